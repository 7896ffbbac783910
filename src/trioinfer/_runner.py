"""One model's request path: admission, scheduler, batcher, instance workers, completion.

A `ModelRunner` runs inside the engine's task group. It owns its
model's queue and one worker task per backend instance; each worker, when its
instance is free, asks the batcher for the next batch, drops requests whose
deadline passed, runs the batch through the fallback plugin on its instance,
and hands each caller its share of the outputs or an error.
"""

from __future__ import annotations

import bisect
import collections
import functools
import heapq
import itertools
import math
import sys
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, NoReturn, Protocol, cast, final

import anyio
import anyio.abc
import anyio.lowlevel
import attrs
import numpy as np
import sniffio
import trio.lowlevel

from ._buffers import BufferPool
from ._config import PIPELINE, ModelConfig
from ._dispatch import Execution, FallbackContext, Replica, ReplicaStatistics, logger
from ._exceptions import (
    BackendError,
    BackendUnavailable,
    CircuitOpen,
    ConfigError,
    DeadlineExceeded,
    EngineClosed,
    PluginContractError,
    QueueFull,
    TrioInferError,
)
from ._inline import DEFAULT_SLICE_S, inline_slice_spent, restart_inline_slice
from ._inline import _slice as _inline_slice
from ._model_tasks import ModelTasks, loading_for
from ._registry import Kind, missing_members, plugin_label
from ._request import Outputs, Request, make_request
from ._tensors import InputLimits, ModelSignature, OutputCheck, rows_validator
from ._tensors import rows as _rows
from ._threads import (
    WOKEN,
    BatchDeadlines,
    EventLike,
    LoopClock,
    _batch_deadline,
    native_event_factory,
    native_waiter_factory,
    trio_rescheduler,
)
from ._util import NoPublicConstructor, resume
from ._warmup import Warmup
from .abc import (
    AssemblingBatcher,
    AttachableBatcher,
    AttachableFallback,
    AttachableScheduler,
    Backend,
    BackendInstance,
    Batcher,
    BoundedBatcher,
    Fallback,
    PipelinedInstance,
    RecoveringFallback,
    RequestsInstance,
    Scheduler,
    SequenceBatcher,
    Split,
    Status,
    StreamingInstance,
    TunedInstance,
)
from .abc import Request as RequestView

if TYPE_CHECKING:
    from ._cache import CacheStatistics
    from ._tracing import Tracing

# Enum members read once: Status.X costs a metaclass lookup on every use (Python 3.11).
_DONE = Status.DONE
_QUEUED = Status.QUEUED
_RUNNING = Status.RUNNING

_INF = math.inf
# The frames that reschedule a task parked on Trio (Engine.infer's fast path)
# call the runner's own method (trio_rescheduler), which Trio does not protect
# from KeyboardInterrupt as it does its public function: they are protected.
_ki_protected = trio.lowlevel.enable_ki_protection

#: How long closing instances may take at shutdown before we stop waiting.
CLEANUP_S = 10.0


class _Held:
    """``request._state.batch`` of a queued request a batcher took and has not dispatched.

    One per call of a batcher's ``next_batch`` (`RequestQueue.new_call`): the
    requests lost with the call if it raises are those held at all; a request
    held by an earlier call, returned in a later batch, broke the batcher's
    contract (it holds no request from one call to the next).
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return "<held by the batcher>"


class _SchedulerBroke(Exception):
    """What the queue found wrong with its scheduler's answers (the scheduler raised nothing)."""


class _OwnScheduler(Protocol):
    # A scheduler as the engine holds it. By its contract a scheduler returns the
    # requests it was given, and only the engine gives it any: its own Request
    # class. Typed so, the request path needs no cast per request.
    def push(self, request: Request) -> None: ...
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove(self, request: Request) -> bool: ...
    def __len__(self) -> int: ...


@final
class _Emptied:
    # The scheduler of a model taken out of service (its own broke its contract): it
    # holds nothing, ever. The model refuses requests before they reach it.
    __slots__ = ()

    def push(self, request: Request) -> None:
        raise AssertionError("a model out of service admits no request")

    def peek(self) -> Request:
        raise IndexError

    def pop(self) -> Request:
        raise IndexError

    def remove(self, request: Request) -> bool:
        return False

    def __len__(self) -> int:
        return 0


class _OwnBatcher(Protocol):
    # A batcher as the engine holds it, for the same reason: it hands out what
    # it took from the engine's queue.
    async def next_batch(self, queue: RequestQueue) -> Sequence[Request]: ...


@final
class RequestQueue(metaclass=NoPublicConstructor):
    """A model's waiting requests: the engine's `trioinfer.abc.RequestQueue`.

    It hands out requests in the scheduler's order and fails those whose
    deadline passed instead of handing them out, so no batcher can send an
    expired request to a backend.
    """

    __slots__ = (
        "_current_time",
        "_front",
        "_held",
        "_held_by",
        "_levels",
        "_new_event",
        "_on_expired",
        "_on_fault",
        "_scheduler",
        "_wakeup",
        "batched",
        "preferred_batch_sizes",
        "taken",
        "uniform",
    )

    def __init__(
        self,
        scheduler: Scheduler,
        on_expired: Callable[[Request, float], object],
        batched: bool = True,
        preferred_batch_sizes: tuple[int, ...] = (),
        bounded_levels: tuple[int, ...] = (),
        uniform: bool = False,
        on_fault: Callable[[str, Exception], object] | None = None,
    ) -> None:
        self._scheduler = cast(_OwnScheduler, scheduler)
        # Told when the scheduler raises where its contract allows no error (the
        # runner takes the model out of service); None: the error propagates.
        self._on_fault = on_fault
        # Requests waiting per priority level, kept only for the levels with a bound
        # (a client may send any priority: counting every one would grow without end).
        self._levels: dict[int, int] | None = (
            dict.fromkeys(bounded_levels, 0) if bounded_levels else None
        )
        # Requests a batcher gave back: they were at the head, so they stay there,
        # ahead of the scheduler's order, without being admitted a second time.
        self._front: collections.deque[Request] = collections.deque()
        # Requests pushed into the scheduler and neither popped nor removed: what its
        # len() must say. Compared where the queue asks for its length or finds it
        # empty, so that a scheduler that loses requests (whose callers would wait
        # for ever) or hands one out twice is caught, not trusted.
        self._held = 0
        #: Whether the model has a batch dimension, so requests may share an execution.
        self.batched = batched
        #: Batch sizes the model's backend runs fastest, as its first instance
        #: advertises them (see `BackendInstance`); empty when it does not say.
        self.preferred_batch_sizes = preferred_batch_sizes
        #: Whether any two requests may share a batch as they are (the signature
        #: fixes every dtype and every dimension but the batch).
        self.uniform = uniform
        self._on_expired = on_expired
        self._current_time = LoopClock().current_time
        self._new_event = native_event_factory()
        self._wakeup: EventLike | None = None
        #: Requests handed out so far (a batch former that took none holds nothing).
        self.taken = 0
        # What the requests the batcher takes in its current call are marked with.
        self._held_by = _Held()

    # What each public method promises is written once, in trioinfer.abc.RequestQueue.

    def __len__(self) -> int:
        """Requests waiting (some may have expired and not yet been dropped)."""
        try:
            held = len(self._scheduler)
        except Exception as exc:
            self._scheduler_failed("__len__", exc)
            return len(self._front)
        if held != self._held:
            self._lost("__len__", f"len() is {held!r}")
            return len(self._front)
        return len(self._front) + held

    def holds_none(self) -> bool:
        """Whether no request waits, by the queue's own count (no call into the scheduler).

        For the hot path's "is the model idle?": a scheduler that broke its
        count is caught where the queue asks it (`__len__`, pops), not here.
        """
        return not self._held and not self._front

    def _scheduler_failed(self, method: str, exc: Exception) -> None:
        # The scheduler raised where its contract allows no error: which requests it
        # holds is unknown from here on. The runner takes the model out of service
        # (every queued request fails); this queue is empty from then on, and its
        # scheduler is never called again. Batchers see an empty queue, not the error.
        if self._on_fault is None:
            raise exc
        self._empty()
        self._on_fault(method, exc)

    def _lost(self, method: str, said: str) -> None:
        # The scheduler's answer disagrees with what it was given: requests pushed
        # and never handed back would leave their callers waiting for ever.
        self._scheduler_failed(
            method,
            _SchedulerBroke(
                f"{said}, but {self._held} requests were pushed into it and neither "
                "returned by pop() nor taken out by a remove() that returned True: it lost "
                "requests, or miscounts them"
            ),
        )

    def _handed_wrong(self, method: str, request: object) -> None:
        # pop() or peek() gave something that is not a request it holds: the same
        # request again (the queue would loop on it), one that ended, or no request.
        if not isinstance(request, Request):
            said = f"a {type(request).__name__!r} object, not a request pushed into it"
        elif request._state.status is _QUEUED:
            said = f"request {request.id!r}, which it had already returned"
        else:
            said = f"request {request.id!r}, which had already ended or been removed"
        self._scheduler_failed(method, _SchedulerBroke(f"{method}() returned {said}"))

    def _empty(self) -> None:
        # The model was taken out of service: nothing waits here any more.
        self._scheduler = _Emptied()
        self._held = 0
        self._front.clear()
        if self._levels is not None:
            self._levels = dict.fromkeys(self._levels, 0)

    def _waiting_at(self, priority: int) -> int:
        assert self._levels is not None
        return self._levels[priority]

    async def wait_not_empty(self) -> None:
        """Wait until at least one request is waiting."""
        while not len(self):
            if self._wakeup is None:
                self._wakeup = self._new_event()
            await self._wakeup.wait()

    def peek_nowait(self) -> Request:
        """Return the live request that `pop_nowait()` would take, failing expired ones."""
        front, scheduler = self._front, self._scheduler
        while True:
            if front:
                request = front[0]
            else:
                try:  # an empty scheduler raises IndexError (its contract): no len() first
                    request = scheduler.peek()
                except IndexError:
                    if self._held:
                        self._lost("peek", "peek() raised IndexError (empty)")
                    raise anyio.WouldBlock from None
                except Exception as exc:
                    self._scheduler_failed("peek", exc)
                    raise anyio.WouldBlock from None
                if (
                    request.__class__ is not Request
                    or request._state.status is not _QUEUED
                    or request._state.batch is not None
                ):
                    self._handed_wrong("peek", request)
                    raise anyio.WouldBlock from None
            deadline = request.deadline
            if deadline == _INF:
                return request
            now = self._current_time()
            if deadline > now:
                return request
            if front:
                front.popleft()
            else:
                try:
                    scheduler.pop()
                except Exception as exc:
                    self._scheduler_failed("pop", exc)
                    raise anyio.WouldBlock from None
                self._held -= 1
            if self._levels is not None and request.priority in self._levels:
                self._levels[request.priority] -= 1
            self._on_expired(request, now)

    def pop_nowait(self) -> Request:
        """Take the next live request in the scheduler's order, failing expired ones."""
        front, scheduler = self._front, self._scheduler
        while True:
            if front:
                request = front.popleft()
            else:
                try:
                    request = scheduler.pop()
                except IndexError:
                    if self._held:
                        self._lost("pop", "pop() raised IndexError (empty)")
                    raise anyio.WouldBlock from None
                except Exception as exc:
                    self._scheduler_failed("pop", exc)
                    raise anyio.WouldBlock from None
                self._held -= 1
                if (
                    request.__class__ is not Request
                    or request._state.status is not _QUEUED
                    or request._state.batch is not None
                ):
                    self._handed_wrong("pop", request)
                    raise anyio.WouldBlock from None
            request._state.batch = self._held_by  # (an expired one ends below: None again)
            self.taken += 1
            levels = self._levels
            if levels is not None and request.priority in levels:
                levels[request.priority] -= 1
            deadline = request.deadline
            if deadline == _INF:
                return request
            now = self._current_time()
            if deadline > now:
                return request
            self._on_expired(request, now)

    def take_nowait(self, max_rows: int) -> list[Request]:
        """Take live requests in order while their rows fit in *max_rows*, failing expired ones."""
        # peek_nowait() and pop_nowait() in one loop: a batch's worth of requests
        # in one call, the clock read once. The scheduler's requests are popped
        # without a peek first (one call each, not two): the one that does not
        # fit goes to the front, where a batcher's given-back requests wait.
        taken: list[Request] = []
        front, scheduler, levels = self._front, self._scheduler, self._levels
        holder = self._held_by
        now: float | None = None
        while True:
            if front:
                request = front.popleft()
            else:
                try:
                    request = scheduler.pop()
                except IndexError:
                    if self._held:  # what it took failed with the rest of the queue
                        self._lost("pop", "pop() raised IndexError (empty)")
                    break
                except Exception as exc:
                    self._scheduler_failed("pop", exc)
                    break  # what it took failed with the rest of the queue
                self._held -= 1
                if (
                    request.__class__ is not Request
                    or request._state.status is not _QUEUED
                    or request._state.batch is not None
                ):
                    self._handed_wrong("pop", request)
                    break  # what it took failed with the rest of the queue
            expired = False
            if request.deadline != _INF:
                if now is None:
                    now = self._current_time()
                expired = request.deadline <= now
            if not expired:
                rows = request.rows
                if rows > max_rows:
                    front.appendleft(request)  # it heads the next batch
                    break
                max_rows -= rows
                request._state.batch = holder
                taken.append(request)
            if levels is not None and request.priority in levels:
                levels[request.priority] -= 1
            if expired:
                assert now is not None
                self._on_expired(request, now)
        self.taken += len(taken)
        return taken

    def put_back(self, requests: Sequence[RequestView]) -> None:
        """Give back requests taken and not dispatched, to the head of the queue, in order."""
        # Only the engine makes requests, so any a batcher gives back is one of ours.
        back = [r for r in cast(Sequence[Request], requests) if r._state.status is _QUEUED]
        for r in back:
            r._state.batch = None  # no longer the batcher's
        self._front.extendleft(reversed(back))
        if self._levels is not None:
            for r in back:
                if r.priority in self._levels:
                    self._levels[r.priority] += 1
        if self._front and self._wakeup is not None:
            self._wakeup.set()
            self._wakeup = None

    def new_call(self) -> None:
        """A batcher's next call begins: what it takes is marked as that call's."""
        self._held_by = _Held()

    def _push(self, request: Request) -> None:
        # ModelRunner.admit does this in line: a change here belongs there too.
        self._scheduler.push(request)  # may raise: the caller (ModelRunner.call) sorts it out
        self._held += 1
        if self._levels is not None and request.priority in self._levels:
            self._levels[request.priority] += 1
        if self._wakeup is not None:
            self._wakeup.set()
            self._wakeup = None

    def _remove(self, request: Request) -> None:
        # The runner's callers look at the request's status again after this: a
        # scheduler that raised here has failed every queued request, this one too.
        try:
            removed = self._scheduler.remove(request)
        except Exception as exc:
            self._scheduler_failed("remove", exc)
            return
        if removed:
            self._held -= 1
        elif request in self._front:
            self._front.remove(request)  # at most a batch's worth: a short scan
            removed = True
        if removed and self._levels is not None and request.priority in self._levels:
            self._levels[request.priority] -= 1


