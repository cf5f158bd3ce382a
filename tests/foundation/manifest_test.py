"""The extracted drop trees are byte-identical to their committed manifests.

Reads each tree through its @cutedsl_megamoe_<tree>//:all_files filegroup (the files every
target sees) and compares path by path, sha256 by sha256, with
third_party/cutedsl_megamoe/<tree>.manifest.json. Any changed, added or removed file fails the
test and is named. The manifest must also describe the pinned carrier (version + wheel sha256
recorded by drop_repo.bzl in carrier.json), so a bumped pin without a regenerated manifest fails
here too.
"""

import json
import os
import sys
from pathlib import Path

import pytest

import manifest  # //third_party/cutedsl_megamoe:manifest_lib

WORKSPACE = "megamoe_ep"


def _runfiles() -> Path:
    return Path(os.environ["TEST_SRCDIR"])


def _regen_hint(tree):
    return f"bazel run //third_party/cutedsl_megamoe:manifest -- --write {tree}"


@pytest.fixture(params=sorted(manifest.TREES))
def tree(request):
    return request.param


def _tree_root(tree) -> Path:
    root = _runfiles() / manifest.TREES[tree]
    assert (root / "carrier.json").exists(), f"@{manifest.TREES[tree]} is missing from the runfiles"
    return root


def _committed(tree) -> dict:
    return manifest.load_manifest(_runfiles() / WORKSPACE / "third_party" / "cutedsl_megamoe" / f"{tree}.manifest.json")


def test_manifest_describes_the_pinned_carrier(tree):
    carrier = json.loads((_tree_root(tree) / "carrier.json").read_text())
    committed = _committed(tree)
    assert (committed["version"], committed["carrier_sha256"]) == (carrier["version"], carrier["carrier_sha256"]), (
        f"{tree}: the manifest is for flashinfer-python {committed['version']} ({committed['carrier_sha256']}), "
        f"but the pin fetched {carrier['version']} ({carrier['carrier_sha256']}). Regenerate: {_regen_hint(tree)}"
    )


def test_tree_is_byte_identical_to_manifest(tree):
    root = _tree_root(tree)
    carrier = json.loads((root / "carrier.json").read_text())
    actual = manifest.compute_manifest(root)
    diff = manifest.diff_manifest(_committed(tree), actual)
    label = f"@{manifest.TREES[tree]} (flashinfer-python {carrier['version']}, carrier sha256 {carrier['carrier_sha256']})"
    print(diff.describe(label))
    assert not diff, (
        diff.describe(label)
        + "\nThe drop is consumed verbatim: never edit it. If the change is a deliberate new drop, "
        f"bump the pin and regenerate the manifest ({_regen_hint(tree)})."
    )
    assert len(actual["files"]) > 0


def test_fetch_checked_the_committed_manifest(tree):
    """drop_repo.bzl checked the tree against a manifest at fetch time and wrote it to pinned.manifest.json
    (the file the shim reads at run time): in this workspace that is the committed one."""
    pinned = _tree_root(tree) / "pinned.manifest.json"
    assert pinned.is_file(), f"{pinned} missing: drop_repo.bzl writes it, the BUILD file exports it"
    assert manifest.load_manifest(pinned) == _committed(tree)


def test_diff_names_every_kind_of_change():
    expected = {"files": {"a.py": "1", "b.py": "2", "c.py": "3"}}
    actual = {"files": {"a.py": "1", "b.py": "X", "d.py": "4"}}
    diff = manifest.diff_manifest(expected, actual)
    assert (diff.changed, diff.added, diff.removed) == (["b.py"], ["d.py"], ["c.py"])
    text = diff.describe("t")
    assert "changed: b.py" in text and "added:   d.py" in text and "removed: c.py" in text


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
