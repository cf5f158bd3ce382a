"""Regenerate third_party/cutedsl_megamoe/<tree>.manifest.json after a bump.

The manifest format and generator belong to third_party/cutedsl_megamoe/manifest.py
(the per-file sha256 record the foundation's manifest test checks); this module
only calls it, so there is one definition of what a manifest holds.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

from tools.drop.pins import manifest_path
from tools.drop.trees import Tree

__all__ = ["generator", "write_manifest"]


def generator(repo_root: Path) -> ModuleType:
    """third_party/cutedsl_megamoe/manifest.py of this checkout, loaded by path.

    Loaded from the checkout being bumped (not from the runfiles copy) so a
    bump always writes the format that checkout's tests expect.
    """
    path = Path(repo_root) / "third_party" / "cutedsl_megamoe" / "manifest.py"
    if not path.is_file():
        raise FileNotFoundError(f"{path} (the manifest generator) is missing")
    spec = importlib.util.spec_from_file_location("_cutedsl_megamoe_manifest", path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def write_manifest(repo_root: Path, tree: Tree, tree_root: Path, version: str, sha256: str) -> Path:
    gen = generator(repo_root)
    data = gen.compute_manifest(tree_root)
    out = manifest_path(repo_root, tree)
    out.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out
