"""Searching the Hopper kernels' knob space: the candidates, the build check, the timing, and knobs="auto".

Staged, as the sweeps in docs/tuning.md suggest: the structural knobs decide most of the time
(operand order, tile, cluster shape, ping-pong: up to 2x between candidates at one capacity), the scheduling knobs
refine the best few (group_hint, token-back mode, tail-split pairs, flag batching, load balancing: a few percent to
20%), then the exchange knobs refine the best one (dispatch warps, the producer-warp layout, the FC1 store path,
scheduler stages, dispatch dedup, the pull buffer, W4A8's narrow FC2 tail), and the changes that helped are tried
together. Stage 1 enumerates every structural combination the kernel accepts, ranks them by how well the token tile
fits the tokens each expert receives at this capacity (plus the drop's own table rows, the measured winners and any
seeds the caller has), and keeps the best-ranked; each later stage changes one knob at a time around the earlier
stages' winners. Candidates the kernel's constructor rejects, and candidates it would build into the same program as
one already on the list (build_probe's signature), are dropped before anything compiles.

tools/tune drives this over many geometries with parallel compiles (one GPU, candidates timed one at a time);
knobs="auto" on a layer runs `autotune` below: one process per rank, the same short list on every rank, timed
collectively (the slowest rank decides), the winner written to the knob cache.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch

from moe_ep.core.dist import RankContext
from moe_ep.core.graphs import capture_graph
from moe_ep.core.spec import MoESpec
from shim.common.autotune import AutotuneResult, collective_autotune
from shim.common.knob_cache import KnobCache
from shim.sm90.knobs import KNOB_SPACE, KERNEL_CLASS, InvalidKnobsError, Sm90Knobs, heuristic_knobs

__all__ = ["structural_candidates", "scheduling_candidates", "exchange_candidates", "combined_candidates",
           "candidate_knobs", "build_check", "build_probe", "kernel_signature", "time_frontend", "synthetic_inputs",
           "autotune", "MEASURED_WINNERS"]

# Structural winners of the format's sweeps (docs/tuning.md has where and what they ran at), by format: ranked
# first wherever their token tile fits, whatever the table says, because the sweeps found them well ahead of the
# drop's heuristic. (swap_ab, mma_tiler_mnk, cluster_shape_mnk, pingpong)
MEASURED_WINNERS = {
    "fp8_block": (
        (False, (64, 128, 128), (1, 2, 1), True),
        (False, (64, 128, 128), (1, 1, 1), False),
        (False, (64, 256, 128), (2, 1, 1), False),
    ),
}
# The knobs stage 2 varies; stage 1 keeps them at the heuristic's values.
SCHEDULING = ("group_hint", "token_back_mode", "accum_mode", "tail_split_pairs", "flag_batch", "epi_flag_batch")
_CLUSTERS = ((1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1))


def _tokens_per_expert(spec: MoESpec, world_size: int) -> float:
    """Tokens one local expert receives at full capacity under balanced routing: T * K / E_local."""
    return spec.max_tokens_per_rank * spec.top_k / spec.experts_per_rank(world_size)


def _structural(fmt: str) -> Iterable[Sm90Knobs]:
    kernel = KERNEL_CLASS[fmt]
    space = KNOB_SPACE[kernel]
    for tile in space["mma_tiler_mnk"]:
        m, n, _ = tile
        # Swap-AB puts the tokens on N (8..128), the plain order on M (64 / 128 with N 128 / 256).
        for swap in ((True,) if m in (128, 256) and n <= 64 else (False,) if m == 64 else (False, True)):
            for cluster in _CLUSTERS:
                for pingpong in (False, True):
                    yield Sm90Knobs(swap_ab=swap, mma_tiler_mnk=tile, cluster_shape_mnk=cluster, pingpong=pingpong,
                                    kernel=kernel)


def _fit(knobs: Sm90Knobs, per_expert: float) -> float:
    """How badly the token tile (times the token cluster) fits the tokens per expert: 0 is a perfect fit."""
    tile = knobs.token_tile * knobs.token_cluster
    return abs(math.log2(max(tile, 1) / max(per_expert, 1.0)))


def structural_candidates(fmt: str, spec: MoESpec, world_size: int = 1, limit: int = 14,
                          accepts: Optional[Callable[[Sm90Knobs], bool]] = None,
                          seeds: Sequence[Sm90Knobs] = ()) -> List[Sm90Knobs]:
    """Stage 1: the heuristic's own row first, then `seeds` as they are (a shipped entry of this key, another
    format's winner at the same geometry and capacity), the drop's table rows of the neighbouring buckets and the
    measured winners next, then every other structural combination by fit; rejected ones dropped; `limit` kept.
    Apart from the seeds, structural knobs only: the scheduling ones stay at the heuristic's values."""
    from shim.sm90 import kernel_symbols as ks

    c = spec.max_tokens_per_rank
    geometry = dict(hidden=spec.hidden_size, intermediate=spec.intermediate_size)
    base = heuristic_knobs(fmt, c, **geometry)
    per_expert = _tokens_per_expert(spec, world_size)
    sched = {f: getattr(base, f) for f in SCHEDULING}
    sched["tail_split_pairs"] = False

    def structural(k: Sm90Knobs) -> Sm90Knobs:
        return k.replace(**sched)

    kernel = KERNEL_CLASS[fmt]
    first: List[Sm90Knobs] = [base] + [k for k in seeds if k.kernel == kernel]
    b = ks.token_bucket(max(c, 1))
    first += [structural(heuristic_knobs(fmt, x, **geometry)) for x in ks.TOKEN_BUCKETS
              if b // 4 <= x <= b * 4 and x != b]
    first += [structural(Sm90Knobs(*w, kernel=KERNEL_CLASS[fmt])) for w in MEASURED_WINNERS.get(fmt, ())]
    rest = sorted((structural(k) for k in _structural(fmt)), key=lambda k: (_fit(k, per_expert), repr(k)))
    ranked = _keep(first + rest, limit + 64, accepts)
    # Both operand orders stay in the race (their fit is not comparable across orders at the extremes).
    keep = ranked[:limit]
    for swap in (False, True) if len({k.swap_ab for k in ranked}) > 1 else ():
        have = [k for k in keep if k.swap_ab == swap]
        for k in [k for k in ranked[limit:] if k.swap_ab == swap][:max(0, 2 - len(have))]:
            drop = next((i for i in range(len(keep) - 1, 0, -1) if sum(c.swap_ab == keep[i].swap_ab for c in keep) > 2),
                        None)
            if drop is None:  # a list this short has no room for two of each order
                break
            keep[drop] = k
    return keep


def scheduling_candidates(best: Sequence[Sm90Knobs], limit: int = 10,
                          accepts: Optional[Callable[[Sm90Knobs], bool]] = None,
                          signature: Optional[Callable[[Sm90Knobs], object]] = None,
                          exclude: Iterable[object] = ()) -> List[Sm90Knobs]:
    """Stage 2: around each of the stage-1 winners, one scheduling knob changed at a time (load-balance mode where
    the kernel has two, group_hint, token-back mode, tail-split pairs where the cluster allows them, flag
    batching)."""
    out: List[Sm90Knobs] = []
    for k in best:
        # Where the kernel's space has more than one load-balance mode (W4A8: FlashInfer's tactics use both).
        out += [k.replace(load_balance_mode=m) for m in KNOB_SPACE[k.kernel]["load_balance_mode"]
                if m != k.load_balance_mode]
        out += [k.replace(group_hint=g) for g in (None, 66, 132, 264) if g != k.group_hint]
        out += [k.replace(token_back_mode=m) for m in ("epi_warps", "standalone_warps", "reuse_dispatch_warps")
                if m != k.token_back_mode]
        if k.token_cluster == 2 and k.weight_cluster == 1:
            out.append(k.replace(tail_split_pairs=not k.tail_split_pairs))
        out += [k.replace(flag_batch=f) for f in (2, 4) if f != k.flag_batch]
        out += [k.replace(epi_flag_batch=f) for f in (2, 4) if f != k.epi_flag_batch]
    return _keep(out, limit, accepts, exclude=set(best), signature=signature, exclude_signatures=exclude)


# The kernels' own defaults of the exchange knobs (what None means): megamoe_kernel_fp8.py's constructor
# (Sm90MegaMoEFp8Kernel.__init__'s signature; Sm90MegaMoESwapABMxfp4Fp8Kernel sets compact_pull_buffer False and
# mxfp4_fc2_tail_n8 False) and kernel_fp8_glu_fc12.py (num_sched_stages None -> 2).
EXCHANGE_DEFAULTS = {
    "Sm90MegaMoEFp8Kernel": (("active_dispatch_warps", 1), ("fold_producer_warps", True), ("fc1_store_offload", True),
                             ("fc1_early_done_publish", False), ("num_sched_stages", 2), ("dedup_dispatch", False),
                             ("compact_pull_buffer", True)),
    "Sm90MegaMoESwapABMxfp4Fp8Kernel": (("active_dispatch_warps", 1), ("fold_producer_warps", True),
                                        ("fc1_store_offload", True), ("fc1_early_done_publish", False),
                                        ("num_sched_stages", 2), ("dedup_dispatch", False),
                                        ("compact_pull_buffer", False), ("mxfp4_fc2_tail_n8", False)),
}  # (knob, value) pairs, as EXCHANGE_VARIANTS below


# Stage 3's changes, in the order they are tried (a stage limit keeps the first): those that move the most bytes or
# free the most shared memory first. The compact pull buffer gives W4A8 back 3 x H bytes of shared memory per CTA (its
# kernel defaults to one pull slot per dispatch warp, active or not: megamoe_kernel_fp8.py), a pipeline stage at
# H 7168; more dispatch warps pull tokens faster at large T; dedup pulls a token routed to several local experts
# once instead of K times; an unfolded producer warpgroup frees the dispatch warpgroup and runs the FC1 store server;
# the narrow FC2 tail spares W4A8's M256 x N64 tile its empty columns at the last token block. Folding the producers
# into the dispatch warpgroup forces the store offload off and early publication on, so the store paths are reached
# only with the fold off.
EXCHANGE_VARIANTS = (
    (("compact_pull_buffer", True),),
    (("active_dispatch_warps", 2),),
    (("dedup_dispatch", True),),
    (("fold_producer_warps", False),),
    (("mxfp4_fc2_tail_n8", True),),
    (("active_dispatch_warps", 4),),
    (("num_sched_stages", 3),),
    (("fold_producer_warps", False), ("fc1_store_offload", False), ("fc1_early_done_publish", True)),
    (("num_sched_stages", 4),),
    (("num_sched_stages", 1),),
    (("fold_producer_warps", False), ("fc1_store_offload", False)),
    (("compact_pull_buffer", False),),
)  # (knob, value) pairs, not dicts: the drop audit reads a dict naming constructor arguments as a call of them


def exchange_candidates(best: Sequence[Sm90Knobs], limit: int = 12,
                        accepts: Optional[Callable[[Sm90Knobs], bool]] = None,
                        signature: Optional[Callable[[Sm90Knobs], object]] = None,
                        exclude: Iterable[object] = ()) -> List[Sm90Knobs]:
    """Stage 3: around each of the earlier stages' winners, one exchange change at a time (EXCHANGE_VARIANTS, in
    order; those the kernel's KNOB_SPACE lacks or the set already has skipped). Sets the kernel would build into the
    same program as an earlier one (`signature`, and the signatures in `exclude`) are dropped: an offload request under
    folded producers, say."""
    out: List[Sm90Knobs] = []
    for k in best:
        space, default = KNOB_SPACE[k.kernel], dict(EXCHANGE_DEFAULTS.get(k.kernel, ()))
        for pairs in EXCHANGE_VARIANTS:
            change = dict(pairs)
            if not all(name in space for name in change):
                continue
            current = {name: default.get(name) if getattr(k, name) is None else getattr(k, name) for name in change}
            if current != change:
                out.append(k.replace(**change))
    return _keep(out, limit, accepts, exclude=set(best), signature=signature, exclude_signatures=exclude)


def combined_candidates(base: Sm90Knobs, changes: Sequence[Mapping[str, Any]], limit: int = 3,
                        accepts: Optional[Callable[[Sm90Knobs], bool]] = None,
                        signature: Optional[Callable[[Sm90Knobs], object]] = None,
                        exclude: Iterable[object] = ()) -> List[Sm90Knobs]:
    """Stage 4: the best set so far with the changes that did not hurt in stages 2-3 applied together. `changes`:
    what each such candidate changed from the set it was derived from (fastest first). Each of the first three on
    top of `base` (the ones `base` already has skipped), each pair of them, then all three."""
    picked: List[Dict[str, Any]] = []
    for c in changes:
        c = {f: v for f, v in c.items() if getattr(base, f) != v}
        if c and c not in picked:
            picked.append(c)
    picked = picked[:3]
    combos: List[Dict[str, Any]] = [dict(c) for c in picked]
    combos += [{**a, **b} for i, a in enumerate(picked) for b in picked[i + 1:] if not set(a) & set(b)]
    if len(picked) > 2 and not any(set(a) & set(b) for i, a in enumerate(picked) for b in picked[i + 1:]):
        combos.append({f: v for c in picked for f, v in c.items()})
    combos.sort(key=len, reverse=True)  # more changes first: the singles were mostly timed in their own stage
    return _keep([base.replace(**c) for c in combos], limit, accepts, exclude={base},
                 signature=signature, exclude_signatures=exclude)


def _keep(cands: Iterable[Sm90Knobs], limit: int, accepts, exclude=(), signature=None,
          exclude_signatures: Iterable[object] = ()) -> List[Sm90Knobs]:
    out: List[Sm90Knobs] = []
    seen = set(exclude)
    seen_sig = set(exclude_signatures)
    for k in cands:
        if k in seen:
            continue
        seen.add(k)
        try:
            k.validate()
        except InvalidKnobsError:
            continue
        if accepts is not None and not accepts(k):
            continue
        if signature is not None:
            sig = signature(k)
            if sig is None or sig in seen_sig:
                continue
            seen_sig.add(sig)
        out.append(k)
        if len(out) >= limit:
            break
    return out


def build_check(frontend_cls, spec: MoESpec, world_size: int = 1, max_active_clusters: int = 132, row=None):
    """accepts(knobs) -> bool: whether the kernel's constructor takes this knob set for this geometry (no
    buffers, no compile: the constructor is where the kernel states what it refuses). row: the table row
    (default: the frontend class's own)."""
    probe = build_probe(frontend_cls, spec, world_size, max_active_clusters, row)
    return lambda knobs: probe(knobs) is not None


def kernel_signature(knobs: Sm90Knobs, kernel) -> tuple:
    """What the constructed kernel will build, as far as the knobs decide it: two knob sets with one signature are
    one program (the constructor folds several exchange knobs into others: folded producer warps force the FC1
    store offload off and early publication on, ping-pong keeps the store in the epilogue, a store server without
    registers falls back to early publication; kernel_fp8_glu_fc12*.py, megamoe_kernel_fp8.py)."""
    comm = getattr(kernel, "token_comm", None)
    mxfp4 = getattr(kernel, "mxfp4_optimizations", None)
    return (type(kernel).__name__, knobs.correctness_part(), knobs.group_hint, knobs.flag_batch, knobs.epi_flag_batch,
            getattr(kernel, "fold_producer_warps", None), getattr(kernel, "fc1_store_offload", None),
            getattr(kernel, "fc1_early_done_publish", None), getattr(comm, "active_dispatch_warps", None),
            getattr(comm, "compact_pull_buffer", None), getattr(kernel, "dedup_dispatch", None),
            knobs.num_sched_stages or 2, None if mxfp4 is None else mxfp4.identity())


def build_probe(frontend_cls, spec: MoESpec, world_size: int = 1, max_active_clusters: int = 132, row=None):
    """probe(knobs) -> kernel_signature of what the kernel's constructor builds for this knob set and geometry, or
    None when it refuses the set (no buffers, no compile)."""

    def probe(knobs: Sm90Knobs):
        fe = frontend_cls.unbuilt(spec, RankContext.detached(0, world_size), knobs, row=row,
                                  max_active_clusters=max_active_clusters)
        try:
            return kernel_signature(knobs, fe.build_kernel(knobs))
        except InvalidKnobsError:
            return None

    return probe


def candidate_knobs(fmt: str, spec: MoESpec, world_size: int = 1, limit: int = 6,
                    build_check: Optional[Callable[[Sm90Knobs], bool]] = None) -> List[Sm90Knobs]:
    """knobs="auto"'s short list: stage 1's best-ranked `limit` (the heuristic's row first)."""
    return structural_candidates(fmt, spec, world_size, limit=limit, accepts=build_check)


def synthetic_inputs(spec: MoESpec, tokens: int, device, seed: int = 0):
    """A balanced routing at `tokens` (each token's K distinct experts uniformly at random), the same on every
    rank and every run: what candidates are timed on."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, spec.hidden_size, generator=gen).to(torch.bfloat16).to(device)
    idx = torch.rand(max(tokens, 1), spec.num_experts, generator=gen).argsort(dim=1)[:tokens, :spec.top_k].to(device)
    w = torch.softmax(torch.randn(tokens, spec.top_k, generator=gen), dim=-1).to(device)
    out = torch.empty(tokens, spec.hidden_size, dtype=torch.bfloat16, device=device)
    return x, idx, w, out


def time_frontend(fe, inputs, iters: int = 30, quick: int = 5, cutoff_us: float = math.inf) -> Tuple[List[float], bool]:
    """(per-replay microseconds, cut short?) of one forward captured in a CUDA graph and replayed: an eager
    launch's host time (docs/shim.md) is more than the kernel at small T, and would make every candidate look
    alike. After `quick` replays a candidate slower than `cutoff_us` stops there."""
    x, idx, w, out = inputs
    dev = fe.device
    graph = capture_graph(lambda: fe.forward(x, idx, w, out), warmup=2, device=dev)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize(dev)
    times: List[float] = []
    for i in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
        if i + 1 == quick and statistics.median(times) > cutoff_us:
            del graph
            return times, True
    del graph
    return times, False


def autotune(make_frontend: Callable[[Sm90Knobs], object], weights, *, fmt: str, spec: MoESpec, cache_key: str,
             world_size: int = 1, candidates: Optional[Sequence[Sm90Knobs]] = None, cache: Optional[KnobCache] = None,
             group=None, device=None, iters: int = 20, tokens: Optional[int] = None,
             progress: bool = True) -> Tuple[Sm90Knobs, AutotuneResult]:
    """knobs="auto": every rank times the same candidates (default: candidate_knobs) on a balanced synthetic
    routing at `tokens` (default: the capacity); the slowest rank decides; rank 0 writes the winner to the
    knob cache when $MOE_EP_KNOB_CACHE names one. The weights are laid out once, by the first candidate, and
    adopted by the others; the result keeps them (kernel_weights) for the caller's frontend."""
    cands = list(candidates) if candidates is not None else candidate_knobs(fmt, spec, world_size)
    t = tokens or spec.max_tokens_per_rank
    laid_out = []  # the kernel weights, laid out by the first candidate that gets that far: the layout does not
    # depend on the knobs, so the others adopt it (and so can the caller's frontend: result.kernel_weights)

    def time_candidate(knobs: Sm90Knobs):
        fe = make_frontend(knobs)
        try:
            if laid_out:
                fe.adopt_weights(laid_out[0])
            else:
                laid_out.append(fe.load_weights(weights))
            fe.compile()
            return time_frontend(fe, synthetic_inputs(spec, t, fe.device), iters=iters, quick=iters)[0]
        finally:
            fe.close()

    t0 = time.perf_counter()
    result = collective_autotune(cands, time_candidate, group=group, device=device, progress=progress)
    result.kernel_weights = laid_out[0] if laid_out else None
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
