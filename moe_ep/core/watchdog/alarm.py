"""Ranks out of step, through the store: what the heartbeat publishes of each group's calls, the comparison with the
next group member after each beat, the group's alarm, and the report that ends the process.

After each beat the heartbeat thread compares this process's digest checkpoints (sequence.py) with the next group
member's (a ring: two store reads a beat whatever the group's size) and watches the group's alarm key. A rank that
sees the sequences part raises the alarm (the first one stands, so every rank reports the same window); every rank
that sees it refuses the group's next calls (they wait for the end), publishes its calls around the place, reads
everyone's, writes ONE message naming the first diverging call, the ranks out of step and the layers
(divergence.py), and ends the process (exit 86). The monitor (monitor.py) lends its trip state: one message per
process, whichever of a stalled call and a divergence is seen first.
"""

from __future__ import annotations

import json
import time
from typing import Dict, Optional, Tuple

from moe_ep.core.watchdog import divergence, sequence, store, verdict
from moe_ep.errors import RankDivergenceError

__all__ = ["SEQUENCE_ENV", "DETAILS_S", "enabled", "checkpoints", "watch_sequences", "out_of_step", "report"]

DETAILS_S = 3.0     # how long a rank that reports a divergence waits for every member's calls
DETAIL_CAP = 4096   # calls published before the first checkpoint that differs, at most
DETAIL_AFTER = 16   # ... and after it (to tell a skipped call from an extra one)


SEQUENCE_ENV = sequence.SEQUENCE_ENV  # "0": nothing is logged, so the heartbeats carry no digests
enabled = sequence.enabled


def _alarm_key(lg) -> str:
    return f"seq/{lg.key}/alarm"


def _calls_key(lg, global_rank: int) -> str:
    return f"seq/{lg.key}/rank{global_rank}"


def checkpoints() -> Dict[str, dict]:
    """The heartbeat's part: each group's calls made, digest checkpoints, and whether calls were lost."""
    out = {}
    for lg in sequence.logs():
        if len(lg.ranks) > 1 and lg.open > 0:
            out[lg.key] = {"n": lg.seq, "cp": sorted(lg.digest().items()), "lost": lg.lost}
    return out


def _theirs(heartbeat: Optional[dict], lg) -> Optional[Dict[int, str]]:
    mine = ((heartbeat or {}).get("seq") or {}).get(lg.key)
    if not mine or mine.get("lost"):
        return None
    return {int(s): h for s, h in mine["cp"]}


def watch_sequences(mon, conn) -> None:
    """After a beat: answer an alarm raised for one of this process's groups, or compare this process's digests
    with the next group member's and raise the alarm when they part."""
    me = store.global_rank()
    beats: dict = {}
    for lg in sequence.logs():
        if not lg.live:
            continue
        raw = conn.get(_alarm_key(lg)) if conn.check([_alarm_key(lg)]) else None
        if raw is not None:
            alarm = json.loads(raw.decode())
            if lg.diverged is None or lg.halting:
                report(mon, conn, lg, alarm)
            elif lg.key not in mon.answered:  # already raised in the exchange: still say what it did
                mon.answered.add(lg.key)
                _publish_calls(conn, lg, alarm)
            continue
        if lg.diverged is not None:
            continue
        peer = lg.ranks[(lg.group_rank + 1) % len(lg.ranks)]
        if peer == me:
            continue
        if peer not in beats:
            key = store.heartbeat_key(peer)
            beats[peer] = json.loads(conn.get(key).decode()) if conn.check([key]) else None
        theirs = _theirs(beats[peer], lg)
        found = None if theirs is None else divergence.compare(lg.digest(), theirs)
        if found is not None:
            report(mon, conn, lg, {"by": lg.group_rank, "peer": lg.ranks.index(peer), "s0": found[0],
                                   "s1": found[1], "t": time.time()})
            return


