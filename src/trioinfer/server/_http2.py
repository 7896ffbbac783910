"""A lean server-side HTTP/2 connection (RFC 9113) for gRPC: frames in, events out.

What ``_grpc_h2`` needs of HTTP/2 and no more, with python-hyper's ``hpack``
for header compression. It replaced ``h2``'s `H2Connection` (same method
names, same event names, same flow-control algorithm) because h2's state
machines, frame objects and trace logging cost about as much server CPU per
gRPC call as everything else in the call together. Like h2 it does no I/O:
`Connection.receive_data` takes bytes and returns events,
`Connection.data_to_send` hands back what to write.

Kept from h2, as the transport's bounds rely on them: the connection preface;
frame size limits; every frame type's length and stream-id checks; header
blocks split over CONTINUATION with nothing interleaved (and a cap on their
size); stream ids rising and odd; inbound flow control (a client that sends
past its window is a FLOW_CONTROL_ERROR, and windows are handed back only as
the application acknowledges data, with h2's `WindowManager` algorithm);
outbound flow control (a send past the client's window raises); SETTINGS
(table size, window size changes applied to open streams, frame size, ACK);
PING answered; RST_STREAM both ways; GOAWAY both ways (the client's graceful
one lets its open streams finish); the concurrent stream
limit (a stream over it is refused). Header validation is not done (h2's was
off too): headers only pick a method, a deadline and metadata compared as
strings. Server push, priorities (parsed and ignored) and HTTP/1.1 upgrade are
not supported.

A connection error raises `ProtocolError` (the caller sends GOAWAY with its
code); a stream error resets that stream and reports it as a `StreamReset`
whose ``remote_reset`` is False.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, Final, cast, final

import hpack

# Frame types (RFC 9113 6).
_DATA: Final = 0x0
_HEADERS: Final = 0x1
_PRIORITY: Final = 0x2
_RST_STREAM: Final = 0x3
_SETTINGS: Final = 0x4
_PUSH_PROMISE: Final = 0x5
_PING: Final = 0x6
_GOAWAY: Final = 0x7
_WINDOW_UPDATE: Final = 0x8
_CONTINUATION: Final = 0x9

# Flags.
_END_STREAM: Final = 0x1
_ACK: Final = 0x1
_END_HEADERS: Final = 0x4
_PADDED: Final = 0x8
_PRIORITY_FLAG: Final = 0x20

# Error codes (RFC 9113 7).
NO_ERROR: Final = 0x0
PROTOCOL_ERROR: Final = 0x1
INTERNAL_ERROR: Final = 0x2
FLOW_CONTROL_ERROR: Final = 0x3
STREAM_CLOSED: Final = 0x5
FRAME_SIZE_ERROR: Final = 0x6
REFUSED_STREAM: Final = 0x7
COMPRESSION_ERROR: Final = 0x9
ENHANCE_YOUR_CALM: Final = 0xB

# Settings (RFC 9113 6.5.2).
_HEADER_TABLE_SIZE: Final = 0x1
_ENABLE_PUSH: Final = 0x2
_MAX_CONCURRENT_STREAMS: Final = 0x3
_INITIAL_WINDOW_SIZE: Final = 0x4
_MAX_FRAME_SIZE: Final = 0x5
_MAX_HEADER_LIST_SIZE: Final = 0x6

PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_DEFAULT_WINDOW: Final = 65535
_LARGEST_WINDOW: Final = (1 << 31) - 1
_MIN_FRAME_SIZE: Final = 16384
_MAX_FRAME_SIZE_LIMIT: Final = (1 << 24) - 1
#: The largest frame this side takes (the default: it is not raised by our SETTINGS).
_INBOUND_FRAME_SIZE: Final = _MIN_FRAME_SIZE
#: The largest decoded header list taken (advertised as SETTINGS_MAX_HEADER_LIST_SIZE).
MAX_HEADER_LIST_SIZE: Final = 65536
#: The largest header block (HEADERS and its CONTINUATIONs) buffered before it is decoded.
_MAX_HEADER_BLOCK: Final = 2 * MAX_HEADER_LIST_SIZE

#: The most the encoder's dynamic table holds, whatever the client allows.
_ENCODER_TABLE_SIZE: Final = 4096

_HEAD: Final = struct.Struct(">BHBBL")
_U32: Final = struct.Struct(">L")
_SETTING: Final = struct.Struct(">HL")
_GOAWAY_HEAD: Final = struct.Struct(">LL")


class ProtocolError(Exception):
    """The peer broke HTTP/2 (a connection error), or a send this connection cannot make."""

    def __init__(self, message: str, error_code: int = PROTOCOL_ERROR) -> None:
        super().__init__(message)
        self.error_code = error_code


class StreamClosedError(ProtocolError):
    """A send, or a window asked for, on a stream that is closed (or was never opened)."""

    def __init__(self, stream_id: int) -> None:
        super().__init__(f"stream {stream_id} is closed", STREAM_CLOSED)
        self.stream_id = stream_id


class FlowControlError(ProtocolError):
    """A send larger than the peer's window or frame size."""


