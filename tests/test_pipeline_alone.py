"""A pipeline step on an idle plain model runs in the pipeline's own task, counted as any request.

No queue, worker or wake-up: the step's model runs in the caller's task when its
scheduler, batcher and fallback would pass a lone request straight through and
an instance is idle. Each test tells where a step ran by the task its model's
``infer`` saw, and checks the model's statistics as for a queued request.
"""

from __future__ import annotations

from typing import Any, ClassVar

import anyio
import attrs
import numpy as np
import pytest
import trio
import trio.testing

import trioinfer
from _instruments import counting_steps
from trioinfer import BackendError, EngineClosed, ModelConfig, open_engine
from trioinfer_python import PythonInstance

pytestmark = pytest.mark.pipeline

Arrays = dict[str, np.ndarray[Any, Any]]
X = np.ones((1, 4), np.float32)
SPEC = [{"name": "x", "dtype": "float32", "shape": ["batch", 4]}]
OUT = [{"name": "y", "dtype": "float32", "shape": ["batch", 4]}]


def _current_task() -> object:
    # The task the model runs in, on Trio or asyncio.
    return anyio.get_current_task().id


class Probe:
    """y = x + 1 after *delay* seconds; records the task it ran in and what happened."""

    tasks: ClassVar[dict[str, list[object]]] = {}
    events: ClassVar[list[str]] = []

    def __init__(self, name: str, delay: float = 0.0, fail: bool = False) -> None:
        self.name, self.delay, self.fail = name, delay, fail

    async def infer(self, inputs: Arrays) -> Arrays:
        Probe.tasks.setdefault(self.name, []).append(_current_task())
        Probe.events.append(f"{self.name} start")
        try:
            await anyio.sleep(self.delay)
        except anyio.get_cancelled_exc_class():
            Probe.events.append(f"{self.name} cancelled")
            raise
        if self.fail:
            raise RuntimeError(f"{self.name} is broken")
        Probe.events.append(f"{self.name} end")
        return {"y": inputs["x"] + 1}

    async def close(self) -> None:
        Probe.events.append(f"{self.name} close")


class Jump:
    """A sync model run inline (no checkpoint): moves the mock clock on by *by* seconds."""

    clock: ClassVar[trio.testing.MockClock | None] = None

    def __init__(self, by: float) -> None:
        self.by = by

    def infer(self, inputs: Arrays) -> Arrays:
        assert Jump.clock is not None
        Jump.clock.jump(self.by)
        return {"y": inputs["x"] + 1}


class Sync:
    """y = x + 1 in a plain ``def infer``; records its task; may raise *fail* (a class name)."""

    def __init__(self, name: str, fail: str = "") -> None:
        self.name, self.fail = name, fail

    def infer(self, inputs: Arrays) -> Arrays:
        try:
            where = _current_task()
        except Exception:  # (on a worker thread: no event loop there)
            where = "a thread"
        Probe.tasks.setdefault(self.name, []).append(where)
        if self.fail == "InvalidInput":
            raise trioinfer.InvalidInput(f"{self.name} refuses it")
        if self.fail:
            raise RuntimeError(f"{self.name} is broken")
        return {"y": inputs["x"] + 1}


def inline(name: str, **parameters: Any) -> ModelConfig:
    # A Sync model whose infer runs on the event loop: its instance never suspends.
    return model(
        name, Sync, parameters={"name": name, **parameters}, backend_options={"dispatch": "inline"}
    )


@pytest.fixture(autouse=True)
def _reset() -> None:
    Probe.tasks.clear()
    Probe.events.clear()


def model(name: str, cls: type = Probe, **kw: Any) -> ModelConfig:
    options: dict[str, Any] = {"class": cls, "inputs": SPEC, "outputs": OUT}
    parameters = kw.pop("parameters", {"name": name})
    options["parameters"] = parameters
    options.update(kw.pop("backend_options", {}))
    return ModelConfig(name=name, path="-", backend="python", backend_options=options, **kw)


def chain(*models: str, name: str = "p") -> ModelConfig:
    names = ["IN", *(f"T{i}" for i in range(len(models) - 1)), "OUT"]
    steps = [
        {"model": m, "input_map": {"x": a}, "output_map": {"y": b}}
        for m, a, b in zip(models, names, names[1:], strict=False)
    ]
    tensor = {"dtype": "float32", "shape": ["batch", 4]}
    options = {
        "inputs": [{"name": "IN", **tensor}],
        "outputs": [{"name": "OUT", **tensor}],
        "steps": steps,
    }
    return ModelConfig(name=name, path="-", backend="pipeline", backend_options=options)


async def load(engine: trioinfer.Engine, *configs: ModelConfig) -> None:
    for config in configs:
        await engine.load(config)


async def two_callers_in_turn(engine: trioinfer.Engine, check: Any = None) -> None:
    """Two callers of "p" at once on the one-instance model "slow" (1 s a run, mock clock).

    The first runs in its caller's task, the second waits and is run by the
    model's worker; both are counted as queued requests are. *check* is
    called on each answer.
    """
    callers: list[object] = []

    async def call() -> None:
        callers.append(_current_task())
        out = await engine.infer("p", {"IN": X})
        if check is not None:
            check(out)

    t0 = trio.current_time()
    with trio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            tg.start_soon(call)
    assert trio.current_time() - t0 == pytest.approx(2.0)  # one instance: in turn
    first, second = Probe.tasks["slow"]
    assert first in callers  # idle: in its caller's task
    assert second not in callers  # busy: queued, run by the model's worker
    s = engine.statistics().models["slow"]
    assert (s.succeeded, s.executions, s.in_flight, s.queue_duration.count) == (2, 2, 0, 2)


