"""The oracle: a single-process torch forward over all experts, and the multi-rank check.

Ranks agree with one another even when all are wrong the same way, so the check does not compare ranks:
each rank (1) checks that the quantized weights its backend reports are the canonical weights within the
format's quantization error, (2) all-gathers every rank's reported weights, (3) runs the single-process oracle
over its own staged tokens and the global expert set and (4) compares its own output slice. The ranks then
share their verdicts, so every rank returns the same report or raises the same OracleMismatchError.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from moe_ep.core.dist import RankContext, all_gather_tensor
from moe_ep.core.weights import ExpertWeights, QuantizedExpertWeights
from moe_ep.errors import OracleMismatchError
from moe_ep.formats import FORMATS, QuantizedActivation, QuantizedWeights, format_info, packs
from moe_ep.reference import ffn

__all__ = ["OUTPUT_TOLERANCE", "kernel_row_tolerance", "WEIGHT_TOLERANCE", "oracle_forward", "gather_quantized_weights",
           "compare", "RankCheck", "OracleReport", "check_multirank", "logical_weights"]

# Per format (moe_ep/formats/<fmt>.py says why each is what it is): the largest per-token relative L2 error of a
# backend's output against the oracle, and the largest per-expert relative L2 error of dequant(reported weights)
# against the canonical bf16 weights.
OUTPUT_TOLERANCE: Dict[str, float] = {fmt: format_info(fmt).output_tolerance for fmt in FORMATS}
WEIGHT_TOLERANCE: Dict[str, float] = {fmt: format_info(fmt).weight_tolerance for fmt in FORMATS}


def kernel_row_tolerance(fmt: str, intermediate_size: int) -> float:
    """The per-token bound (worst row's relative L2) a kernel's output is held to against this oracle: looser than
    OUTPUT_TOLERANCE where the kernel requantizes the FC2 input in another summation order (docs/reference.md,
    "Tolerances")."""
    return format_info(fmt).kernel_row_tolerance(intermediate_size)


@contextlib.contextmanager
def _exact_matmul():
    """No TF32 inside the oracle: it must not be less precise than the kernels it judges."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def oracle_forward(qw: QuantizedWeights, hidden, topk_idx: torch.Tensor, topk_weights: torch.Tensor, *,
                   gate_up_clamp: Optional[float] = None, apply_topk_in_fc1: bool = True) -> torch.Tensor:
    """Single-process MoE forward: hidden (bf16 [T, H], or the QuantizedActivation a backend staged) routed
    over qw's experts (global ids from qw.expert_offset) -> [T, H] bf16. A -1 slot contributes nothing."""
    act = hidden if isinstance(hidden, QuantizedActivation) else packs.quantize_input(qw, hidden)
    t, k = topk_idx.shape
    h = qw.hidden_size
    terms = torch.zeros((t, k, h), dtype=torch.bfloat16, device=act.q.device)
    idx = topk_idx.to(torch.int64)
    with _exact_matmul():
        for e in torch.unique(idx).tolist():
            if e < 0:
                continue  # -1: no expert; the slot's term stays zero
            tok, slot = (idx == e).nonzero(as_tuple=True)
            local = e - qw.expert_offset
            if not 0 <= local < qw.num_experts:
                raise ValueError(f"expert {e} is not in the oracle's weights "
                                 f"[{qw.expert_offset}, {qw.expert_offset + qw.num_experts})")
            y = ffn.expert_ffn(qw, local, act.rows(tok), topk_weights[tok, slot], gate_up_clamp,
                                 apply_topk_in_fc1)
            terms[tok, slot] = y.to(torch.bfloat16)
    return ffn.combine_terms(terms, topk_weights, apply_topk_in_fc1)


def gather_quantized_weights(ctx: RankContext, qw: QuantizedWeights) -> QuantizedWeights:
    """Collective: every rank's reported weights, concatenated in rank order (global expert ids).
    Global (non-per-expert) tensors are taken from rank 0 after checking every rank holds the same."""
    per_expert = set(qw.per_expert_fields())
    kw = {}
    for name in qw.tensor_fields():
        t = getattr(qw, name)
        g = all_gather_tensor(ctx, t)
        if name in per_expert:
            kw[name] = g
        else:
            parts = g.reshape((ctx.world_size,) + tuple(t.shape if t.dim() else (1,)))
            raw = [p.contiguous().view(torch.uint8) for p in parts]
            same = all(torch.equal(raw[0], r) for r in raw[1:])
            if not same:
                raise OracleMismatchError(f"oracle_weights.{name}",
                                          f"ranks report different values of the global {name}: "
                                          f"{parts.to(torch.float32).tolist()}")
            kw[name] = parts[0].reshape(t.shape)
    return replace(qw, expert_offset=0, **kw)


