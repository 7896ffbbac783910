"""Requests: what a caller asked for, and the bookkeeping that makes it end exactly once."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
from trio.lowlevel import Abort

from .abc import Status

if TYPE_CHECKING:
    from ._sequence import SequenceFlags
    from ._threads import EventLike

Outputs = dict[str, np.ndarray[Any, Any]]

_SUCCEEDED = Abort.SUCCEEDED
_QUEUED = Status.QUEUED
_ids = itertools.count(1)
_sequences = itertools.count()


def next_request_id() -> str:
    """A process-unique request id, for requests whose caller gave none."""
    return str(next(_ids))


@attrs.define(eq=False, slots=True, init=False)
class _State:
    # Mutable bookkeeping behind the frozen Request; only the engine touches it.
    # Its one caller waits on *done*, or, on Trio's fast path, parks its *task*
    # here, to be rescheduled when the request ends (see abort()).
    done: EventLike | None = None
    task: Any = None
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
    # The request's spans when it is traced (trioinfer._tracing), None otherwise.
    trace: Any = None

    def __init__(self) -> None:
        # Every field at its default, written out: attrs' __init__ takes each as an
        # argument, and one is made per request.
        self.done = None
        self.task = None
        self.status = _QUEUED
        self.outputs = None
        self.error = None
        self.abandoned = False
        self.batch = None
        self.served_by = None
        self.fallbacks = ()
        self.failover = False
        self.trace = None

    def abort(self, _raise_cancel: object) -> Any:
        # Trio's abort callback for the parked task: cancelled, it is no longer
        # there to reschedule (it withdraws the request itself).
        self.task = None
        return _SUCCEEDED


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


# make_request: what Request's attrs __init__ does, setting each slot through its
# own descriptor (half the cost: the request path builds one per call). Fields
# other than the ones it is given take their defaults, as in __init__; it runs
# no validators or converters (Request has none).
_GIVEN = (
    "model",
    "inputs",
    "id",
    "priority",
    "tenant",
    "deadline",
    "arrival",
    "rows",
    "sequence_flags",
)
# Set by make_request itself, as their factories do (a test compares the two).
_OWN = ("sequence", "_state")
_SET = {field.name: getattr(Request, field.name).__set__ for field in attrs.fields(Request)}
# (setter, default, factory, whether the factory takes the instance) of each other field.
_REST: tuple[tuple[Any, Any, Any, bool], ...] = tuple(
    (
        _SET[field.name],
        field.default,
        getattr(field.default, "factory", None),
        bool(getattr(field.default, "takes_self", False)),
    )
    for field in attrs.fields(Request)
    if field.name not in _GIVEN and field.name not in _OWN
)
_new = object.__new__


def make_request(
    model: str,
    inputs: Mapping[str, np.ndarray[Any, Any]],
    id: str | None,
    priority: int,
    tenant: str | None,
    deadline: float,
    arrival: float,
    rows: int,
    sequence_flags: SequenceFlags | None = None,
) -> Request:
    """``Request(model, inputs, id=id, ...)``, at about half the cost; *id* None: a new one."""
    request = _new(Request)
    _set_model(request, model)
    _set_inputs(request, inputs)
    _set_id(request, id if id is not None else str(_next_id()))
    _set_priority(request, priority)
    _set_tenant(request, tenant)
    _set_deadline(request, deadline)
    _set_arrival(request, arrival)
    _set_rows(request, rows)
    _set_sequence_flags(request, sequence_flags)
    _set_sequence(request, _next_sequence())
    _set_state(request, _State())
    for set_, default, factory, takes_self in _REST:
        if factory is None:
            set_(request, default)
        else:
            set_(request, factory(request) if takes_self else factory())
    return request


(
    _set_model,
    _set_inputs,
    _set_id,
    _set_priority,
    _set_tenant,
    _set_deadline,
    _set_arrival,
    _set_rows,
    _set_sequence_flags,
    _set_sequence,
    _set_state,
) = (_SET[name] for name in (*_GIVEN, *_OWN))
_next_sequence = _sequences.__next__
_next_id = _ids.__next__
