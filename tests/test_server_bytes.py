"""BYTES tensors keep their bytes over HTTP (JSON and binary) and gRPC.

A Python model gets a BYTES input as an object array of ``bytes`` (as Triton's
Python backend gives it), whatever the transport, unless its config declares
the input ``utf8 = true`` (then ``str``). An ONNX string input is UTF-8 text:
bytes that are not UTF-8 are the client's error (400, INVALID_ARGUMENT), named
by input and element. Real server on loopback, real tritonclient.
"""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import numpy as np
import pytest
import trio
import tritonclient.http as triton_http
import tritonclient.utils as utils
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from trioinfer.server import serve_http
from trioinfer.testing import models

pytestmark = pytest.mark.python_model

T = TypeVar("T")

ECHO_PY = '''\
import numpy as np


class Model:
    """OUT is IN as given; KIND is the type name of each element the model got."""

    def infer(self, inputs):
        given = inputs["IN"]
        kinds = np.array([type(v).__name__ for v in given.ravel()], dtype=object)
        return {"OUT": given, "KIND": kinds.reshape(given.shape)}
'''


def echo_config(utf8: bool) -> str:
    text = ", utf8 = true" if utf8 else ""
    return (
        'backend = "python"\n'
        'batcher = "none"\n'
        "[backend_options]\n"
        f'inputs = [{{ name = "IN", dtype = "BYTES", shape = [-1]{text} }}]\n'
        "outputs = [\n"
        '    { name = "OUT", dtype = "BYTES", shape = [-1] },\n'
        '    { name = "KIND", dtype = "BYTES", shape = [-1] },\n'
        "]\n"
    )


#: What an image client sends: a JPEG's first bytes, random bytes, embedded NULs.
BLOBS = [
    b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + np.random.default_rng(7).bytes(300),
    b"",
    b"\x00\x00a\x00",
    b"\x80\xfe\xff",
    "caf\u00e9".encode(),
]


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    root = tmp_path / "repository"
    for name, utf8 in (("echo", False), ("echo_text", True)):
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").write_text(ECHO_PY)
        (root / name / "config.toml").write_text(echo_config(utf8))
    models.write_identity(root / "strings" / "1" / "model.onnx", dtype=object, shape=("b", 4))
    return root


@pytest.fixture
async def server(
    repository: Path, nursery: trio.Nursery, request: pytest.FixtureRequest
) -> AsyncIterator[Any]:
    grpc_port = 0 if request.node.get_closest_marker("grpc") else None
    listening = await nursery.start(
        functools.partial(
            serve_http,
            repository,
            host="127.0.0.1",
            port=0,
            grpc_port=grpc_port,
            handle_signals=False,
        )
    )
    yield listening
    nursery.cancel_scope.cancel()


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    # tritonclient blocks: off the loop that serves it.
    return await trio.to_thread.run_sync(fn, *args)


def blobs_input(client_module: Any, name: str = "IN", *, binary: bool = True) -> Any:
    values = np.array(BLOBS, dtype=object)
    tensor = client_module.InferInput(name, [len(BLOBS)], "BYTES")
    if client_module is triton_http:
        tensor.set_data_from_numpy(values, binary_data=binary)
    else:
        tensor.set_data_from_numpy(values)
    return tensor


def host_port(url: str) -> str:
    return url.removeprefix("http://").rstrip("/")


# -- HTTP ----------------------------------------------------------------------------------------


async def test_http_binary_bytes_reach_a_python_model_as_bytes_and_come_back(server: Any) -> None:
    def infer() -> Any:
        with triton_http.InferenceServerClient(host_port(server.urls[0])) as client:
            outputs = [
                triton_http.InferRequestedOutput("OUT", binary_data=True),
                triton_http.InferRequestedOutput("KIND", binary_data=False),
            ]
            return client.infer("echo", [blobs_input(triton_http)], outputs=outputs)

    result = await in_thread(infer)
    assert result.as_numpy("OUT").tolist() == BLOBS
    assert result.as_numpy("KIND").tolist() == ["bytes"] * len(BLOBS)


