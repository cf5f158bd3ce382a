"""transformers 5 MoE models on moe_ep at world size 2 (gloo, torch reference, bf16): tiny random Mixtral,
Qwen3-MoE and DeepSeek-V3 models, every rank with its own prompts and batch size (2 and 1 rows of 12 tokens: rank
0's prefill is over the capacity and runs in agreed chunks), its own half of the experts, checked against the
model's own implementation (moe_ep.testing.hf_models.run_model_check, the same check as at world size 1)."""

import sys

import pytest


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_world_size_2_matches_the_models_own_experts_on_every_rank(arch):
    from tools.launch.launcher import launch_function

    results = launch_function("moe_ep.testing.hf_models:run_model_check", 2,
                              {"arch": arch, "batch": 2, "seed": 3, "capacity": 16}, device="cpu", timeout_s=300)
    for r in results:
        assert r["ok"], r
        assert r["world_size"] == 2 and len(r["rows"]) == 2 - r["rank"]
    # a prompt position rerouted early takes its whole row out of the decode check: over both ranks, most remain
    assert sum(r["compared_steps"] for r in results) >= sum(r["steps"] for r in results) // 4, results


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"] + sys.argv[1:]))
