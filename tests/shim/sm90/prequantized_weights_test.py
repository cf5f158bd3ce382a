"""An already-quantized pack (a checkpoint's bytes, moe_ep.checkpoint's converters) laid out for the Hopper kernels
(FP8 blockwise and per tensor, BF16, W4A8 MXFP4): what the kernel is handed reads back (canonical(), the oracle's
view) as the pack byte for byte, gate/up interleaved by 8 in the kernel tensors, in one piece or a few experts at a
time; nothing is requantized."""
import pytest
import torch

import moe_ep
from moe_ep.checkpoint import convert_bf16, convert_fp4, convert_fp8
from moe_ep.errors import FormatError
from shim.sm90 import weights
from shim.sm90.formats import BACKENDS
from tests.moe_ep.checkpoint import synth

STEM = "model.layers.1.mlp.experts"


def layout(fmt):
    """The format's Hopper weight layout (its frontend's KernelWeights class)."""
    return BACKENDS.row(fmt).frontend_class().weights_layout


def _stack(t, proj, suffix, e=4):
    return torch.stack([t[f"{STEM}.{x}.{proj}.{suffix}"] for x in range(e)])


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _packs():
    t = synth.tensors("deepseek_fp8", e=4, h=256, i=256, agree=True, seed=7)
    fp8, report = convert_fp8.deepseek_fp8_block(*(_stack(t, p, s) for p in ("gate_proj", "up_proj", "down_proj")
                                                   for s in ("weight", "weight_scale_inv")), expert_offset=8)
    assert report.exact
    t = synth.tensors("hf_bf16", e=4, h=256, i=256, seed=8)
    w13, w2 = convert_bf16.per_expert_bf16(_stack(t, "gate_proj", "weight"), _stack(t, "up_proj", "weight"),
                                           _stack(t, "down_proj", "weight"))
    t = synth.tensors("modelopt_fp8", e=4, h=256, i=256, agree=True, seed=9)
    act = convert_fp8.layer_input_scale(_stack(t, "gate_proj", "input_scale"), _stack(t, "up_proj", "input_scale"))
    tensor, report = convert_fp8.modelopt_fp8_tensor(
        *(_stack(t, p, s) for p in ("gate_proj", "up_proj") for s in ("weight", "weight_scale")),
        _stack(t, "down_proj", "weight"), _stack(t, "down_proj", "weight_scale"), act,
        convert_fp8.layer_input_scale(_stack(t, "down_proj", "input_scale")), expert_offset=8)
    assert report.exact
    return {"fp8_block": fp8, "fp8_tensor": tensor, "bf16": moe_ep.QuantizedWeights("bf16", w13, w2, expert_offset=8)}


@pytest.mark.parametrize("fmt", ["fp8_block", "fp8_tensor", "bf16"])
@pytest.mark.parametrize("chunk_bytes", [1 << 30, 2 * 512 * 256 * 4])  # all experts at once / two at a time
def test_a_checkpoint_pack_reads_back_byte_for_byte(fmt, chunk_bytes):
    qw = _packs()[fmt]
    kw = layout(fmt).from_pack(qw, torch.device("cpu"), chunk_bytes=chunk_bytes)
    got = kw.canonical()
    assert got.fmt == fmt and got.expert_offset == 8
    assert sorted(got.tensor_fields()) == sorted(qw.tensor_fields())
    for name in qw.tensor_fields():
        assert _same(getattr(got, name), getattr(qw, name)), (fmt, name)
    storage = kw.fc1.transpose(1, 2)  # [E, 2I, H] K-major, gate/up interleaved by 8
    g = weights.GATE_UP_INTERLEAVE
    assert _same(storage[:, g:2 * g], qw.w13_q[:, 256:256 + g]) and kw.fc1.stride(1) == 1
    assert storage.data_ptr() != qw.w13_q.data_ptr()  # the kernel's own tensors: the pack may be dropped


def test_a_gpt_oss_pack_in_the_w4a8_layout_reads_back_byte_for_byte():
    from shim.sm90.w4a8_weights import Sm90W4A8Weights

    t = synth.tensors("gpt_oss_mxfp4", e=4, h=256, i=256, seed=13)
    qw, report, _ = convert_fp4.gpt_oss_mxfp4(t[f"{STEM}.gate_up_proj_blocks"], t[f"{STEM}.gate_up_proj_scales"],
                                              t[f"{STEM}.down_proj_blocks"], t[f"{STEM}.down_proj_scales"],
                                              fmt="w4a8_mxfp4", expert_offset=4)
    assert report.exact
    w = moe_ep.ExpertWeights.from_quantized(qw, rank=1, world_size=2, num_experts=8)
    got = Sm90W4A8Weights.prepare(w, torch.device("cpu")).canonical()
    assert got.fmt == "w4a8_mxfp4" and got.expert_offset == 4
    for name in qw.tensor_fields():
        assert _same(getattr(got, name), getattr(qw, name)), name
    with pytest.raises(FormatError, match="quantized as 'bf16', the kernel runs 'w4a8_mxfp4'"):
        Sm90W4A8Weights.prepare(moe_ep.ExpertWeights.from_quantized(_packs()["bf16"], 0, 1, 4), torch.device("cpu"))


def test_the_frontend_entry_takes_either_kind_of_weights():
    qw = _packs()["fp8_block"]
    w = moe_ep.ExpertWeights.from_quantized(qw, rank=2, world_size=3, num_experts=12)
    kw = layout("fp8_block").prepare(w, torch.device("cpu"))
    assert _same(kw.canonical().w13_scale, qw.w13_scale) and kw.expert_offset == 8
    with pytest.raises(FormatError, match="quantized as 'fp8_block'"):
        layout("bf16").prepare(w, torch.device("cpu"))
    bf = torch.randn(4, 512, 256).bfloat16(), torch.randn(4, 256, 256).bfloat16()
    kw = layout("fp8_block").prepare(moe_ep.ExpertWeights(*bf, rank=0, world_size=1, num_experts=4),
                                     torch.device("cpu"))
    assert _same(kw.canonical().w13_q, moe_ep.formats.quantize_weights("fp8_block", *bf).w13_q)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
