"""The kernel backend base (shim/common/backend.py) and the frontend base, for every arch alike: the compile target
a build without a GPU needs, and final composers that an arch or format class cannot replace by accident. (A layer's
device is checked by moe_ep.core.device.require_arch: tests/moe_ep/device_test.py.)"""

import importlib
import sys

import pytest
import torch

import moe_ep
from shim.common.backend import KernelBackend, check_compile_target
from shim.common.frontend import MegaMoEFrontend


def _table(arch):
    """An arch's format table (plain Python; no tree)."""
    return importlib.import_module(f"shim.{arch}.formats").BACKENDS


@pytest.mark.parametrize("arch, other", [("sm90", "sm100"), ("sm100", "sm90")])
def test_a_compile_without_a_gpu_needs_the_arch_target(monkeypatch, arch, other):
    table, other = _table(arch), _table(other)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
    with pytest.raises(moe_ep.BackendUnavailableError, match=f"CUTE_DSL_ARCH={table.cute_targets[0]}a") as err:
        check_compile_target(table)
    assert err.value.argument == "CUTE_DSL_ARCH" and "unset" in str(err.value)
    monkeypatch.setenv("CUTE_DSL_ARCH", other.cute_targets[0] + "a")
    with pytest.raises(moe_ep.BackendUnavailableError):
        check_compile_target(table)
    monkeypatch.setenv("CUTE_DSL_ARCH", table.cute_targets[0] + "a")
    check_compile_target(table)


@pytest.mark.parametrize("base, name", [
    (MegaMoEFrontend, "forward"), (MegaMoEFrontend, "build_kernel"), (MegaMoEFrontend, "compile"),
    (MegaMoEFrontend, "__init__"), (MegaMoEFrontend, "load_weights"),
    (KernelBackend, "__init__"), (KernelBackend, "prepare_weights"), (KernelBackend, "forward"),
])
def test_a_subclass_cannot_replace_a_composer(base, name):
    with pytest.raises(TypeError, match=f"overrides {base.__name__}.{name}, a final composer"):
        type("Arch", (base,), {name: lambda self, *a, **k: None})
    with pytest.raises(TypeError, match="final composer"):  # nor two levels down
        type("Format", (type("Arch", (base,), {}),), {name: lambda self, *a, **k: None})
    type("Fine", (base,), {"a_hook_of_its_own": lambda self: None})


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
