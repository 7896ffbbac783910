"""The scheduler plugins: conformance, each discipline's ordering, and a reference model."""

from __future__ import annotations

import bisect
import gc
import math
import tracemalloc
from collections.abc import Callable
from operator import attrgetter
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import trioinfer
from trioinfer import ConfigError, DeadlineExceeded
from trioinfer.abc import Scheduler
from trioinfer.lowlevel import Request
from trioinfer.testing import check_scheduler, make_request
from trioinfer_scheduling import (
    DeadlineScheduler,
    FairScheduler,
    FifoScheduler,
    PriorityScheduler,
)
from trioinfer_scheduling._sorted import SortedKeys, TimeQueue

SETTINGS = settings(max_examples=150, deadline=None)


class FakeContext:
    """Stands in for trioinfer.lowlevel.SchedulerContext: a settable clock and estimate."""

    def __init__(self, *, now: float = 0.0, estimate: float = 0.0, instances: int = 1) -> None:
        self.model = "m"
        self.now = now
        self.estimate = estimate
        self.instances = instances

    def current_time(self) -> float:
        return self.now

    def execution_estimate(self) -> float:
        return self.estimate


def attached(scheduler: Any, context: FakeContext) -> Any:
    scheduler.attach(context)
    return scheduler


FACTORIES: dict[str, Callable[[], Scheduler]] = {
    "fifo": FifoScheduler,
    "priority": PriorityScheduler,
    "priority-strict": lambda: PriorityScheduler(max_wait=None),
    "priority-aging-clock": lambda: attached(PriorityScheduler(max_wait=5), FakeContext(now=30)),
    "deadline": DeadlineScheduler,
    "deadline-refuse-late": lambda: attached(
        DeadlineScheduler(refuse_late=True), FakeContext(estimate=0.001)
    ),
    "fair": FairScheduler,
    "fair-weighted": lambda: FairScheduler(weights={"a": 3, "b": 0.5}, default_weight=2),
}


@pytest.mark.parametrize("factory", FACTORIES.values(), ids=FACTORIES.keys())
def test_conformance(factory: Callable[[], Scheduler]) -> None:
    check_scheduler(factory)
    assert isinstance(factory(), Scheduler)


@pytest.mark.parametrize(
    ("name", "options", "cls"),
    [
        ("priority", {"max_wait": 0.25}, PriorityScheduler),
        ("deadline", {"refuse_late": True}, DeadlineScheduler),
        ("fair", {"weights": {"gold": 4}, "default_weight": 0.5}, FairScheduler),
    ],
)
def test_registered_under_their_names(name: str, options: dict[str, Any], cls: type) -> None:
    scheduler = trioinfer.Registry().create("schedulers", name, options)
    assert type(scheduler) is cls


def test_options_are_kept() -> None:
    assert PriorityScheduler().max_wait == 1.0
    assert PriorityScheduler(max_wait=None).max_wait is None
    assert PriorityScheduler(max_wait=math.inf).max_wait is None
    assert DeadlineScheduler(refuse_late=True).refuse_late is True
    fair = FairScheduler(weights={"a": 2}, default_weight=3)
    assert fair.weights == {"a": 2.0}
    assert fair.default_weight == 3.0
    assert (fair.weight("a"), fair.weight("b"), fair.weight(None)) == (2.0, 3.0, 3.0)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: PriorityScheduler(max_wait=0), "max_wait must be a number of seconds from"),
        (lambda: PriorityScheduler(max_wait=-1), "got -1"),
        (lambda: PriorityScheduler(max_wait="1s"), "got '1s'"),
        (lambda: PriorityScheduler(max_wait=math.nan), "got nan"),
        (lambda: PriorityScheduler(max_wait=True), "got True"),
        (lambda: DeadlineScheduler(refuse_late="yes"), "refuse_late must be true or false"),
        (lambda: FairScheduler(weights={"a": -1}), "weight of tenant 'a' must be a finite number"),
        (lambda: FairScheduler(weights={"a": 0}), "greater than 0, got 0"),
        (lambda: FairScheduler(weights={"a": "heavy"}), "got 'heavy'"),
        (lambda: FairScheduler(weights={1: 2}), "keyed by tenant name (a string), got 1"),
        (lambda: FairScheduler(weights=[("a", 1)]), "must be a table of tenant = weight"),
        (lambda: FairScheduler(default_weight=-0.5), "default_weight must be a finite number"),
        (lambda: FairScheduler(weights={"a": math.inf}), "must be a finite number greater"),
    ],
)
def test_invalid_options_are_config_errors(make: Callable[[], object], message: str) -> None:
    with pytest.raises(ConfigError, match="scheduler: ") as info:
        make()
    assert message in str(info.value)


# -- priority ------------------------------------------------------------------------


@given(st.lists(st.integers(-3, 3), max_size=60))
@SETTINGS
def test_strict_priority_is_non_increasing_and_fifo_within_a_level(levels: list[int]) -> None:
    scheduler = PriorityScheduler(max_wait=None)
    pushed = [make_request(priority=level) for level in levels]
    for request in pushed:
        scheduler.push(request)
    popped = [scheduler.pop() for _ in pushed]
    assert popped == sorted(pushed, key=lambda r: -r.priority)  # sorted() is stable: FIFO


