"""transformers 5 MoE models on moe_ep: one call moves a model's routed experts onto moe_ep layers.

    import moe_ep
    from moe_ep.integrations.transformers import swap_experts

    ctx = moe_ep.init_from_env()                       # every rank: the same model, built or loaded alike
    model = AutoModelForCausalLM.from_pretrained(..., dtype=torch.bfloat16).to(ctx.device)
    swap_experts(model, max_tokens_per_rank=256)       # collective; each rank keeps only its experts
    model.generate(...)                                # every rank runs the same number of forwards

What moves: every experts module of the transformers 5 layout -- `gate_up_proj` [E, 2I, H] (gate rows, then up
rows) and `down_proj` [E, H, I], called as `experts(hidden [T, H], top_k_index [T, K], top_k_weights [T, K])` by
its MoE block, SiLU-gated, no bias, not transposed: Mixtral, Qwen3-MoE, DeepSeek-V3 and the architectures that
reuse their blocks. transformers' own experts interface (`@use_experts_implementation`: the module's forward
dispatches on `config._experts_implementation`) serves it: moe_ep registers itself there as "moe_ep", the module
keeps its name and place and gets an `moe_ep` child (a moe_ep.MoEModule); an experts module without that
interface but with the same layout and call is replaced in its block by an MoEModule. What stays: the block, its
router (softmax or sigmoid, group limit, bias, renormalisation, routed scaling: all before the experts call),
its shared experts, everything else in the model.

Expert parallelism over the process group: rank r of W keeps experts [r E/W, (r+1) E/W), copied (in bf16) from
the module's weights, which are then deleted, so each rank frees the other ranks' experts. Backend and format
are chosen as for MoELayer (backend=None picks by the device's arch; fmt=None the backend's default).

Every call of a layer is collective (docs/api.md): ranks must run the same number of forwards through the model
(generate with the same max_new_tokens and no early stop: eos_token_id=None, or min_new_tokens). Prompts and
batch sizes may differ per rank; a prefill longer than max_tokens_per_rank runs in agreed chunks
(chunking="agree", the default here).
"""

from __future__ import annotations

import inspect
from typing import Dict, List, Optional

import torch

from moe_ep.core.dist import RankContext, run_agreed
from moe_ep.core.spec import MoESpec
from moe_ep.core.weights import ExpertWeights
from moe_ep.errors import IntegrationError
from moe_ep.module import MoEModule

__all__ = ["IMPLEMENTATION", "swap_experts", "experts_modules", "close"]

IMPLEMENTATION = "moe_ep"  # the name moe_ep registers under in transformers' experts interface
_CHILD = "moe_ep"  # the MoEModule's attribute on an interface experts module
_CALL = ("hidden_states", "top_k_index", "top_k_weights")


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


def _why_not(module, hf_moe) -> Optional[str]:
    """None when moe_ep computes what this experts module computes, else the reason."""
    for flag, want in (("has_gate", True), ("has_bias", False), ("is_transposed", False), ("is_concatenated", True),
                       ("has_post_expert_norm", False)):
        if getattr(module, flag, want) != want:
            return f"{flag}={getattr(module, flag)} (moe_ep serves {flag}={want})"
    gate = getattr(type(module), "_apply_gate", None)
    if gate is not None and gate is not hf_moe._default_apply_gate:
        return f"{type(module).__name__} has its own gating ({gate.__qualname__}); moe_ep serves SiLU(gate) * up"
    act = getattr(getattr(module, "config", None), "hidden_act", "silu")
    if act not in ("silu", "swish"):
        return f"hidden_act={act!r} (moe_ep serves SiLU-gated experts)"
    return None


def experts_modules(model: torch.nn.Module) -> List[str]:
    """Names of the modules in `model` laid out as transformers 5 experts (gate_up_proj [E, 2I, H], down_proj
    [E, H, I], called with hidden_states, top_k_index, top_k_weights), in model order."""
    names = []
    for name, m in model.named_modules():
        g, d = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
        if not (isinstance(g, torch.Tensor) and isinstance(d, torch.Tensor) and g.dim() == 3 and d.dim() == 3):
            continue
        try:
            params = list(inspect.signature(m.forward).parameters)
        except (TypeError, ValueError):
            params = []
        if tuple(params[:3]) == _CALL or hasattr(m, "is_concatenated"):
            names.append(name)
    return names


