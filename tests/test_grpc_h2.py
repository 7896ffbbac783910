"""gRPC over HTTP/2 on the serving loop (``_grpc_h2``), through a raw h2 client.

tests/test_grpc.py shows tritonclient's calls working end to end; these poke
the transport where a well-behaved client never goes: unsupported and bad
compression, oversized and malformed messages, a client that resets its
stream or sends faster than its handler takes messages, deadlines, PING and
GOAWAY at shutdown. The server runs in-process with handlers of its own, so
each test sees exactly what the transport did. Each transport test runs twice,
on Trio and on asyncio (`both_loops`): the transport has Trio-only fast paths,
and the client's deadline, reset and disconnect must cancel a call on both.
"""

from __future__ import annotations

import contextlib
import gzip
import inspect
import logging
import queue
import signal
import socket
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import hpack
import pytest
import sniffio
from hyperframe.frame import DataFrame, Frame, GoAwayFrame, HeadersFrame, PingFrame

from trioinfer.server import _grpc_h2
from trioinfer.server._grpc_h2 import (
    _OUTPUT_LIMIT,
    _STREAM_BACKLOG,
    _WINDOW,
    GrpcCall,
    GrpcError,
    GrpcServer,
    Method,
    _Decoder,
    _Encoder,
)
from trioinfer.server._logging import REQUESTS

pytestmark = pytest.mark.grpc

MAX = 1 << 20
#: Bounds against hangs only; nothing asserts how long anything took.
WAIT_S = 30.0
BACKENDS = ["trio", "asyncio"]


async def poll(predicate: Callable[[], Any]) -> None:
    """Wait until *predicate* holds (what it watches has no event to wait on)."""
    with anyio.fail_after(WAIT_S):
        while not predicate():  # noqa: ASYNC110 - state of another task, no event for it
            await anyio.sleep(0.01)


def frame(message: bytes, compressed: bool = False) -> bytes:
    return struct.pack(">BI", int(compressed), len(message)) + message


class Handlers:
    """The test server's methods, and what they saw."""

    def __init__(self) -> None:
        self.calls: list[GrpcCall] = []
        self.cancelled = anyio.Event()
        self.release = anyio.Event()
        self.taken: list[bytes] = []
        self.reading = anyio.Event()

    async def echo(self, raw: bytes, call: GrpcCall) -> bytes:
        self.calls.append(call)
        if raw == b"fail":
            raise GrpcError(5, "not found: caf\u00e9 100%")
        if raw == b"bug":
            raise ValueError("a handler's bug")
        return raw * 1

    async def slow(self, raw: bytes, call: GrpcCall) -> bytes:
        self.calls.append(call)
        try:
            await self.release.wait()
        except anyio.get_cancelled_exc_class():
            self.cancelled.set()
            raise
        return raw

    async def stream(
        self,
        messages: AsyncIterator[bytes],
        call: GrpcCall,
        send: Callable[[bytes], Awaitable[None]],
    ) -> None:
        # Takes one message, then nothing until released: a slow engine.
        async for message in messages:
            self.taken.append(message)
            await send(b"got " + message[:8])
            if len(self.taken) == 1:
                self.reading.set()
                await self.release.wait()

    async def echo_stream(
        self,
        messages: AsyncIterator[bytes],
        call: GrpcCall,
        send: Callable[[bytes], Awaitable[None]],
    ) -> None:
        async for message in messages:
            await send(message)

    def methods(self) -> dict[str, Method]:
        return {
            "/t.S/Echo": Method(self.echo, streaming=False),
            "/t.S/EchoStream": Method(self.echo_stream, streaming=True),
            "/t.S/Slow": Method(self.slow, streaming=False),
            "/t.S/Stream": Method(self.stream, streaming=True),
        }


class Client:
    """A bare HTTP/2 client: sends what a test says, collects every event."""

    def __init__(self, socket: anyio.abc.SocketStream, *, ack: bool = True) -> None:
        self.socket = socket
        self.h2 = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding="latin-1")
        )
        self.ack = ack
        self.events: list[Any] = []
        self.data: dict[int, bytes] = {}

    async def start(self) -> None:
        self.h2.initiate_connection()
        await self.flush()

    async def receive(self) -> bytes:
        """The next bytes from the server; b"" once it closed."""
        try:
            return await self.socket.receive(65536)
        except anyio.EndOfStream:
            return b""

    async def flush(self) -> None:
        if out := self.h2.data_to_send():
            await self.socket.send(out)

    async def call(
        self,
        path: str,
        body: bytes = b"",
        *,
        headers: tuple[tuple[str, str], ...] = (),
        end: bool = True,
        content_type: str = "application/grpc",
    ) -> int:
        sid = self.h2.get_next_available_stream_id()
        self.h2.send_headers(
            sid,
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", path),
                (":authority", "x"),
                ("content-type", content_type),
                ("te", "trailers"),
                *headers,
            ],
            end_stream=end and not body,
        )
        await self.flush()
        while body:
            room = min(self.h2.local_flow_control_window(sid), self.h2.max_outbound_frame_size)
            if room == 0:
                await self.pump()
                continue
            chunk, body = body[:room], body[room:]
            self.h2.send_data(sid, chunk, end_stream=end and not body)
            await self.flush()
        return sid

    async def pump(self) -> None:
        data = await self.receive()
        assert data, f"the server closed the connection: {self.events[-3:]}"
        for event in self.h2.receive_data(data):
            self.events.append(event)
            if isinstance(event, h2.events.DataReceived):
                self.data[event.stream_id] = self.data.get(event.stream_id, b"") + event.data
                if self.ack:
                    self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        await self.flush()

    async def until(self, predicate: Callable[[], Any]) -> Any:
        with anyio.fail_after(WAIT_S):
            while not (found := predicate()):
                await self.pump()
        return found

    def headers(self, sid: int) -> list[dict[str, str]]:
        """Each HEADERS block of stream *sid* (the answer's, then its trailers)."""
        return [
            dict(e.headers)
            for e in self.events
            if isinstance(e, h2.events.ResponseReceived | h2.events.TrailersReceived)
            and e.stream_id == sid
        ]

    async def status(self, sid: int) -> tuple[str, str]:
        """The call's grpc-status and grpc-message, once it ends."""
        last = await self.until(lambda: [h for h in self.headers(sid) if "grpc-status" in h])
        return last[-1]["grpc-status"], last[-1].get("grpc-message", "")


Serve = Callable[..., Awaitable[tuple[GrpcServer, Callable[..., Awaitable[Client]]]]]


@contextlib.asynccontextmanager
async def serving(task_group: anyio.abc.TaskGroup) -> AsyncIterator[Serve]:
    """Start a server of *handlers*' methods: (server, connect); clients are closed after."""
    clients: list[Client] = []

    async def start(
        handlers: Handlers, **limits: Any
    ) -> tuple[GrpcServer, Callable[..., Awaitable[Client]]]:
        server = GrpcServer(handlers.methods(), MAX, **limits)
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        scope = anyio.CancelScope()

        async def accept() -> None:
            with scope:
                async with listener:
                    await listener.serve(server.connection)

        task_group.start_soon(accept)
        server.port = port  # type: ignore[attr-defined]
        # Cancels every connection, as serve_grpc does when the drain period ends.
        server.stop = scope.cancel  # type: ignore[attr-defined]

        async def connect(**kw: Any) -> Client:
            client = Client(await anyio.connect_tcp("127.0.0.1", port), **kw)
            clients.append(client)
            await client.start()
            return client

        return server, connect

    try:
        yield start
    finally:
        # Shielded: the test's task group is cancelled by now, and on asyncio an aclose's
        # checkpoint would raise there, leaving the clients after the first one open.
        with anyio.CancelScope(shield=True):
            for client in clients:
                await client.socket.aclose()


