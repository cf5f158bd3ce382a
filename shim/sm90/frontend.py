"""What the Hopper frontends share: the tree's symbols, knob resolution by format, and kernel construction.

Both Hopper MegaMoE kernels (FP8 and BF16) take the same scheduling / token-comm constructor arguments;
a format frontend names its two kernel classes (plain and swap-AB) and adds its format's own arguments.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

from shim.common.frontend import MegaMoEFrontend
from shim.sm90.knobs import HopperKnobs, InvalidKnobsError, KERNEL_FOR_FORMAT, resolve_knobs

__all__ = ["Sm90Frontend"]


class Sm90Frontend(MegaMoEFrontend):
    arch = "sm90"

    def symbols(self):
        from shim.sm90 import kernel_symbols

        return kernel_symbols

    def resolve_knobs(self, knobs, cache_key: str):
        return resolve_knobs(knobs, fmt=self.fmt, capacity=self.capacity, cache_key=cache_key)

    def kernel_classes(self) -> Tuple[type, type]:
        """(plain, swap-AB) kernel classes of this format."""
        raise NotImplementedError

    def format_kwargs(self, knobs: HopperKnobs) -> Dict[str, Any]:
        return {}

    def build_kernel(self, knobs: HopperKnobs):
        if knobs.kernel != KERNEL_FOR_FORMAT[self.fmt]:
            raise InvalidKnobsError("kernel", f"fmt {self.fmt!r} is served by {KERNEL_FOR_FORMAT[self.fmt]}, "
                                              f"the knob set names {knobs.kernel!r}")
        plain, swap = self.kernel_classes()
        try:
            return (swap if knobs.swap_ab else plain)(
                mma_tiler_mnk=knobs.mma_tiler_mnk, cluster_shape_mnk=knobs.cluster_shape_mnk, use_2cta_instrs=False,
                group_hint=knobs.group_hint or self.max_active_clusters, token_padding_block=knobs.token_tile,
                load_balance_mode=knobs.load_balance_mode,
                static_expert_shape=(self.experts_per_rank, 2 * self.intermediate, self.hidden),
                pingpong=knobs.pingpong, world_size=self.world_size, local_rank=self.rank, num_topk=self.top_k,
                max_tokens_per_rank=self.capacity, hidden=self.hidden,
                fc2_in_kernel_topk_reduce=knobs.fc2_in_kernel_topk_reduce, apply_topk_in_fc1=True,
                token_back_mode=knobs.token_back_mode, epi_flag_batch=knobs.epi_flag_batch,
                flag_batch=knobs.flag_batch, gate_up_clamp=self.gate_up_clamp,
                tail_split_pairs=knobs.tail_split_pairs, **self.format_kwargs(knobs),
            )
        except (ValueError, NotImplementedError, AssertionError, TypeError) as e:
            raise InvalidKnobsError("knobs", f"the kernel rejects {knobs}: {e}") from e
