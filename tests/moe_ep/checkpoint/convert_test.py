"""The converters as pure functions of a checkpoint's tensors: what they keep is the checkpoint's own bytes, bit for
bit; what moe_ep's format cannot hold is re-rounded and counted, and the counts are checked here against an
independent recount (tests/moe_ep/checkpoint/synth.py dequantizes every convention in plain torch)."""

import pytest
import torch

from moe_ep.checkpoint import convert_fp4, convert_fp8, convert_bf16
from moe_ep.errors import CheckpointError, InexactCheckpointError
from moe_ep.formats import dequantize_weights
from tests.moe_ep.checkpoint import synth

STEM = "model.layers.1.mlp.experts"


def _stack(t, proj, suffix, e=4, stem=STEM):
    return torch.stack([t[f"{stem}.{x}.{proj}.{suffix}"] for x in range(e)])


def _bytes(a):
    return a.contiguous().view(torch.uint8)


def _deepseek(t, fn=convert_fp8.deepseek_fp8_block):
    return fn(*(_stack(t, p, s) for p in ("gate_proj", "up_proj", "down_proj") for s in ("weight", "weight_scale_inv")))


def test_deepseek_agreeing_scales_load_bit_for_bit():
    t = synth.tensors("deepseek_fp8", agree=True)
    pack, report = _deepseek(t)
    assert report.exact and report.changed == 0 and report.values == 4 * 3 * 128 * 256
    assert torch.equal(_bytes(pack.w13_q), _bytes(torch.cat((_stack(t, "gate_proj", "weight"),
                                                              _stack(t, "up_proj", "weight")), dim=1)))
    assert torch.equal(pack.w2_scale, _stack(t, "down_proj", "weight_scale_inv"))
    # fp8_block scale row n covers gate rows [64n, 64n+64) and up rows [64n, 64n+64): checkpoint block n // 2
    assert torch.equal(pack.w13_scale, _stack(t, "gate_proj", "weight_scale_inv").repeat_interleave(2, dim=1))
    w13, w2 = dequantize_weights(pack)
    ref13, ref2 = synth.dequantized(t, "deepseek_fp8")
    assert torch.equal(w13, ref13) and torch.equal(w2, ref2)


def test_deepseek_disagreeing_scales_rescale_the_smaller_half_and_count_it():
    t = synth.tensors("deepseek_fp8", agree=False, seed=3)
    pack, report = _deepseek(t)
    gs, us = _stack(t, "gate_proj", "weight_scale_inv"), _stack(t, "up_proj", "weight_scale_inv")
    w13, w2 = dequantize_weights(pack)
    ref13, ref2 = synth.dequantized(t, "deepseek_fp8")
    assert torch.equal(w2, ref2)  # FC2 has the checkpoint's own grid
    assert not report.exact and report.rescaled_blocks == int((gs != us).sum())
    diff = (w13 - ref13).abs()
    assert report.changed == int((diff != 0).sum()) > 0
    assert report.max_abs_err == pytest.approx(float(diff.max()), rel=0, abs=0)
    # The half with the larger scale keeps its codes; every other value moved by at most half an e4m3 step of
    # the shared scale (3 mantissa bits: 1/16 relative, or half the subnormal step 2^-9).
    shared = torch.maximum(gs, us).repeat_interleave(128, 1).repeat_interleave(128, 2)
    bound = ref13.abs() / 16 + torch.cat((shared, shared), dim=1) * 2.0 ** -10
    assert bool((diff <= bound * (1 + 1e-6)).all())
    keep_gate = (gs >= us).repeat_interleave(128, 1).repeat_interleave(128, 2)
    assert torch.equal(w13[:, :128][keep_gate], ref13[:, :128][keep_gate])
    assert torch.equal(w13[:, 128:][~keep_gate], ref13[:, 128:][~keep_gate])
    assert "NOT exact" in report.summary() and str(report.changed) in report.summary()


