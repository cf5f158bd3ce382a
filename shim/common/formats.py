"""One row per kernel variant: the statement everything else about a kernel backend is derived from.

Each arch's table (shim/<arch>/formats.py, `BACKENDS`) holds one `KernelFormat` per backend moe_ep serves on that
arch. From a row come:
  * moe_ep's registry entry (name, arch, format, description, the class it resolves to): the registry imports the
    table through a lazy string when backends are first listed or looked up (moe_ep/core/registry.py);
  * availability: whether the arch's pinned tree holds `kernel_module`, found by looking for the file, without
    importing the kernel or cutlass (`missing_kernel`);
  * the size rules (`size_violations`: H and I multiples, top_k), asked before anything is allocated;
  * what the backend class serves (written out in shim/<arch>/backend.py, `class X(<Arch>Backend, fmt=...)`, and
    named by `target`): its name, its format, and the frontend it builds (`frontend`, a lazy "module:Class");
  * the knobs' per-format facts: the kernel class whose KNOB_SPACE entry a knob set draws from (`kernel_classes[0]`),
    the FP8 scale mode, the name of the in-kernel reduce argument.

Plain Python on purpose: importing a table imports no kernel, no cutlass, no torch, and activates no tree, so
moe_ep can list backends and reject a spec on any host. tools/drop reads the `KernelFormat(...)` rows by AST
(tools/drop/callsites.py): keep every argument a literal.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple

__all__ = ["KernelFormat", "FormatTable", "missing_kernel"]


@dataclass(frozen=True)
class KernelFormat:
    backend: str  # the registered name, e.g. "sm90_fp8_cutedsl" (spells arch, format and style)
    arch: str  # "sm90" / "sm100": the tree and the device it runs on
    fmt: str  # the moe_ep format it serves (moe_ep.formats)
    description: str
    hidden_multiple: int  # H must be a multiple of this for the kernel
    intermediate_multiple: int  # I (the down projection's K; FC1 is 2I wide) must be a multiple of this
    kernel_module: str  # the drop module holding the kernel class: the backend is available iff the tree has it
    kernel_classes: Tuple[str, ...]  # its class names in kernel_module; the first keys the knobs' KNOB_SPACE
    frontend: str  # "module:Class" of the frontend that drives the kernel
    target: str  # "module:Class" the registry resolves: the backend class generated for this row
    scale_mode: Optional[str] = None  # the sm90 FP8 kernel's fp8_scale_mode ("blockwise" / "per_tensor")
    reduce_kwarg: str = "fc2_in_kernel_topk_reduce"  # the constructor's name for the in-kernel fc2 top-k reduce
    # Which token-back modes the in-kernel fc2 reduce runs with: "epi_warps" (only the epilogue warps'),
    # "dispatch" (only a dispatch-warp mode), None (any). A knob set outside it is refused, never guessed.
    reduce_token_back: Optional[str] = None
    max_top_k: int = 32  # dispatch assigns 32 // top_k tokens per warp pass (src/token_comm.py, both trees)
    # Further drop modules the kernel needs, when kernel_module (where its class is defined) predates it: sm90's
    # W4A8 class sits in megamoe_kernel_fp8.py, which older drops have without it and without its mainloop module.
    requires: Tuple[str, ...] = ()

    @property
    def knob_space(self) -> str:
        """The KNOB_SPACE key (a kernel class name) a knob set for this row draws from."""
        return self.kernel_classes[0]

    def size_violations(self, *, hidden: int, intermediate: int, top_k: int) -> List[Tuple[str, str]]:
        """(argument, message) for each size this kernel cannot serve; empty when it can."""
        out = []
        what = f"the {self.arch} {self.fmt} kernel"
        if hidden % self.hidden_multiple:
            out.append(("hidden_size", f"must be a multiple of {self.hidden_multiple} for {what}, got {hidden}"))
        if intermediate % self.intermediate_multiple:
            out.append(("intermediate_size",
                        f"must be a multiple of {self.intermediate_multiple} for {what}, got {intermediate}"))
        if not 1 <= top_k <= self.max_top_k:
            out.append(("top_k", f"must be in [1, {self.max_top_k}] for the {self.arch} kernels' dispatch, got {top_k}"))
        return out

    def registration(self) -> dict:
        """moe_ep.register_backend's arguments for this row (the probe says why it cannot run here, or None)."""
        return dict(name=self.backend, target=self.target, arch=self.arch, formats=(self.fmt,),
                    description=self.description, probe=lambda: missing_kernel(self))

    def frontend_class(self) -> type:
        module, attr = self.frontend.split(":", 1)
        return getattr(importlib.import_module(module), attr)


class FormatTable:
    """An arch's rows, in registry order (an arch's first row is its default backend), and the CUTE_DSL_ARCH
    prefixes a compile without a GPU of the arch may target (shim/common/backend.py check_compile_target)."""

    def __init__(self, arch: str, rows: Tuple[KernelFormat, ...], *, cute_targets: Tuple[str, ...]):
        for r in rows:
            if r.arch != arch:
                raise ValueError(f"row {r.backend!r} names arch {r.arch!r} in the {arch} table")
        for attr in ("backend", "fmt", "target"):
            values = [getattr(r, attr) for r in rows]
            if len(set(values)) != len(values):
                # One row per format: a layer picks its row by (arch, format).
                raise ValueError(f"the {arch} table repeats a {attr}: {values}")
        self.arch = arch
        self.rows = tuple(rows)
        self.cute_targets = tuple(cute_targets)

    def __iter__(self) -> Iterator[KernelFormat]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def fmts(self) -> Tuple[str, ...]:
        return tuple(r.fmt for r in self.rows)

    def row(self, fmt: str) -> KernelFormat:
        """The row serving `fmt` (KeyError when none does: callers check the format against `fmts` first)."""
        for r in self.rows:
            if r.fmt == fmt:
                return r
        raise KeyError(fmt)

    def registrations(self) -> List[dict]:
        return [r.registration() for r in self.rows]


def _tree_root(arch: str) -> str:
    """The root the arch's tree would be loaded from (verified against its pin; activates nothing). The one call
    into the tree's resolution (shim/common/tree.py) the tables make."""
    from shim.common import tree

    return tree.locate(arch)


def missing_kernel(row: KernelFormat) -> Optional[str]:
    """Why `row` cannot run with the arch's tree (its kernel module is not in it), or None. Looks for the file: no
    kernel or cutlass import. A tree that cannot be found or verified raises its own BackendUnavailableError."""
    root = _tree_root(row.arch)
    for module in (row.kernel_module,) + tuple(row.requires):
        base = os.path.join(root, *module.split("."))
        if not (os.path.isfile(base + ".py") or os.path.isfile(os.path.join(base, "__init__.py"))):
            return f"{row.backend!r} needs the kernel module {module!r}, which the {row.arch} tree at {root} lacks"
    return None
