"""The Hopper FP8 per-tensor MegaMoE frontend: the FP8 kernels (`Sm90MegaMoE{,SwapAB}Fp8Kernel`) with
`fp8_scale_mode="per_tensor"`, and its weight layout.

Static scales throughout: the FC1 input is quantized with the layer's calibrated activation scale
(q = sat(x / act_scale), a fused torch expression, no per-call reduction: nothing to check on the device), FC1 / FC2
accumulate raw over the full K and their epilogues multiply by act_scale * w_scale[e] (resp. fc2_act_scale *
w2_scale[e]); the FC2 input is requantized with the static fc2_act_scale. The per-token scale-factor row the kernel
dispatches alongside the activations is E8M0 metadata the per-tensor GEMMs do not read (megamoe_kernel_fp8.py); it
is allocated in its wire shape and left as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_ep.errors import FormatError
from moe_ep.formats import QuantizedActivation, QuantizedWeights, codecs
from shim.common.weights import KernelWeights, kernel_tensors, read_experts, round_up, store_experts
from shim.sm90.fp8_frontend import fp8_kernel_class, fp8_kernel_kwargs
from shim.sm90.frontend import Sm90Frontend
from shim.sm90.knobs import Sm90Knobs
from shim.sm90.weights import GATE_UP_INTERLEAVE, e8m0_placeholder, fp8_weight_args

__all__ = ["Sm90Fp8TensorFrontend", "Sm90Fp8TensorWeights"]


@dataclass
class Sm90Fp8TensorWeights(KernelWeights):
    """fp8_tensor as the FP8 kernel's per-tensor program takes it: e4m3 FC1 / FC2 (shim/sm90/weights.py), each expert's
    weight scales and the layer's static activation scales in the per-tensor dequant slots, and the blockwise scale
    slots given e8m0 placeholders (shim/sm90/weights.py e8m0_placeholder)."""

    fmt = "fp8_tensor"
    expert_offset: int
    fc1: torch.Tensor  # (E, H, 2I) e4m3 view, H stride 1, gate/up interleaved
    fc2: torch.Tensor  # (E, I, H) e4m3 view, I stride 1
    fc1_scale: torch.Tensor  # e8m0 placeholder
    fc2_scale: torch.Tensor  # e8m0 placeholder
    fc1_act_dequant: torch.Tensor  # (1,) fp32: the static FC1-input scale
    fc1_w_dequant: torch.Tensor  # (E,) fp32
    fc2_act_dequant: torch.Tensor  # (1,) fp32: the static FC2-input scale
    fc2_w_dequant: torch.Tensor  # (E,) fp32

    @classmethod
    def empty(cls, experts, hidden, intermediate, device, expert_offset):
        fc1, fc2 = kernel_tensors(experts, hidden, intermediate, torch.float8_e4m3fn, device)
        w_dequant = torch.empty((2, experts), dtype=torch.float32, device=device)
        return cls(expert_offset, fc1, fc2, e8m0_placeholder(experts, 2 * intermediate, hidden, device),
                   e8m0_placeholder(experts, hidden, intermediate, device),
                   torch.empty(1, dtype=torch.float32, device=device), w_dequant[0],
                   torch.empty(1, dtype=torch.float32, device=device), w_dequant[1])

    def store_static(self, qw):
        self.fc1_act_dequant.copy_(qw.act_scale.reshape(1))
        self.fc2_act_dequant.copy_(qw.fc2_act_scale.reshape(1))

    def store(self, rows, qw):
        store_experts(self.fc1, self.fc2, rows, qw.w13_q, qw.w2_q, GATE_UP_INTERLEAVE)
        self.fc1_w_dequant[rows].copy_(qw.w13_scale)
        self.fc2_w_dequant[rows].copy_(qw.w2_scale)

    def check_replacement(self, qw):
        # Experts replaced in place keep the layer's static activation scales, which they must share.
        for name, mine in (("act_scale", self.fc1_act_dequant), ("fc2_act_scale", self.fc2_act_dequant)):
            theirs = getattr(qw, name)
            if theirs is None or not torch.equal(theirs.reshape(-1).to(mine), mine):
                raise FormatError(f"weights.{name}", "fp8_tensor experts replaced in place keep the layer's static "
                                                     f"activation scale {mine.tolist()}, got "
                                                     f"{None if theirs is None else theirs.tolist()}")

    def canonical(self) -> QuantizedWeights:
        w13, w2 = read_experts(self.fc1, self.fc2, GATE_UP_INTERLEAVE)
        return QuantizedWeights(self.fmt, w13, w2, self.fc1_w_dequant, self.fc2_w_dequant,
                                act_scale=self.fc1_act_dequant, fc2_act_scale=self.fc2_act_dequant,
                                expert_offset=self.expert_offset)


class Sm90Fp8TensorFrontend(Sm90Frontend):
    fmt = "fp8_tensor"
    weights_layout = Sm90Fp8TensorWeights

    def kernel_class(self, knobs: Sm90Knobs):
        return fp8_kernel_class(self, knobs)

    def format_kwargs(self, knobs: Sm90Knobs):
        return fp8_kernel_kwargs(self, knobs, knobs.accum_mode)

    def input_buffers(self):
        c, h = self.max_tokens_per_rank, self.hidden_size
        # 4 E8M0 bytes per dispatched uint32 word, one word per 128 K (Fp8DispatchScaleAtomK).
        return [("act", (c, h), torch.float8_e4m3fn),
                ("act_sf", (c, round_up((h + 31) // 32, 4)), torch.float8_e8m0fnu)]

    def stage_activations(self, x: torch.Tensor) -> None:
        q = codecs.fp8_quantize_static(x, self._weights.fc1_act_dequant)
        self.act[: x.shape[0]].view(torch.uint8).copy_(q.view(torch.uint8))

    def activation_args(self, b, rows: int):
        return dict(super().activation_args(b, rows), activation_sf=b.tensor(self.act_sf[:rows]))

    def weight_args(self, b, w: Sm90Fp8TensorWeights):
        return fp8_weight_args(b, w)

    def staged_activation(self, t: int) -> QuantizedActivation:
        return QuantizedActivation(self.fmt, self.act[:t].clone())
