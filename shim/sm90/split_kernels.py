"""The torch engines' steps around their GEMMs as one Triton kernel each (moe_ep/split/torch_engine.py loads this
module by lazy string, as `kernels="triton"`, the default on a CUDA device where it imports).

  quantize_rows  bf16 [N, H] -> e4m3 and one fp32 scale per row (the rowwise engine's FC1 input): the per-row
                 staging kernel of shim/sm90/fp8_staging.py, byte-exact with moe_ep's quantizer
  swiglu_quant   fc1 bf16 [M, 2I] -> SwiGLU (clamp first), times the row's routing weight, quantized per 1 x block
                 (x * (1 / scale)) into e4m3 [M, I] and fp32 scales placed where the caller says (the block128 engine:
                 each expert block's scales column-major, as cuBLAS reads them; the rowwise engine: one per row)
  combine        per row, its slots' terms (rows of a [P, H] bf16 buffer, -1 for none) summed in fp32 in slot order
                 and rounded once to bf16

The torch ops they replace (moe_ep.split.torch_engine.TorchOps, same signatures) are the definition; each kernel
rounds where those ops round, one operation at a time:
  sigmoid: 1 / (1 + exp(-g)) with libdevice's expf (what torch's CUDA sigmoid calls) and an IEEE division
           (tl.math.div_rn; Triton's `/` on fp32 is an approximation); then gate * sigmoid, then up * that;
  clamp:   min / max that keep NaN, as torch.clamp does;
  scale:   amax by the integer max of |y|'s bit patterns (NaN on top), times fl32(1/448), floored at fl32(1e-30);
           1 / scale by IEEE division, y times that, then the e4m3 encoding of shim/sm90/fp8_staging_kernel.py
           (round to nearest even, saturating at 448, NaN kept);
  combine: bf16 -> fp32 exact, fp32 adds in slot order, one round to nearest even.
No multiply feeds an add, so FMA contraction changes nothing. tools/bench/scaled_mm_probe.py compares both paths'
bytes on the device.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from shim.sm90 import fp8_staging
from shim.sm90.fp8_staging import RCP_E4M3_MAX, SCALE_FLOOR
from shim.sm90.fp8_staging_kernel import encode_e4m3

try:  # where Triton 3.x keeps libdevice (the dispatching module; older releases only the CUDA one)
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - depends on the Triton release
    from triton.language.extra.cuda import libdevice

__all__ = ["name", "unavailable_reason", "quantize_rows", "swiglu_quant", "combine"]

name = "triton"


@functools.lru_cache(maxsize=None)
def unavailable_reason() -> Optional[str]:
    """None where the kernels can run (Triton imported: this module loaded; a CUDA device), else why not."""
    return None if torch.cuda.is_available() else "no CUDA device"


@triton.jit
def _swiglu_quant_kernel(fc1_ptr, w_ptr, q_ptr, s_ptr, sbase_ptr, sstep_ptr, M, NB, stride_f, stride_q, LIMIT,
                         G: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
                         HAS_W: tl.constexpr, HAS_CLAMP: tl.constexpr, ROW_MAJOR_S: tl.constexpr,
                         RCP: tl.constexpr, FLOOR: tl.constexpr):
    """Grid (cdiv(M, BLOCK_M), NB): BLOCK_M rows x one quantization block of BLOCK outputs, in CHUNK columns at a
    time; a first pass takes the block's amax, a second recomputes y (cheaper than keeping it) and encodes it."""
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    r64 = rows.to(tl.int64)
    if HAS_W:
        wv = tl.load(w_ptr + rows, mask=rmask, other=0.0)
    amax_bits = tl.zeros([BLOCK_M], tl.int32)
    for k0 in tl.static_range(0, BLOCK, CHUNK):
        c = b * BLOCK + k0 + tl.arange(0, CHUNK)
        gcol = (c // G) * (2 * G) + (c % G)
        mask = rmask[:, None] & ((k0 + tl.arange(0, CHUNK)) < BLOCK)[None, :]
        base = fc1_ptr + r64[:, None] * stride_f + gcol[None, :]
        g = tl.load(base, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(base + G, mask=mask, other=0.0).to(tl.float32)
        if HAS_CLAMP:
            g = tl.minimum(g, LIMIT, propagate_nan=tl.PropagateNan.ALL)
            u = tl.minimum(tl.maximum(u, -LIMIT, propagate_nan=tl.PropagateNan.ALL), LIMIT,
                           propagate_nan=tl.PropagateNan.ALL)
        sig = tl.math.div_rn(tl.full([BLOCK_M, CHUNK], 1.0, tl.float32), 1.0 + libdevice.exp(-g))
        y = u * (g * sig)
        if HAS_W:
            y = y * wv[:, None]
        mag = y.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        amax_bits = tl.maximum(amax_bits, tl.max(tl.where(mask, mag, 0), axis=1))
    s = amax_bits.to(tl.float32, bitcast=True) * RCP
    s = tl.where(s < FLOOR, FLOOR, s)  # NaN compares false and stays
    inv = tl.math.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), s)
    if ROW_MAJOR_S:
        s_idx = r64 * NB + b
    else:
        s_idx = tl.load(sbase_ptr + rows, mask=rmask, other=0) + b * tl.load(sstep_ptr + rows, mask=rmask, other=0)
    tl.store(s_ptr + s_idx, s, mask=rmask)
    for k0 in tl.static_range(0, BLOCK, CHUNK):
        c = b * BLOCK + k0 + tl.arange(0, CHUNK)
        gcol = (c // G) * (2 * G) + (c % G)
        mask = rmask[:, None] & ((k0 + tl.arange(0, CHUNK)) < BLOCK)[None, :]
        base = fc1_ptr + r64[:, None] * stride_f + gcol[None, :]
        g = tl.load(base, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(base + G, mask=mask, other=0.0).to(tl.float32)
        if HAS_CLAMP:
            g = tl.minimum(g, LIMIT, propagate_nan=tl.PropagateNan.ALL)
            u = tl.minimum(tl.maximum(u, -LIMIT, propagate_nan=tl.PropagateNan.ALL), LIMIT,
                           propagate_nan=tl.PropagateNan.ALL)
        sig = tl.math.div_rn(tl.full([BLOCK_M, CHUNK], 1.0, tl.float32), 1.0 + libdevice.exp(-g))
        y = u * (g * sig)
        if HAS_W:
            y = y * wv[:, None]
        code = encode_e4m3(y * inv[:, None]).to(tl.uint8)
        tl.store(q_ptr + r64[:, None] * stride_q + c[None, :], code, mask=mask)


@triton.jit
def _combine_kernel(terms_ptr, pos_ptr, w_ptr, out_ptr, N, H, stride_t, stride_o,
                    WIDTH: tl.constexpr, HAS_W: tl.constexpr, BLOCK_H: tl.constexpr):
    """Grid (N, cdiv(H, BLOCK_H)): one row, BLOCK_H columns, its WIDTH slots in order."""
    n = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < H
    acc = tl.zeros([BLOCK_H], tl.float32)
    for j in tl.static_range(WIDTH):
        p = tl.load(pos_ptr + n.to(tl.int64) * WIDTH + j)
        ok = p >= 0
        t = tl.load(terms_ptr + tl.maximum(p, 0) * stride_t + cols, mask=cmask & ok, other=0.0)
        if HAS_W:
            wj = tl.load(w_ptr + n.to(tl.int64) * WIDTH + j)
            t = (t.to(tl.float32) * wj).to(tl.bfloat16)
            t = tl.where(ok, t, 0.0)  # a slot with no term adds +0.0, whatever its weight
        if j == 0:
            acc = t.to(tl.float32)  # the first slot as it is (a -0.0 stays -0.0, as in the torch ops)
        else:
            acc = acc + t.to(tl.float32)
    tl.store(out_ptr + n.to(tl.int64) * stride_o + cols, acc.to(tl.bfloat16), mask=cmask)


def _pow2_at_most(x: int, cap: int) -> int:
    p = 1
    while p * 2 <= min(x, cap):
        p *= 2
    return p


def quantize_rows(x: torch.Tensor, q_out: torch.Tensor, s_out: torch.Tensor) -> None:
    """TorchOps.quantize_rows: the Hopper frontend's per-row FP8 staging kernel (byte-exact with the quantizer)."""
    fp8_staging.launch_fused_rows(x, q_out, s_out.view(-1, 1))


def swiglu_quant(fc1: torch.Tensor, gate_group: int, clamp: Optional[float], weight: Optional[torch.Tensor],
                 block: int, q_out: torch.Tensor, s_out: torch.Tensor, s_base: Optional[torch.Tensor] = None,
                 s_step: Optional[torch.Tensor] = None) -> None:
    """moe_ep.split.torch_engine.TorchOps.swiglu_quant in one launch (its docstring says what is computed)."""
    m, two_i = fc1.shape
    i = two_i // 2
    if fc1.dtype != torch.bfloat16 or fc1.stride(1) != 1 or i % gate_group or i % block:
        raise ValueError(f"fc1 must be bf16 [M, 2I] with contiguous rows, I a multiple of gate_group ({gate_group}) "
                         f"and of block ({block}); got {fc1.dtype} {tuple(fc1.shape)} strides {fc1.stride()}")
    if q_out.shape != (m, i) or q_out.stride(1) != 1 or s_out.dtype != torch.float32 or not s_out.is_contiguous():
        raise ValueError(f"q_out must be [{m}, {i}] with contiguous rows and s_out contiguous fp32, got "
                         f"{tuple(q_out.shape)} and {s_out.dtype} {tuple(s_out.shape)}")
    if m == 0:
        return
    nb = i // block
    chunk = _pow2_at_most(block, 512)
    block_m = max(1, 2048 // max(block, chunk)) if block <= 512 else 1
    block_m = _pow2_at_most(block_m, 16)
    q8 = q_out.view(torch.uint8)
    w = weight if weight is not None else s_out  # a valid pointer the kernel never reads
    base = s_base if s_base is not None else s_out
    step = s_step if s_step is not None else s_out
    limit = abs(float(clamp)) if clamp is not None else 0.0
    with torch.cuda.device(fc1.device):
        _swiglu_quant_kernel[(triton.cdiv(m, block_m), nb)](
            fc1, w, q8, s_out, base, step, m, nb, fc1.stride(0), q8.stride(0), limit,
            G=gate_group, BLOCK=block, CHUNK=chunk, BLOCK_M=block_m, HAS_W=weight is not None,
            HAS_CLAMP=clamp is not None, ROW_MAJOR_S=s_base is None, RCP=RCP_E4M3_MAX, FLOOR=SCALE_FLOOR,
            num_warps=4)


def combine(terms: torch.Tensor, pos_of: torch.Tensor, width: int, weight: Optional[torch.Tensor],
            out: torch.Tensor) -> None:
    """moe_ep.split.torch_engine.TorchOps.combine in one launch (its docstring says what is computed)."""
    n, h = out.shape
    if terms.dtype != torch.bfloat16 or (terms.shape[0] and (terms.shape[1] != h or terms.stride(1) != 1)) \
            or out.dtype != torch.bfloat16 or out.stride(1) != 1 or pos_of.numel() != n * width:
        raise ValueError(f"terms bf16 [P, {h}] and out bf16 [{n}, {h}] with contiguous rows and pos_of [{n * width}] "
                         f"expected; got {terms.dtype} {tuple(terms.shape)}, {out.dtype} {tuple(out.shape)}, "
                         f"{tuple(pos_of.shape)}")
    if n == 0:
        return
    if terms.shape[0] == 0:
        out.zero_()
        return
    pos = pos_of.to(torch.int64).contiguous()
    w = weight.to(torch.float32).contiguous() if weight is not None else pos
    block_h = 1024
    with torch.cuda.device(out.device):
        _combine_kernel[(n, triton.cdiv(h, block_h))](
            terms, pos, w, out, n, h, terms.stride(0), out.stride(0), WIDTH=width, HAS_W=weight is not None,
            BLOCK_H=block_h, num_warps=4)
