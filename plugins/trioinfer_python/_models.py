"""What a Python model calls other models with (Triton's business logic scripting, BLS)."""

from __future__ import annotations

import math
import threading
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, final

import anyio
import anyio.from_thread
import anyio.lowlevel
import numpy as np

from trioinfer import BackendError, DeadlineExceeded, Engine, ModelNotFound, ResponseStream
from trioinfer.lowlevel import current_callers_deadline, infer_follow_up, infer_stream_follow_up


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
        self, model: str, inputs: Mapping[str, Any], *, priority: int = 0
    ) -> dict[str, np.ndarray[Any, Any]]:
        """Run *model* on *inputs* and return its outputs, from ``async def infer``.

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
        return await self._infer(model, inputs, priority)

    def infer_stream(
        self, model: str, inputs: Mapping[str, Any], *, priority: int = 0
    ) -> AbstractAsyncContextManager[ResponseStream]:
        """Open a stream of *model*'s responses to *inputs*, from ``async def infer``.

        For a decoupled model (Triton's ``exec(decoupled=True)``); use it as
        ``engine.infer_stream``::

            async with self.models.infer_stream("tokens", inputs) as responses:
                async for outputs in responses:
                    ...

        The model's generator runs at most one response ahead of the reading;
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
        return self._stream(model, inputs, priority)

    @asynccontextmanager
    async def _stream(
        self, model: str, inputs: Mapping[str, Any], priority: int
    ) -> AsyncIterator[ResponseStream]:
        entered = False
        try:
            async with infer_stream_follow_up(
                self._engine, model, inputs, priority=priority, caller=self._own
            ) as responses:
                entered = True
                yield responses
        except ModelNotFound as exc:
            if entered:  # from the block's own code, not this call
                raise
            raise BackendError(
                f"model {self._own!r} called model {model!r}, which is not served: {exc}"
            ) from exc

    def infer_blocking(
        self, model: str, inputs: Mapping[str, Any], *, priority: int = 0
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
            self._infer_for, execution, model, inputs, priority, token=self._token
        )

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
    ) -> dict[str, np.ndarray[Any, Any]]:
        # infer_blocking's call, on the event loop, ended when *execution* is aborted.
        if execution is None:  # from load(), or a thread of the model's own
            return await self._infer(model, inputs, priority, math.inf)
        with anyio.CancelScope() as scope:
            if execution.aborted:
                scope.cancel()
            execution.scopes.add(scope)
            try:
                # The deadline execute() read: this task, started for the thread, runs
                # under no scope of the callers' and does not see the execution's context.
                return await self._infer(model, inputs, priority, execution.deadline)
            finally:
                execution.scopes.discard(scope)
        raise DeadlineExceeded(
            f"model {self._own!r}'s call to model {model!r} did not end before the deadline "
            "of the requests it computes for, or before their callers left"
        )

    async def _infer(
        self, model: str, inputs: Mapping[str, Any], priority: int, deadline: float | None = None
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
                )
            )
        except ModelNotFound as exc:
            # The calling model's code or config is wrong, not its client's request:
            # a 500 naming both, not a 404 for a model the client did not ask for.
            raise BackendError(
                f"model {self._own!r} called model {model!r}, which is not served: {exc}"
            ) from exc


@final
class _Execution:
    """A plain ``def infer``'s execution on its worker thread, for its calls to end with it."""

    __slots__ = ("aborted", "deadline", "scopes")

    def __init__(self) -> None:
        """Made in ``execute``, on the event loop, in the execution's task."""
        self.aborted = False
        self.scopes: set[anyio.CancelScope] = set()
        #: The latest deadline its callers set: its calls' requests carry it.
        self.deadline = current_callers_deadline()

    def abort(self) -> None:
        """Every request it computed for has ended: end its calls (on the event loop)."""
        self.aborted = True
        for scope in self.scopes:
            scope.cancel()
