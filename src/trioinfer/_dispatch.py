"""What a fallback plugin works with: replicas, one batch's execution, and its context.

The engine keeps one `Replica` per loaded backend instance. A fallback plugin
sees each batch as an `Execution` that it can run on the replica the engine
chose or on another one, answer per request, or fail; through its
`FallbackContext` it may take a failing replica out of service, probe it,
re-create it, and put it back. Plugins see these through the Protocols of the
same names in `trioinfer.abc`. Policy (when to retry, when a breaker opens)
lives in the plugin; the mechanism (slots, dispatch, exactly-once answers)
lives in the engine, behind `RunnerPort`: the one door from these objects to
their model's runner.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, cast, final

import attrs
import numpy as np

from ._config import ModelConfig, Placement
from ._exceptions import BackendError, PluginContractError
from ._registry import plugin_label
from ._request import NO_PARAMETERS, Outputs, Request
from ._tensors import ModelSignature, output_misfit
from ._threads import EventLike, LoopClock
from ._util import NoPublicConstructor
from .abc import BackendInstance, ReplicaState, Status
from .abc import Replica as ReplicaView
from .abc import Request as RequestView

# Enum members read once: Status.X costs a metaclass lookup on every use (Python 3.11).
_RUNNING = Status.RUNNING

logger = logging.getLogger("trioinfer")


class RunnerPort(Protocol):
    """What an execution or a fallback's context may ask of its model's runner.

    `trioinfer._runner.ModelRunner` implements it. The objects in this module
    reach the runner through these names only, so that the runner's
    internals can change without them.
    """

    @property
    def config(self) -> ModelConfig:
        """The model's configuration."""
        ...

    @property
    def signature(self) -> ModelSignature:
        """The model's inputs and outputs."""
        ...

    @property
    def replicas(self) -> Sequence[Replica]:
        """Every replica, by index."""
        ...

    @property
    def clock(self) -> LoopClock:
        """The event loop's clock."""
        ...

    @property
    def sources(self) -> Mapping[str, str | None]:
        """The distribution that declared each of the model's plugins, by kind; None if unknown."""
        ...

    @property
    def fallbacks(self) -> dict[str, int]:
        """Fallback steps taken, by their first word (mutable: executions count into it)."""
        ...

    async def attempt(self, execution: Execution, replica: Replica) -> bool:
        """Run *execution*'s pending requests once on *replica* and answer them; whether any ran."""
        ...

    def finish(
        self,
        request: Request,
        *,
        outputs: Outputs | None = None,
        error: BaseException | None = None,
    ) -> None:
        """End *request* with *outputs* or *error*, unless it ended already."""
        ...

    async def infer_elsewhere(self, model: str, request: Request) -> Request:
        """Run *request* on another loaded model: the request that answered it there."""
        ...

    def start_background(self, fn: Callable[..., Awaitable[object]], *args: object) -> None:
        """Run ``fn(*args)`` in the model's task group."""
        ...

    def take_out(self, replica: Replica, reason: str, retry_after: float) -> None:
        """Stop dispatching to *replica*."""
        ...

    def put_back(self, replica: Replica) -> None:
        """Return *replica* to service."""
        ...

    async def probe(self, replica: Replica, inputs: Mapping[str, Any] | None) -> None:
        """One execution on *replica* that answers nobody."""
        ...

    async def recreate(self, replica: Replica) -> None:
        """Load a fresh backend instance for *replica*."""
        ...


