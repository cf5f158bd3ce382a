"""moe_ep.reference.quant against hand-built cases with known answers and against invariants."""

import math
import sys

import pytest
import torch

from moe_ep.formats import QuantizedWeights
from moe_ep.formats import codecs, packs
from moe_ep.reference import ffn, oracle

ALL_E4M3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
FINITE_E4M3 = ALL_E4M3[~torch.isnan(ALL_E4M3.float())]


# ------------------------------------------------------------------------------------------------ e4m3
def test_e4m3_representable_values_round_trip_bit_exact():
    back = codecs.to_e4m3(FINITE_E4M3.float())
    assert torch.equal(back.view(torch.uint8), FINITE_E4M3.view(torch.uint8))


@pytest.mark.parametrize("x, want", [
    (1.0625, 1.0),      # tie between 1.0 (even) and 1.125 -> 1.0
    (1.1875, 1.25),     # tie between 1.125 (odd) and 1.25 -> 1.25
    (447.0, 448.0),
    (463.0, 448.0),     # above max: saturates (satfinite), never NaN
    (1e6, 448.0),
    (-1e6, -448.0),
    (2.0 ** -10, 0.0),  # half the smallest subnormal (2^-9) ties to even: 0
    (3 * 2.0 ** -10, 2.0 ** -8),  # 1.5 * 2^-9 ties to 2 * 2^-9
])
def test_e4m3_rounding_and_saturation(x, want):
    assert codecs.to_e4m3(torch.tensor([x])).float().item() == want


def test_e4m3_nan_stays_nan():
    assert math.isnan(codecs.to_e4m3(torch.tensor([float("nan")])).float().item())


# ------------------------------------------------------------------------------------------- fp8 block
def test_fp8_rows_known_scales():
    x = torch.zeros(2, 256)
    x[0, :128] = torch.linspace(-896.0, 896.0, 128)  # amax 896 -> scale 2.0
    x[0, 128:] = 0.0                                 # all-zero block -> floor scale, zero codes
    x[1, :128] = 1.0
    x[1, 5] = -448.0 / 4                             # amax 112 -> scale 0.25
    x[1, 128:] = 448.0 * 8                           # scale 8
    q, s = codecs.fp8_quantize_rows(x, 128)
    assert s.dtype == torch.float32 and s.shape == (2, 2)
    eps32 = torch.tensor(codecs.FP8_BLOCK_EPS, dtype=torch.float32).item()
    assert s.tolist() == [[2.0, eps32], [0.25, 8.0]]
    assert torch.equal(q[0, 128:].float(), torch.zeros(128))
    assert q[1, 5].float().item() == -448.0 and q[1, 0].float().item() == 4.0
    assert q[1, 200].float().item() == 448.0
    back = codecs.fp8_dequantize_rows(q, s, 128)
    assert back[1, 5].item() == -112.0 and back[1, 130].item() == 448.0 * 8


def test_fp8_rows_reciprocal_matches_division_for_power_of_two_scales():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 128, generator=g)
    x[:, 0] = 448.0 * 2.0 ** torch.arange(-4, 4).float()  # each row's amax is an exact power of two * 448
    qd, sd = codecs.fp8_quantize_rows(x, 64, reciprocal=False)
    qr, sr = codecs.fp8_quantize_rows(x, 64, reciprocal=True)
    assert torch.equal(sd[:, 0], sr[:, 0])
    assert torch.equal(qd[:, :64].view(torch.uint8), qr[:, :64].view(torch.uint8))


def test_fp8_rows_error_bound():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 512, generator=g) * torch.logspace(-3, 3, 64).unsqueeze(1)
    q, s = codecs.fp8_quantize_rows(x, 128)
    back = codecs.fp8_dequantize_rows(q, s, 128)
    scale = s.repeat_interleave(128, dim=1)
    # e4m3: relative half-ulp 2^-4 in the normal range, absolute 2^-10 * scale in the subnormal range
    assert torch.all((back - x).abs() <= torch.maximum(x.abs() * 2.0 ** -4, scale * 2.0 ** -10) * 1.0001)


def test_fp8_weight_blocks_are_independent():
    w = torch.ones(256, 256)
    for bn in range(2):
        for bk in range(2):
            w[bn * 128, bk * 128] = 448.0 * 2.0 ** (bn * 2 + bk)
    q, s = codecs.fp8_quantize_blocks_nk(w.unsqueeze(0))
    assert s.shape == (1, 2, 2)
    assert s[0].tolist() == [[1.0, 2.0], [4.0, 8.0]]
    back = codecs.fp8_dequantize_blocks_nk(q, s)[0]
    assert torch.equal(back, w)  # every value is representable at its block's scale


