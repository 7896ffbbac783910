"""A model's own task group for its backend (`trioinfer.lowlevel.current_model_tasks`).

A toy backend starts a task at load through it; the task is the model's: it
runs until the model's instances closed at its unload, is cancelled at the
engine's close, and what it raises is logged with the model's name. On Trio
and asyncio alike.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import anyio
import numpy as np
import pytest

from trioinfer import BackendError, ModelConfig, Registry, open_engine
from trioinfer.lowlevel import (
    Execution,
    FallbackContext,
    ModelTasks,
    Placement,
    current_model_tasks,
)
from trioinfer.testing import FakeBackend, FakeInstance, assert_no_tasks_left, check_backend

BACKENDS = pytest.mark.parametrize("backend", ["trio", "asyncio"])
X = {"x": np.ones((1, 4), np.float32)}


class Ticking(FakeBackend):
    """Starts one task per instance at load, in the model's task group."""

    def __init__(self, task: Callable[[Ticking, FakeInstance], Awaitable[object]]) -> None:
        super().__init__()
        self.task = task
        self.groups: list[ModelTasks] = []
        self.started = 0
        self.ended: list[tuple[str, bool]] = []  # (how, whether its instance was closed)
        self.fail_load = False

    async def load(self, config: ModelConfig, placement: Placement) -> FakeInstance:
        instance = await super().load(config, placement)
        group = current_model_tasks()
        self.groups.append(group)
        group.start_soon(self.task, self, instance)
        if self.fail_load:
            raise BackendError("the model file is broken")
        return instance


async def forever(backend: Ticking, instance: FakeInstance) -> None:
    backend.started += 1
    try:
        await anyio.sleep_forever()
    except anyio.get_cancelled_exc_class():
        backend.ended.append(("cancelled", instance.closed))
        raise


async def failing(backend: Ticking, instance: FakeInstance) -> None:
    backend.started += 1
    raise ValueError("the session's keep-alive broke")


def run(backend: str, main: Callable[[], Awaitable[None]]) -> None:
    anyio.run(main, backend=backend)


def registry(backend: FakeBackend) -> Registry:
    return Registry(extra={"backends": {"ticking": lambda: backend}})


def config(name: str = "m", count: int = 1, fallback: str = "none") -> ModelConfig:
    return ModelConfig.from_dict(
        {
            "name": name,
            "path": "-",
            "backend": "ticking",
            "fallback": fallback,
            "instances": [{"count": count}],
        }
    )


@BACKENDS
def test_a_backends_task_runs_until_its_model_is_unloaded(backend: str) -> None:
    ticking = Ticking(forever)

    async def main() -> None:
        with assert_no_tasks_left():
            async with open_engine(registry=registry(ticking)) as engine:
                await engine.load(config(count=2))
                for _ in range(10):
                    await anyio.lowlevel.checkpoint()
                assert ticking.started == 2
                await engine.infer("m", X)
                assert ticking.ended == []  # (it runs beside the model's work)
                await engine.unload("m")
                # Ended at the unload, after the instances it serves closed.
                assert ticking.ended == [("cancelled", True)] * 2
                assert [group.model for group in ticking.groups] == ["m", "m"]
                with pytest.raises(RuntimeError, match="'m' is unloaded"):
                    ticking.groups[0].start_soon(forever, ticking, ticking.loaded[0])

    run(backend, main)


@BACKENDS
def test_a_backends_task_is_cancelled_when_the_engine_closes(backend: str) -> None:
    ticking = Ticking(forever)

    async def main() -> None:
        with assert_no_tasks_left():
            async with open_engine(registry=registry(ticking)) as engine:
                await engine.load(config())
                await engine.infer("m", X)
            assert ticking.ended == [("cancelled", True)]

    run(backend, main)