def logical_weights(qw_all: QuantizedWeights, expert_map) -> Tuple[QuantizedWeights, List[str]]:
    """Every slot's weights (gathered, global slot order) -> the logical model: expert e's weights are those of its
    first replica. A replica must hold its expert's bytes exactly (a token routed to any replica gets the same
    expert), so the problems list names every slot whose bytes differ from its expert's first replica."""
    first = expert_map.replica_table[:, 0]
    of_slot = first[expert_map.physical_to_logical]  # the first replica of each slot's expert
    problems, kw = [], {}
    for name in qw_all.per_expert_fields():
        t = getattr(qw_all, name)
        b = t.contiguous().view(torch.uint8).reshape(t.shape[0], -1)
        bad = (b != b[of_slot.to(b.device)]).any(dim=1).nonzero().flatten().tolist()
        if bad:
            problems.append(f"slot(s) {bad[:8]} hold {name} bytes that differ from their logical expert's first "
                            f"replica (slots {of_slot[bad[:8]].tolist()})")
        kw[name] = t.index_select(0, first.to(t.device))
    return replace(qw_all, **kw), problems


def _row_relative_error(out: torch.Tensor, ref: torch.Tensor):
    o = out.to(torch.float32)
    r = ref.to(torch.float32)
    diff = o - r
    if o.numel() == 0:
        return 0.0, 0.0, 0.0
    rn = r.norm(dim=-1)
    # A row whose reference is ~0 (all routing weights zero) must not turn rounding noise into a huge ratio.
    floor = max(float(rn.mean()) * 1e-3, 1e-30)
    row = (diff.norm(dim=-1) / rn.clamp(min=floor))
    max_abs = float(diff.abs().max())
    total = float(diff.norm() / max(float(r.norm()), 1e-30))
    return float(row.max()), max_abs, total


@dataclass
class RankCheck:
    rank: int
    tokens: int
    fmt: str
    ok: bool
    max_abs_err: float
    max_row_rel_err: float
    rel_l2_err: float
    nan_count: int
    weight_rel_err: float
    act_rel_err: float
    tolerance: float
    problems: List[str] = field(default_factory=list)


@dataclass
class OracleReport:
    ranks: List[RankCheck]

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.ranks)

    @property
    def failing(self) -> List[int]:
        return [r.rank for r in self.ranks if not r.ok]

    def mine(self, rank: int) -> RankCheck:
        return self.ranks[rank]

    def summary(self) -> str:
        return "; ".join(f"rank {r.rank}: " + ("ok" if r.ok else ", ".join(r.problems)) for r in self.ranks)


def compare(out: torch.Tensor, ref: torch.Tensor, fmt: str, tol: Optional[float] = None):
    """(ok, problems, max_row_rel, max_abs, rel_l2, nan_count) of a backend output against the oracle."""
    tol = OUTPUT_TOLERANCE[fmt] if tol is None else tol
    problems = []
    nan_out = int(torch.isnan(out.to(torch.float32)).sum())
    nan_ref = int(torch.isnan(ref.to(torch.float32)).sum())
    if nan_out != nan_ref:
        problems.append(f"{nan_out} NaN in the output where the oracle has {nan_ref}")
    o = torch.nan_to_num(out.to(torch.float32), nan=0.0)
    r = torch.nan_to_num(ref.to(torch.float32), nan=0.0)
    row, max_abs, total = _row_relative_error(o, r)
    if not math.isfinite(row) or row > tol:
        problems.append(f"per-token relative error {row:.3g} > {tol:g} (max abs {max_abs:.3g})")
    return not problems, problems, row, max_abs, total, nan_out


