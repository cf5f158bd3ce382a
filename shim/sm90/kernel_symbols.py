"""The one place the sm90 shim names raw symbols of the Hopper kernel tree.

A renamed or moved symbol in a new drop breaks here, and `tools/drop audit`
reads this file (by AST) to check every row against the drop before anyone
compiles. Light symbols (pure-Python tables) are imported eagerly; anything that
pulls in cutlass is resolved on first attribute access (PEP 562), so importing
this module costs no cutlass import.
"""

from shim.common import tree as _tree
from shim.common.lazy import lazy_attributes

_tree.activate("sm90")

# Eager: stdlib-only modules of the drop.
from moe_hopper_fp8.heuristic_config import (  # noqa: E402
    HEURISTIC_CONFIGS,
    TOKEN_BUCKETS,
    HopperFp8Config,
    select_heuristic_config,
    token_bucket,
)

# Lazy: name -> (module, attribute). Keep this a plain dict literal: the drop
# audit parses it.
_LAZY = {
    # moe_hopper_bf16 is newer than the FP8 package; lazy so the FP8 path also loads a tree without it
    # (side-by-side drop benchmarks run the previous drop through this same shim).
    "select_bf16_heuristic_config": ("moe_hopper_bf16.heuristic_config", "select_heuristic_config"),
    "Sm90MegaMoEFp8Kernel": ("moe_hopper_fp8.megamoe_kernel_fp8", "Sm90MegaMoEFp8Kernel"),
    "Sm90MegaMoESwapABFp8Kernel": ("moe_hopper_fp8.megamoe_kernel_fp8", "Sm90MegaMoESwapABFp8Kernel"),
    "Sm90MegaMoEBf16Kernel": ("moe_hopper_bf16.megamoe_kernel_bf16", "Sm90MegaMoEBf16Kernel"),
    "Sm90MegaMoESwapABBf16Kernel": ("moe_hopper_bf16.megamoe_kernel_bf16", "Sm90MegaMoESwapABBf16Kernel"),
    # W4A8 (MXFP4 weights x FP8 activations, swap-AB only) is newer too: the registry's probe checks the tree has
    # its module before anything resolves this row (shim/common/formats.py missing_kernel).
    "Sm90MegaMoESwapABMxfp4Fp8Kernel": ("moe_hopper_fp8.megamoe_kernel_fp8", "Sm90MegaMoESwapABMxfp4Fp8Kernel"),
    "MXFP4_K_TILE": ("moe_hopper_fp8.mxfp4_cutedsl", "MXFP4_K_TILE"),
    "MXFP4_FOLD_M": ("moe_hopper_fp8.mxfp4_cutedsl", "MXFP4_FOLD_M"),
    "SymBufferHost": ("src.sym_buffer", "SymBufferHost"),
    "SfPaddingBlock": ("common.megamoe_constants", "SfPaddingBlock"),
    "Fp8E8M0SfVecSize": ("common.megamoe_constants", "Fp8E8M0SfVecSize"),
    "Fp8BlockScaleK": ("common.megamoe_constants", "Fp8BlockScaleK"),
    "Fp8Fc2ActivationScaleK": ("common.megamoe_constants", "Fp8Fc2ActivationScaleK"),
    "Fp8WeightScaleBlockN": ("common.megamoe_constants", "Fp8WeightScaleBlockN"),
    "Fp8WeightScaleBlockK": ("common.megamoe_constants", "Fp8WeightScaleBlockK"),
    "Fp8GateUpInterleave": ("common.megamoe_constants", "Fp8GateUpInterleave"),
    # The drop's CPU references (torch only): the drop audit runs them on the layouts this shim prepares
    # (tools/drop/numerics.py); nothing at run time uses them.
    "compute_megamoe_reference_fp8": ("moe_hopper_fp8.mega_reference_fp8", "compute_megamoe_reference_fp8"),
    "compute_megamoe_reference_bf16": ("moe_hopper_bf16.mega_reference_bf16", "compute_megamoe_reference_bf16"),
    "FP8_SCALE_MODE_CHOICES": ("moe_hopper_fp8.hopper_moe_utils", "FP8_SCALE_MODE_CHOICES"),
    "FP8_ACCUM_MODE_CHOICES": ("moe_hopper_fp8.hopper_moe_utils", "FP8_ACCUM_MODE_CHOICES"),
}

__all__ = [
    "HEURISTIC_CONFIGS",
    "TOKEN_BUCKETS",
    "HopperFp8Config",
    "select_heuristic_config",
    "token_bucket",
    *_LAZY,
]


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
