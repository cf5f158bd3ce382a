"""Where a layer can run: one typed error for a device this host does not have, one for a kernel backend asked
for on a device of another arch. Both name the argument, the device and what is needed, so the layer, the
process-group set-up and the tools say the same thing (a tool prints it as its one line and exits 2).

The kernel backends' own guard calls require_arch too: the message is written once, here.
"""

from __future__ import annotations


import torch

from moe_ep.errors import BackendUnavailableError, DeviceUnavailableError

__all__ = ["cuda_device_count", "describe_host", "require_device", "require_arch", "ARCH_PARTS"]

# What a user would call the parts of each kernel arch.
ARCH_PARTS = {"sm90": "Hopper, e.g. H100/H200", "sm100": "Blackwell, e.g. B200/GB200"}


def cuda_device_count() -> int:
    """CUDA devices torch can use here (0 on a CPU build of torch or a host without a GPU)."""
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except (AssertionError, RuntimeError):  # a CPU build asserts; a broken driver raises
        return 0


def _arch(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm{major}0" if major >= 10 else f"sm{major}{minor}"


def describe_host() -> str:
    """One clause on what this host offers: the CUDA devices (name, arch) or why there are none."""
    n = cuda_device_count()
    if n == 0:
        if torch.version.cuda is None:
            return f"this host has no CUDA device (torch {torch.__version__} is a CPU build)"
        return "this host has no CUDA device torch can use (no GPU, no driver, or CUDA_VISIBLE_DEVICES hides them)"
    parts = []
    for i in range(n):
        try:
            parts.append(f"cuda:{i} {torch.cuda.get_device_name(i)} ({_arch(i)})")
        except (AssertionError, RuntimeError):
            parts.append(f"cuda:{i}")
    return f"this host has {n} CUDA device(s): " + ", ".join(parts)


def require_device(device, argument: str = "device") -> torch.device:
    """The device, when this host has it; else DeviceUnavailableError naming `argument`. 'cuda' without an
    index is accepted when any CUDA device exists (the current one is meant)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise DeviceUnavailableError(argument, f"expected 'cpu', 'cuda' or 'cuda:N', got {device!r} ({e})") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise DeviceUnavailableError(argument, f"moe_ep runs on 'cpu' or 'cuda[:N]', got {dev}")
    n = cuda_device_count()
    if n == 0 or (dev.index is not None and dev.index >= n):
        raise DeviceUnavailableError(argument, f"{dev} was asked for, but {describe_host()}")
    return dev


def require_arch(device, arch: str, backend: str, argument: str = "backend") -> None:
    """Raise BackendUnavailableError unless `device` is a CUDA device of `arch` ('sm90', 'sm100'), the arch the
    kernel backend `backend` is built for; the message names the backend, the device, its arch and what to do."""
    need = f"backend {backend!r} runs on an {arch} GPU ({ARCH_PARTS.get(arch, arch)})"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type != "cuda":
        raise BackendUnavailableError(argument, (
            f"{need}, and the layer's device is {device}: {describe_host()}. On a GPU host pass a CUDA device "
            f"and an NCCL group (moe_ep.init_from_env() does both); on a CPU leave backend unset for the torch "
            f"reference"))
    require_device(dev, "device")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    got = _arch(index)
    if got != arch:
        raise BackendUnavailableError(argument, (
            f"{need}, and the layer's device cuda:{index} is {torch.cuda.get_device_name(index)} ({got}): "
            f"leave backend unset to take the one registered for {got}, or run on an {arch} GPU"))

