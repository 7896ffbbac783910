"""Deadlines and cancellation come from the caller; every request ends exactly once."""

from __future__ import annotations

import contextlib
import math
import threading
from pathlib import Path

import anyio
import numpy as np
import pytest
import trio
import trio.lowlevel
import trio.testing

import trioinfer
from trioinfer import Instance, ModelConfig, open_engine
from trioinfer._runner import RequestQueue
from trioinfer.lowlevel import Request
from trioinfer.testing import FakeBackend, make_request

X = np.ones((1, 4), dtype=np.float32)


def fake_config(**kw: object) -> ModelConfig:
    return ModelConfig(name="m", path="unused.onnx", backend="fake", **kw)  # type: ignore[arg-type]


class RecordingScheduler:
    """FIFO that remembers every request pushed, to look at what the engine stored."""

    def __init__(self) -> None:
        self.pushed: list[Request] = []
        self._queue: dict[Request, None] = {}

    def push(self, request: Request) -> None:
        self.pushed.append(request)
        self._queue[request] = None

    def peek(self) -> Request:
        if not self._queue:
            raise IndexError("empty")
        return next(iter(self._queue))

    def pop(self) -> Request:
        request = self.peek()
        del self._queue[request]
        return request

    def remove(self, request: Request) -> bool:
        return self._queue.pop(request, False) is None

    def __len__(self) -> int:
        return len(self._queue)


