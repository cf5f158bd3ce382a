"""What a tripped watchdog says, and how it ends the process.

classify_peers and format_message are pure (unit-tested with fake heartbeats); emit() writes the one message,
end() ends the process with WATCHDOG_EXIT_CODE (a persistent kernel cannot be cancelled from the host).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from moe_ep.core.watchdog.bound import WATCHDOG_EXIT_CODE

__all__ = ["PeerState", "STOPPED_STATES", "classify_peers", "format_message", "emit", "warn", "end"]


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


def warn(text: str) -> None:
    try:
        sys.stderr.write(f"moe_ep watchdog [pid {os.getpid()}]: {text}\n")
    except Exception:  # noqa: BLE001
        pass


def emit(text: str) -> None:
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


EXIT = os._exit  # tests replace it


def end() -> None:
    """The process ends here: no atexit handler, no finaliser (a thread may still wait inside the kernel)."""
    EXIT(WATCHDOG_EXIT_CODE)
