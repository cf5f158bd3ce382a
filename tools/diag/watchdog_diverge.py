"""Ranks out of step (#28): two layers L1 and L2 of one geometry (different weights), called alternately (L1 at odd
loop calls) on N ranks; one rank falls out of step at loop call F (an L1 call) and carries on.

  skip   rank R leaves loop call F out and goes on: from there each of its calls meets its peers' call to the
         other layer
  wrong  rank R calls L2 where L1 is due at loop call F
  extra  rank R makes loop call F twice
  dead   rank R kills itself inside loop call F (in-band launch only): the survivors must get moe_ep's
         PeerLostError naming it, not gloo's RuntimeError

Every output a rank is handed is compared with what its layer returned while the ranks were in step (the inputs are
the same every call), so each record says how many wrong outputs the rank was given, and when.

In-band (CPU, the torch reference: its exchange carries every rank's call fingerprint), all cases in ONE launch,
each on a fresh process group; every rank must raise RankDivergenceError at the diverging call, before any wrong
output, name rank R, the call and both layers, and raise again at its next call:

    python3 -m tools.diag.watchdog_diverge --all --in-band --out DIR

Watchdog only (no fingerprint in the exchange: the kernel backends on N GPUs; on CPU the spin-barrier reference of
moe_ep.testing.faults, which mixes data as the kernels' shared workspace does), one launch per case; every rank must
end with exit code 86 and the watchdog's message naming rank R, the first diverging group call and both layers,
within bound + 5 s of the fault:

    python3 -m tools.diag.watchdog_diverge --all --device cuda --nproc 2 --bound 5 --out DIR
    python3 -m tools.diag.watchdog_diverge --all --device cpu --out DIR

Each writes DIR/watchdog_diverge.json (+ .md, per-rank logs and records). On CUDA: the Hopper FP8 kernel
(sm90_fp8_cutedsl), the demo's geometry (tools/diag/watchdog_demo.py), check_values / collective_checks off, one
warm-up call per layer under a 60 s bound (the references); the sm90 tree from $MOE_EP_SM90_TREE.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import List, Optional

REPO = Path(__file__).resolve().parents[2]

# Run as a file by launch() below, this still imports tools.diag: tools.launch's rank environment puts the
# repository root on PYTHONPATH (no sys.path edit here: the layering check refuses those outside shim/).
from tools.diag.watchdog_demo import GEOMETRY, MESSAGE_RE, _read_json, wait_for_peers  # noqa: E402

DIVERGE = ("skip", "wrong", "extra")
GRACE_S = 4.0  # after a loop the watchdog did not stop: beats enough to publish, compare and report
CASES = DIVERGE + ("dead",)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--all", action="store_true", help="launch the cases and summarise")
    p.add_argument("--rank", action="store_true", help="run the cases as this rank (under the launcher)")
    p.add_argument("--cases", nargs="+", default=None,
                   help=f"of {CASES} (default: skip wrong extra, and dead with --in-band); kind:default or kind:off "
                        "picks the layers' checks for one case")
    p.add_argument("--in-band", action="store_true", help="the torch reference carrying the fingerprint (CPU)")
    p.add_argument("--checks", choices=("default", "off", "both"), default="both",
                   help="in-band: the layers' check_values / collective_checks; both runs skip twice (default "
                        "checks, then off) and the other cases with the checks off")
    p.add_argument("--out", required=True)
    p.add_argument("--device", choices=("cuda", "cpu"), default=None)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--bound", type=float, default=None, help="MOE_EP_TIMEOUT_S (default 5 cuda, 2 cpu; 20 in-band)")
    p.add_argument("--calls", type=int, default=None,
                   help="loop calls per case (default 40 in-band, 400 cpu, 5000 cuda: a few seconds)")
    p.add_argument("--fault-call", type=int, default=21, help="the loop call the fault hits (odd: an L1 call)")
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--backend", default=None,
                   help="default: torch_reference in-band, t_spin_reference on cpu, sm90_fp8_cutedsl on cuda")
    p.add_argument("--scenario-timeout", type=float, default=None, help="per launch (default 120 s cuda, 60 cpu)")
    return p


# -- one rank --------------------------------------------------------------------------------------------------
class Recorder:
    """The rank's record of a case, rewritten after every call: the watchdog may end the process at any moment."""

    def __init__(self, out_dir: Path, rank: int, case: str):
        self.path = out_dir / f"{case}.rank{rank}.json"
        self.rec = {"case": case, "rank": rank, "calls_returned": 0, "wrong_returned": 0, "first_wrong_loop_call": None,
                    "error": None, "error_at_loop_call": None, "next_call": None, "fault_t": None}
        self.save()

    def save(self):
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.rec))
        os.replace(tmp, self.path)


