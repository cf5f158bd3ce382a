"""Times moe_ep's sm90 FP8 backend against plain torch and against the physical floors, in one run.

    python -m tools.bench --out DIR            (GPU host, no Bazel)
    bazel run //tools:bench -- --out DIR

For each geometry and token count per rank T it measures, side by side on the same GPU:
  moe_ep eager       MoELayer forward on the hot path (check_values / collective_checks off), CUDA events;
                     moe_ep replays one internal CUDA graph per token count (first call captures it)
  moe_ep nograph     the same with the internal graphs off: every call goes through the CuTe executor
  moe_ep graph       the same forward captured in a CUDA graph and replayed
  host overhead      CPU time of one eager forward call (launch-queue not full), microseconds (both modes)
  watchdog           the same host time with the forward watchdog on (the default) and off, in alternating
                     rounds, and the median of their per-round differences: the watchdog's hot-path cost
  kernel             the drop's fused kernel + its top-k reduce alone: device time from a profiler trace of
                     the graph replay (what moe_ep adds, staging and copies, is the rest)
  torch reference    moe_ep's torch_reference backend, same FP8 format (the oracle; not built for speed)
  torch grouped bf16 torch._grouped_mm over expert-sorted tokens, bf16 weights
  torch grouped fp8  torch._scaled_grouped_mm, rowwise e4m3 scales (where the installed torch has it)
and the floors, from rates measured in this run: bytes that must move (weights of the experts that get a
token, read once, plus bf16 activations in and out) over the device-to-device copy bandwidth, and FLOPs
(2 * T * K * 3 * I * H) over the FP8 matmul rate of torch._scaled_mm at 8192^3.
Every workspace is sized like an engine would size it: capacity = T rounded up to a power of two (>= 8),
knobs from the drop's heuristic for that capacity (or the knob cache when $MOE_EP_KNOB_CACHE names one).
Writes bench.csv, bench.md and bench.png into --out.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import time
from typing import Dict, List, Optional

import torch

from moe_ep.core.dist import destroy_at_normal_exit
from moe_ep.core.graphs import capture_graph
from tools.bench.timing import (FUSED, REDUCE, STAGING, cuda_time_us, host_time_us, kernel_groups_us,
                                paired_host_time_us)
from tools.bench.weights import random_weights

GEOMS = {
    "dsv3": dict(hidden=7168, intermediate=2048, experts=32, top_k=8),
    "small": dict(hidden=2048, intermediate=768, experts=16, top_k=4),
}
TOKENS = [1, 8, 32, 128, 512, 2048, 4096]


def routing(t: int, e: int, k: int, gen: torch.Generator, device) -> tuple:
    """Balanced: each token's k distinct experts uniformly at random; softmax routing weights."""
    idx = torch.rand(max(t, 1), e, generator=gen).argsort(dim=1)[:t, :k]
    w = torch.softmax(torch.randn(t, k, generator=gen), dim=-1)
    return idx.to(device), w.to(device)


def require_sm90(gpu: int = 0) -> None:
    """The Hopper GPU these tools time the sm90 kernels on, or one line and exit status 2 (tools/require.py)."""
    from tools.require import require

    require(device="cuda", first=gpu, arch="sm90", backend="sm90_fp8_cutedsl", argument=None, arch_argument=None)


def init_single_rank(port: str = "29517") -> torch.device:
    """GPU 0 and a one-rank process group (gloo for CPU tensors, NCCL for CUDA), unless one exists."""
    import torch.distributed as dist

    require_sm90(0)
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", port)
        dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1, device_id=dev)
        destroy_at_normal_exit()
    return dev


def measure_rates(device) -> Dict[str, float]:
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = cuda_time_us(lambda: dst.copy_(src), iters=20)
    bw = 2 * n / (us * 1e-6)  # read + write
    m = 8192
    a = torch.randn(m, m, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(m, m, device=device).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=device)
    us = cuda_time_us(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16), iters=20)
    fp8 = 2 * m ** 3 / (us * 1e-6)
    return {"copy_bytes_per_s": bw, "fp8_flops_per_s": fp8}


