"""The NVSHMEM heap's end (shim/common/symmetric.py): at a normal exit, every allocation still held (layers a
program never closed) is freed explicitly, newest first, and only then is NVSHMEM finalised, so NVSHMEM has no
leak to report; after an uncaught exception nothing is freed (a peer may never reach the collective frees) and
NVSHMEM is finalised as before. NVSHMEM needs a GPU: the child processes here stand in a recording nvshmem.core
and cuda.core for it; what is checked is the order of the calls the heap makes."""

import os
import subprocess
import sys

import pytest

_CHILD = r"""
import os, sys, types
import torch

log = lambda *a: print(*a, flush=True)
core = types.ModuleType("nvshmem.core")
names = {}
def tensor(shape, dtype):
    t = torch.zeros(shape, dtype=dtype)
    names[t.data_ptr()] = f"buf{len(names)}"
    return t
core.tensor = tensor
core.free_tensor = lambda t: log("free", names[t.data_ptr()])
core.get_unique_id = lambda empty: object()
core.init = lambda **kw: log("init")
core.finalize = lambda: log("finalize")
core.get_peer_tensor = lambda t, r: t
nv = types.ModuleType("nvshmem")
nv.core = core
cuda_core = types.ModuleType("cuda.core")
class Device:
    def __init__(self, index):
        pass
    def set_current(self):
        pass
cuda_core.Device = Device
sys.modules.update({"nvshmem": nv, "nvshmem.core": core, "cuda.core": cuda_core})
torch.cuda.synchronize = lambda *a: None

from shim.common.symmetric import SymmetricHeap
a = SymmetricHeap(group=None, rank=0, world_size=1, device=torch.device("cuda", 0))
b = SymmetricHeap(group=None, rank=0, world_size=1, device=torch.device("cuda", 0))
x = a.zeros((16,), torch.bfloat16)     # buf0
y = a.zeros((8,), torch.float32)       # buf1
z = b.zeros((4,), torch.uint8)         # buf2
a.free(y)                              # a layer closed: buf1 goes now
log("end of the program")
if os.environ.get("CRASH") == "1":
    raise RuntimeError("the run fails")
"""


def _run(**env):
    return subprocess.run([sys.executable, "-c", _CHILD], env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path),
                                                                   **env),
                          capture_output=True, text=True, timeout=120)


def test_a_normal_end_frees_what_is_left_newest_first_then_finalises():
    proc = _run()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["init", "free buf1", "end of the program", "free buf2", "free buf0",
                                        "finalize"]


def test_an_end_on_an_uncaught_exception_frees_nothing_and_finalises():
    proc = _run(CRASH="1")
    assert proc.returncode == 1 and "the run fails" in proc.stderr
    assert proc.stdout.splitlines() == ["init", "free buf1", "end of the program", "finalize"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
