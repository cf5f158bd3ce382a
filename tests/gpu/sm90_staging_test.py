"""The fused FP8 staging kernel writes exactly the bytes of moe_ep's reference quantizer."""
import pytest
import torch

from moe_ep.reference import quant
from shim.sm90.fp8_staging import stage_fp8_rows, triton_available


@pytest.mark.parametrize("t,h", [(1, 512), (7, 7168), (1000, 2048), (4096, 7168)])
def test_fused_staging_is_bit_identical(t, h):
    if not torch.cuda.is_available():
        pytest.fail("needs a CUDA GPU", pytrace=False)
    assert triton_available(), "the fused path needs Triton (CUDA builds of torch bring it)"
    gen = torch.Generator(device="cuda").manual_seed(t * 31 + h)
    x = (torch.randn(t, h, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    x[0, :128] = 0  # an all-zero block: the scale floor
    if t > 2:
        x[1, 5] = 3.0e4  # one outlier per block sets its scale
        x[2, :] = -x[2, :]
    cap = t + 3
    sf_cols = (h // 128 + 3) // 4 * 4
    outs = []
    for fused in (True, False):
        q = torch.full((cap, h), 0x7F, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
        s = torch.full((cap, sf_cols), float("nan"), dtype=torch.float32, device="cuda")
        stage_fp8_rows(x, q, s, use_triton=fused)
        outs.append((q, s))
    (qf, sf), (qt, st) = outs
    assert torch.equal(qf[:t].view(torch.uint8), qt[:t].view(torch.uint8))
    assert torch.equal(sf[:t, : h // 128], st[:t, : h // 128])
    rq, rs = quant.fp8_quantize_rows(x, 128)
    assert torch.equal(qf[:t].view(torch.uint8), rq.view(torch.uint8)) and torch.equal(sf[:t, : h // 128], rs)
    assert torch.isnan(sf[t:]).all() and (qf[t:].view(torch.uint8) == 0x7F).all()  # nothing past T written


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
