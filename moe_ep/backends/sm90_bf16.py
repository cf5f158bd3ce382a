"""`sm90_bf16_cutedsl`: the Hopper BF16 MegaMoE kernel (drop 0.7.4+) behind the moe_ep backend contract."""

from __future__ import annotations

from moe_ep.backends._sm90 import Sm90KernelBackend

__all__ = ["Sm90Bf16Backend"]


class Sm90Bf16Backend(Sm90KernelBackend):
    name = "sm90_bf16_cutedsl"
    weight_formats = ("bf16",)
    multiple_of = 64

    @staticmethod
    def frontend_class():
        from shim.sm90.bf16_frontend import Sm90Bf16Frontend

        return Sm90Bf16Frontend

    def staged_activation(self):
        from moe_ep.reference.quant import QuantizedActivation

        return QuantizedActivation("bf16", self.frontend.staged_activation(self._last_t))
