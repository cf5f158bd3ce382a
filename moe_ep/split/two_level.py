"""`two_level`: a group spanning several NVLink domains runs a fused backend inside each domain and the transport
between them, so each domain keeps its NVLink speed (the shape of DeepEP's normal mode).

Rank (d, l) (domain d, local index l; moe_ep/split/topology.py) sends each token once to every other domain that
holds one of its experts, to that domain's rank with the same local index l: the rail {(d', l) for every d'} is the
only group the transport uses, so inter-domain traffic never crosses a domain on the way. Every rank then runs the
domain's fused layer (over the domain's group, experts numbered within the domain) over the rows it received from
its rail, its own tokens included (they reach it through the rail's self-copy); that layer's kernel takes each row
to whichever rank of the domain holds its experts, and returns the row's partial sum over the domain's slots. The
partials come back along the rail and each token sums its own, in fp32, in domain order (moe_ep/split/layout.py).

It is the split path with two changes (moe_ep/split/backend.py): the destinations are the domains (through the
rail), and the engine is the fused backend over the domain (moe_ep.split.engine.BackendEngine). Rows cross in bf16:
the fused kernel quantizes its own input. The domain's layer is sized for every rail peer sending it a full call
(capacity * domains rows), so it never needs more than one launch.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from moe_ep.core import registry
from moe_ep.core.dist import RankContext
from moe_ep.core.spec import MoESpec
from moe_ep.errors import BackendUnavailableError, SpecError, TopologyError
from moe_ep.split import engine as engines
from moe_ep.split import topology
from moe_ep.split.backend import SplitBackend

__all__ = ["TwoLevelBackend", "subgroup"]

_groups: Dict[Tuple[int, ...], object] = {}


def subgroup(global_ranks: Tuple[int, ...]):
    """A process group of these global ranks, made once per process (only its members call this: local
    synchronisation, so the other ranks need not take part, and two layers share one group)."""
    g = _groups.get(global_ranks)
    if g is None:
        g = _groups[global_ranks] = dist.new_group(list(global_ranks), use_local_synchronization=True)
    return g


def _global_ranks(ctx: RankContext):
    g = ctx.group if ctx.group is not None else dist.group.WORLD
    return list(dist.get_process_group_ranks(g))


class TwoLevelBackend(SplitBackend):
    """Options: inner (the registered backend run inside each domain; default the device arch's kernel for fmt, or
    the torch reference on the CPU), inner_options (its constructor options), transport (as split's), wire ("bf16":
    the domain's kernel quantizes its input; "fp8": rows cross quantized, Hopper FP8 blockwise only)."""

    name = "two_level"
    path = "two_level"

    def __init__(self, spec: MoESpec, ctx: RankContext, fmt: Optional[str] = None, *, inner: Optional[str] = None,
                 inner_options: Optional[dict] = None, transport: str = "auto", apply_topk_in_fc1: bool = True,
                 wire: str = "bf16"):
        if wire not in ("bf16", "fp8"):
            raise SpecError("wire", f"expected 'bf16' (the domain's kernel quantizes) or 'fp8' (rows cross quantized, "
                                    f"the Hopper FP8 kernel reads them as they are), got {wire!r}")
        self._wire = wire
        dmap = topology.domain_map(ctx)
        if not dmap.uniform:
            raise TopologyError("backend", f"two_level needs domains of one size (a rail is one rank of each "
                                           f"domain); this group's are {dmap}")
        self.domains = dmap
        me = ctx.rank
        self.domain, self.local = dmap.domain_of(me), dmap.local_rank(me)
        glob = _global_ranks(ctx)
        self._rail_ctx = RankContext.from_group(subgroup(tuple(glob[r] for r in dmap.rail(self.local))), ctx.device)
        self._domain_ctx = RankContext.from_group(subgroup(tuple(glob[r] for r in dmap.domains[self.domain])),
                                                  ctx.device)
        self._inner = inner or engines.kernel_backend_for(ctx.device, fmt or self.weight_formats[0]) or \
            ("torch_reference" if ctx.device.type == "cpu" else None)
        self._inner_options = dict(inner_options or {})
        if self._inner is not None and self._inner_options.get("carry_fingerprint") is None and \
                self._inner == "torch_reference":
            # The outer layer's watch covers the call; the domain's group has no layer of its own to name.
            self._inner_options["carry_fingerprint"] = False
        # Slot -> (its domain, its id inside the domain's layer), on the device, for any map (a domain's ranks need
        # not be contiguous).
        e = spec.num_experts
        e_local = e // ctx.world_size
        owner = torch.arange(e) // e_local
        dom = torch.tensor([dmap.domain_of(int(r)) for r in owner], dtype=torch.int64)
        inner_id = torch.tensor([dmap.local_rank(int(r)) for r in owner], dtype=torch.int64) * e_local + \
            torch.arange(e) % e_local
        self._dom_of = dom.to(ctx.device)
        self._inner_of = inner_id.to(ctx.device)
        super().__init__(spec, ctx, fmt, transport=transport, apply_topk_in_fc1=apply_topk_in_fc1,
                         carry_fingerprint=False)

    # -- the split path's hooks ----------------------------------------------------------------------------
    def _choose_engine(self, engine, engine_rows, opts):
        if self._inner is None:
            raise BackendUnavailableError("inner", f"no fused kernel backend serves fmt {self.fmt!r} on "
                                                   f"{self.ctx.device}; pass inner=<a registered backend>")
        entry = registry.get_entry(self._inner)
        if getattr(registry.resolve_backend(self._inner), "path", None) in ("split", "two_level"):
            raise SpecError("inner", f"the domain's layer must be a whole-group backend, not {self._inner!r}")
        if self.fmt not in entry.formats:
            raise SpecError("inner", f"{self._inner!r} serves {list(entry.formats)}, not fmt {self.fmt!r}")
        d = self.domains
        s = self.spec
        e_domain = d.domain_size * (s.num_experts // self.ctx.world_size)
        local = MoESpec(s.hidden_size, s.intermediate_size, e_domain, min(s.top_k, e_domain),
                        d.num_domains * s.max_tokens_per_rank, s.gate_up_clamp)
        problems = registry.resolve_backend(self._inner).check_spec(local, self.fmt, d.domain_size)
        if problems:
            argument, message = problems[0]
            raise SpecError(argument, f"{message} (two_level's domain layer {self._inner!r})")
        opts.update(engine_ctx=self._domain_ctx, backend_options=self._inner_options)
        if self._wire == "fp8":  # the Hopper FP8 kernel over rows quantized at their source (shim/sm90/split_engine.py)
            cls = engines.engine_class("fused_fp8")
            cls.check(local, self.fmt, self.ctx.device, opts)
            return "fused_fp8", cls, local
        opts["backend"] = self._inner
        return f"backend:{self._inner}", engines.BackendEngine, local

    def _transport(self):
        from moe_ep.split.transport import Transport

        return Transport(self._rail_ctx, "two_level's rail")

    def _route(self, topk_idx: torch.Tensor):
        idx = topk_idx.to(torch.int64)
        live = idx >= 0
        safe = idx.clamp(min=0)
        owner = torch.where(live, self._dom_of.index_select(0, safe.reshape(-1)).view(idx.shape),
                            self.domains.num_domains)
        return owner, self._inner_of.index_select(0, safe.reshape(-1)).view(idx.shape), self.domains.num_domains

    def describe(self) -> dict:
        d = super().describe()
        d.update(transport=f"torch.distributed all_to_all_single over rails ({self.transport_mode})",
                 engine=f"{self.engine.backend_name} over each domain", numerics=f"the format's ({self._inner} inside each domain;"
                                                                      f" partials summed across domains)")
        return d
