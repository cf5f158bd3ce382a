"""The command line end to end on synthetic repos and wheels: exit codes, pins, bump, manifest."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.tools.drop import synthetic
from third_party.cutedsl_megamoe.manifest import compute_manifest, diff_manifest, dumps, file_digests
from tools.drop import cli, fetch
from tools.drop.fetch import HashMismatch, locate_tree, sha256_file
from tools.drop.pins import PinError, read_pins, read_strip_prefix, rewrite_pins
from tools.drop.transaction import Transaction
from shim.common.tree_facts import TREES

SM90 = TREES["sm90"]
SHA_A = "a" * 64
SHA_B = "b" * 64
PREFIX = synthetic.WHEEL_PREFIX_SM90
MOVED = "flashinfer/moe_ep/kernel_src/hopper/cutedsl_megamoe/src"
KERNEL = "moe_hopper_fp8/megamoe_kernel_fp8.py"
# The synthetic shim is source only (it raises on import), so the build stage, which runs the shim against the tree,
# is left out of these runs (no child is started); it has its own tests on the real shim and tree
# (build_stage_test, binary_test). What --static-only does is tested apart.
STATIC = "--static-only"
_REAL_BUILD = cli._build


@pytest.fixture(autouse=True)
def _isolated(monkeypatch):
    # Nothing from the environment may point the tool at a real tree or cache.
    for var in ("MOE_EP_SM90_TREE", "MOE_EP_SM100_TREE", "MOE_EP_DROP_CACHE", "BUILD_WORKSPACE_DIRECTORY",
                "BUILD_WORKING_DIRECTORY", "RUNFILES_DIR", "TEST_SRCDIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(cli, "_build", lambda *args, **kwargs: None)


# ---- pins -------------------------------------------------------------------

PINS = synthetic.WORKSPACE_BZL.format(v90="1.0", s90=SHA_A, v100="1.0", s100=SHA_A)


def test_rewrite_pins_touches_exactly_the_pin_lines():
    out = rewrite_pins(PINS, SM90, "2.0", SHA_B)
    changed = [(a, b) for a, b in zip(PINS.splitlines(), out.splitlines()) if a != b]
    assert changed == [
        ('SM90_VERSION = "1.0"', 'SM90_VERSION = "2.0"'),
        (f'SM90_SHA256 = "{SHA_A}"', f'SM90_SHA256 = "{SHA_B}"'),
    ]
    assert read_pins(out, SM90) == ("2.0", SHA_B)
    assert read_pins(out, TREES["sm100"]) == ("1.0", SHA_A)
    moved = rewrite_pins(PINS, SM90, "2.0", SHA_B, MOVED)
    assert read_strip_prefix(moved, SM90) == MOVED
    assert read_strip_prefix(moved, TREES["sm100"]) == "flashinfer/moe_ep/kernel_src/sm100/cutedsl_megamoe/src"
    assert len([1 for a, b in zip(PINS.splitlines(), moved.splitlines()) if a != b]) == 3


@pytest.mark.parametrize(
    "text",
    [
        PINS.replace('SM90_VERSION = "1.0"\n', ""),  # missing
        PINS + 'SM90_SHA256 = "' + SHA_B + '"\n',  # duplicated
    ],
)
def test_pins_must_be_exactly_one_line_each(text):
    with pytest.raises(PinError):
        rewrite_pins(text, SM90, "2.0", SHA_B)


def test_rewrite_rejects_a_non_digest_and_an_unpinnable_move():
    with pytest.raises(PinError):
        rewrite_pins(PINS, SM90, "2.0", "not-a-sha")
    no_prefix = "\n".join(line for line in PINS.splitlines() if not line.startswith("SM90_STRIP"))
    with pytest.raises(PinError, match="no `SM90_STRIP_PREFIX"):
        rewrite_pins(no_prefix, SM90, "2.0", SHA_B, MOVED)


# ---- audit exit codes -----------------------------------------------------------


@pytest.fixture
def repo_and_drops(tmp_path):
    repo = synthetic.make_shim(tmp_path / "repo")
    old = synthetic.make_drop(tmp_path / "old")
    new = synthetic.copy_drop(old, tmp_path / "new")
    return repo, old, new


def test_audit_exit_codes(repo_and_drops, tmp_path, capsys):
    repo, old, new = repo_and_drops
    args = ["--repo", str(repo), "audit", "--tree", "sm90", "--tree-root", str(new), "--against", str(old)]
    assert cli.main(args) == 0
    assert not (repo / "docs").exists()  # an audit only shows, unless --report PATH
    shutil.rmtree(new / "moe_hopper_bf16")
    assert cli.main(args + ["--report", str(tmp_path / "some.md")]) == 3  # only the BF16 backend breaks
    assert "exit 3 (some backends break)" in (tmp_path / "some.md").read_text()
    synthetic.edit(new, "moe_hopper_fp8/heuristic_config.py", "def select_heuristic_config(", "def select_config(")
    capsys.readouterr()
    assert cli.main(args) == 1  # an eager import every backend loads: all break
    out = capsys.readouterr().out
    assert "ALL BACKENDS BREAK (2 of 2)" in out and "did you mean select_config?" in out


def test_usage_errors_exit_2(repo_and_drops, capsys):
    repo, old, new = repo_and_drops
    assert cli.main(["--repo", str(repo), "audit", "--tree", "sm7"]) == 2  # argparse
    assert cli.main(["--repo", str(repo), "frobnicate"]) == 2
    # no workspace.bzl pin and no tree given
    assert cli.main(["--repo", str(repo), "audit", "--tree", "sm90"]) == 2
    assert cli.main(["--repo", str(repo), "audit", "--tree", "all", "--tree-root", str(new)]) == 2
    assert cli.main(["--repo", str(repo), "bump", "--tree", "sm90", "--version", "2.0", "--sha256", "xyz"]) == 2
    assert "error" in capsys.readouterr().err


def test_docs_check_detects_stale_docs(repo_and_drops, capsys):
    repo, _, new = repo_and_drops
    base = ["--repo", str(repo), "docs", "--tree", "sm90", "--tree-root", str(new)]
    assert cli.main(base) == 0
    written = (repo / "docs" / "drop" / "sm90.md").read_text()
    assert "select_heuristic_config" in written and "moe_hopper_fp8/heuristic_config.py" in written
    assert cli.main(base + ["--check"]) == 0
    # The shim names one more kernel symbol: the committed page no longer matches.
    synthetic.edit(repo, "shim/sm90/kernel_symbols.py", "import TABLE,", "import TABLE, TileConfig,")
    capsys.readouterr()
    assert cli.main(base + ["--check"]) == 1
    assert "stale: docs/drop/sm90.md; refresh with `bazel run //tools:drop -- docs`" in capsys.readouterr().out


# ---- bump ---------------------------------------------------------------------


def wheel(cache: Path, version: str, files, prefix: str = PREFIX, extra=None) -> Path:
    return synthetic.make_wheel(cache / "wheels" / f"flashinfer_python-{version}-py3-none-any.whl", prefix, files, extra)


def drop_files(edit=None):
    files = dict(synthetic.BASE_DROP)
    if edit:
        edit(files)
    return files


@pytest.fixture
def bump_world(tmp_path):
    """A repo pinned to synthetic drop 1.0 (manifest, contract, docs accepted), wheels in the tool's cache."""
    repo = synthetic.make_shim(tmp_path / "repo")
    cache = tmp_path / "cache"
    w1 = wheel(cache, "1.0", drop_files())
    bzl = repo / "third_party" / "cutedsl_megamoe" / "workspace.bzl"
    bzl.parent.mkdir(parents=True)
    bzl.write_text(synthetic.WORKSPACE_BZL.format(v90="1.0", s90=sha256_file(w1), v100="0.9", s100=SHA_A))
    assert run(repo, cache, "bump", "--tree", "sm90", "--version", "1.0", "--accept-contract", "--report", "-") == 0
    return repo, cache


