"""The V2 gRPC endpoint of ``trioinfer serve``, through tritonclient.grpc (sync, aio, streaming).

The tests make the calls Triton's Python gRPC client examples make
(triton-inference-server/client, ``src/python/examples``: simple_grpc_infer_client,
its async and aio twins, simple_grpc_stream_infer_client, simple_grpc_health_metadata,
simple_grpc_model_control, simple_grpc_string_infer_client, simple_grpc_keepalive_client,
grpc_explicit_*_content_client, grpc_client) against a real ``trioinfer serve`` on
loopback, on models written here. Then deadlines, cancellation, limits, the
token, and fuzzed messages, which must get a gRPC error and never a crash.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import re
import shutil
import socket
import struct
import subprocess
import sys
import time
import types
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import grpc
import h2.config
import h2.connection
import h2.events
import h2.settings
import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton
import tritonclient.grpc.aio as triton_aio
import tritonclient.utils as utils
import tritonclient.utils.shared_memory as shm
from click.testing import CliRunner
from google.protobuf import descriptor as descriptor_module
from google.protobuf import descriptor_pool
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException, deserialize_bytes_tensor

import test_sequence
import test_triton
import trioinfer
from _serve import WAIT_S, serve_process, wait_until
from trioinfer.cli import main as cli_main
from trioinfer.testing import models

pytestmark = pytest.mark.grpc

TOKEN = "grpc-test-token"  # a test fixture, not a credential
MAX_BODY = 1 << 20
SLOW_WIDTH = 512
#: Rows of a blocker request: seconds of work on one thread (and under MAX_BODY).
BLOCKER_ROWS = 256

SLOW_CONFIG = """\
max_queue_size = 2

[[instances]]
device = "cpu"
count = 1
threads = 1
"""
SERVE_CONFIG = f"""\
[limits]
max_body_bytes = {MAX_BODY}
max_elements_per_tensor = 262144
"""


# -- running a server ------------------------------------------------------------------


@attrs.frozen
class Server:
    """A ``trioinfer serve`` process: its HTTP URL and its gRPC address."""

    url: str
    grpc: str
    process: subprocess.Popen[str]
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")


@contextlib.contextmanager
def run_server(
    repository: Path, *args: str, log: Path, prelude: str = "", want_grpc: bool = True
) -> Iterator[Server]:
    """Start ``trioinfer serve --port 0``; on exit SIGTERM it and require exit code 0."""
    code = f"{prelude}\nfrom trioinfer.cli import main\nmain()"
    command = [sys.executable, "-c", code, "serve", "--port", "0"]
    command += ["--model-repository", str(repository), *args]
    with serve_process(command, log=log) as started:
        found = (re.search(r"gRPC on (\S+)", line) for line in started.lines)
        address = next((match.group(1) for match in found if match), "")
        assert bool(address) == want_grpc, log.read_text()[-4000:]
        yield Server(started.url, address, started.process, log)


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("grpc") / "repository"
    # "simple" as in Triton's examples: two INT32[batch, 16] inputs, their sum and difference.
    models.write_add(root / "simple" / "1" / "model.onnx", dtype=np.int32, width=16)
    models.write_add(root / "add" / "1" / "model.onnx")
    models.write_identity(root / "strings" / "1" / "model.onnx", dtype=object, shape=("b", 16))
    # Three times write_slow's depth: the blocker must outlast a 0.3 s deadline, metric
    # polls and a cancel on a fast, loaded machine (a cancel aborts it between nodes).
    models.write_slow(root / "slow" / "1" / "model.onnx", width=SLOW_WIDTH, depth=3000)
    (root / "slow" / "config.toml").write_text(SLOW_CONFIG)
    # The stateful accumulator of test_sequence.py (Triton's simple_sequence).
    (root / "simple_sequence" / "1").mkdir(parents=True)
    (root / "simple_sequence" / "1" / "model.py").write_text(test_sequence.MODEL_PY)
    (root / "simple_sequence" / "config.toml").write_text(test_sequence.CONFIG_TOML)
    # The bundled decoupled model, as Triton's repeat_int32.
    shutil.copytree(
        Path(trioinfer.__file__).parent / "examples/repository/repeat_int32", root / "repeat_int32"
    )
    (root / "rendezvous" / "1").mkdir(parents=True)
    (root / "rendezvous" / "1" / "model.py").write_text(RENDEZVOUS_PY)
    (root / "rendezvous" / "config.toml").write_text(RENDEZVOUS_TOML)
    return root


#: A decoupled model whose request with ROLE 0 answers only once the request with ROLE 1
#: and the same KEY has arrived: two such requests on one stream need it to run them
#: side by side (one after the other, the first waits forever for the second).
RENDEZVOUS_PY = """
import anyio
import numpy as np

ARRIVED = set()


class Model:
    async def infer(self, inputs):
        key, role = int(inputs["KEY"][0]), int(inputs["ROLE"][0])
        ARRIVED.add((key, role))
        if role == 0:
            with anyio.fail_after(20):  # a bound, so that a stuck test ends
                while (key, 1) not in ARRIVED:
                    await anyio.sleep(0.005)
        yield {"OUT": np.array([role], np.int32)}
"""
RENDEZVOUS_TOML = """
backend = "python"

