"""What a format's data looks like as a kernel reads it, and the one quantizer both sides use.

QuantizedWeights: the quantized expert weights a backend computes with, canonical layout (the multi-rank
oracle's input). QuantizedActivation: the FC1 input as staged. quantize_weights / quantize_input are the
definition of each format's bytes: the shim's weight packers and activation staging call them, so the kernel
computes with exactly the bytes the oracle checks against.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional, Tuple

import torch

from moe_ep.errors import CalibrationError
from moe_ep.formats.codecs import (FP8_ACT_BLOCK_K, FP8_WEIGHT_BLOCK, fp8_dequantize_blocks_nk, fp8_dequantize_rows,
                                   fp8_quantize_blocks_nk, fp8_quantize_per_expert, fp8_quantize_rows,
                                   fp8_quantize_static, fp8_quantize_w13_blocks, fp8_tensor_scale_from_amax,
                                   mxfp4_dequantize, mxfp4_quantize, mxfp8_dequantize, mxfp8_quantize,
                                   nvfp4_dequantize, nvfp4_global_scale, nvfp4_quantize, w13_block_rows)
from moe_ep.formats.table import check_format, format_info

__all__ = ["QuantizedWeights", "QuantizedActivation", "quantize_weights", "dequantize_weights", "quantize_input",
           "dequantize_input", "W4A8_FORMATS"]

# Formats whose weights are 4-bit and whose activations are e4m3 with one scale per token (SM90 mixed input).
W4A8_FORMATS = ("w4a8_mxfp4", "w4a8_nvfp4")


@dataclass
class QuantizedWeights:
    """The quantized weights a backend computes with, in the canonical (unswizzled) layout.

    Per format (E = number of experts held, H hidden, I intermediate):
      bf16       w13_q [E,2I,H] bf16, w2_q [E,H,I] bf16; no scales.
      fp8_block  w13_q/w2_q e4m3; w13_scale [E, 2I/128, H/128] fp32 where scale row n covers gate rows
                 [64n, 64n+64) AND up rows [64n, 64n+64) (the kernel blocks the 8-row gate/up interleave);
                 w2_scale [E, H/128, I/128] fp32.  dequant = q * scale.
      fp8_tensor w13_q/w2_q e4m3; w13_scale/w2_scale [E] fp32; act_scale (1,) and fc2_act_scale (1,) fp32 are
                 the static FC1-input and FC2-input dequant scales.
      mxfp8      w13_q/w2_q e4m3; w13_scale [E,2I,H/32], w2_scale [E,H,I/32] float8_e8m0fnu.
      nvfp4      w13_q/w2_q uint8 e2m1 codes, one per byte (bit 3 sign, bits 0-2 magnitude index);
                 w13_scale [E,2I,H/16], w2_scale [E,H,I/16] float8_e4m3fn; w13_global_scale/w2_global_scale
                 [E] fp32; act_scale (1,) is the FC1-input global scale; fc2_act_scale [E] the FC2-input
                 global scale per expert.  dequant = q * scale / global_scale.
      w4a8_mxfp4 w13_q/w2_q uint8 e2m1 codes, one per byte (as nvfp4); w13_scale [E,2I,H/32], w2_scale
                 [E,H,I/32] float8_e8m0fnu, each expert's codes within MXFP4_MAX_SCALE_RANGE (11) of its largest
                 (quantize_weights keeps to it; codecs.mxfp4_limit_scale_range brings any pack into it).
                 dequant = e2m1(q) * 2^(code-127).  No activation scales (dynamic, per token).
      w4a8_nvfp4 the nvfp4 weight fields (codes, e4m3 scales per 16, w13/w2_global_scale [E]); no activation
                 scales (dynamic, per token).  dequant = q * scale / global_scale.
    expert_offset: global id of expert 0 of this pack.
    """

    fmt: str
    w13_q: torch.Tensor
    w2_q: torch.Tensor
    w13_scale: Optional[torch.Tensor] = None
    w2_scale: Optional[torch.Tensor] = None
    w13_global_scale: Optional[torch.Tensor] = None
    w2_global_scale: Optional[torch.Tensor] = None
    act_scale: Optional[torch.Tensor] = None
    fc2_act_scale: Optional[torch.Tensor] = None
    expert_offset: int = 0

    # Fields indexed by expert (dim 0); act_scale is global.
    _PER_EXPERT = ("w13_q", "w2_q", "w13_scale", "w2_scale", "w13_global_scale", "w2_global_scale")

    def __post_init__(self):
        check_format(self.fmt, "QuantizedWeights.fmt")

    @property
    def num_experts(self) -> int:
        return self.w13_q.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w13_q.shape[2]

    @property
    def intermediate_size(self) -> int:
        return self.w2_q.shape[2]

    def tensor_fields(self) -> Tuple[str, ...]:
        return tuple(f.name for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor))

    def per_expert_fields(self) -> Tuple[str, ...]:
        names = [n for n in self._PER_EXPERT if getattr(self, n) is not None]
        if self.fmt == "nvfp4" and self.fc2_act_scale is not None:
            names.append("fc2_act_scale")
        return tuple(names)

    def to(self, device) -> "QuantizedWeights":
        kw = {n: getattr(self, n).to(device) for n in self.tensor_fields()}
        return replace(self, **kw)

    def experts(self, sl: slice) -> "QuantizedWeights":
        kw = {n: getattr(self, n)[sl] for n in self.per_expert_fields()}
        start = sl.start or 0
        return replace(self, expert_offset=self.expert_offset + start, **kw)

    def dequantize(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) in fp32, canonical layout."""
        return dequantize_weights(self)


