"""docs/drop/worked-example-sm90.md is what docs/drop-audit.md's procedure does now, run step by step by this test.

The steps run the real `//tools:drop` binary as `bazel run` starts it (tests/tools/drop/binary.py: its exit codes
are the ones the page shows) on a sandbox copy of this checkout (its shim, moe_ep, tools, pins and contracts) with
two wheels made from the pinned Hopper tree (tests/tools/drop/synthetic.py, deterministic: the same tree gives the
same bytes and hashes): A holds the tree as it is, B the tree without its BF16 package (as 0.7.2.post1, which
predates it). Every number in the page comes from the same run, so its tables and its verdict lines cannot
disagree; the test fails when the committed page is not what the run gives.

    bazel build //tools:drop && python -m tests.tools.drop.worked_example_test --write   # regenerate the page
"""

from __future__ import annotations

import difflib
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import List, Tuple

import pytest

from shim.common.tree_facts import TREES
from tests.tools.drop import synthetic
from tests.tools.drop.binary import run_drop
from tools.drop import cli
from tools.drop.fetch import default_cache_dir, sha256_file
from tools.drop.trees import find_repo_root

DOC = Path("docs") / "drop" / "worked-example-sm90.md"
REFRESH = "bazel build //tools:drop && python -m tests.tools.drop.worked_example_test --write"
SM90 = TREES["sm90"]
A, B = "0.7.4.dev1", "0.7.5.dev1"


def _sandbox(repo: Path, dest: Path) -> Path:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for part in ("moe_ep", "shim", "tools", "third_party"):
        shutil.copytree(repo / part, dest / part, ignore=ignore)
    (dest / "WORKSPACE").write_text("# sandbox of the worked example\n")
    return dest


def _sub(text: str, subs: List[Tuple[str, str]]) -> str:
    for old, new in subs:
        text = text.replace(old, new)
    return text


def _run(repo: Path, box: Path, args: List[str], subs: List[Tuple[str, str]]) -> Tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if k not in {t.env_var for t in TREES.values()}}
    run = run_drop(repo, args, cwd=box, env=env)

    def clean(text: str) -> str:
        text = "\n".join(line for line in text.splitlines() if not line.startswith("INFO: "))
        text = _sub(text, subs)
        return text.rstrip() + "\n" if text.strip() else ""

    return run.code, clean(run.stdout), clean(run.stderr)


def _verdict(stdout: str) -> str:
    """What stays on screen: the verdict block the terminal output ends with."""
    return stdout.split("[verdict] ", 1)[1] if "[verdict] " in stdout else stdout


def _block(text: str) -> List[str]:
    return ["```", *text.rstrip("\n").splitlines(), "```", ""]


