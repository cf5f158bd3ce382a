"""Where this tool finds things: the checkout, a tree in Bazel's runfiles, a tree's packages.

The facts about the two kernel trees (arch, sub-tree in the wheel, packages, env var, Bazel repository, pin names)
live in shim/common/tree_facts.py, shared with the runtime; this module holds only the tool's look-ups.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Optional

from shim.common.tree_facts import TreeFacts

__all__ = ["find_repo_root", "runfiles_tree_root", "package_dirs"]


def package_dirs(tree_root: Path) -> Dict[str, Path]:
    """Top-level kernel packages of an extracted tree: dirs holding __init__.py or .py files."""
    out = {}
    for child in sorted(Path(tree_root).iterdir()):
        if child.is_dir() and not child.name.startswith(".") and child.name != "__pycache__":
            if (child / "__init__.py").is_file() or any(child.glob("*.py")):
                out[child.name] = child
    return out


def find_repo_root(start: Optional[Path] = None) -> Path:
    """The megamoe-ep checkout to read and rewrite.

    `bazel run` starts the tool inside its runfiles tree and names the real
    checkout in BUILD_WORKSPACE_DIRECTORY; otherwise walk up from `start` (or
    the cwd, then this file) to the directory holding WORKSPACE or .git.
    """
    env = os.environ.get("BUILD_WORKSPACE_DIRECTORY")
    if env:
        return Path(env)
    candidates = [Path(start) if start else Path.cwd(), Path(__file__).resolve().parent]
    for base in candidates:
        for d in [base, *base.parents]:
            if (d / "tools" / "drop").is_dir() and ((d / "WORKSPACE").exists() or (d / ".git").exists()):
                return d
    # Last resort: this file lives at <root>/tools/drop/trees.py.
    return Path(__file__).resolve().parents[2]


def runfiles_tree_root(tree: TreeFacts) -> Optional[Path]:
    """The pinned tree as a Bazel external repo in this process's runfiles, if any."""
    roots = [Path(os.environ[var]) for var in ("RUNFILES_DIR", "TEST_SRCDIR") if os.environ.get(var)]
    # Not resolved: the runfiles tree is made of symlinks, and resolving would
    # leave it for the source checkout.
    roots += [parent for parent in Path(__file__).absolute().parents if parent.name.endswith(".runfiles")]
    for root in roots:
        candidate = root / tree.repo_name
        if candidate.is_dir() and package_dirs(candidate):
            return candidate
    return None
