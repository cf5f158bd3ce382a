"""First GPU run of the sm90 FP8 frontend at world size 1, against an in-script fp32 oracle.

Kept as the record of the first device run; the suite proper goes through moe_ep.
"""
import json, os, sys, time
import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
import moe_ep  # noqa: E402
from moe_ep.core.dist import RankContext  # noqa: E402
from moe_ep.formats import codecs  # noqa: E402
from shim.sm90.fp8_frontend import Sm90Fp8Frontend  # noqa: E402
from shim.sm90.knobs import heuristic_knobs  # noqa: E402


def fp8_frontend(h, i, e, k, capacity, device):
    """A one-rank FP8 frontend with the heuristic's knobs, outside any process group (world size 1)."""
    spec = moe_ep.MoESpec(hidden_size=h, intermediate_size=i, num_experts=e, top_k=k, max_tokens_per_rank=capacity)
    return Sm90Fp8Frontend(spec, RankContext.detached(device=device), heuristic_knobs("fp8_block", capacity))


def load(front, w13, w2):
    return front.load_weights(moe_ep.ExpertWeights(w13, w2, rank=0, world_size=1, num_experts=w13.shape[0]))


def oracle(front, w, x_q, x_s, idx, tw, clamp):
    t, h = x_q.shape
    e, i = front.experts_per_rank, front.intermediate_size
    x = x_q.float() * x_s.repeat_interleave(128, dim=1)
    q1 = w.fc1.permute(0, 2, 1)  # (E, 2I, H) interleaved
    w13 = codecs.deinterleave_gate_up(q1.float() * w.fc1_scale.repeat_interleave(128, 1).repeat_interleave(128, 2))
    q2 = w.fc2.permute(0, 2, 1)
    w2 = q2.float() * w.fc2_scale.repeat_interleave(128, 1).repeat_interleave(128, 2)
    out = torch.zeros(t, h, dtype=torch.float32, device=x.device)
    for ex in range(e):
        tok, slot = (idx == ex).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        hh = x[tok] @ w13[ex].T
        g, u = hh[:, :i], hh[:, i:]
        if clamp is not None:
            g = g.clamp(max=clamp); u = u.clamp(-clamp, clamp)
        a = torch.nn.functional.silu(g) * u * tw[tok, slot].unsqueeze(1)
        blocks = a.view(-1, i // 64, 64)
        s = (blocks.abs().amax(-1) / 448.0).clamp(min=1e-30)
        aq = (blocks * torch.reciprocal(s).unsqueeze(-1)).to(torch.float8_e4m3fn).float() * s.unsqueeze(-1)
        y = aq.view(-1, i) @ w2[ex].T
        out.index_put_((tok,), y.to(torch.bfloat16).float(), accumulate=True)
    return out.to(torch.bfloat16)


def routing(t, e, k, skew, gen):
    if skew:
        p = 1.0 / torch.arange(1, e + 1, dtype=torch.float32) ** 1.5
    else:
        p = torch.ones(e)
    idx = torch.multinomial(p.expand(t, e), k, replacement=False, generator=gen)
    w = torch.softmax(torch.randn(t, k, generator=gen), -1)
    return idx, w


def main():
    from tools.require import require

    require(device="cuda", arch="sm90", backend="sm90_fp8_cutedsl", argument=None, arch_argument=None)
    dev = torch.device("cuda")
    results = []
    geoms = [dict(name="small", H=512, I=256, E=8, K=4), dict(name="dsv3", H=7168, I=2048, E=32, K=8)]
    counts = [1, 7, 64, 128, 1000, 4096]
    for g in geoms:
        t0 = time.time()
        f = fp8_frontend(g["H"], g["I"], g["E"], g["K"], 4096, dev)
        gen = torch.Generator().manual_seed(0)
        w13 = (torch.randn(g["E"], 2 * g["I"], g["H"], generator=gen) / g["H"] ** 0.5).to(torch.bfloat16)
        w2 = (torch.randn(g["E"], g["H"], g["I"], generator=gen) / g["I"] ** 0.5).to(torch.bfloat16)
        w = load(f, w13, w2)
        f.compile()
        print(f"[{g['name']}] knobs={f.knobs} (heuristic) build+compile {time.time()-t0:.1f}s", flush=True)
        for skew in (False, True):
            for t in counts:
                x = torch.randn(t, g["H"], generator=gen).to(torch.bfloat16).to(dev)
                idx, tw = routing(t, g["E"], g["K"], skew, gen)
                idx, tw = idx.to(dev), tw.to(dev)
                out = torch.full((t, g["H"]), float("nan"), dtype=torch.bfloat16, device=dev)
                f.forward(x, idx, tw, out)
                torch.cuda.synchronize()
                staged = f.staged_activation(t)
                xq, xs = staged.q, staged.scale
                ref = oracle(f, w, xq, xs, idx, tw, None).float()
                o = out.float()
                nan = int(torch.isnan(o).sum())
                rel_l2 = float((o - ref).norm() / ref.norm().clamp(min=1e-30))
                max_abs = float((o - ref).abs().max()); ref_max = float(ref.abs().max())
                # second run, same inputs: bitwise equal?
                out2 = torch.full_like(out, float("nan")); f.forward(x, idx, tw, out2); torch.cuda.synchronize()
                bitwise = bool(torch.equal(out.view(torch.int16), out2.view(torch.int16)))
                ok = nan == 0 and rel_l2 < 2e-2
                r = dict(geom=g["name"], T=t, skew=skew, nan=nan, rel_l2=rel_l2, max_abs=max_abs,
                         ref_max=ref_max, bitwise_repeat=bitwise, ok=ok)
                results.append(r)
                print(json.dumps(r), flush=True)
        f.close()
    out_dir = os.environ.get("OUT")
    if out_dir:
        json.dump(results, open(os.path.join(out_dir, "first_light.json"), "w"), indent=1)
    print("ALL OK" if all(r["ok"] for r in results) else "FAILURES")


if __name__ == "__main__":
    main()
