"""The W4A8 formats (w4a8_mxfp4, w4a8_nvfp4): their codecs against hand-worked cases, the kernel's scale window,
the operands the SM90 kernel multiplies, and the reference FFN against an independent re-derivation."""

import sys

import pytest
import torch

from moe_ep.formats import codecs, packs
from moe_ep.reference import ffn


def _e8m0(codes):
    return torch.tensor(codes, dtype=torch.uint8).view(torch.float8_e8m0fnu)


# ------------------------------------------------------------------------------------------------- mxfp4
def test_mxfp4_scale_is_the_power_of_two_that_fits_the_block_at_or_below_six():
    w = torch.zeros(1, 2, 64)
    w[0, 0, :32] = torch.linspace(-6.0, 6.0, 32)  # amax 6 -> 2^0, code 127, nothing saturates
    w[0, 0, 32:] = 0.5
    w[0, 0, 33] = 6.5                              # amax 6.5 -> 2^1 (code 128): 6.5 / 2 = 3.25 -> 3
    w[0, 1, :32] = 0.0                             # all zero -> the floor of the expert's window
    w[0, 1, 32:] = 1.5 * 2.0 ** -3                 # amax 0.1875 = 6 * 2^-5 -> code 122
    q, s = codecs.mxfp4_quantize(w)
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (1, 2, 2)
    assert s.view(torch.uint8).tolist() == [[[127, 128], [117, 122]]]  # the zero block (code 0) raised to 128 - 11
    back = codecs.mxfp4_dequantize(q, s)
    assert back[0, 0, 0].item() == -6.0 and back[0, 0, 31].item() == 6.0
    assert back[0, 0, 33].item() == 6.0 and back[0, 0, 32].item() == 0.0  # 0.5 / 2 = 0.25 ties to even: 0
    assert torch.equal(back[0, 1, :32], torch.zeros(32)) and torch.equal(back[0, 1, 32:], w[0, 1, 32:])


def test_mxfp4_scales_stay_within_the_kernels_window_per_expert():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(2, 4, 128, generator=g)
    w[0, 0, :32] *= 2.0 ** 20       # one huge block in expert 0 drags the others up to max - 11
    w[0, 1, 32:64] *= 2.0 ** -30    # and one tiny block: its values round to zero
    q, s = codecs.mxfp4_quantize(w)
    code = s.view(torch.uint8).int()
    for e in range(2):
        span = int(code[e].max() - code[e].min())
        assert span <= codecs.MXFP4_MAX_SCALE_RANGE
    assert int(code[0].max() - code[0].min()) == codecs.MXFP4_MAX_SCALE_RANGE
    assert int(code[1].max() - code[1].min()) < 5  # an ordinary expert keeps its own scales
    assert torch.equal(codecs.mxfp4_dequantize(q, s)[0, 1, 32:64], torch.zeros(32))


def test_limit_scale_range_rewrites_the_raised_blocks_by_the_rule():
    codes = torch.arange(16, dtype=torch.uint8).repeat(2).reshape(1, 1, 32)  # every code twice
    codes = torch.cat([codes, codes], dim=2)
    scale = _e8m0([[[140, 140 - 12]]])  # the second block is one binade below the window
    new_codes, new_scale = codecs.mxfp4_limit_scale_range(codes, scale)
    assert new_scale.view(torch.uint8).tolist() == [[[140, 129]]]
    assert torch.equal(new_codes[..., :32], codes[..., :32])  # untouched block, untouched codes
    vals = codecs.e2m1_decode(new_codes[0, 0, 32:48])
    # value / 2, nearest, ties away from zero: 0.5 -> 0.5 (0.25 ties up), 1.5 -> 1.0 (0.75 ties up), 3 -> 1.5
    want = [0.0, 0.5, 0.5, 1.0, 1.0, 1.5, 2.0, 3.0]
    assert vals[:8].tolist() == want and vals[8:].tolist() == [-v for v in want]
    assert not bool((new_codes[..., 32:] == 8).any())  # a rewritten block holds no -0 code
    # Within range: identity, the very same tensors.
    q, s = codecs.mxfp4_quantize(torch.randn(2, 8, 64))
    same_q, same_s = codecs.mxfp4_limit_scale_range(q, s)
    assert same_q is q and same_s is s


