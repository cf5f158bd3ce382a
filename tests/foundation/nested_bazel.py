"""Run a second, throw-away Bazel on this workspace from inside a test.

Build-graph facts (visibility errors, query results) can only be observed by asking Bazel, and
the Bazel running the test holds its own output base. So the test starts another one with its own
--output_user_root under TEST_TMPDIR: in batch mode for one command (bazel()), or as a server for
several (Server). It fetches nothing unless told to: the drop trees and the venv that the outer
build already extracted are handed to it with --override_repository, and it creates no
convenience symlinks in the workspace (--symlink_prefix=/).

Needs in the test's data: //:WORKSPACE (to find the source tree) and the carrier.json of each
drop repository (to find the outer extracted trees), and //tools/bazel:source_digest: what such
a test checks is the whole workspace, not only its declared inputs, and the digest (of every source
file, written at the start of each build) makes its cached result expire when any of them changes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional, Sequence

DROP_REPOS = ("cutedsl_megamoe_sm90", "cutedsl_megamoe_sm100")
WORKSPACE_NAME = "megamoe_ep"


def runfiles_root() -> Path:
    for var in ("TEST_SRCDIR", "RUNFILES_DIR"):
        if os.environ.get(var):
            return Path(os.environ[var])
    raise RuntimeError("not running under Bazel (no TEST_SRCDIR / RUNFILES_DIR)")


def workspace_root() -> Path:
    """The source workspace this test was built from (the real directory, not runfiles)."""
    marker = runfiles_root() / WORKSPACE_NAME / "WORKSPACE"
    if not marker.exists():
        raise RuntimeError(f"{marker} missing: add //:WORKSPACE to the test's data")
    return marker.resolve().parent


def bazelignored() -> List[Path]:
    """The directories //:.bazelignore takes out of this workspace (absolute paths)."""
    root = workspace_root()
    path = root / ".bazelignore"
    if not path.is_file():
        return []
    lines = (l.strip() for l in path.read_text(encoding="utf-8").splitlines())
    return [root / l for l in lines if l and not l.startswith("#")]


def outer_repo(name: str) -> Path:
    """Where the outer Bazel extracted external repository `name`."""
    marker = runfiles_root() / name / "carrier.json"
    if not marker.exists():
        raise RuntimeError(f"{marker} missing: add @{name}//:carrier.json to the test's data")
    return marker.resolve().parent


def outer_python_env() -> Path:
    """@moe_ep_python of the outer Bazel: this interpreter's venv lives in it."""
    venv = Path(sys.prefix)
    return venv.parent


def overrides(coverage_stub: bool = True, fetch: Sequence[str] = ()) -> List[str]:
    """The outer build's repositories for the nested one; `fetch` names drop repositories it must fetch itself."""
    flags = [f"--override_repository={name}={outer_repo(name)}" for name in DROP_REPOS if name not in fetch]
    if coverage_stub:
        # .bazelrc reaches the coverage stub through /proc/self/cwd; spell the path out here.
        stub = workspace_root() / "tools" / "bazel" / "coverage_stub"
        flags.append(f"--override_repository=remote_coverage_tools={stub}")
    env_repo = outer_python_env()
    if (env_repo / "BUILD.bazel").exists():
        flags.append(f"--override_repository=moe_ep_python={env_repo}")
    return flags


def _env(tmp: Path, extra: Optional[dict] = None) -> dict:
    env = dict(os.environ)
    env["HOME"] = str(tmp)
    # The outer test's runfiles variables would mislead the nested Bazel's own tools.
    for var in ("RUNFILES_DIR", "RUNFILES_MANIFEST_FILE", "TEST_SRCDIR", "PYTHONPATH", "XML_OUTPUT_FILE"):
        env.pop(var, None)
    env.update(extra or {})
    return env


def _exe() -> str:
    exe = shutil.which("bazel")
    if not exe:
        raise RuntimeError("bazel is not on PATH")
    return exe


def _tmp() -> Path:
    return Path(os.environ.get("TEST_TMPDIR") or tempfile.mkdtemp())


def _run(cmd: List[str], cwd: Path, env: dict, timeout: int) -> subprocess.CompletedProcess:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=timeout)


def bazel(command: str, args: Sequence[str], timeout: int = 600, cwd: Optional[Path] = None,
          coverage_stub: bool = True, fetch: Sequence[str] = (), env: Optional[dict] = None,
          ) -> subprocess.CompletedProcess:
    """`bazel <command> <overrides> <args>` in batch mode; returns the finished process.

    cwd: the workspace to run in (default: this one), e.g. examples/downstream, a workspace of its
    own that reaches this one as @megamoe_ep; the same overrides apply there.
    coverage_stub=False leaves @remote_coverage_tools to the workspace's own .bazelrc (what a
    consumer writes is then what is tested). fetch: drop repositories not handed over (the nested
    build fetches them itself). env: added to the nested Bazel's environment."""
    tmp = _tmp()
    root = tmp / "nested_bazel"
    root.mkdir(parents=True, exist_ok=True)
    cmd = [_exe(), f"--output_user_root={root}", "--batch", "--nohome_rc", command,
           *overrides(coverage_stub, fetch), *args]
    return _run(cmd, cwd or workspace_root(), _env(tmp, env), timeout)


class Server:
    """A nested Bazel server for several commands in one workspace: each command after the first reuses the
    packages and analysis already loaded, where batch mode (bazel() above) starts and loads anew every time.
    Its output root is under TEST_TMPDIR; shutdown() ends it (and it ends itself after max_idle_s)."""

    def __init__(self, cwd: Optional[Path] = None, coverage_stub: bool = True, max_idle_s: int = 120):
        self.cwd = cwd or workspace_root()
        self.coverage_stub = coverage_stub
        self.tmp = _tmp()
        self.root = self.tmp / "nested_bazel_server"
        self.root.mkdir(parents=True, exist_ok=True)
        self.startup = [_exe(), f"--output_user_root={self.root}", "--nohome_rc", f"--max_idle_secs={max_idle_s}"]

    def run(self, command: str, args: Sequence[str], timeout: int = 600) -> subprocess.CompletedProcess:
        cmd = [*self.startup, command, *overrides(self.coverage_stub), *args]
        return _run(cmd, self.cwd, _env(self.tmp), timeout)

    def shutdown(self) -> None:
        subprocess.run([*self.startup, "shutdown"], cwd=self.cwd, env=_env(self.tmp), stdin=subprocess.DEVNULL,
                       capture_output=True, timeout=120)


def errors(proc: subprocess.CompletedProcess, limit: int = 40) -> str:
    """The ERROR lines of a nested Bazel's stderr (else its tail), for failure messages."""
    lines = proc.stderr.splitlines()
    picked = [l for l in lines if l.startswith(("ERROR", " - ", "FAILED"))] or lines[-limit:]
    return "\n".join(picked[:limit])
