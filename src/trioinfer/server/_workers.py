"""``trioinfer serve --workers N``: N server processes on one port, and the supervisor over them.

When one event loop is the limit (one core's worth of HTTP parsing, coding
and scheduling), more processes serve the same port: each worker is a whole
``serve_http`` (its own engine, sessions and event loop) bound with
``SO_REUSEPORT``, and the kernel spreads new connections among them. With
gRPC, each worker serves it too, on the one gRPC port, bound the same way
(the HTTP and gRPC layers share the worker's `ServerState`, so what follows
holds for both protocols). The
supervisor (the ``trioinfer serve`` process) starts them, restarts one that
dies (with backoff), and stops them all on SIGINT/SIGTERM, each draining as a
single server does. It binds the ports too, without listening, so that they
stay reserved while a worker restarts and port 0 means one port.

They talk over Unix sockets in a private temporary directory the supervisor
creates and removes (one JSON line each way per call; a worker's periodic
reports are lines on a connection it keeps open, with no answer):

- repository load and unload (config overrides and traffic splits included):
  the worker that received the request asks the supervisor, which applies it
  on every worker, one change at a time, and answers once all have; a change
  that fails on some workers only is an error that names them. A worker that
  does not answer is asked again while its process runs, and pinged while it
  applies the change (`_Supervisor._reach`):
  one that died takes the change when it restarts, one that runs and cannot be
  reached fails the change, named, and is restarted (what it serves is unknown
  then: it may or may not have applied the change). The supervisor
  keeps the last change of each model and replays them to a worker that
  restarts, before it listens, so a restarted worker serves what the others do.
  It loaded the repository as it is on disk, though: after a reload that
  failed on the others (they serve the files they loaded before), or files
  changed without a load, it would serve something else. So it joins only
  once it serves what the others serve (each version's files as loaded, its
  config override, the traffic split: `served_state`); until then it does not
  listen, the supervisor says why, and each change that applies is repeated
  to it (a poll's reload of the repaired files, say) until they agree, or
  for `JOIN_S` at most: then it exits, and starts again.
  Workers that start together are compared the same way once all are ready
  (`_Supervisor._compare_at_start`): each that differs from the one serving
  the most is restarted, and joins as above.
- trace settings (``POST /v2[/models/{m}]/trace/setting``): the same way, kept
  per setting (each changes alone, so the last value of each is the state).
- statistics and ``/metrics``: the answering worker sends its own to the
  supervisor, which gathers the others' at request time and adds them up,
  sample by sample
  (counts, sums and histograms add up to the server's figure, and so do gauges:
  each worker's value counted once, which is the server's figure for a gauge of
  things held, such as requests in flight or bytes cached; a model's own gauge
  combines as it declares, `merge_expositions`). The supervisor keeps what each
  worker last reported (`MetricsLedger`, `StatsLedger`): a worker that does
  not answer in time is counted as it was, and one that dies leaves its counts
  (counters, histograms and Triton's statistics; not gauges) in the sums, so
  that no counter ever goes down (Prometheus would read that as a reset, and
  count the whole remaining sum again as new). Besides each request's
  gathering, every worker reports its counts every `REPORT_S` when it has
  answered requests since: what a worker counted after its last report (at
  most `REPORT_S`'s worth) is lost with it. Reports are taken by a periodic
  task, never on the per-request path, and are plain numbers
  (`Metrics.counts`: the engine's statistics and the HTTP outcome counters)
  sent as one line on a connection the worker keeps open: the supervisor
  renders the text and Triton's statistics (`exposition_of`, `triton_entry`,
  the functions a single server's routes use), so that a report costs a
  worker's event loop 0.25-0.3 ms of CPU where rendering its own exposition
  took 1.4-3 ms (one to four models), every second it served.
  prometheus_client's multiprocess mode
  was not used: it supports only its own metric objects, updated on the hot
  path through memory-mapped files, while trioinfer's metrics are read from
  the engine's statistics at scrape time (its custom collectors cannot run in
  that mode), and Triton's statistics would have needed the reports anyway.

A worker's in-flight requests die with it: their connections close, and no
client is answered by anyone else. Connections the kernel had queued for it
(accepted but not yet taken) are reset.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import math
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar, final

import anyio
import anyio.abc
import attrs
import orjson
from anyio.streams.buffered import BufferedByteReceiveStream
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from .. import _exceptions, _start_signals
from .._custom_metrics import GaugeWorkers
from .._exceptions import ConfigError, TrioInferError
from .._exit import BACKSTOP_S, LAST_CANCEL_S
from . import _codec
from ._host_metrics import HostMetrics, host_metrics_for
from ._metrics import Counts, exposition_of, gauges_of, triton_entry
from ._poll import poll_repository
from ._poll import snapshot as repository_snapshot

if TYPE_CHECKING:
    from ._app import ServerConfig, ServerState
    from ._models import ServedModels
    from ._serve import Listening

__all__ = ["WorkerFailed", "WorkerLink", "WorkersDisagree", "serve_workers"]

#: A snapshot a worker reports: a metrics exposition, or its statistics.
_S = TypeVar("_S")

log = logging.getLogger("trioinfer.server")

#: The environment variable that hands a worker its settings (JSON).
SPEC_ENV: Final = "TRIOINFER_WORKER_SPEC"
#: The largest control message (a worker's metrics text is the largest).
_MAX_MESSAGE: Final = 64 << 20
#: How long a worker may take to send its statistics or metrics before it is left out.
GATHER_TIMEOUT_S: Final = 10.0
#: How long the supervisor tries to reach a worker whose process runs with a change
#: (fresh connections, doubling delays from `RETRY_S`) before the change fails on it.
REACH_S: Final = 2.0
RETRY_S: Final = 0.05
#: While a worker applies a change (a load may take minutes), how often the supervisor
#: pings it on another connection: one that answers no ping within `REACH_S` has its
#: event loop blocked, and is out of reach.
PING_S: Final = 5.0
#: Restart delays: the first, and the most (doubling in between).
RESTART_DELAY_S: Final = 0.5
MAX_RESTART_DELAY_S: Final = 30.0
#: Worker processes the supervisor starts at once. Each start checks first that serve
#: is not stopping: a signal (or a worker that failed) stops the start of the others
#: once those under way are made, however many workers there are.
STARTS_AT_ONCE: Final = 8
#: A worker that ran this long before dying is restarted after the first delay again.
STABLE_AFTER_S: Final = 30.0
#: Consecutive restarts of one worker that die before it is ready, before serve gives up.
MAX_FAILED_STARTS: Final = 5
#: How long a worker that (re)starts may wait to serve what the others serve (see
#: `_Supervisor._hello`) before it gives up: it exits, and is started again.
JOIN_S: Final = 300.0
#: At shutdown, how long past the drain period a worker may take to exit before it is killed.
STOP_MARGIN_S: Final = 10.0
#: How often a worker checks that its supervisor is still there.
PARENT_POLL_S: Final = 1.0
#: How often a worker reports its statistics and metrics to the supervisor (when it has
#: answered requests since): what it counted after its last report dies with it.
REPORT_S: Final = 1.0
#: A worker that answered no request reports anyway this often (a probe, a failing
#: instance, a fallback change counts too).
REPORT_ANYWAY_S: Final = 15.0


#: What to do when a repository poll's change applied on some workers only (a polled
#: server's API refuses loads and unloads).
_POLL_ADVICE: Final = (
    "the poll tries it again when the model's files have changed again (touching them "
    "does), or restart the server"
)


class WorkerFailed(TrioInferError):
    """A worker could not start (or kept dying before it was ready): serving stops.

    Also raised when workers outlived ``--exit-timeout-secs``.

    Attributes:
        logged: The supervisor has logged this message at ERROR already (the
            workers that outlived the exit timeout, with their pids): the
            command exits 1 without printing it again.
    """

    def __init__(self, message: str, *, logged: bool = False) -> None:
        super().__init__(message)
        self.logged = logged


class WorkersDisagree(TrioInferError):
    """A repository change applied on some workers and failed on others (HTTP 500)."""


class _Gone(Exception):
    """The other end of a control call is not there (any more)."""


class _StoppedBeforeJoining(TrioInferError):
    """The server stopped while this worker waited to join the others: it exits, as asked."""


# -- the wire: one JSON line each way per call --------------------------------------------


async def _call(path: Path, message: Mapping[str, Any]) -> dict[str, Any]:
    try:
        async with await anyio.connect_unix(path) as stream:
            await stream.send(json.dumps(message).encode() + b"\n")
            line = await BufferedByteReceiveStream(stream).receive_until(b"\n", _MAX_MESSAGE)
    except (OSError, anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError) as exc:
        raise _Gone(f"{path.name}: {exc!r}") from exc
    reply: dict[str, Any] = json.loads(line)
    return reply


@attrs.frozen
class _Unreached:
    """Why `_call_while` got no answer: its tries, the last error, and whether the far side died."""

    tries: int
    why: _Gone
    dead: bool
    #: It took the call, then answered no ping meanwhile (`_Supervisor._reach`).
    blocked: bool = False


async def _call_while(
    path: Path,
    message: Mapping[str, Any],
    alive: Callable[[], bool],
    retrying: Callable[[_Gone], object] | None = None,
) -> dict[str, Any] | _Unreached:
    """`_call`, asked again on fresh connections for `REACH_S` while *alive()* says so.

    A socket error (a full backlog, a connection cut) is no death while the
    process on the other side runs; *retrying* hears each error that is tried
    again. The answer, or why there was none.
    """
    tries, delay = 0, RETRY_S
    deadline = anyio.current_time() + REACH_S
    while True:
        tries += 1
        try:
            return await _call(path, message)
        except _Gone as exc:
            why = exc
        if not alive():
            return _Unreached(tries, why, dead=True)
        left = deadline - anyio.current_time()
        if left <= 0:
            return _Unreached(tries, why, dead=False)
        if retrying is not None:
            retrying(why)
        await anyio.sleep(min(delay, left))
        delay *= 2


_Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


async def _serve_calls(
    path: Path,
    handle: _Handler,
    *,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Answer control calls on the Unix socket *path*, each in its own task, forever."""
    await anyio.Path(path).unlink(missing_ok=True)  # a worker's earlier life left it
    listener = await anyio.create_unix_listener(path)

    async def answer(stream: anyio.abc.SocketStream) -> None:
        # One call after the other until the caller closes: a worker keeps one
        # connection open for its periodic reports (see WorkerLink._report_counts).
        async with stream:
            lines = BufferedByteReceiveStream(stream)
            try:
                while True:
                    message = json.loads(await lines.receive_until(b"\n", _MAX_MESSAGE))
                    try:
                        reply = await handle(message)
                    except Exception as exc:
                        # A bug here must cost one call, never the server; and it is
                        # answered: a call closed without an answer reads as a worker
                        # that died, which takes a change when it restarts, while this
                        # one, alive, would go on serving what it had.
                        log.exception("unexpected error answering a control call on %s", path.name)
                        said = (
                            f"unexpected {type(exc).__name__} answering the {message.get('op')!r} "
                            f"call (the log of {path.stem} says more)"
                        )
                        reply = {"error": {"type": "TrioInferError", "message": said}}
                    if message.get("reply", True):
                        await stream.send(json.dumps(reply).encode() + b"\n")
            except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError):
                pass  # the caller went away (a worker that died, a client that left)
            except Exception:
                # A bug here must cost one call, never the server.
                log.exception("unexpected error answering a control call on %s", path.name)

    async with listener:
        task_status.started()
        await listener.serve(answer)


