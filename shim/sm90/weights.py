"""Expert weights -> the Hopper kernels' weight layouts (FP8 blockwise and per-tensor, BF16), and back. (W4A8's
packed 4-bit layout: shim/sm90/w4a8_weights.py.)

Two ways in: canonical bf16 (`prepare_weights`: quantized by moe_ep's format quantizer,
`moe_ep.formats.quantize_weights`, so the kernel computes with exactly the bytes the oracle checks against), or an
already-quantized pack (`prepare_quantized`: a checkpoint's bytes, laid out as they are). Either way this module
only lays them out (facts from the drop's runners and kernels, 0.7.2.post1 and 0.7.4):
  * FC1 rows gate/up interleaved in groups of `Fp8GateUpInterleave` (8; the BF16 kernel pairs them the same
    way): g0..g7, u0..u7, g8..g15, ...; passed as an (E, H, 2I) view whose H axis has stride 1 (K-major
    storage [E, 2I, H], permuted view);
  * FP8: scales [E, 2I/128, H/128] over the interleaved rows (a block spans 64 gate and 64 up rows, so the
    same grid is the canonical fp8_block w13_scale);
  * FC2 as an (E, I, H) view of [E, H, I] storage (I stride 1); FP8 scales [E, H/128, I/128];
  * FP8 per-tensor dequant scales: ones for blockwise (read only by the per-tensor program); for fp8_tensor the
    format's per-expert weight scales and static activation scales, with the blockwise scale slots given
    e8m0 ones of the runner's swizzled shape (E, round_up(N, 128) * round_up(K/32, 4)), which that program
    does not read (megamoe_kernel_fp8.py: "(E, flat_sf) padded/swizzled E8M0 placeholder, unused").

Nothing is held twice: `Sm90KernelWeights.canonical()` reads the oracle's view back from the tensors the
kernel is handed (FC2 is a view of the same storage, FC1 is de-interleaved into a temporary), as on sm100.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from moe_ep.core.weights import QuantizedExpertWeights
from moe_ep.errors import FormatError
from moe_ep.formats import QuantizedWeights, codecs, quantize_weights

__all__ = ["GATE_UP_INTERLEAVE", "Sm90KernelWeights", "prepare", "prepare_weights", "prepare_quantized",
           "placeholder_weights"]

GATE_UP_INTERLEAVE = codecs.FP8_GATE_UP_INTERLEAVE  # checked against the drop's constant at kernel build


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _e8m0_placeholder(e: int, n: int, k: int, device) -> torch.Tensor:
    flat = _round_up(n, 128) * _round_up((k + 31) // 32, 4)
    return torch.full((e, flat), 127, dtype=torch.uint8, device=device).view(torch.float8_e8m0fnu)


@dataclass
class Sm90KernelWeights:
    fmt: str  # "fp8_block" | "fp8_tensor" | "bf16"
    expert_offset: int
    fc1: torch.Tensor  # (E, H, 2I) view, H stride 1, gate/up interleaved
    fc2: torch.Tensor  # (E, I, H) view, I stride 1
    # FP8 only.
    fc1_scale: Optional[torch.Tensor] = None  # (E, 2I/128, H/128) fp32; fp8_tensor: e8m0 placeholder
    fc2_scale: Optional[torch.Tensor] = None  # (E, H/128, I/128) fp32; fp8_tensor: e8m0 placeholder
    fc1_act_dequant: Optional[torch.Tensor] = None  # (1,) fp32
    fc1_w_dequant: Optional[torch.Tensor] = None  # (E,) fp32
    fc2_act_dequant: Optional[torch.Tensor] = None  # (1,) fp32
    fc2_w_dequant: Optional[torch.Tensor] = None  # (E,) fp32

    @property
    def num_experts(self) -> int:
        return self.fc1.shape[0]

    def canonical(self) -> QuantizedWeights:
        """The quantized weights read back from the kernel tensors, in moe_ep's canonical layout."""
        storage = self.fc1.transpose(1, 2)  # [E, 2I, H], contiguous
        w2 = self.fc2.transpose(1, 2)  # [E, H, I], a view of the kernel's own storage
        if self.fmt == "bf16":
            return QuantizedWeights("bf16", codecs.deinterleave_gate_up(storage), w2,
                                    expert_offset=self.expert_offset)
        w13 = codecs.deinterleave_gate_up(storage.view(torch.uint8)).view(torch.float8_e4m3fn)
        if self.fmt == "fp8_tensor":
            return QuantizedWeights("fp8_tensor", w13, w2, self.fc1_w_dequant, self.fc2_w_dequant,
                                    act_scale=self.fc1_act_dequant, fc2_act_scale=self.fc2_act_dequant,
                                    expert_offset=self.expert_offset)
        return QuantizedWeights("fp8_block", w13, w2, self.fc1_scale, self.fc2_scale,
                                expert_offset=self.expert_offset)

    def replace_experts(self, slots, qw: QuantizedWeights) -> None:
        """Write qw's experts (canonical, this format) over experts `slots`, in place, packed as prepare_weights
        packs them: the kernel's tensors keep their addresses and hold a fresh load's bytes for those experts. The
        per-tensor dequant scales are ones for every expert and stay as they are (fp8_blockwise); fp8_tensor writes
        the experts' own scales and keeps the layer's static activation scales, which the new experts must share."""
        if self.fmt == "fp8_tensor":
            for name, mine in (("act_scale", self.fc1_act_dequant), ("fc2_act_scale", self.fc2_act_dequant)):
                theirs = getattr(qw, name)
                if theirs is None or not torch.equal(theirs.reshape(-1).to(mine), mine):
                    raise FormatError(f"weights.{name}", "fp8_tensor experts replaced in place keep the layer's "
                                                         f"static activation scale {mine.tolist()}, got "
                                                         f"{None if theirs is None else theirs.tolist()}")
        storage = self.fc1.transpose(1, 2), self.fc2.transpose(1, 2)
        for i, s in enumerate(slots):
            _store(self.fmt, *storage, self.fc1_scale, self.fc2_scale, slice(s, s + 1), qw.experts(slice(i, i + 1)),
                   self._w_dequant())

    def _w_dequant(self):
        return (self.fc1_w_dequant, self.fc2_w_dequant) if self.fmt == "fp8_tensor" else None


