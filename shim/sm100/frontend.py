"""What the Blackwell frontends share: the tree's symbols, the constructor arguments every Blackwell kernel takes,
the Blackwell weight layout (shim/sm100/weights.py) and the block-scaled activation staging.

Everything a frontend does whatever the tree (kernel object -> workspace sizes -> symmetric buffers -> one
compile -> padded launch) is shim.common.frontend.MegaMoEFrontend; the format frontends
(shim/sm100/{nvfp4,mxfp8,bf16}_frontend.py) say which kernel and constructor arguments, which peer-read
buffers and how to fill them, and what the launch passes. The device (a Blackwell GPU) is checked once, by the
layer before the backend is imported (moe_ep.core.device.require_arch); a compile without one needs CUTE_DSL_ARCH
(shim/common/backend.py check_compile_target). Launch policy (shared with the Hopper tree, whose
token-communication code these kernels share): inputs are capacity-sized with spare rows routed to expert
-1; the top-k reduce covers the T real rows.

All three fold the routing weight into the SwiGLU output (apply_topk_in_fc1: a constructor flag of the NVFP4
and BF16 kernels, always on in the MXFP8 kernel since 0.7.4), reduce the top-k terms in the kernel's own
TopkReduce (skip_topk_reduce=False) and combine in bf16.
"""

from __future__ import annotations

from typing import Any, Dict

import torch

from shim.common.cute_args import ArgBuilder
from shim.common.frontend import MegaMoEFrontend
from shim.sm100 import weights as sm100_weights
from shim.sm100.formats import BACKENDS
from shim.sm100.knobs import Sm100Knobs
from shim.sm100.weights import GATE_UP_INTERLEAVE, SCALE_BLOCK, round_up

__all__ = ["B200_SM_COUNT", "Sm100Frontend", "BlockScaledFrontend", "tensor_workspaces"]

# SMs of a B200 / GB200: the occupancy a compile-only build assumes (a real one asks the device).
B200_SM_COUNT = 148


class Sm100Frontend(MegaMoEFrontend):
    arch = "sm100"
    table = BACKENDS
    compile_only_sm_count = B200_SM_COUNT

    def symbols(self):
        from shim.sm100 import kernel_symbols

        return kernel_symbols

    def kernel_kwargs(self, knobs: Sm100Knobs) -> Dict[str, Any]:
        import cutlass

        # Every argument named (those moe_ep does not expose at drop 0.7.4's defaults), so that the drop audit can
        # call a new parameter with a default a break until the shim says which value it wants. The in-kernel
        # reduce's own name (the row's reduce_kwarg) is passed literally by each format.
        return dict(
            mma_tiler_mnk=knobs.mma_tiler_mnk, cluster_shape_mnk=knobs.cluster_shape_mnk,
            use_2cta_instrs=knobs.use_2cta_instrs, group_hint=knobs.group_hint or self.max_active_clusters,
            load_balance_mode=knobs.load_balance_mode, static_expert_shape=self.static_expert_shape(),
            force_static_sched=True, clc_bundle_size=None, num_sched_stages=None, acc_dtype=cutlass.Float32,
            scenario="2Dx3D", world_size=self.world_size, num_topk=self.top_k,
            max_tokens_per_rank=self.max_tokens_per_rank, hidden=self.hidden_size,
            token_back_mode=knobs.token_back_mode, epi_flag_batch=knobs.epi_flag_batch, flag_batch=knobs.flag_batch,
            gate_up_clamp=self.spec.gate_up_clamp,
            # The kernel's own TopkReduce writes output_activation (without the in-kernel reduce).
            skip_topk_reduce=False,
        )

    def kernel_interleave(self) -> int:
        """The kernel's SwiGLU gate/up pairing, read from the drop (each format says where the drop states it)."""
        raise NotImplementedError

    def check_kernel(self, kernel) -> None:
        if self.kernel_interleave() != GATE_UP_INTERLEAVE[self.fmt]:
            raise RuntimeError(f"the drop's {self.fmt} kernel pairs gate/up rows in groups of "
                               f"{self.kernel_interleave()}; the weight packer assumes {GATE_UP_INTERLEAVE[self.fmt]}")

    def prepare_weights(self, weights):
        return sm100_weights.prepare(self.fmt, weights, self.device)

    def placeholder_weights(self):
        return sm100_weights.placeholder_weights(self.fmt, self.experts_per_rank, self.hidden_size,
                                                 self.intermediate_size, device=self.device)


def tensor_workspaces(f: Sm100Frontend, b: ArgBuilder, *, static_shared: bool) -> Dict[str, Any]:
    """The MXFP8 and BF16 kernels take their workspaces as 1-D byte tensors (they use `.iterator`), as the
    drop's runners pass them: the local one with its extent compiled in; the shared one too for MXFP8 (its
    0.7.4 runner: the extent can exceed int32), dynamic for BF16. Static extents are fixed by the kernel's
    configuration, which the compile key already holds."""
    shared = b.static_tensor(f.shared_ws) if static_shared else b.tensor(f.shared_ws)
    return dict(local_workspace=b.static_tensor(f.local_ws), shared_workspace=shared)


class BlockScaledFrontend(Sm100Frontend):
    """NVFP4 and MXFP8: quantized activations plus per-row block scales, weight scales swizzled."""

    act_dtype: torch.dtype
    scale_dtype: torch.dtype

    @property
    def scale_cols(self) -> int:
        """Scale columns per staged row: H / block, padded to whole 4-byte words."""
        return round_up(self.hidden_size // SCALE_BLOCK[self.fmt], 4)

    def check_kernel(self, kernel) -> None:
        super().check_kernel(kernel)
        if kernel.sf_uint32_per_token * 4 != self.scale_cols:
            raise RuntimeError(f"the {self.fmt} kernel pulls {kernel.sf_uint32_per_token * 4} scale bytes per token; "
                               f"the frontend stages {self.scale_cols}")

    def act_shape(self):
        raise NotImplementedError

    def input_buffers(self):
        c = self.max_tokens_per_rank
        return [("act", (c,) + self.act_shape(), self.act_dtype), ("act_sf", (c, self.scale_cols), self.scale_dtype)]

    def activation_args(self, b, rows: int):
        return dict(activation=b.tensor(self.act[:rows]), activation_sf=b.tensor(self.act_sf[:rows]),
                    num_valid_tokens=None)

    def weight_args(self, b, w):
        return dict(fc1_weight=b.tensor(w.fc1), fc1_weight_sf=b.tensor(w.fc1_sf), fc2_weight=b.tensor(w.fc2),
                    fc2_weight_sf=b.tensor(w.fc2_sf))

    def _write_staged(self, t: int, q: torch.Tensor, sf: torch.Tensor) -> None:
        self.act[:t].view(torch.uint8).copy_(q.view(torch.uint8))
        self.act_sf[:t, : sf.shape[1]].view(torch.uint8).copy_(sf.view(torch.uint8))
        if sf.shape[1] < self.scale_cols:
            # The word padding dispatch moves with each row is zero, as the drop's runners stage it; the staging
            # arena is shared by every layer, so it is written every call, not once.
            self.act_sf[:t, sf.shape[1]:].view(torch.uint8).zero_()

    def staged_scales(self, t: int) -> torch.Tensor:
        return self.act_sf[:t, : self.hidden_size // SCALE_BLOCK[self.fmt]].clone()
