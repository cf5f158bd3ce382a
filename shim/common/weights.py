"""What every kernel weight layout does, whatever the tree and the format: the ways in, the way back, the in-place swap.

Each format's frontend module (shim/<arch>/<format>_frontend.py) defines its layout as a `KernelWeights` subclass:
the kernel's own tensors for E experts and three hooks, `empty` (allocate them), `store` (lay a few experts of a
moe_ep.QuantizedWeights pack, canonical layout, into their rows) and `canonical` (read the pack back from those
tensors, for the oracle). The composers below are the same on every arch:

  from_bf16    canonical bf16 -> moe_ep's format quantizer (the oracle's bytes) -> store, a few experts at a time, so
               the quantizer's fp32 temporaries stay near `chunk_bytes` whatever the layer's size
  from_pack    an already-quantized pack (a checkpoint's bytes) -> store, as it is, never requantized
  prepare      the layer's weights (moe_ep.ExpertWeights or QuantizedExpertWeights) -> one of the two
  placeholder  zero weights of the kernel's shapes and dtypes (a compile without real weights)
  replace_experts  new experts over some rows, in place through the same `store`: the kernel's tensors keep their
               addresses (compiled kernels and captured graphs stay valid) and hold a fresh load's bytes

Nothing is held twice: `canonical()` reads the kernel's tensors back rather than keeping the quantized pack aside.

Both trees take expert weights K-major with FC1's gate and up rows interleaved in groups (g0..g(G-1), u0..u(G-1),
gG, ...; G is the kernel's SwiGLU pairing): FC1 as an (E, K, 2I) view of [E, 2I, K] storage, FC2 as an (E, I', H)
view of [E, H, I'] storage (K and I' in storage elements: an e2m1 pair holds two). `kernel_tensors`,
`store_experts` and `read_experts` are that layout.
"""

from __future__ import annotations

from typing import ClassVar, Optional, Tuple

import torch

from moe_ep.core.weights import QuantizedExpertWeights
from moe_ep.errors import FormatError
from moe_ep.formats import QuantizedWeights, codecs, quantize_weights

