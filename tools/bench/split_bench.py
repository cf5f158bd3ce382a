"""The split path against the fused kernel at world size 1, and the local engines it can run (issue #36).

    python -m tools.bench.split_bench --out DIR           (one Hopper GPU, DeepSeek-V3 geometry; a few minutes)
    python -m tools.bench.split_bench --cpu --out DIR     (CPU, a tiny geometry: every step runs, times mean little)

For each T (tokens per rank; capacity T rounded up to a power of two), side by side in one process:
  fused          the fused kernel layer (sm90_fp8_cutedsl; the torch reference on the CPU), a caller-captured CUDA
                 graph of one call
  split          backend="split" with the `fused` engine (the same kernel at world size 1 over the rank's experts),
                 captured (the padded, capturable exchange) and eager (exact splits: one host read of the counts);
                 its output must equal the fused layer's bit for bit; split - fused is the split path's overhead;
                 also with the `fused_fp8` engine (rows quantized at the source: FP8 on the wire) and two_level over
                 one domain (bf16 and FP8 rows), each bit for bit against the fused layer, captured
  engines        the local engines alone over the call's rows (the rows quantized, the experts computed, the slots
                 reduced): torch_fp8_block128 (torch._scaled_mm blockwise, one GEMM per expert) and torch_fp8_rowwise
                 (torch._scaled_grouped_mm), with their GEMMs alone (everything but the GEMMs already done), and
                 the split layer over each (eager for block128, which reads counts on the host; captured for rowwise);
                 on a GPU each engine again with its non-GEMM steps in torch ops instead of its Triton kernels
                 (`_torchops` columns: what the kernels save; ops_bitwise: the two outputs equal bit for bit)
  auto           backend="auto": what it measured and chose for this capacity (fused or split with the fused engine:
                 the paths that keep the format's numerics), and its captured time
Error columns: each torch engine's worst per-token relative error against the fused layer's output (their numerics
differ from the format's: moe_ep/split/torch_engine.py). pct_dense: the call's FP8 FLOPs (2 T K 3 I H) over the
dense FP8 rate measured in the same run (torch._scaled_mm at 8192^3), as a share.
Writes split_bench.json, .csv, .md and .png into --out and prints the table.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import statistics
import tempfile
import time
import traceback
from typing import Callable, Dict, List, Optional

import torch

GEOMS = {
    "dsv3": dict(hidden=7168, intermediate=2048, experts=32, top_k=8),
    "tiny": dict(hidden=256, intermediate=128, experts=8, top_k=4),  # the CPU mode
}
TOKENS = [512, 1024, 2048, 4096, 8192]
TARGET_T, TARGET_PCT = 4096, 65.0
# Paths over the fused kernel besides split's default engine (name, MoELayer arguments).
PATHS = (("split_fp8wire", dict(backend="split", engine="fused_fp8")),
         ("two_level", dict(backend="two_level")),
         ("two_level_fp8wire", dict(backend="two_level", wire="fp8")))


def _bucket(t: int) -> int:
    c = 8
    while c < t:
        c *= 2
    return c


class Clock:
    """CUDA-event medians on a GPU (tools/bench/timing.py), wall-clock medians on the CPU."""

    def __init__(self, device: torch.device, iters: int):
        self.gpu = device.type == "cuda"
        self.iters = iters

    def us(self, fn: Callable[[], object], iters: Optional[int] = None) -> float:
        n = iters or self.iters
        if self.gpu:
            from tools.bench.timing import cuda_time_us

            return cuda_time_us(fn, iters=n, warmup=3)
        fn()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)


def _graph(fn, device):
    """fn captured in a CUDA graph (moe_ep.capture_graph: warm-up outside the capture), or fn itself on the CPU."""
    if device.type != "cuda":
        return fn
    from moe_ep.core.graphs import capture_graph

    return capture_graph(fn).replay


def _row_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    o, r = out.float(), ref.float()
    return float(((o - r).norm(dim=1) / r.norm(dim=1).clamp(min=1e-6)).max()) if o.numel() else 0.0


def _init(cpu: bool):
    import torch.distributed as dist

    if cpu:
        os.environ.setdefault("MOE_EP_DEVICE", "cpu")
        if not dist.is_initialized():
            store = os.path.join(tempfile.mkdtemp(prefix="split_bench_"), "store")
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        return torch.device("cpu"), None
    from tools.bench.bench import init_single_rank, measure_rates

    dev = init_single_rank("29531")
    return dev, measure_rates(dev)


class _Gemms:
    """The torch engines' GEMMs alone over one call's rows, through the engines' own stages (rows laid out, FC2
    operands computed once beforehand): what the engines would cost if everything around the GEMMs were free."""

    def __init__(self, block_engine, rowwise_engine, x, idx, w):
        ids = idx.to(torch.int32)
        self.block, self.rowwise = block_engine, rowwise_engine
        self.bc = block_engine.stage(block_engine.quantize(x), ids, w)
        block_engine.fc1(self.bc)
        block_engine.act(self.bc)
        self.rc = rowwise_engine.stage(x, ids, w)
        rowwise_engine.fc1(self.rc)
        rowwise_engine.act(self.rc)

    def block128(self):
        self.block.fc1(self.bc)
        self.block.fc2(self.bc)

    def grouped(self):
        self.rowwise.fc1(self.rc)
        self.rowwise.fc2(self.rc)


def transport_facts() -> Dict[str, str]:
    """What this host offers the transports docs/scale-out.md weighs: the NCCL torch runs, torch's symmetric-memory
    all-to-all, and NCCL EP's Python bindings (nccl4py's nccl.ep)."""
    import importlib.util

    facts = {"torch": torch.__version__}
    try:
        facts["nccl (torch)"] = ".".join(str(v) for v in torch.cuda.nccl.version()) if torch.cuda.is_available() \
            else "no CUDA"
    except Exception as e:  # noqa: BLE001 - a fact, not a requirement
        facts["nccl (torch)"] = f"unknown ({type(e).__name__})"
    symm = getattr(torch.ops, "symm_mem", None)
    facts["symm_mem.all_to_all_vdev"] = "present" if symm is not None and hasattr(symm, "all_to_all_vdev") \
        else "absent"
    facts["nccl.ep (nccl4py)"] = "importable" if importlib.util.find_spec("nccl") is not None else "not installed"
    return facts


def _try(notes: List[str], what: str, fn, default=float("nan")):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - one failed measurement is reported, the rest still run
        notes.append(f"{what}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
        traceback.print_exc()
        return default


def run(args) -> Dict[str, object]:
    import moe_ep
    from moe_ep.core.dist import RankContext
    from moe_ep.split.engine import engine_class
    from tools.bench.weights import random_weights

    dev, rates = _init(args.cpu)
    g = GEOMS[args.geom]
    h, i, e, k = g["hidden"], g["intermediate"], g["experts"], g["top_k"]
    fused_name = "torch_reference" if args.cpu else "sm90_fp8_cutedsl"
    clock = Clock(dev, args.iters)
    weights = random_weights(g, torch.Generator().manual_seed(100), dev)
    ctx = RankContext.from_group(None, dev)
    rows, notes = [], []
    common = dict(fmt="fp8_block", device=dev, check_values=False, collective_checks=False)
    for t in args.tokens:
        t0 = time.perf_counter()
        cap = _bucket(t)
        spec = moe_ep.MoESpec(h, i, e, k, cap)
        gen = torch.Generator().manual_seed(t)
        x = torch.randn(t, h, generator=gen).to(torch.bfloat16).to(dev)
        idx = torch.rand(t, e, generator=gen).argsort(dim=1)[:, :k].contiguous().to(dev)
        w = torch.softmax(torch.randn(t, k, generator=gen), dim=-1).to(dev)
        row: Dict[str, object] = dict(T=t, capacity=cap, flops=2 * t * k * 3 * i * h)
        out_f = torch.empty(t, h, dtype=torch.bfloat16, device=dev)
        out_s = torch.empty_like(out_f)

        def base():
            """The fused layer and split over it: their times, the bitwise checks, and the fused output."""
            fused = moe_ep.MoELayer(spec, weights, backend=fused_name, **common)
            try:
                split = moe_ep.MoELayer(spec, weights, backend="split", engine="reference" if args.cpu else "fused",
                                        **common)
                try:
                    fused(x, idx, w, out=out_f)
                    split(x, idx, w, out=out_s)
                    row["bitwise"] = bool(torch.equal(out_f, out_s))
                    row["fused_graph_us"] = clock.us(_graph(lambda: fused(x, idx, w, out=out_f), dev))
                    row["split_eager_us"] = clock.us(lambda: split(x, idx, w, out=out_s))
                    row["split_graph_us"] = _try(notes, f"T={t} split captured",
                                                 lambda: clock.us(_graph(lambda: split(x, idx, w, out=out_s), dev)))
                    row["bitwise_captured"] = bool(torch.equal(out_f, out_s))  # the padded exchange, last replay
                    row["split_overhead_us"] = row["split_graph_us"] - row["fused_graph_us"]
                finally:
                    split.close()
                return out_f.clone()
            finally:
                fused.close()

        ref = _try(notes, f"T={t} fused and split", base, None)
        if ref is None:  # nothing to hold the other paths to at this T
            rows.append(row)
            continue
        # The other paths over the same kernel: FP8 rows on the wire (fused_fp8), and two_level over one domain (at
        # W=1 its rail is a self-copy and its domain this GPU); each must equal the fused layer bit for bit.
        for name, kw in PATHS:
            if args.cpu and (kw.get("engine") == "fused_fp8" or kw.get("wire") == "fp8"):
                continue  # the Hopper FP8 kernel

            def path(name=name, kw=kw):
                with moe_ep.MoELayer(spec, weights, **kw, **common) as lay:
                    lay(x, idx, w, out=out_s)
                    row[f"{name}_bitwise"] = bool(torch.equal(out_s, ref))
                    us = clock.us(_graph(lambda: lay(x, idx, w, out=out_s), dev))
                    row[f"{name}_bitwise_captured"] = bool(torch.equal(out_s, ref))
                    return us
            row[f"{name}_graph_us"] = _try(notes, f"T={t} {name}", path)
        # The local engines alone, over this call's rows (W=1: every token, all K slots local).
        local = moe_ep.MoESpec(h, i, e, k, cap)
        ids32 = idx.to(torch.int32)
        engines, outs = {}, {}
        for name in ("torch_fp8_block128", "torch_fp8_rowwise"):
            def build(name=name, **opts):
                eng = engine_class(name)(local, ctx, "fp8_block", **opts)
                eng.prepare_weights(weights)
                return eng
            engines[name] = _try(notes, f"T={t} {name} build", build, None)
            if engines[name] is not None:
                row[f"kernels_{name.replace('torch_', '')}"] = engines[name].kernels
            if dev.type == "cuda" and engines[name] is not None and engines[name].kernels != "torch":
                # The same engine with its non-GEMM steps in torch ops: what the kernels save, and their bytes.
                engines[name + ":torch"] = _try(notes, f"T={t} {name} build (torch ops)",
                                                lambda name=name: build(name, kernels="torch"), None)
        for name, eng in engines.items():
            if eng is None:
                continue
            out_e = outs[name] = torch.full_like(out_f, float("nan"))
            key = name.replace("torch_", "").replace(":torch", "_torchops")

            def call(eng=eng, out_e=out_e):
                rows_in = eng.quantize(x) if eng.takes_quantized else x
                eng.forward(rows_in, ids32, w, out_e)
            row[f"engine_{key}_us"] = _try(notes, f"T={t} {name}", lambda: clock.us(call))
            row[f"err_{key}"] = _row_err(out_e, ref)
            if eng.capturable and dev.type == "cuda":
                row[f"engine_{key}_graph_us"] = _try(notes, f"T={t} {name} captured",
                                                     lambda: clock.us(_graph(call, dev)))
            if name.endswith(":torch") and name[:-len(":torch")] in outs:
                row[f"ops_bitwise_{key[:-len('_torchops')]}"] = bool(torch.equal(out_e, outs[name[:-len(":torch")]]))
        for name in [n for n in engines if n.endswith(":torch")]:
            if engines[name] is not None:
                engines[name].close()
            del engines[name]
        outs.clear()
        if all(v is not None for v in engines.values()):
            gemms = _try(notes, f"T={t} GEMM operands", lambda: _Gemms(engines["torch_fp8_block128"],
                                                                       engines["torch_fp8_rowwise"], x, idx, w), None)
            if gemms is not None:
                row["gemm_block128_us"] = _try(notes, f"T={t} _scaled_mm GEMMs", lambda: clock.us(gemms.block128))
                row["gemm_grouped_rowwise_us"] = _try(notes, f"T={t} _scaled_grouped_mm GEMMs",
                                                      lambda: clock.us(gemms.grouped))
                del gemms
        for eng in engines.values():
            if eng is not None:
                eng.close()
        engines.clear()
        # The split layer over each torch engine (the whole path: quantize at the source, dispatch, engine, combine).
        for name, captured in (("torch_fp8_block128", False), ("torch_fp8_rowwise", True)):
            key = name.replace("torch_", "")

            def timed(name=name, captured=captured):
                with moe_ep.MoELayer(spec, weights, backend="split", engine=name, **common) as lay:
                    call = lambda: lay(x, idx, w, out=out_s)  # noqa: E731
                    return clock.us(_graph(call, dev) if captured else call)
            row[f"split_{key}_us"] = _try(notes, f"T={t} split over {name}", timed)
        # auto: measure fused against split (the format's numerics) at this capacity, keep the winner.
        def planned():
            with moe_ep.MoELayer(spec, weights, backend="auto", use_table=False, **common) as lay:
                lay(x, idx, w, out=out_s)
                row["auto_bitwise"] = bool(torch.equal(out_s, ref))
                p = lay.plan
                row["auto_plan"] = p.backend
                row["auto_scores"] = "; ".join(f"{n} {s:.0f}" for n, s in p.scores_us)
                return clock.us(_graph(lambda: lay(x, idx, w, out=out_s), dev))
        row["auto_graph_us"] = _try(notes, f"T={t} auto", planned)
        exact = {"fused": row.get("fused_graph_us"), "split": row.get("split_graph_us"),
                 "split_fp8wire": row.get("split_fp8wire_graph_us")}
        anyn = dict(exact, split_block128=row.get("split_block128_us"), split_rowwise=row.get("split_rowwise_us"))
        for label, pool in (("best", exact), ("best_any", anyn)):
            live = {n: v for n, v in pool.items() if isinstance(v, float) and v == v}
            if live:
                best = min(live, key=live.get)
                row[label] = best
                row[f"{label}_us"] = live[best]
        if rates is not None:
            rate = rates["fp8_flops_per_s"]
            for key in ("fused_graph_us", "best_us", "best_any_us", "auto_graph_us"):
                v = row.get(key)
                if isinstance(v, float) and v == v and v > 0:
                    row["pct_dense_" + key[:-3]] = 100.0 * row["flops"] / (rate * v * 1e-6)
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        print(_fmt(row), flush=True)
    return dict(rows=rows, notes=notes, rates=rates, geom=args.geom, device=str(dev), transports=transport_facts(),
                device_name=torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu")


COLS = [("T", "{}"), ("fused_graph_us", "{:.0f}"), ("split_graph_us", "{:.0f}"), ("split_eager_us", "{:.0f}"),
        ("split_overhead_us", "{:+.0f}"), ("bitwise", "{}"), ("bitwise_captured", "{}"),
        ("split_fp8wire_graph_us", "{:.0f}"), ("split_fp8wire_bitwise", "{}"), ("two_level_graph_us", "{:.0f}"),
        ("two_level_bitwise", "{}"), ("two_level_fp8wire_graph_us", "{:.0f}"), ("two_level_fp8wire_bitwise", "{}"),
        ("engine_fp8_block128_us", "{:.0f}"), ("gemm_block128_us", "{:.0f}"), ("split_fp8_block128_us", "{:.0f}"),
        ("err_fp8_block128", "{:.3f}"), ("engine_fp8_block128_torchops_us", "{:.0f}"),
        ("ops_bitwise_fp8_block128", "{}"),
        ("engine_fp8_rowwise_us", "{:.0f}"), ("engine_fp8_rowwise_graph_us", "{:.0f}"),
        ("engine_fp8_rowwise_torchops_graph_us", "{:.0f}"), ("ops_bitwise_fp8_rowwise", "{}"),
        ("gemm_grouped_rowwise_us", "{:.0f}"), ("split_fp8_rowwise_us", "{:.0f}"), ("err_fp8_rowwise", "{:.3f}"),
        ("auto_plan", "{}"), ("auto_graph_us", "{:.0f}"), ("best", "{}"), ("pct_dense_fused_graph", "{:.0f}%"),
        ("pct_dense_best", "{:.0f}%"), ("best_any", "{}"), ("pct_dense_best_any", "{:.0f}%")]


def _fmt(r: dict) -> str:
    cells = []
    for c, f in COLS:
        v = r.get(c, "")
        try:
            cells.append(f.format(v) if v != "" else "")
        except (TypeError, ValueError):
            cells.append(str(v))
    return "| " + " | ".join(cells) + " |"


def verdict(rows: List[dict]) -> List[str]:
    """The issue's two targets, as the run saw them."""
    out = []
    at = [r for r in rows if r["T"] == TARGET_T]
    if at and "pct_dense_best" in at[0]:
        r = at[0]
        out.append(f"T={TARGET_T}: best plan with the format's numerics ({r['best']}) at {r['pct_dense_best']:.0f}% of "
                   f"the dense FP8 rate ({'meets' if r['pct_dense_best'] >= TARGET_PCT else 'misses'} the "
                   f"{TARGET_PCT:.0f}% target); any numerics ({r.get('best_any')}): "
                   f"{r.get('pct_dense_best_any', float('nan')):.0f}%")
    slower = [r["T"] for r in rows if isinstance(r.get("auto_graph_us"), float) and
              r["auto_graph_us"] > 1.05 * r.get("fused_graph_us", float("inf"))]
    out.append("auto never slower than fused (5% noise allowed)" if not slower else
               f"auto slower than fused at T={slower}")
    return out


