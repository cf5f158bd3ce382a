"""Bad checkpoints and bad requests: a typed error that names the tensor and its file, raised before anything is
read where the headers tell, and nothing half-built left in memory when a load fails midway (the error may be
kept: its traceback's frames are cleared)."""

import gc
import json
import warnings
from pathlib import Path

import pytest
import torch

import moe_ep
from moe_ep import checkpoint
from moe_ep.errors import CheckpointError, FormatError, InexactCheckpointError, WorldSizeError
from tests.moe_ep.checkpoint import synth
from tests.support.dist import one_rank_gloo_group

STEM = "model.layers.1.mlp.experts"


def _spec(e=4, h=256, i=128):
    return moe_ep.MoESpec(h, i, e, 2, 8)


def test_a_shard_missing_an_expert_names_the_tensor_and_the_shard(tmp_path):
    name = f"{STEM}.2.up_proj.weight"
    synth.write(tmp_path, "deepseek_fp8", agree=True, drop=[name])
    shard = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"][name]
    ck = checkpoint.Checkpoint(tmp_path)
    with pytest.raises(CheckpointError) as e:
        ck.load_experts(1)
    assert e.value.argument == name and e.value.file == str(tmp_path / shard)
    assert "missing from its shard" in str(e.value) and shard in str(e.value)
    ck.load_experts(1, 0, 2)  # rank 0 of 2 owns experts 0-1: its load does not need the missing tensor


def test_an_expert_missing_from_the_index_names_the_tensor_and_the_index(tmp_path):
    synth.write(tmp_path, "modelopt_nvfp4", config={"num_experts": 5})  # the config promises a fifth expert
    with pytest.raises(CheckpointError) as e:
        checkpoint.Checkpoint(tmp_path).load_experts(1)
    assert e.value.argument == f"{STEM}.4.gate_proj.weight"
    assert e.value.file == str(tmp_path / "model.safetensors.index.json") and "no such tensor" in str(e.value)


@pytest.mark.parametrize("bad, match", [
    (torch.ones(2, 3), "expected shape \\[1, 2\\]"),
    (torch.ones(1, 2, dtype=torch.bfloat16), "expected dtype F32"),
    (torch.ones(2, 4), "128x128 block"),  # a 64x64-block checkpoint: its grid is [I/64, H/64]
])
def test_a_scale_of_the_wrong_shape_dtype_or_block_size(tmp_path, bad, match):
    name = f"{STEM}.1.gate_proj.weight_scale_inv"
    synth.write(tmp_path, "deepseek_fp8", agree=True, shards=0, edit={name: bad})
    with pytest.raises(CheckpointError, match=match) as e:
        checkpoint.Checkpoint(tmp_path).load_experts(1)
    assert e.value.argument == name and e.value.file == str(tmp_path / "model.safetensors")


def test_a_size_the_format_cannot_block(tmp_path):
    synth.write(tmp_path, "deepseek_fp8", i=96, shards=1)
    with pytest.raises(CheckpointError, match="multiple of 128") as e:
        checkpoint.Checkpoint(tmp_path).load_experts(1)
    assert e.value.argument == f"{STEM}.0.gate_proj.weight" and e.value.file.endswith(".safetensors")


def test_a_format_the_backend_does_not_serve(tmp_path):
    synth.write(tmp_path, "deepseek_fp8", agree=True)
    with one_rank_gloo_group():
        with pytest.raises(FormatError) as e:
            checkpoint.load_layer(tmp_path, 1, _spec(), "sm100_nvfp4_cutedsl")
        assert "sm100_nvfp4_cutedsl" in str(e.value) and "fp8_block" in str(e.value)
        assert f"{STEM}.0.gate_proj.weight" in str(e.value) and ".safetensors" in str(e.value)
        with pytest.raises(FormatError, match="loads as \\['fp8_block', 'mxfp8'\\], not 'nvfp4'"):
            checkpoint.load_layer(tmp_path, 1, _spec(), fmt="nvfp4")
        # and a pre-quantized pack handed to the layer directly (a CPU backend that serves bf16 only: a kernel
        # backend named on a CPU host is refused for its device first)
        w = checkpoint.Checkpoint(tmp_path).load_experts(1).weights
        moe_ep.register_backend("bf16_only", "moe_ep.reference.backend:TorchReferenceBackend", arch="cpu",
                                formats=("bf16",))
        try:
            with pytest.raises(FormatError, match="'bf16_only' serves \\['bf16'\\], not 'fp8_block'"):
                moe_ep.MoELayer(_spec(), w, "bf16_only")
            with pytest.raises(FormatError, match="'bf16_only' serves \\['bf16'\\]; a deepseek_fp8 checkpoint"):
                checkpoint.load_layer(tmp_path, 1, _spec(), "bf16_only")
        finally:
            moe_ep.unregister_backend("bf16_only")
        with pytest.raises(FormatError, match="requantize"):
            moe_ep.MoELayer(_spec(), w, fmt="mxfp8")


