"""The Triton kernels behind shim/common/call_guard.py (read its docstring for the protocol).

Imports Triton at the top: only call_guard imports this module, and only when a guard is attached on a CUDA device.
Keep the steps in lockstep with `call_guard.simulate` (the CPU test holds the protocol to it; tools/diag/
call_guard_cost.py holds these kernels to it on the GPU).
"""

import triton
import triton.language as tl

__all__ = ["call_guard_kernel", "poison_kernel"]


# code and n_idx vary by layer and capacity: not specialized, so one compile (in the first, uncaptured launch)
# serves every later launch, and none happens inside a graph capture.
@triton.jit(do_not_specialize=["code", "n_idx"])
def call_guard_kernel(words_ptr, deltas_ptr, state_ptr, calls_ptr, idx_ptr, report_ptr, code, n_idx,
                      RANK: tl.constexpr, W: tl.constexpr, SLOTS: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (1,), one warp. words int64 [SLOTS, W] on the symmetric heap: one word a slot and rank, (epoch mod 2^16,
    layer code mod 2^16, the layer's launch count mod 2^32) in one 64-bit store, so a peer sees a word whole or not at
    all and no write needs an atomic or a round trip; deltas int64 [W]: element offsets from this rank's words to each
    peer's; state int64 [2] (epoch, sticky); calls int64 [1] (this layer's launches); idx int64 (the routing ids the
    kernel reads, n_idx of them); report int64 [2 + W], host-mapped (the host reads it without a sync): refused, the
    first epoch that differed, every rank's word then."""
    epoch = tl.load(state_ptr) + 1                                              # 1. this launch's epoch
    tl.store(state_ptr, epoch)
    n = tl.load(calls_ptr) + 1
    tl.store(calls_ptr, n)
    tag = (epoch & 0xFFFF) << 48
    word = tag | ((code.to(tl.int64) & 0xFFFF) << 32) | (n & 0xFFFFFFFF)      # 2. (layer, its launch)
    slot = epoch % SLOTS
    for p in tl.static_range(W):                                                # 3. to every rank's slot
        d = tl.load(deltas_ptr + p)
        tl.store(words_ptr + d + slot * W + RANK, word, cache_modifier=".wt")
    bad = 0
    for p in tl.static_range(W):                                                # 4. every rank's word arrived
        at = words_ptr + slot * W + p
        seen = tl.load(at, volatile=True)
        while (seen & -281474976710656) != tag:                                 # the top 16 bits: its epoch
            seen = tl.load(at, volatile=True)
        bad = bad | (seen != word).to(tl.int32)                                 # 5. compared
    sticky = tl.load(state_ptr + 1)
    if bad != 0:
        if sticky == 0:                                                         # 6. the first one: kept
            for p in tl.static_range(W):
                tl.store(report_ptr + 2 + p, tl.load(words_ptr + slot * W + p, volatile=True))
            tl.store(report_ptr + 1, epoch)
        sticky = sticky | 1
        tl.store(state_ptr + 1, sticky)
    if sticky != 0:                                                             # 7. a no-token call, said
        # Plain stores to host memory: the host waits for the epoch before it reads the words.
        tl.store(report_ptr, 1)
        offs = tl.arange(0, BLOCK)
        for i in range(0, n_idx, BLOCK):
            tl.store(idx_ptr + i + offs, tl.full((BLOCK,), -1, tl.int64), mask=i + offs < n_idx)


@triton.jit(do_not_specialize=["n"])
def poison_kernel(out_ptr, state_ptr, n, BLOCK: tl.constexpr):
    """Grid (1,). After the kernel: a refused call's output (bf16, n elements) becomes NaN, never a number."""
    if tl.load(state_ptr + 1) != 0:                                             # 8.
        offs = tl.arange(0, BLOCK)
        nan = tl.full((BLOCK,), float("nan"), tl.float32).to(tl.bfloat16)
        for i in range(0, n, BLOCK):
            tl.store(out_ptr + i + offs, nan, mask=i + offs < n)
