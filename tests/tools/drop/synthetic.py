"""Small synthetic kernel drops, shims and registries, written into temp dirs by the tests.

The baseline mimics the shape of a Hopper tree (package names, an FP8 kernel class whose
__init__ forwards to a base class that validates some knobs, a BF16 kernel package, heuristic
tables built through a factory function, a @jit-style __call__) with none of its code. The
synthetic shim has the shape the audit must handle without knowing file names: two backends in
one module, one frontend module per format over a shared frontend, a format-guarded heuristic,
launch arguments collected in the tree-agnostic shim/common/, a registry naming the backends by
lazy strings. Each test derives a "new drop" by editing one file of a copy, so every difference
the audit reports is one the test made.
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


        def select_heuristic_config(tokens) -> TileConfig:
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
            def __call__(self, activation, activation_sf, topk_idx, topk_weights, output, stream):
                pass


        class Sm90MegaMoESwapABFp8Kernel(Sm90MegaMoEFp8Kernel):
            pass


        raise ImportError("the audit reads the drop as source; it must never import it")
        """
    ),
    "moe_hopper_bf16/__init__.py": "",
    "moe_hopper_bf16/heuristic_config.py": textwrap.dedent(
        """
        from dataclasses import dataclass
        from typing import Tuple


        @dataclass(frozen=True)
        class Bf16Config:
            mma_tiler_mnk: Tuple[int, int, int] = (64, 128, 64)


        def select_heuristic_config(tokens):
            return Bf16Config()
        """
    ),
    "moe_hopper_bf16/megamoe_kernel_bf16.py": textwrap.dedent(
        """
        from typing import Literal, Optional

        import cutlass.cute as cute


        class Sm90MegaMoEBf16Kernel:
            def __init__(
                self,
                mma_tiler_mnk,
                cluster_shape_mnk,
                group_hint: Optional[int] = None,
                *,
                world_size: int,
                hidden: int,
                token_back_mode: Literal["epi_warps", "standalone_warps"] = "epi_warps",
            ):
                self.world_size = world_size

            @cute.jit
            def __call__(self, activation, topk_idx, topk_weights, output, stream):
                pass


        raise ImportError("the audit reads the drop as source; it must never import it")
        """
    ),
    "moe_nvfp4_swapab/__init__.py": "",
    "moe_nvfp4_swapab/topk_reduce.py": "def topk_reduce(x):\n    return x\n",
}

# ---- the synthetic shim --------------------------------------------------------------------------

NEVER_IMPORT = '\nraise ImportError("the audit reads the shim as source; it must never import it")\n'

KERNEL_SYMBOLS = textwrap.dedent(
    '''
    """Synthetic single re-export module (mirrors the real shim's convention)."""
    from moe_hopper_fp8.heuristic_config import TABLE, select_heuristic_config
    from common.megamoe_constants import SfPaddingBlock

    _LAZY = {
        "Sm90MegaMoEFp8Kernel": ("moe_hopper_fp8.megamoe_kernel_fp8", "Sm90MegaMoEFp8Kernel"),
        "SwapAB": ("moe_hopper_fp8.megamoe_kernel_fp8", "Sm90MegaMoESwapABFp8Kernel"),
        "Sm90MegaMoEBf16Kernel": ("moe_hopper_bf16.megamoe_kernel_bf16", "Sm90MegaMoEBf16Kernel"),
        "select_bf16_config": ("moe_hopper_bf16.heuristic_config", "select_heuristic_config"),
        "SymBufferHost": ("src.sym_buffer", "SymBufferHost"),
        "topk_reduce": ("moe_nvfp4_swapab.topk_reduce", "topk_reduce"),
        "Helper": ("shim.sm90.helpers", "Helper"),
    }


    def __getattr__(name):
        import importlib
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    '''
) + NEVER_IMPORT

