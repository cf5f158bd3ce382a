"""The split paths' parts in one process: domain maps (parsed, and derived from what ranks report), the dispatch /
combine index math against a plain per-token loop, the engines' slot compaction, the torch engines' CPU paths
against the oracle and an independent loop, the plan table, and one-rank layers of split, two_level and auto."""
import json
import sys

import pytest
import torch

import moe_ep
from moe_ep.reference.oracle import check_multirank, kernel_row_tolerance
from moe_ep.split import plan as plans
from moe_ep.split import topology
from moe_ep.split.layout import Layout, Rows, slot_owners
from moe_ep.testing.problems import make_routing
from tests.support.dist import group_fixture, one_rank_weights  # noqa: F401

H, I, E, K = 256, 128, 8, 4


# -- domain maps ---------------------------------------------------------------------------------------------------
def test_a_domain_map_is_parsed_into_canonical_order():
    d = topology.parse_domains(" 3,2 | 1,0", 4)
    assert d.domains == ((0, 1), (2, 3)) and d.describe() == "0,1|2,3" and d.uniform
    assert [d.domain_of(r) for r in range(4)] == [0, 0, 1, 1] and [d.local_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert d.rail(1) == (1, 3)
    strided = topology.parse_domains("0,2|1,3", 4)
    assert strided.rail(0) == (0, 1) and strided.domain_of(2) == 0


@pytest.mark.parametrize("text, ranks, words", [
    ("0,1|1,2", [1], "appear twice"), ("0,1", [2, 3], "in no domain"), ("0,1|2,3,4", [4], "not in a group"),
    ("0,x|1", [], "integers"), ("0,1||2,3", [], "empty domain")])
def test_a_bad_domain_map_is_a_typed_error_naming_the_ranks(text, ranks, words):
    with pytest.raises(moe_ep.errors.TopologyError) as info:
        topology.parse_domains(text, 4)
    assert info.value.argument == "MOE_EP_DOMAINS" and list(info.value.ranks) == ranks and words in str(info.value)


def _facts(host, dev, row, env=None):
    return (env, host, dev, tuple(row), "")


def test_domains_follow_hosts_and_p2p_reach():
    full = [True] * 4
    two_hosts = [_facts("a", 0, full), _facts("a", 1, full), _facts("b", 0, full), _facts("b", 1, full)]
    assert topology._derive(two_hosts, 4).describe() == "0,1|2,3"
    pairs = [[True, True, False, False], [True, True, False, False], [False, False, True, True],
             [False, False, True, True]]
    one_host = [_facts("a", r, pairs[r]) for r in range(4)]
    d = topology._derive(one_host, 4)
    assert d.describe() == "0,1|2,3" and d.source == "cuda p2p"
    cpu = [_facts("a", -1, ()), _facts("b", -1, ()), _facts("a", -1, ())]
    assert topology._derive(cpu, 3).describe() == "0,2|1"
    with pytest.raises(moe_ep.errors.TopologyError) as info:
        topology._derive([_facts("a", 0, full, "0|1"), _facts("a", 1, full, None)], 2)
    assert list(info.value.ranks) == [1] and "different domain maps" in str(info.value)
    with pytest.raises(moe_ep.errors.TopologyError, match="appear twice"):
        topology._derive([_facts("a", 0, full, "0|0"), _facts("a", 1, full, "0|0")], 2)


def test_a_fused_backend_is_refused_across_domains():
    topology.require_one_domain(topology.parse_domains("0,1,2,3", 4), "sm90_fp8_cutedsl")
    with pytest.raises(moe_ep.errors.TopologyError) as info:
        topology.require_one_domain(topology.parse_domains("0,1|2,3", 4), "sm90_fp8_cutedsl")
    assert info.value.ranks == (2, 3) and "'sm90_fp8_cutedsl'" in str(info.value)


# -- dispatch and combine --------------------------------------------------------------------------------------
def _routing(t, e, k, seed):
    idx, w = make_routing("masked", t, e, k, 1, 0, seed)
    return idx, w


@pytest.mark.parametrize("world", [1, 3, 4])
def test_exact_and_padded_rows_agree_with_a_per_token_loop(world):
    t, cap, e = 23, 32, 12
    idx, _ = _routing(t, e, K, world)
    e_local = e // world
    lay = Layout(*slot_owners(idx, e_local, world), world, cap)
    stats = lay.stats.tolist()
    exact = lay.rows(stats[:-1])
    padded = lay.rows(None)
    want = []  # (dest, token, ids) in send order: destinations in rank order, tokens in order
    for r in range(world):
        for tok in range(t):
            mine = [(int(x) - r * e_local) if x >= 0 and int(x) // e_local == r else -1 for x in idx[tok]]
            if any(m >= 0 for m in mine):
                want.append((r, tok, mine))
    assert exact.token.tolist() == [w[1] for w in want]
    assert exact.dest_ids().tolist() == [w[2] for w in want]
    assert stats[:-1] == [sum(1 for w in want if w[0] == r) for r in range(world)]
    keep = padded.token >= 0
    assert padded.token[keep].tolist() == exact.token.tolist()
    assert padded.dest_ids()[keep].tolist() == exact.dest_ids().tolist()
    assert (padded.dest_ids()[~keep] == -1).all()
    # Combine: per token, the fp32 sum of its partials in destination order, rounded once.
    back = torch.randn(exact.n, H).to(torch.bfloat16)
    out = torch.full((t, H), float("nan"), dtype=torch.bfloat16)
    exact.combine(back, out)
    ref = torch.zeros(t, H)
    for row, (_, tok, _) in enumerate(want):
        ref[tok] += back[row].float()
    assert torch.equal(out, ref.to(torch.bfloat16))
    back_p = torch.zeros(padded.n, H, dtype=torch.bfloat16)
    back_p[keep] = back
    back_p[~keep] = float("nan")  # what a padding row carries must not reach any token
    out_p = torch.full((t, H), float("nan"), dtype=torch.bfloat16)
    padded.combine(back_p, out_p)
    assert torch.equal(out_p, out)


def test_compaction_keeps_live_slots_in_order():
    ids = torch.tensor([[-1, 3, -1, 1], [2, -1, -1, -1], [-1, -1, -1, -1]], dtype=torch.int32)
    w = torch.arange(12, dtype=torch.float32).view(3, 4)
    c_ids, c_w = Rows.compact(ids, w, 2)
    assert c_ids.tolist() == [[3, 1], [2, -1], [-1, -1]] and c_w[:2].tolist() == [[1.0, 3.0], [4.0, 5.0]]


# -- one-rank layers ---------------------------------------------------------------------------------------------
SPEC = moe_ep.MoESpec(H, I, E, K, 32)


def _inputs(seed):
    idx, w = _routing(29, E, K, seed)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(29, H, generator=g).to(torch.bfloat16), idx, w


@pytest.mark.parametrize("backend, options", [("split", {}), ("split", {"transport": "padded"}),
                                              ("two_level", {}), ("auto", {})])
def test_one_rank_paths_equal_the_reference_bit_for_bit(group, backend, options):
    weights = one_rank_weights(E, H, I, 16.0)
    x, idx, w = _inputs(5)
    with moe_ep.MoELayer(SPEC, weights, backend="torch_reference", fmt="fp8_block") as ref:
        want = ref(x, idx, w)
    with moe_ep.MoELayer(SPEC, weights, backend=backend, fmt="fp8_block", **options) as layer:
        out = torch.full_like(want, float("nan"))
        layer(x, idx, w, out=out)
        assert torch.equal(out, want)  # one destination: the partial is the sum, bit for bit
        assert layer.plan.path in ("split", "two_level", "reference") and layer.plan.domains.startswith("0 ")


@pytest.mark.parametrize("engine", ["torch_fp8_block128", "torch_fp8_rowwise"])
@pytest.mark.parametrize("topk_in_fc1", [True, False])
def test_torch_engines_on_the_cpu(group, engine, topk_in_fc1):
    """Their CPU paths (fp32 matmuls over the quantized operands): block128 differs from the format only in the
    FC2-input block and a bf16 FC1 output, so it is held to the kernels' bound; rowwise computes its own format,
    checked against a plain loop over the same quantized operands. Routing weights in FC1 or on the FC2 output."""
    weights = one_rank_weights(E, H, I, 16.0)
    x, idx, w = _inputs(9)
    with moe_ep.MoELayer(SPEC, weights, backend="split", fmt="fp8_block", engine=engine,
                         apply_topk_in_fc1=topk_in_fc1) as layer:
        out = torch.full((x.shape[0], H), float("nan"), dtype=torch.bfloat16)
        layer(x, idx, w, out=out)
        assert layer.plan.engine == engine and ("1x" in layer.plan.numerics or "rowwise" in layer.plan.numerics)
        assert "torch ops" in layer.plan.numerics  # the CPU has no Triton kernels
        if engine == "torch_fp8_block128":
            check_multirank(layer, x, idx, w, out, weights=weights, tol=kernel_row_tolerance("fp8_block", I))
            return
    from moe_ep.formats.codecs import fp8_quantize_rows

    def rowwise(a):
        q, s = fp8_quantize_rows(a, a.shape[1])
        return q.float() * s

    ref = torch.zeros(x.shape[0], H)
    xq = rowwise(x)
    for tok in range(x.shape[0]):
        terms = []
        for j in range(K):
            e = int(idx[tok, j])
            if e < 0:
                continue
            w13 = rowwise(weights.w13[e])
            w2 = rowwise(weights.w2[e])
            fc1 = (xq[tok] @ w13.t()).to(torch.bfloat16).float()
            y = torch.nn.functional.silu(fc1[:I]) * fc1[I:] * (w[tok, j] if topk_in_fc1 else 1.0)
            term = (rowwise(y.unsqueeze(0))[0] @ w2.t()).to(torch.bfloat16)
            terms.append(term if topk_in_fc1 else (term.float() * w[tok, j]).to(torch.bfloat16))
        acc = torch.zeros(H)
        for term in terms:
            acc += term.float()
        ref[tok] = acc
    err = ((out.float() - ref.to(torch.bfloat16).float()).norm(dim=1) / ref.norm(dim=1).clamp(min=1e-6)).max()
    assert float(err) < 1e-2


def test_block128_hands_cublas_aligned_blocks_with_their_own_column_major_scales(group, monkeypatch):
    """What cuBLAS's blockwise FP8 GEMM needs (moe_ep/split/torch_engine.py): every GEMM's M a multiple of
    ROW_ALIGN and its 1x128 scales [M, K/128] column-major over exactly its rows (strides (1, M)); each expert's
    first count rows are its pairs' rows in order (their bytes and scales), the padding real rows' bytes."""
    from moe_ep.formats import packs
    from moe_ep.split import torch_engine as te

    seen = []
    real = te.block_scaled_mm

    def spy(a, a_scale, w, w_scale, out):
        seen.append((a.clone(), a_scale.clone(), a_scale.stride(), out.shape, w.shape))
        return real(a, a_scale, w, w_scale, out)

    monkeypatch.setattr(te, "block_scaled_mm", spy)
    weights = one_rank_weights(E, H, I, 16.0)
    x, idx, w = _inputs(11)
    idx[:, 1] = torch.where(idx[:, 0] == 3, -1, idx[:, 1])  # some -1 slots beside the routing's own
    idx[idx == 5] = -1  # and one expert with no rows at all
    with moe_ep.MoELayer(SPEC, weights, backend="split", fmt="fp8_block", engine="torch_fp8_block128") as layer:
        out = torch.full((x.shape[0], H), float("nan"), dtype=torch.bfloat16)
        layer(x, idx, w, out=out)
        check_multirank(layer, x, idx, w, out, weights=weights, tol=kernel_row_tolerance("fp8_block", I))
        act = packs.quantize_input(layer.backend.engine.oracle_weights(), x)
    counts = [int((idx == e).sum()) for e in range(E)]
    live = [e for e in range(E) if counts[e]]
    assert counts[5] == 0 and len(seen) == 2 * len(live)  # FC1 then FC2 per expert with rows; none for expert 5
    for n, (a, a_scale, stride, out_shape, w_shape) in enumerate(seen):
        m = a.shape[0]
        assert m % te.ROW_ALIGN == 0 and stride == (1, m), (m, stride)
        assert a_scale.shape == (m, a.shape[1] // 128) and out_shape == (m, w_shape[0])
        assert torch.isfinite(a.float()).all() and (a_scale > 0).all()
        if n < len(live):  # FC1: the pairs' token rows, in token order
            e = live[n]
            assert te.ROW_ALIGN * ((counts[e] + te.ROW_ALIGN - 1) // te.ROW_ALIGN) == m
            tokens = (idx == e).any(dim=1).nonzero().reshape(-1)
            assert torch.equal(a[:counts[e]].view(torch.uint8), act.q[tokens].view(torch.uint8))
            assert torch.equal(a_scale[:counts[e]], act.scale[tokens])


def test_torch_ops_swiglu_quant_puts_each_scale_where_it_is_told():
    """TorchOps.swiglu_quant (what the Triton kernel is held to) against the reference's SwiGLU and the FC2-input
    quantizer, for the block128 layout (gate/up in groups of 64, scales column-major per expert block) and the
    rowwise one (gate | up, one scale per row), with the clamp and the routing weight."""
    from moe_ep.formats.codecs import fp8_quantize_rows
    from moe_ep.reference.ffn import swiglu
    from moe_ep.split.torch_engine import TorchOps, gate_up_blocks

    g = torch.Generator().manual_seed(4)
    i, sizes = 256, [16, 0, 32, 16]
    m = sum(sizes)
    canon = (torch.randn(m, 2 * i, generator=g) * 3).to(torch.bfloat16)
    wt = torch.rand(m, generator=g)
    want_y = swiglu(canon.float(), 2.5) * wt.unsqueeze(1)
    blocked = canon[:, gate_up_blocks(i)]  # the block128 engine's FC1 output order
    q_want, s_want = fp8_quantize_rows(want_y, 128, reciprocal=True)
    starts = [sum(sizes[:x]) for x in range(len(sizes))]
    expert = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    start_of, size_of = torch.tensor(starts)[expert], torch.tensor(sizes)[expert]
    nb = i // 128
    q = torch.empty(m, i, dtype=torch.float8_e4m3fn)
    s = torch.full((m * nb,), float("nan"))
    TorchOps.swiglu_quant(blocked, 64, 2.5, wt, 128, q, s, start_of * nb + torch.arange(m) - start_of, size_of)
    assert torch.equal(q.view(torch.uint8), q_want.view(torch.uint8))
    for x, (a, n) in enumerate(zip(starts, sizes)):
        if n:
            assert torch.equal(s[a * nb:(a + n) * nb].view(nb, n).t(), s_want[a:a + n])
    q_row, s_row = fp8_quantize_rows(swiglu(canon.float(), None), i, reciprocal=True)
    s1 = torch.full((m,), float("nan"))
    TorchOps.swiglu_quant(canon, i, None, None, i, q, s1)
    assert torch.equal(q.view(torch.uint8), q_row.view(torch.uint8)) and torch.equal(s1, s_row.reshape(-1))


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("width", [1, 3])
def test_torch_ops_combine_sums_slots_in_order_and_rounds_once(weighted, width):
    from moe_ep.split.torch_engine import TorchOps

    g = torch.Generator().manual_seed(width)
    n, h, p = 7, 64, 11
    terms = torch.randn(p, h, generator=g).to(torch.bfloat16)
    terms[2, :4] = -0.0
    pos_of = torch.randint(-1, p, (n * width,), generator=g)
    pos_of[0] = -1
    wt = torch.rand(n * width, generator=g) if weighted else None
    out = torch.full((n, h), float("nan"), dtype=torch.bfloat16)
    TorchOps.combine(terms, pos_of, width, wt, out)
    want = torch.empty(n, h, dtype=torch.bfloat16)
    for r in range(n):
        acc = None
        for j in range(width):
            k = int(pos_of[r * width + j])
            t = terms[k] if k >= 0 else torch.zeros(h, dtype=torch.bfloat16)
            if k >= 0 and wt is not None:
                t = (t.float() * wt[r * width + j]).to(torch.bfloat16)
            acc = t.float() if acc is None else acc + t.float()
        want[r] = acc.to(torch.bfloat16)
    assert torch.equal(out, want)
    empty = torch.full((n, h), float("nan"), dtype=torch.bfloat16)
    TorchOps.combine(terms[:0], torch.full((n * width,), -1), width, wt, empty)
    assert not empty.any()


def test_torch_engine_options_are_checked(group):
    weights = one_rank_weights(E, H, I, 16.0)
    with pytest.raises(moe_ep.BackendUnavailableError, match="CUDA"):
        moe_ep.MoELayer(SPEC, weights, backend="split", fmt="fp8_block", engine="torch_fp8_rowwise",
                        engine_options={"kernels": "triton"})
    with pytest.raises(moe_ep.SpecError, match="kernels"):
        moe_ep.MoELayer(SPEC, weights, backend="split", fmt="fp8_block", engine="torch_fp8_block128",
                        engine_options={"kernels": "x"})
    with pytest.raises(moe_ep.SpecError, match="takes engine_options kernels"):
        moe_ep.MoELayer(SPEC, weights, backend="split", fmt="fp8_block", engine="torch_fp8_block128",
                        engine_options={"tile": 64})
    with moe_ep.MoELayer(SPEC, weights, backend="split", fmt="fp8_block", engine="torch_fp8_rowwise",
                         engine_options={"kernels": "torch"}) as layer:
        assert layer.backend.engine.kernels == "torch"


def test_auto_with_named_candidates_reports_what_it_chose(group, monkeypatch):
    """A torch engine joins auto's candidates only by name, and its numerics travel with the plan."""
    monkeypatch.setattr(plans, "_table", {})
    weights = one_rank_weights(E, H, I, 16.0)
    x, idx, w = _inputs(3)
    cands = ["torch_reference", "split", "split:torch_fp8_block128"]
    with moe_ep.MoELayer(SPEC, weights, backend="auto", fmt="fp8_block", candidates=cands, reps=1) as layer:
        p = layer.plan
        scores = dict(p.scores_us)
        assert list(scores) == cands and p.source == "measured"
        winner = min(scores, key=scores.get)
        assert (p.backend, p.engine) == {"torch_reference": ("torch_reference", None),
                                         "split": ("split", "reference"),
                                         "split:torch_fp8_block128": ("split", "torch_fp8_block128")}[winner]
        if winner == "split:torch_fp8_block128":
            assert "1x128" in p.numerics
        out = layer(x, idx, w)
        check_multirank(layer, x, idx, w, out, weights=weights, tol=kernel_row_tolerance("fp8_block", I))
    with pytest.raises(moe_ep.SpecError, match="tokens"):
        moe_ep.MoELayer(SPEC, weights, backend="auto", tokens=SPEC.max_tokens_per_rank + 1)


def test_two_level_takes_a_whole_group_backend_inside(group):
    weights = one_rank_weights(E, H, I, 16.0)
    with pytest.raises(moe_ep.SpecError, match="whole-group"):
        moe_ep.MoELayer(SPEC, weights, backend="two_level", inner="split")
    with pytest.raises(moe_ep.SpecError, match="wire"):
        moe_ep.MoELayer(SPEC, weights, backend="two_level", wire="fp4")


def test_the_plan_table_is_read_back_from_its_file(tmp_path, monkeypatch):
    path = tmp_path / "plans.json"
    monkeypatch.setenv(plans.ENV_TABLE, str(path))
    monkeypatch.setattr(plans, "_table", {})
    plans.store("k1", "split", rank=0)
    assert json.loads(path.read_text()) == {"k1": "split"}
    monkeypatch.setattr(plans, "_table", {})
    assert plans.lookup("k1") == "split" and plans.lookup("k2") is None
    assert [plans.bucket(c) for c in (1, 8, 9, 4096, 5000)] == [8, 8, 16, 4096, 8192]


def test_unknown_engines_and_transports_are_typed_errors(group):
    weights = one_rank_weights(E, H, I, 16.0)
    with pytest.raises(moe_ep.SpecError, match="unknown engine"):
        moe_ep.MoELayer(SPEC, weights, backend="split", engine="nope")
    with pytest.raises(moe_ep.SpecError, match="transport"):
        moe_ep.MoELayer(SPEC, weights, backend="split", transport="carrier pigeon")
    with pytest.raises(moe_ep.FormatError, match="serves"):
        moe_ep.MoELayer(SPEC, weights, backend="split", fmt="bf16", engine="torch_fp8_block128")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
