"""The main job: one scaled-down DeepSeek-V3-like MoE layer across N local ranks, checked against the oracle.

    bazel run //tools:main                       # 4 CPU ranks (gloo), the default backend for this host
    bazel run //tools:main -- --fmt fp8_block    # any format the backend serves
    python -m tools.main --ranks 2 --tokens 37   # the same without Bazel
    bazel run //tools:main -- --model            # a tiny random DeepSeek-V3 generating on moe_ep next to
                                                 # transformers' own experts (--model qwen3_moe | mixtral)

DeepSeek-V3's MoE is hidden 7168, moe_intermediate 2048, 256 experts, top-8; the default here keeps its
shape (top-8, many experts, I = H/4) at a size a 2-core laptop runs in seconds. On a GPU host the ranks run
on CUDA over NCCL and the registry picks the kernel backend for the GPU's arch (sm90, sm100).
"""

from __future__ import annotations

import argparse
import sys
import time

_DESCRIPTION = __doc__.split("\n\n")[0]


def _device_and_ranks(device: str, ranks, backend: str):
    """The ranks' device and count; a device, GPU count or kernel arch this host lacks ends the job here with one
    line and exit status 2 (tools/require.py), before any rank starts."""
    from moe_ep.core import registry
    from moe_ep.core.device import cuda_device_count
    from tools.require import require

    gpus = cuda_device_count()
    if device == "auto":
        device = "cuda" if gpus else "cpu"
    if ranks is None:
        ranks = 4 if device == "cpu" else max(1, min(4, gpus))
    arch = None
    if backend != "auto":
        try:
            arch = registry.get_entry(backend).arch
        except KeyError as e:  # BackendNotFoundError: names the registered ones
            print(f"main: {e}", file=sys.stderr)
            raise SystemExit(2) from None
    require("main", device, count=ranks if device == "cuda" else 1, arch=None if arch == "cpu" else arch,
            backend=backend)
    return device, ranks


def _table(rows, headers):
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="main", description=_DESCRIPTION)
    ap.add_argument("--ranks", type=int, default=None, help="EP ranks (default 4 on CPU, up to 4 GPUs)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--backend", default="auto", help="'auto' (by arch) or a registered backend name")
    ap.add_argument("--fmt", default=None, help="bf16 | fp8_block | fp8_tensor | mxfp8 | nvfp4 (default: the "
                                                "backend's own)")
    ap.add_argument("--tokens", type=int, default=100, help="tokens per rank")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=256, help="I (the down projection's K); gate+up is 2I")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--routing", default="balanced", choices=("balanced", "uniform", "skewed", "no_local"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--iters", type=int, default=5, help="timed forwards per rank (median is shown)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--model", nargs="?", const="deepseek_v3", default=None, metavar="ARCH",
                    choices=("deepseek_v3", "qwen3_moe", "mixtral"),
                    help="model mode: a tiny random transformers model of ARCH (default deepseek_v3) built from its "
                         "config, its routed experts on moe_ep over the ranks (default 2), greedy "
                         "generation next to the model's own experts (--new-tokens, --backend, --fmt apply)")
    ap.add_argument("--new-tokens", type=int, default=8, help="model mode: tokens each rank generates")
    ap.add_argument("--model-layers", type=int, default=0, metavar="N",
                    help="GPU mode: N DeepSeek-V3 MoE blocks in one process (memory per layer, the whole model in "
                         "one CUDA graph against one block alone; tools/bench/model_bench.py)")
    args = ap.parse_args(argv)
    if args.model_layers:
        from tools.require import require

        require("main", "cuda", arch="sm90", backend="sm90_fp8_cutedsl", argument="--model-layers",
                arch_argument="--model-layers")
        from tools.bench.model_bench import main as model_main

        return model_main(["--layers", str(args.model_layers)])

    if args.model:
        return _model_mode(args)
    device, ranks = _device_and_ranks(args.device, args.ranks, args.backend)
    kwargs = dict(hidden_size=args.hidden, intermediate_size=args.intermediate, num_experts=args.experts,
                  top_k=args.topk, tokens=args.tokens, routing=args.routing, seed=args.seed,
                  backend=None if args.backend == "auto" else args.backend, fmt=args.fmt, iters=args.iters,
                  raise_on_failure=False)
    results, wall = _on_ranks("moe_ep.testing.scenario:run_scenario", ranks, kwargs, device, args.timeout, "main job")
    if results is None:
        return 1

    r0 = results[0]
    e_local = args.experts // ranks
    print(f"megamoe-ep main job: {ranks} rank(s) on {device} "
          f"({'NCCL' if device == 'cuda' else 'gloo'}), backend {r0['backend']}, fmt {r0['fmt']}")
    print(f"layer: hidden {args.hidden}, intermediate {args.intermediate} (gate+up {2 * args.intermediate}), "
          f"{args.experts} experts ({e_local} per rank), top-{args.topk}, routing {args.routing}")
    rows = []
    for r in results:
        shape = f"[{r['tokens']}, {args.hidden}]"
        rows.append([str(r["rank"]), shape, r["backend"], r["fmt"], f"{r['max_abs_err']:.3e}",
                     f"{r['max_row_rel_err']:.3e}", "ok" if not r["problems"] else "FAIL",
                     f"{r.get('time_ms', float('nan')):.2f}"])
    print(_table(rows, ["rank", "shape", "backend", "fmt", "max abs err", "max rel err", "oracle",
                        "time (ms)"]))
    ok = all(r["ok"] for r in results)
    times = [r["time_ms"] for r in results if "time_ms" in r]
    slowest = max(times) if times else float("nan")
    print(f"oracle check: {'PASS' if ok else 'FAIL'} (per-token relative error vs the torch oracle, "
          f"tolerance {r0['tolerance']:g}); layer time {slowest:.2f} ms (slowest rank, median of {args.iters}); "
          f"job wall {wall:.1f} s")
    if not ok:
        for r in results:
            for p in r["problems"]:
                print(f"  rank {r['rank']}: {p}", file=sys.stderr)
    return 0 if ok else 1


