"""The Hopper kernel variants moe_ep serves, one row each (shim/common/formats.py says what derives from a row).

Adding a format: a row here, its frontend module (shim/sm90/<format>_frontend.py) and the kernel symbols it uses
(shim/sm90/kernel_symbols.py); docs/backends.md walks through it.

Sources of the size rules (the pinned drop; docs/backends.md says which drop brought which kernel):
  * FP8 blockwise: H and I multiples of 128 -- the 1x128 activation and 128x128 weight scale blocks
    (common/megamoe_constants.py Fp8BlockScaleK, Fp8WeightScaleBlockN/K); FC1's N = 2I is cut in 128-row blocks
    over the 8-row gate/up interleave, 64 gate + 64 up rows each.
  * FP8 per-tensor: the FP8 kernel's K tile (128) and the 8-row gate/up interleave: the blockwise multiples.
  * W4A8 MXFP4: H and I multiples of 128 -- the kernel refuses a K not divisible by its K tile (128 or 256;
    kernel_mxfp4_fp8_glu_fc12_swapab.py), and the folded weight offsets are cut in 64-row x 128-K blocks.
  * BF16: H and I multiples of 64 -- the BF16 kernel's K tile (every tile in its KNOB_SPACE has K = 64).
(No row for w4a8_nvfp4: the Hopper NVFP4 x FP8 kernel, Sm90MegaMoESwapABNvfp4Fp8Kernel, ships in the carrier wheel's
kernel_src/sm90/pull_style_cutedsl_megakernel/shim/nvfp4_kernels.py, beside the src/ tree moe_ep pins, not in it;
the tree's moe_nvfp4_swapab/ is the Blackwell kernel the Hopper FP8 kernel borrows helpers from. A row for a module
no pinned tree holds would be a permanent break in every drop audit.)
  * top_k <= 32 (KernelFormat.max_top_k): dispatch assigns `32 // num_topk` tokens per warp pass
    (src/token_comm.py), shared by every kernel of the tree.
"""

from shim.common.formats import FormatTable, KernelFormat

__all__ = ["BACKENDS"]

BACKENDS = FormatTable("sm90", cute_targets=("sm_90",), rows=(
    KernelFormat(
        backend="sm90_fp8_cutedsl", arch="sm90", fmt="fp8_block",
        description="Hopper FP8 MegaMoE, blockwise scales (CuTe DSL)",
        hidden_multiple=128, intermediate_multiple=128,
        kernel_module="moe_hopper_fp8.megamoe_kernel_fp8",
        kernel_classes=("Sm90MegaMoEFp8Kernel", "Sm90MegaMoESwapABFp8Kernel"),
        scale_mode="blockwise",
        frontend="shim.sm90.fp8_frontend:Sm90Fp8Frontend",
        target="shim.sm90.backend:Sm90Fp8Backend",
    ),
    KernelFormat(
        # moe_hopper_bf16 is newer than the oldest drop the shim loads: on a tree without it this row lists as
        # unavailable.
        backend="sm90_bf16_cutedsl", arch="sm90", fmt="bf16",
        description="Hopper BF16 MegaMoE (CuTe DSL)",
        hidden_multiple=64, intermediate_multiple=64,
        kernel_module="moe_hopper_bf16.megamoe_kernel_bf16",
        kernel_classes=("Sm90MegaMoEBf16Kernel", "Sm90MegaMoESwapABBf16Kernel"),
        frontend="shim.sm90.bf16_frontend:Sm90Bf16Frontend",
        target="shim.sm90.backend:Sm90Bf16Backend",
    ),
    KernelFormat(
        # The FP8 kernel classes with static per-tensor scales (calibrated activation amax: CalibrationError
        # without it, from the format table of moe_ep.formats).
        backend="sm90_fp8_tensor_cutedsl", arch="sm90", fmt="fp8_tensor",
        description="Hopper FP8 MegaMoE, per-tensor static scales (CuTe DSL)",
        hidden_multiple=128, intermediate_multiple=128,
        kernel_module="moe_hopper_fp8.megamoe_kernel_fp8",
        kernel_classes=("Sm90MegaMoEFp8Kernel", "Sm90MegaMoESwapABFp8Kernel"),
        scale_mode="per_tensor",
        frontend="shim.sm90.fp8_tensor_frontend:Sm90Fp8TensorFrontend",
        target="shim.sm90.backend:Sm90Fp8TensorBackend",
    ),
    KernelFormat(
        # MXFP4 weights x FP8 activations, swap-AB only. Its class sits in megamoe_kernel_fp8.py beside the FP8
        # ones, but it came later, together with its mainloop module: on a tree whose megamoe_kernel_fp8.py lacks
        # it this row lists as unavailable naming that module.
        backend="sm90_w4a8_mxfp4_cutedsl", arch="sm90", fmt="w4a8_mxfp4",
        description="Hopper MXFP4 weights x FP8 activations MegaMoE (CuTe DSL)",
        hidden_multiple=128, intermediate_multiple=128,
        kernel_module="moe_hopper_fp8.megamoe_kernel_fp8",
        kernel_classes=("Sm90MegaMoESwapABMxfp4Fp8Kernel",),
        requires=("moe_hopper_fp8.kernel_mxfp4_fp8_glu_fc12_swapab",),
        scale_mode="mxfp4_hybrid",
        frontend="shim.sm90.w4a8_frontend:Sm90W4A8Frontend",
        target="shim.sm90.backend:Sm90W4A8Mxfp4Backend",
    ),
))