[backend_options]
decoupled = true
inputs = [
    { name = "KEY", dtype = "int32", shape = [1] },
    { name = "ROLE", dtype = "int32", shape = [1] },
]
outputs = [{ name = "OUT", dtype = "int32", shape = [1] }]
"""


@pytest.fixture(scope="module")
def server(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    config = tmp_path_factory.mktemp("config") / "serve.toml"
    config.write_text(SERVE_CONFIG)
    log = tmp_path_factory.mktemp("log") / "server.log"
    with run_server(
        repository, "--admin-token", TOKEN, "--config", str(config), log=log
    ) as running:
        yield running
    assert "Traceback" not in running.log_text(), running.log_text()[-4000:]


@pytest.fixture
def client(server: Server) -> Iterator[triton.InferenceServerClient]:
    with triton.InferenceServerClient(server.grpc) as c:
        yield c


def simple_inputs(rows: int = 1) -> tuple[list[triton.InferInput], np.ndarray, np.ndarray]:
    a = np.arange(16 * rows, dtype=np.int32).reshape(rows, 16)
    b = np.ones((rows, 16), dtype=np.int32)
    inputs = [
        triton.InferInput("a", [rows, 16], "INT32"),
        triton.InferInput("b", [rows, 16], "INT32"),
    ]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    return inputs, a, b


def slow_input(rows: int) -> list[triton.InferInput]:
    x = triton.InferInput("x", [rows, SLOW_WIDTH], "FP32")
    x.set_data_from_numpy(np.ones((rows, SLOW_WIDTH), dtype=np.float32))
    return [x]


def metric(server: Server, name: str, **labels: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=WAIT_S).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


# -- the protocol file ------------------------------------------------------------------


def _messages(descriptor: Any) -> Iterator[Any]:
    yield descriptor
    for nested in descriptor.nested_types:
        yield from _messages(nested)


def _field_facts(field: Any) -> tuple[Any, ...]:
    kind = field.message_type or field.enum_type
    return (
        field.number,
        field.type,
        field.is_repeated,
        kind.full_name if kind else None,
        field.containing_oneof.name if field.containing_oneof else None,
    )


def test_messages_match_tritonclients_field_by_field() -> None:
    from trioinfer.server import _grpc_proto

    theirs = descriptor_pool.Default()
    assert service_pb2.DESCRIPTOR.package == _grpc_proto.FILE.package == "inference"
    compared = 0
    for top in _grpc_proto.FILE.message_types_by_name.values():
        for ours in _messages(top):
            reference = theirs.FindMessageTypeByName(ours.full_name)
            for field in ours.fields:
                assert field.name in reference.fields_by_name, f"{ours.full_name}.{field.name}"
                expected = reference.fields_by_name[field.name]
                assert _field_facts(field) == _field_facts(expected), (
                    f"{ours.full_name}.{field.name}"
                )
                compared += 1
    enums = [*_grpc_proto.FILE.enum_types_by_name.values()]
    for top in _grpc_proto.FILE.message_types_by_name.values():
        enums += [e for m in _messages(top) for e in m.enum_types]
    for enum in enums:
        reference_enum = theirs.FindEnumTypeByName(enum.full_name)
        for value in enum.values:
            assert reference_enum.values_by_name[value.name].number == value.number, value
    assert "inference.ModelSequenceBatching.Control.Kind" in {e.full_name for e in enums}
    ours_service = _grpc_proto.FILE.services_by_name["GRPCInferenceService"]
    reference_service = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    for method in ours_service.methods:
        expected_method = reference_service.methods_by_name[method.name]
        assert method.input_type.full_name == expected_method.input_type.full_name
        assert method.output_type.full_name == expected_method.output_type.full_name
        assert method.client_streaming == expected_method.client_streaming
        assert method.server_streaming == expected_method.server_streaming
    assert compared > 180
    assert descriptor_module.FieldDescriptor.TYPE_UINT64  # the facts compared include types
    # Every field of Triton's ModelConfig that trioinfer answers or reads is in the proto.
    config = _grpc_proto.FILE.message_types_by_name["ModelConfig"]
    for name in (
        "version_policy",
        "dynamic_batching",
        "sequence_batching",
        "ensemble_scheduling",
        "parameters",
        "model_transaction_policy",
        "response_cache",
        "optimization",
    ):
        assert name in config.fields_by_name, name


@pytest.mark.triton_config
def test_config_pbtxt_messages_match_tritonclients_field_by_field() -> None:
    """The messages config.pbtxt is read with (server/_triton.py's table) are Triton's too."""
    from trioinfer.server._triton import _model_config_class

    theirs = descriptor_pool.Default()
    compared = 0
    file = _model_config_class().DESCRIPTOR.file
    for ours in (m for top in file.message_types_by_name.values() for m in _messages(top)):
        reference = theirs.FindMessageTypeByName(ours.full_name)
        for field in ours.fields:
            assert field.name in reference.fields_by_name, f"{ours.full_name}.{field.name}"
            assert _field_facts(field) == _field_facts(reference.fields_by_name[field.name]), (
                f"{ours.full_name}.{field.name}"
            )
            compared += 1
        for enum in ours.enum_types:
            reference_enum = theirs.FindEnumTypeByName(enum.full_name)
            for value in enum.values:
                assert reference_enum.values_by_name[value.name].number == value.number
    assert compared > 90


# -- what Triton's examples do ----------------------------------------------------------


def test_health_and_metadata(client: triton.InferenceServerClient) -> None:
    # simple_grpc_health_metadata.py
    assert client.is_server_live(headers={"test": "1"})
    assert client.is_server_ready()
    assert client.is_model_ready("simple")
    assert not client.is_model_ready("no_such_model")
    assert not client.is_model_ready("simple", "7")
    metadata = client.get_server_metadata()
    assert metadata.name == "trioinfer"
    assert "model_repository" in metadata.extensions
    model = client.get_model_metadata("simple", "1")
    assert model.name == "simple"
    assert list(model.versions) == ["1"]
    assert [(t.name, t.datatype, list(t.shape)) for t in model.inputs] == [
        ("a", "INT32", [-1, 16]),
        ("b", "INT32", [-1, 16]),
    ]
    as_json = client.get_model_metadata("simple", as_json=True)
    assert as_json["platform"] == "onnxruntime_onnx"
    config = client.get_model_config("simple").config
    assert config.name == "simple"
    assert [i.name for i in config.input] == ["a", "b"]
    assert config.input[0].data_type == 8  # TYPE_INT32
    assert list(config.output[0].dims)[-1] == 16
    with pytest.raises(InferenceServerException) as failed:
        client.get_model_metadata("no_such_model")
    assert failed.value.status() == "StatusCode.NOT_FOUND"
    assert "no_such_model" in failed.value.message()


def test_simple_infer(client: triton.InferenceServerClient, server: Server) -> None:
    # simple_grpc_infer_client.py, with its compression and custom header.
    before = metric(server, "trioinfer_inference_requests_total", model="simple", outcome="success")
    inputs, a, b = simple_inputs()
    outputs = [triton.InferRequestedOutput("sum"), triton.InferRequestedOutput("diff")]
    for compression in (None, "gzip", "deflate"):
        result = client.infer(
            "simple",
            inputs,
            outputs=outputs,
            request_id="7",
            headers={"test": "1"},
            compression_algorithm=compression,
            client_timeout=WAIT_S,
        )
        np.testing.assert_array_equal(result.as_numpy("sum"), a + b)
        np.testing.assert_array_equal(result.as_numpy("diff"), a - b)
        response = result.get_response()
        assert response.model_name == "simple"
        assert response.model_version == "1"
        assert response.id == "7"
        assert result.get_output("sum").datatype == "INT32"
    # Only one output asked for: only that one comes back.
    result = client.infer("simple", inputs, outputs=[triton.InferRequestedOutput("diff")])
    assert [o.name for o in result.get_response().outputs] == ["diff"]
    statistics = client.get_inference_statistics("simple")
    assert len(statistics.model_stats) == 1
    assert statistics.model_stats[0].inference_stats.success.count >= 4
    after = metric(server, "trioinfer_inference_requests_total", model="simple", outcome="success")
    assert after - before == 4  # gRPC requests count in the same metrics as HTTP's


def test_async_infer_with_callbacks(client: triton.InferenceServerClient) -> None:
    # simple_grpc_async_infer_client.py
    done: queue.Queue[tuple[Any, Any]] = queue.Queue()
    inputs, a, b = simple_inputs()
    for _ in range(8):
        client.async_infer("simple", inputs, lambda result, error: done.put((result, error)))
    for _ in range(8):
        result, error = done.get(timeout=WAIT_S)
        assert error is None
        np.testing.assert_array_equal(result.as_numpy("sum"), a + b)


def test_aio_client(server: Server) -> None:
    # simple_grpc_aio_infer_client.py and simple_grpc_aio_health_metadata.py
    async def main() -> None:
        async with triton_aio.InferenceServerClient(server.grpc) as c:
            assert await c.is_server_live()
            assert await c.is_model_ready("simple")
            assert (await c.get_model_metadata("simple")).name == "simple"
            assert (await c.get_model_config("simple")).config.name == "simple"
            inputs, a, b = simple_inputs(3)
            results = await asyncio.gather(*(c.infer("simple", inputs) for _ in range(16)))
            for result in results:
                np.testing.assert_array_equal(result.as_numpy("diff"), a - b)
            stats = await c.get_inference_statistics("simple")
            assert stats.model_stats[0].name == "simple"

    asyncio.run(main())


def test_stream_infer(client: triton.InferenceServerClient) -> None:
    # simple_grpc_stream_infer_client.py: one response per request, each with its id (in
    # the order they finish: the requests run side by side); an error answers its
    # request and the stream goes on.
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        inputs, a, b = simple_inputs()
        wrong = [triton.InferInput("a", [1, 16], "FP32")]
        wrong[0].set_data_from_numpy(np.zeros((1, 16), dtype=np.float32))
        for i in range(6):
            client.async_stream_infer("simple", wrong if i == 3 else inputs, request_id=str(i))
        client.async_stream_infer("no_such_model", inputs, request_id="6")
        got = [answers.get(timeout=WAIT_S) for _ in range(7)]
    finally:
        client.stop_stream()
    answered = {result.get_response().id: result for result, error in got if error is None}
    assert sorted(answered) == ["0", "1", "2", "4", "5"]
    for result in answered.values():
        np.testing.assert_array_equal(result.as_numpy("sum"), a + b)
    # tritonclient's callback gets an error without the response (whose id says which).
    messages = sorted(error.message() for result, error in got if error is not None)
    assert len(messages) == 2
    assert any("no_such_model" in m for m in messages), messages
    assert any("'a'" in m or "input" in m for m in messages if "no_such_model" not in m)


def repeat_inputs(values: list[int], delay_ms: int = 0) -> list[triton.InferInput]:
    arrays = [
        ("IN", np.array(values, dtype=np.int32), "INT32"),
        ("DELAY", np.full(len(values), delay_ms, dtype=np.uint32), "UINT32"),
        ("WAIT", np.array([0], dtype=np.uint32), "UINT32"),
    ]
    inputs = []
    for name, array, datatype in arrays:
        inputs.append(triton.InferInput(name, list(array.shape), datatype))
        inputs[-1].set_data_from_numpy(array)
    return inputs


@pytest.mark.streaming
def test_simple_grpc_custom_repeat(server: Server) -> None:
    # simple_grpc_custom_repeat.py: a decoupled model answers one request with many responses.
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    values = [4, 2, 0, 1]
    with triton.InferenceServerClient(server.grpc) as c:
        c.start_stream(callback=lambda result, error: answers.put((result, error)))
        c.async_stream_infer("repeat_int32", repeat_inputs(values), request_id="r1")
        got = []
        for _ in values:
            result, error = answers.get(timeout=WAIT_S)
            assert error is None, error
            assert result.get_response().id == "r1"
            assert "triton_final_response" not in result.get_response().parameters
            got.append((int(result.as_numpy("OUT")[0]), int(result.as_numpy("IDX")[0])))
        assert got == [(v, i) for i, v in enumerate(values)]
        # With the empty final response asked for, as Triton sends it.
        c.async_stream_infer(
            "repeat_int32", repeat_inputs([7, 8]), request_id="r2", enable_empty_final_response=True
        )
        flags = []
        for _ in range(3):
            result, error = answers.get(timeout=WAIT_S)
            assert error is None, error
            response = result.get_response()
            flags.append(
                (len(response.outputs), response.parameters["triton_final_response"].bool_param)
            )
        assert flags == [(2, False), (2, False), (0, True)]
        # An ordinary model on the same stream: still one response per request.
        inputs, a, b = simple_inputs()
        c.async_stream_infer("simple", inputs, request_id="s")
        result, error = answers.get(timeout=WAIT_S)
        assert error is None, error
        np.testing.assert_array_equal(result.as_numpy("sum"), a + b)
        # Asked for the final flag, its one response is its last and says so, as
        # Triton's does (a client reading until the flag would wait forever).
        c.async_stream_infer("simple", inputs, request_id="s2", enable_empty_final_response=True)
        result, error = answers.get(timeout=WAIT_S)
        assert error is None, error
        assert result.get_response().parameters["triton_final_response"].bool_param is True
        np.testing.assert_array_equal(result.as_numpy("sum"), a + b)
        # An empty IN: no response at all (an error would come back as one).
        c.async_stream_infer("repeat_int32", repeat_inputs([]), request_id="e")
        c.async_stream_infer("simple", inputs, request_id="after")
        result, error = answers.get(timeout=WAIT_S)
        assert error is None, error
        assert result.get_response().id == "after"
        # A decoupled model is never stateful: sequence parameters are refused, as over
        # HTTP generate, not ignored (the request would belong to no sequence).
        c.async_stream_infer("repeat_int32", repeat_inputs([1]), request_id="q", sequence_id=5)
        result, error = answers.get(timeout=WAIT_S)
        assert result is None
        assert "is decoupled (it streams responses), not stateful" in str(error)
        c.stop_stream()
    assert answers.empty()


@pytest.mark.streaming
def test_a_requests_own_timeout_on_a_stream_with_a_deadline_ends_that_request_only(
    server: Server,
) -> None:
    # The request's timeout parameter passing is that request's error; the stream, whose
    # own deadline (stream_timeout) is far, goes on. It returned there, as if the
    # stream's deadline had passed: later requests were never answered, and the call
    # ended OK.
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    with triton.InferenceServerClient(server.grpc) as c:
        c.start_stream(
            callback=lambda result, error: answers.put((result, error)), stream_timeout=WAIT_S
        )
        try:
            c.async_stream_infer(
                "repeat_int32", repeat_inputs([1, 2], delay_ms=2000), request_id="t", timeout=1000
            )
            inputs, a, b = simple_inputs()
            c.async_stream_infer("simple", inputs, request_id="after")
            # Either may answer first: the requests run side by side.
            got = [answers.get(timeout=WAIT_S) for _ in range(2)]
            [error] = [error for _, error in got if error is not None]
            assert isinstance(error, InferenceServerException)
            assert "timeout" in error.message()
            [result] = [result for result, error in got if error is None]
            assert result.get_response().id == "after"
            np.testing.assert_array_equal(result.as_numpy("sum"), a + b)
        finally:
            c.stop_stream()


@pytest.mark.streaming
def test_cancelling_a_stream_stops_the_generator(server: Server) -> None:
    # A long stream (one response a second); the client cancels after the first.
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    labels = {"model": "repeat_int32", "version": "1"}
    before = metric(server, "trioinfer_inference_requests_total", outcome="cancelled", **labels)
    c = triton.InferenceServerClient(server.grpc)
    try:
        c.start_stream(callback=lambda result, error: answers.put((result, error)))
        c.async_stream_infer("repeat_int32", repeat_inputs(list(range(60)), delay_ms=1000))
        _first, error = answers.get(timeout=WAIT_S)
        assert error is None, error
        c.stop_stream(cancel_requests=True)
    finally:
        c.close()
    wait_until(
        lambda: (
            metric(server, "trioinfer_inference_requests_total", outcome="cancelled", **labels)
            > before
        ),
        "the cancelled stream's generator stopped",
    )


def test_strings_raw_and_typed(client: triton.InferenceServerClient, server: Server) -> None:
    # simple_grpc_string_infer_client.py (BYTES as raw contents) and
    # grpc_explicit_byte_content_client.py (BYTES as typed bytes_contents, through the stub).
    values = np.array([[f"{i}é" for i in range(16)]], dtype=object)
    x = triton.InferInput("x", [1, 16], "BYTES")
    x.set_data_from_numpy(values)
    result = client.infer("strings", [x])
    assert result.as_numpy("y").tolist() == [[v.encode() for v in values[0]]]

    with grpc.insecure_channel(server.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = service_pb2.ModelInferRequest(model_name="strings")
        tensor = request.inputs.add(name="x", datatype="BYTES", shape=[1, 16])
        tensor.contents.bytes_contents.extend(str(i).encode() for i in range(16))
        request.outputs.add(name="y")
        response = stub.ModelInfer(request)
        (output,) = response.outputs
        assert list(output.shape) == [1, 16]
        decoded = deserialize_bytes_tensor(response.raw_output_contents[0])
        assert decoded.tolist() == [str(i).encode() for i in range(16)]


def explicit_request(datatype: str) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="simple")
    for name in "ab":
        tensor = request.inputs.add(name=name, datatype=datatype, shape=[1, 16])
        tensor.contents.int_contents.extend(range(16))
    return request


def test_explicit_int_contents(server: Server) -> None:
    # grpc_explicit_int_content_client.py: typed contents through the generated stub,
    # outputs read from raw_output_contents.
    with grpc.insecure_channel(server.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        response = stub.ModelInfer(explicit_request("INT32"))
        total = np.frombuffer(response.raw_output_contents[0], dtype=np.int32)
        np.testing.assert_array_equal(total, 2 * np.arange(16))
        # grpc_explicit_int8_content_client.py sends INT8 (in int_contents) to an INT8
        # model; this one takes INT32, and says so.
        with pytest.raises(grpc.RpcError) as failed:
            stub.ModelInfer(explicit_request("INT8"))
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "INT32" in failed.value.details() or "int32" in failed.value.details()


def test_model_control_and_token(client: triton.InferenceServerClient) -> None:
    # simple_grpc_model_control.py, with the admin token as metadata.
    auth = {"authorization": f"Bearer {TOKEN}"}
    index = client.get_model_repository_index()
    assert sorted(m.name for m in index.models) == [
        "add",
        "rendezvous",
        "repeat_int32",
        "simple",
        "simple_sequence",
        "slow",
        "strings",
    ]
    with pytest.raises(InferenceServerException) as refused:
        client.unload_model("add")
    assert refused.value.status() == "StatusCode.UNAUTHENTICATED"
    client.unload_model("add", headers=auth)
    assert not client.is_model_ready("add")
    ready_only = client.get_model_repository_index(as_json=True)
    assert any(m.get("state") == "UNAVAILABLE" for m in ready_only["models"])
    client.load_model("add", headers=auth)
    assert client.is_model_ready("add")
    with pytest.raises(InferenceServerException) as bad_config:
        client.load_model("add", headers=auth, config='"parameters": {"config": {{')
    assert bad_config.value.status() == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException) as too_many:
        client.load_model("add", headers=auth, config='{"instances": [{"count": 100000}]}')
    assert too_many.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "count 100000 is more than a model may have: at most 256" in too_many.value.message()
    with pytest.raises(InferenceServerException) as upload:
        client.load_model("add", headers=auth, config="{}", files={"file:" + "A" * 256: b"a"})
    assert upload.value.status() == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException) as unknown:
        client.load_model("wrong_model_name", headers=auth)
    assert unknown.value.status() == "StatusCode.NOT_FOUND"
    assert client.is_server_live()
    assert client.is_model_ready("add")


def test_errors_quoting_long_names_keep_their_status(
    client: triton.InferenceServerClient,
) -> None:
    # An error quoting a long name from the request must still reach the client as its
    # status: a grpc-message past grpcio's 16 KiB trailer limit was a transport error
    # ("Stream removed", RESOURCE_EXHAUSTED) instead of NOT_FOUND or INVALID_ARGUMENT.
    x = triton.InferInput("a", [1, 16], "INT32")
    x.set_data_from_numpy(np.zeros((1, 16), np.int32))
    with pytest.raises(InferenceServerException) as unknown:
        client.infer("m" * 100_000, [x])
    assert unknown.value.status() == "StatusCode.NOT_FOUND"
    assert "(100000 characters)" in unknown.value.message()
    long_input = triton.InferInput("é" * 20_000, [1, 16], "INT32")
    long_input.set_data_from_numpy(np.zeros((1, 16), np.int32))
    with pytest.raises(InferenceServerException) as invalid:
        client.infer("simple", [long_input])
    assert invalid.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert invalid.value.message().endswith("... (cut)")
    assert client.is_server_live()


def test_keepalive_client(server: Server) -> None:
    # simple_grpc_keepalive_client.py
    options = triton.KeepAliveOptions(
        keepalive_time_ms=2**31 - 1,
        keepalive_timeout_ms=20000,
        keepalive_permit_without_calls=False,
        http2_max_pings_without_data=2,
    )
    with triton.InferenceServerClient(server.grpc, keepalive_options=options) as c:
        inputs, a, b = simple_inputs()
        np.testing.assert_array_equal(c.infer("simple", inputs).as_numpy("sum"), a + b)


@pytest.fixture
def regions() -> Iterator[list[Any]]:
    """Shared-memory regions a test creates, destroyed (and unregistered) whatever happens."""
    handles: list[Any] = []
    yield handles
    for handle in handles:
        shm.destroy_shared_memory_region(handle)


def create_region(handles: list[Any], name: str, size: int) -> tuple[Any, str]:
    key = f"/trioinfer_grpc_test_{uuid.uuid4().hex[:12]}"
    handle = shm.create_shared_memory_region(name, key, size)
    handles.append(handle)
    return handle, key


@pytest.mark.shm
def test_simple_grpc_shm_client(
    client: triton.InferenceServerClient, server: Server, regions: list[Any]
) -> None:
    # simple_grpc_shm_client.py: inputs and outputs in system shared memory.
    metadata = {"authorization": f"Bearer {TOKEN}"}
    client.unregister_system_shared_memory(headers=metadata)
    client.unregister_cuda_shared_memory(headers=metadata)  # nothing to unregister, no error
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.ones((1, 16), dtype=np.int32)
    size = a.nbytes
    out_handle, out_key = create_region(regions, "output_data", size * 2)
    client.register_system_shared_memory("output_data", out_key, size * 2, headers=metadata)
    in_handle, in_key = create_region(regions, "input_data", size * 2)
    shm.set_shared_memory_region(in_handle, [a])
    shm.set_shared_memory_region(in_handle, [b], offset=size)
    client.register_system_shared_memory("input_data", in_key, size * 2, headers=metadata)

    inputs = [
        triton.InferInput("a", [1, 16], "INT32"),
        triton.InferInput("b", [1, 16], "INT32"),
    ]
    inputs[0].set_shared_memory("input_data", size)
    inputs[1].set_shared_memory("input_data", size, offset=size)
    outputs = [triton.InferRequestedOutput("sum"), triton.InferRequestedOutput("diff")]
    outputs[0].set_shared_memory("output_data", size)
    outputs[1].set_shared_memory("output_data", size, offset=size)
    result = client.infer("simple", inputs, outputs=outputs)

    sum_ = result.get_output("sum")
    diff = result.get_output("diff")
    assert list(sum_.shape) == [1, 16]
    assert sum_.parameters["shared_memory_region"].string_param == "output_data"
    assert diff.parameters["shared_memory_offset"].int64_param == size
    sums = shm.get_contents_as_numpy(out_handle, np.int32, [1, 16])
    diffs = shm.get_contents_as_numpy(out_handle, np.int32, [1, 16], offset=size)
    np.testing.assert_array_equal(sums, a + b)
    np.testing.assert_array_equal(diffs, a - b)

    # Mixed: one input in the request, one in shared memory; the output in the response.
    mixed = [triton.InferInput("a", [1, 16], "INT32"), triton.InferInput("b", [1, 16], "INT32")]
    mixed[0].set_data_from_numpy(a)
    mixed[1].set_shared_memory("input_data", size, offset=size)
    answer = client.infer("simple", mixed, outputs=[triton.InferRequestedOutput("sum")])
    np.testing.assert_array_equal(answer.as_numpy("sum"), a + b)

    status = client.get_system_shared_memory_status()
    assert sorted(status.regions) == ["input_data", "output_data"]
    region = status.regions["input_data"]
    assert (region.key, region.offset, region.byte_size) == (in_key, 0, size * 2)
    assert list(client.get_system_shared_memory_status("output_data").regions) == ["output_data"]
    # The same registry as HTTP's: what gRPC registered, HTTP reports.
    http_status = httpx.get(f"{server.url}/v2/systemsharedmemory/status").json()
    assert {r["name"] for r in http_status} == {"input_data", "output_data"}
    client.unregister_system_shared_memory("input_data", headers=metadata)
    assert list(client.get_system_shared_memory_status().regions) == ["output_data"]
    client.unregister_system_shared_memory(headers=metadata)
    assert not client.get_system_shared_memory_status().regions


@pytest.mark.shm
def test_simple_grpc_shm_string_client(
    client: triton.InferenceServerClient, regions: list[Any]
) -> None:
    # simple_grpc_shm_string_client.py: BYTES tensors in and out of shared memory.
    metadata = {"authorization": f"Bearer {TOKEN}"}
    data = np.array([[str(x).encode() for x in range(16)]], dtype=object)
    serialized = utils.serialize_byte_tensor(data)
    size = utils.serialized_byte_size(serialized)
    in_handle, in_key = create_region(regions, "input_data", size)
    shm.set_shared_memory_region(in_handle, [serialized])
    client.register_system_shared_memory("input_data", in_key, size, headers=metadata)
    out_handle, out_key = create_region(regions, "output_data", size)
    client.register_system_shared_memory("output_data", out_key, size, headers=metadata)
    try:
        inputs = [triton.InferInput("x", [1, 16], "BYTES")]
        inputs[0].set_shared_memory("input_data", size)
        outputs = [triton.InferRequestedOutput("y")]
        outputs[0].set_shared_memory("output_data", size)
        result = client.infer("strings", inputs, outputs=outputs)
        output = result.get_output("y")
        assert output.datatype == "BYTES"
        got = shm.get_contents_as_numpy(out_handle, np.object_, list(output.shape))
        np.testing.assert_array_equal(got, data)
    finally:
        client.unregister_system_shared_memory(headers=metadata)


@pytest.mark.shm
def test_shared_memory_errors(client: triton.InferenceServerClient, regions: list[Any]) -> None:
    metadata = {"authorization": f"Bearer {TOKEN}"}
    _, key = create_region(regions, "small", 64)
    # Registering and unregistering are admin calls, as over HTTP.
    with pytest.raises(InferenceServerException) as unauthorized:
        client.register_system_shared_memory("small", key, 64)
    assert unauthorized.value.status() == "StatusCode.UNAUTHENTICATED"
    with pytest.raises(InferenceServerException) as missing:
        client.register_system_shared_memory(
            "nowhere", "/trioinfer_no_such_key", 64, headers=metadata
        )
    assert missing.value.status() == "StatusCode.INVALID_ARGUMENT"
    client.register_system_shared_memory("small", key, 64, headers=metadata)
    try:
        with pytest.raises(InferenceServerException) as twice:
            client.register_system_shared_memory("small", key, 64, headers=metadata)
        assert twice.value.status() == "StatusCode.INVALID_ARGUMENT"
        inputs = [
            triton.InferInput("a", [1, 16], "INT32"),
            triton.InferInput("b", [1, 16], "INT32"),
        ]
        inputs[0].set_shared_memory("small", 64)
        inputs[1].set_shared_memory("small", 64, offset=32)  # past the region's end
        with pytest.raises(InferenceServerException) as beyond:
            client.infer("simple", inputs)
        assert beyond.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "small" in beyond.value.message()
        inputs[1].set_shared_memory("unknown_region", 64)
        with pytest.raises(InferenceServerException) as unknown:
            client.infer("simple", inputs)
        assert unknown.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert "unknown_region" in unknown.value.message()
    finally:
        client.unregister_system_shared_memory(headers=metadata)
    with pytest.raises(InferenceServerException) as cuda:
        client.register_cuda_shared_memory("gpu", b"\0" * 64, 0, 64, headers=metadata)
    assert cuda.value.status() in {"StatusCode.INVALID_ARGUMENT", "StatusCode.UNAVAILABLE"}
    assert not client.get_cuda_shared_memory_status().regions


SEQUENCE_VALUES = [11, 7, 5, 3, 2, 0, 1]


def sequence_input(value: int) -> list[triton.InferInput]:
    infer_input = triton.InferInput("INPUT", [1, 1], "INT32")
    infer_input.set_data_from_numpy(np.full((1, 1), value, dtype=np.int32))
    return [infer_input]


@pytest.mark.sequence
def test_simple_grpc_sequence_sync_infer_client(client: triton.InferenceServerClient) -> None:
    # simple_grpc_sequence_sync_infer_client.py: integer and string ids, interleaved.
    sequences: dict[int | str, list[int]] = {
        1000: [0, *SEQUENCE_VALUES],
        1001: [100, *[-v for v in SEQUENCE_VALUES]],
        "3f2a-uuid-like": [20, *[-v for v in SEQUENCE_VALUES]],
        2**63 - 1: [5, *SEQUENCE_VALUES],  # the largest id tritonclient sends (int64_param)
    }
    got: dict[int | str, list[int]] = {key: [] for key in sequences}
    for step in range(len(SEQUENCE_VALUES) + 1):
        for sequence_id, values in sequences.items():
            result = client.infer(
                "simple_sequence",
                sequence_input(values[step]),
                outputs=[triton.InferRequestedOutput("OUTPUT")],
                sequence_id=sequence_id,
                sequence_start=step == 0,
                sequence_end=step == len(values) - 1,
            )
            got[sequence_id].append(int(result.as_numpy("OUTPUT")[0][0]))
    for sequence_id, values in sequences.items():
        assert got[sequence_id] == list(np.cumsum(values)), sequence_id
    errors = []
    for kwargs in ({"sequence_id": 1000}, {"sequence_id": 4242}, {}):
        with pytest.raises(InferenceServerException) as failed:
            client.infer("simple_sequence", sequence_input(1), **kwargs)
        errors.append((failed.value.status(), failed.value.message()))
    assert [status for status, _ in errors] == ["StatusCode.INVALID_ARGUMENT"] * 3
    assert "ended with its last request" in errors[0][1]
    assert "no sequence 4242 in progress" in errors[1][1]
    assert "needs a sequence_id" in errors[2][1]


@pytest.mark.sequence
def test_simple_grpc_sequence_stream_infer_client(server: Server) -> None:
    # simple_grpc_sequence_stream_infer_client.py: two sequences over one stream.
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    values = {2001: [0, *SEQUENCE_VALUES], 2002: [100, *[-v for v in SEQUENCE_VALUES]]}
    with triton.InferenceServerClient(server.grpc) as c:
        c.start_stream(callback=lambda result, error: answers.put((result, error)))
        for step in range(len(SEQUENCE_VALUES) + 1):
            for sequence_id, sent in values.items():
                c.async_stream_infer(
                    "simple_sequence",
                    sequence_input(sent[step]),
                    request_id=f"{sequence_id}_{step}",
                    outputs=[triton.InferRequestedOutput("OUTPUT")],
                    sequence_id=sequence_id,
                    sequence_start=step == 0,
                    sequence_end=step == len(sent) - 1,
                )
        got: dict[int, list[int]] = {2001: [], 2002: []}
        for _ in range(2 * (len(SEQUENCE_VALUES) + 1)):
            result, error = answers.get(timeout=WAIT_S)
            assert error is None, error
            sequence_id = int(result.get_response().id.split("_")[0])
            got[sequence_id].append(int(result.as_numpy("OUTPUT")[0][0]))
        c.stop_stream()
    for sequence_id, sent in values.items():
        assert got[sequence_id] == list(np.cumsum(sent))


def rendezvous_inputs(key: int, role: int) -> list[triton.InferInput]:
    inputs = []
    for name, value in (("KEY", key), ("ROLE", role)):
        inputs.append(triton.InferInput(name, [1], "INT32"))
        inputs[-1].set_data_from_numpy(np.array([value], dtype=np.int32))
    return inputs


@pytest.mark.streaming
def test_a_stream_runs_its_requests_side_by_side(server: Server) -> None:
    # As Triton's: each request runs as it arrives, not after the one before ended. The
    # first request answers only once the second has arrived at the model: one at a
    # time, the stream deadlocked (until the model's own bound failed the first).
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    with triton.InferenceServerClient(server.grpc) as c:
        c.start_stream(callback=lambda result, error: answers.put((result, error)))
        try:
            c.async_stream_infer("rendezvous", rendezvous_inputs(1, 0), request_id="first")
            c.async_stream_infer("rendezvous", rendezvous_inputs(1, 1), request_id="second")
            got = [answers.get(timeout=WAIT_S) for _ in range(2)]
        finally:
            c.stop_stream()
    assert [error for _, error in got] == [None, None]
    # Each response carries its request's id; the second request answered first.
    ids = [result.get_response().id for result, _ in got]
    assert ids == ["second", "first"]
    assert [int(result.as_numpy("OUT")[0]) for result, _ in got] == [1, 0]


@pytest.mark.streaming
def test_many_requests_in_flight_on_one_stream(server: Server) -> None:
    # tritonclient's stream with many requests in flight (perf_analyzer --streaming):
    # every one answered once, with its id, a decoupled model's responses in order.
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    inputs, a, b = simple_inputs()
    with triton.InferenceServerClient(server.grpc) as c:
        c.start_stream(callback=lambda result, error: answers.put((result, error)))
        try:
            for i in range(40):
                if i % 4 == 0:
                    c.async_stream_infer(
                        "repeat_int32", repeat_inputs([i, i + 1, i + 2]), request_id=f"r{i}"
                    )
                else:
                    c.async_stream_infer("simple", inputs, request_id=f"s{i}")
            got = [answers.get(timeout=WAIT_S) for _ in range(30 + 10 * 3)]
        finally:
            c.stop_stream()
    assert [error for _, error in got if error is not None] == []
    simple = [r.get_response().id for r, _ in got if r.get_response().id.startswith("s")]
    assert sorted(simple) == sorted(f"s{i}" for i in range(40) if i % 4)
    for result, _ in got:
        if result.get_response().id.startswith("s"):
            np.testing.assert_array_equal(result.as_numpy("sum"), a + b)
    repeats: dict[str, list[int]] = {}
    for result, _ in got:
        response = result.get_response()
        if response.id.startswith("r"):
            repeats.setdefault(response.id, []).append(int(result.as_numpy("OUT")[0]))
    assert repeats == {f"r{i}": [i, i + 1, i + 2] for i in range(0, 40, 4)}


@pytest.mark.sequence
def test_a_streams_sequences_keep_their_order_under_concurrency(server: Server) -> None:
    # Every request of three sequences sent at once, interleaved with plain ones: each
    # sequence's requests reach the model in the order they were sent (the accumulator's
    # running sums say so; a start overtaken by its next request would be refused).
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    steps = 16
    sent = {3001 + k: [k * 100, *range(1, steps)] for k in range(3)}
    inputs, _a, _b = simple_inputs()
    with triton.InferenceServerClient(server.grpc) as c:
        c.start_stream(callback=lambda result, error: answers.put((result, error)))
        try:
            for step in range(steps):
                for sequence_id, values in sent.items():
                    c.async_stream_infer(
                        "simple_sequence",
                        sequence_input(values[step]),
                        request_id=f"{sequence_id}_{step}",
                        outputs=[triton.InferRequestedOutput("OUTPUT")],
                        sequence_id=sequence_id,
                        sequence_start=step == 0,
                        sequence_end=step == steps - 1,
                    )
                c.async_stream_infer("simple", inputs, request_id=f"plain_{step}")
            got = [answers.get(timeout=WAIT_S) for _ in range(4 * steps)]
        finally:
            c.stop_stream()
    assert [error for _, error in got if error is not None] == []
    sums: dict[int, list[tuple[int, int]]] = {k: [] for k in sent}
    for result, _ in got:
        head, step = result.get_response().id.split("_")
        if head != "plain":
            sums[int(head)].append((int(step), int(result.as_numpy("OUTPUT")[0][0])))
    for sequence_id, values in sent.items():
        # Answered in order too: each waited for the one before it.
        assert sums[sequence_id] == list(enumerate(np.cumsum(values).tolist())), sequence_id


def stream_call(server: Server, requests: list[Any], **kwargs: Any) -> list[Any]:
    """ModelStreamInfer through grpcio's own stub: every response message, as sent."""
    with grpc.insecure_channel(server.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        return list(stub.ModelStreamInfer(iter(requests), timeout=WAIT_S, **kwargs))


def test_a_failed_stream_request_answers_with_its_id(server: Server) -> None:
    # As Triton's stream handler: the error_message, and an infer_response holding only the
    # request's id "so that client knows which request failed".
    good = valid_request()
    good.id = "good"
    unknown = service_pb2.ModelInferRequest(model_name="no_such_model", id="lost")
    answers = stream_call(server, [unknown, good])
    by_id = {a.infer_response.id: a for a in answers}
    assert set(by_id) == {"lost", "good"}
    assert "no_such_model" in by_id["lost"].error_message
    assert by_id["lost"].HasField("infer_response")
    assert by_id["lost"].infer_response == service_pb2.ModelInferResponse(id="lost")
    assert by_id["good"].error_message == ""


# -- deadlines and cancellation --------------------------------------------------------


def slow_state(server: Server) -> tuple[int, int, int]:
    labels = {"model": "slow", "version": "1"}
    return (
        int(metric(server, "trioinfer_inference_pending", **labels)),
        int(metric(server, "trioinfer_inference_executions_total", **labels)),
        int(metric(server, "trioinfer_inference_requests_total", outcome="cancelled", **labels)),
    )


def expired_count(server: Server) -> int:
    labels = {"model": "slow", "version": "1"}
    name = "trioinfer_inference_requests_total"
    return int(metric(server, name, outcome="deadline_exceeded", **labels))


def test_deadline_and_cancel_withdraw_requests(
    client: triton.InferenceServerClient, server: Server
) -> None:
    check_deadline_and_cancel(client, server)


def check_deadline_and_cancel(client: triton.InferenceServerClient, server: Server) -> None:
    pending0, executions0, cancelled0 = slow_state(server)
    expired0 = expired_count(server)
    assert pending0 == 0
    stats0 = client.get_inference_statistics("slow", "1").model_stats[0]
    blocker: queue.Queue[tuple[Any, Any]] = queue.Queue()
    call = client.async_infer(
        "slow", slow_input(BLOCKER_ROWS), lambda result, error: blocker.put((result, error))
    )
    wait_until(lambda: slow_state(server)[0] == 1 or not blocker.empty(), "the blocker is accepted")
    assert blocker.empty(), str(blocker.get()[1])
    # A request queued behind it whose client's deadline passes: DEADLINE_EXCEEDED, and
    # the engine withdraws it (it never runs).
    with pytest.raises(InferenceServerException) as late:
        client.infer("slow", slow_input(1), client_timeout=0.3)
    assert late.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    wait_until(lambda: slow_state(server)[0] == 1, "only the blocker is left")
    # The blocker's client cancels: its execution is aborted, nothing else ever ran.
    call.cancel()
    _result, error = blocker.get(timeout=WAIT_S)
    assert error is not None
    wait_until(lambda: slow_state(server)[0] == 0, "the cancelled blocker is withdrawn")
    _pending, executions, cancelled = slow_state(server)
    assert executions == executions0 + 1
    # The cancelled blocker; the late request is counted as expired, as HTTP counts a
    # request whose timeout passed (test_a_passed_deadline_counts_alike_over_http_and_grpc).
    assert cancelled - cancelled0 == 1
    assert expired_count(server) - expired0 == 1
    # Triton's execution_count and inference_count count what answered: nothing did.
    stats = client.get_inference_statistics("slow", "1").model_stats[0]
    assert stats.execution_count == stats0.execution_count
    assert stats.inference_count == stats0.inference_count


def raw_h2_call(
    address: str,
    path: bytes,
    body: bytes,
    *extra: tuple[bytes, bytes],
    frames: list[bytes] | None = None,
) -> dict[bytes, bytes]:
    """One gRPC call over a bare h2 client that never resets its stream: the answer's headers.

    *frames*, if given, gets each DATA frame's payload, as it came.
    """
    host, port = address.rsplit(":", 1)
    conn = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=True, header_encoding=None)
    )
    answer: dict[bytes, bytes] = {}
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as sock:
        conn.initiate_connection()
        headers = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", path)]
        headers += [(b":authority", address.encode()), (b"content-type", b"application/grpc")]
        conn.send_headers(1, [*headers, (b"te", b"trailers"), *extra])
        conn.send_data(1, struct.pack(">BI", 0, len(body)) + body, end_stream=True)
        sock.sendall(conn.data_to_send())
        while data := sock.recv(65536):
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                    answer.update(dict(event.headers))
                elif isinstance(event, h2.events.DataReceived):
                    conn.acknowledge_received_data(event.flow_controlled_length, 1)
                    if frames is not None:
                        frames.append(event.data)
                elif isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
                    return answer
            sock.sendall(conn.data_to_send())
    return answer


