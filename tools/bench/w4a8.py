"""The Hopper 8-bit-activation formats on one GPU in one run: correctness of W4A8 MXFP4, W4A8 NVFP4 and per-tensor
FP8, their time beside blockwise FP8 against #35's targets, and an ablation that says where W4A8's time goes; a
table, CSV/JSON and a plot.

    python -m tools.bench.w4a8 --out DIR [--workers 6] [--budget-s 360] [--skip-checks] [--skip-ablation]
                                                                            (GPU host, no Bazel)
    python -m tools.bench.w4a8 --dry-run                                     (any host: the plan, every kernel
                                                                               constructor run, nothing compiled)

1. Correctness, each new format at the small geometry (H512 I256, 8 experts, top-4) and DeepSeek-V3's (H7168
   I2048, 32 experts, top-8), capacity 1024, T in 1, 8, 128, 1000: fresh random inputs and routing, a NaN-poisoned
   output, checked against the torch oracle over the weights read back from the kernel's tensors and the
   activations it staged (moe_ep.reference.oracle): per-token relative L2 <= max(0.03, 0.75 / sqrt(I)) (twice for per-tensor FP8) -- every
   one of these formats requantizes the FC2 input to e4m3 as blockwise FP8 does, and the oracle repeats the rest
   exactly (tests/shim/sm90/multirank_gpu_test.py says why) -- no NaN; and, apart, the error against an
   unquantized fp64 MoE (the format's own error). W4A8 NVFP4 has no kernel in the pinned tree: its row gives the
   reason and the format's own error through the torch reference.
2. Time, DeepSeek-V3 geometry, W4A8 MXFP4 / W4A8 NVFP4 (unavailable) / FP8 blockwise / FP8 per-tensor at T in 1, 8,
   32, 128, 512, 2048, 4096: capacity = T rounded up to a power of two (>= 8), knobs as a layer resolves them (the
   shipped H200 table, else the knob model, else the heuristic), one forward captured in a CUDA graph by the
   caller and replayed, median over 7 batches of 20 replays (per-replay mean of a batch). The ratios against #35's
   targets, met or missed.
3. Ablation (no extra compile for (a)): (a) W4A8 and blockwise FP8 at every T also on two other routings of the same
   T tokens: every slot -1 ("empty": launch, staging, barriers, the scheduler's walk, the top-k reduce, no expert
   work) and every token to the same K experts ("hot": K experts' weights instead of the ~all a balanced routing
   touches), so (balanced - hot) / (experts touched - K) is the time one more expert's weights cost, and its bytes over
   that time the rate the mainloop streams them at; (b) at capacities 8 and 2048, W4A8 on its resolved tile with K 128
   and blockwise FP8 swap-AB on that same tile: W4A8 K128 / FP8 swap-AB is what the in-register dequant costs at one
   schedule, FP8 swap-AB / FP8 as resolved what W4A8's swap-AB-only operand order costs; (c) the device-to-device copy
   rate of this GPU, the bandwidth floors' yardstick.

Compiles dominate (10-60 s each): a pool of worker processes compiles off the GPU and takes a lock to load, run
and time one kernel at a time on the otherwise idle GPU. Results stream to DIR/results.jsonl as they come; after
--budget-s no new job starts, and the report is written from what finished (a row says what is missing).
Writes results.jsonl, summary.json, checks.csv, timing.csv, report.md and timing.png into --out.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any, Dict, List, Optional

__all__ = ["main", "plan", "capacity_for", "targets_met"]

NEW_FORMATS = ("w4a8_mxfp4", "w4a8_nvfp4", "fp8_tensor")
TIMED_FORMATS = ("w4a8_mxfp4", "w4a8_nvfp4", "fp8_block", "fp8_tensor")
CHECK_GEOMS = {
    "small": dict(hidden=512, intermediate=256, experts=8, top_k=4),
    "dsv3": dict(hidden=7168, intermediate=2048, experts=32, top_k=8),
}
CHECK_TOKENS = (1, 8, 128, 1000)
CHECK_CAPACITY = 1024
TIME_GEOM = "dsv3"
TIME_TOKENS = (1, 8, 32, 128, 512, 2048, 4096)
BATCHES, REPLAYS = 7, 20
# #35's targets: W4A8 / FP8-blockwise time at most this at T (T >= 512: 1.00); per-tensor / blockwise <= 1.00 at
# every T and <= 0.85 at T >= 2048.
W4A8_TARGET = {1: 0.70, 8: 0.60, 32: 0.60, 128: 0.75}
W4A8_TARGET_LARGE = 1.00
TENSOR_TARGET, TENSOR_TARGET_LARGE, TENSOR_FROM = 1.00, 0.85, 2048
# The ablation: the routings each W4A8 / blockwise time job also runs, and the capacities of the same-tile pairs.
ABLATION_FORMATS = ("w4a8_mxfp4", "fp8_block")
ROUTINGS = ("balanced", "empty", "hot")
SAME_TILE_CAPACITIES = (8, 2048)


def capacity_for(t: int) -> int:
    """What an engine sizes a workspace for T tokens: T rounded up to a power of two, at least 8."""
    return max(8, 1 << max(0, t - 1).bit_length())


def plan(check: bool = True, timing: bool = True, ablation: bool = True) -> List[Dict[str, Any]]:
    """Every job, in the order they are submitted: checks first, then the copy rate, timings by capacity, formats
    interleaved (each capacity's ratios fill in together), then the same-tile pairs."""
    jobs: List[Dict[str, Any]] = []
    if check:
        for geom in CHECK_GEOMS:
            for fmt in NEW_FORMATS:
                jobs.append(dict(kind="check", fmt=fmt, geom=geom, capacity=CHECK_CAPACITY, tokens=list(CHECK_TOKENS)))
    if timing:
        if ablation:
            jobs.append(dict(kind="copy", fmt="-", geom="-", capacity=0, tokens=[]))
        by_cap: Dict[int, List[int]] = {}
        for t in TIME_TOKENS:
            by_cap.setdefault(capacity_for(t), []).append(t)
        for cap, tokens in sorted(by_cap.items()):
            for fmt in TIMED_FORMATS:
                routings = list(ROUTINGS) if ablation and fmt in ABLATION_FORMATS else ["balanced"]
                jobs.append(dict(kind="time", fmt=fmt, geom=TIME_GEOM, capacity=cap, tokens=tokens,
                                 routings=routings))
        if ablation:
            for cap in SAME_TILE_CAPACITIES:
                tokens = by_cap.get(cap, [cap])
                for fmt, variant in (("w4a8_mxfp4", "w4a8_k128"), ("fp8_block", "fp8_swap_same_tile")):
                    jobs.append(dict(kind="time", fmt=fmt, geom=TIME_GEOM, capacity=cap, tokens=tokens,
                                     routings=["balanced"], variant=variant))
    for n, j in enumerate(jobs):
        j["id"] = n
    return jobs


def targets_met(t: int, w4a8_ratio: Optional[float], tensor_ratio: Optional[float]) -> Dict[str, Optional[bool]]:
    """#35's verdicts at T (None where there is no number or no target)."""
    bound = W4A8_TARGET.get(t, W4A8_TARGET_LARGE if t >= 512 else None)
    tensor = TENSOR_TARGET_LARGE if t >= TENSOR_FROM else TENSOR_TARGET
    return {"w4a8_target": bound,
            "w4a8_ok": None if bound is None or w4a8_ratio is None else w4a8_ratio <= bound,
            "tensor_target": tensor,
            "tensor_ok": None if tensor_ratio is None else tensor_ratio <= tensor}


# -- worker side ---------------------------------------------------------------------------------------------
_W: Dict[str, Any] = {}


def _init_worker(lock) -> None:
    import torch

    torch.cuda.set_device(0)
    _W.update(lock=lock, bf16={}, kernel_weights={})


def _spec(geom: str, capacity: int):
    import moe_ep

    g = CHECK_GEOMS[geom]
    return moe_ep.MoESpec(hidden_size=g["hidden"], intermediate_size=g["intermediate"], num_experts=g["experts"],
                          top_k=g["top_k"], max_tokens_per_rank=capacity)


def _expert_weights(geom: str, device):
    """The same bf16 weights in every worker and for every format (seeded), calibrated for per-tensor FP8."""
    import torch

    import moe_ep
    from moe_ep.testing.calibration import synthetic_calibration

    if geom not in _W["bf16"]:
        g = CHECK_GEOMS[geom]
        gen = torch.Generator(device=device).manual_seed(22)
        h, i, e = g["hidden"], g["intermediate"], g["experts"]
        w13 = torch.randn(e, 2 * i, h, generator=gen, device=device, dtype=torch.bfloat16).mul_(h ** -0.5)
        w2 = torch.randn(e, h, i, generator=gen, device=device, dtype=torch.bfloat16).mul_(i ** -0.5)
        _W["bf16"][geom] = moe_ep.ExpertWeights(w13, w2, rank=0, world_size=1, num_experts=e,
                                                **synthetic_calibration(w13, seed=5))
    return _W["bf16"][geom]


NO_KERNEL = ("no Hopper kernel in the pinned tree: FlashInfer 0.7.4 ships Sm90MegaMoESwapABNvfp4Fp8Kernel in "
             "kernel_src/sm90/pull_style_cutedsl_megakernel/shim/nvfp4_kernels.py, outside the pinned src/ tree")


def _row_name(fmt: str) -> Optional[str]:
    """The sm90 kernel backend registered for `fmt`, or None when no Hopper kernel serves it."""
    from moe_ep.core.registry import list_backends

    names = [n for n, b in list_backends().items() if b.arch == "sm90" and fmt in b.formats]
    return names[0] if names else None


def _backend_cls(fmt: str):
    from moe_ep.core.registry import resolve_backend

    return resolve_backend(_row_name(fmt))


def _unavailable(fmt: str) -> Optional[str]:
    """Why no Hopper kernel runs `fmt` here (none in the table, or its module missing from the tree), or None."""
    from moe_ep.core.registry import list_backends

    name = _row_name(fmt)
    if name is None:
        return NO_KERNEL
    info = list_backends()[name]
    return None if info.available else info.reason


def _variant_knobs(variant: str, geom: str, capacity: int, ctx):
    """The ablation's knob sets (module docstring, 3b), from the W4A8 layer's own resolved set at this capacity:
    "w4a8_k128" that set on a K-128 tile; "fp8_swap_same_tile" blockwise FP8 swap-AB on that tile (K 128, token N at
    most 64: FP8's swap-AB tiles)."""
    from shim.sm90.knobs import KERNEL_CLASS, Sm90Knobs

    w4a8 = _backend_cls("w4a8_mxfp4")(_spec(geom, capacity), ctx, fmt="w4a8_mxfp4")
    k, _ = w4a8.resolve_knobs(None)
    m, n, _ = k.mma_tiler_mnk
    if variant == "w4a8_k128":
        return k.replace(mma_tiler_mnk=(m, n, 128), mxfp4_fc2_tail_n8=None)
    if variant == "fp8_swap_same_tile":
        from shim.sm90.knobs import EXCHANGE_KNOBS, KNOB_SPACE
        from shim.sm90.tune import EXCHANGE_DEFAULTS, build_check

        plain = Sm90Knobs(swap_ab=True, mma_tiler_mnk=(m, min(n, 64), 128), cluster_shape_mnk=k.cluster_shape_mnk,
                          pingpong=k.pingpong, group_hint=k.group_hint, kernel=KERNEL_CLASS["fp8_block"])
        # W4A8's schedule too, where FP8's kernel takes it: the same scheduling and exchange knobs, W4A8's defaults
        # spelled out (the two kernels' defaults differ: the pull buffer).
        w4a8_default = dict(EXCHANGE_DEFAULTS[k.kernel])
        exchange = {f: getattr(k, f) if getattr(k, f) is not None else w4a8_default.get(f)
                    for f in EXCHANGE_KNOBS if f in KNOB_SPACE[plain.kernel]}
        same = plain.replace(token_back_mode=k.token_back_mode, load_balance_mode=k.load_balance_mode,
                             flag_batch=k.flag_batch, epi_flag_batch=k.epi_flag_batch, **exchange)
        spec = _spec(geom, capacity)
        accepts = build_check(_backend_cls("fp8_block").frontend_class(), spec)
        return same if accepts(same) else plain
    raise ValueError(f"unknown ablation variant {variant!r}")


def _frontend(fmt: str, geom: str, capacity: int, device, compile_only: bool = False, variant: Optional[str] = None):
    """(frontend, knobs, where they came from) as a layer builds them, its weights laid out once per worker; with
    `variant`, the ablation's knob set instead (source "ablation:<variant>")."""
    import torch

    from moe_ep.core.dist import RankContext

    spec = _spec(geom, capacity)
    cls = _backend_cls(fmt)
    ctx = RankContext.detached(device=torch.device("cpu") if compile_only else device)
    explicit = None if variant is None else _variant_knobs(variant, geom, capacity, ctx)
    backend = cls(spec, ctx, fmt=fmt, knobs=explicit)
    weights = None if compile_only else _expert_weights(geom, device)
    knobs, source = backend.resolve_knobs(weights)
    if variant is not None:
        source = f"ablation:{variant}"
    if compile_only:
        fe = object.__new__(cls.frontend_class())  # the kernel's constructor only (tune.build_check's way)
        fe.spec, fe.ctx, fe.knobs, fe.compile_only, fe.max_active_clusters = spec, ctx, knobs, True, 132
        fe.kernel = fe.build_kernel(knobs)
        return fe, knobs, source
    fe = backend.make_frontend(knobs)
    key = (geom, fmt)
    if key not in _W["kernel_weights"]:
        with _W["lock"]:  # one worker at a time holds the quantizer's temporaries
            _W["kernel_weights"][key] = fe.weights_layout.prepare(weights, fe.device)
            torch.cuda.empty_cache()
    fe.adopt_weights(_W["kernel_weights"][key])
    return fe, knobs, source


@contextlib.contextmanager
def _compiled(fmt: str, geom: str, capacity: int, device, variant: Optional[str] = None):
    """The job's frontend, built (timed; outside the lock, so workers' compiles overlap) and compiled on the device
    under the lock, which the body keeps; closed afterwards. Yields (frontend, knobs, knob source, compile s)."""
    fe, knobs, source = _frontend(fmt, geom, capacity, device, variant=variant)
    try:
        t0 = time.perf_counter()
        fe.build_compiled()
        compile_s = round(time.perf_counter() - t0, 1)
        with _W["lock"]:
            fe.compile()
            yield fe, knobs, source, compile_s
    finally:
        fe.close()


def _routing(t: int, e: int, k: int, gen, device):
    import torch

    idx = torch.rand(max(t, 1), e, generator=gen).argsort(dim=1)[:t, :k]
    w = torch.softmax(torch.randn(t, k, generator=gen), dim=-1)
    return idx.to(device), w.to(device)


def _fp64_moe(weights, x, idx, w):
    """Unquantized MoE in fp64 from the bf16 weights: the yardstick of the format's own error."""
    import torch

    out = torch.zeros(x.shape[0], weights.w2.shape[1], dtype=torch.float64, device=x.device)
    i = weights.w2.shape[2]
    for e in torch.unique(idx).tolist():
        tok, slot = (idx == e).nonzero(as_tuple=True)
        h = x[tok].double() @ weights.w13[e].double().t()
        y = torch.nn.functional.silu(h[:, :i]) * h[:, i:] * w[tok, slot].double().unsqueeze(1)
        out.index_add_(0, tok, y @ weights.w2[e].double().t())
    return out


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def _check(job: Dict[str, Any], device) -> List[Dict[str, Any]]:
    import torch

    from moe_ep.formats import quantize_weights
    from moe_ep.reference.oracle import compare, kernel_row_tolerance, oracle_forward

    geom, fmt = job["geom"], job["fmt"]
    weights = _expert_weights(geom, device)
    spec = _spec(geom, job["capacity"])
    tol = kernel_row_tolerance(fmt, spec.intermediate_size)
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))  # fresh inputs every run
    reason = _unavailable(fmt)
    rows = []
    if reason is not None:  # no kernel: the format's own error through the torch reference, and why
        qw = quantize_weights(fmt, weights.w13, weights.w2)
        for t in job["tokens"]:
            x = torch.randn(t, spec.hidden_size, generator=gen).to(torch.bfloat16).to(device)
            idx, w = _routing(t, spec.num_experts, spec.top_k, gen, device)
            ref = oracle_forward(qw, x, idx, w)
            rows.append(dict(T=t, ok=None, kernel=False, reason=reason,
                             rel_l2_vs_fp64=_rel(ref, _fp64_moe(weights, x, idx, w))))
        return rows
    with _compiled(fmt, geom, job["capacity"], device) as (fe, knobs, source, compile_s):
        qw = fe.weights.canonical()  # read back from the kernel's tensors
        w13, w2 = qw.dequantize()
        weight_err = max(_rel(w13, weights.w13), _rel(w2, weights.w2))
        for t in job["tokens"]:
            x = torch.randn(t, spec.hidden_size, generator=gen).to(torch.bfloat16).to(device)
            idx, w = _routing(t, spec.num_experts, spec.top_k, gen, device)
            out = torch.full((t, spec.hidden_size), float("nan"), dtype=torch.bfloat16, device=device)
            fe.forward(x, idx, w, out)
            torch.cuda.synchronize(device)
            ref = oracle_forward(qw, fe.staged_activation(t), idx, w, gate_up_clamp=spec.gate_up_clamp)
            ok, problems, row, max_abs, rel_l2, nans = compare(out, ref, fmt, tol)
            rows.append(dict(T=t, ok=bool(ok and nans == 0), kernel=True, tol=tol, max_row_rel=row,
                             rel_l2=rel_l2, max_abs=max_abs, nan=nans, problems=problems,
                             rel_l2_vs_fp64=_rel(out, _fp64_moe(weights, x, idx, w)),
                             weight_rel_err=weight_err, knobs=knobs.to_json(), knob_source=source,
                             compile_s=compile_s))
    return rows


