"""transformers 5 MoE models on moe_ep: one call moves a model's routed experts onto moe_ep layers, or refuses.

    import moe_ep
    from moe_ep.integrations.transformers import swap_experts

    ctx = moe_ep.init_from_env()                       # every rank: the same model, built or loaded alike
    model = AutoModelForCausalLM.from_pretrained(..., dtype=torch.bfloat16).to(ctx.device)
    swap_experts(model, max_tokens_per_rank=256)       # collective; each rank keeps only its experts
    with torch.inference_mode():
        model.generate(...)                            # every rank runs the same number of forwards
    model.save_pretrained(path)                        # collective: transformers' own checkpoint, all experts

What is served is read from each experts module, never assumed from its config. transformers' experts interface
(`@use_experts_implementation`) says how a module computes: has_gate, has_bias, is_transposed, is_concatenated,
has_post_expert_norm, its `_apply_gate` and its `act_fn`. moe_ep serves a module when what it computes is
SiLU(gate) * up, optionally with the clamp moe_ep computes (gate = min(gate, L), up = clamp(up, -L, L)), over
gate/up and down weights and nothing else: the gating is checked by evaluating the module's own `_apply_gate`
on a probe against moe_ep's SwiGLU (so a GELU, a clamp of another form, an `up + 1` or an alpha is seen, whatever
the config says); layouts (transposed, gate/up interleaved by row) are copied into moe_ep's. Top-k comes from the
block, its router and the config, which must agree. Llama-4's text MoE (the router's sigmoid score scales the
input before its experts) is served for top-1, where scaling the hidden state by the score and weighting the
expert by 1 is exact. Anything else that holds routed experts is refused (IntegrationError naming the module and
the reason) before any layer is built, and nothing is swapped.

Expert parallelism over the process group: rank r of W keeps experts [r E/W, (r+1) E/W), copied (in bf16) from
the module's weights, which are then deleted. Every call of a layer is collective (docs/api.md): ranks run the
same number of forwards (generate with the same max_new_tokens and no early stop). A swapped model is for
inference: moe_ep computes no gradients, so a forward that would need one raises IntegrationError (eager and
compiled alike). save_pretrained gathers every rank's experts into transformers' names and dtype (bf16 layers;
a quantized layer's values are neither the model's weights nor bf16, and are refused before anything is
written). docs/models.md has the table of transformers' MoE architectures and what each gets.
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from moe_ep.core.dist import RankContext, all_gather_tensor, run_agreed
from moe_ep.core.spec import MoESpec
from moe_ep.core.weights import ExpertWeights
from moe_ep.errors import IntegrationError
from moe_ep.formats import format_info
from moe_ep.module import MoEModule, guard_conversions

__all__ = ["IMPLEMENTATION", "swap_experts", "experts_modules", "refusals", "save_pretrained", "close"]

IMPLEMENTATION = "moe_ep"  # the name moe_ep registers under in transformers' experts interface
_CHILD = "moe_ep"  # the MoEModule's attribute on an interface experts module
_WEIGHTS = ("gate_up_proj", "down_proj")
# Where a block, its router or its config say how many experts each token takes.
_TOPK_ATTRS = ("top_k", "num_experts_per_tok", "top_k_experts", "moe_topk", "moe_k", "num_experts_per_token")
# Blocks whose own forward moe_ep reproduces (the router's score scales the input before the experts).
_TOP1_SCALED_BLOCKS = ("Llama4TextMoe",)
# Class-name endings of MoE blocks: one with no experts module moe_ep recognises under it is refused by name.
_MOE_BLOCK_SUFFIXES = ("MoE", "Moe", "MoeBlock", "MoEBlock", "MoeLayer", "MoELayer")


def _interface():
    try:
        from transformers.integrations import moe as hf_moe
    except ImportError as e:
        raise IntegrationError("transformers", f"moe_ep.integrations.transformers needs transformers >= 5 (its "
                                               f"experts interface, transformers.integrations.moe): {e}") from e
    if IMPLEMENTATION not in hf_moe.ALL_EXPERTS_FUNCTIONS:
        hf_moe.ExpertsInterface.register(IMPLEMENTATION, _experts_forward)
    return hf_moe


def _experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts interface entry: the module's moe_ep layer, output in the hidden's dtype."""
    experts = getattr(self, _CHILD, None)
    if experts is None:
        raise IntegrationError(type(self).__name__, f"config._experts_implementation is {IMPLEMENTATION!r} but "
                                                     f"this experts module was not swapped (swap_experts(model))")
    return experts(hidden_states.contiguous(), top_k_index.contiguous(), top_k_weights.contiguous())