@pytest.mark.streaming
def test_a_run_of_stream_responses_leaves_in_one_frame(server: Server) -> None:
    """A decoupled model's run of responses goes in one DATA frame; one made alone, at once."""

    def stream(values: list[int], delay_ms: int) -> tuple[list[bytes], list[Any]]:
        request = service_pb2.ModelInferRequest(model_name="repeat_int32", id="run")
        request.parameters["triton_enable_empty_final_response"].bool_param = True
        for name, datatype, array in [
            ("IN", "INT32", np.array(values, dtype=np.int32)),
            ("DELAY", "UINT32", np.full(len(values), delay_ms, dtype=np.uint32)),
            ("WAIT", "UINT32", np.array([0], dtype=np.uint32)),
        ]:
            request.inputs.add(name=name, datatype=datatype)
            request.inputs[-1].shape.append(array.size)
            request.raw_input_contents.append(array.tobytes())
        frames: list[bytes] = []
        answer = raw_h2_call(
            server.grpc,
            b"/inference.GRPCInferenceService/ModelStreamInfer",
            request.SerializeToString(),
            frames=frames,
        )
        assert answer.get(b"grpc-status") == b"0", answer
        data, responses = b"".join(frames), []
        while data:  # gRPC's messages: a byte stream across the frames
            size = int.from_bytes(data[1:5], "big")
            responses.append(service_pb2.ModelStreamInferResponse.FromString(data[5 : 5 + size]))
            data = data[5 + size :]
        return frames, responses

    def read(responses: list[Any]) -> list[tuple[int | None, bool]]:
        # Each response's OUT (None: none) and its triton_final_response.
        got = []
        for message in responses:
            assert message.error_message == ""
            response = message.infer_response
            assert (response.model_name, response.model_version, response.id) == (
                "repeat_int32",
                "1",
                "run",
            )
            names = [tensor.name for tensor in response.outputs]
            out = None
            if names:
                out = int(np.frombuffer(response.raw_output_contents[names.index("OUT")], "<i4")[0])
            got.append((out, response.parameters["triton_final_response"].bool_param))
        return got

    # 50 responses with no wait between them: made in runs, written a run at a time.
    frames, responses = stream(list(range(50)), 0)
    assert read(responses) == [(v, False) for v in range(50)] + [(None, True)]
    # Runs of up to STREAM_AHEAD (16), cut shorter where the loop's inline slice ran out
    # (a loaded machine): fewer frames than messages (51, the final one with them).
    assert 1 < len(frames) < 51
    # 3 responses 100 ms apart: each written as it is made, alone; the final one with
    # the last when the model's end is at hand by then, else after it.
    frames, responses = stream([7, 8, 9], 100)
    assert read(responses) == [(7, False), (8, False), (9, False), (None, True)]
    assert len(frames) in (3, 4)
    first, second, *_ = frames
    for frame in (first, second):  # one response each
        assert len(frame) == 5 + int.from_bytes(frame[1:5], "big")


