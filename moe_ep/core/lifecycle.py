"""Work for the end of a normal run: what moe_ep set up (its process group, the NVSHMEM heap's allocations) is
torn down explicitly, so a run that ends well ends quietly (no NVSHMEM leak report, no torch warning about an
undestroyed group).

A run that ends on an uncaught exception skips it: tearing down a process group or freeing NVSHMEM memory waits
for the peers, and after a failure a peer may never come (the launcher or the watchdog ends it). torch and NVSHMEM
then say what was left, which is the truth about such an end.
"""

from __future__ import annotations

import atexit
import sys
import threading

__all__ = ["at_normal_exit", "ending_on_exception", "track_exceptions"]

_lock = threading.Lock()
_installed = False
_crashed = False


def track_exceptions() -> None:
    """From now on, remember an uncaught exception (chains sys.excepthook once; idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        previous = sys.excepthook

        def hook(exc_type, exc, tb):
            global _crashed
            _crashed = True
            previous(exc_type, exc, tb)

        sys.excepthook = hook
        _installed = True


def ending_on_exception() -> bool:
    """Whether the interpreter is on its way out because of an uncaught exception (known once track_exceptions()
    or at_normal_exit() ran)."""
    return _crashed


def at_normal_exit(fn, *args) -> None:
    """Run fn(*args) at interpreter exit unless the exit follows an uncaught exception. Hooks run last-registered
    first (atexit's order): register teardown right after the set-up it undoes, so what was built on top of it
    (the NVSHMEM heap on the process group) goes first."""
    track_exceptions()

    def run():
        if not _crashed:
            fn(*args)

    atexit.register(run)
