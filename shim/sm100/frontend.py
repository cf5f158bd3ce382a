"""The Blackwell MegaMoE frontends: NVFP4 (`moe_nvfp4_swapab`), MXFP8 (`moe_mxfp8_glu`), BF16 (`moe_bf16_glu`).

Everything a frontend does whatever the tree (knobs -> kernel object -> workspace sizes -> symmetric
buffers -> one compile -> padded launch) is shim.common.frontend.MegaMoEFrontend; this module says, per
format, which kernel and constructor arguments, which peer-read buffers and how to fill them, and what the
launch passes. Launch policy (shared with the Hopper tree, whose token-communication code these kernels
share): inputs are capacity-sized with spare rows routed to expert -1; the top-k reduce covers the T real
rows.

Per format (facts from the drop's kernels and runners, 0.7.4):
  * NVFP4 (swap-AB): activations e2m1 pairs [C, H/2] with e4m3 scales per 16 in plain row-major layout,
    each row padded with zeros to a multiple of 4 scales (dispatch moves scales 4 bytes at a time);
    weights and scales as shim.sm100.weights lays them out; per-expert fc1_alpha, fc2_alpha,
    fc1_norm_const; the FC1 input global scale comes from the calibrated amax (static activation scale).
  * MXFP8: activations e4m3 [C, H] with e8m0 scales per 32, rows padded like NVFP4; the workspaces are
    passed as 1-D byte tensors with static extents (this kernel takes their `.iterator`), not raw pointers.
    Each expert's pool rows are padded to 128 tokens (one scale atom). After its top-k reduce the launch
    re-quantizes the rank's received FC1 input along the token axis (the drop's `Mxfp8ColRequant`, a copy
    for a backward pass) into two rank-local outputs the caller must hand it, `col_quant_data`
    [pool rows, H] e4m3 and `col_quant_sf` (H * pool rows / 32 e8m0 bytes); moe_ep serves the forward
    only, so nothing reads them, but they are sized as the drop's runner sizes them, from the kernel's
    `pool_token_capacity`.
  * BF16: activations bf16 [C, H], no scales; the kernel stages one bf16 term per (token, slot) in its
    shared workspace and its own TopkReduce sums them into `output_activation` [T, H] (fp32, slot order,
    rounded once: the drop's "form A"); with the in-kernel reduce `output_activation` is the symmetric
    [C, H] target the ranks add into.
All three fold the routing weight into the SwiGLU output (apply_topk_in_fc1: a constructor flag of the NVFP4
and BF16 kernels, always on in the MXFP8 kernel since 0.7.4), reduce the top-k terms in the kernel's own
TopkReduce (skip_topk_reduce=False) and combine in bf16.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

import torch

from moe_ep.reference import quant
from moe_ep.reference.quant import QuantizedActivation
from shim.common.cute_args import ArgBuilder
from shim.common.frontend import MegaMoEFrontend
from shim.sm100 import limits
from shim.sm100 import weights as sm100_weights
from shim.sm100.knobs import IKR_KWARG, InvalidKnobsError, Sm100Knobs, resolve_knobs
from shim.sm100.weights import GATE_UP_INTERLEAVE, SCALE_BLOCK, pack_e2m1, round_up, unpack_e2m1

__all__ = ["B200_SM_COUNT", "Sm100Frontend", "Nvfp4Frontend", "Mxfp8Frontend", "Bf16Frontend", "FRONTENDS",
           "make_frontend"]

# SMs of a B200 / GB200: the occupancy a compile-only build assumes (a real one asks the device).
B200_SM_COUNT = 148


class Sm100Frontend(MegaMoEFrontend):
    arch = "sm100"
    fmt = ""

    def __init__(self, *, hidden: int, intermediate: int, top_k: int, compile_only: bool = False,
                 device=None, max_active_clusters: Optional[int] = None, **kw):
        for argument, message in limits.size_violations(self.fmt, hidden=hidden, intermediate=intermediate,
                                                        top_k=top_k):
            raise ValueError(f"{argument}: {message}")
        if compile_only:
            arch = os.environ.get("CUTE_DSL_ARCH", "")
            on_blackwell = not arch and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10
            if not (arch.startswith(("sm_100", "sm_103")) or on_blackwell):
                raise RuntimeError("a compile-only sm100 build targets sm_100a: set CUTE_DSL_ARCH=sm_100a in the "
                                   f"environment before cutlass is imported (it is {arch or 'unset'})")
        else:
            dev = torch.device(device or "cuda")
            if not torch.cuda.is_available():
                raise RuntimeError("the sm100 MegaMoE kernels need a Blackwell (sm_100) GPU; this host has no "
                                   "CUDA device (use compile_only=True with CUTE_DSL_ARCH=sm_100a to only compile)")
            major, minor = torch.cuda.get_device_capability(dev)
            if major != 10:
                raise RuntimeError(f"the sm100 MegaMoE kernels need a Blackwell (sm_100) GPU; {dev} is "
                                   f"sm_{major}{minor}")
        super().__init__(hidden=hidden, intermediate=intermediate, top_k=top_k, compile_only=compile_only,
                         device=device, max_active_clusters=max_active_clusters, **kw)
        if compile_only and max_active_clusters is None:
            # The base assumes a Hopper part when it cannot ask the device; this tree runs on B200-class parts.
            self.max_active_clusters = B200_SM_COUNT // self.knobs.cluster_size
            if self.knobs.group_hint is None:
                self.kernel.group_hint = self.max_active_clusters

    # -- shared hooks --------------------------------------------------------------------------------------
    def symbols(self):
        from shim.sm100 import kernel_symbols

        return kernel_symbols

    def resolve_knobs(self, knobs, cache_key: str):
        return resolve_knobs(knobs, fmt=self.fmt, capacity=self.capacity, cache_key=cache_key)

    def kernel_kwargs(self, knobs: Sm100Knobs) -> Dict[str, Any]:
        """Constructor arguments every sm100 kernel takes the same way."""
        return dict(
            mma_tiler_mnk=knobs.mma_tiler_mnk, cluster_shape_mnk=knobs.cluster_shape_mnk,
            use_2cta_instrs=knobs.use_2cta_instrs, group_hint=knobs.group_hint or 1,
            load_balance_mode=knobs.load_balance_mode,
            static_expert_shape=(self.experts_per_rank, 2 * self.intermediate, self.hidden),
            world_size=self.world_size, num_topk=self.top_k, max_tokens_per_rank=self.capacity, hidden=self.hidden,
            token_back_mode=knobs.token_back_mode, epi_flag_batch=knobs.epi_flag_batch, flag_batch=knobs.flag_batch,
            gate_up_clamp=self.gate_up_clamp,
            # The kernel's own TopkReduce writes output_activation (without the in-kernel reduce).
            skip_topk_reduce=False,
            **{IKR_KWARG[self.fmt]: knobs.fc2_in_kernel_topk_reduce},
        )

    def kernel_class(self):
        raise NotImplementedError

    def format_kwargs(self) -> Dict[str, Any]:
        raise NotImplementedError

    def kernel_interleave(self) -> int:
        """The kernel's SwiGLU gate/up pairing, read from the drop."""
        raise NotImplementedError

    def build_kernel(self, knobs: Sm100Knobs):
        if self.kernel_interleave() != GATE_UP_INTERLEAVE[self.fmt]:
            raise RuntimeError(f"the drop's {self.fmt} kernel pairs gate/up rows in groups of "
                               f"{self.kernel_interleave()}; the weight packer assumes {GATE_UP_INTERLEAVE[self.fmt]}")
        try:
            kernel = self.kernel_class()(**self.kernel_kwargs(knobs), **self.format_kwargs())
        except (ValueError, NotImplementedError, AssertionError, TypeError) as e:
            raise InvalidKnobsError("knobs", f"the {self.fmt} kernel rejects {knobs}: {e}") from e
        self.check_kernel(kernel)
        return kernel

    def check_kernel(self, kernel) -> None:
        """Cross-check what the kernel object derived against the buffers this frontend will hand it."""

    def prepare_weights(self, w13, w2):
        return sm100_weights.prepare_weights(self.fmt, w13, w2, self.device,
                                             expert_offset=self.rank * self.experts_per_rank)

    def _placeholder(self):
        return sm100_weights.placeholder_weights(self.fmt, self.experts_per_rank, self.hidden, self.intermediate,
                                                 device=self.device)

    def _mapper(self):
        return self.symbols().SymBufferHost(base_addr=self.peer_base, offsets=tuple(self.peer_offsets),
                                            rank_idx=self.rank, num_max_ranks=self.world_size)

    def workspace_args(self, b: ArgBuilder) -> Dict[str, Any]:
        return dict(local_workspace=b.byte_ptr(self.local_ws), shared_workspace=b.byte_ptr(self.shared_ws))

    def output_args(self, b: ArgBuilder, out: torch.Tensor) -> Dict[str, Any]:
        return dict(output_activation=b.tensor(out))

    def _runtime_args(self, b: ArgBuilder, rows: int, out: torch.Tensor) -> dict:
        if self._weights is None:
            self._weights = self._placeholder()
        args = self.activation_args(b, rows)
        args.update(topk_idx=b.tensor(self.topk_idx[:rows]), topk_weights=b.tensor(self.topk_w[:rows]))
        args.update(self.weight_args(b, self._weights))
        args.update(self.output_args(b, out))
        args.update(self.workspace_args(b))
        args.update(peer_rank_ptr_mapper_host=self._mapper(), stream=b.stream())
        return args

    # -- what moe_ep reads back ------------------------------------------------------------------------------
    def symmetric_bytes(self) -> int:
        """Bytes this workspace holds on the NVSHMEM heap (every rank the same)."""
        names = ["shared_ws", "topk_w"] + [n for n, _, _ in self.input_buffers()]
        total = sum(getattr(self, n).numel() * getattr(self, n).element_size() for n in names)
        if self.sym_out is not None:
            total += self.sym_out.numel() * self.sym_out.element_size()
        return total

    def staged_activation(self, t: int) -> QuantizedActivation:
        raise NotImplementedError


