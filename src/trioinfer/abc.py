"""The plugin contracts: what a backend, scheduler, batcher or fallback must do.

Each contract is a `typing.Protocol`; each method's docstring is its
spec: when the engine calls it, whether it may block, what it raises. A plugin
is an object the registry gets by calling the entry point's target: backends
with no arguments (they get the model's ``backend_options`` at load), and
schedulers, batchers and fallbacks with the model's ``scheduler_options``,
``batcher_options`` or ``fallback_options`` as keyword arguments. A class is
the usual target.

A plugin may do more than its contract asks through an optional hook, such as
a scheduler's ``attach(context)``. Each hook is a Protocol here too
([`AttachableScheduler`][trioinfer.abc.AttachableScheduler], ...): the engine
looks for exactly these, and mypy checks a plugin that declares one.

What a plugin is handed by the engine (a request, the queue, a context, an
execution, a replica) is declared here as a Protocol as well, so that this
module depends on no part of the engine; plugin authors import those from
[`trioinfer.lowlevel`][trioinfer.lowlevel], with the tools a backend needs.
Conformance checks for each contract are in [`trioinfer.testing`][trioinfer.testing].
"""

from __future__ import annotations

import enum
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

# Values only: configuration and signatures. This module imports no engine module,
# so that a contract can never come to depend on how the engine implements it.
from ._config import ModelConfig, Placement
from ._sequence import SequenceFlags
from ._tensors import ModelSignature

__all__ = [
    "AssemblingBatcher",
    "AttachableBatcher",
    "AttachableFallback",
    "AttachableScheduler",
    "Backend",
    "BackendInstance",
    "Batcher",
    "BoundedBatcher",
    "ConfigCompletingBackend",
    "Fallback",
    "InlineInstance",
    "OutputsInstance",
    "PipelinedInstance",
    "RecoveringFallback",
    "RequestsInstance",
    "Scheduler",
    "SequenceBatcher",
    "StreamingInstance",
    "TunedInstance",
]

Arrays = Mapping[str, np.ndarray[Any, Any]]
Outputs = dict[str, np.ndarray[Any, Any]]
#: What a batcher's ``assemble`` returns to cut a batch's outputs into one mapping per request.
Split = Callable[[Arrays], Sequence[Outputs]]
ReplicaState = Literal["serving", "out"]


# -- what the engine hands a plugin ----------------------------------------------------
# Exported by trioinfer.lowlevel; defined here so that the contracts below can name them.


