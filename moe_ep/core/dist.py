"""Process-group plumbing: RankContext, the validation agreement and the collectives the runtime uses.

Every collective here runs on the group the layer was built with; the group's own timeout bounds how long a
rank can wait for a peer that never arrives (init_from_env sets one).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from moe_ep.core import lifecycle
from moe_ep.core.device import cuda_device_count, describe_host, require_device
from moe_ep.errors import (DeviceUnavailableError, MoEError, PeerLostError, PeerValidationError, ProcessGroupEnvError,
                           ProcessGroupError, RankDisagreementError)

__all__ = ["RankContext", "init_from_env", "destroy_at_normal_exit", "agree", "run_agreed", "all_to_all_rows",
           "all_gather_tensor", "all_reduce_max", "DEFAULT_TIMEOUT_S", "peer_lost", "check_group", "canonical"]

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
            device = "cuda" if "nccl" in backend else "cpu"
        device = require_device(device)
        if device.type == "cpu" and device.index is not None:
            # The CPU has one device: "cpu:0" is it (tensors on the CPU report device "cpu", so a layer keeping the
            # index would refuse every one of them); any other index names nothing.
            if device.index != 0:
                raise DeviceUnavailableError("device", f"the CPU is one device ('cpu' or 'cpu:0'), got {device}")
            device = torch.device("cpu")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if "nccl" in backend and device.type != "cuda":
            raise ProcessGroupError("device", f"an NCCL group moves CUDA tensors only, got device {device}")
        if backend == "gloo" and device.type != "cpu":
            # gloo can move CUDA tensors for some collectives but not all_to_all: keep the two pairs apart.
            raise ProcessGroupError("device", f"a gloo group serves CPU tensors here, got device {device}")
        return cls(rank, world, group, device, backend)

    @classmethod
    def detached(cls, rank: int = 0, world_size: int = 1, device="cpu") -> "RankContext":
        """A rank's place with no process group: what a compile-only kernel build (CPU, no GPU) or a tool
        needs to describe rank `rank` of `world_size` without joining anything. Collectives refuse it."""
        return cls(rank, world_size, None, torch.device(device), "none")

    @property
    def comm_device(self) -> torch.device:
        return self.device


def init_from_env(backend: Optional[str] = None, timeout_s: Optional[float] = None) -> RankContext:
    """Join the default process group from torchrun-style environment variables; returns this rank's context.

    RANK and WORLD_SIZE (with MASTER_ADDR and MASTER_PORT when WORLD_SIZE > 1; LOCAL_RANK picks the GPU) are
    what torchrun sets. With neither RANK nor WORLD_SIZE set, this process is a group of its own: world size 1,
    MASTER_ADDR (default 127.0.0.1) and MASTER_PORT (default: a free port) used without touching os.environ.
    Anything partial or malformed raises ProcessGroupEnvError naming the variable and what to set.

    The device: on a host with CUDA devices, this rank's GPU (LOCAL_RANK, else RANK) over NCCL; on a host without
    one, the CPU over gloo. MOE_EP_DEVICE=cpu or =cuda says which (cpu on a GPU host is said once, on rank 0;
    cuda on a host without one is a DeviceUnavailableError). MOE_EP_PG_TIMEOUT_S bounds every collective.
    Idempotent: an already initialised default group is reused as it is. The group this function creates is
    destroyed at the end of a normal run (moe_ep.core.lifecycle); one the caller made stays the caller's."""
    env = os.environ

    def bad(var: str, what: str) -> ProcessGroupEnvError:
        shown = f"{var}={env[var]!r}" if var in env else f"{var} is not set"
        return ProcessGroupEnvError(var, f"{shown}: {what}")

    def integer(var: str, lo: int, hi: Optional[int], what: str) -> int:
        try:
            value = int(env[var].strip())
        except ValueError:
            raise bad(var, f"expected an integer, {what}") from None
        if value < lo or (hi is not None and value > hi):
            raise bad(var, f"out of range, {what}")
        return value

    asked = env.get("MOE_EP_DEVICE", "").strip().lower()
    if asked not in ("", "cpu", "cuda"):
        raise bad("MOE_EP_DEVICE", "set it to 'cuda' (this rank's GPU, NCCL) or 'cpu' (gloo), or unset it for the "
                                   "GPU where the host has one")
    if dist.is_available() and dist.is_initialized():
        ctx = RankContext.from_group(None, asked or None)
        _say_if_cpu_on_gpu_host(ctx, "the existing default group" + (" (MOE_EP_DEVICE=cpu)" if asked else ""))
        return ctx

    has_rank, has_world = "RANK" in env, "WORLD_SIZE" in env
    if has_rank != has_world:
        missing, given = ("WORLD_SIZE", "RANK") if has_rank else ("RANK", "WORLD_SIZE")
        raise bad(missing, f"{given} is set, so set {missing} too (RANK in [0, WORLD_SIZE), as torchrun does), "
                           f"or unset both for a single process (world size 1)")
    if has_world:
        world = integer("WORLD_SIZE", 1, None, "set WORLD_SIZE to the number of ranks (>= 1)")
        rank = integer("RANK", 0, world - 1, f"set RANK to this process's rank in [0, {world}) (WORLD_SIZE={world})")
    else:
        world, rank = 1, 0

    if world > 1:
        for var in ("MASTER_ADDR", "MASTER_PORT"):
            if not env.get(var, "").strip():
                raise bad(var, f"WORLD_SIZE={world} needs MASTER_ADDR (the address of rank 0) and MASTER_PORT "
                               "(a free port there), the same on every rank, as torchrun sets them")
    addr = env.get("MASTER_ADDR", "").strip() or "127.0.0.1"
    if env.get("MASTER_PORT", "").strip():
        port = integer("MASTER_PORT", 1, 65535, "set MASTER_PORT to a free TCP port (1-65535)")
    else:
        import socket

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((addr if addr in ("127.0.0.1", "localhost") else "", 0))
            port = s.getsockname()[1]

    if timeout_s is None:
        if env.get("MOE_EP_PG_TIMEOUT_S", "").strip():
            try:
                timeout_s = float(env["MOE_EP_PG_TIMEOUT_S"])
            except ValueError:
                raise bad("MOE_EP_PG_TIMEOUT_S", "expected seconds (a number > 0)") from None
        else:
            timeout_s = DEFAULT_TIMEOUT_S
    if not timeout_s > 0:
        raise ProcessGroupEnvError("timeout_s", f"expected seconds > 0, got {timeout_s!r} "
                                                "(argument or MOE_EP_PG_TIMEOUT_S)")

    gpus = cuda_device_count()
    if asked == "cuda" and gpus == 0:
        raise DeviceUnavailableError("MOE_EP_DEVICE", f"MOE_EP_DEVICE='cuda', but {describe_host()}: unset it (or "
                                                      "set it to 'cpu') to run on the CPU")
    if backend is None:
        kind = asked or ("cuda" if gpus else "cpu")
        backend = "nccl" if kind == "cuda" else "gloo"
    else:
        kind = asked or ("cuda" if "nccl" in str(backend).lower() else "cpu")
    kwargs = {}
    if kind == "cuda":
        local = _local_gpu(env, rank, gpus, integer)
        torch.cuda.set_device(local)
        kwargs["device_id"] = torch.device("cuda", local)
    host = f"[{addr}]" if ":" in addr else addr
    dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    destroy_at_normal_exit()
    ctx = RankContext.from_group(None, kind)
    _say_if_cpu_on_gpu_host(ctx, "MOE_EP_DEVICE=cpu" if asked == "cpu" else f"backend={backend!r}")
    return ctx


