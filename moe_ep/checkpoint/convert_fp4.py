"""FP4 (e2m1) checkpoints -> moe_ep packs. Pure functions over the checkpoint's own tensors, stacked over experts.

Both conventions pack two e2m1 codes a byte, the EVEN element in the LOW nibble (ModelOpt's NVFP4QTensor packs
`q[..., 1::2] << 4 | q[..., 0::2]`; gpt-oss / transformers' mxfp4 dequantizer reads `blk & 0x0F` into the even
columns), and code the value as sign bit 3 + magnitude index bits 0-2 over (0, .5, 1, 1.5, 2, 3, 4, 6) --
moe_ep's own e2m1 codes, so the codes are copied after unpacking, never re-rounded.

NVIDIA ModelOpt NVFP4 (`modelopt_nvfp4`): per Linear `weight` uint8 [N, K/2], `weight_scale` e4m3 [N, K/16],
`weight_scale_2` fp32 (global), `input_scale` fp32; w = e2m1(q) * weight_scale * weight_scale_2. moe_ep's nvfp4
divides by its global scale (q * scale / g), so g = 1 / weight_scale_2, and its activation global scales are
encode scales: g_act = 1 / input_scale.

gpt-oss MXFP4 (`gpt_oss_mxfp4`): per layer `gate_up_proj_blocks` uint8 [E, 2I, H/32, 16] and `_scales` uint8
e8m0 [E, 2I, H/32] with gate and up INTERLEAVED by row (row 2j is gate j, row 2j+1 is up j: transformers'
GptOssExperts takes gate_up[..., ::2] and [..., 1::2]), `down_proj_blocks` [E, H, I/32, 16] / `_scales` [E, H, I/32],
and fp32 biases; w = e2m1(q) * 2^(scale - 127). Its experts also add those biases and use a clamped SwiGLU
(alpha 1.702, limit 7.0, (up + 1)); moe_ep's layer computes neither, so the converter returns them as extras and
moe_ep.checkpoint.load_layer refuses the convention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from moe_ep.checkpoint.report import ExactnessReport
from moe_ep.checkpoint.tensors import expect, expect_finite, expect_scales, new_pack
from moe_ep.errors import CheckpointError
from moe_ep.formats import FORMATS, QuantizedWeights, codecs, format_info
from moe_ep.formats.codecs import E2M1_VALUES, e2m1_decode, to_e4m3

__all__ = ["unpack_e2m1_pairs", "modelopt_nvfp4", "gpt_oss_mxfp4", "GptOssExtras", "GPT_OSS_FORMATS",
           "NVFP4_FORMATS", "reciprocal_scale"]

_E4M3, _F32, _U8 = torch.float8_e4m3fn, torch.float32, torch.uint8
NVFP4_BLOCK, MX_BLOCK = 16, 32


def unpack_e2m1_pairs(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2], two e2m1 codes a byte, even element in the low nibble -> codes [..., K] (one a byte)."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def reciprocal_scale(scale_2: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """g = fl(1 / scale_2) in fp32, and how many of them give scale_2 back exactly as fl(1 / g). Where one does
    not, no fp32 g does (the neighbours of fl(1 / scale_2) were tried: fp32's reciprocal misses some values); the
    quotient q * s / g is then one rounding away from the checkpoint's q * s * scale_2 either way."""
    s = scale_2.to(_F32)
    g = torch.reciprocal(s)
    return g, int((torch.reciprocal(g) == s).sum())


def _unpack_into(dst: torch.Tensor, packed: torch.Tensor) -> None:
    """Codes [E, N, K] <- packed pairs [E, N, K/2], an expert at a time (temporaries of half an expert)."""
    for x in range(dst.shape[0]):
        dst[x, :, 0::2].copy_(packed[x] & 0x0F)
        dst[x, :, 1::2].copy_(packed[x] >> 4)


def modelopt_nvfp4(gate: torch.Tensor, gate_scale: torch.Tensor, gate_scale_2: torch.Tensor, up: torch.Tensor,
                   up_scale: torch.Tensor, up_scale_2: torch.Tensor, down: torch.Tensor, down_scale: torch.Tensor,
                   down_scale_2: torch.Tensor, act_input_scale: Optional[torch.Tensor],
                   down_input_scale: Optional[torch.Tensor], *, fmt: str = "nvfp4",
                   out: Optional[QuantizedWeights] = None,
                   expert_offset: int = 0) -> Tuple[QuantizedWeights, ExactnessReport]:
    """ModelOpt NVFP4 experts [E, ...] -> nvfp4 (the Blackwell NVFP4 kernel's format) or w4a8_nvfp4 (the same
    weights; its FP8 activations are scaled per token, so the checkpoint's input_scale values are not used).

    gate, up uint8 [E, I, H/2]; down uint8 [E, H, I/2]; *_scale e4m3 [E, N, K/16]; *_scale_2 fp32 [E];
    act_input_scale: the layer's FC1 input_scale (fp32, one element: the largest over ALL its experts' gate and up,
    `convert_fp8.layer_input_scale`); down_input_scale [E] fp32, per expert (nvfp4 keeps an FC2-input global scale
    per expert). Codes and block scales are copied; nvfp4 has ONE FC1 global scale per expert: where gate's and
    up's weight_scale_2 differ, the larger is kept and the other half's e4m3 block scales are re-rounded onto it
    (counted in the report). Global scales are stored as reciprocals (see reciprocal_scale)."""
    if fmt not in NVFP4_FORMATS:
        raise CheckpointError("gate_proj.weight", f"ModelOpt NVFP4 converts exactly to {list(NVFP4_FORMATS)}, not "
                                                  f"{fmt!r}")
    static = format_info(fmt).static_activation_scales  # then the checkpoint's input_scale values are used
    if gate.dim() != 3:
        raise CheckpointError("gate_proj.weight", f"expected stacked uint8 [E, I, H/2], got {list(gate.shape)}")
    e, i, h2 = gate.shape
    h = 2 * h2
    if h % NVFP4_BLOCK or i % NVFP4_BLOCK:
        raise CheckpointError("gate_proj.weight", f"fmt nvfp4 takes K in blocks of 16: H ({h}) and I ({i}) must be "
                                                  f"multiples of 16")
    expect(up, "up_proj.weight", _U8, (e, i, h // 2))
    expect(down, "down_proj.weight", _U8, (e, h, i // 2))
    for t, name, shape in ((gate_scale, "gate_proj.weight_scale", (e, i, h // 16)),
                           (up_scale, "up_proj.weight_scale", (e, i, h // 16)),
                           (down_scale, "down_proj.weight_scale", (e, h, i // 16))):
        expect_scales(expect(t, name, _E4M3, shape), name)
    scales_2 = [(gate_scale_2, "gate_proj.weight_scale_2"), (up_scale_2, "up_proj.weight_scale_2"),
                (down_scale_2, "down_proj.weight_scale_2")]
    for t, name in scales_2 + ([(down_input_scale, "down_proj.input_scale")] if static else []):
        expect_scales(expect(t, name, _F32, (e,)), name, positive=True)
    if static:
        expect_scales(expect(act_input_scale.reshape(-1), "input_scale", _F32, (1,)), "input_scale", positive=True)

    pack = out if out is not None else new_pack(fmt, e, h, i, gate.device, expert_offset)
    report = ExactnessReport("modelopt_nvfp4", fmt)
    shared = torch.maximum(gate_scale_2, up_scale_2)
    _unpack_into(pack.w2_q, down)
    pack.w2_scale.copy_(down_scale)
    for half, (packed, sf, s2) in enumerate(((gate, gate_scale, gate_scale_2), (up, up_scale, up_scale_2))):
        rows = slice(half * i, (half + 1) * i)
        codes = pack.w13_q[:, rows]
        _unpack_into(codes, packed)
        pack.w13_scale[:, rows].copy_(sf)
        for x in (s2 != shared).nonzero().flatten().tolist():
            ratio = s2[x] / shared[x]
            new_sf = to_e4m3(sf[x].to(_F32) * ratio)
            report.rescaled_blocks += int((new_sf.view(_U8) != sf[x].view(_U8)).sum())
            for r0 in range(0, i, 128):  # dequantized values compared 128 rows at a time
                r = slice(r0, min(i, r0 + 128))
                vals = e2m1_decode(codes[x, r])
                before = vals * sf[x, r].to(_F32).repeat_interleave(NVFP4_BLOCK, dim=-1) * s2[x]
                after = vals * new_sf[r].to(_F32).repeat_interleave(NVFP4_BLOCK, dim=-1) * shared[x]
                report.count_change(before, after)
            pack.w13_scale[x, rows].copy_(new_sf)
    g13, rt13 = reciprocal_scale(shared)
    g2, rt2 = reciprocal_scale(down_scale_2)
    pack.w13_global_scale.copy_(g13)
    pack.w2_global_scale.copy_(g2)
    report.reciprocal_scales, report.reciprocal_roundtrips = 2 * e, rt13 + rt2
    if static:
        g_in, rt_in = reciprocal_scale(act_input_scale.reshape(1))
        g_fc2, rt_fc2 = reciprocal_scale(down_input_scale)
        pack.act_scale.copy_(g_in)
        pack.fc2_act_scale.copy_(g_fc2)
        report.reciprocal_scales += e + 1
        report.reciprocal_roundtrips += rt_in + rt_fc2
    else:
        report.note("input_scale not used: w4a8_nvfp4 scales its FP8 activations per token")
    report.values = 3 * e * i * h
    report.blocks = 3 * e * i * h // NVFP4_BLOCK
    return pack, report


@dataclass
class GptOssExtras:
    """What gpt-oss's experts compute beyond moe_ep's layer: biases (canonical order: gate_up_bias [E, 2I] gate
    rows first, down_bias [E, H], fp32) and its activation, gate = min(gate, limit), up = clamp(up, -limit, limit),
    out = (up + 1) * gate * sigmoid(alpha * gate)."""

    gate_up_bias: Optional[torch.Tensor]
    down_bias: Optional[torch.Tensor]
    alpha: float = 1.702
    limit: float = 7.0


# What gpt-oss's MXFP4 converts to exactly: e2m1 x e8m0 is an e4m3 code under the same e8m0 scale (mxfp8), and a
# bf16 value (bf16 has fp32's exponent range); the W4A8 MXFP4 format where moe_ep has it.
GPT_OSS_FORMATS = tuple(f for f in ("w4a8_mxfp4", "mxfp8", "bf16") if f in FORMATS)
# What ModelOpt's NVFP4 converts to exactly (the weights are the same: codes, e4m3 scales, fp32 global scale).
NVFP4_FORMATS = tuple(f for f in ("nvfp4", "w4a8_nvfp4") if f in FORMATS)

_E2M1_AS_E4M3 = to_e4m3(torch.tensor(list(E2M1_VALUES) + [-v for v in E2M1_VALUES])).view(_U8)


def _mxfp4_window(codes: torch.Tensor, scales: torch.Tensor, report: ExactnessReport):
    """An expert's MXFP4 tensor [E, N, K] (codes) / [E, N, K/32] (e8m0 codes, uint8) as w4a8_mxfp4 can carry it:
    unchanged when its scales span at most MXFP4_MAX_SCALE_RANGE binades (per expert), else the blocks below the
    floor take the floor's scale and their codes are rounded again (moe_ep.formats.codecs.mxfp4_limit_scale_range,
    the kernel's own rule); every value that moves is counted."""
    new_codes, new_scale = codecs.mxfp4_limit_scale_range(codes, scales.view(torch.float8_e8m0fnu))
    new_scale = new_scale.view(_U8)
    moved = new_scale != scales
    if not bool(moved.any()):
        return codes, scales
    report.rescaled_blocks += int(moved.sum())
    for x in range(codes.shape[0]):
        before = codecs.mxfp4_dequantize(codes[x], scales[x].view(torch.float8_e8m0fnu))
        after = codecs.mxfp4_dequantize(new_codes[x], new_scale[x].view(torch.float8_e8m0fnu))
        report.count_change(before, after)
    report.note(f"w4a8_mxfp4 carries {codecs.MXFP4_MAX_SCALE_RANGE} binades of scales per expert tensor: lower "
                f"block scales were raised to that floor")
    return new_codes, new_scale


def check_biases(gate_up_bias: Optional[torch.Tensor], down_bias: Optional[torch.Tensor]) -> None:
    """gpt-oss's biases travel with its weights (GptOssExtras): a NaN or inf in one is damage like a weight's."""
    for t, name in ((gate_up_bias, "gate_up_proj_bias"), (down_bias, "down_proj_bias")):
        if t is not None:
            expect_finite(t, name)


def _deinterleave_rows(t: torch.Tensor) -> torch.Tensor:
    """[E, 2I, ...] gate/up interleaved by row (gpt-oss) -> gate rows then up rows (moe_ep)."""
    return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)


def gpt_oss_mxfp4(gate_up_blocks: torch.Tensor, gate_up_scales: torch.Tensor, down_blocks: torch.Tensor,
                  down_scales: torch.Tensor, gate_up_bias: Optional[torch.Tensor] = None,
                  down_bias: Optional[torch.Tensor] = None, *, fmt: Optional[str] = None,
                  out: Optional[QuantizedWeights] = None,
                  expert_offset: int = 0) -> Tuple[QuantizedWeights, ExactnessReport, GptOssExtras]:
    """gpt-oss MXFP4 experts [E, ...] -> `fmt` (GPT_OSS_FORMATS; default the first), exactly. Returns the pack,
    its report and the biases / activation moe_ep's layer does not compute (GptOssExtras)."""
    fmt = fmt or GPT_OSS_FORMATS[0]
    if fmt not in GPT_OSS_FORMATS:
        raise CheckpointError("gate_up_proj_blocks", f"gpt-oss MXFP4 converts exactly to {list(GPT_OSS_FORMATS)}, "
                                                     f"not {fmt!r}")
    if gate_up_blocks.dim() != 4 or down_blocks.dim() != 4:
        raise CheckpointError("gate_up_proj_blocks", f"expected [E, 2I, H/32, 16] and [E, H, I/32, 16], got "
                                                     f"{list(gate_up_blocks.shape)} and {list(down_blocks.shape)}")
    e, n2, hb, _ = gate_up_blocks.shape
    h, i = hb * MX_BLOCK, n2 // 2
    expect(gate_up_blocks, "gate_up_proj_blocks", _U8, (e, 2 * i, h // MX_BLOCK, MX_BLOCK // 2))
    expect(gate_up_scales, "gate_up_proj_scales", _U8, (e, 2 * i, h // MX_BLOCK))
    expect(down_blocks, "down_proj_blocks", _U8, (e, h, i // MX_BLOCK, MX_BLOCK // 2))
    expect(down_scales, "down_proj_scales", _U8, (e, h, i // MX_BLOCK))
    for t, name, shape in ((gate_up_bias, "gate_up_proj_bias", (e, 2 * i)), (down_bias, "down_proj_bias", (e, h))):
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or not t.is_floating_point()):
            raise CheckpointError(name, f"expected a float tensor {list(shape)}, got "
                                        f"{getattr(t, 'dtype', type(t).__name__)} {list(getattr(t, 'shape', []))}")
    for t, name in ((gate_up_scales, "gate_up_proj_scales"), (down_scales, "down_proj_scales")):
        if bool((t == 255).any()):
            raise CheckpointError(name, "holds the e8m0 NaN code 255")
    check_biases(gate_up_bias, down_bias)
    c13 = _deinterleave_rows(unpack_e2m1_pairs(gate_up_blocks.reshape(e, 2 * i, h // 2)))
    c2 = unpack_e2m1_pairs(down_blocks.reshape(e, h, i // 2))
    s13 = _deinterleave_rows(gate_up_scales)
    pack = out if out is not None else new_pack(fmt, e, h, i, gate_up_blocks.device, expert_offset)
    report = ExactnessReport("gpt_oss_mxfp4", fmt)
    report.values, report.blocks = 3 * e * i * h, 3 * e * i * h // MX_BLOCK
    if fmt == "mxfp8":
        lut = _E2M1_AS_E4M3.to(c13.device)
        for dst, codes in ((pack.w13_q.view(_U8), c13), (pack.w2_q.view(_U8), c2)):
            for r0 in range(0, codes.shape[1], 256):  # the int64 lookup index stays a few rows
                dst[:, r0:r0 + 256].copy_(lut[codes[:, r0:r0 + 256].long()])
        pack.w13_scale.view(_U8).copy_(s13)
        pack.w2_scale.view(_U8).copy_(down_scales)
    elif fmt == "bf16":
        for dst, codes, sc in ((pack.w13_q, c13, s13), (pack.w2_q, c2, down_scales)):
            for x in range(e):  # an expert at a time: the fp32 values stay one expert's
                exact = e2m1_decode(codes[x]) * torch.exp2(sc[x].to(_F32) - 127).repeat_interleave(MX_BLOCK, -1)
                dst[x].copy_(exact)
                report.count_change(exact, dst[x].to(device=exact.device, dtype=_F32))
        if report.changed:
            report.note("bf16 cannot hold some of these values (an e8m0 exponent beyond bf16's range)")
    else:  # w4a8_mxfp4: e2m1 codes one a byte + e8m0 scales, brought into the kernel's window where they exceed it
        for dst_q, dst_s, codes, sc in ((pack.w13_q, pack.w13_scale, c13, s13),
                                        (pack.w2_q, pack.w2_scale, c2, down_scales)):
            codes, sc = _mxfp4_window(codes, sc, report)
            dst_q.copy_(codes)
            dst_s.view(_U8).copy_(sc)
    extras = GptOssExtras(None if gate_up_bias is None else _deinterleave_rows(gate_up_bias.to(_F32)),
                          None if down_bias is None else down_bias.to(_F32))
    return pack, report, extras
