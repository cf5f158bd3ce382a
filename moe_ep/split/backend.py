"""`split`: dispatch over a transport, the rank's own experts on a local engine, combine back.

Per call, on every rank (docs/scale-out.md):
  1. route: each token goes once to each rank that holds one of its experts, with the ids that rank computes and
     its K routing weights (moe_ep/split/layout.py); EPLB slots are already mapped to physical slots by the layer;
  2. quantize at the source when the engine reads the layer's format (FP8 crosses as FP8: half the bytes of bf16);
  3. dispatch (moe_ep/split/transport.py): the row counts, then the rows; exact splits when the call is eager, the
     padded grid while a CUDA graph is being captured (transport="auto"), or as asked;
  4. the engine computes each received row's partial over the slots this rank holds (moe_ep/split/engine.py);
  5. combine: the partials travel back the way they came and each token sums its own, in fp32, in rank order.
The counts exchange carries the call's fingerprint, as the torch reference's does: ranks out of step raise
RankDivergenceError on every rank before any row moves. A rank with no tokens still takes part in every exchange.

A subclass moves rows over another group and to other destinations (two_level: the rails between NVLink domains,
the fused kernel inside each): it overrides `_route` and builds its own engine.
"""

from __future__ import annotations

from typing import Optional

import torch

from moe_ep.core.backend import Backend
from moe_ep.core.dist import RankContext, run_agreed
from moe_ep.core.spec import MoESpec
from moe_ep.core.watchdog import divergence, sequence
from moe_ep.errors import ExpertIndexError, SpecError
from moe_ep.formats import FORMATS, QuantizedActivation
from moe_ep.split import engine as engines
from moe_ep.split.layout import Layout, Rows, slot_owners
from moe_ep.split.transport import Transport, pack_rows, unpack_rows

__all__ = ["SplitBackend", "TRANSPORTS"]

TRANSPORTS = ("auto", "exact", "padded")
_capturing = torch._C._cuda_isCurrentStreamCapturing if torch.backends.cuda.is_built() else (lambda: False)
# Rows the default engine is built for at most, past the layer's capacity: a rank may receive up to
# world_size * capacity rows (every peer sending it every token); more than this run as local chunks.
ENGINE_ROWS = 16384