def _local_gpu(env, rank: int, gpus: int, integer) -> int:
    """This rank's GPU index on its host: LOCAL_RANK (torchrun sets it), else RANK when the host has that many."""
    if "LOCAL_RANK" in env:
        local = integer("LOCAL_RANK", 0, None, "set LOCAL_RANK to this process's GPU index on its host")
        if local >= gpus:
            raise DeviceUnavailableError("LOCAL_RANK", f"LOCAL_RANK={local} names cuda:{local}, but {describe_host()}")
        return local
    if rank >= gpus:
        raise DeviceUnavailableError("LOCAL_RANK", (
            f"LOCAL_RANK is not set and RANK={rank} is past this host's GPUs ({describe_host()}): set LOCAL_RANK to "
            "this process's GPU index on its host (torchrun does), or MOE_EP_DEVICE=cpu"))
    return rank


_said_cpu = []


def _say_if_cpu_on_gpu_host(ctx: RankContext, why: str) -> None:
    """Running on the CPU where GPUs exist is allowed, never silent: one warning per process, on rank 0."""
    if ctx.device.type != "cpu" or _said_cpu or ctx.rank != 0:
        return
    gpus = cuda_device_count()
    if gpus:
        _said_cpu.append(True)
        warnings.warn(f"moe_ep: running on the CPU over {ctx.pg_backend} ({why}) although this host has {gpus} CUDA "
                      "device(s): layers pick the torch reference backend. Unset MOE_EP_DEVICE (or set it to 'cuda') "
                      "to run on the GPUs.", RuntimeWarning, stacklevel=3)


