"""The watchdog's bound on one call, and the timings every part of the watchdog shares.

The bound, per watch: timeout_s (MoELayer(timeout_s=...), moe_ep.watch(timeout_s=...)) > $MOE_EP_TIMEOUT_S >
the default: DEFAULT_BASE_S + DEFAULT_FACTOR x the slowest call this watch has finished so far (measured from
the host's start to the device's finish, to within POLL_S), and at least FIRST_CALL_S for a watch's first call.
0 turns the watchdog off. An explicit bound is used as given.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

from moe_ep.errors import WatchdogConfigError

__all__ = ["WATCHDOG_EXIT_CODE", "TIMEOUT_ENV", "DEFAULT_BASE_S", "DEFAULT_FACTOR", "FIRST_CALL_S", "POLL_S",
           "HEARTBEAT_S", "STORE_TIMEOUT_S", "Bound", "parse_timeout"]

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
