"""QuantizedExpertWeights: a layer built from an already-quantized pack computes with that pack's bytes in every
format (the reference backend's oracle weights ARE the pack, nothing requantized); a pack that does not fit its
format, rank or layer is a typed error naming the field."""
import pytest
import torch

import moe_ep
from moe_ep.formats import FORMATS, quantize_weights
from moe_ep.reference.oracle import check_multirank
from tests.support.dist import one_rank_gloo_group

E, H, I = 4, 256, 128
CAL = dict(act_amax=4.0, fc2_act_amax=2.0)


def _pack(fmt, e=E, offset=0):
    g = torch.Generator().manual_seed(1)
    w13 = (torch.randn(e, 2 * I, H, generator=g) / 16).bfloat16()
    w2 = (torch.randn(e, H, I, generator=g) / 16).bfloat16()
    return quantize_weights(fmt, w13, w2, expert_offset=offset, **CAL)


def _other(fmt):
    """A pack of the same format and shapes with other bytes."""
    g = torch.Generator().manual_seed(2)
    return quantize_weights(fmt, torch.randn(E, 2 * I, H, generator=g).bfloat16(),
                            torch.randn(E, H, I, generator=g).bfloat16(), **CAL)


def _bytes(t):
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_layer_computes_with_the_given_bytes(fmt):
    qw = _pack(fmt)
    spec = moe_ep.MoESpec(H, I, E, 2, 16)
    given = moe_ep.ExpertWeights.from_quantized(qw, 0, 1, E)
    with one_rank_gloo_group():
        layer = moe_ep.MoELayer(spec, given, "torch_reference")
        assert layer.fmt == fmt  # the pack's format, not the backend's default
        got = layer.oracle_weights()
        for name in qw.tensor_fields():
            assert torch.equal(_bytes(getattr(got, name)), _bytes(getattr(qw, name))), name
        hidden = torch.randn(9, H).bfloat16()
        idx = torch.randint(0, E, (9, 2))
        w = torch.softmax(torch.randn(9, 2), -1)
        out = torch.full((9, H), float("nan"), dtype=torch.bfloat16)
        layer(hidden, idx, w, out=out)
        assert check_multirank(layer, hidden, idx, w, out, weights=given).ok
        other = moe_ep.ExpertWeights.from_quantized(_other(fmt), 0, 1, E)
        report = check_multirank(layer, hidden, idx, w, out, weights=other, raise_on_failure=False)
        assert not report.ok and "not the given pack's, byte for byte" in report.summary()
        layer.close()


def test_all_experts_in_take_this_ranks_block():
    qw = _pack("fp8_block", e=8)
    w = moe_ep.ExpertWeights.from_quantized(qw, rank=1, world_size=2, num_experts=8)
    assert w.expert_offset == 4 and w.qw.expert_offset == 4 and w.qw.num_experts == 4
    assert torch.equal(_bytes(w.qw.w13_q), _bytes(qw.w13_q[4:])) and torch.equal(w.qw.w13_scale, qw.w13_scale[4:])


@pytest.mark.parametrize("field, value, error, match", [
    ("w13_scale", lambda qw: qw.w13_scale.bfloat16(), moe_ep.errors.DTypeError, "expected dtype torch.float32"),
    ("w2_scale", lambda qw: qw.w2_scale[:, :1], moe_ep.errors.ShapeError, "expected \\[4, 2, 1\\]"),
    ("w13_scale", lambda qw: None, moe_ep.errors.DTypeError, "needs w13_scale"),
    ("act_scale", lambda qw: torch.ones(1), moe_ep.errors.ShapeError, "carries no act_scale"),
])
def test_a_pack_that_does_not_fit_its_format(field, value, error, match):
    from dataclasses import replace

    qw = _pack("fp8_block")
    bad = replace(qw, **{field: value(qw)})
    with pytest.raises(error, match=match) as e:
        moe_ep.ExpertWeights.from_quantized(bad, 0, 1, E)
    assert e.value.argument == f"weights.qw.{field}"


