"""``trioinfer bench``: a load generator for any KServe V2 server, or for an engine in-process.

Two load shapes, both measured the same way:

* closed loop (``--concurrency 1,16,64``): C workers, each on its own keep-alive
  connection, send their next request as soon as the last one is answered;
* open loop (``--request-rate 500,1000``): requests are due at fixed (constant)
  or random (Poisson) times and latency runs from the time a request was *due*,
  not from when it went out, so a server that falls behind cannot hide it
  (no coordinated omission).

Each level warms up (excluded), then measures windows of ``--window`` seconds
until the last three agree on throughput and p99 within ``--stability`` percent
(or a fixed ``--windows`` count). The HTTP client speaks only the V2 protocol
(model metadata and infer) over plain non-blocking sockets. A level's connections
are all driven by one loop in a worker thread (`_LoadLoop`): one ``epoll`` wait
returns every answer that arrived and one timeout serves every request due before
it, with no Trio task switch or timer per request; every request's bytes are
encoded once before the run and answers are parsed by httptools. So the tool costs
little CPU per request; it measures its own CPU time and reports it. Trio runs the
rest: metadata, windows, the progress display, and in-process levels.
"""

from __future__ import annotations

import csv
import errno
import functools
import json
import math
import os
import resource
import select
import socket
import sys
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager, suppress
from pathlib import Path
from typing import Any, Final, Literal
from urllib.parse import urlsplit

import attrs
import httptools
import numpy as np
import numpy.typing as npt
import trio

from ._config import ModelConfig, find_model_file
from ._engine import Engine, open_engine
from ._exceptions import TrioInferError
from .server._codec import _WIRE, DATATYPES, Limits, _pack_bytes, decode_infer_request, dumps
from .server._codec import v2_datatype as v2_datatype

#: The percentiles every result reports, in this order.
PERCENTILES: Final = (50, 90, 95, 99)
#: How many of the latest windows must agree for a level to count as stable.
STABLE_WINDOWS: Final = 3
# Status of a request that got no HTTP answer (refused, reset, closed mid-response).
_CONN_ERROR: Final = "conn"
_RECV_BYTES: Final = 256 * 1024
# Arrival offsets are drawn this many at a time (numpy is cheap per batch, dear per call).
_ARRIVAL_CHUNK: Final = 4096
# Open loop: past this many requests per connection waiting for one, new arrivals are dropped.
_BACKLOG_PER_CONNECTION: Final = 8
# Open loop: past this share of requests late or dropped, the table says so.
_BEHIND_SHARE: Final = 0.01
# Open loop: the smallest pool to start with; a 1 ms hiccup at a few thousand req/s needs this many.
_MIN_POOL: Final = 32
#: Open loop: the most connections (in-process: workers) the tool opens by default.
DEFAULT_MAX_CONNECTIONS: Final = 1024
# Requests sent (one at a time) before an open-loop run to size its connection pool.
_PROBE_REQUESTS: Final = 10


class BenchError(TrioInferError):
    """The benchmark cannot run: no server, no such model, unusable input data."""


Arrivals = Literal["constant", "poisson"]
Status = int | str


# -- inputs ---------------------------------------------------------------------------------


@attrs.frozen(eq=False)
class Tensor:
    """One input tensor of one request variant.

    Attributes:
        name: The model input's name.
        datatype: Its V2 datatype (``"FP32"``, ``"BYTES"``, ...).
        array: The values.
    """

    name: str
    datatype: str
    array: npt.NDArray[Any]


def random_inputs(
    specs: Sequence[Mapping[str, Any]],
    shapes: Mapping[str, Sequence[int]] | None = None,
    *,
    seed: int = 0,
) -> list[Tensor]:
    """Make one request's inputs from V2 model metadata (``inputs``: name, datatype, shape).

    Variable dimensions (``-1``) become 1 unless *shapes* gives the input's whole shape.

    Raises:
        BenchError: A datatype that has no numpy type, or a *shapes* entry for no input.
    """
    shapes = dict(shapes or {})
    unknown = sorted(set(shapes) - {str(spec.get("name")) for spec in specs})
    if unknown:
        raise BenchError(
            f"--shape names {', '.join(map(repr, unknown))}, which the model has not; its "
            f"inputs are {', '.join(repr(spec.get('name')) for spec in specs)}"
        )
    rng = np.random.default_rng(seed)
    tensors = []
    for spec in specs:
        name = str(spec["name"])
        datatype = str(spec["datatype"])
        shape = tuple(shapes.get(name, [max(int(d), 1) for d in spec.get("shape", [])]))
        dtype = DATATYPES.get(datatype)
        if dtype is None:
            raise BenchError(
                f"input {name!r} has datatype {datatype!r}, which the tool cannot generate; "
                "pass --input-data with its values"
            )
        array: npt.NDArray[Any]
        if datatype == "BYTES":
            letters = rng.integers(97, 123, size=(*shape, 8), dtype=np.uint8)
            array = np.array(
                [row.tobytes().decode() for row in letters.reshape(-1, 8)], dtype=object
            ).reshape(shape)
        elif dtype.kind == "b":
            array = rng.random(shape) < 0.5
        elif dtype.kind in "iu":
            array = rng.integers(0, 100, size=shape).astype(dtype)
        else:
            array = rng.random(shape).astype(dtype)
        tensors.append(Tensor(name, datatype, array))
    return tensors


