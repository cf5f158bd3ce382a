"""tools/bench/w4a8.py on CPU: its plan (capacities, what is checked, timed and ablated, in what order), #35's target
verdicts, the ablation's arithmetic, and the report it writes from a run's records (here synthetic ones: the timings
run on a GPU)."""
import csv
import json

import pytest

from tools.bench import w4a8


def test_capacity_is_t_rounded_up_to_a_power_of_two_at_least_8():
    assert [w4a8.capacity_for(t) for t in (0, 1, 8, 9, 32, 128, 1000, 4096)] == [8, 8, 8, 16, 32, 128, 1024, 4096]


def test_plan_checks_every_new_format_first_then_times_each_capacity_together():
    jobs = w4a8.plan()
    checks = [j for j in jobs if j["kind"] == "check"]
    assert jobs[:len(checks)] == checks
    assert {(j["fmt"], j["geom"]) for j in checks} == {(f, g) for f in w4a8.NEW_FORMATS for g in w4a8.CHECK_GEOMS}
    assert all(j["tokens"] == [1, 8, 128, 1000] and j["capacity"] == 1024 for j in checks)
    assert jobs[len(checks)]["kind"] == "copy"
    times = [j for j in jobs if j["kind"] == "time" and not j.get("variant")]
    caps = [j["capacity"] for j in times]
    assert caps == sorted(caps) and set(caps) == {8, 32, 128, 512, 2048, 4096}
    assert sorted(t for j in times if j["fmt"] == "fp8_block" for t in j["tokens"]) == list(w4a8.TIME_TOKENS)
    # The ablation's routings ride on the W4A8 and blockwise jobs; the same-tile pairs come last, one per format.
    for j in times:
        assert j["routings"] == (["balanced", "empty", "hot"] if j["fmt"] in ("w4a8_mxfp4", "fp8_block")
                                 else ["balanced"])
    pairs = [j for j in jobs if j.get("variant")]
    assert jobs[-len(pairs):] == pairs
    assert sorted((j["capacity"], j["variant"]) for j in pairs) == [
        (c, v) for c in w4a8.SAME_TILE_CAPACITIES for v in ("fp8_swap_same_tile", "w4a8_k128")]
    assert [j["id"] for j in jobs] == list(range(len(jobs)))
    bare = w4a8.plan(check=False, ablation=False)
    assert all(j["kind"] == "time" and j["routings"] == ["balanced"] and not j.get("variant") for j in bare)


@pytest.mark.parametrize("t, w4a8_ratio, tensor_ratio, want", [
    (1, 0.69, None, (0.70, True, 1.00, None)),
    (8, 0.61, 1.01, (0.60, False, 1.00, False)),
    (32, 0.60, 0.99, (0.60, True, 1.00, True)),
    (128, 0.76, 0.95, (0.75, False, 1.00, True)),
    (512, 1.0, 1.02, (1.00, True, 1.00, False)),
    (2048, 1.05, 0.86, (1.00, False, 0.85, False)),
    (4096, None, 0.85, (1.00, None, 0.85, True)),
])
def test_targets(t, w4a8_ratio, tensor_ratio, want):
    v = w4a8.targets_met(t, w4a8_ratio, tensor_ratio)
    assert (v["w4a8_target"], v["w4a8_ok"], v["tensor_target"], v["tensor_ok"]) == want


def test_expert_bytes_are_the_formats_weight_bytes():
    n = 3 * 7168 * 2048
    assert w4a8.expert_bytes("fp8_block") == 44_040_192 + 10_752
    assert w4a8.expert_bytes("w4a8_mxfp4") == 22_020_096 + 1_376_256 == n // 2 + n // 32


def test_ablation_arithmetic():
    # 31 experts touched at 250 us, the hot routing (8 experts) at 100 us: 150 us for 23 more experts' weights.
    rows = [dict(fmt="w4a8_mxfp4", geom="dsv3", T=8, us=250.0, empty_us=50.0, hot_us=100.0, experts=31),
            dict(fmt="fp8_tensor", geom="dsv3", T=8, us=300.0)]
    (a,) = w4a8.ablation_table(rows, copy_gbps=4000.0, top_k=8)
    per = 150.0 / 23
    assert a["per_expert_us"] == pytest.approx(per)
    assert a["stream_gbps"] == pytest.approx(w4a8.expert_bytes("w4a8_mxfp4") / per / 1e3)
    assert a["fixed_share"] == pytest.approx(0.2)
    assert a["floor_us"] == pytest.approx(31 * w4a8.expert_bytes("w4a8_mxfp4") / 4000.0 / 1e3)
    # No hot time, or no more experts than K: no per-expert cost, rather than a made-up one.
    (b,) = w4a8.ablation_table([dict(rows[0], hot_us=None)], copy_gbps=None)
    assert b["per_expert_us"] is None and b["floor_us"] is None and b["fixed_share"] == pytest.approx(0.2)
    (c,) = w4a8.ablation_table([dict(rows[0], experts=8)], copy_gbps=4000.0)
    assert c["per_expert_us"] is None


