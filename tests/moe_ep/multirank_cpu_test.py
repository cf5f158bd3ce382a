"""Multi-rank CPU tests: 4 ranks over gloo through the torch reference backend, each output checked against
the single-process oracle (moe_ep.reference.oracle.check_multirank).

The cases are parametrized by backend, device and world size, so the GPU suites can reuse them
(MOE_EP_TEST_BACKEND / MOE_EP_TEST_DEVICE / MOE_EP_TEST_WORLD_SIZE)."""

import os
import sys
import time
from pathlib import Path

import pytest

from moe_ep.formats import FORMATS
from moe_ep.core.registry import get_entry
from moe_ep.core.spec import MoESpec
from moe_ep.testing.problems import Problem
from tools.launch.launcher import launch, launch_function

BACKEND = os.environ.get("MOE_EP_TEST_BACKEND", "torch_reference")
DEVICE = os.environ.get("MOE_EP_TEST_DEVICE", "cpu")
WORLD = int(os.environ.get("MOE_EP_TEST_WORLD_SIZE", "4"))
RANK_CASES = str(Path(__file__).resolve().with_name("rank_cases.py"))
GEOM = dict(hidden_size=256, intermediate_size=128, num_experts=8, top_k=4)


def _case(name, **kw):
    c = dict(GEOM, name=name, backend=BACKEND)
    c.update(kw)
    return c


ALL_CASES = [_case(f"balanced_T37_{f}", tokens=37, fmt=f) for f in FORMATS] + [
    _case("uniform_T64_bf16", tokens=64, routing="uniform", fmt="bf16"),
    _case("skewed_fp8_block", tokens=40, routing="skewed", hot_rank=1, fmt="fp8_block"),
    _case("skewed_nvfp4", tokens=40, routing="skewed", hot_rank=3, fmt="nvfp4"),
    _case("no_local_bf16", tokens=33, routing="no_local", fmt="bf16"),
    _case("no_local_mxfp8", tokens=33, routing="no_local", fmt="mxfp8"),
    _case("T1_fp8_block", tokens=1, routing="uniform", fmt="fp8_block"),
    _case("T1_bf16", tokens=1, fmt="bf16"),
    _case("mixed_T_bf16", tokens=[37, 1, 0, 64][:WORLD] + [5] * max(0, WORLD - 4), capacity=64,
          routing="uniform", fmt="bf16"),
    _case("all_T0_fp8_tensor", tokens=0, capacity=4, fmt="fp8_tensor"),
    _case("clamp_fp8_block", tokens=29, routing="uniform", fmt="fp8_block", gate_up_clamp=0.5),
    _case("unweighted_fc2_bf16", tokens=29, fmt="bf16", backend_options={"apply_topk_in_fc1": False}),
    _case("unweighted_fc2_mxfp8", tokens=29, fmt="mxfp8", backend_options={"apply_topk_in_fc1": False}),
    _case("wide_topk_fp8_block", tokens=19, routing="uniform", fmt="fp8_block", num_experts=16, top_k=6),
    # -1 slots (engines pad with them, load balancers mask with them); every fifth row entirely -1
    _case("masked_fp8_block", tokens=31, routing="masked", fmt="fp8_block"),
    _case("masked_mixed_T_nvfp4", tokens=[20, 0, 7, 41][:WORLD] + [3] * max(0, WORLD - 4), capacity=48,
          routing="masked", fmt="nvfp4"),
]
# A kernel backend runs the cases of the formats it serves.
CASES = [c for c in ALL_CASES if c["fmt"] in get_entry(BACKEND).formats]


