"""W4A8 MXFP4 expert weights -> the Hopper MXFP4 x FP8 kernel's tensors, and back.

What `Sm90MegaMoESwapABMxfp4Fp8Kernel.__call__` takes (drop 0.7.4; FlashInfer's adapter gives the same shapes):
  fc1_weight   uint8 (E, H/2, 2I) view of [E, 2I, H/2] storage (K stride 1): the packed e2m1 payload of the
               gate/up rows interleaved by 8 (g0..g7, u0..u7, ...), laid out by shim/sm90/fp4_layout.py;
  fc1_weight_sf uint8 [E, 2I/64, H/128, 16, 16]: the per-32 exponent offsets (1..12), folded;
  fc1_weight_dequant_scale fp32 [E]: each expert's residual 2^(lo - 122);
  fc2_weight / fc2_weight_sf / fc2_weight_dequant_scale: the same for w2, (E, I/2, H) / [E, H/64, I/128, 16, 16];
  fc1/fc2_activation_dequant_scale fp32 (1,): ones (the hybrid mode applies per-token scales in the mainloop).
The codes are moe_ep's (`quantize_weights("w4a8_mxfp4")`, or a checkpoint's pack brought into the kernel's
scale window by `codecs.mxfp4_limit_scale_range`), so `canonical()` (read back from these tensors) is what the
oracle multiplies.
"""

from __future__ import annotations

from dataclasses import dataclass
import torch

from moe_ep.core.weights import QuantizedExpertWeights
from moe_ep.errors import FormatError
from moe_ep.formats import QuantizedWeights, codecs, quantize_weights
from shim.sm90 import fp4_layout

__all__ = ["Sm90W4A8KernelWeights", "prepare", "prepare_weights", "layout_quantized", "placeholder_weights"]

GATE_UP_INTERLEAVE = codecs.FP8_GATE_UP_INTERLEAVE


@dataclass
class Sm90W4A8KernelWeights:
    fmt: str  # "w4a8_mxfp4"
    expert_offset: int
    fc1: torch.Tensor      # uint8 (E, H/2, 2I) view, K stride 1
    fc1_sf: torch.Tensor   # uint8 [E, 2I/64, H/128, 16, 16]
    fc1_residual: torch.Tensor  # fp32 [E]
    fc2: torch.Tensor      # uint8 (E, I/2, H) view, K stride 1
    fc2_sf: torch.Tensor   # uint8 [E, H/64, I/128, 16, 16]
    fc2_residual: torch.Tensor  # fp32 [E]
    one: torch.Tensor      # fp32 (1,): the activation dequant slots

    @property
    def num_experts(self) -> int:
        return self.fc1.shape[0]

    def canonical(self) -> QuantizedWeights:
        """The codes and scales read back from the kernel tensors, canonical layout (gate rows, then up)."""
        c13 = codecs.deinterleave_gate_up(fp4_layout.unpack_payload(self.fc1.transpose(1, 2)), GATE_UP_INTERLEAVE)
        s13 = codecs.deinterleave_gate_up(
            fp4_layout.mxfp4_codes_from_offsets(fp4_layout.unfold_offsets(self.fc1_sf), self.fc1_residual)
            .view(torch.uint8), GATE_UP_INTERLEAVE).view(torch.float8_e8m0fnu)
        c2 = fp4_layout.unpack_payload(self.fc2.transpose(1, 2))
        s2 = fp4_layout.mxfp4_codes_from_offsets(fp4_layout.unfold_offsets(self.fc2_sf), self.fc2_residual)
        return QuantizedWeights(self.fmt, c13, c2, s13, s2, expert_offset=self.expert_offset)


    def replace_experts(self, slots, qw: QuantizedWeights) -> None:
        """Write qw's experts (canonical w4a8_mxfp4) over experts `slots`, in place and laid out as a load lays
        them (the scale window and residual are per expert, so one expert's layout does not depend on another's):
        the kernel's tensors keep their addresses (an EPLB swap)."""
        for i, s in enumerate(slots):
            part = layout_quantized(qw.experts(slice(i, i + 1)), self.fc1.device)
            for name in ("fc1", "fc1_sf", "fc1_residual", "fc2", "fc2_sf", "fc2_residual"):
                getattr(self, name)[s:s + 1].copy_(getattr(part, name))


