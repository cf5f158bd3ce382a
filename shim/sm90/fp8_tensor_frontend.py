"""The Hopper FP8 per-tensor MegaMoE frontend: the FP8 kernels (`Sm90MegaMoE{,SwapAB}Fp8Kernel`) with
`fp8_scale_mode="per_tensor"`.

Static scales throughout: the FC1 input is quantized with the layer's calibrated activation scale
(q = sat(x / act_scale), a fused torch expression, no per-call reduction), FC1 / FC2 accumulate raw over the full
K and their epilogues multiply by act_scale * w_scale[e] (resp. fc2_act_scale * w2_scale[e]); the FC2 input is
requantized with the static fc2_act_scale. The per-token scale-factor row the kernel dispatches alongside the
activations is E8M0 metadata the per-tensor GEMMs do not read (megamoe_kernel_fp8.py); it is allocated in its
wire shape and left as it is.
"""

from __future__ import annotations

import torch

from moe_ep.formats import QuantizedActivation, codecs
from shim.sm90 import weights as sm90_weights
from shim.sm90.fp8_frontend import Sm90Fp8Frontend

__all__ = ["Sm90Fp8TensorFrontend"]


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


class Sm90Fp8TensorFrontend(Sm90Fp8Frontend):
    fmt = "fp8_tensor"
    staging = "static"

    def input_buffers(self):
        c, h = self.max_tokens_per_rank, self.hidden_size
        # 4 E8M0 bytes per dispatched uint32 word, one word per 128 K (Fp8DispatchScaleAtomK).
        return [("act", (c, h), torch.float8_e4m3fn),
                ("act_sf", (c, _round_up((h + 31) // 32, 4)), torch.float8_e8m0fnu)]

    def stage_activations(self, x: torch.Tensor) -> None:
        q = codecs.fp8_quantize_static(x, self._weights.fc1_act_dequant)
        self.act[: x.shape[0]].view(torch.uint8).copy_(q.view(torch.uint8))

    def check_on_device(self) -> None:
        """No per-call quantization kernel to check: the static quantizer is one torch expression."""

    def prepare_weights(self, weights):
        return sm90_weights.prepare(self.fmt, weights, self.device)

    def staged_activation(self, t: int) -> QuantizedActivation:
        return QuantizedActivation(self.fmt, self.act[:t].clone())