class GroupedTorch:
    """The best plain-torch MoE on one GPU: tokens sorted by expert, one grouped GEMM per projection."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, fp8: bool):
        self.fp8 = fp8
        self.i = w2.shape[2]
        if fp8:
            self.w13, self.s13 = _rowwise_e4m3(w13)  # [E, 2I, H], [E, 2I]
            self.w2, self.s2 = _rowwise_e4m3(w2)  # [E, H, I], [E, H]
        else:
            self.w13t = w13.transpose(1, 2)  # [E, H, 2I] view, K stride 1 (the layout grouped_mm wants)
            self.w2t = w2.transpose(1, 2)

    def __call__(self, x, idx, w):
        t, k = idx.shape
        e = (self.w13 if self.fp8 else self.w13t).shape[0]
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        tok = order // k
        counts = torch.bincount(flat, minlength=e)
        offs = counts.cumsum(0).to(torch.int32)
        xs = x[tok]
        if self.fp8:
            xq, xs_s = _rowwise_e4m3(xs)
            h1 = torch._scaled_grouped_mm(xq, self.w13.transpose(1, 2), xs_s, self.s13, offs=offs,
                                          out_dtype=torch.bfloat16)
        else:
            h1 = torch._grouped_mm(xs, self.w13t, offs=offs)
        a = torch.nn.functional.silu(h1[:, : self.i]) * h1[:, self.i:]
        a = a * w.reshape(-1)[order].unsqueeze(1).to(a.dtype)
        if self.fp8:
            aq, a_s = _rowwise_e4m3(a)
            y = torch._scaled_grouped_mm(aq, self.w2.transpose(1, 2), a_s, self.s2, offs=offs,
                                         out_dtype=torch.bfloat16)
        else:
            y = torch._grouped_mm(a.contiguous(), self.w2t, offs=offs)
        out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
        out.index_add_(0, tok, y.float())
        return out.to(torch.bfloat16)


def _rowwise_e4m3(x: torch.Tensor):
    amax = x.float().abs().amax(dim=-1).clamp(min=1e-12)
    s = amax / 448.0
    return (x.float() / s.unsqueeze(-1)).to(torch.float8_e4m3fn), s.float()


def floors(geom: dict, t: int, idx: torch.Tensor, rates: Dict[str, float], world: int = 1) -> Dict[str, float]:
    """The physical floors of one call. At world size W every rank's [T, K] routing is gathered: rank r reads the
    weights of its local experts that any rank's token routes to and computes every slot routed to them, so
    each rank has a floor of its own, and the layer (as slow as its slowest rank) cannot beat the largest."""
    h, i = geom["hidden"], geom["intermediate"]
    if world > 1:
        import torch.distributed as dist

        parts = [torch.empty_like(idx) for _ in range(world)]
        dist.all_gather(parts, idx.contiguous())
        every = torch.cat(parts).flatten()
    else:
        every = idx.flatten()
    e_local = geom["experts"]
    per_expert = 3 * i * h + (2 * i // 128) * (h // 128) * 4 + (h // 128) * (i // 128) * 4
    act_bytes = 2 * t * h * 2
    worst = None
    for r in range(world):
        mine = every[(every >= r * e_local) & (every < (r + 1) * e_local)]
        active = int(torch.unique(mine).numel())
        nbytes = active * per_expert + act_bytes
        flops = 2 * int(mine.numel()) * 3 * i * h
        f = {"active_experts": active, "bytes": nbytes, "flops": flops,
             "bw_floor_us": nbytes / rates["copy_bytes_per_s"] * 1e6,
             "flop_floor_us": flops / rates["fp8_flops_per_s"] * 1e6}
        if worst is None or max(f["bw_floor_us"], f["flop_floor_us"]) > max(worst["bw_floor_us"],
                                                                           worst["flop_floor_us"]):
            worst = f
    return worst


def bucket(t: int) -> int:
    c = 8
    while c < t:
        c *= 2
    return c


def _init(port: str = "29517"):
    """(rank, world size, device): the launcher's group when started by tools.launch (one GPU per rank), else
    a one-rank group on GPU 0."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, init_single_rank(port)
    local = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    require_sm90(local)
    dev = torch.device("cuda", local)
    torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=dev)
        destroy_at_normal_exit()
    return dist.get_rank(), dist.get_world_size(), dev


