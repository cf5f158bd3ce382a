"""The kernel backend base (shim/common/backend.py) and the frontend base, for every arch alike: one device guard,
and final composers that an arch or format class cannot replace by accident."""

import importlib
import sys

import pytest
import torch

import moe_ep
from shim.common.backend import KernelBackend, check_target
from shim.common.frontend import MegaMoEFrontend


def _table(arch):
    """An arch's format table (plain Python; no tree)."""
    return importlib.import_module(f"shim.{arch}.formats").BACKENDS


@pytest.mark.parametrize("arch, other_capability, own_capability", [
    ("sm90", (10, 0), (9, 0)),
    ("sm100", (9, 0), (10, 0)),
    ("sm100", (12, 0), (10, 3)),
])
def test_one_device_guard_for_every_arch(monkeypatch, arch, other_capability, own_capability):
    table = _table(arch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: other_capability)
    with pytest.raises(moe_ep.BackendUnavailableError, match=f"need a {table.gpu} \\({table.arch}\\) GPU") as err:
        check_target(table, "cuda")
    assert err.value.argument == "device" and "cuda is sm_%d%d" % other_capability in str(err.value)
    with pytest.raises(moe_ep.BackendUnavailableError, match="the layer's device is cpu"):
        check_target(table, "cpu")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: own_capability)
    check_target(table, "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(moe_ep.BackendUnavailableError, match="no CUDA device"):
        check_target(table, "cuda")


@pytest.mark.parametrize("arch, other", [("sm90", "sm100"), ("sm100", "sm90")])
def test_a_compile_without_a_gpu_needs_the_arch_target(monkeypatch, arch, other):
    table, other = _table(arch), _table(other)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
    with pytest.raises(moe_ep.BackendUnavailableError, match=f"CUTE_DSL_ARCH={table.cute_targets[0]}a") as err:
        check_target(table)
    assert err.value.argument == "CUTE_DSL_ARCH" and "unset" in str(err.value)
    monkeypatch.setenv("CUTE_DSL_ARCH", other.cute_targets[0] + "a")
    with pytest.raises(moe_ep.BackendUnavailableError):
        check_target(table)
    monkeypatch.setenv("CUTE_DSL_ARCH", table.cute_targets[0] + "a")
    check_target(table)


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
