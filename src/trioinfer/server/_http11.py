"""A lean HTTP/1.1 server for Trio that serves any ASGI 3 app, on the llhttp parser.

Hypercorn spends most of a small request in h11's pure-Python state machine
and in a task plus cancel scopes per request. This server keeps one task per
connection and on the path of a small request spawns no task, enters no
cancel scope and moves no deadline: it parses with httptools (llhttp, in C),
calls the plain socket (waiting with `trio.lowlevel.wait_readable`, and with
`wait_writable` only when a send would block) rather than Trio's socket
wrappers, and writes a whole response (status line, headers and body) with
one ``send``. For small requests that is several times
Hypercorn's rate (over ten times for a hello-world app on two cores).

How a connection works: its task reads until a request's headers are
complete, then calls the app in the same task. The app's ``receive`` reads
the socket itself when it needs more body, so the body is read only as fast
as the app consumes it (backpressure for free). After the whole body was
delivered, ``receive`` keeps reading to notice the client going away (EOF or
reset gives ``http.disconnect``); bytes of pipelined requests read meanwhile
are parsed and queued, up to a bound, and served in order afterwards. An app
that registers a cancel scope with the ``trioinfer.cancel_on_disconnect``
extension instead has the connection's one watcher task do that reading; its
read is left waiting when the response is done, and the request loop takes
the next request from it rather than cancelling it (a cancellation per
request cost about a tenth of a small inference request's time).

Only plain HTTP/1.1 (and 1.0) is served: no TLS, no HTTP/2, no WebSocket;
an ``Upgrade`` request is served as an ordinary request and the connection
is closed after it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, Final, TypeAlias, final
from urllib.parse import unquote_to_bytes

import httptools
import trio

__all__ = ["ASGI3App", "serve_asgi"]

log = logging.getLogger("trioinfer.server")

Scope: TypeAlias = MutableMapping[str, Any]
Message: TypeAlias = MutableMapping[str, Any]
Receive: TypeAlias = Callable[[], Awaitable[Message]]
Send: TypeAlias = Callable[[Message], Awaitable[None]]
#: An ASGI 3 application, e.g. a Starlette app.
ASGI3App: TypeAlias = Callable[[Scope, Receive, Send], Awaitable[None]]

_RECV_SIZE: Final = 64 * 1024
#: While an app waits for a disconnect, pipelined requests read meanwhile are
#: buffered up to about this many bytes; then the socket is left unread until
#: the current response is done (the client's sends block: backpressure).
_AHEAD_LIMIT: Final = 256 * 1024
#: An unread request body is read and discarded to keep the connection alive
#: only up to this size; past it closing is cheaper than reading.
_DRAIN_LIMIT: Final = 1024 * 1024
#: After an error response, how long to read and discard what the client still
#: sends before closing, so that the close does not reset the connection (a
#: reset can destroy the response before the client has read it).
_LINGER_S: Final = 1.0
_LINGER_BYTES: Final = 1024 * 1024
_BACKLOG: Final = 1024
# Most connections accepted per wake-up of the accept loop.
_ACCEPT_BURST: Final = 256
#: Head and body go out in one write up to this body size; a bigger body is
#: written separately rather than copied.
_COALESCE_LIMIT: Final = 256 * 1024

_ASGI_VERSION: Final = "3.0"
_HTTP_SPEC_VERSION: Final = "2.3"
_LIFESPAN_SPEC_VERSION: Final = "2.0"

_METHODS: Final = {
    m.encode(): m for m in ("GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH")
}


def _status_line(status: int) -> bytes:
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = ""
    return f"HTTP/1.1 {status} {phrase}\r\n".encode("latin-1")


_STATUS_LINES: Final = {int(s): _status_line(int(s)) for s in HTTPStatus}

#: Response headers the server itself may add, so it looks for them in the app's.
_CONTENT_LENGTH: Final = 1
_TRANSFER_ENCODING: Final = 2
_CONNECTION: Final = 3
_DATE: Final = 4
_SPECIAL_HEADERS: Final = {  # name -> bit number in _Request._head's `found`
    b"content-length": _CONTENT_LENGTH,
    b"transfer-encoding": _TRANSFER_ENCODING,
    b"connection": _CONNECTION,
    b"date": _DATE,
}


def _simple_response(status: int, text: str) -> bytes:
    body = text.encode()
    return (
        _STATUS_LINES[status]
        + b"content-type: text/plain; charset=utf-8\r\n"
        + b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
        + body
    )


_RESPONSE_400: Final = _simple_response(400, "Bad Request")
_RESPONSE_431: Final = _simple_response(431, "Request Header Fields Too Large")
_RESPONSE_500: Final = _simple_response(500, "Internal Server Error")
_CONTINUE: Final = b"HTTP/1.1 100 Continue\r\n\r\n"

_date_second = -1
_date_line = b""


def _date_header() -> bytes:
    """The ``date`` header line, formatted at most once a second."""
    global _date_second, _date_line
    now = int(time.time())
    if now != _date_second:
        _date_line = b"date: %s\r\n" % formatdate(now, usegmt=True).encode("ascii")
        _date_second = now
    return _date_line


class _HeadTooLarge(Exception):
    """Raised from a parser callback: the request line and headers passed the limit."""


# -- the server -------------------------------------------------------------------------------


async def serve_asgi(
    app: ASGI3App,
    host: str,
    port: int,
    *,
    shutdown: trio.Event,
    graceful_timeout: float,
    keep_alive_timeout: float = 5.0,
    max_header_bytes: int = 64 * 1024,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve *app* over HTTP/1.1 on *host*:*port* until *shutdown* is set, then drain.

    Binds, runs the app's ASGI lifespan startup (an app that raises on the
    lifespan scope is served without one; connections made meanwhile wait in
    the backlog), then reports the base URLs through *task_status*. Keep-alive
    is the default for HTTP/1.1 and pipelined requests are answered in order.
    Malformed requests get 400, oversized heads 431, and an app that fails
    before it responds 500 (logged on ``trioinfer.server``); each closes the
    connection. When *shutdown* is set the listeners close at
    once, idle connections are closed, and requests in flight get up to
    *graceful_timeout* seconds to finish (their responses say
    ``connection: close``) before they are cancelled; then the lifespan
    shutdown runs and the function returns. Cancelling the caller's scope
    stops everything at once instead.

    Args:
        app: The ASGI 3 application.
        host: The address to bind, e.g. ``"127.0.0.1"``.
        port: The port; 0 picks a free one (read it from the reported URL).
        shutdown: Set it to stop gracefully.
        graceful_timeout: How long in-flight requests may run after *shutdown*.
        keep_alive_timeout: How long an idle connection stays open, and how long
            a client may take to send a request's headers, or to send more of
            its body while the app waits for it.
        max_header_bytes: The most bytes of request line plus headers accepted;
            bigger requests get 431 and the connection closes.
        task_status: Receives the listening URLs, e.g. ``["http://127.0.0.1:8000"]``,
            for ``nursery.start``.

    Raises:
        ValueError: A timeout is not positive, or *max_header_bytes* is not.
        RuntimeError: The app reported that its lifespan startup failed.
        OSError: The address could not be bound.
    """
    if not keep_alive_timeout > 0 or not graceful_timeout >= 0 or max_header_bytes <= 0:
        raise ValueError(
            "expected keep_alive_timeout > 0, graceful_timeout >= 0 and max_header_bytes > 0; "
            f"got {keep_alive_timeout}, {graceful_timeout} and {max_header_bytes}"
        )
    # Bound before the lifespan startup: connections made meanwhile wait in the
    # backlog, and a bind error is raised as itself, not inside an ExceptionGroup.
    listeners = [
        _unwrap(listener.socket)
        for listener in await trio.open_tcp_listeners(port, host=host, backlog=_BACKLOG)
    ]
    lifespan = _Lifespan(app)
    try:
        async with trio.open_nursery() as root:
            root.start_soon(lifespan.run)
            if await lifespan.wait_started():
                server = _Server(app, lifespan.state, keep_alive_timeout, max_header_bytes)
                await _serve(server, listeners, shutdown, graceful_timeout, task_status)
            await lifespan.shutdown()
    finally:
        _close_all(listeners)
    if lifespan.failure is not None:
        raise RuntimeError(f"ASGI lifespan startup failed: {lifespan.failure}")


