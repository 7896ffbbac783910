"""HTTP/1.1 framing without I/O: request bytes in, parsed requests out; response bytes out.

Nothing here touches a socket, a clock or an event loop (as h11 says: "bring
your own I/O"). `RequestFraming` takes the bytes a connection received and
turns them into `RequestHead` records, each with its body as it arrives, or
into one `FramingError` that says which status the client gets and why; the
functions at the bottom build a response's head and frame its body. The
connection (``_connection.py``) owns the socket and decides when to read; the
request cycle (``_cycle.py``) speaks ASGI. Tests feed this module bytes and
read what it made, with no socket at all.

Parsing is llhttp's (through httptools, in C); llhttp already refuses most
malformed framing (a ``Content-Length`` beside a ``Transfer-Encoding``, two
``Content-Length`` lines, a sign or a space inside one, a header name with a
space before its colon, folded lines, bare LF). This module adds what llhttp
lets through and RFC 9112 or plain safety asks for:

- a ``Host`` header: exactly one in an HTTP/1.1 request, at most one in
  HTTP/1.0, and a valid value (RFC 9112 section 3.2); otherwise 400;
- ``Transfer-Encoding``: only exactly ``chunked`` (no ``identity, chunked``,
  no coding lists), never with ``Content-Length``, never in HTTP/1.0, where
  RFC 9112 section 6.1 calls it faulty framing; otherwise 400: the server
  and a proxy in front of it must never disagree on where a request ends;
- ``Content-Length``: digits only, one line (llhttp checks it);
- only HTTP/1.0 and 1.1 (505 otherwise; llhttp reads ``HTTP/2.0`` and the
  one-line HTTP/0.9 form as ordinary requests);
- bounded heads: at most ``max_head_bytes`` of request line and header
  fields, and of trailers, and at most ``max_headers`` fields (431);
- bounded chunk framing: chunk-size lines, chunk extensions and trailers may
  not grow without limit (llhttp reads an endless chunk extension without a
  callback) - past ``max_head_bytes`` plus a small allowance per body byte,
  the request is refused (400);
- parsing stops at a request boundary while a parsed request waits to be
  served, so a client that pipelines a flood of small requests costs its
  raw bytes (which the connection bounds), not a Python object per request.

After an error nothing more is parsed: the connection answers the requests
already parsed, then the error, and closes.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Iterable
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, Final, final

import httptools

__all__ = [
    "FramingError",
    "RequestFraming",
    "RequestHead",
    "ResponseHead",
    "date_header",
    "encode_response_head",
    "error_response",
    "frame_body",
]

#: Bytes fed to the parser at once while a parsed request waits to be served:
#: what may be turned into request objects beyond a request boundary.
_STEP: Final = 4096
#: What chunked framing (size lines, extensions, CRLFs) may cost per body byte on
#: top of ``max_head_bytes``: a chunk of one byte takes 5 bytes of framing, a
#: chunk of any sensible size far less.
_FRAMING_PER_BODY_BYTE: Final = 8

_VERSIONS: Final = frozenset({"1.0", "1.1"})
# RFC 3986 host (reg-name, IPv4, or an IP-literal in brackets) and an optional
# port; an empty value is allowed (RFC 9112 section 3.2: an empty authority).
_HOST: Final = re.compile(
    rb"(?:\[[0-9A-Za-z:._~!$&'()*+,;=%-]*\]|[0-9A-Za-z._~!$&'()*+,;=%-]*)(?::[0-9]*)?"
)

#: Request headers that the framing itself reads.
_HOST_FIELD: Final = b"host"
_CONTENT_LENGTH_FIELD: Final = b"content-length"
_TRANSFER_ENCODING_FIELD: Final = b"transfer-encoding"
_EXPECT_FIELD: Final = b"expect"
_FRAMING_FIELDS: Final = frozenset(
    {_HOST_FIELD, _CONTENT_LENGTH_FIELD, _TRANSFER_ENCODING_FIELD, _EXPECT_FIELD}
)


@final
class FramingError(Exception):
    """Why a request cannot be served, and the status that says so; the connection then closes.

    Attributes:
        status: The HTTP status of the answer (400, 431 or 505).
        reason: What was wrong, in words a client can act on; it never
            repeats what the client sent.
    """

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"{status} {reason}")
        self.status = status
        self.reason = reason


class RequestHead:
    """One request as the framing parsed it: the head, then the body as it arrives.

    The request cycle subclasses it (see ``_cycle.py``), so that a request is
    one object from the parser to the app; `RequestFraming` makes them with
    the factory it is given.

    Attributes:
        url: The request target, as sent.
        headers: ``(lower-case name, value)`` pairs in order (trailers are not added).
        method: The method, e.g. ``b"GET"`` (set when the head is complete).
        http_version: ``"1.0"`` or ``"1.1"``.
        keep_alive: Whether the client keeps the connection open after it.
        expect_continue: The client sent ``Expect: 100-continue``.
        body: Body pieces received and not yet taken (framing already removed).
        complete: The whole request (body included) was received.
        discard: Body bytes still arriving are dropped (nobody will read them).
        remaining: Body bytes still expected (``Content-Length`` bodies), else -1.
        chunked: The body is chunked.
    """

    __slots__ = (
        "body",
        "chunked",
        "complete",
        "discard",
        "expect_continue",
        "headers",
        "http_version",
        "keep_alive",
        "method",
        "remaining",
        "url",
    )

    def __init__(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.method = b""
        self.http_version = "1.1"
        self.keep_alive = True
        self.expect_continue = False
        self.body: list[bytes] = []
        self.complete = False
        self.discard = False
        self.remaining = -1
        self.chunked = False


class _Refused(Exception):
    """Raised from a parser callback; carries the `FramingError` out of ``feed_data``."""

    def __init__(self, error: FramingError) -> None:
        super().__init__(error.reason)
        self.error = error


def _refuse(status: int, reason: str) -> _Refused:
    return _Refused(FramingError(status, reason))


@final
class RequestFraming:
    """Turns one connection's request bytes into `RequestHead` records, in order.

    Call `receive_data` with what the socket gave, then take requests with
    `next_request`. A request is handed out as soon as its head is complete
    (so an app can start before its body arrived); its body keeps arriving
    in ``body`` as more bytes are received. Received bytes that lie beyond a
    parsed request that waits to be served stay unparsed (``buffered``)
    until `next_request` takes that request.

    Args:
        max_head_bytes: The most bytes of request line plus header fields, and
            of trailers; also bounds chunk framing (see the module docstring).
        max_headers: The most header fields one request may carry.
        make_head: Makes the record for each new request (`RequestHead` or a subclass).
    """

    __slots__ = (
        "_body_bytes",
        "_buffer",
        "_encodings",
        "_fed_in_body",
        "_head_raw",
        "_head_size",
        "_hosts",
        "_in_head",
        "_last",
        "_length",
        "_lengths",
        "_make_head",
        "_max_head",
        "_max_headers",
        "_parser",
        "_parsing",
        "_pos",
        "_ready",
        "_seq",
        "_valid_host",
        "discarded",
        "error",
        "upgraded",
    )

    def __init__(
        self,
        *,
        max_head_bytes: int,
        max_headers: int,
        make_head: Callable[[], RequestHead] = RequestHead,
    ) -> None:
        if max_head_bytes <= 0 or max_headers <= 0:
            raise ValueError(
                f"expected max_head_bytes > 0 and max_headers > 0, got {max_head_bytes} "
                f"and {max_headers}"
            )
        self._max_head = max_head_bytes
        self._max_headers = max_headers
        self._make_head = make_head
        self._parser = httptools.HttpRequestParser(self)
        self._ready: deque[RequestHead] = deque()
        self._parsing: RequestHead | None = None
        # The last request whose head was complete (an upgrade refers to it).
        self._last: RequestHead | None = None
        self._buffer = b""
        self._pos = 0
        self._in_head = False
        self._head_size = 0
        self._head_raw = 0
        self._seq = 0
        # Host, Content-Length and Transfer-Encoding lines seen in this head.
        self._hosts = self._lengths = self._encodings = 0
        # The value of this head's Content-Length line (when `_lengths`).
        self._length = b""
        # The last Host value found valid: most clients send the same one each time.
        self._valid_host = b""
        self._fed_in_body = 0
        self._body_bytes = 0
        #: Body bytes dropped because their request was marked ``discard``.
        self.discarded = 0
        #: Why the input cannot be served; set once, then nothing more is parsed.
        self.error: FramingError | None = None
        #: The last request asked to switch protocols (``Upgrade``, ``CONNECT``):
        #: it is served as an ordinary request, and what follows it is not HTTP/1.1.
        self.upgraded = False

    # What the connection sees.

    @property
    def stopped(self) -> bool:
        """Nothing more will be parsed: an error, or a protocol switch."""
        return self.error is not None or self.upgraded

    @property
    def in_head(self) -> bool:
        """A request's head is partly received (the start of a request, or more)."""
        return self._in_head

    @property
    def in_request(self) -> bool:
        """Some request is partly received (its head, or its body)."""
        return self._parsing is not None

    @property
    def buffered(self) -> int:
        """Bytes received and not parsed yet (they lie beyond a waiting request)."""
        return len(self._buffer) - self._pos

    @property
    def has_request(self) -> bool:
        """A request is ready for `next_request`, or buffered bytes may hold one."""
        return bool(self._ready) or (self.buffered > 0 and not self.stopped)

    def receive_data(self, data: bytes) -> None:
        """Take bytes the client sent, and parse what may be parsed now.

        Bytes after an error or a protocol switch are dropped.
        """
        if self.error is not None or self.upgraded:
            return
        if not self._buffer and not self._ready and len(data) <= _STEP:
            self._feed(data)  # the usual case: one request, nothing waiting
            return
        if self._pos < len(self._buffer):
            self._buffer = self._buffer[self._pos :] + data
        else:
            self._buffer = data
        self._pos = 0
        self._parse()

    def next_request(self) -> RequestHead | None:
        """The next request whose head is complete, in order; None if there is none yet."""
        ready = self._ready
        if not ready:
            if self._pos >= len(self._buffer):
                return None
            self._parse()
            if not ready:
                return None
        head = ready.popleft()
        if not ready and self._pos < len(self._buffer):
            # Its body, and the next request's head, may wait in the buffer.
            self._parse()
        return head

    # Parsing.

    def _parse(self) -> None:
        buf = self._buffer
        end = len(buf)
        pos = self._pos
        ready = self._ready
        while pos < end:
            if ready and self._parsing is not ready[-1]:
                # A request waits its turn and no body of a waiting request is
                # being parsed: leave the rest unparsed.
                break
            step = end - pos
            if step > _STEP:
                current = self._parsing
                if current is not None and current.remaining > _STEP:
                    step = min(step, current.remaining)  # body bytes: no object per request
                else:
                    step = _STEP
                data = buf[pos : pos + step]
            else:
                data = buf if pos == 0 else buf[pos:]
            pos += step
            self._feed(data)
            if self.error is not None or self.upgraded:
                pos = end
        self._pos = pos
        if pos >= end:
            self._buffer = b""
            self._pos = 0

    def _feed(self, data: bytes) -> None:
        seq = self._seq
        was_in_head = self._in_head
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # Served as a plain request; what follows is another protocol we do not speak.
            self.upgraded = True
            if self._last is not None:
                self._last.keep_alive = False
            return
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            self.error = (
                cause.error
                if isinstance(cause, _Refused)
                else FramingError(400, "the request could not be parsed")
            )
            return
        except httptools.HttpParserError as exc:
            self.error = FramingError(400, _parse_error_reason(exc))
            return
        if self._in_head:
            if was_in_head and seq == self._seq:
                # A head that keeps growing inside one field never reaches a
                # callback (httptools buffers the field): bound its raw bytes too.
                self._head_raw += len(data)
                if self._head_raw > self._max_head:
                    self.error = FramingError(431, "the request head is too large")
        elif self._parsing is not None and self._parsing.chunked and seq == self._seq:
            # Chunk-size lines, chunk extensions and trailers reach no callback
            # either: bound what chunked framing may cost beside the body. (A
            # feed in which a request began is not counted: the bytes before
            # that start were the previous request's.)
            self._fed_in_body += len(data)
            overhead = self._fed_in_body - self._body_bytes
            if overhead > self._max_head + _FRAMING_PER_BODY_BYTE * self._body_bytes:
                self.error = FramingError(
                    400, "the chunked framing (chunk extensions or trailers) is too large"
                )

    # The parser's callbacks: they run inside `feed_data`, synchronously.

    def on_message_begin(self) -> None:
        """Parser callback: a new request starts."""
        self._parsing = self._make_head()
        self._in_head = True
        self._head_size = self._head_raw = 0
        self._seq += 1
        self._hosts = self._lengths = self._encodings = 0
        # (`_fed_in_body` and `_body_bytes` only matter to a chunked body: they
        # are reset when a head says so, in `on_headers_complete`.)

    def on_url(self, url: bytes) -> None:
        """Parser callback: (a piece of) the request target."""
        head = self._parsing
        assert head is not None
        head.url += url
        self._head_size += len(url)
        if self._head_size > self._max_head:
            raise _refuse(431, "the request head is too large")

    def on_header(self, name: bytes, value: bytes) -> None:
        """Parser callback: one complete header field (or trailer field)."""
        # Runs for every header line of every request: locals over attributes.
        size = self._head_size + len(name) + len(value) + 4
        self._head_size = size
        if size > self._max_head:
            raise _refuse(431, "the request head is too large")
        if not self._in_head:
            return  # a trailer: counted, not kept (ASGI has no request trailers)
        head = self._parsing
        assert head is not None
        headers = head.headers
        if len(headers) >= self._max_headers:
            raise _refuse(431, f"the request has more than {self._max_headers} header fields")
        name = name.lower()
        headers.append((name, value))
        if name in _FRAMING_FIELDS:
            if name == _HOST_FIELD:
                if value == self._valid_host and not self._hosts:
                    self._hosts = 1  # the host the last request had: checked already
                    return
            elif name == _CONTENT_LENGTH_FIELD:
                # llhttp refuses a second line, a sign and inner spaces itself.
                self._lengths += 1
                self._length = value
                return
            self._framing_field(head, name, value)

    def _framing_field(self, head: RequestHead, name: bytes, value: bytes) -> None:
        if name == _HOST_FIELD:
            self._hosts += 1
            if self._hosts > 1:
                raise _refuse(400, "the request has more than one Host header")
            if _HOST.fullmatch(value) is None:
                raise _refuse(400, "the Host header is not a valid host[:port]")
            self._valid_host = value
        elif name == _TRANSFER_ENCODING_FIELD:
            self._encodings += 1
            if value.strip(b" \t").lower() != b"chunked":
                raise _refuse(400, "the only Transfer-Encoding accepted is 'chunked', alone")
        elif value.lower() == b"100-continue":  # expect
            head.expect_continue = True

    def on_headers_complete(self) -> None:
        """Parser callback: the head is complete; the request can be served."""
        head = self._parsing
        assert head is not None
        parser = self._parser
        version = parser.get_http_version()
        if version not in _VERSIONS:
            raise _refuse(505, "only HTTP/1.1 and HTTP/1.0 are served")
        if not self._hosts and version == "1.1":
            raise _refuse(400, "an HTTP/1.1 request must have a Host header")
        if self._encodings:
            if self._lengths:
                raise _refuse(
                    400, "a request may not have both Content-Length and Transfer-Encoding"
                )
            if version == "1.0":
                raise _refuse(400, "an HTTP/1.0 request may not have a Transfer-Encoding")
            head.chunked = True
            self._fed_in_body = self._body_bytes = 0
        elif self._lengths:
            # llhttp has checked it already: one line, digits, optional whitespace around.
            head.remaining = int(self._length)
        head.method = parser.get_method()
        head.http_version = version
        head.keep_alive = parser.should_keep_alive()
        self._in_head = False
        self._last = head
        self._ready.append(head)

    def on_body(self, body: bytes) -> None:
        """Parser callback: a piece of the body (chunked framing already removed)."""
        head = self._parsing
        assert head is not None
        size = len(body)
        self._body_bytes += size
        if head.remaining >= 0:
            head.remaining -= size
        if head.discard:
            self.discarded += size
        else:
            head.body.append(body)

    def on_message_complete(self) -> None:
        """Parser callback: the request (body included) is complete."""
        head = self._parsing
        assert head is not None
        head.complete = True
        head.remaining = 0 if head.remaining >= 0 else -1
        self._parsing = None


