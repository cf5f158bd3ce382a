"""The CUDA calls of the watchdog's hot path and of its monitor, bound on first use (a CPU-only torch has none).

kind "driver" (preferred): the driver through ctypes, pre-created events, ONE call per watched call
(cuEventRecord(event, the current stream's raw handle from torch)). torch's Event.record costs several runtime
calls (a capture check, a device guard, the record, with the GIL released around them); with a capture check of
our own it cost several times the one driver call (docs/watchdog.md). kind "torch": the
same through torch's events, where the driver library cannot be loaded.

No capture check: recording a plain event on a capturing stream is legal (it marks a point for cross-stream
dependencies and adds no node to the graph). Queried later, such an event reports an error instead of a state,
and query() counts any error as finished: a caller's graph replays are the caller's to watch.
record(event, raw stream) -> 0 when recorded; query(event) -> True when finished (or not followable).

Everything else reads the one instance through this module (`events.cuda`), so a test can put a fake in its place.
"""

from __future__ import annotations

import ctypes
import os
from typing import Dict, Optional

import torch

from moe_ep.core.watchdog.verdict import warn

__all__ = ["CudaEvents", "cuda", "NOT_READY", "relax_capture_mode"]

NOT_READY = 600  # CUDA_ERROR_NOT_READY
_EVENT_DISABLE_TIMING = 2


class CudaEvents:
    """The event recorder: bind() picks the driver or torch's events; record / query / new_events / raw_stream /
    capturing are the calls the watchdog makes."""

    def __init__(self):
        self.ready = False
        self.kind = None
        self.query = lambda ev: True  # nothing recorded before bind()

    def bind(self, kind: Optional[str] = None) -> None:
        if self.ready:
            return
        self.capturing = torch._C._cuda_isCurrentStreamCapturing
        self.raw_stream = torch._C._cuda_getCurrentRawStream
        kind = kind or os.environ.get("MOE_EP_WATCHDOG_EVENTS", "driver")
        if kind == "driver":
            try:
                self._bind_driver()
            except (OSError, AttributeError):
                kind = "torch"
        if kind != "driver":
            self._bind_torch()
        self.kind = kind
        self.ready = True

    def _bind_driver(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")  # CDLL releases the GIL during each call: a record that blocks on a
        c_int, c_void_p, ptr = ctypes.c_int, ctypes.c_void_p, ctypes.POINTER  # full launch queue stalls nothing else

        def fn(name, *argtypes):
            f = getattr(lib, name)
            f.argtypes, f.restype = list(argtypes), c_int
            return f

        self._lib = lib
        self._create = fn("cuEventCreate", ptr(c_void_p), ctypes.c_uint)
        self._device_get = fn("cuDeviceGet", ptr(c_int), c_int)
        self._ctx_retain = fn("cuDevicePrimaryCtxRetain", ptr(c_void_p), c_int)
        self._ctx_release = fn("cuDevicePrimaryCtxRelease_v2", c_int)
        self._ctx_push = fn("cuCtxPushCurrent_v2", c_void_p)
        self._ctx_pop = fn("cuCtxPopCurrent_v2", ptr(c_void_p))
        self.record = fn("cuEventRecord", c_void_p, c_void_p)
        q = fn("cuEventQuery", c_void_p)
        self.query = lambda ev: q(ev) != NOT_READY
        self.new_events = self._driver_events

    def _driver_events(self, dev: int, n: int) -> list:
        """n events in the device's primary context (the one torch uses), timing off."""
        c_void_p = ctypes.c_void_p
        device, ctx, popped = ctypes.c_int(), c_void_p(), c_void_p()
        for rc in (self._device_get(ctypes.byref(device), dev), self._ctx_retain(ctypes.byref(ctx), device.value)):
            if rc:
                raise RuntimeError(f"moe_ep watchdog: CUDA driver error {rc} getting device {dev}'s context")
        self._ctx_push(ctx)
        try:
            out = []
            for _ in range(n):
                h = c_void_p()
                rc = self._create(ctypes.byref(h), _EVENT_DISABLE_TIMING)
                if rc:
                    raise RuntimeError(f"moe_ep watchdog: cuEventCreate failed with CUDA driver error {rc}")
                out.append(h.value)
            return out
        finally:
            self._ctx_pop(ctypes.byref(popped))
            self._ctx_release(device.value)

    def _bind_torch(self) -> None:
        base_record = torch._C._CudaEventBase.record
        streams: Dict[int, object] = {}

        def record(ev, raw) -> int:
            s = streams.get(raw)
            if s is None:
                if len(streams) > 64:
                    streams.clear()
                s = streams[raw] = torch.cuda.current_stream()
            try:
                base_record(ev, s)
                return 0
            except Exception:  # noqa: BLE001 - not recorded: the call is not followed on the device
                return 1

        def query(ev) -> bool:
            try:
                return ev.query()
            except Exception:  # noqa: BLE001 - e.g. recorded in a capture: not followable, counted finished
                return True

        def new_events(dev: int, n: int) -> list:
            with torch.cuda.device(dev):
                return [torch.cuda.Event() for _ in range(n)]

        self.record, self.query, self.new_events = record, query, new_events


cuda = CudaEvents()


def relax_capture_mode() -> None:
    """This thread's CUDA calls (event queries) must not disturb another thread's graph capture: in the default
    "global" capture mode any thread's potentially unsafe call invalidates a capture in progress (a
    whole-model capture fails with cudaErrorStreamCaptureInvalidated while the monitor polls). A
    thread in "relaxed" mode is exempt, and neither prohibited nor prohibiting."""
    try:
        from cuda.bindings import runtime as rt

        rt.cudaThreadExchangeStreamCaptureMode(rt.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed)
    except Exception as e:  # noqa: BLE001 - no cuda-python / no GPU: nothing to relax
        if torch.cuda.is_available():
            warn(f"could not set the monitor thread's capture mode to relaxed ({type(e).__name__}: {e})")
