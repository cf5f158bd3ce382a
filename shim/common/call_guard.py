"""The call guard: ranks out of step are refused on the device, before the kernel's exchange, in a graph too (#31).

The fused kernels exchange tokens and nothing else: ranks out of step (a rank that skipped a call, made one more or
called another layer) pair their launches with each other's, and every output from there is wrong. moe_ep's watchdog
compares the ranks' sequences of calls through the store after the fact (0.8-1.6 s in a CPU simulation: ~30 outputs
a rank go out mixed). The guard compares them on the device, in the launch itself, before the kernel moves anything.

One guard per workspace pool (shim/common/workspace.py: one process group and device), a word table on the
symmetric heap; in every launch of every layer of the pool, before the kernel (call_guard_kernel.py, one program):
  1. epoch: the pool's launch count, kept on the device (graph replays count: nothing is baked in at capture)
  2. the word: (epoch mod 2^16, the layer's index among the pool's layers mod 2^16, the layer's own launch count
     mod 2^32), also from the device, in one 64-bit value
  3. stored to this rank's slot of every rank's table (one posted store a peer through the NVSHMEM deltas: a word
     arrives whole or not at all, so no atomic and no round trip)
  4. wait until every rank's slot holds this epoch: ranks pair launches in order, as the kernel's exchange does
  5. compare the words
  6. the first difference is kept (its epoch, every rank's word, in host-mapped memory) and the guard turns sticky
  7. sticky: every routing id of the launch becomes -1 (no token moves; every rank still joins the kernel, so no
     rank waits for another) and the host-mapped report says "refused"
and after the kernel:
  8. sticky: the launch's output becomes NaN (a refused call never hands back numbers)
Every rank sees every identity, so every rank refuses the same launch, and every later one.

The host: the next forward of any layer of the pool reads the report (a plain memory read, no sync) and raises
RankDivergenceError naming the ranks, the layers and the launch, after marking the group's sequence (the layer refuses
every later call at once). Calls replayed inside a graph the caller captured never reach the host: the watchdog's
monitor reads the flag every 0.2 s and, when no forward raised it within a second, ends the process with the message
(exit code 86), as for any divergence it finds.

SLOTS: a rank is at most one launch ahead of another (each launch's kernel waits for every rank), so 4 slots never
overwrite a word a peer has yet to read. Cost and the default: docs/watchdog.md ("The call guard"),
tools/diag/call_guard_cost.py. $MOE_EP_CALL_GUARD=0 turns it off (as does $MOE_EP_SEQUENCE_CHECK=0); the layer's
construction agreement compares it across ranks (a guard on one rank only would wait for its peers' words forever).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from moe_ep.core.watchdog import sequence
from moe_ep.errors import CheckConfigError, RankDivergenceError

__all__ = ["ENV", "SLOTS", "DEFAULT_ON", "requested", "available", "enabled", "PoolGuard", "Guard", "attach",
           "word", "describe", "SimRank", "simulate_launch"]

ENV = "MOE_EP_CALL_GUARD"
SLOTS = 4
# Off by default: the rule is on when it costs <= 3 us a call at T=1 and T=128, eager and in a graph, and it costs
# more (tools/diag/call_guard_cost.py; docs/watchdog.md holds the numbers). $MOE_EP_CALL_GUARD=1 turns it on.
DEFAULT_ON = False
# A group of one cannot fall out of step: no guard there (a split path's local kernel, a one-GPU job), unless the cost
# diagnostic asks for one to time the protocol at W=1.
_AT_WORLD_ONE = False
_BLOCK = 1024
_RAISE_GRACE_S = 1.0  # the monitor ends the process when no forward raised a tripped guard within this


def requested() -> bool:
    """$MOE_EP_CALL_GUARD: unset -> DEFAULT_ON, "1" / "on" -> on, "0" / "off" -> off."""
    raw = os.environ.get(ENV, "").strip().lower()
    if raw in ("", "default"):
        return DEFAULT_ON
    if raw in ("1", "on", "true"):
        return True
    if raw in ("0", "off", "false"):
        return False
    raise CheckConfigError(ENV, f"{ENV}={os.environ[ENV]!r}: expected 1 / on or 0 / off (unset: "
                                f"{'on' if DEFAULT_ON else 'off'})")


def available() -> Optional[str]:
    """None when the guard's kernels can run here (Triton importable), else why not."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means: not here
        return f"triton is not importable ({type(e).__name__}: {e})"
    return None


def enabled() -> bool:
    """Whether a layer built now gets a guard: asked for, the sequence check on, and Triton importable."""
    return requested() and sequence.enabled() and available() is None


# -- what a difference says (pure: the CPU test calls it with simulated state) --------------------------------------
def word(epoch: int, code: int, launch: int) -> int:
    """The 64-bit word a launch writes (signed, as torch's int64 holds it)."""
    w = ((epoch & 0xFFFF) << 48) | ((code & 0xFFFF) << 32) | (launch & 0xFFFFFFFF)
    return w - (1 << 64) if w >= 1 << 63 else w