def load_inputs(path: Path) -> list[Tensor]:
    """Read one request's inputs from a ``.npz`` (one array per input) or ``.json`` file.

    A JSON file is a V2 infer request body: ``{"inputs": [{"name", "shape",
    "datatype", "data"}, ...]}``, decoded by the server's own codec.

    Raises:
        BenchError: The file cannot be read or holds no usable inputs.
    """
    try:
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as npz:
                arrays = {name: npz[name] for name in npz.files}
        else:
            arrays = decode_infer_request(path.read_bytes(), None, Limits()).inputs
    except (OSError, ValueError, TrioInferError) as exc:
        raise BenchError(
            f"cannot read inputs from {path}: {exc}; expected an .npz file with one array per "
            "input, or a V2 infer request as JSON"
        ) from None
    if not arrays:
        raise BenchError(f"{path} holds no inputs")
    try:
        return [Tensor(name, v2_datatype(a.dtype), np.asarray(a)) for name, a in arrays.items()]
    except ValueError as exc:
        raise BenchError(f"{path}: {exc}") from None


def encode_request(tensors: Sequence[Tensor], *, binary: bool) -> tuple[bytes, int | None]:
    """Encode an infer request body; return it and the JSON part's length (binary only).

    JSON: flat row-major ``data``. Binary (Triton's extension): each input's raw
    little-endian bytes after the JSON header, outputs asked for as binary too.
    """
    entries: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for t in tensors:
        entry: dict[str, Any] = {"name": t.name, "shape": list(t.array.shape)}
        entry["datatype"] = t.datatype
        items = t.array.ravel()
        if binary:
            if t.datatype == "BYTES":
                blob = _pack_bytes(items.tolist())
            else:
                blob = np.ascontiguousarray(items, dtype=_WIRE[t.datatype]).tobytes()
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        elif t.datatype == "BYTES":
            entry["data"] = [v.decode() if isinstance(v, bytes) else str(v) for v in items]
        else:
            entry["data"] = np.ascontiguousarray(items, dtype=DATATYPES[t.datatype])
        entries.append(entry)
    doc: dict[str, Any] = {"inputs": entries}
    if not binary:
        return dumps(doc), None
    doc["parameters"] = {"binary_data_output": True}
    header = dumps(doc)
    return b"".join([header, *blobs]), len(header)


# -- arrivals -------------------------------------------------------------------------------


def iter_arrivals(rate: float, arrivals: Arrivals, seed: int = 0) -> Iterator[int]:
    """Yield the times requests are due, in nanoseconds after the start, forever.

    ``constant``: every ``1/rate`` seconds exactly (the first at 0). ``poisson``:
    exponential gaps of mean ``1/rate`` from a generator seeded with *seed*, so
    one seed always gives the same schedule.
    """
    if not rate > 0 or math.isinf(rate):
        raise ValueError(f"rate must be a positive number of requests per second, got {rate}")
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


# -- measurement ----------------------------------------------------------------------------


@attrs.define(eq=False)
class _Window:
    # What completed (or was scheduled) in one window; workers append as they finish.
    latencies: list[int] = attrs.field(factory=list)
    errors: Counter[Status] = attrs.field(factory=Counter)
    late: int = 0
    dropped: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0


@attrs.define(eq=False)
class _Recorder:
    window: _Window = attrs.field(factory=_Window)
    first_error: dict[Status, str] = attrs.field(factory=dict)


@attrs.frozen
class Settings:
    """How each level is measured.

    Attributes:
        warmup_s: Seconds of load before measuring, thrown away.
        window_s: The length of one measurement window.
        stability: Percent: the last three windows' throughput and p99 must each
            lie within this of their mean.
        max_windows: Stop after this many windows even if never stable.
        windows: A fixed number of windows instead (0: until stable).
    """

    warmup_s: float = 1.0
    window_s: float = 1.0
    stability: float = 10.0
    max_windows: int = 10
    windows: int = 0


