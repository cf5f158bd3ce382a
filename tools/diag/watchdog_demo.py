"""The forward watchdog on a real job (#14): a loop of MoE forwards on N ranks with a fault on one of them.

One scenario, every rank through the launcher (what the wrapper below runs):

    MOE_EP_TIMEOUT_S=5 python3 -m tools.launch.launcher --nproc 2 --device cuda -- \\
        tools/diag/watchdog_demo.py --scenario kill --out DIR

All four, one launch each, timed and summarised (the GPU run of #14; about 2-4 minutes on two H200s), from the
repository root:

    python3 -m tools.diag.watchdog_demo --all --device cuda --bound 5 --out DIR

  normal  1000 forwards on every rank: the watchdog never trips, every rank exits 0
  kill    rank 1 SIGKILLs itself inside call 100 of 200
  skip    rank 1 leaves call 100 out and goes on: the others' last call has no partner
  stall   rank 1 sleeps bound + 10 s inside call 100 (it trips itself too: its own call passes the bound)
  (and, with --scenario only: stall_before, rank 1 sleeps before call 100, outside the layer)

On CUDA one warm-up call runs first under a 60 s bound (a first call may capture a graph or compile), so the
messages name the layer's call k + 1 for the loop's call k (--warmup).

Each surviving rank must end within bound + 5 s of the fault, with exit code moe_ep.WATCHDOG_EXIT_CODE and the
watchdog's message on stderr. The wrapper writes DIR/watchdog_demo.json (every rank: exit code, seconds from
the fault to its exit, the message), DIR/watchdog_demo.md (a table) and DIR/<scenario>.rank<r>.log. Each
scenario is one launch with a wall-clock limit (--scenario-timeout), so a watchdog bug cannot hang the run.

On CUDA: the Hopper FP8 kernel (sm90_fp8_cutedsl), H 2048 / I 768 / 16 experts / top-4, capacity 128, 128
tokens per rank, check_values / collective_checks off (the hot path); the sm90 tree from $MOE_EP_SM90_TREE
(README, "On a GPU host without Bazel"). On CPU (--device cpu, what CI runs): the torch reference behind a
spin barrier on files (moe_ep.testing.faults: a dead peer hangs it as it hangs the kernel), H 256 / I 128 /
4 experts per rank / top-4; --backend torch_reference gives the plain gloo one (a dead peer is an error there, not a
hang).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import List, Optional

REPO = Path(__file__).resolve().parents[2]

SCENARIOS = ("normal", "kill", "skip", "stall")
ALL_SCENARIOS = SCENARIOS + ("stall_before",)
FAULT_KIND = {"kill": "kill", "skip": "skip", "stall": "stall", "stall_before": "stall_before"}
GEOMETRY = {"cuda": dict(hidden_size=2048, intermediate_size=768, num_experts=16, top_k=4, max_tokens_per_rank=128),
            "cpu": dict(hidden_size=256, intermediate_size=128, num_experts=8, top_k=4, max_tokens_per_rank=16)}
MESSAGE_RE = re.compile(r"^moe_ep watchdog: .*?\(exit code \d+\)\.$", re.S | re.M)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", choices=ALL_SCENARIOS, help="run one scenario as this rank (under the launcher)")
    p.add_argument("--all", action="store_true", help="launch every scenario in turn and summarise")
    p.add_argument("--scenarios", nargs="+", choices=ALL_SCENARIOS, default=list(SCENARIOS),
                   help="with --all: which ones (default: %(default)s)")
    p.add_argument("--out", required=True, help="directory for logs, records and the summary")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="with --all: default cuda when a GPU is present, else cpu (a rank takes $MOE_EP_DEVICE)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--bound", type=float, default=5.0, help="with --all: MOE_EP_TIMEOUT_S for the ranks (s)")
    p.add_argument("--calls", type=int, default=None, help="forwards per rank (default: 1000 normal, 200 faults)")
    p.add_argument("--fault-call", type=int, default=100, help="the call the fault hits (1-based)")
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--stall-s", type=float, default=None, help="stall length (default: bound + 10 s)")
    p.add_argument("--backend", default=None, help="default: sm90_fp8_cutedsl on cuda, t_spin_reference on cpu")
    p.add_argument("--tokens", type=int, default=None, help="tokens per rank (default: the capacity)")
    p.add_argument("--collective-checks", action="store_true", help="layer with check_values/collective_checks on")
    p.add_argument("--warmup", type=int, default=None,
                   help="calls before the loop, under a 60 s bound (default 1 on cuda, 0 on cpu): a first call may "
                        "capture a graph or compile; the loop's call k is then the layer's call k + warmup")
    p.add_argument("--scenario-timeout", type=float, default=None,
                   help="with --all: wall-clock limit per scenario launch (default 120 s cuda, 60 s cpu: four "
                        "scenarios stay inside a 10-minute device command even if every launch hangs)")
    return p


# -- one rank ---------------------------------------------------------------------------------------------------
def _calls(args) -> int:
    return args.calls if args.calls is not None else (1000 if args.scenario == "normal" else 200)


def rank_main(args) -> int:
    import torch
    import torch.distributed as dist

    import moe_ep
    from moe_ep.core.dist import init_from_env
    from moe_ep.testing import faults
    from moe_ep.testing.problems import Problem

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = init_from_env()
    rank, world = ctx.rank, ctx.world_size
    device = ctx.device.type
    if device == "cpu":
        torch.set_num_threads(1)
    backend = args.backend or ("sm90_fp8_cutedsl" if device == "cuda" else faults.BACKEND_NAME)
    options = {}
    if backend == faults.BACKEND_NAME:
        faults.register()
        options["barrier_dir"] = str(out_dir / "barrier")
    geometry = dict(GEOMETRY[device])
    if device == "cpu":  # any rank count: 4 experts per rank
        geometry["num_experts"] = 4 * world
    spec = moe_ep.MoESpec(**geometry)
    tokens = args.tokens or spec.max_tokens_per_rank
    problem = Problem.build(spec, world, tokens, "balanced", seed=14)
    fault = None
    if args.scenario != "normal":
        seconds = args.stall_s if args.stall_s is not None else _bound_from_env() + 10.0
        fault = faults.Fault(FAULT_KIND[args.scenario], rank=args.fault_rank, call=args.fault_call, seconds=seconds)
    t0 = time.time()
    layer = moe_ep.MoELayer(spec, problem.rank_weights(rank), backend=backend, device=ctx.device,
                            check_values=args.collective_checks, collective_checks=args.collective_checks,
                            name="demo MoE layer", **options)
    build_s = time.time() - t0
    watch = layer._watch
    print(f"rank {rank}/{world}: {layer.backend_name} on {ctx.device} built in {build_s:.1f}s; watchdog bound "
          f"{watch.bound if watch else 'off'}", flush=True)
    hidden, idx, w = (x.to(ctx.device) for x in problem.inputs(rank))
    out = torch.empty((hidden.shape[0], spec.hidden_size), dtype=torch.bfloat16, device=ctx.device)
    warmup = args.warmup if args.warmup is not None else (1 if device == "cuda" else 0)
    if warmup:
        from moe_ep.core.watchdog import Bound

        bound = watch.bound if watch else None
        if watch:
            watch.bound = Bound(max(60.0, bound.seconds or 0.0), "the demo's warm-up")
        for _ in range(warmup):
            layer(hidden, idx, w, out=out)
        if device == "cuda":
            torch.cuda.synchronize()
        if watch:
            watch.bound = bound
        print(f"rank {rank}: {warmup} warm-up call(s) done; loop call k is the layer's call k + {warmup}", flush=True)
    faults.inject(layer, fault, record_dir=str(out_dir))  # counts the loop's calls from 1
    n = _calls(args)
    t_loop = time.time()
    for call in range(1, n + 1):
        if fault is not None and not fault.before_call(rank, call, str(out_dir)):
            continue
        layer(hidden, idx, w, out=out)
        if call % 100 == 0:
            print(f"rank {rank}: call {call} issued ({time.time() - t_loop:.2f}s)", flush=True)
    if device == "cuda":
        torch.cuda.synchronize()
    loop_s = time.time() - t_loop
    print(f"rank {rank}: loop of {n} calls done in {loop_s:.2f}s", flush=True)
    if fault is not None and fault.rank == rank:
        # From here on the others wait for this rank in a call it never makes (skip).
        faults.write_record(str(out_dir), rank, loop_end_t=time.time())
    record = {"rank": rank, "world": world, "scenario": args.scenario, "backend": layer.backend_name,
              "device": str(ctx.device), "calls": n, "warmup": warmup, "loop_s": loop_s, "build_s": build_s,
              "watched_calls": watch.started if watch else 0, "finite": bool(torch.isfinite(out.float()).all())}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(record))
    wait_for_peers("watchdog_demo", rank, world)
    layer.close()
    dist.destroy_process_group()
    print(f"rank {rank}: done", flush=True)
    return 0


def wait_for_peers(prefix: str, rank: int, world: int) -> None:
    """Wait for every rank through the store (keys prefix/done/<rank>), not a collective: a rank that died (the
    store's host included) ends the wait, and this rank says so and leaves (exit 3)."""
    import datetime

    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    try:
        store.set(f"{prefix}/done/{rank}", "1")
        store.wait([f"{prefix}/done/{r}" for r in range(world)], datetime.timedelta(seconds=120))
    except Exception as e:  # noqa: BLE001 - a peer is gone: say so and leave without any collective
        print(f"rank {rank}: a peer is gone after the loop ({type(e).__name__}: {str(e)[:160]})", flush=True)
        sys.stdout.flush()
        os._exit(3)


def _bound_from_env() -> float:
    from moe_ep.core import watchdog

    b = watchdog.parse_timeout(None)
    return b.seconds if b is not None and b.seconds is not None else watchdog.DEFAULT_BASE_S


# -- the wrapper: one launch per scenario ---------------------------------------------------------------------
def launch_scenario(args, scenario: str, device: str, out: Path) -> dict:
    from tools.launch.launcher import launch_timed

    sdir = out / scenario
    sdir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--scenario", scenario, "--out", str(sdir),
           "--fault-call", str(args.fault_call), "--fault-rank", str(args.fault_rank)]
    for flag, value in (("--calls", args.calls), ("--stall-s", args.stall_s), ("--backend", args.backend),
                        ("--tokens", args.tokens), ("--warmup", args.warmup)):
        if value is not None:
            cmd += [flag, str(value)]
    if args.collective_checks:
        cmd.append("--collective-checks")
    extra = {"MOE_EP_TIMEOUT_S": str(args.bound)}
    limit = args.scenario_timeout or (120.0 if device == "cuda" else 60.0)
    # A rank past the limit is hung: killed at once, no SIGTERM first.
    t_start, launched = launch_timed(cmd, [str(out / f"{scenario}.rank{r}.log") for r in range(args.nproc)],
                                     device=device, limit_s=limit, env=extra, cwd=str(REPO))
    ranks = []
    fault_rec = _read_json(sdir / f"fault.rank{args.fault_rank}.json")
    if scenario == "skip":
        fault_t = fault_rec.get("loop_end_t")  # the moment the others' last call is left without a partner
    else:
        fault_t = fault_rec.get("t")
    for lr in launched:
        r = lr.rank
        m = MESSAGE_RE.search(lr.output)
        ranks.append({"rank": r, "returncode": lr.returncode, "killed_by_wrapper": lr.returncode is None,
                      "exit_s_after_start": round(lr.exit_t - t_start, 3),
                      "exit_s_after_fault": None if fault_t is None else round(lr.exit_t - fault_t, 3),
                      "watchdog_message": m.group(0) if m else None,
                      "record": _read_json(sdir / f"rank{r}.json") or None, "log": f"{scenario}.rank{r}.log"})
    result = {"scenario": scenario, "device": device, "nproc": args.nproc, "bound_s": args.bound,
              "fault": fault_rec or None, "seconds": round(time.time() - t_start, 2), "limit_s": limit,
              "ranks": ranks}
    result["checks"] = check(result, args.fault_rank)
    result["ok"] = all(c["ok"] for c in result["checks"])
    return result


