"""MoELayer: one fused EP MoE forward per call, tokens in, combined expert outputs out, on every rank."""

from __future__ import annotations

from typing import List, Optional

import torch

from moe_ep.core import op, registry, watchdog
from moe_ep.core.device import require_arch
from moe_ep.core.dist import RankContext, run_agreed
from moe_ep.core.errors import DTypeError, FormatError, LayerClosedError, WatchdogConfigError
from moe_ep.core.spec import LayerGeometry, MoESpec
from moe_ep.core.validate import validate_forward, validate_spec_for_backend, validate_weights
from moe_ep.core.weights import ExpertWeights
from moe_ep.eplb import ExpertMap, SlotRouter
from moe_ep.eplb import placement as eplb_placement
from moe_ep.eplb import swap as eplb_swap
from moe_ep.formats import QuantizedWeights, check_format

__all__ = ["MoELayer"]


class MoELayer(LayerGeometry):
    """An expert-parallel MoE layer over a process group.

    backend: None / "auto" picks by the device's arch (and fmt, if given); or a registered name.
    fmt: the quantization format (see moe_ep.FORMATS); None takes the backend's default.
    check_values: check expert ids are in range on every call (one device sync on GPU).
    collective_checks: agree on validation across ranks before the data collectives, so a bad input on one
      rank raises everywhere instead of stranding the others (one tiny all_reduce per call).
    name: what the forward watchdog calls this layer (default "moe_ep layer #<k>", k in creation order).
    timeout_s: the watchdog's bound on one forward (seconds; 0 turns it off; default $MOE_EP_TIMEOUT_S, else
      10 s + 2 x the slowest call so far): a call that does not finish in time ends the process with one message
      naming the layer, the call and the peers that stopped (exit code moe_ep.WATCHDOG_EXIT_CODE; docs/watchdog.md).
    expert_map: a moe_ep.ExpertMap placing spec.num_experts logical experts on expert_map.num_slots physical slots
      (replicas; docs/eplb.md); `weights` then holds this rank's slots (num_experts = num_slots). None: the slots are
      the experts.
    id_space: what topk_idx holds when an expert_map is given: "logical" (the layer maps ids to slots on the device,
      by the replica rule in moe_ep/eplb/router.py) or "physical" (slot ids, mapped by the caller).
    count_load: count the (token, expert) pairs this rank routes to each slot, on the device (load_counts()); default
      True with an expert_map, else False.
    backend_options: passed to the backend's constructor.

    Construction and every call are collective: all ranks of the group must take part.
    """

    def __init__(self, spec: MoESpec, weights: ExpertWeights, backend: Optional[str] = None, *, group=None,
                 device=None, fmt: Optional[str] = None, check_values: bool = True, collective_checks: bool = True,
                 name: Optional[str] = None, timeout_s: Optional[float] = None,
                 expert_map: Optional[ExpertMap] = None, id_space: str = "logical", count_load: Optional[bool] = None,
                 **backend_options):
        if not isinstance(spec, MoESpec):
            raise DTypeError("spec", f"expected moe_ep.MoESpec, got {type(spec).__name__}")
        ctx = RankContext.from_group(group, device)
        self.spec = spec
        self.ctx = ctx
        self.check_values = check_values
        self.collective_checks = collective_checks
        self._backend = None
        self._eplb: Optional[SlotRouter] = None
        self._swap_template = None
        self._watch = None
        self._watch_paused = False
        self.handle = op.register_layer(self)

        def resolve():
            if backend is None or backend == "auto":
                entry = registry.select_backend(registry.detect_arch(ctx.device), fmt)
            else:
                entry = registry.get_entry(backend)
                if entry.arch != "cpu":  # a kernel backend named on a device of another arch (or the CPU)
                    require_arch(ctx.device, entry.arch, entry.name)
            f = entry.default_format if fmt is None else check_format(fmt)
            if f not in entry.formats:
                raise FormatError("fmt", f"backend {entry.name!r} serves {list(entry.formats)}, not {f!r}")
            cls = registry.resolve_backend(entry.name)
            served = getattr(cls, "weight_formats", entry.formats)
            if f not in served:
                raise FormatError("fmt", f"backend {entry.name!r} ({cls.__name__}) serves {list(served)}, not {f!r}")
            slot_spec = eplb_placement.slot_spec(spec, ctx, expert_map, id_space, count_load)
            validate_weights(slot_spec, weights, ctx, f)
            validate_spec_for_backend(slot_spec, cls, f, ctx.world_size)
            return entry, cls, f, slot_spec

        (entry, cls, f, slot_spec), bound = run_agreed(ctx, lambda: (resolve(), watchdog.parse_timeout(timeout_s)),
                                                       "layer arguments")
        self.backend_name = entry.name
        self.fmt = f
        self._route_spec = spec if expert_map is None or id_space == "logical" else slot_spec
        # What a bf16 swap quantizes with (statically scaled formats; None when the layer was given quantized bytes).
        self._calibration = {k: getattr(weights, k, None) for k in ("act_amax", "fc2_act_amax")}
        self._eplb = eplb_placement.router(spec, slot_spec, ctx, expert_map, id_space, count_load)
        self._backend = cls(slot_spec, ctx, fmt=f, **backend_options)
        self._backend.prepare_weights(weights)
        self.name, self._watch = watchdog.watch_layer(name, bound, ctx.group, ctx.device)

    # -- properties ----------------------------------------------------------------------------------------
    @property
    def backend(self):
        if self._backend is None:
            raise LayerClosedError(None, f"this layer ({self.spec}) was closed; build a new MoELayer")
        return self._backend

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    @property
    def num_slots(self) -> int:
        """Physical expert slots over all ranks (spec.num_experts without an expert_map)."""
        return self.backend.spec.num_experts

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.ctx.world_size

    @property
    def expert_map(self) -> Optional[ExpertMap]:
        """The placement the layer routes by now (None: built without one; slots are experts)."""
        return None if self._eplb is None else self._eplb.expert_map

    @property
    def id_space(self) -> str:
        """What topk_idx holds: "logical" (mapped by the layer, or no map at all) or "physical" (slot ids)."""
        return "logical" if self._eplb is None or self._eplb.expert_map is None else self._eplb.id_space

    @property
    def watch(self):
        """This layer's forward watchdog (moe_ep.core.watchdog.Watch: its name, bound and call count), or None
        when it was built with timeout_s=0 (or MOE_EP_TIMEOUT_S=0) or is closed."""
        return self._watch

    @property
    def watched(self) -> bool:
        """Whether forwards are watched now. Set False to leave them unwatched for a while (a profiler session,
        the benchmark's on/off comparison) and True to watch them again; the layer's Watch stays registered, so
        its call numbers go on. A layer built with the watchdog off cannot be turned on (WatchdogConfigError)."""
        return self._watch is not None and not self._watch_paused

    @watched.setter
    def watched(self, on: bool) -> None:
        if on and self._watch is None:
            raise WatchdogConfigError("watched", "this layer was built with its watchdog off (timeout_s=0 or "
                                                 "MOE_EP_TIMEOUT_S=0); build it with a bound to watch it")
        self._watch_paused = not on

    # -- forward -------------------------------------------------------------------------------------------
    def __call__(self, hidden: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.forward(hidden, topk_idx, topk_weights, out)

    def forward(self, hidden: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """hidden [T, H] bf16, topk_idx [T, K] int64/int32, topk_weights [T, K] fp32 -> [T, H] bf16 (written
        into out when given). T may differ per rank and may be 0; T <= max_tokens_per_rank; a -1 slot in
        topk_idx names no expert. Under torch.compile the call is one opaque custom op (moe_ep.core.op)."""
        if torch.compiler.is_compiling():
            if out is None:
                return op.forward(hidden, topk_idx, topk_weights, self.handle)
            op.forward_out(hidden, topk_idx, topk_weights, out, self.handle)
            return out
        return self.forward_eager(hidden, topk_idx, topk_weights, out)

    def forward_eager(self, hidden: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                      out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The forward itself (validation, then the backend); what the custom op runs. Watched: a call that does
        not finish within the layer's bound ends the process (moe_ep.core.watchdog)."""
        w = self._watch
        if w is None or self._watch_paused:
            return self._forward_unwatched(hidden, topk_idx, topk_weights, out)
        slot = w.begin()
        try:
            out = self._forward_unwatched(hidden, topk_idx, topk_weights, out)
        except BaseException:
            w.abandon(slot)
            raise
        w.end(slot)
        return out

    def _forward_unwatched(self, hidden: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                           out: Optional[torch.Tensor] = None) -> torch.Tensor:
        spec = self._route_spec
        if self.collective_checks:
            t = run_agreed(self.ctx, lambda: validate_forward(spec, self.ctx, hidden, topk_idx, topk_weights,
                                                              out, self.check_values), "forward() inputs")
        else:
            t = validate_forward(spec, self.ctx, hidden, topk_idx, topk_weights, out, self.check_values)
        if out is None:
            out = torch.empty((t, self.spec.hidden_size), dtype=torch.bfloat16, device=self.ctx.device)
        if self._eplb is not None:
            topk_idx = self._eplb.route(topk_idx)  # logical ids -> slots, pairs counted (docs/eplb.md)
        return self.backend.forward(hidden, topk_idx, topk_weights, out)

    def oracle_weights(self) -> QuantizedWeights:
        return self.backend.oracle_weights()

    # -- load balancing (docs/eplb.md) ---------------------------------------------------------------------------
    def load_counts(self, reset: bool = False, gather: bool = False) -> torch.Tensor:
        """(token, expert) pairs this rank routed to each slot since the last reset: int64 [num_slots] on the layer's
        device (no host sync). reset: zero the counters after reading, in stream order. gather: summed over all
        ranks, i.e. the pairs each slot received (one all_reduce; collective)."""
        self.backend  # noqa: B018 - a closed layer says so (LayerClosedError)
        if self._eplb is None:
            raise eplb_placement.no_counters()
        return self._eplb.load_counts(self.ctx, reset, gather)

    def replace_experts(self, slots, weights) -> List[int]:
        """Collective: write new weights over this rank's local slots `slots` (ints in [0, slots_per_rank); may be
        empty on some ranks), in place; the map is unchanged (a weight update). weights: (w13 [n, 2I, H], w2 [n, H, I])
        bf16, quantized as the load quantizes, or a moe_ep.QuantizedWeights of this layer's fmt, written as it is.
        Checked on every rank before anything changes. Returns the slots written."""
        return eplb_swap.replace_experts(self, slots, weights)

    def rearrange(self, expert_map: ExpertMap, weights=None) -> List[int]:
        """Collective: install `expert_map` (the same on every rank; same size as the current one) and give every
        slot whose logical expert changes its new expert: `weights` for this rank's changed slots in increasing slot
        order (as in replace_experts), or None to copy the quantized bytes from slots that hold that expert now (one
        all_to_all). Kernel tensors and the device map are written in place: captured graphs stay valid and read
        the new placement. Returns this rank's rewritten local slots."""
        return eplb_swap.rearrange(self, expert_map, weights)

    def close(self) -> None:
        op.unregister_layer(self.handle)
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        self._eplb = self._swap_template = None
        if self._backend is not None:
            try:
                self._backend.close()
            finally:
                self._backend = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self):
        return (f"MoELayer(backend={getattr(self, 'backend_name', '?')!r}, fmt={getattr(self, 'fmt', '?')!r}, "
                f"rank={self.ctx.rank}/{self.ctx.world_size}, spec={self.spec})")

