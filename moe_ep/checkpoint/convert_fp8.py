"""FP8 e4m3 checkpoints -> moe_ep packs. Pure functions over the checkpoint's own tensors, stacked over experts.

DeepSeek-V3/R1, Kimi-K2, Qwen3-FP8 (`deepseek_fp8_block`, `deepseek_fp8_mxfp8`): per expert and projection an e4m3
`weight` [N, K] and an fp32 `weight_scale_inv` [N/128, K/128] -- despite the name the dequant MULTIPLIER,
w = q * weight_scale_inv, one per 128x128 block; gate and up are separate Linears (gate first in moe_ep's w13).

ModelOpt / llm-compressor per-tensor FP8 (`modelopt_fp8_tensor`): e4m3 `weight` + fp32 `weight_scale` (the dequant
multiplier, one per Linear) + fp32 `input_scale` (the static activation dequant scale, amax / 448).

Where moe_ep's format shares one scale between gate and up and the checkpoint gives them two, the codes under the
smaller scale are rounded again onto the larger (the only way the format holds them); every such value is counted
in the ExactnessReport, and nothing else is touched. Everything else is copied bit for bit.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from moe_ep.checkpoint.report import ExactnessReport
from moe_ep.checkpoint.tensors import expect, expect_codes, expect_scales, new_pack
from moe_ep.errors import CheckpointError, InexactCheckpointError
from moe_ep.formats import QuantizedWeights
from moe_ep.formats.codecs import to_e4m3

__all__ = ["BLOCK", "block_grid", "deepseek_fp8_block", "deepseek_fp8_mxfp8", "modelopt_fp8_tensor",
           "layer_input_scale"]

BLOCK = 128  # the checkpoints' and fp8_block's weight block, rows and columns
_E4M3, _F32 = torch.float8_e4m3fn, torch.float32


def block_grid(n: int, k: int) -> Tuple[int, int]:
    """The [ceil(N/128), ceil(K/128)] scale grid of an [N, K] weight."""
    return -(-n // BLOCK), -(-k // BLOCK)


_ROWS = 32  # rows re-rounded at a time: the fp32 temporaries stay a few MiB at any hidden size


def _rescale_rows(q: torch.Tensor, s_from: torch.Tensor, s_to: torch.Tensor, report: ExactnessReport) -> torch.Tensor:
    """e4m3 codes q [R, K] under per-column-block scales s_from [ceil(K/128)], re-expressed under s_to (>= s_from,
    elementwise), rounded to nearest even. Returns the new codes; counts what moved."""
    k = q.shape[1]
    frm = s_from.repeat_interleave(BLOCK)[:k]
    to = s_to.repeat_interleave(BLOCK)[:k]
    # A zero target scale means both scales are zero: every value is 0 either way, keep the codes.
    live = to > 0
    safe_to = torch.where(live, to, torch.ones_like(to))
    out = torch.empty_like(q)
    for r0 in range(0, q.shape[0], _ROWS):
        rows = slice(r0, r0 + _ROWS)
        before = q[rows].to(_F32) * frm
        q_new = torch.where(live, to_e4m3(before / safe_to), q[rows])
        out[rows] = q_new
        report.count_change(before, q_new.to(_F32) * to)
    return out


def _expect_e4m3(gate, up, down, e: int, h: int, i: int) -> None:
    for t, name, shape in ((gate, "gate_proj.weight", (e, i, h)), (up, "up_proj.weight", (e, i, h)),
                           (down, "down_proj.weight", (e, h, i))):
        expect_codes(expect(t, name, _E4M3, shape), name)


def _check_sizes(gate: torch.Tensor, down: torch.Tensor) -> Tuple[int, int, int]:
    if gate.dim() != 3 or down.dim() != 3:
        raise CheckpointError("gate_proj.weight", f"expected stacked [E, I, H] and [E, H, I] weights, got "
                                                  f"{list(gate.shape)} and {list(down.shape)}")
    e, i, h = gate.shape
    return e, h, i


def deepseek_fp8_block(gate: torch.Tensor, gate_scale_inv: torch.Tensor, up: torch.Tensor,
                       up_scale_inv: torch.Tensor, down: torch.Tensor, down_scale_inv: torch.Tensor, *,
                       out: Optional[QuantizedWeights] = None,
                       expert_offset: int = 0) -> Tuple[QuantizedWeights, ExactnessReport]:
    """DeepSeek-convention experts [E, ...] -> fp8_block (moe_ep's Hopper FP8 kernel's format).

    gate, up [E, I, H] e4m3; down [E, H, I] e4m3; *_scale_inv [E, N/128, K/128] fp32 (dequant multipliers).
    FC2 (down) is exact: same 128x128 grid. FC1 is exact only where gate and up agree: the kernel interleaves gate
    and up rows by 8 and cuts its 128x128 scale blocks over the interleaved rows, so fp8_block scale row n covers
    gate rows [64n, 64n+64) AND up rows [64n, 64n+64) under ONE scale, where the checkpoint has a gate block and an
    up block of 128 rows with a scale each. Row n takes max(gate, up) scale of checkpoint block n // 2; the half
    with the smaller scale is re-rounded onto it (codes change, see the report). Writes into `out` (a pack of E
    experts) when given."""
    e, h, i = _check_sizes(gate, down)
    if h % BLOCK or i % BLOCK:
        raise CheckpointError("gate_proj.weight", f"fmt fp8_block takes 128x128 blocks of whole rows and columns: "
                                                  f"H ({h}) and I ({i}) must be multiples of 128")
    nb, kb = i // BLOCK, h // BLOCK
    _expect_e4m3(gate, up, down, e, h, i)
    for t, name, shape in ((gate_scale_inv, "gate_proj.weight_scale_inv", (e, nb, kb)),
                           (up_scale_inv, "up_proj.weight_scale_inv", (e, nb, kb)),
                           (down_scale_inv, "down_proj.weight_scale_inv", (e, h // BLOCK, i // BLOCK))):
        expect_scales(expect(t, name, _F32, shape), name)
    pack = out if out is not None else new_pack("fp8_block", e, h, i, gate.device, expert_offset)
    report = ExactnessReport("deepseek_fp8", "fp8_block")

    shared = torch.maximum(gate_scale_inv, up_scale_inv)  # [E, I/128, H/128]
    pack.w13_scale.copy_(shared.repeat_interleave(2, dim=1))
    pack.w2_q.copy_(down)
    pack.w2_scale.copy_(down_scale_inv)
    for half, (src, scale) in enumerate(((gate, gate_scale_inv), (up, up_scale_inv))):
        dst = pack.w13_q[:, half * i:(half + 1) * i]
        dst.copy_(src)
        moved = scale != shared  # the blocks of this half that take the other half's (larger) scale
        # A zero scale's block is zeros whatever its codes: under the shared scale its codes become zeros (the
        # same values, _rescale_rows), which is no change of the checkpoint's values and is not counted.
        report.rescaled_blocks += int((moved & (scale > 0)).sum())
        for x, b in moved.any(dim=2).nonzero().tolist():
            rows = slice(b * BLOCK, (b + 1) * BLOCK)
            dst[x, rows].copy_(_rescale_rows(src[x, rows], scale[x, b], shared[x, b], report))
    report.values = 3 * e * i * h
    report.blocks = 2 * gate_scale_inv.numel() + down_scale_inv.numel()
    return pack, report


def _e8m0_codes(scale: torch.Tensor, name: str, report: ExactnessReport) -> torch.Tensor:
    """fp32 scales that are powers of two in e8m0's range -> their e8m0 codes (InexactCheckpointError otherwise:
    an MX scale is a power of two, and re-rounding the codes instead is a requantization moe_ep does not do)."""
    mant, exp = torch.frexp(scale)
    code = exp.to(torch.int32) - 1 + 127
    ok = (mant == 0.5) & (code >= 0) & (code <= 254)
    if not bool(ok.all()):
        report.blocks += scale.numel()
        report.rescaled_blocks += int((~ok).sum())
        raise InexactCheckpointError(name, f"fmt mxfp8 holds power-of-two scales (e8m0) only; {int((~ok).sum())} of "
                                           f"{scale.numel()} scales here are not (e.g. "
                                           f"{scale[~ok].flatten()[:3].tolist()}): load this checkpoint as "
                                           f"fp8_block (sm90) instead", report=report)
    return code.to(torch.uint8)


def deepseek_fp8_mxfp8(gate: torch.Tensor, gate_scale_inv: torch.Tensor, up: torch.Tensor,
                       up_scale_inv: torch.Tensor, down: torch.Tensor, down_scale_inv: torch.Tensor, *,
                       out: Optional[QuantizedWeights] = None,
                       expert_offset: int = 0) -> Tuple[QuantizedWeights, ExactnessReport]:
    """DeepSeek-convention experts -> mxfp8 (the Blackwell MXFP8 kernel's format), exactly, when every
    weight_scale_inv is a power of two (checkpoints with UE8M0 scales): the e4m3 codes are
    kept and each 128x128 block scale becomes the e8m0 scale of its 128 rows x 4 groups of 32. Any other scale
    raises InexactCheckpointError (before anything is written)."""
    e, h, i = _check_sizes(gate, down)
    if h % 32 or i % 32:
        raise CheckpointError("gate_proj.weight", f"fmt mxfp8 takes K in groups of 32: H ({h}) and I ({i}) must be "
                                                  f"multiples of 32")
    g13 = block_grid(i, h)
    _expect_e4m3(gate, up, down, e, h, i)
    report = ExactnessReport("deepseek_fp8", "mxfp8")
    codes = {}
    grids = ((gate_scale_inv, "gate_proj.weight_scale_inv", g13), (up_scale_inv, "up_proj.weight_scale_inv", g13),
             (down_scale_inv, "down_proj.weight_scale_inv", block_grid(h, i)))
    for t, name, grid in grids:  # every scale checked for damage before any is judged for exactness
        expect_scales(expect(t, name, _F32, (e, *grid)), name)
    for t, name, grid in grids:
        codes[name] = _e8m0_codes(t, name, report)
    pack = out if out is not None else new_pack("mxfp8", e, h, i, gate.device, expert_offset)

    def expand(c: torch.Tensor, n: int, k: int) -> torch.Tensor:  # [E, N/128, K/128] -> [E, N, K/32]
        return c.repeat_interleave(BLOCK, dim=1).repeat_interleave(BLOCK // 32, dim=2)[:, :n, :k // 32]

    s13 = pack.w13_scale.view(torch.uint8)
    s13[:, :i].copy_(expand(codes["gate_proj.weight_scale_inv"], i, h))
    s13[:, i:].copy_(expand(codes["up_proj.weight_scale_inv"], i, h))
    pack.w2_scale.view(torch.uint8).copy_(expand(codes["down_proj.weight_scale_inv"], h, i))
    pack.w13_q[:, :i].copy_(gate)
    pack.w13_q[:, i:].copy_(up)
    pack.w2_q.copy_(down)
    report.values = 3 * e * i * h
    report.blocks = sum(c.numel() for c in codes.values())
    return pack, report


def modelopt_fp8_tensor(gate: torch.Tensor, gate_scale: torch.Tensor, up: torch.Tensor, up_scale: torch.Tensor,
                        down: torch.Tensor, down_scale: torch.Tensor, act_scale: torch.Tensor,
                        fc2_act_scale: torch.Tensor, *, out: Optional[QuantizedWeights] = None,
                        expert_offset: int = 0) -> Tuple[QuantizedWeights, ExactnessReport]:
    """Per-tensor FP8 experts (ModelOpt / llm-compressor) -> fp8_tensor.

    gate, up [E, I, H], down [E, H, I] e4m3; gate_scale, up_scale, down_scale [E] fp32 weight dequant
    multipliers; act_scale / fc2_act_scale: the layer's static FC1-input and FC2-input dequant scales (fp32,
    one element: take the largest input_scale over ALL the layer's experts, gate and up for FC1, down for FC2 --
    moe_ep quantizes a token once before dispatch, so one scale serves every expert; `layer_input_scale`).
    fp8_tensor keeps ONE FC1 weight scale per expert: where gate's and up's differ, max(gate, up) is kept and
    the other half's codes are re-rounded onto it (counted in the report). FC2 is exact."""
    e, h, i = _check_sizes(gate, down)
    _expect_e4m3(gate, up, down, e, h, i)
    for t, name in ((gate_scale, "gate_proj.weight_scale"), (up_scale, "up_proj.weight_scale"),
                    (down_scale, "down_proj.weight_scale")):
        expect_scales(expect(t, name, _F32, (e,)), name)
    for t, name in ((act_scale, "input_scale"), (fc2_act_scale, "down_proj.input_scale")):
        expect_scales(expect(t.reshape(-1) if isinstance(t, torch.Tensor) else t, name, _F32, (1,)), name,
                      positive=True)
    pack = out if out is not None else new_pack("fp8_tensor", e, h, i, gate.device, expert_offset)
    report = ExactnessReport("modelopt_fp8", "fp8_tensor")
    shared = torch.maximum(gate_scale, up_scale)
    pack.w13_scale.copy_(shared)
    pack.w2_q.copy_(down)
    pack.w2_scale.copy_(down_scale)
    pack.act_scale.copy_(act_scale.reshape(1))
    pack.fc2_act_scale.copy_(fc2_act_scale.reshape(1))
    kb = -(-h // BLOCK)
    for half, (src, scale) in enumerate(((gate, gate_scale), (up, up_scale))):
        dst = pack.w13_q[:, half * i:(half + 1) * i]
        dst.copy_(src)
        for x in (scale != shared).nonzero().flatten().tolist():
            report.rescaled_blocks += int(scale[x] > 0)  # a zero scale's zeros stay zeros (see above)
            s_from, s_to = scale[x].expand(kb), shared[x].expand(kb)
            for r0 in range(0, i, BLOCK):  # 128 rows at a time: fp32 temporaries stay small
                rows = slice(r0, min(i, r0 + BLOCK))
                dst[x, rows].copy_(_rescale_rows(src[x, rows], s_from, s_to, report))
    report.values = 3 * e * i * h
    report.blocks = 3 * e
    return pack, report


def layer_input_scale(*scales: torch.Tensor) -> torch.Tensor:
    """The one static activation scale of a layer from its experts' input_scale values: the largest (a smaller
    one would saturate the activations calibrated for the largest), as a (1,) fp32 tensor."""
    flat = torch.cat([s.reshape(-1).to(_F32) for s in scales])
    return flat.max().reshape(1)
