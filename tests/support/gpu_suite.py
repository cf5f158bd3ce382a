"""An arch's GPU suite in one command, without Bazel: every test the BUILD files declare with `gpu_py_test` for that
arch (what `bazel test //... --config=hopper` adds for sm90), each run the way Bazel runs it (its main file, from
the repository root, MOE_EP_ARCH set), one after the other, with a log per test and a verdict table.

    python -m tests.support.gpu_suite --arch sm90 --out "$OUT/gpu_suite"        # from the repository root, on the
                                                                                 # GPU host, the tree exported
    python -m tests.support.gpu_suite --arch sm90 --dry-run                      # what it would run (any host)
    python -m tests.support.gpu_suite --arch sm90 --budget-s 400 --out "$OUT/gpu_suite"   # within a device lease

The suites' own per-case JSON lines (tests/support/gpu.py CaseLog) go to <out>/<test>.rank<r>.jsonl; the verdicts to
<out>/gpu_suite.json, rewritten after every test so that a run cut short still leaves its verdicts. --budget-s
caps the whole run: each test's timeout is what is left of it, and a test it leaves no time for is listed as not
run (rc None), never passed. --nproc sets the ranks of the multi-rank suites (MOE_EP_NPROC; default: this host's GPUs).
Exit status 0 when every test passed, 1 otherwise. A GPU test that cannot find its GPUs fails (tests/support/gpu.py):
nothing here skips.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[2]
ARCHS = ("sm90", "sm100")  # tools/bazel/py.bzl GPU_ARCHS: a gpu_py_test without `archs` runs on both
MIN_TEST_S = 30.0  # a test started with less than this left would only time out


def _literal(node: ast.AST, default=None):
    try:
        return ast.literal_eval(node)
    except ValueError:
        return default


def gpu_tests(arch: str, root: Path = ROOT) -> List[Dict]:
    """Every gpu_py_test of tests/ whose archs include `arch`: {name, main (repository path), env}, in path order."""
    out = []
    for build in sorted((root / "tests").rglob("BUILD*")):
        for node in ast.walk(ast.parse(build.read_text(encoding="utf-8"), str(build))):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "gpu_py_test"):
                continue
            kw = {k.arg: _literal(k.value) for k in node.keywords}
            if arch not in (kw.get("archs") or ARCHS):
                continue
            srcs = kw.get("srcs") or []
            main = kw.get("main") or (srcs[0] if len(srcs) == 1 else None)
            if not main:
                raise ValueError(f"{build.relative_to(root)}: gpu_py_test {kw.get('name')!r} names no main file")
            out.append(dict(name=f"{kw['name']}_{arch}", package=build.parent.relative_to(root).as_posix(),
                            main=(build.parent / main).relative_to(root).as_posix(), env=dict(kw.get("env") or {})))
    return out


def _summary(log: str) -> str:
    """The last pytest summary line of a log ("3 passed in 41.2s", "1 failed, 2 passed ..."), else its last line."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if any(w in ln for w in (" passed", " failed", " error", "no tests ran")):
            return ln.strip("= ")
    return lines[-1][:200] if lines else "(no output)"


def selected(arch: str, only: Optional[List[str]] = None, root: Path = ROOT) -> List[Dict]:
    """The arch's GPU tests; with `only`, those whose name holds one of its words, in its order (under a budget,
    what matters most runs first)."""
    tests = gpu_tests(arch, root)
    if not only:
        return tests
    return sorted((t for t in tests if any(o in t["name"] for o in only)),
                  key=lambda t: next(n for n, o in enumerate(only) if o in t["name"]))


def run(arch: str, out: Path, nproc: int, timeout_s: float, only: Optional[List[str]] = None,
        budget_s: float = math.inf, root: Path = ROOT, min_test_s: float = MIN_TEST_S) -> List[Dict]:
    out.mkdir(parents=True, exist_ok=True)
    rows: List[Dict] = []
    t0 = time.monotonic()

    def write() -> None:
        (out / "gpu_suite.json").write_text(json.dumps(dict(arch=arch, nproc=nproc, tests=rows), indent=1) + "\n")

    for test in selected(arch, only, root):
        left = budget_s - (time.monotonic() - t0)
        if left < min_test_s:  # too little left to start a test: say so rather than time it out
            rows.append(dict(test, rc=None, seconds=0.0, summary=f"not run: the {budget_s:.0f} s budget was spent"))
            print(f"SKIP  {test['name']:<32} {0.0:7.1f} s  {rows[-1]['summary']}", flush=True)
            write()
            continue
        env = dict(os.environ, **test["env"], MOE_EP_ARCH=arch, MOE_EP_NPROC=str(nproc),
                   MOE_EP_GPU_LOG=str(out / test["name"]))
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # this one's path: the repository root on it
        start = time.monotonic()
        # Its own session: a multi-rank suite's ranks are its children, and a timeout ends them all (a rank left
        # behind would hold the output pipe open, and the GPU).
        proc = subprocess.Popen([sys.executable, test["main"]], cwd=root, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            log, _ = proc.communicate(timeout=min(timeout_s, left))
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            log, _ = proc.communicate()
            rc, log = 124, f"{log}\nTIMEOUT after {min(timeout_s, left):.0f} s"
        seconds = time.monotonic() - start
        (out / f"{test['name']}.log").write_text(log, encoding="utf-8")
        row = dict(test, rc=rc, seconds=round(seconds, 1), summary=_summary(log))
        rows.append(row)
        print(f"{'PASS' if rc == 0 else 'FAIL'}  {row['name']:<32} {seconds:7.1f} s  {row['summary']}", flush=True)
        write()
    write()
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", choices=ARCHS, default="sm90")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_suite"))
    ap.add_argument("--nproc", type=int, default=0, help="ranks of the multi-rank suites (default: this host's GPUs)")
    ap.add_argument("--timeout-s", type=float, default=1200.0, help="per test")
    ap.add_argument("--budget-s", type=float, default=math.inf, help="the whole run (tests it leaves out: not run)")
    ap.add_argument("--only", nargs="*", help="run the tests whose name contains one of these, in this order")
    ap.add_argument("--dry-run", action="store_true", help="list the tests and their commands, run nothing")
    args = ap.parse_args(argv)
    if args.dry_run:
        for t in selected(args.arch, args.only):
            env = " ".join(f"{k}={v}" for k, v in sorted(t["env"].items()))
            print(f"{t['name']:<32} MOE_EP_ARCH={args.arch} {env + ' ' if env else ''}python {t['main']}")
        return 0
    nproc = args.nproc
    if nproc <= 0:
        import torch

        nproc = max(1, torch.cuda.device_count() if torch.cuda.is_available() else 1)
    rows = run(args.arch, Path(args.out), nproc, args.timeout_s, args.only, args.budget_s)
    failed = [r["name"] for r in rows if r["rc"] != 0]
    print(f"{len(rows) - len(failed)} of {len(rows)} {args.arch} GPU tests passed" +
          (f"; failed or not run: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