def _error_reply(error: TrioInferError, message: str) -> dict[str, Any]:
    # Named by the nearest class the other side raises again (`_raise_error`): one of
    # the server's own subclasses (_models.OneProcessOnly) goes as its base, whose
    # status it shares, not as an unknown name (a 500).
    for kind in type(error).__mro__:
        name = kind.__name__
        if kind is WorkersDisagree or kind in (
            getattr(_exceptions, name, None),
            getattr(_codec, name, None),
        ):
            return {"error": {"type": name, "message": message}}
    return {"error": {"type": "TrioInferError", "message": message}}  # (not reached)


def _raise_error(error: Mapping[str, str]) -> None:
    """Raise the error a worker or the supervisor reported, as its own class where it can."""
    name, message = error["type"], error["message"]
    if name == "WorkersDisagree":
        raise WorkersDisagree(message)
    kind = getattr(_exceptions, name, None) or getattr(_codec, name, None)
    if isinstance(kind, type) and issubclass(kind, TrioInferError):
        try:
            found = kind(message)
        except TypeError:  # a class that needs more than a message (none a load raises)
            found = TrioInferError(message)
        raise found
    raise TrioInferError(message)


# -- adding up statistics and metrics --------------------------------------------------------


def merge_stats(parts: Iterable[Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """Add up Triton-style ``model_stats`` lists from several workers, per model version.

    Counts and durations are summed; ``last_inference`` is the latest.
    """
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for part in parts:
        for entry in part:
            key = (entry["name"], entry["version"])
            have = merged.get(key)
            if have is None:
                merged[key] = copy.deepcopy(dict(entry))
                continue
            have["last_inference"] = max(have["last_inference"], entry["last_inference"])
            have["inference_count"] += entry["inference_count"]
            have["execution_count"] += entry["execution_count"]
            for name, duration in entry["inference_stats"].items():
                total = have["inference_stats"].setdefault(name, {"count": 0, "ns": 0})
                total["count"] += duration["count"]
                total["ns"] += duration["ns"]
    return list(merged.values())


def merge_expositions(
    texts: Iterable[bytes], gauges: Mapping[str, GaugeWorkers] | None = None
) -> bytes:
    """Add up Prometheus text expositions from several workers, sample by sample.

    Samples with the same name and labels are summed (histogram buckets
    included), but those of the *gauges* named (a model's own, declared with
    ``workers``): the largest or smallest of them, or the one with the
    latest timestamp (``mostrecent``, see `exposition_of`); samples only some
    workers have (a worker's own series) are kept as they are. Timestamps
    are dropped. Families keep the first worker's order, and kind: a family
    of the same name and another kind is left out.
    """
    families: dict[str, Metric] = {}
    sums: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    latest: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for text in texts:
        for family in text_string_to_metric_families(text.decode()):
            if family.name not in families:
                families[family.name] = Metric(family.name, family.documentation, family.type)
                sums[family.name] = {}
            elif families[family.name].type != family.type:
                # A model's own family that a reload, not yet on every worker, declares
                # as another kind: the first worker's kind, whole, keeps the text valid.
                continue
            values = sums[family.name]
            combine = (gauges or {}).get(family.name, "sum")
            for sample in family.samples:
                key = (sample.name, tuple(sample.labels.items()))
                have = values.get(key)
                if have is None:
                    values[key] = sample.value
                elif combine == "max":
                    values[key] = max(have, sample.value)
                elif combine == "min":
                    values[key] = min(have, sample.value)
                elif combine == "mostrecent":
                    if _seconds(sample.timestamp) > latest.get(key, 0.0):
                        values[key] = sample.value
                else:
                    values[key] = have + sample.value
                if combine == "mostrecent":
                    latest[key] = max(latest.get(key, 0.0), _seconds(sample.timestamp))
    for name, family in families.items():
        for (sample_name, labels), value in sums[name].items():
            family.add_sample(sample_name, dict(labels), value)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(list(families.values())))
    return generate_latest(registry)


def _seconds(timestamp: object) -> float:
    # The parser's sample timestamps are floats (text format) or Timestamps (OpenMetrics).
    return float(timestamp) if isinstance(timestamp, (int, float)) else 0.0


#: Families one server keeps a model's series of when it is unloaded (Metrics' own
#: outcome counter, not read from the engine's statistics).
_KEPT_AT_UNLOAD: Final = frozenset({"trioinfer_inference_requests"})

#: Metric types whose samples only grow in a process's life: a dead worker's stay in the sums.
_CUMULATIVE: Final = frozenset({"counter", "histogram", "summary"})


def _counts_only(text: bytes) -> bytes:
    """The samples of *text* that a dead worker leaves in the sums: its counts, not its gauges.

    Its own series (labelled with its ``pid``) end with it, and ``_created``
    timestamps are no counts.
    """
    return _samples_where(
        text,
        lambda family, sample: (
            family.type in _CUMULATIVE
            and "pid" not in sample.labels
            and not sample.name.endswith("_created")
        ),
    )


def _samples_where(text: bytes, keep: Callable[[Metric, Any], bool]) -> bytes:
    """*text* with only the samples *keep* (given each one's family) says to keep."""
    kept: list[Metric] = []
    for family in text_string_to_metric_families(text.decode()):
        metric = Metric(family.name, family.documentation, family.type)
        for sample in family.samples:
            if keep(family, sample):
                metric.add_sample(sample.name, sample.labels, sample.value)
        if metric.samples:
            kept.append(metric)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(kept))
    return generate_latest(registry)


@final
class _Latest(Generic[_S]):
    """The latest snapshot each live worker reported, by worker index."""

    def __init__(self) -> None:
        self._by_index: dict[int, tuple[int, int, _S]] = {}

    def report(self, index: int, pid: int, snapshot: _S, taken: int) -> None:
        """Worker *index* (process *pid*) reported *snapshot*, its *taken*-th.

        A snapshot older than the one kept (reports cross on their way) is
        ignored: a counter must not go back to an earlier value.
        """
        last = self._by_index.get(index)
        if last is None or last[0] != pid or last[1] <= taken:
            self._by_index[index] = (pid, taken, snapshot)

    def pop(self, index: int, pid: int) -> _S | None:
        """What worker *index*'s process *pid* last reported (None if nothing), forgotten."""
        last = self._by_index.get(index)
        if last is None or last[0] != pid:
            return None
        del self._by_index[index]
        return last[2]

    def ordered(self, first: int) -> list[_S]:
        """Every live worker's latest, worker *first*'s in front."""
        return [self._by_index[i][2] for i in sorted(self._by_index, key=lambda i: i != first)]

    def change(self, edit: Callable[[_S], _S]) -> None:
        """Replace every worker's latest with *edit* of it."""
        for index, (pid, taken, snapshot) in list(self._by_index.items()):
            self._by_index[index] = (pid, taken, edit(snapshot))


@final
class MetricsLedger:
    """What each worker last reported to ``/metrics``, and the counts of workers that died.

    The supervisor's: every worker reports its exposition every `REPORT_S`
    (when it has answered requests since) and at every scrape; `merged` adds up
    the latest of each live worker (a worker that did not answer counts as it
    last did) and what dead ones left, so that the server's counters never go
    down when a worker is slow, dies or restarts. A report may come as the
    function that renders it: it runs only if the text is needed (at a scrape,
    or when the worker dies), once, and a report replaced first never renders.
    """

    def __init__(self, host: HostMetrics | None = None) -> None:
        """*host*: the machine's metrics, added once to the workers' sums."""
        self._latest = _Latest[tuple[Callable[[], bytes], dict[str, GaugeWorkers]]]()
        self._retired = b""
        self._host = host

    def report(
        self,
        index: int,
        pid: int,
        text: bytes | Callable[[], bytes],
        *,
        taken: int = 0,
        gauges: Mapping[str, GaugeWorkers] | None = None,
    ) -> None:
        """Worker *index* (process *pid*) reported *text* (or what renders it), its *taken*-th.

        *gauges*: its custom gauges not simply added up (`gauges_of`).
        """
        render = functools.cache(text) if callable(text) else functools.partial(bytes, text)
        self._latest.report(index, pid, (render, dict(gauges or {})), taken)

    def retire(self, index: int, pid: int) -> None:
        """Worker *index*'s process *pid* ended: its counts stay, its gauges go."""
        last = self._latest.pop(index, pid)
        if last is not None:
            self._retired = merge_expositions([self._retired, _counts_only(last[0]())])

    def forget(self, model: str, versions: Collection[str] | None = None) -> None:
        """*model* was unloaded (or only its *versions*): the dead workers' counts of it go.

        Its engine series end, as on one server; a load starts them again from
        zero. Its requests by outcome stay: one server's HTTP layer counts them
        for its whole life, through unloads, so the live workers go on reporting
        theirs, and without the dead workers' the sum would go down. *versions*
        are those a load retired (its version policy serves others now), which
        one server unloads as it unloads a whole model.
        """
        if self._retired:
            self._retired = _samples_where(
                self._retired,
                lambda family, sample: (
                    family.name in _KEPT_AT_UNLOAD
                    or sample.labels.get("model") != model
                    or (versions is not None and sample.labels.get("version") not in versions)
                ),
            )

    def merged(self, first: int) -> bytes:
        """The server's exposition, worker *first*'s families in front, the machine's last."""
        reports = self._latest.ordered(first)
        gauges = {name: w for _, each in reversed(reports) for name, w in each.items()}
        merged = merge_expositions([*(text() for text, _ in reports), self._retired], gauges)
        if self._host is None:
            return merged
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self._host)
        return merged + generate_latest(registry)


