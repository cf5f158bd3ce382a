"""What the watchdog publishes and reads: every process's heartbeat in the default process group's store.

The key is `moe_ep/watchdog/rank<global rank>`, on a store connection of the watchdog's own (timeout
STORE_TIMEOUT_S), so a store that hangs cannot hang the caller's own store calls. Every read or write here can
fail or hang when the store's host is gone: the callers bound them (bounded()).
"""

from __future__ import annotations

import datetime
import json
import socket
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

from moe_ep.core.watchdog.bound import HEARTBEAT_S, STORE_TIMEOUT_S

__all__ = ["PREFIX", "LINGER_S", "global_rank", "heartbeat_key", "store_address", "connect", "bounded", "read_once",
           "read_peers", "store_unreachable", "linger", "gone"]

PREFIX = "moe_ep/watchdog/"
LINGER_S = 3.0


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def global_rank() -> int:
    try:
        return dist.get_rank() if _initialized() else 0
    except Exception:  # noqa: BLE001
        return 0


def heartbeat_key(rank: int) -> str:
    return f"rank{rank}"


def store_address() -> Optional[Tuple[str, int]]:
    if not _initialized():
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    s = _get_default_store()
    while hasattr(s, "underlying_store"):
        s = s.underlying_store
    if isinstance(s, dist.TCPStore):
        return s.host, s.port
    return None


def _accepts(addr: Tuple[str, int], timeout_s: float = 1.0) -> bool:
    """Whether the store's host serves connections (a plain socket: c10d's own client retries a refused connection
    for its whole timeout and logs each try with a C++ stack). A live store waits for its client to speak first; a
    dying one's socket may still accept, then closes it at once."""
    try:
        with socket.create_connection(addr, timeout=timeout_s) as s:
            s.settimeout(0.05)
            try:
                return s.recv(1) != b""
            except socket.timeout:
                return True
    except OSError:
        return False


def connect():
    """A store client of the watchdog's own (its own connection and timeout) on the default group's store, or
    the default store itself when it is not a TCPStore; None without a process group. A store whose host refuses
    connections (it is gone) is a ConnectionRefusedError at once."""
    if not _initialized():
        return None
    addr = store_address()
    if addr is not None:
        if not _accepts(addr):
            raise ConnectionRefusedError(f"nothing accepts connections at {addr[0]}:{addr[1]}")
        client = dist.TCPStore(addr[0], addr[1], is_master=False, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
        return dist.PrefixStore(PREFIX, client)
    from torch.distributed.distributed_c10d import _get_default_store

    return dist.PrefixStore(PREFIX, _get_default_store())


def bounded(fn, timeout_s: float):
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


def read_once(store, ranks: Sequence[int]) -> Dict[int, Optional[dict]]:
    out = {}
    for r in ranks:
        key = heartbeat_key(r)
        if not store.check([key]):
            out[r] = None
            continue
        out[r] = json.loads(store.get(key).decode())
    return out


def read_peers(ranks: Sequence[int], store=None, gap_s: Optional[float] = None, connect_: bool = True,
               why: str = "it did not answer"):
    """Every group member's heartbeat but this process's (ranks: the group's global ranks), read twice gap_s apart
    (a beat that did not advance has stopped). Returns ({global rank: (first, second)}, reachable, note):
    reachable is False when the store could not be read at all; note says why, or what else went wrong."""
    me = global_rank()
    ranks = [r for r in ranks if r != me]
    if not ranks:
        return {}, True, None
    if not _initialized():
        return {r: (None, None) for r in ranks}, False, "no process group: the peers cannot be read"
    gap_s = 2.5 * HEARTBEAT_S if gap_s is None else gap_s
    budget = STORE_TIMEOUT_S + 1.0
    if store is None and connect_:
        store, why = bounded(connect, budget)
    if store is None:
        return {r: (None, None) for r in ranks}, False, store_unreachable(why)
    first, why = bounded(lambda: read_once(store, ranks), budget)
    if first is None:
        return {r: (None, None) for r in ranks}, False, store_unreachable(why)
    time.sleep(gap_s)
    second, why = bounded(lambda: read_once(store, ranks), budget)
    if second is None:
        return {r: (first.get(r), None) for r in ranks}, False, store_unreachable(why)
    return {r: (first.get(r), second.get(r)) for r in ranks}, True, None


def store_unreachable(why: Optional[str]) -> str:
    addr = None
    try:
        addr = store_address()
    except Exception:  # noqa: BLE001
        pass
    where = f" at {addr[0]}:{addr[1]}" if addr else ""
    return (f"the process group's store{where} cannot be reached ({why}): the process hosting it (global rank 0 "
            "when init_process_group created it) is gone or hung")


def linger(store, ranks: Sequence[int]) -> None:
    """The store's host, tripped: wait (LINGER_S at most) until no peer is between "reading" and "ending" (a peer
    gets HEARTBEAT_S + a little to show that it tripped too), so peers tripping now can still read the store."""
    t_end = time.monotonic() + LINGER_S
    t_min = time.monotonic() + HEARTBEAT_S + 0.2
    while ranks and time.monotonic() < t_end:
        beats, _ = bounded(lambda: read_once(store, ranks), 1.0)
        reading = [r for r, hb in (beats or {}).items()
                   if hb and (hb.get("tripped") or {}).get("stage") == "reading"]
        if not reading and time.monotonic() >= t_min:
            return
        time.sleep(0.1)


def gone(ranks: Sequence[int]) -> Tuple[List[int], Optional[str]]:
    """Which of these global ranks (this process's excepted) are gone, from their heartbeats read twice: those
    whose beat stopped, and global rank 0 when the store it hosts cannot be reached. Nothing is named for a rank
    that never published one (its watchdog is off). (gone, note on the store)"""
    peers, reachable, note = read_peers(ranks)
    out = []
    for g, (first, second) in sorted(peers.items()):
        if second is None:
            if not reachable and g == 0:
                out.append(g)
        elif first is not None and int(second.get("beat", 0)) <= int(first.get("beat", 0)):
            out.append(g)
    return out, note
