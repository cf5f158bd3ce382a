"""Peak host memory and time of moe_ep.checkpoint's loader, measured in a fresh child process per load.

    python -m tools.checkpoint.memory --out DIR [--experts 16 --hidden 2048 --intermediate 1024] [--ckpt DIR]

For each case (this rank's share at a world size, the pack on the host or on a GPU) the child imports everything,
opens the checkpoint, then resets its resident-set high-water mark (/proc/self/clear_refs) and loads one layer:
peak = VmHWM after the load - VmRSS before it. tracemalloc would not see torch's storage; VmHWM counts every page
the process touched, anonymous or mapped from the checkpoint's files. The bound the loader promises is this rank's
pack (when it is on the host) plus one expert in bf16. Prints a table; writes memory.json into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from tools.checkpoint import fresh

__all__ = ["measure", "run_case", "main"]


def measure(path: str, layer: int, rank: int = 0, world_size: int = 1, fmt: Optional[str] = None,
            pack_device: str = "cpu", threads: Optional[int] = None) -> Dict:
    """In THIS process (meant to be a fresh one): peak RSS growth while loading one layer's experts. threads: torch's
    intra-op threads (None: its default)."""
    import gc

    import torch

    if threads:
        torch.set_num_threads(threads)

    from moe_ep import checkpoint

    ck = checkpoint.Checkpoint(path)
    plan = ck.plan(layer)
    if pack_device != "cpu":
        torch.empty(1, device=pack_device)  # the CUDA context's host memory is not the loader's
    # One expert first, then dropped: the imports, code pages and allocator arenas a first load touches are the
    # process's, not the layer's (they stay whatever is loaded next).
    warm = ck.load_experts(layer, 0, plan.num_experts, fmt=fmt, device=pack_device, allow_inexact=True)
    del warm
    gc.collect()
    base = fresh.status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    t0 = time.perf_counter()
    loaded = ck.load_experts(layer, rank, world_size, fmt=fmt, device=pack_device, allow_inexact=True)
    if pack_device != "cpu":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = fresh.status_bytes("VmHWM") - base
    w = loaded.weights
    tensors = [getattr(w.qw, n) for n in w.qw.tensor_fields()] if hasattr(w, "qw") else [w.w13, w.w2]
    pack = sum(t.numel() * t.element_size() for t in tensors)
    expert_bf16 = 3 * plan.hidden_size * plan.intermediate_size * 2
    host_pack = pack if pack_device == "cpu" else 0
    return dict(convention=plan.convention.name, fmt=loaded.report.fmt, experts=plan.num_experts,
                world_size=world_size, rank=rank, pack_device=pack_device, pack_MiB=pack / 2 ** 20,
                expert_bf16_MiB=expert_bf16 / 2 ** 20, bound_MiB=(host_pack + expert_bf16) / 2 ** 20,
                peak_MiB=peak / 2 ** 20, within_bound=peak <= host_pack + expert_bf16, seconds=seconds,
                GB_per_s=pack / 1e9 / seconds, exact=loaded.report.exact, report=loaded.report.summary())


def run_case(path: str, layer: int, **kw) -> Dict:
    """measure() in a fresh Python process (so nothing this process holds counts)."""
    result, proc = fresh.call("tools.checkpoint.memory", "measure", dict(path=path, layer=layer, **kw),
                              env=dict(os.environ), timeout_s=1800)
    if result is None:
        raise RuntimeError(f"the measuring process failed (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n"
                           f"{proc.stderr[-4000:]}")
    return result


def table(rows: List[Dict]) -> str:
    head = ("| convention | fmt | world | pack on | pack MiB | 1 expert bf16 MiB | bound MiB | peak MiB | within | s "
            "| GB/s | exact |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        lines.append(f"| {r['convention']} | {r['fmt']} | {r['world_size']} | {r['pack_device']} | "
                     f"{r['pack_MiB']:.1f} | {r['expert_bf16_MiB']:.1f} | {r['bound_MiB']:.1f} | {r['peak_MiB']:.1f} | "
                     f"{'yes' if r['within_bound'] else 'NO'} | {r['seconds']:.2f} | {r['GB_per_s']:.2f} | "
                     f"{'yes' if r['exact'] else 'no'} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "checkpoint_memory_out"))
    ap.add_argument("--ckpt", default=None, help="an existing DeepSeek-convention checkpoint (else one is written)")
    ap.add_argument("--layer", type=int, default=3)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--pack-devices", nargs="+", default=["cpu"])
    a = ap.parse_args(argv)
    from tools.checkpoint.synthetic import write_deepseek_fp8

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="moe_ep_ckpt_") as tmp:
        paths = [a.ckpt] if a.ckpt else []
        for agree in ((False, True) if not a.ckpt else ()):  # real-looking scales, and gate/up scales that agree
            p = os.path.join(tmp, "agree" if agree else "real")
            write_deepseek_fp8(p, layer=a.layer, experts=a.experts, hidden=a.hidden, intermediate=a.intermediate,
                               agree=agree, device="cpu", log=lambda s: None)
            paths.append(p)
        for path in paths:
            rows += [run_case(path, a.layer, world_size=w, pack_device=d) for d in a.pack_devices for w in a.worlds]
    text = table(rows)
    print(text, flush=True)
    (out / "memory.json").write_text(json.dumps(dict(rows=rows, argv=sys.argv[1:]), indent=1))
    (out / "memory.md").write_text(text + "\n")
    return 0 if all(r["within_bound"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
