"""Per-file sha256 manifests of the kernel drop trees.

A manifest records one extracted tree byte for byte:

    {"version": "0.7.2.post1", "carrier_sha256": "<sha256 of the wheel>",
     "files": {"common/host_utils.py": "<sha256>", ...}}

Paths are relative to the tree's src/ root, '/'-separated, sorted. The files that
drop_repo.bzl adds to the Bazel repository (BUILD.bazel, WORKSPACE, carrier.json,
pinned.manifest.json at the root) and Python byte-code caches are not part of the drop and are
left out.

Library use (tools/drop reuses this; it is the one definition of the format):

    compute_manifest(tree_root, version=None, carrier_sha256=None) -> dict
    diff_manifest(expected, actual) -> ManifestDiff   # .changed / .added / .removed, .describe()

Command line (via Bazel, which fetches and extracts the pinned trees first):

    bazel run //third_party/cutedsl_megamoe:manifest -- --write sm90 sm100
    bazel run //third_party/cutedsl_megamoe:manifest -- --check sm90
    python3 third_party/cutedsl_megamoe/manifest.py --tree-root PATH   # print a tree's manifest
    python3 third_party/cutedsl_megamoe/manifest.py --tree-root PATH --against MANIFEST
        # compare a tree with a manifest file: exit 1 and name every difference (drop_repo.bzl
        # runs this at fetch time, with the base python: standard library only here)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

__all__ = [
    "ADDED_FILES",
    "ManifestDiff",
    "compute_manifest",
    "diff_manifest",
    "file_digests",
    "is_compiled",
    "load_manifest",
    "manifest_path",
]

# Files drop_repo.bzl writes at the repository root (keep in sync with ADDED_FILES there).
ADDED_FILES = frozenset({"BUILD.bazel", "WORKSPACE", "carrier.json", "pinned.manifest.json"})
_COMPILED_DIRS = frozenset({"__pycache__"})
_COMPILED_SUFFIXES = (".pyc", ".pyo")

_HERE = Path(__file__).resolve().parent


def _repos() -> Dict[str, str]:
    """{arch: Bazel repository}, from the tree facts' one home. Imported only when asked: drop_repo.bzl runs this
    file at fetch time with the base python and no checkout on sys.path (--tree-root / --against need no facts)."""
    from shim.common.tree_facts import TREES as facts

    return {arch: t.repo_name for arch, t in facts.items()}


def __getattr__(name: str):  # `manifest.TREES`, computed on first use (see _repos)
    if name == "TREES":
        return _repos()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def is_compiled(rel: str) -> bool:
    """A byte-code file or anything under __pycache__/ (relative, '/'-separated path)."""
    parts = rel.split("/")
    return rel.endswith(_COMPILED_SUFFIXES) or any(p in _COMPILED_DIRS for p in parts[:-1])


def file_digests(tree_root) -> Dict[str, str]:
    """{relative path: sha256} of every file under tree_root (symlinks followed), strays included:
    only drop_repo.bzl's ADDED_FILES at the root are left out."""
    root = Path(tree_root)
    if not root.is_dir():
        raise FileNotFoundError(f"not a directory: {root}")
    out: Dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = sorted(dirnames)
        rel_dir = Path(dirpath).relative_to(root)
        for name in filenames:
            if rel_dir == Path(".") and name in ADDED_FILES:
                continue
            rel = (rel_dir / name).as_posix()
            out[rel] = _sha256(Path(dirpath) / name)
    return dict(sorted(out.items()))


def _carrier_info(tree_root) -> dict:
    path = Path(tree_root) / "carrier.json"
    if path.is_file():
        return json.loads(path.read_text(encoding="utf-8"))
    return {}


def compute_manifest(tree_root, version: Optional[str] = None, carrier_sha256: Optional[str] = None) -> dict:
    """The manifest of the tree at tree_root.

    version / carrier_sha256 default to what drop_repo.bzl recorded in tree_root/carrier.json
    (present when tree_root is the Bazel repository); pass them for a tree extracted elsewhere.
    """
    info = _carrier_info(tree_root)
    return {
        "version": version if version is not None else info.get("version"),
        "carrier_sha256": carrier_sha256 if carrier_sha256 is not None else info.get("carrier_sha256"),
        "files": file_digests(tree_root),
    }