def _error(e: BaseException) -> dict:
    return {"type": type(e).__name__, "message": str(e), "ranks": list(getattr(e, "ranks", ()) or ()),
            "call": getattr(e, "call", None), "layers": list(getattr(e, "layers", ()) or ())}


def rank_main(args) -> int:
    import torch
    import torch.distributed as dist

    import moe_ep
    from moe_ep.core.dist import init_from_env
    from moe_ep.core.watchdog import Bound, parse_timeout
    from moe_ep.testing import faults
    from moe_ep.testing.problems import Problem

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = init_from_env()
    rank, world = ctx.rank, ctx.world_size
    device = ctx.device
    cpu = device.type == "cpu"
    if cpu:
        torch.set_num_threads(1)
    backend = args.backend or ("torch_reference" if args.in_band else
                               faults.BACKEND_NAME if cpu else "sm90_fp8_cutedsl")
    options = {}
    if backend == faults.BACKEND_NAME:
        faults.register()
        options["barrier_dir"] = str(out_dir / "barrier")
    geometry = dict(GEOMETRY["cpu" if cpu else "cuda"])
    if cpu:
        geometry["num_experts"] = 4 * world
    spec = moe_ep.MoESpec(**geometry)
    tokens = spec.max_tokens_per_rank
    problems = [Problem.build(spec, world, tokens, "balanced", seed=s) for s in (28, 29)]
    hidden, idx, w = (x.to(device) for x in problems[0].inputs(rank))
    F, R = args.fault_call, args.fault_rank
    cases = _rank_cases(args)
    print(f"rank {rank}/{world}: {backend} on {device}, cases {cases}", flush=True)
    for case in cases:
        kind, checks = case.split(":") if ":" in case else (case, "off")
        # In-band, every case gets a process group of its own (a group that fell out of step stays refused).
        group = dist.new_group(list(range(world))) if args.in_band else None
        rec = Recorder(out_dir, rank, _tag(case))
        # "default": the constructor's own schedule (None: values on the first call of a shape, the ranks' agreement
        # on a layer's first calls); "off": none at all.
        on = None if checks == "default" else False
        layers = [moe_ep.MoELayer(spec, p.rank_weights(rank), backend=backend, group=group, device=device,
                                  check_values=on, collective_checks=on, name=f"{_tag(case)}.L{k + 1}", **options)
                  for k, p in enumerate(problems)]
        refs = []
        for layer in layers:  # in step: what each layer returns for these inputs (the warm-up calls)
            if layer.watch is not None and not cpu:
                layer.watch.bound = Bound(max(60.0, layer.watch.bound.seconds or 0.0), "the warm-up")
            refs.append(layer(hidden, idx, w).clone())
        if not cpu:
            torch.cuda.synchronize()
        bound = parse_timeout(None)
        for layer in layers:
            if layer.watch is not None:
                layer.watch.bound = bound
        if kind == "dead":
            faults.inject(layers[0], faults.Fault("kill", rank=R, call=F), record_dir=str(out_dir))
        plan = []  # (loop call, layer index) as this rank makes them
        for i in range(1, args.calls + 1):
            k = 0 if (kind == "dead" or i % 2) else 1
            if rank == R and i == F and kind in DIVERGE:
                rec.rec["fault_t"] = time.time()
                rec.save()
                print(f"rank {rank}: {kind} at loop call {i}", flush=True)
                if kind == "skip":
                    continue
                if kind == "wrong":
                    k = 1 - k
                if kind == "extra":
                    plan.append((i, k))
            plan.append((i, k))
        dist.barrier()  # every rank starts the loop together (the default group: this one may be refused)
        t_loop = time.time()
        try:
            for i, k in plan:
                got = layers[k](hidden, idx, w)
                ok = _same(got, refs[k])
                rec.rec["calls_returned"] += 1
                if not ok:
                    rec.rec["wrong_returned"] += 1
                    if rec.rec["first_wrong_loop_call"] is None:
                        rec.rec["first_wrong_loop_call"] = i
                rec.save()
        except moe_ep.MoEError as e:
            rec.rec.update(error=_error(e), error_at_loop_call=i, error_t=time.time())
            print(f"rank {rank}: {type(e).__name__} at loop call {i}: {e}", flush=True)
            if isinstance(e, moe_ep.RankDivergenceError):
                t = time.time()
                try:  # the group's next call must be refused at once, with the same error
                    layers[1 - k](hidden, idx, w)
                    rec.rec["next_call"] = "returned"
                except moe_ep.MoEError as e2:
                    rec.rec["next_call"] = {"type": type(e2).__name__, "s": round(time.time() - t, 4),
                                            "call": getattr(e2, "call", None)}
            rec.save()
            if isinstance(e, moe_ep.PeerLostError):  # the peer is gone: no collective may follow
                sys.stdout.flush()
                os._exit(0)
        rec.rec["loop_s"] = round(time.time() - t_loop, 3)
        rec.save()
        if not cpu:
            torch.cuda.synchronize()
        if not args.in_band:
            # Out of step, nothing caught it in the loop (a short loop, or calls that realigned in number after a
            # wrong one): the watchdog compares the last calls within a few beats, with the layers open.
            time.sleep(GRACE_S)
            # Then wait for the peers through the store, as the demo does; a peer gone ends the wait.
            wait_for_peers(f"watchdog_diverge/{case}", rank, world)
        for layer in layers:
            layer.close()
        dist.barrier()
    print(f"rank {rank}: done", flush=True)
    dist.destroy_process_group()
    return 0


