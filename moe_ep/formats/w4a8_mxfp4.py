"""w4a8_mxfp4: weights e2m1 + an e8m0 scale per 32 along K, within the SM90 kernel's exponent window (at most
MXFP4_MAX_SCALE_RANGE = 11 binades of scales per expert weight tensor); activations e4m3 with one fp32 scale per
token, the FC2 input 1x64 per (token, topk).

Pack: w13_q / w2_q uint8 e2m1 codes, one per byte (as nvfp4); w13_scale [E, 2I, H/32], w2_scale [E, H, I/32]
float8_e8m0fnu, each expert's codes within the window of its largest (quantize_weights keeps to it;
codecs.mxfp4_limit_scale_range brings any pack into it). dequant = e2m1(q) * 2^(code-127). No activation scales
(dynamic, per token). K of FC1 (H) is cut by the weight scale block.
"""

from __future__ import annotations

from moe_ep.errors import ShapeError
from moe_ep.formats import codecs
from moe_ep.formats.base import E8M0, U8, W4A8Format, check_e2m1_codes

__all__ = ["W4A8Mxfp4"]

BLOCK = codecs.MX_BLOCK


class W4A8Mxfp4(W4A8Format):
    name = "w4a8_mxfp4"
    description = "e2m1 weights + e8m0 scale per 32 along K; e4m3 activations, per-token scale"
    hidden_multiple = BLOCK
    weight_tolerance = 1.8e-1  # power-of-two block scales: ~12% on Gaussian weights

    def fields(self, e, h, i):
        return dict(w13_q=(U8, (e, 2 * i, h)), w2_q=(U8, (e, h, i)), w13_scale=(E8M0, (e, 2 * i, h // BLOCK)),
                    w2_scale=(E8M0, (e, h, i // BLOCK)))

    def check_values(self, qw, prefix):
        window = codecs.MXFP4_MAX_SCALE_RANGE  # the kernel's exponent window, per expert and weight tensor
        for name in ("w13_scale", "w2_scale"):
            for x, sc in enumerate(getattr(qw, name)):
                c = sc.view(U8)
                c = c[c != 255]
                if c.numel() and int(c.max()) - int(c.min()) > window:
                    raise ShapeError(f"{prefix}.{name}", f"expert {x}'s e8m0 scales span {int(c.max()) - int(c.min())} "
                                                         f"binades; w4a8_mxfp4 carries {window} (codecs."
                                                         "mxfp4_limit_scale_range brings a pack into it, changing "
                                                         "values: a requantization moe_ep does not do here)")
        check_e2m1_codes(qw, prefix)

    def quantize_weights(self, w13, w2, act_amax, fc2_act_amax):
        q13, s13 = codecs.mxfp4_quantize(w13)
        q2, s2 = codecs.mxfp4_quantize(w2)
        return dict(w13_q=q13, w2_q=q2, w13_scale=s13, w2_scale=s2)

    def dequantize_weights(self, qw):
        return codecs.mxfp4_dequantize(qw.w13_q, qw.w13_scale), codecs.mxfp4_dequantize(qw.w2_q, qw.w2_scale)

    def operand(self, qw, leg, e):
        return codecs.mxfp4_kernel_operand(getattr(qw, leg + "_q")[e], getattr(qw, leg + "_scale")[e])

    def kernel_row_tolerance(self, intermediate_size):
        # The kernel requantizes the FC2 input per 1x64 block, as fp8_block's does (docs/reference.md, "Tolerances").
        return max(self.output_tolerance, 0.75 / intermediate_size ** 0.5)
