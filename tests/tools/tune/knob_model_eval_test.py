"""tools/tune/knob_model_eval: the times it reads from the tuner's records belong to the knob sets it says, and
holding a geometry out keeps every entry of that geometry from the model's choice (CPU, no build check)."""

import json
import sys

import pytest

from tools.tune import knob_model_eval as ev


@pytest.fixture(scope="module")
def evaluated(sm90_tree):
    from shim.sm90.knobs import heuristic_knobs

    table = json.loads(ev.TABLE.read_text())
    times = ev.candidate_times(table, ev._log_records(ev.LOGS), lambda fmt, cap: heuristic_knobs(fmt, cap).to_json())
    return table, times, ev.evaluate(table, times)


def test_the_records_agree_with_the_table(evaluated):
    table, times, _ = evaluated
    for key, entry in table["entries"].items():
        meta, on_record = entry["meta"], times[key]
        assert on_record[ev._norm(entry["knobs"])] == pytest.approx(meta["tuned_us"], abs=1.0), key
        if meta.get("heuristic_us") is not None:
            assert meta["heuristic_us"] in on_record.values()
        # The tuned set is the fastest on record, but for a kept heuristic (within 3%) or a log rounded to 1 us.
        assert min(on_record.values()) >= 0.97 * meta["tuned_us"] - 1.0, key
        if meta["world_size"] == 1 and not meta["kept_heuristic"]:
            assert len(on_record) >= 3, f"{key}: runners-up not read from the log"


def test_holding_a_geometry_out_hides_all_of_it(evaluated):
    _, _, rows = evaluated
    assert rows and all(r["tuned_us"] > 0 for r in rows)
    for r in rows:
        shape = r["key"].split("/")[2:6]  # H, I, E, K
        if r.get("lgo"):
            source = r["lgo"]["why"].split("won at ")[1].split(" ")[0].split("/")[2:6]
            assert source != shape, r


def test_it_prints_a_table_and_a_summary(sm90_tree, capsys):
    assert ev.main(["--no-build-check"]) == 0
    out = capsys.readouterr().out
    assert "leave-geometry-out choice" in out and "lgo: model" in out and "lco: model" in out


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
