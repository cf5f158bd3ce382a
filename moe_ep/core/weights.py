"""Weight packs: the canonical bf16 expert weights (ExpertWeights) and the quantized weights a backend
actually computes with (QuantizedWeights, the multi-rank oracle's input).

Canonical layout (every backend derives its kernel layout from this, once, at load):
  w13 [E_local, 2I, H] bf16, rows [0, I) gate and [I, 2I) up;  w2 [E_local, H, I] bf16.
Experts are owned in contiguous blocks: rank r holds global experts [r*E_local, (r+1)*E_local).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Optional, Tuple

import torch

from moe_ep.core.errors import CalibrationError, DTypeError, ShapeError, WeightsRankError, WorldSizeError
from moe_ep.core.formats import check_format

__all__ = ["ExpertWeights", "QuantizedWeights", "owner_rank"]


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
        """Slice this rank's contiguous expert block out of the full [E, ...] tensors."""
        e = w13_all.shape[0]
        if world_size <= 0 or e % world_size:
            raise WorldSizeError("world_size", f"{world_size} does not divide num_experts={e}")
        n = e // world_size
        sl = slice(rank * n, (rank + 1) * n)
        return cls(w13_all[sl].contiguous(), w2_all[sl].contiguous(), rank, world_size, e, **calibration)


@dataclass
class QuantizedWeights:
    """The quantized weights a backend computes with, in the canonical (unswizzled) layout.

    Per format (E = number of experts held, H hidden, I intermediate):
      bf16       w13_q [E,2I,H] bf16, w2_q [E,H,I] bf16; no scales.
      fp8_block  w13_q/w2_q e4m3; w13_scale [E, 2I/128, H/128] fp32 where scale row n covers gate rows
                 [64n, 64n+64) AND up rows [64n, 64n+64) (the kernel blocks the 8-row gate/up interleave);
                 w2_scale [E, H/128, I/128] fp32.  dequant = q * scale.
      fp8_tensor w13_q/w2_q e4m3; w13_scale/w2_scale [E] fp32; act_scale (1,) and fc2_act_scale (1,) fp32 are
                 the static FC1-input and FC2-input dequant scales.
      mxfp8      w13_q/w2_q e4m3; w13_scale [E,2I,H/32], w2_scale [E,H,I/32] float8_e8m0fnu.
      nvfp4      w13_q/w2_q uint8 e2m1 codes, one per byte (bit 3 sign, bits 0-2 magnitude index);
                 w13_scale [E,2I,H/16], w2_scale [E,H,I/16] float8_e4m3fn; w13_global_scale/w2_global_scale
                 [E] fp32; act_scale (1,) is the FC1-input global scale; fc2_act_scale [E] the FC2-input
                 global scale per expert.  dequant = q * scale / global_scale.
    expert_offset: global id of expert 0 of this pack.
    """

    fmt: str
    w13_q: torch.Tensor
    w2_q: torch.Tensor
    w13_scale: Optional[torch.Tensor] = None
    w2_scale: Optional[torch.Tensor] = None
    w13_global_scale: Optional[torch.Tensor] = None
    w2_global_scale: Optional[torch.Tensor] = None
    act_scale: Optional[torch.Tensor] = None
    fc2_act_scale: Optional[torch.Tensor] = None
    expert_offset: int = 0

    # Fields indexed by expert (dim 0); act_scale is global.
    _PER_EXPERT = ("w13_q", "w2_q", "w13_scale", "w2_scale", "w13_global_scale", "w2_global_scale")

    def __post_init__(self):
        check_format(self.fmt, "QuantizedWeights.fmt")

    @property
    def num_experts(self) -> int:
        return self.w13_q.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w13_q.shape[2]

    @property
    def intermediate_size(self) -> int:
        return self.w2_q.shape[2]

    def tensor_fields(self) -> Tuple[str, ...]:
        return tuple(f.name for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor))

    def per_expert_fields(self) -> Tuple[str, ...]:
        names = [n for n in self._PER_EXPERT if getattr(self, n) is not None]
        if self.fmt == "nvfp4" and self.fc2_act_scale is not None:
            names.append("fc2_act_scale")
        return tuple(names)

    def to(self, device) -> "QuantizedWeights":
        kw = {n: getattr(self, n).to(device) for n in self.tensor_fields()}
        return replace(self, **kw)

    def experts(self, sl: slice) -> "QuantizedWeights":
        kw = {n: getattr(self, n)[sl] for n in self.per_expert_fields()}
        start = sl.start or 0
        return replace(self, expert_offset=self.expert_offset + start, **kw)

    def dequantize(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) in fp32, canonical layout."""
        from moe_ep.reference import quant  # pure torch; kept out of core's import graph

        return quant.dequantize_weights(self)
