"""bf16 checkpoints -> moe_ep's canonical bf16 experts (w13 [E, 2I, H] gate rows first, w2 [E, H, I]): copies, exact.

Per expert (Mixtral `w1` gate / `w3` up / `w2` down; Qwen3-MoE, DeepSeek-V3 bf16 `gate_proj` / `up_proj` /
`down_proj`): nn.Linear weights [out, in], so gate and up are [I, H] and down [H, I]. Fused (transformers 5's
MoE experts modules, `mlp.experts.gate_up_proj` [E, 2I, H] with gate rows first, `mlp.experts.down_proj`
[E, H, I]): moe_ep's w13 / w2 as they are.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from moe_ep.checkpoint.tensors import expect, expect_finite

__all__ = ["per_expert_bf16", "fused_bf16", "gpt_oss_bf16"]

_BF16 = torch.bfloat16


def _out(out, e: int, h: int, i: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    if out is not None:
        return out
    return (torch.empty((e, 2 * i, h), dtype=_BF16, device=device), torch.empty((e, h, i), dtype=_BF16, device=device))


def per_expert_bf16(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, *,
                    out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """gate, up [E, I, H] and down [E, H, I] bf16 (stacked Linear weights) -> (w13, w2); into `out` when given."""
    e, i, h = gate.shape
    for t, name, shape in ((gate, "gate_proj.weight", (e, i, h)), (up, "up_proj.weight", (e, i, h)),
                           (down, "down_proj.weight", (e, h, i))):
        expect_finite(expect(t, name, _BF16, shape), name)
    w13, w2 = _out(out, e, h, i, gate.device)
    w13[:, :i].copy_(gate)
    w13[:, i:].copy_(up)
    w2.copy_(down)
    return w13, w2


def fused_bf16(gate_up: torch.Tensor, down: torch.Tensor, *,
               out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """transformers 5 fused experts: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I] -> (w13, w2)."""
    e, n2, h = gate_up.shape
    expect_finite(expect(gate_up, "gate_up_proj", _BF16, (e, n2, h)), "gate_up_proj")
    expect_finite(expect(down, "down_proj", _BF16, (e, h, n2 // 2)), "down_proj")
    w13, w2 = _out(out, e, h, n2 // 2, gate_up.device)
    w13.copy_(gate_up)
    w2.copy_(down)
    return w13, w2


def gpt_oss_bf16(gate_up: torch.Tensor, down: torch.Tensor, *,
                 out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """transformers' gpt-oss experts in bf16: gate_up_proj [E, H, 2I] (transposed; column 2j gate j, 2j+1 up j),
    down_proj [E, I, H] (transposed) -> (w13 [E, 2I, H] gate rows first, w2 [E, H, I])."""
    e, h, n2 = gate_up.shape
    expect_finite(expect(gate_up, "gate_up_proj", _BF16, (e, h, n2)), "gate_up_proj")
    expect_finite(expect(down, "down_proj", _BF16, (e, n2 // 2, h)), "down_proj")
    w13, w2 = _out(out, e, h, n2 // 2, gate_up.device)
    w13.copy_(torch.cat((gate_up[:, :, 0::2], gate_up[:, :, 1::2]), dim=2).transpose(1, 2))
    w2.copy_(down.transpose(1, 2))
    return w13, w2
