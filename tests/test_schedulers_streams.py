"""The schedulers under streams of pushes and pops on a mock clock, against their docs.

`test_schedulers.py` checks each rule on a queue filled up front; here requests
keep arriving while others are served, as under an engine: aging must bound a
low request's wait while a higher level never runs dry, and fair sharing must
hold while both tenants keep sending.
"""

from __future__ import annotations

import math
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from trioinfer.lowlevel import Request
from trioinfer.testing import make_request
from trioinfer_scheduling import DeadlineScheduler, FairScheduler, PriorityScheduler

SETTINGS = settings(max_examples=100, deadline=None)


class MockClock:
    """Stands in for trioinfer.lowlevel.SchedulerContext: a clock the test moves."""

    model = "m"
    instances = 1

    def __init__(self) -> None:
        self.now = 0.0

    def current_time(self) -> float:
        return self.now

    def execution_estimate(self) -> float:
        return 0.0


def _expected_next(
    waiting: list[Request], now: float, max_wait: float, aged_last: bool = False
) -> Request:
    # The documented rule, written the slow way: the highest level's oldest request,
    # unless the oldest request of a lower level has waited max_wait and the last
    # request taken was not such an aged one (aged ones take every other start at most).
    top = max(r.priority for r in waiting)
    lower = [r for r in waiting if r.priority < top]
    if lower and not aged_last:
        oldest = min(lower, key=lambda r: (r.arrival, -r.priority, r.sequence))
        if now - oldest.arrival >= max_wait:
            return oldest
    return min((r for r in waiting if r.priority == top), key=lambda r: r.sequence)


@given(
    max_wait=st.sampled_from([0.5, 1.0, 3.0]),
    steps=st.lists(
        st.tuples(
            st.lists(st.integers(0, 3), max_size=3),  # the levels pushed at this tick
            st.sampled_from([0.1, 0.25, 0.5]),  # how long the execution popped now takes
        ),
        min_size=1,
        max_size=80,
    ),
)
@SETTINGS
def test_aging_follows_the_documented_rule_while_requests_keep_arriving(
    max_wait: float, steps: list[tuple[list[int], float]]
) -> None:
    clock = MockClock()
    scheduler = PriorityScheduler(max_wait=max_wait)
    scheduler.attach(clock)  # type: ignore[arg-type]
    waiting: list[Request] = []
    aged_last = False
    for levels, execution in steps:
        for level in levels:
            request = make_request(priority=level, arrival=clock.now)
            scheduler.push(request)
            waiting.append(request)
        if waiting:
            expected = _expected_next(waiting, clock.now, max_wait, aged_last)
            assert scheduler.peek() is expected
            assert scheduler.pop() is expected
            aged_last = expected.priority != max(r.priority for r in waiting)
            waiting.remove(expected)
        clock.now += execution
    assert len(scheduler) == len(waiting)


@given(
    max_wait=st.sampled_from([0.5, 1.0, 2.0]),
    execution=st.sampled_from([0.01, 0.1, 0.3]),
    low_every=st.integers(1, 50),
)
@SETTINGS
def test_a_low_request_starts_within_max_wait_plus_one_execution_under_a_flood(
    max_wait: float, execution: float, low_every: int
) -> None:
    # The higher level never runs dry: two high requests arrive per execution.
    clock = MockClock()
    scheduler = PriorityScheduler(max_wait=max_wait)
    scheduler.attach(clock)  # type: ignore[arg-type]
    arrived: dict[Request, float] = {}
    waits: list[float] = []
    lows_in_flight = 0
    for tick in range(600):
        for _ in range(2):
            scheduler.push(make_request(priority=1, arrival=clock.now))
        # At most one low request waits at a time, so no older aged one goes first.
        if tick % low_every == 0 and not lows_in_flight:
            low = make_request(priority=0, arrival=clock.now)
            scheduler.push(low)
            arrived[low] = clock.now
            lows_in_flight += 1
        served = scheduler.pop()
        if served.priority == 0:
            waits.append(clock.now - arrived.pop(served))
            lows_in_flight -= 1
        clock.now += execution
    assert waits, "no low request was ever served under the flood"
    assert max(waits) <= max_wait + execution + 1e-9
    # Every low request still waiting has waited less than the bound.
    assert all(clock.now - t <= max_wait + execution + 1e-9 for t in arrived.values())


