"""Two CPU ranks through moe_ep's public API, each checked against the torch oracle.

What each EP rank of an engine does, with two local processes standing in for two GPUs: join the
group from torchrun's variables (moe_ep.init_from_env), hold its slice of the experts, run one layer
forward on its own tokens, and check its output against the single-process oracle over every
rank's experts (moe_ep.reference.oracle.check_multirank, a collective).

This file is both the test (pytest starts the ranks) and the rank program (`--rank N`).
"""

import argparse
import json
import os
import socket
import subprocess
import sys

import pytest

WORLD_SIZE = 2
HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 256, 128, 8, 4
TOKENS = (24, 7)  # per rank: the ranks need not agree on their token counts
CAPACITY = 32  # max_tokens_per_rank: fixed per layer


def _expert(e):
    """(w13 [2I, H], w2 [H, I]) bf16 of global expert e, the same on every rank."""
    import torch

    g = torch.Generator().manual_seed(1000 + e)
    w13 = torch.randn(2 * INTERMEDIATE, HIDDEN, generator=g) * HIDDEN ** -0.5
    w2 = torch.randn(HIDDEN, INTERMEDIATE, generator=g) * INTERMEDIATE ** -0.5
    return w13.to(torch.bfloat16), w2.to(torch.bfloat16)


def rank_main():
    import torch
    import torch.distributed

    import moe_ep
    from moe_ep.reference.oracle import check_multirank

    ctx = moe_ep.init_from_env()  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; gloo on CPU
    rank, world = ctx.rank, ctx.world_size
    per_rank = EXPERTS // world
    mine = [_expert(e) for e in range(rank * per_rank, (rank + 1) * per_rank)]
    weights = moe_ep.ExpertWeights(w13=torch.stack([w for w, _ in mine]), w2=torch.stack([w for _, w in mine]),
                                   rank=rank, world_size=world, num_experts=EXPERTS)
    spec = moe_ep.MoESpec(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_experts=EXPERTS, top_k=TOP_K,
                          max_tokens_per_rank=CAPACITY)
    layer = moe_ep.MoELayer(spec, weights)  # CPU: the registry picks the torch reference backend

    g = torch.Generator().manual_seed(7 + rank)
    t = TOKENS[rank]
    hidden = torch.randn(t, HIDDEN, generator=g).to(torch.bfloat16)
    topk_idx = torch.rand(t, EXPERTS, generator=g).topk(TOP_K, dim=1).indices  # distinct experts per token
    topk_weights = torch.softmax(torch.randn(t, TOP_K, generator=g), dim=1)

    out = layer(hidden, topk_idx, topk_weights)
    report = check_multirank(layer, hidden, topk_idx, topk_weights, out, weights=weights, raise_on_failure=False)
    mine = report.mine(rank)
    print(json.dumps({"rank": rank, "world_size": world, "backend": layer.backend_name, "fmt": layer.fmt,
                      "shape": list(out.shape), "dtype": str(out.dtype), "ok": report.ok,
                      "max_row_rel_err": mine.max_row_rel_err, "tolerance": mine.tolerance,
                      "summary": report.summary()}), flush=True)
    layer.close()
    # Leave together: a gloo rank that exits while its peer is still tearing down can abort the peer.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0 if report.ok else 1


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_cpu_ranks_match_the_oracle():
    port = str(_free_port())
    procs = []
    for rank in range(WORLD_SIZE):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, MOE_EP_DEVICE="cpu")
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank", str(rank)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for rank, p in enumerate(procs):
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{out[-2000:]}\n{err[-4000:]}"
        results.append(json.loads(out.strip().splitlines()[-1]))
    for rank, r in enumerate(results):
        print(r)
        assert (r["rank"], r["world_size"]) == (rank, WORLD_SIZE)
        assert r["backend"] == "torch_reference"
        assert r["shape"] == [TOKENS[rank], HIDDEN] and r["dtype"] == "torch.bfloat16"
        assert r["ok"] and r["max_row_rel_err"] <= r["tolerance"], r["summary"]


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, help="run as this rank (the test starts one process per rank)")
    if ap.parse_args().rank is not None:
        sys.exit(rank_main())
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