# -- what a module computes ------------------------------------------------------------------------------------
@dataclass
class _Site:
    """One place moe_ep serves: an interface experts module (kind "interface") or a block whose forward moe_ep
    reproduces (kind "top1_scaled"). `experts` holds gate_up_proj / down_proj in the layout the flags say."""

    name: str  # the experts module's path (the layer's name, for the watchdog and the ranks' agreement)
    kind: str
    experts: torch.nn.Module
    block: torch.nn.Module
    block_name: str
    num_experts: int
    hidden: int
    inter: int
    top_k: int
    clamp: Optional[float]
    transposed: bool  # gate_up_proj [E, H, 2I], down_proj [E, I, H]
    interleaved: bool  # gate/up rows alternate (gate j at 2j, up j at 2j+1)
    dtype: torch.dtype  # the experts' dtype in the model: what save_pretrained writes

    def canonical(self, rows: slice) -> Tuple[torch.Tensor, torch.Tensor]:
        """(w13 [n, 2I, H] gate rows first, w2 [n, H, I]) of experts `rows`, as the module holds them."""
        g = self.experts.gate_up_proj.detach()[rows]
        d = self.experts.down_proj.detach()[rows]
        if self.transposed:
            g, d = g.transpose(1, 2), d.transpose(1, 2)
        if self.interleaved:
            g = torch.cat((g[:, 0::2], g[:, 1::2]), dim=1)
        return g, d

    def layout(self, w13: torch.Tensor, w2: torch.Tensor) -> Dict[str, torch.Tensor]:
        """canonical() undone: the module's own tensors, in its names and dtype (for save_pretrained)."""
        if self.interleaved:
            w13 = torch.stack((w13[:, :self.inter], w13[:, self.inter:]), dim=2).reshape(w13.shape)
        if self.transposed:
            w13, w2 = w13.transpose(1, 2), w2.transpose(1, 2)
        prefix = f"{self.name}." if self.name else ""
        return {prefix + "gate_up_proj": w13.to(self.dtype).contiguous(),
                prefix + "down_proj": w2.to(self.dtype).contiguous()}


def _probe(inter: int = 64, rows: int = 48) -> torch.Tensor:
    """fp32 [rows, 2I] FC1 outputs (gate | up) over magnitudes 1e-3 .. 1e4, both signs: wide enough that a clamp,
    a shifted up, an alpha or another activation shows (a fixed seed: every rank probes alike)."""
    g = torch.Generator().manual_seed(0)
    mag = torch.exp(torch.empty(rows, 2 * inter).uniform_(math.log(1e-3), math.log(1e4), generator=g))
    sign = torch.randint(0, 2, (rows, 2 * inter), generator=g).float() * 2 - 1
    return mag * sign


def _gating(module, interleaved: bool) -> Tuple[Optional[float], Optional[str]]:
    """(the clamp, None) when the module's gating is moe_ep's SwiGLU with that clamp (None: no clamp), else
    (None, the reason). Evaluates the module's own `_apply_gate` (transformers' interface calls it on the FC1
    output) against moe_ep.reference.ffn.swiglu, for no clamp and for every clamp-like number the module holds."""
    from moe_ep.reference.ffn import swiglu

    fc1 = _probe()
    inter = fc1.shape[1] // 2
    arg = torch.stack((fc1[:, :inter], fc1[:, inter:]), dim=2).reshape(fc1.shape) if interleaved else fc1
    gate = getattr(module, "_apply_gate", None)
    act = getattr(module, "act_fn", None)
    what = (f"{type(module).__name__}._apply_gate" if getattr(type(module), "_apply_gate", None) is not None
            and getattr(type(module), "_apply_gate").__name__ != "_default_apply_gate"
            else f"act_fn {getattr(act, '__qualname__', type(act).__name__)}(gate) * up")
    if gate is None:
        return None, "no _apply_gate: not transformers' experts interface"
    try:
        with torch.no_grad():
            got = gate(arg.clone())
    except Exception as e:  # noqa: BLE001 - a gating that cannot run on fp32 rows is not one moe_ep computes
        return None, f"its gating ({what}) cannot be evaluated here ({type(e).__name__}: {e})"
    if not isinstance(got, torch.Tensor) or got.shape != (fc1.shape[0], inter):
        return None, f"its gating ({what}) does not map [T, 2I] to [T, I]"
    candidates = [None] + sorted({float(v) for k, v in vars(module).items()
                                  if ("limit" in k or "clamp" in k) and isinstance(v, (int, float))
                                  and not isinstance(v, bool) and math.isfinite(v) and v > 0})
    for clamp in candidates:
        if torch.allclose(got.float(), swiglu(fc1, clamp), rtol=1e-5, atol=1e-30):
            return clamp, None
    limits = f" or with a clamp at {candidates[1:]}" if len(candidates) > 1 else ""
    return None, (f"its gating ({what}) is not SiLU(gate) * up{limits}: moe_ep's kernels compute SiLU(gate) * up, "
                  f"optionally with gate = min(gate, L), up = clamp(up, -L, L)")


