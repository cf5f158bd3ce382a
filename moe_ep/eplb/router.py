"""A layer's expert slots on the device: the logical-to-physical routing and the load counters (docs/eplb.md).

Everything a forward does here is a handful of torch ops on buffers allocated once, at the layer's construction:
no host sync, nothing allocated that outlives the call, so a forward stays CUDA-graph capturable and a graph captured
once keeps reading the current map and adding to the same counters. A new map is written into the same device tensors
(install), in stream order.

The replica rule: the token in row t, column k of a rank's call, routed to logical expert e with c = count[e]
replicas, goes to replica j = (t + k + rank) mod c, i.e. slot table[e, j]. Deterministic (no random draw, the same
ids give the same slots on every call and in every graph replay) and spread: consecutive tokens, the k columns of
one token and the ranks at one token count (decode: t = 0 everywhere) cycle through the replicas.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from moe_ep.eplb.expert_map import ExpertMap
from moe_ep.errors import LoadCountsError

__all__ = ["SlotRouter", "ID_SPACES"]

ID_SPACES = ("logical", "physical")


class SlotRouter:
    """expert_map: the placement (None: slots are the experts, nothing is mapped; only counters). id_space:
    "logical" (the layer maps the caller's logical ids to slots) or "physical" (the caller passes slot ids).
    count_load: keep per-slot counters of the (token, expert) pairs this rank routes."""

    def __init__(self, expert_map: Optional[ExpertMap], num_slots: int, *, top_k: int, capacity: int, rank: int,
                 device: torch.device, id_space: str, count_load: bool):
        self.expert_map: Optional[ExpertMap] = None
        self.id_space = id_space
        self.num_slots = num_slots
        self.maps = expert_map is not None and id_space == "logical"
        n = capacity * top_k
        if self.maps:
            e, self._width = expert_map.num_logical, expert_map.max_replicas
            # Row 0 answers id -1 ("no expert"): one replica, slot -1. Logical e is row e + 1.
            self._table = torch.full(((e + 1) * self._width,), -1, dtype=torch.int64, device=device)
            self._count = torch.ones(e + 1, dtype=torch.int64, device=device)
            self._pos = (torch.arange(capacity).unsqueeze(1) + torch.arange(top_k).unsqueeze(0) + rank).reshape(-1)
            self._pos = self._pos.to(device)
            self._phys = torch.empty(n, dtype=torch.int64, device=device)
        # Counter 0 takes the -1 slots (ids shifted by one), so no op needs a mask.
        self._load = torch.zeros(num_slots + 1, dtype=torch.int64, device=device) if count_load else None
        self._ones = torch.ones(n, dtype=torch.int64, device=device) if count_load else None
        if expert_map is not None:
            self.install(expert_map)

    def install(self, expert_map: ExpertMap) -> None:
        """Write `expert_map` into the device tensors the forwards read (same addresses; stream-ordered copies)."""
        if self.maps:
            e, w = expert_map.num_logical, self._width
            table = torch.full((e + 1, w), -1, dtype=torch.int64)
            table[1:] = expert_map.replica_table
            count = torch.cat([torch.ones(1, dtype=torch.int64), expert_map.replica_count])
            self._table.copy_(table.reshape(-1))
            self._count.copy_(count)
        self.expert_map = expert_map

    def route(self, topk_idx: torch.Tensor) -> torch.Tensor:
        """[T, K] ids in this layer's id space -> [T, K] slot ids for the backend (a view of a reusable buffer when
        mapped), counting each routed pair. Capturable: no host sync, no data-dependent shape."""
        slots = topk_idx
        if self.maps:
            n = topk_idx.numel()
            e1 = topk_idx.reshape(-1) + 1
            j = torch.remainder(self._pos[:n], self._count.index_select(0, e1))
            j.add_(e1, alpha=self._width)
            slots = torch.index_select(self._table, 0, j, out=self._phys[:n]).view(topk_idx.shape)
        if self._load is not None:
            n = topk_idx.numel()
            self._load.index_add_(0, slots.reshape(-1) + 1, self._ones[:n])
        return slots

    def load_counts(self, ctx, reset: bool, gather: bool) -> torch.Tensor:
        if self._load is None:
            raise LoadCountsError("count_load", "this layer keeps no load counters: build it with count_load=True")
        counts = self._load[1:].clone()
        if reset:
            self._load.zero_()
        if gather:
            on_wire = counts.to(ctx.comm_device)
            dist.all_reduce(on_wire, group=ctx.group)
            counts = on_wire.to(counts.device)
        return counts
