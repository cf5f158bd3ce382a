"""What a format's data looks like as a kernel reads it, and the one quantizer both sides use.

QuantizedWeights: the quantized expert weights a backend computes with, canonical layout (the multi-rank oracle's
input). QuantizedActivation: the FC1 input as staged. quantize_weights / quantize_input are the definition of each
format's bytes: the shim's weight packers and activation staging call them, so the kernel computes with exactly the
bytes the oracle checks against. Each function looks its format up in the table (moe_ep/formats/table.py); what a
format's pack holds is written in its own module.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Dict, Optional, Tuple

import torch

from moe_ep.errors import CalibrationError, DeviceError, DTypeError, ShapeError, WeightValueError
from moe_ep.formats.base import PER_EXPERT_FIELDS, POSITIVE_FIELDS, Rule
from moe_ep.formats.table import check_format, format_info, format_violations

__all__ = ["QuantizedWeights", "QuantizedActivation", "quantize_weights", "dequantize_weights", "quantize_input",
           "dequantize_input", "pack_rules", "check_pack"]


@dataclass
class QuantizedWeights:
    """The quantized weights a backend computes with, in the canonical (unswizzled) layout: w13_q [E, 2I, H] and
    w2_q [E, H, I] (E experts held, H hidden, I intermediate) and the scales the format carries (its module,
    moe_ep/formats/<fmt>.py, says which, of what dtype and shape, and how they dequantize).
    expert_offset: global id of expert 0 of this pack.
    """

    fmt: str
    w13_q: torch.Tensor
    w2_q: torch.Tensor
    w13_scale: Optional[torch.Tensor] = None
    w2_scale: Optional[torch.Tensor] = None
    w13_global_scale: Optional[torch.Tensor] = None
    w2_global_scale: Optional[torch.Tensor] = None
    act_scale: Optional[torch.Tensor] = None
    fc2_act_scale: Optional[torch.Tensor] = None
    expert_offset: int = 0

    def __post_init__(self):
        check_format(self.fmt, "QuantizedWeights.fmt")

    @property
    def num_experts(self) -> int:
        return self.w13_q.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w13_q.shape[2]

    @property
    def intermediate_size(self) -> int:
        return self.w2_q.shape[2]

    def tensor_fields(self) -> Tuple[str, ...]:
        return tuple(f.name for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor))

    def per_expert_fields(self) -> Tuple[str, ...]:
        """The fields indexed by expert (dim 0); the rest (a static activation scale) are the layer's."""
        names = PER_EXPERT_FIELDS + format_info(self.fmt).per_expert_scales
        return tuple(n for n in names if getattr(self, n) is not None)

    def to(self, device) -> "QuantizedWeights":
        kw = {n: getattr(self, n).to(device) for n in self.tensor_fields()}
        return replace(self, **kw)

    def experts(self, sl: slice) -> "QuantizedWeights":
        kw = {n: getattr(self, n)[sl] for n in self.per_expert_fields()}
        start = sl.start or 0
        return replace(self, expert_offset=self.expert_offset + start, **kw)

    def write_experts(self, local_slots, weights: "QuantizedWeights") -> None:
        """Rewrite rows in place: expert i of `weights` into local slot local_slots[i], every per-expert field (the
        tensors stay the same objects, so every view of them sees the new experts)."""
        for name in self.per_expert_fields():
            dst, src = getattr(self, name), getattr(weights, name)
            for i, s in enumerate(local_slots):
                dst[s].copy_(src[i])

    def dequantize(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) in fp32, canonical layout."""
        return dequantize_weights(self)


@dataclass
class QuantizedActivation:
    """Activations as a kernel reads them: q [T, H] (bf16 | e4m3 | e2m1 codes) and per-row block scales (None for
    formats whose activation scale is static: it lives in QuantizedWeights.act_scale)."""

    fmt: str
    q: torch.Tensor
    scale: Optional[torch.Tensor] = None

    def rows(self, index: torch.Tensor) -> "QuantizedActivation":
        return QuantizedActivation(self.fmt, self.q[index], None if self.scale is None else self.scale[index])


META_WEIGHTS = ("expected tensors that hold data, got meta tensors (a model built on the meta device has no weights "
                "yet: load them first)")


def count_flagged(t: torch.Tensor, bad, chunk: int) -> Tuple[int, list, Optional[int]]:
    """(how many values of t `bad` flags, up to 4 of them as floats, the flat index of the first or None), `chunk`
    values of the flattened tensor at a time: the temporaries are the caller's to size (the checkpoint loader keeps
    them a fraction of a MiB on the host; the layer's checks take one expert at a time, wherever it lives)."""
    flat = t.reshape(-1)
    n, first, at = 0, [], None
    for i in range(0, flat.numel(), max(1, chunk)):
        part = flat[i:i + chunk]
        mask = bad(part)
        k = int(mask.sum())
        if k:
            if at is None:
                at = i + int(mask.nonzero()[0])
            n += k
            if len(first) < 4:
                first += part[mask][:4 - len(first)].float().tolist()
    return n, first, at


def _refuse_flagged(t: torch.Tensor, bad, arg: str, message) -> None:
    """WeightValueError at the first expert of t [E, ...] holding a value `bad` flags, worded by
    message(expert, count, first values, place of the first); one expert at a time."""
    for x in range(t.shape[0]):
        n, first, i = count_flagged(t[x], bad, t[x].numel())
        if n:
            at = [int(v) for v in torch.unravel_index(torch.tensor(i), t[x].shape)]
            raise WeightValueError(arg, message(x, n, first, at))