@final
class SchedulerContext(metaclass=NoPublicConstructor):
    """What a scheduler may learn about its model: the engine's `trioinfer.abc.SchedulerContext`."""

    __slots__ = ("_runner",)

    def __init__(self, runner: ModelRunner) -> None:
        self._runner = runner

    @property
    def model(self) -> str:
        """The model's name."""
        return self._runner.config.name

    @property
    def instances(self) -> int:
        """How many instances execute this model's batches in parallel."""
        return len(self._runner.replicas)

    def execution_estimate(self) -> float:
        """A moving average of one execution's duration in seconds (0.0 before the first)."""
        return self._runner.mean_execution_s

    def current_time(self) -> float:
        """The engine's clock (the event loop's, so a MockClock in tests)."""
        return self._runner.clock.current_time()


class BatcherContext(metaclass=NoPublicConstructor):
    """What an attachable batcher learns of its model (`trioinfer.abc.BatcherContext`)."""

    __slots__ = ("_runner",)

    def __init__(self, runner: ModelRunner) -> None:
        self._runner = runner

    @property
    def model(self) -> str:
        """The model's name."""
        return self._runner.config.name

    @property
    def signature(self) -> ModelSignature:
        """The model's signature, as the backend reports it."""
        return self._runner.backend_signature


@final
class SequenceContext(BatcherContext):
    """What a sequence batcher learns of its model: the engine's `trioinfer.abc.SequenceContext`.

    Its ``signature`` is the full one, control and state inputs included (the
    backend's, as for any batcher).
    """

    __slots__ = ()

    @property
    def config(self) -> ModelConfig:
        """The model's configuration."""
        return self._runner.config

    def current_time(self) -> float:
        """The engine's clock (the event loop's, so a MockClock in tests)."""
        return self._runner.clock.current_time()

    def retry_after(self) -> float:
        """A guess at when the model could take a request refused now, in seconds."""
        return self._runner.retry_after()

    def fail(self, request: RequestView, error: Exception) -> None:
        """End *request*, held by the batcher, with *error* (nothing if it has ended)."""
        # Only the engine makes requests, so any a batcher holds is one of ours.
        self._runner.finish(cast(Request, request), error=error)


class _Pinned:
    # One worker's view of a sequence batcher: the plain batcher call its loop makes,
    # turned into next_batch_for(its replica, the batch it ran last). Only stateful
    # models have one, so the loop of every other model is unchanged.
    __slots__ = ("_batcher", "_previous", "_replica")

    def __init__(self, batcher: SequenceBatcher, replica: Replica) -> None:
        self._batcher = batcher
        self._replica = replica
        self._previous: Sequence[Request] = ()

    async def next_batch(self, queue: RequestQueue) -> Sequence[Request]:
        previous, self._previous = self._previous, ()
        batch = await self._batcher.next_batch_for(queue, self._replica, previous)
        self._previous = cast(Sequence[Request], batch)
        return self._previous


#: Upper bounds (seconds) of the duration histograms' buckets: 50 µs to 10 s.
DURATION_BUCKETS: tuple[float, ...] = (
    5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0,
)  # fmt: skip
#: Upper bounds of the batch-size histogram's buckets (rows per execution).
BATCH_BUCKETS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


@attrs.frozen
class Histogram:
    """A snapshot of a cumulative histogram, in the shape Prometheus exposes.

    Attributes:
        bounds: Each bucket's inclusive upper bound, ascending; a last bucket
            without bound (``+Inf``) is implied.
        counts: Observations per bucket, non-cumulative, one more than *bounds*
            (the last counts values above every bound).
        count: Observations in all.
        sum: The sum of every observed value.
    """

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    count: int
    sum: float


@final
class _Histogram:
    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += n
        self.count += n
        self.sum += value * n

    def observe_each(self, values: Sequence[float]) -> None:
        # A batch's worth in one call: one per request would cost a call each.
        if not values:
            return
        counts, bounds, bisect_left = self.counts, self.bounds, bisect.bisect_left
        low = bisect_left(bounds, min(values))
        if low == bisect_left(bounds, max(values)):
            # A batch's requests waited alike: most often all in one bucket.
            counts[low] += len(values)
        else:
            for value in values:
                counts[bisect_left(bounds, value)] += 1
        self.count += len(values)
        self.sum += sum(values)

    def snapshot(self, more: _Histogram | None = None, zeros: int = 0) -> Histogram:
        # With *more* (of the same bounds) added in, and *zeros* observations of 0.0.
        counts = self.counts
        count, total = self.count + zeros, self.sum
        if more is not None and more.count:
            counts = [a + b for a, b in zip(counts, more.counts, strict=True)]
            count, total = count + more.count, total + more.sum
        if zeros:
            counts = [counts[0] + zeros, *counts[1:]]
        return Histogram(self.bounds, tuple(counts), count, total)


@attrs.frozen
class ModelStatistics:
    """A snapshot of one model's counters; see [`Engine.statistics()`][trioinfer.Engine.statistics].

    Attributes:
        name: The model.
        devices: Where each instance really runs.
        queued: Requests waiting now.
        in_flight: Requests accepted and not yet ended (queued or running).
        succeeded: Requests that got outputs.
        inferences: Rows of the requests that got outputs (one for a request
            without a batch dimension): Triton's ``inference_count``, which counts
            neither failed nor retried attempts.
        failed: Requests that ended with an error other than expiry (backend, shutdown).
        cancelled: Requests whose caller gave up before they ended.
        refused: Requests refused at admission: the queue was full, or the scheduler
            refused them (a deadline it could not meet).
        expired: Requests the engine dropped because their deadline passed before
            they ran, noticed before the caller's own scope fired (when the scope
            fires first, the request counts as cancelled).
        executions: Backend executions (batches) started, failed and aborted
            ones included.
        successful_executions: Executions whose outputs went to their requests
            (a failed run, a retried attempt that failed, an execution whose
            callers all left before it ended, aborted or not, or outputs that
            could not be split among the batch's requests do not count):
            Triton's ``execution_count``.
        mean_execution_s: Moving average of a batch's execution time.
        buffers_allocated: Batch input buffers allocated so far; flat in steady
            state, because batches reuse pooled buffers.
        buffers_reused: Batches' input buffers served from the pool.
        queue_duration: Seconds each request that reached an instance waited in
            the queue (arrival to the start of its execution).
        compute_duration: Seconds of execution each request that reached an
            instance took part in (its batch's execution time, failed runs included).
        request_duration: Seconds from arrival to outputs, for each request that succeeded.
        batch_size: Rows per execution.
        replicas: Each loaded instance's state and counters.
        fallbacks: Requests that took each kind of fallback step, by the step's
            first word (``"retry"``, ``"failover"``, ``"hedge"``, ``"model"``,
            ``"default"``; see [`Execution.note()`][trioinfer.lowlevel.Execution.note]).
        cache: The model's use of the response cache, or ``None`` when it has
            ``response_cache`` off. Hits and coalesced requests are counted
            there only: they never reach the model's queue.
        out_of_service: Why the model serves no more, or ``None`` while it does:
            one of its plugins broke its contract so that its state cannot be
            trusted (a scheduler that raised, a batcher that failed twice in a
            row). Its queued requests failed, and every later one is refused
            with a [`PluginContractError`][trioinfer.PluginContractError] saying
            this, until the model is loaded again.
    """

    name: str
    devices: tuple[str, ...]
    queued: int
    in_flight: int
    succeeded: int
    failed: int
    cancelled: int
    refused: int
    expired: int
    executions: int
    mean_execution_s: float
    buffers_allocated: int
    buffers_reused: int
    queue_duration: Histogram
    compute_duration: Histogram
    request_duration: Histogram
    batch_size: Histogram
    replicas: tuple[ReplicaStatistics, ...] = ()
    fallbacks: Mapping[str, int] = attrs.field(factory=dict)
    cache: CacheStatistics | None = None
    inferences: int = 0
    out_of_service: str | None = None
    successful_executions: int = 0


@final
class _Turns:
    """Which free instance forms the next batch: the highest capacity, then the longest idle.

    A lock whose waiters are served by capacity, so that when a GPU and a CPU
    instance are both free, the GPU takes the work.
    """

    __slots__ = ("_busy", "_holder", "_new_event", "_numbers", "_queue", "_waiting")

    def __init__(self, new_event: Callable[[], EventLike], queue: RequestQueue) -> None:
        self._new_event = new_event
        self._queue = queue
        self._busy = False
        self._waiting: list[list[Any]] = []  # heap of [-capacity, number, event, granted]
        self._numbers = itertools.count()
        # The instance forming a batch now: its capacity, forming scope, queue.taken
        # then, and its replica.
        self._holder: tuple[float, anyio.CancelScope, int, Replica | None] | None = None

    async def form(
        self,
        capacity: float,
        batcher: _OwnBatcher,
        in_line: Callable[[], object] | None = None,
        replica: Replica | None = None,
    ) -> Sequence[Request] | None:
        """Wait for this instance's turn, then form a batch; None if a bigger one took over.

        *in_line* is called once this instance holds the turn or waits for it.
        """
        await self._acquire(capacity, in_line)
        if replica is not None and not replica.serving:
            self.release()  # taken out while in line: let a serving instance form
            return None
        try:
            with anyio.CancelScope() as scope:
                self._holder = (capacity, scope, self._queue.taken, replica)
                self._queue.new_call()
                return await batcher.next_batch(self._queue)
            return None
        finally:
            self._holder = None
            self.release()

    async def _acquire(self, capacity: float, in_line: Callable[[], object] | None) -> None:
        if not self._busy:
            self._busy = True
            if in_line is not None:
                in_line()
            return
        holder = self._holder
        if holder is not None and holder[0] < capacity and holder[2] == self._queue.taken:
            # A smaller instance waits for work and holds no request yet: take over.
            holder[1].cancel()
        entry: list[Any] = [-capacity, next(self._numbers), self._new_event(), False]
        heapq.heappush(self._waiting, entry)
        if in_line is not None:
            in_line()
        try:
            await entry[2].wait()
        except anyio.get_cancelled_exc_class():
            if entry[3]:
                self.release()  # the turn came as we were cancelled: pass it on
            else:
                entry[2] = None  # dropped from the heap when it reaches the top
            raise

    def cancel_forming(self, replica: Replica) -> None:
        """Stop *replica* forming a batch if it is, giving back what it took."""
        holder = self._holder
        if holder is not None and holder[3] is replica:
            holder[1].cancel()

    def release(self) -> None:
        while self._waiting:
            entry = heapq.heappop(self._waiting)
            if entry[2] is not None:
                entry[3] = True
                entry[2].set()
                return  # the turn passes on; still busy
        self._busy = False


@final
class _Cost:
    """How long an execution of n rows takes: a + b * n, from recent executions.

    An exponentially weighted least-squares fit, so that a large request
    running now is judged by its size, not by the small ones around it.
    Also the usual rows and requests per execution, for the queue ahead.
    """

    __slots__ = ("_n", "_x", "_xx", "_xy", "_y", "requests")

    #: Weight of past executions against each new one.
    DECAY = 0.9
    #: What an execution is assumed to take before any was measured: a guess
    #: that does not invite a busy retry.
    FIRST_GUESS_S = 0.01

    def __init__(self) -> None:
        self._n = self._x = self._xx = self._xy = self._y = 0.0
        self.requests = 1.0

    def observe(self, rows: int, requests: int, seconds: float) -> None:
        d = self.DECAY
        self._n = self._n * d + 1.0
        self._x = self._x * d + rows
        self._y = self._y * d + seconds
        self._xx = self._xx * d + rows * rows
        self._xy = self._xy * d + rows * seconds
        self.requests += 0.2 * (requests - self.requests)

    @property
    def rows(self) -> float:
        """The usual rows per execution."""
        return self._x / self._n if self._n else 1.0

    def estimate(self, rows: float) -> float:
        """Seconds an execution of *rows* rows is expected to take."""
        n = self._n
        if not n:
            return self.FIRST_GUESS_S
        mean_x, mean_y = self._x / n, self._y / n
        spread = self._xx / n - mean_x * mean_x
        if spread <= 1e-9 * max(mean_x * mean_x, 1.0):
            # Every execution had the same rows: take the time as proportional.
            return mean_y * max(rows, 1.0) / max(mean_x, 1.0)
        slope = max((self._xy / n - mean_x * mean_y) / spread, 0.0)
        return max(mean_y + slope * (rows - mean_x), 0.0)


class _Running:
    # One executing batch: the scope it runs in, and how many of its callers still wait.
    __slots__ = ("scope", "waiting")

    def __init__(self, scope: anyio.CancelScope, waiting: int) -> None:
        self.scope = scope
        self.waiting = waiting


@final
@attrs.frozen(slots=True)
class Unfinished:
    """An execution `ModelRunner.run_now` started and could not end: see `finish_here`."""

    replica: Replica
    inputs: Mapping[str, np.ndarray[Any, Any]]
    rows: int
    deadline: float
    now: float
    #: The execution, suspended after all, and what it yielded there.
    begun: tuple[Coroutine[Any, Any, Outputs], Any] | None
    #: What the execution raised.
    error: Exception | None
    #: The outputs it was asked for alone (`run_now`'s *wanted*); empty: all.
    wanted: tuple[str, ...] = ()


