"""Where the shim uses each kernel symbol and parameter, and which registered backends reach those lines.

Everything is read by AST from the live checkout; nothing is imported and no shim file name is
assumed:

  * the backends come from the registry literal (`register_backend("name", "module:Attr",
    arch=..., formats=(...))` calls in moe_ep/core/registry.py) and from the rows of the kernel
    format tables the registry derives its kernel backends from (`KernelFormat(backend=...,
    arch=..., fmt=..., target="module:Attr", frontend="module:Attr")` in shim/<arch>/formats.py):
    a row is followed from its backend class and from its frontend class;
  * each backend is followed from its class through the repository's own modules: a *unit* is a
    top-level class (all its methods), a top-level function, a module-level variable, or a
    module's import-time code. A unit reaches the units its code names (through imports,
    module attributes and base classes, function-local imports included) and the import-time
    code of every module it imports. A class reached means its methods may run; a class named
    only in a module-level table does not run its methods, so such tables are followed only
    where code names them;
  * a branch guarded by a format literal (`if fmt == "bf16":`, `fmt in ("mxfp8", ...)`, and the
    `else` of such a test) and a dict keyed by format literals (`{"nvfp4": NvFrontend, ...}`)
    are followed only for the formats they admit, so each (backend, format) pair has its own
    reach;
  * the shim's kernel symbols are its import rows (eager imports, the `_LAZY` tables); a *use*
    is an eager import statement, a dynamic import, or an access to a symbol (`ks.Name`, a name
    bound by import);
  * an *argument site* is a call, a `dict(...)`, an `.update(...)` or a dict literal that names
    kernel parameters: tied to a class when its callee is that class or it sits under a key
    naming the class (`KNOB_SPACE = {"Kernel": {...}}`), otherwise to every kernel method whose
    parameters make up at least two thirds of its (two or more) names. A string-keyed store
    `kwargs["name"] = ...` counts as passing `name`.

What static reading cannot see (a computed `**kwargs` built from non-literal names, a callee
chosen through getattr) is not reported; the audit says "no shim line passes it" rather than
guess.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Dict, FrozenSet, Iterable, List, Optional, Sequence, Set, Tuple

__all__ = [
    "REGISTRY_PATH",
    "Backend",
    "Pair",
    "Site",
    "ArgSite",
    "KernelUse",
    "ShimModel",
    "read_registry",
    "read_format_tables",
]

REGISTRY_PATH = "moe_ep/core/registry.py"
FORMAT_TABLES = "shim/*/formats.py"
_OVERLAP = 2.0 / 3.0

Pair = Tuple[str, str]  # (backend name, format)


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    module: str
    attr: str
    arch: str
    formats: Tuple[str, ...]
    lineno: int = 0
    also: Tuple[str, ...] = ()  # further "module:Attr" units the backend runs (a format table row's frontend)
    classes: Tuple[str, ...] = ()  # the kernel classes a format table row's knobs can select (its kernel_classes)

    def pairs(self) -> List[Pair]:
        return [(self.name, f) for f in self.formats]


def _literal(node: Optional[ast.AST]):
    if node is None:
        return None
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


def read_registry(repo_root: Path, path: str = REGISTRY_PATH) -> List[Backend]:
    """Every `register_backend(...)` call with literal arguments in the registry module, then every
    `KernelFormat(...)` row with literal arguments in the format tables."""
    file = Path(repo_root) / path
    if not file.is_file():
        return []
    tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
    out: List[Backend] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if fname != "register_backend":
            continue
        kw = {k.arg: k.value for k in node.keywords if k.arg}
        name = _literal(node.args[0] if node.args else kw.get("name"))
        target = _literal(node.args[1] if len(node.args) > 1 else kw.get("target"))
        arch = _literal(kw.get("arch"))
        formats = _literal(kw.get("formats"))
        if not (isinstance(name, str) and isinstance(target, str) and ":" in target and isinstance(arch, str)):
            continue
        if isinstance(formats, str):
            formats = (formats,)
        if not isinstance(formats, (tuple, list)) or not all(isinstance(f, str) for f in formats):
            continue
        module, attr = target.split(":", 1)
        out.append(Backend(name, module, attr, arch, tuple(formats), node.lineno))
    return out + read_format_tables(repo_root)


def read_format_tables(repo_root: Path) -> List[Backend]:
    """The rows of shim/<arch>/formats.py: `KernelFormat(...)` calls whose backend, arch, fmt, target and
    frontend are literals."""
    out: List[Backend] = []
    for file in sorted(Path(repo_root).glob(FORMAT_TABLES)):
        tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)) != "KernelFormat":
                continue
            kw = {k.arg: _literal(k.value) for k in node.keywords if k.arg}
            fields = [kw.get(k) for k in ("backend", "arch", "fmt", "target", "frontend")]
            if not all(isinstance(v, str) for v in fields) or ":" not in fields[3] or ":" not in fields[4]:
                continue
            name, arch, fmt, target, frontend = fields
            module, attr = target.split(":", 1)
            classes = kw.get("kernel_classes")
            classes = tuple(c for c in classes if isinstance(c, str)) if isinstance(classes, (tuple, list)) else ()
            out.append(Backend(name, module, attr, arch, (fmt,), node.lineno, (frontend,), classes))
    return out


# ---- facts about one unit ----------------------------------------------------------------------

Formats = Optional[FrozenSet[str]]  # None: every format


@dataclasses.dataclass(frozen=True)
class Site:
    file: str
    line: int
    unit: str
    formats: Formats = None

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


@dataclasses.dataclass(frozen=True)
class KernelUse:
    module: str  # kernel module
    name: Optional[str]  # symbol; None: the module itself
    site: Site
    how: str  # import | dynamic | access


@dataclasses.dataclass(frozen=True)
class ArgSite:
    site: Site
    names: Tuple[str, ...]  # keyword / key names, in order
    name_lines: Tuple[int, ...]
    positional: int  # positional arguments of a call (0 for dicts)
    callee: Optional[Tuple[str, Optional[str]]]  # kernel (module, name) when the callee is a kernel symbol
    class_key: Optional[str]  # the class named by the key this dict sits under
    kind: str  # call | dict | store
    builder: bool = False  # a dict literal, dict(...) or .update(...): arguments being collected
    unpacked: bool = False  # a call with *args or **kwargs: what it passes is not all in `names` / `positional`

    def tied_by_overlap(self, params) -> bool:
        """Names mostly parameters of a method: two or more (one suffices for a builder), two thirds in."""
        names = set(self.names)
        if not names or (len(names) < 2 and not self.builder):
            return False
        return len(names & set(params)) / len(names) >= _OVERLAP

    def line_of(self, name: str) -> int:
        for n, line in zip(self.names, self.name_lines):
            if n == name:
                return line
        return self.site.line


@dataclasses.dataclass
class UnitFacts:
    edges: List[Tuple[Tuple, Formats]] = dataclasses.field(default_factory=list)
    uses: List[KernelUse] = dataclasses.field(default_factory=list)
    args: List[ArgSite] = dataclasses.field(default_factory=list)


def _restrict(ctx: Formats, allowed: Iterable[str]) -> FrozenSet[str]:
    allowed = frozenset(allowed)
    return allowed if ctx is None else ctx & allowed


class _Module:
    def __init__(self, name: str, path: Path, rel: str, tree: ast.Module, is_package: bool):
        self.name = name
        self.path = path
        self.rel = rel
        self.tree = tree
        self.is_package = is_package
        self.defs: Dict[str, ast.AST] = {}
        self.variables: Dict[str, ast.expr] = {}
        self.imports: Dict[str, Tuple] = {}
        self.lazy: Dict[str, Tuple[str, str, int]] = {}
        for stmt in _module_level(tree.body):
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.defs[stmt.name] = stmt
            elif isinstance(stmt, ast.Assign):
                for t in stmt.targets:
                    if isinstance(t, ast.Name):
                        self.variables[t.id] = stmt.value
            elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
                self.variables[stmt.target.id] = stmt.value
            elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
                self.imports.update(_import_bindings(stmt, name, is_package))
        lazy = self.variables.get("_LAZY")
        if isinstance(lazy, ast.Dict):
            for k, v in zip(lazy.keys, lazy.values):
                key, value = _literal(k), _literal(v)
                if isinstance(key, str) and isinstance(value, tuple) and len(value) == 2:
                    self.lazy[key] = (value[0], value[1], k.lineno)


def _module_level(body: Sequence[ast.stmt]):
    for stmt in body:
        yield stmt
        if isinstance(stmt, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody"):
                yield from _module_level(getattr(stmt, field, []) or [])
            for h in getattr(stmt, "handlers", []) or []:
                yield from _module_level(h.body)


def _resolve_relative(importer: str, is_package: bool, module: Optional[str], level: int) -> str:
    if level == 0:
        return module or ""
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _import_bindings(stmt: ast.stmt, importer: str, is_package: bool) -> Dict[str, Tuple]:
    out: Dict[str, Tuple] = {}
    if isinstance(stmt, ast.Import):
        for a in stmt.names:
            if a.asname:
                out[a.asname] = ("module", a.name)
            else:
                out[a.name.split(".")[0]] = ("module", a.name.split(".")[0])
    elif isinstance(stmt, ast.ImportFrom):
        source = _resolve_relative(importer, is_package, stmt.module, stmt.level)
        for a in stmt.names:
            if a.name != "*":
                out[a.asname or a.name] = ("from", source, a.name)
    return out


def _guard(test: ast.expr, known: FrozenSet[str]) -> Optional[Tuple[FrozenSet[str], bool]]:
    """(formats, positive) when `test` compares something with format literals."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return None
    left, right, op = test.left, test.comparators[0], test.ops[0]
    for const, other in ((right, left), (left, right)):
        value = _literal(const)
        if isinstance(other, ast.Constant):
            continue
        values = (value,) if isinstance(value, str) else value
        if not isinstance(values, (tuple, list, set, frozenset)) or not values:
            continue
        if not all(isinstance(v, str) and v in known for v in values):
            continue
        if isinstance(op, (ast.Eq, ast.In)):
            return frozenset(values), True
        if isinstance(op, (ast.NotEq, ast.NotIn)):
            return frozenset(values), False
    return None


