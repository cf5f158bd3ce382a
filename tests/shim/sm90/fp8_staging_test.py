"""Fused FP8 activation staging on the CPU: the fallback is the reference quantizer byte for byte; bad arguments
fail before anything runs; and the kernel's arithmetic, replayed op by op (`simulate_fused`), rounds exactly where
the reference does: the same bytes and scale bits on random data, exact e4m3 ties, the subnormal range, zeros of
both signs, the scale floor, inf and NaN. Mutations of that op order (approximate division, multiplying by 1/s,
rounding through fp16, the other scale op) are shown to change bytes on the same inputs, so an edit that
reorders the kernel's arithmetic and its simulation alike cannot pass unnoticed. The kernel itself against this
simulation and the reference runs on the GPU: fp8_staging_gpu_test and tools/diag/fp8_staging_check.py."""

import pytest
import torch

from moe_ep.formats import codecs
from shim.sm90 import fp8_staging as fs

ref = fs._ref  # moe_ep.formats.codecs: fp8_quantize_rows, to_e4m3
U8 = torch.uint8
FP8 = torch.float8_e4m3fn


def _random_x(t, h, seed=0):
    """Normal data, each 1x128 block at its own scale from 1e-6 to 1e4, as bf16."""
    g = torch.Generator().manual_seed(seed)
    nb = h // 128
    scale = torch.pow(10.0, torch.empty(t, nb, 1).uniform_(-6, 4, generator=g))
    return (torch.randn(t, nb, 128, generator=g) * scale).reshape(t, h).to(torch.bfloat16)


def _inputs():
    """Random data at several widths plus every edge-case row, at two block positions."""
    return [_random_x(97, 1024, 1), _random_x(5, 7168, 2), fs.edge_case_rows(128, 3), fs.edge_case_rows(2048, 4)]


def _bits(s):
    return s.contiguous().view(torch.int32)


def _same_scales(a, b):
    """Scale bits equal; a NaN scale only needs to be NaN on both sides: its payload is the platform's (torch's
    CPU amax returns a quiet NaN of its own, the bit-pattern max keeps the input's; the GPU check compares bits)."""
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    assert torch.equal(nan_a, nan_b)
    bad = (_bits(a) != _bits(b)) & ~nan_a
    assert not bad.any(), f"{int(bad.sum())} scale(s) differ, first at {bad.nonzero()[0].tolist()}"


def _same_bytes(a, b):
    bad = a.view(U8) != b.view(U8)
    assert not bad.any(), f"{int(bad.sum())} byte(s) differ, first at {bad.nonzero()[0].tolist()}"


