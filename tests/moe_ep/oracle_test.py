"""The single-process oracle against an independent, token-by-token MoE, and compare()'s verdicts."""

import sys

import pytest
import torch

from moe_ep.formats import packs
from moe_ep.reference import ffn, oracle

H, I, E, K, T = 128, 128, 6, 3, 9


def _problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * H ** -0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) * I ** -0.5).bfloat16()
    x = torch.randn(T, H, generator=g).bfloat16()
    idx = torch.rand(T, E, generator=g).argsort(1)[:, :K].contiguous()
    w = torch.softmax(torch.randn(T, K, generator=g), 1)
    return w13, w2, x, idx, w


def _naive(w13, w2, x, idx, w, clamp=None):
    """Straight from the definition: out[t] = sum_k w[t,k] * W2_e (silu(g) * u), (g, u) = W13_e x[t]."""
    out = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            e = int(idx[t, k])
            h = w13[e].double() @ x[t].double()
            g, u = h[:I], h[I:]
            if clamp is not None:
                g, u = g.clamp(max=clamp), u.clamp(-clamp, clamp)
            out[t] += float(w[t, k]) * (w2[e].double() @ (torch.nn.functional.silu(g) * u))
    return out


def _fc2_amax(w13, x, idx, w, weighted):
    """What a calibration pass records: the largest |FC2 input| over the routed pairs."""
    h = torch.einsum("tkoh,th->tko", w13[idx].float(), x.float())
    y = ffn.swiglu(h.reshape(T * K, 2 * I), None).reshape(T, K, I)
    return float((y * w.unsqueeze(-1) if weighted else y).abs().max())


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


# Bounds: the format's quantization of activations, weights and the FC2 input, compounded (e4m3 ~2.7% per
# quantized operand in L2, e2m1 ~9.5%).
@pytest.mark.parametrize("fmt, bound", [("bf16", 1e-2), ("fp8_block", 1e-1), ("fp8_tensor", 1e-1),
                                        ("mxfp8", 1e-1), ("nvfp4", 3e-1), ("w4a8_mxfp4", 3e-1),
                                        ("w4a8_nvfp4", 3e-1)])
@pytest.mark.parametrize("apply_topk", [True, False])
def test_oracle_is_the_moe(fmt, bound, apply_topk):
    w13, w2, x, idx, w = _problem()
    qw = packs.quantize_weights(fmt, w13, w2, act_amax=float(x.float().abs().max()) * 1.1,
                                fc2_act_amax=_fc2_amax(w13, x, idx, w, apply_topk) * 1.1)
    got = oracle.oracle_forward(qw, x, idx, w, apply_topk_in_fc1=apply_topk)
    assert got.dtype == torch.bfloat16 and got.shape == (T, H)
    err = _rel(got, _naive(w13, w2, x, idx, w))
    assert err < bound
    if fmt != "bf16":
        assert err > 1e-3  # the oracle does quantize


def test_oracle_clamp():
    w13, w2, x, idx, w = _problem(1)
    qw = packs.quantize_weights("bf16", w13, w2)
    got = oracle.oracle_forward(qw, x, idx, w, gate_up_clamp=0.3)
    assert _rel(got, _naive(w13, w2, x, idx, w, clamp=0.3)) < 1e-2
    assert _rel(got, _naive(w13, w2, x, idx, w)) > 5e-2  # the clamp bites at this limit


def test_oracle_uses_staged_activation():
    w13, w2, x, idx, w = _problem(2)
    qw = packs.quantize_weights("fp8_block", w13, w2)
    act = packs.quantize_input(qw, x)
    assert torch.equal(oracle.oracle_forward(qw, act, idx, w), oracle.oracle_forward(qw, x, idx, w))
    other = packs.quantize_input(qw, (x.float() * 2).bfloat16())
    assert not torch.equal(oracle.oracle_forward(qw, other, idx, w), oracle.oracle_forward(qw, x, idx, w))


def test_oracle_with_an_expert_subset_and_offset():
    w13, w2, x, idx, w = _problem(3)
    qw = packs.quantize_weights("bf16", w13, w2)
    sub = qw.experts(slice(3, 6))
    assert sub.expert_offset == 3 and sub.num_experts == 3
    local = idx.clamp(min=3)
    torch.testing.assert_close(oracle.oracle_forward(sub, x, local, w), oracle.oracle_forward(qw, x, local, w))
    with pytest.raises(ValueError, match="not in the oracle's weights"):
        oracle.oracle_forward(sub, x, idx.clamp(max=2), w)


def test_compare_verdicts():
    w13, w2, x, idx, w = _problem(4)
    ref = oracle.oracle_forward(packs.quantize_weights("bf16", w13, w2), x, idx, w)
    ok, problems, *_ = oracle.compare(ref.clone(), ref, "bf16")
    assert ok and not problems
    off = ref.clone()
    off[4] = off[4] * 1.2  # one token 20% off
    ok, problems, row, *_ = oracle.compare(off, ref, "bf16")
    assert not ok and row == pytest.approx(0.2, rel=0.05) and "per-token relative error" in problems[0]
    nan = ref.clone()
    nan[0, 0] = float("nan")  # a NaN left in a poisoned buffer is always a failure
    ok, problems, *_ = oracle.compare(nan, ref, "nvfp4")
    assert not ok and "NaN" in problems[0]
    tiny = ref.clone()
    tiny[2, 3] += 0.003 * ref[2].float().norm().item()  # within bf16's tolerance
    assert oracle.compare(tiny, ref, "bf16")[0]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