async def _serve(
    server: _Server,
    listeners: list[socket.socket],
    shutdown: trio.Event,
    graceful_timeout: float,
    task_status: trio.TaskStatus[list[str]],
) -> None:
    async with trio.open_nursery() as connections:
        async with trio.open_nursery() as acceptors:
            for listener in listeners:
                acceptors.start_soon(server.accept_loop, listener, connections)
            acceptors.start_soon(server.reap_idle)
            task_status.started([_url(listener) for listener in listeners])
            await shutdown.wait()
            acceptors.cancel_scope.cancel()
        _close_all(listeners)
        server.begin_shutdown()
        with trio.move_on_after(graceful_timeout):
            await server.wait_closed()
        connections.cancel_scope.cancel()


def _unwrap(sock: trio.socket.SocketType) -> socket.socket:
    """The plain non-blocking socket under a Trio socket.

    Trio's socket methods wrap every call in an async context manager and
    yield even when the call did not block; on the hot path we call the
    socket directly and wait with `trio.lowlevel.wait_readable` and
    `wait_writable` ourselves.
    """
    plain = socket.socket(fileno=sock.detach())
    plain.setblocking(False)
    return plain


def _close_all(socks: list[socket.socket]) -> None:
    for sock in socks:
        if sock.fileno() != -1:
            trio.lowlevel.notify_closing(sock)
            sock.close()


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


