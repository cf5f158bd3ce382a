"""The drop tool as the README runs it: the real `//tools:drop` binary (tests/tools/drop/binary.py), on the pinned
drops and on drops derived from the pinned Hopper tree whose right verdicts are known (tests/tools/drop/synthetic.py).

The binary carries both pinned trees, which is what once made every build-stage job fail under `bazel run` while
`python -m tools.drop` passed (#37): only a run of the binary itself shows that. Each derived drop gets its verdict
and the shim's `file:line` it is refused at; three of them change what the kernel computes while everything still
compiles (an interleave in the kernel class, the MXFP4 exponent window, a new defaulted parameter).

Time: one build stage per tree digest. The pinned trees compile every kernel class each backend can select at the
smallest capacity's heuristic (`--compile-capacities 8`; the default adds 256 and 4096) and the verdict is cached by
the tree's digest: a second audit of the same tree reads it back. Derived drops run the source checks alone when a
source check decides them (`--static-only`) and knob resolution and the numerical check around the buckets they touch
otherwise (`--no-compile --resolve-capacities ...`); a launch that no longer binds fails to compile in
build_stage_test.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import List

import pytest

from shim.common.tree_facts import TREES
from tests.tools.drop import synthetic
from tests.tools.drop.binary import Run, run_drop
from tools.drop.cli import pinned_tree_root
from tools.drop.fetch import default_cache_dir
from tools.drop.trees import find_repo_root

AROUND_BUCKETS = ["--no-compile", "--resolve-capacities", "1,8,9,16,17,4096"]


@pytest.fixture(scope="module")
def repo() -> Path:
    return find_repo_root(Path(__file__).resolve().parent)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """The tool's cache for every run of this module (what a maintainer's ~/.cache/megamoe-ep/drop would be)."""
    return tmp_path_factory.mktemp("drop-cache")


def drop(repo: Path, cache: Path, cwd: Path, *args: str) -> Run:
    env = dict(os.environ, MOE_EP_DROP_CACHE=str(cache))
    for tree in TREES.values():
        env.pop(tree.env_var, None)  # the binary finds the pinned trees in its runfiles, as under `bazel run`
    return run_drop(repo, list(args), cwd=cwd, env=env)


def shim_line(repo: Path, rel: str, text: str) -> str:
    lines = (repo / rel).read_text().splitlines()
    return f"{rel}:{next(i for i, line in enumerate(lines, 1) if text in line)}"


def break_rows(run: Run) -> List[str]:
    """The rows of the [breaks] block: each break in full, with its shim lines."""
    block = run.stdout.split("[breaks]", 1)[1].split("\n\n", 1)[0] if "[breaks]" in run.stdout else ""
    return block.splitlines()[3:]


def row(run: Run, subject: str) -> str:
    found = [r for r in break_rows(run) if subject in r]
    assert found, f"no break about {subject!r}:\n{run.stdout[-4000:]}\n{run.stderr[-2000:]}"
    return found[0]


# ---- the pinned drops: clean through the binary ------------------------------------------------------------------


def _build_cells(run: Run):
    """{(backend, format): [static, resolve, compile, numbers, verdict]} of the verdict's build table."""
    out = {}
    for line in run.verdict.splitlines():
        parts = re.split(r"\s{2,}", line.strip())
        if len(parts) == 7 and parts[0].startswith("sm"):
            out[(parts[0], parts[1])] = parts[2:]
    return out


def test_the_pinned_hopper_drop_audits_clean_and_the_same_audit_again_is_read_back(repo, cache, tmp_path):
    run = drop(repo, cache, tmp_path, "audit", "--tree", "sm90", "--compile-jobs", "2", "--compile-capacities", "8")
    assert run.code == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert run.verdict.startswith("sm90 0.7.4 (manifest) -> 0.7.4: exit 0 (compatible). CLEAN: 0 break, 0 warn, 0 note")
    cells = _build_cells(run)
    # Every kernel class each backend can select compiled: both forms of FP8 blockwise, per-tensor FP8 and BF16
    # (the non-swap ones with the knobs of another resolve that builds them), W4A8's one.
    assert {k: (v[2].split(",")[0], v[3], v[4]) for k, v in cells.items()} == {
        ("sm90_fp8_cutedsl", "fp8_block"): ("ok (2", "ok", "ok"),
        ("sm90_bf16_cutedsl", "bf16"): ("ok (2", "ok", "ok"),
        ("sm90_fp8_tensor_cutedsl", "fp8_tensor"): ("ok (2", "ok", "ok"),
        ("sm90_w4a8_mxfp4_cutedsl", "w4a8_mxfp4"): ("ok (1", "ok", "ok")}
    assert "TreeConflictError" not in run.stdout + run.stderr
    again = drop(repo, cache, tmp_path, "audit", "--tree", "sm90", "--compile-jobs", "2", "--compile-capacities", "8")
    assert again.code == 0 and again.verdict.split("\n\n")[:2] == run.verdict.split("\n\n")[:2]
    assert "read from the cache" in again.stderr and "compile sm90" not in again.stderr


