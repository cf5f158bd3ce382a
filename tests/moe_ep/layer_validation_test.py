"""Every bad argument gets its typed error, naming the argument, from a one-rank layer (gloo)."""

import os
import subprocess
import sys

import pytest
import torch

import moe_ep
from tests.support.dist import group_fixture  # noqa: F401 (the `group` fixture)

H, I, E, K, C = 128, 128, 4, 2, 16


# A one-rank layer's set-up for the tests that need a process of their own (this one may hold a group for the
# tests below).
_FRESH = ("import moe_ep, torch, torch.distributed as dist\n"
          "spec = moe_ep.MoESpec(128, 128, 4, 2, 16)\n"
          "w = moe_ep.ExpertWeights(torch.zeros(4, 256, 128, dtype=torch.bfloat16), "
          "torch.zeros(4, 128, 128, dtype=torch.bfloat16), 0, 1, 4)\n")


def _fresh(code: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    res = subprocess.run([sys.executable, "-c", _FRESH + code], env=env, capture_output=True, text=True, timeout=120)
    return res.stdout + "\n--- stderr ---\n" + res.stderr


def test_uninitialised_process_group_is_a_typed_error():
    out = _fresh("try:\n    moe_ep.MoELayer(spec, w)\n"
                 "except moe_ep.ProcessGroupError as e:\n    print('ARG', e.argument, isinstance(e, RuntimeError))\n")
    assert "ARG group True" in out, out


def test_a_call_after_the_process_group_was_destroyed_is_a_typed_error():
    # The group destroyed under a live layer (an engine's teardown out of order).
    out = _fresh("dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)\n"
                 "layer = moe_ep.MoELayer(spec, w, timeout_s=0)\n"
                 "x, idx, tw = torch.zeros(2, 128), torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2)\n"
                 "layer(x, idx, tw)\n"
                 "dist.destroy_process_group()\n"
                 "try:\n    layer(x, idx, tw)\n"
                 "except moe_ep.ProcessGroupError as e:\n"
                 "    print('ARG', e.argument, 'destroy_process_group' in str(e))\n"
                 "layer.close()\nprint('CLOSED')\n")
    assert "ARG group True" in out and "CLOSED" in out, out


def _weights(**kw):
    g = torch.Generator().manual_seed(0)
    args = dict(w13=(torch.randn(E, 2 * I, H, generator=g) / 12).bfloat16(),
                w2=(torch.randn(E, H, I, generator=g) / 12).bfloat16(), rank=0, world_size=1, num_experts=E)
    args.update(kw)
    return moe_ep.ExpertWeights(**args)


@pytest.fixture(scope="module")
def layer(group):
    with moe_ep.MoELayer(moe_ep.MoESpec(H, I, E, K, C), _weights()) as lay:
        yield lay


def _inputs(t=5):
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, H, generator=g).bfloat16()
    idx = torch.rand(t, E, generator=g).argsort(1)[:, :K].contiguous()
    w = torch.softmax(torch.randn(t, K, generator=g), 1)
    return x, idx, w


def test_good_call_and_defaults(layer):
    assert layer.backend_name == "torch_reference" and layer.fmt == "bf16" and layer.max_tokens_per_rank == C
    x, idx, w = _inputs()
    out = layer(x, idx, w)
    assert out.shape == (5, H) and out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    out32 = layer(x, idx.to(torch.int32), w)  # int32 ids are accepted
    assert torch.equal(out, out32)
    empty = layer(x[:0], idx[:0], w[:0])  # T = 0 is a valid call
    assert empty.shape == (0, H)
    full = layer(*_inputs(C))  # exactly at capacity
    assert full.shape == (C, H)


