"""Our W4A8 MXFP4 layer beside FlashInfer's `flashinfer.megamoe` MXFP4 x FP8 MegaMoE on one Hopper GPU, same geometry,
same weights, world size 1; a table of ours / theirs per T.

    python3 -m tools.bench.fi_megamoe --bundle .dev/fi/fi_megamoe.tar.xz --out $OUT   (GPU host, after site.sh)
    python3 -m tools.bench.fi_megamoe --bundle ... --cpu-check                         (any host: import, plans,
                                                                                         sources staged, no build)

The bundle is tools/bench/fi_megamoe_pack.py's: the modules `flashinfer.megamoe` imports from the pinned wheel, the
C++ its run-time build includes, apache-tvm-ffi. `flashinfer` itself is entered as a bare namespace (its own
__init__ imports every kernel family, most of which the bundle leaves out).

DeepSeek-V3's geometry (H 7168, I 2048, 32 experts, top-8), capacity = T rounded up to a power of two (>= 8), T in 1,
8, 32, 128, 512, 2048, 4096 (--tokens). The bf16 weights are tools.bench.w4a8's (seed 22); both layers get the MXFP4
codes and scales of moe_ep's quantizer: ours through its layer's frontend, theirs in the byte order and scale range
flashinfer/megamoe/weights.py documents (two e2m1 codes a byte, K[b] high and K[b+4] low in each 4-byte word; each
expert's scales moved into [2^-5, 2^6] by a power of two passed as its per-expert global scale: exact, so both
multiply the same weights). Activations: ours stages per-token FP8 in its graph; theirs take blockwise 1x128 FP8
(their buffer's format), quantized in the graph by moe_ep's fused blockwise stager into their symmetric buffer, the
routing copied beside it: both columns time bf16 tokens in, combined bf16 out. Timing as tools.bench.w4a8: one
forward captured in a CUDA graph, median over 7 batches of 20 replays (FlashInfer's launch eagerly, if its module
cannot be captured: marked). Their output, NaN-poisoned before the call, is compared with an fp64 MoE over the same
dequantized weights (relative L2): the FP8 activations' own rounding, a few percent, as ours is (docs/performance.md);
far more says the weights did not reach their kernel as ours did.

Setup failures end the run at once with the reason and a non-zero status: no nvcc or ninja (exit 3), an import of
the bundle (exit 4), a failed build (exit 5: the compiler's last lines printed). FlashInfer's modules (one per plan,
~1-3 minutes of nvcc each) build in parallel threads while our kernels compile in worker processes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tarfile
import threading
import time
import traceback
import types
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

GEOM = "dsv3"
TOKENS = (1, 8, 32, 128, 512, 2048, 4096)
# FlashInfer's MXFP4 decoder takes scales in [2^-5, 2^6] (flashinfer/megamoe/weights.py): e8m0 codes 122..133.
FI_SCALE_LO = 122
# moe_ep's quantizer keeps each expert's scales within 11 binades of its largest (codecs.MXFP4_MAX_SCALE_RANGE):
# twelve codes, exactly FlashInfer's window, so one power of two per expert and tensor moves them in.
FI_SCALE_SPAN = 12


def capacity_for(t: int) -> int:
    return max(8, 1 << max(0, t - 1).bit_length())


# -- the bundle ----------------------------------------------------------------------------------------------------
def enter_bundle(bundle: Path, into: Path) -> Path:
    """Unpacks the bundle (once) and makes `flashinfer` a bare package over it; returns its root."""
    root = into / "fi"
    if not (root / "flashinfer" / "megamoe" / "__init__.py").exists():
        into.mkdir(parents=True, exist_ok=True)
        with tarfile.open(bundle) as tar:
            tar.extractall(into)
    sys.path.insert(0, str(root))
    pkg = types.ModuleType("flashinfer")
    pkg.__path__ = [str(root / "flashinfer")]
    sys.modules.setdefault("flashinfer", pkg)
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", str(into / "ws"))
    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    os.environ.setdefault("FLASHINFER_DISABLE_VERSION_CHECK", "1")
    return root


def preflight() -> List[str]:
    """What a FlashInfer build needs on this host and lacks."""
    missing = []
    cuda = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = shutil.which("nvcc") or (cuda and os.path.join(cuda, "bin", "nvcc"))
    if not nvcc or not os.path.exists(nvcc):
        missing.append("nvcc (neither on PATH nor under $CUDA_HOME)")
    if not shutil.which("ninja"):
        missing.append("ninja")
    return missing


def fi_weights(qw, device):
    """moe_ep's w4a8_mxfp4 pack -> FlashInfer's ((w13 packed, scales), (w2 packed, scales)) and per-expert global
    scales (g13, g2), the same weights exactly (module docstring)."""
    import torch

    def leg(codes, scale):
        e, n, k = codes.shape
        code = scale.view(torch.uint8).to(torch.int32)
        top = code.reshape(e, -1).amax(dim=1)
        shift = top - (FI_SCALE_LO + FI_SCALE_SPAN - 1)  # the expert's largest scale lands on 2^6
        moved = code - shift.view(e, 1, 1)
        # A block of zero codes may sit below the window (its scale multiplies nothing): lifted into it. Any other
        # block outside it would change value.
        zero = (codes.reshape(e, n, k // 32, 32) & 7).amax(dim=-1) == 0
        if bool(((moved < FI_SCALE_LO) & ~zero).any()):
            raise ValueError("an expert's scales span more than FlashInfer's window")
        moved = moved.clamp(min=FI_SCALE_LO)
        c = codes.to(torch.int32).reshape(e, n, k // 8, 8)
        packed = (c[..., :4] << 4) | c[..., 4:]  # byte b of a 4-byte word: K[b] high, K[b+4] low
        g = torch.pow(2.0, shift.to(torch.float32))
        return (packed.to(torch.uint8).reshape(e, n, k // 2).contiguous().to(device),
                moved.to(torch.uint8).contiguous().to(device)), g.to(device)

    l1, g1 = leg(qw.w13_q, qw.w13_scale)
    l2, g2 = leg(qw.w2_q, qw.w2_scale)
    return l1, l2, g1, g2


# -- ours: tools.bench.w4a8's time jobs in worker processes ----------------------------------------------------------
def our_jobs(tokens) -> List[Dict[str, Any]]:
    by_cap: Dict[int, List[int]] = {}
    for t in tokens:
        by_cap.setdefault(capacity_for(t), []).append(t)
    return [dict(id=n, kind="time", fmt="w4a8_mxfp4", geom=GEOM, capacity=c, tokens=ts, routings=["balanced"])
            for n, (c, ts) in enumerate(sorted(by_cap.items()))]


# -- theirs ------------------------------------------------------------------------------------------------------
def fi_plans(tokens, num_sms: int, e: int, k: int, h: int, i: int):
    """(T, capacity, plan, JitSpec) per T, from FlashInfer's own plan selection and module factory."""
    from flashinfer.jit.megamoe import gen_megamoe_sm90_mxfp4_module
    from flashinfer.megamoe.heuristics import select_mxfp4_fused_plan

    out = []
    for t in tokens:
        c = capacity_for(t)
        plan = select_mxfp4_fused_plan(num_sms, 1, e, k, h, i, c, t)
        # The argument order of flashinfer.megamoe._jit_args for the MXFP4 factory: plan, SMs, ranks, capacity,
        # experts, top-k, hidden, intermediate, the SwiGLU clamp (their default 10), fast math (their default on).
        spec = gen_megamoe_sm90_mxfp4_module(plan, num_sms, 1, c, e, k, h, i, 10.0, True)
        out.append((t, c, plan, spec))
    return out