@attrs.frozen
class Result:
    """One level of load, measured.

    Attributes:
        load: ``"concurrency"`` or ``"rate"``.
        value: The concurrency, or the offered rate in requests per second.
        throughput: Successful requests per second over the counted windows.
        latency_ms: p50, p90, p95, p99 and max of successful requests, in ms.
        completed: Successful requests in the counted windows.
        errors: Failed requests by HTTP status (or ``conn``, or the exception's class).
        late: Open loop: requests that found every connection busy, with the most
            open, and waited.
        dropped: Open loop: requests never sent because too many were waiting.
        windows: How many windows ran; the last three (or all, with a fixed count) count.
        stable: Whether the last three windows agreed within the stability
            bound; ``None`` when fewer than three were measured (``--windows``
            or ``--max-windows`` below 3), which leaves nothing to compare.
        cpu_us_per_request: This process's CPU time per request (user + system).
        cores: This process's CPU time over wall time.
    """

    load: str
    value: float
    throughput: float
    latency_ms: dict[str, float]
    completed: int
    errors: dict[str, int]
    late: int
    dropped: int
    windows: int
    stable: bool | None
    cpu_us_per_request: float
    cores: float

    def row(self) -> dict[str, Any]:
        """The result as one flat mapping (what ``--json`` and ``--csv`` write)."""
        return {
            "load": self.load,
            "value": self.value,
            "throughput": round(self.throughput, 2),
            **{f"{k}_ms": round(v, 4) for k, v in self.latency_ms.items()},
            "completed": self.completed,
            "errors": sum(self.errors.values()),
            "errors_by_status": " ".join(f"{k}:{v}" for k, v in sorted(self.errors.items())),
            "late": self.late,
            "dropped": self.dropped,
            "windows": self.windows,
            "stable": self.stable,
            "cpu_us_per_request": round(self.cpu_us_per_request, 2),
            "cores": round(self.cores, 3),
        }


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _throughput(w: _Window) -> float:
    return len(w.latencies) / w.wall_s if w.wall_s else 0.0


def _p99(w: _Window) -> float:
    return float(np.percentile(w.latencies, 99)) if w.latencies else math.inf


def is_stable(windows: Sequence[tuple[float, float]], stability: float) -> bool:
    """Whether the last three (throughput, p99) pairs each lie within *stability* % of the mean."""
    if len(windows) < STABLE_WINDOWS:
        return False
    for values in zip(*windows[-STABLE_WINDOWS:], strict=True):
        mean = sum(values) / len(values)
        if not mean > 0 or math.isinf(mean):
            return False
        if any(abs(v - mean) > mean * stability / 100 for v in values):
            return False
    return True


@attrs.frozen
class Progress:
    """A running benchmark's state, reported a few times a second to a progress display.

    Attributes:
        level: The level running, e.g. ``"concurrency 16"`` or ``"rate 5000/s"``.
        index: Its position among the levels, from 0.
        levels: How many levels the run has.
        window: The window being measured, from 1; 0 while warming up.
        windows: The most windows this level may take.
        fraction: How much of the current warm-up or window has passed, 0 to 1.
        throughput: Successful requests per second so far in the current warm-up or window.
        p99_ms: The last finished window's p99 latency (NaN before the first).
    """

    level: str
    index: int
    levels: int
    window: int
    windows: int
    fraction: float
    throughput: float
    p99_ms: float


# A progress display is refreshed this often (seconds): often enough to watch, rarely
# enough that its cost, which the CPU figures include, stays small.
_REFRESH_S: Final = 0.25


async def _measure(
    recorder: _Recorder,
    settings: Settings,
    load: str,
    value: float,
    progress: Callable[[Progress], None] | None,
    position: tuple[int, int] = (0, 1),
) -> Result:
    label = f"concurrency {value:g}" if load == "concurrency" else f"{load} {value:g}/s"
    limit = settings.windows or settings.max_windows

    async def wait(length: float, number: int, p99_ms: float) -> None:
        # Sleep through a warm-up or window; with a display, wake to refresh it.
        if progress is None:
            await trio.sleep(length)
            return
        started = time.perf_counter()
        deadline = trio.current_time() + length
        while True:
            elapsed = time.perf_counter() - started
            progress(
                Progress(
                    label,
                    *position,
                    window=number,
                    windows=limit,
                    fraction=min(1.0, elapsed / length) if length else 1.0,
                    throughput=len(recorder.window.latencies) / elapsed if elapsed > 0 else 0.0,
                    p99_ms=p99_ms,
                )
            )
            if trio.current_time() >= deadline:
                return
            await trio.sleep_until(min(deadline, trio.current_time() + _REFRESH_S))

    await wait(settings.warmup_s, 0, math.nan)
    done: list[_Window] = []
    stable = False
    while len(done) < limit:
        window = recorder.window = _Window()
        start, cpu = time.perf_counter(), _cpu_s()
        await wait(settings.window_s, len(done) + 1, _p99(done[-1]) / 1e6 if done else math.nan)
        recorder.window = _Window()  # requests finishing from now on count in no window
        window.wall_s, window.cpu_s = time.perf_counter() - start, _cpu_s() - cpu
        done.append(window)
        if not settings.windows:
            pairs = [(_throughput(w), _p99(w)) for w in done]
            stable = is_stable(pairs, settings.stability)
            if stable:
                break
    counted = done if settings.windows else done[-STABLE_WINDOWS:]
    verdict: bool | None
    if len(done) < STABLE_WINDOWS:
        verdict = None  # --windows or --max-windows below 3: nothing to compare
    elif settings.windows:
        verdict = is_stable([(_throughput(w), _p99(w)) for w in done], settings.stability)
    else:
        verdict = stable
    return _summarise(load, value, counted, len(done), verdict)


