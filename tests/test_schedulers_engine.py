"""The scheduler plugins inside a real engine: fake backend, virtual time, exact orders."""

from __future__ import annotations

import contextlib
import functools
import math

import numpy as np
import pytest
import trio
import trio.testing
from trio.testing import wait_all_tasks_blocked

import trioinfer
from trioinfer import ConfigError, DeadlineExceeded, ModelConfig, open_engine
from trioinfer.testing import FakeBackend

X = np.ones((1, 4), dtype=np.float32)


def fake_config(**kw: object) -> ModelConfig:
    return ModelConfig(name="m", path="unused.onnx", backend="fake", **kw)  # type: ignore[arg-type]


class Log:
    """Calls the engine and notes who finished, in order."""

    def __init__(self, engine: trioinfer.Engine) -> None:
        self.engine = engine
        self.done: list[str] = []

    async def call(
        self,
        name: str,
        *,
        budget: float = math.inf,
        priority: int = 0,
        tenant: str | None = None,
        rows: int = 1,
    ) -> None:
        with trio.move_on_after(budget):
            await self.engine.infer(
                "m", {"x": np.ones((rows, 4), np.float32)}, priority=priority, tenant=tenant
            )
            self.done.append(name)

    async def queue(self, nursery: trio.Nursery, name: str, **kw: object) -> None:
        """Start a call and wait until its request is queued (or running)."""
        nursery.start_soon(functools.partial(self.call, name, **kw))  # type: ignore[arg-type]
        await wait_all_tasks_blocked()