def build_all(specs, jobs: int) -> Optional[str]:
    """Builds every spec (nvcc through ninja), `jobs` at a time; the first failure's compiler output, or None."""
    from flashinfer.jit.megamoe import gen_megamoe_sm90_layout_module

    def one(spec):
        t0 = time.perf_counter()
        spec.build(need_lock=True)
        return spec.name, time.perf_counter() - t0

    try:  # the small layout module first: a toolchain or header problem shows in seconds, not minutes
        name, s = one(gen_megamoe_sm90_layout_module())
        print(f"[fi] built {name} in {s:.0f} s", flush=True)
    except Exception as e:  # noqa: BLE001 - the compiler's words are the report
        return f"{type(e).__name__}: {e}"
    unique = {s.name: s for s in specs}
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        futures = [pool.submit(one, s) for s in unique.values()]
        for f in futures:
            try:
                name, s = f.result()
                print(f"[fi] built {name} in {s:.0f} s", flush=True)
            except Exception as e:  # noqa: BLE001
                for g in futures:
                    g.cancel()
                return f"{type(e).__name__}: {e}"
    return None


def replay_us(fn, device, lock) -> Tuple[List[float], str]:
    """(per-call microseconds over 7 batches of 20, "graph" or "eager"): fn captured in a CUDA graph and replayed,
    else called eagerly when its launch cannot be captured."""
    import torch

    mode = "graph"
    try:
        fn()
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            fn()
            stream.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                fn()
        torch.cuda.current_stream(device).wait_stream(stream)
        call = graph.replay
    except Exception as e:  # noqa: BLE001 - an uncapturable launch is timed eagerly, and says so
        print(f"[fi] graph capture failed ({type(e).__name__}: {str(e)[:200]}); timing eager calls", flush=True)
        torch.cuda.synchronize(device)
        mode, call = "eager", fn
    with lock:
        for _ in range(5):
            call()
        torch.cuda.synchronize(device)
        per = []
        for _ in range(7):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(20):
                call()
            b.record()
            b.synchronize()
            per.append(a.elapsed_time(b) * 1e3 / 20)
    return per, mode


