"""The Hopper kernel variants moe_ep serves, one row each (shim/common/formats.py says what derives from a row).

Adding a format: a row here, its frontend module (shim/sm90/<format>_frontend.py) and the kernel symbols it uses
(shim/sm90/kernel_symbols.py); docs/backends.md walks through it.

Sources of the size rules (drop 0.7.4):
  * FP8 blockwise: H and I multiples of 128 -- the 1x128 activation and 128x128 weight scale blocks
    (common/megamoe_constants.py Fp8BlockScaleK, Fp8WeightScaleBlockN/K); FC1's N = 2I is cut in 128-row blocks
    over the 8-row gate/up interleave, 64 gate + 64 up rows each.
  * BF16: H and I multiples of 64 -- the BF16 kernel's K tile (every tile in its KNOB_SPACE has K = 64).
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
        # moe_hopper_bf16 arrived with drop 0.7.4: on an older tree this row lists as unavailable.
        backend="sm90_bf16_cutedsl", arch="sm90", fmt="bf16",
        description="Hopper BF16 MegaMoE (CuTe DSL)",
        hidden_multiple=64, intermediate_multiple=64,
        kernel_module="moe_hopper_bf16.megamoe_kernel_bf16",
        kernel_classes=("Sm90MegaMoEBf16Kernel", "Sm90MegaMoESwapABBf16Kernel"),
        frontend="shim.sm90.bf16_frontend:Sm90Bf16Frontend",
        target="shim.sm90.backend:Sm90Bf16Backend",
    ),
))
