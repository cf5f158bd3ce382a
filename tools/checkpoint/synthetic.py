"""A DeepSeek-V3-convention FP8 checkpoint of any size, written shard by shard (never whole in memory): per expert
`model.layers.<L>.mlp.experts.<e>.{gate,up,down}_proj.weight` (e4m3 [N, K]) and `.weight_scale_inv` (fp32
[N/128, K/128], the dequant multiplier), quantized from Gaussian weights the way DeepSeek's own FP8 checkpoints
are (each 128x128 block over amax / 448), plus a dense layer 0 and a router, index and config.json.

agree=True gives up the same block scales as gate (re-rounding up's codes at write time): the case moe_ep's
fp8_block holds bit for bit. agree=False (the default) is what real checkpoints look like: gate and up scales
differ in (almost) every block.

    python -m tools.checkpoint.synthetic DIR [--experts 32 --hidden 7168 --intermediate 2048 --agree]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import List, Optional

import torch

__all__ = ["write_deepseek_fp8"]

_MAX = 448.0


def _quantize(w: torch.Tensor, scale: Optional[torch.Tensor] = None):
    """[N, K] -> (e4m3, fp32 [N/128, K/128]) with scale = amax / 448 per 128x128 block, or the given scales."""
    n, k = w.shape
    blocks = w.float().reshape(n // 128, 128, k // 128, 128)
    if scale is None:
        scale = (blocks.abs().amax(dim=(1, 3)) / _MAX).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).clamp(-_MAX, _MAX).reshape(n, k).to(torch.float8_e4m3fn)
    return q, scale.float()


def write_deepseek_fp8(root, *, layer: int = 3, experts: int = 32, hidden: int = 7168, intermediate: int = 2048,
                       experts_per_shard: int = 4, agree: bool = False, seed: int = 0, device=None,
                       log=print) -> dict:
    """Write the checkpoint into directory `root`; returns its description (also root/synthetic.json)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    g = torch.Generator(device=dev).manual_seed(seed)
    h, i = hidden, intermediate
    stem = f"model.layers.{layer}.mlp.experts"
    shards = math.ceil(experts / experts_per_shard) + 1
    weight_map = {}
    t0 = time.perf_counter()

    def save(index: int, tensors: dict) -> None:
        name = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(root / name))
        weight_map.update(dict.fromkeys(tensors, name))

    save(0, {"model.embed_tokens.weight": torch.randn(1024, h, device=dev, generator=g).bfloat16(),
             "model.layers.0.mlp.gate_proj.weight": torch.randn(i, h, device=dev, generator=g).bfloat16(),
             f"model.layers.{layer}.mlp.gate.weight": torch.randn(experts, h, device=dev, generator=g).bfloat16()})
    for s in range(shards - 1):
        part = {}
        for e in range(s * experts_per_shard, min(experts, (s + 1) * experts_per_shard)):
            gate = torch.randn(i, h, device=dev, generator=g) / h ** 0.5
            up = torch.randn(i, h, device=dev, generator=g) / h ** 0.5
            down = torch.randn(h, i, device=dev, generator=g) / i ** 0.5
            qg, sg = _quantize(gate)
            qu, su = _quantize(up, torch.maximum(sg, _quantize(up)[1]) if agree else None)
            if agree:
                qg, sg = _quantize(gate, su.clone())  # both on the shared (larger) scale
            qd, sd = _quantize(down)
            for proj, q, sc in (("gate_proj", qg, sg), ("up_proj", qu, su), ("down_proj", qd, sd)):
                part[f"{stem}.{e}.{proj}.weight"] = q
                part[f"{stem}.{e}.{proj}.weight_scale_inv"] = sc
        save(s + 1, part)
        log(f"  shard {s + 2}/{shards} written ({time.perf_counter() - t0:.0f} s)")
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    desc = dict(convention="deepseek_fp8", layer=layer, experts=experts, hidden=h, intermediate=i, agree=agree,
                seed=seed, bytes=sum(p.stat().st_size for p in root.glob("*.safetensors")))
    (root / "config.json").write_text(json.dumps({"n_routed_experts": experts, "hidden_size": h,
                                                  "moe_intermediate_size": i,
                                                  "quantization_config": {"quant_method": "fp8",
                                                                          "weight_block_size": [128, 128]}}))
    (root / "synthetic.json").write_text(json.dumps(desc))
    return desc


def existing(root, **want) -> bool:
    """Whether `root` already holds the synthetic checkpoint described by `want` (to reuse it)."""
    try:
        desc = json.loads((Path(root) / "synthetic.json").read_text())
    except (OSError, ValueError):
        return False
    return all(desc.get(k) == v for k, v in want.items())


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root")
    ap.add_argument("--layer", type=int, default=3)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--agree", action="store_true")
    ap.add_argument("--device", default=None)
    a = ap.parse_args(argv)
    print(write_deepseek_fp8(a.root, layer=a.layer, experts=a.experts, hidden=a.hidden, intermediate=a.intermediate,
                             agree=a.agree, device=a.device))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
