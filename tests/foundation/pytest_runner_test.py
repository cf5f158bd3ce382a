"""A test target that executes no test case fails, whatever its file says; CI refuses one that passes without saying
which cases it ran.

1. The fixture targets in //tests/fixtures/zero_cases are py_tests made with //tools/bazel:py.bzl, among this
   test's data: Bazel builds them as it builds any test, and each is run here as Bazel would run it (its own
   executable, the runner tools/bazel/pytest_runner.py as main). The one without a test function (whose own
   `__main__` block exits 0) and the one whose every case skips must fail; the one without a `__main__` block
   (what //tests/shim/sm90:fp4_layout_test was) must pass having run its two cases.
2. .ci/run, against a stand-in `bazel` whose log reports tests PASSED: one whose test.log lacks the runner's count
   (a target made some other way) is counted failed and fails the run.
"""

import os
import stat
import subprocess
import sys

import pytest

from tests.foundation import nested_bazel

FIXTURES = "tests/fixtures/zero_cases"


def _run_fixture(name, tmp_path):
    exe = nested_bazel.runfiles_root() / nested_bazel.WORKSPACE_NAME / FIXTURES / name
    assert exe.is_file(), f"{exe} missing: //{FIXTURES}:{name} must be among this test's data"
    env = dict(os.environ, TEST_TMPDIR=str(tmp_path))
    env.pop("XML_OUTPUT_FILE", None)  # this test's own report
    proc = subprocess.run([str(exe)], env=env, cwd=nested_bazel.runfiles_root() / nested_bazel.WORKSPACE_NAME,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    print(f"--- //{FIXTURES}:{name}: exit {proc.returncode}\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}")
    return proc


@pytest.mark.parametrize("name, detail", [
    ("no_case_test", "none collected"),
    ("all_skipped_test", "2 skipped"),
])
def test_a_target_that_runs_no_case_fails(name, detail, tmp_path):
    proc = _run_fixture(name, tmp_path)
    assert proc.returncode != 0, f"//{FIXTURES}:{name} ran no test case and still passed"
    said = proc.stdout
    assert f"pytest_runner: FAILED: {FIXTURES}/{name}.py ran no test case ({detail})" in said, said[-2000:]


def test_a_file_without_a_main_block_runs_its_cases(tmp_path):
    proc = _run_fixture("no_main_block_test", tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert f"pytest_runner: 2 test case(s) ran in {FIXTURES}/no_main_block_test.py (2 passed); " in proc.stdout


def test_a_failing_case_fails_the_target(tmp_path):
    proc = _run_fixture("failing_case_test", tmp_path)
    assert proc.returncode == 1
    assert "this fixture fails on purpose" in proc.stdout
    assert f"pytest_runner: 1 test case(s) ran in {FIXTURES}/failing_case_test.py (1 failed); " in proc.stdout


STAND_IN_BAZEL = """#!/bin/bash
# `bazel info bazel-testlogs` -> the stand-in logs; anything else: nothing.
[[ "$1 $2" == "info bazel-testlogs" ]] && echo "$TESTLOGS"
exit 0
"""


def test_ci_counts_a_passed_test_without_the_runners_count_as_failed(tmp_path):
    logs = tmp_path / "testlogs"
    for pkg, name, text in [
        ("a", "counted_test", "1 passed in 0.1s\npytest_runner: 1 test case(s) ran in a/counted_test.py (1 passed)\n"),
        ("a", "silent_test", ""),  # exited 0 having run nothing a runner saw
    ]:
        (logs / pkg / name).mkdir(parents=True)
        (logs / pkg / name / "test.log").write_text(text)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "bazel").write_text(STAND_IN_BAZEL)
    (bin_dir / "bazel").chmod(0o755 | stat.S_IXUSR)
    log = "//a:counted_test    PASSED in 0.1s\n//a:silent_test     (cached) PASSED in 0.1s\n"
    script = nested_bazel.workspace_root() / ".ci" / "run"
    env = dict(os.environ, PATH=f"{bin_dir}:/usr/bin:/bin", TESTLOGS=str(logs),
               MOE_EP_CI_COMMAND=f"printf '{log}'")
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    out = proc.stdout
    print(out, proc.stderr)
    assert proc.returncode == 1, out
    summary = out.split("test summary", 1)[1].splitlines()
    counted = next(l for l in summary if l.startswith("//a:counted_test"))
    silent = next(l for l in summary if l.startswith("//a:silent_test"))
    assert "PASSED" in counted and "pytest_runner: 1 test case(s) ran" in counted, counted
    assert "NO_CASES" in silent, silent
    assert "bazel: 1 passed, 1 failed" in out


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
