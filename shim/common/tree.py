"""Puts one verified kernel tree on sys.path, and refuses everything else.

Both drop trees use the same top-level package names (`common`, `src`, `moe_nvfp4_swapab`, ...), so a
process can hold exactly one of them, from exactly one directory. `activate(arch)`:

1. picks the tree's root: under Bazel the drop repository in the runfiles (its py_library put it on
   sys.path); outside Bazel the directory `$MOE_EP_SM90_TREE` / `$MOE_EP_SM100_TREE` names. When both are
   there and differ, the Bazel tree serves if the env var's tree has the same content (same pin); a
   different env tree is refused unless declared unpinned, and then it alone serves (see docs/integrity.md);
2. hashes every file of that root (once per process) and compares it with the pinned manifest: a Bazel
   tree with the `pinned.manifest.json` its repository rule wrote (else this checkout's committed
   third_party/cutedsl_megamoe/<arch>.manifest.json); an env-var tree with the committed manifest (and,
   under Bazel, the Bazel tree's pin). A mismatch is a TreeIntegrityError naming the files, unless the
   tree came from the env var and `MOE_EP_UNPINNED_TREE` opts in (warning on every rank, recorded in
   `tree_provenance()`);
3. removes every other copy of a kernel tree from sys.path, refuses the other arch's tree, refuses kernel
   modules already imported from elsewhere, and installs an import guard: from then on every module under
   a kernel top-level name must resolve inside the verified root (TreeConflictError otherwise).
   `check_module()` is the same check for a module object (shim/common/lazy.py runs it on each resolve).

Every error is a moe_ep error (BackendUnavailableError) whose `argument` is "tree" or the env var's name.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from moe_ep.errors import BackendUnavailableError
from shim.common import integrity as _integrity
from shim.common.tree_facts import DROP_PACKAGES as _DROP_PACKAGES
from shim.common.tree_facts import KERNEL_NAMES, TREES, TreeFacts

__all__ = [
    "KERNEL_NAMES", "TREES", "UNPINNED_ENV", "TreeConflictError", "TreeNotFoundError", "TreeIntegrityError",
    "UnpinnedTreeWarning", "activate", "active_tree", "check_module", "locate", "tree_provenance",
]

# Opt-in for an env-var tree that matches no pin: "1" (any arch) or a comma list of arches ("sm90").
UNPINNED_ENV = "MOE_EP_UNPINNED_TREE"


class TreeConflictError(BackendUnavailableError):
    """A second kernel tree (another arch, another directory, or a module from outside the verified root)."""


class TreeNotFoundError(BackendUnavailableError):
    """The kernel tree is not on this machine (not built by Bazel, no env var), or the env var names no tree."""


class TreeIntegrityError(BackendUnavailableError):
    """A kernel tree's files differ from its pinned manifest (or no pinned manifest could be found)."""


class UnpinnedTreeWarning(UserWarning):
    """An env-var tree that matches no pinned manifest was loaded because MOE_EP_UNPINNED_TREE opted in."""


# Directories holding the committed manifests (<arch>.manifest.json). None: this checkout's
# third_party/cutedsl_megamoe/, found next to this file as laid out in the runfiles and, following the
# symlink, in the checkout itself. Tests point it elsewhere in-process; there is no env var for it (an env
# var that chose the pin would be a way around the pin).
_PIN_DIRS: Optional[List[str]] = None

_active: Optional[Tuple[str, str]] = None  # (arch, root)
_provenance: Dict[str, dict] = {}
_hashed: Dict[str, Tuple[_integrity.TreeScan, float]] = {}  # abspath(root) -> (scan, ms): hashed once per process
_guard: Optional["_KernelImportGuard"] = None


def active_tree() -> Optional[Tuple[str, str]]:
    return _active


def tree_provenance(arch: Optional[str] = None) -> Optional[dict]:
    """Where this process's kernel tree came from, for logs: None until `arch` (default: the active one) is
    activated. Keys: arch, root, source ("bazel" or the env var's name), verified (matches its pin),
    unpinned (loaded through the MOE_EP_UNPINNED_TREE opt-in), manifest_version, carrier_sha256,
    manifests (what it was checked against), files, check_ms, mismatch (first differing files), note."""
    if arch is None:
        arch = _active[0] if _active else None
    entry = _provenance.get(arch) if arch else None
    return dict(entry) if entry else None


# ----------------------------------------------------------------------------------------------- paths


def _abs(path: str) -> str:
    return os.path.normpath(os.path.abspath(path))


