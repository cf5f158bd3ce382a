"""Bazel entry of the Blackwell GPU multirank suite: N ranks (default 4, $MOE_EP_NPROC), one sm100 GPU each,
started by tools/launch; each rank runs multirank_gpu_test.py.

`bazel test //tests:multirank --config=blackwell` runs it. It fails, never skips, when the host lacks the
GPUs: the suite exists to run on them, and a pass without running would say nothing.
"""
import os
import sys


def blackwell_gpus_missing(nproc: int):
    """None when this host has `nproc` sm100 GPUs, else the message saying what it has."""
    import torch

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    caps = [torch.cuda.get_device_capability(i) for i in range(found)]
    blackwell = sum(1 for major, _ in caps if major == 10)
    if blackwell >= nproc:
        return None
    what = ", ".join(f"cuda:{i} {torch.cuda.get_device_name(i)} (sm_{a}{b})" for i, (a, b) in enumerate(caps))
    return (f"the sm100 multirank suite needs {nproc} sm100 GPUs; found {found} CUDA device(s)"
            + (f", {blackwell} of them sm100: {what}" if found else "")
            + " (MOE_EP_NPROC sets the rank count)")


def main() -> int:
    nproc = int(os.environ.get("MOE_EP_NPROC", "4"))
    missing = blackwell_gpus_missing(nproc)
    if missing:
        print(f"FAILED: {missing}", file=sys.stderr, flush=True)
        return 1
    from tools.launch.launcher import main as launch

    suite = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multirank_gpu_test.py")
    return launch(["--nproc", str(nproc), "--device", "cuda", "--", suite, "-q", "-x", "-p", "no:cacheprovider"])


if __name__ == "__main__":
    raise SystemExit(main())
