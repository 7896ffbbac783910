"""The lean gRPC load client: V2 ``ModelInfer`` over plain non-blocking sockets.

A minimal client side of HTTP/2 (RFC 9113), just enough for unary gRPC calls
and ``ModelStreamInfer`` streams (one per worker, request after request on it):
the connection preface and SETTINGS (ACKed both ways), request HEADERS encoded
by hpack once per connection, DATA with the 5-byte gRPC message prefix around
a request serialized before the run, response HEADERS, DATA and trailers read
with hpack's decoder, flow control both ways, PING answered, GOAWAY and
RST_STREAM counted as errors. `_RawGrpcLoop` drives all of one closed-loop
level's connections from one worker thread with one poller, as `_LoadLoop`
does for HTTP: ``grpc.aio``'s client cost three times the HTTP client's CPU
per request, which on a small machine took CPU from the server it measured.
"""

from __future__ import annotations

import errno
import itertools
import math
import os
import socket
import struct
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import suppress
from typing import Any, Final, cast
from urllib.parse import unquote

import hpack

from ._client import _CONN_ERROR, _RECV_BYTES, _new_socket
from ._load import _ERR, _IN, _OUT, _POLL_MAX_S, _RETRY_S, _Poller, _precise_wait
from ._stats import STREAM_ERROR, Status, _Recorder

_PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# Frame types and flags (RFC 9113 section 6).
_DATA, _HEADERS, _RST_STREAM, _SETTINGS, _PUSH_PROMISE = 0x0, 0x1, 0x3, 0x4, 0x5
_PING, _GOAWAY, _WINDOW_UPDATE, _CONTINUATION = 0x6, 0x7, 0x8, 0x9
_END_STREAM, _ACK, _END_HEADERS, _PADDED, _PRIORITY = 0x1, 0x1, 0x4, 0x8, 0x20
# SETTINGS identifiers.
_HEADER_TABLE_SIZE, _ENABLE_PUSH, _MAX_CONCURRENT_STREAMS = 0x1, 0x2, 0x3
_INITIAL_WINDOW_SIZE, _MAX_FRAME_SIZE = 0x4, 0x5
_FRAME: Final = struct.Struct(">IBI")  # length << 8 | type, flags, stream id
_U32: Final = struct.Struct(">I")
_SETTING: Final = struct.Struct(">HI")
_DEFAULT_WINDOW: Final = 65_535
# Our receive window, per stream and for the connection: big enough that one
# answer never waits on a WINDOW_UPDATE; the connection's is topped up at half.
_RECV_WINDOW: Final = 1 << 24
_FRAME_HEADER: Final = 9
# Stream ids are 31 bits: a connection that used them all is replaced.
_LAST_STREAM_ID: Final = (1 << 31) - 1

_INFER: Final = "/inference.GRPCInferenceService/ModelInfer"
_STREAM_INFER: Final = "/inference.GRPCInferenceService/ModelStreamInfer"
# Appended to each streamed request (protobuf merges it into the message): the
# parameter triton_enable_empty_final_response = true (field 4, a map entry), which
# asks the server to end each request's responses with one flagged
# triton_final_response, as perf_analyzer asks; the request's id (field 3) follows.
_ENABLE_FINAL: Final = b'"(\n"triton_enable_empty_final_response\x12\x02\x08\x01'
_ID_TAG: Final = b"\x1a"

#: gRPC status codes by number, named as ``grpc.StatusCode`` names them.
GRPC_CODES: Final = [
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
]
#: The status of a call the server refused or cut off at the HTTP/2 level.
GOAWAY_ERROR: Final = "goaway"
RESET_ERROR: Final = "reset"


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return _FRAME.pack(len(payload) << 8 | kind, flags, stream) + payload


def _grpc_timeout(seconds: float) -> str:
    # At most 8 digits (gRPC's wire format): milliseconds, else whole seconds.
    millis = math.ceil(seconds * 1000)
    return f"{millis}m" if millis < 10**8 else f"{min(math.ceil(seconds), 10**8 - 1)}S"


