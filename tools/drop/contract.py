"""The signatures the shim was written for, and how a drop departs from them.

tools/drop/contracts/<tree>.json records __init__ / __call__ of every kernel
class the shim builds (the `_LAZY` entries that name a class of the drop).
The audit compares a drop against it; only `bump --accept-contract`, run after
a human has read the audit and fixed the shim, rewrites it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from tools.drop.source_model import DropIndex, MethodSignature, Param

__all__ = ["METHODS", "ParamChange", "contract_path", "build_contract", "load_contract", "save_contract", "dumps",
           "diff_params", "kernel_classes", "rename_evidence"]

METHODS = ("__init__", "__call__")
_VARIADIC = ("var_positional", "var_keyword")
_POSITIONAL = ("positional_only", "positional_or_keyword")


def contract_path(repo_root: Path, tree: str) -> Path:
    return Path(repo_root) / "tools" / "drop" / "contracts" / f"{tree}.json"


def kernel_classes(index: DropIndex, lazy: Dict[str, Tuple[str, str]]) -> Dict[str, dict]:
    """{class name: {"module", "exports", "node"}} for `_LAZY` entries that are drop classes with __init__/__call__."""
    out: Dict[str, dict] = {}
    for export, (module, attr) in sorted(lazy.items()):
        found = index.find_class(module, attr)
        if found is None:
            continue
        mod, node = found
        if not any(index.method(mod, node, m) for m in METHODS):
            continue
        entry = out.setdefault(node.name, {"module": mod, "node": node, "exports": []})
        entry["exports"].append(export)
    return out


def build_contract(index: DropIndex, lazy: Dict[str, Tuple[str, str]], tree: str, version: str) -> dict:
    classes = {}
    for name, info in kernel_classes(index, lazy).items():
        methods = {}
        for m in METHODS:
            sig = index.signature(info["module"], info["node"], m)
            if sig is not None:
                methods[m] = sig.to_json()
        classes[name] = {"module": info["module"], "methods": methods}
    return {"tree": tree, "accepted_version": version, "classes": classes}


def load_contract(path: Path) -> Optional[dict]:
    path = Path(path)
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def dumps(contract: dict) -> str:
    return json.dumps(contract, indent=2, sort_keys=True) + "\n"


def save_contract(path: Path, contract: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(contract), encoding="utf-8")


def params_of(method_json: dict) -> Tuple[Param, ...]:
    return tuple(Param.from_json(p) for p in method_json.get("params", []))


@dataclasses.dataclass(frozen=True)
class ParamChange:
    change: str  # removed | renamed | added | redefaulted | now_required | kind | annotation | moved | variadic
    status: str  # break | warn | note
    param: str
    detail: str


def diff_params(old: Sequence[Param], new: Sequence[Param], positional_callers: bool = False) -> List[ParamChange]:
    """Departures of `new` from `old`, each classified for a caller written against `old`.

    break: a caller written for `old` fails or binds wrongly (removed / renamed
    parameter, a new required one, a default dropped, positional order changed).
    warn: it still binds but may behave differently (re-defaulted, kind changed,
    **kwargs dropped). note: harmless additions and annotation edits.
    """
    old_by = {p.name: p for p in old}
    new_by = {p.name: p for p in new}
    changes: List[ParamChange] = []

    removed = [p for p in old if p.name not in new_by]
    added = [p for p in new if p.name not in old_by]

    # Rename: only where the evidence supports one. The removed and the added parameter sit in the
    # same slot (between the same two surviving neighbours, alone there), are of the same kind,
    # and share a type or a default (equal and present); annotations that both exist must agree.
    # Anything less is reported as a removal plus an addition.
    renamed: List[Tuple[Param, Param]] = []
    old_slots = _slots(old, set(new_by))
    new_slots = _slots(new, set(old_by))
    for r in list(removed):
        slot = old_slots[r.name]
        in_old = [p for p in removed if old_slots[p.name] == slot]
        in_new = [a for a in added if new_slots[a.name] == slot]
        if len(in_old) != 1 or len(in_new) != 1:
            continue
        a = in_new[0]
        if _rename_evidence(r, a):
            renamed.append((r, a))
            removed.remove(r)
            added.remove(a)
    for r, a in renamed:
        changes.append(ParamChange("renamed", "break", r.name, f"{r.name} -> {a.name}"))
    for r in removed:
        if r.kind in _VARIADIC:
            changes.append(ParamChange("variadic", "warn", r.name, f"{_star(r)} no longer accepted"))
        else:
            changes.append(ParamChange("removed", "break", r.name, f"{_fmt(r)} removed"))
    for a in added:
        if a.kind in _VARIADIC:
            changes.append(ParamChange("variadic", "note", a.name, f"{_star(a)} now accepted"))
        elif a.default is None:
            changes.append(ParamChange("added", "break", a.name, f"new required parameter {_fmt(a)}"))
        else:
            changes.append(ParamChange("added", "note", a.name, f"new optional parameter {_fmt(a)}"))

    for name, o in old_by.items():
        n = new_by.get(name)
        if n is None:
            continue
        if o.default != n.default:
            if n.default is None and n.kind not in _VARIADIC:
                changes.append(ParamChange("now_required", "break", name, f"default {o.default} removed"))
            elif o.default is None:
                changes.append(ParamChange("redefaulted", "note", name, f"now optional, default {n.default}"))
            else:
                changes.append(ParamChange("redefaulted", "warn", name, f"default {o.default} -> {n.default}"))
        if o.kind != n.kind:
            changes.append(ParamChange("kind", "warn", name, f"{o.kind} -> {n.kind}"))
        if o.annotation != n.annotation:
            changes.append(ParamChange("annotation", "note", name, f"{o.annotation} -> {n.annotation}"))

    # Positional binding. Constructors are called by keyword (the shim's
    # convention), so order there only matters as a warning; a launch may go
    # through cute.compile / the compiled callable with positional arguments,
    # where any shift of a shared positional parameter binds it wrongly. The
    # audit judges this against the shim's call sites: a shift no site passes
    # positionally is harmless (tools/drop/audit.py, _judge_change).
    rename_map = {a.name: r.name for r, a in renamed}
    old_pos = [p.name for p in old if p.kind in _POSITIONAL]
    new_pos = [rename_map.get(p.name, p.name) for p in new if p.kind in _POSITIONAL]
    common = [n for n in old_pos if n in new_pos]
    new_order = [n for n in new_pos if n in common]
    if common != new_order:
        moved = [n for i, n in enumerate(common) if new_order[i] != n]
        changes.append(
            ParamChange("moved", "break" if positional_callers else "warn", ",".join(moved),
                        "positional order changed: " + ", ".join(moved))
        )
    elif positional_callers:
        shifted = [n for n in common if old_pos.index(n) != new_pos.index(n)]
        if shifted:
            changes.append(
                ParamChange("moved", "break", ",".join(shifted), "positional index shifted: " + ", ".join(shifted))
            )
    order = {"break": 0, "warn": 1, "note": 2}
    return sorted(changes, key=lambda c: (order[c.status], c.change, c.param))


def _slots(params: Sequence[Param], other: set) -> Dict[str, Tuple[Optional[str], Optional[str]]]:
    """{name: (previous, next) parameter also present in the other signature} for every parameter."""
    names = [p.name for p in params]
    out = {}
    for i, n in enumerate(names):
        prev = next((m for m in reversed(names[:i]) if m in other), None)
        nxt = next((m for m in names[i + 1:] if m in other), None)
        out[n] = (prev, nxt)
    return out


def rename_evidence(r: Param, a: Param) -> bool:
    """Same kind, and a shared type or default; a conflicting annotation rules it out."""
    if r.kind != a.kind:
        return False
    if r.annotation is not None and a.annotation is not None and r.annotation != a.annotation:
        return False
    same_type = r.annotation is not None and r.annotation == a.annotation
    same_default = r.default is not None and r.default == a.default
    return same_type or same_default


_rename_evidence = rename_evidence


def _star(p: Param) -> str:
    return ("*" if p.kind == "var_positional" else "**") + p.name


def _fmt(p: Param) -> str:
    text = p.name
    if p.annotation:
        text += f": {p.annotation}"
    if p.default is not None:
        text += f" = {p.default}"
    return text


def signature_lines(sig: MethodSignature) -> List[str]:
    return [_fmt(p) if p.kind not in _VARIADIC else _star(p) for p in sig.params]
