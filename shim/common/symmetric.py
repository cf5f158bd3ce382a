"""NVSHMEM symmetric heap for the MegaMoE kernels: one init per process, torch.distributed rendezvous.

The kernels reach peer ranks by adding a per-peer byte delta to a local
symmetric address; NVSHMEM keeps every rank's heap laid out alike, so one delta
per peer, measured on any allocation, serves all of them. Every allocation here
must therefore happen collectively, in the same order, with the same sizes.

At the end of a normal run, whatever is still allocated (layers the program never closed) is freed explicitly,
newest first, before NVSHMEM is finalised: every rank holds the same allocations in the same order, so the frees
match up across ranks, and NVSHMEM has nothing left to report as leaked. After an uncaught exception the frees
are skipped (moe_ep.core.lifecycle): a peer may never reach them.
"""

from __future__ import annotations

import atexit
import threading
from typing import List, Tuple

import torch

from moe_ep.core import lifecycle

__all__ = ["SymmetricHeap"]

_lock = threading.Lock()
_initialised = False
_heaps: List["SymmetricHeap"] = []  # every heap of this process, in creation order (the same on every rank)


def _init_nvshmem(group, rank: int, world_size: int, device: torch.device) -> None:
    import numpy as np
    import nvshmem.core
    import torch.distributed as dist

    try:
        from cuda.core import Device
    except ImportError:  # older cuda-python
        from cuda.core.experimental import Device

    dev = Device(device.index if device.index is not None else torch.cuda.current_device())
    dev.set_current()
    uid = nvshmem.core.get_unique_id(empty=(rank != 0))
    if world_size > 1:
        raw = torch.from_numpy(uid._data.view(np.uint8).copy())
        backend = dist.get_backend(group)
        carrier = raw.to(device) if "nccl" in str(backend) and "gloo" not in str(backend) else raw
        dist.broadcast(carrier, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        uid._data[:] = carrier.cpu().numpy().view(uid._data.dtype)
    nvshmem.core.init(device=dev, uid=uid, rank=rank, nranks=world_size, initializer_method="uid")
    # NVSHMEM is initialised once per process and finalised at exit: re-initialising after a finalize is
    # not something to rely on, and layers come and go (autotune builds one per candidate). Registered after the
    # process group it was bootstrapped over, so it runs before that group is torn down (atexit is LIFO).
    atexit.register(_finalize)
    lifecycle.track_exceptions()


def _finalize() -> None:
    import nvshmem.core

    try:
        torch.cuda.synchronize()
        if not lifecycle.ending_on_exception():
            for heap in reversed(_heaps):
                heap.close()
        nvshmem.core.finalize()
    except Exception:  # noqa: BLE001 - exiting anyway; do not mask the real error
        pass


class SymmetricHeap:
    """Collective allocator on the NVSHMEM heap; `close()` frees what it gave out (NVSHMEM stays up)."""

    def __init__(self, *, group, rank: int, world_size: int, device: torch.device):
        global _initialised
        self.rank, self.world_size, self.device = rank, world_size, device
        self._tensors: List[torch.Tensor] = []
        with _lock:
            if not _initialised:
                _init_nvshmem(group, rank, world_size, device)
                _initialised = True
            _heaps.append(self)
        self._open = True

    def zeros(self, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Zeroed symmetric tensor; 1-byte float types are carried as uint8 (nvshmem4py lacks them)."""
        import nvshmem.core

        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        # Round every allocation to 256 B so views of it stay TMA- and vector-aligned.
        buf = nvshmem.core.tensor(((nbytes + 255) // 256 * 256,), dtype=torch.uint8)
        buf.zero_()
        self._tensors.append(buf)
        return buf[:nbytes].view(dtype).view(shape)

    def peer_offsets(self, t: torch.Tensor) -> Tuple[int, Tuple[int, ...]]:
        """(local base address, per-peer byte deltas) for a tensor this heap allocated."""
        import nvshmem.core

        root = next((b for b in self._tensors if b.data_ptr() == t.data_ptr()), None)
        if root is None:
            raise ValueError("peer_offsets needs the base of an allocation made by this heap")
        base = int(root.data_ptr())
        offs = tuple(int(nvshmem.core.get_peer_tensor(root, r).data_ptr()) - base for r in range(self.world_size))
        return base, offs

    def free(self, t: torch.Tensor) -> None:
        """Collective: frees one allocation of this heap (every rank, same order). A no-op once the heap is
        closed (at exit, everything was freed already)."""
        import nvshmem.core

        if not self._open:
            return
        root = next((b for b in self._tensors if b.data_ptr() == t.data_ptr()), None)
        if root is None:
            raise ValueError("free needs the base of an allocation made by this heap")
        torch.cuda.synchronize(self.device)
        nvshmem.core.free_tensor(root)
        self._tensors = [b for b in self._tensors if b is not root]

    def close(self) -> None:
        """Collective: frees this heap's allocations, newest first (every rank, same order)."""
        if not self._open:
            return
        import nvshmem.core

        torch.cuda.synchronize(self.device)
        for buf in reversed(self._tensors):
            nvshmem.core.free_tensor(buf)
        self._tensors.clear()
        self._open = False
