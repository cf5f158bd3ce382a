"""Capturing a forward into a CUDA graph from the outside (an engine graphing its decode step, the benchmark,
the tuner, the GPU suites): warm up on a side stream so lazy initialisation happens outside the capture, then
capture on that stream. moe_ep's own per-token-count graphs do not warm up (their launches are collective,
see shim/common/frontend.py); a caller's warm-up runs the forward on every rank alike, so it may."""

from __future__ import annotations

from typing import Callable, Optional

import torch

__all__ = ["capture_graph"]


def capture_graph(fn: Callable[[], object], *, warmup: int = 1, pool=None,
                  device: Optional[torch.device] = None) -> "torch.cuda.CUDAGraph":
    """Run `fn` `warmup` times on a side stream, then capture one call of it; returns the graph (replay() it).

    Collective when `fn` is a moe_ep forward: every rank must capture together. A layer's value checks and
    cross-rank agreement take host syncs a capture cannot hold: they are skipped while a stream is capturing
    (the warm-up calls run them), whatever the layer's check schedule."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        fn()
    return graph
