"""transformers 5 MoE models on moe_ep (#24.1, #24.5): tiny random Mixtral, Qwen3-MoE and DeepSeek-V3 models built
from configs (no downloads), their routed experts swapped onto moe_ep layers (torch reference backend, bf16, CPU)
with one call, checked against the model's own implementation: teacher-forced logits within the format's bound,
and greedy generation of 16 tokens identical up to the first near-tie (moe_ep.testing.hf_models says why that
is the right line), at world size 1 in process; world size 2 is transformers_multirank_test.py.

    python tests/moe_ep/integrations/transformers_test.py [-k deepseek_v3]
"""

import os
import subprocess
import sys

import pytest
import torch

from moe_ep.testing.hf_models import LOGITS_TOL

CAPACITY = 16  # below the prefills' token counts (2 x 12): they run in chunks


@pytest.fixture(scope="module")
def group():
    from tests.support.dist import one_rank_gloo_group

    with one_rank_gloo_group():
        yield


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_world_size_1_matches_the_models_own_experts(group, arch):
    from moe_ep.testing.hf_models import run_model_check

    r = run_model_check(arch, batch=2, seed=1, capacity=CAPACITY)
    assert r["ok"], r
    assert r["backend"] == "torch_reference" and r["fmt"] == "bf16" and r["logits_tol"] == LOGITS_TOL["bf16"]
    assert r["compared_steps"] >= r["steps"] // 4, r  # the decode check had teeth
    assert r["layers"] == (1 if arch == "deepseek_v3" else 2)  # DeepSeek-V3's first layer is dense


def test_an_fp32_model_runs_its_experts_in_bf16(group):
    """Lenient inputs: fp32 hidden states in, fp32 out; the experts' weights are held in bf16."""
    from moe_ep.testing.hf_models import run_model_check

    r = run_model_check("qwen3_moe", batch=1, seed=2, capacity=CAPACITY, dtype="float32")
    assert r["ok"], r


def test_the_swap_keeps_router_and_shared_experts_and_frees_the_weights(group):
    import moe_ep
    from moe_ep.integrations.transformers import IMPLEMENTATION, close, swap_experts
    from moe_ep.testing import hf_models

    model = hf_models.tiny_model("deepseek_v3")
    mlp = model.model.layers[1].mlp
    gate, shared = mlp.gate, mlp.shared_experts
    swap_experts(model, max_tokens_per_rank=CAPACITY)
    try:
        assert mlp.gate is gate and mlp.shared_experts is shared and mlp.experts.config is model.config
        assert not hasattr(mlp.experts, "gate_up_proj") and not hasattr(mlp.experts, "down_proj")
        assert isinstance(mlp.experts.moe_ep, moe_ep.MoEModule)
        assert model.config._experts_implementation == IMPLEMENTATION
        sd = model.state_dict()
        assert "model.layers.1.mlp.experts.moe_ep.w13_q" in sd and "model.layers.1.mlp.gate.weight" in sd
        assert "model.layers.1.mlp.experts.gate_up_proj" not in sd
        assert mlp.experts.moe_ep.layer.name.startswith("model.layers.1.mlp.experts")  # the watchdog names it so
    finally:
        close(model)


def test_a_model_moe_ep_cannot_serve_is_refused_untouched(group):
    import moe_ep
    from moe_ep.integrations.transformers import swap_experts
    from moe_ep.testing import hf_models

    model = hf_models.tiny_model("mixtral", hidden_act="gelu")
    with pytest.raises(moe_ep.IntegrationError) as e:
        swap_experts(model)
    assert e.value.argument == "model.layers.0.mlp.experts" and "GELUActivation" in str(e.value)
    assert hasattr(model.model.layers[0].mlp.experts, "gate_up_proj")
    with pytest.raises(moe_ep.IntegrationError) as e:
        swap_experts(torch.nn.Linear(4, 4))
    assert e.value.argument == "model"


def test_moe_ep_imports_without_transformers():
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'transformers': raise ImportError('transformers is not installed')\n"
            "sys.meta_path.insert(0, Block())\n"
            "import moe_ep, moe_ep.integrations.transformers as t, moe_ep.testing.hf_models\n"
            "try:\n"
            "    t.swap_experts(None)\n"
            "except moe_ep.IntegrationError as e:\n"
            "    print('ARG', e.argument)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "ARG transformers" in res.stdout, res.stdout + res.stderr


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"] + sys.argv[1:]))
