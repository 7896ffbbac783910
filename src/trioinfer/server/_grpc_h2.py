"""gRPC over HTTP/2 on the serving loop: python-hyper's ``h2`` state machine on an anyio socket.

No grpcio server, no second thread, no bridge: each connection is a task of
the serving loop (Trio or asyncio) that feeds the bytes it reads to an
``h2.connection.H2Connection`` and writes what that answers; each RPC is a
task of the connection's task group, so a call's cancel scope is the
request's. What gRPC adds to HTTP/2 is handled here:

- framing: each message behind a 5-byte prefix (a compressed flag, a
  big-endian length); a message over the size cap is refused with
  ``RESOURCE_EXHAUSTED`` before its bytes are buffered;
- ``grpc-timeout`` becomes the call's deadline (`GrpcCall.expires`), which
  the service turns into the request's cancel scope deadline;
- a client's RST_STREAM, or the connection's loss, cancels the call's task,
  and with it the request in the engine;
- answers end with ``grpc-status`` / ``grpc-message`` trailers (a failure
  before any answer is a trailers-only response);
- ``grpc-encoding``: only identity; a compressed message or another encoding
  is refused with ``UNIMPLEMENTED``, as gRPC specifies;
- flow control both ways: an answer waits for the client's window; a stream's
  messages are acknowledged only as its handler takes them (beyond
  `_STREAM_BACKLOG` waiting ones), so a client that sends faster than the
  engine answers is held by its HTTP/2 window instead of buffered without
  bound;
- PING is answered by h2; at shutdown each connection gets a GOAWAY, calls in
  progress may finish, new streams are refused.

h2 does the HTTP/2; around it, only what repeats is remembered: header
blocks made of table indexes only (`_Decoder`, `_Encoder`), which hpack
would decode and encode the same way call after call.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import struct
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Final, Protocol, final

import anyio
import anyio.abc
import anyio.lowlevel
import attrs
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import hpack
import sniffio
import trio
from hyperframe.frame import GoAwayFrame

log = logging.getLogger("trioinfer.server")

#: gRPC status codes used by the transport itself (the service maps its own).
OK: Final = 0
CANCELLED: Final = 1
INVALID_ARGUMENT: Final = 3
RESOURCE_EXHAUSTED: Final = 8
UNIMPLEMENTED: Final = 12
INTERNAL: Final = 13
UNAVAILABLE: Final = 14

#: Complete messages a stream may hold for its handler before its data is left unacknowledged.
_STREAM_BACKLOG: Final = 4
#: The receive window offered per stream and per connection.
_WINDOW: Final = 1 << 20
_MAX_STREAMS: Final = 1024
_PREFIX: Final = struct.Struct(">BI")
#: The request encodings taken (gRPC's gzip and deflate), as zlib's wbits; answers go identity.
_WBITS: Final[dict[str, int | None]] = {
    "identity": None,
    "gzip": 16 + zlib.MAX_WBITS,
    "deflate": zlib.MAX_WBITS,
}
_ACCEPT: Final = ",".join(_WBITS).encode()
_TIMEOUT_UNITS: Final = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}
#: Request headers that are HTTP/2's or gRPC's own, not the call's metadata.
_RESERVED: Final = frozenset(
    {
        b"te",
        b"content-type",
        b"grpc-timeout",
        b"grpc-encoding",
        b"grpc-accept-encoding",
        b"user-agent",
    }
)
# h2's header validation costs about a fifth of its time per call; requests' headers
# only pick a method, a deadline and metadata compared as strings, never forwarded.
_CONFIG: Final = h2.config.H2Configuration(
    client_side=False,
    header_encoding=None,
    validate_outbound_headers=False,
    normalize_outbound_headers=False,
    validate_inbound_headers=False,
    normalize_inbound_headers=False,
)


#: Header-block bytes that are each a complete one-byte indexed field (RFC 7541 6.1:
#: indexes 1-126); a block made only of them neither reads nor changes the dynamic table
#: beyond looking entries up.
_INDEXED: Final = bytes(range(0x81, 0xFF))
#: Header blocks remembered per connection and direction, before the memo starts over.
_MEMO_SIZE: Final = 64


def _indexed_only(block: bytes) -> bool:
    return bool(block) and not block.translate(None, _INDEXED)


@final
class _Decoder(hpack.Decoder):
    """hpack's decoder, remembering what blocks of indexed fields only decoded to.

    A client that repeats its headers (grpcio does, call after call) sends the
    same few bytes of table indexes each time; decoding them again gives the
    same headers as long as the dynamic table is unchanged. Only a block with
    a literal or a table size update changes the table, so decoding any such
    block forgets what was remembered. Saves hpack's per-field work (about a
    tenth of a call's server CPU); everything else is hpack's own decoding.
    """

    def __init__(self) -> None:
        super().__init__()
        self._memo: dict[bytes, list[Any]] = {}

    def decode(self, data: bytes, raw: bool = False) -> list[Any]:
        """Decode *data* as hpack does, from memory when the table cannot have changed."""
        key = bytes(data)
        headers = self._memo.get(key) if raw else None
        if headers is not None and self.header_table_size <= self.max_allowed_table_size:
            return list(headers)
        indexed = _indexed_only(key)
        try:
            decoded = list(super().decode(data, raw))
        finally:
            if not indexed:
                self._memo.clear()
        if indexed and raw:
            if len(self._memo) >= _MEMO_SIZE:
                self._memo.clear()
            self._memo[key] = decoded
            return list(decoded)
        return decoded


@final
class _Encoder(hpack.Encoder):
    """hpack's encoder, remembering header lists that encoded to table indexes only.

    The answers' headers and trailers repeat call after call; once they are in
    the dynamic table they encode to the same few index bytes, which do not
    change the table. Any encoding that adds to the table (or a pending table
    size change) forgets what was remembered. The server never sends headers
    marked never-indexed, so the key is the list of (name, value) pairs.
    """

    def __init__(self) -> None:
        super().__init__()
        self._memo: dict[tuple[Any, ...], bytes] = {}

    def encode(self, headers: Any, huffman: bool = True) -> bytes:
        """Encode *headers* as hpack does, from memory when the table cannot have changed."""
        key = tuple(headers) if huffman and isinstance(headers, list) else None
        if key is not None and not self.header_table.resized:
            block = self._memo.get(key)
            if block is not None:
                return block
        block = super().encode(key if key is not None else headers, huffman)
        if key is not None and _indexed_only(block):
            if len(self._memo) >= _MEMO_SIZE:
                self._memo.clear()
            self._memo[key] = block
        else:
            self._memo.clear()
        return block


class _Cancellable(Protocol):
    def cancel(self) -> None: ...


def _native() -> tuple[Callable[[], Any], Callable[[], Any]]:
    # On Trio its nursery and cancel scope: a good deal cheaper than anyio's wrappers
    # over them, and this runs once per call (a task and a scope each).
    if sniffio.current_async_library() == "trio":
        return trio.open_nursery, trio.CancelScope
    return anyio.create_task_group, anyio.CancelScope


class GrpcError(Exception):
    """Raised by a handler to end its call with a gRPC status and message."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@final
