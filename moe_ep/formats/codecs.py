"""The element and block codecs of the quantization formats, in plain torch.

Every formula mirrors the drop's own torch references (docs/reference.md lists the file and function for
each); we re-implement rather than import because only shim/ may import the drop. Where the drop's
reference runs a GPU-only helper (rcp.approx, ex2.approx) we use the IEEE torch op: that is the one place the
CPU oracle can differ from the kernel by an ulp, and the oracle's tolerance absorbs it.

Conventions: "raw" GEMMs multiply exactly representable fp32 values of the quantized operands and
accumulate in fp32; scales are applied where the kernel applies them (per K block for fp8_block, after the
full-K sum for fp8_tensor and nvfp4's alpha; mxfp8/nvfp4 block scales are folded into the operands, which is
exact because e8m0 is a power of two and e2m1 x e4m3 fits in fp32's mantissa).
"""

from __future__ import annotations

from typing import Tuple

import torch

__all__ = [
    "E4M3_MAX", "E2M1_MAX", "FP8_ACT_BLOCK_K", "FP8_FC2_ACT_BLOCK_K", "FP8_WEIGHT_BLOCK", "FP8_BLOCK_EPS",
    "FP8_TENSOR_EPS", "FP8_TENSOR_OUTPUT_MARGIN", "FP8_GATE_UP_INTERLEAVE", "MX_BLOCK", "NVFP4_BLOCK",
    "to_e4m3", "fp8_quantize_rows", "fp8_dequantize_rows", "fp8_quantize_blocks_nk", "fp8_dequantize_blocks_nk",
    "interleave_gate_up", "deinterleave_gate_up", "w13_block_rows", "fp8_quantize_w13_blocks", "fp8_block_mm",
    "fp8_tensor_scale_from_amax", "fp8_quantize_static", "fp8_quantize_per_expert",
    "mxfp8_quantize", "e8m0_to_float", "mxfp8_dequantize",
    "E2M1_VALUES", "e2m1_encode", "e2m1_decode", "nvfp4_global_scale", "nvfp4_quantize", "nvfp4_quantize_experts",
    "nvfp4_dequantize_raw",
    "nvfp4_dequantize", "nvfp4_alpha",
    "MXFP4_MAX_SCALE_RANGE", "W4A8_FC2_SAFE_AMAX", "mxfp4_quantize", "mxfp4_dequantize", "mxfp4_limit_scale_range",
    "mxfp4_kernel_operand", "w4a8_nvfp4_kernel_operand",
]

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0          # common/megamoe_constants.py Fp8E4M3FNMax
E2M1_MAX = 6.0            # Nvfp4E2M1Max
FP8_ACT_BLOCK_K = 128     # Fp8BlockScaleK: FC1 input, 1x128 per token
FP8_FC2_ACT_BLOCK_K = 64  # Fp8Fc2ActivationScaleK: FC2 input, 1x64 per (token, topk)
FP8_WEIGHT_BLOCK = 128    # Fp8WeightScaleBlockN = Fp8WeightScaleBlockK
FP8_BLOCK_EPS = 1.0e-30   # hopper_moe_utils.Fp8BlockScaleEpsilon
FP8_TENSOR_EPS = 1.0e-12  # hopper_moe_utils.Fp8PerTensorScaleEpsilon
FP8_TENSOR_OUTPUT_MARGIN = 0.95  # hopper_moe_utils.Fp8PerTensorOutputQuantMargin
FP8_GATE_UP_INTERLEAVE = 8  # Fp8GateUpInterleave: the FP8 kernel's FC1 row interleave
MX_BLOCK = 32             # Mxfp8BlockSize; also MXFP4's scale block (mxfp4_cutedsl.MXFP4_GROUP_SIZE)
NVFP4_BLOCK = 16          # Nvfp4BlockSize
_FP32_MAX = torch.finfo(torch.float32).max
# The SM90 W4A8 conversion (moe_hopper_fp8/mxfp4_cutedsl.py convert_mxfp4_pair_preprocessed_signs) turns an
# e2m1 value into e4m3 by adding an exponent offset in [1, 12]: a (expert, weight tensor) can span 11 binades of
# e8m0 scales; lower scales are raised to the floor (Humming's range clamp).
MXFP4_MAX_SCALE_RANGE = 11
# (below, floor) of the W4A8 FC2-input quantizer's tiny-amax branch (epilogue_fp8_swapab._mxfp4_safe_scale_pair).
W4A8_FC2_SAFE_AMAX = (448.0e-30, 1.3165537626040637e-36)


