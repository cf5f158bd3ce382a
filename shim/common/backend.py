"""What every kernel backend does, whatever the tree: the moe_ep.Backend contract over one shim frontend.

A backend serves one row of its arch's format table (shim/<arch>/formats.py). The arch module
(shim/sm90/backend.py, shim/sm100/backend.py) defines the arch's class (its table, knobs module and autotune) and,
beside it, one subclass per row, written out and bound to its row by format (`class Sm90Fp8Backend(Sm90Backend,
fmt="fp8_block")`: the row's `target` must name that class); moe_ep's registry resolves them by those lazy strings.
moe_ep never imports shim.

The phases, each a final composer (shim/common/phases.py: an arch class cannot replace one by accident):
  validate   before construction, by the layer: the device's arch (moe_ep.core.device.require_arch, the same
             guard for every kernel backend, before this module is imported), the spec against the row
             (check_spec), the kernel module in the tree (the registry's probe); __init__ keeps the options
  weights    prepare_weights: the knob set resolved once (explicit > knob cache > shipped table > knob model >
             heuristic, or a collective tune for knobs="auto" on a miss), then its one frontend (one workspace), the
             weights laid out and the kernel compiled
  forward    the frontend's forward (its stage and launch phases, its internal graphs: shim/common/frontend.py)
  oracle     oracle_weights / staged_activation, read back from what the kernel was handed
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import ClassVar, List, Optional, Tuple

import torch

from moe_ep.core.backend import Backend
from moe_ep.core.spec import LayerGeometry
from moe_ep.core.weights import ExpertWeights
from moe_ep.errors import BackendUnavailableError
from moe_ep.formats import QuantizedActivation, QuantizedWeights
from shim.common.formats import FormatTable, KernelFormat
from shim.common.knob_cache import KnobCache, cache_key
from shim.common.phases import Composed, final

__all__ = ["KernelBackend", "check_compile_target", "compile_only_frontend"]


class _TuneLater(Exception):
    """agreement(): knobs="auto" needs the collective tune, which runs with the weights."""


def check_compile_target(table: FormatTable) -> None:
    """A compile without a GPU of the table's arch needs CUTE_DSL_ARCH naming that arch (or such a GPU on this
    host); BackendUnavailableError naming the variable otherwise. A layer's device is checked before the backend is
    even imported (moe_ep.core.device.require_arch, in MoELayer): the same arch guard for every kernel backend."""
    import torch

    from moe_ep.core.registry import detect_arch

    target = os.environ.get("CUTE_DSL_ARCH", "")
    here = not target and torch.cuda.is_available() and detect_arch() == table.arch
    if not (target.startswith(table.cute_targets) or here):
        raise BackendUnavailableError(
            "CUTE_DSL_ARCH", f"a compile-only {table.arch} build targets {table.cute_targets[0]}a: set "
            f"CUTE_DSL_ARCH={table.cute_targets[0]}a in the environment before cutlass is imported "
            f"(it is {target or 'unset'})")


class KernelBackend(Composed, LayerGeometry, Backend):
    # Set by each arch: its format table and knobs module (resolve_knobs, the knob type).
    table: ClassVar[FormatTable]
    knobs_module: ClassVar[ModuleType]
    # Bound on each row class (`fmt=` in its class statement): the row it serves.
    row: ClassVar[KernelFormat]
    # The frontend copies both into its buffers on every path anyway; the copy converts (shim/common/frontend.py).
    input_dtypes = (torch.bfloat16, torch.float16, torch.float32)
    routing_weight_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    allocates_output = True  # out=None: the frontend's graph writes its workspace, the call returns a fresh copy
    # The kernels reach peers by NVLink P2P: a layer over several NVLink domains is refused at construction
    # (moe_ep/split/topology.py); backend="auto" plans two_level or split there.
    needs_p2p = True

    def __init_subclass__(cls, fmt: Optional[str] = None, **kwargs):
        """`class X(<Arch>Backend, fmt="...")` binds X to its table's row for that format: its name, the format it
        serves and the frontend it builds all come from the row, whose `target` must name X (what the registry
        resolves)."""
        super().__init_subclass__(**kwargs)
        if fmt is None:
            return
        row = cls.table.row(fmt)
        if row.target != f"{cls.__module__}:{cls.__qualname__}":
            raise ValueError(f"{cls.__module__}.{cls.__qualname__} serves {fmt!r}, whose row {row.backend!r} "
                             f"targets {row.target!r}")
        cls.row, cls.name, cls.weight_formats = row, row.backend, (row.fmt,)

    # -- validate ----------------------------------------------------------------------------------------------
    @final
    def __init__(self, spec, ctx, fmt: Optional[str] = None, *, knobs=None, max_active_clusters=None,
                 knob_cache_key: Optional[str] = None, internal_graphs: bool = True):
        """Backend options (MoELayer(..., **options)): knobs (None | dict | knob set | "auto"),
        max_active_clusters (default: the device's), knob_cache_key (default: the geometry's key),
        internal_graphs (one CUDA graph per token count, on by default: see shim/common/graph_cache.py)."""
        super().__init__(spec, ctx, fmt)
        self._internal_graphs = bool(internal_graphs)
        self.requested_knobs = knobs
        self.max_active_clusters = max_active_clusters
        self.knob_cache_key = knob_cache_key or cache_key(
            arch=self.arch, fmt=self.fmt, hidden=spec.hidden_size, intermediate=spec.intermediate_size,
            experts_per_rank=self.experts_per_rank, top_k=spec.top_k, world_size=ctx.world_size,
            max_tokens_per_rank=spec.max_tokens_per_rank)
        self.frontend = None
        self._resolved = None  # (knobs, source), from agreement(): the layer's ranks compare it before any workspace
        self.knob_source: Optional[str] = None
        self.autotune_result = None
        self._last_t = 0

    @classmethod
    def check_spec(cls, spec, fmt: str, world_size: int) -> List[Tuple[str, str]]:
        """The format's own size rules (moe_ep.formats), then the kernel's (its row)."""
        return list(super().check_spec(spec, fmt, world_size)) + cls.row.size_violations(
            hidden=spec.hidden_size, intermediate=spec.intermediate_size, top_k=spec.top_k)

    # -- hooks (per arch) --------------------------------------------------------------------------------------
    def autotune(self, weights: ExpertWeights):
        """knobs="auto" with neither a cache nor a shipped entry: a collective tune returning the winning knob set
        (and keeping its AutotuneResult in `autotune_result`; its kernel_weights, when set, are adopted by the
        layer's frontend instead of laying the weights out again)."""
        raise NotImplementedError

    # -- weights: knobs once, before any workspace, then the one frontend ----------------------------------------
    @classmethod
    def frontend_class(cls):
        return cls.row.frontend_class()

    @final
    def resolve_knobs(self, weights: ExpertWeights, tune=None):
        """(knob set, where it came from), in one pass: explicit > knob cache > shipped table > knob model >
        heuristic; "auto" tunes on a miss of cache and table (a shipped entry counts as tuned: "auto" takes it rather
        than tune again), in the model's and the heuristic's place."""
        return self.knobs_module.resolve_knobs(self.requested_knobs, fmt=self.fmt,
                                               max_tokens_per_rank=self.spec.max_tokens_per_rank,
                                               cache_key=self.knob_cache_key, shipped=self.shipped_knobs,
                                               model=self.model_knobs,
                                               tune=tune or (lambda: self.autotune(weights)),
                                               hidden=self.spec.hidden_size,
                                               intermediate=self.spec.intermediate_size)

    @final
    def shipped_knobs(self):
        """The shipped table's knobs for this layer on this GPU and this (verified) drop, or None."""
        from shim.common import knob_table, tree

        tree.activate(self.arch)  # verifies the tree: a table is keyed by the drop it was measured on
        provenance = tree.tree_provenance(self.arch) or {}
        drop = provenance.get("carrier_sha256") if provenance.get("verified") and not provenance.get("unpinned") \
            else None
        hit = knob_table.lookup(self.arch, self.knob_cache_key, knob_table.device_name(self.ctx.device), drop)
        return None if hit is None else hit[0]

    def model_knobs(self):
        """A knob set derived from the shipped tables for a geometry they do not cover (the arch's knob model), or
        None: the heuristic then decides (a hook: sm90 has a model)."""
        return None

    @final
    def agreement(self):
        """The knob set, resolved before any workspace (the layer's construction agreement compares it across ranks:
        a knob cache or shipped table one host has and another lacks would build different kernels). knobs="auto"
        missing cache and table is tuned later, collectively: one winner on every rank."""
        def tune():
            raise _TuneLater

        from shim.common import call_guard

        guard = call_guard.enabled()  # on one rank only, it would wait for its peers' words forever
        try:
            self._resolved = self.resolve_knobs(None, tune)
        except _TuneLater:
            return {"knobs": "auto: a collective tune", "call_guard": guard}
        return {"knobs": self._resolved[0].to_json(), "call_guard": guard}

    @final
    def make_frontend(self, knobs):
        """A frontend (one workspace) for this layer with the given knob set."""
        return self.frontend_class()(self.spec, self.ctx, knobs, row=self.row,
                                     max_active_clusters=self.max_active_clusters)

    @final
    def prepare_weights(self, weights: ExpertWeights) -> None:
        knobs, self.knob_source = self._resolved or self.resolve_knobs(weights)
        self.frontend = self.make_frontend(knobs)
        self.frontend.use_graphs = self._internal_graphs
        laid_out = getattr(self.autotune_result, "kernel_weights", None)
        if laid_out is not None:  # the tune's candidates shared one layout (it does not depend on the knobs)
            self.frontend.adopt_weights(laid_out)
            self.autotune_result.kernel_weights = None
        else:
            self.frontend.load_weights(weights)
        self.frontend.compile()
        if self.frontend.guard is not None:
            self.frontend.guard.name(self.layer_name)

    @property
    def knobs(self):
        return self.frontend.knobs

    @property
    def internal_graphs(self) -> bool:
        """Whether eager calls replay one internal CUDA graph per token count (the default) or launch through the
        CuTe executor every time (hundreds of microseconds of host time a call: docs/shim.md; for comparisons)."""
        return self._internal_graphs

    @internal_graphs.setter
    def internal_graphs(self, on: bool) -> None:
        self._internal_graphs = bool(on)
        if self.frontend is not None:
            self.frontend.use_graphs = self._internal_graphs

    # -- forward, oracle, close ----------------------------------------------------------------------------------
    @final
    def forward(self, hidden, topk_idx, topk_weights, out):
        self._last_t = hidden.shape[0]
        return self.frontend.forward(hidden, topk_idx, topk_weights, out)

    @final
    def oracle_weights(self) -> QuantizedWeights:
        # Read back from the tensors the kernel is handed, not kept aside.
        return self.frontend.weights.canonical()

    @final
    def replace_experts(self, local_slots, weights: QuantizedWeights) -> None:
        # Into the tensors the compiled kernel and every captured graph already point at, through the format's own
        # layout (shim/common/weights.py KernelWeights.replace_experts): same addresses, a fresh load's bytes.
        self.frontend.weights.replace_experts(local_slots, weights)

    @final
    def staged_activation(self) -> QuantizedActivation:
        return self.frontend.staged_activation(self._last_t)

    @final
    def close(self) -> None:
        if self.frontend is not None:
            self.frontend.close()


def compile_only_frontend(backend, spec, *, fmt: Optional[str] = None, knobs=None, rank: int = 0,
                          world_size: int = 1):
    """The frontend a layer of `backend` (a registered name or class) would build for `spec`, built for a
    compile without a GPU (CUTE_DSL_ARCH names the target; tensors are fakes with symbolic extents): what CI
    compiles every kernel through, and the tuner's and the drop audit's build checks. The spec is checked
    against the backend's rules first (SpecError), as the layer would, then the compile target
    (check_compile_target); knobs resolve as explicit > heuristic (the user's knob cache is not read, so a compile
    check does not depend on the machine it runs on)."""
    from moe_ep.core.dist import RankContext
    from moe_ep.errors import SpecError
    from moe_ep.core.registry import resolve_backend

    cls = resolve_backend(backend) if isinstance(backend, str) else backend
    fmt = fmt or cls.row.fmt
    if fmt != cls.row.fmt:
        raise SpecError("fmt", f"the {cls.arch} kernels serve {list(cls.table.fmts)}; {cls.name!r} serves "
                               f"{cls.row.fmt!r}, got {fmt!r}")
    problems = cls.check_spec(spec, fmt, world_size)
    if problems:
        argument, message = problems[0]
        raise SpecError(argument, f"{message} (backend {cls.name!r})")
    check_compile_target(cls.table)
    knob_set, _ = cls.knobs_module.resolve_knobs(knobs, fmt=fmt, max_tokens_per_rank=spec.max_tokens_per_rank,
                                                 cache_key="", cache=KnobCache(""), hidden=spec.hidden_size,
                                                 intermediate=spec.intermediate_size)
    return cls.frontend_class()(spec, RankContext.detached(rank, world_size), knob_set, row=cls.row,
                                compile_only=True)
