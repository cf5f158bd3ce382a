"""The two kernel trees carried by the wheel, and where this tool finds things.

Facts only: the wheel sub-path of each tree, the Bazel repository that serves
it, the environment variable that points at it outside Bazel, and the package
names we expect (defaults; the real list is always derived from the tree).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Dict, FrozenSet, Optional

__all__ = ["Tree", "TREES", "KERNEL_TOP_LEVEL", "find_repo_root", "runfiles_tree_root", "package_dirs"]

CARRIER = "flashinfer-python"


@dataclasses.dataclass(frozen=True)
class Tree:
    name: str  # "sm90" | "sm100"
    wheel_prefix: str  # path inside the wheel of the tree's import root (ends with "/")
    default_packages: FrozenSet[str]
    bazel_repo: str
    env_var: str
    pin_prefix: str  # constant prefix in workspace.bzl: SM90_VERSION / SM90_SHA256

    @property
    def shim_dir(self) -> str:
        return f"shim/{self.name}"


TREES: Dict[str, Tree] = {
    "sm90": Tree(
        name="sm90",
        wheel_prefix="flashinfer/moe_ep/kernel_src/sm90/pull_style_cutedsl_megakernel/src/",
        # moe_hopper_bf16 arrives with 0.7.4; listing it here only widens the
        # layering check, the audit always reads the real list from the tree.
        default_packages=frozenset({"common", "src", "moe_hopper_fp8", "moe_nvfp4_swapab", "moe_hopper_bf16"}),
        bazel_repo="cutedsl_megamoe_sm90",
        env_var="MOE_EP_SM90_TREE",
        pin_prefix="SM90",
    ),
    "sm100": Tree(
        name="sm100",
        wheel_prefix="flashinfer/moe_ep/kernel_src/sm100/cutedsl_megamoe/src/",
        default_packages=frozenset(
            {"common", "src", "moe_bf16_glu", "moe_mxfp8_glu", "moe_mxfp8_bf16_glu", "moe_nvfp4_swapab"}
        ),
        bazel_repo="cutedsl_megamoe_sm100",
        env_var="MOE_EP_SM100_TREE",
        pin_prefix="SM100",
    ),
}

# Every top-level name either tree may define. Both trees share `common`, `src`
# and `moe_nvfp4_swapab`, which is why one process can hold only one tree.
KERNEL_TOP_LEVEL: FrozenSet[str] = frozenset().union(*(t.default_packages for t in TREES.values()))


def package_dirs(tree_root: Path) -> Dict[str, Path]:
    """Top-level kernel packages of an extracted tree: dirs holding __init__.py or .py files."""
    out = {}
    for child in sorted(Path(tree_root).iterdir()):
        if child.is_dir() and not child.name.startswith(".") and child.name != "__pycache__":
            if (child / "__init__.py").is_file() or any(child.glob("*.py")):
                out[child.name] = child
    return out


def find_repo_root(start: Optional[Path] = None) -> Path:
    """The megamoe-ep checkout to read and rewrite.

    `bazel run` starts the tool inside its runfiles tree and names the real
    checkout in BUILD_WORKSPACE_DIRECTORY; otherwise walk up from `start` (or
    the cwd, then this file) to the directory holding WORKSPACE or .git.
    """
    env = os.environ.get("BUILD_WORKSPACE_DIRECTORY")
    if env:
        return Path(env)
    candidates = [Path(start) if start else Path.cwd(), Path(__file__).resolve().parent]
    for base in candidates:
        for d in [base, *base.parents]:
            if (d / "tools" / "drop").is_dir() and ((d / "WORKSPACE").exists() or (d / ".git").exists()):
                return d
    # Last resort: this file lives at <root>/tools/drop/trees.py.
    return Path(__file__).resolve().parents[2]


def runfiles_tree_root(tree: Tree) -> Optional[Path]:
    """The pinned tree as a Bazel external repo in this process's runfiles, if any."""
    roots = [Path(os.environ[var]) for var in ("RUNFILES_DIR", "TEST_SRCDIR") if os.environ.get(var)]
    # Not resolved: the runfiles tree is made of symlinks, and resolving would
    # leave it for the source checkout.
    roots += [parent for parent in Path(__file__).absolute().parents if parent.name.endswith(".runfiles")]
    for root in roots:
        candidate = root / tree.bazel_repo
        if candidate.is_dir() and package_dirs(candidate):
            return candidate
    return None
