"""Every MoE architecture of the installed transformers, tiny and random, through swap_experts: served within its
format's bound of transformers (moe_ep.testing.hf_models.compare_run: logits and 16 greedy tokens) or refused
with a typed error, never a silent difference. For the CPU model-matrix test and the GPU script
(tools/bench/model_matrix.py). Imports transformers lazily.

The architectures are read from transformers itself: every `transformers/models/<arch>/modeling_<arch>.py` that
decorates an experts class with `use_experts_implementation` or defines an experts / MoE class. Each gets one
model type: its text causal LM where it has one (the experts live in the text decoder), else its image-text-to-
text model run on text alone, else its base model (checked for the refusal only: there is nothing to generate).

Tiny configs are the architecture's default config shrunk by rule (hidden 128, 2-4 layers keeping one of each
layer type, 4 heads of 32, vocabulary 256, 8 experts of intermediate 128, top-2, initializer range 0.1 so logits
spread over ~1) plus the few per-architecture settings its defaults need to build at that size (_EXTRA: a
default that does not build at all, an attention-only layer pattern instead of a slow CPU linear-attention
fallback, an MoE block a default config leaves off). H and I are multiples of 128, so the same models run on the
FP8 and W4A8 kernels.
"""

from __future__ import annotations

import os
import re
from typing import Any, Dict, List, Optional, Tuple

import torch

__all__ = ["moe_architectures", "tiny_config", "tiny_model", "check_architecture", "run_matrix", "table",
           "verdict_problems", "SKIP_BUILD"]

_FIXED = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=256,
              max_position_embeddings=256, initializer_range=0.1, q_lora_rank=64, kv_lora_rank=32,
              qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32, qk_head_dim=32, n_group=2, topk_group=1,
              num_expert_group=2, tie_word_embeddings=False, d_model=128, n_heads=4)
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_TOPK = ("num_experts_per_tok", "moe_topk", "moe_k", "num_experts_per_token", "top_k_experts")
_LAYERS = ("num_hidden_layers", "n_layers", "num_layers")
_FULL2 = ["full_attention", "full_attention"]
_INDEXED = dict(layer_types=["indexed_attention"] * 2, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=32,
                indexer_budget=64, indexer_compress_ratio=4)
_MROPE = dict(rope_type="default", rope_theta=10000.0)
# What an architecture's defaults need at this size (see the module docstring); nested dicts reach sub-configs.
_EXTRA: Dict[str, Dict[str, Any]] = {
    "gemma4_text": dict(enable_moe_block=True, hidden_activation="gelu_pytorch_tanh"),
    "dbrx": dict(attn_config=dict(rope_theta=10000.0, kv_n_heads=2, clip_qkv=8.0),
                 ffn_config=dict(moe_num_experts=8, moe_top_k=2, ffn_hidden_size=128)),
    "granitemoehybrid": dict(layer_types=_FULL2),
    "jamba": dict(attn_layer_period=1, attn_layer_offset=0, expert_layer_period=1, expert_layer_offset=0),
    "lfm2_moe": dict(layer_types=_FULL2, num_dense_layers=0),
    "qwen4_exp_text": _INDEXED,
    "zaya": dict(num_experts_per_tok=1),
    "nemotron_h": dict(layers_block_type=["moe", "full_attention"], n_groups=1, ssm_state_size=16, chunk_size=16),
    "longcat_flash": dict(zero_expert_num=8),
    "llama4_text": dict(num_experts_per_tok=1),  # Llama-4 routes top-1 (served); top-2 is refused (a unit test)
    "qwen3_next": dict(layer_types=_FULL2),
    "qwen3_5_moe_text": dict(layer_types=_FULL2),
    "kimi_linear": dict(layer_types=_FULL2, mlp_layer_types=["sparse", "sparse"]),
    "bailing_hybrid": dict(layer_types=_FULL2),
    "dots3_note_text": dict(head_dim=32),  # its sliding-window head: qk_nope_head_dim + qk_rope_head_dim
    "mistral4": dict(head_dim=32),
    "ernie4_5_vl_moe": dict(text_config=dict(
        moe_intermediate_size=[128, 128], rope_parameters=dict(_MROPE, rope_theta=500000.0, mrope_section=[6, 6, 4]))),
    "deepseek_ocr2": dict(text_config=dict(mlp_layer_types=["dense", "sparse"])),
    "step3p7": dict(text_config=dict(sliding_window=64)),
    "qwen3_omni_moe_thinker": dict(vision_start_token_id=230),
    "glm4v_moe_text": dict(rope_parameters=dict(_MROPE, partial_rotary_factor=0.5, mrope_section=[2, 3, 3])),
    "hy_v4_vl_text": dict(rope_parameters=dict(_MROPE, mrope_section=[2, 3, 3])),
    "glm5_next_text": dict(qk_rope_head_dim=0, head_dim=0),  # its DSA layers have no rotary part
    "lara_mini": dict(layer_types=_FULL2),  # a third (linear-attention) MoE layer reroutes most positions
    "doge": dict(is_moe=True),  # its default config has no MoE
    "vitpose_backbone": dict(part_features=32, stage_names=["stem", "stage1", "stage2"], out_features=["stage2"],
                             out_indices=None),
}
# Architectures whose multimodal model does not run on text alone at this size: their text decoder (where the
# experts are) is checked instead, through its base model's hidden states.
_TEXT_DECODER = ("glm4v_moe", "glm5_next", "hy_v4_vl", "mistral_large4", "muse_spark", "qwen3_vl_moe")
# Architectures whose default config cannot be made tiny here: {arch: why} (reported, never silently dropped).
SKIP_BUILD: Dict[str, str] = {}


