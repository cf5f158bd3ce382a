"""A static model of a kernel drop, read from source with `ast` only.

The audit must run on a CPU-only host with no cutlass installed, and a drop's
modules execute GPU-facing code at import time, so nothing here imports the
drop: every answer ("is this module there?", "does it define that name?",
"what does this constructor take?") comes from parsing files.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Set, Tuple

__all__ = [
    "Binding",
    "DropIndex",
    "MethodSignature",
    "Param",
    "SymbolResolution",
    "forwards_to_super",
    "function_params",
    "literal_or_none",
]

# A module-level name can be bound by these statement kinds; anything bound in
# a function or class body is not a module attribute.
_SCOPE_CONTAINERS = (ast.If, ast.Try, ast.With, ast.For, ast.While)
try:  # Python 3.11+: try/except* blocks also bind at module level.
    _SCOPE_CONTAINERS = _SCOPE_CONTAINERS + (ast.TryStar,)  # type: ignore[attr-defined]
except AttributeError:  # pragma: no cover - older interpreters
    pass


@dataclasses.dataclass(frozen=True)
class Binding:
    """How a module-level name is bound."""

    kind: str  # "class" | "function" | "variable" | "import" | "star"
    lineno: int
    node: Optional[ast.AST] = None
    # For kind == "import": the absolute module and the name imported from it
    # (name None for `import a.b as n`, which binds the module itself).
    source_module: Optional[str] = None
    source_name: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class SymbolResolution:
    """Where a (module, name) pair ends up after following re-exports."""

    status: str  # "ok" | "missing_module" | "missing_symbol" | "unchecked"
    kind: str = ""  # class | function | variable | module | external
    module: str = ""  # module that finally defines it
    lineno: int = 0
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class Param:
    name: str
    kind: str  # positional_only | positional_or_keyword | var_positional | keyword_only | var_keyword
    annotation: Optional[str]
    default: Optional[str]  # source text of the default; None when required

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @staticmethod
    def from_json(data: dict) -> "Param":
        return Param(
            name=data["name"],
            kind=data["kind"],
            annotation=data.get("annotation"),
            default=data.get("default"),
        )


@dataclasses.dataclass(frozen=True)
class MethodSignature:
    method: str
    owner: str  # "<module>.<Class>" that defines the method (may be a base)
    lineno: int
    params: Tuple[Param, ...]
    decorators: Tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {
            "owner": self.owner,
            "decorators": list(self.decorators),
            "params": [p.to_json() for p in self.params],
        }


def literal_or_none(node: Optional[ast.AST]):
    """`ast.literal_eval`, or a sentinel-free None-with-flag for non-literals."""
    if node is None:
        return False, None
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def function_params(func: ast.FunctionDef, drop_self: bool = True) -> Tuple[Param, ...]:
    """The parameters of `func` in declaration order, defaults as source text."""
    a = func.args
    positional = list(a.posonlyargs) + list(a.args)
    defaults: List[Optional[ast.expr]] = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    out: List[Param] = []
    for i, (arg, default) in enumerate(zip(positional, defaults)):
        kind = "positional_only" if i < len(a.posonlyargs) else "positional_or_keyword"
        out.append(_param(arg, kind, default))
    if a.vararg is not None:
        out.append(_param(a.vararg, "var_positional", None))
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        out.append(_param(arg, "keyword_only", default))
    if a.kwarg is not None:
        out.append(_param(a.kwarg, "var_keyword", None))
    if drop_self and out and out[0].kind in ("positional_only", "positional_or_keyword") and out[0].name in ("self", "cls"):
        out = out[1:]
    return tuple(out)


def _param(arg: ast.arg, kind: str, default: Optional[ast.expr]) -> Param:
    return Param(
        name=arg.arg,
        kind=kind,
        annotation=ast.unparse(arg.annotation) if arg.annotation is not None else None,
        default=ast.unparse(default) if default is not None else None,
    )


def _module_level_statements(body: Sequence[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements executed at module scope, descending into if/try/with/for."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, _SCOPE_CONTAINERS):
            for field in ("body", "orelse", "finalbody"):
                yield from _module_level_statements(getattr(stmt, field, []) or [])
            for handler in getattr(stmt, "handlers", []) or []:
                yield from _module_level_statements(handler.body)


def _target_names(target: ast.expr) -> Iterator[str]:
    if isinstance(target, ast.Name):
        yield target.id
    elif isinstance(target, (ast.Tuple, ast.List)):
        for elt in target.elts:
            yield from _target_names(elt)
    elif isinstance(target, ast.Starred):
        yield from _target_names(target.value)


class DropIndex:
    """Modules of one extracted drop tree (the directory that holds `common/`, `src/`, ...)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"drop tree root {self.root} is not a directory")
        self.modules: Dict[str, Path] = {}
        self.packages: Set[str] = set()
        self._ast: Dict[str, ast.Module] = {}
        self._bindings: Dict[str, Dict[str, List[Binding]]] = {}
        self._scan()

    # ---- module discovery -------------------------------------------------

    def _scan(self) -> None:
        for path in sorted(self.root.rglob("*.py")):
            rel = path.relative_to(self.root)
            if any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
                continue
            parts = list(rel.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
                if not parts:
                    continue
                self.packages.add(".".join(parts))
            self.modules[".".join(parts)] = path
            # A directory holding .py files is importable (as a namespace
            # package when it has no __init__.py), so every parent counts.
            for i in range(1, len(parts)):
                self.packages.add(".".join(parts[:i]))

    def top_level_packages(self) -> List[str]:
        """Top-level importable names: dirs with __init__.py or .py files, and top-level modules."""
        names = {name.split(".")[0] for name in self.modules} | {p.split(".")[0] for p in self.packages}
        return sorted(names)

    def module_exists(self, name: str) -> bool:
        return name in self.modules or name in self.packages

    def module_path(self, name: str) -> Optional[Path]:
        return self.modules.get(name)

    def rel(self, name: str) -> str:
        path = self.modules.get(name)
        return str(path.relative_to(self.root)) if path else name.replace(".", "/") + "/"

    def tree(self, name: str) -> Optional[ast.Module]:
        if name not in self.modules:
            return None
        if name not in self._ast:
            path = self.modules[name]
            self._ast[name] = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        return self._ast[name]

    # ---- names bound at module level -------------------------------------

    def resolve_relative(self, importer: str, module: Optional[str], level: int) -> str:
        if level == 0:
            return module or ""
        base = importer.split(".")
        if importer not in self.packages:
            base = base[:-1]
        if level > 1:
            base = base[: len(base) - (level - 1)]
        return ".".join(base + ([module] if module else []))

    def _resolve_import_module(self, importer: str, module: str) -> str:
        """Absolute module name, emulating the drop's own sys.path inserts.

        Some drop modules put their own package directory on sys.path and import
        siblings by bare name; when `module` is not a top-level module but is a
        sibling of the importer, that sibling is what runs.
        """
        if self.module_exists(module):
            return module
        package = importer if importer in self.packages else importer.rpartition(".")[0]
        while package:
            candidate = f"{package}.{module}"
            if self.module_exists(candidate):
                return candidate
            package = package.rpartition(".")[0]
        return module

    def bindings(self, name: str) -> Dict[str, List[Binding]]:
        if name in self._bindings:
            return self._bindings[name]
        table: Dict[str, List[Binding]] = {}
        tree = self.tree(name)
        if tree is not None:
            for stmt in _module_level_statements(tree.body):
                for bound, binding in self._bindings_of(name, stmt):
                    table.setdefault(bound, []).append(binding)
        self._bindings[name] = table
        return table

    def _bindings_of(self, module: str, stmt: ast.stmt) -> Iterator[Tuple[str, Binding]]:
        if isinstance(stmt, ast.ClassDef):
            yield stmt.name, Binding("class", stmt.lineno, stmt)
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield stmt.name, Binding("function", stmt.lineno, stmt)
        elif isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                for n in _target_names(target):
                    yield n, Binding("variable", stmt.lineno, stmt)
        elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
            for n in _target_names(stmt.target):
                yield n, Binding("variable", stmt.lineno, stmt)
        elif isinstance(stmt, (ast.For, ast.AsyncFor)):
            for n in _target_names(stmt.target):
                yield n, Binding("variable", stmt.lineno, stmt)
        elif isinstance(stmt, (ast.With, ast.AsyncWith)):
            for item in stmt.items:
                if item.optional_vars is not None:
                    for n in _target_names(item.optional_vars):
                        yield n, Binding("variable", stmt.lineno, stmt)
        elif isinstance(stmt, ast.Import):
            for alias in stmt.names:
                if alias.asname:
                    target = self._resolve_import_module(module, alias.name)
                    yield alias.asname, Binding("import", stmt.lineno, stmt, target, None)
                else:
                    top = alias.name.split(".")[0]
                    yield top, Binding("import", stmt.lineno, stmt, self._resolve_import_module(module, top), None)
        elif isinstance(stmt, ast.ImportFrom):
            source = self.resolve_relative(module, stmt.module, stmt.level)
            if stmt.level == 0 and stmt.module:
                source = self._resolve_import_module(module, stmt.module)
            for alias in stmt.names:
                if alias.name == "*":
                    yield "*", Binding("star", stmt.lineno, stmt, source, "*")
                else:
                    yield alias.asname or alias.name, Binding("import", stmt.lineno, stmt, source, alias.name)

    def all_names(self, module: str) -> List[str]:
        names = set(self.bindings(module))
        names.discard("*")
        prefix = module + "."
        for other in list(self.modules) + sorted(self.packages):
            if other.startswith(prefix) and "." not in other[len(prefix):]:
                names.add(other[len(prefix):])
        return sorted(names)

    # ---- symbol resolution ----------------------------------------------

    def resolve_symbol(self, module: str, name: Optional[str], _seen: Optional[Set[Tuple[str, str]]] = None) -> SymbolResolution:
        """Is `from module import name` satisfied by this drop (name None: `import module`)?"""
        if not self.module_exists(module):
            return SymbolResolution("missing_module", detail=f"no module {module} in the drop")
        if name is None:
            return SymbolResolution("ok", "module", module, 0)
        if name == "*":
            return SymbolResolution("unchecked", detail="star import: names not enumerable statically")
        seen = _seen if _seen is not None else set()
        if (module, name) in seen:
            return SymbolResolution("unchecked", detail=f"import cycle through {module}.{name}")
        seen.add((module, name))

        bindings = self.bindings(module).get(name)
        if bindings:
            # The last module-level binding in source order is what normally wins;
            # prefer a definition over an import when both exist (try/except fallbacks).
            binding = sorted(bindings, key=lambda b: (b.kind != "import", b.lineno))[-1]
            if binding.kind == "import":
                source = binding.source_module or ""
                if not self.module_exists(source) and not self._is_drop_top(source):
                    return SymbolResolution("ok", "external", source, binding.lineno, f"re-exported from {source}")
                if binding.source_name is None:
                    if self.module_exists(source):
                        return SymbolResolution("ok", "module", source, binding.lineno)
                    return SymbolResolution("missing_module", detail=f"{module} imports missing module {source}")
                return self.resolve_symbol(source, binding.source_name, seen)
            return SymbolResolution("ok", binding.kind, module, binding.lineno)

        # `from package import submodule` binds a submodule that is not in the
        # package's __init__ namespace until imported: the import system loads it.
        if module in self.packages and self.module_exists(f"{module}.{name}"):
            return SymbolResolution("ok", "module", f"{module}.{name}", 0)

        for star in self.bindings(module).get("*", []):
            source = star.source_module or ""
            if self.module_exists(source):
                inner = self.resolve_symbol(source, name, seen)
                if inner.status == "ok":
                    return inner
            else:
                return SymbolResolution("unchecked", detail=f"{module} star-imports {source} (outside the drop)")
        if "__getattr__" in self.bindings(module):
            return SymbolResolution("unchecked", detail=f"{module} defines a module __getattr__")
        return SymbolResolution("missing_symbol", detail=f"{module} defines no {name!r}")

    def _is_drop_top(self, module: str) -> bool:
        return module.split(".")[0] in self.top_level_packages()

    # ---- classes and their methods ---------------------------------------

    def find_class(self, module: str, name: str) -> Optional[Tuple[str, ast.ClassDef]]:
        res = self.resolve_symbol(module, name)
        if res.status != "ok" or res.kind != "class":
            return None
        # Match by line in the defining module: a re-export may rename the class
        # (`from .m import A as B`), so the name asked for is not the ClassDef's.
        for bindings in self.bindings(res.module).values():
            for binding in bindings:
                if binding.kind == "class" and binding.lineno == res.lineno and isinstance(binding.node, ast.ClassDef):
                    return res.module, binding.node
        return None

    def find_function(self, module: str, name: str) -> Optional[Tuple[str, ast.FunctionDef]]:
        """The module-level function `module.name` resolves to (following re-exports), or None."""
        res = self.resolve_symbol(module, name)
        if res.status != "ok" or res.kind != "function":
            return None
        for bindings in self.bindings(res.module).values():
            for binding in bindings:
                if binding.kind == "function" and binding.lineno == res.lineno:
                    return res.module, binding.node
        return None

    def base_classes(self, module: str, cls: ast.ClassDef) -> List[Tuple[str, Optional[Tuple[str, ast.ClassDef]]]]:
        """(source text, resolved (module, ClassDef) or None when outside the drop) per base."""
        out = []
        for base in cls.bases:
            text = ast.unparse(base)
            resolved = None
            if isinstance(base, ast.Name):
                resolved = self.find_class(module, base.id)
            elif isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name):
                res = self.resolve_symbol(module, base.value.id)
                if res.status == "ok" and res.kind == "module":
                    resolved = self.find_class(res.module, base.attr)
            out.append((text, resolved))
        return out

    def mro(self, module: str, cls: ast.ClassDef) -> List[Tuple[str, ast.ClassDef]]:
        """C3 linearization over the bases that live in the drop (external bases are dropped)."""

        def linearize(mod: str, node: ast.ClassDef, stack: Tuple[str, ...]) -> List[Tuple[str, ast.ClassDef]]:
            key = f"{mod}.{node.name}"
            if key in stack:
                return [(mod, node)]
            parents = [r for _, r in self.base_classes(mod, node) if r is not None]
            seqs = [linearize(m, n, stack + (key,)) for m, n in parents] + [list(parents)]
            result = [(mod, node)]
            seqs = [list(s) for s in seqs if s]
            while seqs:
                for seq in seqs:
                    head = seq[0]
                    hk = (head[0], head[1].name)
                    if not any(hk in [(m, n.name) for m, n in s[1:]] for s in seqs):
                        break
                else:  # inconsistent hierarchy: fall back to depth-first order
                    head = seqs[0][0]
                    hk = (head[0], head[1].name)
                result.append(head)
                seqs = [[x for x in s if (x[0], x[1].name) != hk] for s in seqs]
                seqs = [s for s in seqs if s]
            return result

        return linearize(module, cls, ())

    def method(self, module: str, cls: ast.ClassDef, name: str) -> Optional[Tuple[str, ast.ClassDef, ast.FunctionDef]]:
        """The first definition of `name` along the class's in-drop MRO."""
        for mod, node in self.mro(module, cls):
            for stmt in node.body:
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
                    return mod, node, stmt
        return None

    def signature(self, module: str, cls: ast.ClassDef, name: str) -> Optional[MethodSignature]:
        """`name` as a caller of the class sees it. A definition that takes *args / **kwargs and hands them on to
        super().<name>(*args, **kwargs) takes what the next definition along the class's MRO takes (recursively),
        with the defaults its body sets by kwargs.setdefault("p", v): the W4A8 kernel's constructor is four
        parameters of its own over the FP8 kernel's, and a parameter the FP8 kernel gains is one it gains too."""
        mro = self.mro(module, cls)
        found = self._method_from(mro, 0, name)
        if found is None:
            return None
        i, mod, owner, func = found
        params = function_params(func)
        forwarded = forwards_to_super(func, name)
        while forwarded:
            nxt = self._method_from(mro, i + 1, name)
            if nxt is None:
                break
            i, _, _, parent = nxt
            params = _merge_forwarded(params, function_params(parent), _setdefaults(func, params))
            func, forwarded = parent, forwards_to_super(parent, name)
        return MethodSignature(
            method=name,
            owner=f"{mod}.{owner.name}",
            lineno=found[3].lineno,
            params=params,
            decorators=tuple(ast.unparse(d) for d in found[3].decorator_list),
        )

    @staticmethod
    def _method_from(mro, start: int, name: str):
        for i in range(start, len(mro)):
            mod, node = mro[i]
            for stmt in node.body:
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
                    return i, mod, node, stmt
        return None


