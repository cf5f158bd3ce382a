"""The knob model (shim/sm90/knob_model.py): what it reads from the shipped table, how it chooses and where it
stands in the resolution order (knob_model_compile_test: what it chooses compiles)."""

import pytest

import moe_ep
from shim.sm90 import knob_model as km

H200 = "NVIDIA H200"


def _knobs(swap, tile, cluster, pingpong=False, group_hint=264):
    return dict(swap_ab=swap, mma_tiler_mnk=list(tile), cluster_shape_mnk=list(cluster), pingpong=pingpong,
                accum_mode="1xacc", token_back_mode="epi_warps", fc2_in_kernel_topk_reduce=False,
                load_balance_mode="static", tail_split_pairs=False, group_hint=group_hint, flag_batch=1,
                epi_flag_batch=1, kernel="Sm90MegaMoEFp8Kernel")


SMALL = _knobs(True, (256, 16, 128), (2, 1, 1))    # won at 8 tokens per expert
MID = _knobs(False, (64, 128, 128), (1, 2, 1), True)  # won at 32
BIG = _knobs(False, (64, 256, 128), (2, 1, 1))    # won at 128


def _entries():
    geo = "sm90/fp8_block/H7168/I2048/E32/K8/W1"
    return {f"{geo}/C{c}/dev=NVIDIA_H200/drop=a051a62e09a2738e": {"knobs": k, "meta": {}}
            for c, k in ((32, SMALL), (128, MID), (512, BIG))}


def test_keys_parse_into_geometries():
    arch, g, dev, drop = km.parse_key("sm90/fp8_block/H4096/I1536/E16/K8/W8/C128/dev=NVIDIA_H200/drop=a051a62e09a2738e")
    assert (arch, dev, drop) == ("sm90", "NVIDIA_H200", "a051a62e09a2738e")
    assert g == km.Geometry("fp8_block", 4096, 1536, 16, 8, 8, 128) and g.tokens_per_expert == 64
    assert km.parse_key("sm90/fp8_block/H4096/I1536/E16/K8/W8/C128")[1] == g  # a knob-cache key
    assert km.parse_key("not a key") is None


def test_entries_of_another_gpu_or_drop_are_not_read():
    entries = _entries()
    assert len(km.measured_entries(entries, device=H200, drop_sha256="a051a62e09a2738e" + "0" * 48)) == 3
    assert km.measured_entries(entries, device="NVIDIA H100 80GB HBM3", drop_sha256=None) == []
    assert km.measured_entries(entries, device=H200, drop_sha256="bfdc18b9e1e4d8d0") == []
    assert km.measured_entries(entries, arch="sm100") == []


@pytest.mark.parametrize("experts, capacity, want", [
    (48, 128, MID),    # 21 tokens per expert: nearest the 32-token winner
    (32, 64, MID),     # 16: between 8 and 32; the 64-token tile fits 2 x 16 better than 16 x 2
    (64, 32, SMALL),   # 4
    (16, 512, BIG),    # 256
])
def test_the_choice_follows_tokens_per_expert(experts, capacity, want):
    measured = km.measured_entries(_entries())
    knobs, why = km.choose(km.Geometry("fp8_block", 7168, 2048, experts, 8, 1, capacity), measured)
    assert knobs == want, why
    assert "tokens per expert" in why


def test_a_set_the_kernel_rejects_is_passed_over():
    measured = km.measured_entries(_entries())
    g = km.Geometry("fp8_block", 7168, 2048, 48, 8, 1, 128)
    knobs, _ = km.choose(g, measured, accepts=lambda k: k != MID)
    assert knobs != MID and knobs in (SMALL, BIG)
    assert km.choose(g, measured, accepts=lambda k: False) is None


def test_no_choice_without_a_measured_entry_near_enough():
    measured = km.measured_entries(_entries())
    assert km.choose(km.Geometry("fp8_block", 7168, 2048, 256, 8, 1, 8), measured) is None  # 0.25 tokens: 32x off
    assert km.choose(km.Geometry("bf16", 7168, 2048, 48, 8, 1, 128), measured) is None  # no bf16 entry


def test_the_model_comes_after_the_table_and_before_the_heuristic(sm90_tree):
    from shim.common.knob_cache import KnobCache
    from shim.sm90.knobs import Sm90Knobs, resolve_knobs

    empty = KnobCache("")

    def resolve(knobs=None, shipped=None, model=None):
        return resolve_knobs(knobs, fmt="fp8_block", max_tokens_per_rank=128, cache_key="k", cache=empty,
                             shipped=lambda: shipped, model=lambda: model)

    assert resolve(model=MID) == (Sm90Knobs.from_json(MID), "model")
    assert resolve(shipped=BIG, model=MID) == (Sm90Knobs.from_json(BIG), "table")
    assert resolve(knobs=dict(group_hint=66), model=MID)[1] == "explicit"
    assert resolve()[1] == "heuristic"


def test_no_gpu_no_model():
    class Backend:  # what for_backend reads of a layer's backend
        ctx = moe_ep.RankContext.detached()

    assert km.for_backend(Backend()) is None


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
