"""A pipeline request accepted before the engine closes may finish its steps in the drain period.

Each step of a pipeline request is a request to the step's model, made while the
pipeline request runs: when the engine starts closing, the steps of requests it
accepted are still admitted (outside callers are refused), until the drain
period ends. As an ensemble's in-flight requests complete at Triton's shutdown.
"""

from __future__ import annotations

import math
import re
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import anyio
import numpy as np
import pytest
import sniffio
import trio
import trio.testing

import trioinfer
from trioinfer import EngineClosed, ModelConfig, ModelNotFound, open_engine

pytestmark = pytest.mark.pipeline

Arrays = dict[str, np.ndarray[Any, Any]]
X = np.ones((1, 4), np.float32)
BACKENDS = pytest.mark.parametrize("backend", ["trio", "asyncio"])
BATCHED = pytest.mark.parametrize("batched", [False, True], ids=["unbatched", "batched"])


class Gate:
    """Where the held step waits, made in the running event loop."""

    def __init__(self) -> None:
        self.entered = anyio.Event()
        self.release = anyio.Event()


class Held:
    """y = x + 1; with ``hold``, only once the test opens the gate. Logs calls and closes."""

    gate: ClassVar[Gate | None] = None
    log: ClassVar[list[str]] = []

    def __init__(self, name: str, hold: bool = False) -> None:
        self.name, self.hold = name, hold

    async def infer(self, inputs: Arrays) -> Arrays:
        Held.log.append(f"{self.name} runs")
        if self.hold:
            assert Held.gate is not None
            Held.gate.entered.set()
            try:
                await Held.gate.release.wait()
            except anyio.get_cancelled_exc_class():
                Held.log.append(f"{self.name} cancelled")
                raise
        return {"y": inputs["x"] + 1}

    def close(self) -> None:
        Held.log.append(f"{self.name} closed")


@pytest.fixture(autouse=True)
def _reset() -> None:
    Held.gate = None
    Held.log.clear()


def tensor(name: str) -> dict[str, Any]:
    return {"name": name, "dtype": "float32", "shape": ["batch", 4]}


def step_model(name: str, config: dict[str, Any] | None = None, **parameters: Any) -> ModelConfig:
    return ModelConfig(
        name=name,
        path="-",
        backend="python",
        backend_options={
            "class": Held,
            "parameters": {"name": name, **parameters},
            "inputs": [tensor("x")],
            "outputs": [tensor("y")],
        },
        **(config or {}),
    )


def pipeline(batched: bool) -> ModelConfig:
    batching: dict[str, Any] = {}
    if batched:
        batching = {
            "batcher": "dynamic",
            "batcher_options": {"max_batch_size": 8, "max_queue_delay": 0.001},
        }
    return ModelConfig(
        name="p",
        path="-",
        backend="pipeline",
        backend_options={
            "inputs": [tensor("IN")],
            "outputs": [tensor("OUT")],
            "steps": [
                {"model": "held", "input_map": {"x": "IN"}, "output_map": {"y": "A"}},
                {"model": "plus", "input_map": {"x": "A"}, "output_map": {"y": "OUT"}},
            ],
        },
        **batching,
    )


async def load(engine: trioinfer.Engine, batched: bool) -> None:
    await engine.load(step_model("held", hold=True))
    await engine.load(step_model("plus"))
    await engine.load(pipeline(batched))


async def drain_with_step_held(batched: bool, drain_period: float, release: bool) -> list[str]:
    """Exit the engine while a pipeline request's first step is held; what happened, in order.

    With *release*, the step is let go once the engine is closing (and has
    refused new requests to the pipeline and to its step models).
    """
    gate = Held.gate = Gate()

    async def call(engine: trioinfer.Engine) -> None:
        try:
            out = await engine.infer("p", {"IN": X})
        except EngineClosed:
            Held.log.append("p closed")
        else:
            np.testing.assert_array_equal(out["OUT"], X + 2)
            Held.log.append("p answered")

    async def release_once_closing(engine: trioinfer.Engine) -> None:
        await anyio.wait_all_tasks_blocked()
        assert engine.closing
        for model in ("plus", "p", "held"):
            with pytest.raises(EngineClosed, match="is closing"):
                await engine.infer(model, {"IN" if model == "p" else "x": X})
        gate.release.set()

    # (fail_after: a hang fails the test rather than the suite.)
    with anyio.fail_after(30):
        async with (
            anyio.create_task_group() as tg,
            open_engine(drain_period=drain_period) as engine,
        ):
            await load(engine, batched)
            tg.start_soon(call, engine)
            await gate.entered.wait()
            if release:
                tg.start_soon(release_once_closing, engine)
    return Held.log


