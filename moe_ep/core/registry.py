"""String-keyed backend registry. Entries are lazy ("module:attr") so that registering a GPU backend
imports nothing heavy; the module is imported only when a layer asks for that backend."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings
from dataclasses import dataclass
from typing import Dict, NamedTuple, Optional, Tuple, Union

from moe_ep.core.errors import BackendNotFoundError, BackendUnavailableError, FormatError, RegistrationError
from moe_ep.formats import check_format

__all__ = ["BackendEntry", "BackendInfo", "register_backend", "unregister_backend", "get_entry", "resolve_backend",
           "list_backends", "select_backend", "detect_arch"]


@dataclass(frozen=True)
class BackendEntry:
    name: str
    target: Union[str, type]  # "package.module:Attr" or the class itself
    arch: str
    formats: Tuple[str, ...]
    description: str = ""

    @property
    def default_format(self) -> str:
        return self.formats[0]

    @property
    def module(self) -> Optional[str]:
        return self.target.split(":", 1)[0] if isinstance(self.target, str) else None


class BackendInfo(NamedTuple):
    arch: str
    formats: Tuple[str, ...]
    available: bool


_REGISTRY: Dict[str, BackendEntry] = {}


def register_backend(name: str, target, *, arch: str, formats, description: str = "",
                     replace: bool = False) -> BackendEntry:
    if not isinstance(name, str) or not name:
        raise RegistrationError("name", f"expected a non-empty string, got {name!r}")
    if isinstance(target, str) and ":" not in target:
        raise RegistrationError("target", f"expected 'module:attr' (a lazy string) or a class, got {target!r}")
    formats = tuple(formats)
    if not formats:
        raise RegistrationError("formats", "expected at least one format")
    for f in formats:
        check_format(f, "formats")
    if name in _REGISTRY and not replace:
        raise RegistrationError("name", f"backend {name!r} is already registered (pass replace=True to override)")
    entry = BackendEntry(name, target, arch, formats, description)
    _REGISTRY[name] = entry
    return entry


def unregister_backend(name: str) -> None:
    _REGISTRY.pop(name, None)


def get_entry(name: str) -> BackendEntry:
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise BackendNotFoundError("backend", f"unknown backend {name!r}; registered: {sorted(_REGISTRY)}") from None


def _module_present(module: str) -> bool:
    """Whether `module` can be found, importing nothing (importlib.util.find_spec would import its parent
    packages, and a kernel backend's parents are shim packages)."""
    import importlib.machinery

    if module in sys.modules:
        return True
    parts = module.split(".")
    path = None
    try:
        for depth in range(1, len(parts) + 1):
            name = ".".join(parts[:depth])
            loaded = sys.modules.get(name)
            if loaded is not None:
                spec = getattr(loaded, "__spec__", None)
            elif path is None:
                spec = importlib.util.find_spec(name)  # a top-level name: nothing above it to import
            else:
                spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None:
                return False
            path = spec.submodule_search_locations or []
        return True
    except (ImportError, ValueError, AttributeError):
        return False


def resolve_backend(name: str):
    """The backend class for name, importing its module now. BackendUnavailableError says why it cannot."""
    entry = get_entry(name)
    if not isinstance(entry.target, str):
        return entry.target
    module, attr = entry.target.split(":", 1)
    if not _module_present(module):
        raise BackendUnavailableError("backend", f"{name!r} needs module {module!r}, which is not installed here")
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # an import failure of any kind means "not usable here"; keep the reason
        raise BackendUnavailableError("backend", f"{name!r}: importing {module!r} failed: "
                                                 f"{type(e).__name__}: {e}") from e
    try:
        return getattr(mod, attr)
    except AttributeError:
        raise BackendUnavailableError("backend", f"{name!r}: module {module!r} has no attribute {attr!r}") from None


def list_backends() -> Dict[str, BackendInfo]:
    """name -> (arch, formats, available): 'available' means the module can be found; nothing is imported."""
    out = {}
    for name, e in _REGISTRY.items():
        available = True if e.module is None else _module_present(e.module)
        out[name] = BackendInfo(e.arch, e.formats, available)
    return out


def detect_arch(device=None) -> str:
    """'cpu' unless the device is CUDA; then 'sm90', 'sm100', ... from its compute capability."""
    import torch

    if device is None:
        if not torch.cuda.is_available():
            return "cpu"
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}0" if major >= 10 else f"sm{major}{minor}"


def select_backend(arch: str, fmt: Optional[str] = None, *, fallback: str = "torch_reference") -> BackendEntry:
    """First registered backend for arch (and fmt, if given) whose module is present. On no match the
    fallback (the torch reference, which runs on any device) is used, with a warning when a kernel arch was
    asked for."""
    if fmt is not None:
        check_format(fmt)
    for e in _REGISTRY.values():
        if e.arch != arch or (fmt is not None and fmt not in e.formats):
            continue
        if e.module is None or _module_present(e.module):
            return e
    fb = get_entry(fallback)
    if fmt is not None and fmt not in fb.formats:
        raise FormatError("fmt", f"no backend serves fmt {fmt!r} on {arch}")
    if arch != fb.arch:
        warnings.warn(f"no kernel backend for {arch}" + (f" and fmt {fmt!r}" if fmt else "") +
                      f" is installed; using {fallback!r}", RuntimeWarning, stacklevel=2)
    return fb


def _register_builtin() -> None:
    register_backend("torch_reference", "moe_ep.reference.backend:TorchReferenceBackend", arch="cpu",
                     formats=("bf16", "fp8_block", "fp8_tensor", "mxfp8", "nvfp4"),
                     description="exact EP semantics in torch over torch.distributed; the oracle")
    # Kernel backends live beside the shim that drives them; named here by lazy strings only, so moe_ep imports
    # nothing of shim/ and a CPU host never loads a kernel tree.
    register_backend("sm90_fp8_cutedsl", "shim.sm90.backend:Sm90Fp8Backend", arch="sm90",
                     formats=("fp8_block",), description="Hopper FP8 MegaMoE, blockwise scales (CuTe DSL)")
    register_backend("sm90_bf16_cutedsl", "shim.sm90.backend:Sm90Bf16Backend", arch="sm90",
                     formats=("bf16",), description="Hopper BF16 MegaMoE (CuTe DSL)")
    register_backend("sm100_nvfp4_cutedsl", "shim.sm100.backend:Sm100Nvfp4Backend", arch="sm100",
                     formats=("nvfp4",), description="Blackwell NVFP4 MegaMoE (CuTe DSL)")
    register_backend("sm100_mxfp8_cutedsl", "shim.sm100.backend:Sm100Mxfp8Backend", arch="sm100",
                     formats=("mxfp8",), description="Blackwell MXFP8 MegaMoE (CuTe DSL)")
    register_backend("sm100_bf16_cutedsl", "shim.sm100.backend:Sm100Bf16Backend", arch="sm100",
                     formats=("bf16",), description="Blackwell BF16 MegaMoE (CuTe DSL)")

_register_builtin()
