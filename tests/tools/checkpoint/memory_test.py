"""The loader's host-memory promise, measured the way tools.checkpoint.memory measures it (a fresh process, VmHWM
growth over one layer's load after a one-expert warm-up): at most this rank's pack plus one expert in bf16, for a
DeepSeek-convention checkpoint whose gate/up scales disagree (the converter's re-rounding temporaries included)
and one whose scales agree, at world size 1 (and 4)."""
import pytest

from tools.checkpoint.memory import run_case
from tools.checkpoint.synthetic import write_deepseek_fp8


@pytest.mark.parametrize("agree, worlds", [(False, (1, 4)), (True, (1,))])
def test_peak_host_memory_is_the_pack_plus_one_expert(tmp_path, agree, worlds):
    write_deepseek_fp8(tmp_path, layer=3, experts=8, hidden=2048, intermediate=1024, agree=agree, device="cpu",
                       log=lambda s: None)
    for world in worlds:
        r = run_case(str(tmp_path), 3, world_size=world, threads=1)  # one thread: CI's 2 cores are shared
        assert r["exact"] == agree and r["pack_MiB"] == pytest.approx(6.0 * 8 / world, rel=1e-3)  # 6 MiB an expert
        assert r["within_bound"], r  # peak <= pack + one expert in bf16 (12 MiB here)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
