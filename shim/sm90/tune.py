"""knobs="auto" for the Hopper kernels: a candidate list, timed collectively, the winner cached.

Candidates: the drop's heuristic rows for the capacity's bucket and its two neighbours, then perf-knob
variants (group_hint) of the capacity's own row. Every candidate is validated before the list is used, so all
ranks hold the same list of configs and allocate their symmetric buffers in lockstep while timing.
"""

from __future__ import annotations

import time
from typing import Callable, List, Optional, Tuple

import torch

from moe_ep.core.graphs import capture_graph
from moe_ep.core.spec import MoESpec
from shim.common.autotune import AutotuneResult, collective_autotune
from shim.common.knob_cache import KnobCache
from shim.sm90.knobs import InvalidKnobsError, Sm90Knobs, heuristic_knobs

__all__ = ["candidate_knobs", "autotune"]


def candidate_knobs(fmt: str, max_tokens_per_rank: int,
                    build_check: Optional[Callable[[Sm90Knobs], None]] = None) -> List[Sm90Knobs]:
    from shim.sm90 import kernel_symbols as ks

    b = ks.token_bucket(max(max_tokens_per_rank, 1))
    buckets = [x for x in ks.TOKEN_BUCKETS if b // 2 <= x <= b * 2]
    base = heuristic_knobs(fmt, max_tokens_per_rank)
    cands: List[Sm90Knobs] = [base]
    for x in buckets:
        cands.append(heuristic_knobs(fmt, x))
    for gh in (None, 132, 264):
        cands.append(base.replace(group_hint=gh))
    out: List[Sm90Knobs] = []
    seen = set()
    for c in cands:
        if c in seen:  # each distinct config is validated (and build-checked) once
            continue
        seen.add(c)
        try:
            c.validate()
            if build_check is not None:
                build_check(c)
        except InvalidKnobsError:
            continue
        out.append(c)
    return out


def autotune(make_frontend: Callable[[Sm90Knobs], object], weights, *, fmt: str, spec: MoESpec, cache_key: str,
             cache: Optional[KnobCache] = None, group=None, iters: int = 20, tokens: Optional[int] = None,
             progress: bool = True) -> Tuple[Sm90Knobs, AutotuneResult]:
    """Times each candidate on a balanced synthetic routing at `tokens` (default: the capacity)."""
    cands = candidate_knobs(fmt, spec.max_tokens_per_rank)
    t = tokens or spec.max_tokens_per_rank
    gen = torch.Generator().manual_seed(0)  # the same synthetic batch on every rank

    def time_candidate(knobs: Sm90Knobs):
        fe = make_frontend(knobs)
        try:
            fe.load_weights(weights)
            fe.compile()
            dev = fe.device
            x = torch.randn(t, spec.hidden_size, generator=gen).to(torch.bfloat16).to(dev)
            idx = torch.rand(t, spec.num_experts, generator=gen).argsort(dim=1)[:, :spec.top_k].to(dev)
            w = torch.softmax(torch.randn(t, spec.top_k, generator=gen), dim=-1).to(dev)
            out = torch.empty(t, spec.hidden_size, dtype=torch.bfloat16, device=dev)
            # Timed as CUDA-graph replays: an eager launch costs ~200 us of host time on the H200 host, more
            # than the kernel itself at small T, and would make every candidate look alike.
            graph = capture_graph(lambda: fe.forward(x, idx, w, out), warmup=2, device=dev)
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize(dev)
            times = []
            for _ in range(iters):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                graph.replay()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) * 1e3)
            del graph
            return times
        finally:
            fe.close()

    t0 = time.perf_counter()
    result = collective_autotune(cands, time_candidate, group=group, progress=progress)
    winner: Sm90Knobs = result.winner
    if cache is None:
        cache = KnobCache()
    if cache.path:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_rank(group) == 0:
            cache.put(cache_key, winner.to_json(), meta={"score_us": result.scores_us[result.winner_index],
                                                         "candidates": len(cands), "tokens": t,
                                                         "seconds": round(time.perf_counter() - t0, 1)})
    return winner, result
