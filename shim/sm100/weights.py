"""Expert weights -> the Blackwell kernels' weight layouts (NVFP4, MXFP8, BF16), and back.

Two ways in, as in the Hopper shim: canonical bf16 (`prepare_weights`: quantized by moe_ep's format quantizer,
`moe_ep.formats.quantize_weights(fmt, ...)`, so the kernel computes with exactly the bytes the oracle checks
against) or an already-quantized pack (`prepare_quantized`: a checkpoint's bytes as they are). This module lays
them out the way the drop's kernels read them (facts from the drop's runners and kernels, 0.7.2.post1; unchanged
in 0.7.4):

  * FC1 rows: gate and up interleaved in groups of G -- g0..g(G-1), u0..u(G-1), gG.. -- where G is the
    kernel's SwiGLU pairing: 16 for NVFP4 (SwapABSwigluFp4Epilogue), 32 for MXFP8 and BF16
    (GateUpInterleave). Passed as an (E, H, 2I) view whose H axis is the contiguous one (K-major
    storage [E, 2I, H], permuted view).
  * FC2 as an (E, I, H) view of [E, H, I] storage (I contiguous).
  * NVFP4 data: two e2m1 codes a byte, the even element in the low nibble (torch.float4_e2m1fn_x2).
  * Block scales (NVFP4 e4m3 per 16, MXFP8 e8m0 per 32, along K): per expert, the raw [N, K/blk] grid
    padded to [128-row multiple, 4-column multiple] and stored atom by atom, 128 rows x 4 columns = 512
    bytes an atom, atoms row-block major; inside an atom, byte (r % 32) * 16 + (r // 32 % 4) * 4 + c % 4.
    Passed as (E, atoms * 512).
  * NVFP4 epilogue scalars per expert: fc1_alpha = 1 / (g_act * g_w13), fc1_norm_const = g_fc2act (the
    encode scale the kernel quantizes the SwiGLU output with), fc2_alpha = 1 / (g_fc2act * g_w2).

`Sm100KernelWeights.canonical()` inverts the layout (unpack, de-swizzle, de-interleave) so what the
oracle is given is read back from the tensors the kernel is handed, not kept aside.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from moe_ep.core.weights import QuantizedExpertWeights
from moe_ep.errors import FormatError
from moe_ep.formats import QuantizedWeights, codecs, packs

__all__ = ["GATE_UP_INTERLEAVE", "SCALE_BLOCK", "SF_ATOM_ROWS", "SF_ATOM_COLS", "Sm100KernelWeights",
           "round_up", "swizzled_scale_numel", "swizzle_scales", "unswizzle_scales", "pack_e2m1", "unpack_e2m1",
           "prepare", "prepare_weights", "prepare_quantized", "placeholder_weights"]

# The kernels' SwiGLU gate/up pairing (checked against the drop at kernel build).
GATE_UP_INTERLEAVE = {"nvfp4": 16, "mxfp8": 32, "bf16": 32}
# Elements along K per block scale.
SCALE_BLOCK = {"nvfp4": codecs.NVFP4_BLOCK, "mxfp8": codecs.MX_BLOCK}
SF_ATOM_ROWS = 128  # the drop's SfPaddingBlock
SF_ATOM_COLS = 4
_SF_ATOM_BYTES = SF_ATOM_ROWS * SF_ATOM_COLS


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


# ------------------------------------------------------------------------------------------- scale swizzle
def swizzled_scale_numel(rows: int, cols: int) -> int:
    return round_up(rows, SF_ATOM_ROWS) * round_up(cols, SF_ATOM_COLS)


def _atom_offsets(rows: int, cols: int, device) -> torch.Tensor:
    """[rows_padded, cols_padded] int64: where element (r, c) of the padded grid lives in the flat layout."""
    rp, cp = round_up(rows, SF_ATOM_ROWS), round_up(cols, SF_ATOM_COLS)
    r = torch.arange(rp, device=device).reshape(rp, 1)
    c = torch.arange(cp, device=device).reshape(1, cp)
    atom = (r // SF_ATOM_ROWS) * (cp // SF_ATOM_COLS) + c // SF_ATOM_COLS
    inner = (r % 32) * 16 + (r % SF_ATOM_ROWS // 32) * 4 + c % SF_ATOM_COLS
    return atom * _SF_ATOM_BYTES + inner


def swizzle_scales(raw: torch.Tensor) -> torch.Tensor:
    """[..., rows, cols] one-byte scales -> [..., swizzled_scale_numel(rows, cols)], zero-padded."""
    *lead, rows, cols = raw.shape
    dtype = raw.dtype
    src = raw.contiguous().view(torch.uint8)
    rp, cp = round_up(rows, SF_ATOM_ROWS), round_up(cols, SF_ATOM_COLS)
    padded = torch.zeros((*lead, rp, cp), dtype=torch.uint8, device=raw.device)
    padded[..., :rows, :cols] = src
    flat = torch.empty((*lead, rp * cp), dtype=torch.uint8, device=raw.device)
    flat[..., _atom_offsets(rows, cols, raw.device).reshape(-1)] = padded.reshape(*lead, rp * cp)
    return flat.view(dtype)


def unswizzle_scales(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of swizzle_scales: [..., swizzled_scale_numel(rows, cols)] -> [..., rows, cols]."""
    *lead, n = flat.shape
    if n != swizzled_scale_numel(rows, cols):
        raise ValueError(f"a swizzled [{rows}, {cols}] scale grid has {swizzled_scale_numel(rows, cols)} entries, "
                         f"got {n}")
    dtype = flat.dtype
    src = flat.contiguous().view(torch.uint8)
    idx = _atom_offsets(rows, cols, flat.device)[:rows, :cols]
    return src[..., idx.reshape(-1)].reshape(*lead, rows, cols).view(dtype)


