"""The fused FP8 staging kernel on the GPU: the same e4m3 bytes and fp32 scale bits as moe_ep's reference quantizer
run by torch on that GPU, on random data (every block at its own scale, 1e-6 .. 1e4) with the edge-case rows mixed
in, at the frontend's shapes; the same inside a CUDA graph; nothing written outside rows [0, T) and columns
[0, H/128); and the kernel equal to its CPU simulation. Fails, never skips, without the GPU or Triton.
The full matrix with timings and per-step diagnosis: tools/diag/fp8_staging_check.py."""

import os

import pytest
import torch

from shim.sm90 import fp8_staging as fs
from tools.diag.fp8_staging_check import random_x

ref = fs._ref
ARCH_MAJOR = {"sm90": 9, "sm100": 10}
U8 = torch.uint8


@pytest.fixture(scope="module")
def dev():
    arch = os.environ.get("MOE_EP_ARCH", "sm90")
    if not torch.cuda.is_available():
        pytest.fail("fp8_staging GPU test needs a CUDA GPU; found none", pytrace=False)
    if torch.cuda.get_device_capability(0)[0] != ARCH_MAJOR[arch]:
        pytest.fail(f"needs an {arch} GPU, found {torch.cuda.get_device_name(0)}", pytrace=False)
    if not fs.available():
        pytest.fail(f"fused staging unavailable: {fs.unavailable_reason()}", pytrace=False)
    return torch.device("cuda", 0)


def _x(t, h, seed, dev):
    """The diagnostic's random inputs, with as many edge-case rows as fit in t."""
    return random_x(t, h, seed, dev, edge_rows=t)


def _buffers(t, h, dev):
    nb = h // 128
    q = torch.full((t + 3, h), 0xA5, dtype=U8, device=dev).view(torch.float8_e4m3fn)
    s = torch.full((t + 3, (nb + 3) // 4 * 4), -7.0, device=dev)
    return q, s


def _assert_staged(x, q, s):
    t, h = x.shape
    nb = h // 128
    rq, rs = ref.fp8_quantize_rows(x, 128, reciprocal=False)
    bad_q = q[:t].view(U8) != rq.view(U8)
    bad_s = s[:t, :nb].contiguous().view(torch.int32) != rs.view(torch.int32)
    assert not bad_q.any(), f"{int(bad_q.sum())} e4m3 byte(s) differ, first at {bad_q.nonzero()[0].tolist()}"
    assert not bad_s.any(), f"{int(bad_s.sum())} scale(s) differ, first at {bad_s.nonzero()[0].tolist()}"
    assert (q[t:].view(U8) == 0xA5).all() and (s[t:] == -7.0).all() and (s[:, nb:] == -7.0).all()


@pytest.mark.parametrize("t, h", [(1, 7168), (7, 512), (128, 7168), (1000, 2048), (4096, 7168), (33, 128)])
def test_fused_bytes_equal_the_reference_on_the_gpu(dev, t, h):
    x = _x(t, h, seed=t * 31 + h, dev=dev)
    q, s = _buffers(t, h, dev)
    fs.stage_fp8_blocks(x, q, s, backend="triton")
    _assert_staged(x, q, s)


def test_fused_in_a_cuda_graph(dev):
    t, h = 512, 7168
    x = _x(t, h, seed=1, dev=dev)
    q, s = _buffers(t, h, dev)
    fs.stage_fp8_blocks(x, q, s, backend="triton")  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fs.stage_fp8_blocks(x, q, s, backend="triton")
    x.copy_(_x(t, h, seed=2, dev=dev))
    q.view(U8)[:t].fill_(0)
    graph.replay()
    torch.cuda.synchronize()
    _assert_staged(x, q, s)


def test_zero_tokens_write_nothing(dev):
    q, s = _buffers(4, 256, dev)
    fs.stage_fp8_blocks(torch.empty(0, 256, dtype=torch.bfloat16, device=dev), q, s, backend="triton")
    torch.cuda.synchronize()
    assert (q.view(U8) == 0xA5).all() and (s == -7.0).all()


def test_kernel_equals_its_cpu_simulation(dev):
    x = _x(64, 7168, seed=3, dev=dev)
    q, s = _buffers(64, 7168, dev)
    fs.stage_fp8_blocks(x, q, s, backend="triton")
    sq, ss = fs.simulate_fused(x.cpu())
    got_q, got_s = q[:64].view(U8).cpu(), s[:64, :56].cpu()
    # across devices a NaN's sign and payload are the platform's (x86 division returns an operand NaN): NaN codes
    # (0x7F / 0xFF) and NaN scales only have to be NaN on both sides; everything else bit for bit
    nan_q = ((got_q & 0x7F) == 0x7F) & ((sq & 0x7F) == 0x7F)
    assert ((got_q == sq) | nan_q).all()
    assert torch.equal(torch.isnan(got_s), torch.isnan(ss))
    assert (torch.isnan(ss) | (got_s.contiguous().view(torch.int32) == ss.view(torch.int32))).all()


@pytest.mark.parametrize("t, h", [(1, 7168), (8, 512), (1000, 7168), (4096, 2048)])
def test_fused_per_row_bytes_equal_the_reference_on_the_gpu(dev, t, h):
    """The W4A8 FC1 input: one scale per row, replicated over 4 columns; NaN rows compared as NaN."""
    x = _x(t, h, seed=t * 17 + h, dev=dev)
    q = torch.full((t + 3, h), 0xA5, dtype=U8, device=dev).view(torch.float8_e4m3fn)
    s = torch.full((t + 3, 4), -7.0, device=dev)
    fs.launch_fused_rows(x, q, s)
    rq, rs = ref.fp8_quantize_rows(x, h, reciprocal=False)
    assert torch.equal(q[:t].view(U8), rq.view(U8))
    nan = torch.isnan(rs[:, 0])
    assert torch.equal(torch.isnan(s[:t]), nan.unsqueeze(1).expand(t, 4))
    assert torch.equal(s[:t][~nan].view(torch.int32), rs[~nan].expand(-1, 4).contiguous().view(torch.int32))
    assert (q[t:].view(U8) == 0xA5).all() and (s[t:] == -7.0).all()


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
