"""tools/drop: bump, audit and document a kernel drop.

    bazel run //tools:drop -- bump --tree sm90 --version 0.7.4 [--accept-contract]
    bazel run //tools:drop -- audit [--tree sm90|sm100|all] [--against OLD] [--tree-root PATH]
    bazel run //tools:drop -- docs [--tree ...] [--check]
    bazel run //tools:drop -- layering

(or `python -m tools.drop ...` from the repo root). Exit codes: 0 clean or
changes that keep the shim working, 1 the shim would break (or a layering
violation / stale docs with --check), 2 usage or setup error.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import List, Optional, Tuple

from tools.drop import contract as contract_mod
from tools.drop import docs as docs_mod
from tools.drop import layering as layering_mod
from tools.drop.audit import AuditResult, run_audit
from tools.drop.fetch import FetchError, tree_for_version
from tools.drop.inventory import Inventory, inventory_of_tree, load_manifest_file
from tools.drop.manifests import manifest_path, write_manifest
from tools.drop.pins import PinError, read_pins, read_pins_file, rewrite_pins, workspace_bzl
from tools.drop.report import render_markdown, render_terminal
from tools.drop.shim_scan import lazy_tables
from tools.drop.source_model import DropIndex
from tools.drop.trees import KERNEL_TOP_LEVEL, TREES, Tree, find_repo_root, runfiles_tree_root

__all__ = ["main"]

EXIT_OK, EXIT_BREAK, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    pass


def _log(msg: str) -> None:
    print(msg, file=sys.stderr)


def default_cache_dir(repo: Path) -> Path:
    if os.environ.get("MOE_EP_DROP_CACHE"):
        return Path(os.environ["MOE_EP_DROP_CACHE"])
    return Path(repo) / ".drop"  # git-ignored


def _cache_dir(args, repo: Path) -> Path:
    return Path(args.cache_dir).resolve() if args.cache_dir else default_cache_dir(repo)


def _trees(name: str) -> List[Tree]:
    return list(TREES.values()) if name == "all" else [TREES[name]]


def pinned_tree_root(repo: Path, tree: Tree, cache_dir: Path, explicit: Optional[str] = None) -> Tuple[Path, str]:
    """(root, how found) of the pinned drop tree, without importing anything from it."""
    if explicit:
        root = Path(explicit).resolve()
        if not root.is_dir():
            raise UsageError(f"--tree-root {root} is not a directory")
        return root, "--tree-root"
    env = os.environ.get(tree.env_var)
    if env and Path(env).is_dir():
        return Path(env), f"${tree.env_var}"
    root = runfiles_tree_root(tree)
    if root is not None:
        return root, f"@{tree.bazel_repo} (runfiles)"
    pins = read_pins_file(repo, tree)
    if pins is None:
        raise UsageError(f"no pin in {workspace_bzl(repo)}; pass --tree-root or set ${tree.env_var}")
    version, sha = pins
    root, _ = tree_for_version(version, tree, cache_dir, expected_sha256=sha, log=_log)
    return root, f"pip cache ({version}, sha256 verified)"


def _pin_label(repo: Path, tree: Tree) -> str:
    pins = read_pins_file(repo, tree)
    return pins[0] if pins else "unpinned"


def _old_inventory(args, repo: Path, tree: Tree, against: Optional[str], new_inv: Inventory) -> Tuple[Inventory, str]:
    if against is None:
        manifest = manifest_path(repo, tree)
        if manifest.is_file():
            return load_manifest_file(manifest), f"{_pin_label(repo, tree)} (manifest)"
        return new_inv, _pin_label(repo, tree)
    path = Path(against)
    if path.is_dir():
        return inventory_of_tree(path), str(path)
    if path.is_file() and path.suffix == ".json":
        return load_manifest_file(path), str(path)
    root, _ = tree_for_version(against, tree, _cache_dir(args, repo), log=_log)
    return inventory_of_tree(root), against


def _report_path(repo: Path, tree: Tree, old: str, new: str, option: Optional[str]) -> Optional[Path]:
    if option == "-":
        return None
    if option:
        # Under `bazel run` the process starts in the runfiles tree: resolve relative to the caller's cwd.
        p = Path(option)
        cwd = os.environ.get("BUILD_WORKING_DIRECTORY")
        return p if p.is_absolute() or not cwd else Path(cwd) / p
    slug = lambda s: s.split(" ")[0].replace("/", "_")  # noqa: E731
    return repo / "docs" / "drop" / f"audit-{tree.name}-{slug(old)}-to-{slug(new)}.md"


def _emit(result: AuditResult, path: Optional[Path], command: str) -> None:
    print(render_terminal(result), end="")
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(render_markdown(result, command), encoding="utf-8")
        _log(f"report: {path}")


# ---- commands ---------------------------------------------------------------


def cmd_audit(args, repo: Path) -> int:
    if args.tree == "all" and (args.tree_root or args.report not in (None, "-")):
        raise UsageError("--tree-root / --report need a single --tree")
    if args.version and args.report is None and args.against is None:
        args.report = "-"  # a preview writes no file unless asked
    if args.tree_root and args.version:
        raise UsageError("--tree-root and --version both name the new drop: pass one")
    code = EXIT_OK
    for tree in _trees(args.tree):
        if args.version:
            # A bump preview: the new drop from pip, nothing in the repo rewritten.
            root, _ = tree_for_version(args.version, tree, _cache_dir(args, repo), log=_log)
            how, new_label = f"pip cache ({args.version})", args.version
        else:
            root, how = pinned_tree_root(repo, tree, _cache_dir(args, repo), args.tree_root)
            new_label = str(root) if args.tree_root else _pin_label(repo, tree)
        _log(f"{tree.name}: new drop from {how}: {root}")
        new_inv = inventory_of_tree(root)
        old_inv, old_label = _old_inventory(args, repo, tree, args.against, new_inv)
        contract = contract_mod.load_contract(contract_mod.contract_path(repo, tree.name))
        result = run_audit(repo, tree, root, old_inv, new_inv, old_label, new_label, contract)
        _emit(result, _report_path(repo, tree, old_label, new_label, args.report), "bazel run //tools:drop -- audit " + " ".join(sys.argv[2:]))
        code = max(code, result.exit_code())
    return code


def cmd_bump(args, repo: Path) -> int:
    tree = TREES[args.tree]
    bzl = workspace_bzl(repo)
    if not bzl.is_file():
        raise UsageError(f"{bzl} not found")
    text = bzl.read_text(encoding="utf-8")
    try:
        old_version, old_sha = read_pins(text, tree)
    except PinError as error:
        raise UsageError(str(error)) from error
    cache = _cache_dir(args, repo)

    new_root, new_sha = tree_for_version(args.version, tree, cache, log=_log)
    _log(f"{tree.name}: flashinfer-python {args.version} sha256 {new_sha}")
    new_inv = inventory_of_tree(new_root)

    # The previous drop's files: the committed manifest records them exactly,
    # so the old wheel need not be fetched.
    manifest = manifest_path(repo, tree)
    if manifest.is_file():
        old_inv = load_manifest_file(manifest)
    else:
        old_root, _ = tree_for_version(old_version, tree, cache, expected_sha256=old_sha, log=_log)
        old_inv = inventory_of_tree(old_root)

    bzl.write_text(rewrite_pins(text, tree, args.version, new_sha), encoding="utf-8")
    _log(f"pin: {bzl.relative_to(repo)} {tree.pin_prefix}_VERSION {old_version} -> {args.version}")
    write_manifest(repo, tree, new_root, args.version, new_sha)
    _log(f"manifest: {manifest.relative_to(repo)} regenerated ({len(new_inv)} files)")

    cpath = contract_mod.contract_path(repo, tree.name)
    contract = contract_mod.load_contract(cpath)
    result = run_audit(repo, tree, new_root, old_inv, new_inv, old_version, args.version, contract)
    _emit(result, _report_path(repo, tree, old_version, args.version, args.report), f"bazel run //tools:drop -- bump --tree {tree.name} --version {args.version}")

    if args.accept_contract:
        index = DropIndex(new_root)
        lazy = lazy_tables(repo, tree.name, set(KERNEL_TOP_LEVEL) | set(index.top_level_packages()))
        contract_mod.save_contract(cpath, contract_mod.build_contract(index, lazy, tree.name, args.version))
        _log(f"contract: {cpath.relative_to(repo)} accepted for {args.version}")
        contract = contract_mod.load_contract(cpath)
        result = run_audit(repo, tree, new_root, old_inv, new_inv, old_version, args.version, contract)
        print("after accepting the contract: " + result.verdict())
    elif any(f.section == "signatures" and f.status != "ok" for f in result.findings):
        _log("signatures differ from the contract: fix shim/, then re-run bump with --accept-contract")

    out = docs_mod.docs_path(repo, tree)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        docs_mod.render_docs(repo, tree, new_root, new_inv, (args.version, new_sha), contract), encoding="utf-8"
    )
    _log(f"docs: {out.relative_to(repo)} regenerated")
    return result.exit_code()


def render_docs_for(repo: Path, tree: Tree, cache_dir: Path, tree_root: Optional[str] = None) -> str:
    """docs/drop/<tree>.md as it should read now (used by `docs` and by docs_fresh_test)."""
    root, how = pinned_tree_root(repo, tree, cache_dir, tree_root)
    _log(f"{tree.name}: pinned drop from {how}: {root}")
    contract = contract_mod.load_contract(contract_mod.contract_path(repo, tree.name))
    return docs_mod.render_docs(repo, tree, root, inventory_of_tree(root), read_pins_file(repo, tree), contract)


def cmd_docs(args, repo: Path) -> int:
    if args.tree == "all" and args.tree_root:
        raise UsageError("--tree-root needs a single --tree")
    stale = []
    for tree in _trees(args.tree):
        text = render_docs_for(repo, tree, _cache_dir(args, repo), args.tree_root)
        path = docs_mod.docs_path(repo, tree)
        if args.check:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                stale.append(path)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        _log(f"docs: {path.relative_to(repo)}")
    for path in stale:
        print(f"stale: {path.relative_to(repo)}; refresh with `{docs_mod.REFRESH_COMMAND}`")
    return EXIT_BREAK if stale else EXIT_OK


def cmd_layering(args, repo: Path) -> int:
    return layering_mod.main(repo)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tools/drop", description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", help="checkout to read and rewrite (default: $BUILD_WORKSPACE_DIRECTORY or the enclosing checkout)")
    p.add_argument("--cache-dir", help="wheel + extracted-tree cache (default: $MOE_EP_DROP_CACHE or <repo>/.drop)")
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("bump", help="fetch a new drop, re-pin it, regenerate its manifest and docs, audit it")
    b.add_argument("--tree", required=True, choices=sorted(TREES))
    b.add_argument("--version", required=True)
    b.add_argument("--accept-contract", action="store_true",
                   help="after reading the audit and fixing shim/: record the new signatures as the contract")
    b.add_argument("--report", help="markdown report path ('-' for none)")
    b.set_defaults(func=cmd_bump)

    a = sub.add_parser("audit", help="audit the pinned drop (or --tree-root) against an older drop and the shim")
    a.add_argument("--tree", default="all", choices=sorted(TREES) + ["all"])
    a.add_argument("--against", help="older drop: a version (fetched via pip), a tree directory or a manifest .json "
                                     "(default: the committed manifest)")
    a.add_argument("--tree-root", help="audit this extracted tree instead of the pinned one")
    a.add_argument("--version", help="audit this flashinfer-python version (fetched via pip) instead of the pinned "
                                     "one: a bump preview that rewrites nothing")
    a.add_argument("--report", help="markdown report path ('-' for none)")
    a.set_defaults(func=cmd_audit)

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
    repo = Path(args.repo).resolve() if args.repo else find_repo_root()
    try:
        return args.func(args, repo)
    except (UsageError, PinError, FetchError, FileNotFoundError, ValueError) as error:
        print(f"tools/drop: error: {error}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
