"""The per-rank scenario: build a layer, run one forward into a NaN-poisoned buffer, check it against the
oracle, optionally time it. Rank-side entry points for tools/launch (they return JSON-able dicts)."""

from __future__ import annotations

import statistics
import time
import traceback
from typing import Any, Dict, List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from moe_ep.core import registry
from moe_ep.core.dist import RankContext, init_from_env
from moe_ep.core.spec import MoESpec
from moe_ep.errors import MoEError
from moe_ep.formats import format_info
from moe_ep.layer import MoELayer
from moe_ep.reference.oracle import check_multirank
from moe_ep.testing.problems import Problem

__all__ = ["run_scenario", "run_cases", "error_record"]


def error_record(e: BaseException) -> Dict[str, Any]:
    return {"type": type(e).__name__, "argument": getattr(e, "argument", None), "message": str(e),
            "ranks": list(getattr(e, "ranks", ()) or ()),
            "bases": [c.__name__ for c in type(e).__mro__]}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_scenario(ctx: Optional[RankContext] = None, *, hidden_size: int, intermediate_size: int,
                 num_experts: int, top_k: int, tokens: Union[int, Sequence[int]], capacity: Optional[int] = None,
                 routing: str = "balanced", seed: int = 0, hot_rank: int = 0, backend: Optional[str] = None,
                 fmt: Optional[str] = None, gate_up_clamp: Optional[float] = None, iters: int = 0,
                 warmup: int = 1, backend_options: Optional[dict] = None, check: bool = True,
                 raise_on_failure: bool = True) -> Dict[str, Any]:
    """One layer, one checked forward (and `iters` timed ones). Collective: every rank calls it alike."""
    ctx = ctx or init_from_env()
    rank, world = ctx.rank, ctx.world_size
    problem_tokens = tokens if not isinstance(tokens, int) else [tokens] * world
    cap = capacity or max(max(problem_tokens), 1)
    spec = MoESpec(hidden_size, intermediate_size, num_experts, top_k, cap, gate_up_clamp)
    problem = Problem.build(spec, world, problem_tokens, routing, seed, hot_rank)
    if fmt is None:
        # Resolve the format now: statically scaled formats (a backend's default may be one, e.g. nvfp4)
        # need the activation calibration an offline pass would record, before the weights are built.
        entry = (registry.select_backend(registry.detect_arch(ctx.device)) if backend in (None, "auto")
                 else registry.get_entry(backend))
        fmt = entry.default_format
    calibrate = format_info(fmt).static_activation_scales
    weights = problem.rank_weights(rank, calibrate=calibrate)
    t0 = time.perf_counter()
    layer = MoELayer(spec, weights, backend=backend, fmt=fmt, group=ctx.group, device=ctx.device,
                     **(backend_options or {}))
    build_s = time.perf_counter() - t0
    try:
        hidden, idx, w = (x.to(ctx.device) for x in problem.inputs(rank))
        out = torch.full((hidden.shape[0], hidden_size), float("nan"), dtype=torch.bfloat16, device=ctx.device)
        layer(hidden, idx, w, out=out)
        result: Dict[str, Any] = {
            "rank": rank, "world_size": world, "tokens": int(hidden.shape[0]), "backend": layer.backend_name,
            "fmt": layer.fmt, "device": str(ctx.device), "hidden_size": hidden_size,
            "intermediate_size": intermediate_size, "num_experts": num_experts, "top_k": top_k,
            "routing": routing, "build_s": build_s,
        }
        if check:
            report = check_multirank(layer, hidden, idx, w, out, weights=weights, raise_on_failure=raise_on_failure)
            mine = report.mine(rank)
            result.update(ok=report.ok, max_abs_err=mine.max_abs_err, max_row_rel_err=mine.max_row_rel_err,
                          rel_l2_err=mine.rel_l2_err, weight_rel_err=mine.weight_rel_err,
                          tolerance=mine.tolerance, problems=mine.problems, failing=report.failing)
        if iters:
            for _ in range(warmup):
                layer(hidden, idx, w, out=out)
            times = []
            for _ in range(iters):
                dist.barrier(group=ctx.group)
                _sync(ctx.device)
                s = time.perf_counter()
                layer(hidden, idx, w, out=out)
                _sync(ctx.device)
                times.append(time.perf_counter() - s)
            result["time_ms"] = 1e3 * statistics.median(times)
        return result
    finally:
        layer.close()


def run_cases(cases: List[Dict[str, Any]], ctx: Optional[RankContext] = None) -> List[Dict[str, Any]]:
    """Run several scenarios in one set of rank processes (process start-up dominates small cases). A case
    whose layer raises a moe_ep error records it and the next case runs: the errors are collective, so every
    rank has left the failed case at the same point."""
    ctx = ctx or init_from_env()
    results = []
    for case in cases:
        case = dict(case)
        name = case.pop("name")
        try:
            r = run_scenario(ctx, **case)
            r["name"] = name
        except MoEError as e:
            r = {"name": name, "rank": ctx.rank, "error": error_record(e), "traceback": traceback.format_exc()}
        results.append(r)
    return results
