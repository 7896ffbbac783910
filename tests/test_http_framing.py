"""HTTP/1.1 framing with no socket: bytes in, requests (or the error to answer) out.

The framing is the part of the server that decides where a request starts and
ends and whether it may be served at all; these tests feed it bytes and look
at what it made. The same rules are tried over real sockets, on Trio and
asyncio, in ``test_http_hostile.py``.
"""

from __future__ import annotations

import pytest

from trioinfer.server._framing import (
    _HEAD_CACHE,
    FramingError,
    RequestFraming,
    RequestHead,
    date_header,
    encode_response_head,
    error_response,
    frame_body,
)


def framing(**options: int) -> RequestFraming:
    settings = {"max_head_bytes": 4096, "max_headers": 20, **options}
    return RequestFraming(**settings)


def parse(data: bytes, **options: int) -> tuple[list[RequestHead], FramingError | None]:
    """Every request in *data*, taking each as a connection would, and the error if any."""
    f = framing(**options)
    f.receive_data(data)
    heads = []
    while (head := f.next_request()) is not None:
        heads.append(head)
    return heads, f.error


def refused(data: bytes, **options: int) -> FramingError:
    heads, error = parse(data, **options)
    assert error is not None, f"accepted: {[h.url for h in heads]}"
    assert heads == [], "nothing of a refused request may be served"
    return error


GET = b"GET /a?b=1 HTTP/1.1\r\nHost: example.com\r\nX-Thing: Value\r\n\r\n"


# -- what a request looks like ---------------------------------------------------------------------


def test_a_request_head_and_its_fields() -> None:
    (head,), error = parse(GET)
    assert error is None
    assert head.method == b"GET"
    assert head.url == b"/a?b=1"
    assert head.http_version == "1.1"
    assert head.headers == [(b"host", b"example.com"), (b"x-thing", b"Value")]
    assert head.keep_alive
    assert head.complete
    assert head.body == []


def test_the_body_arrives_after_the_head_in_pieces() -> None:
    f = framing()
    f.receive_data(b"POST /p HTTP/1.1\r\nHost: h\r\nContent-Length: 10\r\n\r\nabc")
    head = f.next_request()
    assert head is not None
    assert (head.body, head.complete, head.remaining) == ([b"abc"], False, 7)
    assert f.in_request
    assert not f.in_head
    f.receive_data(b"defghij")
    assert (b"".join(head.body), head.complete) == (b"abcdefghij", True)
    assert not f.in_request


def test_a_chunked_body_loses_its_framing_and_trailers_are_not_headers() -> None:
    (head,), error = parse(
        b"POST /c HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;name=value\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n"
    )
    assert error is None
    assert head.chunked
    assert b"".join(head.body) == b"hello world"
    assert (b"x-trailer", b"t") not in head.headers


def test_http10_needs_no_host_and_closes_by_default() -> None:
    (head,), error = parse(b"GET / HTTP/1.0\r\n\r\n")
    assert error is None
    assert head.http_version == "1.0"
    assert not head.keep_alive


def test_expect_100_continue_is_noted() -> None:
    (head,), _ = parse(
        b"POST / HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\n"
    )
    assert head.expect_continue


