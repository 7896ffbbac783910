"""The device probe: whether CUDA or TensorRT really works here, and why not.

`probe_device` creates a trial session once per device, in a child process
(where ONNX Runtime's own output stays), and reports the cause of a failure
in one line; `_providers` lists the execution providers a
session on a device asks for, the CPU's last.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import subprocess
import sys
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


#: Longest a device probe may take (a first CUDA start can be slow), in seconds.
_PROBE_TIMEOUT_S = 120.0
#: What starts the probing child's answer, the last line of its stdout.
_ANSWER = "trioinfer probe: "


def _probe(device: Device) -> str | None:
    ort = _ort()
    provider = _PROVIDERS[device.kind]
    if provider not in ort.get_available_providers():
        return (
            f"this ONNX Runtime build ({ort.__version__}) has no {provider}; "
            "install trioinfer with the 'gpu' extra (onnxruntime-gpu) instead of 'cpu'"
        )
    # The trial runs in a process of its own: ONNX Runtime and its CUDA loaders
    # write to the process's stdout and stderr (C++ log lines, preload_dlls'
    # prints), which only a child can hold back without swapping this process's
    # streams under every other thread. A driver that crashes takes only the child.
    code = f"from {__name__} import _probe_here; _probe_here({device.kind!r}, {device.index})"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    try:
        child = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            env=env,
            timeout=_PROBE_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"could not probe {device}: {_one_line(exc)}"
    answer = child.stdout.decode(errors="replace").rstrip().rpartition("\n")[2]
    if child.returncode != 0 or not answer.startswith(_ANSWER):
        said = child.stderr.decode(errors="replace").strip().splitlines()
        return f"probing {device} failed (exit status {child.returncode})" + (
            f": {said[-1]}" if said else ""
        )
    reason: str | None = json.loads(answer.removeprefix(_ANSWER))
    if reason is None and hasattr(ort, "preload_dlls"):
        # Load here too what the child loaded, for this process's own sessions:
        # quietly, since it loads.
        with contextlib.suppress(Exception):
            ort.preload_dlls()
    return reason


def _probe_here(kind: str, index: int) -> None:
    # The child's side of _probe: the answer is the last line it prints.
    ort = _ort()
    ort.set_default_logger_severity(4)
    device = Device(kind, index)  # type: ignore[arg-type]  # the parent's Device.kind
    if hasattr(ort, "preload_dlls"):
        with contextlib.suppress(Exception):
            ort.preload_dlls()
    reason: str | None
    try:
        session = ort.InferenceSession(_trial_model(), providers=_providers(device, {})[:1])
    except Exception as exc:
        reason = _one_line(exc)
    else:
        provider = _PROVIDERS[device.kind]
        reason = (
            None
            if session.get_providers()[0] == provider
            else _library_error(device.kind)
            or (
                f"ONNX Runtime could not start {provider} on device {device.index} "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})"
            )
        )
    print(_ANSWER + json.dumps(reason), flush=True)


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
