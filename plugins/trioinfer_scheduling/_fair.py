"""The ``fair`` scheduler: weighted fair sharing of rows across tenants."""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Mapping
from numbers import Real
from typing import final

from trioinfer import ConfigError
from trioinfer.lowlevel import Request

from ._options import already_held, positive_number

# (virtual time tag, number, tenant): numbers are unique, so tenants are never compared.
_Tag = tuple[float, int, str | None]


@final
class FairScheduler:
    """Weighted fair sharing across tenants, so one tenant's flood cannot starve another.

    Each tenant (the request's [`Request.tenant`][trioinfer.lowlevel.Request]; requests
    without one form the tenant ``None``) has its own first-come-first-served
    queue. Which tenant goes next is decided by weighted fair queuing on a
    virtual clock, counting rows, not requests (start-time fair queuing):

    - Serving a request of *rows* rows moves its tenant's virtual time on by
      ``rows / weight``; the tenant whose next request has the smallest virtual
      start time goes next (on a tie, the tenant that has waited longer).
    - The scheduler's virtual clock advances with the rows it serves, shared
      among the tenants waiting (so that a stream of new tenants cannot hold it
      back), but never past the start time of a waiting tenant.
    - A tenant that was idle starts at the virtual clock: it is not owed for
      the time it sent nothing, and it does not queue behind the backlog of a
      tenant that keeps sending. A tenant that has just had a large share starts
      where that share ended.

    While tenants are all backlogged, each one's share of the rows served is
    its weight's share of the total, to within one request's rows per tenant
    at any moment: with weights ``{"a": 3}`` and the default 1, tenant
    ``"a"`` gets 3 rows for every row of any other. A tenant with a trickle of
    traffic waits about one execution however deep another tenant's backlog is.
    Within a tenant, requests run in the order they came; priorities and
    deadlines are not looked at.

    Push, pop and remove cost O(log T) for T tenants waiting (O(1) within a
    tenant); what is kept for a tenant that went idle is dropped as soon as it
    no longer matters, and everything is forgotten when the queue empties.

    Args:
        weights: Weight per tenant name; a larger weight gets a larger share.
        default_weight: The weight of tenants not in *weights*, and of the tenant ``None``.

    Raises:
        ConfigError: A weight that is not a number greater than 0, a tenant name
            that is not a string, or *weights* that is not a mapping.
    """

    __slots__ = (
        "_active_weight",
        "_count",
        "_default",
        "_heap",
        "_idle",
        "_idle_heap",
        "_numbers",
        "_queues",
        "_tags",
        "_virtual_time",
        "_weights",
    )

    def __init__(
        self, *, weights: Mapping[str, float] | None = None, default_weight: float = 1.0
    ) -> None:
        if weights is None:
            weights = {}
        if not isinstance(weights, Mapping):
            raise ConfigError(
                f"fair scheduler: weights must be a table of tenant = weight, got {weights!r}"
            )
        checked: dict[str, float] = {}
        for tenant, weight in weights.items():
            if not isinstance(tenant, str):
                raise ConfigError(
                    f"fair scheduler: weights are keyed by tenant name (a string), got {tenant!r}"
                )
            checked[tenant] = positive_number("fair", f"the weight of tenant {tenant!r}", weight)
        self._weights = checked
        self._default = positive_number("fair", "default_weight", default_weight)
        # Each waiting tenant's requests, in admission order.
        self._queues: dict[str | None, OrderedDict[Request, None]] = {}
        # Each waiting tenant's live tag: the virtual start time of its next request.
        self._tags: dict[str | None, _Tag] = {}
        self._heap: list[_Tag] = []  # live tags, and dead ones dropped lazily
        self._active_weight = 0.0  # the sum of the waiting tenants' weights
        # Tenants gone idle whose virtual finish time is still ahead of the clock.
        self._idle: dict[str | None, _Tag] = {}
        self._idle_heap: list[_Tag] = []
        self._virtual_time = 0.0
        self._numbers = itertools.count()
        self._count = 0

    @property
    def weights(self) -> Mapping[str, float]:
        """The configured weight per tenant."""
        return dict(self._weights)

    @property
    def default_weight(self) -> float:
        """The weight of every other tenant."""
        return self._default

    def weight(self, tenant: str | None) -> float:
        """The weight *tenant* is served with."""
        if tenant is None:
            return self._default
        return self._weights.get(tenant, self._default)

    def push(self, request: Request) -> None:
        """Add *request* at the back of its tenant's queue.

        All or nothing: what it raises, it raises before it changed anything, so
        the requests already held still come out exactly once, in order.

        Raises:
            TypeError: The request's tenant is not hashable, or its rows not a number.
            ValueError: Its rows are negative or NaN (they move its tenant's
                virtual time, which must never go back); or the request is held
                already (each request is pushed once).
        """
        tenant = request.tenant
        rows = request.rows
        # pop() divides the rows by the weight once the request is out of its queue:
        # rows that cannot be must be refused here, not there.
        if rows.__class__ is not int or rows < 0:
            _check_rows(rows)
        queue = self._queues.get(tenant)
        if queue is None:
            # The tenant starts now, or where its last request finished if that is
            # later. Everything that can fail is read first; then the stores.
            weight = self.weight(tenant)
            start = self._virtual_time
            idle = self._idle.get(tenant)
            if idle is not None and idle[0] > start:
                start = idle[0]
            tag = (start, next(self._numbers), tenant)
            heapq.heappush(self._heap, tag)  # a tag no tenant owns yet is dropped lazily
            self._idle.pop(tenant, None)
            self._tags[tenant] = tag
            self._active_weight += weight
            queue = self._queues[tenant] = OrderedDict()
        elif request in queue:
            # Held already: a second entry would count it twice (len() never 0 again).
            already_held("fair", request)
        queue[request] = None
        self._count += 1

    def peek(self) -> Request:
        """Return the request `pop()` would take; ``IndexError`` if empty."""
        tenant = self._next_tag()[2]
        return next(iter(self._queues[tenant]))

    def pop(self) -> Request:
        """Remove and return the next request; ``IndexError`` if empty."""
        start, _, tenant = self._next_tag()
        queue = self._queues[tenant]
        request = queue.popitem(last=False)[0]
        self._count -= 1
        weight = self.weight(tenant)
        finish = start + request.rows / weight
        clock = max(start, self._virtual_time + request.rows / self._active_weight)
        if queue:
            tag = (finish, next(self._numbers), tenant)
            self._tags[tenant] = tag
            heapq.heapreplace(self._heap, tag)
        else:
            heapq.heappop(self._heap)
            self._forget(tenant)
            if not self._count:
                return request
        self._virtual_time = min(clock, self._next_tag()[0])
        if not queue:
            self._go_idle(tenant, finish)
        heap, idle = self._idle_heap, self._idle
        while heap and heap[0][0] <= self._virtual_time:
            tag = heapq.heappop(heap)
            if idle.get(tag[2]) is tag:
                del idle[tag[2]]  # it would start at the clock anyway
        return request

    def remove(self, request: Request) -> bool:
        """Remove *request* if held (its caller gave up); return whether it was."""
        tenant = request.tenant
        queue = self._queues.get(tenant)
        if queue is None or request not in queue:
            return False
        del queue[request]
        self._count -= 1
        if not queue:
            # Not served: the tenant keeps the start time its request had.
            start = self._tags[tenant][0]
            self._forget(tenant)
            if self._count:
                self._go_idle(tenant, start)
            if len(self._heap) > 32 + 2 * len(self._tags):
                self._heap = [tag for tag in self._heap if self._tags.get(tag[2]) is tag]
                heapq.heapify(self._heap)
        return True

    def __len__(self) -> int:
        return self._count

    def _next_tag(self) -> _Tag:
        heap, tags = self._heap, self._tags
        while heap:
            tag = heap[0]
            if tags.get(tag[2]) is tag:
                return tag
            heapq.heappop(heap)  # its tenant went idle by removal since
        raise IndexError("pop from an empty FairScheduler")

    def _forget(self, tenant: str | None) -> None:
        del self._queues[tenant]
        del self._tags[tenant]
        if self._count:
            self._active_weight -= self.weight(tenant)
        else:
            # Nothing waits: every tenant starts afresh.
            self._active_weight = 0.0
            self._virtual_time = 0.0
            self._idle.clear()
            self._idle_heap.clear()
            self._heap.clear()

    def _go_idle(self, tenant: str | None, finish: float) -> None:
        if finish > self._virtual_time:
            tag = (finish, next(self._numbers), tenant)
            self._idle[tenant] = tag
            heapq.heappush(self._idle_heap, tag)
            if len(self._idle_heap) > 32 + 2 * len(self._idle):
                self._idle_heap = [t for t in self._idle_heap if self._idle.get(t[2]) is t]
                heapq.heapify(self._idle_heap)


def _check_rows(rows: object) -> None:
    # Rows that are not a plain int, or negative: a number of at least 0, or TypeError/ValueError.
    if isinstance(rows, bool) or not isinstance(rows, Real):
        raise TypeError(
            f"fair scheduler: a request's rows must be a number, got {rows!r} "
            f"({type(rows).__name__})"
        )
    if not float(rows) >= 0:  # NaN is not
        raise ValueError(f"fair scheduler: a request's rows must be 0 or more, got {rows!r}")
