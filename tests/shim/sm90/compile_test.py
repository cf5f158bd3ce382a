"""The Hopper FP8 and BF16 MegaMoE kernels compile through the shim on a machine with no GPU (CUTE_DSL_ARCH=sm_90a).

One small config per operand order (swap-AB and not), with capacity-sized fake
tensors whose extents are symbolic: the same program a GPU run builds.
"""
import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

pytestmark = pytest.mark.usefixtures("sm90_tree")


@pytest.mark.parametrize("capacity", [64, 1024])  # heuristic picks swap-AB at 64, non-swap at 1024
def test_fp8_kernel_compiles_on_cpu(capacity):
    from shim.common import compile_cache
    from shim.sm90.fp8_frontend import Sm90Fp8Frontend

    f = Sm90Fp8Frontend(hidden=512, intermediate=256, experts_per_rank=4, top_k=2, capacity=capacity,
                        compile_only=True)
    assert f.knobs.swap_ab == (capacity == 64)
    compiled = f.compile()
    assert compiled is not None and callable(compiled)
    again = Sm90Fp8Frontend(hidden=512, intermediate=256, experts_per_rank=4, top_k=2, capacity=capacity,
                            compile_only=True)
    assert again.compile() is compiled and again.compiled_from_cache
    assert compile_cache.stats()["compiles"] >= 1


@pytest.mark.parametrize("capacity", [64, 2048])
def test_bf16_kernel_compiles_on_cpu(capacity):
    from shim.sm90.bf16_frontend import Sm90Bf16Frontend

    f = Sm90Bf16Frontend(hidden=512, intermediate=256, experts_per_rank=4, top_k=2, capacity=capacity,
                         compile_only=True)
    assert f.knobs.kernel == "Sm90MegaMoEBf16Kernel" and f.knobs.mma_tiler_mnk[2] == 64
    assert callable(f.compile())


@pytest.mark.parametrize("backend", ["sm90_fp8_cutedsl", "sm90_bf16_cutedsl"])
def test_backend_builds_its_frontend_the_way_the_layer_does(backend):
    """The backends construct frontends with fmt= plus the layer's keywords (Sm90KernelBackend.make_frontend)."""
    from moe_ep.core.registry import resolve_backend

    cls = resolve_backend(backend)
    fmt = cls.weight_formats[0]
    f = cls.frontend_class()(fmt=fmt, knobs=None, hidden=512, intermediate=256, experts_per_rank=4, top_k=2,
                             capacity=64, rank=0, world_size=1, group=None, device=None, gate_up_clamp=None,
                             knob_cache_key="k", max_active_clusters=None, compile_only=True)
    assert f.fmt == fmt and f.knobs.kernel.startswith("Sm90MegaMoE")
    with pytest.raises(ValueError, match="fmt"):
        cls.frontend_class()(fmt="nvfp4", hidden=512, intermediate=256, experts_per_rank=4, top_k=2, capacity=64,
                             compile_only=True)


def test_bad_geometry_is_refused_before_compiling():
    from shim.sm90.fp8_frontend import Sm90Fp8Frontend

    with pytest.raises(ValueError, match="hidden=500"):
        Sm90Fp8Frontend(hidden=500, intermediate=256, experts_per_rank=4, top_k=2, capacity=64, compile_only=True)
    with pytest.raises(ValueError, match="fmt must be one of"):
        Sm90Fp8Frontend(fmt="int4", hidden=512, intermediate=256, experts_per_rank=4, top_k=2, capacity=64,
                        compile_only=True)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