def time_theirs(plans, weights, top_k: int, device, lock) -> List[Dict[str, Any]]:
    """FlashInfer's layer at every planned T on moe_ep's MXFP4 pack of `weights`; a T that fails is a row with its
    error, the others still run."""
    from flashinfer.megamoe import transform_mxfp4_weights_for_mega_moe
    from moe_ep.formats import quantize_weights
    from shim.sm90 import fp8_staging

    qw = quantize_weights("w4a8_mxfp4", weights.w13, weights.w2)
    dq13, dq2 = qw.dequantize()
    theirs = dict(dequantized=types.SimpleNamespace(w13=dq13.to(device), w2=dq2.to(device)), buffers={},
                  fused=fp8_staging.available(), top_k=top_k)
    l1, l2, theirs["g1"], theirs["g2"] = fi_weights(qw, device)
    theirs["w1"], theirs["w2"] = transform_mxfp4_weights_for_mega_moe(l1, l2)
    del l1, l2, qw
    rows = []
    for t, c, plan, _ in plans:
        try:
            rows.append(_time_one(t, c, plan, theirs, device, lock))
        except Exception as err:  # noqa: BLE001 - one T that fails is a row saying why
            print(f"[fi] T={t}: {type(err).__name__}: {str(err)[:300]}", flush=True)
            rows.append(dict(T=t, capacity=c, us=None, error=f"{type(err).__name__}: {str(err)[:300]}"))
    return rows


