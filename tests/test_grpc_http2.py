"""The gRPC transport's own HTTP/2 frame layer (``_http2``), against h2's client, in memory.

tests/test_grpc_h2.py drives it through the transport over sockets; these
check the frame layer's HTTP/2 where the transport's tests do not reach:
padding, CONTINUATION both ways, the stream limit, flow control both ways
(windows handed back as h2 did, SETTINGS changing open streams' windows),
and malformed frames that must fail the stream or the connection.
"""

from __future__ import annotations

import struct
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.settings
import pytest

from trioinfer.server import _http2

pytestmark = pytest.mark.grpc

REQUEST = [
    (":method", "POST"),
    (":scheme", "http"),
    (":path", "/t.S/M"),
    (":authority", "x"),
    ("content-type", "application/grpc"),
]


def pair(**server: Any) -> tuple[h2.connection.H2Connection, _http2.Connection]:
    client = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=True, header_encoding="latin-1")
    )
    conn = _http2.Connection(**server)
    conn.initiate_connection()
    client.initiate_connection()
    to_server(client, conn)
    to_client(conn, client)
    return client, conn


def to_server(client: h2.connection.H2Connection, conn: _http2.Connection) -> list[Any]:
    return conn.receive_data(client.data_to_send())


def to_client(conn: _http2.Connection, client: h2.connection.H2Connection) -> list[Any]:
    return client.receive_data(conn.data_to_send())


def frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    return (
        struct.pack(">I", len(payload))[1:]
        + bytes((kind, flags))
        + struct.pack(">I", stream_id)
        + payload
    )


def test_a_call_round_trips_with_padding_and_continuation() -> None:
    client, conn = pair()
    # A header block over the server's 16 KiB frame size: HEADERS and CONTINUATION.
    big = "v" * 20000
    client.send_headers(1, [*REQUEST, ("x-big", big)])
    client.send_data(1, b"hello", end_stream=True, pad_length=10)
    events = to_server(client, conn)
    kinds = [type(e) for e in events]
    assert kinds == [_http2.RequestReceived, _http2.DataReceived, _http2.StreamEnded]
    assert dict(events[0].headers)[b"x-big"] == big.encode()
    assert events[1].data == b"hello"
    assert events[1].flow_controlled_length == 5 + 10 + 1
    # The answer's headers, over the client's frame size too, then data and trailers.
    conn.send_headers(1, [(b":status", b"200"), (b"x-big", big.encode())])
    conn.send_data(1, b"world")
    conn.send_headers(1, [(b"grpc-status", b"0")], end_stream=True)
    got = to_client(conn, client)
    response = next(e for e in got if isinstance(e, h2.events.ResponseReceived))
    assert dict(response.headers)["x-big"] == big
    assert [e.data for e in got if isinstance(e, h2.events.DataReceived)] == [b"world"]
    assert any(isinstance(e, h2.events.StreamEnded) for e in got)
    # Closed both ways: forgotten, and no more sends.
    assert not conn.is_open(1)
    with pytest.raises(_http2.StreamClosedError):
        conn.send_data(1, b"late")


def test_streams_over_the_limit_are_refused() -> None:
    client, conn = pair(max_streams=2)
    for sid in (1, 3):
        client.send_headers(sid, REQUEST)
    events = to_server(client, conn)
    # h2's client keeps to the limit; a client that does not: ":method: GET" etc., indexed.
    events += conn.receive_data(frame(0x1, 0x4, 5, b"\x82\x86\x84"))
    assert [e.stream_id for e in events if isinstance(e, _http2.RequestReceived)] == [1, 3]
    assert conn.data_to_send() == frame(0x3, 0, 5, struct.pack(">I", _http2.REFUSED_STREAM))
    assert not conn.is_open(5)


