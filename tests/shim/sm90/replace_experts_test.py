"""Experts swapped in place in the Hopper kernel layouts (KernelWeights.replace_experts, moe_ep's EPLB swap): the
kernel tensors keep their addresses and, byte for byte, equal a fresh load of the new expert set -- from
bf16 through the format quantizer and from already-quantized weights alike; nothing outside the chosen experts moves."""
import pytest
import torch

from moe_ep.formats import quantize_weights
from shim.sm90.formats import BACKENDS


def layout(fmt):
    """The format's Hopper weight layout (its frontend's KernelWeights class)."""
    return BACKENDS.row(fmt).frontend_class().weights_layout

FIELDS = ("fc1", "fc2", "fc1_scale", "fc2_scale", "fc1_act_dequant", "fc1_w_dequant", "fc2_act_dequant",
          "fc2_w_dequant")


def _w(e, h=256, i=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, generator=g) / 16
    w2 = torch.randn(e, h, i, generator=g) / 16
    w2[e - 1, 7, 5] = 40.0  # an outlier sets its block's scale
    return w13.bfloat16(), w2.bfloat16()


def _bytes(t):
    return t.transpose(-1, -2).contiguous().view(torch.uint8) if t.dim() == 3 else t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("fmt", ["fp8_block", "fp8_tensor", "bf16"])
def test_a_swap_leaves_the_bytes_of_a_fresh_load_at_the_same_addresses(fmt):
    w13, w2 = _w(5)
    n13, n2 = _w(2, seed=1)
    cal = dict(act_amax=3.0, fc2_act_amax=0.5) if fmt == "fp8_tensor" else {}
    kw = layout(fmt).from_bf16(w13, w2, torch.device("cpu"), expert_offset=5, **cal)
    before = {f: (getattr(kw, f).data_ptr(), _bytes(getattr(kw, f)).clone()) for f in FIELDS if hasattr(kw, f)}
    slots = [3, 0]
    kw.replace_experts(slots, quantize_weights(fmt, n13, n2, **cal))
    want13, want2 = w13.clone(), w2.clone()
    want13[slots], want2[slots] = n13, n2
    fresh = layout(fmt).from_bf16(want13, want2, torch.device("cpu"), expert_offset=5, **cal)
    for f, (ptr, old) in before.items():
        got = getattr(kw, f)
        assert got.data_ptr() == ptr, f  # written in place: the compiled kernel's arguments stay valid
        assert torch.equal(_bytes(got), _bytes(getattr(fresh, f))), (fmt, f)
        untouched = [e for e in range(5) if e not in slots]
        if got.dim() == 3:
            assert torch.equal(_bytes(got)[untouched], old[untouched]), f
    assert kw.canonical().expert_offset == 5


def test_per_tensor_experts_must_share_the_layers_static_activation_scales():
    import moe_ep

    kw = layout("fp8_tensor").from_bf16(*_w(3), torch.device("cpu"), act_amax=3.0, fc2_act_amax=0.5)
    with pytest.raises(moe_ep.FormatError) as e:
        kw.replace_experts([1], quantize_weights("fp8_tensor", *_w(1, seed=2), act_amax=6.0, fc2_act_amax=0.5))
    assert e.value.argument == "weights.act_scale"


def test_quantized_input_is_written_as_it_is():
    """QuantizedWeights go in without requantization: bytes that no bf16 tensor quantizes to stay those bytes."""
    w13, w2 = _w(3)
    kw = layout("fp8_block").from_bf16(w13, w2, torch.device("cpu"))
    qw = quantize_weights("fp8_block", *_w(1, seed=2))
    qw.w13_scale.mul_(3.0)  # not what the quantizer would pick for these codes
    qw.w2_q.view(torch.uint8)[0, :4, :4] = 0x3C  # arbitrary e4m3 codes
    kw.replace_experts([1], qw)
    got = kw.canonical()
    for name in ("w13_q", "w2_q", "w13_scale", "w2_scale"):
        a, b = getattr(got, name)[1], getattr(qw, name)[0]
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), name


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
