"""What the converters share: checks that name the checkpoint's tensor, and an empty pack to write into."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from moe_ep.errors import CheckpointError
from moe_ep.formats import QuantizedWeights, pack_rules

__all__ = ["expect", "expect_scales", "new_pack"]


def expect(t, name: str, dtype: torch.dtype, shape: Sequence[int], file: Optional[str] = None) -> torch.Tensor:
    """t as the checkpoint must hold it: a tensor of `dtype` and `shape` (CheckpointError naming it otherwise)."""
    if not isinstance(t, torch.Tensor):
        raise CheckpointError(name, f"expected a {dtype} tensor {list(shape)}, got {type(t).__name__}", file)
    if t.dtype != dtype:
        raise CheckpointError(name, f"expected dtype {dtype}, got {t.dtype}", file)
    if tuple(t.shape) != tuple(shape):
        raise CheckpointError(name, f"expected shape {list(shape)}, got {list(t.shape)}", file)
    return t


def expect_scales(t: torch.Tensor, name: str, file: Optional[str] = None, positive: bool = False) -> torch.Tensor:
    """Scale values a checkpoint can mean: finite and >= 0 (> 0 where the scale divides)."""
    v = t.to(torch.float32)
    bad = ~torch.isfinite(v) | ((v <= 0) if positive else (v < 0))
    if bool(bad.any()):
        first = v[bad].flatten()[:4].tolist()
        raise CheckpointError(name, f"expected finite {'positive' if positive else 'non-negative'} scales, got "
                                    f"{int(bad.sum())} others (e.g. {first})", file)
    return t


def new_pack(fmt: str, e: int, h: int, i: int, device=None, expert_offset: int = 0) -> QuantizedWeights:
    """An uninitialised pack of `fmt` for e experts (moe_ep.formats.pack_rules' dtypes and shapes)."""
    kw = {name: torch.empty(rule[1], dtype=rule[0], device=device)
          for name, rule in pack_rules(fmt, e, h, i).items() if rule is not None}
    return QuantizedWeights(fmt, expert_offset=expert_offset, **kw)

