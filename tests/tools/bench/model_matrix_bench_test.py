"""The model matrix bench's CPU mode (the torch reference in the kernels' place): a served and a refused
architecture through the same command the H200 runs, rows written as they finish, the table and the exit status
(0: every row within its bound or refused by name); and a budget that cuts the run short reports the rows it did
not run instead of passing them. What the kernels measure is the GPU run's business (docs/models.md)."""
import json
import os
import subprocess
import sys

import pytest


def _run(out, *args):
    return subprocess.run([sys.executable, "-m", "tools.bench.model_matrix", "--device", "cpu", "--out", str(out),
                           "--archs", "mixtral", "gemma4", "--cases", "torch_reference:bf16", *args],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "MOE_EP_DEVICE": "cpu"})


def test_cpu_run_writes_rows_and_the_table(tmp_path):
    res = _run(tmp_path, "--against", "transformers", "torch_reference")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "model_matrix.jsonl").read_text().splitlines()]
    by = {(r["arch"], r["against"]): r for r in rows}
    served = by[("mixtral", "transformers")]
    assert served["status"] == "served" and served["ok"] and served["backend"] == "torch_reference"
    assert 0 < served["prefill_rel_logits_err"] <= served["logits_tol"]  # bf16 against transformers: not zero
    assert by[("mixtral", "torch_reference")]["ok"]
    assert by[("gemma4", "transformers")]["status"] == "refused"
    table = (tmp_path / "model_matrix.md").read_text()
    assert "| mixtral | served | ok " in table and "| gemma4 | refused: Gemma4TextExperts" in table


def test_a_spent_budget_is_reported_not_passed(tmp_path):
    res = _run(tmp_path, "--against", "transformers", "--budget-s", "0")
    assert res.returncode == 1
    assert "| mixtral | not run | not checked: the run's time budget was spent |" in (
        tmp_path / "model_matrix.md").read_text()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"] + sys.argv[1:]))
