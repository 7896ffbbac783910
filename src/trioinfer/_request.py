"""Requests: what a caller asked for, and the bookkeeping that makes it end exactly once."""

from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

if TYPE_CHECKING:
    from ._threads import EventLike

Outputs = dict[str, np.ndarray[Any, Any]]

_ids = itertools.count(1)
_sequences = itertools.count()


def next_request_id() -> str:
    """A process-unique request id, for requests whose caller gave none."""
    return str(next(_ids))


class Status(enum.Enum):
    """Where a request is on its path through the engine."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"


@attrs.define(eq=False, slots=True)
class _State:
    # Mutable bookkeeping behind the frozen Request; only the engine touches it.
    done: EventLike | None = None
    status: Status = Status.QUEUED
    outputs: Outputs | None = None
    error: BaseException | None = None
    abandoned: bool = False
    batch: Any = None
    # Who answered (a Replica, or the name of the model failed over to) and the
    # fallback steps taken on the way, for InferenceResult.
    served_by: Any = None
    fallbacks: tuple[str, ...] = ()
    # Set on requests a fallback sent to another model, which fail over no further.
    failover: bool = False


@attrs.frozen(eq=False)
class Request:
    """One call of [`Engine.infer()`][trioinfer.Engine.infer], as schedulers and batchers see it.

    Requests compare and hash by identity, so a scheduler can key a dict by them.

    Attributes:
        model: The model's name.
        inputs: The validated inputs, by input name.
        id: The caller's request id, or a generated one.
        priority: Higher runs sooner under schedulers that order by priority; default 0.
        tenant: Who the request is for, for fair-share scheduling; ``None`` if not given.
        deadline: The caller's effective deadline on the engine's clock
            (``math.inf`` when the caller set none).
        arrival: When the request was accepted, on the same clock.
        rows: How many rows (batch entries) the request carries.
        sequence: A number that grows with every request made in this process:
            the order requests were made in. Schedulers break ties with it
            (the ``deadline`` scheduler runs equal deadlines in this order);
            it never changes and is not an argument. Each request the engine
            makes has its own; a copy (``copy.copy``, a pickle round trip)
            keeps the original's, so do not queue a copy beside it.
    """

    model: str
    inputs: Mapping[str, np.ndarray[Any, Any]] = attrs.field(repr=False)
    id: str = attrs.field(factory=next_request_id)
    priority: int = 0
    tenant: str | None = None
    deadline: float = math.inf
    arrival: float = 0.0
    rows: int = 1
    sequence: int = attrs.field(factory=_sequences.__next__, init=False)
    _state: _State = attrs.field(factory=_State, init=False, repr=False)

    @property
    def status(self) -> Status:
        """Queued, running or done."""
        return self._state.status

    @property
    def abandoned(self) -> bool:
        """Whether the caller has stopped waiting (it was cancelled)."""
        return self._state.abandoned