def test_windows_are_handed_back_as_data_is_acknowledged() -> None:
    client, conn = pair(initial_window=1000)
    client.send_headers(1, REQUEST)
    client.send_data(1, b"x" * 400)
    to_server(client, conn)
    # Under half the stream's window: nothing handed back yet.
    conn.acknowledge_received_data(400, 1)
    assert conn.data_to_send() == b""
    client.send_data(1, b"x" * 200)
    to_server(client, conn)
    conn.acknowledge_received_data(200, 1)
    got = to_client(conn, client)
    (update,) = [e for e in got if isinstance(e, h2.events.WindowUpdated)]
    assert (update.stream_id, update.delta) == (1, 600)


def test_a_client_past_its_stream_window_fails_that_stream_only() -> None:
    client, conn = pair(initial_window=10)
    client.send_headers(1, REQUEST)
    to_server(client, conn)
    events = conn.receive_data(frame(0x0, 0, 1, b"x" * 11))
    (reset,) = events
    assert isinstance(reset, _http2.StreamReset)
    assert (reset.error_code, reset.remote_reset) == (_http2.FLOW_CONTROL_ERROR, False)
    assert not conn.is_open(1)
    # The connection goes on: another stream is served.
    client.send_headers(3, REQUEST, end_stream=True)
    assert [type(e) for e in to_server(client, conn)] == [
        _http2.RequestReceived,
        _http2.StreamEnded,
    ]


def test_sends_respect_the_clients_windows_and_settings() -> None:
    client, conn = pair()
    client.send_headers(1, REQUEST, end_stream=True)
    to_server(client, conn)
    conn.send_headers(1, [(b":status", b"200")])
    assert conn.local_flow_control_window(1) == 65535
    # The client shrinks its initial window: open streams' windows follow.
    client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 100})
    events = to_server(client, conn)
    assert any(isinstance(e, _http2.RemoteSettingsChanged) for e in events)
    assert conn.local_flow_control_window(1) == 100
    with pytest.raises(_http2.FlowControlError):
        conn.send_data(1, b"x" * 101)
    conn.send_data(1, b"x" * 100)
    assert conn.local_flow_control_window(1) == 0
    to_client(conn, client)
    client.increment_flow_control_window(50, stream_id=1)
    events = to_server(client, conn)
    assert [(e.stream_id, e.delta) for e in events if isinstance(e, _http2.WindowUpdated)] == [
        (1, 50)
    ]
    assert conn.local_flow_control_window(1) == 50


def test_ping_is_answered_and_goaway_closes() -> None:
    client, conn = pair()
    client.ping(b"12345678")
    assert to_server(client, conn) == []
    got = to_client(conn, client)
    assert [e.ping_data for e in got if isinstance(e, h2.events.PingAckReceived)] == [b"12345678"]
    client.close_connection()
    (terminated,) = to_server(client, conn)
    assert isinstance(terminated, _http2.ConnectionTerminated)
    assert conn.closed
    with pytest.raises(_http2.ProtocolError):
        conn.send_headers(1, [(b":status", b"200")])


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (frame(0x9, 0x4, 1, b"\x82"), _http2.PROTOCOL_ERROR),  # CONTINUATION alone
        (frame(0x8, 0, 0, b"\x00\x00\x00\x00"), _http2.PROTOCOL_ERROR),  # WINDOW_UPDATE 0
        (frame(0x8, 0, 0, b"\x7f\xff\xff\xff"), _http2.FLOW_CONTROL_ERROR),  # overflow
        (frame(0x4, 0, 0, b"\x00\x04\x80\x00\x00\x00"), _http2.FLOW_CONTROL_ERROR),
        (frame(0x4, 0, 0, b"\x00\x05\x00\x00\x00\x01"), _http2.PROTOCOL_ERROR),  # frame size
        (frame(0x4, 0, 0, b"\x00\x01\x00"), _http2.FRAME_SIZE_ERROR),
        (frame(0x3, 0, 7, b"\x00\x00\x00\x08"), _http2.PROTOCOL_ERROR),  # reset of idle
        (frame(0x5, 0x4, 1, b"\x00\x00\x00\x02\x82"), _http2.PROTOCOL_ERROR),  # PUSH_PROMISE
        (frame(0x1, 0x5 | 0x8, 1, b"\x05\x82"), _http2.PROTOCOL_ERROR),  # padding too long
    ],
    ids=[
        "lone-continuation",
        "window-update-0",
        "window-overflow",
        "initial-window-too-large",
        "max-frame-size-too-small",
        "settings-length",
        "reset-idle-stream",
        "push-promise",
        "headers-padding",
    ],
)
def test_malformed_frames_are_connection_errors(raw: bytes, code: int) -> None:
    _, conn = pair()
    with pytest.raises(_http2.ProtocolError) as caught:
        conn.receive_data(raw)
    assert caught.value.error_code == code


