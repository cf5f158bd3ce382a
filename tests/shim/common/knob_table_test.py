"""Shipped knob tables (shim/common/knob_table.py): used only for the geometry, GPU and drop they were measured
on, and only after explicit knobs and the user's cache: explicit > cache > table > heuristic."""
import json

import pytest

import moe_ep
from shim.common import knob_table
from shim.common.knob_cache import KnobCache, cache_key
from shim.common.knobs import KnobSet, resolve_knob_set

from dataclasses import dataclass


@dataclass(frozen=True)
class Knobs(KnobSet):
    tile: int = 64
    group_hint: int = 0


KEY = cache_key(arch="sm90", fmt="fp8_block", hidden=7168, intermediate=2048, experts_per_rank=32, top_k=8,
                world_size=1, max_tokens_per_rank=128)
DROP = "a051a62e09a2738e8b0de47a1944fd2f0f3eff01b728b662141ea660cb09dd32"


@pytest.fixture
def tables(tmp_path, monkeypatch):
    folder = tmp_path / "tables"
    folder.mkdir()
    entry = {"knobs": {"tile": 128, "group_hint": 132}, "meta": {"tuned_us": 500.0, "heuristic_us": 800.0}}
    (folder / "h200.json").write_text(json.dumps({"version": 1, "entries": {
        knob_table.table_key(KEY, "NVIDIA H200", DROP): entry}}))
    monkeypatch.setitem(knob_table.TABLE_DIRS, "sm90", folder)
    knob_table.load_tables.cache_clear()
    yield folder
    knob_table.load_tables.cache_clear()


def _resolve(knobs=None, cache=None, device="NVIDIA H200", drop=DROP):
    def shipped():
        hit = knob_table.lookup("sm90", KEY, device, drop)
        return None if hit is None else hit[0]

    return resolve_knob_set(knobs, knob_type=Knobs, heuristic=Knobs, validate=lambda k: k, cache_key=KEY,
                            cache=cache or KnobCache(""), shipped=shipped)


def test_the_table_is_used_for_its_gpu_drop_and_geometry(tables):
    assert _resolve() == (Knobs(128, 132), "table")
    meta = knob_table.lookup("sm90", KEY, "NVIDIA H200", DROP)[1]
    assert meta["tuned_us"] < meta["heuristic_us"]


@pytest.mark.parametrize("device, drop", [("NVIDIA H100 80GB HBM3", DROP), ("NVIDIA H200", "bfdc18b9e1e4" * 5),
                                          (None, DROP), ("NVIDIA H200", None)])
def test_another_gpu_or_drop_or_an_unverified_tree_never_uses_it(tables, device, drop):
    assert _resolve(device=device, drop=drop) == (Knobs(), "heuristic")


def test_another_geometry_never_uses_it(tables):
    other = KEY.replace("C128", "C256")
    assert knob_table.lookup("sm90", other, "NVIDIA H200", DROP) is None


def test_explicit_and_the_users_cache_come_first(tables, tmp_path):
    assert _resolve(knobs={"tile": 8}) == (Knobs(8, 0), "explicit")
    cache = KnobCache(str(tmp_path / "c.json"))
    cache.put(KEY, {"tile": 256})
    assert _resolve(cache=cache) == (Knobs(256, 0), "cache")


def test_a_broken_table_is_an_error_naming_the_file(tables):
    (tables / "bad.json").write_text("{not json")
    knob_table.load_tables.cache_clear()
    with pytest.raises(moe_ep.errors.KnobError, match="bad.json"):
        _resolve()


def test_the_shipped_tables_parse_and_are_keyed_by_gpu_and_drop():
    knob_table.load_tables.cache_clear()
    for key, entry in knob_table.load_tables("sm90").items():
        assert "/dev=" in key and "/drop=" in key, key
        assert set(entry) >= {"knobs", "meta"} and entry["meta"].get("tuned_us"), key


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
