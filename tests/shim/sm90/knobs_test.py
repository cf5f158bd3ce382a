"""Knob resolution: explicit > persistent cache > the drop's heuristic; invalid sets fail before compiling."""
import json

import pytest

import moe_ep
from shim.common.knob_cache import KnobCache, cache_key

pytestmark = pytest.mark.usefixtures("sm90_tree")


def _key(**kw):
    base = dict(arch="sm90", fmt="fp8_block", hidden=7168, intermediate=2048, experts_per_rank=32, top_k=8,
                world_size=1, max_tokens_per_rank=128)
    base.update(kw)
    return cache_key(**base)


def test_cache_round_trip_and_keys_separate_everything(tmp_path):
    c = KnobCache(str(tmp_path / "k.json"))
    assert c.get(_key()) is None
    c.put(_key(), {"group_hint": 132}, meta={"us": 12.5})
    assert c.get(_key()) == {"group_hint": 132}
    for other in (dict(max_tokens_per_rank=256), dict(world_size=4), dict(fmt="fp8_tensor"), dict(hidden=4096),
                  dict(intermediate=1024), dict(experts_per_rank=16), dict(top_k=6), dict(arch="sm100")):
        assert _key(**other) != _key()
        assert c.get(_key(**other)) is None
    # a second process (a fresh object on the same file) sees it
    assert KnobCache(str(tmp_path / "k.json")).get(_key()) == {"group_hint": 132}


def test_env_var_names_the_file(tmp_path, monkeypatch):
    path = tmp_path / "env.json"
    monkeypatch.setenv("MOE_EP_KNOB_CACHE", str(path))
    KnobCache().put("k", {"flag_batch": 2})
    assert json.loads(path.read_text())["entries"]["k"]["knobs"] == {"flag_batch": 2}


def test_corrupt_cache_is_an_error_not_a_silent_default(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"version": 99, "entries": {}}))
    with pytest.raises(moe_ep.errors.KnobError, match="not a version-1") as e:
        KnobCache(str(path)).get("k")
    assert e.value.argument == "MOE_EP_KNOB_CACHE"


def test_resolution_order(tmp_path):
    from shim.sm90.knobs import Sm90Knobs, heuristic_knobs, resolve_knobs

    cache = KnobCache(str(tmp_path / "k.json"))
    heur = heuristic_knobs("fp8_block", 128)
    k, src = resolve_knobs(None, fmt="fp8_block", max_tokens_per_rank=128, cache_key=_key(), cache=cache)
    assert (k, src) == (heur, "heuristic")
    tuned = heur.replace(group_hint=132, flag_batch=2)
    cache.put(_key(), tuned.to_json())
    k, src = resolve_knobs(None, fmt="fp8_block", max_tokens_per_rank=128, cache_key=_key(), cache=cache)
    assert (k, src) == (tuned, "cache")
    k, src = resolve_knobs({"flag_batch": 4}, fmt="fp8_block", max_tokens_per_rank=128, cache_key=_key(), cache=cache)
    assert src == "explicit" and k.flag_batch == 4 and k.mma_tiler_mnk == heur.mma_tiler_mnk
    explicit = Sm90Knobs(swap_ab=False, mma_tiler_mnk=(64, 256, 128), cluster_shape_mnk=(1, 1, 1))
    assert resolve_knobs(explicit, fmt="fp8_block", max_tokens_per_rank=128, cache_key=_key(), cache=cache) == (explicit, "explicit")


def test_heuristic_follows_the_drop_table_by_capacity():
    from shim.sm90 import kernel_symbols as ks
    from shim.sm90.knobs import heuristic_knobs

    for cap in (1, 8, 100, 128, 4096, 5000):
        row = ks.HEURISTIC_CONFIGS["blockwise"][ks.token_bucket(cap)]
        k = heuristic_knobs("fp8_block", cap)
        assert (k.swap_ab, k.mma_tiler_mnk, k.cluster_shape_mnk, k.pingpong) == (
            row.swap_ab, row.mma_tiler_mnk, row.cluster_shape_mnk, row.pingpong)


def test_per_tensor_follows_the_drops_per_tensor_table():
    from shim.sm90 import kernel_symbols as ks
    from shim.sm90.knobs import heuristic_knobs

    for cap in (1, 128, 4096):
        row = ks.HEURISTIC_CONFIGS["per_tensor"][ks.token_bucket(cap)]
        k = heuristic_knobs("fp8_tensor", cap)
        assert (k.swap_ab, k.mma_tiler_mnk, k.kernel) == (row.swap_ab, row.mma_tiler_mnk, "Sm90MegaMoEFp8Kernel")


