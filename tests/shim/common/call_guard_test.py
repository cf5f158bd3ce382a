"""The call guard (shim/common/call_guard.py) on CPU: its protocol, replayed in torch step by step as its Triton kernel
runs it (call_guard.simulate_launch), across simulated ranks that fall out of step (a skipped launch, one too many, the
wrong layer), and the host's side of it: the report read without a sync, the error naming the ranks and layers, the
group's sequence marked, the monitor's probe for calls the host never sees. The kernels themselves are held to the
same expectations on a GPU by tools/diag/call_guard_cost.py."""

import sys

import pytest
import torch

import moe_ep
from moe_ep.core.watchdog import monitor, sequence
from shim.common import call_guard as cg

L1, L2 = 1, 2  # layer codes (their order among the pool's layers)


def run(world, plans):
    """plans[r]: the layer codes rank r launches, in order (each launch pairs with the peers' launch of the same
    index, as the kernel's exchange pairs them). Returns the ranks and, per launch, whether it was refused."""
    ranks = [cg.SimRank(r, world) for r in range(world)]
    refused = []
    for k in range(min(len(p) for p in plans)):
        idx = [torch.arange(6, dtype=torch.int64).view(3, 2) for _ in range(world)]
        cg.simulate_launch(ranks, [p[k] for p in plans], idx)
        masked = [bool((i == -1).all()) for i in idx]
        assert len(set(masked)) == 1  # every rank refuses the same launch
        refused.append(masked[0])
    return ranks, refused


def alternating(n, skip=None, extra=None, wrong=None):
    out = []
    for k in range(1, n + 1):
        code = L1 if k % 2 else L2
        if k == skip:
            continue
        if k == wrong:
            code = L2 if code == L1 else L1
        out.append(code)
        if k == extra:
            out.append(code)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_in_step_are_never_refused(world):
    ranks, refused = run(world, [alternating(12)] * world)
    assert refused == [False] * 12 and all(int(r.report[0]) == 0 for r in ranks)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("fault", ["skip", "extra", "wrong"])
def test_the_first_launch_out_of_step_and_every_later_one_are_refused(world, fault):
    bad = world - 1
    plans = [alternating(12)] * (world - 1) + [alternating(12, **{fault: 5})]
    ranks, refused = run(world, plans)
    first = 6 if fault == "extra" else 5  # one too many first meets the peers' next launch
    assert refused == [False] * (first - 1) + [True] * (len(refused) - first + 1)  # from there on: sticky
    names = {L1: "model.layers.1.mlp", L2: "model.layers.2.mlp"}
    for rk in ranks:
        assert int(rk.report[0]) == 1 and int(rk.report[1]) == first
        err = cg.describe(rk.report.tolist(), world=world, rank=rk.rank, ranks=list(range(world)), names=names)
        assert isinstance(err, moe_ep.RankDivergenceError) and err.call == first and err.ranks == (bad,)
        assert set(err.layers) == set(names.values())
        assert f"rank {rk.rank} (this rank) in" in str(err) and f"launch {first} of this group" in str(err)
        assert err.seen[0] == (names[L1 if first == 5 else L2], 3, first)  # rank 0's third launch of that layer


def test_a_rank_that_realigns_after_a_skip_and_an_extra_stays_refused():
    # Skip at 5, one too many at 7: from 8 on the codes match again, the pairing is still one off, the data not.
    ranks, refused = run(2, [alternating(12), alternating(12, skip=5, extra=7)])
    assert refused[4:] == [True] * (len(refused) - 4)


class _Pool:
    """What PoolGuard reads of a workspace pool: its context, device, heap allocation and per-peer deltas."""

    def __init__(self, rank, world):
        self.ctx = moe_ep.RankContext.detached(rank, world)
        self.device = torch.device("cpu")
        self.peer_offsets = tuple(0 for _ in range(world))

    def _heap_alloc(self, nbytes):
        return torch.zeros(nbytes, dtype=torch.uint8)


def test_the_host_raises_from_the_report_without_a_sync_and_marks_the_group(monkeypatch):
    lg = sequence.GroupLog("guard:0,1", [0, 1], 0)
    monkeypatch.setattr(sequence, "log_for", lambda group: lg)
    monkeypatch.setattr(sequence, "group_ranks", lambda group: ([0, 1], 0))
    m = monitor.Monitor(threads=False)
    monkeypatch.setattr(monitor, "get", lambda: m)
    pg = cg.PoolGuard(_Pool(0, 2))
    a, b = cg.Guard(pg), cg.Guard(pg)
    a.name("layers.1.mlp"), b.name("layers.2.mlp")
    assert (a.code, b.code) == (1, 2) and not a.tripped and len(m.probes) == 1
    assert m.probes[0]() is None  # nothing refused: nothing to say
    # what the device writes when launch 9 differs: rank 0 in layers.1 (its 5th launch), rank 1 in layers.2 (its 4th)
    pg.report[2], pg.report[3] = cg.word(9, a.code, 5), cg.word(9, b.code, 4)
    pg.report[1], pg.report[0] = 9, 1
    assert a.tripped and b.tripped
    with pytest.raises(moe_ep.RankDivergenceError) as e:
        b.raise_error()
    err = e.value
    assert err.call == 9 and err.ranks == (1,) and err.layers == ("layers.1.mlp", "layers.2.mlp")
    assert "rank 0 (this rank) in 'layers.1.mlp' launch 5; rank 1 in 'layers.2.mlp' launch 4" in str(err)
    assert lg.diverged is not None  # the layers' next calls are refused before they reach the backend
    with pytest.raises(moe_ep.RankDivergenceError) as again:
        a.raise_error()
    assert str(again.value) == str(err) and again.value is not err
    assert m.probes[0]() is None  # a forward raised it: the monitor has nothing to end


