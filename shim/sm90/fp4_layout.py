"""The SM90 W4A8 kernel's 4-bit weight layout, produced (and read back) with torch ops.

The kernel (moe_hopper_fp8/kernel_mxfp4_fp8_glu_fc12_swapab.py, mxfp4_cutedsl.py) TMA-loads the packed weight
bytes as they are, reads them into registers with LDSM shaped as an FP8 A fragment of the [N, K/2] byte matrix,
and widens each 32-bit word (eight e2m1 values) into four e4m3 words with two PRMT lookups per half
(`convert_mxfp4_pair_preprocessed_signs`). For the result to land in the e4m3 A fragment of [N, K], the bytes
must be stored permuted, and the sign bits moved where that converter reads them. Per 16 rows x 64 K values
(16 rows x 32 bytes), stored byte column `4w + b` (w = 0..7 a 32-bit word, b its byte) of stored row `8h + g`
holds, in nibble `n = 2b + (high nibble)`:
  * the magnitude (bits 0-2) of the value at row `g + 8 (n // 4)`, K `32 (w // 4) + 16 h + 4 (w % 4) + n % 4`
    (the converter's low half makes row g's four values, its high half row g + 8's; the word's second
    LDSM register is K + 16);
  * in bit 3, a sign: nibble 2j + 1 carries the sign of the value whose magnitude is in nibble j, nibble 2j the
    sign of nibble 4 + j (the converter takes the low half's signs from bits 7 of each byte, the high half's
    from bits 3).
This is TensorRT-LLM's `interleave_fp4_fp8_weights_for_sm90_mixed_gemm` (FlashInfer's
`interleave_moe_weights_for_sm90_mixed_gemm(..., "fp4_fp8")`), a CUDA op outside the pinned tree; here it is
one gather. tests/shim/sm90/fp4_layout_test.py checks it against an emulation of the kernel's read path
(LDSM fragment, PRMT converter, WGMMA A fragment) written from the kernel side.

The per-32 exponent offsets (code - lo + 1, 1..12) are folded per 64 rows x 128 K into 16 x 16 bytes: byte
`16 r + 4 s + q` of block (m64, k128) holds the offset of row `64 m64 + 16 s + r`, K group `4 k128 + q`
(`make_expanded_offset_view`: stride 16 over r, 4 over s, 1 over q).
"""

from __future__ import annotations

import functools
from typing import Tuple

import torch

from moe_ep.formats import codecs

__all__ = ["ROW_BLOCK", "K_BLOCK", "pack_payload", "unpack_payload", "fold_offsets", "unfold_offsets",
           "mxfp4_offsets", "mxfp4_codes_from_offsets"]

ROW_BLOCK = 16  # rows one permutation block spans (a WGMMA A fragment's 16 rows per warp)
K_BLOCK = 64    # K values one permutation block spans (two K32 k-blocks of one LDSM x4)
FOLD_M, FOLD_K = 64, 128  # folded offset block (mxfp4_cutedsl.MXFP4_FOLD_M, MXFP4_K_TILE)