def _parse_error_reason(exc: httptools.HttpParserError) -> str:
    # llhttp's reasons name the rule that failed ("Invalid character in
    # Content-Length"), never the bytes: safe and useful to repeat.
    reason = str(exc).strip() or "malformed request"
    return f"the request is malformed: {reason}"


# -- responses --------------------------------------------------------------------------------


def _status_line(status: int) -> bytes:
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = ""
    return f"HTTP/1.1 {status} {phrase}\r\n".encode("latin-1")


_STATUS_LINES: Final = {int(s): _status_line(int(s)) for s in HTTPStatus}


def error_response(status: int, reason: str) -> bytes:
    """A whole plain-text response that says *reason*, closing the connection."""
    body = f"{HTTPStatus(status).phrase}: {reason}\n".encode()
    return (
        _STATUS_LINES[status]
        + b"content-type: text/plain; charset=utf-8\r\n"
        + b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
        + body
    )


#: Response headers the server itself may add, so it looks for them in the app's.
_CONTENT_LENGTH: Final = 1
_TRANSFER_ENCODING: Final = 2
_CONNECTION: Final = 3
_DATE: Final = 4
_SPECIAL_HEADERS: Final = {  # name -> bit number in encode_response_head's `found`
    b"content-length": _CONTENT_LENGTH,
    b"transfer-encoding": _TRANSFER_ENCODING,
    b"connection": _CONNECTION,
    b"date": _DATE,
}