def plot(result: dict, out: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as ex:
        print(f"no plot: {ex}")
        return
    from tools.bench.bench import tokens_axes

    rows = result["rows"]
    ts = [r["T"] for r in rows]
    fig, (ax, rax) = plt.subplots(1, 2, figsize=(14, 5))
    series = (("fused_graph_us", "fused kernel (graph)", "-"), ("split_graph_us", "split, fused engine (graph)", "-"),
              ("split_eager_us", "split, fused engine (eager)", ":"),
              ("engine_fp8_block128_us", "engine: _scaled_mm blockwise per expert", "-."),
              ("gemm_block128_us", "  its GEMMs alone", "--"),
              ("engine_fp8_rowwise_us", "engine: _scaled_grouped_mm rowwise", "-."),
              ("gemm_grouped_rowwise_us", "  its GEMMs alone", "--"), ("auto_graph_us", "auto (graph)", "-"))
    for key, label, style in series:
        ys = [r.get(key, float("nan")) for r in rows]
        if any(isinstance(y, float) and y == y for y in ys):
            ax.plot(ts, ys, marker="o", linestyle=style, label=label)
    tokens_axes(ax, "microseconds", log_y=True)
    ax.set_title(f"{result['geom']} at world size 1, {result['device_name']}")
    for key, label in (("pct_dense_fused_graph", "fused"), ("pct_dense_best", "best, format's numerics"),
                       ("pct_dense_best_any", "best, any numerics")):
        ys = [r.get(key, float("nan")) for r in rows]
        if any(isinstance(y, float) and y == y for y in ys):
            rax.plot(ts, ys, marker="o", label=label)
    rax.axhline(TARGET_PCT, color="gray", linestyle="--", linewidth=1, label=f"target {TARGET_PCT:.0f}%")
    tokens_axes(rax, "% of the dense FP8 rate")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "split_bench.png"), dpi=110)
    plt.close(fig)


