"""Persistent knob cache: a JSON file (path from $MOE_EP_KNOB_CACHE) of tuned knob sets.

Resolution order, once per workspace allocation (never per call): explicit knobs
> this cache > the drop's heuristic table. Keys name everything the winning knob
set depends on: arch, format, geometry, world size and capacity.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Dict, Optional

from moe_ep.errors import KnobError

__all__ = ["ENV_VAR", "cache_key", "KnobCache"]

ENV_VAR = "MOE_EP_KNOB_CACHE"
_VERSION = 1


def cache_key(*, arch: str, fmt: str, hidden: int, intermediate: int, experts_per_rank: int, top_k: int,
              world_size: int, max_tokens_per_rank: int, drop: str = "") -> str:
    return (f"{arch}/{fmt}/H{hidden}/I{intermediate}/E{experts_per_rank}/K{top_k}/W{world_size}/C{max_tokens_per_rank}"
            + (f"/{drop}" if drop else ""))


class KnobCache:
    def __init__(self, path: Optional[str] = None):
        """path: the cache file; None reads $MOE_EP_KNOB_CACHE; "" means no cache at all."""
        self.path = path if path is not None else os.environ.get(ENV_VAR) or None

    def _load(self) -> Dict[str, Any]:
        if not self.path or not os.path.exists(self.path):
            return {"version": _VERSION, "entries": {}}
        try:
            with open(self.path) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            raise KnobError(ENV_VAR, f"cannot read the knob cache {self.path}: {e}") from e
        if not isinstance(data, dict) or data.get("version") != _VERSION or not isinstance(data.get("entries"), dict):
            raise KnobError(ENV_VAR, f"knob cache {self.path} is not a version-{_VERSION} moe_ep knob cache: "
                                     "point the variable at another file or remove this one")
        return data

    def get(self, key: str) -> Optional[Dict[str, Any]]:
        entry = self._load()["entries"].get(key)
        return None if entry is None else dict(entry["knobs"])

    def put(self, key: str, knobs: Dict[str, Any], meta: Optional[Dict[str, Any]] = None) -> None:
        if not self.path:
            raise KnobError(ENV_VAR, f"no knob cache path: set ${ENV_VAR}")
        data = self._load()
        data["entries"][key] = {"knobs": knobs, "meta": meta or {}}
        d = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(d, exist_ok=True)
        # Write-then-rename so a reader in another process never sees half a file.
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".knobs-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path)
