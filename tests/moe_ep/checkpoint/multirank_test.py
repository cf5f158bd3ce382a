"""The loader at world size 2 (two CPU ranks over gloo, tools/launch): each rank reads only its own experts of
every convention's synthetic checkpoint, and each rank's layer is checked as at world size 1 (ranks.run): oracle
weights against the checkpoint's dequantized values, output against the multi-rank oracle and plain torch."""

import pytest

from tests.moe_ep.checkpoint import synth
from tests.moe_ep.checkpoint.loader_test import CASES, _id
from tools.launch.launcher import launch_function

WORLD = 2


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    cases = []
    for n, (conv, kw, fmt, inexact, _) in enumerate(CASES):
        d = tmp_path_factory.mktemp(f"case{n}")
        synth.write(d, conv, seed=n, **kw)
        cases.append(dict(path=str(d), synth_convention=conv, fmt=fmt, allow_inexact=inexact, seed=n))
    per_rank = launch_function("tests.moe_ep.checkpoint.ranks:run_all", WORLD, {"cases": cases}, timeout_s=600)
    return {_id(c): [per_rank[r][n] for r in range(WORLD)] for n, c in enumerate(CASES)}


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_world_size_two(results, case):
    conv, kw, fmt, inexact, exact = case
    for rank, r in enumerate(results[_id(case)]):
        w = r["weights"]
        assert r["world"] == WORLD and w["offset"] == 2 * rank and w["experts"] == 2  # this rank's experts only
        if exact is True:
            assert w["equal"] and w["changed"] == 0, w
        elif exact == "ulp":
            assert w["within_ulp"], w
        else:
            assert not w["equal"] and w["changed"] > 0, w
        assert r["nan"] == 0 and r["oracle_ok"], r["oracle"]
        assert r["plain_err"] <= r["plain_tol"], r


def test_a_rank_that_cannot_read_its_experts_stops_every_rank(tmp_path):
    name = "model.layers.1.mlp.experts.3.down_proj.weight"  # rank 1's expert
    synth.write(tmp_path, "hf_bf16", drop=[name])
    per_rank = launch_function("tests.moe_ep.checkpoint.ranks:load_error", WORLD, {"path": str(tmp_path)},
                               timeout_s=300)
    assert per_rank[1]["type"] == "CheckpointError" and per_rank[1]["argument"] == name
    assert per_rank[1]["file"].endswith(".safetensors")
    assert per_rank[0]["type"] == "PeerValidationError" and per_rank[0]["ranks"] == [1]


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
