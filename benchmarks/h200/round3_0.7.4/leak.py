# Which object keeps a closed GPU layer alive? Builds the suite's DSV3 FP8 layer, calls it, closes it, and
# reports what still refers to the layer / backend / frontend, and the device memory before and after.
import gc, weakref, torch, moe_ep
torch.cuda.set_device(0)
ctx = moe_ep.init_from_env()
def free(): torch.cuda.synchronize(); gc.collect(); torch.cuda.empty_cache(); return torch.cuda.mem_get_info()[0] / 2**20
spec = moe_ep.MoESpec(7168, 2048, 32, 8, 512)
base = free()
for rnd in range(3):
    g = torch.Generator().manual_seed(rnd)
    w = moe_ep.ExpertWeights(w13=(torch.randn(32, 4096, 7168, generator=g) / 84).bfloat16().cuda(),
                             w2=(torch.randn(32, 7168, 2048, generator=g) / 45).bfloat16().cuda(), rank=0, world_size=1, num_experts=32)
    lay = moe_ep.MoELayer(spec, w, backend="sm90_fp8_cutedsl")
    x = torch.randn(37, 7168).bfloat16().cuda(); idx = torch.randint(0, 32, (37, 8)).cuda(); tw = torch.rand(37, 8).cuda()
    out = torch.empty(37, 7168, dtype=torch.bfloat16, device="cuda")
    lay(x, idx, tw, out=out); lay(x, idx, tw, out=out); lay(x, idx, tw)
    refs = {"layer": weakref.ref(lay), "backend": weakref.ref(lay.backend), "frontend": weakref.ref(lay.backend.frontend),
            "w13": weakref.ref(w.w13)}
    lay.close(); del lay, w
    f = free()
    alive = [k for k, r in refs.items() if r() is not None]
    print(f"round {rnd}: free {f:.0f} MiB (lost vs start {base - f:.0f}); alive after close: {alive}")
    for k in alive[:2]:
        for ref in gc.get_referrers(refs[k]()):
            if isinstance(ref, dict):
                owners = [type(o).__name__ for o in gc.get_referrers(ref) if not isinstance(o, (list, dict))][:4]
                print("   ", k, "<- dict", list(ref.keys())[:6], "owned by", owners)
            elif not isinstance(ref, list) or len(ref) < 50:
                print("   ", k, "<-", type(ref).__name__, str(ref)[:160])
