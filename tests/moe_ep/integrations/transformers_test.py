"""transformers 5 MoE models on moe_ep (#24, #32), CPU, torch reference backend, world size 1 in process (world size
2: transformers_multirank_test.py; every architecture of transformers: model_matrix_test.py). Tiny random models
built from configs (no downloads), checked against the model's own implementation (moe_ep.testing.hf_models):
teacher-forced logits within the format's bound and greedy generation identical up to the first near-tie. And
what a swapped model does besides generating: what it refuses (and leaves untouched), save_pretrained and a reload
by transformers, conversions, copies, and a forward that needs a gradient (refused, eager and compiled).

    python tests/moe_ep/integrations/transformers_test.py [-k deepseek_v3]
"""

import copy
import os
import subprocess
import sys

import pytest
import torch

import moe_ep
from moe_ep.testing.hf_models import LOGITS_TOL

CAPACITY = 16  # below the prefills' token counts (2 x 12): they run in chunks


@pytest.fixture(scope="module")
def group():
    from tests.support.dist import one_rank_gloo_group

    from moe_ep.testing.hf_matrix import _quiet

    _quiet()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is faster, and CI's two cores are shared
    with one_rank_gloo_group():
        yield
    torch.set_num_threads(threads)


def _swapped(model, **kw):
    from moe_ep.integrations.transformers import swap_experts

    return swap_experts(model, max_tokens_per_rank=CAPACITY, **kw)


def _tiny(arch, **kw):
    from moe_ep.testing import hf_matrix, hf_models

    if arch in hf_models.ARCHS:
        return hf_models.tiny_model(arch, **kw)
    return hf_matrix.tiny_model(arch, **kw)


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
    from moe_ep.integrations.transformers import IMPLEMENTATION, close

    model = _tiny("deepseek_v3")
    mlp = model.model.layers[1].mlp
    gate, shared = mlp.gate, mlp.shared_experts
    before = model.num_parameters()
    experts = mlp.experts.gate_up_proj.numel() + mlp.experts.down_proj.numel()
    out = _swapped(model)
    try:
        assert list(out) == ["model.layers.1.mlp.experts"]
        assert mlp.gate is gate and mlp.shared_experts is shared and mlp.experts.config is model.config
        assert not hasattr(mlp.experts, "gate_up_proj") and not hasattr(mlp.experts, "down_proj")
        assert isinstance(mlp.experts.moe_ep, moe_ep.MoEModule)
        assert model.config._experts_implementation == IMPLEMENTATION
        sd = model.state_dict()  # the layer's own state: its format's codes (save_pretrained writes transformers')
        assert "model.layers.1.mlp.experts.moe_ep.w13_q" in sd and "model.layers.1.mlp.experts.gate_up_proj" not in sd
        assert mlp.experts.moe_ep.layer.name.startswith("model.layers.1.mlp.experts")  # the watchdog names it so
        # documented: the experts are no nn.Parameters any more (an optimizer, num_parameters() do not see them)
        assert model.num_parameters() == before - experts
        with pytest.raises(moe_ep.errors.IntegrationError, match="already on moe_ep"):
            _swapped(model)
    finally:
        close(model)


@pytest.mark.parametrize("arch, kw, match", [
    ("mixtral", dict(hidden_act="gelu"), "GELUActivation"),
    ("gemma4_text", dict(), "GELUTanh"),
    ("llama4_text", dict(num_experts_per_tok=2), "exact on moe_ep for top-1 only"),
], ids=["mixtral_gelu", "gemma4_gelu_tanh", "llama4_top2"])
def test_a_model_moe_ep_cannot_serve_is_refused_untouched(group, arch, kw, match):
    model = _tiny(arch, **kw)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(moe_ep.errors.IntegrationError, match=match) as e:
        _swapped(model)
    assert e.value.argument.startswith("model.layers.0.")
    assert not any(isinstance(m, moe_ep.MoEModule) for m in model.modules())
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)
    with pytest.raises(moe_ep.errors.IntegrationError) as e:
        _swapped(torch.nn.Linear(4, 4))
    assert e.value.argument == "model"


def test_an_experts_module_holding_a_tensor_moe_ep_would_ignore_is_refused(group):
    model = _tiny("mixtral")
    model.model.layers[1].mlp.experts.register_buffer("scales", torch.ones(8))
    with pytest.raises(moe_ep.errors.IntegrationError, match="would ignore: \\['scales'\\]") as e:
        _swapped(model)
    assert e.value.argument == "model.layers.1.mlp.experts"


@pytest.mark.parametrize("arch, kw", [("gemma4_text", dict(hidden_activation="silu")),
                                      ("llama4_text", dict(num_experts_per_tok=1))], ids=["gemma4_silu", "llama4_top1"])
def test_a_model_that_differs_only_in_what_the_layer_absorbs_is_served(group, arch, kw):
    from moe_ep.integrations.transformers import close
    from moe_ep.testing import hf_models

    model = _tiny(arch, **kw)
    ids = hf_models.prompt_ids(2, 10, seed=4, vocab=200)
    ref = hf_models.reference_run(model, ids, 16)
    _swapped(model)
    try:
        r = hf_models.compare_run(model, ref, 16, logits_tol=LOGITS_TOL["bf16"])
    finally:
        close(model)
    assert r["ok"], r