def run(repo: Path, cache: Path, *args: str) -> int:
    return cli.main(["--repo", str(repo), "--cache-dir", str(cache), *args])


def bump(repo, cache, version, *extra):
    return run(repo, cache, "bump", "--tree", "sm90", *(["--version", version] if version else []), *extra)


def without_bf16(files):
    for rel in [r for r in files if r.startswith("moe_hopper_bf16/")]:
        del files[rel]


def changed(before, after):
    return sorted(set(before) ^ set(after) | {k for k in before if k in after and before[k] != after[k]})


def test_bump_refuses_a_hash_other_than_the_announced_one(bump_world, capsys):
    repo, cache = bump_world
    w2 = wheel(cache, "2.0", drop_files(lambda f: f.update({"moe_hopper_fp8/extra.py": "X = 1\n"})))
    before = synthetic.snapshot(repo)
    capsys.readouterr()
    assert bump(repo, cache, "2.0", "--sha256", SHA_B) == 2
    err = capsys.readouterr().err
    assert SHA_B in err and sha256_file(w2) in err and "nothing was written" in err
    assert synthetic.snapshot(repo) == before
    assert bump(repo, cache, "2.0", "--sha256", sha256_file(w2).upper()) == 0  # the announced hash, as typed


def test_a_downloaded_wheel_with_the_wrong_hash_never_enters_the_cache(tmp_path, monkeypatch):
    payload = synthetic.make_wheel(tmp_path / "served.whl", PREFIX, synthetic.BASE_DROP)

    def fake_pip(cmd, **kw):  # what pip download does: put the file into -d
        dest = Path(cmd[cmd.index("-d") + 1])
        shutil.copy(payload, dest / "flashinfer_python-3.0-py3-none-any.whl")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(fetch.subprocess, "run", fake_pip)
    cache = tmp_path / "cache"
    with pytest.raises(HashMismatch) as refused:
        fetch.fetch_wheel("3.0", cache, log=lambda m: None, expected_sha256=SHA_A, expected_from="--sha256")
    assert SHA_A in str(refused.value) and sha256_file(payload) in str(refused.value)
    assert fetch.cached_wheel("3.0", cache) is None and list((cache / "wheels").iterdir()) == []
    path, digest = fetch.fetch_wheel("3.0", cache, log=lambda m: None, expected_sha256=sha256_file(payload))
    assert digest == sha256_file(payload) and fetch.cached_wheel("3.0", cache) == path


