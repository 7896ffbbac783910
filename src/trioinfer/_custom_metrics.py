"""Custom metrics: families a model declares and updates, kept by its engine.

Triton's Python backend lets a model declare its own Prometheus metrics
(``pb_utils.MetricFamily``); here a backend hands a model a `ModelMetrics`
(the ``python`` backend's ``metrics`` keyword), and the engine keeps the
families: `Engine.custom_metrics` snapshots them for an in-process user, and
``trioinfer serve`` shows them on ``/metrics`` beside its own families.

The registry is the engine's: one family per name, whichever models declare
it, each model's series apart (the ``model`` of each sample). A load of a
model owns the series its instances make (an `_Owner`): when a newer load
replaces it, or the model is unloaded, or its load fails, its series go, as
Triton's go with the model's stub, and a load starts again from zero. A family
no model holds any more goes too, so that its name is free again.

Updates come from the event loop (an ``async def infer``) and from worker
threads (a plain ``def infer``) at once: each family has a lock, held for the
few operations of an update or while a snapshot copies the family's series.
"""

from __future__ import annotations

import bisect
import itertools
import math
import numbers
import re
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from contextvars import ContextVar
from typing import Final, Generic, Literal, SupportsFloat, TypeGuard, TypeVar, final

import attrs
import numpy as np

from ._exceptions import InvalidMetric
from ._util import NoPublicConstructor

#: The kinds of family a model may declare.
MetricKind = Literal["counter", "gauge", "histogram"]

#: How a gauge's series of ``trioinfer serve --workers`` workers make the server's:
#: prometheus_client's multiprocess modes of the same names (each worker's series
#: goes with its process, so its ``live*`` modes are these).
GaugeWorkers = Literal["sum", "max", "min", "mostrecent", "all"]
_GAUGE_WORKERS: Final = ("sum", "max", "min", "mostrecent", "all")

#: Prometheus's metric and label names (https://prometheus.io/docs/concepts/data_model/).
_NAME: Final = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL: Final = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")

#: The prefix of trioinfer's own families (``trioinfer_inference_requests``, ...).
RESERVED_PREFIX: Final = "trioinfer_"

#: Label names a model may not declare, and why: the server adds the first two to
#: every sample, Prometheus gives ``le`` a histogram's bounds, and ``pid`` marks a
#: ``--workers`` worker's own series, which end with the process.
_RESERVED_LABELS: Final = {
    "model": "the server labels every sample with its model",
    "version": "the server labels every sample with its model's version",
    "le": "Prometheus names a histogram's bucket bounds le",
    "pid": "trioinfer serve --workers reserves it for a worker's own series",
}


@attrs.frozen
class CustomMetricSample:
    """One series of a custom metric family: a model's, with its label values.

    Attributes:
        model: The engine's name of the model whose load made it.
        labels: Its label values, by label name, in the family's order.
        value: A counter's or gauge's value; a histogram's sum of observations.
        bucket_counts: A histogram's observations per bucket, not cumulative:
            one per bound of the family's ``buckets``, and a last one above them
            all (``+Inf``). Empty for a counter or gauge.
        count: A histogram's number of observations (0 for a counter or gauge).
        updated: When a gauge was last set or changed (``time.time()``; 0 if
            never): what ``workers="mostrecent"`` compares.
    """

    model: str
    labels: Mapping[str, str]
    value: float
    bucket_counts: tuple[int, ...] = ()
    count: int = 0
    updated: float = 0.0


@attrs.frozen
class CustomMetricFamily:
    """A snapshot of a custom metric family, with every loaded model's series of it.

    Attributes:
        name: Its name (a counter's without ``_total``, which the exposition adds).
        description: What it measures (the first declaration's words).
        kind: ``"counter"``, ``"gauge"`` or ``"histogram"``.
        labels: The label names its series have, besides the model.
        buckets: A histogram's upper bounds, increasing (empty otherwise).
        samples: Its series, by model then label values.
        workers: A gauge's: how the series of ``trioinfer serve --workers``
            workers combine (see `ModelMetrics.gauge`); ``"sum"`` otherwise.
    """

    name: str
    description: str
    kind: MetricKind
    labels: tuple[str, ...]
    buckets: tuple[float, ...]
    samples: tuple[CustomMetricSample, ...]
    workers: GaugeWorkers = "sum"


