"""The plugin contracts: what a backend, scheduler, batcher or fallback must do.

Each contract is a `typing.Protocol`; each method's docstring is its
spec: when the engine calls it, whether it may block, what it raises. A plugin
is an object the registry gets by calling the entry point's target: backends
with no arguments (they get the model's ``backend_options`` at load), and
schedulers, batchers and fallbacks with the model's ``scheduler_options``,
``batcher_options`` or ``fallback_options`` as keyword arguments. A class is
the usual target.
Conformance checks for each contract are in [`trioinfer.testing`][trioinfer.testing].
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from ._config import ModelConfig, Placement
from ._request import Request
from ._tensors import ModelSignature

if TYPE_CHECKING:
    from ._dispatch import Execution
    from ._runner import RequestQueue

__all__ = [
    "Backend",
    "BackendInstance",
    "Batcher",
    "Fallback",
    "Scheduler",
]

Arrays = Mapping[str, np.ndarray[Any, Any]]


@runtime_checkable
class BackendInstance(Protocol):
    """One loaded copy of a model on one device: a session, in ONNX Runtime's terms.

    The engine calls `execute()` for one batch at a time per instance and
    `aclose()` after the last call has returned. An instance that can take the
    next batch while one runs (queueing it behind the first, so that its device
    never waits for the event loop) may say so with an integer attribute
    ``pipeline_depth``: the engine then keeps up to that many executions in
    flight on it. An instance that knows which batch sizes it runs fastest per
    row (from a measurement at load, or sizes a TensorRT engine was built for)
    may say so with a tuple attribute ``preferred_batch_sizes`` of increasing
    positive integers: the engine reads it from the model's first instance into
    [`RequestQueue.preferred_batch_sizes`][trioinfer.RequestQueue], where a
    batcher may use it (the dynamic batcher cuts batches at those sizes unless
    its own ``preferred_batch_sizes`` option is set).
    """

    @property
    def signature(self) -> ModelSignature:
        """The model's inputs and outputs, read from the loaded model."""
        ...

    @property
    def device(self) -> str:
        """Where the instance really runs, e.g. ``"cpu"`` after a fallback from ``"cuda:0"``."""
        ...

    async def execute(self, inputs: Arrays) -> dict[str, np.ndarray[Any, Any]]:
        """Run the model once and return every output by name.

        *inputs* are already validated against `signature`. Blocking
        compute must run off the event loop (a worker thread, or the runtime's
        own asynchronous call); the event loop never waits on compute.

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
        idempotent and must not raise for a healthy instance; later `execute()`
        calls raise ``BackendError``.
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

        Raises:
            BackendUnavailable: The device cannot be used and no fallback is allowed.
            ConfigError: ``config.backend_options`` holds options the backend refuses.
            BackendError: The model could not be loaded (missing or invalid file).
        """
        ...


@runtime_checkable
class Scheduler(Protocol):
    """A queue discipline: decides which waiting request runs next.

    Called only from the event loop's thread, never concurrently; no method may
    block or await. Requests hash by identity.

    A scheduler may also define ``attach(context)``: the engine then calls it
    once, before the first `push()`, with a
    [`SchedulerContext`][trioinfer.SchedulerContext] (the model's execution-time
    estimate, instance count and clock). `push()` may refuse a request by
    raising a [`TrioInferError`][trioinfer.TrioInferError] such as
    [`DeadlineExceeded`][trioinfer.DeadlineExceeded]; the caller gets it at once.
    """

    def push(self, request: Request) -> None:
        """Add a request that was just admitted.

        Requests a batcher gives back with
        [`RequestQueue.put_back()`][trioinfer.RequestQueue.put_back] do not come
        here again: the engine keeps them at the head of the queue.
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
class Batcher(Protocol):
    """Decides when to dispatch and which requests go together.

    By default the engine concatenates a batch's inputs along the first axis
    (into pooled, reused buffers) and hands each caller its rows of every
    output, as views. A batcher that needs another layout (padding a ragged
    dimension, say) may define ``assemble(requests)``, returning the backend's
    inputs and a function that turns the backend's outputs into one mapping per
    request, in order; the engine then uses it instead.
    """

    async def next_batch(self, queue: RequestQueue) -> Sequence[Request]:
        """Wait until a batch should be dispatched and return its requests (at least one).

        Take requests only through *queue*, in the order it gives them (the
        scheduler's order). Called by one instance worker at a time, when that
        instance is free. May be cancelled at any await; requests already taken
        must then be given back with [`RequestQueue.put_back()`][trioinfer.RequestQueue.put_back].
        """
        ...


@runtime_checkable
class Fallback(Protocol):
    """Middleware around one batch's execution: retry, fail over, short-circuit.

    The engine hands each formed batch to `execute()` as an
    [`Execution`][trioinfer.Execution], on the replica it chose. A fallback
    may also define ``attach(context)``: the engine then calls it once, when
    the model loads, with a [`FallbackContext`][trioinfer.FallbackContext]
    through which it sees every replica and may take one out of service,
    probe it, re-create it and put it back, and start background tasks in the
    engine's task group. Everything runs on the event loop's thread; there is
    nothing to lock.
    """

    async def execute(self, execution: Execution) -> None:
        """See that every request of *execution* is answered, normally by ``await execution.run()``.

        Requests still pending when it returns fail with a
        [`PluginError`][trioinfer.PluginError]; when it raises, they fail with
        that error (wrapped in [`BackendError`][trioinfer.BackendError] unless it
        is a [`TrioInferError`][trioinfer.TrioInferError]). Must not swallow
        cancellation: it means that every caller of the batch has left, or that
        the model is being unloaded.
        """
        ...