def test_aging_lets_the_oldest_lower_request_go_next() -> None:
    clock = FakeContext(now=0.0)
    scheduler = attached(PriorityScheduler(max_wait=2.0), clock)
    low = make_request(priority=0, arrival=0.0)
    mid = make_request(priority=1, arrival=0.5)
    scheduler.push(low)
    scheduler.push(mid)
    highs = [make_request(priority=9, arrival=0.0) for _ in range(3)]
    for high in highs:
        scheduler.push(high)
    clock.now = 1.99
    assert scheduler.pop() is highs[0]  # nobody has waited 2 s yet
    clock.now = 2.0
    assert scheduler.pop() is low  # the oldest lower request, at exactly max_wait
    assert scheduler.pop() is highs[1]  # mid has waited 1.5 s
    clock.now = 2.5
    assert scheduler.pop() is mid
    assert scheduler.pop() is highs[2]
    assert len(scheduler) == 0


def test_aged_requests_do_not_wait_for_older_high_priority_ones() -> None:
    # The top level is never "aged": a flood queued before a low request cannot delay it.
    clock = FakeContext(now=0.0)
    scheduler = attached(PriorityScheduler(max_wait=1.0), clock)
    flood = [make_request(priority=5, arrival=0.0) for _ in range(100)]
    for request in flood:
        scheduler.push(request)
    low = make_request(priority=0, arrival=0.0)
    scheduler.push(low)
    clock.now = 1.0
    assert scheduler.peek() is low
    assert scheduler.pop() is low


def test_aged_requests_take_every_other_start_while_the_top_level_waits() -> None:
    # Lower levels under sustained overload: every request there has aged. The top
    # level is not starved by them; it and the aged requests alternate.
    clock = FakeContext(now=0.0)
    scheduler = attached(PriorityScheduler(max_wait=1.0), clock)
    lows = [make_request(priority=0, arrival=0.0) for _ in range(10)]
    mids = [make_request(priority=1, arrival=0.1) for _ in range(3)]
    for request in [*lows, *mids]:
        scheduler.push(request)
    clock.now = 5.0
    highs = [make_request(priority=2, arrival=5.0) for _ in range(3)]
    for request in highs:
        scheduler.push(request)
    order = [scheduler.pop() for _ in range(6)]
    assert order == [lows[0], highs[0], lows[1], highs[1], lows[2], highs[2]]
    # With the top level empty, the next one is the top: aged requests alternate with it.
    order = [scheduler.pop() for _ in range(7)]
    assert order == [lows[3], mids[0], lows[4], mids[1], lows[5], mids[2], lows[6]]


@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("push"), st.integers(0, 3), st.sampled_from([0.0, 0.5, 2.0])),
            st.tuples(st.just("pop"), st.just(0), st.sampled_from([0.0, 0.25, 1.0])),
        ),
        max_size=150,
    )
)
@SETTINGS
def test_aging_never_passes_over_the_top_level_twice_running_nor_an_older_aged_head(
    ops: list[tuple[str, int, float]],
) -> None:
    # Stated for any arrivals and any pace: (1) while the top level waits, two starts
    # in a row never both go below it; (2) one that goes below it is aged, and no
    # other level below the top has an older head (the oldest aged request goes).
    clock = FakeContext(now=0.0)
    scheduler = attached(PriorityScheduler(max_wait=1.0), clock)
    held: list[Request] = []
    below_last = False
    for name, a, b in ops:
        if name == "push":
            request = make_request(priority=a, arrival=clock.now - b)
            scheduler.push(request)
            held.append(request)
            continue
        clock.now += b
        if not held:
            continue
        top = max(r.priority for r in held)
        heads = {}
        for r in held:
            heads.setdefault(r.priority, r)
        request = scheduler.pop()
        held.remove(request)
        below = request.priority != top
        if below:
            assert not below_last
            assert clock.now - request.arrival >= 1.0
            assert request is heads[request.priority]
            assert all(h.arrival >= request.arrival for lvl, h in heads.items() if lvl != top)
        below_last = below


def test_pop_takes_what_peek_showed_even_if_time_moved_on() -> None:
    clock = FakeContext(now=0.0)
    scheduler = attached(PriorityScheduler(max_wait=1.0), clock)
    low, high = make_request(priority=0, arrival=0.0), make_request(priority=1, arrival=0.0)
    scheduler.push(low)
    scheduler.push(high)
    assert scheduler.peek() is high
    clock.now = 5.0
    assert scheduler.pop() is high
    scheduler.push(high)
    assert scheduler.peek() is low  # a push forgets what peek chose: low has aged


def test_priority_without_an_event_loop_or_engine_does_not_age() -> None:
    scheduler = PriorityScheduler(max_wait=0.001)
    low, high = make_request(priority=0, arrival=-1e9), make_request(priority=1)
    scheduler.push(low)
    scheduler.push(high)
    assert scheduler.pop() is high


