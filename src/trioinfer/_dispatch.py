"""What a fallback plugin works with: replicas, one batch's execution, and its context.

The engine keeps one [`Replica`][trioinfer.Replica] per loaded backend
instance. A fallback plugin sees each batch as an
[`Execution`][trioinfer.Execution] that it can run on the replica the engine
chose or on another one, answer per request, or fail; through its
[`FallbackContext`][trioinfer.FallbackContext] it may take a failing replica
out of service, probe it, re-create it, and put it back. Policy (when to
retry, when a breaker opens) lives in the plugin; the mechanism (slots,
dispatch, exactly-once answers) lives here, in the engine.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, final

import attrs
import numpy as np

from ._config import Placement
from ._exceptions import BackendError, PluginError
from ._request import Outputs, Request, Status
from ._tensors import ModelSignature
from ._threads import EventLike
from .abc import BackendInstance

if TYPE_CHECKING:
    from ._runner import ModelRunner

logger = logging.getLogger("trioinfer")

ReplicaState = Literal["serving", "out"]


@final
class _Slot:
    """A semaphore without a checkpoint on the uncontended path, served in FIFO order."""

    __slots__ = ("_new_event", "_waiters", "free")

    def __init__(self, size: int, new_event: Callable[[], EventLike]) -> None:
        self.free = size
        self._new_event = new_event
        self._waiters: collections.deque[EventLike] = collections.deque()

    async def acquire(self) -> None:
        if self.free > 0 and not self._waiters:
            self.free -= 1
            return
        event = self._new_event()
        self._waiters.append(event)
        try:
            await event.wait()
        except BaseException:
            try:
                self._waiters.remove(event)
            except ValueError:
                self.release()  # it was handed to us as we were cancelled: pass it on
            raise

    def release(self) -> None:
        if self._waiters:
            self._waiters.popleft().set()  # handed over; `free` stays as it is
        else:
            self.free += 1


@final
class Replica:
    """One loaded backend instance of a model, as dispatch and fallback plugins see it.

    Only the engine creates replicas. A replica is *serving* (it takes
    batches) or *out* (a fallback took it out of service, e.g. its circuit
    breaker opened; it takes no new batch until put back).

    Attributes:
        index: The instance's number within its model (0, 1, ...).
        placement: Where it was asked to run.
        state: ``"serving"`` or ``"out"``.
        reason: Why it is out (``None`` while serving).
        executions: Executions (of batches and probes) started on it.
        failures: Executions whose backend call raised an error. One cancelled
            (its callers left, or a fallback's ``timeout`` ran out) is not counted.
        taken_out: Times it was taken out of service.
        recreated: Times its backend instance was re-created.
    """

    __slots__ = (
        "_back",
        "_backend_instance",
        "_forming",
        "_retry_at",
        "_slot",
        "executions",
        "failures",
        "index",
        "placement",
        "reason",
        "recreated",
        "state",
        "taken_out",
    )

    def __init__(
        self,
        backend_instance: BackendInstance,
        placement: Placement,
        slots: int,
        new_event: Callable[[], EventLike],
    ) -> None:
        self._backend_instance = backend_instance
        self.placement = placement
        self.index = placement.index
        self._slot = _Slot(slots, new_event)
        self.state: ReplicaState = "serving"
        self.reason: str | None = None
        self._back: EventLike | None = None
        self._retry_at = math.inf
        self._forming: Any = None
        self.executions = 0
        self.failures = 0
        self.taken_out = 0
        self.recreated = 0

    def __repr__(self) -> str:
        return f"<Replica {self.index} on {self.device} ({self.state})>"

    @property
    def device(self) -> str:
        """Where the instance really runs (``"cpu"`` after a fallback from ``"cuda:0"``)."""
        return self._backend_instance.device

    @property
    def capacity(self) -> float:
        """Its relative throughput, from the model's instance config."""
        return self.placement.capacity

    @property
    def serving(self) -> bool:
        """Whether it takes batches."""
        return self.state == "serving"

    @property
    def label(self) -> str:
        """A short name for logs and response metadata: ``"instance 1 (cpu)"``."""
        return f"instance {self.index} ({self.device})"

    def statistics(self) -> ReplicaStatistics:
        """A snapshot of its state and counters."""
        return ReplicaStatistics(
            index=self.index,
            device=self.device,
            state=self.state,
            reason=self.reason,
            executions=self.executions,
            failures=self.failures,
            taken_out=self.taken_out,
            recreated=self.recreated,
        )


@attrs.frozen
class ReplicaStatistics:
    """A snapshot of one [`Replica`][trioinfer.Replica], as in ``ModelStatistics.replicas``.

    Attributes:
        index: The instance's number within its model.
        device: Where it really runs.
        state: ``"serving"`` or ``"out"``.
        reason: Why it is out, or ``None``.
        executions: Executions started on it (batches and probes).
        failures: Executions whose backend call raised an error. One cancelled
            (its callers left, or a fallback's ``timeout`` ran out) is not counted.
        taken_out: Times it was taken out of service.
        recreated: Times its backend instance was re-created.
    """

    index: int
    device: str
    state: ReplicaState
    reason: str | None
    executions: int
    failures: int
    taken_out: int
    recreated: int


@final
class Execution:
    """One batch on its way through the model's fallback plugin.

    The engine formed the batch and chose `replica`; the fallback's
    ``execute(execution)`` must see that every request in it gets an answer:
    by `run()` (outputs from a replica), by `respond()` (outputs from
    elsewhere), or by raising, which fails every request still pending with
    that error. Only the engine creates executions.

    Attributes:
        requests: The batch's requests, in the batch's order.
        replica: The replica the engine chose for it.
    """

    __slots__ = ("_runner", "replica", "requests")

    def __init__(self, runner: ModelRunner, requests: Sequence[Request], replica: Replica) -> None:
        self._runner = runner
        self.requests = requests
        self.replica = replica

    def pending(self) -> list[Request]:
        """The requests still waiting for an answer (not answered, caller still there)."""
        return [r for r in self.requests if r._state.status is Status.RUNNING]

    def deadline(self) -> float:
        """The latest deadline among pending requests (``math.inf`` if one has none).

        Past it nobody waits for this batch, so a retry must not start later.
        """
        return max((r.deadline for r in self.pending()), default=-math.inf)

    async def run(self, replica: Replica | None = None) -> bool:
        """Run the pending requests on *replica* (by default the chosen one) and answer them.

        Waits until the replica is free to take another execution (and its
        device, under ``device_limits``). Then, right before the backend call,
        requests whose callers left are dropped, and those whose deadline has
        passed end with [`DeadlineExceeded`][trioinfer.DeadlineExceeded]: no
        row is computed for them; when none is left, nothing runs. A replica
        that is out may be used (a probe, say); dispatch never chooses one.

        Returns:
            Whether it ran anything: ``False`` when no request was left to
            run (say nothing of the replica's health then).

        Raises:
            Exception: What the backend raised (usually
                [`BackendError`][trioinfer.BackendError]); nobody was answered.
        """
        return await self._runner._attempt(self, self.replica if replica is None else replica)

    def respond(self, request: Request, outputs: Mapping[str, Any], *, via: str) -> None:
        """Answer *request* with *outputs* that did not come from a replica of this model.

        *via* names where they came from (``"default"``, ``"model small"``) and
        is recorded as a fallback step. Arrays are converted with
        ``numpy.asarray`` and must cover every model output.

        Raises:
            PluginError: *request* is not in this execution, or outputs are missing.
        """
        if request not in self.requests:
            raise PluginError(f"request {request.id!r} is not part of this execution")
        missing = [s.name for s in self._runner.signature.outputs if s.name not in outputs]
        if missing:
            raise PluginError(
                f"fallback answered request {request.id!r} of model "
                f"{self._runner.config.name!r} without outputs {missing}"
            )
        if request._state.status is not Status.RUNNING:
            return
        self.note(via, [request])
        self._runner._finish(
            request, outputs={name: np.asarray(value) for name, value in outputs.items()}
        )

    def note(self, step: str, requests: Sequence[Request] | None = None) -> None:
        """Record a fallback step, such as ``"failover instance 1 (cpu)"``, on pending requests.

        The steps reach the caller in
        [`InferenceResult.fallbacks`][trioinfer.InferenceResult] (and HTTP
        response parameters) and are counted in the model's statistics by
        their first word.
        """
        counts = self._runner.fallbacks
        kind = step.split(" ", 1)[0]
        for request in self.pending() if requests is None else requests:
            state = request._state
            state.fallbacks = (*state.fallbacks, step)
            counts[kind] = counts.get(kind, 0) + 1

    async def infer_elsewhere(self, model: str, request: Request) -> Outputs:
        """Run one pending request on another loaded *model* and return its outputs.

        The request keeps its deadline, priority, tenant and id. A request
        that is itself a failover from another model is not sent on again,
        so that two models failing over to each other cannot loop.

        Raises:
            BackendError: *request* came from a failover already.
            TrioInferError: What the other model's ``infer`` raised.
        """
        if request._state.failover:
            raise BackendError(
                f"request {request.id!r} was failed over to model "
                f"{self._runner.config.name!r} already; it is not sent on again"
            )
        infer = self._runner.infer_elsewhere
        if infer is None:  # pragma: no cover  # every engine sets it
            raise BackendError("this runner is not part of an engine")
        outputs: Outputs = await infer(model, request)
        return outputs


@final
class FallbackContext:
    """What a fallback plugin may know and do about its model's replicas.

    A fallback with an ``attach(context)`` method gets one when its model
    loads, before the first execution. Only the engine creates it.
    """

    __slots__ = ("_runner",)

    def __init__(self, runner: ModelRunner) -> None:
        self._runner = runner

    @property
    def model(self) -> str:
        """The model's name."""
        return self._runner.config.name

    @property
    def signature(self) -> ModelSignature:
        """The model's inputs and outputs."""
        return self._runner.signature

    @property
    def replicas(self) -> Sequence[Replica]:
        """Every replica, by index."""
        return self._runner.replicas

    def current_time(self) -> float:
        """The engine's clock (the event loop's, so a MockClock in tests)."""
        return self._runner.clock.current_time()

    def start_soon(self, fn: Callable[..., Awaitable[object]], *args: object) -> None:
        """Run ``fn(*args)`` as a background task of the model, in the engine's task group.

        It is cancelled when the model is unloaded or the engine closes; an
        exception it raises is logged and does not stop the model.

        Raises:
            RuntimeError: The model is not running (not yet started, or stopped).
        """
        self._runner.start_background(fn, *args)

    def take_out(self, replica: Replica, reason: str, *, retry_after: float = 1.0) -> None:
        """Take *replica* out of service: dispatch sends it no new batch.

        A batch running on it goes on. When no serving replica is left, the
        model's queued requests fail with [`CircuitOpen`][trioinfer.CircuitOpen]
        at once and new ones are refused with it, carrying *retry_after*
        (seconds until the replica may be back) as their hint. Logged once per
        change, at warning level.
        """
        self._runner.take_out(replica, reason, retry_after)

    def put_back(self, replica: Replica) -> None:
        """Return *replica* to service; logged once, at info level."""
        self._runner.put_back(replica)

    async def probe(
        self, replica: Replica, inputs: Mapping[str, np.ndarray[Any, Any]] | None = None
    ) -> None:
        """Run one execution on *replica* that answers nobody, to test whether it works.

        *inputs* default to zeros of the model's input shapes (one row, and 1
        for every dimension without a fixed size). Waits until the replica is free.

        Raises:
            Exception: What the backend raised.
        """
        await self._runner.probe(replica, inputs)

    async def recreate(self, replica: Replica) -> None:
        """Close *replica*'s backend instance and load a new one at the same placement.

        For a session that died. Waits until nothing runs on the replica; its
        state does not change (put it back after a successful probe).

        Raises:
            BackendError: The new instance could not be loaded, or reports
                another signature; the old one is closed anyway.
        """
        await self._runner.recreate(replica)
