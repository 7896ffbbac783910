"""Request parameters (Triton's parameters extension) reach Python models, in process."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import trio
import trio.testing

from trioinfer import ConfigError, InvalidInput, ModelConfig, open_engine
from trioinfer.testing import make_request
from trioinfer.testing.models import write_add

pytestmark = pytest.mark.python_model

Arrays = dict[str, np.ndarray[Any, Any]]

#: One int32 value in, the parameters the model got (as JSON text) out.
ECHO_SIGNATURE = {
    "inputs": [{"name": "x", "dtype": "int32", "shape": [1]}],
    "outputs": [{"name": "p", "dtype": "BYTES", "shape": [1]}],
}
#: The same, with a batch axis: one row per request row.
ROWS_SIGNATURE = {
    "inputs": [{"name": "x", "dtype": "int32", "shape": ["batch", 1]}],
    "outputs": [{"name": "p", "dtype": "BYTES", "shape": ["batch", 1]}],
}


def _text(parameters: object) -> np.ndarray[Any, Any]:
    return np.array([json.dumps(parameters, sort_keys=True)], dtype=object)


class Echo:
    """Answers with the parameters it got; counts its calls."""

    calls = 0

    def infer(self, inputs: Arrays, parameters: dict[str, Any]) -> Arrays:
        type(self).calls += 1
        return {"p": _text(parameters)}


class AsyncEcho:
    async def infer(self, inputs: Arrays, *, parameters: dict[str, Any]) -> Arrays:
        return {"p": _text(parameters)}


@pytest.mark.streaming
@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_parameters_on_trio_and_asyncio(backend: str) -> None:
    import anyio

    stream = ModelConfig(
        name="stream",
        path="-",
        backend="python",
        backend_options={"class": Stream, "decoupled": True, **ECHO_SIGNATURE},
    )

    async def main() -> None:
        async with open_engine() as engine:
            await engine.load(python("echo", Echo))
            await engine.load(stream)
            assert got(await engine.infer("echo", X, parameters={"t": 1})) == {"t": 1}
            async with engine.infer_stream("stream", X, parameters={"t": 2}) as responses:
                assert [got(outputs) async for outputs in responses] == [{"t": 2}]

    anyio.run(main, backend=backend)


class Plain:
    """Takes no parameters: what callers send is not its business."""

    def infer(self, inputs: Arrays) -> Arrays:
        return {"p": _text("plain")}


class Rows:
    """A batched model: one parameters dict per row; records each batch's."""

    batches: ClassVar[list[list[dict[str, Any]]]] = []

    def infer(self, inputs: Arrays, parameters: list[dict[str, Any]]) -> Arrays:
        type(self).batches.append(parameters)
        assert len(parameters) == len(inputs["x"])
        text = [json.dumps(p, sort_keys=True) for p in parameters]
        return {"p": np.array(text, dtype=object).reshape(-1, 1)}


class Stream:
    async def infer(self, inputs: Arrays, parameters: dict[str, Any]) -> Any:
        for _ in range(int(inputs["x"][0])):
            yield {"p": _text(parameters)}


class Caller:
    """Calls echo with parameters of its own, and its callers' (Triton's BLS)."""

    def __init__(self, models: Any) -> None:
        self.models = models

    async def infer(self, inputs: Arrays, parameters: dict[str, Any]) -> Arrays:
        return await self.models.infer("echo", inputs, parameters={**parameters, "via": "bls"})


def python(name: str, cls: type, signature: dict[str, Any] = ECHO_SIGNATURE, **kw: Any) -> Any:
    return ModelConfig(
        name=name, path="-", backend="python", backend_options={"class": cls, **signature}, **kw
    )


def got(outputs: Arrays) -> Any:
    return json.loads(outputs["p"].reshape(-1)[0])


X = {"x": np.array([1], np.int32)}


@pytest.mark.parametrize("cls", [Echo, AsyncEcho])
async def test_a_model_gets_the_parameters_of_its_request(cls: type) -> None:
    async with open_engine() as engine:
        await engine.load(python("echo", cls))
        assert got(await engine.infer("echo", X)) == {}
        given = {"temperature": 0.7, "max_tokens": 16, "greedy": False, "stop": "\n"}
        assert got(await engine.infer("echo", X, parameters=given)) == given
        assert got(await engine.infer("echo", X, parameters={})) == {}
        detailed = await engine.infer_detailed("echo", X, parameters={"k": 1})
        assert got(detailed.outputs) == {"k": 1}


