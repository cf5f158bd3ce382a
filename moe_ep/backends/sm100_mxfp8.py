"""`sm100_mxfp8_cutedsl`: the Blackwell MXFP8 MegaMoE kernel (`moe_mxfp8_glu`) behind moe_ep's contract.
e4m3 values with an e8m0 scale per 32 along K, activations quantized per call."""

from __future__ import annotations

from moe_ep.backends.sm100_base import Sm100Backend

__all__ = ["Sm100Mxfp8Backend"]


class Sm100Mxfp8Backend(Sm100Backend):
    name = "sm100_mxfp8_cutedsl"
    weight_formats = ("mxfp8",)
