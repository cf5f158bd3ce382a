"""Host time per eager call of a layer built with DEFAULT arguments, next to one with every check off and one with
every check on every call (what the defaults were before #25.1), on a GPU host.

    python3 -m tools.diag.defaults_cost [--tokens 1 8 128] [--out DIR]                          (one GPU)
    python3 -m tools.launch.launcher --nproc 2 --device cuda -- -m tools.diag.defaults_cost     (two GPUs)

DeepSeek-V3 FP8 (sm90_fp8_cutedsl, capacity = the benchmark's bucket of T). Per T and layer, the steady state
(after the first calls: the first call of a T checks ids, a layer's first call agrees across ranks), back to back:
the README's call `layer(x, idx, w)` (allocates the output), the same into a caller's `out`, and with an fp32
hidden and bf16 routing weights (the lenient inputs: converted in the backend's own copies). Also the device
time of one graphed call with the frontend's expert-id guard on and off (its cost is device time only), and the
graphs the layer captured during each timed run (0 in the steady state). Prints a table; writes defaults_cost.json
with --out. Target (#25.1): the defaults at T=1 within 25 us, the README call as cheap as the call into `out`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Dict, List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 128])
    p.add_argument("--out", default=os.environ.get("OUT"))
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("defaults_cost: needs a CUDA GPU", file=sys.stderr)
        return 2
    os.environ.pop("MOE_EP_CHECKS", None)  # the defaults as a user gets them
    import moe_ep
    from tools.bench.bench import GEOMS, bucket, init_single_rank, routing
    from tools.bench.timing import cuda_time_us, host_us_per_call
    from tools.bench.weights import random_weights

    if "RANK" in os.environ:
        os.environ.setdefault("MOE_EP_DEVICE", "cuda")
        ctx = moe_ep.init_from_env()
        dev, rank, world = ctx.device, ctx.rank, ctx.world_size
    else:
        dev, rank, world = init_single_rank("29533"), 0, 1
    sync = torch.cuda.synchronize
    g = GEOMS["dsv3"]
    h, i, e, k = g["hidden"], g["intermediate"], g["experts"], g["top_k"]
    # the benchmark's weights (32 experts per rank)
    weights = random_weights(g, torch.Generator().manual_seed(100 + rank), dev, rank, world)
    e *= world
    kinds = {"defaults": {}, "checks off": dict(check_values=False, collective_checks=False),
             "every check": dict(check_values=True, collective_checks=True)}
    rows: List[Dict[str, object]] = []
    for t in args.tokens:
        cap = bucket(t)
        spec = moe_ep.MoESpec(hidden_size=h, intermediate_size=i, num_experts=e, top_k=k, max_tokens_per_rank=cap)
        gen = torch.Generator().manual_seed(t)
        x = torch.randn(t, h, generator=gen).to(torch.bfloat16).to(dev)
        idx, w = routing(t, e, k, gen, dev)
        x32, w16 = x.float(), w.bfloat16()
        out = torch.empty(t, h, dtype=torch.bfloat16, device=dev)
        for kind, kw in kinds.items():
            layer = moe_ep.MoELayer(spec, weights, backend="sm90_fp8_cutedsl", device=dev, **kw)
            calls = {"readme_call_us": lambda: layer(x, idx, w), "into_out_us": lambda: layer(x, idx, w, out=out),
                     "fp32_hidden_bf16_weights_us": lambda: layer(x32, idx, w16, out=out)}
            row: Dict[str, object] = dict(T=t, capacity=cap, world=world, layer=kind)
            graphs = layer.backend.frontend.graphs
            for name, call in calls.items():
                for _ in range(3):  # first call (checks, agreement), capture, replay: the steady state
                    call()
                sync()
                before = graphs.captures
                row[name] = host_us_per_call(call, 50, 9, sync, idle=False)
                # Graphs captured during the 450 timed calls: 0 in the steady state (#25.1: the README call captured
                # one every other call before the fix).
                row[name.replace("_us", "_captures")] = graphs.captures - before
            if kind == "defaults":
                fe = layer.backend.frontend
                row["device_us_guard_on"] = cuda_time_us(lambda: layer(x, idx, w, out=out), iters=50, warmup=5)
                fe.guard_ids = False
                fe.graphs.clear(forget_seen=False)
                row["device_us_guard_off"] = cuda_time_us(lambda: layer(x, idx, w, out=out), iters=50, warmup=5)
                fe.guard_ids = True
                fe.graphs.clear(forget_seen=False)
            layer.close()
            rows.append(row)
            if rank == 0:
                print({kk: (round(v, 2) if isinstance(v, float) else v) for kk, v in row.items()}, flush=True)
    if rank == 0:
        cols = ["T", "world", "layer", "readme_call_us", "readme_call_captures", "into_out_us", "into_out_captures",
                "fp32_hidden_bf16_weights_us", "device_us_guard_on", "device_us_guard_off"]
        print("| " + " | ".join(cols) + " |")
        print("|" + "---|" * len(cols))
        for r in rows:
            print("| " + " | ".join(f"{r[c]:.1f}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in cols)
                  + " |")
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "defaults_cost.json").write_text(
                json.dumps(dict(gpu=torch.cuda.get_device_name(dev), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