def _under(path: str, root: str) -> bool:
    path = _abs(path)
    return path == root or path.startswith(root + os.sep)


def _is_tree(path: str, spec: TreeFacts) -> bool:
    return os.path.isdir(os.path.join(path, spec.marker))


def _bazel_roots(spec: TreeFacts) -> List[str]:
    """The drop repository as Bazel lays it out (sys.path entries and runfiles roots named by the repo)."""
    found: List[str] = []
    cands = [e for e in sys.path if e and os.path.basename(os.path.normpath(e)) == spec.repo_name]
    for var in ("RUNFILES_DIR", "TEST_SRCDIR"):
        base = os.environ.get(var)
        if base:
            cands.append(os.path.join(base, spec.repo_name))
    for cand in cands:
        root = _abs(cand)
        if root not in found and _is_tree(root, spec):
            found.append(root)
    return found


def _env_root(spec: TreeFacts) -> Optional[str]:
    value = os.environ.get(spec.env_var)
    if not value:
        return None
    root = _abs(value)
    if not _is_tree(root, spec):
        raise TreeNotFoundError(
            spec.env_var,
            f"{spec.env_var}={value} is not the {spec.arch} tree's src/ root (no {spec.marker}/ in it). Point it at "
            f"the {spec.wheel_prefix} directory of an extracted flashinfer-python wheel, or unset it under Bazel.",
        )
    return root


def _unpinned_opt_in(arch: str) -> bool:
    value = os.environ.get(UNPINNED_ENV, "").strip()
    if value in ("", "0"):
        return False
    if value == "1":
        return True
    arches = {a.strip() for a in value.split(",") if a.strip()}
    unknown = sorted(arches - set(TREES))
    if unknown:
        raise TreeIntegrityError(
            UNPINNED_ENV,
            f"{UNPINNED_ENV}={value!r}: expected 1 (any arch) or a comma list of {sorted(TREES)}; unknown {unknown}",
        )
    return arch in arches


# ------------------------------------------------------------------------------------------------ pins


@dataclass
class _Pin:
    files: Dict[str, str]
    version: Optional[str]
    carrier_sha256: Optional[str]
    source: str  # path of the manifest


@dataclass
class _Check:
    root: str
    pin: Optional[_Pin]  # the pin it matched, else the first one tried
    ok: bool
    diff: _integrity.TreeDiff = field(default_factory=_integrity.TreeDiff)
    files: int = 0
    ms: float = 0.0
    scan: Optional[_integrity.TreeScan] = None


def _pin_dirs() -> List[str]:
    if _PIN_DIRS is not None:
        return list(_PIN_DIRS)
    out: List[str] = []
    for here in (os.path.abspath(__file__), os.path.realpath(__file__)):
        d = os.path.normpath(os.path.join(os.path.dirname(here), "..", "..", "third_party", "cutedsl_megamoe"))
        if d not in out:
            out.append(d)
    return out


def _read_pin(path: str, argument: str) -> _Pin:
    try:
        data = _integrity.load_manifest(path)
    except (OSError, ValueError) as e:
        raise TreeIntegrityError(argument, f"cannot read the pinned manifest {path}: {e}") from e
    return _Pin(dict(data["files"]), data.get("version"), data.get("carrier_sha256"), path)


def _committed_pins(arch: str) -> List[_Pin]:
    for d in _pin_dirs():
        path = os.path.join(d, f"{arch}.manifest.json")
        if os.path.isfile(path):
            return [_read_pin(path, "tree")]
    return []


def _bazel_pin(arch: str, root: str) -> Optional[_Pin]:
    """The pin of a Bazel drop repository: the pinned.manifest.json its repository rule wrote (the
    workspace's own pin, which may be a consumer's), else this checkout's committed manifest."""
    path = os.path.join(root, _integrity.PINNED_MANIFEST)
    if os.path.isfile(path):
        return _read_pin(path, "tree")
    committed = _committed_pins(arch)
    return committed[0] if committed else None


def _scan(root: str) -> Tuple[_integrity.TreeScan, float]:
    """Every file under root hashed (and byte code, native code and directories listed), once per process; and
    the ms it took."""
    if root not in _hashed:
        t0 = time.perf_counter()
        scan = _integrity.scan_tree(root)
        _hashed[root] = (scan, (time.perf_counter() - t0) * 1e3)
    return _hashed[root]


