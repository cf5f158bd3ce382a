"""The forward watchdog across CPU ranks (gloo, tools/launch), through the demo the GPU run uses
(tools/diag/watchdog_demo.py), bound 2 s: a rank killed mid-loop, the store's host killed, a rank that skips a
call, a rank that stalls inside its forward (in a gloo collective, and in front of the agreement of
collective_checks=True), and a loop of normal calls that never trips it.

Every surviving rank must end by itself within bound + 5 s of the fault, with exit code 86 and the one message
naming the layer, the call and what each peer was doing. The default backend is the torch reference behind a
spin barrier on files (moe_ep.testing.faults), which waits for a dead peer forever, as the kernel does."""

import sys
from pathlib import Path

import pytest

import moe_ep
from tools.diag import watchdog_demo as demo

BOUND = 2.0


def run(tmp_path, scenario, *extra):
    argv = ["--all", "--device", "cpu", "--bound", str(BOUND), "--scenarios", scenario, "--out", str(tmp_path),
            "--scenario-timeout", "45", *extra]
    args = demo._parser().parse_args(argv)
    result = demo.launch_scenario(args, scenario, "cpu", Path(tmp_path))
    logs = {r["rank"]: (Path(tmp_path) / r["log"]).read_text() for r in result["ranks"]}
    return result, logs


def _survivors_ok(result, logs, survivors):
    for c in result["checks"]:
        assert c["ok"], (c, logs[c["rank"]][-3000:])
    for r in survivors:
        rank = result["ranks"][r]
        assert rank["returncode"] == moe_ep.WATCHDOG_EXIT_CODE, logs[r][-3000:]
        assert rank["exit_s_after_fault"] <= BOUND + 5.0
        assert rank["watchdog_message"] and logs[r].count("moe_ep watchdog:") == 1
        assert "'demo MoE layer' call" in rank["watchdog_message"]
    return [result["ranks"][r]["watchdog_message"] for r in survivors]


def test_normal_calls_never_trip_it(tmp_path):
    result, logs = run(tmp_path, "normal", "--calls", "300")
    assert result["ok"], result
    for r in result["ranks"]:
        assert r["returncode"] == 0 and r["watchdog_message"] is None, logs[r["rank"]][-2000:]
        assert r["record"]["watched_calls"] == 300 and r["record"]["finite"]


def test_a_rank_killed_mid_loop(tmp_path):
    result, logs = run(tmp_path, "kill", "--nproc", "3", "--calls", "40", "--fault-call", "20")
    assert result["ranks"][1]["returncode"] == -9
    for text in _survivors_ok(result, logs, [0, 2]):
        assert "call 20 has not finished" in text and "of 3" in text
        assert "heartbeat stopped or unreachable: rank 1" in text and "rank 1: heartbeat stopped" in text
        assert "verdict: rank 1 stopped" in text


def test_the_store_host_killed(tmp_path):
    result, logs = run(tmp_path, "kill", "--nproc", "3", "--calls", "40", "--fault-call", "20", "--fault-rank", "0")
    assert result["ranks"][0]["returncode"] == -9
    for text in _survivors_ok(result, logs, [1, 2]):
        assert "rank 0: hosts the process group's store, which cannot be reached" in text
        assert "store: the process group's store at" in text


def test_a_rank_that_skips_a_call(tmp_path):
    result, logs = run(tmp_path, "skip", "--calls", "40", "--fault-call", "20")
    (text,) = _survivors_ok(result, logs, [0])
    # rank 1 left call 20 out, so rank 0's call 40 has no partner; rank 1 is alive, waiting after its loop
    assert "call 40 has not finished" in text
    assert "alive, never entered call 40: rank 1 (last call 39)" in text


def test_a_rank_that_stalls_in_a_gloo_collective(tmp_path):
    result, logs = run(tmp_path, "stall", "--backend", "torch_reference", "--calls", "40", "--fault-call", "20")
    (text,) = _survivors_ok(result, logs, [0])
    assert "call 20 has not finished" in text and "rank 1: alive and inside call 20 on the host" in text
    # the stalled rank's own call passed the bound as well
    assert result["ranks"][1]["returncode"] == moe_ep.WATCHDOG_EXIT_CODE


def test_the_validation_agreement_is_watched(tmp_path):
    # collective_checks=True: rank 0 waits for rank 1 in the agreement's all_reduce, inside its forward
    result, logs = run(tmp_path, "stall_before", "--backend", "torch_reference", "--collective-checks",
                       "--calls", "40", "--fault-call", "20", "--stall-s", "5")
    (text,) = _survivors_ok(result, logs, [0])
    assert "call 20 has not finished" in text and "alive, never entered call 20: rank 1 (last call 19)" in text


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