async def test_priority_reads_the_event_loop_clock_before_it_is_attached(
    autojump_clock: object,
) -> None:
    import trio

    scheduler = PriorityScheduler(max_wait=1.0)
    low = make_request(priority=0, arrival=trio.current_time())
    high = make_request(priority=1, arrival=trio.current_time())
    scheduler.push(low)
    scheduler.push(high)
    assert scheduler.peek() is high
    await trio.sleep(1.0)
    scheduler.push(make_request(priority=1, arrival=trio.current_time()))
    assert scheduler.pop() is low


# -- deadline ------------------------------------------------------------------------

deadlines = st.one_of(st.just(math.inf), st.sampled_from([1.0, 2.0, 3.0]), st.floats(0, 100))


@given(st.lists(deadlines, max_size=60))
@SETTINGS
def test_edf_is_non_decreasing_fifo_on_ties_and_no_deadline_last(ds: list[float]) -> None:
    scheduler = DeadlineScheduler()
    pushed = [make_request(deadline=d) for d in ds]
    for request in pushed:
        scheduler.push(request)
    popped = [scheduler.pop() for _ in pushed]
    assert popped == sorted(pushed, key=lambda r: r.deadline)  # stable: ties keep their order


def test_refuse_late_counts_requests_ahead_per_instance() -> None:
    context = FakeContext(now=10.0, estimate=1.0, instances=2)
    scheduler = attached(DeadlineScheduler(refuse_late=True), context)
    # now=10, 1 s per execution, 2 instances: finish = 10 + (ahead // 2 + 1) * 1.
    for deadline in (12.0, 12.0, 13.0, 20.0, 20.0):  # finish 11, 11, 12, 12, 13: all fit
        scheduler.push(make_request(deadline=deadline))
    scheduler.push(make_request(deadline=math.inf))  # no deadline: never refused, never ahead
    scheduler.push(make_request(deadline=12.5))  # 2 ahead (12.0, 12.0): finishes at 12
    scheduler.push(make_request(deadline=12.9))  # 3 ahead: finishes at 12
    scheduler.push(make_request(deadline=11.5))  # nothing ahead: finishes at 11
    hopeless = make_request(deadline=10.5)
    with pytest.raises(DeadlineExceeded) as info:
        scheduler.push(hopeless)
    message = str(info.value)
    assert "refused at admission" in message
    assert "deadline is 0.500s away" in message
    assert "finish in about 1.000s" in message
    assert len(scheduler) == 9
    assert not scheduler.remove(hopeless)
    # Deadline 13.0, 6 ahead (12.0, 12.0, 12.5, 12.9, 11.5, 13.0): finishes at 14.
    with pytest.raises(DeadlineExceeded, match="6 waiting request"):
        scheduler.push(make_request(deadline=13.0))


def test_refuse_late_admits_everything_before_the_first_estimate() -> None:
    context = FakeContext(now=10.0, estimate=0.0)
    scheduler = attached(DeadlineScheduler(refuse_late=True), context)
    scheduler.push(make_request(deadline=10.000001))
    context.estimate = 0.5
    with pytest.raises(DeadlineExceeded):
        scheduler.push(make_request(deadline=10.1))


def test_refuse_late_reports_a_second_push_of_a_held_request_as_such() -> None:
    # Pushing a held request again is the caller's bug (each request is pushed once):
    # it must be told so, not that the request would be late, whatever the estimate.
    context = FakeContext(now=10.0, estimate=0.0)
    scheduler = attached(DeadlineScheduler(refuse_late=True), context)
    held = make_request(deadline=10.5)
    scheduler.push(held)
    context.estimate = 1.0  # now nothing with a deadline 0.5 s away fits
    with pytest.raises(ValueError, match="is already queued"):
        scheduler.push(held)
    with pytest.raises(DeadlineExceeded):
        scheduler.push(make_request(deadline=10.5))  # a new one is late, as before
    assert len(scheduler) == 1
    assert scheduler.pop() is held


def test_refuse_late_is_off_without_an_engine() -> None:
    scheduler = DeadlineScheduler(refuse_late=True)
    scheduler.push(make_request(deadline=-5.0))
    assert len(scheduler) == 1


# -- fair ----------------------------------------------------------------------------

weights = st.sampled_from([0.5, 1.0, 2.0, 3.0, 10.0])


@given(
    weights,
    weights,
    st.lists(st.integers(1, 8), min_size=1, max_size=80),
    st.lists(st.integers(1, 8), min_size=1, max_size=80),
)
@SETTINGS
def test_fair_shares_follow_weights_while_both_are_backlogged(
    wa: float, wb: float, rows_a: list[int], rows_b: list[int]
) -> None:
    scheduler = FairScheduler(weights={"a": wa, "b": wb})
    # Tenant a's whole flood is queued before b's first request.
    for rows in rows_a:
        scheduler.push(make_request(tenant="a", rows=rows))
    for rows in rows_b:
        scheduler.push(make_request(tenant="b", rows=rows))
    served = {"a": 0, "b": 0}
    left = {"a": len(rows_a), "b": len(rows_b)}
    bound = max(rows_a) / wa + max(rows_b) / wb
    while left["a"] and left["b"]:
        request = scheduler.pop()
        assert request.tenant is not None
        served[request.tenant] += request.rows
        left[request.tenant] -= 1
        # Normalised service never drifts apart by more than one request of each.
        assert abs(served["a"] / wa - served["b"] / wb) <= bound + 1e-9


