"""Statistics: one level's measurement windows, their stability, and the `Result` they make.

Workers record each answer in the current `_Window` (latency or error); `_measure`
runs the warm-up and the windows on Trio's clock, swapping windows under the
workers, until the last three agree (`is_stable`), and `_summarise` turns the
counted windows into percentiles, throughput and the tool's own CPU cost.
"""

from __future__ import annotations

import math
import resource
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Final

import attrs
import numpy as np
import numpy.typing as npt
import trio

#: The percentiles every result reports, in this order.
PERCENTILES: Final = (50, 90, 95, 99)
#: How many of the latest windows must agree for a level to count as stable.
STABLE_WINDOWS: Final = 3
#: The status of a streamed request answered with an error among its responses (a gRPC
#: stream's ``error_message``, an SSE stream's ``{"error": ...}`` event).
STREAM_ERROR: Final = "stream-error"
# How a request ended: its HTTP status, or a name for a failure without one
# ("conn", or an in-process error's class).
Status = int | str


@attrs.define(eq=False)
class _Window:
    # What completed (or was scheduled) in one window; workers append as they finish.
    latencies: list[int] = attrs.field(factory=list)
    errors: Counter[Status] = attrs.field(factory=Counter)
    late: int = 0
    dropped: int = 0
    # Open loop: requests sent, and how late each left after it was due (ns).
    sent: int = 0
    delays: list[int] = attrs.field(factory=list)
    # Streaming: each successful request's time to its first response (ns), and the
    # responses of the successful requests.
    first: list[int] = attrs.field(factory=list)
    responses: int = 0
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
        responses_per_s: Streaming: the successful requests' responses per second
            (``None`` for a level of one response per request).
        first_response_ms: Streaming: p50, p90, p95, p99 and max of the time to a
            successful request's first response, in ms (``None`` without streaming;
            NaN where no request had a response). ``latency_ms`` is then the
            time to the last.
        sent_per_s: Open loop: requests sent per second, the rate achieved beside
            the one asked (``value``); ``None`` in a closed loop.
        send_delay_ms: Open loop: p50, p90, p95, p99 and max of how late requests
            were sent after they were due, in ms (a wait for a connection, the
            tool's own lag); ``None`` in a closed loop.
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
    responses_per_s: float | None = None
    first_response_ms: dict[str, float] | None = None
    sent_per_s: float | None = None
    send_delay_ms: dict[str, float] | None = None

    def row(self) -> dict[str, Any]:
        """The result as one flat mapping (what ``--json`` and ``--csv`` write).

        A figure with nothing to measure (latencies when no request succeeded, CPU
        per request when none finished) is ``None``: ``null`` in JSON, which has no
        NaN, and empty in CSV.
        """
        streaming: dict[str, Any] = {}
        if self.first_response_ms is not None:
            streaming = {
                "responses_per_s": _figure(self.responses_per_s or 0.0, 2),
                **{f"first_{k}_ms": _figure(v, 4) for k, v in self.first_response_ms.items()},
            }
        open_loop: dict[str, Any] = {}
        if self.send_delay_ms is not None:
            open_loop = {
                "sent_per_s": round(self.sent_per_s or 0.0, 2),
                **{f"send_delay_{k}_ms": _figure(v, 4) for k, v in self.send_delay_ms.items()},
            }
        return {
            "load": self.load,
            "value": self.value,
            "throughput": round(self.throughput, 2),
            **{f"{k}_ms": _figure(v, 4) for k, v in self.latency_ms.items()},
            "completed": self.completed,
            "errors": sum(self.errors.values()),
            "errors_by_status": " ".join(f"{k}:{v}" for k, v in sorted(self.errors.items())),
            "late": self.late,
            "dropped": self.dropped,
            **open_loop,
            "windows": self.windows,
            "stable": self.stable,
            "cpu_us_per_request": _figure(self.cpu_us_per_request, 2),
            "cores": round(self.cores, 3),
            **streaming,
        }


def _figure(value: float, digits: int) -> float | None:
    return None if math.isnan(value) else round(value, digits)


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
        throughput: Successful requests per second so far in the current warm-up or
            window; NaN during its first refresh interval, too short to tell.
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
    *,
    streaming: bool = False,
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
                    # Not before a refresh interval has passed: a few answers over
                    # a few microseconds read as hundreds of thousands per second.
                    throughput=(
                        len(recorder.window.latencies) / elapsed
                        if elapsed >= _REFRESH_S
                        else math.nan
                    ),
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
    return _summarise(load, value, counted, len(done), verdict, streaming=streaming)


def _percentiles(values_ns: npt.NDArray[np.float64]) -> dict[str, float]:
    # p50..p99 and max in ms; NaN for each when there is nothing to measure.
    names = [*(f"p{p}" for p in PERCENTILES), "max"]
    if not len(values_ns):
        return dict.fromkeys(names, math.nan)
    values = [*np.percentile(values_ns, PERCENTILES).tolist(), values_ns.max()]
    return {name: v / 1e6 for name, v in zip(names, values, strict=True)}


def _summarise(
    load: str,
    value: float,
    counted: list[_Window],
    windows: int,
    stable: bool | None,
    *,
    streaming: bool = False,
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
    first = None
    if streaming:
        first = _percentiles(
            np.fromiter((x for w in counted for x in w.first), dtype=np.int64).astype(np.float64)
        )
    delays = None
    if load == "rate":
        delays = _percentiles(
            np.fromiter((x for w in counted for x in w.delays), dtype=np.int64).astype(np.float64)
        )
    return Result(
        load=load,
        value=value,
        throughput=len(latencies) / wall if wall else 0.0,
        latency_ms=_percentiles(latencies),
        completed=len(latencies),
        errors=dict(errors),
        late=sum(w.late for w in counted),
        dropped=sum(w.dropped for w in counted),
        windows=windows,
        stable=stable,
        cpu_us_per_request=cpu / finished * 1e6 if finished else math.nan,
        cores=cpu / wall if wall else 0.0,
        responses_per_s=(
            (sum(w.responses for w in counted) / wall if wall else 0.0) if streaming else None
        ),
        first_response_ms=first,
        sent_per_s=(sum(w.sent for w in counted) / wall if wall else 0.0) if delays else None,
        send_delay_ms=delays,
    )