def _routed(kind: str, spec, t: int, device):
    """The inputs of one timing: the tuner's balanced routing at T (seed T), or the same tokens with every slot -1
    ("empty") or all sent to experts 0..K-1 ("hot")."""
    import torch

    from shim.sm90.tune import synthetic_inputs

    x, idx, w, out = synthetic_inputs(spec, t, device, seed=t)
    if kind == "empty":
        idx = torch.full_like(idx, -1)
    elif kind == "hot":
        idx = idx.new_tensor(list(range(spec.top_k))).expand(t, spec.top_k).contiguous()
    elif kind != "balanced":
        raise ValueError(f"unknown routing {kind!r}")
    return x, idx, w, out


def _replay_us(graph, device) -> List[float]:
    """Per-replay microseconds of BATCHES batches of REPLAYS back-to-back replays, after 5 warm-up replays."""
    import torch

    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize(device)
    per = []
    for _ in range(BATCHES):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(REPLAYS):
            graph.replay()
        b.record()
        b.synchronize()
        per.append(a.elapsed_time(b) * 1e3 / REPLAYS)
    return per


def _time(job: Dict[str, Any], device) -> List[Dict[str, Any]]:
    from moe_ep.core.graphs import capture_graph

    fmt = job["fmt"]
    reason = _unavailable(fmt)
    if reason is not None:
        return [dict(T=t, us=None, reason=reason) for t in job["tokens"]]
    rows = []
    variant = job.get("variant")
    with _compiled(fmt, job["geom"], job["capacity"], device, variant) as (fe, knobs, source, compile_s):
        for t in job["tokens"]:
            row = dict(T=t, knobs=knobs.to_json(), knob_source=source, compile_s=compile_s,
                       staging=getattr(fe, "staging", "torch"), variant=variant)
            for routing in job.get("routings", ["balanced"]):
                x, idx, w, out = _routed(routing, fe.spec, t, device)
                graph = capture_graph(lambda: fe.forward(x, idx, w, out), warmup=2, device=device)
                per = _replay_us(graph, device)
                del graph
                if routing == "balanced":
                    row.update(us=statistics.median(per), best_us=min(per), batches_us=per,
                               experts=int(idx[idx >= 0].unique().numel()))
                else:
                    row[f"{routing}_us"] = statistics.median(per)
            rows.append(row)
    return rows