async def test_idle_plain_steps_run_in_the_callers_task_and_are_counted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_engine() as engine:
        # q: a model of the same kind whose requests queue (its scheduler could reorder
        # them), for the counters to compare.
        await load(
            engine,
            *(model(name) for name in "abc"),
            model("q", scheduler="priority"),
            chain("a", "b", "c"),
        )
        caller = _current_task()
        out = await engine.infer("p", {"IN": X})
        np.testing.assert_array_equal(out["OUT"], X + 3)
        assert Probe.tasks == {"a": [caller], "b": [caller], "c": [caller]}
        await engine.infer("q", {"x": X})
        assert Probe.tasks["q"] != [caller]
        stats = engine.statistics().models
        for name in ("a", "b", "c", "q"):
            s = stats[name]
            assert (s.succeeded, s.failed, s.cancelled, s.expired, s.in_flight) == (1, 0, 0, 0, 0)
            assert (s.executions, s.replicas[0].executions, s.replicas[0].failures) == (1, 1, 0)
            counts = [h.count for h in (s.queue_duration, s.compute_duration, s.request_duration)]
            assert [*counts, s.batch_size.count, s.batch_size.sum] == [1, 1, 1, 1, 1]
        assert stats["p"].succeeded == 1


async def test_a_busy_step_model_queues_the_step_as_before(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_engine() as engine:
        await load(engine, model("slow", parameters={"name": "slow", "delay": 1.0}))
        await engine.load(chain("slow"))
        await two_callers_in_turn(engine)
        # Idle again: the next one runs in its caller's task.
        await engine.infer("p", {"IN": X})
        assert Probe.tasks["slow"][-1] == _current_task()


@pytest.mark.parametrize(
    ("options", "engine_options"),
    [
        ({"batcher": "dynamic", "batcher_options": {"max_queue_delay": 0.001}}, {}),
        ({"scheduler": "priority"}, {}),
        ({"fallback": "resilient"}, {}),
        ({"response_cache": True}, {"cache_size": 1 << 20}),
        ({"queue_timeouts": {0: 5.0}}, {}),
        ({}, {"device_limits": {"cpu": 1}}),
        pytest.param({}, {"tracer_provider": "sdk"}, marks=pytest.mark.tracing),
    ],
    ids=["batcher", "scheduler", "fallback", "cache", "queue_timeouts", "device_limit", "tracing"],
)
async def test_a_step_model_that_does_more_than_pass_a_request_through_queues_it(
    autojump_clock: trio.testing.MockClock,
    options: dict[str, Any],
    engine_options: dict[str, Any],
) -> None:
    if engine_options.get("tracer_provider") == "sdk":
        from opentelemetry.sdk.trace import TracerProvider  # the otel extra, as test_tracing

        engine_options = {"tracer_provider": TracerProvider()}
    async with open_engine(**engine_options) as engine:
        await load(engine, model("m", **options), chain("m"))
        out = await engine.infer("p", {"IN": X})
        np.testing.assert_array_equal(out["OUT"], X + 1)
        assert Probe.tasks["m"] != [_current_task()]
        assert engine.statistics().models["m"].executions == 1


async def test_a_caller_cancelled_mid_step_stops_the_step_and_the_rest(
    autojump_clock: trio.testing.MockClock,
) -> None:
    slow = model("b", parameters={"name": "b", "delay": 1.0})
    async with open_engine() as engine:
        await load(engine, model("a"), slow, model("c"), chain("a", "b", "c"))
        with pytest.raises(trio.TooSlowError):
            with trio.fail_after(0.5):
                await engine.infer("p", {"IN": X})
        assert Probe.events == ["a start", "a end", "b start", "b cancelled"]
        caller = _current_task()
        assert Probe.tasks["b"] == [caller]
        stats = engine.statistics().models
        b = stats["b"]
        assert (b.cancelled, b.succeeded, b.failed, b.in_flight, b.executions) == (1, 0, 0, 0, 1)
        assert b.replicas[0].failures == 0  # a cancelled run is no failure
        assert "c" not in Probe.tasks
        assert stats["p"].cancelled == 1
        # The instance was given back: the next step runs here again, and ends.
        Probe.events.clear()
        with trio.fail_after(10):
            await engine.infer("p", {"IN": X})
        assert Probe.tasks["b"] == [caller, caller]
        assert Probe.events[-1] == "c end"


async def test_a_failing_step_ends_the_request_once_naming_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    broken = model("b", parameters={"name": "b", "fail": True})
    async with open_engine() as engine:
        await load(engine, model("a"), broken, model("c"), chain("a", "b", "c"))
        with pytest.raises(BackendError) as info:
            await engine.infer("p", {"IN": X})
        message = str(info.value)
        assert message.startswith("pipeline 'p', step 1 (model 'b'): ")
        assert message.count("b is broken") == 1
        assert Probe.tasks["b"] == [_current_task()]
        assert "c" not in Probe.tasks
        stats = engine.statistics().models
        b = stats["b"]
        assert (b.failed, b.succeeded, b.cancelled, b.in_flight) == (1, 0, 0, 0)
        assert (b.executions, b.replicas[0].failures, b.compute_duration.count) == (1, 1, 1)
        assert (stats["p"].failed, stats["p"].in_flight) == (1, 0)


async def test_a_step_past_its_deadline_is_never_computed(
    autojump_clock: trio.testing.MockClock, still_slice: None
) -> None:
    # The first step runs inline and moves the clock past the caller's deadline
    # without a checkpoint: the second must not run, and the caller's scope reports it.
    Jump.clock = autojump_clock
    jump = model("jump", Jump, parameters={"by": 2.0}, backend_options={"dispatch": "inline"})
    async with open_engine() as engine:
        await load(engine, jump, model("b"), chain("jump", "b"))
        with pytest.raises(trio.TooSlowError):
            with trio.fail_after(1.0):
                await engine.infer("p", {"IN": X})
        assert "b" not in Probe.tasks
        stats = engine.statistics().models
        assert stats["jump"].succeeded == 1
        b = stats["b"]
        assert (b.expired, b.executions, b.in_flight, b.succeeded) == (1, 0, 0, 0)


async def test_a_pipelines_queue_timeout_bounds_a_caller_that_set_no_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The pipeline's queue_timeouts give its request a deadline; its steps (this
    # one in the caller's task) are cancelled there, and it expires.
    slow = model("slow", parameters={"name": "slow", "delay": 5.0})
    async with open_engine() as engine:
        await load(engine, slow, attrs.evolve(chain("slow"), queue_timeouts={0: 1.0}))
        start = trio.current_time()
        with pytest.raises(trioinfer.DeadlineExceeded, match="reached its deadline"):
            await engine.infer("p", {"IN": X})
        assert trio.current_time() - start == pytest.approx(1.0)
        assert Probe.events == ["slow start", "slow cancelled"]
        assert Probe.tasks["slow"] == [_current_task()]
        p = engine.statistics().models["p"]
        assert (p.expired, p.failed, p.cancelled, p.in_flight) == (1, 0, 0, 0)
        # A caller's own deadline is its own scope's to report.
        with pytest.raises(trio.TooSlowError):
            with trio.fail_after(0.5):
                await engine.infer("p", {"IN": X})
        assert engine.statistics().models["p"].cancelled == 1


async def test_unloading_a_step_model_cancels_a_step_running_in_a_callers_task(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The execution is not the model's worker's, but the model owns it all the same:
    # past the drain period it is cancelled before its instance closes, as a queued
    # request's would be, and the request ends once, EngineClosed.
    async with open_engine(drain_period=0.5) as engine:
        await load(engine, model("slow", parameters={"name": "slow", "delay": 30.0}))
        await engine.load(chain("slow"))
        outcome: list[BaseException] = []

        async def call() -> None:
            try:
                await engine.infer("p", {"IN": X})
            except EngineClosed as exc:
                outcome.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            await trio.testing.wait_all_tasks_blocked()
            assert Probe.events == ["slow start"]
            start = trio.current_time()
            await engine.unload("slow")
            assert Probe.events == ["slow start", "slow cancelled", "slow close"]
            assert trio.current_time() - start == pytest.approx(0.5)
        (error,) = outcome
        assert str(error).startswith("pipeline 'p', step 0 (model 'slow'): ")
        assert engine.statistics().models["p"].failed == 1


@pytest.mark.parametrize("how", ["unload", "replace"])
async def test_a_step_model_unloaded_or_replaced_takes_no_step_while_it_drains(
    autojump_clock: trio.testing.MockClock, how: str
) -> None:
    # The old model finishes what it accepted (one instance busy) with its other
    # instance idle; a pipeline's step goes where engine.infer sends it now: nowhere
    # (unloaded), or the new model (here one that queues its requests).
    two = (trioinfer.Instance(count=2),)
    old = model("a", parameters={"name": "old", "delay": 1.0}, instances=two)
    async with open_engine(drain_period=10.0) as engine:
        await load(engine, old, chain("a"))
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.infer, "a", {"x": X})
            await trio.testing.wait_all_tasks_blocked()
            if how == "unload":
                tg.start_soon(engine.unload, "a")
                await trio.testing.wait_all_tasks_blocked()
                with pytest.raises(trioinfer.ModelNotFound) as info:
                    await engine.infer("p", {"IN": X})
                assert str(info.value).startswith("pipeline 'p', step 0 (model 'a'): ")
            else:
                new = model("a", parameters={"name": "new"}, queue_timeouts={0: 5.0})
                tg.start_soon(lambda: engine.load(new, replace=True))
                # The new model's class loads on a thread, which wait_all_tasks_blocked
                # does not wait for: spin, no virtual time passing, until it serves.
                while engine.model("a").config.backend_options["parameters"]["name"] != "new":
                    await trio.lowlevel.checkpoint()
                out = await engine.infer("p", {"IN": X})
                np.testing.assert_array_equal(out["OUT"], X + 1)
                assert len(Probe.tasks["new"]) == 1
            assert "old end" not in Probe.events  # still draining, and the step ran elsewhere
        assert len(Probe.tasks["old"]) == 1


async def test_leaving_the_engine_cancels_a_step_running_in_an_outer_task(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Nothing outlives the engine, not even work running in a task it does not own.
    outcome: list[BaseException] = []
    async with trio.open_nursery() as outer:
        async with open_engine(drain_period=0.5) as engine:
            await load(engine, model("slow", parameters={"name": "slow", "delay": 30.0}))
            await engine.load(chain("slow"))

            async def call() -> None:
                try:
                    await engine.infer("p", {"IN": X})
                except EngineClosed as exc:
                    outcome.append(exc)

            outer.start_soon(call)
            await trio.testing.wait_all_tasks_blocked()
            start = trio.current_time()
        assert Probe.events == ["slow start", "slow cancelled", "slow close"]
        assert trio.current_time() - start == pytest.approx(0.5)
    assert len(outcome) == 1


def test_idle_plain_steps_run_in_the_callers_task_on_asyncio() -> None:
    async def main() -> None:
        async with open_engine() as engine:
            await load(engine, model("a"), model("b"), chain("a", "b"))
            with anyio.fail_after(10):
                out = await engine.infer("p", {"IN": X})
            np.testing.assert_array_equal(out["OUT"], X + 2)
            assert Probe.tasks == {"a": [_current_task()], "b": [_current_task()]}
            stats = engine.statistics().models
            assert [stats[m].succeeded for m in "ab"] == [1, 1]
            assert [stats[m].in_flight for m in "ab"] == [0, 0]

    anyio.run(main, backend="asyncio")


def _counts(s: trioinfer.ModelStatistics) -> tuple[object, ...]:
    # Everything a request's way through a model counts, but how long it took.
    return (
        s.succeeded, s.failed, s.cancelled, s.expired, s.refused, s.in_flight, s.queued,
        s.executions, s.replicas[0].executions, s.replicas[0].failures,
        s.queue_duration.counts, s.compute_duration.count, s.request_duration.count,
        sum(s.compute_duration.counts), sum(s.request_duration.counts),
        s.batch_size.counts, s.batch_size.count, s.batch_size.sum,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("step", "scopes"),
    [
        (inline("a"), 0),  # never suspends: nothing can stop its model mid-run
        (model("a"), 1),  # async def infer
        (model("a", Sync, parameters={"name": "a"}), 1),  # def infer on a thread
    ],
    ids=["inline", "async", "thread"],
)
async def test_a_step_on_an_inline_model_needs_no_cancel_scope_and_is_counted_alike(
    autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
    step: ModelConfig,
    scopes: int,
) -> None:
    async with open_engine() as engine:
        options = {**step.backend_options, "parameters": {"name": "q"}}
        queued = attrs.evolve(step, name="q", backend_options=options)
        await load(engine, step, queued, chain("a"))
        made: list[object] = []
        for where in (trio, anyio):
            real = where.CancelScope

            def counting(*args: Any, real: Any = real, **kw: Any) -> Any:
                made.append(real)
                return real(*args, **kw)

            monkeypatch.setattr(where, "CancelScope", counting)
        rows = np.ones((3, 4), np.float32)  # three rows: counted as three, not one
        out = await engine.infer("p", {"IN": rows})
        monkeypatch.undo()
        np.testing.assert_array_equal(out["OUT"], rows + 1)
        assert len(made) == scopes
        if scopes == 0:
            assert Probe.tasks["a"] == [_current_task()]
        # Counted as a request queued to a model of the same kind is.
        await engine.infer("q", {"x": rows})
        stats = engine.statistics().models
        assert _counts(stats["a"]) == _counts(stats["q"])
        assert (stats["a"].succeeded, stats["a"].batch_size.sum) == (1, 3)


async def test_an_inline_steps_time_is_counted_as_its_compute_and_request_durations(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The step runs 0.3 s (the mock clock, moved on inside the model) and never queues.
    Jump.clock = autojump_clock
    jump = model("jump", Jump, parameters={"by": 0.3}, backend_options={"dispatch": "inline"})
    async with open_engine() as engine:
        await load(engine, jump, chain("jump"))
        await engine.infer("p", {"IN": X})
        await engine.infer("p", {"IN": X})
        s = engine.statistics().models["jump"]
        bucket = next(i for i, bound in enumerate(s.compute_duration.bounds) if bound >= 0.3)
        for durations in (s.compute_duration, s.request_duration):
            assert (durations.count, durations.sum) == (2, pytest.approx(0.6))
            assert durations.counts[bucket] == 2
        assert (s.queue_duration.count, s.queue_duration.sum, s.queue_duration.counts[0]) == (
            2, 0.0, 2
        )  # fmt: skip
        assert s.mean_execution_s == pytest.approx(0.3)
        assert (s.executions, s.succeeded) == (2, 2)


@pytest.mark.parametrize(
    ("fail", "error"), [("InvalidInput", trioinfer.InvalidInput), ("RuntimeError", BackendError)]
)
async def test_a_failing_inline_step_ends_the_request_once_naming_it_and_is_counted(
    autojump_clock: trio.testing.MockClock, fail: str, error: type[Exception]
) -> None:
    async with open_engine() as engine:
        await load(engine, inline("a"), inline("b", fail=fail), inline("c"))
        await load(engine, inline("q", fail=fail), chain("a", "b", "c"))
        with pytest.raises(error) as info:
            await engine.infer("p", {"IN": X})
        message = str(info.value)
        assert message.startswith("pipeline 'p', step 1 (model 'b'): ")
        assert message.count("b ") == 1  # the model's own words, once
        assert type(info.value) is error  # a client's fault stays the client's
        assert Probe.tasks["b"] == [_current_task()]
        assert "c" not in Probe.tasks
        with pytest.raises(error):
            await engine.infer("q", {"x": X})
        stats = engine.statistics().models
        assert _counts(stats["b"]) == _counts(stats["q"])
        assert (stats["b"].failed, stats["b"].replicas[0].failures) == (1, 1)
        assert (stats["p"].failed, stats["p"].in_flight) == (1, 0)
        # The instance was given back: the next request runs here again.
        with pytest.raises(error):
            await engine.infer("p", {"IN": X})
        assert Probe.tasks["b"] == [_current_task()] * 2


async def test_an_instance_that_says_it_runs_inline_but_suspends_is_carried_on(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # It broke its word (trioinfer.abc.InlineInstance): its execution goes on as any
    # run in its caller's task: it holds the instance (the next request queues) and
    # is counted once.
    monkeypatch.setattr(PythonInstance, "runs_inline", property(lambda self: True))
    async with open_engine() as engine:
        await load(engine, model("slow", parameters={"name": "slow", "delay": 1.0}), chain("slow"))
        await two_callers_in_turn(
            engine, lambda out: np.testing.assert_array_equal(out["OUT"], X + 1)
        )
        s = engine.statistics().models["slow"]
        assert s.compute_duration.sum == pytest.approx(2.0)


def test_inline_steps_run_in_the_callers_task_on_asyncio() -> None:
    async def main() -> None:
        async with open_engine() as engine:
            await load(engine, inline("a"), inline("b", fail="RuntimeError"), chain("a"))
            await engine.load(chain("a", "b", name="p2"))
            with anyio.fail_after(10):
                out = await engine.infer("p", {"IN": X})
                np.testing.assert_array_equal(out["OUT"], X + 1)
                with pytest.raises(BackendError, match=r"^pipeline 'p2', step 1 "):
                    await engine.infer("p2", {"IN": X})
            assert Probe.tasks == {"a": [_current_task()] * 2, "b": [_current_task()]}
            stats = engine.statistics().models
            assert [(stats[m].succeeded, stats[m].failed) for m in "ab"] == [(2, 0), (0, 1)]
            assert [stats[m].in_flight for m in "ab"] == [0, 0]

    anyio.run(main, backend="asyncio")


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_a_caller_leaving_a_step_that_broke_its_word_cancels_it(
    monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    # The cancellation reaches the model through the run carried on by hand
    # (Trio sends it in, asyncio throws it in), and the step is counted once.
    monkeypatch.setattr(PythonInstance, "runs_inline", property(lambda self: True))

    async def main() -> None:
        async with open_engine() as engine:
            await load(engine, model("slow", parameters={"name": "slow", "delay": 60.0}))
            await engine.load(chain("slow"))
            async with anyio.create_task_group() as tg:
                tg.start_soon(engine.infer, "p", {"IN": X})
                with anyio.fail_after(10):
                    await anyio.wait_all_tasks_blocked()
                assert Probe.events == ["slow start"]
                tg.cancel_scope.cancel()
            assert Probe.events == ["slow start", "slow cancelled"]
            stats = engine.statistics().models
            s = stats["slow"]
            assert (s.cancelled, s.succeeded, s.executions, s.in_flight) == (1, 0, 1, 0)
            assert stats["p"].cancelled == 1

    anyio.run(main, backend=backend)


def _onnx_chain(add_model: Any) -> tuple[ModelConfig, ModelConfig]:
    # The add model (sum = a + b) run inline on the loop, and a pipeline of it: OUT = 2 IN.
    # A budget (0.1 s) no run comes near, even on a loaded machine: it stays inline
    # (a run over ten budgets would move it to its thread for good).
    options = {"dispatch": "inline", "inline_budget_us": 100_000}
    add = ModelConfig(name="add", path=add_model, backend_options=options)
    tensor = {"dtype": "float32", "shape": ["batch", 4]}
    steps = {
        "inputs": [{"name": "IN", **tensor}],
        "outputs": [{"name": "OUT", **tensor}],
        "steps": [
            {"model": "add", "input_map": {"a": "IN", "b": "IN"}, "output_map": {"sum": "OUT"}}
        ],
    }
    return add, ModelConfig(name="p", path="-", backend="pipeline", backend_options=steps)


@pytest.mark.parametrize("spent", [True, False], ids=["slice-spent", "slice-fresh"])
async def test_an_inline_onnx_step_yields_before_it_claims_its_instance(
    add_model: Any, monkeypatch: pytest.MonkeyPatch, spent: bool
) -> None:
    # ONNX Runtime's inline run yields once the loop's inline slice is spent. Were
    # it to yield in its execute, it would hold the instance meanwhile, and callers
    # arriving then would queue (and the queue, at load, seldom empties). The
    # pipeline yields first, holding nothing: every step runs in its caller's task,
    # and the loop is still given its turn once per slice, no more.
    import trioinfer._inline

    wall = iter(range(10**9)) if spent else iter(())
    # Spent: each reading is a second (ten budgets) after the last. Fresh: time stands still.
    monkeypatch.setattr(trioinfer._inline, "_wall", lambda: float(next(wall, 0)))
    monkeypatch.setattr(trioinfer._inline._slice, "start", -1.0 if spent else 0.0)
    queued: list[str] = []
    admit = trioinfer._runner.ModelRunner.admit

    def counting(self: Any, request: Any) -> None:
        queued.append(self.config.name)
        admit(self, request)

    monkeypatch.setattr(trioinfer._runner.ModelRunner, "admit", counting)
    async with open_engine() as engine:
        await load(engine, *_onnx_chain(add_model))
        with counting_steps() as yields:
            for _ in range(3):
                out = await engine.infer("p", {"IN": X})
                np.testing.assert_array_equal(out["OUT"], 2 * X)
        assert yields.count == (3 if spent else 0)  # once per step when spent, not twice

        async def caller() -> None:
            for _ in range(5):
                out = await engine.infer("p", {"IN": X})
                np.testing.assert_array_equal(out["OUT"], 2 * X)

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                for _ in range(8):
                    nursery.start_soon(caller)
        assert queued == []  # each step ran on the idle instance in its caller's task
        s = engine.statistics().models["add"]
        assert (s.succeeded, s.executions, s.in_flight, s.queue_duration.count) == (43, 43, 0, 43)


@pytest.mark.parametrize("budget", [0.5, 1], ids=["float", "int"])
def test_an_inline_budget_in_whole_seconds_is_a_budget_too(
    monkeypatch: pytest.MonkeyPatch, budget: float
) -> None:
    # A third-party InlineInstance may give its budget as an int: it must be
    # honoured as a float one is, or its pipeline steps never yield to the loop.
    import types

    import trioinfer._inline

    monkeypatch.setattr(trioinfer._inline, "_wall", lambda: 10.0)
    monkeypatch.setattr(trioinfer._inline._slice, "start", 0.0)
    monkeypatch.setattr(trioinfer._inline._slice, "granted", False)
    instance = types.SimpleNamespace(runs_inline=True, inline_budget_s=budget)
    replica = types.SimpleNamespace(_backend_instance=instance)
    spent = trioinfer._runner.ModelRunner.slice_spent
    assert spent(None, replica) is True  # type: ignore[arg-type]
    instance.inline_budget_s = True  # not a number of seconds: the engine's own slice
    assert spent(None, replica) is True  # type: ignore[arg-type]
    monkeypatch.setattr(trioinfer._inline, "_wall", lambda: 1e-4)  # 100 µs into the slice
    assert spent(None, replica) is False  # type: ignore[arg-type]


async def test_callers_of_a_pipeline_of_inline_steps_leave_the_loop_its_turns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every step of such a pipeline runs in its caller's task and never queues, so
    # nothing in a request parks, and a plain def infer run inline never yields (it
    # keeps no inline slice of its own, unlike ONNX Runtime's inline runs): the
    # pipeline yields before such a step once the engine's slice is spent. Callers
    # looping on the pipeline must not keep the rest of the program from running
    # until they stop.
    import trioinfer._inline

    wall = iter(range(10**9))  # every reading a second after the last: each slice spent
    monkeypatch.setattr(trioinfer._inline, "_wall", lambda: float(next(wall)))
    monkeypatch.setattr(trioinfer._inline._slice, "start", -1.0)
    monkeypatch.setattr(trioinfer._inline._slice, "granted", False)
    async with open_engine() as engine:
        await load(engine, inline("a"), inline("b"), chain("a", "b"))
        done = 0

        async def caller() -> None:
            nonlocal done
            for _ in range(50):
                out = await engine.infer("p", {"IN": X})
                np.testing.assert_array_equal(out["OUT"], X + 2)
                done += 1

        seen = []
        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(caller)
            while done < 200:
                await trio.lowlevel.checkpoint()
                seen.append(done)
        # This task ran between the callers' requests, not only after the last of them.
        assert any(0 < n < 200 for n in seen), seen
        s = engine.statistics().models["a"]
        assert (s.succeeded, s.queue_duration.count) == (200, 200)  # none of them queued


class Elapses:
    """y = x + 1, with a second of the inline slice's clock passing while it runs."""

    now: ClassVar[list[float]] = [0.0]

    def infer(self, inputs: Arrays) -> Arrays:
        Elapses.now[0] += 1.0
        return {"y": inputs["x"] + 1}


@pytest.fixture
def elapses_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """The inline slice's wall clock is `Elapses`' (10 s, moved on by its runs), the slice fresh."""
    import trioinfer._inline

    Elapses.now[0] = 10.0
    monkeypatch.setattr(trioinfer._inline, "_wall", lambda: Elapses.now[0])
    monkeypatch.setattr(trioinfer._inline._slice, "start", 10.0)
    monkeypatch.setattr(trioinfer._inline._slice, "granted", False)


async def test_a_step_that_waited_for_its_answer_restarts_the_inline_slice(
    elapses_clock: None,
) -> None:
    # A step that queued parks its caller's task: the loop has had its turns, so
    # the inline step after it must not yield again for a slice that only looks
    # spent because time passed while the task was parked.
    queued = model(
        "q",
        Elapses,
        parameters={},
        batcher="dynamic",
        batcher_options={"max_batch_size": 4, "max_queue_delay": 0.0},
    )
    async with open_engine() as engine:
        await load(engine, inline("a"), queued, inline("b"), chain("a", "q", "b"))
        with counting_steps() as steps:
            out = await engine.infer("p", {"IN": X})
        np.testing.assert_array_equal(out["OUT"], X + 3)
        assert Elapses.now[0] == 11.0  # the queued step ran once, a second passing
        assert steps.count == 1  # resumed once: when q answered, not again before b


async def test_a_slice_spent_mid_chain_yields_once_and_goes_on_from_that_step(
    elapses_clock: None,
) -> None:
    # engine.infer runs an unbatched pipeline's chain of inline steps as plain calls
    # (Pipeline.run_now); when the slice is spent before a later step, it yields and
    # goes on from that step: the steps before it are not run again.
    first = model("a", Elapses, parameters={}, backend_options={"dispatch": "inline"})
    async with open_engine() as engine:
        await load(engine, first, inline("b"), inline("c"), chain("a", "b", "c"))
        with counting_steps() as steps:
            out = await engine.infer("p", {"IN": X})
        np.testing.assert_array_equal(out["OUT"], X + 3)
        assert Elapses.now[0] == 11.0  # "a" ran once (its second spent the slice)
        assert steps.count == 1  # one yield: before "b", none before "c"
        assert Probe.tasks == {"b": [_current_task()], "c": [_current_task()]}
        stats = engine.statistics().models
        assert [stats[m].succeeded for m in ("a", "b", "c", "p")] == [1, 1, 1, 1]
        assert stats["p"].request_duration.count == 1


async def test_a_slice_spent_again_after_the_yield_yields_again_and_runs_each_step_once(
    elapses_clock: None,
) -> None:
    # "a" and "b" each spend the slice: the request yields before "b" and again
    # before "c" (Pipeline.run_after_yield goes round), each step running once,
    # the request counted once.
    first = model("a", Elapses, parameters={}, backend_options={"dispatch": "inline"})
    second = model("b", Elapses, parameters={}, backend_options={"dispatch": "inline"})
    async with open_engine() as engine:
        await load(engine, first, second, inline("c"), chain("a", "b", "c"))
        with counting_steps() as steps:
            out = await engine.infer("p", {"IN": X})
        np.testing.assert_array_equal(out["OUT"], X + 3)
        assert Elapses.now[0] == 12.0  # "a" and "b" ran once each
        assert steps.count == 2  # a yield before "b", one before "c"
        stats = engine.statistics().models
        assert [stats[m].succeeded for m in ("a", "b", "c", "p")] == [1, 1, 1, 1]
        assert (stats["p"].request_duration.count, stats["p"].in_flight) == (1, 0)


def test_a_slice_spent_mid_chain_goes_on_after_the_yield_on_asyncio_too(
    elapses_clock: None,
) -> None:
    # run_after_yield yields with the loop's own checkpoint (LoopClock.checkpoint):
    # anyio's on asyncio. The request answers once, each step run once.
    first = model("a", Elapses, parameters={}, backend_options={"dispatch": "inline"})
    second = model("b", Elapses, parameters={}, backend_options={"dispatch": "inline"})

    async def main() -> tuple[np.ndarray[Any, Any], list[int]]:
        async with open_engine() as engine:
            await load(engine, first, second, inline("c"), chain("a", "b", "c"))
            out = await engine.infer("p", {"IN": X})
            stats = engine.statistics().models
            return out["OUT"], [stats[m].succeeded for m in ("a", "b", "c", "p")]

    out, succeeded = anyio.run(main, backend="asyncio")
    np.testing.assert_array_equal(out, X + 3)
    assert succeeded == [1, 1, 1, 1]
    assert Elapses.now[0] == 12.0


@pytest.mark.parametrize("meanwhile", ["nothing", "cancelled", "drained", "unloaded"])
async def test_a_request_waiting_for_the_slice_mid_chain_is_in_flight_and_ends_once(
    meanwhile: str, elapses_clock: None
) -> None:
    # When the slice is spent before a later step, engine.infer yields with no
    # request object of its own (Pipeline.run_after_yield) and goes on from that
    # step. Meanwhile the request is in flight: an unload drains it (it answers)
    # or, with no drain period, ends it with EngineClosed; a caller cancelled
    # meanwhile ends cancelled. Each way it is counted once, and the step after
    # the yield runs only if it answers.
    first = model("a", Elapses, parameters={}, backend_options={"dispatch": "inline"})
    async with open_engine(drain_period=0.0 if meanwhile == "unloaded" else 10.0) as engine:
        await load(engine, first, inline("b"), chain("a", "b"))
        pipeline = engine._pipes["p"]
        events: list[str] = []

        async with trio.open_nursery() as nursery:

            async def unload() -> None:
                await engine.unload("p")
                events.append("unloaded")

            async def yield_meanwhile() -> None:
                # The pipeline's yield for the slice, with the test's doings in it.
                events.append(f"yields, in flight {pipeline.statistics().in_flight}")
                if meanwhile == "cancelled":
                    scope.cancel()
                elif meanwhile != "nothing":
                    nursery.start_soon(unload)
                    await trio.testing.wait_all_tasks_blocked()  # draining, or stopping
                await trio.lowlevel.checkpoint()

            pipeline.clock.checkpoint = yield_meanwhile
            with trio.CancelScope() as scope:
                try:
                    out = await engine.infer("p", {"IN": X})
                except EngineClosed as exc:
                    events.append(f"EngineClosed: {exc}")
                else:
                    np.testing.assert_array_equal(out["OUT"], X + 2)
                    events.append("answered")
            if scope.cancelled_caught:
                events.append("cancelled")
        s = pipeline.statistics()
        counts = (s.succeeded, s.failed, s.cancelled, s.in_flight)
    closed = "EngineClosed: pipeline 'p' was unloaded or the engine closed before a request's"
    assert events[0] == "yields, in flight 1"
    assert [e[: len(closed)] for e in events[1:]] == {
        "nothing": ["answered"],
        "cancelled": ["cancelled"],
        "drained": ["answered", "unloaded"],
        "unloaded": [closed, "unloaded"],
    }[meanwhile]
    expected = {
        "nothing": (1, 0, 0, 0),
        "cancelled": (0, 0, 1, 0),
        "drained": (1, 0, 0, 0),
        "unloaded": (0, 1, 0, 0),
    }
    assert counts == expected[meanwhile]  # (succeeded, failed, cancelled, in flight)
    assert Elapses.now[0] == 11.0  # "a" ran once
    assert ("b" in Probe.tasks) == (meanwhile in ("nothing", "drained"))


@pytest.mark.parametrize("scenario", ["ok", "bad input", "cancelled", "full", "expired", "failing"])
async def test_infer_takes_a_pipelines_request_as_infer_detailed_does(
    scenario: str, autojump_clock: trio.testing.MockClock, still_slice: None
) -> None:
    # engine.infer takes an unbatched pipeline's request in its own frame (straight
    # to Pipeline.call); infer_detailed through _submit: both must end it alike and
    # count it alike, in the pipeline's statistics and its steps'.
    Jump.clock = autojump_clock

    async def run(detailed: bool) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
        steps = [inline("a", fail="RuntimeError" if scenario == "failing" else ""), model("b")]
        if scenario == "expired":
            steps[0] = model(
                "a", Jump, parameters={"by": 2.0}, backend_options={"dispatch": "inline"}
            )
        p = chain("a", "b")
        if scenario == "full":
            # The first caller holds its place in "b" (5 s a run) while the second comes.
            steps[1] = model("b", parameters={"name": "b", "delay": 5.0})
            p = attrs.evolve(p, max_queue_size=1)
        async with open_engine() as engine:
            await load(engine, *steps, p)
            call = engine.infer_detailed if detailed else engine.infer
            inputs = {"IN": X.astype(np.float64)} if scenario == "bad input" else {"IN": X}
            outcome = "ok"
            try:
                with trio.fail_after(1.0) as scope:
                    if scenario == "cancelled":
                        scope.cancel()
                    if scenario == "full":
                        async with trio.open_nursery() as nursery:
                            nursery.start_soon(call, "p", {"IN": X})
                            await trio.testing.wait_all_tasks_blocked()
                            await call("p", inputs)
                    else:
                        await call("p", inputs)
            except trioinfer.TrioInferError as exc:
                outcome = f"{type(exc).__name__}: {exc}"
            except trio.TooSlowError:
                outcome = "too slow"
            except BaseException as exc:  # (an exception group around QueueFull)
                outcome = repr(exc)
            if scenario == "cancelled":
                outcome = f"cancelled: {scope.cancelled_caught}"
            stats = engine.statistics().models
            s = stats["p"]
            counts = (s.succeeded, s.failed, s.cancelled, s.refused, s.expired, s.in_flight)
            steps_counts = tuple(
                n
                for m in ("a", "b")
                for n in (stats[m].succeeded, stats[m].failed, stats[m].expired)
            )
            return outcome, counts, steps_counts

    Probe.tasks.clear()
    fast = await run(detailed=False)
    Probe.tasks.clear()
    slow = await run(detailed=True)
    assert fast == slow
    expected = {
        "ok": "ok",
        "bad input": "InvalidInput",
        "cancelled": "cancelled: True",
        "full": "QueueFull",
        "expired": "too slow",
        "failing": "BackendError: pipeline 'p', step 0 (model 'a')",
    }[scenario]
    assert fast[0].startswith(expected) or expected in fast[0]


class Renamed:
    """A plain ``def infer`` that answers ``z`` where the step's output map reads ``y``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def infer(self, inputs: Arrays) -> Arrays:
        return {"z": inputs["x"] + 1}


async def test_a_step_run_as_a_plain_call_whose_model_lost_the_output_fails_clearly() -> None:
    # Pipeline.run_now keeps a plain call's outputs itself: a model replaced by one
    # without the mapped output fails the step there with the output named, and counts.
    async with open_engine() as engine:
        await load(engine, inline("a"), inline("b"), chain("a", "b"))
        renamed = model(
            "a",
            Renamed,
            backend_options={"dispatch": "inline", "outputs": [{**OUT[0], "name": "z"}]},
        )
        await engine.load(renamed, replace=True)
        with pytest.raises(BackendError, match=r"step 0 \(model 'a'\): .*without outputs \['y'\]"):
            await engine.infer("p", {"IN": X})
        stats = engine.statistics().models
        assert (stats["p"].failed, stats["a"].succeeded, stats["b"].succeeded) == (1, 1, 0)
