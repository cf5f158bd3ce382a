"""Ranks out of step (#28), in one process: the group's call log and its digests, the comparison of two ranks'
checkpoints, naming the first diverging call and what the rank out of step did, the in-band check of a backend's
exchange (and the refusal of every later call), and a lost peer turned into moe_ep's PeerLostError."""

import sys

import pytest
import torch

import moe_ep
from moe_ep.core import dist as mdist
from moe_ep.core.watchdog import divergence, monitor, sequence, store
from moe_ep.core.watchdog import watches as wd_watches
from tests.support.dist import one_rank_gloo_group

L1, L2 = 2, 4  # the identities of a group's first two layers
NAMES = {L1: "L1", L2: "L2"}


def feed(lg, calls):
    """calls: identities in order; call numbers counted per identity, as Watch.begin does."""
    n = lg.__dict__.setdefault("test_counts", {})
    for code in calls:
        n[code] = n.get(code, 0) + 1
        s = lg.seq
        lg.codes[s & sequence.LOG_MASK] = code
        lg.calls[s & sequence.LOG_MASK] = n[code]
        lg.seq = s + 1


def alternating(n, skip=None, extra=None, wrong=None):
    """Loop calls 1..n, L1 at odd ones; a fault at one loop call."""
    out = []
    for i in range(1, n + 1):
        code = L1 if i % 2 else L2
        if i == skip:
            continue
        if i == wrong:
            code = L2 if code == L1 else L1
        out.append(code)
        if i == extra:
            out.append(code)
    return out


def log(calls=()):
    lg = sequence.GroupLog("test", [0, 1], 0)
    lg.names.update(NAMES)
    feed(lg, calls)
    return lg


# -- digests and their comparison --------------------------------------------------------------------------------
@pytest.mark.parametrize("n,fault", [(40, 21), (300, 201), (9000, 8001)])
def test_digests_agree_in_step_and_bracket_the_first_diverging_call(n, fault):
    a, b, c = log(alternating(n)), log(alternating(n)), log(alternating(n, skip=fault))
    da, db, dc = a.digest(), b.digest(), c.digest()
    assert da and da == db and divergence.compare(da, db) is None
    s0, s1 = divergence.compare(da, dc)
    assert s0 < fault <= s1, (s0, s1)  # group call `fault` is the first that differs (loop call = group call here)
    if n - fault < sequence.FINE:
        assert (s0, s1) == (fault - 1, fault)  # within the last calls: to the call


def test_digests_are_incremental_and_ranks_publishing_apart_still_meet():
    calls = alternating(5000)
    a, b = log(), log()
    for k in range(0, 5000, 777):  # one rank digests often, the other only at the end
        feed(a, calls[k:k + 777])
        a.digest()
    feed(b, calls[:4000])
    assert divergence.compare(a.digest(), b.digest()) is None  # shared checkpoints only: 4000 and before agree
    c = log(alternating(5000, skip=4500))
    assert divergence.compare(a.digest(), c.digest())[1] <= 4500 + sequence.BLOCK


def test_a_log_that_fell_behind_publishes_nothing():
    a = log()
    feed(a, [L1] * (sequence.LOG - 1))
    assert a.digest() == {} and "calls arrived between two digests" in a.lost
    assert divergence.compare(a.digest(), log(alternating(100)).digest()) is None  # nothing to compare: no verdict


def test_compare_needs_a_shared_checkpoint():
    assert divergence.compare({64: "a"}, {128: "b"}) is None
    assert divergence.compare({64: "a", 128: "b"}, {64: "a", 128: "c"}) == (64, 128)
    assert divergence.compare({64: "x", 128: "b"}, {64: "a", 128: "c"}) == (0, 64)


# -- naming the call -----------------------------------------------------------------------------------------------
def entries(calls, first=1):
    lg = log(calls)
    return lg.entries(first, lg.seq)


@pytest.mark.parametrize("fault,call,expect", [
    (dict(skip=21), 21, "left out 'L1' call 11, or made 'L2' call 11 one time too many"),
    (dict(extra=21), 22, "left out 'L2' call 11, or made 'L1' call 12 one time too many"),
    (dict(wrong=21), 21, "made 'L2' call 11 where rank 0 made 'L1' call 11"),
])
def test_the_first_diverging_call_and_what_the_rank_did(fault, call, expect):
    f = divergence.analyze({0: entries(alternating(40)), 1: entries(alternating(40, **fault))}, 10, NAMES)
    assert f.call == call and f.out == [1] and f.ref_rank == 0 and expect in f.how[1]
    assert sorted(f.layers) == [L1, L2]
    text = divergence.format_message(f, names=NAMES, rank=0, world=2, ranks=[0, 1], noticed="seen by test", after=5)
    assert text.startswith(f"moe_ep watchdog: rank 0 of 2: the ranks fell out of step at group call {call}")
    assert "out of step: rank 1 (against rank 0)" in text and "layers involved: 'L1', 'L2'" in text
    assert "made 5 collective call(s) after it" in text and text.endswith("(exit code 86).\n")


