"""Triton's CUDA shared memory on a real GPU: a client's device memory in, the answer back there.

What ``simple_http_cudashm_client.py`` does, without tritonclient (a lent GPU
machine may not have it): this process allocates device memory through the
CUDA driver (ctypes, as the server's ``_cuda_ipc`` does), writes the inputs
there, registers its IPC handles with ``trioinfer serve`` over HTTP, asks for
an inference whose inputs and outputs name the regions, and reads the
outputs back from device memory. The server opens the handles in its own
process, as Triton does. Skipped where CUDA is not usable (with the reason);
the CPU-only checks of the same endpoints are in test_triton.py.
"""

from __future__ import annotations

import base64
import ctypes
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from trioinfer.server._cuda_ipc import IPC_HANDLE_SIZE, probe
from trioinfer.testing import models

_WHY_NOT = probe()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.shm,
    pytest.mark.skipif(_WHY_NOT is not None, reason=f"CUDA is not usable here: {_WHY_NOT}"),
]


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_SIZE)]


class DeviceBuffer:
    """*size* bytes of this process's device memory on device 0, and its IPC handle."""

    def __init__(self, size: int) -> None:
        self._lib = lib = ctypes.CDLL("libcuda.so.1")
        self._check(lib.cuInit(0), "cuInit")
        device = ctypes.c_int()
        self._check(lib.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
        self._context = ctypes.c_void_p()
        self._check(
            lib.cuDevicePrimaryCtxRetain(ctypes.byref(self._context), device), "PrimaryCtxRetain"
        )
        self._check(lib.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")
        self.pointer = ctypes.c_uint64()
        self._check(lib.cuMemAlloc_v2(ctypes.byref(self.pointer), ctypes.c_size_t(size)), "alloc")
        self.size = size
        handle = _Handle()
        self._check(lib.cuIpcGetMemHandle(ctypes.byref(handle), self.pointer), "IpcGetMemHandle")
        # The structure's bytes (a c_char array's value would stop at its first NUL).
        self.raw_handle = ctypes.string_at(ctypes.addressof(handle), IPC_HANDLE_SIZE)

    def _check(self, code: int, what: str) -> None:
        assert code == 0, f"{what} failed with CUDA error {code}"

    def write(self, data: bytes) -> None:
        self._check(
            self._lib.cuMemcpyHtoD_v2(
                self.pointer, ctypes.c_char_p(data), ctypes.c_size_t(len(data))
            ),
            "cuMemcpyHtoD",
        )

    def read(self, size: int) -> bytes:
        out = ctypes.create_string_buffer(size)
        self._check(self._lib.cuMemcpyDtoH_v2(out, self.pointer, ctypes.c_size_t(size)), "DtoH")
        return out.raw

    def free(self) -> None:
        self._lib.cuMemFree_v2(self.pointer)


def _pump(stream: Any, lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def _serve(repository: Path, log: Path) -> Iterator[str]:
    command = [sys.executable, "-m", "trioinfer", "serve", "--port", "0", "--no-grpc"]
    command += ["--model-repository", str(repository)]
    env = {k: v for k, v in os.environ.items() if k != "TRIOINFER_ADMIN_TOKEN"}
    with log.open("wb") as err:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, env=env, text=True)
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_pump, args=(process.stdout, lines), daemon=True).start()
    try:
        deadline = time.monotonic() + 60
        while True:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            assert line is not None, f"the server exited; log:\n{log.read_text()[-3000:]}"
            found = re.search(r"listening on (http://\S+)", line)
            if found:
                break
        yield found.group(1)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0, log.read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[str]:
    models.write_add(tmp_path / "repo" / "add" / "1" / "model.onnx", width=4)
    yield from _serve(tmp_path / "repo", tmp_path / "serve.log")


def test_inputs_and_outputs_in_a_clients_device_memory(server: str) -> None:
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    b = np.full((2, 4), 10.0, dtype=np.float32)
    inputs, outputs = DeviceBuffer(a.nbytes * 2), DeviceBuffer(a.nbytes * 2)
    try:
        inputs.write(a.tobytes() + b.tobytes())
        with httpx.Client(base_url=server, timeout=30) as http:
            http.post("/v2/cudasharedmemory/unregister").raise_for_status()
            for name, buffer in (("in", inputs), ("out", outputs)):
                body = {
                    "raw_handle": {"b64": base64.b64encode(buffer.raw_handle).decode()},
                    "device_id": 0,
                    "byte_size": buffer.size,
                }
                response = http.post(f"/v2/cudasharedmemory/region/{name}/register", json=body)
                assert response.status_code == 200, response.text
            status = http.get("/v2/cudasharedmemory/status").json()
            assert sorted(r["name"] for r in status) == ["in", "out"]

            def region(name: str, offset: int) -> dict[str, Any]:
                return {
                    "shared_memory_region": name,
                    "shared_memory_offset": offset,
                    "shared_memory_byte_size": a.nbytes,
                }

            request = {
                "inputs": [
                    {
                        "name": "a",
                        "datatype": "FP32",
                        "shape": [2, 4],
                        "parameters": region("in", 0),
                    },
                    {
                        "name": "b",
                        "datatype": "FP32",
                        "shape": [2, 4],
                        "parameters": region("in", a.nbytes),
                    },
                ],
                "outputs": [
                    {"name": "sum", "parameters": region("out", 0)},
                    {"name": "diff", "parameters": region("out", a.nbytes)},
                ],
            }
            response = http.post("/v2/models/add/infer", json=request)
            assert response.status_code == 200, response.text
            answer = response.json()["outputs"]
            assert [o["name"] for o in answer] == ["sum", "diff"]
            assert all("data" not in o for o in answer)  # in device memory, not the body
            raw = outputs.read(a.nbytes * 2)
            np.testing.assert_array_equal(
                np.frombuffer(raw[: a.nbytes], np.float32), (a + b).ravel()
            )
            np.testing.assert_array_equal(
                np.frombuffer(raw[a.nbytes :], np.float32), (a - b).ravel()
            )
            # A region too small for the answer is refused, and nothing is written.
            request["outputs"][0]["parameters"]["shared_memory_byte_size"] = 4
            response = http.post("/v2/models/add/infer", json=request)
            assert response.status_code == 400, response.text
            http.post("/v2/cudasharedmemory/unregister").raise_for_status()
            assert http.get("/v2/cudasharedmemory/status").json() == []
    finally:
        inputs.free()
        outputs.free()
