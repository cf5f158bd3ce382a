"""Read and rewrite the drop pins in third_party/cutedsl_megamoe/workspace.bzl.

The pins are constant lines per tree, e.g.
    SM90_VERSION = "0.7.2.post1"
    SM90_SHA256 = "bfdc..."
    SM90_STRIP_PREFIX = "flashinfer/moe_ep/kernel_src/sm90/pull_style_cutedsl_megakernel/src"
A bump rewrites exactly the VERSION and SHA256 lines, and the STRIP_PREFIX line when the tree
moved inside the wheel; nothing else in the file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional, Tuple

from shim.common.tree_facts import TreeFacts

__all__ = ["PinError", "workspace_bzl", "read_pins", "read_pins_file", "read_strip_prefix", "rewrite_pins"]


class PinError(RuntimeError):
    pass


def workspace_bzl(repo_root: Path) -> Path:
    return Path(repo_root) / "third_party" / "cutedsl_megamoe" / "workspace.bzl"


def _pattern(tree: TreeFacts, key: str) -> "re.Pattern[str]":
    return re.compile(rf'^(?P<head>{tree.pin_prefix}_{key}\s*=\s*)"(?P<value>[^"]*)"', re.MULTILINE)


def read_pins(text: str, tree: TreeFacts) -> Tuple[str, str]:
    values = []
    for key in ("VERSION", "SHA256"):
        matches = _pattern(tree, key).findall(text)
        if len(matches) != 1:
            raise PinError(
                f"expected exactly one `{tree.pin_prefix}_{key} = \"...\"` line in workspace.bzl, found {len(matches)}"
            )
        values.append(matches[0][1])
    return values[0], values[1]


def read_pins_file(repo_root: Path, tree: TreeFacts) -> Optional[Tuple[str, str]]:
    path = workspace_bzl(repo_root)
    if not path.is_file():
        return None
    return read_pins(path.read_text(encoding="utf-8"), tree)


_SHA = re.compile(r"^[0-9a-f]{64}$")


def read_strip_prefix(text: str, tree: TreeFacts) -> Optional[str]:
    """The pinned sub-path of the tree in the wheel, or None when workspace.bzl has no such line."""
    matches = _pattern(tree, "STRIP_PREFIX").findall(text)
    if len(matches) > 1:
        raise PinError(f"expected at most one `{tree.pin_prefix}_STRIP_PREFIX = \"...\"` line, found {len(matches)}")
    return matches[0][1] if matches else None


def rewrite_pins(text: str, tree: TreeFacts, version: str, sha256: str, strip_prefix: Optional[str] = None) -> str:
    """The pin lines rewritten; `strip_prefix` (a moved tree) needs the STRIP_PREFIX line to exist."""
    if not _SHA.match(sha256):
        raise PinError(f"not a sha256 hex digest: {sha256!r}")
    if '"' in version or "\n" in version:
        raise PinError(f"bad version string {version!r}")
    read_pins(text, tree)  # exactly one line of each, or raise
    text = _pattern(tree, "VERSION").sub(lambda m: f'{m.group("head")}"{version}"', text)
    text = _pattern(tree, "SHA256").sub(lambda m: f'{m.group("head")}"{sha256}"', text)
    if strip_prefix is not None:
        if '"' in strip_prefix or "\n" in strip_prefix:
            raise PinError(f"bad strip prefix {strip_prefix!r}")
        if read_strip_prefix(text, tree) is None:
            raise PinError(f"the tree moved to {strip_prefix}, but workspace.bzl has no "
                           f"`{tree.pin_prefix}_STRIP_PREFIX = \"...\"` line to pin it")
        text = _pattern(tree, "STRIP_PREFIX").sub(lambda m: f'{m.group("head")}"{strip_prefix}"', text)
    return text
