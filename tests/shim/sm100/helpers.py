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


def layout(fmt):
    """The format's Blackwell weight layout (its frontend's KernelWeights class)."""
    from shim.sm100.formats import BACKENDS

    return BACKENDS.row(fmt).frontend_class().weights_layout


def same_bytes(a, b) -> bool:
    """Bitwise equality, dtype and shape included (also for 1-byte float types torch cannot compare)."""
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


BACKEND_FOR_FMT = {"nvfp4": "sm100_nvfp4_cutedsl", "mxfp8": "sm100_mxfp8_cutedsl", "bf16": "sm100_bf16_cutedsl"}


def spec_of(*, hidden, intermediate, experts_per_rank, top_k, capacity, world_size=1):
    import moe_ep

    return moe_ep.MoESpec(hidden_size=hidden, intermediate_size=intermediate,
                          num_experts=experts_per_rank * world_size, top_k=top_k, max_tokens_per_rank=capacity)


def compile_only(fmt, *, knobs=None, world_size=1, rank=0, **geom):
    """The frontend a layer of the `fmt` backend builds for this geometry, built for a CPU compile."""
    from shim.common.backend import compile_only_frontend

    backend = BACKEND_FOR_FMT.get(fmt, "sm100_bf16_cutedsl")
    return compile_only_frontend(backend, spec_of(world_size=world_size, **geom), fmt=fmt, knobs=knobs,
                                 rank=rank, world_size=world_size)


def expert_weights(w13, w2, *, rank=0, world_size=1, act_amax=None, fc2_act_amax=None):
    """One rank's moe_ep.ExpertWeights from its [E_local, ...] slices (the calibration NVFP4 needs)."""
    import moe_ep

    return moe_ep.ExpertWeights(w13=w13, w2=w2, rank=rank, world_size=world_size,
                                num_experts=w13.shape[0] * world_size, act_amax=act_amax, fc2_act_amax=fc2_act_amax)
