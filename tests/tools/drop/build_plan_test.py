"""The build stage's plumbing without a child process: the children's one-tree environment, the compiles that cover
every kernel class a backend can select, and the verdict cache's key (tools/drop/build_stage.py)."""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

import pytest

from shim.common.tree_facts import TREES
from tests.tools.drop import synthetic
from tools.drop import build_stage
from tools.drop.build_stage import BuildReport, Job, Outcome

SM90 = TREES["sm90"]
FP8, TENSOR, BF16 = ("fp8", "fp8_block"), ("tensor", "fp8_tensor"), ("bf16", "bf16")


def test_a_child_sees_one_tree_whatever_the_launcher_put_on_its_path(tmp_path):
    # What `bazel run //tools:drop` hands its process: both pinned trees on PYTHONPATH, its runfiles named.
    runfiles = tmp_path / "drop.runfiles"
    trees = [synthetic.make_drop(runfiles / t.repo_name) for t in TREES.values()]
    stray = synthetic.make_drop(tmp_path / "someone" / "src")  # a tree under another name, e.g. a user's export
    plain = tmp_path / "lib"
    plain.mkdir()
    launcher = {"PYTHONPATH": os.pathsep.join(map(str, [runfiles / "megamoe_ep", *trees, stray, plain])),
                "RUNFILES_DIR": str(runfiles), "RUNFILES_MANIFEST_FILE": str(runfiles / "MANIFEST"),
                "PYTHON_RUNFILES": str(runfiles), "TEST_SRCDIR": str(runfiles), "MOE_EP_SM100_TREE": "/x",
                "MOE_EP_SM90_TREE": "/y", "HOME": "/home/me"}
    candidate = tmp_path / "candidate"
    env = build_stage.child_env(tmp_path / "checkout", SM90, candidate, launcher)
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path / "checkout"), str(runfiles / "megamoe_ep"),
                                                   str(plain)]
    assert not {"RUNFILES_DIR", "RUNFILES_MANIFEST_FILE", "PYTHON_RUNFILES", "TEST_SRCDIR", "MOE_EP_SM100_TREE"} & set(env)
    assert env["MOE_EP_SM90_TREE"] == str(candidate) and env["MOE_EP_UNPINNED_TREE"] == "sm90"
    assert env["CUTE_DSL_ARCH"] == "sm_90a" and env["HOME"] == "/home/me"


_ids = itertools.count()


def _resolved(pair, kernel, capacity, space, source="heuristic"):
    job = Job(next(_ids), pair[0], pair[1], capacity, False, source=source)
    return Outcome(job, True, "resolve", 0.1, knobs={"kernel": space, "swap_ab": kernel.startswith("Swap")},
                   kernel=kernel)


def _compiled(pair, kernel, capacity):
    return Outcome(Job(900 + capacity, pair[0], pair[1], capacity, True), True, "compile", 5.0, kernel=kernel)


def test_every_kernel_class_a_backend_can_select_is_compiled_once():
    outcomes = [
        _resolved(FP8, "SwapFp8", 8, "Fp8"), _resolved(FP8, "Fp8", 4096, "Fp8"),
        _resolved(TENSOR, "SwapFp8", 8, "Fp8"),
        _resolved(BF16, "SwapBf16", 8, "Bf16"), _resolved(BF16, "Bf16", 128, "Bf16", source="table t"),
        _compiled(FP8, "SwapFp8", 8), _compiled(FP8, "Fp8", 4096), _compiled(TENSOR, "SwapFp8", 8),
        _compiled(BF16, "SwapBf16", 8),
    ]
    report = BuildReport("sm90", [FP8, TENSOR, BF16], outcomes, 1.0, 1)
    classes = {FP8: ("Fp8", "SwapFp8"), TENSOR: ("Fp8", "SwapFp8"), BF16: ("Bf16", "SwapBf16", "Bf16Gone")}
    jobs = build_stage.cover_jobs(report, classes, start=100)
    got = {(j.backend, j.fmt): (j.capacity, j.knobs["kernel"], j.source) for j in jobs}
    # per-tensor FP8's plain kernel with the blockwise heuristic's knobs (the same knob space), BF16's with its table
    # row's; nothing for a class no knob set selects, and no knob set of another knob space is borrowed.
    assert got == {TENSOR: (4096, "Fp8", "Fp8: knobs of fp8 [fp8_block] heuristic at capacity 4096"),
                   BF16: (128, "Bf16", "Bf16: knobs of bf16 [bf16] table t at capacity 128")}
    assert all(j.compile and j.id >= 100 for j in jobs)
    assert build_stage.uncovered(report, classes) == [(TENSOR, "Fp8"), (BF16, "Bf16"), (BF16, "Bf16Gone")]


def test_the_cache_key_follows_the_tree_the_sources_and_the_plan(tmp_path):
    repo = synthetic.make_shim(tmp_path / "repo")
    tree = synthetic.make_drop(tmp_path / "tree")
    jobs = build_stage.plan_jobs(repo, "sm90", [FP8], resolve_capacities=(8,), compile=False, tables=False)
    key = build_stage.cache_key(repo, SM90, tree, jobs, {})
    assert build_stage.cache_key(repo, SM90, tree, jobs, {}) == key
    (tree / "src" / "__pycache__").mkdir()
    (tree / "src" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0")  # byte-code caches are not the tree
    assert build_stage.cache_key(repo, SM90, tree, jobs, {}) == key
    synthetic.edit(tree, "common/megamoe_constants.py", "= 128", "= 256")
    edited_tree = build_stage.cache_key(repo, SM90, tree, jobs, {})
    synthetic.edit(repo, "shim/sm90/knobs.py", "[None, 264]", "[None, 132]")
    edited_shim = build_stage.cache_key(repo, SM90, tree, jobs, {})
    more = build_stage.plan_jobs(repo, "sm90", [FP8], resolve_capacities=(8, 9), compile=False, tables=False)
    assert len({key, edited_tree, edited_shim, build_stage.cache_key(repo, SM90, tree, more, {})}) == 4


def test_a_cached_verdict_reads_back_as_it_was_written(tmp_path):
    report = BuildReport("sm90", [FP8], [_compiled(FP8, "Fp8", 8), _resolved(FP8, "Fp8", 8, "Fp8")], 3.0, 2)
    path = tmp_path / "build" / "sm90-k.json"
    build_stage._save(path, report)
    back = build_stage._load_cached(path, "sm90", [FP8])
    assert back.outcomes == report.outcomes and back.cached == str(path) and back.compile_jobs == 2
    # A child that died may not die again: that verdict is never kept.
    died = Outcome(Job(1, *FP8, 8, True), False, "compile", 0.0, error="the build child exited with -9 before this "
                                                                        "job reported: ...")
    build_stage._save(tmp_path / "d.json", BuildReport("sm90", [FP8], [died], 1.0, 1))
    assert not (tmp_path / "d.json").exists()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
