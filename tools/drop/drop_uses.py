"""The shim's calls into drop functions and its reads of drop objects' attributes, checked against a drop.

The contract (tools/drop/contract.py) follows the kernel classes' constructors and launches. The shim also calls
plain drop functions (the heuristic's `select_heuristic_config`, `token_bucket`) and reads fields of what they return
(`.config.swap_ab`): a new required parameter there fails with a TypeError, a renamed field with an AttributeError,
on every layer of the format, and neither shows in a signature diff of the classes. Both are read by AST, cheaply,
before anything is compiled:

  * calls: each shim call whose callee resolves to a drop function (tools/drop/callsites.py) is bound against that
    function's signature in the new drop: too many positional arguments, a keyword it does not take, a required
    parameter the call does not pass (not judged when the call unpacks *args / **kwargs);
  * attribute reads: inside each shim function, a local bound to a drop object (a drop class called, a drop function
    or method whose return annotation names a drop class, a field or property of such an object whose annotation
    does) has every attribute read on it checked against that class in the new drop (its in-drop MRO: class-body
    names, fields, methods, properties, `self.x = ...` in its methods). `if fmt == ...` branches are followed, so a
    name bound to one class per format is checked per format. A class with a base outside the drop, or with its own
    `__getattr__`, is not judged.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
from typing import Dict, FrozenSet, List, Optional, Set, Tuple

from tools.drop.callsites import Formats, ShimModel, Site, UnitFacts, _guard, _restrict, _Visitor, after_if
from tools.drop.source_model import DropIndex, function_params

__all__ = ["Problem", "call_problems", "attribute_problems"]


@dataclasses.dataclass(frozen=True)
class Problem:
    subject: str
    detail: str
    site: Site


# ---- calls ----------------------------------------------------------------------------------------


def call_problems(model: ShimModel, index: DropIndex) -> List[Problem]:
    out: List[Problem] = []
    seen: Set[Tuple] = set()
    for a in model.arg_sites():
        if a.kind != "call" or a.callee is None or a.callee[1] is None:
            continue
        module, name = a.callee
        found = index.find_function(module, name)
        if found is None:
            continue  # a class (the contract follows its constructor), a variable, or missing (the import rows say)
        fmod, func = found
        key = (a.site.where, module, name)
        if key in seen:
            continue
        seen.add(key)
        for why in _bind(function_params(func, drop_self=False), a.positional, a.names, a.unpacked):
            out.append(Problem(f"{module}.{name}()", f"{why} ({fmod}:{func.lineno})", a.site))
    return out


def _bind(params, positional: int, names, unpacked: bool) -> List[str]:
    """Why a call with `positional` arguments and keywords `names` does not bind to `params` (empty: it binds)."""
    pos = [p for p in params if p.kind in ("positional_only", "positional_or_keyword")]
    var_pos = any(p.kind == "var_positional" for p in params)
    var_kw = any(p.kind == "var_keyword" for p in params)
    by_keyword = {p.name for p in params if p.kind in ("positional_or_keyword", "keyword_only")}
    out = []
    if positional > len(pos) and not var_pos and not unpacked:
        out.append(f"takes {len(pos)} positional argument(s); the shim passes {positional}")
    bound = {p.name for p in pos[:positional]}
    for n in names:
        if n in bound:
            out.append(f"gets {n} both by position and by keyword")
        elif n not in by_keyword and not var_kw:
            close = difflib.get_close_matches(n, sorted(by_keyword), n=1, cutoff=0.6)
            out.append(f"takes no parameter {n}" + (f"; did you mean {close[0]}?" if close else ""))
    if not unpacked:
        missing = [p.name for p in params if p.default is None and p.kind not in ("var_positional", "var_keyword")
                   and p.name not in bound and p.name not in names]
        if missing:
            out.append(f"requires {', '.join(missing)}, which the shim does not pass")
    return out


# ---- attribute reads ----------------------------------------------------------------------------

_TypeKey = Tuple[str, str]  # (module, class name) in the drop
_Types = Dict[_TypeKey, Formats]  # the classes a name may hold, each with the formats it holds it for


class _Classes:
    """Drop classes, their members and the annotations that lead to them."""

    def __init__(self, index: DropIndex):
        self.index = index
        self.nodes: Dict[_TypeKey, ast.ClassDef] = {}
        self._members: Dict[_TypeKey, Optional[FrozenSet[str]]] = {}

    def key(self, found: Optional[Tuple[str, ast.ClassDef]]) -> Optional[_TypeKey]:
        if found is None:
            return None
        key = (found[0], found[1].name)
        self.nodes[key] = found[1]
        return key

    def annotation(self, module: str, node: Optional[ast.expr]) -> Optional[_TypeKey]:
        """The drop class an annotation in `module` names (Optional[X] and X | None count as X)."""
        if node is None:
            return None
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                node = ast.parse(node.value, mode="eval").body
            except SyntaxError:
                return None
        if isinstance(node, ast.Subscript) and getattr(node.value, "id", getattr(node.value, "attr", None)) == "Optional":
            return self.annotation(module, node.slice)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            sides = [n for n in (node.left, node.right) if not (isinstance(n, ast.Constant) and n.value is None)]
            return self.annotation(module, sides[0]) if len(sides) == 1 else None
        if isinstance(node, ast.Name):
            return self.key(self.index.find_class(module, node.id))
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            res = self.index.resolve_symbol(module, node.value.id)
            if res.status == "ok" and res.kind == "module":
                return self.key(self.index.find_class(res.module, node.attr))
        return None

    def member_type(self, key: _TypeKey, attr: str) -> Optional[_TypeKey]:
        """The class of `obj.attr` for an instance of `key`: an annotated field, or a property's return."""
        for mod, node in self.index.mro(key[0], self.nodes[key]):
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == attr:
                    return self.annotation(mod, stmt.annotation)
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == attr:
                    if any(getattr(d, "id", None) == "property" for d in stmt.decorator_list):
                        return self.annotation(mod, stmt.returns)
                    return None
        return None

    def method_return(self, key: _TypeKey, attr: str) -> Optional[_TypeKey]:
        found = self.index.method(key[0], self.nodes[key], attr)
        return self.annotation(found[0], found[2].returns) if found else None

    def members(self, key: _TypeKey) -> Optional[FrozenSet[str]]:
        """Every attribute an instance has by the drop's source, or None when the source cannot say."""
        if key in self._members:
            return self._members[key]
        names: Set[str] = set()
        known = True
        for mod, node in self.index.mro(key[0], self.nodes[key]):
            bases = self.index.base_classes(mod, node)
            if any(resolved is None and text != "object" for text, resolved in bases):
                known = False
            for stmt in node.body:
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(stmt.name)
                elif isinstance(stmt, ast.Assign):
                    names |= {t.id for t in stmt.targets if isinstance(t, ast.Name)}
                elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    names.add(stmt.target.id)
            for sub in ast.walk(node):
                if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) and getattr(sub.value, "id", None) == "self":
                    names.add(sub.attr)
                elif (isinstance(sub, ast.Call) and getattr(sub.func, "id", getattr(sub.func, "attr", None))
                      in ("setattr", "__setattr__") and len(sub.args) >= 2 and isinstance(sub.args[-2], ast.Constant)):
                    names.add(str(sub.args[-2].value))
        if names & {"__getattr__", "__getattribute__"}:
            known = False
        self._members[key] = frozenset(names) if known else None
        return self._members[key]


