"""The forward watchdog: a call that does not finish within its bound ends the process with one clear message.

A MegaMoE kernel is persistent and waits on its peers' flags on the device: when a peer dies, skips a call or
stalls, the survivors' kernels spin forever and nothing on the host can cancel them. What the host can do is
notice, say what happened, and end the process so the job's supervisor sees a distinct exit code instead of
a silent hang (docs/watchdog.md).

What is watched: every MoELayer forward (eager, and moe_ep's own per-token-count graph replays: both are the
backend's forward call, so the validation agreement of collective_checks=True is inside it too), and whatever a
caller wraps in `moe_ep.watch(name)` (a caller-captured CUDA graph's replay: moe_ep cannot see those).

One concern a module, imported in this order (no module imports one below it):
  bound     the bound on a call (timeout_s, $MOE_EP_TIMEOUT_S, the default) and the shared timings
  verdict   classifying the peers, the one message, the end of the process (pure but for emit / end)
  events    the CUDA event recorder of the hot path (cuEventRecord through ctypes, or torch's events)
  store     the heartbeats in the process group's store: connect, publish, read (bounded)
  sequence  each group's sequence of collective calls (the hot path's part) and its digest
  divergence  where ranks' sequences part, who left the others, the message; the in-band check
  alarm     the ranks' sequences through the store: published, compared, the alarm and its report
  ring      the process-wide ring of calls in flight and their confirmation
  monitor   the monitor and heartbeat threads, the deadlines, the trip
  watches   Watch (begin / end: the hot path), watch(), layer_identity(), layer_watch()

Ranks out of step: every collective call of a group (a layer's forward, timer or not; a collective watch's call) is
logged as
(layer, its call number) at the group's collective call number; the heartbeats publish digests of the logs and
the monitor compares them with a peer's, so a rank that skips a call, makes one more or calls another layer is
named with the first call where the ranks part (exit 86). A backend whose exchange can carry the fingerprint
(the torch reference) raises RankDivergenceError in that very call instead.
"""

from moe_ep.core.watchdog.bound import (DEFAULT_BASE_S, DEFAULT_FACTOR, FIRST_CALL_S, HEARTBEAT_S, POLL_S,
                                        TIMEOUT_ENV, WATCHDOG_EXIT_CODE, Bound, parse_timeout)
from moe_ep.core.watchdog.verdict import PeerState, classify_peers, format_message
from moe_ep.core.watchdog.watches import Watch, keep_sequences, layer_identity, layer_watch, watch

__all__ = ["WATCHDOG_EXIT_CODE", "TIMEOUT_ENV", "DEFAULT_BASE_S", "DEFAULT_FACTOR", "FIRST_CALL_S", "POLL_S",
           "HEARTBEAT_S", "Bound", "parse_timeout", "Watch", "watch", "layer_identity", "layer_watch",
           "keep_sequences", "PeerState",
           "classify_peers", "format_message"]