@dataclass
class ManifestDiff:
    changed: List[str] = field(default_factory=list)
    added: List[str] = field(default_factory=list)
    removed: List[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.changed or self.added or self.removed)

    def describe(self, label: str = "tree") -> str:
        if not self:
            return f"{label}: identical to its manifest"
        lines = [
            f"{label}: {len(self.changed)} changed, {len(self.added)} added, {len(self.removed)} removed "
            "file(s) against its manifest"
        ]
        lines += [f"  changed: {p}" for p in self.changed]
        lines += [f"  added:   {p}" for p in self.added]
        lines += [f"  removed: {p}" for p in self.removed]
        return "\n".join(lines)


def diff_manifest(expected: dict, actual: dict) -> ManifestDiff:
    """Compares the "files" of two manifests (or two {path: sha256} dicts)."""
    exp = expected.get("files", expected)
    act = actual.get("files", actual)
    return ManifestDiff(
        changed=sorted(p for p in exp.keys() & act.keys() if exp[p] != act[p]),
        added=sorted(act.keys() - exp.keys()),
        removed=sorted(exp.keys() - act.keys()),
    )


def manifest_path(tree: str, repo_root=None) -> Path:
    base = Path(repo_root) / "third_party" / "cutedsl_megamoe" if repo_root else _HERE
    return base / f"{tree}.manifest.json"


def load_manifest(path) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def dumps(manifest: dict) -> str:
    return json.dumps(manifest, indent=2, sort_keys=True) + "\n"


def _runfiles_roots() -> List[Path]:
    roots = []
    for var in ("RUNFILES_DIR", "TEST_SRCDIR"):
        if os.environ.get(var):
            roots.append(Path(os.environ[var]))
    argv0 = Path(sys.argv[0])
    roots.append(Path(str(argv0) + ".runfiles"))
    roots += [p for p in argv0.absolute().parents if p.name.endswith(".runfiles")]
    return roots


def bazel_tree_root(tree: str) -> Path:
    """The extracted tree inside this binary's / test's runfiles."""
    repo = _repos()[tree]
    for root in _runfiles_roots():
        cand = root / repo
        if (cand / "carrier.json").exists():
            return cand
    raise FileNotFoundError(f"@{repo} is not in the runfiles (searched {[str(r) for r in _runfiles_roots()]})")


def _main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trees", nargs="*", metavar="TREE", help="sm90 or sm100 (default: both)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite <tree>.manifest.json in the workspace")
    mode.add_argument("--check", action="store_true", help="compare against the committed manifest")
    ap.add_argument("--tree-root", help="print the manifest of an extracted tree at this path")
    ap.add_argument("--against", metavar="MANIFEST",
                    help="with --tree-root: compare that tree with this manifest file (exit 1 on any difference)")
    args = ap.parse_args(argv)

    if args.against:
        if not args.tree_root:
            ap.error("--against needs --tree-root")
        diff = diff_manifest(load_manifest(args.against), compute_manifest(args.tree_root))
        print(diff.describe(f"{args.tree_root} against {args.against}"))
        return int(bool(diff))
    if args.tree_root:
        sys.stdout.write(dumps(compute_manifest(args.tree_root)))
        return 0

    repos = _repos()
    trees = args.trees or list(repos)
    unknown = [t for t in trees if t not in repos]
    if unknown:
        ap.error(f"unknown tree(s) {unknown}; choose from {sorted(repos)}")
    workspace = os.environ.get("BUILD_WORKSPACE_DIRECTORY")
    status = 0
    for tree in trees:
        current = compute_manifest(bazel_tree_root(tree))
        target = manifest_path(tree, workspace)
        if args.write:
            if not workspace:
                raise SystemExit("--write needs `bazel run` (BUILD_WORKSPACE_DIRECTORY is not set)")
            target.write_text(dumps(current), encoding="utf-8")
            print(f"wrote {target} ({len(current['files'])} files, {current['version']})")
        elif args.check:
            committed = load_manifest(manifest_path(tree, workspace))
            diff = diff_manifest(committed, current)
            print(diff.describe(f"@{repos[tree]}"))
            status |= int(bool(diff))
        else:
            sys.stdout.write(dumps(current))
    return status


if __name__ == "__main__":
    sys.exit(_main())
