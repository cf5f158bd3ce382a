"""The blockwise _scaled_mm probe needs a Hopper GPU: without one it says so in one line and exits 2, before it
touches anything (its cases run on the device: `python -m tools.bench.scaled_mm_probe`)."""
import os
import subprocess
import sys

import pytest


def test_without_a_gpu_it_refuses_in_one_line():
    res = subprocess.run([sys.executable, "-m", "tools.bench.scaled_mm_probe"], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "cuda" in lines[0].lower(), res.stderr
    assert "--" not in res.stdout  # no section started


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