@final
class _Owner:
    """One load of a model: the series it makes go when it ends."""

    # (__weakref__: pb_utils.MetricFamily keeps what a load declared by its owner.)
    __slots__ = ("__weakref__", "ended", "installed", "model", "replaces")

    def __init__(self, model: str, retiring: Iterable[str] = ()) -> None:
        self.model = model
        #: The models it replaces once it serves: its own earlier load, and those
        #: its caller unloads then (a model's versions it no longer serves).
        self.replaces = frozenset({model, *retiring})
        #: Whether it serves (its series are shown): not while loading.
        self.installed = False
        #: Whether it was dropped: what its model still declares or makes (a thread
        #: still running after the unload) is kept by no registry, so never shown and
        #: never held past the objects the model keeps.
        self.ended = False


class _Series:
    """One series' figures; its family's lock guards them."""

    __slots__ = ("count", "counts", "updated", "value")

    def __init__(self, buckets: int) -> None:
        self.value = 0.0
        self.count = 0
        self.counts = [0] * (buckets + 1) if buckets else []
        self.updated = 0.0  # a gauge's (for workers="mostrecent")


@final
class _Family:
    """A family as the registry keeps it: its declaration, its models, their series."""

    def __init__(
        self,
        name: str,
        description: str,
        kind: MetricKind,
        labels: tuple[str, ...],
        buckets: tuple[float, ...],
        workers: GaugeWorkers = "sum",
    ) -> None:
        self.name = name
        self.description = description
        self.kind: MetricKind = kind
        self.labels = labels
        self.buckets = buckets
        self.workers: GaugeWorkers = workers
        self.lock = threading.Lock()
        self.owners: set[_Owner] = set()
        self.series: dict[tuple[_Owner, tuple[str, ...]], _Series] = {}

    def declared(self) -> str:
        """How it was declared, to say what a clashing declaration differs from."""
        labels = f"labels {list(self.labels)}" if self.labels else "no labels"
        buckets = f", buckets {list(self.buckets)}" if self.kind == "histogram" else ""
        workers = f", workers={self.workers!r}" if self.workers != "sum" else ""
        return f"a {self.kind} with {labels}{buckets}{workers}"

    def declaration(self) -> tuple[object, ...]:
        """What every model declaring it declares alike."""
        return (self.kind, self.labels, self.buckets, self.workers)

    def snapshot(self) -> CustomMetricFamily:
        with self.lock:
            figures = [
                (owner.model, values, s.value, tuple(s.counts), s.count, s.updated)
                for (owner, values), s in self.series.items()
                if owner.installed
            ]
        figures.sort(key=lambda f: (f[0], f[1]))
        return CustomMetricFamily(
            name=self.name,
            description=self.description,
            kind=self.kind,
            labels=self.labels,
            buckets=self.buckets,
            samples=tuple(
                CustomMetricSample(
                    model,
                    dict(zip(self.labels, values, strict=True)),
                    value,
                    counts,
                    count,
                    updated,
                )
                for model, values, value, counts, count, updated in figures
            ),
            workers=self.workers,
        )


def _sample_names(name: str, kind: MetricKind) -> set[str]:
    # The names its samples have in the text format, which no other family may use.
    if kind == "counter":
        return {name, f"{name}_total", f"{name}_created"}
    if kind == "histogram":
        return {name, f"{name}_bucket", f"{name}_count", f"{name}_sum", f"{name}_created"}
    return {name}


