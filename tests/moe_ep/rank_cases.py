"""Rank-side functions of the multi-rank tests (run by tools/launch on every rank; loaded by file path).

They return JSON-able records so the test process can assert on every rank's view."""

from __future__ import annotations

import time

import torch

import moe_ep
from moe_ep.core.dist import init_from_env
from moe_ep.reference.backend import TorchReferenceBackend
from moe_ep.reference.oracle import check_multirank
from moe_ep.testing.problems import Problem
from moe_ep.testing.scenario import error_record

H, I, E, K = 256, 128, 8, 4


def _swap01(qw):
    """The same weights with local experts 0 and 1 exchanged: a plausible loader bug."""
    from dataclasses import replace

    kw = {}
    for name in qw.per_expert_fields():
        t = getattr(qw, name).clone()
        t[[0, 1]] = t[[1, 0]]
        kw[name] = t
    return replace(qw, **kw)


class LyingBackend(TorchReferenceBackend):
    """Computes with swapped experts on rank `bad_rank` but reports the correct weights."""
    bad_rank = 1

    def prepare_weights(self, weights):
        super().prepare_weights(weights)
        self._compute = _swap01(self._qw) if self.ctx.rank == self.bad_rank else self._qw

    def compute_experts(self, qw, act, local_expert, weights):
        return super().compute_experts(self._compute, act, local_expert, weights)


class HonestWrongBackend(TorchReferenceBackend):
    """Computes with, and reports, swapped experts on rank `bad_rank`: self-consistent, still wrong."""
    bad_rank = 2

    def prepare_weights(self, weights):
        super().prepare_weights(weights)
        if self.ctx.rank == self.bad_rank:
            self._qw = _swap01(self._qw)


class MisroutingBackend(TorchReferenceBackend):
    """Every rank reverses its local expert order: all ranks agree with each other, all are wrong."""

    def compute_experts(self, qw, act, local_expert, weights):
        return super().compute_experts(qw, act, qw.num_experts - 1 - local_expert, weights)


FAULTY = {"t_lying": LyingBackend, "t_honest_wrong": HonestWrongBackend, "t_misrouting": MisroutingBackend}


def faulty(fmt: str = "bf16"):
    ctx = init_from_env()
    for name, cls in FAULTY.items():
        moe_ep.register_backend(name, cls, arch="cpu", formats=cls.weight_formats, replace=True)
    spec = moe_ep.MoESpec(H, I, E, K, 32)
    problem = Problem.build(spec, ctx.world_size, 32, "uniform", seed=5)
    weights = problem.rank_weights(ctx.rank)
    hidden, idx, w = problem.inputs(ctx.rank)
    records = {}
    for name in ["torch_reference", *FAULTY]:
        with moe_ep.MoELayer(spec, weights, backend=name, fmt=fmt) as layer:
            out = layer(hidden, idx, w)
            # The ranks' outputs are self-consistent: a repeat call gives the same bytes.
            same = torch.equal(out, layer(hidden, idx, w))
            try:
                report = check_multirank(layer, hidden, idx, w, out, weights=weights)
                records[name] = {"ok": report.ok, "deterministic": same}
            except moe_ep.errors.OracleMismatchError as e:
                records[name] = {"error": error_record(e), "deterministic": same}
    return records