@BACKENDS
@BATCHED
def test_a_pipeline_request_in_flight_at_exit_finishes_its_steps(
    backend: str, batched: bool
) -> None:
    log = anyio.run(drain_with_step_held, batched, 60.0, True, backend=backend)
    # Its second step ran while the engine drained, before any step model closed.
    assert log[:3] == ["held runs", "plus runs", "p answered"]
    assert sorted(log[3:]) == ["held closed", "plus closed"]


@BACKENDS
@BATCHED
def test_a_pipeline_request_the_drain_period_leaves_ends_closed_once(
    backend: str, batched: bool
) -> None:
    log = anyio.run(drain_with_step_held, batched, 0.0, False, backend=backend)
    # Cancelled in its first step; no step ran after it.
    assert "plus runs" not in log
    assert log.count("held runs") == 1
    assert log.count("held cancelled") == 1
    assert log.count("p closed") == 1
    assert "p answered" not in log


async def unload_with_step_held(batched: bool, model: str) -> list[str]:
    gate = Held.gate = Gate()

    async def call(engine: trioinfer.Engine) -> None:
        try:
            out = await engine.infer("p", {"IN": X})
        except (EngineClosed, ModelNotFound) as exc:
            Held.log.append(f"p {type(exc).__name__}")
        else:
            np.testing.assert_array_equal(out["OUT"], X + 2)
            Held.log.append("p answered")

    async def release_once_unloading() -> None:
        await anyio.wait_all_tasks_blocked()
        gate.release.set()

    with anyio.fail_after(30):
        async with open_engine(drain_period=60) as engine:
            await load(engine, batched)
            async with anyio.create_task_group() as tg:
                tg.start_soon(call, engine)
                await gate.entered.wait()
                tg.start_soon(release_once_unloading)
                await engine.unload(model)
                Held.log.append(f"{model} unloaded")
    return Held.log


@BACKENDS
@BATCHED
def test_unloading_a_pipeline_lets_its_requests_in_flight_finish(
    backend: str, batched: bool
) -> None:
    log = anyio.run(unload_with_step_held, batched, "p", backend=backend)
    assert log[:4] == ["held runs", "plus runs", "p answered", "p unloaded"]


@BACKENDS
@BATCHED
@pytest.mark.parametrize("how", ["unload", "replace"])
def test_a_pipeline_request_that_finishes_within_the_drain_period_answers(
    backend: str, batched: bool, how: str
) -> None:
    async def main() -> list[str]:
        gate = Held.gate = Gate()
        async with open_engine(drain_period=60) as engine:
            await load(engine, batched)
            async with anyio.create_task_group() as tg:

                async def call() -> None:
                    out = await engine.infer("p", {"IN": X})
                    np.testing.assert_array_equal(out["OUT"], X + 2)
                    Held.log.append("p answered")

                async def release_once_retiring() -> None:
                    await anyio.wait_all_tasks_blocked()
                    gate.release.set()

                tg.start_soon(call)
                await gate.entered.wait()
                tg.start_soon(release_once_retiring)
                await retire(engine, batched, how)
                Held.log.append("p retired")
        return Held.log

    log = anyio.run(main, backend=backend)
    assert log[:4] == ["held runs", "plus runs", "p answered", "p retired"]


# How the held step waits on its model: running alone in the pipeline request's own
# task (an idle model that passes a lone request straight through; a second request
# queues behind it), parked in its request while a worker runs it (a dynamic batcher),
# or the engine's general way (a model with a queue timeout is not a plain one).
WAITS = {
    "alone": {},
    "worker": {
        "batcher": "dynamic",
        "batcher_options": {"max_batch_size": 1, "max_queue_delay": 0.001},
    },
    "general": {"queue_timeouts": {0: 60.0}},
}
CUT_OFF = re.compile(r"model 'p' was unloaded or the engine closed before request '[^']+' ended")


async def retire(engine: trioinfer.Engine, batched: bool, how: str) -> None:
    if how == "unload":
        await engine.unload("p")
    else:
        await engine.load(pipeline(batched), replace=True)


