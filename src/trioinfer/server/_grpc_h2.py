"""gRPC over HTTP/2 on the serving loop: the `_http2` frame layer on an anyio socket.

No grpcio server, no second thread, no bridge: each connection is a task of
the serving loop (Trio or asyncio) that feeds the bytes it reads to an
`_http2.Connection` and writes what that answers; each RPC runs in a
task of the connection's task group, so a call's cancel scope is the
request's. On Trio a call's task, once it answered, takes the connection's
next call under the same scope (`_Connection._calls`: a task and a scope
per call cost a third of the layer's own work per call); on asyncio each
call is a task of its own (`_AsyncioCalls`). What gRPC adds to HTTP/2 is
handled here:

- framing: each message behind a 5-byte prefix (a compressed flag, a
  big-endian length); a message over the size cap is refused with
  ``RESOURCE_EXHAUSTED`` before its bytes are buffered;
- ``grpc-timeout`` becomes the call's deadline (`GrpcCall.expires`), which
  the service turns into the request's cancel scope deadline;
- a client's RST_STREAM, or the connection's loss, cancels the call's scope,
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
- PING is answered by the frame layer; at shutdown each connection gets a GOAWAY, calls in
  progress may finish, new streams are refused, and those cut off at the end
  are told UNAVAILABLE.

Bounds, so that no client can hold memory or a connection for long (HTTP's
limits, in HTTP/2's terms): a unary call takes one message (a second fails it
at once); a connection holds at most `GrpcServer.max_buffered` request bytes
for its calls, beyond which its data is left unacknowledged; output waiting
for a client that does not read stops the reading past `_OUTPUT_LIMIT`, and
``send_timeout`` drops it; an answer whose window stays shut for
``send_timeout`` ends its call (`_stalled`); a connection without calls for ``head_timeout`` is
closed, a request that stops arriving for ``body_timeout`` fails; the
client's deadline holds over its whole call; a client that resets streams
faster than `_RESET_RATE` a second gets GOAWAY (ENHANCE_YOUR_CALM).

`_http2` does the HTTP/2 (it replaced python-hyper's ``h2``, whose state
machines cost as much per call as the rest of the call); around hpack, only
what repeats is remembered: header blocks made of table indexes only
(`_Decoder`, `_Encoder`), which hpack would decode and encode the same way
call after call.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import re
import socket as stdsocket
import struct
import time
import zlib
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Mapping,
)
from typing import Any, Final, Protocol, final

import anyio
import anyio.abc
import anyio.lowlevel
import attrs
import hpack
import outcome
import sniffio
import trio
import trio.lowlevel
from anyio.streams.tls import TLSAttribute

from . import _http2
from ._http2 import ProtocolError, StreamClosedError
from ._logging import REQUESTS, log_request

log = logging.getLogger("trioinfer.server")

#: gRPC status codes (grpc/doc/statuscodes.md): the transport's and the service's.
OK: Final = 0
CANCELLED: Final = 1
INVALID_ARGUMENT: Final = 3
DEADLINE_EXCEEDED: Final = 4
NOT_FOUND: Final = 5
RESOURCE_EXHAUSTED: Final = 8
UNIMPLEMENTED: Final = 12
INTERNAL: Final = 13
UNAVAILABLE: Final = 14
UNAUTHENTICATED: Final = 16

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
_TIMEOUT_UNITS: Final = {
    ord("H"): 3600.0,
    ord("M"): 60.0,
    ord("S"): 1.0,
    ord("m"): 1e-3,
    ord("u"): 1e-6,
    ord("n"): 1e-9,
}
#: gRPC's TimeoutValue and TimeoutUnit, ASCII only (str.isdigit would take '\u00b2').
_TIMEOUT: Final = re.compile(rb"[0-9]{1,8}[HMSmun]")
#: Output waiting for a client that does not read, beyond which the connection reads no
#: more of its frames (each of which may add output: PING, SETTINGS acks) until it drains.
_OUTPUT_LIMIT: Final = 256 * 1024
#: How long the last words (a call's UNAVAILABLE, the final GOAWAY) may take to leave.
_LAST_WORDS_S: Final = 0.5
#: After the last words, how long (and how many bytes) to read and drop what the client
#: still sends until it closes too: a close with unread input is a reset, which destroys
#: what the client has not read yet (as the HTTP/1.1 server's lingering close).
_LINGER_S: Final = 2.0
_LINGER_BYTES: Final = 1024 * 1024
#: RST_STREAMs a client may send per second, on average over 10 s, before a GOAWAY
#: (ENHANCE_YOUR_CALM): each starts a call's work for nothing (CVE-2023-44487).
_RESET_RATE: Final = 100
_RESET_WINDOW_S: Final = 10.0
_ANSWER_HEADERS: Final = (
    (b":status", b"200"),
    (b"content-type", b"application/grpc"),
    (b"grpc-accept-encoding", _ACCEPT),
)
#: The trailers of a call that succeeded, the same for every call.
_OK_TRAILERS: Final = ((b"grpc-status", b"0"),)
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
#: Header-block bytes that are each a complete one-byte indexed field (RFC 7541 6.1:
#: indexes 1-126); a block made only of them neither reads nor changes the dynamic table
#: beyond looking entries up.
_INDEXED: Final = bytes(range(0x81, 0xFF))
#: Header blocks remembered per connection and direction, before the memo starts over.
_MEMO_SIZE: Final = 64
#: A unary answer of at least this many bytes is written by its call's task as soon as it is
#: made (on Trio, when nothing else is being written), not left for the connection's writer.
#: The writer's one send for many answers saves syscalls, which matters for small answers;
#: but a thread waiting for the GIL (the engine's compute thread, handed its next batch
#: just before that batch's answers are made) gets it only when the loop makes a syscall
#: that takes a while, and the loop makes none while it builds the answers: with a 4 KB
#: answer per call the compute thread waited 0.8-1.1 ms per batch for the GIL behind them,
#: against 0.12-0.15 ms behind HTTP's answers (a send each). Large answers are few per
#: batch of work and each write's fixed cost is small next to its bytes.
_WRITE_AT_ONCE: Final = 2048
#: Call tasks a connection keeps waiting for its next calls, on Trio (`_Connection._calls`).
_IDLE_CALLS: Final = 128
#: A call's end when its handler answered: (status, message, whether the answer was large).
_ANSWERED: Final = (OK, "", False)
_ANSWERED_LARGE: Final = (OK, "", True)
#: The most buffers given to one ``sendmsg`` (Linux's IOV_MAX is 1024); more are joined.
_MAX_BUFFERS: Final = 64


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
    marked never-indexed, so the key is the list or tuple of (name, value) pairs
    (the answer's headers and a success's trailers are constant tuples, used as they are).
    """

    def __init__(self) -> None:
        super().__init__()
        self._memo: dict[tuple[Any, ...], bytes] = {}

    def encode(self, headers: Any, huffman: bool = True) -> bytes:
        """Encode *headers* as hpack does, from memory when the table cannot have changed."""
        key: tuple[Any, ...] | None = None
        if huffman:
            if type(headers) is tuple:
                key = headers
            elif isinstance(headers, list):
                key = tuple(headers)
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


