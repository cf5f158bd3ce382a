"""The shim's view of the drop, derived from the shim's own sources by AST.

The import table a maintainer used to keep by hand is generated here: every
`from <kernel module> import <name>` (and `import <kernel module>`,
`importlib.import_module("<kernel module>")`) under shim/<arch>/ and
shim/common/, plus the lazy PEP 562 table `_LAZY = {export: (module, attr)}`
in any module of shim/<arch>/. The tuner's knob space is the module-level
literal `KNOB_SPACE` wherever it sits under shim/<arch>/ (no file name assumed).
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

from shim.common.tree_facts import KERNEL_NAMES

__all__ = ["ImportRow", "shim_files", "scan_imports", "lazy_tables", "knob_space", "knob_key_lines"]

LAZY_NAME = "_LAZY"
KNOB_SPACE_NAME = "KNOB_SPACE"


@dataclasses.dataclass(frozen=True)
class ImportRow:
    file: str  # repo-relative path of the shim module
    lineno: int
    form: str  # from | import | lazy | dynamic
    module: str  # absolute kernel module
    name: Optional[str]  # symbol taken from it; None: the module itself
    export: str  # the name the shim binds

    def sort_key(self):
        return (self.file, self.lineno, self.module, self.name or "", self.export)


def shim_files(repo_root: Path, arch: str) -> List[Path]:
    """Shim sources that run with `arch`'s tree: shim/<arch>/ and the tree-agnostic shim/common/."""
    out: List[Path] = []
    for sub in (arch, "common"):
        d = Path(repo_root) / "shim" / sub
        if d.is_dir():
            out.extend(p for p in sorted(d.rglob("*.py")) if "__pycache__" not in p.parts)
    return out


def _is_kernel(module: str, kernel_names: Iterable[str]) -> bool:
    return bool(module) and module.split(".")[0] in set(kernel_names)


def _module_level_assign(tree: ast.Module, name: str) -> Optional[ast.expr]:
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign):
            if any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets):
                return stmt.value
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == name:
            return stmt.value
    return None


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _lazy_entries(tree: ast.Module, path: Path) -> List[Tuple[str, str, str, int]]:
    """(export, module, attr, lineno) for every entry of a module-level `_LAZY` dict literal."""
    node = _module_level_assign(tree, LAZY_NAME)
    if node is None:
        return []
    if not isinstance(node, ast.Dict):
        raise ValueError(f"{path}: {LAZY_NAME} must be a dict literal so the audit can read it")
    out = []
    for key, value in zip(node.keys, node.values):
        try:
            export = ast.literal_eval(key) if key is not None else None
            module, attr = ast.literal_eval(value)
        except (ValueError, TypeError, SyntaxError) as error:
            raise ValueError(
                f"{path}:{value.lineno}: {LAZY_NAME} entries must be literal \"name\": (\"module\", \"attr\")"
            ) from error
        if not isinstance(export, str):
            raise ValueError(f"{path}:{value.lineno}: {LAZY_NAME} keys must be strings")
        out.append((export, module, attr, key.lineno))
    return out


def scan_imports(repo_root: Path, arch: str, kernel_names: Iterable[str] = KERNEL_NAMES) -> List[ImportRow]:
    kernel_names = set(kernel_names)
    rows: List[ImportRow] = []
    for path in shim_files(repo_root, arch):
        rel = str(path.relative_to(repo_root))
        tree = _parse(path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and _is_kernel(node.module or "", kernel_names):
                for alias in node.names:
                    rows.append(ImportRow(rel, node.lineno, "from", node.module, alias.name, alias.asname or alias.name))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if _is_kernel(alias.name, kernel_names):
                        rows.append(ImportRow(rel, node.lineno, "import", alias.name, None, alias.asname or alias.name))
            elif isinstance(node, ast.Call) and _is_import_module_call(node):
                target = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else None
                if isinstance(target, str) and _is_kernel(target, kernel_names):
                    rows.append(ImportRow(rel, node.lineno, "dynamic", target, None, target))
        for export, module, attr, lineno in _lazy_entries(tree, path):
            if _is_kernel(module, kernel_names):
                rows.append(ImportRow(rel, lineno, "lazy", module, attr, export))
    return sorted(rows, key=ImportRow.sort_key)


def _is_import_module_call(node: ast.Call) -> bool:
    func = node.func
    if isinstance(func, ast.Attribute) and func.attr == "import_module":
        return True
    if isinstance(func, ast.Name) and func.id in ("import_module", "__import__"):
        return True
    return False


def lazy_tables(repo_root: Path, arch: str, kernel_names: Iterable[str] = KERNEL_NAMES) -> Dict[str, Tuple[str, str]]:
    """{export: (kernel module, attr)} over every `_LAZY` table in shim/<arch>/ (kernel entries only)."""
    kernel_names = set(kernel_names)
    out: Dict[str, Tuple[str, str]] = {}
    d = Path(repo_root) / "shim" / arch
    if not d.is_dir():
        return out
    for path in sorted(d.rglob("*.py")):
        for export, module, attr, _ in _lazy_entries(_parse(path), path):
            if _is_kernel(module, kernel_names):
                out[export] = (module, attr)
    return out


def _knob_space_files(repo_root: Path, arch: str) -> List[Path]:
    d = Path(repo_root) / "shim" / arch
    if not d.is_dir():
        return []
    out = []
    for path in sorted(d.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        if KNOB_SPACE_NAME not in path.read_text(encoding="utf-8"):
            continue
        if _module_level_assign(_parse(path), KNOB_SPACE_NAME) is not None:
            out.append(path)
    return out


def knob_space(repo_root: Path, arch: str) -> Tuple[Optional[str], Dict[str, Dict[str, list]]]:
    """(repo-relative path or None, KNOB_SPACE literal) of the shim/<arch>/ module that defines it."""
    files = _knob_space_files(repo_root, arch)
    if not files:
        return None, {}
    if len(files) > 1:
        names = ", ".join(str(p.relative_to(repo_root)) for p in files)
        raise ValueError(f"more than one module-level {KNOB_SPACE_NAME} under shim/{arch}/ ({names}): keep one")
    path = files[0]
    node = _module_level_assign(_parse(path), KNOB_SPACE_NAME)
    try:
        space = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError) as error:
        raise ValueError(f"{path}:{node.lineno}: {KNOB_SPACE_NAME} must be a literal the audit can read") from error
    if not isinstance(space, dict) or not all(isinstance(v, dict) for v in space.values()):
        raise ValueError(f"{path}: {KNOB_SPACE_NAME} must map kernel class -> {{ctor kwarg: [values]}}")
    return str(path.relative_to(repo_root)), space


def knob_key_lines(repo_root: Path, rel: str) -> Dict[Tuple[str, str], str]:
    """{(class, knob): "file:line"} of the keys in KNOB_SPACE ((class, ""): the class key)."""
    path = Path(repo_root) / rel
    node = _module_level_assign(_parse(path), KNOB_SPACE_NAME)
    out: Dict[Tuple[str, str], str] = {}
    if not isinstance(node, ast.Dict):
        return out
    for ckey, cval in zip(node.keys, node.values):
        if not (isinstance(ckey, ast.Constant) and isinstance(ckey.value, str)):
            continue
        out[(ckey.value, "")] = f"{rel}:{ckey.lineno}"
        if isinstance(cval, ast.Dict):
            for kkey in cval.keys:
                if isinstance(kkey, ast.Constant) and isinstance(kkey.value, str):
                    out[(ckey.value, kkey.value)] = f"{rel}:{kkey.lineno}"
    return out
