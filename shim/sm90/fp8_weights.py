"""Canonical bf16 expert weights -> the Hopper FP8 kernel's weight layout and scales.

The quantization itself is moe_ep's reference quantizer (`quantize_weights("fp8_block", ...)`), so the
kernel computes with exactly the bytes the oracle checks against. This module only lays them out:
  * FC1 rows gate/up interleaved in groups of `Fp8GateUpInterleave` (8): g0..g7, u0..u7, g8..g15, ...;
    passed as an (E, H, 2I) view whose H axis has stride 1 (K-major storage, permuted view);
    scales [E, 2I/128, H/128] over the interleaved rows (a block spans 64 gate and 64 up rows);
  * FC2 as an (E, I, H) view with I stride 1, scales [E, H/128, I/128];
  * per-tensor dequant scales: ones (read only by the per-tensor program).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_ep.core.weights import QuantizedWeights
from moe_ep.reference import quant

__all__ = ["GATE_UP_INTERLEAVE", "Fp8KernelWeights", "prepare_fp8_block_weights", "FP8_MAX", "SCALE_FLOOR"]

GATE_UP_INTERLEAVE = quant.FP8_GATE_UP_INTERLEAVE  # checked against the drop's constant at kernel build
FP8_MAX = quant.E4M3_MAX
SCALE_FLOOR = quant.FP8_BLOCK_EPS


@dataclass
class Fp8KernelWeights:
    canonical: QuantizedWeights  # what the oracle checks against
    fc1: torch.Tensor  # (E, H, 2I) fp8 view, H stride 1, gate/up interleaved
    fc1_scale: torch.Tensor  # (E, 2I/128, H/128) fp32
    fc2: torch.Tensor  # (E, I, H) fp8 view, I stride 1
    fc2_scale: torch.Tensor  # (E, H/128, I/128) fp32
    fc1_act_dequant: torch.Tensor  # (1,) fp32
    fc1_w_dequant: torch.Tensor  # (E,) fp32
    fc2_act_dequant: torch.Tensor  # (1,) fp32
    fc2_w_dequant: torch.Tensor  # (E,) fp32


def prepare_fp8_block_weights(w13: torch.Tensor, w2: torch.Tensor, device: torch.device,
                              expert_offset: int = 0) -> Fp8KernelWeights:
    qw = quant.quantize_weights("fp8_block", w13.to(device), w2.to(device), expert_offset=expert_offset)
    e = qw.num_experts
    fc1 = quant.interleave_gate_up(qw.w13_q.view(torch.uint8)).view(torch.float8_e4m3fn)
    ones = torch.ones(e, dtype=torch.float32, device=device)
    one = torch.ones(1, dtype=torch.float32, device=device)
    return Fp8KernelWeights(
        canonical=qw, fc1=fc1.permute(0, 2, 1), fc1_scale=qw.w13_scale.contiguous(),
        fc2=qw.w2_q.permute(0, 2, 1), fc2_scale=qw.w2_scale.contiguous(),
        fc1_act_dequant=one, fc1_w_dequant=ones, fc2_act_dequant=one.clone(), fc2_w_dequant=ones.clone(),
    )
