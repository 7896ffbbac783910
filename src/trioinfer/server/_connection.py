"""One client connection: it owns the socket, reads into the framing, runs the request cycles.

A connection is one task. It reads until a request's head is complete (the
framing, ``_framing.py``, turns bytes into requests), then calls the app in
the same task through a `RequestCycle` (``_cycle.py``). On the path of a small
request it spawns no task, enters no cancel scope and moves no deadline: the
socket is called directly (waiting through ``_io.py`` only when a call would
block), and a whole response (status line, headers and body) goes out in one
``send``.

The app's ``receive`` reads the socket itself when it needs more body, so the
body is read only as fast as the app consumes it (backpressure for free).
After the whole body was delivered, ``receive`` keeps reading to notice the
client going away (EOF or reset gives ``http.disconnect``). An app that
registers a cancel scope with the ``trioinfer.cancel_on_disconnect``
extension instead has the server's one `Hangups` watcher notice it: the
connection's socket is in a private epoll set, edge-triggered on the peer's
hang-up only (``EPOLLRDHUP``, a reset's ``EPOLLHUP`` / ``EPOLLERR``), which
one task waits on for every connection. So a request spawns no task, wakes
no other task and makes no system call to be watched, and bytes that arrive
meanwhile (the next request) wake nobody: the request loop reads them when
the response is done. (A watcher task per connection that read the socket
for each request cost two task wake-ups, two events and a reading turn
handed back and forth per request.) Where epoll is missing the extension
registers nothing and the app watches with ``receive``.

Bounds, so that no client can hold memory or a connection for long:

- bytes read ahead while the app waits in ``receive`` for a disconnect
  (pipelined requests) are bounded by ``_AHEAD_LIMIT``; then the socket is
  left unread until the response is done, and the client's own sends block
  (with the extension nothing is read while the app works). The framing
  parses no further than the next request, so those bytes stay bytes, not a
  Python object per request;
- the next request's head must be complete within ``head_timeout`` of the
  connection falling idle (a silent client, a slow-header one): the server's
  reaper closes it then;
- a body must keep arriving: a read the app waits on that gets nothing for
  ``body_timeout`` ends the request as a disconnect;
- a response must keep leaving: a client that reads nothing of it for
  ``send_timeout`` is dropped, and while a response waits for it the
  connection reads none of its further requests.
"""

from __future__ import annotations

import logging
import select
import socket
import ssl
from contextlib import suppress
from functools import partial
from typing import Any, Final, final

import anyio
import httptools

from ._cycle import ASGI3App, RequestCycle
from ._framing import FramingError, RequestFraming, error_response
from ._io import IO, Event

__all__ = ["Connection", "Hangups", "Shared", "hangup_watcher"]

log = logging.getLogger("trioinfer.server")

_RECV_SIZE: Final = 64 * 1024
#: While an app works, pipelined input read meanwhile is kept up to about this
#: many bytes; then the socket is left unread until the current response is
#: done (the client's sends block: backpressure).
_AHEAD_LIMIT: Final = 64 * 1024
#: An unread request body is read and discarded to keep the connection alive
#: only up to this size; past it closing is cheaper than reading.
_DRAIN_LIMIT: Final = 1024 * 1024
#: After an error response, how long to read and discard what the client still
#: sends before closing, so that the close does not reset the connection (a
#: reset can destroy the response before the client has read it).
_LINGER_S: Final = 1.0
_LINGER_BYTES: Final = 1024 * 1024

_RESPONSE_500: Final = error_response(500, "the server failed to answer this request")

#: What the hang-up watcher asks epoll for: the peer's FIN (EPOLLHUP and
#: EPOLLERR, a reset, come anyway), edge-triggered, so that data arriving
#: wakes nobody and a hang-up is reported once.
_HANGUP_EVENTS: Final = getattr(select, "EPOLLRDHUP", 0) | getattr(select, "EPOLLET", 0)
#: Most hang-ups taken per wake-up of the watcher.
_HANGUP_BURST: Final = 256