@final
class CustomMetrics:
    """The engine's custom metric families (one registry per engine)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._families: dict[str, _Family] = {}
        #: Families a newer load of the only model declaring them declared otherwise
        #: (its file edited, then reloaded): shown until that load serves, and back
        #: in `_families` if it fails.
        self._outgoing: dict[str, _Family] = {}

    def begin(self, model: str, *, retiring: Iterable[str] = ()) -> _Owner:
        """A load of *model* starts: what owns the series it makes.

        *retiring*: the models unloaded once it serves (see `declare`).
        """
        return _Owner(model, retiring)

    def install(self, owner: _Owner) -> None:
        """*owner*'s model serves now: its series are shown."""
        owner.installed = True

    def drop(self, owner: _Owner) -> None:
        """*owner*'s load ended (replaced, unloaded, failed): its series go.

        A family no load holds any more goes too.
        """
        owner.installed = False
        with self._lock:
            owner.ended = True  # under the lock: a declare() after it sees it
            for families in (self._outgoing, self._families):
                for name, family in list(families.items()):
                    if owner not in family.owners:
                        continue
                    with family.lock:
                        family.owners.discard(owner)
                        for key in [k for k in family.series if k[0] is owner]:
                            del family.series[key]
                    if not family.owners:
                        del families[name]
                        if families is self._families and name in self._outgoing:
                            # The load that declared it otherwise failed: as before it.
                            self._families[name] = self._outgoing.pop(name)

    def snapshot(self) -> tuple[CustomMetricFamily, ...]:
        """Every family, sorted by name, with the series of the models that serve."""
        with self._lock:
            families = sorted(
                (
                    # The declaration a reload changes is shown until the reload serves.
                    self._outgoing[f.name]
                    if f.name in self._outgoing and not any(o.installed for o in f.owners)
                    else f
                    for f in self._families.values()
                ),
                key=lambda f: f.name,
            )
        return tuple(f.snapshot() for f in families)

    def declare(
        self,
        owner: _Owner,
        kind: MetricKind,
        name: object,
        description: object,
        labels: object,
        buckets: object,
        workers: object = "sum",
    ) -> _Family:
        """The family *owner* declares, created or, declared alike before, shared."""
        declared = _Family(
            *_checked(owner.model, kind, name, description, labels, buckets, workers)
        )
        name = declared.name
        with self._lock:
            if owner.ended:
                # Its load was dropped (a model's thread declaring after its unload):
                # a family of its own, in no registry, rather than one no drop would end.
                return declared
            family = self._families.get(name)
            if (
                family is not None
                and family.declaration() != declared.declaration()
                and name not in self._outgoing
                and owner not in family.owners
                and all(o.model in owner.replaces for o in family.owners)
            ):
                # A new load of the only model declaring it (its file edited and reloaded,
                # or a new version replacing the served one) declares it otherwise: the
                # new declaration is the family's, the old one's series shown until this
                # load serves (or back if it fails).
                self._outgoing[name] = family
                family = None
            if family is None:
                mine = _sample_names(name, kind)
                for other in [*self._families.values(), *self._outgoing.values()]:
                    if other.name != name and mine & _sample_names(other.name, other.kind):
                        raise InvalidMetric(
                            f"model {owner.model!r}: custom {kind} {name!r} would clash in "
                            f"the Prometheus text with the {other.kind} {other.name!r} "
                            f"declared already (both write samples named "
                            f"{sorted(mine & _sample_names(other.name, other.kind))[0]!r}): "
                            "choose another name"
                        )
                family = declared
                self._families[name] = family
            elif family.declaration() != declared.declaration():
                theirs = sorted({o.model for o in family.owners})
                raise InvalidMetric(
                    f"model {owner.model!r} declares {name!r} as {declared.declared()}, but it "
                    f"is declared already as {family.declared()} (by "
                    f"{', '.join(map(repr, theirs))}): a family's kind, labels, buckets and "
                    "workers are the same for every model that declares it; choose another "
                    "name or declare it alike"
                )
            with family.lock:
                family.owners.add(owner)
        return family


