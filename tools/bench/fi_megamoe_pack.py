"""Packs what `tools/bench/fi_megamoe.py` needs of the pinned flashinfer-python wheel for the GPU host, which reaches no
package index: the Python modules `flashinfer.megamoe` imports (not the whole package: its top-level __init__ imports
every kernel family), the C++ sources and headers its run-time compile includes, and a cp312 apache-tvm-ffi (the
binding layer of FlashInfer's compiled modules).

    python3 tools/bench/fi_megamoe_pack.py [--wheel PATH] [--out .dev/fi/fi_megamoe.tar.xz]     (from the repo root)

The wheel is the one third_party/cutedsl_megamoe/workspace.bzl pins (its sha256 is checked); without --wheel it is
fetched with pip's own index configuration. Which files travel is found by reading them, not by a list:
  - Python: from flashinfer/megamoe/__init__.py and flashinfer/jit/megamoe.py, every `flashinfer` module an import
    statement names (at any depth of the code, so a function-level import counts), with the __init__ of every
    package on the way except flashinfer's own;
  - C++: from csrc/megamoe/ (the .cu / .cuh / .jinja the JIT stages), every `#include` that resolves in the wheel's
    include directories (the ones flashinfer/jit/cpp_ext.py and jit/megamoe.py pass to nvcc, in their order),
    followed through every branch of the preprocessor (more than a compile reads, never less); includes that resolve
    nowhere in the wheel are the toolkit's and the system's (cuda_runtime.h, <cstdint>).
Writes one .tar.xz (the device tool carries it: name its folder in `carry`); prints its size and what it holds.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import io
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Set, Tuple

REPO = Path(__file__).resolve().parents[2]
WORKSPACE = REPO / "third_party" / "cutedsl_megamoe" / "workspace.bzl"
# apache-tvm-ffi: the version FlashInfer's own bundle for the device (the shared flashinfer_pack.sh) carries; the
# wheel asks for >=0.1.11,<0.2.
TVM_FFI = "apache-tvm-ffi==0.1.15.post2"
PY_ROOTS = ("flashinfer/megamoe/__init__.py", "flashinfer/jit/megamoe.py")
CSRC = "flashinfer/data/csrc/megamoe/"
# The include directories of a megamoe module's compile, in nvcc's search order (flashinfer/jit/cpp_ext.py
# build_common_cflags, jit/megamoe.py _gen_fp4_module): the staged sources' own folder first.
INCLUDE_DIRS = ("flashinfer/data/csrc/megamoe", "flashinfer/data/csrc", "flashinfer/data/cccl/cub",
                "flashinfer/data/cccl/libcudacxx/include", "flashinfer/data/cccl/thrust", "flashinfer/data/include",
                "flashinfer/data/cutlass/include", "flashinfer/data/cutlass/tools/util/include",
                "flashinfer/data/spdlog/include")
_INCLUDE = re.compile(rb'^\s*#\s*include\s*[<"]([^">]+)[">]', re.M)


WHOLE = ("flashinfer/data/cccl/",)


def pinned() -> Tuple[str, str]:
    """(version, sha256) of the sm90 drop's carrier wheel."""
    text = WORKSPACE.read_text()
    version = re.search(r'^SM90_VERSION = "([^"]+)"', text, re.M).group(1)
    sha = re.search(r'^SM90_SHA256 = "([0-9a-f]{64})"', text, re.M).group(1)
    return version, sha


def fetch(spec: str, into: Path, *platform: str) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(into)]
    if platform:
        cmd += ["--python-version", "3.12", "--implementation", "cp"] + [a for p in platform for a in ("--platform", p)]
    subprocess.run(cmd + [spec], check=True)
    name = spec.split("==")[0].replace("-", "_")
    return next(into.glob(f"{name}-*.whl"))


