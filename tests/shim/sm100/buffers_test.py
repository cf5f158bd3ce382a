"""Workspace and symmetric-buffer sizing of the Blackwell frontends, and what they refuse, on CPU.

compile_only frontends build the real kernel objects (their constructors size the workspaces) and
allocate every buffer in host memory, so the sizes a GPU run would allocate are checked here against the
kernels' own numbers; activation staging is checked byte for byte against moe_ep's quantizers.
"""
import pytest
import torch

from moe_ep.formats import packs
import moe_ep
from tests.shim.sm100.helpers import canonical_weights, compile_only, expert_weights, same_bytes

pytestmark = pytest.mark.usefixtures("sm100_tree")

GEOM = dict(hidden=512, intermediate=256, experts_per_rank=4, top_k=3, capacity=96)


def _frontend(fmt, **kw):
    args = dict(GEOM, world_size=2, rank=1)
    args.update(kw)
    return compile_only(fmt, **args)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8", "bf16"])
def test_workspaces_are_the_kernels_sizes(fmt):
    f = _frontend(fmt)
    local, shared = f.kernel.get_workspace_sizes()
    assert f.local_ws.dtype == torch.uint8 and f.local_ws.numel() == local > 0
    assert f.shared_ws.dtype == torch.uint8 and f.shared_ws.numel() == shared > 0
    c, k, h = GEOM["capacity"], GEOM["top_k"], GEOM["hidden"]
    assert tuple(f.topk_idx.shape) == (c, k) and f.topk_idx.dtype == torch.int64
    assert tuple(f.topk_w.shape) == (c, k) and f.topk_w.dtype == torch.float32
    # The kernel object was built for this geometry and these knobs.
    kern = f.kernel
    assert (kern.world_size, kern.num_topk, kern.max_tokens_per_rank, kern.hidden) == (2, k, c, h)
    assert kern.num_experts_per_rank == GEOM["experts_per_rank"]
    assert kern.intermediate_gateup == 2 * GEOM["intermediate"]
    assert kern.token_back_mode == f.knobs.token_back_mode and kern.apply_topk_in_fc1
    assert not kern.combine_format.is_quantized