def destroy_at_normal_exit() -> None:
    """Destroy the default process group at the end of a normal run, if it is still this one then: for code that
    made the group itself (init_from_env does this for the group it makes; a group it only reuses is left to
    whoever made it). Without it torch warns at exit that destroy_process_group() was not called."""
    if dist.is_available() and dist.is_initialized():
        lifecycle.at_normal_exit(_destroy_if_current, dist.group.WORLD)


def _destroy_if_current(group) -> None:
    if _lost:
        return  # a peer is gone: tearing the group down would wait for it (or abort inside the transport)
    try:
        if dist.is_initialized() and dist.group.WORLD is group:
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the process is ending; a failed teardown must not mask its exit status
        pass


def canonical(value: Any) -> Any:
    """A value as every rank can compare it: JSON-able, free of memory addresses (a tensor is its dtype and shape,
    an object without a plain repr is its type's name)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return [canonical(v) for v in value]
    if isinstance(value, dict):
        return {str(k): canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, torch.Tensor):
        return f"tensor {str(value.dtype)} {list(value.shape)}"
    text = repr(value)
    return type(value).__name__ if " at 0x" in text else text


def _digest(fields: Dict[str, Any]) -> List[int]:
    """Two int64 words naming the fields' values (blake2b of their canonical JSON)."""
    raw = hashlib.blake2b(json.dumps(fields, sort_keys=True).encode(), digest_size=16).digest()
    return [int.from_bytes(raw[i:i + 8], "little", signed=True) for i in (0, 8)]


