"""The canonical bf16 expert weights one rank owns (ExpertWeights). The quantized weights a backend computes
with are moe_ep.formats.QuantizedWeights.

Canonical layout (every backend derives its kernel layout from this, once, at load):
  w13 [E_local, 2I, H] bf16, rows [0, I) gate and [I, 2I) up;  w2 [E_local, H, I] bf16.
Experts are owned in contiguous blocks: rank r holds global experts [r*E_local, (r+1)*E_local).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from moe_ep.core.errors import CalibrationError, DTypeError, ShapeError, WeightsRankError, WorldSizeError

__all__ = ["ExpertWeights", "owner_rank"]


def owner_rank(expert: int, num_experts: int, world_size: int) -> int:
    return expert // (num_experts // world_size)


def _check_amax(name: str, value) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise CalibrationError(name, f"expected None or a finite positive float, got {value!r}")
    return float(value)


@dataclass
class ExpertWeights:
    """The bf16 expert weights one rank owns.

    act_amax / fc2_act_amax: optional activation calibration (the largest |value| expected in the FC1 input
    and in the weighted SwiGLU output that feeds FC2), the same on every rank. Statically scaled formats
    (fp8_tensor, nvfp4) derive their activation scales from them; the other formats ignore them.
    """

    w13: torch.Tensor
    w2: torch.Tensor
    rank: int
    world_size: int
    num_experts: int
    act_amax: Optional[float] = None
    fc2_act_amax: Optional[float] = None

    def __post_init__(self):
        for name in ("w13", "w2"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise DTypeError(f"weights.{name}", f"expected a torch.Tensor, got {type(t).__name__}")
            if t.dtype != torch.bfloat16:
                raise DTypeError(f"weights.{name}", f"expected dtype torch.bfloat16, got {t.dtype}")
            if t.dim() != 3:
                raise ShapeError(f"weights.{name}", f"expected a 3-D tensor, got shape {tuple(t.shape)}")
        for name in ("rank", "world_size", "num_experts"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise WeightsRankError(f"weights.{name}", f"expected an int, got {v!r}")
        if self.world_size <= 0:
            raise WorldSizeError("weights.world_size", f"expected a positive int, got {self.world_size}")
        if self.num_experts <= 0 or self.num_experts % self.world_size:
            raise WorldSizeError("weights.world_size",
                                 f"world size {self.world_size} does not divide num_experts={self.num_experts}")
        if not 0 <= self.rank < self.world_size:
            raise WeightsRankError("weights.rank", f"expected 0 <= rank < {self.world_size}, got {self.rank}")
        e_local = self.num_experts // self.world_size
        e1, n2, h = self.w13.shape
        e2, h2, i = self.w2.shape
        if e1 != e_local or n2 % 2:
            raise ShapeError("weights.w13", f"expected [{e_local}, 2*I, H] (E_local = num_experts / world_size), "
                                            f"got {tuple(self.w13.shape)}")
        if (e2, h2, i) != (e_local, h, n2 // 2):
            raise ShapeError("weights.w2", f"expected [{e_local}, {h}, {n2 // 2}] to match w13 "
                                           f"{tuple(self.w13.shape)}, got {tuple(self.w2.shape)}")
        self.act_amax = _check_amax("weights.act_amax", self.act_amax)
        self.fc2_act_amax = _check_amax("weights.fc2_act_amax", self.fc2_act_amax)

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.world_size

    @property
    def expert_offset(self) -> int:
        return self.rank * self.experts_per_rank

    @property
    def hidden_size(self) -> int:
        return self.w13.shape[2]

    @property
    def intermediate_size(self) -> int:
        return self.w2.shape[2]

    @classmethod
    def from_global(cls, w13_all: torch.Tensor, w2_all: torch.Tensor, rank: int, world_size: int,
                    **calibration) -> "ExpertWeights":
        """Copy this rank's contiguous expert block out of the full [E, ...] tensors: a copy, not a view, so the
        full tensors can be freed (a view would keep every rank's experts alive on every rank)."""
        e = w13_all.shape[0]
        if world_size <= 0 or e % world_size:
            raise WorldSizeError("world_size", f"{world_size} does not divide num_experts={e}")
        n = e // world_size
        sl = slice(rank * n, (rank + 1) * n)
        return cls(w13_all[sl].clone(memory_format=torch.contiguous_format),
                   w2_all[sl].clone(memory_format=torch.contiguous_format), rank, world_size, e, **calibration)
