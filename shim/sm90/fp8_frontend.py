"""The Hopper FP8 (blockwise) MegaMoE frontend: `moe_hopper_fp8.Sm90MegaMoE{,SwapAB}Fp8Kernel`, and its weight layout.

Per forward, bf16 activations are quantized into the symmetric buffers in 1x128 blocks (scale = amax *
fl32(1/448), floored at 1e-30, q = fp8(x / scale)); the kernel pulls them, runs FC1 / SwiGLU (routing weight
folded in) / FC2 with 128x128 weight block scales and per-64 FC2-input scales it computes itself, and combines.

Staging is one fused Triton kernel where Triton runs (shim/sm90/fp8_staging.py), byte for byte moe_ep's format
quantizer; at compile time the frontend checks that on this device (a probe batch against the quantizer) and
falls back to the torch quantizer, with a warning, if the bytes differ or the kernel cannot be built.

The FP8 kernel's pieces the other FP8-activation formats take too (fp8_tensor, W4A8) are the module's functions
(`fp8_kernel_class`, `fp8_kernel_kwargs`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_ep.formats import QuantizedActivation, QuantizedWeights, codecs
from shim.common.weights import KernelWeights, kernel_tensors, read_experts, round_up, store_experts
from shim.sm90 import fp8_staging
from shim.sm90.frontend import Sm90Frontend
from shim.sm90.knobs import Sm90Knobs
from shim.sm90.weights import GATE_UP_INTERLEAVE, fp8_weight_args

__all__ = ["Sm90Fp8Frontend", "Sm90Fp8Weights", "fp8_kernel_class", "fp8_kernel_kwargs"]

ACT_BLOCK = codecs.FP8_ACT_BLOCK_K
W_BLOCK = codecs.FP8_WEIGHT_BLOCK


@dataclass
class Sm90Fp8Weights(KernelWeights):
    """fp8_block as the FP8 kernel takes it: e4m3 FC1 / FC2 (shim/sm90/weights.py), the scale grids [E, 2I/128, H/128]
    over the interleaved rows (a block spans 64 gate and 64 up rows, so the grid is the canonical w13_scale as it is)
    and [E, H/128, I/128] fp32, and per-tensor dequant scales of one (read only by the per-tensor program)."""

    fmt = "fp8_block"
    expert_offset: int
    fc1: torch.Tensor  # (E, H, 2I) e4m3 view, H stride 1, gate/up interleaved
    fc2: torch.Tensor  # (E, I, H) e4m3 view, I stride 1
    fc1_scale: torch.Tensor  # (E, 2I/128, H/128) fp32
    fc2_scale: torch.Tensor  # (E, H/128, I/128) fp32
    fc1_act_dequant: torch.Tensor  # (1,) fp32 ones
    fc1_w_dequant: torch.Tensor  # (E,) fp32 ones
    fc2_act_dequant: torch.Tensor  # (1,) fp32 ones
    fc2_w_dequant: torch.Tensor  # (E,) fp32 ones

    @classmethod
    def empty(cls, experts, hidden, intermediate, device, expert_offset):
        fc1, fc2 = kernel_tensors(experts, hidden, intermediate, torch.float8_e4m3fn, device)
        f32 = dict(dtype=torch.float32, device=device)
        s13 = torch.empty((experts, 2 * intermediate // W_BLOCK, hidden // W_BLOCK), **f32)
        s2 = torch.empty((experts, hidden // W_BLOCK, intermediate // W_BLOCK), **f32)
        return cls(expert_offset, fc1, fc2, s13, s2, torch.ones(1, **f32), torch.ones(experts, **f32),
                   torch.ones(1, **f32), torch.ones(experts, **f32))

    def store(self, rows, qw):
        store_experts(self.fc1, self.fc2, rows, qw.w13_q, qw.w2_q, GATE_UP_INTERLEAVE)
        self.fc1_scale[rows].copy_(qw.w13_scale)
        self.fc2_scale[rows].copy_(qw.w2_scale)

    def canonical(self) -> QuantizedWeights:
        w13, w2 = read_experts(self.fc1, self.fc2, GATE_UP_INTERLEAVE)
        return QuantizedWeights(self.fmt, w13, w2, self.fc1_scale, self.fc2_scale, expert_offset=self.expert_offset)


def fp8_kernel_class(fe: Sm90Frontend, knobs: Sm90Knobs):
    """The FP8 kernel, plain or swap-AB (fp8_block and fp8_tensor: the scale mode is a constructor argument)."""
    ks = fe.symbols()
    return ks.Sm90MegaMoESwapABFp8Kernel if knobs.swap_ab else ks.Sm90MegaMoEFp8Kernel


def fp8_kernel_kwargs(fe: Sm90Frontend, knobs: Sm90Knobs, accum_mode: str):
    """The FP8-activation kernels' own constructor arguments (the scale mode is the format's row's), every one named,
    the exchange knobs at the knob set's value where it fixes one (Sm90Frontend.kernel_kwargs says why)."""
    import cutlass

    ks = fe.symbols()
    ex = knobs.exchange_kwargs()
    return dict(sf_padding_block=ks.SfPaddingBlock, ab_dtype=cutlass.Float8E4M3FN, sf_vec_size=ks.Fp8E8M0SfVecSize,
                fp8_scale_mode=fe.row.scale_mode, fp8_accum_mode=accum_mode, grouped_token_back=False,
                combine_format="bf16", dedup_dispatch=ex.get("dedup_dispatch", False),
                compact_pull_buffer=ex.get("compact_pull_buffer", True))


