"""The Hopper BF16 MegaMoE frontend: `moe_hopper_bf16.Sm90MegaMoE{,SwapAB}Bf16Kernel` (drop 0.7.4+).

No quantization anywhere: bf16 activations are copied into the symmetric buffer as they are, FC1 and FC2 run
on bf16 weights with fp32 accumulation, the SwiGLU output (routing weight folded in) is rounded to bf16 before
FC2. The FC1 rows use the same 8-row gate/up interleave as the FP8 kernel.
"""

from __future__ import annotations

import torch

from moe_ep.formats import QuantizedActivation
from shim.sm90 import weights as sm90_weights
from shim.sm90.frontend import Sm90Frontend

__all__ = ["Sm90Bf16Frontend"]


class Sm90Bf16Frontend(Sm90Frontend):
    fmt = "bf16"

    def kernel_class(self, knobs):
        ks = self.symbols()
        return ks.Sm90MegaMoESwapABBf16Kernel if knobs.swap_ab else ks.Sm90MegaMoEBf16Kernel

    def format_kwargs(self, knobs):
        import cutlass

        return dict(ab_dtype=cutlass.BFloat16)

    def input_buffers(self):
        return [("act", (self.max_tokens_per_rank, self.hidden_size), torch.bfloat16)]

    def prepare_routing(self, t: int) -> None:
        # Measured on the H200 (drop 0.7.4): this kernel's dispatch skips a -1 slot but its top-k reduce still
        # adds that slot's stale term (the FP8 kernel masks it). So a -1 slot is sent, with routing weight 0, to
        # this rank's first expert: the weight is folded into the SwiGLU output before FC2, so its term is an
        # exact zero. Spare rows past t stay -1 (dispatch skips them and the reduce does not cover them).
        idx = self.topk_idx[:t]
        dead = idx < 0
        self.topk_w[:t].masked_fill_(dead, 0.0)
        idx.masked_fill_(dead, self.rank * self.experts_per_rank)

    def stage_activations(self, x: torch.Tensor) -> None:
        self.act[: x.shape[0]].copy_(x)

    def weight_args(self, b, w: sm90_weights.Sm90KernelWeights):
        return dict(fc1_weight=b.tensor(w.fc1), fc2_weight=b.tensor(w.fc2))

    def staged_activation(self, t: int) -> QuantizedActivation:
        return QuantizedActivation(self.fmt, self.act[:t].clone())
