"""The layer's forward contract beyond validation, on a one-rank gloo group (torch reference backend): the check
schedule (#25.1), the lenient input contract (#24.2) and calls larger than the capacity (#24.3). The multi-rank
side (agreement on the first call, zero-token participation, chunk agreement) is in multirank_cpu_test and
chunking_multirank_test."""

import sys

import pytest
import torch

import moe_ep
from moe_ep import layer as layer_mod
from moe_ep.reference.oracle import compare, oracle_forward
from tests.support.dist import group_fixture, one_rank_weights  # noqa: F401 (the `group` fixture)

H, I, E, K, C = 128, 128, 8, 2, 8


def _weights():
    return one_rank_weights(E, H, I, 12)


def _inputs(t, seed=None, dtype=torch.float32):
    g = torch.Generator().manual_seed(t if seed is None else seed)
    x = torch.randn(t, H, generator=g, dtype=torch.float32).to(dtype)
    idx = torch.rand(t, E, generator=g).argsort(1)[:, :K].contiguous()
    w = torch.softmax(torch.randn(t, K, generator=g), 1)
    return x, idx, w


def _layer(**kw):
    return moe_ep.MoELayer(moe_ep.MoESpec(H, I, E, K, C), _weights(), **kw)


def _bits(t):
    return t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t.view(torch.int32)


# -- the check schedule ------------------------------------------------------------------------------------------
def test_schedules_from_arguments_and_environment(group, monkeypatch):
    monkeypatch.delenv("MOE_EP_CHECKS", raising=False)
    with _layer() as lay:
        assert (lay.check_values, lay.collective_checks) == (None, None)  # the default schedule
        lay.check_values = False
        assert lay.check_values is False
        with pytest.raises(moe_ep.errors.CheckConfigError) as e:
            lay.collective_checks = "sometimes"
        assert e.value.argument == "collective_checks"
    monkeypatch.setenv("MOE_EP_CHECKS", "all")  # the debug switch wins over explicit False
    with _layer(check_values=False, collective_checks=False) as lay:
        assert (lay.check_values, lay.collective_checks) == (True, True)
    monkeypatch.setenv("MOE_EP_CHECKS", "off")  # defaults off, explicit choices kept
    with _layer(check_values=True) as lay:
        assert (lay.check_values, lay.collective_checks) == (True, False)
    monkeypatch.setenv("MOE_EP_CHECKS", "loud")
    with pytest.raises(moe_ep.errors.CheckConfigError) as e:
        _layer()
    assert e.value.argument == "MOE_EP_CHECKS" and "'all'" in str(e.value)


def test_value_checks_run_on_the_first_call_of_each_shape_on_a_gpu(group, monkeypatch):
    """What the default schedule does on a GPU, seen through the layer's own decision (the device is a CPU here:
    the layer is told it is on CUDA): ids checked once per (T, id dtype), never inside a capture."""
    seen = []
    real = layer_mod.check_expert_ids
    monkeypatch.setattr(layer_mod, "check_expert_ids", lambda spec, idx: (seen.append(tuple(idx.shape) + (idx.dtype,)),
                                                                           real(spec, idx)))
    monkeypatch.delenv("MOE_EP_CHECKS", raising=False)
    with _layer() as lay:
        x, idx, w = _inputs(5)
        for _ in range(3):
            lay(x, idx, w)
        assert len(seen) == 3  # a CPU checks every call: no device sync to save
        lay._on_cuda = True
        seen.clear()
        lay(*_inputs(6))
        lay(*_inputs(6))
        lay(x, idx.to(torch.int32), w)
        lay(x, idx.to(torch.int32), w)
        assert seen == [(6, K, torch.int64), (5, K, torch.int32)]
        monkeypatch.setattr(layer_mod, "_capturing", lambda: True)
        lay(*_inputs(7))
        assert len(seen) == 2  # no sync inside a capture
        monkeypatch.setattr(layer_mod, "_capturing", lambda: False)
        bad = idx.clone()
        bad[0, 0] = E
        with pytest.raises(moe_ep.errors.ExpertIndexError):
            lay(x[:3], bad[:3], w[:3])  # a new shape: checked
        lay.check_values = True
        with pytest.raises(moe_ep.errors.ExpertIndexError):
            lay(x, bad, w)  # every call
        lay.check_values = False
        seen.clear()
        lay(*_inputs(4))
        assert seen == []


# -- lenient inputs ------------------------------------------------------------------------------------------------
def test_hidden_in_fp32_fp16_bf16_is_rounded_to_bf16_once(group):
    with _layer() as lay:
        x, idx, w = _inputs(6)
        want = lay(x.bfloat16(), idx, w)
        for dtype in (torch.float32, torch.float16):
            xin = x.to(dtype)
            got = lay(xin, idx, w)
            assert got.dtype == torch.bfloat16
            assert torch.equal(_bits(got), _bits(lay(xin.bfloat16(), idx, w)))
        assert torch.equal(_bits(lay(x, idx, w)), _bits(want))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_routing_weights_in_any_float_dtype(group, dtype):
    with _layer() as lay:
        x, idx, w = _inputs(6, dtype=torch.bfloat16)
        wd = w.to(dtype)
        assert torch.equal(_bits(lay(x, idx, wd)), _bits(lay(x, idx, wd.float())))


