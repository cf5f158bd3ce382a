"""The sm100 backends as moe_ep sees them on a CPU host: registered under their names, cheap to list and to
ask about a spec, and refused with a typed error naming the device when a layer asks for them here."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import moe_ep
from moe_ep.core import registry
from tests.support.dist import one_rank_gloo_group

BACKENDS = {
    "sm100_nvfp4_cutedsl": ("shim.sm100.backend", "Sm100Nvfp4Backend", "nvfp4"),
    "sm100_mxfp8_cutedsl": ("shim.sm100.backend", "Sm100Mxfp8Backend", "mxfp8"),
    "sm100_bf16_cutedsl": ("shim.sm100.backend", "Sm100Bf16Backend", "bf16"),
}


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_registered_and_resolvable(name):
    module, attr, fmt = BACKENDS[name]
    entry = registry.get_entry(name)
    assert entry.target == f"{module}:{attr}" and entry.arch == "sm100" and entry.formats == (fmt,)
    cls = registry.resolve_backend(name)
    assert cls.__name__ == attr and cls.name == name and cls.arch == "sm100" and cls.weight_formats == (fmt,)
    assert issubclass(cls, moe_ep.Backend)
    assert moe_ep.list_backends()[name].available


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_the_oracle_folds_the_routing_weight_into_fc1_as_the_kernels_do(name):
    """The MXFP8 kernel lost its apply_topk_in_fc1 flag in drop 0.7.4 (always folded); the frontends pass True to
    the other two. The property the oracle reads must say so without a device."""
    cls = registry.resolve_backend(name)
    assert cls.apply_topk_in_fc1.fget(object.__new__(cls)) is True


def test_listing_and_spec_checks_load_no_kernel_tree():
    code = textwrap.dedent("""
        import sys
        import moe_ep
        from moe_ep.core import registry
        spec = moe_ep.MoESpec(hidden_size=7168, intermediate_size=2048, num_experts=256, top_k=8,
                              max_tokens_per_rank=512)
        for name in ("sm100_nvfp4_cutedsl", "sm100_mxfp8_cutedsl", "sm100_bf16_cutedsl"):
            cls = registry.resolve_backend(name)
            assert cls.check_spec(spec, cls.weight_formats[0], 4) == [], name
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in
                        ("cutlass", "common", "src", "moe_nvfp4_swapab", "moe_mxfp8_glu", "moe_bf16_glu"))
        assert not loaded, loaded
        from shim.common import tree
        assert tree.active_tree() is None
        print("CLEAN")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p)))
    assert proc.returncode == 0 and "CLEAN" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("name, spec_kw, arguments", [
    ("sm100_nvfp4_cutedsl", dict(hidden_size=7200, intermediate_size=2048), ["hidden_size"]),
    ("sm100_mxfp8_cutedsl", dict(hidden_size=7168, intermediate_size=2080), ["intermediate_size"]),
    ("sm100_mxfp8_cutedsl", dict(hidden_size=2880, intermediate_size=2880), ["hidden_size"]),  # 0.7.4: H % 128
    ("sm100_bf16_cutedsl", dict(hidden_size=7168, intermediate_size=2048, top_k=40, num_experts=64), ["top_k"]),
    ("sm100_bf16_cutedsl", dict(hidden_size=7184, intermediate_size=2056), ["hidden_size", "intermediate_size"]),
])
def test_check_spec_names_what_the_kernel_cannot_serve(name, spec_kw, arguments):
    kw = dict(num_experts=256, top_k=8, max_tokens_per_rank=512)
    kw.update(spec_kw)
    spec = moe_ep.MoESpec(**kw)
    cls = registry.resolve_backend(name)
    problems = cls.check_spec(spec, cls.weight_formats[0], 4)
    assert sorted({a for a, _ in problems}) == sorted(arguments), problems


@pytest.fixture(scope="module")
def gloo_group():
    with one_rank_gloo_group():
        yield


def test_a_layer_refuses_a_format_the_backend_does_not_serve(gloo_group, monkeypatch):
    from moe_ep import layer as layer_module

    # As on a Blackwell host: the layer's arch guard passes (on this CPU host it would refuse first).
    monkeypatch.setattr(layer_module, "require_arch", lambda *a, **k: None)
    spec = moe_ep.MoESpec(hidden_size=256, intermediate_size=128, num_experts=4, top_k=2, max_tokens_per_rank=16)
    weights = moe_ep.ExpertWeights(torch.zeros(4, 256, 256, dtype=torch.bfloat16),
                                   torch.zeros(4, 256, 128, dtype=torch.bfloat16), rank=0, world_size=1, num_experts=4)
    with pytest.raises(moe_ep.FormatError) as err:
        moe_ep.MoELayer(spec, weights, backend="sm100_mxfp8_cutedsl", fmt="bf16")
    assert err.value.argument == "fmt" and "mxfp8" in str(err.value)


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_a_layer_on_this_host_is_refused_naming_the_device(gloo_group, name):
    fmt = BACKENDS[name][2]
    spec = moe_ep.MoESpec(hidden_size=256, intermediate_size=128, num_experts=4, top_k=2, max_tokens_per_rank=16)
    w13 = torch.zeros(4, 256, 256, dtype=torch.bfloat16)
    w2 = torch.zeros(4, 256, 128, dtype=torch.bfloat16)
    cal = dict(act_amax=1.0, fc2_act_amax=1.0) if fmt == "nvfp4" else {}
    weights = moe_ep.ExpertWeights(w13, w2, rank=0, world_size=1, num_experts=4, **cal)
    with pytest.raises(moe_ep.BackendUnavailableError) as err:
        moe_ep.MoELayer(spec, weights, backend=name)
    # The layer's arch guard (moe_ep.core.device.require_arch), before the backend's module is imported.
    assert err.value.argument == "backend" and "sm100" in str(err.value) and "device is cpu" in str(err.value)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
