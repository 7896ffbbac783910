"""Prometheus metrics for ``GET /metrics``, read from the engine's statistics at scrape time.

The engine already counts and times every request (queue, compute and
request durations, batch sizes); a custom collector turns its snapshot into
Prometheus families when scraped, so the hot path pays nothing for metrics
beyond one dictionary increment per HTTP request for its outcome. Names
follow Triton's (``nv_inference_queue_duration_us`` becomes
``trioinfer_inference_queue_duration_seconds``) with Prometheus conventions:
base units, ``_total`` on counters.

Both the exposition and Triton's statistics are rendered from `Counts`, a
snapshot in plain numbers (`Metrics.counts`): a ``--workers`` worker reports
that every second, cheaply, and the supervisor renders it (`exposition_of`,
`triton_entry`) with the same code one server's routes use, so that the sums
over the workers are exact.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Final, NotRequired, TypedDict, final

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from .._custom_metrics import GaugeWorkers
from .._exceptions import (
    BackendError,
    BackendUnavailable,
    CircuitOpen,
    DeadlineExceeded,
    EngineClosed,
    InvalidInput,
    ModelNotFound,
    QueueFull,
)
from .._runner import BATCH_BUCKETS, DURATION_BUCKETS, Histogram
from ._errors import NotReady, Unauthorized
from ._host_metrics import HostMetrics

if TYPE_CHECKING:
    from ._models import ServedModels, ServedVersion

_LABELS: Final = ["model", "version"]

#: Outcome label of each error class, most specific first.
_OUTCOMES: Final[tuple[tuple[type[BaseException], str], ...]] = (
    (ModelNotFound, "not_found"),
    (InvalidInput, "invalid_input"),
    (QueueFull, "queue_full"),
    (CircuitOpen, "circuit_open"),
    (DeadlineExceeded, "deadline_exceeded"),
    (BackendUnavailable, "unavailable"),
    (BackendError, "backend_error"),
    (EngineClosed, "unavailable"),
    (NotReady, "unavailable"),
    (Unauthorized, "unauthorized"),
)


def outcome_of(error: BaseException) -> str:
    """The ``outcome`` label value for a request that ended with *error*."""
    for kind, outcome in _OUTCOMES:
        if isinstance(error, kind):
            return outcome
    return "other"


@final
class Metrics:
    """Outcome counters kept by the HTTP layer, and the Prometheus exposition of everything."""

    def __init__(
        self, models: ServedModels, in_flight: InFlight, *, host: HostMetrics | None = None
    ) -> None:
        """*host*: the machine's metrics, for a server that reports them (not a worker's)."""
        self._models = models
        self._in_flight = in_flight
        self._outcomes: Counter[tuple[str, str, str]] = Counter()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))
        if host is not None:
            self.registry.register(host)

    def succeeded(self, served: ServedVersion) -> None:
        """Count a request *served* answered."""
        self._outcomes[served.model, str(served.version), "success"] += 1

    def cancelled(self, served: ServedVersion) -> None:
        """Count a request whose client disconnected before its answer."""
        self._outcomes[served.model, str(served.version), "cancelled"] += 1

    def expired(self, served: ServedVersion) -> None:
        """Count a request cancelled because its client's deadline passed (gRPC's ``grpc-timeout``).

        The outcome of a request whose own ``timeout`` passed, over HTTP or
        gRPC (`outcome_of` a `DeadlineExceeded`): both are deadlines passing,
        not clients leaving.
        """
        self._outcomes[served.model, str(served.version), "deadline_exceeded"] += 1

    def count(
        self,
        model: str,
        version: str | None,
        error: BaseException,
        served: ServedVersion | None = None,
    ) -> None:
        """Count a request for *model* that ended with *error*.

        *served* is the version the request went to, once it was picked: a
        request that named no version is counted on it, not on a version the
        traffic split would pick again. One that failed before it went to a
        version (refused at the door, or its body could not be read as a
        request) is counted on the version it named, or, naming none, on the
        one its model sends them all to; under a traffic split, on none: with
        its model and an empty version, the model's own, as Triton counts a
        model's errors that no version answered. Requests for models the
        server does not serve are counted without a model label: the label
        values must not be whatever clients send.
        """
        if served is None:
            if version is None and self._models.splits(model):
                # No version's error, nor one to draw a version for at random.
                self._outcomes[model, "", outcome_of(error)] += 1
                return
            try:
                served = self._models.resolve(model, version)
            except ModelNotFound:
                self._outcomes["", "", outcome_of(error)] += 1
                return
        self._outcomes[served.model, str(served.version), outcome_of(error)] += 1

    def requests(self) -> int:
        """Inference requests counted so far, whatever their outcome."""
        return sum(self._outcomes.values())

    def exposition(self) -> tuple[bytes, str]:
        """The metrics in Prometheus text format, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def counts(self) -> Counts:
        """Everything the exposition and Triton's statistics show, as plain data (JSON).

        Cheap to take (no text, no metric objects): what a ``--workers``
        worker reports every second, for the supervisor to render
        (`exposition_of`, `triton_entry`) only when it needs to.
        """
        return {
            "outcomes": [[*key, n] for key, n in sorted(self._outcomes.items())],
            "in_flight": self._in_flight.value,
            "in_flight_protocols": {"http": self._in_flight.http, "grpc": self._in_flight.grpc},
            "versions": self.version_counts(self._models.all()),
            "resources": [
                [p.name, p.device or GLOBAL_DEVICE, p.size, p.in_use, p.waiting, p.waits, p.wait_s]
                for p in self._models.engine.statistics().resources
            ],
            "custom": self.custom_counts(),
        }

    def custom_counts(self) -> list[list[Any]]:
        """The models' own metric families (`Engine.custom_metrics`), as plain data.

        Each sample is labelled with the model and version as clients name
        them (the engine names version 2 of ``digits`` ``digits.v2``); one of a
        model the server does not serve (being loaded or unloaded meanwhile)
        is left out.
        """
        families = self._models.engine.custom_metrics()
        if not families:
            return []
        served = {v.engine_name: (v.model, str(v.version)) for v in self._models.all()}
        out: list[list[Any]] = []
        for family in families:
            samples = [
                [
                    *served[s.model],
                    list(s.labels.values()),
                    s.value,
                    list(s.bucket_counts),
                    s.count,
                    s.updated,
                ]
                for s in family.samples
                if s.model in served
            ]
            out.append(
                [
                    family.name,
                    family.description,
                    family.kind,
                    list(family.labels),
                    list(family.buckets),
                    samples,
                    family.workers,
                ]
            )
        return out

    def version_counts(self, chosen: Iterable[ServedVersion]) -> list[VersionCounts]:
        """The counts of each served version in *chosen* (those unloaded meanwhile left out)."""
        statistics = self._models.engine.statistics().models
        last_inference = self._models.last_inference_ms
        out: list[VersionCounts] = []
        for served in chosen:
            stats = statistics.get(served.engine_name)
            if stats is None:  # unloaded between the two lookups
                continue
            cache = stats.cache
            out.append(
                {
                    "model": served.model,
                    "version": str(served.version),
                    "last_inference": last_inference.get((served.model, served.version), 0),
                    "executions": stats.executions,
                    "successful_executions": stats.successful_executions,
                    "inferences": stats.inferences,
                    "queued": stats.queued,
                    "in_flight": stats.in_flight,
                    "succeeded": stats.succeeded,
                    # Identical requests that got a computing one's error failed too.
                    "failed": stats.failed
                    + stats.expired
                    + stats.refused
                    + (cache.failed if cache is not None else 0),
                    "replicas": [
                        [r.index, r.device, r.state, r.taken_out, r.recreated, r.failures]
                        for r in stats.replicas
                    ],
                    "fallbacks": dict(stats.fallbacks),
                    "histograms": {
                        name: _plain(getattr(stats, name), bounds)
                        for name, bounds in _BOUNDS.items()
                    },
                    "cache": None
                    if cache is None
                    else {
                        "hits": cache.hits,
                        "misses": cache.misses,
                        "coalesced": cache.coalesced,
                        "evictions": cache.evictions,
                        "bytes": cache.bytes,
                        "hit_s": cache.hit_duration.sum,
                        "miss_s": cache.miss_duration.sum,
                    },
                }
            )
        return out


