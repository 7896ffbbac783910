"""The HTTP/1.1 server: ASGI semantics, keep-alive, pipelining, robustness, shutdown.

Integration tests: each starts `serve_asgi` on 127.0.0.1 port 0 and talks to it
with httpx or with raw sockets (for what a well-behaved client never sends).
Timeouts are small and real; `fail_after` guards make a hang a failure, and
nothing asserts how long anything took.
"""

from __future__ import annotations

import functools
import json
import logging
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import attrs
import httpx
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from _http_client import Response, ResponseParser
from trioinfer.server import _connection, _http_server, _io
from trioinfer.server._http_server import serve_asgi

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

GUARD_S = 60  # every test is a failure, not a hang, if something waits forever


@attrs.frozen
class Running:
    url: str
    port: int
    shutdown: trio.Event
    stopped: trio.Event


@asynccontextmanager
async def serving(
    app: Any, *, graceful_timeout: float = 5.0, **options: Any
) -> AsyncIterator[Running]:
    """Serve *app* for the block; on exit shut down gracefully and wait for the return."""
    shutdown = trio.Event()
    stopped = trio.Event()

    async def run(*, task_status: trio.TaskStatus[list[str]]) -> None:
        await serve_asgi(
            app,
            "127.0.0.1",
            0,
            shutdown=shutdown,
            graceful_timeout=graceful_timeout,
            task_status=task_status,
            **options,
        )
        stopped.set()

    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            urls = await nursery.start(run)
            url = urls[0]
            yield Running(url, int(url.rsplit(":", 1)[1]), shutdown, stopped)
            shutdown.set()
    assert stopped.is_set()


# -- a raw HTTP client -----------------------------------------------------------------------------


class Client(ResponseParser):
    """A raw socket plus a response parser that survives pipelining."""

    def __init__(self, stream: trio.SocketStream) -> None:
        super().__init__()
        self.stream = stream

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def response(self) -> Response:
        """The next complete response; AssertionError if the server closes first."""
        while not self.responses:
            data = await self._receive()
            assert data, "the server closed the connection before a complete response"
            self._parser.feed_data(data)
        return self.responses.pop(0)

    async def raw_until_eof(self) -> bytes:
        """Everything the server still sends, up to its closing the connection."""
        chunks = []
        while data := await self._receive():
            chunks.append(data)
        return b"".join(chunks)

    async def closed(self) -> bool:
        """True once the server closes (it must send nothing more first)."""
        return await self.raw_until_eof() == b""

    async def _receive(self) -> bytes:
        try:
            return await self.stream.receive_some(65536)
        except trio.BrokenResourceError:  # reset by the server
            return b""


@asynccontextmanager
async def connect(server: Running) -> AsyncIterator[Client]:
    stream = await trio.open_tcp_stream("127.0.0.1", server.port)
    async with stream:
        yield Client(stream)


def get(path: str = "/", *headers: str, version: str = "1.1") -> bytes:
    lines = [f"GET {path} HTTP/{version}", "Host: test", *headers, "", ""]
    return "\r\n".join(lines).encode()