@pytest.mark.streaming
def test_a_requests_timeout_never_cuts_a_stream_message_in_two(server: Server) -> None:
    """A response being written when its request's timeout passes goes out whole.

    gRPC's messages are one byte stream: a response sent in pieces (a client's
    window smaller than it) that the request's ``timeout`` cut part-way left its
    head on the wire, and the next message (that request's error, or another
    request's response) was read as the rest of it: the client got garbage.
    """
    request = service_pb2.ModelInferRequest(model_name="repeat_int32", id="cut")
    # 3 s: the first response is made well before it, even on a busy machine.
    request.parameters["timeout"].int64_param = 3_000_000
    for name, datatype, array in [
        ("IN", "INT32", np.array([7, 8], dtype=np.int32)),
        ("DELAY", "UINT32", np.array([0, 10_000], dtype=np.uint32)),  # the second after 10 s
        ("WAIT", "UINT32", np.array([0], dtype=np.uint32)),
    ]:
        request.inputs.add(name=name, datatype=datatype)
        request.inputs[-1].shape.append(array.size)
        request.raw_input_contents.append(array.tobytes())
    body = request.SerializeToString()
    host, port = server.grpc.rsplit(":", 1)
    conn = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=True, header_encoding=None)
    )
    data, trailers = b"", {}
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as sock:

        def pump() -> list[Any]:
            received = sock.recv(65536)
            assert received, "the server closed the connection"
            events = conn.receive_data(received)
            sock.sendall(conn.data_to_send())
            return events

        conn.initiate_connection()
        # A window of 16 bytes: each response goes out in pieces, the client's reads between.
        conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 16})
        path = b"/inference.GRPCInferenceService/ModelStreamInfer"
        headers = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", path)]
        headers += [(b":authority", server.grpc.encode()), (b"content-type", b"application/grpc")]
        conn.send_headers(1, [*headers, (b"te", b"trailers")])
        conn.send_data(1, struct.pack(">BI", 0, len(body)) + body)  # the stream stays open
        sent = time.monotonic()
        sock.sendall(conn.data_to_send())
        while not data:  # the response's first piece; the rest waits for the window
            for event in pump():
                if isinstance(event, h2.events.DataReceived):
                    data += event.data
        assert len(data) < 5 + int.from_bytes(data[1:5], "big")  # a piece of a message
        time.sleep(max(sent + 4 - time.monotonic(), 0))  # the request's timeout passes
        conn.increment_flow_control_window(1 << 20, stream_id=1)
        conn.increment_flow_control_window(1 << 20)
        conn.end_stream(1)  # no more requests: the call ends once this one has
        sock.sendall(conn.data_to_send())
        ended = False
        while not ended:
            for event in pump():
                if isinstance(event, h2.events.DataReceived):
                    data += event.data
                    conn.acknowledge_received_data(event.flow_controlled_length, 1)
                elif isinstance(event, h2.events.TrailersReceived):
                    trailers = dict(event.headers)
                elif isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
                    ended = True
            sock.sendall(conn.data_to_send())
    assert trailers.get(b"grpc-status") == b"0", trailers
    messages = []
    while data:  # the byte stream, message by message: each one whole
        size = int.from_bytes(data[1:5], "big")
        assert len(data) >= 5 + size, f"a message cut short: {data!r}"
        messages.append(service_pb2.ModelStreamInferResponse.FromString(data[5 : 5 + size]))
        data = data[5 + size :]
    first, *rest = messages
    assert first.error_message == "", first
    assert first.infer_response.id == "cut"
    out = first.infer_response.raw_output_contents[0]
    assert np.frombuffer(out, "<i4").tolist() in ([7], [0])  # OUT or IDX, whichever first
    # Then, if the model's end came after the timeout, the timeout's error.
    assert all("timeout" in message.error_message for message in rest), rest