async def test_priority_orders_requests_through_the_engine(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FakeBackend(delay=1.0)
    async with open_engine(registry=backend.registry()) as engine, trio.open_nursery() as nursery:
        await engine.load(fake_config(scheduler="priority", scheduler_options={"max_wait": 100}))
        log = Log(engine)
        await log.queue(nursery, "running")  # occupies the only instance
        for name, priority in [("low", -1), ("high", 9), ("mid", 5), ("high-2", 9), ("zero", 0)]:
            await log.queue(nursery, name, priority=priority)
    assert log.done == ["running", "high", "high-2", "mid", "zero", "low"]


@pytest.mark.parametrize("max_wait", [2.0, 5.0, None])
async def test_a_low_priority_request_is_not_starved_by_a_flood(
    autojump_clock: trio.testing.MockClock, max_wait: float | None
) -> None:
    execution = 1.0
    backend = FakeBackend(delay=execution)
    async with open_engine(registry=backend.registry()) as engine, trio.open_nursery() as nursery:
        await engine.load(
            fake_config(scheduler="priority", scheduler_options={"max_wait": max_wait})
        )

        async def flood() -> None:
            # Two high-priority requests per execution for a minute: the top level
            # never empties.
            for _ in range(120):
                nursery.start_soon(functools.partial(engine.infer, "m", {"x": X}, priority=5))
                await trio.sleep(execution / 2)

        nursery.start_soon(flood)
        await trio.sleep(3.25)  # a backlog of high-priority work is queued by now
        start = trio.current_time()
        with trio.move_on_after(30) as scope:
            await engine.infer("m", {"x": X}, priority=0)
        waited = trio.current_time() - start
        nursery.cancel_scope.cancel()
    if max_wait is None:
        assert scope.cancelled_caught  # strict priority: starved for as long as the flood lasts
    else:
        # It starts within max_wait plus the execution already running; then runs itself.
        assert not scope.cancelled_caught
        assert waited - execution <= max_wait + execution


async def test_a_flood_of_aged_low_priority_requests_does_not_starve_the_top_level(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Low-priority work arrives at twice what the model serves: every low request ages
    # before it runs. Aged requests took every start, so high-priority ones, arriving
    # fresh, waited for as long as the flood lasted. They take every other one now.
    execution = 0.01
    backend = FakeBackend(delay=execution)
    waits: list[float] = []
    async with open_engine(registry=backend.registry()) as engine, trio.open_nursery() as nursery:
        await engine.load(
            fake_config(
                scheduler="priority",
                scheduler_options={"max_wait": 1.0},
                max_queue_size=1000,
                queue_sizes={0: 500},  # room for the high level under overload
            )
        )

        async def low() -> None:
            with contextlib.suppress(trioinfer.QueueFull):
                await engine.infer("m", {"x": X}, priority=0)

        async def high() -> None:
            start = trio.current_time()
            await engine.infer("m", {"x": X}, priority=1)
            waits.append(trio.current_time() - start)

        for k in range(2000):  # 10 s of a flood of 200 low requests a second
            nursery.start_soon(low)
            if k % 20 == 10:
                nursery.start_soon(high)  # and 10 high ones
            await trio.sleep(execution / 2)
        nursery.cancel_scope.cancel()
    assert len(waits) == 100
    # Each waits for the execution under way and at most one aged request before it.
    assert max(waits) <= 3 * execution + 1e-9


async def test_deadline_runs_earliest_deadline_first(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FakeBackend(delay=1.0)
    async with open_engine(registry=backend.registry()) as engine, trio.open_nursery() as nursery:
        await engine.load(fake_config(scheduler="deadline"))
        log = Log(engine)
        await log.queue(nursery, "running")
        for name, budget in [
            ("none", math.inf),
            ("late", 50.0),
            ("soon", 10.0),
            ("none-2", math.inf),
            ("mid", 30.0),
            ("mid-2", 30.0),
        ]:
            await log.queue(nursery, name, budget=budget)
    assert log.done == ["running", "soon", "mid", "mid-2", "late", "none", "none-2"]


async def test_refuse_late_refuses_hopeless_requests_at_admission(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FakeBackend(delay=1.0)
    async with open_engine(registry=backend.registry()) as engine, trio.open_nursery() as nursery:
        await engine.load(
            fake_config(scheduler="deadline", scheduler_options={"refuse_late": True})
        )
        for _ in range(30):  # let the moving average of an execution settle near 1 s
            await engine.infer("m", {"x": X})
        estimate = engine.statistics().models["m"].mean_execution_s
        assert 0.99 < estimate <= 1.0
        log = Log(engine)
        await log.queue(nursery, "running")
        await trio.sleep(0.9)  # it ends in 0.1 s
        for i in range(3):  # these end in 1.1, 2.1 and 3.1 s
            await log.queue(nursery, f"queued-{i}", budget=3.5)
        executions = len(backend.executions)
        t0 = trio.current_time()
        # Behind the 3 with earlier deadlines it would end in 4.1 s (estimated: 4 s).
        with pytest.raises(DeadlineExceeded, match=r"3 waiting request\(s\)"):
            with trio.fail_after(3.9):
                await engine.infer("m", {"x": X})
        # Nothing ahead, but one execution takes about a second.
        with pytest.raises(DeadlineExceeded, match="refused at admission") as info:
            with trio.fail_after(0.5):
                await engine.infer("m", {"x": X})
        assert "deadline is 0.500s away" in str(info.value)
        assert trio.current_time() == t0  # refused at once, not after waiting
        # Later deadlines, and no deadline, are admitted.
        await log.queue(nursery, "patient", budget=10.0)
        await log.queue(nursery, "no-deadline")
        stats = engine.statistics().models["m"]
        assert (stats.refused, stats.queued) == (2, 5)
    assert log.done == ["running", "queued-0", "queued-1", "queued-2", "patient", "no-deadline"]
    assert len(backend.executions) == executions + 5  # nothing computed for the refused ones


@pytest.mark.parametrize("scheduler", ["fair", "fifo"])
async def test_a_trickle_tenant_is_not_starved_by_a_flood(
    autojump_clock: trio.testing.MockClock, scheduler: str
) -> None:
    backend = FakeBackend(delay=1.0)
    async with open_engine(registry=backend.registry()) as engine, trio.open_nursery() as nursery:
        await engine.load(fake_config(scheduler=scheduler))

        async def client_of_a() -> None:
            while True:  # the next request as soon as the last one returns
                await engine.infer("m", {"x": X}, tenant="a")

        for _ in range(50):
            nursery.start_soon(client_of_a)
        await trio.sleep(10.5)
        waits = []
        for _ in range(5):  # tenant b sends one request at a time
            start = trio.current_time()
            await engine.infer("m", {"x": X}, tenant="b")
            waits.append(trio.current_time() - start)
            await trio.sleep(3)
        nursery.cancel_scope.cancel()
    if scheduler == "fair":
        # At most the execution under way, one of a's (a tie), and b's own.
        assert max(waits) <= 3.0, waits
    else:
        assert min(waits) >= 45.0, waits  # behind a's 49 other waiting requests, every time


async def test_fair_shares_rows_by_weight_through_the_engine(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FakeBackend(delay=1.0)
    async with open_engine(registry=backend.registry()) as engine, trio.open_nursery() as nursery:
        await engine.load(fake_config(scheduler="fair", scheduler_options={"weights": {"gold": 3}}))
        log = Log(engine)
        await log.queue(nursery, "running")
        for i in range(40):
            nursery.start_soon(functools.partial(log.call, f"gold-{i}", tenant="gold"))
            nursery.start_soon(functools.partial(log.call, f"free-{i}", rows=2))  # tenant None
        await wait_all_tasks_blocked()
        await trio.sleep(42)  # the first 42 executions, with both tenants backlogged
        served = log.done[1:]
        nursery.cancel_scope.cancel()
    rows = {"gold": 0, "free": 0}
    for name in served:
        rows[name.split("-")[0]] += 1 if name.startswith("gold") else 2
    # gold gets 3 rows for each row of the tenant None: 3/4 of the rows, give or take a request.
    gold_share = rows["gold"] / (rows["gold"] + rows["free"])
    assert abs(gold_share - 0.75) <= 0.05


@pytest.mark.parametrize(
    ("scheduler", "options", "message"),
    [
        ("priority", {"max_wait": -1}, "priority scheduler: max_wait must be"),
        (
            "fair",
            {"weights": {"a": -2}},
            "the weight of tenant 'a' must be a finite number greater than 0",
        ),
        ("deadline", {"refuse_late": "no"}, "refuse_late must be true or false"),
    ],
)
async def test_invalid_scheduler_options_refuse_the_model(
    scheduler: str, options: dict[str, object], message: str
) -> None:
    backend = FakeBackend()
    async with open_engine(registry=backend.registry()) as engine:
        with pytest.raises(ConfigError, match=message):
            await engine.load(fake_config(scheduler=scheduler, scheduler_options=options))
        assert [m.name for m in engine.models()] == []


@pytest.mark.parametrize("scheduler", ["fifo", "priority", "deadline", "fair"])
async def test_a_request_argument_of_the_wrong_type_is_refused_before_the_scheduler(
    scheduler: str,
) -> None:
    # priority="high" once went into the priority scheduler's levels, broke it, and took
    # the model out of service for every caller: a caller's typo is that caller's error.
    backend = FakeBackend()
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(fake_config(scheduler=scheduler))
        for kw, words in [
            ({"priority": "high"}, "priority .* must be an integer .* got 'high'"),
            ({"priority": 1.5}, "priority .* must be an integer"),
            ({"priority": None}, "priority .* must be an integer"),
            ({"priority": True}, "priority .* must be an integer"),
            ({"tenant": 3}, r"tenant .* must be a string or None, got 3 \(int\)"),
            ({"request_id": 7}, r"request_id .* must be a string or None, got 7 \(int\)"),
        ]:
            for call in (engine.infer, engine.infer_detailed):
                with pytest.raises(trioinfer.InvalidInput, match=words):
                    await call("m", {"x": X}, **kw)  # type: ignore[arg-type]
            with pytest.raises(trioinfer.InvalidInput, match=words):
                async with engine.infer_stream("m", {"x": X}, **kw):  # type: ignore[arg-type]
                    pass
        # An integer of another type is the integer it stands for; the model still serves.
        out = await engine.infer("m", {"x": X}, priority=np.int64(2))
        np.testing.assert_array_equal(out["y"], 2 * X)
        assert engine.statistics().models["m"].succeeded == 1