def _summarise(
    load: str, value: float, counted: list[_Window], windows: int, stable: bool | None
) -> Result:
    latencies = np.fromiter(
        (x for w in counted for x in w.latencies), dtype=np.int64, count=-1
    ).astype(np.float64)
    wall = sum(w.wall_s for w in counted)
    cpu = sum(w.cpu_s for w in counted)
    errors: Counter[str] = Counter()
    for w in counted:
        for status, n in w.errors.items():
            errors[str(status)] += n
    finished = len(latencies) + sum(errors.values())
    if len(latencies):
        values = [*np.percentile(latencies, PERCENTILES).tolist(), latencies.max()]
        latency = {
            name: v / 1e6
            for name, v in zip([*(f"p{p}" for p in PERCENTILES), "max"], values, strict=True)
        }
    else:
        latency = {name: math.nan for name in [*(f"p{p}" for p in PERCENTILES), "max"]}
    return Result(
        load=load,
        value=value,
        throughput=len(latencies) / wall if wall else 0.0,
        latency_ms=latency,
        completed=len(latencies),
        errors=dict(errors),
        late=sum(w.late for w in counted),
        dropped=sum(w.dropped for w in counted),
        windows=windows,
        stable=stable,
        cpu_us_per_request=cpu / finished * 1e6 if finished else math.nan,
        cores=cpu / wall if wall else 0.0,
    )


# -- targets: what one worker's request does ---------------------------------------------------

#: One worker's way of sending request variant *n*; returns 200 on success, else the status.
#: (In-process only: HTTP levels run in a `_LoadLoop`.)
Send = Callable[[int], Awaitable[Status]]


class _Connection:
    """One keep-alive HTTP/1.1 connection: a plain non-blocking socket and its parser.

    `_LoadLoop` drives many at once from a worker thread; `request` sends a one-off
    (metadata, the probe) from Trio, waiting with ``trio.lowlevel.wait_readable``:
    Trio's socket wrappers cost several times more per call, and this client's own
    CPU time is what it must keep small.
    """

    __slots__ = (
        "body",
        "busy",
        "connecting",
        "done",
        "fd",
        "keep_alive",
        "keep_body",
        "parser",
        "recorder",
        "sock",
        "start",
        "status",
        "unsent",
    )

    def __init__(self, recorder: _Recorder) -> None:
        self.recorder = recorder
        self.sock: socket.socket | None = None
        self.fd = -1
        self.parser: httptools.HttpResponseParser | None = None
        self.busy = False  # a request is in flight
        self.connecting = False
        self.unsent: memoryview | None = None  # what the socket's buffer did not take yet
        self.start = 0  # when the request in flight started (ns), for its latency
        self.done = False
        self.keep_alive = True
        self.status: Status = 0
        self.body: list[bytes] | None = None
        self.keep_body = False  # keep a successful answer's body too (metadata)

    # httptools callbacks: only these three, as each costs a Python call per answer.
    def on_headers_complete(self) -> None:
        assert self.parser is not None
        self.status = self.parser.get_status_code()
        # Keep a failed answer's body for the message; never a successful one's.
        self.body = None if self.status == 200 and not self.keep_body else []

    def on_body(self, body: bytes) -> None:
        if self.body is not None:
            self.body.append(body)

    def on_message_complete(self) -> None:
        assert self.parser is not None
        # Read here: once the message is complete the parser resets for the next one.
        self.keep_alive = self.parser.should_keep_alive()
        self.done = True

    async def connect(self, address: tuple[str, int]) -> None:
        """Open the connection (raising `OSError` when refused)."""
        sock = _new_socket(address)
        try:
            try:
                sock.connect(address)
            except BlockingIOError:
                await trio.lowlevel.wait_writable(sock)
                error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if error:
                    raise OSError(error, os.strerror(error)) from None
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.fd = sock.fileno()
        self.parser = httptools.HttpResponseParser(self)

    def close(self) -> None:
        """Close the socket, if open."""
        if self.sock is not None:
            trio.lowlevel.notify_closing(self.sock)
            self.sock.close()
        self.sock = None

    async def request(self, data: bytes) -> Status:
        """Send *data* (a whole request) and read the answer; return its status."""
        sock, parser = self.sock, self.parser
        assert sock is not None
        assert parser is not None
        self.done = False
        try:
            view = memoryview(data)
            while view:
                await trio.lowlevel.wait_writable(sock)
                with suppress(BlockingIOError):
                    view = view[sock.send(view) :]
            while not self.done:
                await trio.lowlevel.wait_readable(sock)
                try:
                    chunk = sock.recv(_RECV_BYTES)
                except BlockingIOError:
                    continue
                if not chunk:
                    raise ConnectionResetError("the server closed the connection")
                parser.feed_data(chunk)
        except (OSError, httptools.HttpParserError) as exc:
            self.close()
            self.recorder.first_error.setdefault(_CONN_ERROR, f"{type(exc).__name__}: {exc}")
            return _CONN_ERROR
        if not self.keep_alive:
            self.close()
        return self.status


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
    (closed) or was due (open), so a new connection's handshake counts in it.
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
    ) -> None:
        self._address = address
        self._requests = requests
        self._recorder = recorder
        self._schedule = schedule
        self._backlog_limit = backlog_limit
        self._max_connections = max(len(socks), max_connections)
        self._stopping = False
        self._n = 0
        self._poller = _Poller()
        self._by_fd: dict[int, _Connection] = {}
        self._free: list[_Connection] = []
        self._backlog: deque[int] = deque()
        self._broken: list[_Connection] = []
        self.connections = [_Connection(recorder) for _ in socks]
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
        if status == 200:
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
                        self._start(self._free.pop(), due)
                    elif len(self.connections) < self._max_connections:
                        conn = _Connection(self._recorder)
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
                broken, self._broken = self._broken, []
                for conn in broken:
                    self._ready(conn)
                if self._broken:
                    timeout = min(timeout, _RETRY_S)
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


