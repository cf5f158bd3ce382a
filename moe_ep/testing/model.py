"""A model of N MoE blocks, as an engine holds them: each block routes (a linear router, top-k, softmax over the
chosen logits), runs its own moe_ep layer and adds the result to the residual stream. All blocks run one after
another on one stream; every layer of the process shares one workspace (shim/common/workspace.py).

Used by the CPU tests (torch.compile(fullgraph=True) over the custom op), the main job's --model-layers mode
and the model benchmark (tools/bench/model_bench.py: the whole model captured in one CUDA graph).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from moe_ep.core.spec import MoESpec
from moe_ep.core.weights import ExpertWeights
from moe_ep.layer import MoELayer

__all__ = ["MoEBlock", "MoEModel", "route"]


def route(logits: torch.Tensor, top_k: int):
    """(topk_idx int64 [T, K], topk_weights fp32 [T, K]): the top-k experts by router logit, weights the
    softmax over the chosen logits (DeepSeek-style normalisation)."""
    vals, idx = torch.topk(logits.float(), top_k, dim=-1)
    return idx, torch.softmax(vals, dim=-1)


class MoEBlock(torch.nn.Module):
    def __init__(self, layer: MoELayer, router: torch.Tensor):
        super().__init__()
        self.layer = layer
        self.register_buffer("router", router)  # [E, H] bf16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx, w = route(x @ self.router.t(), self.layer.spec.top_k)
        return x + self.layer(x, idx, w)


class MoEModel(torch.nn.Module):
    """N blocks over the same rank context; `layers` are built by the caller (collectively, in order)."""

    def __init__(self, blocks: Sequence[MoEBlock]):
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)

    @classmethod
    def build(cls, spec: MoESpec, weights: Sequence[ExpertWeights], *, seed: int = 0, device=None,
              **layer_options) -> "MoEModel":
        """One block per ExpertWeights (reused objects are fine: an engine's layers each own theirs, a test may
        share one pack), routers drawn from `seed` (the same on every rank)."""
        gen = torch.Generator().manual_seed(seed)
        blocks: List[MoEBlock] = []
        for w in weights:
            layer = MoELayer(spec, w, device=device, **layer_options)
            router = (torch.randn(spec.num_experts, spec.hidden_size, generator=gen) * spec.hidden_size ** -0.5)
            blocks.append(MoEBlock(layer, router.to(torch.bfloat16).to(layer.device)))
        return cls(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    @property
    def layers(self) -> List[MoELayer]:
        return [b.layer for b in self.blocks]

    def close(self) -> None:
        for layer in reversed(self.layers):  # collective: every rank closes in the same order
            layer.close()


def zero_token_input(spec: MoESpec, device: Optional[torch.device] = None) -> torch.Tensor:
    """An idle rank's input under data-parallel attention: no tokens, but it still takes part in every call."""
    return torch.empty(0, spec.hidden_size, dtype=torch.bfloat16, device=device)