# ------------------------------------------------------------------------------------------------ facades
@dataclass
class QuantizedActivation:
    """Activations as a kernel reads them: q [T, H] (bf16 | e4m3 | e2m1 codes) and per-row block scales
    (fp8_block fp32 [T, H/128], mxfp8 e8m0 [T, H/32], nvfp4 e4m3 [T, H/16], w4a8_* fp32 [T, 1]; None for bf16 /
    fp8_tensor, whose static scale lives in QuantizedWeights.act_scale)."""

    fmt: str
    q: torch.Tensor
    scale: Optional[torch.Tensor] = None

    def rows(self, index: torch.Tensor) -> "QuantizedActivation":
        return QuantizedActivation(self.fmt, self.q[index], None if self.scale is None else self.scale[index])


def quantize_weights(fmt: str, w13: torch.Tensor, w2: torch.Tensor, *, act_amax: Optional[float] = None,
                     fc2_act_amax: Optional[float] = None, expert_offset: int = 0) -> QuantizedWeights:
    """Canonical bf16 [E,2I,H] / [E,H,I] -> the format's QuantizedWeights (see its docstring for layouts)."""
    check_format(fmt)
    info = format_info(fmt)
    if info.static_activation_scales and (act_amax is None or fc2_act_amax is None):
        raise CalibrationError("act_amax" if act_amax is None else "fc2_act_amax",
                               f"fmt {fmt!r} uses static activation scales: pass the calibrated amax")
    dev = w13.device
    if fmt == "bf16":
        return QuantizedWeights(fmt, w13.to(torch.bfloat16), w2.to(torch.bfloat16), expert_offset=expert_offset)
    if fmt == "fp8_block":
        q13, s13 = fp8_quantize_w13_blocks(w13)
        q2, s2 = fp8_quantize_blocks_nk(w2)
        return QuantizedWeights(fmt, q13, q2, s13, s2, expert_offset=expert_offset)
    if fmt == "fp8_tensor":
        q13, s13 = fp8_quantize_per_expert(w13)
        q2, s2 = fp8_quantize_per_expert(w2)
        return QuantizedWeights(fmt, q13, q2, s13, s2, act_scale=fp8_tensor_scale_from_amax(act_amax, dev),
                                fc2_act_scale=fp8_tensor_scale_from_amax(fc2_act_amax, dev),
                                expert_offset=expert_offset)
    if fmt == "mxfp8":
        q13, s13 = mxfp8_quantize(w13)
        q2, s2 = mxfp8_quantize(w2)
        return QuantizedWeights(fmt, q13, q2, s13, s2, expert_offset=expert_offset)
    if fmt == "w4a8_mxfp4":
        q13, s13 = mxfp4_quantize(w13)
        q2, s2 = mxfp4_quantize(w2)
        return QuantizedWeights(fmt, q13, q2, s13, s2, expert_offset=expert_offset)
    e = w13.shape[0]
    (q13, s13, g13), (q2, s2, g2) = _nvfp4_weight(w13), _nvfp4_weight(w2)
    if fmt == "w4a8_nvfp4":
        return QuantizedWeights(fmt, q13, q2, s13, s2, g13, g2, expert_offset=expert_offset)
    # nvfp4
    g_in = nvfp4_global_scale(torch.tensor(float(act_amax))).reshape(1).to(dev)
    g_fc2 = nvfp4_global_scale(torch.full((e,), float(fc2_act_amax))).to(dev)
    return QuantizedWeights(fmt, q13, q2, s13, s2, g13, g2, act_scale=g_in, fc2_act_scale=g_fc2,
                            expert_offset=expert_offset)


