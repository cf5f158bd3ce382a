"""Regenerate third_party/cutedsl_megamoe/<tree>.manifest.json after a bump.

The manifest format and generator belong to third_party/cutedsl_megamoe/manifest.py
(the per-file sha256 record the foundation's manifest test checks); this module
only calls it, so there is one definition of what a manifest holds.
"""

from __future__ import annotations

from pathlib import Path

from third_party.cutedsl_megamoe import manifest as _manifest
from shim.common.tree_facts import TreeFacts

__all__ = ["manifest_path", "write_manifest"]


def manifest_path(repo_root: Path, tree: TreeFacts) -> Path:
    return _manifest.manifest_path(tree.arch, repo_root)


def write_manifest(repo_root: Path, tree: TreeFacts, tree_root: Path, version: str, sha256: str) -> Path:
    out = manifest_path(repo_root, tree)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(_manifest.dumps(_manifest.compute_manifest(tree_root, version, sha256)), encoding="utf-8")
    return out
