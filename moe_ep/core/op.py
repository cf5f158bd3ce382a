"""The MoE forward as a registered torch custom op, so that a model calling moe_ep traces under
`torch.compile(fullgraph=True)` with no graph break.

`MoELayer.forward` routes through the op only while torch.compile is tracing: the op is opaque to the
compiler (the layer's validation, its collectives and the kernel launch run inside it, at run time), its fake
implementation says what comes out (a new [T, H] tensor of the layer's output dtype, or `out` written in place). Eager calls go
straight to the layer: the dispatcher would add host time to every call of the hot path.

    moe_ep::forward(Tensor hidden, Tensor topk_idx, Tensor topk_weights, int layer, int? max_tokens=None) -> Tensor
    moe_ep::forward_out(Tensor hidden, Tensor topk_idx, Tensor topk_weights, Tensor(a!) out, int layer,
                        int? max_tokens=None) -> ()

`layer` is the layer's handle in this process (MoELayer.handle), a constant to the compiler; `max_tokens` is the
call's max_tokens_across_ranks (MoELayer.forward).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Dict, Optional

import torch

from moe_ep.errors import MoEError

__all__ = ["register_layer", "unregister_layer", "forward", "forward_out"]

_layers: Dict[int, "weakref.ReferenceType"] = {}
_handles = itertools.count(1)
_lock = threading.Lock()


def register_layer(layer) -> int:
    """A process-unique handle for `layer`; the op finds the layer by it (weakly: closing or dropping the
    layer is not kept from happening by the op)."""
    with _lock:
        handle = next(_handles)
        _layers[handle] = weakref.ref(layer)
    return handle


def unregister_layer(handle: int) -> None:
    with _lock:
        _layers.pop(handle, None)


def _layer(handle: int):
    ref = _layers.get(handle)
    layer = ref() if ref is not None else None
    if layer is None:
        raise MoEError("layer", f"moe_ep layer handle {handle} names no open layer in this process (closed, or the "
                                "compiled model outlived it)")
    return layer


@torch.library.custom_op("moe_ep::forward", mutates_args=())
def forward(hidden: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, layer: int,
            max_tokens: Optional[int] = None) -> torch.Tensor:
    return _layer(layer).forward_eager(hidden, topk_idx, topk_weights, None, max_tokens)


@forward.register_fake
def _forward_fake(hidden, topk_idx, topk_weights, layer, max_tokens=None):
    return hidden.new_empty(hidden.shape, dtype=_layer(layer).output_dtype(hidden.dtype))


@torch.library.custom_op("moe_ep::forward_out", mutates_args=("out",))
def forward_out(hidden: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor,
                layer: int, max_tokens: Optional[int] = None) -> None:
    _layer(layer).forward_eager(hidden, topk_idx, topk_weights, out, max_tokens)


@forward_out.register_fake
def _forward_out_fake(hidden, topk_idx, topk_weights, out, layer, max_tokens=None):
    return None
