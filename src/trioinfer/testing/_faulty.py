"""Fault injection for testing applications built on trioinfer.

[`FaultyBackend`][trioinfer.testing.FaultyBackend] wraps a real or fake backend
and injects errors, hangs, extra latency and crashes around its executions,
deterministically for a given seed. The helpers check what a correct
application and engine guarantee under those faults: every request ended
exactly once ([`RequestLedger`][trioinfer.testing.RequestLedger],
[`assert_all_ended()`][trioinfer.testing.assert_all_ended]) and nothing was
left running ([`assert_no_tasks_left()`][trioinfer.testing.assert_no_tasks_left]).
"""

from __future__ import annotations

import functools
import math
import random
import reprlib
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, NoReturn, ParamSpec, TypeVar, final

import anyio
import anyio.lowlevel
import attrs
import numpy as np
import sniffio

from .._config import Device, ModelConfig, Placement
from .._engine import Engine, EngineStatistics
from .._exceptions import BackendError, TrioInferError
from .._registry import Registry
from .._runner import ModelStatistics
from .._tensors import ModelSignature
from ..abc import Backend, BackendInstance, PipelinedInstance
from ._fake import FakeBackend

P = ParamSpec("P")
T = TypeVar("T")
Arrays = Mapping[str, np.ndarray[Any, Any]]


@attrs.frozen
class FaultStatistics:
    """A snapshot of the faults a [`FaultyBackend`][trioinfer.testing.FaultyBackend] injected.

    Each call to ``execute`` counts once in `calls` and ends in exactly one of
    the other call counters, except a call cancelled during its extra latency,
    which counts in `calls` only.

    Attributes:
        calls: ``execute`` calls, faulty or not.
        forwarded: Calls passed on to the wrapped backend's instance.
        errors: Calls failed at random (``error_rate``).
        planned_errors: Calls failed because their number was in ``fail_on``.
        hangs: Calls that hung (``hang_rate`` or ``hang_on``) until cancelled.
        dead_calls: Calls refused because the instance had crashed (``crash_after``).
        added_latency: Extra seconds of latency injected, in all.
    """

    calls: int = 0
    forwarded: int = 0
    errors: int = 0
    planned_errors: int = 0
    hangs: int = 0
    dead_calls: int = 0
    added_latency: float = 0.0

    def __add__(self, other: FaultStatistics) -> FaultStatistics:
        return FaultStatistics(
            calls=self.calls + other.calls,
            forwarded=self.forwarded + other.forwarded,
            errors=self.errors + other.errors,
            planned_errors=self.planned_errors + other.planned_errors,
            hangs=self.hangs + other.hangs,
            dead_calls=self.dead_calls + other.dead_calls,
            added_latency=self.added_latency + other.added_latency,
        )


def _check_rate(name: str, value: float) -> float:
    if not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
        raise ValueError(f"{name} must be a probability between 0 and 1, got {value!r}")
    return float(value)


def _check_latency(value: float | tuple[float, float]) -> tuple[float, float]:
    low, high = value if isinstance(value, tuple) else (value, value)
    if not (0.0 <= low <= high < math.inf):
        raise ValueError(
            f"latency must be seconds >= 0 or a (low, high) range with low <= high, got {value!r}"
        )
    return float(low), float(high)


def _check_calls(name: str, value: Iterable[int]) -> frozenset[int]:
    calls = frozenset(value)
    if not all(isinstance(n, int) and n >= 1 for n in calls):
        raise ValueError(f"{name} must hold call numbers >= 1 (the first call is 1), got {value!r}")
    return calls


