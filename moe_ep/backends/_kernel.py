"""What every kernel backend shares: one shim frontend per layer, built from the spec, the rank context and a
knob-cache key that names the geometry; weights prepared and the kernel compiled once, at load."""

from __future__ import annotations

from typing import Optional

from moe_ep.core.backend import Backend
from moe_ep.core.weights import ExpertWeights

__all__ = ["KernelBackend"]


class KernelBackend(Backend):
    def __init__(self, spec, ctx, fmt: Optional[str] = None, *, knobs=None, max_active_clusters=None,
                 knob_cache_key: Optional[str] = None):
        super().__init__(spec, ctx, fmt)
        from shim.common.knob_cache import cache_key

        e_local = spec.experts_per_rank(ctx.world_size)
        self._knob_cache_key = knob_cache_key or cache_key(
            arch=self.arch, fmt=self.fmt, hidden=spec.hidden_size, intermediate=spec.intermediate_size,
            experts_per_rank=e_local, top_k=spec.top_k, world_size=ctx.world_size,
            capacity=spec.max_tokens_per_rank)
        self._frontend_kw = dict(
            hidden=spec.hidden_size, intermediate=spec.intermediate_size, experts_per_rank=e_local,
            top_k=spec.top_k, capacity=spec.max_tokens_per_rank, rank=ctx.rank, world_size=ctx.world_size,
            group=ctx.group, device=ctx.device, gate_up_clamp=spec.gate_up_clamp,
            knob_cache_key=self._knob_cache_key, max_active_clusters=max_active_clusters)
        self._last_t = 0
        self.frontend = self.make_frontend(knobs)

    def make_frontend(self, knobs):
        """A new shim frontend (one workspace) for this layer with the given knobs."""
        raise NotImplementedError

    @property
    def knobs(self):
        return self.frontend.knobs

    def prepare_weights(self, weights: ExpertWeights) -> None:
        self.frontend.load_weights(weights.w13, weights.w2)
        self.frontend.compile()

    def forward(self, hidden, topk_idx, topk_weights, out):
        self._last_t = hidden.shape[0]
        return self.frontend.forward(hidden, topk_idx, topk_weights, out)

    def close(self) -> None:
        self.frontend.close()
