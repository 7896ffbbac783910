"""The few I/O calls the HTTP server makes on its hot path, for Trio and for asyncio.

Everything else in the server is written against anyio (task groups, cancel
scopes, events, sleeps), which runs on both loops. These calls are not,
because anyio's generic versions cost what a small request cannot afford:
looking the backend up on every call, and on asyncio registering and
unregistering the socket with the selector on every wait (two system calls
per read). `open_io` picks one implementation per server, once:

- on Trio, Trio's own ``wait_readable``, ``wait_writable``, ``notify_closing``,
  ``checkpoint``, ``current_time`` and ``Event``, called directly;
- on asyncio, a socket stays registered with the selector from its first wait
  until it is closed, and a readiness callback wakes the one waiting task
  through a future. The registration is dropped while nobody waits and the
  socket stays readable (the selector is level-triggered: it would call back
  on every turn of the loop), and made again at the next wait.

A socket here is a plain non-blocking `socket.socket`; the server calls
``recv``, ``send`` and ``accept`` on it directly and waits only when one
would block.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Final, Protocol, final

import sniffio

__all__ = ["IO", "Event", "HasFileno", "open_io"]


class HasFileno(Protocol):
    """A socket, or anything else the loop can wait on (an epoll object)."""

    def fileno(self) -> int:
        """The file descriptor."""
        ...


class Event(Protocol):
    """An event of the loop's own kind (`trio.Event` or `asyncio.Event`)."""

    def set(self) -> None:
        """Wake every waiter, now and later."""
        ...

    def is_set(self) -> bool:
        """Whether `set` was called."""
        ...

    async def wait(self) -> object:
        """Return once the event is set."""
        ...


class IO(Protocol):
    """Readiness waits, clocks and events for one event loop (see `open_io`)."""

    #: Makes an event of the loop's own kind (the connection makes one when two
    #: of an app's ``receive`` calls wait to read at once); anyio's wrapper
    #: around the loop's event costs a few microseconds more.
    event: Callable[[], Event]

    def wait_readable(self, sock: HasFileno) -> Awaitable[None]:
        """Wait until *sock* may be read (or accepted from) without blocking; a checkpoint."""
        ...

    def wait_writable(self, sock: socket.socket) -> Awaitable[None]:
        """Wait until *sock* may be written without blocking; a checkpoint."""
        ...

    def notify_closing(self, sock: HasFileno) -> None:
        """Forget *sock* before it is closed; a task still waiting on it is woken with an error."""
        ...

    def checkpoint(self) -> Awaitable[None]:
        """Let other tasks run (and a cancellation arrive)."""
        ...

    def current_time(self) -> float:
        """The event loop's clock, in seconds (only differences mean anything)."""
        ...

    def wall_time(self) -> float:
        """Seconds since the epoch, for the ``date`` header."""
        ...


def open_io() -> IO:
    """The `IO` for the event loop this is called from (Trio or asyncio).

    Raises:
        RuntimeError: Neither Trio nor asyncio runs this task.
    """
    library = sniffio.current_async_library()
    if library == "trio":
        return _TrioIO()
    if library == "asyncio":
        return _AsyncioIO(asyncio.get_running_loop())
    raise RuntimeError(f"the HTTP server runs on trio or asyncio, not on {library}")


@final
class _TrioIO:
    """Trio's own calls, bound once: no wrapper on the hot path."""

    __slots__ = (
        "checkpoint",
        "current_time",
        "event",
        "notify_closing",
        "wait_readable",
        "wait_writable",
        "wall_time",
    )

    def __init__(self) -> None:
        import trio

        self.wait_readable: Callable[[HasFileno], Awaitable[None]] = trio.lowlevel.wait_readable
        self.wait_writable: Callable[[socket.socket], Awaitable[None]] = trio.lowlevel.wait_writable
        self.notify_closing: Callable[[HasFileno], None] = trio.lowlevel.notify_closing
        self.checkpoint: Callable[[], Awaitable[None]] = trio.lowlevel.checkpoint
        self.current_time: Callable[[], float] = trio.current_time
        self.wall_time: Callable[[], float] = time.time
        self.event: Callable[[], Event] = trio.Event


class ClosedError(OSError):
    """The socket was closed while a task waited on it."""


@final
class _Registration:
    """One socket's place in the asyncio selector, and the task waiting on each side."""

    __slots__ = ("fd", "reader", "reading", "unwaited", "writer")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.reading = False  # registered with add_reader
        # Readiness callbacks in a row that found nobody waiting (see _readable).
        self.unwaited = 0
        self.reader: asyncio.Future[None] | None = None
        self.writer: asyncio.Future[None] | None = None


_CLOSED: Final = "the socket was closed while a task waited on it"


@final
class _AsyncioIO:
    """asyncio's selector, with each socket registered once rather than once per wait."""

    __slots__ = ("_loop", "_registered", "current_time", "event")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._registered: dict[int, _Registration] = {}
        self.current_time: Callable[[], float] = loop.time
        self.event: Callable[[], Event] = asyncio.Event

    async def wait_readable(self, sock: HasFileno) -> None:
        """See `IO.wait_readable`."""
        fd = sock.fileno()
        entry = self._registered.get(fd)
        if entry is None:
            entry = self._registered[fd] = _Registration(fd)
        if entry.reader is not None:
            raise RuntimeError("another task is already waiting to read this socket")
        future = entry.reader = self._loop.create_future()
        if not entry.reading:
            self._loop.add_reader(fd, self._readable, entry)
            entry.reading = True
        try:
            await future
        finally:
            entry.reader = None

    def _readable(self, entry: _Registration) -> None:
        future = entry.reader
        if future is None:
            # Nobody waits: stop watching, or the selector calls back every turn.
            # Not at the first such call: the selector reports a socket again in
            # the turn in which its waiter wakes and reads it, a call that comes
            # after that read; dropping the registration then cost two system
            # calls per request (it is made again at the next wait).
            entry.unwaited += 1
            if entry.unwaited > 1:
                self._loop.remove_reader(entry.fd)
                entry.reading = False
                entry.unwaited = 0
        else:
            entry.unwaited = 0
            if not future.done():
                future.set_result(None)

    async def wait_writable(self, sock: socket.socket) -> None:
        """See `IO.wait_writable` (the rare case: a send that would block)."""
        fd = sock.fileno()
        entry = self._registered.get(fd)
        if entry is None:
            entry = self._registered[fd] = _Registration(fd)
        if entry.writer is not None:
            raise RuntimeError("another task is already waiting to write this socket")
        future = entry.writer = self._loop.create_future()
        self._loop.add_writer(fd, _wake, future)
        try:
            await future
        finally:
            entry.writer = None
            if self._registered.get(fd) is entry:
                self._loop.remove_writer(fd)

    def notify_closing(self, sock: HasFileno) -> None:
        """See `IO.notify_closing`."""
        entry = self._registered.pop(sock.fileno(), None)
        if entry is None:
            return
        if entry.reading:
            self._loop.remove_reader(entry.fd)
        if entry.writer is not None:
            self._loop.remove_writer(entry.fd)
        for future in (entry.reader, entry.writer):
            if future is not None and not future.done():
                future.set_exception(ClosedError(_CLOSED))

    async def checkpoint(self) -> None:
        """See `IO.checkpoint`."""
        await asyncio.sleep(0)

    def wall_time(self) -> float:
        """See `IO.wall_time`."""
        return time.time()


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