def moe_architectures() -> List[Tuple[str, Optional[str], str]]:
    """[(arch, model type or None, how it runs: "causal_lm" | "image_text" | "base" | "none")] for every MoE
    architecture of the installed transformers, read from its modeling sources (nothing imported)."""
    import transformers
    from transformers.models.auto import configuration_auto as ca, modeling_auto as ma

    root = os.path.join(os.path.dirname(transformers.__file__), "models")
    pattern = re.compile(r"use_experts_implementation|class \w*(Experts|MoE|Moe|SparseMLP)\w*\(")
    archs = []
    for arch in sorted(os.listdir(root)):
        src = os.path.join(root, arch, f"modeling_{arch}.py")
        if os.path.exists(src) and pattern.search(open(src, encoding="utf-8").read()):
            archs.append(arch)
    types_of: Dict[str, List[str]] = {}
    for mt in ca.CONFIG_MAPPING_NAMES:
        types_of.setdefault(ca.model_type_to_module_name(mt), []).append(mt)
    image_text = getattr(ma, "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", {})
    backbones = getattr(ma, "MODEL_FOR_BACKBONE_MAPPING_NAMES", {})
    out = []
    for arch in archs:
        mts = types_of.get(arch, [])
        causal = sorted((m for m in mts if m in ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
                        key=lambda m: (not m.endswith("_text"), m))
        text_base = [m for m in mts if m.endswith("_text") and m in ma.MODEL_MAPPING_NAMES]
        if causal:
            out.append((arch, causal[0], "causal_lm"))
        elif arch in _TEXT_DECODER and text_base:
            out.append((arch, text_base[0], "base"))
        elif any(m in image_text for m in mts):
            out.append((arch, next(m for m in mts if m in image_text), "image_text"))
        elif any(m in ma.MODEL_MAPPING_NAMES for m in mts):
            out.append((arch, next(m for m in mts if m in ma.MODEL_MAPPING_NAMES), "base"))
        elif any(m in backbones for m in mts):
            out.append((arch, next(m for m in mts if m in backbones), "backbone"))
        else:
            out.append((arch, None, "none"))
    return out


def _pick_layers(d: dict, n: int) -> List[int]:
    """Layer indices keeping one layer of every kind any per-layer list names (at most 4), in order."""
    idx = [0]
    for v in d.values():
        if isinstance(v, list) and len(v) == n and n > 2:
            for j, x in enumerate(v):
                if all(v[i] != x for i in idx) and len(idx) < 4:
                    idx.append(j)
    idx = sorted(idx)
    return idx if len(idx) > 1 else [0, 1]


def _shrink(d: dict) -> dict:
    out: Dict[str, Any] = {}
    n = next((d[k] for k in _LAYERS if isinstance(d.get(k), int) and not isinstance(d.get(k), bool)), None)
    if n:
        idx = _pick_layers(d, n)
        for k in _LAYERS:
            if isinstance(d.get(k), int):
                out[k] = len(idx)
        for k, v in d.items():
            if isinstance(v, list) and len(v) == n and n > 2:
                out[k] = [v[i] for i in idx]
    for k, v in d.items():
        if k in out or isinstance(v, bool):
            continue
        if k == "per_layer_config":
            out[k] = {}  # per-layer head sizes of the full model: this one has uniform layers
        elif isinstance(v, dict) and ("model_type" in v or k.endswith("_config")):
            out[k] = {**v, **_shrink(v)}
        elif k in _FIXED and (v is None or isinstance(v, (int, float))):
            out[k] = _FIXED[k] if v is not None or k == "head_dim" else None
        elif k in _EXPERTS and (v is None or isinstance(v, int)):
            out[k] = 8
        elif k in _TOPK and (v is None or isinstance(v, int)):
            out[k] = 2
        elif "vocab_size" in k and isinstance(v, int):
            out[k] = 256
        elif re.search(r"(intermediate_size|ffn_hidden_size|_ffn_dim)$", k) and (v is None or isinstance(v, int)):
            out[k] = 128
        elif re.search(r"head_dim$", k) and isinstance(v, int):
            out[k] = 32
        elif re.search(r"(num_attention_heads|_num_heads|n_heads)$", k) and isinstance(v, int):
            out[k] = 4
        elif re.search(r"(key_value_heads|_key_heads|_value_heads|kv_heads)$", k) and isinstance(v, int):
            out[k] = 2
        elif k.endswith("token_id") and isinstance(v, int) and v >= 200:
            out[k] = 200 + sum(map(ord, k)) % 50  # special tokens inside the tiny vocabulary, above the prompts'
        elif k in ("n_shared_experts", "num_shared_experts") and v is None:
            out[k] = 1
        elif k == "first_k_dense_replace" and isinstance(v, int):
            out[k] = min(v, 1)
        elif k == "decoder_sparse_step":
            out[k] = 1
        elif k == "mlp_only_layers":
            out[k] = []
    rope = d.get("rope_parameters")
    if isinstance(rope, dict) and isinstance(rope.get("mrope_section"), list):  # 3-D rope over a 32-wide head
        out["rope_parameters"] = {**rope, "mrope_section": [4, 6, 6][:len(rope["mrope_section"])]}
    if "qk_rope_head_dim" in d and "head_dim" in d:  # MLA: the rotary head is qk_rope_head_dim wide
        out["head_dim"] = out.get("qk_rope_head_dim", 16)
    if "kv_lora_rank" in d and "num_key_value_heads" in d:  # MLA: one key/value head per query head
        out["num_key_value_heads"] = out.get("num_attention_heads", 4)
    return out


def tiny_config(model_type: str, **overrides):
    """The model type's default config, shrunk (module docstring), with `overrides` (nested dicts merge)."""
    from transformers.models.auto import configuration_auto as ca

    cls = ca.CONFIG_MAPPING[model_type]
    o = _shrink(cls().to_dict())
    for k, v in {**_EXTRA.get(model_type, {}), **overrides}.items():
        o[k] = {**o.get(k, {}), **v} if isinstance(v, dict) and v and isinstance(o.get(k), dict) else v
    for sub in [o] + [x for x in o.values() if isinstance(x, dict)]:
        lt = sub.get("layer_types") or sub.get("layers_block_type")
        if isinstance(lt, list):
            for key in _LAYERS:
                if key in sub:
                    sub[key] = len(lt)
    return cls(**o)


def tiny_model(model_type: str, kind: str = "causal_lm", *, seed: int = 0, dtype=torch.bfloat16, device="cpu",
               **overrides):
    """A random model of `model_type` from its tiny config; the same weights on every rank for the same seed."""
    import transformers

    auto = {"causal_lm": transformers.AutoModelForCausalLM, "base": transformers.AutoModel,
            "image_text": transformers.AutoModelForImageTextToText, "backbone": transformers.AutoBackbone}[kind]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = auto.from_config(tiny_config(model_type, **overrides), dtype=dtype)
    return model.to(device).eval()


def check_architecture(arch: str, model_type: Optional[str], kind: str, *, group=None, backend=None, fmt=None,
                       new_tokens: int = 16, batch: int = 2, prompt_len: int = 10, capacity: int = 16, seed: int = 0,
                       logits_tol: Optional[float] = None, against: str = "transformers",
                       uneven: bool = False) -> Dict[str, Any]:
    """Collective over `group`: one architecture's tiny model, swap_experts, and the check of what it returns.
    Returns {arch, model_type, kind, status, ...}: "refused" with the typed error's type, argument and message;
    Every rank has its own prompts (seeded by rank); uneven: odd ranks one row fewer (the token counts differ).
    "served" with the check's numbers and `ok` (generative models: compare_run, logits and `new_tokens` greedy
    tokens; base models and backbones: one teacher-forced forward's outputs, positions whose routes moved
    excluded); "not_built" with why the tiny model could not be made or run (a gap in the matrix, reported)."""
    import moe_ep
    from moe_ep.core.dist import RankContext
    from moe_ep.integrations.transformers import close, experts_modules, swap_experts
    from moe_ep.testing import hf_models

    ctx = RankContext.from_group(group)
    row: Dict[str, Any] = dict(arch=arch, model_type=model_type, kind=kind, world_size=ctx.world_size,
                               rank=ctx.rank)
    if model_type is None or kind == "none" or arch in SKIP_BUILD:
        return dict(row, status="not_built", why=SKIP_BUILD.get(arch, "no model class for this architecture"))

    def build():
        return tiny_model(model_type, kind, seed=seed, device=ctx.device)

    try:
        model = build()
    except Exception as e:  # noqa: BLE001 - a config this matrix cannot shrink: reported, not hidden
        return dict(row, status="not_built", why=f"{type(e).__name__}: {str(e)[:300]}")
    if not experts_modules(model, ctx.world_size):  # refused (or no routed experts): the swap must say so
        try:
            swap_experts(model, group=group, backend=backend, fmt=fmt, max_tokens_per_rank=capacity)
        except moe_ep.errors.IntegrationError as e:
            return dict(row, status="refused", error=type(e).__name__, argument=e.argument, why=e.detail)
        close(model)
        return dict(row, status="served", ok=False, why="refusals() named modules but swap_experts served them")
    rows = max(1, batch - ctx.rank % 2) if uneven else batch
    ids = hf_models.prompt_ids(rows, prompt_len, seed=100 * seed + ctx.rank, device=ctx.device,
                               vocab=min(_vocab(model), 200))
    generative = kind in ("causal_lm", "image_text")
    run = (lambda m: hf_models.reference_run(m, ids, new_tokens)) if generative else (lambda m: _forward(m, ids))
    try:
        if against == "torch_reference":
            swap_experts(model, group=group, backend="torch_reference", fmt=fmt or _default_fmt(backend, ctx),
                         max_tokens_per_rank=capacity)
            ref = run(model)
            close(model)
            model = build()
        else:
            ref = run(model)
    except Exception as e:  # noqa: BLE001 - the tiny model does not run on text alone here: reported
        return dict(row, status="not_built", why=f"reference run: {type(e).__name__}: {str(e)[:300]}")
    swapped = swap_experts(model, group=group, backend=backend, fmt=fmt, max_tokens_per_rank=capacity)
    layer = next(iter(swapped.values())).layer
    row.update(status="served", layers=len(swapped), backend=layer.backend_name, fmt=layer.fmt, against=against,
               clamp=layer.spec.gate_up_clamp, top_k=layer.spec.top_k)
    tol = logits_tol if logits_tol is not None else (
        hf_models.same_format_tol(layer.fmt, layer.spec.intermediate_size) if against == "torch_reference"
        else hf_models.LOGITS_TOL.get(layer.fmt, 0.15))
    min_compared = 0.5 if against == "torch_reference" else hf_models.MIN_COMPARED.get(layer.fmt, 0.15)
    try:
        if generative:
            result = hf_models.compare_run(model, ref, new_tokens, logits_tol=tol, min_compared=min_compared)
        else:
            result = _compare_forward(model, ids, ref, tol, min_compared)
    except Exception as e:  # noqa: BLE001 - a served model whose check fails: a failed row, not a lost matrix
        result = dict(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
    finally:
        close(model)
    keep = ("ok", "prefill_rel_logits_err", "decode_rel_logits_err", "logits_tol", "compared_positions",
            "compared_steps", "steps", "near_ties")
    row.update({k: result[k] for k in keep if k in result})
    if "rows" in result:
        row["matched_tokens"] = [r["matched_tokens"] for r in result["rows"]]
    if not result["ok"]:
        row["detail"] = result
    return row


def _output(model, ids) -> torch.Tensor:
    out = model(ids)
    t = getattr(out, "logits", None)
    if t is None:
        t = getattr(out, "last_hidden_state", None)
    if t is None:
        t = out.feature_maps[-1] if hasattr(out, "feature_maps") else out[0]
    return t.float().cpu()


def _forward(model, ids) -> Dict[str, Any]:
    """One teacher-forced forward of a model that does not generate: its output and the routes it took."""
    from moe_ep.testing.hf_models import RouteRecorder

    rec = RouteRecorder(model)
    with rec, torch.no_grad():
        out = _output(model, ids)
    return dict(out=out, routes=rec.forwards()[0])


def _compare_forward(model, ids, ref, tol: float, min_compared: float) -> Dict[str, Any]:
    from moe_ep.testing.hf_models import _rerouted_tf

    got = _forward(model, ids)
    b, s = ids.shape
    stable = ~_rerouted_tf(ref["routes"], got["routes"], b, s)
    a, w = got["out"].reshape(b, s, -1), ref["out"].reshape(b, s, -1)
    rel = ((a - w).norm(dim=-1) / w.norm(dim=-1).clamp(min=1e-30))[stable]
    compared = float(stable.float().mean())
    err = float(rel.max()) if rel.numel() else None
    return dict(ok=bool(rel.numel() and err <= tol and compared >= min_compared), prefill_rel_logits_err=err,
                logits_tol=tol, compared_positions=compared)


def _vocab(model) -> int:
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return int(emb.weight.shape[0]) if emb is not None and hasattr(emb, "weight") else 256


def _default_fmt(backend, ctx) -> str:
    from moe_ep.testing.hf_models import _backend_format

    return _backend_format(backend, ctx.device)


def run_matrix(archs: Optional[List[str]] = None, *, threads: Optional[int] = 1, **kw) -> List[Dict[str, Any]]:
    """Rank side (tools/launch; collective): check_architecture for every architecture (or `archs`) at this
    launch's world size, in one process. threads: torch's intra-op threads (one: CI's cores are shared)."""
    import moe_ep

    if threads:
        torch.set_num_threads(threads)
    moe_ep.init_from_env()
    _quiet()
    rows = []
    for arch, mt, kind in moe_architectures():
        if archs is None or arch in archs:
            rows.append(check_architecture(arch, mt, kind, **kw))
    return rows


def verdict_problems(row: Dict[str, Any]) -> List[str]:
    """What is wrong with one matrix row: a served model outside its bound, a refusal that is not a typed
    IntegrationError naming a module, a model the matrix could not build. Empty when the row is as it must be."""
    status = row.get("status")
    if status == "served":
        return [] if row.get("ok") else [f"served but not within its bound: {row.get('detail', row)}"]
    if status == "refused":
        if row.get("error") != "IntegrationError" or not row.get("argument") or not row.get("why"):
            return [f"refused without a typed error naming a module: {row}"]
        return []
    return [f"not checked: {row.get('why')}"]


def table(rows: List[Dict[str, Any]]) -> str:
    """Markdown: one line per architecture (and world size / backend when the rows hold several)."""
    head = ("| architecture | model type | world | backend / fmt | verdict | rel. L2 of logits (prefill / decode) | "
            "bound | positions compared | greedy tokens matched | why |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        def num(k):
            v = r.get(k)
            return "-" if v is None else f"{v:.4f}"
        verdict = {"served": "served" if r.get("ok") else "**served, OUT OF BOUND**", "refused": "refused",
                   "not_built": "**not checked**"}.get(r["status"], r["status"])
        extra = []
        if r.get("clamp"):
            extra.append(f"clamp {r['clamp']:g}")
        if r["status"] == "served" and r.get("top_k") == 1 and r["arch"] == "llama4":
            extra.append("top-1, router score on the input")
        why = r.get("why", "; ".join(extra))
        compared = r.get("compared_positions")
        compared = "-" if compared is None else f"{compared:.0%}"
        lines.append(f"| {r['arch']} | {r['model_type']} | {r['world_size']} | "
                     f"{r.get('backend', '-')} / {r.get('fmt', '-')} | {verdict} | "
                     f"{num('prefill_rel_logits_err')} / {num('decode_rel_logits_err')} | {num('logits_tol')} | "
                     f"{compared} | "
                     f"{r.get('matched_tokens', '-')} | {str(why).replace('|', '/')[:160]} |")
    return "\n".join(lines)


def _quiet() -> None:
    import warnings

    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", module="transformers")
