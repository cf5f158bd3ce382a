"""The Hopper W4A8 MXFP4 weight tensors (shim/sm90/w4a8_weights.py) on CPU: what the kernel is handed reads back,
byte for byte, as moe_ep's format quantizer's pack (from bf16, however many experts at a time) or as a
checkpoint's pack brought into the kernel's scale window; shapes, dtypes and strides are the kernel's."""
import pytest
import torch

import moe_ep
from moe_ep.formats import codecs, quantize_weights
from shim.sm90.w4a8_weights import Sm90W4A8Weights


def _w(e=3, h=256, i=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, generator=g) / 16
    w2 = torch.randn(e, h, i, generator=g) / 16
    w13[1, 3, :32] = 0      # an all-zero scale block
    w2[2, 7, 5] = 40.0      # an outlier: its expert's window moves up
    w2[0, :, :32] *= 1e-6   # blocks far below the window
    return w13.bfloat16(), w2.bfloat16()


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("chunk_bytes", [1 << 30, 2 * 256 * 256 * 4 * 3])  # all experts at once / two at a time
def test_kernel_tensors_read_back_as_the_format_quantizer(chunk_bytes):
    w13, w2 = _w()
    kw = Sm90W4A8Weights.from_bf16(w13, w2, torch.device("cpu"), expert_offset=6, chunk_bytes=chunk_bytes)
    got, want = kw.canonical(), quantize_weights("w4a8_mxfp4", w13, w2, expert_offset=6)
    assert got.fmt == "w4a8_mxfp4" and got.expert_offset == 6
    for name in ("w13_q", "w2_q", "w13_scale", "w2_scale"):
        assert _same(getattr(got, name), getattr(want, name)), name


def test_shapes_dtypes_and_strides_are_the_kernels():
    e, h, i = 3, 256, 128
    kw = Sm90W4A8Weights.from_bf16(*_w(e, h, i), torch.device("cpu"))
    assert kw.fc1.dtype == torch.uint8 and kw.fc1.shape == (e, h // 2, 2 * i) and kw.fc1.stride(1) == 1
    assert kw.fc2.dtype == torch.uint8 and kw.fc2.shape == (e, i // 2, h) and kw.fc2.stride(1) == 1
    assert kw.fc1_sf.shape == (e, 2 * i // 64, h // 128, 16, 16) and kw.fc1_sf.is_contiguous()
    assert kw.fc2_sf.shape == (e, h // 64, i // 128, 16, 16) and kw.fc2_sf.is_contiguous()
    assert kw.fc1_residual.shape == (e,) and kw.fc1_residual.dtype == torch.float32
    assert kw.one.tolist() == [1.0]
    offs = torch.cat([kw.fc1_sf.reshape(-1), kw.fc2_sf.reshape(-1)])
    assert int(offs.min()) >= 1 and int(offs.max()) <= 12
    # Residuals are powers of two (the conversion's exponent bookkeeping).
    r = torch.cat([kw.fc1_residual, kw.fc2_residual])
    assert torch.equal(torch.exp2(torch.round(torch.log2(r))), r)


def test_a_checkpoint_pack_beyond_the_window_is_brought_into_it():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (2, 128, 256), generator=g, dtype=torch.uint8)
    scale = torch.full((2, 128, 8), 120, dtype=torch.uint8)
    scale[0, 0, 0] = 140            # expert 0 spans 20 binades: the 120-blocks are raised to 129
    scale13 = torch.full((2, 512, 4), 120, dtype=torch.uint8)
    scale13[1, 9, 2] = 131          # expert 1 spans exactly 11: nothing to raise
    qw = moe_ep.formats.QuantizedWeights("w4a8_mxfp4", codes[:, :, :128].repeat(1, 4, 1), codes,
                                         scale13.view(torch.float8_e8m0fnu), scale.view(torch.float8_e8m0fnu))
    got = Sm90W4A8Weights.from_pack(qw, torch.device("cpu")).canonical()
    c2, s2 = codecs.mxfp4_limit_scale_range(qw.w2_q, qw.w2_scale)
    assert _same(got.w2_q, c2) and _same(got.w2_scale, s2)
    assert int(got.w2_scale.view(torch.uint8)[0].min()) == 129 and not _same(got.w2_q, qw.w2_q)
    assert _same(got.w13_q, qw.w13_q) and _same(got.w13_scale, qw.w13_scale)  # within range: untouched


def test_nan_weights_are_refused_with_a_typed_error():
    w13, w2 = _w()
    w2[1, 2, 3] = float("nan")
    with pytest.raises(moe_ep.FormatError) as e:
        Sm90W4A8Weights.from_bf16(w13, w2, torch.device("cpu"))
    assert e.value.argument == "weights.w2" and "NaN" in str(e.value)


def test_replacing_experts_in_place_is_a_fresh_load_of_them():
    w13, w2 = _w()
    kw = Sm90W4A8Weights.from_bf16(w13, w2, torch.device("cpu"), expert_offset=3)
    ptrs = [kw.fc1.data_ptr(), kw.fc2.data_ptr(), kw.fc1_sf.data_ptr(), kw.fc1_residual.data_ptr()]
    g = torch.Generator().manual_seed(9)
    new13, new2 = (torch.randn(2, *w13.shape[1:], generator=g) * 4).bfloat16(), torch.randn(2, *w2.shape[1:],
                                                                                             generator=g).bfloat16()
    kw.replace_experts([2, 0], quantize_weights("w4a8_mxfp4", new13, new2))
    assert [kw.fc1.data_ptr(), kw.fc2.data_ptr(), kw.fc1_sf.data_ptr(), kw.fc1_residual.data_ptr()] == ptrs
    want = quantize_weights("w4a8_mxfp4", torch.stack([new13[1], w13[1], new13[0]]),
                            torch.stack([new2[1], w2[1], new2[0]]), expert_offset=3)
    got = kw.canonical()
    for name in ("w13_q", "w2_q", "w13_scale", "w2_scale"):
        assert _same(getattr(got, name), getattr(want, name)), name


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
