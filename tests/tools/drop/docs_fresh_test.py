"""docs/drop/<tree>.md must be what `tools/drop docs` generates now.

The page is derived from the pinned drop (under Bazel: the @cutedsl_megamoe_<tree>
data dependency; elsewhere $MOE_EP_<TREE>_TREE or the tool's pip cache) and from
the live shim sources, contract and pins of this checkout. Which trees: all, or
those named in $MOE_EP_DOCS_TREES (Bazel runs one target per tree so that no
target depends on both trees).
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest

from tools.drop.cli import render_docs_for
from tools.drop.fetch import default_cache_dir
from tools.drop.docs import REFRESH_COMMAND, docs_path
from shim.common.tree_facts import TREES
from tools.drop.trees import find_repo_root


def _trees():
    names = os.environ.get("MOE_EP_DOCS_TREES")
    return [n.strip() for n in names.split(",") if n.strip()] if names else sorted(TREES)


@pytest.mark.parametrize("tree_name", _trees())
def test_committed_docs_are_fresh(tree_name):
    # Under Bazel this file is a runfiles link into the checkout (tagged local: it
    # reads the live tree; the source digest in its data reruns it when that changes).
    repo = find_repo_root(Path(__file__).resolve().parent)
    tree = TREES[tree_name]
    path = docs_path(repo, tree)
    rel = path.relative_to(repo)
    expected = render_docs_for(repo, tree, default_cache_dir())
    assert path.is_file(), f"{rel} is missing; generate it with `{REFRESH_COMMAND}`"
    committed = path.read_text(encoding="utf-8")
    if committed != expected:
        diff = "".join(
            list(difflib.unified_diff(committed.splitlines(True), expected.splitlines(True), f"{rel} (committed)", f"{rel} (generated)"))[:60]
        )
        pytest.fail(f"{rel} is stale; refresh it with `{REFRESH_COMMAND}` and commit it.\n{diff}")


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