def _verify(root: str, pins: List[_Pin]) -> _Check:
    """Compares the tree at root with each pin in turn: ok on the first that matches exactly (its files, and no
    directory the pin's files do not sit in: Python would import one as a namespace package)."""
    scan, ms = _scan(root)
    first = None
    for pin in pins:
        diff = _integrity.diff_files(pin.files, scan.digests)
        listed = _integrity.listed_dirs(pin.files)
        diff.added = sorted(diff.added + [d + "/" for d in scan.dirs if d not in listed])
        if not diff:
            return _Check(root, pin, True, diff, len(scan.digests), ms, scan)
        first = first or _Check(root, pin, False, diff, len(scan.digests), ms, scan)
    return first or _Check(root, None, False, _integrity.TreeDiff(), len(scan.digests), ms, scan)


def _foreign_code(spec: TreeFacts, check: _Check, bazel: bool) -> Optional[TreeIntegrityError]:
    """Byte code without source, and native code the pin does not list: refused whatever the tree's pin status (an
    unpinned tree opts in to edited sources, not to code nobody can read), and named before any other difference:
    a drop ships Python sources only."""
    listed = check.pin.files if check.pin else {}
    scan = check.scan
    found = [(rel, "byte code without its source: Python imports it as a module") for rel in scan.sourceless]
    found += [(rel, "a shared object: Python imports it before a .py of the same name")
              for rel in scan.native if rel not in listed]
    if not found:
        return None
    named = "; ".join(f"{_where(check.root, rel)} ({why})" for rel, why in found[:4])
    more = f" (+{len(found) - 4} more)" if len(found) > 4 else ""
    fix = (f"re-fetch it (`bazel sync --only={spec.repo_name}`)" if bazel else
           f"delete them, or re-extract {spec.wheel_prefix} from the wheel")
    return TreeIntegrityError(
        "tree" if bazel else spec.env_var,
        f"the {spec.arch} kernel tree at {check.root} holds importable file(s) no manifest lists: {named}{more}. "
        f"A drop ships Python sources only, and these would run in their place: {fix}.",
    )


def _refuse_foreign_code(spec: TreeFacts, choice: "_Choice") -> None:
    error = _foreign_code(spec, choice.check, choice.source == "bazel")
    if error is not None:
        raise error


def _pin_text(pin: Optional[_Pin]) -> str:
    if pin is None:
        return "no pinned manifest"
    return f"the pinned manifest {pin.source} (flashinfer-python {pin.version})"


def _where(root: str, rel: str) -> str:
    path = os.path.join(root, rel)
    real = os.path.realpath(path)
    return path if real == path else f"{path} -> {real}"


def _no_pin_error(spec: TreeFacts, argument: str) -> TreeIntegrityError:
    return TreeIntegrityError(
        argument,
        f"no pinned manifest of the {spec.arch} tree was found to check it against (looked for "
        f"{_integrity.PINNED_MANIFEST} in the Bazel repository and for {spec.arch}.manifest.json in "
        f"{', '.join(_pin_dirs())}). Run from a megamoe-ep checkout (or under Bazel), or declare the tree unpinned "
        f"with {UNPINNED_ENV}={spec.arch}.",
    )


def _bazel_integrity_error(spec: TreeFacts, check: _Check) -> TreeIntegrityError:
    foreign = _foreign_code(spec, check, True)
    if foreign is not None:
        return foreign
    inits = _integrity.legacy_init_files(check.diff, check.scan.digests)
    if inits:
        return TreeIntegrityError(
            "tree",
            f"the {spec.arch} kernel tree at {check.root} holds {len(inits)} empty __init__.py file(s) no drop ships "
            f"(first: {_where(check.root, inits[0])}): Bazel's legacy __init__.py, which py_binary/py_test write into "
            f"the runfiles unless told not to; the fetched tree is unchanged. Load the Python rules from "
            f"@megamoe_ep//tools/bazel:py.bzl (they set legacy_create_init = False), or add "
            f"`build --incompatible_default_to_explicit_init_py` to your .bazelrc.",
        )
    first = (check.diff.changed + check.diff.added + check.diff.removed)[:1]
    where = f" (first: {_where(check.root, first[0])})" if first else ""
    return TreeIntegrityError(
        "tree",
        f"the {spec.arch} kernel tree at {check.root} does not match {_pin_text(check.pin)}: "
        f"{check.diff.counts()} file(s): {check.diff.describe()}{where}. Its files were modified after Bazel fetched "
        f"them (they live in Bazel's output base, external/{spec.repo_name}/). Re-fetch the tree: "
        f"`bazel sync --only={spec.repo_name}` (or `bazel clean --expunge`), then run again. To run edited kernel "
        f"code on purpose, copy the tree, point {spec.env_var} at the copy and set {UNPINNED_ENV}={spec.arch}.",
    )


