"""Tree-agnostic knob plumbing: the error type, the JSON form of a knob set, and the resolution order.

Each tree's knobs.py owns what its kernels accept (a literal KNOB_SPACE, a frozen
dataclass, validation, the heuristic); this module owns what every tree does the
same way: explicit knobs > the persistent knob cache > the shipped table > the
heuristic (or, for knobs="auto", a collective tune), resolved in one pass per
workspace allocation.
"""

from __future__ import annotations

from dataclasses import asdict, fields, replace
from typing import Any, Callable, Dict, Optional, Tuple, Type, TypeVar

from moe_ep.errors import KnobError

__all__ = ["InvalidKnobsError", "KnobSet", "resolve_knob_set"]


class InvalidKnobsError(KnobError):
    """A knob set the kernel cannot build; raised before any compile. ``argument`` (also ``knob``) names the
    knob, or "knobs" when the kernel's constructor rejects the combination."""

    @property
    def knob(self) -> str:
        return self.argument


K = TypeVar("K", bound="KnobSet")


class KnobSet:
    """Mixin for a frozen knob dataclass: JSON round trip (tuples as lists) and replace()."""

    def to_json(self) -> Dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_json(cls: Type[K], d: Dict[str, Any]) -> K:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise InvalidKnobsError(unknown[0], f"unknown knob; valid knobs: {sorted(names)}")
        d = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items()}
        return cls(**d)

    def replace(self: K, **kw) -> K:
        return replace(self, **kw)


def resolve_knob_set(knobs, *, knob_type: Type[K], heuristic: Callable[[], K], validate: Callable[[K], K],
                     cache_key: str, cache=None, shipped: Optional[Callable[[], Optional[Dict[str, Any]]]] = None,
                     model: Optional[Callable[[], Optional[Dict[str, Any]]]] = None,
                     tune: Optional[Callable[[], K]] = None) -> Tuple[K, str]:
    """Explicit > persistent cache > shipped table > (for "auto") a tune > knob model > heuristic, in one pass: the
    cache and the shipped table are each read at most once. Returns (validated knobs, where they came from:
    "explicit", "cache", "table", "autotune", "model" or "heuristic").

    knobs: a `knob_type` instance (used as is), a dict (overrides on top of the heuristic), None (cache, else
    table, else model, else heuristic) or "auto" (the same, with `tune()` instead of the model and the heuristic
    on a miss: a shipped entry counts as tuned).
    shipped: returns the shipped table's knobs for this layer (shim/common/knob_table.py), or None.
    model: returns a knob set derived from the tables for a geometry they do not cover (shim/sm90/knob_model.py),
    or None.
    tune: runs the collective autotune and returns its winner (knobs="auto" only; it takes the model's and the
    heuristic's place).
    """
    from shim.common.knob_cache import KnobCache

    if isinstance(knobs, knob_type):
        return validate(knobs), "explicit"
    if isinstance(knobs, dict):
        base = heuristic().to_json()
        base.update(knobs)
        return validate(knob_type.from_json(base)), "explicit"
    if knobs not in (None, "auto"):
        raise InvalidKnobsError("knobs", f"expected None, 'auto', a dict or {knob_type.__name__}, got {knobs!r}")
    hit: Optional[Dict[str, Any]] = (cache or KnobCache()).get(cache_key)
    if hit is not None:
        return validate(knob_type.from_json(hit)), "cache"
    tuned = shipped() if shipped is not None else None
    if tuned is not None:
        return validate(knob_type.from_json(tuned)), "table"
    if knobs == "auto" and tune is not None:
        return validate(tune()), "autotune"
    derived = model() if model is not None else None
    if derived is not None:
        return validate(knob_type.from_json(derived)), "model"
    return validate(heuristic()), "heuristic"
