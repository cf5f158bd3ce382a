"""Knobs of the Hopper MegaMoE kernels (FP8, BF16, W4A8): what may be tuned, what changes results, and how a set is
chosen.

Correctness knobs change the generated program's arithmetic or its summation order (tile and cluster shape, operand
swap, ping-pong, accumulation mode, token-back mode, in-kernel fc2 reduce, load-balance mode, tail-split pair tasks:
the tuner oracle-checks a winner that changes any of them); perf knobs change only who moves which bytes when
(group_hint, flag batching, the dispatch warps, the producer-warp layout, the FC1 store path, scheduler stages,
dispatch dedup, the pull buffer's layout, W4A8's narrow FC2 tail). docs/tuning.md lists every constructor argument
of the kernels with the line that decides its class. All are compile-time parameters: one set per workspace.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from shim.common.knobs import InvalidKnobsError, KnobSet, resolve_knob_set
from shim.sm90.formats import BACKENDS

__all__ = ["KNOB_SPACE", "KERNEL_CLASS", "CORRECTNESS_KNOBS", "PERF_KNOBS", "EXCHANGE_KNOBS", "Sm90Knobs",
           "InvalidKnobsError",
           "heuristic_knobs", "resolve_knobs"]

# moe_ep format -> the KNOB_SPACE entry its knob sets draw from (the row's plain kernel class; the swap-AB one is
# chosen by the swap_ab knob). From the format table.
KERNEL_CLASS = {row.fmt: row.knob_space for row in BACKENDS}

# The value sets the tuner draws from, by the kernel constructor parameter they
# feed. Literal on purpose: `tools/drop audit` checks it against the drop by AST.
KNOB_SPACE = {
    "Sm90MegaMoEFp8Kernel": {
        "mma_tiler_mnk": [(64, 128, 128), (64, 256, 128), (128, 128, 128), (128, 8, 128), (128, 16, 128),
                          (128, 32, 128), (128, 64, 128), (256, 8, 128), (256, 16, 128), (256, 32, 128),
                          (256, 64, 128)],
        "cluster_shape_mnk": [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1)],
        "pingpong": [False, True],
        "fp8_accum_mode": ["1xacc", "2xacc"],
        "token_back_mode": ["epi_warps", "standalone_warps", "reuse_dispatch_warps"],
        "fc2_in_kernel_topk_reduce": [False, True],
        "load_balance_mode": ["static", "atomic_counter"],
        "tail_split_pairs": [False, True],
        "group_hint": [None, 66, 132, 264, 1048576],
        "flag_batch": [1, 2, 4],
        "epi_flag_batch": [1, 2, 4],
        # Perf knobs of the fused exchange and the producer warps (docs/tuning.md says where each is decided).
        "active_dispatch_warps": [1, 2, 4],
        "fold_producer_warps": [True, False],
        "fc1_store_offload": [True, False],
        "fc1_early_done_publish": [False, True],
        "num_sched_stages": [2, 1, 3, 4],
        "dedup_dispatch": [False, True],
        "compact_pull_buffer": [True, False],
    },
    # W4A8 MXFP4: swap-AB only, tile M 128/256 (the swap-AB epilogue), K 128 or 256 (the kernel refuses others;
    # K 256 needs H and I multiples of 256), 1xacc only, no in-kernel top-k reduce (FlashInfer's adapter fixes it
    # off). Token N 16..128: the tiles FlashInfer 0.7.4 tunes over (the epilogue also takes 8, unmeasured).
    "Sm90MegaMoESwapABMxfp4Fp8Kernel": {
        "swap_ab": [True],
        "mma_tiler_mnk": [(128, 16, 128), (128, 32, 128), (128, 64, 128), (128, 128, 128), (256, 16, 128),
                          (256, 32, 128), (256, 64, 128), (128, 16, 256), (128, 32, 256), (128, 64, 256),
                          (256, 16, 256), (256, 32, 256), (256, 64, 256)],
        "cluster_shape_mnk": [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1)],
        "pingpong": [False, True],
        "fp8_accum_mode": ["1xacc"],
        "token_back_mode": ["epi_warps", "standalone_warps", "reuse_dispatch_warps"],
        "fc2_in_kernel_topk_reduce": [False],
        "load_balance_mode": ["static", "atomic_counter"],
        "tail_split_pairs": [False, True],
        "group_hint": [None, 66, 78, 132, 264, 330, 396, 512, 528, 1048576],
        "flag_batch": [1, 2, 4],
        "epi_flag_batch": [1, 2, 4],
        "active_dispatch_warps": [1, 2, 4],
        "fold_producer_warps": [True, False],
        "fc1_store_offload": [True, False],
        "fc1_early_done_publish": [False, True],
        "num_sched_stages": [2, 1, 3, 4],
        "dedup_dispatch": [False, True],
        "compact_pull_buffer": [False, True],
        # The narrow N=8 FC2 MMA for token tails of <= 8 rows (mxfp4_policy.py: tile (256, 64, 256), H 7168 only).
        "mxfp4_fc2_tail_n8": [False, True],
    },
    "Sm90MegaMoEBf16Kernel": {
        "mma_tiler_mnk": [(64, 128, 64), (64, 256, 64), (128, 128, 64), (128, 8, 64), (128, 16, 64),
                          (128, 32, 64), (128, 64, 64)],
        "cluster_shape_mnk": [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1)],
        "pingpong": [False, True],
        "token_back_mode": ["epi_warps", "standalone_warps", "reuse_dispatch_warps"],
        "fc2_in_kernel_topk_reduce": [False, True],
        "load_balance_mode": ["static"],
        "tail_split_pairs": [False, True],
        "group_hint": [None, 66, 132, 264, 1048576],
        "flag_batch": [1, 2, 4],
        "epi_flag_batch": [1, 2, 4],
    },
}

CORRECTNESS_KNOBS = ("kernel", "swap_ab", "mma_tiler_mnk", "cluster_shape_mnk", "pingpong", "accum_mode",
                     "token_back_mode", "fc2_in_kernel_topk_reduce", "load_balance_mode", "tail_split_pairs")
# Perf knobs: the first three always passed; the rest (EXCHANGE_KNOBS) at the set's value when set, None meaning drop
# 0.7.4's default, which the frontends pass by name (a drop's new default is then a decision the drop audit names),
# so a knob set written before they existed builds the same program.
EXCHANGE_KNOBS = ("active_dispatch_warps", "fold_producer_warps", "fc1_store_offload", "fc1_early_done_publish",
                  "num_sched_stages", "dedup_dispatch", "compact_pull_buffer", "mxfp4_fc2_tail_n8")
PERF_KNOBS = ("group_hint", "flag_batch", "epi_flag_batch") + EXCHANGE_KNOBS


@dataclass(frozen=True)
class Sm90Knobs(KnobSet):
    """One knob set of a Hopper MegaMoE kernel, FP8 or BF16 (`kernel` names its KNOB_SPACE entry;
    accum_mode is read by the FP8 program only)."""

    swap_ab: bool
    mma_tiler_mnk: Tuple[int, int, int]
    cluster_shape_mnk: Tuple[int, int, int]
    pingpong: bool = False
    accum_mode: str = "1xacc"
    token_back_mode: str = "epi_warps"
    fc2_in_kernel_topk_reduce: bool = False
    load_balance_mode: str = "static"
    tail_split_pairs: bool = False
    group_hint: Optional[int] = None
    flag_batch: int = 1
    epi_flag_batch: int = 1
    kernel: str = "Sm90MegaMoEFp8Kernel"
    active_dispatch_warps: Optional[int] = None
    fold_producer_warps: Optional[bool] = None
    fc1_store_offload: Optional[bool] = None
    fc1_early_done_publish: Optional[bool] = None
    num_sched_stages: Optional[int] = None
    dedup_dispatch: Optional[bool] = None
    compact_pull_buffer: Optional[bool] = None
    mxfp4_fc2_tail_n8: Optional[bool] = None

    @property
    def token_tile(self) -> int:
        return self.mma_tiler_mnk[1] if self.swap_ab else self.mma_tiler_mnk[0]

    @property
    def token_cluster(self) -> int:
        return self.cluster_shape_mnk[1] if self.swap_ab else self.cluster_shape_mnk[0]

    @property
    def weight_cluster(self) -> int:
        return self.cluster_shape_mnk[0] if self.swap_ab else self.cluster_shape_mnk[1]

    def correctness_part(self) -> Tuple:
        return tuple(getattr(self, k) for k in CORRECTNESS_KNOBS)

    def exchange_kwargs(self) -> Dict[str, Any]:
        """The constructor arguments of the EXCHANGE_KNOBS this set fixes (for those left None the frontends pass
        drop 0.7.4's default by name)."""
        return {k: getattr(self, k) for k in EXCHANGE_KNOBS if getattr(self, k) is not None}

    def validate(self, fmt: Optional[str] = None) -> "Sm90Knobs":
        """self, if every knob is in its kernel's KNOB_SPACE and the combination is one the kernels take; with
        fmt, also that the set names fmt's kernel (as sm100's validate(fmt), called the same way by resolution)."""
        if self.kernel not in KNOB_SPACE:
            raise InvalidKnobsError("kernel", f"{self.kernel!r} is not one of {sorted(KNOB_SPACE)}")
        if fmt is not None and self.kernel != KERNEL_CLASS[fmt]:
            raise InvalidKnobsError("kernel", f"fmt {fmt!r} is served by {KERNEL_CLASS[fmt]}, "
                                              f"the knob set names {self.kernel!r}")
        space = KNOB_SPACE[self.kernel]
        checks = {
            "mma_tiler_mnk": self.mma_tiler_mnk, "cluster_shape_mnk": self.cluster_shape_mnk,
            "pingpong": self.pingpong, "token_back_mode": self.token_back_mode,
            "fc2_in_kernel_topk_reduce": self.fc2_in_kernel_topk_reduce,
            "load_balance_mode": self.load_balance_mode, "tail_split_pairs": self.tail_split_pairs,
            "flag_batch": self.flag_batch, "epi_flag_batch": self.epi_flag_batch,
        }
        if "fp8_accum_mode" in space:
            checks["fp8_accum_mode"] = self.accum_mode
        if "swap_ab" in space:
            checks["swap_ab"] = self.swap_ab
        for name, value in self.exchange_kwargs().items():
            if name not in space:
                raise InvalidKnobsError(name, f"the {self.kernel} kernel has no {name} knob (set it to None)")
            want = int if name in ("active_dispatch_warps", "num_sched_stages") else bool
            if type(value) is not want:
                raise InvalidKnobsError(name, f"expected None or a {want.__name__}, got {value!r}")
            checks[name] = value
        for name, value in checks.items():
            if value not in space[name]:
                raise InvalidKnobsError(name, f"{value!r} is not one of {space[name]}")
        if not isinstance(self.swap_ab, bool):
            raise InvalidKnobsError("swap_ab", f"expected a bool, got {self.swap_ab!r}")
        if self.group_hint is not None and (not isinstance(self.group_hint, int) or self.group_hint <= 0):
            raise InvalidKnobsError("group_hint", f"expected None or a positive int, got {self.group_hint!r}")
        if self.cluster_shape_mnk[2] != 1:
            raise InvalidKnobsError("cluster_shape_mnk", "the cluster's K extent must be 1")
        if self.pingpong and self.kernel == "Sm90MegaMoESwapABMxfp4Fp8Kernel" and self.mma_tiler_mnk[0] != 128:
            raise InvalidKnobsError("pingpong", "the W4A8 kernel's ping-pong needs tile M 128 (two M128 warpgroup "
                                                f"schedules), got {self.mma_tiler_mnk}")
        if self.tail_split_pairs and not (self.token_cluster == 2 and self.weight_cluster == 1):
            raise InvalidKnobsError("tail_split_pairs", "needs exactly two CTAs along tokens and one along weights "
                                    f"(swap-AB (1,2,1) or non-swap (2,1,1)), got {self.cluster_shape_mnk}")
        return self


# W4A8 MXFP4 defaults by capacity bucket (the drop ships no table for this kernel). Facts from FlashInfer 0.7.4's
# Hopper MXFP4 default tactics (its block-permutation routing profile, H200/H100-measured): tile, cluster and
# group_hint per bucket; capacities above 2048 take the 2048 row. Its load-balance, dispatch-warp and store-offload
# choices are left at the kernel's defaults here (static, one dispatch warp, folded producers); the tuner searches
# them (EXCHANGE_KNOBS), so these rows are a starting point for tools/tune, not its measured optimum.
# bucket -> (mma_tiler_mnk, cluster_shape_mnk, group_hint)
W4A8_MXFP4_DEFAULTS = {
    8: ((256, 16, 256), (2, 1, 1), 132),
    32: ((256, 16, 256), (2, 1, 1), 132),
    64: ((256, 16, 256), (2, 1, 1), 132),
    128: ((256, 16, 256), (2, 1, 1), 512),
    256: ((256, 32, 128), (1, 1, 1), 330),
    512: ((256, 64, 256), (2, 1, 1), 512),
    1024: ((256, 64, 256), (2, 1, 1), 528),
    2048: ((256, 64, 256), (2, 1, 1), 512),
}


def _w4a8_heuristic(max_tokens_per_rank: int, hidden: Optional[int], intermediate: Optional[int]) -> Sm90Knobs:
    bucket = next((b for b in sorted(W4A8_MXFP4_DEFAULTS) if max_tokens_per_rank <= b), 2048)
    tile, cluster, group_hint = W4A8_MXFP4_DEFAULTS[bucket]
    if tile[2] == 256 and any(x is not None and x % 256 for x in (hidden, intermediate)):
        tile = (tile[0], tile[1], 128)  # the kernel needs both K axes divisible by the tile's K
    return Sm90Knobs(swap_ab=True, mma_tiler_mnk=tile, cluster_shape_mnk=cluster, group_hint=group_hint,
                     kernel=KERNEL_CLASS["w4a8_mxfp4"])


def heuristic_knobs(fmt: str, max_tokens_per_rank: int, *, hidden: Optional[int] = None,
                    intermediate: Optional[int] = None) -> Sm90Knobs:
    """The drop's own token-bucket table for the format's kernel, keyed by the capacity (max_tokens_per_rank);
    W4A8 MXFP4 (no table in the drop): W4A8_MXFP4_DEFAULTS, its K-256 tiles narrowed to K 128 when hidden or
    intermediate (when given) is not a multiple of 256."""
    from shim.sm90 import kernel_symbols as ks

    # One literal-guarded branch per kernel: the drop audit follows each (backend, format) into its own branch.
    if fmt == "w4a8_mxfp4":
        return _w4a8_heuristic(max(1, max_tokens_per_rank), hidden, intermediate)
    elif fmt == "bf16":
        c = ks.select_bf16_heuristic_config(max(1, max_tokens_per_rank)).config
        accum = "1xacc"
    elif fmt in ("fp8_block", "fp8_tensor"):
        c = ks.select_heuristic_config(BACKENDS.row(fmt).scale_mode, max(1, max_tokens_per_rank)).config
        accum = c.accum_mode
    else:
        raise InvalidKnobsError("fmt", f"no Hopper kernel in this tree serves {fmt!r} (served: {sorted(KERNEL_CLASS)})")
    return Sm90Knobs(
        swap_ab=bool(c.swap_ab), mma_tiler_mnk=tuple(c.mma_tiler_mnk), cluster_shape_mnk=tuple(c.cluster_shape_mnk),
        pingpong=bool(c.pingpong), accum_mode=accum, token_back_mode=c.token_back_mode,
        tail_split_pairs=bool(c.tail_split_pairs), group_hint=c.group_hint, kernel=KERNEL_CLASS[fmt],
    )


def resolve_knobs(knobs, *, fmt: str, max_tokens_per_rank: int, cache_key: str, cache=None, shipped=None,
                  model=None, tune=None, hidden: Optional[int] = None,
                  intermediate: Optional[int] = None) -> Tuple[Sm90Knobs, str]:
    """Explicit > persistent cache > shipped table > ("auto": tune()) > knob model > heuristic, in one pass
    (shim.common.knobs.resolve_knob_set). Returns (knobs, where they came from). hidden / intermediate: the layer's
    geometry, for a heuristic that depends on it (W4A8's K-256 tiles)."""
    return resolve_knob_set(knobs, knob_type=Sm90Knobs,
                            heuristic=lambda: heuristic_knobs(fmt, max_tokens_per_rank, hidden=hidden,
                                                              intermediate=intermediate),
                            validate=lambda k: k.validate(fmt), cache_key=cache_key, cache=cache, shipped=shipped,
                            model=model, tune=tune)