def _slowest(us: float, world: int) -> float:
    """The layer is as slow as its slowest rank."""
    if world == 1:
        return us
    import torch.distributed as dist

    t = torch.tensor([us], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _flashinfer(path: Optional[str]) -> Dict[int, dict]:
    """FlashInfer's own moe_ep timed in the same device run (../shared/device/flashinfer_bench.py's JSON lines)."""
    rows = {}
    if path and os.path.exists(path):
        for line in open(path):
            line = line.strip()
            if line.startswith("{"):
                r = json.loads(line)
                if "T" in r and r.get("graph_us"):
                    rows[int(r["T"])] = r
    return rows


def heuristic_knobs(fmt: str, capacity: int):
    from shim.sm90.knobs import heuristic_knobs as heuristic

    return heuristic(fmt, capacity)


def _layer(moe_ep, spec, weights, dev, knobs):
    return moe_ep.MoELayer(spec, weights, backend="sm90_fp8_cutedsl", device=dev, check_values=False,
                           collective_checks=False, knobs=knobs)


def run(args) -> List[dict]:
    import moe_ep

    rank, world, dev = _init()
    rates = measure_rates(dev)
    log = print if rank == 0 else (lambda *a, **k: None)
    log(f"measured: copy {rates['copy_bytes_per_s'] / 1e9:.0f} GB/s, fp8 matmul "
        f"{rates['fp8_flops_per_s'] / 1e12:.0f} TFLOP/s; world size {world}", flush=True)
    fi = _flashinfer(args.flashinfer)
    rows = []
    for gname in args.geoms:
        g = GEOMS[gname]
        gen = torch.Generator().manual_seed(0)
        h, i, e, k = g["hidden"], g["intermediate"], g["experts"], g["top_k"]
        weights = random_weights(g, torch.Generator().manual_seed(100 + rank), dev, rank, world)
        w13, w2 = weights.w13, weights.w2
        alts = {}
        if world == 1 and not args.quick:
            alts["torch grouped bf16"] = GroupedTorch(w13, w2, fp8=False)
            try:
                alts["torch grouped fp8"] = GroupedTorch(w13, w2, fp8=True)
            except Exception as ex:  # noqa: BLE001 - reported, not fatal
                log(f"torch grouped fp8 unavailable: {type(ex).__name__}: {ex}")
        ref_layer = None
        for t in args.tokens:
            cap = bucket(t)
            spec = moe_ep.MoESpec(hidden_size=h, intermediate_size=i, num_experts=e * world, top_k=k,
                                  max_tokens_per_rank=cap)
            t0 = time.perf_counter()
            tuned = _layer(moe_ep, spec, weights, dev, None)  # explicit > cache > shipped table > heuristic
            same = tuned.backend.knobs == heuristic_knobs("fp8_block", cap)
            heur = tuned if same else _layer(moe_ep, spec, weights, dev, {})
            log(f"[{gname}] T={t} capacity {cap}: knobs {tuned.backend.knobs} ({tuned.backend.knob_source}); "
                f"heuristic {heur.backend.knobs}; built in {time.perf_counter() - t0:.1f}s", flush=True)
            x = torch.randn(t, h, generator=gen).to(torch.bfloat16).to(dev)
            idx, w = routing(t, e * world, k, gen, dev)
            out = torch.empty(t, h, dtype=torch.bfloat16, device=dev)
            row = dict(geom=gname, hidden=h, intermediate=i, experts=e, top_k=k, T=t, capacity=cap, world_size=world,
                       knobs=str(tuned.backend.knobs), knob_source=tuned.backend.knob_source,
                       staging=getattr(tuned.backend.frontend, "staging", "torch"))
            call = lambda: tuned(x, idx, w, out=out)  # noqa: E731
            row["moe_ep_eager_us"] = _slowest(cuda_time_us(call), world)
            row["host_overhead_us"] = _slowest(host_time_us(call), world)
            # The forward watchdog's hot-path cost: the same call with the layer's watch on (the default) and off.
            def watch_on(layer=tuned):
                layer.watched = True

            def watch_off(layer=tuned):
                layer.watched = False

            on_us, off_us, diff_us = paired_host_time_us(call, watch_on, watch_off)
            row["host_watchdog_on_us"] = _slowest(on_us, world)
            row["host_watchdog_off_us"] = _slowest(off_us, world)
            row["watchdog_host_us"] = _slowest(diff_us, world)
            graph = capture_graph(call)
            row["moe_ep_graph_us"] = _slowest(cuda_time_us(graph.replay), world)
            # The drop's kernel alone: its fused kernel + top-k reduce, read from a profiler trace of the replay.
            groups, _ = kernel_groups_us(graph.replay)
            row["kernel_us"] = groups.get(FUSED, 0.0) + groups.get(REDUCE, 0.0)
            row["staging_us"] = groups.get(STAGING, 0.0)
            del graph
            if heur is not tuned:
                hgraph = capture_graph(lambda: heur(x, idx, w, out=out))
                row["heuristic_graph_us"] = _slowest(cuda_time_us(hgraph.replay), world)
                del hgraph
            else:
                row["heuristic_graph_us"] = row["moe_ep_graph_us"]
            row["tuned_vs_heuristic"] = row["moe_ep_graph_us"] / row["heuristic_graph_us"]
            if not args.quick:
                tuned.backend.internal_graphs = False  # every call through the CuTe executor, for comparison
                row["moe_ep_nograph_us"] = _slowest(cuda_time_us(call), world)
                row["host_overhead_nograph_us"] = _slowest(host_time_us(call), world)
                tuned.backend.internal_graphs = True
            for name, alt in alts.items():
                try:
                    row[name.replace(" ", "_") + "_us"] = cuda_time_us(lambda: alt(x, idx, w), iters=10)
                except Exception as ex:  # noqa: BLE001
                    row[name.replace(" ", "_") + "_us"] = float("nan")
                    log(f"{name} failed at T={t}: {type(ex).__name__}: {ex}")
            if alts and t <= args.ref_max_tokens:
                if ref_layer is None:
                    rspec = moe_ep.MoESpec(hidden_size=h, intermediate_size=i, num_experts=e, top_k=k,
                                           max_tokens_per_rank=max(args.tokens))
                    ref_layer = moe_ep.MoELayer(rspec, weights, backend="torch_reference", fmt="fp8_block",
                                                device=dev, check_values=False, collective_checks=False)
                row["torch_reference_us"] = cuda_time_us(lambda: ref_layer(x, idx, w), iters=3, warmup=1)
            if gname == "dsv3" and world == 1 and t in fi:
                row["flashinfer_graph_us"] = fi[t]["graph_us"]
                row["flashinfer_eager_us"] = fi[t].get("eager_us", float("nan"))
                row["moe_ep_vs_flashinfer"] = row["moe_ep_graph_us"] / fi[t]["graph_us"]
            row.update(floors(g, t, idx, rates, world))
            floor = max(row["bw_floor_us"], row["flop_floor_us"])
            row["pct_bw_floor"] = 100 * row["bw_floor_us"] / row["moe_ep_graph_us"]
            row["pct_flop_floor"] = 100 * row["flop_floor_us"] / row["moe_ep_graph_us"]
            # A time under its physical floor measured something other than the whole work: flagged, not reported.
            row["kernel_below_floor"] = row["kernel_us"] < floor
            row["graph_below_floor"] = row["moe_ep_graph_us"] < floor
            row["graph_vs_kernel"] = row["moe_ep_graph_us"] / row["kernel_us"] if row["kernel_us"] else float("nan")
            torch_alts = [v for kk, v in row.items() if kk.startswith("torch_grouped") and v == v]
            if torch_alts:
                row["speedup_vs_best_torch"] = min(torch_alts) / row["moe_ep_graph_us"]
            rows.append(row)
            log(_fmt_row(row), flush=True)
            if heur is not tuned:
                heur.close()
            tuned.close()
        if ref_layer is not None:
            ref_layer.close()
    for r in rows:
        r.update(copy_GBps=rates["copy_bytes_per_s"] / 1e9, fp8_TFLOPs=rates["fp8_flops_per_s"] / 1e12)
    return rows if rank == 0 else []


COLS = [("geom", "{}"), ("world_size", "{}"), ("T", "{}"), ("capacity", "{}"), ("knob_source", "{}"),
        ("moe_ep_graph_us", "{:.1f}"), ("heuristic_graph_us", "{:.1f}"), ("tuned_vs_heuristic", "{:.3f}"),
        ("flashinfer_graph_us", "{:.1f}"), ("moe_ep_vs_flashinfer", "{:.3f}"), ("moe_ep_eager_us", "{:.1f}"),
        ("moe_ep_nograph_us", "{:.1f}"), ("kernel_us", "{:.1f}"), ("staging_us", "{:.1f}"),
        ("host_overhead_us", "{:.1f}"), ("host_overhead_nograph_us", "{:.1f}"), ("host_watchdog_on_us", "{:.2f}"),
        ("host_watchdog_off_us", "{:.2f}"), ("watchdog_host_us", "{:+.2f}"), ("torch_grouped_bf16_us", "{:.1f}"),
        ("torch_grouped_fp8_us", "{:.1f}"), ("torch_reference_us", "{:.0f}"), ("speedup_vs_best_torch", "{:.2f}x"),
        ("bw_floor_us", "{:.1f}"), ("pct_bw_floor", "{:.0f}%"), ("flop_floor_us", "{:.1f}"),
        ("pct_flop_floor", "{:.0f}%"), ("graph_vs_kernel", "{:.3f}")]


def _fmt_cell(r: dict, c: str, f: str) -> str:
    v = r.get(c, float("nan"))
    if c == "kernel_us" and r.get("kernel_below_floor"):
        return f"{v:.1f} (BELOW FLOOR: not the whole kernel)"
    if c == "moe_ep_graph_us" and r.get("graph_below_floor"):
        return f"{v:.1f} (BELOW FLOOR)"
    try:
        return f.format(v)
    except (TypeError, ValueError):
        return str(v)


def _fmt_row(r: dict) -> str:
    return " | ".join(_fmt_cell(r, c, f) for c, f in COLS)


SERIES = (("moe_ep_graph_us", "moe_ep (graph, resolved knobs)", "-"), ("heuristic_graph_us", "moe_ep, drop heuristic", "-"),
          ("flashinfer_graph_us", "FlashInfer moe_ep (graph)", "-"), ("moe_ep_eager_us", "moe_ep (eager)", ":"),
          ("kernel_us", "drop kernel alone (profiler)", ":"), ("torch_grouped_bf16_us", "torch grouped bf16", "-."),
          ("torch_grouped_fp8_us", "torch grouped fp8", "-."), ("torch_reference_us", "torch reference", "-."),
          ("bw_floor_us", "bandwidth floor", "--"), ("flop_floor_us", "FLOP floor", "--"))
RATIOS = (("tuned_vs_heuristic", "resolved knobs / heuristic"), ("moe_ep_vs_flashinfer", "moe_ep / FlashInfer"))


def tokens_axes(ax, ylabel: str, *, log_y: bool = False) -> None:
    """The benchmarks' plot axes: tokens per rank on a log2 x axis, a grid, a small legend (of what is drawn so
    far: call it last)."""
    ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def plot(rows: List[dict], out: str, title: str = "") -> None:
    """bench.png: per geometry, times against T (left) and the side-by-side ratios (right, 1.0 = parity)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as ex:
        print(f"no plot: {ex}")
        return

    def num(v):
        try:
            return float(v)
        except (TypeError, ValueError):
            return float("nan")

    geoms = sorted({r["geom"] for r in rows})
    fig, axes = plt.subplots(len(geoms), 2, figsize=(14, 5 * len(geoms)), squeeze=False)
    for (ax, rax), gname in zip(axes, geoms):
        rs = sorted((r for r in rows if r["geom"] == gname), key=lambda r: num(r["T"]))
        ts = [num(r["T"]) for r in rs]
        for key, label, style in SERIES:
            ys = [num(r.get(key)) for r in rs]
            if any(y == y for y in ys):
                ax.plot(ts, ys, marker="o", label=label, linestyle=style)
        tokens_axes(ax, "microseconds", log_y=True)
        r0 = rs[0]
        ax.set_title(f"{gname}: H={r0['hidden']} I={r0['intermediate']} E={r0['experts']} K={r0['top_k']}, "
                     f"world size {r0['world_size']}")
        for key, label in RATIOS:
            ys = [num(r.get(key)) for r in rs]
            if any(y == y for y in ys):
                rax.plot(ts, ys, marker="o", label=label)
        rax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        tokens_axes(rax, "time ratio (< 1: moe_ep's resolved knobs are faster)")
        rax.set_title("side by side, same run")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "bench.png"), dpi=110)
    plt.close(fig)


def write(rows: List[dict], out: str, meta: dict) -> None:
    os.makedirs(out, exist_ok=True)
    keys = sorted({k for r in rows for k in r})
    with open(os.path.join(out, "bench.csv"), "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=keys)
        wr.writeheader()
        wr.writerows(rows)
    with open(os.path.join(out, "bench.md"), "w") as f:
        f.write("# moe_ep benchmark\n\n")
        for k, v in meta.items():
            f.write(f"- {k}: {v}\n")
        f.write("\nTimes in microseconds (CUDA events, median of 30 after 5 warm-ups; torch reference 3; at world size > 1 "
                "the slowest rank's). moe_ep_graph_us: the layer with its resolved knobs (knob_source) captured in a "
                "CUDA graph; heuristic_graph_us: the same with the drop's heuristic knobs, in the same run; "
                "flashinfer_graph_us: FlashInfer's own moe_ep layer on the same GPU and drop, same run. kernel_us: "
                "the drop's fused kernel + top-k reduce from a profiler trace of the replay; a value under the "
                "physical floor is flagged, not reported as a result.\n\n")
        f.write("| " + " | ".join(c for c, _ in COLS) + " |\n|" + "---|" * len(COLS) + "\n")
        for r in rows:
            f.write("| " + _fmt_row(r) + " |\n")
    plot(rows, out, meta.get("device", ""))


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--geoms", nargs="+", default=list(GEOMS), choices=list(GEOMS))
    p.add_argument("--tokens", nargs="+", type=int, default=TOKENS)
    p.add_argument("--ref-max-tokens", type=int, default=512, help="time the torch reference up to this T")
    p.add_argument("--flashinfer", default=None, help="JSON lines of flashinfer_bench.py from this same run")
    p.add_argument("--quick", action="store_true", help="skip the torch alternatives and the no-graph timing")
    p.add_argument("--replot", metavar="DIR", help="redraw DIR/bench.png from DIR/bench.csv (no GPU) and stop")
    args = p.parse_args(argv)
    if args.replot:
        with open(os.path.join(args.replot, "bench.csv"), newline="") as f:
            rows = list(csv.DictReader(f))
        meta_path = os.path.join(args.replot, "meta.json")
        title = json.load(open(meta_path)).get("device", "") if os.path.exists(meta_path) else ""
        plot(rows, args.replot, title)
        return 0
    require_sm90(int(os.environ.get("LOCAL_RANK", "0")))
    rows = run(args)
    if not rows:  # ranks other than 0
        return 0
    import cutlass

    from shim.common import tree

    meta = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(0),
            "driver/cuda": torch.version.cuda, "torch": torch.__version__, "cutlass-dsl": cutlass.__version__,
            "kernel tree": tree.tree_provenance("sm90"),
            "python": platform.python_version(), "world_size": rows[0]["world_size"],
            "copy GB/s (measured)": f"{rows[0]['copy_GBps']:.0f}", "fp8 TFLOP/s (measured)": f"{rows[0]['fp8_TFLOPs']:.0f}"}
    write(rows, args.out, meta)
    print("| " + " | ".join(c for c, _ in COLS) + " |")
    for r in rows:
        print("| " + _fmt_row(r) + " |")
    with open(os.path.join(args.out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    return 0