async def test_http_json_strings_reach_a_python_model_as_bytes(server: Any) -> None:
    def infer(model: str) -> Any:
        texts = np.array(["plain", "caf\u00e9", ""], dtype=object)
        tensor = triton_http.InferInput("IN", [3], "BYTES")
        tensor.set_data_from_numpy(texts, binary_data=False)
        outputs = [triton_http.InferRequestedOutput(n, binary_data=False) for n in ("OUT", "KIND")]
        with triton_http.InferenceServerClient(host_port(server.urls[0])) as client:
            return client.infer(model, [tensor], outputs=outputs)

    result = await in_thread(infer, "echo")
    assert result.as_numpy("OUT").tolist() == ["plain", "caf\u00e9", ""]
    assert result.as_numpy("KIND").tolist() == ["bytes"] * 3
    # Declared utf8: the same request reaches the model as str.
    result = await in_thread(infer, "echo_text")
    assert result.as_numpy("KIND").tolist() == ["str"] * 3


async def test_http_json_output_of_bytes_that_are_not_utf8(server: Any) -> None:
    # JSON cannot hold them without loss: the output goes as binary data even when
    # JSON was asked for, which tritonclient reads as it reads any binary output.
    def infer() -> Any:
        outputs = [triton_http.InferRequestedOutput("OUT", binary_data=False)]
        with triton_http.InferenceServerClient(host_port(server.urls[0])) as client:
            return client.infer("echo", [blobs_input(triton_http)], outputs=outputs)

    result = await in_thread(infer)
    assert result.get_output("OUT")["parameters"]["binary_data_size"] > 0
    assert result.as_numpy("OUT").tolist() == BLOBS
    # A plain JSON client (it says nothing of binary data) could not read that body:
    # it is told to ask for binary output.
    body = {"inputs": [{"name": "IN", "shape": [1], "datatype": "BYTES", "data": ["x"]}]}
    async with httpx.AsyncClient(base_url=server.urls[0]) as client:
        answer = await client.post("/v2/models/echo/infer", json=body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["outputs"][0]["data"] == ["x"]
        # Binary input, but not a word of binary output.
        blob = utils.serialize_byte_tensor(np.array(BLOBS, dtype=object)).item()
        tensor = {"name": "IN", "shape": [len(BLOBS)], "datatype": "BYTES"}
        tensor["parameters"] = {"binary_data_size": len(blob)}
        header = json.dumps({"inputs": [tensor]}).encode()
        answer = await client.post(
            "/v2/models/echo/infer",
            content=header + blob,
            headers={"Inference-Header-Content-Length": str(len(header))},
        )
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"].startswith(
        "output 'OUT' holds bytes that are not UTF-8 (element 0 of the flattened output), "
        "which a JSON response cannot carry; ask for it as binary data"
    )


async def test_http_bytes_that_are_not_utf8_for_a_text_input_are_a_400(server: Any) -> None:
    async with httpx.AsyncClient(base_url=server.urls[0]) as client:
        for model, name, shape in (("strings", "x", [1, 4]), ("echo_text", "IN", [4])):
            tensor = triton_http.InferInput(name, shape, "BYTES")
            values = np.array([b"ok", b"fine", b"\xff\xd8\xff\xe0", b"x"], dtype=object)
            tensor.set_data_from_numpy(values.reshape(shape), binary_data=True)
            body, length = triton_http.InferenceServerClient.generate_request_body([tensor])
            headers = {"Inference-Header-Content-Length": str(length)}
            answer = await client.post(f"/v2/models/{model}/infer", content=body, headers=headers)
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            index = "[0, 2]" if len(shape) == 2 else "2"
            assert f"input {name!r} of model {model!r}" in error
            assert f"element at index {index} is not UTF-8" in error

    def infer() -> None:
        with triton_http.InferenceServerClient(host_port(server.urls[0])) as client:
            client.infer("echo_text", [blobs_input(triton_http)])

    with pytest.raises(InferenceServerException, match="index 0 is not UTF-8"):
        await in_thread(infer)


async def test_http_utf8_bytes_still_reach_an_onnx_string_model_as_text(server: Any) -> None:
    def infer(binary: bool) -> Any:
        tensor = triton_http.InferInput("x", [1, 4], "BYTES")
        values = np.array([["a", "caf\u00e9", "", "z"]], dtype=object)
        tensor.set_data_from_numpy(values, binary_data=binary)
        with triton_http.InferenceServerClient(host_port(server.urls[0])) as client:
            return client.infer("strings", [tensor]).as_numpy("y")

    for binary in (False, True):
        got = await in_thread(infer, binary)
        assert [v.decode() if isinstance(v, bytes) else v for v in got[0]] == [
            "a",
            "caf\u00e9",
            "",
            "z",
        ]


