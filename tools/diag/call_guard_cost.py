"""What the kernels' call guard costs and whether it refuses (#31), and what the layers' construction agreement costs.

    python3 -m tools.diag.call_guard_cost [--tokens 1 128] [--geometry dsv3] [--out DIR]      (one Hopper GPU)
    python3 -m tools.launch.launcher --nproc 2 --device cpu -- -m tools.diag.call_guard_cost --agreement-only

On one GPU (W=1), DeepSeek-V3 FP8 (sm90_fp8_cutedsl, capacity = T's bucket), two layers of the same weights:
  off  built with MOE_EP_CALL_GUARD=0
  on   the default guard (at W=1 it writes and reads its own slot: the whole protocol but the peers' latency)
1. Cost, per T: device time of one call (CUDA events, median of 30) eager (the layer's own internal graph) and
   replayed in a caller's CUDA graph, on and off in alternating rounds (the median of the per-round differences is
   the guard's cost), host time per eager call on and off, and the guard's two kernels alone in a graph.
2. Refusal: a third layer whose guard sees a simulated peer (a second slot this script fills on the stream before
   every call, as a peer's guard would). 20 calls with the peer in step, then 10 with the peer in another layer:
   the first must be refused on the device (its output NaN), the next eager call must raise RankDivergenceError,
   and no output may be finite and wrong. Eager, then the same inside a caller's CUDA graph (the host never sees
   those calls: the report in host memory must say refused).
3. The construction agreement: one agree() with a layer's fields (the digest, the same collective) against one
   without, back to back (W = the launch's ranks; --agreement-only runs only this, on CPU ranks too).
Prints one table; writes call_guard_cost.json with --out. Rule (docs/watchdog.md): the guard is on by default when
on - off <= 3 us a call at T=1 and T=128, eager and in a graph; `refused` must be yes and `wrong` 0 in every row.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional


def _agreement_cost(ctx, fields: Dict[str, object], n: int = 200) -> Dict[str, float]:
    """us per agree() with and without the fields, alternating blocks, medians (every rank runs this alike)."""
    from moe_ep.core.dist import agree

    per: Dict[str, List[float]] = {"with fields": [], "without": []}
    for _ in range(5):
        for kind in per:
            kw = {"fields": fields} if kind == "with fields" else {}
            t0 = time.perf_counter()
            for _ in range(n):
                agree(ctx, None, "cost", **kw)
            per[kind].append(1e6 * (time.perf_counter() - t0) / n)
    out = {f"agree_{k.replace(' ', '_')}_us": statistics.median(v) for k, v in per.items()}
    out["agreement_fields_us"] = out["agree_with_fields_us"] - out["agree_without_us"]
    return out


def _layer_fields(spec, weights, **kw) -> Dict[str, object]:
    """The fields a layer's construction agrees on (caught from one construction)."""
    import moe_ep
    from moe_ep.core import dist as mdist

    seen: Dict[str, object] = {}
    real = mdist.agree

    def spy(ctx, error, what="inputs", fields=None, subject=""):
        if fields is not None:
            seen.update(fields)
        return real(ctx, error, what, fields, subject)

    mdist.agree = spy
    try:
        moe_ep.MoELayer(spec, weights, **kw).close()
    finally:
        mdist.agree = real
    return seen


def agreement_only(args) -> int:
    import torch

    import moe_ep
    from moe_ep.testing.problems import Problem

    ctx = moe_ep.init_from_env()
    torch.set_num_threads(1)
    spec = moe_ep.MoESpec(256, 128, 4 * ctx.world_size, 4, 32)
    p = Problem.build(spec, ctx.world_size, 8, "balanced")
    fields = _layer_fields(spec, p.rank_weights(ctx.rank))
    t0 = time.perf_counter()
    for _ in range(20):
        moe_ep.MoELayer(spec, p.rank_weights(ctx.rank)).close()
    row = dict(_agreement_cost(ctx, fields), layer_build_ms=1e3 * (time.perf_counter() - t0) / 20,
               world=ctx.world_size, device=str(ctx.device), fields=len(fields))
    if ctx.rank == 0:
        print(json.dumps(row, indent=1))
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "agreement_cost.json").write_text(json.dumps(row, indent=1))
    return 0