def test_breaking_bump_writes_only_its_report(bump_world, capsys):
    repo, cache = bump_world
    w2 = wheel(cache, "2.0", drop_files(without_bf16))
    before = synthetic.snapshot(repo)
    capsys.readouterr()
    assert bump(repo, cache, "2.0", "--sha256", sha256_file(w2)) == 3
    err = capsys.readouterr().err
    assert changed(before, synthetic.snapshot(repo)) == ["docs/drop/audit-sm90-1.0-to-2.0.md"]
    assert "Nothing but the report was written" in err and "--accept-contract" in err and "To go on" in err
    report = (repo / "docs" / "drop" / "audit-sm90-1.0-to-2.0.md").read_text()
    assert "| sm90_bf16 | bf16 | BREAK |" in report and "| sm90_fp8 | fp8_block | ok | 0 |" in report
    assert "shim/sm90/bf16_frontend.py:10" in report


def test_accept_only_once_the_shim_fits(bump_world, capsys):
    repo, cache = bump_world
    gone = '        token_back_mode: Literal["epi_warps", "standalone_warps"] = "epi_warps",\n'
    w2 = wheel(cache, "2.0", drop_files(lambda f: f.update({KERNEL: f[KERNEL].replace(gone, "")})))
    sha = sha256_file(w2)
    contract = repo / "tools" / "drop" / "contracts" / "sm90.json"
    before = synthetic.snapshot(repo)
    assert bump(repo, cache, "2.0", "--sha256", sha) == 3
    # Accepting does not paper over a shim that still passes the removed parameter.
    assert bump(repo, cache, "2.0", "--sha256", sha, "--accept-contract") == 3
    assert changed(before, synthetic.snapshot(repo)) == ["docs/drop/audit-sm90-1.0-to-2.0.md"]
    # Fix the shim: only the BF16 kernel still takes token_back_mode.
    synthetic.edit(repo, "shim/sm90/frontend.py", "            token_back_mode=knobs.token_back_mode,\n", "")
    synthetic.edit(repo, "shim/sm90/bf16_frontend.py", "    def activation_args(self, x):",
                   "    def format_kwargs(self, knobs):\n        return dict(token_back_mode=knobs.token_back_mode)\n\n"
                   "    def activation_args(self, x):")
    synthetic.edit(repo, "shim/sm90/knobs.py", '        "token_back_mode": ["epi_warps", "standalone_warps"],\n    },\n    "Sm90MegaMoEBf16',
                   '    },\n    "Sm90MegaMoEBf16')
    capsys.readouterr()
    assert bump(repo, cache, "2.0", "--sha256", sha, "--accept-contract") == 0
    accepted = json.loads(contract.read_text())
    assert accepted["accepted_version"] == "2.0"
    params = [p["name"] for p in accepted["classes"]["Sm90MegaMoEFp8Kernel"]["methods"]["__init__"]["params"]]
    assert "token_back_mode" not in params and "hidden" in params
    assert read_pins((repo / "third_party" / "cutedsl_megamoe" / "workspace.bzl").read_text(), SM90) == ("2.0", sha)
    # After acceptance the pinned drop audits clean against its own manifest, and the docs are fresh.
    assert run(repo, cache, "audit", "--tree", "sm90") == 0
    assert run(repo, cache, "docs", "--tree", "sm90", "--check") == 0


