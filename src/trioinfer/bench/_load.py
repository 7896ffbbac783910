"""Load loops: what sends the requests, and when.

Over HTTP, `_LoadLoop` drives all of one level's connections from one worker
thread with one poller; in-process, `_closed_level` and `_open_level` run one
Trio task per worker against the engine. `iter_arrivals` gives the open loop's
schedule.
"""

from __future__ import annotations

import errno
import os
import select
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import suppress
from typing import Any, Final, Literal

import httptools
import numpy as np
import trio

from .._bounds import MAX_RATE, MIN_RATE, RATE_RANGE
from ._client import _CONN_ERROR, _RECV_BYTES, _Connection, _new_socket
from ._stats import STREAM_ERROR, Result, Status, _Recorder

# Arrival offsets are drawn this many at a time (numpy is cheap per batch, dear per call).
_ARRIVAL_CHUNK: Final = 4096
# Open loop: past this many requests per connection waiting for one, new arrivals are dropped.
_BACKLOG_PER_CONNECTION: Final = 8

Arrivals = Literal["constant", "poisson"]


def iter_arrivals(rate: float, arrivals: Arrivals, seed: int = 0) -> Iterator[int]:
    """Yield the times requests are due, in nanoseconds after the start, forever.

    ``constant``: every ``1/rate`` seconds exactly (the first at 0). ``poisson``:
    exponential gaps of mean ``1/rate`` from a generator seeded with *seed*, so
    one seed always gives the same schedule.

    Raises:
        ValueError: A rate outside 0.001 to 1,000,000 per second, which the
            schedule's nanoseconds cannot keep.
    """
    if not MIN_RATE <= rate <= MAX_RATE:
        raise ValueError(f"rate must be from {RATE_RANGE}, got {rate}")
    period = 1e9 / rate
    if arrivals == "constant":
        n = 0
        while True:
            yield round(n * period)
            n += 1
    rng = np.random.default_rng(seed)
    now = 0.0
    while True:
        # Cumulative sums in float64 keep ns precision for weeks of schedule.
        times = now + np.cumsum(rng.exponential(period, _ARRIVAL_CHUNK))
        now = float(times[-1])
        yield from np.rint(times).astype(np.int64).tolist()


def iter_intervals(intervals_ns: Sequence[int]) -> Iterator[int]:
    """Yield the times requests are due, *intervals_ns* apart in turn, cycled, forever.

    The first is due at 0, the second ``intervals_ns[0]`` later, and so on
    (perf_analyzer's ``--request-intervals``); after the last interval the
    first comes again.

    Raises:
        ValueError: No intervals, a negative one, or none above 0 (an endless burst).
    """
    if not intervals_ns or min(intervals_ns) < 0 or not max(intervals_ns) > 0:
        raise ValueError(
            "request intervals must be nanoseconds, none negative and not all 0, got "
            f"{list(intervals_ns)[:5]}"
        )
    due = 0
    while True:
        for gap in intervals_ns:
            yield due
            due += gap


#: One worker's way of sending request variant *n*, due at the second argument (a
#: ``perf_counter_ns``: when it was sent, closed loop; when it was due, open loop, which
#: its time to a first response counts from, as its latency does); returns 200 on
#: success, else the status. (In-process only: HTTP levels run in a `_LoadLoop`.)
Send = Callable[[int, int], Awaitable[Status]]

# Poll flags: select.poll's and epoll's have the same values for these four.
_IN: Final = select.POLLIN
_OUT: Final = select.POLLOUT
_ERR: Final = select.POLLERR | select.POLLHUP
# The driver re-checks whether it should stop at least this often (seconds).
_POLL_MAX_S: Final = 0.05
# select() cannot wait on a descriptor numbered this or higher (FD_SETSIZE).
_SELECT_MAX_FD: Final = 1024
# A connection that could not connect waits this long before the next attempt (seconds).
_RETRY_S: Final = 0.01


