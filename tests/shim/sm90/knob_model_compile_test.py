"""What the knob model (shim/sm90/knob_model.py) chooses from the shipped H200 table for geometries the table does
not cover builds and compiles for sm_90a on this CPU: the kernel never sees a set it rejects. One geometry per
kind of choice the entries lead to (swap-AB small tile, plain 64 x 128, plain 64 x 256)."""

import os

import pytest

import moe_ep
from shim.sm90 import knob_model as km

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

H200 = "NVIDIA H200"

UNCOVERED = [
    (7168, 2048, 48, 8, 128),  # DeepSeek-V3 shape, 48 local experts: 21 tokens per expert
    (2048, 768, 16, 8, 2048),  # Qwen3-30B at EP=8: 1024
    (4096, 1536, 16, 8, 8),    # Qwen3-235B at EP=8: 4
]


@pytest.mark.parametrize("h, i, e, k, c", UNCOVERED)
def test_what_it_chooses_for_uncovered_geometries_compiles(sm90_tree, h, i, e, k, c):
    from shim.common import knob_table, tree
    from shim.common.backend import compile_only_frontend
    from shim.sm90.knobs import Sm90Knobs
    from shim.sm90.tune import build_check

    drop = (tree.tree_provenance("sm90") or {}).get("carrier_sha256")
    measured = km.measured_entries(knob_table.load_tables("sm90"), device=H200, drop_sha256=drop)
    assert measured, "the shipped H200 table has no entry for the pinned drop"
    spec = moe_ep.MoESpec(h, i, e, k, c)
    g = km.Geometry("fp8_block", h, i, e, k, 1, c)
    assert not any(m.geometry == g for m in measured)
    check = build_check(moe_ep.core.registry.resolve_backend("sm90_fp8_cutedsl").frontend_class(), spec)
    picked = km.choose(g, measured, accepts=lambda kn: check(Sm90Knobs.from_json(kn)))
    assert picked is not None, f"no choice for {g}"
    f = compile_only_frontend("sm90_fp8_cutedsl", spec, knobs=Sm90Knobs.from_json(picked[0]))
    assert f.knobs == Sm90Knobs.from_json(picked[0])
    assert callable(f.compile())


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
