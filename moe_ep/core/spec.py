"""MoESpec: the geometry of one EP MoE layer, fixed when its workspace is allocated."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from moe_ep.errors import SpecError

__all__ = ["MoESpec", "LayerGeometry"]


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SpecError(name, f"expected a positive int, got {value!r}")
    return value


@dataclass(frozen=True)
class MoESpec:
    """hidden_size H, intermediate_size I (the down projection's K; gate+up is 2I), num_experts (global),
    top_k, max_tokens_per_rank (capacity: calls with more tokens are rejected), gate_up_clamp (None or a
    positive limit: gate = min(gate, limit), up = clamp(up, -limit, limit) before SiLU)."""

    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    max_tokens_per_rank: int
    gate_up_clamp: Optional[float] = None

    def __post_init__(self):
        for name in ("hidden_size", "intermediate_size", "num_experts", "top_k", "max_tokens_per_rank"):
            _positive_int(name, getattr(self, name))
        if self.top_k > self.num_experts:
            raise SpecError("top_k", f"must be <= num_experts={self.num_experts}, got {self.top_k}")
        c = self.gate_up_clamp
        if c is not None:
            if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c <= 0:
                raise SpecError("gate_up_clamp", f"expected None or a finite positive number, got {c!r}")
            # Frozen dataclass: normalise through object.__setattr__ so equality/hash see a float.
            object.__setattr__(self, "gate_up_clamp", float(c))

    def experts_per_rank(self, world_size: int) -> int:
        from moe_ep.errors import WorldSizeError

        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size <= 0:
            raise WorldSizeError("world_size", f"expected a positive int, got {world_size!r}")
        if self.num_experts % world_size:
            raise WorldSizeError("world_size", f"{world_size} does not divide num_experts={self.num_experts}")
        return self.num_experts // world_size


class LayerGeometry:
    """The geometry a layer and the objects serving it (backends, frontends) read, for any class that holds
    `spec` (MoESpec) and `ctx` (moe_ep.core.dist.RankContext): one value each, named as MoESpec names it, so no
    layer below renames or re-derives them."""

    __slots__ = ()

    @property
    def hidden_size(self) -> int:
        return self.spec.hidden_size

    @property
    def intermediate_size(self) -> int:
        return self.spec.intermediate_size

    @property
    def top_k(self) -> int:
        return self.spec.top_k

    @property
    def max_tokens_per_rank(self) -> int:
        return self.spec.max_tokens_per_rank

    @property
    def experts_per_rank(self) -> int:
        return self.spec.num_experts // self.ctx.world_size

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size
