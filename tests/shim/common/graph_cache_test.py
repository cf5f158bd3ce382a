"""The internal graphs' bookkeeping (shim/common/graph_cache.py) on CPU, with a stand-in for CUDA graphs: buffers seen
once are not captured, the second sight captures and replays, later sights only replay; token-count graphs capture
once; the caps clear what they cap; a capture records into the pool it is given."""

import sys

import pytest

from shim.common import graph_cache
from shim.common.graph_cache import GraphCache


class FakeGraph:
    made = []

    def __init__(self):
        self.replays = 0
        self.recorded = []
        FakeGraph.made.append(self)

    def replay(self):
        self.replays += 1


class FakeCapture:
    def __init__(self, graph, pool=None):
        self.graph, self.pool = graph, pool

    def __enter__(self):
        self.graph.recorded.append(("pool", self.pool))

    def __exit__(self, *exc):
        return False


@pytest.fixture
def cache(monkeypatch):
    FakeGraph.made = []
    monkeypatch.setattr(graph_cache.torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(graph_cache.torch.cuda, "graph", FakeCapture)
    return GraphCache(lambda: "the shared pool")


def test_buffers_are_captured_on_their_second_sight_then_only_replayed(cache):
    launches = []
    launch = lambda: launches.append(1)  # noqa: E731
    assert cache.in_place("k", launch) is False and not FakeGraph.made and not launches  # seen once: nothing runs
    assert cache.in_place("k", launch) is True
    (g,) = FakeGraph.made
    assert launches == [1] and g.replays == 1 and g.recorded == [("pool", "the shared pool")]
    assert cache.in_place("k", launch) is True and g.replays == 2 and launches == [1]  # no second capture
    assert cache.get("k") is g and len(cache) == 1


def test_token_count_graphs_capture_once(cache):
    launch_count = []
    for _ in range(3):
        cache.by_token_count(7, lambda: launch_count.append(7))
    (g,) = FakeGraph.made
    assert launch_count == [7] and g.replays == 3 and cache.get(7) is g


def test_the_caps_clear_what_they_cap(cache, monkeypatch):
    monkeypatch.setattr(GraphCache, "max_graphs", 2)
    for t in range(2):
        cache.by_token_count(t, lambda: None)
    assert len(cache) == 2
    cache.by_token_count(5, lambda: None)  # full: every graph goes before the new capture
    assert len(cache) == 1 and cache.get(5) is not None
    for k in range(8):  # 4 x max_graphs buffers seen once, then the set starts over
        cache.in_place(("b", k), lambda: None)
    assert cache.in_place(("b", 0), lambda: None) is True  # still remembered: captured now
    cache.in_place(("b", 99), lambda: None)  # the ninth: the seen set is cleared first
    assert cache.in_place(("b", 1), lambda: None) is False  # forgotten


def test_clear_keeps_or_forgets_what_was_seen(cache):
    cache.in_place("k", lambda: None)
    cache.clear(forget_seen=False)
    assert cache.in_place("k", lambda: None) is True  # seen before the clear: captured now
    cache.clear()
    assert len(cache) == 0 and cache.in_place("k", lambda: None) is False


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
