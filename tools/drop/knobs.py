"""What a drop accepts for a constructor knob, as far as its source says so.

Two kinds of evidence, both read by AST:
  * hard constraints: a `Literal[...]` annotation on the parameter, or an
    `if <param> not in (<literals>): raise` / `assert <param> in (...)` check in
    the constructor or in a base constructor it forwards the parameter to.
    A value outside such a set is rejected by the kernel: the shim would break.
  * the drop's own heuristic tables (modules named `*heuristic*`): the values
    its tuned configs use for fields named like the constructor's parameters.
    A value found there is known-good; a value found nowhere is "unchecked" --
    neither accepted nor rejected by anything the source states.
"""

from __future__ import annotations

import ast
import dataclasses
from typing import Dict, Iterable, List, Optional, Set, Tuple

from tools.drop.source_model import DropIndex, forwards_to_super, literal_or_none

__all__ = ["Constraint", "KnobVerdict", "freeze", "heuristic_values", "param_constraints", "judge_value"]


def freeze(value):
    """Hashable, order-stable form: lists (JSON, literal_eval) and tuples compare equal."""
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, freeze(v)) for k, v in value.items()))
    if isinstance(value, set):
        return tuple(sorted(freeze(v) for v in value))
    return value


@dataclasses.dataclass(frozen=True)
class Constraint:
    allowed: Optional[Tuple] = None  # value must be one of these
    rejected: Optional[Tuple] = None  # value must not be one of these
    where: str = ""  # "<module>:<line> (<form>)"


@dataclasses.dataclass(frozen=True)
class KnobVerdict:
    status: str  # ok | break | unchecked
    detail: str


def _literal_annotation_values(annotation: Optional[ast.expr]) -> Optional[Tuple]:
    """Values of `Literal[...]` / `typing.Literal[...]`; None if not a pure Literal."""
    if not isinstance(annotation, ast.Subscript):
        return None
    head = annotation.value
    name = head.attr if isinstance(head, ast.Attribute) else getattr(head, "id", None)
    if name != "Literal":
        return None
    inner = annotation.slice
    elts = inner.elts if isinstance(inner, ast.Tuple) else [inner]
    values = []
    for elt in elts:
        ok, value = literal_or_none(elt)
        if not ok:
            return None
        values.append(freeze(value))
    return tuple(values)


def _assigned_before(func: ast.FunctionDef, name: str, lineno: int) -> bool:
    """True when `name` is rebound in `func` before `lineno`: a later check then
    tests the rebound value, not what the caller passed."""
    for node in ast.walk(func):
        targets: Iterable[ast.expr] = ()
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            if isinstance(target, ast.Name) and target.id == name and node.lineno < lineno:
                return True
    return False


def _raises(body: List[ast.stmt]) -> bool:
    return any(isinstance(stmt, ast.Raise) for stmt in body)


