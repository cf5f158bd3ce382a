"""Puts one kernel tree on sys.path, and refuses to put a second one there.

Both drop trees use the same top-level package names (`common`, `src`,
`moe_nvfp4_swapab`, ...), so a process can hold exactly one of them: importing
`src.token_comm` from the Hopper tree after the Blackwell one was loaded would
silently give the Blackwell module. The guard makes that a loud error instead.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

__all__ = ["TreeSpec", "TREES", "TreeConflictError", "TreeNotFoundError", "activate", "active_tree"]


class TreeConflictError(RuntimeError):
    """A second kernel tree was asked for in a process that already holds one."""


class TreeNotFoundError(RuntimeError):
    """The kernel tree is not on this machine (not built by Bazel, no env var)."""


@dataclass(frozen=True)
class TreeSpec:
    arch: str
    repo_name: str  # Bazel external repository holding the tree
    env_var: str  # outside Bazel: path to the tree's src/ root
    marker: str  # a package only this tree has
    top_level: Tuple[str, ...]


TREES: Dict[str, TreeSpec] = {
    "sm90": TreeSpec(
        arch="sm90",
        repo_name="cutedsl_megamoe_sm90",
        env_var="MOE_EP_SM90_TREE",
        marker="moe_hopper_fp8",
        top_level=("common", "src", "moe_hopper_fp8", "moe_hopper_bf16", "moe_nvfp4_swapab"),
    ),
    "sm100": TreeSpec(
        arch="sm100",
        repo_name="cutedsl_megamoe_sm100",
        env_var="MOE_EP_SM100_TREE",
        marker="moe_mxfp8_glu",
        top_level=(
            "common", "src", "moe_bf16_glu", "moe_mxfp8_glu", "moe_mxfp8_bf16_glu", "moe_nvfp4_swapab",
        ),
    ),
}

_active: Optional[Tuple[str, str]] = None  # (arch, root)


def active_tree() -> Optional[Tuple[str, str]]:
    return _active


def _candidates(spec: TreeSpec):
    env = os.environ.get(spec.env_var)
    if env:
        yield env
    # Under Bazel the py_library's `imports = ["."]` already put the external
    # repository's root on sys.path; runfiles layouts name it by repo.
    for entry in sys.path:
        if os.path.basename(os.path.normpath(entry)) == spec.repo_name:
            yield entry
    for var in ("RUNFILES_DIR", "TEST_SRCDIR"):
        base = os.environ.get(var)
        if base:
            yield os.path.join(base, spec.repo_name)


def locate(arch: str) -> str:
    spec = TREES[arch]
    tried = []
    for cand in _candidates(spec):
        tried.append(cand)
        if os.path.isdir(os.path.join(cand, spec.marker)):
            return os.path.abspath(cand)
    raise TreeNotFoundError(
        f"the {arch} kernel tree was not found (looked in: {tried or 'nothing'}). Under Bazel depend on "
        f"//shim/{arch}; elsewhere set {spec.env_var} to the drop's src/ root."
    )


def _loaded_elsewhere(spec: TreeSpec, root: str):
    """Kernel top-level modules already imported from somewhere other than `root`."""
    bad = []
    for name in spec.top_level + tuple(n for s in TREES.values() for n in s.top_level):
        mod = sys.modules.get(name)
        path = getattr(mod, "__file__", None) or next(iter(getattr(mod, "__path__", []) or []), None)
        if mod is not None and path and not os.path.abspath(path).startswith(root + os.sep):
            bad.append(f"{name} (from {path})")
    return sorted(set(bad))


def activate(arch: str) -> str:
    """Make `arch`'s tree importable by its top-level names; idempotent. Returns its root."""
    global _active
    if arch not in TREES:
        raise ValueError(f"arch must be one of {sorted(TREES)}, got {arch!r}")
    if _active is not None:
        if _active[0] != arch:
            raise TreeConflictError(
                f"this process already holds the {_active[0]} kernel tree ({_active[1]}); the {arch} tree "
                "uses the same top-level package names and cannot be loaded beside it: use a separate process"
            )
        return _active[1]
    spec = TREES[arch]
    root = locate(arch)
    clash = _loaded_elsewhere(spec, root)
    if clash:
        raise TreeConflictError(
            f"cannot load the {arch} kernel tree from {root}: modules with its top-level names are already "
            f"imported from elsewhere: {', '.join(clash)}"
        )
    other_roots = []
    for other in TREES.values():
        if other.arch != arch:
            other_roots += [p for p in sys.path if os.path.basename(os.path.normpath(p)) == other.repo_name]
    if other_roots:
        raise TreeConflictError(
            f"sys.path also holds the other kernel tree ({', '.join(other_roots)}): a target must depend on "
            "one tree only"
        )
    if root not in sys.path:
        sys.path.insert(0, root)
    _active = (arch, root)
    return root
