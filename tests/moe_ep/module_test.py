"""MoEModule: the layer as an nn.Module (#24.4). Its state_dict carries the rank's quantized experts (codes and
scales of the layer's format), load_state_dict lays them out again, .to() elsewhere is a typed error; and
ExpertWeights.from_global keeps a copy of the rank's slice only. One-rank gloo group, torch reference backend."""

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


@pytest.mark.parametrize("move, err", [
    (lambda m: m.to(torch.float16), moe_ep.errors.DTypeError), (lambda m: m.half(), moe_ep.errors.DTypeError),
    (lambda m: m.float(), moe_ep.errors.DTypeError), (lambda m: m.to("meta"), moe_ep.errors.DeviceError),
    (lambda m: Block(m).to(torch.bfloat16), moe_ep.errors.DTypeError),
], ids=["to_fp16", "half", "float", "to_meta", "parent_to_bf16"])
def test_moving_or_converting_is_a_typed_error(group, move, err):
    with moe_ep.MoEModule(moe_ep.MoESpec(H, I, E, K, C), _weights(0), fmt="fp8_block") as m:
        with pytest.raises(err):
            move(m)
        assert m.to("cpu") is m and m.layer.device == torch.device("cpu")
        assert m(*_inputs()).shape == (6, H)


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
