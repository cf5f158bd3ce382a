"""The forward watchdog's hot path, piece by piece, and the CUDA facts it relies on (#14, #28).

    python3 -m tools.diag.watchdog_cost [--device cpu|cuda] [--out DIR]    (~20 s; a CUDA host: one GPU)

Host time per call (median of blocks of 2000 back-to-back calls; on CUDA synchronised between blocks so the launch
queue never fills):
  - the watch's begin()+end() on a CPU watch in a group of one (its Python alone) and in a group of two (plus the
    group's call log of #28: what every rank of a world size >= 2 pays); on CUDA the same through the driver's
    events (the default: one cuEventRecord through ctypes) and through torch's (the fallback);
  - the fingerprint a backend carries in its exchange (fingerprint()) and the in-band comparison of two ranks'
    fingerprints (in_band(), in step: the torch reference pays both every call);
  - the heartbeat thread's digest of the call log, per call (off the hot path: it competes for the GIL only);
  - an eager layer call end to end (a backend that does nothing, T=1, the layer's checks off, a one-rank gloo group
    on CPU), in alternating rounds: the watch off, on, and on with a group log attached (as at world size >= 2),
    with the median of the per-round differences;
  - on CUDA the pieces: torch's current raw stream, its capture check, cuEventRecord through ctypes, torch's
    _CudaEventBase.record and torch.cuda.Event.record.

Checks (CUDA), each printed as ok / FAILED: a driver event recorded after a long kernel is "not ready" until the
kernel ends; an event recorded while the stream is being captured leaves the capture valid (the graph replays) and
is reported finished by the watchdog's query (the driver answers with an error, not "not ready").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, Optional


def _paired(fn: Callable[[], None], setups: Dict[str, Callable[[], None]], sync, rounds: int = 15, n: int = 200):
    """Host time of fn per call under each setup, in rounds whose order rotates so that drift of the host falls
    on all alike: {setup: median us}, {setup: median of the per-round differences to the first setup, us}."""
    names = list(setups)
    per = {k: [] for k in names}
    diffs = {k: [] for k in names[1:]}
    for r in range(rounds):
        got = {}
        for k in names[r % len(names):] + names[:r % len(names)]:
            setups[k]()
            sync()
            t = time.perf_counter()
            for _ in range(n):
                fn()
            sync()
            got[k] = (time.perf_counter() - t) / n * 1e6
        for k in names:
            per[k].append(got[k])
        for k in names[1:]:
            diffs[k].append(got[k] - got[names[0]])
    setups[names[0]]()
    return ({k: statistics.median(v) for k, v in per.items()}, {k: statistics.median(v) for k, v in diffs.items()})


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="write watchdog_cost.json here")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when a GPU is present")
    args = p.parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    from tools.require import require

    require(device=device, argument="--device")
    from moe_ep.core import watchdog as wd
    from moe_ep.core.watchdog import divergence, events, monitor, ring, sequence
    from tools.bench.timing import host_us_per_call

    cuda = device == "cuda"
    if cuda:
        dev = torch.cuda.current_device()
        torch.cuda.init()
        sync = torch.cuda.synchronize
    else:
        torch.set_num_threads(1)

        def sync():
            pass

    def per_call_us(fn):  # the docstring's blocks: median of 7 blocks of 2000 calls
        return host_us_per_call(fn, 2000, 7, sync)

    import platform

    results: Dict[str, object] = {"device": torch.cuda.get_device_name(dev) if cuda else platform.processor() or
                                  platform.machine(), "torch": torch.__version__, "python": platform.python_version()}
    times: Dict[str, float] = {}

    def log2():
        lg = sequence.GroupLog("cost", [0, 1], 0)
        return lg, lg.new_code("cost")

    def watch(kind: Optional["events.CudaEvents"] = None, grouped: bool = False):
        """A watch on a private monitor (no threads, no peers); grouped: in a group of two, with its call log."""
        m = monitor.Monitor(threads=False)
        lg, code = log2() if grouped else (None, 0)
        w = wd.Watch("cost", wd.Bound(60.0, "test"), [0, 1] if grouped else [0], 0, "cpu", monitor=m, log=lg,
                     code=code)
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

    times["begin+end, CPU watch, group of 1"] = per_call_us(pairs(watch()))
    times["begin+end, CPU watch, group of 2 (+ the call log, #28)"] = per_call_us(pairs(watch(grouped=True)))
    lg, code = log2()
    w2 = watch(grouped=True)
    w2.begin()  # a call in progress: fingerprint() answers it
    lg = w2._log
    fp = lg.fingerprint()
    times["fingerprint() (what the torch reference carries)"] = per_call_us(lg.fingerprint)
    rows = [list(fp), list(fp)]
    times["in_band() of 2 ranks, in step (the torch reference)"] = per_call_us(lambda: divergence.in_band(lg, fp, rows))

    dl, dcode = log2()

    def digest_1000():
        for _ in range(1000):
            s = dl.seq
            j = s & sequence.LOG_MASK
            dl.codes[j] = dcode
            dl.calls[j] = s + 1
            dl.seq = s + 1
        t = time.perf_counter()
        dl.digest()
        return (time.perf_counter() - t) / 1000 * 1e6

    times["digest per call (heartbeat thread, off the hot path)"] = statistics.median(digest_1000() for _ in range(20))

    driver = tch = None
    if cuda:
        driver = events.CudaEvents()
        driver.bind("driver")
        tch = events.CudaEvents()
        tch.bind("torch")
        results["driver_path_available"] = driver.kind == "driver"
        if driver.kind == "driver":
            times["begin+end, CUDA watch, driver events (default), group of 1"] = per_call_us(pairs(watch(driver)))
            times["begin+end, CUDA watch, driver events, group of 2 (+ the call log)"] = per_call_us(
                pairs(watch(driver, grouped=True)))
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

    layer_us, layer_diff, exchange = _layer_call(torch, cuda, sync)
    results["per_call_us"] = times
    results["eager_layer_call_us"] = layer_us
    results["eager_layer_call_minus_watch_off_us"] = layer_diff
    if exchange is not None:
        results["reference_exchange_us"], results["reference_exchange_minus_counts_only_us"] = exchange
    results["checks"] = checks = _cuda_checks(torch, driver, dev, sync) if cuda else {}

    width = max(len(k) for k in times)
    print(f"{'host time per call':<{width}}  {'us':>7}")
    for k, v in times.items():
        print(f"{k:<{width}}  {v:7.3f}")
    print("\neager layer call (no-op backend, T=1, checks off), alternating rounds:")
    for k, v in layer_us.items():
        d = f"  ({layer_diff[k]:+.3f} vs watch off)" if k in layer_diff else ""
        print(f"  {k:<44}  {v:8.3f} us{d}")
    if exchange is not None:
        print("\nthe torch reference's counts exchange (gloo, one rank), alternating rounds:")
        for k, v in exchange[0].items():
            d = f"  ({exchange[1][k]:+.3f} vs counts only)" if k in exchange[1] else ""
            print(f"  {k:<44}  {v:8.3f} us{d}")
    for k, ok in checks.items():
        print(f"{'ok' if ok else 'FAILED'}: {k}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "watchdog_cost.json").write_text(json.dumps(results, indent=1))
    return 0 if all(checks.values()) else 1


def _layer_call(torch, cuda: bool, sync):
    """An eager MoELayer call whose backend does nothing: what moe_ep's own host path costs, with the watch off,
    on, and on with a two-rank group log attached (the #28 part, as every rank of a world size >= 2 runs it)."""
    import torch.distributed as dist

    import moe_ep
    from moe_ep.core.backend import Backend
    from moe_ep.core.watchdog import sequence

    class Idle(Backend):
        name = "t_idle"
        weight_formats = ("bf16",)

        def prepare_weights(self, weights):
            pass

        def forward(self, hidden, topk_idx, topk_weights, out):
            return out

    moe_ep.register_backend("t_idle", Idle, arch="cpu", formats=("bf16",), replace=True)
    own_group = not dist.is_initialized()
    tmp = tempfile.TemporaryDirectory()
    if own_group:
        backend = "nccl" if cuda else "gloo"
        dist.init_process_group(backend, init_method=f"file://{tmp.name}/store", rank=0, world_size=1)
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    h, e, k = 256, 8, 4
    spec = moe_ep.MoESpec(h, 128, e, k, 8)
    w = moe_ep.ExpertWeights(torch.zeros(e, 256, h, dtype=torch.bfloat16), torch.zeros(e, h, 128, dtype=torch.bfloat16),
                             0, 1, e)
    layer = moe_ep.MoELayer(spec, w, backend="t_idle", device=dev, check_values=False, collective_checks=False,
                            timeout_s=60)
    x = torch.zeros(1, h, dtype=torch.bfloat16, device=dev)
    idx = torch.arange(k, device=dev).view(1, k)
    tw = torch.full((1, k), 1.0 / k, device=dev)
    out = torch.empty(1, h, dtype=torch.bfloat16, device=dev)
    watch = layer.watch
    lg = sequence.GroupLog("cost layer", [0, 1], 0)
    code = lg.new_code(layer.name)

    def off():
        layer.watched = False

    def on():
        layer.watched = True
        watch._log, watch.code = None, 0

    def on_log():
        layer.watched = True
        watch._log, watch.code = lg, code

    us, diff = _paired(lambda: layer(x, idx, tw, out=out), {"watch off": off, "watch on, group of 1": on,
                                                               "watch on, group of 2 (+ the call log)": on_log}, sync)
    on()
    layer.close()
    ex = None
    if not cuda:
        # The torch reference's first exchange (the row counts), bare and with the fingerprint it carries, checked
        # in band as the backend does: what the torch reference adds to its every call (gloo, one rank).
        from moe_ep.core.dist import RankContext, all_to_all_rows
        from moe_ep.core.watchdog import divergence

        ctx = RankContext.from_group(None, "cpu")
        rows = [torch.zeros(16, 64, dtype=torch.uint8)]
        counts = torch.tensor([16])
        fp = (2, 7, 9)

        def bare():
            all_to_all_rows(ctx, rows, counts)

        def carried():
            _, _, theirs = all_to_all_rows(ctx, rows, counts, header=fp)
            divergence.in_band(lg, fp, theirs)

        state = {"fn": bare}
        ex = _paired(lambda: state["fn"](), {"counts only": lambda: state.update(fn=bare),
                                             "counts + fingerprint, checked in band": lambda: state.update(fn=carried)},
                     sync, n=100)
    if own_group:
        dist.destroy_process_group()
    tmp.cleanup()
    return us, diff, ex


def _cuda_checks(torch, driver, dev, sync) -> Dict[str, bool]:
    from moe_ep.core.watchdog import events

    checks = {}
    if driver is None or driver.kind != "driver":
        return checks
    raw = torch._C._cuda_getCurrentRawStream(dev)
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
    return checks


if __name__ == "__main__":
    sys.exit(main())