def test_a_world_size_that_does_not_divide_the_experts(tmp_path):
    synth.write(tmp_path, "gpt_oss_mxfp4")
    with pytest.raises(WorldSizeError) as e:
        checkpoint.Checkpoint(tmp_path).load_experts(1, 0, 3)
    assert e.value.argument == "world_size" and f"{STEM}.gate_up_proj_blocks" in str(e.value)
    assert "model-0000" in str(e.value) and "does not divide the 4 experts" in str(e.value)


def test_inexact_is_refused_unless_allowed(tmp_path):
    synth.write(tmp_path, "deepseek_fp8", agree=False)
    ck = checkpoint.Checkpoint(tmp_path)
    with pytest.raises(InexactCheckpointError) as e:
        ck.load_experts(1)
    assert e.value.argument == f"{STEM}.0.gate_proj.weight" and e.value.file.endswith(".safetensors")
    assert e.value.report.changed > 0 and "allow_inexact=True" in str(e.value)
    assert not ck.load_experts(1, allow_inexact=True).report.exact


def test_gpt_oss_is_refused_by_load_layer_and_carries_its_extras(tmp_path):
    synth.write(tmp_path, "gpt_oss_mxfp4")
    with one_rank_gloo_group():
        with pytest.raises(CheckpointError, match="biases and a clamped SwiGLU") as e:
            checkpoint.load_layer(tmp_path, 1, _spec())
    assert e.value.argument == f"{STEM}.gate_up_proj_blocks" and e.value.file.endswith(".safetensors")
    loaded = checkpoint.Checkpoint(tmp_path).load_experts(1, 1, 2)
    extras = loaded.extras["gpt_oss"]
    assert extras.gate_up_bias.shape == (2, 256) and extras.down_bias.shape == (2, 256)


