"""tools/drop: bump, audit and document a kernel drop.

    bazel run //tools:drop -- audit [--tree sm90|sm100|all] [--version V | --wheel FILE | --tree-root PATH] [--against OLD]
    bazel run //tools:drop -- bump --tree sm90 (--version V | --wheel FILE) [--sha256 HEX] [--accept-contract]
    bazel run //tools:drop -- manifest --tree sm90|sm100 (--version V | --wheel FILE) --sha256 HEX --out PATH
    bazel run //tools:drop -- docs [--tree ...] [--check]
    bazel run //tools:drop -- layering

(or `python -m tools.drop ...` from the repo root). `audit` and `bump` end with the build stage
(tools/drop/build_stage.py: the shim resolves knobs at every token bucket and compiles kernels against the
new tree, on the CPU, in child processes): `--no-compile` keeps the resolves, `--static-only` skips it,
`--compile-jobs N` runs N compiles at once.

Exit codes of `audit` and `bump`:
  0  compatible: no break (warn/note rows may still ask for a review or --accept-contract)
  1  every registered backend of the tree breaks (or none is registered and the shim breaks)
  2  usage or setup error: bad flags, no pin, pip failure, a hash that differs from --sha256
     or the pin (refused before anything is written)
  3  some registered backends break and others do not (or a break no backend reaches)
`docs --check` and `layering` exit 1 on stale docs / a layering violation; `manifest` 0 or 2.

A bump writes nothing until its audit is known: a compatible bump rewrites the pin, the manifest,
the docs and the report together (all or none); a breaking bump writes only its report and says
how to go on (fix shim/, then re-run with --accept-contract); --accept-contract records the new
signatures only when the shim's call sites fit them.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import List, Optional, Tuple

from shim.common.tree_facts import KERNEL_NAMES, TREES, TreeFacts
from third_party.cutedsl_megamoe import manifest as manifest_mod
from tools.drop import build_stage
from tools.drop import contract as contract_mod
from tools.drop import docs as docs_mod
from tools.drop import layering as layering_mod
from tools.drop.audit import EXIT_ALL_BREAK, EXIT_OK, EXIT_SOME_BREAK, EXIT_USAGE, AuditResult, Finding, run_audit
from tools.drop.fetch import (FetchError, TreeLocation, add_wheel, default_cache_dir, locate_in_directory,
                             tree_for_version)
from tools.drop.inventory import Inventory, inventory_of_tree, is_compiled, load_manifest_file
from tools.drop.manifests import manifest_path
from tools.drop.pins import PinError, read_pins, read_pins_file, read_strip_prefix, rewrite_pins, workspace_bzl
from tools.drop.report import render_markdown, render_terminal
from tools.drop.tables import render_stale, stale_entries, table_entries
from tools.drop.shim_scan import lazy_tables
from tools.drop.source_model import DropIndex
from tools.drop.transaction import Transaction
from tools.drop.trees import find_repo_root, runfiles_tree_root

__all__ = ["main", "EXIT_OK", "EXIT_ALL_BREAK", "EXIT_USAGE", "EXIT_SOME_BREAK"]

EXIT_BREAK = EXIT_ALL_BREAK  # `docs --check` / `layering`: 1 on a problem
_SHA = re.compile(r"^[0-9a-f]{64}$")


class UsageError(Exception):
    pass


def _log(msg: str) -> None:
    print(msg, file=sys.stderr)


def _cache_dir(args) -> Path:
    return _user_path(args.cache_dir).resolve() if args.cache_dir else default_cache_dir()


def _trees(name: str) -> List[TreeFacts]:
    return list(TREES.values()) if name == "all" else [TREES[name]]


def _user_path(option: str) -> Path:
    # Under `bazel run` the process starts in the runfiles tree: resolve relative to the caller's cwd.
    p = Path(option)
    cwd = os.environ.get("BUILD_WORKING_DIRECTORY")
    return p if p.is_absolute() or not cwd else Path(cwd) / p


def _pinned_prefix(repo: Path, tree: TreeFacts) -> str:
    bzl = workspace_bzl(repo)
    if bzl.is_file():
        prefix = read_strip_prefix(bzl.read_text(encoding="utf-8"), tree)
        if prefix:
            return prefix
    return tree.wheel_prefix.rstrip("/")


def _reference(repo: Path, tree: TreeFacts) -> Optional[dict]:
    """{rel: sha256} of the committed manifest: what finds the tree in a wheel by content."""
    path = manifest_path(repo, tree)
    if not path.is_file():
        return None
    return {rel: e.sha256 for rel, e in load_manifest_file(path).items()}


def _fetch(args, repo: Path, tree: TreeFacts, version: str, expected_sha: Optional[str] = None,
           expected_from: str = "the pin", new: bool = True) -> Tuple[Path, str, TreeLocation]:
    """The tree of `version` from the cache or pip. `new`: the drop under audit, which --strip-prefix names."""
    return tree_for_version(
        version, tree, _cache_dir(args), expected_sha256=expected_sha, log=_log, expected_from=expected_from,
        reference=_reference(repo, tree), expected_prefix=_pinned_prefix(repo, tree),
        strip_prefix=getattr(args, "strip_prefix", None) if new else None,
    )


def _take_handover(args, expected_sha: Optional[str], expected_from: str) -> None:
    """--wheel: the file goes into the tool's wheel cache (hash-checked), and args.version is its version."""
    if not getattr(args, "wheel", None):
        if not args.version:
            raise UsageError("name the drop: --version V (fetched with pip) or --wheel FILE (handed over)")
        return
    _, _, args.version = add_wheel(_user_path(args.wheel), _cache_dir(args), args.version, log=_log,
                                   expected_sha256=expected_sha, expected_from=expected_from)


