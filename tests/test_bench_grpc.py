"""The lean gRPC load client of ``trioinfer bench --protocol grpc`` (`_grpc_raw`).

It is checked against three servers: a real ``trioinfer serve``, a plain
``grpc.aio`` server (standard gRPC, not only trioinfer's dialect), and an h2
server scripted to misbehave (closing mid-run, GOAWAY, PING, big messages).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import numpy as np
import pytest
from click.testing import CliRunner

from test_grpc import Server, run_server
from trioinfer.bench import GrpcTarget, Tensor
from trioinfer.bench._grpc_raw import GOAWAY_ERROR, _RawGrpcLoop
from trioinfer.bench._stats import _Recorder
from trioinfer.cli import main as cli_main
from trioinfer.server import _grpc_proto as pb
from trioinfer.testing import models

pytestmark = [pytest.mark.bench, pytest.mark.grpc]

#: How long each run drives load: long enough for many calls, nothing timed.
RUN_S = 0.4
#: Bounds against hangs only.
WAIT_S = 30.0
#: How long the scripted server waits for the client to close after GOAWAY.
GOAWAY_WAIT_S = 5.0
INFER = "/inference.GRPCInferenceService/ModelInfer"


def simple_request(model: str = "simple", width: int = 16) -> bytes:
    a = np.arange(width, dtype=np.int32).reshape(1, width)
    target = GrpcTarget("127.0.0.1:1", model)
    return target.requests([[Tensor("a", "INT32", a), Tensor("b", "INT32", a)]])[0]


def drive(
    address: str,
    requests: list[bytes],
    count: int,
    *,
    per_connection: int = 4,
    seconds: float = RUN_S,
    until: Callable[[_Recorder], bool] | None = None,
    timeout_s: float | None = None,
    streaming: bool = False,
) -> _Recorder:
    """Run the raw client's closed loop for *seconds* (or until *until*); return its record."""
    recorder = _Recorder()
    host, _, port = address.rpartition(":")
    loop = _RawGrpcLoop(
        (host, int(port)),
        address,
        requests,
        recorder,
        count,
        streams_per_connection=per_connection,
        timeout_s=timeout_s,
        streaming=streaming,
    )
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + WAIT_S
        time.sleep(seconds)
        while until is not None and not until(recorder) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        loop.stop()
        thread.join(WAIT_S)
        loop.close()
    assert not thread.is_alive()
    return recorder


# -- against trioinfer serve ----------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("bench_grpc") / "repository"
    models.write_add(root / "simple" / "1" / "model.onnx", dtype=np.int32, width=16)
    log = tmp_path_factory.mktemp("log") / "server.log"
    with run_server(root, log=log) as running:
        yield running


def test_raw_client_against_trioinfer_serve(server: Server) -> None:
    # 6 workers, 4 per connection: two connections, one with 4 calls in flight, one with 2.
    recorder = drive(server.grpc, [simple_request()], 6)
    assert len(recorder.window.latencies) > 10
    assert not recorder.window.errors, recorder.first_error


def test_unknown_model_is_counted_with_its_message(server: Server) -> None:
    recorder = drive(server.grpc, [simple_request("nope")], 3)
    assert not recorder.window.latencies
    assert recorder.window.errors["NOT_FOUND"] > 0
    assert set(recorder.window.errors) == {"NOT_FOUND"}
    assert "nope" in recorder.first_error["NOT_FOUND"]