class Keywords:
    """Takes any keyword: gets parameters= as a keyword of its own name would."""

    def infer(self, inputs: Arrays, **kwargs: Any) -> Arrays:
        return {"p": _text(kwargs)}


class KeywordRows:
    def infer(self, inputs: Arrays, **kwargs: Any) -> Arrays:
        return {"p": np.array([[json.dumps(kwargs)]] * len(inputs["x"]), dtype=object)}


async def test_an_infer_with_kwargs_gets_the_parameters() -> None:
    # Only an infer that named `parameters` got them: a **kwargs got nothing.
    async with open_engine() as engine:
        await engine.load(python("kw", Keywords))
        assert got(await engine.infer("kw", X, parameters={"k": 1})) == {"parameters": {"k": 1}}
        assert got(await engine.infer("kw", X)) == {"parameters": {}}
        # Under a batcher that lays out each batch itself, none can be given: it loads,
        # and is called without them, as before (a named `parameters` is refused there).
        padded = python(
            "padded",
            KeywordRows,
            ROWS_SIGNATURE,
            batcher="dynamic",
            batcher_options={"pad_axis": 1, "pad_buckets": [1]},
        )
        await engine.load(padded)
        rows = {"x": np.array([[1]], np.int32)}
        outputs = await engine.infer("padded", rows, parameters={"k": 1})
        assert json.loads(outputs["p"].reshape(-1)[0]) == {}


async def test_a_model_that_takes_no_parameters_is_called_as_before() -> None:
    async with open_engine() as engine:
        await engine.load(python("plain", Plain))
        assert got(await engine.infer("plain", X, parameters={"k": 1})) == "plain"


@pytest.mark.parametrize(
    ("parameters", "said"),
    [
        ({"t": [0.1]}, "parameter 't' must be a bool, int, float or str, got list"),
        ({"t": None}, "parameter 't' must be a bool, int, float or str, got NoneType"),
        ({"t": {"a": 1}}, "parameter 't' must be a bool, int, float or str, got dict"),
        ({1: "a"}, "parameter names must be strings, got 1"),
        ([("t", 1)], "must be a mapping"),
    ],
)
async def test_bad_parameters_are_refused_naming_the_key(parameters: Any, said: str) -> None:
    async with open_engine() as engine:
        await engine.load(python("echo", Echo))
        with pytest.raises(InvalidInput, match=said):
            await engine.infer("echo", X, parameters=parameters)
        with pytest.raises(InvalidInput, match=said):
            await engine.infer_detailed("echo", X, parameters=parameters)
        with pytest.raises(InvalidInput, match=said):
            engine.infer_stream("echo", X, parameters=parameters)


class Changes:
    """Changes the dict it gets: its own copy."""

    def infer(self, inputs: Arrays, parameters: dict[str, Any]) -> Arrays:
        parameters["seen"] = True
        return {"p": _text(parameters)}


async def test_the_models_dict_is_its_own_and_the_requests_mapping_read_only() -> None:
    given = {"k": 1}
    async with open_engine() as engine:
        await engine.load(python("changes", Changes))
        assert got(await engine.infer("changes", X, parameters=given)) == {"k": 1, "seen": True}
        assert got(await engine.infer("changes", X, parameters=given)) == {"k": 1, "seen": True}
    assert given == {"k": 1}
    request = make_request()
    assert dict(request.parameters) == {}
    request = make_request(parameters={"k": 1})
    assert dict(request.parameters) == {"k": 1}
    with pytest.raises(TypeError):
        request.parameters["k"] = 2  # type: ignore[index]
    with pytest.raises(InvalidInput, match="parameter 'k'"):
        make_request(parameters={"k": [1]})  # type: ignore[dict-item]


class ChangesRows:
    """A batched model that marks each row's dict with its row."""

    def infer(self, inputs: Arrays, parameters: list[dict[str, Any]]) -> Arrays:
        for row, given in enumerate(parameters):
            given.setdefault("row", row)
        text = [json.dumps(p, sort_keys=True) for p in parameters]
        return {"p": np.array(text, dtype=object).reshape(-1, 1)}


