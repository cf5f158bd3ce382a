"""The Blackwell MegaMoE kernels (NVFP4, MXFP8, BF16) through moe_ep on real sm100 GPUs; every rank checked
against the torch oracle.

One process per rank (run_multirank_gpu.py starts them through tools/launch; at world size 1 plain pytest on
one Blackwell GPU works too). For each backend, geometry, token count and routing: fresh random inputs, a
NaN-poisoned output, then moe_ep.reference.oracle.check_multirank: each rank all-gathers the quantized
weights every rank actually used (read back from the kernel tensors) and checks its own output slice against
a single-process torch oracle over its staged tokens and the global expert set. Ranks agreeing with each
other proves nothing, so no rank is compared with another.

Pass criterion: the oracle's own per-token bound for the format (moe_ep.reference.oracle.OUTPUT_TOLERANCE)
and no NaN. The oracle repeats the kernels' quantization steps, so what remains is accumulation order, bf16
rounding of each (token, slot) term and, for the block-scaled formats, an FC2-input element now and then
rounding to the neighbouring value. No Blackwell run has been made yet: rel_l2 is logged per case (and
against an unquantized fp32 forward at world size 1) so the first run can set measured bounds.

NVFP4 scales activations statically: every rank calibrates on a batch of its own tokens through its own
experts, the amaxes are all-reduced (max), so all ranks hold the same global scales, as an offline
calibration pass would give them.
"""
import os

import pytest
import torch

import moe_ep
from moe_ep.reference import ffn
from moe_ep.reference.oracle import check_multirank
from moe_ep.testing.problems import make_routing, unquantized_reference

BACKENDS = {"sm100_nvfp4_cutedsl": "nvfp4", "sm100_mxfp8_cutedsl": "mxfp8", "sm100_bf16_cutedsl": "bf16"}
GEOMS = {
    "small": dict(hidden_size=512, intermediate_size=256, experts_per_rank=8, top_k=4),
    "dsv3": dict(hidden_size=7168, intermediate_size=2048, experts_per_rank=16, top_k=8),
}
TOKENS = [1, 7, 64, 128, 1000, 4096]
ROUTINGS = ["balanced", "skewed", "no_local"]
CAPACITY = 4096
SELECTED = [b for b in os.environ.get("MOE_EP_SM100_BACKENDS", ",".join(BACKENDS)).split(",") if b]


def _calibration(w13, w2, top_k, gate_up_clamp, gen):
    """(act_amax, fc2_act_amax): this rank's calibration batch through its own experts, max over ranks."""
    import torch.distributed as dist

    h = w13.shape[2]
    x = torch.randn(512, h, generator=gen, device="cuda").to(torch.bfloat16)
    w = torch.softmax(torch.randn(512, top_k, generator=gen, device="cuda"), dim=-1).max(dim=1).values
    fc2_amax = torch.zeros((), device="cuda")
    for e in range(w13.shape[0]):
        y = ffn.swiglu(x.float() @ w13[e].float().t(), gate_up_clamp) * w.unsqueeze(1)
        fc2_amax = torch.maximum(fc2_amax, y.abs().max())
    amax = torch.stack([x.float().abs().max(), fc2_amax]) * 1.25
    dist.all_reduce(amax, op=dist.ReduceOp.MAX)
    return float(amax[0]), float(amax[1])


@pytest.fixture(scope="module", params=[(b, g) for b in SELECTED for g in GEOMS], ids=lambda p: f"{p[0]}-{p[1]}")
def layer(request, dist_ctx):
    backend, geom = request.param
    rank, world = dist_ctx
    fmt = BACKENDS[backend]
    g = GEOMS[geom]
    e = g["experts_per_rank"] * world
    spec = moe_ep.MoESpec(hidden_size=g["hidden_size"], intermediate_size=g["intermediate_size"], num_experts=e,
                          top_k=g["top_k"], max_tokens_per_rank=CAPACITY)
    gen = torch.Generator(device="cuda").manual_seed(4321 + rank)
    h, i, el = spec.hidden_size, spec.intermediate_size, g["experts_per_rank"]
    w13 = (torch.randn(el, 2 * i, h, generator=gen, device="cuda") / h ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(el, h, i, generator=gen, device="cuda") / i ** 0.5).to(torch.bfloat16)
    cal = {}
    if fmt == "nvfp4":
        cal["act_amax"], cal["fc2_act_amax"] = _calibration(w13, w2, spec.top_k, spec.gate_up_clamp, gen)
    weights = moe_ep.ExpertWeights(w13=w13, w2=w2, rank=rank, world_size=world, num_experts=e, **cal)
    lay = moe_ep.MoELayer(spec, weights, backend=backend, fmt=fmt, device=torch.device("cuda"))
    lay.geom, lay.weights = geom, weights
    yield lay
    lay.close()