def _top_k(module, name: str) -> int:
    for cfg in (getattr(module, "config", None),):
        k = getattr(cfg, "num_experts_per_tok", None)
        if isinstance(k, int) and k > 0:
            return k
    raise IntegrationError(name, "cannot tell top-k: the module's config has no num_experts_per_tok")


def swap_experts(model: torch.nn.Module, *, group=None, device=None, backend: Optional[str] = None,
                 fmt: Optional[str] = None, max_tokens_per_rank: int = 256, chunking: str = "agree",
                 **layer_options) -> Dict[str, MoEModule]:
    """Collective: put every experts module of `model` (experts_modules()) on an moe_ep layer over `group` (the
    default group if None); returns {module name: MoEModule}. The model's other modules must already be on the
    layers' device (the group's: CPU for gloo, this rank's GPU for NCCL).

    backend / fmt: as for MoELayer. max_tokens_per_rank: each layer's capacity (its workspace); a forward with
    more tokens runs in capacity-sized chunks agreed across ranks (chunking="agree"; "strict" refuses it).
    layer_options: the rest of MoELayer's options (check_values, collective_checks, timeout_s, knobs, ...).
    Outputs come back in the hidden states' dtype; weights are held in the layer's format (bf16 copies of the
    model's experts, quantized by the backend for fp8/fp4 formats)."""
    hf_moe = _interface()
    ctx = RankContext.from_group(group, device)
    names = experts_modules(model)
    modules = dict(model.named_modules())

    def plan():
        if not names:
            raise IntegrationError("model", f"{type(model).__name__} holds no transformers 5 experts module "
                                            f"(gate_up_proj [E, 2I, H] + down_proj [E, H, I])")
        for name in names:
            m = modules[name]
            reason = _why_not(m, hf_moe)
            if reason:
                raise IntegrationError(name, reason)
            e = m.gate_up_proj.shape[0]
            if e % ctx.world_size:
                raise IntegrationError(name, f"{e} experts do not split over {ctx.world_size} ranks")
            if m.gate_up_proj.device != ctx.device:
                raise IntegrationError(name, f"the model is on {m.gate_up_proj.device}, the group's layers on "
                                             f"{ctx.device}: move the model there first")
            _top_k(m, name)

    run_agreed(ctx, plan, "model")  # every rank refuses together, before any layer is built
    out: Dict[str, MoEModule] = {}
    for name in names:
        m = modules[name]
        g, d = m.gate_up_proj, m.down_proj
        e, two_i, h = g.shape
        n = e // ctx.world_size
        sl = slice(ctx.rank * n, (ctx.rank + 1) * n)
        weights = ExpertWeights(g.detach()[sl].to(ctx.device, torch.bfloat16, copy=True).contiguous(),
                                d.detach()[sl].to(ctx.device, torch.bfloat16, copy=True).contiguous(),
                                ctx.rank, ctx.world_size, e)
        spec = MoESpec(hidden_size=h, intermediate_size=two_i // 2, num_experts=e, top_k=_top_k(m, name),
                       max_tokens_per_rank=max_tokens_per_rank)
        experts = MoEModule(spec, weights, backend, group=ctx.group, device=ctx.device, fmt=fmt, chunking=chunking,
                            out_dtype="hidden", **dict(layer_options, name=name))
        del weights
        if hasattr(m, "is_concatenated") and hasattr(m, "config"):
            # transformers' experts interface: the module stays; its forward dispatches to ours.
            del m.gate_up_proj, m.down_proj  # the other ranks' experts (and ours: the layer holds its copy)
            m.add_module(_CHILD, experts)
            m.config._experts_implementation = IMPLEMENTATION
        else:
            parent_name, _, attr = name.rpartition(".")
            parent = modules[parent_name] if parent_name else model
            setattr(parent, attr, experts)
        out[name] = experts
    return out


def close(model: torch.nn.Module) -> None:
    """Collective: close every moe_ep layer in `model` (last first), releasing their workspace shares."""
    for m in reversed(list(model.modules())):
        if isinstance(m, MoEModule):
            m.close()
