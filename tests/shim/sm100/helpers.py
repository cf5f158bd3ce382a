"""Helpers shared by the sm100 CPU tests."""
import torch


def canonical_weights(e=3, h=256, i=128, seed=0):
    """bf16 expert weights with the awkward cases in them: an all-zero block, an outlier, a tiny block."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h ** 0.5
    w2 = torch.randn(e, h, i, generator=g) / i ** 0.5
    w13[0, 3, :32] = 0.0  # a zero block for every block size used here
    w13[e - 1, 7, 5] = 40.0  # an outlier: sets the expert's global scale, saturates nothing
    w2[e - 1, 9, 32:64] *= 1e-6  # a block far below its neighbours
    return w13.to(torch.bfloat16), w2.to(torch.bfloat16)


def same_bytes(a, b) -> bool:
    """Bitwise equality, dtype and shape included (also for 1-byte float types torch cannot compare)."""
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))