@attrs.define(eq=False)
class GrpcCall:
    """What a handler knows of its call: the client's metadata and deadline, and whether it left.

    Attributes:
        metadata: The request's headers that are not HTTP/2's or gRPC's own
            (lower-case keys; binary ``-bin`` ones left out).
        expires: ``time.monotonic()`` when the client's ``grpc-timeout``
            passes, or None.
        gone: True once the client reset the stream or the connection was lost.
    """

    metadata: dict[str, str]
    expires: float | None
    gone: bool = False
    _scope: _Cancellable | None = None

    def cancel(self) -> None:
        """The client left: cancel the call's task (and the request it runs)."""
        self.gone = True
        if self._scope is not None:
            self._scope.cancel()


#: A unary handler: the request message in, the answer message out.
Unary = Callable[[bytes, GrpcCall], Awaitable[bytes]]
#: A bidirectional-streaming handler: the request messages, the call, a send function.
Streaming = Callable[
    [AsyncIterator[bytes], GrpcCall, Callable[[bytes], Awaitable[None]]], Awaitable[None]
]


@final
@attrs.define(frozen=True)
class Method:
    """A served method: its handler, unary or bidirectional streaming."""

    handler: Unary | Streaming
    streaming: bool


@final
@attrs.define(eq=False)
class _Stream:
    """One HTTP/2 stream's state: its method, its inbound bytes and messages, its call."""

    stream_id: int
    method: Method
    call: GrpcCall
    #: zlib's wbits for its grpc-encoding (gzip, deflate), or None for identity.
    wbits: int | None
    buffer: bytearray = attrs.field(factory=bytearray)
    messages: collections.deque[bytes] = attrs.field(factory=collections.deque)
    #: Bytes received but not yet acknowledged (held back while the backlog is full).
    unacked: int = 0
    ended: bool = False
    closed: bool = False
    #: Set when messages arrive or the stream ends (a streaming handler waits on it).
    arrived: anyio.Event | None = None
    #: Set when the client's window may have opened (an answer waits on it).
    window: anyio.Event | None = None
    #: A failure found while reading its messages (status, message), answered instead.
    error: tuple[int, str] | None = None
    started: bool = False


