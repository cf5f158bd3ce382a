"""The Bazel entry of every GPU multirank suite, whatever the arch: check the host has the GPUs, then start
N ranks (tools/launch), one GPU each, each running the suite's pytest file. The suites fail, never skip,
without the GPUs they exist to run on. (The per-rank fixtures live with the tests: tests/support/gpu.py.)"""

from __future__ import annotations

import os
import sys
from typing import Optional

__all__ = ["ARCH_MAJOR", "gpus_missing", "run_suite"]

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


def run_suite(arch: str, suite: str) -> int:
    """Bazel entry: N ranks (default 4, $MOE_EP_NPROC), one GPU each, each running the pytest file `suite`."""
    nproc = int(os.environ.get("MOE_EP_NPROC", "4"))
    missing = gpus_missing(arch, nproc)
    if missing:
        print(f"FAILED: {missing}", file=sys.stderr, flush=True)
        return 1
    from tools.launch.launcher import main as launch

    return launch(["--nproc", str(nproc), "--device", "cuda", "--", suite, "-q", "-x", "-p", "no:cacheprovider"])
