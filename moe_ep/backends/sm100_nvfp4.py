"""`sm100_nvfp4_cutedsl`: the Blackwell NVFP4 MegaMoE kernel (`moe_nvfp4_swapab`) behind moe_ep's contract.

NVFP4 scales activations statically: the FC1-input and FC2-input global scales come from the calibrated
ExpertWeights.act_amax / fc2_act_amax (CalibrationError without them)."""

from __future__ import annotations

from moe_ep.backends.sm100_base import Sm100Backend
from moe_ep.core.errors import CalibrationError
from moe_ep.core.weights import ExpertWeights

__all__ = ["Sm100Nvfp4Backend"]


class Sm100Nvfp4Backend(Sm100Backend):
    name = "sm100_nvfp4_cutedsl"
    weight_formats = ("nvfp4",)

    def prepare_weights(self, weights: ExpertWeights) -> None:
        for argument in ("act_amax", "fc2_act_amax"):
            if getattr(weights, argument) is None:
                raise CalibrationError(f"weights.{argument}", "nvfp4 scales activations statically: pass the "
                                                              "calibrated amax in ExpertWeights")
        self.frontend.calibrate(weights.act_amax, weights.fc2_act_amax)
        super().prepare_weights(weights)
