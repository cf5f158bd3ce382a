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


# Bytes per element of safetensors' dtypes (for checking a header entry's data offsets against its shape).
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
             "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def _header(path: str) -> Tuple[Dict[str, dict], Optional[Tuple[str, str]]]:
    """The JSON header of one .safetensors file (8-byte little-endian length, then JSON), without mapping it, and
    its first damaged entry (name, what is wrong) or None: every entry's data offsets must lie inside the file's
    data and span its shape (safetensors refuses the whole file otherwise, without saying which tensor)."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise CheckpointError(None, "not a safetensors file (shorter than its 8-byte header length)", path)
            (n,) = struct.unpack("<Q", head)
            if n > 100 << 20:
                raise CheckpointError(None, f"not a safetensors file (header length {n})", path)
            data = json.loads(f.read(n))
            size = os.fstat(f.fileno()).st_size - 8 - n
    except OSError as e:
        raise CheckpointError(None, f"cannot read: {e}", path) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(None, f"not a safetensors file (header: {e})", path) from None
    if not isinstance(data, dict):
        raise CheckpointError(None, "not a safetensors file (its header is not a JSON object)", path)
    data.pop("__metadata__", None)
    return data, _damaged(data, size)


def _damaged(header: Dict[str, dict], size: int) -> Optional[Tuple[str, str]]:
    for name, e in header.items():
        try:
            begin, end = (int(x) for x in e["data_offsets"])
            shape = [int(x) for x in e["shape"]]
            dtype = e["dtype"]
        except (KeyError, TypeError, ValueError):
            return name, "its header entry is damaged (no dtype, shape or data_offsets)"
        if not 0 <= begin <= end <= size:
            return name, f"its data offsets [{begin}, {end}) lie outside the file's {size} data bytes"
        item = _ITEMSIZE.get(dtype)
        numel = 1
        for d in shape:
            numel *= d
        if item is not None and end - begin != numel * item:
            return name, (f"its data offsets [{begin}, {end}) span {end - begin} bytes; {dtype} {shape} takes "
                          f"{numel * item}")
    return None


class SafetensorsFiles:
    """The tensors of a checkpoint directory (`model.safetensors.index.json` + shards, or one or more
    `.safetensors` files without an index) or of a single `.safetensors` file."""

    def __init__(self, path):
        path = Path(path)
        if not path.exists():
            raise CheckpointError(None, "no such checkpoint directory or file", str(path))
        self.path = path
        self._headers: Dict[str, Dict[str, dict]] = {}
        self._damage: Dict[str, Optional[Tuple[str, str]]] = {}
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
            self.weight_map = {}
            for f in files:
                for name in self._header_of(f):
                    if name in self.weight_map:  # without an index nothing says which copy is the model's
                        raise CheckpointError(name, f"is in two files and no {INDEX} says which to read: "
                                                    f"{self.weight_map[name]} and {f}", f)
                    self.weight_map[name] = f

    def _header_of(self, file: str) -> Dict[str, dict]:
        if file not in self._headers:
            if not os.path.exists(file):
                raise CheckpointError(None, "a shard the index names is missing", file)
            self._headers[file], self._damage[file] = _header(file)
        return self._headers[file]

    def _readable(self, file: str) -> None:
        """CheckpointError naming the damaged tensor when any entry of `file`'s header is damaged (safetensors
        then opens none of its tensors)."""
        self._header_of(file)
        bad = self._damage.get(file)
        if bad is not None:
            raise CheckpointError(bad[0], f"cannot read {os.path.basename(file)}: {bad[1]}", file)

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
        for file in by_file:
            self._readable(file)
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
