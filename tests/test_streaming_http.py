"""Triton's generate extension over HTTP: ``/generate`` and ``/generate_stream`` (SSE)."""

from __future__ import annotations

import json
import shutil
import sys
import time
import types
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import trio

import trioinfer
from _serve import start_serving
from trioinfer import _stream as stream_module
from trioinfer.server import ServerConfig

pytestmark = pytest.mark.streaming

PROBE = "trioinfer_test_streaming_probe"

SIGNATURE = """
inputs = [{ name = "n", dtype = "int32", shape = [1] }]
outputs = [{ name = "i", dtype = "int32", shape = [1] }]
"""

# A model that yields *n* responses, or fails after two, and then holds on (never
# answering more) until the test lets it go: the test can tell whether it went on.
WATCHED = """
import sys

import anyio
import numpy as np

probe = sys.modules["PROBE"]


class Model:
    async def infer(self, inputs):
        try:
            for i in range(int(inputs["n"][0])):
                if i == 2 and probe.fail:
                    raise ValueError("the model broke after two")
                if i == 3:
                    probe.holding.set()
                    await probe.go_on.wait()
                probe.made += 1
                yield {"i": np.array([i], np.int32)}
        except BaseException as exc:
            probe.ended = type(exc).__name__
            raise
        finally:
            probe.closed.set()
""".replace("PROBE", PROBE)

# A model whose run of responses is read as its request's timeout (1 s) passes: the
# first leaves alone, then three are made at once and the loop is held past the timeout
# before any pass of it (the reader wakes with the first of them, the others at hand).
LATE_RUN = """
import time

import anyio
import numpy as np


class Model:
    async def infer(self, inputs):
        yield {"i": np.array([0], np.int32)}
        await anyio.sleep(0.05)
        for i in (1, 2, 3):
            yield {"i": np.array([i], np.int32)}
        time.sleep(1.2)
        await anyio.sleep_forever()
"""

# A model that makes three responses at once (one run, read in one go), then holds on.
RUN_OF_THREE = """
import anyio
import numpy as np


class Model:
    async def infer(self, inputs):
        for i in range(3):
            yield {"i": np.array([i], np.int32)}
        await anyio.sleep_forever()
"""

PLAIN = """
class Model:
    async def infer(self, inputs):
        return {"i": inputs["n"] * 2}
"""


def probe() -> types.SimpleNamespace:
    return types.SimpleNamespace(
        made=0,
        ended=None,
        fail=False,
        holding=anyio.Event(),
        go_on=anyio.Event(),
        closed=anyio.Event(),
    )


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    shutil.copytree(trioinfer.example_repository() / "repeat_int32", root / "repeat_int32")
    for name, code, decoupled in [
        ("watched", WATCHED, "true"),
        ("late_run", LATE_RUN, "true"),
        ("run_of_three", RUN_OF_THREE, "true"),
        ("plain", PLAIN, "false"),
    ]:
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.py").write_text(code)
        (root / name / "config.toml").write_text(
            f'backend = "python"\n[backend_options]\ndecoupled = {decoupled}\n{SIGNATURE}'
        )
    return root


@asynccontextmanager
async def serving(root: Path) -> AsyncIterator[httpx.AsyncClient]:
    async with trio.open_nursery() as nursery:
        listening = await start_serving(nursery, root)
        async with httpx.AsyncClient(base_url=listening.urls[0]) as client:
            yield client
        nursery.cancel_scope.cancel()


def sse_data(raw: bytes) -> list[Any]:
    """The JSON of each ``data:`` event of a raw chunked SSE response (head optional).

    The server writes the events a model made together in one chunk: chunks are
    undone first, then the events split at their blank lines, as a client does.
    """
    rest = raw.partition(b"\r\n\r\n")[2] if raw.startswith(b"HTTP/") else raw
    body = bytearray()
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if not size:
            break
        body += rest[:size]
        rest = rest[size + 2 :]
    events = bytes(body).split(b"\n\n")
    return [json.loads(event[6:]) for event in events if event.startswith(b"data: ")]