def test_the_server_keeps_the_clients_deadline(
    client: triton.InferenceServerClient, server: Server
) -> None:
    # grpcio resets its own stream when its deadline passes, which cancels the request
    # either way; a client that does not must still get DEADLINE_EXCEEDED from the
    # server once its grpc-timeout passes, the request withdrawn from the engine.
    blocker: queue.Queue[tuple[Any, Any]] = queue.Queue()
    call = client.async_infer(
        "slow", slow_input(BLOCKER_ROWS), lambda result, error: blocker.put((result, error))
    )
    try:
        wait_until(lambda: slow_state(server)[0] == 1 or not blocker.empty(), "blocker accepted")
        assert blocker.empty(), str(blocker.get()[1])
        request = service_pb2.ModelInferRequest(model_name="slow")
        request.inputs.add(name="x", datatype="FP32", shape=[1, SLOW_WIDTH])
        request.raw_input_contents.append(np.ones((1, SLOW_WIDTH), dtype=np.float32).tobytes())
        answer = raw_h2_call(
            server.grpc,
            b"/inference.GRPCInferenceService/ModelInfer",
            request.SerializeToString(),
            (b"grpc-timeout", b"300m"),
        )
        assert answer.get(b"grpc-status") == b"%d" % grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        assert blocker.empty(), "the answer came only once the blocker was done"
    finally:
        call.cancel()
        blocker.get(timeout=WAIT_S)
    wait_until(lambda: slow_state(server)[0] == 0, "nothing is left pending")