def _rank_cases(args) -> List[str]:
    cases = args.cases or (list(CASES) if args.in_band else list(DIVERGE))
    out = []
    for c in cases:
        if ":" in c:
            out.append(c)
        elif args.in_band and c == "skip" and args.checks == "both":
            out += ["skip:default", "skip:off"]
        elif args.in_band and c in DIVERGE:
            out.append(f"{c}:{'default' if args.checks == 'default' else 'off'}")
        else:
            out.append(c)
    dead = [c for c in out if c == "dead"]  # last: it ends the launch
    return [c for c in out if c != "dead"] + dead


def _tag(case: str) -> str:
    """The layers' name prefix of a case: skip:off -> skip_off."""
    return case.replace(":", "_")


def _same(got, ref) -> bool:
    if got.shape != ref.shape:
        return False
    if got.device.type == "cpu":
        return bool((got == ref).all())
    g, r = got.float(), ref.float()
    return float((g - r).norm()) <= 1e-2 * float(r.norm()) + 1e-6


# -- the wrapper -----------------------------------------------------------------------------------------------
def launch(args, name: str, cases: List[str], device: str, out: Path) -> dict:
    from tools.launch.launcher import launch_timed

    sdir = out / name
    sdir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--rank", "--out", str(sdir), "--cases", *cases,
           "--fault-call", str(args.fault_call), "--fault-rank", str(args.fault_rank), "--calls", str(args.calls),
           "--checks", args.checks]
    if args.in_band:
        cmd.append("--in-band")
    if args.backend:
        cmd += ["--backend", args.backend]
    limit = args.scenario_timeout or (120.0 if device == "cuda" else 60.0)
    t_start, launched = launch_timed(cmd, [str(out / f"{name}.rank{r}.log") for r in range(args.nproc)],
                                     device=device, limit_s=limit, env={"MOE_EP_TIMEOUT_S": str(args.bound)},
                                     cwd=str(REPO))
    ranks = []
    for lr in launched:
        r, text = lr.rank, lr.output
        m = MESSAGE_RE.search(text)
        records = {c: _read_json(sdir / f"{_tag(c)}.rank{r}.json") for c in cases}
        ranks.append({"rank": r, "returncode": lr.returncode, "killed_by_wrapper": lr.returncode is None,
                      "exit_t": lr.exit_t, "watchdog_message": m.group(0) if m else None, "records": records,
                      "log": f"{name}.rank{r}.log", "log_tail": text[-1500:]})
    return {"launch": name, "cases": cases, "device": device, "in_band": args.in_band, "nproc": args.nproc,
            "bound_s": args.bound, "seconds": round(time.time() - t_start, 2), "ranks": ranks}


def check(res: dict, fault_rank: int) -> List[dict]:
    """What each case must show, one line per (case, rank)."""
    out = []
    for case in res["cases"]:
        kind = case.split(":")[0]
        for r in res["ranks"]:
            rec = r["records"].get(case) or {}
            fault = (res["ranks"][fault_rank]["records"].get(case) or {}).get("fault_t")
            if res["in_band"] and kind in DIVERGE:
                e = rec.get("error") or {}
                text = e.get("message", "")
                ok = (e.get("type") == "RankDivergenceError" and e.get("ranks") == [fault_rank]
                      and f"rank {fault_rank}" in text and f"'{_tag(case)}.L1'" in text
                      and f"'{_tag(case)}.L2'" in text
                      and rec.get("wrong_returned") == 0
                      and (rec.get("next_call") or {}).get("type") == "RankDivergenceError")
                what = "RankDivergenceError naming the rank and both layers, no wrong output, the next call refused"
                after = None
            elif kind == "dead":
                e = rec.get("error") or {}
                if r["rank"] == fault_rank:
                    ok, what = r["returncode"] == -signal.SIGKILL, "killed itself (SIGKILL)"
                else:
                    ok = (e.get("type") == "PeerLostError" and e.get("ranks") == [fault_rank]
                          and f"rank {fault_rank}" in e.get("message", "") and rec.get("wrong_returned") == 0)
                    what = "PeerLostError naming the dead rank"
                after = None
            else:
                text = r["watchdog_message"] or ""
                after = None if fault is None else round(r["exit_t"] - fault, 3)
                ok = (r["returncode"] == 86 and "fell out of step at group call" in text
                      and f"out of step: rank {fault_rank}" in text and f"'{_tag(case)}.L1'" in text
                      and f"'{_tag(case)}.L2'" in text and after is not None and after <= res["bound_s"] + 5.0)
                what = "exit 86 with the message naming the rank and both layers within bound + 5 s"
            out.append({"case": case, "rank": r["rank"], "ok": bool(ok), "expect": what, "returncode": r["returncode"],
                        "exit_s_after_fault": after, "wrong_returned": rec.get("wrong_returned"),
                        "calls_returned": rec.get("calls_returned"), "error": (rec.get("error") or {}).get("type")})
    return out