@final
class Hangups:
    """Notices clients that hang up while their request is in flight, for every connection.

    One task (`run`) waits on a private epoll set holding the sockets of
    connections whose app asked to be told (``trioinfer.cancel_on_disconnect``),
    edge-triggered on the peer's hang-up only; a connection is added on its
    first such request and stays until it closes. Made by `hangup_watcher`.
    """

    __slots__ = ("_connections", "_epoll", "_io")

    def __init__(self, io: IO, epoll: select.epoll) -> None:
        self._io = io
        self._epoll = epoll
        self._connections: dict[int, Connection] = {}

    def add(self, conn: Connection) -> bool:
        """Watch *conn*'s socket until `discard`; False if it cannot be (it is closed)."""
        fd = conn.sock.fileno()
        try:
            # A peer that hung up already is reported at once (epoll polls on insertion).
            self._epoll.register(fd, _HANGUP_EVENTS)
        except OSError:
            return False
        self._connections[fd] = conn
        return True

    def discard(self, conn: Connection) -> None:
        """Stop watching *conn* (before its socket is closed)."""
        fd = conn.sock.fileno()
        if self._connections.get(fd) is conn:
            del self._connections[fd]
            with suppress(OSError):
                self._epoll.unregister(fd)

    async def run(self) -> None:
        """Tell each watched connection its client hung up, forever."""
        epoll = self._epoll
        wait_readable = self._io.wait_readable
        connections = self._connections
        while True:
            await wait_readable(epoll)
            for fd, _events in epoll.poll(0, _HANGUP_BURST):
                conn = connections.get(fd)
                if conn is None:
                    continue
                try:
                    conn.hung_up()
                except Exception:
                    # A bug here must cost one connection, never the server (the
                    # watcher serves them all): close this one.
                    log.exception("unexpected error telling a connection its client hung up")
                    conn.gone = True
                    conn.cancel_scope.cancel()

    def close(self) -> None:
        """Close the epoll set (after `run` has ended)."""
        self._io.notify_closing(self._epoll)
        self._epoll.close()
        self._connections.clear()


def hangup_watcher(io: IO) -> Hangups | None:
    """A `Hangups` for *io*'s loop, or None where epoll (Linux) is missing."""
    if not hasattr(select, "epoll") or not hasattr(select, "EPOLLRDHUP"):
        return None  # pragma: no cover - Linux has both
    try:
        epoll = select.epoll()
    except OSError as exc:  # out of file descriptors: serve, watching the slower way
        log.warning("no epoll set for hang-ups (%s): each request watches its own socket", exc)
        return None
    return Hangups(io, epoll)


@final
class Shared:
    """What every connection of one server shares: the app, the I/O calls, the limits.

    Attributes:
        app: The ASGI 3 application.
        io: The event loop's I/O calls.
        lifespan_state: The state the app's lifespan startup left, copied into each scope.
        head_timeout: Seconds a connection may wait for a request head to be complete.
        body_timeout: Seconds a read of the body the app waits for may get nothing.
        send_timeout: Seconds a response may wait for the client to read anything.
        max_head_bytes: The most bytes of request line and headers.
        max_headers: The most header fields in one request.
        closing: The server is shutting down: no request starts any more.
        hangups: The server's hang-up watcher, or None where there is none.
        idle_tick: The idle reaper's rounds so far (see ``_http_server.py``).
    """

    __slots__ = (
        "app",
        "body_timeout",
        "closing",
        "hangups",
        "head_timeout",
        "idle_tick",
        "io",
        "lifespan_state",
        "max_head_bytes",
        "max_headers",
        "send_timeout",
    )

    def __init__(
        self,
        app: ASGI3App,
        io: IO,
        lifespan_state: dict[str, Any],
        *,
        head_timeout: float,
        body_timeout: float,
        send_timeout: float,
        max_head_bytes: int,
        max_headers: int,
        hangups: Hangups | None = None,
    ) -> None:
        self.app = app
        self.io = io
        self.lifespan_state = lifespan_state
        self.head_timeout = head_timeout
        self.body_timeout = body_timeout
        self.send_timeout = send_timeout
        self.max_head_bytes = max_head_bytes
        self.max_headers = max_headers
        self.closing = False
        self.hangups = hangups
        # Counts the idle reaper's rounds (a quarter of ``head_timeout`` each): a
        # connection falling idle notes it rather than reading the clock.
        self.idle_tick = 0


