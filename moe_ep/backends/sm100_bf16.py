"""`sm100_bf16_cutedsl`: the Blackwell BF16 MegaMoE kernel (`moe_bf16_glu`) behind moe_ep's contract.
No quantization; the per-(token, slot) bf16 terms are summed by the frontend in fp32."""

from __future__ import annotations

from moe_ep.backends.sm100_base import Sm100Backend

__all__ = ["Sm100Bf16Backend"]


class Sm100Bf16Backend(Sm100Backend):
    name = "sm100_bf16_cutedsl"
    weight_formats = ("bf16",)