@given(st.data())
@settings(max_examples=60, deadline=None)
def test_fair_shares_hold_from_when_each_tenant_joins(data: st.DataObject) -> None:
    # Tenants join at any moment with a backlog that outlasts the run: over the time
    # any two have both been waiting, their rows served (over their weights) differ
    # by at most one request of each. A late tenant is not owed the time before it
    # came, and does not queue behind the others' backlog.
    tenants = [f"t{i}" for i in range(data.draw(st.integers(2, 4)))]
    weights = {t: data.draw(st.sampled_from([0.5, 1.0, 2.0, 3.0])) for t in tenants}
    joins = {t: 0 if i == 0 else data.draw(st.integers(0, 30)) for i, t in enumerate(tenants)}
    scheduler = FairScheduler(weights=weights)
    served = dict.fromkeys(tenants, 0)
    snapshots: list[dict[str, int]] = []  # served before each pop
    for step in range(80):
        for tenant in tenants:
            if joins[tenant] == step:
                pattern = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=8))
                for k in range(100):
                    scheduler.push(make_request(tenant=tenant, rows=pattern[k % len(pattern)]))
        snapshots.append(dict(served))
        request = scheduler.pop()
        assert request.tenant is not None
        served[request.tenant] += request.rows
    snapshots.append(dict(served))
    for a in tenants:
        for b in tenants:
            if a < b:
                base = snapshots[max(joins[a], joins[b])]
                for now in snapshots[max(joins[a], joins[b]) :]:
                    gap = (now[a] - base[a]) / weights[a] - (now[b] - base[b]) / weights[b]
                    assert abs(gap) <= 4 / weights[a] + 4 / weights[b] + 1e-9


def test_a_trickle_is_served_at_once_behind_a_flood() -> None:
    scheduler = FairScheduler()
    for _ in range(1000):
        scheduler.push(make_request(tenant="flood"))
    for _ in range(10):
        scheduler.pop()
    trickle = make_request(tenant="trickle")
    scheduler.push(trickle)
    # It ties with the flood's next request at most, and the flood's has waited longer.
    assert trickle in (scheduler.pop(), scheduler.pop())


def test_an_idle_tenant_banks_no_credit() -> None:
    scheduler = FairScheduler()
    busy = [make_request(tenant="busy") for _ in range(100)]
    for request in busy:
        scheduler.push(request)
    for _ in range(50):
        scheduler.pop()
    # "late" sent nothing while "busy" got 50 rows: it starts level, not 50 rows ahead.
    late = [make_request(tenant="late") for _ in range(10)]
    for request in late:
        scheduler.push(request)
    order = [scheduler.pop().tenant for _ in range(20)]
    assert order.count("late") == 10
    assert order.count("busy") == 10


def test_a_tenant_that_just_ran_big_requests_waits_its_turn() -> None:
    scheduler = FairScheduler()
    big = make_request(tenant="big", rows=100)
    scheduler.push(big)
    scheduler.push(make_request(tenant="other"))  # keeps the scheduler from going empty
    assert scheduler.pop() is big
    # big's next request starts where its 100 rows finished; other's 50 one-row ones go first.
    nxt = make_request(tenant="big")
    scheduler.push(nxt)
    for _ in range(49):
        scheduler.push(make_request(tenant="other"))
    assert [scheduler.pop().tenant for _ in range(50)] == ["other"] * 50
    assert scheduler.pop() is nxt


def test_fair_weights_none_tenant_by_default_weight() -> None:
    scheduler = FairScheduler(weights={"a": 1.0}, default_weight=3.0)
    for _ in range(40):
        scheduler.push(make_request(tenant="a"))
        scheduler.push(make_request(tenant=None))
    order = [scheduler.pop().tenant for _ in range(40)]
    assert order.count(None) == 30


# -- every scheduler against a reference model ---------------------------------------