def post(path: str, body: bytes, *headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: test", f"Content-Length: {len(body)}", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


# -- apps ------------------------------------------------------------------------------------------


def http_only(app: App) -> App:
    """*app*, refusing the lifespan scope: it has none, and the server goes on without."""

    @functools.wraps(app)
    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            raise RuntimeError("no lifespan")
        await app(scope, receive, send)

    return guarded


async def read_body(receive: Receive) -> tuple[bytes, int] | None:
    """The whole body and the number of http.request messages; None on a disconnect."""
    chunks = []
    count = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        count += 1
        chunks.append(message["body"])
        if not message.get("more_body", False):
            return b"".join(chunks), count


async def respond(send: Send, status: int, body: bytes, *headers: tuple[bytes, bytes]) -> None:
    await send({"type": "http.response.start", "status": status, "headers": list(headers)})
    await send({"type": "http.response.body", "body": body})


async def echo_app(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers with the scope (as JSON) and the body it read; has no lifespan."""
    if scope["type"] != "http":
        raise RuntimeError(f"only http, not {scope['type']}")
    read = await read_body(receive)
    if read is None:
        return
    body, messages = read
    info = {
        "type": scope["type"],
        "asgi": scope["asgi"],
        "http_version": scope["http_version"],
        "method": scope["method"],
        "scheme": scope["scheme"],
        "path": scope["path"],
        "raw_path": scope["raw_path"].decode("latin-1"),
        "query_string": scope["query_string"].decode("latin-1"),
        "root_path": scope["root_path"],
        "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in scope["headers"]],
        "client": list(scope["client"]),
        "server": list(scope["server"]),
        "body": body.decode("latin-1"),
        "messages": messages,
    }
    await respond(send, 200, json.dumps(info).encode(), (b"content-type", b"application/json"))


# -- ASGI semantics --------------------------------------------------------------------------------


async def test_scope_and_body_over_httpx() -> None:
    async with serving(echo_app) as server, httpx.AsyncClient(base_url=server.url) as client:
        r = await client.get("/a%20b/%C3%A9?x=1&y=%20", headers={"X-Thing": "Value"})
        assert r.status_code == 200
        info = r.json()
        assert info["type"] == "http"
        assert info["asgi"] == {"version": "3.0", "spec_version": "2.3"}
        assert info["http_version"] == "1.1"
        assert info["method"] == "GET"
        assert info["scheme"] == "http"
        assert info["path"] == "/a b/é"
        assert info["raw_path"] == "/a%20b/%C3%A9"
        assert info["query_string"] == "x=1&y=%20"
        assert info["root_path"] == ""
        assert ["x-thing", "Value"] in info["headers"]
        assert all(k == k.lower() for k, _ in info["headers"])
        assert info["client"][0] == "127.0.0.1"
        assert info["server"] == ["127.0.0.1", server.port]
        assert r.headers["content-length"] == str(len(r.content))
        assert "date" in r.headers

        r = await client.post("/upload", content=b"x" * 100_000)
        assert r.json()["body"] == "x" * 100_000
        assert r.json()["method"] == "POST"


async def test_starlette_app_with_lifespan_state() -> None:
    events: list[str] = []

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, str]]:
        events.append("startup")
        yield {"greeting": "hello"}
        events.append("shutdown")

    async def infer(request: Request) -> JSONResponse:
        data = await request.json()
        return JSONResponse({"sum": sum(data["inputs"]), "greeting": request.state.greeting})

    async def stream(request: Request) -> StreamingResponse:
        async def parts() -> AsyncIterator[bytes]:
            for i in range(3):
                yield f"part{i};".encode()

        return StreamingResponse(parts(), media_type="text/plain")

    app = Starlette(
        routes=[
            Route("/infer", infer, methods=["POST"]),
            Route("/stream", stream),
            Route("/text", lambda r: PlainTextResponse("hi")),
        ],
        lifespan=lifespan,
    )
    async with serving(app) as server:
        assert events == ["startup"]
        async with httpx.AsyncClient(base_url=server.url) as client:
            r = await client.post("/infer", json={"inputs": [1, 2, 3]})
            assert r.json() == {"sum": 6, "greeting": "hello"}
            r = await client.get("/stream")
            assert r.text == "part0;part1;part2;"
            assert r.headers["transfer-encoding"] == "chunked"
            assert (await client.get("/missing")).status_code == 404
            r = await client.head("/text")
            assert r.status_code == 200
            assert r.content == b""
    assert events == ["startup", "shutdown"]


async def test_lifespan_startup_failure_raises() -> None:
    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        raise RuntimeError("no model")
        yield  # pragma: no cover

    app = Starlette(lifespan=lifespan)
    with trio.fail_after(GUARD_S), pytest.raises(RuntimeError, match="startup failed"):
        await serve_asgi(app, "127.0.0.1", 0, shutdown=trio.Event(), graceful_timeout=1)


@pytest.mark.parametrize(
    "options",
    [
        {"head_timeout": 0},
        {"body_timeout": -1},
        {"send_timeout": 0},
        {"graceful_timeout": -1},
        {"max_head_bytes": 0},
        {"max_headers": 0},
    ],
)
async def test_bad_options_are_refused(options: dict[str, float]) -> None:
    kwargs: dict[str, Any] = {"graceful_timeout": 1, **options}
    with pytest.raises(ValueError, match=r"expected (head_timeout|max_head_bytes)"):
        await serve_asgi(echo_app, "127.0.0.1", 0, shutdown=trio.Event(), **kwargs)


async def test_bind_error_is_raised_as_is() -> None:
    async with serving(echo_app) as server:
        with pytest.raises(OSError, match="in use"):
            await serve_asgi(
                echo_app, "127.0.0.1", server.port, shutdown=trio.Event(), graceful_timeout=1
            )


async def test_lifespan_raw_messages() -> None:
    seen: list[str] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            assert scope["asgi"]["version"] == "3.0"
            while True:
                message = await receive()
                seen.append(message["type"])
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.failed", "message": "oops"})
                    return
        await echo_app(scope, receive, send)

    async with serving(app) as server, connect(server) as client:
        await client.send(get())
        assert (await client.response()).status == 200
    assert seen == ["lifespan.startup", "lifespan.shutdown"]


async def test_lifespan_protocol_error_means_no_lifespan() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await receive()
            await send({"type": "lifespan.startup.bogus"})
        await echo_app(scope, receive, send)

    async with serving(app) as server, connect(server) as client:
        await client.send(get())
        assert (await client.response()).status == 200


async def test_chunked_request_body_arrives_in_pieces() -> None:
    received: list[tuple[bytes, bool]] = []
    got_one = trio.Semaphore(0)

    @http_only
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            received.append((message["body"], message["more_body"]))
            got_one.release()
            if not message["more_body"]:
                break
        await respond(send, 200, b"".join(b for b, _ in received))

    async with serving(app) as server, connect(server) as client:
        await client.send(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        await client.send(b"5\r\nhello\r\n")
        await got_one.acquire()
        await client.send(b"1\r\n \r\n6\r\nworld!\r\n")
        await got_one.acquire()
        await client.send(b"0\r\n\r\n")
        response = await client.response()
        assert response.body == b"hello world!"
    assert received[0] == (b"hello", True)
    assert received[-1][1] is False
    assert b"".join(b for b, _ in received) == b"hello world!"


async def test_streamed_response_is_chunked_without_content_length() -> None:
    @http_only
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-length", b"6")] if scope["path"] == "/sized" else []
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"abc", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": True})
        await send({"type": "http.response.body", "body": b"def", "more_body": False})

    async with serving(app) as server:
        async with connect(server) as client:
            await client.send(get("/chunked") + get("/sized"))
            chunked = await client.response()
            assert chunked.header(b"transfer-encoding") == b"chunked"
            assert chunked.body == b"abcdef"
            sized = await client.response()
            assert sized.header(b"transfer-encoding") is None
            assert sized.body == b"abcdef"
        async with connect(server) as client:  # HTTP/1.0: no chunking, the close ends the body
            await client.send(get("/", version="1.0"))
            raw = await client.raw_until_eof()
            head, _, body = raw.partition(b"\r\n\r\n")
            assert b"transfer-encoding" not in head
            assert b"connection: close" in head
            assert body == b"abcdef"


async def test_response_headers_from_the_app_are_respected() -> None:
    @http_only
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        if path == "/own-chunking":
            headers = [(b"Transfer-Encoding", b"chunked")]
        elif path == "/own-date-and-close":
            headers = [(b"date", b"yesterday"), (b"Connection", b"close")]
        elif path == "/odd-status":
            headers = [(b"connection", b"keep-alive")]  # hop-by-hop: the server's own say
        else:
            headers = []
        status = 599 if path == "/odd-status" else 200
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b"", "more_body": True})
        await send({"type": "http.response.body", "body": b"body"})

    async with serving(app) as server, connect(server) as client:
        await client.send(get("/own-chunking") + get("/odd-status") + get("/own-date-and-close"))
        chunked = await client.response()
        assert (chunked.header(b"transfer-encoding"), chunked.body) == (b"chunked", b"body")
        odd = await client.response()
        assert (odd.status, odd.body) == (599, b"body")
        assert odd.header(b"connection") is None
        own = await client.response()
        assert own.header(b"date") == b"yesterday"
        assert [v for k, v in own.headers if k.lower() == b"connection"] == [b"close"]
        assert own.body == b"body"
        assert await client.closed()


async def test_large_response_is_written_completely() -> None:
    size = 32 * 1024 * 1024

    @http_only
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, 200, b"x" * size)

    async with serving(app) as server, connect(server) as client:
        await client.send(get() + get())
        assert len((await client.response()).body) == size
        assert len((await client.response()).body) == size


async def test_head_response_has_no_body() -> None:
    async with serving(echo_app) as server, connect(server) as client:
        await client.send(b"HEAD / HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while b"\r\n\r\n" not in data:
            data += await client.stream.receive_some(65536)
        head, _, rest = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK")
        assert b"content-length: " in head
        assert rest == b""
        # The connection is still in step: the next response follows directly.
        await client.send(get("/next"))
        assert (await client.response()).json()["path"] == "/next"


async def test_head_response_without_a_body_from_the_app() -> None:
    @http_only
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        if scope["path"] == "/streamed":
            await send({"type": "http.response.body", "body": b"abc", "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    async with serving(app) as server, connect(server) as client:
        for path in (b"/empty", b"/streamed"):
            await client.send(b"HEAD %s HTTP/1.1\r\nHost: x\r\n\r\n" % path)
            data = b""
            while b"\r\n\r\n" not in data:
                data += await client.stream.receive_some(65536)
            head, _, rest = data.partition(b"\r\n\r\n")
            assert rest == b""
            assert b"content-length" not in head  # unknown: better none than a wrong one
            assert b"transfer-encoding" not in head


async def test_bodiless_statuses_send_no_body() -> None:
    @http_only
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, int(scope["path"][1:]), b"ignored")

    async with serving(app) as server, connect(server) as client:
        await client.send(get("/204") + get("/304") + get("/200"))
        for status in (204, 304):
            response = await client.response()
            assert response.status == status
            assert response.body == b""
            assert response.header(b"content-length") is None
        assert (await client.response()).body == b"ignored"


# -- connection management -------------------------------------------------------------------------


async def test_keep_alive_and_connection_close() -> None:
    async with serving(echo_app) as server, connect(server) as client:
        await client.send(get("/1"))
        first = await client.response()
        assert first.header(b"connection") is None
        await client.send(get("/2", "Connection: close"))
        second = await client.response()
        assert second.json()["path"] == "/2"
        assert second.header(b"connection") == b"close"
        assert await client.closed()


async def test_http10_closes_unless_keep_alive_requested() -> None:
    async with serving(echo_app) as server:
        async with connect(server) as client:
            await client.send(get("/", version="1.0"))
            response = await client.response()
            assert response.json()["http_version"] == "1.0"
            assert response.header(b"connection") == b"close"
            assert await client.closed()
        async with connect(server) as client:
            await client.send(get("/a", "Connection: keep-alive", version="1.0"))
            response = await client.response()
            assert response.header(b"connection") == b"keep-alive"
            await client.send(get("/b", version="1.0"))
            assert (await client.response()).json()["path"] == "/b"
            assert await client.closed()


async def test_pipelined_requests_are_answered_in_order() -> None:
    async with serving(echo_app) as server, connect(server) as client:
        await client.send(get("/1") + post("/2", b"two") + get("/3") + post("/4", b"four"))
        for path, body in (("/1", ""), ("/2", "two"), ("/3", ""), ("/4", "four")):
            info = (await client.response()).json()
            assert (info["path"], info["body"]) == (path, body)


async def test_idle_connection_closed_after_keep_alive_timeout() -> None:
    async with (
        serving(echo_app, head_timeout=0.2, body_timeout=0.2) as server,
        connect(server) as client,
    ):
        await client.send(get())
        assert (await client.response()).status == 200
        assert await client.closed()


async def test_stalled_partial_request_is_dropped() -> None:
    async with serving(echo_app, head_timeout=0.2, body_timeout=0.2) as server:
        async with connect(server) as client:  # slowloris: headers never finish
            await client.send(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            assert await client.closed()
        async with connect(server) as client:  # a body that stops half-way
            await client.send(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")
            assert await client.closed()


async def test_unread_body_is_discarded_before_next_request() -> None:
    @http_only
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, 200, scope["path"].encode())  # never reads the body

    async with serving(app) as server:
        async with connect(server) as client:
            await client.send(post("/1", b"x" * 50_000) + get("/2"))
            assert (await client.response()).body == b"/1"
            assert (await client.response()).body == b"/2"
        async with connect(server) as client:  # too big to drain: closed instead
            big = 20 * 1024 * 1024
            await client.send(
                b"POST /big HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % big
                + b"x" * 2_000_000
            )
            assert (await client.response()).body == b"/big"
            assert await client.closed()


async def test_slow_app_applies_backpressure_to_a_large_body() -> None:
    release = trio.Event()
    total = 64 * 1024 * 1024
    received = 0

    @http_only
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        nonlocal received
        await release.wait()
        read = await read_body(receive)
        assert read is not None
        received = len(read[0])
        await respond(send, 200, b"ok")

    sent = 0

    async def upload(client: Client) -> None:
        nonlocal sent
        await client.send(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % total)
        piece = b"x" * 65536
        while sent < total:
            await client.send(piece)
            sent += len(piece)

    async with serving(app) as server, connect(server) as client:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(upload, client)
            # Wait until the upload stalls: the server stopped reading.
            last = -1
            while sent != last:
                last = sent
                await trio.sleep(0.2)
            assert sent < total // 4
            release.set()
        assert (await client.response()).body == b"ok"
    assert received == total


# -- client disconnects ----------------------------------------------------------------------------


async def test_receive_reports_disconnect_while_app_runs() -> None:
    seen: list[str] = []
    done = trio.Event()

    @http_only
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        assert await read_body(receive) == (b"abc", 1)
        message = await receive()  # blocks: the client is still there, until it is not
        seen.append(message["type"])
        done.set()

    async with serving(app) as server:
        async with connect(server) as client:
            await client.send(post("/", b"abc"))
        await done.wait()
    assert seen == ["http.disconnect"]


async def test_receive_reports_disconnect_on_reset() -> None:
    seen: list[str] = []
    done = trio.Event()
    waiting = trio.Event()

    @http_only
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        waiting.set()
        seen.append((await receive())["type"])
        done.set()

    async with serving(app) as server:
        async with connect(server) as client:
            await client.send(get())
            await waiting.wait()
            # Close with SO_LINGER 0: the kernel sends a reset, not a FIN.
            client.stream.socket.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
            )
        await done.wait()
    assert seen == ["http.disconnect"]


async def stay_twice_then_leave(
    app: Any, working: trio.Event, done: trio.Event, *, reset: bool = False
) -> None:
    """On one connection: two ``/stay`` requests answered, then the client leaves
    during ``/leave`` once the app sets *working* (with a reset if *reset*, else
    a FIN); returns when it sets *done*."""
    async with serving(app) as server:
        async with connect(server) as client:
            for _ in range(2):
                await client.send(post("/stay", b"x"))
                assert (await client.response()).status == 200
            await client.send(post("/leave", b"x"))
            await working.wait()
            if reset:
                client.stream.socket.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
        with trio.fail_after(5):
            await done.wait()


@pytest.mark.parametrize("reset", [False, True])
async def test_cancel_on_disconnect_extension_cancels_the_registered_scope(reset: bool) -> None:
    # Three requests on one connection share the server's hang-up watcher; the third client leaves.
    outcomes: list[str] = []
    working = trio.Event()
    done = trio.Event()

    @http_only
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        watch = scope["extensions"]["trioinfer.cancel_on_disconnect"]
        with trio.CancelScope() as left:
            assert not watch(left)  # the body is not read yet: receive() must watch
            await read_body(receive)
            assert watch(left)
            if scope["path"] == "/stay":
                await trio.testing.wait_all_tasks_blocked()
                await respond(send, 200, b"ok")
                outcomes.append("answered")
                return
            working.set()
            await trio.sleep_forever()
        outcomes.append("cancelled" if left.cancelled_caught else "?")
        done.set()

    await stay_twice_then_leave(app, working, done, reset=reset)
    assert outcomes == ["answered", "answered", "cancelled"]


async def test_cancel_on_disconnect_after_the_hang_up_was_seen_cancels_at_once() -> None:
    # The request and the client's FIN arrive together on a watched connection; the
    # hang-up is seen (and reported once) before the app registers: it is cancelled anyway.
    outcomes: list[str] = []
    done = trio.Event()

    @http_only
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        await trio.testing.wait_all_tasks_blocked()  # the watcher has seen the hang-up
        with trio.CancelScope() as left:
            assert scope["extensions"]["trioinfer.cancel_on_disconnect"](left)
            if scope["path"] == "/stay":
                await respond(send, 200, b"ok")
                outcomes.append("answered")
                return
            await trio.sleep_forever()
        outcomes.append("cancelled" if left.cancelled_caught else "?")
        done.set()

    async with serving(app) as server, connect(server) as client:
        await client.send(post("/stay", b"x"))
        assert (await client.response()).status == 200
        await client.send(post("/leave", b"x"))
        await client.stream.send_eof()
        with trio.fail_after(5):
            await done.wait()
            assert await client.closed()
    assert outcomes == ["answered", "cancelled"]


async def test_without_a_hang_up_watcher_the_extension_leaves_watching_to_receive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Where epoll is missing the extension registers nothing: the app watches with receive().
    monkeypatch.setattr(_http_server, "hangup_watcher", lambda io: None)
    seen: list[object] = []
    done = trio.Event()

    @http_only
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)
        seen.append(scope["extensions"]["trioinfer.cancel_on_disconnect"]())
        if scope["path"] == "/stay":
            await respond(send, 200, b"ok")
            return
        seen.append((await receive())["type"])
        done.set()

    async with serving(app) as server:
        async with connect(server) as client:
            await client.send(post("/stay", b"x"))
            assert (await client.response()).status == 200
            await client.send(post("/leave", b"x"))
        with trio.fail_after(5):
            await done.wait()
    assert seen == [False, False, "http.disconnect"]


async def test_cancel_on_disconnect_without_a_scope_cancels_the_apps_task() -> None:
    # Two requests on one connection are answered; the client leaves during the third.
    outcomes: list[str] = []
    working = trio.Event()
    done = trio.Event()

    @http_only
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        watch = scope["extensions"]["trioinfer.cancel_on_disconnect"]
        await read_body(receive)
        assert watch()
        if scope["path"] == "/stay":
            await trio.testing.wait_all_tasks_blocked()
            await respond(send, 200, b"ok")
            outcomes.append("answered")
            return
        working.set()
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            outcomes.append("cancelled")
            done.set()
            raise

    await stay_twice_then_leave(app, working, done)
    assert outcomes == ["answered", "answered", "cancelled"]


def disconnect_watching_app(release: trio.Event | None = None) -> Any:
    """An app that answers with the path, watching for a disconnect while it "works".

    It works until *release* is set for the path ``/slow``, else until every
    task waits (its watcher reading the socket).
    """

    @http_only
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        read = await read_body(receive)
        assert read is not None

        async def watch() -> None:
            await receive()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            if scope["path"] == "/slow" and release is not None:
                await release.wait()
            else:
                await trio.testing.wait_all_tasks_blocked()
            await respond(send, 200, scope["path"].encode())

    return app


def extension_watching_app(release: trio.Event | None = None) -> Any:
    """As `disconnect_watching_app`, watching with ``trioinfer.cancel_on_disconnect``.

    The server's hang-up watcher watches then; the connection reads nothing
    while the app works, and the next request when the response is done.
    """

    @http_only
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        read = await read_body(receive)
        assert read is not None
        with trio.CancelScope() as left:
            assert scope["extensions"]["trioinfer.cancel_on_disconnect"](left)
            if scope["path"] == "/slow" and release is not None:
                await release.wait()
            else:
                await trio.testing.wait_all_tasks_blocked()
            await respond(send, 200, scope["path"].encode())

    return app


WATCHING_APPS = pytest.mark.parametrize(
    "watching_app", [disconnect_watching_app, extension_watching_app]
)


@WATCHING_APPS
async def test_malformed_input_read_while_watching_for_disconnect(watching_app: Any) -> None:
    async with serving(watching_app()) as server, connect(server) as client:
        await client.send(get("/good") + b"NOT HTTP\r\n\r\n" + b"more junk" * 100)
        assert (await client.response()).body == b"/good"
        assert (await client.response()).status == 400
        assert await client.closed()


@WATCHING_APPS
async def test_pipelined_flood_while_watching_for_disconnect(watching_app: Any) -> None:
    release = trio.Event()
    count = 4000
    body = b"b" * 1000
    responses: list[bytes] = []
    sent = 0

    async def read_all(client: Client) -> None:
        for _ in range(count + 1):
            responses.append((await client.response()).body)

    async def flood(client: Client) -> None:
        nonlocal sent
        for i in range(count):
            await client.send(post(f"/{i}", body))
            sent += 1

    async with (
        serving(watching_app(release)) as server,
        connect(server) as client,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(read_all, client)
        await client.send(post("/slow", b""))
        nursery.start_soon(flood, client)
        # The server reads ahead only so far while /slow is in flight: the flood stalls.
        last = -1
        while sent != last:
            last = sent
            await trio.sleep(0.2)
        assert sent < count
        release.set()
    assert responses == [b"/slow"] + [f"/{i}".encode() for i in range(count)]


async def test_after_a_watched_response_the_next_request_may_come_in_pieces() -> None:
    # The watcher's read outlives the response and gets the next request's head;
    # its body, sent later, is read when the app asks for it.
    async with serving(extension_watching_app()) as server, connect(server) as client:
        await client.send(post("/1", b"a"))
        assert (await client.response()).body == b"/1"
        await client.send(b"POST /2 HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n")
        await trio.testing.wait_all_tasks_blocked()
        await client.send(b"ab")
        await trio.testing.wait_all_tasks_blocked()
        await client.send(b"cde")
        assert (await client.response()).body == b"/2"
        await client.send(get("/3"))
        assert (await client.response()).body == b"/3"


@pytest.mark.parametrize("pipelined", [False, True])
async def test_after_a_watched_response_a_stalled_body_is_dropped(pipelined: bool) -> None:
    # Pipelined, the second request's head came with the first request: its app
    # asks for the rest of the body while the watcher's read still waits.
    partial = b"POST /2 HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc"
    async with (
        serving(extension_watching_app(), head_timeout=0.2, body_timeout=0.2) as server,
        connect(server) as client,
    ):
        if pipelined:
            await client.send(post("/1", b"a") + partial)
            assert (await client.response()).body == b"/1"
        else:
            await client.send(post("/1", b"a"))
            assert (await client.response()).body == b"/1"
            await client.send(partial)
        with trio.fail_after(5):
            assert await client.closed()


async def test_after_a_watched_response_an_idle_connection_times_out() -> None:
    async with (
        serving(extension_watching_app(), head_timeout=0.2, body_timeout=0.2) as server,
        connect(server) as client,
    ):
        await client.send(post("/1", b"a"))
        assert (await client.response()).body == b"/1"
        with trio.fail_after(5):
            assert await client.closed()


async def test_after_a_watched_response_the_clients_eof_ends_the_connection() -> None:
    async with serving(extension_watching_app()) as server, connect(server) as client:
        await client.send(post("/1", b"a"))
        assert (await client.response()).body == b"/1"
        await client.stream.send_eof()
        with trio.fail_after(5):
            assert await client.closed()


async def test_concurrent_receive_calls_share_the_body() -> None:
    entered = trio.Event()
    results: list[Message] = []

    @http_only
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        first = trio.Event()

        async def one() -> None:
            results.append(await receive())
            first.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one)
            nursery.start_soon(one)
            entered.set()
            await first.wait()
            await respond(send, 200, b"ok")

    async with serving(app) as server, connect(server) as client:
        await client.send(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 6\r\n\r\n")
        await entered.wait()
        await trio.testing.wait_all_tasks_blocked()  # both receive() calls wait for the body
        await client.send(b"abcdef")
        assert (await client.response()).body == b"ok"
    assert results == [
        {"type": "http.request", "body": b"abcdef", "more_body": False},
        {"type": "http.disconnect"},
    ]


async def test_client_gone_mid_response_makes_send_a_no_op() -> None:
    sent_all = trio.Event()
    started = trio.Event()

    @http_only
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        started.set()
        for _ in range(8):
            piece = b"x" * (8 * 1024 * 1024)
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        sent_all.set()

    async with serving(app) as server:
        async with connect(server) as client:
            await client.send(get())
            await started.wait()
            await client.stream.receive_some(1024)
            client.stream.socket.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
            )
        await sent_all.wait()


async def test_waiting_receive_ends_with_the_response_and_pipelining_continues() -> None:
    seen: list[str] = []

    @http_only
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await read_body(receive)

        async def watch() -> None:
            seen.append((await receive())["type"])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            nursery.start_soon(watch)  # two readers at once are fine too
            await trio.testing.wait_all_tasks_blocked()
            await respond(send, 200, scope["path"].encode())
        seen.append((await receive())["type"])  # after the response: at once

    async with serving(app) as server, connect(server) as client:
        # The second request arrives while the first one's watchers read the socket.
        await client.send(post("/1", b"a") + post("/2", b"b"))
        assert (await client.response()).body == b"/1"
        assert (await client.response()).body == b"/2"
    assert seen == ["http.disconnect"] * 6


# -- errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GARBAGE\r\n\r\n",
        b"GET / HTTP/1.1\r\nBad Header\r\n\r\n",
        b"GET / HTTP/1.1\r\nContent-Length: abc\r\n\r\n",
        b"GET / HTTP/7.1\r\n\r\n",
        b"GET /\x00 HTTP/1.1\r\n\r\n",
        b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
        b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n",
    ],
)
async def test_malformed_request_gets_400_and_close(request_bytes: bytes) -> None:
    async with serving(echo_app) as server:
        async with connect(server) as client:
            await client.send(request_bytes)
            assert (await client.response()).status == 400
            assert await client.closed()
        async with connect(server) as client:
            await client.send(get("/ok"))
            assert (await client.response()).status == 200


async def test_malformed_pipelined_request_after_a_good_one() -> None:
    async with serving(echo_app) as server, connect(server) as client:
        await client.send(get("/good") + b"NOT HTTP\r\n\r\n")
        assert (await client.response()).json()["path"] == "/good"
        assert (await client.response()).status == 400
        assert await client.closed()


async def test_oversized_head_gets_431() -> None:
    async with serving(echo_app, max_head_bytes=1024) as server:
        async with connect(server) as client:  # many headers
            headers = [f"X-H{i}: {'v' * 50}" for i in range(40)]
            await client.send(get("/", *headers))
            assert (await client.response()).status == 431
            assert await client.closed()
        async with connect(server) as client:  # one long header line
            await client.send(get("/", "X-Big: " + "v" * 2000))
            assert (await client.response()).status == 431
        async with connect(server) as client:  # a long URL
            await client.send(get("/" + "u" * 2000))
            assert (await client.response()).status == 431

        async with connect(server) as client:  # a header that never ends

            async def flood() -> None:
                await client.send(b"GET / HTTP/1.1\r\nX-Endless: ")
                try:
                    for _ in range(100):
                        await client.send(b"v" * 4096)
                except trio.BrokenResourceError:
                    pass  # the server stopped listening: that is the point

            async with trio.open_nursery() as nursery:
                nursery.start_soon(flood)
                assert (await client.response()).status == 431


async def test_app_error_before_response_is_500_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    @http_only
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] == "/started":
            await send({"type": "http.response.start", "status": 200, "headers": []})
        raise ValueError("boom")

    with caplog.at_level(logging.ERROR, logger="trioinfer.server"):
        async with serving(app) as server:
            for path in ("/", "/started"):
                async with connect(server) as client:
                    await client.send(get(path))
                    response = await client.response()
                    assert response.status == 500
                    assert response.body.startswith(b"Internal Server Error: ")
                    assert await client.closed()
    errors = [r for r in caplog.records if r.name == "trioinfer.server" and r.exc_info]
    assert len(errors) == 2
    assert all(isinstance(r.exc_info[1], ValueError) for r in errors if r.exc_info)


async def test_app_error_after_response_body_started_closes_connection() -> None:
    @http_only
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"partial", "more_body": True})
        raise ValueError("boom")

    async with serving(app) as server, connect(server) as client:
        await client.send(get())
        raw = await client.raw_until_eof()
        assert raw.startswith(b"HTTP/1.1 200 OK")
        assert raw.endswith(b"7\r\npartial\r\n")  # no terminating chunk: cut short


async def test_app_returning_mid_response_closes_connection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    @http_only
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"partial", "more_body": True})

    async with serving(app) as server, connect(server) as client:
        await client.send(get() + get())
        raw = await client.raw_until_eof()
        assert raw.count(b"HTTP/1.1") == 1
        assert raw.endswith(b"7\r\npartial\r\n")
    assert "before its response body was complete" in caplog.text


async def test_app_without_response_is_500(caplog: pytest.LogCaptureFixture) -> None:
    @http_only
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        """Returns without sending anything."""

    async with serving(app) as server, connect(server) as client:
        await client.send(get())
        assert (await client.response()).status == 500
        assert await client.closed()
    assert "without a response" in caplog.text


async def test_app_protocol_errors() -> None:
    @http_only
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        if path == "/body-first":
            await send({"type": "http.response.body", "body": b""})
        elif path == "/start-twice":
            await send({"type": "http.response.start", "status": 200})
            await send({"type": "http.response.start", "status": 200})
        elif path == "/injection":
            await respond(send, 200, b"", (b"x-evil", b"a\r\nset-cookie: b"))
        elif path == "/too-long":
            await respond(send, 200, b"12345", (b"content-length", b"3"))
        elif path == "/websocket":
            await send({"type": "websocket.accept"})

    async with serving(app) as server:
        for path in ("/body-first", "/start-twice", "/injection", "/too-long", "/websocket"):
            async with connect(server) as client:
                await client.send(get(path))
                assert (await client.response()).status == 500, path


@http_only
async def respond_app(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers through the ``trioinfer.respond`` extension, as the path says."""
    respond_once = scope["extensions"]["trioinfer.respond"]
    path = scope["path"]
    chunks = [(message := await receive())["body"]]
    while message.get("more_body"):
        chunks.append((message := await receive())["body"])
    body = b"".join(chunks) or path.encode()
    if path == "/twice":
        await respond_once(200, (), b"one")
        await respond_once(200, (), b"two")
    elif path == "/after-start":
        await send({"type": "http.response.start", "status": 200})
        await respond_once(200, (), b"late")
    elif path == "/injection":
        await respond_once(200, ((b"x-evil", b"a\r\nset-cookie: b"),), b"")
    elif path == "/too-long":
        await respond_once(200, ((b"content-length", b"3"),), b"12345")
    elif path == "/close":
        await respond_once(200, ((b"connection", b"close"),), body)
    else:
        await respond_once(201, ((b"content-type", b"text/plain"), (b"x-n", b"1")), body)


async def test_respond_extension_answers_in_one_call_and_keeps_the_connection() -> None:
    # Its responses carry the server's content-length (the app sends none) and
    # the app's headers; keep-alive and pipelining go on as with `send`.
    async with serving(respond_app) as server, connect(server) as client:
        for body in (b"a", b"bcd" * 1000, b"e" * 300_000):  # the last over _COALESCE_LIMIT
            await client.send(post("/echo", body) + post("/echo", body[:1]))
            for expected in (body, body[:1]):
                response = await client.response()
                assert response.status == 201
                assert response.body == expected
                assert response.header(b"content-length") == str(len(expected)).encode()
                assert response.header(b"content-type") == b"text/plain"
                assert response.header(b"x-n") == b"1"
        await client.send(b"HEAD /head HTTP/1.1\r\nHost: test\r\n\r\n" + get("/after-head"))
        await client.send(get("/close"))
        head_raw = await client.raw_until_eof()
    # A HEAD response has its length and no body; a connection: close from the app closes.
    head, after_head, rest, last = head_raw.split(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 201 ")
    assert b"\r\ncontent-length: 5\r\n" in head
    assert after_head.startswith(b"HTTP/1.1 201 ")
    assert b"\r\ncontent-length: 11\r\n" in after_head
    body, close = rest[: len(b"/after-head")], rest[len(b"/after-head") :]
    assert body == b"/after-head"
    assert close.startswith(b"HTTP/1.1 200 ")
    assert b"\r\nconnection: close" in close
    assert last == b"/close"


async def test_respond_extension_protocol_errors() -> None:
    # A response started or sent twice, a header that injects, a body over its
    # declared length: a 500 if nothing went out yet, else the connection closes.
    async with serving(respond_app) as server:
        for path in ("/after-start", "/injection", "/too-long"):
            async with connect(server) as client:
                await client.send(get(path))
                assert (await client.response()).status == 500, path
        async with connect(server) as client:
            await client.send(get("/twice") + get("/next"))
            first = await client.response()
            assert (first.status, first.body) == (200, b"one")
            assert await client.closed()


async def test_a_response_after_the_cycle_ended_is_refused() -> None:
    # An app that returns without answering gets its 500 from the server; a task
    # it left behind that answers later must not write a second response.
    kept: list[Any] = []

    @http_only
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        kept.append((scope["extensions"]["trioinfer.respond"], send))

    async with serving(app) as server, connect(server) as client:
        await client.send(get("/"))
        assert (await client.response()).status == 500
        respond_late, send_late = kept[0]
        with pytest.raises(RuntimeError, match="the response cycle is over"):
            await respond_late(200, (), b"late")
        with pytest.raises(RuntimeError, match="the response cycle is over"):
            await send_late({"type": "http.response.start", "status": 200})
        assert await client.raw_until_eof() == b""


async def test_short_body_for_content_length_closes_connection() -> None:
    @http_only
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, 200, b"abc", (b"content-length", b"5"))

    async with serving(app) as server, connect(server) as client:
        await client.send(get())
        raw = await client.raw_until_eof()
        assert raw.endswith(b"\r\n\r\nabc")


async def test_expect_100_continue() -> None:
    async with serving(echo_app) as server, connect(server) as client:
        await client.send(
            b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n"
        )
        interim = await client.response()
        assert interim.status == 100
        await client.send(b"hello")
        assert (await client.response()).json()["body"] == "hello"


async def test_expect_100_continue_not_sent_when_body_not_read() -> None:
    @http_only
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, 413, b"too big")

    async with serving(app) as server, connect(server) as client:
        await client.send(
            b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n"
        )
        response = await client.response()
        assert response.status == 413
        assert response.header(b"connection") == b"close"
        assert await client.closed()


async def test_upgrade_request_is_served_then_closed() -> None:
    async with serving(echo_app) as server, connect(server) as client:
        await client.send(get("/ws", "Connection: Upgrade", "Upgrade: websocket") + b"\x81\x00")
        response = await client.response()
        assert response.json()["path"] == "/ws"
        assert response.header(b"connection") == b"close"
        assert await client.closed()


async def test_unusual_request_targets() -> None:
    async with serving(echo_app) as server, connect(server) as client:
        await client.send(
            b"OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n"
            b"GET http://example.com/p%41th?q=1 HTTP/1.1\r\nHost: x\r\n\r\n"
            b"PROPFIND /dav HTTP/1.1\r\nHost: x\r\n\r\n"
            b"GET /frag?q=2#part HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        star = (await client.response()).json()
        assert (star["method"], star["path"]) == ("OPTIONS", "*")
        absolute = (await client.response()).json()
        assert (absolute["path"], absolute["query_string"]) == ("/pAth", "q=1")
        assert (await client.response()).json()["method"] == "PROPFIND"
        fragment = (await client.response()).json()
        assert (fragment["path"], fragment["query_string"]) == ("/frag", "q=2")
        await client.send(b"GET http:// HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await client.response()).status == 400
        assert await client.closed()


# -- graceful shutdown -----------------------------------------------------------------------------


async def test_graceful_shutdown_finishes_in_flight_requests() -> None:
    entered = trio.Event()
    release = trio.Event()

    @http_only
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] == "/slow":
            entered.set()
            await release.wait()
        await respond(send, 200, scope["path"].encode())

    async with serving(app) as server, connect(server) as busy, connect(server) as idle:
        await idle.send(get("/quick"))
        assert (await idle.response()).body == b"/quick"
        await busy.send(get("/slow"))
        await entered.wait()
        server.shutdown.set()
        assert await idle.closed()
        with pytest.raises(OSError, match="connect"):  # the listener is closed at once
            await trio.open_tcp_stream("127.0.0.1", server.port)
        assert not server.stopped.is_set()
        release.set()
        response = await busy.response()
        assert response.body == b"/slow"
        assert response.header(b"connection") == b"close"
        assert await busy.closed()
        await server.stopped.wait()


async def test_graceful_timeout_cancels_stragglers() -> None:
    entered = trio.Event()
    cancelled = trio.Event()

    @http_only
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        entered.set()
        try:
            await trio.sleep_forever()
        finally:
            cancelled.set()

    async with serving(app, graceful_timeout=0.2) as server, connect(server) as client:
        await client.send(get())
        await entered.wait()
        server.shutdown.set()
        await server.stopped.wait()
        assert cancelled.is_set()
        assert await client.closed()


async def test_graceful_timeout_cuts_a_response_the_client_does_not_read() -> None:
    writing = trio.Event()

    @http_only
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        writing.set()
        await send({"type": "http.response.body", "body": b"x" * (256 * 1024 * 1024)})

    async with serving(app, graceful_timeout=0.2) as server, connect(server) as client:
        await client.send(get())
        await writing.wait()
        server.shutdown.set()
        await server.stopped.wait()


async def test_shutdown_with_nothing_open() -> None:
    async with serving(echo_app) as server:
        server.shutdown.set()
        await server.stopped.wait()


# -- fuzzing ---------------------------------------------------------------------------------------

VALID_REQUESTS = [
    get("/path?q=1", "Accept: */*"),
    post("/p", b"hello"),
    b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    get("/a") + get("/b"),
    get("/", "Connection: close", version="1.0"),
]


@st.composite
def mutated_requests(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(VALID_REQUESTS)))
    for _ in range(draw(st.integers(1, 6))):
        position = draw(st.integers(0, len(data)))
        action = draw(st.sampled_from(["replace", "insert", "delete", "duplicate"]))
        if action == "replace" and position < len(data):
            data[position] = draw(st.integers(0, 255))
        elif action == "insert":
            data[position:position] = draw(st.binary(min_size=1, max_size=8))
        elif action == "delete":
            del data[position : position + draw(st.integers(1, 8))]
        else:
            data[position:position] = data[position : position + draw(st.integers(1, 32))]
    return bytes(data)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payload=st.one_of(st.binary(max_size=1024), mutated_requests()))
