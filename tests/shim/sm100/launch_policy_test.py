"""The forward path of the Blackwell frontends around the launch, on CPU with a stand-in kernel.

The compiled kernel is replaced by a function that sees the very tensors a launch would be handed (the
argument builder is swapped for one that passes torch tensors through), so what is checked is the
frontend's own policy: capacity-sized inputs with spare rows routed to expert -1, the output extent, the
argument cache, the in-kernel-reduce zeroing, the MXFP8 column-requant outputs. Since 0.7.4 all three kernels
sum their top-k terms themselves, so the three share one launch path.
"""
import pytest
import torch

from tests.shim.sm100.helpers import canonical_weights, compile_only, expert_weights

pytestmark = pytest.mark.usefixtures("sm100_tree")

GEOM = dict(hidden=256, intermediate=128, experts_per_rank=4, top_k=4, capacity=32)


class PassThroughArgs:
    """ArgBuilder stand-in: the kernel 'arguments' are the torch tensors themselves."""

    def __init__(self, real: bool):
        self.real = real

    def tensor(self, t, align=16):
        return t

    def byte_ptr(self, t, align=16):
        return t

    def static_tensor(self, t, align=16):
        return ("static", t)

    def stream(self):
        return "stream"


@pytest.fixture
def frontend(monkeypatch):
    import shim.common.frontend
    import shim.sm100.frontend

    monkeypatch.setattr(shim.common.frontend, "ArgBuilder", PassThroughArgs)
    monkeypatch.setattr(shim.sm100.frontend, "ArgBuilder", PassThroughArgs)

    def make(fmt, knobs=None):
        f = compile_only(fmt, **GEOM, knobs=knobs)
        cal = dict(act_amax=4.0, fc2_act_amax=1.0) if fmt == "nvfp4" else {}
        f.load_weights(expert_weights(*canonical_weights(GEOM["experts_per_rank"], GEOM["hidden"],
                                                         GEOM["intermediate"]), **cal))
        f.launches = []
        return f

    return make


def _inputs(t, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, GEOM["hidden"], generator=g).to(torch.bfloat16)
    idx = torch.randint(0, 4, (t, GEOM["top_k"]), generator=g)
    w = torch.rand(t, GEOM["top_k"], generator=g)
    return x, idx, w


def _kernel_writing_output(f, value):
    def kernel(**args):
        kept = ("local_workspace", "shared_workspace", "col_quant_data", "col_quant_sf")  # by identity
        f.launches.append({k: (v.clone() if isinstance(v, torch.Tensor) and k not in kept else v)
                           for k, v in args.items()})
        args["output_activation"].fill_(value)
    return kernel


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8", "bf16"])
@pytest.mark.parametrize("t", [0, 1, 19, 32])
def test_inputs_are_capacity_sized_and_spare_rows_are_masked(frontend, fmt, t):
    f = frontend(fmt)
    f.compiled = _kernel_writing_output(f, 7.0)
    x, idx, w = _inputs(t)
    f.topk_idx.fill_(3)  # stale routing from an earlier, larger call
    out = torch.zeros(t, GEOM["hidden"], dtype=torch.bfloat16)
    got = f.forward(x, idx, w, out)
    assert got is out and bool((out == 7.0).all())
    (a,) = f.launches
    c = GEOM["capacity"]
    assert a["activation"].shape[0] == c and (fmt == "bf16" or a["activation_sf"].shape[0] == c)
    assert a["topk_idx"].shape[0] == c and a["topk_weights"].shape[0] == c
    assert torch.equal(a["topk_idx"][:t], idx) and bool((a["topk_idx"][t:] == -1).all())
    assert torch.equal(a["topk_weights"][:t], w)
    # The top-k reduce covers the real rows only (one row when T = 0, so the launch stays well formed).
    assert a["output_activation"].shape[0] == max(t, 1)
    assert a["peer_rank_ptr_mapper_host"].num_max_ranks == 1 and a["stream"] == "stream"
    if fmt in ("mxfp8", "bf16"):
        # Byte tensors, not pointers; the local one with its extent compiled in, as the drop's runners do (the
        # MXFP8 runner the shared one too since 0.7.4).
        kind, local = a["local_workspace"]
        assert a["fc1_c"] is None and kind == "static" and local is f.local_ws
        if fmt == "mxfp8":
            kind, shared = a["shared_workspace"]
            assert kind == "static" and shared is f.shared_ws
            # The column requant's outputs: the frontend's own rank-local buffers, the same every launch.
            assert a["col_quant_data"] is f.col_quant_data and a["col_quant_sf"] is f.col_quant_sf
        else:
            assert a["shared_workspace"] is f.shared_ws and "col_quant_data" not in a
    else:
        assert set(a) >= {"fc1_alpha", "fc2_alpha", "fc1_norm_const"} and "fc1_c" not in a


