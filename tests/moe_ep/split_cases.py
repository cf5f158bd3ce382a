"""Rank-side cases of the split paths' tests (run by tools/launch on every rank; loaded by file path). Each case
builds a layer, runs one forward into a NaN-poisoned buffer and checks it against the single-process oracle
(moe_ep.reference.oracle.check_multirank); the records are JSON-able, so the test process asserts on every rank's
view. Domain maps are simulated with $MOE_EP_DOMAINS, set per case on every rank alike.
"""

from __future__ import annotations

import os
import traceback

import torch

import moe_ep
from moe_ep.core.dist import init_from_env
from moe_ep.formats import FORMATS, format_info
from moe_ep.reference.backend import TorchReferenceBackend
from moe_ep.reference.oracle import check_multirank
from moe_ep.split import plan as plans
from moe_ep.testing.problems import Problem
from moe_ep.testing.scenario import error_record

H, I, K = 256, 128, 4
CAPACITY = 64
# Uneven tokens per rank, one rank with none.
TOKENS = {2: [37, 0], 3: [37, 0, 20], 4: [37, 0, 20, 64]}


class P2PReference(TorchReferenceBackend):
    """The torch reference posing as a backend that reaches its peers by P2P (a fused kernel): what the topology
    refusal is tested with on CPU ranks."""

    name = "test_p2p_reference"
    needs_p2p = True


def _experts(world: int) -> int:
    return 12 if world == 3 else 8


def _domains(value):
    if value is None:
        os.environ.pop("MOE_EP_DOMAINS", None)
    else:
        os.environ["MOE_EP_DOMAINS"] = value


def _check(ctx, layer, weights, hidden, idx, w, out_dtype=None) -> dict:
    out = torch.full((hidden.shape[0], H), float("nan"), dtype=out_dtype or torch.bfloat16)
    got = layer(hidden, idx, w, out=out)
    report = check_multirank(layer, hidden.to(torch.bfloat16), idx, w.to(torch.float32), out.to(torch.bfloat16),
                             weights=weights, raise_on_failure=False)
    mine = report.mine(ctx.rank)
    return dict(ok=report.ok, problems=mine.problems, err=mine.max_row_rel_err, tol=mine.tolerance,
                same_tensor=got is out, out_dtype=str(out.dtype), plan=layer.plan.as_dict(),
                backend=layer.backend_name, fmt=layer.fmt)


def run_case(ctx, *, fmt="fp8_block", backend="split", routing="masked", domains=None, options=None, seed=0,
             expert_map=None, hidden_dtype=None, out_dtype=None, second_layer=False) -> dict:
    world = ctx.world_size
    _domains(domains)
    try:
        spec = moe_ep.MoESpec(H, I, _experts(world), K, CAPACITY)
        problem = Problem.build(spec, world, TOKENS[world], routing, seed)
        hidden, idx, w = problem.inputs(ctx.rank)
        if hidden_dtype is not None:
            hidden = hidden.to(hidden_dtype)
        if expert_map is not None:
            emap = moe_ep.ExpertMap(expert_map, spec.num_experts)
            w13, w2 = problem.global_weights()
            kw = dict(act_amax=5.0, fc2_act_amax=0.5) if format_info(fmt).static_activation_scales else {}
            weights = emap.rank_weights(w13, w2, ctx.rank, world, **kw)
            layer = moe_ep.MoELayer(spec, weights, backend=backend, fmt=fmt, expert_map=emap, **(options or {}))
        else:
            weights = problem.rank_weights(ctx.rank, calibrate=format_info(fmt).static_activation_scales)
            layer = moe_ep.MoELayer(spec, weights, backend=backend, fmt=fmt, **(options or {}))
        with layer:
            rec = _check(ctx, layer, weights, hidden, idx, w, out_dtype)
        if second_layer:  # the same shape again: auto reads the plan the first layer measured
            with moe_ep.MoELayer(spec, weights, backend=backend, fmt=fmt, **(options or {})) as again:
                rec["second"] = _check(ctx, again, weights, hidden, idx, w)
        return rec
    finally:
        _domains(None)


def refusal(ctx, *, backend, domains, fmt="bf16") -> dict:
    """A layer that must be refused on every rank: the error each rank raised."""
    _domains(domains)
    try:
        spec = moe_ep.MoESpec(H, I, _experts(ctx.world_size), K, CAPACITY)
        weights = Problem.build(spec, ctx.world_size, TOKENS[ctx.world_size]).rank_weights(ctx.rank)
        try:
            moe_ep.MoELayer(spec, weights, backend=backend, fmt=fmt).close()
        except moe_ep.MoEError as e:
            return {"error": error_record(e)}
        return {"error": None}
    finally:
        _domains(None)


