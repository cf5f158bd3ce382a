"""Streaming a layer's routed experts out of a safetensors checkpoint, this rank's only, one expert at a time.

Checkpoint(path) indexes the names (the index json, or the files' headers) and recognises the convention from
them; load_experts(layer, rank, world_size) checks every tensor it will read against the convention's dtypes and
shapes from the headers alone (nothing is read before the whole plan holds), allocates this rank's pack once, then
reads each expert's tensors, converts them into the pack's slice and drops them. Peak host memory while loading a
layer: the pack (this rank's experts in the target format) plus one expert's checkpoint tensors and the
converter's temporaries for it (at most about one expert in bf16; docs/checkpoints.md has the measurements).

A failed load leaves nothing behind: the pack is released and the frames of the error's traceback are cleared,
so a caller that keeps the exception does not keep a half-built layer alive.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

import torch

from moe_ep.checkpoint.conventions import STEM, Convention, Role, detect, get_convention, scalar_ok
from moe_ep.checkpoint.files import SafetensorsFiles
from moe_ep.checkpoint.report import ExactnessReport
from moe_ep.checkpoint.tensors import expect_scales, new_pack, scrub
from moe_ep.core.weights import ExpertWeights, QuantizedExpertWeights
from moe_ep.errors import CheckpointError, FormatError, InexactCheckpointError, WorldSizeError
from moe_ep.formats import format_violations

__all__ = ["Checkpoint", "LayerPlan", "LoadedExperts"]

# config.json keys that give a layer's routed expert count, across model families.
_EXPERT_COUNT_KEYS = ("n_routed_experts", "num_local_experts", "num_experts")
_SCALE_BLOCK_NOTE = " (one fp32 scale per 128x128 block, the only block size fp8_block and its kernel take)"


@dataclass(frozen=True)
class LayerPlan:
    """What one layer's routed experts are, from names and headers alone."""

    convention: Convention
    layer: int
    stem: str  # "<prefix>layers.<L>.mlp.experts"
    proj_style: int  # 0: gate_proj/up_proj/down_proj, 1: w1/w3/w2
    num_experts: int
    hidden_size: int
    intermediate_size: int

    def name(self, role: Role, expert: Optional[int] = None) -> str:
        return self.convention.tensor_name(self.stem, role, expert, self.proj_style)


@dataclass
class LoadedExperts:
    """weights: moe_ep.QuantizedExpertWeights (quantized conventions) or moe_ep.ExpertWeights (bf16 ones), this
    rank's experts of the layer; report: how they relate to the checkpoint's values (ExactnessReport); extras: what
    the checkpoint's experts compute that moe_ep's layer does not (gpt-oss: {"gpt_oss": GptOssExtras}), else {}."""

    weights: Any
    report: ExactnessReport
    extras: Dict[str, Any] = field(default_factory=dict)
    plan: Optional[LayerPlan] = None


