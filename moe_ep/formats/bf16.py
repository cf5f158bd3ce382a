"""bf16: no quantization; the FC2 input is handed off in bf16.

Pack: w13_q [E, 2I, H] / w2_q [E, H, I] bf16, no scales. dequant = the values."""

from __future__ import annotations

import torch

from moe_ep.formats.base import Format

__all__ = ["Bf16"]


class Bf16(Format):
    name = "bf16"
    description = "bf16 weights and activations"
    quantized = False
    output_tolerance = 1e-2
    weight_tolerance = 1e-6

    def fields(self, e, h, i):
        return dict(w13_q=(torch.bfloat16, (e, 2 * i, h)), w2_q=(torch.bfloat16, (e, h, i)))

    def quantize_weights(self, w13, w2, act_amax, fc2_act_amax):
        return dict(w13_q=w13.to(torch.bfloat16), w2_q=w2.to(torch.bfloat16))

    def dequantize_weights(self, qw):
        return qw.w13_q.to(torch.float32), qw.w2_q.to(torch.float32)

    def quantize_input(self, qw, hidden):
        return hidden, None

    def dequantize_input(self, qw, act):
        return act.q.to(torch.float32)

    def fc1(self, qw, e, act):
        return act.q.to(torch.float32) @ qw.w13_q[e].to(torch.float32).t()

    def fc2(self, qw, e, y):
        # The SwiGLU output is rounded to bf16 before FC2, as the kernels hand it off.
        return y.to(torch.bfloat16).to(torch.float32) @ qw.w2_q[e].to(torch.float32).t()
