"""What every MegaMoE frontend does, whatever the tree and the data format.

A frontend owns one workspace: the kernel object (built from resolved knobs),
its local and shared workspaces, the peer-read input buffers on the NVSHMEM heap,
one compiled kernel (shared process-wide by compile key) and the forward launch.
Subclasses say which kernel class and constructor arguments, which input buffers
and how to fill them from bf16 activations, and how weights are laid out.

Launch policy below capacity (measured on an H200 with the Hopper FP8 kernel,
drop 0.7.2.post1; see docs/shim.md): inputs are passed capacity-sized, spare
rows carrying expert id -1, which dispatch skips; the top-k reduce covers only
the T real rows. A rank with T = 0 thus still joins the kernel's cross-rank
barriers.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from shim.common import compile_cache
from shim.common.cute_args import ArgBuilder

__all__ = ["MegaMoEFrontend", "H200_SM_COUNT"]

H200_SM_COUNT = 132


class MegaMoEFrontend:
    arch = ""  # "sm90" / "sm100"
    fmt = ""  # moe_ep format name

    def __init__(self, *, hidden: int, intermediate: int, experts_per_rank: int, top_k: int, capacity: int,
                 rank: int = 0, world_size: int = 1, group=None, device=None, knobs=None,
                 gate_up_clamp: Optional[float] = None, knob_cache_key: str = "", compile_only: bool = False,
                 max_active_clusters: Optional[int] = None):
        self.hidden, self.intermediate, self.experts_per_rank = hidden, intermediate, experts_per_rank
        self.top_k, self.capacity, self.rank, self.world_size = top_k, capacity, rank, world_size
        self.gate_up_clamp, self.compile_only, self.group = gate_up_clamp, compile_only, group
        self.device = torch.device("cpu") if compile_only else torch.device(device or "cuda")
        if not compile_only:
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
            # cutlass's HardwareInfo queries the driver directly: make sure the primary context exists.
            torch.empty(1, device=self.device)
        self.knobs, self.knob_source = self.resolve_knobs(knobs, knob_cache_key)
        if max_active_clusters is None:
            cluster = self.knobs.cluster_shape_mnk[0] * self.knobs.cluster_shape_mnk[1]
            if compile_only:
                max_active_clusters = H200_SM_COUNT // cluster
            else:
                import cutlass.utils as cutlass_utils

                max_active_clusters = cutlass_utils.HardwareInfo().get_max_active_clusters(cluster)
        # Known before the kernel is built: a knob set without group_hint gets one wave of clusters per
        # scheduler group, as the drop's runners do.
        self.max_active_clusters = int(max_active_clusters)
        self.kernel = self.build_kernel(self.knobs)
        self._heap = None
        self._weights = None
        self._args_cache: Dict[Tuple[int, int, int], dict] = {}
        self._graphs: Dict[int, Any] = {}
        self._graph_pool = None
        self.compiled = None
        self.compiled_from_cache = False
        self._alloc()

    # -- subclass hooks ------------------------------------------------------------------------------------
    def resolve_knobs(self, knobs, cache_key: str):
        raise NotImplementedError

    def build_kernel(self, knobs):
        raise NotImplementedError

    def input_buffers(self) -> List[Tuple[str, Tuple[int, ...], torch.dtype]]:
        """Peer-read inputs on the symmetric heap, capacity-sized: (attribute name, shape, dtype)."""
        raise NotImplementedError

    def stage_activations(self, x: torch.Tensor) -> None:
        raise NotImplementedError

    def prepare_weights(self, w13: torch.Tensor, w2: torch.Tensor):
        raise NotImplementedError

    def weight_args(self, b: ArgBuilder, w) -> Dict[str, Any]:
        raise NotImplementedError

    def activation_args(self, b: ArgBuilder, rows: int) -> Dict[str, Any]:
        raise NotImplementedError

    def symbols(self):
        """The tree's kernel_symbols module (for SymBufferHost)."""
        raise NotImplementedError

    # -- buffers -------------------------------------------------------------------------------------------
    def _alloc(self) -> None:
        c, h, k, dev = self.capacity, self.hidden, self.top_k, self.device
        local_bytes, shared_bytes = self.kernel.get_workspace_sizes()
        if self.compile_only:
            alloc = lambda shape, dt: torch.zeros(shape, dtype=dt)  # noqa: E731
            self.shared_ws = alloc((shared_bytes,), torch.uint8)
            self.peer_base, self.peer_offsets = 1 << 20, tuple(0 for _ in range(self.world_size))
        else:
            from shim.common.symmetric import SymmetricHeap

            self._heap = SymmetricHeap(group=self.group, rank=self.rank, world_size=self.world_size, device=dev)
            alloc = self._heap.zeros
            # First on the heap: its base anchors the peer-offset table for every later allocation.
            self.shared_ws = alloc((shared_bytes,), torch.uint8)
            self.peer_base, self.peer_offsets = self._heap.peer_offsets(self.shared_ws)
        for name, shape, dtype in self.input_buffers():
            if dtype.itemsize == 1 and dtype != torch.uint8:
                setattr(self, name, alloc(shape, torch.uint8).view(dtype))
            else:
                setattr(self, name, alloc(shape, dtype))
        self.topk_w = alloc((c, k), torch.float32)
        self.sym_out = alloc((c, h), torch.bfloat16) if self.knobs.fc2_in_kernel_topk_reduce else None
        local = (lambda shape, dt: torch.zeros(shape, dtype=dt, device=dev))
        self.local_ws = local((local_bytes,), torch.uint8)
        self.topk_idx = local((c, k), torch.int64)
        self.out_buf = local((c, h), torch.bfloat16) if self.sym_out is None else self.sym_out
        self.x_in = local((c, h), torch.bfloat16)  # the graphs' static input

    def load_weights(self, w13: torch.Tensor, w2: torch.Tensor):
        e, i, h = self.experts_per_rank, self.intermediate, self.hidden
        if tuple(w13.shape) != (e, 2 * i, h) or tuple(w2.shape) != (e, h, i):
            raise ValueError(f"expected w13 {(e, 2 * i, h)} and w2 {(e, h, i)}, got {tuple(w13.shape)} and "
                             f"{tuple(w2.shape)}")
        self._weights = self.prepare_weights(w13, w2)
        self._args_cache.clear()
        self._graphs.clear()
        return self._weights

    @property
    def weights(self):
        return self._weights

    # -- compile -------------------------------------------------------------------------------------------
    def _runtime_args(self, b: ArgBuilder, rows: int, out: torch.Tensor) -> dict:
        """Kernel arguments for a launch over the first `rows` staged rows, writing `out`."""
        if self._weights is None:
            e, i, h = self.experts_per_rank, self.intermediate, self.hidden
            self._weights = self.prepare_weights(torch.zeros((e, 2 * i, h), dtype=torch.bfloat16),
                                                 torch.zeros((e, h, i), dtype=torch.bfloat16))
        mapper = self.symbols().SymBufferHost(base_addr=self.peer_base, offsets=tuple(self.peer_offsets),
                                              rank_idx=self.rank, num_max_ranks=self.world_size)
        args = self.activation_args(b, rows)
        args.update(topk_idx=b.tensor(self.topk_idx[:rows]), topk_weights=b.tensor(self.topk_w[:rows]))
        args.update(self.weight_args(b, self._weights))
        args.update(fc1_c=None, output_activation=b.tensor(out), local_workspace=b.byte_ptr(self.local_ws),
                    shared_workspace=b.byte_ptr(self.shared_ws), peer_rank_ptr_mapper_host=mapper, stream=b.stream())
        return args

    def compile_key(self) -> tuple:
        return (self.arch, self.fmt, type(self.kernel).__name__, self.knobs, self.hidden, self.intermediate,
                self.experts_per_rank, self.top_k, self.capacity, self.world_size, self.rank, self.gate_up_clamp,
                self.max_active_clusters, self.compile_only)

    def compile(self):
        import cutlass.cute as cute

        b = ArgBuilder(real=not self.compile_only)

        def build():
            kwargs = self._runtime_args(b, self.capacity, self.out_buf)
            kwargs["max_active_clusters"] = self.max_active_clusters
            return cute.compile(self.kernel, **kwargs)

        self.compiled, self.compiled_from_cache = compile_cache.get_or_compile(self.compile_key(), build)
        if not self.compile_only and self._weights is not None:
            # One launch with every row masked (all ranks build their layers together, so it is collective):
            # loads the module and settles lazy initialisation before any graph capture needs it.
            self._launch(0, self.x_in[:0], None)
            torch.cuda.synchronize(self.device)
        return self.compiled

    # -- run -----------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Inputs are assumed validated by moe_ep (shapes, dtypes, ids in range, T <= capacity).

        Outside a stream capture, each token count gets one CUDA graph (staging + kernel) on first use and
        every later call replays it: the CuTe executor costs ~200 us of host time per eager launch, a replay
        ~10 us. Inside a caller's capture (the caller graphs the whole model) the launch is eager.
        """
        if self._weights is None:
            raise RuntimeError("load_weights() must run before forward()")
        if self.compiled is None:
            self.compile()
        t = x.shape[0]
        if out is None:
            out = torch.empty((t, self.hidden), dtype=torch.bfloat16, device=self.device)
        if self.use_graphs and not self.compile_only and not torch.cuda.is_current_stream_capturing():
            if t:
                self.x_in[:t].copy_(x)
                self.topk_idx[:t].copy_(topk_idx)
                self.topk_w[:t].copy_(topk_weights)
            graph = self._graphs.get(t)
            if graph is None:
                graph = self._capture(t)
            graph.replay()
            if t:
                out.copy_(self.out_buf[:t])
            return out
        if t:
            self.topk_idx[:t].copy_(topk_idx)
            self.topk_w[:t].copy_(topk_weights)
        self._launch(t, x[:t], out)
        return out

    def _launch(self, t: int, x: torch.Tensor, out: Optional[torch.Tensor]) -> None:
        """Stage x (topk ids / weights already in place), mask spare rows, launch; write out[:t]."""
        rows = self.capacity
        if rows > t:
            self.topk_idx[t:rows].fill_(-1)
        if t:
            self.stage_activations(x)
        out_rows = max(t, 1)
        direct = (out is not None and out_rows == t and self.sym_out is None and out.is_contiguous()
                  and out.data_ptr() % 16 == 0)
        target = out if direct else self.out_buf[:out_rows]
        if self.sym_out is not None:
            self.sym_out[:out_rows].zero_()
        key = (rows, out_rows, target.data_ptr())
        args = self._args_cache.get(key)
        if args is None:
            if len(self._args_cache) > 64:
                self._args_cache.clear()
            args = self._args_cache[key] = self._runtime_args(ArgBuilder(real=True), rows, target)
        else:
            args["stream"] = ArgBuilder(real=True).stream()
        self.compiled(**args)
        if out is not None and not direct and t > 0:
            out.copy_(self.out_buf[:t])

    use_graphs = True
    max_graphs = 64

    def _capture(self, t: int):
        if len(self._graphs) >= self.max_graphs:
            self._graphs.clear()
        # No warm-up launch here: every launch is collective across ranks, and ranks meet a new token count
        # at different calls. The module was loaded by the masked launch in compile(); the capture records
        # without running, and the caller's replay is this call's one launch.
        graph = torch.cuda.CUDAGraph()
        # One memory pool for all of this workspace's graphs: they replay one at a time on one stream.
        with torch.cuda.graph(graph, pool=self._graph_pool):
            self._launch(t, self.x_in[:t], None)
        if self._graph_pool is None:
            self._graph_pool = graph.pool()
        self._graphs[t] = graph
        return graph

    def close(self) -> None:
        self._graphs.clear()
        self._args_cache.clear()
        self.compiled = None
        if self._heap is not None:
            self._heap.close()
            self._heap = None
