"""The source digest (tools/bazel/workspace_status.sh, the input that keeps the whole-workspace tests cached) changes
exactly when a source file's content does: not for a touch, a `git status` or a staged-but-equal file, and it does
for an edit, a new untracked file or a deletion; ignored files (bazel-* links, caches) never count.

Runs the real script in a throw-away git repository laid out like this one."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.foundation import nested_bazel


def _git(repo, *args):
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True,
                   env=dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
                            GIT_COMMITTER_EMAIL="t@t"))


@pytest.fixture
def repo(tmp_path):
    repo = tmp_path / "checkout"
    (repo / "tools" / "bazel").mkdir(parents=True)
    shutil.copy(nested_bazel.workspace_root() / "tools" / "bazel" / "workspace_status.sh",
                repo / "tools" / "bazel" / "workspace_status.sh")
    (repo / "moe_ep").mkdir()
    (repo / "moe_ep" / "a.py").write_text("A = 1\n")
    (repo / ".gitignore").write_text("/bazel-*\n__pycache__/\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "init")
    return repo


def _digest(repo):
    out = subprocess.run(["sh", str(repo / "tools" / "bazel" / "workspace_status.sh")], capture_output=True,
                         text=True, check=True).stdout
    key, value = out.split()
    assert key == "STABLE_MOE_EP_SOURCE_DIGEST" and len(value) == 40
    return value


def test_the_digest_follows_content_not_gits_index(repo):
    first = _digest(repo)
    a = repo / "moe_ep" / "a.py"
    time.sleep(0.01)
    a.write_text("A = 1\n")  # a touch: new mtime, same bytes; the index's stat data is now stale
    os.utime(a, (time.time() + 5, time.time() + 5))
    assert _digest(repo) == first
    _git(repo, "status")  # refreshes the index's stat data
    assert _digest(repo) == first
    (repo / "bazel-checkout").symlink_to(repo / "moe_ep")  # ignored: a convenience symlink
    (repo / "moe_ep" / "__pycache__").mkdir()
    (repo / "moe_ep" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"x")
    assert _digest(repo) == first

    a.write_text("A = 2\n")
    edited = _digest(repo)
    assert edited != first
    _git(repo, "add", "-A")  # staged: the same content, the same digest
    assert _digest(repo) == edited

    (repo / "moe_ep" / "b.py").write_text("B = 1\n")  # untracked, not ignored
    added = _digest(repo)
    assert added not in (first, edited)
    (repo / "moe_ep" / "b.py").unlink()
    assert _digest(repo) == edited
    a.unlink()
    assert _digest(repo) not in (first, edited, added)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