async def test_a_streaming_models_config_loads_back(repository: Path) -> None:
    # GET .../config answers model_transaction_policy for a streaming model; sent back in
    # a load override (as Triton's clients do), it is checked against the model, not refused
    # as a key config.toml does not have.
    async with serving(repository) as client:
        for model in ("repeat_int32", "plain"):
            answered = (await client.get(f"/v2/models/{model}/config")).json()
            override = dict(answered)
            override.setdefault("model_transaction_policy", {"decoupled": False})
            loaded = await client.post(
                f"/v2/repository/models/{model}/load",
                json={"parameters": {"config": json.dumps(override)}},
            )
            assert loaded.status_code == 200, loaded.text
            assert (await client.get(f"/v2/models/{model}/config")).json() == answered
        wrong = await client.post(
            "/v2/repository/models/plain/load",
            json={
                "parameters": {
                    "config": json.dumps({"model_transaction_policy": {"decoupled": True}})
                }
            },
        )
        bad = await client.post(
            "/v2/repository/models/plain/load",
            json={"parameters": {"config": json.dumps({"model_transaction_policy": True})}},
        )
    assert wrong.status_code == 400
    assert (
        "says model_transaction_policy decoupled: true, but the model does not stream"
        in (wrong.json()["error"])
    )
    assert bad.status_code == 400
    assert 'model_transaction_policy must be {"decoupled": true}' in bad.json()["error"]


def events(text: str) -> list[Any]:
    """The JSON of each server-sent event in *text*, checking the framing."""
    assert text.endswith("\n\n")
    chunks = text[:-2].split("\n\n")
    assert all(chunk.startswith("data: ") and "\n" not in chunk for chunk in chunks)
    return [json.loads(chunk[len("data: ") :]) for chunk in chunks]


REPEAT = {"IN": [4, 2, 0, 1], "DELAY": [1, 2, 3, 4], "WAIT": 5}


async def test_generate_stream_sends_one_event_per_response(repository: Path) -> None:
    async with serving(repository) as client:
        answer = await client.post("/v2/models/repeat_int32/generate_stream", json=REPEAT)
        versioned = await client.post(
            "/v2/models/repeat_int32/versions/1/generate_stream",
            json={"IN": [], "DELAY": [], "WAIT": 0},
        )
        metadata = (await client.get("/v2")).json()
        config = (await client.get("/v2/models/repeat_int32/config")).json()
        plain = (await client.get("/v2/models/plain/config")).json()
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert answer.headers["transfer-encoding"] == "chunked"
    assert events(answer.text) == [
        {"model_name": "repeat_int32", "model_version": "1", "OUT": out, "IDX": idx}
        for idx, out in enumerate([4, 2, 0, 1])
    ]
    assert (versioned.status_code, versioned.text) == (200, "")  # no response at all
    assert "generate" in metadata["extensions"]
    assert config["model_transaction_policy"] == {"decoupled": True}  # as Triton says it
    assert "model_transaction_policy" not in plain


