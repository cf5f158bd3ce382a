"""Source-level layering check: Python can reach a kernel tree around Bazel's
visibility (sys.path, importlib), so every module of the repo is scanned.

Rules:
  1. Only modules under shim/ name kernel top-level modules (import, from-import,
     importlib.import_module / __import__ / importlib.util.find_spec /
     runpy.run_module with a literal, or an import inside a literal given to
     exec / eval / compile) or put a kernel tree on sys.path. `common` and `src`
     are kernel names here, so the repo itself must have no top-level package by
     those (or any other kernel) names.
  2. moe_ep (the ground floor: core, formats, reference, testing, ...) imports neither shim nor tools nor
     a kernel tree, even lazily.
  3. No module imports both trees: not shim.sm90 and shim.sm100 together, and
     not the Hopper-only and Blackwell-only kernel packages together.
  4. shim/sm90 never reaches the Blackwell side (shim.sm100 or sm100-only kernel
     packages) and shim/sm100 never the Hopper side; shim/common, being
     tree-agnostic, names only kernel packages both trees have.
  5. Outside shim/, no computed import (`computed-import`): import_module /
     __import__ / find_spec / run_module with a name that is not a literal, a
     module loaded from a computed path (spec_from_file_location, *FileLoader,
     runpy.run_path), exec / eval / compile of computed code. A name whose literal
     head fixes a non-kernel package (f"moe_ep.{x}", "shim." + x) is fine. The
     known dispatchers are allow-listed by call site in COMPUTED_IMPORT_ALLOWED,
     with the reason; a changed call is a new call and is flagged again.
  6. Outside shim/, no sys.path mutation in any form (`sys-path`, or
     `kernel-path` when it names a kernel tree): insert / append / extend / remove /
     pop / clear / sort / reverse, item and slice assignment (`sys.path[:0] = ...`),
     `sys.path = ...`, `+=`, `del`, setattr(sys, "path", ...), the same through an
     alias (`p = sys.path`, `from sys import path`), site.addsitedir. Allow-listed
     call sites: SYS_PATH_ALLOWED.
  7. Outside shim/ and PYTHONPATH_WRITERS, no write of PYTHONPATH into an environment
     (`pythonpath`: env["PYTHONPATH"] = ..., dict(os.environ, PYTHONPATH=...),
     .update / .setdefault / os.putenv, {"PYTHONPATH": ...}) except forwarding
     this interpreter's own path unchanged: os.pathsep.join(sys.path) or a
     filtered comprehension over sys.path (a child then sees nothing new).
  8. A module name is whatever its string expression evaluates to: concatenations, f-strings, `%`,
     "".join of literals and module-level string constants are folded before any rule looks at them
     (`"moe_hopper" + "_fp8"` is `moe_hopper_fp8`), and an importer is whatever name it is bound to
     (`from importlib import import_module as im`, `load = importlib.import_module`, `imp = __import__`,
     `getattr(importlib, "import_module")`, `builtins.__dict__["__import__"]`).
  9. A file holding an allow-listed dispatcher (COMPUTED_IMPORT_ALLOWED) names no kernel module in any
     string (`kernel-name`): what such a call imports is data of the same file (a parametrize list, a
     registration), and the allow-list would otherwise pass a kernel name fed to it.
Files exempt from rules 1 and 5-9 (tests that bypass on purpose): EXEMPT_FILES.
What stays out of reach of a source scan: code in a string run by a child
interpreter (`python -c CODE`); strings are data here. At run time
shim/common/tree.py refuses any kernel module that does not come from the one
verified tree root, whatever imported it.
The Bazel graph has its own check (a query test); this one covers what Python
can do that Bazel does not see.
"""

from __future__ import annotations

import ast
import dataclasses
import textwrap
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

from shim.common.tree_facts import DROP_PACKAGES as _DROP_ONLY
from shim.common.tree_facts import KERNEL_NAMES, TREES

__all__ = ["Violation", "check_layering", "main"]

