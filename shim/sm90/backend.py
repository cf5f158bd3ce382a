"""The Hopper kernel backends moe_ep registers (by lazy string): one class per row of shim/sm90/formats.py
(`sm90_fp8_cutedsl` -> Sm90Fp8Backend, `sm90_bf16_cutedsl` -> Sm90Bf16Backend, ...), each over its row's
frontend."""

from __future__ import annotations

from shim.common.backend import KernelBackend
from shim.sm90 import knobs as sm90_knobs
from shim.sm90.formats import BACKENDS


class Sm90Backend(KernelBackend):
    arch = "sm90"
    table = BACKENDS
    knobs_module = sm90_knobs

    def model_knobs(self):
        from shim.sm90.knob_model import for_backend

        return for_backend(self)

    def autotune(self, weights):
        from shim.sm90 import tune

        w = self.ctx.world_size
        cands = tune.candidate_knobs(self.fmt, self.spec, w,
                                     build_check=tune.build_check(self.frontend_class(), self.spec, w,
                                                                  kernel_format=self.format))
        winner, self.autotune_result = tune.autotune(self.make_frontend, weights, fmt=self.fmt, spec=self.spec,
                                                     cache_key=self.knob_cache_key, world_size=w, candidates=cands,
                                                     group=self.ctx.group, device=self.ctx.comm_device)
        return winner


# Sm90Fp8Backend, Sm90Bf16Backend, ...: the names the table's `target` strings give.
ROW_CLASSES = Sm90Backend.row_classes()
globals().update(ROW_CLASSES)
__all__ = ["Sm90Backend", "ROW_CLASSES", *ROW_CLASSES]
