"""The model matrix on the kernels: every MoE architecture of the installed transformers (moe_ep.testing.hf_matrix,
tiny random models) with its routed experts on each kernel backend at world size 1, against transformers' own
experts and against moe_ep's torch reference in the same format; one process, so each kernel compiles once per
geometry (the tiny models share H 128, I 128, 8 experts). Prints the table docs/models.md holds.

    python3 -m tools.launch.launcher --nproc 1 --device cuda --timeout 390 -- -m tools.bench.model_matrix --out $OUT
    python3 -m tools.bench.model_matrix --device cpu --out DIR      # the same cases on the torch reference (CPU)

--cases backend:fmt ... (default on a GPU: sm90_bf16_cutedsl:bf16 sm90_fp8_cutedsl:fp8_block
sm90_w4a8_mxfp4_cutedsl:w4a8_mxfp4; on the CPU: torch_reference in those formats). Rows go to $OUT/model_matrix.jsonl
as they finish (a run cut short keeps what it measured); the table to model_matrix.md. Rows run reference by
reference, each architecture on every kernel in turn, until --budget-s (300 s: the run and its table fit a
420 s device call); later rows are reported as not run. Bounds: the format's
(hf_models.LOGITS_TOL: bf16 3e-2, FP8 0.15; W4A8 has none yet: 0.15 here, its measured error is the finding)
against transformers, the oracle's per-token rule against the torch reference. Exit status 0 when every row is
served within its bound or refused by name.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

__all__ = ["rank_main", "main"]

GPU_CASES = ("sm90_bf16_cutedsl:bf16", "sm90_fp8_cutedsl:fp8_block", "sm90_w4a8_mxfp4_cutedsl:w4a8_mxfp4")
CPU_CASES = ("torch_reference:bf16", "torch_reference:fp8_block", "torch_reference:w4a8_mxfp4")


def rank_main(out: str, cases: List[str], against: List[str], archs: Optional[List[str]] = None,
              budget_s: float = 300.0) -> List[Dict]:
    """Rank side (one rank): every case x reference x architecture, rows appended to out/model_matrix.jsonl."""
    import torch

    import moe_ep
    from moe_ep.testing import hf_matrix

    torch.set_num_threads(1)
    ctx = moe_ep.init_from_env()
    hf_matrix._quiet()
    t0 = time.perf_counter()
    rows = []
    path = Path(out) / "model_matrix.jsonl"
    refused = {}
    # Reference-major, then architecture, then kernel: a run its budget cuts short keeps whole architectures (every
    # kernel) against the first reference, which is what docs/models.md's table needs first.
    for ref in against:
        for arch, mt, kind in hf_matrix.moe_architectures():
            if archs and arch not in archs:
                continue
            for case in cases:
                backend, fmt = case.split(":")
                if time.perf_counter() - t0 > budget_s:
                    rows.append(dict(arch=arch, backend=backend, fmt=fmt, against=ref, status="not_built",
                                     why="the run's time budget was spent"))
                    continue
                if arch in refused:  # the verdict does not depend on the backend: no device time for it again
                    rows.append(dict(refused[arch], backend=backend, fmt=fmt, against=ref))
                    continue
                t = time.perf_counter()
                row = hf_matrix.check_architecture(arch, mt, kind, backend=backend, fmt=fmt, against=ref)
                row.update(backend=backend, fmt=fmt, against=ref, seconds=round(time.perf_counter() - t, 2),
                           device=str(ctx.device))
                if row["status"] == "refused":
                    refused[arch] = {k: v for k, v in row.items() if k not in ("backend", "fmt", "against")}
                rows.append(row)
                with open(path, "a") as f:
                    f.write(json.dumps(row, default=str) + "\n")
    return rows


def table(rows: List[Dict]) -> str:
    """One line per architecture: its verdict, and per case and reference the logits' relative L2."""
    keys = []
    for r in rows:
        k = (r["backend"], r["fmt"], r["against"])
        if k not in keys:
            keys.append(k)
    head = "| architecture | verdict | " + " | ".join(f"{b} ({f}) vs {a}" for b, f, a in keys) + " |"
    lines = [head, "|" + "---|" * (2 + len(keys))]
    by_arch: Dict[str, Dict] = {}
    for r in rows:
        by_arch.setdefault(r["arch"], {})[(r["backend"], r["fmt"], r["against"])] = r
    for arch, per in by_arch.items():
        first = next(iter(per.values()))
        if first["status"] == "refused":
            lines.append(f"| {arch} | refused: {first.get('why', '')[:90]} |" + " - |" * len(keys))
            continue
        cells = []
        for k in keys:
            r = per.get(k)
            if r is None or r["status"] != "served":
                cells.append("not run" if r is None else f"not checked: {str(r.get('why', ''))[:40]}")
                continue
            p, d = r.get("prefill_rel_logits_err"), r.get("decode_rel_logits_err")
            cells.append(f"{'ok' if r.get('ok') else 'OUT'} {p if p is None else f'{p:.3f}'} / "
                         f"{d if d is None else f'{d:.3f}'} (bound {r.get('logits_tol', 0):.3f}, "
                         f"{(r.get('compared_positions') or 0):.0%} compared, tokens {r.get('matched_tokens')})")
        verdict = "served" if any(r["status"] == "served" for r in per.values()) else "not run"
        lines.append(f"| {arch} | {verdict} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "model_matrix_out"))
    ap.add_argument("--device", default=os.environ.get("MOE_EP_DEVICE", "auto"), choices=("auto", "cpu", "cuda"))
    ap.add_argument("--cases", nargs="+", default=None, help="backend:fmt ...")
    ap.add_argument("--against", nargs="+", default=["transformers", "torch_reference"],
                    choices=("transformers", "torch_reference"))
    ap.add_argument("--archs", nargs="+", default=None)
    ap.add_argument("--budget-s", type=float, default=300.0,
                    help="stop starting new rows after this long (a row already started finishes: a kernel compile "
                         "is the longest, ~40 s)")
    a = ap.parse_args(argv)
    import torch

    device = a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    cases = a.cases or list(GPU_CASES if device == "cuda" else CPU_CASES)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "model_matrix.jsonl").write_text("")
    os.environ.setdefault("MOE_EP_DEVICE", device)
    if "RANK" in os.environ:  # under tools/launch: this process is the rank
        rows = rank_main(str(out), cases, a.against, a.archs, a.budget_s)
    else:
        from tools.launch.launcher import launch_function

        rows = launch_function("tools.bench.model_matrix:rank_main", 1,
                               dict(out=str(out), cases=cases, against=a.against, archs=a.archs,
                                    budget_s=a.budget_s), device=device, timeout_s=a.budget_s + 600)[0]
    from moe_ep.testing.hf_matrix import verdict_problems

    text = table(rows)
    print(text, flush=True)
    (out / "model_matrix.md").write_text(text + "\n")
    bad = [(r["arch"], r["backend"], r["fmt"], r["against"]) for r in rows if verdict_problems(r)]
    print(f"{len(rows)} rows, {len(bad)} not within bound or not checked: {bad[:20]}", flush=True)
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