def test_deepseek_to_mxfp8_needs_power_of_two_scales():
    t = synth.tensors("deepseek_fp8", pow2=True)
    pack, report = _deepseek(t, convert_fp8.deepseek_fp8_mxfp8)
    assert report.exact
    w13, w2 = dequantize_weights(pack)  # separate gate / up scales per row: no sharing, exact even disagreeing
    ref13, ref2 = synth.dequantized(t, "deepseek_fp8")
    assert torch.equal(w13, ref13) and torch.equal(w2, ref2)
    with pytest.raises(InexactCheckpointError) as e:
        _deepseek(synth.tensors("deepseek_fp8"), convert_fp8.deepseek_fp8_mxfp8)
    assert e.value.argument == "gate_proj.weight_scale_inv" and "power-of-two" in str(e.value)


def test_deepseek_refuses_a_partial_block_and_a_bad_scale():
    t = synth.tensors("deepseek_fp8", i=96)
    with pytest.raises(CheckpointError, match="multiples of 128"):
        _deepseek(t)
    t = synth.tensors("deepseek_fp8")
    t[f"{STEM}.2.up_proj.weight_scale_inv"][0, 1] = float("nan")
    with pytest.raises(CheckpointError) as e:
        _deepseek(t)
    assert e.value.argument == "up_proj.weight_scale_inv" and "finite" in str(e.value)


def _modelopt_fp8(t):
    s = {p: _stack(t, p, "weight_scale") for p in ("gate_proj", "up_proj", "down_proj")}
    act = convert_fp8.layer_input_scale(_stack(t, "gate_proj", "input_scale"), _stack(t, "up_proj", "input_scale"))
    fc2 = convert_fp8.layer_input_scale(_stack(t, "down_proj", "input_scale"))
    return convert_fp8.modelopt_fp8_tensor(_stack(t, "gate_proj", "weight"), s["gate_proj"],
                                           _stack(t, "up_proj", "weight"), s["up_proj"],
                                           _stack(t, "down_proj", "weight"), s["down_proj"], act, fc2)


@pytest.mark.parametrize("agree", [True, False])
def test_modelopt_fp8_per_tensor(agree):
    t = synth.tensors("modelopt_fp8", agree=agree, seed=1)
    pack, report = _modelopt_fp8(t)
    w13, w2 = dequantize_weights(pack)
    ref13, ref2 = synth.dequantized(t, "modelopt_fp8")
    assert torch.equal(w2, ref2)
    assert float(pack.act_scale) == max(float(t[f"{STEM}.{x}.{p}.input_scale"]) for x in range(4)
                                        for p in ("gate_proj", "up_proj"))
    assert float(pack.fc2_act_scale) == max(float(t[f"{STEM}.{x}.down_proj.input_scale"]) for x in range(4))
    if agree:
        assert report.exact and torch.equal(w13, ref13)
    else:
        assert report.rescaled_blocks == 4 and report.changed == int((w13 != ref13).sum()) > 0
        # at most half an e4m3 step of the shared scale: 1/16 relative, or half the subnormal step (2^-10 S)
        bound = ref13.abs() / 16 + pack.w13_scale.reshape(4, 1, 1) * 2.0 ** -10
        assert bool(((w13 - ref13).abs() <= bound * (1 + 1e-6)).all())


def _nvfp4(t):
    a = []
    for p in ("gate_proj", "up_proj", "down_proj"):
        a += [_stack(t, p, "weight"), _stack(t, p, "weight_scale"), _stack(t, p, "weight_scale_2")]
    act = convert_fp8.layer_input_scale(_stack(t, "gate_proj", "input_scale"), _stack(t, "up_proj", "input_scale"))
    return convert_fp4.modelopt_nvfp4(*a, act, _stack(t, "down_proj", "input_scale"))


def test_nvfp4_nibble_order_is_low_first():
    packed = torch.tensor([[0x21, 0xF9]], dtype=torch.uint8)
    assert convert_fp4.unpack_e2m1_pairs(packed).tolist() == [[1, 2, 9, 15]]  # 0.5, 1.0, -0.5, -6.0


