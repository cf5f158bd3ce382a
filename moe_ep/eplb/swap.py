"""Replacing the experts of a layer's slots in place, collectively (docs/eplb.md: "Swaps").

Each call checks everything on every rank first (slot ids, the weights' format, dtypes and shapes, the map), agrees
across ranks (moe_ep.core.dist.run_agreed: a rank that refuses makes every rank raise, before anything changed), and
only then moves bytes and writes: the backend's Backend.replace_experts writes the new experts into the tensors the
kernel already reads (same addresses, the load's own packer), then the router's device map is rewritten in place.
Everything is enqueued on the current stream: forwards enqueued before a swap read the old experts, forwards (and
graph replays) enqueued after it read the new ones.
"""

from __future__ import annotations

from dataclasses import replace as dc_replace
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from moe_ep.core.backend import Backend
from moe_ep.core.dist import all_to_all_rows, run_agreed
from moe_ep.eplb.expert_map import ExpertMap
from moe_ep.errors import (BackendUnavailableError, CalibrationError, DTypeError, ExpertIndexError, ExpertMapError,
                           FormatError, ShapeError)
from moe_ep.formats import QuantizedWeights, format_info, quantize_weights
from moe_ep.formats.packs import check_finite_to_quantize, check_pack

__all__ = ["replace_experts", "rearrange"]


def _local_slots(slots, slots_per_rank: int) -> List[int]:
    """Local slot ids (a sequence of ints or a 1-D integer tensor) -> a list of distinct ints in [0, slots_per_rank)."""
    if isinstance(slots, torch.Tensor):
        if slots.dtype.is_floating_point or slots.dtype == torch.bool or slots.dim() != 1:
            raise ExpertIndexError("slots", f"expected a 1-D integer tensor of local slot ids, got {slots.dtype} "
                                            f"{list(slots.shape)}")
        out = slots.tolist()
    else:
        try:
            out = list(slots)
        except TypeError:
            raise ExpertIndexError("slots", f"expected a sequence of local slot ids, got {type(slots).__name__}") \
                from None
    for s in out:
        if isinstance(s, bool) or not isinstance(s, int):
            raise ExpertIndexError("slots", f"expected int slot ids, got {s!r}")
        if not 0 <= s < slots_per_rank:
            raise ExpertIndexError("slots", f"local slot id {s} is outside [0, {slots_per_rank}) (this rank's "
                                            f"slots; the global slot is rank * {slots_per_rank} + local)")
    if len(set(out)) != len(out):
        raise ExpertIndexError("slots", f"slot ids repeat: {out}")
    return out


def _template(layer) -> QuantizedWeights:
    """One expert of what the backend computes with (dtypes, per-expert shapes) and its global tensors (static
    scales, fixed at load): what replacement weights must look like. Read once, from the backend itself."""
    if layer._swap_template is None:
        qw = layer.backend.oracle_weights()
        per = set(qw.per_expert_fields())
        kw = {n: (getattr(qw, n)[:1] if n in per else getattr(qw, n)).clone() for n in qw.tensor_fields()}
        layer._swap_template = dc_replace(qw, expert_offset=0, **kw)
    return layer._swap_template