def test_arguments_are_built_once_per_output_buffer(frontend):
    f = frontend("mxfp8")
    f.compiled = _kernel_writing_output(f, 1.0)
    x, idx, w = _inputs(5)
    out = torch.empty(5, GEOM["hidden"], dtype=torch.bfloat16)
    f.forward(x, idx, w, out)
    f.forward(x, idx, w, out)
    assert len(f._args_cache) == 1
    f.forward(x[:3], idx[:3], w[:3])
    assert len(f._args_cache) == 2


def test_in_kernel_reduce_output_is_zeroed_before_every_launch(frontend):
    from shim.sm100.knobs import heuristic_knobs

    f = frontend("nvfp4", heuristic_knobs("nvfp4", GEOM["capacity"]).replace(fc2_in_kernel_topk_reduce=True))
    seen = []

    def kernel(**args):
        o = args["output_activation"]
        seen.append(float(o[:6].abs().sum()))
        o.add_(2.0)  # accumulate, as the cross-rank atomic adds do
    f.compiled = kernel
    x, idx, w = _inputs(6)
    for _ in range(2):
        out = f.forward(x, idx, w)
        assert bool((out == 2.0).all())
    assert seen == [0.0, 0.0]


@pytest.mark.parametrize("fmt", ["mxfp8", "bf16"])
def test_in_kernel_reduce_output_is_the_symmetric_buffer_for_every_kernel(frontend, fmt):
    from shim.sm100.knobs import heuristic_knobs

    tb = "epi_warps" if fmt == "mxfp8" else "reuse_dispatch_warps"
    f = frontend(fmt, heuristic_knobs(fmt, GEOM["capacity"]).replace(fc2_in_kernel_topk_reduce=True,
                                                                    token_back_mode=tb))

    def kernel(**args):
        o = args["output_activation"]
        assert o.data_ptr() == f.sym_out.data_ptr() and not o.abs().sum()
        o.add_(3.0)
    f.compiled = kernel
    out = f.forward(*_inputs(4))
    assert bool((out == 3.0).all())


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8", "bf16"])
def test_a_graphed_launch_leaves_the_result_where_the_replay_reads_it(frontend, fmt):
    """Inside the base's per-token-count CUDA graph the launch has no `out`: the result must be in out_buf."""
    f = frontend(fmt)
    t, k = 5, GEOM["top_k"]

    def kernel(**args):
        args["output_activation"].fill_(0.5 * k)
    f.compiled = kernel
    x, idx, w = _inputs(t)
    f.x_in[:t].copy_(x)
    f.topk_idx[:t].copy_(idx)
    f.topk_w[:t].copy_(w)
    f.out_buf.zero_()
    f._launch(t, f.x_in[:t], None)
    assert bool((f.out_buf[:t] == 0.5 * k).all()) and not f.out_buf[t:].any()
    assert bool((f.topk_idx[t:] == -1).all())


def test_forward_before_weights_is_an_error():
    f = compile_only("bf16", **GEOM)
    with pytest.raises(RuntimeError, match="load_weights"):
        f.forward(*_inputs(2))


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))


def test_fp32_hidden_and_bf16_routing_weights_are_converted_in_their_one_copy(frontend):
    f = frontend("bf16")
    f.compiled = _kernel_writing_output(f, 1.0)
    x, idx, w = _inputs(7)
    f.forward(x.float(), idx, w.bfloat16(), torch.empty(7, GEOM["hidden"], dtype=torch.bfloat16))
    (a,) = f.launches
    assert torch.equal(a["activation"][:7], x)  # bf16(fp32(x)) == x: the staged rows are the rounded input
    assert a["topk_weights"].dtype == torch.float32 and torch.equal(a["topk_weights"][:7], w.bfloat16().float())


def test_an_expert_id_past_the_experts_never_reaches_the_kernel(frontend):
    f = frontend("mxfp8")
    f.compiled = _kernel_writing_output(f, 1.0)
    x, idx, w = _inputs(4)
    idx[2, 1] = f.spec.num_experts
    with pytest.raises(RuntimeError, match="moe_ep: an expert id >= num_experts"):
        f.forward(x, idx, w)
    assert f.launches == []
    idx[2, 1] = -1
    f.forward(x, idx, w)
    assert len(f.launches) == 1
