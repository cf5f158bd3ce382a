"""Calls with more tokens than the capacity across 2 CPU ranks (gloo, torch reference): the ranks agree on the
number of capacity-sized launches (chunking="agree", or the caller's max_tokens_across_ranks), a rank with fewer
tokens takes part with zero, and every rank's output matches the single-process oracle (#24.3).

The rank-side function below runs on every rank (tools/launch loads this file by path)."""

import sys

import pytest
import torch

C = 8  # capacity
H, I, E, K = 128, 128, 8, 4


def _check(layer, hidden, idx, w, out):
    from moe_ep.reference.oracle import compare, gather_quantized_weights, oracle_forward

    qw_all = gather_quantized_weights(layer.ctx, layer.oracle_weights())
    ref = oracle_forward(qw_all, hidden, idx, w)
    ok, problems, row, *_ = compare(out, ref, layer.fmt)
    return {"ok": ok, "problems": problems, "row_err": row, "tokens": int(hidden.shape[0])}


def ranks(fmt: str = "bf16"):
    import moe_ep
    from moe_ep.core.dist import init_from_env
    from moe_ep.testing.problems import Problem
    from moe_ep.testing.scenario import error_record

    ctx = init_from_env()
    r = ctx.rank
    spec = moe_ep.MoESpec(H, I, E, K, C)
    rec = {}

    def run(name, tokens, layer, **kw):
        p = Problem.build(moe_ep.MoESpec(H, I, E, K, max(tokens)), ctx.world_size, tokens, "uniform", seed=len(rec))
        hidden, idx, w = p.inputs(r)
        out = torch.full((tokens[r], H), float("nan"), dtype=torch.bfloat16)
        try:
            layer(hidden, idx, w, out=out, **kw)
        except moe_ep.MoEError as e:
            rec[name] = {"error": error_record(e)}
            return
        rec[name] = _check(layer, hidden, idx, w, out)

    weights = Problem.build(spec, ctx.world_size, C).rank_weights(r)
    with moe_ep.MoELayer(spec, weights, fmt=fmt, chunking="agree") as agree, \
            moe_ep.MoELayer(spec, weights, fmt=fmt) as strict:
        run("agree_4C_vs_3", [4 * C, 3], agree)
        run("agree_0_vs_4C+1", [0, 4 * C + 1], agree)
        run("agree_both_under", [5, C], agree)
        # the strict layer's first call is agreed: one rank over capacity raises on both
        run("strict_over", [4 * C, 3], strict)
        run("strict_bound", [4 * C + 1, 2], strict, max_tokens_across_ranks=4 * C + 1)
        # later, a rank whose input is bad takes part in every chunk with zero tokens and raises alone
        p = Problem.build(moe_ep.MoESpec(H, I, E, K, 4 * C), ctx.world_size, [4 * C, 4 * C], "uniform", seed=99)
        hidden, idx, w = p.inputs(r)
        if r == 1:
            hidden = hidden.double()
        try:
            out = agree(hidden, idx, w)
            rec["agree_bad_rank_1"] = _check(agree, hidden, idx, w, out)
        except moe_ep.MoEError as e:
            rec["agree_bad_rank_1"] = {"error": error_record(e)}
            _check(agree, hidden[:0].bfloat16(), idx[:0], w[:0], torch.empty(0, H, dtype=torch.bfloat16))
        good = agree(*p.inputs(r))  # the layer serves the next call on every rank
        rec["after"] = _check(agree, *p.inputs(r), good)
    with moe_ep.MoELayer(spec, weights, fmt=fmt) as fresh:
        # a bound the ranks disagree on is caught on the layer's first (agreed) call
        run("bound_differs", [3, 3], fresh, max_tokens_across_ranks=2 * C + r)
    return rec


@pytest.fixture(scope="module", params=["bf16", "fp8_block"])
def records(request):
    from tools.launch.launcher import launch_function

    return launch_function(f"{__file__}:ranks", 2, {"fmt": request.param}, device="cpu", timeout_s=300)


def test_chunked_calls_match_the_oracle_on_every_rank(records):
    for r, rec in enumerate(records):
        for name, tokens in (("agree_4C_vs_3", [4 * C, 3]), ("agree_0_vs_4C+1", [0, 4 * C + 1]),
                             ("agree_both_under", [5, C]), ("strict_bound", [4 * C + 1, 2]),
                             ("after", [4 * C, 4 * C])):
            got = rec[name]
            assert got.get("ok") and got["tokens"] == tokens[r], (r, name, got)


def test_strict_layer_over_capacity_raises_on_every_rank(records):
    first, second = records[0]["strict_over"]["error"], records[1]["strict_over"]["error"]
    assert (first["type"], first["argument"]) == ("CapacityError", "hidden")
    assert (second["type"], second["ranks"]) == ("PeerValidationError", [0])


def test_a_bad_rank_takes_part_in_every_chunk(records):
    assert records[0]["agree_bad_rank_1"].get("ok"), records[0]["agree_bad_rank_1"]
    err = records[1]["agree_bad_rank_1"]["error"]
    assert (err["type"], err["argument"]) == ("DTypeError", "hidden")


def test_ranks_that_disagree_on_the_bound_raise_together(records):
    for rec in records:
        err = rec["bound_differs"]["error"]
        assert (err["type"], err["argument"]) == ("CapacityError", "max_tokens_across_ranks")
        assert "different values" in err["message"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
