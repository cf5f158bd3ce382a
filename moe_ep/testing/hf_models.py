"""Tiny random transformers MoE models built from configs (no downloads), and the check of a model on moe_ep
against its own implementation: logits and greedy generation. For the CPU tests, the GPU script and the main
job's --model mode. Imports transformers lazily (moe_ep.testing imports without it).

The check. Greedy-generate with the model's own experts (the reference), keeping the logits each step decided
on and every router's choice; then, with the experts on moe_ep, teacher-force the reference sequence (the
prefill path) and generate greedily (its prefill and its T=1 decode calls), recording the routers again.

Top-k routing is discontinuous: where a router's k-th and (k+1)-th scores nearly tie, the implementations' tiny
difference in an earlier layer's output can pick another expert in a later layer, and that token's logits (and
every later position's, through attention) then differ by far more than the format's error. Such positions are
counted as "rerouted", not compared. On every other position:
  (1) teacher-forced logits within the format's bound (relative L2); E is their largest |difference|;
  (2) each decode step's logits within the bound while the two runs' contexts and routes agree;
  (3) the generated tokens are the reference's, token for token, up to the first near-tie, a step whose top-1
      minus top-2 logit gap is <= 2 E (only there can an error of E swap the two), or the first rerouted step.
A divergence at a larger gap fails: moe_ep's decode path then errs by more than its prefill path. Most positions
must be comparable (min_compared): a wrong expert would reroute nearly everything, not go unchecked.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, Optional

import torch

__all__ = ["ARCHS", "tiny_config", "tiny_model", "greedy", "RouteRecorder", "reference_run", "compare_run",
           "prompt_ids"]

ARCHS = ("mixtral", "qwen3_moe", "deepseek_v3")

# Small dims, the real block structure: 8 experts, top-2, 2 decoder layers (DeepSeek-V3: the first dense, as its
# first_k_dense_replace keeps; group-limited sigmoid routing with 2 groups, a shared expert, routed scaling 2.5).
# initializer_range 0.1 (instead of 0.02) spreads the logits (std ~1) so most top-2 gaps are well above bf16 noise.
# H 256 and I 128: multiples of 128 (the FP8 block format's rule), the geometry the Hopper GPU suites run.
_COMMON = dict(vocab_size=256, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=256, initializer_range=0.1, tie_word_embeddings=False)
_TINY: Dict[str, Dict[str, Any]] = {
    "mixtral": dict(intermediate_size=128, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2),
    "qwen3_moe": dict(intermediate_size=256, moe_intermediate_size=128, num_key_value_heads=2, head_dim=32,
                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
    "deepseek_v3": dict(intermediate_size=256, moe_intermediate_size=128, first_k_dense_replace=1,
                        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                        routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=64, qk_rope_head_dim=16,
                        qk_nope_head_dim=16, v_head_dim=32, num_key_value_heads=4),
}


def tiny_config(arch: str, **overrides):
    import transformers

    if arch not in _TINY:
        raise ValueError(f"arch must be one of {list(ARCHS)}, got {arch!r}")
    cls = {"mixtral": transformers.MixtralConfig, "qwen3_moe": transformers.Qwen3MoeConfig,
           "deepseek_v3": transformers.DeepseekV3Config}[arch]
    return cls(**{**_COMMON, **_TINY[arch], **overrides})


def tiny_model(arch: str, *, seed: int = 0, dtype=torch.bfloat16, device="cpu", **overrides):
    """A random model of `arch` from its tiny config; the same weights on every rank for the same seed."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), dtype=dtype)
    return model.to(device).eval()


def greedy(model, ids: torch.Tensor, new_tokens: int, with_logits: bool = False):
    """Greedy generation of exactly `new_tokens` tokens (no early stop: every rank makes the same calls); with
    with_logits, also the raw logits each step chose from ([B, new_tokens, V], fp32). The model's own generation
    config is set aside while it runs: generate() fills a config's unset fields from it, an EOS token included, and
    a rank whose row emitted it would stop early and leave the others waiting in a layer call."""
    cfg = copy.deepcopy(model.generation_config)
    cfg.eos_token_id = None
    cfg.pad_token_id = 0
    cfg.do_sample = False
    cfg.max_new_tokens = new_tokens
    cfg.min_new_tokens = None
    own = model.generation_config
    model.generation_config = cfg
    try:
        with torch.no_grad():
            if not with_logits:
                return model.generate(ids, generation_config=cfg)
            out = model.generate(ids, generation_config=cfg, output_logits=True, return_dict_in_generate=True)
    finally:
        model.generation_config = own
    return out.sequences, torch.stack([x.float() for x in out.logits], dim=1)


