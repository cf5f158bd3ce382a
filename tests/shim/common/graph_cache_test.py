"""The internal graphs' bookkeeping (shim/common/graph_cache.py) on CPU, with a stand-in for CUDA graphs: buffers seen
once are not captured, the second sight captures and replays, later sights only replay; token-count graphs capture
once; a full cache drops its least recently used graph, one at a time; keys that churn (captured, never replayed by a
later call) stop being captured after max_unproven of them; a capture records into the pool it is given."""

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


def test_a_full_cache_drops_the_least_recently_used_graph(cache, monkeypatch):
    monkeypatch.setattr(GraphCache, "max_graphs", 3)
    for t in range(3):
        cache.by_token_count(t, lambda: None)
    cache.by_token_count(0, lambda: None)  # 0 is now the most recently used
    cache.by_token_count(5, lambda: None)  # full: only the least recently used (1) goes
    assert len(cache) == 3 and cache.get(1) is None and all(cache.get(k) is not None for k in (0, 2, 5))
    assert cache.captures == 4 and cache.evictions == 1
    for k in range(4 * 3 + 1):  # the seen set is bounded too: the oldest sight is forgotten first
        cache.in_place(("b", k), lambda: None)
    assert cache.in_place(("b", 0), lambda: None) is False  # forgotten: seen once more
    assert cache.in_place(("b", 12), lambda: None) is True  # remembered: captured now


def test_churning_keys_cost_a_bounded_number_of_captures(cache):
    launches = []
    for k in range(1000):  # every key seen twice (captured on its second sight), then never again
        for _ in range(2):
            cache.in_place(("b", k), lambda: launches.append(1))
    windows = 1 + 2000 // cache.churn_window
    assert len(FakeGraph.made) == cache.captures <= cache.max_unproven * windows, cache.captures
    assert cache.declined >= 1000 - cache.max_unproven * windows
    # A key that comes back proves its graph: captures go on for keys that are reused.
    cache.clear()
    for k in range(100):
        for _ in range(3):
            cache.in_place(("c", k % 20), lambda: None)
    assert len(cache) == 20 and all(cache.get(("c", k)) is not None for k in range(20))


def test_token_counts_launch_eagerly_while_captures_are_rationed(cache):
    launched = []
    for t in range(cache.max_unproven):
        cache.by_token_count(t, lambda: None)
    cache.by_token_count(99, lambda: launched.append(99))  # max_unproven graphs never replayed since: no capture
    assert launched == [99] and cache.get(99) is None and cache.declined == 1
    cache.by_token_count(0, lambda: None)  # a replay proves graph 0: one capture is allowed again
    cache.by_token_count(99, lambda: launched.append(99))
    assert launched == [99, 99] and cache.get(99) is not None


def test_clear_keeps_or_forgets_what_was_seen(cache):
    cache.in_place("k", lambda: None)
    cache.clear(forget_seen=False)
    assert cache.in_place("k", lambda: None) is True  # seen before the clear: captured now
    cache.clear()
    assert len(cache) == 0 and cache.in_place("k", lambda: None) is False


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
