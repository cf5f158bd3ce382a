"""Ranks out of step across 2 CPU ranks (gloo, tools/launch), through the driver the GPU run uses
(tools/diag/watchdog_diverge.py): two layers L1 and L2 of one geometry called alternately, rank 1 out of step at
loop call 21 (an L1 call).

In-band, one launch for every case (a fresh process group each): the torch reference carries each rank's call
fingerprint in its exchange, so a skipped call (with the layers' default checks, and with them off), a call to the
wrong layer and one call too many each raise RankDivergenceError on both ranks at the diverging call, naming
rank 1, the group call and both layers, before any wrong output; the group's next call raises it again at once.
Last, rank 1 dies inside a call: rank 0 gets PeerLostError naming rank 1, not gloo's RuntimeError.

Watchdog only, one launch: the spin-barrier reference (moe_ep.testing.faults) carries nothing and mixes data as the
kernels' shared workspace does; the watchdog must end both ranks (exit 86) within bound + 5 s of the skip, each
with one message naming rank 1, the first diverging group call and both layers."""

import sys
from pathlib import Path

import pytest

from tools.diag import watchdog_diverge as tool


def run(tmp_path, *argv):
    args = tool.parse(["--all", "--out", str(tmp_path), *argv])
    cases = tool._rank_cases(args)
    name = "in_band" if args.in_band else cases[0]
    res = tool.launch(args, name, cases, "cpu", Path(tmp_path))
    res["checks"] = tool.check(res, args.fault_rank)
    logs = {r["rank"]: r["log_tail"] for r in res["ranks"]}
    for c in res["checks"]:
        assert c["ok"], (c, logs[c["rank"]])
    return res


def test_in_band_every_case_raises_before_any_wrong_output(tmp_path):
    res = run(tmp_path, "--in-band", "--device", "cpu")
    assert res["cases"] == ["skip:default", "skip:off", "wrong:off", "extra:off", "dead"]
    r0, r1 = (r["records"] for r in res["ranks"])
    expected_call = {"skip:default": 23, "skip:off": 23, "wrong:off": 23, "extra:off": 24}  # 2 warm-ups first
    for case, call in expected_call.items():
        e0, e1 = r0[case]["error"], r1[case]["error"]
        assert e0["call"] == e1["call"] == call and e0["ranks"] == e1["ranks"] == [1], (case, e0, e1)
        assert r0[case]["wrong_returned"] == r1[case]["wrong_returned"] == 0
        # refused at once, before any collective (fault_matrix_test: a call through one took 2-3 s); 0.25 s as there
        assert r0[case]["next_call"]["s"] < 0.25 and r1[case]["next_call"]["s"] < 0.25
    skip = r0["skip:default"]["error"]["message"]
    assert "rank 0 (this rank) is in 'skip_default.L1' call 12 (group call 23)" in skip
    assert "rank 1 is in 'skip_default.L2' call 12 (group call 23)" in skip
    assert "'extra_off.L1' call 13" in r1["extra:off"]["error"]["message"]
    lost = r0["dead"]["error"]
    assert lost["type"] == "PeerLostError" and lost["ranks"] == [1]
    assert lost["message"].startswith("rank 1 of the group left it during an all_to_all")
    assert "Traceback" not in res["ranks"][0]["log_tail"]


def test_the_watchdog_catches_a_skip_the_exchange_cannot_see(tmp_path):
    res = run(tmp_path, "--device", "cpu", "--cases", "skip")
    # How far each rank got before the watchdog halted it depends on when a heartbeat fell (on a loaded machine:
    # right after the skip). Group call numbers: the 2 warm-ups, then the loop; rank 1 left loop call 21 out.
    made = {r["rank"]: r["records"]["skip"]["calls_returned"] + 2 for r in res["ranks"]}
    for r in res["ranks"]:
        text = r["watchdog_message"]
        assert r["returncode"] == 86 and text.count("moe_ep watchdog:") == 1
        assert "the ranks fell out of step at group call 23" in text and "out of step: rank 1 (against rank 0)" in text
        assert "layers involved: 'skip.L1', 'skip.L2'" in text
        # Told apart from a wrong call once rank 1 made group calls 23-24 and rank 0 made 24-25 (what rank 1 made
        # from 23 on is rank 0's from 24 on); from fewer the message must say it cannot tell, and guess nothing.
        if made[0] >= 25 and made[1] >= 24:
            assert "rank 1: left out 'skip.L1' call 12" in text, (made, text)
        else:
            assert ("rank 1: left out 'skip.L1' call 12" in text
                    or "rank 1: made 'skip.L2' call 12 where rank 0 made 'skip.L1' call 12 (too few calls" in text)
        # Without the fingerprint in the exchange, the calls returned after the divergence were wrong outputs (on
        # the GPU: queued); the message counts this rank's calls after it whenever it made any.
        if made[r["rank"]] > 23:
            assert "collective call(s) after it" in text, (made, text)

if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
