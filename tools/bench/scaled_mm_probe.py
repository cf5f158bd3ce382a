"""Which blockwise `torch._scaled_mm` calls this GPU's torch takes, and whether the split path's torch engines run
(issue #36: every T of the first H200 split bench failed with CUBLAS_STATUS_NOT_SUPPORTED). A few seconds, one
Hopper GPU:

    python -m tools.bench.scaled_mm_probe [--out DIR]

1. GEMMs at DeepSeek-V3's expert shapes (FC1 N=4096 K=7168, FC2 N=7168 K=2048), e4m3 operands with 1x128 activation
   scales and 128x128 weight scales: the call the block128 engine made before the fix (an expert's bare row count,
   a fresh column-major scale) at row counts of several alignments, the engine's call now (block_scaled_mm: a
   padded block written in place into a slice of a larger buffer), a scale sliced out of a larger column-major
   tensor, and rowwise / tensorwise scaling at an odd M for contrast. Each: ok or the error's first line, the median
   CUDA-event time, TFLOP/s, and its worst row's relative error against the same operands dequantized into an fp32
   matmul (which says the scales are read the way the engine means them).
2. The Triton kernels of shim/sm90/split_kernels.py against the torch ops they replace, byte for byte, on random
   data with NaN, inf, -0 and clamp edges.
3. Both torch engines end to end at T=512 (32 experts, top-8), kernels="auto" and "torch": ok, time, the two
   outputs equal bit for bit; block128 also against itself with its GEMMs emulated in fp32 (fp8_block_mm).
Prints a table; --out writes scaled_mm_probe.json there. Exit 0 when every expected outcome held.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Dict, List, Optional

import torch

from tools.bench.timing import cuda_time_us

H, I, E, K = 7168, 2048, 32, 8
SHAPES = {"FC1": (2 * I, H), "FC2": (H, I)}  # (N, K)


def _operands(m: int, n: int, k: int, dev, gen):
    """e4m3 a [m, k] with 1x128 scales [m, k/128] (row-major), w [n, k] with 128x128 scales [n/128, k/128]."""
    from moe_ep.formats.codecs import fp8_quantize_blocks_nk, fp8_quantize_rows

    x = torch.randn(m, k, device=dev, generator=gen)
    x = x * torch.exp2(torch.randint(-3, 4, (m, k // 128), device=dev, generator=gen).float()).repeat_interleave(128, 1)
    a, sa = fp8_quantize_rows(x, 128)
    w, sw = fp8_quantize_blocks_nk(torch.randn(n, k, device=dev, generator=gen) / k ** 0.5)
    return a, sa, w, sw


def _dequant_ref(a, sa, w, sw) -> torch.Tensor:
    af = a.float() * sa.repeat_interleave(128, 1)
    wf = w.float() * sw.repeat_interleave(128, 0).repeat_interleave(128, 1)
    return af @ wf.t()


def _row_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    o, r = out.float(), ref.float()
    return float(((o - r).norm(dim=1) / r.norm(dim=1).clamp(min=1e-6)).max())


def _col_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


def gemm_cases(dev, gen, iters: int) -> List[dict]:
    from moe_ep.split.torch_engine import ROW_ALIGN, block_scaled_mm

    rows = []
    for proj, (n, k) in SHAPES.items():
        ms = (1021, 1022, 1020, 1016, 1008, 1024, 16)
        for m in ms:
            a, sa, w, sw = _operands(m, n, k, dev, gen)
            ref = _dequant_ref(a, sa, w, sw)
            rows.append(_case(f"{proj} before the fix: bare M, fresh column-major scale", proj, m, n, k, iters, ref,
                              lambda a=a, sa=sa, w=w, sw=sw: torch._scaled_mm(
                                  a, w.t(), scale_a=_col_major(sa), scale_b=sw.t(), out_dtype=torch.bfloat16),
                              expect=True if m % ROW_ALIGN == 0 else None))
        # The engine's call now: a ROW_ALIGN-padded block at a row offset of a larger buffer, written in place.
        m, at = 1008, 1024
        a, sa, w, sw = _operands(m, n, k, dev, gen)
        big = torch.empty(at + m + 64, n, dtype=torch.bfloat16, device=dev)
        qa = torch.empty(at + m + 64, k, dtype=torch.float8_e4m3fn, device=dev)
        qa[at:at + m] = a
        flat = torch.empty((at + m) * (k // 128), device=dev)
        view = flat[at * (k // 128):].view(k // 128, m).t()
        view.copy_(sa)
        assert view.stride() == (1, m) and m % ROW_ALIGN == 0
        ref = _dequant_ref(a, sa, w, sw)
        rows.append(_case(f"{proj} engine now: block_scaled_mm into an out= slice", proj, m, n, k, iters, ref,
                          lambda: block_scaled_mm(qa[at:at + m], view, w, sw, big[at:at + m]), expect=True))
        # A slice of a larger column-major scale keeps the larger tensor's stride: torch's layout check refuses it.
        sl = _col_major(torch.cat([sa, sa]))[:m]
        rows.append(_case(f"{proj} scale sliced from a larger column-major tensor (stride {sl.stride()})", proj, m, n,
                          k, iters, ref, lambda: torch._scaled_mm(a, w.t(), scale_a=sl, scale_b=sw.t(),
                                                                  out_dtype=torch.bfloat16), expect=False))
        m = 1021
        a, _, w, _ = _operands(m, n, k, dev, gen)
        one = torch.ones((), device=dev)
        rows.append(_case(f"{proj} rowwise scales at M={m}", proj, m, n, k, iters, None,
                          lambda: torch._scaled_mm(a, w.t(), scale_a=torch.ones(m, 1, device=dev),
                                                   scale_b=torch.ones(1, n, device=dev), out_dtype=torch.bfloat16),
                          expect=None))
        rows.append(_case(f"{proj} tensorwise scales at M={m}", proj, m, n, k, iters, None,
                          lambda: torch._scaled_mm(a, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                          expect=None))
    return rows


def _case(what: str, proj: str, m: int, n: int, k: int, iters: int, ref: Optional[torch.Tensor], fn,
          expect: Optional[bool]) -> dict:
    row = dict(case=what, proj=proj, M=m, N=n, K=k, expect={True: "ok", False: "refused", None: "either"}[expect])
    try:
        out = fn()
        torch.cuda.synchronize()
        row["ok"] = True
        row["err_vs_dequant"] = _row_err(out, ref) if ref is not None else None
        us = cuda_time_us(fn, iters=iters, warmup=1)
        row["us"], row["tflops"] = us, 2 * m * n * k / (us * 1e-6) / 1e12
    except Exception as e:  # noqa: BLE001 - what the call raises is the finding
        row["ok"] = False
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    row["as_expected"] = expect is None or row["ok"] == expect
    if row["ok"] and row.get("err_vs_dequant") is not None and row["err_vs_dequant"] > 1e-2:
        row["as_expected"] = False  # runs, but the scales are not read the way the engine means them
    return row


def kernel_cases(dev, gen) -> List[dict]:
    """The Triton kernels against TorchOps, byte for byte."""
    from moe_ep.split.torch_engine import TorchOps, gate_up_blocks, padded_blocks

    try:
        from shim.sm90 import split_kernels as tk
    except ImportError as e:
        return [dict(case="import shim.sm90.split_kernels", ok=False, error=str(e), as_expected=False)]
    rows = []
    sizes = [48, 0, 16, 1024, 32]
    _, padded, m = padded_blocks(sizes)
    starts = [sum(padded[:x]) for x in range(len(padded))]
    expert = torch.repeat_interleave(torch.arange(len(padded), device=dev), torch.tensor(padded, device=dev))
    start_of = torch.tensor(starts, device=dev)[expert]
    size_of = torch.tensor(padded, device=dev)[expert]
    canon = (torch.randn(m, 2 * I, device=dev, generator=gen) * 4).to(torch.bfloat16)
    canon[0, :5] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40])
    canon[1] = 0
    wt = torch.rand(m, device=dev, generator=gen)
    for label, fc1, group, block, clamp, weight in (
            ("swiglu_quant block128 layout, clamp 7, weighted", canon[:, gate_up_blocks(I, dev)], 64, 128, 7.0, wt),
            ("swiglu_quant block128 layout, no clamp, unweighted", canon[:, gate_up_blocks(I, dev)], 64, 128, None,
             None),
            ("swiglu_quant rowwise layout (one scale per row), weighted", canon, I, I, None, wt)):
        nb = I // block
        outs = []
        for ops in (TorchOps, tk):
            q = torch.full((m, I), 0x55, dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn)
            s = torch.full((m * nb,), float("nan"), device=dev)
            if block == 128:
                ops.swiglu_quant(fc1.contiguous(), group, clamp, weight, block, q, s,
                                 start_of * nb + torch.arange(m, device=dev) - start_of, size_of)
            else:
                ops.swiglu_quant(fc1.contiguous(), group, clamp, weight, block, q, s)
            outs.append((q.view(torch.uint8), s))
        (qt, st), (qk, sk) = outs
        diff_q = int((qt != qk).sum())
        diff_s = int(((st.view(torch.int32) != sk.view(torch.int32)) & ~(st.isnan() & sk.isnan())).sum())
        rows.append(dict(case=label, ok=True, q_bytes_differing=diff_q, scales_differing=diff_s,
                         as_expected=diff_q == 0 and diff_s == 0))
    n, width, p = 4096, 8, 20000
    terms = torch.randn(p, H, device=dev, generator=gen).to(torch.bfloat16)
    terms[3, :3] = -0.0
    pos_of = torch.randint(-1, p, (n * width,), device=dev, generator=gen)
    for weighted in (False, True):
        w = torch.rand(n * width, device=dev, generator=gen) if weighted else None
        outs = []
        for ops in (TorchOps, tk):
            out = torch.full((n, H), float("nan"), dtype=torch.bfloat16, device=dev)
            ops.combine(terms, pos_of, width, w, out)
            outs.append(out)
        diff = int((outs[0].view(torch.int16) != outs[1].view(torch.int16)).sum())
        rows.append(dict(case=f"combine width {width}{', weighted' if weighted else ''}", ok=True,
                         elements_differing=diff, as_expected=diff == 0))
    return rows


def engine_cases(dev, gen, iters: int, tokens: int) -> List[dict]:
    import moe_ep
    from moe_ep.core.dist import RankContext
    from moe_ep.formats.codecs import FP8_ACT_BLOCK_K, FP8_WEIGHT_BLOCK, fp8_block_mm
    from moe_ep.split import torch_engine as te

    spec = moe_ep.MoESpec(H, I, E, K, tokens)
    ctx = RankContext.detached(0, 1, dev)
    weights = moe_ep.ExpertWeights(
        w13=(torch.randn(E, 2 * I, H, device=dev, generator=gen) / H ** 0.5).to(torch.bfloat16),
        w2=(torch.randn(E, H, I, device=dev, generator=gen) / I ** 0.5).to(torch.bfloat16),
        rank=0, world_size=1, num_experts=E)
    x = torch.randn(tokens, H, device=dev, generator=gen).to(torch.bfloat16)
    ids = torch.rand(tokens, E, device=dev, generator=gen).argsort(dim=1)[:, :K].to(torch.int32)
    ids[::7, 3] = -1
    w = torch.softmax(torch.randn(tokens, K, device=dev, generator=gen), dim=-1)
    rows = []
    for cls in (te.ScaledMMEngine, te.GroupedRowwiseEngine):
        outs = {}
        for kernels in ("auto", "torch"):
            row = dict(case=f"{cls.name} T={tokens} kernels={kernels}")
            try:
                eng = cls(spec, ctx, "fp8_block", kernels=kernels)
                eng.prepare_weights(weights)
                row["kernels"] = eng.kernels
                out = torch.full((tokens, H), float("nan"), dtype=torch.bfloat16, device=dev)
                rows_in = eng.quantize(x) if eng.takes_quantized else x
                eng.forward(rows_in, ids, w, out)
                torch.cuda.synchronize()
                row["ok"] = bool(torch.isfinite(out.float()).all())
                row["us"] = cuda_time_us(lambda: eng.forward(rows_in, ids, w, out), iters=iters, warmup=1)
                outs[kernels] = out.clone()
                if cls is te.ScaledMMEngine and kernels == "torch":
                    real = te.block_scaled_mm

                    def emulated(a, a_scale, wq, w_scale, o):
                        r = torch.arange(wq.shape[0], device=dev) // FP8_WEIGHT_BLOCK
                        return o.copy_(fp8_block_mm(a, a_scale, FP8_ACT_BLOCK_K, wq, w_scale, r))
                    te.block_scaled_mm = emulated
                    try:
                        emu = torch.empty_like(out)
                        eng.forward(rows_in, ids, w, emu)
                    finally:
                        te.block_scaled_mm = real
                    row["err_vs_fp32_gemms"] = _row_err(out, emu)
                    row["ok"] = row["ok"] and row["err_vs_fp32_gemms"] < 2e-2
                eng.close()
            except Exception as e:  # noqa: BLE001
                row["ok"] = False
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            row["as_expected"] = row["ok"]
            rows.append(row)
        if len(outs) == 2:
            same = bool(torch.equal(outs["auto"], outs["torch"]))
            rows.append(dict(case=f"{cls.name}: kernels=auto output == torch ops output, bit for bit", ok=same,
                             as_expected=same))
    return rows


def _cublaslt_version() -> Optional[int]:
    """cublasLtGetVersion() of the library torch loaded (None where it cannot be found by name)."""
    import ctypes

    torch.zeros(1, device="cuda") @ torch.zeros(1, 1, device="cuda")  # cuBLAS loaded
    for lib in ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"):
        try:
            f = ctypes.CDLL(lib).cublasLtGetVersion
        except OSError:
            continue
        f.restype = ctypes.c_size_t
        return int(f())
    return None


def _fmt(r: dict) -> str:
    parts = [("ok" if r.get("ok") else "FAIL"), ("" if r.get("as_expected") else "UNEXPECTED")]
    for key in ("M", "us", "tflops", "err_vs_dequant", "err_vs_fp32_gemms", "kernels", "q_bytes_differing",
                "scales_differing", "elements_differing", "error"):
        v = r.get(key)
        if v is None:
            continue
        parts.append(f"{key}={v:.4g}" if isinstance(v, float) else f"{key}={v}")
    return f"{r['case']}: " + " ".join(p for p in parts if p)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT"))
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--tokens", type=int, default=512, help="the engines' T (section 3)")
    args = p.parse_args(argv)
    from tools.require import require

    require(device="cuda", first=0, arch="sm90", argument=None, arch_argument=None)
    t0 = time.perf_counter()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    gen = torch.Generator(device=dev).manual_seed(36)
    facts: Dict[str, object] = dict(torch=torch.__version__, cuda=torch.version.cuda,
                                    device=torch.cuda.get_device_name(dev), cublaslt=_cublaslt_version())
    try:
        import triton

        facts["triton"] = triton.__version__
    except ImportError as e:
        facts["triton"] = f"not importable ({e})"
    print(" ".join(f"{k}={v}" for k, v in facts.items()), flush=True)
    sections = {}
    for name, fn in (("gemms", lambda: gemm_cases(dev, gen, args.iters)), ("kernels", lambda: kernel_cases(dev, gen)),
                     ("engines", lambda: engine_cases(dev, gen, args.iters, args.tokens))):
        print(f"-- {name}", flush=True)
        rows = sections[name] = fn()
        for r in rows:
            print(_fmt(r), flush=True)
    bad = [r["case"] for rows in sections.values() for r in rows if not r.get("as_expected")]
    print(f"done in {time.perf_counter() - t0:.1f} s; " + ("every outcome as expected" if not bad else
                                                            f"unexpected: {bad}"))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "scaled_mm_probe.json"), "w") as f:
            json.dump(dict(facts=facts, **sections, unexpected=bad), f, indent=1, default=str)
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
