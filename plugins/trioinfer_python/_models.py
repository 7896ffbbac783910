"""What a Python model calls other models with (Triton's business logic scripting, BLS)."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any, final

import anyio
import anyio.from_thread
import anyio.lowlevel
import numpy as np

from trioinfer import BackendError, DeadlineExceeded, Engine, ModelNotFound
from trioinfer.lowlevel import current_batch_deadline, infer_follow_up


@final
class Models:
    """The other models of the engine serving a Python model, for it to call while it computes.

    A model's class gets one as its ``models`` keyword argument, if its
    ``__init__`` takes one (as ``device``). Each call is an ordinary request
    to the other model, as ``engine.infer`` makes (its batcher, scheduler,
    instances, statistics), under the deadline of the requests the calling
    execution computes for (`trioinfer.lowlevel.current_batch_deadline`):
    past it the call ends with ``DeadlineExceeded`` and never reaches the
    other model's backend; when every caller has left, an ``async def
    infer`` is cancelled, and its calls with it. Calls go on while the engine
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

    __slots__ = ("_deadline", "_engine", "_loop", "_own", "_token")

    def __init__(self, engine: Engine, own: str) -> None:
        """Made by the backend at load, on the event loop."""
        self._engine = engine
        self._own = own
        self._token = anyio.lowlevel.current_token()
        self._loop = threading.get_ident()
        # The deadline of the execution a worker thread computes (a plain def infer).
        self._deadline = threading.local()

    async def infer(
        self, model: str, inputs: Mapping[str, Any], *, priority: int = 0
    ) -> dict[str, np.ndarray[Any, Any]]:
        """Run *model* on *inputs* and return its outputs, from ``async def infer``.

        (A plain ``infer`` on the event loop, ``dispatch = "inline"``, can
        neither await this nor block on `infer_blocking`: make it async.)

        Raises:
            ValueError: *model* is the calling model itself.
            DeadlineExceeded: The calling requests' deadline passed first.
            TrioInferError: What the other model's request raised.
        """
        return await self._infer(model, inputs, priority, current_batch_deadline())

    def infer_blocking(
        self, model: str, inputs: Mapping[str, Any], *, priority: int = 0
    ) -> dict[str, np.ndarray[Any, Any]]:
        """`infer`, from a plain ``def infer`` (or ``load``) on the instance's worker thread.

        Waits for the answer; the call runs on the event loop meanwhile.

        Raises:
            RuntimeError: Called on the event loop's thread, which this would block
                (``dispatch = "inline"``, or ``async def`` code): use ``await
                models.infer(...)`` from an ``async def infer`` there.
            ValueError, DeadlineExceeded, TrioInferError: As `infer`.
        """
        if threading.get_ident() == self._loop:
            raise RuntimeError(
                f"model {self._own!r}: models.infer_blocking() was called on the event "
                "loop's thread, which it would block while the call needs it; run the "
                "model on its worker thread (dispatch = 'thread'), or make its infer an "
                "async def and await models.infer()"
            )
        deadline = getattr(self._deadline, "value", float("inf"))
        return anyio.from_thread.run(
            self._infer, model, inputs, priority, deadline, token=self._token
        )

    def _within(self, deadline: float, infer: Any, inputs: Any) -> Any:
        # On the worker thread: *infer* with its execution's deadline known to
        # infer_blocking (the thread does not see the event loop's context).
        self._deadline.value = deadline
        try:
            return infer(inputs)
        finally:
            self._deadline.value = float("inf")

    async def _infer(
        self, model: str, inputs: Mapping[str, Any], priority: int, deadline: float
    ) -> dict[str, np.ndarray[Any, Any]]:
        # A call to itself, by whatever name, is refused there (ValueError).
        with anyio.CancelScope(deadline=deadline) as scope:
            try:
                return dict(
                    await infer_follow_up(
                        self._engine, model, inputs, priority=priority, caller=self._own
                    )
                )
            except ModelNotFound as exc:
                # The calling model's code or config is wrong, not its client's request:
                # a 500 naming both, not a 404 for a model the client did not ask for.
                raise BackendError(
                    f"model {self._own!r} called model {model!r}, which is not served: {exc}"
                ) from exc
        assert scope.cancelled_caught
        raise DeadlineExceeded(
            f"model {self._own!r}'s call to model {model!r} did not end before the deadline "
            "of the requests it computes for"
        )
