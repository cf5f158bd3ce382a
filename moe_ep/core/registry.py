"""String-keyed backend registry. Entries are lazy ("module:attr") so that registering a GPU backend
imports nothing heavy; the module is imported only when a layer asks for that backend.

The kernel backends are rows of each arch's format table (shim/<arch>/formats.py), named here by lazy strings
(`KERNEL_TABLES`) and read the first time the registry is asked anything (a listing, a lookup, a selection):
`import moe_ep` imports nothing of shim, and a table imports no kernel. A table that is not installed (a build
of moe_ep without the shim) contributes no entries, and lookups say so.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple, Type, Union

from moe_ep.core.backend import Backend
from moe_ep.errors import BackendNotFoundError, BackendUnavailableError, FormatError, MoEError, RegistrationError
from moe_ep.formats import FORMATS, check_format

__all__ = ["BackendEntry", "BackendInfo", "register_backend", "unregister_backend", "get_entry", "resolve_backend",
           "list_backends", "select_backend", "detect_arch", "KERNEL_TABLES"]

# Each kernel arch's format table ("module:attr" of a shim.common.formats.FormatTable; its registrations() are
# register_backend's arguments). Order is selection order: an arch's first row is its default backend.
KERNEL_TABLES = ("shim.sm90.formats:BACKENDS", "shim.sm100.formats:BACKENDS")


@dataclass(frozen=True)
class BackendEntry:
    name: str
    target: Union[str, type]  # "package.module:Attr" or the class itself
    arch: str
    formats: Tuple[str, ...]
    description: str = ""
    # Why the backend cannot run here (None: it can), found without importing it; may raise a
    # BackendUnavailableError of its own (a kernel tree that cannot be found or verified).
    probe: Optional[Callable[[], Optional[str]]] = None

    @property
    def default_format(self) -> str:
        return self.formats[0]

    @property
    def module(self) -> Optional[str]:
        return self.target.split(":", 1)[0] if isinstance(self.target, str) else None


class _Info(NamedTuple):
    arch: str
    formats: Tuple[str, ...]
    available: bool


class BackendInfo(_Info):
    """(arch, formats, available) as before, plus `reason`: why the backend cannot run here ("" when it can).
    `reason` is an attribute, not a tuple field, so unpacking and comparing the triple keep working."""

    def __new__(cls, arch: str, formats: Tuple[str, ...], available: bool, reason: str = ""):
        self = super().__new__(cls, arch, formats, available)
        self.reason = reason
        return self

    def __repr__(self):
        return (f"BackendInfo(arch={self.arch!r}, formats={self.formats!r}, available={self.available!r}"
                + (f", reason={self.reason!r})" if self.reason else ")"))


_REGISTRY: Dict[str, BackendEntry] = {}
_tables_read = False
_tables_absent: List[str] = []  # what a lookup that finds nothing should mention


def _read_tables() -> None:
    """Register every row of the installed kernel format tables (once, on the registry's first use)."""
    global _tables_read
    if _tables_read:
        return
    _tables_read = True
    for spec in KERNEL_TABLES:
        module, attr = spec.split(":", 1)
        try:
            table = getattr(importlib.import_module(module), attr)
        except ModuleNotFoundError as e:
            if e.name and (module == e.name or module.startswith(e.name + ".")):
                _tables_absent.append(f"{module} (not installed here)")
                continue
            raise
        for row in table.registrations():
            _add(**row, replace=False)


def _entries() -> Dict[str, BackendEntry]:
    _read_tables()
    return _REGISTRY


def _add(name: str, target, *, arch: str, formats, description: str = "", probe=None,
         replace: bool = False) -> BackendEntry:
    if not isinstance(name, str) or not name:
        raise RegistrationError("name", f"expected a non-empty string, got {name!r}")
    if isinstance(target, str) and ":" not in target:
        raise RegistrationError("target", f"expected 'module:attr' (a lazy string) or a class, got {target!r}")
    formats = tuple(formats)
    if not formats:
        raise RegistrationError("formats", "expected at least one format")
    for fmt in formats:
        check_format(fmt, "formats")
    if name in _REGISTRY and not replace:
        raise RegistrationError("name", f"backend {name!r} is already registered (pass replace=True to override)")
    entry = BackendEntry(name, target, arch, formats, description, probe)
    _REGISTRY[name] = entry
    return entry


def register_backend(name: str, target, *, arch: str, formats, description: str = "",
                     probe: Optional[Callable[[], Optional[str]]] = None, replace: bool = False) -> BackendEntry:
    """Register a backend class (or a lazy "module:attr" naming one) under `name` for `arch` and `formats` (the
    first is its default). probe: returns why the backend cannot run here, or None; called by list_backends()
    and before the class is imported, it must not import the backend."""
    _read_tables()  # a name a table already holds is a clash, whatever the order of first use
    return _add(name, target, arch=arch, formats=formats, description=description, probe=probe, replace=replace)


def unregister_backend(name: str) -> None:
    _entries().pop(name, None)


def get_entry(name: str) -> BackendEntry:
    entries = _entries()
    try:
        return entries[name]
    except (KeyError, TypeError):
        absent = f"; kernel backend tables not found: {', '.join(_tables_absent)}" if _tables_absent else ""
        raise BackendNotFoundError("backend", f"unknown backend {name!r}; registered: {sorted(entries)}"
                                              f"{absent}") from None


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


def resolve_backend(name: str) -> Type[Backend]:
    """The backend class for name, importing its module now. BackendUnavailableError says why it cannot (its
    probe first: a kernel the pinned tree lacks is named before anything is imported). The class is checked once
    against its registration: a moe_ep.Backend (whose class attributes state its capabilities) serving every
    format the entry names, or a RegistrationError."""
    entry = get_entry(name)
    if entry.probe is not None:
        reason = entry.probe()
        if reason:
            raise BackendUnavailableError("backend", reason)
    cls = entry.target if not isinstance(entry.target, str) else _import_target(name, entry.target)
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise RegistrationError("target", f"backend {name!r} resolves to {cls!r}, not a moe_ep.Backend subclass")
    missing = [fmt for fmt in entry.formats if fmt not in cls.weight_formats]
    if missing:
        raise RegistrationError("formats", f"backend {name!r} is registered for {list(entry.formats)}, but "
                                           f"{cls.__name__} serves {list(cls.weight_formats)} (not {missing})")
    return cls


def _import_target(name: str, target: str):
    module, attr = target.split(":", 1)
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


def _unavailable(entry: BackendEntry) -> str:
    """Why `entry` cannot run here ("" when it can), importing nothing of it."""
    if entry.module is not None and not _module_present(entry.module):
        return f"module {entry.module!r} is not installed here"
    if entry.probe is None:
        return ""
    try:
        return entry.probe() or ""
    except MoEError as e:  # e.g. the kernel tree cannot be found or does not verify
        return str(e)


def list_backends() -> Dict[str, BackendInfo]:
    """name -> (arch, formats, available), with `.reason` when unavailable. A backend is available when its
    module can be found and its probe finds what it needs (a kernel backend: its kernel module in the arch's
    pinned tree); nothing of a backend is imported."""
    out = {}
    for name, e in _entries().items():
        reason = _unavailable(e)
        out[name] = BackendInfo(e.arch, e.formats, not reason, reason)
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
    for e in _entries().values():
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


# The torch reference is moe_ep's own; the kernel backends come from the format tables (KERNEL_TABLES).
_add("torch_reference", "moe_ep.reference.backend:TorchReferenceBackend", arch="cpu", formats=FORMATS,
     description="exact EP semantics in torch over torch.distributed; the oracle")

# The split paths (moe_ep/split, docs/scale-out.md): torch over the group's transport on any device ("cpu" here, as
# for the reference, means no arch is required); "auto" measures the paths the group can run and keeps the fastest.
_add("split", "moe_ep.split.backend:SplitBackend", arch="cpu", formats=FORMATS,
     description="dispatch over the transport, the rank's experts on a local engine, combine back")
_add("two_level", "moe_ep.split.two_level:TwoLevelBackend", arch="cpu", formats=FORMATS,
     description="a fused backend inside each NVLink domain, the transport between domains")
_add("auto", "moe_ep.split.auto:AutoBackend", arch="cpu", formats=FORMATS,
     description="measures the whole-group, split and two-level paths at construction and keeps the fastest")