def test_limit_scale_range_far_below_the_window_is_zero():
    codes = torch.full((1, 1, 32), 7, dtype=torch.uint8)  # 6.0 everywhere
    codes = torch.cat([codes, codes], dim=2)
    new_codes, _ = codecs.mxfp4_limit_scale_range(codes, _e8m0([[[200, 100]]]))
    assert torch.equal(new_codes[..., 32:], torch.zeros(1, 1, 32, dtype=torch.uint8))


def test_kernel_operand_is_exact_e4m3_and_times_residual_is_the_weight():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(3, 64, 256, generator=g) * torch.logspace(-6, 6, 256).reshape(1, 1, 256)
    q, s = codecs.mxfp4_quantize(w)
    for e in range(3):
        op, res = codecs.mxfp4_kernel_operand(q[e], s[e])
        assert torch.equal(codecs.to_e4m3(op).float(), op)  # every operand is an e4m3 value
        assert torch.equal(op * res, codecs.mxfp4_dequantize(q[e], s[e]))
        # The conversion's window: value * 2^(offset - 6), offset 1..12, so |operand| in [2^-6, 6 * 2^6].
        nz = op[op != 0].abs()
        assert float(nz.min()) >= 2.0 ** -6 and float(nz.max()) <= 6 * 2.0 ** 6
        assert float(torch.log2(res)) == int(s[e].view(torch.uint8).min()) - 122


def test_w4a8_nvfp4_weights_are_nvfp4_weights():
    g = torch.Generator().manual_seed(5)
    w13, w2 = torch.randn(2, 64, 128, generator=g), torch.randn(2, 128, 32, generator=g)
    a = packs.quantize_weights("w4a8_nvfp4", w13, w2)
    b = packs.quantize_weights("nvfp4", w13, w2, act_amax=1.0, fc2_act_amax=1.0)
    for name in ("w13_q", "w2_q", "w13_scale", "w2_scale", "w13_global_scale", "w2_global_scale"):
        assert torch.equal(getattr(a, name).view(torch.uint8), getattr(b, name).view(torch.uint8)), name
    assert a.act_scale is None and a.fc2_act_scale is None  # dynamic per-token activations, no calibration


def test_w4a8_nvfp4_operand_rounds_q_times_sf_over_8_to_e4m3():
    codes = torch.tensor([[7, 5, 3, 15] + [0] * 12], dtype=torch.uint8)  # 6, 3, 1.5, -6
    sf = torch.tensor([[2.75]]).to(torch.float8_e4m3fn)
    op, res = codecs.w4a8_nvfp4_kernel_operand(codes, sf, torch.tensor(4.0))
    # 6 * 2.75 / 8 = 2.0625 -> 2.0, 3 * 2.75 / 8 = 1.03125 -> 1.0, 1.5 * 2.75 / 8 = 0.515625 -> 0.5
    assert op[0, :4].tolist() == [2.0, 1.0, 0.5, -2.0]
    assert res.item() == 2.0  # 8 / g


# ------------------------------------------------------------------------------------- activations, FFN
def test_activations_get_one_scale_per_token():
    x = torch.zeros(3, 256)
    x[0, 7] = 896.0   # scale 2
    x[1] = 0.25       # scale 0.25 / 448
    qw = packs.quantize_weights("w4a8_mxfp4", torch.randn(1, 128, 256), torch.randn(1, 256, 64))
    act = packs.quantize_input(qw, x.bfloat16())
    assert act.scale.shape == (3, 1) and act.scale.dtype == torch.float32
    assert act.scale[0, 0].item() == 2.0 and act.q[0, 7].float().item() == 448.0
    assert act.scale[2, 0].item() == torch.tensor(codecs.FP8_BLOCK_EPS, dtype=torch.float32).item()
    torch.testing.assert_close(packs.dequantize_input(qw, act), x, rtol=2 ** -4, atol=0)


