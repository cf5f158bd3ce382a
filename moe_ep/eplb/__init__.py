"""Expert-parallel load balancing (docs/eplb.md): a layer with more expert slots than logical experts (replicas), the
logical-to-physical map it routes by on the device, per-slot load counters, and experts swapped in place.

    emap = moe_ep.ExpertMap(physical_to_logical, num_logical=E)     # which logical expert each slot holds
    layer = moe_ep.MoELayer(spec, emap.rank_weights(w13, w2, rank, W), expert_map=emap)
    out = layer(hidden, logical_topk_idx, topk_weights)              # mapped to slots on the device
    load = layer.load_counts(reset=True, gather=True)                # pairs per slot, summed over ranks
    layer.rearrange(emap.reassign({slot: hot_expert}))               # weights copied from a holder, map updated
"""

from moe_ep.eplb.expert_map import ExpertMap
from moe_ep.eplb.router import ID_SPACES, SlotRouter

__all__ = ["ExpertMap", "SlotRouter", "ID_SPACES"]
