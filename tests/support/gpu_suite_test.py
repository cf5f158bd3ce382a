"""The one-command GPU suite (tests/support/gpu_suite.py) finds what Bazel's GPU configs run: every gpu_py_test of the
arch, with the main file Bazel runs, and every *_gpu_test.py file of the tree is some such test's (a GPU test no
BUILD file names would run nowhere)."""
import json
import sys
from pathlib import Path

import pytest

from tests.support import gpu_suite

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("arch", gpu_suite.ARCHS)
def test_every_gpu_test_of_the_arch_is_found_with_a_main_that_exists(arch):
    tests = gpu_suite.gpu_tests(arch)
    names = [t["name"] for t in tests]
    assert f"multirank_gpu_{arch}" in names and len(names) == len(set(names))
    for t in tests:
        assert (ROOT / t["main"]).is_file(), t
        assert t["name"].endswith(f"_{arch}")
    multirank = next(t for t in tests if t["name"] == f"multirank_gpu_{arch}")
    assert multirank["main"] == f"tests/shim/{arch}/run_multirank_gpu.py"  # it starts its own ranks


def test_every_gpu_test_file_is_run_by_a_gpu_target(tmp_path):
    run = {t["main"] for arch in gpu_suite.ARCHS for t in gpu_suite.gpu_tests(arch)}
    launched = {m.replace("run_multirank_gpu.py", "multirank_gpu_test.py") for m in run}
    files = {p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("*_gpu_test.py")}
    assert files <= launched, sorted(files - launched)


def test_an_arch_a_target_leaves_out_is_not_run(tmp_path):
    (tmp_path / "tests" / "x").mkdir(parents=True)
    (tmp_path / "tests" / "x" / "BUILD.bazel").write_text(
        'gpu_py_test(name = "a", srcs = ["a_gpu_test.py"], archs = ["sm100"])\n'
        'gpu_py_test(name = "b", srcs = ["b_gpu_test.py", "run_b.py"], main = "run_b.py", env = {"K": "v"})\n')
    assert [t["name"] for t in gpu_suite.gpu_tests("sm90", tmp_path)] == ["b_sm90"]
    both = gpu_suite.gpu_tests("sm100", tmp_path)
    assert [(t["name"], t["main"], t["env"]) for t in both] == [("a_sm100", "tests/x/a_gpu_test.py", {}),
                                                                ("b_sm100", "tests/x/run_b.py", {"K": "v"})]


def test_the_budget_times_out_the_test_it_runs_into_and_leaves_the_rest_not_run(tmp_path):
    (tmp_path / "tests" / "x").mkdir(parents=True)
    (tmp_path / "tests" / "x" / "BUILD.bazel").write_text(
        'gpu_py_test(name = "a", srcs = ["a_gpu_test.py"])\n'
        'gpu_py_test(name = "b", srcs = ["b_gpu_test.py"])\n'
        'gpu_py_test(name = "c", srcs = ["c_gpu_test.py"])\n')
    (tmp_path / "tests" / "x" / "a_gpu_test.py").write_text("print('1 passed in 0.01s')\n")
    # b starts a child of its own (as a multi-rank suite starts its ranks) that outlives b unless it is ended too
    (tmp_path / "tests" / "x" / "b_gpu_test.py").write_text(
        "import subprocess, sys, time\nprint('started', flush=True)\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\ntime.sleep(60)\n")
    (tmp_path / "tests" / "x" / "c_gpu_test.py").write_text("print('1 passed in 0.01s')\n")
    out = tmp_path / "out"
    budget = 4.0  # a's interpreter starts well within it; b then runs into it
    rows = gpu_suite.run("sm90", out, 1, timeout_s=600.0, budget_s=budget, root=tmp_path, min_test_s=1.0)
    assert [(r["name"], r["rc"]) for r in rows] == [("a_sm90", 0), ("b_sm90", 124), ("c_sm90", None)]
    assert rows[0]["summary"] == "1 passed in 0.01s" and "not run" in rows[2]["summary"]
    # b is cut at the budget, not at its own 600 s timeout, and its output so far is kept
    assert "started" in (out / "b_sm90.log").read_text() and rows[1]["seconds"] < budget + 1
    written = json.loads((out / "gpu_suite.json").read_text())
    assert [r["rc"] for r in written["tests"]] == [0, 124, None]
    rows = gpu_suite.run("sm90", tmp_path / "out2", 1, timeout_s=600.0, only=["c", "a"], root=tmp_path)
    assert [(r["name"], r["rc"]) for r in rows] == [("c_sm90", 0), ("a_sm90", 0)]  # --only's order, b left out


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