class Checkpoint:
    """A safetensors checkpoint (directory with `model.safetensors.index.json` and shards, a directory of
    `.safetensors` files, or one file). convention: one of moe_ep.checkpoint.CONVENTIONS, or None to recognise it
    from the tensor names."""

    def __init__(self, path, convention: Optional[str] = None):
        self.files = SafetensorsFiles(path)
        self.path = str(self.files.path)
        self.forced = get_convention(convention) if convention is not None else None
        self._layers: Dict[int, Tuple[str, Set[str]]] = {}
        for name in self.files.names():
            m = STEM.match(name)
            if m:
                stem, rests = self._layers.setdefault(int(m["layer"]), (m["stem"], set()))
                rests.add(m["rest"])
        self.config = self._config()

    def _config(self) -> dict:
        p = self.files.path if self.files.path.is_dir() else self.files.path.parent
        try:
            return json.loads((p / "config.json").read_text())
        except (OSError, ValueError):
            return {}

    @property
    def layers(self) -> List[int]:
        """The layers that have routed experts."""
        return sorted(self._layers)

    @property
    def convention(self) -> Convention:
        """The convention of the first layer with experts (every layer of a checkpoint shares one)."""
        if not self._layers:
            raise CheckpointError(None, "no routed experts here (no `layers.<L>.mlp.experts.*` or "
                                        "`layers.<L>.block_sparse_moe.experts.*` tensor)", self.files.index_file
                                  or self.path)
        return self.plan(self.layers[0]).convention

    def _config_experts(self) -> Optional[int]:
        cfg = self.config.get("text_config", self.config)
        for key in _EXPERT_COUNT_KEYS:
            if isinstance(cfg.get(key), int):
                return cfg[key]
        return None

    # -- the plan: names and headers only ----------------------------------------------------------------------
    def plan(self, layer: int, num_experts: Optional[int] = None) -> LayerPlan:
        where = self.files.index_file or self.path
        if layer not in self._layers:
            raise CheckpointError(f"layers.{layer}", f"no routed experts in layer {layer}; layers with experts: "
                                                     f"{self.layers[:8]}{'...' if len(self.layers) > 8 else ''}", where)
        stem, rests = self._layers[layer]
        conv = self.forced or detect(rests)
        if conv is None:
            sample = sorted(rests)[:3]
            name = f"{stem}.{sample[0]}"
            raise CheckpointError(name, f"the names of layer {layer}'s experts (e.g. {sample}) follow no convention "
                                        f"moe_ep reads", self.files.where(name))
        style = 0
        if conv.per_expert:
            style = 1 if any(re.match(r"^\d+\.w1\.", r) for r in rests) else 0
            ids = {int(r.split(".", 1)[0]) for r in rests if r.split(".", 1)[0].isdigit()}
            found = max(ids) + 1 if ids else 0
        first = conv.roles[0]
        probe = conv.tensor_name(stem, first, 0, style)
        info = self.files.info(probe)
        h, i = conv.dims(info.shape) if len(info.shape) >= 2 else (0, 0)
        if not conv.per_expert:
            found = info.shape[0]
        e = num_experts or self._config_experts() or found
        if conv.per_expert and found > e:
            raise CheckpointError(conv.tensor_name(stem, first, found - 1, style),
                                  f"layer {layer} has experts up to {found - 1}, more than the {e} expected", where)
        plan = LayerPlan(conv, layer, stem, style, e, h, i)
        known = {plan.name(r, x)[len(stem) + 1:] for r in conv.roles
                 for x in ((None,) if not conv.per_expert else range(max(e, found)))}
        ignored = sorted(rests - known)
        if ignored:  # what the layer would not compute (an expert bias, an extra scale): refused, not dropped
            name = f"{stem}.{ignored[0]}"
            more = f" (and {len(ignored) - 1} more, e.g. {ignored[1:3]})" if len(ignored) > 1 else ""
            raise CheckpointError(name, f"an expert tensor the {conv.name} convention does not read and moe_ep's "
                                        f"layer does not compute{more}: refused rather than dropped",
                                  self.files.where(name))
        return plan

    def check(self, plan: LayerPlan, experts: range) -> None:
        """Every tensor the load of `experts` will read, checked from the headers: present, dtype, shape
        (CheckpointError naming the tensor and its file)."""
        conv, e, h, i = plan.convention, plan.num_experts, plan.hidden_size, plan.intermediate_size
        wide = range(e)
        for role in conv.roles:
            for x in ((None,) if not conv.per_expert else (wide if role.layer_wide else experts)):
                name = plan.name(role, x)
                if role.optional and name not in self.files.weight_map:
                    continue
                info = self.files.info(name)
                if info.dtype not in role.dtypes:
                    raise CheckpointError(name, f"expected dtype {' or '.join(role.dtypes)} ({conv.name}), got "
                                                f"{info.dtype}", info.file)
                expected = role.shape(e, h, i)
                if role.scalar:
                    if not scalar_ok(info.shape):
                        raise CheckpointError(name, f"expected one value (shape [] or [1]; {conv.name} keeps one "
                                                    f"scale per tensor), got shape {list(info.shape)}", info.file)
                elif info.shape != tuple(expected):
                    note = _SCALE_BLOCK_NOTE if role.suffix == "weight_scale_inv" else ""
                    raise CheckpointError(name, f"expected shape {list(expected)}{note} for hidden {h}, intermediate "
                                                f"{i}, got {list(info.shape)}", info.file)

    # -- the load ----------------------------------------------------------------------------------------------
    def load_experts(self, layer: int, rank: int = 0, world_size: int = 1, *, fmt: Optional[str] = None,
                     device=None, allow_inexact: bool = False, num_experts: Optional[int] = None) -> LoadedExperts:
        """This rank's routed experts of `layer`, converted to `fmt` (default: the convention's first format).

        device: where the pack is built (default CPU; the loader reads on the host and copies each expert there).
        allow_inexact: False raises InexactCheckpointError as soon as a value would change (see the convention's
        caveat and the report); True loads and reports. num_experts: the layer's expert count when neither the
        names nor config.json say it fully (a checkpoint missing its last expert)."""
        plan = self.plan(layer, num_experts)
        conv = plan.convention
        target = fmt or conv.formats[0]
        if target not in conv.formats:
            raise FormatError("fmt", f"{conv.name} ({conv.title}) loads as {list(conv.formats)}, not {target!r}; "
                                     f"e.g. {plan.name(conv.roles[0], 0 if conv.per_expert else None)} in "
                                     f"{self.path}")
        e = plan.num_experts
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size <= 0 or e % world_size:
            probe = plan.name(conv.roles[0], 0 if conv.per_expert else None)
            raise WorldSizeError("world_size", f"world size {world_size} does not divide the {e} experts of layer "
                                               f"{layer} (tensor {probe}, file {self.files.where(probe)})")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise WorldSizeError("rank", f"expected 0 <= rank < {world_size}, got {rank!r}")
        n = e // world_size
        mine = range(rank * n, (rank + 1) * n)
        self.check(plan, mine)
        probe = plan.name(conv.roles[0], mine.start if conv.per_expert else None)
        for _, msg in format_violations(target, plan.hidden_size, plan.intermediate_size):
            raise CheckpointError(probe, f"{msg}: layer {layer} cannot be held in it", self.files.where(probe))
        device = torch.device("cpu") if device is None else torch.device(device)
        try:
            return self._load(plan, target, rank, world_size, mine, device, allow_inexact)
        except BaseException as err:
            scrub(err)  # the frames below (and a suppressed context's) held the half-built pack and the expert
            raise

    def _wide_scales(self, plan: LayerPlan) -> Dict[str, torch.Tensor]:
        """Layer-wide roles (static activation scales): the largest over all the layer's experts, per key."""
        out = {}
        for role in plan.convention.roles:
            if role.layer_wide:
                names = [plan.name(role, x) for x in range(plan.num_experts)]
                vals = self.files.read(names)
                for n in names:  # each checked where it is stored: the largest alone would hide or blur the damage
                    expect_scales(vals[n], n, self.files.where(n))
                out[role.key] = torch.stack([vals[n].reshape(()).to(torch.float32) for n in names]).max().reshape(1)
                del vals
        return out

    def _load(self, plan, fmt, rank, world_size, mine, device, allow_inexact) -> LoadedExperts:
        conv, n, h, i = plan.convention, len(mine), plan.hidden_size, plan.intermediate_size
        wide = self._wide_scales(plan)
        if conv.quantized:
            pack = new_pack(fmt, n, h, i, device, expert_offset=mine.start)
        else:
            pack = (torch.empty((n, 2 * i, h), dtype=torch.bfloat16, device=device),
                    torch.empty((n, h, i), dtype=torch.bfloat16, device=device))
        report = ExactnessReport(conv.name, fmt)
        extras: List[Dict[str, Any]] = []
        roles = [r for r in conv.roles if not r.layer_wide]
        for x, expert in enumerate(mine):
            names = {r.key: plan.name(r, expert if conv.per_expert else None) for r in roles}
            names = {k: v for k, v in names.items() if v in self.files.weight_map}  # optional roles may be absent
            raw = self.files.read(list(names.values()), rows=None if conv.per_expert else slice(expert, expert + 1))
            # On the pack's device: a GPU pack is converted on the GPU, the host holds one expert's mapped pages.
            t = {k: (raw[v].unsqueeze(0) if conv.per_expert else raw[v]).to(device) for k, v in names.items()}
            t.update({k: v.to(device) for k, v in wide.items()})
            out = pack.experts(slice(x, x + 1)) if conv.quantized else (pack[0][x:x + 1], pack[1][x:x + 1])
            try:
                _, rep, extra = conv.convert(fmt, t, out, expert)
            except CheckpointError as err:
                raise self._qualified(err, plan, expert) from None
            del raw, t, out
            report.merge(rep)
            extras.append(extra)
            if not allow_inexact and not rep.exact:
                first = names[roles[0].key]
                raise InexactCheckpointError(first, f"expert {expert} of layer {plan.layer} cannot be held in {fmt} "
                                                    f"as stored: {rep.summary()} ({conv.caveat}); pass "
                                                    f"allow_inexact=True to load it with this report",
                                             self.files.where(first), report=report)
        merged = _merge_extras(extras, self.config)
        if conv.quantized:
            weights = QuantizedExpertWeights(pack, rank, world_size, plan.num_experts, report=report)
        else:
            weights = ExpertWeights(pack[0], pack[1], rank, world_size, plan.num_experts)
        return LoadedExperts(weights, report, merged, plan)


    def _qualified(self, err: CheckpointError, plan: LayerPlan, expert: int) -> CheckpointError:
        """A converter's error (it names a role, e.g. "up_proj.weight_scale_inv") with the tensor's full name in
        the checkpoint and its file."""
        name = err.tensor
        if err.file is None and name:
            for role in plan.convention.roles:
                tail = f"{role.proj}_proj.{role.suffix}" if plan.convention.per_expert else role.suffix
                if tail == name:
                    name = plan.name(role, expert if plan.convention.per_expert else None)
                    break
        file = err.file or (self.files.where(name) if name in self.files.weight_map else self.path)
        new = InexactCheckpointError(name, err.detail, file, err.report) if isinstance(
            err, InexactCheckpointError) else CheckpointError(name, err.detail, file)
        return new


def _merge_extras(extras: List[Dict[str, Any]], config: dict) -> Dict[str, Any]:
    """Per-expert extras -> one per layer (gpt-oss: biases stacked over this rank's experts, the config's limit)."""
    if not extras or not extras[0]:
        return {}
    from moe_ep.checkpoint.convert_fp4 import GptOssExtras

    parts = [x["gpt_oss"] for x in extras]

    def cat(field_name):
        ts = [getattr(p, field_name) for p in parts]
        return None if any(t is None for t in ts) else torch.cat(ts)

    cfg = config.get("text_config", config)
    limit = float(cfg.get("swiglu_limit", GptOssExtras.limit))
    alpha = float(cfg.get("swiglu_alpha", GptOssExtras.alpha))
    return {"gpt_oss": GptOssExtras(cat("gate_up_bias"), cat("down_bias"), alpha=alpha, limit=limit)}
