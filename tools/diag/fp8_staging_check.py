"""GPU check and benchmark of the fused FP8 activation staging (shim/sm90/fp8_staging.py) against moe_ep's reference
quantizer run by torch on the same GPU: e4m3 bytes and fp32 scale bits, shape by shape, then time.

    python3 tools/diag/fp8_staging_check.py --out DIR      # from the repo root; PYTHONPATH holds the repo root

One run says where any difference comes from. Per shape (T x H, random normal data with every 1x128 block at its
own scale from 1e-6 to 1e4, the edge-case rows of fp8_staging.edge_case_rows mixed in; plus an all-edge case per H):
  fused           the kernel as the frontend would run it: mismatching bytes, scales (+ how many of those are only
                  a NaN's payload / sign, and how many scales are 1 ulp off), writes outside [0, T) x [0, H/128)
  given_ref_scale the kernel's steps 5-7 alone (it reads the reference's scales): bytes that still differ are the
                  division or the encoding, not the scale
  div_scale       the kernel with s = amax / 448 (IEEE) instead of amax * fl32(1/448): how many scales the device's
                  reference computes the other way (expected: about half of them differ here)
  hw_cvt          the kernel with Triton's own fp32 -> e4m3 cast instead of the integer RNE encoding
  vs_sim          kernel against its op-by-op CPU simulation, and the simulation against the GPU reference
                  (NaN-only differences counted apart: across devices a NaN's sign and payload are the platform's)
  ref_cpu         the reference run on the CPU against the reference on the GPU (the oracle's device question)
Then: the kernel inside a CUDA graph, T = 0, and the timing table (CUDA events, median of 50) of the fused kernel
against the torch reference path (fp8_quantize_rows + the two copies stage_activations does) at T = 128, 1024,
4096, H = 7168, with a small launch-shape sweep. Everything lands in DIR/fp8_staging_check.json (DIR: --out, else
$OUT, else the current directory).

Exit status: 0 when the fused kernel's bytes and scale bits equal the reference everywhere, nothing outside the
staged region was written and the graph replay matched; 1 otherwise; 2 when it could not run (no GPU / Triton).
The diagnostic variants (given_ref_scale, div_scale, hw_cvt, ref_cpu) never decide the exit status.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback

import torch

from shim.sm90 import fp8_staging as fs  # needs the repo root on PYTHONPATH (or run under Bazel)
from tools.bench.timing import cuda_time_us

ref = fs._ref
U8 = torch.uint8
TS = (1, 7, 128, 1000, 4096, 8192)
HS = (128, 512, 2048, 4096, 7168)
BENCH_TS = (128, 1024, 4096)
BENCH_H = 7168
TIMED_ITERS = 50  # CUDA-event timings: median of this many calls
SIM_MAX_ELEMS = 1000 * 7168  # CPU simulation / CPU reference only up to this size (time)
SWEEP = [dict(block_m=bm, blocks_per_program=kb, num_warps=nw)
         for bm, kb, nw in ((32, 1, 4), (16, 1, 4), (64, 1, 4), (64, 1, 8), (32, 2, 4), (32, 4, 4), (8, 4, 4),
                            (128, 1, 8))]
N_EXAMPLES = 8


# ---------------------------------------------------------------------------------------------------- inputs
def random_x(t, h, seed, device, edge_rows=None):
    """[t, h] bf16, random normal with every 1x128 block at its own scale (1e-6 .. 1e4), and up to `edge_rows`
    (default t // 2: mostly random rows; small T gets the all-edge case, edge_x) of fp8_staging's edge-case rows
    at random positions. tests/shim/sm90/fp8_staging_gpu_test.py draws its inputs here too."""
    g = torch.Generator().manual_seed(seed)
    nb = h // 128
    scale = torch.pow(10.0, torch.empty(t, nb, 1).uniform_(-6, 4, generator=g))
    x = (torch.randn(t, nb, 128, generator=g) * scale).reshape(t, h).to(torch.bfloat16)
    edge = fs.edge_case_rows(h, seed=seed)
    n = min(t // 2 if edge_rows is None else edge_rows, edge.shape[0])
    if n:
        x[torch.randperm(t, generator=g)[:n]] = edge[:n]
    return x.to(device)


def edge_x(h, device):
    return torch.cat([fs.edge_case_rows(h, seed=s) for s in range(4)]).to(device)  # 64 rows


def buffers(t, h, device):
    """Like the frontend's symmetric buffers: capacity past T, scale columns padded to a multiple of 4; every
    byte starts as a sentinel so stray writes show."""
    nb = h // 128
    q = torch.full((t + 3, h), 0xA5, dtype=U8, device=device)
    s = torch.full((t + 3, (nb + 3) // 4 * 4), -7.0, device=device)
    return q, s


# ----------------------------------------------------------------------------------------------- comparisons
def _nan_code(b):
    return (b & 0x7F) == 0x7F


def compare(got_q, got_s, rq, rs, x=None, examples=False):
    """Counts (and a few examples) of byte and scale-bit differences; got_q/rq uint8 [T, H], got_s/rs fp32 [T, NB]."""
    out = {}
    if got_q is not None:
        d = got_q != rq
        out["q_mismatch"] = int(d.sum())
        out["q_nan_sign_only"] = int((d & _nan_code(got_q) & _nan_code(rq)).sum())
    if got_s is not None:
        gb, rb = got_s.contiguous().view(torch.int32), rs.contiguous().view(torch.int32)
        d = gb != rb
        both_nan = torch.isnan(got_s) & torch.isnan(rs)
        out["s_mismatch"] = int(d.sum())
        out["s_nan_payload_only"] = int((d & both_nan).sum())
        out["s_one_ulp"] = int((d & ~both_nan & ((gb.long() - rb.long()).abs() == 1)).sum())
    if examples and x is not None and got_q is not None and out.get("q_mismatch"):
        out["examples"] = q_examples(got_q, got_s, rq, rs, x)
    if examples and x is not None and got_s is not None and out.get("s_mismatch"):
        out["scale_examples"] = s_examples(got_s, rs, x)
    return out


def q_examples(got_q, got_s, rq, rs, x):
    rows = []
    idx = (got_q != rq).nonzero()[:N_EXAMPLES].tolist()
    for r, c in idx:
        b = c // 128
        xv = float(x[r, c].float())
        s_ref = float(rs[r, b])
        rows.append(dict(row=r, col=c, x=xv, x_bits=hex(int(x[r, c].view(torch.int16)) & 0xFFFF),
                         ref_byte=hex(int(rq[r, c])), got_byte=hex(int(got_q[r, c])),
                         ref_value=float(rq[r:r + 1, c:c + 1].view(torch.float8_e4m3fn).float()),
                         got_value=float(got_q[r:r + 1, c:c + 1].view(torch.float8_e4m3fn).float()),
                         ref_scale=s_ref, got_scale=None if got_s is None else float(got_s[r, b]),
                         y_exact=(xv / s_ref) if s_ref else None))
    return rows


def s_examples(got_s, rs, x):
    rows = []
    diff = got_s.contiguous().view(torch.int32) != rs.contiguous().view(torch.int32)
    for r, b in diff.nonzero()[:N_EXAMPLES].tolist():
        amax = float(x[r, b * 128:(b + 1) * 128].float().abs().max())
        rows.append(dict(row=r, block=b, amax=amax, ref_scale=float(rs[r, b]), got_scale=float(got_s[r, b]),
                         ref_bits=hex(int(rs[r, b].view(torch.int32)) & 0xFFFFFFFF),
                         got_bits=hex(int(got_s[r, b].view(torch.int32)) & 0xFFFFFFFF),
                         amax_div_448=float(torch.tensor(amax) / 448.0),
                         amax_times_rcp=float(torch.tensor(amax) * fs.RCP_E4M3_MAX)))
    return rows


def stray_writes(q, s, t, h):
    nb = h // 128
    return int((q[t:] != 0xA5).sum()) + int((s[t:] != -7.0).sum()) + int((s[:, nb:] != -7.0).sum())


def diagnose(case):
    f = case.get("fused", {})
    if "error" in f:
        return "fused kernel failed to run: " + f["error"].splitlines()[-1]
    words = []
    if f.get("s_mismatch"):
        words.append("scale step (amax / scale op / floor) differs")
    g = case.get("given_ref_scale", {})
    if g.get("q_mismatch"):
        words.append("division or encoding (steps 5-7) differs even with the reference scale")
    elif f.get("q_mismatch"):
        words.append("bytes differ only through the scale")
    sim = case.get("vs_sim", {})
    if sim.get("kernel_q_mismatch") or sim.get("kernel_s_mismatch"):
        words.append("kernel differs from its CPU simulation (lowering)")
    if sim.get("sim_vs_ref_q_mismatch") or sim.get("sim_vs_ref_s_mismatch"):
        words.append("simulation differs from the GPU reference (op order)")
    if f.get("stray_writes"):
        words.append("writes outside the staged region")
    return "; ".join(words) or "ok"


# ------------------------------------------------------------------------------------------------ one case
def run_case(name, x, with_sim):
    t, h = x.shape
    nb = h // 128
    dev = x.device
    case = dict(case=name, T=t, H=h)
    rq, rs = ref.fp8_quantize_rows(x, 128, reciprocal=False)
    rq = rq.view(U8)

    q, s = buffers(t, h, dev)
    try:
        fs.stage_fp8_blocks(x, q, s, backend="triton")
        torch.cuda.synchronize()
        case["fused"] = compare(q[:t], s[:t, :nb], rq, rs, x, examples=True)
        case["fused"]["stray_writes"] = stray_writes(q, s, t, h)
    except Exception:
        case["fused"] = dict(error=traceback.format_exc())

    def variant(key, **kw):
        q2, s2 = buffers(t, h, dev)
        try:
            if kw.get("scale_in"):
                s2[:t, :nb] = rs
            fs.launch_fused(x, q2, s2, **kw)
            torch.cuda.synchronize()
            case[key] = compare(q2[:t], None if kw.get("scale_in") else s2[:t, :nb], rq, rs, x,
                                examples=key == "given_ref_scale")
        except Exception as e:
            case[key] = dict(error=f"{type(e).__name__}: {e}"[:2000])

    variant("given_ref_scale", scale_in=True)
    variant("div_scale", scale_by_reciprocal=False)
    variant("hw_cvt", hw_cvt=True)

    if with_sim:
        xc = x.cpu()
        sq, ss = fs.simulate_fused(xc)
        rqc, rsc = rq.cpu(), rs.cpu()
        sim = {}
        # across devices a NaN's sign / payload is the platform's (x86 division returns an operand NaN, the GPU
        # its own): only the differences that are not NaN-only count here
        if "error" not in case["fused"]:
            k = compare(q[:t].cpu(), s[:t, :nb].cpu(), sq, ss)
            sim["kernel_q_mismatch"] = k["q_mismatch"] - k["q_nan_sign_only"]
            sim["kernel_s_mismatch"] = k["s_mismatch"] - k["s_nan_payload_only"]
            sim["kernel_nan_only"] = k["q_nan_sign_only"] + k["s_nan_payload_only"]
        r = compare(sq, ss, rqc, rsc)
        sim["sim_vs_ref_q_mismatch"] = r["q_mismatch"] - r["q_nan_sign_only"]
        sim["sim_vs_ref_s_mismatch"] = r["s_mismatch"] - r["s_nan_payload_only"]
        sim["sim_vs_ref_nan_only"] = r["q_nan_sign_only"] + r["s_nan_payload_only"]
        case["vs_sim"] = sim
        cq, cs = ref.fp8_quantize_rows(xc, 128, reciprocal=False)
        case["ref_cpu"] = compare(cq.view(U8), cs, rqc, rsc)
    case["diagnosis"] = diagnose(case)
    return case


def failed(case):
    f = case.get("fused", {})
    return bool("error" in f or f.get("q_mismatch") or f.get("s_mismatch") or f.get("stray_writes"))


# -------------------------------------------------------------------------------------------- graph and T=0
def graph_check(device):
    out = {}
    try:
        t, h = 1024, BENCH_H
        x = random_x(t, h, 101, device)
        q, s = buffers(t, h, device)
        fs.stage_fp8_blocks(x, q, s, backend="triton")
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(device)
        fs.stage_fp8_blocks(x, q, s, backend="triton")
        torch.cuda.synchronize()
        out["allocated_bytes_per_call"] = torch.cuda.memory_allocated(device) - before
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fs.stage_fp8_blocks(x, q, s, backend="triton")
        x.copy_(random_x(t, h, 102, device))
        q[:t].fill_(0)
        graph.replay()
        torch.cuda.synchronize()
        rq, rs = ref.fp8_quantize_rows(x, 128)
        out.update(compare(q[:t], s[:t, :h // 128], rq.view(U8), rs))
        out["stray_writes"] = stray_writes(q, s, t, h)
        out["ok"] = not (out["q_mismatch"] or out["s_mismatch"] or out["stray_writes"])
    except Exception:
        out = dict(ok=False, error=traceback.format_exc())
    try:
        q, s = buffers(4, 256, device)
        fs.stage_fp8_blocks(torch.empty(0, 256, dtype=torch.bfloat16, device=device), q, s, backend="triton")
        torch.cuda.synchronize()
        out["t0_untouched"] = bool((q == 0xA5).all() and (s == -7.0).all())
    except Exception:
        out["t0_untouched"] = False
        out["t0_error"] = traceback.format_exc()
    return out


# ------------------------------------------------------------------------------------------------- timing
def host_us(fn, n=200):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def bench(device):
    rows = []
    flush = torch.empty(256 << 20, dtype=U8, device=device)  # larger than the H200's L2: cold-cache timing
    for t in BENCH_TS:
        h = BENCH_H
        nb = h // 128
        x = random_x(t, h, 7 + t, device)
        q, s = buffers(t, h, device)
        q8 = q.view(torch.float8_e4m3fn)

        def torch_path(x=x, q8=q8, s=s, t=t, nb=nb):  # what stage_activations does today
            rq, rs = ref.fp8_quantize_rows(x, 128, reciprocal=False)
            q8[:t].view(U8).copy_(rq.view(U8))
            s[:t, :nb].copy_(rs)

        def fused(x=x, q8=q8, s=s):
            fs.stage_fp8_blocks(x, q8, s, backend="triton")

        row = dict(T=t, H=h)
        row["torch_ref_us"] = cuda_time_us(torch_path, TIMED_ITERS)
        row["fused_us"] = cuda_time_us(fused, TIMED_ITERS)
        row["torch_ref_cold_us"] = cuda_time_us(torch_path, TIMED_ITERS, flush=flush)
        row["fused_cold_us"] = cuda_time_us(fused, TIMED_ITERS, flush=flush)
        row["fused_host_us"] = host_us(fused)
        moved = t * h * 2 + t * h + t * nb * 4
        row["fused_GBps"] = moved / (row["fused_us"] * 1e-6) / 1e9
        row["fused_cold_GBps"] = moved / (row["fused_cold_us"] * 1e-6) / 1e9
        row["speedup"] = row["torch_ref_us"] / row["fused_us"]
        sweep = []
        for cfg in SWEEP:
            try:
                us = cuda_time_us(lambda x=x, q8=q8, s=s, cfg=cfg: fs.launch_fused(x, q8, s, **cfg), TIMED_ITERS)
                rq, rs = ref.fp8_quantize_rows(x, 128)
                ok = bool(torch.equal(q[:t], rq.view(U8)) and torch.equal(s[:t, :nb].contiguous().view(torch.int32),
                                                                          rs.view(torch.int32)))
                sweep.append(dict(cfg, us=us, bytes_equal=ok))
            except Exception as e:
                sweep.append(dict(cfg, error=f"{type(e).__name__}: {e}"[:500]))
        row["sweep"] = sweep
        good = [c for c in sweep if c.get("bytes_equal")]
        row["best_cfg"] = min(good, key=lambda c: c["us"]) if good else None
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------------- main
def environment():
    env = dict(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda)
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception as e:
        env["triton"] = f"unavailable: {e}"
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name(0)
        env["capability"] = list(torch.cuda.get_device_capability(0))
    env["rcp_e4m3_max"] = fs.RCP_E4M3_MAX
    env["default_config"] = fs.DEFAULT_CONFIG
    return env


def _fmt(v):
    return "-" if v is None else str(v)


def print_case(c):
    f, g, d, hw = c.get("fused", {}), c.get("given_ref_scale", {}), c.get("div_scale", {}), c.get("hw_cvt", {})
    sim, rc = c.get("vs_sim", {}), c.get("ref_cpu", {})

    def cnt(dct, key):
        return "ERR" if "error" in dct else _fmt(dct.get(key))

    print(f"{c['case']:<7} {c['T']:>5} {c['H']:>5} | q {cnt(f, 'q_mismatch'):>6} s {cnt(f, 's_mismatch'):>6} "
          f"(nan-only q {_fmt(f.get('q_nan_sign_only'))} s {_fmt(f.get('s_nan_payload_only'))}) stray "
          f"{_fmt(f.get('stray_writes'))} | refscale q {cnt(g, 'q_mismatch'):>5} | div s {cnt(d, 's_mismatch'):>6} "
          f"q {cnt(d, 'q_mismatch'):>5} | hwcvt q {cnt(hw, 'q_mismatch'):>5} | "
          f"k~sim q {_fmt(sim.get('kernel_q_mismatch'))} s {_fmt(sim.get('kernel_s_mismatch'))} "
          f"sim~ref q {_fmt(sim.get('sim_vs_ref_q_mismatch'))} "
          f"s {_fmt(sim.get('sim_vs_ref_s_mismatch'))} | cpuref s {_fmt(rc.get('s_mismatch'))} "
          f"q {_fmt(rc.get('q_mismatch'))} | {c['diagnosis']}", flush=True)
    for key in ("fused", "given_ref_scale"):
        for ex in c.get(key, {}).get("examples", [])[:3]:
            print(f"        {key} byte: {ex}", flush=True)
    for ex in f.get("scale_examples", [])[:3]:
        print(f"        fused scale: {ex}", flush=True)
    if "error" in f:
        print("        " + f["error"].replace("\n", "\n        "), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or ".", help="directory for fp8_staging_check.json")
    ap.add_argument("--no-bench", action="store_true", help="skip the timing")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "fp8_staging_check.json")
    report = dict(env=environment(), cases=[], graph=None, bench=None)
    print(json.dumps(report["env"]), flush=True)
    if not fs.available():
        report["error"] = f"cannot run: {fs.unavailable_reason()}"
        print(report["error"], flush=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
        return 2
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)

    print("case        T     H | fused: byte / scale mismatches | q given the reference scale | div-scale variant"
          " | hw-cvt variant | kernel vs CPU simulation, simulation vs GPU ref | CPU ref vs GPU ref | diagnosis",
          flush=True)
    for h in HS:
        c = run_case("edge", edge_x(h, device), with_sim=True)
        report["cases"].append(c)
        print_case(c)
        for t in TS:
            x = random_x(t, h, seed=1000 * t + h, device=device)
            c = run_case("random", x, with_sim=t * h <= SIM_MAX_ELEMS)
            report["cases"].append(c)
            print_case(c)
            del x
        torch.cuda.empty_cache()

    report["graph"] = graph_check(device)
    print("cuda graph:", json.dumps({k: v for k, v in report["graph"].items() if "error" not in k}), flush=True)
    if "error" in report["graph"]:
        print(report["graph"]["error"], flush=True)

    if not args.no_bench:
        try:
            report["bench"] = bench(device)
            print(f"\n{'T':>6} {'H':>6} {'torch_ref_us':>13} {'fused_us':>9} {'speedup':>8} {'fused_GBps':>10} "
                  f"{'ref_cold_us':>12} {'fused_cold_us':>14} {'host_us':>8}  best launch shape", flush=True)
            for r in report["bench"]:
                b = r["best_cfg"]
                best = "-" if not b else (f"block_m={b['block_m']} kb={b['blocks_per_program']} "
                                          f"warps={b['num_warps']}: {b['us']:.1f} us")
                print(f"{r['T']:>6} {r['H']:>6} {r['torch_ref_us']:>13.1f} {r['fused_us']:>9.1f} "
                      f"{r['speedup']:>7.1f}x {r['fused_GBps']:>10.0f} {r['torch_ref_cold_us']:>12.1f} "
                      f"{r['fused_cold_us']:>14.1f} {r['fused_host_us']:>8.1f}  {best}", flush=True)
        except Exception:
            report["bench"] = dict(error=traceback.format_exc())
            print(report["bench"]["error"], flush=True)

    bad_cases = [f"{c['case']} T={c['T']} H={c['H']}" for c in report["cases"] if failed(c)]
    graph_ok = bool(report["graph"].get("ok")) and bool(report["graph"].get("t0_untouched"))
    report["verdict"] = dict(byte_exact=not bad_cases, failing_cases=bad_cases, graph_ok=graph_ok)
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(f"\nverdict: {'BYTE-EXACT' if not bad_cases else 'MISMATCH in ' + ', '.join(bad_cases)}; "
          f"cuda graph {'ok' if graph_ok else 'FAILED'}; report: {path}", flush=True)
    return 0 if (not bad_cases and graph_ok) else 1


if __name__ == "__main__":
    sys.exit(main())