def write(result: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    rows = result["rows"]
    with open(os.path.join(out, "split_bench.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    keys = sorted({k for r in rows for k in r})
    with open(os.path.join(out, "split_bench.csv"), "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=keys)
        wr.writeheader()
        wr.writerows(rows)
    head = "| " + " | ".join(c for c, _ in COLS) + " |\n|" + "---|" * len(COLS) + "\n"
    with open(os.path.join(out, "split_bench.md"), "w") as f:
        f.write(f"# split path vs fused kernel, world size 1\n\n- date: {datetime.date.today().isoformat()}\n"
                f"- device: {result['device_name']}\n- torch: {torch.__version__}\n- geometry: {result['geom']} "
                f"{GEOMS[result['geom']]}\n")
        f.write("- transports here: " + "; ".join(f"{k} {v}" for k, v in result["transports"].items()) + "\n")
        if result.get("rates"):
            f.write(f"- dense FP8 rate (measured): {result['rates']['fp8_flops_per_s'] / 1e12:.0f} TFLOP/s\n")
        f.write("\n" + head + "".join(_fmt(r) + "\n" for r in rows) + "\n")
        for line in verdict(rows) + [f"note: {n}" for n in result["notes"]]:
            f.write(f"- {line}\n")
    plot(result, out)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "split_bench_out"))
    p.add_argument("--cpu", action="store_true", help="run on the CPU with the tiny geometry (a dry run)")
    p.add_argument("--tokens", nargs="+", type=int, default=None)
    p.add_argument("--iters", type=int, default=None, help="timed calls per measurement (default 20 GPU, 3 CPU)")
    args = p.parse_args(argv)
    args.geom = "tiny" if args.cpu else "dsv3"
    args.tokens = args.tokens or ([16, 32] if args.cpu else TOKENS)
    args.iters = args.iters or (3 if args.cpu else 20)
    if not args.cpu:
        from tools.bench.bench import require_sm90

        require_sm90(0)
    started = time.perf_counter()
    result = run(args)
    result["seconds"] = time.perf_counter() - started
    write(result, args.out)
    print("| " + " | ".join(c for c, _ in COLS) + " |")
    for r in result["rows"]:
        print(_fmt(r))
    for line in verdict(result["rows"]) + [f"note: {n}" for n in result["notes"]]:
        print(line)
    print("transports here: " + "; ".join(f"{k} {v}" for k, v in result["transports"].items()))
    print(f"done in {result['seconds']:.0f} s; wrote {args.out}/split_bench.{{json,csv,md,png}}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
