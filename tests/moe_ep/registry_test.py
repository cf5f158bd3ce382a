"""The backend registry: lazy entries, typed errors, arch/format selection."""

import sys
import warnings

import pytest

import moe_ep
from moe_ep.core import registry

KERNEL_BACKENDS = {
    "sm90_fp8_cutedsl": ("sm90", ("fp8_block",)),
    "sm90_bf16_cutedsl": ("sm90", ("bf16",)),
    "sm90_fp8_tensor_cutedsl": ("sm90", ("fp8_tensor",)),
    "sm90_w4a8_mxfp4_cutedsl": ("sm90", ("w4a8_mxfp4",)),
    "sm100_nvfp4_cutedsl": ("sm100", ("nvfp4",)),
    "sm100_mxfp8_cutedsl": ("sm100", ("mxfp8",)),
    "sm100_bf16_cutedsl": ("sm100", ("bf16",)),
}


@pytest.fixture
def scratch_names():
    names = []
    yield names
    for n in names:
        registry.unregister_backend(n)


def test_list_backends_describes_every_entry_without_importing_a_backend():
    """The kernel backends come from the shim's format tables, read by lazy string: listing imports those tables
    (and the tree resolution their availability asks), never a backend, a frontend, cutlass or a kernel."""
    before = set(sys.modules)
    info = moe_ep.list_backends()
    assert info["torch_reference"] == ("cpu", tuple(moe_ep.FORMATS), True)
    assert info["torch_reference"].reason == ""
    for name, (arch, formats) in KERNEL_BACKENDS.items():
        assert (info[name].arch, info[name].formats) == (arch, formats)
        assert isinstance(info[name].available, bool) and info[name].available == (not info[name].reason)
    new = set(sys.modules) - before
    allowed = {"shim", "shim.common", "shim.common.formats", "shim.common.tree", "shim.common.tree_facts",
               "shim.common.integrity", "shim.sm90", "shim.sm90.formats", "shim.sm100", "shim.sm100.formats"}
    assert not [m for m in new if m.startswith("shim") and m not in allowed or m.split(".")[0] == "cutlass"], new


def test_unknown_backend_lists_the_valid_names():
    with pytest.raises(moe_ep.errors.BackendNotFoundError) as e:
        registry.get_entry("nope")
    assert e.value.argument == "backend" and "torch_reference" in str(e.value) and "sm90_fp8_cutedsl" in str(e.value)
    assert isinstance(e.value, KeyError)


def test_absent_module_is_unavailable_with_reason(scratch_names):
    registry.register_backend("t_absent", "moe_ep_no_such_pkg.mod:Cls", arch="sm100", formats=("nvfp4",))
    scratch_names.append("t_absent")
    info = moe_ep.list_backends()["t_absent"]
    assert info.available is False and "moe_ep_no_such_pkg.mod" in info.reason
    arch, formats, available = info  # still the (arch, formats, available) triple
    assert (arch, formats, available) == ("sm100", ("nvfp4",), False)
    with pytest.raises(moe_ep.BackendUnavailableError) as e:
        registry.resolve_backend("t_absent")
    assert "moe_ep_no_such_pkg.mod" in str(e.value) and "not installed" in str(e.value)


