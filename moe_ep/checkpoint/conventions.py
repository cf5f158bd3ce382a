"""The checkpoint conventions moe_ep reads: their tensor names, dtypes and layouts, how one is recognised from the
names alone, and which converter turns a layer's tensors into which format (docs/checkpoints.md has the table).

A layer's routed experts live under a stem `<prefix>layers.<L>.<mlp|block_sparse_moe>.experts`. Per-expert
conventions name `<stem>.<e>.<proj>.<suffix>` with proj gate_proj / up_proj / down_proj (Qwen3-MoE, DeepSeek-V3) or
w1 / w3 / w2 (Mixtral: w1 gate, w3 up, w2 down); fused conventions name `<stem>.<suffix>` with the experts stacked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from typing import Callable, Dict, Optional, Tuple

from moe_ep.checkpoint import convert_bf16, convert_fp4, convert_fp8
from moe_ep.checkpoint.convert_fp8 import block_grid
from moe_ep.errors import CheckpointError

__all__ = ["Role", "Convention", "CONVENTIONS", "PROJ_NAMES", "STEM", "get_convention", "detect", "scalar_ok"]

# <stem>.<rest>: the layer's routed experts (shared experts, `mlp.shared_experts.*`, do not match).
STEM = re.compile(r"^(?P<stem>(?:.*\.)?layers\.(?P<layer>\d+)\.(?:mlp|block_sparse_moe)\.experts)\.(?P<rest>.+)$")
# Per-expert projection names, in the two spellings seen: role -> (HF, Mixtral).
PROJ_NAMES = {"gate": ("gate_proj", "w1"), "up": ("up_proj", "w3"), "down": ("down_proj", "w2")}

Shape = Callable[[int, int, int], Tuple[int, ...]]  # (E, H, I) -> shape (per-expert roles ignore E)


@dataclass(frozen=True)
class Role:
    """One tensor a converter takes: `key` its argument, named by `proj` (per expert) and `suffix`."""

    key: str
    suffix: str
    dtypes: Tuple[str, ...]  # safetensors dtype names accepted
    shape: Shape
    proj: Optional[str] = None  # gate / up / down for per-expert conventions
    scalar: bool = False  # one value: shape () or (1,)
    layer_wide: bool = False  # needed for every expert of the layer on every rank (static activation scales)
    optional: bool = False


@dataclass(frozen=True)
class Convention:
    name: str
    title: str
    formats: Tuple[str, ...]  # what it converts to exactly (or as the report says), preferred first
    per_expert: bool
    roles: Tuple[Role, ...]
    marker: "re.Pattern[str]"  # matches a <rest> only this convention has
    dims: Callable[[Tuple[int, ...]], Tuple[int, int]]  # first role's shape -> (H, I)
    convert: Callable  # (fmt, tensors by key, out, expert_offset) -> (pack | (w13, w2), report, extras)
    quantized: bool = True  # False: bf16, handed to the layer as moe_ep.ExpertWeights
    served: bool = True  # False: the layer would compute something else (load_layer refuses it)
    caveat: str = ""

    def __repr__(self) -> str:
        return f"Convention({self.name!r}: {self.title})"

    def tensor_name(self, stem: str, role: Role, expert: Optional[int], proj_style: int) -> str:
        if not self.per_expert:
            return f"{stem}.{role.suffix}"
        return f"{stem}.{expert}.{PROJ_NAMES[role.proj][proj_style]}.{role.suffix}"


def _w(proj: str, suffix: str, dtype: str, shape: Shape, key: Optional[str] = None, **kw) -> Role:
    return Role(key or f"{proj}{'' if suffix == 'weight' else '_' + suffix}", suffix, (dtype,), shape, proj, **kw)


def _fp8_block_roles():
    out = []
    for proj in ("gate", "up", "down"):
        w = (lambda e, h, i: (h, i)) if proj == "down" else (lambda e, h, i: (i, h))
        s = (lambda e, h, i: block_grid(h, i)) if proj == "down" else (lambda e, h, i: block_grid(i, h))
        out += [_w(proj, "weight", "F8_E4M3", w), _w(proj, "weight_scale_inv", "F32", s, key=f"{proj}_scale_inv")]
    return tuple(out)


def _convert_deepseek(fmt, t, out, offset):
    fn = convert_fp8.deepseek_fp8_mxfp8 if fmt == "mxfp8" else convert_fp8.deepseek_fp8_block
    pack, report = fn(t["gate"], t["gate_scale_inv"], t["up"], t["up_scale_inv"], t["down"], t["down_scale_inv"],
                      out=out, expert_offset=offset)
    return pack, report, {}


def _modelopt_fp8_roles():
    out = []
    for proj in ("gate", "up", "down"):
        w = (lambda e, h, i: (h, i)) if proj == "down" else (lambda e, h, i: (i, h))
        out += [_w(proj, "weight", "F8_E4M3", w), _w(proj, "weight_scale", "F32", lambda e, h, i: (), scalar=True),
                _w(proj, "input_scale", "F32", lambda e, h, i: (), scalar=True, layer_wide=True)]
    return tuple(out)


def _convert_modelopt_fp8(fmt, t, out, offset):
    act = convert_fp8.layer_input_scale(t["gate_input_scale"], t["up_input_scale"])
    fc2 = convert_fp8.layer_input_scale(t["down_input_scale"])
    pack, report = convert_fp8.modelopt_fp8_tensor(
        t["gate"], t["gate_weight_scale"].reshape(-1), t["up"], t["up_weight_scale"].reshape(-1), t["down"],
        t["down_weight_scale"].reshape(-1), act, fc2, out=out, expert_offset=offset)
    report.note("static activation scales: the largest input_scale over the layer's experts (gate/up for FC1, "
                "down for FC2), one per layer")
    return pack, report, {}


def _nvfp4_roles():
    out = []
    for proj in ("gate", "up", "down"):
        w = (lambda e, h, i: (h, i // 2)) if proj == "down" else (lambda e, h, i: (i, h // 2))
        s = (lambda e, h, i: (h, i // 16)) if proj == "down" else (lambda e, h, i: (i, h // 16))
        out += [_w(proj, "weight", "U8", w), _w(proj, "weight_scale", "F8_E4M3", s),
                _w(proj, "weight_scale_2", "F32", lambda e, h, i: (), scalar=True),
                _w(proj, "input_scale", "F32", lambda e, h, i: (), scalar=True, layer_wide=proj != "down")]
    return tuple(out)


def _convert_nvfp4(fmt, t, out, offset):
    act = convert_fp8.layer_input_scale(t["gate_input_scale"], t["up_input_scale"])
    pack, report = convert_fp4.modelopt_nvfp4(
        t["gate"], t["gate_weight_scale"], t["gate_weight_scale_2"].reshape(-1), t["up"], t["up_weight_scale"],
        t["up_weight_scale_2"].reshape(-1), t["down"], t["down_weight_scale"], t["down_weight_scale_2"].reshape(-1),
        act, t["down_input_scale"].reshape(-1), fmt=fmt, out=out, expert_offset=offset)
    return pack, report, {}


def _bf16_roles():
    return tuple(_w(p, "weight", "BF16", (lambda e, h, i: (h, i)) if p == "down" else (lambda e, h, i: (i, h)))
                 for p in ("gate", "up", "down"))


def _convert_bf16(fmt, t, out, offset):
    from moe_ep.checkpoint.report import ExactnessReport

    w13, w2 = convert_bf16.per_expert_bf16(t["gate"], t["up"], t["down"], out=out)
    return (w13, w2), ExactnessReport("hf_bf16", "bf16", values=w13.numel() + w2.numel()), {}


def _convert_fused_bf16(fmt, t, out, offset):
    from moe_ep.checkpoint.report import ExactnessReport

    w13, w2 = convert_bf16.fused_bf16(t["gate_up"], t["down"], out=out)
    return (w13, w2), ExactnessReport("hf_fused_bf16", "bf16", values=w13.numel() + w2.numel()), {}


def _convert_gpt_oss(fmt, t, out, offset):
    pack, report, extras = convert_fp4.gpt_oss_mxfp4(
        t["gate_up_blocks"], t["gate_up_scales"], t["down_blocks"], t["down_scales"], t.get("gate_up_bias"),
        t.get("down_bias"), fmt=fmt, out=out, expert_offset=offset)
    return pack, report, {"gpt_oss": extras}


def _convert_gpt_oss_bf16(fmt, t, out, offset):
    from moe_ep.checkpoint.report import ExactnessReport

    convert_fp4.check_biases(t.get("gate_up_bias"), t.get("down_bias"))
    w13, w2 = convert_bf16.gpt_oss_bf16(t["gate_up"], t["down"], out=out)
    extras = convert_fp4.GptOssExtras(
        None if t.get("gate_up_bias") is None else torch.cat((t["gate_up_bias"][:, 0::2], t["gate_up_bias"][:, 1::2]),
                                                              dim=1).float(),
        None if t.get("down_bias") is None else t["down_bias"].float())
    return (w13, w2), ExactnessReport("gpt_oss_bf16", "bf16", values=w13.numel() + w2.numel()), {"gpt_oss": extras}


def _fused(key: str, suffix: str, dtypes: Tuple[str, ...], shape: Shape, **kw) -> Role:
    return Role(key, suffix, dtypes, shape, **kw)


def _per_expert_marker(suffix: str) -> "re.Pattern[str]":
    return re.compile(rf"^\d+\.(?:gate_proj|w1)\.{suffix}$")


CONVENTIONS: Dict[str, Convention] = {c.name: c for c in (
    Convention("deepseek_fp8", "DeepSeek-V3/R1, Kimi-K2, Qwen3-FP8: e4m3 + fp32 weight_scale_inv per 128x128 block",
               ("fp8_block", "mxfp8"), True, _fp8_block_roles(), _per_expert_marker("weight_scale_inv"),
               lambda s: (s[1], s[0]), _convert_deepseek,
               caveat="fp8_block shares one scale between 64 gate and 64 up rows: exact only where the checkpoint's "
                      "gate and up block scales agree; mxfp8 only with power-of-two scales"),
    Convention("modelopt_nvfp4", "NVIDIA ModelOpt NVFP4: packed e2m1 + e4m3 per 16 + fp32 weight_scale_2, input_scale",
               convert_fp4.NVFP4_FORMATS, True, _nvfp4_roles(), _per_expert_marker("weight_scale_2"),
               lambda s: (2 * s[1], s[0]), _convert_nvfp4,
               caveat="one FC1 global scale per expert: exact where gate and up weight_scale_2 agree"),
    Convention("modelopt_fp8", "ModelOpt / llm-compressor FP8 per tensor: e4m3 + fp32 weight_scale, input_scale",
               ("fp8_tensor",), True, _modelopt_fp8_roles(), _per_expert_marker("weight_scale"),
               lambda s: (s[1], s[0]), _convert_modelopt_fp8,
               caveat="one FC1 weight scale per expert: exact where gate and up weight_scale agree"),
    Convention("gpt_oss_mxfp4", "gpt-oss MXFP4: *_blocks (two e2m1 a byte) + *_scales (e8m0 per 32), gate/up "
                                "interleaved by row, biases", convert_fp4.GPT_OSS_FORMATS, False, (
                   _fused("gate_up_blocks", "gate_up_proj_blocks", ("U8",), lambda e, h, i: (e, 2 * i, h // 32, 16)),
                   _fused("gate_up_scales", "gate_up_proj_scales", ("U8",), lambda e, h, i: (e, 2 * i, h // 32)),
                   _fused("down_blocks", "down_proj_blocks", ("U8",), lambda e, h, i: (e, h, i // 32, 16)),
                   _fused("down_scales", "down_proj_scales", ("U8",), lambda e, h, i: (e, h, i // 32)),
                   _fused("gate_up_bias", "gate_up_proj_bias", ("BF16", "F32"), lambda e, h, i: (e, 2 * i),
                          optional=True),
                   _fused("down_bias", "down_proj_bias", ("BF16", "F32"), lambda e, h, i: (e, h), optional=True)),
               re.compile(r"^gate_up_proj_blocks$"), lambda s: (s[2] * 32, s[1] // 2), _convert_gpt_oss, served=False,
               caveat="expert biases and a clamped SwiGLU (alpha 1.702, limit 7, up + 1) moe_ep does not compute"),
    Convention("gpt_oss_bf16", "gpt-oss experts in bf16 as transformers writes them (save_pretrained of a dequantized "
                               "gpt-oss): gate_up_proj [E, H, 2I] transposed, gate/up interleaved by column, biases",
               ("bf16",), False, (
                   _fused("gate_up", "gate_up_proj", ("BF16",), lambda e, h, i: (e, h, 2 * i)),
                   _fused("gate_up_bias", "gate_up_proj_bias", ("BF16", "F32"), lambda e, h, i: (e, 2 * i)),
                   _fused("down", "down_proj", ("BF16",), lambda e, h, i: (e, i, h)),
                   _fused("down_bias", "down_proj_bias", ("BF16", "F32"), lambda e, h, i: (e, h))),
               re.compile(r"^gate_up_proj_bias$"), lambda s: (s[1], s[2] // 2), _convert_gpt_oss_bf16,
               quantized=False, served=False,
               caveat="expert biases and a clamped SwiGLU (alpha 1.702, limit 7, up + 1) moe_ep does not compute"),
    Convention("hf_fused_bf16", "transformers 5 fused bf16: mlp.experts.gate_up_proj [E, 2I, H] + down_proj [E, H, I]",
               ("bf16",), False, (
                   _fused("gate_up", "gate_up_proj", ("BF16",), lambda e, h, i: (e, 2 * i, h)),
                   _fused("down", "down_proj", ("BF16",), lambda e, h, i: (e, h, i))),
               re.compile(r"^gate_up_proj$"), lambda s: (s[2], s[1] // 2), _convert_fused_bf16, quantized=False),
    Convention("hf_bf16", "bf16 per expert: Mixtral w1/w3/w2, Qwen3-MoE / DeepSeek gate_proj/up_proj/down_proj",
               ("bf16",), True, _bf16_roles(), _per_expert_marker("weight"), lambda s: (s[1], s[0]), _convert_bf16,
               quantized=False),
)}


def get_convention(name: str) -> Convention:
    try:
        return CONVENTIONS[name]
    except (KeyError, TypeError):
        raise CheckpointError(None, f"unknown checkpoint convention {name!r}; moe_ep reads {sorted(CONVENTIONS)}") \
            from None


def detect(rests) -> Optional[Convention]:
    """The convention whose marker one of a layer's <rest> names matches (most specific first), or None."""
    rests = list(rests)
    for conv in CONVENTIONS.values():  # ordered: scale suffixes before the bare `weight`
        if any(conv.marker.match(r) for r in rests):
            return conv
    return None


def scalar_ok(shape: Tuple[int, ...]) -> bool:
    return tuple(shape) in ((), (1,))