def test_a_new_launch_parameter_is_accepted_once_the_shim_passes_it(bump_world, capsys):
    # Upstream's fc1_c: a required __call__ parameter inserted mid-signature shifts every later one. The shim
    # passes launch arguments by keyword, so the shift is harmless; the missing argument is not, until the shim
    # passes it, and then the documented fix-then-accept steps finish.
    repo, cache = bump_world
    inserted = "activation, activation_sf, fc1_c, topk_idx"
    w2 = wheel(cache, "2.0", drop_files(lambda f: f.update({KERNEL: f[KERNEL].replace(
        "activation, activation_sf, topk_idx", inserted)})))
    sha = sha256_file(w2)
    capsys.readouterr()
    assert bump(repo, cache, "2.0", "--sha256", sha) == 3
    report = (repo / "docs" / "drop" / "audit-sm90-1.0-to-2.0.md").read_text()
    assert "new required parameter fc1_c; no shim line passes it" in report
    assert "positional index shifted: topk_idx" in report and "every shim call site passes them by keyword" in report
    assert bump(repo, cache, "2.0", "--sha256", sha, "--accept-contract") == 3  # not before the shim is fixed
    synthetic.edit(repo, "shim/sm90/fp8_frontend.py", "return dict(activation=x, activation_sf=self.scales)",
                   "return dict(activation=x, activation_sf=self.scales, fc1_c=self.fc1_c)")
    assert bump(repo, cache, "2.0", "--sha256", sha, "--accept-contract") == 0
    accepted = json.loads((repo / "tools" / "drop" / "contracts" / "sm90.json").read_text())
    call = [p["name"] for p in accepted["classes"]["Sm90MegaMoEFp8Kernel"]["methods"]["__call__"]["params"]]
    assert call[:3] == ["activation", "activation_sf", "fc1_c"]
    assert run(repo, cache, "audit", "--tree", "sm90") == 0


