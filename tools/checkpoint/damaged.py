"""Damaged checkpoints through moe_ep.checkpoint's loader: the typed error each gives (its tensor and file), and
the host memory the process holds after the error, measured in a fresh child process per case.

    python -m tools.checkpoint.damaged --out DIR [--experts 8 --hidden 2048 --intermediate 1024]

Each case writes a DeepSeek-convention checkpoint (tools.checkpoint.synthetic; gate and up scales agree, so a
healthy load is exact) and damages it in one place, in the LAST expert the load reads, so the pack is nearly
built when the damage is found. The child loads one expert first (imports, allocator arenas: the process's, not
the load's) and records VmRSS as the baseline; then loads the layer, keeps the error, records VmRSS ("kept": what
the kept error holds; the loader promises nothing read stays), drops the error, collects, records VmRSS again
("dropped"). A pack is `experts` * 6 MiB at the default size: an error that kept it would show tens of MiB.
Prints a table; writes damaged.json into --out. A load that does not fail, or fails with another type, or names
another tensor or file than the damaged one, is a failed row.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

from tools.checkpoint import fresh

__all__ = ["CASES", "damage", "measure", "run_case", "main"]

# case -> (what is damaged, the error type the loader must raise)
CASES = {
    "scale_nan": ("a NaN in the last expert's down_proj.weight_scale_inv", "CheckpointError"),
    "scale_inf": ("an inf in the last expert's down_proj.weight_scale_inv", "CheckpointError"),
    "scale_negative": ("a negative block scale in the last expert's down_proj.weight_scale_inv", "CheckpointError"),
    "code_nan": ("an e4m3 NaN code (0x7f) in the last expert's down_proj.weight", "CheckpointError"),
    "code_nan_ff": ("an e4m3 NaN code (0xff) in the last expert's gate_proj.weight", "CheckpointError"),
    "bad_offsets": ("the data offsets of the last expert's up_proj.weight in its shard's header", "CheckpointError"),
    "truncated": ("the last expert's shard cut short (its last tensors' bytes missing)", "CheckpointError"),
    "bias": ("a down_proj.bias added to the last expert (a tensor the layer would not compute)", "CheckpointError"),
    "duplicate": ("a shard copied under another name and the index removed (every tensor of it twice)",
                  "CheckpointError"),
}


def _last(desc: dict) -> str:
    return f"model.layers.{desc['layer']}.mlp.experts.{desc['experts'] - 1}"


def damage(root: str, case: str, desc: dict) -> Dict[str, str]:
    """Damage the checkpoint at `root`; returns {tensor, file} the loader's error must name."""
    from safetensors.torch import load_file, save_file
    import torch

    root_p = Path(root)
    wm = json.loads((root_p / "model.safetensors.index.json").read_text())["weight_map"]
    last = _last(desc)
    if case in ("scale_nan", "scale_inf", "scale_negative", "code_nan", "code_nan_ff"):
        name = f"{last}.gate_proj.weight" if case == "code_nan_ff" else (
            f"{last}.down_proj.weight" if case == "code_nan" else f"{last}.down_proj.weight_scale_inv")
        file = root_p / wm[name]
        tensors = load_file(str(file))
        t = tensors[name].clone()
        if case.startswith("code"):
            t.view(torch.uint8).view(-1)[t.numel() // 2] = 0x7F if case == "code_nan" else 0xFF
        else:
            t.view(-1)[-1] = {"scale_nan": float("nan"), "scale_inf": float("inf"), "scale_negative": -1e-3}[case]
        tensors[name] = t
        save_file(tensors, str(file))
        return dict(tensor=name, file=str(file))
    if case == "bias":
        name = f"{last}.down_proj.bias"
        shard = wm[f"{last}.down_proj.weight"]
        file = root_p / shard
        tensors = load_file(str(file))
        tensors[name] = torch.ones(desc["hidden"], dtype=torch.bfloat16)
        save_file(tensors, str(file))
        index = json.loads((root_p / "model.safetensors.index.json").read_text())
        index["weight_map"][name] = shard
        (root_p / "model.safetensors.index.json").write_text(json.dumps(index))
        return dict(tensor=name, file=str(file))
    if case == "bad_offsets":
        name = f"{last}.up_proj.weight"
        file = root_p / wm[name]
        data = bytearray(file.read_bytes())
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + n])
        begin, end = header[name]["data_offsets"]
        header[name]["data_offsets"] = [begin, end - 16]  # 16 bytes short of its shape
        text = json.dumps(header, separators=(",", ":")).encode()
        if len(text) > n:
            raise RuntimeError("the edited header does not fit")
        data[8:8 + n] = text + b" " * (n - len(text))
        file.write_bytes(bytes(data))
        return dict(tensor=name, file=str(file))
    if case == "truncated":
        name = f"{last}.down_proj.weight_scale_inv"
        file = root_p / wm[name]
        data = file.read_bytes()
        file.write_bytes(data[:len(data) - 64])
        # Which tensor a truncated file loses first is the one whose bytes end last in it.
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + n])
        header.pop("__metadata__", None)
        lost = max(header, key=lambda k: header[k]["data_offsets"][1])
        return dict(tensor=lost, file=str(file))
    if case == "duplicate":
        name = f"{last}.gate_proj.weight"
        src = root_p / wm[name]
        copy = root_p / ("zz-copy-of-" + src.name)
        shutil.copyfile(src, copy)
        (root_p / "model.safetensors.index.json").unlink()
        data = copy.read_bytes()
        (n,) = struct.unpack("<Q", data[:8])
        first = next(k for k in json.loads(data[8:8 + n]) if k != "__metadata__")  # the first one seen twice
        return dict(tensor=first, file=str(copy))
    raise ValueError(f"case must be one of {sorted(CASES)}, got {case!r}")