def _on_ranks(target: str, ranks: int, kwargs: dict, device: str, timeout_s: float, what: str):
    """target(**kwargs) on every rank: (each rank's result, wall seconds), or (None, None) once a failed launch
    has been reported with every rank's output."""
    from tools.launch.launcher import RankFailure, launch_function

    t0 = time.perf_counter()
    try:
        results = launch_function(target, ranks, kwargs, device=device, timeout_s=timeout_s)
    except RankFailure as e:
        print(f"{what} failed:\n{e}", file=sys.stderr)
        return None, None
    return results, time.perf_counter() - t0


def _model_mode(args) -> int:
    """A tiny random transformers MoE model, its experts on moe_ep over N ranks, generating next to its own."""
    from moe_ep.core.device import cuda_device_count

    gpus = cuda_device_count()
    default_ranks = 2 if args.device == "cpu" or not gpus else max(1, min(2, gpus))
    device, ranks = _device_and_ranks(args.device, args.ranks or default_ranks, args.backend)
    kwargs = dict(arch=args.model, new_tokens=args.new_tokens, batch=1, seed=args.seed,
                  backend=None if args.backend == "auto" else args.backend, fmt=args.fmt)
    results, wall = _on_ranks("moe_ep.testing.hf_models:run_model_check", ranks, kwargs, device, args.timeout,
                              "model mode")
    if results is None:
        return 1
    r0 = results[0]
    print(f"megamoe-ep model mode: tiny random {args.model} (transformers, from its config), {ranks} rank(s) on "
          f"{device}; routed experts on moe_ep {r0['backend']} ({r0['fmt']}), {r0['layers']} MoE layer(s), "
          f"expert parallel: each rank holds {1 if ranks == 1 else f'1/{ranks}'} of the experts")
    rows = []
    for r in results:
        row = r["rows"][0]
        rows.append([str(r["rank"]), " ".join(map(str, r["prompts"][0])), " ".join(map(str, r["ref_tokens"][0])),
                     " ".join(map(str, r["moe_ep_tokens"][0])), f"{row['matched_tokens']}/{args.new_tokens}",
                     f"{r['prefill_rel_logits_err']:.2e}", "ok" if r["ok"] else "FAIL"])
    print(_table(rows, ["rank", "prompt", "transformers' experts", "moe_ep", "same", "logits err", "check"]))
    ok = all(r["ok"] for r in results)
    print(f"agreement: {'PASS' if ok else 'FAIL'} (logits within {r0['logits_tol']:g} relative of the model's own; "
          f"tokens identical up to the first near-tie, a step whose top-2 logit gap is within twice the "
          f"implementations' difference; docs/models.md); job wall {wall:.1f} s")
    if not ok:
        for r in results:
            print(f"  rank {r['rank']}: {r['rows']}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