async def test_generate_answers_exactly_one_response(repository: Path) -> None:
    async with serving(repository) as client:
        one = await client.post(
            "/v2/models/repeat_int32/generate", json={"IN": [7], "DELAY": [0], "WAIT": [0]}
        )
        many = await client.post("/v2/models/repeat_int32/generate", json=REPEAT)
        none = await client.post(
            "/v2/models/repeat_int32/generate", json={"IN": [], "DELAY": [], "WAIT": 0}
        )
        plain = await client.post("/v2/models/plain/generate", json={"n": 21})
        plain_stream = await client.post("/v2/models/plain/generate_stream", json={"n": 4})
    assert (one.status_code, one.headers["content-type"]) == (200, "application/json")
    assert one.json() == {"model_name": "repeat_int32", "model_version": "1", "OUT": 7, "IDX": 0}
    assert many.status_code == 400
    assert "sent more than one response" in many.json()["error"]
    assert none.status_code == 400
    assert "sent no response" in none.json()["error"]
    assert plain.json() == {"model_name": "plain", "model_version": "1", "i": 42}
    assert events(plain_stream.text) == [{"model_name": "plain", "model_version": "1", "i": 8}]


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        ("nope/generate_stream", {}, 404, "Request for unknown model: 'nope' is not served"),
        ("repeat_int32/generate_stream", [1], 400, "must be a JSON object of inputs"),
        # A key that names no input is a parameter (Triton's mapping): a scalar.
        ("repeat_int32/generate_stream", {"IN": [1], "X": [1]}, 400, "parameter 'X' must be"),
        ("repeat_int32/generate_stream", {"IN": [1], "X": None}, 400, "got null"),
        ("repeat_int32/generate", {"IN": [1], "parameters": {"t": {}}}, 400, "'t' must be"),
        ("repeat_int32/generate_stream", {"IN": [1.5]}, 400, "cannot hold JSON values like 1.5"),
        # The value as the client wrote it, in JSON: not numpy's repr (np.str_('a')) nor
        # Python's ('a', True).
        ("repeat_int32/generate_stream", {"IN": ["a"]}, 400, 'JSON values like "a"'),
        ("repeat_int32/generate_stream", {"IN": [True]}, 400, "JSON values like true"),
        ("repeat_int32/generate_stream", {"IN": [[1], [2, 3]]}, 400, "rectangular"),
        ("repeat_int32/generate_stream", {"IN": [2**40]}, 400, "out of its range"),
        ("repeat_int32/generate", {"IN": [1], "DELAY": [0]}, 400, "WAIT"),
        ("repeat_int32/generate", {"parameters": {"priority": "high"}}, 400, "priority"),
        ("repeat_int32/infer", None, 400, "is decoupled"),
    ],
)
async def test_errors_before_the_first_response_are_json_with_a_status(
    repository: Path, path: str, body: Any, status: int, message: str
) -> None:
    if body is None:
        body = {"inputs": [{"name": "IN", "shape": [1], "datatype": "INT32", "data": [1]}]}
        body["inputs"] += [
            {"name": "DELAY", "shape": [1], "datatype": "UINT32", "data": [0]},
            {"name": "WAIT", "shape": [1], "datatype": "UINT32", "data": [0]},
        ]
    async with serving(repository) as client:
        answer = await client.post(f"/v2/models/{path}", json=body)
    assert answer.status_code == status
    assert answer.headers["content-type"] == "application/json"
    assert message in answer.json()["error"]


async def test_an_error_mid_stream_is_a_last_error_event(repository: Path) -> None:
    sys.modules[PROBE] = watched = probe()
    watched.fail = True
    try:
        async with serving(repository) as client:
            answer = await client.post("/v2/models/watched/generate_stream", json={"n": 5})
    finally:
        del sys.modules[PROBE]
    assert answer.status_code == 200
    *responses, error = events(answer.text)
    assert [r["i"] for r in responses] == [0, 1]
    assert list(error) == ["error"]
    assert "watched" in error["error"]
    assert "infer raised ValueError: the model broke after two" in error["error"]


async def test_the_timeout_parameter_ends_the_stream(repository: Path) -> None:
    # Ten responses 30 ms apart under a timeout of 100 ms: a few, then the timeout.
    body = {
        "IN": list(range(10)),
        "DELAY": [30] * 10,
        "WAIT": 0,
        "parameters": {"timeout": 100_000},
    }
    async with serving(repository) as client:
        answer = await client.post("/v2/models/repeat_int32/generate_stream", json=body)
        before = await client.post(
            "/v2/models/repeat_int32/generate",
            json={**body, "WAIT": 1000},
        )
    *responses, error = events(answer.text)
    assert 1 <= len(responses) < 10
    assert "timeout of 100000 µs passed" in error["error"]
    assert before.status_code == 504


