"""Local (one-rank) checks. They raise typed errors naming the argument. The layer runs them on every call and
either agrees with the other ranks on the outcome (dist.agree, on the calls its check schedule names) or, when
they fail on this rank alone, takes part in the call with zero tokens before it raises, so a bad rank never
strands the others (moe_ep/layer.py; docs/api.md, "Checks")."""

from __future__ import annotations

import os
from typing import Optional

import torch

from moe_ep.core.dist import RankContext
from moe_ep.core.spec import MoESpec
from moe_ep.core.weights import ExpertWeights, QuantizedExpertWeights
from moe_ep.errors import (CapacityError, CheckConfigError, DeviceError, DTypeError, NonContiguousError,
                           ExpertIndexError, ShapeError, SpecError, TopKMismatchError, WeightsRankError, WorldSizeError)
from moe_ep.formats import format_info
from moe_ep.formats.packs import check_finite_to_quantize

__all__ = ["validate_weights", "validate_spec_for_backend", "validate_forward", "check_expert_ids", "CHECKS_ENV",
           "checks_mode", "check_schedule"]

_IDX_DTYPES = (torch.int64, torch.int32)
_BF16, _F32 = torch.bfloat16, torch.float32


def _tensor(name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise DTypeError(name, f"expected a torch.Tensor, got {type(t).__name__}")
    return t


def _same_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise DeviceError(name, f"expected a tensor on {device} (the layer's device), got {t.device}")


def validate_weights(spec: MoESpec, weights: ExpertWeights, ctx: RankContext, fmt: str) -> None:
    if not isinstance(weights, (ExpertWeights, QuantizedExpertWeights)):
        raise DTypeError("weights", f"expected moe_ep.ExpertWeights or moe_ep.QuantizedExpertWeights, got "
                                    f"{type(weights).__name__}")
    if spec.num_experts % ctx.world_size:
        raise WorldSizeError("world_size", f"the group's world size {ctx.world_size} does not divide "
                                           f"num_experts={spec.num_experts}")
    if isinstance(weights, QuantizedExpertWeights):
        return weights.check_for(spec, ctx.rank, ctx.world_size, fmt)
    if weights.num_experts != spec.num_experts:
        raise WeightsRankError("weights", f"built for num_experts={weights.num_experts}, spec has {spec.num_experts}")
    if weights.world_size != ctx.world_size:
        raise WeightsRankError("weights", f"built for world_size={weights.world_size}, the group has "
                                          f"{ctx.world_size} ranks")
    if weights.rank != ctx.rank:
        raise WeightsRankError("weights", f"built for rank {weights.rank} (experts "
                                          f"{weights.expert_offset}..{weights.expert_offset + weights.experts_per_rank - 1})"
                                          f", this is rank {ctx.rank}")
    e_local = spec.num_experts // ctx.world_size
    h, i = spec.hidden_size, spec.intermediate_size
    if tuple(weights.w13.shape) != (e_local, 2 * i, h):
        raise ShapeError("weights.w13", f"expected [{e_local}, {2 * i}, {h}] ([E_local, 2*I, H]), "
                                        f"got {list(weights.w13.shape)}")
    if tuple(weights.w2.shape) != (e_local, h, i):
        raise ShapeError("weights.w2", f"expected [{e_local}, {h}, {i}] ([E_local, H, I]), got {list(weights.w2.shape)}")
    check_finite_to_quantize(fmt, "weights", w13=weights.w13, w2=weights.w2)
    if format_info(fmt).static_activation_scales:
        from moe_ep.errors import CalibrationError

        for name in ("act_amax", "fc2_act_amax"):
            if getattr(weights, name) is None:
                raise CalibrationError(f"weights.{name}", f"fmt {fmt!r} uses static activation scales; "
                                                          f"pass ExpertWeights({name}=...) from calibration")


def validate_spec_for_backend(spec: MoESpec, backend_cls, fmt: str, world_size: int) -> None:
    problems = backend_cls.check_spec(spec, fmt, world_size)
    if problems:
        arg, msg = problems[0]
        raise SpecError(arg, f"{msg} (backend {backend_cls.name!r})")


# What forward() takes without loss (docs/api.md, "Input contract"): hidden in any of these (converted to bf16
# once, where the backend stages it), routing weights in any float dtype wider than 8 bits, ids int64 or int32,
# out (and so the output) in any of the hidden dtypes.
_HIDDEN_DTYPES = (_BF16, torch.float16, _F32)
_WEIGHT_DTYPES = (_F32, _BF16, torch.float16, torch.float64)
_OUT_DTYPES = _HIDDEN_DTYPES


def _names(dtypes) -> str:
    return " / ".join(str(d) for d in dtypes)


def validate_forward(spec: MoESpec, ctx: RankContext, hidden, topk_idx, topk_weights, out=None,
                     check_values: bool = True, max_tokens: Optional[int] = None) -> int:
    """Returns T. Checks type, device, dtype, shape, contiguity, top_k, T <= max_tokens (default: the layer's
    capacity; the layer passes more when it splits the call into chunks), then, with check_values, the expert-id
    range: ids in [0, num_experts), or -1 for "no expert" (padding, a masked slot; it contributes nothing).

    Every forward runs this on the host before the kernel, so well-formed inputs take one short-circuit
    expression (~1 us on a CPU where the step-by-step checks take ~3); anything it does not accept goes through
    the step-by-step checks, which name the argument and what was expected."""
    dev = ctx.device
    limit = spec.max_tokens_per_rank if max_tokens is None else max_tokens
    try:
        hs = hidden.shape
        t = hs[0]
        ok = (len(hs) == 2 and hs[1] == spec.hidden_size and t <= limit
              and hidden.dtype in _HIDDEN_DTYPES and topk_weights.dtype in _WEIGHT_DTYPES
              and topk_idx.dtype in _IDX_DTYPES
              and topk_idx.shape == (t, spec.top_k) and topk_weights.shape == (t, spec.top_k)
              and hidden.device == dev and topk_idx.device == dev and topk_weights.device == dev
              and hidden.is_contiguous() and topk_idx.is_contiguous() and topk_weights.is_contiguous()
              and (out is None or (out.shape == hs and out.dtype in _OUT_DTYPES and out.device == dev
                                   and out.is_contiguous()))
              and isinstance(hidden, torch.Tensor) and isinstance(topk_idx, torch.Tensor)
              and isinstance(topk_weights, torch.Tensor) and (out is None or isinstance(out, torch.Tensor)))
    except (AttributeError, IndexError, TypeError, ValueError):
        ok = False
    if not ok:
        return validate_forward_stepwise(spec, ctx, hidden, topk_idx, topk_weights, out, check_values, max_tokens)
    if check_values and t > 0:
        check_expert_ids(spec, topk_idx)
    return t


def validate_forward_stepwise(spec: MoESpec, ctx: RankContext, hidden, topk_idx, topk_weights, out=None,
                              check_values: bool = True, max_tokens: Optional[int] = None) -> int:
    """validate_forward one check at a time: the first that fails raises, naming the argument."""
    hidden = _tensor("hidden", hidden)
    topk_idx = _tensor("topk_idx", topk_idx)
    topk_weights = _tensor("topk_weights", topk_weights)
    for name, t in (("hidden", hidden), ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        _same_device(name, t, ctx.device)
    if hidden.dtype not in _HIDDEN_DTYPES:
        raise DTypeError("hidden", f"expected dtype {_names(_HIDDEN_DTYPES)}, got {hidden.dtype}")
    if topk_idx.dtype not in _IDX_DTYPES:
        raise DTypeError("topk_idx", f"expected dtype torch.int64 or torch.int32, got {topk_idx.dtype}")
    if topk_weights.dtype not in _WEIGHT_DTYPES:
        raise DTypeError("topk_weights", f"expected dtype {_names(_WEIGHT_DTYPES)}, got {topk_weights.dtype}")
    if hidden.dim() != 2 or hidden.shape[1] != spec.hidden_size:
        raise ShapeError("hidden", f"expected [T, {spec.hidden_size}], got {list(hidden.shape)}")
    t = hidden.shape[0]
    if topk_idx.dim() != 2 or topk_idx.shape[0] != t:
        raise ShapeError("topk_idx", f"expected [{t}, {spec.top_k}] ([T, top_k], T from hidden), "
                                     f"got {list(topk_idx.shape)}")
    if topk_idx.shape[1] != spec.top_k:
        raise TopKMismatchError("topk_idx", f"expected top_k={spec.top_k} columns, got {topk_idx.shape[1]}")
    if tuple(topk_weights.shape) != tuple(topk_idx.shape):
        raise TopKMismatchError("topk_weights", f"expected the shape of topk_idx {list(topk_idx.shape)}, "
                                                f"got {list(topk_weights.shape)}")
    for name, x in (("hidden", hidden), ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        if not x.is_contiguous():
            raise NonContiguousError(name, f"expected a contiguous tensor, got strides {list(x.stride())}")
    if max_tokens is None and t > spec.max_tokens_per_rank:
        raise CapacityError("hidden", f"{t} tokens exceed max_tokens_per_rank={spec.max_tokens_per_rank} "
                                      f"(the capacity fixed when the layer was built; MoELayer(chunking=\"agree\") "
                                      f"or forward(max_tokens_across_ranks=...) split larger calls into chunks)")
    if max_tokens is not None and t > max_tokens:
        raise CapacityError("hidden", f"{t} tokens exceed max_tokens_across_ranks={max_tokens} (the most tokens "
                                      f"any rank passes to this call, which every rank must pass alike)")
    if out is not None:
        out = _tensor("out", out)
        _same_device("out", out, ctx.device)
        if out.dtype not in _OUT_DTYPES:
            raise DTypeError("out", f"expected dtype {_names(_OUT_DTYPES)}, got {out.dtype}")
        if tuple(out.shape) != (t, spec.hidden_size):
            raise ShapeError("out", f"expected [{t}, {spec.hidden_size}], got {list(out.shape)}")
        if not out.is_contiguous():
            raise NonContiguousError("out", f"expected a contiguous tensor, got strides {list(out.stride())}")
    if check_values and t > 0:
        check_expert_ids(spec, topk_idx)
    return t


def check_expert_ids(spec: MoESpec, topk_idx: torch.Tensor) -> None:
    """Expert ids in [-1, num_experts): one min/max reduction, a device sync on a GPU."""
    lo, hi = torch.aminmax(topk_idx)
    lo, hi = int(lo), int(hi)
    if lo < -1:
        raise ExpertIndexError("topk_idx", f"expert ids must be >= -1 (-1: no expert for that slot), got {lo}")
    if hi >= spec.num_experts:
        raise ExpertIndexError("topk_idx", f"expert ids must be < num_experts={spec.num_experts}, got {hi}")


# -- when the costly checks run (docs/api.md, "Checks") ---------------------------------------------------------
CHECKS_ENV = "MOE_EP_CHECKS"
_CHECK_MODES = ("default", "all", "off")


def checks_mode() -> str:
    """$MOE_EP_CHECKS: "default" (unset), "all" (every check on every call, whatever the constructor said: the
    debug switch) or "off" (cheap checks only, where the constructor left the choice to the default)."""
    raw = os.environ.get(CHECKS_ENV, "").strip().lower() or "default"
    if raw not in _CHECK_MODES:
        raise CheckConfigError(CHECKS_ENV, f"{CHECKS_ENV}={os.environ[CHECKS_ENV]!r}: expected one of "
                                           f"{list(_CHECK_MODES)} (unset means 'default')")
    return raw


def check_schedule(requested: Optional[bool], argument: str, mode: str) -> Optional[bool]:
    """One check's schedule: True every call, False never, None the default schedule (value checks on the first
    call of each (T, id dtype) on a GPU and on every call on a CPU; the cross-rank agreement on a layer's first
    call). $MOE_EP_CHECKS=all turns every check on for every call; =off turns the defaults off."""
    if requested is not None and not isinstance(requested, bool):
        raise CheckConfigError(argument, f"expected None (the default schedule), True (every call) or False "
                                         f"(never), got {requested!r}")
    if mode == "all":
        return True
    if requested is None and mode == "off":
        return False
    return requested