def _new_socket(address: tuple[str, int]) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET)
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _http_requests(
    host: str, port: int, path: str, bodies: Sequence[tuple[bytes, int | None]]
) -> list[bytes]:
    out = []
    for body, header_length in bodies:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        )
        if header_length is not None:
            head = head.replace("application/json", "application/octet-stream")
            head += f"Inference-Header-Content-Length: {header_length}\r\n"
        out.append((head + "\r\n").encode("latin-1") + body)
    return out


@attrs.frozen
class HttpTarget:
    """A V2 server's model, reached over HTTP/1.1 on keep-alive connections.

    Attributes:
        host: The server's address.
        port: Its port.
        model: The model's name.
        version: The model version, or ``None`` for the server's choice.
    """

    host: str
    port: int
    model: str
    version: str | None = None

    @classmethod
    def from_url(cls, url: str, model: str, version: str | None = None) -> HttpTarget:
        """Parse ``http://HOST:PORT``.

        Raises:
            BenchError: Not an ``http://`` URL.
        """
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise BenchError(f"--url must look like http://HOST:PORT, got {url!r}")
        return cls(parts.hostname, parts.port or 80, model, version)

    @property
    def model_path(self) -> str:
        """``/v2/models/{model}[/versions/{version}]``."""
        path = f"/v2/models/{self.model}"
        return path if self.version is None else f"{path}/versions/{self.version}"

    async def get(self, path: str) -> tuple[int, bytes]:
        """A one-off GET (metadata) on a fresh connection; returns the status and body.

        Raises:
            BenchError: Nothing answers at the address.
        """
        request = f"GET {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n\r\n".encode()
        recorder = _Recorder()
        connection = _Connection(recorder)
        try:
            await connection.connect((self.host, self.port))
        except OSError as exc:
            raise BenchError(
                f"cannot connect to http://{self.host}:{self.port}: {exc.strerror or exc}; "
                "is the server running?"
            ) from None
        connection.keep_body = True
        try:
            status = await connection.request(request)
            body = b"".join(connection.body or [])
        finally:
            connection.close()
        if status == _CONN_ERROR:
            raise BenchError(
                f"http://{self.host}:{self.port}{path} gave no HTTP answer: "
                f"{recorder.first_error.get(_CONN_ERROR)}"
            )
        return int(status), body

    async def metadata(self) -> dict[str, Any]:
        """The model's V2 metadata (``GET /v2/models/{m}``).

        Raises:
            BenchError: No server, or it does not serve the model (with its message).
        """
        status, body = await self.get(self.model_path)
        if status != 200:
            try:
                message = json.loads(body).get("error", body.decode(errors="replace"))
            except (ValueError, AttributeError):
                message = body[:300].decode(errors="replace")
            raise BenchError(
                f"the server answered {status} for model {self.model!r}"
                f"{'' if self.version is None else f' version {self.version}'}: {message}"
            )
        doc = json.loads(body)
        if not isinstance(doc, dict) or not isinstance(doc.get("inputs"), list):
            raise BenchError(f"{self.model_path} gave no V2 model metadata: {body[:200]!r}")
        return doc

    def requests(self, variants: Sequence[Sequence[Tensor]], *, binary: bool) -> list[bytes]:
        """Each variant's whole HTTP request, bytes ready to send."""
        bodies = [encode_request(v, binary=binary) for v in variants]
        return _http_requests(self.host, self.port, f"{self.model_path}/infer", bodies)


# -- running levels -----------------------------------------------------------------------------


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
            status = await send(n)
            end = time.perf_counter_ns()
            window = recorder.window
            if status == 200:
                window.latencies.append(end - start)
            else:
                window.errors[status] += 1
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
    arrivals: Arrivals,
    seed: int,
) -> Result:
    # In-process: one schedule shared by all workers; a worker that is free claims
    # the next due time and sleeps until it. (The engine's own work dwarfs a timer
    # per request here; HTTP levels batch their timers in `_LoadLoop`.)
    schedule = iter_arrivals(rate, arrivals, seed)
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
            status = await send(n)
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


