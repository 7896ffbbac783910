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
(model metadata and infer) over raw Trio sockets, with every request's bytes
encoded once before the run and responses parsed by httptools, so that the tool
costs little CPU per request; it measures its own CPU time and reports it.
"""

from __future__ import annotations

import csv
import json
import math
import os
import resource
import socket
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
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
# Open loop: the smallest default pool; a 1 ms hiccup at a few thousand req/s needs this many.
_MIN_POOL: Final = 32
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
        late: Open loop: requests that found every connection busy and waited.
        dropped: Open loop: requests never sent because too many were waiting.
        windows: How many windows ran; the last three (or all, with a fixed count) count.
        stable: Whether the counted windows agreed within the stability bound.
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
    stable: bool
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


async def _measure(
    recorder: _Recorder,
    settings: Settings,
    load: str,
    value: float,
    progress: Callable[[str], None],
) -> Result:
    label = f"{load} {value:g}"
    progress(f"{label}: warming up")
    await trio.sleep(settings.warmup_s)
    done: list[_Window] = []
    limit = settings.windows or settings.max_windows
    stable = False
    while len(done) < limit:
        window = recorder.window = _Window()
        start, cpu = time.perf_counter(), _cpu_s()
        await trio.sleep(settings.window_s)
        recorder.window = _Window()  # requests finishing from now on count in no window
        window.wall_s, window.cpu_s = time.perf_counter() - start, _cpu_s() - cpu
        done.append(window)
        progress(
            f"{label}: window {len(done)}  {_throughput(window):,.0f} req/s  "
            f"p99 {_p99(window) / 1e6:.2f} ms"
        )
        if not settings.windows:
            pairs = [(_throughput(w), _p99(w)) for w in done]
            stable = is_stable(pairs, settings.stability)
            if stable:
                break
    counted = done if settings.windows else done[-STABLE_WINDOWS:]
    if settings.windows:
        stable = is_stable([(_throughput(w), _p99(w)) for w in done], settings.stability)
    return _summarise(load, value, counted, len(done), stable)


def _summarise(
    load: str, value: float, counted: list[_Window], windows: int, stable: bool
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
Send = Callable[[int], Awaitable[Status]]


class _Connection:
    """One keep-alive HTTP/1.1 connection sending pre-encoded requests, one at a time.

    A plain non-blocking socket waited on with ``trio.lowlevel.wait_readable``:
    trio's socket wrappers cost several times more per call, and this client's
    own CPU time is what it must keep small.
    """

    def __init__(self, host: str, port: int, requests: Sequence[bytes], recorder: _Recorder):
        self._address = (host, port)
        self._requests = requests
        self._recorder = recorder
        self._sock: socket.socket | None = None
        self._parser: httptools.HttpResponseParser | None = None
        self._done = False
        self._keep_alive = True
        self._status = 0
        self._body: list[bytes] | None = None
        self.keep_body = False  # keep a successful answer's body too (metadata)

    # httptools callbacks
    def on_headers_complete(self) -> None:
        assert self._parser is not None
        self._status = self._parser.get_status_code()
        # Keep a failed answer's body for the message; never a successful one's.
        self._body = None if self._status == 200 and not self.keep_body else []

    def on_body(self, body: bytes) -> None:
        if self._body is not None:
            self._body.append(body)

    def on_message_complete(self) -> None:
        assert self._parser is not None
        # Read here: once the message is complete the parser resets for the next one.
        self._keep_alive = self._parser.should_keep_alive()
        self._done = True

    async def connect(self) -> None:
        """Open the connection (raising `OSError` when refused)."""
        sock = socket.socket(socket.AF_INET6 if ":" in self._address[0] else socket.AF_INET)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            try:
                sock.connect(self._address)
            except BlockingIOError:
                await trio.lowlevel.wait_writable(sock)
                error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if error:
                    raise OSError(error, os.strerror(error)) from None
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._parser = httptools.HttpResponseParser(self)

    def close(self) -> None:
        """Close the socket; the next request reconnects."""
        if self._sock is not None:
            trio.lowlevel.notify_closing(self._sock)
            self._sock.close()
        self._sock = None

    @staticmethod
    async def _send_rest(sock: socket.socket, view: memoryview) -> None:
        while view:
            await trio.lowlevel.wait_writable(sock)
            with suppress(BlockingIOError):
                view = view[sock.send(view) :]

    async def __call__(self, n: int) -> Status:
        """Send request variant *n* and read its answer; return its status."""
        data = self._requests[n % len(self._requests)]
        try:
            if self._sock is None:
                await self.connect()
            sock, parser = self._sock, self._parser
            assert sock is not None
            assert parser is not None
            self._done = False
            try:
                sent = sock.send(data)
            except BlockingIOError:
                sent = 0
            if sent < len(data):
                await self._send_rest(sock, memoryview(data)[sent:])
            while not self._done:
                # The answer is never there yet right after sending: wait first, which
                # saves a failing recv call per request.
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
            self._recorder.first_error.setdefault(_CONN_ERROR, f"{type(exc).__name__}: {exc}")
            return _CONN_ERROR
        if not self._keep_alive:
            self.close()
        if self._body is not None:
            self._recorder.first_error.setdefault(
                self._status, b"".join(self._body)[:300].decode(errors="replace")
            )
        return self._status


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
        connection = _Connection(self.host, self.port, [request], recorder)
        try:
            await connection.connect()
        except OSError as exc:
            raise BenchError(
                f"cannot connect to http://{self.host}:{self.port}: {exc.strerror or exc}; "
                "is the server running?"
            ) from None
        connection.keep_body = True
        try:
            status = await connection(0)
            body = b"".join(connection._body or [])
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
    settings: Settings,
    progress: Callable[[str], None],
) -> Result:
    async def worker(send: Send, first: int) -> None:
        n = first
        window = recorder.window
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
        result = await _measure(recorder, settings, "concurrency", len(senders), progress)
        nursery.cancel_scope.cancel()
    return result


async def _open_level(
    senders: Sequence[Send],
    recorder: _Recorder,
    settings: Settings,
    progress: Callable[[str], None],
    *,
    rate: float,
    arrivals: Arrivals,
    seed: int,
) -> Result:
    # One schedule shared by all workers: a worker that is free claims the next due
    # time and sleeps until it. So a request waits for a connection only when every
    # worker is busy ("late"), and its latency still runs from when it was due. No
    # dispatcher task and no channel: one wake-up per request, not three.
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
        result = await _measure(recorder, settings, "rate", rate, progress)
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
        max_connections: Open loop: the connection pool (0: sized from a probe).
        settings: Warm-up, window and stability settings.
    """

    concurrency: tuple[int, ...] = (1,)
    rates: tuple[float, ...] = ()
    arrivals: Arrivals = "poisson"
    seed: int = 0
    max_connections: int = 0
    settings: Settings = Settings()