async def test_each_row_of_a_batched_model_has_its_own_dict() -> None:
    # A request of 3 rows contributes 3 dicts: a change to one is not the others'.
    async with open_engine() as engine:
        await engine.load(python("rows", ChangesRows, ROWS_SIGNATURE))
        x = {"x": np.zeros((3, 1), np.int32)}
        outputs = await engine.infer("rows", x, parameters={"k": 1})
    rows = [json.loads(text) for text in outputs["p"].reshape(-1)]
    assert rows == [{"k": 1, "row": 0}, {"k": 1, "row": 1}, {"k": 1, "row": 2}]


def test_a_requests_parameters_survive_a_copy() -> None:
    # A request sent to another process (the ray backend) keeps them.
    from trioinfer._request import checked_parameters

    parameters = checked_parameters({"k": 1, "s": "x"})
    assert dict(pickle.loads(pickle.dumps(parameters))) == {"k": 1, "s": "x"}


async def test_a_batched_model_gets_one_dict_per_row_and_requests_still_share_a_batch(
    autojump_clock: trio.testing.MockClock,
) -> None:
    Rows.batches = []
    config = python(
        "rows",
        Rows,
        ROWS_SIGNATURE,
        batcher="dynamic",
        batcher_options={"max_batch_size": 8, "max_queue_delay": 0.01},
    )
    answers: dict[int, list[Any]] = {}
    async with open_engine() as engine:
        await engine.load(config)
        Rows.batches = []  # (what a warm-up made)

        async def call(i: int, rows: int) -> None:
            x = np.full((rows, 1), i, np.int32)
            outputs = await engine.infer("rows", {"x": x}, parameters={"i": i} if i else None)
            answers[i] = [json.loads(text) for text in outputs["p"].reshape(-1)]

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call, 1, 2)
            nursery.start_soon(call, 2, 1)
            nursery.start_soon(call, 0, 1)
    assert answers == {1: [{"i": 1}, {"i": 1}], 2: [{"i": 2}], 0: [{}]}
    assert sorted(map(len, Rows.batches)) == [4], Rows.batches  # one batch for all three


@pytest.mark.streaming
async def test_a_stream_carries_its_parameters() -> None:
    config = ModelConfig(
        name="stream",
        path="-",
        backend="python",
        backend_options={"class": Stream, "decoupled": True, **ECHO_SIGNATURE},
    )
    async with open_engine() as engine:
        await engine.load(config)
        x = {"x": np.array([2], np.int32)}
        async with engine.infer_stream("stream", x, parameters={"t": 0.5}) as responses:
            seen = [got(outputs) async for outputs in responses]
        assert seen == [{"t": 0.5}, {"t": 0.5}]
        async with engine.infer_stream("stream", x) as responses:
            assert [got(outputs) async for outputs in responses] == [{}, {}]
        # A model that is not decoupled, through infer_stream: its one answer, with them.
        await engine.load(python("echo", Echo))
        async with engine.infer_stream("echo", X, parameters={"t": 1}) as responses:
            assert [got(outputs) async for outputs in responses] == [{"t": 1}]


@pytest.mark.cache
async def test_the_response_cache_keys_on_parameters() -> None:
    Echo.calls = 0
    async with open_engine(cache_size=1 << 20) as engine:
        await engine.load(python("echo", Echo, response_cache=True))
        cold = Echo.calls
        for _ in range(2):
            assert got(await engine.infer("echo", X, parameters={"temperature": 0.1})) == {
                "temperature": 0.1
            }
            assert got(await engine.infer("echo", X, parameters={"temperature": 0.9})) == {
                "temperature": 0.9
            }
            # A parameter's type counts: 1, 1.0 and True may mean different things.
            assert got(await engine.infer("echo", X, parameters={"t": 1})) == {"t": 1}
            assert got(await engine.infer("echo", X, parameters={"t": True})) == {"t": True}
            assert got(await engine.infer("echo", X)) == {}
        assert Echo.calls - cold == 5  # the second round: all hits


@pytest.mark.pipeline
async def test_a_pipeline_passes_its_requests_parameters_to_each_step() -> None:
    pipeline = ModelConfig(
        name="p",
        path="-",
        backend="pipeline",
        backend_options={
            **ECHO_SIGNATURE,
            "steps": [{"model": "echo", "input_map": {"x": "x"}, "output_map": {"p": "p"}}],
        },
    )
    async with open_engine() as engine:
        await engine.load(python("echo", Echo))
        await engine.load(pipeline)
        assert got(await engine.infer("p", X, parameters={"t": 0.5})) == {"t": 0.5}
        assert got(await engine.infer("p", X)) == {}