class _Stream:
    """One call in flight."""

    __slots__ = (
        "data",
        "first",
        "grpc_message",
        "grpc_status",
        "http_status",
        "id",
        "request_id",
        "request_tag",
        "responses",
        "start",
        "unacked",
        "unsent",
        "worker",
    )

    def __init__(self, stream_id: int, start: int, worker: int = 0) -> None:
        self.id = stream_id
        self.start = start
        self.worker = worker  # which of its connection's workers made the call
        self.http_status = ""
        self.grpc_status: str | None = None
        self.grpc_message = ""
        self.data = bytearray()
        self.unsent: memoryview | None = None  # DATA still held back by flow control
        # Streams: the id of the request in flight on it (None between requests),
        # when its first response came (ns), how many came, and DATA not yet given
        # back to the stream's window.
        self.request_id: str | None = None
        self.request_tag = b""  # the id as a response's bytes hold it (field 3)
        self.first = 0
        self.responses = 0
        self.unacked = 0


class _H2Connection:
    """One HTTP/2 connection and its calls in flight; *slots* of the level's workers use it."""

    __slots__ = (
        "block",
        "connecting",
        "decoded",
        "decoder",
        "encoder",
        "fd",
        "first_block",
        "going_away",
        "headers",
        "headers_block",
        "headers_end_stream",
        "headers_stream",
        "index",
        "max_frame",
        "max_streams",
        "next_id",
        "peer_window",
        "rbuf",
        "recv_unacked",
        "retry_at",
        "send_window",
        "slots",
        "sock",
        "streams",
        "turn",
        "wbuf",
        "windows",
        "writing",
    )

    def __init__(self, slots: int, headers: list[tuple[str, str]], index: int = 0) -> None:
        self.slots = slots
        self.index = index  # its place among the level's connections
        self.headers = headers
        self.sock: socket.socket | None = None
        self.fd = -1
        self.retry_at = 0  # when a failed connection may be opened again (ns)
        self.turn = 0  # open loop: the worker to try first for the next due request
        self.reset()

    def reset(self) -> None:
        """Forget the last connection's state (before a new one)."""
        self.connecting = False
        self.going_away = False
        self.streams: dict[int, _Stream] = {}
        self.next_id = 1
        self.rbuf = bytearray()
        self.wbuf = bytearray()
        self.send_window = _DEFAULT_WINDOW
        self.peer_window = _DEFAULT_WINDOW  # the server's initial window per stream
        self.windows: dict[int, int] = {}  # per stream send windows, only while DATA waits
        self.max_frame = 16_384
        self.max_streams = 1 << 31
        self.recv_unacked = 0
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()
        # The first HEADERS adds the request headers to the server's table; every
        # later one refers to them by index, the same bytes each time.
        self.first_block: bytes | None = self.encoder.encode(self.headers)
        self.block: bytes = self.encoder.encode(self.headers)
        # Decoded header blocks that only refer to the table (cannot change it).
        self.decoded: dict[bytes, list[tuple[str, str]]] = {}
        self.headers_stream = 0  # a header block continued in CONTINUATION frames
        self.headers_block = bytearray()
        self.headers_end_stream = False
        self.writing = False  # polled for writable: the socket's buffer was full


