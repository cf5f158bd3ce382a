"""What every MegaMoE frontend does, whatever the tree and the data format: the phases of one kernel for one layer.

A frontend is built from the layer's MoESpec, its rank context and a knob set resolved beforehand
(shim/common/backend.py). Its composers (final: arch and format code cannot replace them, shim/common/phases.py)
run the phases in order, calling hooks the arch (shim/<arch>/frontend.py) and the format
(shim/<arch>/<format>_frontend.py) fill in, with the same signatures on every tree:

  build    kernel_class(knobs), kernel_kwargs(knobs) (arch), format_kwargs(knobs), check_kernel(kernel)
  buffers  input_buffers() (the peer-read inputs), kernel_buffers() (rank-local extras): the layer's share of the
           process's workspace (shim/common/workspace.py: staging buffers, kernel workspaces and graph memory are
           shared by every layer)
  weights  `weights_layout`, the format's KernelWeights class (shim/common/weights.py): load, read-back, swap
  compile  one cute.compile per compile key (process-wide cache), then check_on_device() once on a device
  stage    prepare_routing(t), stage_activations(x)
  launch   activation_args(b, rows), weight_args(b, w), output_args(b, out), workspace_args(b)
  oracle   staged_activation(t)

The layer has validated every input and the spec (its row of shim/<arch>/formats.py) before a frontend sees them,
so frontends do not check them again.

Launch policy below capacity (docs/shim.md says how it was chosen): inputs are passed capacity-sized, spare rows
carrying expert id -1, which dispatch skips; the top-k reduce covers only the T real rows. A rank with T = 0 thus
still joins the kernel's cross-rank barriers.
"""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Tuple, Type

import torch

from moe_ep.core.dist import RankContext
from moe_ep.core.spec import LayerGeometry, MoESpec
from moe_ep.formats import QuantizedActivation
from shim.common import call_guard, compile_cache
from shim.common.cute_args import ArgBuilder
from shim.common.formats import FormatTable, KernelFormat
from shim.common.graph_cache import GraphCache, buffers_key
from shim.common.knobs import InvalidKnobsError
from shim.common.phases import Composed, final
from shim.common.weights import KernelWeights
from shim.common.workspace import BufferSpec

_capturing = torch._C._cuda_isCurrentStreamCapturing if hasattr(torch._C, "_cuda_isCurrentStreamCapturing") \
    else torch.cuda.is_current_stream_capturing

__all__ = ["MegaMoEFrontend"]