def real_tree_dir(root: Path) -> Path:
    """The directory the tree was extracted to. Bazel's runfiles are a forest of links that holds
    only the files the BUILD globs select (not the repository rule's carrier.json, not a stray
    __pycache__/); a stray file sits in the real directory behind them, which is what the
    inventory must read and what the build children must import."""
    root = Path(root)
    for link in sorted(root.rglob("*.py")):
        if link.is_symlink():
            rel = link.relative_to(root)
            real = link.resolve()
            return real.parents[len(rel.parts) - 1]
    return root


def pinned_tree_root(repo: Path, tree: TreeFacts, cache_dir: Path, explicit: Optional[str] = None,
                     strip_prefix: Optional[str] = None) -> Tuple[Path, str]:
    """(root, how found) of the pinned drop tree (or of `explicit`, a directory holding a tree: its import root
    or anything above it, e.g. an unpacked wheel), without importing anything from it."""
    if explicit:
        given = _user_path(explicit).resolve()
        if not given.is_dir():
            raise UsageError(f"--tree-root {given} is not a directory")
        root = locate_in_directory(given, tree, _reference(repo, tree), strip_prefix)
        return root, "--tree-root" if root == given else f"--tree-root (found by content at {root.relative_to(given)})"
    env = os.environ.get(tree.env_var)
    if env and Path(env).is_dir():
        return Path(env), f"${tree.env_var}"
    root = runfiles_tree_root(tree)
    if root is not None:
        return root, f"@{tree.repo_name} (runfiles)"
    pins = read_pins_file(repo, tree)
    if pins is None:
        raise UsageError(f"no pin in {workspace_bzl(repo)}; pass --tree-root or set ${tree.env_var}")
    version, sha = pins
    root, _, _ = tree_for_version(version, tree, cache_dir, expected_sha256=sha, log=_log,
                                  reference=_reference(repo, tree), expected_prefix=_pinned_prefix(repo, tree))
    return root, f"pip cache ({version}, sha256 verified)"


def _pin_label(repo: Path, tree: TreeFacts) -> str:
    pins = read_pins_file(repo, tree)
    return pins[0] if pins else "unpinned"


def _old_inventory(args, repo: Path, tree: TreeFacts, against: Optional[str], new_inv: Inventory) -> Tuple[Inventory, str]:
    if against is None:
        manifest = manifest_path(repo, tree)
        if manifest.is_file():
            return load_manifest_file(manifest), f"{_pin_label(repo, tree)} (manifest)"
        return new_inv, _pin_label(repo, tree)
    path = _user_path(against)
    if path.is_dir():
        return inventory_of_tree(path), str(path)
    if path.is_file() and path.suffix == ".json":
        return load_manifest_file(path), str(path)
    root, _, _ = _fetch(args, repo, tree, against, expected_from="pin", new=False)
    return inventory_of_tree(root), against


