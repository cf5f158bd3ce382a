"""EPLB in one process (docs/eplb.md): ExpertMap's validation and its vLLM-style form, the device router's replica
rule and counters, a slotted layer's construction errors, weight updates on a layer without a map, and the layer under
torch.compile (the custom op keeps counting). The multi-rank behaviour is eplb_multirank_test.py's."""
import pytest
import torch

import moe_ep
from moe_ep.eplb import SlotRouter
from moe_ep.reference.oracle import check_multirank, compare
from tests.support.dist import group_fixture  # noqa: F401 (the `group` fixture)

H, I, E, K, C = 256, 128, 4, 2, 16


# -- ExpertMap ------------------------------------------------------------------------------------------------------
def test_a_map_from_slots_lists_each_experts_replicas_in_slot_order():
    m = moe_ep.ExpertMap([0, 1, 2, 3, 0, 3, 0], num_logical=4)
    assert (m.num_slots, m.num_logical, m.max_replicas) == (7, 4, 4)
    assert m.slots_of(0) == [0, 4, 6] and m.slots_of(3) == [3, 5] and m.slots_of(1) == [1]
    assert m.replica_count.tolist() == [3, 1, 1, 2]
    assert m.replica_table.tolist() == [[0, 4, 6, -1], [1, -1, -1, -1], [2, -1, -1, -1], [3, 5, -1, -1]]
    assert m.logical_ids(torch.tensor([[6, -1], [5, 1]])).tolist() == [[0, -1], [3, 1]]
    assert list(m.local_slots(0, 7)) == [0] and m.slots_per_rank(7) == 1


def test_the_vllm_form_round_trips_and_keeps_its_replica_order():
    m = moe_ep.ExpertMap([0, 1, 2, 3, 0, 3, 0], num_logical=4)
    again = moe_ep.ExpertMap.from_replicas(m.replica_table, m.replica_count, num_slots=7)
    assert again == m and again.digest() == m.digest()
    # vLLM's table may be narrower or wider than ours, and a caller may order replicas as it likes
    other = moe_ep.ExpertMap.from_replicas([[6, 0, 4], [1, -1, -1], [2, -1, -1], [5, 3, -1]], num_slots=7)
    assert other.slots_of(0) == [6, 0, 4] and other.physical_to_logical.tolist() == m.physical_to_logical.tolist()
    assert other != m and other.digest() != m.digest()  # same placement, another routing
    assert other.changed_slots(m) == []
    wide = torch.nn.functional.pad(m.replica_table, (0, 12), value=-1)  # vLLM pads to its redundancy bound
    assert moe_ep.ExpertMap.from_replicas(wide, m.replica_count, num_slots=7) == m


@pytest.mark.parametrize("args, kwargs, etype, argument", [
    (([0, 1, 1],), dict(num_logical=3), "ExpertMapError", "physical_to_logical"),  # expert 2 has no slot
    (([0, 1, 3],), dict(num_logical=3), "ExpertMapError", "physical_to_logical"),  # id out of range
    (([0, -1, 1],), dict(num_logical=2), "ExpertMapError", "physical_to_logical"),
    (([0, 1],), dict(num_logical=3), "ExpertMapError", "physical_to_logical"),  # fewer slots than experts
    (([[0, 1]],), dict(num_logical=2), "ShapeError", "physical_to_logical"),
    (([0.0, 1.0],), dict(num_logical=2), "DTypeError", "physical_to_logical"),
    (([True, False],), dict(num_logical=2), "DTypeError", "physical_to_logical"),
    (([0, 1],), dict(num_logical=0), "ExpertMapError", "num_logical"),
])
def test_bad_maps_are_typed_errors(args, kwargs, etype, argument):
    with pytest.raises(moe_ep.MoEError) as e:
        moe_ep.ExpertMap(*args, **kwargs)
    assert (type(e.value).__name__, e.value.argument) == (etype, argument), str(e.value)