def _store(fmt: str, fc1: torch.Tensor, fc2: torch.Tensor, fc1_scale, fc2_scale, rows: slice,
           qw: QuantizedWeights, w_dequant=None) -> None:
    """Lay qw's experts (canonical) into experts `rows` of the K-major storage fc1 [E, 2I, H] / fc2 [E, H, I] (and the
    FP8 scale grids; fp8_tensor: its per-expert scales into w_dequant = (fc1's, fc2's)): the one packer of both the
    load and a swap."""
    if fmt == "bf16":
        fc1[rows].copy_(codecs.interleave_gate_up(qw.w13_q))
    else:
        fc1[rows].view(torch.uint8).copy_(codecs.interleave_gate_up(qw.w13_q.view(torch.uint8)))
        if fmt == "fp8_tensor":
            w_dequant[0][rows].copy_(qw.w13_scale)
            w_dequant[1][rows].copy_(qw.w2_scale)
        else:
            fc1_scale[rows].copy_(qw.w13_scale)
            fc2_scale[rows].copy_(qw.w2_scale)
    fc2[rows].copy_(qw.w2_q)


_FORMATS = ("fp8_block", "fp8_tensor", "bf16")


def _storage(fmt: str, e: int, h: int, i: int, device):
    """The kernel's own tensors for e experts, empty: ((fc1 [E, 2I, H], fc2 [E, H, I], the two FP8 scale slots),
    fp8_tensor's per-expert weight dequant scales [2, E] or None), as _store and _kernel_weights take them."""
    q_dtype = torch.bfloat16 if fmt == "bf16" else torch.float8_e4m3fn
    fc1 = torch.empty((e, 2 * i, h), dtype=q_dtype, device=device)  # K-major storage, gate/up interleaved
    fc2 = torch.empty((e, h, i), dtype=q_dtype, device=device)
    if fmt == "fp8_block":
        return (fc1, fc2, torch.empty((e, 2 * i // 128, h // 128), dtype=torch.float32, device=device),
                torch.empty((e, h // 128, i // 128), dtype=torch.float32, device=device)), None
    if fmt == "fp8_tensor":
        return ((fc1, fc2, _e8m0_placeholder(e, 2 * i, h, device), _e8m0_placeholder(e, h, i, device)),
                torch.empty((2, e), dtype=torch.float32, device=device))
    return (fc1, fc2, None, None), None


def _kernel_weights(fmt: str, expert_offset: int, fc1, fc2, fc1_scale, fc2_scale, w_dequant=None,
                    act=(None, None)) -> Sm90KernelWeights:
    """The filled storage as the kernel takes it; act: fp8_tensor's static (FC1-input, FC2-input) scales."""
    fc1, fc2 = fc1.permute(0, 2, 1), fc2.permute(0, 2, 1)
    if fmt == "bf16":
        return Sm90KernelWeights("bf16", expert_offset, fc1, fc2)
    if fmt == "fp8_tensor":
        return Sm90KernelWeights("fp8_tensor", expert_offset, fc1, fc2, fc1_scale=fc1_scale, fc2_scale=fc2_scale,
                                 fc1_act_dequant=act[0].reshape(1).contiguous(), fc1_w_dequant=w_dequant[0],
                                 fc2_act_dequant=act[1].reshape(1).contiguous(), fc2_w_dequant=w_dequant[1])
    e, dev = fc1.shape[0], fc1.device
    ones = torch.ones(e, dtype=torch.float32, device=dev)
    one = torch.ones(1, dtype=torch.float32, device=dev)
    return Sm90KernelWeights("fp8_block", expert_offset, fc1, fc2, fc1_scale=fc1_scale, fc2_scale=fc2_scale,
                             fc1_act_dequant=one, fc1_w_dequant=ones, fc2_act_dequant=one.clone(),
                             fc2_w_dequant=ones.clone())


def _step(n2: int, h: int, chunk_bytes: int) -> int:
    return max(1, chunk_bytes // (n2 * h * 4))


def prepare_weights(fmt: str, w13: torch.Tensor, w2: torch.Tensor, device: torch.device, *,
                    expert_offset: int = 0, chunk_bytes: int = 1 << 30, act_amax: Optional[float] = None,
                    fc2_act_amax: Optional[float] = None) -> Sm90KernelWeights:
    """Quantize (moe_ep's format quantizer, on `device`) and lay out for the `fmt` kernel.

    A few experts at a time, into the kernel's own tensors: the quantizer's fp32 temporaries stay near 1 GiB
    whatever the layer's size, and the canonical quantized FC1 is never kept (only its interleaved copy, which
    the kernel reads)."""
    e, n2, h = w13.shape
    storage, w_dequant = _storage(fmt, e, h, w2.shape[2], device)
    step = _step(n2, h, chunk_bytes)
    act = (None, None)
    for lo in range(0, e, step):
        sl = slice(lo, min(e, lo + step))
        qw = quantize_weights(fmt, w13[sl].to(device), w2[sl].to(device), act_amax=act_amax,
                              fc2_act_amax=fc2_act_amax)
        _store(fmt, *storage, sl, qw, w_dequant)
        act = (qw.act_scale, qw.fc2_act_scale)
        del qw
    return _kernel_weights(fmt, expert_offset, *storage, w_dequant, act)


def prepare_quantized(qw: QuantizedWeights, device: torch.device, *,
                      chunk_bytes: int = 1 << 30) -> Sm90KernelWeights:
    """Lay out an already-quantized pack (fp8_block, fp8_tensor or bf16, canonical layout) for its kernel, bit for
    bit: its e4m3 codes and fp32 scales (128x128 blocks, or one per expert and the static activation scales; or
    bf16 values) are copied, gate/up interleaved, never requantized. The pack's fp8_block w13_scale grid is the
    kernel's own (a block over 64 gate + 64 up rows), so it is copied as it is. A few experts at a time (moved to
    `device` first when the pack lives elsewhere, e.g. host -> GPU)."""
    if qw.fmt not in _FORMATS:
        raise FormatError("weights.qw.fmt", f"the sm90 {list(_FORMATS)} weight layouts cannot take a {qw.fmt!r} "
                                            f"pack")
    e, n2, h = qw.w13_q.shape
    storage, w_dequant = _storage(qw.fmt, e, h, qw.intermediate_size, device)
    step = _step(n2, h, chunk_bytes)
    for lo in range(0, e, step):
        sl = slice(lo, min(e, lo + step))
        _store(qw.fmt, *storage, sl, qw.experts(sl).to(device), w_dequant)
    return _kernel_weights(qw.fmt, qw.expert_offset, *storage, w_dequant, (qw.act_scale, qw.fc2_act_scale))


def prepare(fmt: str, weights, device: torch.device) -> Sm90KernelWeights:
    """The layer's weights (moe_ep.ExpertWeights: quantized here, with its calibration; moe_ep.QuantizedExpertWeights:
    laid out as given) -> the `fmt` kernel's."""
    if isinstance(weights, QuantizedExpertWeights):
        if weights.fmt != fmt:
            raise FormatError("fmt", f"the weights are quantized as {weights.fmt!r}, the sm90 kernel runs {fmt!r}")
        return prepare_quantized(weights.qw, device)
    cal = dict(act_amax=weights.act_amax, fc2_act_amax=weights.fc2_act_amax) if fmt == "fp8_tensor" else {}
    return prepare_weights(fmt, weights.w13, weights.w2, device, expert_offset=weights.expert_offset, **cal)


def placeholder_weights(fmt: str, experts: int, hidden: int, intermediate: int, device=None) -> Sm90KernelWeights:
    """Zero weights of the right shapes and dtypes (a compile without real weights)."""
    z13 = torch.zeros((experts, 2 * intermediate, hidden), dtype=torch.bfloat16, device=device)
    z2 = torch.zeros((experts, hidden, intermediate), dtype=torch.bfloat16, device=device)
    cal = dict(act_amax=1.0, fc2_act_amax=1.0) if fmt == "fp8_tensor" else {}
    return prepare_weights(fmt, z13, z2, z13.device, **cal)