def test_w4a8_defaults_are_valid_swap_ab_and_narrow_k_for_the_geometry():
    from shim.sm90.knobs import W4A8_MXFP4_DEFAULTS, heuristic_knobs

    for cap in (1, 8, 9, 100, 256, 700, 2048, 100000):
        k = heuristic_knobs("w4a8_mxfp4", cap)
        assert k.validate() is k and k.swap_ab and k.kernel == "Sm90MegaMoESwapABMxfp4Fp8Kernel"
        bucket = min([b for b in W4A8_MXFP4_DEFAULTS if cap <= b] or [2048])
        assert k.mma_tiler_mnk == W4A8_MXFP4_DEFAULTS[bucket][0]
    # K-256 tiles need H and I multiples of 256 (Qwen3-30B's I = 768 is; an I of 640 is not).
    assert heuristic_knobs("w4a8_mxfp4", 4096, hidden=2048, intermediate=768).mma_tiler_mnk == (256, 64, 256)
    assert heuristic_knobs("w4a8_mxfp4", 4096, hidden=2048, intermediate=640).mma_tiler_mnk == (256, 64, 128)
    assert heuristic_knobs("w4a8_mxfp4", 8, hidden=2944, intermediate=2048).mma_tiler_mnk == (256, 16, 128)


def test_w4a8_stage_one_is_swap_ab_only_and_stage_two_tries_both_load_balance_modes():
    from shim.sm90.tune import scheduling_candidates, structural_candidates

    cands = structural_candidates("w4a8_mxfp4", _spec(512), limit=10)
    assert cands and all(c.swap_ab and c.validate() is c for c in cands)
    assert not any(c.pingpong and c.mma_tiler_mnk[0] != 128 for c in cands)
    modes = {c.load_balance_mode for c in scheduling_candidates(cands[:1], limit=20)}
    assert "atomic_counter" in modes


@pytest.mark.parametrize("bad, knob", [
    ({"token_back_mode": "carrier_pigeon"}, "token_back_mode"),
    ({"mma_tiler_mnk": (96, 128, 128)}, "mma_tiler_mnk"),
    ({"cluster_shape_mnk": (1, 1, 2)}, "cluster_shape_mnk"),
    ({"tail_split_pairs": True, "swap_ab": False, "cluster_shape_mnk": (1, 1, 1)}, "tail_split_pairs"),
    ({"group_hint": -3}, "group_hint"),
    ({"flag_batch": 3}, "flag_batch"),
    ({"warp_speed": 9}, "warp_speed"),
])
def test_invalid_knobs_are_rejected_by_name(bad, knob):
    from shim.sm90.knobs import InvalidKnobsError, resolve_knobs

    with pytest.raises(InvalidKnobsError) as e:
        resolve_knobs(bad, fmt="fp8_block", max_tokens_per_rank=128, cache_key="k", cache=KnobCache(""))
    assert e.value.knob == knob and knob in str(e.value)
    assert isinstance(e.value, moe_ep.errors.KnobError) and e.value.argument == knob


def _spec(capacity, h=7168, i=2048, e=32, k=8):
    return moe_ep.MoESpec(hidden_size=h, intermediate_size=i, num_experts=e, top_k=k, max_tokens_per_rank=capacity)


@pytest.mark.parametrize("fmt", ["fp8_block", "bf16"])
@pytest.mark.parametrize("capacity", [1, 128, 700, 4096])
def test_stage_one_starts_with_the_heuristic_and_is_valid_and_unique(fmt, capacity):
    from shim.sm90.knobs import heuristic_knobs
    from shim.sm90.tune import structural_candidates

    cands = structural_candidates(fmt, _spec(capacity), limit=14)
    assert cands[0] == heuristic_knobs(fmt, capacity)
    assert len(cands) == len(set(cands)) == 14
    for c in cands:
        assert c.validate() is c and c.kernel == cands[0].kernel
    # Both operand orders are searched, and more than one cluster shape.
    assert {c.swap_ab for c in cands} == {False, True}
    assert len({c.cluster_shape_mnk for c in cands}) >= 2


def test_stage_one_ranks_token_tiles_by_fit():
    """At 2 tokens per expert a swap-AB N=8 tile fits; at ~1000 the plain order's 64/128-row tiles do."""
    from shim.sm90.tune import _fit, structural_candidates

    small = structural_candidates("fp8_block", _spec(8), limit=30)
    large = structural_candidates("fp8_block", _spec(4096), limit=30)
    tail = lambda cands, pe: [_fit(c, pe) for c in cands[8:]]  # noqa: E731 (past the table rows and winners)
    assert tail(small, 2) == sorted(tail(small, 2)) and tail(large, 1024) == sorted(tail(large, 1024))
    assert min(c.token_tile for c in small[8:]) == 8


def test_the_build_check_drops_what_the_kernel_refuses():
    rejected = []

    def refuse_pingpong(k):
        rejected.append(k)
        return not k.pingpong

    from shim.sm90.tune import structural_candidates

    cands = structural_candidates("fp8_block", _spec(128), limit=10, accepts=refuse_pingpong)
    assert cands and not any(c.pingpong for c in cands) and any(r.pingpong for r in rejected)