#: Transient accept() failures: the peer gave up first, or we are out of file
#: descriptors or memory for a moment. The listener keeps going after them.
_ACCEPT_RETRY: Final = frozenset(
    {errno.ECONNABORTED, errno.EPROTO, errno.EPERM, errno.EINTR, errno.EAGAIN}
)
_ACCEPT_BACKOFF: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


@final
class _Server:
    """What all connections share: the app, the limits, and the set of open connections."""

    __slots__ = (
        "_all_closed",
        "_connections",
        "app",
        "closing",
        "keep_alive_timeout",
        "lifespan_state",
        "max_header_bytes",
    )

    def __init__(
        self,
        app: ASGI3App,
        lifespan_state: dict[str, Any],
        keep_alive_timeout: float,
        max_header_bytes: int,
    ) -> None:
        self.app = app
        self.lifespan_state = lifespan_state
        self.keep_alive_timeout = keep_alive_timeout
        self.max_header_bytes = max_header_bytes
        self.closing = False
        self._connections: set[_Connection] = set()
        self._all_closed = trio.Event()

    async def accept_loop(self, listener: socket.socket, nursery: trio.Nursery) -> None:
        """Accept connections forever, each served by a task in *nursery*."""
        while True:
            await trio.lowlevel.wait_readable(listener)
            # Take every waiting connection, not one: each wait_readable is a turn
            # of the scheduler, which lasts as long as every runnable task's step,
            # and with the loop busy one accept per turn left clients opening many
            # connections at once waiting seconds for their first answer.
            for _ in range(_ACCEPT_BURST):
                try:
                    sock, _ = listener.accept()
                except BlockingIOError:  # none left (or another process got it)
                    break
                except OSError as exc:
                    if exc.errno in _ACCEPT_RETRY:
                        continue
                    if exc.errno in _ACCEPT_BACKOFF:
                        log.warning("accept() failed (%s); retrying in 100ms", exc)
                        await trio.sleep(0.1)
                        break
                    raise
                nursery.start_soon(self._serve_connection, sock)

    async def _serve_connection(self, sock: socket.socket) -> None:
        try:
            sock.setblocking(False)
            # Responses go out in one write each; waiting for an ACK (Nagle) only adds latency.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Connection(self, sock, sock.getpeername()[:2], sock.getsockname()[:2])
        except OSError:  # the client is already gone
            sock.close()
            return
        self._connections.add(conn)
        try:
            async with trio.open_nursery() as nursery:
                conn.nursery = nursery
                await conn.run()
                nursery.cancel_scope.cancel()  # the watcher, if one was started
        except* Exception:
            # A bug here must cost one connection, never the server.
            log.exception("unexpected error serving a connection")
        finally:
            trio.lowlevel.notify_closing(sock)
            sock.close()
            self._connections.discard(conn)
            if self.closing and not self._connections:
                self._all_closed.set()

    async def reap_idle(self) -> None:
        """Close connections idle for longer than the keep-alive timeout, forever.

        One task checking every connection a few times per timeout, rather than
        a deadline per connection: moving a cancel scope's deadline twice per
        request (arm while idle, disarm while the app runs) costs as much as a
        scheduler round trip, and the request loop needs neither. A connection
        is closed between one and 1.25 timeouts after it fell idle.
        """
        timeout = self.keep_alive_timeout
        while True:
            await trio.sleep(timeout / 4)
            expired = trio.current_time() - timeout
            for conn in self._connections:
                if conn.idle and conn.idle_since <= expired:
                    conn.cancel_scope.cancel()

    def begin_shutdown(self) -> None:
        """Close idle connections now; busy ones close after their current response."""
        self.closing = True
        for conn in list(self._connections):
            if conn.idle:
                conn.cancel_scope.cancel()
        if not self._connections:
            self._all_closed.set()

    async def wait_closed(self) -> None:
        """Wait until every connection has closed (after `begin_shutdown`)."""
        await self._all_closed.wait()


# -- one connection ---------------------------------------------------------------------------