def test_a_passed_deadline_counts_alike_over_http_and_grpc(
    client: triton.InferenceServerClient, server: Server
) -> None:
    # An HTTP request whose timeout passes, a gRPC call whose deadline passes (grpcio
    # resets its stream then; a bare client does not), a gRPC request whose timeout
    # parameter passes: each is one deadline_exceeded, none cancelled, and Triton's
    # statistics count them alike. The gRPC deadline was counted as a client leaving.
    def counts() -> tuple[int, int, int]:
        stats = client.get_inference_statistics("slow", "1").model_stats[0]
        return expired_count(server), slow_state(server)[2], stats.inference_stats.fail.count

    body = {
        "inputs": [{"name": "x", "shape": [1, SLOW_WIDTH], "datatype": "FP32",
                    "data": [1.0] * SLOW_WIDTH}],
        "parameters": {"timeout": 100_000},
    }  # fmt: skip
    request = service_pb2.ModelInferRequest(model_name="slow")
    request.inputs.add(name="x", datatype="FP32", shape=[1, SLOW_WIDTH])
    request.raw_input_contents.append(np.ones((1, SLOW_WIDTH), dtype=np.float32).tobytes())

    def over_http() -> None:
        response = httpx.post(f"{server.url}/v2/models/slow/infer", json=body, timeout=WAIT_S)
        assert response.status_code == 504, response.text

    def over_grpcio() -> None:
        with pytest.raises(InferenceServerException) as late:
            client.infer("slow", slow_input(1), client_timeout=0.1)
        assert late.value.status() == "StatusCode.DEADLINE_EXCEEDED"

    def over_bare_h2() -> None:
        path = b"/inference.GRPCInferenceService/ModelInfer"
        answer = raw_h2_call(
            server.grpc, path, request.SerializeToString(), (b"grpc-timeout", b"100m")
        )
        assert answer.get(b"grpc-status") == b"%d" % grpc.StatusCode.DEADLINE_EXCEEDED.value[0]

    def timeout_parameter() -> None:
        with pytest.raises(InferenceServerException) as late:
            client.infer("slow", slow_input(1), timeout=100_000)
        assert late.value.status() == "StatusCode.DEADLINE_EXCEEDED"

    def answered(answers: queue.Queue[tuple[Any, Any]], result: Any, error: Any) -> None:
        answers.put((result, error))

    def blocking(answers: queue.Queue[tuple[Any, Any]]) -> bool:
        return slow_state(server)[0] == 1 or not answers.empty()

    deltas = {}
    for way in (over_http, over_grpcio, over_bare_h2, timeout_parameter):
        # Behind a blocker of its own, so that it waits in the queue until its end.
        blocker: queue.Queue[tuple[Any, Any]] = queue.Queue()
        call = client.async_infer("slow", slow_input(BLOCKER_ROWS), partial(answered, blocker))
        try:
            wait_until(partial(blocking, blocker), "the blocker is accepted")
            assert blocker.empty(), str(blocker.get()[1])
            before = counts()
            way()
            assert blocker.empty(), "the blocker ran all along"
        finally:
            call.cancel()
            blocker.get(timeout=WAIT_S)
        wait_until(lambda: slow_state(server)[0] == 0, "nothing is left pending")
        # Less the cancelled blocker.
        after = counts()
        deltas[way.__name__] = (
            after[0] - before[0],
            after[1] - before[1] - 1,
            after[2] - before[2],
        )
    first = deltas["over_http"]
    assert first[:2] == (1, 0), deltas
    assert all(delta == first for delta in deltas.values()), deltas


