"""The Hopper MegaMoE kernels through moe_ep on real GPUs; every rank checked against the torch oracle.

One process per rank (tools/launch); at world size 1 plain pytest works too. For each backend (FP8
blockwise, BF16), geometry, token count and routing: fresh random inputs, a NaN-poisoned output, then
moe_ep.reference.oracle.check_multirank: each rank all-gathers the quantized weights every rank actually
used and checks its own output against a single-process torch oracle over its staged tokens and the global
expert set (ranks agreeing with each other proves nothing).

Error metric, per rank: rel_l2 = ||out - ref|| / ||ref||, where the oracle repeats the kernel's
quantization steps; what remains is accumulation order, bf16 rounding of the per-(token, k) terms and, for
FP8, an FC2-input element now and then rounding to the neighbouring e4m3 value (2^-3 relative on one element
of a 64-block). Thresholds: FP8 1e-2 (seen: 2e-3..5e-3), BF16 5e-3, plus the oracle's own per-token bound.
The per-token bound (worst token of the batch) is the oracle's, except that for FP8 it widens for a small
intermediate size: one flipped FC2-input element moves a token's output by about 2^-4 / sqrt(I) relative,
and the worst of 4096 tokens carries several (seen on the H200: 0.031 at I=256, 0.012 at I=2048), so it is
max(0.03, 0.75 / sqrt(I)).
The formats' own error is shown apart (rel_l2 against an unquantized fp32 reference), not tested.
"""
import os

import pytest
import torch

import moe_ep
from moe_ep.core.graphs import capture_graph
from moe_ep.reference.oracle import OUTPUT_TOLERANCE, check_multirank
from moe_ep.testing.problems import unquantized_reference

BACKENDS = {"sm90_fp8_cutedsl": ("fp8_block", 1e-2), "sm90_bf16_cutedsl": ("bf16", 5e-3)}
GEOMS = {
    "small": dict(hidden_size=512, intermediate_size=256, experts_per_rank=8, top_k=4),
    "dsv3": dict(hidden_size=7168, intermediate_size=2048, experts_per_rank=32, top_k=8),
}
TOKENS = [1, 7, 64, 128, 1000, 4096]
CAPACITY = 4096
SELECTED = [b for b in os.environ.get("MOE_EP_SM90_BACKENDS", ",".join(BACKENDS)).split(",") if b]


def routing(t, num_experts, k, skew, gen, device):
    if skew:  # most tokens to the lowest expert ids, i.e. to rank 0's experts under EP
        p = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float32) ** 1.5
    else:
        p = torch.ones(num_experts)
    idx = torch.multinomial(p.expand(max(t, 1), num_experts), k, replacement=False, generator=gen)[:t]
    w = torch.softmax(torch.randn(t, k, generator=gen), dim=-1)
    return idx.to(device), w.to(device)


@pytest.fixture(scope="module", params=[(b, g) for b in SELECTED for g in GEOMS], ids=lambda p: f"{p[0]}-{p[1]}")
def layer(request, dist_ctx):
    backend, geom = request.param
    rank, world = dist_ctx
    g = GEOMS[geom]
    e = g["experts_per_rank"] * world
    spec = moe_ep.MoESpec(hidden_size=g["hidden_size"], intermediate_size=g["intermediate_size"], num_experts=e,
                          top_k=g["top_k"], max_tokens_per_rank=CAPACITY)
    gen = torch.Generator().manual_seed(1234 + rank)
    h, i, el = spec.hidden_size, spec.intermediate_size, g["experts_per_rank"]
    w13 = (torch.randn(el, 2 * i, h, generator=gen) / h ** 0.5).to(torch.bfloat16).cuda()
    w2 = (torch.randn(el, h, i, generator=gen) / i ** 0.5).to(torch.bfloat16).cuda()
    weights = moe_ep.ExpertWeights(w13=w13, w2=w2, rank=rank, world_size=world, num_experts=e)
    lay = moe_ep.MoELayer(spec, weights, backend=backend, device=torch.device("cuda"))
    lay.geom, lay.weights = geom, weights
    lay.max_rel_l2 = BACKENDS[backend][1]
    yield lay
    lay.close()


