"""Requests: what a caller asked for, and the bookkeeping that makes it end exactly once."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, cast, final

import attrs
import numpy as np
from trio.lowlevel import Abort

from . import abc
from ._exceptions import InvalidInput
from .abc import Status

if TYPE_CHECKING:
    from ._sequence import SequenceFlags
    from ._threads import EventLike

Outputs = dict[str, np.ndarray[Any, Any]]

#: A request parameter's value (Triton's parameters extension: bool, int, float or str).
Parameter = bool | int | float | str


@final
class _Parameters(Mapping[str, Parameter]):
    # A request's parameters, read-only; unlike a mappingproxy it pickles (a request
    # copied to another process keeps them).
    __slots__ = ("_given",)

    def __init__(self, given: dict[str, Parameter]) -> None:
        self._given = given

    def __getitem__(self, key: str) -> Parameter:
        return self._given[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._given)

    def __len__(self) -> int:
        return len(self._given)

    def __repr__(self) -> str:
        return repr(self._given)

    def __reduce__(self) -> tuple[type[_Parameters], tuple[dict[str, Parameter]]]:
        return _Parameters, (self._given,)


#: The parameters of a request that has none: one shared, read-only empty mapping.
NO_PARAMETERS: Mapping[str, Parameter] = _Parameters({})

_SUCCEEDED = Abort.SUCCEEDED
_QUEUED = Status.QUEUED
_ids = itertools.count(1)
_sequences = itertools.count()


_PARAMETER_TYPES = (bool, int, float, str)


def checked_parameters(parameters: object) -> Mapping[str, Parameter]:
    """A caller's request *parameters*, copied read-only (`NO_PARAMETERS` when empty).

    Raises:
        InvalidInput: *parameters* is not a mapping, or a key is not a string, or a
            value is not a bool, int, float or str (naming the key).
    """
    if not isinstance(parameters, Mapping):
        raise InvalidInput(
            "a request's parameters must be a mapping of names to bool, int, float or "
            f"str values, got {type(parameters).__name__}"
        )
    if not parameters:
        return NO_PARAMETERS
    copied: dict[str, Parameter] = {}
    for key, value in parameters.items():
        if not isinstance(key, str):
            raise InvalidInput(f"request parameter names must be strings, got {key!r}")
        if not isinstance(value, _PARAMETER_TYPES):
            raise InvalidInput(
                f"request parameter {key!r} must be a bool, int, float or str, got "
                f"{type(value).__name__} {value!r:.80}"
            )
        copied[key] = value
    return _Parameters(copied)


class GeneratedId(str):
    """A request id the engine made, for a request whose caller gave none.

    A ``str`` in every way but its class, by which `caller_request_id` tells
    it from a caller's own (which may be any text, digits too).
    """

    __slots__ = ()


def next_request_id() -> str:
    """A process-unique request id, for requests whose caller gave none."""
    return GeneratedId(next(_ids))


class StepId(str):
    """The id of a pipeline step's request: ``"<the pipeline request's id>/<step>"``.

    Its own in logs and traces (each step request of a pipeline request has
    one), while `caller_request_id` reads through it to the id the pipeline
    request's caller gave, as Triton gives a composing model the ensemble
    request's id. *of*: the pipeline request's id (a step's, for a pipeline
    that is a step of another).
    """

    # (No __slots__: a str subclass may have no slots of its own, so *of* is in __dict__.)
    of: str


def step_request_id(of: str, step: int) -> StepId:
    """The id of step *step*'s request for the pipeline request whose id is *of*."""
    made = StepId(f"{of}/{step}")
    made.of = of
    return made


def set_response_parameters(request: abc.Request, parameters: Mapping[str, Parameter]) -> None:
    """Give the answer to *request* these response *parameters* (Triton's response parameters).

    For a backend whose model answers with parameters as well as outputs: a
    `RequestsInstance` calls it for a request before it returns that
    request's answer, a `StreamingInstance` for its stream's request
    (`current_stream_request`) before each response it yields (each
    response has its own; none given: none). They reach the caller in
    ``InferenceResult.parameters`` (``engine.infer_detailed``) and
    ``ResponseStream.parameters``, and the client in the response's
    ``parameters`` (HTTP and gRPC; a generate response's keys). The response
    cache does not keep an answer that carries them.

    Raises:
        InvalidInput: *parameters* are not names to bool, int, float or str values.
    """
    state: _State = request._state  # type: ignore[attr-defined]  # (the engine's own)
    state.response_parameters = checked_parameters(parameters)


