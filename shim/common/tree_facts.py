"""What is fixed about the two kernel trees the carrier wheel holds: one home for the runtime and the tools.

`shim/common/tree.py` (which directory a process loads, the import guard) and `tools/drop` (fetch, audit, layering)
both read these facts from here; the arrows allow it (tools import shim, never the reverse). Plain data, standard
library only, no kernel import: importing it costs nothing and works on any machine.

What is not here on purpose: the pinned version, wheel hash and sub-tree path (`third_party/cutedsl_megamoe/
workspace.bzl`, rewritten by `tools/drop bump`; `wheel_prefix` below is only the default where the tool looks first),
and the files of a tree (its manifest).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, FrozenSet, Tuple

__all__ = ["CARRIER", "TreeFacts", "TREES", "KERNEL_NAMES", "DROP_PACKAGES"]

# The package that carries the drops (its name only: pip resolves it with its own index configuration).
CARRIER = "flashinfer-python"


@dataclass(frozen=True)
class TreeFacts:
    arch: str  # "sm90" | "sm100": also the shim package (shim/<arch>) and the manifest's name (<arch>.manifest.json)
    wheel_prefix: str  # default path inside the wheel of the tree's import root (its src/), ending with "/"
    packages: Tuple[str, ...]  # top-level packages the shim expects (a drop may have fewer: see the audit)
    marker: str  # a package only this tree has: a directory holding it is this tree's root
    env_var: str  # outside Bazel: path to the tree's src/ root
    repo_name: str  # the Bazel external repository that serves the tree
    pin_prefix: str  # the constants' prefix in workspace.bzl: <pin_prefix>_VERSION / _SHA256 / _STRIP_PREFIX
    cute_arch: str  # CUTE_DSL_ARCH for a compile without a GPU

    @property
    def shim_dir(self) -> str:
        return f"shim/{self.arch}"


TREES: Dict[str, TreeFacts] = {
    "sm90": TreeFacts(
        arch="sm90",
        wheel_prefix="flashinfer/moe_ep/kernel_src/sm90/pull_style_cutedsl_megakernel/src/",
        # moe_hopper_bf16 arrives with 0.7.4.
        packages=("common", "src", "moe_hopper_fp8", "moe_hopper_bf16", "moe_nvfp4_swapab"),
        marker="moe_hopper_fp8",
        env_var="MOE_EP_SM90_TREE",
        repo_name="cutedsl_megamoe_sm90",
        pin_prefix="SM90",
        cute_arch="sm_90a",
    ),
    "sm100": TreeFacts(
        arch="sm100",
        wheel_prefix="flashinfer/moe_ep/kernel_src/sm100/cutedsl_megamoe/src/",
        packages=("common", "src", "moe_bf16_glu", "moe_mxfp8_glu", "moe_mxfp8_bf16_glu", "moe_nvfp4_swapab"),
        marker="moe_mxfp8_glu",
        env_var="MOE_EP_SM100_TREE",
        repo_name="cutedsl_megamoe_sm100",
        pin_prefix="SM100",
        cute_arch="sm_100a",
    ),
}

# Every top-level name either tree defines: an import under one of these is a kernel import. Both trees share
# `common`, `src` and `moe_nvfp4_swapab`, which is why one process can hold only one tree.
KERNEL_NAMES: FrozenSet[str] = frozenset(n for t in TREES.values() for n in t.packages)
# The names only the drops use (not the generic `common` / `src`): a directory holding one is a kernel tree, and a
# dotted module name with one of them in it is kernel code, whatever package it sits in.
DROP_PACKAGES: FrozenSet[str] = KERNEL_NAMES - {"common", "src"}

