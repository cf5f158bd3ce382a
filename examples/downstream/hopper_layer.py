"""One moe_ep layer on the Hopper FP8 kernel (backend sm90_fp8_cutedsl), checked against the torch oracle.

    bazel run //:hopper_layer                    # on a Hopper (sm90) host: one rank, GPU 0
    bazel run //:hopper_layer -- --tokens 512

The target depends on @megamoe_ep//moe_ep:moe_ep_hopper, which carries the pinned Hopper kernel tree,
so it builds on any machine. Without a Hopper GPU it says so and exits with status 2.
"""

import argparse
import sys
import time

NO_HOPPER = 2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=256, help="I (the down projection's K); gate+up is 2I")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)

    import os

    import torch

    import moe_ep
    from moe_ep.reference.oracle import check_multirank

    if not torch.cuda.is_available():
        print("hopper_layer: no CUDA GPU on this machine, so the sm90 kernel cannot run here (the target built, "
              "which is all a CPU-only machine can check). Run it on a Hopper (sm90) host; on CPU, moe_ep serves "
              "the torch reference backend (see //:two_ranks_test).", file=sys.stderr)
        return NO_HOPPER
    arch = moe_ep.detect_arch(torch.device("cuda", 0))
    if arch != "sm90":
        print(f"hopper_layer: GPU 0 is {torch.cuda.get_device_name(0)} ({arch}), not a Hopper (sm90) GPU; this "
              "binary carries the sm90 kernel only (an sm100 host wants @megamoe_ep//moe_ep:moe_ep_blackwell).",
              file=sys.stderr)
        return NO_HOPPER

    # One process, no torchrun: init_from_env makes it world size 1 (NCCL on GPU 0).
    os.environ.setdefault("MOE_EP_DEVICE", "cuda")
    ctx = moe_ep.init_from_env()
    dev = ctx.device
    h, i, e, k, t = args.hidden, args.intermediate, args.experts, args.topk, args.tokens
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * h ** -0.5).to(torch.bfloat16).to(dev)
    w2 = (torch.randn(e, h, i, generator=g) * i ** -0.5).to(torch.bfloat16).to(dev)
    weights = moe_ep.ExpertWeights(w13=w13, w2=w2, rank=ctx.rank, world_size=ctx.world_size, num_experts=e)
    spec = moe_ep.MoESpec(hidden_size=h, intermediate_size=i, num_experts=e, top_k=k, max_tokens_per_rank=t)

    t0 = time.perf_counter()
    layer = moe_ep.MoELayer(spec, weights, backend="sm90_fp8_cutedsl")
    built_s = time.perf_counter() - t0
    hidden = torch.randn(t, h, generator=g).to(torch.bfloat16).to(dev)
    topk_idx = torch.rand(t, e, generator=g).topk(k, dim=1).indices.to(dev)
    topk_weights = torch.softmax(torch.randn(t, k, generator=g), dim=1).to(dev)

    out = layer(hidden, topk_idx, topk_weights)
    report = check_multirank(layer, hidden, topk_idx, topk_weights, out, weights=weights, raise_on_failure=False)

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(args.iters):
        start.record()
        layer(hidden, topk_idx, topk_weights, out=out)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    times.sort()
    print(f"hopper_layer: {torch.cuda.get_device_name(0)}, backend {layer.backend_name}, fmt {layer.fmt}, "
          f"H {h}, I {i}, {e} experts, top-{k}, T {t}; layer built in {built_s:.1f} s")
    print(f"oracle: {'PASS' if report.ok else 'FAIL'} ({report.summary()}); "
          f"median {times[len(times) // 2]:.1f} us per forward over {args.iters}")
    layer.close()
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
