"""Where a rank's tokens go and how their answers come back: the index math of dispatch and combine.

One send row per (token, destination) pair: a token with several experts at one destination crosses once (as
DeepEP's dispatch does), carrying the ids that destination should compute ([K], -1 in every other slot) and its K
routing weights. The destination answers with one row: its partial sum over those slots.

Rows are laid out in a padded grid of `capacity` rows per destination, row (r, p) the p-th token (in token order)
sent to r. Every index here is computed on the device with fixed shapes, so the padded form is CUDA-graph capturable
(no host sync, no data-dependent size); the exact form keeps the grid's first count[r] rows of each block once the
counts are known on the host (the transport's counts exchange), in the same order. Both give the engine the same
rows in the same order, so their outputs are the same.

Combine: the partials of token t are summed in fp32 in increasing destination order, then rounded to bf16 once.
With one destination per token (world size 1, or a token whose experts all sit on one rank) that is the partial
itself, bit for bit. The fused kernels sum a token's K terms in fp32 in slot order and round once; here each
destination rounds its partial to bf16 first, so a token whose experts span ranks can differ from the fused path by
those roundings (docs/scale-out.md).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

__all__ = ["Layout", "slot_owners"]


def slot_owners(topk_idx: torch.Tensor, experts_per_dest: int, dests: int):
    """(owner [T, K] int64: the destination of each slot, `dests` for a -1 slot; dest_id [T, K]: the id the
    destination computes) when destination r holds experts [r * experts_per_dest, (r + 1) * experts_per_dest)."""
    idx = topk_idx.to(torch.int64)
    live = idx >= 0
    owner = torch.where(live, torch.div(idx, experts_per_dest, rounding_mode="floor"), dests)
    return owner, torch.remainder(idx, experts_per_dest)


class Layout:
    """The dispatch of one call. owner / dest_id: [T, K] (slot_owners, or a lookup of them); dests: how many
    destinations; capacity: the most tokens the call has (the grid's rows per destination)."""

    def __init__(self, owner: torch.Tensor, dest_id: torch.Tensor, dests: int, capacity: int):
        t, k = owner.shape
        dev = owner.device
        self.tokens, self.top_k, self.dests, self.capacity = t, k, dests, capacity
        self.parts = max(1, min(k, dests))
        slots = torch.zeros((t, dests + 1), dtype=torch.int64, device=dev).scatter_add_(
            1, owner, torch.ones_like(owner))[:, :dests]  # [T, W]: how many of the token's slots each one holds
        hit = (slots > 0).to(torch.int64)
        self.counts = hit.sum(0)  # rows per destination
        # The most slots one row carries to its destination (at most min(K, experts there) when a token's experts
        # are distinct): with the counts, what the host reads before any row moves.
        self.stats = torch.cat([self.counts, torch.cat([slots.reshape(-1), slots.new_zeros(1)]).max().view(1)])
        pos = hit.cumsum(0) - 1  # the token's place in its destination's block
        part = hit.cumsum(1) - 1  # the destination's place among the token's destinations
        cells = dests * capacity
        cell = torch.where(hit.bool(), torch.arange(dests, device=dev) * capacity + pos, cells)  # [T, W]; cells: none
        token = torch.full((cells + 1,), -1, dtype=torch.int64, device=dev)
        token.scatter_(0, cell.reshape(-1), torch.arange(t, device=dev).repeat_interleave(dests))
        where = torch.full((cells + 1,), 0, dtype=torch.int64, device=dev)
        where.scatter_(0, cell.reshape(-1), part.reshape(-1))
        self._token, self._part = token[:cells], where[:cells]  # per grid row; token -1: an empty row
        self._owner, self._dest_id = owner, dest_id

    # -- the rows that travel ------------------------------------------------------------------------------------
    def rows(self, send_counts: Optional[Sequence[int]] = None) -> "Rows":
        """The grid's rows (send_counts None: the padded form, dests * capacity rows) or the first send_counts[r]
        rows of each destination's block (the exact form; the counts as the host read them from self.counts)."""
        if send_counts is None:
            return Rows(self, self._token, self._part, None)
        n = int(sum(send_counts))
        dev = self._token.device
        counts = torch.tensor(list(send_counts), dtype=torch.int64, device=dev)
        starts = torch.arange(self.dests, device=dev) * self.capacity
        first = torch.cumsum(counts, 0) - counts  # where each destination's rows start among the n kept
        keep = (torch.repeat_interleave(starts - first, counts, output_size=n)
                + torch.arange(n, device=dev))
        return Rows(self, self._token[keep], self._part[keep], list(send_counts))


class Rows:
    """The send rows of a Layout: token [n] (-1: a padding row), part [n], and the per-row payload builders."""

    def __init__(self, layout: Layout, token: torch.Tensor, part: torch.Tensor, counts: Optional[List[int]]):
        self.layout, self.token, self.part, self.counts = layout, token, part, counts
        self.padded = counts is None
        self._src = token.clamp(min=0) if self.padded else token  # a padding row reads token 0, masked below

    @property
    def n(self) -> int:
        return self.token.shape[0]

    def select(self, t: torch.Tensor) -> torch.Tensor:
        """The rows of a [T, ...] tensor in send order (a padding row holds token 0's: its ids are all -1)."""
        if self.layout.tokens == 0:
            return t.new_zeros((self.n,) + tuple(t.shape[1:]))
        return t.index_select(0, self._src)

    def dest_ids(self) -> torch.Tensor:
        """int32 [n, K]: the ids each row's destination computes, -1 in the slots it does not hold (see compact)."""
        lay = self.layout
        if lay.tokens == 0:
            return torch.full((self.n, lay.top_k), -1, dtype=torch.int32, device=self.token.device)
        dest = torch.div(torch.arange(lay.dests * lay.capacity, device=self.token.device), lay.capacity,
                         rounding_mode="floor")
        if not self.padded:
            dest = torch.repeat_interleave(torch.arange(lay.dests, device=self.token.device),
                                           torch.tensor(self.counts, device=self.token.device), output_size=self.n)
        owner = lay._owner.index_select(0, self._src)
        ids = lay._dest_id.index_select(0, self._src)
        mine = owner == dest.unsqueeze(1)
        if self.padded:
            mine &= (self.token >= 0).unsqueeze(1)
        return torch.where(mine, ids, -1).to(torch.int32)

    @staticmethod
    def compact(ids: torch.Tensor, weights: torch.Tensor, width: int):
        """(ids, weights) [n, K] -> [n, width]: each row's live slots first, in slot order (a stable sort), the rest
        cut. A destination holding E experts sees at most min(K, E) live slots per row when a token's experts are
        distinct (the split path checks that before the rows move), so its engine is built for that many."""
        k = ids.shape[1]
        if width >= k:
            return ids, weights
        order = torch.sort((ids < 0).to(torch.int8), dim=1, stable=True).indices[:, :width]
        return ids.gather(1, order), weights.gather(1, order)

    # -- combine ---------------------------------------------------------------------------------------------
    def combine(self, back: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """back [n, H] bf16: each row's partial, in send order -> out [T, H]: per token, the fp32 sum of its
        partials in destination order, rounded once (a token no destination computed gets zeros)."""
        lay = self.layout
        t, h = lay.tokens, out.shape[1]
        if t == 0:
            return out
        p = lay.parts
        if p == 1 and not self.padded:
            out.zero_()
            return out.index_copy_(0, self.token, back.to(out.dtype))
        dense = torch.zeros((t * p + 1, h), dtype=back.dtype, device=back.device)
        at = self.token * p + self.part
        if self.padded:
            at = torch.where(self.token >= 0, at, t * p)  # padding rows land in the spare last row
        dense.index_copy_(0, at, back)
        dense = dense[: t * p].view(t, p, h)
        if p == 1:
            return out.copy_(dense[:, 0])
        acc = dense[:, 0].to(torch.float32)
        for j in range(1, p):
            acc.add_(dense[:, j])
        return out.copy_(acc)