def _native() -> tuple[Callable[[], Any], Callable[[], Any], _AsyncioCalls | None]:
    # On Trio its nursery and cancel scope: a good deal cheaper than anyio's wrappers
    # over them, and this runs once per call (a task and a scope each). On asyncio
    # the calls are plain tasks (`_AsyncioCalls`).
    if sniffio.current_async_library() == "trio":
        return trio.open_nursery, trio.CancelScope, None
    return anyio.create_task_group, anyio.CancelScope, _AsyncioCalls()


@final
class _AsyncioCalls:
    """A connection's call tasks on asyncio: plain tasks, cancelled and awaited at its end.

    anyio's task group spawns a task in about 15 µs on asyncio, asyncio's own
    in about 4, and a call is a task. Each call cancels its own scope when its
    client leaves (`GrpcCall.cancel`); `aclose` ends what is left when the
    connection does, as leaving a task group would.
    """

    __slots__ = ("_tasks",)

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def start_soon(
        self, fn: Callable[..., Coroutine[Any, Any, None]], *args: Any, name: str
    ) -> None:
        """Run ``fn(*args)`` in a task of its own."""
        task = asyncio.get_running_loop().create_task(fn(*args), name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # What a task group would have raised: a bug, logged, the connection goes on.
            log.error("gRPC call task failed", exc_info=task.exception())

    async def aclose(self) -> None:
        """Wait for the calls still running, their scopes cancelled already, as a task group would.

        Briefly: a call that has not ended after `_LAST_WORDS_S` is cancelled
        outright (asyncio's own cancellation) and not waited for.
        """
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=_LAST_WORDS_S)
        for task in list(self._tasks):
            task.cancel()


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
        """The client left: cancel the call's scope (and the request it runs)."""
        self.gone = True
        if self._scope is not None:
            self._scope.cancel()


#: A unary handler: the request message in, the answer message out.
Unary = Callable[[bytes, GrpcCall], Awaitable[bytes]]


class Send(Protocol):
    """A streaming call's send: its answer messages, in order."""

    async def __call__(self, *messages: bytes) -> None:
        """Queue *messages* for the client, waiting only for its flow-control window.

        Messages given together go in one DATA frame when they fit the client's
        window and frame size (gRPC's messages are a byte stream inside DATA
        frames): a run of small answers costs one frame, not one each.
        """


#: A bidirectional-streaming handler: the request messages, the call, a send function.
Streaming = Callable[[AsyncIterator[bytes], GrpcCall, Send], Awaitable[None]]


@final
@attrs.define(frozen=True)
class Method:
    """A served method: its handler, unary or bidirectional streaming.

    *logged*: the request message's top-level string fields (by field number)
    that the request log names (``model``, ``version``, ``request_id``), for a
    unary call.
    """

    handler: Unary | Streaming
    streaming: bool
    logged: Mapping[int, str] = attrs.field(factory=dict)


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
    #: True once its answer's headers are sent (trailers then end it).
    answering: bool = False
    #: Bytes of its messages (and part of one) held for its handler: the connection's budget.
    held: int = 0
    #: ``time.monotonic()`` when its request bytes last arrived (for ``body_timeout``).
    active: float = 0.0
    #: ``time.monotonic()`` when its headers arrived (for the request log).
    opened: float = 0.0
    #: Whether the request log was on when its headers arrived: the call that switches
    #: it (``LogSettings``) is logged as it was before, as an HTTP request is.
    logged: bool = False


def _wake(event: anyio.Event | None) -> None:
    if event is not None:
        event.set()


#: The most bytes of grpc-message sent. grpcio refuses trailers past 16 KiB (8 KiB by
#: default elsewhere), and then its caller sees a transport error instead of the status: a
#: message that quotes a long name from the request is cut to fit.
MAX_MESSAGE_BYTES: Final = 4096
_CUT: Final = b"... (cut)"


def _percent(message: str) -> bytes:
    encoded = _escaped(message)
    if len(encoded) <= MAX_MESSAGE_BYTES:
        return encoded
    # Whole characters only, so that the client decodes what it gets.
    out, room = bytearray(), MAX_MESSAGE_BYTES - len(_CUT)
    for char in message:
        piece = _escaped(char)
        if len(out) + len(piece) > room:
            break
        out += piece
    return bytes(out) + _CUT