def test_gate_up_interleave_order_and_inverse():
    i, h = 16, 4
    w13 = torch.arange(2 * i, dtype=torch.float32).reshape(1, 2 * i, 1).expand(1, 2 * i, h).contiguous()
    inter = codecs.interleave_gate_up(w13)[0, :, 0].tolist()
    gate, up = list(range(0, i)), list(range(i, 2 * i))
    assert inter == gate[:8] + up[:8] + gate[8:] + up[8:]
    assert torch.equal(codecs.deinterleave_gate_up(codecs.interleave_gate_up(w13)), w13)


def test_w13_block_scale_covers_64_gate_and_64_up_rows():
    i, h = 128, 128
    w13 = torch.full((1, 2 * i, h), 0.5)
    w13[0, 3, 0] = 448.0 * 8      # gate row 3 -> scale block 0
    w13[0, i + 70, 0] = 448.0 * 2  # up row 70 -> scale block 1
    q, s = codecs.fp8_quantize_w13_blocks(w13)
    assert s.shape == (1, 2, 1)
    assert s[0, :, 0].tolist() == [8.0, 2.0]
    rows = codecs.w13_block_rows(i)
    assert rows[:64].eq(0).all() and rows[64:128].eq(1).all()
    assert rows[128:192].eq(0).all() and rows[192:].eq(1).all()
    # up row 10 shares gate row 3's block: 0.5 / 8 = 1/16 is representable, so it round-trips
    qw = QuantizedWeights("fp8_block", q, torch.zeros(1, h, i, dtype=torch.float8_e4m3fn), s,
                          torch.ones(1, 1, 1))
    w13_back, _ = packs.dequantize_weights(qw)
    assert torch.equal(w13_back, w13)


def test_fp8_block_mm_matches_dequantized_matmul():
    g = torch.Generator().manual_seed(2)
    a = torch.randn(5, 256, generator=g)
    b = torch.randn(128, 256, generator=g)
    aq, as_ = codecs.fp8_quantize_rows(a, 128)
    bq, bs = codecs.fp8_quantize_blocks_nk(b.unsqueeze(0))
    rows = torch.arange(128) // 128
    got = codecs.fp8_block_mm(aq, as_, 128, bq[0], bs[0], rows)
    want = codecs.fp8_dequantize_rows(aq, as_, 128) @ codecs.fp8_dequantize_blocks_nk(bq, bs)[0].t()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    # with a 64-wide activation grid (the FC2 input) the K segments are the union of both grids
    aq64, as64 = codecs.fp8_quantize_rows(a, 64)
    got64 = codecs.fp8_block_mm(aq64, as64, 64, bq[0], bs[0], rows)
    want64 = codecs.fp8_dequantize_rows(aq64, as64, 64) @ codecs.fp8_dequantize_blocks_nk(bq, bs)[0].t()
    torch.testing.assert_close(got64, want64, rtol=1e-5, atol=1e-4)


# ------------------------------------------------------------------------------------------ fp8 tensor
@pytest.mark.parametrize("amax, want", [(448.0 * 0.95, 1.0), (0.0, 1.0), (-3.0, 1.0), (1e-20, 1e-12),
                                        (2 * 448.0 * 0.95, 2.0)])
def test_fp8_tensor_scale_from_amax(amax, want):
    s = codecs.fp8_tensor_scale_from_amax(amax)
    assert s.dtype == torch.float32 and s.shape == (1,)
    assert s.item() == pytest.approx(want, rel=1e-7)


def test_fp8_static_quantization_saturates_and_keeps_nan():
    s = torch.tensor([0.5])
    q = codecs.fp8_quantize_static(torch.tensor([1.0, 300.0, -1e9, float("nan")]), s)
    vals = q.float().tolist()
    assert vals[:3] == [2.0, 448.0, -448.0] and math.isnan(vals[3])


def test_fp8_per_expert_scale():
    w = torch.ones(3, 4, 8)
    w[1] *= 2.0
    w[2, 0, 0] = 448.0 * 4
    q, s = codecs.fp8_quantize_per_expert(w)
    assert s.tolist() == pytest.approx([1.0 / 448.0, 2.0 / 448.0, 4.0], rel=1e-7)


# ----------------------------------------------------------------------------------------------- mxfp8
@pytest.mark.parametrize("amax, code", [(448.0, 127), (449.0, 128), (1.0, 119), (896.0, 128), (897.0, 129),
                                        (448.0 * 2.0 ** -130, 19)])  # amax floored at 1e-30 first