@pytest.mark.parametrize("table, count, why", [
    ([[0, 3], [1, -1], [2, -1]], None, "outside"),  # a replica points at slot 3 of 3
    ([[0, 1], [1, -1], [2, -1]], None, "claimed by logical experts 0 and 1"),
    ([[0, -1], [1, -1], [-1, -1]], None, "replicas"),  # expert 2 left without a slot
    ([[0, -1], [1, -1], [2, -1]], [1, 1, 1], None),  # fine: every slot once
    ([[0, -1], [1, -1]], None, "hold no logical expert"),  # slot 2 unclaimed
    ([[0, 2], [1, 5]], [1, 1], "not -1 padding"),
    ([[0, 2], [1, -1]], [2, 1, 1], "one count per logical expert"),
])
def test_bad_replica_tables_are_typed_errors(table, count, why):
    if why is None:
        assert moe_ep.ExpertMap.from_replicas(table, count, num_slots=3).num_slots == 3
        return
    with pytest.raises(moe_ep.errors.ExpertMapError) as e:
        moe_ep.ExpertMap.from_replicas(table, count, num_slots=3)
    assert why in str(e.value)


def test_reassign_moves_slots_and_refuses_to_orphan_an_expert():
    m = moe_ep.ExpertMap.round_robin(4, 6)  # slots 4, 5 replicate experts 0, 1
    n = m.reassign({5: 3})
    assert n.slots_of(1) == [1] and n.slots_of(3) == [3, 5] and m.changed_slots(n) == [5]
    with pytest.raises(moe_ep.errors.ExpertMapError, match="without a slot"):
        m.reassign({2: 0})
    with pytest.raises(moe_ep.errors.ExpertMapError, match="outside"):
        m.reassign({6: 0})
    assert m.slots_of(1) == [1, 5]  # values: nothing changed in place


# -- the router: the replica rule and the counters --------------------------------------------------------------
def _rule(m, idx, rank):
    t, k = idx.shape
    e = idx.clamp(min=0)
    j = (torch.arange(t).unsqueeze(1) + torch.arange(k).unsqueeze(0) + rank) % m.replica_count[e]
    return torch.where(idx < 0, -1, m.replica_table[e, j])


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("rank", [0, 3])
def test_the_router_applies_the_documented_replica_rule(dtype, rank):
    m = moe_ep.ExpertMap.from_replicas([[0, 7, 5], [1, -1, -1], [2, 6, -1], [3, 4, -1]], num_slots=8)
    router = SlotRouter(m, 8, top_k=3, capacity=40, rank=rank, device=torch.device("cpu"), id_space="logical",
                        count_load=True)
    g = torch.Generator().manual_seed(rank)
    idx = torch.rand(33, 4, generator=g).argsort(dim=1)[:, :3]
    idx[torch.rand(33, 3, generator=g) < 0.2] = -1
    got = router.route(idx.to(dtype))
    want = _rule(m, idx, rank)
    assert torch.equal(got, want)
    assert torch.equal(router.route(idx.to(dtype)), want)  # deterministic
    counts = router.load_counts(None, reset=False, gather=False)
    assert counts.tolist() == (2 * torch.bincount(want[want >= 0], minlength=8)).tolist()
    assert router.route(idx[:0].to(dtype)).shape == (0, 3)


def test_the_rule_spreads_a_hot_expert_over_its_replicas():
    m = moe_ep.ExpertMap.from_replicas([[0, 7, 5], [1, -1, -1], [2, 6, -1], [3, 4, -1]], num_slots=8)

    def route(idx, rank):
        r = SlotRouter(m, 8, top_k=2, capacity=64, rank=rank, device=torch.device("cpu"), id_space="logical",
                       count_load=False)
        return r.route(idx)

    # every token's top-1 is expert 0 (the usual hot pattern): consecutive tokens cycle through its replicas
    idx = torch.stack([torch.zeros(50, dtype=torch.int64), torch.arange(50) % 3 + 1], dim=1)
    hits = [int((route(idx, 0)[:, 0] == s).sum()) for s in (0, 7, 5)]
    assert sorted(hits) == [16, 17, 17]
    # decode: one token per rank, and the ranks spread over the replicas
    assert [int(route(idx[:1], r)[0, 0]) for r in range(3)] == [0, 7, 5]


def test_a_new_map_is_written_where_the_old_one_was():
    m = moe_ep.ExpertMap.round_robin(4, 6)
    router = SlotRouter(m, 6, top_k=2, capacity=8, rank=0, device=torch.device("cpu"), id_space="logical",
                        count_load=False)
    table_ptr, count_ptr = router._table.data_ptr(), router._count.data_ptr()
    n = moe_ep.ExpertMap.from_replicas([[4, 0], [1, -1], [2, -1], [3, 5]], num_slots=6)
    router.install(n)
    assert (router._table.data_ptr(), router._count.data_ptr()) == (table_ptr, count_ptr)
    idx = torch.tensor([[0, 3], [0, 3], [-1, 1]])
    assert router.route(idx).tolist() == _rule(n, idx, 0).tolist() == [[4, 5], [0, 3], [-1, 1]]


