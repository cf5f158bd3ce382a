"""The split benchmark's CPU mode (tiny geometry, the torch reference in the fused kernel's place): every step of
the GPU run executes, the split path equals the whole-group backend bit for bit (eager and through the padded
exchange), auto's plan is reported, the torch engines' errors are those of their own numerics, and the table, JSON
and plot are written. Times are the GPU run's business (docs/scale-out.md), not asserted here."""
import json
import math
import os
import subprocess
import sys

import pytest


def test_cpu_dry_run_writes_the_report(tmp_path):
    res = subprocess.run([sys.executable, "-m", "tools.bench.split_bench", "--cpu", "--tokens", "16", "--iters", "1",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "MOE_EP_DEVICE": "cpu"})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    data = json.loads((tmp_path / "split_bench.json").read_text())
    assert data["notes"] == [], data["notes"]
    assert set(data["transports"]) >= {"nccl (torch)", "symm_mem.all_to_all_vdev", "nccl.ep (nccl4py)"}
    (row,) = data["rows"]
    assert row["T"] == 16 and row["capacity"] == 16
    assert row["bitwise"] and row["bitwise_captured"] and row["auto_bitwise"]
    assert row["two_level_bitwise"] and row["two_level_bitwise_captured"]  # the FP8-wire paths need the Hopper kernel
    assert row["auto_plan"] in ("torch_reference", "split")
    for key in ("fused_graph_us", "split_graph_us", "split_eager_us", "engine_fp8_block128_us",
                "engine_fp8_rowwise_us", "gemm_block128_us", "gemm_grouped_rowwise_us", "split_fp8_block128_us",
                "split_fp8_rowwise_us", "auto_graph_us", "two_level_graph_us"):
        assert math.isfinite(row[key]) and row[key] > 0, key
    assert 0 < row["err_fp8_block128"] < 0.07  # the FC2-input block and a bf16 FC1 output: near the format
    assert 0 < row["err_fp8_rowwise"] < 0.3  # another format altogether
    assert (tmp_path / "split_bench.png").stat().st_size > 0 and (tmp_path / "split_bench.csv").exists()
    assert "| T | fused_graph_us |" in (tmp_path / "split_bench.md").read_text()
    assert "| 16 |" in res.stdout


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