def _report_path(repo: Path, tree: TreeFacts, old: str, new: str, option: Optional[str]) -> Optional[Path]:
    if option == "-":
        return None
    if option and option != "default":
        return _user_path(option)
    slug = lambda s: s.split(" ")[0].replace("/", "_")  # noqa: E731
    return repo / "docs" / "drop" / f"audit-{tree.arch}-{slug(old)}-to-{slug(new)}.md"


def _command_line() -> str:
    return "bazel run //tools:drop -- " + " ".join(sys.argv[1:])


def _emit(result: AuditResult, path: Optional[Path], command: str) -> None:
    print(render_terminal(result), end="")
    if path is not None:
        tx = Transaction(path.parent)
        tx.write(path, render_markdown(result, command))
        tx.commit()
        _log(f"report: {path}")


# ---- commands ---------------------------------------------------------------


def cmd_audit(args, repo: Path) -> int:
    if args.tree == "all" and (args.tree_root or args.wheel or args.report not in (None, "-")):
        raise UsageError("--tree-root / --wheel / --report need a single --tree")
    if args.report is None:
        args.report = "-"  # an audit only shows; a file only with --report PATH
    if sum(map(bool, (args.tree_root, args.version or args.wheel))) > 1:
        raise UsageError("--tree-root and --version / --wheel all name the new drop: pass one")
    args.sha256 = _check_sha(args.sha256)
    if args.wheel:
        _take_handover(args, args.sha256, "--sha256")
    code = EXIT_OK
    for tree in _trees(args.tree):
        location, fetched_sha = None, None
        if args.version:
            # A bump preview: the new drop from pip (or handed over), nothing in the repo rewritten. The wheel's own
            # hash decides which table rows are in use, as the bump's does: the same plan, so the bump reuses this
            # build stage's verdict.
            root, fetched_sha, loc = _fetch(args, repo, tree, args.version, args.sha256, "--sha256")
            how, new_label, location = f"wheel cache ({args.version})", args.version, loc.as_dict()
        else:
            root, how = pinned_tree_root(repo, tree, _cache_dir(args), args.tree_root, args.strip_prefix)
            new_label = str(root) if args.tree_root else _pin_label(repo, tree)
        real = real_tree_dir(root)
        _log(f"{tree.arch}: new drop from {how}: {real}")
        new_inv = inventory_of_tree(real)
        old_inv, old_label = _old_inventory(args, repo, tree, args.against, new_inv)
        contract = contract_mod.load_contract(contract_mod.contract_path(repo, tree.arch))
        result = run_audit(repo, tree, root, old_inv, new_inv, old_label, new_label, contract, location)
        sha = fetched_sha if args.version else _pinned_sha_if_same(repo, tree, new_inv)
        _build(args, repo, tree, root, result, sha)
        _emit(result, _report_path(repo, tree, old_label, new_label, args.report), _command_line())
        _tables(repo, tree, sha, new_label)
        code = _combine(code, result.exit_code())
    return code


def _pinned_sha_if_same(repo: Path, tree: TreeFacts, inventory: Inventory) -> Optional[str]:
    """The pinned wheel's sha256 when the tree is byte for byte the committed manifest's (its table rows are in
    use), else None."""
    path = manifest_path(repo, tree)
    if not path.is_file():
        return None
    pinned = load_manifest_file(path)
    if {r: e.sha256 for r, e in pinned.items()} != {r: e.sha256 for r, e in inventory.items()}:
        return None
    return manifest_mod.load_manifest(path).get("carrier_sha256")