def forwards_to_super(func: ast.FunctionDef, name: str) -> bool:
    """The body calls super().<name>(...) handing on its own *args and/or **kwargs."""
    var = {a.arg for a in (func.args.vararg, func.args.kwarg) if a is not None}
    if not var:
        return False
    for node in ast.walk(func):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == name):
            continue
        target = node.func.value
        if not (isinstance(target, ast.Call) and isinstance(target.func, ast.Name) and target.func.id == "super"):
            continue
        handed = {a.value.id for a in node.args if isinstance(a, ast.Starred) and isinstance(a.value, ast.Name)}
        handed |= {k.value.id for k in node.keywords if k.arg is None and isinstance(k.value, ast.Name)}
        if handed & var:
            return True
    return False


def _setdefaults(func: ast.FunctionDef, params: Sequence[Param]) -> Dict[str, str]:
    """{parameter: default source} the body sets with <kwargs>.setdefault("p", v) before handing kwargs on."""
    kwarg = func.args.kwarg.arg if func.args.kwarg is not None else None
    out: Dict[str, str] = {}
    for node in ast.walk(func):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "setdefault"
                and isinstance(node.func.value, ast.Name) and node.func.value.id == kwarg and len(node.args) == 2
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            out[node.args[0].value] = ast.unparse(node.args[1])
    return out