@pytest.mark.parametrize("pow2", [False, True])
def test_nvfp4_codes_and_scales_are_the_checkpoints(pow2):
    t = synth.tensors("modelopt_nvfp4", agree=True, pow2=pow2, seed=2)
    pack, report = _nvfp4(t)
    assert report.exact and report.reciprocal_scales == 3 * 4 + 1
    ref13, ref2 = synth.dequantized(t, "modelopt_nvfp4")
    expect_codes = torch.stack([torch.stack((b & 15, b >> 4), -1).reshape(b.shape[0], -1)
                                for b in _stack(t, "gate_proj", "weight")])
    assert torch.equal(pack.w13_q[:, :128], expect_codes)
    assert torch.equal(_bytes(pack.w13_scale[:, 128:]), _bytes(_stack(t, "up_proj", "weight_scale")))
    assert torch.equal(_bytes(pack.w2_scale), _bytes(_stack(t, "down_proj", "weight_scale")))
    # g = 1 / weight_scale_2 is recovered exactly where fp32 allows; the dequantized values are then the
    # checkpoint's to one fp32 rounding (q * s / g against q * s * weight_scale_2), bit for bit for 2^k scales.
    largest = max(float(t[f"{STEM}.{x}.{p}.input_scale"]) for x in range(4) for p in ("gate_proj", "up_proj"))
    scales_2 = torch.cat([_stack(t, p, "weight_scale_2") for p in ("gate_proj", "down_proj")])
    back = torch.reciprocal(torch.cat((pack.w13_global_scale, pack.w2_global_scale)))
    assert int((back == scales_2).sum()) + int(torch.reciprocal(pack.act_scale) == largest) + int(
        (torch.reciprocal(pack.fc2_act_scale) == _stack(t, "down_proj", "input_scale")).sum()) \
        == report.reciprocal_roundtrips
    w13, w2 = dequantize_weights(pack)
    if pow2:
        assert torch.equal(w13, ref13) and torch.equal(w2, ref2) and report.reciprocal_roundtrips >= 8
    else:
        for got, ref in ((w13, ref13), (w2, ref2)):
            ulp = torch.finfo(torch.float32).eps * ref.abs()
            assert bool(((got - ref).abs() <= ulp).all())
    assert torch.equal(pack.act_scale, torch.reciprocal(torch.tensor([largest])))


def test_nvfp4_disagreeing_global_scales_rescale_block_scales():
    t = synth.tensors("modelopt_nvfp4", agree=False, seed=4)
    pack, report = _nvfp4(t)
    gs2, us2 = _stack(t, "gate_proj", "weight_scale_2"), _stack(t, "up_proj", "weight_scale_2")
    assert not report.exact and report.changed > 0
    # the half with the larger weight_scale_2 keeps its block scales byte for byte
    for x in range(4):
        keep = slice(0, 128) if gs2[x] >= us2[x] else slice(128, 256)
        src = "gate_proj" if gs2[x] >= us2[x] else "up_proj"
        assert torch.equal(_bytes(pack.w13_scale[x, keep]), _bytes(t[f"{STEM}.{x}.{src}.weight_scale"]))
        assert float(torch.reciprocal(pack.w13_global_scale[x])) == pytest.approx(float(max(gs2[x], us2[x])),
                                                                                   rel=1e-7)


@pytest.mark.parametrize("fmt", convert_fp4.GPT_OSS_FORMATS)
def test_gpt_oss_deinterleaves_gate_up_and_keeps_the_values(fmt):
    t = synth.tensors("gpt_oss_mxfp4", seed=5)
    pack, report, extras = convert_fp4.gpt_oss_mxfp4(
        t[f"{STEM}.gate_up_proj_blocks"], t[f"{STEM}.gate_up_proj_scales"], t[f"{STEM}.down_proj_blocks"],
        t[f"{STEM}.down_proj_scales"], t[f"{STEM}.gate_up_proj_bias"], t[f"{STEM}.down_proj_bias"], fmt=fmt)
    ref13, ref2, bias13, bias2 = synth.dequantized(t, "gpt_oss_mxfp4")
    w13, w2 = dequantize_weights(pack)
    assert report.exact and torch.equal(w13, ref13) and torch.equal(w2, ref2)
    assert torch.equal(extras.gate_up_bias, bias13) and torch.equal(extras.down_bias, bias2)
    assert (extras.alpha, extras.limit) == (1.702, 7.0)