@attrs.frozen
class Plan:
    """What to run: the levels and how to measure them.

    Attributes:
        concurrency: Closed-loop levels (workers); used when *rates* is empty.
        rates: Open-loop levels (requests per second).
        arrivals: ``constant`` or ``poisson`` (open loop).
        seed: Seeds the Poisson schedule and random inputs.
        max_connections: Open loop: the most connections (in-process: workers) to
            open; 0 for `DEFAULT_MAX_CONNECTIONS`.
        settings: Warm-up, window and stability settings.
    """

    concurrency: tuple[int, ...] = (1,)
    rates: tuple[float, ...] = ()
    arrivals: Arrivals = "poisson"
    seed: int = 0
    max_connections: int = 0
    settings: Settings = Settings()

    @property
    def levels(self) -> int:
        """How many levels the plan runs."""
        return len(self.rates) or len(self.concurrency)


def _pool_limit(plan: Plan) -> int:
    return plan.max_connections or DEFAULT_MAX_CONNECTIONS


def _pool_size(plan: Plan, rate: float, probe_s: float) -> int:
    # The connections to open before the run: enough for the rate times a generous
    # latency, as Little's law says. A batching server's latency under load is
    # several times the probe's, so the loop opens more as requests find none free.
    return min(_pool_limit(plan), max(_MIN_POOL, math.ceil(rate * probe_s * 4)))


async def _run_levels(
    plan: Plan,
    run_closed: Callable[[int, _Recorder], Awaitable[Result]],
    run_open: Callable[[float, _Recorder], Awaitable[Result]],
) -> Run:
    results = []
    seen: dict[str, str] = {}
    for value in plan.rates or plan.concurrency:
        recorder = _Recorder()
        if plan.rates:
            results.append(await run_open(value, recorder))
        else:
            results.append(await run_closed(int(value), recorder))
        seen.update({str(k): v for k, v in recorder.first_error.items() if str(k) not in seen})
    return Run(tuple(results), seen)


@attrs.frozen
class Run:
    """A whole run's results.

    Attributes:
        results: One per level, in the order run.
        first_errors: For each error status seen, the first failed answer's text.
    """

    results: tuple[Result, ...]
    first_errors: dict[str, str]


async def _open_sockets(address: tuple[str, int], count: int) -> list[socket.socket]:
    opened: list[socket.socket] = []
    try:
        for _ in range(count):
            conn = _Connection(_Recorder())
            await conn.connect(address)
            assert conn.sock is not None
            opened.append(conn.sock)
    except OSError as exc:
        for sock in opened:
            sock.close()
        raise BenchError(
            f"cannot open {count} connections to http://{address[0]}:{address[1]}: "
            f"{exc.strerror or exc}"
        ) from None
    except BaseException:
        for sock in opened:
            sock.close()
        raise
    return opened


async def run_http(
    target: HttpTarget,
    plan: Plan,
    *,
    input_files: Sequence[Path] = (),
    shapes: Mapping[str, Sequence[int]] | None = None,
    binary: bool = False,
    progress: Callable[[Progress], None] | None = None,
) -> Run:
    """Benchmark a V2 server's model over HTTP; one `Result` per level.

    Raises:
        BenchError: No server, no such model, or unusable inputs.
    """
    metadata = await target.metadata()
    if input_files:
        variants = [load_inputs(p) for p in input_files]
    else:
        variants = [random_inputs(metadata["inputs"], shapes, seed=plan.seed)]
    requests = target.requests(variants, binary=binary)
    address = (target.host, target.port)

    probe_s = 0.0
    if plan.rates and not plan.max_connections:
        probe = _Connection(_Recorder())
        try:
            for n in range(_PROBE_REQUESTS):
                start = time.perf_counter()
                if probe.sock is None:
                    await probe.connect(address)
                await probe.request(requests[n % len(requests)])
                probe_s = max(probe_s, time.perf_counter() - start)
        except OSError as exc:
            raise BenchError(
                f"cannot connect to http://{target.host}:{target.port}: {exc.strerror or exc}"
            ) from None
        finally:
            probe.close()

    index = 0

    async def level(
        count: int, recorder: _Recorder, load: str, value: float, **loop_options: Any
    ) -> Result:
        nonlocal index
        socks = await _open_sockets(address, count)
        loop = _LoadLoop(address, requests, recorder, socks, **loop_options)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(functools.partial(trio.to_thread.run_sync, loop.run))
                try:
                    result = await _measure(
                        recorder, plan.settings, load, value, progress, (index, plan.levels)
                    )
                finally:
                    loop.stop()  # the thread returns, and the nursery with it
        finally:
            loop.close()
        index += 1
        return result

    async def run_closed(count: int, recorder: _Recorder) -> Result:
        return await level(count, recorder, "concurrency", count)

    async def run_open(rate: float, recorder: _Recorder) -> Result:
        pool, most = _pool_size(plan, rate, probe_s), _pool_limit(plan)
        schedule = iter_arrivals(rate, plan.arrivals, plan.seed)
        return await level(
            pool,
            recorder,
            "rate",
            rate,
            schedule=schedule,
            backlog_limit=_BACKLOG_PER_CONNECTION * most,
            max_connections=most,
        )

    return await _run_levels(plan, run_closed, run_open)