@final
class FaultyBackend:
    """A backend that injects faults around another backend's executions.

    Every ``load`` and ``execute`` goes through *inner* (by default a
    [`FakeBackend`][trioinfer.testing.FakeBackend], whose ``y = 2 * x`` model
    needs no file); each execution first meets its faults, in this order:

    1. A dead instance (one that ran ``crash_after`` calls) raises at once,
       with ``transient`` set to false: like a session whose process died, it
       never recovers.
    2. Extra *latency*, on the event loop's clock.
    3. A hang (``hang_rate``, or a call number in ``hang_on``): it waits until
       cancelled, as a wedged driver call would, and so tests the caller's
       deadlines. ``anyio.sleep_forever()`` respects cancellation, and on a
       ``MockClock`` the clock jumps to the next deadline.
    4. An error (``error_rate``, or a call number in ``fail_on``).
    5. Otherwise the wrapped instance's ``execute``.

    Faults are counted per instance (call numbers start at 1 on each instance)
    and drawn from one `random.Random` per instance, seeded with *seed*, the
    model's name, the device and the instance's index. The same seed therefore
    gives each instance the same sequence of faults whatever order instances
    load or run in; which requests meet them still depends on scheduling.

    With no fault configured it behaves exactly like *inner* and passes
    [`check_backend()`][trioinfer.testing.check_backend]. Faults are set here,
    in Python, not from ``ModelConfig.backend_options``: the config (options
    included) goes to *inner* unchanged, so an application's own config files
    work as they are.

    Args:
        inner: The backend to wrap; a new [`FakeBackend`][trioinfer.testing.FakeBackend]
            by default.
        seed: Makes the fault sequence reproducible.
        error_rate: Probability that a call fails.
        hang_rate: Probability that a call hangs; ``error_rate + hang_rate`` must
            not exceed 1, as each call meets at most one of the two.
        latency: Extra seconds before each call, or a ``(low, high)`` range drawn
            uniformly per call.
        crash_after: Calls an instance runs before it dies; ``None`` never.
        fail_on: Call numbers (1-based, per instance) that fail.
        hang_on: Call numbers (1-based, per instance) that hang.
        error: Makes the injected exception from a message: an exception class
            such as [`BackendError`][trioinfer.BackendError] (the default) or any
            callable.
        transient: The ``transient`` attribute set on errors from *error_rate*
            and *fail_on*, for retry logic to read.
        devices: Inject faults only into instances placed on these devices (as
            configured, e.g. ``["cuda:0"]``, so a "GPU" instance can fail on a
            machine without one); instances elsewhere forward every call.
            ``None``: every instance.

    Raises:
        ValueError: An option out of range.
    """

    def __init__(
        self,
        inner: Backend | None = None,
        *,
        seed: int | str = 0,
        error_rate: float = 0.0,
        hang_rate: float = 0.0,
        latency: float | tuple[float, float] = 0.0,
        crash_after: int | None = None,
        fail_on: Iterable[int] = (),
        hang_on: Iterable[int] = (),
        error: Callable[[str], Exception] = BackendError,
        transient: bool = True,
        devices: Iterable[str] | None = None,
    ) -> None:
        self.inner: Backend = inner if inner is not None else FakeBackend()
        self.seed = seed
        self.error_rate = _check_rate("error_rate", error_rate)
        self.hang_rate = _check_rate("hang_rate", hang_rate)
        if self.error_rate + self.hang_rate > 1.0:
            raise ValueError(
                f"error_rate + hang_rate must not exceed 1, got {error_rate} + {hang_rate}"
            )
        self.latency = _check_latency(latency)
        if crash_after is not None and not (isinstance(crash_after, int) and crash_after >= 0):
            raise ValueError(f"crash_after must be a call count >= 0 or None, got {crash_after!r}")
        self.crash_after = crash_after
        self.fail_on = _check_calls("fail_on", fail_on)
        self.hang_on = _check_calls("hang_on", hang_on)
        self.error = error
        self.transient = transient
        if isinstance(devices, str):
            # A string is an iterable of devices too: "cuda:0" said device 'c' is not one.
            raise TypeError(
                f"devices must be a list of device names, e.g. devices=[{devices!r}], "
                f"got the string {devices!r}"
            )
        self.devices = None if devices is None else frozenset(str(Device.parse(d)) for d in devices)
        #: Instances loaded so far, in load order.
        self.instances: list[FaultyInstance] = []

    def registry(self, name: str = "faulty") -> Registry:
        """A registry where this backend is the backend plugin called *name*.

        Name it as your models' ``backend`` (``"onnxruntime"``, say) to swap it
        in without touching their configs; other plugins resolve as usual.
        """
        return Registry(extra={"backends": {name: lambda: self}})

    def statistics(self) -> FaultStatistics:
        """The faults injected so far, summed over every instance."""
        return sum((i.statistics() for i in self.instances), FaultStatistics())

    async def load(self, config: ModelConfig, placement: Placement) -> FaultyInstance:
        """Load an instance of *inner* and wrap it."""
        inner = await self.inner.load(config, placement)
        key = f"{self.seed}/{config.name}/{placement.device}/{placement.index}"
        instance = FaultyInstance(self, inner, random.Random(key), key)
        if self.devices is not None and str(placement.device) not in self.devices:
            instance.healthy = True
        self.instances.append(instance)
        return instance


