"""The Blackwell MXFP8 MegaMoE frontend (`moe_mxfp8_glu.Sm100MegaMoEMxfp8Kernel`), and its weight layout (e4m3,
K-major, FC1's rows interleaved by 32, e8m0 block scales swizzled: shim/sm100/weights.py).

Activations e4m3 [C, H] with e8m0 scales per 32, rows padded like NVFP4; the workspaces are passed as 1-D byte
tensors with static extents (this kernel takes their `.iterator`), not raw pointers. Each expert's pool rows
are padded to 128 tokens (one scale atom). After its top-k reduce the launch re-quantizes the rank's received
FC1 input along the token axis (the drop's `Mxfp8ColRequant`, a copy for a backward pass) into two rank-local
outputs the caller must hand it, `col_quant_data` [pool rows, H] e4m3 and `col_quant_sf` (H * pool rows / 32
e8m0 bytes); moe_ep serves the forward only, so nothing reads them, but they are sized as the drop's runner
sizes them, from the kernel's `pool_token_capacity` (about pool rows x H bytes per rank, shim/sm100/README.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_ep.formats import QuantizedActivation, QuantizedWeights, codecs
from shim.common.weights import KernelWeights, kernel_tensors, read_experts, store_experts
from shim.common.workspace import BufferSpec
from shim.sm100.frontend import (Sm100Frontend, block_scaled_activation_args, block_scaled_buffers,
                                 block_scaled_weight_args, check_scale_row, staged_scales, tensor_workspaces,
                                 write_staged)
from shim.sm100.weights import empty_scales, read_scales, store_scales

__all__ = ["Sm100Mxfp8Frontend", "Sm100Mxfp8Weights"]


@dataclass
class Sm100Mxfp8Weights(KernelWeights):
    fmt = "mxfp8"
    interleave = 32  # the kernel's GateUpInterleave, checked against the drop at kernel build
    scale_block = codecs.MX_BLOCK
    expert_offset: int
    fc1: torch.Tensor  # (E, H, 2I) e4m3, K-major, gate/up interleaved
    fc2: torch.Tensor  # (E, I, H) e4m3, K-major
    fc1_sf: torch.Tensor  # (E, swizzled) e8m0, over the interleaved rows
    fc2_sf: torch.Tensor  # (E, swizzled) e8m0

    @classmethod
    def empty(cls, experts, hidden, intermediate, device, expert_offset):
        return cls(expert_offset, *kernel_tensors(experts, hidden, intermediate, torch.float8_e4m3fn, device),
                   *empty_scales(experts, hidden, intermediate, cls.scale_block, torch.float8_e8m0fnu, device))

    def store(self, rows, qw):
        store_experts(self.fc1, self.fc2, rows, qw.w13_q, qw.w2_q, self.interleave)
        store_scales(self.fc1_sf, self.fc2_sf, rows, qw.w13_scale, qw.w2_scale, self.interleave)

    def canonical(self) -> QuantizedWeights:
        w13, w2 = read_experts(self.fc1, self.fc2, self.interleave)
        sf13, sf2 = read_scales(self.fc1_sf, self.fc2_sf, self.fc2.shape[2], self.fc2.shape[1], self.scale_block,
                                self.interleave)
        return QuantizedWeights(self.fmt, w13, w2, sf13, sf2, expert_offset=self.expert_offset)


class Sm100Mxfp8Frontend(Sm100Frontend):
    fmt = "mxfp8"
    weights_layout = Sm100Mxfp8Weights

    def kernel_class(self, knobs):
        return self.symbols().Sm100MegaMoEMxfp8Kernel

    def kernel_interleave(self) -> int:
        return int(self.symbols().Sm100MegaMoEMxfp8Kernel.GateUpInterleave)

    def check_kernel(self, kernel) -> None:
        super().check_kernel(kernel)
        check_scale_row(self, kernel)

    def format_kwargs(self, knobs):
        import cutlass

        ks = self.symbols()
        # No apply_topk_in_fc1: this kernel always folds the routing weight into FC1.
        # Pool rows padded per expert to one 128-row scale atom, as the drop's runner does: the column
        # re-quantization works in whole 128-token tiles and refuses the 64-token epilogue tile.
        return dict(token_padding_block=int(ks.SfPaddingBlock), sf_padding_block=ks.SfPaddingBlock,
                    ab_dtype=cutlass.Float8E4M3FN, sf_vec_size=ks.Mxfp8BlockSize, local_rank=self.rank,
                    generate_c=False, use_stg_fc1=False, combine_format=ks.CombineFormat.parse("bf16"),
                    fc2_in_kernel_topk_reduce=knobs.fc2_in_kernel_topk_reduce, col_quant_num_ctas=2368,
                    act_func="swiglu", topk_reduce_persistent=False)

    def input_buffers(self):
        return block_scaled_buffers(self, (self.hidden_size,), torch.float8_e4m3fn, torch.float8_e8m0fnu)

    def col_quant_shapes(self):
        """(data shape, scale bytes) of the column re-quantization outputs, from the kernel's pool size: every
        received token row at its padded pool position, one e8m0 scale per 32 tokens and hidden column."""
        pool = int(self.kernel.pool_token_capacity)
        return (pool, self.hidden_size), self.hidden_size * pool // Sm100Mxfp8Weights.scale_block

    def kernel_buffers(self):
        # Rank-local (no peer reads them), sized by the kernel's layout; the kernel overwrites what it writes.
        data_shape, sf_bytes = self.col_quant_shapes()
        return [BufferSpec("col_quant_data", data_shape, torch.float8_e4m3fn, False),
                BufferSpec("col_quant_sf", (sf_bytes,), torch.uint8, False)]

    def activation_args(self, b, rows: int):
        return dict(block_scaled_activation_args(self, b, rows), fc1_c=None)

    def weight_args(self, b, w: Sm100Mxfp8Weights):
        return block_scaled_weight_args(b, w)

    def output_args(self, b, out):
        return dict(super().output_args(b, out), col_quant_data=b.tensor(self.col_quant_data),
                    col_quant_sf=b.tensor(self.col_quant_sf))

    def workspace_args(self, b):
        return tensor_workspaces(self, b, static_shared=True)

    def stage_activations(self, x: torch.Tensor) -> None:
        q, sf = codecs.mxfp8_quantize(x)
        write_staged(self, x.shape[0], q, sf)

    def staged_activation(self, t: int) -> QuantizedActivation:
        return QuantizedActivation(self.fmt, self.act[:t].clone(), staged_scales(self, t))
