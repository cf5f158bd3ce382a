"""A cost model of one MoE layer's forward at EP 16 / 32 / 64 (8 GPUs per NVLink domain, 400 Gb/s RDMA per GPU):
the bytes each rank sends over the network for the split and two_level paths, the time they take at the NIC's
rate and at the effective rates DeepEP, NCCL EP and UCCL-EP publish, and the layer time with the experts' compute
(by default the fused kernel's time at world size 1 measured on the H200; --compute-us replaces it with another
run's). docs/scale-out.md prints and discusses its output.

    python -m tools.bench.scale_model [--tokens 4096] [--compute-us 3894] [--split-overhead-us 0]

Routing is uniform over the experts (every token's K experts distinct): a token reaches
n (1 - C(E - E/n, K) / C(E, K)) of n equal groups of experts, so the split path sends a token to that many ranks
(n = W) and two_level to that many domains (n = W / 8); the share of them outside the sender's domain is what
crosses the network. DeepSeek-V3's own router limits a token to 4 nodes (--max-nodes), which caps two_level's
fan-out. Nothing here is measured: each number is the formula's, for the inputs printed with it.
"""

from __future__ import annotations

import argparse
from math import comb
from typing import Dict, List, Optional

__all__ = ["reach", "bytes_per_rank", "model", "PUBLISHED", "main"]

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


def model(worlds=(16, 32, 64), *, tokens: int = 4096, compute_us: float = 3894.0, split_overhead_us: float = 0.0,
          max_nodes: Optional[int] = None) -> List[dict]:
    rows = []
    for w in worlds:
        for path, b in bytes_per_rank(w, tokens=tokens, max_nodes=max_nodes).items():
            row = dict(EP=w, path=path, copies=b["copies"], dispatch_MB=b["dispatch"] / 1e6,
                       combine_MB=b["combine"] / 1e6)
            rates = {"NIC 400 Gb/s": (NIC_GBPS, NIC_GBPS), "NCCL all_to_all (80% NIC)": (NCCL_A2A_GBPS,) * 2}
            rates.update({k: v[w] for k, v in PUBLISHED.items() if w in v})
            for name, (d, c) in rates.items():
                comm = b["dispatch"] / (d * 1e3) + b["combine"] / (c * 1e3)  # bytes / (GB/s) -> us
                row[f"comm_us[{name}]"] = comm
                row[f"layer_us[{name}]"] = comm + compute_us + split_overhead_us
            rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank per call")
    p.add_argument("--compute-us", type=float, default=3894.0,
                   help="the rank's expert compute (default: the fused kernel at W=1, T=4096, on the H200)")
    p.add_argument("--split-overhead-us", type=float, default=0.0, help="the split path's own cost (split_bench)")
    p.add_argument("--max-nodes", type=int, default=None, help="cap a token's nodes (DeepSeek-V3 routes to <= 4)")
    args = p.parse_args(argv)
    rows = model(tokens=args.tokens, compute_us=args.compute_us, split_overhead_us=args.split_overhead_us,
                 max_nodes=args.max_nodes)
    rate_names = [k[len("comm_us["):-1] for k in rows[0] if k.startswith("comm_us[")]
    print(f"T={args.tokens} tokens per rank, compute {args.compute_us:.0f} us, split overhead "
          f"{args.split_overhead_us:.0f} us; communication in us at each rate (dispatch + combine, not overlapped)")
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