SM90_ONLY = frozenset(TREES["sm90"].packages) - frozenset(TREES["sm100"].packages)
SM100_ONLY = frozenset(TREES["sm100"].packages) - frozenset(TREES["sm90"].packages)
SHARED = frozenset(TREES["sm90"].packages) & frozenset(TREES["sm100"].packages)

# Strings that mark a sys.path entry as a kernel tree.
_TREE_MARKERS = ("kernel_src", "cutedsl_megamoe", "pull_style_cutedsl_megakernel", "MOE_EP_SM90_TREE", "MOE_EP_SM100_TREE")

_SKIP_DIRS = {"__pycache__", "node_modules"}

# Computed imports outside shim/ that are allowed: (file, the call as ast.unparse prints it) -> why. Each
# dispatcher below loads names handed to it; what guards it: every "module:attr" literal outside shim/ (the
# form both take) is checked not to name a kernel module (rule `kernel-target`), and at run time the tree guard
# (shim/common/tree.py) refuses any kernel module from outside the one verified tree root.
COMPUTED_IMPORT_ALLOWED: Dict[Tuple[str, str], str] = {
    ("moe_ep/core/registry.py", "importlib.import_module(module)"):
        "the backend registry resolves registered 'module:attr' targets (kernel-target rule on every literal)",
    ("moe_ep/core/registry.py", "importlib.util.find_spec(name)"):
        "the backend registry asks whether a registered target's top-level package is installed",
    ("moe_ep/core/registry.py", "importlib.machinery.PathFinder.find_spec(name, path)"):
        "the backend registry finds a registered target's submodules on their parents' paths, importing nothing",
    ("tools/launch/worker.py", "importlib.import_module(mod_name)"):
        "the launcher's rank worker loads its 'module:attr' target (kernel-target rule on every literal)",
    ("tools/launch/worker.py",
     "importlib.util.spec_from_file_location(f'_moe_ep_rank_target_{Path(mod_name).stem}', mod_name)"):
        "the launcher's rank worker loads a target given as a file path (a test or tool of this repo, itself scanned)",
    ("tests/foundation/python_env_test.py", "__import__(module)"):
        "imports the locked runtime packages named in its parametrize list (numpy, cutlass, cuda.bindings, nvshmem)",
    ("tests/moe_ep/fault_matrix_test.py", "importlib.util.spec_from_file_location('fault_cases', CASES)"):
        "loads its sibling fault_cases.py by file path (a test module of this repo, itself scanned), which the "
        "launcher's rank processes import the same way",
    ("moe_ep/split/torch_engine.py", "importlib.import_module(KERNELS[name])"):
        "the split torch engine's optional kernels, by the lazy strings of its KERNELS table (shim.sm90.split_kernels: "
        "a shim module, never a kernel package)",
    ("moe_ep/split/engine.py", "importlib.import_module(module)"):
        "the split path's engine table resolves its literal 'module:attr' entries (ENGINES: moe_ep and shim modules, "
        "named by lazy strings as the backend registry names kernel backends)",
    ("tools/launch/launcher.py", "runpy.run_module(argv[1], run_name='__main__', alter_sys=True)"):
        "a forked CPU rank runs the module its launch was given (`-m module`), as `python -m` would: a test or tool "
        "of this repo, itself scanned; the tree guard refuses kernel modules from anywhere else at run time",
    ("tools/launch/launcher.py", "runpy.run_path(argv[0], run_name='__main__')"):
        "a forked CPU rank runs the file its launch was given (`script.py`), as `python script.py` would: a test or "
        "tool of this repo, itself scanned; the tree guard refuses kernel modules from anywhere else at run time",
}

# sys.path mutations outside shim/ that are allowed: (file, the statement or call as ast.unparse prints it) -> why.
SYS_PATH_ALLOWED: Dict[Tuple[str, str], str] = {
    ("tools/bench/fi_megamoe.py", "sys.path.insert(0, str(root))"):
        "the FlashInfer comparison bench puts FlashInfer's own package (its bundle) on the path of its own process, "
        "on a GPU host; its kernel_src copies are drop packages under another name, which the tree guard refuses "
        "next to ours",
    ("tools/launch/launcher.py", "sys.path.insert(0, os.getcwd())"):
        "a forked CPU rank's sys.path[0] for `-m module`, what `python -m` puts there (the working directory)",
    ("tools/launch/launcher.py", "sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))"):
        "a forked CPU rank's sys.path[0] for `script.py`, what `python script.py` puts there (the script's folder)",
}

