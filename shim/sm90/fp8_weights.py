"""Canonical bf16 expert weights -> the Hopper FP8 kernel's weight layout and scales.

Canonical (moe_ep): w13 [E, 2I, H] with gate rows [0, I) and up rows [I, 2I);
w2 [E, H, I]. The kernel wants:
  * FC1 rows gate/up interleaved in groups of `Fp8GateUpInterleave` (8):
    g0..g7, u0..u7, g8..g15, u8..u15, ...; passed as an (E, H, 2I) view whose
    H axis has stride 1 (the K-major storage is kept, only the view permutes);
  * FC2 as an (E, I, H) view with I stride 1;
  * blockwise: one fp32 scale per 128x128 (N, K) block, scale = amax / 448
    (floored at 1e-30), q = fp8(w / scale) -- over the *interleaved* rows, so a
    scale block covers 64 gate and 64 up rows;
  * per-tensor dequant scales: ones (unused by the blockwise program).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["GATE_UP_INTERLEAVE", "Fp8KernelWeights", "interleave_gate_up", "deinterleave_gate_up",
           "quantize_block_nk", "prepare_fp8_block_weights"]

GATE_UP_INTERLEAVE = 8  # the drop's Fp8GateUpInterleave; checked against it at kernel build
FP8_MAX = 448.0
BLOCK = 128
SCALE_FLOOR = 1.0e-30


def interleave_gate_up(w13: torch.Tensor, group: int = GATE_UP_INTERLEAVE) -> torch.Tensor:
    e, n2, h = w13.shape
    i = n2 // 2
    return w13.view(e, 2, i // group, group, h).permute(0, 2, 1, 3, 4).reshape(e, n2, h)


def deinterleave_gate_up(w13i: torch.Tensor, group: int = GATE_UP_INTERLEAVE) -> torch.Tensor:
    e, n2, h = w13i.shape
    i = n2 // 2
    return w13i.view(e, i // group, 2, group, h).permute(0, 2, 1, 3, 4).reshape(e, n2, h)


def quantize_block_nk(w: torch.Tensor, block_n: int = BLOCK, block_k: int = BLOCK):
    """[E, N, K] -> (fp8 e4m3 [E, N, K], fp32 scales [E, N/bn, K/bk])."""
    e, n, k = w.shape
    blocks = w.to(torch.float32).reshape(e, n // block_n, block_n, k // block_k, block_k)
    scale = (blocks.abs().amax(dim=(2, 4)) / FP8_MAX).clamp(min=SCALE_FLOOR)
    q = (blocks / scale[:, :, None, :, None]).reshape(e, n, k).to(torch.float8_e4m3fn)
    return q, scale


@dataclass
class Fp8KernelWeights:
    fc1: torch.Tensor  # (E, H, 2I) fp8 view, H stride 1, gate/up interleaved
    fc1_scale: torch.Tensor  # (E, 2I/128, H/128) fp32
    fc2: torch.Tensor  # (E, I, H) fp8 view, I stride 1
    fc2_scale: torch.Tensor  # (E, H/128, I/128) fp32
    fc1_act_dequant: torch.Tensor  # (1,) fp32
    fc1_w_dequant: torch.Tensor  # (E,) fp32
    fc2_act_dequant: torch.Tensor  # (1,) fp32
    fc2_w_dequant: torch.Tensor  # (E,) fp32


def prepare_fp8_block_weights(w13: torch.Tensor, w2: torch.Tensor, device: torch.device) -> Fp8KernelWeights:
    e = w13.shape[0]
    q1, s1 = quantize_block_nk(interleave_gate_up(w13.to(device)))
    q2, s2 = quantize_block_nk(w2.to(device))
    ones = torch.ones(e, dtype=torch.float32, device=device)
    one = torch.ones(1, dtype=torch.float32, device=device)
    return Fp8KernelWeights(
        fc1=q1.permute(0, 2, 1), fc1_scale=s1.contiguous(), fc2=q2.permute(0, 2, 1), fc2_scale=s2.contiguous(),
        fc1_act_dequant=one, fc1_w_dequant=ones, fc2_act_dequant=one.clone(), fc2_w_dequant=ones.clone(),
    )
