"""The audit's numerical check: the layouts the shim prepares, fed to the drop's own CPU references, on the CPU.

A drop can change what a kernel computes while every signature stays and every kernel still compiles: a gate/up
interleave, a scale-block size, the W4A8 converter's exponent window. The shim mirrors each of those in how it lays
out weights and stages activations. So, in a build child (one candidate tree, tools/drop/build_child.py), on a small
random problem, the frontend a layer would build lays out the weights and stages the activations, and:

  * fp8_block, fp8_tensor, bf16 (Hopper): the drop's own reference (moe_hopper_fp8.mega_reference_fp8,
    moe_hopper_bf16.mega_reference_bf16, which import cleanly on a CPU host; through shim/sm90/kernel_symbols, the
    one place that names the tree's symbols) runs on the kernel's tensors as the
    shim hands them over, and moe_ep's oracle (moe_ep.reference.oracle) on the canonical weights read back from
    them; each token's output must agree within moe_ep's bound for a kernel against its oracle
    (kernel_row_tolerance);
  * w4a8_mxfp4 (Hopper): the drop ships no reference; the kernel's read path is run instead, its converter taken
    from the candidate tree's own asm (tools/drop/ptx.py) over the bytes and folded offsets the shim packed: the
    operand it makes times the shim's residual must be, exactly, the weight moe_ep's reference multiplies.

Blackwell's references check that their inputs live on a GPU (moe_nvfp4_swapab.mega_reference), so its formats are
not checked here. The problem is fixed (seeded): the same tree and shim give the same verdict, which is what the
build stage's cache keys on.
"""

from __future__ import annotations

import inspect
import os
from typing import Callable, Dict, Optional, Tuple

__all__ = ["CHECKS", "GEOMETRY", "TOKENS", "check"]

# Hopper's size rules (multiples of 128) at their smallest, two experts per token.
GEOMETRY = {"hidden_size": 256, "intermediate_size": 256, "num_experts": 4, "top_k": 2}
TOKENS = 16
SEED = 20261202


class Mismatch(Exception):
    """The drop's numbers differ from moe_ep's for the shim's layout: (message, shim site, drop site)."""

    def __init__(self, message: str, shim_site: Optional[str], drop_site: Optional[str]):
        super().__init__(message)
        self.shim_site, self.drop_site = shim_site, drop_site


def _site(obj, root: str) -> Optional[str]:
    """'rel/path.py:line' of a function or class, relative to `root`."""
    try:
        path = os.path.realpath(inspect.getsourcefile(obj))
        line = inspect.getsourcelines(obj)[1]
    except (TypeError, OSError):
        return None
    return f"{os.path.relpath(path, root)}:{line}"


def _problem(fe):
    """Seeded weights, tokens and routing for frontend `fe`'s geometry, laid out and staged by the frontend."""
    import torch

    from moe_ep.core.weights import ExpertWeights

    g = torch.Generator().manual_seed(SEED)
    e, h, i, k, t = fe.experts_per_rank, fe.hidden_size, fe.intermediate_size, fe.top_k, TOKENS
    w13 = (torch.randn(e, 2 * i, h, generator=g) * h ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, generator=g) * i ** -0.5).to(torch.bfloat16)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    tw = torch.rand(t, k, generator=g)
    # The static scales of fp8_tensor come from calibration: this problem's own amax (SwiGLU out stays near 1).
    weights = ExpertWeights(w13=w13, w2=w2, rank=0, world_size=1, num_experts=e, act_amax=float(x.abs().max()),
                            fc2_act_amax=4.0)
    kw = fe.load_weights(weights)
    fe.topk_idx[:t].copy_(idx)
    fe.topk_w[:t].copy_(tw)
    fe.stage_activations(x)
    return kw, idx, tw


def _compare(fmt: str, out, ref, intermediate: int, what: str, shim_site, drop_site) -> None:
    import torch

    from moe_ep.reference.oracle import kernel_row_tolerance

    o, r = out.to(torch.float32), ref.to(torch.float32)
    err = ((o - r).norm(dim=1) / r.norm(dim=1).clamp(min=1e-30))
    tol = kernel_row_tolerance(fmt, intermediate)
    worst = float(err.max())
    if not worst <= tol:
        raise Mismatch(f"{what} and moe_ep's oracle disagree on the shim's layout: worst token's relative error "
                       f"{worst:.3g} (bound {tol:.3g}, {int((err > tol).sum())} of {len(err)} tokens over it): the "
                       "drop computes something else than the shim lays out for", shim_site, drop_site)


