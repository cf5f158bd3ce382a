"""ExpertMap: which logical expert each physical expert slot holds (docs/eplb.md).

A layer with EPLB holds `num_slots` physical expert slots, `num_slots / world_size` per rank in contiguous blocks
(rank r holds slots [r * S_local, (r + 1) * S_local)), and `num_logical` logical experts (the router's ids). Every slot
holds exactly one logical expert; every logical expert has at least one slot (its replicas). The replica table lists
the slots of each logical expert in the order the replica rule indexes them (docs/eplb.md: replica j of expert e is
table[e, j], j = (t + k + rank) mod count[e] for the token in row t, column k of a rank's call).

An ExpertMap is a host-side value: immutable, validated once, the same on every rank. The layer keeps its device copy
(moe_ep/eplb/router.py) and rewrites it in place when a new map is installed.
"""

from __future__ import annotations

import hashlib
import numbers
from typing import Dict, Iterable, List, Optional, Sequence, Union

import torch

from moe_ep.errors import DTypeError, ExpertMapError, ShapeError, WorldSizeError

__all__ = ["ExpertMap"]

IntsLike = Union[torch.Tensor, Sequence[int]]


def _int_tensor(name: str, value, dims: int) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise DTypeError(name, f"expected an integer tensor, got dtype {value.dtype}")
        t = value.detach().to("cpu", torch.int64)
    else:
        flat = list(_flat(value))
        bad = [v for v in flat if isinstance(v, bool) or not isinstance(v, numbers.Integral)]
        if bad:
            raise DTypeError(name, f"expected integers (a tensor or nested sequences of int), got {bad[0]!r}")
        try:
            t = torch.tensor(value, dtype=torch.int64)
        except (TypeError, ValueError, RuntimeError, OverflowError) as e:
            raise ShapeError(name, f"expected a rectangular table of ints: {e}") from None
    if t.dim() != dims:
        raise ShapeError(name, f"expected a {dims}-D table, got shape {list(t.shape)}")
    return t.contiguous()


def _flat(value) -> Iterable:
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _flat(v)
    else:
        yield value


