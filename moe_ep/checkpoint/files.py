"""A safetensors checkpoint on disk: which file holds which tensor (the index, or the files' own headers), each
tensor's dtype and shape from the header alone, and reading one tensor (or rows of it) at a time.

Reads go through safetensors' `safe_open` one tensor at a time and the handle is closed after it: safetensors maps
the file and hands out tensors over the mapping, so a tensor's pages count as this process's memory while it lives;
the loader copies each into its pack and drops it. Errors name the tensor and the file (CheckpointError).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from moe_ep.errors import CheckpointError

__all__ = ["TensorInfo", "SafetensorsFiles", "DTYPES"]

INDEX = "model.safetensors.index.json"

# safetensors' dtype names -> torch.
DTYPES: Dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
if hasattr(torch, "float8_e8m0fnu"):
    DTYPES["F8_E8M0"] = torch.float8_e8m0fnu


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: str  # path of the file that holds it
    dtype: str  # safetensors' name ("F8_E4M3", ...)
    shape: Tuple[int, ...]

    @property
    def torch_dtype(self) -> Optional[torch.dtype]:
        return DTYPES.get(self.dtype)


def _header(path: str) -> Dict[str, dict]:
    """The JSON header of one .safetensors file (8-byte little-endian length, then JSON), without mapping it."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise CheckpointError(None, "not a safetensors file (shorter than its 8-byte header length)", path)
            (n,) = struct.unpack("<Q", head)
            if n > 100 << 20:
                raise CheckpointError(None, f"not a safetensors file (header length {n})", path)
            data = json.loads(f.read(n))
    except OSError as e:
        raise CheckpointError(None, f"cannot read: {e}", path) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(None, f"not a safetensors file (header: {e})", path) from None
    data.pop("__metadata__", None)
    return data


class SafetensorsFiles:
    """The tensors of a checkpoint directory (`model.safetensors.index.json` + shards, or one or more
    `.safetensors` files without an index) or of a single `.safetensors` file."""

    def __init__(self, path):
        path = Path(path)
        if not path.exists():
            raise CheckpointError(None, "no such checkpoint directory or file", str(path))
        self.path = path
        self._headers: Dict[str, Dict[str, dict]] = {}
        if path.is_file():
            self.index_file = None
            self.weight_map = {name: str(path) for name in self._header_of(str(path))}
        elif (path / INDEX).exists():
            self.index_file = str(path / INDEX)
            try:
                wm = json.loads((path / INDEX).read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise CheckpointError(None, f"unreadable index ({type(e).__name__}: {e})", self.index_file) from None
            self.weight_map = {name: str(path / f) for name, f in wm.items()}
        else:
            files = sorted(str(p) for p in path.glob("*.safetensors"))
            if not files:
                raise CheckpointError(None, f"neither {INDEX} nor any .safetensors file here", str(path))
            self.index_file = None
            self.weight_map = {name: f for f in files for name in self._header_of(f)}

    def _header_of(self, file: str) -> Dict[str, dict]:
        if file not in self._headers:
            if not os.path.exists(file):
                raise CheckpointError(None, "a shard the index names is missing", file)
            self._headers[file] = _header(file)
        return self._headers[file]

    def names(self) -> Iterable[str]:
        return self.weight_map.keys()

    def where(self, name: str) -> str:
        """The file that holds `name` (CheckpointError naming the index or directory when none does)."""
        try:
            return self.weight_map[name]
        except KeyError:
            raise CheckpointError(name, "no such tensor in the checkpoint",
                                  self.index_file or str(self.path)) from None

    def info(self, name: str) -> TensorInfo:
        """dtype and shape from the header (nothing read); CheckpointError when the file lacks the tensor."""
        file = self.where(name)
        entry = self._header_of(file).get(name)
        if entry is None:
            raise CheckpointError(name, "listed in the index but missing from its shard", file)
        return TensorInfo(name, file, entry["dtype"], tuple(entry["shape"]))

    def check(self, name: str, dtype: str, shape: Tuple[int, ...], what: str = "") -> TensorInfo:
        """info(name), with a CheckpointError naming the tensor and its file unless it has `dtype` and `shape`."""
        t = self.info(name)
        if t.dtype != dtype:
            raise CheckpointError(name, f"expected dtype {dtype}{what}, got {t.dtype}", t.file)
        if t.shape != tuple(shape):
            raise CheckpointError(name, f"expected shape {list(shape)}{what}, got {list(t.shape)}", t.file)
        return t

    def read(self, names: List[str], rows: Optional[slice] = None) -> Dict[str, torch.Tensor]:
        """The tensors (rows `rows` of their first dimension, when given), grouped by file, each file opened once
        and closed again. The tensors may be views of the file's mapping: copy what you keep, drop the rest."""
        from safetensors import safe_open

        by_file: Dict[str, List[str]] = {}
        for n in names:
            by_file.setdefault(self.info(n).file, []).append(n)
        out = {}
        for file, group in by_file.items():
            current = group[0]
            try:
                with safe_open(file, framework="pt") as f:
                    for current in group:
                        out[current] = f.get_tensor(current) if rows is None else f.get_slice(current)[rows]
            except Exception as e:  # noqa: BLE001 - safetensors raises its own types for a damaged file
                out.clear()
                raise CheckpointError(current, f"cannot read ({type(e).__name__}: {e})", file) from None
        return out
