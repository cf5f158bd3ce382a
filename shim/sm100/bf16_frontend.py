"""The Blackwell BF16 MegaMoE frontend (`moe_bf16_glu.Sm100MegaMoEBf16Kernel`).

Activations bf16 [C, H], no scales; the kernel stages one bf16 term per (token, slot) in its shared
workspace and its own TopkReduce sums them into `output_activation` [T, H] (fp32, slot order, rounded once:
the drop's "form A"); with the in-kernel reduce `output_activation` is the symmetric [C, H] target the ranks
add into.
"""

from __future__ import annotations

import torch

from moe_ep.formats import QuantizedActivation
from shim.sm100.frontend import Sm100Frontend, tensor_workspaces

__all__ = ["Sm100Bf16Frontend"]


class Sm100Bf16Frontend(Sm100Frontend):
    fmt = "bf16"

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
        # The per-(token, slot) terms live in the kernel's shared workspace (0.7.4); only activations here.
        return [("act", (self.max_tokens_per_rank, self.hidden_size), torch.bfloat16)]

    def activation_args(self, b, rows: int):
        return dict(activation=b.tensor(self.act[:rows]), fc1_c=None)

    def weight_args(self, b, w):
        return dict(fc1_weight=b.tensor(w.fc1), fc2_weight=b.tensor(w.fc2))

    def workspace_args(self, b):
        return tensor_workspaces(self, b, static_shared=False)

    def stage_activations(self, x: torch.Tensor) -> None:
        self.act[: x.shape[0]].copy_(x)

    def staged_activation(self, t: int) -> QuantizedActivation:
        return QuantizedActivation(self.fmt, self.act[:t].clone())
