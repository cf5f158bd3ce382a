"""The drops the audit used to accept though every FP8 layer then fails (#26) are caught, each by the cheapest check
that can: two by reading the sources, one by resolving knobs in a child process, and a launch that no longer binds
by compiling there. Drops derived from the pinned Hopper tree (tests/tools/drop/synthetic.py), audited against the
real shim of this checkout; the build children import this checkout (tagged local, like the pinned audit: it reads
the live tree, and the source digest among its data reruns it when any source changes).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shim.common.tree_facts import TREES
from tests.tools.drop import synthetic
from tools.drop import build_stage, contract as contract_mod
from tools.drop.audit import EXIT_OK, EXIT_SOME_BREAK, Finding, run_audit
from tools.drop.cli import pinned_tree_root
from tools.drop.fetch import default_cache_dir
from tools.drop.inventory import inventory_of_tree, load_manifest_file
from tools.drop.manifests import manifest_path
from tools.drop.report import render_summary
from tools.drop.trees import find_repo_root

SM90 = TREES["sm90"]
FP8 = ("sm90_fp8_cutedsl", "fp8_block")
FP8_TENSOR = ("sm90_fp8_tensor_cutedsl", "fp8_tensor")  # the same kernel, heuristic table and config reads
BF16 = ("sm90_bf16_cutedsl", "bf16")


@pytest.fixture(scope="module")
def repo() -> Path:
    return find_repo_root(Path(__file__).resolve().parent)


@pytest.fixture(scope="module")
def pinned(repo) -> Path:
    root, _ = pinned_tree_root(repo, SM90, default_cache_dir())
    return root


def derived(pinned: Path, tmp_path: Path, name: str) -> Path:
    return synthetic.derive_drop(pinned, tmp_path / name, synthetic.HOPPER_EDITS[name])


def audit(repo: Path, new: Path):
    return run_audit(repo, SM90, new, load_manifest_file(manifest_path(repo, SM90)), inventory_of_tree(new),
                     "0.7.4 (manifest)", new.name, contract_mod.load_contract(contract_mod.contract_path(repo, "sm90")))


def breaks(result, section):
    return [f for f in result.findings if f.status == "break" and f.section == section]


def build(repo: Path, tree: Path, pairs, capacities=build_stage.RESOLVE_CAPACITIES, compile_at=()):
    jobs = build_stage.plan_jobs(repo, "sm90", pairs, resolve_capacities=capacities, compile=bool(compile_at),
                                 compile_capacities=compile_at, tables=False, numbers=False)
    return build_stage.run_build(repo, SM90, tree, jobs, log=lambda m: None)


def _knobs_line(repo: Path, text: str) -> str:
    lines = (repo / "shim" / "sm90" / "knobs.py").read_text().splitlines()
    return f"shim/sm90/knobs.py:{next(i for i, line in enumerate(lines, 1) if text in line)}"


# ---- caught by reading the sources ------------------------------------------------------------------


def test_a_new_required_parameter_of_the_heuristic_is_a_static_break(repo, pinned, tmp_path):
    result = audit(repo, derived(pinned, tmp_path, "heuristic_needs_num_ranks"))
    (f,) = breaks(result, "calls")
    assert f.subject == "moe_hopper_fp8.heuristic_config.select_heuristic_config()"
    assert "requires num_ranks, which the shim does not pass" in f.detail
    assert f.sites == (_knobs_line(repo, "ks.select_heuristic_config("),) and f.pairs == (FP8, FP8_TENSOR)
    assert result.exit_code() == EXIT_SOME_BREAK  # the BF16 backend does not call it


def test_a_renamed_config_field_the_shim_reads_is_a_static_break(repo, pinned, tmp_path):
    result = audit(repo, derived(pinned, tmp_path, "config_field_renamed"))
    (f,) = breaks(result, "reads")
    assert f.subject == "moe_hopper_fp8.heuristic_config.HopperFp8Config.pingpong"
    assert f.detail.endswith("did you mean ping_pong?")
    assert f.sites == (_knobs_line(repo, "pingpong=bool(c.pingpong)"),) and f.pairs == (FP8, FP8_TENSOR)


# ---- caught by resolving knobs (a child process, no compile) ------------------------------------------


def test_a_heuristic_entry_outside_the_knob_space_breaks_at_its_bucket(repo, pinned, tmp_path):
    tree = derived(pinned, tmp_path, "table_entry_outside_knob_space")
    result = audit(repo, tree)
    assert not [f for f in result.findings if f.status == "break"]  # no static break: the sources only hint at it
    (hint,) = [f for f in result.findings if f.status == "warn"]
    assert hint.subject == "Sm90MegaMoEFp8Kernel.mma_tiler_mnk=(256, 48, 128)" and hint.pairs == (FP8, FP8_TENSOR)
    report = build(repo, tree, [FP8], capacities=(1, 8, 9, 16, 17, 32))  # the buckets around it
    build_stage.apply_build(result, report)
    (f,) = breaks(result, "build")
    assert f.subject == "sm90_fp8_cutedsl [fp8_block] knob resolution and kernel build at capacity 9-16"
    assert f.detail.startswith("InvalidKnobsError") and "(256, 48, 128)" in f.detail
    assert f.sites[0].startswith("shim/sm90/knobs.py:") and f.pairs == (FP8,)  # the build ran FP8 alone
    assert report.summary(FP8)[0] == "FAIL at 9-16"
    assert result.exit_code() == EXIT_SOME_BREAK


# ---- caught by compiling --------------------------------------------------------------------------------


def test_a_launch_the_shim_cannot_bind_fails_to_compile_and_the_pinned_tree_compiles(repo, pinned, tmp_path):
    broken = derived(pinned, tmp_path, "launch_parameter_inserted")
    result = audit(repo, broken)
    report = build(repo, broken, [FP8], capacities=(64,), compile_at=(64,))
    build_stage.apply_build(result, report)
    (f,) = breaks(result, "build")
    assert f.subject == "sm90_fp8_cutedsl [fp8_block] compile at capacity 64" and "routing_bias" in f.detail
    assert f.sites[0].startswith("shim/common/frontend.py:")
    assert report.summary(FP8)[1] == "FAIL (1 of 1)"
    # The pinned tree builds (the same job: the failure above is the drop's, not the harness's).
    ok = build(repo, pinned, [FP8], capacities=(64,), compile_at=(64,))
    assert ok.builds(FP8) and ok.compile_seconds()
    assert ok.summary(FP8)[1].startswith("ok (1, ")


def test_a_static_break_that_builds_is_a_warning_with_its_reason(repo, pinned):
    result = audit(repo, pinned)
    assert result.clean
    static = Finding("reads", "break", "x.Config.field", "the shim reads .field of a Config, ...",
                     ("shim/sm90/knobs.py:1",), (FP8,))
    knob = Finding("knobs", "break", "Sm90MegaMoEFp8Kernel.pingpong=3", "rejected by ...", (), (FP8,))
    result.findings += [static, knob]
    ok = build_stage.Outcome(build_stage.Job(0, *FP8, 64, True), True, "compile", 7.0)
    build_stage.apply_build(result, build_stage.BuildReport("sm90", [FP8], [ok], 8.0, 1))
    got = {f.section: f for f in result.findings if f.subject in (static.subject, knob.subject)}
    assert got["reads"].status == "warn" and got["reads"].detail.startswith("the shim reads .field of a Config")
    assert "static check only: sm90_fp8_cutedsl resolve(s) and compile(s) against this drop" in got["reads"].detail
    assert got["knobs"].status == "break"  # values the build did not try
    rows = [line.split() for line in render_summary(result).splitlines()]
    assert ["backend", "format", "static", "resolve", "compile", "numbers", "verdict"] in rows
    assert ["sm90_fp8_cutedsl", "fp8_block", "BREAK", "1", "-", "ok", "(1,", "7", "s", "max)", "-", "BREAK"] in rows
    assert ["sm90_bf16_cutedsl", "bf16", "ok", "-", "-", "-", "ok"] in rows


def test_a_comment_only_drop_builds_clean_statically(repo, pinned, tmp_path):
    result = audit(repo, derived(pinned, tmp_path, "comment_only"))
    assert [f.section for f in result.findings if f.status != "unchecked"] == ["files"]
    assert result.exit_code() == EXIT_OK


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"] + (["-s"] if os.environ.get("VERBOSE") else [])))
