"""The forward watchdog in one process: the bound and its errors, the ring of watched calls (with fake CUDA
events), the classification of peers from fake heartbeats, the message, the layer's wiring, and the exit path
in a child process (a one-rank layer whose backend stalls, and a caller's own watch)."""

import os
import subprocess
import sys
import time

import pytest
import torch

import moe_ep
from moe_ep.core import watchdog as wd
from moe_ep.core.watchdog import events, monitor, ring
from tests.support.dist import group_fixture, one_rank_weights  # noqa: F401 (the `group` fixture)


# -- the package -----------------------------------------------------------------------------------------------
# One concern a module, each importing only modules above it in this order (no circle).
MODULES = ("bound", "verdict", "events", "store", "sequence", "divergence", "alarm", "ring", "monitor",
           "watches")


def test_the_package_modules_import_only_downward():
    import ast
    from pathlib import Path

    pkg = Path(wd.__file__).parent
    assert sorted(p.stem for p in pkg.glob("*.py") if p.stem != "__init__") == sorted(MODULES)
    for k, name in enumerate(MODULES):
        used = set()
        for node in ast.walk(ast.parse((pkg / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "moe_ep.core.watchdog":
                used |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("moe_ep.core.watchdog."):
                used.add(node.module.rsplit(".", 1)[1])
        assert used <= set(MODULES[:k]), (name, used - set(MODULES[:k]))
    assert set(wd.__all__) <= set(dir(wd)) and "watch" in wd.__all__ and callable(wd.watch)


# -- the bound -----------------------------------------------------------------------------------------------
def test_bound_from_argument_environment_and_default():
    assert wd.parse_timeout(None, env={}) == wd.Bound(None, "default")
    assert wd.parse_timeout(None, env={"MOE_EP_TIMEOUT_S": " 5 "}) == wd.Bound(5.0, "$MOE_EP_TIMEOUT_S")
    assert wd.parse_timeout(None, env={"MOE_EP_TIMEOUT_S": ""}) == wd.Bound(None, "default")
    assert wd.parse_timeout(None, env={"MOE_EP_TIMEOUT_S": "0"}) is None
    assert wd.parse_timeout(2.5, env={"MOE_EP_TIMEOUT_S": "9"}) == wd.Bound(2.5, "MoELayer(timeout_s=...)")
    assert wd.parse_timeout(0, env={"MOE_EP_TIMEOUT_S": "9"}) is None


@pytest.mark.parametrize("raw", ["abc", "-1", "nan", "inf", "1e999", "5s"])
def test_a_bad_environment_value_names_the_variable(raw):
    with pytest.raises(moe_ep.errors.WatchdogConfigError) as e:
        wd.parse_timeout(None, env={"MOE_EP_TIMEOUT_S": raw})
    assert e.value.argument == "MOE_EP_TIMEOUT_S" and repr(raw) in str(e.value) and isinstance(e.value, ValueError)


@pytest.mark.parametrize("value", ["5", True, -1, float("nan"), float("inf"), [3]])
def test_a_bad_argument_names_it(value):
    with pytest.raises(moe_ep.errors.WatchdogConfigError) as e:
        wd.parse_timeout(value, env={})
    assert e.value.argument == "timeout_s" and "0 turns the watchdog off" in str(e.value)


def test_default_bound_adapts_to_the_slowest_call_and_spares_first_calls():
    b = wd.Bound(None, "default")
    assert b.limit(1, 0.0) == wd.FIRST_CALL_S
    assert b.limit(2, 0.0) == wd.DEFAULT_BASE_S
    assert b.limit(7, 3.0) == wd.DEFAULT_BASE_S + wd.DEFAULT_FACTOR * 3.0
    assert wd.Bound(4.0, "x").limit(1, 100.0) == 4.0
    assert "at least" in b.describe(1, 0.0) and "slowest call so far" in b.describe(3, 0.5)
    assert wd.Bound(4.0, "$MOE_EP_TIMEOUT_S").describe(3, 9.0) == "4 s, set by $MOE_EP_TIMEOUT_S"


# -- the ring, driven by hand with fake CUDA events ------------------------------------------------------------
class FakeEvent:
    def __init__(self):
        self.done = True
        self.captured = False
        self.queries = 0


class FakeCuda:
    """The driver as the watchdog sees it: record(event, raw stream) -> 0, query(event) -> finished."""
    ready = True

    def __init__(self):
        self.capture = False
        self.stream = 1
        self.recorded = []

    def capturing(self):
        return self.capture

    def raw_stream(self, dev):
        return self.stream

    def record(self, ev, raw):
        ev.done, ev.captured = False, self.capture
        self.recorded.append(ev)
        return 0

    def query(self, ev):
        ev.queries += 1
        return ev.done or ev.captured  # an event recorded in a capture answers with an error: counted finished


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = FakeCuda()
    monkeypatch.setattr(events, "cuda", fake)
    m = monitor.Monitor(threads=False)
    evs = [FakeEvent() for _ in range(ring.RING)]

    def make(name, bound=5.0):
        w = wd.Watch(name, wd.Bound(bound, "test"), [0, 1], 0, "cpu", monitor=m)
        w._dev, w._evs, w._raw, w._rec = 0, evs, fake.raw_stream, fake.record  # a CUDA watch, fake events
        return w

    return fake, m, make


def _call(w):
    i = w.begin()
    w.end(i)
    return i


def test_device_calls_are_confirmed_in_order(fake_cuda):
    fake, m, make = fake_cuda
    w = make("layer")
    for _ in range(10):
        _call(w)
    assert (w.started, w.returned) == (10, 10)
    m.confirm(time.monotonic())
    assert m.done_upto == -1  # nothing finished on the device yet
    for ev in fake.recorded[:6]:  # the device finished the first six (in stream order)
        ev.done = True
    m.confirm(time.monotonic())
    assert m.done_upto == 5
    owner, call, t0, state = m.oldest_unfinished()[0]
    assert (owner.name, call, state) == ("layer", 7, ring.DEVICE)
    assert m.progress()["layer"] == [10, 10, 6]
    for ev in fake.recorded:
        ev.done = True
    m.confirm(time.monotonic())
    assert m.done_upto == 9 and m.oldest_unfinished() == []
    assert m.progress()["layer"] == [10, 10, 10]


def test_the_oldest_unfinished_call_trips_after_its_bound(fake_cuda, monkeypatch):
    fake, m, make = fake_cuda
    a, b = make("layer a", bound=5.0), make("layer b", bound=5.0)
    trips = []
    monkeypatch.setattr(m, "trip", lambda owner, call, t0, st, now, note="": trips.append((owner.name, call, st)))
    for _ in range(3):
        _call(a)
        _call(b)
    fake.recorded[0].done = fake.recorded[1].done = True  # a#1, b#1 finished; a#2 is stuck, so is all after it
    now = time.monotonic()
    m.confirm(now)
    m.check_deadlines(now + 4.0)
    assert trips == []
    m.check_deadlines(now + 6.0)
    assert trips == [("layer a", 2, ring.DEVICE)]


def test_a_call_stuck_on_the_host_trips_too(fake_cuda, monkeypatch):
    fake, m, make = fake_cuda
    w = make("host stuck", bound=2.0)
    trips = []
    monkeypatch.setattr(m, "trip", lambda owner, call, t0, st, now, note="": trips.append((owner.name, call, st)))
    _call(w)
    fake.recorded[0].done = True
    w.begin()  # call 2 never returns on the host (a collective, or the backend blocks)
    now = time.monotonic()
    m.confirm(now)
    assert m.done_upto == 0
    m.check_deadlines(now + 2.5)
    assert trips == [("host stuck", 2, ring.HOST)]


def test_many_calls_in_flight_use_a_binary_search_and_two_streams_a_walk(fake_cuda):
    fake, m, make = fake_cuda
    w = make("layer")
    for _ in range(1000):
        _call(w)
    for ev in fake.recorded[:613]:
        ev.done = True
    m.confirm(time.monotonic())
    assert m.done_upto == 612 and sum(ev.queries for ev in fake.recorded) < 20
    fake.stream = 2  # a call on another stream: order across streams is not known
    _call(w)
    fake.recorded[-1].done = True
    m.confirm(time.monotonic())
    assert m.done_upto == 612  # call 614 (on stream 1) still runs
    for ev in fake.recorded:
        ev.done = True
    m.confirm(time.monotonic())
    assert m.done_upto == 1000


def test_captured_calls_nested_calls_and_a_full_ring(fake_cuda):
    fake, m, make = fake_cuda
    outer, inner = make("decode graph"), make("layer")
    fake.capture = True  # a forward recorded into the caller's graph: its event answers with an error
    _call(inner)
    fake.capture = False
    m.confirm(time.monotonic())
    assert m.done_upto == 0  # counted finished (the caller's replays are the caller's to watch)
    i = outer.begin()
    assert _call(inner) == -1  # nested in a watched call: counted, not watched
    outer.end(i)
    assert (inner.started, inner.returned, outer.started) == (2, 2, 1)
    # The ring full of calls in flight: the captured call's slot (finished) is taken again, then the next call
    # cannot be watched (the outer call, unfinished, is never overwritten)
    for _ in range(ring.RING - 1):
        _call(inner)
    assert m.next_g == ring.RING + 1 and m.done_upto == 0  # the outer call (1) has not finished
    assert _call(inner) == -1 and m.next_g == ring.RING + 1 and inner.started == ring.RING + 2
    assert m.oldest_unfinished()[0][:2] == (outer, 1)
    for ev in fake.recorded:
        ev.done = True
    assert _call(inner) >= 0  # the main thread confirms for itself and goes on


def test_an_exception_inside_the_call_ends_it(fake_cuda):
    fake, m, make = fake_cuda
    w = make("layer")
    with pytest.raises(RuntimeError):
        with w:
            raise RuntimeError("bad input")
    assert m.depth == 0 and (w.started, w.returned) == (1, 1)
    m.confirm(time.monotonic())
    assert m.oldest_unfinished() == []


# -- peers and the message -------------------------------------------------------------------------------------
def _hb(beat, calls, t=1000.0):
    return {"beat": beat, "t": t, "pid": 4242, "host": "h", "calls": calls, "tripped": False}


def test_peers_are_classified_from_their_heartbeats():
    name, call = "moe_ep layer #3", 7
    peers = {
        1: (_hb(5, {name: [7, 7, 6]}), _hb(5, {name: [7, 7, 6]})),     # beat did not advance
        2: (_hb(5, {name: [6, 6, 6]}), _hb(8, {name: [6, 6, 6]})),     # alive, last call 6
        3: (_hb(5, {name: [7, 6, 6]}), _hb(8, {name: [7, 6, 6]})),     # inside call 7 on the host
        4: (_hb(5, {name: [7, 7, 6]}), _hb(8, {name: [7, 7, 6]})),     # returned, device still on it
        5: (_hb(5, {name: [9, 9, 9]}), _hb(8, {name: [9, 9, 9]})),     # past it
        6: (None, None),                                               # never published
        7: (None, _hb(1, {})),                                         # just started: alive, no call yet
    }
    states = {p.rank: p for p in wd.classify_peers(name, call, peers, list(range(8)), 0, now_wall=1003.0)}
    assert sorted(states) == [1, 2, 3, 4, 5, 6, 7]
    assert {r: p.state for r, p in states.items()} == {
        1: "stopped", 2: "not_entered", 3: "inside_host", 4: "inside_device", 5: "past", 6: "no_heartbeat",
        7: "not_entered"}
    assert "3.0 s ago" in states[1].detail and "last call was 6" in states[2].detail


def test_an_unreachable_store_names_its_host_and_global_ranks_are_kept():
    # a group of global ranks [0, 4, 6]; this process is group rank 2 (global 6); the store cannot be read
    peers = {0: (None, None), 4: (None, None)}
    states = wd.classify_peers("L", 3, peers, [0, 4, 6], 2, reachable=False)
    assert [(p.rank, p.global_rank, p.state) for p in states] == [(0, 0, "unreachable"), (1, 4, "unknown")]
    assert "hosts the process group's store" in states[0].detail and "unknown" in states[1].detail
    text = wd.format_message(name="L", call=3, rank=2, world=3, waited_s=9.0, on_device=False, bound="9 s",
                             peers=states, global_rank=6, store_note="the store at h:1 cannot be reached")
    assert "rank 2 (global 6) of 3" in text and "heartbeat stopped or unreachable: rank 0\n" in text
    assert "unknown (the store cannot be read): rank 1 (global 4)" in text and "verdict: rank 0 stopped" in text


def test_the_message_says_everything_once():
    peers = wd.classify_peers("moe_ep layer #1", 137, {
        1: (_hb(3, {"moe_ep layer #1": [137, 137, 136]}), _hb(3, {"moe_ep layer #1": [137, 137, 136]})),
        2: (_hb(3, {"moe_ep layer #1": [136, 136, 136]}), _hb(4, {"moe_ep layer #1": [136, 136, 136]})),
    }, [0, 1, 2], 0, now_wall=1006.0)
    text = wd.format_message(name="moe_ep layer #1", call=137, rank=0, world=3, waited_s=5.2, on_device=True,
                             bound=wd.Bound(5.0, "$MOE_EP_TIMEOUT_S").describe(137, 0.01), peers=peers)
    assert text.startswith("moe_ep watchdog: rank 0 of 3: 'moe_ep layer #1' call 137 has not finished after 5.2 s")
    assert "heartbeat stopped or unreachable: rank 1" in text
    assert "alive, never entered call 137: rank 2 (last call 136)" in text
    assert "5 s, set by $MOE_EP_TIMEOUT_S" in text and "MOE_EP_TIMEOUT_S=<seconds>" in text
    assert "cannot be cancelled from the host: this process ends now (exit code 86)" in text
    assert moe_ep.WATCHDOG_EXIT_CODE == wd.WATCHDOG_EXIT_CODE == 86
    assert text.count("moe_ep watchdog:") == 1 and text.endswith(").\n")


# -- the layer -------------------------------------------------------------------------------------------------
H, I, E, K, C = 128, 128, 4, 2, 8


def _weights():
    return one_rank_weights(E, H, I, 10)


def _inputs(t=5):
    g = torch.Generator().manual_seed(1)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
    return torch.randn(t, H, generator=g).to(torch.bfloat16), idx, torch.softmax(torch.randn(t, K, generator=g), -1)


def test_layer_names_bounds_and_counts(group, monkeypatch):
    monkeypatch.delenv("MOE_EP_TIMEOUT_S", raising=False)
    spec = moe_ep.MoESpec(H, I, E, K, C)
    with moe_ep.MoELayer(spec, _weights()) as a, moe_ep.MoELayer(spec, _weights(), name="experts.7",
                                                                 timeout_s=3) as b:
        assert a.name.startswith("moe_ep layer #") and b.name == "experts.7"
        assert a._watch.bound == wd.Bound(None, "default") and b._watch.bound == wd.Bound(3.0, "MoELayer(timeout_s=...)")
        x, idx, w = _inputs()
        for _ in range(3):
            b(x, idx, w)
        with pytest.raises(moe_ep.errors.DTypeError):
            b(x.double(), idx, w)  # raises inside the watched call: it ends there
        b(x, idx, w)
        assert (b._watch.started, b._watch.returned) == (5, 5)
        assert monitor.get().depth == 0
        assert monitor.get().progress()["experts.7"][:2] == [5, 5]
        b.watched = False  # paused: calls are not watched (nor counted), the Watch stays
        b(x, idx, w)
        assert not b.watched and b.watch is not None and b._watch.started == 5
        b.watched = True
        b(x, idx, w)
        assert b.watched and b._watch.started == 6
    assert a._watch is None and "experts.7" not in monitor.get().progress()
    monkeypatch.setenv("MOE_EP_TIMEOUT_S", "0")
    with moe_ep.MoELayer(spec, _weights(), name="off") as off:
        assert off._watch is None and off.name == "off" and not off.watched
        off(*_inputs())
        with pytest.raises(moe_ep.errors.WatchdogConfigError) as e:
            off.watched = True
        assert e.value.argument == "watched"


def test_layer_refuses_a_bad_bound(group, monkeypatch):
    spec = moe_ep.MoESpec(H, I, E, K, C)
    with pytest.raises(moe_ep.errors.WatchdogConfigError) as e:
        moe_ep.MoELayer(spec, _weights(), timeout_s=-2)
    assert e.value.argument == "timeout_s"
    monkeypatch.setenv("MOE_EP_TIMEOUT_S", "soon")
    with pytest.raises(moe_ep.errors.WatchdogConfigError) as e:
        moe_ep.MoELayer(spec, _weights())
    assert e.value.argument == "MOE_EP_TIMEOUT_S" and "'soon'" in str(e.value)


# -- the exit path, in a child process ------------------------------------------------------------------------
STALLING_LAYER = """
import time, torch, moe_ep
from moe_ep.reference.backend import TorchReferenceBackend
class Stalling(TorchReferenceBackend):
    def forward(self, *a):
        time.sleep(60)
moe_ep.register_backend("t_stalling", Stalling, arch="cpu", formats=("bf16",))
moe_ep.init_from_env()
E, K = 4, 2
spec = moe_ep.MoESpec(128, 128, E, K, 8)
w = moe_ep.ExpertWeights(torch.zeros(E, 256, 128, dtype=torch.bfloat16), torch.zeros(E, 128, 128, dtype=torch.bfloat16),
                         0, 1, E)
layer = moe_ep.MoELayer(spec, w, backend="t_stalling", name="experts.3", timeout_s=1.0)
idx = torch.tensor([[0, 1]] * 2)
print("calling", flush=True)
layer(torch.zeros(2, 128, dtype=torch.bfloat16), idx, torch.ones(2, K) / K)
print("unreachable", flush=True)
"""

STALLING_WATCH = """
import time, moe_ep
replay = moe_ep.watch("decode graph", timeout_s=1.0)
with replay:
    pass
with replay:
    time.sleep(60)
"""


@pytest.mark.parametrize("code,name,call", [(STALLING_LAYER, "experts.3", 1), (STALLING_WATCH, "decode graph", 2)],
                         ids=["layer", "watch"])
def test_a_stuck_call_ends_the_process_with_the_message(code, name, call):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), CUDA_VISIBLE_DEVICES="")
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "MOE_EP_TIMEOUT_S"):
        env.pop(var, None)
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - t0
    assert res.returncode == moe_ep.WATCHDOG_EXIT_CODE, (res.returncode, res.stdout, res.stderr)
    assert "unreachable" not in res.stdout
    assert f"'{name}' call {call} has not finished after 1." in res.stderr, res.stderr
    assert "rank 0 of 1" in res.stderr and "this group has one rank" in res.stderr
    assert "this process ends now (exit code 86)" in res.stderr
    assert res.stderr.count("moe_ep watchdog:") == 1
    assert elapsed < 30, elapsed


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
