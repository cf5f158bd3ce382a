"""Where the time of one moe_ep forward goes on the GPU: per-kernel CUDA time under torch.profiler.

    python -m tools.bench.profile_breakdown --out DIR [--tokens 8 128 512 4096]

For each token count (DeepSeek-V3 geometry, capacity = T rounded up to a power of two, heuristic knobs) it
replays the forward's CUDA graph under the profiler and sums device time per kernel, grouped as: the fused
MegaMoE kernel, the top-k reduce kernel, and moe_ep's own staging (activation quantization, routing copies,
spare-row masking, output copy). Writes breakdown.md / breakdown.json.
"""

from __future__ import annotations

import argparse
import json
import os
import torch


def main(argv=None) -> int:
    import moe_ep
    from tools.bench.bench import GEOMS, bucket, init_single_rank, routing
    from tools.bench.timing import kernel_groups_us
    from tools.bench.weights import random_weights

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "profile_out"))
    p.add_argument("--tokens", nargs="+", type=int, default=[8, 128, 512, 4096])
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    dev = init_single_rank("29519")
    g = GEOMS["dsv3"]
    h, i, e, k = g["hidden"], g["intermediate"], g["experts"], g["top_k"]
    gen = torch.Generator().manual_seed(0)
    weights = random_weights(g, gen, dev)
    rows = []
    for t in args.tokens:
        spec = moe_ep.MoESpec(hidden_size=h, intermediate_size=i, num_experts=e, top_k=k,
                              max_tokens_per_rank=bucket(t))
        layer = moe_ep.MoELayer(spec, weights, backend="sm90_fp8_cutedsl", device=dev, check_values=False,
                                collective_checks=False)
        x = torch.randn(t, h, generator=gen).to(torch.bfloat16).to(dev)
        idx, w = routing(t, e, k, gen, dev)
        out = torch.empty(t, h, dtype=torch.bfloat16, device=dev)
        for _ in range(5):
            layer(x, idx, w, out=out)
        per, names = kernel_groups_us(lambda: layer(x, idx, w, out=out), args.iters)
        row = {"T": t, "capacity": bucket(t), "knobs": str(layer.backend.knobs),
               "us_per_forward": {kk: round(v, 1) for kk, v in per.items()},
               "top_kernels": {kk: round(v, 1) for kk, v in sorted(names.items(), key=lambda kv: -kv[1])[:8]}}
        rows.append(row)
        print(json.dumps(row), flush=True)
        layer.close()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "breakdown.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(args.out, "breakdown.md"), "w") as f:
        cats = sorted({c for r in rows for c in r["us_per_forward"]})
        f.write("# GPU time per forward by kernel group (us, torch.profiler, mean of %d)\n\n" % args.iters)
        f.write("| T | capacity | " + " | ".join(cats) + " |\n|" + "---|" * (len(cats) + 2) + "\n")
        for r in rows:
            f.write(f"| {r['T']} | {r['capacity']} | " + " | ".join(str(r["us_per_forward"].get(c, 0)) for c in cats)
                    + " |\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
