"""What every GPU multirank suite needs, whatever the arch: the GPU check, the per-rank process group, and
the Bazel entry that starts N ranks. The suites fail, never skip, without the GPUs they exist to run on."""

from __future__ import annotations

import datetime
import os
import sys
from typing import Optional, Tuple

__all__ = ["ARCH_MAJOR", "gpus_missing", "init_rank_group", "run_suite"]

ARCH_MAJOR = {"sm90": 9, "sm100": 10}


def gpus_missing(arch: str, nproc: int) -> Optional[str]:
    """None when this host has `nproc` GPUs of `arch`, else the message saying what it has."""
    import torch

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    caps = [torch.cuda.get_device_capability(i) for i in range(found)]
    matching = sum(1 for major, _ in caps if major == ARCH_MAJOR[arch])
    if matching >= nproc:
        return None
    what = ", ".join(f"cuda:{i} {torch.cuda.get_device_name(i)} (sm_{a}{b})" for i, (a, b) in enumerate(caps))
    return (f"the {arch} multirank suite needs {nproc} {arch} GPUs; found {found} CUDA device(s)"
            + (f", {matching} of them {arch}: {what}" if found else "")
            + " (MOE_EP_NPROC sets the rank count)")


def init_rank_group(arch: str) -> Tuple[int, int]:
    """This rank's GPU and torch.distributed group (gloo for objects, NCCL for tensors): from the launcher's
    env, or a one-rank group of its own under plain pytest. Fails the test when the rank's GPU is missing."""
    import pytest
    import torch
    import torch.distributed as dist

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


def run_suite(arch: str, suite: str) -> int:
    """Bazel entry: N ranks (default 4, $MOE_EP_NPROC), one GPU each, each running the pytest file `suite`."""
    nproc = int(os.environ.get("MOE_EP_NPROC", "4"))
    missing = gpus_missing(arch, nproc)
    if missing:
        print(f"FAILED: {missing}", file=sys.stderr, flush=True)
        return 1
    from tools.launch.launcher import main as launch

    return launch(["--nproc", str(nproc), "--device", "cuda", "--", suite, "-q", "-x", "-p", "no:cacheprovider"])
