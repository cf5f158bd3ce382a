"""Every repository path that README.md and docs/**/*.md name exists, so the prose never presents a file, tool or
folder that is gone (or never was) as current.

What counts as a path: a backticked span or a markdown link target that starts with one of the repository's
top-level entries (`moe_ep/...`, `tools/diag/host_cost.py`, `README.md`), or, for links, a path relative to the
page; in fenced blocks, whitespace-separated words that start with a top-level directory. A trailing `:line` or
`#anchor` is dropped. Placeholders match like globs and need at least one match: `<arch>`, `<x>` and `*` any run
of characters in one path segment, `{a,b}` each alternative, a word in capitals (`OLD`) when the literal name is
not there. Generated pages under docs/drop/ (the drop tool
writes and checks them) and records of past runs are listed below with the reason.
"""

from __future__ import annotations

import glob
import re
import sys
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest

# Paths that are not checked, each with why: only historical records belong here (what a past run used, named as
# the command that made a committed record). Empty now: the records under benchmarks/ are not scanned, and the
# pages name a deleted tool without backticks ("made by tools.diag.host_probe, whose modes are now ...").
HISTORICAL: dict = {}
# Pages the drop tool generates from the shim and the drop, and checks itself (tests/tools/drop docs freshness);
# their paths name files inside the kernel drops and inside synthetic checkouts.
GENERATED = ("docs/drop/",)


def _repo_root() -> Path:
    here = Path(__file__).resolve()
    for parent in [here.parent, *here.parents]:
        if (parent / "WORKSPACE").is_file() and (parent / "moe_ep").is_dir():
            return parent
    raise RuntimeError(f"no repository root above {here}")


ROOT = _repo_root()
TOP = sorted(p.name for p in ROOT.iterdir()
             if not p.name.startswith((".git", ".pytest_cache", ".ruff_cache", ".drop", "bazel-")))
TOP_DIRS = tuple(n + "/" for n in TOP if (ROOT / n).is_dir())

_FENCE = re.compile(r"^\s*(```|~~~)")
_TICK = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _pages() -> List[Path]:
    """README.md, docs/**/*.md and the notes beside the code (shim/sm100/README.md, tools/bazel/OFFLINE.md, ...);
    not benchmarks/ (records of past runs, with the commands that made them) nor the generated pages."""
    pages = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
    for top in ("moe_ep", "shim", "tools", "third_party", "tests", "examples"):
        pages += sorted((ROOT / top).rglob("*.md"))
    return [p for p in pages if not p.relative_to(ROOT).as_posix().startswith(GENERATED)]


def _clean(token: str) -> str:
    token = token.strip().strip("'\"")
    token = token.split("#", 1)[0]
    token = re.sub(r"^([^:]*\.\w+):.*$", r"\1", token)  # file.py:12, file.py:Symbol
    return token.rstrip(".,;:)")


def _is_repo_path(token: str) -> bool:
    if not token or " " in token or token.startswith(("/", "//", "@", "$", "http:", "https:")):
        return False
    return token.startswith(TOP_DIRS) or token in TOP


def _expand(pattern: str) -> List[str]:
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m:
        return [x for alt in m.group(1).split(",") for x in _expand(pattern[:m.start()] + alt + pattern[m.end():])]
    return [re.sub(r"<[^<>/]*>", "*", pattern)]


def _exists(path: str, base: Path) -> bool:
    patterns = _expand(path)
    if not any(_found(p, base) for p in patterns):
        # A name in capitals (audit-sm90-OLD-to-NEW.md) is a placeholder too, when the literal name is not there.
        patterns = [re.sub(r"(?<![A-Za-z])[A-Z]{2,}(?![A-Za-z])", "*", p) for p in patterns]
    return any(_found(p, base) for p in patterns)


def _found(pattern: str, base: Path) -> bool:
    return any(glob.glob(str(root / pattern)) for root in (ROOT, base))


def _mentions(page: Path) -> Iterator[Tuple[int, str, bool]]:
    """(line, path, is_link) for every path the page names."""
    fenced = False
    for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            for word in line.split():
                token = _clean(word)
                if token.startswith(TOP_DIRS):
                    yield n, token, False
            continue
        for m in _LINK.finditer(line):
            target = _clean(m.group(1))
            if target and not target.startswith(("http:", "https:", "mailto:")):
                yield n, target, True
        for m in _TICK.finditer(line):
            token = _clean(m.group(1))
            if _is_repo_path(token):
                yield n, token, False


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_path_a_page_names_exists(page):
    missing = []
    for line, path, is_link in _mentions(page):
        if path in HISTORICAL:
            continue
        if not _exists(path, page.parent):
            missing.append(f"{page.relative_to(ROOT)}:{line}: {path}" + (" (link)" if is_link else ""))
    assert not missing, "paths named but not in the repository:\n" + "\n".join(missing)


def test_the_scan_finds_what_it_should(tmp_path):
    """The rules on a page of their own: a gone file is reported, placeholders and anchors are not."""
    page = tmp_path / "page.md"
    page.write_text("See `moe_ep/layer.py:12`, `shim/<arch>/formats.py`, `shim/sm90/{fp8,bf16}_frontend.py`,\n"
                    "`tools/diag/no_such_tool.py` and `python -m tools.main`, [the shim](docs/shim.md#shape).\n"
                    "`docs/drop/audit-sm90-OLD-to-NEW.md` but not `docs/drop/audit-sm90-OLD-from-NEW.md`\n"
                    "```\nshim/sm100/tables/    a folder that is not there\n```\n")
    found = [(p, _exists(p, page.parent)) for _, p, _ in _mentions(page)]
    assert found == [("moe_ep/layer.py", True), ("shim/<arch>/formats.py", True),
                     ("shim/sm90/{fp8,bf16}_frontend.py", True), ("docs/shim.md", True),
                     ("tools/diag/no_such_tool.py", False), ("docs/drop/audit-sm90-OLD-to-NEW.md", True),
                     ("docs/drop/audit-sm90-OLD-from-NEW.md", False), ("shim/sm100/tables/", False)]


def test_the_index_names_every_page():
    """docs/README.md is the index: every page under docs/ (the generated ones under docs/drop/ as their folder) is
    linked from it, so a new page cannot be left where nobody finds it."""
    index = ROOT / "docs" / "README.md"
    linked = {(index.parent / target.split("#", 1)[0]).resolve()
              for target in _LINK.findall(index.read_text(encoding="utf-8")) if not target.startswith("http")}
    pages = [p for p in sorted((ROOT / "docs").glob("*.md")) if p != index]
    missing = [p.relative_to(ROOT).as_posix() for p in pages if p.resolve() not in linked]
    assert not missing, f"pages docs/README.md does not link: {missing}"
    assert (ROOT / "docs" / "drop").resolve() in linked, "docs/README.md does not link the generated pages (drop/)"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
