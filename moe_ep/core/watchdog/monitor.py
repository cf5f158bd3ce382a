"""The monitor: the process-wide ring with its two daemon threads, started with the first watch.

monitor (every POLL_S): confirms finished calls (event queries) and compares the oldest unfinished call's age
with its bound. It runs in CUDA's "relaxed" capture mode, so its queries cannot invalidate a capture elsewhere.
heartbeat (every HEARTBEAT_S): publishes this process's progress to the store (store.py), on a connection of its
own; it also checks the deadlines itself when the monitor thread stops polling (stuck in a driver call).

When a call passes its bound, trip() reads every peer's heartbeat twice, classifies the peers, writes ONE
message and ends the process (verdict.py).

Ranks out of step (sequence.py, divergence.py): every heartbeat carries the digest checkpoints of each group's
sequence of collective calls; after publishing, the heartbeat thread compares its own with the next group
member's (a ring: two store reads a beat, whatever the group's size) and watches the group's alarm key. A rank
that sees the sequences part raises the alarm; every rank that sees the alarm refuses the group's next calls,
publishes its calls around the place, reads everyone's, writes ONE message naming the first diverging call, the
ranks out of step and the layers, and ends the process (exit 86).
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import threading
import time
from typing import List, Optional

import torch
import torch.distributed as dist

from moe_ep.core.errors import RankDivergenceError
from moe_ep.core.watchdog import divergence, events, sequence, store, verdict
from moe_ep.core.watchdog.bound import HEARTBEAT_S, POLL_S, STORE_TIMEOUT_S
from moe_ep.core.watchdog.ring import DEVICE, Ring, _monotonic

__all__ = ["Monitor", "get", "DETAILS_S", "DETAIL_CAP"]

DETAILS_S = 3.0     # how long a rank that reports a divergence waits for every member's calls
DETAIL_CAP = 4096   # calls published before the first checkpoint that differs, at most
DETAIL_AFTER = 16   # ... and after it (to tell a skipped call from an extra one)
SEQUENCE_ENV = "MOE_EP_SEQUENCE_CHECK"  # "0": the heartbeats carry no digests and nothing compares them


class Monitor(Ring):
    """Process-wide: the ring of watched calls, the monitor thread and the heartbeat thread."""

    def __init__(self, threads: bool = True):
        super().__init__()
        self.tripped = False
        self.tripped_info: Optional[dict] = None  # published in the heartbeat: {"name", "call", "stage"}
        self.last_poll = _monotonic()
        self.beat = 0
        self.store_error: Optional[str] = None
        self.threads_started = False
        self.stop = threading.Event()
        self.threads: List[threading.Thread] = []
        self.with_threads = threads  # False: a test drives confirm() / check_deadlines() itself
        self.compare_sequences = os.environ.get(SEQUENCE_ENV, "1").strip() != "0"
        self.answered: set = set()

    def add(self, w) -> None:
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

    def check_deadlines(self, now: float, note: str = "") -> None:
        for owner, call, t0, st in self.oldest_unfinished():
            limit = owner.limit(call)
            if now - t0 > limit:
                self.trip(owner, call, t0, st, now, note)
                return

    # the threads ---------------------------------------------------------------------------------------------
    def _monitor_loop(self) -> None:
        events.relax_capture_mode()
        device_set = False
        reported = set()

        def report(where, e):  # once per kind of error: the watchdog must never flood a log
            key = (where, type(e).__name__, str(e)[:80])
            if key not in reported:
                reported.add(key)
                verdict.warn(f"{where} error {type(e).__name__}: {e}")

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
        conn, failures = None, 0
        while not self.stop.is_set():
            # Beats while a watch is open and the process group lives (after destroy_process_group, or once
            # every layer is closed, a peer may already be gone with the store: nothing to say any more).
            if failures < 3 and self.watches and dist.is_available() and dist.is_initialized():
                try:
                    if conn is None:
                        conn = store.connect()
                    if conn is not None:
                        conn.set(store.heartbeat_key(store.global_rank()), self.heartbeat())
                        failures = 0
                        self.watch_sequences(conn)
                except Exception as e:  # noqa: BLE001 - the store went away: peers will see this rank stop
                    # c10d logs every failed store call with a stack: after a broken connection, stop for good.
                    self.store_error = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
                    failures = 3 if isinstance(e, getattr(dist, "DistNetworkError", ())) else failures + 1
            # The monitor thread is stuck (e.g. in a driver call): decide from what it last confirmed.
            if _monotonic() - self.last_poll > max(2.0, 10 * POLL_S):
                try:
                    self.check_deadlines(_monotonic(), note="the monitor thread itself stopped polling")
                except Exception as e:  # noqa: BLE001
                    verdict.warn(f"heartbeat check error {type(e).__name__}: {e}")
            self.stop.wait(HEARTBEAT_S)

    def heartbeat(self) -> str:
        self.beat += 1
        seq = {}
        if self.compare_sequences:
            for lg in sequence.logs():
                if len(lg.ranks) > 1 and lg.open > 0:
                    seq[lg.key] = {"n": lg.seq, "cp": sorted(lg.digest().items()), "lost": lg.lost}
        return json.dumps({"beat": self.beat, "t": time.time(), "pid": os.getpid(), "host": socket.gethostname(),
                           "calls": self.progress(), "tripped": self.tripped_info, "seq": seq})

    # ranks out of step ---------------------------------------------------------------------------------------
    def watch_sequences(self, conn) -> None:
        """After a beat: answer an alarm raised for one of this process's groups, or compare this process's
        digests with the next group member's and raise the alarm when they part."""
        if not self.compare_sequences:
            return
        me = store.global_rank()
        beats: dict = {}
        for lg in sequence.logs():
            if not lg.live:
                continue
            raw = conn.get(_alarm_key(lg)) if conn.check([_alarm_key(lg)]) else None
            if raw is not None:
                alarm = json.loads(raw.decode())
                if lg.diverged is None or lg.halting:
                    self.diverged(conn, lg, alarm)
                elif lg.key not in self.answered:  # already raised in the exchange: still say what it did
                    self.answered.add(lg.key)
                    self._publish_calls(conn, lg, alarm)
                continue
            if lg.diverged is not None:
                continue
            peer = lg.ranks[(lg.group_rank + 1) % len(lg.ranks)]
            if peer == me:
                continue
            if peer not in beats:
                key = store.heartbeat_key(peer)
                beats[peer] = json.loads(conn.get(key).decode()) if conn.check([key]) else None
            theirs = ((beats[peer] or {}).get("seq") or {}).get(lg.key)
            if not theirs or theirs.get("lost"):
                continue
            found = divergence.compare(lg.digest(), {int(s): h for s, h in theirs["cp"]})
            if found is not None:
                self.diverged(conn, lg, {"by": lg.group_rank, "peer": lg.ranks.index(peer), "s0": found[0],
                                         "s1": found[1], "t": time.time()})
                return

    def diverged(self, conn, lg, alarm: dict, note: str = "", held: bool = False) -> None:
        """Report a divergence of group lg and end the process: refuse the group's next calls (they wait for the
        end), make sure the alarm is raised (the first one stands, so every rank reports the same window),
        publish this rank's calls around it, read every member's, write the message, end."""
        if not held:
            with self.lock:
                if self.tripped:
                    return
                self.tripped = True
        seen_at = lg.seq
        lg.diverged = RankDivergenceError(
            None, f"the ranks of the group of global ranks {list(lg.ranks)} fell out of step (at or before group "
                  f"call {alarm.get('s1')}): the watchdog is ending this process (exit code 86)", call=alarm.get("s1"))
        lg.halting = True  # from here on nothing of this group runs on this rank
        self.tripped_info = {"name": f"group {lg.key}", "call": alarm.get("s1"), "stage": "reading"}
        self._publish(conn)
        try:
            text, missing = self._divergence_message(conn, lg, alarm, seen_at, note)
        except Exception as e:  # noqa: BLE001 - say what is known, and still end
            text = (f"moe_ep watchdog: rank {lg.group_rank} of {len(lg.ranks)}: the ranks of the group of global ranks "
                    f"{list(lg.ranks)} fell out of step (at or before group call {alarm.get('s1')}, seen by rank "
                    f"{alarm.get('by')}); the calls around it could not be gathered ({type(e).__name__}: {e}).\n"
                    "  Ranks out of step cannot be put back in step from the host: this process ends now (exit code "
                    "86).\n")
            missing = []
        verdict.emit(text)
        self.tripped_info = dict(self.tripped_info, stage="ending")
        self._publish(conn)
        if store.global_rank() == 0:
            store.linger(conn, [g for r, g in enumerate(lg.ranks) if r != lg.group_rank and r not in missing])
        verdict.end()

    def _divergence_message(self, conn, lg, alarm: dict, seen_at: int, note: str):
        """(the message, the members that did not answer): the first alarm's window, every member's calls in it."""
        won, _ = store.bounded(lambda: conn.compare_set(_alarm_key(lg), "", json.dumps(alarm)), 1.0)
        if won is not None:
            alarm = json.loads(won.decode())
        s0, s1 = int(alarm["s0"]), int(alarm["s1"])
        mine = self._publish_calls(conn, lg, alarm)
        entries, missing = {lg.group_rank: mine}, []
        deadline = _monotonic() + DETAILS_S
        names = dict(lg.names)
        for r, g in enumerate(lg.ranks):
            if r == lg.group_rank:
                continue
            key = _calls_key(lg, g)
            got = None
            while got is None and _monotonic() < deadline:
                got, _ = store.bounded(lambda: conn.get(key) if conn.check([key]) else None, 1.0)
                if got is None:
                    time.sleep(0.1)
            if got is None:
                missing.append(r)
                continue
            d = json.loads(got.decode())
            entries[r] = (d["first"], d["codes"], d["calls"])
            names.update({int(c): n for c, n in d.get("names", {}).items() if int(c) not in names})
        finding = divergence.analyze(entries, s0, names)
        noticed = f"seen by rank {alarm.get('by')} comparing its calls with rank {alarm.get('peer')}'s"
        after = None if finding.call is None else max(0, seen_at - finding.call)
        text = divergence.format_message(finding, names=names, rank=lg.group_rank, world=len(lg.ranks),
                                         ranks=lg.ranks, noticed=noticed, after=after, s1=s1, missing=missing,
                                         note=note)
        return text, missing

    def _publish_calls(self, conn, lg, alarm: dict):
        s0, s1 = int(alarm["s0"]), int(alarm["s1"])
        first = s0 + 1 if s0 > 0 else max(1, s1 - DETAIL_CAP)
        first = max(first, s1 - DETAIL_CAP)
        mine = lg.entries(first, s1 + DETAIL_AFTER)
        body = json.dumps({"first": mine[0], "codes": mine[1], "calls": mine[2], "seq": lg.seq,
                           "names": {str(c): n for c, n in lg.names.items()}})
        store.bounded(lambda: conn.set(_calls_key(lg, store.global_rank()), body), 1.0)
        return mine

    # the end -------------------------------------------------------------------------------------------------
    def trip(self, owner, call: int, t0: float, st: int, now: float, note: str = "") -> None:
        """Read the peers, print the message, end the process. The peers are told through this process's
        heartbeat (stage "reading", then "ending"); the store's host (global rank 0) stays LINGER_S at most while
        a peer is still reading, so that ranks tripping together can all read the store before it goes."""
        with self.lock:
            if self.tripped:
                return
            self.tripped = True
        self.tripped_info = {"name": owner.name, "call": call, "stage": "reading"}
        waited = now - t0
        conn, why = None, "no process group"
        if len(owner.ranks) > 1 and dist.is_available() and dist.is_initialized():
            conn, why = store.bounded(store.connect, STORE_TIMEOUT_S + 1.0)
            self._publish(conn)
        try:
            peers, reachable, store_note = store.read_peers(owner.ranks, conn, connect_=False, why=why or "")
            states = verdict.classify_peers(owner.name, call, peers, owner.ranks, owner.group_rank, reachable)
        except Exception as e:  # noqa: BLE001 - still say what is known, and still end
            peers, states, store_note = {}, [], f"the peers could not be read ({type(e).__name__}: {e})"
        lg, alarm = self._out_of_step(peers)
        if alarm is not None and conn is not None:
            # The call waits because the ranks are out of step: say that, with the first call where they part.
            where = "returned on the host; the device has not finished it" if st == DEVICE else "still inside the " \
                "forward on the host"
            self.diverged(conn, lg, alarm, held=True,
                          note=f"{owner.name!r} call {call} has not finished after {waited:.1f} s ({where})")
        text = verdict.format_message(name=owner.name, call=call, rank=owner.group_rank, world=len(owner.ranks),
                                      waited_s=waited, on_device=(st == DEVICE),
                                      bound=owner.bound.describe(call, owner.slowest), peers=states,
                                      store_note=store_note, note=note, global_rank=store.global_rank(),
                                      ranks=owner.ranks)
        verdict.emit(text)
        self.tripped_info = dict(self.tripped_info, stage="ending")
        if conn is not None:
            self._publish(conn)
            if store.global_rank() == 0:
                alive = [p.global_rank for p in states if p.state not in verdict.STOPPED_STATES]
                store.linger(conn, alive)
        verdict.end()

    def _out_of_step(self, peers):
        """(log, alarm) for a group whose digests and a peer's (just read) part; (None, None) when none do. Every
        live group: a stalled caller's watch (a graph replay) may hold the calls of any."""
        if not self.compare_sequences:
            return None, None
        for lg in sequence.logs():
            if not lg.live or lg.diverged is not None:
                continue
            mine = lg.digest()
            for r, g in enumerate(lg.ranks):
                theirs = (((peers.get(g) or (None, None))[1] or {}).get("seq") or {}).get(lg.key)
                if r == lg.group_rank or not theirs or theirs.get("lost"):
                    continue
                found = divergence.compare(mine, {int(s): h for s, h in theirs["cp"]})
                if found is not None:
                    return lg, {"by": lg.group_rank, "peer": r, "s0": found[0], "s1": found[1], "t": time.time()}
        return None, None

    def _publish(self, conn) -> None:
        if conn is not None:
            store.bounded(lambda: conn.set(store.heartbeat_key(store.global_rank()), self.heartbeat()), 1.0)


def _alarm_key(lg) -> str:
    return f"seq/{lg.key}/alarm"


def _calls_key(lg, global_rank: int) -> str:
    return f"seq/{lg.key}/rank{global_rank}"


_M: Optional[Monitor] = None
_M_lock = threading.Lock()


def get() -> Monitor:
    """This process's monitor (made, and its threads started, with the first watch)."""
    global _M
    if _M is None:
        with _M_lock:
            if _M is None:
                _M = Monitor()
    return _M


def _forget_after_fork() -> None:
    """A forked child has none of the parent's threads: its first watch starts a monitor of its own."""
    global _M
    _M = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