def both_loops(test: Callable[..., Awaitable[None]]) -> Callable[..., None]:
    """Run the async *test* once on Trio and once on asyncio (``backend``).

    The test may ask for ``serve`` (see `serving`) and ``task_group`` (cancelled
    when the test ends) besides pytest's own fixtures and parameters.
    """
    signature = inspect.signature(test)
    ours = {"serve", "task_group"}

    def run(backend: str, **kwargs: Any) -> None:
        async def main() -> None:
            async with anyio.create_task_group() as task_group, serving(task_group) as serve:
                given = {"serve": serve, "task_group": task_group}
                await test(
                    **{k: v for k, v in given.items() if k in signature.parameters}, **kwargs
                )
                task_group.cancel_scope.cancel()

        anyio.run(main, backend=backend)

    run.__name__ = test.__name__
    run.__qualname__ = test.__qualname__
    run.__doc__ = test.__doc__
    run.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[
            inspect.Parameter("backend", inspect.Parameter.POSITIONAL_OR_KEYWORD),
            *(p for name, p in signature.parameters.items() if name not in ours),
        ]
    )
    return pytest.mark.parametrize("backend", BACKENDS)(run)


@both_loops
async def test_unary_answer_and_error_trailers(serve: Serve) -> None:
    handlers = Handlers()
    _, connect = await serve(handlers)
    client = await connect()
    sid = await client.call("/t.S/Echo", frame(b"hello"), headers=(("x-token", "abc"),))
    assert await client.status(sid) == ("0", "")
    assert client.data[sid] == frame(b"hello")
    assert handlers.calls[0].metadata == {"x-token": "abc"}
    assert handlers.calls[0].expires is None
    # A handler's GrpcError: trailers-only, message percent-encoded (UTF-8, and '%').
    sid = await client.call("/t.S/Echo", frame(b"fail"))
    assert await client.status(sid) == ("5", "not found: caf%C3%A9 100%25")
    sid = await client.call("/t.S/Nope", frame(b""))
    assert (await client.status(sid))[0] == "12"  # UNIMPLEMENTED
    # A handler's bug fails its call (INTERNAL), not the connection.
    sid = await client.call("/t.S/Echo", frame(b"bug"))
    assert await client.status(sid) == ("13", "internal error: ValueError")
    sid = await client.call("/t.S/Echo", frame(b"after"))
    assert await client.status(sid) == ("0", "")


@both_loops
async def test_repeated_headers_are_read_afresh_for_each_call(serve: Serve) -> None:
    # The same headers call after call are read once (a memo): each call still gets
    # its own metadata, and a deadline is never taken from memory.
    handlers = Handlers()
    _, connect = await serve(handlers)
    client = await connect()
    token = (("x-token", "abc"),)
    for _ in range(2):
        sid = await client.call("/t.S/Echo", frame(b"x"), headers=token)
        assert await client.status(sid) == ("0", "")
    first, second = handlers.calls
    assert first.metadata == second.metadata == {"x-token": "abc"}
    for call in handlers.calls:
        call.metadata["x-token"] = "changed by a handler"
    sid = await client.call("/t.S/Echo", frame(b"x"), headers=token)
    assert await client.status(sid) == ("0", "")
    assert handlers.calls[2].metadata == {"x-token": "abc"}
    sid = await client.call("/t.S/Echo", frame(b"x"), headers=(("x-token", "other"),))
    assert await client.status(sid) == ("0", "")
    assert handlers.calls[3].metadata == {"x-token": "other"}
    for _ in range(2):
        sid = await client.call("/t.S/Echo", frame(b"x"), headers=(("grpc-timeout", "20S"),))
        assert await client.status(sid) == ("0", "")
    assert all(call.expires is not None for call in handlers.calls[4:])
    # Unknown methods are refused every time, never remembered as known.
    for _ in range(2):
        sid = await client.call("/t.S/Nope", frame(b""))
        assert (await client.status(sid))[0] == "12"


@both_loops
async def test_compression_gzip_taken_others_refused(serve: Serve) -> None:
    _, connect = await serve(Handlers())
    client = await connect()
    gz = (("grpc-encoding", "gzip"),)
    sid = await client.call("/t.S/Echo", frame(gzip.compress(b"zipped"), True), headers=gz)
    assert await client.status(sid) == ("0", "")
    assert client.data[sid] == frame(b"zipped")  # answered uncompressed
    assert "gzip" in client.headers(sid)[0]["grpc-accept-encoding"]
    sid = await client.call("/t.S/Echo", frame(b"x", True), headers=(("grpc-encoding", "snappy"),))
    code, message = await client.status(sid)
    assert code == "12"
    assert "snappy" in message
    assert "identity" in message
    # Compressed flag without an encoding, or bytes that do not inflate.
    sid = await client.call("/t.S/Echo", frame(b"x", True))
    assert (await client.status(sid))[0] == "13"
    sid = await client.call("/t.S/Echo", frame(b"not gzip", True), headers=gz)
    assert (await client.status(sid))[0] == "13"
    # A small message that inflates past the size cap is refused, not inflated.
    bomb = gzip.compress(b"\0" * (MAX + 1))
    sid = await client.call("/t.S/Echo", frame(bomb, True), headers=gz)
    assert (await client.status(sid))[0] == "8"


@both_loops
async def test_size_cap_and_malformed_calls(serve: Serve) -> None:
    handlers = Handlers()
    _, connect = await serve(handlers)
    client = await connect()
    # Only the prefix is sent: the declared length alone is refused.
    sid = await client.call("/t.S/Echo", struct.pack(">BI", 0, MAX + 1), end=False)
    code, message = await client.status(sid)
    assert code == "8"
    assert str(MAX) in message
    sid = await client.call("/t.S/Echo", frame(b"abc")[:6])  # ends inside a message
    assert (await client.status(sid))[0] == "13"
    sid = await client.call("/t.S/Echo", frame(b"a") + frame(b"b"))  # two for a unary call
    assert (await client.status(sid))[0] == "12"
    sid = await client.call("/t.S/Echo", frame(b"a"), headers=(("grpc-timeout", "soon"),))
    assert (await client.status(sid))[0] == "3"
    sid = await client.call("/t.S/Echo", frame(b"a"), content_type="text/plain")
    await client.until(lambda: client.headers(sid))
    assert client.headers(sid)[0][":status"] == "415"
    assert handlers.calls == []  # none of them reached a handler


@both_loops
async def test_deadline_reset_and_connection_loss_cancel(serve: Serve) -> None:
    handlers = Handlers()
    # Nothing else may cancel the call first: not its deadline, nor head_timeout
    # closing the connection once the reset leaves it without calls.
    _, connect = await serve(handlers, head_timeout=10 * WAIT_S)
    client = await connect()
    before = time.monotonic()
    sid = await client.call("/t.S/Slow", frame(b"a"), headers=(("grpc-timeout", "100S"),))
    await poll(lambda: handlers.calls)
    call = handlers.calls[0]
    assert call.expires is not None
    assert before + 99.9 < call.expires < time.monotonic() + 100.1
    # The client resets its stream: the handler is cancelled (long before the
    # deadline, which would cancel it too, were the wait for it not shorter).
    client.h2.reset_stream(sid, 8)
    await client.flush()
    with anyio.fail_after(WAIT_S):
        await handlers.cancelled.wait()
    assert call.gone
    # The connection is lost: its calls are cancelled too.
    handlers.cancelled = anyio.Event()
    other = await connect()
    await other.call("/t.S/Slow", frame(b"b"))
    await poll(lambda: len(handlers.calls) == 2)
    await other.socket.aclose()
    with anyio.fail_after(WAIT_S):
        await handlers.cancelled.wait()
    assert handlers.calls[1].gone


