"""Bazel entry of the Blackwell GPU multirank suite: N ranks (default 4, $MOE_EP_NPROC), one sm100 GPU each,
started by tools/launch; each rank runs multirank_gpu_test.py.

`bazel test //tests:multirank --config=blackwell` runs it. It fails, never skips, when the host lacks the
GPUs: the suite exists to run on them, and a pass without running would say nothing.
"""
import os

from tools.launch.gpu import run_suite

if __name__ == "__main__":
    raise SystemExit(run_suite("sm100", os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                     "multirank_gpu_test.py")))