def _top_k(experts: torch.nn.Module, block: torch.nn.Module) -> Tuple[Optional[int], str]:
    """The top-k the block hands its experts, from the block, its router(s) and the config; (None, why) when
    they do not say or disagree."""
    found: Dict[str, int] = {}
    owners = [("block", block)] + [(f"block.{n}", c) for n, c in block.named_children() if c is not experts]
    cfg = getattr(experts, "config", None) or getattr(block, "config", None)
    if cfg is not None:
        owners.append(("config", cfg))
    for where, owner in owners:
        for attr in _TOPK_ATTRS:
            v = getattr(owner, attr, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                found[f"{where}.{attr}"] = v
    values = set(found.values())
    if len(values) == 1:
        return values.pop(), ""
    if not values:
        return None, (f"cannot tell top-k: neither the block, its router nor the config holds one of "
                      f"{list(_TOPK_ATTRS)}")
    return None, f"the block, its router and the config disagree on top-k: {found}"


def _extra_tensors(module: torch.nn.Module, keep=_WEIGHTS) -> List[str]:
    own = [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]
    return [n for n in own if n not in keep]


def _interface_site(name: str, m, block, block_name: str, world_size: int) -> Tuple[Optional[_Site], str]:
    cls = type(m).__name__
    if not getattr(m, "has_gate", True) or not isinstance(getattr(m, "gate_up_proj", None), torch.Tensor):
        return None, f"{cls} is not gated (up_proj, then an activation): moe_ep computes SiLU(gate) * up"
    if getattr(m, "has_bias", False):
        return None, f"{cls} adds expert biases (has_bias=True), which moe_ep does not compute"
    if getattr(m, "has_post_expert_norm", False):
        return None, f"{cls} normalises each expert's output (has_post_expert_norm=True), which moe_ep does not"
    extra = _extra_tensors(m)
    if extra:
        return None, f"{cls} holds expert tensors moe_ep would ignore: {extra}"
    transposed = bool(getattr(m, "is_transposed", False))
    interleaved = not getattr(m, "is_concatenated", True)
    clamp, why = _gating(m, interleaved)
    if why:
        return None, f"{cls}: {why}"
    return _geometry(name, "interface", m, block, block_name, transposed, interleaved, clamp, world_size)


def _geometry(name, kind, m, block, block_name, transposed, interleaved, clamp, world_size):
    cls = type(m).__name__
    g, d = m.gate_up_proj, m.down_proj
    if g.dim() != 3 or d.dim() != 3:
        return None, f"{cls}: gate_up_proj {list(g.shape)} / down_proj {list(d.shape)} are not stacked experts"
    if transposed:
        e, h, two_i = g.shape
        e2, i, h2 = d.shape
    else:
        e, two_i, h = g.shape
        e2, h2, i = d.shape
    if e != e2 or h != h2 or two_i != 2 * i:
        layout = "[E, H, 2I] / [E, I, H]" if transposed else "[E, 2I, H] / [E, H, I]"
        return None, (f"{cls}: gate_up_proj {list(g.shape)} and down_proj {list(d.shape)} are not {layout} of one "
                      f"expert set (e.g. identity or zero experts beside the routed ones)")
    k, why = _top_k(m, block)
    if k is None:
        return None, f"{cls}: {why}"
    if e % world_size:
        return None, f"{e} experts do not split over {world_size} ranks"
    return _Site(name, kind, m, block, block_name, e, h, i, k, clamp, transposed, interleaved, g.dtype), ""


def _top1_scaled_site(block_name: str, block, world_size: int) -> Tuple[Optional[_Site], str]:
    """Llama-4's text MoE: router(h) -> sigmoid scores of the top-k, each expert runs on h * score, the outputs
    add to the shared expert's. For top-1 that is expert(h * s) with weight 1: what moe_ep computes exactly."""
    m = getattr(block, "experts", None)
    cls = type(block).__name__
    if m is None or not hasattr(block, "router") or not hasattr(block, "shared_expert"):
        return None, f"{cls} has not the router / experts / shared_expert moe_ep reproduces"
    extra = _extra_tensors(m)
    if extra:
        return None, f"{type(m).__name__} holds expert tensors moe_ep would ignore: {extra}"
    act = getattr(m, "act_fn", None)
    x = _probe()
    try:
        with torch.no_grad():
            ok = act is not None and torch.allclose(act(x), x * torch.sigmoid(x), rtol=1e-5, atol=1e-30)
    except Exception:  # noqa: BLE001 - an activation that cannot run on fp32 is not SiLU
        ok = False
    if not ok:
        return None, f"{type(m).__name__}: act_fn {type(act).__name__} is not SiLU"
    site, why = _geometry(f"{block_name}.experts", "top1_scaled", m, block, block_name, True, False, None,
                          world_size)
    if site is not None and site.top_k != 1:
        return None, (f"{cls} scales each expert's input by its router score: exact on moe_ep for top-1 only, "
                      f"this model routes top-{site.top_k}")
    return site, why


def _looks_routed(name: str, m: torch.nn.Module) -> bool:
    """A module that holds routed experts whatever its layout: what a swap must either serve or refuse."""
    local = name.rpartition(".")[2]
    if local.startswith("shared"):
        return False  # shared experts are dense MLPs every token runs: the model keeps them
    cls = type(m).__name__
    return (local == "experts" or cls.endswith("Experts") or "ParallelExperts" in cls or "SparseMLP" in cls
            or hasattr(m, "is_concatenated"))


def _analyse(model: torch.nn.Module, world_size: int) -> Tuple[List[_Site], List[Tuple[str, str]]]:
    """(the sites moe_ep serves, [(module, why not)] for every routed-experts module it does not)."""
    modules = dict(model.named_modules())
    sites: List[_Site] = []
    refused: List[Tuple[str, str]] = []
    covered = set()
    for name, m in modules.items():
        if type(m).__name__ in _TOP1_SCALED_BLOCKS:
            site, why = _top1_scaled_site(name, m, world_size)
            covered.update(n for n in modules if n == name or n.startswith(name + "."))
            if site is None:
                refused.append((name, why))
            else:
                sites.append(site)
    for name, m in modules.items():
        if name in covered or not _looks_routed(name, m):
            continue
        parent_name = name.rpartition(".")[0]
        block = modules[parent_name] if name else model
        if hasattr(m, "is_concatenated") and hasattr(m, "config"):
            site, why = _interface_site(name, m, block, parent_name, world_size)
        else:
            site, why = None, (f"{type(m).__name__} is not transformers' experts interface "
                               f"(@use_experts_implementation): what its forward computes cannot be read")
        covered.update(n for n in modules if n == name or n.startswith(name + "."))
        if site is None:
            refused.append((name, why))
        else:
            sites.append(site)
    # An MoE block whose experts are none of the above (Doge's embedding experts): refused by its own name.
    for name, m in modules.items():
        if (type(m).__name__.endswith(_MOE_BLOCK_SUFFIXES) and name not in covered
                and not any(n.startswith(name + ".") for n in covered)):
            covered.update(n for n in modules if n == name or n.startswith(name + "."))
            refused.append((name, f"{type(m).__name__} holds its experts in a form moe_ep does not know (no "
                                  f"transformers experts module under it)"))
    refused.sort(key=lambda r: list(modules).index(r[0]))
    return sites, refused


def experts_modules(model: torch.nn.Module, world_size: int = 1) -> List[str]:
    """Names of the experts modules of `model` moe_ep would serve, in model order (empty if any is refused)."""
    sites, refused = _analyse(model, world_size)
    return [] if refused else [s.name for s in sites]


def refusals(model: torch.nn.Module, world_size: int = 1) -> List[Tuple[str, str]]:
    """[(module, reason)] for every routed-experts module of `model` moe_ep does not serve."""
    return _analyse(model, world_size)[1]


# -- the swap --------------------------------------------------------------------------------------------------
class _Top1ScaledMoE(torch.nn.Module):
    """Llama-4's text MoE block on moe_ep (top-1): the block's own router and shared expert, the routed expert on
    moe_ep with its input scaled by the router score, as the block does, and weight 1."""

    def __init__(self, block: torch.nn.Module, experts: MoEModule):
        super().__init__()
        self.hidden_dim = block.hidden_dim
        self.top_k = block.top_k
        self.num_experts = block.num_experts
        self.router = block.router
        self.shared_expert = block.shared_expert
        self.experts = experts

    def forward(self, hidden_states: torch.Tensor):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_scores, router_logits = self.router(hidden_states)
        idx = torch.topk(router_logits, 1, dim=1).indices  # the router's own choice (its topk, same input)
        routed_in = hidden_states * router_scores.gather(1, idx)  # in the block's dtype, as the block rounds it
        ones = torch.ones(idx.shape, dtype=torch.float32, device=idx.device)
        out = self.shared_expert(hidden_states)
        out.add_(self.experts(routed_in.contiguous(), idx.contiguous(), ones))
        return out, router_logits


@dataclass
class _Swapped:
    """What swap_experts changed in a model: its sites and their layers (save_pretrained, close)."""

    sites: List[_Site]
    layers: Dict[str, MoEModule]
    ctx: RankContext


def swap_experts(model: torch.nn.Module, *, group=None, device=None, backend: Optional[str] = None,
                 fmt: Optional[str] = None, max_tokens_per_rank: int = 256, chunking: str = "agree",
                 **layer_options) -> Dict[str, MoEModule]:
    """Collective: put every routed-experts module of `model` on an moe_ep layer over `group` (the default group
    if None), or refuse the whole model (IntegrationError naming the first module moe_ep does not serve and why)
    before any layer is built; returns {experts module name: MoEModule}. The model's other modules must already
    be on the layers' device (the group's: CPU for gloo, this rank's GPU for NCCL).

    backend / fmt: as for MoELayer. max_tokens_per_rank: each layer's capacity (its workspace); a forward with
    more tokens runs in capacity-sized chunks agreed across ranks (chunking="agree"; "strict" refuses it).
    layer_options: the rest of MoELayer's options (check_values, collective_checks, timeout_s, knobs, ...).
    Outputs come back in the hidden states' dtype; weights are held in the layer's format (bf16 copies of the
    model's experts, quantized by the backend for fp8/fp4 formats). The model's parameters no longer include
    the experts (MoEModule holds its weights in the backend's layout: docs/models.md)."""
    _interface()  # registers moe_ep in transformers' experts interface
    ctx = RankContext.from_group(group, device)
    box = []

    def plan():
        if getattr(model, "_moe_ep_swapped", None) is not None:
            raise IntegrationError("model", "this model's experts are already on moe_ep")
        sites, refused = _analyse(model, ctx.world_size)
        if refused:
            name, why = refused[0]
            more = f" (and {len(refused) - 1} more: {[n for n, _ in refused[1:4]]})" if len(refused) > 1 else ""
            raise IntegrationError(name or "model", why + more)
        if not sites:
            raise IntegrationError("model", f"{type(model).__name__} holds no routed experts module")
        for s in sites:
            if s.experts.gate_up_proj.device != ctx.device:
                raise IntegrationError(s.name, f"the model is on {s.experts.gate_up_proj.device}, the group's "
                                               f"layers on {ctx.device}: move the model there first")
        box.append(sites)

    run_agreed(ctx, plan, "model")  # every rank refuses together, before any layer is built
    sites = box.pop()
    modules = dict(model.named_modules())
    out: Dict[str, MoEModule] = {}
    n = None
    for s in sites:
        n = s.num_experts // ctx.world_size
        w13, w2 = s.canonical(slice(ctx.rank * n, (ctx.rank + 1) * n))
        weights = ExpertWeights(w13.to(ctx.device, torch.bfloat16, copy=True).contiguous(),
                                w2.to(ctx.device, torch.bfloat16, copy=True).contiguous(),
                                ctx.rank, ctx.world_size, s.num_experts)
        del w13, w2
        spec = MoESpec(hidden_size=s.hidden, intermediate_size=s.inter, num_experts=s.num_experts, top_k=s.top_k,
                       max_tokens_per_rank=max_tokens_per_rank, gate_up_clamp=s.clamp)
        layer = MoEModule(spec, weights, backend, group=ctx.group, device=ctx.device, fmt=fmt, chunking=chunking,
                          out_dtype="hidden", **dict(layer_options, name=s.name))
        del weights
        if s.kind == "interface":
            # transformers' experts interface: the module stays; its forward dispatches to ours.
            for w in _WEIGHTS:
                delattr(s.experts, w)  # the other ranks' experts (and ours: the layer holds its copy)
            s.experts.add_module(_CHILD, layer)
            s.experts.config._experts_implementation = IMPLEMENTATION
        else:
            parent_name, _, attr = s.block_name.rpartition(".")
            parent = modules[parent_name] if parent_name else model
            setattr(parent, attr, _Top1ScaledMoE(s.block, layer))
            for w in _WEIGHTS:
                delattr(s.experts, w)
        out[s.name] = layer
    model._moe_ep_swapped = _Swapped(sites, dict(out), ctx)
    _install(model)
    return out


def _install(model: torch.nn.Module) -> None:
    """After a swap: conversions checked on the whole model before any parameter changes (the model and every
    module above a layer), and save_pretrained writing transformers' own checkpoint."""
    guard_conversions(model)
    if hasattr(model, "save_pretrained"):
        model.save_pretrained = types.MethodType(_bound_save_pretrained, model)


def _bound_save_pretrained(self, save_directory, *args, **kwargs):
    return save_pretrained(self, save_directory, *args, **kwargs)


def save_pretrained(model: torch.nn.Module, save_directory, *args, is_main_process: Optional[bool] = None,
                    **kwargs):
    """Collective (every rank calls it, as transformers asks of distributed saves): the swapped model's checkpoint
    as transformers writes it -- every rank's experts gathered into the experts modules' own names, layout and
    dtype, the rest of the state as it is -- written by rank 0 (is_main_process, default rank == 0). Refused
    before anything is written (IntegrationError, on every rank) when a layer holds its experts in a quantized
    format: its values are neither the model's weights nor representable in its dtype."""
    state = getattr(model, "_moe_ep_swapped", None)
    if state is None:
        return type(model).save_pretrained(model, save_directory, *args, is_main_process=True
                                           if is_main_process is None else is_main_process, **kwargs)
    if kwargs.get("state_dict") is not None:
        raise IntegrationError("state_dict", "save_pretrained of a model on moe_ep builds its own state dict (its "
                                             "experts gathered from every rank); do not pass one")
    ctx = state.ctx

    def check():
        for s in state.sites:
            layer = state.layers[s.name]
            if format_info(layer.layer.fmt).quantized:
                raise IntegrationError(s.name, f"its moe_ep layer holds the experts in fmt {layer.layer.fmt!r}: "
                                               f"written in transformers' layout ({s.dtype}) they would be neither "
                                               f"the model's weights nor what moe_ep computes; save the model "
                                               f"before swap_experts, or swap with fmt='bf16'")

    run_agreed(ctx, check, "save_pretrained")
    experts: Dict[str, torch.Tensor] = {}
    for s in state.sites:
        qw = state.layers[s.name].layer.oracle_weights()
        w13 = all_gather_tensor(ctx, qw.w13_q.detach()).cpu()
        w2 = all_gather_tensor(ctx, qw.w2_q.detach()).cpu()
        experts.update(s.layout(w13, w2))
    main = ctx.rank == 0 if is_main_process is None else is_main_process
    if not main:
        return None
    sd = {k: v for k, v in model.state_dict().items()
          if not any(k.startswith(s.name + ".") for s in state.sites)}
    sd.update(experts)
    return type(model).save_pretrained(model, save_directory, *args, state_dict=sd, is_main_process=True, **kwargs)


def close(model: torch.nn.Module) -> None:
    """Collective: close every moe_ep layer in `model` (last first), releasing their workspace shares."""
    for m in reversed(list(model.modules())):
        if isinstance(m, MoEModule):
            m.close()