# ------------------------------------------------------------------------------------------------ e2m1 pairs
def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes [..., K] (uint8, one a byte) -> [..., K/2] torch.float4_e2m1fn_x2, even element low."""
    if codes.shape[-1] % 2:
        raise ValueError(f"e2m1 packing needs an even last extent, got {tuple(codes.shape)}")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).contiguous().view(torch.float4_e2m1fn_x2)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] packed pairs (contiguous last dim) -> e2m1 codes [..., K] uint8."""
    b = packed.contiguous().view(torch.uint8)
    return torch.stack((b & 0x0F, b >> 4), dim=-1).reshape(*b.shape[:-1], b.shape[-1] * 2)


# ------------------------------------------------------------------------------------------------- weights
@dataclass
class Sm100KernelWeights:
    fmt: str
    expert_offset: int
    fc1: torch.Tensor  # (E, H, 2I) kernel view, H contiguous, gate/up interleaved
    fc2: torch.Tensor  # (E, I, H) kernel view, I contiguous
    fc1_sf: Optional[torch.Tensor] = None  # (E, swizzled) block scales over the interleaved rows
    fc2_sf: Optional[torch.Tensor] = None  # (E, swizzled)
    # NVFP4 only.
    fc1_alpha: Optional[torch.Tensor] = None  # (E,) fp32
    fc2_alpha: Optional[torch.Tensor] = None  # (E,) fp32
    fc1_norm_const: Optional[torch.Tensor] = None  # (E,) fp32
    w13_global_scale: Optional[torch.Tensor] = None  # (E,) fp32
    w2_global_scale: Optional[torch.Tensor] = None  # (E,) fp32
    act_scale: Optional[torch.Tensor] = None  # (1,) fp32: FC1-input global (encode) scale
    fc2_act_scale: Optional[torch.Tensor] = None  # (E,) fp32: FC2-input global scale

    @property
    def num_experts(self) -> int:
        return self.fc1.shape[0]

    def storage(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(FC1 [E, 2I, K-bytes], FC2 [E, H, K-bytes]) in the K-major storage the views are taken from."""
        return self.fc1.transpose(1, 2), self.fc2.transpose(1, 2)

    def canonical(self) -> QuantizedWeights:
        """The quantized weights read back from the kernel tensors, in moe_ep's canonical layout."""
        g = GATE_UP_INTERLEAVE[self.fmt]
        s1, s2 = self.storage()
        if self.fmt == "bf16":
            return QuantizedWeights("bf16", codecs.deinterleave_gate_up(s1.contiguous(), g), s2.contiguous(),
                                    expert_offset=self.expert_offset)
        if self.fmt == "mxfp8":
            q13 = codecs.deinterleave_gate_up(s1.contiguous().view(torch.uint8), g).view(torch.float8_e4m3fn)
            q2 = s2.contiguous()
        else:
            q13 = codecs.deinterleave_gate_up(unpack_e2m1(s1), g)
            q2 = unpack_e2m1(s2)
        e, n2, h = q13.shape
        i = q2.shape[2]
        blk = SCALE_BLOCK[self.fmt]
        sf13 = unswizzle_scales(self.fc1_sf, n2, h // blk)
        sf13 = codecs.deinterleave_gate_up(sf13.view(torch.uint8), g).view(self.fc1_sf.dtype)
        sf2 = unswizzle_scales(self.fc2_sf, h, i // blk)
        return QuantizedWeights(self.fmt, q13, q2, sf13, sf2, self.w13_global_scale, self.w2_global_scale,
                                act_scale=self.act_scale, fc2_act_scale=self.fc2_act_scale,
                                expert_offset=self.expert_offset)

    # The fields with one entry per expert (dim 0); act_scale is the layer's one static FC1-input scale.
    PER_EXPERT = ("fc1", "fc2", "fc1_sf", "fc2_sf", "fc1_alpha", "fc2_alpha", "fc1_norm_const", "w13_global_scale",
                  "w2_global_scale", "fc2_act_scale")

    def replace_experts(self, slots, qw: QuantizedWeights) -> None:
        """Write qw's experts (canonical, this format) over experts `slots`, in place: laid out by the load's own
        packer (_lay_out; every layout step is per expert), then copied row by row into the kernel's tensors, which
        keep their addresses. The static FC1-input scale is the layer's and stays."""
        fresh = _lay_out(qw)
        for name in self.PER_EXPERT:
            dst, src = getattr(self, name), getattr(fresh, name)
            if dst is None:
                continue
            if dst.element_size() == 1:  # e2m1 pairs / e4m3 / e8m0: copied as bytes
                dst, src = dst.view(torch.uint8), src.view(torch.uint8)
            for i, s in enumerate(slots):
                dst[s].copy_(src[i])


def _lay_out(qw: QuantizedWeights) -> Sm100KernelWeights:
    fmt = qw.fmt
    g = GATE_UP_INTERLEAVE[fmt]
    if fmt == "bf16":
        fc1 = codecs.interleave_gate_up(qw.w13_q, g)
        return Sm100KernelWeights(fmt, qw.expert_offset, fc1.transpose(1, 2), qw.w2_q.contiguous().transpose(1, 2))
    if fmt == "mxfp8":
        fc1 = codecs.interleave_gate_up(qw.w13_q.view(torch.uint8), g).view(torch.float8_e4m3fn)
        fc2 = qw.w2_q.contiguous()
    else:
        fc1 = pack_e2m1(codecs.interleave_gate_up(qw.w13_q, g))
        fc2 = pack_e2m1(qw.w2_q)
    sf13 = codecs.interleave_gate_up(qw.w13_scale.view(torch.uint8), g).view(qw.w13_scale.dtype)
    kw = Sm100KernelWeights(fmt, qw.expert_offset, fc1.transpose(1, 2), fc2.transpose(1, 2),
                            fc1_sf=swizzle_scales(sf13), fc2_sf=swizzle_scales(qw.w2_scale))
    if fmt == "nvfp4":
        e = qw.num_experts
        g_in = qw.act_scale.reshape(1).to(torch.float32)
        g_fc2 = qw.fc2_act_scale.reshape(e).to(torch.float32)
        kw.w13_global_scale, kw.w2_global_scale = qw.w13_global_scale, qw.w2_global_scale
        kw.act_scale, kw.fc2_act_scale = g_in, g_fc2
        kw.fc1_alpha = codecs.nvfp4_alpha(g_in.expand(e), qw.w13_global_scale).contiguous()
        kw.fc1_norm_const = g_fc2.clone()
        kw.fc2_alpha = codecs.nvfp4_alpha(g_fc2, qw.w2_global_scale).contiguous()
    return kw


def prepare_weights(fmt: str, w13: torch.Tensor, w2: torch.Tensor, device: torch.device, *, expert_offset: int = 0,
                    act_amax: Optional[float] = None, fc2_act_amax: Optional[float] = None) -> Sm100KernelWeights:
    """Quantize (moe_ep's reference quantizer, on `device`) and lay out for the `fmt` kernel.

    act_amax / fc2_act_amax: NVFP4's static activation calibration (CalibrationError without them)."""
    if fmt not in GATE_UP_INTERLEAVE:
        raise ValueError(f"fmt must be one of {sorted(GATE_UP_INTERLEAVE)}, got {fmt!r}")
    qw = packs.quantize_weights(fmt, w13.to(device), w2.to(device), act_amax=act_amax, fc2_act_amax=fc2_act_amax,
                                expert_offset=expert_offset)
    return _lay_out(qw)


def prepare_quantized(qw: QuantizedWeights, device: torch.device) -> Sm100KernelWeights:
    """Lay out an already-quantized pack (nvfp4, mxfp8 or bf16, canonical layout) for its kernel, bit for bit: its
    codes, block scales and global scales are moved to `device` and rearranged (gate/up interleave, e2m1 pairs,
    swizzled scale atoms), never requantized; the NVFP4 epilogue scalars are derived from its global scales as for
    a pack quantized here."""
    if qw.fmt not in GATE_UP_INTERLEAVE:
        raise FormatError("weights.qw.fmt", f"the sm100 weight layouts serve {sorted(GATE_UP_INTERLEAVE)}, not "
                                            f"{qw.fmt!r}")
    return _lay_out(qw.to(device))


def prepare(fmt: str, weights, device: torch.device) -> Sm100KernelWeights:
    """The layer's weights (moe_ep.ExpertWeights: quantized here; moe_ep.QuantizedExpertWeights: laid out as
    given) -> the `fmt` kernel's."""
    if isinstance(weights, QuantizedExpertWeights):
        if weights.fmt != fmt:
            raise FormatError("fmt", f"the weights are quantized as {weights.fmt!r}, the sm100 kernel runs {fmt!r}")
        return prepare_quantized(weights.qw, device)
    return prepare_weights(fmt, weights.w13, weights.w2, device, expert_offset=weights.expert_offset,
                           act_amax=weights.act_amax, fc2_act_amax=weights.fc2_act_amax)


def placeholder_weights(fmt: str, experts: int, hidden: int, intermediate: int,
                        device=None) -> Sm100KernelWeights:
    """Zero weights of the right shapes and dtypes (a compile without real weights)."""
    z13 = torch.zeros((experts, 2 * intermediate, hidden), dtype=torch.bfloat16, device=device)
    z2 = torch.zeros((experts, hidden, intermediate), dtype=torch.bfloat16, device=device)
    cal = dict(act_amax=1.0, fc2_act_amax=1.0) if fmt == "nvfp4" else {}
    return prepare_weights(fmt, z13, z2, z13.device, **cal)
