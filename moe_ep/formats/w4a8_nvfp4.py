"""w4a8_nvfp4: weights e2m1 + an e4m3 scale per 16 along K + an fp32 global scale per expert (nvfp4's weight codec);
activations as w4a8_mxfp4 (e4m3, one fp32 scale per token; the FC2 input 1x64 per (token, topk)).

Pack: the nvfp4 weight fields (codes, e4m3 scales per 16, w13/w2_global_scale [E]); no activation scales (dynamic,
per token). dequant = q * scale / global_scale. K of FC1 (H) is cut by the weight scale block.
"""

from __future__ import annotations

from moe_ep.formats import codecs
from moe_ep.formats.base import (W4A8Format, check_e2m1_codes, nvfp4_dequantize_weights, nvfp4_weight_fields,
                                 nvfp4_weight_rules)

__all__ = ["W4A8Nvfp4"]


class W4A8Nvfp4(W4A8Format):
    name = "w4a8_nvfp4"
    description = "e2m1 weights + e4m3 scale per 16 along K + fp32 global scale; e4m3 activations, per-token scale"
    hidden_multiple = codecs.NVFP4_BLOCK
    weight_tolerance = 1.5e-1

    def fields(self, e, h, i):
        return nvfp4_weight_rules(e, h, i)

    def check_values(self, qw, prefix):
        check_e2m1_codes(qw, prefix)

    def quantize_weights(self, w13, w2, act_amax, fc2_act_amax):
        return nvfp4_weight_fields(w13, w2)

    def dequantize_weights(self, qw):
        return nvfp4_dequantize_weights(qw)

    def operand(self, qw, leg, e):
        return codecs.w4a8_nvfp4_kernel_operand(getattr(qw, leg + "_q")[e], getattr(qw, leg + "_scale")[e],
                                                getattr(qw, leg + "_global_scale")[e])
