"""Typed errors for a device this host lacks and for a kernel backend on the wrong device (moe_ep.core.device):
from the layer, from a rank context, and from the guard the kernel backends share. CUDA is faked where a test
needs a GPU host (this host has none): torch.cuda's availability, count, capability and name."""

import sys

import pytest
import torch

import moe_ep
from moe_ep.core import device as devmod
from moe_ep.core.dist import RankContext
from moe_ep.testing.problems import Problem
from tests.support.dist import one_rank_gloo_group


def _fake_gpus(monkeypatch, *caps, name="NVIDIA B200"):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(caps))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(caps))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: caps[0 if i is None else int(i)])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: name)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def _layer_inputs():
    spec = moe_ep.MoESpec(256, 128, 8, 2, 16)
    return spec, Problem.build(spec, 1, [4], "balanced", 0, 0).rank_weights(0)


def test_a_kernel_backend_on_the_cpu_is_a_typed_error_naming_backend_device_and_arch():
    spec, w = _layer_inputs()
    with one_rank_gloo_group():
        with pytest.raises(moe_ep.BackendUnavailableError) as info:
            moe_ep.MoELayer(spec, w, backend="sm90_fp8_cutedsl")
    err = info.value
    assert err.argument == "backend"
    text = str(err)
    assert "'sm90_fp8_cutedsl'" in text and "sm90" in text and "Hopper" in text and "device is cpu" in text, text
    assert "no CUDA device" in text, text
    # Refused before the kernel backend's module was imported.
    assert "shim.sm90.backend" not in sys.modules


def test_every_kernel_backend_is_refused_on_the_cpu_the_reference_is_not():
    spec, w = _layer_inputs()
    kernels = [n for n, info in moe_ep.list_backends().items() if info.arch != "cpu"]
    assert kernels
    with one_rank_gloo_group():
        for name in kernels:
            with pytest.raises(moe_ep.BackendUnavailableError, match=name):
                moe_ep.MoELayer(spec, w, backend=name, fmt=moe_ep.list_backends()[name].formats[0])
        with moe_ep.MoELayer(spec, w, backend="torch_reference") as layer:
            assert layer.backend_name == "torch_reference"


def test_a_cuda_device_on_a_host_without_one_is_a_typed_error():
    spec, w = _layer_inputs()
    with one_rank_gloo_group():
        with pytest.raises(moe_ep.errors.DeviceUnavailableError) as info:
            RankContext.from_group(None, "cuda")
        assert info.value.argument == "device" and "no CUDA device" in str(info.value)
        with pytest.raises(moe_ep.errors.DeviceUnavailableError):
            moe_ep.MoELayer(spec, w, device="cuda:1")


def test_require_arch_names_the_gpu_it_found(monkeypatch):
    _fake_gpus(monkeypatch, (10, 0))
    with pytest.raises(moe_ep.BackendUnavailableError) as info:
        devmod.require_arch("cuda:0", "sm90", "sm90_fp8_cutedsl")
    text = str(info.value)
    assert "cuda:0 is NVIDIA B200 (sm100)" in text and "registered for sm100" in text, text
    devmod.require_arch("cuda:0", "sm100", "sm100_nvfp4_cutedsl")  # the right arch passes
    devmod.require_arch("cuda", "sm100", "sm100_nvfp4_cutedsl")  # no index: the current device


def test_require_device_counts_the_hosts_gpus(monkeypatch):
    _fake_gpus(monkeypatch, (9, 0), (9, 0))
    assert devmod.require_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(moe_ep.errors.DeviceUnavailableError) as info:
        devmod.require_device("cuda:2", "LOCAL_RANK")
    assert info.value.argument == "LOCAL_RANK"
    assert "cuda:2 was asked for" in str(info.value) and "2 CUDA device(s)" in str(info.value)
    with pytest.raises(moe_ep.errors.DeviceUnavailableError, match="'cpu' or 'cuda"):
        devmod.require_device("mps")
    with pytest.raises(moe_ep.errors.DeviceUnavailableError, match="expected 'cpu'"):
        devmod.require_device("no such device")


def test_the_errors_are_moe_errors_a_caller_can_also_catch_as_runtime_errors():
    for cls in (moe_ep.errors.DeviceUnavailableError, moe_ep.BackendUnavailableError):
        assert issubclass(cls, moe_ep.MoEError) and issubclass(cls, RuntimeError)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-p", "no:cacheprovider"]))