@final
class StatsLedger:
    """What each worker last reported of its Triton statistics, and those of workers that died.

    The statistics' counterpart of `MetricsLedger`: a dead worker's counts
    and durations stay in the totals of each model version the live workers
    serve, so that ``/v2/models/stats`` never goes down when a worker dies.
    They are dropped when the model is unloaded (a single server's start
    again from zero then too).
    """

    def __init__(self) -> None:
        self._latest = _Latest[list[dict[str, Any]]]()
        self._retired: list[dict[str, Any]] = []

    def report(self, index: int, pid: int, stats: list[dict[str, Any]], *, taken: int = 0) -> None:
        """Worker *index* (process *pid*) reported *stats* (every model's), its *taken*-th."""
        self._latest.report(index, pid, stats, taken)

    def retire(self, index: int, pid: int) -> None:
        """Worker *index*'s process *pid* ended: what it last reported stays in the totals."""
        last = self._latest.pop(index, pid)
        if last is not None:
            self._retired = merge_stats([self._retired, last])

    def forget(self, model: str, versions: Collection[str] | None = None) -> None:
        """*model* was unloaded (or only its *versions*): what the workers counted of it goes."""

        def without(stats: list[dict[str, Any]]) -> list[dict[str, Any]]:
            return [
                e
                for e in stats
                if e["name"] != model or (versions is not None and e["version"] not in versions)
            ]

        self._retired = without(self._retired)
        self._latest.change(without)

    def merged(
        self, first: int, only: Iterable[tuple[str, str]] | None = None
    ) -> list[dict[str, Any]]:
        """The server's ``model_stats``: of the (name, version) pairs *only*, or of every one.

        Worker *first*'s entries come first; a dead worker's are added to the
        model versions a live worker reports.
        """
        live = merge_stats(self._latest.ordered(first))
        served = {(e["name"], e["version"]) for e in live}
        wanted = served if only is None else served & set(only)
        retired = [e for e in self._retired if (e["name"], e["version"]) in wanted]
        return [e for e in merge_stats([live, retired]) if (e["name"], e["version"]) in wanted]


def _exposition(counts: Counts, index: int, pid: int, requests: int) -> bytes:
    """Worker *index*'s exposition, from the *counts* its process *pid* reported."""
    return exposition_of(counts, pid=pid) + _own_exposition(index, pid, requests)


def _own_exposition(index: int, pid: int, requests: int) -> bytes:
    """The family of a worker's own: the requests its process *pid* handled."""
    family = CounterMetricFamily(
        "trioinfer_worker_inference_requests",
        "Inference requests over HTTP and gRPC each worker process handled, any outcome.",
        labels=["worker", "pid"],
    )
    family.add_metric([str(index), str(pid)], requests)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed([family]))
    return generate_latest(registry)


@final
class _Fixed:
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


# -- the worker's side ----------------------------------------------------------------------


@final
class WorkerLink:
    """One worker's line to its supervisor and, through it, to the other workers.

    `serve_http` calls `serve_control` once its models are loaded (the worker
    joins, takes the changes made before it started, and answers the
    supervisor's calls from then on) and `report_ready` once it listens. The
    HTTP routes call the rest (see ``ServerState.cluster``).
    """

    def __init__(
        self,
        index: int,
        directory: Path,
        supervisor_pid: int,
        start_models: Sequence[str] | None = None,
        *,
        count: int = 2,
        start_overrides: Mapping[str, Any] | None = None,
    ) -> None:
        self.index = index
        #: How many workers serve (N of ``--workers N``).
        self.count = count
        #: For a worker that restarts: the config override of each model whose last
        #: change was a load, to load it with at start (the journal repeats it later).
        self.start_overrides: Mapping[str, Any] = start_overrides or {}
        #: For a worker that restarts: the models the first workers loaded (or failed
        #: to load) at start, to load instead of every model in the repository (None:
        #: every model).
        self.start_models = start_models
        self._directory = directory
        self._supervisor_pid = supervisor_pid
        self._state: ServerState | None = None
        #: Snapshots of this process's counts taken so far (numbers each one, so that
        #: the supervisor keeps the latest when two reports cross).
        self._taken = 0

    @property
    def _supervisor(self) -> Path:
        return self._directory / "supervisor.sock"

    async def serve_control(
        self, state: ServerState, *, task_status: anyio.abc.TaskStatus[None]
    ) -> None:
        """Join the other workers, then answer the supervisor's calls until cancelled."""
        self._state = state
        async with anyio.create_task_group() as tg:
            await tg.start(_serve_calls, worker_socket(self._directory, self.index), self._handle)
            tg.start_soon(self._watch_supervisor)
            # The supervisor replays the changes made before this worker started
            # through our socket before it answers.
            reply = await self._ask({"op": "hello", "worker": self.index, "pid": os.getpid()})
            if reply.get("stopping"):
                raise _StoppedBeforeJoining("the server stopped before this worker joined")
            if "error" in reply:
                _raise_error(reply["error"])
            tg.start_soon(self._report_counts)
            task_status.started()

    async def report_ready(self, listening: Listening) -> None:
        """Tell the supervisor this worker listens and what it serves."""
        await self._ask(
            {
                "op": "ready",
                "worker": self.index,
                "pid": os.getpid(),
                "urls": list(listening.urls),
                "models": {name: list(v) for name, v in listening.models.items()},
                "failed": list(listening.failed),
                "grpc": listening.grpc,
            }
        )

    async def load(self, model: str, override: Mapping[str, Any] | None) -> None:
        """Load *model* (with *override*) on every worker; see `ServedModels.load`.

        Raises:
            TrioInferError: What loading raised, as its class, when every worker
                failed alike; `WorkersDisagree` when some applied it and others not.
        """
        await self._change({"op": "load", "model": model, "override": override})

    async def unload(self, model: str) -> None:
        """Unload *model* on every worker; see `ServedModels.unload`."""
        await self._change({"op": "unload", "model": model})

    async def trace_setting(self, model: str | None, settings: Mapping[str, Any]) -> None:
        """Apply trace *settings* (Triton's, for the server or *model*) on every worker.

        Raises:
            ConfigError: The settings cannot be applied (as on one server).
        """
        await self._change({"op": "trace", "model": model, "settings": dict(settings)})

    async def log_settings(self, settings: Mapping[str, Any]) -> None:
        """Apply Triton's log *settings* on every worker (and on any that restarts later)."""
        await self._change({"op": "logging", "settings": dict(settings)})

    async def merged_stats(
        self, local: list[dict[str, Any]], model: str | None, version: str | None
    ) -> list[dict[str, Any]]:
        """The server's statistics of the model versions in *local* (every one if *model* is None).

        *local* is this worker's answer to the request (which raised for a
        model it does not serve); the supervisor adds up every worker's latest
        counts and those of dead workers (`StatsLedger`).
        """
        only = None if model is None else [[e["name"], e["version"]] for e in local]
        reply = await self._ask(
            {"op": "stats", "worker": self.index, "only": only, **self._counts()}
        )
        merged: list[dict[str, Any]] = reply["stats"]
        return merged

    async def merged_metrics(self) -> bytes:
        """The server's metrics text: this worker's added to the others' (`MetricsLedger`)."""
        reply = await self._ask({"op": "metrics", "worker": self.index, **self._counts()})
        merged: str = reply["metrics"]
        return merged.encode()

    def _counts(self) -> dict[str, Any]:
        """This process's counts (`Metrics.counts`), numbered: the supervisor renders them.

        Plain numbers, neither text nor metric objects: rendering the
        exposition took 1.4-3 ms of this worker's event loop, every second it
        served, and is the supervisor's work now (at a scrape, or when this
        worker dies), off every worker's loop. Rendering on a thread of this
        process would not have freed the loop: the thread holds the GIL, and
        the loop, waking meanwhile, waits for it up to the switch interval
        (5 ms) at a time.
        """
        state = self._state
        assert state is not None
        self._taken += 1
        return {
            "pid": os.getpid(),
            "taken": self._taken,
            "requests": state.metrics.requests(),
            "counts": state.metrics.counts(),
        }

    async def _report_counts(self) -> None:
        # What the supervisor keeps of this process if it dies (SIGKILL, the OOM
        # killer, a crash in a native library): its last report. Reporting from
        # here, every REPORT_S, keeps the per-request path as it was (no call,
        # lock or syscall per request); the price is what was counted since.
        # Each report is one line on a connection kept open, with no answer to
        # wait for: a call of its own (connect, send, receive, close) cost this
        # loop more than the counts. A line sent reaches the supervisor even if
        # this process is killed right after (the kernel holds it).
        state = self._state
        assert state is not None
        reported, quiet_s = -1, 0.0
        stream: anyio.abc.SocketStream | None = None
        try:
            while True:
                await anyio.sleep(REPORT_S)
                quiet_s += REPORT_S
                requests = state.metrics.requests()
                if requests == reported and quiet_s < REPORT_ANYWAY_S:
                    continue
                message = {"op": "counts", "worker": self.index, "reply": False}
                # orjson: a fifth of json's time for the same line (4 models: 30 us).
                line = orjson.dumps({**message, **self._counts()}) + b"\n"
                for _attempt in range(2):
                    try:
                        if stream is None:
                            stream = await anyio.connect_unix(self._supervisor)
                        await stream.send(line)
                        break
                    except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
                        # The supervisor closed it (a bug there costs one connection)
                        # or has gone: a new connection tells which.
                        if stream is not None:
                            await stream.aclose()
                            stream = None
                else:
                    return  # the supervisor has gone: _watch_supervisor stops this worker
                reported, quiet_s = requests, 0.0
        finally:
            if stream is not None:
                with anyio.CancelScope(shield=True):  # closing a Unix socket never waits
                    await stream.aclose()

    async def _change(self, message: dict[str, Any]) -> None:
        # A socket error is no lost supervisor while it is still this process's parent:
        # fresh connections try again (a change the supervisor received twice applies
        # once, see _Supervisor._reach), then the client is told what happened.
        reply = await _call_while(
            self._supervisor, message, lambda: os.getppid() == self._supervisor_pid
        )
        if isinstance(reply, _Unreached):
            if reply.dead:
                raise TrioInferError(
                    "this worker lost its supervisor (the trioinfer serve process); it is stopping"
                ) from reply.why
            raise TrioInferError(
                f"could not reach the supervisor (pid {self._supervisor_pid}) with "
                f"{_what(message)} ({reply.tries} tries over {REACH_S:g}s, the last: "
                f"{reply.why}): it may or may not have applied on the workers; repeat the request"
            ) from reply.why
        if "error" in reply:
            _raise_error(reply["error"])

    async def _ask(self, message: dict[str, Any]) -> dict[str, Any]:
        try:
            return await _call(self._supervisor, message)
        except _Gone as exc:
            raise TrioInferError(
                "this worker lost its supervisor (the trioinfer serve process); it is stopping"
            ) from exc

    async def _handle(self, message: dict[str, Any]) -> dict[str, Any]:
        from .._trace_settings import update_trace_settings
        from ._logging import update_log_settings

        state = self._state
        assert state is not None
        op = message["op"]
        try:
            if op == "load":
                model = message["model"]
                before = {served.version for served in state.models.versions(model)}
                await state.models.load(model, message["override"])
                retired = before - {served.version for served in state.models.versions(model)}
                if not retired:
                    return {"ok": True}
                # Versions its policy no longer serves, unloaded: the supervisor forgets
                # them as at an unload, keeping the counts taken after (see below).
                return {"ok": True, "retired": [str(v) for v in sorted(retired)], **self._counts()}
            if op == "unload":
                await state.models.unload(message["model"])
                # Counts taken after it: the supervisor keeps them as this worker's
                # latest, so that a report taken before the unload and arriving after
                # it (an earlier number) cannot bring the model's old counts back.
                return {"ok": True, **self._counts()}
            if op == "trace":
                tracing = state.models.engine._tracing
                update_trace_settings(tracing, message["model"], message["settings"])
                return {"ok": True}
            if op == "logging":
                update_log_settings(message["settings"])
                return {"ok": True}
            if op == "ping":  # the supervisor: is this event loop running?
                return {"ok": True}
            if op == "counts":
                return self._counts()
            if op == "served":
                return {"served": served_state(state.models), "failed": state.models.failures()}
            if op == "failures":
                state.models.take_failures(message["failed"])
                return {"ok": True}
        except TrioInferError as exc:
            return _error_reply(exc, state.models.public_message(exc))
        return {"error": {"type": "TrioInferError", "message": f"unknown control call {op!r}"}}

    async def _watch_supervisor(self) -> None:
        # Started in a thread, a worker cannot use PR_SET_PDEATHSIG (it fires when
        # that thread ends): it looks for its parent instead, and drains if gone.
        while os.getppid() == self._supervisor_pid:  # noqa: ASYNC110  # no event to wait for
            await anyio.sleep(PARENT_POLL_S)
        log.warning("the supervisor (pid %d) has gone; stopping", self._supervisor_pid)
        os.kill(os.getpid(), signal.SIGTERM)