@BACKENDS
def test_a_replaced_models_tasks_end_with_it(backend: str) -> None:
    ticking = Ticking(forever)

    async def main() -> None:
        async with open_engine(registry=registry(ticking)) as engine:
            await engine.load(config())
            await engine.load(config(), replace=True)
            assert ticking.ended == [("cancelled", True)]  # the old model's only
            assert ticking.groups[0] is not ticking.groups[1]
            await engine.infer("m", X)
        assert len(ticking.ended) == 2

    run(backend, main)


@BACKENDS
def test_a_failed_loads_tasks_are_cancelled(backend: str) -> None:
    ticking = Ticking(forever)
    ticking.fail_load = True

    async def main() -> None:
        with assert_no_tasks_left():
            async with open_engine(registry=registry(ticking)) as engine:
                with pytest.raises(BackendError, match="the model file is broken"):
                    await engine.load(config())
                assert [how for how, _ in ticking.ended] == ["cancelled"]
                ticking.fail_load = False
                await engine.load(config())  # the engine goes on
                await engine.infer("m", X)

    run(backend, main)


@BACKENDS
def test_a_backends_task_that_raises_is_logged_naming_the_model(
    backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    ticking = Ticking(failing)

    async def main() -> None:
        async with open_engine(registry=registry(ticking)) as engine:
            await engine.load(config("keeper"))
            for _ in range(10):
                await anyio.lowlevel.checkpoint()
            assert ticking.started == 1
            # The model, and the engine, go on.
            result = await engine.infer("keeper", X)
            assert np.array_equal(result["y"], 2 * X["x"])

    with caplog.at_level(logging.ERROR, logger="trioinfer"):
        run(backend, main)
    (record,) = [r for r in caplog.records if "backend task" in r.getMessage()]
    assert "model 'keeper'" in record.getMessage()
    assert "failing" in record.getMessage()
    assert record.exc_info is not None
    assert isinstance(record.exc_info[1], ValueError)


def test_the_models_tasks_are_only_known_in_a_load() -> None:
    with pytest.raises(RuntimeError, match=r"only known in a backend's load\(\)"):
        current_model_tasks()


def test_only_the_engine_makes_a_models_tasks() -> None:
    from trioinfer._model_tasks import ModelTasks as Concrete

    with pytest.raises(TypeError, match="no public constructor"):
        Concrete("m", None)


class Keeper:
    """A fallback that only runs executions, and keeps its context (to re-create with)."""

    context: FallbackContext

    def attach(self, context: FallbackContext) -> None:
        self.context = context

    async def execute(self, execution: Execution) -> None:
        await execution.run()


@BACKENDS
def test_a_recreated_instance_starts_its_tasks_in_the_same_group(backend: str) -> None:
    ticking = Ticking(forever)
    keeper = Keeper()
    both = Registry(
        extra={"backends": {"ticking": lambda: ticking}, "fallbacks": {"keeper": lambda: keeper}}
    )

    async def main() -> None:
        async with open_engine(registry=both) as engine:
            await engine.load(config(fallback="keeper"))
            await keeper.context.recreate(keeper.context.replicas[0])
            assert ticking.groups[0] is ticking.groups[1]
            await engine.infer("m", X)
            await engine.unload("m")
            # The first instance's task is the backend's to end with it; the model's
            # group ended them both at the unload.
            assert ticking.ended == [("cancelled", True)] * 2

    run(backend, main)


@BACKENDS
def test_check_backend_gives_the_load_a_models_tasks(backend: str) -> None:
    ticking = Ticking(forever)

    async def main() -> None:
        with assert_no_tasks_left():
            await check_backend(ticking, config(), X)
        assert ticking.ended == [("cancelled", True)]

    run(backend, main)


def test_check_backend_raises_what_the_check_found() -> None:
    # Not wrapped in an ExceptionGroup by the task group it opens for the model's tasks.
    ticking = Ticking(forever)
    ticking.fail_load = True

    async def main() -> None:
        with pytest.raises(BackendError, match="the model file is broken"):
            await check_backend(ticking, config(), X)

    run("trio", main)