def test_a_header_block_cannot_grow_without_bound() -> None:
    _, conn = pair()
    conn.receive_data(frame(0x1, 0, 1, b"\x82"))
    chunk = frame(0x9, 0, 1, b"\x00" * 16384)
    with pytest.raises(_http2.ProtocolError) as caught:
        conn.receive_data(chunk * 20)
    assert caught.value.error_code == _http2.ENHANCE_YOUR_CALM


def test_data_after_the_stream_closed_keeps_the_connection_window() -> None:
    client, conn = pair()
    client.send_headers(1, REQUEST)
    to_server(client, conn)
    conn.send_headers(1, [(b":status", b"200")], end_stream=True)
    conn.reset_stream(1)
    conn.data_to_send()
    # The client's DATA crossed the reset: refused, and its bytes handed back to the
    # connection's window once half of it was used, so later streams are not starved.
    for _ in range(5):
        assert conn.receive_data(frame(0x0, 0, 1, b"x" * 16384)) == []
    out = conn.data_to_send()
    assert frame(0x3, 0, 1, struct.pack(">I", _http2.STREAM_CLOSED)) in out
    assert frame(0x8, 0, 0, struct.pack(">I", 32768)) in out


def test_the_clients_header_table_size_is_followed() -> None:
    client, conn = pair()
    client.send_headers(1, REQUEST, end_stream=True)
    to_server(client, conn)
    # The client shrinks its HPACK table to nothing: the answer must say so first.
    client.update_settings({h2.settings.SettingCodes.HEADER_TABLE_SIZE: 0})
    to_server(client, conn)
    conn.send_headers(1, [(b":status", b"200"), (b"x-a", b"b")], end_stream=True)
    got = to_client(conn, client)
    response = next(e for e in got if isinstance(e, h2.events.ResponseReceived))
    assert dict(response.headers)["x-a"] == "b"


def test_a_flood_of_header_table_sizes_keeps_the_encoder_small() -> None:
    # Each SETTINGS_HEADER_TABLE_SIZE change is a pending update in the next header
    # block; a client alternating sizes once grew that list (and the block) without
    # bound and stalled the loop encoding it. The encoder now uses at most 4 KiB,
    # whatever the client allows (RFC 7541 4.2), and keeps two pending updates.
    client, conn = pair()
    client.send_headers(1, REQUEST, end_stream=True)
    to_server(client, conn)
    sizes = b"".join(struct.pack(">HL", 0x1, 100_000 + i % 2) for i in range(2730))
    for _ in range(10):
        conn.receive_data(frame(0x4, 0, 0, sizes))
    conn.receive_data(frame(0x4, 0, 0, struct.pack(">HL", 0x1, 0)))
    assert conn.encoder.header_table_size == 0
    assert len(conn.encoder.table_size_changes) <= 2
    conn.data_to_send()
    conn.send_headers(1, [(b":status", b"200"), (b"x-a", b"b")], end_stream=True)
    block = conn.data_to_send()
    assert len(block) < 100
    got = client.receive_data(block)
    response = next(e for e in got if isinstance(e, h2.events.ResponseReceived))
    assert dict(response.headers)["x-a"] == "b"
    client.update_settings({h2.settings.SettingCodes.HEADER_TABLE_SIZE: 1 << 30})
    to_server(client, conn)
    assert conn.encoder.header_table_size == 4096