def _bad(kind):
    x, idx, w = _inputs()
    out = None
    if kind == "hidden_dtype":
        x = x.double()
    elif kind == "hidden_not_tensor":
        x = x.tolist()
    elif kind == "idx_dtype":
        idx = idx.float()
    elif kind == "weights_dtype":
        w = w.to(torch.float8_e4m3fn)
    elif kind == "hidden_shape":
        x = x[:, :64].contiguous()
    elif kind == "hidden_rank3":
        x = x.unsqueeze(0)
    elif kind == "idx_rows":
        idx = idx[:4].contiguous()
    elif kind == "topk_cols":
        idx = torch.cat([idx, idx[:, :1]], 1)
    elif kind == "topk_weights_shape":
        w = w[:, :1].contiguous()
    elif kind == "hidden_device":
        x = x.to("meta")
    elif kind == "idx_device":
        idx = idx.to("meta")
    elif kind == "hidden_noncontig":
        x = x.t().contiguous().t()
    elif kind == "idx_noncontig":
        idx = idx.t().contiguous().t()
    elif kind == "negative_id":
        idx[2, 1] = -2
    elif kind == "id_too_large":
        idx[0, 0] = E
    elif kind == "over_capacity":
        x, idx, w = _inputs(C + 1)
    elif kind == "out_dtype":
        out = torch.empty(5, H, dtype=torch.float64)
    elif kind == "out_shape":
        out = torch.empty(4, H, dtype=torch.bfloat16)
    elif kind == "out_noncontig":
        out = torch.empty(H, 5, dtype=torch.bfloat16).t()
    return x, idx, w, out


CASES = [
    ("hidden_dtype", moe_ep.errors.DTypeError, "hidden", "torch.bfloat16 / torch.float16 / torch.float32"),
    ("hidden_not_tensor", moe_ep.errors.DTypeError, "hidden", "torch.Tensor"),
    ("idx_dtype", moe_ep.errors.DTypeError, "topk_idx", "torch.int64"),
    ("weights_dtype", moe_ep.errors.DTypeError, "topk_weights", "torch.float32 / torch.bfloat16"),
    ("hidden_shape", moe_ep.errors.ShapeError, "hidden", f"[T, {H}]"),
    ("hidden_rank3", moe_ep.errors.ShapeError, "hidden", f"[T, {H}]"),
    ("idx_rows", moe_ep.errors.ShapeError, "topk_idx", "[5, 2]"),
    ("topk_cols", moe_ep.errors.TopKMismatchError, "topk_idx", "top_k=2"),
    ("topk_weights_shape", moe_ep.errors.TopKMismatchError, "topk_weights", "shape of topk_idx"),
    ("hidden_device", moe_ep.errors.DeviceError, "hidden", "cpu"),
    ("idx_device", moe_ep.errors.DeviceError, "topk_idx", "cpu"),
    ("hidden_noncontig", moe_ep.errors.NonContiguousError, "hidden", "contiguous"),
    ("idx_noncontig", moe_ep.errors.NonContiguousError, "topk_idx", "contiguous"),
    ("negative_id", moe_ep.errors.ExpertIndexError, "topk_idx", ">= -1"),
    ("id_too_large", moe_ep.errors.ExpertIndexError, "topk_idx", f"< num_experts={E}"),
    ("over_capacity", moe_ep.CapacityError, "hidden", f"max_tokens_per_rank={C}"),
    ("out_dtype", moe_ep.errors.DTypeError, "out", "torch.bfloat16 / torch.float16 / torch.float32"),
    ("out_shape", moe_ep.errors.ShapeError, "out", f"[5, {H}]"),
    ("out_noncontig", moe_ep.errors.NonContiguousError, "out", "contiguous"),
]


def test_minus_one_means_no_expert(layer):
    """-1 slots contribute nothing: the output equals the same call with those slots' weights zeroed (the
    reference's FC2 is linear in the routing weight), and a row of -1 comes back exactly zero."""
    x, idx, w = _inputs(5)
    masked = idx.clone()
    masked[1, 0] = -1
    masked[3] = -1
    got = layer(x, masked, w)
    assert not got[3].any()
    zeroed = w.clone()
    zeroed[1, 0] = 0.0
    zeroed[3] = 0.0
    want = layer(x, idx, zeroed)
    want[3] = 0
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)
    assert not torch.equal(got[1], layer(x, idx, w)[1])  # the masked slot did contribute before