@pytest.mark.parametrize("arch", ["mixtral", "aria_text", "llama4_text"])
def test_save_pretrained_writes_what_transformers_reads_back(group, arch, tmp_path):
    """The experts in transformers' own names, layout (Aria's are transposed, Llama-4's sit in a block moe_ep
    replaces) and dtype: a reload by transformers has the original state bit for bit, and its logits."""
    import transformers

    from moe_ep.integrations.transformers import close
    from moe_ep.testing import hf_models

    model = _tiny(arch)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids = hf_models.prompt_ids(2, 10, seed=5, vocab=200)
    with torch.no_grad():
        want = model(ids).logits
    _swapped(model)
    try:
        model.save_pretrained(tmp_path)
    finally:
        close(model)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    got = back.state_dict()
    assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state)
    with torch.no_grad():
        assert torch.equal(back(ids).logits, want)


def test_save_pretrained_of_quantized_layers_is_refused_before_anything_is_written(group, tmp_path):
    from moe_ep.integrations.transformers import close

    model = _tiny("mixtral")
    _swapped(model, fmt="fp8_block")
    try:
        with pytest.raises(moe_ep.errors.IntegrationError, match="fmt 'fp8_block'") as e:
            model.save_pretrained(tmp_path / "out")
        assert e.value.argument == "model.layers.0.mlp.experts" and not (tmp_path / "out").exists()
    finally:
        close(model)


def test_an_fp32_model_saves_its_bf16_experts_in_fp32(group, tmp_path):
    import transformers

    from moe_ep.integrations.transformers import close

    model = _tiny("qwen3_moe", dtype=torch.float32)
    want = model.model.layers[0].mlp.experts.gate_up_proj.detach().bfloat16().float()
    _swapped(model)
    try:
        model.save_pretrained(tmp_path)  # transformers writes Qwen3-MoE's experts one by one, as its hub files are
    finally:
        close(model)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    got = back.model.layers[0].mlp.experts.gate_up_proj
    assert got.dtype == torch.float32 and torch.equal(got, want)  # what moe_ep computed with, in the model's dtype


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_forward_that_needs_a_gradient_is_refused(group, compiled):
    """moe_ep serves inference: the MoE output would carry no gradient, the router none, attention's would be
    wrong. A forward under grad mode whose hidden states require grad raises, nothing is accumulated, and the same
    model runs under no_grad. Compiled: the MoE block under torch.compile (aot_eager: Dynamo and AOTAutograd, what
    inductor builds on; the whole model compiles the same code, at ~5x the CPU time)."""
    from moe_ep.integrations.transformers import close
    from moe_ep.testing import hf_models

    model = _tiny("qwen3_moe")
    ids = hf_models.prompt_ids(2, 10, seed=6, vocab=200)
    _swapped(model)
    try:
        if compiled:
            block = torch.compile(model.model.layers[0].mlp, backend="aot_eager")
            x = torch.randn(2, 10, model.config.hidden_size, dtype=torch.bfloat16)
            with pytest.raises(moe_ep.errors.IntegrationError, match="needs a gradient") as e:
                block(x.requires_grad_())
            with torch.no_grad():
                assert torch.isfinite(block(x)).all()
        else:
            with pytest.raises(moe_ep.errors.IntegrationError, match="needs a gradient") as e:
                model(ids, labels=ids).loss.backward()
            with pytest.raises(moe_ep.errors.IntegrationError, match="needs a gradient"):
                model(ids)  # a plain forward under grad mode: the parameters require grad, so the hidden states do
            with torch.no_grad():
                assert torch.isfinite(model(ids).logits).all()
            model.requires_grad_(False)  # nothing left to differentiate: runs under grad mode
            assert torch.isfinite(model(ids).logits).all()
        assert e.value.argument == "model.layers.0.mlp.experts"
        assert all(p.grad is None for p in model.parameters())
    finally:
        close(model)


def test_conversions_work_whole_or_are_refused_before_any_parameter_changes(group):
    from moe_ep.integrations.transformers import close
    from moe_ep.testing import hf_models

    ref = _tiny("mixtral").to(torch.float16)
    ids = hf_models.prompt_ids(2, 10, seed=7, vocab=200)
    want = hf_models.reference_run(ref, ids, 16)
    model = _tiny("mixtral")
    _swapped(model)
    try:
        assert model.to(torch.bfloat16) is model and model.to("cpu") is model  # no-ops
        state = {k: v.clone() for k, v in model.state_dict().items()}
        for refused, err in ((lambda: model.to(torch.float64), moe_ep.errors.DTypeError),
                             (lambda: model.double(), moe_ep.errors.DTypeError),
                             (lambda: model.model.layers[0].to("meta"), moe_ep.errors.DeviceError)):
            with pytest.raises(err):
                refused()
            after = model.state_dict()
            assert all(after[k].dtype == state[k].dtype and torch.equal(after[k], state[k]) for k in state)
        with pytest.raises(moe_ep.errors.IntegrationError, match="cannot be copied"):
            copy.deepcopy(model)
        model.to(torch.float16)  # the whole model in fp16; the experts keep their format and return fp16
        assert model.model.embed_tokens.weight.dtype == torch.float16
        r = hf_models.compare_run(model, want, 16, logits_tol=LOGITS_TOL["bf16"])
        assert r["ok"], r
    finally:
        close(model)
    fp32 = _tiny("mixtral", dtype=torch.float32)
    _swapped(fp32)
    try:
        assert fp32.float() is fp32
    finally:
        close(fp32)


def test_moe_ep_imports_without_transformers():
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'transformers': raise ImportError('transformers is not installed')\n"
            "sys.meta_path.insert(0, Block())\n"
            "import moe_ep, moe_ep.integrations.transformers as t, moe_ep.testing.hf_models\n"
            "import moe_ep.testing.hf_matrix\n"
            "try:\n"
            "    t.swap_experts(None)\n"
            "except moe_ep.errors.IntegrationError as e:\n"
            "    print('ARG', e.argument)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "ARG transformers" in res.stdout, res.stdout + res.stderr


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"] + sys.argv[1:]))