class RouteRecorder:
    """Records the experts each token was routed to (sorted ids per token) at every routed-experts call of the
    model, grouped per model forward, in call order. It reads the ids where the experts get them: the top_k_index
    argument of every experts module of transformers' interface (the same module before and after a swap), and
    the router's choice in a block moe_ep reproduces whole (Llama-4's: top-k of the router's logits)."""

    def __init__(self, model):
        from moe_ep.integrations import transformers as it

        self.model = model
        self.sources = []
        for m in model.modules():
            if hasattr(m, "is_concatenated") and hasattr(m, "config"):
                self.sources.append(("experts", m, None))
            elif type(m).__name__ in it._TOP1_SCALED_BLOCKS or isinstance(m, it._Top1ScaledMoE):
                self.sources.append(("router", m.router, m.top_k))
        self.calls = []
        self._forward = -1
        self._hooks = []

    def _record(self, ids: torch.Tensor, weights: torch.Tensor) -> None:
        ids = ids.detach().reshape(-1, ids.shape[-1])
        srt, order = ids.sort(dim=-1)
        w = weights.detach().reshape(ids.shape).float().gather(1, order)
        self.calls.append((self._forward, torch.cat((srt.float(), w), dim=-1).cpu()))

    def __enter__(self):
        self.calls = []
        self._forward = -1

        def on_model(module, args, kwargs):
            self._forward += 1

        def on_experts(module, args, kwargs):
            ids = kwargs.get("top_k_index", args[1] if len(args) > 1 else None)
            w = kwargs.get("top_k_weights", args[2] if len(args) > 2 else None)
            if isinstance(ids, torch.Tensor) and isinstance(w, torch.Tensor):
                self._record(ids, w)

        def on_router(k):
            def hook(module, args, out):
                idx = torch.topk(out[1], k, dim=-1).indices
                self._record(idx, out[0].gather(1, idx))
            return hook

        self._hooks = [self.model.register_forward_pre_hook(on_model, with_kwargs=True)]
        for what, m, k in self.sources:
            self._hooks.append(m.register_forward_pre_hook(on_experts, with_kwargs=True) if what == "experts"
                               else m.register_forward_hook(on_router(k)))
        return self

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        return False

    def forwards(self):
        """[[(sorted ids | their weights) [tokens, 2K] per routed-experts call] per model forward]."""
        out = [[] for _ in range(self._forward + 1)]
        for f, ids in self.calls:
            out[f].append(ids)
        return out


def reference_run(model, ids: torch.Tensor, new_tokens: int) -> Dict[str, Any]:
    """The model's own greedy sequence, the logits each step decided on, the teacher-forced logits of the whole
    sequence (fp32, on the CPU) and the routes of both runs."""
    rec = RouteRecorder(model)
    with rec:
        seq, steps = greedy(model, ids, new_tokens, with_logits=True)
    gen_routes = rec.forwards()
    with rec, torch.no_grad():
        logits = model(seq).logits.float().cpu()
    return {"prompt": ids.cpu(), "seq": seq.cpu(), "steps": steps.cpu(), "logits": logits,
            "gen_routes": gen_routes, "tf_routes": rec.forwards()[0]}


# Some routers' weights jump, not only their ids: PhiMoE's sparsemixer masks experts whose logit is a threshold
# below the top one, so a token near that threshold gets weight 1 or 0.5 for the same experts (a relative move of
# 0.5). A position whose routing weights moved by more than half that counts as rerouted, like one whose experts
# changed. Smooth routers (softmax, sigmoid) move theirs by about the input's own difference: under 1 % in bf16, but
# up to ~10-20 % downstream of an FP8 or W4A8 layer whose top-2 scores nearly tie; a bound of 0.05 called 90-98 % of
# Mixtral's and Qwen3's positions "rerouted" there (FP8 against transformers, CPU and the H200 alike) and so left
# them unchecked, which the min_compared rule then failed.
ROUTE_WEIGHT_JUMP = 0.25