def _inputs(layer, t, routing, seed):
    rank, world = layer.rank, layer.world_size
    gen = torch.Generator().manual_seed(seed + rank)
    hidden = torch.randn(t, layer.spec.hidden_size, generator=gen).to(torch.bfloat16)
    kind = routing if not (routing == "no_local" and world == 1) else "uniform"
    idx, w = make_routing(kind, t, layer.spec.num_experts, layer.spec.top_k, world, rank, seed)
    return hidden.cuda(), idx.cuda(), w.cuda()


def _check(case_log, layer, hidden, idx, w, out, **case):
    report = check_multirank(layer, hidden, idx, w, out, weights=layer.weights, raise_on_failure=False)
    mine = report.mine(layer.rank)
    full = unquantized_reference(layer.weights, hidden, idx, w)
    fmt_err = None if full is None or hidden.shape[0] == 0 else \
        float((out.float() - full).norm() / full.norm().clamp(min=1e-30))
    case_log(suite="sm100", backend=layer.backend_name, fmt=layer.fmt, geom=layer.geom, world=layer.world_size,
             rank=layer.rank, T=int(hidden.shape[0]), nan=mine.nan_count, rel_l2=mine.rel_l2_err,
             max_row_rel=mine.max_row_rel_err, max_abs=mine.max_abs_err, tolerance=mine.tolerance,
             weight_rel_err=mine.weight_rel_err, act_rel_err=mine.act_rel_err, rel_l2_vs_fp32_unquantized=fmt_err,
             knobs=str(layer.backend.knobs), ok=report.ok, **case)
    assert report.ok, report.summary()
    assert mine.nan_count == 0


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("t", TOKENS)
def test_matches_oracle(layer, t, routing, shared_seed, case_log):
    seed = shared_seed()
    hidden, idx, w = _inputs(layer, t, routing, seed)
    out = torch.full((t, layer.spec.hidden_size), float("nan"), dtype=torch.bfloat16, device="cuda")
    layer(hidden, idx, w, out=out)
    torch.cuda.synchronize()
    _check(case_log, layer, hidden, idx, w, out, routing=routing, seed=seed)


def test_unequal_token_counts_and_an_idle_rank(layer, shared_seed, case_log):
    """Rank r sends 37 * r tokens: rank 0 sends none but still serves its experts to the others."""
    seed = shared_seed(1)
    t = 37 * layer.rank
    hidden, idx, w = _inputs(layer, t, "uniform", seed)
    out = layer(hidden, idx, w)
    torch.cuda.synchronize()
    assert out.shape == (t, layer.spec.hidden_size)
    _check(case_log, layer, hidden, idx, w, out, routing="uniform", seed=seed, case="unequal")


def test_bitwise_repeatable(layer, shared_seed, case_log):
    assert not layer.backend.knobs.fc2_in_kernel_topk_reduce  # the in-kernel reduce sums in arrival order
    seed = shared_seed(2)
    hidden, idx, w = _inputs(layer, 1000, "skewed", seed)
    outs = []
    for _ in range(3):
        o = torch.full((1000, layer.spec.hidden_size), float("nan"), dtype=torch.bfloat16, device="cuda")
        layer(hidden, idx, w, out=o)
        outs.append(o)
    torch.cuda.synchronize()
    same = all(torch.equal(outs[0].view(torch.int16), o.view(torch.int16)) for o in outs[1:])
    case_log(suite="sm100", backend=layer.backend_name, geom=layer.geom, case="bitwise_repeat", runs=3,
             identical=same)
    assert same


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-x"]))
