"""The Hopper FP8 MegaMoE frontend: one workspace, one compiled kernel, one launch per forward.

Life of a layer:
  1. knobs are resolved once from the capacity (explicit > knob cache > the
     drop's heuristic) and the kernel object is built (which validates them);
  2. buffers are allocated collectively: the kernel's shared workspace first on
     the NVSHMEM heap (its base anchors the peer-offset table), then the
     peer-read inputs (FP8 activations, their scales, routing weights); the
     local workspace and routing indices in plain device memory;
  3. `cute.compile` once, with capacity-sized tensors whose extents are
     dynamic, so one program serves every token count up to the capacity;
  4. each forward quantizes the bf16 activations into the symmetric buffers
     (1x128 blocks) and launches the compiled kernel on the current stream.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from shim.common import compile_cache
from shim.common.cute_args import ArgBuilder
from shim.sm90 import fp8_weights
from shim.sm90.knobs import SCALE_MODES, Fp8Knobs, InvalidKnobsError, resolve_knobs

__all__ = ["Sm90Fp8Frontend", "H200_SM_COUNT"]

H200_SM_COUNT = 132
ACT_BLOCK = 128


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


class Sm90Fp8Frontend:
    def __init__(self, *, hidden: int, intermediate: int, experts_per_rank: int, top_k: int, capacity: int,
                 rank: int = 0, world_size: int = 1, group=None, device=None, fmt: str = "fp8_block",
                 knobs=None, gate_up_clamp: Optional[float] = None, knob_cache_key: str = "",
                 compile_only: bool = False, max_active_clusters: Optional[int] = None):
        if fmt not in SCALE_MODES:
            raise ValueError(f"fmt must be one of {sorted(SCALE_MODES)}, got {fmt!r}")
        if fmt != "fp8_block":
            raise NotImplementedError("fmt='fp8_tensor' needs calibrated static activation scales; "
                                      "moe_ep serves the blockwise program (fmt='fp8_block')")
        for name, value, div in (("hidden", hidden, 128), ("intermediate", intermediate, 128)):
            if value % div:
                raise ValueError(f"{name}={value} must be a multiple of {div} for blockwise FP8")
        self.hidden, self.intermediate, self.experts_per_rank = hidden, intermediate, experts_per_rank
        self.top_k, self.capacity, self.rank, self.world_size = top_k, capacity, rank, world_size
        self.fmt, self.gate_up_clamp, self.compile_only = fmt, gate_up_clamp, compile_only
        self.group = group
        self.device = torch.device("cpu") if compile_only else torch.device(device or "cuda")
        if not compile_only:
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
            # cutlass's HardwareInfo queries the driver directly: make sure the primary context exists.
            torch.empty(1, device=self.device)
        self.knobs, self.knob_source = resolve_knobs(knobs, fmt=fmt, capacity=capacity, cache_key=knob_cache_key)
        self.kernel = self._build_kernel(self.knobs)
        if max_active_clusters is None:
            cluster = self.knobs.cluster_shape_mnk[0] * self.knobs.cluster_shape_mnk[1]
            if compile_only:
                max_active_clusters = H200_SM_COUNT // cluster
            else:
                import cutlass.utils as cutlass_utils

                max_active_clusters = cutlass_utils.HardwareInfo().get_max_active_clusters(cluster)
        self.max_active_clusters = int(max_active_clusters)
        self._heap = None
        self._weights: Optional[fp8_weights.Fp8KernelWeights] = None
        self._args_cache: Dict[Tuple[int, int], dict] = {}
        self._alloc()
        self.compiled = None
        self.compiled_from_cache = False

    # -- build ---------------------------------------------------------------------------------------------
    def _build_kernel(self, knobs: Fp8Knobs):
        from shim.sm90 import kernel_symbols as ks

        if ks.Fp8GateUpInterleave != fp8_weights.GATE_UP_INTERLEAVE:
            raise RuntimeError(f"drop's Fp8GateUpInterleave={ks.Fp8GateUpInterleave}, the weight packer assumes "
                               f"{fp8_weights.GATE_UP_INTERLEAVE}")
        cls = ks.Sm90MegaMoESwapABFp8Kernel if knobs.swap_ab else ks.Sm90MegaMoEFp8Kernel
        group_hint = knobs.group_hint if knobs.group_hint is not None else 0  # fixed below once clusters known
        try:
            kernel = cls(
                mma_tiler_mnk=knobs.mma_tiler_mnk, cluster_shape_mnk=knobs.cluster_shape_mnk, use_2cta_instrs=False,
                group_hint=group_hint or 1, token_padding_block=knobs.token_tile, sf_padding_block=ks.SfPaddingBlock,
                load_balance_mode=knobs.load_balance_mode,
                static_expert_shape=(self.experts_per_rank, 2 * self.intermediate, self.hidden),
                ab_dtype=_cutlass_fp8(), sf_vec_size=ks.Fp8E8M0SfVecSize, fp8_scale_mode=SCALE_MODES[self.fmt],
                fp8_accum_mode=knobs.accum_mode, pingpong=knobs.pingpong,
                world_size=self.world_size, local_rank=self.rank, num_topk=self.top_k,
                max_tokens_per_rank=self.capacity, hidden=self.hidden,
                fc2_in_kernel_topk_reduce=knobs.fc2_in_kernel_topk_reduce, apply_topk_in_fc1=True,
                token_back_mode=knobs.token_back_mode, epi_flag_batch=knobs.epi_flag_batch,
                flag_batch=knobs.flag_batch, gate_up_clamp=self.gate_up_clamp,
                tail_split_pairs=knobs.tail_split_pairs,
            )
        except (ValueError, NotImplementedError, AssertionError, TypeError) as e:
            raise InvalidKnobsError("knobs", f"the kernel rejects {knobs}: {e}") from e
        if knobs.group_hint is None:
            kernel._moe_ep_group_hint_pending = True
        return kernel

    def _alloc(self) -> None:
        c, h, k, dev = self.capacity, self.hidden, self.top_k, self.device
        local_bytes, shared_bytes = self.kernel.get_workspace_sizes()
        self.sf_cols = _round_up(h // ACT_BLOCK, 4)
        if self.compile_only:
            z = lambda shape, dt: torch.zeros(shape, dtype=dt)  # noqa: E731
            self.shared_ws = z((shared_bytes,), torch.uint8)
            alloc = z
            self.peer_base, self.peer_offsets = 1 << 20, tuple(0 for _ in range(self.world_size))
        else:
            from shim.common.symmetric import SymmetricHeap

            self._heap = SymmetricHeap(group=self.group, rank=self.rank, world_size=self.world_size, device=dev)
            alloc = self._heap.zeros
            self.shared_ws = alloc((shared_bytes,), torch.uint8)
            self.peer_base, self.peer_offsets = self._heap.peer_offsets(self.shared_ws)
        self.act = alloc((c, h), torch.uint8).view(torch.float8_e4m3fn)
        self.act_sf = alloc((c, self.sf_cols), torch.float32)
        self.topk_w = alloc((c, k), torch.float32)
        in_kernel_reduce = self.knobs.fc2_in_kernel_topk_reduce
        self.sym_out = alloc((c, h), torch.bfloat16) if in_kernel_reduce else None
        local = (lambda shape, dt: torch.zeros(shape, dtype=dt, device=dev))
        self.local_ws = local((local_bytes,), torch.uint8)
        self.topk_idx = local((c, k), torch.int64)
        self.out_buf = local((c, h), torch.bfloat16) if self.sym_out is None else self.sym_out

    def load_weights(self, w13: torch.Tensor, w2: torch.Tensor) -> fp8_weights.Fp8KernelWeights:
        e, i, h = self.experts_per_rank, self.intermediate, self.hidden
        if tuple(w13.shape) != (e, 2 * i, h) or tuple(w2.shape) != (e, h, i):
            raise ValueError(f"expected w13 {(e, 2 * i, h)} and w2 {(e, h, i)}, got {tuple(w13.shape)} and "
                             f"{tuple(w2.shape)}")
        self._weights = fp8_weights.prepare_fp8_block_weights(w13, w2, self.device)
        return self._weights

    def _placeholder_weights(self) -> fp8_weights.Fp8KernelWeights:
        e, i, h = self.experts_per_rank, self.intermediate, self.hidden
        z = torch.zeros((e, 2 * i, h), dtype=torch.bfloat16)
        return fp8_weights.prepare_fp8_block_weights(z, torch.zeros((e, h, i), dtype=torch.bfloat16), self.device)

    def _runtime_args(self, b: ArgBuilder, t: int, out: torch.Tensor) -> dict:
        """Kernel arguments for a launch over the first `t` staged rows, writing `out`."""
        w = self._weights if self._weights is not None else self._placeholder_weights()
        from shim.sm90 import kernel_symbols as ks

        mapper = ks.SymBufferHost(base_addr=self.peer_base, offsets=tuple(self.peer_offsets), rank_idx=self.rank,
                                  num_max_ranks=self.world_size)
        return dict(
            activation=b.tensor(self.act[:t]), activation_sf=b.tensor(self.act_sf[:t]),
            topk_idx=b.tensor(self.topk_idx[:t]), topk_weights=b.tensor(self.topk_w[:t]),
            fc1_weight=b.tensor(w.fc1), fc1_weight_sf=b.tensor(w.fc1_scale),
            fc1_activation_dequant_scale=b.tensor(w.fc1_act_dequant, 4),
            fc1_weight_dequant_scale=b.tensor(w.fc1_w_dequant, 4),
            fc2_weight=b.tensor(w.fc2), fc2_weight_sf=b.tensor(w.fc2_scale),
            fc2_activation_dequant_scale=b.tensor(w.fc2_act_dequant, 4),
            fc2_weight_dequant_scale=b.tensor(w.fc2_w_dequant, 4),
            fc1_c=None, output_activation=b.tensor(out),
            local_workspace=b.byte_ptr(self.local_ws), shared_workspace=b.byte_ptr(self.shared_ws),
            peer_rank_ptr_mapper_host=mapper, stream=b.stream(),
        )

    def compile_key(self) -> tuple:
        return ("sm90_fp8", type(self.kernel).__name__, self.knobs, self.hidden, self.intermediate,
                self.experts_per_rank, self.top_k, self.capacity, self.world_size, self.rank, self.fmt,
                self.gate_up_clamp, self.max_active_clusters, self.compile_only)

    def compile(self):
        import cutlass.cute as cute

        if getattr(self.kernel, "_moe_ep_group_hint_pending", False):
            # One wave of clusters per scheduler group, as the drop's runner does when no hint is given.
            self.kernel.group_hint = self.max_active_clusters
        b = ArgBuilder(real=not self.compile_only)

        def build():
            kwargs = self._runtime_args(b, self.capacity, self.out_buf)
            kwargs["max_active_clusters"] = self.max_active_clusters
            return cute.compile(self.kernel, **kwargs)

        self.compiled, self.compiled_from_cache = compile_cache.get_or_compile(self.compile_key(), build)
        return self.compiled

    # -- run -----------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self._weights is None:
            raise RuntimeError("load_weights() must run before forward()")
        if self.compiled is None:
            self.compile()
        t = x.shape[0]
        if out is None:
            out = torch.empty((t, self.hidden), dtype=torch.bfloat16, device=self.device)
        # Token counts below the capacity run as a capacity-sized launch whose spare rows carry expert id -1
        # (dispatch skips them) -- see docs/shim.md for why the dynamic extent alone is not enough.
        # A rank with no tokens thus still joins the kernel's cross-rank barriers.
        tk = self._launch_rows(t)
        self._stage(x, topk_idx, topk_weights, tk)
        out_rows = tk if self.pad_output else max(t, 1)
        direct = out_rows == t and self.sym_out is None and out.is_contiguous() and out.data_ptr() % 16 == 0
        target = out if direct else self.out_buf[:out_rows]
        if self.sym_out is not None:
            self.sym_out[:out_rows].zero_()
        key = (tk, out_rows, target.data_ptr())
        args = self._args_cache.get(key)
        if args is None:
            if len(self._args_cache) > 64:
                self._args_cache.clear()
            args = self._args_cache[key] = self._runtime_args(ArgBuilder(real=True), tk, target)
        else:
            args["stream"] = ArgBuilder(real=True).stream()
        self.compiled(**args)
        if not direct and t > 0:
            out.copy_(self.out_buf[:t])
        return out

    # Measured on an H200 (tests/gpu/sm90_fp8_diag_tokens.py, drop 0.7.2.post1): launching with the inputs'
    # extent set to the token count gives wrong outputs for every T below the capacity (rel. L2 error ~1),
    # while capacity-sized inputs with masked spare rows are right at every T, and the top-k reduce may then
    # cover only the T real rows. So: inputs padded, output not.
    pad_inputs = True
    pad_output = False

    def _launch_rows(self, t: int) -> int:
        return self.capacity if self.pad_inputs else max(t, 1)

    def _stage(self, x, topk_idx, topk_weights, rows: int) -> None:
        t, h = x.shape
        if rows > t:
            self.topk_idx[t:rows].fill_(-1)
        if t == 0:
            return
        blocks = x.view(t, h // ACT_BLOCK, ACT_BLOCK).float()
        scale = (blocks.abs().amax(dim=-1) / fp8_weights.FP8_MAX).clamp_(min=fp8_weights.SCALE_FLOOR)
        q = (blocks / scale.unsqueeze(-1)).to(torch.float8_e4m3fn)
        self.act[:t].view(torch.uint8).copy_(q.view(t, h).view(torch.uint8))
        self.act_sf[:t, : h // ACT_BLOCK].copy_(scale)
        self.topk_idx[:t].copy_(topk_idx)
        self.topk_w[:t].copy_(topk_weights)

    def staged_activation(self, t: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """The FP8 activations and scales the kernel read for the last forward (for the oracle)."""
        return self.act[:t].clone(), self.act_sf[:t, : self.hidden // ACT_BLOCK].clone()

    def close(self) -> None:
        self._args_cache.clear()
        self.compiled = None
        if self._heap is not None:
            self._heap.close()
            self._heap = None


def _cutlass_fp8():
    import cutlass

    return cutlass.Float8E4M3FN
