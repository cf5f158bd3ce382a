"""The Blackwell BF16 MegaMoE frontend (`moe_bf16_glu.Sm100MegaMoEBf16Kernel`), and its weight layout (bf16,
K-major, FC1's rows interleaved by 32: shim/common/weights.py).

Activations bf16 [C, H], no scales; the kernel stages one bf16 term per (token, slot) in its shared
workspace and its own TopkReduce sums them into `output_activation` [T, H] (fp32, slot order, rounded once:
the drop's "form A"); with the in-kernel reduce `output_activation` is the symmetric [C, H] target the ranks
add into.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_ep.formats import QuantizedActivation, QuantizedWeights
from shim.common.weights import KernelWeights, kernel_tensors, read_experts, store_experts
from shim.sm100.frontend import Sm100Frontend, tensor_workspaces

__all__ = ["Sm100Bf16Frontend", "Sm100Bf16Weights"]


@dataclass
class Sm100Bf16Weights(KernelWeights):
    fmt = "bf16"
    interleave = 32  # the kernel's GateUpInterleave, checked against the drop at kernel build
    expert_offset: int
    fc1: torch.Tensor  # (E, H, 2I) bf16, K-major, gate/up interleaved
    fc2: torch.Tensor  # (E, I, H) bf16, K-major

    @classmethod
    def empty(cls, experts, hidden, intermediate, device, expert_offset):
        return cls(expert_offset, *kernel_tensors(experts, hidden, intermediate, torch.bfloat16, device))

    def store(self, rows, qw):
        store_experts(self.fc1, self.fc2, rows, qw.w13_q, qw.w2_q, self.interleave)

    def canonical(self) -> QuantizedWeights:
        return QuantizedWeights(self.fmt, *read_experts(self.fc1, self.fc2, self.interleave),
                                expert_offset=self.expert_offset)


class Sm100Bf16Frontend(Sm100Frontend):
    fmt = "bf16"
    weights_layout = Sm100Bf16Weights

    def kernel_class(self, knobs):
        return self.symbols().Sm100MegaMoEBf16Kernel

    def kernel_interleave(self) -> int:
        return int(self.symbols().Sm100MegaMoEBf16Kernel.GateUpInterleave)

    def format_kwargs(self, knobs):
        import cutlass

        ks = self.symbols()
        return dict(token_padding_block=int(ks.EpilogueTokenTile), ab_dtype=cutlass.BFloat16, local_rank=self.rank,
                    token_back_by_dispatch=knobs.token_back_by_dispatch, generate_c=False, use_stg_fc1=False,
                    apply_topk_in_fc1=True, fc2_in_kernel_topk_reduce=knobs.fc2_in_kernel_topk_reduce)

    def input_buffers(self):
        # The per-(token, slot) terms live in the kernel's shared workspace; only activations here.
        return [("act", (self.max_tokens_per_rank, self.hidden_size), torch.bfloat16)]

    def activation_args(self, b, rows: int):
        return dict(activation=b.tensor(self.act[:rows]), fc1_c=None)

    def weight_args(self, b, w: Sm100Bf16Weights):
        return dict(fc1_weight=b.tensor(w.fc1), fc2_weight=b.tensor(w.fc2))

    def workspace_args(self, b):
        return tensor_workspaces(self, b, static_shared=False)

    def stage_activations(self, x: torch.Tensor) -> None:
        self.act[: x.shape[0]].copy_(x)

    def staged_activation(self, t: int) -> QuantizedActivation:
        return QuantizedActivation(self.fmt, self.act[:t].clone())
