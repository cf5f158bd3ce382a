"""The child process of the audit's build stage: one candidate tree, the shim's knob resolution and kernel compiles.

    python -m tools.drop.build_child PLAN.json

run by tools/drop/build_stage.py with the checkout as its working directory, the candidate tree named by the tree's
environment variable (and declared unpinned: a new drop matches no pin yet), CUTE_DSL_ARCH set from the tree facts.
One process holds one tree (the trees share top-level package names), so each arch gets its own children.

Each job builds the frontend a layer would build (shim.common.backend.compile_only_frontend: the backend's rules,
knob resolution, the kernel object) and, when asked, compiles it or runs the numerical check on it
(tools/drop/numerics.py: the shim's layouts through the drop's own CPU references). One JSON line per job on stdout,
after MARK; the parent reads nothing else from stdout.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import traceback
from typing import Optional

MARK = "@@drop-build@@ "
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _message(e: BaseException) -> str:
    """'Type: message' on one line: terminal colours and the DSL's source excerpts (`-->`, `|` lines) left out."""
    lines = [line.strip() for line in _ANSI.sub("", str(e)).splitlines()]
    kept = [line for line in lines if line and not line.startswith(("-->", "|")) and not line[:1].isdigit()]
    return f"{type(e).__name__}: {' '.join(kept)}".strip()[:1000]


def _site(tb, under: str, strip: str) -> Optional[str]:
    """'rel/path.py:line' of the innermost frame whose file lies under `under`."""
    found = None
    for frame in traceback.extract_tb(tb):
        path = os.path.realpath(frame.filename)
        if path.startswith(under + os.sep):
            found = f"{os.path.relpath(path, strip)}:{frame.lineno}"
    return found


def _knobs_dict(knobs) -> Optional[dict]:
    import dataclasses

    if knobs is None or not dataclasses.is_dataclass(knobs):
        return None
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(knobs).items()}


def run_job(job: dict, repo: str, tree_root: str) -> dict:
    import moe_ep
    from shim.common.backend import compile_only_frontend
    from tools.drop import numerics

    out = {"id": job["id"], "ok": False, "stage": "resolve", "seconds": 0.0, "cpu_seconds": 0.0, "knobs": None,
           "kernel": None, "error": "", "shim_site": None, "drop_site": None}
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        spec = moe_ep.MoESpec(**job["geometry"], max_tokens_per_rank=job["capacity"])
        frontend = compile_only_frontend(job["backend"], spec, fmt=job["fmt"], knobs=job["knobs"],
                                         world_size=job["world_size"])
        out["knobs"] = _knobs_dict(getattr(frontend, "knobs", None))
        out["kernel"] = type(frontend.kernel).__name__
        if job.get("numbers"):
            out["stage"] = "numbers"
            numerics.check(frontend, repo, tree_root)
        elif job["compile"]:
            out["stage"] = "compile"
            t0, c0 = time.perf_counter(), time.process_time()
            frontend.compile()
        out["ok"] = True
    except numerics.Mismatch as e:
        out["error"] = str(e)
        out["shim_site"], out["drop_site"] = e.shim_site, e.drop_site
    except BaseException as e:  # noqa: BLE001 - every failure is the verdict of this job, reported, not raised
        if isinstance(e, KeyboardInterrupt):
            raise
        out["error"] = _message(e)
        out["shim_site"] = _site(e.__traceback__, os.path.join(repo, "shim"), repo)
        out["drop_site"] = _site(e.__traceback__, tree_root, tree_root)
    out["seconds"] = round(time.perf_counter() - t0, 3)
    out["cpu_seconds"] = round(time.process_time() - c0, 3)  # the machine's other load left out
    return out


def main(argv) -> int:
    with open(argv[1], encoding="utf-8") as f:
        plan = json.load(f)
    repo = os.path.realpath(os.getcwd())
    tree_root = os.path.realpath(plan["tree_root"])
    for job in plan["jobs"]:
        result = run_job(job, repo, tree_root)
        sys.stdout.write(MARK + json.dumps(result) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
