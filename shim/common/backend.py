"""What every kernel backend does, whatever the tree: the moe_ep.Backend contract over one shim frontend.

At load (prepare_weights) the backend resolves its knob set once -- explicit > the knob cache > the drop's
heuristic, or a collective tune for knobs="auto" -- and only then builds its one frontend (one workspace),
lays out the weights and compiles. The arch modules (shim/sm90/backend.py, shim/sm100/backend.py) say which
frontend serves each format, which geometry rules apply (shim/<arch>/limits.py) and how knobs resolve.
moe_ep's registry names these classes by lazy strings; moe_ep never imports shim.
"""

from __future__ import annotations

from types import ModuleType
from typing import ClassVar, List, Optional, Tuple

import torch

from moe_ep.core.backend import Backend
from moe_ep.core.weights import ExpertWeights
from moe_ep.formats import QuantizedActivation, QuantizedWeights
from shim.common.knob_cache import KnobCache, cache_key

__all__ = ["KernelBackend", "compile_only_frontend", "size_violations"]


def size_violations(arch: str, limits: ModuleType, fmt: str, *, hidden: int, intermediate: int,
                    top_k: int) -> List[Tuple[str, str]]:
    """(argument, message) for each size the `arch` kernel of `fmt` cannot serve under `limits` (shim/<arch>/
    limits.py: FORMATS, FORMAT_MULTIPLE, MAX_TOP_K); empty when it can.

    `intermediate` is moe_ep's I (the down projection's K); the kernels' FC1 width is 2I.
    """
    if fmt not in limits.FORMAT_MULTIPLE:
        return [("fmt", f"the {arch} kernels serve {list(limits.FORMATS)}, got {fmt!r}")]
    h_mult, i_mult = limits.FORMAT_MULTIPLE[fmt]
    out = []
    if hidden % h_mult:
        out.append(("hidden_size", f"must be a multiple of {h_mult} for the {arch} {fmt} kernel, got {hidden}"))
    if intermediate % i_mult:
        out.append(("intermediate_size",
                    f"must be a multiple of {i_mult} for the {arch} {fmt} kernel, got {intermediate}"))
    if not 1 <= top_k <= limits.MAX_TOP_K:
        out.append(("top_k", f"must be in [1, {limits.MAX_TOP_K}] for the {arch} kernels' dispatch, got {top_k}"))
    return out


