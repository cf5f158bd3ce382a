"""One watched thing: a layer (layer_watch), or a caller's own calls (moe_ep.watch), e.g. the replay of a CUDA graph
that captured moe_ep forwards.

How, per call (hot path; no allocation of device memory, no store round trip, no host sync):
  begin()  one slot of the process-wide ring (ring.py): (watch, call number, host start time), state "on the host"
  end()    CUDA: one driver call, cuEventRecord of a pre-created event on the current stream (a host-side enqueue),
           state "on the device" (events.py); CPU: the call is finished when forward returned. A call made while
           the stream is being captured into a caller's graph is counted finished: that graph's replays are the
           caller's to watch.
"""

from __future__ import annotations

import threading
from time import monotonic as _monotonic
from typing import Dict, Optional, Sequence, Tuple

import torch

from moe_ep.core.watchdog import events
from moe_ep.core.watchdog import monitor as monitor_
from moe_ep.core.watchdog.bound import Bound, parse_timeout
from moe_ep.core.watchdog.ring import DEVICE, FREE, HOST, MASK, RING, Ring
from moe_ep.core.watchdog.sequence import LOG_MASK, GroupLog, group_ranks, log_for
from moe_ep.errors import WatchdogConfigError

__all__ = ["Watch", "Off", "watch", "layer_identity", "layer_watch", "keep_sequences"]


class Watch:
    """Counts and times the calls of one watched thing. begin()/end() bracket a call (the layer does it);
    `with w:` does the same for a caller's own code, e.g. the replay of a graph that captured moe_ep forwards.

    started / returned: calls begun / returned on the host on this rank (1-based call numbers). Calls are
    numbered whether or not they could be watched (nested in another watched call, or 4096 calls in flight).
    log / code: the group's sequence of collective calls (sequence.py) and this watch's identity in it, for a
    layer or a collective watch of a group of two ranks or more; None / 0 otherwise."""

    __slots__ = ("name", "bound", "ranks", "group_rank", "started", "returned", "slowest", "code", "_log", "_m",
                 "_dev", "_evs", "_raw", "_rec", "_slot", "closed", "__weakref__")

    def __init__(self, name: str, bound: Bound, ranks: Sequence[int], group_rank: int, device=None,
                 monitor: Optional[Ring] = None, log: Optional[GroupLog] = None, code: int = 0):
        self.name = name
        self.code = code
        self._log = log
        self.bound = bound
        self.ranks = tuple(int(r) for r in ranks)  # the group's members, as global ranks
        self.group_rank = int(group_rank)
        self.started = 0
        self.returned = 0
        self.slowest = 0.0
        self._slot = -1
        self.closed = False
        device = torch.device(device) if device is not None else torch.device("cpu")
        self._m = monitor if monitor is not None else monitor_.get()
        self._dev = self._evs = self._raw = self._rec = None
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            self._evs = self._m.cuda_events(index)
            self._raw, self._rec = events.cuda.raw_stream, events.cuda.record  # bound once: the hot path looks up nothing
            self._dev = index
        if log is not None:
            log.opened(1)
        self._m.add(self)

    # hot path ----------------------------------------------------------------------------------------------
    def begin(self) -> int:
        """A call starts: its sequence number, or -1 when it cannot be watched (it is counted all the same).
        A call of a group whose ranks fell out of step is refused (RankDivergenceError, sequence.py)."""
        n = self.started + 1
        lg = self._log
        if lg is not None:
            if lg.diverged is not None:
                lg.refuse()
            s = lg.seq
            j = s & LOG_MASK
            lg.codes[j] = self.code
            lg.calls[j] = n
            lg.seq = s + 1
            lg.cur = (self.code, n, s + 1)
        self.started = n
        m = self._m
        if m.depth:  # nested in a watched call (or another thread's): the outer one covers it
            return -1
        g = m.next_g
        if g - RING > m.done_upto and not m.make_room(g):
            return -1
        i = g & MASK
        m.owner[i] = self
        m.call[i] = n
        m.state[i] = HOST
        m.t0[i] = _monotonic()
        m.gen[i] = g
        m.next_g = g + 1
        m.depth = 1
        return g

    def end(self, g: int) -> None:
        """The call returned on the host. On CUDA its device work is followed through one event recorded on the
        current stream (one driver call, no sync); on CPU it is over."""
        self.returned = self.started
        if self._log is not None:
            self._log.cur = None
        if g < 0:
            return
        m = self._m
        i = g & MASK
        if self._dev is None:
            d = _monotonic() - m.t0[i]
            if d > self.slowest:
                self.slowest = d
            m.state[i] = FREE
        else:
            raw = self._raw(self._dev)
            ev = self._evs[i]
            if self._rec(ev, raw):  # not recorded (an error): not followed on the device
                m.state[i] = FREE
            else:
                m.ev[i] = ev
                if raw != m.last_stream:
                    m.last_stream = raw
                    m.stream_since = g
                m.last_device_g = g
                m.state[i] = DEVICE
        m.depth = 0

    def abandon(self, g: int) -> None:
        """The call raised: it is over on the host, and nothing of it is followed on the device."""
        if g >= 0:
            self._m.state[g & MASK] = FREE
            self._m.depth = 0
        self.returned = self.started
        if self._log is not None:
            self._log.cur = None

    def __enter__(self):
        self._slot = self.begin()
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.end(self._slot)
        else:
            self.abandon(self._slot)
        return False

    def limit(self, call: int) -> float:
        return self.bound.limit(call, self.slowest)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._m.remove(self)
            if self._log is not None:
                self._log.opened(-1)

    def __repr__(self):
        return f"Watch({self.name!r}, calls={self.started}, bound={self.bound})"