def test_stopped_within_a_call_of_the_place_it_says_it_cannot_tell():
    """The watchdog can halt the ranks one call after they part (a beat right then): a skip and a wrong call look
    alike from one call, so the message says what each rank made and that it cannot tell which fault it was."""
    ref, bad = alternating(40), alternating(40, skip=21)
    for n0, n1 in ((21, 21), (22, 21), (21, 22)):
        f = divergence.analyze({0: entries(ref[:n0]), 1: entries(bad[:n1])}, 10, NAMES)
        assert f.call == 21 and f.out == [1]
        assert f.how[1] == ("made 'L2' call 11 where rank 0 made 'L1' call 11 (too few calls were made after it to "
                            "tell a call left out, one made too many and a different one apart)"), (n0, n1)
    f = divergence.analyze({0: entries(ref[:23]), 1: entries(bad[:22])}, 10, NAMES)  # two each: told
    assert f.how[1].startswith("left out 'L1' call 11")

def test_one_layer_a_left_out_call_and_the_majority_of_three():
    one = [L1] * 30
    f = divergence.analyze({0: entries(one), 1: entries(one), 2: entries([L1] * 10 + [L2] + [L1] * 19)}, 0, NAMES)
    assert f.call == 11 and f.out == [2] and f.ref_rank == 0
    # one layer's call replaced by another's reads as that call inserted (the last one is still to come)
    assert f.how[2] == "made 'L2' call 1 one time too many: its calls from there on are rank 0's, one late"
    f = divergence.analyze({0: entries(one), 1: entries([L1] * 10 + [L2, L2] + [L1] * 18)}, 0, NAMES)
    assert f.how[1] == "made 'L2' call 1 where rank 0 made 'L1' call 11"
    skipped = [L1] * 10 + [L2] + [L1] * 19
    f = divergence.analyze({0: entries(skipped), 1: entries(skipped[:10] + skipped[11:])}, 0, NAMES)
    assert f.call == 11 and "left out 'L2' call 1" in f.how[1] and "one time too many" not in f.how[1]


# -- the in-band check and the refusal of later calls ----------------------------------------------------------
def test_in_band_raises_on_every_mismatch_and_refuses_later_calls():
    lg = log()
    w = wd_watches.Watch("L1", moe_ep.core.watchdog.Bound(30.0, "test"), [0, 1], 0, "cpu",
                         monitor=monitor.Monitor(threads=False), log=lg, code=L1)
    lg.names[L1] = "L1"
    assert lg.fingerprint() == (0, 0, 0)  # nothing in progress
    slot = w.begin()
    mine = lg.fingerprint()
    assert mine == (L1, 1, 1)
    divergence.in_band(lg, mine, [list(mine), list(mine)])  # in step
    divergence.in_band(lg, (0, 0, 0), [[0, 0, 0], [0, 0, 0]])  # a layer that logs nothing, on every rank
    assert lg.diverged is None
    with pytest.raises(moe_ep.RankDivergenceError) as e:
        divergence.in_band(lg, mine, [list(mine), [L2, 1, 1]])
    err = e.value
    assert err.ranks == (1,) and err.call == 1 and set(err.layers) == {"L1", "L2"}
    assert "rank 1 is in 'L2' call 1 (group call 1)" in str(err) and isinstance(err, moe_ep.ProcessGroupError)
    w.abandon(slot)
    started = w.started
    with pytest.raises(moe_ep.RankDivergenceError) as again:  # the next call of the group: refused, not counted
        w.begin()
    assert again.value is not err and str(again.value) == str(err) and w.started == started
    with pytest.raises(moe_ep.RankDivergenceError):
        with w:
            pass


def test_a_fingerprint_against_a_layer_that_logs_nothing_is_out_of_step():
    # With unwatched calls logged too (#31), zeros come only from a layer built with the sequence check off on every
    # rank: zeros meeting a fingerprint are two ranks in different layers.
    lg = log()
    lg.names[L1] = "L1"
    with pytest.raises(moe_ep.RankDivergenceError) as e:
        divergence.in_band(lg, (L1, 3, 7), [[L1, 3, 7], [0, 0, 0]])
    assert e.value.ranks == (1,) and "a layer with its sequence check off" in str(e.value)
    assert lg.diverged is not None


def test_a_layer_caller_logs_and_clears_its_fingerprint():
    lg = log()
    a, b = sequence.Caller(lg, L1), sequence.Caller(lg, L2)
    assert lg.open == 2 and lg.live
    a.enter()
    assert lg.fingerprint() == (L1, 1, 1)
    a.leave()
    b.enter()
    assert lg.fingerprint() == (L2, 1, 2)
    b.leave()
    assert lg.fingerprint() == (0, 0, 0) and lg.entries(1, 9) == (1, [L1, L2], [1, 1])
    lg.mark(moe_ep.RankDivergenceError(None, "out of step", ranks=(1,)))
    with pytest.raises(moe_ep.RankDivergenceError):
        a.enter()
    assert a.calls == 1 and lg.seq == 2  # refused, not logged
    a.close(), b.close(), a.close()
    assert lg.open == 0 and not lg.live