async def test_fuzzed_input_never_breaks_the_server(payload: bytes) -> None:
    async with serving(echo_app, head_timeout=0.5) as server:
        async with connect(server) as client:
            try:
                await client.send(payload)
                await client.stream.send_eof()
            except trio.BrokenResourceError:
                pass  # the server answered and closed before we finished: fine
            await client.raw_until_eof()
        async with connect(server) as client:
            await client.send(get("/after"))
            assert (await client.response()).json()["path"] == "/after"


async def test_serve_asgi_accepts_a_partial_app() -> None:
    # Any awaitable-returning callable is an app: a partial, as our _serve.py may pass.
    async def app(scope: Scope, receive: Receive, send: Send, *, text: bytes) -> None:
        if scope["type"] != "http":
            raise RuntimeError("no lifespan")
        await respond(send, 200, text)

    async with serving(partial(app, text=b"partial")) as server, connect(server) as client:
        await client.send(get())
        assert (await client.response()).body == b"partial"


async def test_one_wake_of_the_accept_loop_takes_every_waiting_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each wait_readable is a whole turn of Trio's scheduler, which on a busy server
    # lasts as long as every runnable task's step: accepting one connection per turn
    # made clients that open many connections at once wait seconds for an answer.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.setblocking(False)
    clients = [socket.create_connection(listener.getsockname()) for _ in range(20)]
    wakes = 0
    io = _io.open_io()
    real_wait = io.wait_readable

    async def counting_wait(sock: Any) -> None:
        nonlocal wakes
        wakes += 1
        await real_wait(sock)

    monkeypatch.setattr(io, "wait_readable", counting_wait)
    accepted: list[socket.socket] = []

    class Recorder:
        def start_soon(self, fn: object, sock: socket.socket) -> None:
            accepted.append(sock)

    shared = _connection.Shared(
        echo_app,
        io,
        {},
        head_timeout=5.0,
        body_timeout=5.0,
        send_timeout=5.0,
        max_head_bytes=8192,
        max_headers=100,
    )
    server = _http_server._Server(shared)
    try:
        with trio.move_on_after(1):
            await server.accept_loop(listener, Recorder())  # type: ignore[arg-type]
        assert len(accepted) == 20
        assert wakes == 2  # one wake took all twenty; the second waits for more
    finally:
        for sock in [*accepted, *clients, listener]:
            sock.close()