@both_loops
async def test_stream_backpressure_holds_the_client(serve: Serve) -> None:
    # A client streams faster than its handler takes messages: the server stops
    # acknowledging its data, so the client's window closes; nothing piles up.
    handlers = Handlers()
    _, connect = await serve(handlers)
    client = await connect()
    sid = await client.call("/t.S/Stream", end=False)
    message = frame(b"m" * 60_000)
    sent = 0
    with anyio.fail_after(WAIT_S):
        while True:
            room = min(client.h2.local_flow_control_window(sid), client.h2.max_outbound_frame_size)
            if room == 0:
                # Give the server every chance to acknowledge more; it must not.
                for _ in range(5):
                    with anyio.move_on_after(0.1):
                        await client.pump()
                if client.h2.local_flow_control_window(sid) == 0:
                    break
                continue
            chunk = message[sent % len(message) : sent % len(message) + room]
            client.h2.send_data(sid, chunk)
            sent += len(chunk)
            await client.flush()
    await handlers.reading.wait()
    assert len(handlers.taken) == 1
    # What the server holds is bounded: the backlog, plus one window of bytes.
    assert sent <= (_STREAM_BACKLOG + 2) * len(message) + _WINDOW
    handlers.release.set()
    # Released, the handler catches up and the window opens again.
    await client.until(lambda: client.h2.local_flow_control_window(sid) > 0)


@both_loops
async def test_large_answer_waits_for_the_clients_window(serve: Serve) -> None:
    _, connect = await serve(Handlers())
    client = await connect()
    big = bytes(range(256)) * 4096  # 1 MiB, past the client's 64 KiB window
    sid = await client.call("/t.S/Echo", frame(big[: MAX - 5]))
    # Sent in pieces, as the client acknowledges what it read (pump).
    assert await client.status(sid) == ("0", "")
    assert client.data[sid] == frame(big[: MAX - 5])


async def send_in_pieces(client: Client, sid: int, body: bytes, sizes: list[int]) -> None:
    """*body* as DATA frames of *sizes* in turn (within the windows), then the stream's end."""
    turn = 0
    while body:
        room = min(client.h2.local_flow_control_window(sid), client.h2.max_outbound_frame_size)
        if room == 0:
            await client.pump()  # the server's WINDOW_UPDATEs, as its handler takes messages
            continue
        size = min(sizes[turn % len(sizes)], room)
        turn += 1
        chunk, body = body[:size], body[size:]
        client.h2.send_data(sid, chunk)
        await client.flush()
    client.h2.end_stream(sid)
    await client.flush()


@both_loops
async def test_large_messages_cut_anywhere_round_trip_both_ways(serve: Serve) -> None:
    # Messages whose prefixes and bodies are cut across DATA frames of odd sizes, two
    # and more in one frame, and in all more than the stream's window: each arrives
    # whole (the server's WINDOW_UPDATEs let the rest in) and is echoed whole (each
    # answer waits for the client's window, as it reads).
    _, connect = await serve(Handlers())
    client = await connect()
    messages = [
        bytes([n]) * size for n, size in enumerate([300_000, 3, 0, 70_000, 1, 700_000, 4_000])
    ]
    sid = await client.call("/t.S/EchoStream", end=False)
    body = b"".join(map(frame, messages))
    assert len(body) > _WINDOW
    await send_in_pieces(client, sid, body, [16384, 1, 4, 7, 9000, 16383, 2, 5])
    assert await client.status(sid) == ("0", "")
    assert client.data[sid] == body
    # A unary call's message in frames of one byte to a whole frame: echoed whole.
    message = bytes(range(256)) * 1000
    sid = client.h2.get_next_available_stream_id()
    client.h2.send_headers(sid, [(k, v) for k, v in REQUEST_HEADERS])
    await send_in_pieces(client, sid, frame(message), [1, 2, 3, 5, 16384, 4099])
    assert await client.status(sid) == ("0", "")
    assert client.data[sid] == frame(message)


REQUEST_HEADERS = (
    (":method", "POST"),
    (":scheme", "http"),
    (":path", "/t.S/Echo"),
    (":authority", "x"),
    ("content-type", "application/grpc"),
    ("te", "trailers"),
)


@both_loops
async def test_ping_and_goaway_drain(serve: Serve) -> None:
    handlers = Handlers()
    server, connect = await serve(handlers)
    client = await connect()
    client.h2.ping(b"12345678")
    await client.flush()
    await client.until(lambda: any(isinstance(e, h2.events.PingAckReceived) for e in client.events))
    sid = await client.call("/t.S/Slow", frame(b"in flight"))
    await poll(lambda: handlers.calls)
    async with anyio.create_task_group() as nursery:
        nursery.start_soon(server.drain, WAIT_S)
        goaway = await client.until(
            lambda: [e for e in client.events if isinstance(e, h2.events.ConnectionTerminated)]
        )
        assert goaway[0].error_code == 0
        assert goaway[0].last_stream_id == sid
        nursery.cancel_scope.cancel()
    # (h2's client takes nothing after a GOAWAY: grpcio's below sees the answer.)


@both_loops
async def test_a_connection_that_starts_during_the_drain_is_told_to_go_away(
    serve: Serve,
) -> None:
    # As one whose TLS handshake ends after the drain began: its preface, then a GOAWAY at
    # once, rather than serving new calls until the drain period ends.
    handlers = Handlers()
    server, connect = await serve(handlers)
    async with anyio.create_task_group() as nursery:
        first = await connect()
        await first.call("/t.S/Slow", frame(b"holds the drain open"))
        await poll(lambda: handlers.calls)
        nursery.start_soon(server.drain, WAIT_S)
        await poll(lambda: server.draining)
        # Read as frames, not through h2's client, which refuses the SETTINGS ack that may
        # follow the GOAWAY.
        client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        client.initiate_connection()
        kinds = []
        async with await anyio.connect_tcp("127.0.0.1", server.port) as late:
            await late.send(client.data_to_send())
            data = b""
            with anyio.fail_after(WAIT_S):
                while 7 not in kinds:  # GOAWAY
                    data += await late.receive()
                    while len(data) >= 9 and len(data) >= 9 + int.from_bytes(data[:3], "big"):
                        kinds.append(data[3])
                        data = data[9 + int.from_bytes(data[:3], "big") :]
        assert kinds[0] == 4  # the server's preface (SETTINGS) first, then the GOAWAY
        nursery.cancel_scope.cancel()


@both_loops
async def test_drain_lets_a_call_in_flight_finish(serve: Serve) -> None:
    handlers = Handlers()
    server, _ = await serve(handlers)
    address = f"127.0.0.1:{server.port}"

    def call() -> bytes:
        with grpc.insecure_channel(address) as channel:
            answer: bytes = channel.unary_unary("/t.S/Slow")(b"in flight", timeout=WAIT_S)
            return answer

    async with anyio.create_task_group() as nursery:
        answers: list[bytes] = []

        async def client() -> None:
            answers.append(await anyio.to_thread.run_sync(call))

        nursery.start_soon(client)
        await poll(lambda: handlers.calls)
        drained = anyio.Event()

        async def drain() -> None:
            await server.drain(WAIT_S)
            drained.set()

        nursery.start_soon(drain)
        await poll(lambda: all(c._going_away for c in server.connections))
        assert not drained.is_set()
        assert not handlers.cancelled.is_set()
        handlers.release.set()
    assert answers == [b"in flight"]
    assert drained.is_set()
    assert not server.connections


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00"