def batched_pipeline(step: str) -> ModelConfig:
    """Pipeline "p" of one step, *step* (x -> p), with its own dynamic batcher."""
    return ModelConfig(
        name="p",
        path="-",
        backend="pipeline",
        backend_options={
            **ROWS_SIGNATURE,
            "steps": [{"model": step, "input_map": {"x": "x"}, "output_map": {"p": "p"}}],
        },
        batcher="dynamic",
        batcher_options={"max_batch_size": 8, "max_queue_delay": 0.01},
    )


@pytest.mark.pipeline
async def test_a_batched_pipeline_passes_each_members_parameters(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Members with the same parameters share the steps' requests; those that differ
    # run alone, each with its own.
    pipeline = batched_pipeline("rows")
    answers: dict[int, list[Any]] = {}
    async with open_engine() as engine:
        await engine.load(python("rows", Rows, ROWS_SIGNATURE))
        await engine.load(pipeline)

        async def call(i: int, given: dict[str, Any] | None) -> None:
            outputs = await engine.infer("p", {"x": np.full((1, 1), i, np.int32)}, parameters=given)
            answers[i] = [json.loads(text) for text in outputs["p"].reshape(-1)]

        for same in (True, False):
            Rows.batches = []
            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(call, i, {"k": 1} if same else {"k": i} if i else None)
            if same:
                assert answers == {i: [{"k": 1}] for i in range(3)}
                assert Rows.batches == [[{"k": 1}] * 3]  # one step request for all three
            else:
                assert answers == {0: [{}], 1: [{"k": 1}], 2: [{"k": 2}]}


async def test_a_model_passes_parameters_to_the_models_it_calls() -> None:
    async with open_engine() as engine:
        await engine.load(python("echo", Echo))
        await engine.load(python("caller", Caller))
        assert got(await engine.infer("caller", X, parameters={"t": 2})) == {"t": 2, "via": "bls"}


class StreamCaller:
    """Reads stream's responses, asking with parameters (async def infer)."""

    def __init__(self, models: Any) -> None:
        self.models = models

    async def infer(self, inputs: Arrays) -> Arrays:
        async with self.models.infer_stream("stream", inputs, parameters={"s": 1}) as responses:
            return [outputs async for outputs in responses][-1]  # type: ignore[no-any-return]


class BlockingStreamCaller:
    """The same from a plain def infer, on its worker thread."""

    def __init__(self, models: Any) -> None:
        self.models = models

    def infer(self, inputs: Arrays) -> Arrays:
        with self.models.infer_stream_blocking("stream", inputs, parameters={"b": 1}) as got:
            return list(got)[-1]  # type: ignore[no-any-return]


@pytest.mark.streaming
async def test_a_model_passes_parameters_to_the_streams_it_opens() -> None:
    stream = ModelConfig(
        name="stream",
        path="-",
        backend="python",
        backend_options={"class": Stream, "decoupled": True, **ECHO_SIGNATURE},
    )
    async with open_engine() as engine:
        await engine.load(stream)
        await engine.load(python("async_caller", StreamCaller))
        await engine.load(python("blocking_caller", BlockingStreamCaller))
        assert got(await engine.infer("async_caller", X)) == {"s": 1}
        assert got(await engine.infer("blocking_caller", X)) == {"b": 1}


async def test_onnx_models_ignore_parameters(tmp_path: Path) -> None:
    # As Triton's onnxruntime backend does: the request runs as one without any.
    pytest.importorskip("onnxruntime")
    path = write_add(tmp_path / "add.onnx")
    a = np.ones((1, 4), np.float32)
    async with open_engine() as engine:
        await engine.load(ModelConfig(name="add", path=path))
        out = await engine.infer("add", {"a": a, "b": a}, parameters={"t": 0.5})
    np.testing.assert_array_equal(out["sum"], a * 2)


# -- over HTTP, gRPC and the generate extension -------------------------------------------

ECHO_MODEL = """
import json

import numpy as np


class Model:
    def infer(self, inputs, parameters):
        return {"p": np.array([json.dumps(parameters, sort_keys=True)], dtype=object)}
"""

STREAM_MODEL = """
import json

import numpy as np


class Model:
    async def infer(self, inputs, parameters):
        for _ in range(int(inputs["x"][0])):
            yield {"p": np.array([json.dumps(parameters, sort_keys=True)], dtype=object)}
"""

ECHO_TOML = """
backend = "python"
[backend_options]
decoupled = DECOUPLED
inputs = [{ name = "x", dtype = "int32", shape = [1] }]
outputs = [{ name = "p", dtype = "BYTES", shape = [1] }]
"""

TRITON_PBTXT = """
backend: "python"
max_batch_size: 0
input [ { name: "x" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "p" data_type: TYPE_STRING dims: [ 1 ] } ]
"""

TRITON_MODEL = """
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        answers = []
        for request in requests:
            text = json.dumps(json.loads(request.parameters()), sort_keys=True)
            tensor = pb_utils.Tensor("p", np.array([text], dtype=object))
            answers.append(pb_utils.InferenceResponse(output_tensors=[tensor]))
        return answers
"""


def write_served(root: Path) -> Path:
    for name, code, decoupled in [("echo", ECHO_MODEL, "false"), ("stream", STREAM_MODEL, "true")]:
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").write_text(code)
        (root / name / "config.toml").write_text(ECHO_TOML.replace("DECOUPLED", decoupled))
    (root / "triton" / "1").mkdir(parents=True)
    (root / "triton" / "1" / "model.py").write_text(TRITON_MODEL)
    (root / "triton" / "config.pbtxt").write_text(TRITON_PBTXT)
    return root


def infer_body(parameters: Any) -> dict[str, Any]:
    return {
        "inputs": [{"name": "x", "shape": [1], "datatype": "INT32", "data": [1]}],
        "parameters": parameters,
    }


@pytest.mark.streaming
async def test_http_infer_and_generate_pass_parameters_and_keep_the_reserved_ones(
    tmp_path: Path,
) -> None:
    import httpx

    from _serve import start_serving

    root = write_served(tmp_path / "models")
    # Triton's reserved parameters (and binary_data_output) are the server's: no model
    # sees them; every other one reaches it.
    sent = {
        "t": 0.5,
        "n": 3,
        "s": "x",
        "b": True,
        "priority": 1,
        "timeout": 60_000_000,
        "binary_data_output": False,
        "triton_enable_empty_final_response": True,
    }
    want = {"t": 0.5, "n": 3, "s": "x", "b": True}
    async with trio.open_nursery() as nursery:
        listening = await start_serving(nursery, root)
        async with httpx.AsyncClient(base_url=listening.urls[0]) as client:
            for model in ("echo", "triton"):
                answer = await client.post(f"/v2/models/{model}/infer", json=infer_body(sent))
                assert answer.status_code == 200, answer.text
                (p,) = answer.json()["outputs"][0]["data"]
                assert json.loads(p) == want
            for bad, said in [([1], "got list"), (None, "got NoneType"), ({"a": 1}, "got dict")]:
                answer = await client.post("/v2/models/echo/infer", json=infer_body({"t": bad}))
                assert answer.status_code == 400, answer.text
                assert "request parameter 't' must be a bool, int, float or str" in answer.text
                assert said in answer.text
            # generate: every key that names no input is a parameter (Triton's mapping),
            # and so is each of the "parameters" object's.
            body = {"x": 1, "temperature": 0.7, "max_tokens": 16, "parameters": {"k": "v"}}
            answer = await client.post("/v2/models/echo/generate", json=body)
            assert answer.status_code == 200, answer.text
            assert json.loads(answer.json()["p"]) == {
                "temperature": 0.7,
                "max_tokens": 16,
                "k": "v",
            }
            body = {"x": 2, "temperature": 0.7, "parameters": {"priority": 1}}
            answer = await client.post("/v2/models/stream/generate_stream", json=body)
            assert answer.status_code == 200, answer.text
            events = [
                json.loads(line.removeprefix("data: "))
                for line in answer.text.splitlines()
                if line.startswith("data: ")
            ]
            assert [json.loads(e["p"]) for e in events] == [{"temperature": 0.7}] * 2
            answer = await client.post("/v2/models/echo/generate", json={"x": 1, "t": [1]})
            assert answer.status_code == 400
            assert "parameter 't' must be a string, number or boolean, got a list" in answer.text
            # A misspelt input is a parameter too: the 400 for the input it lacks says so.
            answer = await client.post("/v2/models/echo/generate", json={"X": 1, "t": 2})
            assert answer.status_code == 400
            assert "model 'echo' needs input 'x'" in answer.text
            assert "'X' and 't' name no input: they were taken as parameters" in answer.text
        nursery.cancel_scope.cancel()


@pytest.mark.grpc
@pytest.mark.streaming
async def test_grpc_parameters_reach_the_model(tmp_path: Path) -> None:
    grpcclient = pytest.importorskip("tritonclient.grpc")
    from _serve import start_serving

    root = write_served(tmp_path / "models")
    # (tritonclient itself refuses Triton's reserved names in parameters=; its priority=
    # sends one, which the server keeps.)
    want = {"t": 0.5, "n": 3, "s": "x", "b": True}

    def use(address: str) -> list[Any]:
        import grpc
        from tritonclient.grpc import service_pb2

        answers: list[Any] = []
        with grpcclient.InferenceServerClient(address) as client:
            x = grpcclient.InferInput("x", [1], "INT32")
            x.set_data_from_numpy(np.array([1], np.int32))
            for model in ("echo", "triton"):
                result = client.infer(model, [x], parameters=want, priority=1)
                answers.append(json.loads(result.as_numpy("p")[0]))
        # What tritonclient cannot send: a parameter with no value set.
        with grpc.insecure_channel(address) as channel:
            method = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
            message = service_pb2.ModelInferRequest(model_name="echo")
            message.inputs.add(name="x", datatype="INT32", shape=[1])
            message.raw_input_contents.append(np.array([1], np.int32).tobytes())
            message.parameters["t"].CopyFrom(service_pb2.InferParameter())
            try:
                method(message.SerializeToString(), timeout=30)
            except grpc.RpcError as exc:
                answers.append((exc.code(), exc.details()))
        return answers

    async with trio.open_nursery() as nursery:
        listening = await start_serving(nursery, root, grpc_port=0)
        assert listening.grpc is not None
        answers = await trio.to_thread.run_sync(use, listening.grpc)
        nursery.cancel_scope.cancel()
    import grpc

    assert answers[:2] == [want, want]
    for code, details in answers[2:]:
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "request parameter 't' must be a bool, int, float or str" in details
    assert len(answers) == 3


TRITON_STREAM = """
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            text = json.dumps(json.loads(request.parameters()), sort_keys=True)
            tensor = pb_utils.Tensor("p", np.array([text], dtype=object))
            sender.send(pb_utils.InferenceResponse(output_tensors=[tensor]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

TRITON_CALLER = """
import json

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        answers = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "x")
            given = {**json.loads(request.parameters()), "via": "bls"}
            call = pb_utils.InferenceRequest(
                model_name="triton", requested_output_names=["p"], inputs=[x], parameters=given
            )
            response = call.exec()
            p = pb_utils.get_output_tensor_by_name(response, "p")
            answers.append(pb_utils.InferenceResponse(output_tensors=[p]))
        return answers