# Files outside shim/ that rules 1 and 5-7 leave alone, each with the reason: tests whose job is to get around
# the layering on purpose, to prove the run-time tree guard catches what this scan cannot.
EXEMPT_FILES: Dict[str, str] = {
    "tests/shim/common/tree_integrity_test.py":
        "the tree guard's own test: it imports kernel names from stand-in trees and edits sys.path by hand, "
        "in-process, to prove shim/common/tree.py refuses a second root and an unverified tree",
}

# Where writing PYTHONPATH into a child's environment is the job, with the reason.
PYTHONPATH_WRITERS: Dict[str, str] = {
    "tools/launch": "the GPU launcher: its ranks import what the caller's process imports",
    "tools/drop/build_stage.py": "the drop audit's build children: it takes every kernel tree out of the launcher's "
                                 "PYTHONPATH (bazel run's binary carries both pinned trees) and puts the checkout "
                                 "first, so the one tree a child holds is the candidate its variable names",
    "tests/tools/drop/build_plan_test.py": "the test of that: a launcher's environment, as data handed to "
                                           "build_stage.child_env (no process starts with it)",
}

# name -> (positional index, keyword) of the argument that names a module / a file to load.
_IMPORT_CALLS = {"import_module": (0, "name"), "__import__": (0, "name"), "find_spec": (0, "name"),
                 "run_module": (0, "mod_name")}
_PATH_LOAD_CALLS = {"spec_from_file_location": (1, "location"), "SourceFileLoader": (1, "path"),
                    "SourcelessFileLoader": (1, "path"), "ExtensionFileLoader": (1, "path"),
                    "run_path": (0, "path_name")}
_CODE_CALLS = {"exec": (0, "source"), "eval": (0, "source"), "compile": (0, "source")}  # builtins only
_IMPORTERS = frozenset(_IMPORT_CALLS) | frozenset(_PATH_LOAD_CALLS)
_PATH_MUTATORS = {"insert", "append", "extend", "remove", "pop", "clear", "sort", "reverse", "__setitem__",
                  "__delitem__", "__iadd__"}


@dataclasses.dataclass(frozen=True)
class Violation:
    file: str
    line: int
    rule: str
    detail: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: [{self.rule}] {self.detail}"


def _python_files(repo_root: Path) -> Iterator[Path]:
    for path in sorted(repo_root.rglob("*.py")):
        rel = path.relative_to(repo_root)
        if any(p.startswith(".") or p.startswith("bazel-") or p in _SKIP_DIRS for p in rel.parts[:-1]):
            continue
        yield path


def _module_name(rel: Path) -> Tuple[str, bool]:
    parts = list(rel.with_suffix("").parts)
    is_pkg = parts[-1] == "__init__"
    if is_pkg:
        parts = parts[:-1]
    return ".".join(parts), is_pkg


def _call_name(func: ast.expr, aliases: Optional[Dict[str, str]] = None) -> Optional[str]:
    """The importer a call's callee is: its attribute or name, through the file's aliases, `getattr(x, "name")`
    and `x.__dict__["name"]` / `vars(x)["name"]`."""
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return (aliases or {}).get(func.id, func.id)
    if (isinstance(func, ast.Call) and getattr(func.func, "id", None) == "getattr" and len(func.args) >= 2
            and isinstance(func.args[1], ast.Constant) and isinstance(func.args[1].value, str)):
        return func.args[1].value
    if isinstance(func, ast.Subscript) and isinstance(func.slice, ast.Constant) and isinstance(func.slice.value, str):
        return func.slice.value
    return None




