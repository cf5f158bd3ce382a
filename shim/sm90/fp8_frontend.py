"""The Hopper FP8 (blockwise) MegaMoE frontend: `moe_hopper_fp8.Sm90MegaMoE{,SwapAB}Fp8Kernel`.

Per forward, bf16 activations are quantized into the symmetric buffers in 1x128 blocks (scale = amax / 448,
floored at 1e-30, q = fp8(x / scale)); the kernel pulls them, runs FC1 / SwiGLU (routing weight folded in) /
FC2 with 128x128 weight block scales and per-64 FC2-input scales it computes itself, and combines.
"""

from __future__ import annotations

import torch

from moe_ep.formats import QuantizedActivation, codecs
from shim.sm90 import weights as sm90_weights
from shim.sm90.frontend import Sm90Frontend
from shim.sm90.knobs import SCALE_MODES, Sm90Knobs

__all__ = ["Sm90Fp8Frontend"]

ACT_BLOCK = codecs.FP8_ACT_BLOCK_K


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


class Sm90Fp8Frontend(Sm90Frontend):
    fmt = "fp8_block"

    def kernel_classes(self):
        ks = self.symbols()
        if ks.Fp8GateUpInterleave != sm90_weights.GATE_UP_INTERLEAVE:
            raise RuntimeError(f"drop's Fp8GateUpInterleave={ks.Fp8GateUpInterleave}, the weight packer assumes "
                               f"{sm90_weights.GATE_UP_INTERLEAVE}")
        return ks.Sm90MegaMoEFp8Kernel, ks.Sm90MegaMoESwapABFp8Kernel

    def format_kwargs(self, knobs: Sm90Knobs):
        import cutlass

        ks = self.symbols()
        return dict(sf_padding_block=ks.SfPaddingBlock, ab_dtype=cutlass.Float8E4M3FN,
                    sf_vec_size=ks.Fp8E8M0SfVecSize, fp8_scale_mode=SCALE_MODES[self.fmt],
                    fp8_accum_mode=knobs.accum_mode)

    def input_buffers(self):
        c, h = self.max_tokens_per_rank, self.hidden_size
        return [("act", (c, h), torch.float8_e4m3fn), ("act_sf", (c, _round_up(h // ACT_BLOCK, 4)), torch.float32)]

    def stage_activations(self, x: torch.Tensor) -> None:
        # moe_ep's format quantizer: the oracle re-derives the same bytes from the same bf16 input.
        t, h = x.shape
        q, scale = codecs.fp8_quantize_rows(x, ACT_BLOCK, reciprocal=False)
        self.act[:t].view(torch.uint8).copy_(q.view(torch.uint8))
        self.act_sf[:t, : h // ACT_BLOCK].copy_(scale)

    def activation_args(self, b, rows: int):
        return dict(super().activation_args(b, rows), activation_sf=b.tensor(self.act_sf[:rows]))

    def weight_args(self, b, w: sm90_weights.Sm90KernelWeights):
        return dict(
            fc1_weight=b.tensor(w.fc1), fc1_weight_sf=b.tensor(w.fc1_scale),
            fc1_activation_dequant_scale=b.tensor(w.fc1_act_dequant, 4),
            fc1_weight_dequant_scale=b.tensor(w.fc1_w_dequant, 4),
            fc2_weight=b.tensor(w.fc2), fc2_weight_sf=b.tensor(w.fc2_scale),
            fc2_activation_dequant_scale=b.tensor(w.fc2_act_dequant, 4),
            fc2_weight_dequant_scale=b.tensor(w.fc2_w_dequant, 4),
        )

    def staged_activation(self, t: int) -> QuantizedActivation:
        return QuantizedActivation(self.fmt, self.act[:t].clone(), self.act_sf[:t, : self.hidden_size // ACT_BLOCK].clone())
