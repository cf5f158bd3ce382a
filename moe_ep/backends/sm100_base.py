"""What the three Blackwell (sm100) MegaMoE backends share: a thin moe_ep.Backend over one shim.sm100
frontend. The shim is imported inside methods, so registering or listing these backends imports nothing
heavy, and check_spec() asks shim.sm100.limits, which does not load the kernel tree."""

from __future__ import annotations

from typing import ClassVar, List, Optional, Tuple

from moe_ep.backends._kernel import KernelBackend
from moe_ep.core.errors import BackendUnavailableError
from moe_ep.core.weights import QuantizedWeights

__all__ = ["Sm100Backend"]


class Sm100Backend(KernelBackend):
    arch = "sm100"
    name: ClassVar[str] = "sm100_abstract"
    weight_formats: ClassVar[Tuple[str, ...]] = ()

    def __init__(self, spec, ctx, fmt: Optional[str] = None, *, knobs=None, **options):
        from moe_ep.core.registry import detect_arch

        found = detect_arch(ctx.device)
        if found != "sm100":
            raise BackendUnavailableError("device", f"{self.name} runs the Blackwell (sm100) kernels; {ctx.device} "
                                                    f"is {found}")
        if knobs == "auto":
            import warnings

            # Not silently: the Hopper backends tune here; the sm100 ones have no hardware-measured tuning run
            # behind them yet, so "auto" takes the persistent knob cache when it has this key, else the profile.
            warnings.warn(f"{self.name}: knobs='auto' does not run a collective autotune on sm100 yet; using the "
                          "knob cache entry for this geometry if there is one, else the measured profile",
                          RuntimeWarning, stacklevel=2)
        super().__init__(spec, ctx, fmt, knobs=knobs, **options)

    def make_frontend(self, knobs):
        from shim.sm100.frontend import make_frontend

        return make_frontend(self.fmt, knobs=knobs, **self._frontend_kw)

    @classmethod
    def check_spec(cls, spec, fmt: str, world_size: int) -> List[Tuple[str, str]]:
        from shim.sm100 import limits

        problems = list(super().check_spec(spec, fmt, world_size))
        if fmt not in cls.weight_formats:
            problems.append(("fmt", f"{cls.name} serves {list(cls.weight_formats)}, not {fmt!r}"))
            return problems
        problems += limits.size_violations(fmt, hidden=spec.hidden_size, intermediate=spec.intermediate_size,
                                           top_k=spec.top_k)
        return problems

    @property
    def apply_topk_in_fc1(self) -> bool:
        """True for all three: the frontends build the NVFP4 and BF16 kernels with apply_topk_in_fc1=True, and the
        MXFP8 kernel (drop 0.7.4) has no such flag, it always folds the routing weight into the SwiGLU output
        before the FC2-input quantization. The oracle reads this to do the same."""
        return True

    def oracle_weights(self) -> QuantizedWeights:
        # Read back from the tensors the kernel is handed (unpacked, de-swizzled, de-interleaved).
        return self.frontend.weights.canonical()

    def staged_activation(self):
        return self.frontend.staged_activation(self._last_t)
