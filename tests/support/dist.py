"""A one-rank gloo process group for the CPU tests that build a layer in their own process (a file store in a
temporary directory, so parallel test targets never meet on a port), as a context and as a module-scoped fixture
named `group` (`from tests.support.dist import group_fixture  # noqa: F401`); random bf16 experts for such a
layer."""
import contextlib
import datetime
import tempfile

import pytest

__all__ = ["group_fixture", "one_rank_gloo_group", "one_rank_weights"]


@contextlib.contextmanager
def one_rank_gloo_group(timeout_s: float = 60.0):
    """Rank 0 of a world of one for the duration of the block; the process must hold no group yet."""
    import torch.distributed as dist

    assert not dist.is_initialized(), "a process group already exists in this process"
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=timeout_s))
        try:
            yield
        finally:
            dist.destroy_process_group()


@pytest.fixture(scope="module", name="group")
def group_fixture():
    """`group`: the one-rank group for a test module's layers (imported under this name, so that the tests' `group`
    argument shadows no import)."""
    with one_rank_gloo_group():
        yield


def one_rank_weights(e: int, h: int, i: int, scale: float, seed: int = 0):
    """All e experts on rank 0 of a world of one: w13 [e, 2i, h] and w2 [e, h, i], standard normal / scale, bf16."""
    import torch

    import moe_ep

    g = torch.Generator().manual_seed(seed)
    return moe_ep.ExpertWeights((torch.randn(e, 2 * i, h, generator=g) / scale).to(torch.bfloat16),
                                (torch.randn(e, h, i, generator=g) / scale).to(torch.bfloat16), 0, 1, e)