def _escaped(text: str) -> bytes:
    # grpc-message is percent-encoded UTF-8 outside printable ASCII (and '%').
    return b"".join(
        bytes((b,)) if 0x20 <= b <= 0x7E and b != 0x25 else b"%%%02X" % b
        for b in text.encode("utf-8")
    )


def _check(ok: bool, code: int, message: Callable[[], str]) -> None:
    if not ok:
        raise GrpcError(code, message())


def _unsupported(encoding: str) -> str:
    return (
        f"grpc-encoding {encoding[:32]!r} is not supported; this server takes {', '.join(_WBITS)}"
    )


def _deadline(value: bytes) -> float:
    _check(
        _TIMEOUT.fullmatch(value) is not None,
        INVALID_ARGUMENT,
        lambda: (
            f"grpc-timeout {value[:32].decode('latin-1')!r} is not 1-8 ASCII digits and a "
            "unit (H, M, S, m, u, n)"
        ),
    )
    return time.monotonic() + int(value[:-1]) * _TIMEOUT_UNITS[value[-1]]


@final
class _Connection:
    """One client connection: reads frames, runs each call in a task, writes the answers."""

    def __init__(
        self,
        socket: anyio.abc.ByteStream,
        methods: Mapping[str, Method],
        max_message: int,
        server: GrpcServer,
    ) -> None:
        self._socket = socket
        self._methods = methods
        self._max = max_message
        self._server = server
        #: Request bytes held for handlers, over all streams (`_Stream.held`).
        self._held = 0
        #: Streams whose received bytes are left unacknowledged (over the budget or backlog).
        self._held_back: set[_Stream] = set()
        self._idle_since = time.monotonic()
        self._resets: collections.deque[float] = collections.deque()
        #: Set each time the writer has sent what was pending.
        self._drained = anyio.Event()
        self._sending = False
        # hpack's coder, with a memo of the header blocks that repeat.
        self._h2 = _http2.Connection(
            initial_window=_WINDOW,
            max_streams=_MAX_STREAMS,
            decoder=_Decoder(),
            encoder=_Encoder(),
        )
        self._streams: dict[int, _Stream] = {}
        #: Calls waiting for the client's flow-control window to open.
        self._blocked: set[_Stream] = set()
        self._wake = anyio.Event()
        self._going_away = False
        #: Its last frames sent, it reads and drops what the client still sends (`_linger`).
        self.lingering = False
        self._last_stream = 0
        #: What repeated request headers (a client's, call after call) were read as:
        #: the method, the encoding's wbits, the metadata; only calls without a deadline.
        self._parsed: dict[tuple[Any, ...], tuple[Method, int | None, dict[str, str]]] = {}
        self._extra = b""
        #: On Trio, the call tasks waiting for a call to answer (`_next_call`).
        self._idle: list[trio.lowlevel.Task] = []
        #: The connection's task group: Trio's nursery on Trio, anyio's on asyncio.
        self._group: Any = None
        self._open_group, self._cancel_scope, self._asyncio_calls = _native()
        #: The socket itself, for `_write_now`: on Trio only, where nothing of what the
        #: writer sent is still buffered once its send returned (asyncio's transport may
        #: hold some back, which a write beside it would overtake).
        #: Never under TLS, whose bytes must go through the stream's record layer.
        self._raw: stdsocket.socket | None = (
            socket.extra(anyio.abc.SocketAttribute.raw_socket, None)
            if self._asyncio_calls is None and socket.extra(TLSAttribute.tls_version, None) is None
            else None
        )

    async def run(self) -> None:
        """Serve the connection until the client closes it, or `goaway` lets it end."""
        conn = self._h2
        conn.initiate_connection()
        conn.increment_flow_control_window(_WINDOW * 16)
        if self._server.draining:
            self.goaway()
        try:
            async with self._open_group() as group:
                self._group = group
                group.start_soon(self._writer)
                group.start_soon(self._watchdog)
                try:
                    await self._reader()
                finally:
                    # The client went away (or the server stops): every call still
                    # running is cancelled, in the engine too.
                    for stream in list(self._streams.values()):
                        stream.call.cancel()
                    group.cancel_scope.cancel()
        except* (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream, OSError):
            # The client went away (TimeoutError, an OSError: it read nothing for
            # send_timeout): an ordinary end, not the server's failure.
            pass
        finally:
            try:
                with anyio.CancelScope(shield=True):
                    if self._asyncio_calls is not None:
                        await self._asyncio_calls.aclose()
                    await self._last_words()
                if not self._sending:  # (cut short: a partial frame, nothing to wait for)
                    # Not shielded, and the connection still counted as open: a drain
                    # waits for it within its period, and the period's end cuts it
                    # short, so a client that never closes cannot hold the shutdown.
                    await self._linger()
            finally:
                self._server.connections.discard(self)
                self._server.closed.set()
                with anyio.CancelScope(shield=True):
                    await self._socket.aclose()

    async def _last_words(self) -> None:
        # What the cancelled calls answered (UNAVAILABLE at the end of a drain) and a
        # final GOAWAY, sent briefly: never after a send cut short (its frame is partial).
        if self._sending:
            return
        with contextlib.suppress(Exception), anyio.move_on_after(_LAST_WORDS_S):
            if not self._h2.closed:
                self._h2.close_connection(last_stream_id=self._last_stream)
            await self._flush()

    async def _linger(self) -> None:
        # The server ends this connection (a drain, a GOAWAY of ours) while the client
        # may still be reading the last answers and sending as it reads (grpcio's
        # WINDOW_UPDATEs and PINGs). Closing with its bytes unread makes the kernel
        # reset the connection and drop what it had not delivered yet: the end of an
        # answer sent within the drain, which the client then never got (a flake
        # under load). So this side ends with a FIN after the last bytes, and what
        # the client still sends is read and dropped until it closes too (at once
        # when it had closed first), for at most _LINGER_S and _LINGER_BYTES.
        self.lingering = True
        with contextlib.suppress(Exception), anyio.move_on_after(_LINGER_S):
            # A TLS stream cannot half-close (NotImplementedError): the client,
            # told by the GOAWAY, closes first, and until then its bytes are read.
            with contextlib.suppress(NotImplementedError):
                await self._socket.send_eof()
            total = 0
            while total < _LINGER_BYTES:
                total += len(await self._socket.receive(65536))

    def goaway(self) -> None:
        """At shutdown: tell the client to open no more streams; those open may finish."""
        if not self._going_away:
            self._going_away = True
            self._h2.goaway(self._last_stream)
            self._extra += self._h2.data_to_send()
            self._wake.set()

    async def _reader(self) -> None:
        while True:
            try:
                data = await self._socket.receive(65536)
            except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                return
            try:
                events = self._h2.receive_data(data)
            except ProtocolError as exc:
                log.info("gRPC connection closed: HTTP/2 protocol error: %s", exc)
                self._h2.close_connection(exc.error_code)
                await self._flush()
                return
            for event in events:
                if self._h2.closed:
                    break  # closed by a GOAWAY of ours (ENHANCE_YOUR_CALM): the rest is moot
                try:
                    self._event(event)
                except Exception as exc:  # a bug: its stream fails, never the connection
                    self._failed(event, exc)
            # What those frames answered (PING and SETTINGS acks, resets) is counted
            # with the rest waiting to be written: past the limit the client's frames are
            # left unread until it reads, so TCP holds a client that sends without
            # reading. Counted where it is queued, not taken out (and so joined, then
            # joined again by the writer, with the answers queued beside it).
            self._wake.set()
            while len(self._extra) + self._h2.bytes_to_send() > _OUTPUT_LIMIT:
                drained = self._drained
                await drained.wait()

    def _failed(self, event: Any, exc: Exception) -> None:
        log.exception("gRPC stream failed", exc_info=exc)
        stream_id = getattr(event, "stream_id", None)
        if stream_id is None:
            raise exc
        stream = self._streams.pop(stream_id, None)
        if stream is not None:
            stream.closed = True
            stream.call.cancel()
            self._forget(stream)
        self._trailers_only(stream_id, INTERNAL, f"internal error: {type(exc).__name__}")
        self._stop(stream_id)

    def _stop(self, stream_id: int) -> None:
        # Answered before the client finished sending: it may stop (RFC 9113 8.1).
        with contextlib.suppress(ProtocolError):
            if self._h2.is_open(stream_id):
                self._h2.reset_stream(stream_id, _http2.NO_ERROR)

    def _event(self, event: Any) -> None:
        # By the event's exact class (the frame layer's events are final), the most
        # frequent first: a call brings DATA, its headers, its end and two WINDOW_UPDATEs.
        kind = type(event)
        if kind is _http2.DataReceived:
            stream = self._streams.get(event.stream_id)
            if stream is None:
                self._h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                return
            self._data(stream, event.data, event.flow_controlled_length)
        elif kind is _http2.WindowUpdated or kind is _http2.RemoteSettingsChanged:
            # Maybe more room to send: the calls waiting for it look again.
            if self._blocked:
                for stream in self._blocked:
                    _wake(stream.window)
                self._blocked.clear()
        elif kind is _http2.RequestReceived:
            self._request(event.stream_id, event.headers)
        elif kind is _http2.StreamEnded:
            stream = self._streams.get(event.stream_id)
            if stream is not None:
                stream.ended = True
                if stream.buffer and stream.error is None:
                    stream.error = (INTERNAL, "the request ended inside a message")
                self._ready(stream)
        elif kind is _http2.StreamReset:
            stream = self._streams.pop(event.stream_id, None)
            if stream is not None:
                stream.closed = True
                stream.call.cancel()
                self._forget(stream)
                _wake(stream.window)
                _wake(stream.arrived)
            # The client's RST_STREAM, or a reset its frames forced (a stream error):
            # either way a call's work started for nothing (CVE-2023-44487, CVE-2025-8671).
            self._reset_counted()
        elif kind is _http2.ConnectionTerminated:
            self._going_away = True

    def _reset_counted(self) -> None:
        now = time.monotonic()
        resets = self._resets
        resets.append(now)
        while resets[0] < now - _RESET_WINDOW_S:
            resets.popleft()
        if len(resets) > _RESET_RATE * _RESET_WINDOW_S and not self._going_away:
            log.info("gRPC connection closed: the client reset too many streams")
            self._going_away = True
            for stream in list(self._streams.values()):
                stream.call.cancel()
            self._h2.close_connection(
                _http2.ENHANCE_YOUR_CALM,
                additional_data=b"too many RST_STREAM",
                last_stream_id=self._last_stream,
            )
            self._streams.clear()

    def _request(self, stream_id: int, raw_headers: list[tuple[bytes, bytes]]) -> None:
        self._last_stream = max(self._last_stream, stream_id)
        if self._going_away:
            self._h2.reset_stream(stream_id, _http2.REFUSED_STREAM)
            return
        key = tuple(raw_headers)
        parsed = self._parsed.get(key)
        if parsed is not None:
            self._open(stream_id, parsed[0], GrpcCall(dict(parsed[2]), None), parsed[1])
            return
        # Compared as bytes (hpack hands them so); only what is kept is decoded.
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
            expires = _deadline(timeout) if timeout is not None else None
        except GrpcError as exc:
            self._trailers_only(stream_id, exc.code, exc.message)
            return
        metadata = {
            key.decode("latin-1"): value.decode("latin-1")
            for key, value in headers.items()
            if not key.startswith(b":") and key not in _RESERVED and not key.endswith(b"-bin")
        }
        assert method is not None
        if timeout is None:
            if len(self._parsed) >= _MEMO_SIZE:
                self._parsed.clear()
            self._parsed[key] = (method, _WBITS[encoding], metadata)
            metadata = dict(metadata)
        self._open(stream_id, method, GrpcCall(metadata, expires), _WBITS[encoding])

    def _open(self, stream_id: int, method: Method, call: GrpcCall, wbits: int | None) -> None:
        stream = _Stream(stream_id, method, call, wbits)
        stream.active = stream.opened = self._idle_since = time.monotonic()
        stream.logged = REQUESTS.on
        self._streams[stream_id] = stream
        if method.streaming:
            self._start(stream)

    def _data(self, stream: _Stream, data: bytes, flow: int) -> None:
        stream.unacked += flow
        stream.active = time.monotonic()
        if stream.error is None:
            self._split(stream, data)
        if stream.error is not None:
            # The call is answered at once; whatever else arrives is dropped.
            self._ack(stream)
            self._ready(stream)
            return
        self._account(stream)
        if self._may_ack(stream):
            self._ack(stream)
        else:
            self._held_back.add(stream)
        if stream.method.streaming:
            _wake(stream.arrived)

    def _may_ack(self, stream: _Stream) -> bool:
        # A stream's bytes are let in until its handler falls behind by more than the
        # backlog (a unary call has one message), and while the connection holds
        # under its budget of request bytes; past either, the client's window holds
        # it. The oldest stream still inside a message may always go on, so that
        # calls sent side by side each get their whole request.
        if stream.method.streaming and len(stream.messages) > _STREAM_BACKLOG:
            return False
        if self._held <= self._server.max_buffered:
            return True
        receiving = [s.stream_id for s in self._streams.values() if s.buffer]
        return bool(stream.buffer) and stream.stream_id == min(receiving)

    def _account(self, stream: _Stream) -> None:
        held = len(stream.buffer) + sum(map(len, stream.messages))
        self._held += held - stream.held
        stream.held = held

    def _forget(self, stream: _Stream) -> None:
        # The stream is done with: its bytes leave the budget, others may come in.
        stream.messages.clear()
        stream.buffer.clear()
        self._held -= stream.held
        stream.held = 0
        self._held_back.discard(stream)
        self._ack(stream)  # bytes never handed to a handler still free the connection's window
        self._wake.set()
        self._release()

    def _release(self) -> None:
        if not self._held_back:
            return  # the usual case, at the end of every call: nothing to sort
        for stream in sorted(self._held_back, key=lambda s: s.stream_id):
            if stream.closed or stream.stream_id not in self._streams:
                self._held_back.discard(stream)
            elif self._may_ack(stream):
                self._held_back.discard(stream)
                self._ack(stream)
                self._wake.set()

    def _split(self, stream: _Stream, data: bytes) -> None:
        # The messages are cut from the DATA payload as it is when the stream holds no
        # unfinished message (the usual case: a message, or several, per frame); only
        # what is left of an unfinished one is kept in the stream's buffer.
        buffer = stream.buffer
        if buffer:
            buffer += data
            pos = self._cut(stream, buffer)
            if stream.error is not None:
                buffer.clear()
            else:
                del buffer[:pos]
        else:
            pos = self._cut(stream, data)
            if stream.error is None and pos < len(data):
                buffer += memoryview(data)[pos:]

    def _cut(self, stream: _Stream, source: bytes | bytearray) -> int:
        # Whole messages of *source* onto the stream's list; where the rest starts.
        pos, end = 0, len(source)
        length: int
        while end - pos >= 5:
            compressed, length = _PREFIX.unpack_from(source, pos)
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
                return pos
            if end - pos - 5 < length:
                return pos
            message = bytes(source[pos + 5 : pos + 5 + length])
            pos += 5 + length
            if compressed:
                try:
                    message = self._inflate(message, stream.wbits)
                except GrpcError as exc:
                    stream.error = (exc.code, exc.message)
                    return pos
            if stream.messages and not stream.method.streaming:
                # As gRPC specifies for a cardinality violation (statuscodes.md).
                stream.error = (
                    UNIMPLEMENTED,
                    "a unary call takes one request message; this one sent a second",
                )
                return pos
            stream.messages.append(message)
        return pos

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
        if count and not self._h2.closed:
            # The connection's window always; the stream's only while it is open.
            self._h2.acknowledge_received_data(count, stream.stream_id)

    def _ready(self, stream: _Stream) -> None:
        if stream.error is not None and not stream.started:
            self._streams.pop(stream.stream_id, None)
            self._forget(stream)
            self._trailers_only(stream.stream_id, *stream.error)
            if not stream.ended:
                self._stop(stream.stream_id)
            return
        if stream.method.streaming:
            _wake(stream.arrived)
        elif stream.ended:
            self._start(stream)

    def _start(self, stream: _Stream) -> None:
        stream.started = True
        if self._asyncio_calls is not None:
            self._asyncio_calls.start_soon(self._call, stream, name="grpc call")
        elif self._idle:
            # A task that answered a call before takes this one (the most recent first).
            trio.lowlevel.reschedule(self._idle.pop(), outcome.Value(stream))
        else:
            assert self._group is not None
            self._group.start_soon(self._calls, stream, name="grpc call")

    async def _call(self, stream: _Stream) -> None:
        # On asyncio: a task per call, in a scope of its own.
        if stream.closed:
            # Reset before its task ran (a rapid reset): its request is not even parsed.
            self._forget(stream)
            return
        answered = None
        try:
            with self._cancel_scope() as scope:
                answered = await self._one(stream, scope)
            self._conclude(stream, answered, scope.cancelled_caught)
        except BaseException:
            self._cut_off(stream)
            raise

    async def _calls(self, first: _Stream) -> None:
        """On Trio: answer *first*, then the connection's next calls, one after another.

        A task and a cancel scope per call cost a third of the layer's own work
        per call (``benchmarks/bench_grpc_layer.py``: 23 against 15 µs of CPU);
        so a call's task, once it answered, waits for the next call
        (`_next_call`) instead of ending, and answers it under the same scope,
        its deadline set from that call's ``grpc-timeout`` and cleared after.
        A cancelled scope cannot be used again: after a call that was cancelled
        (its client left, its deadline passed), the task takes a fresh one.
        At most `_IDLE_CALLS` tasks wait; the rest end, and those waiting end
        with the connection (its nursery is cancelled).
        """
        stream: _Stream | None = first
        try:
            while stream is not None:
                with trio.CancelScope() as scope:
                    while stream is not None:
                        if stream.closed:
                            # Reset before this task took it (a rapid reset).
                            self._forget(stream)
                        else:
                            answered = await self._one(stream, scope)
                            stream.call._scope = None
                            self._conclude(stream, answered, False)
                            if scope.cancel_called:
                                break  # cancelled as it finished: the scope is spent
                        stream = None
                        stream = await self._next_call()
                if scope.cancelled_caught:
                    assert stream is not None
                    stream.call._scope = None
                    self._conclude(stream, None, True)
                stream = None
                stream = await self._next_call()
        except BaseException:
            if stream is not None:
                self._cut_off(stream)
            raise

    async def _next_call(self) -> _Stream | None:
        # The next call `_start` hands this task, or None when enough tasks wait already.
        if len(self._idle) >= _IDLE_CALLS:
            return None
        task = trio.lowlevel.current_task()
        self._idle.append(task)

        def abort(_: Any) -> trio.lowlevel.Abort:
            # Cancelled while waiting: the connection ends.
            self._idle.remove(task)
            return trio.lowlevel.Abort.SUCCEEDED

        stream: _Stream = await trio.lowlevel.wait_task_rescheduled(abort)
        return stream

    def _cut_off(self, stream: _Stream) -> None:
        # Cancelled from outside (the server stops at the end of its drain, the
        # connection is lost): what can still be told is told, if anyone is left.
        self._streams.pop(stream.stream_id, None)
        self._forget(stream)
        if not stream.closed:
            self._finish(
                stream, UNAVAILABLE, "the server stopped before the call finished", stream.answering
            )

    async def _one(self, stream: _Stream, scope: Any) -> tuple[int, str, bool] | None:
        """Run *stream*'s handler under *scope* and send its answer.

        Returns the status to end the call with (code, message, whether the answer
        was large), or None when the stream closed under the answer. A cancelled
        call raises its scope's ``Cancelled``, which its caller's scope catches.
        """
        call = stream.call
        call._scope = scope
        answered: tuple[int, str, bool] | None
        if call.gone:
            # Its client left before this task took it (on asyncio nothing else
            # cancels a task that had not started).
            scope.cancel()
        expires = call.expires
        if expires is not None:
            # The client's deadline holds over the whole call: its handler, and
            # waiting for the client's window or its next message.
            scope.deadline = anyio.current_time() + (expires - time.monotonic())
        try:
            handler: Any = stream.method.handler
            if stream.method.streaming:

                async def send(*messages: bytes) -> None:
                    if not stream.answering:
                        self._headers(stream)
                        stream.answering = True
                    await self._send_message(stream, *messages)

                # Closed here, even when the handler is cancelled while it waits in it.
                async with contextlib.aclosing(self._messages(stream)) as messages:
                    await handler(messages, call, send)
                answered = _ANSWERED
            else:
                _check(
                    len(stream.messages) == 1,
                    UNIMPLEMENTED if stream.messages else INTERNAL,
                    lambda: (
                        "a unary call takes one request message, this one sent "
                        f"{len(stream.messages)}"
                    ),
                )
                answer = await handler(stream.messages[0], call)
                self._headers(stream)
                stream.answering = True
                await self._send_message(stream, answer)
                answered = _ANSWERED_LARGE if len(answer) >= _WRITE_AT_ONCE else _ANSWERED
        except GrpcError as exc:
            answered = (exc.code, exc.message, False)
        except ProtocolError:
            # The stream or connection closed under the answer (a reset, the
            # client's GOAWAY): nobody is left to tell.
            answered = None
        except Exception as exc:  # a bug: this call fails, never its connection
            log.exception("gRPC call failed", exc_info=exc)
            answered = (INTERNAL, f"internal error: {type(exc).__name__}", False)
        if expires is not None:
            scope.deadline = math.inf
        return answered

    def _conclude(
        self, stream: _Stream, answered: tuple[int, str, bool] | None, cancelled: bool
    ) -> None:
        # The call's end: its trailers (or its status, when it was cancelled).
        if stream.logged:  # the request log: the one test when off
            self._log_call(stream, answered, cancelled)
        if answered is None and not cancelled:
            self._streams.pop(stream.stream_id, None)
            return
        code, message, large = answered or _ANSWERED
        self._streams.pop(stream.stream_id, None)
        self._forget(stream)
        if cancelled or stream.closed:
            if stream.closed:
                return
            if stream.call.expires is not None and time.monotonic() >= stream.call.expires:
                code, message = (
                    DEADLINE_EXCEEDED,
                    "the client's deadline passed before the call finished",
                )
            else:
                # Cancelled from outside while its stream is open: the server stops.
                code, message = UNAVAILABLE, "the server stopped before the call finished"
        self._finish(stream, code, message, stream.answering)
        if not stream.ended:
            self._stop(stream.stream_id)
        if large:
            self._write_now()

    def _log_call(
        self, stream: _Stream, answered: tuple[int, str, bool] | None, cancelled: bool
    ) -> None:
        # The status `_conclude` ends the call with; CANCELLED where the client left.
        if stream.closed or (answered is None and not cancelled):
            code = CANCELLED
        elif cancelled:
            expires = stream.call.expires
            code = (
                DEADLINE_EXCEEDED
                if expires is not None and time.monotonic() >= expires
                else UNAVAILABLE
            )
        else:
            code = (answered or _ANSWERED)[0]
        fields: dict[str, str] = {}
        size = None
        if not stream.method.streaming and stream.messages:
            size = len(stream.messages[0])
            if stream.method.logged:
                fields = _string_fields(stream.messages[0], stream.method.logged)
        peer = self._socket.extra(anyio.abc.SocketAttribute.remote_address, None)
        log_request(
            "grpc",
            self._server.paths[id(stream.method)],
            code,
            stream.opened,
            model=fields.get("model"),
            version=fields.get("version"),
            request_id=fields.get("request_id"),
            peer=f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else None,
            bytes_in=size,
            protocol="grpc",
        )

    def _write_now(self) -> None:
        # What is queued, written from this task without waiting (see _WRITE_AT_ONCE);
        # only when the writer is not sending and holds nothing back, so that the
        # bytes stay in order. What the socket does not take is left to the writer
        # (woken by _finish), ahead of anything queued after it; so is an error.
        raw = self._raw
        if raw is None or self._sending or self._extra:
            return
        buffers = self._h2.buffers_to_send()
        if not buffers:
            return
        try:
            if len(buffers) <= _MAX_BUFFERS:
                sent = raw.sendmsg(buffers)
            else:
                buffers = [b"".join(buffers)]
                sent = raw.send(buffers[0])
        except OSError:  # full (BlockingIOError), or broken: the writer meets it again
            sent = 0
        if sent < sum(map(len, buffers)):
            self._extra = b"".join(buffers)[sent:]
            self._wake.set()

    def _finish(self, stream: _Stream, code: int, message: str, sent_headers: bool) -> None:
        trailers: tuple[tuple[bytes, bytes], ...] = _OK_TRAILERS
        if code != OK or message:
            trailers = ((b"grpc-status", b"%d" % code),)
            if message:
                trailers += ((b"grpc-message", _percent(message)),)
        try:
            if sent_headers:
                self._h2.send_headers(stream.stream_id, trailers, end_stream=True)
            else:
                self._trailers_only(stream.stream_id, code, message)
                return
        except (StreamClosedError, ProtocolError):
            return
        self._wake.set()

    def _headers(self, stream: _Stream) -> None:
        self._h2.send_headers(stream.stream_id, _ANSWER_HEADERS)

    def _trailers_only(self, stream_id: int, code: int, message: str) -> None:
        headers = [*_ANSWER_HEADERS, (b"grpc-status", b"%d" % code)]
        if message:
            headers.append((b"grpc-message", _percent(message)))
        try:
            self._h2.send_headers(stream_id, headers, end_stream=True)
        except (StreamClosedError, ProtocolError):
            return
        self._wake.set()

    async def _messages(self, stream: _Stream) -> AsyncGenerator[bytes, None]:
        while True:
            if stream.messages:
                message = stream.messages.popleft()
                self._account(stream)
                if self._held_back:
                    # Caught up, or under budget again: the bytes held back may come.
                    self._release()
                yield message
                continue
            if stream.error is not None:
                raise GrpcError(*stream.error)
            if stream.ended or stream.closed:
                return
            stream.arrived = arrived = anyio.Event()
            await arrived.wait()

    async def _send_message(self, stream: _Stream, *messages: bytes) -> None:
        # One message or several (`Send`), each behind its prefix, as one byte stream.
        if len(messages) == 1:
            data = messages[0]
            prefix = _PREFIX.pack(0, len(data))
        else:
            pack = _PREFIX.pack
            data = b"".join([piece for m in messages for piece in (pack(0, len(m)), m)])
            prefix = b""
        conn = self._h2
        if not stream.closed and len(prefix) + len(data) <= min(
            conn.local_flow_control_window(stream.stream_id), conn.max_outbound_frame_size
        ):
            # The usual case: the whole of it fits the window and one frame, which
            # takes it as it is (no copy behind its prefix).
            conn.send_data(stream.stream_id, data, prefix=prefix)
            self._wake.set()
            return
        payload = memoryview(prefix + data)
        # When the client must have opened its window by: one that reads none of the
        # answer for send_timeout ends its call, as an HTTP client is dropped (its
        # window held the call for ever; a stream's, with its request's timeout held
        # off while a message is written, `send_whole`).
        stalled = math.inf
        while payload:
            if stream.closed:
                # Reset by the client (or stalled): this task was cancelled with its call.
                await anyio.lowlevel.checkpoint()
            room = min(
                conn.local_flow_control_window(stream.stream_id),
                conn.max_outbound_frame_size,
                len(payload),
            )
            if room <= 0:
                if stalled == math.inf:
                    stalled = anyio.current_time() + self._server.send_timeout
                stream.window = window = anyio.Event()
                self._blocked.add(stream)
                with anyio.move_on_at(stalled):
                    await window.wait()
                    continue
                self._stalled(stream)
                continue
            stalled = math.inf
            conn.send_data(stream.stream_id, payload[:room].tobytes())
            payload = payload[room:]
            self._wake.set()

    def _stalled(self, stream: _Stream) -> None:
        # Its client read none of its answer for send_timeout: the call ends, told why
        # (trailers take no window), its stream reset, its handler cancelled.
        log.info(
            "gRPC call ended: the client read none of its answer for %ss (send_timeout)",
            self._server.send_timeout,
        )
        self._streams.pop(stream.stream_id, None)
        self._finish(
            stream,
            CANCELLED,
            f"the client read none of the answer for {self._server.send_timeout}s (send_timeout)",
            stream.answering,
        )
        self._stop(stream.stream_id)
        stream.closed = True
        stream.call.cancel()
        self._forget(stream)

    async def _flush(self) -> None:
        out = self._h2.data_to_send()
        if self._extra:
            out, self._extra = self._extra + out, b""
        if out:
            self._sending = True
            # A client that reads nothing for send_timeout is dropped (TimeoutError).
            with self._cancel_scope() as scope:
                scope.deadline = anyio.current_time() + self._server.send_timeout
                await self._socket.send(out)
            if scope.cancelled_caught:
                raise TimeoutError
            self._sending = False
        self._drained.set()
        self._drained = anyio.Event()

    async def _writer(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake = anyio.Event()
                await self._flush()
                if self._going_away and not self._streams:
                    assert self._group is not None
                    self._group.cancel_scope.cancel()
                    return
        except TimeoutError:
            log.info(
                "gRPC connection closed: the client read nothing for %ss (send_timeout)",
                self._server.send_timeout,
            )
            raise

    async def _watchdog(self) -> None:
        # Time limits no frame brings: a connection with no calls (head_timeout), a
        # request body that stopped arriving (body_timeout), a client's deadline passing
        # while its request still arrives (the call's own scope covers it after).
        server = self._server
        tick = min(server.head_timeout, server.body_timeout) / 4
        while True:
            await anyio.sleep(tick)
            now = time.monotonic()
            if self._streams:
                self._idle_since = now
            elif now - self._idle_since > server.head_timeout:
                log.info(
                    "gRPC connection closed: no call for %ss (head_timeout)", server.head_timeout
                )
                self.goaway()
                continue
            for stream in list(self._streams.values()):
                if stream.started:
                    continue
                expires = stream.call.expires
                if expires is not None and now >= expires:
                    error = (DEADLINE_EXCEEDED, "the client's deadline passed before its request")
                elif now - stream.active > server.body_timeout:
                    error = (
                        CANCELLED,
                        f"the request stopped arriving for {server.body_timeout}s (body_timeout)",
                    )
                else:
                    continue
                stream.error = error
                self._ready(stream)
                self._wake.set()


def _string_fields(message: bytes, wanted: Mapping[int, str]) -> dict[str, str]:
    """The top-level string fields *wanted* (number: name) of protobuf *message*, by name.

    Read off the wire without parsing the message (its tensors are skipped,
    not copied); a malformed message gives what was read before the fault.
    """
    found: dict[str, str] = {}
    pos, end = 0, len(message)
    try:
        while pos < end and len(found) < len(wanted):
            tag, pos = _read_varint(message, pos)
            number, kind = tag >> 3, tag & 7
            if kind == 0:
                _, pos = _read_varint(message, pos)
            elif kind == 1:
                pos += 8
            elif kind == 5:
                pos += 4
            elif kind == 2:
                size, pos = _read_varint(message, pos)
                if number in wanted:
                    found[wanted[number]] = message[pos : pos + size].decode("utf-8", "replace")
                pos += size
            else:
                break
    except IndexError:
        pass
    return found


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


@final
class GrpcServer:
    """Serves gRPC methods over HTTP/2 on one listener; `drain` sends GOAWAY and waits.

    Args:
        methods: The served methods, by path (``/package.Service/Method``).
        max_message: The largest request message, in bytes (as received and inflated).
        head_timeout: Seconds a connection may stay without a call before it is closed.
        body_timeout: Seconds a call's request may stop arriving before it is failed.
        send_timeout: Seconds the client may read nothing of what is sent before its
            connection is closed.
        max_buffered: Request bytes a connection may hold for its handlers before its
            data is left unacknowledged (HTTP/2 flow control then holds the client);
            by default twice *max_message*.
    """

    def __init__(
        self,
        methods: Mapping[str, Method],
        max_message: int,
        *,
        head_timeout: float = 5.0,
        body_timeout: float = 30.0,
        send_timeout: float = 30.0,
        max_buffered: int | None = None,
    ) -> None:
        self._methods = methods
        #: Each method's path, by the method's id: what the request log names a call by.
        self.paths = {id(method): path for path, method in methods.items()}
        self._max = max_message
        self.head_timeout = head_timeout
        self.body_timeout = body_timeout
        self.send_timeout = send_timeout
        self.max_buffered = 2 * max_message if max_buffered is None else max_buffered
        self.connections: set[_Connection] = set()
        #: Set when a connection ends (replaced by whoever waits for it).
        self.closed = anyio.Event()
        #: `drain` began: a connection that starts now (its TLS handshake ended
        #: meanwhile) is told to go away at once, after its preface.
        self.draining = False

    async def connection(self, socket: anyio.abc.ByteStream) -> None:
        """Serve one accepted connection (a socket's stream, or TLS over one) until it closes."""
        conn = _Connection(socket, self._methods, self._max, self)
        self.connections.add(conn)
        try:
            await conn.run()
        except Exception as exc:
            # A bug met by one connection closes that connection, never the server.
            log.exception("gRPC connection failed", exc_info=exc)

    async def drain(self, period: float) -> None:
        """Send every connection a GOAWAY and wait up to *period* seconds for its calls to end."""
        self.draining = True
        for conn in list(self.connections):
            conn.goaway()
        with anyio.move_on_after(period):
            while self.connections:
                self.closed = anyio.Event()
                await self.closed.wait()
