"""The Hopper W4A8 MXFP4 frontend's weight layout (shim/sm90/w4a8_frontend.py): w4a8_mxfp4 expert weights -> the
MXFP4 x FP8 kernel's tensors, and back.

What `Sm90MegaMoESwapABMxfp4Fp8Kernel.__call__` takes (FlashInfer's adapter gives the same shapes):
  fc1_weight   uint8 (E, H/2, 2I) view of [E, 2I, H/2] storage (K stride 1): the packed e2m1 payload of the
               gate/up rows interleaved by 8 (g0..g7, u0..u7, ...), laid out by shim/sm90/fp4_layout.py;
  fc1_weight_sf uint8 [E, 2I/64, H/128, 16, 16]: the per-32 exponent offsets (1..12), folded;
  fc1_weight_dequant_scale fp32 [E]: each expert's residual 2^(lo - 122);
  fc2_weight / fc2_weight_sf / fc2_weight_dequant_scale: the same for w2, (E, I/2, H) / [E, H/64, I/128, 16, 16];
  fc1/fc2_activation_dequant_scale fp32 (1,): ones (the hybrid mode applies per-token scales in the mainloop).
The codes are moe_ep's (`quantize_weights("w4a8_mxfp4")`, or a checkpoint's pack brought into the kernel's
scale window by `codecs.mxfp4_limit_scale_range`), so `canonical()` (read back from these tensors) is what the
oracle multiplies. The scale window and residual are per expert, so one expert's layout does not depend on another's
(loads a few experts at a time, swaps in place: shim/common/weights.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_ep.errors import FormatError
from moe_ep.formats import QuantizedWeights, codecs
from shim.common.weights import KernelWeights, kernel_tensors
from shim.sm90 import fp4_layout
from shim.sm90.weights import GATE_UP_INTERLEAVE

__all__ = ["Sm90W4A8Weights"]


@dataclass
class Sm90W4A8Weights(KernelWeights):
    fmt = "w4a8_mxfp4"
    quantize_bytes_per_element = 12  # the quantizer's fp32 temporaries and the layout's, per weight element
    expert_offset: int
    fc1: torch.Tensor      # uint8 (E, H/2, 2I) view, K stride 1
    fc1_sf: torch.Tensor   # uint8 [E, 2I/64, H/128, 16, 16]
    fc1_residual: torch.Tensor  # fp32 [E]
    fc2: torch.Tensor      # uint8 (E, I/2, H) view, K stride 1
    fc2_sf: torch.Tensor   # uint8 [E, H/64, I/128, 16, 16]
    fc2_residual: torch.Tensor  # fp32 [E]
    one: torch.Tensor      # fp32 (1,): the activation dequant slots

    @classmethod
    def empty(cls, experts, hidden, intermediate, device, expert_offset):
        e, h, i = experts, hidden, intermediate
        fc1, fc2 = kernel_tensors(e, h, i, torch.uint8, device, per_element=2)  # two e2m1 codes a byte
        u8, f32 = dict(dtype=torch.uint8, device=device), dict(dtype=torch.float32, device=device)
        return cls(expert_offset, fc1, torch.empty((e, 2 * i // 64, h // 128, 16, 16), **u8), torch.empty(e, **f32),
                   fc2, torch.empty((e, h // 64, i // 128, 16, 16), **u8), torch.empty(e, **f32), torch.ones(1, **f32))

    def store(self, rows, qw):
        p13, f13, r13 = _lay_leg(qw.w13_q, qw.w13_scale, "w13", True)
        p2, f2, r2 = _lay_leg(qw.w2_q, qw.w2_scale, "w2", False)
        for name, part in (("fc1", p13.transpose(1, 2)), ("fc1_sf", f13), ("fc1_residual", r13),
                           ("fc2", p2.transpose(1, 2)), ("fc2_sf", f2), ("fc2_residual", r2)):
            getattr(self, name)[rows].copy_(part)

    def canonical(self) -> QuantizedWeights:
        """The codes and scales read back from the kernel tensors, canonical layout (gate rows, then up)."""
        c13 = codecs.deinterleave_gate_up(fp4_layout.unpack_payload(self.fc1.transpose(1, 2)), GATE_UP_INTERLEAVE)
        s13 = codecs.deinterleave_gate_up(
            fp4_layout.mxfp4_codes_from_offsets(fp4_layout.unfold_offsets(self.fc1_sf), self.fc1_residual)
            .view(torch.uint8), GATE_UP_INTERLEAVE).view(torch.float8_e8m0fnu)
        c2 = fp4_layout.unpack_payload(self.fc2.transpose(1, 2))
        s2 = fp4_layout.mxfp4_codes_from_offsets(fp4_layout.unfold_offsets(self.fc2_sf), self.fc2_residual)
        return QuantizedWeights(self.fmt, c13, c2, s13, s2, expert_offset=self.expert_offset)


def _check_window(residual: torch.Tensor, leg: str) -> None:
    if not bool(torch.isfinite(residual).all()) or not bool((residual > 0).all()):
        raise FormatError(f"weights.{leg}", "an expert's MXFP4 scales are outside what the kernel's fp32 "
                                            "residual can hold (e8m0 codes above 249): weights too large")


def _lay_leg(codes: torch.Tensor, scale: torch.Tensor, leg: str, interleave: bool):
    """One weight tensor's experts (canonical codes and e8m0 scales) -> (packed payload in K-major storage, folded
    offsets, residual per expert)."""
    if bool((scale.view(torch.uint8) == 255).any()):
        raise FormatError(f"weights.{leg}", "an MXFP4 block has the NaN scale (NaN weights): the W4A8 kernel "
                                            "cannot carry it")
    codes, scale = codecs.mxfp4_limit_scale_range(codes, scale)
    offsets, residual = fp4_layout.mxfp4_offsets(scale)
    _check_window(residual, leg)
    if interleave:
        codes = codecs.interleave_gate_up(codes, GATE_UP_INTERLEAVE)
        offsets = codecs.interleave_gate_up(offsets, GATE_UP_INTERLEAVE)
    return fp4_layout.pack_payload(codes), fp4_layout.fold_offsets(offsets), residual