async def _run_levels(
    plan: Plan,
    make_senders: Callable[[int, _Recorder], Awaitable[list[Send]]],
    close: Callable[[], None],
    probe_s: float,
    progress: Callable[[str], None],
) -> Run:
    results = []
    seen: dict[str, str] = {}
    try:
        if plan.rates:
            for rate in plan.rates:
                # Enough connections for the rate times a generous latency, as Little's law says.
                pool = plan.max_connections or min(
                    1024, max(_MIN_POOL, math.ceil(rate * probe_s * 4))
                )
                recorder = _Recorder()
                senders = await make_senders(pool, recorder)
                results.append(
                    await _open_level(
                        senders,
                        recorder,
                        plan.settings,
                        progress,
                        rate=rate,
                        arrivals=plan.arrivals,
                        seed=plan.seed,
                    )
                )
                seen.update(
                    {str(k): v for k, v in recorder.first_error.items() if str(k) not in seen}
                )
                close()
        else:
            for c in plan.concurrency:
                recorder = _Recorder()
                senders = await make_senders(c, recorder)
                results.append(await _closed_level(senders, recorder, plan.settings, progress))
                seen.update(
                    {str(k): v for k, v in recorder.first_error.items() if str(k) not in seen}
                )
                close()
    finally:
        close()
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


