"""Audit one drop tree against the previous drop's files and against the shim.

Sections, each row carrying a status:
  tree        where the tree sits in the wheel (found by content: a move is reported)
  files       added / removed / changed files per kernel package (old -> new), renamed
              packages, stray compiled files
  imports     the shim's import table, each row checked against the new drop
  signatures  __init__ / __call__ of the contracted kernel classes vs the contract, each
              change judged by the shim lines that pass the parameter
  calls       the shim's argument sites vs the new drop's signatures (names it does not take,
              required parameters nobody passes): a cross-check of the contract; and every shim
              call of a drop function bound against its signature (tools/drop/drop_uses.py)
  reads       attributes the shim reads on drop objects (a heuristic's config fields) vs the
              new drop's classes (tools/drop/drop_uses.py)
  knobs       the tuner's knob names and values vs what the new drop accepts
  build       (tools/drop/build_stage.py, when run) the shim's knob resolution at every token
              bucket and its kernel compiles, run against the new tree in a child process: the
              ground truth the static sections predict; a static break of the imports,
              signatures, calls or reads sections whose backends all build is a warning

Statuses: break (the shim would fail against this drop), warn (binds, but may behave
differently, or the contract is stale: a human must look), note (informational), unchecked
(nothing in the drop's source decides it), ok.

Every break carries the shim lines it comes from (file:line, across shim/) and the registered
(backend, format) pairs that run those lines (tools/drop/callsites.py). The exit code: 0 no
break, 3 some registered backends break (or a break no registered backend reaches), 1 every
registered backend of the tree breaks (or the tree has none registered), 2 usage/setup error.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from tools.drop import contract as contract_mod
from tools.drop import drop_uses
from tools.drop import knobs as knobs_mod
from tools.drop.callsites import ArgSite, Backend, Pair, ShimModel
from tools.drop.inventory import Inventory, PackageDiff, diff_inventories, is_compiled, package_renames
from tools.drop.shim_scan import ImportRow, knob_key_lines, knob_space, lazy_tables, scan_imports
from tools.drop.source_model import DropIndex, SymbolResolution
from shim.common.tree_facts import KERNEL_NAMES, TreeFacts

__all__ = ["AuditResult", "Finding", "KnobRow", "run_audit", "STATUS_ORDER", "EXIT_OK", "EXIT_ALL_BREAK",
           "EXIT_USAGE", "EXIT_SOME_BREAK"]

STATUS_ORDER = {"break": 0, "warn": 1, "note": 2, "unchecked": 3, "ok": 4}
SECTION_ORDER = {"tree": 0, "files": 1, "imports": 2, "signatures": 3, "calls": 4, "reads": 5, "knobs": 6, "build": 7}

# The exit codes of `tools/drop audit` / `bump` (also in cli.py's docstring and the README).
EXIT_OK = 0  # compatible: no break
EXIT_ALL_BREAK = 1  # every registered backend of the tree breaks (or none is registered and the shim breaks)
EXIT_USAGE = 2  # usage or setup error (bad flags, no pin, fetch failure, hash mismatch)
EXIT_SOME_BREAK = 3  # some registered backends break, others do not


@dataclasses.dataclass(frozen=True)
class Finding:
    section: str  # tree | files | imports | signatures | calls | knobs
    status: str
    subject: str
    detail: str
    sites: Tuple[str, ...] = ()  # shim lines ("file:line") it comes from
    pairs: Tuple[Pair, ...] = ()  # registered (backend, format) pairs that run those lines


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
    backends: List[Backend] = dataclasses.field(default_factory=list)
    location: Optional[dict] = None  # {"prefix", "expected", "moved"} when the tree came from a wheel
    build: Optional[object] = None  # tools/drop/build_stage.BuildReport once the build stage has run

    def count(self, status: str) -> int:
        return sum(1 for f in self.findings if f.status == status)

    @property
    def breaks(self) -> bool:
        return self.count("break") > 0

    @property
    def clean(self) -> bool:
        return not any(f.status in ("break", "warn", "note") for f in self.findings)

    def all_pairs(self) -> List[Pair]:
        return [p for b in self.backends for p in b.pairs()]

    def broken_pairs(self) -> set:
        return {p for f in self.findings if f.status == "break" for p in f.pairs}

    def unattributed_breaks(self) -> List[Finding]:
        return [f for f in self.findings if f.status == "break" and not f.pairs]

    def grouped_breaks(self) -> List[Tuple[List[str], Finding]]:
        """Breaks with the same cause, lines and backends as one (a subclass repeats its base's): what the verdict
        counts, per backend and in all."""
        groups: Dict[tuple, Tuple[List[str], Finding]] = {}
        for f in self.findings:
            if f.status != "break":
                continue
            tail = f.subject.split(".", 1)[1] if f.section == "signatures" and "." in f.subject else ""
            key = (f.section, tail, f.detail, f.sites, f.pairs)
            if key in groups:
                groups[key][0].append(f.subject)
            else:
                groups[key] = ([f.subject], f)
        return list(groups.values())

    def exit_code(self) -> int:
        if not self.breaks:
            return EXIT_OK
        every = set(self.all_pairs())
        if not every or every <= self.broken_pairs():
            return EXIT_ALL_BREAK
        return EXIT_SOME_BREAK

    def verdict(self) -> str:
        unchecked = self.count("unchecked")
        tail = f" ({unchecked} unchecked: nothing in the drop's source decides them)" if unchecked else ""
        if self.breaks:
            groups = self.grouped_breaks()
            nobody = sum(1 for _, f in groups if not f.pairs)
            unrun = f" ({nobody} of them in code no registered backend runs)" if nobody else ""
            counts = (f"{len(groups)} break{unrun}, {self.count('warn')} warn, {self.count('note')} note{tail}")
            every = self.all_pairs()
            if not every:
                return f"SHIM WOULD BREAK (no backend of this tree registered): {counts}"
            broken = {b for b, _ in self.broken_pairs()}
            names = sorted({b for b, _ in every})
            if self.exit_code() == EXIT_ALL_BREAK:
                return f"ALL BACKENDS BREAK ({len(names)} of {len(names)}): {counts}"
            return f"SOME BACKENDS BREAK ({len(broken)} of {len(names)}: {', '.join(sorted(broken)) or 'none reached'}): {counts}"
        if self.count("warn"):
            return f"REVIEW: 0 break, {self.count('warn')} warn, {self.count('note')} note{tail}"
        if self.count("note"):
            return f"OK WITH CHANGES: 0 break, 0 warn, {self.count('note')} note{tail}"
        return f"CLEAN: 0 break, 0 warn, 0 note{tail}"


def _resolution_detail(index: DropIndex, row: ImportRow, res: SymbolResolution, renames=()) -> str:
    top = row.module.split(".")[0]
    for old, new, _ in renames:
        if old == top:
            moved = new + row.module[len(top):]
            if index.module_exists(moved):
                return f"{res.detail}; the package was renamed: {moved}"
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


def _join(values, limit: int = 0) -> Tuple[str, ...]:
    out: List[str] = []
    for v in values:
        if v not in out:
            out.append(v)
    return tuple(out)


class _Impact:
    """Ties findings to shim lines and to the (backend, format) pairs that run them."""

    def __init__(self, model: ShimModel, index: DropIndex, rows: List[ImportRow], contract: Optional[dict]):
        self.model = model
        self.index = index
        self.rows = rows
        self.uses = model.kernel_uses()
        self.args = model.arg_sites()
        self._hits: Dict[object, frozenset] = {}
        self.recorded = (contract or {}).get("classes", {})

    def hits(self, site) -> frozenset:
        if site not in self._hits:
            self._hits[site] = frozenset(self.model.hits(site))
        return self._hits[site]

    # -- symbols
    def uses_of(self, module: str, name: Optional[str]):
        if name is None:
            return [u for u in self.uses if u.module == module or u.module.startswith(module + ".")]
        return [u for u in self.uses if (u.module, u.name) == (module, name)]

    def class_keys(self, cls: str, module: Optional[str]) -> set:
        keys = {(module, cls)} if module else set()
        for row in self.rows:
            if row.name is None:
                continue
            if row.name == cls or row.export == cls:
                keys.add((row.module, row.name))
                continue
            found = self.index.find_class(row.module, row.name)
            if found is not None and found[1].name == cls and (module is None or found[0] == module):
                keys.add((row.module, row.name))
        return keys

    def class_names(self, cls: str, module: Optional[str]) -> set:
        """The names the shim may use for the class: its own, its exports, its in-drop bases."""
        names = {cls} | {row.export for row in self.rows if row.name is not None and (row.module, row.name) in self.class_keys(cls, module)}
        found = self.index.find_class(module, cls) if module else None
        if found is not None:
            names |= {node.name for _, node in self.index.mro(*found)}
        return names

    def users(self, cls: str, module: Optional[str]) -> Tuple[frozenset, List[str]]:
        keys = self.class_keys(cls, module)
        pairs: set = set()
        sites: List[str] = []
        for u in self.uses:
            if (u.module, u.name) in keys:
                pairs |= self.hits(u.site)
                sites.append(u.site.where)
        return frozenset(pairs), sites

    # -- argument sites
    def arg_sites(self, cls: str, module: Optional[str], method: str, params: set, users: frozenset) -> List[ArgSite]:
        keys = self.class_keys(cls, module)
        names_of_cls = self.class_names(cls, module)
        out = []
        for a in self.args:
            if a.kind == "store":
                continue
            if a.callee is not None:
                tied = method == "__init__" and a.callee in keys
            elif a.class_key is not None:
                tied = method == "__init__" and a.class_key in names_of_cls
            else:
                tied = a.tied_by_overlap(params)
            if tied and self.hits(a.site) & users:
                out.append(a)
        return out

    def stores(self, name: str, users: frozenset) -> List[ArgSite]:
        return [a for a in self.args if a.kind == "store" and name in a.names and self.hits(a.site) & users]

    def _selects_from(self, module: str, users: frozenset) -> bool:
        """Some of `users` call a function of `module` that returns one of the module's own classes (a heuristic's
        selection): its bucket helpers (token_bucket -> int) and an eager import reach no table."""
        for a in self.args:
            if a.kind != "call" or a.callee is None or a.callee[0] != module or a.callee[1] is None:
                continue
            found = self.index.find_function(module, a.callee[1])
            if found is not None and self._returns_own_object(module, found[1]) and self.hits(a.site) & users:
                return True
        return False

    def _returns_own_object(self, module: str, func: ast.FunctionDef) -> bool:
        """Annotated to return a class of `module`, or (unannotated) returning an instance of one or an entry of a
        module-level table."""
        returns = func.returns
        if isinstance(returns, ast.Constant) and isinstance(returns.value, str):
            returns = ast.parse(returns.value, mode="eval").body
        if returns is not None:
            return isinstance(returns, ast.Name) and self.index.find_class(module, returns.id) is not None
        bound = self.index.bindings(module)
        for node in ast.walk(func):
            value = node.value if isinstance(node, ast.Return) else None
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
                if self.index.find_class(module, value.func.id) is not None:
                    return True
            if isinstance(value, ast.Subscript) and isinstance(value.value, ast.Name) and value.value.id in bound:
                return True
        return False

    def tables_reached(self, tables: Dict[str, tuple], users: frozenset) -> Dict[str, tuple]:
        """The drop's heuristic-table values (knobs.heuristic_values) from modules some of `users` reach: a table
        feeds a class only through a pair that calls into its module (the FP8 tables are not W4A8's)."""
        reached = {m for m in {m for _, (_, mods) in tables.items() for m in mods} if self._selects_from(m, users)}
        out = {}
        for knob, (values, mods) in tables.items():
            kept = [m for m in mods if m in reached]
            if kept:
                out[knob] = (values, kept)
        return out


def run_audit(
    repo_root: Path,
    tree: TreeFacts,
    new_root: Path,
    old_inventory: Inventory,
    new_inventory: Inventory,
    old_label: str,
    new_label: str,
    contract: Optional[dict],
    location: Optional[dict] = None,
) -> AuditResult:
    repo_root = Path(repo_root)
    index = DropIndex(new_root)
    kernel_names = set(KERNEL_NAMES) | set(index.top_level_packages())
    findings: List[Finding] = []

    # -- tree ------------------------------------------------------------
    if location and location.get("moved"):
        findings.append(Finding("tree", "note", tree.arch,
                                f"tree moved inside the wheel: {location['expected']} -> {location['prefix']} "
                                "(found by content; the bump pins the new prefix)"))

    # -- files -----------------------------------------------------------
    diffs = diff_inventories(old_inventory, new_inventory)
    renames = package_renames(old_inventory, new_inventory)
    renamed_old = {old for old, _, _ in renames}
    renamed_new = {new for _, new, _ in renames}
    for old, new, detail in renames:
        findings.append(Finding("files", "note", f"{old} -> {new}", f"package renamed ({detail})"))
    for d in diffs:
        strays = [rel for rel in d.added if is_compiled(rel)]
        if strays:
            for rel in strays:
                findings.append(Finding("files", "warn", rel, "compiled file in the tree, not part of the drop "
                                        "(delete it; the drop is consumed verbatim)"))
        if d.status == "added" and d.package not in renamed_new and len(strays) < d.new_files:
            findings.append(Finding("files", "note", d.package, f"package added ({d.new_files} files)"))
        elif d.status == "removed" and d.package not in renamed_old:
            findings.append(Finding("files", "note", d.package, f"package removed ({d.old_files} files)"))
        elif d.status == "changed":
            for rel in d.added:
                if not is_compiled(rel):
                    findings.append(Finding("files", "note", rel, "file added"))
            for rel in d.removed:
                findings.append(Finding("files", "note", rel, "file removed"))
            for rel in d.changed:
                findings.append(Finding("files", "note", rel, "file changed"))

    model = ShimModel(repo_root, tree.arch, kernel_names, drop_module_exists=index.module_exists)
    rows = scan_imports(repo_root, tree.arch, kernel_names)
    impact = _Impact(model, index, rows, contract)

    # -- imports ---------------------------------------------------------
    shim_found = (repo_root / "shim" / tree.arch).is_dir()
    import_rows: List[Tuple[ImportRow, SymbolResolution]] = []
    for row in rows:
        res = index.resolve_symbol(row.module, row.name)
        if res.status in ("missing_module", "missing_symbol"):
            res = dataclasses.replace(res, detail=_resolution_detail(index, row, res, renames))
        import_rows.append((row, res))
        subject = f"{row.module}" + (f".{row.name}" if row.name else "")
        if row.name and row.export != row.name:
            subject += f" (shim name {row.export})"
        if res.status in ("missing_module", "missing_symbol"):
            uses = impact.uses_of(row.module, row.name)
            pairs = frozenset().union(*[impact.hits(u.site) for u in uses]) if uses else frozenset()
            sites = _join([f"{row.file}:{row.lineno}"] + [u.site.where for u in uses])
            used = bool(uses) or row.form != "lazy"
            # A lazy row nothing in the shim reads fails nothing at run time (the drop's CPU references: the audit's
            # numerical check, which then fails for its backend, is where that shows).
            detail = res.detail if used else res.detail + "; no shim line uses it"
            findings.append(Finding("imports", "break" if used else "warn", subject, detail, sites,
                                    tuple(sorted(pairs))))
        elif res.status == "unchecked":
            findings.append(Finding("imports", "unchecked", f"{row.file}:{row.lineno} {subject}", res.detail))

    # -- signatures ------------------------------------------------------
    lazy = lazy_tables(repo_root, tree.arch, kernel_names)
    current = contract_mod.kernel_classes(index, lazy)
    signatures: Dict[str, Dict[str, List[contract_mod.ParamChange]]] = {}
    recorded = (contract or {}).get("classes", {})
    if contract is None and current:
        findings.append(
            Finding("signatures", "warn", tree.arch, "no contract recorded: review, then bump --accept-contract")
        )
    reported: set = set()  # (class, method, param) already judged from the contract diff
    for name, entry in sorted(recorded.items()):
        users, use_sites = impact.users(name, entry["module"])
        found = index.find_class(entry["module"], name)
        if found is None:
            findings.append(Finding("signatures", "break", name, f"class gone from {entry['module']}",
                                    _join(use_sites), tuple(sorted(users))))
            continue
        mod, node = found
        signatures[name] = {}
        for method, old_json in sorted(entry.get("methods", {}).items()):
            old_params = contract_mod.params_of(old_json)
            sig = index.signature(mod, node, method)
            if sig is None:
                findings.append(Finding("signatures", "break", f"{name}.{method}", "method gone",
                                        _join(use_sites), tuple(sorted(users))))
                continue
            params = {p.name for p in old_params} | {p.name for p in sig.params}
            sites = impact.arg_sites(name, entry["module"], method, params, users)
            changes = contract_mod.diff_params(old_params, sig.params, positional_callers=(method == "__call__"))
            old_positional = [p.name for p in old_params if p.kind in ("positional_only", "positional_or_keyword")]
            judged = [_judge_change(c, name, method, sites, impact, users, old_positional) for c in changes]
            signatures[name][method] = [c for c, _ in judged]
            for c, finding in judged:
                findings.append(finding)
                reported.add((name, method, c.param))
                if c.change == "renamed":
                    reported.add((name, method, c.detail.split(" -> ")[-1]))
            findings.extend(_relied_defaults(name, method, sig, sites, impact, users, reported))
            findings.extend(_cross_check(name, method, sig, sites, impact, users, reported))
        if name not in current and lazy:
            findings.append(Finding("signatures", "note", name, "in the contract but no longer named by the shim's _LAZY"))
    if contract is not None:
        for name in sorted(set(current) - set(recorded)):
            findings.append(
                Finding("signatures", "warn", name, "built by the shim but not in the contract: review, then bump --accept-contract")
            )

    # -- calls into drop functions, reads of drop objects -------------------
    for section, problems in (("calls", drop_uses.call_problems(model, index)),
                              ("reads", drop_uses.attribute_problems(model, index))):
        for p in problems:
            findings.append(Finding(section, "break", p.subject, p.detail, (p.site.where,),
                                    tuple(sorted(model.hits(p.site)))))

    # -- knobs -----------------------------------------------------------
    knob_file, space = knob_space(repo_root, tree.arch)
    key_lines = knob_key_lines(repo_root, knob_file) if knob_file else {}
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
        module_hint = recorded.get(cls_key, {}).get("module") or (by_export.get(cls_key, (None,))[0])
        users, _ = impact.users(cls_key, module_hint)
        where = lambda knob="": tuple(s for s in [key_lines.get((cls_key, knob))] if s)  # noqa: E731
        if located is None:
            knob_rows.append(KnobRow(cls_key, "", "", "break", "class not found in the drop via the shim's _LAZY table"))
            findings.append(Finding("knobs", "break", cls_key, "knob space names a class the drop does not provide",
                                    where(), tuple(sorted(users))))
            continue
        mod, node = located
        init = index.signature(mod, node, "__init__")
        params = {p.name: p for p in (init.params if init else ())}
        takes_kwargs = any(p.kind == "var_keyword" for p in params.values())
        package = mod.split(".")[0]
        tables = impact.tables_reached(knobs_mod.heuristic_values(index, package), users)
        passed = {n for a in impact.arg_sites(cls_key, module_hint, "__init__", set(params), users)
                  if a.class_key is None for n in a.names}
        for knob, values in sorted(knobs.items()):
            if knob not in params and knob not in passed and not takes_kwargs:
                # The knob set's own field (e.g. swap_ab, which picks the class): no constructor argument carries it.
                knob_rows.append(KnobRow(cls_key, knob, "", "note", "a shim-side knob: no constructor argument of "
                                                                   f"the shim passes it to {cls_key}"))
                continue
            if knob not in params or params[knob].kind in ("var_positional", "var_keyword"):
                if takes_kwargs:
                    knob_rows.append(KnobRow(cls_key, knob, "", "unchecked", "not a named parameter; __init__ takes **kwargs"))
                    findings.append(Finding("knobs", "unchecked", f"{cls_key}.{knob}", "__init__ takes **kwargs"))
                else:
                    owner = init.owner if init else f"{mod}.{node.name}"
                    knob_rows.append(KnobRow(cls_key, knob, "", "break", f"not a parameter of {owner}.__init__"))
                    findings.append(Finding("knobs", "break", f"{cls_key}.{knob}", f"not a parameter of {owner}.__init__",
                                            where(knob), tuple(sorted(users))))
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
                    brk = verdict.status == "break"
                    findings.append(Finding("knobs", verdict.status, f"{cls_key}.{knob}={value!r}", verdict.detail,
                                            where(knob) if brk else (), tuple(sorted(users)) if brk else ()))
            if table is not None:
                for v in sorted(table[0] - offered, key=repr):
                    table_only.append((cls_key, knob, repr(v)))
                    findings.append(Finding(
                        "knobs", "warn", f"{cls_key}.{knob}={v!r}",
                        f"the drop's heuristic tables ({', '.join(table[1])}) use it and the knob space does not "
                        "offer it: a capacity whose bucket picks it fails knob validation (the build stage resolves "
                        "every bucket)", where(knob), tuple(sorted(users))))

    findings.sort(key=lambda f: (STATUS_ORDER[f.status], SECTION_ORDER[f.section], f.subject))
    return AuditResult(
        tree=tree.arch,
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
        backends=list(model.backends),
        location=location,
    )


def _lines_passing(sites: List[ArgSite], name: str, stores: List[ArgSite]) -> List[ArgSite]:
    return [a for a in sites if name in a.names] + stores


def _positional_over(sites: List[ArgSite], names: List[str], old_positional: List[str]) -> List[ArgSite]:
    """The call sites whose positional arguments reach one of `names` (by its place in the old signature)."""
    first = min((old_positional.index(n) for n in names if n in old_positional), default=len(old_positional))
    return [a for a in sites if a.positional > first]


def _judge_change(c: contract_mod.ParamChange, cls: str, method: str, sites: List[ArgSite], impact: _Impact,
                  users: frozenset, old_positional: List[str] = ()) -> Tuple[contract_mod.ParamChange, Finding]:
    """The contract diff's change, judged by what the shim actually passes."""
    subject = f"{cls}.{method}({c.param})"
    name = c.param
    status, detail = c.status, f"{c.change}: {c.detail}"
    passing: List[ArgSite] = []
    if c.change in ("removed", "renamed"):
        passing = _lines_passing(sites, name, impact.stores(name, users))
        if not passing:
            status = "warn"
            new = c.detail.split(" -> ")[-1] if c.change == "renamed" else None
            if new and _lines_passing(sites, new, impact.stores(new, users)):
                detail += "; the shim passes the new name already: accept the contract"
            else:
                detail += "; no shim line passes it: accept the contract once reviewed"
    elif c.change in ("added", "now_required") and c.status == "break":
        passing = _lines_passing(sites, name, impact.stores(name, users))
        if passing:
            status = "warn"
            detail += "; the shim passes it already: accept the contract"
        elif not sites:
            status = "warn"
            detail += "; the shim never calls it"
        else:
            passing = sites
            detail += "; no shim line passes it"
    elif (c.change == "added" and c.status == "note") or (c.change == "redefaulted" and " -> " in c.detail):
        # A default the shim does not pass is what every layer now runs with: a decision the shim must make.
        unpinned, where_missing = _unpinned(name, sites, impact, users)
        if unpinned:
            status = "break"
            names = ", ".join(sorted({b for b, _ in unpinned}))
            detail += (f"; changes behaviour unless the shim pins it: no shim line passes {name} for {names} "
                       "(pass the value the shim wants, then accept the contract)")
            passing = where_missing
            return dataclasses.replace(c, status=status), Finding(
                "signatures", status, subject, detail, _join(a.site.where for a in passing), tuple(sorted(unpinned)))
        status = "note"
        passing = _lines_passing(sites, name, impact.stores(name, users))
        detail += "; the shim pins it: accept the contract" if passing else "; the shim never calls it"
    elif c.change == "moved" and c.status == "break":
        passing = _positional_over(sites, c.param.split(","), old_positional)
        if not sites:
            status = "warn"
            detail += "; the shim never calls it"
        elif not passing:
            status = "note"
            detail += "; every shim call site passes them by keyword"
    else:
        for n in name.split(","):
            passing += _lines_passing(sites, n, impact.stores(n, users))
    where = _join(f"{a.site.file}:{a.line_of(name.split(',')[0])}" for a in passing)
    pairs: frozenset = frozenset()
    if status == "break":
        pairs = frozenset().union(*[impact.hits(a.site) for a in passing]) & users if passing else users
    return dataclasses.replace(c, status=status), Finding("signatures", status, subject, detail, where, tuple(sorted(pairs)))


def _pins(sites: List[ArgSite]) -> List[ArgSite]:
    """The sites that hand arguments to the kernel (a knob space's value set under a class key passes nothing)."""
    return [a for a in sites if a.class_key is None]


def _unpinned(name: str, sites: List[ArgSite], impact: _Impact, users: frozenset):
    """(pairs among `users` that call the method and pass `name` on no shim line, the argument sites they run)."""
    pins = _pins(sites)
    stores = impact.stores(name, users)
    missing, where = set(), []
    for pair in users:
        mine = [a for a in pins if pair in impact.hits(a.site)]
        if not mine:
            continue  # the pair reads the class (an attribute, a constant) but never calls it
        if any(name in a.names for a in mine) or any(pair in impact.hits(a.site) for a in stores):
            continue
        missing.add(pair)
        where += [a for a in mine if a not in where]
    return frozenset(missing), where


def _relied_defaults(cls: str, method: str, sig, sites: List[ArgSite], impact: _Impact, users: frozenset,
                     reported: set) -> List[Finding]:
    """Parameters with a default the contract already had, which some backend leaves to the drop: the shim should
    name every value it relies on (a default given by a name, set in the body or by setdefault can change without
    the signature's text changing)."""
    out: List[Finding] = []
    if not sites:
        return out
    for p in sig.params:
        if p.default is None or p.kind in ("var_positional", "var_keyword") or (cls, method, p.name) in reported:
            continue
        unpinned, where = _unpinned(p.name, sites, impact, users)
        if not unpinned:
            continue
        names = ", ".join(sorted({b for b, _ in unpinned}))
        out.append(Finding("signatures", "warn", f"{cls}.{method}({p.name})",
                           f"the shim relies on the drop's default {p.name} = {p.default} for {names}: pass it "
                           "explicitly, so that a drop that changes it is a break the audit names",
                           _join(a.site.where for a in where)))
    return out


def _cross_check(cls: str, method: str, sig, sites: List[ArgSite], impact: _Impact, users: frozenset,
                 reported: set) -> List[Finding]:
    """The shim's argument sites against the new signature itself (warn: a site tied by name overlap
    may not be a call of this method; the contract diff is what decides a break)."""
    out: List[Finding] = []
    sites = _pins(sites)
    if not sites:
        return out
    names = {p.name for p in sig.params}
    takes_kwargs = any(p.kind == "var_keyword" for p in sig.params)
    passed: set = set()
    for a in sites:
        passed |= set(a.names)
        if a.positional:
            positional = [p.name for p in sig.params if p.kind in ("positional_only", "positional_or_keyword")]
            passed |= set(positional[: a.positional])
        if takes_kwargs:
            continue
        for n in a.names:
            if n not in names and (cls, method, n) not in reported:
                reported.add((cls, method, n))
                out.append(Finding("calls", "warn", f"{cls}.{method}({n})",
                                   f"the shim passes {n}, which {sig.owner}.{method} does not take",
                                   (f"{a.site.file}:{a.line_of(n)}",)))
    for p in sig.params:
        if p.kind in ("var_positional", "var_keyword") or p.default is not None:
            continue
        if p.name in passed or impact.stores(p.name, users) or (cls, method, p.name) in reported:
            continue
        reported.add((cls, method, p.name))
        out.append(Finding("calls", "warn", f"{cls}.{method}({p.name})",
                           f"required by {sig.owner}.{method}; no shim argument site names it",
                           _join(a.site.where for a in sites)))
    return out