_date_second = -1
_date_line = b""


def date_header(now: float) -> bytes:
    """The ``date`` header line for wall-clock time *now*, formatted at most once a second."""
    global _date_second, _date_line
    second = int(now)
    if second != _date_second:
        _date_line = b"date: %s\r\n" % formatdate(second, usegmt=True).encode("ascii")
        _date_second = second
    return _date_line


@final
class ResponseHead:
    """How one response's body goes on the wire, as its head decided.

    Attributes:
        data: The status line and headers.
        keep_alive: The connection stays open after the response.
        chunked: The body is sent in chunks.
        no_body: The response has no body on the wire (HEAD, 1xx, 204, 304).
        declared_length: The app's ``content-length``, or -1.
    """

    __slots__ = ("chunked", "data", "declared_length", "keep_alive", "no_body")

    def __init__(
        self, data: bytes, keep_alive: bool, chunked: bool, no_body: bool, declared_length: int
    ) -> None:
        self.data = data
        self.keep_alive = keep_alive
        self.chunked = chunked
        self.no_body = no_body
        self.declared_length = declared_length


#: Recent response heads by everything they are made of but the body's length:
#: an inference server answers the same few heads (a status, a content type,
#: the second's date) over and over, with bodies whose length varies (JSON's
#: numbers). Each entry is the head, where its ``content-length`` line
#: starts and ends (-1 when it has none), and the length it says. Emptied
#: when full.
_HEAD_CACHE: Final[dict[tuple[Any, ...], tuple[ResponseHead, int, int, int]]] = {}
_HEAD_CACHE_SIZE: Final = 256
_HEAD_CACHE_BYTES: Final = 1024