@pytest.mark.parametrize("kind, err, argument, expected", CASES, ids=[c[0] for c in CASES])
def test_bad_forward_input(layer, kind, err, argument, expected):
    x, idx, w, out = _bad(kind)
    with pytest.raises(err) as e:
        layer(x, idx, w, out=out)
    assert e.value.argument == argument
    assert f"argument '{argument}'" in str(e.value) and expected in str(e.value)
    assert isinstance(e.value, ValueError)
    if err is moe_ep.errors.DTypeError:
        assert isinstance(e.value, TypeError)
    # the layer is still usable after a rejected call
    assert layer(*_inputs()).shape == (5, H)



@pytest.mark.parametrize("which", ["hidden", "topk_weights", "out"])
def test_a_call_that_needs_a_gradient_is_refused(layer, which):
    """moe_ep computes no gradients: an output without a graph would leave every gradient through the layer out,
    silently. Refused (GradientError, an InputError naming the argument) under grad mode; the same inputs run
    under no_grad / inference_mode, or detached, and the layer runs on."""
    x, idx, w = _inputs()
    want = layer(x, idx, w)
    args = dict(hidden=x.float(), topk_weights=w.clone(), out=torch.empty(5, H))
    args[which].requires_grad_()
    with pytest.raises(moe_ep.errors.GradientError) as e:
        layer(args["hidden"], idx, args["topk_weights"], out=args["out"])
    assert e.value.argument == which and isinstance(e.value, moe_ep.InputError)
    assert "computes no gradients" in str(e.value) and "inference_mode" in str(e.value)
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            got = layer(args["hidden"], idx, args["topk_weights"])
        assert not got.requires_grad and torch.equal(got, want)
    assert torch.equal(layer(args["hidden"].detach(), idx, args["topk_weights"].detach()), want)
    with pytest.raises(moe_ep.errors.DTypeError):  # not a tensor: the input checks answer first, typed
        layer(x.float().requires_grad_(), idx, w.tolist())


def test_a_compiled_call_that_needs_a_gradient_is_refused_alike(layer):
    x, idx, w = _inputs()
    torch._dynamo.reset()
    block = torch.compile(lambda h: layer(h, idx, w) * 2, backend="aot_eager")
    with pytest.raises(moe_ep.errors.GradientError) as e:
        block(x.float().requires_grad_())
    assert e.value.argument == "hidden"
    with torch.no_grad():
        assert torch.equal(block(x.float()), layer(x, idx, w) * 2)


def test_a_layer_is_not_copied_or_pickled(layer):
    """A copy would share the backend and workspace but count calls apart; a pickle cannot carry a process group:
    LayerCopyError (a TypeError, as pickle's own refusals are), naming the layer; the layer runs on."""
    import copy
    import io
    import pickle

    for what, fn in (("copy", copy.copy), ("deepcopy", copy.deepcopy), ("pickle", pickle.dumps),
                     ("torch.save", lambda lay: torch.save(lay, io.BytesIO()))):
        with pytest.raises(moe_ep.errors.LayerCopyError) as e:
            fn(layer)
        assert isinstance(e.value, TypeError) and e.value.argument == layer.name, what
    assert layer(*_inputs()).shape == (5, H)

def _outcome(fn, *args):
    try:
        return fn(*args)
    except moe_ep.MoEError as e:
        return type(e), e.argument


@pytest.mark.parametrize("kind", [c[0] for c in CASES] + ["good", "int32", "empty", "at_capacity", "with_out",
                                                         "out_device", "out_not_tensor", "weights_device"])
