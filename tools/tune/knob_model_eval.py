"""How good is the knob model's choice where no table entry exists? Leave entries out and look up what the choice
measured, from the tuner's own records (no GPU).

    python -m tools.tune.knob_model_eval                 (CPU; needs the sm90 tree for the heuristic and the
    bazel run //tools/tune:knob_model_eval                build check, as the tuner does)

For every entry of the shipped table (shim/sm90/tables/h200.json) the times of up to six knob sets are on record:
  - the heuristic's (the entry's heuristic_us);
  - world size 1, entries of the staged search (meta "search"): the winner, its three runners-up with their times
    (runners_up_us) and the knob model's own choice for that key (model_us), all in the entry itself: a new entry
    joins the evaluation with no change here;
  - world size 1, older entries: the tuner's measured winner ("wrote" in the log) and its three runners-up (the
    entry's runners_up), whose times are the fastest, 2nd, 3rd and 4th of the candidates timed in stages 1-2 of that
    key in benchmarks/h200/round2_0.7.4/tune/tune_*_w1.log and round 3's W4A8 tune.log (graph replays at T =
    capacity; rounded to 1 us);
  - world size 2: every candidate of the collective tune (the entry's scores_us).
Each entry is held out in turn, two ways: leave-capacity-out (the entries of its geometry and capacity at every
world size: a capacity the table lacks for a geometry it has) and leave-geometry-out (every entry of the same H,
I, local experts and top-k: a model no table covers). The model chooses from what is left (shim/sm90/knob_model.py, the kernel's build check for the
held-out geometry included), and its choice's time at the held-out entry is looked up. A choice outside the
five on record has no time here ("unmeasured"): the GPU command in docs/tuning.md measures those.
Prints one row per entry and a summary; --json writes the rows.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from tools.tune.tune import short

REPO = Path(__file__).resolve().parents[2]
TABLE = REPO / "shim" / "sm90" / "tables" / "h200.json"
# The world-size-1 tuner logs behind the shipped table's entries: round 2's FP8 and BF16 sweeps, round 3's W4A8.
LOGS = [REPO / "benchmarks" / "h200" / "round2_0.7.4" / "tune" / name
        for name in ("tune_fp8_w1.log", "tune_bf16_w1.log")] + [
            REPO / "benchmarks" / "h200" / "round3_0.7.4" / "run3_after_fixes" / "tune.log"]

_LINE = re.compile(r"\] (?P<model>\w+)/(?P<fmt>\w+)/C(?P<cap>\d+) stage (?P<stage>[12]): (?P<us>[\d.]+) us(?P<cut> \(cut\))?;")
_WROTE = re.compile(r"^\[tune\] (?P<model>\w+)/(?P<fmt>\w+)/C(?P<cap>\d+): wrote (?P<knobs>\{.*\}) \((?P<us>[\d.]+) us")


def _norm(knobs: Dict[str, Any]) -> str:
    """One text per knob set: a knob left None and a knob the record predates (written before it existed) are one
    set, the kernel's default."""
    return json.dumps({k: (list(v) if isinstance(v, tuple) else v) for k, v in knobs.items() if v is not None},
                      sort_keys=True)


def _log_records(paths) -> Dict[Tuple[str, str, int], Dict[str, Any]]:
    """(model, fmt, capacity) -> {"times": sorted stage-1/2 times not cut short, "winner": knobs, "winner_us"}."""
    out: Dict[Tuple[str, str, int], Dict[str, Any]] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            m = _LINE.search(line)
            if m and not m["cut"]:
                out.setdefault((m["model"], m["fmt"], int(m["cap"])), {"times": []})["times"].append(float(m["us"]))
                continue
            m = _WROTE.match(line)
            if m:
                rec = out.setdefault((m["model"], m["fmt"], int(m["cap"])), {"times": []})
                rec["winner"], rec["winner_us"] = ast.literal_eval(m["knobs"]), float(m["us"])
    for rec in out.values():
        rec["times"].sort()
    return out


def candidate_times(table: Dict[str, Any], logs, heuristic) -> Dict[str, Dict[str, float]]:
    """table key -> {normalised knob set: measured us} for every set whose time at that entry is on record."""
    from shim.sm90.knob_model import parse_key
    from tools.geometries import GEOMETRIES

    by_geometry = {(g["hidden"], g["intermediate"], g["experts"], g["top_k"]): name for name, g in GEOMETRIES.items()}
    out: Dict[str, Dict[str, float]] = {}
    for key, entry in table["entries"].items():
        _, g, _, _ = parse_key(key)
        meta = entry["meta"]
        times: Dict[str, float] = {}
        if meta.get("heuristic_us") is not None:
            times[_norm(heuristic(g.fmt, g.capacity))] = meta["heuristic_us"]
        if meta.get("runners_up_us") is not None:  # the staged search records its own times
            if meta.get("measured_winner") is not None:
                times.setdefault(_norm(meta["measured_winner"]), meta["measured_winner_us"])
            for knobs, us in zip(meta["runners_up"], meta["runners_up_us"]):
                times.setdefault(_norm(knobs), us)
            if meta.get("model_choice") is not None and meta.get("model_us") is not None:
                times.setdefault(_norm(meta["model_choice"]), meta["model_us"])
        elif g.world_size == 1:
            model = by_geometry.get((g.hidden, g.intermediate, g.experts_per_rank, g.top_k))
            rec = logs.get((model, g.fmt, g.capacity))
            if rec and rec.get("winner") and rec["times"]:
                times.setdefault(_norm(rec["winner"]), rec["times"][0])
                for i, knobs in enumerate(meta.get("runners_up", [])[:3]):
                    if i + 1 < len(rec["times"]):
                        times.setdefault(_norm(knobs), rec["times"][i + 1])
        for text, us in (meta.get("scores_us") or {}).items():
            times.setdefault(_norm(ast.literal_eval(text)), us)
        times.setdefault(_norm(entry["knobs"]), meta["tuned_us"])
        out[key] = times
    return out