class _LoadLoop:
    """All of one level's HTTP connections, driven from one worker thread by one poller.

    Why not a Trio task per connection: each request then costs a task switch, an
    ``epoll_ctl`` to re-arm the one-shot registration and, in an open loop, a
    cancel-scope timer that expires by raising ``Cancelled``; together that was
    most of the tool's CPU time. Here sockets stay registered (level-triggered),
    one blocking ``poll`` returns every answer that arrived, the next request goes
    out from the same loop without waking anything, and one timeout serves every
    request due before it. Trio's side only starts the thread, swaps measurement
    windows and stops it; the thread touches nothing of Trio's.

    Closed loop (*schedule* ``None``): every connection sends its next request as
    soon as the last is answered. Open loop: requests are due at ``start +``
    *schedule*'s offsets; a due request goes out on a free connection, else on a
    new one while there are fewer than *max_connections* (like a new client
    arriving), else waits in a backlog (counted late) that a connection takes
    from as it frees up, and past *backlog_limit* waiting, new arrivals are
    dropped. Latency always runs from the request's start: when it went out
    (closed) or was due (open), so a new connection's handshake counts in it;
    an open loop also records how late each request went out (its send delay).
    With *in_turn* free connections take due requests in turn (oldest free
    first) rather than the last freed, so that each connection's sequence
    advances and none sits idle long enough for the server to release it.
    """

    def __init__(
        self,
        address: tuple[str, int],
        requests: Sequence[bytes],
        recorder: _Recorder,
        socks: Sequence[socket.socket],
        *,
        schedule: Iterator[int] | None = None,
        backlog_limit: int = 0,
        max_connections: int = 0,
        next_request: Callable[[_Connection], bytes] | None = None,
        streaming: bool = False,
        in_turn: bool = False,
    ) -> None:
        self._address = address
        self._requests = requests
        # Requests that differ by connection (sequences, shared memory): made per send.
        self._next_request = next_request
        self._recorder = recorder
        self._schedule = schedule
        self._backlog_limit = backlog_limit
        self._max_connections = max(len(socks), max_connections)
        self._stopping = False
        self._n = 0
        self._poller = _Poller()
        self._by_fd: dict[int, _Connection] = {}
        self._free: deque[_Connection] = deque()
        self._take_free = self._free.popleft if in_turn else self._free.pop
        self._streaming = streaming
        self._backlog: deque[int] = deque()
        self._broken: list[_Connection] = []
        # When the broken connections may try again (perf_counter_ns).
        self._retry_ns = 0
        # Streaming: answers are event streams, each counted to its end.
        self.connections = [_Connection(recorder, streaming=streaming) for _ in socks]
        for conn, sock in zip(self.connections, socks, strict=True):
            self._attach(conn, sock, _IN)

    def stop(self) -> None:
        """Ask the loop to return (from any thread); it does within ``_POLL_MAX_S``."""
        self._stopping = True

    def close(self) -> None:
        """Close every socket (after `run` returned)."""
        for conn in self.connections:
            self._close(conn)
        self._poller.close()

    # -- connection states ---------------------------------------------------------------------

    def _attach(self, conn: _Connection, sock: socket.socket, flags: int) -> None:
        conn.sock = sock
        conn.fd = sock.fileno()
        conn.parser = httptools.HttpResponseParser(conn)
        self._by_fd[conn.fd] = conn
        self._poller.register(conn.fd, flags)

    def _close(self, conn: _Connection) -> None:
        if conn.sock is None:
            return
        self._by_fd.pop(conn.fd, None)
        with suppress(OSError, KeyError, ValueError):
            self._poller.unregister(conn.fd)
        conn.sock.close()
        conn.sock = None
        conn.connecting = False
        conn.unsent = None

    def _fail(self, conn: _Connection, exc: BaseException) -> None:
        # The request in flight ends as a connection error; the connection is
        # rebuilt on the loop's next turn, not here, so a server that refuses every
        # connection can neither recurse nor spin.
        conn.busy = False
        self._recorder.window.errors[_CONN_ERROR] += 1
        self._recorder.first_error.setdefault(_CONN_ERROR, f"{type(exc).__name__}: {exc}")
        self._close(conn)
        self._broken.append(conn)
        self._retry_ns = time.perf_counter_ns() + int(_RETRY_S * 1e9)

    def _start(self, conn: _Connection, start_ns: int) -> None:
        """Send the next request on *conn*; its latency runs from *start_ns*."""
        conn.busy = True
        conn.done = False
        conn.start = start_ns
        if conn.sock is None:
            sock = _new_socket(self._address)
            error = sock.connect_ex(self._address)
            if error not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK):
                sock.close()
                self._fail(conn, OSError(error, os.strerror(error)))
                return
            # Writable once connected (or failed); the request goes out then.
            conn.connecting = True
            self._attach(conn, sock, _OUT)
            return
        if self._schedule is not None:
            window = self._recorder.window
            window.sent += 1
            window.delays.append(time.perf_counter_ns() - start_ns)
        if self._next_request is not None:
            self._transmit(conn, memoryview(self._next_request(conn)))
            return
        self._transmit(conn, memoryview(self._requests[self._n % len(self._requests)]))
        self._n += 1

    def _transmit(self, conn: _Connection, data: memoryview) -> None:
        assert conn.sock is not None
        try:
            sent = conn.sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            self._fail(conn, exc)
            return
        if sent < len(data):
            conn.unsent = data[sent:]
            self._poller.modify(conn.fd, _IN | _OUT)

    def _ready(self, conn: _Connection) -> None:
        """*conn* has nothing in flight: give it the next request, or keep it free."""
        if self._schedule is None:
            self._start(conn, time.perf_counter_ns())
        elif self._backlog:
            self._start(conn, self._backlog.popleft())
        else:
            self._free.append(conn)

    def _complete(self, conn: _Connection, now: int) -> None:
        conn.busy = False
        window = self._recorder.window
        status = conn.status
        if status == 200 and conn.streaming:
            if conn.stream_error is not None:
                window.errors[STREAM_ERROR] += 1
                self._recorder.first_error.setdefault(STREAM_ERROR, conn.stream_error)
            else:
                window.latencies.append(now - conn.start)
                if conn.events:
                    window.first.append(conn.first - conn.start)
                    window.responses += conn.events
        elif status == 200:
            window.latencies.append(now - conn.start)
        else:
            window.errors[status] += 1
            if conn.body is not None:
                self._recorder.first_error.setdefault(
                    status, b"".join(conn.body)[:300].decode(errors="replace")
                )
        if not conn.keep_alive:
            self._close(conn)  # the next request reconnects
        self._ready(conn)

    def _event(self, conn: _Connection, flags: int, now: int) -> None:
        sock = conn.sock
        assert sock is not None
        if not conn.busy:
            # An idle keep-alive connection the server closed (or wrote to unasked):
            # drop it quietly; the next request on it reconnects.
            self._close(conn)
            return
        if conn.connecting:
            error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if error:
                self._fail(conn, OSError(error, os.strerror(error)))
                return
            conn.connecting = False
            self._poller.modify(conn.fd, _IN)
            self._start(conn, conn.start)  # the request that was waiting for it
            return
        if conn.unsent is not None and flags & _OUT:
            data, conn.unsent = conn.unsent, None
            self._poller.modify(conn.fd, _IN)
            self._transmit(conn, data)
            if conn.sock is None:
                return
        if not flags & (_IN | _ERR):
            return
        try:
            chunk = sock.recv(_RECV_BYTES)
        except BlockingIOError:
            return
        except OSError as exc:
            self._fail(conn, exc)
            return
        if not chunk:
            self._fail(conn, ConnectionResetError("the server closed the connection"))
            return
        assert conn.parser is not None
        try:
            conn.parser.feed_data(chunk)
        except httptools.HttpParserError as exc:
            self._fail(conn, exc)
            return
        if conn.done:
            self._complete(conn, now)

    # -- the loop ----------------------------------------------------------------------------------

    def run(self) -> None:
        """Drive the connections until `stop` (runs in a worker thread)."""
        poll = self._poller.poll
        by_fd = self._by_fd
        schedule = self._schedule
        start_ns = time.perf_counter_ns()
        due = start_ns + next(schedule) if schedule is not None else 0
        # select() waits on the poller's own fd with microsecond timeouts, where
        # epoll/poll round theirs up to whole milliseconds: arrivals go out on time.
        precise = _precise_wait(self._poller)
        for conn in list(self.connections):
            if schedule is None:
                self._start(conn, time.perf_counter_ns())
            else:
                self._free.append(conn)
        while not self._stopping:
            timeout = _POLL_MAX_S
            if schedule is not None:
                now = time.perf_counter_ns()
                while due <= now:
                    if self._free:
                        self._start(self._take_free(), due)
                    elif len(self.connections) < self._max_connections:
                        conn = _Connection(self._recorder, streaming=self._streaming)
                        self.connections.append(conn)
                        self._start(conn, due)  # connects, then sends
                    elif len(self._backlog) < self._backlog_limit:
                        self._backlog.append(due)
                        self._recorder.window.late += 1
                    else:
                        self._recorder.window.dropped += 1
                    due = start_ns + next(schedule)
                timeout = min(timeout, (due - now) / 1e9)
            if self._broken:
                # Not at once: a refusal that arrives as a poll event (a non-blocking
                # connect's usual way) would otherwise be retried in a tight loop.
                wait_ns = self._retry_ns - time.perf_counter_ns()
                if wait_ns <= 0:
                    broken, self._broken = self._broken, []
                    for conn in broken:
                        self._ready(conn)
                    wait_ns = int(_RETRY_S * 1e9)
                if self._broken:
                    timeout = min(timeout, wait_ns / 1e9)
            if precise is not None and 0 < timeout < _POLL_MAX_S:
                # Woken by the timer (nothing readable): no poll call needed.
                events = poll(0) if precise(timeout)[0] else ()
            else:
                events = poll(timeout)
            now = time.perf_counter_ns()
            for fd, flags in events:
                ready = by_fd.get(fd)
                if ready is not None and ready.sock is not None:
                    self._event(ready, flags, now)