def test_one_expression_check_agrees_with_the_stepwise_checks(layer, kind):
    """validate_forward's fast path (one expression for well-formed inputs) accepts exactly what the stepwise
    checks accept, with the same T, and hands everything else to them."""
    from moe_ep.core.validate import validate_forward, validate_forward_stepwise

    if kind in {c[0] for c in CASES}:
        x, idx, w, out = _bad(kind)
    else:
        x, idx, w = _inputs(C if kind == "at_capacity" else 5)
        out = None
        if kind == "int32":
            idx = idx.to(torch.int32)
        elif kind == "empty":
            x, idx, w = x[:0], idx[:0], w[:0]
        elif kind == "with_out":
            out = torch.empty(5, H, dtype=torch.bfloat16)
        elif kind == "out_device":
            out = torch.empty(5, H, dtype=torch.bfloat16, device="meta")
        elif kind == "out_not_tensor":
            out = [[0.0] * H] * 5
        elif kind == "weights_device":
            w = w.to("meta")
    args = (layer.spec, layer.ctx, x, idx, w, out, True)
    fast, stepwise = _outcome(validate_forward, *args), _outcome(validate_forward_stepwise, *args)
    assert fast == stepwise
    assert isinstance(fast, int) == (kind in ("good", "int32", "empty", "at_capacity", "with_out"))


def test_a_closed_layer_is_a_typed_error(group):
    lay = moe_ep.MoELayer(moe_ep.MoESpec(H, I, E, K, C), _weights())
    lay.close()
    with pytest.raises(moe_ep.errors.LayerClosedError, match="closed"):
        lay(*_inputs())


@pytest.mark.parametrize("make, err, argument", [
    (lambda: (moe_ep.MoESpec(H, I, E, K, C), _weights(rank=1, world_size=2, w13=_weights().w13[2:],
                                                      w2=_weights().w2[2:])),
     moe_ep.errors.WeightsRankError, "weights"),
    (lambda: (moe_ep.MoESpec(H, I, 8, K, C), _weights()), moe_ep.errors.WeightsRankError, "weights"),
    (lambda: (moe_ep.MoESpec(H, 64, E, K, C), _weights()), moe_ep.errors.ShapeError, "weights.w13"),
    (lambda: (moe_ep.MoESpec(H, I, E, K, C), "weights"), moe_ep.errors.DTypeError, "weights"),
    (lambda: ("spec", _weights()), moe_ep.errors.DTypeError, "spec"),
], ids=["wrong_world", "wrong_num_experts", "wrong_shape", "not_weights", "not_spec"])
def test_bad_layer_arguments(group, make, err, argument):
    spec, weights = make()
    with pytest.raises(err) as e:
        moe_ep.MoELayer(spec, weights)
    assert e.value.argument == argument


def _left():
    from moe_ep.core import op
    from moe_ep.core.watchdog import monitor, sequence

    return len(op._layers), sum(lg.open for lg in sequence.logs()), len(monitor.get().watches)


def test_a_refused_layer_leaves_nothing_behind(group, monkeypatch):
    spec = moe_ep.MoESpec(H, I, E, K, C)
    before = _left()
    with pytest.raises(moe_ep.errors.UnknownArgumentError) as e:
        moe_ep.MoELayer(spec, _weights(), bogus=1)
    assert e.value.argument == "bogus" and isinstance(e.value, TypeError) and "apply_topk_in_fc1" in str(e.value)
    with pytest.raises(moe_ep.errors.DeviceUnavailableError) as e:
        moe_ep.MoELayer(spec, _weights(), device="cpu:1")
    assert e.value.argument == "device"
    # A backend that fails while laying out its weights (after the agreement) is closed, and so is everything else.
    from moe_ep.reference.backend import TorchReferenceBackend

    closed = []
    monkeypatch.setattr(TorchReferenceBackend, "prepare_weights", lambda self, w: (_ for _ in ()).throw(
        moe_ep.errors.WorkspaceError("max_tokens_per_rank", "no room")))
    monkeypatch.setattr(TorchReferenceBackend, "close", lambda self: closed.append(self))
    with pytest.raises(moe_ep.errors.WorkspaceError):
        moe_ep.MoELayer(spec, _weights(), timeout_s=30)
    assert len(closed) == 1 and _left() == before


