"""Where the host time of one eager forward goes, piece by piece, on a GPU host (#16: host overhead <= 15 us).

    python3 -m tools.diag.host_cost [--tokens 1 8 128] [--pause-ms 2] [--second-layer] [--out DIR]
                                                                    (one GPU; ~1 min with a cold compile cache)

For DeepSeek-V3 FP8 (sm90_fp8_cutedsl, capacity = the benchmark's bucket of T, knobs resolved as the benchmark's),
each T: the whole call as the benchmark times it (back to back, the GPU busy), the whole call with the GPU idle
before each call (synchronised, so nothing can wait on the device), the whole call after a host pause of
--pause-ms before each (the CPU's caches and clocks cool down, as between the layers of a real step; 0: not
timed), and its pieces: the layer's validation, the watchdog's begin + end, the backend's forward (no validation,
no watch; idle, and after the pause), the internal graph's replay alone, and torch's capture check.
--second-layer also builds a layer with the drop's heuristic knobs beside each one (a second layer in the same
workspace, as in a model). Medians of blocks; prints a table, writes host_cost.json with --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 128])
    p.add_argument("--pause-ms", type=float, default=2.0, help="host pause before each call of the paused rows")
    p.add_argument("--second-layer", action="store_true", help="a heuristic-knob layer beside each timed one")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import torch

    from tools.bench.bench import require_sm90

    require_sm90(0)
    import moe_ep
    from moe_ep.core.validate import validate_forward
    from tools.bench.bench import GEOMS, bucket, init_single_rank, routing
    from tools.bench.timing import host_us_per_call
    from tools.bench.weights import random_weights

    dev = init_single_rank("29531")
    sync = torch.cuda.synchronize
    g = GEOMS["dsv3"]
    h, i, e, k = g["hidden"], g["intermediate"], g["experts"], g["top_k"]
    weights = random_weights(g, torch.Generator().manual_seed(100), dev)  # the benchmark's weights
    rows: List[Dict[str, object]] = []
    layers, second = {}, []
    pause_s = args.pause_ms / 1e3
    for t in args.tokens:
        cap = bucket(t)
        if cap not in layers:
            spec = moe_ep.MoESpec(hidden_size=h, intermediate_size=i, num_experts=e, top_k=k, max_tokens_per_rank=cap)
            layers[cap] = moe_ep.MoELayer(spec, weights, backend="sm90_fp8_cutedsl", device=dev, check_values=False,
                                          collective_checks=False)
            if args.second_layer:  # knobs={}: the heuristic's, on top of nothing
                second.append(moe_ep.MoELayer(spec, weights, backend="sm90_fp8_cutedsl", device=dev,
                                              check_values=False, collective_checks=False, knobs={}))
        layer = layers[cap]
        gen = torch.Generator().manual_seed(t)
        x = torch.randn(t, h, generator=gen).to(torch.bfloat16).to(dev)
        idx, w = routing(t, e, k, gen, dev)
        out = torch.empty(t, h, dtype=torch.bfloat16, device=dev)
        call = lambda: layer(x, idx, w, out=out)  # noqa: E731
        for _ in range(3):  # seen, captured, replayed: the steady state
            call()
        sync()
        fe = layer.backend.frontend
        graph = next(gr for key, gr in fe.graphs.items() if isinstance(key, tuple))
        watch = layer.watch
        row: Dict[str, object] = dict(T=t, capacity=cap, second_layer=args.second_layer, knobs=str(layer.backend.knobs))
        n, blocks = 50, 9
        row["call_busy_us"] = host_us_per_call(call, n, blocks, sync, idle=False)
        row["call_idle_us"] = host_us_per_call(call, n, blocks, sync, idle=True)
        if pause_s > 0:
            row["call_paused_us"] = host_us_per_call(call, 20, blocks, sync, pause_s=pause_s)
        row["validate_us"] = host_us_per_call(lambda: validate_forward(layer.spec, layer.ctx, x, idx, w, out, False),
                                              n, blocks, sync, idle=False)
        if watch is not None:
            row["watch_begin_end_us"] = host_us_per_call(lambda: watch.end(watch.begin()), n, blocks, sync,
                                                         idle=False)
        backend_call = lambda: layer.backend.forward(x, idx, w, out)  # noqa: E731
        row["backend_forward_us"] = host_us_per_call(backend_call, n, blocks, sync, idle=True)
        if pause_s > 0:
            row["backend_forward_paused_us"] = host_us_per_call(backend_call, 20, blocks, sync, pause_s=pause_s)
        row["graph_replay_busy_us"] = host_us_per_call(graph.replay, n, blocks, sync, idle=False)
        row["graph_replay_idle_us"] = host_us_per_call(graph.replay, n, blocks, sync, idle=True)
        row["capture_check_us"] = host_us_per_call(torch.cuda.is_current_stream_capturing, n, blocks, sync,
                                                   idle=False)
        rows.append(row)
        print({kk: (round(v, 2) if isinstance(v, float) else v) for kk, v in row.items()}, flush=True)
    cols = [c for c in rows[0] if c not in ("knobs", "second_layer")]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.2f}" if isinstance(r.get(c), float) else str(r.get(c)) for c in cols) + " |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "host_cost.json").write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(dev),
                                                                      pause_ms=args.pause_ms, rows=rows), indent=1))
    for layer in [*layers.values(), *second]:
        layer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
