"""Does a normal run end quietly? Runs what users run, keeps every process's output, and looks in it for the two
end-of-run complaints (#25.5): NVSHMEM's "Some NVSHMEM Symmetric memory was not freed explicitly" and torch's
"destroy_process_group() was not called".

    python3 -m tools.diag.clean_end --nproc 2 --out DIR          (GPU host; --device cpu runs the same on CPU ranks)

Cases, each in fresh processes:
  scenario      every rank: init_from_env, one layer checked against the oracle and closed (the main job's rank
                work, tools/main.py), then the end of the program with the group still up
  open_layer    every rank: init_from_env, one layer built and called and never closed, then the end
  main          the main job itself (`python -m tools.main --ranks N`): its exit status and its own output
  bench         the benchmark at world size 1 (`python -m tools.bench --quick --geoms small --tokens 8`), GPU only
Prints one row per case (exit status, the complaints found, a traceback found) and writes clean_end.json and every
process's output under --out. Exit status 0 when every case ended with status 0 and no complaint.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMPLAINTS = {
    "nvshmem_leak": "Symmetric memory was not freed explicitly",
    "pg_not_destroyed": "destroy_process_group() was not called",
    "nvshmem_error": "NVSHMEM ERROR",
}
SMALL = dict(hidden_size=1024, intermediate_size=256, num_experts=32, top_k=8)


def rank_main(case: str) -> int:
    """One rank of `scenario` / `open_layer`: ends by returning, leaving the teardown to the interpreter's exit."""
    import torch

    import moe_ep
    from moe_ep.testing.problems import Problem
    from moe_ep.testing.scenario import run_scenario

    ctx = moe_ep.init_from_env()
    if case == "scenario":
        r = run_scenario(ctx, tokens=37, **SMALL)
        print(f"rank {ctx.rank}: {r['backend']} {r['fmt']} oracle {'ok' if r['ok'] else 'FAILED'}", flush=True)
        return 0 if r["ok"] else 1
    spec = moe_ep.MoESpec(max_tokens_per_rank=64, **SMALL)
    problem = Problem.build(spec, ctx.world_size, [37] * ctx.world_size, "balanced", 0, 0)
    layer = moe_ep.MoELayer(spec, problem.rank_weights(ctx.rank), group=ctx.group, device=ctx.device)
    hidden, idx, w = (x.to(ctx.device) for x in problem.inputs(ctx.rank))
    out = layer(hidden, idx, w)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
    print(f"rank {ctx.rank}: {layer.backend_name} left open, out {tuple(out.shape)}", flush=True)
    return 0


def _findings(text: str) -> dict:
    found = {k: text.count(v) for k, v in COMPLAINTS.items()}
    found["traceback"] = text.count("Traceback (most recent call last)")
    return found


def _ranks(case: str, nproc: int, device: str, out: Path) -> dict:
    from tools.launch.launcher import launch

    t = time.time()
    results = launch(["-m", "tools.diag.clean_end", "--rank", case], nproc, device=device, timeout_s=600,
                     cwd=str(REPO))
    text = ""
    for r in results:
        (out / f"{case}.rank{r.rank}.log").write_text(r.output)
        text += r.output
    return dict(case=case, returncodes=[r.returncode for r in results], seconds=round(time.time() - t, 1),
                **_findings(text))


def _process(case: str, cmd, out: Path) -> dict:
    t = time.time()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, *cmd], cwd=str(REPO), env=env, capture_output=True, text=True,
                          timeout=900)
    text = proc.stdout + proc.stderr
    (out / f"{case}.log").write_text(text)
    return dict(case=case, returncodes=[proc.returncode], seconds=round(time.time() - t, 1), **_findings(text))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "clean_end_out"))
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--rank", choices=("scenario", "open_layer"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank:
        return rank_main(args.rank)
    from tools.require import require

    require("clean_end", args.device, count=args.nproc if args.device == "cuda" else 1, count_argument="--nproc")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [_ranks("scenario", args.nproc, args.device, out), _ranks("open_layer", args.nproc, args.device, out),
            _process("main", ["-m", "tools.main", "--ranks", str(args.nproc), "--device", args.device], out)]
    if args.device == "cuda":
        rows.append(_process("bench", ["-m", "tools.bench", "--quick", "--geoms", "small", "--tokens", "8",
                                       "--ref-max-tokens", "0", "--out", str(out / "bench")], out))
    cols = ["case", "returncodes", "nvshmem_leak", "pg_not_destroyed", "nvshmem_error", "traceback", "seconds"]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    (out / "clean_end.json").write_text(json.dumps(rows, indent=1))
    clean = all(set(r["returncodes"]) == {0} and not any(r[k] for k in (*COMPLAINTS, "traceback")) for r in rows)
    print("clean end: " + ("yes" if clean else "NO (logs under " + str(out) + ")"))
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
