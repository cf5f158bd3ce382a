"""BUILD files get Python rules from //tools/bazel:py.bzl only.

That one file is what changes when rules_python replaces Bazel's built-in rules. Scans every
BUILD / BUILD.bazel / *.BUILD / *.bzl file of the source tree (not only this test's inputs: the
source digest among its data reruns it when any of them changes), the downstream example workspace
included.
The BUILD files applied to the drops, the generated @moe_ep_python BUILD and an engine's BUILD
files reach the same file as `@megamoe_ep//tools/bazel:py.bzl`.
"""

import re
import sys
from pathlib import Path

import pytest

from tests.foundation import nested_bazel

PY_RULES = ("py_library", "py_binary", "py_test", "py_runtime", "py_runtime_pair")
THE_LABEL = ("//tools/bazel:py.bzl", "@//tools/bazel:py.bzl", "@megamoe_ep//tools/bazel:py.bzl")
ALLOWED_NATIVE = {"tools/bazel/py.bzl"}
SKIP_DIRS = {".git", ".dev", ".whl", ".drop", ".venv", "node_modules"}

_LOAD = re.compile(r'load\(\s*"([^"]+)"((?:\s*,\s*(?:\w+\s*=\s*)?"[^"]*")*)\s*,?\s*\)', re.S)
_CALL = re.compile(r"(?<![\w.])(" + "|".join(PY_RULES) + r")\s*\(")
_NATIVE = re.compile(r"\bnative\.(" + "|".join(PY_RULES) + r")\b")


def _build_files(root: Path):
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if rel.parts[0] in SKIP_DIRS or rel.parts[0].startswith("bazel-"):
            continue
        if path.is_file() and (path.name in ("BUILD", "BUILD.bazel") or path.suffix in (".bzl", ".BUILD")):
            yield rel, path.read_text(encoding="utf-8")


def _strip_comments(text):
    return re.sub(r"#[^\n]*", "", text)


def problems(rel: Path, text: str):
    text = _strip_comments(text)
    out = []
    if rel.as_posix() not in ALLOWED_NATIVE:
        for m in _NATIVE.finditer(text):
            out.append(f"{rel}: calls native.{m.group(1)} (use //tools/bazel:py.bzl)")
    loaded_from_py_bzl = set()
    for m in _LOAD.finditer(text):
        label, names = m.group(1), m.group(2)
        symbols = set(re.findall(r'(?:(\w+)\s*=\s*)?"(\w+)"', names))
        local_names = {alias or name for alias, name in symbols}
        py_names = {name for _, name in symbols if name in PY_RULES}
        if label in THE_LABEL:
            loaded_from_py_bzl |= local_names
        elif py_names and rel.as_posix() not in ALLOWED_NATIVE:
            out.append(f"{rel}: loads {sorted(py_names)} from {label} (use //tools/bazel:py.bzl)")
    if rel.name in ("BUILD", "BUILD.bazel") or rel.suffix == ".BUILD":
        for m in _CALL.finditer(text):
            if m.group(1) not in loaded_from_py_bzl:
                out.append(f"{rel}: uses {m.group(1)} without loading it from //tools/bazel:py.bzl (native rule)")
    return sorted(set(out))


def test_no_build_file_uses_native_python_rules():
    root = nested_bazel.workspace_root()
    files = list(_build_files(root))
    assert any(rel.as_posix() == "tools/bazel/py.bzl" for rel, _ in files), "scan did not see tools/bazel/py.bzl"
    found = [p for rel, text in files for p in problems(rel, text)]
    print(f"scanned {len(files)} BUILD/.bzl files under {root}")
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "text, bad",
    [
        ('py_library(name = "x")', True),
        ('load("//tools/bazel:py.bzl", "py_library")\npy_library(name = "x")', False),
        ('load("@rules_python//python:defs.bzl", "py_test")\npy_test(name = "x")', True),
        ('load("@megamoe_ep//tools/bazel:py.bzl", "py_test")\npy_test(name = "x")', False),
        ('load("@other//tools/bazel:py.bzl", "py_test")\npy_test(name = "x")', True),
        ('native.py_binary(name = "x")', True),
        ('# py_test(name = "x") in a comment\n', False),
        ('load("//tools/bazel:py.bzl", "py_test")\npy_binary(name = "x")', True),
    ],
)
def test_checker_catches_native_rules(text, bad):
    assert bool(problems(Path("pkg/BUILD.bazel"), text)) == bad


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
