"""A lean HTTP/1.1 server for any ASGI 3 app, on Trio or asyncio, parsing with llhttp.

`serve_asgi` binds, runs the app's lifespan, accepts connections and shuts
down gracefully; the rest is split by job, as uvicorn and Hypercorn split
theirs:

- ``_framing.py``: HTTP/1.1 framing without I/O (bytes in, requests out;
  response heads and body framing out), and every rule about what a request
  may look like;
- ``_connection.py``: one connection, which owns its socket, reads into the
  framing, runs the request cycles one after another, and bounds how long
  and how much a client may hold;
- ``_cycle.py``: one request/response cycle, speaking ASGI;
- ``_lifespan.py``: the ASGI lifespan protocol;
- ``_io.py``: the few socket waits on the hot path, for Trio and asyncio.

Everything else is written against anyio. Hypercorn spends most of a small
request in h11's pure-Python state machine and in a task plus cancel scopes
per request; this server keeps one task per connection (and one for the
whole server that notices clients hanging up) and, per small request, spawns
no task, wakes no other task, enters no cancel scope and moves no deadline.

Only HTTP/1.1 (and 1.0) is served, in plaintext or over TLS (*ssl_context*:
the standard library's ``ssl`` socket, non-blocking, its handshake in the
connection's task under ``head_timeout``); no HTTP/2, no WebSocket; an
``Upgrade`` request is served as an ordinary request and the connection is
closed after it.
"""

from __future__ import annotations

import errno
import logging
import socket
import ssl
from typing import Final, Protocol, final

import anyio
import anyio.abc

from ._connection import Connection, Hangups, Shared, hangup_watcher
from ._cycle import ASGI3App
from ._io import IO, open_io
from ._lifespan import Lifespan
from ._tls import ReloadingContext, tls_handshake

__all__ = ["ASGI3App", "serve_asgi"]

log = logging.getLogger("trioinfer.server")

_BACKLOG: Final = 1024
# Most connections accepted per wake-up of the accept loop.
_ACCEPT_BURST: Final = 256

#: Transient accept() failures: the peer gave up first, or we are out of file
#: descriptors or memory for a moment. The listener keeps going after them.
_ACCEPT_RETRY: Final = frozenset(
    {errno.ECONNABORTED, errno.EPROTO, errno.EPERM, errno.EINTR, errno.EAGAIN}
)
_ACCEPT_BACKOFF: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


class _Waitable(Protocol):
    """An event to wait for: `anyio.Event`, or `trio.Event` on Trio."""

    async def wait(self) -> object:
        """Return once the event is set."""
        ...


