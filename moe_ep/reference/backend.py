"""torch_reference: exact EP semantics over torch.distributed (gloo on CPU, NCCL on GPU).

Per call: quantize the bf16 input as the kernel stages it; send each (token, slot) row to the rank owning
its expert (all_to_all, bytes); run FC1 -> SwiGLU -> (routing weight) -> FC2-input quantization -> FC2 per
local expert; send the bf16 terms back; sum them on the source rank in slot order (fp32) and round to bf16.

The first exchange (the row counts) also carries each rank's call fingerprint (which layer, which call of it,
which collective call of the group; moe_ep.core.watchdog.sequence): ranks out of step raise RankDivergenceError
there, on every rank, before any of the call's data moves (carry_fingerprint=False leaves it out, as a kernel
backend must: the watchdog then finds it from the published sequences).
"""

from __future__ import annotations

from typing import Optional

import torch

from moe_ep.core.backend import Backend
from moe_ep.core.dist import all_to_all_rows
from moe_ep.core.watchdog import divergence, sequence
from moe_ep.core.weights import ExpertWeights, QuantizedExpertWeights
from moe_ep.formats import FORMATS, QuantizedActivation, QuantizedWeights, packs
from moe_ep.reference import ffn

__all__ = ["TorchReferenceBackend"]


class TorchReferenceBackend(Backend):
    name = "torch_reference"
    arch = "cpu"
    weight_formats = FORMATS

    def __init__(self, spec, ctx, fmt: Optional[str] = None, apply_topk_in_fc1: bool = True,
                 keep_staged: bool = True, carry_fingerprint: bool = True):
        super().__init__(spec, ctx, fmt)
        self._apply_topk = bool(apply_topk_in_fc1)
        self._keep_staged = keep_staged
        self._seq = sequence.log_for(ctx.group) if carry_fingerprint and ctx.pg_backend != "none" else None
        self._qw: Optional[QuantizedWeights] = None
        self._staged: Optional[QuantizedActivation] = None

    @property
    def apply_topk_in_fc1(self) -> bool:
        return self._apply_topk

    def prepare_weights(self, weights: ExpertWeights) -> None:
        dev = self.ctx.device
        if isinstance(weights, QuantizedExpertWeights):
            self._qw = weights.qw.to(dev)  # the given bytes, as they are (a copy only when on another device)
            return
        self._qw = packs.quantize_weights(self.fmt, weights.w13.to(dev), weights.w2.to(dev),
                                          act_amax=weights.act_amax, fc2_act_amax=weights.fc2_act_amax,
                                          expert_offset=weights.expert_offset)

    def oracle_weights(self) -> QuantizedWeights:
        if self._qw is None:
            raise RuntimeError("prepare_weights() has not run")
        return self._qw

    def replace_experts(self, local_slots, weights: QuantizedWeights) -> None:
        # The oracle's own tensors: rows rewritten in place, every field the load filled per expert.
        for name in self._qw.per_expert_fields():
            dst, src = getattr(self._qw, name), getattr(weights, name)
            for i, s in enumerate(local_slots):
                dst[s].copy_(src[i])

    def staged_activation(self) -> Optional[QuantizedActivation]:
        return self._staged

    def compute_experts(self, qw: QuantizedWeights, act: QuantizedActivation, local_expert: torch.Tensor,
                        weights: torch.Tensor) -> torch.Tensor:
        """Received rows -> bf16 terms [N, H]. Split out so a test can subclass the compute step."""
        n = act.q.shape[0]
        terms = torch.empty((n, self.spec.hidden_size), dtype=torch.bfloat16, device=act.q.device)
        for e in range(qw.num_experts):
            sel = (local_expert == e).nonzero().squeeze(1)
            if sel.numel() == 0:
                continue
            y = ffn.expert_ffn(qw, e, act.rows(sel), weights[sel], self.spec.gate_up_clamp, self._apply_topk)
            terms[sel] = y.to(torch.bfloat16)
        return terms

    def forward(self, hidden, topk_idx, topk_weights, out):
        spec, ctx, qw = self.spec, self.ctx, self._qw
        t, k = topk_idx.shape
        e_local = spec.num_experts // ctx.world_size
        act = packs.quantize_input(qw, hidden)
        self._staged = act if self._keep_staged else None

        idx = topk_idx.reshape(-1).to(torch.int64)
        # A -1 slot names no expert: it is sent nowhere and its term stays zero (a row of -1 comes back zero).
        live = (idx >= 0).nonzero().squeeze(1)
        dest = torch.div(idx[live], e_local, rounding_mode="floor")
        order = live[torch.argsort(dest, stable=True)]
        dest = torch.div(idx[order], e_local, rounding_mode="floor")
        send_counts = torch.bincount(dest, minlength=ctx.world_size)
        token = torch.div(order, k, rounding_mode="floor")
        sent = act.rows(token)
        rows = [sent.q] + ([sent.scale] if sent.scale is not None else [])
        rows += [(idx[order] - dest * e_local).to(torch.int32), topk_weights.reshape(-1)[order].contiguous()]
        # Every rank sends a fingerprint (zeros when it has none to give), so the exchange keeps one shape.
        mine = self._seq.fingerprint() if self._seq is not None else (0, 0, 0)
        recv, recv_counts, theirs = all_to_all_rows(ctx, rows, send_counts, header=mine)
        if self._seq is not None:
            divergence.in_band(self._seq, mine, theirs)

        r_act = QuantizedActivation(act.fmt, recv[0], recv[1] if sent.scale is not None else None)
        terms = self.compute_experts(qw, r_act, recv[-2].to(torch.int64), recv[-1])

        (back,), _ = all_to_all_rows(ctx, [terms], recv_counts)
        per_pair = torch.zeros((t * k, spec.hidden_size), dtype=torch.bfloat16, device=hidden.device)
        per_pair[order] = back
        out.copy_(ffn.combine_terms(per_pair.view(t, k, spec.hidden_size), topk_weights, self._apply_topk))
        return out

    def close(self) -> None:
        self._qw = None
        self._staged = None
