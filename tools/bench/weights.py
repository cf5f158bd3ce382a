"""The expert weights the benchmarks and the GPU diagnostics build a layer from: random normal bf16 at
1/sqrt(fan-in) scale, so activations keep their size through both projections."""

from __future__ import annotations

import torch

__all__ = ["random_weights"]


def random_weights(geom: dict, gen: torch.Generator, device, rank: int = 0, world_size: int = 1):
    """moe_ep.ExpertWeights for one rank of `geom` (hidden, intermediate, experts per rank), drawn from `gen` on
    the CPU and moved to `device`."""
    import moe_ep

    h, i, e = geom["hidden"], geom["intermediate"], geom["experts"]
    w13 = (torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5).to(torch.bfloat16).to(device)
    w2 = (torch.randn(e, h, i, generator=gen) / i ** 0.5).to(torch.bfloat16).to(device)
    return moe_ep.ExpertWeights(w13=w13, w2=w2, rank=rank, world_size=world_size, num_experts=e * world_size)