def _decode(w: int) -> Tuple[int, int]:
    """(layer code, its launch count) of a word."""
    w = int(w) & 0xFFFFFFFFFFFFFFFF
    return (w >> 32) & 0xFFFF, w & 0xFFFFFFFF


def describe(report: Sequence[int], *, world: int, rank: int, ranks: Sequence[int],
             names: Dict[int, str]) -> RankDivergenceError:
    """The error for a guard's report (refused, the first epoch that differed, every rank's word then)."""
    epoch = int(report[1])
    idents = [int(v) for v in report[2:2 + world]]
    counts: Dict[int, int] = {}
    for v in idents:
        counts[v] = counts.get(v, 0) + 1
    ref = max(counts, key=lambda v: (counts[v], -idents.index(v)))
    ref_rank = idents.index(ref)
    out = [r for r, v in enumerate(idents) if v != ref]

    def name(code: int) -> str:
        return names.get(code, f"kernel layer #{code}")

    seen = {r: (name(_decode(v)[0]), _decode(v)[1], epoch) for r, v in enumerate(idents)}
    where = "; ".join(f"rank {r}{' (this rank)' if r == rank else ''} in {seen[r][0]!r} launch {seen[r][1]}"
                      for r in range(world))
    layers = list(dict.fromkeys(seen[r][0] for r in range(world)))
    against = f"rank {ref_rank}" + (", the majority" if counts[ref] > world / 2 and world > 2 else "")
    text = (f"the ranks of the group of global ranks [{', '.join(str(g) for g in ranks)}] fell out of step at the "
            f"kernels' launch {epoch} of this group: {where}. Out of step: "
            f"{', '.join(f'rank {r}' for r in out)} (against {against}); layers involved: "
            f"{', '.join(repr(n) for n in layers)}. Seen on the device by the call guard before that launch's "
            "exchange: no token of it moved and its output is NaN, as is every later launch's; every later call of "
            "this group raises this error (the ranks cannot be put back in step: rebuild the group or restart the "
            "job).")
    return RankDivergenceError(None, text, ranks=out, call=epoch, layers=layers, seen=seen)


