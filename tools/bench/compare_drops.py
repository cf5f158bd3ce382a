"""Two kernel drops side by side in one run: each in its own process (one process holds one tree).

    python -m tools.bench.compare_drops --out DIR 0.7.2.post1=/path/to/old/src 0.7.4=/path/to/new/src

Runs the benchmark (graph-replayed moe_ep forward and the kernel alone) once per drop on the same GPU,
then prints and writes the per-token-count ratio new/old (compare.md, compare.csv, compare.png).
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
from typing import Dict, List


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("drops", nargs=2, help="LABEL=TREE_ROOT (old first)")
    p.add_argument("--out", default=os.environ.get("OUT", "compare_out"))
    p.add_argument("--geoms", nargs="+", default=["dsv3"])
    p.add_argument("--tokens", nargs="+", default=["1", "8", "32", "128", "512", "2048", "4096"])
    args = p.parse_args(argv)
    results: Dict[str, List[dict]] = {}
    for spec in args.drops:
        label, tree = spec.split("=", 1)
        out = os.path.join(args.out, label)
        env = dict(os.environ, MOE_EP_SM90_TREE=tree, MOE_EP_DROP_VERSION=label)
        cmd = [sys.executable, "-m", "tools.bench", "--out", out, "--ref-max-tokens", "0", "--geoms", *args.geoms,
               "--tokens", *args.tokens]
        print(f"== {label}: {' '.join(cmd)}", flush=True)
        rc = subprocess.call(cmd, env=env)
        if rc:
            print(f"benchmark for {label} failed (rc={rc})", file=sys.stderr)
            return rc
        with open(os.path.join(out, "bench.csv")) as f:
            results[label] = list(csv.DictReader(f))
    (old, new) = [s.split("=", 1)[0] for s in args.drops]
    rows = []
    for a, b in zip(results[old], results[new]):
        assert (a["geom"], a["T"]) == (b["geom"], b["T"])
        row = {"geom": a["geom"], "T": int(a["T"])}
        for key in ("moe_ep_graph_us", "kernel_us", "moe_ep_eager_us"):
            row[f"{key}[{old}]"] = float(a[key])
            row[f"{key}[{new}]"] = float(b[key])
        row["graph new/old"] = row[f"moe_ep_graph_us[{new}]"] / row[f"moe_ep_graph_us[{old}]"]
        rows.append(row)
    keys = list(rows[0])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "compare.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        lines.append("| " + " | ".join(f"{v:.3f}" if isinstance(v, float) and "new/old" in k else
                                        (f"{v:.1f}" if isinstance(v, float) else str(v)) for k, v in r.items()) + " |")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(args.out, "compare.md"), "w") as f:
        f.write(f"# Drop {old} vs {new}: sm90 FP8, same GPU, one run (graph replay; us)\n\n{text}\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 5))
        for label in (old, new):
            ax.plot([r["T"] for r in rows], [r[f"moe_ep_graph_us[{label}]"] for r in rows], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel("microseconds (graph replay)")
        ax.legend()
        ax.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "compare.png"), dpi=110)
    except ImportError:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