def _route_changed(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[tokens] bool: other experts, or weights that jumped (x, y: [tokens, 2K] ids | weights)."""
    k = x.shape[-1] // 2
    ids = (x[:, :k] != y[:, :k]).any(dim=-1)
    wx, wy = x[:, k:], y[:, k:]
    jump = ((wx - wy).abs() > ROUTE_WEIGHT_JUMP * torch.maximum(wx.abs(), wy.abs()).clamp(min=1e-6)).any(dim=-1)
    return ids | jump


def _rerouted_tf(a, b, batch: int, length: int) -> torch.Tensor:
    """[B, S] bool: some router chose other experts (or jumped its weights) at this position or an earlier one of
    its row."""
    diff = torch.zeros(batch, length, dtype=torch.bool)
    if len(a) != len(b):
        return ~diff
    for x, y in zip(a, b):
        diff |= _route_changed(x, y).reshape(batch, length)
    return diff.cummax(dim=1).values


def _rerouted_from(a, b, batch: int, prompt_len: int, new_tokens: int) -> torch.Tensor:
    """[B] the first decode step whose logits a route change reached (new_tokens if none): a change in the prefill
    reaches step 0; one in forward c (the token of step c - 1) reaches step c."""
    first = torch.full((batch,), new_tokens, dtype=torch.long)
    for c, (fa, fb) in enumerate(zip(a, b)):
        if c >= new_tokens:
            break
        changed = torch.zeros(batch, dtype=torch.bool)
        if len(fa) != len(fb):
            changed |= True
        for x, y in zip(fa, fb):
            if x.shape != y.shape:
                changed |= True
                continue
            changed |= _route_changed(x, y).reshape(batch, -1).any(dim=1)
        first = torch.where(changed & (first == new_tokens), torch.full_like(first, c), first)
    return first


def compare_run(model, ref: Dict[str, Any], new_tokens: int, *, logits_tol: float,
                min_compared: float = 0.5) -> Dict[str, Any]:
    """Check `model` (its experts on moe_ep) against `ref` (reference_run of the same model before the swap)."""
    prompt, seq, ref_logits, ref_steps = ref["prompt"], ref["seq"], ref["logits"], ref["steps"]
    device = next(model.parameters()).device
    rec = RouteRecorder(model)
    with rec, torch.no_grad():
        got_logits = model(seq.to(device)).logits.float().cpu()
    tf_routes = rec.forwards()[0]
    with rec:
        got_seq, got_steps = greedy(model, prompt.to(device), new_tokens, with_logits=True)
    gen_routes = rec.forwards()
    got_seq, got_steps = got_seq.cpu(), got_steps.cpu()
    batch, n0 = prompt.shape

    def rel(a, b):
        return (a - b).norm(dim=-1) / b.norm(dim=-1).clamp(min=1e-30)

    rerouted = _rerouted_tf(ref["tf_routes"], tf_routes, batch, seq.shape[1])
    stable = ~rerouted
    tf_rel = rel(got_logits, ref_logits)[stable]
    err = float((got_logits - ref_logits).abs().amax(dim=-1)[stable].max()) if stable.any() else float("inf")
    reached = _rerouted_from(ref["gen_routes"], gen_routes, batch, n0, new_tokens)
    top2 = ref_steps.topk(2, dim=-1).values
    gap = top2[..., 0] - top2[..., 1]  # [B, N]: what each reference step decided by
    near_tie = gap <= 2 * err
    step_rel = rel(got_steps, ref_steps)  # [B, N]
    rows = []
    decode_err, compared_steps = 0.0, 0
    ok = bool(tf_rel.numel() and tf_rel.max() <= logits_tol)
    for b in range(batch):
        mismatch = (got_seq[b, n0:] != seq[b, n0:]).nonzero()
        first = int(mismatch[0]) if mismatch.numel() else None
        upto = min(new_tokens if first is None else first + 1, int(reached[b]))  # same context, same routes
        if upto:
            decode_err = max(decode_err, float(step_rel[b, :upto].max()))
        compared_steps += upto
        row_ok = first is None or first >= int(reached[b]) or bool(near_tie[b, first])
        ok &= row_ok
        rows.append(dict(first_divergence=first, gap_there=None if first is None else float(gap[b, first]),
                         rerouted_from_step=int(reached[b]), ok=row_ok,
                         matched_tokens=new_tokens if first is None else first))
    compared = float(stable.float().mean())
    ok &= decode_err <= logits_tol and compared >= min_compared
    return dict(ok=ok, prefill_rel_logits_err=float(tf_rel.max()) if tf_rel.numel() else None,
                prefill_abs_logits_err=err, decode_rel_logits_err=decode_err, logits_tol=logits_tol,
                compared_positions=compared, compared_steps=compared_steps, near_tie_gap=2 * err,
                near_ties=int(near_tie.sum()), steps=int(gap.numel()), rows=rows,
                ref_tokens=seq[:, n0:].tolist(), moe_ep_tokens=got_seq[:, n0:].tolist())


def prompt_ids(batch: int, length: int, seed: int, vocab: int = 256, device=None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (batch, length), generator=g).to(device or "cpu")


# Bounds on the teacher-forced / decode logits, relative L2 per position, by the layer's format, against the
# model's own bf16 experts. bf16: the two implementations' rounding (0.7-1.5 % measured on these models on the
# CPU). fp8_block: the weights and the FC1/FC2 inputs in e4m3 with 128-wide block scales lose up to 2^-4 relative
# per element (3 mantissa bits), about 2.5-3 % RMS for these Gaussian-like values; the MoE output then errs by
# ~4-5 % (weights and activations together), adds into a residual stream of comparable size in every MoE layer,
# and the logits measured 6.8-7.6 % off (torch reference in fp8_block on the CPU, which stages and quantizes as
# the kernel does); on the H200 the FP8 kernel's logits measured 6.3-10.8 % off (Mixtral 10.8 %, 2026-12-01:
# the kernel's FC2-input requantization rounds from its own fp32 sums, so some e4m3 codes land one step from the
# reference's): 0.15 leaves room for that and still catches a wrong expert or a lost scale (tens of percent).
# Against moe_ep's own torch reference in the same format (the same bytes in, only the accumulation order differs):
# bf16's rounding bound, and for FP8 the oracle's per-token rule max(0.03, 0.75/sqrt(I)) -- one e4m3 step of
# the FC2 input (2^-4 relative) flipped by a different fp32 sum weighs about 1/sqrt(I) of a row (measured on the
# H200: Qwen3-MoE 3.9 % at I=128, where the rule gives 6.6 %).
LOGITS_TOL = {"bf16": 3e-2, "fp8_block": 0.15}


def same_format_tol(fmt: str, intermediate_size: int) -> float:
    """The bound against moe_ep's torch reference in the same format (see LOGITS_TOL's comment)."""
    from moe_ep.reference.oracle import kernel_row_tolerance

    return 3e-2 if fmt == "bf16" else kernel_row_tolerance(fmt, intermediate_size)


# A perturbation of E reroutes the tokens whose router gaps are below it: FP8's larger error reroutes 30-80 % of
# the positions of these tiny random models (8 experts, small router gaps; Qwen3-MoE on the H200 kept 20 %
# comparable), bf16's a few: the share of positions that must stay comparable, by format.
MIN_COMPARED = {"bf16": 0.5}


def run_model_check(arch: str = "deepseek_v3", *, new_tokens: int = 16, batch: int = 2, prompt_len: int = 12,
                    seed: int = 0, backend: Optional[str] = None, fmt: Optional[str] = None,
                    capacity: int = 16, against: str = "transformers", dtype: str = "bfloat16",
                    logits_tol: Optional[float] = None) -> Dict[str, Any]:
    """Rank side (tools/launch; collective): a tiny model of `arch` on this rank's device, the reference run, then
    its experts on moe_ep (`backend`, `fmt`; expert parallel over the default group) and compare_run. The
    reference is the model's own experts (against="transformers") or moe_ep's torch reference backend in the same
    format (against="torch_reference": the same quantized bytes, so what is left is the kernel's own error).
    dtype: the model's ("bfloat16" or "float32": its hidden states then reach moe_ep in fp32, its experts are held in
    bf16). Each rank has its own prompts (seeded by rank) and batch size (batch - rank % 2: the ranks' token counts
    differ). `compared_steps` says how many decode steps were compared (a prompt position rerouted early takes
    its whole row out): a caller checking several runs wants a good share of them compared."""
    import moe_ep
    from moe_ep.integrations.transformers import close, swap_experts

    if against not in ("transformers", "torch_reference"):
        raise ValueError(f"against must be 'transformers' or 'torch_reference', got {against!r}")
    ctx = moe_ep.init_from_env()
    dt = getattr(torch, dtype)
    model = tiny_model(arch, device=ctx.device, dtype=dt)
    ids = prompt_ids(max(1, batch - ctx.rank % 2), prompt_len, seed=100 * seed + ctx.rank, device=ctx.device,
                     vocab=model.config.vocab_size)
    if against == "torch_reference":
        first = swap_experts(model, backend="torch_reference", fmt=fmt or _backend_format(backend, ctx.device),
                             max_tokens_per_rank=capacity)
        del first
        ref = reference_run(model, ids, new_tokens)
        close(model)
        model = tiny_model(arch, device=ctx.device, dtype=dt)
    else:
        ref = reference_run(model, ids, new_tokens)
    swapped = swap_experts(model, backend=backend, fmt=fmt, max_tokens_per_rank=capacity)
    layer = next(iter(swapped.values())).layer
    tol = logits_tol if logits_tol is not None else (
        same_format_tol(layer.fmt, layer.spec.intermediate_size) if against == "torch_reference"
        else LOGITS_TOL.get(layer.fmt, 0.15))
    min_compared = 0.5 if against == "torch_reference" else MIN_COMPARED.get(layer.fmt, 0.15)
    try:
        result = compare_run(model, ref, new_tokens, logits_tol=tol, min_compared=min_compared)
    finally:
        close(model)
    result.update(rank=ctx.rank, world_size=ctx.world_size, arch=arch, backend=layer.backend_name, fmt=layer.fmt,
                  against=against, device=str(ctx.device), layers=len(swapped), prompts=ids.cpu().tolist())
    return result


def _backend_format(backend: Optional[str], device) -> str:
    from moe_ep.core import registry

    entry = (registry.select_backend(registry.detect_arch(device)) if backend in (None, "auto")
             else registry.get_entry(backend))
    return entry.default_format
