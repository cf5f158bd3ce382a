"""#35's device batch on one H200, in one command that ends inside its time: tune, then time side by side.

    python3 -m tools.tune.batch --out $OUT [--total-s 480] [--bench-s 150]      (GPU host, after site.sh)
    python3 -m tools.tune.batch --dry-run                                       (any host: the plan and its times)

1. `python -m tools.tune --preset issue35` (tools/tune/tune.py: the keys in value order, W4A8 and per-tensor FP8 at
   DeepSeek-V3's capacities, then Qwen3-235B-A22B, Kimi-K2 and GLM-4.5 at EP=8's local expert counts) into
   shim/sm90/tables/h200.json, with what is left of --total-s after --bench-s as its budget: every key it finishes,
   or stops with a checked best, is written; the rest wait for the next run of the same command.
2. `python -m tools.bench.w4a8 --skip-checks` on the table the tune just wrote: blockwise FP8, per-tensor FP8 and
   W4A8 side by side at T = 1..4096 (graph replay, one run) against #35's targets, and the ablation (where W4A8's
   time goes: the fixed part, the weight stream, the dequant, the operand order).
Writes into --out (at most 8 files, as the device tool brings back): h200.json (the table), tune.log, bench.log,
report.md and timing.png of the bench, bench.tgz (its JSON / CSV records); prints the tune's per-key summary and the
bench's report last.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import List, Optional

REPO = Path(__file__).resolve().parents[2]
TABLE = REPO / "shim" / "sm90" / "tables" / "h200.json"
# Per-key stage sizes of the batch: 21 candidates a key, ~10 keys in the tune's share of ~9 minutes (round 3's rate).
STAGES = ("--stage1", "7", "--stage2", "4", "--stage3", "8", "--stage4", "2")
STARTUP_S = 20  # a worker pool's start and its first imports, before the budget's clock means anything


def _run(cmd: List[str], log: Path, limit_s: float) -> int:
    """Runs cmd with its output into log (and a line per step here), killed at limit_s; its exit status."""
    print(f"[batch] {' '.join(cmd[2:])}  (at most {limit_s:.0f} s)", flush=True)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
        try:
            return proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # its own session: the command and its workers, nothing else
            proc.wait()
            f.write(f"\n[batch] killed at {limit_s:.0f} s\n")
            return 124


def plan(total_s: float, bench_s: float, grace_s: float) -> dict:
    """The tune's budget: what --total-s leaves after the bench, the tune's grace for jobs in flight and its start."""
    tune_budget = total_s - bench_s - grace_s - STARTUP_S
    if tune_budget < 60:
        raise SystemExit(f"--total-s {total_s:.0f} leaves the tune {tune_budget:.0f} s after the bench's {bench_s:.0f} "
                         "s: give it more, or the bench less")
    return dict(tune_budget=tune_budget, tune_limit=tune_budget + grace_s + STARTUP_S + 15, bench_budget=bench_s - 45,
                bench_limit=bench_s)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.tune.batch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "batch_out"))
    ap.add_argument("--total-s", type=float, default=480.0, help="the whole batch, tune and bench")
    ap.add_argument("--bench-s", type=float, default=150.0, help="the bench's share, at the end")
    ap.add_argument("--grace-s", type=float, default=40.0, help="the tune's wait for jobs in flight at its budget")
    ap.add_argument("--workers", type=int, default=0, help="compile workers of each step (default: cores - 2)")
    ap.add_argument("--dry-run", action="store_true", help="the plan: the tune's keys and the bench's jobs, no GPU")
    args = ap.parse_args(argv)
    p = plan(args.total_s, args.bench_s, args.grace_s)
    workers = args.workers or max(1, min(14, (os.cpu_count() or 4) - 2))
    tune_cmd = [sys.executable, "-m", "tools.tune", "--preset", "issue35", "--table", str(TABLE), "--workers",
                str(workers), "--budget-s", f"{p['tune_budget']:.0f}", "--grace-s", f"{args.grace_s:.0f}", *STAGES]
    if args.dry_run:
        print(f"[batch dry run] tune budget {p['tune_budget']:.0f} s (killed at {p['tune_limit']:.0f}), bench budget "
              f"{p['bench_budget']:.0f} s (killed at {p['bench_limit']:.0f}); {workers} workers here")
        from tools.bench import w4a8
        from tools.tune import tune

        rc = tune.main(tune_cmd[3:] + ["--dry-run"])
        return rc or w4a8.main(["--dry-run"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="issue35_"))
    started = time.perf_counter()
    rc_tune = _run(tune_cmd, out / "tune.log", p["tune_limit"])
    shutil.copy(TABLE, out / "h200.json")
    left = args.total_s - (time.perf_counter() - started)
    bench_limit = max(60.0, min(p["bench_limit"], left))
    rc_bench = _run([sys.executable, "-m", "tools.bench.w4a8", "--skip-checks", "--out", str(work / "bench"),
                     "--workers", str(min(workers, 12)), "--budget-s", f"{max(30.0, bench_limit - 45):.0f}"],
                    out / "bench.log", bench_limit)
    bench = work / "bench"
    for name in ("report.md", "timing.png"):
        if (bench / name).exists():
            shutil.copy(bench / name, out / name)
    with tarfile.open(out / "bench.tgz", "w:gz") as tar:
        if bench.exists():
            tar.add(bench, arcname="bench")
    # The end of the output is what comes back inline: the tune's summary, then the side-by-side report.
    tune_lines = [line for line in (out / "tune.log").read_text().splitlines()
                  if line.startswith("| ") or line.startswith("|---") or line.startswith("[tune] done")
                  or "wrote" in line or "nothing written" in line]
    print("\n".join(tune_lines))
    report = bench / "report.md"
    print(report.read_text() if report.exists() else (out / "bench.log").read_text()[-6000:])
    print(f"[batch] tune rc={rc_tune}, bench rc={rc_bench}, {time.perf_counter() - started:.0f} s", flush=True)
    return rc_tune or rc_bench


if __name__ == "__main__":
    sys.exit(main())
