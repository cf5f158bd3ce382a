"""The expert weights one rank owns: bf16 (ExpertWeights: the layer quantizes them into its format) or already
quantized (QuantizedExpertWeights: a moe_ep.formats.QuantizedWeights pack the backend lays out as it is, never
requantized; what moe_ep.checkpoint builds from a quantized checkpoint).

Canonical layout (every backend derives its kernel layout from this, once, at load):
  w13 [E_local, 2I, H] bf16, rows [0, I) gate and [I, 2I) up;  w2 [E_local, H, I] bf16.
Experts are owned in contiguous blocks: rank r holds global experts [r*E_local, (r+1)*E_local).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from moe_ep.errors import (CalibrationError, DeviceError, DTypeError, FormatError, ShapeError, WeightsRankError,
                           WorldSizeError)
from moe_ep.formats import QuantizedWeights, check_pack
from moe_ep.formats.packs import META_WEIGHTS

__all__ = ["ExpertWeights", "QuantizedExpertWeights", "owner_rank"]


def owner_rank(expert: int, num_experts: int, world_size: int) -> int:
    return expert // (num_experts // world_size)


def _check_ownership(prefix: str, rank, world_size, num_experts) -> int:
    """E_local, after checking rank / world size / expert count are ints that fit together."""
    for name, v in (("rank", rank), ("world_size", world_size), ("num_experts", num_experts)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise WeightsRankError(f"{prefix}.{name}", f"expected an int, got {v!r}")
    if world_size <= 0:
        raise WorldSizeError(f"{prefix}.world_size", f"expected a positive int, got {world_size}")
    if num_experts <= 0 or num_experts % world_size:
        raise WorldSizeError(f"{prefix}.world_size",
                             f"world size {world_size} does not divide num_experts={num_experts}")
    if not 0 <= rank < world_size:
        raise WeightsRankError(f"{prefix}.rank", f"expected 0 <= rank < {world_size}, got {rank}")
    return num_experts // world_size


def _check_amax(name: str, value) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise CalibrationError(name, f"expected None or a finite positive float, got {value!r}")
    return float(value)


class _RankBlock:
    """The contiguous block of experts a rank owns (rank, world_size, num_experts checked by _check_ownership)."""

    rank: int
    world_size: int
    num_experts: int

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.world_size

    @property
    def expert_offset(self) -> int:
        return self.rank * self.experts_per_rank


@dataclass
class ExpertWeights(_RankBlock):
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
            if t.is_meta:
                raise DeviceError(f"weights.{name}", META_WEIGHTS)
        e_local = _check_ownership("weights", self.rank, self.world_size, self.num_experts)
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

    @staticmethod
    def from_quantized(qw: QuantizedWeights, rank: int, world_size: int, num_experts: int,
                       report=None) -> "QuantizedExpertWeights":
        """Already-quantized experts for a layer: qw holds this rank's E_local experts, or all num_experts (this
        rank's block is taken). The backend lays out qw's bytes as they are (no requantization); the layer runs
        in qw.fmt. See QuantizedExpertWeights."""
        return QuantizedExpertWeights.of(qw, rank, world_size, num_experts, report=report)


@dataclass
class QuantizedExpertWeights(_RankBlock):
    """The already-quantized expert weights one rank owns: qw (moe_ep.QuantizedWeights, canonical layout, this
    rank's E_local experts, expert_offset = rank * E_local) is laid out for the kernel as it is. The layer runs
    in qw.fmt; asking it for another fmt is a FormatError (moe_ep never requantizes a given pack), and so is a
    backend that does not serve qw.fmt. Statically scaled formats carry their activation scales in qw.

    report: how these bytes relate to the checkpoint they came from (moe_ep.checkpoint.ExactnessReport), or None.
    Build with ExpertWeights.from_quantized (or QuantizedExpertWeights.of).
    """

    qw: QuantizedWeights
    rank: int
    world_size: int
    num_experts: int
    report: Any = None

    def __post_init__(self):
        e_local = _check_ownership("weights", self.rank, self.world_size, self.num_experts)
        check_pack(self.qw)
        if self.qw.num_experts != e_local:
            raise ShapeError("weights.qw", f"expected this rank's {e_local} experts (num_experts / world_size), "
                                           f"got a pack of {self.qw.num_experts}")
        if self.qw.expert_offset != self.rank * e_local:
            raise WeightsRankError("weights.qw.expert_offset",
                                   f"rank {self.rank} owns experts from {self.rank * e_local}; the pack starts at "
                                   f"{self.qw.expert_offset}")

    @classmethod
    def of(cls, qw: QuantizedWeights, rank: int, world_size: int, num_experts: int,
           report=None) -> "QuantizedExpertWeights":
        """qw holding this rank's E_local experts (its expert_offset is set to this rank's first expert), or all
        num_experts (this rank's contiguous block is taken, as views)."""
        e_local = _check_ownership("weights", rank, world_size, num_experts)
        if not isinstance(qw, QuantizedWeights):
            raise DTypeError("weights.qw", f"expected moe_ep.QuantizedWeights, got {type(qw).__name__}")
        if world_size > 1 and qw.num_experts == num_experts:
            qw = replace(qw, expert_offset=0).experts(slice(rank * e_local, (rank + 1) * e_local))
        elif qw.num_experts == e_local:
            qw = replace(qw, expert_offset=rank * e_local)
        return cls(qw, rank, world_size, num_experts, report)

    @property
    def fmt(self) -> str:
        return self.qw.fmt

    def check_for(self, spec, rank: int, world_size: int, fmt: str) -> None:
        """The layer's checks: built for this rank, world size and spec, and asked for the pack's own format."""
        if fmt != self.qw.fmt:
            raise FormatError("fmt", f"the weights are already quantized as {self.qw.fmt!r}; a layer in {fmt!r} "
                                     f"would have to requantize them, which moe_ep never does (leave fmt unset or "
                                     f"pass fmt={self.qw.fmt!r})")
        if self.num_experts != spec.num_experts:
            raise WeightsRankError("weights", f"built for num_experts={self.num_experts}, spec has {spec.num_experts}")
        if self.world_size != world_size:
            raise WeightsRankError("weights", f"built for world_size={self.world_size}, the group has {world_size} "
                                              f"ranks")
        if self.rank != rank:
            raise WeightsRankError("weights", f"built for rank {self.rank} (experts {self.expert_offset}.."
                                              f"{self.expert_offset + self.experts_per_rank - 1}), this is rank {rank}")
        if (self.hidden_size, self.intermediate_size) != (spec.hidden_size, spec.intermediate_size):
            raise ShapeError("weights.qw", f"holds experts of hidden {self.hidden_size}, intermediate "
                                           f"{self.intermediate_size}; the spec has {spec.hidden_size}, "
                                           f"{spec.intermediate_size}")

    @property
    def hidden_size(self) -> int:
        return self.qw.hidden_size

    @property
    def intermediate_size(self) -> int:
        return self.qw.intermediate_size