__all__ = ["KernelWeights", "round_up", "copy_bytes", "kernel_tensors", "store_experts", "read_experts"]


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src), as bytes for one-byte element types (e4m3, e8m0, e2m1 pairs: a bit copy, never a cast)."""
    if dst.element_size() == 1:
        dst, src = dst.view(torch.uint8), src.view(torch.uint8)
    dst.copy_(src)


def _interleave(w: torch.Tensor, group: int, inverse: bool = False) -> torch.Tensor:
    """Gate/up row (de)interleave of any element type (one-byte types moved as bytes)."""
    move = codecs.deinterleave_gate_up if inverse else codecs.interleave_gate_up
    if w.element_size() == 1:
        return move(w.view(torch.uint8), group).view(w.dtype)
    return move(w, group)


def kernel_tensors(experts: int, hidden: int, intermediate: int, dtype: torch.dtype, device,
                   per_element: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    """The kernel's FC1 (E, H', 2I) and FC2 (E, I', H) views of fresh K-major storage ([E, 2I, H'], [E, H, I']; a K
    extent counts storage elements: `per_element` values each)."""
    fc1 = torch.empty((experts, 2 * intermediate, hidden // per_element), dtype=dtype, device=device)
    fc2 = torch.empty((experts, hidden, intermediate // per_element), dtype=dtype, device=device)
    return fc1.transpose(1, 2), fc2.transpose(1, 2)


def store_experts(fc1: torch.Tensor, fc2: torch.Tensor, rows: slice, w13: torch.Tensor, w2: torch.Tensor,
                  group: int) -> None:
    """Canonical w13 [n, 2I, H'] / w2 [n, H, I'] (in the storage's element type) into experts `rows` of the kernel
    views fc1 / fc2, FC1's rows interleaved by `group`; bytes copied as they are."""
    copy_bytes(fc1.transpose(1, 2)[rows], _interleave(w13, group))
    copy_bytes(fc2.transpose(1, 2)[rows], w2)


def read_experts(fc1: torch.Tensor, fc2: torch.Tensor, group: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(w13 [E, 2I, H'], w2 [E, H, I']) canonical, from the kernel views: FC1 de-interleaved into a temporary, FC2 a
    view of the kernel's own storage."""
    return _interleave(fc1.transpose(1, 2).contiguous(), group, inverse=True), fc2.transpose(1, 2)


class KernelWeights:
    """One format's expert weights as its kernel reads them. Subclasses are dataclasses holding the kernel's tensors
    and `expert_offset` (the global id of expert 0), and set `fmt`."""

    fmt: ClassVar[str]
    expert_offset: int
    # fp32 bytes the quantizer holds per weight element while a chunk is quantized (from_bf16's chunk size).
    quantize_bytes_per_element: ClassVar[int] = 4

    # -- hooks -------------------------------------------------------------------------------------------------
    @classmethod
    def empty(cls, experts: int, hidden: int, intermediate: int, device, expert_offset: int) -> "KernelWeights":
        """The kernel's tensors for `experts` experts, allocated, not filled."""
        raise NotImplementedError

    def store(self, rows: slice, qw: QuantizedWeights) -> None:
        """Lay qw's experts (canonical, this format, len(rows) of them, on this device) into experts `rows`."""
        raise NotImplementedError

    def store_static(self, qw: QuantizedWeights) -> None:
        """Keep the layer-wide scales qw carries (a static activation scale), where the layout holds them; runs
        before `store` at load, never at a swap (the layer's static scales are fixed once loaded)."""

    def canonical(self) -> QuantizedWeights:
        """The quantized weights read back from the kernel's tensors, in moe_ep's canonical layout."""
        raise NotImplementedError

    def check_replacement(self, qw: QuantizedWeights) -> None:
        """Refuse experts that cannot join this layout in place (a layer-wide scale they do not share)."""

    @property
    def num_experts(self) -> int:
        return self.fc1.shape[0]  # every layout's FC1 is indexed by expert first

    # -- composers ---------------------------------------------------------------------------------------------
    @classmethod
    def from_bf16(cls, w13: torch.Tensor, w2: torch.Tensor, device, *, expert_offset: int = 0,
                  chunk_bytes: int = 1 << 30, act_amax: Optional[float] = None,
                  fc2_act_amax: Optional[float] = None) -> "KernelWeights":
        """Canonical bf16 [E, 2I, H] / [E, H, I] -> quantized (moe_ep's format quantizer, on `device`) and laid out,
        a few experts at a time into the kernel's own tensors (every layout step is per expert, so chunking does not
        change a byte). act_amax / fc2_act_amax: a statically scaled format's calibration."""
        e, n2, h = w13.shape
        out = cls.empty(e, h, n2 // 2, device, expert_offset)
        step = max(1, chunk_bytes // (n2 * h * cls.quantize_bytes_per_element))
        for lo in range(0, e, step):
            sl = slice(lo, min(e, lo + step))
            qw = quantize_weights(cls.fmt, w13[sl].to(device), w2[sl].to(device), act_amax=act_amax,
                                  fc2_act_amax=fc2_act_amax)
            out.store_static(qw)
            out.store(sl, qw)
            del qw
        return out

    @classmethod
    def from_pack(cls, qw: QuantizedWeights, device, *, chunk_bytes: int = 1 << 30) -> "KernelWeights":
        """An already-quantized pack (canonical layout) laid out for the kernel bit for bit: its codes and scales
        are copied and rearranged, never requantized. A few experts at a time (moved to `device` first when the
        pack lives elsewhere, e.g. host -> GPU)."""
        if qw.fmt != cls.fmt:
            raise FormatError("weights.qw.fmt", f"the {cls.__name__} layout takes fmt {cls.fmt!r}, got {qw.fmt!r}")
        e, n2, h = qw.w13_q.shape
        out = cls.empty(e, h, qw.intermediate_size, device, qw.expert_offset)
        step = max(1, chunk_bytes // (n2 * h * 4))
        for lo in range(0, e, step):
            sl = slice(lo, min(e, lo + step))
            part = qw.experts(sl).to(device)
            out.store_static(part)
            out.store(sl, part)
        return out

    @classmethod
    def prepare(cls, weights, device) -> "KernelWeights":
        """The layer's weights (moe_ep.ExpertWeights: quantized here, with its calibration; a
        moe_ep.QuantizedExpertWeights: laid out as given) -> the kernel's."""
        if isinstance(weights, QuantizedExpertWeights):
            if weights.fmt != cls.fmt:
                raise FormatError("fmt", f"the weights are quantized as {weights.fmt!r}, the kernel runs {cls.fmt!r}")
            return cls.from_pack(weights.qw, device)
        return cls.from_bf16(weights.w13, weights.w2, device, expert_offset=weights.expert_offset,
                             act_amax=weights.act_amax, fc2_act_amax=weights.fc2_act_amax)

    @classmethod
    def placeholder(cls, experts: int, hidden: int, intermediate: int, device=None) -> "KernelWeights":
        """Zero weights of the kernel's shapes and dtypes (a compile without real weights; a statically scaled
        format gets a calibration of 1)."""
        z13 = torch.zeros((experts, 2 * intermediate, hidden), dtype=torch.bfloat16, device=device)
        z2 = torch.zeros((experts, hidden, intermediate), dtype=torch.bfloat16, device=device)
        return cls.from_bf16(z13, z2, z13.device, act_amax=1.0, fc2_act_amax=1.0)

    def replace_experts(self, slots, qw: QuantizedWeights) -> None:
        """Write qw's experts (canonical, this format) over experts `slots`, in place, laid out as a load lays them."""
        self.check_replacement(qw)
        for i, s in enumerate(slots):
            self.store(slice(s, s + 1), qw.experts(slice(i, i + 1)))