@given(
    weights=st.tuples(st.sampled_from([1, 2, 3]), st.sampled_from([1, 2, 5])),
    rows=st.tuples(st.integers(1, 4), st.integers(1, 4)),
    per_tick=st.tuples(st.integers(1, 4), st.integers(1, 4)),
)
@SETTINGS
def test_fair_shares_rows_by_weight_while_both_tenants_keep_sending(
    weights: tuple[int, int], rows: tuple[int, int], per_tick: tuple[int, int]
) -> None:
    # A heavy tenant sends more and bigger requests each tick than the scheduler
    # serves; the light one too. Each should get its weight's share of the rows.
    wh, wl = weights
    scheduler = FairScheduler(weights={"heavy": wh, "light": wl})
    served = {"heavy": 0, "light": 0}
    for _ in range(400):
        for _ in range(per_tick[0]):
            scheduler.push(make_request(tenant="heavy", rows=rows[0]))
        for _ in range(per_tick[1]):
            scheduler.push(make_request(tenant="light", rows=rows[1]))
        # One pop per tick, after each tenant pushed one or more: neither runs dry.
        request = scheduler.pop()
        assert request.tenant is not None
        served[request.tenant] += request.rows
    # Normalised service apart by at most one request's rows per tenant.
    gap = abs(served["heavy"] / wh - served["light"] / wl)
    assert gap <= rows[0] / wh + rows[1] / wl + 1e-9


def test_fair_keys_on_the_request_tenant_with_none_its_own_tenant() -> None:
    scheduler = FairScheduler(weights={"None": 100})  # the string, not the tenant None
    for _ in range(30):
        scheduler.push(make_request(tenant=None))
        scheduler.push(make_request(tenant="x"))
    order = [scheduler.pop().tenant for _ in range(30)]
    assert order.count(None) == 15
    assert order.count("x") == 15


@given(
    st.lists(
        st.tuples(st.one_of(st.just(math.inf), st.sampled_from([1.0, 2.0, 5.0])), st.booleans()),
        max_size=80,
    )
)
@SETTINGS
def test_remove_of_cancelled_requests_keeps_every_order(ops: list[tuple[float, bool]]) -> None:
    # Callers give up (remove) in any order; the rest come out as documented.
    for make in (
        lambda: PriorityScheduler(max_wait=None),
        DeadlineScheduler,
        FairScheduler,
    ):
        scheduler: Any = make()
        kept: list[Request] = []
        for deadline, cancel in ops:
            request = make_request(
                deadline=deadline,
                priority=int(deadline) % 3 if deadline < 10 else 0,
                tenant=str(int(deadline) % 2) if deadline < 10 else None,
            )
            scheduler.push(request)
            kept.append(request)
            if cancel:
                victim = kept.pop(len(kept) // 2)
                assert scheduler.remove(victim) is True
                assert scheduler.remove(victim) is False
        out = [scheduler.pop() for _ in range(len(scheduler))]
        assert sorted(r.sequence for r in out) == sorted(r.sequence for r in kept)
        if isinstance(scheduler, DeadlineScheduler):
            assert [(r.deadline, r.sequence) for r in out] == sorted(
                (r.deadline, r.sequence) for r in kept
            )
        elif isinstance(scheduler, PriorityScheduler):
            assert [(r.priority, r.sequence) for r in out] == sorted(
                ((r.priority, r.sequence) for r in kept), key=lambda p: (-p[0], p[1])
            )