def _rss() -> int:
    """VmRSS after handing freed heap pages back to the OS (glibc keeps them otherwise, and they would read as
    memory still held)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return fresh.status_bytes("VmRSS")


def measure(path: str, layer: int, warm_path: str, threads: int = 1, control: bool = False) -> Dict:
    """In THIS process (a fresh one): the load's error and VmRSS at baseline, with the error kept, and dropped.
    control: load the healthy checkpoint instead and keep the loaded experts (what a kept pack reads as)."""
    import gc

    import torch

    torch.set_num_threads(threads)
    from moe_ep import checkpoint
    from moe_ep.errors import CheckpointError

    # One healthy expert first (imports, code pages, allocator arenas), from an undamaged copy.
    warm_ck = checkpoint.Checkpoint(warm_path)
    warm = warm_ck.load_experts(layer, 0, warm_ck.plan(layer).num_experts)
    del warm, warm_ck
    gc.collect()
    base = _rss()
    kept = []
    try:
        loaded = checkpoint.Checkpoint(path).load_experts(layer)
        if control:
            kept.append(loaded)
        del loaded
    except Exception as e:  # noqa: BLE001 - the point: which error, and what it keeps
        kept.append(e)
    with_error = _rss()
    row = dict(raised=bool(kept) and not control)
    if kept and not control:
        e = kept[0]
        row.update(error=type(e).__name__, tensor=getattr(e, "tensor", None), file=getattr(e, "file", None),
                   message=str(e)[:300], is_checkpoint_error=isinstance(e, CheckpointError))
        del e
    kept.clear()
    dropped = _rss()
    row.update(kept_MiB=(with_error - base) / 2 ** 20, dropped_MiB=(dropped - base) / 2 ** 20)
    return row


def run_case(case: str, tmp: str, *, experts: int, hidden: int, intermediate: int, layer: int = 3,
             healthy: Optional[str] = None) -> Dict:
    """Write (or copy `healthy`), damage, and measure in a fresh process."""
    from tools.checkpoint.synthetic import write_deepseek_fp8

    src = healthy or os.path.join(tmp, "healthy")
    if healthy is None and not os.path.exists(src):
        write_deepseek_fp8(src, layer=layer, experts=experts, hidden=hidden, intermediate=intermediate, agree=True,
                           device="cpu", log=lambda s: None)
    path = os.path.join(tmp, case)
    shutil.copytree(src, path)
    desc = json.loads((Path(path) / "synthetic.json").read_text())
    want = damage(path, case, desc)
    result, proc = fresh.call("tools.checkpoint.damaged", "measure", dict(path=path, layer=layer, warm_path=src),
                              env=dict(os.environ), timeout_s=600)
    if result is None:
        raise RuntimeError(f"the measuring process failed (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n"
                           f"{proc.stderr[-4000:]}")
    pack_mib = experts * 3 * hidden * intermediate / 2 ** 20
    ok = (result["raised"] and result.get("error") == CASES[case][1] and result["is_checkpoint_error"]
          and result.get("tensor") == want["tensor"] and result.get("file") == want["file"]
          and result["kept_MiB"] < KEPT_BOUND * pack_mib and result["dropped_MiB"] < KEPT_BOUND * pack_mib)
    shutil.rmtree(path, ignore_errors=True)
    return dict(case=case, damage=CASES[case][0], want_tensor=want["tensor"], want_file=want["file"],
                pack_MiB=pack_mib, ok=bool(ok), **result)


# What "back to baseline" allows: heap pages malloc_trim cannot return (a fragmented arena) and the warm-up's
# caches, a few MiB; a kept pack (the control row) reads as the whole of it.
KEPT_BOUND = 0.1


def control(tmp: str, *, experts: int, hidden: int, intermediate: int, layer: int = 3) -> Dict:
    """The measurement's own check: a healthy load whose experts are kept must read as the pack."""
    src = os.path.join(tmp, "healthy")
    result, proc = fresh.call("tools.checkpoint.damaged", "measure",
                              dict(path=src, layer=layer, warm_path=src, control=True), env=dict(os.environ),
                              timeout_s=600)
    if result is None:
        raise RuntimeError(f"the measuring process failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    pack_mib = experts * 3 * hidden * intermediate / 2 ** 20
    return dict(case="control: healthy, experts kept", damage="none", want_tensor=None, want_file=None,
                pack_MiB=pack_mib,
                ok=result["kept_MiB"] > 0.8 * pack_mib and result["dropped_MiB"] < KEPT_BOUND * pack_mib,
                error="none (loaded)", **result)


def table(rows: List[Dict]) -> str:
    lines = ["| case | error | names the damaged tensor | and its file | RSS kept over baseline MiB | dropped MiB "
             "| pack MiB | ok |", "|" + "---|" * 8]
    for r in rows:
        named = "-" if r["want_tensor"] is None else (
            "yes" if r.get("tensor") == r["want_tensor"] else "NO: " + str(r.get("tensor")))
        named_file = "-" if r["want_file"] is None else "yes" if r.get("file") == r["want_file"] else "NO"
        lines.append(f"| {r['case']} | {r.get('error', 'none raised')} | {named} | {named_file} | "
                     f"{r['kept_MiB']:.1f} | "
                     f"{r['dropped_MiB']:.1f} | {r['pack_MiB']:.0f} | {'yes' if r['ok'] else 'NO'} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "checkpoint_damaged_out"))
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--cases", nargs="+", default=sorted(CASES))
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="moe_ep_damaged_") as tmp:
        rows = [run_case(c, tmp, experts=a.experts, hidden=a.hidden, intermediate=a.intermediate) for c in a.cases]
        rows.append(control(tmp, experts=a.experts, hidden=a.hidden, intermediate=a.intermediate))
    text = table(rows)
    print(text, flush=True)
    (out / "damaged.json").write_text(json.dumps(dict(rows=rows, argv=sys.argv[1:]), indent=1))
    (out / "damaged.md").write_text(text + "\n")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
