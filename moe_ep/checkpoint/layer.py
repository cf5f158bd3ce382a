"""load_layer: a checkpoint layer's routed experts into an MoELayer, on every rank of the group, each rank reading
only its own experts. Collective like MoELayer itself: a rank whose read fails makes every rank raise
(PeerValidationError on the others) before any layer is built, and nothing read stays in memory on any rank."""

from __future__ import annotations

import warnings
from typing import Optional

from moe_ep.checkpoint.conventions import Convention
from moe_ep.checkpoint.loader import Checkpoint, LayerPlan
from moe_ep.checkpoint.tensors import scrub
from moe_ep.core import registry
from moe_ep.core.dist import RankContext, run_agreed
from moe_ep.core.spec import MoESpec
from moe_ep.core.weights import ExpertWeights
from moe_ep.errors import CheckpointError, FormatError
from moe_ep.layer import MoELayer

__all__ = ["load_layer", "choose_format"]


def _probe(ckpt: Checkpoint, plan: LayerPlan):
    conv = plan.convention
    name = plan.name(conv.roles[0], 0 if conv.per_expert else None)
    return name, ckpt.files.where(name)


def choose_format(conv: Convention, backend: Optional[str], fmt: Optional[str], arch: str,
                  where: str = "") -> Optional[str]:
    """The format a `conv` checkpoint loads as for `backend` (a name, or None / "auto" for the arch's own): `fmt`
    if given and the convention converts to it, else the first of the convention's formats the backend serves.
    bf16 conventions go to the layer as bf16 experts, which it quantizes into any format: `fmt` as given."""
    if not conv.quantized:
        return fmt
    candidates = conv.formats if fmt is None else (fmt,)
    if fmt is not None and fmt not in conv.formats:
        raise FormatError("fmt", f"a {conv.name} checkpoint ({conv.title}) loads as {list(conv.formats)}, not "
                                 f"{fmt!r}{where}")
    if backend is None or backend == "auto":
        kernels = [info for info in registry.list_backends().values() if info.arch == arch and info.available]
        for f in candidates:
            if any(f in info.formats for info in kernels):
                return f
        return candidates[0]  # no kernel of this arch serves it: the layer's own choice (the reference, or an error)
    entry = registry.get_entry(backend)
    for f in candidates:
        if f in entry.formats:
            return f
    raise FormatError("fmt", f"backend {backend!r} serves {list(entry.formats)}; a {conv.name} checkpoint "
                             f"({conv.title}) loads as {list(candidates)} without requantization{where}")


def load_layer(checkpoint, layer: int, spec: MoESpec, backend: Optional[str] = None, *, fmt: Optional[str] = None,
               group=None, device=None, allow_inexact: bool = False, pack_device=None,
               act_amax: Optional[float] = None, fc2_act_amax: Optional[float] = None, **layer_options) -> MoELayer:
    """An MoELayer of checkpoint layer `layer` (a moe_ep.checkpoint.Checkpoint or a path), this rank's experts read
    from it; spec must match the checkpoint's hidden / intermediate size and expert count.

    backend / fmt / group / device / **layer_options: as MoELayer. A quantized checkpoint is handed to the layer as
    it is (moe_ep.QuantizedExpertWeights): fmt defaults to the first format of the convention the backend serves.
    allow_inexact: load a checkpoint that moe_ep's format cannot hold bit for bit (InexactCheckpointError
    otherwise; a RuntimeWarning says what changed). pack_device: where the pack is assembled before the backend lays
    it out (default CPU). act_amax / fc2_act_amax: calibration for a bf16 checkpoint in a statically scaled fmt."""
    if not isinstance(spec, MoESpec):
        raise CheckpointError("spec", f"expected moe_ep.MoESpec, got {type(spec).__name__}")
    ctx = RankContext.from_group(group, device)
    box = []

    def plan():
        ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)
        p = ckpt.plan(layer, spec.num_experts)
        conv = p.convention
        name, file = _probe(ckpt, p)
        if not conv.served:
            raise CheckpointError(name, f"{conv.name} experts compute what moe_ep's layer does not ({conv.caveat}); "
                                        f"Checkpoint.load_experts() returns their weights and these extras", file)
        got = (p.hidden_size, p.intermediate_size, p.num_experts)
        if got != (spec.hidden_size, spec.intermediate_size, spec.num_experts):
            raise CheckpointError(name, f"layer {layer} has hidden {got[0]}, intermediate {got[1]}, {got[2]} experts; "
                                        f"the spec says {spec.hidden_size}, {spec.intermediate_size}, "
                                        f"{spec.num_experts}", file)
        f = choose_format(conv, backend, fmt, registry.detect_arch(ctx.device), f" (e.g. {name} in {file})")
        box.append((ckpt, f, conv.quantized))

    run_agreed(ctx, plan, "checkpoint plan")
    ckpt, f, quantized = box.pop()
    try:
        run_agreed(ctx, lambda: box.append(ckpt.load_experts(
            layer, ctx.rank, ctx.world_size, fmt=f if quantized else None, device=pack_device,
            allow_inexact=allow_inexact, num_experts=spec.num_experts)), "checkpoint read")
        loaded = box.pop()
        weights = loaded.weights
        if isinstance(weights, ExpertWeights) and (act_amax is not None or fc2_act_amax is not None):
            weights = ExpertWeights(weights.w13, weights.w2, weights.rank, weights.world_size, weights.num_experts,
                                    act_amax=act_amax, fc2_act_amax=fc2_act_amax)
        if not loaded.report.exact:
            warnings.warn(f"layer {layer} of {ckpt.path}: {loaded.report.summary()}", RuntimeWarning, stacklevel=2)
        del loaded
        return MoELayer(spec, weights, backend, group=group, device=device,
                        fmt=f if isinstance(weights, ExpertWeights) else None, **layer_options)
    except BaseException as err:
        box.clear()
        weights = loaded = None  # noqa: F841 - dropped before the error leaves, with the frames below
        scrub(err)
        raise
