"""On one H200: a DeepSeek-V3-convention FP8 checkpoint with the full layer geometry (H 7168, I 2048, 32 experts,
EP=1; ~1.4 GB, written synthetically into --root) through moe_ep.checkpoint into the sm90 FP8 kernel.

    python3 -m tools.launch.launcher --nproc 1 --device cuda -- -m tools.checkpoint.gpu_load --out $OUT

Two checkpoints: `real` (gate and up quantized on their own 128x128 scales, as DeepSeek's are: the kernel's
fp8_block shares one scale per 64 gate + 64 up rows, so the smaller half of each block is re-rounded, counted)
and `agree` (gate and up written on shared scales: held bit for bit). Each case (--cases, default real:cpu
agree:cpu real:cuda: checkpoint, and where the pack is assembled) runs in a fresh process (nothing earlier
counts), which records:
  * load: seconds and host peak (VmHWM growth after a one-expert warm-up) of Checkpoint.load_experts, against the
    loader's bound (this rank's pack on the host + one expert in bf16);
  * layer: seconds and host peak of MoELayer(...) on the pack (layout, workspace, kernel compile);
  * readback: the kernel's tensors read back (layer.oracle_weights()) against the pack, byte for byte;
  * vs checkpoint: the pack's dequantized values against the checkpoint's own (q * weight_scale_inv, computed here
    from the files): changed values must equal the loader's report (0 for `agree`);
  * forward: T tokens per call, checked against the torch oracle (check_multirank) and against a plain fp32 MoE over
    the checkpoint's dequantized experts (the activation quantization's error, plus the re-rounding for `real`).
Prints a table; writes gpu_load.json and gpu_load.md into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from tools.checkpoint import fresh

__all__ = ["child", "main"]

_GROUP_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _reset_peak() -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return fresh.status_bytes("VmRSS")


def _checkpoint_expert(ck, plan, e: int, dev):
    """Expert e's (w13 [2I, H], w2 [H, I]) fp32 as the checkpoint means them: q * weight_scale_inv per block."""
    import torch

    def deq(proj):
        names = [f"{plan.stem}.{e}.{proj}.weight", f"{plan.stem}.{e}.{proj}.weight_scale_inv"]
        raw = ck.files.read(names)
        q, s = raw[names[0]].to(dev), raw[names[1]].to(dev)
        n, k = q.shape
        return q.float() * s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]

    return torch.cat((deq("gate_proj"), deq("up_proj"))), deq("down_proj")


def _plain_moe(hidden, idx, w, w13, w2):
    """fp32 MoE over dequantized experts, nothing quantized, one batched matmul per expert."""
    import torch

    x = hidden.float()
    out = torch.zeros(x.shape[0], w2.shape[1], device=x.device)
    i = w2.shape[2]
    for e in torch.unique(idx).tolist():
        tok, slot = (idx == e).nonzero(as_tuple=True)
        fc1 = x[tok] @ w13[e].t()
        y = (torch.nn.functional.silu(fc1[:, :i]) * fc1[:, i:]) @ w2[e].t()
        out.index_add_(0, tok, y * w[tok, slot].unsqueeze(1))
    return out


