"""Knobs of the Blackwell kernels: the space is the kernels' own constructor parameters, every heuristic
profile is valid, invalid sets fail by name before anything is built, resolution is explicit > cache >
heuristic."""
import inspect

import pytest

from shim.common.knob_cache import KnobCache, cache_key
from shim.sm100.knobs import KERNEL_CLASS, KNOB_SPACE, InvalidKnobsError, Sm100Knobs, heuristic_knobs, resolve_knobs

FORMATS = ("nvfp4", "mxfp8", "bf16")


def _key(fmt="nvfp4", **kw):
    base = dict(arch="sm100", fmt=fmt, hidden=7168, intermediate=2048, experts_per_rank=64, top_k=8, world_size=4,
                max_tokens_per_rank=256)
    base.update(kw)
    return cache_key(**base)


def test_knob_space_names_real_constructor_parameters(ks):
    for cls_name, space in KNOB_SPACE.items():
        params = inspect.signature(getattr(ks, cls_name).__init__).parameters
        missing = sorted(set(space) - set(params))
        assert not missing, f"{cls_name} has no constructor parameter(s) {missing}"
    assert set(KERNEL_CLASS.values()) == set(KNOB_SPACE)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("capacity", [1, 64, 511, 512, 1023, 1024, 2047, 2048, 8192])
def test_every_heuristic_profile_validates(fmt, capacity):
    k = heuristic_knobs(fmt, capacity)
    assert k.validate(fmt) is k
    assert not k.fc2_in_kernel_topk_reduce  # nondeterministic summation is never a default


def test_heuristic_follows_the_measured_token_back_crossover():
    modes = {c: heuristic_knobs("nvfp4", c).token_back_mode for c in (64, 600, 1500, 4096)}
    assert modes == {64: "epi_warps", 600: "reuse_dispatch_warps", 1500: "standalone_warps",
                     4096: "reuse_dispatch_warps"}
    assert heuristic_knobs("nvfp4", 4096).mma_tiler_mnk == (256, 256, 256)
    assert heuristic_knobs("mxfp8", 2047).token_back_mode == "epi_warps"
    assert heuristic_knobs("mxfp8", 2048).token_back_mode == "reuse_dispatch_warps"
    assert heuristic_knobs("bf16", 8192) == heuristic_knobs("bf16", 8)


@pytest.mark.parametrize("fmt, change, knob", [
    ("nvfp4", dict(mma_tiler_mnk=(256, 96, 256)), "mma_tiler_mnk"),
    ("nvfp4", dict(cluster_shape_mnk=(1, 1, 1)), "cluster_shape_mnk"),  # a 2-CTA tile needs an even cluster M
    ("nvfp4", dict(cluster_shape_mnk=(2, 2, 1)), "cluster_shape_mnk"),
    ("nvfp4", dict(token_back_mode="warps"), "token_back_mode"),
    ("nvfp4", dict(flag_batch=3), "flag_batch"),
    ("nvfp4", dict(group_hint=0), "group_hint"),
    ("nvfp4", dict(group_hint=True), "group_hint"),
    ("nvfp4", dict(fc2_in_kernel_topk_reduce=1), "fc2_in_kernel_topk_reduce"),
    ("mxfp8", dict(mma_tiler_mnk=(256, 128, 256)), "mma_tiler_mnk"),
    ("mxfp8", dict(fc2_in_kernel_topk_reduce=True, token_back_mode="reuse_dispatch_warps"),
     "fc2_in_kernel_topk_reduce"),
    ("bf16", dict(cluster_shape_mnk=(4, 1, 1)), "cluster_shape_mnk"),
    ("bf16", dict(fc2_in_kernel_topk_reduce=True, token_back_mode="epi_warps"), "fc2_in_kernel_topk_reduce"),
    ("bf16", dict(epi_flag_batch=(3, 3)), "epi_flag_batch"),
])
def test_invalid_sets_are_refused_by_name(fmt, change, knob):
    with pytest.raises(InvalidKnobsError) as err:
        heuristic_knobs(fmt, 64).replace(**change).validate(fmt)
    assert err.value.knob == knob


def test_valid_non_default_sets_pass():
    heuristic_knobs("nvfp4", 64).replace(mma_tiler_mnk=(128, 128, 256), cluster_shape_mnk=(1, 1, 1)).validate("nvfp4")
    heuristic_knobs("nvfp4", 64).replace(fc2_in_kernel_topk_reduce=True).validate("nvfp4")
    heuristic_knobs("mxfp8", 64).replace(fc2_in_kernel_topk_reduce=True).validate("mxfp8")
    heuristic_knobs("bf16", 64).replace(fc2_in_kernel_topk_reduce=True,
                                        token_back_mode="standalone_warps").validate("bf16")


def test_unknown_format_is_refused():
    with pytest.raises(InvalidKnobsError) as err:
        heuristic_knobs("fp8_block", 64)
    assert err.value.knob == "fmt"


def test_resolution_order(tmp_path):
    cache = KnobCache(str(tmp_path / "k.json"))
    heur = heuristic_knobs("nvfp4", 256)
    assert resolve_knobs(None, fmt="nvfp4", max_tokens_per_rank=256, cache_key=_key(), cache=cache) == (heur, "heuristic")
    tuned = heur.replace(group_hint=128, flag_batch=8)
    cache.put(_key(), tuned.to_json(), meta={"us": 300.0})
    assert resolve_knobs(None, fmt="nvfp4", max_tokens_per_rank=256, cache_key=_key(), cache=cache) == (tuned, "cache")
    assert resolve_knobs("auto", fmt="nvfp4", max_tokens_per_rank=256, cache_key=_key(), cache=cache)[1] == "cache"
    # Another key (geometry, format or capacity) does not see it.
    assert resolve_knobs(None, fmt="nvfp4", max_tokens_per_rank=512, cache_key=_key(max_tokens_per_rank=512), cache=cache)[1] == "heuristic"
    # Explicit beats the cache; a dict overrides the heuristic field by field.
    k, src = resolve_knobs({"flag_batch": 2}, fmt="nvfp4", max_tokens_per_rank=256, cache_key=_key(), cache=cache)
    assert src == "explicit" and k == heur.replace(flag_batch=2)
    assert resolve_knobs(heur, fmt="nvfp4", max_tokens_per_rank=256, cache_key=_key(), cache=cache) == (heur, "explicit")


def test_a_bad_cached_set_is_an_error_not_a_silent_default(tmp_path):
    cache = KnobCache(str(tmp_path / "k.json"))
    cache.put(_key("mxfp8"), dict(heuristic_knobs("mxfp8", 256).to_json(), mma_tiler_mnk=[128, 128, 256]))
    with pytest.raises(InvalidKnobsError) as err:
        resolve_knobs(None, fmt="mxfp8", max_tokens_per_rank=256, cache_key=_key("mxfp8"), cache=cache)
    assert err.value.knob == "mma_tiler_mnk"
    with pytest.raises(InvalidKnobsError) as err:
        resolve_knobs({"tile": (1, 2, 3)}, fmt="mxfp8", max_tokens_per_rank=256, cache_key=_key("mxfp8"), cache=cache)
    assert err.value.knob == "tile"
    with pytest.raises(InvalidKnobsError, match="expected None, 'auto', a dict or Sm100Knobs"):
        resolve_knobs(7, fmt="mxfp8", max_tokens_per_rank=256, cache_key=_key("mxfp8"), cache=cache)


def test_json_round_trip_keeps_tuples():
    k = heuristic_knobs("nvfp4", 2048)
    assert Sm100Knobs.from_json(k.to_json()) == k


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