"""


@pytest.mark.triton_config
@pytest.mark.streaming
async def test_a_triton_python_model_reads_request_parameters(tmp_path: Path) -> None:
    from trioinfer.server._repository import ModelRepository

    root = write_served(tmp_path / "models")
    for name, code, extra in [
        ("triton_stream", TRITON_STREAM, "model_transaction_policy { decoupled: true }\n"),
        ("triton_caller", TRITON_CALLER, ""),
    ]:
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").write_text(code)
        (root / name / "config.pbtxt").write_text(TRITON_PBTXT + extra)
    repository = ModelRepository(root)
    async with open_engine() as engine:
        for name in ("triton", "triton_stream", "triton_caller"):
            await engine.load(repository.entry(name).config(1))
        assert got(await engine.infer("triton", X, parameters={"t": 0.5})) == {"t": 0.5}
        assert got(await engine.infer("triton", X)) == {}
        async with engine.infer_stream("triton_stream", X, parameters={"t": 1}) as responses:
            assert [got(outputs) async for outputs in responses] == [{"t": 1}]
        answer = await engine.infer("triton_caller", X, parameters={"t": 2})
        assert got(answer) == {"t": 2, "via": "bls"}


# -- batchers that lay out the batch themselves -------------------------------------------


class Stateful:
    def infer(self, inputs: Arrays, parameters: list[dict[str, Any]]) -> Arrays:
        total = inputs["STATE_IN"] * (1 - inputs["START"]) + inputs["INPUT"]
        return {"OUTPUT": total, "STATE_OUT": total}


@pytest.mark.sequence
async def test_a_stateful_model_whose_infer_takes_parameters_is_refused_saying_why() -> None:
    # The sequence batcher lays out each batch (rows by slot, control and state tensors):
    # no row can be told whose, so the load says so, rather than the engine's
    # "its 'python' instances take each request's own inputs".
    from test_sequence import state_config

    async with open_engine() as engine:
        with pytest.raises(ConfigError, match="model 'acc': its infer takes parameters") as info:
            await engine.load(state_config(Stateful))
        assert "the sequence batcher of a stateful model" in str(info.value)
        assert "drop the parameters keyword" in str(info.value)
        padded = python(
            "padded",
            Rows,
            ROWS_SIGNATURE,
            batcher="dynamic",
            batcher_options={"pad_axis": 1, "pad_buckets": [1]},
        )
        with pytest.raises(ConfigError, match="the dynamic batcher with pad_axis"):
            await engine.load(padded)


class SlowRows:
    """A batched step that takes a second per execution; records each batch's parameters."""

    batches: ClassVar[list[list[dict[str, Any]]]] = []

    async def infer(self, inputs: Arrays, parameters: list[dict[str, Any]]) -> Arrays:
        type(self).batches.append(parameters)
        await trio.sleep(1)
        text = [json.dumps(p, sort_keys=True) for p in parameters]
        return {"p": np.array(text, dtype=object).reshape(-1, 1)}