# Every value here is decided by the synthetic drop (Literal, a membership
# check, or a heuristic table), so the baseline self-audit has no "unchecked".
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
        "Sm90MegaMoEBf16Kernel": {
            "mma_tiler_mnk": [(64, 128, 64)],
            "token_back_mode": ["epi_warps", "standalone_warps"],
        },
    }


    def heuristic(fmt, tokens):
        from shim.sm90 import kernel_symbols as ks

        if fmt == "bf16":
            return ks.select_bf16_config(tokens)
        config = ks.select_heuristic_config(tokens)
        return config.mma_tiler_mnk, config.cluster_shape_mnk
    """
)

COMMON_FRONTEND = textwrap.dedent(
    """
    class Frontend:
        def symbols(self):
            raise NotImplementedError

        def launch(self, x, out):
            args = self.activation_args(x)
            args.update(topk_idx=self.topk_idx, topk_weights=self.topk_weights)
            args.update(output=out, stream=None)
            self.mapper = self.symbols().SymBufferHost(world_size=self.world_size)
            self.symbols().topk_reduce(out)
            return self.kernel(**args)
    """
) + NEVER_IMPORT

SM90_FRONTEND = textwrap.dedent(
    """
    from shim.common.frontend import Frontend
    from shim.sm90.knobs import heuristic


    class Sm90Frontend(Frontend):
        def symbols(self):
            from shim.sm90 import kernel_symbols

            return kernel_symbols

        def knobs(self):
            return heuristic(self.fmt, self.capacity)

        def build_kernel(self, knobs):
            plain, swap = self.kernel_classes()
            return (swap if knobs.swap_ab else plain)(
                mma_tiler_mnk=knobs.tile,
                cluster_shape_mnk=knobs.cluster,
                group_hint=knobs.group_hint,
                world_size=self.world_size,
                hidden=self.hidden,
                token_back_mode=knobs.token_back_mode,
                **self.format_kwargs(knobs),
            )

        def format_kwargs(self, knobs):
            return {}
    """
) + NEVER_IMPORT

FP8_FRONTEND = textwrap.dedent(
    """
    from shim.sm90.frontend import Sm90Frontend


    class Sm90Fp8Frontend(Sm90Frontend):
        fmt = "fp8_block"

        def kernel_classes(self):
            ks = self.symbols()
            return ks.Sm90MegaMoEFp8Kernel, ks.SwapAB

        def format_kwargs(self, knobs):
            return dict(load_balance_mode="static", fp8_accum_mode=knobs.accum_mode, dedup_dispatch=False,
                        fc1_store_offload=True)

        def activation_args(self, x):
            return dict(activation=x, activation_sf=self.scales)
    """
) + NEVER_IMPORT

BF16_FRONTEND = textwrap.dedent(
    """
    from shim.sm90.frontend import Sm90Frontend


    class Sm90Bf16Frontend(Sm90Frontend):
        fmt = "bf16"

        def kernel_classes(self):
            ks = self.symbols()
            return ks.Sm90MegaMoEBf16Kernel, ks.Sm90MegaMoEBf16Kernel

        def activation_args(self, x):
            return dict(activation=x)
    """
) + NEVER_IMPORT

BACKENDS = textwrap.dedent(
    """
    from shim.sm90.bf16_frontend import Sm90Bf16Frontend
    from shim.sm90.fp8_frontend import Sm90Fp8Frontend


    class Sm90Fp8Backend:
        def make_frontend(self):
            return Sm90Fp8Frontend()


    class Sm90Bf16Backend:
        def make_frontend(self):
            return Sm90Bf16Frontend()
    """
) + NEVER_IMPORT

REGISTRY = textwrap.dedent(
    """
    def _register_builtin():
        register_backend("torch_reference", "moe_ep.reference.backend:TorchReferenceBackend", arch="cpu",
                         formats=("bf16", "fp8_block"))
        register_backend("sm90_fp8", "shim.sm90.backend:Sm90Fp8Backend", arch="sm90", formats=("fp8_block",))
        register_backend("sm90_bf16", "shim.sm90.backend:Sm90Bf16Backend", arch="sm90", formats=("bf16",))


    _register_builtin()
    """
) + NEVER_IMPORT

SHIM_FILES: Dict[str, str] = {
    "shim/__init__.py": "",
    "shim/common/__init__.py": "",
    "shim/common/frontend.py": COMMON_FRONTEND,
    "shim/sm90/__init__.py": "",
    "shim/sm90/kernel_symbols.py": KERNEL_SYMBOLS,
    "shim/sm90/knobs.py": KNOBS,
    "shim/sm90/helpers.py": "class Helper:\n    pass\n",
    "shim/sm90/frontend.py": SM90_FRONTEND,
    "shim/sm90/fp8_frontend.py": FP8_FRONTEND,
    "shim/sm90/bf16_frontend.py": BF16_FRONTEND,
    "shim/sm90/backend.py": BACKENDS,
    "moe_ep/__init__.py": "",
    "moe_ep/core/__init__.py": "",
    "moe_ep/core/registry.py": REGISTRY,
}

WHEEL_PREFIX_SM90 = "flashinfer/moe_ep/kernel_src/sm90/pull_style_cutedsl_megakernel/src"

WORKSPACE_BZL = textwrap.dedent(
    '''
    """Synthetic pins."""
    SM90_VERSION = "{v90}"
    SM90_SHA256 = "{s90}"

    SM100_VERSION = "{v100}"
    SM100_SHA256 = "{s100}"

    SM90_STRIP_PREFIX = "flashinfer/moe_ep/kernel_src/sm90/pull_style_cutedsl_megakernel/src"
    SM100_STRIP_PREFIX = "flashinfer/moe_ep/kernel_src/sm100/cutedsl_megamoe/src"
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
    """The synthetic shim and the registry that names its backends."""
    return write_tree(Path(repo), SHIM_FILES)


def make_wheel(path: Path, prefix: str, files: Dict[str, str], extra: Dict[str, str] = None) -> Path:
    """A carrier-shaped wheel: the tree's files (text or bytes) under `prefix`, plus unrelated files (`extra`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    prefix = prefix.rstrip("/") + "/"
    entries = {"flashinfer/__init__.py": ""}
    entries.update(extra or {})
    entries.update({prefix + rel: text for rel, text in files.items()})
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in sorted(entries):  # fixed order and time stamps: the same files give the same sha256
            data = entries[name]
            zf.writestr(zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0)),
                        data.encode("utf-8") if isinstance(data, str) else data)
    return path