class KernelBackend(Backend):
    # Set by each arch: its limits module (the geometry rules size_violations applies) and knobs module
    # (resolve_knobs, the knob type).
    limits: ClassVar[ModuleType]
    knobs_module: ClassVar[ModuleType]
    # The frontend copies both into its buffers on every path anyway; the copy converts (shim/common/frontend.py).
    input_dtypes = (torch.bfloat16, torch.float16, torch.float32)
    routing_weight_dtypes = (torch.float32, torch.bfloat16, torch.float16)

    def __init__(self, spec, ctx, fmt: Optional[str] = None, *, knobs=None, max_active_clusters=None,
                 knob_cache_key: Optional[str] = None, internal_graphs: bool = True):
        """Backend options (MoELayer(..., **options)): knobs (None | dict | knob set | "auto"),
        max_active_clusters (default: the device's), knob_cache_key (default: the geometry's key),
        internal_graphs (one CUDA graph per token count, on by default: see shim/common/frontend.py)."""
        super().__init__(spec, ctx, fmt)
        self._internal_graphs = bool(internal_graphs)
        self.requested_knobs = knobs
        self.max_active_clusters = max_active_clusters
        self.knob_cache_key = knob_cache_key or cache_key(
            arch=self.arch, fmt=self.fmt, hidden=spec.hidden_size, intermediate=spec.intermediate_size,
            experts_per_rank=spec.experts_per_rank(ctx.world_size), top_k=spec.top_k, world_size=ctx.world_size,
            max_tokens_per_rank=spec.max_tokens_per_rank)
        self.frontend = None
        self.knob_source: Optional[str] = None
        self.autotune_result = None
        self._last_t = 0

    @classmethod
    def check_spec(cls, spec, fmt: str, world_size: int) -> List[Tuple[str, str]]:
        return list(super().check_spec(spec, fmt, world_size)) + size_violations(
            cls.arch, cls.limits, fmt, hidden=spec.hidden_size, intermediate=spec.intermediate_size, top_k=spec.top_k)

    # -- per arch / format -----------------------------------------------------------------------------------
    @staticmethod
    def frontend_class():
        raise NotImplementedError

    def autotune(self, weights: ExpertWeights):
        """knobs="auto" with no cache entry: a collective tune returning the winning knob set."""
        raise NotImplementedError

    # -- knobs, once, before any workspace -------------------------------------------------------------------
    def resolve_knobs(self, weights: ExpertWeights):
        """(knob set, where it came from): explicit > knob cache > shipped table > knob model > heuristic; "auto"
        tunes on a cache miss (a shipped entry counts as tuned: "auto" takes it rather than tune again)."""
        if self.requested_knobs == "auto":
            if KnobCache().get(self.knob_cache_key) is None and self.shipped_knobs() is None:
                return self.autotune(weights), "autotune"
        return self.knobs_module.resolve_knobs(self.requested_knobs, fmt=self.fmt,
                                               max_tokens_per_rank=self.spec.max_tokens_per_rank,
                                               cache_key=self.knob_cache_key, shipped=self.shipped_knobs,
                                               model=self.model_knobs)

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
        None: the heuristic then decides."""
        return None

    def make_frontend(self, knobs):
        """A frontend (one workspace) for this layer with the given knob set."""
        return self.frontend_class()(self.spec, self.ctx, knobs, max_active_clusters=self.max_active_clusters)

    @property
    def internal_graphs(self) -> bool:
        """Whether eager calls replay one internal CUDA graph per token count (the default) or launch through the
        CuTe executor every time (~200 us of host time a call on the H200 host; for comparisons)."""
        return self._internal_graphs

    @internal_graphs.setter
    def internal_graphs(self, on: bool) -> None:
        self._internal_graphs = bool(on)
        if self.frontend is not None:
            self.frontend.use_graphs = self._internal_graphs

    # -- the moe_ep.Backend contract -------------------------------------------------------------------------
    @property
    def knobs(self):
        return self.frontend.knobs

    def prepare_weights(self, weights: ExpertWeights) -> None:
        knobs, self.knob_source = self.resolve_knobs(weights)
        self.frontend = self.make_frontend(knobs)
        self.frontend.use_graphs = self._internal_graphs
        self.frontend.load_weights(weights)
        self.frontend.compile()

    def forward(self, hidden, topk_idx, topk_weights, out):
        self._last_t = hidden.shape[0]
        return self.frontend.forward(hidden, topk_idx, topk_weights, out)

    def oracle_weights(self) -> QuantizedWeights:
        # Read back from the tensors the kernel is handed, not kept aside.
        return self.frontend.weights.canonical()

    def replace_experts(self, local_slots, weights: QuantizedWeights) -> None:
        # Into the tensors the compiled kernel and every captured graph already point at, through the arch's own
        # packer (shim/<arch>/weights.py: <Arch>KernelWeights.replace_experts): same addresses, a fresh load's bytes.
        kernel_weights = self.frontend.weights
        write = getattr(kernel_weights, "replace_experts", None)
        if write is None:
            from moe_ep.core.errors import BackendUnavailableError

            raise BackendUnavailableError("backend", f"{self.name!r} ({type(kernel_weights).__name__}) cannot "
                                                     "replace experts in place yet")
        write(local_slots, weights)

    def staged_activation(self) -> QuantizedActivation:
        return self.frontend.staged_activation(self._last_t)

    def close(self) -> None:
        if self.frontend is not None:
            self.frontend.close()


def compile_only_frontend(backend, spec, *, fmt: Optional[str] = None, knobs=None, rank: int = 0,
                          world_size: int = 1):
    """The frontend a layer of `backend` (a registered name or class) would build for `spec`, built for a
    compile without a GPU (CUTE_DSL_ARCH names the target; tensors are fakes with symbolic extents): what CI
    compiles every kernel through, and the tuner's and the drop audit's build checks. The spec is checked
    against the backend's rules first (SpecError), as the layer would; knobs resolve as explicit > heuristic
    (the user's knob cache is not read, so a compile check does not depend on the machine it runs on)."""
    from moe_ep.core.dist import RankContext
    from moe_ep.core.errors import SpecError
    from moe_ep.core.registry import resolve_backend

    cls = resolve_backend(backend) if isinstance(backend, str) else backend
    fmt = fmt or cls.weight_formats[0]
    problems = cls.check_spec(spec, fmt, world_size)
    if problems:
        argument, message = problems[0]
        raise SpecError(argument, f"{message} (backend {cls.name!r})")
    knob_set, _ = cls.knobs_module.resolve_knobs(knobs, fmt=fmt, max_tokens_per_rank=spec.max_tokens_per_rank,
                                                 cache_key="", cache=KnobCache(""))
    return cls.frontend_class()(spec, RankContext.detached(rank, world_size), knob_set, compile_only=True)