def _wake(event: anyio.Event | None) -> None:
    if event is not None:
        event.set()


def _percent(message: str) -> bytes:
    # grpc-message is percent-encoded UTF-8 outside printable ASCII (and '%').
    return b"".join(
        bytes((b,)) if 0x20 <= b <= 0x7E and b != 0x25 else b"%%%02X" % b
        for b in message.encode("utf-8")
    )


def _check(ok: bool, code: int, message: Callable[[], str]) -> None:
    if not ok:
        raise GrpcError(code, message())


def _unsupported(encoding: str) -> str:
    return (
        f"grpc-encoding {encoding[:32]!r} is not supported; this server takes {', '.join(_WBITS)}"
    )


def _deadline(value: str) -> float:
    _check(
        2 <= len(value) <= 9 and value[:-1].isdigit() and value[-1] in _TIMEOUT_UNITS,
        INVALID_ARGUMENT,
        lambda: f"grpc-timeout {value[:32]!r} is not 1-8 digits and a unit (H, M, S, m, u, n)",
    )
    return time.monotonic() + int(value[:-1]) * _TIMEOUT_UNITS[value[-1]]


@final
class _Connection:
    """One client connection: reads frames, starts a task per call, writes what h2 answers."""

    def __init__(
        self,
        socket: anyio.abc.SocketStream,
        methods: Mapping[str, Method],
        max_message: int,
        server: GrpcServer,
    ) -> None:
        self._socket = socket
        self._methods = methods
        self._max = max_message
        self._server = server
        self._h2 = h2.connection.H2Connection(config=_CONFIG)
        # hpack's coder, with a memo of the header blocks that repeat (h2 reads and
        # writes through these attributes only); the decoder keeps h2's header list cap.
        decoder = _Decoder()
        decoder.max_header_list_size = self._h2.decoder.max_header_list_size
        self._h2.decoder, self._h2.encoder = decoder, _Encoder()
        self._streams: dict[int, _Stream] = {}
        #: Calls waiting for the client's flow-control window to open.
        self._blocked: set[_Stream] = set()
        self._wake = anyio.Event()
        self._going_away = False
        self._last_stream = 0
        self._extra = b""
        #: The connection's task group: Trio's nursery on Trio, anyio's on asyncio.
        self._group: Any = None
        self._open_group, self._cancel_scope = _native()

    async def run(self) -> None:
        """Serve the connection until the client closes it, or `goaway` lets it end."""
        conn = self._h2
        conn.local_settings = h2.settings.Settings(
            client=False,
            initial_values={
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: _WINDOW,
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: _MAX_STREAMS,
            },
        )
        conn.initiate_connection()
        conn.increment_flow_control_window(_WINDOW * 16)
        try:
            async with self._open_group() as group:
                self._group = group
                group.start_soon(self._writer)
                try:
                    await self._reader()
                finally:
                    # The client went away (or the server stops): every call still
                    # running is cancelled, in the engine too.
                    for stream in self._streams.values():
                        stream.call.cancel()
                    group.cancel_scope.cancel()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass
        finally:
            self._server.connections.discard(self)
            self._server.closed.set()
            with anyio.CancelScope(shield=True):
                await self._socket.aclose()

    def goaway(self) -> None:
        """At shutdown: tell the client to open no more streams; those open may finish."""
        if not self._going_away:
            self._going_away = True
            frame = GoAwayFrame(0)
            frame.last_stream_id = self._last_stream
            frame.error_code = h2.errors.ErrorCodes.NO_ERROR
            self._extra += frame.serialize()
            self._wake.set()

    async def _reader(self) -> None:
        while True:
            try:
                data = await self._socket.receive(65536)
            except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                return
            try:
                events = self._h2.receive_data(data)
            except h2.exceptions.ProtocolError as exc:
                log.info("gRPC connection closed: HTTP/2 protocol error: %s", exc)
                self._h2.close_connection(h2.errors.ErrorCodes.PROTOCOL_ERROR)
                await self._flush()
                return
            for event in events:
                self._event(event)
            self._wake.set()

    def _event(self, event: Any) -> None:
        if isinstance(event, h2.events.DataReceived):
            stream = self._streams.get(event.stream_id)
            if stream is None:
                self._h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                return
            self._data(stream, event.data, event.flow_controlled_length)
        elif isinstance(event, h2.events.RequestReceived):
            self._request(event.stream_id, event.headers)
        elif isinstance(event, h2.events.StreamEnded):
            stream = self._streams.get(event.stream_id)
            if stream is not None:
                stream.ended = True
                if stream.buffer and stream.error is None:
                    stream.error = (INTERNAL, "the request ended inside a message")
                self._ready(stream)
        elif isinstance(event, h2.events.StreamReset):
            stream = self._streams.pop(event.stream_id, None)
            if stream is not None:
                stream.closed = True
                stream.call.cancel()
                _wake(stream.window)
                _wake(stream.arrived)
        elif isinstance(event, h2.events.WindowUpdated | h2.events.RemoteSettingsChanged):
            # Maybe more room to send: the calls waiting for it look again.
            for stream in self._blocked:
                _wake(stream.window)
            self._blocked.clear()
        elif isinstance(event, h2.events.ConnectionTerminated):
            self._going_away = True

    def _request(self, stream_id: int, raw_headers: list[tuple[bytes, bytes]]) -> None:
        self._last_stream = max(self._last_stream, stream_id)
        if self._going_away:
            self._h2.reset_stream(stream_id, h2.errors.ErrorCodes.REFUSED_STREAM)
            return
        # Compared as bytes (h2 hands them so); only what is kept is decoded.
        headers: dict[bytes, bytes] = dict(raw_headers)
        if headers.get(b":method") != b"POST" or not headers.get(b"content-type", b"").startswith(
            b"application/grpc"
        ):
            # Not a gRPC call: HTTP's own answer, as gRPC specifies.
            self._h2.send_headers(stream_id, [(b":status", b"415")], end_stream=True)
            return
        path = headers.get(b":path", b"").decode("latin-1")
        method = self._methods.get(path)
        try:
            encoding = headers.get(b"grpc-encoding", b"identity").decode("latin-1")
            _check(encoding in _WBITS, UNIMPLEMENTED, lambda: _unsupported(encoding))
            _check(method is not None, UNIMPLEMENTED, lambda: f"unknown method {path[:128]!r}")
            timeout = headers.get(b"grpc-timeout")
            expires = _deadline(timeout.decode("latin-1")) if timeout is not None else None
        except GrpcError as exc:
            self._trailers_only(stream_id, exc.code, exc.message)
            return
        metadata = {
            key.decode("latin-1"): value.decode("latin-1")
            for key, value in headers.items()
            if not key.startswith(b":") and key not in _RESERVED and not key.endswith(b"-bin")
        }
        assert method is not None
        stream = _Stream(stream_id, method, GrpcCall(metadata, expires), _WBITS[encoding])
        self._streams[stream_id] = stream
        if method.streaming:
            self._start(stream)

    def _data(self, stream: _Stream, data: bytes, flow: int) -> None:
        stream.unacked += flow
        if stream.error is None:
            stream.buffer += data
            self._split(stream)
        if stream.error is not None:
            # The call is answered at once; whatever else arrives is dropped.
            self._ack(stream)
            self._ready(stream)
            return
        if not stream.method.streaming or len(stream.messages) <= _STREAM_BACKLOG:
            # A unary call's bytes are bounded by the size cap; a stream's are let in
            # until its handler falls behind by more than the backlog, then held by
            # the client's window until it catches up.
            self._ack(stream)
        if stream.method.streaming:
            _wake(stream.arrived)

    def _split(self, stream: _Stream) -> None:
        buffer = stream.buffer
        while len(buffer) >= 5:
            compressed, length = _PREFIX.unpack_from(buffer)
            if compressed and stream.wbits is None:
                stream.error = (
                    INTERNAL,
                    "a message is marked compressed, but the call's grpc-encoding is identity",
                )
            elif length > self._max:
                stream.error = (
                    RESOURCE_EXHAUSTED,
                    f"the message is {length} bytes, over this server's limit of {self._max} "
                    "(max_body_bytes)",
                )
            if stream.error is not None:
                buffer.clear()
                return
            if len(buffer) < 5 + length:
                return
            message = bytes(buffer[5 : 5 + length])
            del buffer[: 5 + length]
            if compressed:
                try:
                    message = self._inflate(message, stream.wbits)
                except GrpcError as exc:
                    stream.error = (exc.code, exc.message)
                    buffer.clear()
                    return
            stream.messages.append(message)

    def _inflate(self, data: bytes, wbits: int | None) -> bytes:
        # Never more than the size cap, however small the compressed message.
        inflater = zlib.decompressobj(wbits or zlib.MAX_WBITS)
        try:
            message = inflater.decompress(data, self._max + 1)
        except zlib.error as exc:
            raise GrpcError(INTERNAL, f"the message could not be decompressed: {exc}") from None
        _check(
            len(message) <= self._max and not inflater.unconsumed_tail,
            RESOURCE_EXHAUSTED,
            lambda: (
                f"the message decompresses to over this server's limit of {self._max} "
                "bytes (max_body_bytes)"
            ),
        )
        return message

    def _ack(self, stream: _Stream) -> None:
        count, stream.unacked = stream.unacked, 0
        if count and not stream.closed:
            with contextlib.suppress(h2.exceptions.StreamClosedError):
                self._h2.acknowledge_received_data(count, stream.stream_id)

    def _ready(self, stream: _Stream) -> None:
        if stream.error is not None and not stream.started:
            self._streams.pop(stream.stream_id, None)
            self._trailers_only(stream.stream_id, *stream.error)
            return
        if stream.method.streaming:
            _wake(stream.arrived)
        elif stream.ended:
            self._start(stream)

    def _start(self, stream: _Stream) -> None:
        stream.started = True
        assert self._group is not None
        self._group.start_soon(self._call, stream, name="grpc call")

    async def _call(self, stream: _Stream) -> None:
        code, message = OK, ""
        sent_headers = False
        with self._cancel_scope() as scope:
            stream.call._scope = scope
            try:
                handler: Any = stream.method.handler
                if stream.method.streaming:

                    async def send(data: bytes) -> None:
                        nonlocal sent_headers
                        if not sent_headers:
                            self._headers(stream)
                            sent_headers = True
                        await self._send_message(stream, data)

                    await handler(self._messages(stream), stream.call, send)
                else:
                    _check(
                        len(stream.messages) == 1,
                        UNIMPLEMENTED if stream.messages else INTERNAL,
                        lambda: (
                            "a unary call takes one request message, this one sent "
                            f"{len(stream.messages)}"
                        ),
                    )
                    answer = await handler(stream.messages[0], stream.call)
                    self._headers(stream)
                    sent_headers = True
                    await self._send_message(stream, answer)
            except GrpcError as exc:
                code, message = exc.code, exc.message
            except h2.exceptions.ProtocolError:
                # The stream or connection closed under the answer (a reset, the
                # client's GOAWAY): nobody is left to tell.
                self._streams.pop(stream.stream_id, None)
                return
            except Exception as exc:  # a bug: this call fails, never its connection
                log.exception("gRPC call failed", exc_info=exc)
                code, message = INTERNAL, f"internal error: {type(exc).__name__}"
        if scope.cancelled_caught or stream.closed:
            self._streams.pop(stream.stream_id, None)
            if not stream.closed:
                # Cancelled from outside while its stream is open: the server stops.
                self._finish(
                    stream, UNAVAILABLE, "the server stopped before the call finished", sent_headers
                )
            return
        self._streams.pop(stream.stream_id, None)
        self._finish(stream, code, message, sent_headers)

    def _finish(self, stream: _Stream, code: int, message: str, sent_headers: bool) -> None:
        trailers = [(b"grpc-status", b"%d" % code)]
        if message:
            trailers.append((b"grpc-message", _percent(message)))
        try:
            if sent_headers:
                self._h2.send_headers(stream.stream_id, trailers, end_stream=True)
            else:
                self._trailers_only(stream.stream_id, code, message)
                return
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            return
        self._wake.set()

    def _headers(self, stream: _Stream) -> None:
        self._h2.send_headers(
            stream.stream_id,
            [
                (b":status", b"200"),
                (b"content-type", b"application/grpc"),
                (b"grpc-accept-encoding", _ACCEPT),
            ],
        )

    def _trailers_only(self, stream_id: int, code: int, message: str) -> None:
        headers = [
            (b":status", b"200"),
            (b"content-type", b"application/grpc"),
            (b"grpc-accept-encoding", _ACCEPT),
            (b"grpc-status", b"%d" % code),
        ]
        if message:
            headers.append((b"grpc-message", _percent(message)))
        try:
            self._h2.send_headers(stream_id, headers, end_stream=True)
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            return
        self._wake.set()

    async def _messages(self, stream: _Stream) -> AsyncIterator[bytes]:
        while True:
            if stream.messages:
                message = stream.messages.popleft()
                if stream.unacked and len(stream.messages) <= _STREAM_BACKLOG:
                    # Caught up: the bytes held back may come.
                    self._ack(stream)
                    self._wake.set()
                yield message
                continue
            if stream.error is not None:
                raise GrpcError(*stream.error)
            if stream.ended or stream.closed:
                return
            stream.arrived = arrived = anyio.Event()
            await arrived.wait()

    async def _send_message(self, stream: _Stream, data: bytes) -> None:
        framed = _PREFIX.pack(0, len(data)) + data
        conn = self._h2
        if not stream.closed and len(framed) <= min(
            conn.local_flow_control_window(stream.stream_id), conn.max_outbound_frame_size
        ):
            # The usual case: the whole message fits the window and one frame.
            conn.send_data(stream.stream_id, framed)
            self._wake.set()
            return
        payload = memoryview(framed)
        while payload:
            if stream.closed:
                # Reset by the client: this task was cancelled with its call.
                await anyio.lowlevel.checkpoint()
            room = min(
                conn.local_flow_control_window(stream.stream_id),
                conn.max_outbound_frame_size,
                len(payload),
            )
            if room <= 0:
                stream.window = window = anyio.Event()
                self._blocked.add(stream)
                await window.wait()
                continue
            conn.send_data(stream.stream_id, payload[:room].tobytes())
            payload = payload[room:]
            self._wake.set()

    async def _flush(self) -> None:
        out = self._h2.data_to_send()
        if self._extra:
            out, self._extra = out + self._extra, b""
        if out:
            await self._socket.send(out)

    async def _writer(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            await self._flush()
            if self._going_away and not self._streams:
                assert self._group is not None
                self._group.cancel_scope.cancel()
                return


@final
class GrpcServer:
    """Serves gRPC methods over HTTP/2 on one listener; `shutdown` sends GOAWAY and drains."""

    def __init__(self, methods: Mapping[str, Method], max_message: int) -> None:
        self._methods = methods
        self._max = max_message
        self.connections: set[_Connection] = set()
        #: Set when a connection ends (replaced by whoever waits for it).
        self.closed = anyio.Event()

    async def connection(self, socket: anyio.abc.SocketStream) -> None:
        """Serve one accepted connection until it closes."""
        conn = _Connection(socket, self._methods, self._max, self)
        self.connections.add(conn)
        try:
            await conn.run()
        except Exception as exc:
            # A bug met by one connection closes that connection, never the server.
            log.exception("gRPC connection failed", exc_info=exc)

    async def drain(self, period: float) -> None:
        """Send every connection a GOAWAY and wait up to *period* seconds for its calls to end."""
        for conn in list(self.connections):
            conn.goaway()
        with anyio.move_on_after(period):
            while self.connections:
                self.closed = anyio.Event()
                await self.closed.wait()
