"""Small synthetic kernel drops and shims, written into temp dirs by the tests.

The baseline mimics the shape of a Hopper tree (package names, a kernel class
whose __init__ forwards to a base class that validates some knobs, a heuristic
table built through a factory function, a @jit-style __call__) with none of its
code. Each test derives a "new drop" by editing one file of a copy, so every
difference the audit reports is one the test made.
"""

from __future__ import annotations

import shutil
import textwrap
import zipfile
from pathlib import Path
from typing import Dict

BASE_DROP: Dict[str, str] = {
    "common/__init__.py": '"""Shared constants."""\n',
    "common/megamoe_constants.py": "SfPaddingBlock = 128\nFp8BlockScaleK = 128\n",
    "src/__init__.py": "",
    "src/sym_buffer.py": textwrap.dedent(
        """
        class SymBufferHost:
            def __init__(self, world_size):
                self.world_size = world_size
        """
    ),
    "moe_hopper_fp8/__init__.py": "",
    "moe_hopper_fp8/heuristic_config.py": textwrap.dedent(
        """
        from dataclasses import dataclass
        from typing import Optional, Tuple

        DEFAULT_MMA_TILER_MNK = (64, 128, 128)


        @dataclass(frozen=True)
        class TileConfig:
            mma_tiler_mnk: Tuple[int, int, int]
            cluster_shape_mnk: Tuple[int, int, int]
            group_hint: Optional[int] = None


        def _cfg(*, tile, cga, group_hint=None):
            return TileConfig(mma_tiler_mnk=tile, cluster_shape_mnk=cga, group_hint=group_hint)


        TABLE = {
            8: _cfg(tile=(128, 16, 128), cga=(1, 2, 1), group_hint=264),
            4096: _cfg(tile=(128, 128, 128), cga=(2, 1, 1)),
        }


        def select_heuristic_config(tokens):
            return TABLE[8 if tokens <= 8 else 4096]
        """
    ),
    "moe_hopper_fp8/base_kernel.py": textwrap.dedent(
        """
        from typing import Literal


        class BaseGemm:
            def __init__(self, mma_tiler_mnk, cluster_shape_mnk, group_hint,
                         load_balance_mode: Literal["static", "atomic_counter"] = "static",
                         accum_mode="1xacc"):
                if accum_mode not in ("1xacc", "2xacc"):
                    raise ValueError(accum_mode)
                self.tile = mma_tiler_mnk
        """
    ),
    "moe_hopper_fp8/megamoe_kernel_fp8.py": textwrap.dedent(
        """
        from typing import Literal, Optional

        import cutlass.cute as cute

        from .base_kernel import BaseGemm


        class Sm90MegaMoEFp8Kernel(BaseGemm):
            def __init__(
                self,
                mma_tiler_mnk,
                cluster_shape_mnk,
                group_hint: Optional[int] = None,
                load_balance_mode: str = "static",
                fp8_accum_mode: str = "1xacc",
                *,
                world_size: int,
                hidden: int,
                token_back_mode: Literal["epi_warps", "standalone_warps"] = "epi_warps",
                dedup_dispatch: bool = False,
                fc1_store_offload: bool = True,
            ):
                super().__init__(
                    mma_tiler_mnk=mma_tiler_mnk,
                    cluster_shape_mnk=cluster_shape_mnk,
                    group_hint=group_hint,
                    load_balance_mode=load_balance_mode,
                    accum_mode=fp8_accum_mode,
                )
                self.world_size = world_size

            @cute.jit
            def __call__(self, activation, topk_idx, topk_weights, output, stream):
                pass


        class Sm90MegaMoESwapABFp8Kernel(Sm90MegaMoEFp8Kernel):
            pass


        raise ImportError("the audit reads the drop as source; it must never import it")
        """
    ),
    "moe_nvfp4_swapab/__init__.py": "",
    "moe_nvfp4_swapab/topk_reduce.py": "def topk_reduce(x):\n    return x\n",
}

KERNEL_SYMBOLS = textwrap.dedent(
    '''
    """Synthetic single re-export module (mirrors the real shim's convention)."""
    from moe_hopper_fp8.heuristic_config import TABLE, select_heuristic_config
    from common.megamoe_constants import SfPaddingBlock

    _LAZY = {
        "Sm90MegaMoEFp8Kernel": ("moe_hopper_fp8.megamoe_kernel_fp8", "Sm90MegaMoEFp8Kernel"),
        "SwapAB": ("moe_hopper_fp8.megamoe_kernel_fp8", "Sm90MegaMoESwapABFp8Kernel"),
        "SymBufferHost": ("src.sym_buffer", "SymBufferHost"),
        "topk_reduce": ("moe_nvfp4_swapab.topk_reduce", "topk_reduce"),
        "Helper": ("shim.sm90.helpers", "Helper"),
    }


    def __getattr__(name):
        import importlib
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)


    raise ImportError("the audit reads the shim as source; it must never import it")
    '''
)

# Every value here is decided by the synthetic drop (Literal, a membership
# check, or the heuristic table), so the baseline self-audit has no "unchecked".
KNOBS = textwrap.dedent(
    """
    KNOB_SPACE = {
        "Sm90MegaMoEFp8Kernel": {
            "mma_tiler_mnk": [(128, 16, 128), (128, 128, 128), (64, 128, 128)],
            "cluster_shape_mnk": [(1, 2, 1), (2, 1, 1)],
            "group_hint": [None, 264],
            "load_balance_mode": ["static"],
            "fp8_accum_mode": ["1xacc", "2xacc"],
            "token_back_mode": ["epi_warps", "standalone_warps"],
        },
    }
    """
)

WORKSPACE_BZL = textwrap.dedent(
    '''
    """Synthetic pins."""
    SM90_VERSION = "{v90}"
    SM90_SHA256 = "{s90}"

    SM100_VERSION = "{v100}"
    SM100_SHA256 = "{s100}"
    '''
)


def write_tree(root: Path, files: Dict[str, str]) -> Path:
    root = Path(root)
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return root


def make_drop(root: Path) -> Path:
    return write_tree(root, BASE_DROP)


def copy_drop(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return Path(dst)


def edit(root: Path, rel: str, old: str, new: str) -> None:
    path = Path(root) / rel
    text = path.read_text(encoding="utf-8")
    assert old in text, f"{old!r} not in {rel}"
    path.write_text(text.replace(old, new), encoding="utf-8")


def make_shim(repo: Path) -> Path:
    repo = Path(repo)
    write_tree(
        repo,
        {
            "shim/__init__.py": "",
            "shim/common/__init__.py": "",
            "shim/sm90/__init__.py": "",
            "shim/sm90/kernel_symbols.py": KERNEL_SYMBOLS,
            "shim/sm90/knobs.py": KNOBS,
            "shim/sm90/helpers.py": "class Helper:\n    pass\n",
        },
    )
    return repo


def make_wheel(path: Path, prefix: str, files: Dict[str, str]) -> Path:
    """A carrier-shaped wheel: the tree's files under `prefix`, plus an unrelated file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("flashinfer/__init__.py", "")
        for rel, text in files.items():
            zf.writestr(prefix + rel, text)
    return path