class Off:
    """What watch() returns when the watchdog is off: a context manager that does nothing."""
    name, bound, started, returned = "", None, 0, 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def close(self):
        pass


_names_lock = threading.Lock()
_names: Dict[str, int] = {}
_layer_count = [0]


def _unique(name: str) -> str:
    with _names_lock:
        k = _names.get(name, 0) + 1
        _names[name] = k
    return name if k == 1 else f"{name} ({k})"


def layer_identity(name: Optional[str], group) -> Tuple[str, int, Optional[GroupLog]]:
    """(the layer's name, its position: its creation index among the group's layers (0 for a group of one), the
    group's log or None for a group of one). Default names count layers in creation order ("moe_ep layer #1", ...),
    the same on every rank since layers are built collectively. Taken before the layer's construction agreement and
    whatever it decides, so that names and positions stay aligned across ranks."""
    with _names_lock:
        _layer_count[0] += 1
        k = _layer_count[0]
    name = _unique(name if isinstance(name, str) and name else f"moe_ep layer #{k}")
    log = log_for(group)
    code = log.new_code(name) if log is not None else 0
    return name, code, log


def layer_watch(name: str, bound: Optional[Bound], group, device) -> Optional[Watch]:
    """The layer's timer (None when the watchdog is off). The layer logs its calls in the group's sequence itself
    (sequence.Caller), timer or not."""
    if bound is None:
        return None
    ranks, me = group_ranks(group)
    return Watch(name, bound, ranks, me, device)


def keep_sequences() -> None:
    """A layer logs its calls in a group of two ranks or more: the heartbeat publishes and compares them even when no
    timer runs (a backend that carries no fingerprint in its exchange relies on it)."""
    monitor_.get().ensure_threads()


def _sequence(group, name: str, collective_watch: bool):
    """The group's log and the next identity in it; (None, 0) for a group of one (it cannot fall out of step)."""
    log = log_for(group)
    return (log, log.new_code(name, collective_watch)) if log is not None else (None, 0)


def watch(name: str, *, group=None, device=None, timeout_s=None, collective: bool = False):
    """A reusable watch for a caller's own calls, e.g. the replay of a CUDA graph that captured moe_ep forwards
    (moe_ep does not see those replays):

        decode = moe_ep.watch("decode graph")       # once
        with decode:                                 # around every replay
            graph.replay()

    device: where the watched work runs (default: the current CUDA device if there is one, else the CPU);
    group: whose heartbeats to read when it trips (default: the default group). Make it once and reuse it (each
    watch() is a new watch with a name of its own; close() one that is done). Returns a no-op context manager
    when the watchdog is off (timeout_s=0 or MOE_EP_TIMEOUT_S=0).
    collective: every rank of the group makes this watch's calls, in the same order relative to the group's layer
    calls (the replay of a graph every rank captured alike): they join the group's sequence of collective calls,
    so a rank that skips a replay, adds one or replays another graph is caught (docs/watchdog.md). Make the
    collective watches of a group in the same order on every rank."""
    if not isinstance(name, str) or not name:
        raise WatchdogConfigError("name", f"expected a non-empty string, got {name!r}")
    bound = parse_timeout(timeout_s, where="moe_ep.watch(timeout_s=...)")
    ranks, me = group_ranks(group)
    name = _unique(name)
    # A collective watch takes its identity with the watchdog off too: identities stay aligned across ranks.
    log, code = _sequence(group, name, True) if collective else (None, 0)
    if bound is None:
        return Off()
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    return Watch(name, bound, ranks, me, device, log=log, code=code)
