"""The split path's transport: torch.distributed's all_to_all_single with host-known splits (NCCL on GPUs, across
nodes as well as inside one; gloo on the CPU).

Exact form: one small exchange of the row counts (it may carry a few int64 of header, the call's fingerprint), read
on the host, then one all_to_all_single per payload tensor with those splits: the bytes that cross are the rows that
exist. The host read is a sync, so the exact form cannot be captured in a CUDA graph.
Padded form: every rank sends `capacity` rows to every peer (empty rows carry ids -1): fixed splits, no counts, no
host sync, so it can be captured; it moves world_size * capacity rows whatever the routing.
A group of one has nothing to exchange: both forms hand the rows back as they are.

docs/scale-out.md weighs the other transports (NCCL's own EP API, torch's symmetric-memory all_to_all_vdev).
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from moe_ep.core.dist import RankContext, peer_lost

__all__ = ["Transport", "pack_rows", "unpack_rows"]


class Transport:
    def __init__(self, ctx: RankContext, what: str = "the split path"):
        self.ctx = ctx
        self.what = what

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    def counts(self, send: Sequence[int], header: Sequence[int] = ()) -> Tuple[List[int], List[int], list]:
        """(send counts, receive counts, the header each rank sent), the send counts read on the host already.
        Collective."""
        send = [int(c) for c in send]
        if self.world_size == 1:
            return send, send, [list(header)]
        width = 1 + len(header)
        mine = torch.tensor([v for c in send for v in (c, *header)], dtype=torch.int64, device=self.ctx.comm_device)
        theirs = torch.empty_like(mine)
        self._a2a(theirs, mine, None, None)
        got = theirs.view(-1, width).tolist()
        return send, [g[0] for g in got], [g[1:] for g in got]

    def rows(self, t: torch.Tensor, send: Optional[Sequence[int]], recv: Optional[Sequence[int]]) -> torch.Tensor:
        """Exchange the rows of t [n, ...] (sorted by destination): send[r] rows go to rank r, recv[r] rows come
        from it; send None: the padded form, t's rows split evenly. Returns the received rows, same trailing shape
        and dtype. Collective."""
        if self.world_size == 1:
            return t
        tail = tuple(t.shape[1:])
        width = math.prod(tail) * t.element_size()
        src = t.contiguous().view(torch.uint8).reshape(t.shape[0], width) if t.shape[0] else \
            torch.empty((0, width), dtype=torch.uint8, device=t.device)
        n_recv = t.shape[0] if send is None else int(sum(recv))
        dst = torch.empty((n_recv, width), dtype=torch.uint8, device=t.device)
        if send is None:
            self._a2a(dst.view(-1), src.view(-1), None, None)
        else:
            self._a2a(dst.view(-1), src.view(-1), [c * width for c in recv], [c * width for c in send])
        return dst.view(t.dtype).reshape((n_recv,) + tail) if n_recv else dst.new_empty((0,) + tail, dtype=t.dtype)

    def _a2a(self, out, inp, out_splits, in_splits) -> None:
        try:
            dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.ctx.group)
        except RuntimeError as e:
            raise peer_lost(self.ctx, e, f"{self.what}'s all_to_all") from None


def pack_rows(parts: Sequence[Optional[torch.Tensor]]) -> Tuple[torch.Tensor, list]:
    """[n, ...] tensors (None skipped) -> (uint8 [n, total bytes], their (dtype, trailing shape, bytes) layout): the
    small per-row fields ride in one exchange."""
    live = [p for p in parts if p is not None]
    n = live[0].shape[0]
    spec, cols = [], []
    for p in parts:
        if p is None:
            spec.append(None)
            continue
        width = math.prod(p.shape[1:]) * p.element_size()
        spec.append((p.dtype, tuple(p.shape[1:]), width))
        cols.append(p.contiguous().view(torch.uint8).reshape(n, width) if n else
                    torch.empty((0, width), dtype=torch.uint8, device=p.device))
    return torch.cat(cols, dim=1), spec


def unpack_rows(packed: torch.Tensor, spec: list) -> List[Optional[torch.Tensor]]:
    out, at = [], 0
    n = packed.shape[0]
    for s in spec:
        if s is None:
            out.append(None)
            continue
        dtype, tail, width = s
        col = packed[:, at:at + width].contiguous()
        at += width
        out.append(col.view(dtype).reshape((n,) + tail) if n else torch.empty((0,) + tail, dtype=dtype,
                                                                              device=packed.device))
    return out