def generate(repo: Path) -> str:
    pinned, _ = cli.pinned_tree_root(repo, SM90, default_cache_dir())
    with tempfile.TemporaryDirectory(prefix="worked-example-") as tmp:
        tmp = Path(tmp)
        box = _sandbox(repo, tmp / "checkout")
        files = synthetic.tree_files(pinned)
        prefix = synthetic.WHEEL_PREFIX_SM90
        wa = synthetic.make_wheel(tmp / "handover" / f"flashinfer_python-{A}-py3-none-any.whl", prefix, files)
        wb = synthetic.make_wheel(tmp / "handover" / f"flashinfer_python-{B}-py3-none-any.whl", prefix,
                                  {r: t for r, t in files.items() if not r.startswith("moe_hopper_bf16/")})
        sha_a, sha_b = sha256_file(wa), sha256_file(wb)
        cache = tmp / "cache"
        subs = [(str(box), "<checkout>"), (str(tmp / "handover"), "<handover>"), (str(cache), "<cache>")]
        base = ["--repo", str(box), "--cache-dir", str(cache)]
        steps = [
            ("the pinned tree, handed over as wheel A: pinned", ["bump", "--tree", "sm90", "--wheel", str(wa),
                                                                  "--sha256", sha_a, "--no-compile"]),
            ("wheel B with an announced hash it does not have", ["bump", "--tree", "sm90", "--wheel", str(wb),
                                                                  "--sha256", sha_a, "--no-compile"]),
            ("preview of B: the audit with its build stage (knobs resolved at every bucket, the numbers checked, "
             "no compile)", ["audit", "--tree", "sm90", "--wheel", str(wb), "--sha256", sha_b, "--no-compile"]),
            ("bump to B (the preview's build stage read back)", ["bump", "--tree", "sm90", "--wheel", str(wb),
                                                                 "--sha256", sha_b, "--no-compile"]),
            ("back to A, by its version (the wheel cache holds it, the verdict cache its build stage)",
             ["bump", "--tree", "sm90", "--version", A, "--sha256", sha_a, "--no-compile"]),
        ]
        runs = []
        for title, args in steps:
            before = synthetic.snapshot(box)
            code, out, err = _run(repo, box, base + args, subs)
            after = synthetic.snapshot(box)
            changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
            shown = " ".join(["--repo", "<checkout>", "--cache-dir", "<cache>"] + [_sub(a, subs) for a in args])
            runs.append((title, shown, code, out, err, changed))

    lines = [
        "# Worked example: a Hopper drop without its BF16 package, refused; the pinned one kept",
        "",
        f"<!-- Generated by `{REFRESH}`; do not edit. //tests/tools/drop:worked_example_test fails when it is stale. -->",
        "",
        "The procedure of docs/drop-audit.md (\"Bumping a drop\", \"A drop that is not on the index\") run end to end by",
        "`tests/tools/drop/worked_example_test.py` on a sandbox copy of this checkout, with two wheels made from the",
        f"pinned Hopper tree as a kernel team would hand them over: A ({A}) holds the tree as it is, B ({B}) the same",
        "tree without `moe_hopper_bf16` (as 0.7.2.post1, which predates the Hopper BF16 package). Taking B must break",
        "the BF16 backend and nothing else. The wheels' hashes are those of these synthetic files (which is also why",
        "the shipped knob tables read as stale: they are keyed by the real pin's hash); `<checkout>`, `<handover>` and",
        "`<cache>` stand for the sandbox, the hand-over directory and the tool's cache. Every step runs the build",
        "stage (docs/drop-audit.md) without compiles (`--no-compile`, which the verdict marks as a warning) to keep",
        "the run short; a bump right after an audit of the same tree, shim and plan reads its build stage back from",
        "the cache.",
        "",
        "| step | command | exit | what changed in the checkout |",
        "|---|---|---|---|",
    ]
    for n, (title, shown, code, out, err, changed) in enumerate(runs, 1):
        # Paths in the sandbox checkout, not in this one (an audit report the sandbox wrote is not committed here).
        what = ", ".join(f"`<checkout>/{c}`" for c in changed) or "nothing"
        lines.append(f"| {n} | `bazel run //tools:drop -- {shown}` | {code} | {what} |")
    lines.append("")
    for n, (title, shown, code, out, err, changed) in enumerate(runs, 1):
        lines += [f"## {n}. {title[0].upper()}{title[1:]}", "", f"`bazel run //tools:drop -- {shown}` exits {code}.",
                  ""]
        if out:
            lines += ["The verdict, as the terminal shows it last:", ""] + _block(_verdict(out))
        if err:
            lines += ["On stderr:", ""] + _block(err)
    code_b = runs[3][2]
    lines += ["## What it shows", "",
              f"B was refused (exit {code_b}) with only its report written, and every break it names is in the BF16",
              "backend or in code no registered backend runs; the FP8 backend stays `ok`. The verdict line counts each",
              "distinct break once: the per-backend counts plus those no backend runs (and, after a build stage, its",
              "own breaks) add up to it. Going back to A by its version needed no hand-over and no network: the",
              "tool's wheel cache held it, checked against its hash again."]
    reread = [n for n, run in enumerate(runs, 1) if "read from the cache" in run[4]]
    if reread:
        lines += [f"Step{'s' if len(reread) > 1 else ''} {' and '.join(map(str, reread))} ran no build stage: "
                  "the verdict of the same tree, shim and plan was read back from the tool's cache (a bump right "
                  "after its preview, and a bump back to a tree built before)."]
    lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def test_the_worked_example_is_what_the_procedure_does_now():
    repo = find_repo_root(Path(__file__).resolve().parent)
    path = repo / DOC
    expected = generate(repo)
    assert path.is_file(), f"{DOC} is missing; generate it with `{REFRESH}`"
    committed = path.read_text(encoding="utf-8")
    if committed != expected:
        diff = "".join(list(difflib.unified_diff(committed.splitlines(True), expected.splitlines(True),
                                                 f"{DOC} (committed)", f"{DOC} (generated)"))[:80])
        pytest.fail(f"{DOC} is stale; refresh it with `{REFRESH}` and commit it.\n{diff}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        root = find_repo_root(Path(__file__).resolve().parent)
        (root / DOC).write_text(generate(root), encoding="utf-8")
        print(f"wrote {DOC}")
    else:
        raise SystemExit(pytest.main([__file__, "-q"]))