def tree_files(root: Path) -> Dict[str, bytes]:
    """Every file of an extracted tree (symlinks followed; byte-code caches and the repository rule's files left
    out), for a wheel made from it."""
    root = Path(root)
    skip = {"BUILD.bazel", "WORKSPACE", "carrier.json", "pinned.manifest.json"}
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts and not p.name.endswith((".pyc", ".pyo"))
            and p.relative_to(root).as_posix() not in skip}


def snapshot(root: Path) -> Dict[str, bytes]:
    """Every file under root (what a failed or breaking bump must leave as it was)."""
    root = Path(root)
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ---- drops derived from a drop (deterministic: the same input gives the same bytes) --------------------


def older(files: Dict[str, str]) -> Dict[str, str]:
    """The same tree one version earlier: every file at its path, none byte-identical."""
    return {rel: text + "# an earlier revision\n" for rel, text in files.items()}


def sibling_fork(files: Dict[str, str], drop_package: str = "moe_hopper_bf16") -> Dict[str, str]:
    """A tree forked from `files` for another GPU, as a wheel carries next to it (0.7.0.post1's sm120 tree beside
    sm100): most files byte-identical, one package gone, a package of its own."""
    out = {rel: text for rel, text in files.items() if not rel.startswith(drop_package + "/")}
    out.update({"moe_fork_swapab/__init__.py": ""})
    out.update({f"moe_fork_swapab/kernel_{i}.py": f"K = {i}\n" for i in range(4)})
    return out


# ---- drops derived from the pinned Hopper tree (0.7.4), the way a kernel team's next drop would differ ---------
#
# Each is a list of (file, text, replacement, count): the text must occur exactly `count` times, so an edit that no
# longer applies to the pinned tree fails loudly instead of producing the pinned tree again. The copies are made in
# a test's temporary directory; the pinned tree itself is only read.

HEURISTIC = "moe_hopper_fp8/heuristic_config.py"
FP8_KERNEL = "moe_hopper_fp8/megamoe_kernel_fp8.py"
MXFP4 = "moe_hopper_fp8/mxfp4_cutedsl.py"