@pytest.mark.parametrize(
    ("garbage", "code"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", 1),
        (PREFACE + b"\x00\x00\x01\x00\x00\x00\x00\x00\x00x", 1),
        # A header block that cannot be decoded is COMPRESSION_ERROR (RFC 9113 4.3).
        (PREFACE + b"\x00\x00\x04\x01\x05\x00\x00\x00\x01\xff\xff\xff\xff", 9),
        (PREFACE + b"\x00\x00\x01\x01\x05\x00\x00\x00\x02\x82", 1),
        # A frame over the 16 KiB this server takes: FRAME_SIZE_ERROR.
        (PREFACE + b"\x00\x40\x01\x00\x00\x00\x00\x00\x01", 6),
        # A header block interrupted by another frame.
        (PREFACE + b"\x00\x00\x01\x01\x01\x00\x00\x00\x01\x82" + PREFACE[24:], 1),
        # PING of the wrong length.
        (PREFACE + b"\x00\x00\x04\x06\x00\x00\x00\x00\x00abcd", 6),
        # DATA on a stream never opened.
        (PREFACE + b"\x00\x00\x01\x00\x00\x00\x00\x00\x03x", 1),
    ],
    ids=[
        "http1",
        "data-on-stream-0",
        "bad-hpack",
        "even-stream-id",
        "frame-too-large",
        "interrupted-headers",
        "bad-ping",
        "data-on-idle-stream",
    ],
)
@both_loops
async def test_garbage_closes_only_its_connection(
    serve: Serve, garbage: bytes, code: int, caplog: pytest.LogCaptureFixture
) -> None:
    server, connect = await serve(Handlers())
    answer = b""
    async with await anyio.connect_tcp("127.0.0.1", server.port) as socket_:
        bad = Client(socket_)
        await socket_.send(garbage)
        with anyio.fail_after(WAIT_S):
            while data := await bad.receive():
                answer += data
    # The server says why (GOAWAY and its error code) and closes the connection.
    assert b"\x00\x00\x08\x07\x00\x00\x00\x00\x00" in answer
    assert answer.endswith(struct.pack(">I", code))
    # The server is unharmed: another connection is served.
    client = await connect()
    sid = await client.call("/t.S/Echo", frame(b"still here"))
    assert await client.status(sid) == ("0", "")
    # Refused as HTTP/2 errors, not met as bugs.
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_sigterm_lets_a_call_in_flight_finish(tmp_path: Path) -> None:
    # Through trioinfer serve: SIGTERM sends GOAWAY, and a call already running
    # gets its answer within the drain period before the server exits (with 0).
    import tritonclient.grpc as triton

    import test_grpc
    from trioinfer.testing import models

    root = tmp_path / "repository"
    models.write_slow(root / "slow" / "1" / "model.onnx", width=test_grpc.SLOW_WIDTH)
    (root / "slow" / "config.toml").write_text(test_grpc.SLOW_CONFIG)
    log = tmp_path / "server.log"
    with (
        test_grpc.run_server(root, "--drain-period", "60", log=log) as server,
        triton.InferenceServerClient(server.grpc) as client,
    ):
        answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
        rows = test_grpc.BLOCKER_ROWS
        client.async_infer(
            "slow", test_grpc.slow_input(rows), lambda result, error: answers.put((result, error))
        )
        test_grpc.wait_until(
            lambda: test_grpc.slow_state(server)[0] == 1 or not answers.empty(),
            "the call is running",
        )
        server.process.send_signal(signal.SIGTERM)
        result, error = answers.get(timeout=WAIT_S)
        assert error is None, str(error)
        assert result.as_numpy("y").shape == (rows, test_grpc.SLOW_WIDTH)
        assert server.process.wait(timeout=WAIT_S) == 0
    assert "Traceback" not in server.log_text()


# -- the hpack memo: the same headers as hpack's own coder, whatever the table did --------

#: Header lists as a client sends them call after call: repeats (which the memo answers),
#: new values that push entries through a small dynamic table (shifting every index),
#: and metadata that changes per call.
_BLOCKS: list[list[tuple[bytes, bytes]]] = [
    [(b":method", b"POST"), (b":path", b"/a"), (b"x-key", b"one")],
    [(b":method", b"POST"), (b":path", b"/a"), (b"x-key", b"one")],
    [(b":method", b"POST"), (b":path", b"/a"), (b"x-key", b"one")],
    [(b":method", b"POST"), (b":path", b"/b"), (b"x-key", b"two" * 20)],
    [(b":method", b"POST"), (b":path", b"/a"), (b"x-key", b"one")],
    [(b":method", b"POST"), (b":path", b"/b"), (b"x-key", b"two" * 20)],
    [(b":method", b"POST"), (b":path", b"/c"), (b"x-other", b"three" * 10)],
    [(b":method", b"POST"), (b":path", b"/a"), (b"x-key", b"one")],
    [(b":method", b"POST"), (b":path", b"/a"), (b"x-key", b"one")],
]


def test_decoder_memo_follows_the_dynamic_table() -> None:
    # A small table evicts entries as new ones come, so the same index bytes name
    # other headers later: a memo that outlived a table change would answer wrongly.
    client = hpack.Encoder()
    client.header_table_size = 160
    decoder = _Decoder()
    decoder.header_table_size = 160
    sent = [client.encode(headers) for headers in _BLOCKS * 3]
    # The repeats do come as index bytes only, and the same bytes mean different headers.
    assert sent[1] == sent[2]
    got = [[tuple(h) for h in decoder.decode(block, raw=True)] for block in sent]
    assert got == [list(h) for h in _BLOCKS * 3]
    assert decoder._memo, "the repeated blocks were not remembered"


def test_decoder_memo_sees_a_table_size_update() -> None:
    client = hpack.Encoder()
    decoder = _Decoder()
    first = client.encode(_BLOCKS[0])
    again = client.encode(_BLOCKS[0])
    assert [tuple(h) for h in decoder.decode(first, raw=True)] == _BLOCKS[0]
    assert [tuple(h) for h in decoder.decode(again, raw=True)] == _BLOCKS[0]
    client.header_table_size = 0  # empties the table: the next block says so first
    shrunk = client.encode(_BLOCKS[0])
    assert [tuple(h) for h in decoder.decode(shrunk, raw=True)] == _BLOCKS[0]
    assert not decoder._memo


def test_encoder_memo_round_trips_through_table_changes() -> None:
    # What the memo sends must decode, on a plain hpack decoder, to what was asked,
    # through evictions and a table size change the peer asked for.
    encoder = _Encoder()
    peer = hpack.Decoder()
    answers = [
        [(b":status", b"200"), (b"content-type", b"application/grpc")],
        [(b"grpc-status", b"0")],
        [(b"grpc-status", b"3"), (b"grpc-message", b"bad input " * 8)],
    ]
    remembered = 0
    for round_ in range(3):
        if round_ == 1:
            # The peer's SETTINGS_HEADER_TABLE_SIZE: the next block must say so first.
            encoder.header_table_size = 96
            peer.max_allowed_table_size = 96  # what h2 does once its setting is acknowledged
        for headers in answers * 4:
            block = encoder.encode(list(headers))
            assert [tuple(h) for h in peer.decode(block, raw=True)] == headers
            remembered = max(remembered, len(encoder._memo))
    assert remembered, "the repeated answers were not remembered"


# -- what a hostile or broken client can make the server hold or wait for --------------


@both_loops
async def test_unary_call_with_a_second_message_fails_at_once(serve: Serve) -> None:
    server, connect = await serve(Handlers())
    client = await connect()
    # Messages without END_STREAM: the second one ends the call (a cardinality
    # violation), instead of the server buffering all that come.
    sid = await client.call("/t.S/Echo", frame(b"x" * 1000) * 50, end=False)
    code, message = await client.status(sid)
    assert code == "12"
    assert "one request message" in message
    await client.until(lambda: [e for e in client.events if isinstance(e, h2.events.StreamReset)])
    (conn,) = server.connections
    assert conn._held == 0
    assert not conn._streams
    sid = await client.call("/t.S/Echo", frame(b"after"))
    assert await client.status(sid) == ("0", "")


