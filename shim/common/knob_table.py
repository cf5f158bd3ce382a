"""Tuned knob tables shipped in the repository (shim/<arch>/tables/*.json), made by `tools/tune` on real GPUs.

Resolution, once per layer before any workspace exists: explicit knobs > the user's knob cache
($MOE_EP_KNOB_CACHE) > a shipped table > the drop's heuristic. A shipped entry is keyed by the geometry key the
knob cache uses (arch, format, H, I, local experts, top-k, world size, capacity) plus the GPU's name and the
drop it was measured on (the carrier wheel's sha256): another GPU, another drop or another geometry finds no
entry and falls back to the heuristic, never to someone else's numbers. The drop audit reports entries made
on an older drop as stale (tools/drop).

File format (the knob cache's, version 1):
    {"version": 1, "entries": {"<key>": {"knobs": {...}, "meta": {"tuned_us": ..., "heuristic_us": ...,
     "device": "NVIDIA H200", "drop": "0.7.4", "drop_sha256": "...", "date": "...", ...}}}}
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from moe_ep.errors import KnobError

__all__ = ["table_key", "TABLE_DIRS", "lookup", "load_tables", "device_name"]

_SHIM = Path(__file__).resolve().parents[1]
TABLE_DIRS = {"sm90": _SHIM / "sm90" / "tables", "sm100": _SHIM / "sm100" / "tables"}


def table_key(cache_key: str, device: str, drop_sha256: str) -> str:
    """The shipped-table key: the knob cache's geometry key, the GPU's name and the drop's identity."""
    return f"{cache_key}/dev={device.replace(' ', '_')}/drop={drop_sha256[:16]}"


def device_name(device) -> Optional[str]:
    import torch

    if device is None or torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(torch.device(device))


@lru_cache(maxsize=None)
def load_tables(arch: str) -> Dict[str, Dict[str, Any]]:
    """Every shipped entry of `arch`'s tables, merged ({key: {"knobs", "meta"}}); an unreadable table is an
    error naming the file, not a silent fallback."""
    out: Dict[str, Dict[str, Any]] = {}
    folder = TABLE_DIRS.get(arch)
    if folder is None or not folder.is_dir():
        return out
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise KnobError("knobs", f"shipped knob table {path} cannot be read: {e}") from e
        if not isinstance(data, dict) or data.get("version") != 1 or not isinstance(data.get("entries"), dict):
            raise KnobError("knobs", f"shipped knob table {path} is not a version-1 knob table")
        out.update(data["entries"])
    return out


def lookup(arch: str, cache_key: str, device: Optional[str], drop_sha256: Optional[str]) -> Optional[Tuple[dict, dict]]:
    """(knobs, meta) of the shipped entry for this geometry on this GPU and drop, or None. No GPU name or no
    verified drop (an unpinned tree) means no entry: tables are measurements of one GPU and one drop."""
    if not device or not drop_sha256 or os.environ.get("MOE_EP_NO_KNOB_TABLES"):
        return None
    entry = load_tables(arch).get(table_key(cache_key, device, drop_sha256))
    return None if entry is None else (dict(entry["knobs"]), dict(entry.get("meta", {})))