def check_finite_to_quantize(fmt: str, prefix: str, **tensors: torch.Tensor) -> None:
    """Refuse bf16 weights with a NaN or inf before a quantized format takes them: its block scale saturates on an
    inf and the block's other codes round to zero, so the layer would return finite, wrong outputs (bf16 itself
    passes them through, visibly)."""
    if fmt == "bf16":
        return
    for name, t in tensors.items():
        _refuse_flagged(t, lambda v: ~torch.isfinite(v), f"{prefix}.{name}",
                        lambda x, n, first, at: f"expert {x} holds {first[0]} at {at}: fmt {fmt!r} cannot quantize "
                                                "a non-finite weight")


def quantize_weights(fmt: str, w13: torch.Tensor, w2: torch.Tensor, *, act_amax: Optional[float] = None,
                     fc2_act_amax: Optional[float] = None, expert_offset: int = 0) -> QuantizedWeights:
    """Canonical bf16 [E,2I,H] / [E,H,I] -> the format's QuantizedWeights."""
    info = format_info(fmt)
    if info.static_activation_scales and (act_amax is None or fc2_act_amax is None):
        raise CalibrationError("act_amax" if act_amax is None else "fc2_act_amax",
                               f"fmt {fmt!r} uses static activation scales: pass the calibrated amax")
    return QuantizedWeights(fmt, **info.quantize_weights(w13, w2, act_amax, fc2_act_amax),
                            expert_offset=expert_offset)


def dequantize_weights(qw: QuantizedWeights) -> Tuple[torch.Tensor, torch.Tensor]:
    return format_info(qw.fmt).dequantize_weights(qw)


def quantize_input(qw: QuantizedWeights, hidden: torch.Tensor) -> QuantizedActivation:
    """The FC1 input a kernel stages from bf16 hidden [T, H]."""
    return QuantizedActivation(qw.fmt, *format_info(qw.fmt).quantize_input(qw, hidden))


def dequantize_input(qw: QuantizedWeights, act: QuantizedActivation) -> torch.Tensor:
    return format_info(act.fmt).dequantize_input(qw, act)


def pack_rules(fmt: str, e: int, h: int, i: int) -> Dict[str, Optional[Rule]]:
    """What a QuantizedWeights pack of `fmt` holding e experts of hidden h, intermediate i must carry: field ->
    (dtype, shape), or None where the field must be absent."""
    return format_info(fmt, "weights.fmt").pack_rules(e, h, i)


def check_pack(qw: QuantizedWeights, prefix: str = "weights.qw") -> None:
    """Dtype, shape, device and value-range checks of a QuantizedWeights pack against its format's rules."""
    if not isinstance(qw, QuantizedWeights):
        raise DTypeError(prefix, f"expected moe_ep.QuantizedWeights, got {type(qw).__name__}")
    for name in ("w13_q", "w2_q"):
        t = getattr(qw, name)
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ShapeError(f"{prefix}.{name}", f"expected a 3-D tensor, got {getattr(t, 'shape', t)!r}")
    e, n2, h = qw.w13_q.shape
    i = qw.w2_q.shape[2]
    if n2 != 2 * i:
        raise ShapeError(f"{prefix}.w13_q", f"expected [E, 2*I, H] with I = {i} (from w2_q [E, H, I]), "
                                            f"got {list(qw.w13_q.shape)}")
    for arg, msg in format_violations(qw.fmt, h, i):
        raise ShapeError(f"{prefix}.{'w13_q' if arg == 'hidden_size' else 'w2_q'}", msg)
    device = qw.w13_q.device
    if device.type == "meta":
        raise DeviceError(f"{prefix}.w13_q", META_WEIGHTS)
    for name, rule in pack_rules(qw.fmt, e, h, i).items():
        t = getattr(qw, name)
        arg = f"{prefix}.{name}"
        if rule is None:
            if t is not None:
                raise ShapeError(arg, f"fmt {qw.fmt!r} carries no {name}; got a tensor")
            continue
        dtype, shape = rule
        if not isinstance(t, torch.Tensor):
            raise DTypeError(arg, f"fmt {qw.fmt!r} needs {name} as a {dtype} tensor {list(shape)}, got {t!r}")
        if t.dtype != dtype:
            raise DTypeError(arg, f"expected dtype {dtype} for fmt {qw.fmt!r}, got {t.dtype}")
        if tuple(t.shape) != shape:
            raise ShapeError(arg, f"expected {list(shape)} for fmt {qw.fmt!r}, got {list(t.shape)}")
        if t.device != device:
            raise DeviceError(arg, f"expected every tensor of the pack on {device} (w13_q's), got {t.device}")
        if name in POSITIVE_FIELDS and not bool(torch.isfinite(t).all() and (t > 0).all()):
            raise WeightValueError(arg, f"expected finite positive values, got {t.flatten()[:8].tolist()}")
        if name in BLOCK_SCALE_FIELDS and t.dtype.is_floating_point:
            _check_block_scales(t, arg)
    format_info(qw.fmt).check_values(qw, prefix)


BLOCK_SCALE_FIELDS = ("w13_scale", "w2_scale")


def _check_block_scales(t: torch.Tensor, arg: str) -> None:
    """Float block scales multiply their codes: finite and >= 0 (zero: a block of zeros), as a checkpoint's are
    (moe_ep.checkpoint); a negative or NaN one would turn a block's outputs silently. Read as float32 (e4m3 scales
    included)."""
    def bad(v):
        v = v.to(torch.float32)
        return ~torch.isfinite(v) | (v < 0)

    _refuse_flagged(t, bad, arg, lambda x, n, first, at: f"expected finite non-negative scales; expert {x} holds {n} "
                                                          f"others (e.g. {first})")
