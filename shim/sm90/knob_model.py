"""A knob default for the geometries no shipped table covers, derived from what the tables measured.

The drop's heuristic picks a knob set by capacity alone. What the shipped tables show deciding is the number of rows
each local expert's GEMMs get at full capacity under balanced routing, tokens per local expert
tpe = C * K / E_local (the same at any world size: W ranks send C * K rows each over W * E_local experts). The
shipped winners sort by it: at tpe <= 8 swap-AB with 8- or 16-token tiles; at tpe 32 the plain order with
a 64 x 128 tile; from tpe 128 on the plain order with a 64 x 256 tile, mostly with a 2-CTA cluster. The same
capacity at another expert count (48 local experts instead of 32) moves tpe, and with it the right knobs; the
heuristic does not see it (docs/tuning.md has the case that showed it).

choose() takes the knob sets that won somewhere (the shipped entries of the same GPU, drop and format), and
scores each by the nearest entry it won at plus how its token tile fits this geometry:

    distance(entry, geometry) = |log2 tpe ratio| + 1/4 (|log2 H ratio| + |log2 I ratio| + |log2 K ratio|)
    misfit(set, geometry)     = |log2(token tile x token-side cluster / clamp(2 tpe, 8, 128))|
    score                     = min over the entries it won of distance, + 1/2 misfit

The lowest score the kernel accepts wins (the kernel's constructor is asked through `accepts`, as the tuner asks
it: no compile). The weights were set from the tables' pattern above, not fitted (there are too few entries to
fit them honestly); tools/tune/knob_model_eval.py measures the choice by leaving entries out. Only measurements of
this GPU and this drop are used: on another GPU or drop there is nothing to derive from, and the heuristic
stays the default.

Plain Python, no torch and no kernel tree: the evaluation tool runs it anywhere.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

__all__ = ["Geometry", "Measured", "parse_key", "measured_entries", "ranked", "choose", "for_backend"]

# Weights of the score (module docstring); the same for every format.
SIZE_WEIGHT = 0.25
MISFIT_WEIGHT = 0.5
FIT_MIN, FIT_MAX = 8, 128
# A set is only taken from an entry within this many doublings of tokens per expert: farther than 4x, the tables
# say nothing about this geometry, and the heuristic stays.
MAX_TPE_GAP = 2.0

_KEY = re.compile(r"^(?P<arch>sm\d+)/(?P<fmt>[^/]+)/H(?P<h>\d+)/I(?P<i>\d+)/E(?P<e>\d+)/K(?P<k>\d+)/W(?P<w>\d+)/"
                  r"C(?P<c>\d+)(?:/dev=(?P<dev>[^/]+)/drop=(?P<drop>[0-9a-f]+))?$")


@dataclass(frozen=True)
class Geometry:
    """One layer as the knob cache keys it: format, H, I (the down projection's K), local experts, top-k, world
    size and capacity (max tokens per rank)."""

    fmt: str
    hidden: int
    intermediate: int
    experts_per_rank: int
    top_k: int
    world_size: int
    capacity: int

    @property
    def tokens_per_expert(self) -> float:
        return self.capacity * self.top_k / self.experts_per_rank


@dataclass(frozen=True)
class Measured:
    """A shipped entry: where it was measured, the set that won there, and the key it is filed under."""

    geometry: Geometry
    knobs: Mapping[str, Any]
    key: str


def parse_key(key: str) -> Optional[Tuple[str, Geometry, Optional[str], Optional[str]]]:
    """(arch, geometry, device with '_' for spaces, drop sha prefix) of a knob-cache or shipped-table key."""
    m = _KEY.match(key)
    if m is None:
        return None
    g = Geometry(m["fmt"], int(m["h"]), int(m["i"]), int(m["e"]), int(m["k"]), int(m["w"]), int(m["c"]))
    return m["arch"], g, m["dev"], m["drop"]


def measured_entries(entries: Mapping[str, Mapping[str, Any]], *, arch: str = "sm90", device: Optional[str] = None,
                     drop_sha256: Optional[str] = None) -> List[Measured]:
    """The entries of a shipped table (knob_table.load_tables(arch)) measured on `device` (its name) and the drop
    with `drop_sha256`; None for either means any (the evaluation tool reads every entry)."""
    out = []
    for key, entry in entries.items():
        parsed = parse_key(key)
        if parsed is None or parsed[0] != arch:
            continue
        _, g, dev, drop = parsed
        if device is not None and dev != device.replace(" ", "_"):
            continue
        if drop_sha256 is not None and (drop is None or not drop_sha256.startswith(drop)):
            continue
        out.append(Measured(g, dict(entry["knobs"]), key))
    return out


def _log2(a: float, b: float) -> float:
    return abs(math.log2(max(a, 1e-9) / max(b, 1e-9)))


def distance(a: Geometry, b: Geometry) -> float:
    return (_log2(a.tokens_per_expert, b.tokens_per_expert)
            + SIZE_WEIGHT * (_log2(a.hidden, b.hidden) + _log2(a.intermediate, b.intermediate) + _log2(a.top_k, b.top_k)))


def token_span(knobs: Mapping[str, Any]) -> int:
    """Token rows one cluster covers: the token tile (N under swap-AB, M otherwise) times the token-side cluster."""
    tile, cluster = knobs["mma_tiler_mnk"], knobs["cluster_shape_mnk"]
    return (tile[1] * cluster[1]) if knobs["swap_ab"] else (tile[0] * cluster[0])


def misfit(knobs: Mapping[str, Any], g: Geometry) -> float:
    want = min(max(2 * g.tokens_per_expert, FIT_MIN), FIT_MAX)
    return _log2(token_span(knobs), want)


def _frozen(knobs: Mapping[str, Any]) -> Tuple:
    # None and absent are one value: a knob's default (entries written before a knob existed do not name it).
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in knobs.items() if v is not None))


def ranked(g: Geometry, measured: Iterable[Measured]) -> List[Tuple[float, Dict[str, Any], Measured]]:
    """(score, knob set, the nearest entry it won at) for every knob set that won at an entry of g's format within
    MAX_TPE_GAP, best first. An entry of g itself counts like any other (the table normally answers first)."""
    best: Dict[Tuple, Tuple[float, Dict[str, Any], Measured]] = {}
    for m in measured:
        if m.geometry.fmt != g.fmt or _log2(m.geometry.tokens_per_expert, g.tokens_per_expert) > MAX_TPE_GAP:
            continue
        d = distance(g, m.geometry)
        k = _frozen(m.knobs)
        if k not in best or d < best[k][0]:
            best[k] = (d, dict(m.knobs), m)
    scored = [(d + MISFIT_WEIGHT * misfit(knobs, g), knobs, m) for d, knobs, m in best.values()]
    return sorted(scored, key=lambda s: (s[0], s[2].key))


def choose(g: Geometry, measured: Iterable[Measured],
           accepts: Optional[Callable[[Dict[str, Any]], bool]] = None) -> Optional[Tuple[Dict[str, Any], str]]:
    """(knob set, why) for g, or None when no measured entry of g's format exists or the kernel accepts none of
    the candidates. `accepts(knobs)` is the kernel's build check for g (shim/sm90/tune.build_check)."""
    for score, knobs, m in ranked(g, measured):
        if accepts is not None and not accepts(knobs):
            continue
        why = (f"knob model: won at {m.key.split('/dev=')[0]} (tokens per expert {m.geometry.tokens_per_expert:g}, "
               f"here {g.tokens_per_expert:g}; score {score:.2f})")
        return knobs, why
    return None


def for_backend(backend) -> Optional[Dict[str, Any]]:
    """The model's knob set for a Hopper kernel backend's layer (its resolution step after the shipped table), or
    None: no GPU name, a drop that is not the verified pin, tables switched off ($MOE_EP_NO_KNOB_TABLES), no entry
    of the format near enough, or no candidate the kernel's constructor accepts for this geometry."""
    import os

    from shim.common import knob_table, tree
    from shim.sm90.knobs import Sm90Knobs
    from shim.sm90.tune import build_check

    device = knob_table.device_name(backend.ctx.device)
    if not device or os.environ.get("MOE_EP_NO_KNOB_TABLES"):
        return None
    tree.activate("sm90")
    provenance = tree.tree_provenance("sm90") or {}
    if not provenance.get("verified") or provenance.get("unpinned"):
        return None
    spec, world = backend.spec, backend.ctx.world_size
    measured = measured_entries(knob_table.load_tables("sm90"), device=device,
                                drop_sha256=provenance.get("carrier_sha256"))
    g = Geometry(backend.fmt, spec.hidden_size, spec.intermediate_size, spec.experts_per_rank(world), spec.top_k,
                 world, spec.max_tokens_per_rank)
    check = build_check(backend.frontend_class(), spec, world, row=backend.row)
    picked = choose(g, measured, accepts=lambda knobs: check(Sm90Knobs.from_json(knobs)))
    return None if picked is None else picked[0]
