"""MoEModule: the layer as an nn.Module (#24.4, #32). Its state_dict carries the rank's quantized experts (codes and
scales of the layer's format), load_state_dict lays them out again and refuses damaged values before the layer
changes; a dtype conversion leaves its format, a move elsewhere is a typed error before any parameter changes;
copies, pickles and forwards that need a gradient are typed errors; and ExpertWeights.from_global keeps a copy of
the rank's slice only. One-rank gloo group, torch reference backend."""

import sys

import pytest
import torch

import moe_ep
from tests.support.dist import group_fixture, one_rank_weights  # noqa: F401 (the `group` fixture)

H, I, E, K, C = 128, 128, 4, 2, 16


def _weights(seed):
    return one_rank_weights(E, H, I, 12, seed)


def _inputs(t=6):
    g = torch.Generator().manual_seed(t)
    return (torch.randn(t, H, generator=g).bfloat16(), torch.rand(t, E, generator=g).argsort(1)[:, :K].contiguous(),
            torch.softmax(torch.randn(t, K, generator=g), 1))


class Block(torch.nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.router = torch.nn.Linear(H, E, bias=False)
        self.experts = experts


@pytest.mark.parametrize("fmt", ["bf16", "fp8_block", "mxfp8"])
def test_state_dict_carries_the_quantized_experts(group, fmt):
    with moe_ep.MoEModule(moe_ep.MoESpec(H, I, E, K, C), _weights(0), fmt=fmt) as m:
        sd = Block(m).state_dict()
        qw = m.layer.oracle_weights()
        assert {k for k in sd if k.startswith("experts.")} == {f"experts.{n}" for n in qw.tensor_fields()} | {
            "experts.expert_offset"}
        assert "router.weight" in sd and int(sd["experts.expert_offset"]) == 0
        for name in qw.tensor_fields():
            assert sd[f"experts.{name}"].dtype == getattr(qw, name).dtype
            assert torch.equal(sd[f"experts.{name}"].view(torch.uint8), getattr(qw, name).view(torch.uint8))
        if fmt != "bf16":
            assert sd["experts.w13_q"].dtype == torch.float8_e4m3fn and "experts.w13_scale" in sd


@pytest.mark.parametrize("fmt", ["bf16", "fp8_block"])
def test_load_state_dict_reproduces_the_other_modules_outputs(group, fmt):
    spec = moe_ep.MoESpec(H, I, E, K, C)
    with moe_ep.MoEModule(spec, _weights(0), fmt=fmt) as a, moe_ep.MoEModule(spec, _weights(1), fmt=fmt) as b:
        x, idx, w = _inputs()
        want = a(x, idx, w)
        assert not torch.equal(b(x, idx, w), want)
        before = b.layer
        result = Block(b).load_state_dict(Block(a).state_dict(), strict=False)
        assert result.missing_keys == ["router.weight"] or not result.missing_keys
        assert b.layer is not before and b.layer.fmt == fmt
        assert torch.equal(b(x, idx, w).view(torch.int16), want.view(torch.int16))
        with pytest.raises(moe_ep.errors.LayerClosedError):
            before(x, idx, w)  # the old layer is gone, its workspace share released


def test_bad_states_are_typed_errors_and_a_partial_one_is_never_loaded(group):
    spec = moe_ep.MoESpec(H, I, E, K, C)
    with moe_ep.MoEModule(spec, _weights(0)) as m:
        x, idx, w = _inputs()
        want = m(x, idx, w)
        sd = m.state_dict()
        with pytest.raises(moe_ep.errors.WeightsRankError) as e:
            m.load_state_dict(dict(sd, expert_offset=torch.tensor(2)))
        assert e.value.argument == "expert_offset"
        with pytest.raises(moe_ep.errors.DTypeError) as e:
            m.load_state_dict(dict(sd, w13_q=sd["w13_q"].float()))
        assert e.value.argument == "w13_q"
        with pytest.raises(moe_ep.errors.ShapeError) as e:
            m.load_state_dict(dict(sd, w2_q=sd["w2_q"][:2]))
        assert e.value.argument == "w2_q"
        partial = {k: v for k, v in sd.items() if k != "w2_q"}
        with pytest.raises(RuntimeError, match="Missing key"):
            m.load_state_dict(partial)
        layer = m.layer
        assert m.load_state_dict(partial, strict=False).missing_keys == ["w2_q"]
        assert m.layer is layer and torch.equal(m(x, idx, w), want)


@pytest.mark.parametrize("field, value", [("w13_scale", float("nan")), ("w2_scale", float("inf")),
                                          ("w13_scale", -1.0), ("w2_q", "nan_code")])
def test_a_state_with_damaged_values_is_refused_before_the_layer_changes(group, field, value):
    spec = moe_ep.MoESpec(H, I, E, K, C)
    with moe_ep.MoEModule(spec, _weights(0), fmt="fp8_block") as m:
        x, idx, w = _inputs()
        want = m(x, idx, w)
        sd = {k: v.clone() for k, v in m.state_dict().items()}
        if value == "nan_code":
            sd[field].view(torch.uint8).view(-1)[3] = 0x7F
        else:
            sd[field].view(-1)[1] = value
        layer = m.layer
        with pytest.raises(moe_ep.CheckpointError) as e:
            m.load_state_dict(sd)
        assert e.value.argument == field
        assert m.layer is layer and torch.equal(m(x, idx, w), want)


@pytest.mark.parametrize("fmt, field, damage", [
    ("bf16", "w2_q", lambda t: t.view(-1).__setitem__(1, float("inf"))),
    ("bf16", "w13_q", lambda t: t.view(-1).__setitem__(1, float("nan"))),
    ("mxfp8", "w13_scale", lambda t: t.view(torch.uint8).view(-1).__setitem__(1, 255)),  # the e8m0 NaN code
    ("mxfp8", "w2_q", lambda t: t.view(torch.uint8).view(-1).__setitem__(1, 0xFF)),
    ("w4a8_mxfp4", "w2_scale", lambda t: t.view(torch.uint8).view(-1).__setitem__(1, 255)),
    ("w4a8_mxfp4", "w13_q", lambda t: t.view(-1).__setitem__(1, 16)),  # one e2m1 code a byte: 0..15
])
def test_damaged_values_are_refused_in_every_format(group, fmt, field, damage):
    spec = moe_ep.MoESpec(H, I, E, K, C)
    with moe_ep.MoEModule(spec, _weights(0), fmt=fmt) as m:
        x, idx, w = _inputs()
        want = m(x, idx, w)
        sd = {k: v.clone() for k, v in m.state_dict().items()}
        damage(sd[field])
        layer = m.layer
        with pytest.raises(moe_ep.CheckpointError) as e:
            m.load_state_dict(sd)
        assert e.value.argument == field
        assert m.layer is layer and torch.equal(m(x, idx, w), want)


def test_a_zero_scale_state_loads(group):
    spec = moe_ep.MoESpec(H, I, E, K, C)
    with moe_ep.MoEModule(spec, _weights(0), fmt="fp8_block") as m:
        sd = {k: v.clone() for k, v in m.state_dict().items()}
        sd["w2_scale"][0] = 0.0  # expert 0's down projection: all zeros
        m.load_state_dict(sd)
        assert not bool(m.layer.oracle_weights().dequantize()[1][0].any())


@pytest.mark.parametrize("convert", [lambda m: m.to(torch.float16), lambda m: m.half(), lambda m: m.float(),
                                     lambda m: m.bfloat16(), lambda m: m.to("cpu", torch.bfloat16)],
                         ids=["to_fp16", "half", "float", "bfloat16", "to_cpu_bf16"])
def test_a_dtype_conversion_leaves_the_format_and_the_outputs(group, convert):
    with moe_ep.MoEModule(moe_ep.MoESpec(H, I, E, K, C), _weights(0), fmt="fp8_block", out_dtype="hidden") as m:
        x, idx, w = _inputs()
        want = m(x, idx, w)
        layer = m.layer
        assert convert(m) is m and m.layer is layer and m.layer.fmt == "fp8_block"
        assert torch.equal(m(x, idx, w), want)
        assert m(x.half(), idx, w).dtype == torch.float16  # it reads fp16 hidden states and returns them


@pytest.mark.parametrize("move, err", [
    (lambda m: m.to(torch.float64), moe_ep.errors.DTypeError), (lambda m: m.double(), moe_ep.errors.DTypeError),
    (lambda m: m.to("meta"), moe_ep.errors.DeviceError),
], ids=["to_fp64", "double", "to_meta"])
def test_a_move_or_a_dtype_it_cannot_take_is_refused_before_any_parameter_changes(group, move, err):
    with moe_ep.MoEModule(moe_ep.MoESpec(H, I, E, K, C), _weights(0), fmt="fp8_block") as m:
        block = Block(m)  # the router comes first: nn.Module converts children in order
        router = block.router.weight.detach().clone()
        with pytest.raises(err):
            move(m)
        moe_ep.module.guard_conversions(block)
        with pytest.raises(err):
            move(block)
        assert block.router.weight.dtype == torch.float32 and block.router.weight.device.type == "cpu"
        assert torch.equal(block.router.weight, router)
        assert m.to("cpu") is m and m(*_inputs()).shape == (6, H)


def test_copies_and_pickles_are_typed_errors(group):
    import copy
    import pickle

    with moe_ep.MoEModule(moe_ep.MoESpec(H, I, E, K, C), _weights(0)) as m:
        for attempt in (lambda: copy.deepcopy(Block(m)), lambda: pickle.dumps(m), lambda: copy.copy(m)):
            with pytest.raises(moe_ep.errors.IntegrationError, match="cannot be"):
                attempt()
        assert m(*_inputs()).shape == (6, H)


def test_a_forward_that_needs_a_gradient_is_refused_and_no_grad_is_not(group):
    with moe_ep.MoEModule(moe_ep.MoESpec(H, I, E, K, C), _weights(0)) as m:
        assert not list(m.parameters())  # its weights are in the backend's layout: nothing for an optimizer
        x, idx, w = _inputs()
        with pytest.raises(moe_ep.errors.IntegrationError, match="needs a gradient"):
            m(x.requires_grad_(), idx, w)
        with pytest.raises(moe_ep.errors.IntegrationError, match="topk_weights requires grad"):
            m(x.detach(), idx, w.clone().requires_grad_())
        with torch.no_grad():
            a = m(x, idx, w)
        with torch.inference_mode():
            b = m(x.detach(), idx, w)
        assert torch.equal(a, b) and torch.equal(m(x.detach(), idx, w), a)  # no input needs a gradient


def test_from_global_keeps_a_copy_of_the_rank_slice_only():
    g = torch.Generator().manual_seed(3)
    w13 = torch.randn(8, 2 * I, H, generator=g).bfloat16()
    w2 = torch.randn(8, H, I, generator=g).bfloat16()
    w = moe_ep.ExpertWeights.from_global(w13, w2, rank=1, world_size=4)
    for mine, full in ((w.w13, w13), (w.w2, w2)):
        assert torch.equal(mine, full[2:4])
        assert mine.untyped_storage().data_ptr() != full.untyped_storage().data_ptr()
        assert mine.untyped_storage().nbytes() == mine.numel() * mine.element_size()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