# -- the simulated peer ---------------------------------------------------------------------------------------------
class SimulatedPeer:
    """Turns a layer's W=1 guard into one of two ranks whose peer is this script: the peer's slot in the layer's
    table is filled on the stream before every call (capturable: the epoch and the layer's launch count are read on
    the device), with the layer's own identity (in step) or another layer's (`wrong`, set between calls)."""

    def __init__(self, layer):
        import torch

        from shim.common import call_guard

        self.fe = layer.backend.frontend
        self.guard = self.fe.guard
        self.pg = pg = self.guard.pool
        dev = pg.device
        self.slots = call_guard.SLOTS
        self.words = torch.zeros(self.slots, 2, dtype=torch.int64, device=dev)
        self.theirs = torch.zeros_like(self.words)  # where the layer's guard writes "to the peer"
        self.offset = torch.zeros(1, dtype=torch.int64, device=dev)
        pg.words, pg.world = self.words, 2
        pg.deltas = torch.tensor([0, (self.theirs.data_ptr() - self.words.data_ptr()) // 8], dtype=torch.int64,
                                 device=dev)
        pg.report = torch.zeros(4, dtype=torch.int64).pin_memory()  # 2 + W for the two ranks
        pg._report = pg.report.numpy()
        if pg._report_dev is not None:  # the guard writes a device copy here (see call_guard.Guard.before)
            pg._report_dev = torch.zeros(4, dtype=torch.int64, device=dev)
        pg._target = pg._report_dev if pg._report_dev is not None else pg.report
        # One launch of the two-rank guard outside any capture (its kernels compile for W=2 here, never inside the
        # layer's graph captures), with the peer's word in place so it does not wait; then everything from zero.
        self.write()
        self.guard.before(self.fe.topk_idx, self.fe.topk_idx.numel())
        self.guard.after(self.fe.out_buf)
        torch.cuda.synchronize(dev)
        self.reset()

    def reset(self) -> None:
        import torch

        pg = self.pg
        torch.cuda.synchronize(pg.device)
        for t in (self.words, self.theirs, pg.state, self.guard.calls, pg.report, pg._report_dev):
            if t is not None:
                t.zero_()
        pg.raised = None
        self.fe.graphs.clear()  # the internal graphs read the tables they were captured with

    def wrong(self, on: bool) -> None:
        self.offset.fill_(1000 if on else 0)  # another layer's code

    def write(self) -> None:
        """The peer's word for the launch about to run (call_guard.word, computed on the device)."""
        import torch

        e = self.pg.state[:1] + 1
        code = (self.offset + self.guard.code) & 0xFFFF
        w = ((e & 0xFFFF) << 48) | (code << 32) | ((self.guard.calls[:1] + 1) & 0xFFFFFFFF)
        self.words.view(-1).index_put_((torch.remainder(e, self.slots) * 2 + 1,), w)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 128])
    p.add_argument("--geometry", default="dsv3", choices=("dsv3", "small"))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--agreement-only", action="store_true")
    p.add_argument("--out", default=os.environ.get("OUT"))
    args = p.parse_args(argv)
    if args.agreement_only:
        return agreement_only(args)
    import torch

    if not torch.cuda.is_available():
        print("call_guard_cost: needs a CUDA GPU (or --agreement-only under the launcher)", file=sys.stderr)
        return 2
    import torch.distributed as dist

    import moe_ep
    from moe_ep.core.dist import RankContext
    from shim.common import call_guard
    from tools.bench.bench import GEOMS, bucket, init_single_rank, routing
    from tools.bench.timing import cuda_time_us, host_us_per_call
    from tools.bench.weights import random_weights

    dev = init_single_rank("29541")
    call_guard._AT_WORLD_ONE = True  # the protocol's cost at W=1 (a real group of one gets no guard)
    g = GEOMS[args.geometry]
    h, i, e, k = g["hidden"], g["intermediate"], g["experts"], g["top_k"]
    weights = random_weights(g, torch.Generator().manual_seed(31), dev)
    sync = torch.cuda.synchronize
    if call_guard.available() is not None:
        print(f"call_guard_cost: {call_guard.available()}", file=sys.stderr)
        return 2

    def build(spec, guard: bool, group=None):
        os.environ[call_guard.ENV] = "1" if guard else "0"
        try:
            return moe_ep.MoELayer(spec, weights, backend="sm90_fp8_cutedsl", device=dev, group=group,
                                   check_values=False, collective_checks=False, name=f"{'on' if guard else 'off'}")
        finally:
            os.environ.pop(call_guard.ENV, None)

    def same(a, b) -> bool:
        a, b = a.float(), b.float()
        return bool(torch.isfinite(a).all()) and float((a - b).norm()) <= 1e-2 * float(b.norm()) + 1e-6

    rows: List[Dict[str, object]] = []
    for t in args.tokens:
        cap = bucket(t)
        spec = moe_ep.MoESpec(hidden_size=h, intermediate_size=i, num_experts=e, top_k=k, max_tokens_per_rank=cap)
        gen = torch.Generator().manual_seed(t)
        x = torch.randn(t, h, generator=gen).to(torch.bfloat16).to(dev)
        idx, w = routing(t, e, k, gen, dev)
        layers = {"off": build(spec, False), "on": build(spec, True)}
        assert layers["on"].backend.frontend.guard is not None and layers["off"].backend.frontend.guard is None
        outs = {name: torch.empty(t, h, dtype=torch.bfloat16, device=dev) for name in layers}
        calls = {name: (lambda lay=lay, o=outs[name]: lay(x, idx, w, out=o)) for name, lay in layers.items()}
        for c in calls.values():
            for _ in range(3):
                c()
        sync()
        ref = outs["off"].clone()
        row: Dict[str, object] = dict(T=t, capacity=cap, geometry=args.geometry, same_output=same(outs["on"], ref))
        graphs = {name: moe_ep.capture_graph(c, warmup=2) for name, c in calls.items()}
        per: Dict[str, List[float]] = {f"{m}_{n}": [] for m in ("eager", "graph", "host") for n in layers}
        for _ in range(args.rounds):
            for name in layers:
                per[f"eager_{name}"].append(cuda_time_us(calls[name], iters=30, warmup=3))
                per[f"graph_{name}"].append(cuda_time_us(graphs[name].replay, iters=30, warmup=3))
                per[f"host_{name}"].append(host_us_per_call(calls[name], 50, 3, sync))
        for m in ("eager", "graph", "host"):
            row[f"{m}_off_us"] = statistics.median(per[f"{m}_off"])
            row[f"{m}_on_us"] = statistics.median(per[f"{m}_on"])
            row[f"{m}_cost_us"] = statistics.median(a - b for a, b in zip(per[f"{m}_on"], per[f"{m}_off"]))
        fe = layers["on"].backend.frontend
        guard_only = moe_ep.capture_graph(lambda: (fe.guard.before(fe.topk_idx, cap * k), fe.guard.after(fe.out_buf)))
        row["guard_kernels_alone_us"] = cuda_time_us(guard_only.replay, iters=50, warmup=5)
        for name in layers:
            layers[name].close()

        # -- refusal, eager then in a caller's graph ---------------------------------------------------------------
        sim_layer = build(spec, True, group=dist.new_group([0]))
        peer = SimulatedPeer(sim_layer)
        sim_out = torch.empty(t, h, dtype=torch.bfloat16, device=dev)

        def sim_call():
            peer.write()
            sim_layer(x, idx, w, out=sim_out)

        for mode in ("eager", "graph"):
            peer.reset()
            peer.wrong(False)
            replay = sim_call if mode == "eager" else moe_ep.capture_graph(sim_call, warmup=1).replay
            stats = dict(in_step_ok=0, returned=0, wrong=0, nan=0, raised=None)
            for n in range(30):
                if n == 20:
                    peer.wrong(True)
                try:
                    replay()
                    sync()
                except moe_ep.RankDivergenceError as err:
                    stats["raised"] = f"call {n + 1}: {str(err)[:160]}"
                    break
                stats["returned"] += 1
                if bool(torch.isnan(sim_out.float()).all()):
                    stats["nan"] += 1
                elif same(sim_out, ref):
                    stats["in_step_ok"] += n < 20
                else:
                    stats["wrong"] += 1
            if mode == "graph":  # the host never called the layer: the report says it, the next eager call raises
                stats["report_refused"] = bool(peer.pg.tripped)
                try:
                    sim_layer(x, idx, w, out=sim_out)
                except moe_ep.RankDivergenceError as err:
                    stats["raised"] = f"eager call after the graph: {str(err)[:160]}"
            row[f"refusal_{mode}"] = stats
            row[f"refused_{mode}"] = (stats["in_step_ok"] == 20 and stats["wrong"] == 0 and stats["nan"] >= 1
                                      and stats["raised"] is not None)
        sim_layer.close()
        rows.append(row)
        print(json.dumps(row, default=str), flush=True)

    # -- the construction agreement at W=1 -------------------------------------------------------------------------
    spec = moe_ep.MoESpec(hidden_size=h, intermediate_size=i, num_experts=e, top_k=k, max_tokens_per_rank=8)
    fields = _layer_fields(spec, weights, backend="sm90_fp8_cutedsl", device=dev)
    agreement = _agreement_cost(RankContext.from_group(None, dev), fields)

    cols = [("T", "T"), ("eager_off_us", "eager off"), ("eager_cost_us", "eager +guard"), ("graph_off_us", "graph off"),
            ("graph_cost_us", "graph +guard"), ("host_off_us", "host off"), ("host_cost_us", "host +guard"),
            ("guard_kernels_alone_us", "guard kernels alone"), ("refused_eager", "refused eager"),
            ("refused_graph", "refused graph"), ("same_output", "same output")]
    print("\n| " + " | ".join(c[1] for c in cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        cells = []
        for key, _ in cols:
            v = r.get(key)
            shown = "yes" if v is True else "NO" if v is False else str(v)
            cells.append(f"{v:.2f}" if isinstance(v, float) else shown)
        print("| " + " | ".join(cells) + " |")
    worst = max(max(r["eager_cost_us"], r["graph_cost_us"]) for r in rows)
    ok = all(r["refused_eager"] and r["refused_graph"] and r["same_output"] for r in rows)
    print(f"\nconstruction agreement (W=1): {agreement['agree_with_fields_us']:.1f} us with the fields, "
          f"{agreement['agree_without_us']:.1f} us without ({len(fields)} fields)")
    print(f"worst guard cost {worst:.2f} us a call: {'<=' if worst <= 3.0 else '>'} 3 us -> default "
          f"{'on' if worst <= 3.0 else 'off'} by the rule; every refusal {'held' if ok else 'FAILED'}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "call_guard_cost.json").write_text(json.dumps(
            dict(gpu=torch.cuda.get_device_name(dev), rows=rows, agreement=agreement,
                 worst_cost_us=worst, all_refused=ok), indent=1, default=str))
    return 0 if ok and not math.isnan(worst) else 1


if __name__ == "__main__":
    sys.exit(main())