@final
class _Slot:
    """A semaphore without a checkpoint on the uncontended path, served in FIFO order."""

    __slots__ = ("_new_event", "_waiters", "free")

    def __init__(self, size: int, new_event: Callable[[], EventLike]) -> None:
        self.free = size
        self._new_event = new_event
        self._waiters: collections.deque[EventLike] = collections.deque()

    def try_acquire(self) -> bool:
        # acquire()'s uncontended path without a coroutine: True if it took a slot.
        if self.free > 0 and not self._waiters:
            self.free -= 1
            return True
        return False

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
class Replica(metaclass=NoPublicConstructor):
    """One loaded backend instance of a model: the engine's `trioinfer.abc.Replica`.

    The underscored fields are the runner's: its slot, its backend instance,
    and when it comes back into service.
    """

    __slots__ = (
        "_back",
        "_backend_instance",
        "_forming",
        "_gate",
        "_mortal",
        "_outputs",
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
        self.serve_with(backend_instance)
        self.placement = placement
        self.index = placement.index
        self._slot = _Slot(slots, new_event)
        self.state: ReplicaState = "serving"
        self.reason: str | None = None
        self._back: EventLike | None = None
        self._retry_at = math.inf
        self._forming: Any = None
        # Its rate limiter's gate (trioinfer._resources), set by the engine when its
        # instance needs resources: then the runner takes it in place of the device's.
        self._gate: Any = None
        self.executions = 0
        self.failures = 0
        self.taken_out = 0
        self.recreated = 0

    def __repr__(self) -> str:
        return f"<Replica {self.index} on {self.device} ({self.state})>"

    def serve_with(self, backend_instance: BackendInstance) -> None:
        """Hold *backend_instance* from now on (the one loaded, or one re-created)."""
        self._backend_instance = backend_instance
        # Whether it may say it is gone: asked once, since `gone` is read before each
        # batch, and a getattr that misses costs an exception raised and caught.
        self._mortal = hasattr(backend_instance, "gone")
        # Its execute_outputs (an OutputsInstance), or None: asked once for the same
        # reason, since executions whose requests named outputs look for it.
        self._outputs: Callable[..., Any] | None = getattr(
            backend_instance, "execute_outputs", None
        )

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
    def gone(self) -> str | None:
        """Why its backend instance can serve no more (its ``gone``), or None while it lives.

        An instance run in a process of its own (a Ray actor) may lose it; the
        batches sent to it then fail until a fallback re-creates it or the
        model is loaded again, and meanwhile it counts as out of service in
        statistics and readiness.
        """
        if not self._mortal:
            return None
        gone = getattr(self._backend_instance, "gone", None)
        return gone if isinstance(gone, str) and gone else None

    @property
    def label(self) -> str:
        """A short name for logs and response metadata: ``"instance 1 (cpu)"``."""
        return f"instance {self.index} ({self.device})"

    def statistics(self) -> ReplicaStatistics:
        """A snapshot of its state and counters."""
        gone = self.gone if self.serving else None
        return ReplicaStatistics(
            index=self.index,
            device=self.device,
            state=self.state if gone is None else "out",
            reason=self.reason if gone is None else f"gone: {gone}",
            executions=self.executions,
            failures=self.failures,
            taken_out=self.taken_out,
            recreated=self.recreated,
        )


@attrs.frozen
class ReplicaStatistics:
    """A snapshot of one model instance's state and counters, as in ``ModelStatistics.replicas``.

    Attributes:
        index: The instance's number within its model.
        device: Where it really runs.
        state: ``"serving"`` or ``"out"``: taken out by a fallback, or gone (its
            backend instance says it can serve no more: a Ray actor that died), where
            the batches sent to it fail until a fallback re-creates it or the model
            is loaded again.
        reason: Why it is out (``"gone: ..."`` for a lost instance), or ``None``.
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
class Execution(metaclass=NoPublicConstructor):
    """One batch on its way through the model's fallback: the engine's `trioinfer.abc.Execution`.

    Created per batch, so it stays small: five slots, and a constructor that
    costs what an ordinary one does (see `NoPublicConstructor`).
    """

    __slots__ = ("_elsewhere", "_port", "_raised", "replica", "requests")

    def __init__(self, port: RunnerPort, requests: Sequence[Request], replica: Replica) -> None:
        self._port = port
        self.requests = requests
        self.replica = replica
        # What its runs raised (a backend's errors, for the fallback to handle): an
        # exception out of the fallback that is none of these is the fallback's own.
        self._raised: list[BaseException] | None = None
        # Each request's answer from another model (infer_elsewhere), by request, with who
        # made it and its response parameters, which only that answer, given to
        # respond(), carries: kept here, not on the request, which a run answers too.
        self._elsewhere: dict[Request, tuple[Outputs, Any, Mapping[str, Any]]] | None = None

    # What each method promises is written once, in trioinfer.abc.Execution.

    def pending(self) -> list[Request]:
        """The requests still waiting for an answer."""
        return [r for r in self.requests if r._state.status is _RUNNING]

    def deadline(self) -> float:
        """The latest deadline among pending requests."""
        return max((r.deadline for r in self.pending()), default=-math.inf)

    async def run(self, replica: ReplicaView | None = None) -> bool:
        """Run the pending requests on *replica* (by default the chosen one) and answer them."""
        # Only the engine makes replicas, so any a fallback passes is one of ours.
        chosen = self.replica if replica is None else cast(Replica, replica)
        if self._raised is not None:
            # A run after one that failed: response parameters its backend gave a
            # request then are not this run's answer's (it may give none).
            for request in self.pending():
                request._state.response_parameters = NO_PARAMETERS
        return await self._port.attempt(self, chosen)

    def respond(self, request: RequestView, outputs: Mapping[str, Any], *, via: str) -> None:
        """Answer *request* with *outputs* that did not come from a replica of this model."""
        port = self._port
        if request not in self.requests:
            raise self._broken(f"answered request {request.id!r}, which is not part of this batch")
        # The outputs the request asked for (all where it named none): another model's
        # answer may hold those alone (it computes what it was asked, as the replicas do).
        wanted = request.requested_outputs
        missing = [
            s.name
            for s in port.signature.outputs
            if s.name not in outputs and (not wanted or s.name in wanted)
        ]
        if missing:
            raise self._broken(
                f"answered request {request.id!r} of model {port.config.name!r} without "
                f"outputs {missing}"
            )
        ours = cast(Request, request)  # one of self.requests, checked above
        state = ours._state
        if state.status is not _RUNNING:
            return
        theirs = None if self._elsewhere is None else self._elsewhere.get(ours)
        if theirs is not None and theirs[0] is outputs:
            _, state.served_by, state.response_parameters = theirs
        else:
            # Not the answer another model gave it (a default, the fallback's own):
            # no model's instance made it, and it has no response parameters (a
            # failed run's are not its).
            state.served_by, state.response_parameters = None, NO_PARAMETERS
        arrays = {name: np.asarray(value) for name, value in outputs.items()}
        # Checked as a backend's answer is: a caller gets what the metadata says.
        signature = port.signature
        rows = ours.rows if signature.batched else 0
        for spec in signature.outputs:
            if spec.name not in arrays:
                continue  # one the request did not ask for (checked above)
            problem = output_misfit(spec, arrays[spec.name], rows)
            if problem is not None:
                raise self._broken(
                    f"answered request {request.id!r} of model {port.config.name!r} "
                    f"({via}) with output {spec.name!r} {problem}"
                )
        self.note(via, [ours])
        port.finish(ours, outputs=arrays)

    def _broken(self, what: str) -> PluginContractError:
        # Not logged here: a fallback may catch it (resilient tries whether another
        # model's outputs fit); the runner logs one that escapes the fallback.
        fallback = self._port.config.fallback
        return PluginContractError(
            f"{plugin_label('fallbacks', fallback, self._port.sources.get('fallbacks'))} of "
            f"model {self._port.config.name!r} {what}",
            kind="fallbacks",
            plugin=fallback,
        )

    def note(self, step: str, requests: Sequence[RequestView] | None = None) -> None:
        """Record a fallback step on pending requests, and count it by its first word."""
        counts = self._port.fallbacks
        kind = step.split(" ", 1)[0]
        # Only the engine makes requests, so any a fallback passes is one of ours.
        for request in self.pending() if requests is None else cast(Sequence[Request], requests):
            state = request._state
            state.fallbacks = (*state.fallbacks, step)
            counts[kind] = counts.get(kind, 0) + 1

    async def infer_elsewhere(self, model: str, request: RequestView) -> Outputs:
        """Run one pending request on another loaded *model*, unless it failed over already."""
        ours = cast(Request, request)  # only the engine makes requests
        if ours._state.failover:
            raise BackendError(
                f"request {request.id!r} was failed over to model "
                f"{self._port.config.name!r} already; it is not sent on again"
            )
        answered = await self._port.infer_elsewhere(model, ours)
        theirs = answered._state
        outputs = theirs.outputs
        assert outputs is not None  # an answered request's
        if self._elsewhere is None:
            self._elsewhere = {}
        self._elsewhere[ours] = (outputs, (model, theirs.served_by), theirs.response_parameters)
        return outputs


@final
class FallbackContext(metaclass=NoPublicConstructor):
    """What a fallback may know and do about its model's replicas.

    The engine's `trioinfer.abc.FallbackContext`; its methods are documented there.
    """

    __slots__ = ("_port",)

    def __init__(self, port: RunnerPort) -> None:
        self._port = port

    @property
    def model(self) -> str:
        """The model's name."""
        return self._port.config.name

    @property
    def signature(self) -> ModelSignature:
        """The model's inputs and outputs."""
        return self._port.signature

    @property
    def replicas(self) -> Sequence[Replica]:
        """Every replica, by index."""
        return self._port.replicas

    def current_time(self) -> float:
        """The engine's clock (the event loop's, so a MockClock in tests)."""
        return self._port.clock.current_time()

    def start_soon(self, fn: Callable[..., Awaitable[object]], *args: object) -> None:
        """Run ``fn(*args)`` as a background task of the model."""
        self._port.start_background(fn, *args)

    # Only the engine makes replicas, so any a fallback passes is one of ours.

    def take_out(self, replica: ReplicaView, reason: str, *, retry_after: float = 1.0) -> None:
        """Take *replica* out of service."""
        self._port.take_out(cast(Replica, replica), reason, retry_after)

    def put_back(self, replica: ReplicaView) -> None:
        """Return *replica* to service."""
        self._port.put_back(cast(Replica, replica))

    async def probe(
        self, replica: ReplicaView, inputs: Mapping[str, np.ndarray[Any, Any]] | None = None
    ) -> None:
        """Run one execution on *replica* that answers nobody."""
        await self._port.probe(cast(Replica, replica), inputs)

    async def recreate(self, replica: ReplicaView) -> None:
        """Load a new backend instance for *replica*."""
        await self._port.recreate(cast(Replica, replica))
