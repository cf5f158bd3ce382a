"""The Hopper FP8 (blockwise) MegaMoE frontend: `moe_hopper_fp8.Sm90MegaMoE{,SwapAB}Fp8Kernel`.

Per forward, bf16 activations are quantized into the symmetric buffers in 1x128 blocks (scale = amax *
fl32(1/448), floored at 1e-30, q = fp8(x / scale)); the kernel pulls them, runs FC1 / SwiGLU (routing weight
folded in) / FC2 with 128x128 weight block scales and per-64 FC2-input scales it computes itself, and combines.

Staging is one fused Triton kernel where Triton runs (shim/sm90/fp8_staging.py), byte for byte moe_ep's format
quantizer; at compile time the frontend checks that on this device (a probe batch against the quantizer) and
falls back to the torch quantizer, with a warning, if the bytes differ or the kernel cannot be built.
"""

from __future__ import annotations

import warnings

import torch

from moe_ep.formats import QuantizedActivation, codecs
from shim.sm90 import fp8_staging
from shim.sm90 import weights as sm90_weights
from shim.sm90.frontend import Sm90Frontend
from shim.sm90.knobs import Sm90Knobs

__all__ = ["Sm90Fp8Frontend", "Sm90StagedFp8Frontend"]

ACT_BLOCK = codecs.FP8_ACT_BLOCK_K


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


class Sm90StagedFp8Frontend(Sm90Frontend):
    """What the FP8-activation frontends with a fused staging kernel share (FP8 blockwise, W4A8): the FP8 format
    arguments, the activation scale row, and the compile-time check that the fused kernel gives the format
    quantizer's bytes on this device (else the torch quantizer, with a warning). A format says how it stages
    (stage_fused), what the quantizer's bytes are (fused_matches) and the probe's seed and magnitudes."""

    staging = "torch"  # "fused" once compile() has checked the fused kernel on this device
    staging_name = "FP8 staging"  # in the fallback's warnings
    probe_seed = 7
    probe_decades = (-4, 3)  # the probe rows' magnitudes, 10^a .. 10^b

    def accum_mode(self, knobs: Sm90Knobs) -> str:
        return knobs.accum_mode

    def format_kwargs(self, knobs: Sm90Knobs):
        import cutlass

        ks = self.symbols()
        return dict(sf_padding_block=ks.SfPaddingBlock, ab_dtype=cutlass.Float8E4M3FN,
                    sf_vec_size=ks.Fp8E8M0SfVecSize, fp8_scale_mode=self.format.scale_mode,
                    fp8_accum_mode=self.accum_mode(knobs), grouped_token_back=False, combine_format="bf16",
                    dedup_dispatch=knobs.exchange_kwargs().get("dedup_dispatch", False),
                    compact_pull_buffer=knobs.exchange_kwargs().get("compact_pull_buffer", True))

    def stage_fused(self, x: torch.Tensor) -> None:
        """x's rows into the input buffers by the fused kernel."""
        raise NotImplementedError

    def fused_matches(self, x: torch.Tensor) -> bool:
        """Whether the input buffers' first len(x) rows hold the format quantizer's bytes for x."""
        raise NotImplementedError

    def check_on_device(self) -> None:
        if self.staging != "fused":
            self.staging = self._check_fused_staging()

    def _check_fused_staging(self) -> str:
        """"fused" when the fused kernel gives the format quantizer's bytes on this device, else "torch"."""
        if not fp8_staging.available():
            return "torch"
        # Into the very buffers (and so the dtypes and strides) the forwards stage into: the kernel is built here,
        # outside any graph capture. The rows are restaged before the next launch reads them.
        gen = torch.Generator().manual_seed(self.probe_seed)
        t, h = min(64, self.max_tokens_per_rank), self.hidden_size
        x = torch.randn(t, h, generator=gen) * torch.logspace(*self.probe_decades, t).unsqueeze(1)
        x = x.to(torch.bfloat16).to(self.device)
        # stacklevel 4: the warning points at whoever called compile() (-> check_on_device -> here).
        try:
            self.stage_fused(x)
            same = self.fused_matches(x)
        except Exception as e:  # noqa: BLE001 - any failure of the optional kernel means the torch path
            warnings.warn(f"fused {self.staging_name} unavailable here ({type(e).__name__}: {e}); staging with "
                          "torch ops", RuntimeWarning, stacklevel=4)
            return "torch"
        if not same:
            warnings.warn(f"the fused {self.staging_name} kernel's bytes differ from the format quantizer's on this "
                          "device; staging with torch ops", RuntimeWarning, stacklevel=4)
            return "torch"
        return "fused"

    def activation_args(self, b, rows: int):
        return dict(super().activation_args(b, rows), activation_sf=b.tensor(self.act_sf[:rows]))


class Sm90Fp8Frontend(Sm90StagedFp8Frontend):
    fmt = "fp8_block"

    def kernel_class(self, knobs: Sm90Knobs):
        ks = self.symbols()
        return ks.Sm90MegaMoESwapABFp8Kernel if knobs.swap_ab else ks.Sm90MegaMoEFp8Kernel

    def input_buffers(self):
        c, h = self.max_tokens_per_rank, self.hidden_size
        return [("act", (c, h), torch.float8_e4m3fn), ("act_sf", (c, _round_up(h // ACT_BLOCK, 4)), torch.float32)]

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

    def weight_args(self, b, w: sm90_weights.Sm90KernelWeights):
        return dict(
            fc1_weight=b.tensor(w.fc1), fc1_weight_sf=b.tensor(w.fc1_scale),
            fc1_activation_dequant_scale=b.tensor(w.fc1_act_dequant, 4),
            fc1_weight_dequant_scale=b.tensor(w.fc1_w_dequant, 4),
            fc2_weight=b.tensor(w.fc2), fc2_weight_sf=b.tensor(w.fc2_scale),
            fc2_activation_dequant_scale=b.tensor(w.fc2_act_dequant, 4),
            fc2_weight_dequant_scale=b.tensor(w.fc2_w_dequant, 4),
        )

    def staged_activation(self, t: int) -> QuantizedActivation:
        return QuantizedActivation(self.fmt, self.act[:t].clone(), self.act_sf[:t, : self.hidden_size // ACT_BLOCK].clone())