def _nvfp4_weight(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[E, N, K] -> (e2m1 codes, e4m3 scales per 16, global scale [E] = 448 * 6 / amax of each expert): the NVFP4
    weight codec nvfp4 and w4a8_nvfp4 share."""
    e = w.shape[0]
    g = nvfp4_global_scale(w.to(torch.float32).abs().reshape(e, -1).amax(dim=1))
    q, sf = nvfp4_quantize(w, g.reshape(e, 1, 1))
    return q, sf, g


def dequantize_weights(qw: QuantizedWeights) -> Tuple[torch.Tensor, torch.Tensor]:
    f = qw.fmt
    if f == "bf16":
        return qw.w13_q.to(torch.float32), qw.w2_q.to(torch.float32)
    if f == "fp8_block":
        i = qw.intermediate_size
        rows = w13_block_rows(i, device=qw.w13_q.device)
        s13 = qw.w13_scale.to(torch.float32)[:, rows].repeat_interleave(FP8_WEIGHT_BLOCK, dim=-1)
        return qw.w13_q.to(torch.float32) * s13, fp8_dequantize_blocks_nk(qw.w2_q, qw.w2_scale)
    if f == "fp8_tensor":
        return (qw.w13_q.to(torch.float32) * qw.w13_scale.reshape(-1, 1, 1),
                qw.w2_q.to(torch.float32) * qw.w2_scale.reshape(-1, 1, 1))
    if f == "mxfp8":
        return mxfp8_dequantize(qw.w13_q, qw.w13_scale), mxfp8_dequantize(qw.w2_q, qw.w2_scale)
    if f == "w4a8_mxfp4":
        return mxfp4_dequantize(qw.w13_q, qw.w13_scale), mxfp4_dequantize(qw.w2_q, qw.w2_scale)
    return (nvfp4_dequantize(qw.w13_q, qw.w13_scale, qw.w13_global_scale.reshape(-1, 1, 1)),
            nvfp4_dequantize(qw.w2_q, qw.w2_scale, qw.w2_global_scale.reshape(-1, 1, 1)))


def quantize_input(qw: QuantizedWeights, hidden: torch.Tensor) -> QuantizedActivation:
    """The FC1 input a kernel stages from bf16 hidden [T, H]."""
    f = qw.fmt
    if f == "bf16":
        return QuantizedActivation(f, hidden)
    if f == "fp8_block":
        q, s = fp8_quantize_rows(hidden, FP8_ACT_BLOCK_K, reciprocal=False)
        return QuantizedActivation(f, q, s)
    if f == "fp8_tensor":
        return QuantizedActivation(f, fp8_quantize_static(hidden, qw.act_scale))
    if f == "mxfp8":
        q, s = mxfp8_quantize(hidden)
        return QuantizedActivation(f, q, s)
    if f in W4A8_FORMATS:
        # One block spanning the row: the kernels' per-token FC1 input scale (staged by the host).
        q, s = fp8_quantize_rows(hidden, hidden.shape[1], reciprocal=False)
        return QuantizedActivation(f, q, s)
    q, s = nvfp4_quantize(hidden, qw.act_scale.reshape(1, 1))
    return QuantizedActivation(f, q, s)


def dequantize_input(qw: QuantizedWeights, act: QuantizedActivation) -> torch.Tensor:
    f = act.fmt
    if f == "bf16":
        return act.q.to(torch.float32)
    if f == "fp8_block":
        return fp8_dequantize_rows(act.q, act.scale, FP8_ACT_BLOCK_K)
    if f == "fp8_tensor":
        return act.q.to(torch.float32) * qw.act_scale.reshape(())
    if f == "mxfp8":
        return mxfp8_dequantize(act.q, act.scale)
    if f in W4A8_FORMATS:
        return act.q.to(torch.float32) * act.scale.to(torch.float32)
    return nvfp4_dequantize(act.q, act.scale, qw.act_scale.reshape(1, 1))