def encode_response_head(
    status: int,
    headers: Iterable[tuple[bytes, bytes]],
    method: bytes,
    http_version: str,
    keep_alive: bool,
    body_length: int,
    more: bool,
    date: bytes,
    /,
) -> ResponseHead:
    """The status line and headers of a response, with framing and connection headers added.

    Positional arguments only: this runs once per response, and keywords cost.
    A head made of the same parts as a recent one is that one, with this
    body's length put in (a `ResponseHead` is never changed): looking it up
    costs a fraction of making it.

    Args:
        status: The status code.
        headers: The app's headers, as ASGI gives them.
        method: The request's method (a HEAD response has no body).
        http_version: The request's version.
        keep_alive: Whether the connection may stay open, as far as the server knows.
        body_length: The size of the first body piece.
        more: Whether more body pieces follow.
        date: The ``date`` header line, added unless the app set one.

    Raises:
        ValueError: A header name or value holds CR or LF (which would let
            the app's data inject headers or responses), or the app's
            ``content-length`` is not a number.
    """
    headers = tuple(headers)
    # The length changes the head only through its content-length line, and
    # for HEAD whether there is one at all.
    key = (status, headers, method, http_version, keep_alive, more, date, body_length > 0)
    try:
        cached = _HEAD_CACHE.get(key)
    except (TypeError, ValueError):  # unhashable headers (lists, writable memoryviews): not cached
        return _encode_response_head(
            status, headers, method, http_version, keep_alive, body_length, more, date
        )[0]
    if cached is None:
        head, start, end = _encode_response_head(
            status, headers, method, http_version, keep_alive, body_length, more, date
        )
        if len(head.data) <= _HEAD_CACHE_BYTES:  # a few small heads, not an app's big ones
            if len(_HEAD_CACHE) >= _HEAD_CACHE_SIZE:
                _HEAD_CACHE.clear()
            _HEAD_CACHE[key] = (head, start, end, body_length)
        return head
    head, start, end, length = cached
    if start < 0 or length == body_length:
        return head
    data = head.data
    return ResponseHead(
        b"%bcontent-length: %d\r\n%b" % (data[:start], body_length, data[end:]),
        head.keep_alive,
        head.chunked,
        head.no_body,
        head.declared_length,
    )