def test_names_no_convention_reads(tmp_path):
    from safetensors.torch import save_file

    save_file({f"{STEM}.0.gate_proj.weight_packed": torch.zeros(4, 4, dtype=torch.uint8),
               f"{STEM}.0.gate_proj.weight_global_scale": torch.ones(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="no convention moe_ep reads") as e:
        checkpoint.Checkpoint(tmp_path).plan(1)
    assert e.value.argument.startswith(STEM) and e.value.file == str(tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="no routed experts in layer 7"):
        checkpoint.Checkpoint(tmp_path).plan(7)


def test_a_spec_that_is_not_the_checkpoints(tmp_path):
    synth.write(tmp_path, "hf_bf16")
    with one_rank_gloo_group():
        with pytest.raises(CheckpointError, match="hidden 256, intermediate 128, 4 experts") as e:
            checkpoint.load_layer(tmp_path, 1, _spec(h=512))
    assert e.value.argument == f"{STEM}.0.gate_proj.weight"


def _pack_tensors():
    """Live tensors shaped like a loaded pack of this file's checkpoints ([4, 256, 256] w13 codes or values)."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on every live object touches deprecated module attributes
        warnings.simplefilter("ignore")
        return [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and tuple(o.shape) == (4, 256, 256)]


@pytest.mark.parametrize("conv, drop", [("deepseek_fp8", f"{STEM}.3.down_proj.weight_scale_inv"),
                                        ("hf_bf16", f"{STEM}.3.up_proj.weight")])
def test_a_failed_load_leaves_nothing_behind(tmp_path, conv, drop):
    synth.write(tmp_path, conv, shards=2, agree=True)
    shard = Path(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"][drop])
    before = len(_pack_tensors())
    # Experts 0-2 convert into the pack before expert 3's tensor turns out unreadable (a truncated shard).
    data = (tmp_path / shard).read_bytes()
    (tmp_path / shard).write_bytes(data[: len(data) - 64])
    kept = []
    try:
        checkpoint.Checkpoint(tmp_path).load_experts(1)
    except CheckpointError as err:
        kept.append(err)  # the caller keeps the error (and so its traceback)
    assert kept and kept[0].file == str(tmp_path / shard)
    assert len(_pack_tensors()) == before
    with one_rank_gloo_group():
        try:
            checkpoint.load_layer(tmp_path, 1, _spec())
        except CheckpointError as err:
            kept.append(err)
    assert len(kept) == 2 and len(_pack_tensors()) == before


def test_an_expert_tensor_the_layer_would_not_compute_is_refused_not_dropped(tmp_path):
    bias = f"{STEM}.2.up_proj.bias"
    synth.write(tmp_path, "hf_bf16", edit={bias: torch.ones(128).bfloat16()})
    ck = checkpoint.Checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="does not compute") as e:
        ck.load_experts(1)
    assert e.value.tensor == bias and e.value.file.endswith(".safetensors")
    with one_rank_gloo_group():
        with pytest.raises(CheckpointError, match="does not compute"):
            checkpoint.load_layer(tmp_path, 1, _spec())


def test_gpt_oss_saved_by_transformers_in_bf16_is_recognised_and_refused_by_name(tmp_path):
    pytest.importorskip("transformers")
    from moe_ep.testing import hf_matrix

    model = hf_matrix.tiny_model("gpt_oss")
    model.save_pretrained(tmp_path)
    ck = checkpoint.Checkpoint(tmp_path)
    assert ck.convention.name == "gpt_oss_bf16"
    with one_rank_gloo_group():
        with pytest.raises(CheckpointError, match="gpt_oss_bf16 experts compute what moe_ep's layer does not") as e:
            checkpoint.load_layer(tmp_path, 0, moe_ep.MoESpec(128, 128, 8, 2, 8))
    assert e.value.tensor == "model.layers.0.mlp.experts.gate_up_proj"
    loaded = ck.load_experts(0, 1, 2)  # its weights, in moe_ep's layout, and what the layer leaves out
    ex = model.model.layers[0].mlp.experts
    g = ex.gate_up_proj.detach()[4:]
    assert torch.equal(loaded.weights.w13, torch.cat((g[:, :, 0::2], g[:, :, 1::2]), dim=2).transpose(1, 2))
    assert torch.equal(loaded.weights.w2, ex.down_proj.detach()[4:].transpose(1, 2))
    b = ex.gate_up_proj_bias.detach()[4:].float()
    assert torch.equal(loaded.extras["gpt_oss"].gate_up_bias, torch.cat((b[:, 0::2], b[:, 1::2]), dim=1))


@pytest.mark.parametrize("which", ["gate", "up"])
def test_a_zero_scale_is_a_block_of_zeros_and_the_load_stays_exact(tmp_path, which):
    """A zero block scale that must share the other half's scale in fp8_block: its values are zero under any
    scale, so its codes become zeros, nothing changes, and the load is exact (not an InexactCheckpointError with
    nothing changed)."""
    t = synth.tensors("deepseek_fp8", agree=True)
    name = f"{STEM}.1.{which}_proj.weight_scale_inv"
    zero = t[name].clone()
    zero[0, 0] = 0.0
    written = synth.write(tmp_path, "deepseek_fp8", agree=True, shards=0, edit={name: zero})
    loaded = checkpoint.Checkpoint(tmp_path).load_experts(1, fmt="fp8_block")
    assert loaded.report.exact and loaded.report.changed == 0 and loaded.report.rescaled_blocks == 0
    got13, got2 = loaded.weights.qw.dequantize()
    want13, want2 = synth.dequantized(written, "deepseek_fp8")[:2]
    assert torch.equal(got13, want13) and torch.equal(got2, want2)
    half = slice(0, 128) if which == "gate" else slice(128, 256)
    assert not bool(got13[1, half][:128, :128].any())  # the zero-scale block reads as zeros


def test_nan_codes_are_damage_named_with_their_file(tmp_path):
    name = f"{STEM}.3.down_proj.weight"
    t = synth.tensors("deepseek_fp8", agree=True)
    bad = t[name].clone()
    bad.view(torch.uint8)[5, 7] = 0xFF
    synth.write(tmp_path, "deepseek_fp8", agree=True, edit={name: bad})
    with pytest.raises(CheckpointError, match="e4m3 NaN codes") as e:
        checkpoint.Checkpoint(tmp_path).load_experts(1)
    assert e.value.tensor == name and e.value.file.endswith(".safetensors")


def test_gpt_oss_reports_say_bf16_cannot_hold_values_only_for_bf16(tmp_path):
    """Scales spanning more binades than w4a8_mxfp4 carries: that load changes values, and its report says why in
    its own words, not "bf16 cannot hold" (which the loader said for every format that changed a value)."""
    name = f"{STEM}.down_proj_scales"
    scales = synth.tensors("gpt_oss_mxfp4")[name].clone()
    scales[2, :, 0] = 127 - 20  # 2^-20 blocks next to ~2^-5 ones in expert 2: beyond the kernel's window
    synth.write(tmp_path, "gpt_oss_mxfp4", edit={name: scales})
    ck = checkpoint.Checkpoint(tmp_path)
    w4 = ck.load_experts(1, fmt="w4a8_mxfp4", allow_inexact=True).report
    assert w4.changed > 0 and any("w4a8_mxfp4 carries" in n for n in w4.notes), w4.notes
    for fmt in ("w4a8_mxfp4", "mxfp8", "bf16"):  # mxfp8 and bf16 hold every e2m1 x e8m0 value: nothing to say
        r = ck.load_experts(1, fmt=fmt, allow_inexact=True).report
        assert not any("bf16" in n for n in r.notes) and (fmt == "w4a8_mxfp4") == (r.changed > 0), (fmt, r.notes)
    scales[1] = 254  # 2^127 blocks: 4 and 6 times that overflow bf16 (and fp32): there the wording applies
    synth.write(tmp_path / "huge", "gpt_oss_mxfp4", edit={name: scales})
    r = checkpoint.Checkpoint(tmp_path / "huge").load_experts(1, fmt="bf16", allow_inexact=True).report
    assert r.changed > 0 and any("bf16 cannot hold" in n for n in r.notes), r.notes


def _nan_code(t):
    t.view(torch.uint8).view(-1)[1] = 0x7F


def _set(v):
    def damage(t):
        t.view(-1)[1] = v
    return damage


NAN, INF = float("nan"), float("inf")
MIXTRAL = "model.layers.1.block_sparse_moe.experts"


@pytest.mark.parametrize("conv, name, damage", [
    ("deepseek_fp8", f"{STEM}.2.up_proj.weight_scale_inv", _set(NAN)),
    ("deepseek_fp8", f"{STEM}.2.gate_proj.weight_scale_inv", _set(-1.0)),
    ("modelopt_fp8", f"{STEM}.2.gate_proj.weight_scale", lambda t: t.fill_(INF)),
    ("modelopt_fp8", f"{STEM}.2.down_proj.weight", _nan_code),
    ("modelopt_fp8", f"{STEM}.2.up_proj.input_scale", lambda t: t.fill_(NAN)),  # layer-wide: read for every expert
    ("modelopt_nvfp4", f"{STEM}.2.gate_proj.weight_scale", _nan_code),
    ("modelopt_nvfp4", f"{STEM}.2.down_proj.weight_scale_2", lambda t: t.fill_(INF)),
    ("modelopt_nvfp4", f"{STEM}.2.up_proj.weight_scale_2", lambda t: t.fill_(-2.0)),
    ("modelopt_nvfp4", f"{STEM}.3.gate_proj.input_scale", lambda t: t.fill_(-INF)),
    ("gpt_oss_mxfp4", f"{STEM}.down_proj_scales", _set(255)),
    ("gpt_oss_mxfp4", f"{STEM}.gate_up_proj_bias", _set(NAN)),  # biases travel with the weights (extras)
    ("hf_bf16", f"{STEM}.2.down_proj.weight", _set(INF)),
    ("mixtral_bf16", f"{MIXTRAL}.2.w1.weight", _set(NAN)),
    ("hf_fused_bf16", f"{STEM}.gate_up_proj", _set(-INF)),
], ids=lambda v: v if isinstance(v, str) and "." not in v else None)
def test_a_damaged_value_in_any_convention_names_its_tensor_and_file(tmp_path, conv, name, damage):
    """NaN / inf / negative scales, NaN codes, non-finite weights and biases: a CheckpointError naming the damaged
    tensor and the shard that holds it (allow_inexact: the damage, not an inexact scale elsewhere, is what fails)."""
    t = synth.tensors(conv)[name].clone()
    damage(t)
    synth.write(tmp_path, conv, edit={name: t})
    shard = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"][name]
    with pytest.raises(CheckpointError) as e:
        checkpoint.Checkpoint(tmp_path).load_experts(1, allow_inexact=True)
    assert type(e.value) is CheckpointError and e.value.tensor == name and e.value.file == str(tmp_path / shard)


def test_gpt_oss_bf16_biases_are_checked_like_weights(tmp_path):
    pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file

    from moe_ep.testing import hf_matrix

    hf_matrix.tiny_model("gpt_oss").save_pretrained(tmp_path)
    name = "model.layers.1.mlp.experts.down_proj_bias"
    file = next(f for f in tmp_path.glob("*.safetensors") if name in load_file(str(f)))
    tensors = load_file(str(file))
    tensors[name][3, 5] = INF
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="NaN or infinite") as e:
        checkpoint.Checkpoint(tmp_path).load_experts(1)
    assert e.value.tensor == name and e.value.file == str(file)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
