"""`auto`: measure the paths this group can run at the layer's capacity, and keep the fastest (one plan per
capacity bucket; moe_ep/split/plan.py).

Candidates, from the group's NVLink domain map (moe_ep/split/topology.py):
  one domain    the device arch's whole-group backend for the format (the fused kernel; the torch reference on the
                CPU) and `split` (its default engine: the fused kernel at world size 1 where there is one);
  several       `two_level` and `split`; a whole-group backend only if it does not need P2P (the reference).
Each is built, loaded with the layer's weights and timed over a call of `capacity` tokens per rank (random routing,
the same seed on every run). Every rank then agrees on the winner: a candidate's score is the slowest rank's median
(the layer waits for its slowest rank), the lowest score wins everywhere (as shim/common/autotune.py does for
knobs); a candidate that fails to build on any rank is out on every rank. The losers are closed. With a table entry
for the same shape (agreed by every rank) nothing is measured.

The winner serves every call, so a graph captured around the layer captures the chosen path (split and two_level
switch to their padded, capturable exchange inside a capture). Engines that compute other numerics than the
format's (moe_ep/split/torch_engine.py) are never candidates unless `candidates` names them.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from moe_ep.core import registry
from moe_ep.core.backend import Backend
from moe_ep.core.dist import RankContext
from moe_ep.core.spec import MoESpec
from moe_ep.errors import SpecError, TuningError
from moe_ep.formats import FORMATS
from moe_ep.split import plan as plans
from moe_ep.split import topology

__all__ = ["AutoBackend", "default_candidates"]

Candidate = Tuple[str, str, dict]  # (label, registered backend, its options)


def _whole_group(device: torch.device, fmt: str):
    arch = registry.detect_arch(device)
    for name, info in registry.list_backends().items():
        if info.arch == arch and fmt in info.formats and info.available and name not in ("split", "two_level",
                                                                                          "auto"):
            return name
    return "torch_reference" if device.type == "cpu" else None


def default_candidates(ctx: RankContext, fmt: str, dmap: topology.DomainMap) -> List[Candidate]:
    out: List[Candidate] = []
    whole = _whole_group(ctx.device, fmt)
    if whole is not None and (dmap.num_domains == 1 or not registry.resolve_backend(whole).needs_p2p):
        out.append((whole, whole, {}))
    if dmap.num_domains > 1 and dmap.uniform:
        out.append(("two_level", "two_level", {}))
    out.append(("split", "split", {}))
    return out


def _candidates(given, ctx, fmt, dmap) -> List[Candidate]:
    if given is None:
        return default_candidates(ctx, fmt, dmap)
    out = []
    for c in given:
        if isinstance(c, str):
            out.append((c, c.split(":", 1)[0], {"engine": c.split(":", 1)[1]} if c.startswith("split:") else {}))
        elif isinstance(c, (tuple, list)) and len(c) == 2 and isinstance(c[0], str) and isinstance(c[1], dict):
            out.append((f"{c[0]}{c[1]}" if c[1] else c[0], c[0], dict(c[1])))
        else:
            raise SpecError("candidates", f"expected backend names ('split:<engine>' for a split engine) or "
                                          f"(name, options) pairs, got {c!r}")
    if not out:
        raise SpecError("candidates", "expected at least one candidate")
    return out


def _inputs(spec: MoESpec, ctx: RankContext, tokens: int):
    g = torch.Generator().manual_seed(20261 + ctx.rank)
    t, h, e, k = tokens, spec.hidden_size, spec.num_experts, spec.top_k
    hidden = (torch.randn(t, h, generator=g) * 0.5).to(torch.bfloat16)
    idx = torch.rand(t, e, generator=g).topk(k, dim=1).indices
    w = torch.softmax(torch.randn(t, k, generator=g), dim=1)
    dev = ctx.device
    return hidden.to(dev), idx.to(dev), w.to(dev), torch.empty(t, h, dtype=torch.bfloat16, device=dev)


def _align(ctx: RankContext) -> None:
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    if ctx.world_size > 1:
        dist.all_reduce(torch.zeros(1, device=ctx.comm_device), group=ctx.group)


def _time_us(backend, inputs, ctx: RankContext, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        backend.forward(*inputs)
    times = []
    for _ in range(reps):
        _align(ctx)
        t0 = time.perf_counter()
        backend.forward(*inputs)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


class AutoBackend(Backend):
    """Options: candidates (backend names, 'split:<engine>', or (name, options) pairs; default above), tokens (the
    tokens per rank a candidate is timed at; default the capacity), warmup / reps (calls per candidate; default
    1 / 3 on the CPU, 3 / 10 on a GPU), use_table (read and write the plan table; default True)."""

    name = "auto"
    arch = "cpu"
    weight_formats = FORMATS

    def __init__(self, spec: MoESpec, ctx: RankContext, fmt: Optional[str] = None, *,
                 candidates: Optional[Sequence] = None, tokens: Optional[int] = None, warmup: Optional[int] = None,
                 reps: Optional[int] = None, use_table: bool = True):
        super().__init__(spec, ctx, fmt)
        self.domains = topology.domain_map(ctx)
        self.candidates = _candidates(candidates, ctx, self.fmt, self.domains)
        gpu = ctx.device.type == "cuda"
        self.tokens = spec.max_tokens_per_rank if tokens is None else int(tokens)
        if not 0 <= self.tokens <= spec.max_tokens_per_rank:
            raise SpecError("tokens", f"expected 0 <= tokens <= max_tokens_per_rank={spec.max_tokens_per_rank}")
        self.warmup = (3 if gpu else 1) if warmup is None else int(warmup)
        self.reps = (10 if gpu else 3) if reps is None else int(reps)
        self.use_table = bool(use_table)
        self.chosen: Optional[Backend] = None
        self.plan: Optional[plans.Plan] = None

    # -- choosing ------------------------------------------------------------------------------------------------
    def _build(self, cand: Candidate, weights):
        """The candidate built and loaded, or the reason it cannot be (agreed: out on one rank, out on all)."""
        label, name, options = cand
        backend, error = None, None
        try:
            cls = registry.resolve_backend(name)
            problems = cls.check_spec(self.spec, self.fmt, self.ctx.world_size)
            if problems:
                raise SpecError(problems[0][0], problems[0][1])
            if cls.needs_p2p:
                topology.require_one_domain(self.domains, name)
            backend = cls(self.spec, self.ctx, fmt=self.fmt, **options)
            backend.prepare_weights(weights)
        except Exception as e:  # noqa: BLE001 - a candidate that cannot run here is out, not fatal
            error = f"{type(e).__name__}: {e}"
        flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=self.ctx.comm_device)
        if self.ctx.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.ctx.group)
        if int(flag.item()) and backend is not None:
            backend.close()
            backend = None
            error = error or "failed on another rank"
        return backend, error

    def _agreed_index(self, index: int) -> int:
        """index when every rank holds the same one, else -1."""
        t = torch.tensor([index, -index], dtype=torch.int64, device=self.ctx.comm_device)
        if self.ctx.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.ctx.group)
        hi, lo = t.tolist()
        return hi if hi == -lo else -1

    def prepare_weights(self, weights) -> None:
        ctx, labels = self.ctx, [c[0] for c in self.candidates]
        key = plans.table_key(device=ctx.device, fmt=self.fmt, spec=self.spec, world_size=ctx.world_size,
                              domains=self.domains.describe(), candidates=self.candidates)
        hit = plans.lookup(key) if self.use_table else None
        index = self._agreed_index(labels.index(hit) if hit in labels else -1)
        if index >= 0:
            backend, error = self._build(self.candidates[index], weights)
            if backend is not None:
                self._adopt(index, backend, "table", ())
                return
        self._measure(weights, key)

    def _measure(self, weights, key: str) -> None:
        ctx = self.ctx
        inputs = _inputs(self.spec, ctx, self.tokens)
        built, medians, errors = [], [], []
        for cand in self.candidates:
            backend, error = self._build(cand, weights)
            median = math.inf
            if backend is not None:
                try:
                    median = _time_us(backend, inputs, ctx, self.warmup, self.reps)
                except Exception as e:  # noqa: BLE001 - its peers are past this call too: agreed below
                    error = f"{type(e).__name__}: {e}"
            built.append(backend)
            medians.append(median)
            errors.append(error)
        scores = torch.tensor(medians, dtype=torch.float64, device=ctx.comm_device)
        if ctx.world_size > 1:
            dist.all_reduce(scores, op=dist.ReduceOp.MAX, group=ctx.group)
        score = scores.cpu().tolist()
        best = min(range(len(score)), key=lambda j: (score[j], j))
        for j, b in enumerate(built):
            if j != best and b is not None:
                b.close()
        if not math.isfinite(score[best]):
            raise TuningError("backend", "auto: no candidate path could run here: " +
                              "; ".join(f"{c[0]}: {e}" for c, e in zip(self.candidates, errors) if e))
        scored = tuple((c[0], float(s)) for c, s in zip(self.candidates, score))
        if self.use_table:
            plans.store(key, self.candidates[best][0], ctx.rank)
        self._adopt(best, built[best], "measured", scored)

    def _adopt(self, index: int, backend, source: str, scores) -> None:
        label, name, _ = self.candidates[index]
        self.chosen = backend
        if hasattr(backend, "describe"):
            d = backend.describe()
        else:
            d = dict(path="fused" if backend.needs_p2p else
                     ("reference" if name == "torch_reference" else name), backend=name)
        self.plan = plans.Plan(domains=str(self.domains), capacity=self.spec.max_tokens_per_rank, source=source,
                               scores_us=scores, **d)

    # -- the chosen backend's ----------------------------------------------------------------------------------
    @property
    def apply_topk_in_fc1(self) -> bool:
        return self.chosen.apply_topk_in_fc1

    def forward(self, hidden, topk_idx, topk_weights, out):
        return self.chosen.forward(hidden, topk_idx, topk_weights, out)

    def oracle_weights(self):
        return self.chosen.oracle_weights()

    def staged_activation(self):
        return self.chosen.staged_activation()

    def replace_experts(self, local_slots, weights) -> None:
        self.chosen.replace_experts(local_slots, weights)

    def close(self) -> None:
        if self.chosen is not None:
            self.chosen.close()
            self.chosen = None
