"""The Hopper W4A8 MXFP4 MegaMoE frontend: `moe_hopper_fp8.Sm90MegaMoESwapABMxfp4Fp8Kernel`, MXFP4 weights x FP8
activations, `fp8_scale_mode="mxfp4_hybrid"`, swap-AB only; its weight layout is shim/sm90/w4a8_weights.py.

Per forward, bf16 activations are quantized per token (one fp32 scale over the whole row, replicated into the
kernel's [T, 4] scale row so dispatch and TMA move 16 aligned bytes) by one fused Triton launch where Triton
runs (shim/sm90/fp8_staging.py, byte for byte the format quantizer; checked at compile time on this device,
torch ops with a warning otherwise: a dozen small kernels); the kernel pulls them, widens the packed e2m1 weights
to e4m3 in registers (shim/sm90/fp4_layout.py says how the bytes must lie), accumulates FC1 over
the full K and multiplies by the token's scale, applies each expert's residual, runs SwiGLU (routing weight
folded in), requantizes the FC2 input per 64 with scales it computes itself, and combines with the separate
top-k reduce (the W4A8 kernel has no in-kernel reduce).
"""

from __future__ import annotations

import torch

from moe_ep.formats import QuantizedActivation, codecs
from shim.sm90 import fp4_layout, fp8_staging
from shim.sm90.fp8_frontend import fp8_kernel_kwargs
from shim.sm90.frontend import Sm90Frontend
from shim.sm90.knobs import Sm90Knobs
from shim.sm90.w4a8_weights import Sm90W4A8Weights

__all__ = ["Sm90W4A8Frontend"]

SCALE_ROW = 4  # fp32 words per token in the activation scale row (megamoe_kernel_fp8.py sf_uint32_per_token)


class Sm90W4A8Frontend(Sm90Frontend):
    fmt = "w4a8_mxfp4"
    weights_layout = Sm90W4A8Weights
    staging = "torch"  # "fused" once compile() has checked the fused kernel on this device

    def kernel_class(self, knobs: Sm90Knobs):
        # Swap-AB only: the knob space pins swap_ab (a tree without the module is refused by the registry's probe,
        # before anything gets here).
        return self.symbols().Sm90MegaMoESwapABMxfp4Fp8Kernel

    def format_kwargs(self, knobs: Sm90Knobs):
        # The FP8 kernel's arguments, then the MXFP4 constructor's own at the values it defaults to (the compact pull
        # buffer off: it sets that default itself for its dispatch storage), the exchange knobs at the set's value
        # where it fixes one.
        ex = knobs.exchange_kwargs()
        return dict(fp8_kernel_kwargs(self, knobs, "1xacc"), compact_pull_buffer=ex.get("compact_pull_buffer", False),
                    mxfp4_fc2_tail_n8=ex.get("mxfp4_fc2_tail_n8", False), mxfp4_fc1_ready_mode="tile")

    def check_kernel(self, kernel) -> None:
        super().check_kernel(kernel)
        ks = self.symbols()
        for where, value, mine in (("the kernel's sf_uint32_per_token", getattr(kernel, "sf_uint32_per_token", None),
                                    SCALE_ROW),
                                   ("mxfp4_cutedsl.MXFP4_FOLD_M", ks.MXFP4_FOLD_M, fp4_layout.FOLD_M),
                                   ("mxfp4_cutedsl.MXFP4_K_TILE", ks.MXFP4_K_TILE, fp4_layout.FOLD_K)):
            if value != mine:
                raise RuntimeError(f"the drop's {where} is {value}; the W4A8 layout (shim/sm90/fp4_layout.py, this "
                                   f"frontend's scale row) assumes {mine}")

    def input_buffers(self):
        c, h = self.max_tokens_per_rank, self.hidden_size
        return [("act", (c, h), torch.float8_e4m3fn), ("act_sf", (c, SCALE_ROW), torch.float32)]

    def check_on_device(self) -> None:
        if self.staging != "fused":
            self.staging = fp8_staging.check_fused(self, "per-token FP8 staging", seed=11, decades=(-6, 4))

    def stage_activations(self, x: torch.Tensor) -> None:
        # The bytes of moe_ep's format quantizer either way: the oracle re-derives them from the same bf16 input.
        if self.staging == "fused":
            self.stage_fused(x)
        else:
            fp8_staging.stage_fp8_rows_reference(x, self.act, self.act_sf)

    def stage_fused(self, x: torch.Tensor) -> None:
        fp8_staging.launch_fused_rows(x, self.act, self.act_sf)

    def fused_matches(self, x: torch.Tensor) -> bool:
        t, h = x.shape
        rq, rs = codecs.fp8_quantize_rows(x, h, reciprocal=False)
        return torch.equal(self.act[:t].view(torch.uint8), rq.view(torch.uint8)) and torch.equal(
            self.act_sf[:t].view(torch.int32), rs.expand(t, SCALE_ROW).contiguous().view(torch.int32))

    def activation_args(self, b, rows: int):
        return dict(super().activation_args(b, rows), activation_sf=b.tensor(self.act_sf[:rows]))

    def weight_args(self, b, w: Sm90W4A8Weights):
        return dict(
            fc1_weight=b.tensor(w.fc1), fc1_weight_sf=b.tensor(w.fc1_sf),
            fc1_activation_dequant_scale=b.tensor(w.one, 4), fc1_weight_dequant_scale=b.tensor(w.fc1_residual, 4),
            fc2_weight=b.tensor(w.fc2), fc2_weight_sf=b.tensor(w.fc2_sf),
            fc2_activation_dequant_scale=b.tensor(w.one, 4), fc2_weight_dequant_scale=b.tensor(w.fc2_residual, 4),
        )

    def staged_activation(self, t: int) -> QuantizedActivation:
        return QuantizedActivation(self.fmt, self.act[:t].clone(), self.act_sf[:t, :1].clone())