@both_loops
async def test_buffered_request_bytes_have_a_budget(serve: Serve) -> None:
    # Two calls each inside a large message: the budget is spent, so only the
    # older one's bytes are acknowledged; the other waits for its window.
    # (Over half the window each: h2 sends WINDOW_UPDATE only past that.)
    server, connect = await serve(Handlers(), max_buffered=100_000)
    client = await connect()
    head = frame(b"x" * (MAX - 5))[:600_000]
    await client.until(
        lambda: [e for e in client.events if isinstance(e, h2.events.RemoteSettingsChanged)]
    )
    first = await client.call("/t.S/Echo", head, end=False)
    second = await client.call("/t.S/Echo", head, end=False)
    shut = client.h2.local_flow_control_window(second)
    assert shut == client.h2.local_flow_control_window(first)
    await client.until(lambda: client.h2.local_flow_control_window(first) > shut)
    for _ in range(3):
        with anyio.move_on_after(0.05):
            await client.pump()
    assert client.h2.local_flow_control_window(second) == shut
    (conn,) = server.connections
    assert conn._held == 2 * len(head)
    # The older call goes away: the other's bytes are let in.
    client.h2.reset_stream(first, 8)
    await client.flush()
    await client.until(lambda: client.h2.local_flow_control_window(second) > shut)
    await poll(lambda: conn._held == len(head))


async def _flood(client: Client) -> None:
    ping = PingFrame(0)
    ping.opaque_data = b"12345678"
    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
        while True:
            await client.socket.send(ping.serialize() * 4000)


async def _not_reading(server: GrpcServer) -> Client:
    # A small receive buffer, set before connecting (it sizes the TCP window).
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))  # type: ignore[attr-defined]  # loopback: at once
    client = Client(await anyio.abc.SocketStream.from_socket(sock))
    await client.start()
    return client


@both_loops
async def test_a_drained_connection_closes_without_destroying_the_unread_answer(
    serve: Serve, task_group: anyio.abc.TaskGroup
) -> None:
    # At the end of a drain the server closes the connection. A client still reading
    # the last answer (slow, or on a loaded machine) sends on meanwhile (grpcio sends
    # WINDOW_UPDATEs and PINGs as it reads): closing with that input unread made the
    # kernel reset the connection, which destroyed what the client had not read yet,
    # and a call answered within the drain failed (UNAVAILABLE) or hung.
    handlers = Handlers()
    server, _ = await serve(handlers)
    client = await _not_reading(server)
    client.h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 2**31 - 1})
    client.h2.increment_flow_control_window(2**30)
    body = bytes(range(256)) * 3000  # far more than the client's socket buffer takes
    sid = await client.call("/t.S/Slow", frame(body))
    await poll(lambda: handlers.calls)
    task_group.start_soon(server.drain, WAIT_S)
    await poll(lambda: all(c._going_away for c in server.connections))
    handlers.release.set()
    # Answered, and done with: the server reads no more of this connection and closes
    # its side, most of the answer still in its socket buffer.
    await poll(lambda: all(c.lingering for c in server.connections))
    ping = PingFrame(0)
    ping.opaque_data = b"12345678"
    received = bytearray()
    try:
        await client.socket.send(ping.serialize())  # the client, reading only now, says so
        with anyio.fail_after(WAIT_S):
            while data := await client.receive():
                received += data
    except anyio.BrokenResourceError as exc:
        pytest.fail(f"the connection was reset after {len(received)} bytes: {exc!r}")
    finally:
        await client.socket.aclose()
    # Read frame by frame: h2's client state machine takes nothing after a GOAWAY.
    frames = _frames(bytes(received))
    answer = b"".join(f.data for f in frames if isinstance(f, DataFrame) and f.stream_id == sid)
    assert answer == frame(body)
    decoder = hpack.Decoder()
    blocks = [dict(decoder.decode(f.data)) for f in frames if isinstance(f, HeadersFrame)]
    assert blocks[-1].get("grpc-status") == "0"
    assert isinstance(frames[-1], GoAwayFrame)