def _time_one(t: int, c: int, plan, theirs: Dict[str, Any], device, lock) -> Dict[str, Any]:
    """FlashInfer's layer at T: staging, routing copies and its kernel in one graph; its output against fp64."""
    import torch
    import torch.distributed as dist

    from flashinfer.megamoe import MegaMoESymmBuffer, mxfp4_mega_moe
    from moe_ep.formats import codecs
    from shim.sm90 import fp8_staging
    from shim.sm90.tune import synthetic_inputs
    from tools.bench.w4a8 import _fp64_moe
    from tools.geometries import spec_for

    dq = theirs["dequantized"]
    e, h, i = dq.w13.shape[0], dq.w13.shape[2], dq.w2.shape[2]
    if c not in theirs["buffers"]:
        theirs["buffers"][c] = MegaMoESymmBuffer(dist.group.WORLD, e, c, theirs["top_k"], h, i)
    buf = theirs["buffers"][c]
    x, idx, w, _ = synthetic_inputs(spec_for(GEOM, c), t, device, seed=t)  # the routing ours is timed on
    idx64, w32 = idx.to(torch.int64), w.to(torch.float32)
    y = torch.empty(t, h, dtype=torch.bfloat16, device=device)

    def stage():
        if theirs["fused"]:
            fp8_staging.launch_fused(x, buf.x, buf.x_sf)
        else:
            q, s = codecs.fp8_quantize_rows(x, 128, reciprocal=False)
            buf.x[:t].view(torch.uint8).copy_(q.view(torch.uint8))
            buf.x_sf[:t].copy_(s)
        buf.topk_idx[:t].copy_(idx64)
        buf.topk_weights[:t].copy_(w32)

    def call():
        stage()
        buf.commit_staged(t)
        mxfp4_mega_moe(y, theirs["w1"], theirs["w2"], buf, num_tokens=t, l1_global_scales=theirs["g1"],
                       l2_global_scales=theirs["g2"])

    per, mode = replay_us(call, device, lock)
    y.fill_(float("nan"))
    call()
    torch.cuda.synchronize(device)
    ref = _fp64_moe(dq, x, idx, w)
    rel = float((y.double() - ref).norm() / ref.norm().clamp(min=1e-30))
    return dict(T=t, capacity=c, us=statistics.median(per), batches_us=per, mode=mode,
                plan={f: getattr(plan, f) for f in ("block_m", "block_n", "num_experts_per_wave", "num_stages",
                                                      "swap_ab", "rs_swap_ab")},
                staging="fused" if theirs["fused"] else "torch", rel_l2_vs_fp64=rel, nan=int(torch.isnan(y).sum()))