@asynccontextmanager
async def open_local_model(
    *,
    model_file: Path | None = None,
    repository: Path | None = None,
    model: str | None = None,
    version: int | None = None,
) -> AsyncIterator[tuple[Engine, str, list[dict[str, Any]]]]:
    """Open an engine with one model; yield it, the model's name and V2-style input specs.

    Either *model_file* (defaults for everything) or *repository* and *model*
    (its ``config.toml`` when there is one, and *version*).

    Raises:
        BenchError: Neither given, or the model cannot be found.
    """
    if model_file is not None:
        config = ModelConfig(name=model or "model", path=model_file)
    elif repository is not None and model is not None:
        toml = repository / model / "config.toml"
        if toml.is_file():
            config = ModelConfig.from_toml(toml, version=version)
        else:
            config = ModelConfig(name=model, path=find_model_file(repository / model, version))
    else:
        raise BenchError("--in-process needs --model-file, or --model-repository and --model")
    async with open_engine() as engine:
        info = await engine.load(config)
        specs = []
        for spec in info.signature.inputs:
            shape = [d if isinstance(d, int) else -1 for d in spec.shape]
            specs.append(
                {
                    "name": spec.name,
                    "datatype": v2_datatype(spec.dtype, spec.type_name),
                    "shape": shape,
                }
            )
        yield engine, info.name, specs


async def run_in_process(
    engine: Engine,
    model: str,
    specs: Sequence[Mapping[str, Any]],
    plan: Plan,
    *,
    input_files: Sequence[Path] = (),
    shapes: Mapping[str, Sequence[int]] | None = None,
    progress: Callable[[Progress], None] | None = None,
) -> Run:
    """Benchmark *model* on *engine* directly (no HTTP); one `Result` per level.

    CPU figures here are the whole process's: the engine's work included.
    """
    if input_files:
        variants = [load_inputs(p) for p in input_files]
    else:
        variants = [random_inputs(specs, shapes, seed=plan.seed)]
    inputs = [{t.name: t.array for t in v} for v in variants]
    index = 0

    def senders(count: int, recorder: _Recorder) -> list[Send]:
        async def send(n: int) -> Status:
            try:
                await engine.infer(model, inputs[n % len(inputs)])
            except TrioInferError as exc:
                name = type(exc).__name__
                recorder.first_error.setdefault(name, str(exc))
                return name
            return 200

        return [send] * count

    async def measure(recorder: _Recorder, load: str, value: float) -> Result:
        nonlocal index
        result = await _measure(
            recorder, plan.settings, load, value, progress, (index, plan.levels)
        )
        index += 1
        return result

    async def run_closed(count: int, recorder: _Recorder) -> Result:
        return await _closed_level(senders(count, recorder), recorder, measure)

    async def run_open(rate: float, recorder: _Recorder) -> Result:
        # Workers are only tasks: start them all; each sleeps until the time it claimed.
        return await _open_level(
            senders(_pool_limit(plan), recorder),
            recorder,
            measure,
            rate=rate,
            arrivals=plan.arrivals,
            seed=plan.seed,
        )

    return await _run_levels(plan, run_closed, run_open)


# -- output -------------------------------------------------------------------------------------

_COLUMNS: Final = (
    ("req/s", 9),
    ("p50 ms", 8),
    ("p90 ms", 8),
    ("p95 ms", 8),
    ("p99 ms", 8),
    ("max ms", 8),
    ("errors", 8),
    ("CPU us/req", 10),
    ("cores", 6),
    ("windows", 8),
)


def _table(results: Sequence[Result]) -> tuple[list[tuple[str, int]], list[list[str]]]:
    # The columns (name, width) and one row of cells per level.
    open_loop = results[0].load == "rate"
    first = ("rate/s", 8) if open_loop else ("concurrency", 11)
    columns = [first, *_COLUMNS]
    if open_loop:
        columns.insert(8, ("late", 7))
        columns.insert(9, ("dropped", 7))
    rows = []
    for r in results:
        lat = r.latency_ms
        cells = [
            f"{r.value:g}",
            f"{r.throughput:,.0f}",
            *(f"{lat[k]:.2f}" for k in ("p50", "p90", "p95", "p99", "max")),
            str(sum(r.errors.values())),
            f"{r.cpu_us_per_request:.1f}",
            f"{r.cores:.2f}",
            f"{r.windows}{'*' if r.stable is False else ''}",
        ]
        if open_loop:
            cells.insert(8, str(r.late))
            cells.insert(9, str(r.dropped))
        rows.append(cells)
    return columns, rows


def _notes(results: Sequence[Result]) -> list[str]:
    # What the table cannot say in a cell: errors by status, overload, instability.
    lines = []
    failed = Counter[str]()
    for r in results:
        failed.update(r.errors)
    if failed:
        lines.append(
            "errors by status: " + ", ".join(f"{k} x {v}" for k, v in sorted(failed.items()))
        )
    for r in results:
        behind = r.late + r.dropped
        if r.load == "rate" and behind > _BEHIND_SHARE * (r.completed + r.dropped):
            lines.append(
                f"at {r.value:g}/s the server (or this tool) could not keep up: {r.late} requests "
                f"waited for a free connection, {r.dropped} were dropped; their wait is latency"
            )
    if any(r.stable is False for r in results):
        lines.append("* not stable within the bound after the last window")
    return lines


