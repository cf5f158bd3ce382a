"""MoESpec and ExpertWeights: construction-time checks name the argument."""

import sys

import pytest
import torch

import moe_ep
from moe_ep.core.weights import owner_rank


def test_spec_accepts_and_normalises():
    s = moe_ep.MoESpec(1024, 256, 32, 8, 128, gate_up_clamp=7)
    assert s.gate_up_clamp == 7.0 and isinstance(s.gate_up_clamp, float)
    assert s.experts_per_rank(4) == 8


@pytest.mark.parametrize("kwargs, argument", [
    (dict(hidden_size=0), "hidden_size"),
    (dict(intermediate_size=-1), "intermediate_size"),
    (dict(num_experts=2.0), "num_experts"),
    (dict(top_k=True), "top_k"),
    (dict(top_k=40), "top_k"),
    (dict(max_tokens_per_rank=0), "max_tokens_per_rank"),
    (dict(gate_up_clamp=0.0), "gate_up_clamp"),
    (dict(gate_up_clamp=float("inf")), "gate_up_clamp"),
    (dict(gate_up_clamp="7"), "gate_up_clamp"),
])
def test_spec_errors_name_the_argument(kwargs, argument):
    base = dict(hidden_size=64, intermediate_size=32, num_experts=8, top_k=2, max_tokens_per_rank=4)
    base.update(kwargs)
    with pytest.raises(moe_ep.SpecError) as e:
        moe_ep.MoESpec(**base)
    assert e.value.argument == argument and argument in str(e.value)
    assert isinstance(e.value, ValueError)


def test_spec_world_size_must_divide_experts():
    s = moe_ep.MoESpec(64, 32, 6, 2, 4)
    with pytest.raises(moe_ep.errors.WorldSizeError) as e:
        s.experts_per_rank(4)
    assert e.value.argument == "world_size" and "does not divide" in str(e.value)


def _pack(e=2, i=4, h=8, dtype=torch.bfloat16):
    return torch.zeros(e, 2 * i, h, dtype=dtype), torch.zeros(e, h, i, dtype=dtype)


def test_expert_weights_ownership():
    w13, w2 = _pack()
    w = moe_ep.ExpertWeights(w13, w2, rank=3, world_size=4, num_experts=8)
    assert (w.experts_per_rank, w.expert_offset, w.hidden_size, w.intermediate_size) == (2, 6, 8, 4)
    assert [owner_rank(e, 8, 4) for e in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_from_global_slices_contiguous_blocks():
    w13 = torch.arange(8, dtype=torch.bfloat16).reshape(8, 1, 1).expand(8, 2, 3).contiguous()
    w2 = torch.zeros(8, 3, 1, dtype=torch.bfloat16)
    w = moe_ep.ExpertWeights.from_global(w13, w2, rank=2, world_size=4, act_amax=2.0)
    assert w.w13[:, 0, 0].tolist() == [4.0, 5.0] and w.act_amax == 2.0


@pytest.mark.parametrize("mutate, err, argument", [
    (lambda a: a.update(w13=a["w13"].float()), moe_ep.errors.DTypeError, "weights.w13"),
    (lambda a: a.update(w2=[1, 2]), moe_ep.errors.DTypeError, "weights.w2"),
    (lambda a: a.update(w13=a["w13"][0]), moe_ep.errors.ShapeError, "weights.w13"),
    (lambda a: a.update(w13=a["w13"][:1]), moe_ep.errors.ShapeError, "weights.w13"),
    (lambda a: a.update(w2=a["w2"][:, :, :3]), moe_ep.errors.ShapeError, "weights.w2"),
    (lambda a: a.update(w2=a["w2"].to("meta")), moe_ep.errors.DeviceError, "weights.w2"),  # no data to copy
    (lambda a: a.update(rank=4), moe_ep.errors.WeightsRankError, "weights.rank"),
    (lambda a: a.update(rank=-1), moe_ep.errors.WeightsRankError, "weights.rank"),
    (lambda a: a.update(num_experts=6, world_size=4), moe_ep.errors.WorldSizeError, "weights.world_size"),
    (lambda a: a.update(act_amax=-1.0), moe_ep.CalibrationError, "weights.act_amax"),
    (lambda a: a.update(fc2_act_amax=float("nan")), moe_ep.CalibrationError, "weights.fc2_act_amax"),
])
def test_expert_weights_errors(mutate, err, argument):
    w13, w2 = _pack()
    args = dict(w13=w13, w2=w2, rank=0, world_size=4, num_experts=8)
    mutate(args)
    with pytest.raises(err) as e:
        moe_ep.ExpertWeights(**args)
    assert e.value.argument == argument and f"'{argument}'" in str(e.value)


def test_errors_survive_pickling_with_their_argument():
    import pickle

    e = moe_ep.PeerValidationError("hidden", "rank 2 failed", ranks=[2], reasons={2: "bad"})
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is moe_ep.PeerValidationError and back.argument == "hidden" and back.ranks == (2,)
    d = pickle.loads(pickle.dumps(moe_ep.errors.DTypeError("hidden", "expected bf16")))
    assert isinstance(d, TypeError) and isinstance(d, ValueError) and d.argument == "hidden"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
