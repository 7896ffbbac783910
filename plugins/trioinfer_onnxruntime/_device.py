"""The device probe: whether CUDA or TensorRT really works here, and why not.

`probe_device` creates a trial session once per device and reports the cause
of a failure in one line; `_providers` lists the execution providers a
session on a device asks for, the CPU's last.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from trioinfer import Device

from ._ort import _one_line, _ort

_PROVIDERS: Final = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}


def _providers(device: Device, options: Mapping[str, Any]) -> list[Any]:
    extra = dict(options.get("provider_options", {}))
    if device.kind == "cpu":
        return ["CPUExecutionProvider"]
    cuda = ("CUDAExecutionProvider", {"device_id": device.index})
    if device.kind == "cuda":
        return [("CUDAExecutionProvider", {**cuda[1], **extra}), "CPUExecutionProvider"]
    return [
        ("TensorrtExecutionProvider", {"device_id": device.index, **extra}),
        cuda,
        "CPUExecutionProvider",
    ]


_probe_lock = threading.Lock()
_probed: dict[Device, str | None] = {}


def probe_device(device: Device) -> str | None:
    """Say why *device* cannot run ONNX Runtime sessions here, or ``None`` if it can.

    For GPU devices this creates a trial session on a one-node model (once per
    device; the answer is cached) with ONNX Runtime's own error output held
    back, and reports the cause in one line, e.g. a CUDA library that cannot
    be found. Blocks; call it off the event loop.
    """
    if device.kind == "cpu":
        return None
    with _probe_lock:
        if device not in _probed:
            _probed[device] = _probe(device)
        return _probed[device]


def _probe(device: Device) -> str | None:
    ort = _ort()
    provider = _PROVIDERS[device.kind]
    if provider not in ort.get_available_providers():
        return (
            f"this ONNX Runtime build ({ort.__version__}) has no {provider}; "
            "install trioinfer with the 'gpu' extra (onnxruntime-gpu) instead of 'cpu'"
        )
    captured = io.StringIO()
    ort.set_default_logger_severity(4)
    try:
        with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
            if hasattr(ort, "preload_dlls"):
                with contextlib.suppress(Exception):
                    ort.preload_dlls()
            try:
                session = ort.InferenceSession(_trial_model(), providers=_providers(device, {})[:1])
            except Exception as exc:
                return _one_line(exc)
    finally:
        ort.set_default_logger_severity(2)
    if session.get_providers()[0] == provider:
        return None
    return _library_error(device.kind) or (
        f"ONNX Runtime could not start {provider} on device {device.index} "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})"
    )


def _library_error(kind: str) -> str | None:
    # ORT's own message is many lines of C++ log; dlopen's is one line naming what is missing.
    lib = Path(_ort().__file__).parent / "capi" / f"libonnxruntime_providers_{kind}.so"
    if not lib.exists():
        return None
    try:
        ctypes.CDLL(str(lib))
    except OSError as exc:
        return str(exc).replace(str(lib) + ": ", "")
    return None


def _trial_model() -> bytes:
    # A one-node Identity model written as protobuf bytes by hand, so that the
    # probe needs no `onnx` package: ir_version 8, opset 13, float input x -> y.
    def field(number: int, wire: int, payload: bytes) -> bytes:
        return _varint(number << 3 | wire) + payload

    def string(number: int, value: bytes) -> bytes:
        return field(number, 2, _varint(len(value)) + value)

    def value_info(name: bytes) -> bytes:
        tensor_type = field(1, 0, _varint(1)) + string(2, string(1, field(1, 0, _varint(1))))
        return string(1, name) + string(2, string(1, tensor_type))

    node = string(1, b"x") + string(2, b"y") + string(4, b"Identity")
    graph = string(1, node) + string(2, b"probe") + string(11, value_info(b"x"))
    graph += string(12, value_info(b"y"))
    opset = string(1, b"") + field(2, 0, _varint(13))
    return field(1, 0, _varint(8)) + string(7, graph) + string(8, opset)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)
