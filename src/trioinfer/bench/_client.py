"""The HTTP client: V2 metadata and infer requests over plain non-blocking sockets.

`_Connection` is one keep-alive connection with its httptools response parser;
`HttpTarget` is a model on a V2 server: its metadata, and each request variant
as the whole HTTP request, encoded once before the run.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from typing import Any, Final
from urllib.parse import urlsplit

import attrs
import httptools
import trio

from .._util import server_url
from ..server import encode_infer_request
from ._inputs import BenchError, Tensor
from ._modes import SequenceStep, ShmRegion, shm_request_doc
from ._stats import Status, _Recorder

# Status of a request that got no HTTP answer (refused, reset, closed mid-response).
_CONN_ERROR: Final = "conn"
_RECV_BYTES: Final = 256 * 1024


class _Connection:
    """One keep-alive HTTP/1.1 connection: a plain non-blocking socket and its parser.

    `_LoadLoop` drives many at once from a worker thread; `request` sends a one-off
    (metadata, the probe) from Trio, waiting with ``trio.lowlevel.wait_readable``:
    Trio's socket wrappers cost several times more per call, and this client's own
    CPU time is what it must keep small.
    """

    __slots__ = (
        "body",
        "busy",
        "connecting",
        "done",
        "events",
        "fd",
        "first",
        "keep_alive",
        "keep_body",
        "parser",
        "pending",
        "recorder",
        "sock",
        "start",
        "status",
        "stream_error",
        "streaming",
        "unsent",
    )

    def __init__(self, recorder: _Recorder, *, streaming: bool = False) -> None:
        self.recorder = recorder
        # generate_stream (SSE): each answer's events counted as they arrive, the
        # first one's time, the first error event, and an event not yet whole.
        self.streaming = streaming
        self.events = 0
        self.first = 0
        self.stream_error: str | None = None
        self.pending = bytearray()
        self.sock: socket.socket | None = None
        self.fd = -1
        self.parser: httptools.HttpResponseParser | None = None
        self.busy = False  # a request is in flight
        self.connecting = False
        self.unsent: memoryview | None = None  # what the socket's buffer did not take yet
        self.start = 0  # when the request in flight started (ns), for its latency
        self.done = False
        self.keep_alive = True
        self.status: Status = 0
        self.body: list[bytes] | None = None
        self.keep_body = False  # keep a successful answer's body too (metadata)

    # httptools callbacks: only these three, as each costs a Python call per answer.
    def on_headers_complete(self) -> None:
        assert self.parser is not None
        self.status = self.parser.get_status_code()
        # Keep a failed answer's body for the message; never a successful one's.
        self.body = None if self.status == 200 and not self.keep_body else []
        if self.streaming:
            self.events, self.first, self.stream_error = 0, 0, None
            self.pending.clear()

    def on_body(self, body: bytes) -> None:
        if self.body is not None:
            self.body.append(body)
        elif self.streaming:
            self._events(body)

    def _events(self, body: bytes) -> None:
        # Server-sent events, 'data: {...}' each, ended by a blank line.
        pending = self.pending
        pending += body
        while (end := pending.find(b"\n\n")) >= 0:
            event = bytes(pending[:end])
            del pending[: end + 2]
            if event.startswith(b'data: {"error"'):
                if self.stream_error is None:
                    self.stream_error = event[6:300].decode(errors="replace")
            elif event.startswith(b"data:"):
                if not self.events:
                    self.first = time.perf_counter_ns()
                self.events += 1

    def on_message_complete(self) -> None:
        assert self.parser is not None
        # Read here: once the message is complete the parser resets for the next one.
        self.keep_alive = self.parser.should_keep_alive()
        self.done = True

    async def connect(self, address: tuple[str, int]) -> None:
        """Open the connection (raising `OSError` when refused)."""
        sock = _new_socket(address)
        try:
            try:
                sock.connect(address)
            except BlockingIOError:
                await trio.lowlevel.wait_writable(sock)
                error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if error:
                    raise OSError(error, os.strerror(error)) from None
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.fd = sock.fileno()
        self.parser = httptools.HttpResponseParser(self)

    def close(self) -> None:
        """Close the socket, if open."""
        if self.sock is not None:
            trio.lowlevel.notify_closing(self.sock)
            self.sock.close()
        self.sock = None

    async def request(self, data: bytes) -> Status:
        """Send *data* (a whole request) and read the answer; return its status."""
        sock, parser = self.sock, self.parser
        assert sock is not None
        assert parser is not None
        self.done = False
        try:
            view = memoryview(data)
            while view:
                await trio.lowlevel.wait_writable(sock)
                with suppress(BlockingIOError):
                    view = view[sock.send(view) :]
            while not self.done:
                await trio.lowlevel.wait_readable(sock)
                try:
                    chunk = sock.recv(_RECV_BYTES)
                except BlockingIOError:
                    continue
                if not chunk:
                    raise ConnectionResetError("the server closed the connection")
                parser.feed_data(chunk)
        except (OSError, httptools.HttpParserError) as exc:
            self.close()
            self.recorder.first_error.setdefault(_CONN_ERROR, f"{type(exc).__name__}: {exc}")
            return _CONN_ERROR
        if not self.keep_alive:
            self.close()
        return self.status


def _new_socket(address: tuple[str, int]) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET)
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _plain(values: Any) -> Any:
    # A tensor's values as JSON takes them: BYTES elements as text.
    if isinstance(values, list):
        return [_plain(v) for v in values]
    return values.decode(errors="replace") if isinstance(values, bytes) else values


def _error_text(body: bytes) -> str:
    # A V2 error answer's message ({"error": ...}), else the start of the body.
    try:
        return str(json.loads(body).get("error", body.decode(errors="replace")))
    except (ValueError, AttributeError):
        return body[:300].decode(errors="replace")


def _http_requests(
    host: str, port: int, path: str, bodies: Sequence[tuple[bytes, int | None]]
) -> list[bytes]:
    out = []
    for body, header_length in bodies:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        )
        if header_length is not None:
            head = head.replace("application/json", "application/octet-stream")
            head += f"Inference-Header-Content-Length: {header_length}\r\n"
        out.append((head + "\r\n").encode("latin-1") + body)
    return out


@attrs.frozen
class HttpTarget:
    """A V2 server's model, reached over HTTP/1.1 on keep-alive connections.

    Attributes:
        host: The server's address.
        port: Its port.
        model: The model's name.
        version: The model version, or ``None`` for the server's choice.
    """

    host: str
    port: int
    model: str
    version: str | None = None

    @classmethod
    def from_url(cls, url: str, model: str, version: str | None = None) -> HttpTarget:
        """Parse ``http://HOST:PORT``, or ``HOST:PORT`` as perf_analyzer's ``-u`` takes it.

        Raises:
            BenchError: Not an ``http://`` URL.
        """
        try:
            parts = server_url(url)
        except ValueError as exc:
            # A gRPC URL is the likely slip: say the option that makes it right.
            hint = {
                "grpc": " (for V2 gRPC, add --protocol grpc)",
                "https": " (the tool speaks no TLS: use a plain-HTTP port)",
            }.get(urlsplit(url).scheme, "")
            raise BenchError(f"{exc}{hint}") from None
        assert parts.hostname is not None  # server_url checked it
        return cls(parts.hostname, parts.port or 80, model, version)

    @property
    def model_path(self) -> str:
        """``/v2/models/{model}[/versions/{version}]``."""
        path = f"/v2/models/{self.model}"
        return path if self.version is None else f"{path}/versions/{self.version}"

    async def get(self, path: str) -> tuple[int, bytes]:
        """A one-off GET (metadata) on a fresh connection; returns the status and body.

        Raises:
            BenchError: Nothing answers at the address.
        """
        return await self.call(
            f"GET {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n\r\n".encode(), path
        )

    async def post(self, path: str, doc: Mapping[str, Any]) -> tuple[int, bytes]:
        """A one-off POST of *doc* as JSON on a fresh connection; returns the status and body.

        Raises:
            BenchError: Nothing answers at the address.
        """
        body = json.dumps(doc).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        return await self.call(head.encode() + body, path)

    async def call(self, request: bytes, path: str) -> tuple[int, bytes]:
        """Send one whole HTTP *request* (for *path*) on a fresh connection; return its answer.

        Raises:
            BenchError: Nothing answers at the address.
        """
        recorder = _Recorder()
        connection = _Connection(recorder)
        try:
            await connection.connect((self.host, self.port))
        except OSError as exc:
            raise BenchError(
                f"cannot connect to http://{self.host}:{self.port}: {exc.strerror or exc}; "
                "is the server running?"
            ) from None
        connection.keep_body = True
        try:
            status = await connection.request(request)
            body = b"".join(connection.body or [])
        finally:
            connection.close()
        if status == _CONN_ERROR:
            raise BenchError(
                f"http://{self.host}:{self.port}{path} gave no HTTP answer: "
                f"{recorder.first_error.get(_CONN_ERROR)}"
            )
        return int(status), body

    async def config(self) -> dict[str, Any]:
        """The model's configuration (``GET /v2/models/{m}/config``), or ``{}`` without one.

        A server without Triton's configuration endpoint (MLServer, KServe) answers
        404: then nothing is known of the model beyond its metadata.
        """
        status, body = await self.get(f"{self.model_path}/config")
        try:
            doc = json.loads(body) if status == 200 else {}
        except ValueError:
            doc = {}
        return doc if isinstance(doc, dict) else {}

    async def metadata(self) -> dict[str, Any]:
        """The model's V2 metadata (``GET /v2/models/{m}``).

        Raises:
            BenchError: No server, or it does not serve the model (with its message).
        """
        status, body = await self.get(self.model_path)
        if status != 200:
            raise BenchError(
                f"the server answered {status} for model {self.model!r}"
                f"{'' if self.version is None else f' version {self.version}'}: "
                f"{_error_text(body)}"
            )
        doc = json.loads(body)
        if not isinstance(doc, dict) or not isinstance(doc.get("inputs"), list):
            raise BenchError(f"{self.model_path} gave no V2 model metadata: {body[:200]!r}")
        return doc

    def requests(self, variants: Sequence[Sequence[Tensor]], *, binary: bool) -> list[bytes]:
        """Each variant's whole HTTP request, bytes ready to send."""
        bodies = [
            encode_infer_request({t.name: t.array for t in v}, binary=binary) for v in variants
        ]
        return _http_requests(self.host, self.port, f"{self.model_path}/infer", bodies)

    def sequence_requests(
        self, variants: Sequence[Sequence[Tensor]], *, binary: bool
    ) -> Callable[[int, SequenceStep], bytes]:
        """A maker of whole HTTP requests: variant *n* as step *step* of its sequence.

        Each variant is encoded once; only its ``parameters`` (the sequence's id
        and flags beside the encoding's own) are written per request.
        """
        parts = []
        for variant in variants:
            body, header_length = encode_infer_request(
                {t.name: t.array for t in variant}, binary=binary
            )
            header = body if header_length is None else body[:header_length]
            doc = json.loads(header)
            parameters = doc.pop("parameters", {})
            # '{"inputs": ...}' without its '{': each request's parameters go first.
            rest = json.dumps(doc, separators=(",", ":")).encode()[1:]
            parts.append((parameters, rest, body[len(header) :]))
        path = f"{self.model_path}/infer"

        def make(n: int, step: SequenceStep) -> bytes:
            parameters, rest, blobs = parts[n % len(parts)]
            own = json.dumps({**parameters, **step.parameters()}, separators=(",", ":"))
            header = b'{"parameters":' + own.encode() + b"," + rest
            length = len(header) if binary else None
            return _http_requests(self.host, self.port, path, [(header + blobs, length)])[0]

        return make

    def stream_requests(self, variants: Sequence[Sequence[Tensor]]) -> list[bytes]:
        """Each variant as a whole ``generate_stream`` request (Triton's generate extension).

        Its body is one JSON object: each input's values under its name, as nested
        lists, which the server shapes as the input's metadata says.
        """
        bodies = [
            (json.dumps({t.name: _plain(t.array.tolist()) for t in v}).encode(), None)
            for v in variants
        ]
        return _http_requests(self.host, self.port, f"{self.model_path}/generate_stream", bodies)

    def shm_requests(self, regions: Sequence[ShmRegion]) -> list[bytes]:
        """For each region, the whole HTTP request whose inputs and outputs lie in it."""
        bodies = [(json.dumps(shm_request_doc(r)).encode(), None) for r in regions]
        return _http_requests(self.host, self.port, f"{self.model_path}/infer", bodies)

    async def register_regions(self, regions: Sequence[ShmRegion]) -> None:
        """Register each region with the server's system shared-memory extension.

        Raises:
            BenchError: The server refused one (its message, e.g. a server of
                several worker processes, which takes none).
        """
        for region in regions:
            status, body = await self.post(
                f"/v2/systemsharedmemory/region/{region.name}/register",
                {"key": region.key, "offset": 0, "byte_size": region.byte_size},
            )
            if status != 200:
                raise BenchError(
                    f"the server refused to register the shared-memory region {region.name!r} "
                    f"(HTTP {status}): {_error_text(body)}"
                )

    async def unregister_regions(self, regions: Sequence[ShmRegion]) -> None:
        """Unregister each region (one the server does not know, or no server, is no error)."""
        for region in regions:
            with suppress(BenchError):
                await self.post(f"/v2/systemsharedmemory/region/{region.name}/unregister", {})