@final
class FaultyInstance:
    """An instance of [`FaultyBackend`][trioinfer.testing.FaultyBackend]; wraps one of *inner*'s.

    Attributes:
        inner: The wrapped instance.
        history: What each call met, in order: ``"ok"`` (forwarded), ``"error"``,
            ``"planned_error"``, ``"hang"`` or ``"dead"``; a call cancelled
            during its extra latency is ``"cancelled"``.
    """

    def __init__(
        self, backend: FaultyBackend, inner: BackendInstance, rng: random.Random, key: str
    ) -> None:
        self._backend = backend
        self.inner = inner
        self._rng = rng
        self._key = key
        self.history: list[str] = []
        self._added_latency = 0.0
        #: Set for instances outside ``devices``: they forward every call, untouched.
        self.healthy = False

    @property
    def signature(self) -> ModelSignature:
        """The wrapped instance's signature."""
        return self.inner.signature

    @property
    def device(self) -> str:
        """The wrapped instance's device."""
        return self.inner.device

    @property
    def pipeline_depth(self) -> int:
        """The wrapped instance's ``pipeline_depth`` (1 if it has none).

        Passed through so that the engine keeps as many executions in flight
        as it would on the wrapped instance.
        """
        depth = self.inner.pipeline_depth if isinstance(self.inner, PipelinedInstance) else 1
        return depth if isinstance(depth, int) and depth >= 1 else 1

    @property
    def dead(self) -> bool:
        """Whether the instance has crashed: it ran ``crash_after`` calls."""
        crash_after = self._backend.crash_after
        return not self.healthy and crash_after is not None and len(self.history) >= crash_after

    def statistics(self) -> FaultStatistics:
        """The faults this instance injected so far."""
        kinds = Counter(self.history)
        return FaultStatistics(
            calls=len(self.history),
            forwarded=kinds["ok"],
            errors=kinds["error"],
            planned_errors=kinds["planned_error"],
            hangs=kinds["hang"],
            dead_calls=kinds["dead"],
            added_latency=self._added_latency,
        )

    def _raise(self, what: str, number: int, transient: bool) -> NoReturn:
        error = self._backend.error(f"injected fault: {what} on call {number} of {self._key}")
        # A plain attribute, so that retry logic can tell a flaky failure from a dead one.
        error.__dict__["transient"] = transient
        raise error

    async def execute(self, inputs: Arrays) -> dict[str, np.ndarray[Any, Any]]:
        """Meet this call's faults, then forward it to the wrapped instance.

        The faults and their order are described on
        [`FaultyBackend`][trioinfer.testing.FaultyBackend].

        Raises:
            BackendError: Or what ``error`` makes: an injected error, or a dead instance.
        """
        if self.healthy:
            self.history.append("ok")
            return await self.inner.execute(inputs)
        backend = self._backend
        dead = self.dead
        number = len(self.history) + 1
        # Every call draws the same two numbers, so each call's faults depend only
        # on the seed and the call's number, not on which faults came before.
        fault = self._rng.random()
        low, high = backend.latency
        latency = low + self._rng.random() * (high - low)
        if dead:
            self.history.append("dead")
            self._raise("the instance has crashed", number, False)
        slot = len(self.history)
        self.history.append("cancelled")  # until the latency has passed
        if latency > 0:
            self._added_latency += latency
            await anyio.sleep(latency)
        if number in backend.hang_on or fault < backend.hang_rate:
            self.history[slot] = "hang"
            await anyio.sleep_forever()
        if number in backend.fail_on:
            self.history[slot] = "planned_error"
            self._raise("fail_on", number, backend.transient)
        if fault < backend.hang_rate + backend.error_rate:
            self.history[slot] = "error"
            self._raise("error_rate", number, backend.transient)
        self.history[slot] = "ok"
        return await self.inner.execute(inputs)

    async def aclose(self) -> None:
        """Close the wrapped instance (a crashed instance closes too)."""
        await self.inner.aclose()


# -- every request ended exactly once ------------------------------------------------------


def _fail(message: str) -> NoReturn:
    raise AssertionError(message)


