"""Prometheus metrics for ``GET /metrics``, read from the engine's statistics at scrape time.

The engine already counts and times every request (queue, compute and
request durations, batch sizes); a custom collector turns its snapshot into
Prometheus families when scraped, so the hot path pays nothing for metrics
beyond one dictionary increment per HTTP request for its outcome. Names
follow Triton's (``nv_inference_queue_duration_us`` becomes
``trioinfer_inference_queue_duration_seconds``) with Prometheus conventions:
base units, ``_total`` on counters.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Final, final

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

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
from .._runner import Histogram
from ._errors import NotReady, Unauthorized

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

    def __init__(self, models: ServedModels, in_flight: InFlight) -> None:
        self._models = models
        self._in_flight = in_flight
        self._outcomes: Counter[tuple[str, str, str]] = Counter()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))

    def succeeded(self, served: ServedVersion) -> None:
        """Count a request *served* answered."""
        self._outcomes[served.model, str(served.version), "success"] += 1

    def cancelled(self, served: ServedVersion) -> None:
        """Count a request whose client disconnected before its answer."""
        self._outcomes[served.model, str(served.version), "cancelled"] += 1

    def count(self, model: str, version: str | None, error: BaseException) -> None:
        """Count a request for *model* that ended with *error*.

        Requests for models the server does not serve are counted without a
        model label: the label values must not be whatever clients send.
        """
        try:
            served = self._models.resolve(model, version)
        except ModelNotFound:
            key = ("", "", outcome_of(error))
        else:
            key = (served.model, str(served.version), outcome_of(error))
        self._outcomes[key] += 1

    def requests(self) -> int:
        """Inference requests counted so far, whatever their outcome."""
        return sum(self._outcomes.values())

    def exposition(self) -> tuple[bytes, str]:
        """The metrics in Prometheus text format, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def _families(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "trioinfer_inference_requests",
            "Inference requests over HTTP, by model, version and outcome.",
            labels=[*_LABELS, "outcome"],
        )
        for (model, version, outcome), n in sorted(self._outcomes.items()):
            requests.add_metric([model, version, outcome], n)
        yield requests
        yield GaugeMetricFamily(
            "trioinfer_http_inference_in_flight",
            "Inference requests the HTTP server is handling now.",
            value=self._in_flight.value,
        )
        statistics = self._models.engine.statistics().models
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
        for served in self._models.all():
            stats = statistics.get(served.engine_name)
            if stats is None:
                continue
            labels = [served.model, str(served.version)]
            executions.add_metric(labels, stats.executions)
            succeeded_executions.add_metric(labels, stats.successful_executions)
            inferences.add_metric(labels, stats.inferences)
            queued.add_metric(labels, stats.queued)
            in_flight.add_metric(labels, stats.in_flight)
            states = Counter((r.device, r.state) for r in stats.replicas)
            for (device, state), n in sorted(states.items()):
                instances.add_metric([*labels, device, state], n)
            for replica in stats.replicas:
                where = [*labels, str(replica.index), replica.device]
                taken_out.add_metric(where, replica.taken_out)
                recreated.add_metric(where, replica.recreated)
                failures.add_metric(where, replica.failures)
            for kind, n in sorted(stats.fallbacks.items()):
                fallbacks.add_metric([*labels, kind], n)
            for attribute, family in histograms.items():
                histogram: Histogram = getattr(stats, attribute)
                family.add_metric(labels, _buckets(histogram), histogram.sum)
            if stats.cache is not None:
                for attribute, cache_family in cache.items():
                    cache_family.add_metric(labels, getattr(stats.cache, attribute))
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


@final
class InFlight:
    """A counter the HTTP layer updates, read by the metrics at scrape time."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0


def _buckets(histogram: Histogram) -> list[tuple[str, float]]:
    out = []
    total = 0
    for bound, n in zip(histogram.bounds, histogram.counts, strict=False):
        total += n
        out.append((repr(float(bound)), float(total)))
    out.append(("+Inf", float(histogram.count)))
    return out


@final
class _Collector:
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return self._metrics._families()
