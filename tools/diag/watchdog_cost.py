"""The forward watchdog's hot path on a GPU host, piece by piece, and the CUDA facts it relies on (#14).

    python3 -m tools.diag.watchdog_cost [--out DIR]        (a CUDA host; one GPU; ~10 s)

Times, per call (median of blocks of 2000 on an idle stream, synchronised between blocks so the launch queue never
fills): the watch's begin()+end() on a CPU watch (its Python alone), on a CUDA watch through the driver (the
default: one cuEventRecord through ctypes) and through torch's events (the fallback, and what the first version
used); and the pieces: torch's current raw stream, torch's capture check, cuEventRecord through ctypes, torch's
_CudaEventBase.record and torch.cuda.Event.record.

Checks, each printed as ok / FAILED: a driver event recorded after a long kernel is "not ready" until the kernel
ends; an event recorded while the stream is being captured leaves the capture valid (the graph replays) and is
reported finished by the watchdog's query (the driver answers with an error, not "not ready").
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, Optional


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="write watchdog_cost.json here")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from moe_ep.core import watchdog as wd
    from moe_ep.core.watchdog import events, monitor, ring
    from tools.bench.timing import host_us_per_call

    dev = torch.cuda.current_device()
    torch.cuda.init()
    sync = torch.cuda.synchronize

    def per_call_us(fn):  # the docstring's blocks: median of 7 blocks of 2000 calls
        return host_us_per_call(fn, 2000, 7, sync)

    results: Dict[str, object] = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__}
    times: Dict[str, float] = {}

    driver = events.CudaEvents()
    driver.bind("driver")
    tch = events.CudaEvents()
    tch.bind("torch")
    results["driver_path_available"] = driver.kind == "driver"

    def watch(kind: Optional["events.CudaEvents"] = None):  # a watch on a private monitor (no threads, no peers)
        m = monitor.Monitor(threads=False)
        w = wd.Watch("cost", wd.Bound(60.0, "test"), [0], 0, "cpu", monitor=m)
        if kind is not None:
            w._dev, w._evs, w._raw, w._rec = dev, kind.new_events(dev, ring.RING), kind.raw_stream, kind.record
        return w

    def pairs(w):
        state = {"n": 0}

        def one():
            state["n"] += 1
            if state["n"] % 4000 == 0:  # stay inside one ring: this private monitor confirms nothing
                w._m.__init__(threads=False)
            w.end(w.begin())
        return one

    times["begin+end, CPU watch (Python only)"] = per_call_us(pairs(watch()))
    if driver.kind == "driver":
        times["begin+end, CUDA watch, driver events (default)"] = per_call_us(pairs(watch(driver)))
    times["begin+end, CUDA watch, torch events (fallback)"] = per_call_us(pairs(watch(tch)))

    raw = torch._C._cuda_getCurrentRawStream(dev)
    times["torch._C._cuda_getCurrentRawStream"] = per_call_us(lambda: torch._C._cuda_getCurrentRawStream(dev))
    times["torch._C._cuda_isCurrentStreamCapturing"] = per_call_us(torch._C._cuda_isCurrentStreamCapturing)
    if driver.kind == "driver":
        dev_ev = driver.new_events(dev, 1)[0]
        times["cuEventRecord through ctypes"] = per_call_us(lambda: driver.record(dev_ev, raw))
        times["cuEventQuery through ctypes (monitor side)"] = per_call_us(lambda: driver.query(dev_ev))
    ev = torch.cuda.Event()
    stream = torch.cuda.current_stream()
    base = torch._C._CudaEventBase.record
    times["torch _CudaEventBase.record(ev, stream)"] = per_call_us(lambda: base(ev, stream))
    times["torch.cuda.Event.record()"] = per_call_us(ev.record)
    results["per_call_us"] = times

    checks = {}
    if driver.kind == "driver":
        h = driver.new_events(dev, 1)[0]
        torch.cuda._sleep(int(2e8))  # ~0.1 s of device time on the current stream
        driver.record(h, raw)
        pending = not driver.query(h)
        sync()
        checks["driver event: not ready behind a running kernel, ready after it"] = pending and driver.query(h)

        x = torch.zeros(1024, device="cuda")
        g = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            x.add_(1)
        torch.cuda.current_stream().wait_stream(side)
        captured = driver.new_events(dev, 1)[0]
        rc_capture = None
        with torch.cuda.graph(g):
            x.add_(1)
            rc_capture = driver.record(captured, torch._C._cuda_getCurrentRawStream(dev))
        g.replay()
        sync()
        q = driver._lib.cuEventQuery(captured)
        checks["event recorded inside a capture: the capture stays valid and replays"] = rc_capture == 0 and float(
            x[0]) == 2.0
        checks["event recorded inside a capture: the query answers with an error, counted finished"] = (
            q != events.NOT_READY and driver.query(captured))
        results["captured_event_query_code"] = q
        results["record_in_capture_code"] = rc_capture
    results["checks"] = checks

    width = max(len(k) for k in times)
    for k, v in times.items():
        print(f"{k:<{width}}  {v:7.3f} us")
    for k, ok in checks.items():
        print(f"{'ok' if ok else 'FAILED'}: {k}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "watchdog_cost.json").write_text(json.dumps(results, indent=1))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
