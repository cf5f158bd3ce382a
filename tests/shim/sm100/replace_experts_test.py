"""Experts swapped in place in the Blackwell kernel layouts (KernelWeights.replace_experts, moe_ep's EPLB swap):
every kernel tensor keeps its address and, byte for byte, equals a fresh load of the new expert set (NVFP4 pairs,
swizzled block scales, the per-expert epilogue scalars included); the pack a layout was loaded from is never
written."""
import pytest
import torch

from moe_ep.formats import packs
from tests.shim.sm100.helpers import canonical_weights, layout, same_bytes

pytestmark = pytest.mark.usefixtures("sm100_tree")

CAL = {"nvfp4": dict(act_amax=6.5, fc2_act_amax=0.75)}


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8", "bf16"])
def test_a_swap_leaves_the_bytes_of_a_fresh_load_at_the_same_addresses(fmt):
    from dataclasses import fields

    w13, w2 = canonical_weights(4)
    n13, n2 = canonical_weights(2, seed=3)
    cpu = torch.device("cpu")
    kw = layout(fmt).from_bf16(w13, w2, cpu, expert_offset=4, **CAL.get(fmt, {}))
    names = [f.name for f in fields(kw) if isinstance(getattr(kw, f.name), torch.Tensor)]
    ptrs = {n: getattr(kw, n).data_ptr() for n in names}
    slots = [2, 1]
    kw.replace_experts(slots, packs.quantize_weights(fmt, n13, n2, **CAL.get(fmt, {})))
    want13, want2 = w13.clone(), w2.clone()
    want13[slots], want2[slots] = n13, n2
    fresh = layout(fmt).from_bf16(want13, want2, cpu, expert_offset=4, **CAL.get(fmt, {}))
    for n in names:
        assert getattr(kw, n).data_ptr() == ptrs[n], n
        assert same_bytes(getattr(kw, n), getattr(fresh, n)), (fmt, n)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8", "bf16"])
def test_a_swap_writes_the_layouts_own_tensors_not_the_pack_it_was_loaded_from(fmt):
    """A checkpoint's pack (a loader may reuse its buffers for the next layer) and the layout share no storage."""
    cpu = torch.device("cpu")
    qw = packs.quantize_weights(fmt, *canonical_weights(4), **CAL.get(fmt, {}))
    before = {n: getattr(qw, n).clone() for n in qw.tensor_fields()}
    kw = layout(fmt).from_pack(qw, cpu)
    kw.replace_experts([0, 3], packs.quantize_weights(fmt, *canonical_weights(2, seed=5), **CAL.get(fmt, {})))
    for n in qw.tensor_fields():
        assert same_bytes(getattr(qw, n), before[n]), (fmt, n)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
