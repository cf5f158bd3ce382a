"""The forward watchdog: a call that does not finish within its bound ends the process with one clear message.

A MegaMoE kernel is persistent and waits on its peers' flags on the device: when a peer dies, skips a call or
stalls, the survivors' kernels spin forever and nothing on the host can cancel them. What the host can do is
notice, say what happened, and end the process so the job's supervisor sees a distinct exit code instead of
a silent hang (docs/watchdog.md).

What is watched: every MoELayer forward (eager, and moe_ep's own per-token-count graph replays: both are the
backend's forward call, so the validation agreement of collective_checks=True is inside it too), and whatever a
caller wraps in `moe_ep.watch(name)` (a caller-captured CUDA graph's replay: moe_ep cannot see those).

How, per call (hot path; no allocation of device memory, no store round trip, no host sync):
  begin()  one slot of a process-wide ring: (watch, call number, host start time), state "on the host"
  end()    CUDA: one driver call, cuEventRecord of a pre-created event on the current stream (a host-side enqueue),
           state "on the device" (see _Cuda); CPU: the call is finished when forward returned. A call made while
           the stream is being captured into a caller's graph is counted finished: that graph's replays are the
           caller's to watch.
One monitor thread per process (daemon, started with the first watch) polls every POLL_S: it confirms finished
calls (event queries, newest first, a binary search when the device lags) and compares the oldest unfinished
call's age with its bound. A heartbeat thread publishes this process's progress (per watch: calls started,
returned on the host, finished on the device) to the default process group's store every HEARTBEAT_S, on a
connection of its own. When a call passes its bound, the monitor reads every peer's heartbeat twice, a few
beats apart, and classifies each peer: heartbeat stopped (process gone or hung), store unreachable (its host,
rank 0 when init_process_group made it, is gone), alive but not yet in this call (it skipped or is stalled
before it), inside the call on the host, inside it on the device, or past it. It then writes ONE message to
stderr and ends the process with os._exit(WATCHDOG_EXIT_CODE).

The bound, per watch: timeout_s (MoELayer(timeout_s=...), moe_ep.watch(timeout_s=...)) > $MOE_EP_TIMEOUT_S >
the default: DEFAULT_BASE_S + DEFAULT_FACTOR x the slowest call this watch has finished so far (measured from
the host's start to the device's finish, to within POLL_S), and at least FIRST_CALL_S for a watch's first call.
0 turns the watchdog off. An explicit bound is used as given.
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import json
import math
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from moe_ep.core.errors import WatchdogConfigError

__all__ = ["WATCHDOG_EXIT_CODE", "TIMEOUT_ENV", "DEFAULT_BASE_S", "DEFAULT_FACTOR", "FIRST_CALL_S", "POLL_S",
           "HEARTBEAT_S", "Bound", "parse_timeout", "Watch", "watch", "watch_layer", "PeerState",
           "classify_peers", "format_message"]

WATCHDOG_EXIT_CODE = 86
TIMEOUT_ENV = "MOE_EP_TIMEOUT_S"
# Default bound: ranks legitimately skew by seconds (a host stalls on GC, I/O or a slow scheduler step, a rank
# captures a graph or compiles a Triton kernel for a new token count while its peers already wait in the
# kernel), so a fixed allowance well above that, plus twice the slowest call seen (a big prefill, or skew that
# this job shows in steady state). A watch's first call waits for every rank to finish its own set-up after the
# layers were built (torch.compile of the model, an engine's warm-up): at least FIRST_CALL_S for it.
DEFAULT_BASE_S = 10.0
DEFAULT_FACTOR = 2.0
FIRST_CALL_S = 60.0
POLL_S = 0.2          # monitor period: the resolution of every timing here
HEARTBEAT_S = 0.5     # store heartbeat period
STORE_TIMEOUT_S = 2.0  # one store operation of the watchdog, at most
RING = 4096           # calls in flight the monitor can follow (more than the device's launch queue holds)
_MASK = RING - 1
_PREFIX = "moe_ep/watchdog/"

# slot states
_FREE, _HOST, _DEVICE = 0, 1, 2


# -- the bound -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Bound:
    """seconds: the fixed bound, or None for the adaptive default; source: where it was set."""
    seconds: Optional[float]
    source: str

    def limit(self, call: int, slowest: float) -> float:
        if self.seconds is not None:
            return self.seconds
        b = DEFAULT_BASE_S + DEFAULT_FACTOR * slowest
        return max(b, FIRST_CALL_S) if call <= 1 else b

    def describe(self, call: int, slowest: float) -> str:
        if self.seconds is not None:
            return f"{self.seconds:g} s, set by {self.source}"
        text = f"{self.limit(call, slowest):.1f} s, the default ({DEFAULT_BASE_S:g} s + {DEFAULT_FACTOR:g} x the " \
               f"slowest call so far, {slowest:.2f} s"
        if call <= 1:
            text += f"; at least {FIRST_CALL_S:g} s for a first call"
        return text + ")"


def parse_timeout(timeout_s=None, env=None, where: str = "MoELayer(timeout_s=...)") -> Optional[Bound]:
    """The bound from an argument, else $MOE_EP_TIMEOUT_S, else the default. None: the watchdog is off (0).
    A value that is not a finite number >= 0 raises WatchdogConfigError naming the argument or the variable.
    where: how the argument is spelled for the caller (shown in the message when the watchdog trips)."""
    env = os.environ if env is None else env
    hint = "expected seconds, a finite number >= 0 (0 turns the watchdog off)"
    if timeout_s is not None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
            raise WatchdogConfigError("timeout_s", f"{hint}, got {timeout_s!r}")
        value = float(timeout_s)
        if not math.isfinite(value) or value < 0:
            raise WatchdogConfigError("timeout_s", f"{hint}, got {timeout_s!r}")
        return Bound(value, where) if value > 0 else None
    raw = env.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return Bound(None, "default")
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value < 0:
        raise WatchdogConfigError(TIMEOUT_ENV, f"{TIMEOUT_ENV}={env[TIMEOUT_ENV]!r}: {hint}")
    return Bound(value, f"${TIMEOUT_ENV}") if value > 0 else None


# -- one watched thing: a layer, or a caller's replay ---------------------------------------------------------
class Watch:
    """Counts and times the calls of one watched thing. begin()/end() bracket a call (the layer does it);
    `with w:` does the same for a caller's own code, e.g. the replay of a graph that captured moe_ep forwards.

    started / returned: calls begun / returned on the host on this rank (1-based call numbers). Calls are
    numbered whether or not they could be watched (nested in another watched call, or 4096 calls in flight)."""

    __slots__ = ("name", "bound", "ranks", "group_rank", "started", "returned", "slowest", "_m", "_dev", "_evs",
                 "_raw", "_rec", "_slot", "closed", "__weakref__")

    def __init__(self, name: str, bound: Bound, ranks: Sequence[int], group_rank: int, device=None,
                 monitor: Optional["_Monitor"] = None):
        self.name = name
        self.bound = bound
        self.ranks = tuple(int(r) for r in ranks)  # the group's members, as global ranks
        self.group_rank = int(group_rank)
        self.started = 0
        self.returned = 0
        self.slowest = 0.0
        self._slot = -1
        self.closed = False
        device = torch.device(device) if device is not None else torch.device("cpu")
        self._m = monitor if monitor is not None else _monitor()
        self._dev = self._evs = self._raw = self._rec = None
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            self._evs = self._m.cuda_events(index)
            self._raw, self._rec = _cuda.raw_stream, _cuda.record  # bound once: the hot path looks up nothing
            self._dev = index
        self._m.add(self)

    # hot path ----------------------------------------------------------------------------------------------
    def begin(self) -> int:
        """A call starts: its sequence number, or -1 when it cannot be watched (it is counted all the same)."""
        m = self._m
        n = self.started + 1
        self.started = n
        if m.depth:  # nested in a watched call (or another thread's): the outer one covers it
            return -1
        g = m.next_g
        if g - RING > m.done_upto and not m.make_room(g):
            return -1
        i = g & _MASK
        m.owner[i] = self
        m.call[i] = n
        m.state[i] = _HOST
        m.t0[i] = _monotonic()
        m.gen[i] = g
        m.next_g = g + 1
        m.depth = 1
        return g

    def end(self, g: int) -> None:
        """The call returned on the host. On CUDA its device work is followed through one event recorded on the
        current stream (one driver call, no sync); on CPU it is over."""
        self.returned = self.started
        if g < 0:
            return
        m = self._m
        i = g & _MASK
        if self._dev is None:
            d = _monotonic() - m.t0[i]
            if d > self.slowest:
                self.slowest = d
            m.state[i] = _FREE
        else:
            raw = self._raw(self._dev)
            ev = self._evs[i]
            if self._rec(ev, raw):  # not recorded (an error): not followed on the device
                m.state[i] = _FREE
            else:
                m.ev[i] = ev
                if raw != m.last_stream:
                    m.last_stream = raw
                    m.stream_since = g
                m.last_device_g = g
                m.state[i] = _DEVICE
        m.depth = 0

    def abandon(self, g: int) -> None:
        """The call raised: it is over on the host, and nothing of it is followed on the device."""
        if g >= 0:
            self._m.state[g & _MASK] = _FREE
            self._m.depth = 0
        self.returned = self.started

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

    def __repr__(self):
        return f"Watch({self.name!r}, calls={self.started}, bound={self.bound})"


class _Off:
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


def _group_ranks(group) -> Tuple[List[int], int]:
    if not (dist.is_available() and dist.is_initialized()):
        return [0], 0
    g = group if group is not None else dist.group.WORLD
    try:
        ranks = list(dist.get_process_group_ranks(g))
    except Exception:  # noqa: BLE001 - a group torch cannot describe: this process alone
        ranks = [dist.get_rank()]
    return ranks, dist.get_rank(g)


def watch_layer(name: Optional[str], bound: Optional[Bound], group, device) -> Tuple[str, Optional[Watch]]:
    """(the layer's name, its Watch or None when the watchdog is off). Default names count layers in creation
    order ("moe_ep layer #1", ...), the same on every rank since layers are built collectively."""
    with _names_lock:
        _layer_count[0] += 1
        k = _layer_count[0]
    name = _unique(name if name else f"moe_ep layer #{k}")
    if bound is None:
        return name, None
    ranks, me = _group_ranks(group)
    return name, Watch(name, bound, ranks, me, device)


def watch(name: str, *, group=None, device=None, timeout_s=None):
    """A reusable watch for a caller's own calls, e.g. the replay of a CUDA graph that captured moe_ep forwards
    (moe_ep does not see those replays):

        decode = moe_ep.watch("decode graph")       # once
        with decode:                                 # around every replay
            graph.replay()

    device: where the watched work runs (default: the current CUDA device if there is one, else the CPU);
    group: whose heartbeats to read when it trips (default: the default group). Make it once and reuse it (each
    watch() is a new watch with a name of its own; close() one that is done). Returns a no-op context manager
    when the watchdog is off (timeout_s=0 or MOE_EP_TIMEOUT_S=0)."""
    if not isinstance(name, str) or not name:
        raise WatchdogConfigError("name", f"expected a non-empty string, got {name!r}")
    bound = parse_timeout(timeout_s, where="moe_ep.watch(timeout_s=...)")
    if bound is None:
        return _Off()
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    ranks, me = _group_ranks(group)
    return Watch(_unique(name), bound, ranks, me, device)


# -- CUDA entry points, bound on first use (a CPU-only torch has none) ---------------------------------------
_NOT_READY = 600  # CUDA_ERROR_NOT_READY
_EVENT_DISABLE_TIMING = 2


class _Cuda:
    """The CUDA calls of the hot path and of the monitor.

    kind "driver" (preferred): the driver through ctypes, pre-created events, ONE call per watched call
    (cuEventRecord(event, the current stream's raw handle from torch)). torch's Event.record costs several runtime
    calls (a capture check, a device guard, the record, with the GIL released around them); with a capture check of
    our own it measured ~5.5 us a call on the H200 host (benchmarks/h200/round2_0.7.4/bench_tuned). kind "torch": the
    same through torch's events, where the driver library cannot be loaded.

    No capture check: recording a plain event on a capturing stream is legal (it marks a point for cross-stream
    dependencies and adds no node to the graph). Queried later, such an event reports an error instead of a state,
    and query() counts any error as finished: a caller's graph replays are the caller's to watch.
    record(event, raw stream) -> 0 when recorded; query(event) -> True when finished (or not followable)."""

    def __init__(self):
        self.ready = False
        self.kind = None
        self.query = lambda ev: True  # nothing recorded before bind()

    def bind(self, kind: Optional[str] = None) -> None:
        if self.ready:
            return
        self.capturing = torch._C._cuda_isCurrentStreamCapturing
        self.raw_stream = torch._C._cuda_getCurrentRawStream
        kind = kind or os.environ.get("MOE_EP_WATCHDOG_EVENTS", "driver")
        if kind == "driver":
            try:
                self._bind_driver()
            except (OSError, AttributeError):
                kind = "torch"
        if kind != "driver":
            self._bind_torch()
        self.kind = kind
        self.ready = True

    def _bind_driver(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")  # CDLL releases the GIL during each call: a record that blocks on a
        c_int, c_void_p, ptr = ctypes.c_int, ctypes.c_void_p, ctypes.POINTER  # full launch queue stalls nothing else

        def fn(name, *argtypes):
            f = getattr(lib, name)
            f.argtypes, f.restype = list(argtypes), c_int
            return f

        self._lib = lib
        self._create = fn("cuEventCreate", ptr(c_void_p), ctypes.c_uint)
        self._device_get = fn("cuDeviceGet", ptr(c_int), c_int)
        self._ctx_retain = fn("cuDevicePrimaryCtxRetain", ptr(c_void_p), c_int)
        self._ctx_release = fn("cuDevicePrimaryCtxRelease_v2", c_int)
        self._ctx_push = fn("cuCtxPushCurrent_v2", c_void_p)
        self._ctx_pop = fn("cuCtxPopCurrent_v2", ptr(c_void_p))
        self.record = fn("cuEventRecord", c_void_p, c_void_p)
        q = fn("cuEventQuery", c_void_p)
        self.query = lambda ev: q(ev) != _NOT_READY
        self.new_events = self._driver_events

    def _driver_events(self, dev: int, n: int) -> list:
        """n events in the device's primary context (the one torch uses), timing off."""
        c_void_p = ctypes.c_void_p
        device, ctx, popped = ctypes.c_int(), c_void_p(), c_void_p()
        for rc in (self._device_get(ctypes.byref(device), dev), self._ctx_retain(ctypes.byref(ctx), device.value)):
            if rc:
                raise RuntimeError(f"moe_ep watchdog: CUDA driver error {rc} getting device {dev}'s context")
        self._ctx_push(ctx)
        try:
            out = []
            for _ in range(n):
                h = c_void_p()
                rc = self._create(ctypes.byref(h), _EVENT_DISABLE_TIMING)
                if rc:
                    raise RuntimeError(f"moe_ep watchdog: cuEventCreate failed with CUDA driver error {rc}")
                out.append(h.value)
            return out
        finally:
            self._ctx_pop(ctypes.byref(popped))
            self._ctx_release(device.value)

    def _bind_torch(self) -> None:
        base_record = torch._C._CudaEventBase.record
        streams: Dict[int, object] = {}

        def record(ev, raw) -> int:
            s = streams.get(raw)
            if s is None:
                if len(streams) > 64:
                    streams.clear()
                s = streams[raw] = torch.cuda.current_stream()
            try:
                base_record(ev, s)
                return 0
            except Exception:  # noqa: BLE001 - not recorded: the call is not followed on the device
                return 1

        def query(ev) -> bool:
            try:
                return ev.query()
            except Exception:  # noqa: BLE001 - e.g. recorded in a capture: not followable, counted finished
                return True

        def new_events(dev: int, n: int) -> list:
            with torch.cuda.device(dev):
                return [torch.cuda.Event() for _ in range(n)]

        self.record, self.query, self.new_events = record, query, new_events


_cuda = _Cuda()
_monotonic = time.monotonic


# -- the monitor ---------------------------------------------------------------------------------------------
class _Monitor:
    """Process-wide: the ring of watched calls, the monitor thread and the heartbeat thread."""

    def __init__(self, threads: bool = True):
        self.gen = [-1] * RING
        self.owner: List[Optional[Watch]] = [None] * RING
        self.call = [0] * RING
        self.t0 = [0.0] * RING
        self.state = [_FREE] * RING
        self.ev: list = [None] * RING
        self.next_g = 0          # the next call's sequence number
        self.done_upto = -1      # every call with a sequence number <= this one has finished
        self.depth = 0
        self.last_stream = None
        self.stream_since = 0    # first sequence number recorded on last_stream
        self.last_device_g = -1
        self.events: Dict[int, list] = {}
        self.watches: List[Watch] = []
        self.lock = threading.Lock()
        self.tripped = False
        self.tripped_info: Optional[dict] = None  # published in the heartbeat: {"name", "call", "stage"}
        self.last_poll = _monotonic()
        self.wake = threading.Event()
        self.beat = 0
        self.store_error: Optional[str] = None
        self.threads_started = False
        self.stop = threading.Event()
        self.threads: List[threading.Thread] = []
        self.with_threads = threads  # False: a test drives confirm() / check_deadlines() itself

    # called by the main thread -------------------------------------------------------------------------------
    def cuda_events(self, dev: int) -> list:
        """The ring's events on device dev, created once (RING of them: creation stays off the hot path)."""
        _cuda.bind()
        evs = self.events.get(dev)
        if evs is None:
            try:
                evs = _cuda.new_events(dev, RING)
            except RuntimeError as e:
                if _cuda.kind != "driver" or self.events:
                    raise
                _warn(f"{e}; following calls through torch's events instead")
                _cuda.ready = False
                _cuda.bind("torch")
                evs = _cuda.new_events(dev, RING)
            self.events[dev] = evs
        return evs

    def add(self, w: Watch) -> None:
        with self.lock:
            self.watches.append(w)
            start = self.with_threads and not self.threads_started
            self.threads_started = self.threads_started or start
        if start:
            self.threads = [threading.Thread(target=self._monitor_loop, name="moe_ep-watchdog", daemon=True),
                            threading.Thread(target=self._heartbeat_loop, name="moe_ep-watchdog-heartbeat",
                                             daemon=True)]
            for t in self.threads:
                t.start()
            atexit.register(self.shutdown)

    def shutdown(self) -> None:
        """At interpreter exit: stop both threads and wait for them (bounded). A daemon thread that finalization
        catches inside a store call (C++, GIL released) would abort the process on its way out."""
        self.stop.set()
        for t in self.threads:
            if t is not threading.current_thread():
                t.join(STORE_TIMEOUT_S + 1.0)

    def remove(self, w: Watch) -> None:
        with self.lock:
            if w in self.watches:
                self.watches.remove(w)

    def make_room(self, g: int) -> bool:
        """RING calls in flight: confirm finished ones now (rare: the monitor runs every POLL_S). Not while this
        thread captures a graph: an event query would invalidate the capture (the call is then not watched)."""
        if _cuda.ready and _cuda.capturing():
            return False
        self.confirm(_monotonic())
        return g - RING <= self.done_upto

    # confirmation --------------------------------------------------------------------------------------------
    def confirm(self, now: float) -> None:
        """Advance done_upto over every finished call. Events on one stream finish in order, so the newest is
        queried first, and a binary search finds the first unfinished one when the device lags."""
        with self.lock:
            g0 = self.done_upto + 1
            h = self.next_g
            if g0 >= h:
                return
            mask = RING - 1
            state, gen = self.state, self.gen
            last = h - 1
            if state[last & mask] == _HOST:  # the call in progress (only ever the newest one)
                last -= 1
            if last < g0:
                return
            stop = last + 1  # first unfinished sequence number
            ldg = self.last_device_g
            query = _cuda.query
            if ldg >= g0 and not (self.stream_since <= g0 and query(self.ev[ldg & mask])):
                # the device lags (or two streams): find the first unfinished call
                devs = [g for g in range(g0, last + 1) if state[g & mask] == _DEVICE and gen[g & mask] == g]
                if self.stream_since <= g0:  # one stream: finished-ness is monotonic in order
                    lo, hi = 0, len(devs)
                    while lo < hi:
                        mid = (lo + hi) // 2
                        if query(self.ev[devs[mid] & mask]):
                            lo = mid + 1
                        else:
                            hi = mid
                else:
                    lo = 0
                    while lo < len(devs) and query(self.ev[devs[lo] & mask]):
                        lo += 1
                if lo < len(devs):
                    stop = devs[lo]
            if stop > g0:
                i = g0 & mask
                owner = self.owner[i]
                if owner is not None and self.state[i] == _DEVICE:
                    d = now - self.t0[i]  # host start -> seen finished: an upper bound, to within POLL_S
                    if d > owner.slowest:
                        owner.slowest = d
                self.done_upto = stop - 1

    def oldest_unfinished(self) -> List[Tuple[Watch, int, float, int]]:
        """(watch, call, host start, state) of the oldest unfinished call and of the call on the host, if other."""
        out = []
        mask = RING - 1
        g0, h = self.done_upto + 1, self.next_g
        for g in ((g0, h - 1) if h - 1 > g0 else (g0,)):
            if g >= h:
                continue
            i = g & mask
            owner, call, t0, st = self.owner[i], self.call[i], self.t0[i], self.state[i]
            if self.gen[i] == g and owner is not None and st != _FREE:
                out.append((owner, call, t0, st))
        return out

    def check_deadlines(self, now: float, note: str = "") -> None:
        for owner, call, t0, st in self.oldest_unfinished():
            limit = owner.limit(call)
            if now - t0 > limit:
                self.trip(owner, call, t0, st, now, note)
                return

    # the threads ---------------------------------------------------------------------------------------------
    def _monitor_loop(self) -> None:
        _relax_capture_mode()
        device_set = False
        reported = set()

        def report(where, e):  # once per kind of error: the watchdog must never flood a log
            key = (where, type(e).__name__, str(e)[:80])
            if key not in reported:
                reported.add(key)
                _warn(f"{where} error {type(e).__name__}: {e}")

        while not self.stop.is_set():
            try:
                if self.events and not device_set:
                    # This thread's event queries on the watched GPU's context, not on a context of GPU 0 that
                    # a fresh thread's first CUDA call would otherwise create (memory on another rank's GPU).
                    torch.cuda.set_device(min(self.events))
                    device_set = True
                self.confirm(_monotonic())
            except Exception as e:  # noqa: BLE001 - the watchdog must never take the process down by itself
                report("monitor (confirming calls)", e)
            try:  # deadlines are checked whatever confirming did: a failing query must not silence the watchdog
                self.check_deadlines(_monotonic())
            except Exception as e:  # noqa: BLE001
                report("monitor (deadlines)", e)
            self.last_poll = _monotonic()
            self.stop.wait(POLL_S)

    def _heartbeat_loop(self) -> None:
        store, failures = None, 0
        while not self.stop.is_set():
            # Beats while a watch is open and the process group lives (after destroy_process_group, or once
            # every layer is closed, a peer may already be gone with the store: nothing to say any more).
            if failures < 3 and self.watches and dist.is_available() and dist.is_initialized():
                try:
                    if store is None:
                        store = _connect_store()
                    if store is not None:
                        store.set(_heartbeat_key(_global_rank()), self.heartbeat())
                        failures = 0
                except Exception as e:  # noqa: BLE001 - the store went away: peers will see this rank stop
                    # c10d logs every failed store call with a stack: after a broken connection, stop for good.
                    self.store_error = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
                    failures = 3 if isinstance(e, getattr(dist, "DistNetworkError", ())) else failures + 1
            # The monitor thread is stuck (e.g. in a driver call): decide from what it last confirmed.
            if _monotonic() - self.last_poll > max(2.0, 10 * POLL_S):
                try:
                    self.check_deadlines(_monotonic(), note="the monitor thread itself stopped polling")
                except Exception as e:  # noqa: BLE001
                    _warn(f"heartbeat check error {type(e).__name__}: {e}")
            self.stop.wait(HEARTBEAT_S)

    def progress(self) -> Dict[str, List[int]]:
        """name -> [started, returned on the host, finished] for every watch of this process."""
        pending: Dict[int, int] = {}
        mask = RING - 1
        g0, h = self.done_upto + 1, self.next_g
        for g in range(g0, h):
            i = g & mask
            o = self.owner[i]
            if o is not None and self.gen[i] == g and self.state[i] != _FREE and id(o) not in pending:
                pending[id(o)] = self.call[i]
        with self.lock:
            watches = list(self.watches)
        out = {}
        for w in watches:
            done = pending[id(w)] - 1 if id(w) in pending else w.returned
            out[w.name] = [w.started, w.returned, min(done, w.returned)]
        return out

    def heartbeat(self) -> str:
        self.beat += 1
        return json.dumps({"beat": self.beat, "t": time.time(), "pid": os.getpid(), "host": socket.gethostname(),
                           "calls": self.progress(), "tripped": self.tripped_info})

    # the end -------------------------------------------------------------------------------------------------
    def trip(self, owner: Watch, call: int, t0: float, st: int, now: float, note: str = "") -> None:
        """Read the peers, print the message, end the process. The peers are told through this process's
        heartbeat (stage "reading", then "ending"); the store's host (global rank 0) stays LINGER_S at most while
        a peer is still reading, so that ranks tripping together can all read the store before it goes."""
        with self.lock:
            if self.tripped:
                return
            self.tripped = True
        self.tripped_info = {"name": owner.name, "call": call, "stage": "reading"}
        waited = now - t0
        store, why = None, "no process group"
        if len(owner.ranks) > 1 and dist.is_available() and dist.is_initialized():
            store, why = _bounded(_connect_store, STORE_TIMEOUT_S + 1.0)
            self._publish(store)
        try:
            peers, reachable, store_note = read_peers(owner, store, connect=False, why=why or "")
            states = classify_peers(owner.name, call, peers, owner.ranks, owner.group_rank, reachable)
        except Exception as e:  # noqa: BLE001 - still say what is known, and still end
            states, store_note = [], f"the peers could not be read ({type(e).__name__}: {e})"
        text = format_message(name=owner.name, call=call, rank=owner.group_rank, world=len(owner.ranks),
                              waited_s=waited, on_device=(st == _DEVICE),
                              bound=owner.bound.describe(call, owner.slowest), peers=states,
                              store_note=store_note, note=note, global_rank=_global_rank(),
                              ranks=owner.ranks)
        _emit(text)
        self.tripped_info = dict(self.tripped_info, stage="ending")
        if store is not None:
            self._publish(store)
            if _global_rank() == 0:
                alive = [p.global_rank for p in states if p.state not in STOPPED_STATES]
                _linger(store, alive)
        _EXIT(WATCHDOG_EXIT_CODE)

    def _publish(self, store) -> None:
        if store is not None:
            _bounded(lambda: store.set(_heartbeat_key(_global_rank()), self.heartbeat()), 1.0)


LINGER_S = 3.0


def _linger(store, ranks: Sequence[int]) -> None:
    """The store's host, tripped: wait (LINGER_S at most) until no peer is between "reading" and "ending" (a peer
    gets HEARTBEAT_S + a little to show that it tripped too), so peers tripping now can still read the store."""
    t_end = _monotonic() + LINGER_S
    t_min = _monotonic() + HEARTBEAT_S + 0.2
    while ranks and _monotonic() < t_end:
        beats, _ = _bounded(lambda: _read_once(store, ranks), 1.0)
        reading = [r for r, hb in (beats or {}).items()
                   if hb and (hb.get("tripped") or {}).get("stage") == "reading"]
        if not reading and _monotonic() >= t_min:
            return
        time.sleep(0.1)


_M: Optional[_Monitor] = None
_M_lock = threading.Lock()


def _relax_capture_mode() -> None:
    """This thread's CUDA calls (event queries) must not disturb another thread's graph capture: in the default
    "global" capture mode any thread's potentially unsafe call invalidates a capture in progress (seen on the
    H200: a whole-model capture failed with cudaErrorStreamCaptureInvalidated while the monitor polled). A
    thread in "relaxed" mode is exempt, and neither prohibited nor prohibiting."""
    try:
        from cuda.bindings import runtime as rt

        rt.cudaThreadExchangeStreamCaptureMode(rt.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed)
    except Exception as e:  # noqa: BLE001 - no cuda-python / no GPU: nothing to relax
        if torch.cuda.is_available():
            _warn(f"could not set the monitor thread's capture mode to relaxed ({type(e).__name__}: {e})")


def _monitor() -> _Monitor:
    global _M
    if _M is None:
        with _M_lock:
            if _M is None:
                _M = _Monitor()
    return _M


def _forget_after_fork() -> None:
    """A forked child has none of the parent's threads: its first watch starts a monitor of its own."""
    global _M
    _M = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def _warn(text: str) -> None:
    try:
        sys.stderr.write(f"moe_ep watchdog [pid {os.getpid()}]: {text}\n")
    except Exception:  # noqa: BLE001
        pass


def _emit(text: str) -> None:
    """The message, unbuffered, then whatever Python still holds in its own buffers (bounded)."""
    try:
        os.write(2, text.encode("utf-8", "replace"))
    except OSError:
        pass

    def flush():
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:  # noqa: BLE001
                pass

    t = threading.Thread(target=flush, daemon=True)
    t.start()
    t.join(1.0)


_EXIT = os._exit  # tests replace it


# -- the store -----------------------------------------------------------------------------------------------
def _global_rank() -> int:
    try:
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    except Exception:  # noqa: BLE001
        return 0


def _heartbeat_key(global_rank: int) -> str:
    return f"rank{global_rank}"


def _store_address() -> Optional[Tuple[str, int]]:
    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    s = _get_default_store()
    while hasattr(s, "underlying_store"):
        s = s.underlying_store
    if isinstance(s, dist.TCPStore):
        return s.host, s.port
    return None


def _connect_store():
    """A store client of the watchdog's own (its own connection and timeout) on the default group's store, or
    the default store itself when it is not a TCPStore; None without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    addr = _store_address()
    if addr is not None:
        client = dist.TCPStore(addr[0], addr[1], is_master=False, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
        return dist.PrefixStore(_PREFIX, client)
    from torch.distributed.distributed_c10d import _get_default_store

    return dist.PrefixStore(_PREFIX, _get_default_store())


def _bounded(fn, timeout_s: float):
    """fn() in a helper thread: (result, None) or (None, why) after an exception or timeout_s."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001
            box["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        return None, f"no answer within {timeout_s:g} s"
    if "error" in box:
        return None, box["error"]
    return box.get("value"), None


def _read_once(store, ranks: Sequence[int]) -> Dict[int, Optional[dict]]:
    out = {}
    for r in ranks:
        key = _heartbeat_key(r)
        if not store.check([key]):
            out[r] = None
            continue
        out[r] = json.loads(store.get(key).decode())
    return out


def read_peers(owner: Watch, store=None, gap_s: Optional[float] = None, connect: bool = True,
               why: str = "it did not answer"):
    """Every group member's heartbeat, read twice gap_s apart (a beat that did not advance has stopped).
    Returns ({global rank: (first, second)}, reachable, note): reachable is False when the store could not be
    read at all; note says why, or what else went wrong."""
    me = _global_rank()
    ranks = [r for r in owner.ranks if r != me]
    if not ranks:
        return {}, True, None
    if not (dist.is_available() and dist.is_initialized()):
        return {r: (None, None) for r in ranks}, False, "no process group: the peers cannot be read"
    gap_s = 2.5 * HEARTBEAT_S if gap_s is None else gap_s
    budget = STORE_TIMEOUT_S + 1.0
    if store is None and connect:
        store, why = _bounded(_connect_store, budget)
    if store is None:
        return {r: (None, None) for r in ranks}, False, _store_unreachable(why)
    first, why = _bounded(lambda: _read_once(store, ranks), budget)
    if first is None:
        return {r: (None, None) for r in ranks}, False, _store_unreachable(why)
    time.sleep(gap_s)
    second, why = _bounded(lambda: _read_once(store, ranks), budget)
    if second is None:
        return {r: (first.get(r), None) for r in ranks}, False, _store_unreachable(why)
    return {r: (first.get(r), second.get(r)) for r in ranks}, True, None


def _store_unreachable(why: Optional[str]) -> str:
    addr = None
    try:
        addr = _store_address()
    except Exception:  # noqa: BLE001
        pass
    where = f" at {addr[0]}:{addr[1]}" if addr else ""
    return (f"the process group's store{where} cannot be reached ({why}): the process hosting it (global rank 0 "
            "when init_process_group created it) is gone or hung")


# -- classification and the message (pure: unit-tested with fake heartbeats) ----------------------------------
@dataclass(frozen=True)
class PeerState:
    rank: int          # in the watched group
    global_rank: int
    state: str         # stopped | unreachable | no_heartbeat | unknown | not_entered | inside_host | inside_device | past
    started: Optional[int] = None
    detail: str = ""


STOPPED_STATES = ("stopped", "unreachable", "no_heartbeat")


def classify_peers(name: str, call: int, peers: Dict[int, Tuple[Optional[dict], Optional[dict]]],
                   ranks: Sequence[int], my_rank: int, reachable: bool = True, now_wall: Optional[float] = None,
                   store_host_rank: int = 0) -> List[PeerState]:
    """One PeerState per member of the group but this rank (my_rank, in the group). peers: global rank ->
    (first, second) heartbeat, as the heartbeat thread writes them (None: absent, or the read failed);
    reachable: whether the store answered both reads."""
    now_wall = time.time() if now_wall is None else now_wall
    out = []
    for grp_rank, g in enumerate(ranks):
        if grp_rank == my_rank:
            continue
        first, second = peers.get(g, (None, None))
        if second is None and not reachable:
            if g == store_host_rank:
                out.append(PeerState(grp_rank, g, "unreachable", None,
                                     "hosts the process group's store, which cannot be reached: gone or hung"))
            else:
                why = "the store stopped answering" if first is not None else "the store cannot be reached"
                out.append(PeerState(grp_rank, g, "unknown", None, f"unknown: {why}"))
            continue
        if second is None:
            out.append(PeerState(grp_rank, g, "no_heartbeat", None,
                                 "never published a heartbeat (gone before its first one, or not watching)"))
            continue
        started, returned, done = (second.get("calls", {}).get(name) or [0, 0, 0])[:3]
        age = now_wall - float(second.get("t", now_wall))
        if first is not None and int(second.get("beat", 0)) <= int(first.get("beat", 0)):
            out.append(PeerState(grp_rank, g, "stopped", started,
                                 f"heartbeat stopped {age:.1f} s ago (pid {second.get('pid')} on "
                                 f"{second.get('host')}): its process is gone or hung; its last heartbeat showed "
                                 f"{started} call(s) of {name!r} started"))
        elif started < call:
            out.append(PeerState(grp_rank, g, "not_entered", started,
                                 f"alive, but never entered call {call}: its last call was {started} (it skipped a "
                                 "call or is stalled before this one)"))
        elif returned < call:
            out.append(PeerState(grp_rank, g, "inside_host", started,
                                 f"alive and inside call {call} on the host (its forward has not returned)"))
        elif done < call:
            out.append(PeerState(grp_rank, g, "inside_device", started,
                                 f"alive; call {call} returned on the host, its device has not finished it"))
        else:
            out.append(PeerState(grp_rank, g, "past", started,
                                 f"alive and finished call {call} (it is at call {started}): the ranks' calls are out "
                                 "of step (a rank skipped or added a call earlier)"))
        tripped = second.get("tripped")
        if isinstance(tripped, dict):
            p = out[-1]
            out[-1] = PeerState(p.rank, p.global_rank, p.state, p.started,
                                f"{p.detail}; its own watchdog tripped too ({tripped.get('name')!r} call "
                                f"{tripped.get('call')})")
    return out


def format_message(*, name: str, call: int, rank: int, world: int, waited_s: float, on_device: bool, bound: str,
                   peers: Sequence[PeerState], store_note: Optional[str] = None, note: str = "",
                   global_rank: Optional[int] = None, ranks: Sequence[int] = ()) -> str:
    """The one message a tripped watchdog prints."""
    def names(states):
        return ", ".join(f"rank {p.rank}" + (f" (global {p.global_rank})" if p.global_rank != p.rank else "")
                         for p in states) or "none"

    stopped = [p for p in peers if p.state in STOPPED_STATES]
    not_entered = [p for p in peers if p.state == "not_entered"]
    inside = [p for p in peers if p.state in ("inside_host", "inside_device")]
    past = [p for p in peers if p.state == "past"]
    unknown = [p for p in peers if p.state == "unknown"]
    me = f"rank {rank}" + (f" (global {global_rank})" if global_rank is not None and global_rank != rank else "")
    where = ("returned on the host; the device has not finished it" if on_device else
             "still inside the forward on the host")
    lines = [f"moe_ep watchdog: {me} of {world}: {name!r} call {call} has not finished after {waited_s:.1f} s "
             f"({where}).",
             f"  bound: {bound}; set MOE_EP_TIMEOUT_S=<seconds> or MoELayer(..., timeout_s=...) to change it, 0 "
             "turns the watchdog off."]
    if note:
        lines.append(f"  note: {note}")
    if world > 1:
        lines.append(f"  heartbeat stopped or unreachable: {names(stopped)}")
        lines.append(f"  alive, never entered call {call}: " + (", ".join(
            f"rank {p.rank} (last call {p.started})" for p in not_entered) or "none"))
        lines.append(f"  alive, inside call {call}: {names(inside)}")
        if past:
            lines.append(f"  alive, past call {call}: {names(past)}")
        if unknown:
            lines.append(f"  unknown (the store cannot be read): {names(unknown)}")
        for p in peers:
            lines.append(f"    rank {p.rank}: {p.detail}")
        if store_note:
            lines.append(f"  store: {store_note}")
        if stopped:
            verdict = (f"{names(stopped)} stopped: call {call} cannot finish without them.")
        elif not_entered:
            verdict = (f"{names(not_entered)} never entered call {call}: a rank skipped a call or is stalled "
                       "before it.")
        elif past:
            verdict = f"the ranks' calls are out of step: {names(past)} already finished call {call}."
        elif inside and len(inside) == len(peers):
            on_host = [p for p in inside if p.state == "inside_host"]
            verdict = f"no rank is missing: every rank is inside call {call}"
            if on_host and on_device:
                verdict += (f"; {names(on_host)} never returned from it on the host while this rank's device waits: "
                            "the stall is there (inside its forward).")
            elif on_host:
                verdict += (f"; still inside the forward on the host: {names(on_host)} and this rank (a stall inside "
                            "one of them, or all waiting in the kernel or a collective).")
            else:
                verdict += "; the device is where it stalls (the kernel, or a collective on the device)."
        else:
            verdict = "the peers could not be classified."
        lines.append(f"  verdict: {verdict}")
    else:
        lines.append("  this group has one rank: the call itself is stuck (the kernel, or a collective).")
    lines.append(f"  A persistent MegaMoE kernel cannot be cancelled from the host: this process ends now "
                 f"(exit code {WATCHDOG_EXIT_CODE}).")
    return "\n".join(lines) + "\n"