def test_output_dtype_on_request(group):
    with _layer(out_dtype="hidden") as lay:
        x, idx, w = _inputs(6)
        got = lay(x, idx, w)
        assert got.dtype == torch.float32
        ref = lay(x.bfloat16(), idx, w)
        assert ref.dtype == torch.bfloat16 and torch.equal(got, ref.float())
        assert lay(x.half(), idx, w).dtype == torch.float16
        out = torch.full((6, H), float("nan"), dtype=torch.float32)
        assert lay(x.bfloat16(), idx, w, out=out) is out and torch.equal(out, ref.float())
    with _layer(out_dtype=torch.float16) as lay:
        assert lay(*_inputs(3)).dtype == torch.float16
    with pytest.raises(moe_ep.errors.DTypeError) as e:
        _layer(out_dtype=torch.int8)
    assert e.value.argument == "out_dtype"


# -- more tokens than capacity ---------------------------------------------------------------------------------------
def test_strict_layers_name_the_ways_out(group):
    with _layer() as lay:
        with pytest.raises(moe_ep.CapacityError) as e:
            lay(*_inputs(C + 1))
        assert "chunking" in str(e.value) and "max_tokens_across_ranks" in str(e.value)
        with pytest.raises(moe_ep.CapacityError) as e:
            lay(*_inputs(C + 1), max_tokens_across_ranks=C)
        assert e.value.argument == "hidden" and f"max_tokens_across_ranks={C}" in str(e.value)
        with pytest.raises(moe_ep.CapacityError) as e:
            lay(*_inputs(3), max_tokens_across_ranks=-1)
        assert e.value.argument == "max_tokens_across_ranks"
    with pytest.raises(moe_ep.SpecError) as e:
        _layer(chunking="sometimes")
    assert e.value.argument == "chunking"


@pytest.mark.parametrize("fmt", ["bf16", "fp8_block"])
def test_four_times_capacity_matches_the_oracle(group, fmt):
    t = 4 * C + 3
    x, idx, w = _inputs(t, seed=11, dtype=torch.bfloat16)
    idx[5] = -1
    with _layer(chunking="agree", fmt=fmt) as agree, _layer(fmt=fmt) as strict:
        out = torch.full((t, H), float("nan"), dtype=torch.bfloat16)
        agree(x, idx, w, out=out)
        ref = oracle_forward(agree.oracle_weights(), x, idx, w)
        ok, problems, *_ = compare(out, ref, fmt)
        assert ok, problems
        # the same bytes as the caller splitting the call itself, and as the bound passed explicitly
        parts = torch.cat([strict(x[a:a + C], idx[a:a + C], w[a:a + C]) for a in range(0, t, C)])
        assert torch.equal(_bits(out), _bits(parts))
        assert torch.equal(_bits(strict(x, idx, w, max_tokens_across_ranks=t + 9)), _bits(out))


def test_compiled_call_with_lenient_inputs_and_chunks(group):
    torch._dynamo.reset()
    with _layer(out_dtype="hidden", chunking="agree") as lay:
        def f(x, idx, w):
            return lay(x, idx, w, max_tokens_across_ranks=x.shape[0]) * 2

        compiled = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=False)
        x, idx, w = _inputs(2 * C + 1)
        got = compiled(x, idx, w.bfloat16())
        assert got.dtype == torch.float32
        assert torch.equal(got, lay(x, idx, w.bfloat16()) * 2)


# -- the layer's weights are its own (#31 item 3) ------------------------------------------------------------------
def test_a_loader_reusing_one_buffer_does_not_change_a_built_layer(group):
    # Engines load each layer's experts into a buffer they reuse for the next one: the layer must have copied.
    spec = moe_ep.MoESpec(H, I, E, K, C)
    buf = _weights()
    x, idx, w = _inputs(5, seed=3)
    first = moe_ep.MoELayer(spec, buf, fmt="bf16")
    before = first(x, idx, w).clone()
    other = one_rank_weights(E, H, I, 12, seed=9)
    buf.w13.copy_(other.w13)  # the loader's next layer, into the same tensors
    buf.w2.copy_(other.w2)
    second = moe_ep.MoELayer(spec, buf, fmt="bf16")
    assert torch.equal(first(x, idx, w), before)
    assert not torch.equal(second(x, idx, w), before)
    first.close(), second.close()


@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
def test_replace_experts_writes_only_the_layers_own_memory(group, fmt):
    spec = moe_ep.MoESpec(H, I, E, K, C)
    given = _weights()
    kept = (given.w13.clone(), given.w2.clone())
    a = moe_ep.MoELayer(spec, given, fmt=fmt)
    b = moe_ep.MoELayer(spec, given, fmt=fmt)  # built from the same tensors
    x, idx, w = _inputs(6, seed=4)
    ref_b = b(x, idx, w).clone()
    new = one_rank_weights(E, H, I, 12, seed=7)
    a.replace_experts([0, 1], (new.w13[:2], new.w2[:2]))
    assert torch.equal(given.w13, kept[0]) and torch.equal(given.w2, kept[1])  # the caller's tensors: untouched
    assert torch.equal(b(x, idx, w), ref_b)  # ... and so the other layer
    assert not torch.equal(a(x, idx, w), ref_b)
    a.close(), b.close()


def test_a_quantized_pack_on_the_layers_device_is_copied(group):
    spec = moe_ep.MoESpec(H, I, E, K, C)
    from moe_ep.formats import quantize_weights

    pack = quantize_weights("mxfp8", _weights().w13, _weights().w2)
    given = moe_ep.ExpertWeights.from_quantized(pack, 0, 1, E)
    layer = moe_ep.MoELayer(spec, given)
    used = layer.oracle_weights()
    theirs = {getattr(pack, n).untyped_storage().data_ptr() for n in pack.tensor_fields()}
    assert all(getattr(used, n).untyped_storage().data_ptr() not in theirs for n in used.tensor_fields())
    layer.close()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