def _ends(body: Sequence[ast.stmt]) -> bool:
    return bool(body) and isinstance(body[-1], (ast.Return, ast.Raise, ast.Continue, ast.Break))


def after_if(stmt: ast.If, formats: Formats, known: FrozenSet[str]) -> Formats:
    """The formats the statements after a format-guarded `if` run for: a branch that always leaves (return, raise)
    takes its formats out."""
    g = _guard(stmt.test, known)
    if g is None:
        return formats
    values, positive = g
    on = _restrict(formats, values if positive else known - values)
    off = _restrict(formats, known - values if positive else values)
    if _ends(stmt.body) and _ends(stmt.orelse):
        return frozenset()
    if _ends(stmt.body):
        return off
    if _ends(stmt.orelse):
        return on
    return formats


class ShimModel:
    """The repository's Python modules as units, for one kernel tree.

    `kernel_names`: the tree's top-level kernel packages. `tree_dirs`: the shim directories whose
    files run with this tree (shim/<tree>/ and the tree-agnostic shim/common/); files reached by
    the tree's backends are added to them.
    """

    def __init__(self, repo_root: Path, tree: str, kernel_names: Iterable[str], known_formats: Iterable[str] = (),
                 backends: Optional[List[Backend]] = None, drop_module_exists=None):
        self.repo = Path(repo_root)
        self.tree = tree
        self.kernel_names = frozenset(kernel_names)
        all_backends = read_registry(self.repo) if backends is None else backends
        self.backends = [b for b in all_backends if b.arch == tree]
        self.known_formats = frozenset(known_formats) | frozenset(f for b in all_backends for f in b.formats)
        self._drop_module_exists = drop_module_exists or (lambda m: False)
        self._modules: Dict[str, Optional[_Module]] = {}
        self._facts: Dict[str, UnitFacts] = {}
        self._reach: Dict[Pair, Set[str]] = {}
        self.export_names = self._export_names()

    # ---- modules ----------------------------------------------------------------------------

    def module(self, name: str) -> Optional[_Module]:
        if name in self._modules:
            return self._modules[name]
        found = None
        if name and not self.is_kernel(name):
            parts = name.split(".")
            base = self.repo.joinpath(*parts)
            for path, pkg in ((base.with_suffix(".py"), False), (base / "__init__.py", True)):
                if path.is_file():
                    try:
                        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
                    except SyntaxError:
                        break
                    found = _Module(name, path, path.relative_to(self.repo).as_posix(), tree, pkg)
                    break
            if found is None and base.is_dir() and any(base.glob("*.py")):
                # A namespace package: importable, no code of its own.
                found = _Module(name, base, base.relative_to(self.repo).as_posix(), ast.Module(body=[], type_ignores=[]), True)
        self._modules[name] = found
        return found

    def is_kernel(self, module: str) -> bool:
        return bool(module) and module.split(".")[0] in self.kernel_names

    def shim_modules(self) -> List[str]:
        """Every module under shim/ (the whole shim, all trees)."""
        root = self.repo / "shim"
        out = []
        if root.is_dir():
            for path in sorted(root.rglob("*.py")):
                if "__pycache__" in path.parts:
                    continue
                rel = path.relative_to(self.repo).with_suffix("")
                parts = list(rel.parts)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                out.append(".".join(parts))
        return out

    def tree_modules(self) -> List[str]:
        """Shim modules that run with this tree: shim/<tree>/, shim/common/, and whatever its backends reach."""
        mods = [m for m in self.shim_modules() if m.split(".")[1:2] in ([self.tree], ["common"])]
        reached = {u.split(":", 1)[0] for pair in self.pairs() for u in self.reach(pair)}
        mods += [m for m in sorted(reached) if m.split(".")[0] == "shim" and m not in mods]
        return mods

    def _export_names(self) -> Dict[str, Tuple[str, Optional[str]]]:
        """{name: (kernel module, symbol)} for names a shim module of this tree binds to a kernel symbol."""
        out: Dict[str, Tuple[str, Optional[str]]] = {}
        for name in self.shim_modules():
            if name.split(".")[1:2] not in ([self.tree], ["common"]):
                continue
            mod = self.module(name)
            if mod is None:
                continue
            for export, (kmod, attr, _) in mod.lazy.items():
                if self.is_kernel(kmod):
                    out[export] = (kmod, attr)
            for bound, binding in mod.imports.items():
                if binding[0] == "from" and self.is_kernel(binding[1]):
                    out[bound] = (binding[1], binding[2])
        return out

    # ---- name resolution ----------------------------------------------------------------------

    def _submodule(self, package: str, name: str) -> Optional[str]:
        cand = f"{package}.{name}"
        return cand if self.module(cand) is not None else None

    def resolve_in(self, module: str, name: str, depth: int = 0) -> Optional[Tuple]:
        """What `name` is in repo module `module`: ("unit", m, n) | ("var", m, n) | ("module", m) | ("kernel", kmod, name)."""
        if depth > 8:
            return None
        mod = self.module(module)
        if mod is None:
            return None
        if name in mod.defs:
            return ("unit", module, name)
        if name in mod.imports:
            return self._resolve_binding(mod.imports[name], depth + 1)
        if name in mod.lazy:
            kmod, attr, _ = mod.lazy[name]
            if self.is_kernel(kmod):
                return ("kernel", kmod, attr)
            return self.resolve_in(kmod, attr, depth + 1)
        if name in mod.variables:
            return ("var", module, name)
        if mod.is_package:
            sub = self._submodule(module, name)
            if sub:
                return ("module", sub)
        return None

    def _resolve_binding(self, binding: Tuple, depth: int = 0) -> Optional[Tuple]:
        if binding[0] == "module":
            target = binding[1]
            if self.is_kernel(target):
                return ("kernel", target, None)
            return ("module", target) if self.module(target) is not None else None
        _, source, name = binding
        if self.is_kernel(source):
            if self._drop_module_exists(f"{source}.{name}"):
                return ("kernel", f"{source}.{name}", None)
            return ("kernel", source, name)
        if self.module(source) is None:
            return None
        found = self.resolve_in(source, name, depth + 1)
        if found is None:
            sub = self._submodule(source, name)
            if sub:
                return ("module", sub)
        return found

    def _resolve_attr(self, ref: Optional[Tuple], attr: str) -> Optional[Tuple]:
        if ref is not None:
            if ref[0] == "module":
                return self.resolve_in(ref[1], attr)
            if ref[0] == "kernel" and ref[2] is None:
                if self._drop_module_exists(f"{ref[1]}.{attr}"):
                    return ("kernel", f"{ref[1]}.{attr}", None)
                return ("kernel", ref[1], attr)
            if ref[0] in ("unit", "var", "kernel"):
                return None
        if attr in self.export_names:
            kmod, name = self.export_names[attr]
            return ("kernel", kmod, name)
        return None

    # ---- units --------------------------------------------------------------------------------

    @staticmethod
    def unit_id(module: str, name: Optional[str] = None) -> str:
        return f"{module}:{name}" if name else f"{module}:"

    def facts(self, unit: str) -> UnitFacts:
        if unit in self._facts:
            return self._facts[unit]
        module, _, name = unit.partition(":")
        mod = self.module(module)
        facts = UnitFacts()
        self._facts[unit] = facts
        if mod is None:
            return facts
        if name:
            node = mod.defs.get(name)
            if node is None:
                value = mod.variables.get(name)
                if value is not None:
                    _Visitor(self, mod, unit, facts).visit_node(value, None)
                return facts
            _Visitor(self, mod, unit, facts).visit_node(node, None)
        else:
            v = _Visitor(self, mod, unit, facts)
            for stmt in mod.tree.body:
                v.visit_import_time(stmt)
        return facts

    def pairs(self) -> List[Pair]:
        return [p for b in self.backends for p in b.pairs()]

    def reach(self, pair: Pair) -> Set[str]:
        """Units the backend runs for this format."""
        if pair in self._reach:
            return self._reach[pair]
        backend = next(b for b in self.backends if b.name == pair[0])
        fmt = pair[1]
        seen: Set[str] = set()
        work = [self.unit_id(backend.module, backend.attr)]
        work += [self.unit_id(*u.split(":", 1)) for u in backend.also]
        while work:
            unit = work.pop()
            if unit in seen:
                continue
            seen.add(unit)
            module = unit.split(":", 1)[0]
            work.extend(self._import_time_units(module))
            for ref, formats in self.facts(unit).edges:
                if formats is not None and fmt not in formats:
                    continue
                work.extend(self._units_of(ref))
        self._reach[pair] = seen
        return seen

    def _import_time_units(self, module: str) -> List[str]:
        parts = module.split(".")
        return [self.unit_id(".".join(parts[:i])) for i in range(1, len(parts) + 1)]

    def _units_of(self, ref: Tuple) -> List[str]:
        kind = ref[0]
        if kind in ("unit", "var"):
            return [self.unit_id(ref[1], ref[2])]
        if kind == "module":
            return self._import_time_units(ref[1])
        return []

    def _is_variable_unit(self, unit: str) -> bool:
        module, _, name = unit.partition(":")
        mod = self.module(module)
        return bool(name) and mod is not None and name in mod.variables and name not in mod.defs

    def hits(self, site: Site) -> Set[Pair]:
        """The (backend, format) pairs that run this line.

        A module-level variable's value is evaluated when its module is imported, so its lines run
        for every pair that imports the module; what it names is followed only where code uses it.
        """
        units = {site.unit}
        if self._is_variable_unit(site.unit):
            units.add(self.unit_id(site.unit.split(":", 1)[0]))
        return {p for p in self.pairs() if units & self.reach(p) and (site.formats is None or p[1] in site.formats)}

    # ---- what the tree's shim does ------------------------------------------------------------

    def all_units(self) -> List[str]:
        units: List[str] = []
        for name in self.tree_modules():
            mod = self.module(name)
            if mod is None:
                continue
            units.append(self.unit_id(name))
            units += [self.unit_id(name, n) for n in mod.defs]
            units += [self.unit_id(name, n) for n in mod.variables if n not in mod.defs]
        return units

    def kernel_uses(self) -> List[KernelUse]:
        out: List[KernelUse] = []
        seen = set()
        for unit in self.all_units():
            for use in self.facts(unit).uses:
                key = (use.module, use.name, use.site, use.how)
                if key not in seen:
                    seen.add(key)
                    out.append(use)
        return out

    def arg_sites(self) -> List[ArgSite]:
        out: List[ArgSite] = []
        for unit in self.all_units():
            out.extend(self.facts(unit).args)
        return out