# -- events ----------------------------------------------------------------------------------


@final
class RequestReceived:
    """A new stream's request headers (raw bytes pairs, as hpack decoded them)."""

    __slots__ = ("headers", "stream_id")

    def __init__(self, stream_id: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.stream_id = stream_id
        self.headers = headers


@final
class DataReceived:
    """DATA on an open stream; ``flow_controlled_length`` counts its padding too."""

    __slots__ = ("data", "flow_controlled_length", "stream_id")

    def __init__(self, stream_id: int, data: bytes, flow_controlled_length: int) -> None:
        self.stream_id = stream_id
        self.data = data
        self.flow_controlled_length = flow_controlled_length


@final
class StreamEnded:
    """The client ended its side of the stream (END_STREAM, on DATA or trailers)."""

    __slots__ = ("stream_id",)

    def __init__(self, stream_id: int) -> None:
        self.stream_id = stream_id


@final
class StreamReset:
    """The stream was reset: by the client (``remote_reset``), or by this side for an error."""

    __slots__ = ("error_code", "remote_reset", "stream_id")

    def __init__(self, stream_id: int, error_code: int, remote_reset: bool) -> None:
        self.stream_id = stream_id
        self.error_code = error_code
        self.remote_reset = remote_reset


@final
class WindowUpdated:
    """The client opened a window (``stream_id`` 0: the connection's)."""

    __slots__ = ("delta", "stream_id")

    def __init__(self, stream_id: int, delta: int) -> None:
        self.stream_id = stream_id
        self.delta = delta


@final
class RemoteSettingsChanged:
    """The client's SETTINGS were applied (windows may have changed)."""

    __slots__ = ()


@final
class ConnectionTerminated:
    """The client sent GOAWAY.

    With NO_ERROR while streams are open, those streams may still finish (the
    client opens no more; one it opens anyway is refused); otherwise, or with
    none open, the connection takes no more frames either way.
    """

    __slots__ = ("additional_data", "error_code", "last_stream_id")

    def __init__(self, error_code: int, last_stream_id: int, additional_data: bytes) -> None:
        self.error_code = error_code
        self.last_stream_id = last_stream_id
        self.additional_data = additional_data


Event = (
    RequestReceived
    | DataReceived
    | StreamEnded
    | StreamReset
    | WindowUpdated
    | RemoteSettingsChanged
    | ConnectionTerminated
)


# -- the connection --------------------------------------------------------------------------


@final
class _Window:
    """An inbound flow-control window, handed back as the application processes data (h2's)."""

    __slots__ = ("current", "maximum", "processed")

    def __init__(self, size: int) -> None:
        self.maximum = self.current = size
        self.processed = 0

    def consumed(self, size: int) -> bool:
        self.current -= size
        return self.current >= 0

    def process(self, size: int) -> int:
        # h2's WindowManager: hand back half a window at a time, or as soon as 1 KiB (a
        # quarter of a small window) was processed of a window that is shut.
        processed = self.processed = self.processed + size
        if (self.current == 0 and processed > min(1024, self.maximum // 4)) or (
            processed >= self.maximum // 2
        ):
            increment = min(processed, self.maximum - self.current)
            self.processed = 0
            self.current += increment
            return increment
        return 0


@final
class _Stream:
    __slots__ = ("inbound", "local_open", "outbound", "remote_open")

    def __init__(self, inbound: int, outbound: int) -> None:
        self.inbound = _Window(inbound)
        self.outbound = outbound
        self.remote_open = True
        self.local_open = True


def _frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _HEAD.pack(n >> 16, n & 0xFFFF, kind, flags, stream_id) + payload


@final
class Connection:
    """The server side of one HTTP/2 connection, without I/O.

    Args:
        initial_window: The receive window offered per stream.
        max_streams: Streams the client may have open at once (more are refused).
        decoder: hpack's decoder (or a subclass); its header list cap is set here.
        encoder: hpack's encoder (or a subclass).
    """

    def __init__(
        self,
        *,
        initial_window: int = _DEFAULT_WINDOW,
        max_streams: int = 100,
        decoder: hpack.Decoder | None = None,
        encoder: hpack.Encoder | None = None,
    ) -> None:
        self.decoder = decoder if decoder is not None else hpack.Decoder()
        self.decoder.max_header_list_size = MAX_HEADER_LIST_SIZE
        self.encoder = encoder if encoder is not None else hpack.Encoder()
        #: The client's streams not yet closed both ways, by id.
        self.streams: dict[int, _Stream] = {}
        #: True once either side sent GOAWAY through `close_connection` or the client's arrived.
        self.closed = False
        self.highest_inbound_stream_id = 0
        #: The largest DATA payload the client takes in one frame (its SETTINGS).
        self.max_outbound_frame_size = _MIN_FRAME_SIZE
        self._initial_window = initial_window
        self._max_streams = max_streams
        self._remote_initial_window = _DEFAULT_WINDOW
        self._outbound = _DEFAULT_WINDOW
        self._inbound = _Window(_DEFAULT_WINDOW)
        self._buffer = bytearray()
        self._preface = False
        #: The client's SETTINGS, which must be its first frame, arrived.
        self._greeted = False
        #: The client sent a graceful GOAWAY while streams were open: it opens no more.
        self._remote_goaway = False
        #: A header block waiting for its CONTINUATIONs: (stream id, flags, bytes so far).
        self._block: tuple[int, int, bytearray] | None = None
        self._out: list[bytes] = []

    # -- sending --

    def initiate_connection(self) -> None:
        """Queue this side's SETTINGS (the connection's first frame)."""
        settings = b"".join(
            _SETTING.pack(key, value)
            for key, value in (
                (_ENABLE_PUSH, 0),
                (_MAX_CONCURRENT_STREAMS, self._max_streams),
                (_INITIAL_WINDOW_SIZE, self._initial_window),
                (_MAX_HEADER_LIST_SIZE, MAX_HEADER_LIST_SIZE),
            )
        )
        self._out.append(_frame(_SETTINGS, 0, 0, settings))

    def increment_flow_control_window(self, increment: int) -> None:
        """Open the connection's receive window by *increment* bytes."""
        window = self._inbound
        window.current += increment
        window.maximum = max(window.maximum, window.current)
        self._out.append(_frame(_WINDOW_UPDATE, 0, 0, _U32.pack(increment)))

    def data_to_send(self) -> bytes:
        """The bytes queued to write, taken out."""
        out, self._out = self._out, []
        return b"".join(out)

    def bytes_to_send(self) -> int:
        """How many bytes are queued to write (what `data_to_send` would take out)."""
        return sum(map(len, self._out))

    def buffers_to_send(self) -> list[bytes]:
        """The bytes queued to write, taken out as the buffers they were queued in.

        For ``socket.sendmsg``: what `data_to_send` would join, in order, not joined.
        """
        out, self._out = self._out, []
        return out

    def _open(self, stream_id: int) -> _Stream:
        if self.closed:
            raise ProtocolError("the connection is closed")
        stream = self.streams.get(stream_id)
        if stream is None or not stream.local_open:
            raise StreamClosedError(stream_id)
        return stream

    def send_headers(
        self, stream_id: int, headers: Sequence[tuple[bytes, bytes]], end_stream: bool = False
    ) -> None:
        """Queue a header block (response headers, or trailers with *end_stream*)."""
        stream = self._open(stream_id)
        block = self.encoder.encode(headers)
        size = self.max_outbound_frame_size
        end = _END_STREAM if end_stream else 0
        if len(block) <= size:
            self._out.append(_frame(_HEADERS, end | _END_HEADERS, stream_id, block))
        else:
            chunks = [block[i : i + size] for i in range(0, len(block), size)]
            self._out.append(_frame(_HEADERS, end, stream_id, chunks[0]))
            for chunk in chunks[1:-1]:
                self._out.append(_frame(_CONTINUATION, 0, stream_id, chunk))
            self._out.append(_frame(_CONTINUATION, _END_HEADERS, stream_id, chunks[-1]))
        if end_stream:
            self._end_local(stream_id, stream)

    def send_data(
        self, stream_id: int, data: bytes, end_stream: bool = False, prefix: bytes = b""
    ) -> None:
        """Queue one DATA frame; it must fit the client's windows and frame size.

        *prefix* (gRPC's message prefix) goes before *data* in the same frame: the
        payload is queued as it is, not copied into one with it.
        """
        stream = self._open(stream_id)
        n = len(prefix) + len(data)
        if n > self._outbound or n > stream.outbound or n > self.max_outbound_frame_size:
            raise FlowControlError(
                f"{n} bytes exceed the client's window or frame size", FLOW_CONTROL_ERROR
            )
        self._outbound -= n
        stream.outbound -= n
        flags = _END_STREAM if end_stream else 0
        head = _HEAD.pack(n >> 16, n & 0xFFFF, _DATA, flags, stream_id)
        # Joined once, with everything else queued, by data_to_send.
        self._out += (head + prefix, data)
        if end_stream:
            self._end_local(stream_id, stream)

    def _end_local(self, stream_id: int, stream: _Stream) -> None:
        stream.local_open = False
        if not stream.remote_open:
            del self.streams[stream_id]

    def local_flow_control_window(self, stream_id: int) -> int:
        """Bytes that may be sent on *stream_id* now (the client's windows)."""
        stream = self.streams.get(stream_id)
        if stream is None:
            raise StreamClosedError(stream_id)
        return min(self._outbound, stream.outbound)

    def acknowledge_received_data(self, size: int, stream_id: int) -> None:
        """The application took *size* flow-controlled bytes of *stream_id*: hand them back."""
        increment = self._inbound.process(size)
        if increment:
            self._out.append(_frame(_WINDOW_UPDATE, 0, 0, _U32.pack(increment)))
        stream = self.streams.get(stream_id)
        if stream is not None and stream.remote_open:
            increment = stream.inbound.process(size)
            if increment:
                self._out.append(_frame(_WINDOW_UPDATE, 0, stream_id, _U32.pack(increment)))

    def is_open(self, stream_id: int) -> bool:
        """Whether *stream_id* is open in either direction."""
        return stream_id in self.streams

    def reset_stream(self, stream_id: int, error_code: int = NO_ERROR) -> None:
        """Queue RST_STREAM: the stream is closed both ways."""
        if self.closed:
            raise ProtocolError("the connection is closed")
        if self.streams.pop(stream_id, None) is None:
            raise StreamClosedError(stream_id)
        self._out.append(_frame(_RST_STREAM, 0, stream_id, _U32.pack(error_code)))

    def goaway(self, last_stream_id: int, error_code: int = NO_ERROR, data: bytes = b"") -> None:
        """Queue GOAWAY without closing: the streams up to *last_stream_id* may finish."""
        payload = _GOAWAY_HEAD.pack(last_stream_id, error_code) + data
        self._out.append(_frame(_GOAWAY, 0, 0, payload))

    def close_connection(
        self,
        error_code: int = NO_ERROR,
        additional_data: bytes | None = None,
        last_stream_id: int | None = None,
    ) -> None:
        """Queue GOAWAY and close: nothing more is sent or taken."""
        if last_stream_id is None:
            last_stream_id = self.highest_inbound_stream_id
        self.goaway(last_stream_id, error_code, additional_data or b"")
        self.closed = True

    # -- receiving --

    def receive_data(self, data: bytes) -> list[Any]:
        """Take bytes read from the client; the events they make, in order.

        Raises:
            ProtocolError: A connection error (its ``error_code`` says which).
        """
        buffer = self._buffer
        if self.closed:
            # After GOAWAY either way nothing more is taken, nor kept.
            buffer.clear()
            return []
        if self._preface and not buffer:
            # Nothing left over from the last read (the usual case): the frames are cut
            # from the bytes read as they are, and only an unfinished frame is kept.
            return self._frames(data)
        buffer += data
        if not self._preface:
            if len(buffer) < len(PREFACE):
                if not PREFACE.startswith(buffer):
                    raise ProtocolError(_not_a_preface(buffer))
                return []
            if not buffer.startswith(PREFACE):
                raise ProtocolError(_not_a_preface(buffer))
            del buffer[: len(PREFACE)]
            self._preface = True
        return self._frames(buffer)

    def _frames(self, source: bytes | bytearray) -> list[Any]:
        # The frames in *source* (the bytes read, or the buffer with them behind what
        # was left over), in order; what is left of an unfinished frame stays in the
        # buffer.
        buffer = self._buffer
        events: list[Any] = []
        pos = 0
        end = len(source)
        view = memoryview(source)
        try:
            while end - pos >= 9 and not self.closed:
                high, low, kind, flags, stream_id = _HEAD.unpack_from(source, pos)
                length = high << 16 | low
                if length > _INBOUND_FRAME_SIZE:
                    raise ProtocolError(
                        f"a frame of {length} bytes is over the {_INBOUND_FRAME_SIZE} taken",
                        FRAME_SIZE_ERROR,
                    )
                if end - pos - 9 < length:
                    break
                payload = bytes(view[pos + 9 : pos + 9 + length])
                pos += 9 + length
                stream_id &= 0x7FFFFFFF
                if not self._greeted:
                    if kind != _SETTINGS or flags & _ACK:
                        raise ProtocolError("the client's first frame must be its SETTINGS")
                    self._greeted = True
                if self._block is not None and kind != _CONTINUATION:
                    raise ProtocolError("a header block was interrupted by another frame")
                if kind == _DATA:
                    self._data(events, flags, stream_id, payload)
                elif kind == _HEADERS:
                    self._headers(events, flags, stream_id, payload)
                elif kind == _CONTINUATION:
                    self._continuation(events, flags, stream_id, payload)
                elif kind == _WINDOW_UPDATE:
                    self._window_update(events, stream_id, payload)
                elif kind == _RST_STREAM:
                    self._rst_stream(events, stream_id, payload)
                elif kind == _SETTINGS:
                    self._settings(events, flags, stream_id, payload)
                elif kind == _PING:
                    self._ping(flags, stream_id, payload)
                elif kind == _GOAWAY:
                    self._goaway(events, stream_id, payload)
                elif kind == _PRIORITY:
                    if stream_id == 0:
                        raise ProtocolError("PRIORITY on stream 0")
                    if length != 5:
                        # A stream error (RFC 9113 6.3): the other streams go on.
                        self._stream_error(events, stream_id, FRAME_SIZE_ERROR)
                elif kind == _PUSH_PROMISE:
                    raise ProtocolError("a client may not send PUSH_PROMISE")
                # Other types are extensions: ignored (RFC 9113 4.1).
        finally:
            if not self.closed and source is not buffer and pos < end:
                buffer += view[pos:]
            view.release()
            if self.closed:
                buffer.clear()
            elif source is buffer:
                del buffer[:pos]
        return events

    def _stream_error(self, events: list[Any], stream_id: int, error_code: int) -> None:
        # The stream alone fails: reset it, and tell the application as h2 did.
        if self.streams.pop(stream_id, None) is not None:
            events.append(StreamReset(stream_id, error_code, False))
        self._out.append(_frame(_RST_STREAM, 0, stream_id, _U32.pack(error_code)))

    def _closed_or_idle(self, stream_id: int, what: str) -> None:
        # A frame for a stream not open: never opened (idle) is a connection error.
        if stream_id > self.highest_inbound_stream_id or not stream_id & 1:
            raise ProtocolError(f"{what} on stream {stream_id}, which was never opened")

    def _data(self, events: list[Any], flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise ProtocolError("DATA on stream 0")
        flow = len(payload)
        if flags & _PADDED:
            if not payload or payload[0] >= flow:
                raise ProtocolError("DATA padding is longer than the frame")
            payload = payload[1 : flow - payload[0]]
        if not self._inbound.consumed(flow):
            raise ProtocolError("the client sent past the connection's window", FLOW_CONTROL_ERROR)
        stream = self.streams.get(stream_id)
        if stream is None or not stream.remote_open:
            self._closed_or_idle(stream_id, "DATA")
            # Still counted against the connection's window: handed back at once.
            increment = self._inbound.process(flow)
            if increment:
                self._out.append(_frame(_WINDOW_UPDATE, 0, 0, _U32.pack(increment)))
            self._stream_error(events, stream_id, STREAM_CLOSED)
            return
        if not stream.inbound.consumed(flow):
            increment = self._inbound.process(flow)
            if increment:
                self._out.append(_frame(_WINDOW_UPDATE, 0, 0, _U32.pack(increment)))
            self._stream_error(events, stream_id, FLOW_CONTROL_ERROR)
            return
        events.append(DataReceived(stream_id, payload, flow))
        if flags & _END_STREAM:
            self._end_remote(events, stream_id, stream)

    def _end_remote(self, events: list[Any], stream_id: int, stream: _Stream) -> None:
        stream.remote_open = False
        events.append(StreamEnded(stream_id))
        if not stream.local_open:
            del self.streams[stream_id]

    def _headers(self, events: list[Any], flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            raise ProtocolError("HEADERS on stream 0")
        start, stop = 0, len(payload)
        if flags & _PADDED:
            if not payload or payload[0] >= stop:
                raise ProtocolError("HEADERS padding is longer than the frame")
            start, stop = 1, stop - payload[0]
        if flags & _PRIORITY_FLAG:
            start += 5
            if start > stop:
                raise ProtocolError("a HEADERS frame's priority is cut short", FRAME_SIZE_ERROR)
        block = payload[start:stop]
        if flags & _END_HEADERS:
            self._header_block(events, flags, stream_id, block)
        else:
            self._block = (stream_id, flags, bytearray(block))

    def _continuation(self, events: list[Any], flags: int, stream_id: int, payload: bytes) -> None:
        if self._block is None or self._block[0] != stream_id:
            raise ProtocolError("CONTINUATION without the header block it continues")
        _, first, block = self._block
        block += payload
        if len(block) > _MAX_HEADER_BLOCK:
            raise ProtocolError(f"a header block over {_MAX_HEADER_BLOCK} bytes", ENHANCE_YOUR_CALM)
        if flags & _END_HEADERS:
            self._block = None
            self._header_block(events, first, stream_id, bytes(block))

    def _header_block(self, events: list[Any], flags: int, stream_id: int, block: bytes) -> None:
        # Decoded whatever becomes of the stream: the dynamic table must follow the client's.
        try:
            headers = cast(list[tuple[bytes, bytes]], self.decoder.decode(block, raw=True))
        except hpack.OversizedHeaderListError:
            raise ProtocolError(
                f"a header list over {MAX_HEADER_LIST_SIZE} bytes", ENHANCE_YOUR_CALM
            ) from None
        except hpack.HPACKError as exc:
            raise ProtocolError(f"bad header block: {exc}", COMPRESSION_ERROR) from None
        stream = self.streams.get(stream_id)
        if stream is not None:
            # Trailers: they end the client's side.
            if not stream.remote_open:
                self._stream_error(events, stream_id, STREAM_CLOSED)
            elif not flags & _END_STREAM:
                # A malformed request (RFC 9113 8.1): that stream alone fails.
                self._stream_error(events, stream_id, PROTOCOL_ERROR)
            else:
                self._end_remote(events, stream_id, stream)
            return
        if not stream_id & 1 or stream_id <= self.highest_inbound_stream_id:
            self._closed_or_idle(stream_id, "HEADERS")
            self._stream_error(events, stream_id, STREAM_CLOSED)
            return
        self.highest_inbound_stream_id = stream_id
        if len(self.streams) >= self._max_streams or self._remote_goaway:
            self._out.append(_frame(_RST_STREAM, 0, stream_id, _U32.pack(REFUSED_STREAM)))
            return
        stream = self.streams[stream_id] = _Stream(
            self._initial_window, self._remote_initial_window
        )
        events.append(RequestReceived(stream_id, headers))
        if flags & _END_STREAM:
            self._end_remote(events, stream_id, stream)

    def _window_update(self, events: list[Any], stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ProtocolError("a WINDOW_UPDATE frame is 4 bytes", FRAME_SIZE_ERROR)
        increment = _U32.unpack(payload)[0] & 0x7FFFFFFF
        if stream_id == 0:
            if increment == 0:
                raise ProtocolError("a WINDOW_UPDATE of 0")
            self._outbound += increment
            if self._outbound > _LARGEST_WINDOW:
                raise ProtocolError("the connection's window overflowed", FLOW_CONTROL_ERROR)
            events.append(WindowUpdated(0, increment))
            return
        stream = self.streams.get(stream_id)
        if stream is None:
            self._closed_or_idle(stream_id, "WINDOW_UPDATE")
            return
        if increment == 0:
            self._stream_error(events, stream_id, PROTOCOL_ERROR)
            return
        stream.outbound += increment
        if stream.outbound > _LARGEST_WINDOW:
            self._stream_error(events, stream_id, FLOW_CONTROL_ERROR)
            return
        events.append(WindowUpdated(stream_id, increment))

    def _rst_stream(self, events: list[Any], stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ProtocolError("a RST_STREAM frame is 4 bytes", FRAME_SIZE_ERROR)
        if stream_id == 0:
            raise ProtocolError("RST_STREAM on stream 0")
        if self.streams.pop(stream_id, None) is None:
            self._closed_or_idle(stream_id, "RST_STREAM")
            return
        events.append(StreamReset(stream_id, _U32.unpack(payload)[0], True))

    def _settings(self, events: list[Any], flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id != 0:
            raise ProtocolError("SETTINGS on a stream")
        if flags & _ACK:
            if payload:
                raise ProtocolError("a SETTINGS ACK with a payload", FRAME_SIZE_ERROR)
            return
        if len(payload) % 6:
            raise ProtocolError("SETTINGS of a length not a multiple of 6", FRAME_SIZE_ERROR)
        for offset in range(0, len(payload), 6):
            key, value = _SETTING.unpack_from(payload, offset)
            if key == _HEADER_TABLE_SIZE:
                # The encoder may use less than the client allows (RFC 7541 4.2): never
                # more than the default, and at most two size updates pending (the
                # smallest and the last), however many SETTINGS the client sends.
                size = min(value, _ENCODER_TABLE_SIZE)
                encoder = self.encoder
                if size != encoder.header_table_size:
                    encoder.header_table_size = size
                    changes = encoder.table_size_changes
                    if len(changes) > 2:
                        encoder.table_size_changes = [min(changes), changes[-1]]
            elif key == _ENABLE_PUSH:
                if value > 1:
                    raise ProtocolError("SETTINGS_ENABLE_PUSH is 0 or 1")
            elif key == _INITIAL_WINDOW_SIZE:
                if value > _LARGEST_WINDOW:
                    raise ProtocolError(
                        "SETTINGS_INITIAL_WINDOW_SIZE over 2^31-1", FLOW_CONTROL_ERROR
                    )
                delta = value - self._remote_initial_window
                self._remote_initial_window = value
                for stream in self.streams.values():
                    stream.outbound += delta
                    if stream.outbound > _LARGEST_WINDOW:
                        raise ProtocolError("a stream's window overflowed", FLOW_CONTROL_ERROR)
            elif key == _MAX_FRAME_SIZE:
                if not _MIN_FRAME_SIZE <= value <= _MAX_FRAME_SIZE_LIMIT:
                    raise ProtocolError("SETTINGS_MAX_FRAME_SIZE out of range")
                self.max_outbound_frame_size = value
        self._out.append(_frame(_SETTINGS, _ACK, 0))
        events.append(RemoteSettingsChanged())

    def _ping(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id != 0:
            raise ProtocolError("PING on a stream")
        if len(payload) != 8:
            raise ProtocolError("a PING frame is 8 bytes", FRAME_SIZE_ERROR)
        if not flags & _ACK:
            self._out.append(_frame(_PING, _ACK, 0, payload))

    def _goaway(self, events: list[Any], stream_id: int, payload: bytes) -> None:
        if stream_id != 0:
            raise ProtocolError("GOAWAY on a stream")
        if len(payload) < 8:
            raise ProtocolError("a GOAWAY frame is at least 8 bytes", FRAME_SIZE_ERROR)
        last, code = _GOAWAY_HEAD.unpack_from(payload)
        if code == NO_ERROR and self.streams:
            # A graceful goodbye: the answers to the streams it opened may still come.
            self._remote_goaway = True
        else:
            self.closed = True
        events.append(ConnectionTerminated(code, last & 0x7FFFFFFF, payload[8:]))


def _not_a_preface(start: bytes | bytearray) -> str:
    """Why a connection that began with *start* (not HTTP/2's preface) is closed."""
    said = "the connection did not start with HTTP/2's preface"
    # A TLS handshake record, version 3.x: a client with TLS on (ssl=True) at a port that
    # serves plaintext, a mistake worth telling apart from a stranger's bytes.
    if len(start) >= 2 and start[0] == 0x16 and start[1] == 0x03:
        return f"{said} (it began a TLS handshake: the client speaks TLS, this port plaintext)"
    return said