def agree(ctx: RankContext, error: Optional[BaseException], what: str = "inputs",
          fields: Optional[Dict[str, Any]] = None, subject: str = "") -> None:
    """Collective: every rank reports whether its local validation failed; then the failing ranks raise their
    own error and every other rank raises PeerValidationError, so no rank is left waiting in a later
    collective. All ranks must call it, error or not.

    fields: what every rank must hold alike (canonical(): JSON-able values), compared in the same collective by a
    16-byte digest a rank (one all_reduce of [W, 3] int64 whatever the fields are: gloo never sees buffers of
    different sizes); only when the digests differ are the fields themselves gathered, and every rank raises
    RankDisagreementError naming the fields, each rank's value and the ranks (subject: what the fields describe)."""
    check_group(ctx, what)
    rows = torch.zeros((ctx.world_size, 3), dtype=torch.int64)
    if error is not None:
        rows[ctx.rank, 0] = 1
    elif fields is not None:
        rows[ctx.rank, 1:] = torch.tensor(_digest(fields), dtype=torch.int64)
    flags = rows.to(ctx.comm_device)
    try:
        dist.all_reduce(flags, group=ctx.group)
    except RuntimeError as e:
        raise peer_lost(ctx, e, f"the agreement on {what}") from None
    got = flags.tolist()
    failing = [r for r, row in enumerate(got) if row[0]]
    if not failing:
        if fields is not None and any(row[1:] != got[0][1:] for row in got):
            _disagree(ctx, fields, what, subject)
        return
    # Failure path only: learn why the peers failed (one object gather; cheap next to a failed call).
    mine = None if error is None else (type(error).__name__, getattr(error, "argument", None), str(error))
    gathered: List[object] = [None] * ctx.world_size
    try:
        dist.all_gather_object(gathered, mine, group=ctx.group)
    except RuntimeError as e:
        raise peer_lost(ctx, e, f"the agreement on {what}") from None
    if error is not None:
        raise error
    first = gathered[failing[0]]
    argument = first[1] if first else None
    reasons = {r: gathered[r][2] for r in failing if gathered[r]}
    text = "; ".join(f"rank {r}: {reasons.get(r, '?')}" for r in failing)
    raise PeerValidationError(argument, f"rank(s) {failing} rejected their {what}, so this rank stops too ({text})",
                              ranks=failing, reasons=reasons)


def _disagree(ctx: RankContext, fields: Dict[str, Any], what: str, subject: str) -> None:
    """The digests differ: gather every rank's fields (pickled by torch, sizes exchanged first) and raise."""
    gathered: List[Any] = [None] * ctx.world_size
    try:
        dist.all_gather_object(gathered, fields, group=ctx.group)
    except RuntimeError as e:
        raise peer_lost(ctx, e, f"the agreement on {what}") from None
    order = list(fields)
    names = sorted({k for g in gathered for k in g}, key=lambda k: (order.index(k) if k in order else 1 << 30, k))
    differ = [k for k in names if len({json.dumps(g.get(k), sort_keys=True) for g in gathered}) > 1]
    values = {k: {r: g.get(k) for r, g in enumerate(gathered)} for k in differ}
    # The reference: the largest group of ranks holding the same values (ties: the one with the lowest rank).
    keys = [json.dumps([g.get(k) for k in differ], sort_keys=True) for g in gathered]
    counts = {key: keys.count(key) for key in keys}
    ref = max(keys, key=lambda key: (counts[key], -keys.index(key)))
    out = [r for r, key in enumerate(keys) if key != ref]
    ref_rank = keys.index(ref)
    majority = counts[ref] > ctx.world_size / 2
    parts = []
    for k in differ:
        shown = ", ".join(f"rank {r}{' (this rank)' if r == ctx.rank else ''} {v!r}" for r, v in values[k].items())
        parts.append(f"{k}: {shown}")
    who = ", ".join(f"rank {r}" for r in out)
    if majority:
        blame = f"Out of agreement: {who} (against the majority, with rank {ref_rank})"
    else:
        blame = f"No majority: {who} differ(s) from rank {ref_rank}, and either may be the one built differently"
    text = (f"the ranks of the group of {ctx.world_size} built {subject or what} differently: " + "; ".join(parts)
            + f". {blame}. Every rank must build each layer alike and in the same order (the same model, configuration "
            "and environment); nothing of this layer was built, on any rank.")
    raise RankDisagreementError(differ[0] if differ else None, text, fields=differ, values=values, ranks=out,
                                layer=fields.get("name") if isinstance(fields.get("name"), str) else None)


def run_agreed(ctx: RankContext, fn, what: str = "inputs", fields: Optional[Callable[[Any], Dict[str, Any]]] = None,
               subject: str = ""):
    """Run a local check, then agree(); returns fn's result on every rank when all passed. fields: the result ->
    what every rank must hold alike (agreed in the same collective; see agree())."""
    result, error, mine = None, None, None
    try:
        result = fn()
        mine = fields(result) if fields is not None else None
    except Exception as e:  # noqa: BLE001 - any local failure must still reach the agreement
        error = e
    agree(ctx, error, what, mine, subject)
    return result