def _build(args, repo: Path, tree: TreeFacts, root: Path, result: AuditResult, sha: Optional[str]) -> None:
    """The build stage (tools/drop/build_stage.py) unless --static-only: knob resolution at every token bucket, the
    numerical check, and compiles of every kernel class each backend can select unless --no-compile; its findings
    join the result. A stage left out is a warning: what it would have decided is not known."""
    if not result.backends:
        return
    if args.static_only:
        build_stage.note_skipped(result, "--static-only: no knob was resolved, no number checked, nothing compiled")
        return
    jobs = build_stage.plan_jobs(repo, tree.arch, result.all_pairs(), compile=not args.no_compile,
                                 compile_capacities=args.compile_capacities, drop_sha256=sha,
                                 compile_tables=args.compile_tables, resolve_capacities=args.resolve_capacities)
    classes = {p: b.classes for b in result.backends for p in b.pairs() if b.classes}
    # The directory behind Bazel's runfiles links: what the child imports is what the audit inventoried.
    report = build_stage.run_stage(repo, tree, real_tree_dir(root), jobs, classes=classes, compile=not args.no_compile,
                                   compile_jobs=args.compile_jobs, cache_dir=_cache_dir(args), rebuild=args.rebuild,
                                   log=_log)
    build_stage.apply_build(result, report)
    if args.no_compile:
        build_stage.note_skipped(result, "--no-compile: knobs resolved and numbers checked, nothing compiled")
    else:
        for (backend, fmt), name in build_stage.uncovered(report, classes):
            result.findings.append(Finding("build", "warn", f"{backend} [{fmt}] {name}",
                                           "not compiled: no knob set the heuristic or a shipped table gives selects "
                                           "it", (), ((backend, fmt),)))


def _tables(repo: Path, tree: TreeFacts, sha: Optional[str], label: str) -> None:
    """Shipped knob tables measured on another drop than the audited one (they are no longer used). `sha`: the
    audited wheel's, None when it is not known (a tree handed over as a directory)."""
    if sha:
        print(render_stale(stale_entries(repo, tree.arch, sha), tree.arch, label, table_entries(repo, tree.arch)),
              end="")


def _combine(a: int, b: int) -> int:
    rank = {EXIT_OK: 0, EXIT_SOME_BREAK: 1, EXIT_ALL_BREAK: 2}
    return a if rank.get(a, 0) >= rank.get(b, 0) else b


def _check_sha(value: Optional[str]) -> Optional[str]:
    if value is None:
        return None
    value = value.strip().lower()
    if not _SHA.match(value):
        raise UsageError(f"--sha256 must be 64 hex digits, got {value!r}")
    return value


def _command(sub: str, args, tree: TreeFacts, sha: Optional[str], *extra: str) -> str:
    """`bazel run //tools:drop -- <sub> ...` naming the new drop with this run's options, so that a suggested
    command finds the same wheel, tree and checkout (a handed-over wheel is in the wheel cache by now: its
    version names it)."""
    common = [f"--{o.replace('_', '-')} {getattr(args, o)}" for o in ("repo", "cache_dir") if getattr(args, o, None)]
    own = [f"--tree {tree.arch}", f"--version {args.version}"] + ([f"--sha256 {sha}"] if sha else [])
    if getattr(args, "strip_prefix", None):
        own.append(f"--strip-prefix {args.strip_prefix}")
    return " ".join(["bazel run //tools:drop --", *common, sub, *own, *extra])


def _next_steps(args, tree: TreeFacts, sha: str, result: AuditResult, report: Optional[Path], repo: Path) -> str:
    where = f" (report: {report.relative_to(repo) if report and report.is_relative_to(repo) else report})" if report else ""
    return (
        f"\nbump refused: {result.verdict()}{where}.\n"
        "Nothing but the report was written: the pin, the manifest, the contract and the docs are as they were.\n"
        "To go on:\n"
        f"  1. fix shim/ (the report names each shim line and the backends it breaks); check with\n"
        f"     {_command('audit', args, tree, sha)}\n"
        f"  2. accept: {_command('bump', args, tree, sha, '--accept-contract')}\n"
    )


def _byte_code_refusal(root: Path, strays: List[str]) -> str:
    # A cached extraction is checked file by file against its wheel before use (tools/drop/fetch.py), so compiled
    # files here come from the wheel itself.
    return (f"the wheel ships compiled files in its tree ({strays[:3]}{'...' if len(strays) > 3 else ''}, extracted "
            f"at {root}): a drop is pinned as Python sources, and byte code would run in their place (the shim's tree "
            "guard refuses it at load); ask the kernel team for a wheel without them")


