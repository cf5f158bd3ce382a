"""Shipped knob tables measured on another drop than the one audited: stale, reported by `audit` and `bump`.

A table entry (shim/<tree>/tables/*.json, written by tools/tune) is keyed by the drop's sha256, so a stale
entry is never used at run time (shim/common/knob_table.py); it is dead weight that says a retune is due.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import List

__all__ = ["StaleEntry", "stale_entries", "table_entries", "render_stale"]


@dataclass(frozen=True)
class StaleEntry:
    table: str  # path relative to the repository
    key: str
    drop: str  # the version the entry was measured on
    drop_sha256: str


def table_entries(repo_root: Path, tree: str) -> int:
    """How many entries the shipped tables of `tree` hold (0: no table ships)."""
    folder = Path(repo_root) / "shim" / tree / "tables"
    return sum(len(json.loads(p.read_text()).get("entries", {})) for p in sorted(folder.glob("*.json"))) \
        if folder.is_dir() else 0


def stale_entries(repo_root: Path, tree: str, sha256: str) -> List[StaleEntry]:
    """Entries of shim/<tree>/tables/*.json whose drop is not the wheel `sha256`."""
    folder = Path(repo_root) / "shim" / tree / "tables"
    out: List[StaleEntry] = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else ():
        data = json.loads(path.read_text())
        for key, entry in sorted(data.get("entries", {}).items()):
            meta = entry.get("meta", {})
            sha = meta.get("drop_sha256") or key.rpartition("/drop=")[2]
            if not sha or not sha256.lower().startswith(sha.lower()[:16]):
                out.append(StaleEntry(str(path.relative_to(repo_root)), key, str(meta.get("drop", "?")), sha))
    return out


def render_stale(entries: List[StaleEntry], tree: str, version: str, shipped: int = 1) -> str:
    """The [tables] line: `shipped` is how many entries the tree's tables hold (table_entries)."""
    if not shipped:
        return f"[tables] no knob table ships for {tree}: nothing to retune\n"
    if not entries:
        return (f"[tables] every shipped {tree} knob table entry ({shipped}) was measured on this drop "
                f"({version})\n")
    tables = sorted({e.table for e in entries})
    drops = sorted({e.drop for e in entries})
    lines = [f"[tables] STALE: {len(entries)} shipped knob table entr{'y' if len(entries) == 1 else 'ies'} in "
             f"{', '.join(tables)} were measured on drop {', '.join(drops)}, not on {version}: they are no longer "
             f"used (keyed by drop); retune with `python -m tools.tune ...` on a GPU (docs/tuning.md)"]
    lines += [f"  {e.key}" for e in entries[:8]]
    if len(entries) > 8:
        lines.append(f"  ... and {len(entries) - 8} more")
    return "\n".join(lines) + "\n"