def _tensor_workspaces(f: Sm100Frontend, b: ArgBuilder, *, static_shared: bool) -> Dict[str, Any]:
    """The MXFP8 and BF16 kernels take their workspaces as 1-D byte tensors (they use `.iterator`), as the
    drop's runners pass them: the local one with its extent compiled in; the shared one too for MXFP8 (its
    0.7.4 runner: the extent can exceed int32), dynamic for BF16. Static extents are fixed by the kernel's
    configuration, which the compile key already holds."""
    shared = b.static_tensor(f.shared_ws) if static_shared else b.tensor(f.shared_ws)
    return dict(local_workspace=b.static_tensor(f.local_ws), shared_workspace=shared)


class _BlockScaledFrontend(Sm100Frontend):
    """NVFP4 and MXFP8: quantized activations plus per-row block scales, weight scales swizzled."""

    act_dtype: torch.dtype
    scale_dtype: torch.dtype

    @property
    def scale_cols(self) -> int:
        """Scale columns per staged row: H / block, padded to whole 4-byte words."""
        return round_up(self.hidden // SCALE_BLOCK[self.fmt], 4)

    def check_kernel(self, kernel) -> None:
        if kernel.sf_uint32_per_token * 4 != self.scale_cols:
            raise RuntimeError(f"the {self.fmt} kernel pulls {kernel.sf_uint32_per_token * 4} scale bytes per token; "
                               f"the frontend stages {self.scale_cols}")

    def act_shape(self):
        raise NotImplementedError

    def input_buffers(self):
        c = self.capacity
        return [("act", (c,) + self.act_shape(), self.act_dtype), ("act_sf", (c, self.scale_cols), self.scale_dtype)]

    def activation_args(self, b, rows: int):
        return dict(activation=b.tensor(self.act[:rows]), activation_sf=b.tensor(self.act_sf[:rows]))

    def weight_args(self, b, w):
        return dict(fc1_weight=b.tensor(w.fc1), fc1_weight_sf=b.tensor(w.fc1_sf), fc2_weight=b.tensor(w.fc2),
                    fc2_weight_sf=b.tensor(w.fc2_sf))

    def _write_staged(self, t: int, q: torch.Tensor, sf: torch.Tensor) -> None:
        self.act[:t].view(torch.uint8).copy_(q.view(torch.uint8))
        self.act_sf[:t, : sf.shape[1]].view(torch.uint8).copy_(sf.view(torch.uint8))


class Nvfp4Frontend(_BlockScaledFrontend):
    fmt = "nvfp4"
    act_dtype = torch.float4_e2m1fn_x2
    scale_dtype = torch.float8_e4m3fn

    def kernel_class(self):
        return self.symbols().Sm100MegaMoEKernel

    def kernel_interleave(self) -> int:
        return int(self.symbols().SwapABSwigluFp4Epilogue._EpilogueFc1GateUpInterleave)

    def format_kwargs(self):
        import cutlass

        ks = self.symbols()
        return dict(token_padding_block=int(ks.SwapABSwigluFp4Epilogue._EpilogueTokenTileSize),
                    sf_padding_block=ks.SfPaddingBlock, sf_vec_size=ks.Nvfp4BlockSize,
                    fc2_output_dtype=cutlass.BFloat16, combine_format=ks.CombineFormat.parse("bf16"),
                    non_ubulk_fc2_store=True, apply_topk_in_fc1=True)

    def act_shape(self):
        return (self.hidden // 2,)

    def weight_args(self, b, w):
        args = super().weight_args(b, w)
        args.update(fc1_alpha=b.tensor(w.fc1_alpha, 4), fc2_alpha=b.tensor(w.fc2_alpha, 4),
                    fc1_norm_const=b.tensor(w.fc1_norm_const, 4))
        return args

    def calibrate(self, act_amax: Optional[float], fc2_act_amax: Optional[float]) -> None:
        """The static activation calibration load_weights() quantizes with (moe_ep ExpertWeights fields)."""
        self._act_amax, self._fc2_act_amax = act_amax, fc2_act_amax

    def prepare_weights(self, w13, w2):
        return sm100_weights.prepare_weights(self.fmt, w13, w2, self.device,
                                             expert_offset=self.rank * self.experts_per_rank,
                                             act_amax=getattr(self, "_act_amax", None),
                                             fc2_act_amax=getattr(self, "_fc2_act_amax", None))

    def stage_activations(self, x: torch.Tensor) -> None:
        codes, sf = quant.nvfp4_quantize(x, self._weights.act_scale.reshape(1, 1))
        self._write_staged(x.shape[0], pack_e2m1(codes), sf)

    def staged_activation(self, t: int) -> QuantizedActivation:
        h = self.hidden
        return QuantizedActivation("nvfp4", unpack_e2m1(self.act[:t]),
                                   self.act_sf[:t, : h // SCALE_BLOCK["nvfp4"]].clone())


class Mxfp8Frontend(_BlockScaledFrontend):
    fmt = "mxfp8"
    act_dtype = torch.float8_e4m3fn
    scale_dtype = torch.float8_e8m0fnu

    def kernel_class(self):
        return self.symbols().Sm100MegaMoEMxfp8Kernel

    def kernel_interleave(self) -> int:
        return int(self.symbols().Sm100MegaMoEMxfp8Kernel.GateUpInterleave)

    def format_kwargs(self):
        import cutlass

        ks = self.symbols()
        # No apply_topk_in_fc1: since 0.7.4 this kernel always folds the routing weight into FC1.
        # Pool rows padded per expert to one 128-row scale atom, as the drop's runner does: the column
        # re-quantization works in whole 128-token tiles and refuses the 64-token epilogue tile.
        return dict(token_padding_block=int(ks.SfPaddingBlock), sf_padding_block=ks.SfPaddingBlock,
                    ab_dtype=cutlass.Float8E4M3FN, sf_vec_size=ks.Mxfp8BlockSize, local_rank=self.rank,
                    generate_c=False, use_stg_fc1=False, combine_format=ks.CombineFormat.parse("bf16"))

    def act_shape(self):
        return (self.hidden,)

    def col_quant_shapes(self):
        """(data shape, scale bytes) of the column re-quantization outputs, from the kernel's pool size: every
        received token row at its padded pool position, one e8m0 scale per 32 tokens and hidden column."""
        pool = int(self.kernel.pool_token_capacity)
        return (pool, self.hidden), self.hidden * pool // SCALE_BLOCK["mxfp8"]

    def _alloc(self) -> None:
        super()._alloc()
        # Rank-local (no peer reads them), on the device; the kernel overwrites what it writes each launch.
        data_shape, sf_bytes = self.col_quant_shapes()
        dev = self.device
        self.col_quant_data = torch.zeros(data_shape, dtype=torch.uint8, device=dev).view(self.act_dtype)
        self.col_quant_sf = torch.zeros((sf_bytes,), dtype=torch.uint8, device=dev)

    def activation_args(self, b, rows: int):
        args = super().activation_args(b, rows)
        args["fc1_c"] = None
        return args

    def output_args(self, b, out):
        args = super().output_args(b, out)
        args.update(col_quant_data=b.tensor(self.col_quant_data), col_quant_sf=b.tensor(self.col_quant_sf))
        return args

    def workspace_args(self, b):
        return _tensor_workspaces(self, b, static_shared=True)

    def stage_activations(self, x: torch.Tensor) -> None:
        q, sf = quant.mxfp8_quantize(x)
        self._write_staged(x.shape[0], q, sf)

    def staged_activation(self, t: int) -> QuantizedActivation:
        h = self.hidden
        return QuantizedActivation("mxfp8", self.act[:t].clone(), self.act_sf[:t, : h // SCALE_BLOCK["mxfp8"]].clone())


class Bf16Frontend(Sm100Frontend):
    fmt = "bf16"

    def kernel_class(self):
        return self.symbols().Sm100MegaMoEBf16Kernel

    def kernel_interleave(self) -> int:
        return int(self.symbols().Sm100MegaMoEBf16Kernel.GateUpInterleave)

    def format_kwargs(self):
        import cutlass

        ks = self.symbols()
        return dict(token_padding_block=int(ks.EpilogueTokenTile), ab_dtype=cutlass.BFloat16, local_rank=self.rank,
                    token_back_by_dispatch=self.knobs.token_back_by_dispatch, generate_c=False, use_stg_fc1=False,
                    apply_topk_in_fc1=True)

    def input_buffers(self):
        # The per-(token, slot) terms live in the kernel's shared workspace (0.7.4); only activations here.
        return [("act", (self.capacity, self.hidden), torch.bfloat16)]

    def activation_args(self, b, rows: int):
        return dict(activation=b.tensor(self.act[:rows]), fc1_c=None)

    def weight_args(self, b, w):
        return dict(fc1_weight=b.tensor(w.fc1), fc2_weight=b.tensor(w.fc2))

    def workspace_args(self, b):
        return _tensor_workspaces(self, b, static_shared=False)

    def stage_activations(self, x: torch.Tensor) -> None:
        self.act[: x.shape[0]].copy_(x)

    def staged_activation(self, t: int) -> QuantizedActivation:
        return QuantizedActivation("bf16", self.act[:t].clone())


FRONTENDS = {"nvfp4": Nvfp4Frontend, "mxfp8": Mxfp8Frontend, "bf16": Bf16Frontend}


def make_frontend(fmt: str, **kw) -> Sm100Frontend:
    if fmt not in FRONTENDS:
        raise ValueError(f"fmt must be one of {sorted(FRONTENDS)}, got {fmt!r}")
    return FRONTENDS[fmt](**kw)
