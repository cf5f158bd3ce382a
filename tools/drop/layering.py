"""Source-level layering check: Python can reach a kernel tree around Bazel's
visibility (sys.path, importlib), so every module of the repo is scanned.

Rules:
  1. Only modules under shim/ name kernel top-level modules (import, from-import,
     importlib.import_module / __import__ with a literal) or put a kernel tree on
     sys.path. `common` and `src` are kernel names here, so the repo itself must
     have no top-level package by those (or any other kernel) names.
  2. moe_ep/core imports neither shim nor a kernel tree.
  3. No module imports both trees: not shim.sm90 and shim.sm100 together, and
     not the Hopper-only and Blackwell-only kernel packages together.
  4. shim/sm90 never reaches the Blackwell side (shim.sm100 or sm100-only kernel
     packages) and shim/sm100 never the Hopper side; shim/common, being
     tree-agnostic, names only kernel packages both trees have.
The Bazel graph has its own check (a query test); this one covers what Python
can do that Bazel does not see.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Iterator, List, Optional, Set, Tuple

from tools.drop.trees import KERNEL_TOP_LEVEL, TREES

__all__ = ["Violation", "check_layering", "main"]

SM90_ONLY = frozenset(TREES["sm90"].default_packages - TREES["sm100"].default_packages)
SM100_ONLY = frozenset(TREES["sm100"].default_packages - TREES["sm90"].default_packages)
SHARED = frozenset(TREES["sm90"].default_packages & TREES["sm100"].default_packages)

# Strings that mark a sys.path entry as a kernel tree.
_TREE_MARKERS = ("kernel_src", "cutedsl_megamoe", "pull_style_cutedsl_megakernel", "MOE_EP_SM90_TREE", "MOE_EP_SM100_TREE")

_SKIP_DIRS = {"__pycache__", "node_modules"}


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


def _imports(tree: ast.Module, module: str, is_pkg: bool) -> Iterator[Tuple[int, str, str]]:
    """(line, absolute module, how) for every import-like statement in the file."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, "import"
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                base = node.module or ""
            else:
                pkg = module.split(".") if is_pkg else module.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)] if node.level > 1 else pkg
                base = ".".join(pkg + ([node.module] if node.module else []))
            yield node.lineno, base, "from"
            # `from shim import sm90` reaches shim.sm90 as well.
            for alias in node.names:
                if alias.name != "*":
                    yield node.lineno, f"{base}.{alias.name}" if base else alias.name, "from"
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
                if isinstance(node.args[0].value, str) and not node.args[0].value.startswith("."):
                    yield node.lineno, node.args[0].value, "dynamic"


def _path_edits(tree: ast.Module) -> Iterator[Tuple[int, str]]:
    """sys.path insert/append/extend and site.addsitedir calls whose argument names a kernel tree."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        target = ast.unparse(node.func)
        if target not in ("sys.path.insert", "sys.path.append", "sys.path.extend", "site.addsitedir"):
            continue
        text = " ".join(ast.unparse(a) for a in node.args)
        if any(m in text for m in _TREE_MARKERS):
            yield node.lineno, target


def _top(name: str) -> str:
    return name.split(".")[0]


def _under(rel: Path, prefix: str) -> bool:
    return rel.as_posix() == prefix or rel.as_posix().startswith(prefix + "/")


def check_layering(repo_root: Path, kernel_names: Optional[Set[str]] = None) -> List[Violation]:
    repo_root = Path(repo_root)
    kernel = set(kernel_names or KERNEL_TOP_LEVEL)
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
        imports = list(_imports(tree, module, is_pkg))
        f = rel.as_posix()

        kernel_hits = [(line, name, how) for line, name, how in imports if _top(name) in kernel]
        shim90 = [(line, n) for line, n, _ in imports if n == "shim.sm90" or n.startswith("shim.sm90.")]
        shim100 = [(line, n) for line, n, _ in imports if n == "shim.sm100" or n.startswith("shim.sm100.")]

        if not in_shim:
            seen: Set[Tuple[int, str]] = set()
            for line, name, how in kernel_hits:
                if (line, _top(name)) in seen:
                    continue
                seen.add((line, _top(name)))
                out.append(Violation(f, line, "kernel-import", f"`{name}` ({how}) names a kernel module outside shim/"))
            for line, call in _path_edits(tree):
                out.append(Violation(f, line, "kernel-path", f"{call} puts a kernel tree on sys.path outside shim/"))

        if _under(rel, "moe_ep/core"):
            for line, name, how in imports:
                if _top(name) == "shim":
                    out.append(Violation(f, line, "core-imports-shim", f"moe_ep/core imports `{name}`"))
                    break

        if shim90 and shim100:
            out.append(Violation(f, min(shim90[0][0], shim100[0][0]), "both-trees", "imports both shim.sm90 and shim.sm100"))
        k90 = sorted({_top(n) for _, n, _ in kernel_hits} & SM90_ONLY)
        k100 = sorted({_top(n) for _, n, _ in kernel_hits} & SM100_ONLY)
        if k90 and k100:
            out.append(Violation(f, kernel_hits[0][0], "both-trees", f"imports Hopper-only {k90} and Blackwell-only {k100}"))

        if _under(rel, "shim/sm90"):
            out += [Violation(f, line, "cross-tree", f"shim/sm90 imports `{n}`") for line, n in shim100[:1]]
            out += [
                Violation(f, line, "cross-tree", f"shim/sm90 imports Blackwell-only `{name}`")
                for line, name, _ in kernel_hits if _top(name) in SM100_ONLY
            ][:1]
        if _under(rel, "shim/sm100"):
            out += [Violation(f, line, "cross-tree", f"shim/sm100 imports `{n}`") for line, n in shim90[:1]]
            out += [
                Violation(f, line, "cross-tree", f"shim/sm100 imports Hopper-only `{name}`")
                for line, name, _ in kernel_hits if _top(name) in SM90_ONLY
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