@both_loops
async def test_a_client_that_never_closes_holds_no_shutdown_past_the_drain(
    serve: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    # After its last frames the server reads and drops what the client still sends until
    # the client closes too (the linger). A client that never closes (hung, or its host
    # gone) must not hold the server's shutdown past the drain period: the linger was
    # shielded, so every such connection held serve_grpc's end for _LINGER_S after the
    # drain, whatever the period said. The linger longer than this test waits:
    monkeypatch.setattr(_grpc_h2, "_LINGER_S", WAIT_S * 10)
    ended = anyio.Event()
    run = _grpc_h2._Connection.run

    async def run_then_say(conn: _grpc_h2._Connection) -> None:
        try:
            await run(conn)
        finally:
            ended.set()

    monkeypatch.setattr(_grpc_h2._Connection, "run", run_then_say)
    server, connect = await serve(Handlers())
    await connect()  # and never closes, nor reads
    await poll(lambda: server.connections)
    await server.drain(0)  # the GOAWAY is sent; the drain period is over at once
    server.stop()  # type: ignore[attr-defined]  # as serve_grpc at the drain's end
    with anyio.fail_after(WAIT_S):
        await ended.wait()


def _frames(data: bytes) -> list[Frame]:
    """The HTTP/2 frames that *data* (what a connection sent, after its preface) holds."""
    frames: list[Frame] = []
    pos = 0
    while pos < len(data):
        parsed, length = Frame.parse_frame_header(memoryview(data[pos : pos + 9]))
        parsed.parse_body(memoryview(data[pos + 9 : pos + 9 + length]))
        frames.append(parsed)
        pos += 9 + length
    return frames


@both_loops
async def test_a_client_that_does_not_read_is_held_then_dropped(
    serve: Serve, task_group: anyio.abc.TaskGroup, caplog: pytest.LogCaptureFixture
) -> None:
    # PINGs sent without reading their acks: the server stops reading once its
    # output passes the limit, so nothing piles up; send_timeout then drops it.
    server, _ = await serve(Handlers(), send_timeout=0.5)
    client = await _not_reading(server)
    await poll(lambda: server.connections)
    (conn,) = server.connections
    task_group.start_soon(_flood, client)
    peak = 0
    with anyio.fail_after(WAIT_S):
        while server.connections:
            peak = max(peak, len(conn._extra) + conn._h2.bytes_to_send())
            await anyio.sleep(0.01)
    # One read past the limit (65536 bytes of PINGs: as many bytes of acks), plus the
    # odd control frame the same write carried (a WINDOW_UPDATE, 13 bytes, was seen).
    assert peak <= _OUTPUT_LIMIT + 65536 + 64
    await client.socket.aclose()
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


@both_loops
async def test_a_client_reset_mid_send_is_no_error(
    serve: Serve, task_group: anyio.abc.TaskGroup, caplog: pytest.LogCaptureFixture
) -> None:
    server, _ = await serve(Handlers())
    client = await _not_reading(server)
    task_group.start_soon(_flood, client)
    # The server's reading waits for its writing, which waits for the client.
    await poll(
        lambda: any(
            len(c._extra) + c._h2.bytes_to_send() > _OUTPUT_LIMIT for c in server.connections
        )
    )
    # The client's TCP reset while the server is sending to it: an ordinary end.
    raw = client.socket.extra(anyio.abc.SocketAttribute.raw_socket)
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    await client.socket.aclose()
    await poll(lambda: not server.connections)
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


@both_loops
async def test_a_connection_without_calls_is_closed(serve: Serve) -> None:
    server, connect = await serve(Handlers(), head_timeout=0.2)
    client = await connect()
    sid = await client.call("/t.S/Echo", frame(b"one"))
    assert await client.status(sid) == ("0", "")
    # Idle since: GOAWAY, then the connection is closed.
    answer = b""
    with anyio.fail_after(WAIT_S):
        while data := await client.receive():
            answer += data
    assert b"\x07\x00\x00\x00\x00\x00" in answer  # a GOAWAY frame
    await poll(lambda: not server.connections)


@both_loops
async def test_a_connection_with_short_calls_is_kept(serve: Serve) -> None:
    # Calls come more often than head_timeout, each over before anyone looks; the
    # connection outlives head_timeout three times over. (The gap between calls is
    # 0.05 s plus a call's latency: a head_timeout of 0.2 s failed once at load 6.)
    server, connect = await serve(Handlers(), head_timeout=0.4)
    client = await connect()
    for _ in range(24):
        sid = await client.call("/t.S/Echo", frame(b"again"))
        assert await client.status(sid) == ("0", "")
        await anyio.sleep(0.05)
    assert not [e for e in client.events if isinstance(e, h2.events.ConnectionTerminated)]
    assert len(server.connections) == 1


@both_loops
async def test_a_request_that_stops_arriving_fails(serve: Serve) -> None:
    _, connect = await serve(Handlers(), body_timeout=0.2)
    client = await connect()
    sid = await client.call("/t.S/Echo", frame(b"x" * 100)[:50], end=False)
    code, message = await client.status(sid)
    assert code == "1"
    assert "body_timeout" in message


@both_loops
async def test_client_deadline_holds_over_the_whole_call(serve: Serve) -> None:
    _, connect = await serve(Handlers())
    client = await connect()
    deadline = (("grpc-timeout", "100m"),)
    # While the request still arrives.
    sid = await client.call("/t.S/Echo", frame(b"x" * 100)[:50], headers=deadline, end=False)
    assert (await client.status(sid))[0] == "4"
    # While the answer waits for the client's window (here shut).
    client.h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
    await client.flush()
    sid = await client.call("/t.S/Echo", frame(b"abc"), headers=deadline)
    assert (await client.status(sid))[0] == "4"
    assert sid not in client.data


@pytest.mark.parametrize("path", ["/t.S/Echo", "/t.S/EchoStream"])
@both_loops
async def test_an_answer_the_client_never_reads_ends_its_call_after_send_timeout(
    serve: Serve, path: str
) -> None:
    # A client that opens no window for its answer (and gave no grpc-timeout): the
    # answer waited for it for ever, holding its call (and a model's stream, whose
    # request's own timeout is held off while a message is written: send_whole).
    server, connect = await serve(Handlers(), send_timeout=0.3)
    client = await connect()
    client.h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
    await client.flush()
    sid = await client.call(path, frame(b"abc"))
    code, message = await client.status(sid)
    assert code == "1"
    assert "send_timeout" in message
    assert sid not in client.data
    # Its call is over (nothing of it held); the connection serves on.
    (conn,) = server.connections
    await poll(lambda: not conn._streams)


@both_loops
async def test_client_deadline_holds_while_a_stream_is_idle(serve: Serve) -> None:
    handlers = Handlers()
    _, connect = await serve(handlers)
    client = await connect()
    sid = await client.call(
        "/t.S/Stream", frame(b"one"), headers=(("grpc-timeout", "100m"),), end=False
    )
    # The handler answers, then waits (for its release, or for the next message).
    assert (await client.status(sid))[0] == "4"
    assert client.data[sid] == frame(b"got one")


@pytest.mark.parametrize("value", ["1\u00b2S", "+1S", "123456789S", "1s", ""])
@both_loops
async def test_a_bad_grpc_timeout_fails_its_call_only(serve: Serve, value: str) -> None:
    server, connect = await serve(Handlers())
    client = await connect()
    # As raw bytes: h2 would send a str as UTF-8.
    raw = ((b"grpc-timeout", value.encode("latin-1", "replace")),)
    sid = await client.call("/t.S/Echo", frame(b"x"), headers=raw)  # type: ignore[arg-type]
    code, message = await client.status(sid)
    assert code == "3"
    assert "grpc-timeout" in message
    sid = await client.call("/t.S/Echo", frame(b"after"))
    assert await client.status(sid) == ("0", "")
    assert len(server.connections) == 1


@both_loops
async def test_a_call_cut_off_by_the_drain_is_told_unavailable(serve: Serve) -> None:
    handlers = Handlers()
    server, _ = await serve(handlers)
    address = f"127.0.0.1:{server.port}"

    def call() -> grpc.RpcError | None:
        with grpc.insecure_channel(address) as channel:
            try:
                channel.unary_unary("/t.S/Slow")(b"in flight", timeout=WAIT_S)
            except grpc.RpcError as exc:
                return exc
            return None

    async with anyio.create_task_group() as nursery:
        errors: list[Any] = []

        async def client() -> None:
            errors.append(await anyio.to_thread.run_sync(call))

        nursery.start_soon(client)
        await poll(lambda: handlers.calls)
        await server.drain(0.05)
        server.stop()
    (error,) = errors
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "server stopped" in error.details()


@both_loops
async def test_rapid_resets_get_goaway(serve: Serve, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_grpc_h2, "_RESET_RATE", 1)
    handlers = Handlers()
    server, connect = await serve(handlers)
    client = await connect()
    # All in one write: the server reads it all before it closes (no TCP reset).
    for _ in range(int(_grpc_h2._RESET_WINDOW_S) + 5):
        sid = client.h2.get_next_available_stream_id()
        client.h2.send_headers(
            sid,
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", "/t.S/Slow"),
                (":authority", "x"),
                ("content-type", "application/grpc"),
            ],
        )
        client.h2.reset_stream(sid, 8)
    await client.flush()
    goaway = await client.until(
        lambda: [e for e in client.events if isinstance(e, h2.events.ConnectionTerminated)]
    )
    assert goaway[0].error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
    await poll(lambda: not server.connections)


def raw_frame(kind: int, flags: int, sid: int, payload: bytes) -> bytes:
    """One HTTP/2 frame as bytes, for what h2's client refuses to send."""
    return (
        struct.pack(">I", len(payload))[1:]
        + bytes((kind, flags))
        + struct.pack(">I", sid)
        + payload
    )


@pytest.mark.parametrize(
    "offence",
    [
        raw_frame(0x8, 0, 0, b"\0\0\0\0"),  # WINDOW_UPDATE of 0 on the stream
        raw_frame(0x0, 0, 0, b"x"),  # DATA after the stream's END_STREAM
    ],
    ids=["window-update-0", "data-after-end"],
)
@both_loops
async def test_resets_a_client_forces_count_as_rapid_resets(
    serve: Serve, monkeypatch: pytest.MonkeyPatch, offence: bytes
) -> None:
    # A stream error the client provokes frees the stream and cancels its call as its
    # own RST_STREAM would: counting only RST_STREAM let calls start and be thrown
    # away without limit (MadeYouReset, CVE-2025-8671).
    monkeypatch.setattr(_grpc_h2, "_RESET_RATE", 1)
    _server, connect = await serve(Handlers())
    client = await connect()
    # All in one write: the server reads it all before it closes (no TCP reset).
    wire = b""
    for _ in range(int(_grpc_h2._RESET_WINDOW_S) + 5):
        sid = client.h2.get_next_available_stream_id()
        client.h2.send_headers(
            sid,
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", "/t.S/Slow"),
                (":authority", "x"),
                ("content-type", "application/grpc"),
            ],
        )
        client.h2.send_data(sid, frame(b"x"), end_stream=True)
        # The offence, addressed to this stream (its id in the frame head's last 4 bytes).
        wire += client.h2.data_to_send() + offence[:5] + struct.pack(">I", sid) + offence[9:]
    await client.socket.send(wire)
    goaway = await client.until(
        lambda: [e for e in client.events if isinstance(e, h2.events.ConnectionTerminated)]
    )
    assert goaway[0].error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM


class Stuck(Handlers):
    """A streaming method that takes one message, then never reads again."""

    async def stuck(
        self,
        messages: AsyncIterator[bytes],
        call: GrpcCall,
        send: Callable[[bytes], Awaitable[None]],
    ) -> None:
        async for _ in messages:
            await anyio.sleep_forever()

    def methods(self) -> dict[str, Method]:
        return {**super().methods(), "/t.S/Stuck": Method(self.stuck, streaming=True)}


