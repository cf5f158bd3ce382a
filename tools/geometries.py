"""The MoE geometries the benchmarks and the tuner use, per rank (what one rank's layer holds at world size 1;
at world size W the same local geometry with W times the experts)."""

from __future__ import annotations

from typing import Dict

__all__ = ["GEOMETRIES", "spec_for"]

GEOMETRIES: Dict[str, Dict[str, int]] = {
    # DeepSeek-V3: hidden 7168, moe_intermediate 2048, top-8; 32 local experts (256 over EP8).
    "dsv3": dict(hidden=7168, intermediate=2048, experts=32, top_k=8),
    # Qwen3-235B-A22B: hidden 4096, moe_intermediate 1536, 128 experts, top-8 (all local at EP1).
    "qwen3_235b": dict(hidden=4096, intermediate=1536, experts=128, top_k=8),
    # Qwen3-30B-A3B: hidden 2048, moe_intermediate 768, 128 experts, top-8.
    "qwen3_30b": dict(hidden=2048, intermediate=768, experts=128, top_k=8),
    # Mixtral-8x7B: hidden 4096, intermediate 14336, 8 experts, top-2.
    "mixtral": dict(hidden=4096, intermediate=14336, experts=8, top_k=2),
    # One rank's experts at EP=8, laid out as a world-size-1 layer (what one GPU of an 8-GPU deployment computes; its
    # knob choice carries to the EP=8 layer through the knob model, which matches by tokens per local expert, H, I and
    # top-k, not by world size). From each model's config.json: hidden_size, moe_intermediate_size,
    # n_routed_experts / num_experts divided by 8, num_experts_per_tok.
    # Qwen3-235B-A22B: 4096, 1536, 128 / 8 = 16, top-8.
    "qwen3_235b_ep8": dict(hidden=4096, intermediate=1536, experts=16, top_k=8),
    # Kimi-K2: 7168, 2048, 384 / 8 = 48, top-8.
    "kimi_k2_ep8": dict(hidden=7168, intermediate=2048, experts=48, top_k=8),
    # GLM-4.5: 5120, 1536, 160 / 8 = 20, top-8.
    "glm45_ep8": dict(hidden=5120, intermediate=1536, experts=20, top_k=8),
    # A small layer for quick checks.
    "small": dict(hidden=2048, intermediate=768, experts=16, top_k=4),
}


def spec_for(name: str, capacity: int, world_size: int = 1):
    import moe_ep

    g = GEOMETRIES[name]
    return moe_ep.MoESpec(hidden_size=g["hidden"], intermediate_size=g["intermediate"],
                          num_experts=g["experts"] * world_size, top_k=g["top_k"], max_tokens_per_rank=capacity)
