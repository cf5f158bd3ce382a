"""The Hopper kernel backends moe_ep registers (by lazy string): `sm90_fp8_cutedsl` (FP8, blockwise scales)
and `sm90_bf16_cutedsl` (BF16, drop 0.7.4+), each over its format's frontend."""

from __future__ import annotations

from shim.common.backend import KernelBackend
from shim.sm90 import knobs as sm90_knobs
from shim.sm90 import limits as sm90_limits

__all__ = ["Sm90Backend", "Sm90Fp8Backend", "Sm90Bf16Backend"]


class Sm90Backend(KernelBackend):
    arch = "sm90"
    limits = sm90_limits
    knobs_module = sm90_knobs

    def model_knobs(self):
        from shim.sm90.knob_model import for_backend

        return for_backend(self)

    def autotune(self, weights):
        from shim.sm90 import tune

        w = self.ctx.world_size
        cands = tune.candidate_knobs(self.fmt, self.spec, w,
                                     build_check=tune.build_check(self.frontend_class(), self.spec, w))
        winner, self.autotune_result = tune.autotune(self.make_frontend, weights, fmt=self.fmt, spec=self.spec,
                                                     cache_key=self.knob_cache_key, world_size=w, candidates=cands,
                                                     group=self.ctx.group, device=self.ctx.comm_device)
        return winner


class Sm90Fp8Backend(Sm90Backend):
    name = "sm90_fp8_cutedsl"
    weight_formats = ("fp8_block",)

    @staticmethod
    def frontend_class():
        from shim.sm90.fp8_frontend import Sm90Fp8Frontend

        return Sm90Fp8Frontend


class Sm90Bf16Backend(Sm90Backend):
    name = "sm90_bf16_cutedsl"
    weight_formats = ("bf16",)

    @staticmethod
    def frontend_class():
        from shim.sm90.bf16_frontend import Sm90Bf16Frontend

        return Sm90Bf16Frontend
