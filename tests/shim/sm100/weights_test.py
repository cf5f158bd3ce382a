"""Blackwell weight preprocessing and activation staging, checked bit for bit on CPU.

Three independent sides meet here:
  * moe_ep's reference quantizers (the oracle's): what the kernel must compute with;
  * the kernel layouts (each format's KernelWeights in shim/sm100/<format>_frontend.py, over shim.sm100.weights:
    gate/up interleave, e2m1 pairs, swizzled block scales);
  * the drop's own torch helpers (to_blocked / from_blocked, unpack_fp4_to_f32, swiglu_fold_interleave,
    mxfp8_quantize_per_block_32_row): what the kernel team's runners feed the same kernels.
The kernel tensors, read back, must equal the reference quantization byte for byte, and each layout rule
must agree with the drop's helper for it.
"""
import pytest
import torch

from moe_ep.formats import codecs
from moe_ep.formats import packs
from moe_ep.reference import ffn
from tests.shim.sm100.helpers import canonical_weights, layout, same_bytes

pytestmark = pytest.mark.usefixtures("sm100_tree")

FORMATS = ("nvfp4", "mxfp8", "bf16")
CAL = {"nvfp4": dict(act_amax=6.5, fc2_act_amax=0.75)}


def _prepare(fmt, w13, w2, offset=6):
    return layout(fmt).from_bf16(w13, w2, torch.device("cpu"), expert_offset=offset, **CAL.get(fmt, {}))


@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_weights_read_back_to_the_reference_quantization(fmt):
    w13, w2 = canonical_weights()
    kw = _prepare(fmt, w13, w2)
    ref = packs.quantize_weights(fmt, w13, w2, expert_offset=6, **CAL.get(fmt, {}))
    got = kw.canonical()
    assert got.fmt == fmt and got.expert_offset == 6
    assert sorted(got.tensor_fields()) == sorted(ref.tensor_fields())
    for name in ref.tensor_fields():
        assert same_bytes(getattr(got, name), getattr(ref, name)), name


