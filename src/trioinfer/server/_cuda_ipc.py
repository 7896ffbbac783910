"""CUDA IPC memory through the CUDA driver API (``libcuda``), with ctypes: no extra package.

What Triton's CUDA shared-memory extension needs of CUDA: open a
``cudaIpcMemHandle_t`` another process made (``cuIpcOpenMemHandle``), copy
bytes out of it and into it, and close it. The driver library comes with the
NVIDIA driver, so this works wherever a GPU does; `probe()` says why not
elsewhere. Every call makes the device's primary context current on the
calling thread first (the HTTP event loop's, or a gRPC worker's).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from typing import Any, Final

__all__ = ["IPC_HANDLE_SIZE", "CudaError", "IpcMemory", "probe"]

#: Bytes of a ``cudaIpcMemHandle_t``.
IPC_HANDLE_SIZE: Final = 64
_LAZY_ENABLE_PEER_ACCESS: Final = 1


class CudaError(Exception):
    """A CUDA driver call failed, or there is no usable driver or device."""


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_SIZE)]


@functools.cache
def _driver() -> Any:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise CudaError(f"no CUDA driver (libcuda.so.1 cannot be loaded: {exc})") from None
    _check(lib, lib.cuInit(0), "cuInit")
    return lib


def _check(lib: Any, code: int, what: str) -> None:
    if code != 0:
        text = ctypes.c_char_p()
        lib.cuGetErrorString(code, ctypes.byref(text))
        reason = text.value.decode() if text.value else f"error {code}"
        raise CudaError(f"{what} failed: {reason}")


def _function(lib: Any, *names: str) -> Any:
    for name in names:
        try:
            return getattr(lib, name)
        except AttributeError:
            continue
    raise CudaError(f"the CUDA driver has none of {', '.join(names)}")  # pragma: no cover


def probe() -> str | None:
    """``None`` when CUDA IPC memory can be used here, else why not (for messages)."""
    try:
        lib = _driver()
        count = ctypes.c_int()
        _check(lib, lib.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
    except CudaError as exc:
        return str(exc)
    return None if count.value > 0 else "no CUDA device"


_contexts: dict[int, ctypes.c_void_p] = {}
_contexts_lock = threading.Lock()


def _context(lib: Any, device_id: int) -> ctypes.c_void_p:
    with _contexts_lock:
        context = _contexts.get(device_id)
        if context is None:
            device = ctypes.c_int()
            _check(lib, lib.cuDeviceGet(ctypes.byref(device), device_id), "cuDeviceGet")
            context = ctypes.c_void_p()
            _check(
                lib,
                lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device),
                "cuDevicePrimaryCtxRetain",
            )
            _contexts[device_id] = context
        return context


class IpcMemory:
    """Another process's device memory, opened from its IPC handle; close it when done."""

    def __init__(self, raw_handle: bytes, device_id: int) -> None:
        if len(raw_handle) != IPC_HANDLE_SIZE:
            raise CudaError(f"a CUDA IPC handle is {IPC_HANDLE_SIZE} bytes, got {len(raw_handle)}")
        self._lib = lib = _driver()
        self.device_id = device_id
        self._ctx = _context(lib, device_id)
        self._pointer = ctypes.c_uint64()
        handle = _Handle()
        ctypes.memmove(ctypes.addressof(handle), raw_handle, IPC_HANDLE_SIZE)
        open_handle = _function(lib, "cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle")
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        address_range = _function(lib, "cuMemGetAddressRange_v2", "cuMemGetAddressRange")
        with self._current():
            _check(
                lib,
                open_handle(ctypes.byref(self._pointer), handle, _LAZY_ENABLE_PEER_ACCESS),
                "cuIpcOpenMemHandle",
            )
            _check(
                lib,
                address_range(ctypes.byref(base), ctypes.byref(size), self._pointer),
                "cuMemGetAddressRange",
            )
        #: Bytes from the handle's address to the end of its allocation.
        self.size = size.value - (self._pointer.value - base.value)

    def _current(self) -> _Current:
        return _Current(self._lib, self._ctx)

    def read(self, offset: int, size: int) -> bytearray:
        """Copy *size* bytes at *offset* to the host."""
        out = bytearray(size)
        if size:
            buffer = (ctypes.c_char * size).from_buffer(out)
            copy = _function(self._lib, "cuMemcpyDtoH_v2", "cuMemcpyDtoH")
            with self._current():
                _check(
                    self._lib,
                    copy(
                        buffer, ctypes.c_uint64(self._pointer.value + offset), ctypes.c_size_t(size)
                    ),
                    "cuMemcpyDtoH",
                )
        return out

    def write(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        """Copy *data* to *offset*."""
        raw = bytes(data)
        if raw:
            copy = _function(self._lib, "cuMemcpyHtoD_v2", "cuMemcpyHtoD")
            with self._current():
                _check(
                    self._lib,
                    copy(
                        ctypes.c_uint64(self._pointer.value + offset),
                        ctypes.c_char_p(raw),
                        ctypes.c_size_t(len(raw)),
                    ),
                    "cuMemcpyHtoD",
                )

    def close(self) -> None:
        """Close the handle (the memory stays the other process's)."""
        if self._pointer.value:
            with self._current():
                self._lib.cuIpcCloseMemHandle(self._pointer)
            self._pointer = ctypes.c_uint64()


class _Current:
    """Make a context current on this thread for the block (push, then pop)."""

    def __init__(self, lib: Any, context: ctypes.c_void_p) -> None:
        self._lib = lib
        self._context = context

    def __enter__(self) -> None:
        push = _function(self._lib, "cuCtxPushCurrent_v2", "cuCtxPushCurrent")
        _check(self._lib, push(self._context), "cuCtxPushCurrent")

    def __exit__(self, *_exc: object) -> None:
        pop = _function(self._lib, "cuCtxPopCurrent_v2", "cuCtxPopCurrent")
        pop(ctypes.byref(ctypes.c_void_p()))
