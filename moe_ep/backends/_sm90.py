"""What the Hopper kernel backends share: frontend construction, knob cache key, knobs="auto", launch."""

from __future__ import annotations

from typing import ClassVar, List, Optional, Tuple

from moe_ep.core.backend import Backend
from moe_ep.core.weights import ExpertWeights, QuantizedWeights

__all__ = ["Sm90KernelBackend"]


class Sm90KernelBackend(Backend):
    arch = "sm90"
    multiple_of: ClassVar[int] = 128  # hidden and intermediate divisibility the kernel needs

    @staticmethod
    def frontend_class():
        raise NotImplementedError

    def __init__(self, spec, ctx, fmt: Optional[str] = None, *, knobs=None, max_active_clusters=None,
                 knob_cache_key: Optional[str] = None):
        super().__init__(spec, ctx, fmt)
        from shim.common.knob_cache import cache_key

        e_local = spec.experts_per_rank(ctx.world_size)
        key = knob_cache_key or cache_key(
            arch="sm90", fmt=self.fmt, hidden=spec.hidden_size, intermediate=spec.intermediate_size,
            experts_per_rank=e_local, top_k=spec.top_k, world_size=ctx.world_size,
            capacity=spec.max_tokens_per_rank)
        self._auto = knobs == "auto"
        self._knob_cache_key = key
        self._frontend_kw = dict(
            hidden=spec.hidden_size, intermediate=spec.intermediate_size, experts_per_rank=e_local,
            top_k=spec.top_k, capacity=spec.max_tokens_per_rank, rank=ctx.rank, world_size=ctx.world_size,
            group=ctx.group, device=ctx.device, gate_up_clamp=spec.gate_up_clamp,
            knob_cache_key=key, max_active_clusters=max_active_clusters)
        self.frontend = self._make_frontend(knobs)
        self.autotune_result = None
        self._last_t = 0

    def _make_frontend(self, knobs):
        return self.frontend_class()(knobs=knobs, **self._frontend_kw)

    @classmethod
    def check_spec(cls, spec, fmt: str, world_size: int) -> List[Tuple[str, str]]:
        problems = list(super().check_spec(spec, fmt, world_size))
        if fmt not in cls.weight_formats:
            problems.append(("fmt", f"{cls.name} serves {list(cls.weight_formats)}, not {fmt!r}"))
        for name, value in (("hidden_size", spec.hidden_size), ("intermediate_size", spec.intermediate_size)):
            if value % cls.multiple_of:
                problems.append((name, f"must be a multiple of {cls.multiple_of} for {cls.name}, got {value}"))
        return problems

    @property
    def knobs(self):
        return self.frontend.knobs

    def prepare_weights(self, weights: ExpertWeights) -> None:
        if self._auto and self.frontend.knob_source != "cache":
            # knobs="auto" and nothing cached for this key: tune collectively now, cache the winner, rebuild.
            # The first frontend stays open while tuning: its heap keeps NVSHMEM initialised throughout.
            from shim.sm90.tune import autotune

            first = self.frontend
            winner, self.autotune_result = autotune(
                self._make_frontend, weights.w13, weights.w2, fmt=self.fmt,
                capacity=self.spec.max_tokens_per_rank, experts_total=self.spec.num_experts,
                expert_offset=weights.expert_offset, top_k=self.spec.top_k, cache_key=self._knob_cache_key,
                group=self.ctx.group)
            self.frontend = self._make_frontend(winner)
            self.frontend.knob_source = "autotune"
            first.close()
        self.frontend.load_weights(weights.w13, weights.w2)
        self.frontend.compile()

    def forward(self, hidden, topk_idx, topk_weights, out):
        self._last_t = hidden.shape[0]
        return self.frontend.forward(hidden, topk_idx, topk_weights, out)

    def oracle_weights(self) -> QuantizedWeights:
        return self.frontend.weights.canonical

    def close(self) -> None:
        self.frontend.close()