def test_the_pinned_blackwell_drop_audits_clean(repo, cache, tmp_path):
    run = drop(repo, cache, tmp_path, "audit", "--tree", "sm100", "--compile-capacities", "8")
    assert run.code == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert "exit 0 (compatible). CLEAN: 0 break, 0 warn, 0 note" in run.verdict
    assert all(v[2].startswith("ok (1,") for v in _build_cells(run).values()) and len(_build_cells(run)) == 3
    assert "[tables] no knob table ships for sm100" in run.stdout


# ---- drops whose right verdicts are known ------------------------------------------------------------------------
# (name, options, exit code, [(subject of a break, shim file, text on the shim line it names)])

CASES = [
    ("comment_only", AROUND_BUCKETS, 0, []),
    ("heuristic_needs_num_ranks", ["--static-only"], 3, [
        ("select_heuristic_config()", "shim/sm90/knobs.py", "ks.select_heuristic_config(")]),
    ("config_field_renamed", ["--static-only"], 3, [
        ("HopperFp8Config.pingpong", "shim/sm90/knobs.py", "pingpong=bool(c.pingpong)")]),
    ("launch_parameter_inserted", ["--static-only"], 3, [
        ("Sm90MegaMoEFp8Kernel.__call__(routing_bias)", "shim/common/frontend.py",
         "return dict(output_activation=b.tensor(out))")]),
    ("swiglu_limit_default", ["--static-only"], 3, [
        ("Sm90MegaMoEFp8Kernel.__init__(swiglu_limit)", "shim/sm90/frontend.py", "return dict("),
        ("Sm90MegaMoESwapABMxfp4Fp8Kernel.__init__(swiglu_limit)", "shim/sm90/fp8_frontend.py",
         "return dict(sf_padding_block")]),
    ("table_entry_outside_knob_space", AROUND_BUCKETS, 3, [
        ("sm90_fp8_cutedsl [fp8_block] knob resolution and kernel build at capacity 9-16", "shim/sm90/knobs.py",
         "raise InvalidKnobsError(name, f\"{value!r} is not one of")]),
    ("interleave_in_kernel_class", AROUND_BUCKETS, 3, [
        ("sm90_fp8_cutedsl [fp8_block] knob resolution", "shim/sm90/frontend.py", "raise RuntimeError(f\"the drop's"),
        ("sm90_w4a8_mxfp4_cutedsl [w4a8_mxfp4] knob resolution", "shim/sm90/frontend.py",
         "raise RuntimeError(f\"the drop's")]),
    ("mxfp4_window_one_binade_up", AROUND_BUCKETS, 3, [
        ("sm90_w4a8_mxfp4_cutedsl [w4a8_mxfp4] numerical check", "shim/sm90/fp4_layout.py", "def mxfp4_offsets(")]),
]


@pytest.fixture(scope="module")
def pinned(repo) -> Path:
    root, _ = pinned_tree_root(repo, TREES["sm90"], default_cache_dir())
    return root


@pytest.mark.parametrize("name, options, code, expected", CASES, ids=[c[0] for c in CASES])
def test_a_derived_drop_gets_its_verdict_and_the_shim_line_it_is_refused_at(repo, cache, pinned, tmp_path, name,
                                                                           options, code, expected):
    tree = synthetic.derive_drop(pinned, tmp_path / name, synthetic.HOPPER_EDITS[name])
    # A path relative to where the maintainer typed the command, as the README's examples give it.
    run = drop(repo, cache, tmp_path, "audit", "--tree", "sm90", "--tree-root", name, *options)
    assert run.code == code, run.stdout[-6000:] + run.stderr[-3000:]
    print(f"{name}: exit {run.code}: {run.verdict.splitlines()[0]}")
    for subject, rel, text in expected:
        where = shim_line(repo, rel, text)
        assert where in row(run, subject), f"{where} not in {row(run, subject)}"
    if name == "mxfp4_window_one_binade_up":
        # Every W4A8 weight doubles: the numbers say so, with the converter's drop line.
        assert "their ratio to moe_ep's values: 2 (median)" in run.stdout
        assert "moe_hopper_fp8/mxfp4_cutedsl.py:" in run.stdout
    if name == "comment_only":
        assert "BREAK" not in run.verdict


if __name__ == "__main__":
    # Bazel runs the pinned trees and the derived drops as two targets (MOE_EP_DROP_BINARY_TESTS=pinned | derived).
    part = os.environ.get("MOE_EP_DROP_BINARY_TESTS")
    raise SystemExit(pytest.main([__file__, "-q", "-s"] + (["-k", part] if part else [])))