def out_of_step(peers: dict) -> Tuple[Optional[object], Optional[dict]]:
    """(log, alarm) for a group whose digests and a peer's part, from heartbeats just read (global rank ->
    (first, second)); (None, None) when none do. Every live group: a stalled caller's watch (a graph replay) may
    hold the calls of any."""
    for lg in sequence.logs():
        if not lg.live or lg.diverged is not None:
            continue
        mine = lg.digest()
        for r, g in enumerate(lg.ranks):
            theirs = _theirs((peers.get(g) or (None, None))[1], lg)
            found = None if r == lg.group_rank or theirs is None else divergence.compare(mine, theirs)
            if found is not None:
                return lg, {"by": lg.group_rank, "peer": r, "s0": found[0], "s1": found[1], "t": time.time()}
    return None, None


def report(mon, conn, lg, alarm: dict, note: str = "", held: bool = False) -> None:
    """Report a divergence of group lg and end the process: refuse the group's next calls (they wait for the
    end), make sure the alarm is raised, publish this rank's calls around it, read every member's, write the
    message, end. held: the caller (a trip) already holds the monitor's one message."""
    if not held:
        with mon.lock:
            if mon.tripped:
                return
            mon.tripped = True
    seen_at = lg.seq
    lg.diverged = RankDivergenceError(
        None, f"the ranks of the group of global ranks {list(lg.ranks)} fell out of step (at or before group "
              f"call {alarm.get('s1')}): the watchdog is ending this process (exit code 86)", call=alarm.get("s1"))
    lg.halting = True  # from here on nothing of this group runs on this rank
    mon.tripped_info = {"name": f"group {lg.key}", "call": alarm.get("s1"), "stage": "reading"}
    mon.publish(conn)
    try:
        text, missing = _message(conn, lg, alarm, seen_at, note)
    except Exception as e:  # noqa: BLE001 - say what is known, and still end
        text = (f"moe_ep watchdog: rank {lg.group_rank} of {len(lg.ranks)}: the ranks of the group of global ranks "
                f"{list(lg.ranks)} fell out of step (at or before group call {alarm.get('s1')}, seen by rank "
                f"{alarm.get('by')}); the calls around it could not be gathered ({type(e).__name__}: {e}).\n"
                "  Ranks out of step cannot be put back in step from the host: this process ends now (exit code "
                "86).\n")
        missing = []
    verdict.emit(text)
    mon.tripped_info = dict(mon.tripped_info, stage="ending")
    mon.publish(conn)
    if store.global_rank() == 0:
        store.linger(conn, [g for r, g in enumerate(lg.ranks) if r != lg.group_rank and r not in missing])
    verdict.end()


def _message(conn, lg, alarm: dict, seen_at: int, note: str):
    """(the message, the members that did not answer): the first alarm's window, every member's calls in it."""
    won, _ = store.bounded(lambda: conn.compare_set(_alarm_key(lg), "", json.dumps(alarm)), 1.0)
    if won is not None:
        alarm = json.loads(won.decode())
    s0, s1 = int(alarm["s0"]), int(alarm["s1"])
    entries, missing = {lg.group_rank: _publish_calls(conn, lg, alarm)}, []
    deadline = time.monotonic() + DETAILS_S
    names = dict(lg.names)
    for r, g in enumerate(lg.ranks):
        if r == lg.group_rank:
            continue
        key = _calls_key(lg, g)
        got = None
        while got is None and time.monotonic() < deadline:
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
    text = divergence.format_message(finding, names=names, rank=lg.group_rank, world=len(lg.ranks), ranks=lg.ranks,
                                     noticed=noticed, after=after, s1=s1, missing=missing, note=note)
    return text, missing


def _publish_calls(conn, lg, alarm: dict):
    s0, s1 = int(alarm["s0"]), int(alarm["s1"])
    first = max(s0 + 1 if s0 > 0 else 1, s1 - DETAIL_CAP)
    mine = lg.entries(first, s1 + DETAIL_AFTER)
    body = json.dumps({"first": mine[0], "codes": mine[1], "calls": mine[2], "seq": lg.seq,
                       "names": {str(c): n for c, n in lg.names.items()}})
    store.bounded(lambda: conn.set(_calls_key(lg, store.global_rank()), body), 1.0)
    return mine
