"""What the Blackwell frontends share: the tree's symbols, the constructor arguments every Blackwell kernel takes,
the gate/up pairing check, and (module functions, for the two block-scaled formats) the staging of quantized
activations with per-row block scales.

Everything a frontend does whatever the tree (kernel object -> workspace sizes -> symmetric buffers -> one
compile -> padded launch) is shim.common.frontend.MegaMoEFrontend; the format frontends
(shim/sm100/{nvfp4,mxfp8,bf16}_frontend.py, one class per format directly on Sm100Frontend) say which kernel and
constructor arguments, which peer-read buffers and how to fill them, what the launch passes, and own their weight
layouts (the helpers those share: shim/sm100/weights.py). The device (a Blackwell GPU) is checked once, by the
layer before the backend is imported (moe_ep.core.device.require_arch); a compile without one needs CUTE_DSL_ARCH
(shim/common/backend.py check_compile_target). Launch policy (shared with the Hopper tree, whose
token-communication code these kernels share): inputs are capacity-sized with spare rows routed to expert
-1; the top-k reduce covers the T real rows.

All three fold the routing weight into the SwiGLU output (apply_topk_in_fc1: a constructor flag of the NVFP4
and BF16 kernels, always on in the MXFP8 kernel), reduce the top-k terms in the kernel's own
TopkReduce (skip_topk_reduce=False) and combine in bf16.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from shim.common.cute_args import ArgBuilder
from shim.common.frontend import MegaMoEFrontend
from shim.common.weights import round_up
from shim.sm100.formats import BACKENDS
from shim.sm100.knobs import Sm100Knobs

__all__ = ["B200_SM_COUNT", "Sm100Frontend", "tensor_workspaces", "scale_cols", "check_scale_row",
           "block_scaled_buffers", "block_scaled_activation_args", "block_scaled_weight_args", "write_staged",
           "staged_scales"]

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

        # Every argument named (those moe_ep does not expose at the pinned drop's defaults), so that the drop audit
        # can call a new parameter with a default a break until the shim says which value it wants. The in-kernel
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
        want = self.weights_layout.interleave
        if self.kernel_interleave() != want:
            raise RuntimeError(f"the drop's {self.fmt} kernel pairs gate/up rows in groups of "
                               f"{self.kernel_interleave()}; the weight packer assumes {want}")


def tensor_workspaces(fe: Sm100Frontend, b: ArgBuilder, *, static_shared: bool) -> Dict[str, Any]:
    """The MXFP8 and BF16 kernels take their workspaces as 1-D byte tensors (they use `.iterator`), as the
    drop's runners pass them: the local one with its extent compiled in; the shared one too for MXFP8 (its
    runner: the extent can exceed int32), dynamic for BF16. Static extents are fixed by the kernel's
    configuration, which the compile key already holds."""
    shared = b.static_tensor(fe.shared_ws) if static_shared else b.tensor(fe.shared_ws)
    return dict(local_workspace=b.static_tensor(fe.local_ws), shared_workspace=shared)


# --------------------------------------------------------------------------- block-scaled formats (NVFP4, MXFP8)
# Quantized activations with per-row block scales, weight scales swizzled (the layout's `scale_block` elements a
# scale along K).
def scale_cols(fe: Sm100Frontend) -> int:
    """Scale columns per staged row: H / block, padded to whole 4-byte words."""
    return round_up(fe.hidden_size // fe.weights_layout.scale_block, 4)


def check_scale_row(fe: Sm100Frontend, kernel) -> None:
    if kernel.sf_uint32_per_token * 4 != scale_cols(fe):
        raise RuntimeError(f"the {fe.fmt} kernel pulls {kernel.sf_uint32_per_token * 4} scale bytes per token; "
                           f"the frontend stages {scale_cols(fe)}")


def block_scaled_buffers(fe: Sm100Frontend, act_shape: Tuple[int, ...], act_dtype: torch.dtype,
                         scale_dtype: torch.dtype) -> List[Tuple[str, Tuple[int, ...], torch.dtype]]:
    c = fe.max_tokens_per_rank
    return [("act", (c,) + tuple(act_shape), act_dtype), ("act_sf", (c, scale_cols(fe)), scale_dtype)]


def block_scaled_activation_args(fe: Sm100Frontend, b: ArgBuilder, rows: int) -> Dict[str, Any]:
    return dict(activation=b.tensor(fe.act[:rows]), activation_sf=b.tensor(fe.act_sf[:rows]), num_valid_tokens=None)


def block_scaled_weight_args(b: ArgBuilder, w) -> Dict[str, Any]:
    return dict(fc1_weight=b.tensor(w.fc1), fc1_weight_sf=b.tensor(w.fc1_sf), fc2_weight=b.tensor(w.fc2),
                fc2_weight_sf=b.tensor(w.fc2_sf))


def write_staged(fe: Sm100Frontend, t: int, q: torch.Tensor, sf: torch.Tensor) -> None:
    fe.act[:t].view(torch.uint8).copy_(q.view(torch.uint8))
    fe.act_sf[:t, : sf.shape[1]].view(torch.uint8).copy_(sf.view(torch.uint8))
    if sf.shape[1] < scale_cols(fe):
        # The word padding dispatch moves with each row is zero, as the drop's runners stage it; the staging
        # arena is shared by every layer, so it is written every call, not once.
        fe.act_sf[:t, sf.shape[1]:].view(torch.uint8).zero_()


def staged_scales(fe: Sm100Frontend, t: int) -> torch.Tensor:
    return fe.act_sf[:t, : fe.hidden_size // fe.weights_layout.scale_block].clone()