def evaluate(table: Dict[str, Any], times: Dict[str, Dict[str, float]], accepts_for=None) -> List[Dict[str, Any]]:
    from shim.sm90.knob_model import choose, measured_entries

    everything = measured_entries(table["entries"])
    rows = []
    for held in everything:
        g = held.geometry
        shape = (g.hidden, g.intermediate, g.experts_per_rank, g.top_k)
        tuned = min(times[held.key].values())
        meta = table["entries"][held.key]["meta"]
        row = dict(key=held.key.split("/dev=")[0], tpe=g.tokens_per_expert, tuned_us=tuned,
                   heuristic_us=meta.get("heuristic_us"))
        accepts = accepts_for(g) if accepts_for else None
        def shape_of(m):
            return (m.geometry.hidden, m.geometry.intermediate, m.geometry.experts_per_rank, m.geometry.top_k)

        for how, rest in (("lco", [m for m in everything
                                   if (shape_of(m), m.geometry.fmt, m.geometry.capacity) != (shape, g.fmt, g.capacity)]),
                          ("lgo", [m for m in everything if shape_of(m) != shape])):
            picked = choose(g, rest, accepts=lambda k: accepts(k) if accepts else True)
            if picked is None:
                row[how] = None
                continue
            knobs, why = picked
            us = times[held.key].get(_norm(knobs))
            row[how] = dict(knobs=knobs, short=short(knobs), us=us, why=why)
        rows.append(row)
    return rows


def _ratio(a: Optional[float], b: float) -> str:
    return "-" if a is None else f"{a / b:.2f}"


def summarise(rows: List[Dict[str, Any]], how: str) -> str:
    measured = [r for r in rows if r.get(how) and r[how]["us"] is not None]
    known = [r[how]["us"] / r["tuned_us"] for r in measured]
    unmeasured = sum(1 for r in rows if r.get(how) and r[how]["us"] is None)
    none = sum(1 for r in rows if not r.get(how))
    heur = [r["heuristic_us"] / r["tuned_us"] for r in measured if r["heuristic_us"] is not None]

    def stats(xs):
        if not xs:
            return "none"
        gm = math.exp(sum(math.log(x) for x in xs) / len(xs))
        return (f"{len(xs)} entries, geometric mean {gm:.3f} x tuned, worst {max(xs):.2f}, "
                f"within 10%: {sum(1 for x in xs if x <= 1.10)}")

    return (f"{how}: model {stats(known)}; {unmeasured} choice(s) unmeasured, {none} without a choice (heuristic)\n"
            f"     the heuristic on the same entries: {stats(heur)}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--table", default=str(TABLE))
    ap.add_argument("--logs", nargs="+", default=[str(p) for p in LOGS])
    ap.add_argument("--no-build-check", action="store_true", help="skip the kernel's constructor check")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)

    from moe_ep.core.spec import MoESpec
    from shim.sm90.knobs import heuristic_knobs

    table = json.loads(Path(args.table).read_text())
    times = candidate_times(table, _log_records([Path(p) for p in args.logs]),
                            lambda fmt, cap: heuristic_knobs(fmt, cap).to_json())
    accepts_for = None
    if not args.no_build_check:
        from shim.sm90.knobs import Sm90Knobs
        from shim.sm90.tune import build_check
        from tools.tune.tune import _frontend_cls

        def accepts_for(g):
            spec = MoESpec(g.hidden, g.intermediate, g.experts_per_rank * g.world_size, g.top_k, g.capacity)
            check = build_check(_frontend_cls(g.fmt), spec, g.world_size)
            return lambda knobs: check(Sm90Knobs.from_json(knobs))

    rows = evaluate(table, times, accepts_for)
    head = f"{'entry':44} {'tpe':>6} {'tuned':>7} {'heur/t':>6}  {'leave-geometry-out choice':34} {'/t':>5}  " \
           f"{'leave-capacity-out choice':34} {'/t':>5}"
    print(head)
    print("-" * len(head))
    for r in rows:
        cells = []
        for how in ("lgo", "lco"):
            c = r.get(how)
            cells.append(f"{(c['short'] if c else 'none'):34} {(_ratio(c['us'], r['tuned_us']) if c else '-'):>5}")
        print(f"{r['key']:44} {r['tpe']:6.1f} {r['tuned_us']:7.1f} {_ratio(r['heuristic_us'], r['tuned_us']):>6}  "
              + "  ".join(cells))
    print()
    heur_all = [r["heuristic_us"] / r["tuned_us"] for r in rows if r["heuristic_us"] is not None]
    print(summarise(rows, "lgo"))
    print(summarise(rows, "lco"))
    print(f"heuristic over all {len(heur_all)} entries: worst {max(heur_all):.2f} x tuned, within 10%: "
          f"{sum(1 for x in heur_all if x <= 1.10)}")
    print("('-' under /t: the choice's time at that entry is not on record; tuned = the fastest time on record)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
