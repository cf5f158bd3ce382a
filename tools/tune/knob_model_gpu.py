"""The knob model on geometries no shipped table covers, measured on one Hopper GPU: its choice against the drop's
heuristic and against the best of a tune over the same candidates, timed alike.

    python -m tools.tune.knob_model_gpu --out DIR                         (H200 host, no Bazel; ~1 min a point)
    python -m tools.tune.knob_model_gpu --points dsv3_e48:128 --out DIR   (one point)

A point is a per-rank geometry and a capacity, at world size 1 (one GPU holds the rank's local experts; the
shapes are those of the named model at the given expert parallelism). For each point the candidates are: the
model's choice (shim/sm90/knob_model.py over the shipped entries of this GPU and drop), the heuristic's, and
knobs="auto"'s list (shim/sm90/tune.candidate_knobs), deduplicated; each is compiled, loaded and timed as
CUDA-graph replays of the whole forward at T = capacity on a balanced routing (the tuner's timing,
shim/sm90/tune.time_frontend, median of 20). `tuned` is the fastest of them. A layer built with default knobs at the
same point must report knob_source "model" and the model's set. Prints a table (model / tuned, heuristic / tuned),
writes knob_model_gpu.json into --out. The target: the model within 10% of tuned.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# name -> (H, I, local experts, top-k): per-rank shapes no table covers.
GEOMS = {
    "dsv3_e48": (7168, 2048, 48, 8),     # the 48-local-expert case of the 2026-12-01 run (heuristic 819-870 us at 128)
    "dsv3_ep16": (7168, 2048, 16, 8),    # DeepSeek-V3 at EP=16
    "qwen3_235b_ep8": (4096, 1536, 16, 8),
    "qwen3_30b_ep8": (2048, 768, 16, 8),
    "qwen3_30b_ep4": (2048, 768, 32, 8),
}
DEFAULT_POINTS = ["dsv3_e48:128", "dsv3_e48:512", "qwen3_30b_ep8:128", "qwen3_30b_ep8:2048",
                  "qwen3_235b_ep8:128", "dsv3_ep16:32"]


def _short(k) -> str:
    from tools.tune.knob_model_eval import short

    return short(k.to_json())


def measure(point: str, budget_s: float) -> dict:
    import torch

    import moe_ep
    from moe_ep.core.dist import RankContext
    from shim.common import knob_table, tree
    from shim.sm90 import knob_model
    from shim.sm90.knobs import Sm90Knobs, heuristic_knobs
    from shim.sm90.tune import build_check, candidate_knobs, synthetic_inputs, time_frontend
    from tools.tune.tune import _frontend_cls

    name, cap = point.split(":")
    cap = int(cap)
    h, i, e, k = GEOMS[name]
    fmt = "fp8_block"
    spec = moe_ep.MoESpec(h, i, e, k, cap)
    dev = torch.device("cuda", 0)
    ctx = RankContext.detached(device=dev)
    cls = _frontend_cls(fmt)
    check = build_check(cls, spec, 1)

    tree.activate("sm90")
    prov = tree.tree_provenance("sm90") or {}
    measured = knob_model.measured_entries(knob_table.load_tables("sm90"), device=torch.cuda.get_device_name(0),
                                           drop_sha256=prov.get("carrier_sha256"))
    g = knob_model.Geometry(fmt, h, i, e, k, 1, cap)
    picked = knob_model.choose(g, measured, accepts=lambda kn: check(Sm90Knobs.from_json(kn)))
    model = Sm90Knobs.from_json(picked[0]) if picked else None
    heur = heuristic_knobs(fmt, cap)
    cands = [c for c in [model, heur] if c is not None] + candidate_knobs(fmt, spec, 1, build_check=check)
    cands = list(dict.fromkeys(cands))

    gen = torch.Generator().manual_seed(7)
    weights = moe_ep.ExpertWeights((torch.randn(e, 2 * i, h, generator=gen) * h ** -0.5).to(torch.bfloat16).to(dev),
                                   (torch.randn(e, h, i, generator=gen) * i ** -0.5).to(torch.bfloat16).to(dev),
                                   rank=0, world_size=1, num_experts=e)
    times, started = {}, time.perf_counter()
    for c in cands:
        if time.perf_counter() - started > budget_s and c not in (model, heur):
            continue
        fe = None
        try:
            fe = cls(spec, ctx, c)
            fe.load_weights(weights)
            fe.compile()
            ts, _ = time_frontend(fe, synthetic_inputs(spec, cap, dev), iters=20, quick=20)
            times[c] = sorted(ts)[len(ts) // 2]
        except Exception as ex:  # noqa: BLE001 - a candidate that fails is reported, not fatal
            print(f"  {point}: {_short(c)} failed: {type(ex).__name__}: {str(ex)[:200]}", flush=True)
        finally:
            if fe is not None:
                fe.close()
        print(f"  {point}: {_short(c):32} {times.get(c, float('nan')):8.1f} us", flush=True)
    # The same choice through the layer's own resolution (explicit > cache > table > model > heuristic): a layer
    # built with default knobs must say it took the model's set (the compile comes from the process's cache).
    with moe_ep.MoELayer(spec, weights, backend="sm90_fp8_cutedsl", device=dev, check_values=False,
                         collective_checks=False) as layer:
        layer_source, layer_knobs = layer.backend.knob_source, layer.backend.knobs
    tuned = min(times.values())
    best = min(times, key=times.get)
    return dict(point=point, hidden=h, intermediate=i, experts=e, top_k=k, capacity=cap,
                tokens_per_expert=cap * k / e, model=None if model is None else model.to_json(),
                model_why=picked[1] if picked else "no measured entry near enough: the heuristic stays",
                model_us=times.get(model), heuristic=heur.to_json(), heuristic_us=times.get(heur),
                tuned_us=tuned, tuned=best.to_json(), candidates=len(times), layer_knob_source=layer_source,
                layer_took_model=model is not None and layer_knobs == model,
                seconds=round(time.perf_counter() - started, 1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "knob_model_out"))
    ap.add_argument("--points", nargs="+", default=DEFAULT_POINTS, help="NAME:CAPACITY, NAME one of " + ", ".join(GEOMS))
    ap.add_argument("--budget-s", type=float, default=90.0, help="per point: stop starting auto's candidates after this")
    args = ap.parse_args(argv)
    from tools.require import require

    require("knob_model_gpu", "cuda", arch="sm90", backend="sm90_fp8_cutedsl", argument=None, arch_argument=None)
    import moe_ep

    moe_ep.init_from_env()  # one rank, this GPU, NCCL: what a layer is built on
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for p in args.points:
        rows.append(measure(p, args.budget_s))
        (out / "knob_model_gpu.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{'point':22} {'tpe':>6} {'model':>8} {'heur':>8} {'tuned':>8} {'model/t':>8} {'heur/t':>7}  model's set")
    for r in rows:
        m, hu, t = r["model_us"], r["heuristic_us"], r["tuned_us"]
        ratio = (lambda a: "-" if a is None else f"{a / t:.2f}")
        print(f"{r['point']:22} {r['tokens_per_expert']:6.1f} {m or float('nan'):8.1f} {hu or float('nan'):8.1f} "
              f"{t:8.1f} {ratio(m):>8} {ratio(hu):>7}  {r['model_why']}")
    ok = [r for r in rows if r["model_us"] is not None]
    print(f"within 10% of tuned: {sum(1 for r in ok if r['model_us'] <= 1.10 * r['tuned_us'])} of {len(ok)} "
          f"points with a model choice; {len(rows) - len(ok)} fell back to the heuristic; a default layer took the "
          f"model's set at {sum(1 for r in ok if r['layer_took_model'])} of {len(ok)} "
          f"(sources: {sorted({r['layer_knob_source'] for r in rows})})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
