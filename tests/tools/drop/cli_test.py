"""The command line end to end on synthetic repos and wheels: exit codes, pins, bump."""

from __future__ import annotations

import json

import pytest

from tests.tools.drop import synthetic
from tools.drop import cli
from tools.drop.fetch import sha256_file
from third_party.cutedsl_megamoe.manifest import compute_manifest
from tools.drop.pins import PinError, read_pins, rewrite_pins
from tools.drop.trees import TREES

SM90 = TREES["sm90"]
SHA_A = "a" * 64
SHA_B = "b" * 64


@pytest.fixture(autouse=True)
def _isolated(monkeypatch):
    # Nothing from the environment may point the tool at a real tree or cache.
    for var in ("MOE_EP_SM90_TREE", "MOE_EP_SM100_TREE", "MOE_EP_DROP_CACHE", "BUILD_WORKSPACE_DIRECTORY",
                "RUNFILES_DIR", "TEST_SRCDIR"):
        monkeypatch.delenv(var, raising=False)


# ---- pins -------------------------------------------------------------------

PINS = synthetic.WORKSPACE_BZL.format(v90="1.0", s90=SHA_A, v100="1.0", s100=SHA_A)


def test_rewrite_pins_touches_exactly_the_two_lines():
    out = rewrite_pins(PINS, SM90, "2.0", SHA_B)
    changed = [(a, b) for a, b in zip(PINS.splitlines(), out.splitlines()) if a != b]
    assert changed == [
        ('SM90_VERSION = "1.0"', 'SM90_VERSION = "2.0"'),
        (f'SM90_SHA256 = "{SHA_A}"', f'SM90_SHA256 = "{SHA_B}"'),
    ]
    assert read_pins(out, SM90) == ("2.0", SHA_B)
    assert read_pins(out, TREES["sm100"]) == ("1.0", SHA_A)


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


def test_rewrite_rejects_a_non_digest():
    with pytest.raises(PinError):
        rewrite_pins(PINS, SM90, "2.0", "not-a-sha")


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
    assert cli.main(args + ["--report", str(tmp_path / "same.md")]) == 0
    synthetic.edit(new, "moe_hopper_fp8/heuristic_config.py", "def select_heuristic_config(", "def select_config(")
    report = tmp_path / "broken.md"
    assert cli.main(args + ["--report", str(report)]) == 1
    out = capsys.readouterr().out
    assert "SHIM WOULD BREAK" in out and "did you mean select_config?" in out
    assert "select_heuristic_config" in report.read_text()


def test_usage_errors_exit_2(repo_and_drops, capsys):
    repo, old, new = repo_and_drops
    assert cli.main(["--repo", str(repo), "audit", "--tree", "sm7"]) == 2  # argparse
    assert cli.main(["--repo", str(repo), "frobnicate"]) == 2
    # no workspace.bzl pin and no tree given
    assert cli.main(["--repo", str(repo), "audit", "--tree", "sm90", "--report", "-"]) == 2
    assert cli.main(["--repo", str(repo), "audit", "--tree", "all", "--tree-root", str(new)]) == 2
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


@pytest.fixture
def bump_world(tmp_path):
    """A repo pinned to synthetic drop 1.0, and wheels 1.0 / 2.0 in the tool's cache (no network)."""
    repo = synthetic.make_shim(tmp_path / "repo")
    cache = tmp_path / "cache"
    files_v1 = dict(synthetic.BASE_DROP)
    files_v2 = dict(files_v1)
    files_v2["moe_hopper_fp8/megamoe_kernel_fp8.py"] = files_v2["moe_hopper_fp8/megamoe_kernel_fp8.py"].replace(
        "        dedup_dispatch: bool = False,\n", ""
    )
    files_v2["moe_hopper_fp8/extra.py"] = "X = 1\n"
    w1 = synthetic.make_wheel(cache / "wheels" / "flashinfer_python-1.0-py3-none-any.whl", SM90.wheel_prefix, files_v1)
    w2 = synthetic.make_wheel(cache / "wheels" / "flashinfer_python-2.0-py3-none-any.whl", SM90.wheel_prefix, files_v2)
    bzl = repo / "third_party" / "cutedsl_megamoe" / "workspace.bzl"
    bzl.parent.mkdir(parents=True)
    bzl.write_text(synthetic.WORKSPACE_BZL.format(v90="1.0", s90=sha256_file(w1), v100="0.9", s100=SHA_A))
    # Establish 1.0 as the accepted baseline: manifest + contract + docs.
    assert cli.main(["--repo", str(repo), "--cache-dir", str(cache), "bump", "--tree", "sm90", "--version", "1.0",
                     "--accept-contract", "--report", "-"]) == 0
    return repo, cache, w1, w2


