"""Process-group plumbing: RankContext, the validation agreement and the collectives the runtime uses.

Every collective here runs on the group the layer was built with; the group's own timeout bounds how long a
rank can wait for a peer that never arrives (init_from_env sets one).
"""

from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from moe_ep.core.errors import PeerValidationError, ProcessGroupError

__all__ = ["RankContext", "init_from_env", "agree", "run_agreed", "all_to_all_rows", "all_gather_tensor", "DEFAULT_TIMEOUT_S"]

DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class RankContext:
    rank: int
    world_size: int
    group: Optional[object]
    device: torch.device
    pg_backend: str

    @classmethod
    def from_group(cls, group=None, device=None) -> "RankContext":
        if not dist.is_available() or not dist.is_initialized():
            raise ProcessGroupError("group", "torch.distributed is not initialised: call "
                                             "torch.distributed.init_process_group (or moe_ep.init_from_env) first")
        try:
            rank = dist.get_rank(group)
            world = dist.get_world_size(group)
            backend = str(dist.get_backend(group)).lower()
        except (RuntimeError, ValueError) as e:
            raise ProcessGroupError("group", f"not a usable process group: {e}") from e
        if rank < 0:
            raise ProcessGroupError("group", "this process is not a member of the given group")
        if device is None:
            if "nccl" in backend:
                device = torch.device("cuda", torch.cuda.current_device())
            else:
                device = torch.device("cpu")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if "nccl" in backend and device.type != "cuda":
            raise ProcessGroupError("device", f"an NCCL group moves CUDA tensors only, got device {device}")
        if backend == "gloo" and device.type != "cpu":
            # gloo can move CUDA tensors for some collectives but not all_to_all: keep the two pairs apart.
            raise ProcessGroupError("device", f"a gloo group serves CPU tensors here, got device {device}")
        return cls(rank, world, group, device, backend)

    @property
    def comm_device(self) -> torch.device:
        return self.device


def init_from_env(backend: Optional[str] = None, timeout_s: Optional[float] = None) -> RankContext:
    """Join the default group from torchrun-style env (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); gloo on
    CPU, NCCL when MOE_EP_DEVICE=cuda. Idempotent."""
    device_kind = os.environ.get("MOE_EP_DEVICE", "cpu")
    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if device_kind == "cuda" else "gloo"
        if timeout_s is None:
            timeout_s = float(os.environ.get("MOE_EP_PG_TIMEOUT_S", DEFAULT_TIMEOUT_S))
        kwargs = {}
        if backend == "nccl":
            local = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
            torch.cuda.set_device(local)
            kwargs["device_id"] = torch.device("cuda", local)
        dist.init_process_group(backend, init_method="env://", rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]),
                                timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return RankContext.from_group(None, "cuda" if device_kind == "cuda" else "cpu")


def agree(ctx: RankContext, error: Optional[BaseException], what: str = "inputs") -> None:
    """Collective: every rank reports whether its local validation failed; then the failing ranks raise their
    own error and every other rank raises PeerValidationError, so no rank is left waiting in a later
    collective. All ranks must call it, error or not."""
    flags = torch.zeros(ctx.world_size, dtype=torch.int32, device=ctx.comm_device)
    if error is not None:
        flags[ctx.rank] = 1
    dist.all_reduce(flags, group=ctx.group)
    failing = [r for r, f in enumerate(flags.tolist()) if f]
    if not failing:
        return
    # Failure path only: learn why the peers failed (one object gather; cheap next to a failed call).
    mine = None if error is None else (type(error).__name__, getattr(error, "argument", None), str(error))
    gathered: List[object] = [None] * ctx.world_size
    dist.all_gather_object(gathered, mine, group=ctx.group)
    if error is not None:
        raise error
    first = gathered[failing[0]]
    argument = first[1] if first else None
    reasons = {r: gathered[r][2] for r in failing if gathered[r]}
    text = "; ".join(f"rank {r}: {reasons.get(r, '?')}" for r in failing)
    raise PeerValidationError(argument, f"rank(s) {failing} rejected their {what}, so this rank stops too ({text})",
                              ranks=failing, reasons=reasons)


def run_agreed(ctx: RankContext, fn, what: str = "inputs"):
    """Run a local check, then agree(); returns fn's result on every rank when all passed."""
    result, error = None, None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - any local failure must still reach the agreement
        error = e
    agree(ctx, error, what)
    return result


def _bytes2d(t: torch.Tensor) -> torch.Tensor:
    width = math.prod(t.shape[1:]) * t.element_size()
    if t.shape[0] == 0:
        return torch.empty((0, width), dtype=torch.uint8, device=t.device)
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], width)


def all_to_all_rows(ctx: RankContext, rows: Sequence[torch.Tensor], send_counts: torch.Tensor):
    """Send row blocks: rows are [N, ...] tensors sorted by destination rank, send_counts [W] how many rows go
    to each rank. Returns (received tensors with the same trailing shapes/dtypes, recv_counts [W] on cpu).
    The tensors are packed into one byte matrix so a single payload collective moves them all."""
    dev = ctx.comm_device
    counts = send_counts.to(device=dev, dtype=torch.int64)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=ctx.group)
    send_list = counts.tolist()
    recv_list = recv_counts.tolist()
    widths = []
    parts = []
    for t in rows:
        b = _bytes2d(t)
        widths.append(b.shape[1])
        parts.append(b)
    payload = torch.cat(parts, dim=1) if parts else torch.empty((0, 0), dtype=torch.uint8, device=dev)
    total = sum(widths)
    n_recv = sum(recv_list)
    recv = torch.empty((n_recv, total), dtype=torch.uint8, device=dev)
    dist.all_to_all_single(recv.view(-1), payload.contiguous().view(-1).to(dev),
                           [c * total for c in recv_list], [c * total for c in send_list], group=ctx.group)
    out = []
    off = 0
    for t, width in zip(rows, widths):
        chunk = recv[:, off:off + width].contiguous()
        off += width
        out.append(chunk.view(t.dtype).reshape((n_recv,) + tuple(t.shape[1:])))
    return out, recv_counts.cpu()


def all_gather_tensor(ctx: RankContext, t: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's same-shaped tensor along dim 0 (bytes on the wire: any dtype)."""
    src = t.contiguous().to(ctx.comm_device)
    b = src.view(torch.uint8) if src.dim() else src.reshape(1).view(torch.uint8)
    outs = [torch.empty_like(b) for _ in range(ctx.world_size)]
    dist.all_gather(outs, b, group=ctx.group)
    parts = [o.view(t.dtype).reshape(t.shape if t.dim() else (1,)) for o in outs]
    return torch.cat(parts, dim=0)
