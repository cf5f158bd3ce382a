"""The Hopper weight layouts (each format's KernelWeights, shim/sm90/<format>_frontend.py) on CPU: what the kernel
is handed reads back, byte for byte, as moe_ep's format quantizer's canonical weights, however many experts are
quantized at a time; the kernel views have the strides the kernel expects; nothing canonical is held beside them."""
import pytest
import torch

from moe_ep.formats import quantize_weights
from shim.sm90 import weights
from shim.sm90.formats import BACKENDS


def layout(fmt):
    """The format's Hopper weight layout (its frontend's KernelWeights class)."""
    return BACKENDS.row(fmt).frontend_class().weights_layout


def _w(e=5, h=256, i=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, generator=g) / 16
    w2 = torch.randn(e, h, i, generator=g) / 16
    w13[1, 3, :128] = 0  # an all-zero scale block
    w2[4, 7, 5] = 40.0  # an outlier
    return w13.bfloat16(), w2.bfloat16()


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("fmt", ["fp8_block", "fp8_tensor", "bf16"])
@pytest.mark.parametrize("chunk_bytes", [1 << 30, 2 * 512 * 256 * 4])  # all experts at once / two at a time
def test_kernel_tensors_read_back_as_the_format_quantizer(fmt, chunk_bytes):
    w13, w2 = _w()
    cal = dict(act_amax=3.0, fc2_act_amax=0.5) if fmt == "fp8_tensor" else {}
    kw = layout(fmt).from_bf16(w13, w2, torch.device("cpu"), expert_offset=10, chunk_bytes=chunk_bytes, **cal)
    got, want = kw.canonical(), quantize_weights(fmt, w13, w2, expert_offset=10, **cal)
    assert got.fmt == fmt and got.expert_offset == 10
    for name in ("w13_q", "w2_q", "w13_scale", "w2_scale", "act_scale", "fc2_act_scale"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert _same(a, b), (fmt, name)


@pytest.mark.parametrize("fmt", ["fp8_block", "bf16"])
def test_views_are_k_major_and_gate_up_interleaved_by_eight(fmt):
    w13, w2 = _w()
    kw = layout(fmt).from_bf16(w13, w2, torch.device("cpu"))
    e, n2, h = w13.shape
    assert kw.fc1.shape == (e, h, n2) and kw.fc1.stride(1) == 1  # (E, H, 2I) view of [E, 2I, H] storage
    assert kw.fc2.shape == (e, w2.shape[2], h) and kw.fc2.stride(1) == 1
    storage = kw.fc1.transpose(1, 2)
    q13 = quantize_weights(fmt, w13, w2).w13_q
    g = weights.GATE_UP_INTERLEAVE
    assert _same(storage[:, :g], q13[:, :g]) and _same(storage[:, g:2 * g], q13[:, n2 // 2:n2 // 2 + g])


def test_fp8_tensor_hands_the_kernel_its_scales_and_the_blockwise_slots_placeholders():
    w13, w2 = _w()
    kw = layout("fp8_tensor").from_bf16(w13, w2, torch.device("cpu"), act_amax=3.0, fc2_act_amax=0.5)
    qw = quantize_weights("fp8_tensor", w13, w2, act_amax=3.0, fc2_act_amax=0.5)
    assert torch.equal(kw.fc1_w_dequant, qw.w13_scale) and torch.equal(kw.fc2_w_dequant, qw.w2_scale)
    assert kw.fc1_act_dequant.shape == (1,) and kw.fc1_act_dequant.item() == qw.act_scale.item()
    assert kw.fc2_act_dequant.item() == qw.fc2_act_scale.item()
    e, n2, h = w13.shape
    # The runner's swizzled E8M0 slot shape: (E, round_up(N, 128) * round_up(K / 32, 4)), all 1.0.
    assert kw.fc1_scale.dtype == torch.float8_e8m0fnu and kw.fc1_scale.shape == (e, n2 * (h // 32))
    assert kw.fc2_scale.shape == (e, h * (w2.shape[2] // 32)) and bool((kw.fc2_scale.float() == 1).all())


def test_the_oracle_view_shares_fc2_storage_with_the_kernel():
    kw = layout("fp8_block").from_bf16(*_w(), torch.device("cpu"))
    assert kw.canonical().w2_q.data_ptr() == kw.fc2.data_ptr()  # a view, not a second copy


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
