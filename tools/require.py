"""What every tool does when the device it was asked for is not here: one line on stderr that says what is
missing and what the host has, and exit status 2 (a usage error, as for a bad flag). The main job, the
benchmarks, the tuner, the launcher and the diagnostics all go through require(); the messages are moe_ep's
own typed errors (moe_ep.core.device), so a library caller and a tool user read the same sentence.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

from moe_ep.core.device import cuda_device_count, describe_host, require_arch, require_device
from moe_ep.errors import BackendUnavailableError, DeviceUnavailableError

__all__ = ["EXIT_ABSENT", "check_devices", "require", "local_gpu"]

EXIT_ABSENT = 2


def local_gpu() -> int:
    """The GPU a rank started by tools.launch (or torchrun) uses: LOCAL_RANK, else 0."""
    try:
        return int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError:
        return 0


def check_devices(device: str = "cuda", *, count: int = 1, first: int = 0, arch: Optional[str] = None,
                  backend: Optional[str] = None, argument: Optional[str] = "--device",
                  count_argument: Optional[str] = "--ranks", arch_argument: Optional[str] = "--backend") -> None:
    """Raise DeviceUnavailableError unless `device` exists here and, for CUDA, cuda:first .. cuda:first+count-1
    do; BackendUnavailableError unless each is an `arch` GPU when arch is given (`backend` names what needs it).
    On the CPU, a kernel backend (arch given) is refused too."""
    dev = require_device(device, argument)
    if dev.type != "cuda":
        if arch is not None:
            require_arch(dev, arch, backend or arch, arch_argument)
        return
    n = cuda_device_count()
    if first + count > n:
        raise DeviceUnavailableError(count_argument if count > 1 else argument, (
            f"cuda:{first}" + (f"..cuda:{first + count - 1} ({count} GPUs) are" if count > 1 else " is")
            + f" needed, but {describe_host()}"))
    if arch is not None:
        for i in range(first, first + count):
            require_arch(f"cuda:{i}", arch, backend or arch, arch_argument)


def _tool_name() -> str:
    path = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else "moe_ep"
    stem = os.path.splitext(os.path.basename(path))[0]
    return os.path.basename(os.path.dirname(path)) if stem == "__main__" else stem


def require(tool: Optional[str] = None, device: str = "cuda", **kwargs) -> None:
    """check_devices(), and on failure the tool's one line on stderr (`tool`: default, the running script's
    name) and SystemExit(EXIT_ABSENT)."""
    try:
        check_devices(device, **kwargs)
    except (DeviceUnavailableError, BackendUnavailableError) as e:
        print(f"{tool or _tool_name()}: {e}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_ABSENT) from None