def _copy(device) -> List[Dict[str, Any]]:
    """The device-to-device copy rate (bytes read + written per second) of 1 GiB, median of 10, as the bandwidth
    floors use it."""
    import torch

    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    with _W["lock"]:
        for _ in range(3):
            dst.copy_(src)
        torch.cuda.synchronize(device)
        per = []
        for _ in range(10):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            b.synchronize()
            per.append(a.elapsed_time(b) / 1e3)
    return [dict(T=0, copy_gbps=2 * n / statistics.median(per) / 1e9)]


def run_job(job: Dict[str, Any]) -> Dict[str, Any]:
    import torch

    t0 = time.perf_counter()
    out = dict(job, ok=False)
    try:
        device = torch.device("cuda", 0)
        if job["kind"] == "copy":
            out["rows"] = _copy(device)
        else:
            out["rows"] = (_check if job["kind"] == "check" else _time)(job, device)
        out["ok"] = True
    except Exception as e:  # noqa: BLE001 - a job that cannot build or run is reported, with why
        out.update(error=f"{type(e).__name__}: {str(e)[:600]}", traceback=traceback.format_exc()[-2000:])
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


# -- coordinator side ----------------------------------------------------------------------------------------
def expert_bytes(fmt: str, geom: str = TIME_GEOM) -> int:
    """Weight bytes of one expert (docs/performance.md): 3 x H x I values; W4A8 MXFP4 half a byte each plus one e8m0
    scale per 32 values, blockwise FP8 a byte each plus one fp32 scale per 128 x 128."""
    g = CHECK_GEOMS[geom]
    n = 3 * g["hidden"] * g["intermediate"]
    return {"w4a8_mxfp4": n // 2 + n // 32, "fp8_block": n + n // (128 * 128) * 4}[fmt]


def _flatten(results: List[Dict[str, Any]]):
    """(checks, times, same-tile rows, copy rate rows): one record per (job, T)."""
    checks, times, same_tile, copy = [], [], [], []
    for r in results:
        for row in r.get("rows") or [dict(T=t, error=r.get("error", "not run")) for t in r["tokens"]]:
            rec = dict(fmt=r["fmt"], geom=r["geom"], capacity=r["capacity"], **row)
            if r["kind"] == "check":
                checks.append(rec)
            elif r["kind"] == "copy":
                copy.append(rec)
            elif r.get("variant"):
                same_tile.append(dict(rec, variant=r["variant"]))
            else:
                times.append(rec)
    return checks, times, same_tile, copy


def _timing_table(times: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    table = []
    us = {(r["fmt"], r["T"]): r.get("us") for r in times}
    for t in TIME_TOKENS:
        row: Dict[str, Any] = {"T": t, "capacity": capacity_for(t)}
        for fmt in TIMED_FORMATS:
            row[fmt] = us.get((fmt, t))
        blk = row["fp8_block"]
        row["w4a8_mxfp4/fp8_block"] = row["w4a8_mxfp4"] / blk if row["w4a8_mxfp4"] and blk else None
        row["fp8_tensor/fp8_block"] = row["fp8_tensor"] / blk if row["fp8_tensor"] and blk else None
        row.update(targets_met(t, row["w4a8_mxfp4/fp8_block"], row["fp8_tensor/fp8_block"]))
        table.append(row)
    return table


def ablation_table(times: List[Dict[str, Any]], copy_gbps: Optional[float], top_k: int = 8) -> List[Dict[str, Any]]:
    """Per T and format (W4A8, blockwise FP8): the balanced / empty / hot times, the experts the balanced routing
    touches, what one more expert's weights cost (balanced - hot) / (experts - K), the rate that streams them at, the
    fixed share (empty / balanced) and the bandwidth floor (experts x bytes over the copy rate)."""
    out = []
    for r in times:
        if r["fmt"] not in ABLATION_FORMATS or r.get("us") is None:
            continue
        b = expert_bytes(r["fmt"], r["geom"])
        row = dict(T=r["T"], fmt=r["fmt"], us=r["us"], empty_us=r.get("empty_us"), hot_us=r.get("hot_us"),
                   experts=r.get("experts"), per_expert_us=None, stream_gbps=None, fixed_share=None, floor_us=None)
        if row["hot_us"] is not None and row["experts"] and row["experts"] > top_k:
            per = (r["us"] - row["hot_us"]) / (row["experts"] - top_k)
            row["per_expert_us"] = per
            row["stream_gbps"] = b / per / 1e3 if per > 0 else None
        if row["empty_us"] is not None:
            row["fixed_share"] = row["empty_us"] / r["us"]
        if copy_gbps and row["experts"]:
            row["floor_us"] = row["experts"] * b / copy_gbps / 1e3
        out.append(row)
    return sorted(out, key=lambda x: (x["T"], x["fmt"]))


def same_tile_table(times: List[Dict[str, Any]], same_tile: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per capacity of the pairs and T: W4A8 and blockwise FP8 as resolved, W4A8 on K 128, blockwise FP8 swap-AB on
    W4A8's tile; dequant = W4A8 K128 / FP8 swap-AB (one schedule, the in-register widening and half the bytes),
    operand order = FP8 swap-AB / FP8 as resolved."""
    us = {(r["fmt"], r["T"]): r for r in times}
    var = {(r["variant"], r["T"]): r for r in same_tile}
    out = []
    for cap in SAME_TILE_CAPACITIES:
        for t in [t for t in TIME_TOKENS if capacity_for(t) == cap] or [cap]:
            w, f = us.get(("w4a8_mxfp4", t), {}), us.get(("fp8_block", t), {})
            wk, fs = var.get(("w4a8_k128", t), {}), var.get(("fp8_swap_same_tile", t), {})
            row = dict(capacity=cap, T=t, w4a8_us=w.get("us"), w4a8_tile=w.get("knobs", {}).get("mma_tiler_mnk"),
                       w4a8_k128_us=wk.get("us"), fp8_swap_us=fs.get("us"),
                       fp8_swap_tile=fs.get("knobs", {}).get("mma_tiler_mnk"), fp8_us=f.get("us"),
                       fp8_tile=f.get("knobs", {}).get("mma_tiler_mnk"),
                       fp8_swap=f.get("knobs", {}).get("swap_ab"))
            row["dequant"] = row["w4a8_k128_us"] / row["fp8_swap_us"] if row["w4a8_k128_us"] and row["fp8_swap_us"] \
                else None
            row["order"] = row["fp8_swap_us"] / row["fp8_us"] if row["fp8_swap_us"] and row["fp8_us"] else None
            out.append(row)
    return out


def _fmt(v, spec=".0f") -> str:
    return "-" if v is None else format(v, spec)


def report(results: List[Dict[str, Any]], out: Path, meta: Dict[str, Any]) -> str:
    checks, times, same_tile, copy = _flatten(results)
    table = _timing_table(times)
    copy_gbps = next((c["copy_gbps"] for c in copy if c.get("copy_gbps")), None)
    ablation = ablation_table(times, copy_gbps, CHECK_GEOMS[TIME_GEOM]["top_k"])
    pairs = same_tile_table(times, same_tile)
    lines = [f"# W4A8 and per-tensor FP8 beside blockwise FP8 on {meta.get('device', '?')} (drop {meta.get('drop', '?')})",
             "",
             "## Correctness (oracle over the kernel's own weights and staged activations; fp64: the format's error)",
             "", "| fmt | geom | T | ok | max row rel (tol) | rel L2 | NaN | rel L2 vs fp64 | knobs |",
             "|" + "---|" * 9]
    for c in checks:
        if "error" in c:
            lines.append(f"| {c['fmt']} | {c['geom']} | {c['T']} | ERROR | {c['error'][:80]} | | | | |")
        elif not c.get("kernel", True):
            lines.append(f"| {c['fmt']} | {c['geom']} | {c['T']} | no kernel | | | | "
                         f"{_fmt(c['rel_l2_vs_fp64'], '.4f')} (reference) | |")
        else:
            lines.append(f"| {c['fmt']} | {c['geom']} | {c['T']} | {'PASS' if c['ok'] else 'FAIL'} | "
                         f"{c['max_row_rel']:.4f} ({c['tol']:.4f}) | {c['rel_l2']:.2e} | {c['nan']} | "
                         f"{c['rel_l2_vs_fp64']:.4f} | {c['knob_source']} |")
    reasons = sorted({c["reason"] for c in checks + times if c.get("reason")})
    lines += ["", "## Time per forward, DeepSeek-V3 geometry, world size 1, caller-captured graph replay (us)", "",
              "| T | C | W4A8 MXFP4 | W4A8 NVFP4 | FP8 block | FP8 tensor | W4A8/FP8 (target) "
              "| tensor/block (target) | knobs (W4A8 / block / tensor) |",
              "|" + "---|" * 9]
    source = {(r["fmt"], r["T"]): r.get("knob_source", "-") for r in times}

    def verdict(bound, ok) -> str:
        return "" if bound is None else f" (<= {bound:.2f}{'' if ok is None else ' met' if ok else ' MISSED'})"

    for r in table:
        w = r["w4a8_mxfp4/fp8_block"]
        tr = r["fp8_tensor/fp8_block"]
        wt = verdict(r["w4a8_target"], r["w4a8_ok"])
        tt = verdict(r["tensor_target"], r["tensor_ok"])
        srcs = " / ".join(source.get((f, r["T"]), "-") for f in ("w4a8_mxfp4", "fp8_block", "fp8_tensor"))
        lines.append(f"| {r['T']} | {r['capacity']} | {_fmt(r['w4a8_mxfp4'])} | {_fmt(r['w4a8_nvfp4'])} | "
                     f"{_fmt(r['fp8_block'])} | {_fmt(r['fp8_tensor'])} | {_fmt(w, '.3f')}{wt} | "
                     f"{_fmt(tr, '.3f')}{tt} | {srcs} |")
    if ablation:
        lines += ["", "## Ablation: where the time goes (module docstring, 3a)", "",
                  f"Copy rate of this GPU: {_fmt(copy_gbps)} GB/s (read + write). empty: every slot -1; hot: every "
                  "token to experts 0..K-1; per expert = (balanced - hot) / (experts - K); stream = one expert's "
                  "weight bytes over that; floor = experts x bytes over the copy rate.", "",
                  "| T | fmt | balanced (us) | empty (us) | hot (us) | experts | per expert (us) | stream (GB/s) "
                  "| empty / balanced | floor (us) | floor / balanced |",
                  "|" + "---|" * 11]
        for a in ablation:
            of_floor = a["floor_us"] / a["us"] if a["floor_us"] else None
            lines.append(f"| {a['T']} | {a['fmt']} | {_fmt(a['us'])} | {_fmt(a['empty_us'])} | {_fmt(a['hot_us'])} | "
                         f"{_fmt(a['experts'], 'd')} | {_fmt(a['per_expert_us'], '.2f')} | "
                         f"{_fmt(a['stream_gbps'])} | {_fmt(a['fixed_share'], '.2f')} | {_fmt(a['floor_us'])} | "
                         f"{_fmt(of_floor, '.2f')} |")
    if any(p["w4a8_k128_us"] or p["fp8_swap_us"] for p in pairs):
        lines += ["", "## Ablation: one tile, two formats (module docstring, 3b)", "",
                  "| C | T | W4A8 as resolved (tile) | W4A8, K 128 | FP8 swap-AB, W4A8's tile | FP8 as resolved (tile) "
                  "| dequant: W4A8 K128 / FP8 swap-AB | order: FP8 swap-AB / FP8 |",
                  "|" + "---|" * 8]
        for p in pairs:
            lines.append(f"| {p['capacity']} | {p['T']} | {_fmt(p['w4a8_us'])} ({p['w4a8_tile']}) | "
                         f"{_fmt(p['w4a8_k128_us'])} | {_fmt(p['fp8_swap_us'])} ({p['fp8_swap_tile']}) | "
                         f"{_fmt(p['fp8_us'])} ({p['fp8_tile']}{', swap-AB' if p['fp8_swap'] else ''}) | "
                         f"{_fmt(p['dequant'], '.3f')} | {_fmt(p['order'], '.3f')} |")
    if reasons:
        lines += ["", "Unavailable: " + "; ".join(reasons)]
    failed = [r for r in results if not r["ok"]]
    if failed:
        lines += ["", "Jobs that failed or did not run:"] + [
            f"- {r['kind']} {r['fmt']} {r['geom']} C{r['capacity']}: {r.get('error', 'not run')}" for r in failed]
    text = "\n".join(lines) + "\n"
    (out / "report.md").write_text(text)
    (out / "summary.json").write_text(json.dumps(dict(meta=meta, checks=checks, timing=table, ablation=ablation,
                                                      same_tile=pairs, copy_gbps=copy_gbps), indent=1, default=str))
    for name, rows in (("checks.csv", checks), ("timing.csv", table)):
        if rows:
            keys = sorted({k for r in rows for k in r if not isinstance(r.get(k), (list, dict))})
            with open(out / name, "w", newline="") as f:
                wr = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
                wr.writeheader()
                wr.writerows(rows)
    _plot(table, out / "timing.png")
    return text


def _plot(table: List[Dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (ax, rx) = plt.subplots(1, 2, figsize=(13, 4.8))
    ts = [r["T"] for r in table]
    for fmt, style in (("fp8_block", "o-"), ("fp8_tensor", "s--"), ("w4a8_mxfp4", "^-")):
        pts = [(r["T"], r[fmt]) for r in table if r[fmt]]
        if pts:
            ax.plot(*zip(*pts), style, label=fmt)
    ax.set(xscale="log", yscale="log", xlabel="tokens per rank T", ylabel="us per forward (graph replay)",
           title="DeepSeek-V3 geometry, 1 x H200")
    ax.legend()
    for key, style, targets in (("w4a8_mxfp4/fp8_block", "^-", "w4a8_target"),
                                ("fp8_tensor/fp8_block", "s--", "tensor_target")):
        pts = [(r["T"], r[key]) for r in table if r[key]]
        if pts:
            rx.plot(*zip(*pts), style, label=key)
        tgt = [(r["T"], r[targets]) for r in table if r[targets]]
        if tgt:
            rx.plot(*zip(*tgt), "k:", drawstyle="steps-mid", alpha=0.5)
    rx.axhline(1.0, color="grey", lw=0.5)
    rx.set(xscale="log", xticks=ts, xticklabels=[str(t) for t in ts], xlabel="tokens per rank T",
           ylabel="time ratio", title="ratios (dotted: #35 targets)")
    rx.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _meta() -> Dict[str, Any]:
    import torch

    from shim.common import tree

    tree.activate("sm90")
    prov = tree.tree_provenance("sm90") or {}
    return dict(device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                drop=prov.get("manifest_version"), drop_verified=prov.get("verified"),
                torch=torch.__version__, date=time.strftime("%Y-%m-%d %H:%M:%S"),
                command=" ".join(sys.argv))


def dry_run() -> int:
    """The plan, and for every kernel job its knobs as a layer would resolve them and the kernel's constructor
    (what refuses a knob set): no GPU, nothing compiled."""
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    bad = 0
    for job in plan():
        if job["kind"] == "copy":
            print(f"{job['id']:3d} copy: the device-to-device copy rate")
            continue
        reason = _unavailable(job["fmt"])
        if reason is not None:
            print(f"{job['id']:3d} {job['kind']:5s} {job['fmt']:10s} {job['geom']:5s} C{job['capacity']:<5d} "
                  f"T{job['tokens']}: unavailable ({reason[:60]}...)")
            continue
        try:
            fe, knobs, source = _frontend(job["fmt"], job["geom"], job["capacity"], None, compile_only=True,
                                          variant=job.get("variant"))
            desc = f"{source:9s} {knobs.mma_tiler_mnk} {knobs.cluster_shape_mnk} swap={knobs.swap_ab} " \
                   f"pp={knobs.pingpong} {type(fe.kernel).__name__}"
        except Exception as e:  # noqa: BLE001 - report every job, not only the first that fails
            bad += 1
            desc = f"REFUSED {type(e).__name__}: {e}"
        print(f"{job['id']:3d} {job['kind']:5s} {job['fmt']:10s} {job['geom']:5s} C{job['capacity']:<5d} "
              f"T{job['tokens']} {'+'.join(job.get('routings', []))}: {desc}")
    return 1 if bad else 0


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.w4a8", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "w4a8_out"))
    ap.add_argument("--workers", type=int, default=0, help="compile workers (default: min(6, cores - 2))")
    ap.add_argument("--budget-s", type=float, default=360.0,
                    help="start no new job after this long (running ones finish: keep ~2 min of headroom)")
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--skip-ablation", action="store_true", help="no copy rate, routing variants or same-tile pairs")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args(argv)
    if args.dry_run:
        return dry_run()
    import torch

    if not torch.cuda.is_available():
        print("tools.bench.w4a8 needs a Hopper GPU (none found); --dry-run checks the plan here", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = _meta()
    jobs = plan(check=not args.skip_checks, timing=not args.skip_timing, ablation=not args.skip_ablation)
    workers = args.workers or max(1, min(6, (os.cpu_count() or 4) - 2))
    print(f"[w4a8] {len(jobs)} jobs on {meta['device']}, drop {meta['drop']} (verified {meta['drop_verified']}), "
          f"{workers} workers, budget {args.budget_s:.0f} s", flush=True)
    ctxm = mp.get_context("spawn")
    lock = ctxm.Lock()
    started = time.perf_counter()
    results: Dict[int, Dict[str, Any]] = {}
    with ProcessPoolExecutor(workers, mp_context=ctxm, initializer=_init_worker, initargs=(lock,)) as pool, \
            open(out / "results.jsonl", "a") as log:
        pending = list(jobs)
        running = {}
        while pending or running:
            while pending and len(running) < workers and time.perf_counter() - started < args.budget_s:
                j = pending.pop(0)
                running[pool.submit(run_job, j)] = j
            if not running:
                break
            done, _ = wait(list(running), timeout=30, return_when=FIRST_COMPLETED)
            for fut in done:
                j = running.pop(fut)
                try:
                    r = fut.result()
                except Exception as e:  # noqa: BLE001 - a worker that died takes its job with it
                    r = dict(j, ok=False, error=f"worker died: {type(e).__name__}: {e}")
                results[j["id"]] = r
                log.write(json.dumps(r, default=str) + "\n")
                log.flush()
                status = "ok" if r["ok"] else f"FAILED {r.get('error', '')[:120]}"
                print(f"[w4a8 {time.perf_counter() - started:5.0f}s] {j['kind']} {j['fmt']} {j['geom']} "
                      f"C{j['capacity']}: {status} ({r.get('seconds', '?')} s)", flush=True)
        for j in pending:
            results[j["id"]] = dict(j, ok=False, error="not run: out of --budget-s")
    text = report([results[j["id"]] for j in jobs if j["id"] in results], out, meta)
    print(text, flush=True)
    checks = _flatten(list(results.values()))[0]
    failed = [c for c in checks if c.get("ok") is False or "error" in c]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