def format_table(results: Sequence[Result]) -> str:
    """The results as an aligned text table, one row per level, and notes under it."""
    if not results:
        return ""
    columns, rows = _table(results)
    lines = ["  ".join(name.rjust(width) for name, width in columns)]
    for cells in rows:
        lines.append("  ".join(c.rjust(w) for c, (_, w) in zip(cells, columns, strict=True)))
    return "\n".join([*lines, *_notes(results)])


def print_table(results: Sequence[Result]) -> None:
    """Print the results on stdout: a rich table on a terminal when rich is installed.

    Anywhere else (a pipe, a file, no rich, a terminal too narrow for every
    digit) it prints `format_table`'s plain text, which scripts can parse.
    """
    if not results:
        return
    if not sys.stdout.isatty():
        print(format_table(results))
        return
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(format_table(results))
        return
    columns, rows = _table(results)
    console = Console()
    if console.width < sum(width + 2 for _, width in columns):
        # Too narrow: rich would elide digits; plain lines wrap but keep every one.
        print(format_table(results))
        return
    table = Table(box=None, header_style="bold")
    for name, _ in columns:
        table.add_column(name, justify="right", no_wrap=True)
    for cells in rows:
        table.add_row(*cells)
    console.print(table)
    for line in _notes(results):
        console.print(line, highlight=False, markup=False, soft_wrap=True)


def _describe(p: Progress) -> tuple[str, str]:
    # The level, and where it is: "[2/4] concurrency 16", "window 3/10  19,780 req/s ...".
    phase = "warm-up" if p.window == 0 else f"window {p.window}/{p.windows}"
    status = f"{phase}  {p.throughput:,.0f} req/s"
    if not math.isnan(p.p99_ms):
        status += f"  last p99 {p.p99_ms:.2f} ms"
    return f"[{p.index + 1}/{p.levels}] {p.level}", status


@contextmanager
def open_progress() -> Iterator[Callable[[Progress], None] | None]:
    """Show the run's progress on stderr while the block runs, if stderr is a terminal.

    With rich installed (``pip install 'trioinfer[bench]'``) it is a progress bar
    through the current warm-up or window, with its throughput so far; without,
    one status line. Either is redrawn only when the benchmark reports (4 times a
    second) and erased at the end. Yields ``None`` when stderr is not a terminal:
    then nothing is drawn and the benchmark does not wake up to report.
    """
    if not sys.stderr.isatty():
        yield None
        return
    try:
        import rich.progress
        from rich.console import Console
    except ImportError:

        def show_line(p: Progress) -> None:
            level, status = _describe(p)
            sys.stderr.write(f"\r\x1b[K{level}: {status}")
            sys.stderr.flush()

        try:
            yield show_line
        finally:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
        return
    bar = rich.progress.Progress(
        rich.progress.TextColumn("{task.description}"),
        rich.progress.BarColumn(),
        rich.progress.TextColumn("{task.fields[status]}"),
        console=Console(stderr=True),
        auto_refresh=False,  # no refresh thread: redrawn when the benchmark reports
        transient=True,
        redirect_stdout=False,
        redirect_stderr=False,
    )
    task = bar.add_task("", total=1.0, status="")

    def show_bar(p: Progress) -> None:
        level, status = _describe(p)
        bar.update(task, description=level, completed=p.fraction, status=status)
        bar.refresh()

    with bar:
        yield show_bar


def write_json(path: Path, results: Sequence[Result], about: Mapping[str, Any]) -> None:
    """Write the run's settings and one object per level as JSON."""
    doc = {**about, "results": [r.row() for r in results]}
    path.write_text(json.dumps(doc, indent=2) + "\n")


def write_csv(path: Path, results: Sequence[Result]) -> None:
    """Write one CSV row per level, with a header."""
    rows = [r.row() for r in results]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["load"])
        writer.writeheader()
        writer.writerows(rows)


def write_plot(path: Path, results: Sequence[Result], title: str) -> None:
    """Plot latency percentiles against throughput across the levels (needs matplotlib).

    Raises:
        BenchError: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BenchError("--plot needs matplotlib: pip install 'trioinfer[bench]'") from None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = [r.throughput for r in results]
    for key in ("p50", "p90", "p95", "p99"):
        ax.plot(x, [r.latency_ms[key] for r in results], marker="o", label=key)
    for r in results:
        tag = f"c={r.value:g}" if r.load == "concurrency" else f"{r.value:g}/s"
        ax.annotate(
            tag,
            (r.throughput, r.latency_ms["p99"]),
            textcoords="offset points",
            xytext=(4, 4),
            fontsize=8,
        )
    ax.set_xlabel("throughput (successful requests/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_title(title)
    ax.grid(visible=True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