def _quantized(layer, n: int, weights) -> Optional[QuantizedWeights]:
    """The replacement for n slots as the backend's QuantizedWeights on the layer's device, or a typed error."""
    if weights is None:
        if n:
            raise DTypeError("weights", f"expected the weights of the {n} slot(s) being replaced, got None")
        return None
    tmpl = _template(layer)
    dev = layer.ctx.device
    per = set(tmpl.per_expert_fields())
    if isinstance(weights, QuantizedWeights):
        if weights.fmt != layer.fmt:
            raise FormatError("weights.fmt", f"this layer runs {layer.fmt!r}, got QuantizedWeights of {weights.fmt!r}")
        if n:  # dtypes, shapes, and values (finite positive scales, the format's code and scale ranges)
            check_pack(weights, "weights")
        have, want = set(weights.tensor_fields()), set(tmpl.tensor_fields())
        if have != want:
            raise FormatError("weights", f"{layer.fmt!r} weights carry {sorted(want)}, got {sorted(have)}")
        for name in sorted(want):
            got, ref = getattr(weights, name), getattr(tmpl, name)
            if got.dtype != ref.dtype:
                raise DTypeError(f"weights.{name}", f"expected dtype {ref.dtype}, got {got.dtype}")
            shape = ((n,) + tuple(ref.shape[1:])) if name in per else tuple(ref.shape)
            if tuple(got.shape) != shape:
                raise ShapeError(f"weights.{name}", f"expected {list(shape)} ({n} slot(s)), got {list(got.shape)}")
            if name not in per and not torch.equal(got.to(dev).view(torch.uint8), ref.view(torch.uint8)):
                raise CalibrationError(f"weights.{name}", f"the layer's static {name} is fixed at load "
                                                          f"({ref.tolist()}); got {got.tolist()}")
        return dc_replace(weights.to(dev), expert_offset=0) if n else None
    if not isinstance(weights, (tuple, list)) or len(weights) != 2:
        raise DTypeError("weights", "expected (w13 [n, 2I, H], w2 [n, H, I]) bf16 tensors or a "
                                    f"moe_ep.QuantizedWeights, got {type(weights).__name__}")
    h, i = layer.spec.hidden_size, layer.spec.intermediate_size
    for name, t, shape in (("w13", weights[0], (n, 2 * i, h)), ("w2", weights[1], (n, h, i))):
        if not isinstance(t, torch.Tensor):
            raise DTypeError(f"weights.{name}", f"expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.bfloat16:
            raise DTypeError(f"weights.{name}", f"expected dtype torch.bfloat16, got {t.dtype}")
        if tuple(t.shape) != shape:
            raise ShapeError(f"weights.{name}", f"expected {list(shape)} ([slots, ...]), got {list(t.shape)}")
    if not n:
        return None
    check_finite_to_quantize(layer.fmt, "weights", w13=weights[0], w2=weights[1])
    cal = layer._calibration
    if format_info(layer.fmt).static_activation_scales and None in cal.values():
        raise CalibrationError("weights", f"fmt {layer.fmt!r} has static activation scales and this layer knows no "
                               "calibration to quantize bf16 with: pass QuantizedWeights")
    qw = quantize_weights(layer.fmt, weights[0].to(dev), weights[1].to(dev), **cal)
    return dc_replace(qw, expert_offset=0)


def _supported(layer) -> None:
    if type(layer.backend).replace_experts is Backend.replace_experts:
        raise BackendUnavailableError("backend", f"backend {layer.backend_name!r} cannot replace experts in place "
                                                 "(it does not implement Backend.replace_experts)")


def replace_experts(layer, slots, weights) -> List[int]:
    """Collective: write `weights` over this rank's local `slots`; the map is unchanged. Returns the slots written."""
    s_local = layer.slots_per_rank

    def check():
        _supported(layer)
        mine = _local_slots(slots, s_local)
        return mine, _quantized(layer, len(mine), weights)

    mine, qw = run_agreed(layer.ctx, check, "replace_experts() arguments")
    if mine:
        layer.backend.replace_experts(mine, qw)
    return mine


def _agree_on_map(ctx, expert_map: ExpertMap, fetching: bool) -> List[bool]:
    """Collective (one all_reduce): ExpertMapError on every rank unless every rank passed the same map; returns,
    per rank, whether it copies slots from their holders (so every rank knows what it has to send)."""
    world = ctx.world_size
    v = torch.zeros(2 + world, dtype=torch.int64)
    v[0], v[1] = expert_map.digest(), -expert_map.digest()
    v[2 + ctx.rank] = int(fetching)
    v = v.to(ctx.comm_device)
    dist.all_reduce(v, op=dist.ReduceOp.MAX, group=ctx.group)
    v = v.cpu()
    if int(v[0]) != -int(v[1]):
        raise ExpertMapError("expert_map", "ranks were given different expert maps; every rank must pass the same "
                                           "one (nothing was changed)")
    return [bool(f) for f in v[2:].tolist()]


def rearrange(layer, expert_map: ExpertMap, weights=None) -> List[int]:
    """Collective: install `expert_map`, rewriting the slots whose logical expert changes. Returns this rank's
    rewritten local slots."""
    router = layer._eplb
    s_local = layer.slots_per_rank

    def check():
        if router is None or router.expert_map is None:
            raise ExpertMapError("expert_map", "this layer was built without an expert map (MoELayer(..., "
                                               "expert_map=...)): its slots are its experts; use replace_experts()")
        if not isinstance(expert_map, ExpertMap):
            raise DTypeError("expert_map", f"expected a moe_ep.ExpertMap, got {type(expert_map).__name__}")
        old = router.expert_map
        changed = old.changed_slots(expert_map)
        lo = layer.ctx.rank * s_local
        mine = [s - lo for s in changed if lo <= s < lo + s_local]
        _supported(layer)
        qw = None if weights is None else _quantized(layer, len(mine), weights)
        if changed:
            _template(layer)  # the rows a fetch moves, read before anything does
        return old, changed, mine, qw

    old, changed, mine, qw = run_agreed(layer.ctx, check, "rearrange() arguments")
    fetchers = _agree_on_map(layer.ctx, expert_map, weights is None and bool(mine))
    if any(fetchers):
        fetched = _fetch_from_holders(layer, old, expert_map, changed, fetchers)
        qw = fetched if weights is None else qw
    if mine:
        layer.backend.replace_experts(mine, qw)
    router.install(expert_map)
    return mine


def _stack(rows: List[torch.Tensor]) -> torch.Tensor:
    """torch.stack through byte views: the 1-byte float formats (e4m3, e8m0) have no stack kernel everywhere."""
    flat = torch.stack([r.contiguous().reshape(-1).view(torch.uint8) for r in rows])
    return flat.view(rows[0].dtype).reshape(len(rows), *rows[0].shape)


def _moves(old: ExpertMap, new: ExpertMap, changed: List[int], s_local: int,
           fetchers: List[bool]) -> List[Tuple[int, int]]:
    """(destination slot, source slot) for every changed slot of a fetching rank: a slot that holds the expert under
    the old map, on the destination's own rank when there is one (no transfer), else its first replica. Every rank
    computes the same list."""
    moves = []
    for d in changed:
        if not fetchers[d // s_local]:
            continue
        holders = old.slots_of(new.logical_of(d))
        local = [h for h in holders if h // s_local == d // s_local]
        moves.append((d, (local or holders)[0]))
    return moves


def _fetch_from_holders(layer, old: ExpertMap, new: ExpertMap, changed: List[int],
                        fetchers: List[bool]) -> Optional[QuantizedWeights]:
    """The quantized bytes of this rank's changed slots (when it fetches), read from the slots that hold those experts
    now, before anything is written (so experts may trade places): local ones copied, remote ones in one all_to_all
    (every rank takes part when any expert crosses ranks: holders send even if they fetch nothing)."""
    ctx, s_local = layer.ctx, layer.slots_per_rank
    rank, world = ctx.rank, ctx.world_size
    tmpl = _template(layer)
    names = tmpl.per_expert_fields()
    moves = _moves(old, new, changed, s_local, fetchers)
    owner = lambda s: s // s_local  # noqa: E731
    current = layer.backend.oracle_weights() if any(owner(s) == rank for _, s in moves) else None

    def rows(local_ids: List[int]) -> List[torch.Tensor]:
        if not local_ids:
            return [getattr(tmpl, n)[:0] for n in names]
        return [_stack([getattr(current, n)[i] for i in local_ids]) for n in names]

    received: Dict[int, List[torch.Tensor]] = {}
    remote = [(d, s) for d, s in moves if owner(d) != owner(s)]
    if remote:
        sends = sorted(((owner(d), d), s) for d, s in remote if owner(s) == rank)
        counts = torch.bincount(torch.tensor([r for (r, _), _ in sends], dtype=torch.int64), minlength=world)
        got, _ = all_to_all_rows(ctx, rows([s - rank * s_local for _, s in sends]), counts)
        arrivals = [d for src in range(world) for d, s in sorted(remote) if owner(d) == rank and owner(s) == src]
        for row, d in enumerate(arrivals):
            received[d] = [t[row] for t in got]
    mine = [(d, s) for d, s in moves if owner(d) == rank]
    if not mine:
        return None
    fields = {}
    for k, n in enumerate(names):
        parts = [received[d][k] if d in received else getattr(current, n)[s - rank * s_local] for d, s in mine]
        fields[n] = _stack(parts).to(ctx.device)
    return dc_replace(tmpl, **fields)
