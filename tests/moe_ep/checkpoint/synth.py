"""Small synthetic checkpoints in each convention moe_ep reads, written with safetensors: the real tensor names,
dtypes and layouts, random values, nothing downloaded. Also the plain-torch dequantization of each, written here
from the conventions' own definitions and independent of moe_ep's codecs (the tests' second opinion)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Dict, Optional, Sequence

import torch

__all__ = ["write", "dequantized", "FP4", "CONVENTIONS"]

CONVENTIONS = ("deepseek_fp8", "modelopt_fp8", "modelopt_nvfp4", "gpt_oss_mxfp4", "hf_bf16", "mixtral_bf16",
               "hf_fused_bf16")
# e2m1 by code: bit 3 sign, bits 0-2 index into the magnitudes (the OCP MX spec's table).
FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _e4m3_codes(g, shape):
    """e4m3 codes as a quantizer leaves them: Gaussian over the range (|q| <= 448), a few at the extremes."""
    return (torch.randn(shape, generator=g) * 112).clamp(-448, 448).to(torch.float8_e4m3fn)


def _positive_e4m3(g, shape):
    """Positive e4m3 block scales around 1 (codes 0x30..0x47: 0.5 .. 3.75), as NVFP4 quantizers leave them."""
    return torch.randint(0x30, 0x48, shape, generator=g, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)


def _scales(g, shape, lo=-12.0, hi=-9.0):
    return torch.exp2(torch.empty(shape).uniform_(lo, hi, generator=g)).to(torch.float32)


def _experts(stem, e, fn):
    out = {}
    for x in range(e):
        out.update({f"{stem}.{x}.{k}": v for k, v in fn(x).items()})
    return out


def tensors(convention: str, *, layers: Sequence[int] = (1,), e: int = 4, h: int = 256, i: int = 128,
            seed: int = 0, agree: bool = False, pow2: bool = False) -> Dict[str, torch.Tensor]:
    """Every tensor of a checkpoint with MoE `layers` (plus a dense layer 0 and non-expert tensors). agree: gate
    and up share their scales (what moe_ep's one-scale-for-both formats can hold exactly). pow2: power-of-two
    scales (DeepSeek's block scales, NVFP4's weight_scale_2)."""
    g = torch.Generator().manual_seed(seed)
    t: Dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(32, h, generator=g).bfloat16(),
                                  "model.layers.0.mlp.gate_proj.weight": torch.randn(i, h, generator=g).bfloat16()}
    for layer in layers:
        block = "block_sparse_moe" if convention == "mixtral_bf16" else "mlp"
        stem = f"model.layers.{layer}.{block}.experts"
        t[f"model.layers.{layer}.{block}.gate.weight"] = torch.randn(e, h, generator=g).bfloat16()
        t[f"model.layers.{layer}.self_attn.q_proj.weight"] = torch.randn(h, h, generator=g).bfloat16()
        if convention == "deepseek_fp8":
            t[f"model.layers.{layer}.mlp.shared_experts.gate_proj.weight"] = _e4m3_codes(g, (i, h))

            def sc(shape):
                s = _scales(g, shape)
                return torch.exp2(torch.round(torch.log2(s))) if pow2 else s

            def fn(x):
                gs = sc((math.ceil(i / 128), math.ceil(h / 128)))
                us = gs.clone() if agree else sc(gs.shape)
                return {"gate_proj.weight": _e4m3_codes(g, (i, h)), "gate_proj.weight_scale_inv": gs,
                        "up_proj.weight": _e4m3_codes(g, (i, h)), "up_proj.weight_scale_inv": us,
                        "down_proj.weight": _e4m3_codes(g, (h, i)),
                        "down_proj.weight_scale_inv": sc((math.ceil(h / 128), math.ceil(i / 128)))}
        elif convention == "modelopt_fp8":
            def fn(x):
                gs = _scales(g, ())
                return {"gate_proj.weight": _e4m3_codes(g, (i, h)), "gate_proj.weight_scale": gs,
                        "gate_proj.input_scale": _scales(g, (), -6.5, -5.5),
                        "up_proj.weight": _e4m3_codes(g, (i, h)),
                        "up_proj.weight_scale": gs.clone() if agree else _scales(g, ()),
                        "up_proj.input_scale": _scales(g, (), -6.5, -5.5),
                        "down_proj.weight": _e4m3_codes(g, (h, i)), "down_proj.weight_scale": _scales(g, ()),
                        "down_proj.input_scale": _scales(g, (), -4, -3)}
        elif convention == "modelopt_nvfp4":
            def fn(x):
                out = {}
                for proj, n, k in (("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)):
                    out[f"{proj}.weight"] = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.int32).to(
                        torch.uint8)
                    out[f"{proj}.weight_scale"] = _positive_e4m3(g, (n, k // 16))
                    out[f"{proj}.weight_scale_2"] = (torch.exp2(torch.randint(-7, -4, (), generator=g).float()) if pow2
                                                     else _scales(g, (), -7, -5))
                    out[f"{proj}.input_scale"] = _scales(g, (), -9.5, -8.5) if proj != "down_proj" else _scales(
                        g, (), -7, -6)
                if agree:
                    out["up_proj.weight_scale_2"] = out["gate_proj.weight_scale_2"].clone()
                return out
        elif convention == "gpt_oss_mxfp4":
            def rand_u8(shape, lo=0, hi=256):
                return torch.randint(lo, hi, shape, generator=g, dtype=torch.int32).to(torch.uint8)

            t[f"{stem}.gate_up_proj_blocks"] = rand_u8((e, 2 * i, h // 32, 16))
            t[f"{stem}.gate_up_proj_scales"] = rand_u8((e, 2 * i, h // 32), 120, 125)
            t[f"{stem}.gate_up_proj_bias"] = torch.randn(e, 2 * i, generator=g).bfloat16()
            t[f"{stem}.down_proj_blocks"] = rand_u8((e, h, i // 32, 16))
            t[f"{stem}.down_proj_scales"] = rand_u8((e, h, i // 32), 120, 125)
            t[f"{stem}.down_proj_bias"] = torch.randn(e, h, generator=g).bfloat16()
            t[f"model.layers.{layer}.mlp.router.weight"] = t.pop(f"model.layers.{layer}.mlp.gate.weight")
            continue
        elif convention == "hf_fused_bf16":
            t[f"{stem}.gate_up_proj"] = (torch.randn(e, 2 * i, h, generator=g) / 16).bfloat16()
            t[f"{stem}.down_proj"] = (torch.randn(e, h, i, generator=g) / 16).bfloat16()
            continue
        else:  # hf_bf16 / mixtral_bf16
            names = ("w1", "w3", "w2") if convention == "mixtral_bf16" else ("gate_proj", "up_proj", "down_proj")

            def fn(x):
                return {f"{names[0]}.weight": (torch.randn(i, h, generator=g) / 16).bfloat16(),
                        f"{names[1]}.weight": (torch.randn(i, h, generator=g) / 16).bfloat16(),
                        f"{names[2]}.weight": (torch.randn(h, i, generator=g) / 16).bfloat16()}
        t.update(_experts(stem, e, fn))
    return t


def write(root, convention: str, *, shards: int = 3, layers: Sequence[int] = (1,), e: int = 4, h: int = 256,
          i: int = 128, seed: int = 0, agree: bool = False, pow2: bool = False, config: Optional[dict] = None,
          drop: Sequence[str] = (), edit: Optional[Dict[str, torch.Tensor]] = None) -> Dict[str, torch.Tensor]:
    """Write a checkpoint into directory `root`: `shards` files + model.safetensors.index.json (shards=0: one
    model.safetensors, no index) + config.json. drop: names left out of their shard (still in the index);
    edit: names whose tensor is replaced (or added) on disk. Returns the tensors as written (drop/edit applied)."""
    from safetensors.torch import save_file

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    t = tensors(convention, layers=layers, e=e, h=h, i=i, seed=seed, agree=agree, pow2=pow2)
    names = list(t) + [n for n in (edit or {}) if n not in t]
    t.update(edit or {})
    cfg = {"num_local_experts" if convention == "mixtral_bf16" else "num_experts": e, "hidden_size": h}
    cfg.update(config or {})
    (root / "config.json").write_text(json.dumps(cfg))
    if shards == 0:
        save_file({n: t[n].contiguous() for n in names if n not in drop}, str(root / "model.safetensors"))
    else:
        per = math.ceil(len(names) / shards)
        weight_map = {}
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = names[s * per:(s + 1) * per]
            weight_map.update({n: fname for n in part})
            save_file({n: t[n].contiguous() for n in part if n not in drop}, str(root / fname))
        (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return {n: v for n, v in t.items() if n not in drop}


def _blocks(scale, n, k, bn, bk):
    return scale.repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]


def dequantized(t: Dict[str, torch.Tensor], convention: str, layer: int = 1):
    """(w13 [E, 2I, H] gate rows first, w2 [E, H, I]) fp32 as the checkpoint means them, in plain torch; the
    conventions' definitions, not moe_ep's code. gpt-oss: also the biases (gate_up [E, 2I] gate first, down)."""
    block = "block_sparse_moe" if convention == "mixtral_bf16" else "mlp"
    stem = f"model.layers.{layer}.{block}.experts"
    if convention == "gpt_oss_mxfp4":
        def mx(blocks, scales):
            e, n, kb, _ = blocks.shape
            lo, hi = FP4[(blocks & 0x0F).long()], FP4[(blocks >> 4).long()]
            vals = torch.stack((lo, hi), dim=-1).reshape(e, n, kb, 32)  # even element from the low nibble
            return (vals * torch.exp2(scales.float() - 127).unsqueeze(-1)).reshape(e, n, kb * 32)

        gu = mx(t[f"{stem}.gate_up_proj_blocks"], t[f"{stem}.gate_up_proj_scales"])
        bias = t[f"{stem}.gate_up_proj_bias"].float()
        return (torch.cat((gu[:, 0::2], gu[:, 1::2]), dim=1),
                mx(t[f"{stem}.down_proj_blocks"], t[f"{stem}.down_proj_scales"]),
                torch.cat((bias[:, 0::2], bias[:, 1::2]), dim=1), t[f"{stem}.down_proj_bias"].float())
    if convention == "hf_fused_bf16":
        return t[f"{stem}.gate_up_proj"].float(), t[f"{stem}.down_proj"].float()
    ids = sorted({int(n[len(stem) + 1:].split(".")[0]) for n in t if n.startswith(stem + ".")})
    projs = ("w1", "w3", "w2") if convention == "mixtral_bf16" else ("gate_proj", "up_proj", "down_proj")

    def one(x, proj):
        p = f"{stem}.{x}.{proj}"
        if convention == "deepseek_fp8":
            w = t[f"{p}.weight"].float()
            return w * _blocks(t[f"{p}.weight_scale_inv"], *w.shape, 128, 128)
        if convention == "modelopt_fp8":
            return t[f"{p}.weight"].float() * t[f"{p}.weight_scale"]
        if convention == "modelopt_nvfp4":
            b = t[f"{p}.weight"]
            vals = torch.stack((FP4[(b & 0x0F).long()], FP4[(b >> 4).long()]), dim=-1).reshape(b.shape[0], -1)
            return vals * t[f"{p}.weight_scale"].float().repeat_interleave(16, dim=-1) * t[f"{p}.weight_scale_2"]
        return t[f"{p}.weight"].float()

    w13 = torch.stack([torch.cat((one(x, projs[0]), one(x, projs[1]))) for x in ids])
    w2 = torch.stack([one(x, projs[2]) for x in ids])
    return w13, w2


def plain_moe(hidden: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor,
              w2: torch.Tensor, expert_offset: int = 0) -> torch.Tensor:
    """fp32 MoE over dequantized experts, nothing quantized: sum_k w_k * (silu(x gate^T) * (x up^T)) down^T."""
    x = hidden.float()
    i = w2.shape[2]
    out = torch.zeros(x.shape[0], w2.shape[1])
    for t in range(x.shape[0]):
        for k in range(topk_idx.shape[1]):
            e = int(topk_idx[t, k]) - expert_offset
            if e < 0:
                continue
            fc1 = w13[e] @ x[t]
            h = torch.nn.functional.silu(fc1[:i]) * fc1[i:]
            out[t] += float(topk_weights[t, k]) * (w2[e] @ h)
    return out