@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_views_are_k_major_with_the_drops_shapes(fmt):
    from shim.sm100.weights import swizzled_scale_numel

    e, h, i = 3, 256, 128
    kw = _prepare(fmt, *canonical_weights(e, h, i))
    pack = 2 if fmt == "nvfp4" else 1  # torch counts e2m1 pairs
    dtype = {"nvfp4": torch.float4_e2m1fn_x2, "mxfp8": torch.float8_e4m3fn, "bf16": torch.bfloat16}[fmt]
    # (E, K, N) views whose K axis is the contiguous one, as the runners build them.
    assert kw.fc1.dtype == dtype and tuple(kw.fc1.shape) == (e, h // pack, 2 * i) and kw.fc1.stride()[1] == 1
    assert kw.fc2.dtype == dtype and tuple(kw.fc2.shape) == (e, i // pack, h) and kw.fc2.stride()[1] == 1
    if fmt == "bf16":
        assert not hasattr(kw, "fc1_sf") and not hasattr(kw, "fc2_sf")  # nothing to scale
        return
    blk = {"nvfp4": 16, "mxfp8": 32}[fmt]
    sf_dtype = torch.float8_e4m3fn if fmt == "nvfp4" else torch.float8_e8m0fnu
    assert kw.fc1_sf.dtype == sf_dtype and tuple(kw.fc1_sf.shape) == (e, swizzled_scale_numel(2 * i, h // blk))
    assert kw.fc2_sf.dtype == sf_dtype and tuple(kw.fc2_sf.shape) == (e, swizzled_scale_numel(h, i // blk))
    # The runners' flat size: round_up(N, 128) * round_up(K / blk, 4).
    assert kw.fc1_sf.shape[1] == -(-2 * i // 128) * 128 * (-(-(h // blk) // 4) * 4)


@pytest.mark.parametrize("rows, cols", [(256, 16), (200, 9), (128, 4), (1, 1), (384, 7)])
def test_scale_swizzle_matches_the_drops_to_blocked(ks, rows, cols):
    from shim.sm100.weights import swizzle_scales, unswizzle_scales

    g = torch.Generator().manual_seed(rows * 31 + cols)
    raw = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=g)
    for dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu):
        mine = swizzle_scales(raw.view(dtype))
        theirs = ks.to_blocked(raw.view(dtype))
        assert same_bytes(mine, theirs)
        assert same_bytes(unswizzle_scales(mine, rows, cols), raw.view(dtype))
        assert same_bytes(ks.from_blocked(mine, rows, cols), raw.view(dtype))


def test_scale_swizzle_per_expert_equals_the_runners_stacking(ks):
    from shim.sm100.weights import swizzle_scales

    raw = torch.randint(0, 256, (4, 192, 12), dtype=torch.uint8).view(torch.float8_e4m3fn)
    stacked = torch.stack([ks.to_blocked(raw[e]).view(torch.uint8) for e in range(4)]).view(torch.float8_e4m3fn)
    assert same_bytes(swizzle_scales(raw), stacked)


def test_unswizzle_rejects_a_wrong_size():
    from shim.sm100.weights import unswizzle_scales

    with pytest.raises(ValueError, match="has 512 entries, got 500"):
        unswizzle_scales(torch.zeros(500, dtype=torch.uint8), 128, 4)


def test_e2m1_pairs_decode_as_the_drop_decodes_them(ks):
    """The packed kernel view, decoded by the drop's unpack_fp4_to_f32, is the reference's e2m1 values."""
    e, h, i = 2, 128, 64
    w13, w2 = canonical_weights(e, h, i)
    kw = _prepare("nvfp4", w13, w2)
    ref = packs.quantize_weights("nvfp4", w13, w2, **CAL["nvfp4"])
    fc1_rows = codecs.interleave_gate_up(ref.w13_q, 16)  # [E, 2I, H] codes in kernel row order
    for x in range(e):
        got = ks.unpack_fp4_to_f32(kw.fc1[x])  # (H, 2I): the drop finds the packed (contiguous) axis itself
        assert torch.equal(got, codecs.e2m1_decode(fc1_rows[x]).t())
        got2 = ks.unpack_fp4_to_f32(kw.fc2[x])  # (I, H)
        assert torch.equal(got2, codecs.e2m1_decode(ref.w2_q[x]).t())


def test_pack_e2m1_round_trips_every_code_pair():
    from shim.sm100.weights import pack_e2m1, unpack_e2m1

    codes = torch.cartesian_prod(torch.arange(16), torch.arange(16)).to(torch.uint8).reshape(16, 32)
    packed = pack_e2m1(codes)
    assert packed.dtype == torch.float4_e2m1fn_x2 and tuple(packed.shape) == (16, 16)
    assert torch.equal(packed.view(torch.uint8)[0, :2], torch.tensor([0x00, 0x10], dtype=torch.uint8))
    assert torch.equal(unpack_e2m1(packed), codes)
    with pytest.raises(ValueError, match="even"):
        pack_e2m1(torch.zeros(3, 5, dtype=torch.uint8))


@pytest.mark.parametrize("fmt, group", [("nvfp4", 16), ("mxfp8", 32), ("bf16", 32)])
def test_gate_up_pairing_is_the_one_the_drops_swiglu_fold_reads(ks, fmt, group):
    """FC1 computed with the kernel's row order and folded the drop's way is SwiGLU(gate, up) of the
    canonical rows: the interleave puts each gate row opposite its own up row."""
    assert layout(fmt).interleave == group
    h, i = 64, 4 * group
    g = torch.Generator().manual_seed(group)
    w13 = torch.randn(1, 2 * i, h, generator=g)
    x = torch.randn(5, h, generator=g)
    fc1_kernel_order = x @ codecs.interleave_gate_up(w13, group)[0].t()
    folded = ks.swiglu_fold_interleave(fc1_kernel_order, group)
    assert torch.allclose(folded, ffn.swiglu(x @ w13[0].t(), None), rtol=1e-6, atol=1e-6)


def test_mxfp8_reference_quantizer_is_the_drops_bit_for_bit(ks):
    """Against the drop's row quantizer (per-32 scales along K). Block amaxes here stay above 1e-30, where
    moe_ep's reference clamps; 0.7.4's helper takes the exact exponent of any smaller amax as well."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-20, 20, 64).reshape(64, 1)
    x[3, :32] = 0.0
    x[5, 40] = 448.0 * 2 ** 10
    x = x.to(torch.bfloat16).to(torch.float32)
    q_ref, s_ref = codecs.mxfp8_quantize(x)
    q_drop, s_drop = ks.mxfp8_quantize_per_block_32_row(x, torch.float8_e4m3fn)
    assert same_bytes(q_ref, q_drop) and same_bytes(s_ref, s_drop)


def test_nvfp4_epilogue_scalars_are_the_oracles_alphas():
    w13, w2 = canonical_weights()
    kw = _prepare("nvfp4", w13, w2)
    ref = packs.quantize_weights("nvfp4", w13, w2, **CAL["nvfp4"])
    e = ref.num_experts
    for x in range(e):
        # The oracle computes alpha per expert exactly this way (ffn.expert_ffn).
        assert same_bytes(kw.fc1_alpha[x], codecs.nvfp4_alpha(ref.act_scale[0], ref.w13_global_scale[x]))
        assert same_bytes(kw.fc2_alpha[x], codecs.nvfp4_alpha(ref.fc2_act_scale[x], ref.w2_global_scale[x]))
    assert same_bytes(kw.fc1_norm_const, ref.fc2_act_scale)
    for t in (kw.fc1_alpha, kw.fc2_alpha, kw.fc1_norm_const):
        assert t.dtype == torch.float32 and tuple(t.shape) == (e,) and t.is_contiguous()


def test_nvfp4_needs_calibration():
    from moe_ep.errors import CalibrationError

    w13, w2 = canonical_weights()
    with pytest.raises(CalibrationError) as err:
        layout("nvfp4").from_bf16(w13, w2, torch.device("cpu"), act_amax=1.0)
    assert err.value.argument == "fc2_act_amax"


def test_a_pack_of_another_format_is_refused():
    from moe_ep.errors import FormatError

    with pytest.raises(FormatError) as err:
        layout("mxfp8").from_pack(packs.quantize_weights("fp8_block", *canonical_weights()), torch.device("cpu"))
    assert err.value.argument == "weights.qw.fmt"


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
