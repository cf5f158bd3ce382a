"""An already-quantized pack (a checkpoint's bytes, moe_ep.checkpoint's converters) laid out for the Blackwell
kernels: the kernel tensors (e2m1 pairs, swizzled scale atoms, gate/up interleave) read back through
the layout's canonical() as the pack byte for byte, global scales and the NVFP4 epilogue scalars included;
nothing is requantized."""
import pytest
import torch

import moe_ep
from moe_ep.checkpoint import convert_fp4, convert_fp8
from moe_ep.errors import FormatError
from moe_ep.formats import codecs
from tests.moe_ep.checkpoint import synth
from tests.shim.sm100.helpers import layout, same_bytes

STEM = "model.layers.1.mlp.experts"


def _stack(t, proj, suffix, e=4):
    return torch.stack([t[f"{STEM}.{x}.{proj}.{suffix}"] for x in range(e)])


def _pack(fmt):
    if fmt == "nvfp4":
        t = synth.tensors("modelopt_nvfp4", agree=True, seed=9)
        a = [_stack(t, p, s) for p in ("gate_proj", "up_proj", "down_proj")
             for s in ("weight", "weight_scale", "weight_scale_2")]
        act = convert_fp8.layer_input_scale(_stack(t, "gate_proj", "input_scale"), _stack(t, "up_proj", "input_scale"))
        qw, report = convert_fp4.modelopt_nvfp4(*a, act, _stack(t, "down_proj", "input_scale"), expert_offset=4)
    elif fmt == "mxfp8":
        t = synth.tensors("deepseek_fp8", pow2=True, seed=10)
        qw, report = convert_fp8.deepseek_fp8_mxfp8(*(_stack(t, p, s) for p in ("gate_proj", "up_proj", "down_proj")
                                                     for s in ("weight", "weight_scale_inv")), expert_offset=4)
    else:
        t = synth.tensors("gpt_oss_mxfp4", seed=11)
        qw, report, _ = convert_fp4.gpt_oss_mxfp4(t[f"{STEM}.gate_up_proj_blocks"], t[f"{STEM}.gate_up_proj_scales"],
                                                  t[f"{STEM}.down_proj_blocks"], t[f"{STEM}.down_proj_scales"],
                                                  fmt="bf16", expert_offset=4)
    assert report.exact
    return qw


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8", "bf16"])
def test_a_checkpoint_pack_reads_back_byte_for_byte(fmt):
    qw = _pack(fmt)
    kw = layout(fmt).from_pack(qw, torch.device("cpu"))
    got = kw.canonical()
    assert got.fmt == fmt and got.expert_offset == 4
    assert sorted(got.tensor_fields()) == sorted(qw.tensor_fields())
    for name in qw.tensor_fields():
        assert same_bytes(getattr(got, name), getattr(qw, name)), (fmt, name)
    if fmt == "nvfp4":  # the epilogue scalars come from the checkpoint's global scales as for a pack made here
        assert torch.equal(kw.fc1_alpha, codecs.nvfp4_alpha(qw.act_scale.expand(4), qw.w13_global_scale))
        assert torch.equal(kw.fc2_alpha, codecs.nvfp4_alpha(qw.fc2_act_scale, qw.w2_global_scale))


def test_the_frontend_entry_refuses_another_format():
    w = moe_ep.ExpertWeights.from_quantized(_pack("mxfp8"), rank=1, world_size=2, num_experts=8)
    assert layout("mxfp8").prepare(w, torch.device("cpu")).expert_offset == 4
    with pytest.raises(FormatError, match="quantized as 'mxfp8'"):
        layout("nvfp4").prepare(w, torch.device("cpu"))


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
