"""File inventories of a drop tree and their differences, per kernel package."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Dict, List, Mapping, Tuple

from third_party.cutedsl_megamoe import manifest as _manifest

__all__ = ["FileEntry", "Inventory", "PackageDiff", "diff_inventories", "inventory_of_tree", "inventory_from_manifest",
           "is_compiled", "package_renames"]


@dataclasses.dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str


# relative path (posix) -> entry
Inventory = Dict[str, FileEntry]


def inventory_of_tree(tree_root: Path) -> Inventory:
    """Every file under the tree root, with its size.

    Which files count (Bazel's added files at the root left out; stray byte-code
    caches kept, so that they show up as added files) and their digests come from
    the manifest generator, the one definition shared with the committed
    manifests and their test.
    """
    root = Path(tree_root)
    return {
        rel: FileEntry((root / rel).stat().st_size, digest)
        for rel, digest in _manifest.file_digests(root).items()
    }


def inventory_from_manifest(manifest: Mapping) -> Inventory:
    """A committed manifest ({"files": {path: sha256}}) as an inventory; sizes unknown (-1)."""
    files = manifest.get("files", manifest)
    out: Inventory = {}
    for rel, value in files.items():
        if isinstance(value, str):
            out[rel] = FileEntry(-1, value)
        else:
            out[rel] = FileEntry(int(value.get("size", -1)), value["sha256"])
    return dict(sorted(out.items()))


def load_manifest_file(path: Path) -> Inventory:
    return inventory_from_manifest(_manifest.load_manifest(path))


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


def is_compiled(rel: str) -> bool:
    """A byte-code file or anything under __pycache__: never part of a drop as the wheel ships it."""
    return _manifest.is_compiled(rel)


def package_renames(old: Inventory, new: Inventory, threshold: float = 0.5) -> List[Tuple[str, str, str]]:
    """(old package, new package, evidence) for a removed and an added package with the same files.

    Evidence is content: the share of the old package's files found, at the same path inside the
    new package, with the same sha256. One-to-one, best match first; below `threshold` it is a
    removal plus an addition, not a rename.
    """
    old_pkgs = {package_of(r) for r in old if "/" in r}
    new_pkgs = {package_of(r) for r in new if "/" in r}
    gone, came = sorted(old_pkgs - new_pkgs), sorted(new_pkgs - old_pkgs)
    scored = []
    for g in gone:
        files = {r.split("/", 1)[1]: e.sha256 for r, e in old.items() if package_of(r) == g and "/" in r}
        for c in came:
            other = {r.split("/", 1)[1]: e.sha256 for r, e in new.items() if package_of(r) == c and "/" in r}
            same = sum(1 for rel, sha in files.items() if other.get(rel) == sha)
            if files and same / len(files) >= threshold:
                scored.append((same / len(files), g, c, f"{same} of {len(files)} files identical"))
    out, used_old, used_new = [], set(), set()
    for _, g, c, detail in sorted(scored, key=lambda t: -t[0]):
        if g not in used_old and c not in used_new:
            used_old.add(g)
            used_new.add(c)
            out.append((g, c, detail))
    return sorted(out)
