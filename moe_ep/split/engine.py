"""Local engines: what computes a rank's own experts over the rows the transport brought it.

An engine takes N rows (the tokens sent to this rank, once each), [N, K] expert ids local to the engine (-1 in the
slots other ranks compute) and the [N, K] routing weights, and writes each row's partial sum over its slots, bf16
[N, H]: the fused kernels' top-k reduce (fp32, in slot order, one rounding) restricted to the slots it holds.

  reference   the torch reference's FFN (moe_ep/reference/ffn.py): any format, any device; the oracle's own math.
  fused       the arch's fused kernel backend at world size 1 over the rank's experts (same numerics as the fused
              path: same kernel, same knobs at the same capacity); CUDA. Rows cross in bf16 (the kernel stages them).
  fused_fp8   the same Hopper FP8 blockwise kernel over rows that crossed already quantized (shim/sm90/split_engine.py):
              half the bytes on the wire, the kernel's inputs unchanged.
  backend:<n> a registered backend <n> at world size 1 (the same wrapper; `fused` names the arch's own).
  torch_fp8_block128, torch_fp8_rowwise
              grouped GEMMs torch ships (moe_ep/split/torch_engine.py); their own numerics, named as such.
Named here by lazy strings (ENGINES), as the registry names backends.

An engine that `takes_quantized` receives its rows already in the layer's format (quantized once at the source by
the format's own quantizer, moe_ep.formats.packs.quantize_input, whose bytes do not depend on where it runs): FP8 on
the wire is half the bytes of bf16. The others receive bf16 rows and quantize them as they would anyway.
"""

from __future__ import annotations

import importlib
from dataclasses import replace
from typing import ClassVar, Dict, Optional, Tuple

import torch

from moe_ep.core import registry
from moe_ep.core.dist import RankContext
from moe_ep.core.spec import MoESpec
from moe_ep.core.weights import QuantizedExpertWeights
from moe_ep.errors import BackendUnavailableError, FormatError, SpecError
from moe_ep.formats import FORMATS, QuantizedActivation, QuantizedWeights, packs
from moe_ep.reference.oracle import oracle_forward

__all__ = ["LocalEngine", "ReferenceEngine", "BackendEngine", "ENGINES", "engine_class", "default_engine",
           "rebase", "kernel_backend_for"]

ENGINES: Dict[str, str] = {
    "reference": "moe_ep.split.engine:ReferenceEngine",
    "fused": "moe_ep.split.engine:BackendEngine",
    "fused_fp8": "shim.sm90.split_engine:FusedFp8WireEngine",
    "torch_fp8_block128": "moe_ep.split.torch_engine:ScaledMMEngine",
    "torch_fp8_rowwise": "moe_ep.split.torch_engine:GroupedRowwiseEngine",
}


def rebase(weights, rank: int, world_size: int, num_experts: int):
    """The same expert tensors, described as rank `rank` of `world_size` owning num_experts / world_size of
    num_experts (the engine's own numbering): no copy."""
    if isinstance(weights, QuantizedExpertWeights):
        e_local = num_experts // world_size
        return QuantizedExpertWeights(replace(weights.qw, expert_offset=rank * e_local), rank, world_size,
                                      num_experts, weights.report)
    return replace(weights, rank=rank, world_size=world_size, num_experts=num_experts)


def kernel_backend_for(device: torch.device, fmt: str) -> Optional[str]:
    """The registered kernel backend serving fmt on the device's arch (its table's row), or None."""
    arch = registry.detect_arch(device)
    if arch == "cpu":
        return None
    for name, info in registry.list_backends().items():
        if info.arch == arch and fmt in info.formats and info.available:
            return name
    return None