HOPPER_EDITS = {
    # select_heuristic_config grows a required parameter: every FP8 layer fails with a TypeError.
    "heuristic_needs_num_ranks": [
        (HEURISTIC, "    scale_mode: str, tokens_per_rank: int\n) -> HopperFp8ConfigSelection:",
         "    scale_mode: str, tokens_per_rank: int, num_ranks: int\n) -> HopperFp8ConfigSelection:", 1),
    ],
    # The config object's `pingpong` field is renamed (the drop's own uses follow): AttributeError in the shim.
    "config_field_renamed": [
        (HEURISTIC, "    swap_ab: bool\n    pingpong: bool\n", "    swap_ab: bool\n    ping_pong: bool\n", 1),
        (HEURISTIC, "        pingpong=pingpong,\n", "        ping_pong=pingpong,\n", 1),
        (HEURISTIC, "                pingpong=resolved_pingpong,\n", "                ping_pong=resolved_pingpong,\n", 1),
    ],
    # The blockwise 16-token bucket (capacities 9-16) picks a tile the shim's knob space does not offer.
    "table_entry_outside_knob_space": [
        (HEURISTIC, "16: _config(swap_ab=True, pingpong=False, tile=(256, 16, 128), cga=(1, 1, 1),",
         "16: _config(swap_ab=True, pingpong=False, tile=(256, 48, 128), cga=(1, 1, 1),", 1),
    ],
    # The launch takes a new required tensor (as upstream's fc1_c did): the shim does not pass it, the compile fails.
    "launch_parameter_inserted": [
        (FP8_KERNEL, "        topk_weights: cute.Tensor,         # (T, num_topk) Float32\n",
         "        topk_weights: cute.Tensor,         # (T, num_topk) Float32\n        routing_bias: cute.Tensor,\n", 1),
    ],
    # The FP8 kernels' own gate/up interleave moves to 16 while the shared constant the shim reads stays 8 (the W4A8
    # kernel inherits it): FC1's rows would be paired wrongly on every FP8 and W4A8 layer, and everything compiles.
    "interleave_in_kernel_class": [
        ("moe_hopper_fp8/kernel_fp8_glu_fc12.py", "    GateUpInterleave: int = Fp8GateUpInterleave\n",
         "    GateUpInterleave: int = 16\n", 1),
        ("moe_hopper_fp8/kernel_fp8_glu_fc12_swapab.py", "    GateUpInterleave: int = Fp8GateUpInterleave\n",
         "    GateUpInterleave: int = 16\n", 1),
    ],
    # The W4A8 converter's exponent window one binade up: its four lookup constants, nothing else; every weight
    # doubles, and the compiled kernel differs from 0.7.4 only in those constants.
    "mxfp4_window_one_binade_up": [
        (MXFP4, ", 0x08080800, 0x0c080000;", ", 0x08080800, 0x14100800;", 2),
        (MXFP4, ", 0x08080808, 0x1c181410;", ", 0x08080808, 0x24201c18;", 2),
    ],
    # A new constructor parameter with a default that changes what the kernel computes (a SwiGLU clamp at 7.0 while
    # the layer's spec says none): it compiles, and it binds, so only a policy on unpassed parameters catches it.
    "swiglu_limit_default": [
        (FP8_KERNEL, "        tail_split_pairs: bool = False,\n    ) -> None:\n",
         "        tail_split_pairs: bool = False,\n        swiglu_limit: Optional[float] = 7.0,\n    ) -> None:\n", 1),
    ],
    # A comment: new bytes, nothing else.
    "comment_only": [
        (HEURISTIC, '"""Token-bucket launch heuristics for Hopper FP8 MegaMoE.',
         '"""Token-bucket launch heuristics for Hopper FP8 MegaMoE (revised).', 1),
    ],
}


def derive_drop(src: Path, dst: Path, edits) -> Path:
    """A copy of the tree at `src` (symlinks followed, byte-code caches left out) with `edits` applied."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for rel, text, replacement, count in edits:
        path = Path(dst) / rel
        body = path.read_text(encoding="utf-8")
        found = body.count(text)
        assert found == count, f"{rel}: expected {count} occurrence(s) of {text!r}, found {found}"
        path.write_text(body.replace(text, replacement), encoding="utf-8")
    return Path(dst)