async def retire_with_steps_held(
    batched: bool,
    how: str,
    wait: str,
    drain_period: float = 0.0,
    settle: Callable[[], Awaitable[object]] = anyio.wait_all_tasks_blocked,
    limit: float = 30.0,
) -> tuple[list[str], list[str], list[str], trioinfer.ModelStatistics, list[float]]:
    """Retire the pipeline while two requests' first steps wait on a step that never ends.

    Returns the log until it returned, the log after (the step let go meanwhile),
    the callers' errors, the held step model's statistics, and (on Trio) how long
    after the retiring began each caller had its error and the retiring returned. *settle*: waits
    until whatever would happen has (virtual time: a sleep). *limit*: seconds
    before a hang fails the test (none in virtual time: loading waits on a thread).
    """
    gate = Held.gate = Gate()
    errors: list[str] = []
    # (Trio: virtual time, when the callers had their errors and the retiring returned.)
    closed_at: list[float] = []
    start = 0.0

    async def call(engine: trioinfer.Engine) -> None:
        try:
            await engine.infer("p", {"IN": X})
        except EngineClosed as exc:
            errors.append(str(exc))
            Held.log.append("p closed")
            if backend_is_trio():
                closed_at.append(trio.current_time() - start)
        else:
            Held.log.append("p answered")

    with anyio.fail_after(limit):
        async with open_engine(drain_period=drain_period) as engine:
            await engine.load(step_model("held", WAITS[wait], hold=True))
            await engine.load(step_model("plus"))
            await engine.load(pipeline(batched))
            async with anyio.create_task_group() as tg:
                tg.start_soon(call, engine)
                tg.start_soon(call, engine)
                await gate.entered.wait()
                await settle()
                if backend_is_trio():
                    start = trio.current_time()
                await retire(engine, batched, how)
                Held.log.append("p retired")
                if backend_is_trio():
                    closed_at.append(trio.current_time() - start)
                before = list(Held.log)
                # Nothing of those requests runs any more, even with the step let go.
                gate.release.set()
                await settle()
                after = Held.log[len(before) :]
                tg.cancel_scope.cancel()  # (a caller still waiting fails the test, not hangs)
            stats = engine.statistics().models["held"]
    return before, after, errors, stats, closed_at


def backend_is_trio() -> bool:
    return sniffio.current_async_library() == "trio"


def check_cut_off(
    batched: bool,
    log: list[str],
    after: list[str],
    errors: list[str],
    stats: trioinfer.ModelStatistics,
) -> None:
    everything = log + after
    assert everything.count("p closed") == 2, everything
    assert "plus runs" not in everything
    assert "p answered" not in everything
    # Every run of the held step was aborted; nothing else ran after the pipeline
    # was retired. (A step on a worker of its model unwinds there, maybe after.)
    assert everything.count("held runs") == everything.count("held cancelled") >= 1
    assert set(after) <= {"held cancelled", "p closed"}
    if not batched:
        # An unbatched pipeline's requests run in their callers' tasks: they have
        # ended there, their callers have their errors, before the unload returns.
        # (A batched one's end in its runner, which wakes their callers.)
        assert log.count("p closed") == 2, log
    assert len(errors) == 2
    assert all(CUT_OFF.fullmatch(error) for error in errors), errors
    assert stats.in_flight == 0
    assert stats.succeeded == 0


@BACKENDS
@BATCHED
@pytest.mark.parametrize("how", ["unload", "replace"])
@pytest.mark.parametrize("wait", sorted(WAITS))
def test_retiring_a_pipeline_ends_its_requests_after_the_drain_period(
    backend: str, batched: bool, how: str, wait: str
) -> None:
    # As a model's runner ends its requests when it stops: EngineClosed, the same
    # words for a pipeline batched or not, and nothing of theirs runs afterwards.
    before, after, errors, stats, _ = anyio.run(
        retire_with_steps_held, batched, how, wait, backend=backend
    )
    check_cut_off(batched, before, after, errors, stats)


@BATCHED
@pytest.mark.parametrize("how", ["unload", "replace"])
async def test_retiring_a_pipeline_waits_the_drain_period_then_ends_its_requests(
    autojump_clock: trio.testing.MockClock, batched: bool, how: str
) -> None:
    async def settle() -> None:
        await trio.sleep(1)

    before, after, errors, stats, closed_at = await retire_with_steps_held(
        batched, how, "alone", 5.0, settle, math.inf
    )
    check_cut_off(batched, before, after, errors, stats)
    # The callers had their errors at the end of the drain period, and the retiring returned then.
    assert closed_at == [5.0, 5.0, 5.0]
