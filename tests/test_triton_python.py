"""Triton Python models served as they are: ``config.pbtxt`` with ``backend: "python"``.

The models here are written as for Triton (``class TritonPythonModel``,
``import triton_python_backend_utils as pb_utils``, ``execute(requests)``), in
a Triton-layout repository the tests write, and run through the engine and
through a real ``trioinfer serve`` with ``tritonclient``.
"""

from __future__ import annotations

import importlib
import json
import logging
import queue
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import trio
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import trioinfer
from trioinfer import BackendError, ConfigError, InvalidInput
from trioinfer.server._repository import ModelRepository

pytestmark = [pytest.mark.python_model, pytest.mark.triton_config]

#: Bounds against hangs only.
WAIT_S = 60.0

ADD_SUB_PBTXT = """\
name: "add_sub"
backend: "python"
max_batch_size: 8
dynamic_batching { max_queue_delay_microseconds: 500000 }
input [
  { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "REQUESTS" data_type: TYPE_INT32 dims: [ 1 ] }
]
instance_group [ { kind: KIND_CPU count: 1 } ]
parameters { key: "offset" value: { string_value: "0.5" } }
model_warmup [
  {
    name: "zeros"
    batch_size: 2
    inputs { key: "INPUT0" value: { data_type: TYPE_FP32 dims: [ 4 ] zero_data: true } }
    inputs { key: "INPUT1" value: { data_type: TYPE_FP32 dims: [ 4 ] zero_data: true } }
  }
]
"""

# As Triton's add_sub example, with an offset from the config's parameters, and how
# many requests each execute got (REQUESTS); a negative INPUT0 is refused per request.
ADD_SUB = """\
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.args = dict(args)
        self.config = json.loads(args["model_config"])
        self.offset = float(self.config["parameters"]["offset"]["string_value"])
        output = pb_utils.get_output_config_by_name(self.config, "OUTPUT0")
        self.dtype = pb_utils.triton_string_to_numpy(output["data_type"])
        pb_utils.Logger.log_info("add_sub initialized: " + json.dumps(self.args, sort_keys=True))

    def execute(self, requests):
        pb_utils.Logger.log_verbose(f"add_sub execute: {[r.request_id() for r in requests]}")
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            if (a < 0).any():
                responses.append(
                    pb_utils.InferenceResponse(
                        error=pb_utils.TritonError(
                            "INPUT0 must not be negative", pb_utils.TritonError.INVALID_ARG
                        )
                    )
                )
                continue
            if (a > 1000).any():
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("too big")))
                continue
            count = np.full((len(a), 1), len(requests), np.int32)
            responses.append(
                pb_utils.InferenceResponse(
                    output_tensors=[
                        pb_utils.Tensor("OUTPUT0", (a + b + self.offset).astype(self.dtype)),
                        pb_utils.Tensor("OUTPUT1", (a - b).astype(self.dtype)),
                        pb_utils.Tensor("REQUESTS", count),
                    ]
                )
            )
        return responses

    def finalize(self):
        pb_utils.Logger.log_info("add_sub finalized")
"""

UPPER_PBTXT = """\
backend: "python"
max_batch_size: 0
input [ { name: "TEXT" data_type: TYPE_STRING dims: [ -1 ] } ]
output [
  { name: "UPPER" data_type: TYPE_STRING dims: [ -1 ] },
  { name: "LENGTHS" data_type: TYPE_INT64 dims: [ -1 ] },
  { name: "META" data_type: TYPE_STRING dims: [ 2 ] }
]
"""

# BYTES in and out; an unbatched model whose outputs need not have the input's length
# (LENGTHS and UPPER have; META has two elements whatever came).
UPPER = """\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()
            assert pb_utils.get_input_tensor_by_name(request, "NOPE") is None
            upper = np.array([t.upper() for t in text], dtype=object)
            lengths = np.array([len(t) for t in text], dtype=np.int64)
            meta = np.array([request.request_id(), request.parameters()], dtype=object)
            responses.append(
                pb_utils.InferenceResponse(
                    [
                        pb_utils.Tensor("UPPER", upper),
                        pb_utils.Tensor("LENGTHS", lengths),
                        pb_utils.Tensor("META", meta),
                    ]
                )
            )
        return responses
"""