class LocalEngine:
    """Base. spec: the engine's geometry (num_experts = the experts it holds, max_tokens_per_rank = the most rows
    one forward hands it); ctx: the layer's rank; expert_offset: the layer's global id of its expert 0."""

    name: ClassVar[str] = "abstract"
    formats: ClassVar[Tuple[str, ...]] = FORMATS
    takes_quantized: bool = False
    numerics: str = "the format's"
    capturable: bool = True  # its forward reads nothing on the host (a CUDA graph can hold it)

    def __init__(self, spec: MoESpec, ctx: RankContext, fmt: str, *, expert_offset: int = 0,
                 apply_topk_in_fc1: bool = True):
        self.spec, self.ctx, self.fmt = spec, ctx, fmt
        self.expert_offset = expert_offset
        self.apply_topk_in_fc1 = bool(apply_topk_in_fc1)

    @classmethod
    def check(cls, spec: MoESpec, fmt: str, device: torch.device, options: dict) -> None:
        """Raise a typed error when this engine cannot serve (fmt, device, options); before anything is built."""
        if fmt not in cls.formats:
            raise FormatError("fmt", f"the split path's {cls.name!r} engine serves {list(cls.formats)}, not {fmt!r}")

    def prepare_weights(self, weights) -> None:
        raise NotImplementedError

    def quantize(self, hidden: torch.Tensor) -> QuantizedActivation:
        """bf16 [T, H] -> the rows as this engine reads them (takes_quantized engines)."""
        return packs.quantize_input(self.oracle_weights(), hidden)

    def forward(self, rows, ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """rows: a QuantizedActivation (takes_quantized) or bf16 [N, H]; ids int32 [N, K]; weights fp32 [N, K];
        out bf16 [N, H]."""
        raise NotImplementedError

    def oracle_weights(self) -> QuantizedWeights:
        """The quantized weights it computes with, canonical layout, expert_offset the layer's."""
        raise NotImplementedError

    def replace_experts(self, local_slots, weights: QuantizedWeights) -> None:
        raise BackendUnavailableError("backend", f"the split path's {self.name!r} engine cannot replace experts")

    def staged_activation(self) -> Optional[QuantizedActivation]:
        return None

    def close(self) -> None:
        pass


class ReferenceEngine(LocalEngine):
    """The torch reference's FFN per expert, then the top-k reduce over the row's slots (moe_ep.reference.ffn)."""

    name = "reference"
    capturable = False  # per-expert row selection on the host

    def __init__(self, spec, ctx, fmt, *, expert_offset: int = 0, apply_topk_in_fc1: bool = True,
                 wire: str = "quantized"):
        super().__init__(spec, ctx, fmt, expert_offset=expert_offset, apply_topk_in_fc1=apply_topk_in_fc1)
        self.takes_quantized = wire == "quantized"
        self._qw: Optional[QuantizedWeights] = None
        self._local: Optional[QuantizedWeights] = None

    @classmethod
    def check(cls, spec, fmt, device, options):
        super().check(spec, fmt, device, options)
        wire = options.get("wire", "quantized")
        if wire not in ("quantized", "bf16"):
            raise SpecError("wire", f"expected 'quantized' (rows cross in the layer's format) or 'bf16', got {wire!r}")

    def prepare_weights(self, weights) -> None:
        dev = self.ctx.device
        if isinstance(weights, QuantizedExpertWeights):
            qw = weights.qw.to(dev)
        else:
            qw = packs.quantize_weights(self.fmt, weights.w13.to(dev), weights.w2.to(dev), act_amax=weights.act_amax,
                                        fc2_act_amax=weights.fc2_act_amax, expert_offset=weights.expert_offset)
        self._qw = replace(qw, expert_offset=self.expert_offset)
        self._local = replace(qw, expert_offset=0)

    def forward(self, rows, ids, weights, out):
        if ids.shape[0] == 0:
            return out
        act = rows if isinstance(rows, QuantizedActivation) else packs.quantize_input(self._local, rows)
        return out.copy_(oracle_forward(self._local, act, ids, weights, gate_up_clamp=self.spec.gate_up_clamp,
                                        apply_topk_in_fc1=self.apply_topk_in_fc1))

    def oracle_weights(self) -> QuantizedWeights:
        return self._qw

    def replace_experts(self, local_slots, weights: QuantizedWeights) -> None:
        self._qw.write_experts(local_slots, weights)  # the same tensors back both views

    def close(self) -> None:
        self._qw = self._local = None


class BackendEngine(LocalEngine):
    """A registered backend over a group of its own: the arch's fused kernel at world size 1 (the split path's
    `fused` engine; `backend` names another), or over one NVLink domain (two_level's inner layer: `ctx` is then
    the domain's). Its forward is collective over that group: every member calls it once per outer call."""

    name = "fused"

    def __init__(self, spec, ctx, fmt, *, expert_offset: int = 0, apply_topk_in_fc1: bool = True,
                 backend: Optional[str] = None, engine_ctx: Optional[RankContext] = None,
                 backend_options: Optional[dict] = None, backend_class=None):
        super().__init__(spec, ctx, fmt, expert_offset=expert_offset, apply_topk_in_fc1=apply_topk_in_fc1)
        self.ctx_engine = engine_ctx or (ctx if ctx.world_size == 1 else RankContext.detached(0, 1, ctx.device))
        if backend_class is not None:  # a variant of a registered backend (the shim's fused_fp8 engine)
            cls, self.backend_name = backend_class, backend_class.name
        else:
            self.backend_name = backend or kernel_backend_for(ctx.device, fmt)
            cls = registry.resolve_backend(self.backend_name)
        opts = dict(backend_options or {})
        if not apply_topk_in_fc1:
            opts["apply_topk_in_fc1"] = False
        self.backend = cls(spec, self.ctx_engine, fmt=fmt, **opts)
        self.collective = self.ctx_engine.world_size > 1
        self.name = f"fused:{self.backend_name}" if backend is None else f"backend:{self.backend_name}"

    @classmethod
    def check(cls, spec, fmt, device, options):
        name = options.get("backend") or kernel_backend_for(device, fmt)
        if name is None:
            raise BackendUnavailableError("engine", f"no fused kernel backend serves fmt {fmt!r} on {device}: the "
                                                    "split path's 'fused' engine needs one (engine='reference' runs "
                                                    "anywhere)")
        entry = registry.get_entry(name)
        if fmt not in entry.formats:
            raise FormatError("fmt", f"backend {name!r} serves {list(entry.formats)}, not {fmt!r}")
        problems = registry.resolve_backend(name).check_spec(spec, fmt, 1)
        if problems:
            argument, message = problems[0]
            raise SpecError(argument, f"{message} (the split path's engine {name!r})")

    def prepare_weights(self, weights) -> None:
        c = self.ctx_engine
        self.backend.prepare_weights(rebase(weights, c.rank, c.world_size, self.spec.num_experts))

    def forward(self, rows, ids, weights, out):
        n = ids.shape[0]
        if n == 0 and not self.collective:
            return out
        cap = self.spec.max_tokens_per_rank
        ids = ids.to(torch.int64)
        if n <= cap:
            self.backend.forward(rows, ids, weights, out)
            return out
        # A one-rank kernel has no peers to agree with: more rows than its capacity run as local chunks.
        for a in range(0, n, cap):
            b = min(a + cap, n)
            self.backend.forward(rows[a:b], ids[a:b], weights[a:b], out[a:b])
        return out

    def oracle_weights(self) -> QuantizedWeights:
        return replace(self.backend.oracle_weights(), expert_offset=self.expert_offset)

    def replace_experts(self, local_slots, weights: QuantizedWeights) -> None:
        self.backend.replace_experts(local_slots, weights)

    def close(self) -> None:
        self.backend.close()


def engine_class(name: str):
    """The engine class for a name of ENGINES (or "backend:<registered name>", a BackendEngine)."""
    target = ENGINES["fused"] if name.startswith("backend:") else ENGINES.get(name)
    if target is None:
        raise SpecError("engine", f"unknown engine {name!r}; expected one of {sorted(ENGINES)} or "
                                  "'backend:<registered backend>'")
    module, attr = target.split(":", 1)
    try:
        return getattr(importlib.import_module(module), attr)
    except ImportError as e:
        raise BackendUnavailableError("engine", f"engine {name!r}: importing {module!r} failed: {e}") from e


def default_engine(device: torch.device, fmt: str) -> str:
    """`fused` where a kernel backend serves fmt on the device (same numerics as the fused path), else
    `reference`."""
    return "fused" if kernel_backend_for(device, fmt) is not None else "reference"