def _encode_response_head(
    status: int,
    headers: Iterable[tuple[bytes, bytes]],
    method: bytes,
    http_version: str,
    keep_alive: bool,
    body_length: int,
    more: bool,
    date: bytes,
    /,
) -> tuple[ResponseHead, int, int]:
    # The head, and where the content-length line made here starts and ends in
    # its bytes (-1, -1 when there is none).
    found = 0  # bit set of the _SPECIAL_HEADERS seen
    length_at = -1  # the index in parts of the content-length line made here
    parts = [_STATUS_LINES.get(status) or _status_line(status)]
    special = _SPECIAL_HEADERS
    chunked = False
    declared = -1
    for name, value in headers:
        kind = special.get(name.lower(), 0)
        if kind:
            found |= 1 << kind
            if kind == _CONTENT_LENGTH:
                declared = int(value)
            elif kind == _TRANSFER_ENCODING:
                chunked = b"chunked" in value.lower()
            elif kind == _CONNECTION:
                # Hop-by-hop: the server says what it will do (below).
                if b"close" in value.lower():
                    keep_alive = False
                continue
        parts += (name, b": ", value, b"\r\n")
    lines = (len(parts) - 1) // 4  # one per header so far
    head_request = method == b"HEAD"
    no_body = False
    if status < 200 or status in (204, 304):
        no_body = True
    elif not found & (1 << _CONTENT_LENGTH | 1 << _TRANSFER_ENCODING):
        if not more:
            # For HEAD, the body an app sends anyway is the one GET would get.
            if body_length or not head_request:
                length_at = len(parts)
                parts.append(b"content-length: %d\r\n" % body_length)
                lines += 1
        elif head_request:
            pass
        elif http_version != "1.0":
            parts.append(b"transfer-encoding: chunked\r\n")
            lines += 1
            chunked = True
        else:  # an HTTP/1.0 client knows the body ended when the connection closes
            keep_alive = False
    if head_request:
        no_body = True
    if no_body:
        chunked = False
    if not found & 1 << _DATE:
        parts.append(date)
        lines += 1
    if not keep_alive:
        parts.append(b"connection: close\r\n")
        lines += 1
    elif http_version == "1.0":
        parts.append(b"connection: keep-alive\r\n")
        lines += 1
    parts.append(b"\r\n")
    data = b"".join(parts)
    # One scan in C instead of a check per header: a CR or LF inside a name
    # or value would let the app's data inject headers or responses.
    if data.count(b"\n") != lines + 2 or data.count(b"\r") != lines + 2:
        raise ValueError("response header names and values must not contain CR or LF")
    head = ResponseHead(data, keep_alive, chunked, no_body, declared)
    if length_at < 0:
        return head, -1, -1
    start = sum(map(len, parts[:length_at]))
    return head, start, start + len(parts[length_at])


def frame_body(head: ResponseHead, body: bytes, more: bool) -> bytes:
    """*body* as it goes on the wire after *head*: chunked if need be, nothing if bodiless."""
    if head.no_body:
        return b""
    if head.chunked:
        if body:
            data = b"%x\r\n%b\r\n" % (len(body), body)
            return data if more else data + b"0\r\n\r\n"
        return b"" if more else b"0\r\n\r\n"
    return body
