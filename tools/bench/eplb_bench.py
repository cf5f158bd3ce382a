"""EPLB benchmark: one hot logical expert, layer time before and after a replica of it is placed on another rank.

    python -m tools.launch.launcher --nproc 2 --device cuda -- -m tools.bench.eplb_bench --out DIR   (two GPUs)
    python -m tools.bench.eplb_bench --out DIR                         (one GPU: 2 replicas on one rank, a smoke test)
    python -m tools.launch.launcher --nproc 2 --device cpu -- -m tools.bench.eplb_bench --geom tiny --out DIR

The routing: every token's top-1 is logical expert 0 (with --hot-share 1.0 and top-2, expert 0 takes half of all
routed pairs), the other slots uniform over the other experts. The layer holds ceil(E / W) + 1 slots per rank: experts
in contiguous blocks as moe_ep places them without EPLB (rank r holds experts r*E/W ..), each rank's spare slot a
replica of its last cold expert. Phases, each timed at every token count T (slowest rank, median):
  plain     a layer without slots (today's placement): the baseline, and the cost of the map + counters beside it
  before    the slotted layer, expert 0 on one slot (rank 0)
  after     the same layer after layer.rearrange(): the last rank's spare slot now holds expert 0, rank 0's a replica
            of a cold expert of the last rank (bytes copied between ranks by the layer, in place; graphs captured
            before the swap are replayed, not recaptured)
Every phase is checked against the oracle (its logical model) at the first T, the swapped layer's bytes against a
layer freshly built with the new placement, and the load counters give each rank's share of the routed pairs.
GPU: CUDA-event time of a replay of a graph captured around one layer call; also the host time of an eager call.
CPU (gloo, torch reference): wall-clock medians, for correctness in CI (the times mean little there).
Writes eplb.json, eplb.csv, eplb.md and eplb.png into --out (rank 0); prints the table.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import hashlib
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import fields, is_dataclass
from typing import Dict, List, Optional

import torch

GEOMS = {
    # Mixtral-8x7B: top-2 over 8 experts, so one expert in every token is half of all routed pairs.
    "mixtral": dict(hidden=4096, intermediate=14336, experts=8, top_k=2),
    "small": dict(hidden=1024, intermediate=512, experts=8, top_k=2),
    "tiny": dict(hidden=256, intermediate=128, experts=8, top_k=2),  # CPU ranks
}
HOT = 0


def placement(experts: int, world: int):
    """(before, after) ExpertMaps. Before: contiguous blocks, each rank's spare slot a replica of its last (cold)
    expert. After: the last rank's spare slot holds the hot expert, and rank 0's (world > 1) a replica of the last
    rank's first expert, which evens out the cold pairs the hot replica added there (at top-2 over 8 experts on 2
    ranks: the busiest rank's share of routed pairs 0.71 -> 0.50; the hot replica alone: 0.71 -> 0.54)."""
    import moe_ep

    share = -(-experts // world)
    s_local = share + 1
    p2l = []
    for r in range(world):
        mine = list(range(r * share, min(experts, (r + 1) * share)))
        mine = mine or [experts - 1]
        p2l += mine + [mine[-1]] * (s_local - len(mine))
    before = moe_ep.ExpertMap(p2l, experts)
    changes = {before.num_slots - 1: HOT}
    if world > 1:
        changes[s_local - 1] = before.logical_of((world - 1) * s_local)
    return before, before.reassign(changes)


def routing(t: int, experts: int, k: int, hot_share: float, gen: torch.Generator):
    """topk_idx [t, k] (distinct per token; expert HOT first in a hot_share fraction of tokens), softmax weights."""
    scores = torch.rand(t, experts, generator=gen)
    scores[:, HOT] = torch.where(torch.rand(t, generator=gen) < hot_share, 2.0, scores[:, HOT] * 0.0)
    idx = scores.topk(k, dim=1).indices.contiguous()
    return idx, torch.softmax(torch.randn(t, k, generator=gen), dim=1)


def _weights(g: dict, seed: int = 5):
    gen = torch.Generator().manual_seed(seed)
    h, i, e = g["hidden"], g["intermediate"], g["experts"]
    w13 = (torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, generator=gen) / i ** 0.5).to(torch.bfloat16)
    return w13, w2