def served_state(models: ServedModels) -> dict[str, Any]:
    """What *models* serve, as the supervisor compares workers: JSON, by model.

    Each served version's files as they were when it loaded (their
    fingerprint: a file changed on disk since has another) and its config
    override, and the model's traffic split.
    """
    state: dict[str, Any] = {}
    for served in models.all():
        model = state.setdefault(
            served.model,
            {
                "versions": {},
                "traffic": {str(v): share for v, share in models.traffic(served.model).items()},
            },
        )
        model["versions"][str(served.version)] = [list(served.fingerprint), served.override]
    wire: dict[str, Any] = json.loads(json.dumps(state))  # as the supervisor receives it
    return wire


def worker_socket(directory: Path, index: int) -> Path:
    """The control socket of worker *index*."""
    return directory / f"worker-{index}.sock"


#: The longest path a Unix socket may have: ``sun_path`` holds 108 bytes on Linux and
#: 104 on macOS, the terminating NUL included.
UNIX_PATH_MAX: Final = 103


def control_directory(workers: int) -> Path:
    """A new private directory for the control sockets of *workers* workers.

    In the temporary directory (``TMPDIR``), unless a socket's path there would
    be longer than a Unix socket's may be (a long ``TMPDIR``): then in
    ``/tmp``, where a bind would otherwise fail with "AF_UNIX path too long"
    before any worker started.
    """
    directory = Path(tempfile.mkdtemp(prefix="trioinfer-workers-"))
    longest = max(
        len(os.fsencode(directory / "supervisor.sock")),
        len(os.fsencode(worker_socket(directory, workers - 1))),
    )
    if longest <= UNIX_PATH_MAX or not Path("/tmp").is_dir():
        return directory
    directory.rmdir()
    return Path(tempfile.mkdtemp(prefix="trioinfer-workers-", dir="/tmp"))


# -- the supervisor ---------------------------------------------------------------------------


@attrs.define(eq=False)
class _Worker:
    index: int
    socket: Path
    process: anyio.abc.Process | None = None
    pid: int = 0
    #: Receives repository changes (it has taken those made before it started).
    member: bool = False
    ready: bool = False
    #: Why it could not start, as it said.
    failure: str = ""
    #: Why the supervisor stopped it to start it again ("": it was not).
    stopped_for: str = ""
    #: Set when the supervisor stops this life to start it again (`_Supervisor._restart`):
    #: it is killed if it has not exited after its drain period and `STOP_MARGIN_S`.
    restarting: anyio.Event = attrs.field(factory=anyio.Event)
    listening: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class WorkersListening:
    """Where the workers listen and what they serve; `serve_workers` reports it when all are ready.

    Attributes:
        urls: The base URLs, e.g. ``("http://127.0.0.1:8000",)``.
        models: The served models and versions, e.g. ``{"digits": (1,)}``.
        failed: Models of the repository that could not be loaded.
        pids: The process ids of the workers that serve, by worker index (one
            stopped at start to be restarted, see `serve_workers`, is left out).
        grpc: Where every worker serves V2 gRPC (``host:port``), or None when not served.
    """

    urls: tuple[str, ...]
    models: dict[str, tuple[int, ...]]
    failed: tuple[str, ...]
    pids: tuple[int, ...]
    grpc: str | None = None


