"""Every MoE architecture of the installed transformers (#32), read from transformers itself
(moe_ep.testing.hf_matrix.moe_architectures): a tiny random model of each through swap_experts at world size 1
(CPU, torch reference, bf16), either within bf16's bound of transformers' own logits with 16 greedy tokens identical
up to the first near-tie (moe_ep.testing.hf_models.compare_run; base models: one forward's outputs) or refused with
an IntegrationError naming the module and why -- never a silent difference, never a model left unchecked. World
size 2: model_matrix_multirank_test.py. Prints the table docs/models.md holds (pytest -s).

    python tests/moe_ep/integrations/model_matrix_test.py [-k gemma4]
"""

import sys

import pytest
import torch

pytest.importorskip("transformers", reason="the matrix is transformers' own architectures")

from moe_ep.testing import hf_matrix  # noqa: E402

ARCHS = hf_matrix.moe_architectures()
ROWS = []


@pytest.fixture(scope="module")
def group():
    from tests.support.dist import one_rank_gloo_group

    hf_matrix._quiet()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is faster, and CI's two cores are shared
    with one_rank_gloo_group():
        yield
    torch.set_num_threads(threads)
    print("\n" + hf_matrix.table(ROWS))


def test_the_matrix_is_transformers_moe_architectures():
    names = {a for a, _, _ in ARCHS}
    # the ones this issue is about, and the ones transformers' own experts interface names (at least these)
    assert {"mixtral", "qwen3_moe", "deepseek_v3", "gemma4", "llama4", "gpt_oss", "phimoe", "dbrx"} <= names
    assert len(names) >= 60, sorted(names)


@pytest.mark.parametrize("arch, model_type, kind", ARCHS, ids=[a for a, _, _ in ARCHS])
def test_served_within_bound_or_refused_by_name(group, arch, model_type, kind):
    row = hf_matrix.check_architecture(arch, model_type, kind)
    ROWS.append({k: v for k, v in row.items() if k != "detail"})
    assert not hf_matrix.verdict_problems(row), row
    if arch == "gemma4":  # its experts are GELU-tanh: refused by what the module computes, not by its config
        assert row["status"] == "refused" and "GELUTanh" in row["why"], row
    if arch == "llama4":  # top-1 with the router score on the input: served exactly
        assert row["status"] == "served" and row["top_k"] == 1, row
    if arch in ("deepseek_v4", "hy_v4"):  # a clamped SwiGLU moe_ep computes
        assert row["status"] == "served" and row["clamp"], row
    if arch == "gpt_oss":
        assert row["status"] == "refused" and "bias" in row["why"], row


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-s", "-p", "no:cacheprovider"] + sys.argv[1:]))
