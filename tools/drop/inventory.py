"""File inventories of a drop tree and their differences, per kernel package."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple

__all__ = ["FileEntry", "Inventory", "PackageDiff", "diff_inventories", "inventory_of_tree", "inventory_from_manifest"]


@dataclasses.dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str


# relative path (posix) -> entry
Inventory = Dict[str, FileEntry]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def inventory_of_tree(tree_root: Path) -> Inventory:
    """Every regular file under the tree root (caches and Bazel's own files excluded)."""
    root = Path(tree_root)
    out: Inventory = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if not path.is_file() or _ignored(rel):
            continue
        out[rel.as_posix()] = FileEntry(path.stat().st_size, _sha256(path))
    return out


# Files that appear next to an extracted tree but are not part of the drop:
# bytecode caches, and what Bazel writes into an external repository root.
_IGNORED_TOP = {"BUILD", "BUILD.bazel", "WORKSPACE", "WORKSPACE.bazel", "REPO.bazel", "MODULE.bazel", "carrier.json"}


def _ignored(rel: Path) -> bool:
    if "__pycache__" in rel.parts or rel.suffix == ".pyc":
        return True
    return len(rel.parts) == 1 and rel.name in _IGNORED_TOP


def inventory_from_manifest(manifest: Mapping) -> Inventory:
    """Read a committed manifest: {"files": {path: {"sha256", "size"}}} or {path: sha256}."""
    files = manifest.get("files", manifest)
    out: Inventory = {}
    for rel, value in files.items():
        if isinstance(value, str):
            out[rel] = FileEntry(-1, value)
        else:
            out[rel] = FileEntry(int(value.get("size", -1)), value["sha256"])
    return dict(sorted(out.items()))


def load_manifest_file(path: Path) -> Inventory:
    return inventory_from_manifest(json.loads(Path(path).read_text(encoding="utf-8")))


def package_of(rel: str) -> str:
    """Top-level package a file belongs to; files at the tree root group under '.'."""
    return rel.split("/", 1)[0] if "/" in rel else "."


def packages_in(inv: Inventory) -> List[str]:
    return sorted({package_of(rel) for rel in inv if "/" in rel})


@dataclasses.dataclass
class PackageDiff:
    package: str
    status: str  # same | added | removed | changed
    added: List[str] = dataclasses.field(default_factory=list)
    removed: List[str] = dataclasses.field(default_factory=list)
    changed: List[str] = dataclasses.field(default_factory=list)
    old_files: int = 0
    new_files: int = 0


def diff_inventories(old: Inventory, new: Inventory) -> List[PackageDiff]:
    packages = sorted({package_of(r) for r in old} | {package_of(r) for r in new})
    out = []
    for pkg in packages:
        o = {r: e for r, e in old.items() if package_of(r) == pkg}
        n = {r: e for r, e in new.items() if package_of(r) == pkg}
        d = PackageDiff(pkg, "same", old_files=len(o), new_files=len(n))
        d.added = sorted(set(n) - set(o))
        d.removed = sorted(set(o) - set(n))
        d.changed = sorted(r for r in set(o) & set(n) if o[r].sha256 != n[r].sha256)
        if not o:
            d.status = "added"
        elif not n:
            d.status = "removed"
        elif d.added or d.removed or d.changed:
            d.status = "changed"
        out.append(d)
    return out


def totals(inv: Inventory) -> Tuple[int, int]:
    return len(inv), sum(max(e.size, 0) for e in inv.values())


def manifest_json(inv: Inventory, extra: Optional[dict] = None) -> dict:
    data = dict(extra or {})
    data["files"] = {rel: {"sha256": e.sha256, "size": e.size} for rel, e in sorted(inv.items())}
    return data