def child(path: str, layer_idx: int, pack_device: str, tokens: List[int], capacity: int,
          backend: str = "sm90_fp8_cutedsl", device: str = "cuda") -> Dict:
    """One fresh process: load, build, check (see the module docstring). World size 1, GPU 0 (device="cpu" with
    the torch reference backend: the same steps on a CPU host, to check this script without a GPU)."""
    import gc

    import torch

    import moe_ep
    from moe_ep import checkpoint
    from moe_ep.core import registry
    from moe_ep.reference.oracle import check_multirank

    moe_ep.init_from_env()
    gpu = device == "cuda"
    dev = torch.device("cuda", 0) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(dev)
    torch.empty(1, device=dev)
    registry.resolve_backend(backend)  # the kernel tree's imports are the process's, not the load's

    def sync():
        if gpu:
            torch.cuda.synchronize()
    ck = checkpoint.Checkpoint(path)
    plan = ck.plan(layer_idx)
    h, i, e = plan.hidden_size, plan.intermediate_size, plan.num_experts
    pdev = torch.device(pack_device)
    warm = ck.load_experts(layer_idx, 0, e, device=pdev, allow_inexact=True)
    del warm
    gc.collect()
    rec: Dict = dict(pack_device=pack_device, experts=e, hidden=h, intermediate=i)

    base = _reset_peak()
    t0 = time.perf_counter()
    loaded = ck.load_experts(layer_idx, 0, 1, device=pdev, allow_inexact=True)
    sync()
    rec["load_s"] = time.perf_counter() - t0
    rec["load_host_peak_MiB"] = (fresh.status_bytes("VmHWM") - base) / 2 ** 20
    qw = loaded.weights.qw
    pack_bytes = sum(getattr(qw, n).numel() * getattr(qw, n).element_size() for n in qw.tensor_fields())
    rec["pack_MiB"] = pack_bytes / 2 ** 20
    rec["load_GB_per_s"] = pack_bytes / 1e9 / rec["load_s"]
    rec["bound_MiB"] = ((pack_bytes if pack_device == "cpu" else 0) + 3 * h * i * 2) / 2 ** 20
    rec["within_bound"] = rec["load_host_peak_MiB"] <= rec["bound_MiB"]
    rep = loaded.report
    rec.update(report=rep.summary(), exact=rep.exact, changed=rep.changed, values=rep.values,
               rescaled_blocks=rep.rescaled_blocks, blocks=rep.blocks, max_abs_err=rep.max_abs_err,
               max_rel_err=rep.max_rel_err)

    spec = moe_ep.MoESpec(h, i, e, 8, capacity)
    base = _reset_peak()
    t0 = time.perf_counter()
    layer = moe_ep.MoELayer(spec, loaded.weights, backend)
    sync()
    rec["layer_s"] = time.perf_counter() - t0
    rec["layer_host_peak_MiB"] = (fresh.status_bytes("VmHWM") - base) / 2 ** 20
    rec["knobs"] = str(getattr(layer.backend, "knobs", None))

    # The kernel's own tensors, read back, against the pack: byte for byte.
    rb = layer.oracle_weights()
    same = True
    for name in qw.tensor_fields():
        a, b = getattr(rb, name), getattr(qw, name)
        for lo in range(0, e, 4):
            x = a[lo:lo + 4].contiguous().view(torch.uint8)
            y = b[lo:lo + 4].to(dev).contiguous().view(torch.uint8)
            same = same and bool(torch.equal(x, y))
    rec["readback_byte_exact"] = same
    del rb

    # The pack against the checkpoint's own dequantized values, expert by expert; keep them for the plain MoE.
    changed, max_abs = 0, 0.0
    w13_all = torch.empty(e, 2 * i, h, device=dev)
    w2_all = torch.empty(e, h, i, device=dev)
    for x in range(e):
        ref13, ref2 = _checkpoint_expert(ck, plan, x, dev)
        got13, got2 = qw.experts(slice(x, x + 1)).to(dev).dequantize()
        for got, ref in ((got13[0], ref13), (got2[0], ref2)):
            d = (got - ref).abs()
            changed += int(torch.count_nonzero(d))
            max_abs = max(max_abs, float(d.max()))
        w13_all[x], w2_all[x] = ref13, ref2
    rec.update(vs_checkpoint_changed=changed, vs_checkpoint_max_abs=max_abs,
               report_matches=changed == rep.changed)

    runs = []
    g = torch.Generator(device=dev).manual_seed(0)
    for t in tokens:
        hidden = torch.randn(t, h, device=dev, generator=g).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(e, device=dev, generator=g)[:8] for _ in range(t)])
        w = torch.softmax(torch.randn(t, 8, device=dev, generator=g), dim=-1)
        out = torch.full_like(hidden, float("nan"))
        layer(hidden, idx, w, out=out)
        sync()
        orc = check_multirank(layer, hidden, idx, w, out, raise_on_failure=False)
        plain = _plain_moe(hidden, idx, w, w13_all, w2_all)
        rel = ((out.float() - plain).norm(dim=-1) / plain.norm(dim=-1).clamp(min=1e-6)).max()
        runs.append(dict(tokens=t, oracle_ok=orc.ok, oracle_err=orc.mine(0).max_row_rel_err,
                         oracle=orc.summary(), plain_rel_err=float(rel), nan=int(torch.isnan(out.float()).sum())))
    rec["forward"] = runs
    rec["device_peak_GiB"] = torch.cuda.max_memory_allocated() / 2 ** 30 if gpu else 0.0
    layer.close()
    return rec


def _run_child(**kw) -> Dict:
    env = {k: v for k, v in os.environ.items() if k not in _GROUP_ENV}  # a group of its own (world size 1)
    env["MOE_EP_DEVICE"] = kw.get("device", "cuda")
    result, proc = fresh.call("tools.checkpoint.gpu_load", "child", kw, env=env, timeout_s=3000)
    if result is not None:
        return result
    return dict(error=f"rc {proc.returncode}", stdout=proc.stdout[-3000:], stderr=proc.stderr[-6000:], **kw)


