"""Chaos tests: thousands of requests through faulty instances, cancelled callers and overload.

Every test runs on virtual time (``trio.testing.MockClock`` with autojump) and
draws its randomness from seeded generators, so a run takes a few seconds of
real time however many virtual seconds it covers. The faults come from
[`FaultyBackend`][trioinfer.testing.FaultyBackend]; the `resilient` fallback
retries, fails over, and takes instances out with its breakers. What is checked
is what the engine promises under all of that at once:

- every accepted request ends exactly once, with outputs or a typed error;
- no compute is spent on a request whose caller left or whose deadline passed;
- breakers open, and once the faults stop every instance serves again;
- dead instances are re-created and the model goes on answering;
- when the engine exits, no task or worker thread is left.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Mapping
from typing import Any, final

import attrs
import numpy as np
import pytest
import trio
import trio.testing

import trioinfer
from trioinfer import Instance, ModelConfig, Registry, open_engine
from trioinfer.abc import BackendInstance
from trioinfer.lowlevel import Placement
from trioinfer.testing import (
    FakeBackend,
    FaultyBackend,
    RequestLedger,
    assert_all_ended,
    assert_no_tasks_left,
)

Arrays = Mapping[str, np.ndarray[Any, Any]]

#: Seconds one execution of the fake model takes (virtual time).
DELAY = 0.01
#: Instances of the model.
INSTANCES = 3
#: Most requests in one execution.
BATCH = 4


# -- recording what reaches the backend ---------------------------------------------------


@attrs.frozen
class Started:
    """One ``execute()`` call as the backend saw it begin.

    Attributes:
        order: Its place among every recorded event (executions and callers giving up).
        time: The clock when it began.
        ids: The request ids in its batch (0 for the rows of a breaker's probe).
    """

    order: int
    time: float
    ids: tuple[int, ...]


@final
class Recorder:
    """A backend around another that records, at each ``execute()`` start, who is in the batch.

    Request ids travel in the input values (``x = full((1, 4), id)``), so the
    record needs nothing from the engine's internals: it is what a backend
    really received, before any injected latency, hang or error.
    """

    def __init__(self, inner: FaultyBackend, order: itertools.count[int]) -> None:
        self.inner = inner
        self.order = order
        self.started: list[Started] = []

    def registry(self) -> Registry:
        """A registry where this recorder is the backend called ``chaos``."""
        return Registry(extra={"backends": {"chaos": lambda: self}})

    async def load(self, config: ModelConfig, placement: Placement) -> RecordingInstance:
        """Load an instance of the inner backend and wrap it."""
        return RecordingInstance(self, await self.inner.load(config, placement))


@final
class RecordingInstance:
    """An instance of [`Recorder`][]: records, then forwards."""

    def __init__(self, recorder: Recorder, inner: BackendInstance) -> None:
        self._recorder = recorder
        self.inner = inner
        self.signature = inner.signature
        self.device = inner.device

    async def execute(self, inputs: Arrays) -> dict[str, np.ndarray[Any, Any]]:
        """Record the batch's ids and the time, then run it on the wrapped instance."""
        ids = tuple(int(v) for v in inputs["x"][:, 0])
        recorder = self._recorder
        recorder.started.append(Started(next(recorder.order), trio.current_time(), ids))
        return dict(await self.inner.execute(inputs))

    async def aclose(self) -> None:
        """Close the wrapped instance."""
        await self.inner.aclose()


@attrs.define
class GaveUp:
    """When a caller stopped waiting: its place among recorded events, and the clock."""

    order: int
    time: float


def model_config(**fallback_options: Any) -> ModelConfig:
    """Three instances of the fake model behind the resilient fallback, with a small queue."""
    return ModelConfig(
        name="m",
        path="unused.onnx",
        backend="chaos",
        instances=[Instance(count=INSTANCES)],
        # Batches of several requests, so that some callers of a batch leave while
        # the others still wait (a batch whose callers all left is aborted).
        batcher="dynamic",
        batcher_options={"max_batch_size": BATCH, "max_queue_delay": DELAY / 5},
        fallback="resilient",
        fallback_options={"seed": 7, **fallback_options},
        max_queue_size=16,
    )


def x_for(request_id: int) -> np.ndarray[Any, Any]:
    """The input that carries *request_id* (ids start at 1: probes send zeros)."""
    return np.full((1, 4), request_id, np.float32)


def assert_no_compute_after_giving_up(
    started: list[Started], gave_up: Mapping[int, GaveUp], deadlines: Mapping[int, float]
) -> None:
    """No execution began, for any request, after its caller left or its deadline passed."""
    late = []
    for execution in started:
        for request_id in execution.ids:
            left = gave_up.get(request_id)
            if left is not None and execution.order > left.order:
                late.append(f"request {request_id} at {execution.time}: caller left at {left.time}")
            deadline = deadlines.get(request_id)
            if deadline is not None and execution.time >= deadline:
                late.append(f"request {request_id} at {execution.time}: deadline {deadline}")
    assert not late, f"executions began after nobody waited: {late[:5]}"


# -- thousands of requests, everything going wrong at once --------------------------------


REQUESTS = 3000
#: Callers that arrive per second: five times what the instances serve with full batches.
ARRIVAL_RATE = 5 * INSTANCES * BATCH / DELAY
BREAKER = {"fail_max": 2, "reset_timeout": 0.05, "max_reset_timeout": 0.4}


@pytest.mark.parametrize(
    ("seed", "hedge_after"), [(1, None), (2, None), (3, 2 * DELAY)], ids=["1", "2", "3-hedged"]
)
async def test_chaos(
    seed: int, hedge_after: float | None, autojump_clock: trio.testing.MockClock
) -> None:
    """3,000 requests: 10% errors, 5% hangs, 30% of callers leave early, 5x overload."""
    rng = random.Random(seed)
    order = itertools.count()
    faulty = FaultyBackend(
        FakeBackend(delay=DELAY), seed=seed, error_rate=0.10, hang_rate=0.05, transient=True
    )
    recorder = Recorder(faulty, order)
    ledger = RequestLedger()
    infer = ledger.wrap(trioinfer.Engine.infer)
    outcomes: dict[int, str] = {}
    gave_up: dict[int, GaveUp] = {}
    deadlines: dict[int, float] = {}
    wrong: list[int] = []

    async def cancel_later(scope: trio.CancelScope, delay: float) -> None:
        await trio.sleep(delay)
        scope.cancel()  # a client that disconnects: the engine never knew a deadline

    async def caller(
        engine: trioinfer.Engine, nursery: trio.Nursery, request_id: int, arrival: float
    ) -> None:
        await trio.sleep_until(arrival)
        x = x_for(request_id)
        roll = rng.random()
        with trio.CancelScope() as scope:
            if roll < 0.15:
                # Leaves at its deadline, which the engine knows.
                scope.deadline = trio.current_time() + rng.uniform(0.001, 0.1)
                deadlines[request_id] = scope.deadline
            elif roll < 0.30:
                nursery.start_soon(cancel_later, scope, rng.uniform(0.001, 0.1))
            try:
                out = await infer(engine, "m", {"x": x})
            except trioinfer.TrioInferError as exc:
                outcomes[request_id] = type(exc).__name__
                return
            outcomes[request_id] = "ok"
            if not np.array_equal(out["y"], 2 * x):
                wrong.append(request_id)
        if scope.cancelled_caught:
            outcomes[request_id] = "cancelled"
            gave_up[request_id] = GaveUp(next(order), trio.current_time())

    with assert_no_tasks_left():
        async with open_engine(registry=recorder.registry()) as engine:
            await engine.load(
                model_config(timeout=5 * DELAY, breaker=BREAKER, hedge_after=hedge_after)
            )
            t0 = trio.current_time()
            async with trio.open_nursery() as nursery:
                arrival = t0
                for request_id in range(1, REQUESTS + 1):
                    arrival += rng.expovariate(ARRIVAL_RATE)
                    nursery.start_soon(caller, engine, nursery, request_id, arrival)
            storm = engine.statistics().models["m"]
            assert_all_ended(engine, accepted=REQUESTS - storm.refused)

            # The faults stop. Within the longest breaker wait and a probe, every
            # instance is back, and each one answers without any fallback step.
            faulty.error_rate = faulty.hang_rate = 0.0
            await trio.sleep(2 * BREAKER["max_reset_timeout"])
            after = engine.statistics().models["m"]
            assert [r.state for r in after.replicas] == ["serving"] * INSTANCES
            results = []
            for request_id in range(REQUESTS + 1, REQUESTS + 61):
                results.append(await engine.infer_detailed("m", {"x": x_for(request_id)}))
            assert all(r.fallbacks == () for r in results)
            # Sequential calls go to the instance that has been idle longest: all of them.
            assert {r.instance for r in results} == set(range(INSTANCES))

    # The caller's side: each call ended once, with a result, a typed error or
    # its own cancellation, and every answer was this caller's own.
    ledger.assert_all_ended()
    calls = ledger.statistics()
    assert calls.calls == REQUESTS
    assert wrong == []
    assert len(outcomes) == REQUESTS
    assert set(calls.errors) <= {"QueueFull", "CircuitOpen", "BackendError"}
    # ... and each outcome matches the engine's count of it, exactly.
    assert calls.succeeded == storm.succeeded
    assert calls.cancelled == storm.cancelled + storm.expired
    assert sum(calls.errors.values()) == storm.failed + storm.refused

    # Everything happened: overload, faults, early leavers, breakers, fallbacks.
    counts = Counter(outcomes.values())
    assert counts["QueueFull"] > REQUESTS // 4  # 5x overload: most of the surplus is refused
    # Three instances serve about a fifth of the offered load at best, and failovers
    # and hangs cost some of that (a failing instance's worker waits for the failover).
    assert counts["ok"] > REQUESTS // 20
    assert counts["cancelled"] > 0
    faults = faulty.statistics()
    assert faults.errors > 0
    assert faults.hangs > 0
    assert any(r.taken_out >= 1 for r in storm.replicas), storm.replicas
    assert storm.fallbacks.get("retry", 0) + storm.fallbacks.get("failover", 0) > 0

    # No compute for callers that left or whose deadline passed, and none at all
    # for requests refused at admission or failed because every instance was out.
    assert_no_compute_after_giving_up(recorder.started, gave_up, deadlines)
    computed = {i for execution in recorder.started for i in execution.ids}
    never_run = {i for i, outcome in outcomes.items() if outcome in ("QueueFull", "CircuitOpen")}
    assert not computed & never_run
    # A request that got outputs ran at least once, and none ran more than
    # `attempts` (3) times, or twice that when each attempt may be hedged.
    runs = Counter(i for execution in recorder.started for i in execution.ids if i)
    assert all(runs[i] >= 1 for i, outcome in outcomes.items() if outcome == "ok")
    assert max(runs.values()) <= (3 if hedge_after is None else 6)
    if hedge_after is not None:
        assert storm.fallbacks.get("hedge", 0) > 0


# -- dead instances are re-created -------------------------------------------------------


async def test_crashed_instances_are_recreated_and_the_model_keeps_answering(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Every instance dies after 40 calls; breakers re-create them, and answers go on."""
    rng = random.Random(3)
    order = itertools.count()
    faulty = FaultyBackend(FakeBackend(delay=DELAY), seed=3, crash_after=40)
    recorder = Recorder(faulty, order)
    ledger = RequestLedger()
    infer = ledger.wrap(trioinfer.Engine.infer)
    served: list[tuple[float, str]] = []

    async def caller(engine: trioinfer.Engine, request_id: int, arrival: float) -> None:
        await trio.sleep_until(arrival)
        x = x_for(request_id)
        try:
            out = await infer(engine, "m", {"x": x})
        except trioinfer.TrioInferError as exc:
            served.append((trio.current_time(), type(exc).__name__))
            return
        assert np.array_equal(out["y"], 2 * x)
        served.append((trio.current_time(), "ok"))

    with assert_no_tasks_left():
        async with open_engine(registry=recorder.registry()) as engine:
            await engine.load(model_config(breaker={"fail_max": 1, "reset_timeout": 0.05}))
            async with trio.open_nursery() as nursery:
                arrival = trio.current_time()
                for request_id in range(1, 1001):
                    # Half of what three instances serve: a crash, not overload, is the test.
                    arrival += rng.expovariate(0.5 * INSTANCES * BATCH / DELAY)
                    nursery.start_soon(caller, engine, request_id, arrival)
            stats = engine.statistics().models["m"]
            assert_all_ended(engine, accepted=1000 - stats.refused)

    ledger.assert_all_ended()
    # Each instance died (40 calls each cannot serve 1,000 requests) and came back
    # as a new instance of the backend, more than once.
    assert all(r.recreated >= 2 for r in stats.replicas), stats.replicas
    assert len(faulty.instances) == INSTANCES + sum(r.recreated for r in stats.replicas)
    assert faulty.statistics().dead_calls > 0
    # Failover hid almost every crash from the callers, to the very end.
    outcomes = Counter(outcome for _, outcome in served)
    assert outcomes["ok"] >= 950, outcomes
    assert set(outcomes) <= {"ok", "BackendError", "CircuitOpen"}
    last = [outcome for _, outcome in sorted(served)[-100:]]
    assert last.count("ok") >= 95
