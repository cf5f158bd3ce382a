"""torch_reference: exact EP semantics over torch.distributed (gloo on CPU, NCCL on GPU).

Per call: quantize the bf16 input as the kernel stages it; send each (token, slot) row to the rank owning
its expert (all_to_all, bytes); run FC1 -> SwiGLU -> (routing weight) -> FC2-input quantization -> FC2 per
local expert; send the bf16 terms back; sum them on the source rank in slot order (fp32) and round to bf16.

Each exchange sends a fixed-size header with its row counts, compared on every rank after the counts moved and
BEFORE the rows do (moe_ep.core.dist.all_to_all_rows' check): the first carries the call's fingerprint (which layer,
which call of it, which collective call of the group; moe_ep.core.watchdog.sequence) and the width of a row in
bytes, the second the width of the terms. Ranks out of step raise RankDivergenceError there, on every rank, and
ranks whose rows would not fit each other (layers of another geometry meeting in one exchange, with the sequence
check off) raise it too, instead of gloo aborting the process on buffers of different sizes. carry_fingerprint=False
sends zeros in the fingerprint's place, as a kernel's exchange cannot carry it (the watchdog then finds ranks out
of step from the published sequences).

An expert id >= num_experts in a call whose ids the layer did not check (check_values off) would name a rank that
does not exist: this rank then takes part in both exchanges with no rows of its own (its peers' rows to its experts
are still served, so their outputs are right) and raises ExpertIndexError after, naming its own input.

The weights are the backend's own: prepare_weights copies whatever would alias the caller's tensors (a bf16 layer
computes with w13 / w2 as given; a quantized pack on the layer's device would be used as it is).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import torch

from moe_ep.core.backend import Backend
from moe_ep.core.dist import all_to_all_rows
from moe_ep.core.watchdog import divergence, sequence
from moe_ep.core.weights import ExpertWeights, QuantizedExpertWeights
from moe_ep.errors import ExpertIndexError, RankDivergenceError
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
            given = [getattr(weights.qw, n) for n in weights.qw.tensor_fields()]
            qw = weights.qw.to(dev)  # the given bytes, as they are
        else:
            given = [weights.w13, weights.w2]
            qw = packs.quantize_weights(self.fmt, weights.w13.to(dev), weights.w2.to(dev),
                                        act_amax=weights.act_amax, fc2_act_amax=weights.fc2_act_amax,
                                        expert_offset=weights.expert_offset)
        self._qw = _owned(qw, given)

    def oracle_weights(self) -> QuantizedWeights:
        if self._qw is None:
            raise RuntimeError("prepare_weights() has not run")
        return self._qw

    def replace_experts(self, local_slots, weights: QuantizedWeights) -> None:
        self._qw.write_experts(local_slots, weights)  # the oracle's own tensors

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
        bad = None
        if idx.numel() and int(idx.max()) >= spec.num_experts:
            bad = ExpertIndexError("topk_idx", (
                f"expert ids must be < num_experts={spec.num_experts}, got {int(idx.max())} (this call's ids were not "
                "checked: check_values off); this rank took part with no tokens, its peers' outputs are right"))
        # A -1 slot names no expert: it is sent nowhere and its term stays zero (a row of -1 comes back zero).
        live = (idx >= 0).nonzero().squeeze(1) if bad is None else idx[:0]
        dest = torch.div(idx[live], e_local, rounding_mode="floor")
        order = live[torch.argsort(dest, stable=True)]
        dest = torch.div(idx[order], e_local, rounding_mode="floor")
        send_counts = torch.bincount(dest, minlength=ctx.world_size)
        token = torch.div(order, k, rounding_mode="floor")
        sent = act.rows(token)
        rows = [sent.q] + ([sent.scale] if sent.scale is not None else [])
        rows += [(idx[order] - dest * e_local).to(torch.int32), topk_weights.reshape(-1)[order].contiguous()]
        # Every rank sends a fingerprint (zeros when it has none to give) and its row width: one header shape always.
        mine = self._seq.fingerprint() if self._seq is not None else (0, 0, 0)
        recv, recv_counts, _ = all_to_all_rows(ctx, rows, send_counts, header=(*mine, _width(rows)),
                                               check=lambda headers: self._check(mine, headers, "rows"))

        r_act = QuantizedActivation(act.fmt, recv[0], recv[1] if sent.scale is not None else None)
        terms = self.compute_experts(qw, r_act, recv[-2].to(torch.int64), recv[-1])

        (back,), _, _ = all_to_all_rows(ctx, [terms], recv_counts, header=(0, 0, 0, _width([terms])),
                                         check=lambda headers: self._check((0, 0, 0), headers, "terms"))
        if bad is not None:
            raise bad
        per_pair = torch.zeros((t * k, spec.hidden_size), dtype=torch.bfloat16, device=hidden.device)
        per_pair[order] = back
        out.copy_(ffn.combine_terms(per_pair.view(t, k, spec.hidden_size), topk_weights, self._apply_topk))
        return out

    def _check(self, mine, headers: Sequence[Sequence[int]], what: str) -> None:
        """Before the payload moves: the ranks' fingerprints (in step?), then their row widths (would the rows fit?)."""
        if self._seq is not None:
            divergence.in_band(self._seq, mine, [h[:3] for h in headers])
        widths = [int(h[3]) for h in headers]
        if len(set(widths)) > 1:
            ref = max(set(widths), key=lambda v: (widths.count(v), -widths.index(v)))
            out = [r for r, v in enumerate(widths) if v != ref]
            shown = ", ".join(f"rank {r}{' (this rank)' if r == self.ctx.rank else ''} {v} B" for r, v in
                              enumerate(widths))
            err = RankDivergenceError(None, (
                f"the ranks' {what} in this exchange are of different widths ({shown}): layers of different geometry "
                "meet in one exchange, so the ranks are out of step (the sequence check, which would name the calls, "
                "is off for this layer) and nothing of this call was exchanged; every later call of this group raises "
                "this error (rebuild the group or restart the job)"), ranks=out)
            if self._seq is not None:
                self._seq.mark(err)
            raise err

    def close(self) -> None:
        self._qw = None
        self._staged = None


def _width(rows) -> int:
    """Bytes per row of the tensors an exchange packs together."""
    return sum(math.prod(t.shape[1:]) * t.element_size() for t in rows)


def _owned(qw: QuantizedWeights, given) -> QuantizedWeights:
    """qw with a copy of every tensor that shares memory with one the caller gave (the layer's weights are its own)."""
    theirs = {t.untyped_storage().data_ptr() for t in given if isinstance(t, torch.Tensor)}
    kw = {n: getattr(qw, n).clone() for n in qw.tensor_fields()
          if getattr(qw, n).untyped_storage().data_ptr() in theirs}
    return dataclasses.replace(qw, **kw) if kw else qw