def table(rows: List[Dict]) -> str:
    lines = ["| checkpoint | pack on | load s | GB/s | host peak MiB | bound MiB | within | layer s | layer host MiB "
             "| readback exact | changed (report) | max abs err | oracle T: err | plain T: err |",
             "|" + "---|" * 14]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r.get('variant')} | {r.get('pack_device')} | FAILED: {r['error']} |" + " |" * 11)
            continue
        orc = ", ".join(f"{f['tokens']}: {f['oracle_err']:.1e}{'' if f['oracle_ok'] else ' FAIL'}"
                        for f in r["forward"])
        pl = ", ".join(f"{f['tokens']}: {f['plain_rel_err']:.3f}" for f in r["forward"])
        lines.append(f"| {r['variant']} | {r['pack_device']} | {r['load_s']:.1f} | {r['load_GB_per_s']:.2f} | "
                     f"{r['load_host_peak_MiB']:.0f} | {r['bound_MiB']:.0f} | {'yes' if r['within_bound'] else 'NO'} "
                     f"| {r['layer_s']:.1f} | {r['layer_host_peak_MiB']:.0f} | "
                     f"{'yes' if r['readback_byte_exact'] else 'NO'} | {r['vs_checkpoint_changed']} "
                     f"({r['changed']}{'' if r['report_matches'] else ' MISMATCH'}) of {r['values']} | "
                     f"{r['vs_checkpoint_max_abs']:.3g} | {orc} | {pl} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_load_out"))
    ap.add_argument("--root", default="/tmp/moe_ep_ckpt_dsv3")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 128, 512])
    ap.add_argument("--cases", nargs="+", default=["real:cpu", "agree:cpu", "real:cuda"],
                    help="checkpoint:pack-device pairs; checkpoint real | agree, pack device cpu | cuda")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="the same steps through the torch reference backend on a CPU host (use a small geometry)")
    a = ap.parse_args(argv)
    import torch

    run_on = dict(backend="torch_reference", device="cpu") if a.cpu_dry_run else {}
    cases = [tuple(c.split(":")) for c in a.cases]
    if any(len(c) != 2 or c[0] not in ("real", "agree") or c[1] not in ("cpu", "cuda") for c in cases):
        ap.error(f"--cases takes real|agree:cpu|cuda pairs, got {a.cases}")
    if a.cpu_dry_run:
        cases = [(v, "cpu") for v in dict.fromkeys(v for v, _ in cases)]
    elif not torch.cuda.is_available():
        print("tools.checkpoint.gpu_load needs a CUDA GPU (an H200)", flush=True)
        return 2
    from tools.checkpoint.synthetic import existing, write_deepseek_fp8

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, writes = [], {}
    for variant, pack_device in cases:
        root = f"{a.root}_{variant}"
        geom = dict(experts=a.experts, hidden=a.hidden, intermediate=a.intermediate, agree=variant == "agree")
        if not existing(root, **geom):
            t0 = time.perf_counter()
            desc = write_deepseek_fp8(root, layer=3, **geom, device=run_on.get("device"),
                                      log=lambda s: print(s, flush=True))
            writes[variant] = dict(seconds=time.perf_counter() - t0, bytes=desc["bytes"])
            print(f"wrote {root}: {desc['bytes'] / 1e9:.2f} GB in {writes[variant]['seconds']:.0f} s", flush=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        print(f"-- {variant}, pack on {pack_device}", flush=True)
        t0 = time.perf_counter()
        r = _run_child(path=root, layer_idx=3, pack_device=pack_device, tokens=a.tokens, capacity=max(a.tokens),
                       **run_on)
        r.update(variant=variant, child_s=time.perf_counter() - t0)
        rows.append(r)
        print(json.dumps({k: v for k, v in r.items() if k not in ("forward", "stdout", "stderr")}), flush=True)
        if "error" in r:
            print(r.get("stderr", ""), flush=True)
    text = table(rows)
    print(text, flush=True)
    (out / "gpu_load.json").write_text(json.dumps(dict(rows=rows, writes=writes, argv=sys.argv[1:]), indent=1))
    (out / "gpu_load.md").write_text(text + "\n")
    ok = all("error" not in r and r["within_bound"] and r["readback_byte_exact"] and r["report_matches"]
             and all(f["oracle_ok"] and f["nan"] == 0 for f in r["forward"]) for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