def _results():
    us = {"fp8_block": 300.0, "fp8_tensor": 270.0, "w4a8_mxfp4": 180.0}
    out = []
    for j in w4a8.plan():
        if j["kind"] == "check":
            if j["fmt"] == "w4a8_nvfp4":
                rows = [dict(T=t, ok=None, kernel=False, reason="no kernel", rel_l2_vs_fp64=0.2) for t in j["tokens"]]
            else:
                rows = [dict(T=t, ok=t != 1000 or j["geom"] != "dsv3", kernel=True, tol=0.03, max_row_rel=0.01,
                             rel_l2=3e-3, max_abs=0.01, nan=0, problems=[], rel_l2_vs_fp64=0.15,
                             weight_rel_err=0.12, knobs={}, knob_source="heuristic", compile_s=9.0)
                        for t in j["tokens"]]
            out.append(dict(j, ok=True, rows=rows))
        elif j["kind"] == "copy":
            out.append(dict(j, ok=True, rows=[dict(T=0, copy_gbps=4200.0)]))
        elif j["capacity"] == 4096 and j["fmt"] == "w4a8_mxfp4":
            out.append(dict(j, ok=False, error="not run: out of --budget-s"))
        elif j["fmt"] == "w4a8_nvfp4":
            out.append(dict(j, ok=True, rows=[dict(T=t, us=None, reason="no kernel") for t in j["tokens"]]))
        elif j.get("variant"):
            factor = {"w4a8_k128": 0.7, "fp8_swap_same_tile": 1.2}[j["variant"]]
            out.append(dict(j, ok=True, rows=[dict(T=t, us=us["fp8_block"] * factor * (1 + t / 1000),
                                                   knobs={"mma_tiler_mnk": [256, 16, 128]},
                                                   knob_source=f"ablation:{j['variant']}") for t in j["tokens"]]))
        else:
            rows = []
            for t in j["tokens"]:
                row = dict(T=t, us=us[j["fmt"]] * (1 + t / 1000), best_us=1.0, knobs={}, knob_source="table",
                           compile_s=5.0, experts=min(32, 8 * t))
                if "empty" in j["routings"]:
                    row.update(empty_us=40.0, hot_us=row["us"] / 2)
                rows.append(row)
            out.append(dict(j, ok=True, rows=rows))
    return out


def test_report_from_a_runs_records(tmp_path):
    text = w4a8.report(_results(), tmp_path, dict(device="NVIDIA H200", drop="0.7.4"))
    assert "| w4a8_mxfp4 | dsv3 | 1000 | FAIL |" in text and "| w4a8_nvfp4 | small | 8 | no kernel |" in text
    assert "| 1 | 8 | 180 | - | 300 | 270 | 0.600 (<= 0.70 met) | 0.900 (<= 1.00 met) | table / table / table |" in text
    assert "| 2048 | 2048 | 549 | - | 914 | 823 | 0.600 (<= 1.00 met) | 0.900 (<= 0.85 MISSED) |" in text
    assert "| 4096 | 4096 | - | - |" in text and "out of --budget-s" in text and "Unavailable: no kernel" in text
    # The ablation: T=8 touches 32 experts; W4A8's hot run is half its balanced one.
    assert "Copy rate of this GPU: 4200 GB/s" in text
    assert "| 8 | w4a8_mxfp4 | 181 | 40 | 91 | 32 | 3.78 |" in text
    # The same-tile pair at capacity 2048: 0.7 / 1.2 of blockwise's time, the dequant ratio is their quotient.
    assert "| 2048 | 2048 |" in text and "| 0.583 | 1.200 |" in text
    summary = json.loads((tmp_path / "summary.json").read_text())
    t2048 = next(r for r in summary["timing"] if r["T"] == 2048)
    assert t2048["fp8_tensor/fp8_block"] == pytest.approx(0.9) and t2048["tensor_ok"] is False
    assert summary["copy_gbps"] == 4200.0 and summary["same_tile"] and summary["ablation"]
    with open(tmp_path / "timing.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["T"]) for r in rows] == list(w4a8.TIME_TOKENS)
    with open(tmp_path / "checks.csv") as f:
        assert len(list(csv.DictReader(f))) == len(w4a8.NEW_FORMATS) * len(w4a8.CHECK_GEOMS) * 4


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