@final
class Connection:
    """One client connection: the read loop, the request loop, writes, hang-ups."""

    __slots__ = (
        "_current",
        "_hung_up",
        "_reader_free",
        "_reading",
        "_watched",
        "cancel_scope",
        "client",
        "closed_by_server",
        "framing",
        "gone",
        "idle",
        "idle_since",
        "io",
        "lifespan_state",
        "linger",
        "scheme",
        "server_addr",
        "shared",
        "sock",
        "watched",
    )

    def __init__(
        self,
        shared: Shared,
        sock: socket.socket,
        client: tuple[str, int],
        server_addr: tuple[str, int],
    ) -> None:
        self.shared = shared
        self.io = shared.io
        # The lifespan state to copy into each request's scope.
        self.lifespan_state = shared.lifespan_state
        self.sock = sock
        self.client = client
        self.server_addr = server_addr
        #: The ASGI scope's scheme: "https" on a TLS socket (``_tls.tls_handshake``).
        self.scheme = "https" if isinstance(sock, ssl.SSLSocket) else "http"
        self.framing = RequestFraming(
            max_head_bytes=shared.max_head_bytes,
            max_headers=shared.max_headers,
            make_head=partial(RequestCycle, self),
        )
        self._current: RequestCycle | None = None
        # Whether a task is reading the socket, and an event for those waiting
        # to read next (made only when one does).
        self._reading = False
        self._reader_free: Event | None = None
        self.cancel_scope = anyio.CancelScope()
        # `close_now` was called: the idle reaper or the shutdown closes this connection.
        self.closed_by_server = False
        # Set while waiting for the next request (since the reaper's round
        # `idle_since`): the reaper and the shutdown close the connection then.
        self.idle = False
        self.idle_since = 0
        # No more input will be read: the client closed or reset, or was too slow.
        self.gone = False
        # Read and discard the client's leftovers before closing.
        self.linger = False
        # In the server's `Hangups` (from the first watched request on).
        self.watched = False
        # The request whose app asked to hear of a hang-up (finished or not).
        self._watched: RequestCycle | None = None
        # The hang-up watcher saw the client hang up (reported once: edge-triggered).
        self._hung_up = False

    # Reading.

    async def _recv(self) -> bytes:
        """Receive some bytes (b"" at EOF); a checkpoint, like any I/O.

        Waits before trying: when we read, the client is usually still
        sending, so trying first would mostly cost a failed system call, and
        when data is there already the wait is the checkpoint we owe anyway.
        """
        sock = self.sock
        wait_readable = self.io.wait_readable
        while True:
            await wait_readable(sock)
            try:
                return sock.recv(_RECV_SIZE)
            except BlockingIOError:  # a spurious wakeup
                pass

    async def _read(self) -> int:
        """Read once from the socket into the framing; the byte count, 0 when the client is gone."""
        # `_recv`'s loop written out: this runs once per request.
        sock = self.sock
        wait_readable = self.io.wait_readable
        try:
            while True:
                await wait_readable(sock)
                try:
                    data = sock.recv(_RECV_SIZE)
                    break
                except BlockingIOError:  # a spurious wakeup
                    pass
        except OSError:  # reset by the peer, or otherwise unusable
            data = b""
        if not data:
            self.gone = True
            return 0
        self.framing.receive_data(data)
        return len(data)

    async def _take_reading_turn(self) -> None:
        # Only one task reads at a time: an app may call `receive` from two
        # tasks, or leave one reading after its response. Callers
        # check `_reading` first and then set it themselves: when the turn is
        # free (nearly always) that spares a coroutine, and the read that
        # follows is the checkpoint.
        while self._reading:
            event = self._reader_free
            if event is None:
                event = self._reader_free = self.io.event()
            await event.wait()

    def _give_reading_turn(self) -> None:
        self._reading = False
        event = self._reader_free
        if event is not None:
            self._reader_free = None
            event.set()

    async def read_for_app(self, request: RequestCycle, *, waiting: bool) -> None:
        """Read for the app's ``receive``: more body, or (*waiting*) until a disconnect.

        A later caller finds the state already advanced and returns.
        """
        if waiting:
            if self._reading:
                await self._take_reading_turn()
            self._reading = True
            # Counted per waiting call: a count kept on the connection would take
            # in what an earlier request's wait read of this one (a large body)
            # and park this wait for good, so that a client that left went unseen.
            ahead = 0
            try:
                while not self.gone and not request.finished:
                    if ahead > _AHEAD_LIMIT:
                        # Enough pipelined input kept: leave the rest in the socket
                        # until the response is done (which cancels this wait).
                        await anyio.sleep_forever()
                    ahead += await self._read()
            finally:
                self._give_reading_turn()
            return
        # The turn may be held by another `receive` of the app's: a client that
        # sends nothing more stalls this wait as much as the read.
        framing = self.framing
        with anyio.move_on_after(self.shared.body_timeout) as timeout:
            if self._reading:
                await self._take_reading_turn()
            self._reading = True
            try:
                if not (request.body or request.complete or self.gone or framing.stopped):
                    await self._read()
            finally:
                self._give_reading_turn()
        if timeout.cancelled_caught:
            log.debug("client %s:%d stalled sending a body; dropping it", *self.client)
            self.gone = True

    async def send_all(self, data: bytes) -> bool:
        """Write *data*; False (and the client marked gone) if the connection broke.

        Not a checkpoint when the socket takes everything at once (the common
        case): the read for the next request yields instead. A client that
        reads nothing for ``send_timeout`` is dropped.
        """
        sock = self.sock
        try:
            try:
                sent = sock.send(data)
            except BlockingIOError:
                sent = 0
            if sent < len(data):
                await self._send_rest(data, sent)
        except OSError:
            self.gone = True
            return False
        except BaseException:
            # Cancelled part-way, the response on the wire is cut short: the
            # connection can carry nothing more.
            self.gone = True
            raise
        return not self.gone

    async def _send_rest(self, data: bytes, sent: int) -> None:
        view = memoryview(data)
        sock = self.sock
        wait_writable = self.io.wait_writable
        timeout = self.shared.send_timeout
        while sent < len(data):
            with anyio.move_on_after(timeout) as waited:
                await wait_writable(sock)
            if waited.cancelled_caught:
                log.debug("client %s:%d reads nothing of its response; dropping it", *self.client)
                self.gone = True
                return
            with suppress(BlockingIOError):  # a spurious wakeup
                sent += sock.send(view[sent:])

    def close_now(self) -> None:
        """Close the connection now, whatever it is doing (the idle reaper, the shutdown)."""
        self.closed_by_server = True
        self.cancel_scope.cancel()

    # Hang-ups while the app works.

    def watch(self, request: RequestCycle) -> bool:
        """Have the server's `Hangups` tell *request* if the client hangs up; False if none can."""
        if not self.watched:
            hangups = self.shared.hangups
            if hangups is None or not hangups.add(self):
                return False
            self.watched = True
        self._watched = request
        return True

    @property
    def hung_up_seen(self) -> bool:
        """The hang-up watcher saw the client hang up (and will not say so again)."""
        return self._hung_up

    def hung_up(self) -> None:
        """The client hung up (the `Hangups` watcher saw a FIN or a reset).

        A request in flight that asked to be told is: the connection reads
        nothing more, and the request's cancel scopes are cancelled. Otherwise
        the request loop's next read finds the EOF itself, and a request
        that asks later hears of it at once (the edge is not reported again).
        """
        self._hung_up = True
        request = self._watched
        if request is not None and not request.finished:
            self.gone = True
            request.disconnected()

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
        if self.gone:
            return
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            return
        framing = self.framing
        current = self._current
        if (
            self.linger
            or framing.has_request
            or framing.in_request
            or (current is not None and not current.complete)
        ):
            # Unread input at close() makes the kernel send a reset, which can
            # destroy the response before the client reads it; read until EOF.
            with anyio.move_on_after(_LINGER_S):
                total = 0
                while total < _LINGER_BYTES and (n := await self._read_discarding()):
                    total += n

    async def _read_discarding(self) -> int:
        try:
            return len(await self._recv())
        except OSError:
            return 0

    async def _next_request(self) -> RequestCycle | None:
        """The next request whose head is complete, or None to close the connection."""
        framing = self.framing
        previous = self._current
        if previous is not None and not previous.complete:
            # (A client waiting for 100 Continue never got it: its response closed
            # the connection.)
            previous.discard = True
            previous.body.clear()
            framing.discarded = 0
        if self.shared.closing or self.gone:
            # Gone: nothing more can be answered (and a client that reads
            # nothing gets none of its further requests served either).
            return None
        request = framing.next_request()
        if request is not None:
            # Pipelined requests need no read, which is what yields otherwise:
            # let other connections run between them.
            await self.io.checkpoint()
            return request  # type: ignore[return-value]  # made by make_head
        self.idle_since = self.shared.idle_tick
        self.idle = True
        try:
            while True:
                if framing.error is not None:
                    await self._send_error(framing.error)
                    return None
                if self.gone or framing.upgraded or framing.discarded > _DRAIN_LIMIT:
                    return None
                # An app's `receive` left reading after its response: its bytes are ours.
                # (Without that wait nothing ran since `next_request` found no
                # request, the framing is not stopped and the client not gone: checked
                # just above.)
                if self._reading:
                    await self._take_reading_turn()
                    if framing.has_request or self.gone or framing.stopped:
                        self._give_reading_turn()
                        request = framing.next_request()
                        if request is not None:
                            break
                        continue
                self._reading = True
                try:
                    await self._read()
                finally:
                    self._give_reading_turn()
                request = framing.next_request()
                if request is not None:
                    break
        finally:
            self.idle = False
        # Closed (timeout, shutdown) as the request came? The scope is only ever
        # cancelled by `close_now` or for a client gone: asking Trio (which reads
        # the clock to answer) only then spares that for every other request.
        if (self.closed_by_server or self.gone) and self.cancel_scope.cancel_called:
            return None
        return request  # type: ignore[return-value]  # made by make_head

    async def _send_error(self, error: FramingError) -> None:
        log.debug("client %s:%d: %s", *self.client, error)
        await self.send_all(error_response(error.status, error.reason))
        self.linger = True

    async def _handle(self, request: RequestCycle) -> None:
        """Run the app for *request*; answer 500 if it fails before responding."""
        self._current = request
        try:
            scope = request.scope()
        except httptools.HttpParserError:
            request.keep_alive = False
            await self._send_error(FramingError(400, "the request target is not a valid URL"))
            return
        try:
            await self.shared.app(scope, request.receive, request.send)
        except Exception:
            if request.finished:
                # Answered, then raised again (Starlette's error handler does that
                # after its 500, which it logged): said once is enough.
                log.debug("ASGI application raised after its response", exc_info=True)
            else:
                log.exception(
                    "exception in ASGI application (%s %s)", scope["method"], scope["path"]
                )
            request.keep_alive = False
            if not request.head_sent and not self.gone:
                await self.send_all(_RESPONSE_500)
                self.linger = True
        else:
            if not request.finished:
                request.keep_alive = False
                error = self.framing.error
                if self.gone:
                    pass  # the client left; nobody is there to answer
                elif error is not None and not request.head_sent:
                    # The body was malformed (the app got http.disconnect): say so.
                    await self._send_error(error)
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
            if not request.finished:
                request.finish()
