"""A whole model in one process on one GPU: memory per layer, and time per layer inside the model against one
layer alone (DeepSeek-V3 geometry by default).

    python -m tools.bench.model_bench --out DIR [--layers 8] [--capacity 4096] [--tokens 1 128 4096]

Memory: N layers are built one after another on the same bf16 weights, as an engine builds one per block; for
each, the device memory it took (torch.cuda.mem_get_info, everything the process holds on the device) and the
torch-allocated bytes it added, against the size of its own FP8 weights. Then every layer is closed and all N
are built again: the memory after closing must come back to what it was before the first round (no leak).
Time: the model (N blocks of router + moe_ep layer + residual, shim-free moe_ep.testing.model) captured whole in
one CUDA graph and replayed, per block, against one block alone captured the same way (same T, same routing
statistics), CUDA events, median of 20 replays. Writes model.md, model.json and model.png into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Dict, List, Optional

import torch

__all__ = ["main"]


def _weight_bytes(layer) -> int:
    w = layer.backend.frontend.weights
    return sum(t.untyped_storage().nbytes() for t in {id(v): v for v in vars(w).values()
                                                       if isinstance(v, torch.Tensor)}.values())


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def build_layers(spec, weights, n: int, backend: str, log) -> List[Dict]:
    import moe_ep

    rows, layers = [], []
    for k in range(n):
        free0, alloc0 = _free(), torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        layer = moe_ep.MoELayer(spec, weights, backend=backend, check_values=False, collective_checks=False)
        build_s = time.perf_counter() - t0
        free1, alloc1 = _free(), torch.cuda.memory_allocated()
        rows.append(dict(layer=k, device_taken_MiB=(free0 - free1) / 2 ** 20,
                         torch_allocated_MiB=(alloc1 - alloc0) / 2 ** 20,
                         weights_MiB=_weight_bytes(layer) / 2 ** 20, build_s=round(build_s, 1)))
        log(f"layer {k}: took {rows[-1]['device_taken_MiB']:.0f} MiB of device memory, torch +"
            f"{rows[-1]['torch_allocated_MiB']:.0f} MiB, weights {rows[-1]['weights_MiB']:.0f} MiB "
            f"({build_s:.1f} s)")
        layers.append(layer)
    return rows, layers


def time_us(fn, iters: int = 20) -> float:
    from tools.bench.timing import cuda_time_us

    return cuda_time_us(fn, iters=iters, warmup=3)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "model_out"))
    ap.add_argument("--geometry", default="dsv3")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--capacity", type=int, default=4096)
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 128, 4096])
    ap.add_argument("--backend", default="sm90_fp8_cutedsl")
    args = ap.parse_args(argv)
    from tools.bench.bench import require_sm90

    require_sm90(0)
    import moe_ep
    from moe_ep.core.graphs import capture_graph
    from moe_ep.testing.model import MoEBlock, MoEModel
    from shim.common.workspace import live_pools
    from tools.bench.bench import init_single_rank
    from tools.geometries import GEOMETRIES, spec_for

    os.makedirs(args.out, exist_ok=True)
    lines: List[str] = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        lines.append(msg)

    dev = init_single_rank("29531")
    g = GEOMETRIES[args.geometry]
    spec = spec_for(args.geometry, args.capacity)
    gen = torch.Generator(device=dev).manual_seed(0)
    h, i, e = g["hidden"], g["intermediate"], g["experts"]
    w13 = (torch.randn(e, 2 * i, h, generator=gen, device=dev) * h ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, generator=gen, device=dev) * i ** -0.5).to(torch.bfloat16)
    weights = moe_ep.ExpertWeights(w13, w2, rank=0, world_size=1, num_experts=e)
    free_start = _free()

    mem_rows, layers = build_layers(spec, weights, args.layers, args.backend, log)
    pool = [p.stats() for p in live_pools() if p.stats()["layers"]]
    for lay in reversed(layers):
        lay.close()
    del layers
    torch.cuda.empty_cache()
    free_closed = _free()
    rebuild_rows, layers = build_layers(spec, weights, args.layers, args.backend, lambda m: None)
    for lay in reversed(layers):
        lay.close()
    del layers
    torch.cuda.empty_cache()
    free_closed2 = _free()
    leak = dict(free_before_first_MiB=free_start / 2 ** 20, free_after_close_MiB=free_closed / 2 ** 20,
                free_after_second_close_MiB=free_closed2 / 2 ** 20,
                lost_over_a_build_close_round_MiB=(free_closed - free_closed2) / 2 ** 20)
    log(f"close and rebuild: free {free_start / 2 ** 30:.2f} GiB before, {free_closed / 2 ** 30:.2f} after the first "
        f"close, {free_closed2 / 2 ** 30:.2f} after the second: {leak['lost_over_a_build_close_round_MiB']:.0f} MiB "
        "lost over a build-and-close round")

    # Time: the whole model in one graph against one block alone.
    model = MoEModel.build(spec, [weights] * args.layers, seed=1, device=dev, backend=args.backend,
                           check_values=False, collective_checks=False)
    block = MoEBlock(model.layers[0], model.blocks[0].router)
    time_rows = []
    for t in args.tokens:
        x = torch.randn(t, h, generator=gen, device=dev).to(torch.bfloat16)
        out_model = torch.empty_like(x)
        out_block = torch.empty_like(x)
        g_model = capture_graph(lambda: out_model.copy_(model(x)))
        g_block = capture_graph(lambda: out_block.copy_(block(x)))
        us_model = time_us(g_model.replay)
        us_block = time_us(g_block.replay)
        eager_model = time_us(lambda: model(x), iters=5)
        row = dict(T=t, layers=args.layers, model_graph_us=us_model, per_block_in_model_us=us_model / args.layers,
                   one_block_alone_us=us_block, in_model_vs_alone=us_model / args.layers / us_block,
                   model_eager_us=eager_model)
        time_rows.append(row)
        log(f"T={t}: model {us_model:.0f} us in one graph = {row['per_block_in_model_us']:.0f} us per block; one block "
            f"alone {us_block:.0f} us (ratio {row['in_model_vs_alone']:.3f}); eager model {eager_model:.0f} us")
        del g_model, g_block
    model.close()

    meta = dict(date=time.strftime("%Y-%m-%d"), device=torch.cuda.get_device_name(0), torch=torch.__version__,
                python=platform.python_version(), geometry=args.geometry, spec=str(spec), backend=args.backend,
                pool_with_all_layers=pool)
    first = mem_rows[0]["device_taken_MiB"]
    later = [r["device_taken_MiB"] - r["weights_MiB"] for r in mem_rows[1:]]
    with open(os.path.join(args.out, "model.json"), "w") as f:
        json.dump(dict(meta=meta, memory=mem_rows, rebuild=rebuild_rows, leak=leak, time=time_rows), f, indent=1)
    with open(os.path.join(args.out, "model.md"), "w") as f:
        f.write(f"# A whole model in one process: {args.layers} x {args.geometry}, capacity {args.capacity}\n\n")
        for k, v in meta.items():
            f.write(f"- {k}: {v}\n")
        f.write("\n## Memory per layer (device memory taken = mem_get_info before - after building the layer)\n\n")
        f.write("| layer | device taken (MiB) | torch allocated (MiB) | its FP8 weights (MiB) | beyond its weights (MiB) |\n"
                "|---|---|---|---|---|\n")
        for r in mem_rows:
            f.write(f"| {r['layer']} | {r['device_taken_MiB']:.0f} | {r['torch_allocated_MiB']:.0f} | "
                    f"{r['weights_MiB']:.0f} | {r['device_taken_MiB'] - r['weights_MiB']:.0f} |\n")
        f.write(f"\nFirst layer: {first:.0f} MiB in all. Each later layer beyond its weights: max "
                f"{max(later) if later else float('nan'):.0f} MiB, median "
                f"{statistics.median(later) if later else float('nan'):.0f} MiB (target: at most 64).\n\n")
        f.write(f"Close and rebuild: {leak['lost_over_a_build_close_round_MiB']:.0f} MiB lost over one round.\n\n")
        f.write("## Time per block (CUDA events, median of 20 graph replays)\n\n| T | model in one graph (us) | "
                "per block in the model (us) | one block alone (us) | in model / alone | model eager (us) |\n"
                "|---|---|---|---|---|---|\n")
        for r in time_rows:
            f.write(f"| {r['T']} | {r['model_graph_us']:.0f} | {r['per_block_in_model_us']:.0f} | "
                    f"{r['one_block_alone_us']:.0f} | {r['in_model_vs_alone']:.3f} | {r['model_eager_us']:.0f} |\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
        a.bar([r["layer"] for r in mem_rows], [r["weights_MiB"] for r in mem_rows], label="its FP8 weights")
        a.bar([r["layer"] for r in mem_rows], [r["device_taken_MiB"] - r["weights_MiB"] for r in mem_rows],
              bottom=[r["weights_MiB"] for r in mem_rows], label="beyond its weights")
        a.set_xlabel("layer (built in order)")
        a.set_ylabel("device memory taken (MiB)")
        a.legend()
        ts = [str(r["T"]) for r in time_rows]
        xs = range(len(ts))
        b.bar([x - 0.2 for x in xs], [r["per_block_in_model_us"] for r in time_rows], 0.4, label="per block in the model")
        b.bar([x + 0.2 for x in xs], [r["one_block_alone_us"] for r in time_rows], 0.4, label="one block alone")
        b.set_xticks(list(xs), ts)
        b.set_xlabel("tokens")
        b.set_ylabel("us")
        b.set_yscale("log")
        b.legend()
        fig.suptitle(meta["device"])
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "model.png"), dpi=110)
    except ImportError as ex:
        print(f"no plot: {ex}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