class MegaMoEFrontend(Composed, LayerGeometry):
    arch = ""  # "sm90" / "sm100"
    table: FormatTable  # the arch's format table (shim/<arch>/formats.py)
    fmt = ""  # the moe_ep format this class serves (its row of the table: `row`)
    weights_layout: Type[KernelWeights]  # the format's kernel weight layout
    # SMs of the part a compile-only build (no GPU to ask) assumes when sizing the persistent grid.
    compile_only_sm_count = 0

    @final
    def __init__(self, spec: MoESpec, ctx: RankContext, knobs, *, row: Optional[KernelFormat] = None,
                 compile_only: bool = False, max_active_clusters: Optional[int] = None):
        """row: the table row served (default: the row of this class's `fmt`; a test passes one with other size
        rules)."""
        if row is not None:
            self._row = row
        self.spec, self.ctx, self.knobs, self.compile_only = spec, ctx, knobs, compile_only
        self.device = torch.device("cpu") if compile_only else ctx.device
        if not compile_only:
            torch.cuda.set_device(self.device)
            # cutlass's HardwareInfo queries the driver directly: make sure the primary context exists.
            torch.empty(1, device=self.device)
        if max_active_clusters is None:
            cluster = self.knobs.cluster_shape_mnk[0] * self.knobs.cluster_shape_mnk[1]
            if compile_only:
                max_active_clusters = self.compile_only_sm_count // cluster
            else:
                import cutlass.utils as cutlass_utils

                max_active_clusters = cutlass_utils.HardwareInfo().get_max_active_clusters(cluster)
        # Known before the kernel is built: a knob set without group_hint gets one wave of clusters per
        # scheduler group, as the drop's runners do.
        self.max_active_clusters = int(max_active_clusters)
        self.kernel = self.build_kernel(self.knobs)
        self._lease = None
        self._weights = None
        self._args_cache: Dict[Tuple[int, int, int], dict] = {}
        self.compiled = None
        self.compiled_from_cache = False
        self._views: Tuple[str, ...] = ()
        self._alloc()

    @final
    @classmethod
    def unbuilt(cls, spec: MoESpec, ctx: RankContext, knobs, *, row: Optional[KernelFormat] = None,
                max_active_clusters: int):
        """A frontend holding only what build_kernel reads (no device, no kernel, no buffers): the tuner's build
        check asks the kernel's constructor with it."""
        fe = object.__new__(cls)
        if row is not None:
            fe._row = row
        fe.spec, fe.ctx, fe.knobs, fe.compile_only = spec, ctx, knobs, True
        fe.max_active_clusters = int(max_active_clusters)
        return fe

    @property
    def row(self) -> KernelFormat:
        """This frontend's row of the arch's format table."""
        row = self.__dict__.get("_row")
        return row if row is not None else self.table.row(self.fmt)

    def static_expert_shape(self) -> Tuple[int, int, int]:
        """(E_local, FC1's N = 2I, H): the drop's `intermediate` is FC1's N, the down projection's K is I."""
        return self.experts_per_rank, 2 * self.intermediate_size, self.hidden_size

    # -- hooks: build ------------------------------------------------------------------------------------------
    def symbols(self):
        """The tree's kernel_symbols module (arch)."""
        raise NotImplementedError

    def kernel_class(self, knobs):
        """The drop's kernel class for this knob set (format)."""
        raise NotImplementedError

    def kernel_kwargs(self, knobs) -> Dict[str, Any]:
        """Constructor arguments every kernel of the tree takes the same way (arch)."""
        raise NotImplementedError

    def format_kwargs(self, knobs) -> Dict[str, Any]:
        """The format's own constructor arguments."""
        return {}

    def check_kernel(self, kernel) -> None:
        """Cross-check what the drop's kernel derived (its layout constants, its buffer sizes) against what this
        frontend lays out and hands it; RuntimeError on a mismatch."""

    # -- hooks: buffers ----------------------------------------------------------------------------------------
    def input_buffers(self) -> List[Tuple[str, Tuple[int, ...], torch.dtype]]:
        """Peer-read inputs on the symmetric heap, capacity-sized: (attribute name, shape, dtype)."""
        raise NotImplementedError

    def kernel_buffers(self) -> List[BufferSpec]:
        """Rank-local buffers the kernel's launch needs beyond its workspaces, shared by its layout."""
        return []

    # -- hooks: compile, stage -----------------------------------------------------------------------------------
    def check_on_device(self) -> None:
        """Runs once compiled on a device, outside any capture: a format checks a device-dependent path here."""

    def prepare_routing(self, t: int) -> None:
        """Runs inside every launch (and so inside its graph) once the first t routing rows are in place; a
        kernel that does not skip -1 slots everywhere rewrites them here."""

    def stage_activations(self, x: torch.Tensor) -> None:
        """bf16 x [t, H] -> the peer-read input buffers' first t rows."""
        raise NotImplementedError

    # -- hooks: launch arguments -----------------------------------------------------------------------------------
    def activation_args(self, b: ArgBuilder, rows: int) -> Dict[str, Any]:
        raise NotImplementedError

    def weight_args(self, b: ArgBuilder, w) -> Dict[str, Any]:
        raise NotImplementedError

    def output_args(self, b: ArgBuilder, out: torch.Tensor) -> Dict[str, Any]:
        return dict(output_activation=b.tensor(out))

    def workspace_args(self, b: ArgBuilder) -> Dict[str, Any]:
        return dict(local_workspace=b.byte_ptr(self.local_ws), shared_workspace=b.byte_ptr(self.shared_ws))

    # -- hooks: oracle -------------------------------------------------------------------------------------------
    def staged_activation(self, t: int) -> QuantizedActivation:
        """The FC1 input the kernel read in the last forward over t tokens (for the oracle)."""
        raise NotImplementedError

    # -- build -----------------------------------------------------------------------------------------------
    @final
    def build_kernel(self, knobs):
        """The drop's kernel object for this knob set; a combination its constructor refuses is an
        InvalidKnobsError before anything is allocated (the tuner's build check calls this alone)."""
        cls = self.kernel_class(knobs)
        try:
            kernel = cls(**self.kernel_kwargs(knobs), **self.format_kwargs(knobs))
        except (ValueError, NotImplementedError, AssertionError, TypeError) as e:
            raise InvalidKnobsError("knobs", f"the {self.arch} {self.fmt} kernel rejects {knobs}: {e}") from e
        self.check_kernel(kernel)
        return kernel

    # -- buffers: the layer's share of the process's workspace (shim/common/workspace.py) ---------------------
    @final
    def staging_buffers(self) -> List[BufferSpec]:
        """What a call stages and reads back, capacity-sized; overwritten every call, so shared by all layers."""
        c, h, k = self.max_tokens_per_rank, self.hidden_size, self.top_k
        specs = [BufferSpec(name, shape, dtype, True) for name, shape, dtype in self.input_buffers()]
        specs.append(BufferSpec("topk_w", (c, k), torch.float32, True))
        if self.knobs.fc2_in_kernel_topk_reduce:  # the ranks add their terms into it
            specs.append(BufferSpec("sym_out", (c, h), torch.bfloat16, True))
        else:
            specs.append(BufferSpec("out_buf", (c, h), torch.bfloat16, False))
        specs += [BufferSpec("topk_idx", (c, k), torch.int64, False),
                  BufferSpec("x_in", (c, h), torch.bfloat16, False)]  # the internal graphs' static input
        return specs

    def _alloc(self) -> None:
        from shim.common.workspace import pool_for

        self._pool = pool = pool_for(self.ctx, self.arch, self.compile_only)
        # The getter closes over the pool, not over this frontend: a frontend in a reference cycle outlives its
        # close() until the garbage collector runs, holding its weights (GiBs) and workspace views.
        self.graphs = GraphCache(lambda: pool.graph_pool)
        self._lease = self._pool.acquire(id(self), self.staging_buffers(), self.compile_key(),
                                         self.kernel.get_workspace_sizes(), self.kernel_buffers())
        if self.compile_only:
            # A compile check's frontend is seldom closed (the drop tool's child builds one per job, a test one per
            # case): its share goes when it does. Only here: a compile-only release touches no device and no peer,
            # where a real one is collective and must stay an explicit close().
            weakref.finalize(self, self._lease.release).atexit = False
        self._bind()

    def _bind(self) -> None:
        """(Re)bind this layer's views of the pool; after the pool grew, drop what holds the old addresses."""
        views = self._lease.views()
        for name, t in views.items():
            setattr(self, name, t)
        self._views = tuple(views)
        if self.knobs.fc2_in_kernel_topk_reduce:
            self.out_buf = self.sym_out
        else:
            self.sym_out = None
        self.peer_base, self.peer_offsets = self._pool.peer_base, self._pool.peer_offsets
        self._args_cache.clear()
        self.graphs.clear()

    @final
    def symmetric_bytes(self) -> int:
        """Bytes this workspace holds on the NVSHMEM heap (every rank the same)."""
        names = ["shared_ws", "topk_w"] + [n for n, _, _ in self.input_buffers()]
        total = sum(getattr(self, n).numel() * getattr(self, n).element_size() for n in names)
        if self.sym_out is not None:
            total += self.sym_out.numel() * self.sym_out.element_size()
        return total

    # -- weights -----------------------------------------------------------------------------------------------
    @final
    def load_weights(self, weights):
        """Lay out the layer's weights (a moe_ep.ExpertWeights or QuantizedExpertWeights, validated by the layer) for
        the kernel; returns the kernel weights."""
        self._weights = self.weights_layout.prepare(weights, self.device)
        self._args_cache.clear()
        self.graphs.clear(forget_seen=False)
        return self._weights

    @final
    def adopt_weights(self, kernel_weights) -> None:
        """Take kernel weights another frontend of the same format and geometry laid out (the tuner's candidates
        share one layout: it does not depend on the knobs)."""
        self._weights = kernel_weights
        self._args_cache.clear()
        self.graphs.clear()

    @property
    def weights(self):
        return self._weights

    # -- compile -------------------------------------------------------------------------------------------
    def _mapper(self):
        return self.symbols().SymBufferHost(base_addr=self.peer_base, offsets=tuple(self.peer_offsets),
                                            rank_idx=self.rank, num_max_ranks=self.world_size)

    def _runtime_args(self, b: ArgBuilder, rows: int, out: torch.Tensor) -> dict:
        """Kernel arguments for a launch over the first `rows` staged rows, writing `out`."""
        if self._weights is None:  # a compile without real weights: zeros of the kernel's shapes and dtypes
            self._weights = self.weights_layout.placeholder(self.experts_per_rank, self.hidden_size,
                                                            self.intermediate_size, device=self.device)
        args = self.activation_args(b, rows)
        args.update(topk_idx=b.tensor(self.topk_idx[:rows]), topk_weights=b.tensor(self.topk_w[:rows]))
        args.update(self.weight_args(b, self._weights))
        args.update(self.output_args(b, out))
        args.update(self.workspace_args(b))
        args.update(peer_rank_ptr_mapper_host=self._mapper(), stream=b.stream())
        return args

    @final
    def compile_key(self) -> tuple:
        return (self.arch, self.fmt, type(self.kernel).__name__, self.knobs, self.spec, self.world_size, self.rank,
                self.max_active_clusters, self.compile_only)

    @final
    def build_compiled(self):
        """The `cute.compile` alone (host work only; process-wide cache by compile key). compile() also loads
        the module on the device; a tuner compiles many candidates in parallel with this, off the GPU."""
        import cutlass.cute as cute

        b = ArgBuilder(real=not self.compile_only)

        def build():
            kwargs = self._runtime_args(b, self.max_tokens_per_rank, self.out_buf)
            kwargs["max_active_clusters"] = self.max_active_clusters
            return cute.compile(self.kernel, **kwargs)

        self.compiled, self.compiled_from_cache = compile_cache.get_or_compile(self.compile_key(), build)
        return self.compiled

    @final
    def compile(self):
        self.build_compiled()
        if self.guard is None:  # collective, as compile is: the pool's first guard allocates its word table
            self.guard = call_guard.attach(self)
        if not self.compile_only and self._weights is not None:
            # One launch with every row masked (all ranks build their layers together, so it is collective):
            # loads the module and settles lazy initialisation before any graph capture needs it.
            self._launch(0, self.x_in[:0], None)
            torch.cuda.synchronize(self.device)
        if not self.compile_only:
            self.check_on_device()
        return self.compiled

    # -- run -----------------------------------------------------------------------------------------------
    use_graphs = True
    guard = None  # the call guard (shim/common/call_guard.py): ranks out of step refused before the exchange

    @final
    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Inputs are validated by moe_ep (shapes, dtypes, ids in range, T <= capacity); out [T, H] bf16, or None:
        a fresh [T, H] bf16 tensor the caller owns is returned.

        Outside a stream capture every call replays an internal CUDA graph (shim/common/graph_cache.py): in place
        over the caller's buffers when they come back, else over the workspace's inputs by token count. Without
        `out` the graph writes the workspace's output buffer and the call returns a copy of it: keyed by the
        caller's inputs alone, since a fresh output's address is the allocator's choice (keying by it would capture
        a graph every other call). Inside a caller's capture (the caller graphs the whole model) the
        launch is eager.
        """
        if self.guard is not None and self.guard.tripped:
            self.guard.raise_error()
        t = x.shape[0]
        graphing = self.use_graphs and not self.compile_only and not _capturing()
        if graphing:
            # The steady state first (an engine's static buffers): one dict lookup and the replay.
            key = buffers_key(t, x, topk_idx, topk_weights, out)
            graph = self.graphs.get(key)
            if graph is not None and not self._lease.stale:
                graph.replay()
                return out if out is not None else self.out_buf[:t].clone()
        if self._weights is None:
            raise RuntimeError("load_weights() must run before forward()")
        if self._lease.stale:
            self._bind()
        if self.compiled is None:
            self.compile()
        if not graphing:
            if out is None:
                out = torch.empty((t, self.hidden_size), dtype=torch.bfloat16, device=self.device)
            self._launch_in_place(t, x, topk_idx, topk_weights, out)
            return out
        if not self.graphs.in_place(key, lambda: self._launch_in_place(t, x, topk_idx, topk_weights, out)):
            # Buffers seen once (or captures rationed): copy them into the workspace, replay by token count.
            if t:
                self.x_in[:t].copy_(x)
                self.topk_idx[:t].copy_(topk_idx)
                self.topk_w[:t].copy_(topk_weights)
            self.graphs.by_token_count(t, lambda: self._launch(t, self.x_in[:t], None))
            if out is not None:
                if t:
                    out.copy_(self.out_buf[:t])
                return out
        return out if out is not None else self.out_buf[:t].clone()

    def _launch_in_place(self, t: int, x, topk_idx, topk_weights, out) -> None:
        if t:
            self.topk_idx[:t].copy_(topk_idx)
            self.topk_w[:t].copy_(topk_weights)  # fp32 whatever the caller's float dtype: the copy converts
            if x.dtype is not torch.bfloat16:
                # fp16 / fp32 hidden: rounded to bf16 in its one copy, into the graphs' input buffer.
                self.x_in[:t].copy_(x)
                x = self.x_in
        self._launch(t, x[:t], out)

    def _launch(self, t: int, x: torch.Tensor, out: Optional[torch.Tensor]) -> None:
        """Stage x (topk ids / weights already in place), mask spare rows, launch; write out[:t]."""
        rows = self.max_tokens_per_rank
        if rows > t:
            self.topk_idx[t:rows].fill_(-1)
        if t:
            if self.guard_ids:
                self._guard_ids(t)
            self.prepare_routing(t)
            self.stage_activations(x)
        out_rows = max(t, 1)
        direct = (out is not None and out_rows == t and self.sym_out is None and out.is_contiguous()
                  and out.data_ptr() % 16 == 0)
        target = out if direct else self.out_buf[:out_rows]
        if self.sym_out is not None:
            self.sym_out[:out_rows].zero_()
        # Arguments over the workspace's output are kept; a caller's `out` is wrapped anew each launch: a kept
        # CuTe tensor holds its torch storage alive (DLPack), so a cache of caller outputs pinned every output a
        # call without `out` allocated, and each next call got a new address.
        key = (rows, out_rows)
        args = self._args_cache.get(key)
        if args is None:
            if len(self._args_cache) > 64:
                self._args_cache.clear()
            args = self._args_cache[key] = self._runtime_args(ArgBuilder(real=True), rows, self.out_buf[:out_rows])
        else:
            args["stream"] = ArgBuilder(real=True).stream()
        if direct:
            args = dict(args, **self.output_args(ArgBuilder(real=True), target))
        if self.guard is not None:
            self.guard.before(self.topk_idx, rows * self.top_k)
        self.compiled(**args)
        if self.guard is not None:
            self.guard.after(target)
        if out is not None and not direct and t > 0:
            out.copy_(self.out_buf[:t])

    # An expert id >= num_experts reaches the kernel's dispatch as a shared-memory counter index past its array and a
    # peer rank that does not exist (src/token_comm.py): memory corruption or an illegal address, then peers that
    # wait forever. The layer checks ids on the first call of each shape; this guard, inside every launch (and so
    # inside its graph: no host time, three small kernels of device time), stops the stream with a device-side
    # assert before the kernel can read one on any later call. Ids below -1 are let through: the dispatch and the
    # top-k reduce skip every negative id as they skip -1 (an int64 id below -2**31 would wrap in the dispatch's
    # int32 read; no router makes one).
    guard_ids = True

    def _guard_ids(self, t: int) -> None:
        idx = self.topk_idx[:t]
        torch._assert_async(idx.lt(self.spec.num_experts).all(),
                            "moe_ep: an expert id >= num_experts reached the MegaMoE kernel (the layer's value checks "
                            "were off for this call: MoELayer(check_values=True) or MOE_EP_CHECKS=all names it)")

    @final
    def close(self) -> None:
        """Collective: this layer's graphs go, and its share of the workspace is released."""
        self.graphs.clear()
        self._args_cache.clear()
        self.compiled = None
        self.guard = None
        if self._lease is not None:
            self._lease.release()
            self._lease = None
        # What this layer held goes now, whoever still refers to the frontend: its weights and its views of the
        # workspace (a released arena stays allocated while a view of it lives).
        self._weights = None
        for name in self._views + ("sym_out", "out_buf"):
            setattr(self, name, None)
        self._views = ()