def _aliases(tree: ast.Module) -> Dict[str, str]:
    """{local name: importer} for the file's other names of an importer (from-import `as`, assignment)."""
    out: Dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for a in node.names:
                if a.name in _IMPORTERS and a.asname:
                    out[a.asname] = a.name
    for _ in range(2):  # f = importlib.import_module; g = f
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                name = _call_name(node.value, out) if isinstance(node.value, (ast.Attribute, ast.Name, ast.Call,
                                                                               ast.Subscript)) else None
                if isinstance(node.value, ast.Call) and getattr(node.value.func, "id", None) != "getattr":
                    name = None  # the result of a call is not the callee
                if name in _IMPORTERS:
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    out.update({t.id: name for t in targets if isinstance(t, ast.Name)})
    return out


def _constants(tree: ast.Module) -> Dict[str, str]:
    """Module-level names bound once to a string the file spells out (folded)."""
    counts: Dict[str, int] = {}
    values: Dict[str, ast.expr] = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign):
            for t in stmt.targets:
                if isinstance(t, ast.Name):
                    counts[t.id] = counts.get(t.id, 0) + 1
                    values[t.id] = stmt.value
    out: Dict[str, str] = {}
    for _ in range(3):  # A = "x"; B = A + "y"
        for name, value in values.items():
            if counts[name] == 1 and name not in out:
                folded = _fold(value, out)
                if folded is not None:
                    out[name] = folded
    return out


def _fold(node: Optional[ast.expr], consts: Optional[Dict[str, str]] = None) -> Optional[str]:
    """The string an expression always evaluates to, when the file spells it out; else None."""
    consts = consts or {}
    if node is None:
        return None
    if isinstance(node, ast.Constant):
        return node.value if isinstance(node.value, str) else None
    if isinstance(node, ast.Name):
        return consts.get(node.id)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _fold(node.left, consts), _fold(node.right, consts)
        return left + right if left is not None and right is not None else None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
        left = _fold(node.left, consts)
        items = node.right.elts if isinstance(node.right, ast.Tuple) else [node.right]
        parts = [_fold(e, consts) for e in items]
        if left is None or any(p is None for p in parts):
            return None
        try:
            return left % tuple(parts)
        except (TypeError, ValueError):
            return None
    if isinstance(node, ast.JoinedStr):
        out = ""
        for part in node.values:
            if isinstance(part, ast.FormattedValue):
                if part.conversion not in (-1, 115) or part.format_spec is not None:
                    return None
                part = part.value
            folded = _fold(part, consts)
            if folded is None:
                return None
            out += folded
        return out
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "join"
            and len(node.args) == 1 and isinstance(node.args[0], (ast.List, ast.Tuple)) and not node.keywords):
        sep = _fold(node.func.value, consts)
        parts = [_fold(e, consts) for e in node.args[0].elts]
        return None if sep is None or any(p is None for p in parts) else sep.join(parts)
    return None


def _call_arg(node: ast.Call, index: int, keyword: str) -> Optional[ast.expr]:
    if len(node.args) > index and not any(isinstance(a, ast.Starred) for a in node.args[: index + 1]):
        return node.args[index]
    for kw in node.keywords:
        if kw.arg == keyword:
            return kw.value
    return None