def all_reduce_max(ctx: RankContext, values: Sequence[int], what: str) -> List[int]:
    """The largest of every rank's ints, position by position (one all_reduce); a lost peer is PeerLostError."""
    check_group(ctx, what)
    t = torch.tensor(list(values), dtype=torch.int64, device=ctx.comm_device)
    try:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.group)
    except RuntimeError as e:
        raise peer_lost(ctx, e, what) from None
    return t.tolist()


def _bytes2d(t: torch.Tensor) -> torch.Tensor:
    width = math.prod(t.shape[1:]) * t.element_size()
    if t.shape[0] == 0:
        return torch.empty((0, width), dtype=torch.uint8, device=t.device)
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], width)


def all_to_all_rows(ctx: RankContext, rows: Sequence[torch.Tensor], send_counts: torch.Tensor,
                    header: Optional[Sequence[int]] = None, check=None):
    """Send row blocks: rows are [N, ...] tensors sorted by destination rank, send_counts [W] how many rows go
    to each rank. Returns (received tensors with the same trailing shapes/dtypes, recv_counts [W] on cpu).
    The tensors are packed into one byte matrix so a single payload collective moves them all.
    header: a few int64 this rank sends every peer with its counts (every rank must pass as many); then returns
    (tensors, recv_counts, headers: a list with, for each rank r, the list rank r sent).
    check: called with the headers after the counts moved and BEFORE the payload does; what it raises is raised
    there, on every rank alike (each sees every header), so ranks whose payloads would not fit each other never
    exchange them (gloo aborts the process on buffers of different sizes)."""
    check_group(ctx, "an all_to_all")
    dev = ctx.comm_device
    counts = send_counts.to(device=dev, dtype=torch.int64)
    if header is not None:  # one wider counts exchange: a few host ops more, no extra collective
        send_list = counts.tolist()
        width = 1 + len(header)
        counts = torch.tensor([v for c in send_list for v in (c, *header)], dtype=torch.int64,
                              device=dev).view(-1, width)
    recv_counts = torch.empty_like(counts)
    try:
        dist.all_to_all_single(recv_counts, counts, group=ctx.group)
    except RuntimeError as e:
        raise peer_lost(ctx, e, "an all_to_all") from None
    headers = None
    if header is not None:
        got = recv_counts.tolist()
        recv_list, headers = [g[0] for g in got], [g[1:] for g in got]
        recv_counts = recv_counts.select(1, 0).contiguous()
        if check is not None:
            check(headers)
    else:
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
    try:
        dist.all_to_all_single(recv.view(-1), payload.contiguous().view(-1).to(dev),
                               [c * total for c in recv_list], [c * total for c in send_list], group=ctx.group)
    except RuntimeError as e:
        raise peer_lost(ctx, e, "an all_to_all") from None
    out = []
    off = 0
    for t, width in zip(rows, widths):
        chunk = recv[:, off:off + width].contiguous()
        off += width
        out.append(chunk.view(t.dtype).reshape((n_recv,) + tuple(t.shape[1:])))
    if headers is not None:
        return out, recv_counts.cpu(), headers
    return out, recv_counts.cpu()