def _env_integrity_error(spec: TreeFacts, check: _Check, bazel_root: Optional[str]) -> TreeIntegrityError:
    foreign = _foreign_code(spec, check, False)
    if foreign is not None:
        return foreign
    version = check.pin.version if check.pin else "the pinned version"
    under_bazel = (
        f" Under Bazel the variable is not needed (the pinned tree is in the runfiles: {bazel_root}); unset it "
        f"(`--config=hopper/blackwell` pass it through from your shell)." if bazel_root else ""
    )
    return TreeIntegrityError(
        spec.env_var,
        f"{spec.env_var}={check.root} does not match {_pin_text(check.pin)}: {check.diff.counts()} file(s): "
        f"{check.diff.describe()}. A tree named by {spec.env_var} must be a clean extraction of the pinned drop: "
        f"point it at the {spec.wheel_prefix} directory of flashinfer-python=={version}, or declare this tree "
        f"unpinned with {UNPINNED_ENV}={spec.arch} (or =1): it then loads with a warning on every rank, recorded in "
        f"the logs (tree_provenance).{under_bazel}",
    )


# ------------------------------------------------------------------------------------------- selection


@dataclass
class _Choice:
    root: str
    source: str  # "bazel" or the env var's name
    check: _Check
    unpinned: bool
    set_aside: List[str]  # same-arch tree roots that must not stay on sys.path
    note: str = ""


def _choose(spec: TreeFacts) -> _Choice:
    bazel = _bazel_roots(spec)
    env = _env_root(spec)
    if env is not None and any(env == b for b in bazel):
        env = None  # the env var names the Bazel tree itself
    if not bazel and env is None:
        tried = [f"${spec.env_var} (unset)"] + [e for e in sys.path if e] + [
            os.path.join(os.environ[v], spec.repo_name) for v in ("RUNFILES_DIR", "TEST_SRCDIR") if os.environ.get(v)]
        raise TreeNotFoundError(
            spec.env_var,
            f"the {spec.arch} kernel tree was not found (looked in: {', '.join(tried)}). Under Bazel depend on "
            f"//shim/{spec.arch}; elsewhere set {spec.env_var} to the drop's src/ root ({spec.wheel_prefix} of the "
            "flashinfer-python wheel).",
        )

    if bazel:
        root = bazel[0]
        pin = _bazel_pin(spec.arch, root)
        if pin is None:
            raise _no_pin_error(spec, "tree")
        if env is not None:
            env_check = _verify(env, [pin])
            if env_check.ok:
                check = _verify(root, [pin])
                if not check.ok:
                    raise _bazel_integrity_error(spec, check)
                note = f"{spec.env_var}={env} has the same content as the pinned Bazel tree, which serves"
                return _Choice(root, "bazel", check, False, bazel[1:] + [env], note)
            if not _unpinned_opt_in(spec.arch):
                raise _env_integrity_error(spec, env_check, root)
            note = f"the pinned Bazel tree {root} is set aside for {spec.env_var}"
            return _Choice(env, spec.env_var, env_check, True, bazel, note)
        check = _verify(root, [pin])
        if not check.ok:
            raise _bazel_integrity_error(spec, check)
        return _Choice(root, "bazel", check, False, bazel[1:])

    pins = _committed_pins(spec.arch)
    if not pins:
        if not _unpinned_opt_in(spec.arch):
            raise _no_pin_error(spec, spec.env_var)
        return _Choice(env, spec.env_var, _verify(env, []), True, [], "no pinned manifest found")
    check = _verify(env, pins)
    if check.ok:
        return _Choice(env, spec.env_var, check, False, [])
    if not _unpinned_opt_in(spec.arch):
        raise _env_integrity_error(spec, check, None)
    return _Choice(env, spec.env_var, check, True, [])


def locate(arch: str) -> str:
    """The root `activate(arch)` uses (the active one once activated); verifies, activates nothing."""
    if arch not in TREES:
        raise TreeNotFoundError("arch", f"arch must be one of {sorted(TREES)}, got {arch!r}")
    if _active is not None and _active[0] == arch:
        return _active[1]
    spec = TREES[arch]
    choice = _choose(spec)
    _refuse_foreign_code(spec, choice)
    return choice.root


# ------------------------------------------------------------------------------------------ the guards


