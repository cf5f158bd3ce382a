"""The Hopper FP8 (blockwise and per-tensor), BF16 and W4A8 MXFP4 MegaMoE kernels compile through the shim on a
machine with no GPU (CUTE_DSL_ARCH=sm_90a).

One small config per operand order (swap-AB and not) for blockwise FP8 and BF16, one each for per-tensor FP8 and
W4A8 (its only order), with capacity-sized fake tensors whose extents are symbolic: the same program a GPU run
builds. The frontends are built the way a layer builds them
(shim.common.backend.compile_only_frontend: the backend's rules, knob resolution, its frontend class).
"""
import os

import pytest

import moe_ep

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

pytestmark = pytest.mark.usefixtures("sm90_tree")


def _spec(capacity, **kw):
    geom = dict(hidden_size=512, intermediate_size=256, num_experts=4, top_k=2, max_tokens_per_rank=capacity)
    geom.update(kw)
    return moe_ep.MoESpec(**geom)


@pytest.mark.parametrize("capacity", [64, 1024])  # heuristic picks swap-AB at 64, non-swap at 1024
def test_fp8_kernel_compiles_on_cpu(capacity):
    from shim.common import compile_cache
    from shim.common.backend import compile_only_frontend

    f = compile_only_frontend("sm90_fp8_cutedsl", _spec(capacity))
    assert type(f).__name__ == "Sm90Fp8Frontend" and f.fmt == "fp8_block"
    assert f.knobs.swap_ab == (capacity == 64)
    # The kernel the frontend builds is the one its format table row names (plain, or swap-AB by the knob).
    assert type(f.kernel).__name__ == f.row.kernel_classes[int(f.knobs.swap_ab)]
    compiled = f.compile()
    assert compiled is not None and callable(compiled)
    again = compile_only_frontend("sm90_fp8_cutedsl", _spec(capacity))
    assert again.compile() is compiled and again.compiled_from_cache
    assert compile_cache.stats()["compiles"] >= 1


@pytest.mark.parametrize("capacity", [64, 2048])
def test_bf16_kernel_compiles_on_cpu(capacity):
    from shim.common.backend import compile_only_frontend

    f = compile_only_frontend("sm90_bf16_cutedsl", _spec(capacity))
    assert type(f).__name__ == "Sm90Bf16Frontend"
    assert f.knobs.kernel == "Sm90MegaMoEBf16Kernel" and f.knobs.mma_tiler_mnk[2] == 64
    assert type(f.kernel).__name__ == f.row.kernel_classes[int(f.knobs.swap_ab)]
    assert callable(f.compile())


def test_fp8_tensor_kernel_compiles_on_cpu():
    from shim.common.backend import compile_only_frontend

    f = compile_only_frontend("sm90_fp8_tensor_cutedsl", _spec(64))
    assert type(f).__name__ == "Sm90Fp8TensorFrontend" and f.fmt == "fp8_tensor"
    assert f.kernel.fp8_scale_mode == "per_tensor" and f.knobs.kernel == "Sm90MegaMoEFp8Kernel"
    assert callable(f.compile())


def test_w4a8_mxfp4_kernel_compiles_on_cpu():
    from shim.common.backend import compile_only_frontend

    f = compile_only_frontend("sm90_w4a8_mxfp4_cutedsl", _spec(64))
    assert type(f).__name__ == "Sm90W4A8Frontend" and f.fmt == "w4a8_mxfp4"
    assert type(f.kernel).__name__ == "Sm90MegaMoESwapABMxfp4Fp8Kernel" and f.kernel.fp8_scale_mode == "mxfp4_hybrid"
    assert f.knobs.swap_ab and f.knobs.mma_tiler_mnk == (256, 16, 256)  # the K-256 tile at this capacity
    assert callable(f.compile())


@pytest.mark.parametrize("knobs, argument", [
    (dict(swap_ab=False), "swap_ab"),                                            # the kernel has no plain order
    (dict(mma_tiler_mnk=(256, 16, 128), pingpong=True), "pingpong"),             # ping-pong needs tile M 128
    (dict(mma_tiler_mnk=(64, 128, 128)), "mma_tiler_mnk"),                       # not a W4A8 tile
    (dict(fc2_in_kernel_topk_reduce=True), "fc2_in_kernel_topk_reduce"),         # no in-kernel reduce
])
def test_w4a8_knob_sets_the_kernel_cannot_build_are_typed_errors(knobs, argument):
    from shim.common.backend import compile_only_frontend

    with pytest.raises(moe_ep.errors.KnobError) as e:
        compile_only_frontend("sm90_w4a8_mxfp4_cutedsl", _spec(64), knobs=knobs)
    assert e.value.argument == argument


def test_w4a8_geometry_is_refused_with_a_typed_error():
    from shim.common.backend import compile_only_frontend

    with pytest.raises(moe_ep.SpecError, match="hidden_size") as e:  # gpt-oss's hidden size
        compile_only_frontend("sm90_w4a8_mxfp4_cutedsl", _spec(64, hidden_size=2880))
    assert "128" in str(e.value)


def test_bad_geometry_is_refused_before_any_kernel_is_built():
    from shim.common.backend import compile_only_frontend

    with pytest.raises(moe_ep.SpecError, match="hidden_size") as e:
        compile_only_frontend("sm90_fp8_cutedsl", _spec(64, hidden_size=576))
    assert e.value.argument == "hidden_size"
    with pytest.raises(moe_ep.SpecError, match="top_k"):
        compile_only_frontend("sm90_bf16_cutedsl", _spec(64, num_experts=64, top_k=33))


def test_a_knob_set_the_kernel_rejects_is_a_typed_error_before_compiling():
    from shim.common.backend import compile_only_frontend

    # The FP8 kernel refuses ping-pong with the non-swap (64, 256, 128) tile (measured on the H200).
    with pytest.raises(moe_ep.errors.KnobError) as e:
        compile_only_frontend("sm90_fp8_cutedsl", _spec(1024), knobs=dict(
            swap_ab=False, mma_tiler_mnk=(64, 256, 128), cluster_shape_mnk=(1, 1, 1), pingpong=True))
    assert e.value.argument == "knobs"


def test_the_tuners_build_check_asks_the_kernels_constructor():
    """shim.sm90.tune.build_check: the kernel's constructor alone (no buffers, no compile) says which knob sets it
    takes, for the format table row the check is given."""
    from shim.sm90.formats import BACKENDS
    from shim.sm90.knobs import heuristic_knobs
    from shim.sm90.tune import build_check

    row = BACKENDS.row("fp8_block")
    accepts = build_check(row.frontend_class(), _spec(1024), row=row)
    base = heuristic_knobs("fp8_block", 1024)
    assert accepts(base)
    assert not accepts(base.replace(swap_ab=False, mma_tiler_mnk=(64, 256, 128), cluster_shape_mnk=(1, 1, 1),
                                    pingpong=True))


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
