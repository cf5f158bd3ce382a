"""PEP 562 lazy attributes for the kernel_symbols modules: the table stays a literal in each module (the drop
audit reads it by AST), the resolving code lives here once."""

from __future__ import annotations

import importlib
from typing import Callable, Dict, List, Tuple

from shim.common import tree as _tree

__all__ = ["lazy_attributes"]


def lazy_attributes(module_name: str, table: Dict[str, Tuple[str, str]],
                    namespace: dict) -> Tuple[Callable[[str], object], Callable[[], List[str]]]:
    """(__getattr__, __dir__) for a module whose names in `table` resolve on first access, then stay cached."""

    def __getattr__(name: str):
        try:
            source, attr = table[name]
        except KeyError:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}") from None
        module = importlib.import_module(source)
        _tree.check_module(module)  # a kernel module must come from the verified tree's root (TreeConflictError)
        value = getattr(module, attr)
        namespace[name] = value
        return value

    def __dir__():
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__