def _membership(test: ast.expr, name: str) -> Optional[Tuple[str, Tuple]]:
    """('not in' | 'in', literal values) when `test` is `name [not] in <literal>`."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.left, ast.Name)):
        return None
    if test.left.id != name:
        return None
    ok, values = literal_or_none(test.comparators[0])
    if not ok or not isinstance(values, (tuple, list, set, frozenset)):
        return None
    op = test.ops[0]
    if isinstance(op, ast.NotIn):
        return "not in", tuple(freeze(v) for v in values)
    if isinstance(op, ast.In):
        return "in", tuple(freeze(v) for v in values)
    return None


def _checks_in(func: ast.FunctionDef, name: str, where_module: str) -> List[Constraint]:
    out: List[Constraint] = []
    for node in ast.walk(func):
        # form: how the check reads; allowing: the membership operator that names the accepted values.
        if isinstance(node, ast.If) and _raises(node.body):
            form, allowing = "if {} {} ...: raise", "not in"
        elif isinstance(node, ast.Assert):
            form, allowing = "assert {} {} ...", "in"
        else:
            continue
        found = _membership(node.test, name)
        if found and not _assigned_before(func, name, node.lineno):
            op, values = found
            where = f"{where_module}:{node.lineno} ({form.format(name, op)})"
            if op == allowing:
                out.append(Constraint(allowed=values, where=where))
            else:
                out.append(Constraint(rejected=values, where=where))
    return out


def _forwarded_as(func: ast.FunctionDef, name: str) -> List[str]:
    """Names under which `name` is passed on to `super().__init__` / `Base.__init__`."""
    out = []
    for node in ast.walk(func):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        if node.func.attr != "__init__":
            continue
        if _assigned_before(func, name, node.lineno):
            continue
        for kw in node.keywords:
            if kw.arg and isinstance(kw.value, ast.Name) and kw.value.id == name:
                out.append(kw.arg)
    return out


def param_constraints(index: DropIndex, module: str, cls: ast.ClassDef, param: str) -> List[Constraint]:
    """Hard constraints on `param` of cls.__init__, following keyword forwarding up the MRO."""
    mro = index.mro(module, cls)
    out: List[Constraint] = []
    seen: Set[Tuple[str, str]] = set()

    def visit(start: int, name: str) -> None:
        # The first class at or after `start` in the MRO that defines __init__.
        for i in range(start, len(mro)):
            mod, node = mro[i]
            init = next((s for s in node.body if isinstance(s, ast.FunctionDef) and s.name == "__init__"), None)
            if init is None:
                continue
            key = (f"{mod}.{node.name}", name)
            if key in seen:
                return
            seen.add(key)
            named = False
            for arg in list(init.args.posonlyargs) + list(init.args.args) + list(init.args.kwonlyargs):
                if arg.arg == name:
                    named = True
                    values = _literal_annotation_values(arg.annotation)
                    if values is not None:
                        out.append(Constraint(allowed=values, where=f"{mod}:{arg.lineno} (Literal annotation)"))
            out.extend(_checks_in(init, name, mod))
            for forwarded in _forwarded_as(init, name):
                visit(i + 1, forwarded)
            if not named and forwards_to_super(init, "__init__"):
                visit(i + 1, name)  # reaches the next __init__ through *args / **kwargs
            return

    visit(0, param)
    return out


def heuristic_values(index: DropIndex, package: str) -> Dict[str, Tuple[Set, List[str]]]:
    """{field: (values seen, [modules])} from the package's heuristic-table modules.

    A table is a set of literal calls to a config dataclass, directly or through a
    factory function that maps its own keywords onto dataclass fields
    (`return Config(field=param, ...)`); dataclass field defaults count too.
    Fields are matched to constructor parameters by name only.
    """
    found: Dict[str, Tuple[Set, List[str]]] = {}

    def add(field: str, value, where: str) -> None:
        values, wheres = found.setdefault(field, (set(), []))
        values.add(freeze(value))
        if where not in wheres:
            wheres.append(where)

    for mod in sorted(index.modules):
        if not (mod == package or mod.startswith(package + ".")):
            continue
        leaf = mod.rsplit(".", 1)[-1]
        if "heuristic" not in leaf or leaf.startswith("test_"):
            continue
        tree = index.tree(mod)
        if tree is None:
            continue
        consts = _module_constants(tree)
        dataclasses_: Dict[str, ast.ClassDef] = {
            s.name: s for s in tree.body if isinstance(s, ast.ClassDef) and _is_dataclass(s)
        }
        # A module constant named DEFAULT_<FIELD> is the module's own statement
        # of a default for that field (e.g. DEFAULT_MMA_TILER_MNK).
        fields_ = {
            stmt.target.id
            for cnode in dataclasses_.values()
            for stmt in cnode.body
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
        }
        for field in fields_:
            key = "DEFAULT_" + field.upper()
            if key in consts:
                add(field, consts[key], mod)
        # field defaults
        for cname, cnode in dataclasses_.items():
            for stmt in cnode.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None:
                    ok, value = _literal_with_consts(stmt.value, consts)
                    if ok:
                        add(stmt.target.id, value, mod)
        # factories: def f(*, a, b=...) -> return Config(field=a, ...)
        factories: Dict[str, Dict[str, str]] = {cname: {} for cname in dataclasses_}
        for stmt in tree.body:
            if not isinstance(stmt, ast.FunctionDef):
                continue
            for node in ast.walk(stmt):
                if isinstance(node, ast.Return) and isinstance(node.value, ast.Call):
                    callee = getattr(node.value.func, "id", None)
                    if callee in dataclasses_:
                        mapping = {
                            kw.value.id: kw.arg
                            for kw in node.value.keywords
                            if kw.arg and isinstance(kw.value, ast.Name)
                        }
                        factories[stmt.name] = mapping
                        params = stmt.args.args + stmt.args.kwonlyargs
                        defaults = [None] * (len(stmt.args.args) - len(stmt.args.defaults)) + list(stmt.args.defaults) + list(stmt.args.kw_defaults)
                        for arg, default in zip(params, defaults):
                            if default is not None and arg.arg in mapping:
                                ok, value = _literal_with_consts(default, consts)
                                if ok:
                                    add(mapping[arg.arg], value, mod)
        # table entries: literal calls outside function bodies
        for stmt in tree.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            for node in ast.walk(stmt):
                if not isinstance(node, ast.Call):
                    continue
                callee = getattr(node.func, "id", None)
                if callee not in factories:
                    continue
                mapping = factories[callee]
                for kw in node.keywords:
                    if not kw.arg:
                        continue
                    ok, value = _literal_with_consts(kw.value, consts)
                    if ok:
                        field = kw.arg if callee in dataclasses_ else mapping.get(kw.arg)
                        if field:
                            add(field, value, mod)
    return found


def _is_dataclass(cls: ast.ClassDef) -> bool:
    for dec in cls.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", None)
        if name == "dataclass":
            return True
    return False


def _module_constants(tree: ast.Module) -> Dict[str, object]:
    consts: Dict[str, object] = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            ok, value = literal_or_none(stmt.value)
            if ok:
                consts[stmt.targets[0].id] = value
    return consts


def _literal_with_consts(node: ast.expr, consts: Dict[str, object]):
    if isinstance(node, ast.Name) and node.id in consts:
        return True, consts[node.id]
    return literal_or_none(node)


def judge_value(
    value,
    constraints: List[Constraint],
    table: Optional[Tuple[Set, List[str]]],
    default: Optional[Tuple[object, str]] = None,
) -> KnobVerdict:
    """ok / break / unchecked for one knob value.

    `default` is (literal default, where) of the constructor parameter: the
    value the kernel runs with when the shim passes nothing is accepted by
    definition.
    """
    v = freeze(value)
    for c in constraints:
        if c.allowed is not None and v not in c.allowed:
            return KnobVerdict("break", f"rejected by {c.where}; accepts {list(c.allowed)}")
        if c.rejected is not None and v in c.rejected:
            return KnobVerdict("break", f"rejected by {c.where}")
    allowed_by = [c.where for c in constraints if c.allowed is not None]
    if allowed_by:
        return KnobVerdict("ok", "accepted by " + "; ".join(allowed_by))
    if default is not None and freeze(default[0]) == v:
        return KnobVerdict("ok", f"the constructor's default ({default[1]})")
    if table is not None and v in table[0]:
        return KnobVerdict("ok", "used by the drop's table " + ", ".join(table[1]))
    return KnobVerdict("unchecked", "no Literal, membership check, constructor default or heuristic-table use decides it")