@pytest.mark.parametrize("fmt, blk, act_cols, act_dtype, sf_dtype", [
    ("nvfp4", 16, 256, torch.float4_e2m1fn_x2, torch.float8_e4m3fn),
    ("mxfp8", 32, 512, torch.float8_e4m3fn, torch.float8_e8m0fnu),
])
def test_block_scaled_inputs_match_what_dispatch_pulls(fmt, blk, act_cols, act_dtype, sf_dtype):
    f = _frontend(fmt)
    c, h = GEOM["capacity"], GEOM["hidden"]
    assert f.act.dtype == act_dtype and tuple(f.act.shape) == (c, act_cols)
    assert f.act.numel() * f.act.element_size() == f.kernel.hidden_bytes * c
    # Scale rows padded to whole 32-bit words: exactly what the kernel's dispatch moves per token.
    assert f.act_sf.dtype == sf_dtype and tuple(f.act_sf.shape) == (c, f.kernel.sf_uint32_per_token * 4)
    assert f.act_sf.shape[1] == -(-(h // blk) // 4) * 4


def test_bf16_terms_are_staged_in_the_kernels_shared_workspace():
    """Since 0.7.4 the BF16 kernel keeps its [C, K, H] bf16 terms in its own shared workspace and reduces them
    itself: the frontend holds no term buffer; with the in-kernel reduce the output is the symmetric [C, H]."""
    from shim.sm100.knobs import heuristic_knobs

    c, k, h = GEOM["capacity"], GEOM["top_k"], GEOM["hidden"]
    f = _frontend("bf16")
    assert f.act.dtype == torch.bfloat16 and tuple(f.act.shape) == (c, h)
    assert not hasattr(f, "combine") and f.sym_out is None and not f.kernel.skip_topk_reduce
    ikr = heuristic_knobs("bf16", c).replace(fc2_in_kernel_topk_reduce=True, token_back_mode="reuse_dispatch_warps")
    g = _frontend("bf16", knobs=ikr)
    assert g.kernel.fc2_in_kernel_topk_reduce and tuple(g.sym_out.shape) == (c, h) and g.out_buf is g.sym_out
    # The staging region is what the in-kernel reduce saves.
    assert f.kernel.get_workspace_sizes()[1] - g.kernel.get_workspace_sizes()[1] >= c * k * h * 2


def test_mxfp8_column_requant_outputs_are_sized_from_the_kernels_pool():
    """0.7.4's MXFP8 launch ends by re-quantizing the received tokens along the token axis into two outputs
    the caller hands it: [pool rows, H] e4m3 and one e8m0 byte per 32 tokens and column. Rank-local, and
    sized as the drop's runner sizes them."""
    f = _frontend("mxfp8")
    kern, h = f.kernel, GEOM["hidden"]
    pool = kern.pool_token_capacity
    assert kern.token_padding_block == 128 and kern.token_padding_block in kern.col_quant.TokenPaddingBlocks
    assert f.col_quant_data.dtype == torch.float8_e4m3fn and tuple(f.col_quant_data.shape) == (pool, h)
    assert f.col_quant_sf.dtype == torch.uint8 and tuple(f.col_quant_sf.shape) == (h * pool // 32,)
    # Every pool row the scheduler may fill: world x capacity x min(K, E_local) tokens, each expert padded.
    w, c, k, e = 2, GEOM["capacity"], GEOM["top_k"], GEOM["experts_per_rank"]
    assert pool >= w * c * min(k, e) and kern.col_quant.max_total_tokens == w * c * min(k, e)
    assert kern.col_quant.hidden == h and kern.col_quant.num_experts == e


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8", "bf16"])
def test_symmetric_bytes_is_the_sum_of_heap_buffers(fmt):
    f = _frontend(fmt)
    c, k, h = GEOM["capacity"], GEOM["top_k"], GEOM["hidden"]
    shared = f.kernel.get_workspace_sizes()[1]
    if fmt == "bf16":
        act = c * h * 2  # activations (the per-slot terms are in the shared workspace)
    else:
        act = c * h // (2 if fmt == "nvfp4" else 1) + c * f.act_sf.shape[1]
    assert f.symmetric_bytes() == shared + act + c * k * 4


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8", "bf16"])
def test_staged_activations_are_the_reference_quantization(fmt):
    w13, w2 = canonical_weights(GEOM["experts_per_rank"], GEOM["hidden"], GEOM["intermediate"])
    f = _frontend(fmt)
    cal = dict(act_amax=5.0, fc2_act_amax=0.5) if fmt == "nvfp4" else {}
    f.load_weights(expert_weights(w13, w2, rank=1, world_size=2, **cal))
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(37, GEOM["hidden"], generator=g) * 2).to(torch.bfloat16)
    x[4, :64] = 0
    f.act[37:].view(torch.uint8).fill_(0xA5)  # the staging arena is shared: whatever an earlier layer left
    f.act_sf.view(torch.uint8).fill_(0x5A) if fmt != "bf16" else None
    f.stage_activations(x)
    got = f.staged_activation(37)
    want = packs.quantize_input(f.weights.canonical(), x)
    assert got.fmt == fmt and same_bytes(got.q, want.q)
    if fmt != "bf16":
        assert same_bytes(got.scale, want.scale)
        pad = f.act_sf[:, want.scale.shape[1]:]
        assert pad.numel() == 0 or not pad.view(torch.uint8).any()  # the word padding stays zero
    assert bool((f.act[37:].view(torch.uint8) == 0xA5).all())  # rows past T untouched


@pytest.mark.parametrize("fmt, change, argument, message", [
    ("nvfp4", dict(hidden=480), "hidden_size", "must be a multiple of 64"),
    ("mxfp8", dict(hidden=448), "hidden_size", "must be a multiple of 128"),
    ("bf16", dict(intermediate=48), "intermediate_size", "must be a multiple of 32"),
    ("mxfp8", dict(top_k=33, experts_per_rank=40), "top_k", "must be in"),
    ("fp8_block", {}, "fmt", "the sm100 kernels serve"),
])
def test_bad_geometry_names_the_argument_before_anything_is_built(fmt, change, argument, message):
    """The backend's rules (its row of shim/sm100/formats.py), asked as the layer asks them, before any kernel
    object."""
    with pytest.raises(moe_ep.SpecError, match=message) as err:
        _frontend(fmt, **change)
    assert err.value.argument == argument


def test_the_mxfp8_hidden_rule_is_the_drops_own(monkeypatch):
    """The format table asks H % 128 for MXFP8 because the drop's kernel refuses anything else (its column
    requant): with the rule relaxed, the kernel's own constructor refuses."""
    import dataclasses

    from shim.sm100.backend import Sm100Mxfp8Backend
    from shim.sm100.knobs import InvalidKnobsError

    relaxed = dataclasses.replace(Sm100Mxfp8Backend.row, hidden_multiple=64)
    monkeypatch.setattr(Sm100Mxfp8Backend, "row", relaxed)
    with pytest.raises(InvalidKnobsError, match="hidden=448 is not supported") as err:
        _frontend("mxfp8", hidden=448)
    assert isinstance(err.value, moe_ep.errors.KnobError)


def test_a_knob_set_the_kernel_cannot_build_is_refused_by_name():
    from shim.sm100.knobs import InvalidKnobsError, heuristic_knobs

    k = heuristic_knobs("mxfp8", 96).replace(fc2_in_kernel_topk_reduce=True, token_back_mode="standalone_warps")
    with pytest.raises(InvalidKnobsError) as err:
        _frontend("mxfp8", knobs=k)
    assert err.value.knob == "fc2_in_kernel_topk_reduce"
    with pytest.raises(InvalidKnobsError) as err:
        _frontend("nvfp4", knobs={"mma_tiler_mnk": (256, 96, 256)})
    assert err.value.knob == "mma_tiler_mnk"


def test_compile_only_needs_the_blackwell_target(monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")  # e.g. a Hopper build environment
    with pytest.raises(moe_ep.BackendUnavailableError, match="CUTE_DSL_ARCH=sm_100a"):
        _frontend("bf16")


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
