"""mxfp8: e4m3 with one e8m0 (power of two) scale per 32 along K, activations and weights.

Pack: w13_q / w2_q e4m3; w13_scale [E, 2I, H/32], w2_scale [E, H, I/32] float8_e8m0fnu. The block scales are folded
into the operands (exact: e8m0 is a power of two)."""

from __future__ import annotations

from moe_ep.formats import codecs
from moe_ep.formats.base import E4M3, E8M0, Format

__all__ = ["Mxfp8"]

BLOCK = codecs.MX_BLOCK


class Mxfp8(Format):
    name = "mxfp8"
    description = "e4m3 + e8m0 scale per 32 along K"
    hidden_multiple = BLOCK
    intermediate_multiple = BLOCK
    output_tolerance = 3e-2
    weight_tolerance = 6e-2

    def fields(self, e, h, i):
        return dict(w13_q=(E4M3, (e, 2 * i, h)), w2_q=(E4M3, (e, h, i)), w13_scale=(E8M0, (e, 2 * i, h // BLOCK)),
                    w2_scale=(E8M0, (e, h, i // BLOCK)))

    def quantize_weights(self, w13, w2, act_amax, fc2_act_amax):
        q13, s13 = codecs.mxfp8_quantize(w13)
        q2, s2 = codecs.mxfp8_quantize(w2)
        return dict(w13_q=q13, w2_q=q2, w13_scale=s13, w2_scale=s2)

    def dequantize_weights(self, qw):
        return codecs.mxfp8_dequantize(qw.w13_q, qw.w13_scale), codecs.mxfp8_dequantize(qw.w2_q, qw.w2_scale)

    def quantize_input(self, qw, hidden):
        return codecs.mxfp8_quantize(hidden)

    def dequantize_input(self, qw, act):
        return codecs.mxfp8_dequantize(act.q, act.scale)

    def fc1(self, qw, e, act):
        return self.dequantize_input(qw, act) @ codecs.mxfp8_dequantize(qw.w13_q[e], qw.w13_scale[e]).t()

    def fc2(self, qw, e, y):
        q, s = codecs.mxfp8_quantize(y)
        return codecs.mxfp8_dequantize(q, s) @ codecs.mxfp8_dequantize(qw.w2_q[e], qw.w2_scale[e]).t()