@final
class _Supervisor:
    def __init__(
        self, count: int, directory: Path, spec: dict[str, Any], host: HostMetrics | None = None
    ) -> None:
        self.directory = directory
        self.spec = spec
        self.workers = [_Worker(i, worker_socket(directory, i)) for i in range(count)]
        #: The last change of each model (and of each trace setting), replayed to a
        #: worker that (re)starts.
        self.journal: dict[str | tuple[str, ...], dict[str, Any]] = {}
        self.changing = anyio.Lock()
        #: Set (and replaced) when a change applies or a worker's process ends: a
        #: worker that waits to join (see _hello) looks again.
        self._news = anyio.Event()
        self.stopping = False
        self.stop = anyio.Event()
        self._starting = anyio.CapacityLimiter(STARTS_AT_ONCE)
        self.all_ready = anyio.Event()
        #: The worker whose models the others were compared with when all were first
        #: ready (`_compare_at_start`); what serve reports is what it serves.
        self.reference = 0
        self._compared = False
        self.failure: str | None = None
        #: `failure` was logged at ERROR when it was set (`kill_after`'s bound).
        self.failure_logged = False
        self.metrics = MetricsLedger(host)
        self.stats = StatsLedger()

    def listening(self) -> WorkersListening:
        """What serve reports once every first worker is ready (and they were compared).

        The pids are those of the workers that serve: one the comparison stopped
        (or that died since) restarts, and its pid is about to be another's.
        """
        first = self.workers[self.reference].listening
        return WorkersListening(
            tuple(first["urls"]),
            {name: tuple(v) for name, v in first["models"].items()},
            tuple(first["failed"]),
            tuple(w.pid for w in self.workers if w.member and w.ready),
            first.get("grpc"),
        )

    # -- workers' lives --

    async def run_worker(self, worker: _Worker) -> None:
        backoff = 0
        failed_starts = 0
        # Whether any of its lives got ready: until one has, its death stops serve.
        ever_ready = False
        while True:
            async with self._starting:
                # Its turn may come long after it asked (many workers, a slow fork):
                # a signal meanwhile, or a worker that could not start, starts no more.
                if self.stop.is_set():
                    return
                started_at = anyio.current_time()
                process = await anyio.open_process(
                    [sys.executable, "-m", "trioinfer.server._workers", str(worker.index)],
                    stdin=None,
                    stdout=None,
                    stderr=None,
                    env={**os.environ, SPEC_ENV: json.dumps(self._spec_for_a_start())},
                    # Its own session: a terminal's Ctrl+C reaches the supervisor
                    # alone, which then stops the workers once, in order.
                    start_new_session=True,
                )
            worker.process, worker.pid, worker.failure = process, process.pid, ""
            worker.restarting = anyio.Event()
            log.info("started worker %d (pid %d)", worker.index, process.pid)
            if self.stopping:
                process.send_signal(signal.SIGTERM)
            was_ready = False
            try:
                async with anyio.create_task_group() as life:
                    life.start_soon(self._kill_if_held, worker, process)
                    await process.wait()
                    life.cancel_scope.cancel()
            finally:
                was_ready = worker.ready
                ever_ready = ever_ready or was_ready
                worker.process = None
                worker.member = worker.ready = False
                self.metrics.retire(worker.index, worker.pid)
                self.stats.retire(worker.index, worker.pid)
                self._tell_news()
            if self.stopping:
                return
            how = _exit_text(process.returncode)
            why = f": {worker.failure}" if worker.failure else " (see its log above)"
            if not ever_ready and not self.all_ready.is_set():
                # A first start that failed. One that got ready and died before the
                # others were (or while the first workers were compared, see
                # `_compare_at_start`) is restarted as any later death: its restart
                # joins as a restart does, compared with the members once all are ready.
                self._fail(
                    f"worker {worker.index} (pid {worker.pid}) {how} before it was ready{why}"
                )
                return
            uptime = anyio.current_time() - started_at
            if not was_ready:
                failed_starts += 1
                if failed_starts >= MAX_FAILED_STARTS:
                    self._fail(
                        f"worker {worker.index} {how} before it was ready {failed_starts} times "
                        f"in a row{why}"
                    )
                    return
            else:
                failed_starts = 0
            backoff = 0 if was_ready and uptime >= STABLE_AFTER_S else backoff + 1
            delay = min(RESTART_DELAY_S * 2 ** (backoff - 1 if backoff else 0), MAX_RESTART_DELAY_S)
            if worker.stopped_for:
                log.info(
                    "worker %d (pid %d), stopped because %s, %s; restarting it in %.1fs",
                    worker.index,
                    worker.pid,
                    worker.stopped_for,
                    how,
                    delay,
                )
                worker.stopped_for = ""
            else:
                log.warning(
                    "worker %d (pid %d) %s%s; its in-flight requests failed (connections "
                    "closed); restarting it in %.1fs",
                    worker.index,
                    worker.pid,
                    how,
                    "" if was_ready else " before it was ready",
                    delay,
                )
            with anyio.move_on_after(delay):
                await self.stop.wait()
            if self.stop.is_set():
                # Stopping: `stopping` may not be set yet (stop_all runs after this
                # wakes), and a worker started now would only be told to stop.
                return

    def _spec_for_a_start(self) -> dict[str, Any]:
        # A worker that restarts loads each model whose last change was a load with
        # that load's override at once: loading it from disk, then again when the
        # journal is replayed, would hold two copies of it for a while (on a GPU,
        # perhaps more than fits) and take twice as long. The replay then finds
        # nothing to do.
        overrides = {
            key: change["override"]
            for key, change in self.journal.items()
            if isinstance(key, str) and change["op"] == "load"
        }
        # Nor does it load a model unloaded since: its files may be gone, and a load
        # that failed would stay a failure the others do not have (not ready under
        # --strict-readiness; with --model, a worker that cannot start).
        unloaded = {
            key
            for key, change in self.journal.items()
            if isinstance(key, str) and change["op"] == "unload"
        }
        spec = {**self.spec, "start_overrides": overrides} if overrides else dict(self.spec)
        for key in ("models", "start_models"):
            if spec.get(key) is not None:
                spec[key] = [name for name in spec[key] if name not in unloaded]
        return spec

    async def _kill_if_held(self, worker: _Worker, process: anyio.abc.Process) -> None:
        # A life the supervisor stopped to restart (`_restart`) drains as at shutdown;
        # one that has not exited by the time a shutdown would kill it (its event loop
        # blocked, say: the SIGTERM waits for it) is killed, so that it does restart.
        await worker.restarting.wait()
        held_s = self.spec.get("config", {}).get("drain_period", 0.0) + STOP_MARGIN_S
        await anyio.sleep(held_s)
        log.warning(
            "worker %d (pid %d), stopped because %s, is still running %.0fs later; killing it",
            worker.index,
            process.pid,
            worker.stopped_for,
            held_s,
        )
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGKILL)

    def _restart(self, worker: _Worker, why: str) -> None:
        """Stop *worker* (it drains) to start it again, *why* (said when it has exited).

        It is no member from now: no change reaches it, no joining worker compares
        with it. Its restart joins as any restart does (`_hello`).
        """
        worker.member = False
        worker.stopped_for = why
        worker.restarting.set()
        if worker.process is not None:
            with contextlib.suppress(ProcessLookupError):
                worker.process.send_signal(signal.SIGTERM)

    def _tell_news(self) -> None:
        self._news.set()
        self._news = anyio.Event()

    def _fail(self, message: str) -> None:
        if self.failure is None:
            self.failure = message
        self.stop.set()

    def stop_all(self) -> None:
        """SIGTERM every worker: each drains, as a single server does, and exits."""
        self.stopping = True
        self.signal_all(signal.SIGTERM)

    async def kill_after(self, seconds: float, *, bound: bool = False) -> None:
        """SIGKILL the workers still running *seconds* from now.

        *bound*: *seconds* is ``--exit-timeout-secs``, the whole exit's bound: the
        workers still running `LAST_CANCEL_S` after it (as one process gives its
        last cancel) broke it, are named at ERROR, and the exit fails.
        """
        await anyio.sleep(seconds)
        if not bound:
            log.warning("workers still running %.0fs after SIGTERM; killing them", seconds)
        else:
            # As one process gives its last cancel LAST_CANCEL_S past the bound: a worker
            # that is exiting then (a bound of 0 ends every exit there) is not held.
            with anyio.move_on_after(LAST_CANCEL_S):
                while any(w.process is not None for w in self.workers):
                    await self._news.wait()  # told when a worker's process ends
            held = ", ".join(
                f"worker {w.index} (pid {w.pid})" for w in self.workers if w.process is not None
            )
            if not held:
                return  # the last one exited just now: the exit kept its bound
            message = (
                f"the exit timeout ({seconds:.1f}s after the stop, --exit-timeout-secs) has "
                f"passed with {held} still running: killing them"
            )
            log.error("%s", message)
            if self.failure is None:
                self.failure, self.failure_logged = message, True
        self.signal_all(signal.SIGKILL)

    def signal_all(self, signum: signal.Signals) -> None:
        """Send *signum* to every running worker."""
        for worker in self.workers:
            if worker.process is not None:
                with contextlib.suppress(ProcessLookupError):
                    worker.process.send_signal(signum)

    # -- control calls from the workers --

    async def handle(self, message: dict[str, Any]) -> dict[str, Any]:
        op = message["op"]
        if op in ("load", "unload", "trace", "logging"):
            return await self._change(message)
        worker = self.workers[message["worker"]]
        if op == "counts":
            self._keep(worker, message)
            return {"ok": True}
        if op == "metrics":
            await self._gather_counts(worker, message)
            return {"metrics": self.metrics.merged(worker.index).decode()}
        if op == "stats":
            only = message["only"]
            await self._gather_counts(worker, message)
            pairs = None if only is None else [(name, version) for name, version in only]
            return {"stats": self.stats.merged(worker.index, pairs)}
        if op == "hello":
            return await self._hello(worker, message["pid"])
        if op == "ready":
            worker.ready = True
            worker.listening = message
            log.info("worker %d (pid %d) is ready", worker.index, worker.pid)
            if all(w.ready for w in self.workers) and not self._compared:
                self._compared = True
                self.reference = await self._compare_at_start()
                first = self.workers[self.reference].listening
                if self.spec["models"] is None:
                    # A worker that restarts loads what these loaded at start, not
                    # the repository as it is on disk then: a model added since, and
                    # never loaded through the API, would be served by it alone. (It
                    # tries those that failed too, to give the same reason for them.)
                    self.spec["start_models"] = sorted({*first["models"], *first["failed"]})
                self.all_ready.set()
            return {"ok": True}
        if op == "failed":
            worker.failure = message["message"]
            return {"ok": True}
        return {"error": {"type": "TrioInferError", "message": f"unknown control call {op!r}"}}

    async def poll_load(self, model: str) -> None:
        """Load *model* on every worker, for the repository poll; raises what failed."""
        reply = await self._change(
            {"op": "load", "model": model, "override": None}, advice=_POLL_ADVICE
        )
        if "error" in reply:
            _raise_error(reply["error"])

    async def poll_unload(self, model: str) -> None:
        """Unload *model* on every worker, for the repository poll; raises what failed."""
        reply = await self._change({"op": "unload", "model": model}, advice=_POLL_ADVICE)
        if "error" in reply:
            _raise_error(reply["error"])

    async def _hello(self, worker: _Worker, pid: int) -> dict[str, Any]:
        # Worker *worker*'s process *pid* joins: it takes the changes made before it
        # started, then must serve what the members serve (see _differences) before it
        # becomes one. Until it does, it waits here, not listening (it listens once
        # this answers), and takes each change that applies meanwhile.
        replayed: dict[str | tuple[str, ...], dict[str, Any]] = {}
        said = ""
        # Bounded: files changed on disk that nothing reloads keep it from agreeing for
        # ever, loaded but not serving. Started again, it loads the repository as it is
        # then (and the others may have reloaded meanwhile).
        give_up_at = anyio.current_time() + JOIN_S
        while True:
            # Under the lock: no change may pass between the replay, the comparison
            # and membership.
            async with self.changing:
                if worker.pid != pid or worker.process is None:
                    return {"error": {"type": "TrioInferError", "message": "replaced meanwhile"}}
                for key, change in list(self.journal.items()):
                    if replayed.get(key) is change:
                        continue  # repeated to it already, while it waited
                    replayed[key] = change
                    reply = await self._reach(worker, change)
                    if reply is None or reply.get("unreachable"):
                        # Not joined yet (it does not listen): it exits and starts again.
                        message = "its control socket stopped answering while it joined"
                        return {"error": {"type": "TrioInferError", "message": message}}
                    if "error" in reply:
                        log.warning(
                            "worker %d could not repeat %s made before it started: %s",
                            worker.index,
                            _what(change),
                            reply["error"]["message"],
                        )
                try:
                    differences, failures = await self._differences(worker)
                    if failures is not None:
                        await _call(worker.socket, {"op": "failures", "failed": failures})
                except _Gone:
                    message = "its control socket stopped answering while it joined"
                    return {"error": {"type": "TrioInferError", "message": message}}
                if not differences:
                    worker.member = True
                    if said:
                        log.info(
                            "worker %d (pid %d) serves what the others serve now; it joins them",
                            worker.index,
                            pid,
                        )
                    return {"ok": True}
                news = self._news
            if "; ".join(differences) != said:
                said = "; ".join(differences)
                log.warning(
                    "worker %d (pid %d) does not serve what the others serve: %s. It does not "
                    "listen until it does: each change that applies on the others (a "
                    "repository poll's reload, a load or unload through the API) is repeated "
                    "to it, and it joins once they agree; the others serve meanwhile",
                    worker.index,
                    pid,
                    said,
                )
            with anyio.move_on_after(give_up_at - anyio.current_time()):
                async with anyio.create_task_group() as waiting:
                    waiting.start_soon(_first, news, waiting.cancel_scope)
                    waiting.start_soon(_first, self.stop, waiting.cancel_scope)
            if self.stop.is_set():
                return {"stopping": True}
            if anyio.current_time() >= give_up_at:
                message = (
                    f"worker {worker.index} (pid {pid}) still does not serve what the others "
                    f"serve {JOIN_S:g}s after it asked to join ({said}): it stops, and is "
                    "started again (loading the repository as it is then); reload the models "
                    "whose files changed, or restart the server, for all to agree"
                )
                log.error("%s", message)
                return {"error": {"type": "TrioInferError", "message": message}}

    async def _compare_at_start(self) -> int:
        """Compare what the first workers serve, once all are ready; the reference's index.

        Each loaded the repository at start, on its own: a load that failed on
        one only (a model whose load fails at random, a file that was broken
        for a moment) or files changed between their starts leave them serving
        different things. The reference is the worker that serves the most
        models, then the one with the fewest failed loads, then the one most
        others agree with, then the lowest index. Each worker that differs
        from it stops being a member and is stopped (it drains) and
        restarted, as one that died: it loads
        what the reference loaded and joins once it serves the same (see
        `_hello`), while the others serve. A worker that dies meanwhile is
        left out of the comparison, and restarted (`run_worker`).
        """
        async with self.changing:
            asked = {worker.index: worker.pid for worker in self.workers}
            replies = await _each(self.workers, {"op": "served"}, limit_s=GATHER_TIMEOUT_S)
            groups: dict[str, list[tuple[_Worker, dict[str, Any]]]] = {}
            for worker, reply in replies:
                # One that died since it answered is left out: it is no reference
                # (the others would be stopped for a worker that is gone), and it
                # restarts and joins as any restart does (`run_worker`, `_hello`).
                if (
                    reply is not None
                    and "served" in reply
                    and _running(worker, asked[worker.index])
                ):
                    key = json.dumps(reply["served"], sort_keys=True)
                    groups.setdefault(key, []).append((worker, reply))
            if len(groups) < 2:  # they agree (those that answered)
                return next(iter(groups.values()))[0][0].index if groups else 0
            # The most models served first: a model added to the repository between
            # two starts is served by the later worker, and failed on neither.
            best = min(
                groups.values(),
                key=lambda group: (
                    -len(group[0][1]["served"]),
                    len(group[0][1].get("failed", {})),
                    -len(group),
                    group[0][0].index,
                ),
            )
            reference, theirs = best[0]
            for group in groups.values():
                if group is best:
                    continue
                for worker, reply in group:
                    log.warning(
                        "worker %d (pid %d) started serving other things than worker %d "
                        "(pid %d), the reference (the workers that start together are "
                        "compared; the reference serves the most models): %s. It is "
                        "restarted and listens again once it serves what worker %d serves, "
                        "as a worker that restarts does",
                        worker.index,
                        worker.pid,
                        reference.index,
                        reference.pid,
                        "; ".join(_disagreements(reply["served"], theirs["served"])),
                        reference.index,
                    )
                    self._restart(
                        worker, f"it started serving other things than worker {reference.index}"
                    )
            return reference.index

    async def _differences(self, worker: _Worker) -> tuple[list[str], dict[str, str] | None]:
        """How what *worker* serves differs from what the members serve (nothing: it agrees).

        A joining worker loaded the repository as it is on disk: after a reload
        that failed on the others (they serve the files they loaded before),
        or files changed without a load, it would serve something else. It
        agrees when it serves what one member serves (members that disagree
        among themselves were told so by `WorkersDisagree`). Before every first
        worker is ready, there is nothing to compare with: each loaded the
        repository at start, and they are compared once all are ready
        (`_compare_at_start`).

        Also, when it agrees, the failed loads that member holds (its
        `ServedModels.failures`) where *worker*'s differ, for *worker* to take.

        Raises:
            _Gone: *worker* did not answer.
        """
        members = [w for w in self.workers if w.member and w is not worker]
        if not self.all_ready.is_set() or not members:
            return [], None
        replies = await _each([worker, *members], {"op": "served"}, limit_s=GATHER_TIMEOUT_S)
        mine = replies[0][1]
        if mine is None or "served" not in mine:
            raise _Gone(f"worker {worker.index} did not say what it serves")
        theirs = [r for _, r in replies[1:] if r is not None and "served" in r]
        for reply in theirs:
            if reply["served"] == mine["served"]:
                failed = reply.get("failed", {})
                return [], None if failed == mine.get("failed", {}) else failed
        if not theirs:
            return [], None
        return _disagreements(mine["served"], theirs[0]["served"]), None

    async def _change(
        self, message: dict[str, Any], *, advice: str = "repeat the request, or restart the server"
    ) -> dict[str, Any]:
        # *advice*: what to do when the workers disagree after it.
        async with self.changing:
            targets = [w for w in self.workers if w.member]
            replies = await _each(targets, message, call=self._reach)
            applied = [w.index for w, r in replies if r is not None and "error" not in r]
            failed = [(w.index, r["error"]) for w, r in replies if r is not None and "error" in r]
            if not failed or applied:
                # Workers that died meanwhile take it when they restart.
                for key, change in _journal_entries(message, self.journal):
                    self.journal.pop(key, None)
                    self.journal[key] = change
                if message["op"] == "logging" and "log_format" in message["settings"]:
                    # The supervisor's lines take the new format too: a log that mixes
                    # JSON and text lines is no use to a log shipper. (Its level stays:
                    # its lines are about the workers, which the settings are for.)
                    from ._logging import update_log_settings

                    with contextlib.suppress(ConfigError):
                        update_log_settings({"log_format": message["settings"]["log_format"]})
                self._tell_news()
                retired = {
                    version
                    for _, reply in replies
                    if reply is not None
                    for version in reply.get("retired", ())
                }
                if message["op"] == "unload" or retired:
                    for worker, reply in replies:
                        if reply is not None and "taken" in reply:
                            self._keep(worker, reply)
                    versions = None if message["op"] == "unload" else retired
                    self.stats.forget(message["model"], versions)
                    self.metrics.forget(message["model"], versions)
            if not failed:
                return {"ok": True}
            errors = {(e["type"], e["message"]) for _, e in failed}
            if not applied and len(errors) == 1:
                return {"error": failed[0][1]}  # as a single server would have failed
            what = _what(message)
            said = "; ".join(f"worker {i}: {e['message']}" for i, e in failed)
            return {
                "error": {
                    "type": "WorkersDisagree",
                    "message": (
                        f"{what} applied on worker(s) {', '.join(map(str, applied)) or 'none'} "
                        f"and failed on worker(s) {', '.join(str(i) for i, _ in failed)} "
                        f"({said}); the workers may now serve different things: {advice}"
                    ),
                }
            }

    async def _reach(self, worker: _Worker, change: dict[str, Any]) -> dict[str, Any] | None:
        """*worker*'s answer to *change*: None if its process ended, an error if it is out of reach.

        A socket error (a full backlog, a connection cut) is no death: while
        the worker's process runs, fresh connections try again for `REACH_S`.
        One that died is left to take the change from the journal when it
        restarts; one that runs and cannot be reached gets an error answer
        that names it and says why (marked ``unreachable``), so that the
        change is no success; a member is then restarted (`_restart`: it
        drains, and its restart loads what the journal says), since whether
        it applied the change, and so what it serves, is unknown. A
        change may reach a worker twice (the connection broke after it was
        sent): each is idempotent (a load of what is served, an unload of what
        is not, a setting set again, change nothing), but for an unload of a
        model whose directory is gone too: the second says ModelNotFound, and
        the change reads as failed on that worker. Only a connection cut after
        the worker took the call repeats it, which a live worker never does
        (it answers every call, its errors included).
        """
        pid = worker.pid
        reply = await self._call_pinged(worker, pid, change)
        if not isinstance(reply, _Unreached):
            return reply
        if reply.dead:
            log.info(
                "worker %d (pid %d) has died: it takes %s when it restarts",
                worker.index,
                pid,
                _what(change),
            )
            return None
        how = (
            f"({reply.why})"
            if reply.blocked
            else f"({reply.tries} tries over {REACH_S:g}s, the last: {reply.why})"
        )
        said = (
            f"worker {worker.index} (pid {pid}) is running but did not answer {_what(change)} "
            f"{how}; it may not have applied it"
        )
        if worker.member and _running(worker, pid):
            # It may or may not have applied the change: what it serves is unknown, so
            # it cannot stay a member (it would serve what the others may not, and miss
            # the next changes too). Restarted, it loads what the journal says.
            said += ", and is restarted"
            self._restart(worker, f"it did not answer {_what(change)}")
        log.error("%s", said)
        return {"error": {"type": "TrioInferError", "message": said}, "unreachable": True}

    async def _call_pinged(
        self, worker: _Worker, pid: int, change: dict[str, Any]
    ) -> dict[str, Any] | _Unreached:
        """`_call_while` of *change* to *worker*'s process *pid*, pinged every `PING_S` meanwhile.

        A worker whose event loop is blocked (a model's code that never yields)
        still takes the connection (the kernel accepts it) and never answers: the
        change, and every change and joining worker after it (they wait for this
        one), waited for ever. A load may take minutes, but its worker's loop
        answers a ping meanwhile; one that answers none within `REACH_S` is out
        of reach.
        """
        outcome: list[dict[str, Any] | _Unreached] = []

        async def call(scope: anyio.CancelScope) -> None:
            outcome.append(
                await _call_while(
                    worker.socket,
                    change,
                    lambda: _running(worker, pid),
                    lambda why: log.info(
                        "worker %d (pid %d) runs but did not answer (%s): trying again",
                        worker.index,
                        pid,
                        why,
                    ),
                )
            )
            scope.cancel()

        async def ping(scope: anyio.CancelScope) -> None:
            started = anyio.current_time()
            while True:
                await anyio.sleep(PING_S)
                with anyio.move_on_after(REACH_S):
                    with contextlib.suppress(_Gone):  # a socket error: `call` tells
                        await _call(worker.socket, {"op": "ping"})
                    continue
                why = _Gone(
                    f"it took the call and answered no ping on another connection within "
                    f"{REACH_S:g}s, {anyio.current_time() - started:.0f}s into it: its event "
                    "loop is blocked"
                )
                outcome.append(_Unreached(1, why, dead=not _running(worker, pid), blocked=True))
                scope.cancel()
                return

        async with anyio.create_task_group() as tg:
            tg.start_soon(call, tg.cancel_scope)
            tg.start_soon(ping, tg.cancel_scope)
        return outcome[0]

    async def _gather_counts(self, asker: _Worker, counts: dict[str, Any]) -> None:
        # A scrape or a statistics request that *asker* answers, with its own counts:
        # every other worker's now (one that does not answer in time counts as it
        # last reported).
        self._keep(asker, counts)
        targets = [w for w in self.workers if w.member and w.index != asker.index]
        for worker, reply in await _each(targets, {"op": "counts"}, limit_s=GATHER_TIMEOUT_S):
            if reply is not None and "taken" in reply:
                self._keep(worker, reply)

    def _keep(self, worker: _Worker, counts: dict[str, Any]) -> None:
        if worker.process is None or counts["pid"] != worker.pid:
            # Sent by a process that has died since (the call crossed its death):
            # what it had reported before is in the totals already, retired.
            return
        # Rendered here, not in the worker (the text took a worker's event loop
        # 1.4-3 ms a report, see WorkerLink._counts), and only when needed: most reports
        # are replaced by the next before any scrape or death needs them.
        taken, numbers = counts["taken"], counts["counts"]
        text = functools.partial(_exposition, numbers, worker.index, worker.pid, counts["requests"])
        self.metrics.report(worker.index, worker.pid, text, taken=taken, gauges=gauges_of(numbers))
        stats = [triton_entry(version) for version in numbers["versions"]]
        self.stats.report(worker.index, worker.pid, stats, taken=taken)
        log.debug(
            "kept the counts of worker %d (pid %d): %d inference requests",
            worker.index,
            worker.pid,
            counts["requests"],
        )


