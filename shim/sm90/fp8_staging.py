"""Stages bf16 activations as the FP8 kernel reads them: e4m3 values + one fp32 scale per 1x128 block.

Bit-identical to moe_ep.reference.quant.fp8_quantize_rows(x, 128): scale = max(amax / 448, 1e-30) and
q = e4m3(clamp(x / scale, +-448)), IEEE division, round-to-nearest-even. The torch version makes six passes
over fp32 copies of x (490 us of a 4.3 ms forward at T=4096, H=7168 on the H200: profile in
benchmarks/h200/profile_0.7.4); where Triton is importable (the CUDA builds of torch bring it) one fused
kernel reads x once and writes q and the scales straight into the kernel's symmetric buffers.
"""

from __future__ import annotations

import torch

from moe_ep.reference import quant

__all__ = ["stage_fp8_rows", "triton_available"]

BLOCK = quant.FP8_ACT_BLOCK_K
_kernel = None


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "use the torch path"
        return False
    return True


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def quant_rows(x_ptr, q_ptr, s_ptr, x_stride, q_stride, s_stride, BLOCK_K: tl.constexpr,
                   NBLK: tl.constexpr):
        row = tl.program_id(0)
        blk = tl.program_id(1)
        offs = blk * BLOCK_K + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * x_stride + offs).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=0)
        scale = tl.maximum(tl.math.div_rn(amax, 448.0), 1.0e-30)
        q = tl.math.div_rn(x, scale)
        q = tl.minimum(tl.maximum(q, -448.0), 448.0)
        tl.store(q_ptr + row * q_stride + offs, q.to(tl.float8e4nv, fp_downcast_rounding="rtne"))
        tl.store(s_ptr + row * s_stride + blk, scale)

    return quant_rows


def stage_fp8_rows(x: torch.Tensor, q_out: torch.Tensor, scale_out: torch.Tensor, use_triton: bool = True) -> None:
    """x [T, H] bf16 -> q_out[:T] (e4m3 [T, H]) and scale_out[:T, :H/128] (fp32), in place."""
    global _kernel
    t, h = x.shape
    if t == 0:
        return
    if use_triton and x.is_cuda and triton_available():
        if _kernel is None:
            _kernel = _build()
        _kernel[(t, h // BLOCK)](x, q_out, scale_out, x.stride(0), q_out.stride(0), scale_out.stride(0),
                                  BLOCK_K=BLOCK, NBLK=h // BLOCK)
        return
    q, s = quant.fp8_quantize_rows(x, BLOCK, reciprocal=False)
    q_out[:t].view(torch.uint8).copy_(q.view(torch.uint8))
    scale_out[:t, : h // BLOCK].copy_(s)
