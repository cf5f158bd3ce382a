"""MoEModule: an MoELayer as a torch.nn.Module, so a model holding it saves, loads and prints it like any module.

    block.experts = moe_ep.MoEModule(spec, weights)          # MoELayer's arguments
    with torch.inference_mode():
        out = block.experts(hidden, topk_idx, topk_weights)  # MoELayer's forward
    sd = model.state_dict()                                  # ...experts.w13_q, ...experts.w13_scale, ...
    model.load_state_dict(sd)                                # collective: every rank loads its own experts

state_dict holds the rank's experts as the backend computes with them: the canonical QuantizedWeights fields of
the layer's format (codes and scales: w13_q, w2_q, w13_scale, ..., docs/api.md), plus expert_offset. They are
not nn buffers or parameters: a kernel backend keeps them in the kernel's layout, and a canonical copy held
beside it would double the weight memory, so state_dict reads them back on demand and load_state_dict lays them
out again (collectively: it builds the layer anew, with the same arguments, from the loaded pack, never
requantizing). So `parameters()` (an optimizer, `num_parameters()`) does not see them: an MoEModule does not
train. moe_ep computes no gradients; a forward that would need one (grad mode on and an input that requires
grad) raises IntegrationError instead of returning an output cut off from autograd, after taking part in the
call with no tokens so that no peer waits for it. Run it under torch.inference_mode() / torch.no_grad(), or
with inputs that do not require grad.

The layer lives on one device in one format for its whole life (its workspace is collective and symmetric).
A dtype conversion of the module (.half(), .float(), .to(torch.bfloat16), a parent's .to(dtype)) leaves its
weights in their format: the layer reads bf16, fp16 and fp32 hidden states and returns its out_dtype ("hidden":
the input's). A move to another device, or to a dtype the layer cannot take (float64), raises DeviceError /
DTypeError; guard_conversions(root) makes a model check every MoEModule under it before any of its parameters
change, so such a conversion leaves the whole model as it was. copy.deepcopy and pickling raise
IntegrationError: a copy would need a new collective construction on every rank.
"""

from __future__ import annotations

import types
from typing import Optional

import torch

from moe_ep.core.spec import MoESpec
from moe_ep.core.weights import ExpertWeights
from moe_ep.errors import (CheckpointError, DeviceError, DTypeError, IntegrationError, ShapeError,
                           WeightsRankError)
from moe_ep.formats import QuantizedWeights
from moe_ep.layer import MoELayer

__all__ = ["MoEModule", "guard_conversions"]

_OFFSET = "expert_offset"
_HIDDEN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what MoELayer.forward takes


