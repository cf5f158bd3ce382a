"""What the Hopper frontends share: the tree's symbols, the constructor arguments every Hopper MegaMoE kernel takes
and the Hopper launch arguments.

Every Hopper MegaMoE kernel (FP8, BF16, W4A8) takes the same scheduling / token-comm constructor arguments; a format
frontend (shim/sm90/<format>_frontend.py, one class per format directly on this one) names its kernel class (plain
or swap-AB, by the swap_ab knob), adds its format's own constructor arguments, says how activations are staged and
owns its weight layout (the helpers the layouts share: shim/sm90/weights.py).
"""

from __future__ import annotations

from typing import Any, Dict

from shim.common.frontend import MegaMoEFrontend
from shim.sm90.formats import BACKENDS
from shim.sm90.knobs import Sm90Knobs
from shim.sm90.weights import GATE_UP_INTERLEAVE

__all__ = ["Sm90Frontend", "H200_SM_COUNT"]

# SMs of an H200 / H100 SXM: the occupancy a compile-only build assumes (a real one asks the device).
H200_SM_COUNT = 132


class Sm90Frontend(MegaMoEFrontend):
    arch = "sm90"
    table = BACKENDS
    compile_only_sm_count = H200_SM_COUNT

    def symbols(self):
        from shim.sm90 import kernel_symbols

        return kernel_symbols

    def kernel_kwargs(self, knobs: Sm90Knobs) -> Dict[str, Any]:
        import cutlass

        # Every argument named, those moe_ep does not expose at the values the kernels were validated with
        # (the pinned drop's defaults), the exchange knobs at the knob set's value where it fixes one: a drop that
        # changes a default then changes nothing here, and the drop audit calls a new parameter with a default a
        # break until this says which value it wants. The exchange knobs only some kernels take: format_kwargs.
        ex = knobs.exchange_kwargs()
        return dict(
            mma_tiler_mnk=knobs.mma_tiler_mnk, cluster_shape_mnk=knobs.cluster_shape_mnk, use_2cta_instrs=False,
            group_hint=knobs.group_hint or self.max_active_clusters, token_padding_block=knobs.token_tile,
            load_balance_mode=knobs.load_balance_mode, static_expert_shape=self.static_expert_shape(),
            force_static_sched=True, clc_bundle_size=None, num_sched_stages=ex.get("num_sched_stages"),
            acc_dtype=cutlass.Float32, pingpong=knobs.pingpong, scenario="2Dx3D", world_size=self.world_size,
            local_rank=self.rank, num_topk=self.top_k, max_tokens_per_rank=self.max_tokens_per_rank,
            hidden=self.hidden_size, fc2_in_kernel_topk_reduce=knobs.fc2_in_kernel_topk_reduce, apply_topk_in_fc1=True,
            token_back_mode=knobs.token_back_mode, epi_flag_batch=knobs.epi_flag_batch,
            flag_batch=knobs.flag_batch, gate_up_clamp=self.spec.gate_up_clamp,
            fc1_store_offload=ex.get("fc1_store_offload", True),
            fc1_early_done_publish=ex.get("fc1_early_done_publish", False),
            active_dispatch_warps=ex.get("active_dispatch_warps", 1),
            fold_producer_warps=ex.get("fold_producer_warps", True), generate_c=False,
            tail_split_pairs=knobs.tail_split_pairs,
        )

    def check_kernel(self, kernel) -> None:
        # The packer's gate/up pairing (shim/sm90/weights.py) against both values the kernel reads: its class
        # attribute (the FC1 mainloop's) and the shared constant its epilogue imports.
        ks = self.symbols()
        for where, value in ((f"{type(kernel).__name__}.GateUpInterleave", getattr(kernel, "GateUpInterleave", None)),
                             ("common.megamoe_constants.Fp8GateUpInterleave", ks.Fp8GateUpInterleave)):
            if value != GATE_UP_INTERLEAVE:
                raise RuntimeError(f"the drop's {where} is {value}; the weight packer interleaves gate/up rows in "
                                   f"groups of {GATE_UP_INTERLEAVE}")

    def activation_args(self, b, rows: int):
        return dict(activation=b.tensor(self.act[:rows]), fc1_c=None)