def check_multirank(layer, hidden: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                    out: torch.Tensor, *, weights: Optional[ExpertWeights] = None, tol: Optional[float] = None,
                    raise_on_failure: bool = True) -> OracleReport:
    """Collective. Check this rank's `out` (from layer(hidden, topk_idx, topk_weights)) against the
    single-process oracle over every rank's reported quantized weights. weights: the canonical pack the
    layer was built from; when given, the reported weights are checked against it too (within the format's
    quantization error for ExpertWeights, byte for byte for a QuantizedExpertWeights).

    A layer with an expert map (moe_ep.eplb) is checked against its logical model: the oracle routes topk_idx
    (logical ids, or slot ids turned back into the logical ids they hold) over one copy of each logical expert,
    and every replica must hold its expert's bytes. So a token sent to the wrong slot, or a replica holding other
    weights, is a mismatch however the replicas are chosen; `weights` then holds this rank's slots."""
    ctx: RankContext = layer.ctx
    backend = layer.backend
    fmt = layer.fmt
    problems: List[str] = []
    qw = backend.oracle_weights()

    e_local = layer.slots_per_rank
    if qw.fmt != fmt:
        problems.append(f"backend reports fmt {qw.fmt!r}, the layer runs {fmt!r}")
    if qw.expert_offset != ctx.rank * e_local or qw.num_experts != e_local:
        problems.append(f"backend reports experts [{qw.expert_offset}, {qw.expert_offset + qw.num_experts}), "
                        f"rank {ctx.rank} owns [{ctx.rank * e_local}, {(ctx.rank + 1) * e_local})")

    weight_err = 0.0
    if isinstance(weights, QuantizedExpertWeights) and not problems:
        # Handed an already-quantized pack: the backend must compute with exactly those bytes.
        for name in weights.qw.tensor_fields():
            mine, given = getattr(qw, name, None), getattr(weights.qw, name)
            if mine is None or not torch.equal(mine.contiguous().view(torch.uint8).cpu(),
                                               given.contiguous().view(torch.uint8).cpu()):
                problems.append(f"reported {name} is not the given pack's, byte for byte")
    elif weights is not None and not problems:
        w13, w2 = qw.dequantize()
        for name, got, want in (("w13", w13, weights.w13), ("w2", w2, weights.w2)):
            want = want.to(device=got.device, dtype=torch.float32)
            err = ((got - want).flatten(1).norm(dim=1) / want.flatten(1).norm(dim=1).clamp(min=1e-30))
            err = float(torch.nan_to_num(err, nan=float("inf")).max()) if err.numel() else 0.0
            weight_err = max(weight_err, err)
        if weight_err > WEIGHT_TOLERANCE[fmt]:
            problems.append(f"reported weights differ from the canonical ones by {weight_err:.3g} "
                            f"(> {WEIGHT_TOLERANCE[fmt]:g})")

    # Collective from here on: every rank gathers even if its own report is already bad.
    try:
        qw_all = gather_quantized_weights(ctx, qw)
    except OracleMismatchError as e:
        qw_all = None
        problems.append(str(e))
    expert_map = layer.expert_map
    if qw_all is not None and expert_map is not None:
        qw_all, replica_problems = logical_weights(qw_all, expert_map)
        problems += replica_problems
        if layer.id_space == "physical":
            topk_idx = expert_map.logical_ids(topk_idx)

    act = backend.staged_activation()
    act_err = 0.0
    if qw_all is not None and act is not None and hidden.shape[0] > 0:
        mine = packs.quantize_input(qw_all, hidden)
        a = packs.dequantize_input(qw_all, act)
        b = packs.dequantize_input(qw_all, mine)
        act_err = float((a - b).norm() / b.norm().clamp(min=1e-30))
        if act_err > OUTPUT_TOLERANCE[fmt]:
            problems.append(f"staged activations differ from the format's quantization of hidden by {act_err:.3g}")

    row = max_abs = total = 0.0
    nan_count = 0
    if qw_all is not None:
        ref = oracle_forward(qw_all, act if act is not None else hidden, topk_idx, topk_weights,
                             gate_up_clamp=layer.spec.gate_up_clamp, apply_topk_in_fc1=backend.apply_topk_in_fc1)
        ok_out, out_problems, row, max_abs, total, nan_count = compare(out, ref, fmt, tol)
        problems += out_problems

    check = RankCheck(ctx.rank, int(hidden.shape[0]), fmt, not problems, max_abs, row, total, nan_count,
                      weight_err, act_err, OUTPUT_TOLERANCE[fmt] if tol is None else tol, problems)
    gathered: List[Optional[RankCheck]] = [None] * ctx.world_size
    dist.all_gather_object(gathered, check, group=ctx.group)
    report = OracleReport(list(gathered))
    if raise_on_failure and not report.ok:
        raise OracleMismatchError("out", f"backend {layer.backend_name!r} (fmt {fmt!r}) disagrees with the torch "
                                         f"oracle on rank(s) {report.failing}: {report.summary()}")
    return report