def python_closure(names: Set[str], read) -> List[str]:
    """The flashinfer modules (file names in the wheel) the roots import, with their packages' __init__ files but
    not flashinfer/__init__.py."""

    def module_file(mod: str) -> Optional[str]:
        base = mod.replace(".", "/")
        for cand in (base + ".py", base + "/__init__.py"):
            if cand in names:
                return cand
        return None

    def package_of(path: str) -> str:
        parts = path[:-3].split("/")
        return ".".join(parts[:-1])  # a module's package; an __init__'s is its own folder

    todo, seen = list(PY_ROOTS), set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        # Every package on the way (flashinfer.jit's __init__ runs before flashinfer.jit.megamoe).
        parts = path.split("/")[:-1]
        for n in range(2, len(parts) + 1):
            init = "/".join(parts[:n]) + "/__init__.py"
            if init in names and init not in seen:
                todo.append(init)
        pkg = package_of(path)
        for node in ast.walk(ast.parse(read(path), filename=path)):
            mods: List[str] = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")
                    base = base[:len(base) - node.level + 1]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                mods = [stem] + [f"{stem}.{a.name}" for a in node.names]
            for mod in mods:
                if mod == "flashinfer" or not mod.startswith("flashinfer."):
                    continue
                f = module_file(mod)
                if f is not None:
                    todo.append(f)
    return sorted(seen)


def include_closure(names: Set[str], read) -> List[str]:
    """The wheel's files the megamoe sources include, transitively, resolved the way nvcc would (the including
    file's folder for quoted includes first, then INCLUDE_DIRS)."""
    roots = [n for n in names if n.startswith(CSRC) and not n.endswith("/")]
    todo, seen = list(roots), set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        here = path.rsplit("/", 1)[0]
        for inc in _INCLUDE.findall(read(path)):
            inc = inc.decode()
            for d in (here,) + INCLUDE_DIRS:
                cand = _norm(f"{d}/{inc}")
                if cand in names:
                    todo.append(cand)
                    break
    return sorted(seen)


def _norm(path: str) -> str:
    out: List[str] = []
    for part in path.split("/"):
        if part == "..":
            if out:
                out.pop()
        elif part not in (".", ""):
            out.append(part)
    return "/".join(out)


def pack(wheel: Path, tvm_wheel: Path, out: Path) -> Dict[str, int]:
    """Writes the bundle: fi/<wheel paths> and fi/<tvm-ffi's files>; returns counts and sizes."""
    zf = zipfile.ZipFile(wheel)
    names = set(zf.namelist())
    cache: Dict[str, bytes] = {}

    def read(name: str) -> bytes:
        if name not in cache:
            cache[name] = zf.read(name)
        return cache[name]

    py = python_closure(names, read)
    # The include scan misses CCCL's computed and configuration includes; half a CCCL beside the toolkit's own mixes
    # two versions' config macros (nvcc: "missing binary operator before token '('"), so CCCL travels whole.
    cpp = sorted(set(include_closure(names, read)) | {n for n in names if n.startswith(WHOLE) and not n.endswith("/")})
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in py + cpp:
            info = tarfile.TarInfo(f"fi/{name}")
            data = read(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        tz = zipfile.ZipFile(tvm_wheel)
        for name in tz.namelist():
            if name.endswith("/") or ".dist-info/" in name:
                continue
            data = tz.read(name)
            info = tarfile.TarInfo(f"fi/{name}")
            info.size = len(data)
            info.mode = 0o755 if name.endswith(".so") else 0o644
            tar.addfile(info, io.BytesIO(data))
    import lzma

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(lzma.compress(buf.getvalue(), preset=6))
    return dict(python=len(py), cpp=len(cpp), tar_bytes=len(buf.getvalue()), xz_bytes=out.stat().st_size)


def main(argv: Optional[Iterable[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheel", help="the flashinfer-python wheel (default: fetched, its sha256 checked)")
    ap.add_argument("--tvm-ffi-wheel", help="a cp312 apache-tvm-ffi wheel (default: fetched)")
    ap.add_argument("--out", default=str(REPO / ".dev" / "fi" / "fi_megamoe.tar.xz"))
    args = ap.parse_args(list(argv) if argv is not None else None)
    version, sha = pinned()
    with tempfile.TemporaryDirectory() as tmp:
        wheel = Path(args.wheel) if args.wheel else fetch(f"flashinfer-python=={version}", Path(tmp))
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        if digest != sha:
            print(f"fi_megamoe_pack: {wheel} has sha256 {digest}, the pin is {sha} ({version})", file=sys.stderr)
            return 2
        tvm = Path(args.tvm_ffi_wheel) if args.tvm_ffi_wheel else fetch(
            TVM_FFI, Path(tmp), "manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
        stats = pack(wheel, tvm, Path(args.out))
    print(f"fi_megamoe_pack: {args.out}: {stats['python']} Python modules, {stats['cpp']} C++ sources and headers, "
          f"{tvm.name}; {stats['tar_bytes'] / 2**20:.1f} MiB, {stats['xz_bytes'] / 2**20:.1f} MiB compressed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