# -- the layer in one process ---------------------------------------------------------------------------------------
def _weights(seed=0, e=E):
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(e, 2 * I, H, generator=g) / 16).bfloat16(),
            (torch.randn(e, H, I, generator=g) / 11).bfloat16())


def _inputs(t=11, seed=1):
    g = torch.Generator().manual_seed(seed)
    idx = torch.rand(t, E, generator=g).argsort(dim=1)[:, :K].contiguous()
    return torch.randn(t, H, generator=g).bfloat16(), idx, torch.softmax(torch.randn(t, K, generator=g), dim=1)


def test_construction_refuses_maps_that_do_not_fit(group):
    spec = moe_ep.MoESpec(H, I, E, K, C)
    w13, w2 = _weights()
    m = moe_ep.ExpertMap.round_robin(E, 6)
    cases = [
        (dict(expert_map=moe_ep.ExpertMap.round_robin(E + 1, 6)), m.rank_weights, "ExpertMapError", "expert_map"),
        (dict(expert_map=m), lambda *a: moe_ep.ExpertWeights(w13, w2, 0, 1, E), "WeightsRankError", "weights"),
        (dict(expert_map=m, id_space="slots"), m.rank_weights, "ExpertMapError", "id_space"),
        (dict(id_space="physical"), lambda *a: moe_ep.ExpertWeights(w13, w2, 0, 1, E), "ExpertMapError", "id_space"),
        (dict(expert_map=m, count_load=1), m.rank_weights, "DTypeError", "count_load"),
        (dict(expert_map=[0, 1, 2, 3, 0, 1]), m.rank_weights, "DTypeError", "expert_map"),
    ]
    for kw, make, etype, argument in cases:
        with pytest.raises(moe_ep.MoEError) as e:
            moe_ep.MoELayer(spec, make(w13, w2, 0, 1), **kw)
        assert (type(e.value).__name__, e.value.argument) == (etype, argument), (kw, str(e.value))


def test_a_layer_without_a_map_counts_on_request_and_takes_weight_updates(group):
    spec = moe_ep.MoESpec(H, I, E, K, C)
    w13, w2 = _weights()
    x, idx, w = _inputs()
    with moe_ep.MoELayer(spec, moe_ep.ExpertWeights(w13, w2, 0, 1, E), fmt="fp8_block") as plain:
        assert plain.expert_map is None and plain.num_slots == E
        plain(x, idx, w)
        with pytest.raises(moe_ep.errors.LoadCountsError):
            plain.load_counts()
        with pytest.raises(moe_ep.errors.ExpertMapError, match="without an expert map"):
            plain.rearrange(moe_ep.ExpertMap.identity(E))
        # a weight update of expert 2 (an RL step): written in place, the oracle agrees with the new weights
        n13, n2 = _weights(seed=5, e=1)
        assert plain.replace_experts([2], (n13, n2)) == [2]
        w13[2], w2[2] = n13[0], n2[0]
        out = plain(x, idx, w)
        assert check_multirank(plain, x, idx, w, out, weights=moe_ep.ExpertWeights(w13, w2, 0, 1, E)).ok
    with moe_ep.MoELayer(spec, moe_ep.ExpertWeights(w13, w2, 0, 1, E), count_load=True) as counted:
        counted(x, idx, w)
        assert counted.load_counts().tolist() == torch.bincount(idx.flatten(), minlength=E).tolist()



