"""The Hopper W4A8 MXFP4 MegaMoE frontend: `moe_hopper_fp8.Sm90MegaMoESwapABMxfp4Fp8Kernel` (drop 0.7.4+), MXFP4
weights x FP8 activations, `fp8_scale_mode="mxfp4_hybrid"`, swap-AB only.

Per forward, bf16 activations are quantized per token (one fp32 scale over the whole row, replicated into the
kernel's [T, 4] scale row so dispatch and TMA move 16 aligned bytes) by one fused Triton launch where Triton
runs (shim/sm90/fp8_staging.py, byte for byte the format quantizer; checked at compile time on this device,
torch ops with a warning otherwise: a dozen small kernels, tens of microseconds at decode sizes); the kernel
pulls them, widens the packed
e2m1 weights to e4m3 in registers (shim/sm90/fp4_layout.py says how the bytes must lie), accumulates FC1 over
the full K and multiplies by the token's scale, applies each expert's residual, runs SwiGLU (routing weight
folded in), requantizes the FC2 input per 64 with scales it computes itself, and combines with the separate
top-k reduce (the W4A8 kernel has no in-kernel reduce).
"""

from __future__ import annotations

import warnings

import torch

from moe_ep.formats import QuantizedActivation, codecs
from shim.sm90 import fp8_staging, w4a8_weights
from shim.sm90.frontend import Sm90Frontend
from shim.sm90.knobs import Sm90Knobs

__all__ = ["Sm90W4A8Frontend"]

SCALE_ROW = 4  # fp32 words per token in the activation scale row (megamoe_kernel_fp8.py sf_uint32_per_token)


class Sm90W4A8Frontend(Sm90Frontend):
    fmt = "w4a8_mxfp4"
    staging = "torch"  # "fused" once compile() has checked the fused kernel on this device

    def kernel_class(self, knobs: Sm90Knobs):
        # Swap-AB only: the knob space pins swap_ab (a tree without the module is refused by the registry's probe,
        # before anything gets here).
        return self.symbols().Sm90MegaMoESwapABMxfp4Fp8Kernel

    def format_kwargs(self, knobs: Sm90Knobs):
        import cutlass

        ks = self.symbols()
        return dict(sf_padding_block=ks.SfPaddingBlock, ab_dtype=cutlass.Float8E4M3FN,
                    sf_vec_size=ks.Fp8E8M0SfVecSize, fp8_scale_mode=self.format.scale_mode, fp8_accum_mode="1xacc")

    def input_buffers(self):
        c, h = self.max_tokens_per_rank, self.hidden_size
        return [("act", (c, h), torch.float8_e4m3fn), ("act_sf", (c, SCALE_ROW), torch.float32)]

    def stage_activations(self, x: torch.Tensor) -> None:
        # The bytes of moe_ep's format quantizer either way: the oracle re-derives them from the same bf16 input.
        if self.staging == "fused":
            fp8_staging.launch_fused_rows(x, self.act, self.act_sf)
        else:
            fp8_staging.stage_fp8_rows_reference(x, self.act, self.act_sf)

    def check_on_device(self) -> None:
        if self.staging != "fused":
            self.staging = self._check_fused_staging()

    def _check_fused_staging(self) -> str:
        """"fused" when the fused per-row kernel gives the format quantizer's bytes on this device, else "torch"."""
        if not fp8_staging.available():
            return "torch"
        gen = torch.Generator().manual_seed(11)
        t, h = min(64, self.max_tokens_per_rank), self.hidden_size
        x = (torch.randn(t, h, generator=gen) * torch.logspace(-6, 4, t).unsqueeze(1)).to(torch.bfloat16)
        x = x.to(self.device)
        try:
            fp8_staging.launch_fused_rows(x, self.act, self.act_sf)
            rq, rs = codecs.fp8_quantize_rows(x, h, reciprocal=False)
            same = torch.equal(self.act[:t].view(torch.uint8), rq.view(torch.uint8)) and torch.equal(
                self.act_sf[:t].view(torch.int32), rs.expand(t, SCALE_ROW).contiguous().view(torch.int32))
        except Exception as e:  # noqa: BLE001 - any failure of the optional kernel means the torch path
            warnings.warn(f"fused per-token FP8 staging unavailable here ({type(e).__name__}: {e}); staging with "
                          "torch ops", RuntimeWarning, stacklevel=3)
            return "torch"
        if not same:
            warnings.warn("the fused per-token FP8 staging kernel's bytes differ from the format quantizer's on this "
                          "device; staging with torch ops", RuntimeWarning, stacklevel=3)
            return "torch"
        return "fused"

    def activation_args(self, b, rows: int):
        return dict(super().activation_args(b, rows), activation_sf=b.tensor(self.act_sf[:rows]))

    def prepare_weights(self, weights):
        return w4a8_weights.prepare(weights, self.device)

    def placeholder_weights(self):
        return w4a8_weights.placeholder_weights(self.experts_per_rank, self.hidden_size, self.intermediate_size,
                                                device=self.device)

    def weight_args(self, b, w: w4a8_weights.Sm90W4A8KernelWeights):
        return dict(
            fc1_weight=b.tensor(w.fc1), fc1_weight_sf=b.tensor(w.fc1_sf),
            fc1_activation_dequant_scale=b.tensor(w.one, 4), fc1_weight_dequant_scale=b.tensor(w.fc1_residual, 4),
            fc2_weight=b.tensor(w.fc2), fc2_weight_sf=b.tensor(w.fc2_sf),
            fc2_activation_dequant_scale=b.tensor(w.one, 4), fc2_weight_dequant_scale=b.tensor(w.fc2_residual, 4),
        )

    def staged_activation(self, t: int) -> QuantizedActivation:
        return QuantizedActivation(self.fmt, self.act[:t].clone(), self.act_sf[:t, :1].clone())
