"""One workspace per (process group, device, tree), used in turn by every layer of the process.

An engine holds one MoE layer per transformer block and runs them one after another on one stream, so what a
layer needs only while its forward runs can belong to all of them at once:
  * the staging buffers: the peer-read inputs on the NVSHMEM heap (activations, scales, routing weights, the
    in-kernel-reduce output) and the rank-local ones (routing ids, the graphs' static input, the output);
    every call overwrites what it reads, so one arena, sized by the largest layer registered, serves all;
  * the kernel's local and shared workspaces: shared by every layer whose kernel has the same workspace layout
    (kernel class, knobs and geometry: DeepSeek-V3's 58 MoE layers are one). Layers of different layouts get
    one each: the drop's kernel keeps an NVLink barrier phase across launches at a layout-dependent offset and
    resets only its own counter prefix at its tail (src/token_comm.py kernel_tail), so two layouts must not
    alias one workspace;
  * the memory of the internal CUDA graphs: one graph memory pool (torch) for every layer's graphs.
A layer owns its weights and its graphs' handles; nothing else.

Growth is collective: layers are built on every rank in the same order, so every rank registers the same sizes
at the same point. When a layer needs more staging than the arena holds, the arena is freed and allocated again
at the new size, and every layer rebinds its views (and drops its graphs) before its next call. A size that
cannot be allocated is refused, on every rank, with a WorkspaceError before anything is allocated. Closing a
layer releases its share; the last layer of a kernel layout frees that layout's workspaces, the last layer of
the pool frees the arenas. Closing is collective too (NVSHMEM frees are): close layers in the same order on
every rank.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Dict, Hashable, List, Optional, Sequence, Tuple

import torch

from moe_ep.core.dist import RankContext, run_agreed
from moe_ep.errors import WorkspaceError

__all__ = ["BufferSpec", "WorkspacePool", "WorkspaceError", "Lease", "pool_for"]

_ALIGN = 256  # every buffer starts TMA- and vector-aligned
# Headroom left free on the device when a workspace is sized: the caching allocator and NCCL need some.
_DEVICE_HEADROOM = 512 << 20


@dataclass(frozen=True)
class BufferSpec:
    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    symmetric: bool  # on the NVSHMEM heap (peers read or write it) or rank-local

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * torch.empty((), dtype=self.dtype).element_size()


def _round(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _layout(specs: Sequence[BufferSpec]) -> Tuple[Dict[str, int], int, int]:
    """({name: byte offset in its arena}, symmetric bytes, local bytes) of a list of buffers, packed in order."""
    offsets, used = {}, {True: 0, False: 0}
    for s in specs:
        offsets[s.name] = used[s.symmetric]
        used[s.symmetric] += _round(s.nbytes)
    return offsets, used[True], used[False]


def _view(arena: torch.Tensor, offset: int, spec: BufferSpec) -> torch.Tensor:
    return arena[offset:offset + spec.nbytes].view(spec.dtype).view(spec.shape)


@dataclass
class _KernelWorkspace:
    local_ws: torch.Tensor
    shared_ws: torch.Tensor
    extra: Dict[str, torch.Tensor]
    owners: set = field(default_factory=set)


@dataclass
class Lease:
    """One layer's share of the pool. `views()` are valid while `generation` equals the pool's."""

    pool: "WorkspacePool"
    owner: int
    staging: Tuple[BufferSpec, ...]
    layout_key: Hashable
    offsets: Dict[str, int]
    generation: int = -1

    def views(self) -> Dict[str, torch.Tensor]:
        p = self.pool
        out = {s.name: _view(p.sym_arena if s.symmetric else p.local_arena, self.offsets[s.name], s)
               for s in self.staging}
        kw = p._kernel_ws[self.layout_key]
        out.update(local_ws=kw.local_ws, shared_ws=kw.shared_ws, **kw.extra)
        self.generation = p.generation
        return out

    @property
    def stale(self) -> bool:
        return self.generation != self.pool.generation

    def release(self) -> None:
        self.pool.release(self)


class WorkspacePool:
    """See the module docstring. Get one with pool_for(ctx, arch, compile_only)."""

    def __init__(self, ctx: RankContext, arch: str, compile_only: bool):
        self.ctx, self.arch, self.compile_only = ctx, arch, compile_only
        self.device = torch.device("cpu") if compile_only else ctx.device
        self.generation = 0
        self._needs: Dict[int, Tuple[int, int]] = {}  # owner -> (symmetric, local) staging bytes
        self.sym_arena: Optional[torch.Tensor] = None
        self.local_arena: Optional[torch.Tensor] = None
        self._kernel_ws: Dict[Hashable, _KernelWorkspace] = {}
        self._heap = None
        self._graph_pool = None
        # Compile-only builds have no heap: any address and zero deltas make a well-formed mapper.
        self.peer_base, self.peer_offsets = 1 << 20, tuple(0 for _ in range(ctx.world_size))
        self._offsets_measured = False

    # -- allocation -----------------------------------------------------------------------------------------
    def _heap_alloc(self, nbytes: int) -> torch.Tensor:
        if self.compile_only:
            return torch.zeros((nbytes,), dtype=torch.uint8)
        if self.ctx.pg_backend == "none":
            # A rank's own kernel at world size 1 (the split path's local engine, moe_ep/split/engine.py): no peer
            # maps this memory, so plain device memory serves, outside the NVSHMEM job the process's group joined.
            t = self._local_alloc(nbytes)
            if not self._offsets_measured:
                self.peer_base, self.peer_offsets = int(t.data_ptr()), (0,)
                self._offsets_measured = True
            return t
        if self._heap is None:
            from shim.common.symmetric import SymmetricHeap

            self._heap = SymmetricHeap(group=self.ctx.group, rank=self.ctx.rank, world_size=self.ctx.world_size,
                                       device=self.device)
        t = self._heap.zeros((nbytes,), torch.uint8)
        if not self._offsets_measured:
            # Any allocation measures the per-peer deltas: NVSHMEM lays every rank's heap out alike.
            self.peer_base, self.peer_offsets = self._heap.peer_offsets(t)
            self._offsets_measured = True
        return t

    def _heap_free(self, t: Optional[torch.Tensor]) -> None:
        if t is not None and self._heap is not None:
            self._heap.free(t)

    def _local_alloc(self, nbytes: int) -> torch.Tensor:
        return torch.zeros((nbytes,), dtype=torch.uint8, device=self.device)

    def _check_room(self, nbytes: int) -> None:
        """Collective: refuse, on every rank, before anything is allocated, when this device cannot hold it."""
        if self.compile_only or nbytes == 0:
            return

        def check():
            free, total = torch.cuda.mem_get_info(self.device)
            if nbytes + _DEVICE_HEADROOM > free:
                raise WorkspaceError("max_tokens_per_rank", (
                    f"the shared MoE workspace needs {nbytes / 2**30:.2f} GiB more on {self.device} for this layer, "
                    f"{free / 2**30:.2f} GiB of {total / 2**30:.2f} GiB is free (keeping "
                    f"{_DEVICE_HEADROOM >> 20} MiB headroom): lower max_tokens_per_rank, or free device memory"))

        if self.ctx.group is None and self.ctx.pg_backend == "none":
            check()
        else:
            run_agreed(self.ctx, check, "workspace size")

    # -- leases ---------------------------------------------------------------------------------------------
    def acquire(self, owner: int, staging: Sequence[BufferSpec], layout_key: Hashable,
                kernel_bytes: Tuple[int, int], kernel_extra: Sequence[BufferSpec] = ()) -> Lease:
        """Register a layer (collective): grow the staging arenas if it needs more, and share or make the
        kernel workspaces of its layout. Returns its lease."""
        staging = tuple(staging)
        offsets, sym_need, local_need = _layout(staging)
        have_sym = 0 if self.sym_arena is None else self.sym_arena.numel()
        have_local = 0 if self.local_arena is None else self.local_arena.numel()
        grow_sym, grow_local = max(sym_need - have_sym, 0), max(local_need - have_local, 0)
        new_kernel = layout_key not in self._kernel_ws
        extra_bytes = sum(_round(s.nbytes) for s in kernel_extra)
        more = (sym_need if grow_sym else 0) + (local_need if grow_local else 0)
        if new_kernel:
            more += sum(kernel_bytes) + extra_bytes
        self._check_room(more)

        if grow_sym or grow_local:
            self._sync()
            if grow_sym:
                self._heap_free(self.sym_arena)
                self.sym_arena = None
                self.sym_arena = self._heap_alloc(max(sym_need, have_sym))
            if grow_local:
                self.local_arena = self._local_alloc(max(local_need, have_local))
            self.generation += 1
        if new_kernel:
            local_bytes, shared_bytes = kernel_bytes
            extra = {s.name: _view(self._local_alloc(_round(s.nbytes)), 0, s) for s in kernel_extra}
            self._kernel_ws[layout_key] = _KernelWorkspace(self._local_alloc(local_bytes),
                                                           self._heap_alloc(shared_bytes), extra)
        self._kernel_ws[layout_key].owners.add(owner)
        self._needs[owner] = (sym_need, local_need)
        return Lease(self, owner, staging, layout_key, offsets)

    def release(self, lease: Lease) -> None:
        """Collective (NVSHMEM frees are): the layer is gone; free what no other layer uses."""
        if lease.owner not in self._needs:
            return
        del self._needs[lease.owner]
        kw = self._kernel_ws.get(lease.layout_key)
        if kw is not None:
            kw.owners.discard(lease.owner)
            if not kw.owners:
                self._sync()
                self._heap_free(kw.shared_ws)
                del self._kernel_ws[lease.layout_key]
        if not self._needs:
            self._sync()
            self._heap_free(self.sym_arena)
            self.sym_arena = self.local_arena = None
            self._graph_pool = None
            self.generation += 1

    def _sync(self) -> None:
        if not self.compile_only:
            torch.cuda.synchronize(self.device)

    # -- what layers share besides memory -------------------------------------------------------------------
    @property
    def graph_pool(self):
        """The one memory pool of every layer's internal CUDA graphs (they replay one at a time, on one
        stream)."""
        if self._graph_pool is None and not self.compile_only:
            self._graph_pool = torch.cuda.graph_pool_handle()
        return self._graph_pool

    def stats(self) -> Dict[str, int]:
        """What the pool holds, in bytes (every rank the same): for the memory benchmark and tests."""
        kernel_local = sum(k.local_ws.numel() + sum(t.numel() * t.element_size() for t in k.extra.values())
                           for k in self._kernel_ws.values())
        return dict(layers=len(self._needs), kernel_layouts=len(self._kernel_ws),
                    symmetric_staging=0 if self.sym_arena is None else self.sym_arena.numel(),
                    local_staging=0 if self.local_arena is None else self.local_arena.numel(),
                    kernel_shared=sum(k.shared_ws.numel() for k in self._kernel_ws.values()),
                    kernel_local=kernel_local, generation=self.generation)


_pools: Dict[Tuple, WorkspacePool] = {}
_lock = threading.Lock()


def pool_for(ctx: RankContext, arch: str, compile_only: bool = False) -> WorkspacePool:
    """The process's pool for this group, device and tree (one tree per process; the arch keeps it honest)."""
    key = (id(ctx.group) if ctx.group is not None else None, ctx.pg_backend, str(ctx.device), ctx.rank,
           ctx.world_size, arch, compile_only)
    with _lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = WorkspacePool(ctx, arch, compile_only)
        return pool


def live_pools() -> List[WorkspacePool]:
    with _lock:
        return list(_pools.values())
