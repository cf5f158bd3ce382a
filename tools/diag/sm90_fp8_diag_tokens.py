"""Below capacity, the launch the frontend makes (capacity-sized inputs, spare rows masked, reduce over T rows)
against the oracle, timed. The run that compared it with the other launch shapes is commit 657bbdf's version
of this script; its numbers are in that commit's message."""
import json, os, sys
import torch
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
from sm90_fp8_first_light import fp8_frontend, load, oracle, routing  # noqa: E402
from tools.require import require  # noqa: E402

require(device="cuda", arch="sm90", backend="sm90_fp8_cutedsl", argument=None, arch_argument=None)
dev = torch.device("cuda")
for g in [dict(name="small", H=512, I=256, E=8, K=4, C=1024), dict(name="dsv3", H=7168, I=2048, E=32, K=8, C=4096)]:
    f = fp8_frontend(g["H"], g["I"], g["E"], g["K"], g["C"], dev)
    gen = torch.Generator().manual_seed(0)
    w = load(f, (torch.randn(g["E"], 2 * g["I"], g["H"], generator=gen) / g["H"] ** 0.5).to(torch.bfloat16),
                       (torch.randn(g["E"], g["H"], g["I"], generator=gen) / g["I"] ** 0.5).to(torch.bfloat16))
    f.compile()
    for pad_in, pad_out in ((True, False),):
        for t in (0, 1, 8, 100, g["C"]):
            x = torch.randn(t, g["H"], generator=gen).to(torch.bfloat16).to(dev)
            idx, tw = routing(t, g["E"], g["K"], False, gen)
            idx, tw = idx.to(dev), tw.to(dev)
            out = torch.full((t, g["H"]), float("nan"), dtype=torch.bfloat16, device=dev)
            f.forward(x, idx, tw, out); torch.cuda.synchronize()
            if t:
                staged = f.staged_activation(t)
                xq, xs = staged.q, staged.scale
                ref = oracle(f, w, xq, xs, idx, tw, None).float()
                rel = float((out.float() - ref).norm() / ref.norm())
            else:
                rel = 0.0
            ts = []
            for _ in range(15):
                a, b = torch.cuda.Event(True), torch.cuda.Event(True)
                a.record(); f.forward(x, idx, tw, out); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b) * 1e3)
            ts.sort()
            print(json.dumps(dict(geom=g["name"], pad_in=pad_in, pad_out=pad_out, T=t, rel_l2=round(rel, 5),
                                  nan=int(torch.isnan(out.float()).sum()), us_median=round(ts[7], 1))), flush=True)
    f.close()