def _locations(module) -> List[str]:
    spec = getattr(module, "__spec__", None)
    locs: List[str] = []
    origin = getattr(spec, "origin", None) if spec is not None else None
    if origin and origin not in ("namespace", "built-in", "frozen"):
        locs.append(origin)
    elif getattr(module, "__file__", None):
        locs.append(module.__file__)
    locs += [p for p in (getattr(module, "__path__", None) or []) if isinstance(p, str)]
    return locs


def _foreign(module, root: str) -> Optional[str]:
    """Why `module` is not from `root` (None when it is)."""
    locs = _locations(module)
    if not locs:
        return "no file (a module object put into sys.modules by hand?)"
    bad = [p for p in locs if not _under(p, root)]
    return f"from {bad[0]}" if bad else None


def _copy_of_a_drop_package(name: str) -> bool:
    """`name` is a drop package (or inside one) imported under a longer name, e.g. FlashInfer's
    flashinfer.moe_ep.kernel_src.sm90....src.moe_hopper_fp8: a second copy of kernel code."""
    return "moe_" in name and any(part in _DROP_PACKAGES for part in name.split(".")[1:])


def _loaded_elsewhere(root: str) -> List[str]:
    """Kernel modules already imported from outside `root`: any name under a kernel top-level name, and any drop
    package imported under another name."""
    bad = []
    for name, mod in list(sys.modules.items()):
        if mod is None:
            continue
        if name.partition(".")[0] in KERNEL_NAMES:
            why = _foreign(mod, root)
        elif _copy_of_a_drop_package(name):
            why = _foreign(mod, root) or "a drop package under another name"
        else:
            continue
        if why:
            bad.append(f"{name} ({why})")
    return sorted(bad)


def check_module(module) -> None:
    """Raises TreeConflictError unless `module` (a kernel module) comes from the active verified root.
    Modules outside the kernel top-level names pass untouched."""
    name = getattr(module, "__name__", "") or ""
    if name.partition(".")[0] not in KERNEL_NAMES:
        return
    if _active is None:
        raise TreeConflictError(
            "tree", f"kernel module {name} was resolved before any kernel tree was activated: import it through "
                    "shim/<arch>/kernel_symbols, which activates and verifies the tree first")
    why = _foreign(module, _active[1])
    if why:
        raise TreeConflictError(
            "tree", f"kernel module {name} is not from the verified {_active[0]} tree {_active[1]} ({why}): one "
                    "process loads every kernel module from one root; remove the other copy from sys.path / "
                    "sys.modules, or run it in its own process")


class _KernelImportGuard(importlib.abc.MetaPathFinder):
    """First on sys.meta_path once a tree is active: a module under a kernel top-level name must be found
    inside the verified root. Other names are left to the rest of the import system."""

    def find_spec(self, fullname, path=None, target=None):
        if _active is None:
            return None
        if fullname.partition(".")[0] not in KERNEL_NAMES:
            if _copy_of_a_drop_package(fullname):
                raise TreeConflictError(
                    "tree", f"import of {fullname}: a drop package under another name, i.e. a second copy of the "
                            f"kernels next to the verified {_active[0]} tree {_active[1]} (FlashInfer's own kernel_src "
                            "trees are one): one process loads kernel code from one root; run it in another process")
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None:
            return None
        locs = [spec.origin] if spec.origin and spec.origin not in ("namespace",) else []
        locs += list(spec.submodule_search_locations or [])
        bad = [p for p in locs if not _under(p, _active[1])]
        if bad:
            raise TreeConflictError(
                "tree", f"import of kernel module {fullname} would load {bad[0]}, outside the verified "
                        f"{_active[0]} tree {_active[1]}: one process loads every kernel module from one root. "
                        "Remove the other tree from sys.path (only shim/common/tree.py puts a tree there).")
        return spec


def _install_guard() -> None:
    global _guard
    if _guard is None:
        _guard = _KernelImportGuard()
    if not sys.meta_path or sys.meta_path[0] is not _guard:
        if _guard in sys.meta_path:
            sys.meta_path.remove(_guard)
        sys.meta_path.insert(0, _guard)


def _rank_prefix() -> str:
    for var in ("RANK", "LOCAL_RANK"):
        if os.environ.get(var):
            return f"[rank {os.environ[var]}] "
    return ""


