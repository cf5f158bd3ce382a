"""The Blackwell MXFP8 MegaMoE frontend (`moe_mxfp8_glu.Sm100MegaMoEMxfp8Kernel`).

Activations e4m3 [C, H] with e8m0 scales per 32, rows padded like NVFP4; the workspaces are passed as 1-D byte
tensors with static extents (this kernel takes their `.iterator`), not raw pointers. Each expert's pool rows
are padded to 128 tokens (one scale atom). After its top-k reduce the launch re-quantizes the rank's received
FC1 input along the token axis (the drop's `Mxfp8ColRequant`, a copy for a backward pass) into two rank-local
outputs the caller must hand it, `col_quant_data` [pool rows, H] e4m3 and `col_quant_sf` (H * pool rows / 32
e8m0 bytes); moe_ep serves the forward only, so nothing reads them, but they are sized as the drop's runner
sizes them, from the kernel's `pool_token_capacity` (about pool rows x H bytes per rank, shim/sm100/README.md).
"""

from __future__ import annotations

import torch

from moe_ep.formats import QuantizedActivation, codecs
from shim.common.workspace import BufferSpec
from shim.sm100.frontend import BlockScaledFrontend, tensor_workspaces
from shim.sm100.weights import SCALE_BLOCK

__all__ = ["Sm100Mxfp8Frontend"]


class Sm100Mxfp8Frontend(BlockScaledFrontend):
    fmt = "mxfp8"
    act_dtype = torch.float8_e4m3fn
    scale_dtype = torch.float8_e8m0fnu

    def kernel_class(self, knobs):
        return self.symbols().Sm100MegaMoEMxfp8Kernel

    def kernel_interleave(self) -> int:
        return int(self.symbols().Sm100MegaMoEMxfp8Kernel.GateUpInterleave)

    def format_kwargs(self, knobs):
        import cutlass

        ks = self.symbols()
        # No apply_topk_in_fc1: since 0.7.4 this kernel always folds the routing weight into FC1.
        # Pool rows padded per expert to one 128-row scale atom, as the drop's runner does: the column
        # re-quantization works in whole 128-token tiles and refuses the 64-token epilogue tile.
        return dict(token_padding_block=int(ks.SfPaddingBlock), sf_padding_block=ks.SfPaddingBlock,
                    ab_dtype=cutlass.Float8E4M3FN, sf_vec_size=ks.Mxfp8BlockSize, local_rank=self.rank,
                    generate_c=False, use_stg_fc1=False, combine_format=ks.CombineFormat.parse("bf16"),
                    fc2_in_kernel_topk_reduce=knobs.fc2_in_kernel_topk_reduce, col_quant_num_ctas=2368,
                    act_func="swiglu", topk_reduce_persistent=False)

    def act_shape(self):
        return (self.hidden_size,)

    def col_quant_shapes(self):
        """(data shape, scale bytes) of the column re-quantization outputs, from the kernel's pool size: every
        received token row at its padded pool position, one e8m0 scale per 32 tokens and hidden column."""
        pool = int(self.kernel.pool_token_capacity)
        return (pool, self.hidden_size), self.hidden_size * pool // SCALE_BLOCK["mxfp8"]

    def kernel_buffers(self):
        # Rank-local (no peer reads them), sized by the kernel's layout; the kernel overwrites what it writes.
        data_shape, sf_bytes = self.col_quant_shapes()
        return [BufferSpec("col_quant_data", data_shape, self.act_dtype, False),
                BufferSpec("col_quant_sf", (sf_bytes,), torch.uint8, False)]

    def activation_args(self, b, rows: int):
        return dict(super().activation_args(b, rows), fc1_c=None)

    def output_args(self, b, out):
        return dict(super().output_args(b, out), col_quant_data=b.tensor(self.col_quant_data),
                    col_quant_sf=b.tensor(self.col_quant_sf))

    def workspace_args(self, b):
        return tensor_workspaces(self, b, static_shared=True)

    def stage_activations(self, x: torch.Tensor) -> None:
        q, sf = codecs.mxfp8_quantize(x)
        self._write_staged(x.shape[0], q, sf)

    def staged_activation(self, t: int) -> QuantizedActivation:
        return QuantizedActivation(self.fmt, self.act[:t].clone(), self.staged_scales(t))