def test_bump_rewrites_pin_manifest_docs_and_reports(bump_world, capsys):
    repo, cache, w1, w2 = bump_world
    bzl = repo / "third_party" / "cutedsl_megamoe" / "workspace.bzl"
    contract_before = (repo / "tools" / "drop" / "contracts" / "sm90.json").read_text()
    capsys.readouterr()
    code = cli.main(["--repo", str(repo), "--cache-dir", str(cache), "bump", "--tree", "sm90", "--version", "2.0"])
    out = capsys.readouterr().out
    assert code == 1  # a parameter the contract has is gone: the shim would break
    assert read_pins(bzl.read_text(), SM90) == ("2.0", sha256_file(w2))
    assert read_pins(bzl.read_text(), TREES["sm100"]) == ("0.9", SHA_A)
    manifest = json.loads((repo / "third_party" / "cutedsl_megamoe" / "sm90.manifest.json").read_text())
    assert json.dumps(manifest, sort_keys=True) == json.dumps(
        compute_manifest(cache / "trees" / "2.0" / "sm90", "2.0", sha256_file(w2)), sort_keys=True
    )
    assert "removed: dedup_dispatch: bool = False removed" in out
    assert "+ moe_hopper_fp8/extra.py" in out
    report = repo / "docs" / "drop" / "audit-sm90-1.0-to-2.0.md"
    assert "dedup_dispatch" in report.read_text()
    assert "flashinfer-python 2.0" in (repo / "docs" / "drop" / "sm90.md").read_text()
    # The contract moves only when a human accepts it.
    assert (repo / "tools" / "drop" / "contracts" / "sm90.json").read_text() == contract_before

    code = cli.main(["--repo", str(repo), "--cache-dir", str(cache), "bump", "--tree", "sm90", "--version", "2.0",
                     "--accept-contract", "--report", "-"])
    assert code == 0
    contract = json.loads((repo / "tools" / "drop" / "contracts" / "sm90.json").read_text())
    assert contract["accepted_version"] == "2.0"
    params = [p["name"] for p in contract["classes"]["Sm90MegaMoEFp8Kernel"]["methods"]["__init__"]["params"]]
    assert "dedup_dispatch" not in params and "hidden" in params
    # After acceptance the pinned drop audits clean against its own manifest.
    assert cli.main(["--repo", str(repo), "--cache-dir", str(cache), "audit", "--tree", "sm90", "--report", "-"]) == 0
    assert cli.main(["--repo", str(repo), "--cache-dir", str(cache), "docs", "--tree", "sm90", "--check"]) == 0


def test_bump_refuses_nothing_silently_on_a_bad_pin_file(bump_world):
    repo, cache, _, _ = bump_world
    bzl = repo / "third_party" / "cutedsl_megamoe" / "workspace.bzl"
    bzl.write_text(bzl.read_text().replace("SM90_VERSION", "SM90_VER"))
    before = bzl.read_text()
    assert cli.main(["--repo", str(repo), "--cache-dir", str(cache), "bump", "--tree", "sm90", "--version", "2.0"]) == 2
    assert bzl.read_text() == before


def test_pinned_tree_from_cache_is_hash_checked(bump_world):
    repo, cache, _, _ = bump_world
    # The pin now names a digest no cached wheel has: the extracted tree in the
    # cache must not be trusted, and the wheel behind it fails the check.
    bzl = repo / "third_party" / "cutedsl_megamoe" / "workspace.bzl"
    bzl.write_text(rewrite_pins(bzl.read_text(), SM90, "1.0", SHA_B))
    assert cli.main(["--repo", str(repo), "--cache-dir", str(cache), "audit", "--tree", "sm90", "--report", "-"]) == 2


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
