"""GPU suites: one process per rank, started by tools/launch (or plain pytest for world size 1).

They never skip for want of a GPU: a GPU suite that cannot find the GPUs it needs fails, and says so.
"""
import json
import os

import pytest


@pytest.fixture(scope="session")
def dist_ctx():
    import torch.distributed as dist

    from tools.launch.gpu_suite import init_rank_group

    yield init_rank_group(os.environ.get("MOE_EP_ARCH", "sm90"))
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