def _checked(
    model: str,
    kind: MetricKind,
    name: object,
    description: object,
    labels: object,
    buckets: object,
    workers: object,
) -> tuple[str, str, MetricKind, tuple[str, ...], tuple[float, ...], GaugeWorkers]:
    what = f"model {model!r}: custom {kind}"
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        raise InvalidMetric(
            f"{what} name must be a Prometheus metric name (letters, digits, _ and :, not "
            f"starting with a digit), got {name!r}"
        )
    if name.startswith(RESERVED_PREFIX):
        raise InvalidMetric(
            f"{what} {name!r}: names starting with {RESERVED_PREFIX!r} are trioinfer's own "
            "families; choose a prefix of the model's or application's"
        )
    if kind == "counter" and name.endswith("_total"):
        # As prometheus_client does: the exposition adds it back (``requests_total``).
        name = name.removesuffix("_total")
    if not isinstance(description, str):
        raise InvalidMetric(f"{what} {name!r}: the description must be a str, got {description!r}")
    if isinstance(labels, str) or not isinstance(labels, Iterable):
        raise InvalidMetric(
            f"{what} {name!r}: labels must be a sequence of label names such as "
            f"['kind'], got {labels!r}"
        )
    label_names = tuple(labels)
    for label in label_names:
        if not isinstance(label, str) or _LABEL.fullmatch(label) is None or label[:2] == "__":
            raise InvalidMetric(
                f"{what} {name!r}: label {label!r} is not a Prometheus label name (letters, "
                "digits and _, not starting with a digit or __)"
            )
        if label in _RESERVED_LABELS:
            raise InvalidMetric(
                f"{what} {name!r}: label {label!r} is reserved ({_RESERVED_LABELS[label]})"
            )
    if len(set(label_names)) != len(label_names):
        raise InvalidMetric(f"{what} {name!r}: labels {list(label_names)} name one label twice")
    bounds: tuple[float, ...] = ()
    if kind == "histogram":
        if isinstance(buckets, (str, bytes)) or not isinstance(buckets, Iterable):
            raise InvalidMetric(
                f"{what} {name!r}: buckets must be a sequence of upper bounds such as "
                f"[0.01, 0.1, 1.0], got {buckets!r}"
            )
        given = list(buckets)
        if (
            not given
            or not all(_is_number(b) for b in given)
            or not all(math.isfinite(b) for b in given)
            or any(a >= b for a, b in itertools.pairwise(given))
        ):
            raise InvalidMetric(
                f"{what} {name!r}: buckets must be finite numbers in increasing order, at "
                f"least one (+Inf is always there), got {given!r}"
            )
        bounds = tuple(float(b) for b in given)
    mode: GaugeWorkers = "sum"
    for allowed in _GAUGE_WORKERS:
        if workers == allowed and isinstance(workers, str):
            mode = allowed
            break
    else:
        raise InvalidMetric(
            f"{what} {name!r}: workers must be one of {', '.join(map(repr, _GAUGE_WORKERS))}, "
            f"got {workers!r}"
        )
    return name, description, kind, label_names, bounds, mode


#: The series a load makes (see `current_model_metrics`), set by the engine while it loads.
_current_owner: ContextVar[tuple[CustomMetrics, _Owner] | None] = ContextVar(
    "trioinfer_metrics_owner", default=None
)


def current_model_metrics() -> ModelMetrics:
    """The custom metrics of the model the engine is loading, for a backend to hand it.

    Call it in a backend's ``load`` (the ``python`` backend does, for a
    class whose ``__init__`` takes ``metrics``). Every instance of one load
    gets the same series; they go when the load is replaced or unloaded.

    Raises:
        RuntimeError: Outside an engine's load of a model.
    """
    current = _current_owner.get()
    if current is None:
        raise RuntimeError("current_model_metrics() is only known in a backend's load()")
    return ModelMetrics._create(*current)


