"""The reference FFN math of one expert and the top-k combine: FC1 -> SwiGLU -> (routing weight) -> FC2-input
quantization -> FC2, with the kernels' accumulation and rounding order (each format's FC1 and FC2 legs are its own:
moe_ep/formats/<fmt>.py)."""

from __future__ import annotations

from typing import Optional

import torch

from moe_ep.formats import QuantizedActivation, QuantizedWeights, format_info

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
    FC2-input quantization, so the returned term is already weighted; otherwise it is unweighted. FC1 and the FC2
    leg (its input's quantization and the GEMM) are the format's (moe_ep/formats/<fmt>.py)."""
    info = format_info(qw.fmt)
    y = swiglu(info.fc1(qw, e, act), gate_up_clamp)
    if apply_topk_in_fc1:
        y = y * topk_weights.to(torch.float32).reshape(act.q.shape[0], 1)
    return info.fc2(qw, e, y)


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