@final
@attrs.define(eq=False)
class ModelRunner(metaclass=NoPublicConstructor):
    """The tasks and state that serve one loaded model. Created by the engine only.

    It is the `trioinfer._dispatch.RunnerPort` of its executions and fallback
    context: they reach it through that Protocol's names alone.
    """

    config: ModelConfig
    _scheduler: Scheduler = attrs.field(alias="scheduler")
    _batcher: Batcher = attrs.field(alias="batcher")
    _fallback: Fallback = attrs.field(alias="fallback")
    _instances: list[BackendInstance] = attrs.field(alias="instances")
    #: The backend plugin, for re-creating an instance.
    _backend: Backend | None = attrs.field(default=None, alias="backend")
    # The model's task group (current_model_tasks), ended once its instances closed.
    _tasks: ModelTasks | None = attrs.field(default=None, alias="tasks")
    #: Runs a request on another model (set by the engine), for fallbacks.
    _elsewhere: Callable[[str, Request], Awaitable[Request]] | None = attrs.field(
        default=None, alias="infer_elsewhere"
    )
    #: OpenTelemetry spans (trioinfer._tracing), None when tracing is off.
    tracing: Tracing | None = attrs.field(default=None)
    #: The distribution that declared each plugin, by kind ("schedulers"...), for the
    #: errors that say a plugin broke its contract; None (or absent) if not known.
    sources: Mapping[str, str | None] = attrs.field(factory=dict)
    replicas: list[Replica] = attrs.field(init=False)
    _biggest_first: list[Replica] = attrs.field(init=False)
    queue: RequestQueue = attrs.field(init=False)
    signature: ModelSignature = attrs.field(init=False)
    #: The signature the backend reports: ``signature`` plus a stateful model's
    #: control and state tensors, which its sequence batcher fills.
    backend_signature: ModelSignature = attrs.field(init=False)
    #: The backend's outputs (names, dtypes, ranks, fixed sizes), as every execution
    #: must return them. None for a pipeline, whose graph answers its requests itself
    #: (its steps' models checked theirs) and returns nothing when nobody is left.
    _output_check: OutputCheck | None = attrs.field(init=False)
    _sequencer: SequenceBatcher | None = attrs.field(default=None, init=False)
    input_limits: InputLimits = attrs.field(init=False)
    validate: Callable[[object], tuple[dict[str, Any], int]] = attrs.field(init=False)
    queue_timeouts: Mapping[int, float] = attrs.field(init=False)
    #: Whether a request's way here is the plain one, which `Engine.infer` takes
    #: in one frame: no response cache, no sequences, no queue policy deadlines.
    plain: bool = attrs.field(init=False)
    batched: bool = attrs.field(init=False)
    _new_event: Callable[[], EventLike] = attrs.field(init=False)
    _new_waiter: Callable[[], EventLike] = attrs.field(init=False)
    #: Whether it runs on Trio, where Engine.infer's fast path parks the caller's
    #: task in its request (``_State.task``) rather than on a waiter.
    on_trio: bool = attrs.field(init=False)
    clock: LoopClock = attrs.field(init=False)
    _assemble: Callable[[Sequence[Request]], tuple[Mapping[str, Any], Split]] | None = attrs.field(
        init=False
    )
    _pool: BufferPool = attrs.field(init=False)
    #: Whether its instances take an execution's requests as they came (RequestsInstance).
    _per_request: bool = attrs.field(default=False, init=False)
    #: Its sequence batcher's computed(), for RequestsInstance models (see load).
    _computed: Callable[[Sequence[Request]], object] | None = attrs.field(default=None, init=False)
    _sets_differ: bool = attrs.field(default=False, init=False)
    _scope: anyio.CancelScope = attrs.field(factory=anyio.CancelScope, init=False)
    _finished: anyio.Event = attrs.field(factory=anyio.Event, init=False)
    _idle: anyio.Event | None = attrs.field(default=None, init=False)
    # A decoupled model's open streams, ended at close: waited for before its
    # instances close, so that no generator runs on a closed model (the StreamGate's).
    streams_closed: Callable[[], Awaitable[None]] | None = attrs.field(default=None, init=False)
    # fast_acquire: an uncontended acquire need not yield to the scheduler, which
    # would cost a whole scheduling pass per batch.
    _device_limits: Mapping[str, anyio.CapacityLimiter] = attrs.field(
        factory=dict, alias="device_limits"
    )
    _turns: _Turns = attrs.field(init=False)
    _in_flight: set[Request] = attrs.field(factory=set, init=False)
    succeeded: int = attrs.field(default=0, init=False)
    inferences: int = attrs.field(default=0, init=False)
    failed: int = attrs.field(default=0, init=False)
    cancelled: int = attrs.field(default=0, init=False)
    refused: int = attrs.field(default=0, init=False)
    expired: int = attrs.field(default=0, init=False)
    executions: int = attrs.field(default=0, init=False)
    # Executions whose outputs went to their requests (Triton's execution_count);
    # with those in _answered_here.
    successful_executions: int = attrs.field(default=0, init=False)
    _mean_execution_s: float = attrs.field(default=0.0, init=False)
    _cost: _Cost = attrs.field(factory=lambda: _Cost(), init=False)
    # (replica, start, rows, its callers' latest deadline) of each execution in
    # progress, for retry_after.
    _executing: list[tuple[Replica, float, int, float]] = attrs.field(factory=list, init=False)
    fallbacks: dict[str, int] = attrs.field(factory=dict, init=False)
    _serving: int = attrs.field(default=0, init=False)
    #: Why the model is out of service (a plugin broke its contract so that its
    #: state cannot be trusted), or None: every request is refused with it.
    _fault: PluginContractError | None = attrs.field(default=None, init=False)
    # next_batch() failures since a batch was last formed (see _batcher_failed).
    _batcher_faults: int = attrs.field(default=0, init=False)
    _task_group: anyio.abc.TaskGroup | None = attrs.field(default=None, init=False)
    _queue_duration: _Histogram = attrs.field(
        factory=lambda: _Histogram(DURATION_BUCKETS), init=False
    )
    _compute_duration: _Histogram = attrs.field(
        factory=lambda: _Histogram(DURATION_BUCKETS), init=False
    )
    _request_duration: _Histogram = attrs.field(
        factory=lambda: _Histogram(DURATION_BUCKETS), init=False
    )
    _batch_size: _Histogram = attrs.field(factory=lambda: _Histogram(BATCH_BUCKETS), init=False)
    # The durations of executions run in their callers' tasks that answered (see
    # run_here): counted in the queue (as 0.0), compute and request histograms
    # and the executions when statistics() reads them.
    _answered_here: _Histogram = attrs.field(
        factory=lambda: _Histogram(DURATION_BUCKETS), init=False
    )
    #: Whether a request may run in its caller's task when an instance is idle
    #: (`idle_replica`, `run_alone`): its scheduler, batcher and fallback would
    #: pass a lone request straight through.
    alone_ok: bool = attrs.field(default=False, init=False)
    # Executions running in their callers' tasks now, and who waits for them to end.
    _alone: int = attrs.field(default=0, init=False)
    _alone_ended: EventLike | None = attrs.field(default=None, init=False)
    #: Their cancel scopes: stopping the model aborts them as it aborts the workers'.
    _alone_scopes: set[anyio.CancelScope | trio.CancelScope] = attrs.field(factory=set, init=False)

    def __attrs_post_init__(self) -> None:
        self._new_event = native_event_factory()
        self._new_waiter = native_waiter_factory()
        self.on_trio = sniffio.current_async_library() == "trio"
        self.clock = LoopClock()
        self.replicas = [
            Replica._create(instance, placement, _depth(instance), self._new_event)
            for instance, placement in zip(self._instances, self.config.placements(), strict=True)
        ]
        self._serving = len(self.replicas)
        # The order idle_replica looks in: the biggest first, as the workers take work.
        self._biggest_first = sorted(self.replicas, key=lambda r: -r.capacity)
        self.signature = self.backend_signature = self._instances[0].signature
        self._output_check = (
            None
            if self.config.backend == PIPELINE
            else OutputCheck.for_instances(self.config.name, self.signature, self._instances)
        )
        self.batched = self.signature.batched
        if not self.batched and self.config.batcher != "none":
            logger.warning(
                "model %r: the %r batcher will not group requests, each runs alone: %s",
                self.config.name,
                self.config.batcher,
                self.signature.unbatched_reason,
            )
        self.queue = RequestQueue._create(
            self._scheduler,
            self._expire,
            self.batched,
            _preferred(self._instances[0], self.config.name),
            bounded_levels=tuple(self.config.queue_sizes),
            on_fault=self._scheduler_failed,
        )
        self._turns = _Turns(self._new_event, self.queue)
        # The optional hooks (see trioinfer.abc), looked for once, at load.
        batcher = self._batcher
        self._assemble = batcher.assemble if isinstance(batcher, AssemblingBatcher) else None
        self._per_request = isinstance(self._instances[0], RequestsInstance)
        sequence = self.config.sequence
        if self._per_request and self._assemble is not None:
            if sequence is None or not isinstance(batcher, SequenceBatcher):
                # The batcher would lay out inputs that execute_requests never reads.
                raise ConfigError(
                    f"model {self.config.name!r}: its {self.config.backend!r} instances take "
                    f"each request's own inputs, which the {self.config.batcher!r} batcher "
                    "would lay out itself; choose another batcher"
                )
            if sequence.state:
                # The state is fed back from the batch's outputs, which such an instance
                # does not give (each request answers for itself).
                raise ConfigError(
                    f"model {self.config.name!r}: its {self.config.backend!r} instances take "
                    "each request's own inputs and answer each on its own, so the sequence "
                    "batcher has no batch outputs to keep implicit state from: remove "
                    "sequence.state (the model keeps its own state per sequence id)"
                )
            # Told which requests were computed without laying out their inputs, if
            # it can be (see trioinfer.abc.SequenceBatcher); else through assemble.
            computed = getattr(batcher, "computed", None)
            self._computed = computed if callable(computed) else None
        # Enough buffers for every instance to run a batch while the next is formed.
        self._pool = BufferPool(per_key=len(self._instances) + 1)
        if isinstance(self._scheduler, AttachableScheduler):
            self._attach("schedulers", self._scheduler.attach, SchedulerContext._create(self))
        if isinstance(self._fallback, AttachableFallback):
            self._attach("fallbacks", self._fallback.attach, FallbackContext._create(self))
        if self.config.sequence is not None:
            self._attach_sequencer(
                self.config.sequence.hidden_inputs, self.config.sequence.hidden_outputs
            )
        elif isinstance(self._batcher, SequenceBatcher):
            # Refused here, at load: its workers would call next_batch(), which a sequence
            # batcher refuses, and that broken contract would stop the engine (over HTTP, a
            # load override {"batcher": "sequence"} took the whole server down).
            raise ConfigError(
                f"model {self.config.name!r}: batcher {self.config.batcher!r} keeps sequences "
                "and needs a [sequence] table (its strategy, control inputs and state; "
                "SequenceConfig in Python); add one, or choose another batcher"
            )
        elif isinstance(self._batcher, AttachableBatcher):
            # Its options checked against the model (padding an axis the model fixes, say).
            self._attach("batchers", self._batcher.attach, BatcherContext._create(self))
        # Every request admitted passes validate_inputs against this signature, so
        # when it fixes every dtype and non-batch dimension, they all agree on them.
        self.queue.uniform = self.signature._fixed is not None
        # Requests may send different sets of inputs (some optional ones left out):
        # a batch is checked to hold one set before its inputs are concatenated.
        self._sets_differ = self.signature._required_names != self.signature._input_names
        self.input_limits = self.config.input_limits
        #: validate_rows() for this model's requests, bound once.
        self.validate = rows_validator(
            self.config.name, self.signature, self.input_limits, self.batched
        )
        self.queue_timeouts = self.config.queue_timeouts
        self.plain = not (
            self.config.response_cache or self.config.sequence is not None or self.queue_timeouts
        )
        self.alone_ok = self.plain and _passes_alone(self._scheduler, self._batcher, self._fallback)

    @property
    def max_batch_size(self) -> int | None:
        """Most rows one batch holds, as its batcher says; None where nothing says.

        The batcher's `BoundedBatcher.max_batch_size` (the dynamic batcher's, which
        config.pbtxt's sets; a stateful model's ``sequence.max_batch_size``).
        """
        if not self.batched or not isinstance(self._batcher, BoundedBatcher):
            return None
        most = self._batcher.max_batch_size
        # A bound that is no positive whole number bounds nothing it could mean.
        return most if type(most) is int and most > 0 else None

    def _attach_sequencer(self, inputs: frozenset[str], outputs: frozenset[str]) -> None:
        # A stateful model: its batcher must keep sequences, and callers neither send
        # the inputs it fills nor receive the state it feeds back.
        batcher = self._batcher
        if not isinstance(batcher, SequenceBatcher):
            raise ConfigError(
                f"model {self.config.name!r} has a [sequence] table, but its batcher "
                f"{self.config.batcher!r} is not a sequence batcher; set batcher = 'sequence'"
            )
        self._sequencer = batcher
        full = self.backend_signature
        self.signature = ModelSignature(
            tuple(spec for spec in full.inputs if spec.name not in inputs),
            tuple(spec for spec in full.outputs if spec.name not in outputs),
        )
        self._attach("batchers", batcher.attach, SequenceContext._create(self))

    def _attach(self, kind: Kind, attach: Callable[[Any], object], context: object) -> None:
        # A plugin's attach() at load: it may refuse the model (a TrioInferError, a
        # ConfigError most often); anything else it raises is a broken contract.
        try:
            attach(context)
        except TrioInferError:
            raise
        except Exception as exc:
            raise self._broken(kind, f"raised {type(exc).__name__} in attach(): {exc}") from exc

    @property
    def devices(self) -> tuple[str, ...]:
        """Where each instance really runs."""
        return tuple(replica.device for replica in self.replicas)

    @property
    def preferred_batch_sizes(self) -> tuple[int, ...]:
        """The batch sizes the model's backend says it runs fastest (empty if it does not)."""
        return self.queue.preferred_batch_sizes

    @property
    def mean_execution_s(self) -> float:
        """A moving average of one execution's duration in seconds (0.0 before the first)."""
        return self._mean_execution_s

    @property
    def out_of_service(self) -> str | None:
        """Why the model answers nothing (a plugin broke its contract), or None while it serves."""
        return None if self._fault is None else str(self._fault)

    @property
    def unavailable(self) -> str | None:
        """Why no instance serves the model now (it is not ready), or None while one does.

        `out_of_service`, or every instance out: taken out of service by a
        fallback (a breaker's, until it is back), or gone (its backend instance
        says it can serve no more: a Ray actor that died), where requests fail.
        """
        if self._fault is not None:
            return str(self._fault)
        reasons = []
        for replica in self.replicas:
            gone = replica.gone
            if replica.serving and gone is None:
                return None
            why = f"gone: {gone}" if replica.serving else replica.reason
            reasons.append(f"{replica.label}: {why}")
        return f"no instance of model {self.config.name!r} serves it ({'; '.join(reasons)})"

    # -- the tasks ---------------------------------------------------------------

    async def run(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """Run the instance workers until cancelled; then fail what is left and close."""
        try:
            with self._scope:
                async with anyio.create_task_group() as tg:
                    self._task_group = tg
                    # Biggest first, each in line before the next starts, so that
                    # the first requests already go to the biggest free instance.
                    for replica in sorted(self.replicas, key=lambda r: -r.capacity):
                        for _ in range(_depth(replica._backend_instance)):
                            await tg.start(self._worker, replica)
                    task_status.started()
        finally:
            for request in list(self._in_flight):
                self.finish(
                    request,
                    error=EngineClosed(
                        f"model {self.config.name!r} was unloaded or the engine closed "
                        f"before request {request.id!r} ended"
                    ),
                )
            self._task_group = None
            for scope in self._alone_scopes:
                scope.cancel()  # their requests ended above (EngineClosed)
            if self.streams_closed is not None:
                with anyio.move_on_after(CLEANUP_S, shield=True):
                    await self.streams_closed()
            await self._wait_alone()
            await close_instances(
                self.config.name, [replica._backend_instance for replica in self.replicas]
            )
            if self._tasks is not None:
                await self._tasks.aclose(CLEANUP_S)
            self._finished.set()

    async def _worker(
        self,
        replica: Replica,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        alone = sum(map(_depth, self._instances)) == 1
        batcher = cast(_OwnBatcher, self._batcher)
        # Each call's takings marked as its own, but a sequence batcher's: it holds the
        # requests of its sequences from one call to the next (its contract), and each
        # instance's worker calls it at once.
        new_call: Callable[[], None] | None = self.queue.new_call
        if self._sequencer is not None:
            # Each instance forms its own batches: its sequences' requests are its alone.
            alone, batcher = True, _Pinned(self._sequencer, replica)
            new_call = None
        capacity = replica.capacity
        in_line: Callable[[], object] | None = task_status.started
        if alone:
            task_status.started()
            in_line = None
        while True:
            # One scope serves many executions; it is replaced only after an abort,
            # which saves a scope per execution on the hot path.
            with anyio.CancelScope() as scope:
                while True:
                    if replica._back is not None or (
                        replica._mortal and not self._in_rotation(replica)
                    ):
                        assert replica._back is not None  # (set whenever it is out)
                        await replica._back.wait()  # out of service: wait to be put back
                        continue
                    # The last batch is dropped before waiting for the next: its requests
                    # hold their inputs, which may be views of a client's shared memory
                    # that must be unmapped once unregistered, not when traffic resumes.
                    batch = formed = None
                    try:
                        if alone:
                            if new_call is not None:
                                new_call()
                            batch = await batcher.next_batch(self.queue)
                        else:
                            # One free instance forms a batch at a time, the biggest first.
                            formed = await self._turns.form(capacity, batcher, in_line, replica)
                            in_line = None
                            if formed is None:
                                continue
                            batch, formed = formed, None
                    except Exception as exc:
                        # What it had taken fails with it; the engine and the model go on.
                        await self._batcher_failed(_raised(exc, "next_batch()"), exc)
                        continue
                    try:  # (one per batch: free in CPython 3.11 when nothing raises)
                        if not batch:
                            await self._batcher_failed("returned an empty batch", None)
                            continue
                        if replica._back is not None or (
                            replica._mortal and not self._in_rotation(replica)
                        ):
                            # Taken out (or found gone) while forming: the batch goes to a
                            # serving replica, unsent. Not a sequence batcher's: its
                            # sequences are this instance's (and the queue is not where
                            # it looks for requests): they fail, ending their sequences.
                            if self._sequencer is not None:
                                self._out_of_sequence(replica, batch)
                                continue
                            self.queue.put_back(batch)
                            if not self._serving:
                                self._refuse_queued()
                            continue
                        await self._execute(replica, batch, scope)
                    except Exception as exc:
                        # Something that is no batch of its queue's requests: the
                        # batcher's fault, which must not end the worker.
                        wrong = _not_a_batch(batch)
                        if wrong is None:
                            raise  # the engine's own bug: let it be seen
                        await self._batcher_failed(f"returned {wrong}", exc, batch)

    def _out_of_sequence(self, replica: Replica, batch: Sequence[Request]) -> None:
        # A sequence batcher's batch formed on *replica* as it was taken out: no other
        # instance holds its sequences' state, so its requests fail; the batcher, told
        # that they were not computed, ends their sequences.
        for request in batch:
            self.finish(
                request,
                error=BackendUnavailable(
                    f"{replica.label} of model {self.config.name!r}, which holds the sequence "
                    f"of request {request.id!r}, is out of service ({replica.reason}); start "
                    "a new sequence with sequence_start"
                ),
            )

    async def _batcher_failed(self, what: str, exc: Exception | None, batch: object = ()) -> None:
        """A batcher failed to form a batch: fail what it held, and maybe the model.

        The requests it took from the queue and had not dispatched nor given back
        fail with a `PluginContractError` naming it; the model goes on with its next
        batch. A batcher that fails again with no batch formed in between (or whose
        model is out of service already) cannot be trusted: the model is taken out
        of service. Either way the worker checkpoints, so that a batcher failing at
        once cannot keep the event loop. Requests of *batch* (what it returned, if
        anything) that were marked running fail too.
        """
        error = self._fault
        if error is None:
            self._batcher_faults += 1
            if self._batcher_faults > 1:
                what += "; it failed again with no batch formed since, so it cannot be trusted"
                error = self._broken("batchers", what, exc, log=False)
                self._out_of_service(error)
            else:
                error = self._broken("batchers", what, exc)
                for request in list(self._in_flight):
                    state = request._state
                    if state.status is _QUEUED and state.batch is not None:  # held
                        self.finish(request, error=_copy_error(error, cause=exc))
        for request in batch if isinstance(batch, list | tuple) else ():
            if isinstance(request, Request) and request._state.status is _RUNNING:
                self.finish(request, error=_copy_error(error, cause=error.__cause__))
        if self._fault is not None:
            await anyio.sleep_forever()  # nothing left to form: the model is unloaded later
        await anyio.lowlevel.checkpoint()

    def _scheduler_failed(self, method: str, exc: Exception) -> None:
        # The queue's report that its scheduler raised in *method*, or answered what
        # cannot be (a _SchedulerBroke saying what): the queue is empty already, its
        # requests unknown; the model is taken out of service.
        if isinstance(exc, _SchedulerBroke):
            error = self._broken("schedulers", str(exc), exc, log=False)
            error.__cause__ = None  # nothing of the scheduler's to show: what it said is told
        else:
            what = f"raised {type(exc).__name__} in {method}(): {exc}"
            error = self._broken("schedulers", what, exc, log=False)
        self._out_of_service(error)

    def _out_of_service(self, error: PluginContractError) -> None:
        """Take the model out of service: a plugin's state can no longer be trusted.

        Every queued request fails with *error* (a copy each), and every later one
        is refused with it (`admit`); running executions finish. Logged once, with
        the plugin's traceback. The model stays loaded, answering nothing, until it
        is unloaded or loaded again.
        """
        if self._fault is not None:
            return
        self._fault = error
        self._serving = 0  # admit() refuses: its one check, no cost on the hot path
        self.alone_ok = False
        self.queue._empty()
        failed = 0
        for request in list(self._in_flight):
            if request._state.status is _QUEUED:
                self.finish(request, error=_copy_error(error, cause=error.__cause__))
                failed += 1
        logger.error(
            "%s; model %r is out of service: %d queued requests failed, later ones are "
            "refused, until the model is loaded again",
            error,
            self.config.name,
            failed,
            exc_info=error.__cause__,
        )

    async def _execute(
        self, replica: Replica, batch: Sequence[Request], scope: anyio.CancelScope
    ) -> None:
        started = self.clock.current_time()
        running = _Running(scope, 0)
        live: list[Request] = []
        stray: Request | None = None
        twice: Request | None = None
        # What the batcher's call that returned the batch marked what it took with.
        held = self.queue._held_by
        # One pass: drop what ended or expired while the batch formed, mark the rest running.
        for request in batch:
            state = request._state
            if state.status is not _QUEUED:
                if state.batch is running:
                    # Marked running by this very pass: the batcher returned it twice,
                    # which its contract forbids. Run once without a word, the batch hid
                    # the batcher's miscount (the request it meant may be left behind).
                    # Checked only here, off the path of a request that runs: a sound
                    # batch pays nothing for it.
                    twice = request
                continue
            if state.batch is not held:
                # Not taken from the queue (only peeked at, or given back): it is still
                # queued there, and running it now would hand it out twice, with the
                # scheduler blamed for it. Left where it is; the batcher is at fault.
                # Or taken by an earlier call and held since: it fails with the batch.
                stray = request
                continue
            if request.deadline <= started:
                self._expire(request, started)
                continue
            state.status = _RUNNING
            state.batch = running
            live.append(request)
        if stray is not None:
            if stray._state.batch is None:
                what = (
                    f"returned request {stray.id!r}, which it had not taken from its queue "
                    "(with pop_nowait() or take_nowait()) or had given back"
                )
            else:
                what = (
                    f"returned request {stray.id!r} in a later batch than the one it was "
                    "taken in (a request taken and left out of a batch goes back with "
                    "put_back() before next_batch() returns)"
                )
            await self._batcher_failed(what, None, live)
            return
        if twice is not None:
            await self._batcher_failed(
                f"returned request {twice.id!r} twice in one batch (each request it takes "
                "from its queue goes in one batch, once)",
                None,
                live,
            )
            return
        self._batcher_faults = 0  # it formed a batch
        if not live:
            return
        if len(live) > 1 and not self.batched:
            error = self._broken(
                "batchers",
                f"grouped {len(live)} requests, but the model has no batch dimension",
            )
            for request in live:
                self.finish(request, error=_copy_error(error, cause=error.__cause__))
            return
        running.waiting = len(live)
        if len(live) == 1:  # an unbatched model's every execution: no list to build
            self._queue_duration.observe(started - live[0].arrival)
        else:
            self._queue_duration.observe_each([started - request.arrival for request in live])
        execution = Execution._create(self, live, replica)
        try:
            if self.tracing is None or not self.tracing.traced(live):
                await self._fallback.execute(execution)
            else:
                await self.tracing.execute(
                    self.config.name, live, replica, lambda: self._fallback.execute(execution)
                )
        except Exception as exc:
            if isinstance(exc, PluginContractError):  # e.g. from Execution.respond()
                logger.error("%s", exc)
            elif not isinstance(exc, TrioInferError) and not (
                execution._raised is not None and any(exc is e for e in execution._raised)
            ):
                # Not a backend's error passed on: the fallback's own bug. Its batch
                # fails, named after it; the model goes on with the next batch.
                error = self._broken("fallbacks", _raised(exc, "execute()"), exc)
                for request in execution.pending():
                    self.finish(request, error=_copy_error(error, cause=exc))
                return
            for request in execution.pending():
                self.finish(request, error=_backend_error(self.config.name, request, exc))
            return
        unanswered = execution.pending()
        if unanswered:
            error = self._broken(
                "fallbacks",
                f"returned without answering {len(unanswered)} of the batch's requests "
                f"({', '.join(repr(r.id) for r in unanswered)})",
            )
            for request in unanswered:
                self.finish(request, error=_copy_error(error, cause=error.__cause__))

    def _broken(
        self, kind: Kind, what: str, cause: BaseException | None = None, *, log: bool = True
    ) -> PluginContractError:
        """A plugin of this model broke its contract: the error, logged with the plugin's name.

        *cause*: the plugin's own exception, chained and logged with its traceback
        (by default the one being handled). ``log=False``: the caller logs it.
        """
        plugin = {
            "schedulers": self.config.scheduler,
            "batchers": self.config.batcher,
            "fallbacks": self.config.fallback,
            "backends": self.config.backend,
        }[kind]
        error = PluginContractError(
            f"{plugin_label(kind, plugin, self.sources.get(kind))} of model "
            f"{self.config.name!r} broke its contract: {what}",
            kind=kind,
            plugin=plugin,
        )
        if cause is None:
            cause = sys.exc_info()[1]
        error.__cause__ = cause
        if log:
            logger.error("%s", error, exc_info=cause)
        return error

    async def attempt(self, execution: Execution, replica: Replica) -> bool:
        """Run *execution*'s pending requests once on *replica*, and answer them.

        Returns whether anything ran: ``False`` when no request was left.
        """
        # One execution of a batch's pending requests on one replica: the engine's
        # side of Execution.run(). False when nothing was left to run.
        slot = replica._slot
        if not slot.try_acquire():  # a free slot costs no coroutine
            await slot.acquire()
        limiter = replica._gate or (  # its resources (and device), or its device
            self._device_limits.get(replica.device) if self._device_limits else None
        )
        try:
            if limiter is not None:
                await limiter.acquire()
            try:
                # After every wait (this slot, the device, a fallback's backoff):
                # rows whose caller left or whose deadline passed go no further.
                live, rows, deadline = self._live(execution.requests)
                if not live:
                    return False
                outputs: Outputs | None = None
                split: Callable[[Outputs], Sequence[Outputs]] | None = None  # None: alone
                taken: list[Any] | None = None
                per_request = self._per_request
                answered: list[Outputs] = []
                inputs: Mapping[str, Any]
                if per_request:
                    # Each request's own inputs, to execute_requests: nothing to lay out.
                    inputs = {}
                    split = functools.partial(_answered, answered, None)
                    if self._computed is not None:
                        # A sequence batcher's (a stateless one, checked at load): the
                        # instance feeds each request's controls itself (its
                        # sequence_flags); the batcher learns which requests were
                        # computed, so their sequences go on.
                        split = functools.partial(
                            _answered, answered, functools.partial(self._computed, live)
                        )
                    elif self._assemble is not None:
                        # One without computed(): its split, given no outputs, learns it.
                        try:
                            _, computed = self._assemble(live)
                        except Exception as exc:
                            self._fail_batch(live, "assemble", exc)
                            return True
                        split = functools.partial(
                            _answered, answered, functools.partial(computed, {})
                        )
                elif self._sets_differ and len(live) > 1 and _mixed(live):
                    # No rows to give an input some requests left out: the batcher's
                    # to keep apart, as it keeps apart shapes that cannot be concatenated
                    # (an assembling one would lay out the first request's inputs only).
                    self._fail_batch(live, "assemble", _mixed_inputs(live))
                    return True
                elif self._assemble is not None:
                    try:
                        inputs, split = self._assemble(live)
                    except Exception as exc:
                        # A batcher's bug fails its batch, not the instance's worker.
                        self._fail_batch(live, "assemble", exc)
                        return True
                elif len(live) == 1:
                    inputs = live[0].inputs  # its outputs are its own: no split
                else:
                    names = live[0].inputs.keys()
                    inputs, taken = self._pool.concatenate(
                        # Every input of a request holds its rows (validate_inputs).
                        {name: [r.inputs[name] for r in live] for name in names},
                        rows,
                    )
                    split = functools.partial(_split, live, rows)
                # The outputs asked for, where every request named some (their
                # union; one read for the usual batch, which names none).
                wanted = (
                    _wanted(live)
                    if live[0].requested_outputs and not per_request and self._assemble is None
                    else ()
                )
                self._batch_size.observe(rows)
                self.executions += 1
                replica.executions += 1
                started = self.clock.current_time()
                running = (replica, started, rows, deadline)
                self._executing.append(running)
                if self._assemble is not None and not per_request:
                    rows = _rows(inputs)  # the batcher's own layout: check what it built
                deadline_token = _batch_deadline.set(
                    deadline if not self.queue_timeouts else _deadlines(live, deadline)
                )
                try:
                    if per_request:
                        if self.tracing is None or not self.tracing.in_batch():
                            answered += await self._execute_requests(replica, live)
                        else:
                            answered += await self.tracing.compute(
                                self.config.name,
                                replica,
                                rows,
                                lambda: self._execute_requests(replica, live),
                            )
                        outputs = {}  # (each request's answer is in answered)
                    elif wanted and (self.tracing is None or not self.tracing.in_batch()):
                        outputs = await self._call_backend(
                            replica, inputs, rows if self.batched else 0, wanted
                        )
                    elif self.tracing is None or not self.tracing.in_batch():
                        # _call_backend() in line: one coroutine frame fewer per execution.
                        try:
                            outputs = await replica._backend_instance.execute(inputs)
                            if (check := self._output_check) is not None:
                                check.check(outputs, rows if self.batched else 0, replica)
                            elif self.batched:
                                _check_rows(self.config.name, replica, outputs, rows)
                        except Exception:
                            replica.failures += 1
                            raise
                    else:
                        outputs = await self.tracing.compute(
                            self.config.name,
                            replica,
                            rows,
                            lambda: self._call_backend(
                                replica, inputs, rows if self.batched else 0, wanted
                            ),
                        )
                finally:
                    _batch_deadline.reset(deadline_token)
                    self._executing.remove(running)
                    ended = self.clock.current_time()
                    self._executed(rows, len(live), ended - started, outputs is not None)
                    if taken is not None:
                        self._pool.give_back(taken, outputs)
            finally:
                if limiter is not None:
                    limiter.release()
        except Exception as exc:
            # An instance that failed because it is gone leaves the rotation before the
            # fallback picks another for the batch (one known gone is never picked).
            self._in_rotation(replica)
            # A backend's error (or the engine's) for the fallback to handle: not its own.
            if execution._raised is None:
                execution._raised = [exc]
            else:
                execution._raised.append(exc)
            raise
        finally:
            slot.release()
        if split is None:
            assert outputs is not None
            # Counted only if its outputs went to someone: its caller may have left
            # after it ended, before this task resumed (a thread's answer comes one
            # scheduling pass later), as one aborted because its callers left.
            if self._succeed(live, (outputs,), replica, ended):
                self.successful_executions += 1
            return True
        try:
            shares = split(outputs)
        except Exception as exc:
            self._fail_batch(live, "split", exc)
            return True
        if len(shares) != len(live):
            error = ValueError(f"it gave {len(shares)} shares for {len(live)} requests")
            self._fail_batch(live, "split", error)
            return True
        if self._succeed(live, shares, replica, ended):
            self.successful_executions += 1
        return True

    def _live(self, requests: Sequence[Request]) -> tuple[list[Request], int, float]:
        # The batch's rows still worth computing: running, caller still there,
        # deadline not passed. The others end here, exactly once, uncomputed.
        # With them, their rows and their latest deadline.
        live: list[Request] = []
        now: float | None = None
        rows, latest = 0, -math.inf
        for request in requests:
            state = request._state
            if state.status is not _RUNNING:
                continue
            deadline = request.deadline
            if deadline != math.inf:
                if now is None:
                    now = self.clock.current_time()
                if deadline <= now:
                    running: _Running = state.batch
                    running.waiting -= 1
                    if running.waiting == 0:
                        # Nobody waits for this batch any more (another attempt, a
                        # hedge, may be running): abort it, as when its callers leave.
                        running.scope.cancel()
                    self._expire(request, now)
                    continue
            live.append(request)
            rows += request.rows
            if deadline > latest:
                latest = deadline
        return live, rows, latest

    def _fail_batch(self, requests: Sequence[Request], step: str, exc: Exception) -> None:
        error = self._broken(
            "batchers",
            f"failed to {step} a batch of {len(requests)} requests: {type(exc).__name__}: {exc}",
        )
        error.__cause__ = exc
        for request in requests:
            self.finish(request, error=_copy_error(error, cause=error.__cause__))

    # -- called from callers' tasks ----------------------------------------------

    async def call(self, request: Request, *, own_deadline: bool = True) -> Outputs:
        """Admit *request*, wait for it to end, and return its outputs or raise its error.

        ``own_deadline=False`` says the request's deadline came from the model's
        queue policy, not the caller's scope: the engine enforces it itself, and
        the request ends with [`DeadlineExceeded`][trioinfer.DeadlineExceeded]
        if it is still queued then.
        """
        self.enter(request)
        state = request._state
        assert state.done is not None
        try:
            if own_deadline:
                await state.done.wait()
            else:
                with anyio.CancelScope(deadline=request.deadline) as scope:
                    await state.done.wait()
                if scope.cancelled_caught:
                    if state.status is _QUEUED:
                        self._expire(request, self.clock.current_time())
                        self._tell_sequencer(request)
                    else:
                        # Running: the engine ends it if the timeout passes before an
                        # attempt starts (a failover's wait, say), never mid-run.
                        await state.done.wait()
        except anyio.get_cancelled_exc_class():
            self.withdraw(request)
            raise
        if state.error is not None:
            await self.raise_error(state.error, own_deadline)
        assert state.outputs is not None
        return state.outputs

    def enter(self, request: Request) -> None:
        """Admit *request* to the queue, with a waiter for its one caller, or raise why not.

        The caller then waits on ``request._state.done``, withdraws the request
        (`withdraw`) if cancelled meanwhile, and raises its error (`raise_error`)
        if it has one: `call` does all of this; the engine's fast path inlines it,
        and on Trio parks its task in ``request._state.task`` instead of a waiter.
        """
        request._state.done = self._new_waiter()  # only this caller waits on it
        self.admit(request)

    def admit(self, request: Request) -> None:
        """Admit *request* to the queue, or raise why not: `enter` without the waiter."""
        if not self._serving:
            self.refused += 1
            raise self._circuit_open()
        limit = self.config.max_queue_size
        # In flight counts the queued requests and the running ones: below the
        # bound, the queue is too, and its length (a call into the scheduler) can wait.
        if len(self._in_flight) >= limit and len(self.queue) >= limit:
            self.refused += 1
            raise QueueFull(
                f"model {self.config.name!r} has {len(self.queue)} requests queued, its "
                f"max_queue_size; retry later",
                retry_after=self.retry_after(),
            )
        bounds = self.config.queue_sizes
        if bounds and request.priority in bounds:
            waiting = self.queue._waiting_at(request.priority)
            if waiting >= bounds[request.priority]:
                self.refused += 1
                raise QueueFull(
                    f"model {self.config.name!r} has {waiting} requests of priority "
                    f"{request.priority} queued, its queue_sizes bound for that level; "
                    "retry later",
                    retry_after=self.retry_after(),
                )
        queue = self.queue
        try:
            # RequestQueue._push in line: one call fewer per admitted request.
            queue._scheduler.push(request)
        except TrioInferError:
            self.refused += 1  # the scheduler refused it at admission (e.g. hopeless deadline)
            raise
        except Exception as exc:
            self.refused += 1
            if self._fault is not None:  # its scheduler failed as this came (in len())
                raise self._circuit_open() from None
            raise self._broken(
                "schedulers", f"raised {type(exc).__name__} in push(): {exc}"
            ) from exc
        queue._held += 1
        levels = queue._levels
        if levels is not None and request.priority in levels:
            levels[request.priority] += 1
        wakeup = queue._wakeup
        if wakeup is not None:
            queue._wakeup = None
            wakeup.set()
        if self._sequencer is not None:
            self._admit(request)
        self._in_flight.add(request)

    async def raise_error(self, error: BaseException, own_deadline: bool) -> NoReturn:
        """Raise the error a request ended with, or the caller's own cancellation first."""
        if isinstance(error, DeadlineExceeded) and own_deadline:
            # The request's deadline is the caller's own: let the caller's scope
            # report it (Cancelled, TooSlowError) rather than our error.
            await self.clock.checkpoint_if_cancelled()
        raise error

    def _admit(self, request: Request) -> None:
        # A stateful model's batcher sees each accepted request, and may refuse it
        # (a sequence it does not know, say): then it leaves the queue again.
        assert self._sequencer is not None
        try:
            self._sequencer.admit(request)
        except TrioInferError:
            self.queue._remove(request)
            self.refused += 1
            raise
        except Exception as exc:
            self.queue._remove(request)
            self.refused += 1
            raise self._broken(
                "batchers", f"raised {type(exc).__name__} in admit(): {exc}"
            ) from exc

    # -- a request run in its caller's task (a pipeline's step) -----------------------

    def idle_replica(self) -> Replica | None:
        """An idle replica on which a request may run at once in its caller's task, or None.

        Only for a model that passes a lone request straight through (`alone_ok`:
        FIFO scheduler, no batcher, no fallback, nothing cached, no sequences, no
        queue timeouts) and only while nothing is queued: a serving replica with
        a free slot nobody waits for and no device limit. Then `run_alone` on it
        does what the queue, the worker and the execution would, without them.
        When every replica is busy the request must queue: waiting for a slot
        in the caller's task instead measured slower (each hand-over costs a
        pass of the event loop for one task, where the worker runs the queue).
        """
        if not self.alone_ok or not self.queue.holds_none() or self._task_group is None:
            return None  # (no task group: the model is not running, its instances closed)
        limits = self._device_limits
        for replica in self._biggest_first:
            slot = replica._slot
            if (
                slot.free
                and not slot._waiters
                and replica._back is None
                and not (limits and replica.device in limits)
                and replica._gate is None  # its resources are taken in attempt() only
                # (An instance that cannot be gone costs one slot read, not a call.)
                and (not replica._mortal or self._in_rotation(replica))
            ):
                return replica
        return None

    def idle_inline_replica(self) -> Replica | None:
        """`idle_replica`, if its instance runs on the loop (``runs_inline``, ``starts_inline``).

        A plain request may run on it in its caller's task (`run_here`): to its
        end with no cancel scope when it never suspends; started there, hoping
        it ends before it suspends, when it only may (an ``async def infer``),
        and carried on there if it does, its caller's cancellation reaching it
        at its awaits as the worker's abort would. Any other instance (a worker
        thread's, a remote one's) serves the request from the queue: there its
        cancelled caller leaves at once, whatever the execution does.
        """
        replica = self.idle_replica()
        if replica is not None and (runs_inline(replica) or starts_inline(replica)):
            return replica
        return None

    def slice_spent(self, replica: Replica) -> bool:
        """Whether *replica*'s instance would yield for the loop's inline slice at its start.

        An instance that runs on the loop in slices (``inline_budget_s``, see
        `trioinfer.abc.InlineInstance`) yields at the start of an execution once
        the slice is spent: in `run_here` it would hold the replica meanwhile,
        and every caller that came by would queue. Its caller yields first
        instead (`restart_inline_slice` after), then asks `idle_replica` again.
        An inline instance without a budget of its own never yields: its
        caller yields for it once `DEFAULT_SLICE_S` is spent.
        """
        if not runs_inline(replica):
            # One that may end before it suspends (run_here starts it hoping so) holds
            # the loop then as an inline one does: the engine keeps the slice for it.
            return starts_inline(replica) and inline_slice_spent(DEFAULT_SLICE_S)
        return inline_slice_spent(inline_budget(replica))

    def idle_inline_now(self, yielded: bool = False) -> Replica | Literal[False] | None:
        """An idle replica whose instance never suspends, if a request may run on it now.

        `idle_replica`, if ``runs_inline``, and False when the loop's inline slice
        is spent for it (`slice_spent`: yield, then ask again, *yielded*); else
        None. What a pipeline's step asks before it runs as a plain call
        (`run_now`): one look at the instance, where the three questions
        (idle, inline, slice) would take three.
        """
        replica = self.idle_replica()
        if replica is None or not runs_inline(replica):
            return None
        if not yielded and inline_slice_spent(inline_budget(replica)):
            return False
        return replica

    async def run_here(
        self,
        replica: Replica,
        inputs: Mapping[str, np.ndarray[Any, Any]],
        rows: int,
        request_id: str | None,
        priority: int,
        tenant: str | None,
        deadline: float,
        now: float,
        held: dict[Request, ModelRunner] | None = None,
        wanted: tuple[str, ...] = (),
    ) -> Outputs:
        """Run validated *inputs* on *replica*, from `idle_replica` with no await since.

        *rows*: their rows, as `validate_rows` counts them for this model.
        *held*: where an execution that suspends puts its request while it runs
        (the pipeline's, which ends it with `cut_off` if the pipeline stops first).
        *wanted*: the outputs asked for (checked names; empty: all), the request's
        requested outputs: the answer holds at least those, and an
        `trioinfer.abc.OutputsInstance` computes those alone.

        What `run_alone` does with a request made of them at *now* (its arrival),
        counted the same way. On an instance that never suspends
        (`trioinfer.abc.InlineInstance`) it is `run_now`, with no request
        object, slot, in-flight entry or cancel scope: only its counts. One
        that may end before it suspends (``starts_inline``) is started the
        same way inside a cancel scope of its own, and carried on in it by
        `run_alone` if it suspends, so that stopping the model aborts it.

        Raises:
            What the request ended with, as `call` does.
        """
        if deadline > now:
            # The inline instance first: the hot path asks nothing more of it.
            if runs_inline(replica):
                outputs = self.run_now(replica, inputs, rows, deadline, now, wanted)
                if outputs.__class__ is Unfinished:
                    return await self.finish_here(outputs, request_id, priority, tenant, held)
                return cast(Outputs, outputs)
            if starts_inline(replica):
                return await self._run_hoping(
                    replica, inputs, rows, request_id, priority, tenant, deadline, now, held, wanted
                )
        return await self.run_alone(
            replica,
            make_request(
                self.config.name,
                inputs,
                request_id,
                priority,
                tenant,
                deadline,
                now,
                rows,
                requested_outputs=wanted,
            ),
            held=held,
        )

    def run_now(
        self,
        replica: Replica,
        inputs: Mapping[str, np.ndarray[Any, Any]],
        rows: int,
        deadline: float,
        now: float,
        wanted: tuple[str, ...] = (),
    ) -> Outputs | Unfinished:
        """`run_here` on an instance that never suspends, as a plain call: its outputs.

        From `idle_inline_replica` (and `slice_spent` False) with no await since,
        *deadline* after *now*, both read then. The execution runs to its end
        before anything else can look at the model, so it needs no request
        object, slot, in-flight entry or cancel scope, and no coroutine frame
        of its own: a pipeline's chain of such steps runs as one call each.
        An execution that answered is counted here; one that failed, or
        suspended after all (it broke its word), comes back as an `Unfinished`
        to pass to `finish_here` at once (no await before), which ends it.
        *wanted*: as `run_here` says.
        """
        token = _batch_deadline.set(deadline)
        try:
            if wanted:
                run = _execution(replica, inputs, wanted)
            else:
                run = replica._backend_instance.execute(inputs)
            # Its caller checked the loop's inline slice (slice_spent) with no
            # await since: the instance need not yield for it, holding the model.
            _inline_slice.granted = True
            try:
                yielded = run.send(None)
            except StopIteration as done:
                outputs: Outputs = done.value
                check = self._output_check
                if wanted:
                    outputs = self._narrowed(outputs, wanted, rows if self.batched else 0, replica)
                elif check is None:
                    if self.batched:
                        _check_rows(self.config.name, replica, outputs, rows)
                elif check.full:
                    check.check(outputs, rows if self.batched else 0, replica)
                else:
                    # What check.check() does for instances that check their own
                    # dtypes and shapes, in line: every pipeline step's path, where
                    # the call cost a few percent of a request.
                    if outputs.__class__ is not dict or outputs.keys() != check.names:
                        check.check(outputs, rows if self.batched else 0, replica)
                    if self.batched:
                        for array in outputs.values():
                            if (
                                type(array) is not np.ndarray
                                or not array.ndim
                                or len(array) != rows
                            ):
                                check.check(outputs, rows, replica)
            else:
                return Unfinished(
                    replica, inputs, rows, deadline, now, (run, yielded), None, wanted
                )
        except Exception as exc:
            return Unfinished(replica, inputs, rows, deadline, now, None, exc, wanted)
        except BaseException:
            # Not a cancellation (it never suspended): KeyboardInterrupt and the like.
            self._count_alone(replica, rows, self.clock.current_time() - now)
            self.cancelled += 1
            raise
        finally:
            _inline_slice.granted = False  # (an instance that never read it)
            _batch_deadline.reset(token)
        self._answered(replica, rows, now)
        return outputs

    def _answered(self, replica: Replica, rows: int, now: float) -> None:
        # An execution run here, from *now*, that answered without suspending, counted
        # as the worker counts an execution and its request, in line (this is every
        # pipeline step's path): it never queued, and its request took its
        # execution's time, so one tally stands for its queue, compute and request
        # durations and its execution (statistics() adds it to each).
        elapsed = self.clock.current_time() - now
        here = self._answered_here
        here.counts[bisect.bisect_left(here.bounds, elapsed)] += 1
        here.count += 1
        here.sum += elapsed
        sizes = self._batch_size
        sizes.counts[bisect.bisect_left(sizes.bounds, rows)] += 1
        sizes.count += 1
        sizes.sum += rows
        replica.executions += 1
        self._learn(rows, 1, elapsed)
        self.succeeded += 1
        self.inferences += rows or 1

    async def _run_hoping(
        self,
        replica: Replica,
        inputs: Mapping[str, np.ndarray[Any, Any]],
        rows: int,
        request_id: str | None,
        priority: int,
        tenant: str | None,
        deadline: float,
        now: float,
        held: dict[Request, ModelRunner] | None,
        wanted: tuple[str, ...],
    ) -> Outputs:
        # run_here on an instance that may end before it suspends (starts_inline: an
        # async def model): started here in the hope that it does, when it is done
        # at run_here's cost; if it suspends, it goes on as run_alone runs any other,
        # in this task. Its scope, entered before the execution starts (a scope entered
        # after would not nest with the execution's own), lets an unload or cut_off
        # abort it then, as they abort any run in its caller's task.
        scope = trio.CancelScope() if self.on_trio else anyio.CancelScope()
        slot = replica._slot
        request: Request | None = None
        with scope:
            # Held while it starts: a request the execution makes meanwhile (to its
            # own model) must not find this replica idle.
            slot.free -= 1
            try:
                outcome = self.run_now(replica, inputs, rows, deadline, now, wanted)
            finally:
                slot.release()  # (nobody can wait for it: no await since idle_replica)
            if outcome.__class__ is not Unfinished:
                return cast(Outputs, outcome)  # it ended before it suspended
            begun = outcome.begun
            if begun is not None:
                # It suspended: from here on as any run in its caller's task, in
                # this scope (no await since it was taken: the slot is still free).
                request = make_request(
                    self.config.name,
                    inputs,
                    request_id,
                    priority,
                    tenant,
                    deadline,
                    now,
                    rows,
                    requested_outputs=wanted,
                )
                outputs = await self.run_alone(replica, request, begun, held, scope)
                restart_inline_slice()  # it yielded to the loop
                return outputs
        if request is None:
            # It failed before it suspended: ended as run_here ends such a run.
            return await self.finish_here(cast(Unfinished, outcome), request_id, priority, tenant)
        # Aborted by its scope: the unload or cut_off that did it ended the request.
        assert request._state.error is not None
        await self.raise_error(request._state.error, own_deadline=True)

    async def finish_here(
        self,
        unfinished: Unfinished,
        request_id: str | None,
        priority: int,
        tenant: str | None,
        held: dict[Request, ModelRunner] | None = None,
    ) -> Outputs:
        """End what `run_now` left *unfinished*, as its request: raise its error, or carry it on.

        Called at once, with no await since `run_now`: its request is made now
        (with *request_id*, *priority* and *tenant*), at the execution's
        arrival. A failed execution ends it with the backend's error; one
        that suspended goes on as `run_alone` runs any other (it holds the
        slot, and an unload waits for it; *held* as `run_here` says).

        Raises:
            What the request ended with, as `call` does.
        """
        u = unfinished
        request = make_request(
            self.config.name,
            u.inputs,
            request_id,
            priority,
            tenant,
            u.deadline,
            u.now,
            u.rows,
            requested_outputs=u.wanted,
        )
        if u.begun is not None:
            return await self.run_alone(u.replica, request, u.begun, held)
        assert u.error is not None
        request._state.status = _RUNNING
        self._in_flight.add(request)
        self._count_alone(u.replica, u.rows, self.clock.current_time() - u.now)
        u.replica.failures += 1
        self.finish(request, error=_backend_error(self.config.name, request, u.error))
        assert request._state.error is not None
        await self.raise_error(request._state.error, own_deadline=True)
        raise AssertionError("raise_error returned")  # pragma: no cover

    def _count_alone(self, replica: Replica, rows: int, elapsed: float) -> None:
        # An execution in its caller's task that did not answer, counted as the
        # worker counts one (run_here counts one that answered).
        self._queue_duration.observe(0.0)
        self._batch_size.observe(rows)
        self.executions += 1
        replica.executions += 1
        self._compute_duration.observe(elapsed)

    def _executed(self, rows: int, requests: int, elapsed: float, answered: bool) -> None:
        # One execution's compute time; a run that answered also teaches the
        # estimates (aborted and failed runs say little of the next one).
        self._compute_duration.observe(elapsed, requests)
        if answered:
            self._learn(rows, requests, elapsed)

    def _learn(self, rows: int, requests: int, elapsed: float) -> None:
        mean = self._mean_execution_s
        self._mean_execution_s = elapsed if mean == 0.0 else mean + 0.2 * (elapsed - mean)
        self._cost.observe(rows, requests, elapsed)

    async def run_alone(
        self,
        replica: Replica,
        request: Request,
        begun: tuple[Coroutine[Any, Any, Outputs], Any] | None = None,
        held: dict[Request, ModelRunner] | None = None,
        scope: anyio.CancelScope | trio.CancelScope | None = None,
    ) -> Outputs:
        """Run *request* on *replica*, from `idle_replica` with no await since, in this task.

        Its caller's cancel scope is the execution's: a cancelled caller cancels
        it, as a queued request's caller leaving aborts its execution. It is
        counted as a queued request is (succeeded, failed, cancelled, expired,
        executions, the histograms, the replica's executions and failures), ends
        exactly once, and holds the replica's slot, so that the worker waits for
        it and the model's instances close only after it (`_wait_alone`).
        *begun*: the execution, already run (by `run_here`) to its first
        suspension, and what it yielded there; it is carried on in *scope*, the
        cancel scope it started in (an unload or `cut_off` aborts it by that),
        or with none (an unload waits for it rather than aborting it). *held*:
        where *request* is kept while it runs, for `cut_off` (a pipeline's).

        Raises:
            What the request ended with, as `call` does.
        """
        state = request._state
        state.status = _RUNNING
        # Its arrival was just now (no await since), unless made a while ago.
        started = request.arrival if begun is not None else self.clock.current_time()
        deadline = request.deadline
        if deadline <= started:
            # Past its deadline with no checkpoint since (the step before it ran
            # without yielding): never computed. A checkpoint lets the caller's scope
            # report it, as it would have for a request waiting in the queue.
            self._expire(request, started)
            await anyio.lowlevel.checkpoint()
            assert state.error is not None
            await self.raise_error(state.error, own_deadline=True)
        slot = replica._slot
        taken = slot.try_acquire()
        assert taken, "run_alone() on a replica that is not idle"
        self._in_flight.add(request)
        self._alone += 1
        rows = request.rows
        self._queue_duration.observe(started - request.arrival)
        self._batch_size.observe(rows)
        self.executions += 1
        replica.executions += 1
        running = (replica, started, rows, deadline)
        self._executing.append(running)
        outputs: Outputs | None = None
        deadline_token = _batch_deadline.set(deadline)
        if held is not None:
            held[request] = self
        try:
            try:
                answer: Outputs | None = None  # (none if an unload aborts it)
                if begun is not None:
                    if scope is not None:
                        self._alone_scopes.add(scope)
                        state.batch = scope  # for cut_off
                    answer = await resume(*begun)
                else:
                    # A run that may suspend: stopping the model aborts it by its scope.
                    scope = trio.CancelScope() if self.on_trio else anyio.CancelScope()
                    self._alone_scopes.add(scope)
                    state.batch = scope  # for cut_off
                    with scope:
                        if self._per_request:
                            (share,) = await self._execute_requests(replica, (request,))
                            # A request its answer failed has ended already, with it.
                            answer = share if state.status is _RUNNING else None
                        elif request.requested_outputs:
                            answer = await _execution(
                                replica, request.inputs, request.requested_outputs
                            )
                        else:
                            answer = await replica._backend_instance.execute(request.inputs)
                if answer is None or (begun is None and self._per_request):
                    pass  # (a RequestsInstance's answer: checked by _execute_requests)
                elif request.requested_outputs:
                    answer = self._narrowed(
                        answer, request.requested_outputs, rows if self.batched else 0, replica
                    )
                elif (check := self._output_check) is not None:
                    check.check(answer, rows if self.batched else 0, replica)
                elif self.batched:
                    _check_rows(self.config.name, replica, answer, rows)
                outputs = answer
            except Exception as exc:
                replica.failures += 1
                outputs = None
                self.finish(request, error=_backend_error(self.config.name, request, exc))
        except BaseException:
            # The caller was cancelled (its deadline, or it left): so is the execution.
            if state.status is not _DONE:
                state.abandoned = True
                self.cancelled += 1
                self._end(request)
            raise
        finally:
            _batch_deadline.reset(deadline_token)
            if held is not None:
                del held[request]
            if scope is not None:
                self._alone_scopes.discard(scope)
            self._executing.remove(running)
            ended = self.clock.current_time()
            self._executed(rows, 1, ended - started, outputs is not None)
            slot.release()  # to the next in line, if any
            self._alone_left()
        if state.status is _RUNNING:
            assert outputs is not None
            self.successful_executions += 1
            self._succeed((request,), (outputs,), replica, ended)
            return outputs
        # It failed, or the model stopped under it (EngineClosed): its error, once.
        assert state.error is not None
        await self.raise_error(state.error, own_deadline=True)

    def _alone_left(self) -> None:
        self._alone -= 1
        if not self._alone and self._alone_ended is not None:
            self._alone_ended.set()
            self._alone_ended = None

    async def _wait_alone(self) -> None:
        # Executions in their callers' tasks are not the workers': stopping those
        # does not end them. The instances must not close under them.
        with anyio.move_on_after(CLEANUP_S, shield=True):
            while self._alone:
                self._alone_ended = self._new_event()
                await self._alone_ended.wait()

    def move_deadline(self, request: Request, deadline: float, *, requeue: bool) -> None:
        """Give *request* another deadline: that of the latest caller still waiting for it.

        For the response cache, whose one computation answers every identical
        request waiting for it (`trioinfer._cache`): when the caller whose
        deadline the request had leaves, those still waiting keep it alive.
        Not admitted yet, taken by a batcher or running, it is out of its
        scheduler, and the deadline changes in place (the checks before each
        attempt read it).
        In its scheduler (which may order requests by deadline) it moves only
        with *requeue*: it leaves and enters again, behind those queued since.
        """
        state = request._state
        if state.status is _DONE or request.deadline == deadline:
            return
        queue = self.queue
        if state.status is _QUEUED and state.batch is None and request in self._in_flight:
            if not requeue:
                return
            queue._remove(request)
            if state.status is _DONE:  # a scheduler that failed there failed it too
                return
            object.__setattr__(request, "deadline", deadline)
            try:
                queue._push(request)
            except TrioInferError as exc:  # the scheduler refused it (a deadline it cannot meet)
                self.finish(request, error=exc)
            except Exception as exc:  # fails every queued request, this one too
                queue._scheduler_failed("push", exc)
            return
        object.__setattr__(request, "deadline", deadline)

    def withdraw(self, request: Request) -> None:
        """Take back the request of a caller cancelled while it waited, wherever it is."""
        state = request._state
        if state.status is _DONE:
            return
        state.abandoned = True
        held = state.status is _QUEUED
        if held:
            self.queue._remove(request)
            if state.status is _DONE:  # a scheduler that failed there failed it too
                return
        elif state.status is _RUNNING:
            running: _Running = state.batch
            running.waiting -= 1
            if running.waiting == 0:
                # Nobody waits for this execution any more: abort it in the backend.
                running.scope.cancel()
        self.cancelled += 1
        self._end(request)
        if held:
            self._tell_sequencer(request)

    def cut_off(self, request: Request, error: BaseException) -> None:
        """End *request* with *error* now, wherever it is, as if its caller had left.

        For a request made for another that is ending (a step of a pipeline
        request, when the pipeline stops after its drain period): taken out of
        the queue, or its execution aborted if nobody else waits for it (a run
        in its caller's task by its scope, as stopping the model does), and
        counted as cancelled. Its caller, parked in the request or waiting on
        it, wakes to *error*. Nothing if it has ended already.
        """
        state = request._state
        status = state.status
        if status is _DONE:
            return
        state.abandoned = True
        if status is _QUEUED:
            self.queue._remove(request)
            if state.status is _DONE:  # a scheduler that failed there failed it too
                return
        else:
            running = state.batch
            if isinstance(running, _Running):
                running.waiting -= 1
                if running.waiting == 0:
                    running.scope.cancel()  # nobody waits for this execution: abort it
            elif running is not None:
                running.cancel()  # a run in its caller's task (run_alone): its scope
        state.error = error
        self.cancelled += 1
        self._end(request)
        if status is _QUEUED:
            self._tell_sequencer(request)

    def _tell_sequencer(self, request: Request) -> None:
        # A request a sequence batcher may hold ended before it ran (its caller left, its
        # deadline passed): tell the batcher now, so its sequence ends now and not at the
        # batcher's next wake-up (which may be a whole max_sequence_idle away).
        if self._sequencer is None:
            return
        try:
            self._sequencer.withdrawn(request)
        except Exception as exc:
            # Raising here would replace the caller's Cancelled: log the broken contract.
            self._broken("batchers", f"raised {type(exc).__name__} in withdrawn(): {exc}")

    # -- ending requests -----------------------------------------------------------

    def _expire(self, request: Request, now: float) -> None:
        self.finish(
            request,
            error=DeadlineExceeded(
                f"request {request.id!r} for model {self.config.name!r} reached its deadline "
                f"after {now - request.arrival:.3f}s waiting to run; nothing was computed"
            ),
        )

    def finish(
        self,
        request: Request,
        *,
        outputs: Outputs | None = None,
        error: BaseException | None = None,
    ) -> None:
        state = request._state
        if state.status is _DONE:
            return
        if state.status is _QUEUED:
            self.queue._remove(request)
            if state.status is _DONE:  # a scheduler that failed there failed it too
                return
        state.outputs, state.error = outputs, error
        if error is None:
            self.succeeded += 1
            self.inferences += request.rows or 1
        elif isinstance(error, DeadlineExceeded):
            self.expired += 1
        else:
            self.failed += 1
        self._end(request)

    @_ki_protected
    def _end(self, request: Request) -> None:
        # _succeed() does this for a computed batch's requests, in one pass.
        state = request._state
        state.status = _DONE
        state.batch = None
        task = state.task
        if task is not None:
            state.task = None
            trio_rescheduler()(task, WOKEN)
        elif state.done is not None:
            state.done.set()
        self._in_flight.discard(request)
        if not self._in_flight and self._idle is not None:
            self._idle.set()
            self._idle = None

    @_ki_protected
    def _succeed(
        self, requests: Sequence[Request], shares: Sequence[Outputs], replica: Replica, ended: float
    ) -> bool:
        # finish(outputs=...) and _end() for a computed batch's requests, in one
        # pass (two calls fewer per request): a change to either belongs here too.
        # After the backend call a request is still running, or done: its caller
        # left, or another attempt (a hedge) answered. True if any got its outputs.
        in_flight = self._in_flight
        if len(requests) == 1:
            # One request (every execution of an unbatched model): the loop
            # below without its list, zip and sum.
            request = requests[0]
            state = request._state
            if state.status is _RUNNING:
                state.served_by = replica
                state.outputs = shares[0]
                state.status = _DONE
                state.batch = None
                task = state.task
                if task is not None:
                    state.task = None
                    trio_rescheduler()(task, WOKEN)
                elif state.done is not None:
                    state.done.set()
                in_flight.discard(request)
                self.succeeded += 1
                self.inferences += request.rows or 1
                if not in_flight and self._idle is not None:
                    self._idle.set()
                    self._idle = None
                self._request_duration.observe(ended - request.arrival)
                return True
            return False
        durations: list[float] = []
        inferences = 0
        reschedule: Callable[[Any, Any], object] | None = None  # fetched for the first parked task
        for request, share in zip(requests, shares, strict=True):
            state = request._state
            if state.status is _RUNNING:
                durations.append(ended - request.arrival)
                inferences += request.rows or 1
                state.served_by = replica
                state.outputs = share
                state.status = _DONE
                state.batch = None
                task = state.task
                if task is not None:  # a caller parked on Trio's fast path
                    state.task = None
                    if reschedule is None:
                        reschedule = trio_rescheduler()
                    reschedule(task, WOKEN)
                elif state.done is not None:
                    state.done.set()
                in_flight.discard(request)
        self.succeeded += len(durations)
        self.inferences += inferences
        if not in_flight and self._idle is not None:
            self._idle.set()
            self._idle = None
        self._request_duration.observe_each(durations)
        return bool(durations)

    # -- replicas in and out of service (FallbackContext) ------------------------------

    def take_out(self, replica: Replica, reason: str, retry_after: float) -> None:
        """Stop dispatching to *replica*; see `FallbackContext.take_out`."""
        self._take_out(replica, reason, retry_after)
        if not self._serving:
            self._refuse_queued()

    def _take_out(self, replica: Replica, reason: str, retry_after: float) -> None:
        # take_out, but for refusing the queue with no replica left: the caller's to do.
        if self._fault is not None:
            return  # the whole model is out of service: no replica serves anyway
        replica._retry_at = self.clock.current_time() + max(retry_after, 0.0)
        if not replica.serving:
            replica.reason = reason
            return
        replica.state, replica.reason = "out", reason
        replica.taken_out += 1
        replica._back = self._new_event()
        self._serving -= 1
        logger.warning(
            "model %r: %s taken out of service: %s", self.config.name, replica.label, reason
        )
        self._turns.cancel_forming(replica)

    def _in_rotation(self, replica: Replica) -> bool:
        """Whether batches may go to *replica*: it serves, and its instance is not gone.

        The one place where an instance that says it is gone (its ``gone``, see
        `trioinfer.abc.BackendInstance`: a Ray actor that died) leaves the
        rotation: it is taken out of service as a fallback takes one out, with
        ``"gone: ..."`` as its reason and no time to come back, so that no batch
        is sent to it (the one it was running fails there, once), later ones go
        to the instances that serve, and with none left requests are refused at
        once. A [`RecoveringFallback`][trioinfer.abc.RecoveringFallback] is told,
        to re-create it; else loading the model again replaces it.
        """
        if replica._back is not None:  # out of service (a slot: cheaper than `serving`)
            return False
        gone = replica.gone
        if gone is None:
            return True
        self._take_out(replica, f"gone: {gone}", math.inf)
        if replica._back is None:
            return True  # the whole model is out of service (a plugin's fault): none runs
        if self._sequencer is not None:
            # Its sequences' state went with it: a sequence batcher that can end them
            # (an optional method, see trioinfer.abc.SequenceBatcher) does now, or
            # their requests would wait for it for ever.
            ended = getattr(self._sequencer, "replica_gone", None)
            if ended is not None:
                try:
                    ended(replica)
                except Exception as exc:
                    self._broken("batchers", _raised(exc, "replica_gone()"), exc)
        fallback = self._fallback
        if isinstance(fallback, RecoveringFallback):
            try:
                fallback.replica_gone(replica)
            except Exception as exc:
                # Its bug: logged, naming it; the instance stays out, the model goes on.
                self._broken("fallbacks", _raised(exc, "replica_gone()"), exc)
            if replica._back is None:
                # Put back still gone (its contract: re-created first, in a task): its
                # fault, said once; the instance stays out, as with nothing to re-create it.
                self._broken(
                    "fallbacks",
                    f"put back {replica.label} in replica_gone(), its instance still gone "
                    "(re-create it first, in a task: FallbackContext.start_soon)",
                )
                self._take_out(replica, f"gone: {gone}", math.inf)
                replica.taken_out -= 1  # the one taking out, undone by the fallback: once
        if not self._serving:
            # Refused once the fallback had its say: queued requests are told when to
            # retry (it re-creates the instance), not that none is coming back.
            self._refuse_queued()
        return False

    def put_back(self, replica: Replica) -> None:
        """Return *replica* to service; see `FallbackContext.put_back`."""
        if replica.serving or self._fault is not None:
            return
        replica.state, replica.reason = "serving", None
        replica._retry_at = math.inf
        back, replica._back = replica._back, None
        self._serving += 1
        logger.info("model %r: %s back in service", self.config.name, replica.label)
        if back is not None:
            back.set()

    def _circuit_open(self) -> TrioInferError:
        # Why a request is refused when no replica serves: a breaker's, or the model's fault.
        fault = self._fault
        if fault is not None:
            refusal = PluginContractError(
                f"model {self.config.name!r} is out of service: {fault}; it refuses every "
                "request until it is loaded again",
                kind=fault.kind,
                plugin=fault.plugin,
            )
            refusal.__cause__ = fault
            return refusal
        now = self.clock.current_time()
        retry_after = max(min(r._retry_at for r in self.replicas) - now, 0.0)
        reasons = "; ".join(f"{r.label}: {r.reason}" for r in self.replicas)
        if retry_after == math.inf:
            # None is to come back (each gone, and nothing re-creates it): no retry helps.
            return BackendUnavailable(
                f"every instance of model {self.config.name!r} is out of service "
                f"({reasons}), and none is coming back: load the model again"
            )
        return CircuitOpen(
            f"every instance of model {self.config.name!r} is out of service ({reasons}); "
            f"retry in {retry_after:.3g}s",
            retry_after=retry_after,
        )

    def _refuse_queued(self) -> None:
        # No replica serves: nobody would take these, so they fail now, not at their deadline.
        while True:
            try:
                request = self.queue.pop_nowait()
            except anyio.WouldBlock:
                return
            self.finish(request, error=self._circuit_open())

    async def infer_elsewhere(self, model: str, request: Request) -> Request:
        """Run *request* on another loaded *model*: its answered request there.

        See `Execution.infer_elsewhere`.
        """
        if self._elsewhere is None:  # pragma: no cover  # every engine sets it
            raise BackendError(f"model {self.config.name!r} is not part of an engine")
        return await self._elsewhere(model, request)

    def start_background(self, fn: Callable[..., Awaitable[object]], *args: object) -> None:
        """Run ``fn(*args)`` in the model's task group; see `FallbackContext.start_soon`."""
        if self._task_group is None:
            raise RuntimeError(f"model {self.config.name!r} is not running")
        self._task_group.start_soon(self._background, fn, args)

    async def _background(
        self, fn: Callable[..., Awaitable[object]], args: tuple[object, ...]
    ) -> None:
        try:
            await fn(*args)
        except Exception:
            # A fallback's helper task must not take the model (and the engine) down.
            logger.exception("model %r: background task %r failed", self.config.name, fn)

    async def probe(self, replica: Replica, inputs: Mapping[str, Any] | None) -> None:
        """One execution that answers nobody; see `FallbackContext.probe`."""
        arrays = _probe_inputs(self.backend_signature) if inputs is None else inputs
        instance = replica._backend_instance
        if isinstance(instance, StreamingInstance) and instance.decoupled:
            # A decoupled instance serves streams only (its execute is refused): probed
            # by one, read to its end (a re-created one was never put back otherwise).
            await self._probe_stream(replica, instance, arrays)
            return
        await replica._slot.acquire()
        try:
            replica.executions += 1
            limiter = replica._gate or self._device_limits.get(replica.device)
            if limiter is None:
                await self._call_backend(replica, arrays, _rows(arrays) if self.batched else 0)
            else:
                async with limiter:
                    await self._call_backend(replica, arrays, _rows(arrays) if self.batched else 0)
        finally:
            replica._slot.release()

    async def _probe_stream(
        self, replica: Replica, instance: StreamingInstance, inputs: Mapping[str, Any]
    ) -> None:
        generator = instance.stream(inputs)
        try:
            async for _ in generator:
                pass
        except Exception:
            replica.failures += 1
            raise
        finally:
            await generator.aclose()

    async def _execute_requests(
        self, replica: Replica, requests: Sequence[Request]
    ) -> list[Outputs]:
        # One call of a RequestsInstance's execute_requests on a replica whose slot the
        # caller holds: each request's answer, checked against its own rows, or its own
        # error, with which it ends here (its share is then empty: _succeed passes it by).
        instance = cast(RequestsInstance, replica._backend_instance)
        try:
            answers = await instance.execute_requests(requests)
        except Exception:
            replica.failures += 1
            raise
        if not isinstance(answers, Sequence) or len(answers) != len(requests):
            replica.failures += 1
            got = len(answers) if isinstance(answers, Sequence) else type(answers).__name__
            raise BackendError(
                f"model {self.config.name!r}: {replica.label} answered {got} for "
                f"{len(requests)} requests; execute_requests returns one answer per request"
            )
        check = self._output_check
        shares: list[Outputs] = []
        for request, answer in zip(requests, answers, strict=True):
            error: Exception
            if isinstance(answer, Exception):
                error = answer
            elif not isinstance(answer, dict):
                error = BackendError(
                    f"model {self.config.name!r}: {replica.label} answered a request with "
                    f"{type(answer).__name__}, not outputs by name"
                )
            else:
                try:
                    rows = request.rows if self.batched else 0
                    if check is None:
                        pass
                    elif request.requested_outputs:
                        # It may answer with the requested outputs alone (the rest dropped).
                        answer = check.requested(answer, request.requested_outputs, rows, replica)
                    else:
                        check.check(answer, rows, replica)
                except BackendError as exc:
                    error = exc
                else:
                    shares.append(answer)
                    continue
            self.finish(request, error=_backend_error(self.config.name, request, error))
            shares.append({})
        return shares

    async def _call_backend(
        self,
        replica: Replica,
        inputs: Mapping[str, Any],
        rows: int,
        wanted: tuple[str, ...] = (),
    ) -> Outputs:
        # One backend call on a replica whose slot (and device) the caller holds.
        # attempt() has this in line on its untraced path: a change belongs there too.
        # With *rows*, every output must hold that many rows: only then can each
        # caller get its own. *wanted*: the outputs asked for alone (an answer of
        # those, narrowed to them). A failure here counts against the replica.
        try:
            if wanted:
                outputs = await _execution(replica, inputs, wanted)
                return self._narrowed(outputs, wanted, rows, replica)
            outputs = await replica._backend_instance.execute(inputs)
            if (check := self._output_check) is not None:
                check.check(outputs, rows, replica)
            elif rows:
                _check_rows(self.config.name, replica, outputs, rows)
        except Exception:
            replica.failures += 1
            raise
        return outputs

    def _narrowed(
        self, outputs: Outputs, wanted: tuple[str, ...], rows: int, replica: Replica
    ) -> Outputs:
        # An answer of an execution asked for *wanted* alone (`_execution`), narrowed
        # to them, each checked (*rows*: 0 unbatched). The rest of it is dropped unchecked.
        if (check := self._output_check) is not None:
            return check.requested(outputs, wanted, rows, replica)
        if rows:
            _check_rows(self.config.name, replica, outputs, rows)
        return outputs

    def _backend_label(self) -> str:
        # The backend and the package that declared it, as its load errors name them.
        return plugin_label("backends", self.config.backend, self.sources.get("backends"))

    async def recreate(self, replica: Replica) -> None:
        """Load a fresh backend instance for *replica*; see `FallbackContext.recreate`."""
        if self._backend is None:  # pragma: no cover  # every engine passes its backend
            raise BackendError(f"model {self.config.name!r} cannot re-create instances")
        depth = _depth(replica._backend_instance)
        held = 0
        try:
            while held < depth:  # every slot: nothing may run on the old instance
                await replica._slot.acquire()
                held += 1
            old = replica._backend_instance
            was = old.device  # asked before it closes
            try:
                with loading_for(self._tasks):
                    new = await self._backend.load(self.config, replica.placement)
            except TrioInferError:
                raise
            except Exception as exc:
                raise BackendError(
                    f"{self._backend_label()} could not re-create {replica.label} of model "
                    f"{self.config.name!r}: {type(exc).__name__}: {exc}"
                ) from exc
            finally:
                await close_instances(self.config.name, [old])
            if (wrong := _not_an_instance(new)) is not None:
                # As at load: the backend's broken contract, not an AttributeError
                # from the fallback that re-creates (nor a junk object served).
                if isinstance(new, BackendInstance):
                    await close_instances(self.config.name, [new])
                raise PluginContractError(
                    f"{self._backend_label()} broke its contract: load(), re-creating "
                    f"{replica.label} of model {self.config.name!r}, returned {wrong}",
                    kind="backends",
                    plugin=self.config.backend,
                )
            if new.signature != self.backend_signature:
                await close_instances(self.config.name, [new])
                raise BackendError(
                    f"{replica.label} of model {self.config.name!r}, re-created by "
                    f"{self._backend_label()}, reports another signature than the model was "
                    "loaded with"
                )
            try:
                await warm_up(
                    self.config.name,
                    self.config.warmup,
                    self.backend_signature,
                    self.input_limits,
                    [new],
                    [replica.label],
                    max_batch_size=self.max_batch_size,
                )
                if replica._gate is not None and new.device != was:
                    # Its resources are the device's it runs on now (a GPU's instance
                    # re-created on the CPU takes from the CPU's pools).
                    replica._gate.move(
                        self.config.name, new.device, self._device_limits.get(new.device)
                    )
            except BaseException:
                await close_instances(self.config.name, [new])
                raise
            replica.serve_with(new)
            if self._output_check is not None and not self._output_check.full:
                # The cheap check was the old instances' word for their outputs: the
                # new one, from the file as it is now, may not give it.
                self._output_check = OutputCheck.for_instances(
                    self.config.name,
                    self.backend_signature,  # the instances', as at load
                    [r._backend_instance for r in self.replicas],
                )
            replica.recreated += 1
            logger.info("model %r: %s re-created", self.config.name, replica.label)
        finally:
            for _ in range(held):
                replica._slot.release()

    # -- engine-facing -------------------------------------------------------------

    async def wait_idle(self) -> None:
        """Wait until no request is queued or running."""
        while self._in_flight:
            if self._idle is None:
                self._idle = anyio.Event()
            await self._idle.wait()

    async def stop(self) -> None:
        """Cancel the workers, fail what is left, close the instances, and wait for all that."""
        self._scope.cancel()
        with anyio.move_on_after(CLEANUP_S):
            await self._finished.wait()
        if not self._finished.is_set():
            # Nothing can abandon a task: say who holds the model, rather than hang mute.
            busy = sorted({replica.label for replica, *_ in self._executing})
            logger.error(
                "model %r: stopping it has waited %ss for %s, whose execute() has not "
                "returned since it was cancelled; a backend must let Cancelled propagate (does "
                "it shield its work, or catch Cancelled?). Still waiting for it",
                self.config.name,
                CLEANUP_S,
                ", ".join(busy) or "its workers",
            )
            await self._finished.wait()

    def executing(self) -> list[tuple[str, float]]:
        """Each execution in progress: its instance's label and how long it has run, in seconds.

        For a process that must end while some still run (``trioinfer serve``'s
        exit timeout): what to name in its last log line.
        """
        now = self.clock.current_time()
        return [(replica.label, now - started) for replica, started, *_ in self._executing]

    def retry_after(self) -> float:
        """A guess at when an instance could take a request refused now, in seconds.

        The first serving instance to come free, then the queue ahead, in
        executions of the usual size spread over the instances. A running
        execution ends when executions of its rows have taken so far, or when
        its last caller's deadline passes, if sooner (a caller's own deadline
        aborts it then; a queue timeout does not, so this may be early).
        """
        cost, now = self._cost, self.clock.current_time()
        free_at = {id(r): now for r in self.replicas if r.serving} or {id(self.replicas[0]): now}
        for replica, started, rows, deadline in self._executing:
            if id(replica) in free_at:
                ends = min(started + cost.estimate(rows), deadline)
                free_at[id(replica)] = max(free_at[id(replica)], ends)
        first = max(min(free_at.values()) - now, 0.0)
        executions = math.ceil(len(self.queue) / (cost.requests * len(free_at)))
        return first + executions * cost.estimate(cost.rows)

    def statistics(self) -> ModelStatistics:
        """A snapshot of this model's counters."""
        here = self._answered_here
        return ModelStatistics(
            name=self.config.name,
            devices=self.devices,
            queued=len(self.queue),
            in_flight=len(self._in_flight),
            succeeded=self.succeeded,
            failed=self.failed,
            cancelled=self.cancelled,
            refused=self.refused,
            expired=self.expired,
            executions=self.executions + here.count,
            successful_executions=self.successful_executions + here.count,
            mean_execution_s=self._mean_execution_s,
            buffers_allocated=self._pool.allocated,
            buffers_reused=self._pool.reused,
            queue_duration=self._queue_duration.snapshot(zeros=here.count),
            compute_duration=self._compute_duration.snapshot(here),
            request_duration=self._request_duration.snapshot(here),
            batch_size=self._batch_size.snapshot(),
            replicas=tuple(replica.statistics() for replica in self.replicas),
            fallbacks=dict(self.fallbacks),
            inferences=self.inferences,
            out_of_service=self.out_of_service,
        )


#: The first-party plugins that pass a lone request on an idle instance straight
#: through: FIFO hands it out as pushed, NoBatcher at once and alone, NoFallback
#: runs it once. Named, not imported: the core imports no plugin.
_PASS_ALONE = frozenset(
    {
        "trioinfer_scheduling._fifo.FifoScheduler",
        "trioinfer_batching.NoBatcher",
        "trioinfer_fallback.NoFallback",
    }
)


def _passes_alone(*plugins: object) -> bool:
    # Whether every one of *plugins* is one of _PASS_ALONE (a subclass is not).
    return all(
        f"{type(plugin).__module__}.{type(plugin).__qualname__}" in _PASS_ALONE
        for plugin in plugins
    )


def starts_inline(replica: Replica) -> bool:
    """Whether *replica*'s instance says its execution may end before it first suspends."""
    return getattr(replica._backend_instance, "starts_inline", False) is True


def inline_budget(replica: Replica) -> float:
    """The inline slice (seconds) *replica*'s instance keeps: its own, or `DEFAULT_SLICE_S`.

    One without a slice of its own (``inline_budget_s``, a number of seconds,
    never a flag) never yields, and requests whose every step runs so would
    never park: the engine keeps the slice for it, lest callers looping on a
    pipeline of such steps keep every other task waiting. So does one whose
    slice is not a positive, finite number (``inf`` or ``nan`` would never
    yield either).
    """
    budget = getattr(replica._backend_instance, "inline_budget_s", None)
    if not isinstance(budget, (float, int)) or isinstance(budget, bool) or not 0 < budget < _INF:
        return DEFAULT_SLICE_S
    return budget


def runs_inline(replica: Replica) -> bool:
    """Whether *replica*'s instance never suspends in ``execute`` (an ``InlineInstance``)."""
    return getattr(replica._backend_instance, "runs_inline", False) is True


def _execution(
    replica: Replica, inputs: Mapping[str, Any], wanted: tuple[str, ...]
) -> Coroutine[Any, Any, Outputs]:
    # The backend call of an execution whose requests all named outputs (*wanted*:
    # their union): an OutputsInstance computes those alone; any other, every output.
    execute_outputs = replica._outputs
    if execute_outputs is None:
        return replica._backend_instance.execute(inputs)
    return cast(Coroutine[Any, Any, Outputs], execute_outputs(inputs, wanted))


def _wanted(requests: Sequence[Request]) -> tuple[str, ...]:
    # The union of *requests*' requested outputs, in order; empty if one named none.
    first = requests[0].requested_outputs
    if len(requests) == 1 or not first:
        return first
    names = dict.fromkeys(first)
    for request in requests[1:]:
        named = request.requested_outputs
        if not named:
            return ()
        names.update(dict.fromkeys(named))
    return tuple(names)


def _depth(instance: BackendInstance) -> int:
    # Executions the instance accepts at once (see PipelinedInstance); 1 unless it says more.
    depth = instance.pipeline_depth if isinstance(instance, PipelinedInstance) else 1
    return depth if isinstance(depth, int) and depth >= 1 else 1


def _preferred(instance: BackendInstance, model: str) -> tuple[int, ...]:
    # The batch sizes it runs fastest (see TunedInstance), if it says so sensibly:
    # increasing positive integers. Nonsense is ignored, with a warning.
    if not isinstance(instance, TunedInstance):
        return ()
    advertised: object = instance.preferred_batch_sizes
    sizes = tuple(advertised) if isinstance(advertised, tuple | list) else (None,)
    valid = all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes)
    if valid and list(sizes) == sorted(set(sizes)):
        return cast(tuple[int, ...], sizes)
    logger.warning(
        "model %r: its backend instance says preferred_batch_sizes = %r; expected a tuple of "
        "increasing positive integers, so it is ignored",
        model,
        advertised,
    )
    return ()


async def close_instances(model: str, instances: Sequence[BackendInstance]) -> None:
    """Close every instance, shielded from cancellation and bounded by `CLEANUP_S`.

    An instance whose ``aclose()`` raises (a broken contract: it must not) is
    logged with the model and the instance, and the others are closed anyway.
    """
    left = list(instances)
    with anyio.move_on_after(CLEANUP_S, shield=True):
        while left:
            instance = left[0]
            try:
                await instance.aclose()
            except Exception:
                logger.exception(
                    "model %r: closing backend instance %r failed; it may still hold its "
                    "threads or device memory",
                    model,
                    instance,
                )
            del left[0]
    if left:
        logger.error(
            "model %r: closing backend instances took longer than %ss; gave up on %s",
            model,
            CLEANUP_S,
            ", ".join(map(repr, left)),
        )


def _raised(exc: BaseException, where: str) -> str:
    # "raised KeyError in execute(): 'replica 7'". An exception without a message (a
    # bare anyio.WouldBlock from a queue found empty) is said so, not left as ": ".
    said = str(exc)
    return f"raised {type(exc).__name__} in {where}" + (
        f": {said}" if said else ", with no message"
    )


def _not_an_instance(instance: object) -> str | None:
    # What a backend's load() returned instead of a BackendInstance, or None. Checked
    # once per instance at load (and at each re-creation): a None, or a dict for a
    # signature, failed the load with "instances report different signatures" or an
    # unhashable-type TypeError, and a re-creation with an AttributeError.
    if not isinstance(instance, BackendInstance):
        return (
            f"a {type(instance).__name__!r} object, not a trioinfer.abc.BackendInstance "
            "(signature, device, execute() and aclose()): it lacks "
            f"{', '.join(missing_members(instance, BackendInstance))}"
        )
    try:
        signature, device = instance.signature, instance.device
    except Exception as exc:
        return f"an instance whose signature or device raised {type(exc).__name__}: {exc}"
    if not isinstance(signature, ModelSignature):
        return (
            f"an instance whose signature is a {type(signature).__name__!r} object, not a "
            "trioinfer.ModelSignature"
        )
    if not isinstance(device, str) or not device:
        return f"an instance whose device is {device!r}, not a non-empty str such as 'cpu'"
    return None


def _probe_inputs(signature: ModelSignature) -> dict[str, Any]:
    # Zeros of each input's shape: one row, and 1 for every dimension without a fixed size.
    arrays = {}
    for spec in signature.inputs:
        shape = tuple(d if isinstance(d, int) and d > 0 else 1 for d in spec.shape)
        dtype = spec.dtype if spec.dtype is not None else np.dtype(np.float32)
        # A string input's empty element as its requests' are: str, or bytes where
        # they reach the model as bytes (TensorSpec.utf8 false).
        blank = "" if spec.utf8 else b""
        arrays[spec.name] = (
            np.full(shape, blank, dtype=object) if dtype.kind == "O" else np.zeros(shape, dtype)
        )
    return arrays


def _mixed(requests: Sequence[Request]) -> bool:
    # Whether the requests send different sets of inputs (a model's optional ones).
    names = requests[0].inputs.keys()
    return any(r.inputs.keys() != names for r in requests)


def _mixed_inputs(requests: Sequence[Request]) -> ValueError:
    # What a batch of requests that send different sets of inputs fails with.
    sets = sorted({tuple(sorted(r.inputs)) for r in requests})
    return ValueError(
        "its requests send different inputs ("
        + " and ".join(str(list(names)) for names in sets)
        + "), which cannot be concatenated; a batch must hold requests that send the "
        "same inputs (a model's optional ones sent by all or by none)"
    )


def _not_a_batch(batch: object) -> str | None:
    # What a batcher returned instead of a batch of requests from its queue, or None.
    try:
        items = list(cast(Sequence[object], batch))
    except Exception:
        return f"a {type(batch).__name__!r} object, not a sequence of requests"
    odd = [item for item in items if not isinstance(item, Request)]
    if not odd:
        return None
    return (
        f"a batch holding {len(odd)} {type(odd[0]).__name__!r} objects among its "
        f"{len(items)} items, not requests taken from its queue"
    )


def _deadlines(live: Sequence[Request], latest: float) -> float | BatchDeadlines:
    # What current_batch_deadline and current_callers_deadline read for a batch of a
    # model with queue_timeouts: the callers' own latest deadline differs from the
    # batch's only when a row's is a queue timeout (then its caller waits for the run).
    if not any(request._state.queue_timeout for request in live):
        return latest
    return BatchDeadlines(latest, math.inf)


def _backend_error(model: str, request: Request, exc: Exception) -> TrioInferError:
    # What a failed execution's callers get: its error, or a BackendError for any other.
    if isinstance(exc, TrioInferError):
        return _copy_error(exc, cause=exc)
    error = BackendError(
        f"model {model!r} failed on request {request.id!r}: {type(exc).__name__}: {exc}"
    )
    error.__cause__ = exc
    return error


def _copy_error(
    exc: TrioInferError, *, cause: BaseException | None, message: str | None = None
) -> TrioInferError:
    # Each caller gets its own exception object: one object raised in several
    # tasks would collect all their tracebacks. *message*, if given, replaces its text.
    error = type(exc).__new__(type(exc))
    error.__dict__.update(exc.__dict__)
    error.args = exc.args if message is None else (message, *exc.args[1:])
    error.__cause__ = cause
    return error


def _check_rows(model: str, replica: Replica, outputs: Outputs, rows: int) -> None:
    # A batched pipeline's answer (any other model's answer its OutputCheck judges).
    for name, array in outputs.items():
        if array.__class__ is np.ndarray and array.ndim and len(array) == rows:
            continue  # the usual answer, in a few comparisons (every pipeline request)
        shape = tuple(getattr(array, "shape", ()))
        if not shape or shape[0] != rows:
            raise BackendError(
                f"model {model!r}: {replica.label} returned output {name!r} with shape "
                f"{list(shape)} for a batch of {rows} rows; every output of a batched model "
                "must have one row per input row, or no request could be given its own rows "
                "(an output whose first dimension is not the batch must be named differently "
                "from the inputs' in the model; then each request runs alone)"
            )


def _answered(
    answered: list[Outputs],
    computed: Callable[[], object] | None,
    outputs: Outputs,
) -> list[Outputs]:
    # The split of a RequestsInstance's execution: each request's own answer, given
    # (*computed*: tells a sequence batcher that they were computed).
    if computed is not None:
        computed()
    return answered


def _split(requests: Sequence[Request], rows: int, outputs: Outputs) -> list[Outputs]:
    # Views, not copies: each caller's share is a slice of the batch's output.
    # The cut points are worked out once for every output.
    if not outputs:
        return [{} for _ in requests]
    if rows == len(requests) and all(type(a) is np.ndarray for a in outputs.values()):
        # One row each (each has at least one): the output's rows as numpy iterates
        # them, each a view of shape (1, ...), at about half the cost of a slice each.
        if len(outputs) == 1:
            for name, array in outputs.items():
                return [{name: row} for row in array[:, None]]
        if len(outputs) == 2:  # (a label and its scores, say) without a zip per request
            (name, array), (other, second) = outputs.items()
            return [
                {name: row, other: row2}
                for row, row2 in zip(array[:, None], second[:, None], strict=True)
            ]
        names = list(outputs)
        each = [array[:, None] for array in outputs.values()]
        return [dict(zip(names, row, strict=True)) for row in zip(*each, strict=True)]
    cuts = list(itertools.accumulate([r.rows for r in requests], initial=0))
    pairs = list(itertools.pairwise(cuts))
    if len(outputs) == 1:
        for name, array in outputs.items():
            return [{name: array[a:b]} for a, b in pairs]
    names = list(outputs)
    columns = [[array[a:b] for a, b in pairs] for array in outputs.values()]
    return [dict(zip(names, row, strict=True)) for row in zip(*columns, strict=True)]


if TYPE_CHECKING:
    # Where mypy checks that the engine's own classes are what trioinfer.abc
    # promises plugins: a change to either that breaks the promise fails here.
    from . import abc

    def _conforms(
        request: Request,
        queue: RequestQueue,
        scheduler_context: SchedulerContext,
        sequence_context: SequenceContext,
        replica: Replica,
        execution: Execution,
        fallback_context: FallbackContext,
    ) -> None:
        views: tuple[
            abc.Request,
            abc.RequestQueue,
            abc.SchedulerContext,
            abc.SequenceContext,
            abc.Replica,
            abc.Execution,
            abc.FallbackContext,
        ] = (
            request,
            queue,
            scheduler_context,
            sequence_context,
            replica,
            execution,
            fallback_context,
        )
        del views


async def warm_up(
    model: str,
    samples: Sequence[Warmup],
    signature: ModelSignature,
    limits: InputLimits,
    instances: Sequence[BackendInstance],
    labels: Sequence[str],
    *,
    max_batch_size: int | None = None,
) -> None:
    """Run every sample ``count`` times on each instance, instances side by side.

    *signature* is the instances' own (a stateful model's control and state
    inputs included); *labels* name the instances in errors; *max_batch_size*
    (`ModelRunner.max_batch_size`) bounds a sample's ``batch_size``.

    Raises:
        ConfigError: A sample does not fit the model (checked before anything runs).
        BackendError: An execution failed or answered with outputs that do not fit
            their declared ones; when several instances fail, the first is named.
    """
    if not samples:
        return
    made = [(sample, sample.arrays(model, signature, limits, max_batch_size)) for sample in samples]
    check = OutputCheck(model, signature)
    errors: list[BackendError] = []

    async def run(instance: BackendInstance, label: str) -> None:
        streams = isinstance(instance, StreamingInstance) and instance.decoupled is True
        for sample, arrays in made:
            for _ in range(sample.count):
                try:
                    if streams:
                        assert isinstance(instance, StreamingInstance)
                        responses = instance.stream(arrays)
                        try:
                            async for outputs in responses:
                                check.check(outputs, 0, _Named(label))  # each response alone
                        finally:
                            await responses.aclose()
                    else:
                        outputs = await instance.execute(arrays)
                        rows = sample.batch_size if signature.batched else 0  # 0: unbatched
                        check.check(outputs, rows, _Named(label))
                except Exception as exc:
                    reason = (
                        str(exc)
                        if isinstance(exc, TrioInferError)
                        else (f"{type(exc).__name__}: {exc}")
                    )
                    error = BackendError(
                        f"model {model!r}: warm-up sample {sample.name!r} failed on {label}: "
                        f"{reason}"
                    )
                    error.__cause__ = exc
                    errors.append(error)
                    return

    async with anyio.create_task_group() as tg:
        for instance, label in zip(instances, labels, strict=True):
            tg.start_soon(run, instance, label)
    if errors:
        raise errors[0]


@attrs.frozen
class _Named:
    label: str