def _capture(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    made: list[Any] = []
    real = _http_server.hangup_watcher

    def spy(io: Any) -> Any:
        h = real(io)
        made.append(h)
        return h

    monkeypatch.setattr(_http_server, "hangup_watcher", spy)
    return made


async def test_hangups_follow_reused_descriptors_and_forget_closed_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made = _capture(monkeypatch)
    outcomes: list[str] = []
    working = trio.Event()
    done = trio.Event()

    @http_only
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await read_body(receive)
        with trio.CancelScope() as left:
            assert scope["extensions"]["trioinfer.cancel_on_disconnect"](left)
            if scope["path"] == "/stay":
                await respond(send, 200, b"ok")
                outcomes.append("answered")
                return
            working.set()
            await trio.sleep_forever()
        outcomes.append("cancelled" if left.cancelled_caught else "?")
        done.set()

    async with serving(app) as server:
        for _ in range(20):  # each closes: fds are reused by the next
            async with connect(server) as client:
                await client.send(post("/stay", b"x"))
                assert (await client.response()).status == 200
            await trio.testing.wait_all_tasks_blocked()
        hangups = made[0]
        assert hangups._connections == {}, hangups._connections
        async with connect(server) as client:
            await client.send(post("/leave", b"x"))
            await working.wait()
        with trio.fail_after(5):
            await done.wait()
        await trio.testing.wait_all_tasks_blocked()
        assert hangups._connections == {}
    assert outcomes == ["answered"] * 20 + ["cancelled"]


async def test_an_error_in_the_watcher_costs_no_more_than_its_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A fault while telling one connection of its hang-up (here: a registered scope whose
    # cancel() raises) must not end the server: before, each connection's watcher ran in
    # that connection's task group, whose errors were logged and cost only it.
    class Bad:
        def cancel(self) -> None:
            raise RuntimeError("boom")

    registered = trio.Event()

    @http_only
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await read_body(receive)
        if scope["path"] == "/bad":
            assert scope["extensions"]["trioinfer.cancel_on_disconnect"](Bad())
            registered.set()
            await trio.sleep(0.5)
        await respond(send, 200, b"ok")

    async with serving(app) as server:
        async with connect(server) as client:
            await client.send(post("/bad", b"x"))
            await registered.wait()
        await trio.sleep(0.1)
        async with connect(server) as client:
            await client.send(post("/ok", b"x"))
            assert (await client.response()).status == 200


async def test_no_epoll_set_left_means_the_slower_watch_not_a_failure(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def out_of_descriptors() -> Any:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(_connection.select, "epoll", out_of_descriptors)
    assert _connection.hangup_watcher(_io.open_io()) is None
    assert "Too many open files" in caplog.text


async def test_a_busy_connection_is_not_reaped_for_the_time_it_has_been_open() -> None:
    # Idleness is counted from the last request, not from the connection's start:
    # requests kept coming for more than two timeouts, each gap far shorter than one.
    async with (
        serving(echo_app, head_timeout=0.5, body_timeout=0.5) as server,
        connect(server) as client,
    ):
        end = trio.current_time() + 1.2
        while trio.current_time() < end:
            await client.send(get("/busy"))
            assert (await client.response()).status == 200
            await trio.sleep(0.02)
        assert await client.closed()  # and once idle, it is closed


@pytest.mark.parametrize("closed", [False, True])
async def test_a_request_read_while_the_loop_waited_for_the_reading_turn_is_served(
    closed: bool,
) -> None:
    # An app's `receive` held the reading turn and read the next request: the request
    # loop, given the turn, serves it rather than waiting for more bytes; unless the
    # server closed the connection (idle reaper, shutdown) meanwhile.
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    shared = _connection.Shared(
        echo_app,
        _io.open_io(),
        {},
        head_timeout=5.0,
        body_timeout=5.0,
        send_timeout=5.0,
        max_head_bytes=8192,
        max_headers=100,
    )
    conn = _connection.Connection(shared, ours, ("127.0.0.1", 1), ("127.0.0.1", 2))
    conn._reading = True  # the app's reader has the turn
    got: list[Any] = []

    async def next_request() -> None:
        got.append(await conn._next_request())

    try:
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(next_request)
                await trio.testing.wait_all_tasks_blocked()
                conn.framing.receive_data(get("/read-by-the-app"))
                if closed:
                    conn.close_now()
                conn._give_reading_turn()
        if closed:
            assert got == [None]
        else:
            assert got[0] is not None
            assert got[0].url == b"/read-by-the-app"
    finally:
        ours.close()
        theirs.close()