# -- gRPC ----------------------------------------------------------------------------------------


@pytest.mark.grpc
async def test_grpc_raw_bytes_reach_a_python_model_as_bytes_and_come_back(server: Any) -> None:
    triton_grpc = pytest.importorskip("tritonclient.grpc")

    def infer() -> Any:
        with triton_grpc.InferenceServerClient(server.grpc) as client:
            return client.infer("echo", [blobs_input(triton_grpc)])

    result = await in_thread(infer)
    assert result.as_numpy("OUT").tolist() == BLOBS
    assert result.as_numpy("KIND").tolist() == [b"bytes"] * len(BLOBS)


@pytest.mark.grpc
async def test_grpc_typed_bytes_contents_keep_their_bytes(server: Any) -> None:
    grpc = pytest.importorskip("grpc")
    from tritonclient.grpc import service_pb2, service_pb2_grpc
    from tritonclient.utils import deserialize_bytes_tensor

    def infer(model: str) -> Any:
        with grpc.insecure_channel(server.grpc) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            request = service_pb2.ModelInferRequest(model_name=model)
            tensor = request.inputs.add(name="IN", datatype="BYTES", shape=[len(BLOBS)])
            tensor.contents.bytes_contents.extend(BLOBS)
            return stub.ModelInfer(request)

    response = await in_thread(infer, "echo")
    outputs = {o.name: i for i, o in enumerate(response.outputs)}
    raw = response.raw_output_contents
    assert deserialize_bytes_tensor(raw[outputs["OUT"]]).tolist() == BLOBS
    assert deserialize_bytes_tensor(raw[outputs["KIND"]]).tolist() == [b"bytes"] * len(BLOBS)

    with pytest.raises(grpc.RpcError) as failed:
        await in_thread(infer, "echo_text")
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "input 'IN' of model 'echo_text'" in failed.value.details()
    assert "element at index 0 is not UTF-8" in failed.value.details()


@pytest.mark.grpc
async def test_grpc_bytes_that_are_not_utf8_for_an_onnx_string_input(server: Any) -> None:
    triton_grpc = pytest.importorskip("tritonclient.grpc")

    def infer() -> None:
        tensor = triton_grpc.InferInput("x", [1, 4], "BYTES")
        tensor.set_data_from_numpy(np.array([[b"a", b"b", b"c", b"\xff\x00"]], dtype=object))
        with triton_grpc.InferenceServerClient(server.grpc) as client:
            client.infer("strings", [tensor])

    with pytest.raises(InferenceServerException) as failed:
        await in_thread(infer)
    assert failed.value.status() == "StatusCode.INVALID_ARGUMENT"
    message = failed.value.message()
    assert "input 'x' of model 'strings'" in message
    assert "element at index [0, 3] is not UTF-8" in message


# -- system shared memory ------------------------------------------------------------------------


@pytest.mark.shm
async def test_http_shared_memory_bytes_reach_a_python_model_as_bytes(server: Any) -> None:
    serialized = utils.serialize_byte_tensor(np.array(BLOBS, dtype=object))
    size = utils.serialized_byte_size(serialized)
    handles = []

    def infer() -> Any:
        regions = {}
        for name in ("in", "out"):
            key = f"/trioinfer_bytes_test_{uuid.uuid4().hex[:12]}"
            handles.append(shm.create_shared_memory_region(name, key, size))
            regions[name] = key
        shm.set_shared_memory_region(handles[0], [serialized])
        with triton_http.InferenceServerClient(host_port(server.urls[0])) as client:
            for name, key in regions.items():
                client.register_system_shared_memory(name, key, size)
            try:
                tensor = triton_http.InferInput("IN", [len(BLOBS)], "BYTES")
                tensor.set_shared_memory("in", size)
                out = triton_http.InferRequestedOutput("OUT")
                out.set_shared_memory("out", size)
                kind = triton_http.InferRequestedOutput("KIND", binary_data=False)
                result = client.infer("echo", [tensor], outputs=[out, kind])
                got = shm.get_contents_as_numpy(handles[1], np.object_, [len(BLOBS)])
                return got.tolist(), result.as_numpy("KIND").tolist()
            finally:
                client.unregister_system_shared_memory()

    try:
        got, kinds = await in_thread(infer)
    finally:
        for handle in handles:
            shm.destroy_shared_memory_region(handle)
    assert got == BLOBS
    assert kinds == ["bytes"] * len(BLOBS)