def _literal(node: Optional[ast.expr]) -> Optional[str]:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _leading_literal(node: ast.expr) -> Tuple[str, bool]:
    """The literal text a str expression starts with, and whether that is all of it."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value, True
    if isinstance(node, ast.JoinedStr):
        text = ""
        for part in node.values:
            if not (isinstance(part, ast.Constant) and isinstance(part.value, str)):
                return text, False
            text += part.value
        return text, True
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, whole = _leading_literal(node.left)
        if not whole:
            return left, False
        right, whole = _leading_literal(node.right)
        return left + right, whole
    return "", False


@dataclasses.dataclass
class _Source:
    """One parsed file with what names its importers and which strings it spells out."""
    tree: ast.Module
    aliases: Dict[str, str]
    consts: Dict[str, str]

    @classmethod
    def of(cls, tree: ast.Module) -> "_Source":
        return cls(tree, _aliases(tree), _constants(tree))

    def fold(self, node: Optional[ast.expr]) -> Optional[str]:
        return _fold(node, self.consts)

    def name(self, call: ast.Call) -> Optional[str]:
        return _call_name(call.func, self.aliases)


def _code_calls(src: "_Source", tree: Optional[ast.AST] = None) -> Iterator[Tuple[ast.Call, str]]:
    """Calls that import or run code by name, path or source: (call, kind) with kind import / path / code."""
    for node in ast.walk(tree if tree is not None else src.tree):
        if not isinstance(node, ast.Call):
            continue
        name = src.name(node)
        if name in _IMPORT_CALLS:
            yield node, "import"
        elif name in _PATH_LOAD_CALLS:
            yield node, "path"
        elif name in _CODE_CALLS and isinstance(node.func, ast.Name):
            yield node, "code"


def _parse_literal_code(text: str) -> Optional[ast.Module]:
    try:
        return ast.parse(textwrap.dedent(text))
    except (SyntaxError, ValueError):
        return None


def _imports(src: _Source, module: str, is_pkg: bool, line: Optional[int] = None,
             tree: Optional[ast.Module] = None) -> Iterator[Tuple[int, str, str]]:
    """(line, absolute module, how) for every import-like statement in the file (and in literal code it runs
    through exec / eval / compile; `line` then pins them to the call)."""
    tree = tree if tree is not None else src.tree
    for node in ast.walk(tree):
        at = line or getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield at, alias.name, "import"
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                base = node.module or ""
            else:
                pkg = module.split(".") if is_pkg else module.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)] if node.level > 1 else pkg
                base = ".".join(pkg + ([node.module] if node.module else []))
            yield at, base, "from"
            # `from shim import sm90` reaches shim.sm90 as well.
            for alias in node.names:
                if alias.name != "*":
                    yield at, f"{base}.{alias.name}" if base else alias.name, "from"
    for node, kind in _code_calls(src, tree):
        at = line or node.lineno
        if kind == "import":
            name = src.fold(_call_arg(node, *_IMPORT_CALLS[src.name(node)]))
            if name and not name.startswith("."):
                yield at, name, "dynamic"
        elif kind == "code":
            code = _parse_literal_code(src.fold(_call_arg(node, *_CODE_CALLS[node.func.id])) or "")
            if code is not None:
                yield from _imports(src, module, is_pkg, at, code)


def _computed_imports(src: _Source, kernel: Set[str]) -> Iterator[Tuple[int, str, str]]:
    """(line, call source, what) for each import / load / exec whose target is computed."""
    for node, kind in _code_calls(src):
        name = src.name(node)
        if kind == "import":
            arg = _call_arg(node, *_IMPORT_CALLS[name])
            if arg is not None and src.fold(arg) is not None:
                continue  # spelled out in the file: _imports names it
            head, _ = _leading_literal(arg) if arg is not None else ("", False)
            top = head.split(".")[0]
            if "." in head and top.isidentifier() and top not in kernel:
                continue  # the literal head fixes a package of this repo or a library, never a kernel one
            yield node.lineno, ast.unparse(node), f"{name}() of a computed module name"
        elif kind == "path":
            if src.fold(_call_arg(node, *_PATH_LOAD_CALLS[name])) is None:
                yield node.lineno, ast.unparse(node), f"{name}() of a computed path"
        elif src.fold(_call_arg(node, *_CODE_CALLS[name])) is None:
            yield node.lineno, ast.unparse(node), f"{name}() of computed code"


def _kernel_paths(src: _Source) -> Iterator[Tuple[int, str]]:
    """Modules loaded from a spelled-out path inside a kernel tree (spec_from_file_location, run_path, ...)."""
    for node, kind in _code_calls(src):
        if kind == "path":
            path = src.fold(_call_arg(node, *_PATH_LOAD_CALLS[src.name(node)])) or ""
            if any(m in path for m in _TREE_MARKERS):
                yield node.lineno, ast.unparse(node)


class _SysPath:
    """Which expressions of one file denote sys.path (aliases of sys and of its path list included)."""

    def __init__(self, tree: ast.Module):
        self.sys_names = {"sys"}
        self.path_names: Set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                self.sys_names |= {a.asname for a in node.names if a.name == "sys" and a.asname}
            elif isinstance(node, ast.ImportFrom) and node.module == "sys" and node.level == 0:
                self.path_names |= {a.asname or a.name for a in node.names if a.name == "path"}
        for _ in range(2):  # p = sys.path; q = p
            for node in ast.walk(tree):
                if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and self.is_path(node.value):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    self.path_names |= {t.id for t in targets if isinstance(t, ast.Name)}

    def is_sys(self, node: ast.expr) -> bool:
        return isinstance(node, ast.Name) and node.id in self.sys_names

    def is_path(self, node: ast.expr) -> bool:
        if isinstance(node, ast.Attribute) and node.attr == "path" and self.is_sys(node.value):
            return True
        if isinstance(node, ast.Name) and node.id in self.path_names:
            return True
        if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and len(node.args) >= 2
                and self.is_sys(node.args[0]) and _literal(node.args[1]) == "path"):
            return True
        if isinstance(node, ast.Subscript) and _literal(node.slice) == "path":  # sys.__dict__["path"], vars(sys)[...]
            inner = node.value
            return ((isinstance(inner, ast.Attribute) and inner.attr == "__dict__" and self.is_sys(inner.value))
                    or (isinstance(inner, ast.Call) and getattr(inner.func, "id", None) == "vars"
                        and inner.args and self.is_sys(inner.args[0])))
        return False

    def is_rebinding(self, target: ast.expr) -> bool:
        """An assignment target that changes sys.path: `sys.path = ...`, `sys.path[...] = ...`, `p[...] = ...`."""
        if isinstance(target, ast.Attribute) and target.attr == "path" and self.is_sys(target.value):
            return True
        if isinstance(target, ast.Subscript) and self.is_path(target.value):
            return True
        if isinstance(target, (ast.Tuple, ast.List)):
            return any(self.is_rebinding(t) for t in target.elts)
        if isinstance(target, ast.Starred):
            return self.is_rebinding(target.value)
        return False


def _path_edits(tree: ast.Module) -> Iterator[Tuple[int, str, str]]:
    """(line, source, rule) for every sys.path mutation; rule kernel-path when it names a kernel tree."""
    sp = _SysPath(tree)
    for node in ast.walk(tree):
        hit: Optional[ast.AST] = None
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in _PATH_MUTATORS and sp.is_path(func.value):
                hit = node
            elif _call_name(func) == "addsitedir":
                hit = node
            elif (getattr(func, "id", None) == "setattr" and len(node.args) >= 2 and sp.is_sys(node.args[0])
                  and _literal(node.args[1]) == "path"):
                hit = node
        elif isinstance(node, ast.Assign) and any(sp.is_rebinding(t) for t in node.targets):
            hit = node
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and (
                sp.is_rebinding(node.target) or (isinstance(node, ast.AugAssign) and sp.is_path(node.target))):
            hit = node
        elif isinstance(node, ast.Delete) and any(sp.is_rebinding(t) for t in node.targets):
            hit = node
        if hit is not None:
            text = ast.unparse(hit)
            yield hit.lineno, text, "kernel-path" if any(m in text for m in _TREE_MARKERS) else "sys-path"


def _forwards_own_path(value: Optional[ast.expr], sp: _SysPath) -> bool:
    """os.pathsep.join(sys.path) or os.pathsep.join(p for p in sys.path if ...): this interpreter's path as is."""
    if not (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "join"
            and ast.unparse(value.func.value) == "os.pathsep" and len(value.args) == 1 and not value.keywords):
        return False
    arg = value.args[0]
    if sp.is_path(arg):
        return True
    if isinstance(arg, (ast.ListComp, ast.GeneratorExp)) and len(arg.generators) == 1:
        gen = arg.generators[0]
        return (sp.is_path(gen.iter) and isinstance(gen.target, ast.Name) and isinstance(arg.elt, ast.Name)
                and arg.elt.id == gen.target.id)
    return False


