"""The pinned drop, audited against its committed manifest, the shim and the contract, is clean.

This is the audit a maintainer runs (`bazel run //tools:drop -- audit`): it fails
as soon as the shim names a kernel symbol the pinned drop lacks, offers a knob
value the drop rejects, builds a kernel class whose signature is not the
accepted contract, or the tree differs from its manifest -- read from the directory the
tree was extracted to, behind Bazel's runfiles links, so that a stray compiled file
(`__pycache__/`, `*.pyc`) left there by someone's import fails it too. Trees: all, or
those in $MOE_EP_DOCS_TREES (Bazel runs one target per tree).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tools.drop import contract as contract_mod
from tools.drop.audit import run_audit
from tools.drop.cli import pinned_tree_root, real_tree_dir
from tools.drop.fetch import default_cache_dir
from tools.drop.inventory import inventory_of_tree, load_manifest_file
from tools.drop.manifests import manifest_path
from tools.drop.pins import read_pins_file
from tools.drop.report import render_terminal
from shim.common.tree_facts import TREES
from tools.drop.trees import find_repo_root


def _trees():
    names = os.environ.get("MOE_EP_DOCS_TREES")
    return [n.strip() for n in names.split(",") if n.strip()] if names else sorted(TREES)


@pytest.mark.parametrize("tree_name", _trees())
def test_pinned_drop_audits_clean(tree_name):
    repo = find_repo_root(Path(__file__).resolve().parent)  # the live checkout (see BUILD)
    tree = TREES[tree_name]
    root, _ = pinned_tree_root(repo, tree, default_cache_dir())
    version = read_pins_file(repo, tree)[0]
    manifest = manifest_path(repo, tree)
    assert manifest.is_file(), f"{manifest.relative_to(repo)} is missing"
    result = run_audit(
        repo, tree, root, load_manifest_file(manifest), inventory_of_tree(real_tree_dir(root)), f"{version} (manifest)", version,
        contract_mod.load_contract(contract_mod.contract_path(repo, tree.arch)),
    )
    assert result.clean, (
        f"the pinned {tree.arch} drop does not audit clean; see below, fix shim/{tree.arch} or accept the "
        f"contract (bazel run //tools:drop -- bump --tree {tree.arch} --version {version} --accept-contract)\n"
        + render_terminal(result)
    )


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
