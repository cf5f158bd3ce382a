"""The Hopper kernel backends moe_ep registers (by lazy string): one class per row of shim/sm90/formats.py, each
over its row's frontend."""

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
                                     build_check=tune.build_check(self.frontend_class(), self.spec, w, row=self.row))
        winner, self.autotune_result = tune.autotune(self.make_frontend, weights, fmt=self.fmt, spec=self.spec,
                                                     cache_key=self.knob_cache_key, world_size=w, candidates=cands,
                                                     group=self.ctx.group, device=self.ctx.comm_device)
        return winner


class Sm90Fp8Backend(Sm90Backend, fmt="fp8_block"):
    """sm90_fp8_cutedsl: Hopper FP8 MegaMoE, blockwise scales."""


class Sm90Bf16Backend(Sm90Backend, fmt="bf16"):
    """sm90_bf16_cutedsl: Hopper BF16 MegaMoE."""


class Sm90Fp8TensorBackend(Sm90Backend, fmt="fp8_tensor"):
    """sm90_fp8_tensor_cutedsl: Hopper FP8 MegaMoE, per-tensor static scales."""


class Sm90W4A8Mxfp4Backend(Sm90Backend, fmt="w4a8_mxfp4"):
    """sm90_w4a8_mxfp4_cutedsl: Hopper MXFP4 weights x FP8 activations MegaMoE."""


__all__ = ["Sm90Backend", "Sm90Fp8Backend", "Sm90Bf16Backend", "Sm90Fp8TensorBackend", "Sm90W4A8Mxfp4Backend"]
