"""What a Python model calls other models with (Triton's business logic scripting, BLS)."""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, TypeVar, final

import anyio
import anyio.abc
import anyio.from_thread
import anyio.lowlevel
import numpy as np

from trioinfer import (
    BackendError,
    DeadlineExceeded,
    Engine,
    ModelNotFound,
    ResponseStream,
    SequenceFlags,
    TrioInferError,
)
from trioinfer.lowlevel import (
    WorkerThread,
    current_callers_deadline,
    infer_follow_up,
    infer_stream_follow_up,
)

T = TypeVar("T")


@final
class Models:
    """The other models of the engine serving a Python model, for it to call while it computes.

    A model's class gets one as its ``models`` keyword argument, if its
    ``__init__`` takes one (as ``device``). Each call is an ordinary request
    to the other model, as ``engine.infer`` makes (its batcher, scheduler,
    instances, statistics), bound to the requests the calling execution
    computes for: when every one of them has ended (its caller's deadline
    passed, or its caller left), an ``async def infer`` is cancelled, and
    its calls with it; an ``infer_blocking`` call from a plain ``def
    infer`` ends then with ``DeadlineExceeded`` (the thread cannot be
    interrupted, but what it waits for can). Each call's request carries
    the latest deadline those callers set (however the model runs: in its
    caller's task, in the engine's, on its worker thread), so the other
    model's queue drops it, uncomputed and counted as expired, once nobody
    waits for it, and orders it by that deadline. A model's ``queue_timeouts``
    bound its requests' wait to start, not their run, and so not these
    calls, as for any execution (`trioinfer.lowlevel.current_batch_deadline`
    counts them, for a service that wants the latest time worth starting
    by). Calls go on while the engine
    drains, as a pipeline's steps do. Errors come as the other model raised
    them (``trioinfer.TrioInferError``s: catch them to handle them, or let
    them through to reach the callers as they are), but for a model that is
    not served: a ``BackendError`` naming both models (the calling model's
    code or config is at fault, not its client: a 500, not a 404).

    A model may not call itself (its instances may all be busy computing the
    call's caller: the call would wait for ever), and calls that go round in
    a circle (A calls B, B calls A) can wait the same way until the deadline:
    keep calls going one way.
    """

    __slots__ = ("_computing", "_engine", "_loop", "_own", "_token")

    def __init__(self, engine: Engine, own: str) -> None:
        """Made by the backend at load, on the event loop."""
        self._engine = engine
        self._own = own
        self._token = anyio.lowlevel.current_token()
        self._loop = threading.get_ident()
        # The execution a worker thread computes (a plain def infer), as an _Execution.
        self._computing = threading.local()

    async def infer(
        self,
        model: str,
        inputs: Mapping[str, Any],
        *,
        priority: int = 0,
        parameters: Mapping[str, bool | int | float | str] | None = None,
        sequence: SequenceFlags | None = None,
    ) -> dict[str, np.ndarray[Any, Any]]:
        """Run *model* on *inputs* and return its outputs, from ``async def infer``.

        *parameters* are the request's own, and *sequence* the sequence of a
        stateful *model* the request belongs to, as ``engine.infer`` takes them.

        (A plain ``infer`` on the event loop, ``dispatch = "inline"``, can
        neither await this nor block on `infer_blocking`: make it async.)

        Raises:
            ValueError: *model* is the calling model itself.
            BackendError: *model* is not served, or is decoupled (it answers with
                a stream of responses: call it with `infer_stream`).
            TrioInferError: What the other model's request raised.
        """
        # Bound by cancellation alone: the engine cancels this execution when every
        # request it computes for has ended (a caller's own deadline among them).
        return await self._infer(model, inputs, priority, None, parameters, sequence)

    def infer_stream(
        self,
        model: str,
        inputs: Mapping[str, Any],
        *,
        priority: int = 0,
        parameters: Mapping[str, bool | int | float | str] | None = None,
    ) -> AbstractAsyncContextManager[ResponseStream]:
        """Open a stream of *model*'s responses to *inputs*, from ``async def infer``.

        *parameters* are the request's own, as ``engine.infer_stream`` takes them.

        For a decoupled model (Triton's ``exec(decoupled=True)``); use it as
        ``engine.infer_stream``::

            async with self.models.infer_stream("tokens", inputs) as responses:
                async for outputs in responses:
                    ...

        The model's generator runs at most 16 responses ahead of the reading;
        leaving the block, or the end of the requests the calling execution
        computes for (as for `infer`: its caller's deadline, its caller
        leaving), stops it at the ``yield`` it waits at. A model that is not
        decoupled answers with its one response, as `infer` would. The stream
        is opened also while the engine drains.

        Raises:
            ValueError: *model* is the calling model itself.
            BackendError: (Entering) *model* is not served.
            DeadlineExceeded: (Leaving) the deadline of the requests the
                execution computes for passed first, where no scope of theirs
                encloses the call (the model runs in the engine's task).
            TrioInferError: What ``engine.infer_stream`` raises, entering or
                iterating (``BackendError`` the other model raised mid-stream...).
        """
        return self._stream(model, inputs, priority, None, parameters)

    @asynccontextmanager
    async def _stream(
        self,
        model: str,
        inputs: Mapping[str, Any],
        priority: int,
        deadline: float | None,
        parameters: Mapping[str, bool | int | float | str] | None = None,
        ahead: int | None = None,
    ) -> AsyncIterator[ResponseStream]:
        entered = False
        try:
            async with infer_stream_follow_up(
                self._engine,
                model,
                inputs,
                priority=priority,
                caller=self._own,
                deadline=deadline,
                parameters=parameters,
                ahead=ahead,
            ) as responses:
                entered = True
                yield responses
        except ModelNotFound as exc:
            if entered:  # from the block's own code, not this call
                raise
            raise BackendError(
                f"model {self._own!r} called model {model!r}, which is not served: {exc}"
            ) from exc

    def _stateful(self, model: str) -> bool:
        """Whether *model* takes sequences (its config has one); True when it is not served.

        For the Triton shim's BLS calls, which pass a correlation id on only to a
        stateful model, as Triton's do: a model that is not served gets the call
        as it is, which says so. Safe from a worker thread: it only reads.
        """
        try:
            return self._engine.model(model).config.sequence is not None
        except TrioInferError:
            return True

    def infer_blocking(
        self,
        model: str,
        inputs: Mapping[str, Any],
        *,
        priority: int = 0,
        parameters: Mapping[str, bool | int | float | str] | None = None,
        sequence: SequenceFlags | None = None,
    ) -> dict[str, np.ndarray[Any, Any]]:
        """`infer`, from a plain ``def infer`` (or ``load``) on the instance's worker thread.

        Waits for the answer; the call runs on the event loop meanwhile.

        Raises:
            RuntimeError: Called on the event loop's thread, which this would block
                (``dispatch = "inline"``, or ``async def`` code): use ``await
                models.infer(...)`` from an ``async def infer`` there.
            DeadlineExceeded: Every request the execution computes for ended first
                (their deadline passed, or their callers left).
            ValueError, TrioInferError: As `infer`.
        """
        if threading.get_ident() == self._loop:
            raise RuntimeError(
                f"model {self._own!r}: models.infer_blocking() was called on the event "
                "loop's thread, which it would block while the call needs it; run the "
                "model on its worker thread (dispatch = 'thread'), or make its infer an "
                "async def and await models.infer()"
            )
        execution = getattr(self._computing, "value", None)
        return anyio.from_thread.run(
            self._infer_for,
            execution,
            model,
            inputs,
            priority,
            parameters,
            sequence,
            token=self._token,
        )

    def infer_stream_blocking(
        self,
        model: str,
        inputs: Mapping[str, Any],
        *,
        priority: int = 0,
        parameters: Mapping[str, bool | int | float | str] | None = None,
    ) -> BlockingResponses:
        """`infer_stream`, from a plain ``def infer`` on the instance's worker thread.

        Returns an iterator of *model*'s responses, each waited for; close it
        (``with``, as below, or its ``close()``) to stop the stream early::

            with self.models.infer_stream_blocking("tokens", inputs) as responses:
                for outputs in responses:
                    ...

        The stream is read on the event loop meanwhile, at most one response
        ahead of the thread; closing it stops *model*'s generator at the
        ``yield`` it waits at, and has when ``close()`` returns. A stream left
        open is stopped when ``infer`` returns (nothing outlives the
        execution), or when every request it computes for has ended.

        Raises:
            RuntimeError: Called on the event loop's thread (as `infer_blocking`),
                or outside ``infer`` (in ``load``, or from a thread of the model's own:
                no execution to bound the stream);
                (iterating) the stream, left open, is read after ``infer`` returned.
            DeadlineExceeded: (Iterating) every request the execution computes
                for ended first.
            ValueError, TrioInferError: As `infer_stream`, from this call (what
                entering raises) or from the iteration.
        """
        if threading.get_ident() == self._loop:
            raise RuntimeError(
                f"model {self._own!r}: models.infer_stream_blocking() was called on the "
                "event loop's thread, which it would block while the stream needs it; run "
                "the model on its worker thread (dispatch = 'thread'), or make its infer an "
                "async def and use models.infer_stream()"
            )
        execution = getattr(self._computing, "value", None)
        if execution is None:
            # Known per thread: a thread of the model's own (or load()) has no execution.
            raise RuntimeError(
                f"model {self._own!r}: models.infer_stream_blocking() works only on the thread "
                "that runs the model's infer, while it runs (a stream lives no longer than "
                "the execution it reads for); call it from infer itself, not from load() or "
                "a thread of the model's own"
            )
        pump = anyio.from_thread.run(
            self._bounded,
            execution,
            model,
            self._open,
            execution,
            model,
            inputs,
            priority,
            parameters,
            token=self._token,
        )
        return BlockingResponses._make(self, execution, model, pump)

    async def _open(
        self,
        execution: _Execution,
        model: str,
        inputs: Mapping[str, Any],
        priority: int,
        parameters: Mapping[str, bool | int | float | str] | None = None,
    ) -> _Pump:
        # On the event loop: a task of the execution's own reads the stream for the thread.
        pump = _Pump()
        assert execution.tasks is not None  # set for as long as _within runs
        await execution.tasks.start(
            self._pump, execution, pump, model, inputs, priority, parameters
        )
        return pump

    async def _pump(
        self,
        execution: _Execution,
        pump: _Pump,
        model: str,
        inputs: Mapping[str, Any],
        priority: int,
        parameters: Mapping[str, bool | int | float | str] | None = None,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        # Holds the stream open, in a task of the execution's own, and reads it for the
        # thread. Ends when the stream does, when the thread closes it, or the
        # execution aborts (its scope is among the execution's).
        started = False
        execution.scopes.add(pump.scope)
        try:
            with pump.scope:
                if execution.aborted:
                    pump.scope.cancel()
                # One ahead: the thread takes one response per hop to the loop anyway.
                async with self._stream(
                    model, inputs, priority, execution.deadline, parameters, ahead=1
                ) as stream:
                    started = True
                    task_status.started()
                    await pump.serve(stream)
        except TrioInferError as exc:
            if not started:
                raise  # to the thread's infer_stream_blocking() call
            pump.error = exc  # raised by the thread's next(), after the responses before it
        finally:
            execution.scopes.discard(pump.scope)
            pump.end()
        if not started:
            # Stopped before the stream opened (the execution aborted): say so to the thread.
            raise DeadlineExceeded(_ended(self._own, model))

    async def _run(self, worker: WorkerThread, infer: Any, inputs: Any, abort: Any) -> Any:
        """Run a plain ``def infer`` on *worker* with its calls bound to this execution.

        Its streams (`infer_stream_blocking`) are read by tasks of a group the
        execution owns: stopped when ``infer`` returns, at the latest.
        """
        execution = _Execution()
        body: BaseException | None = None
        try:
            async with anyio.create_task_group() as tasks:
                execution.tasks = tasks
                try:
                    return await worker.run_sync(
                        self._within,
                        execution,
                        infer,
                        inputs,
                        abort=functools.partial(_abort_both, execution, abort),
                    )
                except BaseException as exc:
                    body = exc
                    raise
                finally:
                    execution.tasks = None
                    execution.returned = True
                    if execution.scopes:
                        # The streams the thread left open (its calls have all returned).
                        # Only then: cancelling the group costs a Cancelled raised and
                        # caught, a sixth of a thread's call to another model.
                        execution.abort()
        except BaseExceptionGroup as group:
            # The group wraps infer's own error (or cancellation): hand it on as it was.
            if body is not None and _only(group, body):
                raise body from None
            raise

    async def _bounded(
        self, execution: _Execution, model: str, fn: Callable[..., Awaitable[T]], *args: Any
    ) -> T:
        # A thread's call, on the event loop, ended when *execution* is aborted.
        with anyio.CancelScope() as scope:
            if execution.aborted:
                scope.cancel()
            execution.scopes.add(scope)
            try:
                return await fn(*args)
            finally:
                execution.scopes.discard(scope)
        raise _stopped(execution, self._own, model)

    def _within(self, execution: _Execution, infer: Any, inputs: Any) -> Any:
        # On the worker thread: *infer* with its execution known to infer_blocking
        # (the thread does not see the event loop's context).
        self._computing.value = execution
        try:
            return infer(inputs)
        finally:
            self._computing.value = None

    async def _infer_for(
        self,
        execution: _Execution | None,
        model: str,
        inputs: Mapping[str, Any],
        priority: int,
        parameters: Mapping[str, bool | int | float | str] | None = None,
        sequence: SequenceFlags | None = None,
    ) -> dict[str, np.ndarray[Any, Any]]:
        # infer_blocking's call, on the event loop, ended when *execution* is aborted.
        if execution is None:  # from load(), or a thread of the model's own
            return await self._infer(model, inputs, priority, math.inf, parameters, sequence)
        # The deadline execute() read: this task, started for the thread, runs under no
        # scope of the callers' and does not see the execution's context.
        return await self._bounded(
            execution,
            model,
            self._infer,
            model,
            inputs,
            priority,
            execution.deadline,
            parameters,
            sequence,
        )

    async def _infer(
        self,
        model: str,
        inputs: Mapping[str, Any],
        priority: int,
        deadline: float | None = None,
        parameters: Mapping[str, bool | int | float | str] | None = None,
        sequence: SequenceFlags | None = None,
    ) -> dict[str, np.ndarray[Any, Any]]:
        # A call to itself, by whatever name, is refused there (ValueError). The request
        # carries the callers' deadline (None: the execution's, read in its task).
        try:
            return dict(
                await infer_follow_up(
                    self._engine,
                    model,
                    inputs,
                    priority=priority,
                    caller=self._own,
                    deadline=deadline,
                    parameters=parameters,
                    sequence=sequence,
                )
            )
        except ModelNotFound as exc:
            # The calling model's code or config is wrong, not its client's request:
            # a 500 naming both, not a 404 for a model the client did not ask for.
            raise BackendError(
                f"model {self._own!r} called model {model!r}, which is not served: {exc}"
            ) from exc


@final
class BlockingResponses:
    """A stream's responses for a worker thread: what `Models.infer_stream_blocking` returns.

    An iterator of outputs by name, each ``next()`` waiting for the next
    response; a context manager whose exit closes it. Made only by
    ``infer_stream_blocking``.
    """

    __slots__ = ("_closed", "_execution", "_model", "_models", "_pump")
    _closed: bool
    _execution: _Execution
    _model: str
    _models: Models
    _pump: _Pump

    def __init__(self) -> None:
        raise TypeError(
            "BlockingResponses has no public constructor: models.infer_stream_blocking() makes it"
        )

    @classmethod
    def _make(
        cls, models: Models, execution: _Execution, model: str, pump: _Pump
    ) -> BlockingResponses:
        self = object.__new__(cls)
        self._models = models
        self._execution = execution
        self._model = model
        self._pump = pump
        self._closed = False
        return self

    def __iter__(self) -> BlockingResponses:
        return self

    def __next__(self) -> dict[str, np.ndarray[Any, Any]]:
        """The next response, waited for; ``StopIteration`` after the last, or once closed.

        Raises:
            DeadlineExceeded: Every request the execution computes for ended first.
            RuntimeError: The stream was left open, and is read after ``infer`` returned.
            TrioInferError: What ended the stream, after the responses before it.
        """
        if self._closed:
            raise StopIteration
        models, pump = self._models, self._pump
        try:
            return anyio.from_thread.run(
                models._bounded, self._execution, self._model, pump.next, token=models._token
            )
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            self._closed = True
            if pump.error is not None:
                raise pump.error from None
            if not pump.complete:  # stopped with the execution: it returned, or its callers left
                raise _stopped(self._execution, models._own, self._model) from None
            raise StopIteration from None

    def close(self) -> None:
        """Stop the stream now (idempotent): the other model's generator has stopped on return."""
        if not self._closed:
            self._closed = True
            anyio.from_thread.run(self._pump.stop, token=self._models._token)

    def __enter__(self) -> BlockingResponses:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@final
class _Pump:
    """One stream read on the event loop for a worker thread (`Models._pump`).

    The thread asks for each response: the stream is read one response per
    ask, so the other model runs at most one ahead of the thread, as of any
    reader of a stream.
    """

    __slots__ = ("answering", "answers", "asking", "asks", "complete", "done", "error", "scope")

    def __init__(self) -> None:
        self.scope = anyio.CancelScope()
        self.asking, self.asks = anyio.create_memory_object_stream[None](0)
        self.answering, self.answers = anyio.create_memory_object_stream[
            dict[str, np.ndarray[Any, Any]]
        ](0)
        self.error: BaseException | None = None
        self.complete = False  # the model sent its last response
        self.done = anyio.Event()

    async def serve(self, stream: ResponseStream) -> None:
        """In the pump's task: a response for each ask, until the stream or the thread ends."""
        try:
            async for _ in self.asks:
                try:
                    outputs = await stream.__anext__()
                except StopAsyncIteration:
                    self.complete = True
                    return
                await self.answering.send(dict(outputs))
        except anyio.BrokenResourceError:
            return  # the thread closed it

    async def next(self) -> dict[str, np.ndarray[Any, Any]]:
        """The next response, for the thread's iteration; ``EndOfStream`` once there is none."""
        try:
            await self.asking.send(None)
            return await self.answers.receive()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            raise anyio.EndOfStream from None

    def end(self) -> None:
        """The pump's task has ended (the stream is closed): nothing more to read."""
        for channel in (self.asking, self.asks, self.answering, self.answers):
            channel.close()
        self.done.set()

    async def stop(self) -> None:
        """The thread closed the stream: end it, and wait until the model has stopped."""
        self.scope.cancel()
        await self.done.wait()


@final
class _Execution:
    """A plain ``def infer``'s execution on its worker thread, for its calls to end with it."""

    __slots__ = ("aborted", "deadline", "returned", "scopes", "tasks")

    def __init__(self) -> None:
        """Made in ``execute``, on the event loop, in the execution's task."""
        self.aborted = False
        #: Its ``infer`` returned (or raised): a stream still read is one left open.
        self.returned = False
        self.scopes: set[anyio.CancelScope] = set()
        #: The latest deadline its callers set: its calls' requests carry it.
        self.deadline = current_callers_deadline()
        #: Where the thread's streams are read, while infer runs (`Models._run`).
        self.tasks: anyio.abc.TaskGroup | None = None

    def abort(self) -> None:
        """Every request it computed for has ended: end its calls (on the event loop)."""
        self.aborted = True
        for scope in self.scopes:
            scope.cancel()


def _abort_both(execution: _Execution, abort: Any) -> None:
    # Every caller of a plain def infer's execution left: its calls to other models
    # end, and the model's own abort(), if it has one, is asked to stop it early.
    execution.abort()
    if abort is not None:
        abort()


def _ended(own: str, model: str) -> str:
    return (
        f"a call by model {own!r} to model {model!r} did not end before the deadline of the "
        "requests it computes for, or before their callers left"
    )


def _stopped(execution: _Execution, own: str, model: str) -> Exception:
    # Why a thread's call or stream of *execution*'s ended before its answer.
    if execution.returned:
        # A thread of the model's own reading a stream that infer left open: no deadline
        # passed, the stream ended with the execution that opened it.
        return RuntimeError(
            f"model {own!r}: its stream from model {model!r} was read after its infer "
            "returned, which stopped it; expected every stream read (or closed) before "
            "infer returns"
        )
    return DeadlineExceeded(_ended(own, model))


def _only(group: BaseExceptionGroup[BaseException], error: BaseException) -> bool:
    return all(
        leaf is error or (isinstance(leaf, BaseExceptionGroup) and _only(leaf, error))
        for leaf in group.exceptions
    )