class VersionCounts(TypedDict):
    """What `Metrics.counts` holds of one served model version (JSON-compatible)."""

    model: str
    version: str
    #: Milliseconds since the epoch of its last inference (0: none yet).
    last_inference: int
    executions: int
    successful_executions: int
    inferences: int
    queued: int
    in_flight: int
    succeeded: int
    #: Failed, expired and refused requests.
    failed: int
    #: Each instance: index, device, state, taken out, re-created, failures.
    replicas: list[list[Any]]
    fallbacks: dict[str, int]
    #: Each histogram by ModelStatistics' attribute: [bounds (None: the usual ones),
    #: counts (one more than bounds), count, sum].
    histograms: dict[str, list[Any]]
    cache: dict[str, Any] | None


class Counts(TypedDict):
    """What `Metrics.counts` returns: a process's counts, as plain data (JSON-compatible)."""

    #: [model, version, outcome, requests], sorted.
    outcomes: list[list[Any]]
    #: Every protocol's requests in flight (``trioinfer_http_inference_in_flight``).
    in_flight: int
    #: Requests in flight by protocol (``http``, ``grpc``).
    in_flight_protocols: dict[str, int]
    versions: list[VersionCounts]
    #: The rate limiter's pools: [name, device, size, in use, waiting, waits, seconds waited].
    resources: NotRequired[list[list[Any]]]
    #: The models' own families: [name, description, kind, label names, buckets, samples,
    #: a gauge's workers], each sample [model, version, label values, value (a histogram's
    #: sum), bucket counts (not cumulative, +Inf's last), count, a gauge's time last
    #: updated] (see `Metrics.custom_counts`).
    custom: NotRequired[list[list[Any]]]


