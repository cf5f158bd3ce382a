"""The monitor: the process-wide ring with its two daemon threads, started with the first watch.

monitor (every POLL_S): confirms finished calls (event queries) and compares the oldest unfinished call's age
with its bound. It runs in CUDA's "relaxed" capture mode, so its queries cannot invalidate a capture elsewhere.
heartbeat (every HEARTBEAT_S): publishes this process's progress to the store (store.py), on a connection of its
own; it also checks the deadlines itself when the monitor thread stops polling (stuck in a driver call).

When a call passes its bound, trip() reads every peer's heartbeat twice, classifies the peers, writes ONE
message and ends the process (verdict.py).

After each beat the heartbeat thread also compares the ranks' sequences of collective calls (alarm.py): ranks out
of step end the process the same way, with one message of their own; a trip checks them too.
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

from moe_ep.core.watchdog import alarm, events, sequence, store, verdict
from moe_ep.core.watchdog.bound import HEARTBEAT_S, POLL_S, STORE_TIMEOUT_S
from moe_ep.core.watchdog.ring import DEVICE, Ring, _monotonic

__all__ = ["Monitor", "get"]


class Monitor(Ring):
    """Process-wide: the ring of watched calls, the monitor thread and the heartbeat thread."""

    def __init__(self, threads: bool = True):
        super().__init__()
        self.tripped = False
        self.tripped_info: Optional[dict] = None  # published in the heartbeat: {"name", "call", "stage"}
        self.last_poll = _monotonic()
        self.beat = 0
        self.store_error: Optional[str] = None
        self.store_lost: Optional[str] = None  # the heartbeat gave the store up for good (its host is gone)
        self.threads_started = False
        self.stop = threading.Event()
        self.threads: List[threading.Thread] = []
        self.with_threads = threads  # False: a test drives confirm() / check_deadlines() itself
        self.compare_sequences = alarm.enabled()
        self.answered: set = set()  # groups whose alarm this process answered after raising in the exchange
        # Checks a backend adds (the kernels' call guard): each returns None, or (the group's log or None, the
        # message) for ranks found out of step where no forward could raise it (a caller's graph replays).
        self.probes: List[object] = []

    def add_probe(self, probe) -> None:
        with self.lock:
            self.probes.append(probe)
        self.ensure_threads()

    def check_probes(self) -> None:
        for probe in list(self.probes):
            found = probe()
            if found is None:
                continue
            lg, text = found
            with self.lock:
                if self.tripped:
                    return
                self.tripped = True
            if lg is not None:
                lg.halting = True  # nothing of the group runs on this rank from here on
            verdict.emit(text.rstrip("\n") + "\n  Ranks out of step cannot be put back in step from the host: this "
                         "process ends now (exit code 86).\n")
            verdict.end()

    def add(self, w) -> None:
        with self.lock:
            self.watches.append(w)
        self.ensure_threads()

    def ensure_threads(self) -> None:
        """Start both threads (once): with the first watch, or the first layer whose calls are logged."""
        with self.lock:
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
            try:
                self.check_probes()
            except Exception as e:  # noqa: BLE001
                report("monitor (probes)", e)
            self.last_poll = _monotonic()
            self.stop.wait(POLL_S)

    def _heartbeat_loop(self) -> None:
        conn, failures = None, 0
        while not self.stop.is_set():
            # Beats while a watch or a logged layer is open and the process group lives (after
            # destroy_process_group, or once every layer is closed, a peer may already be gone with the store).
            if failures < 3 and not self.store_lost and (self.watches or any(lg.live for lg in sequence.logs())) \
                    and dist.is_available() and dist.is_initialized():
                try:
                    if conn is None:
                        conn = store.connect()
                    if conn is not None:
                        conn.set(store.heartbeat_key(store.global_rank()), self.heartbeat())
                        failures = 0
                        if self.compare_sequences:
                            alarm.watch_sequences(self, conn)
                except Exception as e:  # noqa: BLE001 - the store went away: peers will see this rank stop
                    # c10d logs every failed store call with a stack: after a broken connection, stop for good.
                    self.store_error = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
                    failures = 3 if isinstance(e, getattr(dist, "DistNetworkError", ())) else failures + 1
                    if failures >= 3:
                        self.store_lost = self.store_error
            # The monitor thread is stuck (e.g. in a driver call): decide from what it last confirmed.
            if _monotonic() - self.last_poll > max(2.0, 10 * POLL_S):
                try:
                    self.check_deadlines(_monotonic(), note="the monitor thread itself stopped polling")
                except Exception as e:  # noqa: BLE001
                    verdict.warn(f"heartbeat check error {type(e).__name__}: {e}")
            self.stop.wait(HEARTBEAT_S)

    def heartbeat(self) -> str:
        self.beat += 1
        seq = alarm.checkpoints() if self.compare_sequences else {}
        return json.dumps({"beat": self.beat, "t": time.time(), "pid": os.getpid(), "host": socket.gethostname(),
                           "calls": self.progress(), "tripped": self.tripped_info, "seq": seq})

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
            self.publish(conn)
        try:
            peers, reachable, store_note = store.read_peers(owner.ranks, conn, connect_=False, why=why or "")
            states = verdict.classify_peers(owner.name, call, peers, owner.ranks, owner.group_rank, reachable)
        except Exception as e:  # noqa: BLE001 - still say what is known, and still end
            peers, states, store_note = {}, [], f"the peers could not be read ({type(e).__name__}: {e})"
        lg, raised = alarm.out_of_step(peers) if self.compare_sequences else (None, None)
        if raised is not None and conn is not None:
            # The call waits because the ranks are out of step: say that, with the first call where they part.
            where = "returned on the host; the device has not finished it" if st == DEVICE else "still inside the " \
                "forward on the host"
            alarm.report(self, conn, lg, raised, held=True,
                          note=f"{owner.name!r} call {call} has not finished after {waited:.1f} s ({where})")
        text = verdict.format_message(name=owner.name, call=call, rank=owner.group_rank, world=len(owner.ranks),
                                      waited_s=waited, on_device=(st == DEVICE),
                                      bound=owner.bound.describe(call, owner.slowest), peers=states,
                                      store_note=store_note, note=note, global_rank=store.global_rank(),
                                      ranks=owner.ranks)
        verdict.emit(text)
        self.tripped_info = dict(self.tripped_info, stage="ending")
        if conn is not None:
            self.publish(conn)
            if store.global_rank() == 0:
                alive = [p.global_rank for p in states if p.state not in verdict.STOPPED_STATES]
                store.linger(conn, alive)
        verdict.end()

    def publish(self, conn) -> None:
        if conn is not None:
            store.bounded(lambda: conn.set(store.heartbeat_key(store.global_rank()), self.heartbeat()), 1.0)


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
