"""`sm100_mxfp8_cutedsl`: the Blackwell MXFP8 MegaMoE kernel (`moe_mxfp8_glu`) behind moe_ep's contract.
e4m3 values with an e8m0 scale per 32 along K, activations quantized per call. The kernel always folds the
routing weight into FC1 (apply_topk_in_fc1 is True, as for the other sm100 backends); since drop 0.7.4 each launch
also re-quantizes the received tokens along the token axis into rank-local buffers no forward reads (the
frontend holds them: about pool rows x H bytes per rank, see shim/sm100/README.md)."""

from __future__ import annotations

from moe_ep.backends.sm100_base import Sm100Backend

__all__ = ["Sm100Mxfp8Backend"]


class Sm100Mxfp8Backend(Sm100Backend):
    name = "sm100_mxfp8_cutedsl"
    weight_formats = ("mxfp8",)
