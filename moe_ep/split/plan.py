"""What a layer runs (its plan), and the table of plans `auto` measured, one per capacity bucket.

A plan names the path (the fused backend over the whole group, `split`, or `two_level`), what runs it, and where the
choice came from: "measured" (auto timed its candidates on this group at construction), "table" (a plan measured
before for the same geometry, group shape, device and capacity bucket), or "fixed" (the layer was built with that
backend by name). `MoELayer.plan` reports it.

The table lives in the process (every layer of a model with the same shape reuses the first one's measurement)
and, when $MOE_EP_PLAN_TABLE names a JSON file, on disk: read at construction, written by rank 0 after a
measurement. A table entry is used only when every rank finds the same one (agreed by one all_reduce); otherwise
the ranks measure.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Dict, Optional, Tuple

import torch

__all__ = ["Plan", "plan_of", "bucket", "table_key", "lookup", "store", "ENV_TABLE"]

ENV_TABLE = "MOE_EP_PLAN_TABLE"


@dataclass(frozen=True)
class Plan:
    """path: "fused" (a kernel backend over the whole group), "reference" (the torch reference), "split" or
    "two_level"; backend: the registered backend that runs each call; engine / transport / wire: the split paths'
    (None for a whole-group backend); numerics: how its arithmetic relates to the format's; domains: the group's
    NVLink domain map; capacity: the layer's max_tokens_per_rank; source: "measured", "table" or "fixed";
    scores_us: per candidate auto measured, the slowest rank's median time of one call at the capacity."""

    path: str
    backend: str
    engine: Optional[str] = None
    transport: Optional[str] = None
    wire: Optional[str] = None
    numerics: str = "the format's"
    domains: str = ""
    capacity: int = 0
    source: str = "fixed"
    scores_us: Tuple[Tuple[str, float], ...] = field(default_factory=tuple)

    def as_dict(self) -> dict:
        return asdict(self)


def plan_of(layer) -> Plan:
    """The plan of a built layer: its backend's own (auto), or a description of the backend it was built with."""
    from moe_ep.split import topology

    be = layer.backend
    own = getattr(be, "plan", None)
    if isinstance(own, Plan):
        return own
    dmap = topology.domain_map(layer.ctx)
    d = be.describe() if hasattr(be, "describe") else {
        "path": "fused" if be.needs_p2p else ("reference" if be.name == "torch_reference" else be.name),
        "backend": layer.backend_name}
    return Plan(domains=str(dmap), capacity=layer.spec.max_tokens_per_rank, source="fixed", **d)


def bucket(capacity: int) -> int:
    """The capacity bucket a plan is measured for: the capacity rounded up to a power of two (at least 8)."""
    c = 8
    while c < capacity:
        c *= 2
    return c


def table_key(*, device: torch.device, fmt: str, spec, world_size: int, domains: str, candidates) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    labels = ",".join(c[0] for c in candidates)
    return (f"{name}|{fmt}|H{spec.hidden_size}|I{spec.intermediate_size}|E{spec.num_experts}|K{spec.top_k}|"
            f"W{world_size}|{domains}|C{bucket(spec.max_tokens_per_rank)}|{labels}")


_table: Dict[str, str] = {}


def _file() -> Optional[str]:
    path = os.environ.get(ENV_TABLE, "").strip()
    return path or None


def lookup(key: str) -> Optional[str]:
    """The winner's label measured before for this key (the process's table, then the file's), or None."""
    hit = _table.get(key)
    if hit is not None:
        return hit
    path = _file()
    if path and os.path.isfile(path):
        try:
            with open(path) as f:
                hit = json.load(f).get(key)
        except (OSError, ValueError):
            return None
        if isinstance(hit, str):
            _table[key] = hit
            return hit
    return None


def store(key: str, label: str, rank: int) -> None:
    _table[key] = label
    path = _file()
    if not path or rank != 0:
        return
    try:
        old = {}
        if os.path.isfile(path):
            with open(path) as f:
                old = json.load(f)
        old[key] = label
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(old, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except (OSError, ValueError):
        pass  # a table that cannot be written costs a measurement next time, nothing else