class Reference:
    """Naive O(n) versions of each discipline: lists, scanned in full on every call."""

    def __init__(self, kind: str, context: FakeContext, **options: Any) -> None:
        self.kind = kind
        self.context = context
        self.options = options
        self.held: list[Request] = []  # in push order
        self.peeked: Request | None = None
        # fair: per-tenant (start tag, number) while waiting; finish tag once idle
        self.tags: dict[str | None, tuple[float, int]] = {}
        self.finish: dict[str | None, float] = {}
        self.vtime = 0.0
        self.numbers = 0
        self.aged_last = False  # priority: the last pop took an aged request

    def weight(self, tenant: str | None) -> float:
        weights = self.options.get("weights", {})
        default = self.options.get("default_weight", 1.0)
        return default if tenant is None else weights.get(tenant, default)

    def number(self) -> int:
        self.numbers += 1
        return self.numbers

    def push(self, request: Request) -> None:
        if (
            self.kind == "deadline"
            and self.options.get("refuse_late")
            and request.deadline != math.inf
            and self.context.estimate > 0
        ):
            ahead = sum(r.deadline <= request.deadline for r in self.held)
            rounds = ahead // self.context.instances + 1
            if rounds * self.context.estimate > request.deadline - self.context.now:
                raise DeadlineExceeded("late")
        if self.kind == "fair" and not any(r.tenant == request.tenant for r in self.held):
            start = max(self.vtime, self.finish.pop(request.tenant, -math.inf))
            self.tags[request.tenant] = (start, self.number())
        self.held.append(request)
        self.peeked = None

    def choose(self) -> Request:
        if not self.held:
            raise IndexError
        if self.kind == "fifo":
            return self.held[0]
        if self.kind == "deadline":
            # Equal deadlines in the order the requests were made (a request pushed
            # again keeps its place by age); no deadline: first come, first served.
            order = {id(r): i for i, r in enumerate(self.held)}
            return min(
                self.held,
                key=lambda r: (r.deadline, r.sequence if r.deadline < math.inf else order[id(r)]),
            )
        if self.kind == "fair":
            tenant = min(self.tags, key=lambda t: self.tags[t])
            return next(r for r in self.held if r.tenant == tenant)
        levels = sorted({r.priority for r in self.held})
        heads = {lvl: next(r for r in self.held if r.priority == lvl) for lvl in levels}
        max_wait = self.options.get("max_wait", 1.0)
        # After an aged request, the top level's turn (aged requests or not).
        if max_wait is not None and len(levels) > 1 and not self.aged_last:
            oldest = min(levels[:-1], key=lambda lvl: (heads[lvl].arrival, -lvl))
            if self.context.now - heads[oldest].arrival >= max_wait:
                return heads[oldest]
        return heads[levels[-1]]

    def peek(self) -> Request:
        if self.peeked is None:
            self.peeked = self.choose()
        return self.peeked

    def pop(self) -> Request:
        request = self.peeked if self.peeked is not None else self.choose()
        self.peeked = None
        if self.kind == "priority" and self.options.get("max_wait", 1.0) is not None:
            self.aged_last = request.priority != max(r.priority for r in self.held)
        self.held.remove(request)
        if self.kind == "fair":
            tenant = request.tenant
            start = self.tags[tenant][0]
            finish = start + request.rows / self.weight(tenant)
            active = sum(self.weight(t) for t in self.tags)
            clock = max(start, self.vtime + request.rows / active)
            if any(r.tenant == tenant for r in self.held):
                self.tags[tenant] = (finish, self.number())
            else:
                del self.tags[tenant]
                self.finish[tenant] = finish
            if self.held:
                self.vtime = min(clock, min(self.tags.values())[0])
            self.reset_if_empty()
        return request

    def remove(self, request: Request) -> bool:
        if request not in self.held:
            return False
        self.held.remove(request)
        self.peeked = None
        tenant = request.tenant
        if self.kind == "fair" and not any(r.tenant == tenant for r in self.held):
            self.finish[tenant] = self.tags.pop(tenant)[0]
            self.reset_if_empty()
        return True

    def reset_if_empty(self) -> None:
        if not self.held:
            self.vtime = 0.0
            self.finish.clear()


REFERENCE_SETUPS: dict[str, tuple[str, Callable[[], Any], dict[str, Any]]] = {
    "fifo": ("fifo", FifoScheduler, {}),
    "priority": ("priority", lambda: PriorityScheduler(max_wait=2.0), {"max_wait": 2.0}),
    "priority-strict": ("priority", lambda: PriorityScheduler(max_wait=None), {"max_wait": None}),
    "deadline": ("deadline", DeadlineScheduler, {}),
    "deadline-refuse-late": (
        "deadline",
        lambda: DeadlineScheduler(refuse_late=True),
        {"refuse_late": True},
    ),
    "fair": (
        "fair",
        lambda: FairScheduler(weights={"a": 2.0, "b": 0.5}),
        {"weights": {"a": 2.0, "b": 0.5}},
    ),
}

operations = st.lists(
    st.one_of(
        st.tuples(
            st.just("push"),
            st.integers(0, 3),  # priority
            st.sampled_from(["a", "b", "c", None]),  # tenant
            st.one_of(
                st.just(math.inf), st.sampled_from([1.0, 2.0, 4.0, 8.0])
            ),  # deadline after now
            st.integers(1, 4),  # rows
            st.sampled_from([0.0, 0.0, 1.0, 3.0]),  # how long ago it arrived
        ),
        st.tuples(st.just("remove"), st.integers(0, 200)),
        st.tuples(st.just("push_again"), st.integers(0, 200)),
        st.tuples(st.just("pop")),
        st.tuples(st.just("peek")),
        st.tuples(st.just("advance"), st.sampled_from([0.5, 1.0, 2.5])),
        st.tuples(st.just("estimate"), st.sampled_from([0.0, 0.5, 2.0])),
    ),
    max_size=120,
)


@pytest.mark.parametrize("setup", REFERENCE_SETUPS.values(), ids=REFERENCE_SETUPS.keys())
@given(ops=operations, instances=st.integers(1, 3))
@example(
    # Two aged requests below a waiting top level: the top level's turn comes between them.
    ops=[("push", 0, "a", math.inf, 1, 3.0)] * 2
    + [("push", 1, "b", math.inf, 1, 0.0)]
    + [("pop",)] * 3,
    instances=1,
)
@settings(max_examples=60, deadline=None)
def test_matches_reference_model(
    setup: tuple[str, Callable[[], Any], dict[str, Any]], ops: list[Any], instances: int
) -> None:
    run_against_reference(setup, ops, instances)


