"""GPU suites: one process per rank, started by tools/launch (or plain pytest for world size 1).

They never skip for want of a GPU: a GPU suite that cannot find the GPUs it needs fails, and says so.
"""
import datetime
import json
import os
import socket

import pytest
import torch


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def require_gpus(arch: str, world_size: int) -> None:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < world_size:
        pytest.fail(f"this suite needs {world_size} {arch} GPU(s); found {n} CUDA device(s)", pytrace=False)
    major, minor = torch.cuda.get_device_capability(0)
    found = f"sm{major}{minor}" if major < 10 else f"sm{major}0"
    if found != arch:
        pytest.fail(f"this suite needs {arch} GPUs; device 0 is {torch.cuda.get_device_name(0)} ({found})",
                    pytrace=False)


@pytest.fixture(scope="session")
def dist_ctx():
    """torch.distributed over NCCL: from the launcher's env, or a one-rank group of our own."""
    import torch.distributed as dist

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    world = int(os.environ["WORLD_SIZE"])
    arch = os.environ.get("MOE_EP_ARCH", "sm90")
    require_gpus(arch, world)
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if not dist.is_initialized():
        dist.init_process_group("cpu:gloo,cuda:nccl", timeout=datetime.timedelta(seconds=300),
                                device_id=torch.device("cuda", int(os.environ["LOCAL_RANK"])))
    yield dist.get_rank(), dist.get_world_size()
    dist.barrier()
    dist.destroy_process_group()


class CaseLog:
    """Every case's figures, written as JSON lines where $MOE_EP_GPU_LOG points (one file per rank)."""

    def __init__(self):
        path = os.environ.get("MOE_EP_GPU_LOG")
        if path:
            path = f"{path}.rank{os.environ.get('RANK', '0')}.jsonl"
        self.path = path

    def __call__(self, **row):
        print(json.dumps(row), flush=True)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")


@pytest.fixture(scope="session")
def case_log():
    return CaseLog()