def _check_window(residual: torch.Tensor, leg: str) -> None:
    if not bool(torch.isfinite(residual).all()) or not bool((residual > 0).all()):
        raise FormatError(f"weights.{leg}", "an expert's MXFP4 scales are outside what the kernel's fp32 "
                                            "residual can hold (e8m0 codes above 249): weights too large")


def _lay_leg(codes: torch.Tensor, scale: torch.Tensor, leg: str, interleave: bool):
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


def layout_quantized(qw: QuantizedWeights, device) -> Sm90W4A8KernelWeights:
    """A w4a8_mxfp4 pack (canonical; e.g. from a checkpoint) -> the kernel's tensors on `device`."""
    if qw.fmt != "w4a8_mxfp4":
        raise FormatError("weights.fmt", f"the Hopper W4A8 MXFP4 layout takes fmt 'w4a8_mxfp4', got {qw.fmt!r}")
    q = qw.to(device)
    p13, f13, r13 = _lay_leg(q.w13_q, q.w13_scale, "w13", True)
    p2, f2, r2 = _lay_leg(q.w2_q, q.w2_scale, "w2", False)
    return Sm90W4A8KernelWeights("w4a8_mxfp4", qw.expert_offset, p13.transpose(1, 2), f13, r13,
                                 p2.transpose(1, 2), f2, r2, torch.ones(1, dtype=torch.float32, device=device))


def prepare_weights(w13: torch.Tensor, w2: torch.Tensor, device: torch.device, *, expert_offset: int = 0,
                    chunk_bytes: int = 1 << 30) -> Sm90W4A8KernelWeights:
    """Canonical bf16 [E, 2I, H] / [E, H, I] -> quantized (moe_ep's quantizer, on `device`) and laid out for the
    kernel, a few experts at a time into the kernel's own tensors (the fp32 temporaries stay near
    `chunk_bytes`; the scale window is per expert, so chunking does not change a byte)."""
    e, n2, h = w13.shape
    i = w2.shape[2]
    u8 = dict(dtype=torch.uint8, device=device)
    out = Sm90W4A8KernelWeights(
        "w4a8_mxfp4", expert_offset, torch.empty((e, n2, h // 2), **u8).transpose(1, 2),
        torch.empty((e, n2 // 64, h // 128, 16, 16), **u8), torch.empty(e, dtype=torch.float32, device=device),
        torch.empty((e, h, i // 2), **u8).transpose(1, 2), torch.empty((e, h // 64, i // 128, 16, 16), **u8),
        torch.empty(e, dtype=torch.float32, device=device), torch.ones(1, dtype=torch.float32, device=device))
    step = max(1, chunk_bytes // (n2 * h * 4 * 3))
    for lo in range(0, e, step):
        sl = slice(lo, min(e, lo + step))
        part = layout_quantized(quantize_weights("w4a8_mxfp4", w13[sl].to(device), w2[sl].to(device)), device)
        for name in ("fc1", "fc1_sf", "fc1_residual", "fc2", "fc2_sf", "fc2_residual"):
            getattr(out, name)[sl].copy_(getattr(part, name))
        del part
    return out


def prepare(weights, device) -> Sm90W4A8KernelWeights:
    """The layer's weights (moe_ep.ExpertWeights: quantized here; a moe_ep.QuantizedExpertWeights in w4a8_mxfp4,
    whose scales its pack check keeps inside the kernel's window: laid out as given) -> the kernel's."""
    if isinstance(weights, QuantizedExpertWeights):
        if weights.fmt != "w4a8_mxfp4":
            raise FormatError("fmt", f"the weights are quantized as {weights.fmt!r}, the Hopper W4A8 kernel runs "
                                     f"'w4a8_mxfp4'")
        return layout_quantized(weights.qw, device)
    return prepare_weights(weights.w13, weights.w2, device, expert_offset=weights.expert_offset)


def placeholder_weights(experts: int, hidden: int, intermediate: int, device=None) -> Sm90W4A8KernelWeights:
    """Zero weights of the kernel's shapes and dtypes (a compile without real weights)."""
    z13 = torch.zeros((experts, 2 * intermediate, hidden), dtype=torch.bfloat16, device=device)
    z2 = torch.zeros((experts, hidden, intermediate), dtype=torch.bfloat16, device=device)
    return prepare_weights(z13, z2, z13.device)
