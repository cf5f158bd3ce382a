"""The frontend's forward and its internal graphs on CPU (shim/common/frontend.py, graph_cache.py): a compile-only
Hopper FP8 frontend driven through forward() with stand-ins for the compiled kernel (it fills its output with the
byte of the current call, through the pointer the launch was given) and for CUDA graph capture (a capture records
the launches, a replay runs them again). What the H200 showed (#25.1): `layer(x, idx, w)` without `out` captured a
graph every other call (the kernel arguments kept each call's fresh output alive, so the next call's output had a
new address, and the in-place graphs were keyed by it), and a closed layer's frontend lived on in a reference cycle
with its weights until the garbage collector ran."""

import ctypes
import gc
import sys
import weakref

import pytest
import torch

import moe_ep
from shim.common import cute_args, frontend, graph_cache

_BYTE = [0x3F]
_recording = []


class _Graph:
    made = 0  # captures, counted by the stand-in itself

    def __init__(self):
        self.ops = []
        _Graph.made += 1

    def replay(self):
        for op in self.ops:
            op()


class _Capture:
    def __init__(self, graph, pool=None):
        self.graph = graph

    def __enter__(self):
        _recording.append(self.graph)

    def __exit__(self, *exc):
        _recording.pop()
        return False


def _kernel(**args):
    """The compiled kernel's stand-in: fills its output with the current call's byte (read at run time, so a replay
    writes the replaying call's byte). It keeps the output's address, not the tensor, as a CUDA graph does."""
    o = args["output_activation"]
    ptr, nbytes = o.data_ptr(), o.numel() * o.element_size()

    def run():
        ctypes.memset(ptr, _BYTE[0], nbytes)

    (_recording[-1].ops.append if _recording else lambda f: f())(run)


@pytest.fixture
def stand_ins(sm90_tree, monkeypatch):

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setattr(graph_cache.torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(graph_cache.torch.cuda, "graph", _Capture)
    monkeypatch.setattr(frontend, "_capturing", lambda: False)
    monkeypatch.setattr(cute_args.ArgBuilder, "stream", lambda self: 0)
    real_tensor = cute_args.ArgBuilder.tensor
    # A real launch's tensor arguments hold their storage alive (DLPack) as this does; the stand-in kernel reads
    # the output's address from it.
    monkeypatch.setattr(cute_args.ArgBuilder, "tensor", lambda self, t, align=16: t if self.real else
                        real_tensor(self, t, align))


def _frontend():
    from shim.common.backend import compile_only_frontend

    f = compile_only_frontend("sm90_fp8_cutedsl", moe_ep.MoESpec(512, 256, 8, 4, 16))
    f.compile_only = False  # as on a device: forward() takes the graph paths
    f._weights = f.weights_layout.placeholder(f.experts_per_rank, f.hidden_size, f.intermediate_size)
    f.compiled = _kernel
    _Graph.made = 0
    return f


@pytest.fixture
def fe(stand_ins):
    f = _frontend()
    yield f
    f.close()


def _inputs(t, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, 512, generator=g).to(torch.bfloat16), torch.randint(0, 8, (t, 4), generator=g),
            torch.rand(t, 4, generator=g))


def _filled(out, byte):
    return bool((out.view(torch.int16) == ((byte << 8) | byte)).all())


def test_calls_without_out_return_fresh_tensors_and_capture_at_most_twice(fe):
    x, idx, w = _inputs(3)
    kept = []
    for call in range(60):
        _BYTE[0] = 0x20 + call
        got = fe.forward(x, idx, w)
        assert got.shape == (3, 512) and got.dtype == torch.bfloat16 and _filled(got, 0x20 + call)
        assert got.data_ptr() != fe.out_buf.data_ptr()  # the caller's own tensor, not the workspace
        if call % 7 == 0:
            kept.append((got, 0x20 + call))
    assert all(_filled(o, b) for o, b in kept)  # later calls did not write over what earlier ones returned
    assert _Graph.made == 2  # the token count's graph (first sight), then the inputs' in-place graph


def test_a_callers_out_is_not_kept_alive_by_the_frontend(fe):
    x, idx, w = _inputs(5)
    for call in range(3):  # seen once (by token count), captured in place, replayed
        out = torch.empty(5, 512, dtype=torch.bfloat16)
        _BYTE[0] = 0x31 + call
        assert fe.forward(x, idx, w, out=out) is out and _filled(out, 0x31 + call)
        storage = out.untyped_storage()._weak_ref()
        del out
        assert torch.UntypedStorage._expired(storage), f"call {call}: the frontend still holds the caller's out"


def test_the_same_out_is_written_in_place_by_one_graph(fe):
    x, idx, w = _inputs(4)
    out = torch.empty(4, 512, dtype=torch.bfloat16)
    for call in range(20):
        _BYTE[0] = 0x40 + call
        assert fe.forward(x, idx, w, out=out) is out and _filled(out, 0x40 + call)
    assert _Graph.made == 2


def test_outputs_at_ever_new_addresses_cost_a_bounded_number_of_captures(fe):
    x, idx, w = _inputs(2)
    kept = []
    for call in range(300):  # each out seen exactly twice, then never again: the pattern that churned
        if call % 2 == 0:
            out = torch.empty(2, 512, dtype=torch.bfloat16)
            kept.append(out)
        _BYTE[0] = 0x50 + call % 100
        assert fe.forward(x, idx, w, out=out) is out and _filled(out, 0x50 + call % 100)
    cache = fe.graphs
    assert _Graph.made <= 1 + cache.max_unproven * (1 + 300 // cache.churn_window), _Graph.made
    assert cache.captures == _Graph.made and cache.declined > 0


def test_a_closed_frontend_frees_its_weights_without_the_garbage_collector(stand_ins):
    fe = _frontend()
    x, idx, w = _inputs(2)
    fe.forward(x, idx, w)
    fe.forward(x, idx, w)
    weights = weakref.ref(fe.weights)
    arena = fe.x_in.untyped_storage()._weak_ref()
    gc.disable()
    try:
        fe.close()
        assert weights() is None  # at close, whoever still refers to the frontend
        f = weakref.ref(fe)
        del fe
        alive = f()
        assert alive is None, f"it lives on, referred to by {[type(r).__name__ for r in gc.get_referrers(alive)]}"
    finally:
        gc.enable()
    assert torch.UntypedStorage._expired(arena)  # the workspace's arena (no other layer holds the pool)



def test_a_compile_checks_frontend_dropped_unclosed_leaves_the_pool(stand_ins):
    """The drop tool's child and the compile tests build compile-only frontends and never close them: each one's
    share of the (compile-only) pool goes with it, so a process building many holds one, not all."""
    from shim.common.backend import compile_only_frontend

    def build(capacity):
        f = compile_only_frontend("sm90_fp8_cutedsl", moe_ep.MoESpec(512, 256, 8, 4, capacity))
        return f, f._pool

    f, pool = build(16)
    before = pool.stats()["layers"]
    others = [build(c)[0] for c in (32, 64)]
    assert pool.stats()["layers"] == before + 2
    gc.disable()
    try:
        del others, f  # no close(), no collector: reference counting alone
        assert pool.stats()["layers"] == before - 1
    finally:
        gc.enable()

if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
