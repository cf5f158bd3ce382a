"""Deterministic MoE problems. Every rank can rebuild any rank's data from (seed, rank), so no data
collective is needed to set a problem up, and a failure is reproducible from its seed alone."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

import torch

from moe_ep.core.spec import MoESpec
from moe_ep.core.weights import ExpertWeights
from moe_ep.formats import packs
from moe_ep.reference import ffn

__all__ = ["ROUTINGS", "Problem", "make_routing", "unquantized_reference"]

# balanced:  every expert gets the same number of (token, slot) pairs (+-1), ids shuffled per rank
# uniform:   K distinct experts per token, uniformly at random
# skewed:    ~90% of tokens send every slot they can to one rank's experts (the hot rank)
# no_local:  no token picks an expert of its own rank (everything crosses ranks)
# masked:    uniform, then about a quarter of the slots set to -1 ("no expert", as engines pad and expert-load
#            balancers mask) and every fifth token masked entirely (its output is zero)
ROUTINGS = ("balanced", "uniform", "skewed", "no_local", "masked")


def _gen(*key: int) -> torch.Generator:
    seed = 0
    for k in key:
        seed = (seed * 1_000_003 + int(k) + 7) % (2 ** 63 - 1)
    return torch.Generator().manual_seed(seed)


def make_routing(kind: str, tokens: int, num_experts: int, top_k: int, world_size: int, rank: int, seed: int,
                 hot_rank: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """(topk_idx int64 [T, K], topk_weights fp32 [T, K]) on CPU; ids are distinct within a token."""
    g = _gen(seed, 11, rank)
    e_local = num_experts // world_size
    if kind == "balanced":
        perm = torch.randperm(num_experts, generator=g)
        start = int(torch.randint(num_experts, (1,), generator=g))
        slots = (start + torch.arange(tokens * top_k)) % num_experts
        idx = perm[slots].reshape(tokens, top_k)
    else:
        scores = torch.rand((tokens, num_experts), generator=g)
        if kind == "skewed":
            hot = torch.rand((tokens,), generator=g) < 0.9
            block = slice(hot_rank * e_local, (hot_rank + 1) * e_local)
            scores[hot, block] += 2.0
        elif kind == "no_local":
            if num_experts - e_local < top_k:
                raise ValueError("no_local routing needs num_experts - experts_per_rank >= top_k")
            scores[:, rank * e_local:(rank + 1) * e_local] = -1.0
        elif kind not in ("uniform", "masked"):
            raise ValueError(f"routing must be one of {ROUTINGS}, got {kind!r}")
        idx = scores.topk(top_k, dim=1).indices
        if kind == "masked":
            idx = idx.masked_fill(torch.rand((tokens, top_k), generator=g) < 0.25, -1)
            idx[::5] = -1
    weights = torch.softmax(torch.randn((tokens, top_k), generator=g), dim=1).to(torch.float32)
    return idx.to(torch.int64).contiguous(), weights.contiguous()


@dataclass
class Problem:
    spec: MoESpec
    world_size: int
    tokens: Sequence[int]          # per rank
    routing: str = "balanced"
    seed: int = 0
    hot_rank: int = 0

    @classmethod
    def build(cls, spec: MoESpec, world_size: int, tokens: Union[int, Sequence[int]], routing: str = "balanced",
              seed: int = 0, hot_rank: int = 0) -> "Problem":
        if isinstance(tokens, int):
            tokens = [tokens] * world_size
        if len(tokens) != world_size:
            raise ValueError(f"tokens: expected {world_size} per-rank counts, got {list(tokens)}")
        return cls(spec, world_size, list(tokens), routing, seed, hot_rank)

    # -- data ----------------------------------------------------------------------------------------------
    def expert_weights(self, expert: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """(w13 [2I, H], w2 [H, I]) bf16 of one global expert, scaled so activations stay O(1)."""
        h, i = self.spec.hidden_size, self.spec.intermediate_size
        g = _gen(self.seed, 23, expert)
        w13 = torch.randn((2 * i, h), generator=g) * (h ** -0.5)
        w2 = torch.randn((h, i), generator=g) * (i ** -0.5)
        return w13.to(torch.bfloat16), w2.to(torch.bfloat16)

    def global_weights(self, experts: Optional[range] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        experts = range(self.spec.num_experts) if experts is None else experts
        pairs = [self.expert_weights(e) for e in experts]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])

    def inputs(self, rank: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(hidden bf16 [T, H], topk_idx int64 [T, K], topk_weights fp32 [T, K]) of one rank, on CPU."""
        t = self.tokens[rank]
        hidden = torch.randn((t, self.spec.hidden_size), generator=_gen(self.seed, 31, rank)).to(torch.bfloat16)
        idx, w = make_routing(self.routing, t, self.spec.num_experts, self.spec.top_k, self.world_size, rank,
                              self.seed, self.hot_rank)
        return hidden, idx, w

    def calibration(self, margin: float = 1.1) -> Tuple[float, float]:
        """(act_amax, fc2_act_amax) over every rank's tokens with bf16 math: what an offline calibration pass
        would record. Needs every expert's weights: meant for test-sized problems."""
        w13, w2 = self.global_weights()
        qw = packs.quantize_weights("bf16", w13, w2)
        act_amax, fc2_amax = 0.0, 0.0
        for r in range(self.world_size):
            hidden, idx, w = self.inputs(r)
            if hidden.shape[0] == 0:
                continue
            act_amax = max(act_amax, float(hidden.float().abs().max()))
            for e in torch.unique(idx).tolist():
                if e < 0:
                    continue
                tok, slot = (idx == e).nonzero(as_tuple=True)
                fc1 = hidden[tok].float() @ qw.w13_q[e].float().t()
                y = ffn.swiglu(fc1, self.spec.gate_up_clamp) * w[tok, slot].unsqueeze(1)
                fc2_amax = max(fc2_amax, float(y.abs().max()))
        return act_amax * margin or 1.0, fc2_amax * margin or 1.0

    def rank_weights(self, rank: int, calibrate: bool = False) -> ExpertWeights:
        e_local = self.spec.num_experts // self.world_size
        w13, w2 = self.global_weights(range(rank * e_local, (rank + 1) * e_local))
        kw = {}
        if calibrate:
            kw["act_amax"], kw["fc2_act_amax"] = self.calibration()
        return ExpertWeights(w13, w2, rank, self.world_size, self.spec.num_experts, **kw)


def unquantized_reference(weights, hidden: torch.Tensor, topk_idx: torch.Tensor,
                          topk_weights: torch.Tensor) -> Optional[torch.Tensor]:
    """fp32 MoE forward with no quantization over one rank's ExpertWeights (world size 1 only, else None): the
    GPU suites set a kernel's output against it to show the format's own error, apart from the oracle check."""
    if weights.world_size != 1:
        return None
    w13, w2 = weights.w13.float(), weights.w2.float()
    i = w2.shape[2]
    out = torch.zeros(hidden.shape[0], hidden.shape[1], dtype=torch.float32, device=hidden.device)
    for e in range(w13.shape[0]):  # a -1 slot matches no expert: it contributes nothing
        tok, slot = (topk_idx == e).nonzero(as_tuple=True)
        if tok.numel():
            f = hidden[tok].float() @ w13[e].t()
            y = torch.nn.functional.silu(f[:, :i]) * f[:, i:] * topk_weights[tok, slot, None]
            out.index_put_((tok,), y @ w2[e].t(), accumulate=True)
    return out