class Status(enum.Enum):
    """Where a request is on its path through the engine."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"


class Request(Protocol):
    """One call of [`Engine.infer()`][trioinfer.Engine.infer], as plugins see it.

    Read-only. Requests compare and hash by identity, so a scheduler can key a
    dict by them. Only the engine makes them
    ([`trioinfer.testing.make_request()`][trioinfer.testing.make_request] makes
    them for a plugin's tests).
    """

    @property
    def model(self) -> str:
        """The model's name."""
        ...

    @property
    def inputs(self) -> Arrays:
        """The validated inputs, by input name."""
        ...

    @property
    def id(self) -> str:
        """The caller's request id, or a generated one."""
        ...

    @property
    def priority(self) -> int:
        """Higher runs sooner under schedulers that order by priority; default 0."""
        ...

    @property
    def tenant(self) -> str | None:
        """Who the request is for, for fair-share scheduling; ``None`` if not given."""
        ...

    @property
    def deadline(self) -> float:
        """The caller's effective deadline on the engine's clock (``math.inf`` when none)."""
        ...

    @property
    def arrival(self) -> float:
        """When the request was accepted, on the same clock."""
        ...

    @property
    def rows(self) -> int:
        """How many rows (batch entries) the request carries."""
        ...

    @property
    def sequence(self) -> int:
        """A number that grows with every request made in this process: the order they were made in.

        Schedulers may break ties with it (the ``deadline`` scheduler runs
        equal deadlines in this order). It never changes; a copy of a request
        (``copy.copy``, a pickle round trip) keeps it, so do not queue a copy
        beside the original.
        """
        ...

    @property
    def sequence_flags(self) -> SequenceFlags | None:
        """The sequence the request belongs to (a stateful model's), or ``None``."""
        ...

    @property
    def parameters(self) -> Mapping[str, bool | int | float | str]:
        """The caller's request parameters (Triton's parameters extension), read-only.

        An empty mapping when the caller gave none. What they mean is the
        model's business: a backend hands them to the model (the ``python``
        backend does) or ignores them (``onnxruntime`` does, as Triton's does).
        """
        ...

    @property
    def requested_outputs(self) -> tuple[str, ...]:
        """The outputs the caller asked for (``engine.infer(outputs=...)``); empty: all.

        Triton's requested outputs. The caller gets those alone, so a backend
        whose model can skip the others may: a `RequestsInstance` may answer
        the request with these outputs alone (any others it answers with are
        dropped), and an `OutputsInstance` is asked for them alone where every
        request of an execution named some. Any other backend answers with
        every output, as ever.
        """
        ...

    @property
    def status(self) -> Status:
        """Queued, running or done."""
        ...

    @property
    def abandoned(self) -> bool:
        """Whether the caller has stopped waiting (it was cancelled)."""
        ...


class RequestQueue(Protocol):
    """A model's waiting requests, as a batcher takes them.

    It hands out requests in the scheduler's order and fails those whose
    deadline passed instead of handing them out (with
    [`DeadlineExceeded`][trioinfer.DeadlineExceeded]), so no batcher can send
    an expired request to a backend. Only the engine creates it.
    """

    @property
    def batched(self) -> bool:
        """Whether the model has a batch dimension, so requests may share an execution."""
        ...

    @property
    def preferred_batch_sizes(self) -> tuple[int, ...]:
        """Batch sizes the model's backend runs fastest, as its first instance says.

        See [`TunedInstance`][trioinfer.abc.TunedInstance]; empty when it does not say.
        """
        ...

    @property
    def uniform(self) -> bool:
        """Whether any waiting requests may share a batch as they are.

        True when the model's signature fixes every input's dtype and every
        dimension but the first, and has no optional input, so that every
        request the engine admits agrees on them and sends the same inputs: a
        batcher need not compare requests' input names, shapes and dtypes.
        Otherwise a batch must hold requests that send the same inputs (an
        optional one sent by all or by none), or the engine fails it.
        """
        ...

    def __len__(self) -> int:
        """Requests waiting (some may have expired and not yet been dropped)."""
        ...

    async def wait_not_empty(self) -> None:
        """Wait until at least one request is waiting."""
        ...

    def peek_nowait(self) -> Request:
        """Return the live request that `pop_nowait()` would take, leaving it queued.

        Expired requests at the head are failed on the way, as by `pop_nowait()`.

        Raises:
            anyio.WouldBlock: If no live request is waiting.
        """
        ...

    def pop_nowait(self) -> Request:
        """Take the next live request in the scheduler's order.

        Requests whose deadline has passed are failed with
        [`DeadlineExceeded`][trioinfer.DeadlineExceeded] on the way and never returned.

        Raises:
            anyio.WouldBlock: If no live request is waiting.
        """
        ...

    def take_nowait(self, max_rows: int) -> Sequence[Request]:
        """Take live requests in the scheduler's order while their rows fit in *max_rows*.

        What `pop_nowait()` called until the queue is empty or the next live
        request would bring the rows past *max_rows* (that one stays at the
        head), in one call: the cheap way to fill a batch from a `uniform`
        queue. Expired requests are failed on the way. Returns an empty
        sequence when nothing fits.
        """
        ...

    def put_back(self, requests: Sequence[Request]) -> None:
        """Give back requests taken for a batch that is not dispatched (e.g. cancelled).

        They go back to the head of the queue, in the order given, ahead of
        everything the scheduler holds; the scheduler does not see them again
        (see [`Scheduler.push()`][trioinfer.abc.Scheduler.push]). Requests that
        ended meanwhile (their caller left) are dropped.
        """
        ...


class SchedulerContext(Protocol):
    """What a scheduler may learn about the model it orders requests for.

    An [`AttachableScheduler`][trioinfer.abc.AttachableScheduler] gets one
    once, before its first ``push``; deadline-aware schedulers use it to tell
    whether a request can still finish in time. Only the engine creates it.
    """

    @property
    def model(self) -> str:
        """The model's name."""
        ...

    @property
    def instances(self) -> int:
        """How many instances execute this model's batches in parallel."""
        ...

    def execution_estimate(self) -> float:
        """A moving average of one execution's duration in seconds (0.0 before the first)."""
        ...

    def current_time(self) -> float:
        """The engine's clock (the event loop's, so a MockClock in tests)."""
        ...


class BatcherContext(Protocol):
    """What an [`AttachableBatcher`][trioinfer.abc.AttachableBatcher] learns about its model.

    It gets one once, when the model loads. Only the engine creates it.
    """

    @property
    def model(self) -> str:
        """The model's name."""
        ...

    @property
    def signature(self) -> ModelSignature:
        """The model's signature, as the backend reports it (declared dims included).

        Every request reaching the batcher has passed a check against it, so
        its fixed sizes are the sizes the backend expects: a batcher that lays
        out inputs itself must not change them.
        """
        ...


class SequenceContext(BatcherContext, Protocol):
    """What a [`SequenceBatcher`][trioinfer.abc.SequenceBatcher] learns about its model.

    It gets one once, when the model loads. Only the engine creates it.
    """

    @property
    def model(self) -> str:
        """The model's name."""
        ...

    @property
    def config(self) -> ModelConfig:
        """The model's configuration; its ``sequence`` is set."""
        ...

    @property
    def signature(self) -> ModelSignature:
        """The model's full signature, as the backend reports it, control and state inputs included.

        Callers see and send it without the inputs in
        ``config.sequence.hidden_inputs`` and receive no ``hidden_outputs``.
        """
        ...

    def current_time(self) -> float:
        """The engine's clock (the event loop's, so a MockClock in tests)."""
        ...

    def retry_after(self) -> float:
        """A guess, in seconds, at when the model could take a request refused now.

        For the ``retry_after`` of a [`QueueFull`][trioinfer.QueueFull] raised in ``admit``.
        """
        ...

    def fail(self, request: Request, error: Exception) -> None:
        """End *request*, which the batcher holds and will not dispatch, with *error*.

        Does nothing if it has ended already (its caller left, say).
        """
        ...


class Replica(Protocol):
    """One loaded backend instance of a model, as fallback plugins see it.

    A replica is *serving* (it takes batches) or *out* (a fallback took it out
    of service, e.g. its circuit breaker opened; it takes no new batch until
    put back). Only the engine creates replicas.
    """

    @property
    def index(self) -> int:
        """The instance's number within its model (0, 1, ...)."""
        ...

    @property
    def placement(self) -> Placement:
        """Where it was asked to run."""
        ...

    @property
    def device(self) -> str:
        """Where the instance really runs (``"cpu"`` after a fallback from ``"cuda:0"``)."""
        ...

    @property
    def capacity(self) -> float:
        """Its relative throughput, from the model's instance config."""
        ...

    @property
    def state(self) -> ReplicaState:
        """``"serving"`` or ``"out"``."""
        ...

    @property
    def serving(self) -> bool:
        """Whether it takes batches."""
        ...

    @property
    def reason(self) -> str | None:
        """Why it is out (``None`` while serving)."""
        ...

    @property
    def gone(self) -> str | None:
        """Why its backend instance can serve no more (its ``gone``), or None while it lives.

        An instance run in a process of its own (a Ray actor) may lose it; see
        [`RecoveringFallback`][trioinfer.abc.RecoveringFallback]. Read while
        the replica is out of service too: one found gone then is best
        re-created, not probed.
        """
        ...

    @property
    def label(self) -> str:
        """A short name for logs and response metadata: ``"instance 1 (cpu)"``."""
        ...

    @property
    def executions(self) -> int:
        """Executions (of batches and probes) started on it."""
        ...

    @property
    def failures(self) -> int:
        """Executions whose backend call raised an error.

        One cancelled (its callers left, or a fallback's ``timeout`` ran out) is not counted.
        """
        ...

    @property
    def taken_out(self) -> int:
        """Times it was taken out of service."""
        ...

    @property
    def recreated(self) -> int:
        """Times its backend instance was re-created."""
        ...


class Execution(Protocol):
    """One batch on its way through the model's fallback plugin.

    The engine formed the batch and chose `replica`; the fallback's
    ``execute(execution)`` must see that every request in it gets an answer:
    by `run()` (outputs from a replica), by `respond()` (outputs from
    elsewhere), or by raising, which fails every request still pending with
    that error. Only the engine creates executions.
    """

    @property
    def requests(self) -> Sequence[Request]:
        """The batch's requests, in the batch's order."""
        ...

    @property
    def replica(self) -> Replica:
        """The replica the engine chose for it."""
        ...

    def pending(self) -> Sequence[Request]:
        """The requests still waiting for an answer (not answered, caller still there)."""
        ...

    def deadline(self) -> float:
        """The latest deadline among pending requests (``math.inf`` if one has none).

        Past it nobody waits for this batch, so a retry must not start later.
        """
        ...

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
        ...

    def respond(self, request: Request, outputs: Mapping[str, Any], *, via: str) -> None:
        """Answer *request* with *outputs* that did not come from a replica of this model.

        *via* names where they came from (``"default"``, ``"model small"``) and
        is recorded as a fallback step. Arrays are converted with
        ``numpy.asarray`` and must cover every output the request asked for
        (``requested_outputs``; every model output where it named none). The
        answer keeps the response parameters and the model of the other
        model's answer only when *outputs* is the one `infer_elsewhere`
        returned for *request*; any other (a default) has none, and no model
        made it.

        Raises:
            PluginContractError: *request* is not in this execution, or outputs are missing.
        """
        ...

    def note(self, step: str, requests: Sequence[Request] | None = None) -> None:
        """Record a fallback step, such as ``"failover instance 1 (cpu)"``, on pending requests.

        The steps reach the caller in
        [`InferenceResult.fallbacks`][trioinfer.InferenceResult] (and HTTP
        response parameters) and are counted in the model's statistics by
        their first word.
        """
        ...

    async def infer_elsewhere(self, model: str, request: Request) -> Outputs:
        """Run one pending request on another loaded *model* and return its outputs.

        The request keeps its deadline, priority, tenant, id, parameters and
        requested outputs (the answer may hold those alone); the other
        model's response parameters come with its answer. A request
        that is itself a failover from another model is not sent on again,
        so that two models failing over to each other cannot loop. While the
        engine closes, the request (accepted before it began to) is still
        admitted to *model* until the drain period ends, as a pipeline's
        steps are; other callers of *model* are refused meanwhile.

        Raises:
            BackendError: *request* came from a failover already.
            EngineClosed: The engine closes and its drain period is over.
            TrioInferError: What the other model's ``infer`` raised.
        """
        ...


class FallbackContext(Protocol):
    """What a fallback plugin may know and do about its model's replicas.

    An [`AttachableFallback`][trioinfer.abc.AttachableFallback] gets one when
    its model loads, before the first execution. Everything runs on the event
    loop's thread; there is nothing to lock. Only the engine creates it.
    """

    @property
    def model(self) -> str:
        """The model's name."""
        ...

    @property
    def signature(self) -> ModelSignature:
        """The model's inputs and outputs."""
        ...

    @property
    def replicas(self) -> Sequence[Replica]:
        """Every replica, by index."""
        ...

    def current_time(self) -> float:
        """The engine's clock (the event loop's, so a MockClock in tests)."""
        ...

    def start_soon(self, fn: Callable[..., Awaitable[object]], *args: object) -> None:
        """Run ``fn(*args)`` as a background task of the model, in the engine's task group.

        It is cancelled when the model is unloaded or the engine closes; an
        exception it raises is logged and does not stop the model.

        Raises:
            RuntimeError: The model is not running (not yet started, or stopped).
        """
        ...

    def take_out(self, replica: Replica, reason: str, *, retry_after: float = 1.0) -> None:
        """Take *replica* out of service: dispatch sends it no new batch.

        A batch running on it goes on. When no serving replica is left, the
        model's queued requests fail with [`CircuitOpen`][trioinfer.CircuitOpen]
        at once and new ones are refused with it, carrying *retry_after*
        (seconds until the replica may be back) as their hint. Logged once per
        change, at warning level.
        """
        ...

    def put_back(self, replica: Replica) -> None:
        """Return *replica* to service; logged once, at info level."""
        ...

    async def probe(self, replica: Replica, inputs: Arrays | None = None) -> None:
        """Run one execution on *replica* that answers nobody, to test whether it works.

        *inputs* default to zeros of the model's input shapes (one row, and 1
        for every dimension without a fixed size). Waits until the replica is free.
        A decoupled model's instance, which serves streams only, is probed by one
        stream, read to its end.

        Raises:
            Exception: What the backend raised.
        """
        ...

    async def recreate(self, replica: Replica) -> None:
        """Close *replica*'s backend instance and load a new one at the same placement.

        For a session that died. Waits until nothing runs on the replica; its
        state does not change (put it back after a successful probe).

        Raises:
            BackendError: The new instance could not be loaded, or reports
                another signature; the old one is closed anyway.
            PluginContractError: The backend's ``load()`` returned no
                [`BackendInstance`][trioinfer.abc.BackendInstance] (as at load,
                the backend's broken contract); the old one is closed anyway.
        """
        ...


class ModelTasks(Protocol):
    """A model's task group, as its backend sees it: tasks that live as long as the model.

    What [`current_model_tasks()`][trioinfer.lowlevel.current_model_tasks]
    returns in a backend's ``load()``; keep it to start tasks later, from the
    instance's calls too. Everything runs on the event loop's thread. Only the
    engine creates it.
    """

    @property
    def model(self) -> str:
        """The model's name."""
        ...

    def start_soon(self, fn: Callable[..., Awaitable[object]], *args: object) -> None:
        """Run ``fn(*args)`` as a task of the model, in the engine's task group.

        It runs until it returns, or until it is cancelled: after every
        instance of the model closed at its unload (or after a failed load),
        or when the engine closes. An exception it raises is logged with the
        model's name and its traceback; the model and its other tasks go on.
        A task that must end with its instance (a re-created one, say) is the
        instance's to cancel, in its ``aclose()``.

        Raises:
            RuntimeError: The model's tasks have ended (it was unloaded).
        """
        ...


# -- the contracts a plugin implements ---------------------------------------------------


@runtime_checkable
class BackendInstance(Protocol):
    """One loaded copy of a model on one device: a session, in ONNX Runtime's terms.

    The engine calls `execute()` for one batch at a time per instance (unless
    it is a [`PipelinedInstance`][trioinfer.abc.PipelinedInstance]) and
    `aclose()` after the last call has returned.

    An instance that can die apart from the engine (one held by another
    process: a Ray actor) may have a ``gone`` attribute (not part of this
    protocol; there from load on, as the engine looks for it once):
    ``None`` while it lives, else a non-empty string saying why it
    can serve no more. The engine reads it whenever it reports on the model,
    before it hands the instance a batch, and when an execution on it fails:
    such an instance counts as out of service (``"gone: ..."``), and a model
    none of whose instances serves is not ready
    ([`ModelInfo.unavailable`][trioinfer.ModelInfo]). Once the engine finds
    it gone, it takes the instance out of service: no batch is sent to it
    any more, later ones go to the model's other instances, and with none
    left requests are refused at once
    ([`BackendUnavailable`][trioinfer.BackendUnavailable]). Its executions
    should fail once it is gone (``BackendUnavailable``, saying which
    instance and why: the batch it was running fails with it). A
    [`RecoveringFallback`][trioinfer.abc.RecoveringFallback] is told, and may
    re-create it; loading the model again replaces it too.
    """

    @property
    def signature(self) -> ModelSignature:
        """The model's inputs and outputs, read from the loaded model."""
        ...

    @property
    def device(self) -> str:
        """Where the instance really runs, e.g. ``"cpu"`` after a fallback from ``"cuda:0"``."""
        ...

    async def execute(self, inputs: Arrays) -> Outputs:
        """Run the model once and return every output by name.

        *inputs* are already validated against `signature`, and are not the
        instance's to change: they may be the caller's own arrays, another
        pipeline step's answer or a client's request body (the Python backend
        hands its models read-only views of them). Blocking
        compute must run off the event loop (a worker thread, or the runtime's
        own asynchronous call); the event loop never waits on compute.

        It returns exactly the outputs ``signature`` declares, each a numpy
        array of the declared dtype, rank and fixed sizes (any size where the
        signature leaves one open): the engine checks every execution's
        answer, and one that does not fit fails the execution's requests with
        ``BackendError`` naming the instance, the output, what came and what
        was declared (a 500 over HTTP). Nothing is converted: a client is
        told the declared dtype, so it must get that one. An instance whose
        answers fit its ``signature`` by construction or by its own check (the
        Python backend's, which checks each; ONNX Runtime's where ONNX shape
        inference derives every declared rank and fixed size, as the runtime
        itself holds answers to the graph's types but not to its declared
        shapes) may say ``checks_outputs = True`` (an attribute, read at load,
        and of an instance re-created): the engine then checks only the names
        and, batched, the rows.

        For a batched model (``signature.batched``), every output must have
        one row per input row: the engine cuts each caller's rows out of it,
        and fails the whole batch with ``BackendError`` when an output's first
        dimension is anything else.

        Runs under the caller's cancel scope and sets no timeout of its own.
        When cancelled, abort the computation where the runtime allows it, wait
        until the instance can take the next call, then let ``Cancelled``
        propagate.

        Raises:
            BackendError: For any failure of the runtime, with the cause chained.
        """
        ...

    async def aclose(self) -> None:
        """Release the instance's resources (threads, sessions, device memory).

        The engine calls it after the last `execute()` returned. Must be
        idempotent and must not raise for a healthy instance (a failure is
        logged with the instance); later `execute()` calls raise ``BackendError``.
        """
        ...


@runtime_checkable
class PipelinedInstance(BackendInstance, Protocol):
    """An instance that takes the next batch while one runs (an optional hook).

    It queues the next execution behind the running one itself, so that its
    device never waits for the event loop; the engine keeps up to
    `pipeline_depth` executions in flight on it.
    """

    @property
    def pipeline_depth(self) -> int:
        """Executions the instance accepts at once; a positive integer (else ignored: 1)."""
        ...


@runtime_checkable
class InlineInstance(BackendInstance, Protocol):
    """An instance whose `execute` never suspends (an optional hook).

    Its execution runs to its end in one stretch of its caller's task, with
    no ``await`` that yields to the event loop: a Python model's plain
    ``def infer`` with ``dispatch = "inline"`` (see below), for instance. A
    request to an idle instance of a model that passes lone requests straight
    through (the ``fifo`` scheduler, no batcher or fallback), and a pipeline's
    step on one, then runs in its caller's task, with no queue or worker and
    no cancel scope for stopping the model mid-run, since nothing else can
    run until it returns. An instance that says so and
    suspends anyway still finishes, but stopping its model waits for it
    (up to the cleanup period) instead of aborting it.

    An instance that runs on the event loop's thread within a time budget
    (ONNX Runtime's ``dispatch = "inline"``) may say so too, and also have an
    ``inline_budget_s`` attribute (seconds, a float or an int): its `execute` then
    suspends once, at its start, when
    [`inline_slice_spent(inline_budget_s)`][trioinfer.lowlevel.inline_slice_spent]
    (restarting the slice after it yields), or when its caller is cancelled,
    and never otherwise. The engine then yields itself before claiming such
    an instance in its caller's task, holding nothing meanwhile. For an inline
    instance without ``inline_budget_s`` (the Python backend's), the engine
    yields the same way once 250 µs of the slice are spent: back-to-back
    requests run in their callers' tasks never park, and must still leave
    the loop its turns.

    An instance whose `execute` runs on the event loop until it first
    suspends, which it may never do (a Python model's ``async def infer``),
    may say ``starts_inline = True`` instead (an attribute, not part of this
    protocol). Such an execution starts in its caller's task: if it ends
    without suspending, the request is done as an inline one's; if it
    suspends, it goes on there, holding the instance, under its caller's
    cancel scope and a scope of its own that stopping the model cancels.
    Say it only if every suspension gives way to cancellation at once:
    a caller cancelled meanwhile leaves only when the execution does.
    """

    @property
    def runs_inline(self) -> bool:
        """True when `execute` never suspends; anything else counts as False."""
        ...


@runtime_checkable
class TunedInstance(BackendInstance, Protocol):
    """An instance that knows which batch sizes it runs fastest per row (an optional hook).

    From a measurement at load (the ONNX Runtime backend's
    ``tune_batch_sizes``), or the sizes a TensorRT engine was built for. The
    engine reads them from the model's first instance into
    [`RequestQueue.preferred_batch_sizes`][trioinfer.lowlevel.RequestQueue.preferred_batch_sizes]
    and [`ModelInfo`][trioinfer.ModelInfo], where a batcher may use them (the
    dynamic batcher cuts batches at those sizes unless its own option is set).
    """

    @property
    def preferred_batch_sizes(self) -> tuple[int, ...]:
        """Increasing positive integers; anything else is ignored, with a warning."""
        ...


@runtime_checkable
class StreamingInstance(BackendInstance, Protocol):
    """An instance of a decoupled model: any number of responses per request (an optional hook).

    When `decoupled` is true, the engine serves the model only through
    [`Engine.infer_stream()`][trioinfer.Engine.infer_stream]: each request is
    one call of `stream()`, unbatched, outside the scheduler, batcher and
    fallback (see the streaming tutorial). `execute()` is not called.
    """

    @property
    def decoupled(self) -> bool:
        """Whether the model answers with a stream (read once, at load)."""
        ...

    def stream(self, inputs: Arrays) -> AsyncGenerator[Outputs, None]:
        """Return an async generator of one request's responses, each outputs by name.

        The engine iterates it in a task of the caller's, at most the
        stream's ``ahead`` responses ahead of the caller (16 by default),
        under the caller's cancel scope; when the caller stops early the
        engine calls its ``aclose()``, so the model stops at the ``yield``
        it waits at. Errors as in `execute()`: a
        ``TrioInferError`` (``BackendError`` for a failure of the model) ends
        the stream with that error after the responses already yielded.
        """
        ...


@runtime_checkable
class OutputsInstance(BackendInstance, Protocol):
    """An instance that can be asked for only some of its outputs (an optional hook).

    For a runtime that can spare the work of outputs nobody asked for: a model
    whose code skips a head, a runtime that prunes its graph by the outputs
    fetched. (The ONNX Runtime backend's instances fetch only those from
    ``session.run(names, ...)``; ONNX Runtime's inference builds still run the
    whole graph, so what they spare is the copies of the other outputs.)
    Where every request of an execution
    named outputs ([`Request.requested_outputs`][trioinfer.lowlevel.Request.requested_outputs]:
    ``engine.infer(outputs=...)``, HTTP and gRPC ``outputs``, a pipeline
    step whose ``output_map`` keeps only some), the engine calls
    `execute_outputs` with the union of their names in place of `execute`;
    an execution with any request that named none calls `execute`. Looked
    for on the instance once, when it is loaded or re-created
    (``execute_outputs``, a method): an instance without it answers with
    every output, as ever,
    and the engine drops those not asked for. (A `RequestsInstance` reads
    each request's requested outputs itself and is not asked this way.)
    """

    async def execute_outputs(self, inputs: Arrays, outputs: tuple[str, ...]) -> Outputs:
        """Run the model once, as `execute`, and return the named *outputs* alone.

        *outputs*: some of `signature`'s output names, each once, in no
        particular order. The answer holds at least those (any other it holds
        is dropped unchecked), each checked as `execute`'s are. Errors and
        cancellation as for `execute`.
        """
        ...


@runtime_checkable
class RequestsInstance(BackendInstance, Protocol):
    """An instance that takes an execution's requests as they came (an optional hook).

    For a runtime whose models take a list of requests and answer each on
    its own, as Triton's Python backend's ``execute(requests)`` does: the
    engine calls `execute_requests` with the requests of each execution,
    in place of `execute` with their inputs concatenated (so requests that
    sent different optional inputs may share an execution), and each request
    ends with its own answer or its own error. `execute` still serves what no
    request made: warm-up samples, a fallback's probe. Looked for once, on
    the model's first instance, at load; a batcher that lays out the inputs
    itself (an ``AssemblingBatcher``) is refused with it, but for a stateful
    model's sequence batcher without implicit state: its sequences still
    reach one instance in order, and the instance feeds each request's
    controls (START, END, READY, CORRID) from its ``sequence_flags`` itself,
    as the batcher's inputs are not passed.
    """

    async def execute_requests(self, requests: Sequence[Request]) -> Sequence[Outputs | Exception]:
        """Run the model once on *requests* and return one answer per request, in order.

        An answer is the request's outputs by name, checked as `execute`'s
        are but against the request's own rows, or an exception that ends
        that request alone: a ``TrioInferError`` reaches its caller as it is,
        any other as a ``BackendError``. The requests' inputs are theirs
        (read them, do not change them). Raising fails every request, as
        `execute` raising does; so does an answer of another length (a
        ``BackendError``). Cancellation as for `execute`.
        """
        ...


@runtime_checkable
class Backend(Protocol):
    """A backend plugin: loads model instances onto devices."""

    async def load(self, config: ModelConfig, placement: Placement) -> BackendInstance:
        """Load one instance of *config*'s model where *placement* says.

        May take long (reading files, building sessions); blocking work must run
        off the event loop. If ``placement.device`` is not usable, fall back to
        the CPU when ``placement.cpu_fallback`` allows it (and report the real
        device in [`BackendInstance.device`][trioinfer.abc.BackendInstance.device]), else raise.

        What it returns must be a `BackendInstance` whose ``signature`` is a
        ``ModelSignature`` and whose ``device`` a non-empty ``str``; anything
        else fails the load with a
        [`PluginContractError`][trioinfer.PluginContractError] naming the backend.

        Raises:
            BackendUnavailable: The device cannot be used and no fallback is allowed.
            ConfigError: ``config.backend_options`` holds options the backend refuses.
            BackendError: The model could not be loaded (missing or invalid file).
        """
        ...


@runtime_checkable
class ConfigCompletingBackend(Backend, Protocol):
    """A backend whose models complete their Triton configuration (an optional hook).

    Triton's ``auto_complete_config``: a model's own code says what its
    ``config.pbtxt`` leaves out (its inputs and outputs, its batch size). The
    server calls `complete_triton_config` when it loads a model of this
    backend configured by a ``config.pbtxt``, before any of the configuration
    is used, and serves the configuration it returns (``GET .../config``
    answers it). The ``python`` backend has it for Triton Python models.
    """

    def complete_triton_config(
        self, config: Mapping[str, Any], path: Path
    ) -> Mapping[str, Any] | None:
        """Return *config* completed by the model at *path*, or None to keep it as it is.

        *config* is the ``config.pbtxt`` as Triton's JSON (every field
        printed, as ``GET .../config`` answers it), *path* the model file of
        the version being loaded. Blocks (it may import the model's code):
        the server calls it on a worker thread.

        Raises:
            ConfigError: The model's completion conflicts with the file, or is
                not a configuration.
            BackendError: The model's code failed (its import, say).
        """
        ...


@runtime_checkable
class Scheduler(Protocol):
    """A queue discipline: decides which waiting request runs next.

    Which request that is, is the scheduler's whole policy: the contract
    fixes no order (first in first out, last in first out, by priority, by
    deadline, ...). It fixes what every discipline must keep: each request
    pushed comes out of `pop()` once, unless `remove()` took it first; `peek()`
    shows what `pop()` would return; ``len()`` counts what is held.

    Called only from the event loop's thread, never concurrently; no method may
    block or await. Requests hash by identity. `push()` may refuse a request
    by raising a [`TrioInferError`][trioinfer.TrioInferError] such as
    [`DeadlineExceeded`][trioinfer.DeadlineExceeded]; the caller gets it at
    once. Any other exception `push()` raises is a broken contract: that
    caller gets a [`PluginContractError`][trioinfer.PluginContractError], and
    the model goes on. An exception from any other method (but the
    ``IndexError`` of an empty scheduler) leaves the queue in a state nobody
    can trust: the engine takes the model out of service. Its queued requests
    fail with a `PluginContractError` naming the scheduler and the model (the
    scheduler's exception chained), later ones are refused with it, it is
    logged once with the traceback, and the engine and its other models go
    on; loading the model again brings it back. The same happens, without
    an exception, when its answers cannot be right: a ``len()`` other than
    the engine's own count of what it pushed and did not get back (a
    request lost, whose caller would wait for ever), or a `pop()` or
    `peek()` that returns a request again, one that ended, or no request.
    """

    def push(self, request: Request) -> None:
        """Add a request that was just admitted.

        Each request is pushed once, when it is admitted. Requests a batcher
        gives back with
        [`RequestQueue.put_back()`][trioinfer.lowlevel.RequestQueue.put_back]
        are not pushed again: the engine keeps them at the head of the queue,
        ahead of the scheduler's order.

        Raises:
            ValueError: *request* is held already: a second push would count it
                twice. The engine never does this; refusing it (and changing
                nothing) tells a caller that breaks the contract, and
                [`check_scheduler()`][trioinfer.testing.check_scheduler] checks it.
        """
        ...

    def peek(self) -> Request:
        """Return the request `pop()` would return, without removing it.

        Raises:
            IndexError: If the scheduler holds no request.
        """
        ...

    def pop(self) -> Request:
        """Remove and return the request that should run next.

        Raises:
            IndexError: If the scheduler holds no request.
        """
        ...

    def remove(self, request: Request) -> bool:
        """Remove *request* if it is held (its caller gave up); return whether it was.

        Must not scan the whole queue: cancelling is as common as running.
        """
        ...

    def __len__(self) -> int:
        """The number of requests held."""
        ...


@runtime_checkable
class AttachableScheduler(Scheduler, Protocol):
    """A scheduler that wants to know about its model (an optional hook)."""

    def attach(self, context: SchedulerContext) -> None:
        """Called once, before the first `push()`, with the model's execution estimate and clock.

        May raise [`ConfigError`][trioinfer.ConfigError] to refuse the model.
        """
        ...


@runtime_checkable
class Batcher(Protocol):
    """Decides when to dispatch and which requests go together.

    By default the engine concatenates a batch's inputs along the first axis
    (into pooled, reused buffers) and hands each caller its rows of every
    output, as views. An [`AssemblingBatcher`][trioinfer.abc.AssemblingBatcher]
    lays out the backend's inputs itself (padding a ragged dimension, say).
    """

    async def next_batch(self, queue: RequestQueue) -> Sequence[Request]:
        """Wait until a batch should be dispatched and return its requests.

        Called by one instance worker at a time, when that instance is free.
        A batch must keep these rules, which
        [`check_batcher()`][trioinfer.testing.check_batcher] checks:

        - It holds at least one request, each taken through *queue* during
          this call (in the order the queue gives them: the scheduler's), and
          no request twice. A request taken and not in the batch goes back
          with [`RequestQueue.put_back()`][trioinfer.lowlevel.RequestQueue.put_back],
          in the order taken, before the call returns: a batcher holds no
          request from one call to the next, so every request is always
          queued, in a batch, or ended. (Given back, a request whose deadline
          passes meanwhile is failed by the queue, never handed out.)
        - When the model has no batch dimension (``queue.batched`` is false),
          one request.
        - Unless the batcher assembles its own inputs, every request has the
          same inputs with the same dtypes and non-batch dimensions (the
          engine concatenates them along the first axis).

        A request's deadline may pass while the batcher waits for company:
        the engine drops that row right before the backend call.

        May be cancelled at any await; requests already taken must then be
        given back with ``queue.put_back()``, in the order they were taken,
        so that the scheduler's order holds. Any exception other than
        cancellation, an empty batch, a batch holding a request twice, or a
        batch of anything but the queue's requests is a broken contract: the
        requests it had taken and not given back (and those of the batch) fail
        with a [`PluginContractError`][trioinfer.PluginContractError] naming the
        batcher and the model, logged with the traceback, and the model asks
        for its next batch. A batcher that breaks it again before it forms a
        batch takes its model out of service (queued requests fail, later
        ones are refused, until the model is loaded again). The engine and
        its other models go on either way.
        """
        ...


@runtime_checkable
class AssemblingBatcher(Batcher, Protocol):
    """A batcher that lays out the backend's inputs itself (an optional hook)."""

    def assemble(self, requests: Sequence[Request]) -> tuple[Arrays, Split]:
        """Return the backend's inputs for *requests*, and how to split its outputs.

        The engine calls it right before the backend call, with the batch's
        requests still worth computing, in order; the function returned gets
        the backend's outputs and must return one mapping per request, in the
        same order. An exception from either fails that batch's requests with
        a [`PluginContractError`][trioinfer.PluginContractError]; the worker goes on.
        """
        ...


@runtime_checkable
class AttachableBatcher(Batcher, Protocol):
    """A batcher that checks its options against the model when it loads (an optional hook).

    Not a [`SequenceBatcher`][trioinfer.abc.SequenceBatcher], whose ``attach``
    gets a [`SequenceContext`][trioinfer.lowlevel.SequenceContext] instead.
    """

    def attach(self, context: BatcherContext) -> None:
        """Called once, when the model loads, before any other method.

        May raise [`ConfigError`][trioinfer.ConfigError] to refuse the model
        (padding an axis whose size the model fixes, say).
        """
        ...


@runtime_checkable
class BoundedBatcher(Batcher, Protocol):
    """A batcher that says how many rows its batches hold at most (an optional hook).

    A batcher without it (a third party's that does not say) has no bound, as
    one whose ``max_batch_size`` is None.
    """

    @property
    def max_batch_size(self) -> int | None:
        """Most rows one batch holds (the sum of its requests' first dimensions).

        None: no bound (one request per batch, of any rows, say). A positive
        integer the engine holds the model's warm-up samples to at load (a
        sample's ``batch_size`` above it fails the load, as in Triton: no batch
        the model serves is that big). Read after ``attach``, where the batcher
        has one; must not block.
        """
        ...


@runtime_checkable
class SequenceBatcher(AssemblingBatcher, Protocol):
    """A batcher for stateful models: each sequence on one instance, its requests in order.

    A model with a ``sequence`` config needs one (its load fails otherwise).
    The engine then does not call ``next_batch``: each instance's worker calls
    `next_batch_for()` on its own, concurrently, and every request is handed
    to `admit()` as it is accepted. Unlike a plain batcher, a sequence
    batcher holds requests from one call to the next (a sequence's later
    requests wait for its earlier ones); it must empty *queue* as requests
    arrive, bound what it holds (in ``admit``; the first-party one refuses
    past ``max_queue_size``), and each request it holds must end: in a batch, or by
    [`SequenceContext.fail()`][trioinfer.lowlevel.SequenceContext.fail].
    A held request whose caller leaves, or whose deadline passes, is ended by
    the engine (its ``status`` becomes ``DONE``); the batcher then must not
    dispatch it. ``assemble`` adds the control and state inputs.

    For a model whose instances take each request as it came (a
    [`RequestsInstance`][trioinfer.abc.RequestsInstance]: they read each
    request's ``sequence_flags`` themselves), no inputs are laid out: the
    engine calls the batcher's ``computed(requests)`` instead, if it has one
    (an optional method, called where ``split`` would be, with the requests
    the execution computed), else ``assemble`` and then its ``split`` with no
    outputs.

    An instance the engine finds gone (see
    [`BackendInstance`][trioinfer.abc.BackendInstance]: a Ray actor that
    died) took its sequences' state with it: once it is out of service, the
    engine calls the batcher's ``replica_gone(replica)``, if it has one (an
    optional method; must not block), to end the sequences on it. The
    first-party batcher fails their waiting requests and refuses later ones
    with [`SequenceError`][trioinfer.SequenceError]; without it they wait
    for the instance to be back. A batch formed on an instance taken out
    meanwhile fails, saying so, and its sequences end.
    """

    def attach(self, context: SequenceContext) -> None:
        """Called once, when the model loads, before any other method.

        May raise [`ConfigError`][trioinfer.ConfigError] to refuse the model
        (a control input the model lacks, say).
        """
        ...

    def admit(self, request: Request) -> None:
        """Take a request that was just accepted (it is in the queue too); must not block.

        Raises:
            TrioInferError: To refuse it (usually [`SequenceError`][trioinfer.SequenceError]):
                the caller gets this error at once and the request is not queued.
        """
        ...

    def withdrawn(self, request: Request) -> None:
        """Told that *request*, admitted and not yet returned in a batch, has ended.

        Its caller left or its deadline passed while the batcher held it (its
        ``status`` is ``DONE`` already). Called at once, from the caller's
        task; must not block. The first-party batcher ends the request's
        sequence here, so that the sequence's other requests are refused now
        rather than when a worker next looks.
        """
        ...

    async def next_batch_for(
        self, queue: RequestQueue, replica: Replica, previous: Sequence[Request]
    ) -> Sequence[Request]:
        """Wait for, and return, the next batch to run on *replica*.

        *previous* is the batch this worker returned last time (empty the first
        time), whose execution is over: each of its requests was computed (the
        batch's ``split`` got its outputs) or ended without being computed.
        Each request returned must be one admitted and not yet returned, at
        most one per sequence, and only after that sequence's previous request
        is over. Called concurrently by every worker of the model.
        """
        ...


@runtime_checkable
class Fallback(Protocol):
    """Middleware around one batch's execution: retry, fail over, short-circuit.

    The engine hands each formed batch to `execute()` as an
    [`Execution`][trioinfer.lowlevel.Execution], on the replica it chose.
    """

    async def execute(self, execution: Execution) -> None:
        """See that every request of *execution* is answered, normally by ``await execution.run()``.

        Requests still pending when it returns fail with a
        [`PluginContractError`][trioinfer.PluginContractError] (a fallback
        that answers nobody breaks its contract); when it raises, they fail
        with that error: a [`TrioInferError`][trioinfer.TrioInferError] as it
        is, a backend's exception from ``execution.run()`` passed on wrapped in
        [`BackendError`][trioinfer.BackendError], and any other exception (the
        fallback's own bug) wrapped in a `PluginContractError` naming the
        fallback and logged with its traceback; the model goes on. Must not
        swallow cancellation: it means that every caller of the batch has
        left, or that the model is being unloaded.
        """
        ...


@runtime_checkable
class AttachableFallback(Fallback, Protocol):
    """A fallback that watches and manages its model's replicas (an optional hook)."""

    def attach(self, context: FallbackContext) -> None:
        """Called once, when the model loads and before its first execution.

        Through *context* the fallback sees every replica and may take one out
        of service, probe it, re-create it and put it back, and start
        background tasks in the engine's task group. May raise
        [`ConfigError`][trioinfer.ConfigError] to refuse the model.
        """
        ...


@runtime_checkable
class RecoveringFallback(AttachableFallback, Protocol):
    """A fallback that brings back instances the engine found gone (an optional hook).

    An instance whose ``gone`` says it can serve no more (see
    [`BackendInstance`][trioinfer.abc.BackendInstance]: a Ray actor that died)
    gets no more batches: the engine takes it out of service itself, whatever
    the model's fallback, since a batch sent to it could only fail. A
    fallback that re-creates instances (a breaker's) would then see no
    failure to act on: this hook tells it instead.
    """

    def replica_gone(self, replica: Replica) -> None:
        """Called once when the engine takes *replica* out because its instance is gone.

        The replica is out of service already, its ``reason`` starting with
        ``"gone: "`` and saying why. Called on the event loop, so it must not
        block: work such as `FallbackContext.recreate` followed by
        `FallbackContext.put_back` goes in a task
        (`FallbackContext.start_soon`). An exception it raises is logged,
        naming the fallback; the instance stays out. So does one it puts
        back here, still gone: its contract is broken.
        """
        ...