@final
class _Connection:
    """One client connection: the parser's callbacks, the read loop, and the request queue.

    The parser calls back into this object (``on_*``); it appends requests to
    ``_ready`` once their headers are complete, so the app can start before
    the body arrived (streaming uploads, ``Expect: 100-continue``).
    """

    __slots__ = (
        "_ahead",
        "_current",
        "_drained",
        "_head_raw",
        "_head_size",
        "_in_head",
        "_max_head",
        "_parked",
        "_parser",
        "_parsing",
        "_read_lock",
        "_ready",
        "_seq",
        "_server",
        "_watch_event",
        "_watch_scope",
        "_watched",
        "cancel_scope",
        "client",
        "error",
        "gone",
        "idle",
        "idle_since",
        "linger",
        "nursery",
        "server_addr",
        "sock",
        "stopped",
    )

    def __init__(
        self,
        server: _Server,
        sock: socket.socket,
        client: tuple[str, int],
        server_addr: tuple[str, int],
    ) -> None:
        self._server = server
        self.sock = sock
        self.client = client
        self.server_addr = server_addr
        self._parser = httptools.HttpRequestParser(self)
        self._max_head = server.max_header_bytes
        self._ready: deque[_Request] = deque()
        self._parsing: _Request | None = None
        self._current: _Request | None = None
        self._read_lock = trio.Lock()
        self.cancel_scope = trio.CancelScope()
        # Set while waiting for the next request (since `idle_since`): the
        # reaper and `begin_shutdown` close the connection then.
        self.idle = False
        self.idle_since = 0.0
        # No more input will be read: the client closed or reset, or was too slow.
        self.gone = False
        # The parser stopped (an Upgrade request, or an error): later bytes are discarded.
        self.stopped = False
        # The status of the error response owed after the queued requests (400 or 431).
        self.error: int | None = None
        # Read and discard the client's leftovers before closing.
        self.linger = False
        self._in_head = False
        self._head_size = 0
        self._head_raw = 0
        self._seq = 0
        self._ahead = 0
        self._drained = 0
        # The connection's disconnect watcher (started on first use, in `nursery`)
        # and the request it should watch next.
        self.nursery: trio.Nursery | None = None
        self._watched: _Request | None = None
        self._watch_event: trio.Event | None = None
        # The watcher's cancel scope (see `_watch_loop`); None until it starts.
        self._watch_scope: trio.CancelScope | None = None
        # A reader holds the read lock without reading: too much input is buffered.
        self._parked = False

    # The parser's callbacks. They run inside `feed_data`, synchronously.

    def on_message_begin(self) -> None:
        """Parser callback: a new request starts."""
        self._parsing = _Request(self)
        self._in_head = True
        self._head_size = 0
        self._head_raw = 0
        self._seq += 1

    def on_url(self, url: bytes) -> None:
        """Parser callback: (a piece of) the request target."""
        request = self._parsing
        assert request is not None
        request.url += url
        self._head_size += len(url)
        if self._head_size > self._max_head:
            raise _HeadTooLarge

    def on_header(self, name: bytes, value: bytes) -> None:
        """Parser callback: one complete header field."""
        request = self._parsing
        assert request is not None
        name = name.lower()
        request.headers.append((name, value))
        if name == b"expect" and value.lower() == b"100-continue":
            request.expect_continue = True
        self._head_size += len(name) + len(value) + 4
        if self._head_size > self._max_head:
            raise _HeadTooLarge

    def on_headers_complete(self) -> None:
        """Parser callback: the head is complete; the request can be served."""
        request = self._parsing
        assert request is not None
        parser = self._parser
        request.method = parser.get_method()
        request.http_version = parser.get_http_version()
        request.keep_alive = parser.should_keep_alive()
        self._in_head = False
        self._ready.append(request)

    def on_body(self, body: bytes) -> None:
        """Parser callback: a piece of the body (chunked framing already removed)."""
        request = self._parsing
        assert request is not None
        if request.discard:
            self._drained += len(body)
        else:
            request.body.append(body)

    def on_message_complete(self) -> None:
        """Parser callback: the request (body included) is complete."""
        request = self._parsing
        assert request is not None
        request.complete = True

    # Reading.

    def _feed(self, data: bytes) -> None:
        """Parse *data*; record a parse error as the error response owed."""
        seq = self._seq
        was_in_head = self._in_head
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # Served as a plain request; what follows is another protocol we do not speak.
            self.stopped = True
            upgrade = self._parsing
            assert upgrade is not None
            upgrade.keep_alive = False
            return
        except httptools.HttpParserCallbackError as exc:
            self.stopped = True
            self.error = 431 if isinstance(exc.__context__, _HeadTooLarge) else 400
            return
        except httptools.HttpParserError:
            self.stopped = True
            self.error = 400
            return
        if self._in_head and was_in_head and seq == self._seq:
            # A head that keeps growing inside one field never reaches a callback
            # (httptools buffers the field), so bound the raw bytes of the head too.
            self._head_raw += len(data)
            if self._head_raw > self._max_head:
                self.stopped = True
                self.error = 431

    async def _recv(self) -> bytes:
        """Receive some bytes (b"" at EOF); a checkpoint, like any Trio I/O.

        Waits before trying: when we read, the client is usually still
        sending, so trying first would mostly cost a failed system call, and
        when data is there already the wait is the checkpoint we owe anyway.
        """
        sock = self.sock
        while True:
            await trio.lowlevel.wait_readable(sock)
            try:
                return sock.recv(_RECV_SIZE)
            except BlockingIOError:  # a spurious wakeup
                pass

    async def _read(self) -> int:
        """Read once from the socket and parse; the byte count, 0 when the client is gone."""
        try:
            data = await self._recv()
        except OSError:  # reset by the peer, or otherwise unusable
            data = b""
        if not data:
            self.gone = True
            return 0
        if not self.stopped:
            self._feed(data)
        return len(data)

    async def read_for_app(self, request: _Request, *, waiting: bool) -> None:
        """Read for the app's ``receive``: more body, or (*waiting*) until a disconnect.

        Only one task reads at a time (an app may call ``receive`` from two
        tasks); a later caller finds the state already advanced and returns.
        """
        if waiting:
            await self._acquire_read_lock()
            try:
                while not self.gone and not request.finished:
                    if self._ahead > _AHEAD_LIMIT:
                        # Enough pipelined input buffered: leave the rest in the socket
                        # until the response is done (which wakes us).
                        self._parked = True
                        try:
                            await trio.sleep_forever()
                        finally:
                            self._parked = False
                    self._ahead += await self._read()
            finally:
                self._read_lock.release()
            return
        # The lock may be held by the watcher's last read (see `_watch_loop`): a
        # client that sends nothing more stalls this wait as much as the read.
        with trio.move_on_after(self._server.keep_alive_timeout) as timeout:
            await self._acquire_read_lock()
            try:
                if not (request.body or request.complete or self.gone or self.stopped):
                    await self._read()
            finally:
                self._read_lock.release()
        if timeout.cancelled_caught:
            log.debug("client %s:%d stalled sending a body; dropping it", *self.client)
            self.gone = True

    async def _acquire_read_lock(self) -> None:
        # Without a checkpoint when free: the read that follows is one.
        lock = self._read_lock
        if lock.locked():
            await lock.acquire()
        else:
            lock.acquire_nowait()

    async def send_all(self, data: bytes) -> bool:
        """Write *data*; False (and the client marked gone) if the connection broke.

        Not a checkpoint when the socket takes everything at once (the common
        case): the read for the next request yields instead.
        """
        sock = self.sock
        try:
            try:
                sent = sock.send(data)
            except BlockingIOError:
                sent = 0
            if sent < len(data):
                view = memoryview(data)
                while sent < len(data):
                    await trio.lowlevel.wait_writable(sock)
                    with contextlib.suppress(BlockingIOError):  # a spurious wakeup
                        sent += sock.send(view[sent:])
        except OSError:
            self.gone = True
            return False
        except BaseException:
            # Cancelled part-way, the response on the wire is cut short: the
            # connection can carry nothing more.
            self.gone = True
            raise
        return True

    # Disconnects while the app works.

    def watch(self, request: _Request) -> None:
        """Have the watcher task look for a disconnect until *request* is finished."""
        self._watched = request
        event = self._watch_event
        if event is not None:
            event.set()
        elif self.nursery is not None:
            self._watch_event = trio.Event()
            self.nursery.start_soon(self._watch_loop)

    async def _watch_loop(self) -> None:
        # One task per connection, not per request: spawning a watcher for each
        # request cost about a third of a small request's time in the server.
        # Its read is not cancelled when the response is done: it lingers until
        # the next bytes (the next request, parsed into `_ready`) or the EOF,
        # and the request loop waits for it on the read lock. Waking a task out
        # of a socket wait takes a cancellation, which cost about a tenth of a
        # small request's time in the server. One cancel scope serves many
        # requests: entering and leaving one costs about 9 us here (2-3% of a
        # small inference request's server time).
        while True:
            with trio.CancelScope() as self._watch_scope:
                await self._watch_until_cancelled()
            # Cancelled: a parked wait whose response is done, or the connection closes.

    async def _watch_until_cancelled(self) -> None:
        while True:
            request = self._watched
            if request is None:
                event = self._watch_event = trio.Event()
                await event.wait()
                continue
            self._watched = None
            if request.finished:
                continue
            await self.read_for_app(request, waiting=True)
            if self.gone and not request.finished:
                request.disconnected()

    def wake_parked(self) -> None:
        """End a watcher's wait that holds the read lock without reading (too much ahead)."""
        if self._parked:
            self._stop_watching()

    def _stop_watching(self) -> None:
        # End the watcher's current wait. Before this task reads without the lock
        # (the linger after the last response) the watcher then waits for a
        # request to watch, which no longer comes.
        if self._watch_scope is not None:
            self._watch_scope.cancel()

    # The request loop.

    async def run(self) -> None:
        """Serve requests until the connection should close, then close it politely."""
        with self.cancel_scope:
            while True:
                request = await self._next_request()
                if request is None:
                    break
                await self._handle(request)
                if not request.keep_alive:
                    break
        self._stop_watching()
        if self.gone:
            return
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            return
        current = self._current
        if self.linger or self._ready or self._in_head or (current and not current.complete):
            # Unread input at close() makes the kernel send a reset, which can
            # destroy the response before the client reads it; read until EOF.
            with trio.move_on_after(_LINGER_S):
                total = 0
                while total < _LINGER_BYTES and (n := await self._read_discarding()):
                    total += n

    async def _read_discarding(self) -> int:
        try:
            return len(await self._recv())
        except OSError:
            return 0

    async def _next_request(self) -> _Request | None:
        """The next request whose head is complete, or None to close the connection."""
        previous = self._current
        if previous is not None and not previous.complete:
            # (A client waiting for 100 Continue never got it: _head closed the connection.)
            previous.discard = True
            previous.body.clear()
            self._drained = 0
        ready = self._ready
        if ready and not self._server.closing:
            # Pipelined requests need no read, which is what yields otherwise:
            # let other connections run between them.
            await trio.lowlevel.checkpoint()
            return ready.popleft()
        if self._server.closing:
            return None
        self.idle_since = trio.current_time()
        self.idle = True
        self._ahead = 0
        try:
            while not ready:
                if self.error is not None:
                    await self._send_error(self.error)
                    return None
                if self.gone or self.stopped or self._drained > _DRAIN_LIMIT:
                    return None
                # The watcher may still be in its last read: its bytes are ours.
                await self._acquire_read_lock()
                try:
                    if not (ready or self.gone or self.stopped):
                        await self._read()
                finally:
                    self._read_lock.release()
        finally:
            self.idle = False
        if self.cancel_scope.cancel_called:  # closed (timeout, shutdown) as the request came
            return None
        return ready.popleft()

    async def _send_error(self, status: int) -> None:
        await self.send_all(_RESPONSE_431 if status == 431 else _RESPONSE_400)
        self.linger = True

    async def _handle(self, request: _Request) -> None:
        """Run the app for *request*; answer 500 if it fails before responding."""
        self._current = request
        try:
            scope = request.scope()
        except httptools.HttpParserError:
            request.keep_alive = False
            await self._send_error(400)
            return
        try:
            await self._server.app(scope, request.receive, request.send)
        except Exception:
            log.exception("exception in ASGI application (%s %s)", scope["method"], scope["path"])
            request.keep_alive = False
            if not request.head_sent and not self.gone:
                await self.send_all(_RESPONSE_500)
                self.linger = True
        else:
            if not request.finished:
                request.keep_alive = False
                if self.gone:
                    pass  # the client left; nobody is there to answer
                elif self.error is not None and not request.head_sent:
                    # The body was malformed (the app got http.disconnect): say so.
                    await self._send_error(self.error)
                elif request.head_sent:
                    log.error("ASGI application returned before its response body was complete")
                else:
                    log.error(
                        "ASGI application returned without a response (%s %s)",
                        scope["method"],
                        scope["path"],
                    )
                    await self.send_all(_RESPONSE_500)
                    self.linger = True
        finally:
            request.finish()


