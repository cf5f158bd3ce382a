"""EPLB across ranks (docs/eplb.md): logical ids mapped to replica slots on the device, physical slot ids, the
deterministic replica rule, load counters, in-place swaps (weights copied from holders, given in bf16, given
quantized), weight updates, and refusals that change nothing. Every output is checked against the oracle's logical
model; a swapped layer must hold the bytes of a layer freshly built with the new placement.

CPU: gloo ranks through the torch reference backend at world sizes 2 and 3. The same cases run the Hopper kernels:
    MOE_EP_TEST_BACKEND=sm90_fp8_cutedsl MOE_EP_TEST_DEVICE=cuda MOE_EP_TEST_WORLD_SIZES=1 python -m pytest <this file>
(there a CUDA graph captured before the swaps replays the map and the counters, and reads the swapped experts).
"""
import os
import sys
from pathlib import Path

import pytest

from moe_ep.core.registry import get_entry
from tools.launch.launcher import launch_function

BACKEND = os.environ.get("MOE_EP_TEST_BACKEND", "torch_reference")
DEVICE = os.environ.get("MOE_EP_TEST_DEVICE", "cpu")
WORLDS = [int(w) for w in os.environ.get("MOE_EP_TEST_WORLD_SIZES", "2,3").split(",")]
FORMATS = {"torch_reference": ["bf16", "fp8_block", "nvfp4"]}.get(BACKEND, list(get_entry(BACKEND).formats))
CASES = str(Path(__file__).resolve().with_name("eplb_cases.py"))
BAD_RANK = 1


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"W{w}")
def suite(request):
    world = request.param
    recs = launch_function(f"{CASES}:suite", world, {"backend": BACKEND, "fmts": FORMATS, "bad_rank": BAD_RANK},
                           device=DEVICE, timeout_s=600)
    return world, recs


@pytest.fixture(params=FORMATS)
def scenario(suite, request):
    world, recs = suite
    return world, request.param, [r["scenario"][request.param] for r in recs]


def test_logical_ids_through_the_map_match_the_logical_model(scenario):
    world, fmt, recs = scenario
    for r in recs:
        assert r["logical"]["ok"], r["logical"]["summary"]
        assert r["deterministic"]
        if world in (1, 2, 4):  # E divides: the same experts without slots give the same outputs
            assert r["vs_plain"]["ok"], r["vs_plain"]


def test_physical_ids_give_what_the_layer_maps_itself(scenario):
    _, _, recs = scenario
    for r in recs:
        assert r["physical"]["ok"], r["physical"]["summary"]
        assert r["physical_equals_logical"]
        assert r["physical_counts"] == r["physical_counts_expected"]


def test_counters_follow_the_replica_rule_and_gather_over_ranks(scenario):
    _, _, recs = scenario
    for r in recs:
        assert r["counts_local"] == r["counts_expected"]  # the documented rule, slot by slot, two calls
        assert r["counts_after_reset"] == [0] * r["num_slots"]
        assert r["counts_gathered"] == [sum(x["counts_expected"][s] for x in recs) for s in range(r["num_slots"])]
    # the rule spreads the hot expert over its replicas, so the hot rank's share is not 1:1 with the hot expert
    assert any(c > 0 for c in recs[0]["counts_expected"])


def test_swaps_keep_the_oracle_and_leave_a_fresh_layers_bytes(scenario):
    world, fmt, recs = scenario
    s_local = recs[0]["num_slots"] // world
    for r in recs:
        for swap in ("swap1", "swap2", "swap3"):
            assert r[swap]["ok"], (swap, r[swap]["summary"])
            assert r[f"{swap}_bytes_equal_fresh"], swap
        assert r["swap1_close_to_before"]  # the same logical model before and after
        assert r["same_addresses"]
        # slots 1, E-1 and the last slot change hands; each rank rewrote exactly its own
        want = sorted(s - r["rank"] * s_local for s in (1, 7, r["num_slots"] - 1) if s // s_local == r["rank"])
        assert sorted(r["swap1_written"]) == want and sorted(r["swap3_written"]) == want
        if "graph_after_swap_equals_eager" in r:
            assert r["graph_counts"] == r["graph_counts_expected"]
            assert r["graph_after_swap_equals_eager"]


def test_a_weight_update_must_reach_every_replica(scenario):
    _, _, recs = scenario
    for r in recs:
        one = r["one_replica_updated"]
        assert not one["ok"] and "differ from their logical expert's first replica" in one["summary"], one
        assert r["all_replicas_updated"]["ok"], r["all_replicas_updated"]["summary"]


EXPECTED = {
    "slot_out_of_range": ("ExpertIndexError", "slots"), "slot_repeated": ("ExpertIndexError", "slots"),
    "weights_shape": ("ShapeError", "weights.w13"), "weights_dtype": ("DTypeError", "weights.w13"),
    "weights_missing": ("DTypeError", "weights"), "weights_not_tensors": ("DTypeError", "weights"),
    "weights_format": ("FormatError", "weights.fmt"), "weights_count": ("ShapeError", "weights.w13"),
    "map_wrong_size": ("ExpertMapError", "expert_map"), "map_wrong_experts": ("ExpertMapError", "expert_map"),
    "map_not_a_map": ("DTypeError", "expert_map"), "forward_logical_id": ("ExpertIndexError", "topk_idx"),
}


def test_refused_calls_raise_typed_errors_and_change_nothing(suite):
    world, recs = suite
    recs = [r["refusals"] for r in recs]
    bad = min(BAD_RANK, world - 1)
    for r in recs:
        for kind, (etype, argument) in EXPECTED.items():
            err = r[kind]["error"]
            assert err is not None, (r["rank"], kind)
            if r["rank"] == bad:
                assert (err["type"], err["argument"]) == (etype, argument), (kind, err)
            else:
                assert err["type"] == "PeerValidationError" and err["ranks"] == [bad], (kind, err)
            assert r[kind]["unchanged"], kind
        if world > 1:
            err = r["maps_differ"]["error"]
            assert (err["type"], err["argument"]) == ("ExpertMapError", "expert_map") and r["maps_differ"]["unchanged"]
        fwd = r["forward_slot_id"]["error"]
        assert fwd["type"] == ("ExpertIndexError" if r["rank"] == bad else "PeerValidationError"), fwd
        assert r["counts_unchanged"]
        assert r["still_serves"]["ok"], r["still_serves"]["summary"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
