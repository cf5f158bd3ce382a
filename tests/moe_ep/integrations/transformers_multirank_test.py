"""transformers 5 MoE models on moe_ep at world size 2 (gloo, torch reference, bf16): tiny random Mixtral,
Qwen3-MoE and DeepSeek-V3 models, every rank with its own prompts and batch size (2 and 1 rows of 12 tokens: rank
0's prefill is over the capacity and runs in agreed chunks), its own half of the experts, checked against the
model's own implementation (moe_ep.testing.hf_models.run_model_check, the same check as at world size 1); then
save_pretrained gathering both ranks' experts into a checkpoint transformers reloads bit for bit, and a forward
that needs a gradient refused on both ranks at the same call (after which both still run in step)."""

import sys

import pytest

HERE = __file__


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


def save_and_reload(path: str, arch: str) -> dict:
    """Rank side: swap, save_pretrained (collective; rank 0 writes), close; rank 0 reloads with transformers."""
    import torch
    import transformers

    import moe_ep
    from moe_ep.integrations.transformers import close, swap_experts
    from moe_ep.testing import hf_matrix, hf_models

    torch.set_num_threads(1)
    hf_matrix._quiet()
    ctx = moe_ep.init_from_env()
    model = hf_models.tiny_model(arch) if arch in hf_models.ARCHS else hf_matrix.tiny_model(arch)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids = hf_models.prompt_ids(2, 10, seed=8, vocab=200)
    with torch.no_grad():
        want = model(ids).logits
    swap_experts(model, max_tokens_per_rank=16)
    model.save_pretrained(path)
    close(model)
    if ctx.rank != 0:
        return dict(rank=ctx.rank)
    back = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    got = back.state_dict()
    with torch.no_grad():
        logits = back(ids).logits
    return dict(rank=0, same_keys=got.keys() == state.keys(),
                same_state=all(torch.equal(got[k], state[k]) for k in state if k in got),
                same_logits=bool(torch.equal(logits, want)))


@pytest.mark.parametrize("arch", ["mixtral", "llama4_text"])
def test_save_pretrained_gathers_every_ranks_experts(arch, tmp_path):
    from tools.launch.launcher import launch_function

    results = launch_function(f"{HERE}:save_and_reload", 2, {"path": str(tmp_path), "arch": arch}, device="cpu",
                              timeout_s=300)
    assert results[0] == dict(rank=0, same_keys=True, same_state=True, same_logits=True), results


def gradient_refused() -> dict:
    """Rank side: a forward needing a gradient raises on every rank at the same layer call; both ranks then run
    a no_grad forward in step."""
    import torch

    import moe_ep
    from moe_ep.integrations.transformers import close, swap_experts
    from moe_ep.testing import hf_matrix, hf_models

    torch.set_num_threads(1)
    hf_matrix._quiet()
    ctx = moe_ep.init_from_env()
    model = hf_models.tiny_model("mixtral")
    swap_experts(model, max_tokens_per_rank=16)
    ids = hf_models.prompt_ids(2 - ctx.rank, 10, seed=ctx.rank, vocab=200)
    out = dict(rank=ctx.rank)
    try:
        model(ids, labels=ids).loss.backward()
    except moe_ep.errors.IntegrationError as e:
        out.update(error=type(e).__name__, argument=e.argument)
    with torch.no_grad():
        out["finite"] = bool(torch.isfinite(model(ids).logits).all())
    out["grads"] = sum(p.grad is not None for p in model.parameters())
    close(model)
    return out


def test_a_forward_that_needs_a_gradient_is_refused_on_every_rank():
    from tools.launch.launcher import launch_function

    results = launch_function(f"{HERE}:gradient_refused", 2, {}, device="cpu", timeout_s=300)
    for r in results:
        assert r == dict(rank=r["rank"], error="IntegrationError", argument="model.layers.0.mlp.experts", finite=True,
                         grads=0), results


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"] + sys.argv[1:]))
