"""Collective autotune over gloo with fake timings: the slowest rank decides, everyone agrees."""
import math
import os

import pytest

import moe_ep
import torch.distributed as dist
import torch.multiprocessing as mp

from shim.common.autotune import NoViableCandidateError, collective_autotune
from tools.launch.launcher import free_port


def _worker(rank, world, port, scenario, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=__import__("datetime").timedelta(seconds=60))
    try:
        cands = ["a", "b", "c", "d"]
        if scenario == "max":
            # 'a' is fastest on rank 0 but slowest on rank 1; 'c' is the best worst case.
            table = {0: {"a": 1, "b": 5, "c": 3, "d": 9}, 1: {"a": 10, "b": 4, "c": 3.5, "d": 2},
                     2: {"a": 1, "b": 6, "c": 2, "d": 12}}
            fn = lambda c: [table[rank][c] * f for f in (0.9, 1.0, 5.0)]  # median ignores the outlier
        elif scenario == "fail":
            def fn(c):
                if c == "c" and rank == 1:
                    raise RuntimeError("does not build here")
                return [{"a": 9, "b": 8, "c": 1, "d": 7}[c]]
        elif scenario == "allfail":
            def fn(c):
                raise RuntimeError("broken")
        elif scenario == "mismatch":
            cands = cands if rank == 0 else ["a", "b", "x", "d"]
            fn = lambda c: [1.0]
        try:
            r = collective_autotune(cands, fn, progress=False)
            q.put((rank, "ok", r.winner, r.scores_us))
        except Exception as e:
            q.put((rank, type(e).__name__, str(e), None))
    finally:
        dist.destroy_process_group()


def _run(scenario, world=3):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, scenario, q)) for r in range(world)]
    for p in procs:
        p.start()
    res = sorted(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return res


def test_argmin_of_rank_max_wins_everywhere():
    res = _run("max")
    assert {r[2] for r in res} == {"c"}
    scores = res[0][3]
    assert scores == [10.0, 6.0, 3.5, 12.0]
    assert all(r[3] == scores for r in res)


def test_candidate_failing_on_one_rank_is_out_everywhere():
    res = _run("fail", world=2)
    assert [r[2] for r in res] == ["d", "d"]
    assert math.isinf(res[0][3][2])


def test_all_failing_is_a_clear_error():
    res = _run("allfail", world=2)
    assert {r[1] for r in res} == {"NoViableCandidateError"}
    assert "broken" in res[0][2]


def test_different_lists_on_ranks_are_refused():
    res = _run("mismatch", world=2)
    assert {r[1] for r in res} == {"CandidateMismatchError"}


def test_single_process_without_group():
    r = collective_autotune([3, 1, 2], lambda c: [c * 10.0, c * 10.0 + 1], progress=False)
    assert r.winner == 1 and r.winner_index == 1 and r.scores_us == [30.5, 10.5, 20.5]
    with pytest.raises(moe_ep.errors.TuningError) as err:
        collective_autotune([], lambda c: [1.0])
    assert err.value.argument == "candidates"
    with pytest.raises(NoViableCandidateError):
        collective_autotune([1], lambda c: [float("nan")], progress=False)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
