"""Hostile clients against the real server on 127.0.0.1, on Trio and on asyncio.

Every test runs twice, once per event loop, against `serve_asgi` (the HTTP
layer alone, with a small app that records what it served) or `serve_http`
(the whole V2 server over a model repository), talking through raw sockets
because well-behaved clients never send any of this: smuggled requests, bad
``Host`` headers, slow and silent clients, clients that pipeline without
reading, huge heads, endless chunk extensions and trailers, compression
bombs, traversal names, and answers checked for host paths.

The server's timeouts are set small (a fraction of a second) so that the
tests that wait for them end soon; nothing asserts how long anything took.
``GUARD_S`` turns a server that never closes into a failure, not a hang.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import socket
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager, suppress
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import attrs
import pytest

from _http_client import Response, ResponseParser
from trioinfer import example_repository
from trioinfer._exceptions import ConfigError
from trioinfer.server import Limits, ServerConfig, serve_http
from trioinfer.server._http_server import serve_asgi

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

BACKENDS = ["trio", "asyncio"]
both = pytest.mark.parametrize("backend", BACKENDS)
GUARD_S = 30  # a server that never answers or never closes fails the test, not the run
SHORT_S = 0.3  # every server timeout in these tests


def run(backend: str, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
    async def guarded() -> None:
        with anyio.fail_after(GUARD_S):
            await fn(*args)

    anyio.run(guarded, backend=backend)


# -- a server, an app that records, and a raw client -----------------------------------------------


@attrs.define
class Recorder:
    """An ASGI app that reads the body and answers with the path; it remembers every path."""

    paths: list[str] = attrs.Factory(list)
    response_size: int = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            raise RuntimeError("no lifespan")
        self.paths.append(scope["path"])
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            if not message.get("more_body", False):
                break
        body = scope["path"].encode().ljust(self.response_size, b".")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})


@asynccontextmanager
async def serving(app: Any, **options: Any) -> AsyncIterator[int]:
    """Serve *app* with short timeouts for the block; yields the port."""
    settings: dict[str, Any] = {
        "graceful_timeout": 1.0,
        "head_timeout": SHORT_S,
        "body_timeout": SHORT_S,
        "send_timeout": SHORT_S,
        **options,
    }
    shutdown = anyio.Event()
    async with anyio.create_task_group() as tg:
        urls = await tg.start(
            partial(serve_asgi, app, "127.0.0.1", 0, shutdown=shutdown, **settings)
        )
        yield int(urls[0].rsplit(":", 1)[1])
        shutdown.set()


class Client(ResponseParser):
    """A raw socket and a response parser that survives pipelining.

    A plain non-blocking socket rather than an anyio stream: on asyncio a
    stream reads the socket in the background, and some tests need a client
    that truly reads nothing.
    """

    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        self.sock = sock

    async def send(self, data: bytes) -> bool:
        """Send *data*; False if the server already closed (or reset) the connection."""
        view = memoryview(data)
        while view:
            await anyio.wait_writable(self.sock)
            try:
                view = view[self.sock.send(view) :]
            except BlockingIOError:
                continue
            except OSError:  # EPIPE, ECONNRESET: the server hung up
                return False
        return True

    async def receive(self) -> bytes:
        """Some bytes, or b"" once the server closed or reset the connection."""
        while True:
            await anyio.wait_readable(self.sock)
            try:
                data = self.sock.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                return b""
            if data:
                self._parser.feed_data(data)
            return data

    async def response(self) -> Response:
        while not self.responses:
            assert await self.receive(), "the server closed before a complete response"
        return self.responses.pop(0)

    async def until_closed(self) -> list[Response]:
        """Every response until the server closes the connection."""
        while await self.receive():
            pass
        return self.responses


@asynccontextmanager
async def connect(port: int, *, receive_buffer: int | None = None) -> AsyncIterator[Client]:
    sock = socket.socket()
    try:
        if receive_buffer is not None:
            # Before connecting, so the advertised window is small from the start.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        sock.setblocking(False)
        with suppress(BlockingIOError):
            sock.connect(("127.0.0.1", port))
        await anyio.wait_writable(sock)
        yield Client(sock)
    finally:
        anyio.notify_closing(sock)
        sock.close()


def get(path: str = "/", *headers: str, host: str | None = "test") -> bytes:
    lines = [f"GET {path} HTTP/1.1", *([f"Host: {host}"] if host is not None else []), *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def refused_and_closed(client: Client, status: int) -> Response:
    """The one answer a refused request gets, after which the server closes."""
    (response,) = await client.until_closed()
    assert response.status == status, response.body
    assert response.header(b"connection") == b"close"
    return response


# -- request smuggling -----------------------------------------------------------------------------


SMUGGLING = {
    "cl-te": b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n",
    "te-cl": b"Transfer-Encoding: chunked\r\nContent-Length: 4\r\n",
    "te-chunked-identity": b"Transfer-Encoding: chunked, identity\r\n",
    "te-identity-chunked-cl": b"Transfer-Encoding: identity, chunked\r\nContent-Length: 4\r\n",
    "te-leading-space-cl": b"Transfer-Encoding:  chunked\r\nContent-Length: 4\r\n",
    "te-tab-cl": b"Transfer-Encoding:\tchunked\r\nContent-Length: 4\r\n",
    "te-space-before-colon": b"Transfer-Encoding : chunked\r\n",
    "te-folded": b"Transfer-Encoding:\r\n chunked\r\n",
    "te-twice": b"Transfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n",
    "te-xchunked": b"Transfer-Encoding: xchunked\r\n",
    "cl-differing": b"Content-Length: 4\r\nContent-Length: 40\r\n",
    "cl-same-twice": b"Content-Length: 4\r\nContent-Length: 4\r\n",
    "cl-plus": b"Content-Length: +4\r\n",
    "cl-inner-space": b"Content-Length: 4 0\r\n",
    "cl-list": b"Content-Length: 4, 40\r\n",
}


@both
@pytest.mark.parametrize("fields", SMUGGLING.values(), ids=SMUGGLING.keys())
def test_smuggled_requests_are_refused_and_never_served(backend: str, fields: bytes) -> None:
    async def main() -> None:
        app = Recorder()
        async with serving(app) as port, connect(port) as client:
            smuggled = get("/smuggled")
            body = b"0\r\n\r\n" + smuggled
            await client.send(
                b"POST /front HTTP/1.1\r\nHost: test\r\n" + fields + b"\r\n" + body + smuggled
            )
            await refused_and_closed(client, 400)
        assert app.paths == []

    run(backend, main)


@both
def test_transfer_encoding_in_http10_is_refused(backend: str) -> None:
    async def main() -> None:
        app = Recorder()
        async with serving(app) as port, connect(port) as client:
            await client.send(
                b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + get("/x")
            )
            response = await refused_and_closed(client, 400)
            assert b"HTTP/1.0 request may not have a Transfer-Encoding" in response.body
        assert app.paths == []

    run(backend, main)


# -- Host ------------------------------------------------------------------------------------------


@both
@pytest.mark.parametrize(
    ("request_bytes", "reason"),
    [
        (get("/", host=None), b"must have a Host header"),
        (get("/", "Host: other"), b"more than one Host header"),
        (get("/", host="a b"), b"not a valid host"),
        (get("/", host="evil.com/path"), b"not a valid host"),
    ],
    ids=["missing", "two", "space", "slash"],
)
def test_host_rules(backend: str, request_bytes: bytes, reason: bytes) -> None:
    async def main() -> None:
        app = Recorder()
        async with serving(app) as port:
            async with connect(port) as client:
                await client.send(request_bytes)
                response = await refused_and_closed(client, 400)
                assert reason in response.body
            async with connect(port) as client:  # HTTP/1.0 may leave Host out
                await client.send(b"GET /ten HTTP/1.0\r\n\r\n")
                (response,) = await client.until_closed()
                assert response.status == 200
        assert app.paths == ["/ten"]

    run(backend, main)


# -- slow, silent and non-reading clients ----------------------------------------------------------


@both
def test_silent_client_is_closed(backend: str) -> None:
    async def main() -> None:
        async with serving(Recorder()) as port, connect(port) as client:
            assert await client.until_closed() == []

    run(backend, main)


@both
def test_idle_keep_alive_connection_is_closed(backend: str) -> None:
    async def main() -> None:
        async with serving(Recorder()) as port, connect(port) as client:
            await client.send(get("/one"))
            assert (await client.response()).body == b"/one"
            assert await client.until_closed() == []

    run(backend, main)


@both
def test_slow_header_client_is_closed_before_its_head_ends(backend: str) -> None:
    async def main() -> None:
        app = Recorder()
        trickled = 0
        async with serving(app) as port, connect(port) as client:
            await client.send(b"GET /slow HTTP/1.1\r\nHost: test\r\n")

            async def trickle() -> None:
                # A header line every 50 ms, each inside the head timeout, for longer
                # than the test guard: only the server closing ends it.
                nonlocal trickled
                for i in range(GUARD_S * 20):
                    if not await client.send(b"X-%d: y\r\n" % i):
                        return
                    trickled += 1
                    await anyio.sleep(0.05)

            async with anyio.create_task_group() as tg:
                tg.start_soon(trickle)
                assert await client.until_closed() == []
                tg.cancel_scope.cancel()
        assert app.paths == []
        assert trickled < GUARD_S * 20

    run(backend, main)


@both
def test_a_body_that_stops_is_dropped(backend: str) -> None:
    async def main() -> None:
        app = Recorder()
        async with serving(app) as port, connect(port) as client:
            await client.send(b"POST /p HTTP/1.1\r\nHost: test\r\nContent-Length: 10\r\n\r\nabc")
            assert await client.until_closed() == []
        assert app.paths == ["/p"]

    run(backend, main)


@both
def test_a_client_that_does_not_read_is_not_read_and_is_dropped(backend: str) -> None:
    async def main() -> None:
        app = Recorder(response_size=256 * 1024)
        batch = b"".join(get(f"/{i}") for i in range(100))
        cap = 20_000  # batches: 60 MB of requests, far past what socket buffers hold
        sent = 0
        async with serving(app) as port:
            async with connect(port, receive_buffer=4096) as client:
                # Pipeline without reading until the server hangs up: it stops
                # reading our requests (our sends block once the buffers are
                # full), then drops us, and a send fails.
                while sent < cap and await client.send(batch):
                    sent += 1
                await client.until_closed()
            # Each answer is 256 KiB: a handful fill the socket buffers, and
            # then the server neither answers nor reads any more.
            assert sent < cap
            assert len(app.paths) < 100
            async with connect(port) as other:  # and it serves everyone else
                await other.send(get("/other"))
                assert (await other.response()).body.startswith(b"/other")

    run(backend, main)


# -- oversized heads, chunk framing and trailers ---------------------------------------------------


async def flood_until_refused(client: Client, start: bytes, filler: bytes, limit: int) -> int:
    """Send *start*, then *filler* until the server answers or *limit* bytes went; bytes sent."""
    await client.send(start)
    sent = len(start)

    async def flood() -> None:
        nonlocal sent
        while sent < limit and await client.send(filler):
            sent += len(filler)

    async with anyio.create_task_group() as tg:
        tg.start_soon(flood)
        await client.response()
        tg.cancel_scope.cancel()
    return sent


@both
@pytest.mark.parametrize(
    "request_bytes",
    [
        get("/", "X-Big: " + "v" * 1024 * 1024),
        get("/", *(f"X-{i}: v" for i in range(10_000))),
        get("/" + "u" * 100_000),
    ],
    ids=["1MB-header", "10000-headers", "100kB-target"],
)
def test_huge_heads_get_431(backend: str, request_bytes: bytes) -> None:
    async def main() -> None:
        app = Recorder()
        async with (
            serving(app) as port,
            connect(port) as client,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(client.send, request_bytes)
            await refused_and_closed(client, 431)
            tg.cancel_scope.cancel()
        assert app.paths == []

    run(backend, main)


@both
def test_a_header_that_never_ends_gets_431(backend: str) -> None:
    async def main() -> None:
        async with serving(Recorder()) as port, connect(port) as client:
            start = b"GET / HTTP/1.1\r\nHost: test\r\nX-Endless: "
            sent = await flood_until_refused(client, start, b"v" * 65536, 256 * 2**20)
            assert sent < 256 * 2**20
            assert client.responses == [] or client.responses[0].status == 431

    run(backend, main)


@both
@pytest.mark.parametrize(
    ("start", "filler", "status"),
    [
        (b"1;ext=", b"a" * 65536, 400),  # an endless chunk extension
        (b"1\r\nx\r\n0\r\n", b"X-Trailer: " + b"v" * 1000 + b"\r\n", 431),  # endless trailers
    ],
    ids=["chunk-extension", "trailers"],
)
def test_endless_chunk_framing_gets_an_answer(
    backend: str, start: bytes, filler: bytes, status: int
) -> None:
    async def main() -> None:
        app = Recorder()
        head = b"POST /c HTTP/1.1\r\nHost: test\r\nTransfer-Encoding: chunked\r\n\r\n"
        async with serving(app) as port, connect(port) as client:
            limit = 200 * 2**20  # 200 MiB: an answer must come long before
            sent = await flood_until_refused(client, head + start, filler, limit)
            assert sent < limit
        assert client.responses == [] or client.responses[0].status == status

    run(backend, main)


@both
def test_many_requests_pipelined_at_once_are_all_answered_in_order(backend: str) -> None:
    # The framing parses a step at a time: a flood of small pipelined requests
    # stays bytes until its turn, and nothing is lost at the step boundaries.
    async def main() -> None:
        app = Recorder()
        async with serving(app) as port, connect(port) as client:
            count = 3000
            async with anyio.create_task_group() as tg:
                tg.start_soon(client.send, b"".join(get(f"/{i}") for i in range(count)))
                bodies = [(await client.response()).body for _ in range(count)]
            assert bodies == [f"/{i}".encode() for i in range(count)]

    run(backend, main)


# -- the V2 server: bombs, traversal names, host paths, tokens -------------------------------------


TOKEN = "hostile-test-token"  # a test fixture, not a credential


def test_host_paths_are_cut_but_the_servers_endpoints_stay() -> None:
    from trioinfer.server._errors import without_host_paths

    assert without_host_paths("cannot open /home/me/x/model.onnx: gone") == (
        "cannot open model.onnx: gone"
    )
    assert without_host_paths("/srv/repo/m/1/model.onnx is bad", "/srv/repo") == (
        "m/1/model.onnx is bad"
    )
    for message in (
        "register it first (POST /v2/systemsharedmemory/region/<name>/register)",
        "use system shared memory (/v2/systemsharedmemory), or",
        "set it on /v2/trace/setting; a model",
    ):
        assert without_host_paths(message) == message


def write_repository(root: Path, outside: Path) -> None:
    """The example model, a model file that is not ONNX, and a link out of the repository."""
    shutil.copytree(example_repository() / "digits", root / "digits")
    (root / "garbage" / "1").mkdir(parents=True)
    (root / "garbage" / "1" / "model.onnx").write_bytes(b"this is not an ONNX file")
    outside.mkdir()
    (outside / "model.onnx").write_bytes(b"outside")
    (root / "escape" / "1").mkdir(parents=True)
    os.symlink(outside / "model.onnx", root / "escape" / "1" / "model.onnx")


def raw_request(method: str, target: str, body: bytes = b"", *headers: str) -> bytes:
    lines = [
        f"{method} {target} HTTP/1.1",
        "Host: test",
        f"Content-Length: {len(body)}",
        *headers,
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def exchange(port: int, request_bytes: bytes) -> Response:
    async with connect(port) as client:
        await client.send(request_bytes)
        return await client.response()


def digits_body() -> bytes:
    return json.dumps(
        {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": [0.0] * 64}]}
    ).encode()


@both
def test_v2_server_against_hostile_requests(backend: str, tmp_path: Path) -> None:
    root = tmp_path / "repository"
    outside = tmp_path / "outside"
    write_repository(root, outside)
    limits = Limits(
        max_body_bytes=2**20, head_timeout=SHORT_S, body_timeout=SHORT_S, send_timeout=SHORT_S
    )
    config = ServerConfig(limits=limits, admin_token=TOKEN, drain_period=1.0)
    auth = f"Authorization: Bearer {TOKEN}"
    host_paths = [
        str(tmp_path),
        str(root.resolve()),
        str(outside),
        "/onnxruntime_src",
        str(Path.home()),
    ]
    answers: list[Response] = []

    async def ask(request_bytes: bytes) -> Response:
        response = await exchange(port, request_bytes)
        answers.append(response)
        return response

    async def main() -> None:
        nonlocal port
        async with anyio.create_task_group() as tg:
            listening = await tg.start(
                partial(serve_http, root, port=0, config=config, handle_signals=False)
            )
            port = listening.port
            assert listening.failed == ("escape", "garbage")
            infer = "/v2/models/digits/infer"
            ok = await ask(raw_request("POST", infer, digits_body()))
            assert ok.status == 200, ok.body

            # Compression bombs: 64 MiB of zeros in 64 KiB, against a 1 MiB limit.
            zeros = b"\0" * 64 * 2**20
            bombs = {
                "gzip": gzip.compress(zeros),
                "deflate": zlib.compress(zeros),
            }
            for coding, bomb in bombs.items():
                response = await ask(
                    raw_request("POST", infer, bomb, f"Content-Encoding: {coding}")
                )
                assert response.status == 413, (coding, response.body)
            nested = gzip.compress(gzip.compress(digits_body()))
            response = await ask(raw_request("POST", infer, nested, "Content-Encoding: gzip, gzip"))
            assert response.status == 415
            response = await ask(raw_request("POST", infer, b"x" * (2**20 + 1)))
            assert response.status == 413

            # Traversal names, raw (no client normalises them): never served, never a 5xx.
            for name in [
                "..",
                ".",
                "..%2F..%2Fetc",
                "%2e%2e",
                "%2Fetc%2Fpasswd",
                ".hidden",
                "digits%00",
                "..%5C..%5Cwindows",
                "escape",
            ]:
                for target in [
                    f"/v2/repository/models/{name}/load",
                    f"/v2/models/{name}/infer",
                    f"/v2/models/{name}",
                ]:
                    method = "GET" if target.endswith(name) else "POST"
                    response = await ask(raw_request(method, target, b"", auth))
                    assert 400 <= response.status < 500, (target, response.status, response.body)

            # The admin token: none, empty, wrong.
            for header in [None, "Authorization: Bearer ", "Authorization: Bearer wrong"]:
                extra = [header] if header else []
                response = await ask(
                    raw_request("POST", "/v2/repository/models/digits/load", b"", *extra)
                )
                assert response.status == 401

            # What the broken models say, in answers and in the index.
            garbage = await ask(
                raw_request("POST", "/v2/repository/models/garbage/load", b"", auth)
            )
            # The repository's fault, not the server's: a 400 naming the file (as Triton).
            assert garbage.status == 400
            assert b"garbage/1/model.onnx" in garbage.body
            escape = await ask(raw_request("POST", "/v2/repository/models/escape/load", b"", auth))
            assert escape.status == 400
            index = await ask(raw_request("POST", "/v2/repository/index", b"", auth))
            assert index.status == 200
            reasons = {row["name"]: row.get("reason", "") for row in json.loads(index.body)}
            assert "leads outside the model repository" in reasons["escape"]

            # HTTP rules hold on the V2 server too.
            response = await ask(b"GET /v2/health/live HTTP/1.1\r\n\r\n")
            assert response.status == 400
            tg.cancel_scope.cancel()

    port = 0
    run(backend, main)
    for response in answers:
        for path in host_paths:
            assert path.encode() not in response.body, (path, response.body)


def test_an_empty_admin_token_is_refused() -> None:
    for token in ["", "  ", " padded ", "new\nline"]:
        with pytest.raises(ConfigError, match="admin_token must"):
            ServerConfig(admin_token=token)