def _digest(layer) -> str:
    """Every byte the layer computes with: the oracle's view and, for a kernel backend, the kernel's tensors."""
    h = hashlib.sha256()
    qw = layer.oracle_weights()
    for n in qw.tensor_fields():
        h.update(getattr(qw, n).contiguous().view(torch.uint8).cpu().numpy().tobytes())
    kw = getattr(getattr(layer.backend, "frontend", None), "weights", None)
    if kw is not None and is_dataclass(kw):
        for f in fields(kw):
            t = getattr(kw, f.name)
            if isinstance(t, torch.Tensor):
                t = t.transpose(1, 2) if t.dim() == 3 else t
                h.update(t.contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


class Timer:
    """The layer's time per call on this rank: CUDA events over a captured graph's replays (GPU), wall clock between
    barriers (CPU). The layer is as slow as its slowest rank: max over ranks."""

    def __init__(self, ctx, iters: int):
        self.ctx, self.iters = ctx, iters
        self.cuda = ctx.device.type == "cuda"

    def slowest(self, us: float) -> float:
        import torch.distributed as dist

        t = torch.tensor([us], dtype=torch.float64, device=self.ctx.comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.ctx.group)
        return float(t.item())

    def time(self, fn) -> float:
        if self.cuda:
            from tools.bench.timing import cuda_time_us

            return self.slowest(cuda_time_us(fn, iters=self.iters))
        import torch.distributed as dist

        fn()
        times = []
        for _ in range(self.iters):
            dist.barrier(group=self.ctx.group)
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        return self.slowest(statistics.median(times))

    def host(self, fn) -> float:
        if not self.cuda:
            return float("nan")
        from tools.bench.timing import host_time_us

        return self.slowest(host_time_us(fn))


def _rank_shares(layer, num_slots: int, world: int) -> List[float]:
    """Each rank's share of the routed pairs, from the load counters gathered over ranks (and reset)."""
    counts = layer.load_counts(reset=True, gather=True).cpu()
    per_rank = counts.reshape(world, num_slots // world).sum(dim=1).to(torch.float64)
    return (per_rank / per_rank.sum().clamp(min=1)).tolist()


def run(args) -> List[dict]:
    import moe_ep
    from moe_ep.reference.oracle import check_multirank

    ctx = moe_ep.init_from_env()
    rank, world, dev = ctx.rank, ctx.world_size, ctx.device
    log = print if rank == 0 else (lambda *a, **k: None)
    g = GEOMS[args.geom]
    h, e, k = g["hidden"], g["experts"], g["top_k"]
    cap = max(args.tokens)
    spec = moe_ep.MoESpec(hidden_size=h, intermediate_size=g["intermediate"], num_experts=e, top_k=k,
                          max_tokens_per_rank=cap)
    w13, w2 = _weights(g)
    before, after = placement(e, world)
    fast = dict(check_values=False, collective_checks=False, backend=args.backend, fmt=args.fmt, device=dev)
    layer = moe_ep.MoELayer(spec, before.rank_weights(w13, w2, rank, world), expert_map=before, **fast)
    plain = None
    if e % world == 0:
        plain = moe_ep.MoELayer(spec, moe_ep.ExpertWeights.from_global(w13, w2, rank, world), **fast)
    log(f"world size {world}, {layer.backend_name} ({layer.fmt}), {args.geom} {g}, {layer.num_slots} slots "
        f"({layer.slots_per_rank} a rank); before {before}; after {after}", flush=True)
    timer = Timer(ctx, args.iters)
    gen = torch.Generator().manual_seed(11 + rank)

    def eager(lay, c):
        t, x, idx, w, out = c
        return lambda: lay(x, idx, w, out=out)

    cases = []
    for t in args.tokens:
        idx, w = routing(t, e, k, args.hot_share, gen)
        x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
        cases.append((t, x.to(dev), idx.to(dev), w.to(dev), torch.empty(t, h, dtype=torch.bfloat16, device=dev)))
    # One graph per (layer, T), captured now and replayed after the swap too: the swap writes in place.
    graphs: Dict[tuple, object] = {}
    if dev.type == "cuda":
        for which, lay in (("slots", layer), ("plain", plain)):
            for c in cases if lay is not None else ():
                graphs[(which, c[0])] = moe_ep.capture_graph(eager(lay, c))

    def call(which, lay, c):
        graph = graphs.get((which, c[0]))
        return graph.replay if graph is not None else eager(lay, c)

    def checked(lay, weights) -> bool:
        t, x, idx, w, _ = cases[0]
        out = torch.full((t, h), float("nan"), dtype=torch.bfloat16, device=dev)
        lay(x, idx, w, out=out)
        return check_multirank(lay, x, idx, w, out, weights=weights, raise_on_failure=False).ok

    rows = {t: dict(T=t, world_size=world, geom=args.geom, backend=layer.backend_name, fmt=layer.fmt,
                    hot_share=args.hot_share) for t, *_ in cases}
    phase_ok = {}
    if plain is not None:
        phase_ok["plain"] = checked(plain, moe_ep.ExpertWeights.from_global(w13, w2, rank, world))
        for c in cases:
            rows[c[0]]["plain_us"] = timer.time(call("plain", plain, c))
            rows[c[0]]["host_plain_us"] = timer.host(eager(plain, c))
    phase_ok["before"] = checked(layer, before.rank_weights(w13, w2, rank, world))
    rearrange_ms = float("nan")
    for phase in ("before", "after"):
        if phase == "after":
            t0 = time.perf_counter()
            layer.rearrange(after)  # the hot expert's bytes copied from rank 0 to the last rank's spare slot
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            rearrange_ms = timer.slowest((time.perf_counter() - t0) * 1e6) / 1e3
            phase_ok["after"] = checked(layer, after.rank_weights(w13, w2, rank, world))
        for c in cases:
            layer.load_counts(reset=True)
            one = call("slots", layer, c)
            one()
            rows[c[0]][f"max_rank_share_{phase}"] = max(_rank_shares(layer, layer.num_slots, world))
            rows[c[0]][f"{phase}_us"] = timer.time(one)
            rows[c[0]][f"host_{phase}_us"] = timer.host(eager(layer, c))
    # Last: a fresh layer of the new placement (built after the timing, so no graph above sees the pool change).
    with moe_ep.MoELayer(spec, after.rank_weights(w13, w2, rank, world), expert_map=after, **fast) as fresh:
        same_bytes = _digest(layer) == _digest(fresh)
    for r in rows.values():
        r.update(after_vs_before=r["after_us"] / r["before_us"], rearrange_ms=rearrange_ms,
                 swap_bytes_equal_fresh=same_bytes, **{f"oracle_{p}": ok for p, ok in phase_ok.items()})
    layer.close()
    if plain is not None:
        plain.close()
    return list(rows.values()) if rank == 0 else []


COLS = [("T", "{}"), ("plain_us", "{:.1f}"), ("before_us", "{:.1f}"), ("after_us", "{:.1f}"),
        ("after_vs_before", "{:.3f}"), ("max_rank_share_before", "{:.3f}"), ("max_rank_share_after", "{:.3f}"),
        ("host_plain_us", "{:.1f}"), ("host_before_us", "{:.1f}"), ("oracle_before", "{}"), ("oracle_after", "{}"),
        ("swap_bytes_equal_fresh", "{}"), ("rearrange_ms", "{:.1f}")]


def _cell(r: dict, c: str, f: str) -> str:
    v = r.get(c, float("nan"))
    try:
        return f.format(v)
    except (TypeError, ValueError):
        return str(v)


def plot(rows: List[dict], out: str, title: str) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as ex:
        print(f"no plot: {ex}")
        return None
    from tools.bench.bench import tokens_axes

    ts = [r["T"] for r in rows]
    fig, (ax, rax) = plt.subplots(1, 2, figsize=(13, 4.8))
    for key, label in (("plain_us", "no slots (today's placement)"), ("before_us", "slots, hot expert on one rank"),
                       ("after_us", "after rearrange: a replica on another rank")):
        ys = [r.get(key, float("nan")) for r in rows]
        if any(y == y for y in ys):
            ax.plot(ts, ys, marker="o", label=label)
    tokens_axes(ax, "layer time, slowest rank (us)", log_y=True)
    rax.plot(ts, [r["after_vs_before"] for r in rows], marker="o", label="time after / before")
    rax.plot(ts, [r["max_rank_share_after"] / r["max_rank_share_before"] for r in rows], marker="x", linestyle="--",
             label="busiest rank's pairs after / before")
    rax.axhline(0.75, color="gray", linestyle=":", linewidth=1, label="target 0.75")
    rax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    tokens_axes(rax, "ratio")
    fig.suptitle(title)
    fig.tight_layout()
    path = os.path.join(out, "eplb.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(rows: List[dict], out: str, meta: dict) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "eplb.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    keys = sorted({k for r in rows for k in r})
    with open(os.path.join(out, "eplb.csv"), "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=keys)
        wr.writeheader()
        wr.writerows(rows)
    table = ["| " + " | ".join(c for c, _ in COLS) + " |", "|" + "---|" * len(COLS)]
    table += ["| " + " | ".join(_cell(r, c, f) for c, f in COLS) + " |" for r in rows]
    with open(os.path.join(out, "eplb.md"), "w") as f:
        f.write("# EPLB benchmark\n\n" + "".join(f"- {k}: {v}\n" for k, v in meta.items()) + "\n")
        f.write("\n".join(table) + "\n")
    print("\n".join(table))
    plot(rows, out, f"{meta['device']}, world size {meta['world_size']}, {meta['geom']}")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "eplb_out"))
    p.add_argument("--geom", default=None, choices=list(GEOMS), help="default: mixtral on GPUs, tiny on CPU")
    p.add_argument("--tokens", nargs="+", type=int, default=None, help="tokens per rank (default: GPU 128 512 2048 "
                                                                       "4096, CPU 64)")
    p.add_argument("--hot-share", type=float, default=1.0, help="fraction of tokens whose top-1 is the hot expert")
    p.add_argument("--backend", default=None, help="default: by the device (sm90_fp8_cutedsl on an H200)")
    p.add_argument("--fmt", default=None)
    p.add_argument("--iters", type=int, default=None, help="timed calls per case (GPU 30, CPU 5)")
    args = p.parse_args(argv)
    cuda = os.environ.get("MOE_EP_DEVICE", "cuda" if torch.cuda.is_available() else "cpu") == "cuda"
    if cuda:
        os.environ.setdefault("MOE_EP_DEVICE", "cuda")
    args.geom = args.geom or ("mixtral" if cuda else "tiny")
    args.tokens = args.tokens or ([128, 512, 2048, 4096] if cuda else [64])
    args.iters = args.iters or (30 if cuda else 5)
    rows = run(args)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()  # every rank, before rank 0 writes: no rank leaves a peer's group behind
    if not rows:
        return 0
    meta = {"date": datetime.date.today().isoformat(),
            "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
            "torch": torch.__version__, "python": platform.python_version(), "world_size": rows[0]["world_size"],
            "geom": f"{args.geom} {GEOMS[args.geom]}", "backend": rows[0]["backend"], "fmt": rows[0]["fmt"],
            "hot_share": args.hot_share}
    if cuda:
        from shim.common import tree

        meta["kernel tree"] = tree.tree_provenance("sm90")
    write(rows, args.out, meta)
    bad = [p for p in ("oracle_plain", "oracle_before", "oracle_after", "swap_bytes_equal_fresh")
           if rows[0].get(p) is False]
    if bad:
        print(f"FAILED: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