def test_fair_tenants_that_return_and_cancel_match_the_reference() -> None:
    # Tenants served a big request come back (starting far ahead of the clock) and
    # cancel, over and over, behind a slow tenant's backlog: dead entries deep in the
    # heaps, and idle tenants outlived by the clock.
    ops: list[Any] = [("push", 0, "b", math.inf, 1, 0.0)] * 10
    for i in range(300):
        tenant = f"x{i % 40}"
        ops += [("push", 0, "b", math.inf, 1, 0.0)] * 2
        ops += [("push", 0, tenant, math.inf, 200, 0.0), ("pop",), ("pop",)]
        ops += [("push", 0, tenant, math.inf, 1, 0.0), ("remove", -1)]
    run_against_reference(REFERENCE_SETUPS["fair"], ops, 1)


def run_against_reference(
    setup: tuple[str, Callable[[], Any], dict[str, Any]], ops: list[Any], instances: int
) -> None:
    kind, factory, options = setup
    context = FakeContext(now=100.0, instances=instances)
    scheduler = factory()
    if hasattr(scheduler, "attach"):
        scheduler.attach(context)
    reference = Reference(kind, context, **options)
    pushed: list[Request] = []
    popped: list[Request] = []
    for op in ops:
        name = op[0]
        if name in ("push", "push_again"):
            if name == "push":
                _, priority, tenant, deadline, rows, age = op
                request = make_request(
                    priority=priority,
                    tenant=tenant,
                    deadline=context.now + deadline,
                    rows=rows,
                    arrival=context.now - age,
                )
            elif popped:
                # Served and then sent again as a new admission (the engine keeps
                # requests a batcher gives back away from the scheduler).
                request = popped.pop(op[1] % len(popped))
            else:
                continue
            refused = None
            try:
                reference.push(request)
            except DeadlineExceeded:
                refused = pytest.raises(DeadlineExceeded)
            if refused is None:
                scheduler.push(request)
                pushed.append(request)
            else:
                with refused:
                    scheduler.push(request)
        elif name == "remove" and pushed:
            request = pushed[op[1] % len(pushed)]
            assert scheduler.remove(request) == reference.remove(request)
        elif name in ("pop", "peek"):
            if reference.held:
                got = getattr(scheduler, name)()
                assert got is getattr(reference, name)()
                if name == "pop":
                    popped.append(got)
            else:
                with pytest.raises(IndexError):
                    getattr(scheduler, name)()
        elif name == "advance":
            context.now += op[1]
        elif name == "estimate":
            context.estimate = op[1]
        assert len(scheduler) == len(reference.held)
    while reference.held:
        assert scheduler.pop() is reference.pop()
    assert len(scheduler) == 0


@pytest.mark.parametrize("factory", FACTORIES.values(), ids=FACTORIES.keys())
def test_churn_leaves_nothing_behind(factory: Callable[[], Scheduler]) -> None:
    # Cancellation and one-off tenants or levels, under a standing backlog, for a long
    # time: lazily deleted entries and idle tenants' state must not pile up.
    scheduler = factory()
    backlog = [make_request(tenant="steady", priority=0, deadline=50.0) for _ in range(100)]
    for request in backlog:
        scheduler.push(request)

    def churn(n: int) -> None:
        for i in range(n):
            key = f"t{i}"
            cancelled = make_request(tenant=key, priority=i, deadline=1.0 + i % 100, rows=3)
            scheduler.push(cancelled)
            assert scheduler.remove(cancelled)
            served = make_request(tenant=key, priority=-i, deadline=99.0, rows=2)
            scheduler.push(served)
            scheduler.push(scheduler.pop())  # served, then sent again
            assert scheduler.remove(served) or scheduler.remove(scheduler.peek())

    churn(300)  # warm up: allocator pools, lazily built structures
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        churn(2000)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 64 * 1024, f"{grown} bytes kept after 2000 cancellations"
    assert 0 < len(scheduler) <= 100


# -- the sorted structure behind priority and deadline -------------------------------


@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("add"), st.integers(0, 60)),
            st.tuples(st.just("remove"), st.integers(0, 60)),
            st.tuples(st.just("pop_first")),
        ),
        max_size=200,
    ),
    st.sampled_from([1, 2, 3, 128]),
)
@example([("add", 1), ("remove", 61)], 2)
@SETTINGS
def test_sorted_keys_match_a_sorted_list(ops: list[Any], load: int) -> None:
    keys: SortedKeys[int] = SortedKeys(load=load)
    model: list[int] = []
    for op in ops:
        if op[0] == "add" and op[1] not in model:
            keys.add(op[1])
            bisect.insort(model, op[1])
        elif op[0] == "remove":
            if op[1] in model:
                keys.remove(op[1])
                model.remove(op[1])
            else:
                with pytest.raises(ValueError, match="is not held"):
                    keys.remove(op[1])
        elif op[0] == "pop_first" and model:
            assert keys.pop_first() == model.pop(0)
        assert len(keys) == len(model)
        assert list(keys) == model
        if model:
            assert (keys.first(), keys.last()) == (model[0], model[-1])
        if len(model) > 1:
            assert keys.second() == model[1]