# -- one request ------------------------------------------------------------------------------


@final
class _Request:
    """One request/response cycle: its parsed head, its buffered body, its response state.

    Its bound ``receive`` and ``send`` are what the app gets, so that calls a
    misbehaving app makes after its request ended affect nothing else.
    """

    __slots__ = (
        "_conn",
        "_declared_length",
        "_headers",
        "_on_disconnect",
        "_sent_length",
        "_status",
        "_waiters",
        "body",
        "body_done",
        "chunked",
        "complete",
        "continue_sent",
        "discard",
        "expect_continue",
        "finished",
        "head_sent",
        "headers",
        "http_version",
        "keep_alive",
        "method",
        "no_body",
        "started",
        "url",
    )

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.method = b""
        self.http_version = "1.1"
        self.keep_alive = True
        self.expect_continue = False
        self.continue_sent = False
        self.body: list[bytes] = []
        self.complete = False
        self.body_done = False
        self.discard = False
        self.started = False
        self.head_sent = False
        self.finished = False
        self.chunked = False
        self.no_body = False
        self._status = 200
        self._headers: Iterable[tuple[bytes, bytes]] = ()
        self._declared_length = -1
        self._sent_length = 0
        self._waiters: list[trio.CancelScope] | None = None
        self._on_disconnect: list[trio.CancelScope] | None = None

    def cancel_on_disconnect(self, scope: trio.CancelScope | None = None) -> bool:
        """Cancel *scope* if the client goes away before the response is done.

        The ASGI extension ``trioinfer.cancel_on_disconnect`` (in the scope's
        ``extensions``): an app that has read the whole body registers a cancel
        scope instead of calling ``receive`` from a task of its own, and the
        connection's one watcher task serves every request on it. Returns
        False (nothing registered) if the body is not all read: the app then
        watches with ``receive``.

        Without a *scope*, the client going away cancels the task that runs
        the app (call it from that task): whatever the app awaits for this
        request raises ``trio.Cancelled``, and the connection, which has
        nobody left on it, closes. That spares the app a cancel scope of its
        own per request (entering and leaving one costs about 9 us here).
        """
        if not self.body_done or self.finished:
            return False
        conn = self._conn
        target = conn.cancel_scope if scope is None else scope
        if conn.gone:
            target.cancel()
            return True
        if self._on_disconnect is None:
            self._on_disconnect = []
        self._on_disconnect.append(target)
        conn.watch(self)
        return True

    def disconnected(self) -> None:
        """The client went away while the app worked: cancel what was registered."""
        for scope in self._on_disconnect or ():
            scope.cancel()

    def scope(self) -> Scope:
        """The ASGI HTTP connection scope."""
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
            "asgi": {"version": _ASGI_VERSION, "spec_version": _HTTP_SPEC_VERSION},
            "http_version": self.http_version,
            "server": conn.server_addr,
            "client": conn.client,
            "scheme": "http",
            "method": method,
            "root_path": "",
            "path": path,
            "raw_path": raw_path,
            "query_string": query,
            "headers": self.headers,
            "extensions": {"trioinfer.cancel_on_disconnect": self.cancel_on_disconnect},
        }
        state = conn._server.lifespan_state
        if state:
            scope["state"] = state.copy()
        return scope

    def finish(self) -> None:
        """The response is done (or abandoned): wake every ``receive`` waiting for a disconnect."""
        self.finished = True
        if self._waiters:
            for waiter in self._waiters:
                waiter.cancel()
        self._conn.wake_parked()

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
            if conn.gone or conn.stopped:  # the body can never complete
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
        with trio.CancelScope() as scope:
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
            if self.head_sent:
                data = self._frame(body, more)
            else:
                head = self._head(len(body), more)
                data = self._frame(body, more) if body or not more else b""
                self.head_sent = True  # only now: a bad message above still gets a 500
                if len(data) <= _COALESCE_LIMIT:
                    data = head + data
                elif not conn.gone:  # too big to copy just to save a write
                    await conn.send_all(head)
            if not more:
                self.finish()
            if data and not conn.gone:
                await conn.send_all(data)
        elif kind == "http.response.start":
            if self.started:
                raise RuntimeError("http.response.start sent twice")
            self.started = True
            self._status = message["status"]
            self._headers = message.get("headers", ())
        else:
            raise RuntimeError(f"expected an http.response.* message, got {kind!r}")

    def _head(self, body_length: int, more: bool) -> bytes:
        """The status line and headers, with the framing and connection headers added."""
        status = self._status
        conn = self._conn
        keep_alive = self.keep_alive and not conn._server.closing
        if self.expect_continue and not self.continue_sent and not self.complete:
            keep_alive = False  # the client holds the body back; see _next_request
        found = 0  # bit set of the _SPECIAL_HEADERS seen
        parts = [_STATUS_LINES.get(status) or _status_line(status)]
        special = _SPECIAL_HEADERS
        for name, value in self._headers:
            kind = special.get(name.lower(), 0)
            if kind:
                found |= 1 << kind
                if kind == _CONTENT_LENGTH:
                    self._declared_length = int(value)
                elif kind == _TRANSFER_ENCODING:
                    self.chunked = b"chunked" in value.lower()
                elif kind == _CONNECTION:
                    # Hop-by-hop: the server says what it will do (below).
                    if b"close" in value.lower():
                        keep_alive = False
                    continue
            parts += (name, b": ", value, b"\r\n")
        lines = (len(parts) - 1) // 4  # one per header so far
        head_request = self.method == b"HEAD"
        if status < 200 or status in (204, 304):
            self.no_body = True
        elif not found & (1 << _CONTENT_LENGTH | 1 << _TRANSFER_ENCODING):
            if not more:
                # For HEAD, the body an app sends anyway is the one GET would get.
                if body_length or not head_request:
                    parts.append(b"content-length: %d\r\n" % body_length)
                    lines += 1
            elif head_request:
                pass
            elif self.http_version != "1.0":
                parts.append(b"transfer-encoding: chunked\r\n")
                lines += 1
                self.chunked = True
            else:  # an HTTP/1.0 client knows the body ended when the connection closes
                keep_alive = False
        if head_request:
            self.no_body = True
        if self.no_body:
            self.chunked = False
        if not found & 1 << _DATE:
            parts.append(_date_header())
            lines += 1
        if not keep_alive:
            self.keep_alive = False
            parts.append(b"connection: close\r\n")
            lines += 1
        elif self.http_version == "1.0":
            parts.append(b"connection: keep-alive\r\n")
            lines += 1
        parts.append(b"\r\n")
        head = b"".join(parts)
        # One scan in C instead of a check per header: a CR or LF inside a name
        # or value would let the app's data inject headers or responses.
        if head.count(b"\n") != lines + 2 or head.count(b"\r") != lines + 2:
            raise ValueError("response header names and values must not contain CR or LF")
        return head

    def _frame(self, body: bytes, more: bool) -> bytes:
        """*body* as it goes on the wire: chunked if needed, nothing for HEAD."""
        if self.no_body:
            return b""
        if self.chunked:
            if body:
                data = b"%x\r\n%b\r\n" % (len(body), body)
                return data if more else data + b"0\r\n\r\n"
            return b"" if more else b"0\r\n\r\n"
        if self._declared_length >= 0:
            self._sent_length += len(body)
            if self._sent_length > self._declared_length:
                raise RuntimeError(
                    f"the response body is longer than its content-length, {self._declared_length}"
                )
            if not more and self._sent_length < self._declared_length:
                self.keep_alive = False  # the client is still waiting for the rest
        return body