class _Reads:
    """One shim function: the drop classes its locals hold, and the attribute reads on them."""

    def __init__(self, model: ShimModel, classes: _Classes, resolver: _Visitor, file: str, unit: str,
                 out: List[Problem]):
        self.m = model
        self.classes = classes
        self.resolver = resolver
        self.file = file
        self.unit = unit
        self.out = out
        self.seen: Set[Tuple[int, str, _TypeKey]] = set()

    # -- what an expression holds
    def types(self, node: ast.expr, env: Dict[str, _Types], formats: Formats) -> _Types:
        if isinstance(node, ast.Name):
            return env.get(node.id, {})
        if isinstance(node, ast.Call):
            ref = self.resolver.resolve_expr(node.func)
            if ref is not None and ref[0] == "kernel" and ref[2] is not None:
                index = self.classes.index
                key = self.classes.key(index.find_class(ref[1], ref[2]))
                if key is None:
                    fn = index.find_function(ref[1], ref[2])
                    key = self.classes.annotation(fn[0], fn[1].returns) if fn else None
                return {key: formats} if key else {}
            if isinstance(node.func, ast.Attribute):
                return self._each(node.func.value, env, formats, lambda k: self.classes.method_return(k, node.func.attr))
            return {}
        if isinstance(node, ast.Attribute):
            return self._each(node.value, env, formats, lambda k: self.classes.member_type(k, node.attr))
        return {}

    def _each(self, base: ast.expr, env, formats, step) -> _Types:
        out: _Types = {}
        for key, fmts in self.types(base, env, formats).items():
            nxt = step(key)
            if nxt is not None:
                out[nxt] = fmts
        return out

    # -- reads
    def check(self, node: ast.AST, env: Dict[str, _Types], formats: Formats) -> None:
        for sub in ast.walk(node):
            attr, base = None, None
            if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Load):
                attr, base = sub.attr, sub.value
            elif (isinstance(sub, ast.Call) and getattr(sub.func, "id", None) == "getattr"
                  and len(sub.args) == 2 and isinstance(sub.args[1], ast.Constant)):
                attr, base = str(sub.args[1].value), sub.args[0]  # getattr(obj, "x") with no default
            if attr is None or attr.startswith("__"):
                continue
            for key, fmts in self.types(base, env, formats).items():
                members = self.classes.members(key)
                if members is None or attr in members or (sub.lineno, attr, key) in self.seen:
                    continue
                self.seen.add((sub.lineno, attr, key))
                close = difflib.get_close_matches(attr, sorted(n for n in members if not n.startswith("_")), n=1)
                where = f"{key[0]}:{self.classes.nodes[key].lineno}"
                self.out.append(Problem(
                    f"{key[0]}.{key[1]}.{attr}",
                    f"the shim reads .{attr} of a {key[1]}, which has no such attribute in this drop ({where})"
                    + (f"; did you mean {close[0]}?" if close else ""),
                    Site(self.file, sub.lineno, self.unit, fmts)))

    # -- statements, in order, following format branches
    def run(self, body: List[ast.stmt], env: Dict[str, _Types], formats: Formats) -> Dict[str, _Types]:
        for stmt in body:
            if formats is not None and not formats:
                return env
            if isinstance(stmt, ast.If):
                self.check(stmt.test, env, formats)
                g = _guard(stmt.test, self.m.known_formats)
                on, off = formats, formats
                if g is not None:
                    values, positive = g
                    known = self.m.known_formats
                    on = _restrict(formats, values if positive else known - values)
                    off = _restrict(formats, known - values if positive else values)
                a = self.run(stmt.body, {k: dict(v) for k, v in env.items()}, on)
                b = self.run(stmt.orelse, {k: dict(v) for k, v in env.items()}, off)
                env = {k: {**a.get(k, {}), **b.get(k, {})} for k in set(a) | set(b)}
                formats = after_if(stmt, formats, self.m.known_formats)
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
                self.check(stmt.value, env, formats)
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                held = self.types(stmt.value, env, formats)
                for t in targets:
                    if isinstance(t, ast.Name):
                        env[t.id] = held
                    else:
                        self.check(t, env, formats)
            elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue  # nested definitions: not followed
            else:  # loops, with, try, return, expressions: their expressions checked, their bodies run in order
                for _, value in ast.iter_fields(stmt):
                    values = value if isinstance(value, list) else [value]
                    if values and isinstance(values[0], ast.stmt):
                        env = self.run(values, env, formats)
                        continue
                    for v in values:
                        if isinstance(v, ast.excepthandler):
                            env = self.run(v.body, env, formats)
                        elif isinstance(v, ast.AST):
                            self.check(v, env, formats)
        return env


def attribute_problems(model: ShimModel, index: DropIndex) -> List[Problem]:
    classes = _Classes(index)
    out: List[Problem] = []
    for unit in model.all_units():
        module, _, name = unit.partition(":")
        mod = model.module(module)
        node = mod.defs.get(name) if mod is not None and name else None
        if node is None:
            continue
        functions = [node] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else [
            s for s in getattr(node, "body", []) if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))]
        resolver = _Visitor(model, mod, unit, UnitFacts())
        for func in functions:
            _Reads(model, classes, resolver, mod.rel, unit, out).run(func.body, {}, None)
    return out
