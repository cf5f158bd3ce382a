"""Canonical bf16 expert weights -> the Hopper kernels' weight layouts (FP8 blockwise, BF16), and back.

The quantization is moe_ep's format quantizer (`moe_ep.formats.quantize_weights`), so the kernel computes
with exactly the bytes the oracle checks against. This module only lays them out (facts from the drop's
runners and kernels, 0.7.2.post1 and 0.7.4):
  * FC1 rows gate/up interleaved in groups of `Fp8GateUpInterleave` (8; the BF16 kernel pairs them the same
    way): g0..g7, u0..u7, g8..g15, ...; passed as an (E, H, 2I) view whose H axis has stride 1 (K-major
    storage [E, 2I, H], permuted view);
  * FP8: scales [E, 2I/128, H/128] over the interleaved rows (a block spans 64 gate and 64 up rows, so the
    same grid is the canonical fp8_block w13_scale);
  * FC2 as an (E, I, H) view of [E, H, I] storage (I stride 1); FP8 scales [E, H/128, I/128];
  * FP8 per-tensor dequant scales: ones (read only by the per-tensor program).

Nothing is held twice: `Sm90KernelWeights.canonical()` reads the oracle's view back from the tensors the
kernel is handed (FC2 is a view of the same storage, FC1 is de-interleaved into a temporary), as on sm100.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from moe_ep.formats import QuantizedWeights, codecs, quantize_weights

__all__ = ["GATE_UP_INTERLEAVE", "Sm90KernelWeights", "prepare_weights", "placeholder_weights"]

GATE_UP_INTERLEAVE = codecs.FP8_GATE_UP_INTERLEAVE  # checked against the drop's constant at kernel build


@dataclass
class Sm90KernelWeights:
    fmt: str  # "fp8_block" | "bf16"
    expert_offset: int
    fc1: torch.Tensor  # (E, H, 2I) view, H stride 1, gate/up interleaved
    fc2: torch.Tensor  # (E, I, H) view, I stride 1
    # FP8 only.
    fc1_scale: Optional[torch.Tensor] = None  # (E, 2I/128, H/128) fp32
    fc2_scale: Optional[torch.Tensor] = None  # (E, H/128, I/128) fp32
    fc1_act_dequant: Optional[torch.Tensor] = None  # (1,) fp32
    fc1_w_dequant: Optional[torch.Tensor] = None  # (E,) fp32
    fc2_act_dequant: Optional[torch.Tensor] = None  # (1,) fp32
    fc2_w_dequant: Optional[torch.Tensor] = None  # (E,) fp32

    @property
    def num_experts(self) -> int:
        return self.fc1.shape[0]

    def canonical(self) -> QuantizedWeights:
        """The quantized weights read back from the kernel tensors, in moe_ep's canonical layout."""
        storage = self.fc1.transpose(1, 2)  # [E, 2I, H], contiguous
        w2 = self.fc2.transpose(1, 2)  # [E, H, I], a view of the kernel's own storage
        if self.fmt == "bf16":
            return QuantizedWeights("bf16", codecs.deinterleave_gate_up(storage), w2,
                                    expert_offset=self.expert_offset)
        w13 = codecs.deinterleave_gate_up(storage.view(torch.uint8)).view(torch.float8_e4m3fn)
        return QuantizedWeights("fp8_block", w13, w2, self.fc1_scale, self.fc2_scale,
                                expert_offset=self.expert_offset)


def prepare_weights(fmt: str, w13: torch.Tensor, w2: torch.Tensor, device: torch.device, *,
                    expert_offset: int = 0) -> Sm90KernelWeights:
    """Quantize (moe_ep's format quantizer, on `device`) and lay out for the `fmt` kernel.

    The canonical quantized FC1 is a temporary: only its interleaved copy, the one the kernel reads, is kept."""
    qw = quantize_weights(fmt, w13.to(device), w2.to(device), expert_offset=expert_offset)
    if fmt == "bf16":
        fc1 = codecs.interleave_gate_up(qw.w13_q)
        return Sm90KernelWeights("bf16", expert_offset, fc1.permute(0, 2, 1), qw.w2_q.permute(0, 2, 1))
    e = qw.num_experts
    fc1 = codecs.interleave_gate_up(qw.w13_q.view(torch.uint8)).view(torch.float8_e4m3fn)
    ones = torch.ones(e, dtype=torch.float32, device=device)
    one = torch.ones(1, dtype=torch.float32, device=device)
    return Sm90KernelWeights(
        "fp8_block", expert_offset, fc1.permute(0, 2, 1), qw.w2_q.permute(0, 2, 1),
        fc1_scale=qw.w13_scale.contiguous(), fc2_scale=qw.w2_scale.contiguous(),
        fc1_act_dequant=one, fc1_w_dequant=ones, fc2_act_dequant=one.clone(), fc2_w_dequant=ones.clone(),
    )


def placeholder_weights(fmt: str, experts: int, hidden: int, intermediate: int, device=None) -> Sm90KernelWeights:
    """Zero weights of the right shapes and dtypes (a compile without real weights)."""
    z13 = torch.zeros((experts, 2 * intermediate, hidden), dtype=torch.bfloat16, device=device)
    z2 = torch.zeros((experts, hidden, intermediate), dtype=torch.bfloat16, device=device)
    return prepare_weights(fmt, z13, z2, z13.device)
