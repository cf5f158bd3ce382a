"""The three Blackwell MegaMoE kernels compile through the shim without a GPU (CUTE_DSL_ARCH=sm_100a).

One small geometry per kernel and per token-back family of its heuristic (epilogue warps at small
capacity, dispatch warps at large), with capacity-sized fake tensors whose extents are symbolic: the
program a GPU run builds. The PTX is kept and must target the requested arch (sm_100a unless set
otherwise); no kernel runs.
"""
import os
import tempfile
import time

import pytest

# Read by cutlass when it is first imported (no test module imports it at collection).
os.environ.setdefault("CUTE_DSL_ARCH", "sm_100a")
os.environ.setdefault("CUTE_DSL_KEEP_PTX", "1")
os.environ.setdefault("CUTE_DSL_DUMP_DIR", tempfile.mkdtemp(prefix="sm100_ptx_", dir=os.environ.get("TEST_TMPDIR")))

pytestmark = pytest.mark.usefixtures("sm100_tree")

from tests.shim.sm100.helpers import compile_only  # noqa: E402

GEOM = dict(hidden=512, intermediate=256, experts_per_rank=4, top_k=2)
CASES = [  # (fmt, capacity, token-back mode the heuristic picks there)
    ("nvfp4", 64, "epi_warps"),
    ("nvfp4", 1024, "standalone_warps"),
    ("mxfp8", 64, "epi_warps"),
    ("mxfp8", 4096, "reuse_dispatch_warps"),
    ("bf16", 64, "epi_warps"),
]
KERNEL = {"nvfp4": "Sm100MegaMoEKernel", "mxfp8": "Sm100MegaMoEMxfp8Kernel", "bf16": "Sm100MegaMoEBf16Kernel"}


@pytest.mark.parametrize("fmt, capacity, token_back", CASES)
def test_kernel_compiles_on_cpu_for_sm100a(fmt, capacity, token_back):
    from shim.common import compile_cache
    from shim.sm100.knobs import heuristic_knobs

    f = compile_only(fmt, **GEOM, capacity=capacity)
    assert f.knobs.token_back_mode == token_back and f.knobs == heuristic_knobs(fmt, capacity)
    assert (type(f.kernel).__name__,) == f.row.kernel_classes == (KERNEL[fmt],)  # the format table's row
    t0 = time.perf_counter()
    compiled = f.compile()
    seconds = time.perf_counter() - t0
    print(f"{fmt} capacity={capacity} {f.knobs}: compiled in {seconds:.1f} s")
    assert callable(compiled) and compiled.has_gpu_module
    assert any(KERNEL[fmt] in name for name in compiled.kernel_info), list(compiled.kernel_info)
    ptx = compiled.artifacts.PTX
    assert ptx and f".target {os.environ['CUTE_DSL_ARCH']}" in ptx
    again = compile_only(fmt, **GEOM, capacity=capacity)
    assert again.compile() is compiled and again.compiled_from_cache
    assert compile_cache.stats()["compiles"] >= 1


@pytest.mark.parametrize("fmt, token_back", [
    ("nvfp4", "epi_warps"), ("nvfp4", "reuse_dispatch_warps"), ("mxfp8", "epi_warps"), ("bf16", "reuse_dispatch_warps"),
])
def test_in_kernel_reduce_variants_compile(fmt, token_back):
    """The opt-in in-kernel top-k reduce (nondeterministic summation order) builds a different program."""
    from shim.sm100.knobs import heuristic_knobs

    knobs = heuristic_knobs(fmt, 64).replace(fc2_in_kernel_topk_reduce=True, token_back_mode=token_back)
    f = compile_only(fmt, **GEOM, capacity=64, knobs=knobs)
    assert f.sym_out is not None  # the cross-rank adds land in a symmetric output
    compiled = f.compile()
    assert compiled.has_gpu_module and f".target {os.environ['CUTE_DSL_ARCH']}" in compiled.artifacts.PTX


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8", "bf16"])
def test_each_kernel_chains_its_topk_reduce_into_the_same_program(fmt):
    """Without the in-kernel reduce, each launch also runs the drop's TopkReduce on the same stream (BF16 too
    since 0.7.4); the MXFP8 launch then runs the column re-quantization of the received tokens."""
    f = compile_only(fmt, **GEOM, capacity=64)
    names = list(f.compile().kernel_info)
    assert any("TopkReduce" in n for n in names), names
    assert any("Mxfp8ColRequant" in n for n in names) == (fmt == "mxfp8"), names


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-s"]))
