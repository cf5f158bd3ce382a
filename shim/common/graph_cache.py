"""A layer's internal CUDA graphs: what lets an eager forward cost a replay instead of a CuTe launch.

The CuTe executor costs hundreds of microseconds of host time per eager launch, a replay a few (docs/shim.md). A
caller that passes the same buffers again (an engine's static buffers, or a loop whose tensors the allocator hands
back at the same addresses) gets a graph that reads and writes them in place, the routing copies inside it: one
replay is the whole call. Any other call copies its inputs into the workspace and replays the graph of its token
count. The frontend's forward (shim/common/frontend.py) decides which; this class keeps the graphs and captures
them.

Capture rules (every MegaMoE launch is a cross-rank collective):
  * no warm-up launch before a capture: ranks meet a new token count or new buffers at different calls, so a
    launch on one rank alone would strand the others. The module was loaded by the frontend's all-masked launch
    at compile time; a capture records without running, and the caller's replay is the call's one launch;
  * buffers seen once are not captured: ones that never come back would each cost a capture (the call copies
    and replays by token count instead); the second sight captures;
  * a capture is dear (torch's capture synchronizes the device and empties the allocator's cache first: one costs
    the queued device work plus hundreds of microseconds), so captures are rationed: a graph captured and not
    replayed by a later call is "unproven"; with `max_unproven` of them in the last `churn_window` slow-path calls,
    no new graph is captured (buffers go by token count, a token count launches eagerly: one launch either way)
    until one proves itself or ages out. Keys that churn thus cost at most max_unproven captures per window;
  * full (`max_graphs`), the least recently used graph goes, one at a time: a new key never drops the hot ones;
  * every layer's graphs share one memory pool (the workspace's): they replay one at a time on one stream.
`captures`, `declined` and `evictions` count what happened (tools/diag/defaults_cost.py prints captures).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Dict, Hashable, Optional

import torch

__all__ = ["GraphCache", "buffers_key"]


def buffers_key(t: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                out: Optional[torch.Tensor]) -> tuple:
    """The key of a graph that reads the caller's buffers in place (their dtypes too: the graph holds the
    conversions of an fp16 / fp32 hidden or routing-weight copy) and writes `out` in place, or, with out None, the
    workspace's output buffer (the call then hands back a fresh copy: a fresh tensor's address says nothing)."""
    return (t, x.data_ptr(), x.dtype, topk_idx.data_ptr(), topk_idx.dtype, topk_weights.data_ptr(), topk_weights.dtype,
            None if out is None else out.data_ptr())


class GraphCache:
    """Graphs by key: a token count (replays over the workspace's inputs) or a buffers_key (in place).
    `pool()` gives the memory pool graphs are captured into (the shared workspace's, asked at each capture)."""

    max_graphs = 64
    max_unproven = 8
    churn_window = 256

    def __init__(self, pool: Callable[[], Any]):
        self._pool = pool
        self._graphs: "OrderedDict[Hashable, Any]" = OrderedDict()
        self._seen: "OrderedDict[Hashable, None]" = OrderedDict()
        self._unproven: Dict[Hashable, int] = {}  # captured, not replayed by a later call since: key -> tick
        self._tick = 0  # slow-path calls (a lookup that missed)
        self.captures = self.declined = self.evictions = 0

    def __len__(self) -> int:
        return len(self._graphs)

    def items(self):
        return self._graphs.items()

    def get(self, key: Hashable):
        """The graph of `key` or None (the steady state's lookup: the frontend's forward calls it first)."""
        graph = self._graphs.get(key)
        if graph is not None:
            self._graphs.move_to_end(key)
            if self._unproven:
                self._unproven.pop(key, None)
        return graph

    def clear(self, *, forget_seen: bool = True) -> None:
        """Drop every graph (they hold addresses or weights that changed); `forget_seen` also forgets which buffers
        were seen once."""
        self._graphs.clear()
        self._unproven.clear()
        if forget_seen:
            self._seen.clear()

    def in_place(self, key: Hashable, launch: Callable[[], None]) -> bool:
        """Replay the in-place graph of `key`, capturing `launch` first if these buffers were seen before (and
        captures are not rationed now); False (nothing run) otherwise."""
        graph = self.get(key)
        if graph is None:
            self._tick += 1
            if key not in self._seen:
                if len(self._seen) >= 4 * self.max_graphs:
                    self._seen.popitem(last=False)
                self._seen[key] = None
                return False
            if not self._may_capture():
                return False
            graph = self._capture(key, launch)
        graph.replay()
        return True

    def by_token_count(self, t: int, launch: Callable[[], None]) -> None:
        """Replay the graph of token count t over the workspace's inputs, capturing `launch` first if needed (or
        running it eagerly while captures are rationed)."""
        graph = self.get(t)
        if graph is None:
            self._tick += 1
            if not self._may_capture():
                launch()
                return
            graph = self._capture(t, launch)
        graph.replay()

    def _may_capture(self) -> bool:
        if len(self._unproven) >= self.max_unproven:
            oldest = self._tick - self.churn_window
            for key in [k for k, tick in self._unproven.items() if tick <= oldest]:
                del self._unproven[key]
            if len(self._unproven) >= self.max_unproven:
                self.declined += 1
                return False
        return True

    def _capture(self, key: Hashable, launch: Callable[[], None]):
        while len(self._graphs) >= self.max_graphs:
            old, _ = self._graphs.popitem(last=False)
            self._unproven.pop(old, None)
            self.evictions += 1
        # No warm-up launch here (see the module docstring): the capture records without running.
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool()):
            launch()
        self._graphs[key] = graph
        self._unproven[key] = self._tick
        self.captures += 1
        return graph