def caller_request_id(request: abc.Request) -> str:
    """The id *request*'s caller gave it, or ``""`` where the engine made one.

    For a backend that hands a model the caller's id as Triton does (its
    ``request_id()`` is empty for a request sent without one). A pipeline
    step's request answers with the id its pipeline request's caller gave (Triton
    gives a composing model the ensemble request's id), though the engine's own
    id for it (``request.id``, in logs and traces) names the step.
    """
    given = request.id
    while given.__class__ is StepId:
        given = given.of
    return "" if given.__class__ is GeneratedId else given


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
    # Its deadline is its model's queue timeout, not its caller's (who waits for the run).
    queue_timeout: bool = False
    # The parameters of its answer (a stream's: of the response being made), given by
    # its backend (set_response_parameters).
    response_parameters: Mapping[str, Parameter] = NO_PARAMETERS

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
        self.queue_timeout = False
        self.response_parameters = NO_PARAMETERS

    def abort(self, _raise_cancel: object) -> Any:
        # Trio's abort callback for the parked task: cancelled, it is no longer
        # there to reschedule (it withdraws the request itself).
        self.task = None
        return _SUCCEEDED


class _Slots:
    # Request's slots, __weakref__ among them, defined once for Request and _Draft
    # (make_request, below): two classes that each define a __weakref__ slot of
    # their own do not share a layout, and Python refuses to change one into the
    # other; two that add nothing to one base do. attrs reuses these slots.
    __slots__ = (
        "__weakref__",
        "_state",
        "arrival",
        "deadline",
        "id",
        "inputs",
        "model",
        "parameters",
        "priority",
        "requested_outputs",
        "rows",
        "sequence",
        "sequence_flags",
        "tenant",
    )


@attrs.frozen(eq=False, weakref_slot=False)
class Request(_Slots):
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
    parameters: Mapping[str, Parameter] = attrs.field(default=NO_PARAMETERS, repr=False)
    requested_outputs: tuple[str, ...] = ()
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


# make_request: what Request's attrs __init__ does, at a third of its cost: the
# request path builds one per call. A frozen Request refuses plain attribute
# stores, and its attrs __init__ (or each slot's own descriptor) costs a call per
# field; so make_request fills a _Draft, a class with exactly Request's slots and
# no frozen __setattr__, with plain stores, then makes it a Request by assigning
# its __class__ (Python allows that between classes of the same layout). The
# fields it is given and the ones it sets itself, as their factories do, are all
# of Request's (checked below; a test compares it with Request(...)). It runs no
# validators or converters (Request has none).
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
    "parameters",
    "requested_outputs",
)
_OWN = ("sequence", "_state")
assert {field.name for field in attrs.fields(Request)} == {*_GIVEN, *_OWN}, (
    "make_request must set every field of Request"
)
_new = object.__new__


assert set(_Slots.__slots__) == {*_GIVEN, *_OWN, "__weakref__"}
assert not vars(Request).get("__slots__")  # attrs added none: the layout is _Slots'


class _Draft(_Slots):
    # A Request being filled in: Request's layout, mutable.
    __slots__ = ()


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
    parameters: Mapping[str, Parameter] = NO_PARAMETERS,
    requested_outputs: tuple[str, ...] = (),
) -> Request:
    """``Request(model, inputs, id=id, ...)``, at a third of the cost; *id* None: a new one."""
    draft: Any = _new(_Draft)
    draft.model = model
    draft.inputs = inputs
    draft.id = id if id is not None else GeneratedId(_next_id())
    draft.priority = priority
    draft.tenant = tenant
    draft.deadline = deadline
    draft.arrival = arrival
    draft.rows = rows
    draft.sequence_flags = sequence_flags
    draft.parameters = parameters
    draft.requested_outputs = requested_outputs
    draft.sequence = _next_sequence()
    draft._state = _State()
    draft.__class__ = Request
    return cast(Request, draft)


def _make_request_slowly(
    model: str,
    inputs: Mapping[str, np.ndarray[Any, Any]],
    id: str | None,
    priority: int,
    tenant: str | None,
    deadline: float,
    arrival: float,
    rows: int,
    sequence_flags: SequenceFlags | None = None,
    parameters: Mapping[str, Parameter] = NO_PARAMETERS,
    requested_outputs: tuple[str, ...] = (),
) -> Request:
    # make_request through each slot's own descriptor, for a Python whose objects
    # cannot change class (none known; checked once, below).
    request = _new(Request)
    for name, value in (
        ("model", model),
        ("inputs", inputs),
        ("id", id if id is not None else GeneratedId(_next_id())),
        ("priority", priority),
        ("tenant", tenant),
        ("deadline", deadline),
        ("arrival", arrival),
        ("rows", rows),
        ("sequence_flags", sequence_flags),
        ("parameters", parameters),
        ("requested_outputs", requested_outputs),
        ("sequence", _next_sequence()),
        ("_state", _State()),
    ):
        getattr(Request, name).__set__(request, value)
    return request


_next_sequence = _sequences.__next__
_next_id = _ids.__next__
try:
    make_request("", {}, "", 0, None, math.inf, 0.0, 1)  # the class change, tried once
except TypeError:  # pragma: no cover - CPython and PyPy allow it
    make_request = _make_request_slowly
