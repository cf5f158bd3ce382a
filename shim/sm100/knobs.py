"""Knobs of the Blackwell MegaMoE kernels (NVFP4, MXFP8, BF16): what may be tuned, what changes results,
and how a set is chosen.

Correctness knobs change the generated program or its summation order (MMA tile and
cluster shape, token-back mode, in-kernel fc2 reduce, load-balance mode); perf knobs
change only scheduling (group_hint, flag_batch, epi_flag_batch). All are compile-time
constructor parameters: one set per workspace, resolved from the capacity
(explicit > knob cache > heuristic, shim.common.knobs).

The sm100 drop ships no heuristic table (the Hopper one does). The heuristic below is
the per-capacity profile table measured on 4x GB200 (DeepSeek-V3 geometry, drop of
2026-07, cutlass-dsl 4.5.2-4.6.1) and published with the carrier wheel (TUNING.md of
its kernel_src/sm100/cutedsl_megamoe): the values are facts taken from there, the code
is ours. Its dominant axis is the token-back mode: the epilogue warps win at small
capacity, the dispatch warps beyond ~512 tokens per rank.

Always chosen, not knobs: the bf16 combine wire (exact terms, fp32 sum,
deterministic), non-UBLK fc2 stores (every token-back mode needs them), the routing
weight folded into FC1 (apply_topk_in_fc1; the MXFP8 kernel has no other mode since
drop 0.7.4), the kernel's own top-k reduce (skip_topk_reduce=False), the static
scheduler. Left at the drop's defaults: the 0.7.4 additions act_func ("swiglu"),
topk_reduce_persistent (off) and the MXFP8 column requant's grid (col_quant_num_ctas).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from shim.common.knobs import InvalidKnobsError, KnobSet, resolve_knob_set
from shim.sm100.formats import BACKENDS

__all__ = ["KNOB_SPACE", "KERNEL_CLASS", "CORRECTNESS_KNOBS", "PERF_KNOBS", "Sm100Knobs",
           "InvalidKnobsError", "heuristic_knobs", "resolve_knobs"]

# moe_ep format -> the KNOB_SPACE entry (the drop's kernel class) its knob sets draw from. From the format table.
KERNEL_CLASS = {row.fmt: row.knob_space for row in BACKENDS}

# The value sets the tuner draws from, by the kernel constructor parameter they
# feed. Literal on purpose: `tools/drop audit` checks it against the drop by AST.
KNOB_SPACE = {
    "Sm100MegaMoEKernel": {
        "mma_tiler_mnk": [(128, 128, 256), (128, 256, 256), (256, 64, 256), (256, 128, 256), (256, 256, 256)],
        "cluster_shape_mnk": [(1, 1, 1), (2, 1, 1), (4, 1, 1)],
        "token_back_mode": ["epi_warps", "standalone_warps", "reuse_dispatch_warps"],
        "in_kernel_fc2_reduce": [False, True],
        "load_balance_mode": ["static", "atomic_counter"],
        "group_hint": [None, 64, 128, 256, 512],
        "flag_batch": [1, 2, 4, 8, 16],
        "epi_flag_batch": [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4), (4, 2), (4, 4), (8, 2), (8, 4), (2, 8),
                           (4, 8), (16, 16)],
    },
    "Sm100MegaMoEMxfp8Kernel": {
        "mma_tiler_mnk": [(256, 256, 128)],
        "cluster_shape_mnk": [(2, 1, 1), (4, 1, 1)],
        "token_back_mode": ["epi_warps", "standalone_warps", "reuse_dispatch_warps"],
        "fc2_in_kernel_topk_reduce": [False, True],
        "load_balance_mode": ["static", "atomic_counter"],
        "group_hint": [None, 64, 128, 256, 512],
        "flag_batch": [1, 2, 4, 8, 16],
        "epi_flag_batch": [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4), (4, 2), (4, 4), (8, 2), (8, 4), (2, 8),
                           (4, 8), (16, 16)],
    },
    "Sm100MegaMoEBf16Kernel": {
        "mma_tiler_mnk": [(256, 256, 64)],
        "cluster_shape_mnk": [(2, 1, 1)],
        "token_back_mode": ["epi_warps", "standalone_warps", "reuse_dispatch_warps"],
        "fc2_in_kernel_topk_reduce": [False, True],
        "load_balance_mode": ["static", "atomic_counter"],
        "group_hint": [None, 64, 128, 256, 512],
        "flag_batch": [1, 2, 4, 8, 16],
        "epi_flag_batch": [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4), (4, 2), (4, 4), (8, 2), (8, 4), (2, 8),
                           (4, 8), (16, 16)],
    },
}

CORRECTNESS_KNOBS = ("mma_tiler_mnk", "cluster_shape_mnk", "token_back_mode", "fc2_in_kernel_topk_reduce",
                     "load_balance_mode")
PERF_KNOBS = ("group_hint", "flag_batch", "epi_flag_batch")


@dataclass(frozen=True)
class Sm100Knobs(KnobSet):
    """One knob set for any of the three kernels; `validate(fmt)` says whether that kernel takes it.

    fc2_in_kernel_topk_reduce: the cross-rank combine atomically adds bf16 terms into the output, so the
    summation order is nondeterministic; off unless asked for."""

    mma_tiler_mnk: Tuple[int, int, int]
    cluster_shape_mnk: Tuple[int, int, int]
    token_back_mode: str = "epi_warps"
    fc2_in_kernel_topk_reduce: bool = False
    load_balance_mode: str = "static"
    group_hint: Optional[int] = None
    flag_batch: int = 1
    epi_flag_batch: Tuple[int, int] = (1, 1)

    @property
    def use_2cta_instrs(self) -> bool:
        """A 256-row MMA tile is a 2-CTA instruction (every kernel here wants 128 rows per CTA)."""
        return self.mma_tiler_mnk[0] == 256

    @property
    def token_back_by_dispatch(self) -> bool:
        return self.token_back_mode != "epi_warps"

    @property
    def cluster_size(self) -> int:
        return self.cluster_shape_mnk[0] * self.cluster_shape_mnk[1]

    def correctness_part(self) -> Tuple:
        return tuple(getattr(self, k) for k in CORRECTNESS_KNOBS)

    def validate(self, fmt: str) -> "Sm100Knobs":
        if fmt not in KERNEL_CLASS:
            raise InvalidKnobsError("fmt", f"the sm100 kernels serve {sorted(KERNEL_CLASS)}, got {fmt!r}")
        space = KNOB_SPACE[KERNEL_CLASS[fmt]]
        if not isinstance(self.fc2_in_kernel_topk_reduce, bool):
            raise InvalidKnobsError("fc2_in_kernel_topk_reduce",
                                    f"expected a bool, got {self.fc2_in_kernel_topk_reduce!r}")
        # Errors name the knob field; the space is keyed by the kernel's constructor parameter.
        for name in ("mma_tiler_mnk", "cluster_shape_mnk", "token_back_mode", "fc2_in_kernel_topk_reduce",
                     "load_balance_mode", "flag_batch", "epi_flag_batch"):
            value = getattr(self, name)
            allowed = space[BACKENDS.row(fmt).reduce_kwarg if name == "fc2_in_kernel_topk_reduce" else name]
            if value not in allowed:
                raise InvalidKnobsError(name, f"{value!r} is not one of {allowed} for the {fmt} kernel")
        if self.group_hint is not None and (isinstance(self.group_hint, bool) or not isinstance(self.group_hint, int)
                                            or self.group_hint <= 0):
            raise InvalidKnobsError("group_hint", f"expected None or a positive int, got {self.group_hint!r}")
        # A 2-CTA MMA pairs CTAs along the cluster's M (the kernels' own geometry check).
        if self.use_2cta_instrs and self.cluster_shape_mnk[0] % 2:
            raise InvalidKnobsError("cluster_shape_mnk", f"a 256-row MMA tile needs an even cluster M, got "
                                    f"{self.cluster_shape_mnk}")
        needs = BACKENDS.row(fmt).reduce_token_back  # the row says which token-back modes the reduce runs with
        if (self.fc2_in_kernel_topk_reduce and needs is not None
                and self.token_back_by_dispatch != (needs == "dispatch")):
            raise InvalidKnobsError("fc2_in_kernel_topk_reduce", f"the {fmt} kernel reduces in kernel only with "
                                    + ("a dispatch-warp token_back_mode" if needs == "dispatch"
                                       else "token_back_mode='epi_warps'"))
        return self


# Measured per-capacity profiles (see the module docstring for provenance).
def _nvfp4_profile(capacity: int) -> Sm100Knobs:
    if capacity < 512:
        tile, tb, fb = (256, 128, 256), "epi_warps", 4
    elif capacity < 1024:
        tile, tb, fb = (256, 128, 256), "reuse_dispatch_warps", 4
    elif capacity < 2048:
        tile, tb, fb = (256, 256, 256), "standalone_warps", 4
    else:
        tile, tb, fb = (256, 256, 256), "reuse_dispatch_warps", 8
    return Sm100Knobs(mma_tiler_mnk=tile, cluster_shape_mnk=(2, 1, 1), token_back_mode=tb,
                      load_balance_mode="atomic_counter", group_hint=512, flag_batch=fb, epi_flag_batch=(2, 4))


def _mxfp8_profile(capacity: int) -> Sm100Knobs:
    tb = "epi_warps" if capacity < 2048 else "reuse_dispatch_warps"
    return Sm100Knobs(mma_tiler_mnk=(256, 256, 128), cluster_shape_mnk=(2, 1, 1), token_back_mode=tb,
                      load_balance_mode="atomic_counter", group_hint=512, flag_batch=4, epi_flag_batch=(2, 4))


def _bf16_profile(capacity: int) -> Sm100Knobs:
    # One validated geometry; no per-capacity tuning has been measured.
    return Sm100Knobs(mma_tiler_mnk=(256, 256, 64), cluster_shape_mnk=(2, 1, 1), token_back_mode="epi_warps",
                      load_balance_mode="static", group_hint=None, flag_batch=1, epi_flag_batch=(1, 1))


_PROFILES = {"nvfp4": _nvfp4_profile, "mxfp8": _mxfp8_profile, "bf16": _bf16_profile}


def heuristic_knobs(fmt: str, max_tokens_per_rank: int) -> Sm100Knobs:
    """The measured profile for `fmt` at this capacity (max_tokens_per_rank)."""
    if fmt not in _PROFILES:
        raise InvalidKnobsError("fmt", f"the sm100 kernels serve {sorted(_PROFILES)}, got {fmt!r}")
    return _PROFILES[fmt](max(1, int(max_tokens_per_rank)))


def resolve_knobs(knobs, *, fmt: str, max_tokens_per_rank: int, cache_key: str, cache=None, shipped=None,
                  model=None, tune=None, hidden: Optional[int] = None,
                  intermediate: Optional[int] = None) -> Tuple[Sm100Knobs, str]:
    """Explicit > persistent cache > shipped table > ("auto": tune()) > knob model (none for sm100 yet) >
    heuristic, in one pass (shim.common.knobs.resolve_knob_set). Returns (knobs, where they came from). The
    geometry (hidden, intermediate) is taken as sm90's is; no sm100 heuristic depends on it."""
    del hidden, intermediate
    return resolve_knob_set(knobs, knob_type=Sm100Knobs, heuristic=lambda: heuristic_knobs(fmt, max_tokens_per_rank),
                            validate=lambda k: k.validate(fmt), cache_key=cache_key, cache=cache, shipped=shipped,
                            model=model, tune=tune)
