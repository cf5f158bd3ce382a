"""Collective autotune: every rank times the same candidates; the slowest rank decides.

A MoE layer is as slow as its slowest rank (every rank waits at the combine), so
each candidate's score is the MAX over ranks of that rank's median time, and the
argmin of those scores wins on every rank. Candidates that fail to build or run
score +inf on the rank where they failed, which rules them out everywhere.
Each candidate is a `cute.compile` (seconds to minutes), so this is an offline or
warm-up step; it reports progress and an estimate of the time left.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence

from moe_ep.errors import TuningError

__all__ = ["AutotuneResult", "CandidateMismatchError", "NoViableCandidateError", "collective_autotune"]


class CandidateMismatchError(TuningError):
    """Ranks were given different candidate lists; the collective would compare unlike things."""


class NoViableCandidateError(TuningError):
    """Every candidate failed on at least one rank."""


@dataclass
class AutotuneResult:
    winner_index: int
    winner: Any
    scores_us: List[float]  # per candidate, MAX over ranks of the per-rank median
    local_medians_us: List[float]
    errors: List[Optional[str]] = field(default_factory=list)
    seconds: float = 0.0
    # What the candidates shared and the caller may keep (the Hopper tune: the kernel weights, laid out once).
    kernel_weights: Any = None


def _digest(candidates: Sequence[Any]) -> int:
    text = json.dumps([repr(c) for c in candidates])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def _progress(done: int, total: int, started: float, label: str, out) -> None:
    elapsed = time.perf_counter() - started
    left = elapsed / done * (total - done) if done else float("nan")
    width = 24
    bar = "#" * (width * done // total) + "." * (width - width * done // total)
    out.write(f"\r[autotune] [{bar}] {done}/{total} {label}  elapsed {elapsed:.0f}s, ~{left:.0f}s left")
    if done == total:
        out.write("\n")
    out.flush()


def collective_autotune(candidates: Sequence[Any], time_candidate: Callable[[Any], Sequence[float]], *,
                        group=None, device=None, progress: bool = True, out=None) -> AutotuneResult:
    """`time_candidate(c)` builds candidate c and returns its timings in microseconds (any number of reps).

    Without an initialised process group this is a one-rank tune. `device`: where the group's collectives run,
    the caller's RankContext.comm_device (None: CPU, a gloo group; an NCCL-only group needs its GPU).
    """
    import torch
    import torch.distributed as dist

    if not candidates:
        raise TuningError("candidates", "the candidate list is empty")
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(group) if distributed else 0
    out = out or sys.stderr
    dev = device
    if distributed:
        mine = torch.tensor([_digest(candidates), len(candidates)], dtype=torch.int64, device=dev)
        lo, hi = mine.clone(), mine.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
        if not torch.equal(lo, hi):
            raise CandidateMismatchError("knobs", "ranks were given different autotune candidate lists")
    started = time.perf_counter()
    medians: List[float] = []
    errors: List[Optional[str]] = []
    for i, cand in enumerate(candidates):
        try:
            times = [float(t) for t in time_candidate(cand)]
            if not times or not all(math.isfinite(t) and t >= 0 for t in times):
                raise ValueError(f"timings must be finite and non-negative, got {times}")
            medians.append(statistics.median(times))
            errors.append(None)
        except Exception as e:  # a candidate that cannot build or run is out, not fatal
            medians.append(math.inf)
            errors.append(f"{type(e).__name__}: {e}")
        if progress and rank == 0:
            _progress(i + 1, len(candidates), started, f"{medians[-1]:.1f} us", out)
    scores = torch.tensor(medians, dtype=torch.float64, device=dev)
    if distributed:
        dist.all_reduce(scores, op=dist.ReduceOp.MAX, group=group)
    score_list = scores.cpu().tolist()
    best = min(range(len(score_list)), key=lambda j: (score_list[j], j))
    if not math.isfinite(score_list[best]):
        raise NoViableCandidateError(
            "knobs", "every autotune candidate failed on some rank; this rank's errors: "
            + "; ".join(f"#{j}: {e}" for j, e in enumerate(errors) if e),
            reasons={j: e for j, e in enumerate(errors) if e})
    return AutotuneResult(best, candidates[best], score_list, medians, errors, time.perf_counter() - started)