@both_loops
async def test_a_reset_stream_gives_back_the_connection_window_it_held(serve: Serve) -> None:
    # Bytes held back for a handler that fell behind were never acknowledged once
    # the client reset the stream: each cancelled streaming call shrank the
    # connection's window until no call on it could send again.
    _server, connect = await serve(Stuck())
    client = await connect()
    await client.until(lambda: client.h2.outbound_flow_control_window > 65_535)
    window = client.h2.outbound_flow_control_window
    body = frame(b"z" * 60_000) * 40
    for _ in range(2 * window // len(body) + 4):
        sid = await client.call("/t.S/Stuck", end=False)
        sent = 0
        while room := min(
            client.h2.local_flow_control_window(sid),
            client.h2.max_outbound_frame_size,
            len(body) - sent,
        ):
            client.h2.send_data(sid, body[sent : sent + room])
            sent += room
        client.h2.reset_stream(sid, 8)
        # Once the PING is answered the server has taken in all that came before it.
        client.h2.ping(b"resetdon")
        await client.flush()
        await client.until(
            lambda: [e for e in client.events if isinstance(e, h2.events.PingAckReceived)]
        )
        client.events.clear()
        # Handed back in steps of half the window at most: never lower than that.
        assert client.h2.outbound_flow_control_window >= window // 2
    with anyio.fail_after(WAIT_S):
        sid = await client.call("/t.S/Echo", frame(b"x"))
    assert await client.status(sid) == ("0", "")


@both_loops
async def test_no_call_outlives_its_connection() -> None:
    # As a task group's children: the connection ends when its calls have, their
    # clean-up included (on asyncio the calls are plain tasks, waited for by hand).
    started = anyio.Event()
    finished: list[bool] = []

    async def slow(message: bytes, call: GrpcCall) -> bytes:
        started.set()
        try:
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.sleep(0.05)  # a handler's clean-up that takes a while
            finished.append(True)
        return b""

    server = GrpcServer({"/t.S/Slow": Method(slow, streaming=False)}, MAX)
    seen_at_end: list[list[bool]] = []
    async with await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0) as listener:
        port = listener.extra(anyio.abc.SocketAttribute.local_port)

        async def one_connection(socket: anyio.abc.SocketStream) -> None:
            await server.connection(socket)
            seen_at_end.append(list(finished))
            group.cancel_scope.cancel()  # one connection only

        async with anyio.create_task_group() as group:
            group.start_soon(listener.serve, one_connection)
            client = Client(await anyio.connect_tcp("127.0.0.1", port))
            await client.start()
            await client.call("/t.S/Slow", frame(b"a"))
            with anyio.fail_after(WAIT_S):
                await started.wait()
            await client.socket.aclose()
    assert seen_at_end == [[True]]


class _Recording:
    """A socket's sendmsg and send, recorded and passed on (a socket's own cannot be patched)."""

    def __init__(self, sock: socket.socket, *, refuse: bool = False) -> None:
        self.sock = sock
        self.sendmsg_sizes: list[int] = []
        self.refuse = refuse

    def sendmsg(self, buffers: list[bytes]) -> int:
        if self.refuse:
            raise BlockingIOError
        sent = self.sock.sendmsg(buffers)
        self.sendmsg_sizes.append(sent)
        return sent

    def send(self, data: bytes) -> int:
        if self.refuse:
            raise BlockingIOError
        return self.sock.send(data)


@both_loops
async def test_large_answers_are_written_by_their_calls_on_trio(serve: Serve) -> None:
    # On Trio an answer of _WRITE_AT_ONCE bytes or more leaves from its call's task
    # (headers, data and trailers in one sendmsg); a small one is left to the writer;
    # on asyncio both are left to the writer (its transport may hold bytes back).
    server, connect = await serve(Handlers())
    client = await connect()
    await poll(lambda: server.connections)
    (conn,) = server.connections
    raw = conn._raw
    if sniffio.current_async_library() == "asyncio":
        assert raw is None
        return
    assert raw is not None
    recording = conn._raw = _Recording(raw)  # type: ignore[assignment]
    small = b"s" * 100
    assert len(small) < _grpc_h2._WRITE_AT_ONCE <= len(bytes(range(256)) * 40)
    large = bytes(range(256)) * 40  # 10 KiB: one frame
    for body in (small, large):
        sid = await client.call("/t.S/Echo", frame(body))
        assert await client.status(sid) == ("0", "")
        assert client.data[sid] == frame(body)
    assert len(recording.sendmsg_sizes) == 1
    assert recording.sendmsg_sizes[0] > len(frame(large))


@both_loops
async def test_a_large_answer_the_socket_does_not_take_is_left_to_the_writer(
    serve: Serve,
) -> None:
    # A socket that takes nothing now (full): the answer is sent by the writer, whole
    # and in order with the answers after it.
    server, connect = await serve(Handlers())
    client = await connect()
    await poll(lambda: server.connections)
    (conn,) = server.connections
    if sniffio.current_async_library() == "trio":
        conn._raw = _Recording(conn._raw, refuse=True)  # type: ignore[arg-type,assignment]
    bodies = [bytes([n]) * (3000 + 1000 * n) for n in range(6)]
    sids = [await client.call("/t.S/Echo", frame(body)) for body in bodies]
    for sid, body in zip(sids, bodies, strict=True):
        assert await client.status(sid) == ("0", "")
        assert client.data[sid] == frame(body)


@both_loops
async def test_large_answers_to_a_slow_reader_arrive_whole_and_in_order(serve: Serve) -> None:
    # A client with a small receive buffer that reads only after its calls are
    # answered: the direct writes fill the socket, what it does not take goes to the
    # writer, and every answer arrives whole (answers of one frame and of several).
    server, _ = await serve(Handlers())
    client = await _not_reading(server)
    bodies = [bytes([n]) * size for n, size in enumerate([16000, 4000, 40000, 2048, 9000] * 3)]
    sids = []
    for body in bodies:
        sids.append(await client.call("/t.S/Echo", frame(body)))
    await anyio.sleep(0.05)  # the calls answer into a socket nobody reads yet
    try:
        for sid, body in zip(sids, bodies, strict=True):
            assert await client.status(sid) == ("0", "")
            assert client.data[sid] == frame(body)
    finally:
        await client.socket.aclose()