#: The ``device`` label of a global resource's pool, which every device shares.
GLOBAL_DEVICE: Final = "global"


#: The exported histograms, by ModelStatistics' attribute, and the bounds they have.
_BOUNDS: Final[dict[str, tuple[float, ...]]] = {
    "queue_duration": DURATION_BUCKETS,
    "compute_duration": DURATION_BUCKETS,
    "request_duration": DURATION_BUCKETS,
    "batch_size": BATCH_BUCKETS,
}


def _plain(histogram: Histogram, usual: tuple[float, ...]) -> list[Any]:
    # The usual bounds go as None: a third of a report's bytes, every second.
    bounds = None if histogram.bounds == usual else histogram.bounds
    return [bounds, histogram.counts, histogram.count, histogram.sum]


def exposition_of(counts: Counts, *, pid: int | None = None) -> bytes:
    """*counts* in Prometheus text format: what `Metrics.exposition` serves for them.

    *pid*: the ``--workers`` worker process they are of, for the supervisor to
    add up (``merge_expositions``): a custom gauge declared ``workers="all"``
    is labelled with it, and one declared ``"mostrecent"`` carries the time it
    was last updated (a sample timestamp, which the sum drops).
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(counts, pid))
    return generate_latest(registry)


def gauges_of(counts: Counts) -> dict[str, GaugeWorkers]:
    """The custom gauges of *counts* that workers do not simply add up, and how they combine."""
    return {
        name: workers
        for name, _, kind, _, _, _, workers in counts.get("custom", [])
        if kind == "gauge" and workers != "sum"
    }


def triton_entry(counts: VersionCounts) -> dict[str, Any]:
    """One version's entry of Triton's ``model_stats``, from its *counts*."""
    # As in Triton, a request the cache answered is a success too (its time to
    # answer included): the engine counts it in the cache's figures only. A
    # coalesced one (answered by an identical request in flight) is one as
    # well; the cache does not time it.
    histograms = counts["histograms"]
    cache = counts["cache"]
    succeeded = counts["succeeded"] + (cache["hits"] + cache["coalesced"] if cache else 0)
    success_s = histograms["request_duration"][3] + (cache["hit_s"] if cache else 0.0)
    queue, compute = histograms["queue_duration"], histograms["compute_duration"]
    return {
        "name": counts["model"],
        "version": counts["version"],
        "last_inference": counts["last_inference"],
        "inference_count": counts["inferences"],
        # Triton's: executions that answered, not every one started.
        "execution_count": counts["successful_executions"],
        "inference_stats": {
            "success": _duration(succeeded, success_s),
            "fail": _duration(counts["failed"], 0.0),
            "queue": _duration(queue[2], queue[3]),
            "compute_input": _duration(0, 0.0),
            "compute_infer": _duration(compute[2], compute[3]),
            "compute_output": _duration(0, 0.0),
            # Triton's fields: hits, and misses (their time to look up and store, not to compute).
            "cache_hit": _duration(cache["hits"] if cache else 0, cache["hit_s"] if cache else 0.0),
            "cache_miss": _duration(
                cache["misses"] if cache else 0, cache["miss_s"] if cache else 0.0
            ),
        },
        "batch_stats": [],
    }


def _duration(count: int, seconds: float) -> dict[str, int]:
    return {"count": count, "ns": int(seconds * 1e9)}


def _families(counts: Counts, pid: int | None = None) -> Iterator[Metric]:
    requests = CounterMetricFamily(
        "trioinfer_inference_requests",
        "Inference requests over HTTP and gRPC, by model, version and outcome.",
        labels=[*_LABELS, "outcome"],
    )
    for model, version, outcome, n in counts["outcomes"]:
        requests.add_metric([model, version, outcome], n)
    yield requests
    by_protocol = GaugeMetricFamily(
        "trioinfer_inference_in_flight",
        "Inference requests the server is handling now, by protocol (http, grpc).",
        labels=["protocol"],
    )
    for protocol, n in counts["in_flight_protocols"].items():
        by_protocol.add_metric([protocol], n)
    yield by_protocol
    yield GaugeMetricFamily(
        "trioinfer_http_inference_in_flight",
        "Inference requests the server is handling now, over HTTP and gRPC together "
        "(an older name, kept: trioinfer_inference_in_flight has them by protocol).",
        value=counts["in_flight"],
    )
    executions = CounterMetricFamily(
        "trioinfer_inference_executions",
        "Backend executions (batches) started.",
        labels=_LABELS,
    )
    succeeded_executions = CounterMetricFamily(
        "trioinfer_inference_executions_succeeded",
        "Backend executions whose outputs went to their requests "
        "(Triton's nv_inference_exec_count).",
        labels=_LABELS,
    )
    inferences = CounterMetricFamily(
        "trioinfer_inferences",
        "Rows of the requests that got outputs (Triton's nv_inference_count).",
        labels=_LABELS,
    )
    queued = GaugeMetricFamily(
        "trioinfer_inference_queue_depth", "Requests waiting in the queue.", labels=_LABELS
    )
    in_flight = GaugeMetricFamily(
        "trioinfer_inference_pending",
        "Requests accepted by the engine and not yet ended (queued or running).",
        labels=_LABELS,
    )
    instances = GaugeMetricFamily(
        "trioinfer_instances",
        "Model instances by device and state (serving, or out of service).",
        labels=[*_LABELS, "device", "state"],
    )
    taken_out = CounterMetricFamily(
        "trioinfer_instance_taken_out",
        "Times an instance was taken out of service (its circuit breaker opened).",
        labels=[*_LABELS, "instance", "device"],
    )
    recreated = CounterMetricFamily(
        "trioinfer_instance_recreated",
        "Times an instance's backend session was re-created after it died.",
        labels=[*_LABELS, "instance", "device"],
    )
    failures = CounterMetricFamily(
        "trioinfer_instance_failures",
        "Executions (batches and probes) that failed on an instance.",
        labels=[*_LABELS, "instance", "device"],
    )
    fallbacks = CounterMetricFamily(
        "trioinfer_inference_fallbacks",
        "Requests that took a fallback step, by kind (retry, failover, hedge, model, default).",
        labels=[*_LABELS, "kind"],
    )
    cache: dict[str, CounterMetricFamily | GaugeMetricFamily] = {
        "hits": CounterMetricFamily(
            "trioinfer_cache_hits", "Requests answered from the response cache.", labels=_LABELS
        ),
        "misses": CounterMetricFamily(
            "trioinfer_cache_misses",
            "Requests of a model with the response cache on that were computed.",
            labels=_LABELS,
        ),
        "coalesced": CounterMetricFamily(
            "trioinfer_cache_coalesced",
            "Requests answered by an identical request computed meanwhile.",
            labels=_LABELS,
        ),
        "evictions": CounterMetricFamily(
            "trioinfer_cache_evictions",
            "Answers dropped from the response cache to make room.",
            labels=_LABELS,
        ),
        "bytes": GaugeMetricFamily(
            "trioinfer_cache_bytes", "Bytes the model's answers take in the cache.",
            labels=_LABELS,
        ),
    }  # fmt: skip
    histograms = {
        "queue_duration": HistogramMetricFamily(
            "trioinfer_inference_queue_duration_seconds",
            "Time requests waited in the queue before their execution started.",
            labels=_LABELS,
        ),
        "compute_duration": HistogramMetricFamily(
            "trioinfer_inference_compute_duration_seconds",
            "Execution time of the batch each request ran in.",
            labels=_LABELS,
        ),
        "request_duration": HistogramMetricFamily(
            "trioinfer_inference_request_duration_seconds",
            "Time from arrival to outputs, for requests that succeeded.",
            labels=_LABELS,
        ),
        "batch_size": HistogramMetricFamily(
            "trioinfer_inference_batch_rows",
            "Rows (batch size) per execution.",
            labels=_LABELS,
        ),
    }
    for stats in counts["versions"]:
        labels = [stats["model"], stats["version"]]
        executions.add_metric(labels, stats["executions"])
        succeeded_executions.add_metric(labels, stats["successful_executions"])
        inferences.add_metric(labels, stats["inferences"])
        queued.add_metric(labels, stats["queued"])
        in_flight.add_metric(labels, stats["in_flight"])
        states = Counter((device, state) for _, device, state, *_ in stats["replicas"])
        for (device, state), n in sorted(states.items()):
            instances.add_metric([*labels, device, state], n)
        for index, device, _state, n_taken_out, n_recreated, n_failures in stats["replicas"]:
            where = [*labels, str(index), device]
            taken_out.add_metric(where, n_taken_out)
            recreated.add_metric(where, n_recreated)
            failures.add_metric(where, n_failures)
        for kind, n in sorted(stats["fallbacks"].items()):
            fallbacks.add_metric([*labels, kind], n)
        for attribute, family in histograms.items():
            bounds, bucket_counts, count, total = stats["histograms"][attribute]
            bounds = _BOUNDS[attribute] if bounds is None else bounds
            family.add_metric(labels, _buckets(bounds, bucket_counts, count), total)
        if stats["cache"] is not None:
            for attribute, cache_family in cache.items():
                cache_family.add_metric(labels, stats["cache"][attribute])
    yield executions
    yield succeeded_executions
    yield inferences
    yield queued
    yield in_flight
    yield instances
    yield taken_out
    yield recreated
    yield failures
    yield fallbacks
    yield from histograms.values()
    yield from cache.values()
    yield from _resource_families(counts.get("resources", []))
    yield from _custom_families(counts.get("custom", []), pid)


def _custom_families(families: list[list[Any]], pid: int | None) -> Iterator[Metric]:
    # The models' own (Metrics.custom_counts), after ours: their names never start
    # with trioinfer_, nor clash with each other's samples (the engine refuses both).
    for name, description, kind, label_names, bounds, samples, workers in families:
        labels = [*_LABELS, *label_names]
        family: Metric
        if kind == "counter":
            family = CounterMetricFamily(name, description, labels=labels)
            for model, version, values, value, *_ in samples:
                family.add_metric([model, version, *values], value)
        elif kind == "gauge":
            # A worker's for the supervisor (see exposition_of); "pid" is reserved.
            each = pid is not None and workers == "all"
            latest = pid is not None and workers == "mostrecent"
            family = GaugeMetricFamily(
                name, description, labels=[*labels, "pid"] if each else labels
            )
            for model, version, values, value, _, _, updated in samples:
                family.add_metric(
                    [model, version, *values, *([str(pid)] if each else [])],
                    value,
                    timestamp=updated if latest else None,
                )
        else:
            family = HistogramMetricFamily(name, description, labels=labels)
            for model, version, values, value, bucket_counts, count, _ in samples:
                family.add_metric(
                    [model, version, *values], _buckets(bounds, bucket_counts, count), value
                )
        yield family


def _resource_families(pools: list[list[Any]]) -> Iterator[Metric]:
    # The rate limiter's pools (--rate-limit execution_count), shared by every model.
    labels = ["resource", "device"]
    size = GaugeMetricFamily(
        "trioinfer_resource_pool_size", "How much of a resource its pool holds.", labels=labels
    )
    in_use = GaugeMetricFamily(
        "trioinfer_resource_in_use",
        "How much of a resource running executions hold.",
        labels=labels,
    )
    waiting = GaugeMetricFamily(
        "trioinfer_resource_waiting", "Instances waiting for a resource now.", labels=labels
    )
    waits = CounterMetricFamily(
        "trioinfer_resource_waits", "Executions that waited for a resource.", labels=labels
    )
    wait_s = CounterMetricFamily(
        "trioinfer_resource_wait_seconds", "Seconds executions waited for a resource.",
        labels=labels,
    )  # fmt: skip
    for name, device, n_size, n_in_use, n_waiting, n_waits, seconds in pools:
        size.add_metric([name, device], n_size)
        in_use.add_metric([name, device], n_in_use)
        waiting.add_metric([name, device], n_waiting)
        waits.add_metric([name, device], n_waits)
        wait_s.add_metric([name, device], seconds)
    # Declared with no pools too, as the cache's families are without a cached model.
    yield from (size, in_use, waiting, waits, wait_s)


@final
class InFlight:
    """Inference requests being handled now, by protocol: the server's layers count them.

    Read by the metrics at scrape time. The HTTP routes (infer, generate)
    count theirs in ``http``, the gRPC service in ``grpc``.
    """

    __slots__ = ("grpc", "http")

    def __init__(self) -> None:
        self.http = 0
        self.grpc = 0

    @property
    def value(self) -> int:
        """Every protocol's together."""
        return self.http + self.grpc


def _buckets(bounds: Sequence[float], counts: Sequence[int], count: int) -> list[tuple[str, float]]:
    out = []
    total = 0
    for bound, n in zip(bounds, counts, strict=False):
        total += n
        out.append((repr(float(bound)), float(total)))
    out.append(("+Inf", float(count)))
    return out


@final
class _Collector:
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return _families(self._metrics.counts())


@final
class _Families:
    def __init__(self, counts: Counts, pid: int | None) -> None:
        self._counts = counts
        self._pid = pid

    def collect(self) -> Iterator[Metric]:
        return _families(self._counts, self._pid)