def test_fc2_input_tiny_amax_branch():
    y = torch.zeros(2, 64)
    y[0, 3] = 1e-31    # positive amax below 448e-30: quant = 448 / amax, scale = 1 / quant
    y[1, 5] = 1.0      # the ordinary path: scale = amax / 448, q = y * (1 / scale)
    q, s = codecs.fp8_quantize_rows(y, 64, reciprocal=True, tiny_safe=True)
    assert q[0, 3].float().item() == 448.0 and q[1, 5].float().item() == 448.0
    quant = torch.tensor(448.0) / torch.tensor(1e-31)
    assert s[0, 0].item() == torch.reciprocal(quant).item()
    q_plain, s_plain = codecs.fp8_quantize_rows(y, 64, reciprocal=True)
    # Without the branch: on the 1e-30 floor, 1e-31 / 1e-30 = 0.1 rounds to e4m3 0.1015625.
    assert q_plain[0, 3].float().item() == 0.1015625 and s_plain[0, 0].item() == s.new_tensor(1e-30).item()
    assert torch.equal(q_plain[1], q[1]) and s_plain[1, 0] == s[1, 0]


@pytest.mark.parametrize("fmt", ["w4a8_mxfp4", "w4a8_nvfp4"])
def test_expert_ffn_is_the_kernel_chain(fmt):
    """Independent re-derivation: dequantized weights (exact), FC1 over full K times the token scale, SwiGLU,
    routing weight, FC2 input 1x64 with reciprocal scales, FC2 over 64-blocks. The only difference allowed is
    where fp32 rounds (the reference sums raw e4m3 products first), so the two agree to a few ulp."""
    g = torch.Generator().manual_seed(6)
    h, i = 256, 128
    w13 = (torch.randn(1, 2 * i, h, generator=g) * h ** -0.5).bfloat16()
    w2 = (torch.randn(1, h, i, generator=g) * i ** -0.5).bfloat16()
    qw = packs.quantize_weights(fmt, w13, w2)
    x = torch.randn(5, h, generator=g).bfloat16()
    tw = torch.rand(5, generator=g)
    act = packs.quantize_input(qw, x)
    got = ffn.expert_ffn(qw, 0, act, tw)

    if fmt == "w4a8_mxfp4":
        d13, d2 = qw.dequantize()
    else:  # the kernel's e4m3(q * sf / 8) weights, times 8 / g
        d13 = codecs.to_e4m3(codecs.nvfp4_dequantize_raw(qw.w13_q, qw.w13_scale) / 8).float() * (
            8 / qw.w13_global_scale.reshape(-1, 1, 1))
        d2 = codecs.to_e4m3(codecs.nvfp4_dequantize_raw(qw.w2_q, qw.w2_scale) / 8).float() * (
            8 / qw.w2_global_scale.reshape(-1, 1, 1))
    fc1 = (act.q.double() * act.scale.double()) @ d13[0].double().t()
    gate, up = fc1[:, :i], fc1[:, i:]
    y = (up * gate * torch.sigmoid(gate) * tw.double().unsqueeze(1)).float()
    q, s = codecs.fp8_quantize_rows(y, 64, reciprocal=True, tiny_safe=True)
    want = (q.double() * s.double().repeat_interleave(64, dim=1)) @ d2[0].double().t()
    err = float((got.double() - want).norm() / want.norm())
    assert err < 5e-3, err  # an FC2-input element may round the other way; nothing more
    other = ffn.expert_ffn(packs.quantize_weights("fp8_block", w13, w2), 0,
                           packs.quantize_input(packs.quantize_weights("fp8_block", w13, w2), x), tw)
    assert float((got - other).norm() / other.norm()) > 2e-2  # and it is not the FP8 chain


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