# -- the run -----------------------------------------------------------------------------------------------------
def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench.fi_megamoe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", default=".dev/fi/fi_megamoe.tar.xz")
    ap.add_argument("--unpack-to", default="/tmp/fi_megamoe")
    ap.add_argument("--out", default=os.environ.get("OUT", "fi_megamoe_out"))
    ap.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    ap.add_argument("--workers", type=int, default=4, help="our compile workers")
    ap.add_argument("--build-jobs", type=int, default=0, help="FlashInfer modules built at once (default: all)")
    ap.add_argument("--cpu-check", action="store_true", help="import, plan and stage the sources; build nothing")
    args = ap.parse_args(argv)
    try:
        enter_bundle(Path(args.bundle), Path(args.unpack_to))
        import flashinfer.megamoe  # noqa: F401 - the import is the check
    except Exception:  # noqa: BLE001 - a bundle that does not import ends the run here, with why
        print("[fi] the bundle does not import:\n" + traceback.format_exc()[-3000:], file=sys.stderr, flush=True)
        return 4
    from tools.bench.w4a8 import CHECK_GEOMS

    g = CHECK_GEOMS[GEOM]
    e, k, h, i = g["experts"], g["top_k"], g["hidden"], g["intermediate"]
    if args.cpu_check:
        plans = fi_plans(args.tokens, 132, e, k, h, i)
        for t, c, plan, spec in plans:
            print(f"[fi cpu-check] T={t} C={c} {plan.block_m}x{plan.block_n} epw {plan.num_experts_per_wave} "
                  f"stages {plan.num_stages} swap {plan.swap_ab} rs {plan.rs_swap_ab}: {spec.name}, sources "
                  f"{[str(s) for s in spec.sources]}", flush=True)
            missing = [str(d) for d in spec.extra_include_dirs if not Path(d).is_dir()]
            if missing:
                print(f"[fi cpu-check] include directories missing: {missing}", flush=True)
                return 4
        return 0
    missing = preflight()
    if missing:
        print(f"[fi] this host cannot build FlashInfer's modules: missing {missing}", file=sys.stderr, flush=True)
        return 3

    import torch
    import torch.distributed as dist

    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    plans = fi_plans(args.tokens, num_sms, e, k, h, i)

    # Ours compile in worker processes while nvcc builds theirs in threads; both time under one GPU lock.
    from tools.bench import w4a8

    ctxm = mp.get_context("spawn")
    lock = ctxm.Lock()
    pool = ProcessPoolExecutor(args.workers, mp_context=ctxm, initializer=w4a8._init_worker, initargs=(lock,))
    ours_futures = [pool.submit(w4a8.run_job, j) for j in our_jobs(args.tokens)]
    error = build_all([p[3] for p in plans], args.build_jobs or len(plans))
    if error is not None:
        print(f"[fi] FlashInfer's build failed:\n{error[-4000:]}", file=sys.stderr, flush=True)
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in list((getattr(pool, "_processes", None) or {}).values()):
            proc.terminate()
        return 5
    print(f"[fi] built in {time.perf_counter() - started:.0f} s", flush=True)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{29000 + os.getpid() % 1000}", rank=0,
                            world_size=1, device_id=device)
    w4a8._W.update(lock=threading.Lock(), bf16={}, kernel_weights={})
    weights = w4a8._expert_weights(GEOM, device)
    theirs = time_theirs(plans, weights, k, device, lock)
    ours: Dict[int, Dict[str, Any]] = {}
    for f in ours_futures:
        r = f.result()
        for row in r.get("rows") or []:
            ours[row["T"]] = row
        if not r.get("ok"):
            print(f"[fi] ours at C{r['capacity']} failed: {r.get('error')}", flush=True)
    pool.shutdown()
    lines = [f"# ours (moe_ep W4A8 MXFP4) / FlashInfer flashinfer.megamoe MXFP4, {torch.cuda.get_device_name(device)}, "
             f"DeepSeek-V3 geometry, world size 1", "",
             "| T | C | ours (us) | FlashInfer (us) | ours / FlashInfer | target <= 0.95 | their plan "
             "| their rel L2 vs fp64 (NaN) |",
             "|" + "---|" * 8]
    records = []
    for r in theirs:
        o = ours.get(r["T"], {})
        if r.get("us") is None:
            lines.append(f"| {r['T']} | {r['capacity']} | {o.get('us', float('nan')):.0f} | failed: {r['error']} "
                         "| - | - | - | - |")
            records.append(dict(r, ours_us=o.get("us")))
            continue
        ratio = o.get("us") / r["us"] if o.get("us") else None
        p = r["plan"]
        verdict = "-" if ratio is None else ("met" if ratio <= 0.95 else "MISSED")
        lines.append(f"| {r['T']} | {r['capacity']} | {o.get('us', float('nan')):.0f} | {r['us']:.0f}"
                     f"{' (eager)' if r['mode'] == 'eager' else ''} | {'-' if ratio is None else f'{ratio:.3f}'} | "
                     f"{verdict} | bm{p['block_m']} bn{p['block_n']} epw{p['num_experts_per_wave']} st"
                     f"{p['num_stages']}{' swap' if p['swap_ab'] else ''}{' rs' if p['rs_swap_ab'] else ''} | "
                     f"{r['rel_l2_vs_fp64']:.4f} ({r['nan']}) |")
        records.append(dict(r, ours_us=o.get("us"), ours_knobs=o.get("knobs"),
                            ours_knob_source=o.get("knob_source"), ratio=ratio))
    text = "\n".join(lines) + "\n"
    (out / "fi_megamoe.md").write_text(text)
    (out / "fi_megamoe.json").write_text(json.dumps(records, indent=1, default=str))
    print(text + f"[fi] done in {time.perf_counter() - started:.0f} s", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