def test_compatible_bump_rewrites_pin_manifest_docs_and_report_together(bump_world):
    repo, cache = bump_world
    w2 = wheel(cache, "2.0", drop_files(lambda f: f.update({"moe_hopper_fp8/extra.py": "X = 1\n"})))
    assert bump(repo, cache, "2.0") == 0  # no --sha256: pins what pip served (and says so)
    bzl = (repo / "third_party" / "cutedsl_megamoe" / "workspace.bzl").read_text()
    assert read_pins(bzl, SM90) == ("2.0", sha256_file(w2)) and read_pins(bzl, TREES["sm100"]) == ("0.9", SHA_A)
    manifest = json.loads((repo / "third_party" / "cutedsl_megamoe" / "sm90.manifest.json").read_text())
    assert manifest == compute_manifest(cache / "trees" / "2.0" / "sm90", "2.0", sha256_file(w2))
    assert "flashinfer-python 2.0" in (repo / "docs" / "drop" / "sm90.md").read_text()
    assert "moe_hopper_fp8/extra.py" in (repo / "docs" / "drop" / "audit-sm90-1.0-to-2.0.md").read_text()


def test_interrupted_bump_leaves_the_tree_as_it_was(bump_world, monkeypatch):
    repo, cache = bump_world
    wheel(cache, "2.0", drop_files(lambda f: f.update({"moe_hopper_fp8/extra.py": "X = 1\n"})))
    before = synthetic.snapshot(repo)
    calls = []

    def flaky(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt  # Ctrl-C between two of the bump's renames
        return os.replace(src, dst)

    monkeypatch.setattr(Transaction, "replace", staticmethod(flaky))
    with pytest.raises(KeyboardInterrupt):
        bump(repo, cache, "2.0")
    assert len(calls) == 2  # one file had been replaced already, and was put back
    assert synthetic.snapshot(repo) == before


def moved_world(tmp_path, decoy=True):
    """Wheel 2.0 whose sm90 tree moved; a second tree with the same package names as a decoy."""
    repo = synthetic.make_shim(tmp_path / "repo")
    cache = tmp_path / "cache"
    w1 = wheel(cache, "1.0", drop_files())
    decoy_files = {f"flashinfer/moe_ep/kernel_src/other/src/{rel}": "# other tree\n" for rel in synthetic.BASE_DROP} if decoy else {}
    w2 = wheel(cache, "2.0", drop_files(lambda f: f.update({"moe_hopper_fp8/extra.py": "X = 1\n"})), MOVED, decoy_files)
    bzl = repo / "third_party" / "cutedsl_megamoe" / "workspace.bzl"
    bzl.parent.mkdir(parents=True)
    bzl.write_text(synthetic.WORKSPACE_BZL.format(v90="1.0", s90=sha256_file(w1), v100="0.9", s100=SHA_A))
    assert run(repo, cache, "bump", "--tree", "sm90", "--version", "1.0", "--accept-contract", "--report", "-") == 0
    return repo, cache, w2


def test_moved_tree_is_found_reported_and_pinned(tmp_path, capsys):
    repo, cache, w2 = moved_world(tmp_path)
    capsys.readouterr()
    assert run(repo, cache, "audit", "--tree", "sm90", "--version", "2.0") == 0
    assert f"MOVED from {PREFIX}" in capsys.readouterr().out
    assert bump(repo, cache, "2.0", "--sha256", sha256_file(w2)) == 0
    bzl = (repo / "third_party" / "cutedsl_megamoe" / "workspace.bzl").read_text()
    assert read_strip_prefix(bzl, SM90) == MOVED and read_pins(bzl, SM90) == ("2.0", sha256_file(w2))
    assert f"tree moved inside the wheel: {PREFIX} -> {MOVED}" in (repo / "docs" / "drop" / "audit-sm90-1.0-to-2.0.md").read_text()
    assert f"- sub-tree: `{MOVED}/`" in (repo / "docs" / "drop" / "sm90.md").read_text()


def test_locate_tree_by_content(tmp_path):
    reference = {rel: fetch.hashlib.sha256(text.encode()).hexdigest() for rel, text in synthetic.BASE_DROP.items()}
    same_names = {f"x/decoy/{rel}": "# not the tree\n" for rel in synthetic.BASE_DROP}
    w = synthetic.make_wheel(tmp_path / "w.whl", MOVED, synthetic.BASE_DROP, same_names)
    loc = locate_tree(w, SM90, reference, PREFIX)
    assert (loc.prefix, loc.moved, loc.how) == (MOVED + "/", True, "by content")
    # At the expected path it stays there; without a reference the package names decide.
    w = synthetic.make_wheel(tmp_path / "w2.whl", PREFIX, synthetic.BASE_DROP)
    assert locate_tree(w, SM90, reference, PREFIX).moved is False
    assert locate_tree(w, SM90, None, PREFIX).prefix == PREFIX + "/"
    with pytest.raises(fetch.FetchError, match="equally well"):
        twin = {f"a/src/{rel}": text for rel, text in synthetic.BASE_DROP.items()}
        locate_tree(synthetic.make_wheel(tmp_path / "w3.whl", "b/src", synthetic.BASE_DROP, twin), SM90, reference, PREFIX)


# ---- manifest ---------------------------------------------------------------------


def test_manifest_subcommand(bump_world, tmp_path, capsys):
    repo, cache = bump_world
    w2 = wheel(cache, "2.0", drop_files(lambda f: f.update({"moe_hopper_fp8/extra.py": "X = 1\n"})), MOVED)
    out = tmp_path / "m.json"
    args = ["manifest", "--tree", "sm90", "--version", "2.0", "--out", str(out)]
    assert run(repo, cache, *args, "--sha256", SHA_B) == 2 and not out.exists()
    assert run(repo, cache, *args, "--sha256", sha256_file(w2)) == 0
    assert out.read_text() == dumps(compute_manifest(cache / "trees" / "2.0" / "sm90", "2.0", sha256_file(w2)))
    assert "moe_hopper_fp8/extra.py" in json.loads(out.read_text())["files"]
    assert "MOVED" in capsys.readouterr().err


def test_manifest_check_reports_stray_compiled_files(tmp_path):
    root = synthetic.make_drop(tmp_path / "tree")
    clean = compute_manifest(root, "1.0", SHA_A)
    synthetic.write_tree(root, {"common/__pycache__/x.cpython-311.pyc": "b", "src/old.pyc": "c"})
    (root / "BUILD.bazel").write_text("# added by drop_repo.bzl, not a stray\n")
    diff = diff_manifest(clean, compute_manifest(root, "1.0", SHA_A))
    assert (diff.changed, diff.added, diff.removed) == ([], ["common/__pycache__/x.cpython-311.pyc", "src/old.pyc"], [])
    assert "src/old.pyc" in file_digests(root)


def test_pinned_tree_from_cache_is_hash_checked(bump_world):
    repo, cache = bump_world
    # The pin now names a digest no cached wheel has: the extracted tree in the
    # cache must not be trusted, and the wheel behind it fails the check.
    bzl = repo / "third_party" / "cutedsl_megamoe" / "workspace.bzl"
    bzl.write_text(rewrite_pins(bzl.read_text(), SM90, "1.0", SHA_B))
    assert run(repo, cache, "audit", "--tree", "sm90") == 2


def test_audit_sees_strays_behind_bazel_runfiles_links(bump_world, tmp_path):
    repo, cache = bump_world
    real = synthetic.make_drop(tmp_path / "external" / "cutedsl_megamoe_sm90")
    (real / "carrier.json").write_text("{}")
    links = tmp_path / "runfiles" / "cutedsl_megamoe_sm90"
    for rel in list(synthetic.BASE_DROP) + ["carrier.json"]:
        (links / rel).parent.mkdir(parents=True, exist_ok=True)
        (links / rel).symlink_to(real / rel)
    assert cli.real_tree_dir(links) == real
    # The runfiles of the real binary hold only what the BUILD file globs: no carrier.json to follow.
    bare = tmp_path / "runfiles2" / "cutedsl_megamoe_sm90"
    for rel in synthetic.BASE_DROP:
        (bare / rel).parent.mkdir(parents=True, exist_ok=True)
        (bare / rel).symlink_to(real / rel)
    assert cli.real_tree_dir(bare) == real
    (real / "src" / "__pycache__").mkdir()
    (real / "src" / "__pycache__" / "sym_buffer.cpython-311.pyc").write_text("stale")
    # Not in the links (the BUILD globs leave __pycache__ out), but in the directory behind them.
    assert run(repo, cache, "audit", "--tree", "sm90", "--tree-root", str(links), "--report", str(tmp_path / "r.md")) == 0
    assert "src/__pycache__/sym_buffer.cpython-311.pyc | compiled file in the tree" in (tmp_path / "r.md").read_text()


def test_static_only_is_no_verdict_of_compatibility(bump_world, tmp_path, monkeypatch, capsys):
    repo, cache = bump_world
    monkeypatch.setattr(cli, "_build", _REAL_BUILD)
    before = synthetic.snapshot(repo)
    w2 = wheel(cache, "2.0", drop_files())
    assert bump(repo, cache, "2.0", "--sha256", sha256_file(w2), STATIC) == 2
    assert "a bump pins the drop, and the source checks alone cannot say it is compatible" in capsys.readouterr().err
    assert synthetic.snapshot(repo) == before
    # An audit may stop at the sources, and says what it did not check.
    assert run(repo, cache, "audit", "--tree", "sm90", "--version", "2.0", STATIC, "--report", str(tmp_path / "r.md")) == 0
    out = capsys.readouterr().out
    assert "REVIEW: 0 break, 1 warn" in out
    assert "--static-only: no knob was resolved, no number checked, nothing compiled" in (tmp_path / "r.md").read_text()


def test_bump_refuses_byte_code_in_the_tree_it_would_pin(bump_world, capsys):
    repo, cache = bump_world
    w2 = wheel(cache, "2.0", dict(drop_files(), **{"src/stray.pyc": "b"}))
    assert bump(repo, cache, "2.0", "--sha256", sha256_file(w2)) == 2
    err = capsys.readouterr().err
    assert "the wheel ships compiled files in its tree (['src/stray.pyc'], extracted at " in err
    assert "a drop is pinned as Python sources" in err


# ---- the cache, hand-overs, tree finding ------------------------------------------------------------


def test_the_cache_lives_in_the_users_cache_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert fetch.default_cache_dir() == tmp_path / "home" / ".cache" / "megamoe-ep" / "drop"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert fetch.default_cache_dir() == tmp_path / "xdg" / "megamoe-ep" / "drop"
    monkeypatch.setenv("MOE_EP_DROP_CACHE", str(tmp_path / "mine"))
    assert fetch.default_cache_dir() == tmp_path / "mine"


def test_a_run_leaves_nothing_in_its_working_directory(tmp_path, monkeypatch):
    repo = synthetic.make_shim(tmp_path / "repo")
    handed = wheel(tmp_path / "handover", "1.0", drop_files())
    cwd = tmp_path / "somewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cli.main(["--repo", str(repo), "audit", "--tree", "sm90", "--wheel", str(handed)]) == 0
    assert list(cwd.iterdir()) == []
    assert fetch.cached_wheel("1.0", tmp_path / "xdg" / "megamoe-ep" / "drop") is not None


def test_an_edited_cached_tree_is_put_right_before_use(bump_world, tmp_path, capsys):
    repo, cache = bump_world
    genuine = json.loads((repo / "third_party" / "cutedsl_megamoe" / "sm90.manifest.json").read_text())
    cached = cache / "trees" / "1.0" / "sm90"
    (cached / "common" / "megamoe_constants.py").write_text("SfPaddingBlock = 64\n")  # one edited byte string
    (cached / "src" / "extra.py").write_text("X = 1\n")
    out = tmp_path / "m.json"
    capsys.readouterr()
    assert run(repo, cache, "manifest", "--tree", "sm90", "--version", "1.0", "--sha256", genuine["carrier_sha256"],
               "--out", str(out)) == 0
    assert "differs from its wheel" in capsys.readouterr().err
    assert json.loads(out.read_text()) == genuine
    assert file_digests(cached) == genuine["files"]


def test_bump_takes_a_handed_over_wheel(bump_world, tmp_path, capsys):
    repo, cache = bump_world
    handed = wheel(tmp_path / "handover", "2.0", drop_files(lambda f: f.update({"moe_hopper_fp8/extra.py": "X = 1\n"})))
    sha = sha256_file(handed)
    before = synthetic.snapshot(repo)
    # Any other announced hash: refused, nothing written, nothing cached.
    assert bump(repo, cache, None, "--wheel", str(handed), "--sha256", SHA_B) == 2
    assert synthetic.snapshot(repo) == before and fetch.cached_wheel("2.0", cache) is None
    # The file's version must be the one named.
    assert run(repo, cache, "bump", "--tree", "sm90", "--version", "3.0", "--wheel", str(handed)) == 2
    assert run(repo, cache, "bump", "--tree", "sm90", "--wheel", str(handed.parent), "--sha256", sha) == 0
    bzl = (repo / "third_party" / "cutedsl_megamoe" / "workspace.bzl").read_text()
    assert read_pins(bzl, SM90) == ("2.0", sha)
    assert sha256_file(fetch.cached_wheel("2.0", cache)) == sha  # later runs find it without pip


def test_audit_finds_the_tree_inside_a_handed_over_directory(bump_world, tmp_path):
    repo, cache = bump_world
    unpacked = synthetic.write_tree(tmp_path / "unpacked", {f"{MOVED}/{rel}": text for rel, text in drop_files().items()})
    synthetic.write_tree(unpacked, {f"flashinfer/moe_ep/kernel_src/other/src/{rel}": "# other\n" for rel in synthetic.BASE_DROP})
    report = tmp_path / "r.md"
    assert run(repo, cache, "audit", "--tree", "sm90", "--tree-root", str(unpacked), "--report", str(report)) == 0
    assert "CLEAN" in report.read_text()


def test_a_sibling_fork_does_not_pass_for_the_tree(tmp_path):
    # The real 0.7.0.post1 case: the tree one revision older (paths kept, bytes changed) at a new path, and a fork
    # of today's tree for another GPU beside it, most of its files byte-identical to today's reference.
    reference = {rel: fetch.hashlib.sha256(text.encode()).hexdigest() for rel, text in synthetic.BASE_DROP.items()}
    fork = {f"flashinfer/moe_ep/kernel_src/sm120/fork/src/{rel}": text
            for rel, text in synthetic.sibling_fork(synthetic.BASE_DROP).items()}
    w = synthetic.make_wheel(tmp_path / "w.whl", MOVED, synthetic.older(synthetic.BASE_DROP), fork)
    loc = locate_tree(w, SM90, reference, PREFIX)
    assert (loc.prefix, loc.how) == (MOVED + "/", "by content")
    assert loc.runner_up[0] == "flashinfer/moe_ep/kernel_src/sm120/fork/src/"


def test_suggested_commands_repeat_the_options_used(bump_world, tmp_path, capsys):
    repo, cache = bump_world
    w2 = wheel(cache, "2.0", drop_files(without_bf16), MOVED)
    sha = sha256_file(w2)
    capsys.readouterr()
    assert bump(repo, cache, "2.0", "--sha256", sha, "--strip-prefix", MOVED) == 3
    err = capsys.readouterr().err
    lines = [line.split("bazel run //tools:drop -- ", 1)[1] for line in err.splitlines() if "bazel run //tools:drop" in line]
    assert len(lines) == 2
    for line in lines:
        assert f"--strip-prefix {MOVED}" in line and f"--cache-dir {cache}" in line and f"--repo {repo}" in line
    # The suggested check runs as printed and sees the same breaking drop.
    assert cli.main(lines[0].split()) == 3


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