def test_requests_in_flight_are_counted_by_protocol(
    client: triton.InferenceServerClient, server: Server
) -> None:
    # trioinfer_inference_in_flight{protocol}: a gRPC request is "grpc", never "http"
    # (trioinfer_http_inference_in_flight, the old name, counts both, as documented).
    def in_flight() -> tuple[int, int, int]:
        name = "trioinfer_inference_in_flight"
        return (
            int(metric(server, name, protocol="http")),
            int(metric(server, name, protocol="grpc")),
            int(metric(server, "trioinfer_http_inference_in_flight")),
        )

    # The scrape that reads them is an HTTP request, but not an inference one.
    assert in_flight() == (0, 0, 0)
    blocker: queue.Queue[tuple[Any, Any]] = queue.Queue()
    call = client.async_infer(
        "slow", slow_input(BLOCKER_ROWS), lambda result, error: blocker.put((result, error))
    )
    try:
        wait_until(lambda: in_flight() != (0, 0, 0) or not blocker.empty(), "blocker counted")
        assert blocker.empty(), str(blocker.get()[1])
        assert in_flight() == (0, 1, 1)
    finally:
        call.cancel()
        blocker.get(timeout=WAIT_S)
    wait_until(lambda: in_flight() == (0, 0, 0), "nothing in flight")


def test_timeout_parameter_is_the_triton_timeout(client: triton.InferenceServerClient) -> None:
    # tritonclient's `timeout` (microseconds, a request parameter) bounds the request too.
    blocker: queue.Queue[tuple[Any, Any]] = queue.Queue()
    call = client.async_infer(
        "slow", slow_input(BLOCKER_ROWS), lambda result, error: blocker.put((result, error))
    )
    try:
        with pytest.raises(InferenceServerException) as late:
            client.infer("slow", slow_input(1), timeout=1000)
        assert late.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    finally:
        call.cancel()
        blocker.get(timeout=WAIT_S)


# -- bad messages ------------------------------------------------------------------------


def raw_infer(server: Server, body: bytes) -> grpc.RpcError | None:
    with grpc.insecure_channel(server.grpc) as channel:
        method = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        try:
            method(body, timeout=WAIT_S)
        except grpc.RpcError as exc:
            return exc
    return None


def valid_request() -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="add")
    for name in "ab":
        request.inputs.add(name=name, datatype="FP32", shape=[2, 4])
        request.raw_input_contents.append(np.ones((2, 4), dtype=np.float32).tobytes())
    return request


def test_bad_messages_get_invalid_argument(server: Server) -> None:
    assert raw_infer(server, valid_request().SerializeToString()) is None
    cases: dict[str, bytes] = {}
    body = valid_request().SerializeToString()
    cases["truncated"] = body[: len(body) // 2]
    cases["garbage"] = b"\xff\xff\xff\xff\x0f"
    wrong_type = bytearray(body)
    wrong_type[0] = (1 << 3) | 0  # model_name (a string) sent as a varint
    cases["wrong wire type"] = bytes(wrong_type)
    huge = valid_request()
    huge.inputs[0].ClearField("shape")
    huge.inputs[0].shape.extend([2**40, 2**40])
    cases["huge declared shape"] = huge.SerializeToString()
    negative = valid_request()
    negative.inputs[0].shape[0] = -2
    cases["negative dimension"] = negative.SerializeToString()
    short = valid_request()
    short.raw_input_contents[1] = b"\x00" * 31
    cases["raw contents of the wrong length"] = short.SerializeToString()
    missing = valid_request()
    del missing.raw_input_contents[1]
    cases["fewer raw contents than inputs"] = missing.SerializeToString()
    mixed = valid_request()
    mixed.inputs[0].contents.fp32_contents.extend([1.0] * 8)
    cases["contents and raw contents"] = mixed.SerializeToString()
    typed = service_pb2.ModelInferRequest(model_name="add")
    for name in "ab":
        typed.inputs.add(name=name, datatype="FP32", shape=[2, 4]).contents.int_contents.extend(
            range(8)
        )
    cases["contents of the wrong type"] = typed.SerializeToString()
    no_values = service_pb2.ModelInferRequest(model_name="add")
    no_values.inputs.add(name="a", datatype="FP32", shape=[2, 4])
    cases["no values"] = no_values.SerializeToString()
    cases["no inputs"] = service_pb2.ModelInferRequest(model_name="add").SerializeToString()
    bad_datatype = valid_request()
    bad_datatype.inputs[0].datatype = "FLOAT"
    cases["unknown datatype"] = bad_datatype.SerializeToString()
    for what, message in cases.items():
        error = raw_infer(server, message)
        assert error is not None, what
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (what, error.details())
        assert error.details(), what
    too_big = valid_request()
    too_big.raw_input_contents[0] = b"\x00" * (MAX_BODY + 1)
    error = raw_infer(server, too_big.SerializeToString())
    assert error is not None
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_wire_split_reads_what_protobuf_reads() -> None:
    from trioinfer.server._grpc import _wire_split

    request = valid_request()
    request.id = "r-\u00e9"
    request.parameters["priority"].int64_param = 1
    split = _wire_split(request.SerializeToString())
    assert split is not None
    rest, request_id, contents = split
    assert request_id == "r-\u00e9"
    assert [bytes(c) for c in contents] == list(request.raw_input_contents)
    bare = service_pb2.ModelInferRequest()
    bare.CopyFrom(request)
    bare.ClearField("id")
    bare.ClearField("raw_input_contents")
    assert rest == bare.SerializeToString()
    # Anything unusual is left to protobuf: a varint field, a cut length, two ids.
    body = request.SerializeToString()
    assert _wire_split(b"\x08\x01" + body) is None
    assert _wire_split(body[:-3]) is None
    assert _wire_split(body + b"\x1a\x01x") is None
    assert _wire_split(b"\x1a\x01\xff") is None  # an id that is not UTF-8


def infer_raw_answer(server: Server, message: service_pb2.ModelInferRequest) -> Any:
    with grpc.insecure_channel(server.grpc) as channel:
        method = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        return service_pb2.ModelInferResponse.FromString(
            method(message.SerializeToString(), timeout=WAIT_S)
        )


def test_a_layout_seen_before_answers_as_the_long_way(server: Server) -> None:
    # The same layout again and again (a plan is made the second time, used after),
    # with each request's own id and data; then contents that do not fit the plan.
    layout = service_pb2.ModelInferRequest(model_name="add")
    layout.inputs.add(name="a", datatype="FP32", shape=[1, 4])
    layout.inputs.add(name="b", datatype="FP32", shape=[1, 4])
    layout.outputs.add(name="sum")
    for turn in range(5):
        message = service_pb2.ModelInferRequest()
        message.CopyFrom(layout)
        if turn % 2:
            message.id = f"call-{turn}"
        a = np.arange(4, dtype=np.float32).reshape(1, 4) * turn
        b = np.full((1, 4), 0.5, dtype=np.float32)
        message.raw_input_contents.extend([a.tobytes(), b.tobytes()])
        answer = infer_raw_answer(server, message)
        assert answer.id == message.id
        assert answer.model_name == "add"
        assert [o.name for o in answer.outputs] == ["sum"]
        assert list(answer.outputs[0].shape) == [1, 4]
        assert answer.outputs[0].datatype == "FP32"
        got = np.frombuffer(answer.raw_output_contents[0], dtype=np.float32).reshape(1, 4)
        np.testing.assert_array_equal(got, a + b)
    short = service_pb2.ModelInferRequest()
    short.CopyFrom(layout)
    short.raw_input_contents.extend([b"\x00" * 16, b"\x00" * 15])
    missing = service_pb2.ModelInferRequest()
    missing.CopyFrom(layout)
    missing.raw_input_contents.append(b"\x00" * 16)
    extra = service_pb2.ModelInferRequest()
    extra.CopyFrom(layout)
    extra.raw_input_contents.extend([b"\x00" * 16] * 3)
    for what, message in {"short": short, "missing": missing, "extra": extra}.items():
        error = raw_infer(server, message.SerializeToString())
        assert error is not None, what
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (what, error.details())
        assert "raw_input_contents" in error.details(), (what, error.details())


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_fuzzed_messages_never_crash(server: Server, data: st.DataObject) -> None:
    body = bytearray(valid_request().SerializeToString())
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(body) - 1))
        body[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(1, len(body)))
    error = raw_infer(server, bytes(body[:cut]))
    if error is not None:
        assert error.code() in (
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        ), error.details()


