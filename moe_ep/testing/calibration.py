"""A stand-in for an engine's offline activation calibration, for the statically scaled formats (fp8_tensor,
nvfp4) on synthetic weights: the GPU suites, the tuner and the benchmarks calibrate the same way."""

from __future__ import annotations

from typing import Dict

import torch

from moe_ep.reference.ffn import swiglu

__all__ = ["synthetic_calibration"]


def synthetic_calibration(w13: torch.Tensor, *, tokens: int = 512, seed: int = 0, margin: float = 1.1,
                          gate_up_clamp=None, group=None) -> Dict[str, float]:
    """act_amax / fc2_act_amax (x margin) from a bf16 pass of `tokens` standard-normal tokens (the synthetic
    inputs' distribution) through every expert of w13 [E, 2I, H], routing weight 1: an upper bound of what
    routed tokens reach. Runs on w13's device. With `group` (or an initialised default group) the ranks take the
    max, so every rank quantizes with the same static scales."""
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, w13.shape[2], generator=gen).to(torch.bfloat16).to(w13.device).float()
    amax = torch.zeros(2, device=w13.device)
    amax[0] = x.abs().max()
    for e in range(w13.shape[0]):
        amax[1] = torch.maximum(amax[1], swiglu(x @ w13[e].float().t(), gate_up_clamp).abs().max())
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return dict(act_amax=float(amax[0]) * margin, fc2_act_amax=float(amax[1]) * margin)
