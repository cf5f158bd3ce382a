"""knobs="auto" for the Hopper FP8 kernel: a candidate list, timed collectively, the winner cached.

Candidates: the drop's heuristic rows for the capacity's bucket and its two neighbours, then perf-knob
variants (group_hint) of the capacity's own row. Every candidate is validated by building the kernel
object (no compile) before the list is used, so all ranks hold the same list of buildable configs and
allocate their symmetric buffers in lockstep while timing.
"""

from __future__ import annotations

import time
from typing import Callable, List, Optional, Tuple

import torch

from shim.common.autotune import AutotuneResult, collective_autotune
from shim.common.knob_cache import KnobCache
from shim.sm90.knobs import HopperKnobs as Fp8Knobs, InvalidKnobsError, heuristic_knobs

__all__ = ["candidate_knobs", "autotune"]


def candidate_knobs(fmt: str, capacity: int, build_check: Optional[Callable[[Fp8Knobs], None]] = None) -> List[Fp8Knobs]:
    from shim.sm90 import kernel_symbols as ks

    b = ks.token_bucket(max(capacity, 1))
    buckets = [x for x in ks.TOKEN_BUCKETS if b // 2 <= x <= b * 2]
    base = heuristic_knobs(fmt, capacity)
    cands: List[Fp8Knobs] = [base]
    for x in buckets:
        cands.append(heuristic_knobs(fmt, x))
    for gh in (None, 132, 264):
        cands.append(base.replace(group_hint=gh))
    out: List[Fp8Knobs] = []
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


def autotune(make_frontend: Callable[[Fp8Knobs], object], w13: torch.Tensor, w2: torch.Tensor, *, fmt: str,
             capacity: int, experts_total: int, expert_offset: int, top_k: int, cache_key: str,
             cache: Optional[KnobCache] = None, group=None, iters: int = 20, tokens: Optional[int] = None,
             progress: bool = True) -> Tuple[Fp8Knobs, AutotuneResult]:
    """Times each candidate on a balanced synthetic routing at `tokens` (default: the capacity)."""
    cands = candidate_knobs(fmt, capacity)
    t = tokens or capacity
    gen = torch.Generator().manual_seed(0)  # the same synthetic batch on every rank

    def time_candidate(knobs: Fp8Knobs):
        fe = make_frontend(knobs)
        try:
            fe.load_weights(w13, w2)
            fe.compile()
            dev = fe.device
            x = torch.randn(t, fe.hidden, generator=gen).to(torch.bfloat16).to(dev)
            idx = torch.rand(t, experts_total, generator=gen).argsort(dim=1)[:, :top_k].to(dev)
            w = torch.softmax(torch.randn(t, top_k, generator=gen), dim=-1).to(dev)
            out = torch.empty(t, fe.hidden, dtype=torch.bfloat16, device=dev)
            # Timed as CUDA-graph replays: an eager launch costs ~200 us of host time on the H200 host, more
            # than the kernel itself at small T, and would make every candidate look alike.
            s = torch.cuda.Stream(dev)
            s.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(s):
                for _ in range(2):
                    fe.forward(x, idx, w, out)
            torch.cuda.current_stream(dev).wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fe.forward(x, idx, w, out)
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
    winner: Fp8Knobs = result.winner
    if cache is None:
        cache = KnobCache()
    if cache.path:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_rank(group) == 0:
            cache.put(cache_key, winner.to_json(), meta={"score_us": result.scores_us[result.winner_index],
                                                         "candidates": len(cands), "tokens": t,
                                                         "seconds": round(time.perf_counter() - t0, 1)})
    return winner, result