class _RawGrpcLoop:
    """One closed-loop level's gRPC calls, driven from one worker thread by one poller.

    *count* workers share ``ceil(count / streams_per_connection)`` connections,
    each keeping its share of calls in flight: a call answered, the next goes out
    on the same connection. A connection that fails or is told to go away
    fails its calls in flight (counted as errors with the first message) and is
    replaced on the loop's next turn.

    With *streaming*, as perf_analyzer's ``--streaming``: each worker keeps one
    ``ModelStreamInfer`` stream open and sends its requests on it one after
    another, each with an id of its own and ``triton_enable_empty_final_response``;
    a request is done at the response flagged ``triton_final_response`` (or at
    its ``error_message``), and the worker's next request goes out on the same
    stream at once. Responses name their request's id, which is checked: one
    for another request is an error. A stream the server ends is replaced.

    Open loop (*schedule*, offsets in ns after the start, as `_LoadLoop`'s): the
    *count* workers are a fixed pool; a due request goes to the next free
    worker, workers taken in turn (so that each worker's sequence advances),
    else waits in a backlog (counted late) that workers take from as they
    free up, and past *backlog_limit* waiting new arrivals are dropped.
    Latency runs from when a request was due; how late it left is recorded.
    """

    def __init__(
        self,
        address: tuple[str, int],
        authority: str,
        requests: Sequence[bytes],
        recorder: _Recorder,
        count: int,
        *,
        streams_per_connection: int,
        timeout_s: float | None = None,
        streaming: bool = False,
        next_request: Callable[[int, int], bytes] | None = None,
        schedule: Iterator[int] | None = None,
        backlog_limit: int = 0,
    ) -> None:
        self._address = address
        self._schedule = schedule
        self._backlog: deque[int] = deque()
        self._backlog_limit = backlog_limit
        self._streaming = streaming
        # Requests that differ by worker (sequences) or connection (shared memory):
        # made per call from (connection index, worker index within it).
        self._next_request = next_request
        # Each message with its gRPC prefix: not compressed, then its length.
        self._messages = [b"\0" + _U32.pack(len(r)) + r for r in requests]
        # Streams: each request asks for the final-response flag; its id is added per send.
        self._stream_bodies = [r + _ENABLE_FINAL for r in requests]
        self._parse: Callable[[bytes], Any] = _no_parser
        if streaming:
            from ..server import _grpc_proto as pb  # upb: about 2 us a response

            self._parse = pb.ModelStreamInferResponse.FromString
        self._recorder = recorder
        self._stopping = False
        self._n = 0
        self._ids = itertools.count(1)  # streamed requests' ids
        self._poller = _Poller()
        self._by_fd: dict[int, _H2Connection] = {}
        self._broken: list[_H2Connection] = []
        headers = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", _STREAM_INFER if streaming else _INFER),
            (":authority", authority),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ]
        if timeout_s is not None:
            headers.append(("grpc-timeout", _grpc_timeout(timeout_s)))
        per = max(1, streams_per_connection)
        self.connections = [
            _H2Connection(min(per, count - first), headers, first // per)
            for first in range(0, count, per)
        ]

    def stop(self) -> None:
        """Ask the loop to return (from any thread); it does within ``_POLL_MAX_S``."""
        self._stopping = True

    def close(self) -> None:
        """Close every socket (after `run` returned)."""
        for conn in self.connections:
            self._close(conn)
        self._poller.close()

    # -- connections ---------------------------------------------------------------------------

    def _open(self, conn: _H2Connection) -> None:
        conn.reset()
        sock = _new_socket(self._address)
        error = sock.connect_ex(self._address)
        if error not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
            sock.close()
            self._fail(conn, OSError(error, os.strerror(error)), self._waiting(conn))
            return
        conn.sock = sock
        conn.fd = sock.fileno()
        conn.connecting = True
        self._by_fd[conn.fd] = conn
        self._poller.register(conn.fd, _OUT)  # writable once connected (or failed)

    def _connected(self, conn: _H2Connection) -> None:
        conn.connecting = False
        settings = _SETTING.pack(_ENABLE_PUSH, 0) + _SETTING.pack(
            _INITIAL_WINDOW_SIZE, _RECV_WINDOW
        )
        conn.wbuf += _PREFACE
        conn.wbuf += _frame(_SETTINGS, 0, 0, settings)
        conn.wbuf += _frame(_WINDOW_UPDATE, 0, 0, _U32.pack(_RECV_WINDOW - _DEFAULT_WINDOW))
        self._poller.modify(conn.fd, _IN)
        self._fill(conn)

    def _close(self, conn: _H2Connection) -> None:
        if conn.sock is None:
            return
        self._by_fd.pop(conn.fd, None)
        with suppress(OSError, KeyError, ValueError):
            self._poller.unregister(conn.fd)
        conn.sock.close()
        conn.sock = None

    def _fail(self, conn: _H2Connection, exc: BaseException, calls: int) -> None:
        # Every call in flight (or, unconnected, every worker waiting) ends as a
        # connection error; the connection is rebuilt on the loop's next turn, not
        # here, so a server that refuses every connection can neither recurse nor spin.
        if calls:
            self._recorder.window.errors[_CONN_ERROR] += calls
            self._recorder.first_error.setdefault(_CONN_ERROR, f"{type(exc).__name__}: {exc}")
        self._close(conn)
        conn.streams = {}
        conn.retry_at = time.perf_counter_ns() + int(_RETRY_S * 1e9)
        self._broken.append(conn)

    def _waiting(self, conn: _H2Connection) -> int:
        # The requests a connection that could not connect fails: a closed loop's
        # workers each had one waiting; an open loop sends none to it until it is up.
        return 0 if self._schedule is not None else conn.slots

    def _in_flight(self, conn: _H2Connection) -> int:
        # Requests in flight on *conn* (a stream between requests has none).
        if self._streaming:
            return sum(s.request_id is not None for s in conn.streams.values())
        return len(conn.streams)

    def _go_away(self, conn: _H2Connection, message: str) -> None:
        # The server takes no more calls here: the ones above its last stream are
        # counted now, the rest finish; then the connection is replaced.
        self._recorder.first_error.setdefault(GOAWAY_ERROR, message)
        conn.going_away = True

    # -- sending -------------------------------------------------------------------------------

    def _fill(self, conn: _H2Connection) -> None:
        """Start calls on *conn* until its workers (or the server's limit) are all in flight.

        Open loop: only requests due (the backlog's), while it has free workers.
        """
        if conn.going_away or conn.sock is None:
            return  # its workers wait for the next connection
        if self._schedule is not None:
            while self._backlog and self._start_due(conn, self._backlog[0]):
                self._backlog.popleft()
            return
        want = min(conn.slots, conn.max_streams)
        if len(conn.streams) < want:
            start = time.perf_counter_ns()
            while len(conn.streams) < want:
                self._send(conn, start)

    def _start_due(self, conn: _H2Connection, due: int) -> bool:
        """Open loop: send the request due at *due* on a free worker of *conn*, if any."""
        if conn.going_away or conn.sock is None or conn.connecting:
            return False
        if self._streaming:
            busy = {s.worker for s in conn.streams.values() if s.request_id is not None}
        else:
            busy = {s.worker for s in conn.streams.values()}
        worker = self._next_worker(conn, busy)
        if worker is None:
            return False
        window = self._recorder.window
        window.sent += 1
        window.delays.append(time.perf_counter_ns() - due)
        idle = None
        if self._streaming:
            idle = next((s for s in conn.streams.values() if s.worker == worker), None)
        if idle is not None:
            self._stream_next(conn, idle, due)
        else:
            self._send(conn, due, worker)
        return True

    def _next_worker(self, conn: _H2Connection, busy: set[int]) -> int | None:
        # Open loop: the next of *conn*'s workers in turn that is not busy.
        if len(busy) >= min(conn.slots, conn.max_streams):
            return None
        for step in range(conn.slots):
            worker = (conn.turn + step) % conn.slots
            if worker not in busy:
                conn.turn = worker + 1
                return worker
        return None  # pragma: no cover - fewer busy than slots leaves one free

    def _request(self, conn: _H2Connection, worker: int) -> bytes:
        # The next request's bytes, made for its worker where requests differ by worker.
        if self._next_request is not None:
            request = self._next_request(conn.index, worker)
            return request + _ENABLE_FINAL if self._streaming else request
        n = self._n
        self._n += 1
        if self._streaming:
            return self._stream_bodies[n % len(self._stream_bodies)]
        return self._messages[n % len(self._messages)]

    def _send(self, conn: _H2Connection, start: int, worker: int | None = None) -> None:
        """Start the next call on *conn* (its latency runs from *start*), for *worker*.

        Streaming: open the worker's stream and send its first request.
        """
        if worker is None:
            worker = 0
            if self._next_request is not None or self._streaming:
                # The first of the connection's workers with no call in flight: whatever
                # ended its last call (an answer, a reset, a lost connection).
                busy = {s.worker for s in conn.streams.values()}
                worker = next(i for i in range(conn.slots) if i not in busy)
        sid = conn.next_id
        conn.next_id += 2
        if conn.next_id > _LAST_STREAM_ID:
            conn.going_away = True  # finish what is in flight, then reconnect
        stream = conn.streams[sid] = _Stream(sid, start, worker)
        block = conn.block
        if conn.first_block is not None:
            block, conn.first_block = conn.first_block, None
        conn.wbuf += _FRAME.pack(len(block) << 8 | _HEADERS, _END_HEADERS, sid)
        conn.wbuf += block
        conn.windows[sid] = conn.peer_window
        if self._streaming:
            self._stream_next(conn, stream, start)
            return
        request = self._request(conn, worker)
        if self._next_request is not None:
            request = b"\0" + _U32.pack(len(request)) + request
        self._data(conn, stream, request)

    def _stream_next(self, conn: _H2Connection, stream: _Stream, start: int) -> None:
        # A stream's next request: its own id, in a message of its own on the stream.
        request_id = str(next(self._ids))
        body = self._request(conn, stream.worker)
        tail = _ID_TAG + bytes([len(request_id)]) + request_id.encode()
        stream.request_id = request_id
        stream.request_tag = tail  # (a ModelInferResponse's id is field 3 too)
        stream.start = start
        stream.first = stream.responses = 0
        self._data(conn, stream, b"\0" + _U32.pack(len(body) + len(tail)) + body + tail)

    def _data(self, conn: _H2Connection, stream: _Stream, message: bytes) -> None:
        # One message on *stream*: at once where both windows allow it in one frame,
        # else as flow control lets it out. A unary call's message ends its stream.
        sid = stream.id
        size = len(message)
        if (
            stream.unsent is None
            and size <= conn.send_window
            and size <= conn.windows[sid]
            and size <= conn.max_frame
        ):
            conn.send_window -= size
            conn.windows[sid] -= size
            conn.wbuf += _FRAME.pack(size << 8 | _DATA, 0 if self._streaming else _END_STREAM, sid)
            conn.wbuf += message
        elif stream.unsent is None:
            stream.unsent = memoryview(message)
            self._pump(conn, stream)
        else:  # pragma: no cover - a server that answered before reading the whole request
            stream.unsent = memoryview(bytes(stream.unsent) + message)

    def _pump(self, conn: _H2Connection, stream: _Stream) -> None:
        # DATA as far as both windows allow, in frames no larger than the server takes.
        data = stream.unsent
        assert data is not None
        sid = stream.id
        last = 0 if self._streaming else _END_STREAM
        while data:
            size = min(len(data), conn.send_window, conn.windows[sid], conn.max_frame)
            if size <= 0:
                break
            conn.send_window -= size
            conn.windows[sid] -= size
            flags = last if size == len(data) else 0
            conn.wbuf += _FRAME.pack(size << 8 | _DATA, flags, sid)
            conn.wbuf += data[:size]
            data = data[size:]
        stream.unsent = data if data else None

    def _flush(self, conn: _H2Connection) -> None:
        sock = conn.sock
        if sock is None or not conn.wbuf or conn.connecting:
            return
        try:
            sent = sock.send(conn.wbuf)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            self._fail(conn, exc, self._in_flight(conn))
            return
        del conn.wbuf[:sent]
        writing = bool(conn.wbuf)
        if writing != conn.writing:
            conn.writing = writing
            self._poller.modify(conn.fd, _IN | _OUT if writing else _IN)

    # -- receiving -----------------------------------------------------------------------------

    def _event(self, conn: _H2Connection, flags: int, now: int) -> None:
        sock = conn.sock
        assert sock is not None
        if conn.connecting:
            error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if error:
                self._fail(conn, OSError(error, os.strerror(error)), self._waiting(conn))
                return
            self._connected(conn)
        elif flags & (_IN | _ERR):
            try:
                chunk = sock.recv(_RECV_BYTES)
            except BlockingIOError:
                chunk = None
            except OSError as exc:
                self._fail(conn, exc, self._in_flight(conn))
                return
            if chunk is not None:
                if not chunk:
                    self._fail(
                        conn,
                        ConnectionResetError("the server closed the connection"),
                        self._in_flight(conn),
                    )
                    return
                try:
                    self._receive(conn, chunk, now)
                except (ValueError, KeyError, IndexError, struct.error, hpack.HPACKError) as exc:
                    self._fail(
                        conn,
                        _ProtocolError(f"bad HTTP/2 from the server: {exc}"),
                        self._in_flight(conn),
                    )
                    return
                if conn.sock is None:
                    return
        if conn.going_away and not conn.streams:
            self._close(conn)
            self._broken.append(conn)
            return
        self._flush(conn)

    def _receive(self, conn: _H2Connection, chunk: bytes, now: int) -> None:
        rbuf = conn.rbuf
        rbuf += chunk
        offset = 0
        end = len(rbuf)
        while end - offset >= _FRAME_HEADER:
            head, flags, sid = _FRAME.unpack_from(rbuf, offset)
            length = head >> 8
            stop = offset + _FRAME_HEADER + length
            if stop > end:
                break
            payload = bytes(rbuf[offset + _FRAME_HEADER : stop])
            offset = stop
            self._frame(conn, head & 0xFF, flags, sid & 0x7FFF_FFFF, payload, now)
            if conn.sock is None:
                return
        del rbuf[:offset]

    def _frame(
        self, conn: _H2Connection, kind: int, flags: int, sid: int, payload: bytes, now: int
    ) -> None:
        if conn.headers_stream and kind != _CONTINUATION:
            raise ValueError("a header block was interrupted by another frame")
        if kind == _DATA:
            if flags & _PADDED:
                payload = payload[1 : len(payload) - payload[0]]
            conn.recv_unacked += len(payload)
            if conn.recv_unacked >= _RECV_WINDOW // 2:
                conn.wbuf += _frame(_WINDOW_UPDATE, 0, 0, _U32.pack(conn.recv_unacked))
                conn.recv_unacked = 0
            stream = conn.streams.get(sid)
            if stream is not None:
                stream.data += payload
                if self._streaming:
                    self._responses(conn, stream, len(payload), now)
                if flags & _END_STREAM:
                    self._complete(conn, stream, now)
                elif len(stream.data) >= _RECV_WINDOW // 2 and payload:
                    # An answer past half the stream's window: give back what arrives.
                    conn.wbuf += _frame(_WINDOW_UPDATE, 0, sid, _U32.pack(len(payload)))
        elif kind in (_HEADERS, _CONTINUATION):
            if kind == _HEADERS:
                if flags & _PADDED:
                    payload = payload[1 : len(payload) - payload[0]]
                if flags & _PRIORITY:
                    payload = payload[5:]
                conn.headers_block = bytearray(payload)
                conn.headers_stream = sid
                # Where the block ends, the stream's END_STREAM flag (on HEADERS only) counts.
                conn.headers_end_stream = bool(flags & _END_STREAM)
            else:
                if sid != conn.headers_stream:
                    raise ValueError("CONTINUATION of no header block")
                conn.headers_block += payload
            if flags & _END_HEADERS:
                conn.headers_stream = 0
                self._headers(conn, sid, bytes(conn.headers_block), now)
        elif kind == _WINDOW_UPDATE:
            increment = _U32.unpack(payload)[0] & 0x7FFF_FFFF
            if sid == 0:
                conn.send_window += increment
                for waiting in list(conn.streams.values()):
                    if waiting.unsent is not None:
                        self._pump(conn, waiting)
            elif sid in conn.windows:
                conn.windows[sid] += increment
                waiting = conn.streams[sid]
                if waiting.unsent is not None:
                    self._pump(conn, waiting)
        elif kind == _PING:
            if not flags & _ACK:
                conn.wbuf += _frame(_PING, _ACK, 0, payload)
        elif kind == _SETTINGS:
            if not flags & _ACK:
                self._settings(conn, payload)
                conn.wbuf += _frame(_SETTINGS, _ACK, 0)
        elif kind == _RST_STREAM:
            stream = conn.streams.pop(sid, None)
            if stream is not None:
                if not self._streaming or stream.request_id is not None:
                    code = _U32.unpack(payload)[0]
                    self._error(
                        RESET_ERROR, f"the server reset the stream (HTTP/2 error code {code})"
                    )
                conn.windows.pop(sid, None)
                self._fill(conn)
        elif kind == _GOAWAY:
            last, code = struct.unpack_from(">II", payload)
            last &= 0x7FFF_FFFF
            debug = payload[8:].decode(errors="replace")
            self._go_away(
                conn,
                f"the server sent GOAWAY (HTTP/2 error code {code}, last stream {last})"
                + (f": {debug}" if debug else ""),
            )
            for sid_above in [s for s in conn.streams if s > last]:
                del conn.streams[sid_above]
                conn.windows.pop(sid_above, None)
                self._recorder.window.errors[GOAWAY_ERROR] += 1
        elif kind == _PUSH_PROMISE:
            raise ValueError("PUSH_PROMISE, though the client disabled push")
        # PRIORITY, unknown and extension frames: ignored, as RFC 9113 asks.

    def _settings(self, conn: _H2Connection, payload: bytes) -> None:
        for i in range(0, len(payload) - 5, 6):
            key, value = _SETTING.unpack_from(payload, i)
            if key == _INITIAL_WINDOW_SIZE:
                delta = value - conn.peer_window
                conn.peer_window = value
                for sid in conn.windows:
                    conn.windows[sid] += delta
                for waiting in list(conn.streams.values()):
                    if waiting.unsent is not None:
                        self._pump(conn, waiting)
            elif key == _MAX_FRAME_SIZE:
                conn.max_frame = value
            elif key == _MAX_CONCURRENT_STREAMS:
                conn.max_streams = value
            elif key == _HEADER_TABLE_SIZE and value < conn.encoder.header_table_size:
                # The server's table is smaller than hpack's default: encode again,
                # the first block announcing the new size.
                conn.encoder.header_table_size = value
                conn.first_block = conn.encoder.encode(conn.headers)
                conn.block = conn.encoder.encode(conn.headers)

    def _headers(self, conn: _H2Connection, sid: int, block: bytes, now: int) -> None:
        headers = conn.decoded.get(block)
        if headers is None:
            headers = cast("list[tuple[str, str]]", conn.decoder.decode(block))
            # A block of one-byte indexed fields only reads the table: its result
            # stays right until a block that changes the table, which clears these.
            if all(b >= 0x80 and b != 0xFF for b in block):
                conn.decoded[block] = headers
            else:
                conn.decoded.clear()
        stream = conn.streams.get(sid)
        if stream is None:
            return
        for name, value in headers:
            if name == ":status":
                stream.http_status = value
            elif name == "grpc-status":
                stream.grpc_status = value
            elif name == "grpc-message":
                stream.grpc_message = unquote(value)
        if conn.headers_end_stream:
            self._complete(conn, stream, now)

    def _complete(self, conn: _H2Connection, stream: _Stream, now: int) -> None:
        # The call ended (its trailers, or END_STREAM on DATA). A stream's requests
        # end at their final responses: one still in flight when it ends failed.
        del conn.streams[stream.id]
        conn.windows.pop(stream.id, None)
        data = stream.data
        ok = stream.grpc_status == "0" and stream.http_status == "200"
        if self._streaming:
            if stream.request_id is None:
                pass  # between requests: the worker's next one opens a new stream
            elif ok:
                self._error(
                    "bad-answer",
                    f"the server ended the stream before request {stream.request_id!r}'s final "
                    "response (triton_final_response)"
                    + (f", inside a message: {data[:40]!r}" if data else ""),
                )
            else:
                self._call_failed(stream)
        elif ok:
            if len(data) >= 5 and data[0] == 0 and _U32.unpack_from(data, 1)[0] == len(data) - 5:
                self._recorder.window.latencies.append(now - stream.start)
            else:
                self._error("bad-answer", f"an OK answer without one whole message: {data[:40]!r}")
        else:
            self._call_failed(stream)
        self._fill(conn)

    def _call_failed(self, stream: _Stream) -> None:
        # A call that ended with an HTTP or gRPC status other than OK.
        if stream.http_status != "200":
            self._error(
                f"http-{stream.http_status or '?'}",
                f"the server answered HTTP status {stream.http_status or '(none)'}",
            )
            return
        code = stream.grpc_status
        name = (
            GRPC_CODES[int(code)]
            if code is not None and code.isdigit() and int(code) < len(GRPC_CODES)
            else f"grpc-status {code}"
        )
        self._error(name, stream.grpc_message)

    def _responses(self, conn: _H2Connection, stream: _Stream, received: int, now: int) -> None:
        # A stream's whole ModelStreamInferResponses, as they arrive: each for the
        # request in flight (its id), counted unless it is the empty final one; the
        # final one (or an error_message) ends the request and sends the worker's
        # next on the stream. The stream's window is given back as its bytes are read.
        data = stream.data
        offset = 0
        while len(data) - offset >= 5:
            size = _U32.unpack_from(data, offset + 1)[0]
            if len(data) - offset - 5 < size:
                break
            message = bytes(data[offset + 5 : offset + 5 + size])
            offset += 5 + size
            self._response(conn, stream, message, now)
        del data[:offset]
        stream.unacked += received
        if stream.unacked >= _RECV_WINDOW // 2:
            conn.wbuf += _frame(_WINDOW_UPDATE, 0, stream.id, _U32.pack(stream.unacked))
            stream.unacked = 0

    def _read(self, message: bytes) -> tuple[str, str, bool, bool] | None:
        # A response's request id, error_message, final flag and whether it has
        # outputs (None: it does not parse). The parameters map, dear to read, is
        # read only where its bytes hold the final flag.
        try:
            answer = self._parse(message)
        except Exception:  # garbled: the caller counts it, with its bytes
            return None
        response = answer.infer_response
        if _FINAL_TRUE not in message:
            return response.id, answer.error_message, False, True
        final = response.parameters.get("triton_final_response")
        is_final = final is not None and final.bool_param
        has_outputs = bool(response.outputs) or bool(response.raw_output_contents)
        return response.id, answer.error_message, is_final, has_outputs

    def _response(self, conn: _H2Connection, stream: _Stream, message: bytes, now: int) -> None:
        if (
            message[:1] == b"\x12"  # an infer_response, no error_message
            and _FINAL_TRUE not in message
            and message.find(stream.request_tag, 0, _ID_WITHIN) > 0
        ):
            # The usual response, read from its bytes (the parser would cost twice the
            # rest of its handling): the request in flight's, and not its last.
            if not stream.responses:
                stream.first = now
            stream.responses += 1
            return
        read = self._read(message)
        if read is None:
            self._error("bad-answer", f"a stream response that does not parse: {message[:60]!r}")
            return
        response_id, error, is_final, has_outputs = read
        # An error without an id (a server that names none) is the request in flight's.
        if response_id != stream.request_id and not (error and not response_id):
            if is_final and not has_outputs:
                return  # a late end of a request that already failed: nothing to count
            self._error(
                "bad-answer",
                f"a response for request {response_id!r} on a stream whose request in flight "
                f"is {stream.request_id!r}",
            )
            return
        if error:
            self._error(STREAM_ERROR, error)
        else:
            if not is_final or has_outputs:
                if not stream.responses:
                    stream.first = now
                stream.responses += 1
            if not is_final:
                return
            window = self._recorder.window
            window.latencies.append(now - stream.start)
            if stream.responses:
                window.first.append(stream.first - stream.start)
                window.responses += stream.responses
        stream.request_id = None
        if conn.going_away:
            # No new request here: end the stream, and the connection is replaced
            # once the server has closed its streams.
            conn.wbuf += _frame(_DATA, _END_STREAM, stream.id)
        elif self._schedule is not None:
            self._fill(conn)  # the backlog's next, if any; else the stream waits
        else:
            self._stream_next(conn, stream, time.perf_counter_ns())

    def _error(self, status: Status, message: str) -> None:
        self._recorder.window.errors[status] += 1
        self._recorder.first_error.setdefault(status, message)

    # -- the loop ----------------------------------------------------------------------------------

    def run(self) -> None:
        """Drive the connections until `stop` (runs in a worker thread)."""
        poll = self._poller.poll
        by_fd = self._by_fd
        schedule = self._schedule
        for conn in self.connections:
            self._open(conn)
        start_ns = time.perf_counter_ns()
        due = start_ns + next(schedule) if schedule is not None else 0
        # As `_LoadLoop`: microsecond waits, so that requests go out when due.
        precise = _precise_wait(self._poller)
        turn = 0  # the connection to try first, so that every one's workers take turns
        while not self._stopping:
            timeout = _POLL_MAX_S
            if schedule is not None:
                now = time.perf_counter_ns()
                while due <= now:
                    count = len(self.connections)
                    for step in range(count):
                        conn = self.connections[(turn + step) % count]
                        if not self._backlog and self._start_due(conn, due):
                            turn = (turn + step + 1) % count
                            self._flush(conn)
                            break
                    else:
                        if len(self._backlog) < self._backlog_limit:
                            self._backlog.append(due)
                            self._recorder.window.late += 1
                        else:
                            self._recorder.window.dropped += 1
                    due = start_ns + next(schedule)
                timeout = min(timeout, (due - now) / 1e9)
            if self._broken:
                broken, self._broken = self._broken, []
                now = time.perf_counter_ns()
                for conn in broken:
                    if conn.retry_at <= now:
                        self._open(conn)
                    else:
                        self._broken.append(conn)
                if self._broken:
                    timeout = min(timeout, _RETRY_S)
            if precise is not None and 0 < timeout < _POLL_MAX_S:
                events = poll(0) if precise(timeout)[0] else []
            else:
                events = poll(timeout)
            now = time.perf_counter_ns()
            for fd, flags in events:
                ready = by_fd.get(fd)
                if ready is not None and ready.sock is not None:
                    self._event(ready, flags, now)


# A ModelInferResponse's parameters entry triton_final_response = true (field 4), as
# protobuf writes it: only a response holding these bytes has its parameters read.
_FINAL_TRUE: Final = b"\n\x15triton_final_response\x12\x02\x08\x01"
# A response's id comes after its model's name and version: within this many bytes of
# its start, or the response is parsed to find it.
_ID_WITHIN: Final = 512


def _no_parser(message: bytes) -> Any:  # pragma: no cover - unary calls parse nothing
    raise AssertionError("only streams parse their responses")


class _ProtocolError(Exception):
    """The server broke HTTP/2 or gRPC framing."""
