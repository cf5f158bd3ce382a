"""Synthetic checkpoints of every convention on disk, through the loader into a layer at world size 1 (the torch
reference backend in a one-rank gloo group): the layer's oracle weights are the checkpoint's dequantized values
bit for bit (NVFP4: codes and scales bit for bit, values to one fp32 rounding of the global scale), its output
matches the oracle and a plain-torch MoE over the checkpoint. World size 2: checkpoint_multirank_test.py."""

import pytest

from tests.moe_ep.checkpoint import ranks, synth
from tests.support.dist import one_rank_gloo_group

# (synthetic convention, what it is written as, format to load, allow_inexact, exact weights expected)
CASES = [
    ("deepseek_fp8", dict(agree=True), "fp8_block", False, True),
    ("deepseek_fp8", dict(agree=False), "fp8_block", True, False),
    ("deepseek_fp8", dict(pow2=True), "mxfp8", False, True),
    ("modelopt_fp8", dict(agree=True), "fp8_tensor", False, True),
    ("modelopt_nvfp4", dict(agree=True, pow2=True), "nvfp4", False, True),
    ("modelopt_nvfp4", dict(agree=True), "nvfp4", False, "ulp"),
    ("modelopt_nvfp4", dict(agree=True, pow2=True), "w4a8_nvfp4", False, True),
    ("gpt_oss_mxfp4", dict(), "w4a8_mxfp4", False, True),
    ("gpt_oss_mxfp4", dict(), "mxfp8", False, True),
    ("gpt_oss_mxfp4", dict(), "bf16", False, True),
    ("hf_bf16", dict(shards=0), None, False, True),
    ("mixtral_bf16", dict(), None, False, True),
    ("hf_fused_bf16", dict(shards=1), None, False, True),
]


def _id(c):
    return f"{c[0]}-{c[2]}-" + "-".join(f"{k}{v}" for k, v in c[1].items())


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_world_size_one(tmp_path, case):
    conv, kw, fmt, inexact, exact = case
    synth.write(tmp_path, conv, **kw)
    with one_rank_gloo_group():
        r = ranks.run(str(tmp_path), conv, fmt=fmt, allow_inexact=inexact)
    w = r["weights"]
    assert w["fmt"] == (fmt or "bf16") and w["offset"] == 0 and w["experts"] == 4
    if exact is True:
        assert w["equal"] and w["changed"] == 0
    elif exact == "ulp":
        assert w["within_ulp"] and not w["equal"]
    else:
        assert not w["equal"] and w["changed"] > 0
    assert r["nan"] == 0 and r["oracle_ok"], r["oracle"]
    assert r["plain_err"] <= r["plain_tol"], r


def test_the_plain_torch_check_catches_a_gate_up_swap(tmp_path):
    synth.write(tmp_path, "deepseek_fp8", agree=True)
    with one_rank_gloo_group():
        r = ranks.run(str(tmp_path), "deepseek_fp8", swap_gate_up=True)
    assert r["oracle_ok"] and r["plain_err"] > 5 * r["plain_tol"]


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
