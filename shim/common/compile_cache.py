"""Process-wide cache of compiled kernels, keyed by everything that shapes the generated program.

A `cute.compile` of a MegaMoE kernel takes seconds to minutes, so every
workspace with the same compile-relevant key (class, knobs, geometry, world
size, rank, capacity, scale mode, cluster budget) reuses one compiled kernel.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Dict, Hashable, Tuple

__all__ = ["get_or_compile", "stats", "clear"]

_lock = threading.Lock()
_cache: Dict[Hashable, Any] = {}
_stats = {"hits": 0, "compiles": 0, "compile_seconds": 0.0}


def get_or_compile(key: Hashable, compile_fn: Callable[[], Any]) -> Tuple[Any, bool]:
    """Returns (compiled, was_cached)."""
    with _lock:
        if key in _cache:
            _stats["hits"] += 1
            return _cache[key], True
    t0 = time.perf_counter()
    compiled = compile_fn()
    with _lock:
        _stats["compiles"] += 1
        _stats["compile_seconds"] += time.perf_counter() - t0
        _cache.setdefault(key, compiled)
        return _cache[key], False


def stats() -> Dict[str, float]:
    with _lock:
        return dict(_stats, entries=len(_cache))


def clear() -> None:
    with _lock:
        _cache.clear()
