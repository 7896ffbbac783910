"""The ``deadline`` scheduler: earliest deadline first, with optional refusal at admission."""

from __future__ import annotations

import math
from collections import OrderedDict
from numbers import Real
from operator import attrgetter
from typing import final

from trioinfer import ConfigError, DeadlineExceeded
from trioinfer.lowlevel import Request, SchedulerContext

from ._options import already_held
from ._sorted import TimeQueue


@final
class DeadlineScheduler:
    """Earliest deadline first (EDF): the request whose caller gives up soonest runs next.

    A request's deadline is its caller's: the effective deadline of the cancel
    scope around ``engine.infer`` (``trio.fail_after``, ``move_on_after``...).
    Requests without one run after every request that has one, first come
    first served among themselves; requests with equal deadlines also run in
    the order they came (their `Request.sequence`).

    With *refuse_late*, a request that cannot finish in time is refused at
    admission with [`DeadlineExceeded`][trioinfer.DeadlineExceeded] (counted as
    ``refused`` in the model's statistics) instead of waiting only to expire,
    or worse, being computed for nobody. The estimate is deliberately simple:

        finish = now + (ahead // instances + 1) * execution_estimate

    where *ahead* counts the waiting requests that would run before it (those
    with an earlier or equal deadline), *instances* is the model's instance
    count and *execution_estimate* the engine's moving average of one
    execution. Until the model has run once there is no estimate, and nothing
    is refused. (A request that a batcher takes and then gives back goes to
    the head of the engine's queue, not through `push` again, so it is never
    refused.) The estimate ignores batching (a batch serves several requests
    in one execution) and the executions already running, so it errs
    towards admitting.

    Push, pop and remove cost O(log n) (O(1) for requests without a deadline),
    counting *ahead* included; the count is skipped when even the whole queue
    ahead would leave time enough.

    Args:
        refuse_late: Refuse at admission requests that the estimate says cannot
            finish before their deadline.
    """

    __slots__ = ("_context", "_open", "_queue", "_refuse_late")

    def __init__(self, *, refuse_late: bool = False) -> None:
        if not isinstance(refuse_late, bool):
            raise ConfigError(
                f"deadline scheduler: refuse_late must be true or false, got {refuse_late!r}"
            )
        self._refuse_late = refuse_late
        self._context: SchedulerContext | None = None
        # The requests that have a deadline, by deadline.
        self._queue: TimeQueue[Request] = TimeQueue(attrgetter("sequence"))
        # The requests without a deadline, in admission order.
        self._open: OrderedDict[Request, None] = OrderedDict()

    @property
    def refuse_late(self) -> bool:
        """Whether hopeless requests are refused at admission."""
        return self._refuse_late

    def attach(self, context: SchedulerContext) -> None:
        """Learn the model's execution estimate and instance count (the engine calls this once)."""
        self._context = context

    def push(self, request: Request) -> None:
        """Queue *request* by its deadline.

        All or nothing: what it raises, it raises before it changed anything.

        Raises:
            DeadlineExceeded: With *refuse_late*, the request cannot finish in time.
            TypeError: The request's deadline is not a real number.
            ValueError: Its deadline is NaN (it would sort nowhere, and spoil the
                order of every request queued after it); or the request is held
                already (each request is pushed once).
        """
        deadline = request.deadline
        if deadline == math.inf:
            if request in self._open:
                already_held("deadline", request)
            self._open[request] = None
            return
        if deadline.__class__ is not float or deadline != deadline:
            _check_deadline(deadline)
        if self._refuse_late and self._context is not None:
            try:
                self._check_in_time(request)
            except DeadlineExceeded:
                if self._queue.holds(deadline, request):
                    already_held("deadline", request)  # the caller's bug comes first
                raise
        if not self._queue.add(deadline, request):
            already_held("deadline", request)

    def peek(self) -> Request:
        """Return the request with the earliest deadline; ``IndexError`` if empty."""
        if self._queue:
            return self._queue.first()
        try:
            return next(iter(self._open))
        except StopIteration:
            raise IndexError("peek into an empty DeadlineScheduler") from None

    def pop(self) -> Request:
        """Remove and return the request with the earliest deadline; ``IndexError`` if empty."""
        if self._queue:
            request = self._queue.pop_first()
        else:
            try:
                request = self._open.popitem(last=False)[0]
            except KeyError:
                raise IndexError("pop from an empty DeadlineScheduler") from None
        return request

    def remove(self, request: Request) -> bool:
        """Remove *request* if held (its caller gave up); return whether it was."""
        if request.deadline == math.inf:
            return self._open.pop(request, False) is None
        return self._queue.remove(request.deadline, request)

    def __len__(self) -> int:
        return len(self._queue) + len(self._open)

    def _check_in_time(self, request: Request) -> None:
        context = self._context
        assert context is not None
        per_execution = context.execution_estimate()
        if not per_execution > 0:
            return  # no estimate yet: admit
        now = context.current_time()
        instances = max(context.instances, 1)
        slack = request.deadline - now
        # Every waiting request with a deadline is an upper bound on those ahead:
        # when even that fits, admit without counting (the common case).
        if (len(self._queue) // instances + 1) * per_execution <= slack:
            return
        ahead = self._queue.count_until(request.deadline)
        finish = (ahead // instances + 1) * per_execution
        if finish <= slack:
            return
        raise DeadlineExceeded(
            f"request {request.id!r} for model {context.model!r} was refused at admission: "
            f"its deadline is {slack:.3f}s away, but it would finish in about {finish:.3f}s "
            f"({ahead} waiting request(s) with an earlier or equal deadline run first on "
            f"{instances} instance(s), then its own execution, at about {per_execution:.4f}s "
            f"per execution); nothing was computed"
        )


def _check_deadline(deadline: object) -> None:
    # A deadline that is not a plain float, or is NaN: a real number, or TypeError/ValueError.
    if isinstance(deadline, bool) or not isinstance(deadline, Real):
        raise TypeError(
            f"deadline scheduler: a request's deadline must be a time in seconds (or inf), "
            f"got {deadline!r} ({type(deadline).__name__})"
        )
    if math.isnan(deadline):
        raise ValueError(
            "deadline scheduler: a request's deadline must be a time in seconds (or inf), got NaN"
        )
