"""The ring of watched calls: one slot per call in flight, process-wide, and the confirmation of finished ones.

A watched call takes the slot of its sequence number g (g & MASK): its watch, call number, host start time and
state (on the host, then on the device with the event recorded after it). Watch.begin()/end() write the slots
(the hot path: no lock, no allocation); the monitor thread confirms finished calls with event queries and moves
done_upto. A slot is never taken again before its call is confirmed: begin() gives up watching (the call is still
counted) when RING calls are in flight, and the oldest unfinished call is never dropped.
"""

from __future__ import annotations

import threading
from time import monotonic as _monotonic
from typing import Dict, List, Optional, Tuple

from moe_ep.core.watchdog import events
from moe_ep.core.watchdog.verdict import warn

__all__ = ["RING", "MASK", "FREE", "HOST", "DEVICE", "Ring"]

RING = 4096           # calls in flight the monitor can follow (more than the device's launch queue holds)
MASK = RING - 1
FREE, HOST, DEVICE = 0, 1, 2  # slot states


class Ring:
    """The slots, the watches of this process and the confirmation of finished calls. The monitor (monitor.py)
    adds the threads; a Ring alone is driven by hand (tests, the cost diagnostic)."""

    def __init__(self):
        self.gen = [-1] * RING
        self.owner: List[Optional[object]] = [None] * RING  # the Watch that made the call
        self.call = [0] * RING
        self.t0 = [0.0] * RING
        self.state = [FREE] * RING
        self.ev: list = [None] * RING
        self.next_g = 0          # the next call's sequence number
        self.done_upto = -1      # every call with a sequence number <= this one has finished
        self.depth = 0
        self.last_stream = None
        self.stream_since = 0    # first sequence number recorded on last_stream
        self.last_device_g = -1
        self.events: Dict[int, list] = {}
        self.watches: List[object] = []
        self.lock = threading.Lock()

    # called by the main thread -------------------------------------------------------------------------------
    def cuda_events(self, dev: int) -> list:
        """The ring's events on device dev, created once (RING of them: creation stays off the hot path)."""
        cuda = events.cuda
        cuda.bind()
        evs = self.events.get(dev)
        if evs is None:
            try:
                evs = cuda.new_events(dev, RING)
            except RuntimeError as e:
                if cuda.kind != "driver" or self.events:
                    raise
                warn(f"{e}; following calls through torch's events instead")
                cuda.ready = False
                cuda.bind("torch")
                evs = cuda.new_events(dev, RING)
            self.events[dev] = evs
        return evs

    def add(self, w) -> None:
        with self.lock:
            self.watches.append(w)

    def remove(self, w) -> None:
        with self.lock:
            if w in self.watches:
                self.watches.remove(w)

    def make_room(self, g: int) -> bool:
        """RING calls in flight: confirm finished ones now (rare: the monitor runs every POLL_S). Not while this
        thread captures a graph: an event query would invalidate the capture (the call is then not watched)."""
        cuda = events.cuda
        if cuda.ready and cuda.capturing():
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
            state, gen = self.state, self.gen
            last = h - 1
            if state[last & MASK] == HOST:  # the call in progress (only ever the newest one)
                last -= 1
            if last < g0:
                return
            stop = last + 1  # first unfinished sequence number
            ldg = self.last_device_g
            query = events.cuda.query
            if ldg >= g0 and not (self.stream_since <= g0 and query(self.ev[ldg & MASK])):
                # the device lags (or two streams): find the first unfinished call
                devs = [g for g in range(g0, last + 1) if state[g & MASK] == DEVICE and gen[g & MASK] == g]
                if self.stream_since <= g0:  # one stream: finished-ness is monotonic in order
                    lo, hi = 0, len(devs)
                    while lo < hi:
                        mid = (lo + hi) // 2
                        if query(self.ev[devs[mid] & MASK]):
                            lo = mid + 1
                        else:
                            hi = mid
                else:
                    lo = 0
                    while lo < len(devs) and query(self.ev[devs[lo] & MASK]):
                        lo += 1
                if lo < len(devs):
                    stop = devs[lo]
            if stop > g0:
                i = g0 & MASK
                owner = self.owner[i]
                if owner is not None and self.state[i] == DEVICE:
                    d = now - self.t0[i]  # host start -> seen finished: an upper bound, to within POLL_S
                    if d > owner.slowest:
                        owner.slowest = d
                self.done_upto = stop - 1

    def oldest_unfinished(self) -> List[Tuple[object, int, float, int]]:
        """(watch, call, host start, state) of the oldest unfinished call and of the call on the host, if other."""
        out = []
        g0, h = self.done_upto + 1, self.next_g
        for g in ((g0, h - 1) if h - 1 > g0 else (g0,)):
            if g >= h:
                continue
            i = g & MASK
            owner, call, t0, st = self.owner[i], self.call[i], self.t0[i], self.state[i]
            if self.gen[i] == g and owner is not None and st != FREE:
                out.append((owner, call, t0, st))
        return out

    def progress(self) -> Dict[str, List[int]]:
        """name -> [started, returned on the host, finished] for every watch of this process."""
        pending: Dict[int, int] = {}
        g0, h = self.done_upto + 1, self.next_g
        for g in range(g0, h):
            i = g & MASK
            o = self.owner[i]
            if o is not None and self.gen[i] == g and self.state[i] != FREE and id(o) not in pending:
                pending[id(o)] = self.call[i]
        with self.lock:
            watches = list(self.watches)
        out = {}
        for w in watches:
            done = pending[id(w)] - 1 if id(w) in pending else w.returned
            out[w.name] = [w.started, w.returned, min(done, w.returned)]
        return out