class Reused(Handlers):
    """Handlers that record which task ran each call, and the deadline it ran under."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, float]] = []
        self.gone: list[bytes] = []
        self.releases: dict[bytes, anyio.Event] = {}

    async def where(self, raw: bytes, call: GrpcCall) -> bytes:
        self.seen.append((anyio.get_current_task().id, anyio.current_effective_deadline()))
        if raw == b"leave":
            # The client leaves as the call finishes: its scope is cancelled, never entered
            # again (no checkpoint follows, so nothing is raised in this call).
            call.cancel()
            return raw
        if raw.startswith(b"wait"):
            # Waits for its own release; a client that leaves cancels it.
            try:
                await self.releases.setdefault(raw, anyio.Event()).wait()
            except anyio.get_cancelled_exc_class():
                self.gone.append(raw)
                raise
        return raw

    def methods(self) -> dict[str, Method]:
        return {**super().methods(), "/t.S/Where": Method(self.where, streaming=False)}


def connection_of(server: GrpcServer) -> Any:
    (conn,) = server.connections
    return conn


@both_loops
async def test_sequential_calls_reuse_a_task_each_with_its_own_deadline(serve: Serve) -> None:
    """On Trio one task answers a connection's calls one after another, each its own deadline.

    A call's deadline is cleared after it; a call after one whose deadline passed, or
    one its client reset, runs as if nothing happened before it.
    """
    handlers = Reused()
    _, connect = await serve(handlers, head_timeout=10 * WAIT_S)
    client = await connect()
    before = anyio.current_time()
    sid = await client.call("/t.S/Where", frame(b"a"), headers=(("grpc-timeout", "100S"),))
    assert await client.status(sid) == ("0", "")
    assert before + 99 < handlers.seen[-1][1] < anyio.current_time() + 101
    sid = await client.call("/t.S/Where", frame(b"b"))
    assert await client.status(sid) == ("0", "")
    assert handlers.seen[-1][1] == float("inf")
    # Its deadline passes: DEADLINE_EXCEEDED; the next call is not expired.
    sid = await client.call("/t.S/Where", frame(b"wait1"), headers=(("grpc-timeout", "50m"),))
    assert await client.status(sid) == (
        "4",
        "the client's deadline passed before the call finished",
    )
    assert handlers.gone == [b"wait1"]
    sid = await client.call("/t.S/Where", frame(b"c"))
    assert await client.status(sid) == ("0", "")
    assert handlers.seen[-1][1] == float("inf")
    sid = await client.call("/t.S/Where", frame(b"d"), headers=(("grpc-timeout", "100S"),))
    assert await client.status(sid) == ("0", "")
    assert handlers.seen[-1][1] < anyio.current_time() + 101
    # Its client resets it: it is cancelled; the next call works.
    sid = await client.call("/t.S/Where", frame(b"wait2"))
    await poll(lambda: len(handlers.seen) == 6)
    client.h2.reset_stream(sid, 8)
    await client.flush()
    await poll(lambda: handlers.gone == [b"wait1", b"wait2"])
    sid = await client.call("/t.S/Where", frame(b"e"))
    assert await client.status(sid) == ("0", "")
    assert client.data[sid] == frame(b"e")
    assert handlers.seen[-1][1] == float("inf")
    # Cancelled as it finished, without a checkpoint after: the next call runs.
    sid = await client.call("/t.S/Where", frame(b"leave"))
    assert (await client.status(sid))[0] == "0"
    sid = await client.call("/t.S/Where", frame(b"f"))
    assert await client.status(sid) == ("0", "")
    if sniffio.current_async_library() == "trio":
        assert len({task for task, _ in handlers.seen}) == 1


@both_loops
async def test_a_cancelled_call_among_reused_tasks_cancels_only_itself(serve: Serve) -> None:
    handlers = Reused()
    server, connect = await serve(handlers, head_timeout=10 * WAIT_S)
    client = await connect()
    names = [b"wait-a", b"wait-b", b"wait-c"]
    trio_loop = sniffio.current_async_library() == "trio"
    # Three calls at once: three tasks, which wait for calls once they answered.
    sids = [await client.call("/t.S/Where", frame(name)) for name in names]
    await poll(lambda: len(handlers.seen) == 3)
    for name in names:
        handlers.releases.pop(name).set()
    for sid in sids:
        assert await client.status(sid) == ("0", "")
    first = {task for task, _ in handlers.seen}
    if trio_loop:
        await poll(lambda: len(connection_of(server)._idle) == 3)
    # Three more run in those tasks; the middle call's client resets it.
    sids = [await client.call("/t.S/Where", frame(name)) for name in names]
    await poll(lambda: len(handlers.seen) == 6)
    if trio_loop:
        assert {task for task, _ in handlers.seen[3:]} == first
    client.h2.reset_stream(sids[1], 8)
    await client.flush()
    await poll(lambda: handlers.gone == [b"wait-b"])
    handlers.releases[b"wait-a"].set()
    handlers.releases[b"wait-c"].set()
    assert await client.status(sids[0]) == ("0", "")
    assert await client.status(sids[2]) == ("0", "")
    assert client.data[sids[0]] == frame(b"wait-a")
    assert client.data[sids[2]] == frame(b"wait-c")
    assert handlers.gone == [b"wait-b"]
    sid = await client.call("/t.S/Where", frame(b"after"))
    assert await client.status(sid) == ("0", "")


@both_loops
async def test_idle_call_tasks_are_capped_and_end_with_their_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_grpc_h2, "_IDLE_CALLS", 2)
    handlers = Reused()
    server = GrpcServer(handlers.methods(), MAX, head_timeout=10 * WAIT_S)
    trio_loop = sniffio.current_async_library() == "trio"
    ended: list[Any] = []
    async with await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0) as listener:
        port = listener.extra(anyio.abc.SocketAttribute.local_port)

        async def one_connection(socket: anyio.abc.SocketStream) -> None:
            await server.connection(socket)  # returns once its nursery has exited
            ended.append(conn)
            group.cancel_scope.cancel()  # one connection only

        async with anyio.create_task_group() as group:
            group.start_soon(listener.serve, one_connection)
            client = Client(await anyio.connect_tcp("127.0.0.1", port))
            await client.start()
            names = [b"wait-%d" % i for i in range(4)]
            sids = [await client.call("/t.S/Where", frame(name)) for name in names]
            await poll(lambda: len(handlers.seen) == 4)
            conn = connection_of(server)
            for name in names:
                handlers.releases[name].set()
            for sid in sids:
                assert await client.status(sid) == ("0", "")
            if trio_loop:
                # Four tasks answered; two wait for calls, two ended (beside them the
                # writer and the watchdog).
                await poll(lambda: len(conn._group.child_tasks) == 4)
                assert len(conn._idle) == 2
            else:
                await poll(lambda: not conn._asyncio_calls._tasks)
            await client.socket.aclose()
            with anyio.fail_after(WAIT_S):
                await anyio.sleep_forever()
    assert ended == [conn]
    assert conn._idle == []
    if trio_loop:
        assert not conn._group.child_tasks


class _Counted(dict[str, Method]):
    """The methods, counting the passes over them."""

    passes = 0

    def items(self) -> Any:
        self.passes += 1
        return super().items()


@both_loops
async def test_the_request_log_names_each_call_without_a_pass_over_the_methods(
    serve: Serve, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Each logged call looked its path up by a pass over every served method.
    monkeypatch.setattr(REQUESTS, "on", True)
    caplog.set_level(logging.INFO, logger="trioinfer.access")
    handlers = Handlers()
    methods = _Counted(handlers.methods())
    handlers.methods = lambda: methods  # type: ignore[method-assign]
    _, connect = await serve(handlers)
    client = await connect()
    for _ in range(3):
        sid = await client.call("/t.S/Echo", frame(b"hi"))
        assert await client.status(sid) == ("0", "")
    await poll(lambda: len(caplog.records) == 3)
    assert [r.getMessage().split()[:3] for r in caplog.records] == [["grpc", "/t.S/Echo", "0"]] * 3
    assert methods.passes == 1  # the server's own, when it starts


@both_loops
async def test_a_call_that_switches_the_request_log_is_logged_as_it_was_before(
    serve: Serve, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # As over HTTP: the switch applies from the next call. The call that turned the log
    # off was not logged, and the one that turned it on was.
    monkeypatch.setattr(REQUESTS, "on", True)
    caplog.set_level(logging.INFO, logger="trioinfer.access")
    handlers = Handlers()

    async def switch(raw: bytes, call: GrpcCall) -> bytes:
        REQUESTS.on = raw == b"on"
        return raw

    methods = {**handlers.methods(), "/t.S/Switch": Method(switch, streaming=False)}
    handlers.methods = lambda: methods  # type: ignore[method-assign]
    _, connect = await serve(handlers)
    client = await connect()
    for message in (b"off", b"unlogged", b"on", b"logged"):
        path = "/t.S/Echo" if message.endswith(b"logged") else "/t.S/Switch"
        sid = await client.call(path, frame(message))
        assert await client.status(sid) == ("0", "")
    await poll(lambda: len(caplog.records) == 2)
    said = [(r.getMessage().split()[1], r.bytes_in) for r in caplog.records]
    assert said == [("/t.S/Switch", len(b"off")), ("/t.S/Echo", len(b"logged"))]
