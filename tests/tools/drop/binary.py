"""The real `//tools:drop` binary, run as `bazel run //tools:drop -- ...` runs it.

Tests that depend on `//tools/drop:drop` as data find it in their runfiles, with its own runfiles merged in (both
pinned trees among them, as `bazel run` gives them); run outside Bazel, they take the one `bazel build //tools:drop`
left in bazel-bin/. Either way the process starts the way `bazel run` starts it: Bazel's Python stub puts every
runfiles repository on PYTHONPATH, and BUILD_WORKSPACE_DIRECTORY / BUILD_WORKING_DIRECTORY name the checkout and the
caller's directory. So a difference between the binary and `python -m tools.drop` fails these tests.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path
from typing import Dict, Optional, Sequence

__all__ = ["Run", "drop_binary", "run_drop"]

_RUNFILES_VARS = ("RUNFILES_DIR", "RUNFILES_MANIFEST_FILE", "PYTHON_RUNFILES", "TEST_SRCDIR")


def drop_binary(repo: Path) -> Path:
    for var in ("TEST_SRCDIR", "RUNFILES_DIR"):
        base = os.environ.get(var)
        if base:
            for workspace in ("megamoe_ep", "__main__"):
                found = Path(base) / workspace / "tools" / "drop" / "drop"
                if found.is_file():
                    return found
    built = Path(repo) / "bazel-bin" / "tools" / "drop" / "drop"
    if built.is_file():
        return built
    raise FileNotFoundError("the //tools:drop binary is not built: run `bazel build //tools:drop` (a Bazel test gets "
                            "it as data from //tools/drop:drop)")


@dataclasses.dataclass
class Run:
    code: int
    stdout: str
    stderr: str

    @property
    def verdict(self) -> str:
        """What stays on screen: the verdict block the terminal output ends with."""
        return self.stdout.split("[verdict] ", 1)[-1]


def _start_dir(binary: Path) -> Path:
    """Where `bazel run` starts the binary: its runfiles' workspace directory."""
    own = binary.with_name(binary.name + ".runfiles") / "megamoe_ep"
    return own if own.is_dir() else binary.parents[2]


def run_drop(repo: Path, args: Sequence[str], *, cwd: Path, env: Optional[Dict[str, str]] = None,
             timeout: float = 1200) -> Run:
    """`bazel run //tools:drop -- ARGS` typed in directory `cwd` of checkout `repo`."""
    binary = drop_binary(repo)
    environ = dict(os.environ if env is None else env)
    if not any(os.environ.get(v) for v in ("TEST_SRCDIR", "RUNFILES_DIR")):
        for var in _RUNFILES_VARS:  # outside Bazel: the binary finds its own runfiles next to it
            environ.pop(var, None)
    environ.update(BUILD_WORKSPACE_DIRECTORY=str(repo), BUILD_WORKING_DIRECTORY=str(cwd))
    proc = subprocess.run([str(binary), *args], cwd=str(_start_dir(binary)), env=environ, capture_output=True,
                          text=True, timeout=timeout)
    return Run(proc.returncode, proc.stdout, proc.stderr)