BROKEN_PBTXT = """\
backend: "python"
max_batch_size: 4
input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

# X 1: execute raises; X 2: it returns one response too few; X 3: not a list; X 5: it
# calls sys.exit(); X 6: it raises KeyboardInterrupt.
BROKEN = """\
import sys

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        x = int(pb_utils.get_input_tensor_by_name(requests[0], "X").as_numpy()[0, 0])
        if x == 1:
            raise pb_utils.TritonModelException("execute broke")
        if x == 2:
            return []
        if x == 3:
            return "no"
        if x == 5:
            sys.exit(3)
        if x == 6:
            raise KeyboardInterrupt(3)
        return [
            pb_utils.InferenceResponse([pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(
                r, "X").as_numpy() * 2)])
            for r in requests
        ]
"""

REPEAT_PBTXT = """\
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

# As Triton's repeat example: one response per element of IN, from a thread of its own
# after execute returned, then the final flag alone.
REPEAT = """\
import threading

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().copy()
            threading.Thread(target=self.send, args=(sender, values)).start()
        return None

    def send(self, sender, values):
        for value in values:
            if value < 0:
                sender.send(
                    pb_utils.InferenceResponse(error=pb_utils.TritonError("negative")),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )
                return
            out = pb_utils.Tensor("OUT", np.array([value], np.int32))
            sender.send(pb_utils.InferenceResponse([out]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""

CALLER_PBTXT = """\
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1, 4 ] } ]
output [ { name: "SUM" data_type: TYPE_FP32 dims: [ 1, 4 ] } ]
"""

# Business logic scripting: add_sub called with X twice; a negative X is its error.
CALLER = """\
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X")
            wanted = "NOPE" if x.as_numpy()[0, 0] == 7 else "OUTPUT0"
            called = pb_utils.InferenceRequest(
                model_name="add_sub",
                requested_output_names=[wanted],
                inputs=[pb_utils.Tensor("INPUT0", x.as_numpy()),
                        pb_utils.Tensor("INPUT1", x.as_numpy())],
            ).exec()
            if called.has_error():
                responses.append(pb_utils.InferenceResponse(error=called.error()))
                continue
            assert [t.name() for t in called.output_tensors()] == ["OUTPUT0"]
            total = pb_utils.get_output_tensor_by_name(called, "OUTPUT0")
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("SUM", total.as_numpy())]))
        return responses