async def run_http(
    target: HttpTarget,
    plan: Plan,
    *,
    input_files: Sequence[Path] = (),
    shapes: Mapping[str, Sequence[int]] | None = None,
    binary: bool = False,
    progress: Callable[[str], None] = lambda _: None,
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
    connections: list[_Connection] = []

    async def make_senders(count: int, recorder: _Recorder) -> list[Send]:
        made = [_Connection(target.host, target.port, requests, recorder) for _ in range(count)]
        connections.extend(made)
        try:
            for c in made:
                await c.connect()
        except OSError as exc:
            raise BenchError(
                f"cannot open {count} connections to http://{target.host}:{target.port}: "
                f"{exc.strerror or exc}"
            ) from None
        return list(made)

    def close() -> None:
        for c in connections:
            c.close()
        connections.clear()

    probe_s = 0.0
    if plan.rates and not plan.max_connections:
        probe = _Recorder()
        (send,) = await make_senders(1, probe)
        for n in range(_PROBE_REQUESTS):
            start = time.perf_counter()
            await send(n)
            probe_s = max(probe_s, time.perf_counter() - start)
        close()
    return await _run_levels(plan, make_senders, close, probe_s, progress)


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
    progress: Callable[[str], None] = lambda _: None,
) -> Run:
    """Benchmark *model* on *engine* directly (no HTTP); one `Result` per level.

    CPU figures here are the whole process's: the engine's work included.
    """
    if input_files:
        variants = [load_inputs(p) for p in input_files]
    else:
        variants = [random_inputs(specs, shapes, seed=plan.seed)]
    inputs = [{t.name: t.array for t in v} for v in variants]

    async def make_senders(count: int, recorder: _Recorder) -> list[Send]:
        async def send(n: int) -> Status:
            try:
                await engine.infer(model, inputs[n % len(inputs)])
            except TrioInferError as exc:
                name = type(exc).__name__
                recorder.first_error.setdefault(name, str(exc))
                return name
            return 200

        return [send] * count

    return await _run_levels(plan, make_senders, lambda: None, 0.01, progress)


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


def format_table(results: Sequence[Result]) -> str:
    """The results as an aligned text table, one row per level."""
    if not results:
        return ""
    open_loop = results[0].load == "rate"
    first = ("rate/s", 8) if open_loop else ("concurrency", 11)
    columns = [first, *_COLUMNS]
    if open_loop:
        columns.insert(8, ("late", 7))
        columns.insert(9, ("dropped", 7))
    lines = ["  ".join(name.rjust(width) for name, width in columns)]
    for r in results:
        lat = r.latency_ms
        cells = [
            f"{r.value:g}",
            f"{r.throughput:,.0f}",
            *(f"{lat[k]:.2f}" for k in ("p50", "p90", "p95", "p99", "max")),
            str(sum(r.errors.values())),
            f"{r.cpu_us_per_request:.1f}",
            f"{r.cores:.2f}",
            f"{r.windows}{'' if r.stable else '*'}",
        ]
        if open_loop:
            cells.insert(8, str(r.late))
            cells.insert(9, str(r.dropped))
        lines.append("  ".join(c.rjust(w) for c, (_, w) in zip(cells, columns, strict=True)))
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
    if not all(r.stable for r in results):
        lines.append("* not stable within the bound after the last window")
    return "\n".join(lines)


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


def progress_line() -> Callable[[str], None]:
    """A status printer: one carriage-return line on stderr when it is a terminal, else nothing."""
    if not sys.stderr.isatty():
        return lambda _: None

    def show(text: str) -> None:
        sys.stderr.write("\r\x1b[K" + text)
        sys.stderr.flush()

    return show