@pytest.mark.parametrize("fmt", ["fp8_block", "mxfp8", "nvfp4"])
def test_block_scales_must_be_finite_and_non_negative(fmt):
    """A pack built by hand (not loaded: the loader checks its own): a negative or NaN block scale would turn its
    block's outputs silently; zero is a block of zeros and stays allowed."""
    from dataclasses import replace

    qw = _pack(fmt)
    if not qw.w13_scale.dtype.is_floating_point:
        pytest.skip(f"{fmt}'s block scales are exponent codes (the format's own range check)")
    dt = qw.w13_scale.dtype
    # the bad values the scale dtype can hold (e4m3 saturates inf to 448; e8m0 has no sign)
    held = [v for v in (-1.0, float("nan"), float("inf")) if not bool(torch.tensor([v]).to(dt).float() >= 0)]
    assert held
    for value in held:
        s = qw.w13_scale.clone()
        s[1].view(-1)[3] = value
        with pytest.raises(moe_ep.errors.WeightValueError, match="expert 1") as e:
            moe_ep.ExpertWeights.from_quantized(replace(qw, w13_scale=s), 0, 1, E)
        assert e.value.argument == "weights.qw.w13_scale"
    zero = qw.w13_scale.clone()
    zero[1].view(-1)[3] = 0
    moe_ep.ExpertWeights.from_quantized(replace(qw, w13_scale=zero), 0, 1, E)


def test_a_pack_on_the_meta_device_is_a_device_error():
    from dataclasses import fields, replace

    qw = _pack("fp8_block")
    meta = replace(qw, **{f.name: getattr(qw, f.name).to("meta") for f in fields(qw)
                          if isinstance(getattr(qw, f.name), torch.Tensor)})
    with pytest.raises(moe_ep.errors.DeviceError, match="meta tensors") as e:
        moe_ep.ExpertWeights.from_quantized(meta, 0, 1, E)
    assert e.value.argument == "weights.qw.w13_q"


def test_nvfp4_codes_and_global_scales_are_checked():
    from dataclasses import replace

    qw = _pack("nvfp4")
    codes = qw.w2_q.clone()
    codes[2, 0, 0] = 16
    with pytest.raises(moe_ep.errors.ShapeError, match="expert 2 has a larger byte"):
        moe_ep.ExpertWeights.from_quantized(replace(qw, w2_q=codes), 0, 1, E)
    with pytest.raises(moe_ep.errors.WeightValueError, match="finite positive") as e:
        moe_ep.ExpertWeights.from_quantized(replace(qw, fc2_act_scale=qw.fc2_act_scale * 0), 0, 1, E)
    assert e.value.argument == "weights.qw.fc2_act_scale"


def test_w4a8_mxfp4_scales_must_fit_the_kernels_window():
    from dataclasses import replace

    qw = _pack("w4a8_mxfp4")
    scales = qw.w2_scale.view(torch.uint8).clone()
    scales[3, 0, 0] = int(scales[3].max()) - 12  # 12 binades below the expert's largest: the kernel carries 11
    with pytest.raises(moe_ep.errors.ShapeError, match="expert 3's e8m0 scales span 1[2-9] binades") as e:
        moe_ep.ExpertWeights.from_quantized(replace(qw, w2_scale=scales.view(torch.float8_e8m0fnu)), 0, 1, E)
    assert e.value.argument == "weights.qw.w2_scale"


def test_a_layer_refuses_another_format_or_a_foreign_pack():
    w = moe_ep.ExpertWeights.from_quantized(_pack("mxfp8"), 0, 1, E)
    with one_rank_gloo_group():
        with pytest.raises(moe_ep.FormatError, match="would have to requantize"):
            moe_ep.MoELayer(moe_ep.MoESpec(H, I, E, 2, 16), w, "torch_reference", fmt="nvfp4")
        moe_ep.register_backend("fp8_block_only", "moe_ep.reference.backend:TorchReferenceBackend", arch="cpu",
                                formats=("fp8_block",))
        try:
            with pytest.raises(moe_ep.FormatError, match="'fp8_block_only' serves \\['fp8_block'\\], not 'mxfp8'"):
                moe_ep.MoELayer(moe_ep.MoESpec(H, I, E, 2, 16), w, "fp8_block_only")
        finally:
            moe_ep.unregister_backend("fp8_block_only")
        with pytest.raises(moe_ep.errors.ShapeError, match="hidden 256, intermediate 128"):
            moe_ep.MoELayer(moe_ep.MoESpec(H, 2 * I, E, 2, 16), w, "torch_reference")
    with pytest.raises(moe_ep.errors.WeightsRankError, match="pack starts at 3"):
        moe_ep.QuantizedExpertWeights(_pack("bf16", e=2, offset=3), rank=1, world_size=2, num_experts=4)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