class Sm90Fp8Frontend(Sm90Frontend):
    fmt = "fp8_block"
    weights_layout = Sm90Fp8Weights
    staging = "torch"  # "fused" once compile() has checked the fused kernel on this device

    def kernel_class(self, knobs: Sm90Knobs):
        return fp8_kernel_class(self, knobs)

    def format_kwargs(self, knobs: Sm90Knobs):
        return fp8_kernel_kwargs(self, knobs, knobs.accum_mode)

    def input_buffers(self):
        c, h = self.max_tokens_per_rank, self.hidden_size
        return [("act", (c, h), torch.float8_e4m3fn), ("act_sf", (c, round_up(h // ACT_BLOCK, 4)), torch.float32)]

    def check_on_device(self) -> None:
        if self.staging != "fused":
            self.staging = fp8_staging.check_fused(self, "FP8 staging", seed=7, decades=(-4, 3))

    def stage_activations(self, x: torch.Tensor) -> None:
        # The bytes of moe_ep's format quantizer either way: the oracle re-derives them from the same bf16 input.
        t, h = x.shape
        if self.staging == "fused":
            self.stage_fused(x)
        else:
            q, scale = codecs.fp8_quantize_rows(x, ACT_BLOCK, reciprocal=False)
            self.act[:t].view(torch.uint8).copy_(q.view(torch.uint8))
            self.act_sf[:t, : h // ACT_BLOCK].copy_(scale)
        if h // ACT_BLOCK < self.act_sf.shape[1]:
            # Zero word padding, every call: the staging arena is shared by every layer (shim/common/workspace.py).
            self.act_sf[:t, h // ACT_BLOCK:].zero_()

    def stage_fused(self, x: torch.Tensor) -> None:
        fp8_staging.launch_fused(x, self.act, self.act_sf)

    def fused_matches(self, x: torch.Tensor) -> bool:
        t, h = x.shape
        rq, rs = codecs.fp8_quantize_rows(x, ACT_BLOCK, reciprocal=False)
        q, s = self.act[:t].view(torch.uint8), self.act_sf[:t, : h // ACT_BLOCK]
        return torch.equal(q, rq.view(torch.uint8)) and torch.equal(s.view(torch.int32), rs.view(torch.int32))

    def activation_args(self, b, rows: int):
        return dict(super().activation_args(b, rows), activation_sf=b.tensor(self.act_sf[:rows]))

    def weight_args(self, b, w: Sm90Fp8Weights):
        return fp8_weight_args(b, w)

    def staged_activation(self, t: int) -> QuantizedActivation:
        return QuantizedActivation(self.fmt, self.act[:t].clone(),
                                   self.act_sf[:t, : self.hidden_size // ACT_BLOCK].clone())
