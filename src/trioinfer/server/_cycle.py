"""One request/response cycle as ASGI sees it: the scope, ``receive`` and ``send``.

A `RequestCycle` is the `RequestHead` the framing parsed (it subclasses it,
so a request is one object from the parser to the app), plus the response's
state. ``receive`` hands out the body the connection received, asking the
connection to read more when the app wants it; ``send`` turns ``http.response.*``
messages into bytes with `encode_response_head` and `frame_body` and writes
them through the connection; ``respond`` (the ASGI extension
``trioinfer.respond``, which the infer route uses) does both messages' work
in one call. Reading and writing the socket, and every timeout, are the
connection's (``_connection.py``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any, Final, TypeAlias, final
from urllib.parse import unquote_to_bytes

import anyio
import httptools

from ._framing import RequestHead, ResponseHead, date_header, encode_response_head, frame_body

if TYPE_CHECKING:
    from ._connection import Connection

__all__ = ["ASGI3App", "Message", "Receive", "RequestCycle", "Scope", "Send"]

Scope: TypeAlias = MutableMapping[str, Any]
Message: TypeAlias = MutableMapping[str, Any]
Receive: TypeAlias = Callable[[], Awaitable[Message]]
Send: TypeAlias = Callable[[Message], Awaitable[None]]
#: An ASGI 3 application, e.g. a Starlette app.
ASGI3App: TypeAlias = Callable[[Scope, Receive, Send], Awaitable[None]]

ASGI_VERSION: Final = "3.0"
_HTTP_SPEC_VERSION: Final = "2.3"

_METHODS: Final = {
    m.encode(): m for m in ("GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH")
}
_CONTINUE: Final = b"HTTP/1.1 100 Continue\r\n\r\n"
#: Head and body go out in one write up to this body size; a bigger body is
#: written separately rather than copied.
_COALESCE_LIMIT: Final = 256 * 1024


_TWICE: Final = "http.response.start sent twice"
# After the server answered for the app (it returned without a response, or raised).
_OVER: Final = "the response cycle is over: the server has answered this request already"


@final
class RequestCycle(RequestHead):
    """One request/response cycle: its parsed head, its buffered body, its response state.

    Its bound ``receive`` and ``send`` are what the app gets, so that calls a
    misbehaving app makes after its request ended affect nothing else.
    """

    __slots__ = (
        "_conn",
        "_head",
        "_headers",
        "_on_disconnect",
        "_sent_length",
        "_status",
        "_waiters",
        "body_done",
        "continue_sent",
        "finished",
        "head_sent",
        "started",
    )

    def __init__(self, conn: Connection) -> None:
        # RequestHead's fields, set here rather than through super().__init__():
        # one call less per request.
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
        self._conn = conn
        self.continue_sent = False
        self.body_done = False
        self.started = False
        self.head_sent = False
        self.finished = False
        self._status = 200
        self._headers: Any = ()
        self._head: ResponseHead | None = None
        self._sent_length = 0
        self._waiters: list[anyio.CancelScope] | None = None
        self._on_disconnect: list[anyio.CancelScope] | None = None

    def cancel_on_disconnect(self, scope: anyio.CancelScope | None = None) -> bool:
        """Cancel *scope* if the client goes away before the response is done.

        The ASGI extension ``trioinfer.cancel_on_disconnect`` (in the scope's
        ``extensions``): an app that has read the whole body registers a cancel
        scope instead of calling ``receive`` from a task of its own, and the
        server's one hang-up watcher serves every request of every connection
        (see ``_connection.py``). Returns False (nothing registered) if the
        body is not all read, or where the server has no hang-up watcher (no
        epoll): the app then watches with ``receive``.

        Without a *scope*, the client going away cancels the task that runs
        the app (call it from that task): whatever the app awaits for this
        request is cancelled, and the connection, which has nobody left on
        it, closes. That spares the app a cancel scope of its own per
        request (entering and leaving one costs about 9 us on Trio).
        """
        if not self.body_done or self.finished:
            return False
        conn = self._conn
        if not conn.watch(self):
            return False
        target = conn.cancel_scope if scope is None else scope
        if conn.gone or conn.hung_up_seen:
            conn.gone = True
            target.cancel()
            return True
        if self._on_disconnect is None:
            self._on_disconnect = []
        self._on_disconnect.append(target)
        return True

    def disconnected(self) -> None:
        """The client went away while the app worked: cancel what was registered."""
        for scope in self._on_disconnect or ():
            scope.cancel()

    def scope(self) -> Scope:
        """The ASGI HTTP connection scope.

        Raises:
            httptools.HttpParserError: An absolute-form target that is not a URL.
        """
        url = self.url
        if url[:1] != b"/":
            if url == b"*":
                raw_path, query = b"*", b""
            else:  # absolute-form, as sent to proxies
                parsed = httptools.parse_url(url)
                raw_path, query = parsed.path or b"/", parsed.query or b""
        else:
            if b"#" in url:  # llhttp lets a fragment through; it is not part of the path
                url = url.partition(b"#")[0]
            raw_path, _, query = url.partition(b"?")
        if b"%" in raw_path:
            path = unquote_to_bytes(raw_path).decode("utf-8", "replace")
        else:
            path = raw_path.decode("utf-8", "replace")
        method = _METHODS.get(self.method) or self.method.decode("ascii")
        conn = self._conn
        scope: Scope = {
            "type": "http",
            "asgi": {"version": ASGI_VERSION, "spec_version": _HTTP_SPEC_VERSION},
            "http_version": self.http_version,
            "server": conn.server_addr,
            "client": conn.client,
            "scheme": conn.scheme,
            "method": method,
            "root_path": "",
            "path": path,
            "raw_path": raw_path,
            "query_string": query,
            "headers": self.headers,
            "extensions": {
                "trioinfer.cancel_on_disconnect": self.cancel_on_disconnect,
                "trioinfer.respond": self.respond,
            },
        }
        state = conn.lifespan_state
        if state:
            scope["state"] = state.copy()
        return scope

    def finish(self) -> None:
        """The response is done (or abandoned): wake every ``receive`` waiting for a disconnect."""
        self.finished = True
        if self._waiters:
            for waiter in self._waiters:
                waiter.cancel()

    async def receive(self) -> Message:
        """ASGI ``receive``: the body in ``http.request`` messages, then ``http.disconnect``."""
        conn = self._conn
        while True:
            if self.finished:
                return {"type": "http.disconnect"}
            body = self.body
            if body:
                data = body[0] if len(body) == 1 else b"".join(body)
                body.clear()
                more = not self.complete
                self.body_done = not more
                return {"type": "http.request", "body": data, "more_body": more}
            if self.complete:
                if not self.body_done:
                    self.body_done = True
                    return {"type": "http.request", "body": b"", "more_body": False}
                await self._wait_disconnect()
                return {"type": "http.disconnect"}
            if conn.gone or conn.framing.stopped:  # the body can never complete
                return {"type": "http.disconnect"}
            if (
                self.expect_continue
                and not self.continue_sent
                and not self.started
                and self.http_version == "1.1"
            ):
                self.continue_sent = True
                await conn.send_all(_CONTINUE)
            await conn.read_for_app(self, waiting=False)

    async def _wait_disconnect(self) -> None:
        """Block until the client goes away or the response is done."""
        with anyio.CancelScope() as scope:
            if self._waiters is None:
                self._waiters = []
            self._waiters.append(scope)
            try:
                await self._conn.read_for_app(self, waiting=True)
            finally:
                self._waiters.remove(scope)

    async def send(self, message: Mapping[str, Any]) -> None:
        """ASGI ``send``: ``http.response.start`` then ``http.response.body`` messages.

        The head is held back until the first body message so that head and
        body go out in one write. Once the client is gone, sends do nothing.
        """
        kind = message["type"]
        if kind == "http.response.body":
            if not self.started or self.finished:
                raise RuntimeError(
                    "expected http.response.start before http.response.body, and nothing "
                    f"after the last body; got {kind!r} "
                    f"(started={self.started}, finished={self.finished})"
                )
            body: bytes = message.get("body", b"")
            more: bool = message.get("more_body", False)
            conn = self._conn
            head = self._head
            if head is not None:
                data = self._frame(head, body, more)
            else:
                head = self._encode_head(len(body), more)
                data = self._frame(head, body, more) if body or not more else b""
                self._head = head
                self.head_sent = True  # only now: a bad message above still gets a 500
                if len(data) <= _COALESCE_LIMIT:
                    data = head.data + data
                elif not conn.gone:  # too big to copy just to save a write
                    await conn.send_all(head.data)
            if not more:
                self.finish()
            if data and not conn.gone:
                await conn.send_all(data)
        elif kind == "http.response.start":
            if self.started or self.finished:
                raise RuntimeError(_TWICE if self.started else _OVER)
            self.started = True
            self._status = message["status"]
            self._headers = message.get("headers", ())
        else:
            raise RuntimeError(f"expected an http.response.* message, got {kind!r}")

    async def respond(
        self, status: int, headers: tuple[tuple[bytes, bytes], ...], body: bytes
    ) -> None:
        """A whole response in one call: ``http.response.start``, then its one and last body.

        The ASGI extension ``trioinfer.respond`` (in the scope's
        ``extensions``), for an app that has its whole body at hand: it
        spares two messages and two calls of `send`, and with *headers* a
        tuple without ``content-length`` (the server adds it, from the
        body's length) the head is one seen before, looked up rather than
        made. Once the client is gone it sends nothing.
        """
        if self.started or self.finished:
            raise RuntimeError(_TWICE if self.started else _OVER)
        self.started = True
        self._status = status
        self._headers = headers
        head = self._encode_head(len(body), False)
        data = self._frame(head, body, False)
        self._head = head
        self.head_sent = True
        self.finish()
        conn = self._conn
        if conn.gone:
            return
        if len(data) <= _COALESCE_LIMIT:
            await conn.send_all(head.data + data)
        elif await conn.send_all(head.data):
            await conn.send_all(data)

    def _encode_head(self, body_length: int, more: bool) -> ResponseHead:
        conn = self._conn
        keep_alive = self.keep_alive and not conn.shared.closing
        if self.expect_continue and not self.continue_sent and not self.complete:
            keep_alive = False  # the client holds the body back; see Connection.next_request
        head = encode_response_head(
            self._status,
            self._headers,
            self.method,
            self.http_version,
            keep_alive,
            body_length,
            more,
            date_header(conn.io.wall_time()),
        )
        if not head.keep_alive:
            self.keep_alive = False
        return head

    def _frame(self, head: ResponseHead, body: bytes, more: bool) -> bytes:
        """*body* as it goes on the wire, checked against the app's ``content-length``."""
        declared = head.declared_length
        if declared >= 0 and not (head.no_body or head.chunked):
            self._sent_length += len(body)
            if self._sent_length > declared:
                raise RuntimeError(
                    f"the response body is longer than its content-length, {declared}"
                )
            if not more and self._sent_length < declared:
                self.keep_alive = False  # the client is still waiting for the rest
        return frame_body(head, body, more)