@final
class ModelMetrics(metaclass=NoPublicConstructor):
    """Where a model declares its own metric families (the python backend's ``metrics``).

    Each method declares a family, or returns the one declared alike before
    (by another instance of the model, or another model: a family is the
    engine's, and each model's series are its own), and raises
    [`InvalidMetric`][trioinfer.InvalidMetric] for a name that is not a
    Prometheus name, one of trioinfer's own (``trioinfer_*``), one another
    family's samples would clash with, or one declared already as another
    kind, with other labels, other buckets or (a gauge) other ``workers``.
    Label names are Prometheus's; ``model``, ``version``, ``le`` and ``pid``
    are reserved. Declare families in ``__init__`` (or ``load``): a family
    is free to declare again only once no loaded model declares it, or by a
    reload of the only model that declares it.
    """

    __slots__ = ("_owner", "_registry")

    def __init__(self, registry: CustomMetrics, owner: _Owner) -> None:
        self._registry = registry
        self._owner = owner

    def counter(
        self, name: str, description: str, *, labels: Sequence[str] = ()
    ) -> MetricFamily[CounterMetric]:
        """A counter: a total that only goes up (requests, tokens, seconds spent).

        Exposed as ``name_total``; a trailing ``_total`` in *name* is dropped
        from the family's name, as prometheus_client does.
        """
        family = self._registry.declare(self._owner, "counter", name, description, labels, ())
        return MetricFamily[CounterMetric]._create(family, self._owner, CounterMetric)

    def gauge(
        self,
        name: str,
        description: str,
        *,
        labels: Sequence[str] = (),
        workers: GaugeWorkers = "sum",
    ) -> MetricFamily[GaugeMetric]:
        """A gauge: a value that goes up and down (items held, a temperature).

        *workers*: how the series of ``trioinfer serve --workers N`` (each
        worker a copy of the model, with its own series) show as the
        server's: ``"sum"`` (the default, as the instances of a Triton model
        add to one series: things held, such as requests in flight),
        ``"max"`` or ``"min"`` (a high-water mark, a "loaded" flag),
        ``"mostrecent"`` (the value of the worker that set or changed it
        last, as a Triton model's last ``set`` shows) or ``"all"`` (each
        worker's series, labelled with its ``pid``). A worker's series goes
        when it stops. One process shows its own value, whichever is declared.
        """
        family = self._registry.declare(
            self._owner, "gauge", name, description, labels, (), workers
        )
        return MetricFamily[GaugeMetric]._create(family, self._owner, GaugeMetric)

    def histogram(
        self, name: str, description: str, *, buckets: Sequence[float], labels: Sequence[str] = ()
    ) -> MetricFamily[HistogramMetric]:
        """A histogram: observations counted in *buckets* (increasing upper bounds).

        Exposed as ``name_bucket`` (cumulative, with ``+Inf``), ``name_count``
        and ``name_sum``.
        """
        family = self._registry.declare(
            self._owner, "histogram", name, description, labels, buckets
        )
        return MetricFamily[HistogramMetric]._create(family, self._owner, HistogramMetric)


M = TypeVar("M", "CounterMetric", "GaugeMetric", "HistogramMetric")


@final
class MetricFamily(Generic[M], metaclass=NoPublicConstructor):
    """A declared family, as the model that declared it sees it: its series by label values."""

    __slots__ = ("_family", "_kind", "_owner")

    def __init__(self, family: _Family, owner: _Owner, kind: type[M]) -> None:
        self._family = family
        self._owner = owner
        self._kind: type[M] = kind

    @property
    def name(self) -> str:
        """The family's name."""
        return self._family.name

    def metric(self, /, **labels: str) -> M:
        """The model's series with these label values (one per declared label), made once.

        Keep it (in ``__init__``, or the first time) rather than asking for it
        on every request: it is cheap, but its update is cheaper.

        Raises:
            InvalidMetric: A label the family does not declare, one missing, or
                a value that is not a str.
        """
        family = self._family
        if labels.keys() != set(family.labels):
            raise InvalidMetric(
                f"custom {family.kind} {family.name!r} declares labels {list(family.labels)}, "
                f"got {sorted(labels)}: give each declared label a value, and no other"
            )
        values = tuple(labels[name] for name in family.labels)
        if not all(isinstance(v, str) for v in values):
            raise InvalidMetric(
                f"custom {family.kind} {family.name!r}: label values must be str, got {labels!r}"
            )
        key = (self._owner, values)
        with family.lock:
            series = family.series.get(key)
            if series is None:
                series = _Series(len(family.buckets))
                # Not kept once the load was dropped (drop() took the series it had
                # under this lock): updates after an unload count into nothing.
                if not self._owner.ended:
                    family.series[key] = series
        made: M = self._kind._create(family, series)
        return made


