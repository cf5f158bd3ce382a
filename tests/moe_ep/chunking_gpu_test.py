"""Calls larger than the capacity on the Hopper kernels (#24.3, GPU half): 4x the capacity on rank 0 (half of it
on the others), eager with chunking="agree" and inside a caller's CUDA graph with max_tokens_across_ranks; every
rank's output against the torch oracle over the gathered quantized weights (the kernel stages the format
quantizer's bytes, so the oracle quantizes hidden the same way).

    python3 -m tools.launch.launcher --nproc 2 --device cuda -- tests/moe_ep/chunking_gpu_test.py   (or --nproc 1)
"""

import os
import sys

import pytest
import torch

os.environ.setdefault("MOE_EP_DEVICE", "cuda")

import moe_ep  # noqa: E402
from moe_ep.core.graphs import capture_graph  # noqa: E402
from moe_ep.reference.oracle import compare, gather_quantized_weights, kernel_row_tolerance, oracle_forward  # noqa: E402
from tests.support.gpu import case_log, dist_ctx, shared_seed  # noqa: E402,F401 (pytest fixtures)

C = 64
H, I, K, E_LOCAL = 512, 256, 4, 8


@pytest.fixture(scope="module", params=["sm90_bf16_cutedsl", "sm90_fp8_cutedsl"])
def layers(request, dist_ctx):  # noqa: F811 (fixture)
    rank, world = dist_ctx
    spec = moe_ep.MoESpec(H, I, E_LOCAL * world, K, C)
    gen = torch.Generator().manual_seed(77 + rank)
    w13 = (torch.randn(E_LOCAL, 2 * I, H, generator=gen) / H ** 0.5).to(torch.bfloat16).cuda()
    w2 = (torch.randn(E_LOCAL, H, I, generator=gen) / I ** 0.5).to(torch.bfloat16).cuda()
    weights = moe_ep.ExpertWeights(w13, w2, rank, world, spec.num_experts)
    dev = torch.device("cuda", torch.cuda.current_device())
    agree = moe_ep.MoELayer(spec, weights, backend=request.param, device=dev, chunking="agree")
    strict = moe_ep.MoELayer(spec, weights, backend=request.param, device=dev)
    yield agree, strict
    strict.close()
    agree.close()


def _inputs(layer, seed):
    t = 4 * C if layer.rank == 0 else C // 2
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=gen).to(torch.bfloat16).cuda()
    idx = torch.rand(t, layer.spec.num_experts, generator=gen).argsort(1)[:, :K].contiguous().cuda()
    w = torch.softmax(torch.randn(t, K, generator=gen), 1).cuda()
    return x, idx, w


def _check(layer, x, idx, w, out):
    ref = oracle_forward(gather_quantized_weights(layer.ctx, layer.oracle_weights()), x, idx, w)
    tol = kernel_row_tolerance(layer.fmt, I) if layer.fmt == "fp8_block" else None
    ok, problems, row, *_ = compare(out, ref, layer.fmt, tol)
    return ok, problems, row


def test_eager_agreed_chunks_match_the_oracle(layers, case_log, shared_seed):  # noqa: F811 (fixtures)
    agree, _ = layers
    x, idx, w = _inputs(agree, shared_seed(agree.rank))
    out = torch.full_like(x, float("nan"))
    agree(x, idx, w, out=out)
    torch.cuda.synchronize()
    ok, problems, row = _check(agree, x, idx, w, out)
    case_log(suite="chunking", backend=agree.backend_name, rank=agree.rank, world=agree.world_size, case="eager",
             T=x.shape[0], capacity=C, max_row_rel=row, ok=ok)
    assert ok, problems


def test_chunks_inside_a_captured_graph_match_the_oracle(layers, case_log, shared_seed):  # noqa: F811
    agree, strict = layers
    seed = shared_seed(strict.rank)
    x, idx, w = _inputs(strict, seed)
    out = torch.full_like(x, float("nan"))
    bound = 4 * C  # every rank passes the same bound: rank 0's token count
    graph = capture_graph(lambda: strict(x, idx, w, out=out, max_tokens_across_ranks=bound))
    fresh = _inputs(strict, seed + 1)
    for static, new in zip((x, idx, w), fresh):
        static.copy_(new)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ok, problems, row = _check(strict, x, idx, w, out)
    eager = agree(x, idx, w)
    torch.cuda.synchronize()
    same = torch.equal(eager.view(torch.int16), out.view(torch.int16))
    case_log(suite="chunking", backend=strict.backend_name, rank=strict.rank, world=strict.world_size,
             case="captured", T=x.shape[0], capacity=C, max_row_rel=row, ok=ok, replay_equals_eager_agreed=same)
    assert ok, problems
    assert same


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"] + sys.argv[1:]))
