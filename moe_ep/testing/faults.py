"""Faults for the watchdog's tests and demo: a rank that dies, stalls or skips a call, and a CPU backend that
waits for its peers the way the MegaMoE kernel does.

The kernel waits on its peers' flags in symmetric memory: a dead peer is not an error it can see, it simply
never arrives, and the survivors spin forever. gloo, on the other hand, notices a closed connection and raises
at once, so the torch reference backend alone cannot show that hang on a CPU. SpinBarrierBackend puts a flag
barrier on shared files in front of the reference backend's forward: every rank writes how many calls it has
entered, then spins (sleeping, so the GIL is free) until every peer has entered as many. Same host only.
Like the kernels, whose layers share one workspace per process group, the barrier counts the calls of every
layer of the group together (a rank that skips a call of one layer meets its peers' call of another), and it
carries no call fingerprint in its exchange (the kernel's exchange cannot): a rank out of step mixes data as
it would on the GPU, and only the watchdog's published sequences can tell.

    moe_ep.testing.faults.register()                               # the backend, as "t_spin_reference"
    layer = moe_ep.MoELayer(spec, weights, backend="t_spin_reference", barrier_dir=d)
    faults.inject(layer, Fault("stall", rank=1, call=5, seconds=8), record_dir=d)   # any backend
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Optional

from moe_ep.core.registry import register_backend
from moe_ep.reference.backend import TorchReferenceBackend

__all__ = ["SpinBarrierBackend", "Fault", "inject", "register", "BACKEND_NAME", "KINDS"]

BACKEND_NAME = "t_spin_reference"
KINDS = ("kill", "stall", "skip", "stall_before")


class SpinBarrierBackend(TorchReferenceBackend):
    """The torch reference behind a flag barrier on files in `barrier_dir` (backend option, required), one
    barrier per process group for all its layers."""

    _entered: Dict[str, int] = {}  # group tag -> calls entered by this process

    def __init__(self, spec, ctx, fmt: Optional[str] = None, *, barrier_dir: str, poll_s: float = 0.002,
                 carry_fingerprint: bool = False, **options):
        super().__init__(spec, ctx, fmt, carry_fingerprint=carry_fingerprint, **options)
        self._dir = Path(barrier_dir)
        self._dir.mkdir(parents=True, exist_ok=True)
        # Groups are made collectively, in the same order on every rank: a group's name is the same everywhere.
        name = _group_name(ctx.group)
        self._tag = f"group{name}"
        self._poll_s = poll_s
        self._entered.setdefault(self._tag, 0)

    def _flag(self, rank: int) -> Path:
        return self._dir / f"{self._tag}.r{rank}"

    def _read(self, rank: int) -> int:
        try:
            return int(self._flag(rank).read_text() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    def barrier(self) -> None:
        n = self._entered[self._tag] = self._entered[self._tag] + 1
        tmp = self._dir / f".{self._tag}.r{self.ctx.rank}.tmp"
        tmp.write_text(str(n))
        os.replace(tmp, self._flag(self.ctx.rank))
        peers = [r for r in range(self.ctx.world_size) if r != self.ctx.rank]
        while peers:
            peers = [r for r in peers if self._read(r) < n]
            if peers:
                time.sleep(self._poll_s)

    def forward(self, hidden, topk_idx, topk_weights, out):
        self.barrier()
        return super().forward(hidden, topk_idx, topk_weights, out)


def _group_name(group) -> str:
    import torch.distributed as dist

    pg = group if group is not None else dist.group.WORLD
    return "".join(c for c in str(getattr(pg, "group_name", "") or "world") if c.isalnum()) or "world"


def register() -> None:
    register_backend(BACKEND_NAME, SpinBarrierBackend, arch="cpu", formats=SpinBarrierBackend.weight_formats,
                     description="test: the torch reference behind a spin barrier on files (a dead peer hangs it, "
                                 "as it hangs the kernel)", replace=True)


@dataclass(frozen=True)
class Fault:
    """kill: the rank SIGKILLs itself inside call `call`; stall: it sleeps `seconds` inside call `call`, then goes
    on; skip: the driver loop leaves call `call` out on that rank; stall_before: the driver loop sleeps `seconds`
    before call `call` on that rank (outside the layer). The last two are the driver's: see before_call()."""
    kind: str
    rank: int = 1
    call: int = 100
    seconds: float = 0.0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"fault kind must be one of {KINDS}, got {self.kind!r}")

    def before_call(self, rank: int, call: int, record_dir: Optional[str] = None) -> bool:
        """The driver loop's part, before call `call` on `rank`: False when that call is to be skipped."""
        if rank != self.rank or call != self.call:
            return True
        if self.kind == "skip":
            write_record(record_dir, rank, **asdict(self), t=time.time())
            print(f"rank {rank}: skipping call {call}", flush=True)
            return False
        if self.kind == "stall_before":
            write_record(record_dir, rank, **asdict(self), t=time.time())
            print(f"rank {rank}: stalling {self.seconds:g} s before call {call}", flush=True)
            time.sleep(self.seconds)
            write_record(record_dir, rank, stall_end_t=time.time())
        return True


def write_record(record_dir: Optional[str], who: int, **fields) -> None:
    """What a faulty rank did and when (wall clock), for the demo's timing: record_dir/fault.rank<who>.json."""
    if record_dir:
        path = Path(record_dir) / f"fault.rank{who}.json"
        old = json.loads(path.read_text()) if path.exists() else {}
        old.update(fields)
        path.write_text(json.dumps(old))


def inject(layer, fault: Optional[Fault], record_dir: Optional[str] = None) -> None:
    """Wrap the layer's backend forward so that `fault` (kill / stall) happens inside the watched call on its rank.
    Works for any backend (the GPU demo wraps the Hopper kernel backend the same way)."""
    if fault is None or fault.kind not in ("kill", "stall") or layer.rank != fault.rank:
        return
    backend = layer.backend
    inner = backend.forward
    state = {"n": 0}

    def forward(hidden, topk_idx, topk_weights, out):
        state["n"] += 1
        if state["n"] == fault.call:
            write_record(record_dir, layer.rank, **asdict(fault), t=time.time())
            if fault.kind == "kill":
                print(f"rank {layer.rank}: killing itself inside call {fault.call}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            print(f"rank {layer.rank}: stalling {fault.seconds:g} s inside call {fault.call}", flush=True)
            time.sleep(fault.seconds)
            write_record(record_dir, layer.rank, stall_end_t=time.time())
        return inner(hidden, topk_idx, topk_weights, out)

    backend.forward = forward
