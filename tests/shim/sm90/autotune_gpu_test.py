"""knobs="auto" on the GPU: a collective tune writes the knob cache, and the tuned layer (its frontend adopts the weights
the candidates shared) agrees with the oracle; a second process finds the cache entry and compiles once."""
import json
import os
import subprocess
import sys

import pytest
import torch

import moe_ep

GEOM = dict(hidden_size=2048, intermediate_size=768, num_experts=16, top_k=4, max_tokens_per_rank=128)


def _weights():
    rank, world = 0, 1
    gen = torch.Generator().manual_seed(5)
    h, i, e = GEOM["hidden_size"], GEOM["intermediate_size"], GEOM["num_experts"]
    w13 = (torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5).to(torch.bfloat16).cuda()
    w2 = (torch.randn(e, h, i, generator=gen) / i ** 0.5).to(torch.bfloat16).cuda()
    return moe_ep.ExpertWeights(w13=w13, w2=w2, rank=rank, world_size=world, num_experts=e)


def _layer(knobs, weights=None):
    return moe_ep.MoELayer(moe_ep.MoESpec(**GEOM), weights or _weights(), backend="sm90_fp8_cutedsl",
                           device=torch.device("cuda"), knobs=knobs)


def test_autotune_then_cache_reuse(dist_ctx, tmp_path, case_log, monkeypatch):
    from shim.common import compile_cache

    cache = os.environ.get("MOE_EP_TEST_KNOB_CACHE") or str(tmp_path / "knobs.json")
    if os.path.exists(cache):
        os.remove(cache)
    monkeypatch.setenv("MOE_EP_KNOB_CACHE", cache)
    weights = _weights()
    layer = _layer("auto", weights)
    res = layer.backend.autotune_result
    assert res is not None and layer.backend.knob_source == "autotune"
    entry = json.load(open(cache))["entries"]
    assert len(entry) == 1
    (key, val), = entry.items()
    assert val["knobs"] == layer.backend.knobs.to_json()
    case_log(suite="sm90_autotune", key=key, candidates=[str(c) for c in
             __import__("shim.sm90.tune", fromlist=["x"]).candidate_knobs("fp8_block", moe_ep.MoESpec(**GEOM))],
             scores_us=res.scores_us, winner=str(res.winner), seconds=res.seconds,
             compiles=compile_cache.stats()["compiles"])
    # The tuned layer serves the weights laid out once for the candidates: fresh inputs, a NaN-poisoned output,
    # checked against the oracle over the weights the caller gave.
    from moe_ep.reference.oracle import check_multirank, kernel_row_tolerance

    gen = torch.Generator().manual_seed(11)
    t, e, k = 100, GEOM["num_experts"], GEOM["top_k"]
    x = torch.randn(t, GEOM["hidden_size"], generator=gen).to(torch.bfloat16).cuda()
    idx = torch.rand(t, e, generator=gen).argsort(dim=1)[:, :k].cuda()
    w = torch.softmax(torch.randn(t, k, generator=gen), dim=-1).cuda()
    out = torch.full((t, GEOM["hidden_size"]), float("nan"), dtype=torch.bfloat16, device="cuda")
    layer(x, idx, w, out=out)
    tol = kernel_row_tolerance("fp8_block", GEOM["intermediate_size"])
    report = check_multirank(layer, x, idx, w, out, weights=weights, tol=tol, raise_on_failure=False)
    case_log(suite="sm90_autotune", case="tuned_layer_vs_oracle", rel_l2=report.mine(0).rel_l2_err, ok=report.ok)
    assert report.ok, report.summary()
    assert res.kernel_weights is None  # handed to the layer's frontend, not held twice
    layer.close()
    # A second process with the same key: cache hit, one compile.
    code = ("import json, torch, sys; sys.path[:0] = %r; from autotune_gpu_test import _layer; "
            "import torch.distributed as dist; dist.init_process_group('cpu:gloo,cuda:nccl', rank=0, world_size=1,"
            " init_method='tcp://127.0.0.1:%d'); from shim.common import compile_cache; l = _layer('auto'); "
            "print(json.dumps(dict(source=l.backend.knob_source, knobs=l.backend.knobs.to_json(), "
            "compiles=compile_cache.stats()['compiles']))); l.close(); dist.destroy_process_group()"
            % ([os.path.dirname(os.path.abspath(__file__))] + sys.path, 29000 + os.getpid() % 1000))
    env = dict(os.environ, RANK="0", WORLD_SIZE="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                          cwd=os.getcwd())
    assert proc.returncode == 0, proc.stderr[-3000:]
    second = json.loads(proc.stdout.strip().splitlines()[-1])
    case_log(suite="sm90_autotune", case="second_process", **second)
    assert second["source"] == "cache"
    assert second["knobs"] == val["knobs"]
    assert second["compiles"] == 1


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-x"]))
