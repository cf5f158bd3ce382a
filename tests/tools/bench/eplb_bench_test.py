"""The EPLB benchmark's correctness on CPU ranks (gloo, torch reference): every phase agrees with the oracle, the
swapped layer holds a fresh layer's bytes, and the load counters show what the rearrangement was for -- the busiest
rank's share of routed pairs drops from ~0.71 (the hot expert on rank 0) to ~0.5. Times are the GPU run's business
(tools/bench/eplb_bench.py; docs/eplb.md), not asserted here."""
import json
import os
import subprocess
import sys

import pytest

from tools.launch.launcher import launch


def _read(out):
    data = json.loads((out / "eplb.json").read_text())
    assert (out / "eplb.png").stat().st_size > 0 and (out / "eplb.csv").exists()
    return data["rows"]


def test_two_ranks_rebalance_the_hot_expert(tmp_path):
    args = ["-m", "tools.bench.eplb_bench", "--tokens", "64", "--iters", "2", "--out", str(tmp_path)]
    results = launch(args, 2, device="cpu", timeout_s=300)
    assert all(r.returncode == 0 for r in results), [r.output[-3000:] for r in results]
    (row,) = _read(tmp_path)
    assert row["world_size"] == 2 and row["backend"] == "torch_reference"
    assert row["oracle_plain"] and row["oracle_before"] and row["oracle_after"] and row["swap_bytes_equal_fresh"]
    assert 0.64 < row["max_rank_share_before"] < 0.78  # 1/2 + 1/2 * 3/7, sampled
    assert row["max_rank_share_after"] < 0.56  # 1/2, sampled
    assert "| 64 |" in results[0].output  # the table is printed


def test_one_rank_two_replicas_smoke(tmp_path):
    """World size 1 (what the lead runs on one H200 as a smoke test of the kernel path with slots)."""
    res = subprocess.run([sys.executable, "-m", "tools.bench.eplb_bench", "--tokens", "16", "32", "--iters", "2",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "MOE_EP_DEVICE": "cpu"})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    rows = _read(tmp_path)
    assert [r["T"] for r in rows] == [16, 32]
    for r in rows:
        assert r["oracle_before"] and r["oracle_after"] and r["swap_bytes_equal_fresh"]
        assert r["max_rank_share_before"] == r["max_rank_share_after"] == 1.0


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