def _journal_entries(
    message: dict[str, Any], journal: Mapping[str | tuple[str, ...], dict[str, Any]]
) -> list[tuple[str | tuple[str, ...], dict[str, Any]]]:
    """What the journal keeps of a change that applied: its key(s), and what to replay.

    A model's load or unload replaces its last one. Trace settings are kept one
    per setting (server-wide, or a model's): each setting changes alone, so the
    last value of each, replayed in any order, gives a restarted worker the
    settings the others have. Log settings are checked together (info needs
    warning, say), so they are kept as one change, merged with the last.
    """
    if message["op"] == "logging":
        before = journal.get(("logging",), {}).get("settings", {})
        return [(("logging",), {**message, "settings": {**before, **message["settings"]}})]
    if message["op"] != "trace":
        return [(message["model"], message)]
    model, settings = message["model"], message["settings"]
    if model is not None and not settings:  # Triton: a model's empty request clears its own
        settings = {"trace_rate": None}
    return [
        (("trace", model or "", name), {"op": "trace", "model": model, "settings": {name: value}})
        for name, value in settings.items()
    ]


def _disagreements(mine: Mapping[str, Any], theirs: Mapping[str, Any]) -> list[str]:
    """How one worker's `served_state` (*mine*) differs from another's (*theirs*), in words."""
    found = []
    for model in sorted(mine.keys() | theirs.keys()):
        have, want = mine.get(model), theirs.get(model)
        if have == want:
            continue
        if have is None:
            found.append(
                f"model {model!r} is not served by it (its load from the repository as it is "
                "now failed, or was undone), while the others serve it"
            )
            continue
        if want is None:
            found.append(f"it serves model {model!r}, which the others do not serve")
            continue
        if have["versions"].keys() != want["versions"].keys():
            found.append(
                f"it serves versions {', '.join(sorted(have['versions']))} of model {model!r}, "
                f"the others {', '.join(sorted(want['versions']))}"
            )
            continue
        for version in sorted(have["versions"]):
            (files, override), (their_files, their_override) = (
                have["versions"][version],
                want["versions"][version],
            )
            if files != their_files:
                found.append(
                    f"model {model!r} version {version}: its files on disk are not those the "
                    "others loaded (they changed since, and no reload of them applied)"
                )
            elif override != their_override:
                found.append(
                    f"model {model!r} version {version}: loaded with another config override"
                )
        if have["traffic"] != want["traffic"]:
            found.append(f"model {model!r}: another traffic split")
    return found


