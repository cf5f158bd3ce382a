"""Bazel entry of the Hopper GPU multirank suite: N ranks (default 4, $MOE_EP_NPROC), one GPU each.

Fails, never skips, when the host lacks the GPUs: the suite exists to run on them.
"""
import os

from tools.launch.gpu import run_suite

if __name__ == "__main__":
    raise SystemExit(run_suite("sm90", os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                    "multirank_gpu_test.py")))
