"""The Hopper BF16 MegaMoE frontend: `moe_hopper_bf16.Sm90MegaMoE{,SwapAB}Bf16Kernel`, and its weight layout.

No quantization anywhere: bf16 activations are copied into the symmetric buffer as they are, FC1 and FC2 run
on bf16 weights with fp32 accumulation, the SwiGLU output (routing weight folded in) is rounded to bf16 before
FC2. The FC1 rows use the same 8-row gate/up interleave as the FP8 kernel (shim/sm90/weights.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_ep.formats import QuantizedActivation, QuantizedWeights
from shim.common.weights import KernelWeights, kernel_tensors, read_experts, store_experts
from shim.sm90.frontend import Sm90Frontend
from shim.sm90.weights import GATE_UP_INTERLEAVE

__all__ = ["Sm90Bf16Frontend", "Sm90Bf16Weights"]


@dataclass
class Sm90Bf16Weights(KernelWeights):
    """bf16 as the BF16 kernel takes it: FC1 / FC2 in the Hopper K-major views (shim/sm90/weights.py), no scales."""

    fmt = "bf16"
    expert_offset: int
    fc1: torch.Tensor  # (E, H, 2I) bf16 view, H stride 1, gate/up interleaved
    fc2: torch.Tensor  # (E, I, H) bf16 view, I stride 1

    @classmethod
    def empty(cls, experts, hidden, intermediate, device, expert_offset):
        return cls(expert_offset, *kernel_tensors(experts, hidden, intermediate, torch.bfloat16, device))

    def store(self, rows, qw):
        store_experts(self.fc1, self.fc2, rows, qw.w13_q, qw.w2_q, GATE_UP_INTERLEAVE)

    def canonical(self) -> QuantizedWeights:
        w13, w2 = read_experts(self.fc1, self.fc2, GATE_UP_INTERLEAVE)
        return QuantizedWeights(self.fmt, w13, w2, expert_offset=self.expert_offset)


class Sm90Bf16Frontend(Sm90Frontend):
    fmt = "bf16"
    weights_layout = Sm90Bf16Weights

    def kernel_class(self, knobs):
        ks = self.symbols()
        return ks.Sm90MegaMoESwapABBf16Kernel if knobs.swap_ab else ks.Sm90MegaMoEBf16Kernel

    def format_kwargs(self, knobs):
        import cutlass

        return dict(ab_dtype=cutlass.BFloat16)

    def input_buffers(self):
        return [("act", (self.max_tokens_per_rank, self.hidden_size), torch.bfloat16)]

    def prepare_routing(self, t: int) -> None:
        # This kernel's dispatch skips a -1 slot but its top-k reduce still adds that slot's stale term (the FP8
        # kernel masks it; docs/shim.md). So a -1 slot is sent, with routing weight 0, to this rank's first expert:
        # the weight is folded into the SwiGLU output before FC2, so its term is an exact zero. Spare rows past t
        # stay -1 (dispatch skips them and the reduce does not cover them).
        idx = self.topk_idx[:t]
        dead = idx < 0
        self.topk_w[:t].masked_fill_(dead, 0.0)
        idx.masked_fill_(dead, self.rank * self.experts_per_rank)

    def stage_activations(self, x: torch.Tensor) -> None:
        self.act[: x.shape[0]].copy_(x)

    def weight_args(self, b, w: Sm90Bf16Weights):
        return dict(fc1_weight=b.tensor(w.fc1), fc2_weight=b.tensor(w.fc2))

    def staged_activation(self, t: int) -> QuantizedActivation:
        return QuantizedActivation(self.fmt, self.act[:t].clone())
