"""The W4A8 weight layout (shim/sm90/fp4_layout.py) against an emulation of how the kernel reads it, on CPU.

The emulation is written from the kernel side, not from the layout's description: per warp and lane, the
bytes LDSM x4 loads as an FP8 A fragment of the [N, K/2] byte matrix (rows g, g + 8; byte columns 4t, 16 + 4t;
CuTe's SM90 64x32 8-bit A layout), the PTX of mxfp4_cutedsl.convert_mxfp4_pair_preprocessed_signs instruction by
instruction (mad.lo.u32, prmt.b32, and/shl), the folded offsets read through make_expanded_offset_view's
strides, and the converted words placed into the e4m3 A fragment of [N, K]. What comes out must be, bit for bit,
the operand the reference multiplies (moe_ep.formats.codecs.mxfp4_kernel_operand)."""
import pytest
import torch

from moe_ep.formats import codecs
from shim.sm90 import fp4_layout

M32 = 0xFFFFFFFF


def _prmt(a, b, c):
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        sel = (c >> (4 * i)) & 0xF
        byte = src[sel & 7]
        if sel & 8:  # sign-replicate mode (the converter masks it off; kept for fidelity)
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _convert(src0, src1, lo_off, hi_off):
    """convert_mxfp4_pair_preprocessed_signs, one PTX instruction per line."""
    em0, em1 = src0 & 0x77777777, src1 & 0x77777777
    lo_lut0 = (lo_off * 0x08080800 + 0x0C080000) & M32
    lo_lut1 = (lo_off * 0x08080808 + 0x1C181410) & M32
    hi_lut0 = (hi_off * 0x08080800 + 0x0C080000) & M32
    hi_lut1 = (hi_off * 0x08080808 + 0x1C181410) & M32
    lo_em0, lo_em1 = _prmt(lo_lut0, lo_lut1, em0), _prmt(lo_lut0, lo_lut1, em1)
    hi_em0, hi_em1 = _prmt(hi_lut0, hi_lut1, em0 >> 16), _prmt(hi_lut0, hi_lut1, em1 >> 16)
    out0 = (src0 & 0x80808080) | lo_em0
    out1 = (((src0 << 4) & M32) & 0x80808080) | hi_em0
    out2 = (src1 & 0x80808080) | lo_em1
    out3 = (((src1 << 4) & M32) & 0x80808080) | hi_em1
    return out0, out1, out2, out3


def _word(row_bytes, col):
    return sum(int(row_bytes[col + i]) << (8 * i) for i in range(4))


def _kernel_reads(packed: torch.Tensor, folded: torch.Tensor) -> torch.Tensor:
    """One expert's packed bytes [N, K/2] and folded offsets [N/64, K/128, 16, 16] -> the e4m3 A operand [N, K]
    the WGMMAs see, as float32."""
    n, k2 = packed.shape
    k = 2 * k2
    out = torch.zeros((n, k), dtype=torch.uint8)
    flat_off = folded.reshape(-1)

    def offset(row, k_group):  # expanded view: 16 r + 4 s + q within the (m64, k128) block of 256 bytes
        m64, r64 = divmod(row, 64)
        s, r = divmod(r64, 16)
        k128, q = divmod(k_group, 4)
        block = m64 * (k // 128) + k128
        return int(flat_off[block * 256 + 16 * r + 4 * s + q])

    for m0 in range(0, n, 64):
        for warp in range(4):
            for lane in range(32):
                g, t = divmod(lane, 4)
                r0 = m0 + 16 * warp + g
                for hk in range(k // 64):  # one LDSM x4: a 32-byte column block
                    regs = [_word(packed[r0 + 8 * (r % 2)], 32 * hk + 16 * (r // 2) + 4 * t) for r in range(4)]
                    for kk in range(2):
                        kb = 2 * hk + kk
                        words = _convert(regs[2 * kk], regs[2 * kk + 1], offset(r0, kb), offset(r0 + 8, kb))
                        for r, w in enumerate(words):  # e4m3 A fragment: reg r -> row g + 8 (r % 2), K 16 (r // 2)
                            for j in range(4):
                                out[r0 + 8 * (r % 2), 32 * kb + 16 * (r // 2) + 4 * t + j] = (w >> (8 * j)) & 0xFF
    return out.view(torch.float8_e4m3fn).float()


def _weights(e, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(e, n, k, generator=g)
    w *= torch.logspace(-2, 2, k).reshape(1, 1, k)  # scales spread over K
    w[0, :, :64] *= 2.0 ** -16                      # a band below the window: its blocks raised and rounded
    w[-1, 5, :] = 0.0                               # an all-zero row
    w[-1, 7, 3] = -0.0
    return codecs.mxfp4_quantize(w)


@pytest.mark.parametrize("n, k", [(64, 128), (128, 256)])
def test_the_kernel_reads_the_reference_operand(n, k):
    codes, scale = _weights(2, n, k, seed=n + k)
    packed = fp4_layout.pack_payload(codes)
    offsets, residual = fp4_layout.mxfp4_offsets(scale)
    assert int(offsets.min()) >= 1 and int(offsets.max()) <= 12  # the converter's window
    folded = fp4_layout.fold_offsets(offsets)
    assert packed.shape == (2, n, k // 2) and folded.shape == (2, n // 64, k // 128, 16, 16)
    for e in range(2):
        seen = _kernel_reads(packed[e], folded[e])
        op, res = codecs.mxfp4_kernel_operand(codes[e], scale[e])
        assert torch.equal(seen, op), f"expert {e}: {(seen != op).sum()} operands differ"
        assert res.item() == residual[e].item()


def test_pack_and_fold_read_back_byte_exact():
    codes, scale = _weights(3, 128, 512, seed=1)
    assert torch.equal(fp4_layout.unpack_payload(fp4_layout.pack_payload(codes)), codes)
    offsets, residual = fp4_layout.mxfp4_offsets(scale)
    assert torch.equal(fp4_layout.unfold_offsets(fp4_layout.fold_offsets(offsets)), offsets)
    back = fp4_layout.mxfp4_codes_from_offsets(offsets, residual)
    assert torch.equal(back.view(torch.uint8), scale.view(torch.uint8))


def test_the_layout_is_a_permutation_not_a_copy():
    codes, _ = _weights(1, 16, 64, seed=2)
    packed = fp4_layout.pack_payload(codes)
    natural = codes[..., 0::2] | (codes[..., 1::2] << 4)
    assert not torch.equal(packed, natural)
    # Magnitudes are a permutation of the block's magnitudes; so are the sign bits.
    nib = torch.stack((packed & 15, packed >> 4), -1).reshape(-1)
    assert torch.equal((nib & 7).sort().values, (codes.reshape(-1) & 7).sort().values)
    assert int((nib & 8).count_nonzero()) == int((codes & 8).count_nonzero())


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