class _Ticketed:
    """A queue item with the ticket `TimeQueue` orders equal keys by."""

    __slots__ = ("ticket",)

    def __init__(self, ticket: int) -> None:
        self.ticket = ticket


@given(
    st.lists(
        st.one_of(
            # A key (often shared) and a rank that puts the ticket out of add order.
            st.tuples(
                st.just("add"),
                st.sampled_from([1.0, 2.0, 2.5, 3.0]) | st.floats(0, 9),
                st.integers(0, 5),
            ),
            st.tuples(st.just("remove"), st.integers(0, 300)),
            st.tuples(st.just("add_again"), st.integers(0, 300)),
            st.tuples(st.just("remove_wrong_key"), st.integers(0, 300)),
            st.tuples(
                st.just("remove_stranger"),
                st.sampled_from([1.0, 2.0, 2.5, 3.0]),
                st.sampled_from([-1, 10**9]),  # before or after every held ticket
            ),
            st.tuples(st.just("pop_first")),
            st.tuples(st.just("count_until"), st.floats(-1, 10)),
        ),
        max_size=300,
    ),
    st.sampled_from([1, 2, 3, 128]),
)
# An item whose key ends a chunk but whose ticket comes before that chunk's last.
@example([("add", 2.0, 0), ("add", 2.0, 2), ("add", 3.0, 0), ("add", 2.0, 1)], 1)
# Several chunks end on one key: the item may be in any of them, or in none.
@example([("add", 2.0, 0), ("add", 2.0, 0), ("add", 2.0, 0), ("remove", 2)], 1)
@example([("add", 2.0, 0), ("add", 2.0, 0), ("remove_stranger", 2.0, 10**9)], 1)
@SETTINGS
def test_time_queue_matches_a_list_sorted_by_key_then_ticket(ops: list[Any], load: int) -> None:
    queue: TimeQueue[_Ticketed] = TimeQueue(attrgetter("ticket"), load=load)
    model: list[tuple[float, int, _Ticketed]] = []  # (key, ticket, item), sorted
    added = 0
    for op in ops:
        if op[0] == "add":
            # Unique tickets, in an order of their own: an item added later may go first.
            item = _Ticketed(op[2] * 1000 + added)
            added += 1
            assert queue.add(op[1], item)
            bisect.insort(model, (op[1], item.ticket, item), key=lambda e: e[:2])
        elif op[0] == "remove" and model:
            key, _, item = model.pop(op[1] % len(model))
            assert queue.remove(key, item)
            assert not queue.remove(key, item)  # no longer held
        elif op[0] == "add_again" and model:
            key, _, item = model[op[1] % len(model)]
            assert not queue.add(key, item)  # held already: refused, nothing changed
        elif op[0] == "remove_wrong_key" and model:
            key, _, item = model[op[1] % len(model)]
            assert not queue.remove(key + 0.25, item)  # held, but not with that key: kept
        elif op[0] == "remove_stranger":
            assert not queue.remove(op[1], _Ticketed(op[2]))
        elif op[0] == "pop_first" and model:
            assert queue.first() is model[0][2]
            assert queue.pop_first() is model.pop(0)[2]
        elif op[0] == "count_until":
            assert queue.count_until(op[1]) == sum(key <= op[1] for key, _, _ in model)
        assert len(queue) == len(model)
        assert list(queue) == [item for _, _, item in model]


@pytest.mark.parametrize("name", ["fifo", "priority", "deadline", "fair"])
@pytest.mark.parametrize("deadline", [math.inf, 5.0])
def test_a_second_push_of_a_queued_request_is_refused(name: str, deadline: float) -> None:
    # priority and fair counted it twice: len() stayed 1 after its one pop, and
    # peek() then raised IndexError with len() saying a request was held.
    scheduler = FACTORIES[name]()
    first = make_request(priority=1, tenant="t", deadline=deadline)
    twin = make_request(priority=1, tenant="t", deadline=deadline)  # alike, another request
    scheduler.push(first)
    scheduler.push(twin)
    for request in (first, twin):
        with pytest.raises(ValueError, match="already queued") as info:
            scheduler.push(request)
        assert str(info.value).startswith(
            f"{name} scheduler: request {request.id!r} is already queued; each request is "
            "pushed once"
        )
    assert len(scheduler) == 2
    assert {scheduler.pop(), scheduler.pop()} == {first, twin}
    assert len(scheduler) == 0
    # Once out, it may be pushed again (as a test might; the engine does not).
    scheduler.push(first)
    assert scheduler.pop() is first


def test_deadline_runs_equal_deadlines_in_the_order_requests_were_made() -> None:
    scheduler = DeadlineScheduler()
    first, second, third = (make_request(deadline=5.0) for _ in range(3))
    assert first.sequence < second.sequence < third.sequence
    for request in (third, first, second):  # pushed out of order
        scheduler.push(request)
    assert [scheduler.pop() for _ in range(3)] == [first, second, third]


