"""tools.checkpoint.gpu_load's steps without a GPU (its --cpu-dry-run path: the torch reference backend in a fresh
process), so the H200 run is not where its bugs are found: the read-back is the pack byte for byte, the pack's
changes are the report's, the forwards match the oracle, for a checkpoint whose gate/up scales differ and one
whose scales agree."""
import pytest

from tools.checkpoint.gpu_load import _run_child, table
from tools.checkpoint.synthetic import write_deepseek_fp8


@pytest.mark.parametrize("agree", [False, True])
def test_the_steps_on_cpu(tmp_path, agree):
    write_deepseek_fp8(tmp_path, layer=3, experts=8, hidden=512, intermediate=256, agree=agree, device="cpu",
                       log=lambda s: None)
    r = _run_child(path=str(tmp_path), layer_idx=3, pack_device="cpu", tokens=[1, 16], capacity=16,
                   backend="torch_reference", device="cpu")
    assert "error" not in r, r
    r["variant"] = "agree" if agree else "real"
    assert r["readback_byte_exact"] and r["report_matches"] and r["exact"] == agree
    assert (r["vs_checkpoint_changed"] == 0) == agree and r["values"] == 8 * 3 * 512 * 256
    assert all(f["oracle_ok"] and f["nan"] == 0 and f["plain_rel_err"] < 0.15 for f in r["forward"]), r["forward"]
    assert "| " + r["variant"] + " | cpu |" in table([r])


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