def all_gather_tensor(ctx: RankContext, t: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's same-shaped tensor along dim 0 (bytes on the wire: any dtype)."""
    check_group(ctx, "an all_gather")
    src = t.contiguous().to(ctx.comm_device)
    b = src.view(torch.uint8) if src.dim() else src.reshape(1).view(torch.uint8)
    outs = [torch.empty_like(b) for _ in range(ctx.world_size)]
    try:
        dist.all_gather(outs, b, group=ctx.group)
    except RuntimeError as e:
        raise peer_lost(ctx, e, "an all_gather") from None
    parts = [o.view(t.dtype).reshape(t.shape if t.dim() else (1,)) for o in outs]
    return torch.cat(parts, dim=0)


# A peer that is gone: gloo raises at once with its own words (the connection closed) or after the group's
# timeout; those become PeerLostError naming the peers whose watchdog heartbeats stopped.
_TRANSPORT = ("Connection closed by peer", "Connection reset by peer", "Connection refused", "Broken pipe",
              "Timed out waiting", "gloo/transport", "Socket closed", "Read error", "Write error")
# Groups that lost a peer, by id(group): the first PeerLostError, raised again at once by every later collective
# of moe_ep on that group (a dead transport fails each call its own slow way, and c10d logs a C++ stack each time).
_lost: Dict[int, PeerLostError] = {}


def _group_id(ctx: RankContext) -> int:
    return id(ctx.group if ctx.group is not None else dist.group.WORLD) if ctx.pg_backend != "none" else 0


def check_group(ctx: RankContext, what: str) -> None:
    """Raise the group's PeerLostError again, at once, when it lost a peer earlier; ProcessGroupError when the
    process group was torn down under a live layer (torch's own error is an untyped ValueError from inside c10d)."""
    if ctx.pg_backend != "none" and not dist.is_initialized():
        raise ProcessGroupError("group", f"{what} of a layer whose process group was destroyed "
                                         "(torch.distributed.destroy_process_group): close every moe_ep layer "
                                         "(layer.close(), or its with-block) before tearing the group down")
    if _lost:
        err = _lost.get(_group_id(ctx))
        if err is not None:
            raise PeerLostError(err.argument, err.detail, ranks=err.ranks, transport=err.transport)


def peer_lost(ctx: RankContext, e: BaseException, what: str) -> BaseException:
    """The error to raise for `e`, raised by a collective of `what`: PeerLostError when the transport lost a peer,
    `e` itself otherwise. The group is remembered as lost: check_group() raises the same error from then on."""
    text = str(e)
    if isinstance(e, MoEError) or not (isinstance(e, getattr(dist, "DistError", ())) or
                                       any(m in text for m in _TRANSPORT)):
        return e
    ranks = list(range(ctx.world_size))
    try:
        ranks = list(dist.get_process_group_ranks(ctx.group if ctx.group is not None else dist.group.WORLD))
    except Exception:  # noqa: BLE001 - a group torch cannot describe: group ranks as they are
        pass
    try:
        from moe_ep.core.watchdog import monitor, store

        m = monitor._M
        broken = m.store_lost if m is not None else None
        if broken:  # the heartbeat already lost the store: its host is gone; no store call (c10d logs each failure)
            gone, note = ([0] if 0 in ranks else []), f"the heartbeat lost the process group's store ({broken})"
        else:
            gone, note = store.gone(ranks)
            if m is not None and 0 in gone:  # the store's host is gone: the heartbeat stops calling it
                m.store_lost = note or "its host (global rank 0) is gone"
    except Exception as ex:  # noqa: BLE001 - the error must still come
        gone, note = [], f"the heartbeats could not be read ({type(ex).__name__}: {ex})"
    group_gone = [ranks.index(g) for g in gone if g in ranks]
    timed_out = "Timed out" in text
    if group_gone:
        who = ", ".join(f"rank {r}" + (f" (global {ranks[r]})" if ranks[r] != r else "") for r in group_gone)
        head = f"{who} of the group left it during {what}: its process is gone (its watchdog heartbeat stopped)"
    elif timed_out:
        head = f"a peer did not arrive within the process group's timeout during {what}"
    else:
        head = (f"a peer left the process group during {what}; which one cannot be told: no heartbeat stopped (its "
                "watchdog is off, or its process lives without its connection)")
    first = (text.splitlines() or [""])[0][:300]
    detail = f"{head}. This rank (rank {ctx.rank} of {ctx.world_size}) cannot go on with it: end the job and restart " \
             f"its ranks. The transport said: {first}"
    if note and not group_gone:
        detail += f" ({note})"
    err = PeerLostError(None, detail, ranks=group_gone, transport=first)
    _lost[_group_id(ctx)] = err
    return err