class SplitBackend(Backend):
    """Options (MoELayer(..., backend="split", **options)):
    engine: a name of moe_ep.split.engine.ENGINES or "backend:<registered backend>" (default: "fused" where the
      device's arch has a kernel for fmt, else "reference");
    transport: "auto" (exact splits, the padded grid while capturing), "exact" or "padded";
    wire: "quantized" / "bf16" for the reference engine (what crosses; default the format's own bytes);
    engine_rows: the most rows one engine call takes (default min(world_size * capacity, max(capacity, 16384)));
    engine_options: passed to the engine; apply_topk_in_fc1, carry_fingerprint as for the torch reference."""

    name = "split"
    arch = "cpu"  # torch on any device: the engine decides what runs where
    weight_formats = FORMATS
    path = "split"

    def __init__(self, spec: MoESpec, ctx: RankContext, fmt: Optional[str] = None, *, engine: Optional[str] = None,
                 transport: str = "auto", wire: Optional[str] = None, engine_rows: Optional[int] = None,
                 engine_options: Optional[dict] = None, apply_topk_in_fc1: bool = True,
                 carry_fingerprint: bool = True):
        super().__init__(spec, ctx, fmt)
        self._apply_topk = bool(apply_topk_in_fc1)
        self._seq = sequence.log_for(ctx.group) if carry_fingerprint and ctx.pg_backend != "none" else None
        self._staged: Optional[QuantizedActivation] = None
        opts = dict(engine_options or {})
        if wire is not None:
            opts["wire"] = wire

        def check():
            if transport not in TRANSPORTS:
                raise SpecError("transport", f"expected one of {list(TRANSPORTS)}, got {transport!r}")
            return self._choose_engine(engine, engine_rows, opts)

        # Every rank resolves the same options, or every rank stops here (nothing collective has run yet).
        self.engine_name, cls, local = run_agreed(ctx, check, "the split path's options")
        self.transport_mode = transport
        self.transport = self._transport()
        self.engine = self._build_engine(cls, local, opts)

    # -- what a subclass changes ---------------------------------------------------------------------------------
    def _choose_engine(self, engine: Optional[str], engine_rows: Optional[int], opts: dict):
        """(engine name, class, its spec), checked; local (the agreement runs around it). May add to opts."""
        ctx, s = self.ctx, self.spec
        name = engine or engines.default_engine(ctx.device, self.fmt)
        if name.startswith("backend:"):
            opts["backend"] = name.split(":", 1)[1]
        cls = engines.engine_class(name)
        if "wire" in opts and cls is not engines.ReferenceEngine:
            raise SpecError("wire", f"the {name!r} engine reads what it reads; wire= is the reference engine's")
        rows = engine_rows or min(ctx.world_size * s.max_tokens_per_rank, max(s.max_tokens_per_rank, ENGINE_ROWS))
        if isinstance(rows, bool) or not isinstance(rows, int) or rows <= 0:
            raise SpecError("engine_rows", f"expected a positive int, got {engine_rows!r}")
        e_local = s.num_experts // ctx.world_size
        # A row carries at most min(K, E_local) live slots to this rank (distinct experts; checked per call).
        local = MoESpec(s.hidden_size, s.intermediate_size, e_local, min(s.top_k, e_local), rows, s.gate_up_clamp)
        cls.check(local, self.fmt, ctx.device, opts)
        return name, cls, local

    def _transport(self) -> Transport:
        return Transport(self.ctx)

    def _build_engine(self, cls, local: MoESpec, opts: dict):
        offset = self.ctx.rank * (self.spec.num_experts // self.ctx.world_size)
        return cls(local, self.ctx, self.fmt, expert_offset=offset, apply_topk_in_fc1=self._apply_topk, **opts)

    def _route(self, topk_idx: torch.Tensor):
        """(owner, dest_id) per slot and the number of destinations (moe_ep.split.layout.slot_owners)."""
        w = self.ctx.world_size
        owner, dest_id = slot_owners(topk_idx, self.spec.num_experts // w, w)
        return owner, dest_id, w

    def _check_slots(self, most: list) -> None:
        """Every rank raises the same error when a row would carry more slots to one destination than its engine
        takes: a token naming one expert twice (the counts exchange carried each rank's largest)."""
        width = self.engine.spec.top_k
        bad = [r for r, m in enumerate(most) if m > width]
        if bad:
            raise ExpertIndexError("topk_idx", (
                f"rank(s) {bad} routed a token to more than {width} slots held by one rank ({max(most)}): a token "
                f"names one expert twice. Each rank holds {width} expert(s) here, and the split path's engine takes "
                f"at most that many slots per token; route each token to distinct experts"))

    def _fingerprint(self):
        return self._seq.fingerprint() if self._seq is not None else (0, 0, 0)

    # -- Backend ---------------------------------------------------------------------------------------------
    @property
    def apply_topk_in_fc1(self) -> bool:
        return self._apply_topk

    def prepare_weights(self, weights) -> None:
        self.engine.prepare_weights(weights)

    def oracle_weights(self):
        return self.engine.oracle_weights()

    def staged_activation(self) -> Optional[QuantizedActivation]:
        return self._staged

    def replace_experts(self, local_slots, weights) -> None:
        self.engine.replace_experts(local_slots, weights)

    def padded(self) -> bool:
        """Whether this call moves the padded grid (capturable) rather than exact splits."""
        mode = self.transport_mode
        if mode == "auto":
            return self.ctx.device.type == "cuda" and _capturing()
        return mode == "padded"

    def forward(self, hidden, topk_idx, topk_weights, out):
        owner, dest_id, dests = self._route(topk_idx)
        lay = Layout(owner, dest_id, dests, self.spec.max_tokens_per_rank)
        eng = self.engine
        if eng.takes_quantized:
            act = eng.quantize(hidden)
            self._staged = act
            q, scale = act.q, act.scale
        else:
            q, scale = hidden, None
        tr = self.transport
        if self.padded():
            if not eng.capturable and self.ctx.device.type == "cuda" and _capturing():
                raise SpecError("engine", f"the split path's {self.engine_name!r} engine reads row counts on the "
                                          "host, which a CUDA graph capture cannot hold; capture a layer built with a "
                                          "capturable engine ('fused', 'torch_fp8_rowwise')")
            send = recv = None
            rows = lay.rows(None)
            if self.engine.spec.top_k < self.spec.top_k:  # no host read while capturing: the check on the device
                torch._assert_async(lay.stats[-1] <= self.engine.spec.top_k, "moe_ep split path: a token names "
                                    "one expert twice, more slots than the rank's engine takes")
        else:
            stats = lay.stats.tolist()  # the call's one host read: counts per destination, most slots in a row
            mine = self._fingerprint()
            send, recv, theirs = tr.counts(stats[:-1], header=(*mine, stats[-1]))
            if self._seq is not None and tr.world_size > 1:
                divergence.in_band(self._seq, mine, [h[:-1] for h in theirs])
            self._check_slots([h[-1] for h in theirs])
            rows = lay.rows(send)
        ids, w = Rows.compact(rows.dest_ids(), rows.select(topk_weights), self.engine.spec.top_k)
        meta, spec = pack_rows([None if scale is None else rows.select(scale), ids, w])
        q_in = tr.rows(rows.select(q), send, recv)
        scale_in, ids_in, w_in = unpack_rows(tr.rows(meta, send, recv), spec)
        partial = torch.empty((q_in.shape[0], self.spec.hidden_size), dtype=torch.bfloat16, device=q_in.device)
        eng.forward(QuantizedActivation(self.fmt, q_in, scale_in) if eng.takes_quantized else q_in, ids_in, w_in,
                    partial)
        back = tr.rows(partial, recv, send)
        rows.combine(back, out)
        return out

    def describe(self) -> dict:
        """What layer.plan reports for this path."""
        return dict(path=self.path, backend=self.name, engine=self.engine_name, numerics=self.engine.numerics,
                    transport=f"torch.distributed all_to_all_single ({self.transport_mode})",
                    wire=self.fmt if self.engine.takes_quantized else "bf16")

    def close(self) -> None:
        self.engine.close()
        self._staged = None
