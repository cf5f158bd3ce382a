"""The Blackwell kernel backends moe_ep registers (by lazy string): one class per row of shim/sm100/formats.py, each
over its row's frontend."""

from __future__ import annotations

import warnings

from shim.common.backend import KernelBackend
from shim.sm100 import knobs as sm100_knobs
from shim.sm100.formats import BACKENDS


class Sm100Backend(KernelBackend):
    arch = "sm100"
    table = BACKENDS
    knobs_module = sm100_knobs

    def autotune(self, weights):
        # Not silently: the Hopper backends tune here; the sm100 ones have no tuning run on hardware behind them
        # yet, so "auto" on a cache miss takes the measured profile.
        warnings.warn(f"{self.name}: knobs='auto' does not run a collective autotune on sm100 yet; using the "
                      "measured profile (a knob cache entry for this geometry would have been used first)",
                      RuntimeWarning, stacklevel=6)
        return self.knobs_module.heuristic_knobs(self.fmt, self.spec.max_tokens_per_rank)


class Sm100Nvfp4Backend(Sm100Backend, fmt="nvfp4"):
    """sm100_nvfp4_cutedsl: Blackwell NVFP4 MegaMoE. Static activation scales: the FC1-input and FC2-input global
    scales come from the calibrated ExpertWeights.act_amax / fc2_act_amax (CalibrationError without them)."""


class Sm100Mxfp8Backend(Sm100Backend, fmt="mxfp8"):
    """sm100_mxfp8_cutedsl: Blackwell MXFP8 MegaMoE (each launch also re-quantizes the received tokens along the
    token axis into rank-local buffers no forward reads: shim/sm100/mxfp8_frontend.py)."""


class Sm100Bf16Backend(Sm100Backend, fmt="bf16"):
    """sm100_bf16_cutedsl: Blackwell BF16 MegaMoE; the kernel sums the top-k terms."""


__all__ = ["Sm100Backend", "Sm100Nvfp4Backend", "Sm100Mxfp8Backend", "Sm100Bf16Backend"]
