"""Audit one drop tree against the previous drop's files and against the shim.

Sections, each row carrying a status:
  files       added / removed / changed files per kernel package (old -> new)
  imports     the shim's import table, each row checked against the new drop
  signatures  __init__ / __call__ of the contracted kernel classes vs the contract
  knobs       the tuner's knob names and values vs what the new drop accepts

Statuses: break (the shim would fail against this drop: the exit code is 1),
warn (binds, but may behave differently: a human must look), note
(informational), unchecked (nothing in the drop's source decides it), ok.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from tools.drop import contract as contract_mod
from tools.drop import knobs as knobs_mod
from tools.drop.inventory import Inventory, PackageDiff, diff_inventories
from tools.drop.shim_scan import ImportRow, knob_space, lazy_tables, scan_imports
from tools.drop.source_model import DropIndex, SymbolResolution
from tools.drop.trees import KERNEL_TOP_LEVEL, Tree

__all__ = ["AuditResult", "Finding", "KnobRow", "run_audit", "STATUS_ORDER"]

STATUS_ORDER = {"break": 0, "warn": 1, "note": 2, "unchecked": 3, "ok": 4}


@dataclasses.dataclass(frozen=True)
class Finding:
    section: str  # files | imports | signatures | knobs
    status: str
    subject: str
    detail: str


@dataclasses.dataclass(frozen=True)
class KnobRow:
    cls: str
    knob: str
    value: str  # repr of the value, or "" for a row about the knob itself
    status: str
    detail: str


@dataclasses.dataclass
class AuditResult:
    tree: str
    old_label: str
    new_label: str
    package_diffs: List[PackageDiff]
    import_rows: List[Tuple[ImportRow, SymbolResolution]]
    signatures: Dict[str, Dict[str, List[contract_mod.ParamChange]]]
    knob_rows: List[KnobRow]
    table_only_values: List[Tuple[str, str, str]]  # (class, knob, value) the drop's table uses, the space lacks
    findings: List[Finding]
    shim_found: bool
    knob_file: Optional[str]

    def count(self, status: str) -> int:
        return sum(1 for f in self.findings if f.status == status)

    @property
    def breaks(self) -> bool:
        return self.count("break") > 0

    @property
    def clean(self) -> bool:
        return not any(f.status in ("break", "warn", "note") for f in self.findings)

    def exit_code(self) -> int:
        return 1 if self.breaks else 0

    def verdict(self) -> str:
        unchecked = self.count("unchecked")
        tail = f" ({unchecked} unchecked: nothing in the drop's source decides them)" if unchecked else ""
        if self.breaks:
            return f"SHIM WOULD BREAK: {self.count('break')} break, {self.count('warn')} warn, {self.count('note')} note{tail}"
        if self.count("warn"):
            return f"REVIEW: 0 break, {self.count('warn')} warn, {self.count('note')} note{tail}"
        if self.count("note"):
            return f"OK WITH CHANGES: 0 break, 0 warn, {self.count('note')} note{tail}"
        return f"CLEAN: 0 break, 0 warn, 0 note{tail}"


def _resolution_detail(index: DropIndex, row: ImportRow, res: SymbolResolution) -> str:
    if res.status == "missing_symbol" and row.name:
        names = [n for n in index.all_names(row.module) if not n.startswith("__")]
        close = difflib.get_close_matches(row.name, names, n=3, cutoff=0.6)
        if close:
            return f"{res.detail}; did you mean {', '.join(close)}?"
    if res.status == "missing_module":
        parent = row.module.rpartition(".")[0]
        if parent and index.module_exists(parent):
            close = difflib.get_close_matches(row.module.rpartition(".")[2], index.all_names(parent), n=3, cutoff=0.6)
            if close:
                return f"{res.detail}; did you mean {', '.join(parent + '.' + c for c in close)}?"
    return res.detail


def run_audit(
    repo_root: Path,
    tree: Tree,
    new_root: Path,
    old_inventory: Inventory,
    new_inventory: Inventory,
    old_label: str,
    new_label: str,
    contract: Optional[dict],
) -> AuditResult:
    repo_root = Path(repo_root)
    index = DropIndex(new_root)
    kernel_names = set(KERNEL_TOP_LEVEL) | set(index.top_level_packages())
    findings: List[Finding] = []

    # -- files -----------------------------------------------------------
    diffs = diff_inventories(old_inventory, new_inventory)
    for d in diffs:
        if d.status == "added":
            findings.append(Finding("files", "note", d.package, f"package added ({d.new_files} files)"))
        elif d.status == "removed":
            findings.append(Finding("files", "note", d.package, f"package removed ({d.old_files} files)"))
        else:
            for rel in d.added:
                findings.append(Finding("files", "note", rel, "file added"))
            for rel in d.removed:
                findings.append(Finding("files", "note", rel, "file removed"))
            for rel in d.changed:
                findings.append(Finding("files", "note", rel, "file changed"))

    # -- imports ---------------------------------------------------------
    rows = scan_imports(repo_root, tree.name, kernel_names)
    shim_found = (repo_root / "shim" / tree.name).is_dir()
    import_rows: List[Tuple[ImportRow, SymbolResolution]] = []
    for row in rows:
        res = index.resolve_symbol(row.module, row.name)
        if res.status in ("missing_module", "missing_symbol"):
            res = dataclasses.replace(res, detail=_resolution_detail(index, row, res))
        import_rows.append((row, res))
        subject = f"{row.file}:{row.lineno} {row.module}" + (f".{row.name}" if row.name else "")
        if res.status in ("missing_module", "missing_symbol"):
            findings.append(Finding("imports", "break", subject, res.detail))
        elif res.status == "unchecked":
            findings.append(Finding("imports", "unchecked", subject, res.detail))

    # -- signatures ------------------------------------------------------
    lazy = lazy_tables(repo_root, tree.name, kernel_names)
    current = contract_mod.kernel_classes(index, lazy)
    signatures: Dict[str, Dict[str, List[contract_mod.ParamChange]]] = {}
    recorded = (contract or {}).get("classes", {})
    if contract is None and current:
        findings.append(
            Finding("signatures", "warn", tree.name, "no contract recorded: review, then bump --accept-contract")
        )
    for name, entry in sorted(recorded.items()):
        found = index.find_class(entry["module"], name)
        if found is None:
            findings.append(Finding("signatures", "break", name, f"class gone from {entry['module']}"))
            continue
        mod, node = found
        signatures[name] = {}
        for method, old_json in sorted(entry.get("methods", {}).items()):
            sig = index.signature(mod, node, method)
            if sig is None:
                findings.append(Finding("signatures", "break", f"{name}.{method}", "method gone"))
                continue
            changes = contract_mod.diff_params(
                contract_mod.params_of(old_json), sig.params, positional_callers=(method == "__call__")
            )
            signatures[name][method] = changes
            for c in changes:
                findings.append(Finding("signatures", c.status, f"{name}.{method}({c.param})", f"{c.change}: {c.detail}"))
        if name not in current and lazy:
            findings.append(Finding("signatures", "note", name, "in the contract but no longer named by the shim's _LAZY"))
    if contract is not None:
        for name in sorted(set(current) - set(recorded)):
            findings.append(
                Finding("signatures", "warn", name, "built by the shim but not in the contract: review, then bump --accept-contract")
            )

    # -- knobs -----------------------------------------------------------
    knob_file, space = knob_space(repo_root, tree.name)
    knob_rows: List[KnobRow] = []
    table_only: List[Tuple[str, str, str]] = []
    by_export = {export: (m, a) for export, (m, a) in lazy.items()}
    for cls_key, knobs in sorted(space.items()):
        located = None
        if cls_key in by_export:
            located = index.find_class(*by_export[cls_key])
        if located is None and cls_key in current:
            located = current[cls_key]["module"], current[cls_key]["node"]
        if located is None and cls_key in recorded:
            located = index.find_class(recorded[cls_key]["module"], cls_key)
        if located is None:
            knob_rows.append(KnobRow(cls_key, "", "", "break", "class not found in the drop via the shim's _LAZY table"))
            findings.append(Finding("knobs", "break", cls_key, "knob space names a class the drop does not provide"))
            continue
        mod, node = located
        init = index.signature(mod, node, "__init__")
        params = {p.name: p for p in (init.params if init else ())}
        takes_kwargs = any(p.kind == "var_keyword" for p in params.values())
        package = mod.split(".")[0]
        tables = knobs_mod.heuristic_values(index, package)
        for knob, values in sorted(knobs.items()):
            if knob not in params or params[knob].kind in ("var_positional", "var_keyword"):
                if takes_kwargs:
                    knob_rows.append(KnobRow(cls_key, knob, "", "unchecked", "not a named parameter; __init__ takes **kwargs"))
                    findings.append(Finding("knobs", "unchecked", f"{cls_key}.{knob}", "__init__ takes **kwargs"))
                else:
                    owner = init.owner if init else f"{mod}.{node.name}"
                    knob_rows.append(KnobRow(cls_key, knob, "", "break", f"not a parameter of {owner}.__init__"))
                    findings.append(Finding("knobs", "break", f"{cls_key}.{knob}", f"not a parameter of {owner}.__init__"))
                continue
            constraints = knobs_mod.param_constraints(index, mod, node, knob)
            default = None
            if params[knob].default is not None:
                ok, literal = knobs_mod.literal_or_none(ast.parse(params[knob].default, mode="eval").body)
                if ok:
                    default = (literal, f"{init.owner.rpartition('.')[0]}:{init.lineno}")
            table = tables.get(knob)
            offered = set()
            for value in values:
                verdict = knobs_mod.judge_value(value, constraints, table, default)
                offered.add(knobs_mod.freeze(value))
                knob_rows.append(KnobRow(cls_key, knob, repr(value), verdict.status, verdict.detail))
                if verdict.status != "ok":
                    findings.append(Finding("knobs", verdict.status, f"{cls_key}.{knob}={value!r}", verdict.detail))
            if table is not None:
                for v in sorted(table[0] - offered, key=repr):
                    table_only.append((cls_key, knob, repr(v)))

    order = {"files": 0, "imports": 1, "signatures": 2, "knobs": 3}
    findings.sort(key=lambda f: (STATUS_ORDER[f.status], order[f.section], f.subject))
    return AuditResult(
        tree=tree.name,
        old_label=old_label,
        new_label=new_label,
        package_diffs=diffs,
        import_rows=import_rows,
        signatures=signatures,
        knob_rows=knob_rows,
        table_only_values=table_only,
        findings=findings,
        shim_found=shim_found,
        knob_file=knob_file,
    )
