"""The reference FFN math of one expert and the top-k combine: FC1 -> SwiGLU -> (routing weight) -> FC2-input
quantization -> FC2, per format, with the kernels' accumulation and rounding order."""

from __future__ import annotations

from typing import Optional

import torch

from moe_ep.formats.codecs import (FP8_ACT_BLOCK_K, FP8_FC2_ACT_BLOCK_K, FP8_WEIGHT_BLOCK, fp8_block_mm,
                                   fp8_quantize_rows, mxfp4_kernel_operand, mxfp8_dequantize,
                                   mxfp8_quantize, nvfp4_alpha, nvfp4_dequantize_raw, nvfp4_quantize,
                                   to_e4m3, w4a8_nvfp4_kernel_operand, w13_block_rows)
from moe_ep.formats.packs import W4A8_FORMATS, QuantizedActivation, QuantizedWeights

__all__ = ["swiglu", "expert_ffn", "combine_terms"]


def swiglu(fc1: torch.Tensor, gate_up_clamp: Optional[float]) -> torch.Tensor:
    """fc1 [M, 2I] fp32 (gate | up) -> [M, I]: up * (gate * sigmoid(gate)), after the optional clamp
    gate = min(gate, limit), up = clamp(up, -limit, limit) on the dequantized values."""
    i = fc1.shape[1] // 2
    gate, up = fc1[:, :i], fc1[:, i:]
    if gate_up_clamp is not None:
        limit = abs(float(gate_up_clamp))
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return up * (gate * torch.sigmoid(gate))


def expert_ffn(qw: QuantizedWeights, e: int, act: QuantizedActivation, topk_weights: torch.Tensor,
               gate_up_clamp: Optional[float] = None, apply_topk_in_fc1: bool = True) -> torch.Tensor:
    """One expert (local index e of qw) over M routed rows -> fp32 [M, H] FC2 output.

    With apply_topk_in_fc1 (the kernels' default) the routing weight multiplies the SwiGLU output before the
    FC2-input quantization, so the returned term is already weighted; otherwise it is unweighted."""
    f = qw.fmt
    m = act.q.shape[0]
    if f == "bf16":
        fc1 = act.q.to(torch.float32) @ qw.w13_q[e].to(torch.float32).t()
    elif f == "fp8_block":
        rows = w13_block_rows(qw.intermediate_size, device=act.q.device)
        fc1 = fp8_block_mm(act.q, act.scale, FP8_ACT_BLOCK_K, qw.w13_q[e], qw.w13_scale[e], rows)
    elif f == "fp8_tensor":
        raw = act.q.to(torch.float32) @ qw.w13_q[e].to(torch.float32).t()
        fc1 = raw * (qw.act_scale[0] * qw.w13_scale[e])  # the epilogue's one factor act * w[e]
    elif f == "mxfp8":
        fc1 = mxfp8_dequantize(act.q, act.scale) @ mxfp8_dequantize(qw.w13_q[e], qw.w13_scale[e]).t()
    elif f in W4A8_FORMATS:
        # Full-K raw sum of e4m3 products, times the token's scale (mainloop), times the residual (epilogue).
        operand, residual = _w4a8_operand(qw, "w13", e)
        fc1 = (act.q.to(torch.float32) @ operand.t()) * act.scale.to(torch.float32) * residual
    else:
        raw = nvfp4_dequantize_raw(act.q, act.scale) @ nvfp4_dequantize_raw(qw.w13_q[e], qw.w13_scale[e]).t()
        fc1 = raw * nvfp4_alpha(qw.act_scale[0], qw.w13_global_scale[e])

    y = swiglu(fc1, gate_up_clamp)
    if apply_topk_in_fc1:
        y = y * topk_weights.to(torch.float32).reshape(m, 1)

    if f == "bf16":
        return y.to(torch.bfloat16).to(torch.float32) @ qw.w2_q[e].to(torch.float32).t()
    if f == "fp8_block":
        q, s = fp8_quantize_rows(y, FP8_FC2_ACT_BLOCK_K, reciprocal=True)
        h = qw.hidden_size
        rows = torch.arange(h, device=y.device) // FP8_WEIGHT_BLOCK
        return fp8_block_mm(q, s, FP8_FC2_ACT_BLOCK_K, qw.w2_q[e], qw.w2_scale[e], rows)
    if f == "fp8_tensor":
        q = to_e4m3(y * torch.reciprocal(qw.fc2_act_scale[0]))  # the epilogue multiplies by 1 / scale
        raw = q.to(torch.float32) @ qw.w2_q[e].to(torch.float32).t()
        return raw * (qw.fc2_act_scale[0] * qw.w2_scale[e])
    if f in W4A8_FORMATS:
        # FC2 input 1x64 per row (tiny-amax branch included); each 64-wide K slice's raw sum promoted by its
        # scale in K order (the mainloop), then the residual (epilogue).
        q, s = fp8_quantize_rows(y, FP8_FC2_ACT_BLOCK_K, reciprocal=True, tiny_safe=True)
        operand, residual = _w4a8_operand(qw, "w2", e)
        n, k = operand.shape
        ones = torch.ones((1, k // FP8_FC2_ACT_BLOCK_K), dtype=torch.float32, device=y.device)
        rows = torch.zeros(n, dtype=torch.int64, device=y.device)
        return fp8_block_mm(q, s, FP8_FC2_ACT_BLOCK_K, operand, ones, rows, FP8_FC2_ACT_BLOCK_K) * residual
    if f == "mxfp8":
        q, s = mxfp8_quantize(y)
        return mxfp8_dequantize(q, s) @ mxfp8_dequantize(qw.w2_q[e], qw.w2_scale[e]).t()
    g = qw.fc2_act_scale[e]
    q, s = nvfp4_quantize(y, g.reshape(1, 1))
    raw = nvfp4_dequantize_raw(q, s) @ nvfp4_dequantize_raw(qw.w2_q[e], qw.w2_scale[e]).t()
    return raw * nvfp4_alpha(g, qw.w2_global_scale[e])


def _w4a8_operand(qw: QuantizedWeights, leg: str, e: int):
    """(e4m3-valued fp32 operand [N, K], fp32 residual) of expert e's `leg` as the SM90 W4A8 kernel uses it."""
    codes, scale = getattr(qw, leg + "_q")[e], getattr(qw, leg + "_scale")[e]
    if qw.fmt == "w4a8_mxfp4":
        return mxfp4_kernel_operand(codes, scale)
    return w4a8_nvfp4_kernel_operand(codes, scale, getattr(qw, leg + "_global_scale")[e])


def combine_terms(terms: torch.Tensor, topk_weights: torch.Tensor, weighted: bool) -> torch.Tensor:
    """terms [T, K, H] (bf16 values) -> [T, H] bf16: fp32 sum in slot order, as the kernels' top-k reduce.
    weighted=True means the routing weights are already inside the terms. A -1 slot's term is zero (the
    backends never fill it), so it adds nothing in either mode."""
    t, k, h = terms.shape
    acc = torch.zeros((t, h), dtype=torch.float32, device=terms.device)
    terms = terms.to(torch.float32)
    for j in range(k):
        if weighted:
            acc = acc + terms[:, j, :]
        else:
            acc = torch.addcmul(acc, terms[:, j, :], topk_weights[:, j].to(torch.float32).unsqueeze(-1))
    return acc.to(torch.bfloat16)
