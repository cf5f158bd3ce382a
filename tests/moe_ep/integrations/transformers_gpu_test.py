"""transformers MoE models on the Hopper kernels (#24.5, GPU half): tiny random Mixtral, Qwen3-MoE and DeepSeek-V3
models (moe_ep.testing.hf_models: H 256, I 128, 8 experts, top-2, built from configs, no downloads) with their
routed experts on sm90_bf16_cutedsl and sm90_fp8_cutedsl, on one H200 (or N, one rank each):

    python3 -m tools.launch.launcher --nproc 1 --device cuda -- tests/moe_ep/integrations/transformers_gpu_test.py
    (MOE_EP_GPU_LOG=$OUT/transformers_gpu: one JSON line per case in $OUT/transformers_gpu.rank<r>.jsonl)

Two references per backend, the checks of moe_ep.testing.hf_models.compare_run (teacher-forced logits, decode
steps while contexts and routes agree, greedy tokens identical up to the first near-tie):
  against="transformers": the model's own bf16 experts (transformers' CUDA grouped GEMM). Bounds (relative L2 of
    the logits per position): bf16 3e-2 (the implementations' rounding); FP8 0.15 (H200: 6.3-10.8 %), because e4m3
    weights and FC1 /
    FC2 inputs with 128-wide block scales keep 3 mantissa bits (up to 2^-4 relative per element, ~2.5-3 % RMS):
    the MoE output errs by ~4-5 %, it adds into a residual stream of comparable size in each MoE layer, and the
    logits measured 6.8-7.6 % off with the torch reference quantizing the same way on the CPU. FP8's error also
    reroutes many positions of these small random routers (their logits are then not compared; at least 25 %
    must stay comparable), and greedy generation parts from the reference at the first near-tie, often within
    a few tokens.
  against="torch_reference": moe_ep's torch reference backend in the same format on the same GPU (the same
    quantized bytes in; only the kernel's accumulation order and its bf16 terms differ): 3e-2 for bf16 and the
    oracle's per-token rule max(0.03, 0.75/sqrt(I)) for FP8 (a requantized FC2 input one e4m3 step apart),
    half the positions comparable, the generation identical up to the first near-tie of that tiny error.
A failure prints the case's JSON record (per-row first divergence, the gap there, the rerouted step).
"""

import os
import sys

import pytest

os.environ.setdefault("MOE_EP_DEVICE", "cuda")
pytest.importorskip("transformers", reason="the tiny models are transformers models (transformers 5.x needed)")

from tests.support.gpu import case_log, dist_ctx  # noqa: E402,F401 (pytest fixtures)

ARCHS = ["mixtral", "qwen3_moe", "deepseek_v3"]
BACKENDS = ["sm90_bf16_cutedsl", "sm90_fp8_cutedsl"]


@pytest.mark.parametrize("against", ["torch_reference", "transformers"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_model_on_the_kernel_matches(dist_ctx, case_log, arch, backend, against):  # noqa: F811 (fixtures)
    from moe_ep.testing.hf_models import run_model_check

    r = run_model_check(arch, backend=backend, against=against, new_tokens=16, batch=2)
    keep = ("ok", "prefill_rel_logits_err", "decode_rel_logits_err", "logits_tol", "compared_positions",
            "compared_steps", "steps", "near_ties", "near_tie_gap", "rows", "fmt")
    case_log(case=f"{arch}/{backend}/{against}", rank=r["rank"], world=r["world_size"],
             **{k: r[k] for k in keep}, matched=[row["matched_tokens"] for row in r["rows"]])
    assert r["backend"] == backend
    assert r["ok"], r


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"] + sys.argv[1:]))
