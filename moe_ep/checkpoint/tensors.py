"""What the converters share: checks that name the checkpoint's tensor, and an empty pack to write into."""

from __future__ import annotations

import traceback
from typing import Optional, Sequence

import torch

from moe_ep.errors import CheckpointError
from moe_ep.formats import QuantizedWeights, pack_rules
from moe_ep.formats.packs import count_flagged

__all__ = ["expect", "expect_scales", "expect_codes", "expect_finite", "new_pack", "scrub"]


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


# Values checked at a time: the checks' temporaries stay a fraction of a MiB, inside the loader's memory bound (at
# 2^18 a DeepSeek-convention layer peaked 0.2 MiB under its pack-plus-one-expert bound on a quiet machine and over it
# under Bazel on a loaded one; at 2^16, 6 MiB under).
_CHUNK = 1 << 16


def _count(t: torch.Tensor, bad) -> tuple:
    """(how many elements of t `bad` flags, up to 4 of them), _CHUNK values at a time."""
    return count_flagged(t, bad, _CHUNK)[:2]


def expect_codes(t: torch.Tensor, name: str, file: Optional[str] = None) -> torch.Tensor:
    """e4m3 codes a checkpoint can mean: no NaN (bytes 0x7f / 0xff; e4m3fn has no infinity)."""
    n, _ = _count(t.view(torch.uint8), lambda b: (b & 0x7F) == 0x7F)
    if n:
        raise CheckpointError(name, f"holds {n} e4m3 NaN codes (0x7f / 0xff): a damaged weight", file)
    return t


def expect_finite(t: torch.Tensor, name: str, file: Optional[str] = None) -> torch.Tensor:
    """Weight values a checkpoint can mean: finite."""
    n, first = _count(t, lambda v: ~torch.isfinite(v))
    if n:
        raise CheckpointError(name, f"holds {n} NaN or infinite values (e.g. {first}): a damaged weight", file)
    return t


def scrub(err: BaseException) -> None:
    """Drop what an error raised while loading keeps alive: the locals of every frame of its traceback and of the
    errors it chains (a converter's frames hold the expert's tensors and the pack's slice), and a context it
    already suppresses (`raise ... from None`), which nobody reads but which would keep its own frames."""
    seen = set()
    e: Optional[BaseException] = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)
        nxt = e.__cause__ or e.__context__
        if e.__suppress_context__:
            e.__context__ = None
        e = nxt


def new_pack(fmt: str, e: int, h: int, i: int, device=None, expert_offset: int = 0) -> QuantizedWeights:
    """An uninitialised pack of `fmt` for e experts (moe_ep.formats.pack_rules' dtypes and shapes)."""
    kw = {name: torch.empty(rule[1], dtype=rule[0], device=device)
          for name, rule in pack_rules(fmt, e, h, i).items() if rule is not None}
    return QuantizedWeights(fmt, expert_offset=expert_offset, **kw)