def test_nothing_is_kept_after_goaway() -> None:
    # Bytes that follow a GOAWAY (the client's, or one of ours) are dropped, not
    # buffered: a client may not fill the server's memory after it.
    client, conn = pair()
    client.close_connection()
    to_server(client, conn)
    partial = frame(0x0, 0, 1, b"x" * 100)[:50]
    for _ in range(100):
        assert conn.receive_data(partial) == []
    assert len(conn._buffer) == 0
    _, conn = pair()
    conn.close_connection()
    assert conn.receive_data(frame(0x6, 0, 0, b"12345678") + partial) == []
    assert len(conn._buffer) == 0


def test_the_clients_first_frame_must_be_settings() -> None:
    conn = _http2.Connection()
    conn.initiate_connection()
    with pytest.raises(_http2.ProtocolError, match="first frame must be its SETTINGS"):
        conn.receive_data(_http2.PREFACE + frame(0x6, 0, 0, b"12345678"))
    conn = _http2.Connection()
    with pytest.raises(_http2.ProtocolError):  # a SETTINGS ack is no greeting either
        conn.receive_data(_http2.PREFACE + frame(0x4, 0x1, 0, b""))


def test_a_tls_client_on_a_plaintext_port_is_told_apart() -> None:
    # A ClientHello's first bytes (a TLS handshake record), from a client with ssl=True
    # against a port that serves plaintext: the log says which mistake it is.
    hello = bytes([0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xFC, 0x03, 0x03])
    for data in (hello, hello + bytes(64)):
        with pytest.raises(_http2.ProtocolError, match=r"speaks TLS.*plaintext"):
            _http2.Connection().receive_data(data)
    with pytest.raises(_http2.ProtocolError) as caught:
        _http2.Connection().receive_data(b"GET / HTTP/1.1\r\n")
    assert "TLS" not in str(caught.value)


def test_malformed_stream_frames_fail_their_stream_only() -> None:
    client, conn = pair()
    client.send_headers(1, REQUEST)
    client.send_headers(3, REQUEST)
    to_server(client, conn)
    conn.data_to_send()
    # Trailers without END_STREAM (RFC 9113 8.1) on 1, a PRIORITY of 4 bytes on 3 (6.3).
    trailers = client.encoder.encode([("x-t", "1")])
    events = conn.receive_data(frame(0x1, 0x4, 1, trailers) + frame(0x2, 0, 3, b"\x00" * 4))
    assert [(type(e), e.stream_id, e.error_code) for e in events] == [
        (_http2.StreamReset, 1, _http2.PROTOCOL_ERROR),
        (_http2.StreamReset, 3, _http2.FRAME_SIZE_ERROR),
    ]
    out = conn.data_to_send()
    assert frame(0x3, 0, 1, struct.pack(">I", _http2.PROTOCOL_ERROR)) in out
    assert frame(0x3, 0, 3, struct.pack(">I", _http2.FRAME_SIZE_ERROR)) in out
    # The connection goes on.
    client.send_headers(5, REQUEST, end_stream=True)
    received, _ = to_server(client, conn)
    assert isinstance(received, _http2.RequestReceived)
    assert received.stream_id == 5
    assert not conn.closed