@pytest.fixture(scope="module")
def results():
    cases = [dict(c) for c in CASES]
    per_rank = launch_function("moe_ep.testing.scenario:run_cases", WORLD, {"cases": cases}, device=DEVICE,
                               timeout_s=900)
    return {c["name"]: [per_rank[r][i] for r in range(WORLD)] for i, c in enumerate(CASES)}


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_case_matches_oracle(results, case):
    ranks = results[case["name"]]
    errors = [r.get("error") for r in ranks if r.get("error")]
    assert not errors, errors
    tokens = case["tokens"] if isinstance(case["tokens"], list) else [case["tokens"]] * WORLD
    assert [r["tokens"] for r in ranks] == tokens
    assert all(r["backend"] == BACKEND and r["fmt"] == case["fmt"] for r in ranks)
    for r in ranks:
        assert r["ok"] and not r["problems"], r
        assert r["max_row_rel_err"] <= r["tolerance"]
        assert r["failing"] == []


def _pairs_by_rank(case):
    spec = MoESpec(case["hidden_size"], case["intermediate_size"], case["num_experts"], case["top_k"], 64)
    p = Problem.build(spec, WORLD, case["tokens"], case.get("routing", "balanced"), hot_rank=case.get("hot_rank", 0))
    e_local = spec.num_experts // WORLD
    counts = []
    for r in range(WORLD):
        _, idx, _ = p.inputs(r)
        dest = (idx // e_local).flatten()
        counts.append([int((dest == d).sum()) for d in range(WORLD)])
    return counts


def test_routings_are_what_they_claim():
    by_name = {c["name"]: c for c in ALL_CASES}
    skew = _pairs_by_rank(by_name["skewed_fp8_block"])
    received = [sum(c[d] for c in skew) for d in range(WORLD)]
    # the hot rank's experts take every slot they can (E_local of K per hot token)
    assert received[1] > 2 * max(received[d] for d in range(WORLD) if d != 1), received
    no_local = _pairs_by_rank(by_name["no_local_bf16"])
    assert all(no_local[r][r] == 0 for r in range(WORLD)) and all(sum(c) > 0 for c in no_local)
    masked = Problem.build(MoESpec(1024, 256, 32, 8, 64), WORLD, 31, "masked")
    _, idx, _ = masked.inputs(0)
    assert (idx == -1).any(dim=1).float().mean() > 0.5 and (idx == -1).all(dim=1)[::5].all()
    assert ((idx >= 0) | (idx == -1)).all() and (idx >= 0).any()
    bal = _pairs_by_rank(by_name["balanced_T37_bf16"])
    totals = [sum(bal[s][d] for s in range(WORLD)) for d in range(WORLD)]
    assert max(totals) - min(totals) <= 2 * WORLD


@pytest.mark.skipif(BACKEND != "torch_reference", reason="the faulty backends subclass the reference")
def test_oracle_catches_wrong_backends_that_agree_with_themselves():
    per_rank = launch_function(f"{RANK_CASES}:faulty", WORLD, device=DEVICE, timeout_s=600)
    for r, rec in enumerate(per_rank):
        assert rec["torch_reference"] == {"ok": True, "deterministic": True}
        for name, failing in (("t_lying", {1}), ("t_honest_wrong", {2}), ("t_misrouting", None)):
            err = rec[name].get("error")
            assert rec[name]["deterministic"]
            assert err and err["type"] == "OracleMismatchError", (r, name, rec[name])
            assert "disagrees with the torch oracle" in err["message"]
        # the self-consistent wrong weights are caught by the weight check on the rank that holds them
        assert "reported weights differ" in rec["t_honest_wrong"]["error"]["message"]


@pytest.fixture(scope="module")
def bad_records():
    return launch_function(f"{RANK_CASES}:bad_inputs", WORLD, {"bad_rank": 2}, device=DEVICE, timeout_s=600)


EXPECTED_FORWARD = {
    "dtype": ("DTypeError", "hidden"), "shape": ("ShapeError", "hidden"), "topk": ("TopKMismatchError", "topk_idx"),
    "device": ("DeviceError", "topk_idx"), "noncontig": ("NonContiguousError", "hidden"),
    "negative_id": ("ExpertIndexError", "topk_idx"), "id_out_of_range": ("ExpertIndexError", "topk_idx"),
    "over_capacity": ("CapacityError", "hidden"), "out_dtype": ("DTypeError", "out"),
}


@pytest.mark.parametrize("kind", sorted(EXPECTED_FORWARD))
def test_bad_input_on_one_rank_raises_everywhere(bad_records, kind):
    etype, argument = EXPECTED_FORWARD[kind]
    for r, rec in enumerate(bad_records):
        err = rec[kind]["error"]
        assert err is not None, (r, kind)
        if r == 2:
            assert (err["type"], err["argument"]) == (etype, argument)
        else:
            assert err["type"] == "PeerValidationError" and err["ranks"] == [2]
            assert err["argument"] == argument and "rank(s) [2]" in err["message"]
        assert rec[kind]["seconds"] < 30  # an agreement, not a timeout
        assert rec[kind]["recovered"]


@pytest.fixture(scope="module")
def default_records():
    return launch_function(f"{RANK_CASES}:bad_inputs_default_checks", WORLD, {"bad_rank": 2}, device=DEVICE,
                           timeout_s=600)


def test_first_call_is_agreed_under_the_default_checks(default_records):
    for r, rec in enumerate(default_records):
        err = rec["first_call"]["error"]
        assert err is not None
        assert (err["type"], err["argument"]) == (("ExpertIndexError", "topk_idx") if r == 2 else
                                                  ("PeerValidationError", "topk_idx"))


@pytest.mark.parametrize("kind", sorted(EXPECTED_FORWARD))
def test_bad_input_later_raises_on_its_rank_and_the_peers_stay_right(default_records, kind):
    etype, argument = EXPECTED_FORWARD[kind]
    for r, rec in enumerate(default_records):
        got = rec[kind]
        assert got["seconds"] < 30  # nobody waited for a peer that never came
        if r == 2:
            assert (got["error"]["type"], got["error"]["argument"]) == (etype, argument)
            assert got["tokens"] == 0
        else:
            assert got["error"] is None, (r, got)
            assert got["oracle_ok"] and got["tokens"] == [24, 5, 17, 0][r], (r, got)


def test_bad_layer_arguments_are_collective(bad_records):
    for r, rec in enumerate(bad_records):
        wr = rec["wrong_rank_weights"]["error"]
        assert (wr["type"], wr["argument"]) == (("WeightsRankError", "weights") if r == 1 else
                                                ("PeerValidationError", "weights"))
        mc = rec["missing_calibration"]["error"]
        assert (mc["type"], mc["argument"]) == (("CalibrationError", "weights.act_amax") if r == 3 else
                                                ("PeerValidationError", "weights.act_amax"))
        wd = rec["world_does_not_divide"]["error"]
        assert (wd["type"], wd["argument"]) == ("WorldSizeError", "world_size")
        fe = rec["foreign_error"]["error"]
        if r == 0:
            assert fe["type"] == "RuntimeError" and "device properties" in fe["message"]
        else:
            assert fe["type"] == "PeerValidationError" and fe["ranks"] == [0] and "device properties" in fe["message"]
        wwd = rec["weights_world_does_not_divide"]["error"]
        assert (wwd["type"], wwd["argument"]) == ("WorldSizeError", "weights.world_size")


def test_a_missing_peer_does_not_hang_the_others():
    t0 = time.monotonic()
    from tools.launch import worker

    import json
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        spec = Path(d) / "call.json"
        spec.write_text(json.dumps({"target": f"{RANK_CASES}:absent_peer", "kwargs": {}, "result_dir": d}))
        # A long grace period: the ranks must leave on their own (peer gone / group timeout), not be killed.
        results = launch([worker.__file__, str(spec)], WORLD, device=DEVICE, pg_timeout_s=10, grace_s=120,
                         timeout_s=300)
    elapsed = time.monotonic() - t0
    assert elapsed < 120
    assert results[1].returncode == 1 and "SystemExit: 3" in results[1].output
    for r in results:
        assert r.returncode is not None and r.returncode != 0, r  # exited by itself, with an error
        if r.rank != 1:
            assert "forward left after" in r.output, r.output[-2000:]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
