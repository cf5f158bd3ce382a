"""fp8_tensor: e4m3; one fp32 scale per expert weight, static (calibrated) activation scales.

Pack: w13_q / w2_q e4m3; w13_scale / w2_scale [E] fp32; act_scale (1,) and fc2_act_scale (1,) fp32, the static
FC1-input and FC2-input dequant scales (from ExpertWeights.act_amax / fc2_act_amax). FC1 and FC2 accumulate raw over
the full K; their epilogues multiply by one factor, act * w[e].
"""

from __future__ import annotations

import torch

from moe_ep.formats import codecs
from moe_ep.formats.base import E4M3, F32, Format

__all__ = ["Fp8Tensor"]


class Fp8Tensor(Format):
    name = "fp8_tensor"
    description = "e4m3, per-expert weight scale, static activation scales"
    static_activation_scales = True
    output_tolerance = 3e-2
    weight_tolerance = 5e-2

    def fields(self, e, h, i):
        return dict(w13_q=(E4M3, (e, 2 * i, h)), w2_q=(E4M3, (e, h, i)), w13_scale=(F32, (e,)), w2_scale=(F32, (e,)),
                    act_scale=(F32, (1,)), fc2_act_scale=(F32, (1,)))

    def quantize_weights(self, w13, w2, act_amax, fc2_act_amax):
        q13, s13 = codecs.fp8_quantize_per_expert(w13)
        q2, s2 = codecs.fp8_quantize_per_expert(w2)
        dev = w13.device
        return dict(w13_q=q13, w2_q=q2, w13_scale=s13, w2_scale=s2,
                    act_scale=codecs.fp8_tensor_scale_from_amax(act_amax, dev),
                    fc2_act_scale=codecs.fp8_tensor_scale_from_amax(fc2_act_amax, dev))

    def dequantize_weights(self, qw):
        return (qw.w13_q.to(torch.float32) * qw.w13_scale.reshape(-1, 1, 1),
                qw.w2_q.to(torch.float32) * qw.w2_scale.reshape(-1, 1, 1))

    def quantize_input(self, qw, hidden):
        return codecs.fp8_quantize_static(hidden, qw.act_scale), None

    def dequantize_input(self, qw, act):
        return act.q.to(torch.float32) * qw.act_scale.reshape(())

    def fc1(self, qw, e, act):
        raw = act.q.to(torch.float32) @ qw.w13_q[e].to(torch.float32).t()
        return raw * (qw.act_scale[0] * qw.w13_scale[e])  # the epilogue's one factor act * w[e]

    def fc2(self, qw, e, y):
        q = codecs.to_e4m3(y * torch.reciprocal(qw.fc2_act_scale[0]))  # the epilogue multiplies by 1 / scale
        raw = q.to(torch.float32) @ qw.w2_q[e].to(torch.float32).t()
        return raw * (qw.fc2_act_scale[0] * qw.w2_scale[e])

    def kernel_row_tolerance(self, intermediate_size):
        # The static FC2-input scale is sized by the calibrated amax, so a token whose SwiGLU output sits well below
        # it is quantized on fewer levels and a flipped e4m3 element weighs more than under fp8_block's per-block
        # scales: twice that bound (docs/reference.md, "Tolerances").
        return max(2 * self.output_tolerance, 1.5 / intermediate_size ** 0.5)
