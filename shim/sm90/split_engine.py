"""The split path's `fused_fp8` engine: the Hopper FP8 blockwise kernel over rows that crossed the wire already
quantized (moe_ep/split/engine.py names it by lazy string; docs/scale-out.md).

The split path quantizes a token once, at its source, with the format's own quantizer
(moe_ep.formats.codecs.fp8_quantize_rows over 1x128 blocks): the bytes the kernel frontend's staging writes for the
same bf16 row (its fused Triton staging is checked byte for byte against that quantizer on the device before it is
used). So the rows cross in FP8 (7,456 bytes a DeepSeek-V3 row with scales and routing, against 14,336 in bf16), and
this engine's frontend copies their bytes into the kernel's activation buffers instead of quantizing: the kernel
reads the same inputs as on the bf16 wire, and gives the same outputs.

The rows' tensors are new every call, so the frontend runs without its internal graphs (a replayed graph would read
the addresses it was captured with): inside a caller's capture that changes nothing (the launch is captured); an
eager call pays the CuTe executor's host time, small beside a prefill-sized call.
"""

from __future__ import annotations

import torch

from moe_ep.formats import QuantizedActivation, codecs
from moe_ep.split.engine import BackendEngine
from shim.sm90 import fp8_staging
from shim.sm90.backend import Sm90Fp8Backend
from shim.sm90.fp8_frontend import ACT_BLOCK, Sm90Fp8Frontend

__all__ = ["Sm90Fp8PrestagedFrontend", "Sm90Fp8PrestagedBackend", "FusedFp8WireEngine"]


class Sm90Fp8PrestagedFrontend(Sm90Fp8Frontend):
    """Staging copies rows already quantized by the format's quantizer (`prestaged`: e4m3 [>= t, H], fp32 scales
    [>= t, H/128]) into the activation buffers; the bf16 rows handed to forward() only give the call its shape."""

    prestaged = None

    def stage_activations(self, x: torch.Tensor) -> None:
        q, s = self.prestaged
        t, h = x.shape
        nb = h // ACT_BLOCK
        self.act[:t].view(torch.uint8).copy_(q[:t].view(torch.uint8))
        self.act_sf[:t, :nb].copy_(s[:t])
        if nb < self.act_sf.shape[1]:
            self.act_sf[:t, nb:].zero_()  # the staging arena is shared by every layer: the padding words every call


class Sm90Fp8PrestagedBackend(Sm90Fp8Backend):
    """sm90_fp8_cutedsl with the prestaged frontend (same row, knobs, compile and weights)."""

    @classmethod
    def frontend_class(cls):
        return Sm90Fp8PrestagedFrontend


class FusedFp8WireEngine(BackendEngine):
    """The Hopper FP8 blockwise kernel over rows that arrive quantized: at world size 1 over the rank's experts
    (split), or over one NVLink domain (two_level, wire="fp8")."""

    name = "fused_fp8"
    formats = ("fp8_block",)
    takes_quantized = True

    def __init__(self, spec, ctx, fmt, *, expert_offset: int = 0, apply_topk_in_fc1: bool = True,
                 engine_ctx=None, backend_options=None, backend=None):
        opts = dict(backend_options or {})
        opts["internal_graphs"] = False
        super().__init__(spec, ctx, fmt, expert_offset=expert_offset, apply_topk_in_fc1=apply_topk_in_fc1,
                         engine_ctx=engine_ctx, backend_options=opts, backend_class=Sm90Fp8PrestagedBackend)
        self.name = "fused_fp8"
        self._shape_rows = torch.zeros((1, spec.hidden_size), dtype=torch.bfloat16, device=ctx.device)

    @classmethod
    def check(cls, spec, fmt, device, options):
        from moe_ep.errors import BackendUnavailableError, FormatError
        from moe_ep.core.registry import detect_arch

        if fmt not in cls.formats:
            raise FormatError("fmt", f"the split path's 'fused_fp8' engine serves {list(cls.formats)}, not {fmt!r}")
        if detect_arch(device) != "sm90":
            raise BackendUnavailableError("engine", f"the 'fused_fp8' engine runs the Hopper FP8 kernel; the device "
                                                    f"is {device}")
        problems = Sm90Fp8PrestagedBackend.check_spec(spec, fmt, 1)
        if problems:
            from moe_ep.errors import SpecError

            raise SpecError(problems[0][0], f"{problems[0][1]} (the split path's engine 'fused_fp8')")

    def quantize(self, hidden: torch.Tensor) -> QuantizedActivation:
        t, h = hidden.shape
        fe = self.backend.frontend
        if fe is not None and fe.staging == "fused" and t:
            q = torch.empty((t, h), dtype=torch.float8_e4m3fn, device=hidden.device)
            s = torch.empty((t, h // ACT_BLOCK), dtype=torch.float32, device=hidden.device)
            fp8_staging.launch_fused(hidden, q, s)  # checked on this device against the quantizer below
            return QuantizedActivation(self.fmt, q, s)
        q, s = codecs.fp8_quantize_rows(hidden, ACT_BLOCK, reciprocal=False)
        return QuantizedActivation(self.fmt, q, s)

    def forward(self, rows: QuantizedActivation, ids, weights, out):
        n = ids.shape[0]
        if n == 0 and not self.collective:
            return out
        fe = self.backend.frontend
        ids = ids.to(torch.int64)
        cap = self.spec.max_tokens_per_rank
        for a in range(0, max(n, 1), cap):  # more rows than the capacity: local chunks (one-rank kernels only)
            b = min(a + cap, n)
            fe.prestaged = (rows.q[a:b], rows.scale[a:b])
            try:
                self.backend.forward(self._shape_rows.expand(b - a, -1), ids[a:b], weights[a:b], out[a:b])
            finally:
                fe.prestaged = None
        return out
