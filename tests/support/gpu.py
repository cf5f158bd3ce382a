"""What every GPU suite shares, whatever the arch: the per-rank process group, the per-case JSON log and a
fresh seed that is the same on every rank. Import the fixtures into a suite module:

    from tests.support.gpu import case_log, dist_ctx, shared_seed  # noqa: F401 (pytest fixtures)

The suites run one process per rank (tools/launch) or, at world size 1, under plain pytest. They never skip
for want of a GPU: a GPU suite that cannot find the GPUs it needs fails, and says so.
"""
import datetime
import json
import os

import pytest

__all__ = ["dist_ctx", "case_log", "shared_seed", "CaseLog", "init_rank_group"]


def init_rank_group(arch: str):
    """(rank, world size): this rank's GPU and torch.distributed group (gloo for objects, NCCL for tensors),
    from the launcher's env, or a one-rank group of its own under plain pytest. Fails the test when the rank's
    GPU is missing or of another arch."""
    import torch
    import torch.distributed as dist

    from tools.launch.gpu import ARCH_MAJOR
    from tools.launch.launcher import free_port

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    local = int(os.environ["LOCAL_RANK"])
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n <= local or torch.cuda.get_device_capability(local)[0] != ARCH_MAJOR[arch]:
        found = "" if n <= local else f" ({torch.cuda.get_device_name(local)})"
        pytest.fail(f"rank {os.environ['RANK']} needs an {arch} GPU at cuda:{local}; found {n} CUDA device(s)"
                    + found, pytrace=False)
    torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group("cpu:gloo,cuda:nccl", timeout=datetime.timedelta(seconds=300),
                                device_id=torch.device("cuda", local))
    return dist.get_rank(), dist.get_world_size()


@pytest.fixture(scope="session")
def dist_ctx():
    import torch.distributed as dist

    yield init_rank_group(os.environ.get("MOE_EP_ARCH", "sm90"))
    dist.barrier()
    dist.destroy_process_group()


class CaseLog:
    """Every case's figures, one JSON line each on stdout and, where $MOE_EP_GPU_LOG points, in
    <path>.rank<r>.jsonl (one file per rank)."""

    def __init__(self):
        path = os.environ.get("MOE_EP_GPU_LOG")
        self.path = f"{path}.rank{os.environ.get('RANK', '0')}.jsonl" if path else None

    def __call__(self, **row):
        line = json.dumps(row)
        print(line, flush=True)
        if self.path:
            with open(self.path, "a") as f:
                f.write(line + "\n")


@pytest.fixture(scope="session")
def case_log():
    return CaseLog()


@pytest.fixture
def shared_seed(dist_ctx):
    """A callable: fresh on every call and every run, the same on every rank (so the routings are one
    problem), plus `salt` (a suite adds its rank to get per-rank data). Logged with each case."""
    import torch
    import torch.distributed as dist

    def draw(salt: int = 0) -> int:
        s = torch.tensor([int.from_bytes(os.urandom(4), "little") >> 1], dtype=torch.int64, device="cuda")
        dist.broadcast(s, src=0)
        return int(s.item()) + salt

    return draw