def test_cpu_0_is_the_cpu(group):
    with moe_ep.MoELayer(moe_ep.MoESpec(H, I, E, K, C), _weights(), device="cpu:0") as lay:
        assert lay.device == torch.device("cpu")
        assert lay(*_inputs()).shape == (5, H)


def test_backend_and_format_selection_errors(group):
    spec = moe_ep.MoESpec(H, I, E, K, C)
    with pytest.raises(moe_ep.errors.BackendNotFoundError) as e:
        moe_ep.MoELayer(spec, _weights(), backend="no_such_backend")
    assert "torch_reference" in str(e.value)
    with pytest.raises(moe_ep.FormatError) as e:
        moe_ep.MoELayer(spec, _weights(), fmt="int4")
    assert e.value.argument == "fmt"
    with pytest.raises(moe_ep.BackendUnavailableError) as e:  # a kernel backend on this CPU: refused for the device
        moe_ep.MoELayer(spec, _weights(), backend="sm90_fp8_cutedsl", fmt="nvfp4")
    assert e.value.argument == "backend"
    from moe_ep.reference.backend import TorchReferenceBackend as _Ref

    moe_ep.register_backend("t_bf16_entry", _Ref, arch="cpu", formats=("bf16", "fp8_block"), replace=True)
    try:
        with pytest.raises(moe_ep.FormatError) as e:  # a format the registry entry does not name
            moe_ep.MoELayer(spec, _weights(), backend="t_bf16_entry", fmt="nvfp4")
        assert e.value.argument == "fmt" and "fp8_block" in str(e.value)
    finally:
        moe_ep.unregister_backend("t_bf16_entry")
    with pytest.raises(moe_ep.CalibrationError) as e:
        moe_ep.MoELayer(spec, _weights(), fmt="fp8_tensor")
    assert e.value.argument == "weights.act_amax"
    from moe_ep.reference.backend import TorchReferenceBackend

    class OnlyBf16(TorchReferenceBackend):
        weight_formats = ("bf16",)

    moe_ep.register_backend("t_only_bf16", OnlyBf16, arch="cpu", formats=("bf16", "mxfp8"), replace=True)
    try:  # registered for a format its class does not serve: a registration error, whatever format is asked for
        with pytest.raises(moe_ep.errors.RegistrationError) as e:
            moe_ep.MoELayer(spec, _weights(), backend="t_only_bf16", fmt="bf16")
        assert "OnlyBf16" in str(e.value) and "mxfp8" in str(e.value)
    finally:
        moe_ep.unregister_backend("t_only_bf16")
    odd = moe_ep.MoESpec(96, I, E, K, C)
    with pytest.raises(moe_ep.SpecError) as e:
        moe_ep.MoELayer(odd, _weights(w13=torch.zeros(E, 2 * I, 96, dtype=torch.bfloat16),
                                      w2=torch.zeros(E, 96, I, dtype=torch.bfloat16)), fmt="fp8_block")
    assert e.value.argument == "hidden_size" and "128" in str(e.value)


@pytest.mark.parametrize("fmt", list(moe_ep.FORMATS))
def test_every_format_runs_and_matches_the_oracle(group, fmt):
    from moe_ep.reference.oracle import check_multirank

    w = _weights(act_amax=6.0, fc2_act_amax=1.0)
    with moe_ep.MoELayer(moe_ep.MoESpec(H, I, E, K, C), w, backend="torch_reference", fmt=fmt) as lay:
        x, idx, tw = _inputs(11)
        out = torch.full((11, H), float("nan"), dtype=torch.bfloat16)
        lay(x, idx, tw, out=out)
        report = check_multirank(lay, x, idx, tw, out, weights=w)
        assert report.ok and report.ranks[0].tokens == 11


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
