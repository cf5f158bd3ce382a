"""A one-rank gloo process group for the CPU tests that build a layer in their own process (a file store in a
temporary directory, so parallel test targets never meet on a port)."""
import contextlib
import datetime
import tempfile

__all__ = ["one_rank_gloo_group"]


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