class _Poller:
    # The part of select.epoll (or select.poll without it) the load loop uses;
    # timeouts in seconds.
    def __init__(self) -> None:
        self.epoll = select.epoll() if hasattr(select, "epoll") else None
        if self.epoll is not None:
            self._impl: select.epoll | select.poll = self.epoll
            self.poll: Callable[[float], list[tuple[int, int]]] = self.epoll.poll
        else:  # pragma: no cover - macOS and other Unix without epoll
            fallback = self._impl = select.poll()
            self.poll = lambda timeout: fallback.poll(timeout * 1000)

    def register(self, fd: int, flags: int) -> None:
        self._impl.register(fd, flags)

    def modify(self, fd: int, flags: int) -> None:
        self._impl.modify(fd, flags)

    def unregister(self, fd: int) -> None:
        self._impl.unregister(fd)

    def close(self) -> None:
        if self.epoll is not None:
            self.epoll.close()


def _precise_wait(poller: _Poller) -> Callable[[float], tuple[list[int], Any, Any]] | None:
    # select() on the epoll fd itself: readable when any socket is. Without epoll,
    # or past select's 1024-descriptor limit, timeouts stay whole milliseconds.
    if poller.epoll is None or poller.epoll.fileno() >= _SELECT_MAX_FD:  # pragma: no cover
        return None
    fds = [poller.epoll.fileno()]
    return lambda timeout: select.select(fds, (), (), timeout)


