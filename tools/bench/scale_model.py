"""A cost model of one MoE layer's forward at EP 16 / 32 / 64 (8 GPUs per NVLink domain, 400 Gb/s RDMA per GPU):
the bytes each rank sends over the network for the split and two_level paths, the time they take at the NIC's
rate and at the effective rates DeepEP, NCCL EP and UCCL-EP publish, and the layer time with the experts' compute
(by default the fused kernel's time at world size 1 measured on the H200; --compute-us replaces it with another
run's). docs/scale-out.md prints and discusses its output.

    python -m tools.bench.scale_model [--tokens 4096] [--compute-us 3894] [--split-overhead-us 0]
    python -m tools.bench.scale_model --tokens 4096 --from-bench benchmarks/h200/round4_0.7.4/split_bench/split_bench.json

--from-bench takes the compute and each path's own cost from a split_bench run at world size 1 (tools/bench/
split_bench.py) at the same T: the fused layer's captured time as the compute, and per path its captured time over
the fused layer's (the path's local work: routing, the exchange, which at W=1 moves nothing over a network, and the
combine). W=1 cannot check the network term; it fixes the rest of each row.

Routing is uniform over the experts (every token's K experts distinct): a token reaches
n (1 - C(E - E/n, K) / C(E, K)) of n equal groups of experts, so the split path sends a token to that many ranks
(n = W) and two_level to that many domains (n = W / 8); the share of them outside the sender's domain is what
crosses the network. DeepSeek-V3's own router limits a token to 4 nodes (--max-nodes), which caps two_level's
fan-out. Nothing here is measured: each number is the formula's, for the inputs printed with it.
"""

from __future__ import annotations

import argparse
import json
from math import comb
from typing import Dict, List, Optional, Tuple

__all__ = ["reach", "bytes_per_rank", "model", "from_bench", "BENCH_PATHS", "PUBLISHED", "main"]

NIC_GBPS = 50.0  # 400 Gb/s
# Effective per-GPU RDMA bandwidth (GB/s) the libraries publish at these EP sizes, dispatch / combine.
PUBLISHED: Dict[str, Dict[int, tuple]] = {
    # deepseek-ai/DeepEP docs/legacy.md (V1 normal kernels, H800 + CX7 400 Gb/s, 4096 tokens, FP8 dispatch, BF16
    # combine)
    "DeepEP V1 normal": {16: (43, 43), 32: (58, 57), 64: (51, 50)},
    # NVIDIA/nccl contrib/nccl_ep/README.md (low-latency mode, H100, BF16 both ways, 128 tokens per rank)
    "NCCL EP low-latency": {16: (76.7, 73.0), 32: (53.6, 50.0), 64: (48.8, 43.8)},
    # uccl-project/uccl ep/README.md (normal kernels, 8x H200 + 16x 200 Gb/s EFA, DeepSeek-V3 pretraining setting)
    "UCCL-EP normal (EFA)": {16: (50, 18), 32: (54, 43)},
}
# torch.distributed all_to_all_single over NCCL: no published number at these sizes; modelled at 80% of the NIC.
NCCL_A2A_GBPS = 0.8 * NIC_GBPS


def reach(groups: int, top_k: int, experts: int) -> float:
    """Expected number of `groups` equal expert groups a token's top_k distinct experts fall in."""
    if groups <= 1:
        return 1.0
    per = experts // groups
    return groups * (1 - comb(experts - per, top_k) / comb(experts, top_k))


def bytes_per_rank(world: int, *, tokens: int, hidden: int = 7168, top_k: int = 8, experts: int = 256,
                   domain: int = 8, max_nodes: Optional[int] = None) -> Dict[str, Dict[str, float]]:
    """Bytes one rank sends over the network for one call (what it receives is the same on average)."""
    fp8_row = hidden + hidden // 128 * 4 + 2 * top_k * 4  # e4m3 + 1x128 scales + ids + weights
    bf16_row = 2 * hidden + 2 * top_k * 4
    out_row = 2 * hidden  # each partial comes back in bf16
    nodes = world // domain
    split_copies = reach(world, top_k, experts) * (world - domain) / world
    node_reach = reach(nodes, top_k, experts)
    if max_nodes is not None:
        node_reach = min(node_reach, max_nodes)
    two_copies = node_reach * (nodes - 1) / nodes if nodes > 1 else 0.0
    return {
        "split (FP8 out, bf16 back)": dict(copies=split_copies, dispatch=tokens * split_copies * fp8_row,
                                           combine=tokens * split_copies * out_row),
        "two_level (bf16 out, as built)": dict(copies=two_copies, dispatch=tokens * two_copies * bf16_row,
                                               combine=tokens * two_copies * out_row),
        "two_level (FP8 out)": dict(copies=two_copies, dispatch=tokens * two_copies * fp8_row,
                                    combine=tokens * two_copies * out_row),
    }


