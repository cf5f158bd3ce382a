"""Read and rewrite the drop pins in third_party/cutedsl_megamoe/workspace.bzl.

The pins are two constant lines per tree, e.g.
    SM90_VERSION = "0.7.2.post1"
    SM90_SHA256 = "bfdc..."
A bump rewrites exactly those two lines and nothing else in the file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional, Tuple

from tools.drop.trees import Tree

__all__ = ["PinError", "workspace_bzl", "read_pins", "read_pins_file", "rewrite_pins"]


class PinError(RuntimeError):
    pass


def workspace_bzl(repo_root: Path) -> Path:
    return Path(repo_root) / "third_party" / "cutedsl_megamoe" / "workspace.bzl"


def _pattern(tree: Tree, key: str) -> "re.Pattern[str]":
    return re.compile(rf'^(?P<head>{tree.pin_prefix}_{key}\s*=\s*)"(?P<value>[^"]*)"', re.MULTILINE)


def read_pins(text: str, tree: Tree) -> Tuple[str, str]:
    values = []
    for key in ("VERSION", "SHA256"):
        matches = _pattern(tree, key).findall(text)
        if len(matches) != 1:
            raise PinError(
                f"expected exactly one `{tree.pin_prefix}_{key} = \"...\"` line in workspace.bzl, found {len(matches)}"
            )
        values.append(matches[0][1])
    return values[0], values[1]


def read_pins_file(repo_root: Path, tree: Tree) -> Optional[Tuple[str, str]]:
    path = workspace_bzl(repo_root)
    if not path.is_file():
        return None
    return read_pins(path.read_text(encoding="utf-8"), tree)


_SHA = re.compile(r"^[0-9a-f]{64}$")


def rewrite_pins(text: str, tree: Tree, version: str, sha256: str) -> str:
    if not _SHA.match(sha256):
        raise PinError(f"not a sha256 hex digest: {sha256!r}")
    if '"' in version or "\n" in version:
        raise PinError(f"bad version string {version!r}")
    read_pins(text, tree)  # exactly one line of each, or raise
    text = _pattern(tree, "VERSION").sub(lambda m: f'{m.group("head")}"{version}"', text)
    text = _pattern(tree, "SHA256").sub(lambda m: f'{m.group("head")}"{sha256}"', text)
    return text
