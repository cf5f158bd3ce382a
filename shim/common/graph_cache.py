"""A layer's internal CUDA graphs: what lets an eager forward cost a replay instead of a CuTe launch.

The CuTe executor costs ~200 us of host time per eager launch on the H200 host, a replay a few. A caller that
passes the same buffers again (an engine's static buffers, or a loop whose tensors the allocator hands back at the
same addresses) gets a graph that reads and writes them in place, the routing copies inside it: one replay is the
whole call. Any other call copies its inputs into the workspace and replays the graph of its token count. The
frontend's forward (shim/common/frontend.py) decides which; this class keeps the graphs and captures them.

Capture rules (every MegaMoE launch is a cross-rank collective):
  * no warm-up launch before a capture: ranks meet a new token count or new buffers at different calls, so a
    launch on one rank alone would strand the others. The module was loaded by the frontend's all-masked launch
    at compile time; a capture records without running, and the caller's replay is the call's one launch;
  * buffers seen once are not captured: ones that never come back would each cost a capture (the call copies
    and replays by token count instead); the second sight captures;
  * every layer's graphs share one memory pool (the workspace's): they replay one at a time on one stream.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Hashable

import torch

__all__ = ["GraphCache", "buffers_key"]


def buffers_key(t: int, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                out: torch.Tensor) -> tuple:
    """The key of a graph that reads and writes the caller's buffers in place (their dtypes too: the graph holds the
    conversions of an fp16 / fp32 hidden or routing-weight copy)."""
    return (t, x.data_ptr(), x.dtype, topk_idx.data_ptr(), topk_idx.dtype, topk_weights.data_ptr(), topk_weights.dtype,
            out.data_ptr())


class GraphCache:
    """Graphs by key: a token count (replays over the workspace's inputs) or a buffers_key (in place).
    `pool()` gives the memory pool graphs are captured into (the shared workspace's, asked at each capture)."""

    max_graphs = 64

    def __init__(self, pool: Callable[[], Any]):
        self._pool = pool
        self._graphs: Dict[Hashable, Any] = {}
        self._seen: set = set()
        # The steady state's one lookup (the frontend's forward calls it before anything else).
        self.get: Callable[[Hashable], Any] = self._graphs.get

    def __len__(self) -> int:
        return len(self._graphs)

    def items(self):
        return self._graphs.items()

    def clear(self, *, forget_seen: bool = True) -> None:
        """Drop every graph (they hold addresses or weights that changed); `forget_seen` also forgets which buffers
        were seen once."""
        self._graphs.clear()
        if forget_seen:
            self._seen.clear()

    def in_place(self, key: Hashable, launch: Callable[[], None]) -> bool:
        """Replay the in-place graph of `key`, capturing `launch` first if these buffers were seen before; False
        (nothing run) the first time they are seen."""
        graph = self._graphs.get(key)
        if graph is None:
            if key not in self._seen:
                if len(self._seen) >= 4 * self.max_graphs:
                    self._seen.clear()
                self._seen.add(key)
                return False
            graph = self._capture(key, launch)
        graph.replay()
        return True

    def by_token_count(self, t: int, launch: Callable[[], None]) -> None:
        """Replay the graph of token count t over the workspace's inputs, capturing `launch` first if needed."""
        graph = self._graphs.get(t)
        if graph is None:
            graph = self._capture(t, launch)
        graph.replay()

    def _capture(self, key: Hashable, launch: Callable[[], None]):
        if len(self._graphs) >= self.max_graphs:
            self._graphs.clear()
        # No warm-up launch here (see the module docstring): the capture records without running.
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool()):
            launch()
        self._graphs[key] = graph
        return graph