@pytest.mark.parametrize("skew", [False, True], ids=["balanced", "skewed"])
@pytest.mark.parametrize("t", TOKENS)
def test_matches_oracle(layer, t, skew, case_log, shared_seed):
    seed = shared_seed(layer.rank)
    gen = torch.Generator().manual_seed(seed)
    dev = layer.device
    hidden = torch.randn(t, layer.spec.hidden_size, generator=gen).to(torch.bfloat16).to(dev)
    idx, w = routing(t, layer.spec.num_experts, layer.spec.top_k, skew, gen, dev)
    out = torch.full((t, layer.spec.hidden_size), float("nan"), dtype=torch.bfloat16, device=dev)
    layer(hidden, idx, w, out=out)
    torch.cuda.synchronize()
    tol = None
    if layer.fmt == "fp8_block":
        tol = max(OUTPUT_TOLERANCE["fp8_block"], 0.75 / layer.spec.intermediate_size ** 0.5)
    report = check_multirank(layer, hidden, idx, w, out, weights=layer.weights, tol=tol, raise_on_failure=False)
    mine = report.mine(layer.rank)
    full = unquantized_reference(layer.weights, hidden, idx, w)
    fmt_err = None if full is None else float((out.float() - full).norm() / full.norm().clamp(min=1e-30))
    local_tokens = int(((idx // layer.experts_per_rank) == layer.rank).any(dim=1).sum()) if t else 0
    case_log(suite="sm90", backend=layer.backend_name, geom=layer.geom, world=layer.world_size, rank=layer.rank,
             T=t, routing="skewed" if skew else "balanced", seed=seed, tokens_with_a_local_expert=local_tokens,
             nan=mine.nan_count, rel_l2=mine.rel_l2_err, max_row_rel=mine.max_row_rel_err,
             max_abs=mine.max_abs_err, weight_rel_err=mine.weight_rel_err, rel_l2_vs_fp32_unquantized=fmt_err,
             knobs=str(layer.backend.knobs), ok=report.ok)
    assert report.ok, report.summary()
    assert mine.nan_count == 0
    assert mine.rel_l2_err < layer.max_rel_l2, f"rel_l2 {mine.rel_l2_err:.3e} >= {layer.max_rel_l2}"


def test_bitwise_repeatable(layer, case_log, shared_seed):
    assert not layer.backend.knobs.fc2_in_kernel_topk_reduce  # the in-kernel reduce sums in arrival order
    gen = torch.Generator().manual_seed(shared_seed(layer.rank))
    dev = layer.device
    t = 1000
    hidden = torch.randn(t, layer.spec.hidden_size, generator=gen).to(torch.bfloat16).to(dev)
    idx, w = routing(t, layer.spec.num_experts, layer.spec.top_k, True, gen, dev)
    outs = []
    for _ in range(3):
        o = torch.full((t, layer.spec.hidden_size), float("nan"), dtype=torch.bfloat16, device=dev)
        layer(hidden, idx, w, out=o)
        outs.append(o)
    torch.cuda.synchronize()
    same = all(torch.equal(outs[0].view(torch.int16), o.view(torch.int16)) for o in outs[1:])
    case_log(suite="sm90", backend=layer.backend_name, geom=layer.geom, case="bitwise_repeat", T=t, runs=3,
             identical=same)
    assert same


def test_cuda_graph_replay_matches_eager(layer, case_log, shared_seed):
    dev = layer.device
    t = 128
    gen = torch.Generator().manual_seed(shared_seed(layer.rank))
    hidden = torch.randn(t, layer.spec.hidden_size, generator=gen).to(torch.bfloat16).to(dev)
    idx, w = routing(t, layer.spec.num_experts, layer.spec.top_k, False, gen, dev)
    eager = torch.empty(t, layer.spec.hidden_size, dtype=torch.bfloat16, device=dev)
    layer(hidden, idx, w, out=eager)
    static_out = torch.full_like(eager, float("nan"))
    layer.check_values, layer.collective_checks = False, False  # no host syncs inside a capture
    try:
        g = capture_graph(lambda: layer(hidden, idx, w, out=static_out))
        static_out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        same = torch.equal(static_out.view(torch.int16), eager.view(torch.int16))
        hidden.copy_(torch.randn(t, layer.spec.hidden_size, generator=gen).to(torch.bfloat16).to(dev))
        g.replay()
        fresh = torch.empty_like(eager)
        layer(hidden, idx, w, out=fresh)
        torch.cuda.synchronize()
        same_new = torch.equal(static_out.view(torch.int16), fresh.view(torch.int16))
    finally:
        layer.check_values, layer.collective_checks = True, True
    case_log(suite="sm90", backend=layer.backend_name, geom=layer.geom, case="cuda_graph", T=t,
             replay_equals_eager=same, replay_with_new_inputs_equals_eager=same_new)
    assert same and same_new


def test_zero_tokens(layer):
    dev = layer.device
    hidden = torch.empty(0, layer.spec.hidden_size, dtype=torch.bfloat16, device=dev)
    idx = torch.empty(0, layer.spec.top_k, dtype=torch.int64, device=dev)
    w = torch.empty(0, layer.spec.top_k, dtype=torch.float32, device=dev)
    out = layer(hidden, idx, w)
    torch.cuda.synchronize()
    assert out.shape == (0, layer.spec.hidden_size)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-x"]))
