"""Host time of one eager forward under three call patterns, per T, on a GPU host (#16: host overhead).

    python3 -m tools.diag.host_probe        (one GPU, DeepSeek-V3 FP8, ~1 min with a cold compile cache)

busy: back to back (what the benchmark's host column times); idle: the GPU synchronised before each call; spaced:
2 ms of host sleep before each call (the CPU's caches and clocks cool down, as between layers of a real step).
For the whole layer call, the backend alone (no validation, no watch) and the internal graph's replay alone;
with and without a second layer (the heuristic's) in the same workspace. Prints medians and every 4th sorted
sample."""
import statistics
import time

import torch

import moe_ep
from tools.bench.bench import GEOMS, _layer, bucket, init_single_rank, routing
from tools.bench.timing import cuda_time_us
from tools.bench.weights import random_weights
dev = init_single_rank("29533")
g = GEOMS["dsv3"]
weights = random_weights(g, torch.Generator().manual_seed(100), dev)
gen = torch.Generator().manual_seed(0)
sync = torch.cuda.synchronize
def q(v): return [round(x, 1) for x in sorted(v)[::4]]
for t, with_heur in [(1, True), (8, True), (8, False), (32, True), (2048, True), (2048, False)]:
    cap = bucket(t)
    spec = moe_ep.MoESpec(hidden_size=g["hidden"], intermediate_size=g["intermediate"], num_experts=g["experts"],
                          top_k=g["top_k"], max_tokens_per_rank=cap)
    tuned = _layer(moe_ep, spec, weights, dev, None)
    heur = _layer(moe_ep, spec, weights, dev, {}) if with_heur else None
    x = torch.randn(t, g["hidden"], generator=gen).to(torch.bfloat16).to(dev)
    idx, w = routing(t, g["experts"], g["top_k"], gen, dev)
    out = torch.empty(t, g["hidden"], dtype=torch.bfloat16, device=dev)
    call = lambda: tuned(x, idx, w, out=out)
    gpu = cuda_time_us(call)
    res = {}
    for name, fn in [("call", call), ("backend", lambda: tuned.backend.forward(x, idx, w, out))]:
        for mode in ("busy", "idle", "spaced"):
            sync(); per = []
            for _ in range(40):
                if mode == "idle": sync()
                if mode == "spaced": time.sleep(0.002)
                c0 = time.perf_counter(); fn(); per.append((time.perf_counter() - c0) * 1e6)
            sync()
            res[f"{name}_{mode}"] = (round(statistics.median(per), 1), q(per))
    graph = next(gr for k, gr in tuned.backend.frontend.graphs.items() if isinstance(k, tuple))
    sync(); per = []
    for _ in range(40):
        c0 = time.perf_counter(); graph.replay(); per.append((time.perf_counter() - c0) * 1e6)
    sync()
    res["replay_busy"] = (round(statistics.median(per), 1), q(per))
    print(f"T={t} cap={cap} heur_layer={with_heur} knobs={tuned.backend.knob_source} gpu={gpu:.0f}us", flush=True)
    for k, v in res.items():
        print(f"   {k:16s} median {v[0]:6.1f}  sorted/4 {v[1]}", flush=True)
    if heur is not None: heur.close()
    tuned.close()
