"""`sm90_fp8_cutedsl`: the Hopper FP8 (blockwise) MegaMoE kernel behind the moe_ep backend contract."""

from __future__ import annotations

from moe_ep.backends._sm90 import Sm90KernelBackend

__all__ = ["Sm90Fp8Backend"]


class Sm90Fp8Backend(Sm90KernelBackend):
    name = "sm90_fp8_cutedsl"
    # fp8_tensor would need calibrated static activation scales this kernel path does not take.
    weight_formats = ("fp8_block",)
    multiple_of = 128

    @staticmethod
    def frontend_class():
        from shim.sm90.fp8_frontend import Sm90Fp8Frontend

        return Sm90Fp8Frontend

    def staged_activation(self):
        from moe_ep.reference.quant import QuantizedActivation

        q, s = self.frontend.staged_activation(self._last_t)
        return QuantizedActivation("fp8_block", q, s)
