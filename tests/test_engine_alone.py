"""``engine.infer`` on an idle model whose instance runs inline takes no queue, worker or wake-up.

When a model would pass a lone request straight through (the ``fifo``
scheduler, no batcher, fallback, cache or sequences), its instance runs on the
event loop without suspending (`trioinfer.abc.InlineInstance`: a plain
``def infer`` with ``dispatch = "inline"``, ONNX Runtime's inline dispatch)
and it has an idle instance with nothing queued, the request runs in its
caller's task, counted as a queued request is. An instance that may end
before it suspends (``starts_inline``: a Python ``async def infer``) is started
there too, and carried on there if it suspends. Each test tells where a
request ran by the task its model saw.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import anyio
import numpy as np
import pytest
import trio
import trio.testing

import trioinfer
import trioinfer._inline
from _instruments import counting_steps
from trioinfer import BackendError, InvalidInput, ModelConfig, open_engine

pytestmark = pytest.mark.python_model

Arrays = dict[str, np.ndarray[Any, Any]]
X = np.ones((1, 4), np.float32)
SPEC = [{"name": "x", "dtype": "float32", "shape": ["batch", 4]}]
OUT = [{"name": "y", "dtype": "float32", "shape": ["batch", 4]}]


def _task() -> object:
    return anyio.get_current_task().id


class Where:
    """y = x + 1, recording the task it ran in; *fail*: raise InvalidInput or RuntimeError."""

    tasks: ClassVar[list[object]] = []
    clock: ClassVar[trio.testing.MockClock | None] = None

    def __init__(self, fail: str = "", jump: float = 0.0) -> None:
        self.fail, self.jump = fail, jump

    def infer(self, inputs: Arrays) -> Arrays:
        try:
            Where.tasks.append(_task())
        except Exception:  # on a worker thread: no task there
            Where.tasks.append("a thread")
        if self.jump:
            assert Where.clock is not None
            Where.clock.jump(self.jump)  # the model's run takes this long, with no checkpoint
        if self.fail == "InvalidInput":
            raise InvalidInput("it refuses this input")
        if self.fail:
            raise RuntimeError("it is broken")
        return {"y": inputs["x"] + 1}


class AsyncWhere(Where):
    """The same as ``async def infer``: run on the loop, but it may suspend."""

    async def infer(self, inputs: Arrays) -> Arrays:  # type: ignore[override]
        return Where.infer(self, inputs)


@pytest.fixture(autouse=True)
def _reset(monkeypatch: pytest.MonkeyPatch) -> None:
    Where.tasks.clear()
    # A fresh slice, and time standing still for it: no test yields for it unless it says so.
    monkeypatch.setattr(trioinfer._inline, "_wall", lambda: 0.0)
    monkeypatch.setattr(trioinfer._inline._slice, "start", 0.0)
    monkeypatch.setattr(trioinfer._inline._slice, "granted", False)


def model(name: str, cls: type = Where, dispatch: str = "inline", **kw: Any) -> ModelConfig:
    options: dict[str, Any] = {
        "class": cls,
        "inputs": SPEC,
        "outputs": OUT,
        "parameters": kw.pop("parameters", {}),
        "dispatch": dispatch,
    }
    return ModelConfig(name=name, path="-", backend="python", backend_options=options, **kw)


def _counts(s: trioinfer.ModelStatistics) -> tuple[object, ...]:
    return (
        s.succeeded, s.failed, s.cancelled, s.expired, s.in_flight, s.queued, s.executions,
        s.replicas[0].executions, s.replicas[0].failures, s.queue_duration.count,
        s.compute_duration.count, s.request_duration.count, s.batch_size.count,
        s.batch_size.sum, s.inferences,
    )  # fmt: skip


async def test_an_idle_inline_model_runs_the_request_in_its_callers_task(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_engine() as engine:
        await engine.load(model("a"))
        rows = np.ones((3, 4), np.float32)
        out = await engine.infer("a", {"x": rows})
        np.testing.assert_array_equal(out["y"], rows + 1)
        # infer_detailed (what the server calls) alike, saying which instance answered.
        result = await engine.infer_detailed("a", {"x": X})
        np.testing.assert_array_equal(result.outputs["y"], X + 1)
        assert (result.model, result.instance, result.device, result.fallbacks) == (
            "a", 0, "cpu", ()
        )  # fmt: skip
        assert Where.tasks == [_task()] * 2
        # Counted as the worker counts a request: executions, durations, rows.
        s = engine.statistics().models["a"]
        assert _counts(s) == (2, 0, 0, 0, 0, 0, 2, 2, 0, 2, 2, 2, 2, 4, 4)
        assert s.queue_duration.sum == 0.0
        assert s.successful_executions == 2


@pytest.mark.parametrize(
    "config",
    [
        model("b", dispatch="thread"),  # def infer on the instance's thread
        model("b", batcher="dynamic", batcher_options={"max_batch_size": 4}),
        model("b", scheduler="priority"),
    ],
    ids=["thread", "batched", "priority"],
)
async def test_any_other_model_queues_the_request_as_before(
    autojump_clock: trio.testing.MockClock, config: ModelConfig
) -> None:
    async with open_engine() as engine:
        await engine.load(config)
        out = await engine.infer("b", {"x": X})
        np.testing.assert_array_equal(out["y"], X + 1)
        assert Where.tasks != [_task()]
        assert engine.statistics().models["b"].succeeded == 1


@pytest.mark.parametrize(
    ("fail", "error"), [("InvalidInput", InvalidInput), ("RuntimeError", BackendError)]
)
async def test_a_failing_inline_request_ends_once_counted_and_the_instance_serves_on(
    autojump_clock: trio.testing.MockClock, fail: str, error: type[Exception]
) -> None:
    async with open_engine() as engine:
        await engine.load(model("a", parameters={"fail": fail}))
        for _ in range(2):
            with pytest.raises(error) as info:
                await engine.infer("a", {"x": X})
            assert type(info.value) is error
        assert Where.tasks == [_task()] * 2  # given back after the first: the second ran here too
        s = engine.statistics().models["a"]
        assert (s.succeeded, s.failed, s.in_flight, s.executions) == (0, 2, 0, 2)
        assert (s.replicas[0].failures, s.successful_executions) == (2, 0)


async def test_a_request_past_its_deadline_is_never_computed(
    autojump_clock: trio.testing.MockClock, still_slice: None
) -> None:
    # The first model runs inline and moves the clock past the caller's deadline
    # without a checkpoint: the second request must not run, and the scope reports it.
    Where.clock = autojump_clock
    async with open_engine() as engine:
        await engine.load(model("jump", parameters={"jump": 2.0}))
        await engine.load(model("b"))
        with pytest.raises(trio.TooSlowError), trio.fail_after(1.0):  # noqa: PT012
            await engine.infer("jump", {"x": X})
            await engine.infer("b", {"x": X})
        assert len(Where.tasks) == 1  # jump's run only
        b = engine.statistics().models["b"]
        assert (b.expired, b.executions, b.in_flight, b.succeeded) == (1, 0, 0, 0)


async def test_a_cancelled_caller_gets_cancelled_before_anything_runs(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_engine() as engine:
        await engine.load(model("a"))
        with trio.CancelScope() as scope:
            scope.cancel()
            await engine.infer("a", {"x": X})
        assert scope.cancelled_caught
        assert Where.tasks == []
        assert engine.statistics().models["a"].executions == 0


@pytest.mark.parametrize("detailed", [False, True], ids=["infer", "infer_detailed"])
async def test_a_caller_that_leaves_at_the_slices_yield_is_counted_as_cancelled(
    monkeypatch: pytest.MonkeyPatch, detailed: bool
) -> None:
    # The engine yields before an inline request once the loop's slice is spent; a
    # caller whose scope ends there left a request the engine had taken: it must be
    # in a counter (make demo showed 64 timed out, 16 expired and 0 cancelled).
    scope = trio.CancelScope()
    armed = False

    def wall() -> float:
        # The slice is always spent; and once the request is taken, the caller's scope
        # ends before the yield does (its deadline passing, or a cancel from elsewhere).
        if armed:
            scope.cancel()
        return 1.0

    monkeypatch.setattr(trioinfer._inline, "_wall", wall)
    async with open_engine() as engine:
        await engine.load(model("a"))
        call = engine.infer_detailed if detailed else engine.infer
        with scope:
            armed = True
            await call("a", {"x": X})
        assert scope.cancelled_caught
        assert Where.tasks == []
        s = engine.statistics().models["a"]
        assert (s.cancelled, s.expired, s.executions, s.in_flight) == (1, 0, 0, 0)


async def test_callers_looping_on_an_inline_model_leave_the_loop_its_turns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Such requests never park: a caller yields once the loop's inline slice is
    # spent (here, at every request), so that the rest of the program runs.
    wall = iter(range(10**9))  # every reading a second after the last
    monkeypatch.setattr(trioinfer._inline, "_wall", lambda: float(next(wall)))
    monkeypatch.setattr(trioinfer._inline._slice, "start", -1.0)
    async with open_engine() as engine:
        await engine.load(model("a"))
        done = 0

        async def caller() -> None:
            nonlocal done
            for _ in range(50):
                out = await engine.infer("a", {"x": X})
                np.testing.assert_array_equal(out["y"], X + 1)
                done += 1

        async def detailed_caller() -> None:
            nonlocal done
            for _ in range(50):
                result = await engine.infer_detailed("a", {"x": X})
                np.testing.assert_array_equal(result.outputs["y"], X + 1)
                done += 1

        seen = []
        async with trio.open_nursery() as nursery:
            for _ in range(2):
                nursery.start_soon(caller)
                nursery.start_soon(detailed_caller)
            while done < 200:
                await trio.lowlevel.checkpoint()
                seen.append(done)
        assert any(0 < n < 200 for n in seen), seen
        s = engine.statistics().models["a"]
        assert (s.succeeded, s.executions) == (200, 200)


async def test_a_caller_back_from_a_wait_finds_a_fresh_slice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The slice counts the time the loop is held, not the time it sat polling: a
    # caller whose wait outlasted the slice (its client, a socket) does not yield
    # at its next request, as if the idle time had been spent in inline work.
    now = 0.0
    monkeypatch.setattr(trioinfer._inline, "_wall", lambda: now)
    async with open_engine() as engine:
        await engine.load(model("a"))
        with counting_steps() as steps:
            now = 1.0  # the slice spent: the request yields (the first yield: the restarts begin)
            await engine.infer("a", {"x": X})
            assert steps.count == 1
            now = 2.0  # the wait, by the slice's clock: the slice spent over again
            await trio.lowlevel.checkpoint()  # ... while the loop polled
            count = steps.count
            await engine.infer("a", {"x": X})
            assert steps.count == count  # no yield
            now = 3.0  # held since: no poll, so the slice is spent and the next request yields
            await engine.infer("a", {"x": X})
            assert steps.count == count + 1


async def test_the_slice_restarts_at_polls_only_while_an_engine_is_open(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = 0.0
    monkeypatch.setattr(trioinfer._inline, "_wall", lambda: now)
    async with open_engine():
        now = 0.5  # no inline work has yielded yet: nothing restarts the slice at polls
        await trio.lowlevel.checkpoint()
        assert trioinfer._inline._slice.start == 0.0
        trioinfer._inline.restart_inline_slice()  # (inline work's first yield)
        async with open_engine():
            now = 1.0
            await trio.lowlevel.checkpoint()  # a loop pass: a poll
            assert trioinfer._inline._slice.start == 1.0
        now = 2.0  # the inner engine closed: the outer one still asks for restarts
        await trio.lowlevel.checkpoint()  # a loop pass: a poll
        assert trioinfer._inline._slice.start == 2.0
    now = 3.0  # both closed: nothing of the engine's is left in the run
    await trio.lowlevel.checkpoint()  # a loop pass: a poll
    assert trioinfer._inline._slice.start == 2.0


async def test_a_fresh_slice_costs_no_yield(autojump_clock: trio.testing.MockClock) -> None:
    # Within the slice, the request neither queues nor yields: the task does not resume.
    async with open_engine() as engine:
        await engine.load(model("a"))
        with counting_steps() as steps:
            for _ in range(5):
                await engine.infer("a", {"x": X})
        assert steps.count == 0
        assert Where.tasks == [_task()] * 5


def test_an_idle_inline_model_runs_in_its_callers_task_on_asyncio() -> None:
    async def main() -> None:
        async with open_engine() as engine:
            await engine.load(model("a"))
            await engine.load(model("f", parameters={"fail": "RuntimeError"}))
            with anyio.fail_after(10):
                out = await engine.infer("a", {"x": X})
                np.testing.assert_array_equal(out["y"], X + 1)
                with pytest.raises(BackendError):
                    await engine.infer("f", {"x": X})
            assert Where.tasks == [_task()] * 2
            stats = engine.statistics().models
            assert [(stats[m].succeeded, stats[m].failed) for m in "af"] == [(1, 0), (0, 1)]

    anyio.run(main, backend="asyncio")


# -- an instance that may suspend: started in the caller's task, hoping it does not ----


class Awaits:
    """y = x + 1 after awaiting *wait* (seconds; inf: until cancelled), recording what it saw."""

    tasks: ClassVar[list[object]] = []
    seen: ClassVar[list[str]] = []
    release: ClassVar[anyio.Event | None] = None

    def __init__(self, wait: float = 0.0, fail: bool = False) -> None:
        self.wait, self.fail = wait, fail

    async def infer(self, inputs: Arrays) -> Arrays:
        Awaits.tasks.append(_task())
        try:
            if Awaits.release is not None:
                await Awaits.release.wait()
            elif self.wait:
                await anyio.sleep(self.wait)
        except anyio.get_cancelled_exc_class():
            Awaits.seen.append("cancelled")
            raise
        Awaits.seen.append("done")
        if self.fail:
            raise RuntimeError("it is broken")
        return {"y": inputs["x"] + 1}


@pytest.fixture(autouse=True)
def _reset_awaits() -> None:
    Awaits.tasks.clear()
    Awaits.seen.clear()
    Awaits.release = None


async def test_an_async_model_that_does_not_suspend_runs_in_its_callers_task(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Started here, it returned without suspending: done as an inline model's request,
    # counted alike, with no yield.
    async with open_engine() as engine:
        await engine.load(model("a", AsyncWhere))
        with counting_steps() as steps:
            out = await engine.infer("a", {"x": np.ones((3, 4), np.float32)})
            result = await engine.infer_detailed("a", {"x": X})
        assert steps.count == 0
        np.testing.assert_array_equal(out["y"], np.full((3, 4), 2, np.float32))
        assert (result.model, result.instance, result.device) == ("a", 0, "cpu")
        assert Where.tasks == [_task()] * 2
        s = engine.statistics().models["a"]
        assert _counts(s) == (2, 0, 0, 0, 0, 0, 2, 2, 0, 2, 2, 2, 2, 4, 4)
        assert s.successful_executions == 2


@pytest.mark.parametrize("wait", [0.0, 1.0], ids=["at-once", "after-awaiting"])
async def test_a_failing_async_model_fails_its_request_once_in_its_callers_task(
    autojump_clock: trio.testing.MockClock, wait: float
) -> None:
    async with open_engine() as engine:
        await engine.load(model("a", Awaits, parameters={"wait": wait, "fail": True}))
        for _ in range(2):
            with pytest.raises(BackendError, match="it is broken"):
                await engine.infer("a", {"x": X})
        assert Awaits.tasks == [_task()] * 2
        s = engine.statistics().models["a"]
        assert (s.succeeded, s.failed, s.cancelled, s.in_flight, s.executions) == (0, 2, 0, 0, 2)
        assert (s.replicas[0].failures, s.successful_executions) == (2, 0)


async def test_an_async_model_that_suspends_goes_on_in_its_callers_task(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_engine() as engine:
        await engine.load(model("a", Awaits, parameters={"wait": 1.0}))
        start = trio.current_time()
        out = await engine.infer("a", {"x": X})
        np.testing.assert_array_equal(out["y"], X + 1)
        assert trio.current_time() - start == 1.0
        result = await engine.infer_detailed("a", {"x": X})
        assert result.instance == 0
        assert Awaits.tasks == [_task()] * 2
        s = engine.statistics().models["a"]
        assert _counts(s) == (2, 0, 0, 0, 0, 0, 2, 2, 0, 2, 2, 2, 2, 2, 2)
        assert s.compute_duration.sum == 2.0


async def test_the_callers_deadline_cancels_an_async_model_that_suspends(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_engine() as engine:
        await engine.load(model("a", Awaits, parameters={"wait": math.inf}))
        with pytest.raises(trio.TooSlowError), trio.fail_after(1.0):
            await engine.infer("a", {"x": X})
        assert Awaits.seen == ["cancelled"]
        with trio.move_on_after(1.0) as scope:
            await engine.infer_detailed("a", {"x": X})
        assert scope.cancelled_caught
        assert Awaits.tasks == [_task()] * 2  # the slot was given back: the second ran here
        s = engine.statistics().models["a"]
        assert (s.succeeded, s.cancelled, s.failed, s.in_flight, s.executions) == (0, 2, 0, 0, 2)
        assert s.replicas[0].failures == 0


async def test_a_request_arriving_while_it_runs_queues_and_the_worker_serves_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_engine() as engine:
        await engine.load(model("a", Awaits))
        Awaits.release = anyio.Event()
        tasks: dict[str, object] = {}

        async def call(name: str) -> None:
            tasks[name] = _task()
            out = await engine.infer("a", {"x": X})
            np.testing.assert_array_equal(out["y"], X + 1)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call, "first")
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(call, "second")
            await trio.testing.wait_all_tasks_blocked()
            # Queued, then taken by the worker, which waits for the instance.
            assert engine.statistics().models["a"].in_flight == 2
            Awaits.release.set()
        # The first ran in its caller's task; the second, queued, in the worker's.
        assert Awaits.tasks[0] == tasks["first"]
        assert Awaits.tasks[1] not in tasks.values()
        s = engine.statistics().models["a"]
        assert (s.succeeded, s.in_flight, s.queued, s.executions) == (2, 0, 0, 2)


@pytest.mark.parametrize("how", ["unload", "close"])
async def test_an_unload_ends_an_async_model_suspended_in_its_callers_task(
    autojump_clock: trio.testing.MockClock, how: str
) -> None:
    # As any request still running after the drain period: EngineClosed, and the
    # execution aborted (not waited for).
    errors: list[BaseException] = []
    callers: list[object] = []

    async def call(engine: trioinfer.Engine) -> None:
        callers.append(_task())
        try:
            await engine.infer("a", {"x": X})
        except trioinfer.EngineClosed as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        async with open_engine(drain_period=1.0) as engine:
            await engine.load(model("a", Awaits, parameters={"wait": math.inf}))
            nursery.start_soon(call, engine)
            await trio.testing.wait_all_tasks_blocked()
            start = trio.current_time()
            if how == "unload":
                await engine.unload("a")
        # (closing: leaving the block)
        assert trio.current_time() - start == 1.0
    assert len(errors) == 1
    assert Awaits.seen == ["cancelled"]
    assert Awaits.tasks == callers


def test_an_async_model_runs_in_its_callers_task_on_asyncio() -> None:
    async def main() -> None:
        async with open_engine(drain_period=0.0) as engine:
            await engine.load(model("a", AsyncWhere))
            await engine.load(model("w", Awaits, parameters={"wait": math.inf}))
            with anyio.fail_after(10):
                out = await engine.infer("a", {"x": X})
                np.testing.assert_array_equal(out["y"], X + 1)
            assert Where.tasks == [_task()]
            with pytest.raises(TimeoutError):
                with anyio.fail_after(0.05):
                    await engine.infer("w", {"x": X})
            assert Awaits.seen == ["cancelled"]
            Awaits.seen.clear()

            async def call() -> None:
                with pytest.raises(trioinfer.EngineClosed):
                    await engine.infer("w", {"x": X})

            async with anyio.create_task_group() as tg:
                tg.start_soon(call)
                await anyio.sleep(0.05)
                await engine.unload("w")
            assert Awaits.seen == ["cancelled"]
            assert Awaits.tasks[0] == _task()
            stats = engine.statistics().models
            assert (stats["a"].succeeded, stats["a"].executions) == (1, 1)

    anyio.run(main, backend="asyncio")