def cmd_bump(args, repo: Path) -> int:
    tree = TREES[args.tree]
    if args.static_only:
        raise UsageError("a bump pins the drop, and the source checks alone cannot say it is compatible: bump runs "
                         "the build stage (--no-compile keeps it to knob resolution and the numerical check)")
    announced = _check_sha(args.sha256)
    _take_handover(args, announced, "--sha256 (announced)")
    bzl = workspace_bzl(repo)
    if not bzl.is_file():
        raise UsageError(f"{bzl} not found")
    text = bzl.read_text(encoding="utf-8")
    try:
        old_version, old_sha = read_pins(text, tree)
        read_strip_prefix(text, tree)
    except PinError as error:
        raise UsageError(str(error)) from error

    # 1. Fetch and verify: a hash other than the announced one is refused before anything is written.
    new_root, new_sha, location = _fetch(args, repo, tree, args.version, announced, "--sha256 (announced)")
    _log(f"{tree.arch}: {tree.arch} tree of flashinfer-python {args.version} (sha256 {new_sha}) at "
         f"{location.strip_prefix} ({location.how}{', MOVED from ' + location.expected.rstrip('/') if location.moved else ''})")
    if announced is None:
        _log(f"  no --sha256 given: pinning the wheel as found; compare {new_sha} with the announced hash")
    new_inv = inventory_of_tree(new_root)
    strays = [rel for rel in new_inv if is_compiled(rel)]
    if strays:
        raise UsageError(_byte_code_refusal(new_root, strays))

    # 2. The previous drop's files: the committed manifest records them exactly.
    manifest = manifest_path(repo, tree)
    if manifest.is_file():
        old_inv = load_manifest_file(manifest)
    else:
        old_root, _, _ = _fetch(args, repo, tree, old_version, old_sha, new=False)
        old_inv = inventory_of_tree(old_root)

    # 3. Audit against the accepted contract (with call sites, so a fixed shim passes).
    cpath = contract_mod.contract_path(repo, tree.arch)
    contract = contract_mod.load_contract(cpath)
    loc = location.as_dict()
    result = run_audit(repo, tree, new_root, old_inv, new_inv, old_version, args.version, contract, loc)
    _build(args, repo, tree, new_root, result, new_sha)
    report = _report_path(repo, tree, old_version, args.version, args.report)
    command = _command("bump", args, tree, announced, *(["--accept-contract"] if args.accept_contract else []))

    if result.breaks:
        _emit(result, report, command)
        _log(_next_steps(args, tree, new_sha, result, report, repo))
        return result.exit_code()

    # 4. Compatible: plan every write, then commit them together.
    tx = Transaction(repo)
    tx.write(bzl, rewrite_pins(text, tree, args.version, new_sha, location.strip_prefix if location.moved else None))
    tx.write(manifest, manifest_mod.dumps(manifest_mod.compute_manifest(new_root, args.version, new_sha)))
    if args.accept_contract:
        index = DropIndex(new_root)
        lazy = lazy_tables(repo, tree.arch, set(KERNEL_NAMES) | set(index.top_level_packages()))
        contract = contract_mod.build_contract(index, lazy, tree.arch, args.version)
        tx.write(cpath, contract_mod.dumps(contract))
        accepted = run_audit(repo, tree, new_root, old_inv, new_inv, old_version, args.version, contract, loc)
        if result.build is not None:
            build_stage.apply_build(accepted, result.build)
        _log("after accepting the contract: " + accepted.verdict())
    elif any(f.section == "signatures" and f.status != "ok" for f in result.findings):
        _log("signatures differ from the contract: review the report, then re-run bump with --accept-contract")
    docs = docs_mod.docs_path(repo, tree)
    tx.write(docs, docs_mod.render_docs(repo, tree, new_root, new_inv, (args.version, new_sha), contract,
                                        location.strip_prefix))
    print(render_terminal(result), end="")
    if report is not None:
        tx.write(report, render_markdown(result, command))
    written = tx.commit()
    for path in tx.paths:
        state = "written" if path in written else "unchanged"
        _log(f"{state}: {path.relative_to(repo) if path.is_relative_to(repo) else path}")
    if location.moved:
        _log(f"pinned the move: {tree.pin_prefix}_STRIP_PREFIX = {location.strip_prefix}")
    _tables(repo, tree, new_sha, args.version)
    return result.exit_code()