# -- the device state -------------------------------------------------------------------------------------------------
class PoolGuard:
    """One pool's word table (symmetric heap), device state and host-mapped flag; made collectively (the table is an
    NVSHMEM allocation) by the pool's first compiled layer."""

    def __init__(self, pool):
        ctx = pool.ctx
        self.ctx, self.rank, self.world, self.device = ctx, ctx.rank, ctx.world_size, pool.device
        nbytes = SLOTS * self.world * 8
        self.words = pool._heap_alloc(nbytes).view(torch.int64).view(SLOTS, self.world)
        # NVSHMEM lays every rank's heap out alike: the pool's per-peer byte deltas reach this table on each peer.
        self.deltas = torch.tensor([int(o) // 8 for o in pool.peer_offsets], dtype=torch.int64, device=self.device)
        self.state = torch.zeros(2, dtype=torch.int64, device=self.device)
        # Host-mapped: the device writes it (only once refused), the host reads it with no sync.
        self.report = torch.zeros(2 + self.world, dtype=torch.int64)
        if self.device.type == "cuda":
            self.report = self.report.pin_memory()
        self._report = self.report.numpy()
        self.layers = 0
        self.names: Dict[int, str] = {}
        self.tripped_at: Optional[float] = None
        self.raised: Optional[RankDivergenceError] = None
        self._lock = threading.Lock()
        self._kernels = None
        # Where the device writes the report: the host-mapped tensor itself, or (where the driver will not hand
        # Triton a device address for it) a device copy that each launch copies to the host (one more graph node).
        self._report_dev: Optional[torch.Tensor] = None
        self._target: Optional[torch.Tensor] = None
        if self.world > 1:
            _watch(self)

    def new_code(self) -> int:
        self.layers += 1
        return self.layers

    @property
    def tripped(self) -> bool:
        return bool(self._report[0])

    def error(self) -> RankDivergenceError:
        """The difference the device kept, as RankDivergenceError (no device sync: the report is host memory; the
        group's sequence is marked so the layers refuse every later call at once)."""
        with self._lock:
            if self.raised is None:
                deadline = time.monotonic() + 1.0
                while not self._report[1] and time.monotonic() < deadline:  # the flag's write overtook the report's
                    time.sleep(0.001)
                time.sleep(0.001)
                ranks, _ = sequence.group_ranks(self.ctx.group)
                self.raised = describe(self._report.tolist(), world=self.world, rank=self.rank, ranks=ranks,
                                       names=self.names)
                log = sequence.log_for(self.ctx.group)
                if log is not None:
                    log.mark(self.raised)
            e = self.raised
        return RankDivergenceError(e.argument, e.detail, ranks=e.ranks, call=e.call, layers=e.layers, seen=e.seen)


class Guard:
    """One layer's part: its identity in the pool, its launch count on the device. before() / after() bracket the
    kernel's launch (inside the frontend's graphs); tripped / raise_error() are the host's check."""

    __slots__ = ("pool", "code", "calls")

    def __init__(self, pool: PoolGuard):
        self.pool = pool
        self.code = pool.new_code()
        self.calls = torch.zeros(1, dtype=torch.int64, device=pool.device)

    def name(self, name: str) -> None:
        """What the messages call this layer (the same code names the peers' layer: pools are built collectively)."""
        self.pool.names[self.code] = name

    def before(self, topk_idx: torch.Tensor, n_idx: int) -> None:
        p = self.pool
        if p._kernels is None:
            from shim.common import call_guard_kernel

            p._kernels = call_guard_kernel
        if p._target is None:  # the first launch (compile's warm-up, never captured) picks where the report goes
            try:
                self._launch(topk_idx, n_idx, p.report)
                p._target = p.report
                return
            except (RuntimeError, ValueError):
                p._report_dev = torch.zeros(p.report.shape, dtype=torch.int64, device=p.device)
                p._target = p._report_dev
        self._launch(topk_idx, n_idx, p._target)
        if p._report_dev is not None:
            p.report.copy_(p._report_dev, non_blocking=True)

    def _launch(self, topk_idx: torch.Tensor, n_idx: int, report: torch.Tensor) -> None:
        p = self.pool
        # One warp: the epoch's and the launch count's read-modify-writes are scalar code every lane runs; in one
        # warp they run together, in two they could interleave and count twice.
        p._kernels.call_guard_kernel[(1,)](p.words, p.deltas, p.state, self.calls, topk_idx, report, self.code,
                                           n_idx, RANK=p.rank, W=p.world, SLOTS=SLOTS, BLOCK=_BLOCK, num_warps=1)

    def after(self, out: torch.Tensor) -> None:
        p = self.pool
        p._kernels.poison_kernel[(1,)](out, p.state, out.numel(), BLOCK=_BLOCK, num_warps=4)

    @property
    def tripped(self) -> bool:
        return bool(self.pool._report[0])

    def raise_error(self) -> None:
        raise self.pool.error()


_pools: Dict[int, PoolGuard] = {}
_pools_lock = threading.Lock()


def attach(frontend) -> Optional[Guard]:
    """The frontend's guard (collective: the pool's first one allocates the word table), or None when the guard is off
    (enabled()), the group has one rank, or the frontend is a compile-only build."""
    if frontend.compile_only or not enabled() or (frontend.world_size == 1 and not _AT_WORLD_ONE):
        return None
    pool = frontend._pool
    with _pools_lock:
        pg = _pools.get(id(pool))
        if pg is None:
            pg = _pools[id(pool)] = PoolGuard(pool)
    return Guard(pg)


# -- the monitor: graph replays the host never sees --------------------------------------------------------------------
def _watch(pg: PoolGuard) -> None:
    from moe_ep.core.watchdog import monitor

    def probe() -> Optional[Tuple[object, str]]:
        """(the group's log, the message) when a tripped guard was not raised by a forward in time, else None."""
        if not pg.tripped or pg.raised is not None:
            return None
        now = time.monotonic()
        if pg.tripped_at is None:
            pg.tripped_at = now
            return None
        if now - pg.tripped_at < _RAISE_GRACE_S:
            return None
        err = pg.error()
        return sequence.log_for(pg.ctx.group), f"moe_ep watchdog: rank {pg.rank} of {pg.world}: {err.detail}"

    monitor.get().add_probe(probe)


# -- the protocol in torch, for the CPU test (steps as numbered above and in call_guard_kernel.py) ------------------
class SimRank:
    """One simulated rank: its word table, state and report, laid out as PoolGuard's."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.words = torch.zeros(SLOTS, world, dtype=torch.int64)
        self.state = torch.zeros(2, dtype=torch.int64)
        self.report = torch.zeros(2 + world, dtype=torch.int64)
        self.calls: Dict[int, int] = {}


def simulate_launch(ranks: List[SimRank], codes: Sequence[int], idx: Sequence[torch.Tensor]) -> None:
    """Every rank's next launch, together (step 4 waits for all of them): rank r launches layer codes[r] with routing
    ids idx[r] (masked in place when refused)."""
    mine = []
    for r, rk in enumerate(ranks):
        epoch = int(rk.state[0]) + 1                                                      # 1.
        rk.state[0] = epoch
        n = rk.calls.get(codes[r], 0) + 1
        rk.calls[codes[r]] = n
        w = word(epoch, codes[r], n)                                                      # 2.
        slot = epoch % SLOTS
        for peer in ranks:                                                                # 3.
            peer.words[slot, r] = w
        mine.append((epoch, slot, w))
    for r, rk in enumerate(ranks):
        epoch, slot, w = mine[r]
        tag = w >> 48
        assert all(int(rk.words[slot, p]) >> 48 == tag for p in range(rk.world))         # 4. (all wrote)
        bad = any(int(rk.words[slot, p]) != w for p in range(rk.world))                  # 5.
        sticky = int(rk.state[1])
        if bad:
            if sticky == 0:                                                               # 6.
                rk.report[2:2 + rk.world] = rk.words[slot]
                rk.report[1] = epoch
            sticky = 1
            rk.state[1] = 1
        if sticky:                                                                        # 7.
            rk.report[0] = 1
            idx[r].fill_(-1)