class _Visitor:
    """Collects one unit's edges, kernel uses and argument sites, with format guards."""

    def __init__(self, model: ShimModel, mod: _Module, unit: str, facts: UnitFacts):
        self.m = model
        self.mod = mod
        self.unit = unit
        self.facts = facts
        self.local: Dict[str, Tuple] = {}
        # Function-local imports bind names for the whole unit (a sound over-approximation).
        node = None
        name = unit.partition(":")[2]
        if name:
            node = mod.defs.get(name)
        if node is not None:
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    self.local.update(_import_bindings(sub, mod.name, mod.is_package))

    def site(self, node: ast.AST, formats: Formats) -> Site:
        return Site(self.mod.rel, getattr(node, "lineno", 0), self.unit, formats)

    # -- resolution
    def resolve_name(self, name: str) -> Optional[Tuple]:
        if name in self.local:
            return self.m._resolve_binding(self.local[name])
        return self.m.resolve_in(self.mod.name, name)

    def resolve_expr(self, node: ast.expr) -> Optional[Tuple]:
        if isinstance(node, ast.Name):
            return self.resolve_name(node.id)
        if isinstance(node, ast.Attribute):
            return self.m._resolve_attr(self.resolve_expr(node.value), node.attr)
        return None

    def note_ref(self, ref: Optional[Tuple], node: ast.AST, formats: Formats) -> None:
        if ref is None:
            return
        if ref[0] == "kernel":
            self.facts.uses.append(KernelUse(ref[1], ref[2], self.site(node, formats), "access"))
        else:
            self.facts.edges.append((ref, formats))

    # -- import-time code
    def visit_import_time(self, stmt: ast.stmt) -> None:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for expr in list(stmt.decorator_list) + list(stmt.args.defaults) + [d for d in stmt.args.kw_defaults if d]:
                self.visit_node(expr, None)
            return
        if isinstance(stmt, ast.ClassDef):
            for expr in list(stmt.decorator_list) + list(stmt.bases):
                self.visit_node(expr, None)
            for sub in stmt.body:
                self.visit_import_time(sub)
            return
        if isinstance(stmt, ast.Assign) and all(isinstance(t, ast.Name) for t in stmt.targets):
            return  # a module-level variable is a unit of its own (ShimModel.hits counts it as run at import)
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            return
        self.visit_node(stmt, None)

    # -- generic walk
    def visit_node(self, node: ast.AST, formats: Formats) -> None:
        if formats is not None and not formats:
            return
        known = self.m.known_formats
        if isinstance(node, (ast.If, ast.IfExp)):
            g = _guard(node.test, known)
            self.visit_node(node.test, formats)
            body = node.body if isinstance(node.body, list) else [node.body]
            orelse = node.orelse if isinstance(node.orelse, list) else [node.orelse]
            if g is None:
                on, off = formats, formats
            else:
                values, positive = g
                on = _restrict(formats, values if positive else known - values)
                off = _restrict(formats, known - values if positive else values)
            if body and isinstance(body[0], ast.stmt):
                self.visit_block(body, on)
                self.visit_block(orelse, off)
            else:
                for s in body:
                    self.visit_node(s, on)
                for s in orelse:
                    self.visit_node(s, off)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            self._visit_import(node, formats)
            return
        if isinstance(node, ast.Call):
            self._visit_call(node, formats)
        elif isinstance(node, ast.Dict):
            self._visit_dict(node, formats, None)
            return
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Subscript) and isinstance(t.ctx, ast.Store):
                    key = _literal(t.slice)
                    if isinstance(key, str) and key.isidentifier():
                        self.facts.args.append(ArgSite(self.site(t, formats), (key,), (t.lineno,), 0, None, None, "store"))
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            ref = self.resolve_expr(node)
            if ref is not None:
                self.note_ref(ref, node, formats)
                if ref[0] == "kernel":
                    return  # the receiver chain is part of this one use
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            ref = self.resolve_name(node.id)
            if ref is not None:
                self.note_ref(ref, node, formats)
        for _, value in ast.iter_fields(node):
            values = value if isinstance(value, list) else [value]
            if values and isinstance(values[0], ast.stmt):
                self.visit_block(values, formats)
            else:
                for child in values:
                    if isinstance(child, ast.AST):
                        self.visit_node(child, formats)

    def visit_block(self, stmts: Sequence[ast.stmt], formats: Formats) -> None:
        """Statements in order: after `if <format test>: ... return` the rest runs for the other formats only."""
        for stmt in stmts:
            self.visit_node(stmt, formats)
            if isinstance(stmt, ast.If):
                formats = after_if(stmt, formats, self.m.known_formats)

    def _visit_import(self, node: ast.stmt, formats: Formats) -> None:
        site = self.site(node, formats)
        if isinstance(node, ast.Import):
            for a in node.names:
                if self.m.is_kernel(a.name):
                    self.facts.uses.append(KernelUse(a.name, None, site, "import"))
                elif self.m.module(a.name) is not None:
                    self.facts.edges.append((("module", a.name), formats))
            return
        source = _resolve_relative(self.mod.name, self.mod.is_package, node.module, node.level)
        if self.m.is_kernel(source):
            for a in node.names:
                self.facts.uses.append(KernelUse(source, None if a.name == "*" else a.name, site, "import"))
            return
        if self.m.module(source) is not None:
            self.facts.edges.append((("module", source), formats))
            for a in node.names:
                sub = self.m._submodule(source, a.name)
                if sub:
                    self.facts.edges.append((("module", sub), formats))

    def _visit_call(self, node: ast.Call, formats: Formats) -> None:
        func = node.func
        fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if fname in ("import_module", "__import__") and node.args:
            target = _literal(node.args[0])
            if isinstance(target, str) and self.m.is_kernel(target):
                self.facts.uses.append(KernelUse(target, None, self.site(node, formats), "dynamic"))
        names = [k.arg for k in node.keywords if k.arg]
        callee_ref = self.resolve_expr(func)
        if callee_ref is not None and callee_ref[0] in ("unit", "var", "module"):
            return  # a call into the repository's own code, not a kernel call
        callee = (callee_ref[1], callee_ref[2]) if callee_ref is not None and callee_ref[0] == "kernel" else None
        if callee is None and not names:
            return  # (a kernel callee is kept even with no arguments: a new required parameter breaks that call)
        lines = tuple(getattr(k, "lineno", node.lineno) for k in node.keywords if k.arg)
        builder = callee is None and fname in ("dict", "update")
        unpacked = any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords)
        self.facts.args.append(ArgSite(self.site(node, formats), tuple(names), lines, len(node.args), callee, None,
                                       "call", builder, unpacked))

    def _visit_dict(self, node: ast.Dict, formats: Formats, class_key: Optional[str]) -> None:
        keys = [_literal(k) if k is not None else None for k in node.keys]
        known = self.m.known_formats
        str_keys = [k for k in keys if isinstance(k, str)]
        if str_keys and len(str_keys) == len(keys) and all(k.isidentifier() for k in str_keys):
            lines = tuple(k.lineno for k in node.keys if k is not None)
            self.facts.args.append(ArgSite(self.site(node, formats), tuple(str_keys), lines, 0, None, class_key, "dict",
                                           True))
        format_keyed = bool(keys) and all(isinstance(k, str) and k in known for k in keys)
        for key_node, key, value in zip(node.keys, keys, node.values):
            if key_node is not None:
                self.visit_node(key_node, formats)
            sub = _restrict(formats, {key}) if format_keyed else formats
            if isinstance(value, ast.Dict):
                self._visit_dict(value, sub, key if isinstance(key, str) else None)
            else:
                self.visit_node(value, sub)
