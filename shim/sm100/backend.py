"""The Blackwell kernel backends moe_ep registers (by lazy string): one class per row of shim/sm100/formats.py
(`sm100_nvfp4_cutedsl` -> Sm100Nvfp4Backend, `sm100_mxfp8_cutedsl`, `sm100_bf16_cutedsl`), each over its row's
frontend.

NVFP4 scales activations statically: the FC1-input and FC2-input global scales come from the calibrated
ExpertWeights.act_amax / fc2_act_amax, which the layer requires for the format (CalibrationError without).
MXFP8: since drop 0.7.4 each launch also re-quantizes the received tokens along the token axis into rank-local
buffers no forward reads (shim/sm100/mxfp8_frontend.py). BF16: no quantization; the kernel sums the top-k terms.
"""

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
        # Not silently: the Hopper backends tune here; the sm100 ones have no hardware-measured tuning run behind
        # them yet, so "auto" on a cache miss takes the measured profile.
        warnings.warn(f"{self.name}: knobs='auto' does not run a collective autotune on sm100 yet; using the "
                      "measured profile (a knob cache entry for this geometry would have been used first)",
                      RuntimeWarning, stacklevel=6)
        return self.knobs_module.heuristic_knobs(self.fmt, self.spec.max_tokens_per_rank)


# Sm100Nvfp4Backend, Sm100Mxfp8Backend, Sm100Bf16Backend: the names the table's `target` strings give.
ROW_CLASSES = Sm100Backend.row_classes()
globals().update(ROW_CLASSES)
__all__ = ["Sm100Backend", "ROW_CLASSES", *ROW_CLASSES]