@functools.lru_cache(maxsize=None)
def _maps() -> Tuple[torch.Tensor, torch.Tensor]:
    """(magnitude source, sign source): for each stored nibble of a 16 x 32-byte block (index (row * 32 + byte)
    * 2 + high), the flat index row * 64 + k of the value whose magnitude / sign it holds."""
    mag = torch.empty(ROW_BLOCK * K_BLOCK, dtype=torch.int64)
    sign = torch.empty_like(mag)
    for row in range(ROW_BLOCK):
        h, g = divmod(row, 8)
        for byte in range(K_BLOCK // 2):
            w, b = divmod(byte, 4)
            for high in range(2):
                n = 2 * b + high

                def src(nibble: int) -> int:
                    return (g + 8 * (nibble // 4)) * K_BLOCK + 32 * (w // 4) + 16 * h + 4 * (w % 4) + nibble % 4

                at = (row * (K_BLOCK // 2) + byte) * 2 + high
                mag[at] = src(n)
                sign[at] = src((n - 1) // 2 if n % 2 else 4 + n // 2)
    return mag, sign


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """[..., N, K] -> [..., N/16, K/64, 16 * 64] (each permutation block flattened row-major)."""
    *lead, n, k = x.shape
    v = x.reshape(*lead, n // ROW_BLOCK, ROW_BLOCK, k // K_BLOCK, K_BLOCK)
    d = len(lead)
    return v.transpose(d + 1, d + 2).reshape(*lead, n // ROW_BLOCK, k // K_BLOCK, ROW_BLOCK * K_BLOCK)


def _unblocks(b: torch.Tensor, n: int, k: int) -> torch.Tensor:
    *lead, _, _, _ = b.shape
    v = b.reshape(*lead, n // ROW_BLOCK, k // K_BLOCK, ROW_BLOCK, K_BLOCK)
    d = len(lead)
    return v.transpose(d + 1, d + 2).reshape(*lead, n, k)


def pack_payload(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes [..., N, K] (uint8, one per byte, canonical order) -> the kernel's bytes [..., N, K/2].
    N a multiple of 16, K of 64."""
    mag_src, sign_src = (m.to(codes.device) for m in _maps())
    blk = _blocks(codes)
    nib = (blk[..., mag_src] & 7) | (blk[..., sign_src] & 8)
    nib = nib.reshape(*nib.shape[:-1], ROW_BLOCK, K_BLOCK // 2, 2)
    packed = nib[..., 0] | (nib[..., 1] << 4)  # [..., N/16, K/64, 16, 32]
    *lead, nb, kb, _, _ = packed.shape
    d = len(lead)
    return packed.transpose(d + 1, d + 2).reshape(*lead, nb * ROW_BLOCK, kb * (K_BLOCK // 2))


def unpack_payload(packed: torch.Tensor) -> torch.Tensor:
    """The kernel's bytes [..., N, K/2] -> e2m1 codes [..., N, K] in canonical order (pack_payload's inverse)."""
    *lead, n, k2 = packed.shape
    k = 2 * k2
    mag_src, sign_src = (m.to(packed.device) for m in _maps())
    nib = torch.stack((packed & 15, packed >> 4), dim=-1).reshape(*lead, n, k)
    blk = _blocks(nib)
    codes = torch.empty_like(blk)
    codes[..., mag_src] = blk & 7
    codes[..., sign_src] |= blk & 8
    return _unblocks(codes, n, k)


def fold_offsets(offsets: torch.Tensor) -> torch.Tensor:
    """Per-32 offsets [E, N, K/32] (uint8) -> the kernel's folded [E, N/64, K/128, 16, 16]."""
    e, n, kg = offsets.shape
    v = offsets.reshape(e, n // FOLD_M, FOLD_M // 16, 16, kg // 4, 4)
    return v.permute(0, 1, 4, 3, 2, 5).contiguous().reshape(e, n // FOLD_M, kg // 4, 16, 16)


def unfold_offsets(folded: torch.Tensor) -> torch.Tensor:
    e, nb, kb, _, _ = folded.shape
    v = folded.reshape(e, nb, kb, 16, FOLD_M // 16, 4)
    return v.permute(0, 1, 4, 3, 2, 5).reshape(e, nb * FOLD_M, kb * 4)


def mxfp4_offsets(scale: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """e8m0 scales [E, N, K/32], each expert within the kernel's window -> (offsets uint8 code - lo + 1 in 1..12,
    fp32 residual [E] = 2^(lo - 122)), lo = the expert's floor. The conversion makes e2m1 * 2^(offset - 6); the
    residual on the accumulator restores the rest of 2^(code - 127) (codecs.mxfp4_kernel_operand)."""
    code = scale.view(torch.uint8).to(torch.int32)
    e = code.shape[0]
    flat = code.reshape(e, -1)
    lo = torch.maximum(flat.amin(dim=1), flat.amax(dim=1) - codecs.MXFP4_MAX_SCALE_RANGE)
    off = code - lo.reshape(e, 1, 1) + 1
    return off.to(torch.uint8), torch.pow(2.0, (lo - 122).to(torch.float32))


def mxfp4_codes_from_offsets(offsets: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """mxfp4_offsets' inverse: e8m0 scales [E, N, K/32] from offsets and residuals."""
    lo = torch.round(torch.log2(residual.to(torch.float32))).to(torch.int32) + 122
    code = offsets.to(torch.int32) + lo.reshape(-1, 1, 1) - 1
    return code.to(torch.uint8).view(torch.float8_e8m0fnu)
