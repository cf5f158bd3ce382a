"""MoELayer: one fused EP MoE forward per call, tokens in, combined expert outputs out, on every rank."""

from __future__ import annotations

import dataclasses
import inspect
from typing import List, Optional

import torch

from moe_ep.core import op, registry, watchdog
from moe_ep.core.device import require_arch
from moe_ep.core.dist import RankContext, all_reduce_max, canonical, run_agreed
from moe_ep.core.spec import LayerGeometry, MoESpec
from moe_ep.core.validate import (check_expert_ids, check_schedule, checks_mode, validate_forward,
                                  validate_spec_for_backend, validate_weights)
from moe_ep.core.watchdog import sequence
from moe_ep.core.weights import ExpertWeights, QuantizedExpertWeights
from moe_ep.eplb import ExpertMap, SlotRouter
from moe_ep.eplb import placement as eplb_placement
from moe_ep.eplb import swap as eplb_swap
from moe_ep.errors import (CapacityError, CheckConfigError, DeviceUnavailableError, DTypeError, FormatError,
                           GradientError, LayerClosedError, LayerCopyError, ProcessGroupError, SpecError,
                           UnknownArgumentError, WatchdogConfigError)
from moe_ep.formats import QuantizedWeights, check_format
from moe_ep.split import hooks as split_paths

__all__ = ["MoELayer", "AGREED_CALLS", "CHUNKING"]

# The default schedule's cross-rank agreement covers a layer's first call (every rank makes it; a bad wiring shows
# there, and every rank raises); later local failures are raised on their own rank after it took part with zero
# tokens (docs/api.md, "Checks").
AGREED_CALLS = 1
CHUNKING = ("strict", "agree")
_NO_LIMIT = 1 << 62
_MAX_SEEN = 4096  # (T, id dtype) pairs whose first call had its ids checked; forgotten (and re-checked) beyond it
# torch's C binding (~0.1 us); a CPU-only build has a placeholder there, and no capture.
_capturing = torch._C._cuda_isCurrentStreamCapturing if torch.backends.cuda.is_built() else (lambda: False)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _out_dtype_option(out_dtype):
    if out_dtype is None or out_dtype == "hidden" or out_dtype in _OUT_DTYPES:
        return out_dtype
    raise DTypeError("out_dtype", f"expected None (bf16, the kernels' output), 'hidden' (the call's hidden dtype) or "
                                  f"one of {[str(d) for d in _OUT_DTYPES]}, got {out_dtype!r}")


def _chunking_option(chunking):
    if chunking not in CHUNKING:
        raise SpecError("chunking", f"expected one of {list(CHUNKING)}, got {chunking!r}")
    return chunking


def _sequence_option(on) -> bool:
    if on is not None and not isinstance(on, bool):
        raise CheckConfigError("sequence_check", f"expected None (${sequence.SEQUENCE_ENV}, on by default), True or "
                                                 f"False, got {on!r}")
    return sequence.enabled() if on is None else on


def _context(group, device):
    """(the rank context, the device's error or None). A device this rank cannot use is an error of the agreement
    (raised on every rank), not a local one its peers would wait for: the context then takes the group's default
    device to agree on."""
    try:
        return RankContext.from_group(group, device), None
    except (DeviceUnavailableError, ProcessGroupError) as e:
        if e.argument != "device" or device is None:
            raise
        return RankContext.from_group(group, None), e


# MoELayer's own keywords: anything else goes to the backend, which must take it.
_LAYER_KEYWORDS = ("backend", "group", "device", "fmt", "check_values", "collective_checks", "chunking", "out_dtype",
                   "name", "timeout_s", "expert_map", "id_space", "count_load", "sequence_check")


