"""nvfp4: e2m1 with one e4m3 scale per 16 along K and an fp32 global scale per tensor; static activation scales.

Pack: w13_q / w2_q uint8 e2m1 codes, one per byte (bit 3 sign, bits 0-2 magnitude index); w13_scale [E, 2I, H/16],
w2_scale [E, H, I/16] float8_e4m3fn; w13_global_scale / w2_global_scale [E] fp32; act_scale (1,) the FC1-input global
scale; fc2_act_scale [E] the FC2-input global scale per expert. dequant = q * scale / global_scale. The block-scaled
MMA multiplies q * sf exactly (e2m1 x e4m3 fits fp32's mantissa); the epilogue's alpha = 1 / (g_act * g_w).
"""

from __future__ import annotations

import torch

from moe_ep.formats import codecs
from moe_ep.formats.base import (F32, Format, check_e2m1_codes, nvfp4_dequantize_weights, nvfp4_weight_fields,
                                 nvfp4_weight_rules)

__all__ = ["Nvfp4"]


class Nvfp4(Format):
    name = "nvfp4"
    description = "e2m1 + e4m3 scale per 16 along K + fp32 global scale"
    hidden_multiple = codecs.NVFP4_BLOCK
    intermediate_multiple = codecs.NVFP4_BLOCK
    static_activation_scales = True
    per_expert_scales = ("fc2_act_scale",)
    # One e2m1 step is large: the odd FC2-input element on the other side of a rounding boundary moves a token more.
    output_tolerance = 1e-1
    weight_tolerance = 1.5e-1

    def fields(self, e, h, i):
        return dict(nvfp4_weight_rules(e, h, i), act_scale=(F32, (1,)), fc2_act_scale=(F32, (e,)))

    def check_values(self, qw, prefix):
        check_e2m1_codes(qw, prefix)

    def quantize_weights(self, w13, w2, act_amax, fc2_act_amax):
        e, dev = w13.shape[0], w13.device
        return dict(nvfp4_weight_fields(w13, w2),
                    act_scale=codecs.nvfp4_global_scale(torch.tensor(float(act_amax))).reshape(1).to(dev),
                    fc2_act_scale=codecs.nvfp4_global_scale(torch.full((e,), float(fc2_act_amax))).to(dev))

    def dequantize_weights(self, qw):
        return nvfp4_dequantize_weights(qw)

    def quantize_input(self, qw, hidden):
        return codecs.nvfp4_quantize(hidden, qw.act_scale.reshape(1, 1))

    def dequantize_input(self, qw, act):
        return codecs.nvfp4_dequantize(act.q, act.scale, qw.act_scale.reshape(1, 1))

    def fc1(self, qw, e, act):
        raw = codecs.nvfp4_dequantize_raw(act.q, act.scale) @ codecs.nvfp4_dequantize_raw(qw.w13_q[e],
                                                                                         qw.w13_scale[e]).t()
        return raw * codecs.nvfp4_alpha(qw.act_scale[0], qw.w13_global_scale[e])

    def fc2(self, qw, e, y):
        g = qw.fc2_act_scale[e]
        q, s = codecs.nvfp4_quantize(y, g.reshape(1, 1))
        raw = codecs.nvfp4_dequantize_raw(q, s) @ codecs.nvfp4_dequantize_raw(qw.w2_q[e], qw.w2_scale[e]).t()
        return raw * codecs.nvfp4_alpha(g, qw.w2_global_scale[e])
