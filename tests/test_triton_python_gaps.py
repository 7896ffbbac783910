"""What a Triton Python model reads of its request, as Triton's python backend gives it.

Each seen by ``tritonclient`` (HTTP and gRPC) against a real ``trioinfer
serve``, for a model's executes and a decoupled model's streams alike:
``request_id()`` is the client's id (``""`` when it sent none);
``requested_output_names()`` the outputs it asked for (all when it named none),
and a response may hold those alone; ``InferenceResponse(parameters=...)``
reaches the client as the response's parameters.
"""

from __future__ import annotations

import json
import queue
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import trio
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

import trioinfer
from trioinfer.server._repository import ModelRepository

pytestmark = [pytest.mark.python_model, pytest.mark.triton_config]

#: Bounds against hangs only.
WAIT_S = 60.0

IDENT_PBTXT = """\
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "ID" data_type: TYPE_STRING dims: [ 1 ] } ]
"""

# What the model was told of its request: its request_id().
IDENT = """\
import numpy as np
import triton_python_backend_utils as pb_utils


def answer(request):
    said = np.array([request.request_id().encode()], dtype=np.object_)
    return pb_utils.InferenceResponse([pb_utils.Tensor("ID", said)])


class TritonPythonModel:
    def execute(self, requests):
        return [answer(request) for request in requests]
"""

IDENT_STREAM_PBTXT = IDENT_PBTXT + "model_transaction_policy { decoupled: true }\n"

