"""Each process group's sequence of collective calls and its digest: how ranks tell that they are in step.

Every collective call of a group (a layer's forward; a `moe_ep.watch(..., collective=True)` call) appends
(identity, call number) to the group's log. The identity is the layer's creation index among the group's layers
(the same on every rank: layers are built collectively, in one order), the call number counts that layer's calls
from 1. The log's position is the group's collective call number: ranks in step hold the same log. It is kept per
group, not per layer, because every layer of a group meets the others' calls in the same exchange (the kernels
share one workspace; the torch reference shares the group's collectives): a rank that skips a call of layer 1
pairs its next call, to layer 2, with its peers' layer-1 call. It is per group, not per process, because a
process's groups are separate streams of calls that other processes see in other orders.

The hot path (Caller.enter: every layer call, and every call of a collective watch) writes two array slots and
three attributes: no lock, no allocation, no store. It does not depend on the watchdog's timer: a layer built with
timeout_s=0, or a call made with layer.watched = False, is logged all the same (the sequence check has its own
switch, $MOE_EP_SEQUENCE_CHECK=0 or MoELayer(sequence_check=False), agreed across ranks when a layer is built).
The monitor's heartbeat thread digests the log (a chain of blake2b hashes over blocks of BLOCK calls) and
publishes checkpoints: the digest after each of the last FINE calls, after the last MID block ends and after the
last COARSE multiples of COARSE_EVERY. Two ranks compare the checkpoints they both have: digests are chained, so
two that agree after call s agree on every call up to s, and the first checkpoint where they differ brackets the
first call that differs (divergence.py names it from the entries themselves).
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import deque
from typing import Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

from moe_ep.errors import RankDivergenceError

__all__ = ["LOG", "LOG_MASK", "BLOCK", "SEQUENCE_ENV", "GroupLog", "Caller", "log_for", "logs", "group_key",
           "group_ranks", "enabled"]

SEQUENCE_ENV = "MOE_EP_SEQUENCE_CHECK"  # "0": no layer logs its calls; nothing compares them (docs/watchdog.md)


def enabled() -> bool:
    """The process-wide default of the sequence check ($MOE_EP_SEQUENCE_CHECK, on unless "0")."""
    import os

    return os.environ.get(SEQUENCE_ENV, "1").strip() != "0"

LOG = 1 << 16          # calls kept in memory per group (the digest must read them before they are overwritten)
LOG_MASK = LOG - 1
BLOCK = 64             # calls per digest block
FINE = 64              # checkpoints after each of the last FINE calls (a slow job may make fewer than BLOCK a beat)
MID = 32               # ... after each of the last MID block ends
COARSE_EVERY = 4096    # ... and after the last COARSE multiples of COARSE_EVERY (ranks publishing far apart)
COARSE = 32
HALT_S = 60.0          # a call refused while the watchdog ends the process waits this long, then raises


def _h(prev: bytes, *parts: bytes) -> bytes:
    return hashlib.blake2b(prev + b"".join(parts), digest_size=8).digest()


class GroupLog:
    """One group's log. Written by the main thread (begin), digested by the heartbeat thread."""

    def __init__(self, key: str, ranks: Sequence[int], group_rank: int):
        self.key = key
        self.ranks = tuple(ranks)
        self.group_rank = group_rank
        self.seq = 0               # collective calls begun: call s (1-based) sits at index (s - 1) & LOG_MASK
        self.codes = array("q", bytes(8 * LOG))
        self.calls = array("q", bytes(8 * LOG))
        self.cur = None            # (identity, call, group call) of the call in progress (the in-band fingerprint)
        self.diverged: Optional[RankDivergenceError] = None  # set: every later call of the group is refused
        self.halting = False       # ... by waiting for the watchdog to end the process, rather than raising
        self.names: Dict[int, str] = {}
        self._count = [0, 0]       # layers, collective watches made in this group
        self.open = 0              # callers open on it: a log none is open on is neither published nor compared
        self._lock = threading.Lock()
        # the digest (heartbeat thread only)
        self.hashed = 0
        self.chains: deque = deque([(0, bytes(8))], maxlen=MID + 1)  # (block end, digest after it)
        self.coarse: deque = deque(maxlen=COARSE)
        self.lost: Optional[str] = None
        self._fine: Tuple[int, Dict[int, str]] = (-1, {})

    # identities -------------------------------------------------------------------------------------------------
    def new_code(self, name: str, collective_watch: bool = False) -> int:
        """The identity of the next layer (even codes) or collective watch (odd codes) of this group: its creation
        index, which is the same on every rank when they are made in the same order."""
        kind = 1 if collective_watch else 0
        with self._lock:
            self._count[kind] += 1
            code = 2 * self._count[kind] + kind
            self.names[code] = name
        return code

    def opened(self, k: int) -> None:
        with self._lock:
            self.open += k

    @property
    def live(self) -> bool:
        """Published and compared: two ranks or more, a watch open on it, no calls lost."""
        return len(self.ranks) > 1 and self.open > 0 and not self.lost

    def name_of(self, code: int) -> str:
        return self.names.get(code, f"layer #{code // 2}" if code % 2 == 0 else f"collective watch #{code // 2}")

    # the in-band fingerprint -----------------------------------------------------------------------------------
    def fingerprint(self) -> Tuple[int, int, int]:
        """(identity, its call number, group call number) of the collective call in progress on this process, or
        zeros when none is (a layer built with the sequence check off): what a backend carries in its exchange."""
        return self.cur or (0, 0, 0)

    def refuse(self) -> None:
        """A call of a group that fell out of step (begin() calls this)."""
        err = self.diverged
        if self.halting:
            # The watchdog is gathering what every rank did and then ends the process (exit 86): nothing of this
            # call may run. Should it fail to end the process, the call raises after HALT_S.
            threading.Event().wait(HALT_S)
        raise type(err)(err.argument, err.detail, ranks=err.ranks, call=err.call, layers=err.layers, seen=err.seen)

    def mark(self, err: RankDivergenceError) -> None:
        """The group fell out of step (seen in an exchange, or on the device): every later call raises err."""
        if self.diverged is None:
            self.diverged = err

    # the digest (heartbeat thread) -----------------------------------------------------------------------------
    def digest(self) -> Dict[int, str]:
        """Checkpoints: group call number -> hex digest of every call up to it. Empty once calls were lost."""
        with self._lock:
            return self._digest()

    def _digest(self) -> Dict[int, str]:
        if self.lost:
            return {}
        top = self.seq
        k0, k1 = self.hashed // BLOCK, top // BLOCK
        if top - self.hashed >= LOG - BLOCK:
            self.lost = f"{top - self.hashed} calls arrived between two digests (more than {LOG - BLOCK})"
            return {}
        codes, calls = self.codes, self.calls
        chain = self.chains[-1][1]
        for k in range(k0, k1):
            a = (k * BLOCK) & LOG_MASK
            chain = _h(chain, codes[a:a + BLOCK].tobytes(), calls[a:a + BLOCK].tobytes())
            end = (k + 1) * BLOCK
            self.chains.append((end, chain))
            if end % COARSE_EVERY == 0:
                self.coarse.append((end, chain.hex()))
        if self.seq >= k0 * BLOCK + 1 + LOG:  # the main thread overwrote entries while they were read
            self.lost = "the digest fell more than one log behind the calls"
            return {}
        self.hashed = k1 * BLOCK
        if self._fine[0] != top:
            self._fine = (top, self._partial(top))
        out = dict(self.coarse)
        out.update((end, c.hex()) for end, c in self.chains if end > 0)
        out.update(self._fine[1])
        return out

    def _partial(self, top: int) -> Dict[int, str]:
        """The digest after each of the last FINE calls: the chain at the block before, then the block's calls."""
        chains = dict(self.chains)
        out = {}
        for s in range(max(1, top - FINE + 1), top + 1):
            base = (s // BLOCK) * BLOCK
            if s == base:
                c = chains.get(s)
            else:
                prev = chains.get(base)
                if prev is None:
                    continue
                a, b = base & LOG_MASK, (base & LOG_MASK) + (s - base)
                c = _h(prev, self.codes[a:b].tobytes(), self.calls[a:b].tobytes())
            if c is not None:
                out[s] = c.hex()
        return out

    def entries(self, first: int, last: int) -> Tuple[int, List[int], List[int]]:
        """(first call number kept, identities, call numbers) of group calls first..last, as far as the log
        still holds them."""
        last = min(last, self.seq)
        first = max(first, 1, self.seq - LOG + 1)
        codes, calls = [], []
        for s in range(first, last + 1):
            j = (s - 1) & LOG_MASK
            codes.append(self.codes[j])
            calls.append(self.calls[j])
        return first, codes, calls


class Caller:
    """One layer's (or collective watch's) place in its group's log: its identity and its call count. enter() logs a
    call (the hot path); leave() says the call is over (the fingerprint reads zeros again). Made once per layer,
    whether or not its watchdog's timer is on."""

    __slots__ = ("log", "code", "calls", "closed")

    def __init__(self, log: GroupLog, code: int):
        self.log, self.code, self.calls, self.closed = log, code, 0, False
        log.opened(1)

    def enter(self) -> None:
        lg = self.log
        if lg.diverged is not None:
            lg.refuse()
        n = self.calls + 1
        self.calls = n
        s = lg.seq
        j = s & LOG_MASK
        lg.codes[j] = self.code
        lg.calls[j] = n
        lg.seq = s + 1
        lg.cur = (self.code, n, s + 1)

    def leave(self) -> None:
        self.log.cur = None

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.log.opened(-1)


def _group_name(group) -> str:
    pg = group if group is not None else dist.group.WORLD
    name = getattr(pg, "group_name", None)
    if not name:
        try:
            name = dist.distributed_c10d._get_process_group_name(pg)
        except Exception:  # noqa: BLE001 - an older torch: the ranks alone
            name = ""
    return str(name)


def group_ranks(group) -> Tuple[List[int], int]:
    """(the group's members as global ranks, this process's rank in it); ([0], 0) without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return [0], 0
    g = group if group is not None else dist.group.WORLD
    try:
        ranks = list(dist.get_process_group_ranks(g))
    except Exception:  # noqa: BLE001 - a group torch cannot describe: this process alone
        ranks = [dist.get_rank()]
    return ranks, dist.get_rank(g)


def group_key(group, ranks: Sequence[int]) -> str:
    """The same on every member: the group's name (given in creation order, collectively) and its ranks."""
    name = _group_name(group) if dist.is_available() and dist.is_initialized() else "local"
    return f"{name}:{','.join(str(r) for r in ranks)}"


_logs: Dict[str, GroupLog] = {}
_logs_lock = threading.Lock()


def log_for(group) -> Optional[GroupLog]:
    """The group's log (made on first use); None for a group of one, which cannot fall out of step."""
    ranks, me = group_ranks(group)
    if len(ranks) < 2:
        return None
    key = group_key(group, ranks)
    with _logs_lock:
        lg = _logs.get(key)
        if lg is None:
            lg = _logs[key] = GroupLog(key, ranks, me)
        return lg


def logs() -> List[GroupLog]:
    with _logs_lock:
        return list(_logs.values())