def test_fair_forgets_everything_when_the_last_request_is_cancelled() -> None:
    scheduler = FairScheduler()
    big = make_request(tenant="a", rows=50)
    scheduler.push(big)
    scheduler.push(make_request(tenant="b"))
    assert scheduler.pop() is big
    scheduler.remove(scheduler.peek())
    assert len(scheduler) == 0
    # a's 50 rows are forgotten with the empty queue: a and b start level again.
    first, second = make_request(tenant="b"), make_request(tenant="a")
    scheduler.push(first)
    scheduler.push(second)
    assert [scheduler.pop(), scheduler.pop()] == [first, second]


# -- a push that fails leaves the scheduler as it was ---------------------------------
# The engine hands the caller of a push that raised a PluginContractError and keeps the
# model serving (trioinfer.abc.Scheduler), so whatever push raises, it must raise before
# it changed anything: every request held before, and every one pushed after, still
# comes out exactly once, in the scheduler's order.


def drained(scheduler: Scheduler) -> list[Request]:
    """Pop until empty, checking that len() counts down to 0 with it."""
    popped = []
    while len(scheduler):
        shown = scheduler.peek()
        request = scheduler.pop()
        assert request is shown
        popped.append(request)
    with pytest.raises(IndexError):
        scheduler.pop()
    with pytest.raises(IndexError):
        scheduler.peek()
    return popped


BAD_REQUESTS: dict[str, tuple[Callable[[], Scheduler], dict[str, Any]]] = {
    "priority-str": (PriorityScheduler, {"priority": "high"}),
    "priority-float": (PriorityScheduler, {"priority": 1.5}),
    "priority-strict-str": (lambda: PriorityScheduler(max_wait=None), {"priority": "high"}),
    "priority-arrival-nan": (PriorityScheduler, {"priority": 7, "arrival": math.nan}),
    "priority-arrival-str": (PriorityScheduler, {"priority": 7, "arrival": "now"}),
    "priority-arrival-str-old-level": (PriorityScheduler, {"priority": 1, "arrival": "now"}),
    "deadline-nan": (DeadlineScheduler, {"deadline": math.nan}),
    "deadline-str": (DeadlineScheduler, {"deadline": "soon"}),
    "fair-rows-str": (FairScheduler, {"tenant": "c", "rows": "2"}),
    "fair-rows-str-old-tenant": (FairScheduler, {"tenant": "a", "rows": "2"}),
    "fair-rows-negative": (FairScheduler, {"tenant": "c", "rows": -5}),
}


@pytest.mark.parametrize("first", [False, True], ids=["among-others", "into-empty"])
@pytest.mark.parametrize(("factory", "bad"), BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_a_refused_push_changes_nothing(
    factory: Callable[[], Scheduler], bad: dict[str, Any], first: bool
) -> None:
    def requests() -> list[Request]:
        return [
            make_request(priority=p, tenant=t, deadline=d)
            for p, t, d in [(1, "a", 3.0), (0, "b", 1.0), (2, "a", 2.0), (0, "b", math.inf)]
        ]

    # What the scheduler does with these requests when nothing goes wrong.
    control = factory()
    expected = requests()
    for request in expected:
        control.push(request)
    order = [expected.index(r) for r in drained(control)]

    scheduler = factory()
    pushed = requests()
    before, after = ([], pushed) if first else (pushed[:2], pushed[2:])
    for request in before:
        scheduler.push(request)
    with pytest.raises((TypeError, ValueError)):
        scheduler.push(make_request(**bad))
    assert len(scheduler) == len(before)
    for request in after:
        scheduler.push(request)
    assert drained(scheduler) == [pushed[i] for i in order]
    # And it goes on working once emptied.
    again = requests()
    for request in again:
        scheduler.push(request)
    assert drained(scheduler) == [again[i] for i in order]


def test_priority_push_that_fails_between_its_structures_changes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A new level goes into two sorted structures (levels, and heads for aging): the
    # second add failing (MemoryError, say) must take the first back.
    scheduler = PriorityScheduler()
    low, high = make_request(priority=0), make_request(priority=5)
    scheduler.push(low)
    real_add = SortedKeys.add
    calls = 0

    def add_once_then_fail(self: SortedKeys[Any], key: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise MemoryError
        real_add(self, key)

    monkeypatch.setattr(SortedKeys, "add", add_once_then_fail)
    with pytest.raises(MemoryError):
        scheduler.push(make_request(priority=3))
    monkeypatch.undo()
    assert calls == 2
    assert len(scheduler) == 1
    scheduler.push(high)
    assert drained(scheduler) == [high, low]


def test_fair_push_that_fails_midway_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    # A new tenant is written into its queue, its tag, the heap and the active weight:
    # a failure reading its weight must leave none of them changed.
    scheduler = FairScheduler(weights={"a": 2.0})
    first = make_request(tenant="a")
    scheduler.push(first)

    def broken_weight(self: FairScheduler, tenant: str | None) -> float:
        raise MemoryError

    monkeypatch.setattr(FairScheduler, "weight", broken_weight)
    with pytest.raises(MemoryError):
        scheduler.push(make_request(tenant="b"))
    monkeypatch.undo()
    assert len(scheduler) == 1
    later = [make_request(tenant="b"), make_request(tenant="a"), make_request(tenant="b")]
    for request in later:
        scheduler.push(request)
    assert sorted(map(id, drained(scheduler))) == sorted(map(id, [first, *later]))
