"""MoEModule: an MoELayer as a torch.nn.Module, so a model holding it saves, loads and prints it like any module.

    block.experts = moe_ep.MoEModule(spec, weights)          # MoELayer's arguments
    out = block.experts(hidden, topk_idx, topk_weights)      # MoELayer's forward
    sd = model.state_dict()                                  # ...experts.w13_q, ...experts.w13_scale, ...
    model.load_state_dict(sd)                                # collective: every rank loads its own experts

state_dict holds the rank's experts as the backend computes with them: the canonical QuantizedWeights fields of
the layer's format (codes and scales: w13_q, w2_q, w13_scale, ..., docs/api.md), plus expert_offset. They are
not nn buffers: a kernel backend keeps them in the kernel's layout, and a canonical copy held beside it would
double the weight memory, so state_dict reads them back on demand and load_state_dict lays them out again
(collectively: it builds the layer anew, with the same arguments, from the loaded pack, never requantizing).

The layer lives on one device in one format for its whole life (its workspace is collective and symmetric):
.to() / .cuda() / .half() / .float() to another device or dtype raise DeviceError / DTypeError instead of
being ignored. Build a new module on the other device instead.
"""

from __future__ import annotations

from typing import Optional

import torch

from moe_ep.core.spec import MoESpec
from moe_ep.core.weights import ExpertWeights
from moe_ep.errors import DeviceError, DTypeError, ShapeError, WeightsRankError
from moe_ep.formats import QuantizedWeights
from moe_ep.layer import MoELayer

__all__ = ["MoEModule"]

_OFFSET = "expert_offset"


class MoEModule(torch.nn.Module):
    """An expert-parallel MoE layer (moe_ep.MoELayer) as an nn.Module. Construction, forward, load_state_dict
    and close are collective: every rank of the group calls them in the same order."""

    def __init__(self, spec: MoESpec, weights, backend: Optional[str] = None, **layer_options):
        super().__init__()
        self._layer = MoELayer(spec, weights, backend, **layer_options)
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
        return self._layer(hidden, topk_idx, topk_weights, out, max_tokens_across_ranks=max_tokens_across_ranks)

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
    def _apply(self, fn, recurse=True):
        dev = self._layer.ctx.device
        for dtype in (torch.bfloat16, torch.float32):
            probe = torch.empty(0, dtype=dtype, device=dev)
            try:
                moved = fn(probe)
            except Exception as e:  # noqa: BLE001 - a move this host cannot even make is still a move
                raise DeviceError("device", f"an moe_ep layer stays on {dev} in fmt {self._layer.fmt!r}; this "
                                            f"conversion fails here ({type(e).__name__}: {e})") from e
            if isinstance(moved, torch.Tensor) and moved.device != dev:
                raise DeviceError("device", f"an moe_ep layer stays on {dev} (its workspace is collective): build "
                                            f"a new MoEModule on {moved.device} instead of moving this one")
            if isinstance(moved, torch.Tensor) and moved.dtype != dtype:
                raise DTypeError("dtype", f"an moe_ep layer keeps its weights in fmt {self._layer.fmt!r}: build a "
                                          f"new MoEModule with another fmt instead of converting this one to "
                                          f"{moved.dtype}")
        return super()._apply(fn, recurse)

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
