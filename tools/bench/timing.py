"""How the benchmarks time things on the GPU: CUDA-event medians, host time per call, and device time per
kernel from a profiler trace (what the GPU ran, whatever the host did)."""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Callable, Optional

import torch

__all__ = ["cuda_time_us", "host_time_us", "host_us_per_call", "paired_host_time_us", "kernel_groups_us", "classify",
           "FUSED", "REDUCE", "STAGING"]


def cuda_time_us(fn: Callable[[], None], iters: int = 30, warmup: int = 5,
                 flush: Optional[torch.Tensor] = None) -> float:
    """CUDA-event time of one call, median of `iters` after `warmup` calls. flush: a buffer (larger than the L2)
    zeroed before each timed call, outside the events, for cold-cache times."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if flush is not None:
            flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def host_time_us(fn: Callable[[], None], iters: int = 20) -> float:
    """CPU time of one call, median, with the GPU queue far from full (so no call blocks on the GPU)."""
    torch.cuda.synchronize()
    cpu = []
    for _ in range(iters):
        c0 = time.perf_counter()
        fn()
        cpu.append((time.perf_counter() - c0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(cpu)


def host_us_per_call(fn: Callable[[], None], n: int, blocks: int, sync: Callable[[], None] = torch.cuda.synchronize,
                     idle: bool = False, pause_s: float = 0.0) -> float:
    """Host time per call, median over `blocks` blocks of `n` back-to-back calls, synchronised between blocks so
    the launch queue never fills. idle=True synchronises before every call too and times only the call (nothing
    in it can wait on the device); pause_s > 0 sleeps that long on the host before every call and times only the
    call (the CPU's caches and clocks cool down, as between the layers of a real step)."""
    per = []
    for _ in range(blocks):
        sync()
        if idle or pause_s > 0:
            total = 0.0
            for _ in range(n):
                if idle:
                    sync()
                if pause_s > 0:
                    time.sleep(pause_s)
                t = time.perf_counter()
                fn()
                total += time.perf_counter() - t
            per.append(total / n * 1e6)
        else:
            t = time.perf_counter()
            for _ in range(n):
                fn()
            per.append((time.perf_counter() - t) / n * 1e6)
    sync()
    return statistics.median(per)


def paired_host_time_us(fn: Callable[[], None], on: Callable[[], None], off: Callable[[], None], rounds: int = 15,
                        iters: int = 20):
    """Host time of fn with a feature on and off, measured in alternating rounds (on/off, off/on, ...) so that drift
    of the host (clocks, other processes) falls on both alike. Returns (median on, median off, median of the
    per-round differences on - off), microseconds."""
    ons, offs, diffs = [], [], []
    for r in range(rounds):
        pair = {}
        for state in ((True, False) if r % 2 == 0 else (False, True)):
            (on if state else off)()
            pair[state] = host_time_us(fn, iters)
        on()
        ons.append(pair[True])
        offs.append(pair[False])
        diffs.append(pair[True] - pair[False])
    return statistics.median(ons), statistics.median(offs), statistics.median(diffs)


FUSED, REDUCE, STAGING = "MegaMoE fused kernel (drop)", "top-k reduce (drop)", "moe_ep staging (torch ops)"


def classify(name: str) -> str:
    n = name.lower()
    if "topk_reduce" in n or "topkreduce" in n:
        return REDUCE
    if "kernel_cutlass" in n or "megamoe" in n or "cutlass" in n:
        return FUSED
    return STAGING


def kernel_groups_us(fn, iters: int = 20):
    """({group: device us per call}, {kernel name: device us per call}) of `fn` (e.g. a graph replay) under
    torch.profiler: what ran on the GPU, whatever the host did. The drop's kernel alone is FUSED + REDUCE."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    per = defaultdict(float)
    names = defaultdict(float)
    # Per kernel name: the median launch times the launches per call, not the mean. At world size > 1 a rank
    # that enters the profiled loop later than its peer leaves the peer's first kernel spinning on it for
    # milliseconds (seen on two H200s: a 105 us kernel read as 25 ms on average); the median drops that.
    runs = defaultdict(list)
    try:
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                runs[ev.name].append(ev.time_range.elapsed_us())
    except (AttributeError, RuntimeError):
        runs.clear()
    if runs:
        for name, durations in runs.items():
            us = statistics.median(durations) * len(durations) / iters
            per[classify(name)] += us
            names[name[:80]] += us
        return dict(per), dict(names)
    for ev in prof.key_averages():
        dt = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
        if dt and ev.device_type == torch.autograd.DeviceType.CUDA:
            per[classify(ev.key)] += dt / iters
            names[ev.key[:80]] += dt / iters
    return dict(per), dict(names)