@pytest.mark.pipeline
async def test_a_batched_pipelines_members_with_different_parameters_run_side_by_side(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Members whose parameters differ each take the steps with their own, side by side
    # (the step model's batcher joins them again): not one after the other, each
    # waiting for the others' whole way through the pipeline.
    pipeline = batched_pipeline("slow")
    batching = {"max_batch_size": 8, "max_queue_delay": 0.01}
    answered: dict[int, tuple[float, list[Any]]] = {}
    async with open_engine() as engine:
        await engine.load(
            python("slow", SlowRows, ROWS_SIGNATURE, batcher="dynamic", batcher_options=batching)
        )
        await engine.load(pipeline)
        start = trio.current_time()

        async def call(i: int) -> None:
            x = {"x": np.full((1, 1), i, np.int32)}
            outputs = await engine.infer("p", x, parameters={"k": i})
            text = [json.loads(t) for t in outputs["p"].reshape(-1)]
            answered[i] = (trio.current_time() - start, text)

        SlowRows.batches = []
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(call, i)
        assert {i: text for i, (_, text) in answered.items()} == {i: [{"k": i}] for i in range(3)}
        assert max(took for took, _ in answered.values()) < 2  # one step execution, not three
        assert sorted(map(len, SlowRows.batches)) == [3]
        # A caller that leaves ends its own run; the others are answered, each once.
        answered.clear()
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            leaving = trio.CancelScope()

            async def leaves() -> None:
                with leaving:
                    await call(1)

            nursery.start_soon(call, 0)
            nursery.start_soon(leaves)
            nursery.start_soon(call, 2)
            await trio.sleep(0.5)
            leaving.cancel()
        assert {i: text for i, (_, text) in answered.items()} == {0: [{"k": 0}], 2: [{"k": 2}]}
        assert max(took for took, _ in answered.values()) < 2


TRITON_BAD_CALLER = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        answers = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "x")
            call = pb_utils.InferenceRequest(
                model_name="triton", requested_output_names=["p"], inputs=[x], parameters="t=1"
            )
            response = call.exec()
            assert response.has_error()
            answers.append(pb_utils.InferenceResponse(error=response.error()))
        return answers
"""


@pytest.mark.triton_config
async def test_a_triton_bls_request_whose_parameters_text_is_not_json_gets_an_error_response(
    tmp_path: Path,
) -> None:
    # As one whose parameters the engine refuses: the model reads the error, not a
    # JSONDecodeError out of exec() that fails its whole execute.
    from trioinfer.server._repository import ModelRepository

    root = tmp_path / "models"
    for name, code in [("triton", TRITON_MODEL), ("caller", TRITON_BAD_CALLER)]:
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").write_text(code)
        (root / name / "config.pbtxt").write_text(TRITON_PBTXT)
    repository = ModelRepository(root)
    async with open_engine() as engine:
        for name in ("triton", "caller"):
            await engine.load(repository.entry(name).config(1))
        with pytest.raises(InvalidInput, match=r"parameters='t=1'\): the parameters text is not"):
            await engine.infer("caller", X)