def test_the_monitor_ends_the_process_when_no_forward_raises_it(monkeypatch):
    lg = sequence.GroupLog("guard2:0,1", [0, 1], 0)
    monkeypatch.setattr(sequence, "log_for", lambda group: lg)
    monkeypatch.setattr(sequence, "group_ranks", lambda group: ([0, 1], 0))
    m = monitor.Monitor(threads=False)
    monkeypatch.setattr(monitor, "get", lambda: m)
    ended, said = [], []
    from moe_ep.core.watchdog import verdict

    monkeypatch.setattr(verdict, "EXIT", ended.append)
    monkeypatch.setattr(verdict, "emit", said.append)
    monkeypatch.setattr(cg, "_RAISE_GRACE_S", 0.0)
    pg = cg.PoolGuard(_Pool(1, 2))
    g = cg.Guard(pg)
    pg.report[2], pg.report[3] = cg.word(4, g.code, 2), cg.word(4, g.code, 3)
    pg.report[1], pg.report[0] = 4, 1
    m.check_probes()  # first seen: the grace starts
    assert not ended
    m.check_probes()
    assert ended == [86] and lg.halting and "out of step" in said[0] and "exit code 86" in said[0]


def test_a_word_holds_the_epoch_layer_and_launch_and_wraps_alike_on_every_rank():
    w = cg.word(70000, 5, (1 << 32) + 7)  # the epoch and the launch count wrap: every rank wraps them alike
    assert w >> 48 == 70000 & 0xFFFF and cg._decode(w) == (5, 7)
    top = cg.word(0xFFFF, 0xFFFF, 0xFFFFFFFF)
    assert top == -1 and cg._decode(top) == (0xFFFF, 0xFFFFFFFF)  # int64 as torch holds it


def test_the_switch(monkeypatch):
    monkeypatch.delenv(cg.ENV, raising=False)
    assert cg.requested() is cg.DEFAULT_ON
    for raw, want in (("0", False), ("off", False), ("1", True), ("on", True)):
        monkeypatch.setenv(cg.ENV, raw)
        assert cg.requested() is want
    monkeypatch.setenv(cg.ENV, "maybe")
    with pytest.raises(moe_ep.errors.CheckConfigError) as e:
        cg.requested()
    assert e.value.argument == cg.ENV
    monkeypatch.setenv(cg.ENV, "1")
    monkeypatch.setenv(sequence.SEQUENCE_ENV, "0")
    assert not cg.enabled()  # the sequence check's own switch turns the guard off too


# -- the kernel backends' part of the layers' construction agreement ----------------------------------------------
class _Knobs:
    def __init__(self, tile):
        self.tile = tile

    def to_json(self):
        return {"tile": self.tile}


class _KnobsModule:
    tuned = []

    @staticmethod
    def resolve_knobs(knobs, *, tune, **_):
        if knobs == "auto":  # a miss of cache and table: the collective tune decides
            return tune(), "autotune"
        return _Knobs(knobs or 128), "explicit" if knobs else "heuristic"


def _backend(knobs):
    from shim.common.backend import KernelBackend

    cls = type("FakeKernelBackend", (KernelBackend,), dict(arch="sm90", knobs_module=_KnobsModule, name="fake",
                                                           autotune=lambda self, w: _KnobsModule.tuned.append(w)))
    return cls(moe_ep.MoESpec(256, 128, 8, 2, 16), moe_ep.RankContext.detached(0, 2), fmt="fp8_block", knobs=knobs)


def test_a_kernel_backend_agrees_on_its_resolved_knobs_before_any_workspace():
    be = _backend(64)
    fields = be.agreement()
    assert fields == {"knobs": {"tile": 64}, "call_guard": cg.enabled()}
    assert be._resolved[1] == "explicit" and be.frontend is None  # resolved once, nothing allocated
    auto = _backend("auto")
    assert auto.agreement()["knobs"] == "auto: a collective tune"
    assert auto._resolved is None and _KnobsModule.tuned == []  # the tune runs later, with the weights


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
