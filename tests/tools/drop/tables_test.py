"""Shipped knob tables made on another drop are reported stale by the audit (tools/drop/tables.py)."""
import json
import sys

import pytest

from tools.drop.tables import render_stale, stale_entries

NEW = "a051a62e09a2738e8b0de47a1944fd2f0f3eff01b728b662141ea660cb09dd32"
OLD = "bfdc18b9e1e4d8d0730fe4343dc0e284cd0c160086de80f99888bc4867922d49"


def _table(repo, entries):
    folder = repo / "shim" / "sm90" / "tables"
    folder.mkdir(parents=True)
    (folder / "h200.json").write_text(json.dumps({"version": 1, "entries": entries}))


def _entry(sha, version):
    return {"knobs": {}, "meta": {"drop": version, "drop_sha256": sha, "tuned_us": 1.0}}


def test_entries_of_another_drop_are_stale(tmp_path):
    _table(tmp_path, {f"sm90/fp8_block/H1/I1/E1/K1/W1/C8/dev=NVIDIA_H200/drop={OLD[:16]}": _entry(OLD, "0.7.2.post1"),
                      f"sm90/fp8_block/H1/I1/E1/K1/W1/C16/dev=NVIDIA_H200/drop={NEW[:16]}": _entry(NEW, "0.7.4")})
    stale = stale_entries(tmp_path, "sm90", NEW)
    assert [e.drop for e in stale] == ["0.7.2.post1"] and "C8" in stale[0].key
    text = render_stale(stale, "sm90", "0.7.4")
    assert "STALE: 1 shipped knob table entry" in text and "0.7.2.post1" in text and "retune" in text
    assert stale_entries(tmp_path, "sm90", OLD)[0].drop == "0.7.4"  # a bump back makes the others stale


def test_no_tables_or_all_current(tmp_path):
    assert stale_entries(tmp_path, "sm90", NEW) == []
    _table(tmp_path, {f"k/drop={NEW[:16]}": _entry(NEW, "0.7.4")})
    assert stale_entries(tmp_path, "sm90", NEW) == []
    assert "every shipped sm90 knob table entry (1) was measured" in render_stale([], "sm90", "0.7.4", 1)
    # A tree with no table at all is not one whose entries all match (sm100 ships none).
    assert render_stale([], "sm100", "0.7.4", 0) == "[tables] no knob table ships for sm100: nothing to retune\n"


def test_the_shipped_tables_of_this_checkout_match_the_pin():
    from pathlib import Path

    from tools.drop.pins import read_pins_file
    from shim.common.tree_facts import TREES
    from tools.drop.trees import find_repo_root

    repo = find_repo_root(Path(__file__))
    for tree in TREES.values():
        version, sha = read_pins_file(repo, tree)
        assert stale_entries(repo, tree.arch, sha) == [], tree.arch


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
