"""Bazel runs tests with exactly the locked environment, not the machine's python3.

The interpreter is @moe_ep_python's venv (tools/bazel/python_env.bzl); every distribution in it
is pinned in //:requirements.lock at the locked version, and nothing else is installed but pip.
"""

import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

from tests.foundation import nested_bazel

ALLOWED_UNLOCKED = {"pip"}


def _norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def _lock():
    path = nested_bazel.runfiles_root() / nested_bazel.WORKSPACE_NAME / "requirements.lock"
    pins = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", line)
        if m:
            pins[_norm(m.group(1))] = m.group(2)
    assert pins, f"no pins read from {path}"
    return pins


def _installed():
    return {_norm(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()}


def test_interpreter_is_the_locked_venv():
    assert sys.prefix != sys.base_prefix, f"not a venv: {sys.executable}"
    assert Path(sys.prefix).name == "venv" and Path(sys.prefix).parent.name == "moe_ep_python", sys.prefix
    assert sys.version_info[:2] == (3, 11)


def test_every_pin_installed_at_its_version():
    installed = _installed()
    wrong = {n: (v, installed.get(n)) for n, v in _lock().items() if installed.get(n) != v}
    assert not wrong, f"locked vs installed: {wrong}"


def test_nothing_installed_beyond_the_lock():
    extra = sorted(set(_installed()) - set(_lock()) - ALLOWED_UNLOCKED)
    assert not extra, f"installed but not in requirements.lock: {extra}"


def test_torch_is_the_cpu_build():
    import torch

    assert torch.__version__ == "2.13.0+cpu"


@pytest.mark.parametrize("module", ["numpy", "cutlass.cute", "cuda.bindings.driver", "nvshmem.core"])
def test_runtime_packages_import_without_a_gpu(module):
    __import__(module)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