def check(result: dict, fault_rank: int) -> List[dict]:
    """What each scenario must show, one line per rank."""
    from moe_ep.core.watchdog import WATCHDOG_EXIT_CODE

    out = []
    scenario, bound = result["scenario"], result["bound_s"]
    for r in result["ranks"]:
        if scenario == "normal":
            ok = r["returncode"] == 0 and r["watchdog_message"] is None
            what = "exit 0, no watchdog message"
        elif r["rank"] == fault_rank:
            if scenario == "kill":
                ok, what = r["returncode"] == -signal.SIGKILL, "the faulty rank: killed (SIGKILL)"
            elif scenario == "stall":
                ok = r["returncode"] == WATCHDOG_EXIT_CODE and r["watchdog_message"] is not None
                what = f"the stalled rank: its own call passed the bound too (exit {WATCHDOG_EXIT_CODE})"
            else:  # skip / stall_before: it exits by itself once the others are gone (recorded, not judged)
                ok, what = r["returncode"] is not None, "the faulty rank: exits by itself"
        else:
            after = r["exit_s_after_fault"]
            ok = (r["returncode"] == WATCHDOG_EXIT_CODE and r["watchdog_message"] is not None and after is not None
                  and after <= bound + 5.0)
            what = f"exit {WATCHDOG_EXIT_CODE} with the message within bound + 5 s = {bound + 5:g} s of the fault"
        out.append({"rank": r["rank"], "ok": bool(ok), "expect": what, "returncode": r["returncode"],
                    "exit_s_after_fault": r["exit_s_after_fault"]})
    return out


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def summary_md(results: List[dict], meta: dict) -> str:
    lines = ["# moe_ep forward watchdog: fault scenarios", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    lines += ["", "| scenario | rank | exit code | s from fault to exit | expected | ok |", "|---|---|---|---|---|---|"]
    for res in results:
        for c in res["checks"]:
            after = "" if c["exit_s_after_fault"] is None else f"{c['exit_s_after_fault']:.2f}"
            lines.append(f"| {res['scenario']} | {c['rank']} | {c['returncode']} | {after} | {c['expect']} | "
                         f"{'yes' if c['ok'] else 'NO'} |")
    lines.append("")
    for res in results:
        for r in res["ranks"]:
            if r["watchdog_message"]:
                lines += [f"## {res['scenario']}: the message on rank {r['rank']}", "", "```", r["watchdog_message"],
                          "```", ""]
    return "\n".join(lines)


def run_all(args) -> int:
    import platform

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = args.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    from tools.require import require

    require("watchdog_demo", device, count=args.nproc if device == "cuda" else 1, count_argument="--nproc")
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": device, "nproc": args.nproc,
            "bound (MOE_EP_TIMEOUT_S)": args.bound, "fault": f"rank {args.fault_rank}, call {args.fault_call}",
            "python": platform.python_version(), "host": platform.node()}
    try:
        import torch

        meta["torch"] = torch.__version__
        if device == "cuda" and torch.cuda.is_available():
            meta["gpu"] = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001
        pass
    results = []
    for s in args.scenarios:
        t = time.time()
        res = launch_scenario(args, s, device, out)
        results.append(res)
        print(f"{s}: {'ok' if res['ok'] else 'FAILED'} in {time.time() - t:.1f}s  " +
              "; ".join(f"rank {c['rank']} rc={c['returncode']} after_fault={c['exit_s_after_fault']}"
                        for c in res["checks"]), flush=True)
        (out / "watchdog_demo.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    (out / "watchdog_demo.md").write_text(summary_md(results, meta))
    ok = all(r["ok"] for r in results)
    print(f"{'all scenarios ok' if ok else 'SOME SCENARIOS FAILED'}: {out / 'watchdog_demo.md'}", flush=True)
    return 0 if ok else 1


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.all == bool(args.scenario):
        _parser().error("give exactly one of --all / --scenario")
    if args.all:
        return run_all(args)
    return rank_main(args)


if __name__ == "__main__":
    sys.exit(main())
