"""Damaged checkpoints, measured the way tools.checkpoint.damaged measures them (a fresh process per case): each
load fails with a CheckpointError naming the damaged tensor and its file, and the process's memory is back to its
baseline with the error still kept (and after it is dropped), where a kept pack (the control) reads as the pack."""
import pytest

from tools.checkpoint.damaged import CASES, control, run_case
from tools.checkpoint.synthetic import write_deepseek_fp8

SIZE = dict(experts=8, hidden=2048, intermediate=1024)  # a 48 MiB pack: far above the measurement's noise


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    root = tmp_path_factory.mktemp("damaged")
    write_deepseek_fp8(root / "healthy", layer=3, agree=True, device="cpu", log=lambda s: None, **SIZE)
    return str(root)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_damaged_file_is_named_and_nothing_read_stays(tmp, case):
    r = run_case(case, tmp, **SIZE)
    assert r["error"] == CASES[case][1] and r["tensor"] == r["want_tensor"] and r["file"] == r["want_file"], r
    assert r["kept_MiB"] < 0.1 * r["pack_MiB"] and r["dropped_MiB"] < 0.1 * r["pack_MiB"], r
    assert r["ok"]


def test_the_measurement_sees_a_kept_pack(tmp):
    r = control(tmp, **SIZE)
    assert r["kept_MiB"] > 0.8 * r["pack_MiB"] and r["ok"], r


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
