"""The Hopper BF16 MegaMoE frontend: `moe_hopper_bf16.Sm90MegaMoE{,SwapAB}Bf16Kernel` (drop 0.7.4+).

No quantization anywhere: bf16 activations are copied into the symmetric buffer as they are, FC1 and FC2
run on bf16 weights with fp32 accumulation, the SwiGLU output (routing weight folded in) is rounded to bf16
before FC2. The FC1 rows use the same 8-row gate/up interleave as the FP8 kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_ep.core.weights import QuantizedWeights
from moe_ep.reference import quant
from shim.sm90.frontend import Sm90Frontend

__all__ = ["Sm90Bf16Frontend", "Bf16KernelWeights"]


@dataclass
class Bf16KernelWeights:
    canonical: QuantizedWeights  # fmt "bf16": the weights as given
    fc1: torch.Tensor  # (E, H, 2I) bf16 view, H stride 1, gate/up interleaved
    fc2: torch.Tensor  # (E, I, H) bf16 view, I stride 1


class Sm90Bf16Frontend(Sm90Frontend):
    fmt = "bf16"

    def __init__(self, *, fmt: str = "bf16", **kw):
        if fmt != "bf16":
            raise ValueError(f"the BF16 frontend serves fmt 'bf16', got {fmt!r}")
        for name in ("hidden", "intermediate"):
            if kw[name] % 64:
                raise ValueError(f"{name}={kw[name]} must be a multiple of 64 for the BF16 kernel (K tile 64)")
        super().__init__(**kw)

    def kernel_classes(self):
        ks = self.symbols()
        return ks.Sm90MegaMoEBf16Kernel, ks.Sm90MegaMoESwapABBf16Kernel

    def input_buffers(self):
        return [("act", (self.capacity, self.hidden), torch.bfloat16)]

    def stage_activations(self, x: torch.Tensor) -> None:
        self.act[: x.shape[0]].copy_(x)

    def prepare_weights(self, w13, w2):
        qw = quant.quantize_weights("bf16", w13.to(self.device), w2.to(self.device),
                                    expert_offset=self.rank * self.experts_per_rank)
        fc1 = quant.interleave_gate_up(qw.w13_q)
        return Bf16KernelWeights(canonical=qw, fc1=fc1.permute(0, 2, 1), fc2=qw.w2_q.permute(0, 2, 1))

    def activation_args(self, b, rows: int):
        return dict(activation=b.tensor(self.act[:rows]))

    def weight_args(self, b, w: Bf16KernelWeights):
        return dict(fc1_weight=b.tensor(w.fc1), fc2_weight=b.tensor(w.fc2))

    def staged_activation(self, t: int):
        return self.act[:t].clone()