# fl32(1/448), as a Python float holding that fp32 value exactly: a tensor times a Python scalar is one fp32
# multiply on every device, with no host-to-device copy (which a CUDA graph capture would refuse).
_INV_E4M3_MAX = float(torch.tensor(1.0 / E4M3_MAX, dtype=torch.float32))


def _over_e4m3_max(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448 the way every device computes it here: one fp32 multiply by fl32(1/448), rounded to nearest.
    torch on CUDA turns a division by a Python scalar into exactly this multiply, on the CPU into a true
    division; the two differ by an ulp for about half of all amax values, and so would the bytes staged on a
    GPU and the oracle's on a CPU. Spelled out, the definition is the same everywhere (and it is what a fused
    staging kernel reproduces, shim/sm90/fp8_staging.py)."""
    return amax.to(torch.float32) * _INV_E4M3_MAX


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> e4m3 with round-to-nearest-even and saturation (the kernel's cvt.rn.satfinite).

    torch's cast already saturates; the explicit clamp pins that behaviour whatever the torch version.
    NaN stays NaN."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(FP8)


# ---------------------------------------------------------------------------------------------- fp8 block
def fp8_quantize_rows(x: torch.Tensor, block_k: int, reciprocal: bool = False,
                      tiny_safe: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (e4m3 [M, K], fp32 scales [M, K/block_k]); scale = max(amax * fl32(1/448), 1e-30).

    reciprocal=True multiplies by 1/scale (the kernel's FC2-input requantization), False divides (the FC1
    input, staged by the host). tiny_safe (with reciprocal; the W4A8 kernel's FC2 input): a block whose amax is
    positive but below 448e-30 gets quant = 448 / max(amax, W4A8_FC2_SAFE_AMAX[1]) and scale = 1 / quant
    instead, so its values keep their resolution rather than sit on the 1e-30 floor."""
    m, k = x.shape
    blocks = x.to(torch.float32).reshape(m, k // block_k, block_k)
    absmax = blocks.abs().amax(dim=-1)
    scale = torch.clamp(_over_e4m3_max(absmax), min=FP8_BLOCK_EPS).to(torch.float32)
    if reciprocal:
        inv = torch.reciprocal(scale)
        if tiny_safe:
            below, floor = (torch.tensor(v, dtype=torch.float32, device=x.device) for v in W4A8_FC2_SAFE_AMAX)
            tiny = (absmax > 0) & (absmax < below)
            quant = torch.tensor(E4M3_MAX, dtype=torch.float32, device=x.device) / torch.maximum(absmax, floor)
            inv = torch.where(tiny, quant, inv)
            scale = torch.where(tiny, torch.reciprocal(quant), scale)
        scaled = blocks * inv.unsqueeze(-1)
    else:
        scaled = blocks / scale.unsqueeze(-1)
    return to_e4m3(scaled.reshape(m, k)), scale


def fp8_dequantize_rows(q: torch.Tensor, scale: torch.Tensor, block_k: int) -> torch.Tensor:
    return q.to(torch.float32) * scale.to(torch.float32).repeat_interleave(block_k, dim=-1)


def fp8_quantize_blocks_nk(w: torch.Tensor, block_n: int = FP8_WEIGHT_BLOCK,
                           block_k: int = FP8_WEIGHT_BLOCK) -> Tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] -> (e4m3, fp32 scales [..., N/bn, K/bk]); one scale per bn x bk block, amax/448 floored."""
    *lead, n, k = w.shape
    blocks = w.to(torch.float32).reshape(*lead, n // block_n, block_n, k // block_k, block_k)
    nd = blocks.dim()
    absmax = blocks.abs().amax(dim=(nd - 3, nd - 1))
    scale = torch.clamp(_over_e4m3_max(absmax), min=FP8_BLOCK_EPS).to(torch.float32)
    q = to_e4m3((blocks / scale.unsqueeze(-1).unsqueeze(-3)).reshape(*lead, n, k))
    return q, scale


def fp8_dequantize_blocks_nk(q: torch.Tensor, scale: torch.Tensor, block_n: int = FP8_WEIGHT_BLOCK,
                             block_k: int = FP8_WEIGHT_BLOCK) -> torch.Tensor:
    s = scale.to(torch.float32).repeat_interleave(block_n, dim=-2).repeat_interleave(block_k, dim=-1)
    return q.to(torch.float32) * s


def interleave_gate_up(w13: torch.Tensor, group: int = FP8_GATE_UP_INTERLEAVE) -> torch.Tensor:
    """Canonical [.., gate(I); up(I), H] rows -> g0..g7 u0..u7 g8.. (the FP8 kernel's FC1 row order)."""
    *lead, n2, h = w13.shape
    i = n2 // 2
    v = w13.reshape(*lead, 2, i // group, group, h)
    d = len(lead)
    return v.transpose(d, d + 1).reshape(*lead, n2, h)


def deinterleave_gate_up(w13i: torch.Tensor, group: int = FP8_GATE_UP_INTERLEAVE) -> torch.Tensor:
    *lead, n2, h = w13i.shape
    i = n2 // 2
    v = w13i.reshape(*lead, i // group, 2, group, h)
    d = len(lead)
    return v.transpose(d, d + 1).reshape(*lead, n2, h)


def w13_block_rows(intermediate: int, block_n: int = FP8_WEIGHT_BLOCK,
                   group: int = FP8_GATE_UP_INTERLEAVE, device=None) -> torch.Tensor:
    """For each canonical w13 row, the row of its fp8_block scale: blocks are cut over the interleaved
    order, so gate row r and up row r both fall in block r // (block_n / 2)."""
    del group  # any interleave that divides block_n/2 gives the same answer
    r = torch.arange(intermediate, device=device) // (block_n // 2)
    return torch.cat([r, r])


def fp8_quantize_w13_blocks(w13: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """[E, 2I, H] canonical -> (e4m3 canonical, fp32 [E, 2I/128, H/128] scales over the interleaved rows)."""
    q, s = fp8_quantize_blocks_nk(interleave_gate_up(w13))
    return deinterleave_gate_up(q), s


def fp8_block_mm(a: torch.Tensor, a_scale: torch.Tensor, a_block_k: int, b: torch.Tensor, b_scale: torch.Tensor,
                 b_scale_rows: torch.Tensor, b_block_k: int = FP8_WEIGHT_BLOCK) -> torch.Tensor:
    """a [M,K] e4m3 with scales [M, K/a_block_k]; b [N,K] e4m3 with scales [Nb, K/b_block_k] where row n of b
    uses scale row b_scale_rows[n]. Raw fp32 partial sums per K segment (the union of both block grids),
    promoted by a_scale * b_scale and accumulated in K order, as the kernel's WGMMA promotion does."""
    m, k = a.shape
    n = b.shape[0]
    bounds = sorted({0, k} | set(range(a_block_k, k, a_block_k)) | set(range(b_block_k, k, b_block_k)))
    acc = torch.zeros((m, n), dtype=torch.float32, device=a.device)
    a32 = a.to(torch.float32)
    b32 = b.to(torch.float32)
    a_s = a_scale.to(torch.float32)
    b_s = b_scale.to(torch.float32)[b_scale_rows]  # [N, K/b_block_k]
    for k0, k1 in zip(bounds[:-1], bounds[1:]):
        raw = a32[:, k0:k1] @ b32[:, k0:k1].t()
        acc.add_(raw * a_s[:, k0 // a_block_k].reshape(m, 1) * b_s[:, k0 // b_block_k].reshape(1, n))
    return acc


# --------------------------------------------------------------------------------------------- fp8 tensor
def fp8_tensor_scale_from_amax(amax: float, device=None) -> torch.Tensor:
    """Static per-tensor dequant scale from a calibrated amax: max(amax / (448 * 0.95), 1e-12), 1.0 for
    amax <= 0 (in double, then fp32, as the drop computes its FC2-input scale)."""
    amax = float(amax)
    fp8_amax = E4M3_MAX * FP8_TENSOR_OUTPUT_MARGIN
    value = 1.0 if amax <= 0.0 else max(amax / fp8_amax, FP8_TENSOR_EPS)
    return torch.tensor((value,), dtype=torch.float32, device=device)


def fp8_quantize_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q = sat(x / scale) with a fixed (1,) dequant scale."""
    return to_e4m3(x.to(torch.float32) / scale.reshape(()))


def fp8_quantize_per_expert(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> (e4m3, fp32 [E]): one block spanning each expert (the 128x128 rule, block = matrix)."""
    e = w.shape[0]
    w32 = w.to(torch.float32)
    absmax = w32.abs().reshape(e, -1).amax(dim=1)
    scale = torch.clamp(_over_e4m3_max(absmax), min=FP8_BLOCK_EPS).to(torch.float32)
    return to_e4m3(w32 / scale.reshape(e, 1, 1)), scale


# ------------------------------------------------------------------------------------------------- mxfp8
def mxfp8_quantize(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """[..., K] -> (e4m3 [..., K], e8m0 [..., K/32]).

    exp = ceil(log2(amax * (1/448))), biased and clamped to [0, 254]; an all-zero block gets code 0 (2^-127);
    q = sat(x / 2^(code-127)). A NaN block gets the e8m0 NaN code 255 (the drop's cast of NaN to int is
    undefined there)."""
    *lead, k = x.shape
    x32 = x.to(torch.float32)
    blocked = x32.reshape(*lead, k // MX_BLOCK, MX_BLOCK)
    absmax = blocked.abs().amax(dim=-1)
    safe = torch.clamp(absmax, min=1e-30)
    scale_exp = torch.ceil(torch.log2(safe * (1.0 / E4M3_MAX)))
    nan = torch.isnan(scale_exp)
    code = torch.clamp(torch.where(nan, torch.zeros_like(scale_exp), scale_exp) + 127.0, min=0.0, max=254.0)
    code = code.to(torch.int32)
    code = torch.where(absmax == 0, torch.zeros_like(code), code)
    scale_fp32 = torch.pow(2.0, code.float() - 127.0)
    code = torch.where(nan, torch.full_like(code, 255), code)
    scale_fp32 = torch.where(nan, torch.full_like(scale_fp32, float("nan")), scale_fp32)
    q = to_e4m3((blocked / scale_fp32.unsqueeze(-1)).reshape(*lead, k))
    return q, code.to(torch.uint8).view(torch.float8_e8m0fnu)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    code = scale.view(torch.uint8).to(torch.int32)
    out = torch.pow(2.0, code.to(torch.float32) - 127.0)
    return torch.where(code == 255, torch.full_like(out, float("nan")), out)


def mxfp8_dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.to(torch.float32) * e8m0_to_float(scale).repeat_interleave(MX_BLOCK, dim=-1)


# ------------------------------------------------------------------------------------------------- nvfp4
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_LUT = torch.tensor(list(E2M1_VALUES) + [-v for v in E2M1_VALUES], dtype=torch.float32)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> e2m1 codes (uint8, one per element): round to nearest, ties to even code, saturating at 6
    (cvt.rn.satfinite.e2m1x2.f32). NaN encodes as 0: NVFP4 carries NaN in the block's e4m3 scale."""
    a = x.abs()
    # Midpoints between neighbours; at a tie, '>' keeps the even code below, '>=' moves to the even code above.
    idx = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5)
           + (a > 5.0))
    sign = torch.signbit(x) & ~torch.isnan(x)
    return idx.to(torch.uint8) | (sign.to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    return _E2M1_LUT.to(codes.device)[codes.to(torch.int64)]


def nvfp4_global_scale(amax) -> torch.Tensor:
    """Global (encode) scale that maps amax onto the largest block value: 448 * 6 / amax; 1.0 for amax 0."""
    a = torch.as_tensor(amax, dtype=torch.float32)
    return torch.where(a > 0, (E4M3_MAX * E2M1_MAX) / a, torch.ones_like(a)).to(torch.float32)


def nvfp4_quantize(x: torch.Tensor, global_scale: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """[..., K] -> (e2m1 codes [..., K], e4m3 block scales [..., K/16]) with global_scale broadcastable to
    the block-scale shape [..., K/16] (the drop's norm_const): sf = e4m3(clamp(amax * (1/6) * g, +-448)); q = e2m1(x * (g / sf));
    a zero sf zeroes its block."""
    *lead, k = x.shape
    blocked = x.to(torch.float32).reshape(*lead, k // NVFP4_BLOCK, NVFP4_BLOCK)
    g = global_scale.to(torch.float32)
    absmax = blocked.abs().amax(dim=-1)
    sfc = torch.clamp(absmax * (1.0 / E2M1_MAX) * g, min=-E4M3_MAX, max=E4M3_MAX)
    sf = sfc.to(FP8)
    sf_rt = sf.to(torch.float32)
    acc = g * torch.reciprocal(sf_rt)
    acc = torch.nan_to_num(acc, nan=_FP32_MAX, posinf=_FP32_MAX, neginf=_FP32_MAX)
    acc = torch.clamp(acc, max=_FP32_MAX)
    acc = torch.where(sf_rt > 0, acc, torch.zeros_like(acc))
    codes = e2m1_encode((blocked * acc.unsqueeze(-1)).reshape(*lead, k))
    return codes, sf


def nvfp4_quantize_experts(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert weights [E, N, K] -> (e2m1 codes, e4m3 scales per 16, global scale [E] = 448 * 6 / amax of each
    expert): the NVFP4 weight codec."""
    e = w.shape[0]
    g = nvfp4_global_scale(w.to(torch.float32).abs().reshape(e, -1).amax(dim=1))
    q, sf = nvfp4_quantize(w, g.reshape(e, 1, 1))
    return q, sf, g


def nvfp4_dequantize_raw(codes: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """q * sf (exact in fp32): what the block-scaled MMA multiplies before alpha."""
    return e2m1_decode(codes) * sf.to(torch.float32).repeat_interleave(NVFP4_BLOCK, dim=-1)


def nvfp4_dequantize(codes: torch.Tensor, sf: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    return nvfp4_dequantize_raw(codes, sf) / global_scale.to(torch.float32)


def nvfp4_alpha(g_a: torch.Tensor, g_b: torch.Tensor) -> torch.Tensor:
    """The GEMM epilogue's alpha (the drop's fc1_alpha / fc2_alpha): 1 / (g_a * g_b) in fp32."""
    return torch.reciprocal(g_a.to(torch.float32) * g_b.to(torch.float32))


# ------------------------------------------------------------------------------------------------- mxfp4
def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    return torch.pow(2.0, exponent.to(torch.float32))


def _mxfp4_scale_floor(code: torch.Tensor, max_range: int) -> torch.Tensor:
    """Per leading index (expert), the kernel's lowest code: max(min code, max code - max_range) over every
    block of that expert's tensor, the NaN code 255 left out (Humming's range clamp, as FlashInfer's
    prepare.py states it)."""
    c = code.to(torch.int32).reshape(code.shape[0], -1)
    finite = c != 255
    top = torch.where(finite, c, torch.full_like(c, -1)).amax(dim=1)
    low = torch.where(finite, c, torch.full_like(c, 256)).amin(dim=1)
    lo = torch.where(top < 0, torch.zeros_like(top), torch.maximum(low, top - max_range))
    return lo.reshape((-1,) + (1,) * (code.dim() - 1))


def mxfp4_quantize(w: torch.Tensor, max_range: int = MXFP4_MAX_SCALE_RANGE) -> Tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> (e2m1 codes uint8 [E, N, K], e8m0 [E, N, K/32]).

    code = clamp(ceil(log2(amax / 6)) + 127, 0, 254) (the power of two that puts the block's largest value at
    or below 6, so nothing saturates; 0 for an all-zero block), then raised to its expert's floor, max code -
    max_range (the kernel's exponent window, MXFP4_MAX_SCALE_RANGE); q = e2m1(x / 2^(code-127)), round to
    nearest even. A NaN block gets code 255 and zero codes."""
    *lead, k = w.shape
    blocks = w.to(torch.float32).reshape(*lead, k // MX_BLOCK, MX_BLOCK)
    absmax = blocks.abs().amax(dim=-1)
    nan = torch.isnan(absmax)
    exp = torch.ceil(torch.log2(torch.clamp(absmax, min=1e-38) / E2M1_MAX))
    code = torch.clamp(torch.where(nan, torch.zeros_like(exp), exp) + 127.0, min=0.0, max=254.0).to(torch.int32)
    code = torch.where(absmax == 0, torch.zeros_like(code), code)
    code = torch.where(nan, torch.full_like(code, 255), code)
    code = torch.where(code == 255, code, torch.maximum(code, _mxfp4_scale_floor(code, max_range)))
    scaled = blocks / _pow2(torch.where(code == 255, torch.full_like(code, 127), code) - 127).unsqueeze(-1)
    q = e2m1_encode(torch.nan_to_num(scaled, nan=0.0).reshape(*lead, k))
    return q, code.to(torch.uint8).view(torch.float8_e8m0fnu)


def mxfp4_dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e2m1(q) * 2^(code-127), exact (code 255: NaN)."""
    return e2m1_decode(codes) * e8m0_to_float(scale).repeat_interleave(MX_BLOCK, dim=-1)


def _shrink_table(device) -> torch.Tensor:
    """[6, 16]: the e2m1 code of value(code) / 2^delta, nearest, ties away from zero (Humming's rewrite rule,
    process_mxfp4.cuh via FlashInfer's prepare.py), for delta 0..5; a zero result is +0. delta >= 5 rounds
    every value to zero (6 / 32 < 0.25), so row 5 serves every larger delta."""
    vals = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    out = torch.zeros((6, 16), dtype=torch.uint8)
    for d in range(6):
        for c in range(16):
            v = abs(float(E2M1_VALUES[c & 7])) / 2 ** d
            dist = (vals - v).abs()
            best = float(dist.min())
            idx = int(torch.nonzero(dist == best).max())  # of two equally near values, the larger magnitude
            out[d, c] = idx | (8 if (c & 8) and idx else 0)
    return out.to(device)


def mxfp4_limit_scale_range(codes: torch.Tensor, scale: torch.Tensor,
                            max_range: int = MXFP4_MAX_SCALE_RANGE) -> Tuple[torch.Tensor, torch.Tensor]:
    """An MXFP4 pack [E, N, K] whose scales span more than `max_range` binades per expert -> the pack the kernel
    can carry: each scale below the floor is raised to it and its block's codes rewritten for the larger scale
    (value / 2^delta, nearest, ties away from zero). Identity on packs already within range (mxfp4_quantize's)."""
    code = scale.view(torch.uint8).to(torch.int32)
    lo = _mxfp4_scale_floor(code, max_range)
    raised = torch.where(code == 255, code, torch.maximum(code, lo))
    delta = (raised - code).clamp(max=5).repeat_interleave(MX_BLOCK, dim=-1)
    if not bool((delta > 0).any()):
        return codes, scale
    table = _shrink_table(codes.device)
    new = torch.where(delta > 0, table[delta.to(torch.int64), codes.to(torch.int64)], codes)
    return new, raised.to(torch.uint8).view(torch.float8_e8m0fnu)


def mxfp4_kernel_operand(codes: torch.Tensor, scale: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """One expert's MXFP4 weight [N, K] as the SM90 W4A8 kernel multiplies it: (operand fp32 [N, K], residual
    fp32 scalar) with operand * residual == the dequantized weight, exactly.

    The kernel converts each e2m1 value to e4m3 as value * 2^(offset - 6), offset = code - lo + 1 (1..12, lo =
    the expert's scale floor), so every operand is an exact e4m3 value; the FP32 residual 2^(lo - 127 - 1) * 2^6
    multiplies the accumulator in the epilogue (Humming's residual and its fixed 2^6 compensation). The range
    clamp is applied first (identity on packs within range)."""
    codes, scale = mxfp4_limit_scale_range(codes.unsqueeze(0), scale.unsqueeze(0))
    code = scale.view(torch.uint8).to(torch.int32)
    lo = _mxfp4_scale_floor(code, MXFP4_MAX_SCALE_RANGE)
    shift = (code - lo - 5).repeat_interleave(MX_BLOCK, dim=-1)
    operand = e2m1_decode(codes) * _pow2(shift)
    operand = torch.where((code == 255).repeat_interleave(MX_BLOCK, dim=-1), torch.full_like(operand, float("nan")),
                          operand)
    return operand[0], _pow2(lo.reshape(()) - 122)


def w4a8_nvfp4_kernel_operand(codes: torch.Tensor, sf: torch.Tensor,
                              global_scale: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """One expert's NVFP4 weight [N, K] as an SM90 W4A8 kernel multiplies it: the FP8 operand e4m3(q * sf / 8)
    (rounded to nearest even: the product of an e2m1 value and an e4m3 scale needs up to five significant bits)
    and the residual 8 / g, restored on the accumulator (FlashInfer's Hopper NVFP4 x FP8 contract, in the carrier
    wheel: kernel_src/sm90/pull_style_cutedsl_megakernel/shim/nvfp4_kernels.py and its backend's weights.py)."""
    operand = to_e4m3(nvfp4_dequantize_raw(codes, sf) * 0.125).to(torch.float32)
    return operand, torch.reciprocal(global_scale.to(torch.float32).reshape(())) * 8.0