def cmd_manifest(args, repo: Path) -> int:
    """The manifest of a drop, from the wheel pip serves (hash-checked), in the committed format."""
    tree = TREES[args.tree]
    sha = _check_sha(args.sha256)
    _take_handover(args, sha, "--sha256")
    root, digest, location = _fetch(args, repo, tree, args.version, sha, "--sha256")
    data = manifest_mod.compute_manifest(root, args.version, digest)
    strays = [rel for rel in data["files"] if is_compiled(rel)]
    if strays:
        raise UsageError(_byte_code_refusal(root, strays))
    out = _user_path(args.out)
    tx = Transaction(out.parent)
    tx.write(out, manifest_mod.dumps(data))
    tx.commit()
    moved = f"; the tree MOVED from {location.expected.rstrip('/')} (pin the new STRIP_PREFIX)" if location.moved else ""
    _log(f"manifest: {out} ({len(data['files'])} files, {tree.arch} tree at {location.strip_prefix}{moved})")
    return EXIT_OK


def render_docs_for(repo: Path, tree: TreeFacts, cache_dir: Path, tree_root: Optional[str] = None) -> str:
    """docs/drop/<tree>.md as it should read now (used by `docs` and by docs_fresh_test)."""
    root, how = pinned_tree_root(repo, tree, cache_dir, tree_root)
    _log(f"{tree.arch}: pinned drop from {how}: {root}")
    contract = contract_mod.load_contract(contract_mod.contract_path(repo, tree.arch))
    return docs_mod.render_docs(repo, tree, root, inventory_of_tree(root), read_pins_file(repo, tree), contract,
                                _pinned_prefix(repo, tree))


def cmd_docs(args, repo: Path) -> int:
    if args.tree == "all" and args.tree_root:
        raise UsageError("--tree-root needs a single --tree")
    stale = []
    for tree in _trees(args.tree):
        text = render_docs_for(repo, tree, _cache_dir(args), args.tree_root)
        path = docs_mod.docs_path(repo, tree)
        if args.check:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                stale.append(path)
            continue
        tx = Transaction(repo)
        tx.write(path, text)
        tx.commit()
        _log(f"docs: {path.relative_to(repo)}")
    for path in stale:
        print(f"stale: {path.relative_to(repo)}; refresh with `{docs_mod.REFRESH_COMMAND}`")
    return EXIT_BREAK if stale else EXIT_OK


def cmd_layering(args, repo: Path) -> int:
    return layering_mod.main(repo)