def _what(change: Mapping[str, Any]) -> str:
    """A change the supervisor fans out, as messages name it."""
    if change["op"] in ("trace", "logging"):
        return f"the {change['op']} settings change"
    return f"the {change['op']} of model {change['model']!r}"


async def _each(
    workers: list[_Worker],
    message: dict[str, Any],
    *,
    limit_s: float = math.inf,
    call: Callable[[_Worker, dict[str, Any]], Awaitable[dict[str, Any] | None]] | None = None,
) -> list[tuple[_Worker, dict[str, Any] | None]]:
    """Send *message* to every worker at once; None for those that died or did not answer.

    *call*: how to reach one worker (None: once, `_call`).
    """
    replies: dict[int, dict[str, Any] | None] = {}

    async def one(worker: _Worker) -> None:
        replies[worker.index] = None
        with anyio.move_on_after(limit_s):
            if call is not None:
                replies[worker.index] = await call(worker, message)
                return
            try:
                replies[worker.index] = await _call(worker.socket, message)
            except _Gone:
                log.info("worker %d did not answer a %s call", worker.index, message["op"])

    async with anyio.create_task_group() as tg:
        for worker in workers:
            tg.start_soon(one, worker)
    return [(w, replies[w.index]) for w in workers]


def _running(worker: _Worker, pid: int) -> bool:
    """Whether *worker*'s process *pid* still runs (it has not exited, nor been replaced)."""
    process = worker.process
    return process is not None and worker.pid == pid and process.returncode is None


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _reserve_port(host: str, port: int) -> tuple[list[socket.socket], int]:
    """Bind (without listening) every address of *host* with SO_REUSEPORT; return the port.

    Held for the whole run: port 0 becomes one port that every worker binds,
    and no other program can take the port while a worker restarts. A socket
    that does not listen gets no connections.
    """
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    seen = set()
    try:
        for family, kind, proto, _name, address in infos:
            if (family, address[0]) in seen:
                continue
            seen.add((family, address[0]))
            where = (address[0], port, *address[2:])
            # First without SO_REUSEPORT, and let go at once: a port another
            # server listens on (another `serve --workers` too) is refused here
            # rather than shared with it.
            with socket.socket(family, kind, proto) as probe:
                _bind(probe, family, where, reuse_port=False)
                port = probe.getsockname()[1]
                where = (address[0], port, *address[2:])
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            _bind(sock, family, where, reuse_port=True)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets, port


def _bind(sock: socket.socket, family: int, where: tuple[Any, ...], *, reuse_port: bool) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    sock.bind(where)