def _pythonpath_writes(tree: ast.Module) -> Iterator[Tuple[int, str]]:
    """(line, source) for every write of PYTHONPATH into an environment mapping, except plain forwarding."""
    sp = _SysPath(tree)
    for node in ast.walk(tree):
        value: Optional[ast.expr] = None
        hit = False
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Subscript) and _literal(t.slice) == "PYTHONPATH" for t in targets):
                hit, value = True, (node.value if isinstance(node, ast.Assign) else None)
        elif isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg == "PYTHONPATH":
                    hit, value = True, kw.value
            name = _call_name(node.func)
            if name in ("putenv", "setdefault") and len(node.args) >= 2 and _literal(node.args[0]) == "PYTHONPATH":
                hit, value = True, node.args[1]
        elif isinstance(node, ast.Dict):
            for key, val in zip(node.keys, node.values):
                if _literal(key) == "PYTHONPATH":
                    hit, value = True, val
        if hit and not _forwards_own_path(value, sp):
            yield node.lineno, ast.unparse(node)


def _strings(src: _Source) -> Iterator[Tuple[int, str]]:
    """(line, value) of every string expression the file spells out (literals, and what folds to a string: each
    concatenation once, as a whole)."""
    seen: Set[Tuple[int, str]] = set()
    for node in ast.walk(src.tree):
        if isinstance(node, (ast.Constant, ast.BinOp, ast.JoinedStr, ast.Call)):
            text = src.fold(node)
            if text is not None and (node.lineno, text) not in seen:
                seen.add((node.lineno, text))
                yield node.lineno, text


