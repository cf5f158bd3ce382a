"""The scale-out cost model (tools/bench/scale_model.py): its fan-out formula against sampled routings, what it
says two_level saves, and its table. The published rates it quotes are data, checked by reading their sources
(docs/scale-out.md cites them)."""
import json
import sys

import pytest
import torch

from tools.bench import scale_model as sm


@pytest.mark.parametrize("groups", [2, 4, 8, 16, 64])
def test_reach_matches_sampled_routings(groups):
    g = torch.Generator().manual_seed(groups)
    e, k, n = 256, 8, 20000
    ids = torch.rand(n, e, generator=g).topk(k, dim=1).indices
    hit = torch.zeros(n, groups, dtype=torch.bool).scatter_(1, ids // (e // groups), True)
    assert abs(hit.sum(1).float().mean().item() - sm.reach(groups, k, e)) < 0.03


def test_two_level_sends_no_more_than_split_and_fp8_halves_the_way_out():
    for w in (16, 32, 64):
        b = sm.bytes_per_rank(w, tokens=4096)
        split, bf, fp8 = (b[k] for k in ("split (FP8 out, bf16 back)", "two_level (bf16 out, as built)",
                                         "two_level (FP8 out)"))
        assert fp8["copies"] < split["copies"] and fp8["dispatch"] < split["dispatch"]
        assert fp8["combine"] < split["combine"]
        assert 0.5 < fp8["dispatch"] / bf["dispatch"] < 0.55
    capped = sm.bytes_per_rank(64, tokens=4096, max_nodes=4)["two_level (FP8 out)"]["copies"]
    assert capped == pytest.approx(4 * 7 / 8)


def test_the_table_prints_every_ep_and_path(capsys):
    assert sm.main(["--tokens", "512", "--compute-us", "575"]) == 0
    out = capsys.readouterr().out
    assert out.count("| 16 |") == 3 and out.count("| 64 |") == 3 and "DeepEP V1 normal" in out


def test_from_bench_takes_compute_and_each_paths_own_cost(tmp_path, capsys):
    row = dict(T=512, fused_graph_us=500.0, split_fp8wire_graph_us=650.0, two_level_graph_us=610.0,
               two_level_fp8wire_graph_us=620.0)
    path = tmp_path / "split_bench.json"
    path.write_text(json.dumps({"rows": [row, dict(T=1024, fused_graph_us=float("nan"))]}))
    compute, costs = sm.from_bench(str(path), 512)
    assert compute == 500.0 and costs == {"split (FP8 out, bf16 back)": 150.0,
                                          "two_level (bf16 out, as built)": 110.0, "two_level (FP8 out)": 120.0}
    rows = sm.model(tokens=512, compute_us=compute, path_costs=costs)
    for r in rows:
        comm = r["comm_us[NIC 400 Gb/s]"]
        assert r["layer_us[NIC 400 Gb/s]"] == pytest.approx(comm + 500.0 + costs[r["path"]])
    assert sm.main(["--tokens", "512", "--from-bench", str(path)]) == 0
    assert "+150 us" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no row at T=4096"):
        sm.from_bench(str(path), 4096)
    with pytest.raises(SystemExit, match="no fused_graph_us"):
        sm.from_bench(str(path), 1024)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
