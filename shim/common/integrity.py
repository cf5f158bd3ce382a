"""Per-file sha256 of a kernel tree, compared with a pinned manifest.

The manifest format is the one third_party/cutedsl_megamoe/manifest.py defines (and tools/drop writes):

    {"version": "0.7.4", "carrier_sha256": "<sha256 of the wheel>", "files": {"common/host_utils.py": "<sha256>"}}

paths relative to the tree's src/ root, '/'-separated. What counts as a file of the tree is the same here as
there: every file, symlinks followed, except byte-code caches (`__pycache__/`, `*.pyc`, `*.pyo`) and the files
the Bazel repository rule adds at the root (ADDED_FILES). Keep the two in step: a file one side counts and
the other skips shows up as `added` or `removed` on every load.

Byte code and native code are listed apart (`scan_tree`): a `.pyc` / `.pyo` outside `__pycache__/` is a sourceless
module Python imports as it is, and a shared object (`.so`, `.pyd`, any extension suffix) shadows the `.py` of the
same name; neither is ever part of a drop as the wheel ships it. So are the directories (one no manifest file sits
under is a package the drop does not have: Python imports it as a namespace package).

Stdlib only; nothing here imports a kernel module. tree.py decides what a mismatch means.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import json
import os
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List

__all__ = ["ADDED_FILES", "PINNED_MANIFEST", "TreeDiff", "TreeScan", "diff_files", "legacy_init_files", "listed_dirs",
           "load_manifest", "scan_tree", "tree_digests"]

# Written inside the Bazel drop repository at fetch time, from the pinned manifest (drop_repo.bzl).
PINNED_MANIFEST = "pinned.manifest.json"
# Files drop_repo.bzl adds at the repository root; not part of the drop.
ADDED_FILES = frozenset({"BUILD.bazel", "WORKSPACE", "carrier.json", PINNED_MANIFEST})
_SKIP_DIRS = frozenset({"__pycache__"})
_SKIP_SUFFIXES = (".pyc", ".pyo")
_NATIVE_SUFFIXES = tuple(sorted(set(importlib.machinery.EXTENSION_SUFFIXES) | {".so", ".pyd"}))
_CHUNK = 1 << 20
_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        if hasattr(hashlib, "file_digest"):  # 3.11: one buffer, readinto, no per-chunk bytes objects
            return hashlib.file_digest(f, "sha256").hexdigest()
        h = hashlib.sha256()
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
        return h.hexdigest()


@dataclass
class TreeScan:
    digests: Dict[str, str]  # {relative path: sha256} of every file of the tree (the manifest's view)
    sourceless: List[str]  # .pyc / .pyo outside __pycache__/: importable byte code with no source
    native: List[str]  # shared objects: importable native code
    dirs: List[str]  # every directory but __pycache__/, relative ('' is not listed)


def scan_tree(root: str) -> TreeScan:
    """One walk of the tree at `root`: its files' digests, and what is importable without being a source file."""
    if not os.path.isdir(root):
        raise FileNotFoundError(f"not a directory: {root}")
    scan = TreeScan({}, [], [], [])
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        rel_dir = os.path.relpath(dirpath, root)
        at_root = rel_dir == "."
        if not at_root:
            scan.dirs.append(rel_dir.replace(os.sep, "/"))
        for name in filenames:
            rel = name if at_root else f"{rel_dir}/{name}".replace(os.sep, "/")
            if name.endswith(_SKIP_SUFFIXES):
                scan.sourceless.append(rel)
                continue
            if at_root and name in ADDED_FILES:
                continue
            if name.endswith(_NATIVE_SUFFIXES):
                scan.native.append(rel)
            scan.digests[rel] = _sha256(os.path.join(dirpath, name))
    return scan


def tree_digests(root: str) -> Dict[str, str]:
    """{relative path: sha256} of every file of the tree at `root` (see the module doc for what is left out)."""
    return scan_tree(root).digests


def listed_dirs(files) -> FrozenSet[str]:
    """The directories a manifest's files sit in (every ancestor)."""
    out = set()
    for rel in files:
        parts = rel.split("/")[:-1]
        out.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
    return frozenset(out)


def load_manifest(path: str) -> dict:
    """A manifest file, checked for shape (ValueError names the file when it is not one)."""
    with open(path, "r", encoding="utf-8") as f:
        data = json.load(f)
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        raise ValueError(f"{path} is not a tree manifest (expected {{'version', 'carrier_sha256', 'files': {{...}}}})")
    return data


@dataclass
class TreeDiff:
    changed: List[str] = field(default_factory=list)
    added: List[str] = field(default_factory=list)  # in the tree, not in the manifest
    removed: List[str] = field(default_factory=list)  # in the manifest, not in the tree

    def __bool__(self) -> bool:
        return bool(self.changed or self.added or self.removed)

    def counts(self) -> str:
        return f"{len(self.changed)} changed, {len(self.added)} added, {len(self.removed)} removed"

    def describe(self, limit: int = 8) -> str:
        """'changed: a, b; added: c' with at most `limit` names per kind."""
        parts = []
        for kind in ("changed", "added", "removed"):
            names = getattr(self, kind)
            if names:
                more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
                parts.append(f"{kind}: {', '.join(names[:limit])}{more}")
        return "; ".join(parts) if parts else "identical"


def diff_files(expected: Dict[str, str], actual: Dict[str, str]) -> TreeDiff:
    return TreeDiff(
        changed=sorted(p for p in expected.keys() & actual.keys() if expected[p] != actual[p]),
        added=sorted(actual.keys() - expected.keys()),
        removed=sorted(expected.keys() - actual.keys()),
    )


def legacy_init_files(diff: TreeDiff, digests: Dict[str, str]) -> List[str]:
    """The added files when every difference is an empty `__init__.py` the manifest does not list (and the
    directories they make), else []: what Bazel's legacy_create_init writes into a runfiles tree, not an edit."""
    inits = [p for p in diff.added if p.rsplit("/", 1)[-1] == "__init__.py" and digests.get(p) == _EMPTY_SHA256]
    others = [p for p in diff.added if p not in inits and not p.endswith("/")]
    return inits if inits and not (others or diff.changed or diff.removed) else []
