"""The Blackwell kernel variants moe_ep serves, one row each (shim/common/formats.py says what derives from a row).

Adding a format: a row here, its frontend module (shim/sm100/<format>_frontend.py) and the kernel symbols it uses
(shim/sm100/kernel_symbols.py); docs/backends.md walks through it.

Sources of the size rules (the pinned drop; docs/backends.md keeps what was run where):
  * top_k <= 32 (KernelFormat.max_top_k): dispatch assigns `32 // num_topk` tokens per warp pass
    (src/token_comm.py); the BF16 kernel checks it explicitly, the others share the same dispatch code.
  * BF16: gate+up (2I) a multiple of 64 and H a multiple of 32 -- the BF16 kernel's own constructor checks (the
    fc1 store pairs 32 gate with 32 up columns; fc2 stores 32-wide hidden subtiles).
  * NVFP4 / MXFP8: H and I multiples of 64. Each format's block (16 / 32) and the 16-byte TMA row rule need
    less; 64 is the bound FlashInfer's integration of these kernels validates on Blackwell hardware, and nothing
    weaker has been run there, so it is the rule until a Blackwell run says otherwise.
  * MXFP8: H a multiple of 128. Every launch ends with the column re-quantization of the received
    activations (moe_mxfp8_glu/mxfp8_col_requant.py), whose tile spans whole 128-column scale atoms; on sm_100
    it takes its portable path (4 columns a lane, 32 lanes), so H must be a multiple of lcm(128, 128) = 128,
    which its constructor enforces ("hidden=... is not supported").
"""

from shim.common.formats import FormatTable, KernelFormat

__all__ = ["BACKENDS"]

BACKENDS = FormatTable("sm100", cute_targets=("sm_100", "sm_103"), rows=(
    KernelFormat(
        backend="sm100_nvfp4_cutedsl", arch="sm100", fmt="nvfp4",
        description="Blackwell NVFP4 MegaMoE (CuTe DSL)",
        hidden_multiple=64, intermediate_multiple=64,
        kernel_module="moe_nvfp4_swapab.megamoe_kernel",
        kernel_classes=("Sm100MegaMoEKernel",),
        # The NVFP4 constructor spells the in-kernel fc2 reduce differently from the other two.
        reduce_kwarg="in_kernel_fc2_reduce",
        frontend="shim.sm100.nvfp4_frontend:Sm100Nvfp4Frontend",
        target="shim.sm100.backend:Sm100Nvfp4Backend",
    ),
    KernelFormat(
        backend="sm100_mxfp8_cutedsl", arch="sm100", fmt="mxfp8",
        description="Blackwell MXFP8 MegaMoE (CuTe DSL)",
        hidden_multiple=128, intermediate_multiple=64,
        kernel_module="moe_mxfp8_glu.megamoe_kernel_mxfp8",
        kernel_classes=("Sm100MegaMoEMxfp8Kernel",),
        # Sm100MegaMoEMxfp8Kernel.__init__ raises on an in-kernel reduce with a dispatch-warp token-back.
        reduce_token_back="epi_warps",
        frontend="shim.sm100.mxfp8_frontend:Sm100Mxfp8Frontend",
        target="shim.sm100.backend:Sm100Mxfp8Backend",
    ),
    KernelFormat(
        backend="sm100_bf16_cutedsl", arch="sm100", fmt="bf16",
        description="Blackwell BF16 MegaMoE (CuTe DSL)",
        hidden_multiple=32, intermediate_multiple=32,
        kernel_module="moe_bf16_glu.megamoe_kernel_bf16",
        kernel_classes=("Sm100MegaMoEBf16Kernel",),
        # FlashInfer's validity table marks BF16 + in-kernel reduce + epilogue token-back unsupported; not run
        # here either, so refused rather than guessed.
        reduce_token_back="dispatch",
        frontend="shim.sm100.bf16_frontend:Sm100Bf16Frontend",
        target="shim.sm100.backend:Sm100Bf16Backend",
    ),
))
