"""A layer's slot arguments (expert_map, id_space, count_load) checked at construction and turned into what the
layer builds: the spec its backend is built with (num_experts = num_slots: the kernels never see logical experts)
and the router that maps and counts on the device."""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from moe_ep.core.dist import RankContext
from moe_ep.core.spec import MoESpec
from moe_ep.eplb.expert_map import ExpertMap
from moe_ep.eplb.router import ID_SPACES, SlotRouter
from moe_ep.errors import DTypeError, ExpertMapError, LoadCountsError

__all__ = ["slot_spec", "router", "no_counters"]


def slot_spec(spec: MoESpec, ctx: RankContext, expert_map: Optional[ExpertMap], id_space: str,
              count_load: Optional[bool]) -> MoESpec:
    """The backend's spec: spec itself without a map, else spec with num_experts = the map's slots. Raises a typed
    error naming the argument when the map does not fit the layer."""
    if id_space not in ID_SPACES:
        raise ExpertMapError("id_space", f"expected one of {list(ID_SPACES)}, got {id_space!r}")
    if count_load is not None and not isinstance(count_load, bool):
        raise DTypeError("count_load", f"expected None or a bool, got {count_load!r}")
    if expert_map is None:
        if id_space != "logical":
            raise ExpertMapError("id_space", "physical slot ids need an expert_map (which logical expert each slot "
                                             "holds)")
        return spec
    if not isinstance(expert_map, ExpertMap):
        raise DTypeError("expert_map", f"expected a moe_ep.ExpertMap, got {type(expert_map).__name__}")
    if expert_map.num_logical != spec.num_experts:
        raise ExpertMapError("expert_map", f"maps {expert_map.num_logical} logical experts, spec.num_experts is "
                                           f"{spec.num_experts}")
    if expert_map.num_slots % ctx.world_size:
        raise ExpertMapError("expert_map", f"{expert_map.num_slots} slots do not split evenly over {ctx.world_size} "
                                           f"ranks (every rank holds num_slots / world_size)")
    return replace(spec, num_experts=expert_map.num_slots)


def router(spec: MoESpec, backend_spec: MoESpec, ctx: RankContext, expert_map: Optional[ExpertMap], id_space: str,
           count_load: Optional[bool]) -> Optional[SlotRouter]:
    """The layer's router, or None when there is nothing to map or count (the forward then adds no op)."""
    count = expert_map is not None if count_load is None else count_load
    if expert_map is None and not count:
        return None
    return SlotRouter(expert_map, backend_spec.num_experts, top_k=spec.top_k, capacity=spec.max_tokens_per_rank,
                      rank=ctx.rank, device=ctx.device, id_space=id_space, count_load=count)


def no_counters() -> LoadCountsError:
    return LoadCountsError("count_load", "this layer keeps no load counters: build it with count_load=True (the "
                                        "default when an expert_map is given)")
