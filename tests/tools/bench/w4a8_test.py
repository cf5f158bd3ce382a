"""tools/bench/w4a8.py on CPU: its plan (capacities, what is checked and timed, in what order), #22's target
verdicts, and the report it writes from a run's records (here synthetic ones: the timings run on a GPU)."""
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
    times = [j for j in jobs if j["kind"] == "time"]
    caps = [j["capacity"] for j in times]
    assert caps == sorted(caps) and set(caps) == {8, 32, 128, 512, 2048, 4096}
    assert sorted(t for j in times if j["fmt"] == "fp8_block" for t in j["tokens"]) == list(w4a8.TIME_TOKENS)
    assert [j["id"] for j in jobs] == list(range(len(jobs)))


@pytest.mark.parametrize("t, w4a8_ratio, tensor_ratio, want", [
    (1, 0.74, None, (0.75, True, None, None)),
    (8, 0.63, None, (0.62, False, None, None)),
    (128, 0.80, 0.95, (0.80, True, None, None)),
    (512, 1.2, 0.99, (1.10, False, None, None)),
    (2048, 1.05, 0.91, (1.10, True, 0.90, False)),
    (4096, None, 0.85, (1.10, None, 0.90, True)),
])
def test_targets(t, w4a8_ratio, tensor_ratio, want):
    v = w4a8.targets_met(t, w4a8_ratio, tensor_ratio)
    assert (v["w4a8_target"], v["w4a8_ok"], v["tensor_target"], v["tensor_ok"]) == want


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
        elif j["capacity"] == 4096 and j["fmt"] == "w4a8_mxfp4":
            out.append(dict(j, ok=False, error="not run: out of --budget-s"))
        elif j["fmt"] == "w4a8_nvfp4":
            out.append(dict(j, ok=True, rows=[dict(T=t, us=None, reason="no kernel") for t in j["tokens"]]))
        else:
            out.append(dict(j, ok=True, rows=[dict(T=t, us=us[j["fmt"]] * (1 + t / 1000), best_us=1.0, knobs={},
                                                   knob_source="heuristic", compile_s=5.0) for t in j["tokens"]]))
    return out


def test_report_from_a_runs_records(tmp_path):
    text = w4a8.report(_results(), tmp_path, dict(device="NVIDIA H200", drop="0.7.4"))
    assert "| w4a8_mxfp4 | dsv3 | 1000 | FAIL |" in text and "| w4a8_nvfp4 | small | 8 | no kernel |" in text
    assert "| 8 | 8 | 181 | - | 302 | 272 | 0.600 (<= 0.62 met) | 0.900 |" in text
    assert "| 4096 | 4096 | - | - |" in text and "out of --budget-s" in text and "Unavailable: no kernel" in text
    table = json.loads((tmp_path / "summary.json").read_text())["timing"]
    t2048 = next(r for r in table if r["T"] == 2048)
    assert t2048["fp8_tensor/fp8_block"] == pytest.approx(0.9) and t2048["tensor_ok"] is True
    with open(tmp_path / "timing.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["T"]) for r in rows] == list(w4a8.TIME_TOKENS)
    with open(tmp_path / "checks.csv") as f:
        assert len(list(csv.DictReader(f))) == len(w4a8.NEW_FORMATS) * len(w4a8.CHECK_GEOMS) * 4


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
