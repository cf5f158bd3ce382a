"""Bazel entry of the Hopper GPU multirank suite: N ranks (default 4, $MOE_EP_NPROC), one GPU each.

Fails, never skips, when the host lacks the GPUs: the suite exists to run on them.
"""
import os
import sys

import torch

from tools.launch.launcher import main as launch


def run(arch: str, suite: str) -> int:
    nproc = int(os.environ.get("MOE_EP_NPROC", "4"))
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < nproc:
        print(f"FAILED: the {arch} multirank suite needs {nproc} {arch} GPUs (set MOE_EP_NPROC for fewer); "
              f"found {found} CUDA device(s) on this host", file=sys.stderr)
        return 1
    major, _ = torch.cuda.get_device_capability(0)
    want = {"sm90": 9, "sm100": 10}[arch]
    if major != want:
        print(f"FAILED: the {arch} multirank suite needs {arch} GPUs; device 0 is "
              f"{torch.cuda.get_device_name(0)} (compute capability {major}.x)", file=sys.stderr)
        return 1
    suite_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), suite)
    return launch(["--nproc", str(nproc), "--device", "cuda", "--", suite_path, "-q", "-x", "-p", "no:cacheprovider"])


if __name__ == "__main__":
    raise SystemExit(run("sm90", "sm90_multirank_test.py"))