async def serve_asgi(
    app: ASGI3App,
    host: str,
    port: int,
    *,
    shutdown: _Waitable,
    graceful_timeout: float,
    head_timeout: float = 5.0,
    body_timeout: float = 30.0,
    send_timeout: float = 30.0,
    max_head_bytes: int = 64 * 1024,
    max_headers: int = 100,
    reuse_port: bool = False,
    ssl_context: ssl.SSLContext | ReloadingContext | None = None,
    task_status: anyio.abc.TaskStatus[list[str]] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve *app* over HTTP/1.1 on *host*:*port* until *shutdown* is set, then drain.

    Runs on Trio or asyncio. Binds, runs the app's ASGI lifespan startup (an
    app that raises on the lifespan scope is served without one; connections
    made meanwhile wait in the backlog), then reports the base URLs through
    *task_status*. Keep-alive is the default for HTTP/1.1 and pipelined
    requests are answered in order. Malformed or ambiguous requests (see
    ``_framing.py``) get 400 with the reason, oversized heads 431, other
    HTTP versions 505, and an app that fails before it responds 500 (logged
    on ``trioinfer.server``); each closes the connection. When *shutdown* is
    set the listeners close at once, idle connections are closed, and
    requests in flight get up to *graceful_timeout* seconds to finish (their
    responses say ``connection: close``) before they are cancelled; then the
    lifespan shutdown runs and the function returns. Cancelling the caller's
    scope stops everything at once instead.

    Args:
        app: The ASGI 3 application.
        host: The address to bind, e.g. ``"127.0.0.1"``.
        port: The port; 0 picks a free one (read it from the reported URL).
        shutdown: Set it to stop gracefully.
        graceful_timeout: How long in-flight requests may run after *shutdown*.
        head_timeout: How long a connection may wait for a request's head to be
            complete, counted from when it opened or answered its last request:
            idle keep-alive connections, silent ones and slow-header ones close then.
        body_timeout: How long a read of a body the app waits for may get nothing.
        send_timeout: How long a response may wait for the client to read any of it.
        max_head_bytes: The most bytes of request line plus headers (and of
            trailers) accepted; bigger requests get 431 and the connection closes.
        max_headers: The most header fields one request may carry (431 over it).
        reuse_port: Bind with ``SO_REUSEPORT``, so that other processes serving
            the same app on the same port share its connections (the kernel
            spreads them), as ``trioinfer serve --workers`` does.
        ssl_context: Serve HTTPS with this server-side context (see
            ``_tls.server_context``, with ALPN ``http/1.1``), or a
            ``_tls.ReloadingContext`` (each connection handshakes with the
            files' latest usable state): each connection's handshake must end
            within *head_timeout*, or the client is dropped (as is one that
            fails it). None: plain HTTP.
        task_status: Receives the listening URLs, e.g. ``["http://127.0.0.1:8000"]``
            (``https://`` with *ssl_context*), for ``start``.

    Raises:
        ValueError: A timeout is not positive, or a size limit is not.
        RuntimeError: The app reported that its lifespan startup failed.
        OSError: The address could not be bound.
    """
    timeouts = (head_timeout, body_timeout, send_timeout)
    if not all(t > 0 for t in timeouts) or not graceful_timeout >= 0:
        raise ValueError(
            "expected head_timeout, body_timeout and send_timeout > 0 and graceful_timeout "
            f">= 0; got {head_timeout}, {body_timeout}, {send_timeout} and {graceful_timeout}"
        )
    if max_head_bytes <= 0 or max_headers <= 0:
        raise ValueError(
            f"expected max_head_bytes > 0 and max_headers > 0, got {max_head_bytes} and "
            f"{max_headers}"
        )
    io = open_io()
    # Bound before the lifespan startup: connections made meanwhile wait in the
    # backlog, and a bind error is raised as itself, not inside an ExceptionGroup.
    listeners = await _open_listeners(host, port, reuse_port=reuse_port)
    lifespan = Lifespan(app)
    hangups = hangup_watcher(io)
    try:
        async with anyio.create_task_group() as root:
            root.start_soon(lifespan.run)
            if await lifespan.wait_started():
                shared = Shared(
                    app,
                    io,
                    lifespan.state,
                    head_timeout=head_timeout,
                    body_timeout=body_timeout,
                    send_timeout=send_timeout,
                    max_head_bytes=max_head_bytes,
                    max_headers=max_headers,
                    hangups=hangups,
                )
                server = _Server(shared, ssl_context)
                await _serve(server, listeners, shutdown, graceful_timeout, task_status)
            await lifespan.shutdown()
    finally:
        _close_all(io, listeners)
        if hangups is not None:
            hangups.close()
    if lifespan.failure is not None:
        raise RuntimeError(f"ASGI lifespan startup failed: {lifespan.failure}")


async def _serve(
    server: _Server,
    listeners: list[socket.socket],
    shutdown: _Waitable,
    graceful_timeout: float,
    task_status: anyio.abc.TaskStatus[list[str]],
) -> None:
    io = server.shared.io
    hangups = server.shared.hangups
    async with anyio.create_task_group() as connections:
        if hangups is not None:
            # In the connections' group: a client hanging up during the drain is still seen.
            connections.start_soon(hangups.run)
        async with anyio.create_task_group() as acceptors:
            for listener in listeners:
                acceptors.start_soon(server.accept_loop, listener, connections)
            acceptors.start_soon(server.reap_idle)
            scheme = "https" if server.tls is not None else "http"
            task_status.started([_url(listener, scheme) for listener in listeners])
            await shutdown.wait()
            acceptors.cancel_scope.cancel()
        _close_all(io, listeners)
        server.begin_shutdown()
        with anyio.move_on_after(graceful_timeout):
            await server.wait_closed()
        connections.cancel_scope.cancel()


async def _open_listeners(
    host: str, port: int, *, reuse_port: bool = False, listen: bool = True
) -> list[socket.socket]:
    """Plain non-blocking listening sockets on every address *host* resolves to.

    The server calls them directly (``accept``) and waits through ``_io.py``.
    """
    infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    listeners: list[socket.socket] = []
    seen = set()
    try:
        for family, kind, proto, _name, address in infos:
            if (family, address) in seen:
                continue
            seen.add((family, address))
            sock = socket.socket(family, kind, proto)
            listeners.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                # One socket per family, as Trio does: no IPv4-mapped addresses here.
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            if listen:
                sock.listen(_BACKLOG)
            sock.setblocking(False)
    except BaseException:
        for sock in listeners:
            sock.close()
        raise
    return listeners


async def check_bindable(host: str, port: int) -> None:
    """Bind every address of *host* at *port* as the server would, and let go at once.

    Raises the OSError the server's own bind would raise (the port in use,
    an address not of this host), so that it is said before the models load
    rather than after. Something may still take the port in between: the
    server's bind reports that too.
    """
    for sock in await _open_listeners(host, port, listen=False):
        sock.close()


def _close_all(io: IO, socks: list[socket.socket]) -> None:
    for sock in socks:
        if sock.fileno() != -1:
            io.notify_closing(sock)
            sock.close()


def _url(sock: socket.socket, scheme: str = "http") -> str:
    host, port = sock.getsockname()[:2]
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"


@final
class _Server:
    """The set of open connections, and what runs across them: accepting, reaping, shutdown."""

    __slots__ = ("_all_closed", "_connections", "shared", "tls")

    def __init__(
        self, shared: Shared, tls: ssl.SSLContext | ReloadingContext | None = None
    ) -> None:
        self.shared = shared
        #: Serve each connection over TLS with this context (None: plaintext).
        self.tls = tls
        self._connections: set[Connection] = set()
        self._all_closed = anyio.Event()

    async def accept_loop(self, listener: socket.socket, task_group: anyio.abc.TaskGroup) -> None:
        """Accept connections forever, each served by a task in *task_group*."""
        wait_readable = self.shared.io.wait_readable
        while True:
            await wait_readable(listener)
            # Take every waiting connection, not one: each wait is a turn of the
            # scheduler, which lasts as long as every runnable task's step, and
            # with the loop busy one accept per turn left clients opening many
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
                        await anyio.sleep(0.1)
                        break
                    raise
                task_group.start_soon(self._serve_connection, sock)

    async def _serve_connection(self, sock: socket.socket) -> None:
        shared = self.shared
        if self.tls is not None:
            secured = await tls_handshake(sock, self.tls, shared.io, shared.head_timeout)
            if secured is None:
                return
            sock = secured
        try:
            sock.setblocking(False)
            # Responses go out in one write each; waiting for an ACK (Nagle) only adds latency.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = Connection(shared, sock, sock.getpeername()[:2], sock.getsockname()[:2])
        except OSError:  # the client is already gone
            sock.close()
            return
        self._connections.add(conn)
        try:
            await conn.run()
        except Exception:
            # A bug here must cost one connection, never the server.
            log.exception("unexpected error serving a connection")
        finally:
            if conn.watched:
                hangups: Hangups | None = shared.hangups
                assert hangups is not None
                hangups.discard(conn)
            shared.io.notify_closing(sock)
            sock.close()
            self._connections.discard(conn)
            if shared.closing and not self._connections:
                self._all_closed.set()

    async def reap_idle(self) -> None:
        """Close connections that waited for a request head longer than ``head_timeout``, forever.

        One task checking every connection a few times per timeout, rather than
        a deadline per connection: moving a cancel scope's deadline twice per
        request (arm while idle, disarm while the app runs) costs as much as a
        scheduler round trip, and the request loop needs neither. A connection
        is closed between one and 1.25 timeouts after it fell idle.
        """
        shared = self.shared
        while True:
            await anyio.sleep(shared.head_timeout / 4)
            # Rounds rather than the clock, read by each connection falling idle:
            # one that fell idle in round t has waited more than k - t - 1
            # quarters at round k, so round t + 5 closes it after 1 to 1.25 timeouts.
            shared.idle_tick += 1
            expired = shared.idle_tick - 5
            for conn in self._connections:
                if conn.idle and conn.idle_since <= expired:
                    conn.close_now()

    def begin_shutdown(self) -> None:
        """Close idle connections now; busy ones close after their current response."""
        self.shared.closing = True
        for conn in list(self._connections):
            if conn.idle:
                conn.close_now()
        if not self._connections:
            self._all_closed.set()

    async def wait_closed(self) -> None:
        """Wait until every connection has closed (after `begin_shutdown`)."""
        await self._all_closed.wait()
