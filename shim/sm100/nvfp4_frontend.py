"""The Blackwell NVFP4 MegaMoE frontend (`moe_nvfp4_swapab.Sm100MegaMoEKernel`, swap-AB), and its weight layout.

Activations e2m1 pairs [C, H/2] with e4m3 scales per 16 in plain row-major layout, each row padded with zeros
to a multiple of 4 scales (dispatch moves scales 4 bytes at a time). NVFP4 scales activations statically: the FC1
input global scale comes from the calibrated ExpertWeights.act_amax (the layer refuses a pack without it).

Weights: e2m1 pairs, K-major, FC1's rows interleaved by 16 (SwapABSwigluFp4Epilogue's pairing), e4m3 block scales
swizzled (shim/sm100/weights.py), and the epilogue's scalars per expert: fc1_alpha = 1 / (g_act * g_w13),
fc1_norm_const = g_fc2act (the encode scale the kernel quantizes the SwiGLU output with), fc2_alpha =
1 / (g_fc2act * g_w2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_ep.formats import QuantizedActivation, QuantizedWeights, codecs
from shim.common.weights import KernelWeights, kernel_tensors, read_experts, store_experts
from shim.sm100.frontend import (Sm100Frontend, block_scaled_activation_args, block_scaled_buffers,
                                 block_scaled_weight_args, check_scale_row, staged_scales, write_staged)
from shim.sm100.weights import empty_scales, pack_e2m1, read_scales, store_scales, unpack_e2m1

__all__ = ["Sm100Nvfp4Frontend", "Sm100Nvfp4Weights"]


@dataclass
class Sm100Nvfp4Weights(KernelWeights):
    fmt = "nvfp4"
    interleave = 16  # checked against the drop at kernel build
    scale_block = codecs.NVFP4_BLOCK
    expert_offset: int
    fc1: torch.Tensor  # (E, H/2, 2I) e2m1 pairs, K-major, gate/up interleaved
    fc2: torch.Tensor  # (E, I/2, H) e2m1 pairs, K-major
    fc1_sf: torch.Tensor  # (E, swizzled) e4m3, over the interleaved rows
    fc2_sf: torch.Tensor  # (E, swizzled) e4m3
    fc1_alpha: torch.Tensor  # (E,) fp32
    fc2_alpha: torch.Tensor  # (E,) fp32
    fc1_norm_const: torch.Tensor  # (E,) fp32
    w13_global_scale: torch.Tensor  # (E,) fp32
    w2_global_scale: torch.Tensor  # (E,) fp32
    act_scale: torch.Tensor  # (1,) fp32: the FC1-input global (encode) scale, the layer's
    fc2_act_scale: torch.Tensor  # (E,) fp32: the FC2-input global scale

    @classmethod
    def empty(cls, experts, hidden, intermediate, device, expert_offset):
        fc1, fc2 = kernel_tensors(experts, hidden, intermediate, torch.float4_e2m1fn_x2, device, per_element=2)
        sf = empty_scales(experts, hidden, intermediate, cls.scale_block, torch.float8_e4m3fn, device)
        per_expert = [torch.empty(experts, dtype=torch.float32, device=device) for _ in range(5)]
        return cls(expert_offset, fc1, fc2, *sf, *per_expert, torch.empty(1, dtype=torch.float32, device=device),
                   torch.empty(experts, dtype=torch.float32, device=device))

    def store_static(self, qw):
        self.act_scale.copy_(qw.act_scale.reshape(1))

    def store(self, rows, qw):
        g = self.interleave
        store_experts(self.fc1, self.fc2, rows, pack_e2m1(qw.w13_q), pack_e2m1(qw.w2_q), g)
        store_scales(self.fc1_sf, self.fc2_sf, rows, qw.w13_scale, qw.w2_scale, g)
        n = qw.num_experts
        g_fc2 = qw.fc2_act_scale.reshape(n).to(torch.float32)
        self.w13_global_scale[rows].copy_(qw.w13_global_scale)
        self.w2_global_scale[rows].copy_(qw.w2_global_scale)
        self.fc2_act_scale[rows].copy_(g_fc2)
        self.fc1_alpha[rows].copy_(codecs.nvfp4_alpha(self.act_scale.expand(n), qw.w13_global_scale))
        self.fc1_norm_const[rows].copy_(g_fc2)
        self.fc2_alpha[rows].copy_(codecs.nvfp4_alpha(g_fc2, qw.w2_global_scale))

    def canonical(self) -> QuantizedWeights:
        w13, w2 = read_experts(self.fc1, self.fc2, self.interleave)
        h, i = self.fc2.shape[2], self.fc2.shape[1] * 2
        sf13, sf2 = read_scales(self.fc1_sf, self.fc2_sf, h, i, self.scale_block, self.interleave)
        return QuantizedWeights(self.fmt, unpack_e2m1(w13), unpack_e2m1(w2), sf13, sf2, self.w13_global_scale,
                                self.w2_global_scale, act_scale=self.act_scale, fc2_act_scale=self.fc2_act_scale,
                                expert_offset=self.expert_offset)


class Sm100Nvfp4Frontend(Sm100Frontend):
    fmt = "nvfp4"
    weights_layout = Sm100Nvfp4Weights

    def kernel_class(self, knobs):
        return self.symbols().Sm100MegaMoEKernel

    def kernel_interleave(self) -> int:
        return int(self.symbols().SwapABSwigluFp4Epilogue._EpilogueFc1GateUpInterleave)

    def check_kernel(self, kernel) -> None:
        super().check_kernel(kernel)
        check_scale_row(self, kernel)

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

    def input_buffers(self):
        return block_scaled_buffers(self, (self.hidden_size // 2,), torch.float4_e2m1fn_x2, torch.float8_e4m3fn)

    def activation_args(self, b, rows: int):
        return dict(block_scaled_activation_args(self, b, rows), fc1_activation_per_token_scale=None)

    def weight_args(self, b, w: Sm100Nvfp4Weights):
        return dict(block_scaled_weight_args(b, w), fc1_alpha=b.tensor(w.fc1_alpha, 4),
                    fc2_alpha=b.tensor(w.fc2_alpha, 4), fc1_norm_const=b.tensor(w.fc1_norm_const, 4))

    def stage_activations(self, x: torch.Tensor) -> None:
        codes, sf = codecs.nvfp4_quantize(x, self._weights.act_scale.reshape(1, 1))
        write_staged(self, x.shape[0], pack_e2m1(codes), sf)

    def staged_activation(self, t: int) -> QuantizedActivation:
        return QuantizedActivation(self.fmt, unpack_e2m1(self.act[:t]), staged_scales(self, t))