# The split_bench columns whose captured time over the fused layer's is each modelled path's own cost at W=1.
BENCH_PATHS = {"split (FP8 out, bf16 back)": "split_fp8wire_graph_us",
               "two_level (bf16 out, as built)": "two_level_graph_us",
               "two_level (FP8 out)": "two_level_fp8wire_graph_us"}


def from_bench(path: str, tokens: int) -> Tuple[float, Dict[str, float]]:
    """(compute us, {modelled path: its own cost us}) from a split_bench JSON's row at T = tokens."""
    with open(path) as f:
        rows = json.load(f)["rows"]
    row = next((r for r in rows if r.get("T") == tokens), None)
    if row is None:
        raise SystemExit(f"scale_model: {path} has no row at T={tokens} (it has {[r.get('T') for r in rows]})")
    fused = row.get("fused_graph_us")
    if not isinstance(fused, (int, float)) or fused != fused:
        raise SystemExit(f"scale_model: {path} has no fused_graph_us at T={tokens}")
    costs = {}
    for name, key in BENCH_PATHS.items():
        v = row.get(key)
        if not isinstance(v, (int, float)) or v != v:
            raise SystemExit(f"scale_model: {path} has no {key} at T={tokens}")
        costs[name] = v - fused
    return fused, costs


def model(worlds=(16, 32, 64), *, tokens: int = 4096, compute_us: float = 3894.0, split_overhead_us: float = 0.0,
          max_nodes: Optional[int] = None, path_costs: Optional[Dict[str, float]] = None) -> List[dict]:
    """path_costs: each path's own cost (us) in place of split_overhead_us, by path name."""
    rows = []
    for w in worlds:
        for path, b in bytes_per_rank(w, tokens=tokens, max_nodes=max_nodes).items():
            own = (path_costs or {}).get(path, split_overhead_us)
            row = dict(EP=w, path=path, copies=b["copies"], dispatch_MB=b["dispatch"] / 1e6,
                       combine_MB=b["combine"] / 1e6, own_us=own)
            rates = {"NIC 400 Gb/s": (NIC_GBPS, NIC_GBPS), "NCCL all_to_all (80% NIC)": (NCCL_A2A_GBPS,) * 2}
            rates.update({k: v[w] for k, v in PUBLISHED.items() if w in v})
            for name, (d, c) in rates.items():
                comm = b["dispatch"] / (d * 1e3) + b["combine"] / (c * 1e3)  # bytes / (GB/s) -> us
                row[f"comm_us[{name}]"] = comm
                row[f"layer_us[{name}]"] = comm + compute_us + own
            rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank per call")
    p.add_argument("--compute-us", type=float, default=3894.0,
                   help="the rank's expert compute (default: the fused kernel at W=1, T=4096, on the H200)")
    p.add_argument("--split-overhead-us", type=float, default=0.0, help="the split path's own cost (split_bench)")
    p.add_argument("--max-nodes", type=int, default=None, help="cap a token's nodes (DeepSeek-V3 routes to <= 4)")
    p.add_argument("--from-bench", default=None, metavar="JSON",
                   help="compute and each path's own cost from a split_bench run at world size 1, at --tokens")
    args = p.parse_args(argv)
    compute, costs = args.compute_us, None
    if args.from_bench:
        compute, costs = from_bench(args.from_bench, args.tokens)
    rows = model(tokens=args.tokens, compute_us=compute, split_overhead_us=args.split_overhead_us,
                 max_nodes=args.max_nodes, path_costs=costs)
    rate_names = [k[len("comm_us["):-1] for k in rows[0] if k.startswith("comm_us[")]
    own = ("each path's own cost at W=1 (split_bench): " + ", ".join(f"{k} {v:+.0f} us" for k, v in costs.items())
           if costs else f"split overhead {args.split_overhead_us:.0f} us")
    print(f"T={args.tokens} tokens per rank, compute {compute:.0f} us, {own}; communication in us at each rate "
          f"(dispatch + combine, not overlapped)")
    layer = "NCCL all_to_all (80% NIC)"
    print("| EP | path | copies/token | out MB | back MB | " + " | ".join(rate_names) + f" | layer us ({layer}) |")
    print("|---|---|---|---|---|" + "---|" * (len(rate_names) + 1))
    for r in rows:
        cells = [f"{r.get(f'comm_us[{n}]', float('nan')):.0f}" if f"comm_us[{n}]" in r else "" for n in rate_names]
        print(f"| {r['EP']} | {r['path']} | {r['copies']:.2f} | {r['dispatch_MB']:.0f} | {r['combine_MB']:.0f} | "
              + " | ".join(cells) + f" | {r[f'layer_us[{layer}]']:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