def test_an_upgrade_is_the_last_request_and_closes() -> None:
    f = framing()
    f.receive_data(
        b"GET /ws HTTP/1.1\r\nHost: h\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
        b"\x81\x00not http"
    )
    head = f.next_request()
    assert head is not None
    assert head.url == b"/ws"
    assert not head.keep_alive
    assert f.upgraded
    assert f.stopped
    assert f.error is None
    f.receive_data(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
    assert f.next_request() is None


# -- pipelining: bytes stay bytes ------------------------------------------------------------------


def test_parsing_stops_at_the_boundary_after_a_waiting_request() -> None:
    made = 0

    def counting_head() -> RequestHead:
        nonlocal made
        made += 1
        return RequestHead()

    f = RequestFraming(max_head_bytes=4096, max_headers=20, make_head=counting_head)
    one = b"GET / HTTP/1.1\r\nHost: h\r\n\r\n"
    f.receive_data(one * 10_000)
    # Only what one step of the parser holds became objects; the rest is bytes.
    assert made <= 4096 // len(one) + 1
    assert f.buffered > len(one) * 9_000
    taken = 0
    while f.next_request() is not None:
        taken += 1
        assert made - taken <= 4096 // len(one) + 2  # never more than one step ahead
    assert taken == 10_000
    assert f.buffered == 0


def test_a_large_body_is_parsed_in_one_piece_not_in_steps() -> None:
    body = b"x" * 200_000
    f = framing()
    f.receive_data(b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 200000\r\n\r\n" + body)
    head = f.next_request()
    assert head is not None
    assert head.complete
    assert b"".join(head.body) == body
    assert len(head.body) <= 3


def test_a_pipelined_body_is_parsed_when_its_request_is_taken() -> None:
    f = framing()
    second = b"POST /2 HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\n\r\nxyz"
    f.receive_data(GET * 1000 + second + GET)
    for _ in range(1000):
        assert f.next_request() is not None
    assert f.has_request
    taken = f.next_request()
    assert taken is not None
    assert taken.url == b"/2"
    assert taken.complete
    assert taken.body == [b"xyz"]
    last = f.next_request()
    assert last is not None
    assert last.url == b"/a?b=1"
    assert f.next_request() is None
    assert not f.has_request
    assert f.buffered == 0


def test_a_discarded_body_is_counted_not_kept() -> None:
    f = framing()
    f.receive_data(b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 10\r\n\r\nab")
    head = f.next_request()
    assert head is not None
    head.discard = True
    f.receive_data(b"cdefghij")
    assert head.body == [b"ab"]
    assert f.discarded == 8


# -- Host (RFC 9112 section 3.2) -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"GET / HTTP/1.1\r\n\r\n", "must have a Host header"),
        (b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", "more than one Host"),
        (b"GET / HTTP/1.1\r\nHost: a\r\nHost: a\r\n\r\n", "more than one Host"),
        (b"GET / HTTP/1.0\r\nHost: a\r\nHost: b\r\n\r\n", "more than one Host"),
        (b"GET / HTTP/1.1\r\nHost: a b\r\n\r\n", "not a valid host"),
        (b"GET / HTTP/1.1\r\nHost: a/b\r\n\r\n", "not a valid host"),
        (b"GET / HTTP/1.1\r\nHost: a:b\r\n\r\n", "not a valid host"),
        (b"GET / HTTP/1.1\r\nHost: a@b\r\n\r\n", "not a valid host"),
    ],
)
def test_host_rules(data: bytes, reason: str) -> None:
    error = refused(data)
    assert error.status == 400
    assert reason in error.reason


@pytest.mark.parametrize(
    "host", [b"", b"example.com", b"example.com:8000", b"127.0.0.1:1", b"[::1]:80", b"xn--b-e.c"]
)
def test_valid_hosts(host: bytes) -> None:
    (head,), error = parse(b"GET / HTTP/1.1\r\nHost: " + host + b"\r\n\r\n")
    assert error is None
    assert head.headers == [(b"host", host)]


# -- request smuggling: where a request ends must never be ambiguous -------------------------------


SMUGGLING = {
    "cl-and-te": b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n",
    "te-and-cl": b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n",
    "te-chunked-identity": b"Transfer-Encoding: chunked, identity\r\n",
    "te-identity-chunked": b"Transfer-Encoding: identity, chunked\r\n",
    "te-identity": b"Transfer-Encoding: identity\r\n",
    "te-xchunked": b"Transfer-Encoding: xchunked\r\n",
    "te-twice": b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n",
    "te-space-before-colon": b"Transfer-Encoding : chunked\r\n",
    "te-folded": b"Transfer-Encoding:\r\n chunked\r\n",
    "te-space-and-cl": b"Transfer-Encoding:  chunked\r\nContent-Length: 5\r\n",
    "te-tab-and-cl": b"Transfer-Encoding:\tchunked\r\nContent-Length: 5\r\n",
    "cl-twice-same": b"Content-Length: 5\r\nContent-Length: 5\r\n",
    "cl-twice-differing": b"Content-Length: 5\r\nContent-Length: 6\r\n",
    "cl-list": b"Content-Length: 5, 6\r\n",
    "cl-plus": b"Content-Length: +5\r\n",
    "cl-minus": b"Content-Length: -5\r\n",
    "cl-inner-space": b"Content-Length: 5 0\r\n",
    "cl-hex": b"Content-Length: 0x5\r\n",
    "cl-overflow": b"Content-Length: 99999999999999999999999\r\n",
    "cl-space-before-colon": b"Content-Length : 5\r\n",
}


@pytest.mark.parametrize("fields", SMUGGLING.values(), ids=SMUGGLING.keys())
def test_ambiguous_framing_is_refused(fields: bytes) -> None:
    data = b"POST / HTTP/1.1\r\nHost: h\r\n" + fields + b"\r\n0\r\n\r\n" + GET
    assert refused(data).status == 400


def test_transfer_encoding_in_http10_is_refused() -> None:
    error = refused(b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
    assert (error.status, error.reason) == (
        400,
        "an HTTP/1.0 request may not have a Transfer-Encoding",
    )


def test_lenient_but_unambiguous_framing_is_accepted() -> None:
    # Whitespace around a field value is not part of it (RFC 9110 section 5.5).
    (head,), error = parse(
        b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding:  CHUNKED \r\n\r\n1\r\nx\r\n0\r\n\r\n"
    )
    assert error is None
    assert b"".join(head.body) == b"x"
    (head,), error = parse(b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length:  1 \r\n\r\nx")
    assert error is None
    assert b"".join(head.body) == b"x"


@pytest.mark.parametrize(
    "data",
    [
        b"GET / HTTP/1.1\nHost: h\n\n",  # bare LF
        b"GET / HTTP/1.1\r\nHost: h\r\nX: a\rb\r\n\r\n",  # bare CR
        b"GET / HTTP/1.1\r\nHost: h\r\nX: a\x00b\r\n\r\n",  # NUL
        b"GET /a b HTTP/1.1\r\nHost: h\r\n\r\n",  # space in the target
    ],
    ids=["bare-lf", "bare-cr", "nul", "space-in-target"],
)
def test_malformed_lines_are_refused(data: bytes) -> None:
    error = refused(data)
    assert error.status == 400
    assert error.reason.startswith("the request is malformed: ")


@pytest.mark.parametrize(
    "chunks",
    [b"1\nx\n0\n\n", b"1 \r\nx\r\n0\r\n\r\n", b"fffffffffffffffff\r\n", b"zz\r\nabc\r\n"],
    ids=["bare-lf", "space-after-size", "size-overflow", "not-hex"],
)
def test_malformed_chunks_end_the_request_unfinished(chunks: bytes) -> None:
    # The head was handed out already; its body never completes (the app
    # gets http.disconnect) and the error is what the client is told.
    (head,), error = parse(
        b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks + GET
    )
    assert not head.complete
    assert error is not None
    assert error.status == 400


@pytest.mark.parametrize(
    "data", [b"GET / HTTP/2.0\r\nHost: h\r\n\r\n", b"GET /\r\n\r\n"], ids=["2.0", "0.9"]
)
def test_other_http_versions_get_505(data: bytes) -> None:
    assert refused(data).status == 505


def test_requests_before_an_error_are_served_and_nothing_after() -> None:
    f = framing()
    f.receive_data(GET + b"NOT HTTP\r\n\r\n" + GET)
    assert f.next_request() is not None
    assert f.next_request() is None
    assert f.error is not None
    assert f.error.status == 400
    f.receive_data(GET)
    assert f.next_request() is None


# -- bounded heads, chunk framing and trailers -----------------------------------------------------


def test_a_long_target_gets_431() -> None:
    error = refused(b"GET /" + b"u" * 5000 + b" HTTP/1.1\r\nHost: h\r\n\r\n")
    assert error.status == 431


def test_a_long_header_gets_431() -> None:
    assert refused(b"GET / HTTP/1.1\r\nHost: h\r\nX: " + b"v" * 5000 + b"\r\n\r\n").status == 431


def test_too_many_headers_get_431() -> None:
    fields = b"".join(b"X-%d: v\r\n" % i for i in range(20))
    error = refused(b"GET / HTTP/1.1\r\nHost: h\r\n" + fields + b"\r\n")
    assert (error.status, error.reason) == (431, "the request has more than 20 header fields")


def test_a_header_that_never_ends_is_cut_off() -> None:
    f = framing()
    f.receive_data(b"GET / HTTP/1.1\r\nHost: h\r\nX-Endless: ")
    for _ in range(10):
        f.receive_data(b"v" * 1000)
        if f.error is not None:
            break
    assert f.error is not None
    assert f.error.status == 431


def test_an_endless_chunk_extension_is_cut_off() -> None:
    f = framing()
    f.receive_data(b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n1;ext=")
    fed = 0
    while f.error is None and fed < 10 * 2**20:
        f.receive_data(b"a" * 65536)
        fed += 65536
    assert f.error is not None
    assert (f.error.status, f.error.reason) == (
        400,
        "the chunked framing (chunk extensions or trailers) is too large",
    )
    assert fed <= 2 * 65536


def test_chunk_extensions_may_not_outgrow_the_body() -> None:
    # Every chunk carries a byte of body and a kilobyte of extension.
    f = framing()
    f.receive_data(b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunks = 0
    while f.error is None and chunks < 10_000:
        f.receive_data(b"1;e=" + b"a" * 1024 + b"\r\nx\r\n")
        chunks += 1
    assert f.error is not None
    assert f.error.status == 400
    assert chunks < 100


def test_endless_trailers_are_cut_off() -> None:
    f = framing()
    f.receive_data(
        b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n"
    )
    fed = 0
    while f.error is None and fed < 2**20:
        f.receive_data(b"X-T: " + b"v" * 100 + b"\r\n")
        fed += 107
    assert f.error is not None
    assert f.error.status == 431


def test_small_chunks_with_short_extensions_are_fine() -> None:
    body = b"".join(b"1;a=b\r\n%c\r\n" % (65 + i % 26) for i in range(5000))
    (head,), error = parse(
        b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n" + body + b"0\r\n\r\n"
    )
    assert error is None
    assert len(b"".join(head.body)) == 5000


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_head_bytes > 0"):
        RequestFraming(max_head_bytes=0, max_headers=1)


# -- responses -----------------------------------------------------------------------------------


DATE = b"date: Thu, 01 Jan 1970 00:00:00 GMT\r\n"


def head(status: int = 200, headers: list[tuple[bytes, bytes]] | None = None, **options: object):  # type: ignore[no-untyped-def]
    settings: dict[str, object] = {
        "method": b"GET",
        "http_version": "1.1",
        "keep_alive": True,
        "body_length": 2,
        "more": False,
        "date": DATE,
        **options,
    }
    return encode_response_head(status, headers or [], *settings.values())  # type: ignore[arg-type]


def test_a_whole_response_gets_a_content_length() -> None:
    h = head(200, [(b"content-type", b"text/plain")])
    assert h.data == (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 2\r\n" + DATE + b"\r\n"
    )
    assert h.keep_alive
    assert not h.chunked
    assert not h.no_body
    assert frame_body(h, b"hi", False) == b"hi"


def test_a_streamed_response_is_chunked_and_http10_closes_instead() -> None:
    h = head(more=True)
    assert b"transfer-encoding: chunked\r\n" in h.data
    assert h.chunked
    assert frame_body(h, b"abc", True) == b"3\r\nabc\r\n"
    assert frame_body(h, b"", False) == b"0\r\n\r\n"
    h10 = head(more=True, http_version="1.0")
    assert not h10.chunked
    assert not h10.keep_alive
    assert b"connection: close\r\n" in h10.data


def test_bodiless_responses() -> None:
    for status in (204, 304, 101):
        assert head(status).no_body
    h = head(method=b"HEAD")
    assert h.no_body
    assert frame_body(h, b"hi", False) == b""


def test_the_apps_connection_header_is_replaced_by_the_servers_decision() -> None:
    h = head(200, [(b"Connection", b"close")])
    assert not h.keep_alive
    assert h.data.count(b"onnection") == 1
    assert b"connection: close\r\n" in h.data


@pytest.mark.parametrize(
    "headers", [[(b"x", b"a\r\nInjected: yes")], [(b"x\r\n", b"v")], [(b"x", b"a\nb")]]
)
def test_cr_or_lf_in_response_headers_is_refused(headers: list[tuple[bytes, bytes]]) -> None:
    with pytest.raises(ValueError, match="CR or LF"):
        head(200, headers)


def test_error_responses_say_why_and_close() -> None:
    data = error_response(400, "an HTTP/1.1 request must have a Host header")
    assert data.startswith(b"HTTP/1.1 400 Bad Request\r\n")
    assert b"connection: close\r\n" in data
    assert data.endswith(b"\r\n\r\nBad Request: an HTTP/1.1 request must have a Host header\n")


def test_the_date_header_is_formatted_once_a_second() -> None:
    assert date_header(0.2) == DATE
    assert date_header(0.9) is date_header(0.2)
    assert date_header(86400.0) == b"date: Fri, 02 Jan 1970 00:00:00 GMT\r\n"


def test_a_head_made_of_the_same_parts_is_reused_and_only_then() -> None:
    parts = [(b"content-type", b"application/json")]
    first = head(200, parts)
    assert head(200, list(parts)) is first
    # Every part counts: a head differing in any one of them is a head of its own.
    for other in (
        head(201, parts),
        head(200, [*parts, (b"x", b"y")]),
        head(200, parts, method=b"HEAD"),
        head(200, parts, http_version="1.0"),
        head(200, parts, keep_alive=False),
        head(200, parts, body_length=3),
        head(200, parts, more=True),
        head(200, parts, date=b"date: Fri, 02 Jan 1970 00:00:00 GMT\r\n"),
    ):
        assert other is not first
        assert other.data != first.data or other.no_body != first.no_body
    assert not head(200, parts, keep_alive=False).keep_alive
    assert head(200, parts).keep_alive


def test_unhashable_headers_and_many_heads_still_encode() -> None:
    # Headers as lists (some apps send them) cannot be a cache key; they still encode.
    listed = head(200, [[b"content-type", b"text/plain"]])  # type: ignore[list-item]
    assert b"content-type: text/plain\r\n" in listed.data
    # Refused heads are never kept: the same bad parts are refused again.
    for _ in range(2):
        with pytest.raises(ValueError, match="CR or LF"):
            head(200, [(b"x", b"a\r\nb")])
    for length in range(1000):
        assert b"content-length: %d\r\n" % length in head(200, body_length=length).data
    assert len(_HEAD_CACHE) <= 256


def test_a_cached_head_takes_each_bodys_own_length() -> None:
    # JSON answers vary in length: one cache entry serves them all, each head
    # byte for byte what encoding it afresh gives.
    from trioinfer.server._framing import _encode_response_head

    _HEAD_CACHE.clear()
    parts = [(b"content-type", b"application/json")]
    settings = (b"POST", "1.1", True)
    for length in (7, 123, 7, 4096, 1, 123):
        got = encode_response_head(200, parts, *settings, length, False, DATE)
        fresh = _encode_response_head(200, parts, *settings, length, False, DATE)[0]
        assert got.data == fresh.data
        assert (got.keep_alive, got.chunked, got.no_body) == (True, False, False)
    assert len(_HEAD_CACHE) == 1
    # HEAD: an empty body says no length at all, a non-empty one says its own.
    assert b"content-length" not in head(200, parts, method=b"HEAD", body_length=0).data
    assert b"content-length: 9\r\n" in head(200, parts, method=b"HEAD", body_length=9).data
    # An app's own content-length is kept as the app set it.
    own = [(b"content-length", b"5")]
    assert head(200, own, body_length=5).data.count(b"content-length") == 1
    assert head(200, own, body_length=3).declared_length == 5


def test_a_writable_memoryview_header_value_is_encoded_not_cached() -> None:
    value = memoryview(bytearray(b"v"))
    assert b"x-a: v\r\n" in head(200, [(b"x-a", value)]).data  # type: ignore[list-item]