def test_nvfp4_as_w4a8_nvfp4_keeps_the_same_weights():
    t = synth.tensors("modelopt_nvfp4", agree=True, seed=6)
    ref, _ = _nvfp4(t)
    a = []
    for p in ("gate_proj", "up_proj", "down_proj"):
        a += [_stack(t, p, "weight"), _stack(t, p, "weight_scale"), _stack(t, p, "weight_scale_2")]
    pack, report = convert_fp4.modelopt_nvfp4(*a, None, None, fmt="w4a8_nvfp4")
    assert pack.fmt == "w4a8_nvfp4" and report.exact and pack.act_scale is None and pack.fc2_act_scale is None
    for name in ("w13_q", "w2_q", "w13_scale", "w2_scale", "w13_global_scale", "w2_global_scale"):
        assert torch.equal(_bytes(getattr(pack, name)), _bytes(getattr(ref, name))), name
    assert any("per token" in n for n in report.notes)


def test_gpt_oss_into_w4a8_mxfp4_counts_what_the_scale_window_moves():
    t = synth.tensors("gpt_oss_mxfp4", seed=12)
    scales = t[f"{STEM}.gate_up_proj_scales"].clone()
    scales[1, 5, 2] = 100  # expert 1: one block 20 binades below the rest (120..124): outside the kernel's 11
    args = (t[f"{STEM}.gate_up_proj_blocks"], scales, t[f"{STEM}.down_proj_blocks"], t[f"{STEM}.down_proj_scales"])
    assert convert_fp4.gpt_oss_mxfp4(*args, fmt="mxfp8")[1].exact  # mxfp8 has no window: held as it is
    pack, report, _ = convert_fp4.gpt_oss_mxfp4(*args, fmt="w4a8_mxfp4")
    t[f"{STEM}.gate_up_proj_scales"] = scales
    ref13, ref2, _, _ = synth.dequantized(t, "gpt_oss_mxfp4")
    w13, w2 = dequantize_weights(pack)
    assert torch.equal(w2, ref2) and not report.exact and report.rescaled_blocks == 1
    diff = w13 != ref13
    assert report.changed == int(diff.sum()) > 0
    # only the raised block's 32 values can move: expert 1, interleaved row 5 = up row 2 (canonical 128 + 2)
    assert not diff[0].any() and not diff[2:].any() and diff[1].nonzero()[:, 0].unique().tolist() == [130]
    assert set(diff[1, 130].nonzero()[:, 0].tolist()) <= set(range(64, 96))
    assert int(pack.w13_scale[1].view(torch.uint8).min()) >= 124 - 11


def test_bf16_per_expert_and_fused_are_copies():
    t = synth.tensors("mixtral_bf16")
    stem = "model.layers.1.block_sparse_moe.experts"
    w13, w2 = convert_bf16.per_expert_bf16(_stack(t, "w1", "weight", stem=stem), _stack(t, "w3", "weight", stem=stem),
                                           _stack(t, "w2", "weight", stem=stem))
    ref13, ref2 = synth.dequantized(t, "mixtral_bf16")
    assert torch.equal(w13.float(), ref13) and torch.equal(w2.float(), ref2)
    t = synth.tensors("hf_fused_bf16")
    w13, w2 = convert_bf16.fused_bf16(t[f"{STEM}.gate_up_proj"], t[f"{STEM}.down_proj"])
    assert w13 is not t[f"{STEM}.gate_up_proj"] and torch.equal(w13, t[f"{STEM}.gate_up_proj"])


def test_reciprocal_scale_counts_the_round_trips():
    s = torch.exp2(torch.empty(4096).uniform_(-20, 5, generator=torch.Generator().manual_seed(0)))
    g, hits = convert_fp4.reciprocal_scale(s)
    assert torch.equal(g, torch.reciprocal(s))
    assert hits == int((torch.reciprocal(g) == s).sum()) and 0.5 * s.numel() < hits < s.numel()
    g, hits = convert_fp4.reciprocal_scale(torch.exp2(torch.arange(-20.0, 5.0)))
    assert hits == 25


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
