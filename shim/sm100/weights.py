"""What the Blackwell weight layouts share; each format's own layout is its frontend module's (shim/sm100/
{nvfp4,mxfp8,bf16}_frontend.py), all K-major (shim/common/weights.py). Facts from the drop's runners and kernels:

  * FC1 rows: gate and up interleaved in groups of G, the kernel's SwiGLU pairing (each layout's `interleave`:
    16 for NVFP4, SwapABSwigluFp4Epilogue; 32 for MXFP8 and BF16, GateUpInterleave).
  * NVFP4 data: two e2m1 codes a byte, the even element in the low nibble (torch.float4_e2m1fn_x2).
  * Block scales (NVFP4 e4m3 per 16, MXFP8 e8m0 per 32, along K): per expert, the raw [N, K/blk] grid
    padded to [128-row multiple, 4-column multiple] and stored atom by atom, 128 rows x 4 columns = 512
    bytes an atom, atoms row-block major; inside an atom, byte (r % 32) * 16 + (r // 32 % 4) * 4 + c % 4.
    Passed as (E, atoms * 512); FC1's over the interleaved rows.

A layout's `canonical()` inverts all of it (unpack, de-swizzle, de-interleave), so what the oracle is given is read
back from the tensors the kernel is handed, not kept aside.
"""

from __future__ import annotations

from typing import Tuple

import torch

from moe_ep.formats import codecs
from shim.common.weights import copy_bytes, round_up

__all__ = ["SF_ATOM_ROWS", "SF_ATOM_COLS", "swizzled_scale_numel", "swizzle_scales", "unswizzle_scales", "pack_e2m1",
           "unpack_e2m1", "empty_scales", "store_scales", "read_scales"]

SF_ATOM_ROWS = 128  # the drop's SfPaddingBlock
SF_ATOM_COLS = 4
_SF_ATOM_BYTES = SF_ATOM_ROWS * SF_ATOM_COLS


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


# ------------------------------------------------------------------------------------- block scales of a layout
def empty_scales(experts: int, hidden: int, intermediate: int, block: int, dtype: torch.dtype,
                 device) -> Tuple[torch.Tensor, torch.Tensor]:
    """(FC1's, FC2's) swizzled block scales for `experts` experts, empty: (E, swizzled [2I, H/block]) and
    (E, swizzled [H, I/block])."""
    return (torch.empty((experts, swizzled_scale_numel(2 * intermediate, hidden // block)), dtype=dtype,
                        device=device),
            torch.empty((experts, swizzled_scale_numel(hidden, intermediate // block)), dtype=dtype, device=device))


def store_scales(fc1_sf: torch.Tensor, fc2_sf: torch.Tensor, rows: slice, w13_scale: torch.Tensor,
                 w2_scale: torch.Tensor, group: int) -> None:
    """Canonical block scales [n, 2I, H/blk] / [n, H, I/blk] into experts `rows`: FC1's rows interleaved by `group`
    (as its weights are), both swizzled."""
    w13 = codecs.interleave_gate_up(w13_scale.view(torch.uint8), group).view(w13_scale.dtype)
    copy_bytes(fc1_sf[rows], swizzle_scales(w13))
    copy_bytes(fc2_sf[rows], swizzle_scales(w2_scale))


def read_scales(fc1_sf: torch.Tensor, fc2_sf: torch.Tensor, hidden: int, intermediate: int, block: int,
                group: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The canonical block scales back from the swizzled ones (inverse of store_scales)."""
    sf13 = unswizzle_scales(fc1_sf, 2 * intermediate, hidden // block)
    sf13 = codecs.deinterleave_gate_up(sf13.view(torch.uint8), group).view(fc1_sf.dtype)
    return sf13, unswizzle_scales(fc2_sf, hidden, intermediate // block)