def assert_all_ended(
    source: Engine | EngineStatistics | ModelStatistics, *, accepted: int | None = None
) -> None:
    """Check through the engine's counters that every accepted request has ended.

    No model may have a request queued or in flight. With *accepted*, the
    requests that ended (``succeeded + failed + cancelled + expired``, over all
    models) must add up to it exactly: fewer means some never ended, more means
    some ended twice. Requests refused at admission
    ([`QueueFull`][trioinfer.QueueFull], or a scheduler's refusal; counted in
    ``refused``) were never accepted, and neither were calls that failed before
    reaching a model's queue ([`ModelNotFound`][trioinfer.ModelNotFound],
    [`InvalidInput`][trioinfer.InvalidInput], a caller cancelled on the way in).

    Call it inside the engine's block, or pass a
    [`statistics()`][trioinfer.Engine.statistics] snapshot taken there: a closed
    engine (or an unloaded model) no longer reports its counters.

    Args:
        source: An engine, its statistics, or one model's statistics.
        accepted: How many requests the engine accepted, if the test knows.

    Raises:
        AssertionError: Naming the model and the counter that is off.
    """
    if isinstance(source, Engine):
        statistics = source.statistics()
        if source.closing and not statistics.models:
            _fail(
                "the engine has closed and no longer reports its counters; take "
                "engine.statistics() inside its block and pass that"
            )
        models = list(statistics.models.values())
    elif isinstance(source, EngineStatistics):
        models = list(source.models.values())
    else:
        models = [source]
    for stats in models:
        if stats.queued or stats.in_flight:
            _fail(
                f"model {stats.name!r} has requests that have not ended: queued {stats.queued}, "
                f"in_flight {stats.in_flight} (queued or running)"
            )
    if accepted is None:
        return
    ended = sum(s.succeeded + s.failed + s.cancelled + s.expired for s in models)
    if ended != accepted:
        parts = "; ".join(
            f"{s.name!r}: succeeded {s.succeeded} + failed {s.failed} + cancelled {s.cancelled} "
            f"+ expired {s.expired} (refused {s.refused}, not counted)"
            for s in models
        )
        why = "some never ended" if ended < accepted else "some ended more than once"
        _fail(f"{accepted} requests accepted but {ended} ended, so {why}: {parts or 'no models'}")


@attrs.frozen
class LedgerStatistics:
    """A snapshot of a [`RequestLedger`][trioinfer.testing.RequestLedger]'s outcomes.

    Attributes:
        calls: Calls started.
        pending: Calls started and not yet ended.
        succeeded: Calls that returned.
        cancelled: Calls that ended with the event loop's cancellation exception.
        errors: Calls that raised a [`TrioInferError`][trioinfer.TrioInferError],
            by class name.
        untyped: Calls that raised anything else, by class name.
    """

    calls: int
    pending: int
    succeeded: int
    cancelled: int
    errors: Mapping[str, int]
    untyped: Mapping[str, int]