@pytest.mark.parametrize("client", ["raw", "aio"])
def test_bench_cli_grpc_clients(server: Server, tmp_path: Path, client: str) -> None:
    out = tmp_path / "run.json"
    result = CliRunner().invoke(
        cli_main,
        [
            *("bench", "--protocol", "grpc", "--grpc-client", client),
            *("--url", f"grpc://{server.grpc}", "-m", "simple", "--concurrency", "1,20"),
            *("--warmup", "0", "--window", "0.3", "--windows", "1", "--json", str(out)),
        ],
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["grpc_client"] == client
    assert [r["value"] for r in doc["results"]] == [1, 20]
    assert all(r["completed"] > 0 and r["errors"] == 0 for r in doc["results"])


# -- against a plain grpc.aio server ----------------------------------------------------------


@contextlib.contextmanager
def aio_server(streams: list[int] | None = None) -> Iterator[tuple[str, list[bytes]]]:
    """A grpc.aio server whose ModelInfer echoes the first raw input as the output.

    Model ``nope`` gets NOT_FOUND; ``big`` gets a 300 kB answer (past any window).
    Its ModelStreamInfer answers each request as a decoupled model with Triton's
    empty final response: two echoes, then the final; ``nope`` gets an
    error_message, ``wrong_id`` an echo naming another request first, and
    ``hang_up`` ends the stream unanswered. *streams* gets one entry per stream
    opened: how many requests came on it.
    """
    seen: list[bytes] = []
    ready = threading.Event()
    state: dict[str, Any] = {}
    opened = streams if streams is not None else []

    async def stream_infer(
        requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[bytes]:
        index = len(opened)
        opened.append(0)
        async for raw in requests:
            seen.append(raw)
            opened[index] += 1
            request = pb.ModelInferRequest.FromString(raw)
            assert request.parameters["triton_enable_empty_final_response"].bool_param
            if request.model_name == "hang_up":
                return
            if request.model_name in ("nope", "nope_unnamed"):
                # (Its id, as Triton's; or none, as a server might.)
                named = request.model_name == "nope"
                yield pb.ModelStreamInferResponse(
                    error_message="no model 'nope'",
                    infer_response=pb.ModelInferResponse(id=request.id if named else ""),
                ).SerializeToString()
                continue
            wrong = request.model_name == "wrong_id"
            ids = ["elsewhere", request.id] if wrong else [request.id] * 2
            payload = request.raw_input_contents[0]
            for response_id in ids:
                response = pb.ModelInferResponse(model_name=request.model_name, id=response_id)
                response.outputs.add(name="out", datatype="INT32", shape=[1])
                response.raw_output_contents.append(
                    payload * 4 if request.model_name == "big" else payload
                )
                response.parameters["triton_final_response"].bool_param = False
                yield pb.ModelStreamInferResponse(infer_response=response).SerializeToString()
            final = pb.ModelInferResponse(model_name=request.model_name, id=request.id)
            final.parameters["triton_final_response"].bool_param = True
            yield pb.ModelStreamInferResponse(infer_response=final).SerializeToString()

    async def infer(raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        seen.append(raw)
        request = pb.ModelInferRequest.FromString(raw)
        if request.model_name == "nope":
            await context.abort(grpc.StatusCode.NOT_FOUND, "no model 'nope' here, sorry: 100%")
        response = pb.ModelInferResponse(model_name=request.model_name, id=request.id)
        response.outputs.add(name="out", datatype="INT32", shape=[1])
        payload = request.raw_input_contents[0]
        response.raw_output_contents.append(payload * 4 if request.model_name == "big" else payload)
        return bytes(response.SerializeToString())

    async def main() -> None:
        server = grpc.aio.server()
        handler = grpc.method_handlers_generic_handler(
            "inference.GRPCInferenceService",
            {
                "ModelInfer": grpc.unary_unary_rpc_method_handler(infer),
                "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(stream_infer),
            },
        )
        server.add_generic_rpc_handlers((handler,))
        state["port"] = server.add_insecure_port("127.0.0.1:0")
        state["stop"] = asyncio.Event()
        state["loop"] = asyncio.get_running_loop()
        await server.start()
        ready.set()
        await state["stop"].wait()
        await server.stop(None)

    # asyncio.run, not run_until_complete and close: the calls server.stop cancelled are
    # tasks still pending then, which asyncio.run cancels and waits for. A loop closed
    # under them left them to the garbage collector, which destroyed them at the end of
    # the test run ("Task was destroyed but it is pending!", grpc.aio's GeneratorExit).
    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(WAIT_S)
    try:
        yield f"127.0.0.1:{state['port']}", seen
    finally:
        state["loop"].call_soon_threadsafe(state["stop"].set)
        thread.join(WAIT_S)
        assert not thread.is_alive(), "the grpc.aio server did not stop"


def test_raw_client_speaks_standard_grpc() -> None:
    request = simple_request()
    with aio_server() as (address, seen):
        recorder = drive(address, [request], 5)
    assert len(recorder.window.latencies) > 10
    assert not recorder.window.errors, recorder.first_error
    # The server got the very message the client serialized, every time.
    assert seen
    assert set(seen) == {request}
    assert len(seen) >= len(recorder.window.latencies)


def test_grpc_errors_from_a_standard_server() -> None:
    with aio_server() as (address, _seen):
        recorder = drive(address, [simple_request("nope"), simple_request()], 2)
    assert recorder.window.errors["NOT_FOUND"] > 0
    assert len(recorder.window.latencies) > 0
    # grpc-message arrives percent-encoded; the record has it decoded.
    assert recorder.first_error["NOT_FOUND"] == "no model 'nope' here, sorry: 100%"


def test_big_messages_both_ways_through_flow_control() -> None:
    # 400 kB requests (past the 64 kB initial windows and 16 kB frames) and 1.6 MB answers.
    request = simple_request("big", width=100_000)
    with aio_server() as (address, seen):
        recorder = drive(address, [request], 3, until=lambda r: len(r.window.latencies) >= 3)
    assert len(recorder.window.latencies) >= 3
    assert not recorder.window.errors, recorder.first_error
    assert set(seen) == {request}


# -- streaming: one ModelStreamInfer stream per worker -----------------------------------------


@pytest.mark.streaming
def test_each_worker_sends_request_after_request_on_one_stream() -> None:
    # 5 workers, 4 per connection: five streams, each carrying many requests, as
    # perf_analyzer's --streaming does (not a call per request).
    streams: list[int] = []
    with aio_server(streams) as (address, seen):
        recorder = drive(
            address,
            [simple_request()],
            5,
            streaming=True,
            until=lambda r: len(r.window.latencies) >= 50,
        )
    assert not recorder.window.errors, recorder.first_error
    completed = len(recorder.window.latencies)
    assert len(streams) == 5
    assert all(n > 1 for n in streams)
    assert sum(streams) >= completed >= 50
    # Two responses counted per request; the empty final one is not a response.
    assert recorder.window.responses == 2 * completed
    assert len(recorder.window.first) == completed
    # Each request carried an id of its own (how its responses are matched).
    ids = [pb.ModelInferRequest.FromString(raw).id for raw in seen]
    assert len(set(ids)) == len(ids)


def stream_response(request_id: str, *, final: bool, outputs: bool) -> bytes:
    response = pb.ModelInferResponse(model_name="m", model_version="1", id=request_id)
    if outputs:
        response.outputs.add(name="out", datatype="INT32", shape=[1])
        response.raw_output_contents.append(b"\1\0\0\0")
    response.parameters["triton_final_response"].bool_param = final
    return bytes(pb.ModelStreamInferResponse(infer_response=response).SerializeToString())


@pytest.mark.streaming
@pytest.mark.parametrize("final_outputs", [False, True])
def test_a_streamed_request_ends_at_its_final_response(final_outputs: bool) -> None:
    # A decoupled model's final response is empty (not a response); a model that is not
    # decoupled answers once, its one response flagged final (counted).
    from trioinfer.bench._grpc_raw import _Stream

    recorder = _Recorder()
    loop = _RawGrpcLoop(
        ("127.0.0.1", 1), "x", [b""], recorder, 1, streams_per_connection=1, streaming=True
    )
    try:
        conn = loop.connections[0]
        conn.going_away = True  # no next request: the stream just ends
        stream = _Stream(1, start=0)
        stream.request_id, stream.request_tag = "7", b"\x1a\x017"
        loop._response(conn, stream, stream_response("7", final=False, outputs=True), 10)
        loop._response(conn, stream, stream_response("17", final=False, outputs=True), 15)
        loop._response(conn, stream, stream_response("7", final=True, outputs=final_outputs), 20)
    finally:
        loop.close()
    assert recorder.window.latencies == [20]
    assert recorder.window.first == [10]
    assert recorder.window.responses == (2 if final_outputs else 1)
    # The response for request "17" was not counted for "7" (its id's bytes hold "7").
    assert recorder.window.errors == {"bad-answer": 1}
    assert stream.request_id is None


@pytest.mark.streaming
def test_big_requests_one_after_another_on_a_stream_through_flow_control() -> None:
    # 400 kB requests: each stream's send window (64 kB at first) is used up by
    # its first request and must be given back for the next ones.
    streams: list[int] = []
    request = simple_request("big", width=100_000)
    with aio_server(streams) as (address, _seen):
        recorder = drive(
            address,
            [request],
            2,
            streaming=True,
            until=lambda r: len(r.window.latencies) >= 6,
        )
    assert not recorder.window.errors, recorder.first_error
    assert len(recorder.window.latencies) >= 6
    assert len(streams) == 2


@pytest.mark.streaming
@pytest.mark.parametrize("model", ["nope", "nope_unnamed"])
def test_a_streamed_error_fails_its_request_and_the_stream_goes_on(model: str) -> None:
    streams: list[int] = []
    with aio_server(streams) as (address, _seen):
        recorder = drive(
            address,
            [simple_request(model), simple_request()],
            1,
            streaming=True,
            until=lambda r: len(r.window.latencies) >= 5,
        )
    assert recorder.window.errors["stream-error"] >= 5
    assert recorder.first_error["stream-error"] == "no model 'nope'"
    assert len(streams) == 1


@pytest.mark.streaming
def test_a_response_for_another_request_is_counted_as_a_bad_answer() -> None:
    with aio_server() as (address, _seen):
        recorder = drive(
            address,
            [simple_request("wrong_id")],
            1,
            streaming=True,
            until=lambda r: len(r.window.latencies) >= 3,
        )
    assert recorder.window.errors["bad-answer"] >= 3
    assert "'elsewhere'" in recorder.first_error["bad-answer"]
    # The request's own responses still end it: one response each, not two.
    assert recorder.window.responses == len(recorder.window.latencies)


@pytest.mark.streaming
def test_a_stream_ended_under_a_request_fails_it_and_a_new_one_opens() -> None:
    streams: list[int] = []
    with aio_server(streams) as (address, _seen):
        recorder = drive(
            address,
            [simple_request("hang_up")],
            1,
            streaming=True,
            until=lambda r: r.window.errors["bad-answer"] >= 3,
        )
    assert recorder.window.errors["bad-answer"] >= 3
    assert "before request" in recorder.first_error["bad-answer"]
    assert len(streams) >= 3
    assert not recorder.window.latencies


# -- against a scripted h2 server -------------------------------------------------------------


def grpc_message(payload: bytes) -> bytes:
    return b"\0" + struct.pack(">I", len(payload)) + payload


class ScriptedServer:
    """An h2 server answering every call OK, then misbehaving as *mode* says.

    ``close``: after *after* answers on a connection, close it abruptly.
    ``goaway``: after *after* answers, send GOAWAY (last stream: the last answered)
    and wait for the client to close the connection. ``ping``: send a PING first.
    """

    def __init__(self, mode: str, after: int, settings: dict[int, int]) -> None:
        self.mode = mode
        self.after = after
        self.settings = settings
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.bodies: list[bytes] = []
        self.timeouts: set[str | None] = set()
        self.connections = 0
        self.ping_acks = 0
        self.errors: list[BaseException] = []
        self.threads: list[threading.Thread] = []
        self.accepting = threading.Thread(target=self.accept, daemon=True)
        self.accepting.start()

    def accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            thread = threading.Thread(target=self.serve, args=(sock,), daemon=True)
            thread.start()
            self.threads.append(thread)

    def close(self) -> None:
        # shutdown, not only close, wakes the thread blocked in accept().
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self.accepting.join(WAIT_S)
        for thread in self.threads:
            thread.join(WAIT_S)

    def serve(self, sock: socket.socket) -> None:
        config = h2.config.H2Configuration(client_side=False, header_encoding="utf-8")
        conn = h2.connection.H2Connection(config=config)
        conn.initiate_connection()
        if self.settings:
            conn.update_settings(self.settings)  # in force once the client ACKs them
        if self.mode == "ping":
            conn.ping(b"12345678")
        bodies: dict[int, bytes] = {}
        answered = 0
        try:
            with sock:
                sock.sendall(conn.data_to_send())
                while True:
                    data = sock.recv(65536)
                    if not data:
                        return
                    for event in conn.receive_data(data):
                        if isinstance(event, h2.events.PingAckReceived):
                            self.ping_acks += 1
                        elif isinstance(event, h2.events.RequestReceived):
                            headers = dict(event.headers)
                            assert headers[":path"] == INFER
                            assert headers["content-type"] == "application/grpc"
                            assert headers["te"] == "trailers"
                            self.timeouts.add(headers.get("grpc-timeout"))
                            bodies[event.stream_id] = b""
                        elif isinstance(event, h2.events.DataReceived):
                            bodies[event.stream_id] += event.data
                            conn.acknowledge_received_data(
                                event.flow_controlled_length, event.stream_id
                            )
                        elif isinstance(event, h2.events.StreamEnded):
                            body = bodies.pop(event.stream_id)
                            self.bodies.append(body)
                            sid = event.stream_id
                            conn.send_headers(
                                sid, [(":status", "200"), ("content-type", "application/grpc")]
                            )
                            conn.send_data(sid, grpc_message(b"\x0a\x03out"))
                            conn.send_headers(sid, [("grpc-status", "0")], end_stream=True)
                            answered += 1
                            if answered == self.after and self.mode == "goaway":
                                conn.close_connection(last_stream_id=sid, additional_data=b"bye")
                                sock.sendall(conn.data_to_send())
                                # Left open: the client must close it, having nothing in flight.
                                sock.settimeout(GOAWAY_WAIT_S)
                                try:
                                    while sock.recv(65536):
                                        pass
                                except TimeoutError:
                                    self.errors.append(TimeoutError("open after GOAWAY"))
                                return
                            if answered == self.after and self.mode == "close":
                                sock.sendall(conn.data_to_send())
                                return
                    sock.sendall(conn.data_to_send())
        except OSError:
            pass  # the client went first (as it may, at the end of a run or after GOAWAY)
        except (AssertionError, h2.exceptions.ProtocolError) as exc:
            self.errors.append(exc)


@contextlib.contextmanager
def scripted(
    mode: str, after: int = 10, settings: dict[int, int] | None = None
) -> Iterator[ScriptedServer]:
    server = ScriptedServer(mode, after, settings or {})
    try:
        yield server
    finally:
        server.close()
    assert not server.errors, server.errors


def test_a_server_closing_mid_run_counts_errors_and_reconnects() -> None:
    with scripted("close", after=10) as server:
        recorder = drive(server.address, [b"x"], 4, until=lambda r: len(r.window.latencies) > 30)
    assert recorder.window.errors["conn"] > 0
    assert "closed" in recorder.first_error["conn"] or "reset" in recorder.first_error["conn"]
    # It reconnected and went on: more answers than one connection gave.
    assert len(recorder.window.latencies) > 30
    assert server.connections > 3


def test_goaway_fails_the_calls_above_its_last_stream_and_reconnects() -> None:
    with scripted("goaway", after=10) as server:
        recorder = drive(server.address, [b"x"], 4, until=lambda r: len(r.window.latencies) > 30)
    assert recorder.window.errors[GOAWAY_ERROR] > 0
    assert "conn" not in recorder.window.errors, recorder.first_error
    assert "GOAWAY" in recorder.first_error[GOAWAY_ERROR]
    assert "bye" in recorder.first_error[GOAWAY_ERROR]
    assert len(recorder.window.latencies) > 30
    assert server.connections > 3


def test_no_server_counts_connection_errors_without_spinning() -> None:
    with socket.create_server(("127.0.0.1", 0)) as placeholder:
        address = f"127.0.0.1:{placeholder.getsockname()[1]}"
    recorder = drive(address, [b"x"], 3, seconds=0.2)
    assert not recorder.window.latencies
    assert set(recorder.window.errors) == {"conn"}
    assert "refused" in recorder.first_error["conn"].lower()
    # One attempt per 10 ms retry at most (each failing its 3 workers), not a busy loop.
    assert recorder.window.errors["conn"] <= 3 * (0.2 / 0.01 + 10)


def test_stream_ids_running_out_reconnect(monkeypatch: pytest.MonkeyPatch) -> None:
    import trioinfer.bench._grpc_raw as raw

    monkeypatch.setattr(raw, "_LAST_STREAM_ID", 21)  # 10 calls per connection
    with scripted("ok") as server:
        recorder = drive(server.address, [b"x"], 2, until=lambda r: len(r.window.latencies) > 30)
    assert not recorder.window.errors, recorder.first_error
    assert server.connections > 3


def test_ping_is_answered() -> None:
    with scripted("ping") as server:
        recorder = drive(server.address, [b"x"], 2, until=lambda r: len(r.window.latencies) > 5)
    assert server.ping_acks >= 1
    assert not recorder.window.errors, recorder.first_error
    assert server.timeouts == {None}


def test_grpc_timeout_is_sent_when_asked() -> None:
    with scripted("ok") as server:
        recorder = drive(
            server.address, [b"x"], 2, timeout_s=2.5, until=lambda r: len(r.window.latencies) > 5
        )
    assert not recorder.window.errors, recorder.first_error
    assert server.timeouts == {"2500m"}


def test_server_settings_are_obeyed() -> None:
    # Small frames, small windows, one stream at a time and no header table:
    # a 100 kB request must be split, paced by WINDOW_UPDATEs, and sent one call at a time.
    message = bytes(range(256)) * 400
    settings: dict[int, int] = {
        h2.settings.SettingCodes.MAX_FRAME_SIZE: 16_384,
        h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1000,
        h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 1,
        h2.settings.SettingCodes.HEADER_TABLE_SIZE: 0,
    }
    with scripted("ok", settings=settings) as server:
        recorder = drive(server.address, [message], 4, until=lambda r: len(r.window.latencies) > 5)
    assert not recorder.window.errors, recorder.first_error
    assert len(recorder.window.latencies) > 5
    assert server.bodies
    assert set(server.bodies) == {grpc_message(message)}