def test_stage_two_changes_one_scheduling_knob_at_a_time():
    from shim.sm90.knobs import CORRECTNESS_KNOBS, heuristic_knobs
    from shim.sm90.tune import scheduling_candidates

    base = heuristic_knobs("fp8_block", 512)
    cands = scheduling_candidates([base], limit=20)
    assert cands and base not in cands
    for c in cands:
        changed = [f for f in ("group_hint", "token_back_mode", "tail_split_pairs", "flag_batch", "epi_flag_batch",
                               "load_balance_mode") if getattr(c, f) != getattr(base, f)]
        assert len(changed) == 1, changed
        assert all(getattr(c, f) == getattr(base, f) for f in CORRECTNESS_KNOBS if f not in changed)


def test_the_in_layer_autotune_lays_the_weights_out_once(monkeypatch, tmp_path):
    """knobs="auto": the first candidate lays the weights out, every other candidate adopts that layout (it does not
    depend on the knobs), a candidate that fails does not stop the next from laying out, and the result keeps the
    layout for the layer's own frontend."""
    from shim.sm90 import tune
    from shim.sm90.knobs import heuristic_knobs

    events = []

    class Frontend:
        device = "cpu"

        def __init__(self, knobs):
            self.knobs = knobs
            if knobs.flag_batch == 4:
                raise ValueError("the kernel refuses this one")

        def load_weights(self, weights):
            events.append(("layout", self.knobs.flag_batch))
            return ("laid out", weights)

        def adopt_weights(self, kw):
            events.append(("adopt", self.knobs.flag_batch, kw))

        def compile(self):
            pass

        def close(self):
            pass

    monkeypatch.setattr(tune, "synthetic_inputs", lambda *a, **k: None)
    monkeypatch.setattr(tune, "time_frontend", lambda fe, inputs, **k: ([10.0 + fe.knobs.flag_batch], False))
    base = heuristic_knobs("fp8_block", 128)
    cands = [base.replace(flag_batch=f) for f in (4, 2, 1)]
    winner, result = tune.autotune(Frontend, "W", fmt="fp8_block", spec=_spec(128), cache_key="k", candidates=cands,
                                   cache=KnobCache(str(tmp_path / "c.json")), progress=False)
    assert events == [("layout", 2), ("adopt", 1, ("laid out", "W"))]
    assert winner.flag_batch == 1 and result.kernel_weights == ("laid out", "W")


def test_exchange_knobs_default_to_the_kernel_and_are_checked_per_kernel():
    from shim.sm90.knobs import InvalidKnobsError, heuristic_knobs

    base = heuristic_knobs("w4a8_mxfp4", 2048)
    assert base.exchange_kwargs() == {}  # None everywhere: the kernel's defaults, what every old entry built
    k = base.replace(active_dispatch_warps=2, mxfp4_fc2_tail_n8=True)
    assert k.validate("w4a8_mxfp4").exchange_kwargs() == {"active_dispatch_warps": 2, "mxfp4_fc2_tail_n8": True}
    with pytest.raises(InvalidKnobsError) as e:  # FP8's kernel has no narrow MXFP4 tail
        heuristic_knobs("fp8_block", 2048).replace(mxfp4_fc2_tail_n8=True).validate("fp8_block")
    assert e.value.knob == "mxfp4_fc2_tail_n8"
    with pytest.raises(InvalidKnobsError) as e:  # nor BF16's any exchange knob
        heuristic_knobs("bf16", 2048).replace(dedup_dispatch=True).validate("bf16")
    assert e.value.knob == "dedup_dispatch"
    for bad in (dict(active_dispatch_warps=3), dict(active_dispatch_warps=True), dict(num_sched_stages=2.0),
                dict(compact_pull_buffer=1)):
        with pytest.raises(InvalidKnobsError) as e:
            base.replace(**bad).validate("w4a8_mxfp4")
        assert e.value.knob == next(iter(bad))


def test_the_exchange_stage_reaches_every_exchange_knob_and_value_of_each_kernel():
    from shim.sm90.knobs import EXCHANGE_KNOBS, KNOB_SPACE, heuristic_knobs
    from shim.sm90.tune import EXCHANGE_DEFAULTS, exchange_candidates

    for fmt in ("w4a8_mxfp4", "fp8_block"):
        base = heuristic_knobs(fmt, 2048)
        space, default = KNOB_SPACE[base.kernel], dict(EXCHANGE_DEFAULTS[base.kernel])
        cands = exchange_candidates([base], limit=100)
        for name in EXCHANGE_KNOBS:
            if name not in space:
                continue
            want = {v for v in space[name] if v != default[name]}
            assert {getattr(c, name) for c in cands} - {None} >= want, (fmt, name)
        # One change at a time: a candidate sets only the knobs of one EXCHANGE_VARIANTS entry.
        assert all(1 <= len(c.exchange_kwargs()) <= 3 for c in cands)


def test_correctness_and_perf_knobs_partition_the_knob_set():
    from dataclasses import fields

    from shim.sm90.knobs import CORRECTNESS_KNOBS, PERF_KNOBS, Sm90Knobs

    names = {f.name for f in fields(Sm90Knobs)}
    assert set(CORRECTNESS_KNOBS) | set(PERF_KNOBS) == names
    assert not set(CORRECTNESS_KNOBS) & set(PERF_KNOBS)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