@final
class RequestLedger:
    """Records, from the caller's side, how each call ended: once, and how.

    Wrap the function your application calls (``engine.infer``, or your own
    function around it) with [`wrap()`][trioinfer.testing.RequestLedger.wrap]
    and hand the wrapper to the code under test. Each call is entered when it
    starts and gets exactly one outcome when it returns or raises: a result,
    a typed error ([`TrioInferError`][trioinfer.TrioInferError]), cancellation,
    or an untyped exception. The wrapper returns and raises exactly what the
    wrapped function does, so the application behaves as it would without it.

    Then [`assert_all_ended()`][trioinfer.testing.RequestLedger.assert_all_ended]
    checks that no call is still pending (a hang, or a task left behind) and
    that none ended with an untyped exception.
    """

    def __init__(self) -> None:
        # What each pending call was, described only if it is reported: a repr of
        # the arguments (an Engine's runs to every request in flight) per call
        # would cost more than the calls themselves.
        self._pending: dict[int, tuple[Callable[..., object], tuple[Any, ...]]] = {}
        self._calls = 0
        self._succeeded = 0
        self._cancelled = 0
        self._errors: Counter[str] = Counter()
        self._untyped: Counter[str] = Counter()
        self._first_untyped: BaseException | None = None

    def wrap(self, fn: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
        """Return an async function that calls *fn* and records how each call ended."""

        @functools.wraps(fn)
        async def recorded(*args: P.args, **kwargs: P.kwargs) -> T:
            self._calls += 1
            number = self._calls
            self._pending[number] = (fn, args)
            cancelled = anyio.get_cancelled_exc_class()
            try:
                result = await fn(*args, **kwargs)
            except cancelled:
                self._end(number)
                self._cancelled += 1
                raise
            except TrioInferError as exc:
                self._end(number)
                self._errors[type(exc).__name__] += 1
                raise
            except BaseException as exc:
                self._end(number)
                self._untyped[type(exc).__name__] += 1
                if self._first_untyped is None:
                    self._first_untyped = exc
                raise
            self._end(number)
            self._succeeded += 1
            return result

        return recorded

    async def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Call ``fn(*args)`` through [`wrap()`][trioinfer.testing.RequestLedger.wrap]."""
        return await self.wrap(fn)(*args)

    def _end(self, number: int) -> None:
        # Through wrap() a call ends once by construction; this guards the ledger itself.
        if self._pending.pop(number, None) is None:
            _fail(f"call {number} ended twice")

    def statistics(self) -> LedgerStatistics:
        """A snapshot of the outcomes so far."""
        return LedgerStatistics(
            calls=self._calls,
            pending=len(self._pending),
            succeeded=self._succeeded,
            cancelled=self._cancelled,
            errors=dict(sorted(self._errors.items())),
            untyped=dict(sorted(self._untyped.items())),
        )

    def assert_all_ended(self) -> None:
        """Check that every call ended, with a result, a typed error or cancellation.

        Raises:
            AssertionError: Naming the calls still pending (at most ten), or the
                untyped exceptions (the first one chained as the cause).
        """
        if self._pending:
            shown = "; ".join(
                f"call {number}: {_describe(fn, args)}"
                for number, (fn, args) in list(self._pending.items())[:10]
            )
            more = len(self._pending) - 10
            _fail(
                f"{len(self._pending)} of {self._calls} calls never ended: {shown}"
                + (f"; and {more} more" if more > 0 else "")
            )
        if self._untyped:
            kinds = ", ".join(f"{name} x{n}" for name, n in sorted(self._untyped.items()))
            raise AssertionError(
                f"calls ended with errors outside TrioInferError: {kinds}"
            ) from self._first_untyped


def _describe(fn: Callable[..., object], args: tuple[Any, ...]) -> str:
    name = getattr(fn, "__qualname__", None) or repr(fn)
    short = reprlib.Repr()
    short.maxstring = short.maxother = 40  # Repr's keyword arguments are Python 3.12+
    return f"{name}({', '.join(short.repr(a) for a in args[:2])}{', ...' if len(args) > 2 else ''})"


# -- nothing left running ----------------------------------------------------------------


def _tasks() -> dict[object, str]:
    # The live tasks of the running event loop, with their names.
    if sniffio.current_async_library() == "trio":
        import trio

        def walk(task: trio.lowlevel.Task) -> Iterator[trio.lowlevel.Task]:
            yield task
            for nursery in task.child_nurseries:
                for child in nursery.child_tasks:
                    yield from walk(child)

        root = trio.lowlevel.current_root_task()
        assert root is not None  # we run inside trio.run
        return {task: task.name for task in walk(root)}
    import asyncio

    return {task: task.get_name() for task in asyncio.all_tasks() if not task.done()}


def _threads(prefix: str) -> dict[object, str]:
    return {t: t.name for t in threading.enumerate() if t.name.startswith(prefix) and t.is_alive()}


@contextmanager
def assert_no_tasks_left(*, thread_prefix: str = "trioinfer-") -> Iterator[None]:
    """Check that the block leaves no task and no worker thread running.

    Snapshots the event loop's tasks (Trio's task tree from the root task, or
    asyncio's running tasks) and the threads whose names start with
    *thread_prefix* (trioinfer's worker threads by default) on entry, and
    again when the block ends normally: anything new fails the check. Wrap the
    ``async with open_engine()`` block (and the nursery of your own tasks) in
    it; tasks started in a nursery that outlives the block, such as
    pytest-trio's ``nursery`` fixture, count as left.

    Raises:
        AssertionError: Naming what is left, at the end of a block that raised nothing.
    """
    tasks, threads = _tasks(), _threads(thread_prefix)
    yield  # if the block raises, its exception propagates from here: nothing to check
    left_tasks = sorted(name for task, name in _tasks().items() if task not in tasks)
    left_threads = sorted(
        name for thread, name in _threads(thread_prefix).items() if thread not in threads
    )
    if left_tasks or left_threads:
        _fail(
            f"left running after the block: {len(left_tasks)} tasks {left_tasks}, "
            f"{len(left_threads)} threads {left_threads}"
        )