def test_a_graceful_goaway_lets_open_streams_finish() -> None:
    client, conn = pair()
    client.send_headers(1, REQUEST, end_stream=True)
    to_server(client, conn)
    conn.data_to_send()
    # GOAWAY(NO_ERROR) with stream 1 open: its answer may still go out.
    (terminated,) = conn.receive_data(frame(0x7, 0, 0, struct.pack(">LL", 0, 0)))
    assert isinstance(terminated, _http2.ConnectionTerminated)
    assert not conn.closed
    # A stream opened after it is refused; stream 1 is answered.
    assert conn.receive_data(frame(0x1, 0x5, 3, client.encoder.encode(REQUEST))) == []
    assert frame(0x3, 0, 3, struct.pack(">I", _http2.REFUSED_STREAM)) in conn.data_to_send()
    conn.send_headers(1, [(b":status", b"200")])
    conn.send_data(1, b"answer")
    conn.send_headers(1, [(b"grpc-status", b"0")], end_stream=True)
    got = to_client(conn, client)
    assert [e.data for e in got if isinstance(e, h2.events.DataReceived)] == [b"answer"]
    # With an error code, the client has given up: nothing more either way.
    client, conn = pair()
    client.send_headers(1, REQUEST, end_stream=True)
    to_server(client, conn)
    conn.receive_data(frame(0x7, 0, 0, struct.pack(">LL", 0, _http2.PROTOCOL_ERROR)))
    assert conn.closed


def test_frames_cut_anywhere_between_reads_arrive_whole() -> None:
    # Frames are cut from each read as it is while nothing is left over, and from the
    # buffer behind what was: wherever the reads split the frames, the same events.
    client, conn = pair()
    client.send_headers(1, REQUEST)
    to_server(client, conn)
    body = bytes(range(256)) * 100  # 25,600 bytes: DATA frames of 16 KiB and the rest
    client.send_data(1, body[:16384])
    client.send_data(1, body[16384:20000], pad_length=7)
    client.send_data(1, body[20000:], end_stream=True)
    wire = client.data_to_send()
    for cuts in (
        [],
        [1],
        [5, 9, 10],
        [16392, 16393],
        [16400, 20050],
        list(range(0, len(wire), 997)),
    ):
        _, conn = pair()
        events = conn.receive_data(frame(0x1, 0x4, 1, b"\x83\x86\x84"))  # POST, http, /
        assert [type(e) for e in events] == [_http2.RequestReceived]
        for start, stop in zip([0, *cuts], [*cuts, len(wire)], strict=True):
            events += conn.receive_data(wire[start:stop])
        data = [e for e in events if isinstance(e, _http2.DataReceived)]
        assert b"".join(e.data for e in data) == body, cuts
        assert [e.flow_controlled_length for e in data] == [16384, 3616 + 8, 5600], cuts
        assert isinstance(events[-1], _http2.StreamEnded), cuts


def test_a_data_frame_with_a_prefix_is_one_frame_charged_both() -> None:
    client, conn = pair()
    client.send_headers(1, REQUEST, end_stream=True)
    to_server(client, conn)
    conn.send_headers(1, [(b":status", b"200")])
    conn.send_data(1, b"message", prefix=b"\x00\x00\x00\x00\x07")
    assert conn.local_flow_control_window(1) == 65535 - 12
    got = to_client(conn, client)
    assert [e.data for e in got if isinstance(e, h2.events.DataReceived)] == [
        b"\x00\x00\x00\x00\x07message"
    ]
    # The prefix counts against the frame size and the windows as the data does.
    with pytest.raises(_http2.FlowControlError):
        conn.send_data(1, b"x" * (conn.max_outbound_frame_size - 4), prefix=b"12345")


def test_buffers_to_send_are_what_data_to_send_would_join() -> None:
    # The buffers a sendmsg writes, in order, are the bytes data_to_send returns.
    client, conn = pair()
    client.send_headers(1, REQUEST, end_stream=True)
    to_server(client, conn)
    conn.send_headers(1, [(b":status", b"200")])
    conn.send_data(1, b"x" * 5000)
    conn.send_headers(1, [(b"grpc-status", b"0")], end_stream=True)
    buffers = conn.buffers_to_send()
    assert len(buffers) == 4  # HEADERS, DATA's head apart from its payload, trailers
    assert conn.buffers_to_send() == []
    assert conn.data_to_send() == b""
    events = client.receive_data(b"".join(buffers))
    data = b"".join(e.data for e in events if isinstance(e, h2.events.DataReceived))
    assert data == b"x" * 5000
    assert any(isinstance(e, h2.events.StreamEnded) for e in events)
