"""Callers parked on Trio's fast path are woken by the runner's own reschedule, KI-protected."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import trio
import trio.lowlevel
import trio.testing

import trioinfer._runner
from trioinfer import BackendError, ModelConfig, open_engine
from trioinfer._threads import WOKEN, trio_rescheduler
from trioinfer.testing import FakeBackend

X = np.ones((1, 4), dtype=np.float32)


def parker(parked: list[trio.lowlevel.Task], woken: list[object]) -> Callable[[], Any]:
    """A task body that parks in wait_task_rescheduled: its task to *parked*, then what woke it."""

    async def park() -> None:
        parked.append(trio.lowlevel.current_task())
        woken.append(
            await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.SUCCEEDED)
        )

    return park


async def test_trio_rescheduler_wakes_a_parked_task() -> None:
    reschedule = trio_rescheduler()
    # On this Trio, the running runner's own method, not the public wrapper.
    assert reschedule is not trio.lowlevel.reschedule
    parked: list[trio.lowlevel.Task] = []
    woken: list[object] = []
    park = parker(parked, woken)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(park)
        await trio.testing.wait_all_tasks_blocked()
        assert not woken
        reschedule(parked[0])
    assert woken == [None]


def test_trio_rescheduler_outside_trio_is_the_public_function() -> None:
    assert trio_rescheduler() is trio.lowlevel.reschedule


@pytest.mark.parametrize(
    ("batcher", "callers", "error"),
    [
        ("none", 1, None),  # _succeed, one request
        ("dynamic", 4, None),  # _succeed, a batch
        ("none", 1, RuntimeError("boom")),  # finish() -> _end
    ],
)
async def test_parked_callers_are_rescheduled_under_ki_protection(
    monkeypatch: pytest.MonkeyPatch, batcher: str, callers: int, error: Exception | None
) -> None:
    # Trio protects its public reschedule from KeyboardInterrupt, not the runner
    # method the engine calls instead: the engine's frames that call it must be.
    protected: list[bool] = []
    real = trio_rescheduler

    def recording() -> Callable[..., object]:
        reschedule = real()

        def wrapped(task: Any, *outcome: Any) -> object:
            protected.append(trio.lowlevel.currently_ki_protected())
            return reschedule(task, *outcome)

        return wrapped

    monkeypatch.setattr(trioinfer._runner, "trio_rescheduler", recording)
    backend = FakeBackend(delay=0.01)
    backend.error = error
    options = {"max_batch_size": 8, "max_queue_delay": 0.005} if batcher == "dynamic" else {}
    config = ModelConfig(
        name="m",
        path="unused.onnx",  # type: ignore[arg-type]
        backend="fake",
        batcher=batcher,
        batcher_options=options,
    )

    async def call() -> None:
        if error is None:
            await engine.infer("m", {"x": X})
        else:
            with pytest.raises(BackendError):
                await engine.infer("m", {"x": X})

    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(config)
        async with trio.open_nursery() as nursery:
            for _ in range(callers):
                nursery.start_soon(call)
    assert protected == [True] * callers


async def test_woken_wakes_parked_tasks_with_none_any_number_of_times() -> None:
    # One shared outcome for every wake-up, unlike Trio's single-use Value(None):
    # each parked task, public wait_task_rescheduled or the engine's park, gets None.
    reschedule = trio_rescheduler()
    parked: list[trio.lowlevel.Task] = []
    woken: list[object] = []
    park = parker(parked, woken)

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(park)
        await trio.testing.wait_all_tasks_blocked()
        for task in parked:
            reschedule(task, WOKEN)
    assert woken == [None, None, None]
    assert WOKEN.unwrap() is None  # and again: it never becomes "already used"


async def test_many_callers_of_one_batch_each_get_their_own_outputs() -> None:
    # Every caller of a batch is woken with the same WOKEN; each must still
    # return its own share (the outputs travel in the request, not the outcome).
    backend = FakeBackend(delay=0.01)  # y = 2 x
    config = ModelConfig(
        name="m",
        path="unused.onnx",  # type: ignore[arg-type]
        backend="fake",
        batcher="dynamic",
        batcher_options={"max_batch_size": 16, "max_queue_delay": 0.005},
    )
    results: dict[int, float] = {}

    async def call(k: int) -> None:
        out = await engine.infer("m", {"x": np.full((1, 4), k, np.float32)})
        results[k] = float(out["y"][0, 0])

    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(config)
        async with trio.open_nursery() as nursery:
            for k in range(12):
                nursery.start_soon(call, k)
    assert results == {k: 2.0 * k for k in range(12)}