async def test_request_carries_deadline_priority_tenant_and_id(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FakeBackend()
    scheduler = RecordingScheduler()
    registry = trioinfer.Registry(
        extra={"backends": {"fake": lambda: backend}, "schedulers": {"rec": lambda: scheduler}}
    )
    async with open_engine(registry=registry) as engine:
        await engine.load(fake_config(scheduler="rec"))
        t0 = trio.current_time()
        with trio.fail_after(0.75):
            await engine.infer("m", {"x": X}, priority=3, tenant="acme", request_id="r-1")
        await engine.infer("m", {"x": np.ones((5, 4), np.float32)})
    first, second = scheduler.pushed
    assert (first.deadline, first.priority, first.tenant, first.id) == (t0 + 0.75, 3, "acme", "r-1")
    assert first.arrival == t0
    assert first.rows == 1
    assert (second.deadline, second.priority, second.tenant) == (math.inf, 0, None)
    assert second.rows == 5
    assert second.id != first.id


async def test_expired_requests_never_reach_the_backend(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FakeBackend(delay=1.0)
    timed_out = 0

    async def call(engine: trioinfer.Engine, budget: float) -> None:
        nonlocal timed_out
        with trio.move_on_after(budget) as scope:
            await engine.infer("m", {"x": X})
        timed_out += scope.cancelled_caught

    async with open_engine(registry=backend.registry()) as engine, trio.open_nursery() as nursery:
        await engine.load(fake_config())
        nursery.start_soon(call, engine, 10.0)  # runs first, 1 s
        await trio.testing.wait_all_tasks_blocked()
        for _ in range(50):  # all expire while the first one runs
            nursery.start_soon(call, engine, 0.5)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(call, engine, 10.0)  # runs second
        await trio.sleep(5)
        stats = engine.statistics().models["m"]
    assert timed_out == 50
    assert backend.executions == [1, 1]
    assert stats.succeeded == 2
    assert stats.cancelled + stats.expired == 50


async def test_deadline_already_passed_is_refused_before_queueing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FakeBackend()
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(fake_config())
        with trio.move_on_at(trio.current_time() - 1) as scope:
            await engine.infer("m", {"x": X})
        assert scope.cancelled_caught
        assert engine.statistics().models["m"].in_flight == 0
    assert backend.executions == []


async def test_cancelled_while_queued_is_removed_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FakeBackend(delay=1.0)
    async with open_engine(registry=backend.registry()) as engine, trio.open_nursery() as nursery:
        await engine.load(fake_config())
        nursery.start_soon(engine.infer, "m", {"x": X})
        await trio.sleep(0.1)
        async with trio.open_nursery() as waiters:
            for _ in range(1000):
                waiters.start_soon(engine.infer, "m", {"x": X})
            await trio.sleep(0.1)
            assert engine.statistics().models["m"].queued == 1000
            waiters.cancel_scope.cancel()
        stats = engine.statistics().models["m"]
        assert (stats.queued, stats.cancelled, stats.in_flight) == (0, 1000, 1)
    assert backend.executions == [1]


async def test_caller_cancelled_while_running_leaves_at_once_and_aborts(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FakeBackend(delay=10.0)
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(fake_config())
        t0 = trio.current_time()
        with trio.move_on_after(1.0):
            await engine.infer("m", {"x": X})
        assert trio.current_time() - t0 == 1.0
        await trio.testing.wait_all_tasks_blocked()
        # Nobody waited for the execution any more, so it was cancelled in the backend.
        assert backend.loaded[0].running == 0
        out = await engine.infer("m", {"x": X})
        assert trio.current_time() - t0 == 11.0
        np.testing.assert_array_equal(out["y"], 2 * X)


async def test_queue_full_is_refused_at_once_with_a_retry_hint(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FakeBackend(delay=1.0)
    async with open_engine(registry=backend.registry()) as engine, trio.open_nursery() as nursery:
        await engine.load(fake_config(max_queue_size=3))
        nursery.start_soon(engine.infer, "m", {"x": X})  # runs
        await trio.sleep(0.1)
        for _ in range(3):  # wait
            nursery.start_soon(engine.infer, "m", {"x": X})
        await trio.sleep(0.4)
        t0 = trio.current_time()
        with pytest.raises(trioinfer.QueueFull, match="max_queue_size") as info:
            await engine.infer("m", {"x": X})
        assert trio.current_time() == t0
        assert info.value.retry_after > 0
        assert engine.statistics().models["m"].refused == 1
    assert backend.executions == [1, 1, 1, 1]


async def test_every_request_ends_exactly_once(autojump_clock: trio.testing.MockClock) -> None:
    backend = FakeBackend(delay=0.01)
    outcomes: dict[str, int] = {}

    async def call(engine: trioinfer.Engine, i: int) -> None:
        kind = "ok"
        with trio.move_on_after(0.005 * (i % 40)) as scope:
            try:
                await engine.infer("m", {"x": X})
            except trioinfer.TrioInferError as exc:
                kind = type(exc).__name__
        if scope.cancelled_caught:
            kind = "cancelled"
        outcomes[kind] = outcomes.get(kind, 0) + 1

    async with open_engine(registry=backend.registry()) as engine, trio.open_nursery() as nursery:
        await engine.load(fake_config(instances=[Instance(count=2)], max_queue_size=100))
        for i in range(400):
            nursery.start_soon(call, engine, i)
            if i % 10 == 0:
                await trio.sleep(0.003)
        await trio.sleep(5)
        stats = engine.statistics().models["m"]
    assert sum(outcomes.values()) == 400
    assert stats.in_flight == stats.queued == 0
    refused_before_queueing = 10  # move_on_after(0): cancelled before admission
    admitted = 400 - refused_before_queueing - stats.refused
    assert stats.succeeded + stats.failed + stats.cancelled + stats.expired == admitted
    assert stats.refused == outcomes.get("QueueFull", 0)
    # A result may be ready at the very moment its caller's deadline strikes; the
    # caller then sees the cancellation, never both.
    assert outcomes["ok"] <= stats.succeeded
    assert outcomes["ok"] + outcomes["cancelled"] + stats.refused == 400
    # Only requests whose caller still waited were computed.
    assert len(backend.executions) <= stats.succeeded + stats.cancelled


async def test_cancel_during_load_closes_what_was_loaded(
    autojump_clock: trio.testing.MockClock, add_model: Path
) -> None:
    async with open_engine() as engine:
        with trio.CancelScope() as scope:
            scope.cancel()
            await engine.load(
                ModelConfig(name="add", path=add_model, instances=[Instance(count=2)])
            )
        assert scope.cancelled_caught
        assert engine.models() == []
        # The instances' worker threads were stopped too, even mid-start.
        assert not [t for t in threading.enumerate() if t.name.startswith("trioinfer-")]


async def test_queue_timeout_rejects_a_request_that_waited_too_long(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FakeBackend(delay=1.0)
    async with open_engine(registry=backend.registry()) as engine, trio.open_nursery() as nursery:
        await engine.load(fake_config(queue_timeouts={0: 0.5, 5: 3.0}))
        nursery.start_soon(engine.infer, "m", {"x": X})  # runs for 1 s
        await trio.testing.wait_all_tasks_blocked()
        t0 = trio.current_time()
        with pytest.raises(trioinfer.DeadlineExceeded, match="nothing was computed"):
            await engine.infer("m", {"x": X})  # level 0: 0.5 s in the queue at most
        assert trio.current_time() - t0 == 0.5
        # Level 5 may wait 3 s; a caller's own deadline always wins over the policy.
        await engine.infer("m", {"x": X}, priority=5)
        with trio.move_on_after(10):
            await engine.infer("m", {"x": X})
        stats = engine.statistics().models["m"]
    assert (stats.expired, stats.succeeded) == (1, 3)
    assert backend.executions == [1, 1, 1]


def test_queue_timeouts_are_validated() -> None:
    with pytest.raises(trioinfer.ConfigError, match="not an integer priority level"):
        fake_config(queue_timeouts={"high": 1.0})
    with pytest.raises(
        trioinfer.ConfigError, match="level 0 must be a number of seconds from 1e-06"
    ):
        fake_config(queue_timeouts={0: 0})
    assert fake_config(queue_timeouts={"2": 1}).queue_timeouts == {2: 1.0}


class Pairs:
    """A test batcher: up to two requests per batch, in queue order."""

    async def next_batch(self, queue: RequestQueue) -> list[Request]:
        await queue.wait_not_empty()
        batch = [queue.pop_nowait()]
        with contextlib.suppress(anyio.WouldBlock):
            batch.append(queue.pop_nowait())
        return batch


@pytest.mark.parametrize("aliasing", [False, True])
async def test_batches_reuse_pooled_buffers_and_split_outputs(
    autojump_clock: trio.testing.MockClock, aliasing: bool
) -> None:
    # An aliasing backend returns its input itself: a pooled buffer must then not be reused.
    backend = FakeBackend((lambda inputs: {"y": inputs["x"]}) if aliasing else None, delay=0.1)
    registry = trioinfer.Registry(
        extra={"backends": {"fake": lambda: backend}, "batchers": {"pairs": Pairs}}
    )
    results: dict[int, np.ndarray] = {}

    async def call(engine: trioinfer.Engine, i: int) -> None:
        x = np.full((1 + i % 3, 4), i, np.float32)
        results[i] = (await engine.infer("m", {"x": x}))["y"]

    async with open_engine(registry=registry) as engine:
        await engine.load(fake_config(batcher="pairs"))
        for _ in range(5):
            async with trio.open_nursery() as nursery:
                for i in range(20):
                    nursery.start_soon(call, engine, i)
        stats = engine.statistics().models["m"]
    factor = 1 if aliasing else 2
    for i, y in results.items():
        np.testing.assert_array_equal(y, np.full((1 + i % 3, 4), factor * i, np.float32))
    assert max(backend.executions) <= 6
    assert stats.executions == 50
    if aliasing:
        assert stats.buffers_reused == 0
    else:
        # Steady state: a handful of buffer sizes, then only reuse.
        assert stats.buffers_allocated <= 6
        assert stats.buffers_reused >= 40


async def test_given_back_requests_keep_their_place_at_the_head() -> None:
    from trioinfer_scheduling import FifoScheduler

    expired: list[Request] = []
    # The engine's own queue: only the engine may make one (a unit test of it may).
    with pytest.raises(TypeError, match="no public constructor"):
        RequestQueue(FifoScheduler(), lambda r, now: expired.append(r))
    queue = RequestQueue._create(FifoScheduler(), lambda r, now: expired.append(r))
    a, b, c, d = (make_request() for _ in range(4))
    for request in (a, b, c):
        queue._push(request)
    taken = [queue.pop_nowait(), queue.pop_nowait()]
    queue._push(d)
    queue.put_back(taken)  # a batcher was cancelled holding a and b
    assert len(queue) == 4
    assert queue.peek_nowait() is a
    queue._remove(b)  # b's caller left while it was given back
    assert [queue.pop_nowait() for _ in range(3)] == [a, c, d]
    with pytest.raises(anyio.WouldBlock):
        queue.pop_nowait()
    assert expired == []


@pytest.mark.parametrize("way", ["make_request", "_make_request_slowly"])
def test_the_engines_fast_request_constructor_matches_the_attrs_one(way: str) -> None:
    """make_request (the request path's) builds what Request(...) builds, defaults included."""
    import copy
    import pickle

    import attrs

    from trioinfer import _request
    from trioinfer._request import Request as EngineRequest

    # The fast way (a _Draft that becomes a Request) is the one in use here.
    assert _request.make_request.__name__ == "make_request"
    fast = getattr(_request, way)
    inputs = {"x": np.ones((2, 3), np.float32)}
    args = ("m", inputs, "id-1", 2, "tenant", 9.5, 1.5, 2)
    made = fast(*args)
    assert type(made) is EngineRequest
    slow = EngineRequest(
        "m", inputs, id="id-1", priority=2, tenant="tenant", deadline=9.5, arrival=1.5, rows=2
    )
    skip = {"sequence", "_state"}
    for field in attrs.fields(EngineRequest):
        if field.name not in skip:
            assert getattr(made, field.name) == getattr(slow, field.name), field.name
    assert made.sequence < slow.sequence  # each made in turn: its own number
    assert attrs.asdict(made._state) == attrs.asdict(slow._state)
    assert made._state is not slow._state
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        made.priority = 3  # type: ignore[misc]
    for twin in (copy.copy(made), pickle.loads(pickle.dumps(made))):
        assert type(twin) is EngineRequest
        assert (twin.id, twin.sequence, twin.rows) == (made.id, made.sequence, made.rows)
    generated = fast("m", inputs, None, 0, None, 9.5, 1.5, 2)
    assert int(generated.id) > 0  # no id given: a process-unique one
    assert fast("m", inputs, None, 0, None, 9.5, 1.5, 2).id != generated.id


async def test_take_nowait_takes_what_fits_in_order_and_fails_the_expired() -> None:
    from trioinfer_scheduling import FifoScheduler

    expired: list[Request] = []
    queue = RequestQueue._create(FifoScheduler(), lambda r, now: expired.append(r))
    now = trio.current_time()
    a = make_request(rows=2)
    late = make_request(rows=1, deadline=now - 1.0)
    b = make_request(rows=3, deadline=now + 60.0)
    c, d = make_request(rows=2), make_request(rows=1)
    for request in (a, late, b, c, d):
        queue._push(request)
    queue.put_back([queue.pop_nowait()])  # a, given back, heads the queue from the front
    assert queue.take_nowait(0) == []
    assert queue.take_nowait(6) == [a, b]  # c (2 rows) would make 7: it stays at the head
    assert expired == [late]
    assert queue.taken == 3  # the pop above, then a and b
    assert queue.peek_nowait() is c
    assert queue.take_nowait(10) == [c, d]
    assert queue.take_nowait(10) == []
    assert len(queue) == 0


async def test_take_nowait_leaves_what_does_not_fit_at_the_head_and_counted() -> None:
    # take_nowait pops from the scheduler without a peek: the request that does not
    # fit goes to the front. It must stay first (ahead of a later, more urgent one),
    # waiting, counted in its priority level once, and withdrawable.
    from trioinfer_scheduling import PriorityScheduler

    queue = RequestQueue._create(PriorityScheduler(), lambda r, now: None, bounded_levels=(0, 5))
    a, big = make_request(rows=2), make_request(rows=3)
    for request in (a, big):
        queue._push(request)
    assert queue.take_nowait(4) == [a]
    assert len(queue) == 1
    assert queue._waiting_at(0) == 1
    urgent = make_request(rows=1, priority=5)
    queue._push(urgent)
    assert queue._waiting_at(5) == 1
    assert queue.take_nowait(2) == []  # big still heads the queue and does not fit
    assert (len(queue), queue._waiting_at(0), queue._waiting_at(5)) == (2, 1, 1)
    queue._remove(big)  # its caller left while it waited at the front
    assert len(queue) == 1
    assert queue.take_nowait(2) == [urgent]
    assert (len(queue), queue._waiting_at(0), queue._waiting_at(5)) == (0, 0, 0)


def test_requests_are_weakly_referenceable_again() -> None:
    # Before the fourth loop round a Request took weak references (a plugin may key a
    # WeakKeyDictionary by request); make_request's class change dropped that.
    import copy
    import math
    import pickle
    import weakref

    from trioinfer._request import Request, make_request

    for r in (make_request("m", {}, None, 0, None, math.inf, 0.0, 1), Request("m", {})):
        assert type(r) is Request
        assert weakref.ref(r)() is r
        assert pickle.loads(pickle.dumps(r)).id == r.id
        assert copy.copy(r).sequence == r.sequence