async def _closed_level(
    senders: Sequence[Send],
    recorder: _Recorder,
    measure: Callable[[_Recorder, str, float], Awaitable[Result]],
) -> Result:
    # In-process: one task per worker, each awaiting the engine in turn.
    async def worker(send: Send, first: int) -> None:
        n = first
        while True:
            start = time.perf_counter_ns()
            status = await send(n, start)
            end = time.perf_counter_ns()
            window = recorder.window
            if status == 200:
                window.latencies.append(end - start)
            else:
                window.errors[status] += 1
                # The engine refuses a request it cannot take (a 0-row --shape, say)
                # without a checkpoint: a worker failing on each in turn held the event
                # loop for ever, and the measuring clock never ran.
                await trio.lowlevel.checkpoint()
            n += 1

    async with trio.open_nursery() as nursery:
        for i, send in enumerate(senders):
            nursery.start_soon(worker, send, i)
        result = await measure(recorder, "concurrency", len(senders))
        nursery.cancel_scope.cancel()
    return result


async def _open_level(
    senders: Sequence[Send],
    recorder: _Recorder,
    measure: Callable[[_Recorder, str, float], Awaitable[Result]],
    *,
    rate: float,
    schedule: Iterator[int],
) -> Result:
    # In-process: one schedule shared by all workers; a worker that is free claims
    # the next due time and sleeps until it. (The engine's own work dwarfs a timer
    # per request here; HTTP levels batch their timers in `_LoadLoop`.)
    start_ns = time.perf_counter_ns()
    max_behind_ns = _BACKLOG_PER_CONNECTION * len(senders) * 1e9 / rate

    async def worker(send: Send, first: int) -> None:
        n = first
        for offset in schedule:
            due = start_ns + offset
            wait_ns = due - time.perf_counter_ns()
            if wait_ns > 0:
                await trio.sleep(wait_ns / 1e9)
            elif -wait_ns > max_behind_ns:
                recorder.window.dropped += 1
                continue
            else:
                recorder.window.late += 1
            window = recorder.window
            window.sent += 1
            window.delays.append(time.perf_counter_ns() - due)
            status = await send(n, due)
            end = time.perf_counter_ns()
            window = recorder.window
            if status == 200:
                window.latencies.append(end - due)
            else:
                window.errors[status] += 1
            n += 1

    async with trio.open_nursery() as nursery:
        for i, send in enumerate(senders):
            nursery.start_soon(worker, send, i)
        result = await measure(recorder, "rate", rate)
        nursery.cancel_scope.cancel()
    return result
