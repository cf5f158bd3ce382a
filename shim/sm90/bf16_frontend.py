"""The Hopper BF16 MegaMoE frontend: `moe_hopper_bf16.Sm90MegaMoE{,SwapAB}Bf16Kernel` (drop 0.7.4+).

No quantization anywhere: bf16 activations are copied into the symmetric buffer as they are, FC1 and FC2
run on bf16 weights with fp32 accumulation, the SwiGLU output (routing weight folded in) is rounded to bf16
before FC2. The FC1 rows use the same 8-row gate/up interleave as the FP8 kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_ep.core.weights import QuantizedWeights
from moe_ep.reference import quant
from shim.common.frontend import MegaMoEFrontend
from shim.sm90.knobs import HopperKnobs, InvalidKnobsError, resolve_knobs

__all__ = ["Sm90Bf16Frontend", "Bf16KernelWeights"]


@dataclass
class Bf16KernelWeights:
    canonical: QuantizedWeights  # fmt "bf16": the weights as given
    fc1: torch.Tensor  # (E, H, 2I) bf16 view, H stride 1, gate/up interleaved
    fc2: torch.Tensor  # (E, I, H) bf16 view, I stride 1


class Sm90Bf16Frontend(MegaMoEFrontend):
    arch = "sm90"
    fmt = "bf16"

    def __init__(self, **kw):
        for name in ("hidden", "intermediate"):
            if kw[name] % 64:
                raise ValueError(f"{name}={kw[name]} must be a multiple of 64 for the BF16 kernel (K tile 64)")
        super().__init__(**kw)

    def symbols(self):
        from shim.sm90 import kernel_symbols

        return kernel_symbols

    def resolve_knobs(self, knobs, cache_key: str):
        return resolve_knobs(knobs, fmt="bf16", capacity=self.capacity, cache_key=cache_key)

    def build_kernel(self, knobs: HopperKnobs):
        ks = self.symbols()
        if knobs.kernel != "Sm90MegaMoEBf16Kernel":
            raise InvalidKnobsError("kernel", f"the BF16 frontend builds Sm90MegaMoEBf16Kernel, got {knobs.kernel!r}")
        cls = ks.Sm90MegaMoESwapABBf16Kernel if knobs.swap_ab else ks.Sm90MegaMoEBf16Kernel
        try:
            return cls(
                mma_tiler_mnk=knobs.mma_tiler_mnk, cluster_shape_mnk=knobs.cluster_shape_mnk, use_2cta_instrs=False,
                group_hint=knobs.group_hint or self.max_active_clusters, token_padding_block=knobs.token_tile,
                load_balance_mode=knobs.load_balance_mode,
                static_expert_shape=(self.experts_per_rank, 2 * self.intermediate, self.hidden),
                pingpong=knobs.pingpong, world_size=self.world_size, local_rank=self.rank, num_topk=self.top_k,
                max_tokens_per_rank=self.capacity, hidden=self.hidden,
                fc2_in_kernel_topk_reduce=knobs.fc2_in_kernel_topk_reduce, apply_topk_in_fc1=True,
                token_back_mode=knobs.token_back_mode, epi_flag_batch=knobs.epi_flag_batch,
                flag_batch=knobs.flag_batch, gate_up_clamp=self.gate_up_clamp,
                tail_split_pairs=knobs.tail_split_pairs,
            )
        except (ValueError, NotImplementedError, AssertionError, TypeError) as e:
            raise InvalidKnobsError("knobs", f"the kernel rejects {knobs}: {e}") from e

    def input_buffers(self):
        return [("act", (self.capacity, self.hidden), torch.bfloat16)]

    def stage_activations(self, x: torch.Tensor) -> None:
        self.act[: x.shape[0]].copy_(x)

    def prepare_weights(self, w13, w2):
        qw = quant.quantize_weights("bf16", w13.to(self.device), w2.to(self.device),
                                    expert_offset=self.rank * self.experts_per_rank)
        fc1 = quant.interleave_gate_up(qw.w13_q)
        return Bf16KernelWeights(canonical=qw, fc1=fc1.permute(0, 2, 1), fc2=qw.w2_q.permute(0, 2, 1))

    def activation_args(self, b, rows: int):
        return dict(activation=b.tensor(self.act[:rows]))

    def weight_args(self, b, w: Bf16KernelWeights):
        return dict(fc1_weight=b.tensor(w.fc1), fc2_weight=b.tensor(w.fc2))

    def staged_activation(self, t: int):
        return self.act[:t].clone()