def summary_md(results: List[dict], meta: dict) -> str:
    lines = ["# moe_ep: ranks out of step", ""] + [f"- {k}: {v}" for k, v in meta.items()]
    lines += ["", "| launch | case | rank | exit | s fault->exit | outputs returned | wrong ones | error | ok |",
              "|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        for c in res["checks"]:
            after = "" if c["exit_s_after_fault"] is None else f"{c['exit_s_after_fault']:.2f}"
            lines.append(f"| {res['launch']} | {c['case']} | {c['rank']} | {c['returncode']} | {after} | "
                         f"{c['calls_returned']} | {c['wrong_returned']} | {c['error'] or ''} | "
                         f"{'yes' if c['ok'] else 'NO'} |")
    for res in results:
        for r in res["ranks"]:
            if r["watchdog_message"]:
                lines += ["", f"## {res['launch']}: the message on rank {r['rank']}", "", "```", r["watchdog_message"],
                          "```"]
            for case, rec in r["records"].items():
                if rec and rec.get("error"):
                    lines += ["", f"## {res['launch']} {case}: rank {r['rank']} raised {rec['error']['type']}", "",
                              "```", rec["error"]["message"], "```"]
    return "\n".join(lines) + "\n"


def run_all(args) -> int:
    import platform

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = args.device
    if args.in_band and device != "cpu":
        print("--in-band runs on CPU (the torch reference over gloo)", file=sys.stderr)
        return 2
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": device, "nproc": args.nproc, "in_band": args.in_band,
            "bound (MOE_EP_TIMEOUT_S)": args.bound, "fault": f"rank {args.fault_rank}, loop call {args.fault_call}",
            "calls": args.calls, "python": platform.python_version(), "host": platform.node()}
    results = []
    cases = _rank_cases(args)
    launches = [("in_band", cases)] if args.in_band else [(c, [c]) for c in cases]
    for name, cs in launches:
        t = time.time()
        res = launch(args, name, cs, device, out)
        res["checks"] = check(res, args.fault_rank)
        res["ok"] = all(c["ok"] for c in res["checks"])
        results.append(res)
        print(f"{name}: {'ok' if res['ok'] else 'FAILED'} in {time.time() - t:.1f}s  " + "; ".join(
            f"{c['case']} rank {c['rank']} rc={c['returncode']} err={c['error']} wrong={c['wrong_returned']} "
            f"after_fault={c['exit_s_after_fault']}" for c in res["checks"]), flush=True)
        (out / "watchdog_diverge.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    (out / "watchdog_diverge.md").write_text(summary_md(results, meta))
    ok = all(r["ok"] for r in results)
    print(f"{'all cases ok' if ok else 'SOME CASES FAILED'}: {out / 'watchdog_diverge.md'}", flush=True)
    return 0 if ok else 1


def parse(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The arguments, checked, with the defaults that depend on others filled in."""
    args = _parser().parse_args(argv)
    if args.all == args.rank:
        _parser().error("give exactly one of --all / --rank")
    for c in args.cases or ():
        kind, _, checks = c.partition(":")
        if kind not in CASES or checks not in ("", "default", "off"):
            _parser().error(f"--cases: {c!r} is not one of {CASES} (optionally :default or :off)")
    if args.all and args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() and not args.in_band else "cpu"
    if args.calls is None:
        args.calls = 40 if args.in_band else (5000 if args.device == "cuda" else 400)
    if args.bound is None:
        args.bound = 20.0 if args.in_band else (5.0 if args.device == "cuda" else 2.0)
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse(argv)
    return run_all(args) if args.all else rank_main(args)


if __name__ == "__main__":
    sys.exit(main())