async def serve_workers(
    repository: str | os.PathLike[str],
    *,
    workers: int,
    host: str = "127.0.0.1",
    port: int = 8000,
    config: ServerConfig,
    models: Sequence[str] | None = None,
    grpc_port: int | None = None,
    loop: str = "trio",
    log_level: str = "info",
    log_format: str = "default",
    access_log: bool = False,
    trace: tuple[str | None, float | None] = (None, None),
    exit_timeout: float | None = None,
    task_status: anyio.abc.TaskStatus[WorkersListening] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve *repository* from *workers* processes on one port until SIGINT/SIGTERM.

    Reports a `WorkersListening` once every worker is ready (a signal before
    then stops the workers, and this returns without reporting). On the first
    signal every worker drains (as `serve_http` does) and this returns once
    all have exited; a second signal stops them at once. *trace* is the
    ``--trace-exporter`` and ``--trace-rate`` settings: each worker makes its
    own tracer provider from them and the ``OTEL_*`` variables (a provider
    cannot cross a process boundary; *config*'s is not used). With
    *grpc_port* (0: a free one, the same for every worker) each worker serves
    V2 gRPC there too, as `serve_http` does. *log_level*, *log_format* and
    *access_log* are ``serve``'s, for every worker's log handler (the
    supervisor's is the caller's). *exit_timeout*
    (``--exit-timeout-secs``) bounds the whole exit from the first signal: the
    workers still running then are killed, named at ERROR, and this raises
    `WorkerFailed`; None kills them `STOP_MARGIN_S` past the drain period, with
    a warning.

    Raises:
        ConfigError: The repository does not exist, *workers* is below 1, or
            *grpc_port* is the HTTP port.
        WorkerFailed: A worker could not start (the message says why), one
            kept dying before it was ready, or workers outlived *exit_timeout*.
        OSError: An address could not be bound.
    """
    from ._repository import ModelRepository

    if workers < 1:
        raise ConfigError(f"workers must be at least 1, got {workers}")
    if grpc_port is not None and grpc_port != 0 and grpc_port == port:
        raise ConfigError(f"grpc_port {grpc_port} is also the HTTP port: each needs its own")
    # Watched from here: a signal while the supervisor sets up (its control directory,
    # the repository's baseline) waits for the watcher, which stops the start, rather
    # than end the process with the directory left behind.
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        _start_signals.replay()  # a signal during the imports: as if it came now
        root = ModelRepository(repository).root  # a missing repository fails here, once
        reserved, port = _reserve_port(host, port)
        if grpc_port is not None:
            # Reserved as the HTTP port is: port 0 becomes the one port all workers share.
            try:
                grpc_reserved, grpc_port = _reserve_port(host, grpc_port)
            except OSError as exc:
                for sock in reserved:
                    sock.close()
                from ._grpc import listen_error

                raise listen_error(host, grpc_port, exc) from None
            reserved += grpc_reserved
        directory = control_directory(workers)
        log.info("supervising %d workers; control sockets in %s", workers, directory)
        spec = {
            "repository": str(root),
            "host": host,
            "port": port,
            "grpc_port": grpc_port,
            "models": None if models is None else list(models),
            "workers": workers,
            "loop": loop,
            "log_level": log_level,
            "log_format": log_format,
            "access_log": access_log,
            "directory": str(directory),
            "supervisor_pid": os.getpid(),
            # Each worker bounds its own exit too (serve_http), just past the supervisor's
            # kill (which decides, and names the workers it kills): so that one whose
            # supervisor has gone (SIGKILL) still ends after its SIGTERM.
            "exit_timeout": (
                config.drain_period + STOP_MARGIN_S if exit_timeout is None else exit_timeout
            )
            + LAST_CANCEL_S
            + BACKSTOP_S,
            "config": {
                "limits": attrs.asdict(config.limits),
                "admin_token": config.admin_token,
                "protect_inference": config.protect_inference,
                "drain_period": config.drain_period,
                "cache_size": config.cache_size,
                "trace": list(trace),
                # Polled by the supervisor; the workers refuse the API's load and unload.
                "repository_poll_s": config.repository_poll_s,
                "strict_readiness": config.strict_readiness,
                "exit_on_error": config.exit_on_error,
                "disable_auto_complete_config": config.disable_auto_complete_config,
                "rate_limit": config.rate_limit,
                "rate_limit_resources": list(config.rate_limit_resources),
                # The files' paths: each worker reads them and serves TLS as serve_http does.
                "grpc_tls": None if config.grpc_tls is None else attrs.asdict(config.grpc_tls),
                "http_tls": None if config.http_tls is None else attrs.asdict(config.http_tls),
                "http_header_forward_pattern": config.http_header_forward_pattern,
                "grpc_header_forward_pattern": config.grpc_header_forward_pattern,
            },
        }
        repo = ModelRepository(root)
        polling = config.repository_poll_s
        baseline = await anyio.to_thread.run_sync(repository_snapshot, repo) if polling else None
        # The machine's metrics, reported once, by the supervisor, sampled while it runs.
        machine = host_metrics_for(config)
        supervisor = _Supervisor(workers, directory, spec, machine)
        try:
            async with anyio.create_task_group() as tg:
                if machine is not None:
                    await tg.start(machine.run)
                await tg.start(_serve_calls, directory / "supervisor.sock", supervisor.handle)
                await tg.start(_watch_signals, supervisor, signals)
                async with anyio.create_task_group() as lives:
                    for worker in supervisor.workers:
                        lives.start_soon(supervisor.run_worker, worker)
                    async with anyio.create_task_group() as waiting:
                        waiting.start_soon(_first, supervisor.all_ready, waiting.cancel_scope)
                        waiting.start_soon(_first, supervisor.stop, waiting.cancel_scope)
                    # A signal before every worker was ready stops the start, as it does
                    # one process's (exit status 0): nothing is reported.
                    if supervisor.failure is None and supervisor.all_ready.is_set():
                        task_status.started(supervisor.listening())
                    async with anyio.create_task_group() as serving:
                        if polling and supervisor.failure is None:
                            serving.start_soon(
                                functools.partial(
                                    poll_repository,
                                    repo,
                                    polling,
                                    supervisor.poll_load,
                                    supervisor.poll_unload,
                                    baseline=baseline,
                                )
                            )
                        await supervisor.stop.wait()
                        serving.cancel_scope.cancel()  # nothing loads or unloads while they drain
                    log.info(
                        "stopping %d workers; each drains for up to %.1fs",
                        workers,
                        config.drain_period,
                    )
                    supervisor.stop_all()
                    if exit_timeout is None:
                        tg.start_soon(supervisor.kill_after, config.drain_period + STOP_MARGIN_S)
                    else:
                        tg.start_soon(
                            functools.partial(supervisor.kill_after, exit_timeout, bound=True)
                        )
                # Every worker has exited.
                tg.cancel_scope.cancel()
        finally:
            for sock in reserved:
                sock.close()
            shutil.rmtree(directory, ignore_errors=True)
        if supervisor.failure is not None:
            raise WorkerFailed(supervisor.failure, logged=supervisor.failure_logged)
        log.info("all workers stopped")


async def _first(event: anyio.Event, scope: anyio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


async def _watch_signals(
    supervisor: _Supervisor,
    signals: AsyncIterator[int],
    *,
    task_status: anyio.abc.TaskStatus[None],
) -> None:
    task_status.started()
    async for signum in signals:
        if not supervisor.stop.is_set():
            log.info("%s: stopping the workers", signal.Signals(signum).name)
            supervisor.stop.set()
        else:
            log.info("second signal: stopping the workers now")
            supervisor.signal_all(signal.SIGTERM)  # their second signal: stop at once


# -- a worker process ------------------------------------------------------------------------


def _worker_main(argv: list[str]) -> int:
    """Run worker ``argv[0]`` with the settings in ``$TRIOINFER_WORKER_SPEC``; the exit status."""
    from .._trace_settings import provider_from_settings
    from ._app import ServerConfig
    from ._codec import Limits
    from ._logging import install_handler
    from ._models import public_names
    from ._serve import serve_http
    from ._tls import TlsFiles

    index = int(argv[0])
    spec = json.loads(os.environ.pop(SPEC_ENV))
    install_handler(
        spec["log_level"],
        log_format=spec["log_format"],
        requests=spec["access_log"],
        worker=index,
    )
    settings = spec["config"]
    tracing = provider_from_settings(*settings["trace"], environ=os.environ)
    config = ServerConfig(
        limits=Limits(**settings["limits"]),
        admin_token=settings["admin_token"],
        protect_inference=settings["protect_inference"],
        drain_period=settings["drain_period"],
        cache_size=settings["cache_size"],
        tracer_provider=tracing[0] if tracing else None,
        trace_rate=tracing[1] if tracing else 1.0,
        repository_poll_s=settings["repository_poll_s"],
        strict_readiness=settings["strict_readiness"],
        exit_on_error=settings["exit_on_error"],
        disable_auto_complete_config=settings["disable_auto_complete_config"],
        rate_limit=settings["rate_limit"],
        rate_limit_resources=settings["rate_limit_resources"],
        grpc_tls=None if settings.get("grpc_tls") is None else TlsFiles(**settings["grpc_tls"]),
        http_tls=None if settings.get("http_tls") is None else TlsFiles(**settings["http_tls"]),
        http_header_forward_pattern=settings.get("http_header_forward_pattern"),
        grpc_header_forward_pattern=settings.get("grpc_header_forward_pattern"),
    )
    directory = Path(spec["directory"])
    link = WorkerLink(
        index,
        directory,
        spec["supervisor_pid"],
        spec.get("start_models"),
        count=spec["workers"],
        start_overrides=spec.get("start_overrides"),
    )

    async def serve() -> None:
        from .._exit import EXIT_TIMEOUT_SAID
        from ..cli.serve import _OnStarted, _settle_gc

        EXIT_TIMEOUT_SAID.set("--exit-timeout-secs")  # a worker of the command
        await serve_http(
            spec["repository"],
            host=spec["host"],
            port=spec["port"],
            config=config,
            models=spec["models"],
            grpc_port=spec.get("grpc_port"),
            reuse_port=True,
            worker=link,
            exit_timeout=spec.get("exit_timeout"),
            task_status=_OnStarted(lambda listening: _settle_gc()),
        )

    try:
        anyio.run(serve, backend=spec["loop"])
    except (TrioInferError, OSError, BaseExceptionGroup) as exc:
        cause = exc
        while isinstance(cause, BaseExceptionGroup) and len(cause.exceptions) == 1:
            cause = cause.exceptions[0]
        if not isinstance(cause, TrioInferError | OSError):
            raise
        if isinstance(cause, _StoppedBeforeJoining):
            log.info("%s", cause)
            return 0
        message = public_names(f"{type(cause).__name__}: {cause}")
        log.error("could not serve: %s", message)  # noqa: TRY400  # the message says it all
        with contextlib.suppress(_Gone):
            anyio.run(
                _call,
                directory / "supervisor.sock",
                {"op": "failed", "worker": index, "message": message},
            )
        return 1
    finally:
        if tracing:
            tracing[0].shutdown()  # sends the spans still buffered
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
