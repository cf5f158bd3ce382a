"""tools/tune's world-size-1 search on CPU: the kernel's constructor answers the build checks as on the GPU host, a
fake worker stands in for compile-and-time (times from a made-up cost of the knobs, one candidate failing the
oracle). What the stages try, in what order the keys' jobs go, what is written, what a budget cut leaves, and that a
rerun goes on where the last one stopped."""

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tools.tune import tune


def _cost(knobs) -> float:
    """A made-up time: token tiles far from 16 rows cost more, the compact pull buffer and two dispatch warps help,
    group_hint 66 helps a little; dedup is the fastest of all but fails the oracle."""
    from shim.sm90.knobs import Sm90Knobs

    k = Sm90Knobs.from_json(knobs)
    span = k.token_tile * k.token_cluster
    us = 100.0 * (1 + abs(span - 16) / 64)
    if k.compact_pull_buffer:
        us *= 0.9
    if k.active_dispatch_warps == 2:
        us *= 0.93
    if k.group_hint == 66:
        us *= 0.97
    if k.dedup_dispatch:
        us *= 0.5
    return us


class FakeWorkers:
    """run_job's contract: time a candidate; one faster than its key's checked best so far is checked against the
    oracle and becomes the best only if it passes."""

    def __init__(self, delay: float = 0.0):
        self.delay = delay
        self.best = {}
        self.order = []
        self.lock = threading.Lock()

    def __call__(self, job):
        from shim.sm90.knobs import Sm90Knobs

        with self.lock:
            self.order.append(job["slot"])
        time.sleep(self.delay)
        us = _cost(job["knobs"])
        out = dict(job, ok=True, us=us, cut=False, seconds=self.delay)
        with self.lock:
            if us < self.best.get(job["slot"], float("inf")):
                ok = not Sm90Knobs.from_json(job["knobs"]).dedup_dispatch
                out.update(validated=True, oracle_ok=ok, oracle_rel_l2=0.009, oracle_problems=[] if ok else ["row 3"])
                if ok:
                    self.best[job["slot"]] = us
        return out


def _args(tmp_path, *extra):
    return tune.parser().parse_args(["--models", "small", "--fmt", "w4a8_mxfp4", "fp8_tensor", "--capacities", "8",
                                     "128", "--table", str(tmp_path / "t.json"), "--workers", "1", "--active-keys",
                                     "2", "--stage1", "4", "--stage2", "3", "--stage3", "6", "--stage4", "2",
                                     *extra])


def _tune(args, workers):
    return tune.tune_world1(args, device="NVIDIA H200", run=workers,
                            make_pool=lambda n, lock, best: ThreadPoolExecutor(n))


@pytest.fixture(scope="module")
def full_run(sm90_tree, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tune")
    workers = FakeWorkers()
    assert _tune(_args(tmp, "--budget-s", "600"), workers) == 0
    return tmp, workers, json.loads((tmp / "t.json").read_text())["entries"]


def test_every_key_is_written_with_a_checked_winner_the_fastest_that_passed(full_run):
    from shim.sm90.knobs import Sm90Knobs

    _, _, entries = full_run
    assert len(entries) == 4  # small x {w4a8, fp8_tensor} x {8, 128}
    for key, e in entries.items():
        meta, knobs = e["meta"], Sm90Knobs.from_json(e["knobs"])
        assert meta["search"] == tune.SEARCH and meta["complete"] and meta["oracle_rel_l2"] == 0.009
        assert not knobs.dedup_dispatch, key  # the fastest candidate failed its oracle check: never written
        assert meta["tuned_us"] == pytest.approx(_cost(e["knobs"]), abs=0.1)
        assert set(meta["stage_best_us"]) == set(tune.STAGES)
        # Each stage starts from the last one's best, so its best is no worse.
        stages = [meta["stage_best_us"][s] for s in tune.STAGES]
        assert stages == sorted(stages, reverse=True)
        assert len(meta["runners_up"]) == len(meta["runners_up_us"]) == 3
        assert meta["runners_up_us"] == sorted(meta["runners_up_us"]) and meta["runners_up_us"][0] >= meta["tuned_us"]
        assert meta["heuristic_us"] is not None and meta["candidates"] >= 8


def test_the_exchange_stage_finds_the_exchange_knobs_that_help(full_run):
    from shim.sm90.knobs import Sm90Knobs

    _, _, entries = full_run
    for key, e in entries.items():
        k = Sm90Knobs.from_json(e["knobs"])
        # Both helpful exchange changes are found and combined; W4A8's pull buffer is not compact by default.
        assert k.active_dispatch_warps == 2, key
        if "/w4a8_mxfp4/" in key:
            assert k.compact_pull_buffer is True, key


def test_the_first_keys_jobs_go_first(full_run):
    _, workers, _ = full_run
    order = workers.order
    # Two keys at a time, one worker: key 0's jobs never wait behind a later key's (slot numbers rise).
    firsts = [order.index(s) for s in sorted(set(order))]
    assert firsts == sorted(firsts)
    lasts = [len(order) - 1 - order[::-1].index(s) for s in sorted(set(order))]
    assert lasts == sorted(lasts)


def test_a_budget_cut_writes_what_was_checked_and_a_rerun_goes_on(sm90_tree, tmp_path, capsys):
    slow = FakeWorkers(delay=0.05)
    assert _tune(_args(tmp_path, "--budget-s", "0.6", "--grace-s", "5"), slow) == 0
    out = capsys.readouterr().out
    entries = json.loads((tmp_path / "t.json").read_text())["entries"]
    partial = {k for k, e in entries.items() if not e["meta"]["complete"]}
    assert entries and partial, out  # the budget stopped a search; what it had checked is written
    assert "cut short by the budget" in out
    for e in entries.values():
        assert e["meta"]["tuned_us"] == pytest.approx(_cost(e["knobs"]), abs=0.1)
    # The rerun skips none of the cut keys and every complete one.
    again = FakeWorkers()
    assert _tune(_args(tmp_path, "--budget-s", "600"), again) == 0
    out = capsys.readouterr().out
    complete = {k for k, e in entries.items() if e["meta"]["complete"]}
    assert out.count("skipped") == len(complete)
    after = json.loads((tmp_path / "t.json").read_text())["entries"]
    assert len(after) == 4 and all(e["meta"]["complete"] for e in after.values())


def test_a_key_whose_every_checked_candidate_fails_is_not_written(sm90_tree, tmp_path, capsys):
    class AllFail(FakeWorkers):
        def __call__(self, job):
            out = super().__call__(job)
            if out.get("validated"):
                out.update(oracle_ok=False, oracle_problems=["row 0"])
            return out

    assert _tune(_args(tmp_path, "--budget-s", "600"), AllFail()) == 0
    assert not (tmp_path / "t.json").exists()
    out = capsys.readouterr().out
    assert out.count("nothing written (its fastest failed the oracle: ['row 0'])") == 4, out


def test_the_dry_run_plans_the_preset_in_its_order(sm90_tree, capsys):
    assert tune.main(["--preset", "issue35", "--dry-run", "--stage1", "2", "--stage2", "1", "--stage3", "2",
                      "--stage4", "1", "--table", "/nonexistent/t.json"]) == 0
    out = capsys.readouterr().out
    labels = [line.split()[0] for line in out.splitlines() if line.startswith("  ") and "candidates per stage" in line]
    assert labels == [f"{m}/{f}/C{c}" for m, f, c in tune.PRESETS["issue35"]]
    assert "s each (round 3 on the H200 host" in out


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