def _cuda_reference(x):
    """The reference's op sequence as torch runs it on a CUDA device: `absmax / 448.0` there is absmax times
    fl32(1/448) (a Python-scalar divisor becomes a reciprocal multiply in BinaryDivTrueKernel.cu). Written with
    plain torch float ops, independent of the simulation's integer max and integer encoding."""
    t, h = x.shape
    blocks = x.to(torch.float32).reshape(t, h // 128, 128)
    absmax = blocks.abs().amax(dim=-1)
    scale = torch.clamp(absmax * (torch.tensor(1.0, dtype=torch.float32) / 448.0), min=1e-30)
    q = (blocks / scale.unsqueeze(-1)).clamp(-448.0, 448.0).to(FP8)
    return q.reshape(t, h), scale


# ----------------------------------------------------------------------------------------------- constants
def test_reciprocal_is_the_fp32_one_and_448_times_it_is_one():
    r = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(448.0, dtype=torch.float32)
    assert fs.RCP_E4M3_MAX == float(r)
    assert float(torch.tensor(448.0) * r) == 1.0  # so amax = 448 * 2^k gives s = 2^k under either scale op
    assert (fs.BLOCK_K, fs.E4M3_MAX, fs.SCALE_FLOOR) == (128, 448.0, 1e-30)


def test_unavailable_without_triton_or_cuda():
    try:
        import triton  # noqa: F401
        has_triton = True
    except ImportError:
        has_triton = False
    assert fs.available() == (has_triton and torch.cuda.is_available())
    if not fs.available():
        assert fs.unavailable_reason()


# -------------------------------------------------------------------------------------------- the fallback
@pytest.mark.parametrize("q_dtype", [FP8, U8])
@pytest.mark.parametrize("t, h", [(1, 128), (37, 384), (16, 2048)])
def test_fallback_writes_the_reference_bytes_and_nothing_else(q_dtype, t, h):
    x = _random_x(t, h, seed=t)
    nb = h // 128
    cap = t + 5
    q_out = torch.full((cap, h), 0xA5, dtype=U8).view(q_dtype)
    wide = torch.full((cap, 2 * (nb + 4)), -7.0)
    s_out = wide[:, ::2]                      # padded columns and a column stride of 2
    fs.stage_fp8_blocks(x, q_out, s_out)
    q, s = ref.fp8_quantize_rows(x, 128, reciprocal=False)
    _same_bytes(q_out[:t], q)
    assert torch.equal(_bits(s_out[:t, :nb]), _bits(s))
    assert (q_out[t:].view(U8) == 0xA5).all()
    assert (s_out[t:] == -7.0).all() and (s_out[:, nb:] == -7.0).all() and (wide[:, 1::2] == -7.0).all()


def test_fallback_on_edge_rows_and_explicit_torch_backend():
    x = fs.edge_case_rows(512)
    q_out = torch.zeros(x.shape, dtype=FP8)
    s_out = torch.zeros(x.shape[0], 4)
    fs.stage_fp8_blocks(x, q_out, s_out, backend="torch")
    q, s = ref.fp8_quantize_rows(x, 128)
    _same_bytes(q_out, q)
    assert torch.equal(_bits(s_out), _bits(s))  # same function, same platform: NaN payloads included


def test_zero_rows_write_nothing():
    q_out = torch.full((4, 256), 3, dtype=U8)
    s_out = torch.full((4, 2), 5.0)
    fs.stage_fp8_blocks(torch.empty(0, 256, dtype=torch.bfloat16), q_out, s_out)
    assert (q_out == 3).all() and (s_out == 5.0).all()


def _bad_cases():
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    q = torch.zeros(4, 256, dtype=FP8)
    s = torch.zeros(4, 2)
    return [
        ("x fp32", (x.float(), q, s), TypeError, "bfloat16"),
        ("x 1-D", (x.reshape(-1), q, s), ValueError, "2-D"),
        ("x 3-D", (x.reshape(2, 2, 256), q, s), ValueError, "2-D"),
        ("H not a multiple of 128", (torch.zeros(4, 200, dtype=torch.bfloat16), torch.zeros(4, 200, dtype=FP8), s),
         ValueError, "multiple of 128"),
        ("x column stride", (torch.zeros(256, 4, dtype=torch.bfloat16).t(), q, s), ValueError, "contiguous"),
        ("q fp16", (x, torch.zeros(4, 256, dtype=torch.float16), s), TypeError, "float8_e4m3fn"),
        ("q int8", (x, torch.zeros(4, 256, dtype=torch.int8), s), TypeError, "float8_e4m3fn"),
        ("q too few rows", (x, torch.zeros(3, 256, dtype=FP8), s), ValueError, "q_out"),
        ("q other width", (x, torch.zeros(4, 384, dtype=FP8), s), ValueError, "q_out"),
        ("q column stride", (x, torch.zeros(256, 4, dtype=U8).t(), s), ValueError, "contiguous"),
        ("s bf16", (x, q, s.bfloat16()), TypeError, "float32"),
        ("s too few rows", (x, q, torch.zeros(3, 2)), ValueError, "s_out"),
        ("s too few columns", (x, q, torch.zeros(4, 1)), ValueError, "s_out"),
        ("s 1-D", (x, q, torch.zeros(8)), ValueError, "s_out"),
        ("not a tensor", ([[0.0]], q, s), TypeError, "torch tensors"),
        ("devices differ", (x, q.to("meta"), s), ValueError, "one device"),
    ]


@pytest.mark.parametrize("name, args, exc, words", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_bad_arguments_fail_before_anything_runs(name, args, exc, words):
    with pytest.raises(exc, match=words):
        fs.stage_fp8_blocks(*args)


def test_backend_choice_is_checked():
    x = torch.zeros(2, 128, dtype=torch.bfloat16)
    q, s = torch.zeros(2, 128, dtype=FP8), torch.zeros(2, 1)
    with pytest.raises(ValueError, match="backend"):
        fs.stage_fp8_blocks(x, q, s, backend="cuda")
    # CPU tensors: the fused kernel is refused, for want of Triton/CUDA or because the tensors are on the CPU
    with pytest.raises((RuntimeError, ValueError), match="unavailable|CUDA"):
        fs.stage_fp8_blocks(x, q, s, backend="triton")
    with pytest.raises(ValueError, match="CUDA"):
        fs.launch_fused(x, q, s)


# ------------------------------------------------------------------------------- the kernel's arithmetic
def test_simulation_is_the_reference_on_every_device():
    """moe_ep's format spells the scale as amax * fl32(1/448) on every device (moe_ep/formats/codecs.py), which is
    what torch computes on CUDA: the kernel's arithmetic (simulated) gives the reference's bytes and scales."""
    for x in _inputs():
        q, s = fs.simulate_fused(x, scale_by_reciprocal=True)
        rq, rs = ref.fp8_quantize_rows(x, 128, reciprocal=False)
        _same_bytes(q, rq)
        _same_scales(s, rs)


def test_simulation_with_the_reciprocal_scale_is_the_reference_as_cuda_runs_it():
    for x in _inputs():
        q, s = fs.simulate_fused(x, scale_by_reciprocal=True)
        rq, rs = _cuda_reference(x)
        _same_bytes(q, rq)
        _same_scales(s, rs)


def test_the_two_scale_ops_really_differ():
    """Why the kernel has to pick the device's scale op: fl32(a * fl32(1/448)) != fl32(a / 448) for about half of
    all finite bf16 amax values, and the bytes follow."""
    a = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    by_div = torch.clamp(a / 448.0, min=1e-30)
    by_rcp = torch.clamp(a * (torch.tensor(1.0) / 448.0), min=1e-30)
    assert int((by_div != by_rcp).sum()) == 15543  # of 32640 (the module docstring quotes this)
    x = _random_x(97, 1024, 1)
    assert (fs.simulate_fused(x, scale_by_reciprocal=True)[0] != fs.simulate_fused(x, scale_by_reciprocal=False)[0]
            ).any()


def _tie_rows(h=1024, seed=11):
    """Blocks with amax = 448 * 2^k and every other element 2^k times a midpoint between adjacent e4m3 values
    (both signs), so x / s is exactly a tie under either scale op."""
    g = torch.Generator().manual_seed(seed)
    vals = fs._e4m3_values()
    mids = (vals[:-1] + vals[1:]) / 2
    rows = []
    for _ in range(8):
        blocks = []
        for _ in range(h // 128):
            k = int(torch.randint(-30, 30, (1,), generator=g))
            sign = torch.where(torch.rand(127, generator=g) < 0.5, -1.0, 1.0)
            body = torch.cat([torch.tensor([448.0]), torch.cat([mids, mids[:1]]) * sign])
            blocks.append((body * 2.0 ** k)[torch.randperm(128, generator=g)])
        rows.append(torch.cat(blocks))
    x = torch.stack(rows)
    assert torch.equal(x.to(torch.bfloat16).float(), x)  # every value exact in bf16
    return x.to(torch.bfloat16)


def test_exact_ties_round_to_even_and_match_the_reference_under_both_scale_ops():
    x = _tie_rows()
    t, h = x.shape
    rq, rs = ref.fp8_quantize_rows(x, 128, reciprocal=False)
    # the ties are real: each block's scale is a power of two and x / s is a midpoint
    assert torch.equal(torch.frexp(rs)[0], torch.full_like(rs, 0.5))
    y = x.float().reshape(t, h // 128, 128) / rs.unsqueeze(-1)
    mids = set(((fs._e4m3_values()[:-1] + fs._e4m3_values()[1:]) / 2).tolist())
    on_tie = torch.tensor([abs(v) in mids for v in y.reshape(-1).tolist()]).reshape(t, h)
    assert int(on_tie.sum()) == t * (h // 128) * 127
    codes = rq.view(U8)
    assert not (codes[on_tie] & 1).any()  # ties went to the even code
    for rcp in (True, False):
        q, s = fs.simulate_fused(x, scale_by_reciprocal=rcp)
        _same_bytes(q, rq)
        assert torch.equal(_bits(s), _bits(rs))


def test_encoding_is_the_reference_cast_on_every_rounding_case():
    """encode_e4m3_bits against the reference's to_e4m3 (clamp to +-448, then torch's RNE cast) on: every sign x
    exponent x kept-mantissa with the dropped 20 bits at 0, 1, just under / at / just over the half (ties), and
    all ones; every bf16 pattern; a million random fp32 patterns."""
    sign = torch.tensor([0, 1], dtype=torch.int64).reshape(2, 1, 1, 1) << 31
    exp = torch.arange(256, dtype=torch.int64).reshape(1, 256, 1, 1) << 23
    keep = torch.arange(8, dtype=torch.int64).reshape(1, 1, 8, 1) << 20
    low = torch.tensor([0, 1, 0x40000, 0x7FFFF, 0x80000, 0x80001, 0xC0000, 0xFFFFF], dtype=torch.int64)
    structured = (sign | exp | keep | low.reshape(1, 1, 1, 8)).reshape(-1)
    bf16 = torch.arange(1 << 16, dtype=torch.int64) << 16
    rand = torch.randint(0, 1 << 32, (1 << 20,), generator=torch.Generator().manual_seed(5), dtype=torch.int64)
    for pat in (structured, bf16, rand):
        y = (pat - ((pat >> 31) << 32)).to(torch.int32).view(torch.float32)  # uint32 patterns as fp32
        _same_bytes(fs.encode_e4m3_bits(y), ref.to_e4m3(y))


def test_edge_rows_cover_every_kind_at_every_block_position():
    x = fs.edge_case_rows(16 * 128)
    assert x.shape == (16, 2048) and x.dtype == torch.bfloat16
    f = x.float().reshape(16, 16, 128)
    assert torch.isnan(f).any(dim=-1).sum() == 2 * 16       # two NaN kinds, once per block position
    assert torch.isinf(f).any(dim=-1).sum() == 3 * 16       # +inf, +-inf, NaN+inf
    assert ((f == 0).all(dim=-1)).sum() == 2 * 16           # +0 and -0 blocks
    assert torch.signbit(f[(f == 0).all(dim=-1)]).any()     # the -0 block really is -0
    again = fs.edge_case_rows(256, seed=1).view(torch.int16)
    assert torch.equal(fs.edge_case_rows(256, seed=1).view(torch.int16), again)  # deterministic


# --------------------------------------------------------------------------- the tests have teeth
def _mutant(x, how):
    """The simulation with one step changed: what a plausible wrong kernel computes."""
    t, h = x.shape
    xb = x.float().reshape(t, h // 128, 128)
    _, s = fs.simulate_fused(x, scale_by_reciprocal=True)
    if how == "scale_by_ieee_division":
        _, s = fs.simulate_fused(x, scale_by_reciprocal=False)
        y = xb / s.unsqueeze(-1)
    elif how == "multiply_by_inverse_scale":
        y = xb * (1.0 / s).unsqueeze(-1)
    elif how == "approximate_division":      # div.full.f32-like: off by an ulp now and then
        y = (xb.double() / s.double().unsqueeze(-1)).float()
        y = torch.where(torch.arange(y.numel()).reshape(y.shape) % 7 == 0, torch.nextafter(y, y * 2), y)
    elif how == "fp16_double_rounding":
        y = (xb / s.unsqueeze(-1)).to(torch.float16).float()
    elif how == "truncating_encode":
        y = xb / s.unsqueeze(-1)
        bits = y.view(torch.int32)
        y = (bits & ~((1 << 20) - 1)).view(torch.float32)  # round toward zero, then the (now exact) encode
    else:
        raise AssertionError(how)
    return fs.encode_e4m3_bits(y.reshape(t, h))


@pytest.mark.parametrize("how", ["scale_by_ieee_division", "multiply_by_inverse_scale", "approximate_division",
                                 "fp16_double_rounding", "truncating_encode"])
def test_a_changed_op_order_changes_bytes_on_these_inputs(how):
    bad = 0
    for x in _inputs() + [_tie_rows()]:
        rq, _ = ref.fp8_quantize_rows(x, 128, reciprocal=False)
        bad += int((_mutant(x, how) != rq.view(U8)).sum())
    assert bad > 0, f"inputs too weak: the {how} mutant agrees with the reference everywhere"


# ----------------------------------------------------------------- one scale per row (the W4A8 FC1 input)
def test_row_staging_simulation_is_the_reference_on_edge_rows():
    """The per-row kernel's arithmetic (simulate_fused_rows) gives the format quantizer's bytes and scales, on
    rows of every edge kind (ties, subnormals, zeros, infinities, NaN) and on ordinary rows."""
    g = torch.Generator().manual_seed(3)
    for x in (fs.edge_case_rows(7168, seed=1), fs.edge_case_rows(512, seed=2),
              (torch.randn(33, 2048, generator=g) * torch.logspace(-30, 4, 33).unsqueeze(1)).bfloat16()):
        q, s = fs.simulate_fused_rows(x)
        rq, rs = codecs.fp8_quantize_rows(x, x.shape[1], reciprocal=False)
        assert torch.equal(q, rq.view(torch.uint8))
        nan = torch.isnan(s)  # a NaN row: both NaN (the payload bits may differ; the codes above do not)
        assert torch.equal(nan, torch.isnan(rs[:, 0]))
        assert torch.equal(s[~nan].view(torch.int32), rs[:, 0][~nan].view(torch.int32))


def test_row_staging_fallback_writes_the_replicated_scale_row():
    x = (torch.randn(5, 512) * 3).bfloat16()
    q = torch.full((8, 512), 0x55, dtype=torch.uint8)
    s = torch.full((8, 4), -1.0)
    fs.stage_fp8_rows_reference(x, q, s)
    rq, rs = codecs.fp8_quantize_rows(x, 512)
    assert torch.equal(q[:5], rq.view(torch.uint8)) and bool((q[5:] == 0x55).all())
    assert torch.equal(s[:5], rs.expand(5, 4)) and bool((s[5:] == -1).all())
    with pytest.raises(ValueError, match="CUDA"):
        fs.launch_fused_rows(x, q, s)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
