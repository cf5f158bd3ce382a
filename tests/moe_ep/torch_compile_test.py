"""A model calling moe_ep traces under torch.compile(fullgraph=True): the forward is one registered custom op
(moe_ep::forward / moe_ep::forward_out, moe_ep/core/op.py) with a fake implementation, so the compiler sees no
graph break, and the compiled model's output equals eager (one-rank gloo group, torch reference backend)."""

import re

import pytest
import torch

import moe_ep
from moe_ep.testing.model import MoEModel
from tests.support.dist import one_rank_gloo_group

H, I, E, K, C = 256, 128, 8, 2, 32


@pytest.fixture(scope="module")
def model():
    with one_rank_gloo_group():
        g = torch.Generator().manual_seed(0)
        spec = moe_ep.MoESpec(H, I, E, K, C)
        packs = [moe_ep.ExpertWeights((torch.randn(E, 2 * I, H, generator=g) / 16).bfloat16(),
                                      (torch.randn(E, H, I, generator=g) / 11).bfloat16(), 0, 1, E)
                 for _ in range(3)]
        m = MoEModel.build(spec, packs, fmt="fp8_block", check_values=False, collective_checks=False)
        yield m
        m.close()


def _x(t, seed=1):
    return torch.randn(t, H, generator=torch.Generator().manual_seed(seed)).bfloat16()


def test_the_op_is_registered_with_its_schema():
    schema = str(torch.ops.moe_ep.forward.default._schema)
    assert re.match(r"moe_ep::forward\(Tensor hidden, Tensor topk_idx, Tensor topk_weights, (SymInt|int) layer, "
                    r"(SymInt|int)\? max_tokens=None\) -> Tensor", schema), schema
    out_schema = str(torch.ops.moe_ep.forward_out.default._schema)
    assert re.search(r"Tensor\(a\d*!\) out", out_schema), out_schema  # the mutation is declared


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fullgraph_compile_equals_eager(model, backend):
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend, dynamic=False)
    for t in (17, 32):
        x = _x(t, seed=t)
        want = model(x)
        got = compiled(x)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (t, (got.float() - want.float()).abs().max())


def test_no_graph_break_and_one_op_per_layer(model):
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(_x(9))
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    code = "\n".join(str(g.graph) for g in explained.graphs)
    assert code.count("moe_ep.forward") == len(model.blocks), code


def test_out_variant_and_zero_tokens_compile(model):
    torch._dynamo.reset()
    layer = model.layers[0]

    def f(x, idx, w, out):
        layer(x, idx, w, out=out)
        return out * 2

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for t in (0, 5):
        x = _x(t, seed=3)
        idx = torch.randint(0, E, (t, K))
        idx[:, 1] = -1 if t else idx[:, 1]  # -1 slots under compile too
        w = torch.rand(t, K)
        out = torch.full((t, H), float("nan"), dtype=torch.bfloat16)
        got = compiled(x, idx, w, out)
        assert torch.equal(got.view(torch.int16), (layer(x, idx, w) * 2).view(torch.int16))
        assert not torch.isnan(out).any()


def test_a_closed_layer_is_a_typed_error_not_a_crash():
    from moe_ep.core import op

    with pytest.raises(moe_ep.MoEError) as err:
        op.forward(_x(2), torch.zeros(2, K, dtype=torch.int64), torch.ones(2, K), 10 ** 9)
    assert err.value.argument == "layer"


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
