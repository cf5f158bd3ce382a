"""The one place the sm100 shim names raw symbols of the Blackwell kernel tree.

A renamed or moved symbol in a new drop breaks here, and `tools/drop audit` reads
this file (by AST) to check every row against the drop before anyone compiles.
Every module of the sm100 tree the shim uses imports cutlass (even
`common.megamoe_constants` builds cutlass scalars), so there is no eager section:
all names resolve on first attribute access (PEP 562), and importing this module
costs only the tree bootstrap and its guard against the Hopper tree.

Runner modules (`*/mega_runner.py`, `*/runner_fc12*.py`) are never named here:
they import the kernel team's `tester` package, which is not in the drop.
`moe_nvfp4_swapab.runner_common` is a host-helper module (torch only); its layout
helpers are exported so tests can check the shim's layouts (scale swizzle, e2m1 nibble order, gate/up
pairing) against them.
"""

from shim.common import tree as _tree
from shim.common.lazy import lazy_attributes

_tree.activate("sm100")

# Lazy: name -> (module, attribute). Keep this a plain dict literal: the drop
# audit parses it.
_LAZY = {
    # Kernels (one per data format) and the pieces of their launch contract.
    "Sm100MegaMoEKernel": ("moe_nvfp4_swapab.megamoe_kernel", "Sm100MegaMoEKernel"),
    "Sm100MegaMoEMxfp8Kernel": ("moe_mxfp8_glu.megamoe_kernel_mxfp8", "Sm100MegaMoEMxfp8Kernel"),
    "Sm100MegaMoEBf16Kernel": ("moe_bf16_glu.megamoe_kernel_bf16", "Sm100MegaMoEBf16Kernel"),
    "SymBufferHost": ("src.sym_buffer", "SymBufferHost"),
    "CombineFormat": ("src.token_comm", "CombineFormat"),
    # The NVFP4 kernel's epilogue: gate/up row interleave and token tile (class attributes).
    "SwapABSwigluFp4Epilogue": ("moe_nvfp4_swapab.epilogue_refactor", "SwapABSwigluFp4Epilogue"),
    # Token tile the drop's BF16 runner pads each expert's pool rows to (its MXFP8 runner pads to 128:
    # SfPaddingBlock below).
    "EpilogueTokenTile": ("moe_nvfp4_swapab.epilogue", "EpilogueTokenTile"),
    # Constants. SfPaddingBlock: rows of one 128x4 scale atom.
    "SfPaddingBlock": ("common.megamoe_constants", "SfPaddingBlock"),
    "Nvfp4BlockSize": ("common.megamoe_constants", "Nvfp4BlockSize"),
    "Mxfp8BlockSize": ("common.megamoe_constants", "Mxfp8BlockSize"),
    "Nvfp4E2M1Max": ("common.megamoe_constants", "Nvfp4E2M1Max"),
    "Fp8E4M3FNMax": ("common.megamoe_constants", "Fp8E4M3FNMax"),
    "get_cutedsl_target_arch": ("common.host_utils", "get_cutedsl_target_arch"),
    # Host helpers (torch only), used as independent cross-checks of the shim's own layout code.
    # The MXFP8 quantizer with per-32 scales along each row.
    "mxfp8_quantize_per_block_32_row": ("common.host_utils", "mxfp8_quantize_per_block_32_row"),
    "to_blocked": ("moe_nvfp4_swapab.runner_common", "to_blocked"),
    "from_blocked": ("moe_nvfp4_swapab.runner_common", "from_blocked"),
    "unpack_fp4_to_f32": ("moe_nvfp4_swapab.runner_common", "unpack_fp4_to_f32"),
    "swiglu_fold_interleave": ("moe_nvfp4_swapab.runner_common", "swiglu_fold_interleave"),
}

__all__ = [*_LAZY]


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