def _inputs_for(kind, rank, bad_rank, problem, spec):
    hidden, idx, w = problem.inputs(rank)
    out = None
    if rank != bad_rank:
        return hidden, idx, w, out
    if kind == "dtype":
        hidden = hidden.double()
    elif kind == "shape":
        hidden = hidden[:, : H // 2].contiguous()
    elif kind == "topk":
        idx, w = idx[:, :-1].contiguous(), w[:, :-1].contiguous()
    elif kind == "device":
        idx = idx.to("meta")
    elif kind == "noncontig":
        hidden = hidden.t().contiguous().t()
    elif kind == "negative_id":
        idx[0, 0] = -3
    elif kind == "id_out_of_range":
        idx[-1, -1] = spec.num_experts + 5
    elif kind == "over_capacity":
        hidden = torch.cat([hidden, hidden])
        idx, w = torch.cat([idx, idx]), torch.cat([w, w])
    elif kind == "out_dtype":
        out = torch.empty(hidden.shape, dtype=torch.int32)
    return hidden, idx, w, out


FORWARD_KINDS = ["dtype", "shape", "topk", "device", "noncontig", "negative_id", "id_out_of_range",
                 "over_capacity", "out_dtype"]


def bad_inputs(bad_rank: int = 2):
    """Each bad forward input on one rank, with the cross-rank agreement on every call (collective_checks=True):
    that rank gets its typed error, every other rank a PeerValidationError naming it; then the same layer serves a
    good call on every rank."""
    ctx = init_from_env()
    spec = moe_ep.MoESpec(H, I, E, K, 24)
    problem = Problem.build(spec, ctx.world_size, [24, 5, 17, 0][: ctx.world_size], "uniform", seed=9)
    weights = problem.rank_weights(ctx.rank)
    records = {}
    with moe_ep.MoELayer(spec, weights, collective_checks=True) as layer:
        for kind in FORWARD_KINDS:
            hidden, idx, w, out = _inputs_for(kind, ctx.rank, bad_rank, problem, spec)
            t0 = time.monotonic()
            try:
                layer(hidden, idx, w, out=out)
                rec = {"error": None}
            except moe_ep.MoEError as e:
                rec = {"error": error_record(e)}
            rec["seconds"] = time.monotonic() - t0
            good = problem.inputs(ctx.rank)
            rec["recovered"] = bool(torch.isfinite(layer(*good).float()).all())
            records[kind] = rec

    def attempt(make):
        try:
            spec_, weights_, kw = make()
            moe_ep.MoELayer(spec_, weights_, **kw).close()
            return {"error": None}
        except moe_ep.MoEError as e:
            return {"error": error_record(e)}

    # weights built for another rank (rank 1 loads rank 0's experts)
    records["wrong_rank_weights"] = attempt(
        lambda: (spec, problem.rank_weights(0 if ctx.rank == 1 else ctx.rank), {}))
    # a statically scaled format without calibration, on one rank only
    calibrated = problem.rank_weights(ctx.rank, calibrate=ctx.rank != 3)
    records["missing_calibration"] = attempt(lambda: (spec, calibrated, {"fmt": "fp8_tensor"}))
    # the group's world size does not divide the expert count (weights made for 2 ranks of 6 experts)
    spec6 = moe_ep.MoESpec(H, I, 6, K, 24)
    p6 = Problem.build(spec6, 2, 24)
    records["world_does_not_divide"] = attempt(lambda: (spec6, p6.rank_weights(ctx.rank % 2), {}))
    # any local failure during construction, not only moe_ep's own errors, is agreed on
    class Flaky(TorchReferenceBackend):
        @classmethod
        def check_spec(cls, spec_, fmt, world_size):
            if ctx.rank == 0:
                raise RuntimeError("rank 0 cannot read its device properties")
            return []

    moe_ep.register_backend("t_flaky", Flaky, arch="cpu", formats=("bf16",), replace=True)
    try:
        moe_ep.MoELayer(spec, weights, backend="t_flaky").close()
        records["foreign_error"] = {"error": None}
    except Exception as e:  # noqa: BLE001
        records["foreign_error"] = {"error": error_record(e)}
    try:
        moe_ep.ExpertWeights(weights.w13, weights.w2, ctx.rank, ctx.world_size, 6)
        records["weights_world_does_not_divide"] = {"error": None}
    except moe_ep.MoEError as e:
        records["weights_world_does_not_divide"] = {"error": error_record(e)}
    return records


def absent_peer(absent_rank: int = 1):
    """Rank `absent_rank` builds the layer and then dies before its forward; the others must not hang."""
    ctx = init_from_env()
    spec = moe_ep.MoESpec(H, I, E, K, 8)
    problem = Problem.build(spec, ctx.world_size, 8, seed=3)
    layer = moe_ep.MoELayer(spec, problem.rank_weights(ctx.rank))
    if ctx.rank == absent_rank:
        raise SystemExit(3)
    t0 = time.monotonic()
    try:
        layer(*problem.inputs(ctx.rank))
    finally:
        print(f"rank {ctx.rank}: forward left after {time.monotonic() - t0:.1f}s", flush=True)
    return {"unexpected": "forward completed without its peer"}


def bad_inputs_default_checks(bad_rank: int = 2):
    """The default check schedule. A bad input on the layer's first call (agreed) raises on every rank; later, a
    bad input on one rank raises there alone, after that rank took part with zero tokens: its peers return, and
    their outputs match the oracle (the bad rank's experts still served their tokens)."""
    ctx = init_from_env()
    spec = moe_ep.MoESpec(H, I, E, K, 24)
    problem = Problem.build(spec, ctx.world_size, [24, 5, 17, 0][: ctx.world_size], "uniform", seed=9)
    weights = problem.rank_weights(ctx.rank)
    records = {}
    with moe_ep.MoELayer(spec, weights) as layer:
        hidden, idx, w, out = _inputs_for("negative_id", ctx.rank, bad_rank, problem, spec)
        try:
            layer(hidden, idx, w, out=out)
            records["first_call"] = {"error": None}
        except moe_ep.MoEError as e:
            records["first_call"] = {"error": error_record(e)}
        for kind in FORWARD_KINDS:
            hidden, idx, w, out = _inputs_for(kind, ctx.rank, bad_rank, problem, spec)
            t0 = time.monotonic()
            try:
                got = layer(hidden, idx, w, out=out)
                rec = {"error": None}
            except moe_ep.MoEError as e:
                rec = {"error": error_record(e)}
                got = None
            rec["seconds"] = time.monotonic() - t0
            if got is None:  # the oracle of a rank that took part with no tokens: no tokens
                hidden, idx, w = (x[:0] for x in problem.inputs(ctx.rank))
                got = torch.empty(0, H, dtype=torch.bfloat16)
            report = check_multirank(layer, hidden, idx, w, got, weights=weights, raise_on_failure=False)
            rec["oracle_ok"] = report.mine(ctx.rank).ok
            rec["tokens"] = int(hidden.shape[0])
            records[kind] = rec
    return records
