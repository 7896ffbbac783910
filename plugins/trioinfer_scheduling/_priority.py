"""The ``priority`` scheduler: integer levels, FIFO within a level, with aging."""

from __future__ import annotations

import math
import operator
from collections import OrderedDict
from collections.abc import Callable
from numbers import Real
from typing import SupportsIndex, final

from trioinfer.lowlevel import Request, SchedulerContext, check_seconds

from ._options import already_held, event_loop_clock
from ._sorted import SortedKeys


@final
class PriorityScheduler:
    """Higher priority first, first come first served within a level, and no starvation.

    A request's level is its [`Request.priority`][trioinfer.lowlevel.Request] (any
    integer; higher runs sooner; ``engine.infer(..., priority=...)``, 0 by default).
    Within a level requests run in the order they were admitted, exactly as
    under ``fifo``.

    Strict priority would let a steady stream of high-priority work starve
    everything below it forever. Aging bounds that: when the oldest request of
    any level below the highest waiting one has waited *max_wait* seconds, it
    goes next, ahead of the higher levels (the oldest such request first). A
    low-priority request therefore starts within about *max_wait* plus one
    execution of its arrival (plus the time to run older aged requests, and a
    highest-level request between each two of them), however
    busy the higher levels are; the higher levels keep everything the aged
    requests do not take. Aged requests take at most every other start while
    the highest level has requests waiting: after one, the highest level's
    next request goes, aged requests or not. So the lower levels cannot starve
    the highest one either: under sustained overload of the lower levels,
    where every request there ages, the two alternate (without this, aged
    requests took every start, and high-priority work waited for as long as
    the overload lasted).

    Push, pop and remove cost O(log L) for L distinct levels waiting (O(1)
    within a level); peek is O(log L). Time is read from the engine's clock
    (a `trio.testing.MockClock` in tests).

    Args:
        max_wait: Seconds after which a waiting lower-priority request goes ahead
            of higher levels. ``None`` (or ``inf``) turns aging off: strict
            priority, where lower levels run only when the higher ones are empty.

    Raises:
        ConfigError: *max_wait* is not a duration (`trioinfer.lowlevel.check_seconds`:
            a microsecond to about 584,542 years), ``inf`` nor ``None``.
    """

    __slots__ = (
        "_aged_last",
        "_clock",
        "_count",
        "_heads",
        "_levels",
        "_max_wait",
        "_order",
        "_peeked",
    )

    def __init__(self, *, max_wait: float | None = 1.0) -> None:
        limit = (
            math.inf
            if max_wait is None
            else check_seconds("priority scheduler: max_wait", max_wait, never=True)
        )
        self._max_wait = limit
        self._clock: Callable[[], float] = event_loop_clock()
        # level -> its requests in admission order
        self._levels: dict[int, OrderedDict[Request, None]] = {}
        self._order: SortedKeys[int] = SortedKeys()  # the levels that hold requests
        # (arrival, -level) of each level's oldest request; kept only when aging is on
        self._heads: SortedKeys[tuple[float, int]] | None = (
            SortedKeys() if limit != math.inf else None
        )
        self._count = 0
        # What peek() chose, so that pop() takes the same even if time moved on between.
        self._peeked: Request | None = None
        # Whether the last pop() took an aged request (one below the highest level): then
        # the next goes to the highest level, so that aged requests cannot starve it.
        self._aged_last = False

    @property
    def max_wait(self) -> float | None:
        """The aging bound in seconds; ``None`` if aging is off."""
        return None if self._max_wait == math.inf else self._max_wait

    def attach(self, context: SchedulerContext) -> None:
        """Read time from the engine's clock from now on (the engine calls this once)."""
        self._clock = context.current_time

    def push(self, request: Request) -> None:
        """Add *request* at the back of its priority level.

        All or nothing: what it raises, it raises before it changed anything, so
        the requests already held still come out exactly once, in order.

        Raises:
            TypeError: The request's priority is not an integer, or (with aging on)
                its arrival is not a real number.
            ValueError: With aging on, its arrival is NaN; or the request is held
                already (each request is pushed once).
        """
        level = request.priority
        if level.__class__ is not int:
            level = _checked_level(level)
        heads = self._heads
        if heads is not None:
            # Every request may become its level's head, and heads are compared by
            # arrival: refuse one that cannot be, now, not in a later pop.
            arrival = request.arrival
            if arrival.__class__ is not float or arrival != arrival:
                _check_arrival(arrival)
        queue = self._levels.get(level)
        if queue is None:
            # A new level goes into the sorted levels and the heads: if the second
            # add fails (MemoryError), the first is taken back.
            self._order.add(level)
            if heads is not None:
                try:
                    heads.add((request.arrival, -level))
                except BaseException:
                    self._order.remove(level)
                    raise
            queue = self._levels[level] = OrderedDict()
        elif request in queue:
            # Held already: a second entry would count it twice (len() never 0 again).
            already_held("priority", request)
        queue[request] = None
        self._count += 1
        self._peeked = None

    def peek(self) -> Request:
        """Return the request `pop()` would take; ``IndexError`` if empty."""
        if self._peeked is None:
            self._peeked = self._choose()
        return self._peeked

    def pop(self) -> Request:
        """Remove and return the next request; ``IndexError`` if empty."""
        request = self._peeked if self._peeked is not None else self._choose()
        self._peeked = None
        if self._heads is not None:
            # Taken from below the highest level: it was aged (only aging takes one there).
            self._aged_last = request.priority != self._order.last()
        self._take(request, head=True)
        return request

    def remove(self, request: Request) -> bool:
        """Remove *request* if held (its caller gave up); return whether it was."""
        queue = self._levels.get(request.priority)
        if queue is None or request not in queue:
            return False
        self._peeked = None
        self._take(request, head=next(iter(queue)) is request)
        return True

    def __len__(self) -> int:
        return self._count

    def _choose(self) -> Request:
        order = self._order
        if not order:
            raise IndexError("pop from an empty PriorityScheduler")
        level = order.last()
        heads = self._heads
        if heads is not None and len(order) > 1 and not self._aged_last:
            # The oldest head among the levels below the top one.
            arrival, negated = heads.first()
            if -negated == level:
                arrival, negated = heads.second()
            if self._clock() - arrival >= self._max_wait:
                level = -negated
        return next(iter(self._levels[level]))

    def _take(self, request: Request, *, head: bool) -> None:
        level = request.priority
        queue = self._levels[level]
        del queue[request]
        self._count -= 1
        if head and self._heads is not None:
            self._heads.remove((request.arrival, -level))
            if queue:
                self._heads.add((next(iter(queue)).arrival, -level))
        if not queue:
            del self._levels[level]
            self._order.remove(level)


def _checked_level(level: object) -> int:
    # A priority that is not a plain int: an integer all the same (numpy's, say), or
    # TypeError. bool is refused, as the engine refuses it: True is not a priority.
    if isinstance(level, bool) or not isinstance(level, SupportsIndex):
        raise TypeError(
            f"priority scheduler: a request's priority must be an integer, got {level!r} "
            f"({type(level).__name__})"
        )
    return operator.index(level)


def _check_arrival(arrival: object) -> None:
    # An arrival that is not a plain float, or is NaN: a real number, or TypeError/ValueError.
    if isinstance(arrival, bool) or not isinstance(arrival, Real):
        raise TypeError(
            f"priority scheduler: a request's arrival must be a time in seconds, got "
            f"{arrival!r} ({type(arrival).__name__})"
        )
    if math.isnan(arrival):
        raise ValueError("priority scheduler: a request's arrival must be a time, got NaN")