# The same, sent through a decoupled model's response sender.
IDENT_STREAM = (
    IDENT.removesuffix("        return [answer(request) for request in requests]\n")
    + """\
        for request in requests:
            sender = request.get_response_sender()
            sender.send(answer(request), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""
)

PICKY_PBTXT = """\
backend: "python"
max_batch_size: 8
dynamic_batching { }
input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [
  { name: "A" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "B" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "ASKED" data_type: TYPE_STRING dims: [ 1 ] }
]
"""

# Computes only what the request asked for, and says what that was (ASKED, always sent).
PICKY = """\
import numpy as np
import triton_python_backend_utils as pb_utils


def answer(request):
    x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
    asked = request.requested_output_names()
    said = ",".join(asked).encode()
    tensors = [pb_utils.Tensor("ASKED", np.full(x.shape, said, dtype=np.object_))]
    if "A" in asked:
        tensors.append(pb_utils.Tensor("A", x + 1))
    if "B" in asked:
        tensors.append(pb_utils.Tensor("B", x + 2))
    return pb_utils.InferenceResponse(tensors)


class TritonPythonModel:
    def execute(self, requests):
        return [answer(request) for request in requests]
"""

PICKY_STREAM_PBTXT = (
    PICKY_PBTXT.replace("max_batch_size: 8", "max_batch_size: 0").replace(
        "dynamic_batching { }\n", ""
    )
    + "model_transaction_policy { decoupled: true }\n"
)

PICKY_STREAM = (
    PICKY.removesuffix("        return [answer(request) for request in requests]\n")
    + """\
        for request in requests:
            sender = request.get_response_sender()
            sender.send(answer(request), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""
)

TAGGED_PBTXT = """\
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

# Response parameters of each type Triton takes; X < 0 gives one it refuses (a float).
TAGGED = """\
import triton_python_backend_utils as pb_utils


def answer(request, index=0):
    x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
    given = {"index": index, "even": bool(x[0] % 2 == 0), "word": "w" + str(int(x[0]))}
    if x[0] < 0:
        given["ratio"] = 0.5
    return pb_utils.InferenceResponse([pb_utils.Tensor("Y", x + index)], parameters=given)


class TritonPythonModel:
    def execute(self, requests):
        return [answer(request) for request in requests]
"""

TAGGED_STREAM_PBTXT = TAGGED_PBTXT + "model_transaction_policy { decoupled: true }\n"

TAGGED_STREAM = (
    TAGGED.removesuffix("        return [answer(request) for request in requests]\n")
    + """\
        for request in requests:
            sender = request.get_response_sender()
            sender.send(answer(request, 1))
            sender.send(answer(request, 2), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""
)

SUMMER_PBTXT = """\
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [
  { name: "SUM" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] }
]
"""

# Sums the responses of tagged_stream (X+1, X+2) got with exec(decoupled=True); X < 0
# calls a model that is not there (the error is the iterator's one response).
SUMMER = """\
import numpy as np
import triton_python_backend_utils as pb_utils


def call(request):
    x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
    model = "tagged_stream" if x[0] >= 0 else "missing"
    return pb_utils.InferenceRequest(
        model_name=model, requested_output_names=["Y"], inputs=[pb_utils.Tensor("X", x)]
    )


def total(responses):
    got = []
    for response in responses:
        if response.has_error():
            return pb_utils.InferenceResponse(error=response.error())
        got.append(pb_utils.get_output_tensor_by_name(response, "Y").as_numpy()[0])
    return pb_utils.InferenceResponse([
        pb_utils.Tensor("SUM", np.array([sum(got)], np.int32)),
        pb_utils.Tensor("COUNT", np.array([len(got)], np.int32)),
    ])


class TritonPythonModel:
    def execute(self, requests):
        return [total(call(request).exec(decoupled=True)) for request in requests]
"""

ASYNC_SUMMER = SUMMER.replace(
    """    def execute(self, requests):
        return [total(call(request).exec(decoupled=True)) for request in requests]""",
    """    async def execute(self, requests):
        return [total(await call(r).async_exec(decoupled=True)) for r in requests]""",
)

PICKY_CACHED_PBTXT = PICKY_PBTXT + "response_cache { enable: true }\n"

MODELS = {
    "ident": (IDENT_PBTXT, IDENT),
    "ident_stream": (IDENT_STREAM_PBTXT, IDENT_STREAM),
    "picky": (PICKY_PBTXT, PICKY),
    "picky_stream": (PICKY_STREAM_PBTXT, PICKY_STREAM),
    "tagged": (TAGGED_PBTXT, TAGGED),
    "tagged_stream": (TAGGED_STREAM_PBTXT, TAGGED_STREAM),
    "summer": (SUMMER_PBTXT, SUMMER),
    "async_summer": (SUMMER_PBTXT, ASYNC_SUMMER),
}


def write_models(root: Path, models: dict[str, tuple[str, str]]) -> Path:
    for name, (pbtxt, code) in models.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(pbtxt)
        (root / name / "1" / "model.py").write_text(code)
    return root


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_models(tmp_path_factory.mktemp("triton_gaps") / "models", MODELS)


@pytest.fixture(scope="module")
def server(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from test_grpc import run_server

    log = tmp_path_factory.mktemp("log") / "server.log"
    with run_server(repository, log=log) as running:
        yield running
    assert "Traceback" not in running.log_text(), running.log_text()[-4000:]


def _said(result: Any, name: str = "ID") -> list[bytes]:
    return [bytes(v) for v in result.as_numpy(name).reshape(-1).tolist()]


# -- request_id() ------------------------------------------------------------------------


async def test_request_id_is_the_callers_or_empty_through_the_engine(repository: Path) -> None:
    repo = ModelRepository(repository)
    async with trioinfer.open_engine() as engine:
        for name in ("ident", "ident_stream"):
            await engine.load(repo.entry(name).config(1))
        x = {"X": np.array([1], np.int32)}
        with trio.fail_after(WAIT_S):
            assert (await engine.infer("ident", x, request_id="42"))["ID"].tolist() == [b"42"]
            # No id: the engine makes one for its logs, the model is told none (Triton's "").
            assert (await engine.infer("ident", x))["ID"].tolist() == [b""]
            for given, said in (("s-1", b"s-1"), (None, b"")):
                async with engine.infer_stream("ident_stream", x, request_id=given) as stream:
                    assert [o["ID"].tolist() async for o in stream] == [[said]]


def test_http_request_id_reaches_the_model(server: Any) -> None:
    with httpclient.InferenceServerClient(server.url.removeprefix("http://")) as client:
        x = httpclient.InferInput("X", [1], "INT32")
        x.set_data_from_numpy(np.array([1], np.int32))
        assert _said(client.infer("ident", [x], request_id="7")) == [b"7"]
        assert _said(client.infer("ident", [x])) == [b""]


@pytest.mark.grpc
def test_grpc_request_id_reaches_the_model_and_its_stream(server: Any) -> None:
    with grpcclient.InferenceServerClient(server.grpc) as client:
        x = grpcclient.InferInput("X", [1], "INT32")
        x.set_data_from_numpy(np.array([1], np.int32))
        assert _said(client.infer("ident", [x], request_id="g1")) == [b"g1"]
        assert _said(client.infer("ident", [x])) == [b""]
        answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        try:
            client.async_stream_infer("ident_stream", [x], request_id="g2")
            first = answers.get(timeout=WAIT_S)
            client.async_stream_infer("ident_stream", [x])
            second = answers.get(timeout=WAIT_S)
        finally:
            client.stop_stream()
    assert (first[1], second[1]) == (None, None)
    assert (_said(first[0]), _said(second[0])) == ([b"g2"], [b""])


# -- requested_output_names() ------------------------------------------------------------


async def test_requested_outputs_through_the_engine(repository: Path) -> None:
    repo = ModelRepository(repository)
    async with trioinfer.open_engine() as engine:
        for name in ("picky", "picky_stream"):
            await engine.load(repo.entry(name).config(1))
        x = {"X": np.array([[1], [2]], np.int32)}
        with trio.fail_after(WAIT_S):
            out = await engine.infer("picky", x, outputs=["B", "ASKED"])
            assert sorted(out) == ["ASKED", "B"]
            assert out["ASKED"].tolist() == [[b"B,ASKED"]] * 2
            assert out["B"].tolist() == [[3], [4]]
            # None named: every output, in the model's order.
            out = await engine.infer("picky", x)
            assert out["ASKED"].tolist() == [[b"A,B,ASKED"]] * 2
            assert (await engine.infer_detailed("picky", x, outputs=["A"])).outputs.keys() == {"A"}
            with pytest.raises(trioinfer.InvalidInput, match="has no output 'C'"):
                await engine.infer("picky", x, outputs=["A", "C"])
            one = {"X": np.array([1], np.int32)}
            async with engine.infer_stream("picky_stream", one, outputs=["A"]) as stream:
                assert [dict(o) async for o in stream] == [{"A": np.array([2], np.int32)}]


async def test_requested_outputs_of_a_request_run_in_its_callers_task(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An idle model whose instance runs on the loop answers in its caller's task, with
    # no request object (what the HTTP server calls for each request): a request that
    # names its outputs keeps that way, its answer narrowed there, a name it lacks refused.
    model = trioinfer.example_repository() / "digits" / "1" / "model.onnx"
    async with trioinfer.open_engine() as engine:
        # The largest inline budget: on a busy machine a run past the default (250 us)
        # would move the instance to its worker thread, and the requests to the queue.
        options = {"dispatch": "inline", "inline_budget_us": 10_000_000}
        await engine.load(trioinfer.ModelConfig(name="digits", path=model, backend_options=options))
        x = {"input": trioinfer.digits_samples()[0][:2]}

        async def queued(*args: object, **kwargs: object) -> None:
            raise AssertionError("the request was queued, not run in its caller's task")

        monkeypatch.setattr(type(engine), "_submit", queued)
        with trio.fail_after(WAIT_S):
            result = await engine.infer_detailed("digits", x, outputs=["label"])
            assert result.outputs.keys() == {"label"}
            assert result.outputs["label"].shape == (2,)
            both = await engine.infer_detailed("digits", x, outputs=["label", "probabilities"])
            assert both.outputs.keys() == {"label", "probabilities"}
            with pytest.raises(trioinfer.InvalidInput, match="has no output 'nope'"):
                await engine.infer_detailed("digits", x, outputs=["nope"])


async def test_the_requested_outputs_are_part_of_the_cache_key(tmp_path: Path) -> None:
    # The model answers the requested outputs alone: an answer cached for a request
    # that asked for some is no answer to one that asked for others, or for all.
    repo = ModelRepository(write_models(tmp_path, {"picky_cached": (PICKY_CACHED_PBTXT, PICKY)}))
    async with trioinfer.open_engine(cache_size=1 << 20) as engine:
        await engine.load(repo.entry("picky_cached").config(1))
        x = {"X": np.array([[1]], np.int32)}
        with trio.fail_after(WAIT_S):
            assert (await engine.infer("picky_cached", x, outputs=["A"])).keys() == {"A"}
            assert (await engine.infer("picky_cached", x, outputs=["B"]))["B"].tolist() == [[3]]
            out = await engine.infer("picky_cached", x)
            assert out["ASKED"].tolist() == [[b"A,B,ASKED"]]
            again = await engine.infer("picky_cached", x, outputs=["A"])
        assert again["A"].tolist() == [[2]]
        stats = engine.statistics().models["picky_cached"].cache
        assert stats is not None
        assert (stats.hits, stats.misses) == (1, 3)


def test_http_requested_outputs_reach_the_model(server: Any) -> None:
    with httpclient.InferenceServerClient(server.url.removeprefix("http://")) as client:
        x = httpclient.InferInput("X", [1, 1], "INT32")
        x.set_data_from_numpy(np.array([[5]], np.int32))
        asked = [httpclient.InferRequestedOutput(n) for n in ("A", "ASKED")]
        result = client.infer("picky", [x], outputs=asked)
        assert result.as_numpy("A").tolist() == [[6]]
        assert result.as_numpy("B") is None
        assert _said(result, "ASKED") == [b"A,ASKED"]
        assert _said(client.infer("picky", [x]), "ASKED") == [b"A,B,ASKED"]


@pytest.mark.grpc
def test_grpc_requested_outputs_reach_the_model_and_its_stream(server: Any) -> None:
    with grpcclient.InferenceServerClient(server.grpc) as client:
        x = grpcclient.InferInput("X", [1, 1], "INT32")
        x.set_data_from_numpy(np.array([[5]], np.int32))
        result = client.infer("picky", [x], outputs=[grpcclient.InferRequestedOutput("ASKED")])
        assert _said(result, "ASKED") == [b"ASKED"]
        assert result.as_numpy("A") is None
        answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        try:
            one = grpcclient.InferInput("X", [1], "INT32")
            one.set_data_from_numpy(np.array([5], np.int32))
            asked = [grpcclient.InferRequestedOutput(n) for n in ("B", "ASKED")]
            client.async_stream_infer("picky_stream", [one], outputs=asked)
            got, error = answers.get(timeout=WAIT_S)
        finally:
            client.stop_stream()
    assert error is None, error.message()
    assert _said(got, "ASKED") == [b"B,ASKED"]
    assert got.as_numpy("B").tolist() == [7]
    assert got.as_numpy("A") is None


# -- response parameters -----------------------------------------------------------------


async def test_response_parameters_through_the_engine(repository: Path) -> None:
    repo = ModelRepository(repository)
    async with trioinfer.open_engine() as engine:
        for name in ("tagged", "tagged_stream"):
            await engine.load(repo.entry(name).config(1))
        with trio.fail_after(WAIT_S):
            result = await engine.infer_detailed("tagged", {"X": np.array([4], np.int32)})
            assert dict(result.parameters) == {"index": 0, "even": True, "word": "w4"}
            # A float is refused where the response is made, as Triton refuses it.
            with pytest.raises(trioinfer.BackendError, match="'ratio' must be a bool, int or str"):
                await engine.infer("tagged", {"X": np.array([-1], np.int32)})
            x = {"X": np.array([3], np.int32)}
            async with engine.infer_stream("tagged_stream", x) as stream:
                said = [(o["Y"].tolist(), dict(stream.parameters)) async for o in stream]
            assert said == [
                ([4], {"index": 1, "even": False, "word": "w3"}),
                ([5], {"index": 2, "even": False, "word": "w3"}),
            ]
            # A model that is not decoupled, streamed: its one response's.
            async with engine.infer_stream("tagged", x) as stream:
                assert [dict(stream.parameters) async for _ in stream] == [
                    {"index": 0, "even": False, "word": "w3"}
                ]


async def test_an_answer_with_response_parameters_is_not_cached(tmp_path: Path) -> None:
    # The cache keeps outputs: an answer carrying parameters is computed each time.
    pbtxt = TAGGED_PBTXT + "response_cache { enable: true }\n"
    repo = ModelRepository(write_models(tmp_path, {"tagged_cached": (pbtxt, TAGGED)}))
    async with trioinfer.open_engine(cache_size=1 << 20) as engine:
        await engine.load(repo.entry("tagged_cached").config(1))
        x = {"X": np.array([4], np.int32)}
        with trio.fail_after(WAIT_S):
            for _ in range(2):
                result = await engine.infer_detailed("tagged_cached", x)
                assert result.parameters["word"] == "w4"
        stats = engine.statistics().models["tagged_cached"].cache
        assert stats is not None
        assert (stats.hits, stats.misses) == (0, 2)


def test_http_response_parameters(server: Any) -> None:
    with httpclient.InferenceServerClient(server.url.removeprefix("http://")) as client:
        x = httpclient.InferInput("X", [1], "INT32")
        x.set_data_from_numpy(np.array([6], np.int32))
        result = client.infer("tagged", [x])
        assert result.get_response()["parameters"] == {"index": 0, "even": True, "word": "w6"}
    with httpx.Client(base_url=server.url, timeout=WAIT_S) as http:
        answer = http.post("/v2/models/tagged_stream/generate_stream", json={"X": 7})
        assert answer.status_code == 200, answer.text
        events = [json.loads(c.removeprefix("data: ")) for c in answer.text.split("\n\n") if c]
        assert [(e["Y"], e["index"], e["word"]) for e in events] == [(8, 1, "w7"), (9, 2, "w7")]
        answer = http.post("/v2/models/tagged/generate", json={"X": 2})
        assert answer.status_code == 200, answer.text
        assert answer.json() == {
            "model_name": "tagged",
            "model_version": "1",
            "Y": 2,
            "index": 0,
            "even": True,
            "word": "w2",
        }


@pytest.mark.grpc
def test_grpc_response_parameters_of_infer_and_stream(server: Any) -> None:
    def plain(parameters: Any) -> dict[str, Any]:
        return {
            key: getattr(value, value.WhichOneof("parameter_choice"))
            for key, value in parameters.items()
        }

    with grpcclient.InferenceServerClient(server.grpc) as client:
        x = grpcclient.InferInput("X", [1], "INT32")
        x.set_data_from_numpy(np.array([6], np.int32))
        result = client.infer("tagged", [x])
        assert plain(result.get_response().parameters) == {"index": 0, "even": True, "word": "w6"}
        answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        try:
            client.async_stream_infer("tagged_stream", [x])
            got = [answers.get(timeout=WAIT_S) for _ in range(2)]
        finally:
            client.stop_stream()
    assert [error for _, error in got] == [None, None]
    assert [plain(r.get_response().parameters)["index"] for r, _ in got] == [1, 2]


# -- BLS of a decoupled model: exec(decoupled=True) ------------------------------------------


@pytest.mark.parametrize("name", ["summer", "async_summer"])
async def test_bls_exec_decoupled_iterates_the_responses(repository: Path, name: str) -> None:
    repo = ModelRepository(repository)
    async with trioinfer.open_engine() as engine:
        for model in ("tagged_stream", name):
            await engine.load(repo.entry(model).config(1))
        with trio.fail_after(WAIT_S):
            out = await engine.infer(name, {"X": np.array([10], np.int32)})
            assert (out["SUM"].tolist(), out["COUNT"].tolist()) == ([23], [2])
            # The other model's failure is a response carrying it, as Triton's.
            with pytest.raises(trioinfer.BackendError, match="'missing'"):
                await engine.infer(name, {"X": np.array([-1], np.int32)})


def test_http_bls_exec_decoupled(server: Any) -> None:
    with httpclient.InferenceServerClient(server.url.removeprefix("http://")) as client:
        x = httpclient.InferInput("X", [1], "INT32")
        x.set_data_from_numpy(np.array([1], np.int32))
        for name in ("summer", "async_summer"):
            result = client.infer(name, [x])
            assert (result.as_numpy("SUM").tolist(), result.as_numpy("COUNT").tolist()) == (
                [5],
                [2],
            )