# -- lifespan ---------------------------------------------------------------------------------


@final
class _Lifespan:
    """The ASGI lifespan protocol, in "auto" mode: an app that raises has none."""

    __slots__ = (
        "_app",
        "_scope",
        "_shutdown_done",
        "_shutdown_requested",
        "_started",
        "_startup_sent",
        "_supported",
        "failure",
        "state",
    )

    def __init__(self, app: ASGI3App) -> None:
        self._app = app
        self.state: dict[str, Any] = {}
        self._started = trio.Event()
        self._shutdown_requested = trio.Event()
        self._shutdown_done = trio.Event()
        self._startup_sent = False
        self._supported = False
        self.failure: str | None = None
        self._scope = trio.CancelScope()

    async def run(self) -> None:
        """Run the app's lifespan scope until it returns or `shutdown` ends it."""
        scope: Scope = {
            "type": "lifespan",
            "asgi": {"version": _ASGI_VERSION, "spec_version": _LIFESPAN_SPEC_VERSION},
            "state": self.state,
        }
        with self._scope:
            try:
                await self._app(scope, self._receive, self._send)
            except Exception as exc:
                if self._started.is_set():
                    log.exception("the ASGI lifespan task failed")
                else:  # like uvicorn's lifespan="auto"
                    log.info("the ASGI app does not support lifespan (%r); serving without it", exc)
            finally:
                self._started.set()
                self._shutdown_done.set()

    async def wait_started(self) -> bool:
        """Wait for the startup to complete; False if the app said it failed."""
        await self._started.wait()
        if self.failure is not None:
            self._scope.cancel()
            return False
        return True

    async def shutdown(self) -> None:
        """Run the app's lifespan shutdown, if it has a lifespan."""
        if self._supported:
            self._shutdown_requested.set()
            await self._shutdown_done.wait()
            if self.failure is not None:
                log.error("ASGI lifespan shutdown failed: %s", self.failure)
                self.failure = None  # logged; only a failed startup makes serve_asgi raise
        self._scope.cancel()

    async def _receive(self) -> Message:
        if not self._startup_sent:
            self._startup_sent = True
            return {"type": "lifespan.startup"}
        await self._shutdown_requested.wait()
        return {"type": "lifespan.shutdown"}

    async def _send(self, message: Mapping[str, Any]) -> None:
        kind = message["type"]
        if kind == "lifespan.startup.complete":
            self._supported = True
            self._started.set()
        elif kind == "lifespan.startup.failed":
            self.failure = message.get("message", "") or "(no message)"
            self._started.set()
        elif kind == "lifespan.shutdown.complete":
            self._shutdown_done.set()
        elif kind == "lifespan.shutdown.failed":
            self.failure = message.get("message", "") or "(no message)"
            self._shutdown_done.set()
        else:
            raise RuntimeError(f"expected a lifespan.* message, got {kind!r}")
