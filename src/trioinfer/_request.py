"""Requests: what a caller asked for, and the bookkeeping that makes it end exactly once."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from .abc import Status

if TYPE_CHECKING:
    from ._sequence import SequenceFlags
    from ._threads import EventLike

Outputs = dict[str, np.ndarray[Any, Any]]

_ids = itertools.count(1)
_sequences = itertools.count()


def next_request_id() -> str:
    """A process-unique request id, for requests whose caller gave none."""
    return str(next(_ids))


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
    """One call of `Engine.infer()`: the engine's own implementation of `trioinfer.abc.Request`.

    Plugins see it through that Protocol; its attributes are documented there.
    The mutable bookkeeping that makes it end exactly once is in ``_state``,
    which only the engine touches. A copy (``copy.copy``, a pickle round
    trip) keeps the original's ``sequence``, so do not queue a copy beside it.
    """

    model: str
    inputs: Mapping[str, np.ndarray[Any, Any]] = attrs.field(repr=False)
    id: str = attrs.field(factory=next_request_id)
    priority: int = 0
    tenant: str | None = None
    deadline: float = math.inf
    arrival: float = 0.0
    rows: int = 1
    sequence_flags: SequenceFlags | None = None
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