class ExpertMap:
    """The placement of `num_logical` logical experts on `num_slots` physical slots.

    ExpertMap(physical_to_logical, num_logical): slot s holds logical expert physical_to_logical[s]; replicas of an
      expert are listed in increasing slot order.
    ExpertMap.from_replicas(replica_table, replica_count, num_slots): a logical-to-physical table [E, R] (-1 padding
      past each count) as vLLM's EPLB state keeps it; the replica order is kept.
    ExpertMap.identity(E), ExpertMap.round_robin(E, S): slot s holds expert s (mod E).
    """

    __slots__ = ("_p2l", "_table", "_count", "_digest")

    def __init__(self, physical_to_logical: IntsLike, num_logical: int):
        p2l = _int_tensor("physical_to_logical", physical_to_logical, 1)
        e = self._check_num("num_logical", num_logical)
        s = p2l.numel()
        if s < e:
            raise ExpertMapError("physical_to_logical", f"{s} slots cannot hold {e} logical experts (num_slots >= "
                                                        f"num_logical)")
        bad = ((p2l < 0) | (p2l >= e)).nonzero().flatten().tolist()
        if bad:
            raise ExpertMapError("physical_to_logical", f"slot {bad[0]} holds logical expert {int(p2l[bad[0]])}, "
                                                        f"expected 0 <= id < num_logical={e}")
        self._finish(p2l, torch.bincount(p2l, minlength=e), self._slots_by_expert(p2l, e))

    # -- constructors ------------------------------------------------------------------------------------------
    @classmethod
    def from_replicas(cls, replica_table: IntsLike, replica_count: Optional[IntsLike] = None, *,
                      num_slots: int) -> "ExpertMap":
        """From a logical-to-physical table [E, R]: row e lists expert e's slots, then -1 padding. replica_count [E]
        (default: the entries of each row before its first -1). Every slot in [0, num_slots) must appear exactly
        once."""
        table = _int_tensor("replica_table", replica_table, 2)
        s = cls._check_num("num_slots", num_slots)
        e, width = table.shape
        if e == 0:
            raise ExpertMapError("replica_table", "expected at least one logical expert (one row), got none")
        if replica_count is None:
            neg = table < 0
            count = torch.where(neg.any(dim=1), neg.int().argmax(dim=1), torch.full((e,), width)).to(torch.int64)
        else:
            count = _int_tensor("replica_count", replica_count, 1)
            if count.numel() != e:
                raise ExpertMapError("replica_count", f"expected one count per logical expert ({e}, the table's rows), "
                                                      f"got {count.numel()}")
        for lg in range(e):
            c = int(count[lg])
            if not 1 <= c <= width:
                raise ExpertMapError("replica_count", f"logical expert {lg} has {c} replicas, expected 1..{width} "
                                                      f"(every logical expert needs a slot)")
            row = table[lg]
            out = [int(x) for x in row[:c].tolist() if not 0 <= x < s]
            if out:
                raise ExpertMapError("replica_table", f"a replica of logical expert {lg} points at slot {out[0]}, "
                                                      f"outside [0, num_slots={s})")
            if (row[c:] != -1).any():
                raise ExpertMapError("replica_table", f"row {lg} has entries past its {c} replicas that are not -1 "
                                                      f"padding: {row.tolist()}")
        owner = torch.full((s,), -1, dtype=torch.int64)
        lists = []
        for lg in range(e):
            slots = table[lg, : int(count[lg])].tolist()
            for sl in slots:
                if owner[sl] >= 0:
                    raise ExpertMapError("replica_table", f"slot {sl} is claimed by logical experts {int(owner[sl])} "
                                                          f"and {lg}")
                owner[sl] = lg
            lists.append(slots)
        empty = (owner < 0).nonzero().flatten().tolist()
        if empty:
            raise ExpertMapError("replica_table", f"slot(s) {empty[:8]} hold no logical expert (every slot must be "
                                                  f"some expert's replica)")
        m = cls.__new__(cls)
        m._finish(owner, count, lists)
        return m

    @classmethod
    def identity(cls, num_experts: int) -> "ExpertMap":
        return cls(torch.arange(cls._check_num("num_experts", num_experts)), num_experts)

    @classmethod
    def round_robin(cls, num_logical: int, num_slots: int) -> "ExpertMap":
        """Slot s holds logical expert s mod num_logical: the extra slots replicate experts 0, 1, ..."""
        return cls(torch.arange(cls._check_num("num_slots", num_slots)) % cls._check_num("num_logical", num_logical),
                   num_logical)

    # -- internals ---------------------------------------------------------------------------------------------
    @staticmethod
    def _check_num(name: str, v) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ExpertMapError(name, f"expected a positive int, got {v!r}")
        return v

    @staticmethod
    def _slots_by_expert(p2l: torch.Tensor, e: int) -> List[List[int]]:
        lists: List[List[int]] = [[] for _ in range(e)]
        for s, lg in enumerate(p2l.tolist()):
            lists[lg].append(s)
        return lists

    def _finish(self, p2l: torch.Tensor, count: torch.Tensor, lists: List[List[int]]) -> None:
        e, s = len(lists), p2l.numel()
        missing = [lg for lg in range(e) if not lists[lg]]
        if missing:
            raise ExpertMapError("physical_to_logical", f"logical expert(s) {missing[:8]} have no slot (every logical "
                                                        f"expert needs at least one)")
        # The widest a valid table can be (every other expert keeps one slot): a fixed width, so the layer's device
        # copy never grows and captured graphs that read it stay valid across rearrangements.
        table = torch.full((e, s - e + 1), -1, dtype=torch.int64)
        for lg, slots in enumerate(lists):
            table[lg, : len(slots)] = torch.tensor(slots, dtype=torch.int64)
        self._p2l = p2l.clone()
        self._table = table
        self._count = count.to(torch.int64).clone()
        h = hashlib.sha256()
        for t in (torch.tensor([e, s]), self._p2l, self._table):
            h.update(t.numpy().tobytes())
        self._digest = int.from_bytes(h.digest()[:7], "little")

    # -- views -------------------------------------------------------------------------------------------------
    @property
    def num_logical(self) -> int:
        return self._table.shape[0]

    @property
    def num_slots(self) -> int:
        return self._p2l.numel()

    @property
    def max_replicas(self) -> int:
        """The replica table's width: num_slots - num_logical + 1 (enough for any valid map of this size)."""
        return self._table.shape[1]

    @property
    def physical_to_logical(self) -> torch.Tensor:
        """[num_slots] int64 (a copy)."""
        return self._p2l.clone()

    @property
    def replica_table(self) -> torch.Tensor:
        """[num_logical, max_replicas] int64, -1 past each expert's count (a copy)."""
        return self._table.clone()

    @property
    def replica_count(self) -> torch.Tensor:
        """[num_logical] int64 (a copy)."""
        return self._count.clone()

    def digest(self) -> int:
        """A 56-bit fingerprint of the placement and the replica order (what ranks compare before a rearrangement)."""
        return self._digest

    def logical_of(self, slot: int) -> int:
        return int(self._p2l[slot])

    def slots_of(self, expert: int) -> List[int]:
        """The slots of logical expert `expert`, in replica order."""
        return self._table[expert, : int(self._count[expert])].tolist()

    def slots_per_rank(self, world_size: int) -> int:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size <= 0 \
                or self.num_slots % world_size:
            raise WorldSizeError("world_size", f"{world_size!r} does not divide num_slots={self.num_slots} (every "
                                               f"rank holds the same number of slots)")
        return self.num_slots // world_size

    def local_slots(self, rank: int, world_size: int) -> range:
        """The global ids of rank `rank`'s slots."""
        n = self.slots_per_rank(world_size)
        return range(rank * n, (rank + 1) * n)

    def logical_ids(self, slot_idx: torch.Tensor) -> torch.Tensor:
        """Physical slot ids (any shape, -1 = no expert) -> the logical ids they hold (-1 kept), on the same device."""
        p2l = torch.cat([self._p2l, torch.tensor([-1])]).to(slot_idx.device)
        return p2l[slot_idx.to(torch.int64)]  # -1 indexes the appended -1

    def changed_slots(self, other: "ExpertMap") -> List[int]:
        """The slots whose logical expert differs between this map and `other` (of the same size)."""
        if (other.num_slots, other.num_logical) != (self.num_slots, self.num_logical):
            raise ExpertMapError("expert_map", f"a map of {other.num_logical} experts on {other.num_slots} slots "
                                               f"cannot replace one of {self.num_logical} on {self.num_slots}")
        return (self._p2l != other._p2l).nonzero().flatten().tolist()

    def reassign(self, changes: Dict[int, int]) -> "ExpertMap":
        """A new map with slot s holding logical expert changes[s]. Replica order: unchanged replicas keep theirs, a
        slot given to an expert is appended to its list. Raises ExpertMapError if an expert would lose its last slot."""
        lists = [self.slots_of(lg) for lg in range(self.num_logical)]
        for s, lg in changes.items():
            if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < self.num_slots:
                raise ExpertMapError("changes", f"slot {s!r} is outside [0, num_slots={self.num_slots})")
            if isinstance(lg, bool) or not isinstance(lg, int) or not 0 <= lg < self.num_logical:
                raise ExpertMapError("changes", f"logical expert {lg!r} is outside [0, num_logical={self.num_logical})")
        for s, lg in sorted(changes.items()):
            old = self.logical_of(s)
            if old != lg:
                lists[old].remove(s)
                lists[lg].append(s)
        width = self.max_replicas
        table = [row + [-1] * (width - len(row)) for row in lists]
        if any(not row for row in lists):
            lost = [lg for lg, row in enumerate(lists) if not row]
            raise ExpertMapError("changes", f"logical expert(s) {lost[:8]} would be left without a slot")
        return ExpertMap.from_replicas(table, [len(r) for r in lists], num_slots=self.num_slots)

    def rank_weights(self, w13: torch.Tensor, w2: torch.Tensor, rank: int, world_size: int, **calibration):
        """This rank's slot weights (moe_ep.ExpertWeights, num_experts = num_slots) from the logical experts' canonical
        bf16 weights w13 [E, 2I, H], w2 [E, H, I] (any device; the result is on the same one)."""
        from moe_ep.core.weights import ExpertWeights

        if w13.shape[0] != self.num_logical or w2.shape[0] != self.num_logical:
            raise ShapeError("w13", f"expected the {self.num_logical} logical experts' weights, got "
                                    f"{list(w13.shape)} and {list(w2.shape)}")
        held = self._p2l[list(self.local_slots(rank, world_size))].to(w13.device)
        return ExpertWeights(w13.index_select(0, held).contiguous(), w2.index_select(0, held).contiguous(), rank,
                             world_size, self.num_slots, **calibration)

    # -- value semantics ---------------------------------------------------------------------------------------
    def __eq__(self, other) -> bool:
        return (isinstance(other, ExpertMap) and self.num_slots == other.num_slots
                and torch.equal(self._p2l, other._p2l) and torch.equal(self._table, other._table))

    def __hash__(self) -> int:
        return self._digest

    def __repr__(self) -> str:
        reps = {lg: self.slots_of(lg) for lg in range(self.num_logical) if int(self._count[lg]) > 1}
        return (f"ExpertMap(num_logical={self.num_logical}, num_slots={self.num_slots}, "
                f"replicated={reps if len(reps) <= 8 else f'{len(reps)} experts'})")