def _is_module_name(text: str, kernel: Set[str]) -> bool:
    return bool(text) and all(p.isidentifier() for p in text.split(".")) and text.split(".")[0] in kernel


def _kernel_targets(src: _Source, kernel: Set[str]) -> Iterator[Tuple[int, str]]:
    """'module:attr' strings (what the registry and the launcher resolve) naming a kernel module."""
    for line, text in _strings(src):
        if text.count(":") != 1:
            continue
        mod, attr = text.split(":")
        if attr.isidentifier() and _is_module_name(mod, kernel):
            yield line, text


def _kernel_names(src: _Source, kernel: Set[str]) -> Iterator[Tuple[int, str]]:
    """Strings that are a kernel module's name (for the files of the allow-listed dispatchers)."""
    for line, text in _strings(src):
        if (_is_module_name(text, kernel) and "." in text) or text in _DROP_ONLY:
            yield line, text


def _top(name: str) -> str:
    return name.split(".")[0]


def _under(rel: Path, prefix: str) -> bool:
    return rel.as_posix() == prefix or rel.as_posix().startswith(prefix + "/")


def check_layering(repo_root: Path, kernel_names: Optional[Set[str]] = None) -> List[Violation]:
    repo_root = Path(repo_root)
    kernel = set(kernel_names or KERNEL_NAMES)
    out: List[Violation] = []

    for name in sorted(kernel):
        for candidate in (repo_root / name, repo_root / f"{name}.py"):
            if candidate.exists():
                out.append(Violation(candidate.name, 0, "shadow", f"top-level `{name}` shadows a kernel package name"))

    for path in _python_files(repo_root):
        rel = path.relative_to(repo_root)
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except SyntaxError as error:
            out.append(Violation(rel.as_posix(), error.lineno or 0, "syntax", str(error)))
            continue
        module, is_pkg = _module_name(rel)
        in_shim = _under(rel, "shim")
        src = _Source.of(tree)
        imports = list(_imports(src, module, is_pkg))
        f = rel.as_posix()

        kernel_hits = [(line, name, how) for line, name, how in imports if _top(name) in kernel]
        shim90 = [(line, n) for line, n, _ in imports if n == "shim.sm90" or n.startswith("shim.sm90.")]
        shim100 = [(line, n) for line, n, _ in imports if n == "shim.sm100" or n.startswith("shim.sm100.")]

        if not in_shim and f not in EXEMPT_FILES:
            seen: Set[Tuple[int, str]] = set()
            for line, name, how in kernel_hits:
                if (line, _top(name)) in seen:
                    continue
                seen.add((line, _top(name)))
                out.append(Violation(f, line, "kernel-import", f"`{name}` ({how}) names a kernel module outside shim/"))
            for line, text in _kernel_targets(src, kernel):
                out.append(Violation(f, line, "kernel-target", f"'{text}' names a kernel module for a dispatcher to "
                                                               "load, outside shim/"))
            if any(file == f for file, _ in COMPUTED_IMPORT_ALLOWED):
                for line, text in _kernel_names(src, kernel):
                    if not any(v.line == line and v.rule in ("kernel-target", "kernel-import") for v in out
                               if v.file == f):
                        out.append(Violation(f, line, "kernel-name", f"'{text}' names a kernel module in a file whose "
                                                                     "allow-listed dispatcher imports computed names"))
            for line, call, what in _computed_imports(src, kernel):
                if (f, call) not in COMPUTED_IMPORT_ALLOWED:
                    out.append(Violation(f, line, "computed-import", f"{what} outside shim/ (`{call}`): name the module "
                                                                     "literally, or allow-list the call site in "
                                                                     "tools/drop/layering.py with the reason"))
            for line, call in _kernel_paths(src):
                out.append(Violation(f, line, "kernel-path", f"`{call}` loads a kernel tree file outside shim/"))
            for line, text, rule in _path_edits(tree):
                if (f, text) not in SYS_PATH_ALLOWED:
                    out.append(Violation(f, line, rule, f"`{text}` changes sys.path outside shim/ (only "
                                                        "shim/common/tree.py puts a kernel tree there); allow-list "
                                                        "the call site in tools/drop/layering.py with the reason"))
            if not any(_under(rel, d) for d in PYTHONPATH_WRITERS):
                for line, text in _pythonpath_writes(tree):
                    out.append(Violation(f, line, "pythonpath", f"`{text}` writes PYTHONPATH outside shim/ and {', '.join(PYTHONPATH_WRITERS)} "
                                                                "(forwarding os.pathsep.join(sys.path) as is is fine)"))

        if _under(rel, "moe_ep"):
            for line, name, how in imports:
                if _top(name) in ("shim", "tools"):
                    out.append(Violation(f, line, "moe_ep-imports-upper",
                                         f"moe_ep (the ground floor) imports `{name}` ({how}): name it by a lazy string"))
                    break

        if shim90 and shim100:
            out.append(Violation(f, min(shim90[0][0], shim100[0][0]), "both-trees", "imports both shim.sm90 and shim.sm100"))
        k90 = sorted({_top(n) for _, n, _ in kernel_hits} & SM90_ONLY)
        k100 = sorted({_top(n) for _, n, _ in kernel_hits} & SM100_ONLY)
        if k90 and k100:
            out.append(Violation(f, kernel_hits[0][0], "both-trees", f"imports Hopper-only {k90} and Blackwell-only {k100}"))

        # Each tree's shim: the first import of the other tree's shim, and of a package only the other tree has.
        for own, other_shim, other_only, other_tree in (("shim/sm90", shim100, SM100_ONLY, "Blackwell"),
                                                        ("shim/sm100", shim90, SM90_ONLY, "Hopper")):
            if _under(rel, own):
                out += [Violation(f, line, "cross-tree", f"{own} imports `{n}`") for line, n in other_shim[:1]]
                out += [
                    Violation(f, line, "cross-tree", f"{own} imports {other_tree}-only `{name}`")
                    for line, name, _ in kernel_hits if _top(name) in other_only
                ][:1]
        if _under(rel, "shim/common"):
            for line, n in (shim90 + shim100)[:1]:
                out.append(Violation(f, line, "common-tree-specific", f"tree-agnostic shim/common imports `{n}`"))
            for line, name, _ in kernel_hits:
                if _top(name) not in SHARED:
                    out.append(Violation(f, line, "common-tree-specific", f"tree-agnostic shim/common imports tree-specific `{name}`"))
                    break
    return out


def main(repo_root: Path) -> int:
    violations = check_layering(repo_root)
    for v in violations:
        print(v)
    print(f"layering: {len(violations)} violation(s)" if violations else "layering: ok")
    return 1 if violations else 0