def make_runs_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model's run of responses goes in the buffer in one go, however loaded the machine.

    (Past the loop's inline slice a hand-over yields: a busy machine could cut the run.)
    """
    monkeypatch.setattr(stream_module, "DEFAULT_SLICE_S", 60.0)


async def test_a_run_cut_by_the_timeout_sends_what_the_stream_gave_then_its_error(
    repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Of a run made before the timeout, and read as it passed: the response handed to the
    waiting reader before it leaves (it was dropped); the rest, still in the buffer when
    the timeout passed, the stream refuses; then the timeout's error."""
    make_runs_whole(monkeypatch)
    body = {"n": 4, "parameters": {"timeout": 1_000_000}}
    async with serving(repository) as client:
        answer = await client.post("/v2/models/late_run/generate_stream", json=body)
    *responses, error = events(answer.text)
    assert [r["i"] for r in responses] == [0, 1]
    assert "timeout of 1000000 µs passed" in error["error"]


@pytest.mark.grpc
async def test_a_grpc_stream_cut_by_the_timeout_sends_what_the_stream_gave(
    repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gRPC's ModelStreamInfer, the same: two responses, then the timeout's error."""
    make_runs_whole(monkeypatch)
    grpc = pytest.importorskip("grpc")
    service_pb2 = pytest.importorskip("tritonclient.grpc.service_pb2")
    service_pb2_grpc = pytest.importorskip("tritonclient.grpc.service_pb2_grpc")

    def call(address: str) -> list[int | str]:
        request = service_pb2.ModelInferRequest(model_name="late_run", id="late")
        request.parameters["timeout"].int64_param = 1_000_000
        tensor = request.inputs.add(name="n", datatype="INT32", shape=[1])
        tensor.contents.int_contents.append(4)
        got: list[int | str] = []
        with grpc.insecure_channel(address) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            for answer in stub.ModelStreamInfer(iter([request]), timeout=10):
                if answer.error_message:
                    got.append(answer.error_message)
                    break  # the request has ended; the call would wait for more
                raw = answer.infer_response.raw_output_contents[0]
                got.append(int.from_bytes(raw, "little"))
        return got

    async with trio.open_nursery() as nursery:
        listening = await start_serving(nursery, repository, grpc_port=0)
        got = await trio.to_thread.run_sync(call, listening.grpc)
        nursery.cancel_scope.cancel()
    *responses, error = got
    assert responses == [0, 1]
    assert isinstance(error, str)
    assert "timeout" in error
    assert "passed before its last response" in error


def slow_second_response(module: Any, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Encoding the second response (``i`` 1) holds the loop past the 1 s timeout.

    The first two of a run are then read before the timeout and held for the third,
    which the reader refuses: the timeout has passed.
    """
    encoder = getattr(module, name)

    def slow(*args: Any, **kwargs: Any) -> Any:
        encode = encoder(*args, **kwargs)

        def encoding(outputs: Any) -> Any:
            if int(outputs["i"][0]) == 1:
                time.sleep(1.3)
            return encode(outputs)

        return encoding

    monkeypatch.setattr(module, name, slow)


async def test_responses_read_before_the_timeout_leave_before_its_error(
    repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Responses the stream gave before the timeout, held for the rest of their run, were
    dropped at it: the client saw none of them. Now they leave, then the timeout's error."""
    from trioinfer.server import _generate

    make_runs_whole(monkeypatch)
    encode = _generate.encode_generate_response

    def slow(served: Any, outputs: Any, *rest: Any) -> Any:
        if int(outputs["i"][0]) == 1:
            time.sleep(1.3)  # the loop held past the timeout: see slow_second_response
        return encode(served, outputs, *rest)

    monkeypatch.setattr(_generate, "encode_generate_response", slow)
    body = {"n": 1, "parameters": {"timeout": 1_000_000}}
    async with serving(repository) as client:
        answer = await client.post("/v2/models/run_of_three/generate_stream", json=body)
    *responses, error = events(answer.text)
    assert [r["i"] for r in responses] == [0, 1]
    assert "timeout of 1000000 µs passed" in error["error"]


@pytest.mark.grpc
async def test_a_grpc_streams_responses_read_before_the_timeout_leave_before_its_error(
    repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gRPC's ModelStreamInfer, the same: the two responses read in time, then the error."""
    make_runs_whole(monkeypatch)
    grpc = pytest.importorskip("grpc")
    service_pb2 = pytest.importorskip("tritonclient.grpc.service_pb2")
    service_pb2_grpc = pytest.importorskip("tritonclient.grpc.service_pb2_grpc")
    from trioinfer.server import _grpc  # (the grpc extra's)

    slow_second_response(_grpc, "raw_output_encoder", monkeypatch)

    def call(address: str) -> list[int | str]:
        request = service_pb2.ModelInferRequest(model_name="run_of_three", id="run")
        request.parameters["timeout"].int64_param = 1_000_000
        tensor = request.inputs.add(name="n", datatype="INT32", shape=[1])
        tensor.contents.int_contents.append(1)
        got: list[int | str] = []
        with grpc.insecure_channel(address) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            for answer in stub.ModelStreamInfer(iter([request]), timeout=10):
                if answer.error_message:
                    got.append(answer.error_message)
                    break
                raw = answer.infer_response.raw_output_contents[0]
                got.append(int.from_bytes(raw, "little"))
        return got

    async with trio.open_nursery() as nursery:
        listening = await start_serving(nursery, repository, grpc_port=0)
        got = await trio.to_thread.run_sync(call, listening.grpc)
        nursery.cancel_scope.cancel()
    *responses, error = got
    assert responses == [0, 1]
    assert isinstance(error, str)
    assert "passed before its last response" in error


@pytest.mark.grpc
async def test_a_grpc_calls_requests_share_what_their_models_make_ahead(
    repository: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each decoupled request of a call streams with the ``ahead`` the call lends it."""
    grpc = pytest.importorskip("grpc")
    service_pb2 = pytest.importorskip("tritonclient.grpc.service_pb2")
    service_pb2_grpc = pytest.importorskip("tritonclient.grpc.service_pb2_grpc")
    from trioinfer.server import _grpc  # (the grpc extra's)

    monkeypatch.setattr(_grpc, "STREAM_CALL_AHEAD", 20)
    lent: list[int] = []
    infer_stream = trioinfer.Engine.infer_stream

    def recording(self: trioinfer.Engine, *args: Any, **kwargs: Any) -> Any:
        lent.append(kwargs["ahead"])
        return infer_stream(self, *args, **kwargs)

    monkeypatch.setattr(trioinfer.Engine, "infer_stream", recording)

    def request(request_id: str) -> Any:
        # Two responses after 300 ms: the call's three requests are in flight together.
        message = service_pb2.ModelInferRequest(model_name="repeat_int32", id=request_id)
        for name, datatype, values in [
            ("IN", "INT32", [1, 2]),
            ("DELAY", "UINT32", [0, 0]),
            ("WAIT", "UINT32", [300]),
        ]:
            tensor = message.inputs.add(name=name, datatype=datatype, shape=[len(values)])
            if datatype == "INT32":
                tensor.contents.int_contents.extend(values)
            else:
                tensor.contents.uint_contents.extend(values)
        return message

    def call(address: str) -> list[str]:
        ids = []
        with grpc.insecure_channel(address) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            answers = stub.ModelStreamInfer(iter([request(i) for i in "abc"]), timeout=30)
            for answer in answers:
                assert not answer.error_message, answer.error_message
                ids.append(answer.infer_response.id)
                if len(ids) == 6:
                    answers.cancel()
                    break
        return ids

    async with trio.open_nursery() as nursery:
        listening = await start_serving(nursery, repository, grpc_port=0)
        ids = await trio.to_thread.run_sync(call, listening.grpc)
        nursery.cancel_scope.cancel()
    assert sorted(ids) == ["a", "a", "b", "b", "c", "c"]
    # 16, then what is left of the call's 20 beyond one each (5), then one.
    assert sorted(lent) == [1, 6, 16]


async def test_a_client_that_disconnects_stops_the_model(repository: Path) -> None:
    """No work after the disconnect: the model, holding its 4th response, never makes it."""
    sys.modules[PROBE] = watched = probe()
    try:
        async with serving(repository) as client:
            # A bare socket: read three events, then hang up.
            host, port = client.base_url.host, client.base_url.port
            assert port is not None
            body = b'{"n": 10}'
            request = (
                b"POST /v2/models/watched/generate_stream HTTP/1.1\r\nhost: x\r\n"
                b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
            ) % (len(body), body)
            got = b""
            async with await trio.open_tcp_stream(host, port) as sock:
                await sock.send_all(request)
                while got.count(b"data: ") < 3 or not got.endswith(b"\r\n"):
                    got += await sock.receive_some()
            # The client has gone; the server notices and cancels the stream.
            with trio.fail_after(10):
                await watched.closed.wait()
            watched.go_on.set()  # were the model still running, it would go on now
            await trio.testing.wait_all_tasks_blocked()
            still = await client.post("/v2/models/repeat_int32/generate", json=REPEAT | {
                "IN": [1], "DELAY": [0]})  # fmt: skip
    finally:
        del sys.modules[PROBE]
    assert got.startswith(b"HTTP/1.1 200 OK\r\n")
    assert [event["i"] for event in sse_data(got)] == [0, 1, 2]
    assert (watched.made, watched.ended) == (3, "Cancelled")
    assert still.status_code == 200


def test_generate_stream_and_a_disconnect_on_asyncio(repository: Path) -> None:
    """The same HTTP stack on asyncio: events as they come, and a hang-up stops the model."""
    seen: dict[str, Any] = {}

    async def main() -> None:
        sys.modules[PROBE] = watched = probe()
        try:
            async with anyio.create_task_group() as tg:
                listening = await start_serving(tg, repository)
                url = listening.urls[0]
                async with httpx.AsyncClient(base_url=url) as client:
                    answer = await client.post(
                        "/v2/models/repeat_int32/generate_stream", json=REPEAT
                    )
                    seen["events"] = [e["OUT"] for e in events(answer.text)]
                host, port = url.removeprefix("http://").rsplit(":", 1)
                body = b'{"n": 10}'
                async with await anyio.connect_tcp(host, int(port)) as sock:
                    await sock.send(
                        b"POST /v2/models/watched/generate_stream HTTP/1.1\r\nhost: x\r\n"
                        b"content-length: %d\r\n\r\n%b" % (len(body), body)
                    )
                    got = b""
                    while got.count(b"data: ") < 3 or not got.endswith(b"\r\n"):
                        got += await sock.receive()
                with anyio.fail_after(10):
                    await watched.closed.wait()
                watched.go_on.set()
                await anyio.sleep(0.01)
                seen["model"] = (watched.made, watched.ended)
                tg.cancel_scope.cancel()
        finally:
            del sys.modules[PROBE]

    anyio.run(main, backend="asyncio")
    assert seen["events"] == [4, 2, 0, 1]
    assert seen["model"] == (3, "CancelledError")


async def _cut_by_the_drain(
    repository: Path, client_side: Any, *, grpc: bool = False
) -> tuple[Any, types.SimpleNamespace]:
    """Run *client_side(listening)* (a stream of the watched model, which holds its 4th
    response) while the server stops with a short drain period; return what it got."""
    sys.modules[PROBE] = watched = probe()
    stop = anyio.Event()
    got: list[Any] = []
    try:
        async with trio.open_nursery() as nursery:
            listening = await start_serving(
                nursery,
                repository,
                grpc_port=0 if grpc else None,
                config=ServerConfig(drain_period=0.2),
                shutdown=stop,
            )

            async def client() -> None:
                got.append(await client_side(listening))

            nursery.start_soon(client)
            with trio.fail_after(10):
                await watched.holding.wait()  # three responses made, the fourth held
            stop.set()  # as SIGTERM does: the stream outlasts the drain period
    finally:
        del sys.modules[PROBE]
    return got[0], watched


async def test_a_stream_cut_by_the_drain_ends_with_an_error_event(repository: Path) -> None:
    """Cut at the drain's end, an SSE stream says so: a client can tell it from a whole one."""

    async def read_all(listening: Any) -> bytes:
        host, port = listening.urls[0].removeprefix("http://").rsplit(":", 1)
        body = b'{"n": 10}'
        got = b""
        async with await trio.open_tcp_stream(host, int(port)) as sock:
            await sock.send_all(
                b"POST /v2/models/watched/generate_stream HTTP/1.1\r\nhost: x\r\n"
                b"content-length: %d\r\n\r\n%b" % (len(body), body)
            )
            while chunk := await sock.receive_some():
                got += chunk
        return got

    got, watched = await _cut_by_the_drain(repository, read_all)
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert body.endswith(b"\r\n0\r\n\r\n")  # the chunked body ends whole, not cut short
    sent = sse_data(got)
    *responses, error = sent
    assert [r["i"] for r in responses] == [0, 1, 2]
    assert list(error) == ["error"]
    assert "shut down before the stream ended" in error["error"]
    assert watched.ended == "Cancelled"


async def test_a_grpc_stream_cut_by_the_drain_ends_unavailable(repository: Path) -> None:
    """gRPC's ModelStreamInfer, cut the same way, ends with UNAVAILABLE, not a clean end."""
    grpc = pytest.importorskip("grpc")
    service_pb2 = pytest.importorskip("tritonclient.grpc.service_pb2")
    service_pb2_grpc = pytest.importorskip("tritonclient.grpc.service_pb2_grpc")

    def call(address: str) -> tuple[list[int], Any]:
        request = service_pb2.ModelInferRequest(model_name="watched", id="cut")
        tensor = request.inputs.add(name="n", datatype="INT32", shape=[1])
        tensor.contents.int_contents.append(10)
        responses: list[int] = []
        with grpc.insecure_channel(address) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            try:
                for answer in stub.ModelStreamInfer(iter([request]), timeout=10):
                    assert not answer.error_message, answer.error_message
                    raw = answer.infer_response.raw_output_contents[0]
                    responses.append(int.from_bytes(raw, "little"))
            except grpc.RpcError as exc:
                return responses, exc
        return responses, None

    async def client_side(listening: Any) -> tuple[list[int], Any]:
        return await trio.to_thread.run_sync(call, listening.grpc)

    (responses, error), watched = await _cut_by_the_drain(repository, client_side, grpc=True)
    assert responses == [0, 1, 2]
    assert error is not None
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "server stopped before the call finished" in error.details()
    assert watched.ended == "Cancelled"


def test_a_generate_response_refuses_text_that_is_not_utf8() -> None:
    """Bytes that are not UTF-8, and a str with lone surrogates (a model's
    decode(errors="surrogateescape")), are refused naming the element, as a plain-JSON
    infer response refuses them: they were sent with U+FFFD in their place."""
    import numpy as np

    from trioinfer.server._codec import RequestError
    from trioinfer.server._generate import encode_generate_response

    served: Any = types.SimpleNamespace(model="m", version=1)
    spec = trioinfer.TensorSpec("text", np.dtype(object), (None,))
    signature = trioinfer.ModelSignature(inputs=(), outputs=(spec,))
    escaped = b"caf\xc3\xa9 \xff".decode("utf-8", "surrogateescape")
    for outputs, index in (
        ({"text": np.array([escaped], dtype=object)}, 0),
        ({"text": np.array(["ok", escaped], dtype=object)}, 1),
        ({"text": np.array([b"ok", b"\xff"], dtype=object)}, 1),
        ({"text": np.array([b"\xc3"], dtype=object)}, 0),
    ):
        with pytest.raises(
            RequestError, match=rf"output 'text' holds bytes that are not UTF-8 \(element {index} "
        ):
            encode_generate_response(served, outputs, signature)
    ok = {"text": np.array([b"caf\xc3\xa9", "\u00e9"], dtype=object)}
    assert encode_generate_response(served, ok, signature)["text"] == ["caf\u00e9", "\u00e9"]


BYTES_MODEL = """
import numpy as np


class Model:
    async def infer(self, inputs):
        for text in (b"ok", b"caf\\xc3\\xa9", b"\\xff"):
            if int(inputs["n"][0]) == 0:
                text = b"\\xff"
            yield {"s": np.array([text], dtype=object)}
"""


async def test_generate_refuses_a_bytes_output_that_is_not_utf8(repository: Path) -> None:
    """/generate answers 400 saying why; /generate_stream sends the good responses, then
    an error event for the one it cannot send unaltered (and a 400 when it is the first)."""
    (repository / "texts" / "1").mkdir(parents=True)
    (repository / "texts" / "1" / "model.py").write_text(BYTES_MODEL)
    (repository / "texts" / "config.toml").write_text(
        'backend = "python"\n[backend_options]\ndecoupled = true\n'
        'inputs = [{ name = "n", dtype = "int32", shape = [1] }]\n'
        'outputs = [{ name = "s", dtype = "BYTES", shape = [1] }]\n'
    )
    async with serving(repository) as client:
        one = await client.post("/v2/models/texts/generate", json={"n": 0})
        first = await client.post("/v2/models/texts/generate_stream", json={"n": 0})
        stream = await client.post("/v2/models/texts/generate_stream", json={"n": 1})
    expected = "output 's' holds bytes that are not UTF-8 (element 0 of the flattened output)"
    assert one.status_code == 400
    assert one.json()["error"].startswith(expected)
    assert first.status_code == 400
    assert first.json()["error"].startswith(expected)
    *responses, error = events(stream.text)
    assert [r["s"] for r in responses] == ["ok", "caf\u00e9"]
    assert list(error) == ["error"]
    assert error["error"].startswith(expected)
    assert "binary_data_output" in error["error"]


async def test_responses_made_together_leave_together(repository: Path) -> None:
    """A model's run of responses goes out in one chunk; one made alone goes out at once."""

    async def raw(body: bytes, until: bytes) -> bytes:
        got = b""
        async with await trio.open_tcp_stream(host, port) as sock:
            await sock.send_all(
                b"POST /v2/models/repeat_int32/generate_stream HTTP/1.1\r\nhost: x\r\n"
                b"content-length: %d\r\n\r\n%b" % (len(body), body)
            )
            with trio.fail_after(30):
                while not got.endswith(until):
                    data = await sock.receive_some()
                    assert data, got  # the server closed before the end
                    got += data
        assert got.startswith(b"HTTP/1.1 200 OK\r\n"), got
        return got

    async with serving(repository) as client:
        host, port = client.base_url.host, client.base_url.port
        assert port is not None
        # 50 responses with no wait between them: made in runs, written a run at a time.
        quick = json.dumps({"IN": list(range(50)), "DELAY": [0] * 50, "WAIT": 0})
        quick_got = await raw(quick.encode(), b"\r\n0\r\n\r\n")
        # 3 responses 100 ms apart: each written as it is made, alone.
        slow = json.dumps({"IN": [7, 8, 9], "DELAY": [100] * 3, "WAIT": 0})
        slow_got = await raw(slow.encode(), b"\r\n0\r\n\r\n")
    assert [event["OUT"] for event in sse_data(quick_got)] == list(range(50))
    # Runs of up to STREAM_AHEAD (16), cut shorter where the loop's inline slice ran out.
    assert 1 < chunks(quick_got) < 50
    assert [event["OUT"] for event in sse_data(slow_got)] == [7, 8, 9]
    assert chunks(slow_got) == 3


def chunks(raw: bytes) -> int:
    """How many chunks with data a raw chunked response has (its last, empty one not counted)."""
    rest = raw.partition(b"\r\n\r\n")[2]
    count = 0
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if not size:
            break
        count += 1
        rest = rest[size + 2 :]
    return count


# A model whose first response is bigger than a socket's buffers (8 MB of text), then
# holds on: the server is still writing it when a client that reads nothing meanwhile
# lets the request's timeout pass.
BIG_FIRST = """
import anyio
import numpy as np


class Model:
    async def infer(self, inputs):
        yield {"text": np.array(["x" * (8 << 20)], object)}
        await anyio.sleep_forever()
"""


async def test_a_response_being_written_at_the_timeout_goes_out_whole_then_its_error(
    tmp_path: Path,
) -> None:
    """The request's timeout passing mid-write cut the event, and the connection: the client
    got part of a response and no error. Now the event goes out whole, then the error."""
    root = tmp_path / "models"
    (root / "big_first" / "1").mkdir(parents=True)
    (root / "big_first" / "1" / "model.py").write_text(BIG_FIRST)
    (root / "big_first" / "config.toml").write_text(
        'backend = "python"\n[backend_options]\ndecoupled = true\n'
        'inputs = [{ name = "n", dtype = "int32", shape = [1] }]\n'
        'outputs = [{ name = "text", dtype = "string", shape = [1] }]\n'
    )
    # 3 s: the response is made well before it, even on a busy machine.
    body = json.dumps({"n": 1, "parameters": {"timeout": 3_000_000}}).encode()
    async with trio.open_nursery() as nursery:
        listening = await start_serving(nursery, root)
        host, port = listening.urls[0].removeprefix("http://").rsplit(":", 1)
        sock = trio.socket.socket()
        sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, 4096)
        await sock.connect((host, int(port)))
        sent = trio.current_time()
        await sock.send(
            b"POST /v2/models/big_first/generate_stream HTTP/1.1\r\nhost: x\r\n"
            b"content-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        raw = bytearray(await sock.recv(65536))  # the head, and the event's first bytes
        await trio.sleep_until(sent + 4)  # reading nothing while the timeout passes
        with trio.fail_after(30):
            while chunk := await sock.recv(1 << 20):
                raw += chunk
        sock.close()
        nursery.cancel_scope.cancel()
    assert raw.endswith(b"0\r\n\r\n"), raw[-200:]  # the body's end: not a cut connection
    response, error = sse_data(bytes(raw))
    assert response["text"] == "x" * (8 << 20)
    assert "timeout of 3000000 µs passed" in error["error"]