def duplicate(ctx) -> dict:
    """Rank 1 routes a token to one expert twice where a rank holds fewer experts than top_k: every rank raises
    (the counts exchange carries each rank's largest slot count), no rank waits in the payload exchange."""
    spec = moe_ep.MoESpec(H, I, _experts(ctx.world_size), K, CAPACITY)
    problem = Problem.build(spec, ctx.world_size, TOKENS[ctx.world_size], "uniform")
    hidden, idx, w = problem.inputs(ctx.rank)
    if ctx.rank == 1:
        hidden, idx, w = problem.inputs(0)
        idx[3] = torch.tensor([5, 5, 4, -1])
    with moe_ep.MoELayer(spec, problem.rank_weights(ctx.rank), backend="split", fmt="bf16") as layer:
        try:
            layer(hidden, idx, w)
        except moe_ep.MoEError as e:
            return {"error": error_record(e)}
    return {"error": None}


def cases(world: int) -> list:
    """(name, function, kwargs) of one world size's cases. Every served format runs at world size 4 (split and
    two_level); 2 and 3 ranks run a spread of them."""
    every = "|".join(str(r) for r in range(world))  # each rank its own domain
    formats = {2: ["fp8_block", "nvfp4"], 3: ["bf16", "mxfp8", "w4a8_nvfp4"], 4: list(FORMATS)}[world]
    # -1 slots, a rank with no tokens and uneven T in every case; rows cross in the format's own bytes.
    out = [(f"split_{f}", run_case, dict(fmt=f)) for f in formats]
    out += [
        ("split_eplb", run_case, dict(expert_map=[s % _experts(world) for s in range(2 * _experts(world))])),
        ("auto_one_domain", run_case, dict(backend="auto", fmt="fp8_block", second_layer=True)),
        ("refuse_p2p", refusal, dict(backend="test_p2p_reference", domains=every)),
        ("refuse_bad_map", refusal, dict(backend="split", domains="0,1|1")),
    ]
    if world == 2:
        out += [
            ("split_balanced_bf16_wire", run_case, dict(routing="balanced", options=dict(wire="bf16"))),
            ("split_padded_nvfp4", run_case, dict(fmt="nvfp4", options=dict(transport="padded"))),
            ("split_out_fp32_hidden_fp16", run_case, dict(hidden_dtype=torch.float16, out_dtype=torch.float32)),
            ("default_ignores_domains", run_case, dict(backend=None, fmt="bf16", domains=every)),
            ("two_level_bf16", run_case, dict(backend="two_level", fmt="bf16", domains="0|1")),
            ("two_level_fp8_block_padded", run_case, dict(backend="two_level", domains="0|1",
                                                          options=dict(transport="padded"))),
            ("auto_two_domains", run_case, dict(backend="auto", domains="0|1", routing="uniform")),
        ]
    if world == 3:
        out += [
            ("split_no_local", run_case, dict(fmt="bf16", routing="no_local")),
            ("split_unweighted_fc2", run_case, dict(fmt="mxfp8", options=dict(apply_topk_in_fc1=False))),
            ("two_level_uneven_domains", refusal, dict(backend="two_level", domains="0,1|2")),
            ("two_level_one_domain", run_case, dict(backend="two_level", domains="0,1,2")),
        ]
    if world == 4:
        out += [(f"two_level_{f}", run_case, dict(backend="two_level", fmt=f, domains="0,1|2,3")) for f in FORMATS]
        out += [
            ("split_padded", run_case, dict(routing="uniform", options=dict(transport="padded"))),
            ("two_level_strided_domains", run_case, dict(backend="two_level", domains="0,2|1,3")),
            ("two_level_padded_eplb", run_case, dict(backend="two_level", domains="0,1|2,3",
                                                     expert_map=[(3 * s) % 8 for s in range(16)],
                                                     options=dict(transport="padded"))),
            ("auto_two_domains", run_case, dict(backend="auto", domains="0,1|2,3", routing="uniform",
                                                second_layer=True)),
            ("refuse_p2p_two_domains", refusal, dict(backend="test_p2p_reference", domains="0,1|2,3")),
            ("split_duplicate_expert", duplicate, {}),
        ]
    return out


def suite(names=None) -> dict:
    """Every case of this world size, in one set of rank processes: {name: record}. A case that raises records
    the error and the next one runs (each case's collectives are complete on every rank when it returns)."""
    ctx = init_from_env()
    moe_ep.register_backend("test_p2p_reference", P2PReference, arch="cpu", formats=FORMATS)
    plans._table.clear()
    recs = {}
    for name, fn, kw in cases(ctx.world_size):
        if names and name not in names:
            continue
        try:
            recs[name] = fn(ctx, **kw)
        except Exception as e:  # noqa: BLE001 - recorded; the test names it
            recs[name] = {"error": error_record(e) if isinstance(e, moe_ep.MoEError) else
                          {"type": type(e).__name__, "message": str(e)}, "traceback": traceback.format_exc()}
    return recs