def test_server_survived_the_fuzzing(client: triton.InferenceServerClient) -> None:
    inputs, a, b = simple_inputs()
    np.testing.assert_array_equal(client.infer("simple", inputs).as_numpy("sum"), a + b)


# -- serve's options -----------------------------------------------------------------------


def test_asyncio_loop_and_no_extra(repository: Path, tmp_path: Path) -> None:
    # The same endpoint on asyncio (grpc.aio on serve's own loop): infer, stream, a client
    # deadline and a cancelled call.
    config = tmp_path / "serve.toml"
    config.write_text(SERVE_CONFIG)
    with (
        run_server(
            repository,
            *("--loop", "asyncio", "--model", "simple", "--model", "slow"),
            *("--model", "repeat_int32"),
            *("--config", str(config)),
            log=tmp_path / "a.log",
        ) as server,
        triton.InferenceServerClient(server.grpc) as c,
    ):
        check_deadline_and_cancel(c, server)
        inputs, a, b = simple_inputs()
        np.testing.assert_array_equal(c.infer("simple", inputs).as_numpy("sum"), a + b)
        answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
        c.start_stream(callback=lambda result, error: answers.put((result, error)))
        c.async_stream_infer("simple", inputs)
        result, error = answers.get(timeout=WAIT_S)
        assert error is None
        np.testing.assert_array_equal(result.as_numpy("diff"), a - b)
        # A decoupled model's stream, on grpc.aio's own loop.
        c.async_stream_infer("repeat_int32", repeat_inputs([3, 5]))
        streamed = [answers.get(timeout=WAIT_S) for _ in range(2)]
        c.stop_stream()
        assert [error for _, error in streamed] == [None, None]
        assert [int(result.as_numpy("OUT")[0]) for result, _ in streamed] == [3, 5]
    # Without the extra, serve says why it serves no gRPC, and serves HTTP.
    with run_server(
        repository,
        "--model",
        "simple",
        log=tmp_path / "b.log",
        prelude="import sys; sys.modules['grpc'] = None",
        want_grpc=False,
    ) as server:
        assert httpx.get(f"{server.url}/v2/health/ready", timeout=WAIT_S).status_code == 200
        assert "not serving gRPC" in server.log_text()
        assert "'grpc' extra" in server.log_text()


def test_asking_for_grpc_without_the_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from trioinfer.cli import serve as serve_module

    monkeypatch.setattr(serve_module, "_importable", lambda module: module != "grpc")
    result = CliRunner().invoke(cli_main, ["serve", "--grpc-port", "9001"])
    assert result.exit_code == 2
    assert "'grpc' extra" in result.output


def test_bench_over_grpc(server: Server, tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    options = ["--concurrency", "1,4", "--warmup", "0", "--window", "0.3", "--windows", "1"]
    result = CliRunner().invoke(
        cli_main,
        [
            "bench",
            "--protocol",
            "grpc",
            "--url",
            f"grpc://{server.grpc}",
            "-m",
            "simple",
            *options,
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["protocol"] == "grpc"
    assert [r["value"] for r in doc["results"]] == [1, 4]
    assert all(r["completed"] > 0 and r["errors"] == 0 for r in doc["results"])
    unknown = CliRunner().invoke(
        cli_main, ["bench", "--protocol", "grpc", "--url", f"grpc://{server.grpc}", "-m", "nope"]
    )
    assert unknown.exit_code == 1
    assert "NOT_FOUND" in unknown.output


def test_grpc_port_in_use_is_a_clear_error(repository: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(
            cli_main,
            [
                *("serve", "--port", "0", "--grpc-port", str(port)),
                *("--model-repository", str(repository), "--model", "simple"),
            ],
        )
    assert result.exit_code == 1
    # The gRPC address alone: not under the HTTP one ("cannot listen on 127.0.0.1:0: ...").
    assert result.output.startswith(f"Error: cannot listen for gRPC on 127.0.0.1:{port}: ")
    # A newcomer who wanted HTTP only, with another server on 8001, is shown the way out.
    assert result.output.rstrip().endswith("--no-grpc serves HTTP alone)")


def test_one_port_for_http_and_grpc_is_a_usage_error(repository: Path) -> None:
    result = CliRunner().invoke(
        cli_main,
        [
            *("serve", "--port", "18123", "--grpc-port", "18123"),
            *("--model-repository", str(repository)),
        ],
    )
    assert result.exit_code == 2
    assert "--grpc-port 18123 is also the HTTP port (--port 18123)" in result.output


def test_no_grpc_serves_http_only(repository: Path, tmp_path: Path) -> None:
    with run_server(
        repository, "--no-grpc", "--model", "simple", log=tmp_path / "s.log", want_grpc=False
    ) as server:
        assert httpx.get(f"{server.url}/v2/health/live", timeout=WAIT_S).status_code == 200
    assert "gRPC" not in server.log_text()


def test_errors_map_to_tritons_status_codes() -> None:
    from trioinfer import (
        BackendError,
        CircuitOpen,
        DeadlineExceeded,
        InvalidInput,
        ModelNotFound,
        QueueFull,
    )
    from trioinfer.server import PayloadTooLarge, RequestError
    from trioinfer.server._grpc import grpc_status_for

    # The integers sent, by grpc.StatusCode's names.
    code = types.SimpleNamespace(**{c.name: c.value[0] for c in grpc.StatusCode})
    assert grpc_status_for(ModelNotFound("m")) == code.NOT_FOUND
    assert grpc_status_for(RequestError("r")) == code.INVALID_ARGUMENT
    assert grpc_status_for(InvalidInput("i")) == code.INVALID_ARGUMENT
    assert grpc_status_for(PayloadTooLarge("p")) == code.RESOURCE_EXHAUSTED
    assert grpc_status_for(QueueFull("q", retry_after=1.0)) == code.UNAVAILABLE
    assert grpc_status_for(CircuitOpen("c", retry_after=1.0)) == code.UNAVAILABLE
    assert grpc_status_for(DeadlineExceeded("d")) == code.DEADLINE_EXCEEDED
    assert grpc_status_for(BackendError("b")) == code.INTERNAL
    assert grpc_status_for(ValueError("bug")) == code.INTERNAL


@pytest.mark.triton_config
def test_triton_priority_levels_and_classification(tmp_path: Path) -> None:
    # A config.pbtxt model over gRPC: Triton's priority levels are mapped (as Triton does),
    # and class_count answers the top classes with labels, as over HTTP.
    root = tmp_path / "repository"
    test_triton.write_scores(root / "classifier" / "1" / "model.onnx")
    (root / "classifier" / "config.pbtxt").write_text(test_triton.CLASSIFIER_PBTXT)
    (root / "classifier" / "labels.txt").write_text("\n".join(test_triton.LABELS) + "\n")
    with run_server(root, log=tmp_path / "server.log") as running:
        client = triton.InferenceServerClient(running.grpc)
        try:
            scores = np.array([[0.1, 0.7, 0.05, 0.9, 0.7]], dtype=np.float32)
            inputs = [triton.InferInput("IMAGE", [1, 5], "FP32")]
            inputs[0].set_data_from_numpy(scores)
            # 4 is no level of the model's: as in Triton, it is served at the default level.
            for level in (0, 1, 3, 4):
                client.infer("classifier", inputs, priority=level)
            outputs = [triton.InferRequestedOutput("SCORES", class_count=3)]
            top = client.infer("classifier", inputs, outputs=outputs).as_numpy("SCORES")
            assert [t.decode() for t in top[0]] == [
                "0.900000:3:fish",
                "0.700000:1:dog",
                "0.700000:4:frog",
            ]
        finally:
            client.close()


@pytest.mark.streaming
def test_a_stream_response_serialised_by_hand_reads_as_the_protobuf_message() -> None:
    # `_stream_response` writes the message from memos and pieces; it must read back as
    # the message protobuf builds, parameter types (True against 1, -0.0 against 0.0,
    # equal as memo keys would be) and outputs in shared memory included.
    from trioinfer.server import _grpc, _grpc_proto

    data = np.array([5, -6], "<i4").tobytes()
    plain = [("OUT", "INT32", (2,), data, None), ("S", "BYTES", (0,), b"", None)]
    in_shm = [("OUT", "INT32", (2,), b"", {"shared_memory_region": "r", "shared_memory_offset": 8})]
    cases = [None, {}, {"a": True}, {"a": 1}, {"a": True}, {"f": -0.0}, {"f": 0.0}, {"f": -0.0}]
    cases += [{"s": "x" * 2000, "n": 2**40, "triton_final_response": False}]
    for outputs in (plain, in_shm, []):
        for request_id in ("", "id-é"):
            for parameters in cases:
                got = _grpc_proto.ModelStreamInferResponse.FromString(
                    _grpc._stream_response("m", "1", request_id, outputs, parameters)
                )
                expected = _grpc_proto.ModelStreamInferResponse(
                    infer_response=_grpc._infer_response("m", "1", request_id, outputs, parameters)
                )
                assert got.SerializeToString(deterministic=True) == expected.SerializeToString(
                    deterministic=True
                ), (outputs, request_id, parameters)
