"""What the Hopper kernel backends share: divisibility rules, knobs="auto" (collective autotune at load)."""

from __future__ import annotations

from typing import ClassVar, List, Tuple

from moe_ep.backends._kernel import KernelBackend
from moe_ep.core.weights import ExpertWeights, QuantizedWeights

__all__ = ["Sm90KernelBackend"]


class Sm90KernelBackend(KernelBackend):
    arch = "sm90"
    multiple_of: ClassVar[int] = 128  # hidden and intermediate divisibility the kernel needs

    @staticmethod
    def frontend_class():
        raise NotImplementedError

    def __init__(self, spec, ctx, fmt=None, *, knobs=None, **options):
        self._auto = knobs == "auto"
        super().__init__(spec, ctx, fmt, knobs=knobs, **options)
        self.autotune_result = None

    def make_frontend(self, knobs):
        return self.frontend_class()(fmt=self.fmt, knobs=knobs, **self._frontend_kw)

    @classmethod
    def check_spec(cls, spec, fmt: str, world_size: int) -> List[Tuple[str, str]]:
        problems = list(super().check_spec(spec, fmt, world_size))
        if fmt not in cls.weight_formats:
            problems.append(("fmt", f"{cls.name} serves {list(cls.weight_formats)}, not {fmt!r}"))
        for name, value in (("hidden_size", spec.hidden_size), ("intermediate_size", spec.intermediate_size)):
            if value % cls.multiple_of:
                problems.append((name, f"must be a multiple of {cls.multiple_of} for {cls.name}, got {value}"))
        return problems

    def prepare_weights(self, weights: ExpertWeights) -> None:
        if self._auto and self.frontend.knob_source != "cache":
            # knobs="auto" and nothing cached for this key: tune collectively now, cache the winner, rebuild.
            # The first frontend stays open while tuning: its heap keeps NVSHMEM initialised throughout.
            from shim.sm90.tune import autotune

            first = self.frontend
            winner, self.autotune_result = autotune(
                self.make_frontend, weights.w13, weights.w2, fmt=self.fmt,
                capacity=self.spec.max_tokens_per_rank, experts_total=self.spec.num_experts,
                expert_offset=weights.expert_offset, top_k=self.spec.top_k, cache_key=self._knob_cache_key,
                group=self.ctx.group)
            self.frontend = self.make_frontend(winner)
            self.frontend.knob_source = "autotune"
            first.close()
        super().prepare_weights(weights)

    def oracle_weights(self) -> QuantizedWeights:
        return self.frontend.weights.canonical