"""

# The same from an async def execute, with async_exec().
ASYNC_CALLER = (
    CALLER.replace("def execute", "async def execute")
    .replace(").exec()", ").async_exec()")
    .replace("called = pb_utils", "called = await pb_utils")
)

ENSEMBLE_PBTXT = """\
platform: "ensemble"
max_batch_size: 0
input [ { name: "WORDS" data_type: TYPE_STRING dims: [ -1 ] } ]
output [ { name: "SHOUTED" data_type: TYPE_STRING dims: [ -1 ] } ]
ensemble_scheduling {
  step [
    {
      model_name: "upper"
      model_version: -1
      input_map { key: "TEXT" value: "WORDS" }
      output_map { key: "UPPER" value: "SHOUTED" }
    }
  ]
}
"""

MODELS = {
    "add_sub": (ADD_SUB_PBTXT, ADD_SUB),
    "upper": (UPPER_PBTXT, UPPER),
    "broken": (BROKEN_PBTXT, BROKEN),
    "repeat": (REPEAT_PBTXT, REPEAT),
    "caller": (CALLER_PBTXT, CALLER),
    "async_caller": (CALLER_PBTXT, ASYNC_CALLER),
}


def write_repository(root: Path) -> Path:
    for name, (pbtxt, code) in MODELS.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(pbtxt)
        (root / name / "1" / "model.py").write_text(code)
    (root / "shout" / "1").mkdir(parents=True)
    (root / "shout" / "config.pbtxt").write_text(ENSEMBLE_PBTXT)
    return root


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_repository(tmp_path_factory.mktemp("triton_python") / "models")


async def load(engine: trioinfer.Engine, repository: Path, *names: str) -> None:
    repo = ModelRepository(repository)
    for name in names:
        await engine.load(repo.entry(name).config(1))


def pair(a: float, b: float, rows: int = 1) -> dict[str, np.ndarray[Any, Any]]:
    return {
        "INPUT0": np.full((rows, 4), a, np.float32),
        "INPUT1": np.full((rows, 4), b, np.float32),
    }


# -- through the engine ----------------------------------------------------------------


async def test_add_sub_gets_tritons_arguments_and_answers(
    repository: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, "trioinfer.python")
    async with trioinfer.open_engine() as engine:
        await load(engine, repository, "add_sub")
        # model_warmup's sample ran at load, as one request with no id.
        assert "add_sub execute: ['']" in [r.getMessage() for r in caplog.records]
        out = await engine.infer("add_sub", pair(3, 1, rows=2), request_id="q")
    np.testing.assert_array_equal(out["OUTPUT0"], np.full((2, 4), 4.5, np.float32))
    np.testing.assert_array_equal(out["OUTPUT1"], np.full((2, 4), 2, np.float32))
    (said,) = [r.getMessage() for r in caplog.records if "initialized" in r.getMessage()]
    args = json.loads(said.split(": ", 1)[1])
    assert args["model_name"] == "add_sub"
    assert args["model_version"] == "1"
    assert args["model_instance_kind"] == "CPU"
    assert args["model_instance_device_id"] == "0"
    assert args["model_instance_name"] == "add_sub_0_0"
    assert Path(args["model_repository"]) == repository / "add_sub"
    config = json.loads(args["model_config"])
    assert config["name"] == "add_sub"
    assert config["max_batch_size"] == 8
    assert [o["name"] for o in config["output"]] == ["OUTPUT0", "OUTPUT1", "REQUESTS"]
    assert any(r.getMessage() == "add_sub finalized" for r in caplog.records)


async def test_execute_gets_a_batch_of_requests_each_with_its_own_tensors(
    repository: Path,
) -> None:
    # Eight requests within max_queue_delay: the dynamic batcher hands them to one
    # execute (at most eight per call), each request its own tensors and answer, with
    # its own number of rows.
    answers: dict[int, dict[str, np.ndarray[Any, Any]]] = {}
    async with trioinfer.open_engine() as engine:
        await load(engine, repository, "add_sub")

        async def one(i: int) -> None:
            answers[i] = await engine.infer("add_sub", pair(i, 1, rows=1 + i % 2))

        with trio.fail_after(WAIT_S):
            async with trio.open_nursery() as nursery:
                for i in range(8):
                    nursery.start_soon(one, i)
    for i, out in answers.items():
        rows = 1 + i % 2
        np.testing.assert_array_equal(out["OUTPUT0"], np.full((rows, 4), i + 1.5, np.float32))
        np.testing.assert_array_equal(out["OUTPUT1"], np.full((rows, 4), i - 1, np.float32))
    assert max(int(out["REQUESTS"].max()) for out in answers.values()) > 1


async def test_an_error_response_fails_its_request_only(repository: Path) -> None:
    results: dict[int, Any] = {}
    async with trioinfer.open_engine() as engine:
        await load(engine, repository, "add_sub")

        async def one(i: int, a: float) -> None:
            try:
                results[i] = await engine.infer("add_sub", pair(a, 1))
            except trioinfer.TrioInferError as exc:
                results[i] = exc

        with trio.fail_after(WAIT_S):
            async with trio.open_nursery() as nursery:
                for i, a in enumerate([1, -1, 2, 5000]):
                    nursery.start_soon(one, i, a)
    assert isinstance(results[1], InvalidInput)
    assert "INPUT0 must not be negative" in str(results[1])
    assert isinstance(results[3], BackendError)
    assert "model 'add_sub': too big" in str(results[3])
    for i, a in ((0, 1), (2, 2)):
        np.testing.assert_array_equal(results[i]["OUTPUT1"], np.full((1, 4), a - 1, np.float32))


async def test_execute_that_raises_or_answers_wrong_fails_the_batch(repository: Path) -> None:
    async with trioinfer.open_engine() as engine:
        await load(engine, repository, "broken")
        x = np.array([[4]], np.int32)
        assert (await engine.infer("broken", {"X": x}))["Y"].tolist() == [[8]]
        with pytest.raises(BackendError, match=r"execute raised TritonModelException: execute br"):
            await engine.infer("broken", {"X": x - 3})
        with pytest.raises(BackendError, match=r"model 'broken': execute returned 0 items for 1"):
            await engine.infer("broken", {"X": x - 2})
        with pytest.raises(BackendError, match=r"execute returned str for 1 requests"):
            await engine.infer("broken", {"X": x - 1})
        # SystemExit is no Exception: it ended the engine (and the server) with it.
        with pytest.raises(BackendError, match=r"execute raised SystemExit: 3 \(model\.py, line"):
            await engine.infer("broken", {"X": x + 1})
        # KeyboardInterrupt alike (a model's own, not the operator's Ctrl+C).
        with pytest.raises(BackendError, match=r"execute raised KeyboardInterrupt: 3 \(model\."):
            await engine.infer("broken", {"X": x + 2})
        assert (await engine.infer("broken", {"X": x}))["Y"].tolist() == [[8]]


async def test_bytes_in_and_out_of_an_unbatched_model(repository: Path) -> None:
    async with trioinfer.open_engine() as engine:
        await load(engine, repository, "upper")
        out = await engine.infer(
            "upper", {"TEXT": np.array([b"ab", "\u00e9t\u00e9"], dtype=object)}, request_id="r1"
        )
    assert out["UPPER"].tolist() == [b"AB", "\u00e9t\u00e9".encode().upper()]
    assert out["LENGTHS"].tolist() == [2, 5]
    assert out["META"].tolist() == ["r1", "{}"]  # (str elements pass as they are)


async def test_a_decoupled_model_streams_what_it_sends(repository: Path) -> None:
    async with trioinfer.open_engine() as engine:
        await load(engine, repository, "repeat")
        got = []
        with trio.fail_after(WAIT_S):
            async with engine.infer_stream("repeat", {"IN": np.array([3, 1, 4], np.int32)}) as s:
                got = [int(out["OUT"][0]) async for out in s]
        assert got == [3, 1, 4]
        with pytest.raises(InvalidInput, match="decoupled"):
            await engine.infer("repeat", {"IN": np.array([1], np.int32)})
        got = []

        async def read() -> None:
            async with engine.infer_stream("repeat", {"IN": np.array([2, -1], np.int32)}) as s:
                async for out in s:
                    got.append(int(out["OUT"][0]))

        with trio.fail_after(WAIT_S), pytest.raises(BackendError, match="negative"):
            await read()
        assert got == [2]


@pytest.mark.parametrize("caller", ["caller", "async_caller"])
async def test_bls_calls_another_model(repository: Path, caller: str) -> None:
    async with trioinfer.open_engine() as engine:
        await load(engine, repository, "add_sub", caller)
        out = await engine.infer(caller, {"X": np.full((1, 4), 2, np.float32)})
        np.testing.assert_array_equal(out["SUM"], np.full((1, 4), 4.5, np.float32))
        with pytest.raises(InvalidInput, match="INPUT0 must not be negative"):
            await engine.infer(caller, {"X": np.full((1, 4), -2, np.float32)})
        with pytest.raises(InvalidInput, match="model 'add_sub' has no output 'NOPE'"):
            await engine.infer(caller, {"X": np.full((1, 4), 7, np.float32)})


def test_what_pb_utils_does_not_provide_is_named() -> None:
    pb_utils = importlib.import_module("trioinfer_python.triton_python_backend_utils")
    with pytest.raises(AttributeError, match=r"load_model is not provided.*from-triton.md"):
        pb_utils.load_model  # noqa: B018  # the attribute access is the test
    with pytest.raises(AttributeError, match=r"Tensor.from_dlpack is not provided"):
        pb_utils.Tensor.from_dlpack  # noqa: B018
    with pytest.raises(AttributeError, match=r"Tensor.to_dlpack is not provided.*from-triton"):
        pb_utils.Tensor("x", [1]).to_dlpack  # noqa: B018
    for decoupled in (False, True):
        with pytest.raises(pb_utils.TritonModelException, match="only in a plain def execute"):
            pb_utils.InferenceRequest(model_name="m").exec(decoupled=decoupled)
    assert pb_utils.triton_string_to_numpy("TYPE_STRING") is np.object_
    assert pb_utils.numpy_to_triton_type(np.float32) == "TYPE_FP32"
    # The import name leads to the module once a Triton model was loaded.
    assert sys.modules.get("triton_python_backend_utils") in (None, pb_utils)


@pytest.mark.parametrize(
    ("pbtxt", "said"),
    [
        (
            'platform: "onnxruntime_onnx"\nmodel_transaction_policy { decoupled: true }\n',
            "model_transaction_policy decoupled: true is for a Triton Python model",
        ),
        (
            BROKEN_PBTXT + "optimization { graph { level: 1 } }\n",
            "optimization is not supported for a Triton Python model",
        ),
        ('backend: "python"\n', "must declare its input and output"),
    ],
)
def test_configs_it_cannot_serve_are_refused(tmp_path: Path, pbtxt: str, said: str) -> None:
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "config.pbtxt").write_text(pbtxt)
    (tmp_path / "m" / "1" / "model.py").write_text(BROKEN)
    with pytest.raises(ConfigError, match=said):
        ModelRepository(tmp_path).entry("m").config(1)


# -- through trioinfer serve, with tritonclient ------------------------------------------


@pytest.fixture(scope="module")
def server(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from test_grpc import run_server

    log = tmp_path_factory.mktemp("log") / "server.log"
    with run_server(repository, log=log) as running:
        yield running
    assert "Traceback" not in running.log_text(), running.log_text()[-4000:]


def _http_pair(a: float, b: float) -> list[httpclient.InferInput]:
    inputs = []
    for name, value in (("INPUT0", a), ("INPUT1", b)):
        tensor = httpclient.InferInput(name, [1, 4], "FP32")
        tensor.set_data_from_numpy(np.full((1, 4), value, np.float32))
        inputs.append(tensor)
    return inputs


def test_tritonclient_http(server: Any) -> None:
    with httpclient.InferenceServerClient(server.url.removeprefix("http://")) as client:
        assert client.is_model_ready("add_sub")
        result = client.infer("add_sub", _http_pair(2, 1), request_id="7")
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.full((1, 4), 3.5))
        assert result.get_response()["id"] == "7"
        with pytest.raises(InferenceServerException, match="INPUT0 must not be negative") as bad:
            client.infer("add_sub", _http_pair(-2, 1))
        assert bad.value.status() == "400"
        config = client.get_model_config("add_sub")
        assert config["backend"] == "python"
        assert config["parameters"]["offset"] == {"string_value": "0.5"}
        text = httpclient.InferInput("TEXT", [2], "BYTES")
        text.set_data_from_numpy(np.array([b"x", b"yz"], dtype=object), binary_data=True)
        result = client.infer("upper", [text])
        assert result.as_numpy("UPPER").tolist() == [b"X", b"YZ"]
        assert result.as_numpy("LENGTHS").tolist() == [1, 2]
        meta = client.get_model_metadata("upper")
        assert [(o["datatype"], o["shape"]) for o in meta["outputs"]] == [
            ("BYTES", [-1]),
            ("INT64", [-1]),
            ("BYTES", [2]),
        ]
        # A Triton ensemble whose step is a Triton Python model.
        words = httpclient.InferInput("WORDS", [1], "BYTES")
        words.set_data_from_numpy(np.array([b"hey"], dtype=object))
        assert client.infer("shout", [words]).as_numpy("SHOUTED").tolist() == [b"HEY"]


def test_http_generate_stream_of_a_decoupled_model(server: Any) -> None:
    with httpx.Client(base_url=server.url, timeout=WAIT_S) as client:
        answer = client.post("/v2/models/repeat/generate_stream", json={"IN": [5, 6]})
    assert answer.status_code == 200, answer.text
    chunks = [c for c in answer.text.split("\n\n") if c]
    assert [json.loads(c.removeprefix("data: "))["OUT"] for c in chunks] == [5, 6]


@pytest.mark.grpc
def test_tritonclient_grpc_infer_and_stream(server: Any) -> None:
    with grpcclient.InferenceServerClient(server.grpc) as client:
        inputs = []
        for name, value in (("INPUT0", 5), ("INPUT1", 1)):
            tensor = grpcclient.InferInput(name, [1, 4], "FP32")
            tensor.set_data_from_numpy(np.full((1, 4), value, np.float32))
            inputs.append(tensor)
        result = client.infer("add_sub", inputs)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), np.full((1, 4), 4))
        answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        try:
            values = grpcclient.InferInput("IN", [3], "INT32")
            values.set_data_from_numpy(np.array([7, 8, 9], np.int32))
            client.async_stream_infer("repeat", [values], request_id="s")
            got = [answers.get(timeout=WAIT_S) for _ in range(3)]
        finally:
            client.stop_stream()
    assert [error for _, error in got] == [None] * 3
    assert [int(result.as_numpy("OUT")[0]) for result, _ in got] == [7, 8, 9]