class MoEModule(torch.nn.Module):
    """An expert-parallel MoE layer (moe_ep.MoELayer) as an nn.Module. Construction, forward, load_state_dict
    and close are collective: every rank of the group calls them in the same order."""

    def __init__(self, spec: MoESpec, weights, backend: Optional[str] = None, **layer_options):
        super().__init__()
        self._layer = MoELayer(spec, weights, backend, **layer_options)
        self._name = layer_options.get("name") or self._layer.name  # as the caller named it (errors say so)
        self._options = dict(layer_options, backend=self._layer.backend_name, fmt=self._layer.fmt,
                             group=self._layer.ctx.group, device=self._layer.ctx.device)

    @property
    def layer(self) -> MoELayer:
        return self._layer

    @property
    def spec(self) -> MoESpec:
        return self._layer.spec

    def forward(self, hidden: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                out: Optional[torch.Tensor] = None, *, max_tokens_across_ranks: Optional[int] = None) -> torch.Tensor:
        if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                           for t in (hidden, topk_weights)):
            self._refuse_gradient(hidden, topk_idx, topk_weights, max_tokens_across_ranks)
        return self._layer(hidden, topk_idx, topk_weights, out, max_tokens_across_ranks=max_tokens_across_ranks)

    def _refuse_gradient(self, hidden, topk_idx, topk_weights, max_tokens_across_ranks):
        """The layer would refuse it too (GradientError); the module's refusal names the module (under an
        integration, the model's path to it). Compiled models raise alike: this runs as traced code."""
        self._layer._take_part_empty(hidden, topk_idx, topk_weights, max_tokens_across_ranks)
        which = "hidden" if hidden.requires_grad else "topk_weights"
        raise IntegrationError(self._name or "hidden", f"a forward that needs a gradient ({which} requires "
                                                             f"grad under grad mode): moe_ep computes no gradients "
                                                             f"(it serves inference); run under "
                                                             f"torch.inference_mode() or torch.no_grad()")

    # -- state_dict -------------------------------------------------------------------------------------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        qw = self._layer.oracle_weights()
        for name in qw.tensor_fields():
            destination[prefix + name] = getattr(qw, name).detach()
        destination[prefix + _OFFSET] = torch.tensor(qw.expert_offset, dtype=torch.int64)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        mine = self._layer.oracle_weights()
        wanted = list(mine.tensor_fields()) + [_OFFSET]
        ours = {k[len(prefix):] for k in state_dict if k.startswith(prefix) and "." not in k[len(prefix):]}
        unexpected_keys.extend(prefix + k for k in sorted(ours - set(wanted)))
        missing = [prefix + k for k in wanted if k not in ours]
        if missing:
            missing_keys.extend(missing)
            return  # a partial pack is never loaded (strict=True then raises; strict=False keeps the weights)
        offset = int(state_dict[prefix + _OFFSET])
        if offset != mine.expert_offset:
            raise WeightsRankError(prefix + _OFFSET, f"this state holds experts from {offset}; rank "
                                                     f"{self._layer.ctx.rank} owns experts from {mine.expert_offset}")
        tensors = {}
        for name in mine.tensor_fields():
            got, want = state_dict[prefix + name], getattr(mine, name)
            if not isinstance(got, torch.Tensor) or got.dtype != want.dtype:
                raise DTypeError(prefix + name, f"expected a {want.dtype} tensor (fmt {mine.fmt!r}), got "
                                                f"{getattr(got, 'dtype', type(got).__name__)}")
            if tuple(got.shape) != tuple(want.shape):
                raise ShapeError(prefix + name, f"expected {list(want.shape)} (fmt {mine.fmt!r}), got "
                                                f"{list(got.shape)}")
            _check_values(prefix + name, got)
            tensors[name] = got.detach().to(want.device).clone()
        self._reload(QuantizedWeights(mine.fmt, expert_offset=offset, **tensors))

    def _reload(self, qw: QuantizedWeights) -> None:
        """Collective: a new layer, with this one's arguments, from the pack (its bytes as they are)."""
        old = self._layer
        ctx, spec = old.ctx, old.spec
        weights = ExpertWeights.from_quantized(qw, ctx.rank, ctx.world_size, spec.num_experts)
        old.close()
        self._layer = MoELayer(spec, weights, **self._options)

    # -- one device, one format ---------------------------------------------------------------------------------
    def check_conversion(self, fn) -> None:
        """Raise DeviceError / DTypeError if `fn` (what nn.Module._apply applies to each tensor) would move this
        layer to another device or a dtype it cannot take; changes nothing."""
        dev = self._layer.ctx.device
        for dtype in (torch.bfloat16, torch.float32):
            probe = torch.empty(0, dtype=dtype, device=dev)
            try:
                moved = fn(probe)
            except Exception as e:  # noqa: BLE001 - a move this host cannot even make is still a move
                raise DeviceError("device", f"an moe_ep layer stays on {dev} in fmt {self._layer.fmt!r}; this "
                                            f"conversion fails here ({type(e).__name__}: {e})") from e
            if not isinstance(moved, torch.Tensor):
                continue
            if moved.device != dev:
                raise DeviceError("device", f"an moe_ep layer stays on {dev} (its workspace is collective): build "
                                            f"a new MoEModule on {moved.device} instead of moving this one")
            if moved.dtype not in _HIDDEN_DTYPES:
                raise DTypeError("dtype", f"an moe_ep layer takes and returns {sorted(map(str, _HIDDEN_DTYPES))} "
                                          f"hidden states, not {moved.dtype}; its weights stay in fmt "
                                          f"{self._layer.fmt!r}")

    def _apply(self, fn, recurse=True):
        self.check_conversion(fn)  # its weights are in its format: a dtype conversion leaves them as they are
        return super()._apply(fn, recurse)

    # A copy would be a second layer over the same workspace share, built on one rank only.
    def __deepcopy__(self, memo):
        raise IntegrationError(self._name or "MoEModule", "an moe_ep layer cannot be copied (its workspace "
                                                                "is collective): build a new one on every rank")

    def __reduce_ex__(self, protocol):
        raise IntegrationError(self._name or "MoEModule", "an moe_ep layer cannot be pickled (it holds a "
                                                                "process group and a collective workspace); save "
                                                                "its state_dict() instead")

    def extra_repr(self) -> str:
        lay = self._layer
        return (f"backend={lay.backend_name!r}, fmt={lay.fmt!r}, rank={lay.ctx.rank}/{lay.ctx.world_size}, "
                f"spec={lay.spec}")

    def close(self) -> None:
        self._layer.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _check_values(name: str, t: torch.Tensor) -> None:
    """What a pack's tensor can mean: weights without NaN (codes or values), scales finite and >= 0 (a zero scale is
    a block of zeros); CheckpointError naming the state-dict key otherwise, before the layer changes. (The same
    rules as moe_ep.checkpoint's loader, written here: //moe_ep cannot depend on //moe_ep/checkpoint, which builds
    on it.)"""
    weight = name.rpartition(".")[2] in ("w13_q", "w2_q")
    if t.dtype == torch.float8_e4m3fn:
        n = int(((t.view(torch.uint8) & 0x7F) == 0x7F).sum())
        if n:
            raise CheckpointError(name, f"holds {n} e4m3 NaN codes (0x7f / 0xff)")
    elif t.dtype == getattr(torch, "float8_e8m0fnu", None):
        if bool((t.view(torch.uint8) == 255).any()):
            raise CheckpointError(name, "holds the e8m0 NaN code 255")
        return  # e8m0 holds no sign and no infinity
    elif t.dtype == torch.uint8:
        if weight and bool((t > 15).any()):  # e2m1 codes one a byte (docs/api.md's packs)
            raise CheckpointError(name, f"holds {int((t > 15).sum())} bytes above 15: not e2m1 codes (one a byte)")
        return
    if not t.is_floating_point():
        return
    v = t.float()
    bad = ~torch.isfinite(v) if weight else ~torch.isfinite(v) | (v < 0)
    if bool(bad.any()):
        what = "NaN or infinite values" if weight else "scales that are not finite and >= 0"
        raise CheckpointError(name, f"holds {int(bad.sum())} {what} (e.g. {v[bad].flatten()[:4].tolist()})")


def _guarded_apply(self, fn, recurse=True):
    for m in self.modules():
        if isinstance(m, MoEModule):
            m.check_conversion(fn)
    return type(self)._apply(self, fn, recurse)


def guard_conversions(root: torch.nn.Module) -> None:
    """Make a conversion of `root` or of any module above one of its MoEModules (.to(), .half(), .cuda(), ...)
    check every MoEModule below it before any parameter changes: one a layer refuses then leaves the model as it
    was, instead of converted up to that layer. (nn.Module._apply converts children in order: without this, the
    modules before the first layer would already be converted when it refuses.)"""
    names = [n for n, m in root.named_modules() if isinstance(m, MoEModule)]
    modules = dict(root.named_modules())
    above = set()
    for n in names:
        parts = n.split(".")
        above.update(".".join(parts[:k]) for k in range(len(parts)))
    for n in above:
        m = modules[n]
        if not isinstance(m, MoEModule):
            m._apply = types.MethodType(_guarded_apply, m)
