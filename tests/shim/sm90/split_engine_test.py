"""The split path's fused_fp8 engine on a CPU host: its frontend stages rows quantized at their source into exactly
the bytes the FP8 frontend's own staging writes for the same bf16 rows (so the kernel's inputs do not change with the
wire), it keeps the padding words zero in the shared arena, and the engine is refused off a Hopper GPU by a typed
error, at the layer too. Its GPU run: tools/bench/split_bench.py (bitwise against the fused layer)."""
import sys

import pytest
import torch

import moe_ep
from moe_ep.formats import codecs
from tests.support.dist import one_rank_gloo_group, one_rank_weights

pytestmark = pytest.mark.usefixtures("sm90_tree")


def _frontend(cls, c, h):
    fe = object.__new__(cls)
    fe.act = torch.zeros(c, h, dtype=torch.float8_e4m3fn)
    fe.act_sf = torch.full((c, -(-(h // 128) // 4) * 4), float("nan"), dtype=torch.float32)
    fe.staging = "torch"
    return fe


@pytest.mark.parametrize("h", [256, 7168])
def test_prestaged_rows_stage_the_bytes_the_bf16_staging_writes(h):
    from shim.sm90.fp8_frontend import Sm90Fp8Frontend
    from shim.sm90.split_engine import Sm90Fp8PrestagedFrontend

    g = torch.Generator().manual_seed(h)
    t, c = 13, 16
    x = (torch.randn(t, h, generator=g) * torch.logspace(-3, 3, t).unsqueeze(1)).to(torch.bfloat16)
    own = _frontend(Sm90Fp8Frontend, c, h)
    own.stage_activations(x)
    pre = _frontend(Sm90Fp8PrestagedFrontend, c, h)
    q, s = codecs.fp8_quantize_rows(x, 128, reciprocal=False)  # what the split path quantizes at the source
    pre.prestaged = (q, s)
    pre.stage_activations(x.new_zeros(1, h).expand(t, -1))  # the shape alone
    assert torch.equal(pre.act[:t].view(torch.uint8), own.act[:t].view(torch.uint8))
    assert torch.equal(pre.act_sf[:t], own.act_sf[:t])  # scales and zeroed padding words alike
    assert torch.isnan(pre.act_sf[t:]).all()  # nothing past the call's rows


def test_the_engine_is_refused_off_a_hopper_gpu():
    from shim.sm90.split_engine import FusedFp8WireEngine

    spec = moe_ep.MoESpec(256, 128, 8, 4, 32)
    with pytest.raises(moe_ep.BackendUnavailableError, match="Hopper FP8 kernel"):
        FusedFp8WireEngine.check(spec, "fp8_block", torch.device("cpu"), {})
    with pytest.raises(moe_ep.FormatError):
        FusedFp8WireEngine.check(spec, "bf16", torch.device("cpu"), {})
    with one_rank_gloo_group():
        with pytest.raises(moe_ep.BackendUnavailableError, match="fused_fp8"):
            moe_ep.MoELayer(spec, one_rank_weights(8, 256, 128, 16.0), backend="split", fmt="fp8_block",
                            engine="fused_fp8")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
