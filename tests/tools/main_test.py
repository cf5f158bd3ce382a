"""The main job's model mode (#24.7): a tiny random transformers model on 2 CPU ranks generates on moe_ep next to
its own experts; the job prints both token streams per rank and their agreement, and exits 0 only when the check
passes. Run as a user would (a subprocess of `python -m tools.main`)."""

import os
import subprocess
import sys

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_model_mode_prints_both_generations_and_their_agreement():
    # `python -m` from ROOT puts ROOT on the child's path itself; the rest of this process's path is forwarded.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    res = subprocess.run([sys.executable, "-m", "tools.main", "--model", "qwen3_moe", "--new-tokens", "6"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = res.stdout
    assert res.returncode == 0, out + res.stderr[-3000:]
    assert "tiny random qwen3_moe" in out and "2 rank(s) on cpu" in out and "torch_reference (bf16)" in out
    lines = [line.split() for line in out.splitlines()]
    ranks = [cells for cells in lines if cells and cells[0] in ("0", "1")]
    assert len(ranks) == 2
    for cells in ranks:
        # rank, 12 prompt ids, 6 of transformers', 6 of moe_ep's, same, err, check
        assert len(cells) == 1 + 12 + 6 + 6 + 3, cells
        ref, ours, same = cells[13:19], cells[19:25], cells[25]
        matched = int(same.split("/")[0])
        assert ref[:matched] == ours[:matched] and same.endswith("/6") and cells[-1] == "ok"
    assert "agreement: PASS" in out


if __name__ == "__main__":
    import pytest

    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