def test_watch_begin_logs_every_collective_call_nested_or_not():
    lg = log()
    m = monitor.Monitor(threads=False)
    outer = wd_watches.Watch("graph", moe_ep.core.watchdog.Bound(30.0, "t"), [0, 1], 0, "cpu", monitor=m, log=lg,
                             code=3)
    inner = wd_watches.Watch("L1", moe_ep.core.watchdog.Bound(30.0, "t"), [0, 1], 0, "cpu", monitor=m, log=lg,
                             code=L1)
    with outer:
        with inner:  # nested: not watched (the outer covers it), still in the group's sequence
            assert lg.fingerprint() == (L1, 1, 2)
        assert lg.fingerprint() == (0, 0, 0)  # the newest call returned
    assert lg.entries(1, 9) == (1, [3, L1], [1, 1])


def test_identities_follow_creation_order_with_the_watchdog_off_too(monkeypatch):
    # a pretend group of two (no process group here): layers take even identities, collective watches odd ones
    monkeypatch.setattr(sequence, "group_ranks", lambda group: ([0, 1], 0))
    monkeypatch.setattr(sequence, "group_key", lambda group, ranks: "identities:0,1")
    _, a, lg = wd_watches.layer_identity("A", None)
    _, b, _ = wd_watches.layer_identity("B", None)  # whatever its watchdog: the identity is taken
    _, c, _ = wd_watches.layer_identity("C", None)
    g = moe_ep.watch("graph", collective=True, device="cpu", timeout_s=30)
    plain = moe_ep.watch("plain", device="cpu", timeout_s=30)
    assert wd_watches.layer_watch("B", None, None, "cpu") is None  # the timer off: no Watch
    assert (a, b, c, g.code, plain.code) == (2, 4, 6, 3, 0)
    assert g._log is lg and plain._log is None and lg.names[4] == "B"
    layers = [sequence.Caller(lg, code) for code in (a, b, c)]
    for w in layers + [g, plain]:
        w.close()
    assert lg.open == 0 and not lg.live  # nothing open: neither published nor compared


def test_a_trip_finds_a_peer_out_of_step_in_its_heartbeat(monkeypatch):
    from moe_ep.core.watchdog import alarm

    mine = log(alternating(60))
    mine.key, mine.open = "trip:0,1", 1
    monkeypatch.setitem(sequence._logs, mine.key, mine)
    published = alarm.checkpoints()[mine.key]
    assert published["n"] == 60 and not published["lost"] and dict(published["cp"]) == mine.digest()
    same = {"seq": {mine.key: published}}
    peer = log(alternating(60, skip=41))
    other = {"seq": {mine.key: {"n": peer.seq, "cp": sorted(peer.digest().items()), "lost": None}}}
    assert alarm.out_of_step({1: (same, same)}) == (None, None)
    lg, raised = alarm.out_of_step({1: (other, other)})
    assert lg is mine and (raised["by"], raised["peer"], raised["s0"], raised["s1"]) == (0, 1, 40, 41)
    mine.open = 0  # a group none is open on is not compared
    assert alarm.out_of_step({1: (other, other)}) == (None, None) and mine.key not in alarm.checkpoints()


# -- a lost peer ---------------------------------------------------------------------------------------------------
def test_a_transport_error_becomes_peer_lost_naming_the_stopped_peer(monkeypatch):
    ctx = moe_ep.RankContext(0, 3, None, torch.device("cpu"), "gloo")
    other = RuntimeError("Expected tensors of the same size")
    assert mdist.peer_lost(ctx, other, "an all_to_all") is other
    monkeypatch.setattr(store, "gone", lambda ranks: ([2], None))
    monkeypatch.setattr(mdist.dist, "get_process_group_ranks", lambda g: [0, 1, 2])
    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:3973. This is "
                        "typically caused by a remote worker crashing.")
    e = mdist.peer_lost(ctx, gloo, "an all_to_all")
    assert isinstance(e, moe_ep.PeerLostError) and isinstance(e, moe_ep.ProcessGroupError) and e.ranks == (2,)
    assert str(e).startswith("rank 2 of the group left it during an all_to_all") and "Connection closed" in e.transport
    monkeypatch.setattr(store, "gone", lambda ranks: ([], "no process group: the peers cannot be read"))
    e = mdist.peer_lost(ctx, RuntimeError("[gloo] Timed out waiting 300000ms for recv operation"), "the agreement")
    assert e.ranks == () and "did not arrive within the process group's timeout during the agreement" in str(e)


def test_all_to_all_rows_carries_a_header():
    with one_rank_gloo_group():
        ctx = moe_ep.RankContext.from_group(None, "cpu")
        rows = [torch.arange(6, dtype=torch.int32).view(3, 2)]
        (got,), counts, headers = mdist.all_to_all_rows(ctx, rows, torch.tensor([3]), header=(7, 8, 9))
        assert torch.equal(got, rows[0]) and counts.tolist() == [3] and headers == [[7, 8, 9]]
        (got,), counts = mdist.all_to_all_rows(ctx, rows, torch.tensor([3]))
        assert torch.equal(got, rows[0])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
