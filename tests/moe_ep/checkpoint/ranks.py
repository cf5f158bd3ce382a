"""One rank's part of the checkpoint tests (called in-process under a one-rank group, or on every rank by
tools.launch): load a synthetic checkpoint's layer into a layer, then check (a) the layer's oracle weights against
the checkpoint's own dequantized values, (b) its output against the multi-rank oracle, (c) its output against a
plain-torch MoE over the checkpoint's dequantized experts (tests/moe_ep/checkpoint/synth.py, not moe_ep's codecs)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

# Largest per-token relative error of the layer against the unquantized plain-torch MoE: the activation
# quantization of each format (weights are the checkpoint's own), with room; a swapped gate/up or nibble order
# lands near 1.
PLAIN_TOL = {"bf16": 2e-2, "fp8_block": 0.15, "fp8_tensor": 0.15, "mxfp8": 0.15, "nvfp4": 0.35, "w4a8_mxfp4": 0.15,
             "w4a8_nvfp4": 0.15}


def _all_tensors(path):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _row_rel(out, ref):
    ref = ref.float()
    d = (out.float() - ref).norm(dim=-1) / ref.norm(dim=-1).clamp(min=1e-6 * float(ref.norm(dim=-1).mean()) + 1e-30)
    return float(d.max()) if d.numel() else 0.0


def run(path: str, synth_convention: str, fmt=None, tokens: int = 24, top_k: int = 2, allow_inexact: bool = False,
        backend: str = "torch_reference", seed: int = 0, swap_gate_up: bool = False):
    import moe_ep
    from moe_ep import checkpoint
    from moe_ep.reference.oracle import check_multirank
    from tests.moe_ep.checkpoint import synth

    rank, world = dist.get_rank(), dist.get_world_size()
    ck = checkpoint.Checkpoint(path)
    plan = ck.plan(1)
    spec = moe_ep.MoESpec(plan.hidden_size, plan.intermediate_size, plan.num_experts, top_k, tokens)
    if plan.convention.served:
        layer = checkpoint.load_layer(ck, 1, spec, backend, fmt=fmt, allow_inexact=allow_inexact)
        report = None
    else:  # gpt-oss: its weights, without the biases and activation moe_ep does not compute
        loaded = ck.load_experts(1, rank, world, fmt=fmt)
        report = loaded.report
        layer = moe_ep.MoELayer(spec, loaded.weights, backend)
    e_local = plan.num_experts // world
    mine = slice(rank * e_local, (rank + 1) * e_local)
    ref = synth.dequantized(_all_tensors(path), synth_convention)
    ref13, ref2 = ref[0], ref[1]

    # (a) what the backend computes with, against the checkpoint's own values
    qw = layer.oracle_weights()
    got13, got2 = qw.dequantize()
    d13, d2 = (got13 - ref13[mine]).abs(), (got2 - ref2[mine]).abs()
    ulp13, ulp2 = torch.finfo(torch.float32).eps * ref13[mine].abs(), torch.finfo(torch.float32).eps * ref2[mine].abs()
    weights = dict(equal=bool(torch.equal(got13, ref13[mine]) and torch.equal(got2, ref2[mine])),
                   within_ulp=bool((d13 <= ulp13).all() and (d2 <= ulp2).all()),
                   changed=int((d13 != 0).sum() + (d2 != 0).sum()), fmt=qw.fmt,
                   offset=qw.expert_offset, experts=qw.num_experts)

    # (b) the layer against the multi-rank oracle
    g = torch.Generator().manual_seed(seed * 100 + rank)
    hidden = torch.randn(tokens, plan.hidden_size, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(plan.num_experts, generator=g)[:top_k] for _ in range(tokens)])
    w = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=-1)
    out = torch.full_like(hidden, float("nan"))  # poisoned: a row the layer does not write stays NaN
    layer(hidden, idx, w, out=out)
    oracle = check_multirank(layer, hidden, idx, w, out, raise_on_failure=False)

    # (c) the layer against plain torch over the checkpoint's dequantized experts (all of them: routing is global)
    w13_all = ref13
    if swap_gate_up:  # a negative control: what a converter that mixed up gate and up would be judged by
        i = plan.intermediate_size
        w13_all = torch.cat((ref13[:, i:], ref13[:, :i]), dim=1)
    plain = synth.plain_moe(hidden, idx, w, w13_all, ref2)
    result = dict(rank=rank, world=world, weights=weights, oracle_ok=oracle.ok, oracle=oracle.summary(),
                  oracle_err=oracle.mine(rank).max_row_rel_err, plain_err=_row_rel(out, plain),
                  plain_tol=PLAIN_TOL[qw.fmt], nan=int(torch.isnan(out.float()).sum()),
                  report=None if report is None else report.summary())
    layer.close()
    return result


def run_all(cases):
    """Every case of `cases` (dicts of run()'s arguments) on this rank, in order."""
    return [run(**c) for c in cases]


def load_error(path: str, layer: int = 1, e: int = 4, h: int = 256, i: int = 128):
    """load_layer on every rank, expecting it to fail; what each rank raised (type, argument, file)."""
    import moe_ep
    from moe_ep import checkpoint

    try:
        checkpoint.load_layer(path, layer, moe_ep.MoESpec(h, i, e, 2, 8), "torch_reference")
    except moe_ep.MoEError as err:
        return dict(type=type(err).__name__, argument=err.argument, file=getattr(err, "file", None),
                    ranks=list(getattr(err, "ranks", ())))
    return dict(type=None)