def test_mxfp8_scale_exponent(amax, code):
    x = torch.zeros(1, 32)
    x[0, 7] = amax
    q, s = codecs.mxfp8_quantize(x)
    assert s.dtype == torch.float8_e8m0fnu
    assert s.view(torch.uint8).item() == code


def test_mxfp8_scales_are_powers_of_two_and_bounded():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 256, generator=g) * torch.logspace(-6, 6, 16).unsqueeze(1)
    q, s = codecs.mxfp8_quantize(x)
    f = codecs.e8m0_to_float(s)
    assert torch.equal(torch.log2(f), torch.round(torch.log2(f)))
    back = codecs.mxfp8_dequantize(q, s)
    scale = f.repeat_interleave(32, dim=1)
    assert torch.all((back - x).abs() <= torch.maximum(x.abs() * 2.0 ** -4, scale * 2.0 ** -10) * 1.0001)
    # the block amax never lands above 448 after scaling: no saturation from the scale choice
    assert torch.all((x / scale).abs().reshape(16, 8, 32).amax(-1) <= 448.0)


def test_mxfp8_zero_and_nan_blocks():
    x = torch.ones(1, 96)
    x[0, :32] = 0.0
    x[0, 40] = float("nan")
    q, s = codecs.mxfp8_quantize(x)
    codes = s.view(torch.uint8)[0].tolist()
    assert codes[0] == 0 and codes[1] == 255
    back = codecs.mxfp8_dequantize(q, s)[0]
    assert torch.equal(back[:32], torch.zeros(32))
    assert torch.isnan(back[32:64]).all()     # a NaN poisons its own block...
    assert torch.equal(back[64:], torch.ones(32))  # ...and only that block


def test_mxfp8_representable_values_round_trip():
    vals = FINITE_E4M3.float()
    vals = vals[vals.abs() <= 448][:224].reshape(7, 32)
    vals[:, 0] = 448.0  # pin every block's scale to 1
    q, s = codecs.mxfp8_quantize(vals * 2.0 ** -5)
    assert torch.equal(codecs.mxfp8_dequantize(q, s), vals * 2.0 ** -5)


# ----------------------------------------------------------------------------------------------- nvfp4
@pytest.mark.parametrize("x, want", [
    (0.0, 0.0), (0.25, 0.0), (0.26, 0.5), (0.75, 1.0), (1.25, 1.0), (1.3, 1.5), (1.75, 2.0), (2.5, 2.0),
    (2.6, 3.0), (3.5, 4.0), (5.0, 4.0), (5.01, 6.0), (100.0, 6.0), (float("inf"), 6.0), (-0.75, -1.0),
    (-5.5, -6.0), (-0.1, -0.0),
])
def test_e2m1_round_to_nearest_even_saturating(x, want):
    got = codecs.e2m1_decode(codecs.e2m1_encode(torch.tensor([x]))).item()
    assert got == want and math.copysign(1, got) == math.copysign(1, want)


def test_e2m1_codes_round_trip():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = codecs.e2m1_decode(codes)
    assert vals[:8].tolist() == list(codecs.E2M1_VALUES)
    again = codecs.e2m1_encode(vals)
    assert torch.equal(again[1:], codes[1:])  # code 8 (-0) and 0 (+0) both decode to a zero
    assert again[0] == 0


def test_nvfp4_known_block():
    x = torch.tensor([[6.0, -3.0, 1.0, 0.5, 0.24, 0.0, 4.0, -6.0, 2.0, 1.5, 5.0, 3.5, 0.75, 1.25, -2.5, 0.3]])
    codes, sf = codecs.nvfp4_quantize(x, torch.tensor(1.0))
    assert sf.dtype == torch.float8_e4m3fn and sf.float().item() == 1.0  # amax 6 / 6 * g(=1)
    got = codecs.e2m1_decode(codes)[0].tolist()
    assert got == [6.0, -3.0, 1.0, 0.5, 0.0, 0.0, 4.0, -6.0, 2.0, 1.5, 4.0, 4.0, 1.0, 1.0, -2.0, 0.5]


def test_nvfp4_global_scale_and_zero_block():
    assert codecs.nvfp4_global_scale(torch.tensor(2688.0)).item() == 1.0
    assert codecs.nvfp4_global_scale(torch.tensor(0.0)).item() == 1.0
    x = torch.zeros(1, 32)
    x[0, 16:] = torch.linspace(-1, 1, 16)
    g = codecs.nvfp4_global_scale(x.abs().max())
    codes, sf = codecs.nvfp4_quantize(x, g)
    assert sf.float()[0, 0].item() == 0.0 and torch.equal(codes[0, :16], torch.zeros(16, dtype=torch.uint8))
    assert sf.float()[0, 1].item() == 448.0  # amax of the tensor maps to the largest e4m3 block scale
    back = codecs.nvfp4_dequantize(codes, sf, g)
    assert torch.equal(back[0, :16], torch.zeros(16))