def _merge_forwarded(own: Sequence[Param], parent: Sequence[Param], defaults: Dict[str, str]) -> Tuple[Param, ...]:
    """own's named parameters, then the parent's the caller reaches through own's *args / **kwargs (positional
    ones first, keyword-only after own's), each parent default replaced by a setdefault of own's body."""
    named = {p.name for p in own if p.kind not in ("var_positional", "var_keyword")}
    takes_args = any(p.kind == "var_positional" for p in own)
    takes_kwargs = any(p.kind == "var_keyword" for p in own)

    def inherited(p: Param) -> Param:
        if p.name in defaults:
            return dataclasses.replace(p, default=defaults[p.name])
        return p

    positional, keyword, tail = [], [], []
    for p in parent:
        if p.name in named:
            continue
        if p.kind in ("positional_only", "positional_or_keyword"):
            if takes_args or (takes_kwargs and p.kind == "positional_or_keyword"):
                positional.append(inherited(p) if takes_args else dataclasses.replace(inherited(p), kind="keyword_only"))
        elif p.kind == "keyword_only" and takes_kwargs:
            keyword.append(inherited(p))
        elif p.kind in ("var_positional", "var_keyword"):
            tail.append(p)
    mine = [p for p in own if p.kind not in ("var_positional", "var_keyword")]
    own_positional = [p for p in mine if p.kind in ("positional_only", "positional_or_keyword")]
    own_keyword = [p for p in mine if p.kind == "keyword_only"]
    return tuple(own_positional + [p for p in positional if p.kind != "keyword_only"] + own_keyword
                 + [p for p in positional if p.kind == "keyword_only"] + keyword + tail)