class _Metric(metaclass=NoPublicConstructor):
    __slots__ = ("_family", "_series")

    def __init__(self, family: _Family, series: _Series) -> None:
        self._family = family
        self._series = series


def _is_number(value: object) -> TypeGuard[SupportsFloat]:
    # numbers.Real takes numpy's scalars (a mask's sum is a numpy.int64), not bool.
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _number(family: _Family, what: str, amount: object) -> float:
    # Not inf or NaN: +inf in a counter stays for good (every rate() of it NaN from
    # then on), and NaN, or inf in a gauge or a histogram's sum, turns every figure
    # computed from the series into NaN. Each is a model's bug, refused where it is.
    if type(amount) is float:  # the usual case first: every update pays for this check
        if math.isfinite(amount):
            return amount
    elif type(amount) is int or _is_number(amount):
        try:
            value = float(amount)
        except OverflowError:  # an int past a float's range
            pass
        else:
            if math.isfinite(value):
                return value
    raise InvalidMetric(
        f"custom {family.kind} {family.name!r}: {what} takes a finite number, got {amount!r}"
    )


@final
class CounterMetric(_Metric):
    """One series of a counter."""

    __slots__ = ()

    def increment(self, amount: float = 1.0) -> None:
        """Add *amount* (1 by default) to it.

        Raises:
            InvalidMetric: *amount* is negative or not a number (a counter never
                goes down: Prometheus would read that as a restart).
        """
        amount = _number(self._family, "increment", amount)
        if amount < 0:
            raise InvalidMetric(
                f"custom counter {self._family.name!r} only goes up, got an increment of "
                f"{amount!r}: use a gauge for a value that also goes down"
            )
        with self._family.lock:
            self._series.value += amount

    def value(self) -> float:
        """Its value now."""
        return self._series.value


@final
class GaugeMetric(_Metric):
    """One series of a gauge."""

    __slots__ = ()

    def set(self, value: float) -> None:
        """Set it to *value*."""
        value = _number(self._family, "set", value)
        with self._family.lock:
            self._series.value = value
            self._series.updated = time.time()

    def increment(self, amount: float = 1.0) -> None:
        """Add *amount* (1 by default; negative takes away)."""
        amount = _number(self._family, "increment", amount)
        with self._family.lock:
            self._series.value += amount
            self._series.updated = time.time()

    def decrement(self, amount: float = 1.0) -> None:
        """Take *amount* (1 by default) away."""
        self.increment(-_number(self._family, "decrement", amount))

    def value(self) -> float:
        """Its value now."""
        return self._series.value


@final
class HistogramMetric(_Metric):
    """One series of a histogram."""

    __slots__ = ()

    def observe(self, value: float) -> None:
        """Count *value* in its bucket (the first whose bound is at least it)."""
        value = _number(self._family, "observe", value)
        index = bisect.bisect_left(self._family.buckets, value)
        with self._family.lock:
            series = self._series
            series.counts[index] += 1
            series.count += 1
            series.value += value

    def value(self) -> float:
        """The sum of its observations."""
        return self._series.value

    def count(self) -> int:
        """How many values it observed."""
        return self._series.count