def _backend_keywords(cls):
    """The keywords the backend class's constructor takes (None: any), following **options up its bases."""
    names = []
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None:
            continue
        params = list(inspect.signature(init).parameters.values())[1:]
        names += [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            return [n for n in dict.fromkeys(names) if n not in ("spec", "ctx", "fmt")]
    return None


def _check_options(cls, backend: str, options: dict) -> None:
    known = _backend_keywords(cls)
    if known is None:
        return
    for key in options:
        if key not in known:
            raise UnknownArgumentError(key, f"MoELayer takes no keyword {key!r}, and backend {backend!r} has no such "
                                            f"option: the layer's keywords are {list(_LAYER_KEYWORDS)}, the backend's "
                                            f"options {known}")


def _calibration(weights):
    return {k: getattr(weights, k, None) for k in ("act_amax", "fc2_act_amax")}


def _quietly(fn) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - tearing down a refused layer must not hide why it was refused
        pass


class MoELayer(LayerGeometry):
    """An expert-parallel MoE layer over a process group.

    backend: None picks by the device's arch (and fmt, if given); "auto" measures the paths the group can run (the
      fused kernel, "split", "two_level" across NVLink domains) and keeps the fastest (docs/scale-out.md); or a
      registered name. `plan` reports what runs.
    fmt: the quantization format (see moe_ep.FORMATS); None takes the backend's default.
    Every call checks types, shapes, dtypes, devices and contiguity (one host expression, ~1 us). The costly checks
    follow a schedule (docs/api.md, "Checks"; $MOE_EP_CHECKS=all turns both on for every call, =off turns the
    defaults off): None (default) / True (every call) / False (never):
    check_values: expert ids in range (one device sync on GPU). Default: every call on a CPU; on a GPU, the first
      call of each (T, id dtype) outside a graph capture.
    collective_checks: agree on validation across ranks before the data collectives, so a bad input on one rank
      raises on every rank (one tiny all_reduce). Default: the layer's first call. Otherwise a rank whose input
      fails takes part in the call with zero tokens (its peers' outputs stay right) and raises its own error.
    chunking: "strict" (default): a call with more than max_tokens_per_rank tokens is a CapacityError unless it
      passes max_tokens_across_ranks; "agree": every call agrees on the largest T across ranks (one tiny
      all_reduce and a host sync per call) and runs ceil(T_max / capacity) capacity-sized launches.
    out_dtype: the dtype a call without `out` returns: None (bf16, the kernels' own output), "hidden" (the call's
      hidden dtype) or torch.bfloat16 / float16 / float32.
    name: what the forward watchdog and the errors call this layer (default "moe_ep layer #<k>", k in creation
      order); an integration passes the module path. Every rank must give the same name.
    sequence_check: log every call in the group's sequence, so ranks out of step (a skipped, extra or wrong-layer
      call) are refused before any wrong output: in the torch reference's exchange, before the kernels' exchange
      (the call guard), and through the heartbeats. None: $MOE_EP_SEQUENCE_CHECK (on unless "0"). Independent of
      the watchdog's timer (timeout_s=0 keeps it). docs/watchdog.md says what turning it off costs and risks.
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
    backend_options: passed to the backend's constructor; a keyword neither the layer nor the backend takes is an
      UnknownArgumentError.

    Construction and every call are collective: all ranks of the group must take part. Construction agrees, in one
    small collective, on everything that must be equal on every rank (the spec, format, backend and its resolved
    knobs, the options above, the expert map, the calibration, the name and the layer's position among the group's
    layers): a difference is a RankDisagreementError on every rank, naming the field, each rank's value and the
    ranks, with nothing of the layer built (docs/api.md, "Every rank agrees").
    """

    def __init__(self, spec: MoESpec, weights: ExpertWeights, backend: Optional[str] = None, *, group=None,
                 device=None, fmt: Optional[str] = None, check_values: Optional[bool] = None,
                 collective_checks: Optional[bool] = None, chunking: str = "strict", out_dtype=None,
                 name: Optional[str] = None, timeout_s: Optional[float] = None,
                 expert_map: Optional[ExpertMap] = None, id_space: str = "logical", count_load: Optional[bool] = None,
                 sequence_check: Optional[bool] = None, **backend_options):
        self._backend = None
        self._eplb: Optional[SlotRouter] = None
        self._swap_template = None
        self._watch = None
        self._watch_paused = False
        self._seq = None
        self.handle = None
        ctx, device_error = _context(group, device)
        self.spec = spec
        self.ctx = ctx
        # Taken on every rank before anything can fail, so names and positions stay aligned across ranks.
        self.name, position, log = watchdog.layer_identity(name, ctx.group)
        domains = split_paths.domain_map(ctx)  # collective (once per group): before anything can fail locally
        built = {}

        def resolve(fmt):
            if device_error is not None:
                raise device_error
            if not isinstance(spec, MoESpec):
                raise DTypeError("spec", f"expected moe_ep.MoESpec, got {type(spec).__name__}")
            if name is not None and (not isinstance(name, str) or not name):
                raise SpecError("name", f"expected None or a non-empty string, got {name!r}")
            if fmt is None and isinstance(weights, QuantizedExpertWeights):
                fmt = weights.fmt  # already quantized: the layer runs in the pack's format
            if backend is None:
                entry = registry.select_backend(registry.detect_arch(ctx.device), fmt)
            else:
                entry = registry.get_entry(backend)
                if entry.arch != "cpu":  # a kernel backend named on a device of another arch (or the CPU)
                    require_arch(ctx.device, entry.arch, entry.name)
            fmt = split_paths.default_format(entry, ctx.device) if fmt is None else check_format(fmt)
            if fmt not in entry.formats:  # the entry states what its class serves (registry.resolve_backend)
                raise FormatError("fmt", f"backend {entry.name!r} serves {list(entry.formats)}, not {fmt!r}")
            cls = registry.resolve_backend(entry.name)
            split_paths.check_topology(cls, entry.name, domains)
            _check_options(cls, entry.name, backend_options)
            slot_spec = eplb_placement.slot_spec(spec, ctx, expert_map, id_space, count_load)
            validate_weights(slot_spec, weights, ctx, fmt)
            validate_spec_for_backend(slot_spec, cls, fmt, ctx.world_size)
            return entry, cls, fmt, slot_spec

        def local(fmt):
            entry, cls, fmt, slot_spec = resolve(fmt)
            mode = checks_mode()
            options = (check_schedule(check_values, "check_values", mode),
                       check_schedule(collective_checks, "collective_checks", mode),
                       _chunking_option(chunking), _out_dtype_option(out_dtype))
            bound = watchdog.parse_timeout(timeout_s)
            seq_on = _sequence_option(sequence_check)
            # The backend object (kernel backends resolve their knob set here, before any workspace exists).
            be = built["backend"] = cls(slot_spec, ctx, fmt=fmt, **backend_options)
            be.layer_name = self.name
            fields = dict(
                # The name as given (an integration's module path): a default name counts layers process-wide,
                # and a process in several groups may count differently from its peers in this one (the position
                # below is this group's own count).
                name=name, position=position // 2, backend=entry.name, fmt=fmt,
                **canonical(dataclasses.asdict(spec)),
                slots=None if expert_map is None else [expert_map.num_slots, expert_map.digest()],
                id_space=id_space if expert_map is not None else None,
                count_load=expert_map is not None if count_load is None else count_load,
                check_values=options[0], collective_checks=options[1], chunking=options[2],
                out_dtype=canonical(options[3]), sequence_check=seq_on, watchdog="off" if bound is None else "on",
                calibration=canonical(_calibration(weights)), weights=type(weights).__name__,
                device=ctx.device.type, backend_options=canonical(backend_options))
            fields.update({f"backend.{k}": canonical(v) for k, v in (be.agreement() or {}).items()})
            return (entry, cls, fmt, slot_spec), bound, options, seq_on, fields

        try:
            # One collective: every rank's local checks and the digest of what it built (dist.agree).
            (entry, cls, fmt, slot_spec), bound, options, seq_on, _ = run_agreed(
                ctx, lambda: local(fmt), "layer arguments", fields=lambda r: r[-1], subject=f"the layer {self.name!r}")
            self._values_sched, self._agree_sched, self.chunking, self._out_dtype = options
            self._calls = 0
            self._values_seen = set()
            self._empty = None
            self._on_cuda = ctx.device.type == "cuda"
            # What the backend's forward stages itself (converting once, where it copies anyway); the rest is
            # converted here. Declared by the backend class (moe_ep.core.backend.Backend; the registry resolves only
            # Backend subclasses).
            self._hidden_dtypes = cls.input_dtypes
            self._weight_dtypes = cls.routing_weight_dtypes
            self._backend_allocates = cls.allocates_output
            self.backend_name = entry.name
            self.fmt = fmt
            self.sequence_check = seq_on and log is not None
            self._route_spec = spec if expert_map is None or id_space == "logical" else slot_spec
            # What a bf16 swap quantizes with (statically scaled formats; None when the layer was given quantized
            # bytes).
            self._calibration = {k: getattr(weights, k, None) for k in ("act_amax", "fc2_act_amax")}
            self._eplb = eplb_placement.router(spec, slot_spec, ctx, expert_map, id_space, count_load)
            self._backend = built.pop("backend")
            self._backend.prepare_weights(weights)
            if self.sequence_check:
                self._seq = sequence.Caller(log, position)
                watchdog.keep_sequences()
            self._watch = watchdog.layer_watch(self.name, bound, ctx.group, ctx.device)
            self.handle = op.register_layer(self)
        except BaseException:
            # Nothing of a layer that was refused stays behind: no op handle, no watch, no backend, no workspace.
            be = built.pop("backend", None)
            if be is not None:
                _quietly(be.close)
            self.close()
            raise

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
    def plan(self):
        """What this layer runs (moe_ep.split.plan.Plan): the path, the backend, the engine and transport of a split
        path, the group's NVLink domains, and whether auto measured it, read it from the plan table, or the layer
        was built with it by name."""
        return split_paths.plan_of(self)

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
                 out: Optional[torch.Tensor] = None, *, max_tokens_across_ranks: Optional[int] = None) -> torch.Tensor:
        return self.forward(hidden, topk_idx, topk_weights, out, max_tokens_across_ranks=max_tokens_across_ranks)

    def forward(self, hidden: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                out: Optional[torch.Tensor] = None, *, max_tokens_across_ranks: Optional[int] = None) -> torch.Tensor:
        """hidden [T, H] bf16 / fp16 / fp32, topk_idx [T, K] int64 / int32, topk_weights [T, K] fp32 / bf16 / fp16 /
        fp64 -> [T, H] in out's dtype when out is given (written into it), else in the layer's out_dtype (bf16 by
        default). hidden is rounded to bf16 once, where the backend stages it; routing weights are read as fp32.
        T may differ per rank and may be 0; a -1 slot in topk_idx names no expert.

        T <= max_tokens_per_rank, unless the call is split into capacity-sized chunks: with
        max_tokens_across_ranks (the most tokens any rank passes to this call, the same number on every rank: an
        engine under data-parallel attention knows it) or on a layer built with chunking="agree" (the ranks agree
        on it, one tiny all_reduce per call). Under torch.compile the call is one opaque custom op
        (moe_ep.core.op). A call that needs a gradient (hidden, topk_weights or out requiring grad under grad
        mode) raises GradientError: moe_ep serves inference and computes none."""
        if torch.is_grad_enabled() and (getattr(hidden, "requires_grad", False)
                                        or getattr(topk_weights, "requires_grad", False)
                                        or getattr(out, "requires_grad", False)):
            self._refuse_gradient(hidden, topk_idx, topk_weights, out, max_tokens_across_ranks)
        if torch.compiler.is_compiling():
            if out is None:
                return op.forward(hidden, topk_idx, topk_weights, self.handle, max_tokens_across_ranks)
            op.forward_out(hidden, topk_idx, topk_weights, out, self.handle, max_tokens_across_ranks)
            return out
        return self.forward_eager(hidden, topk_idx, topk_weights, out, max_tokens_across_ranks)

    def _take_part_empty(self, hidden, topk_idx, topk_weights, max_tokens_across_ranks=None) -> None:
        """This call with no tokens, before a refusal on this rank alone: every call is collective, and the peers'
        call completes with whatever they pass (under torch.compile this runs as traced code)."""
        with torch.no_grad():
            if all(isinstance(t, torch.Tensor) for t in (hidden, topk_idx, topk_weights)):
                self.forward(hidden.detach()[:0], topk_idx[:0], topk_weights.detach()[:0],
                             max_tokens_across_ranks=max_tokens_across_ranks)
            else:  # no call at all: the input checks say why, typed
                self.forward(hidden, topk_idx, topk_weights, max_tokens_across_ranks=max_tokens_across_ranks)

    def _refuse_gradient(self, hidden, topk_idx, topk_weights, out, max_tokens_across_ranks) -> None:
        self._take_part_empty(hidden, topk_idx, topk_weights, max_tokens_across_ranks)
        which = next(n for n, t in (("hidden", hidden), ("topk_weights", topk_weights), ("out", out))
                     if t is not None and t.requires_grad)
        raise GradientError(which, "a forward that needs a gradient (it requires grad under grad mode): moe_ep "
                                   "computes no gradients (it serves inference), and an output without a graph would "
                                   "leave every gradient through this layer out; run under torch.inference_mode() "
                                   "or torch.no_grad(), or pass it detached")

    def forward_eager(self, hidden: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                      out: Optional[torch.Tensor] = None, max_tokens_across_ranks: Optional[int] = None) -> torch.Tensor:
        """The forward itself (validation, then the backend); what the custom op runs. Watched: a call that does
        not finish within the layer's bound ends the process (moe_ep.core.watchdog)."""
        sq = self._seq
        if sq is not None:
            # The group's sequence of calls (the exchange's fingerprint, the heartbeat's digests, the kernels' call
            # guard): logged whether or not the timer watches this call, so an unwatched call is no divergence.
            sq.enter()
        try:
            w = self._watch
            if w is None or self._watch_paused:
                return self._forward_unwatched(hidden, topk_idx, topk_weights, out, max_tokens_across_ranks)
            slot = w.begin()
            try:
                out = self._forward_unwatched(hidden, topk_idx, topk_weights, out, max_tokens_across_ranks)
            except BaseException:
                w.abandon(slot)
                raise
            w.end(slot)
            return out
        finally:
            if sq is not None:
                sq.leave()

    def output_dtype(self, hidden_dtype: torch.dtype) -> torch.dtype:
        """The dtype a call with hidden of `hidden_dtype` and no `out` returns."""
        o = self._out_dtype
        return torch.bfloat16 if o is None else hidden_dtype if o == "hidden" else o

    # Check schedules (docs/api.md, "Checks"): True every call, False never, None the default schedule.
    @property
    def check_values(self) -> Optional[bool]:
        return self._values_sched

    @check_values.setter
    def check_values(self, on: Optional[bool]) -> None:
        self._values_sched = check_schedule(on, "check_values", checks_mode())

    @property
    def collective_checks(self) -> Optional[bool]:
        return self._agree_sched

    @collective_checks.setter
    def collective_checks(self, on: Optional[bool]) -> None:
        self._agree_sched = check_schedule(on, "collective_checks", checks_mode())

    def _forward_unwatched(self, hidden, topk_idx, topk_weights, out=None, max_tokens_across_ranks=None):
        ctx = self.ctx
        call = self._calls
        self._calls = call + 1
        capturing = self._on_cuda and _capturing()
        m = max_tokens_across_ranks
        # Every rank reaches the same call number (all calls are collective), and ranks capture graphs together:
        # a schedule keyed by these two is entered by all ranks at the same call.
        agree = (ctx.world_size > 1 and not capturing
                 and (self._agree_sched or (self._agree_sched is None and call < AGREED_CALLS)))

        def local() -> int:
            if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 0):
                raise CapacityError("max_tokens_across_ranks", f"expected None or an int >= 0, got {m!r}")
            limit = m if m is not None else (_NO_LIMIT if self.chunking == "agree" else None)
            t = validate_forward(self._route_spec, ctx, hidden, topk_idx, topk_weights, out, False, limit)
            if t and not capturing and self._values_sched is not False:
                key = (t, topk_idx.dtype)
                if self._values_sched or not self._on_cuda or key not in self._values_seen:
                    check_expert_ids(self._route_spec, topk_idx)
                    if len(self._values_seen) >= _MAX_SEEN:
                        self._values_seen.clear()
                    self._values_seen.add(key)
            return t

        error = None
        if agree:
            t = run_agreed(ctx, local, "forward() inputs")
        else:
            try:
                t = local()
            except Exception as e:  # noqa: BLE001 - any local failure: take part, then raise it
                error, t = e, 0
        n = self._chunk_count(t, m, agree, capturing, error is None)
        if error is not None:
            if ctx.world_size > 1:
                # The peers are already on their way into the call's collectives: take part with no tokens (their
                # tokens routed to this rank's experts are still served, so their outputs are right), then raise.
                empty = self._empty_call()
                for _ in range(n):
                    self.backend.forward(*empty)
            raise error
        return self._run(hidden, topk_idx, topk_weights, out, t, n)

    def _chunk_count(self, t: int, m: Optional[int], agree: bool, capturing: bool, valid: bool) -> int:
        """How many capacity-sized launches this call takes, the same number on every rank."""
        c = self.spec.max_tokens_per_rank
        ctx = self.ctx
        if m is not None:
            if not valid and (isinstance(m, bool) or not isinstance(m, int) or m < 0):
                return 1  # this rank's own max_tokens_across_ranks is the error: the peers' count is unknowable
            if agree:
                # The one cheap place to catch ranks that disagree on the bound (their chunk counts would differ).
                hi, lo = all_reduce_max(ctx, [m, -m], "the agreement on max_tokens_across_ranks")
                if hi != -lo:
                    raise CapacityError("max_tokens_across_ranks", f"the ranks passed different values (from {-lo} "
                                                                   f"to {hi}); every rank must pass the same bound")
            return max(1, -(-m // c))
        if self.chunking != "agree":
            return 1
        if ctx.world_size == 1:
            return max(1, -(-t // c))
        if capturing:
            raise CapacityError("max_tokens_across_ranks", "chunking='agree' agrees on the call's largest T on the "
                                                           "host, which a CUDA graph capture cannot hold; pass "
                                                           "forward(..., max_tokens_across_ranks=N) when capturing")
        (most,) = all_reduce_max(ctx, [t], "the agreement on the call's largest T (chunking='agree')")
        return max(1, -(-most // c))

    def _empty_call(self):
        e = self._empty
        if e is None:
            dev, h, k = self.ctx.device, self.spec.hidden_size, self.spec.top_k
            e = self._empty = (torch.empty((0, h), dtype=torch.bfloat16, device=dev),
                               torch.empty((0, k), dtype=torch.int64, device=dev),
                               torch.empty((0, k), dtype=torch.float32, device=dev),
                               torch.empty((0, h), dtype=torch.bfloat16, device=dev))
        return e

    def _run(self, hidden, topk_idx, topk_weights, out, t: int, n: int) -> torch.Tensor:
        be = self.backend
        want = out.dtype if out is not None else self.output_dtype(hidden.dtype)
        if hidden.dtype not in self._hidden_dtypes:
            hidden = hidden.to(torch.bfloat16)
        if topk_weights.dtype not in self._weight_dtypes:
            topk_weights = topk_weights.to(torch.float32)
        if want is torch.bfloat16 and out is not None:
            target = out
        elif n == 1 and self._backend_allocates:
            target = None  # the backend returns a fresh tensor (moe_ep.core.backend.Backend.allocates_output)
        else:
            target = torch.empty((t, self.spec.hidden_size), dtype=torch.bfloat16, device=self.ctx.device)
        router = self._eplb  # logical ids -> slots, pairs counted, per launch (docs/eplb.md)
        if n == 1:
            res = be.forward(hidden, topk_idx if router is None else router.route(topk_idx), topk_weights, target)
            if target is None:
                target = res
        else:
            c = self.spec.max_tokens_per_rank
            for i in range(n):
                a = min(i * c, t)
                b = min(a + c, t)
                idx = topk_idx[a:b] if router is None else router.route(topk_idx[a:b])
                be.forward(hidden[a:b], idx, topk_weights[a:b], target[a:b])
        if target is out or want is torch.bfloat16:
            return target
        if out is not None:
            return out.copy_(target)
        return target.to(want)

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
        if self._seq is not None:
            self._seq.close()
            self._seq = None
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        self._eplb = self._swap_template = None
        if self._backend is not None:
            try:
                self._backend.close()
            finally:
                self._backend = None

    def __copy__(self):
        raise LayerCopyError(self.name or "layer", "an moe_ep layer cannot be copied: a copy would share this one's "
                                                   "backend and workspace but count its calls apart (and close "
                                                   "them under it); build a new layer on every rank")

    def __deepcopy__(self, memo):
        raise LayerCopyError(self.name or "layer", "an moe_ep layer cannot be copied (its workspace is collective): "
                                                   "build a new layer on every rank")

    def __reduce_ex__(self, protocol):
        raise LayerCopyError(self.name or "layer", "an moe_ep layer cannot be pickled or saved with torch.save (it "
                                                   "holds a process group and a collective workspace); save its "
                                                   "weights (oracle_weights(), or MoEModule's state_dict()) instead")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self):
        return (f"MoELayer(backend={getattr(self, 'backend_name', '?')!r}, fmt={getattr(self, 'fmt', '?')!r}, "
                f"rank={self.ctx.rank}/{self.ctx.world_size}, spec={self.spec})")

