"""The Blackwell NVFP4 MegaMoE frontend (`moe_nvfp4_swapab.Sm100MegaMoEKernel`, swap-AB).

Activations e2m1 pairs [C, H/2] with e4m3 scales per 16 in plain row-major layout, each row padded with zeros
to a multiple of 4 scales (dispatch moves scales 4 bytes at a time); weights and scales as shim.sm100.weights
lays them out; per-expert fc1_alpha, fc2_alpha, fc1_norm_const. NVFP4 scales activations statically: the FC1
input global scale comes from the calibrated ExpertWeights.act_amax (the layer refuses a pack without it).
"""

from __future__ import annotations

import torch

from moe_ep.formats import QuantizedActivation, codecs
from shim.sm100.frontend import BlockScaledFrontend
from shim.sm100.weights import pack_e2m1, unpack_e2m1

__all__ = ["Sm100Nvfp4Frontend"]


class Sm100Nvfp4Frontend(BlockScaledFrontend):
    fmt = "nvfp4"
    act_dtype = torch.float4_e2m1fn_x2
    scale_dtype = torch.float8_e4m3fn

    def kernel_class(self, knobs):
        return self.symbols().Sm100MegaMoEKernel

    def kernel_interleave(self) -> int:
        return int(self.symbols().SwapABSwigluFp4Epilogue._EpilogueFc1GateUpInterleave)

    def format_kwargs(self, knobs):
        import cutlass

        ks = self.symbols()
        return dict(token_padding_block=int(ks.SwapABSwigluFp4Epilogue._EpilogueTokenTileSize),
                    sf_padding_block=ks.SfPaddingBlock, sf_vec_size=ks.Nvfp4BlockSize,
                    fc2_output_dtype=cutlass.BFloat16, combine_format=ks.CombineFormat.parse("bf16"),
                    non_ubulk_fc2_store=True, apply_topk_in_fc1=True,
                    in_kernel_fc2_reduce=knobs.fc2_in_kernel_topk_reduce, swiglu_alpha=None, swiglu_beta=None,
                    situ_beta=None, situ_linear_beta=None, enable_fc1_activation_per_token_scale=False,
                    topk_reduce_persistent=False)

    def activation_args(self, b, rows: int):
        return dict(super().activation_args(b, rows), fc1_activation_per_token_scale=None)

    def act_shape(self):
        return (self.hidden_size // 2,)

    def weight_args(self, b, w):
        args = super().weight_args(b, w)
        args.update(fc1_alpha=b.tensor(w.fc1_alpha, 4), fc2_alpha=b.tensor(w.fc2_alpha, 4),
                    fc1_norm_const=b.tensor(w.fc1_norm_const, 4))
        return args

    def stage_activations(self, x: torch.Tensor) -> None:
        codes, sf = codecs.nvfp4_quantize(x, self._weights.act_scale.reshape(1, 1))
        self._write_staged(x.shape[0], pack_e2m1(codes), sf)

    def staged_activation(self, t: int) -> QuantizedActivation:
        return QuantizedActivation(self.fmt, unpack_e2m1(self.act[:t]), self.staged_scales(t))