def _capacities(text: str) -> Tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def _build_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("build stage", "the shim resolves knobs and compiles kernels against the new tree, on "
                                            "the CPU, in child processes (tools/drop/build_stage.py)")
    g.add_argument("--no-compile", action="store_true",
                   help="resolve knobs at every token bucket (seconds) but compile nothing")
    g.add_argument("--static-only", action="store_true", help="no build stage at all: the source checks alone")
    g.add_argument("--compile-jobs", type=int, default=1, metavar="N",
                   help="compile in N child processes at once (default 1; each compile takes a core for 7-14 s)")
    g.add_argument("--compile-tables", action="store_true",
                   help="also compile each distinct shipped knob-table row measured on this drop (sm90: a dozen)")
    g.add_argument("--compile-capacities", type=_capacities, default=build_stage.COMPILE_CAPACITIES,
                   metavar="C,C,...", help="capacities whose heuristic knobs are compiled per backend and format "
                                           f"(default {','.join(map(str, build_stage.COMPILE_CAPACITIES))}); every "
                                           "kernel class a backend can select is compiled besides")
    g.add_argument("--resolve-capacities", type=_capacities, default=build_stage.RESOLVE_CAPACITIES,
                   metavar="C,C,...", help="capacities whose knobs are resolved (default: both sides of every token "
                                           "bucket, 1 to 32769)")
    g.add_argument("--rebuild", action="store_true",
                   help="run the build stage even when the cache holds the verdict of the same tree, shim and plan")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tools/drop", description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", help="checkout to read and rewrite (default: $BUILD_WORKSPACE_DIRECTORY or the enclosing checkout)")
    p.add_argument("--cache-dir", help="wheel + extracted-tree cache (default: $MOE_EP_DROP_CACHE, else "
                                       "$XDG_CACHE_HOME/megamoe-ep/drop, else ~/.cache/megamoe-ep/drop)")
    sub = p.add_subparsers(dest="command", required=True)
    prefix_help = ("the tree's path inside the wheel, when finding it by content is ambiguous "
                   "(default: the pinned STRIP_PREFIX, or wherever the tree's files are)")
    wheel_help = ("a wheel the kernel team handed over (a file, or a directory holding one): hash-checked against "
                  "--sha256, put into the wheel cache, its version read from its name; pip is not asked")

    b = sub.add_parser("bump", help="fetch a new drop, audit it; re-pin it (pin, manifest, docs, report) only if the shim fits")
    b.add_argument("--tree", required=True, choices=sorted(TREES))
    b.add_argument("--version", help="the flashinfer-python version (fetched with pip unless --wheel)")
    b.add_argument("--wheel", help=wheel_help)
    b.add_argument("--sha256", help="the wheel's sha256 as the kernel team announced it: any other file is refused")
    b.add_argument("--accept-contract", action="store_true",
                   help="after reading the audit and fixing shim/: record the new signatures as the contract")
    b.add_argument("--report", help="markdown report path ('-' for none)")
    b.add_argument("--strip-prefix", help=prefix_help)
    _build_options(b)
    b.set_defaults(func=cmd_bump)

    a = sub.add_parser("audit", help="audit the pinned drop (or --tree-root / --version) against an older drop and the shim")
    a.add_argument("--tree", default="all", choices=sorted(TREES) + ["all"])
    a.add_argument("--against", help="older drop: a version (fetched via pip), a tree directory or a manifest .json "
                                     "(default: the committed manifest)")
    a.add_argument("--tree-root", help="audit this tree instead of the pinned one: its src/ root, or a directory "
                                       "holding it (an unpacked wheel: the tree is found by content)")
    a.add_argument("--version", help="audit this flashinfer-python version (fetched via pip) instead of the pinned "
                                     "one: a bump preview that rewrites nothing")
    a.add_argument("--wheel", help=wheel_help)
    a.add_argument("--sha256", help="with --version / --wheel: refuse a wheel with any other hash")
    a.add_argument("--strip-prefix", help=prefix_help)
    a.add_argument("--report", help="markdown report path ('-' for none)")
    _build_options(a)
    a.set_defaults(func=cmd_audit)

    m = sub.add_parser("manifest", help="write the per-file manifest of a drop's tree, from the hash-checked wheel")
    m.add_argument("--tree", required=True, choices=sorted(TREES))
    m.add_argument("--version", help="the flashinfer-python version (fetched with pip unless --wheel)")
    m.add_argument("--wheel", help=wheel_help)
    m.add_argument("--sha256", required=True, help="the wheel's sha256 (the pin): any other file is refused")
    m.add_argument("--out", required=True, help="where to write it (e.g. third_party/cutedsl_megamoe/sm90.manifest.json)")
    m.add_argument("--strip-prefix", help=prefix_help)
    m.set_defaults(func=cmd_manifest)

    d = sub.add_parser("docs", help="regenerate docs/drop/<tree>.md from the pinned drop")
    d.add_argument("--tree", default="all", choices=sorted(TREES) + ["all"])
    d.add_argument("--tree-root")
    d.add_argument("--check", action="store_true", help="only report stale docs (exit 1)")
    d.set_defaults(func=cmd_docs)

    lay = sub.add_parser("layering", help="check that only shim/ reaches the kernel trees")
    lay.set_defaults(func=cmd_layering)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0) and EXIT_USAGE
    repo = _user_path(args.repo).resolve() if args.repo else find_repo_root()
    if getattr(args, "sha256", None) and args.command == "audit" and not (args.version or args.wheel):
        print("tools/drop: error: --sha256 goes with --version or --wheel", file=sys.stderr)
        return EXIT_USAGE
    try:
        return args.func(args, repo)
    except (UsageError, PinError, FetchError, FileNotFoundError, ValueError) as error:
        print(f"tools/drop: error: {error}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
