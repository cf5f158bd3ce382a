"""The main of every py_test made with //tools/bazel:py.bzl: runs the test's file under pytest and fails the target
when no test case ran.

py.bzl does not run this file as it is: for each test it writes a copy, `<test>.pytest_main.py`, with the test's
file written in below (its `main`; else its one source; else every source named `*_test.py`, run in one pytest
session, so that they share session fixtures such as one nested Bazel server; else `<name>.py`), and makes that
copy the test's main.
So a test file needs no `__main__` block of its own, and one that has none, or one whose block runs nothing, cannot
pass having checked nothing: pytest collecting no case (its exit code 5), or every case skipped, fails the target
and says so, however the test is started (`bazel test`, `bazel run`, its executable). The last line of every log
counts the cases that ran (.ci/run prints it per test, and refuses a passed test whose log lacks it). By hand:

    python tools/bazel/pytest_runner.py <test file> [pytest arguments ...]

Also, under Bazel:
  - pytest writes the cases to $XML_OUTPUT_FILE, so Bazel's test.xml lists them;
  - TMPDIR is the test's own $TEST_TMPDIR, which Bazel empties after the test: what the test and its child
    processes write to the temp dir (pytest's tmp_path, tempfile.mkdtemp) is not left behind on the machine,
    and parallel tests do not share pytest's numbered temp folders;
  - pytest's cache is off (the runfiles tree is read-only).
"""

from __future__ import annotations

import os
import resource
import signal
import sys
import time
from typing import List, Optional, Tuple

# Written in by py.bzl (runfiles paths: "<repository>/<path>", test files separated by spaces); left as they are when
# this file is run by hand.
TEST_FILES = "@TEST_FILES@"
THIS_FILE = "@THIS_FILE@"

# The line every log ends with; .ci/run and the zero-case test read it.
SUMMARY = "pytest_runner: {ran} test case(s) ran in {file} ({detail}); {cost}"
NO_CASE = ("pytest_runner: FAILED: {file} ran no test case ({detail}). A test target must run at least one case: "
           "name the test functions test_*, or fix the skip conditions.")
NO_TESTS_COLLECTED = 5  # pytest.ExitCode.NO_TESTS_COLLECTED


class _Count:
    """Counts the cases whose body ran (passed, failed, xfailed), and those skipped."""

    def __init__(self) -> None:
        self.ran = 0
        self.outcomes = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "call":
            if report.skipped and not hasattr(report, "wasxfail"):
                self.outcomes["skipped"] += 1
            else:
                self.ran += 1
                self.outcomes["failed" if report.failed else "passed"] += 1
        elif report.failed:
            self.outcomes["errors"] += 1  # setup or teardown
        elif report.skipped and report.when == "setup":
            self.outcomes["skipped"] += 1

    def detail(self) -> str:
        return ", ".join(f"{n} {k}" for k, n in self.outcomes.items() if n) or "none collected"


def _under_bazel_tmp() -> None:
    tmp = os.environ.get("TEST_TMPDIR")
    if tmp:
        os.environ["TMPDIR"] = tmp
        import tempfile

        tempfile.tempdir = None  # recomputed from TMPDIR on next use


def _written_in() -> Optional[Tuple[List[str], str]]:
    """(absolute paths, paths to show) of the test files py.bzl wrote in, found from where this copy sits in the
    runfiles (it works whatever the current directory); None when run by hand."""
    if TEST_FILES.startswith("@"):
        return None
    here = os.path.abspath(__file__)
    if not here.endswith(THIS_FILE):
        raise RuntimeError(f"{here} is not at its runfiles path {THIS_FILE}")
    root = here[:-len(THIS_FILE)]
    files = TEST_FILES.split()
    return [os.path.join(root, f) for f in files], " ".join(f.split("/", 1)[1] for f in files)


def _cost(t0: float) -> str:
    """Wall time since the runner started, and CPU time of the process and the children it waited for (ranks,
    compile children, nested Bazel clients): what a test's `size` and a 2-core machine's schedule need to know."""
    forkserver = sys.modules.get("multiprocessing.forkserver")
    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    if pid:  # tools/launch forks CPU ranks from it, and it reaps them: reaped in turn, it and they count here
        # Killed, not asked to stop: a process holding torch takes seconds to tear itself down.
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            forkserver._forkserver._forkserver_pid = None
        except OSError:
            pass
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
    return f"{time.monotonic() - t0:.1f} s wall, {cpu:.1f} s CPU"


def main(argv: Optional[List[str]] = None) -> int:
    t0 = time.monotonic()
    argv = list(sys.argv[1:] if argv is None else argv)
    written = _written_in()
    if written:
        (test_files, shown), extra = written, argv
    elif argv:
        test_files, extra = argv[:1], argv[1:]
        shown = argv[0]
    else:
        print("usage: pytest_runner.py <test file> [pytest arguments ...]", file=sys.stderr)
        return 2
    _under_bazel_tmp()
    import pytest

    args = [*test_files, "-v", "-p", "no:cacheprovider"]
    if os.environ.get("XML_OUTPUT_FILE"):
        args.append(f"--junitxml={os.environ['XML_OUTPUT_FILE']}")
    count = _Count()
    code = int(pytest.main(args + extra, plugins=[count]))
    sys.stdout.flush()
    if code in (0, NO_TESTS_COLLECTED) and count.ran == 0:
        print(NO_CASE.format(file=shown, detail=count.detail()), flush=True)
        return 1
    print(SUMMARY.format(ran=count.ran, file=shown, detail=count.detail(), cost=_cost(t0)), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