def _oracle(fe, idx, tw):
    from moe_ep.reference.oracle import oracle_forward

    return oracle_forward(fe.weights.canonical(), fe.staged_activation(TOKENS), idx, tw,
                          gate_up_clamp=fe.spec.gate_up_clamp)


def _hopper_fp8(fe, repo: str, tree: str) -> None:
    import torch

    compute_megamoe_reference_fp8 = fe.symbols().compute_megamoe_reference_fp8

    kw, idx, tw = _problem(fe)
    t, h = TOKENS, fe.hidden_size
    passed = fe.format_kwargs(fe.knobs)  # the scale and accumulation modes the frontend hands the kernel
    common = dict(input_topk_idx=idx[None], input_topk_weights=tw[None], fc1_weight=kw.fc1[None],
                  fc1_weight_sf=kw.fc1_scale[None], fc2_weight=kw.fc2[None], fc2_weight_sf=kw.fc2_scale[None],
                  ab_dtype=torch.float8_e4m3fn, gate_up_clamp=fe.spec.gate_up_clamp,
                  fp8_accum_mode=passed["fp8_accum_mode"], fp8_scale_mode=passed["fp8_scale_mode"])
    if passed["fp8_scale_mode"] == "blockwise":
        out = compute_megamoe_reference_fp8(input_activation=fe.act[:t][None],
                                            input_activation_sf=fe.act_sf[:t, : h // 128][None], **common)
    else:
        out = compute_megamoe_reference_fp8(input_activation=fe.act[:t][None], input_activation_sf=fe.act_sf[:t][None],
                                            fc1_activation_dequant_scale=kw.fc1_act_dequant,
                                            fc1_weight_dequant_scale=kw.fc1_w_dequant[None],
                                            fc2_activation_dequant_scale=kw.fc2_act_dequant,
                                            fc2_weight_dequant_scale=kw.fc2_w_dequant[None], **common)
    _compare(fe.fmt, _terms(out).sum(1), _oracle(fe, idx, tw), fe.intermediate_size,
             "moe_hopper_fp8.mega_reference_fp8", _site(type(kw).store, repo),
             _site(compute_megamoe_reference_fp8, tree))


def _terms(out):
    """The reference's per-(token, slot) terms [T, K, H] (rank 0), in fp32 as the kernels' top-k reduce adds them."""
    import torch

    out = out[0] if isinstance(out, tuple) else out
    return out[0].to(torch.float32)


def _hopper_bf16(fe, repo: str, tree: str) -> None:
    compute_megamoe_reference_bf16 = fe.symbols().compute_megamoe_reference_bf16

    kw, idx, tw = _problem(fe)
    out = compute_megamoe_reference_bf16(fe.act[:TOKENS][None], idx[None], tw[None], kw.fc1[None], kw.fc2[None],
                                         gate_up_clamp=fe.spec.gate_up_clamp)
    _compare(fe.fmt, _terms(out).sum(1), _oracle(fe, idx, tw), fe.intermediate_size,
             "moe_hopper_bf16.mega_reference_bf16", _site(type(kw).store, repo),
             _site(compute_megamoe_reference_bf16, tree))


# ---- W4A8: the kernel's read path over the shim's bytes, the converter from the drop's asm -------------------------

CONVERTER = ("moe_hopper_fp8.mxfp4_cutedsl", "convert_mxfp4_pair_preprocessed_signs")


def _word(row, col: int) -> int:
    return int(row[col]) | int(row[col + 1]) << 8 | int(row[col + 2]) << 16 | int(row[col + 3]) << 24


def kernel_operand(convert: Callable[[int, int, int, int], Tuple[int, ...]], packed, folded):
    """One expert's packed bytes [N, K/2] and folded offsets [N/64, K/128, 16, 16] -> the e4m3 operand [N, K] the
    WGMMAs see (float32): per warp and lane, LDSM x4 of the [N, K/2] bytes as an FP8 A fragment (rows g, g + 8;
    byte columns 4t, 16 + 4t), `convert` on each register pair with the row's offsets read through
    make_expanded_offset_view's strides, the words placed into the e4m3 A fragment of [N, K]."""
    import torch

    n, k2 = packed.shape
    k = 2 * k2
    out = torch.zeros((n, k), dtype=torch.uint8)
    rows = packed.tolist()
    flat = folded.reshape(-1).tolist()

    def offset(row: int, k_group: int) -> int:
        m64, r64 = divmod(row, 64)
        s, r = divmod(r64, 16)
        k128, q = divmod(k_group, 4)
        return int(flat[(m64 * (k // 128) + k128) * 256 + 16 * r + 4 * s + q])

    for m0 in range(0, n, 64):
        for warp in range(4):
            for lane in range(32):
                g, t = divmod(lane, 4)
                r0 = m0 + 16 * warp + g
                for hk in range(k // 64):
                    regs = [_word(rows[r0 + 8 * (r % 2)], 32 * hk + 16 * (r // 2) + 4 * t) for r in range(4)]
                    for kk in range(2):
                        kb = 2 * hk + kk
                        words = convert(regs[2 * kk], regs[2 * kk + 1], offset(r0, kb), offset(r0 + 8, kb))
                        for r, w in enumerate(words):
                            for j in range(4):
                                out[r0 + 8 * (r % 2), 32 * kb + 16 * (r // 2) + 4 * t + j] = (w >> (8 * j)) & 0xFF
    return out.view(torch.float8_e4m3fn).to(torch.float32)


def _hopper_w4a8(fe, repo: str, tree: str) -> None:
    import torch

    from moe_ep.formats import codecs
    from shim.sm90 import fp4_layout
    from tools.drop import ptx
    from tools.drop.source_model import DropIndex

    try:
        asm = ptx.find_asm_function(DropIndex(tree), *CONVERTER)
    except ptx.NotEmulated as e:
        raise Mismatch(f"the W4A8 converter cannot be run on the CPU ({e}): its numbers are not checked",
                       _site(fp4_layout.mxfp4_offsets, repo), None) from None
    drop_site = asm.where
    kw, _, _ = _problem(fe)
    qw = kw.canonical()
    group = codecs.FP8_GATE_UP_INTERLEAVE

    def convert(*values):
        return ptx.run(asm, dict(zip(asm.inputs, values)))

    # The FC1 leg's first expert and the FC2 leg's last: every row block and both K tiles of each.
    for leg, e, packed, folded, residual, codes, scale in (
            ("w13", 0, kw.fc1, kw.fc1_sf, kw.fc1_residual, qw.w13_q, qw.w13_scale),
            ("w2", kw.num_experts - 1, kw.fc2, kw.fc2_sf, kw.fc2_residual, qw.w2_q, qw.w2_scale)):
        try:
            seen = kernel_operand(convert, packed[e].transpose(0, 1), folded[e])
        except ptx.NotEmulated as err:
            raise Mismatch(f"the W4A8 converter cannot be run on the CPU ({err}): its numbers are not checked",
                           _site(fp4_layout.mxfp4_offsets, repo), drop_site) from None
        want = codecs.mxfp4_dequantize(codes[e], scale[e])
        if leg == "w13":
            want = codecs.interleave_gate_up(want, group)
        got = seen * residual[e]
        bad = ~((got == want) | (torch.isnan(got) & torch.isnan(want)))
        if bool(bad.any()):
            ratio = (got[bad] / want[bad]).abs()
            ratio = ratio[torch.isfinite(ratio)]
            how = f"; their ratio to moe_ep's values: {float(ratio.median()):.4g} (median)" if len(ratio) else ""
            raise Mismatch(f"the W4A8 kernel's converter ({drop_site}) makes, from the shim's {leg} bytes and "
                           f"offsets, {int(bad.sum())} of {bad.numel()} weights of expert {e} other than the ones "
                           f"moe_ep's reference multiplies{how}: the MXFP4 window or layout the shim mirrors is not "
                           "the drop's", _site(fp4_layout.mxfp4_offsets, repo), drop_site)


CHECKS: Dict[Tuple[str, str], Callable] = {
    ("sm90", "fp8_block"): _hopper_fp8,
    ("sm90", "fp8_tensor"): _hopper_fp8,
    ("sm90", "bf16"): _hopper_bf16,
    ("sm90", "w4a8_mxfp4"): _hopper_w4a8,
}


def check(fe, repo: str, tree: str) -> None:
    """Raises Mismatch when the drop's numbers differ from moe_ep's for frontend `fe`'s layout; nothing for a format
    without a check."""
    fn = CHECKS.get((fe.arch, fe.fmt))
    if fn is not None:
        fn(fe, repo, tree)