def _warn_unpinned(spec: TreeFacts, choice: _Choice) -> None:
    check = choice.check
    what = (f"does not match {_pin_text(check.pin)} ({check.diff.counts()}: {check.diff.describe(4)})"
            if check.pin else "could not be checked (no pinned manifest found)")
    text = (f"moe_ep: {_rank_prefix()}UNPINNED {spec.arch} kernel tree in use: {spec.env_var}={choice.root} {what}; "
            f"loaded because {UNPINNED_ENV}={os.environ.get(UNPINNED_ENV)}. Results of this process are not from the "
            f"pinned drop.{' ' + choice.note + '.' if choice.note else ''}")
    warnings.warn(text, UnpinnedTreeWarning, stacklevel=3)
    print(text, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------- activation


def activate(arch: str) -> str:
    """Make `arch`'s verified tree importable by its top-level names; idempotent. Returns its root."""
    global _active
    if arch not in TREES:
        raise TreeNotFoundError("arch", f"arch must be one of {sorted(TREES)}, got {arch!r}")
    if _active is not None:
        if _active[0] != arch:
            raise TreeConflictError(
                "tree",
                f"this process already holds the {_active[0]} kernel tree ({_active[1]}); the {arch} tree uses the "
                "same top-level package names and cannot be loaded beside it: use a separate process",
            )
        clash = _loaded_elsewhere(_active[1])
        if clash:
            raise TreeConflictError(
                "tree", f"kernel modules were imported from outside the verified {arch} tree {_active[1]}: "
                        f"{', '.join(clash)}; one process loads every kernel module from one root")
        _install_guard()
        return _active[1]

    spec = TREES[arch]
    choice = _choose(spec)
    _refuse_foreign_code(spec, choice)
    root = choice.root
    clash = _loaded_elsewhere(root)
    if clash:
        raise TreeConflictError(
            "tree",
            f"cannot load the {arch} kernel tree from {root}: modules with its top-level names are already imported "
            f"from elsewhere: {', '.join(clash)}",
        )
    other_roots = []
    for other in TREES.values():
        if other.arch != arch:
            other_roots += [p for p in sys.path if p and not _under(p, root) and (
                os.path.basename(os.path.normpath(p)) == other.repo_name or _is_tree(p, other))]
    if other_roots:
        raise TreeConflictError(
            "tree",
            f"sys.path also holds the other kernel tree ({', '.join(other_roots)}): a target must depend on one tree "
            "only, and one process holds one tree",
        )

    # One root on sys.path. Other layouts of the same files (the other Bazel runfiles layout of this repository,
    # a link to the root, the tree the choice set aside) are dropped from it; any other directory that provides a
    # drop package is a second copy of the kernels, refused: whichever came first on sys.path would serve.
    set_aside = {_abs(p) for p in choice.set_aside}
    real_root = os.path.realpath(root)
    keep, copies = [], []
    for entry in sys.path:
        if entry and not _under(entry, root):
            a = _abs(entry)
            if a in set_aside or os.path.basename(a) == spec.repo_name or os.path.realpath(a) == real_root:
                continue
            provided = [n for n in sorted(_DROP_PACKAGES) if os.path.isdir(os.path.join(a, n))
                        or os.path.isfile(os.path.join(a, n + ".py"))]
            if provided:
                copies.append(f"{entry} (provides {', '.join(provided)})")
        keep.append(entry)
    if copies:
        raise TreeConflictError(
            "tree",
            f"a second copy of the kernel packages is on sys.path next to the verified {arch} tree {root}: "
            f"{'; '.join(copies)}. Whichever comes first would serve, unchecked. Remove it from PYTHONPATH / "
            "sys.path (an installed package of those names: uninstall it; FlashInfer's own moe_ep puts its "
            "kernel_src trees there when imported: run it in another process).",
        )
    if not any(e and _abs(e) == root for e in keep):
        keep.insert(0, root)
    sys.path[:] = keep
    importlib.invalidate_caches()

    check = choice.check
    _provenance[arch] = {
        "arch": arch,
        "root": root,
        "source": choice.source,
        "verified": check.ok,
        "unpinned": choice.unpinned,
        "manifest_version": check.pin.version if check.pin else None,
        "carrier_sha256": check.pin.carrier_sha256 if check.pin else None,
        "manifests": [check.pin.source] if check.pin else [],
        "files": check.files,
        "check_ms": round(check.ms, 2),
        "mismatch": (check.diff.changed + check.diff.added + check.diff.removed)[:20],
        "note": choice.note,
    }
    _active = (arch, root)
    _install_guard()
    if choice.unpinned:
        _warn_unpinned(spec, choice)
    return root