def test_nvfp4_error_bound_and_nan_policy():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(32, 256, generator=g) * torch.logspace(-2, 2, 32).unsqueeze(1)
    gs = codecs.nvfp4_global_scale(x.abs().max())
    codes, sf = codecs.nvfp4_quantize(x, gs)
    back = codecs.nvfp4_dequantize(codes, sf, gs)
    step = sf.float().repeat_interleave(16, dim=1) / gs
    # half the widest e2m1 gap (4 -> 6) is 1 step; e4m3 rounding of the block scale can push the block's
    # largest value up to 6 * (1 + 2^-4): saturation adds at most that much again
    assert torch.all((back - x).abs() <= 1.5 * step + 1e-12)
    x[3, 17] = float("nan")
    codes, sf = codecs.nvfp4_quantize(x, gs)
    back = codecs.nvfp4_dequantize(codes, sf, gs)
    assert torch.isnan(back[3, 16:32]).all() and not torch.isnan(back[3, :16]).any()


# ---------------------------------------------------------------------------------------------- facades
def _weights(e=2, i=128, h=256, seed=5):
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(e, 2 * i, h, generator=g) * h ** -0.5).bfloat16(),
            (torch.randn(e, h, i, generator=g) * i ** -0.5).bfloat16())


@pytest.mark.parametrize("fmt", ["bf16", "fp8_block", "fp8_tensor", "mxfp8", "nvfp4", "w4a8_mxfp4", "w4a8_nvfp4"])
def test_weight_round_trip_within_format_error(fmt):
    w13, w2 = _weights()
    qw = packs.quantize_weights(fmt, w13, w2, act_amax=4.0, fc2_act_amax=1.0)
    assert qw.fmt == fmt and qw.w13_q.shape == w13.shape and qw.w2_q.shape == w2.shape
    a, b = qw.dequantize()
    for got, want in ((a, w13), (b, w2)):
        err = float((got - want.float()).norm() / want.float().norm())
        assert err <= oracle.WEIGHT_TOLERANCE[fmt]
        if fmt != "bf16":
            assert err > 1e-3  # it did quantize


@pytest.mark.parametrize("fmt", ["fp8_block", "fp8_tensor", "mxfp8", "nvfp4", "w4a8_mxfp4", "w4a8_nvfp4"])
def test_nan_in_input_is_never_silently_finite(fmt):
    w13, w2 = _weights()
    qw = packs.quantize_weights(fmt, w13, w2, act_amax=4.0, fc2_act_amax=1.0)
    x = torch.randn(3, 256).bfloat16()
    x[1, 9] = float("nan")
    back = packs.dequantize_input(qw, packs.quantize_input(qw, x))
    assert torch.isnan(back[1, 9])
    assert not torch.isnan(back[0]).any() and not torch.isnan(back[2]).any()


def test_swiglu_and_clamp():
    fc1 = torch.tensor([[3.0, -2.0, 0.5, 4.0, -9.0, 0.25]])  # gate | up, I = 3
    y = ffn.swiglu(fc1, None)
    g, u = fc1[:, :3], fc1[:, 3:]
    torch.testing.assert_close(y, u * g * torch.sigmoid(g), rtol=0, atol=0)
    yc = ffn.swiglu(fc1, 1.0)
    gc = torch.tensor([[1.0, -2.0, 0.5]])
    uc = torch.tensor([[1.0, -1.0, 0.25]])
    torch.testing.assert_close(yc, uc * gc * torch.sigmoid(gc), rtol=0, atol=0)


def test_expert_ffn_bf16_is_the_plain_math():
    w13, w2 = _weights(e=1)
    qw = packs.quantize_weights("bf16", w13, w2)
    x = torch.randn(4, 256).bfloat16()
    tw = torch.tensor([0.5, 1.0, 0.25, 2.0])
    got = ffn.expert_ffn(qw, 0, packs.quantize_input(qw, x), tw)
    h = x.float() @ w13[0].float().t()
    y = (torch.nn.functional.silu(h[:, :128]) * h[:, 128:] * tw.unsqueeze(1)).bfloat16().float()
    torch.testing.assert_close(got, y @ w2[0].float().t(), rtol=1e-5, atol=1e-5)
    unweighted = ffn.expert_ffn(qw, 0, packs.quantize_input(qw, x), tw, apply_topk_in_fc1=False)
    torch.testing.assert_close(unweighted * tw.unsqueeze(1), got, rtol=2e-2, atol=1e-3)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