@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_quantized_layer_refuses_non_finite_bf16_weights(group, bad):
    """A block scale saturates on an inf and the block's other codes round to zero: a quantized layer would return
    finite, wrong outputs for the tokens of that expert. Refused (WeightValueError naming tensor, expert and place)
    at construction and in a weight update, before anything changes; bf16 passes them through, visibly."""
    spec = moe_ep.MoESpec(H, I, E, K, C)
    w13, w2 = _weights()
    x, idx, w = _inputs()
    poisoned = w2.clone()
    poisoned[3, 5, 7] = bad
    for fmt in ("fp8_block", "w4a8_mxfp4", "mxfp8"):
        with pytest.raises(moe_ep.errors.WeightValueError) as e:
            moe_ep.MoELayer(spec, moe_ep.ExpertWeights(w13, poisoned, 0, 1, E), fmt=fmt)
        assert e.value.argument == "weights.w2" and "expert 3" in str(e.value) and "[5, 7]" in str(e.value), fmt
    with moe_ep.MoELayer(spec, moe_ep.ExpertWeights(w13, w2, 0, 1, E), fmt="fp8_block") as layer:
        before = layer(x, idx, w).clone()
        n13, n2 = _weights(seed=5, e=1)
        n13[0, 0, 0] = bad
        with pytest.raises(moe_ep.errors.WeightValueError, match="expert 0 holds"):
            layer.replace_experts([2], (n13, n2))
        assert torch.equal(layer(x, idx, w), before)  # nothing written
        # a pack whose values the format cannot hold: checked as a layer's own pack is, nothing written
        from dataclasses import replace as dc_replace

        from moe_ep.formats import quantize_weights
        pack = quantize_weights("fp8_block", *_weights(seed=5, e=1))
        for field, value in (("w2_scale", -pack.w2_scale), ("w13_scale", pack.w13_scale * float("nan"))):
            with pytest.raises(moe_ep.MoEError) as e:
                layer.replace_experts([2], dc_replace(pack, **{field: value}))
            assert isinstance(e.value, moe_ep.errors.WeightValueError) and e.value.argument == f"weights.{field}"
        assert torch.equal(layer(x, idx, w), before)
    with moe_ep.MoELayer(spec, moe_ep.ExpertWeights(w13, poisoned, 0, 1, E), fmt="bf16") as plain:
        out = plain(x, idx, w).float()
        through = (idx == 3).any(1)
        assert through.any() and not out[through].isfinite().all() and out[~through].isfinite().all()

def test_the_compiled_layer_maps_and_counts_inside_the_custom_op(group):
    spec = moe_ep.MoESpec(H, I, E, K, C)
    m = moe_ep.ExpertMap([0, 1, 2, 3, 0, 0], num_logical=E)
    layer = moe_ep.MoELayer(spec, m.rank_weights(*_weights(), 0, 1), expert_map=m, check_values=False,
                            collective_checks=False)

    def block(x, idx, w):
        return layer(x, idx, w) * 2

    torch._dynamo.reset()
    explained = torch._dynamo.explain(block)(*_inputs())
    assert explained.graph_break_count == 0, explained.break_reasons
    layer.load_counts(reset=True)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    x, idx, w = _inputs()
    assert torch.equal(compiled(x, idx, w).view(torch.int16), block(x, idx, w).view(torch.int16))
    want = torch.bincount(_rule(m, idx, 0).flatten(), minlength=6)
    assert layer.load_counts().tolist() == (2 * want).tolist()  # one compiled call, one eager
    layer.close()



def test_a_call_over_the_capacity_maps_each_chunk(group):
    """chunking='agree': a call of 2.5 x the capacity runs in capacity-sized launches, each mapped (the rule's t
    counts within a launch) and counted; the outputs are the logical model's, as a map-less layer computes it."""
    spec = moe_ep.MoESpec(H, I, E, K, C)
    w13, w2 = _weights()
    m = moe_ep.ExpertMap([0, 1, 2, 3, 0, 0], num_logical=E)
    x, idx, w = _inputs(t=5 * C // 2, seed=4)
    with moe_ep.MoELayer(spec, m.rank_weights(w13, w2, 0, 1), expert_map=m, chunking="agree") as slotted, \
            moe_ep.MoELayer(spec, moe_ep.ExpertWeights(w13, w2, 0, 1, E), chunking="agree") as plain:
        got, want = slotted(x, idx, w), plain(x, idx, w)
        assert compare(got, want, "bf16")[0]
        chunks = [idx[a:a + C] for a in range(0, idx.shape[0], C)]
        counts = sum(torch.bincount(_rule(m, c, 0).flatten(), minlength=6) for c in chunks)
        assert slotted.load_counts().tolist() == counts.tolist()
        assert counts[[0, 4, 5]].sum() == (idx == 0).sum() and min(counts[[0, 4, 5]]) > 0


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
