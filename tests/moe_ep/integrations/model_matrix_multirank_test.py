"""The model matrix (model_matrix_test.py) at world size 2: one launch of two gloo ranks runs every MoE
architecture of the installed transformers through swap_experts, each rank with its own prompts and batch size
and its half of the experts; every row served within bf16's bound of transformers or refused with an
IntegrationError, and both ranks reach the same verdict."""

import sys

import pytest

pytest.importorskip("transformers", reason="the matrix is transformers' own architectures")


def test_world_size_2_served_within_bound_or_refused_by_name_on_both_ranks():
    from moe_ep.testing import hf_matrix
    from tools.launch.launcher import launch_function

    per_rank = launch_function("moe_ep.testing.hf_matrix:run_matrix", 2, {}, device="cpu", timeout_s=1500)
    r0, r1 = per_rank
    print("\n" + hf_matrix.table(r0 + r1))
    assert [r["arch"] for r in r0] == [r["arch"] for r in r1] == [a for a, _, _ in hf_matrix.moe_architectures()]
    problems = {f"{r['arch']}@{r['rank']}": p for r in r0 + r1 for p in hf_matrix.verdict_problems(r)}
    assert not problems, problems
    assert [r["status"] for r in r0] == [r["status"] for r in r1]
    assert any(r["status"] == "served" for r in r0) and any(r["status"] == "refused" for r in r0)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-s", "-p", "no:cacheprovider"] + sys.argv[1:]))