def test_import_failure_is_unavailable_with_reason(tmp_path, monkeypatch, scratch_names):
    (tmp_path / "moe_ep_broken_backend.py").write_text("raise ImportError('needs a GPU toolchain')\n")
    (tmp_path / "moe_ep_ok_backend.py").write_text("import moe_ep\n\n\nclass B(moe_ep.Backend):\n    pass\n\n\n"
                                                  "class NotABackend:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.register_backend("t_broken", "moe_ep_broken_backend:B", arch="sm90", formats=("bf16",))
    registry.register_backend("t_noattr", "moe_ep_ok_backend:Missing", arch="sm90", formats=("bf16",))
    registry.register_backend("t_ok", "moe_ep_ok_backend:B", arch="sm90", formats=("bf16",))
    registry.register_backend("t_stranger", "moe_ep_ok_backend:NotABackend", arch="sm90", formats=("bf16",))
    scratch_names.extend(["t_broken", "t_noattr", "t_ok", "t_stranger"])
    assert moe_ep.list_backends()["t_broken"].available is True  # present; whether it imports is found later
    with pytest.raises(moe_ep.BackendUnavailableError, match="ImportError: needs a GPU toolchain"):
        registry.resolve_backend("t_broken")
    with pytest.raises(moe_ep.BackendUnavailableError, match="no attribute 'Missing'"):
        registry.resolve_backend("t_noattr")
    assert registry.resolve_backend("t_ok").__name__ == "B"
    with pytest.raises(moe_ep.errors.RegistrationError, match="not a moe_ep.Backend subclass"):
        registry.resolve_backend("t_stranger")  # the layer reads a backend's capabilities from the Backend contract


def test_a_probe_decides_availability_and_resolution(scratch_names):
    """A probe says why a backend cannot run here without importing it: list_backends() shows the reason and
    resolving the backend (what a layer does first) raises it, typed, before anything is imported."""
    calls = []

    def probe():
        calls.append(1)
        return "needs the kernel module k.m, which the tree lacks"

    registry.register_backend("t_probed2", moe_ep.Backend, arch="sm90", formats=("bf16",), probe=probe)
    scratch_names.append("t_probed2")
    info = moe_ep.list_backends()["t_probed2"]
    assert info.available is False and info.reason == probe()
    with pytest.raises(moe_ep.BackendUnavailableError, match="k.m") as e:
        registry.resolve_backend("t_probed2")
    assert e.value.argument == "backend" and calls
    registry.register_backend("t_probed2", moe_ep.Backend, arch="sm90", formats=("bf16",), probe=lambda: None,
                              replace=True)
    assert moe_ep.list_backends()["t_probed2"].available and registry.resolve_backend("t_probed2") is moe_ep.Backend


def test_a_missing_format_table_is_named_by_a_failed_lookup(monkeypatch):
    """A build of moe_ep without the shim has no kernel backend tables: the registry still works, and a lookup of
    an unknown name says which tables were not found."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(torch_reference=registry.get_entry("torch_reference")))
    monkeypatch.setattr(registry, "_tables_read", False)
    monkeypatch.setattr(registry, "_tables_absent", [])
    monkeypatch.setattr(registry, "KERNEL_TABLES", ("moe_ep_no_such_shim.formats:BACKENDS",))
    assert set(moe_ep.list_backends()) == {"torch_reference"}
    with pytest.raises(moe_ep.errors.BackendNotFoundError, match="moe_ep_no_such_shim.formats"):
        registry.get_entry("sm90_fp8_cutedsl")


def test_register_rejects_bad_entries(scratch_names):
    with pytest.raises(moe_ep.FormatError) as e:
        registry.register_backend("t_bad", "a.b:C", arch="cpu", formats=("fp6",))
    assert e.value.argument == "formats"
    with pytest.raises(moe_ep.errors.RegistrationError, match="module:attr") as e:
        registry.register_backend("t_bad", "a.b.C", arch="cpu", formats=("bf16",))
    assert e.value.argument == "target" and isinstance(e.value, ValueError)
    with pytest.raises(moe_ep.errors.RegistrationError, match="already registered") as e:
        registry.register_backend("torch_reference", "a.b:C", arch="cpu", formats=("bf16",))
    assert e.value.argument == "name"
    with pytest.raises(moe_ep.errors.RegistrationError, match="already registered"):  # a format table's row, too
        registry.register_backend("sm90_fp8_cutedsl", "a.b:C", arch="sm90", formats=("bf16",))
    with pytest.raises(moe_ep.errors.RegistrationError) as e:
        registry.register_backend("t_bad", "a.b:C", arch="cpu", formats=())
    assert e.value.argument == "formats"


def test_select_backend_by_arch_and_format(scratch_names):
    assert registry.select_backend("cpu").name == "torch_reference"
    assert registry.select_backend("cpu", "nvfp4").name == "torch_reference"
    registry.register_backend("t_sm120", "moe_ep_no_such_pkg:X", arch="sm120", formats=("nvfp4",))
    scratch_names.append("t_sm120")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        entry = registry.select_backend("sm120", "nvfp4")
    assert entry.name == "torch_reference" and any("no kernel backend" in str(x.message) for x in w)
    registry.register_backend("t_sm120_live", moe_ep.Backend, arch="sm120", formats=("mxfp8", "nvfp4"))
    scratch_names.append("t_sm120_live")
    assert registry.select_backend("sm120", "nvfp4").name == "t_sm120_live"
    assert registry.select_backend("sm120").name == "t_sm120_live"
    with pytest.raises(moe_ep.FormatError):
        registry.select_backend("cpu", "int4")


def test_detect_arch_on_this_host():
    import torch

    assert registry.detect_arch("cpu") == "cpu"
    if not torch.cuda.is_available():
        assert registry.detect_arch() == "cpu"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
