"""The engine's public API on both Trio and asyncio: the core is written against anyio."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import trioinfer
from trioinfer import Instance, ModelConfig, open_engine
from trioinfer.testing import FakeBackend

BACKENDS = ["trio", "asyncio"]


def run(backend: str, fn: object, *args: object) -> None:
    anyio.run(fn, *args, backend=backend)  # type: ignore[arg-type]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dispatch", ["thread", "ort_async"])
def test_infer_concurrently(backend: str, dispatch: str, add_model: Path) -> None:
    async def main() -> None:
        async with open_engine() as engine:
            await engine.load(
                ModelConfig(
                    name="add",
                    path=add_model,
                    instances=[Instance(count=2, threads=2)],
                    backend_options={"dispatch": dispatch},
                )
            )
            results: dict[int, np.ndarray] = {}

            async def one(i: int) -> None:
                a = np.full((1, 4), i, np.float32)
                with anyio.fail_after(10):
                    results[i] = (await engine.infer("add", {"a": a, "b": a}))["sum"]

            async with anyio.create_task_group() as tg:
                for i in range(100):
                    tg.start_soon(one, i)
            assert all(results[i][0, 0] == 2 * i for i in range(100))

    run(backend, main)
    assert not [t for t in threading.enumerate() if t.name.startswith("trioinfer-")]


@pytest.mark.parametrize("backend", BACKENDS)
def test_errors_cancellation_and_shutdown(backend: str, add_model: Path, slow_model: Path) -> None:
    async def main() -> None:
        async with open_engine(drain_period=0) as engine:
            await engine.load(ModelConfig(name="add", path=add_model))
            await engine.load(ModelConfig(name="slow", path=slow_model))
            x = np.ones((1, 4), np.float32)
            with pytest.raises(trioinfer.InvalidInput):
                await engine.infer("add", {"a": x})
            with pytest.raises(trioinfer.ModelNotFound):
                await engine.infer("nope", {"a": x, "b": x})
            big = np.ones((256, 512), np.float32)
            with anyio.move_on_after(0.05) as scope:
                await engine.infer("slow", {"x": big})
            assert scope.cancelled_caught
            stats = engine.statistics().models["slow"]
            assert (stats.cancelled, stats.succeeded) == (1, 0)
            await engine.unload("slow")
            assert [m.name for m in engine.models()] == ["add"]
        with pytest.raises(trioinfer.EngineClosed):
            await engine.infer("add", {"a": x, "b": x})

    run(backend, main)
    assert not [t for t in threading.enumerate() if t.name.startswith("trioinfer-")]


def test_on_asyncio_anyio_scopes_carry_the_deadline_and_asyncio_timeouts_only_cancel() -> None:
    """What the docs say about asyncio: only anyio's scopes tell the engine the deadline."""
    import asyncio

    from trioinfer.testing import FakeBackend
    from trioinfer_scheduling import FifoScheduler

    seen: list[float] = []

    class Recording(FifoScheduler):
        def push(self, request: trioinfer.Request) -> None:
            seen.append(request.deadline)
            super().push(request)

    backend = FakeBackend(delay=0.5)
    registry = trioinfer.Registry(
        extra={"backends": {"fake": lambda: backend}, "schedulers": {"rec": Recording}}
    )
    x = np.ones((1, 4), np.float32)

    async def main() -> None:
        async with open_engine(registry=registry) as engine:
            await engine.load(ModelConfig(name="m", path="-", backend="fake", scheduler="rec"))
            with anyio.move_on_after(0.05):
                await engine.infer("m", {"x": x})
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.05):
                    await engine.infer("m", {"x": x})
            # Cancelled all the same: the second request left its queue or execution.
            stats = engine.statistics().models["m"]
            assert (stats.cancelled, stats.in_flight) == (2, 0)

    anyio.run(main, backend="asyncio")
    assert seen[0] < float("inf")  # anyio's scope: the deadline travels with the request
    assert seen[1] == float("inf")  # asyncio.timeout: invisible to the engine


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_load_cancelled_as_its_instances_are_ready_closes_them(backend: str) -> None:
    # The caller's scope is cancelled just as the last instance finishes loading: on
    # asyncio the cancellation came at the end of the load's task group, with every
    # instance loaded, and those were left open (their threads running for good).
    class CancelAsLoaded(FakeBackend):
        scope: anyio.CancelScope | None = None

        async def load(self, config: ModelConfig, placement: Any) -> Any:
            instance = await super().load(config, placement)
            if placement.index == 1:
                assert self.scope is not None
                self.scope.cancel()  # the caller gives up as the instance is ready
            return instance

    fake = CancelAsLoaded()

    async def main() -> None:
        async with open_engine(registry=fake.registry()) as engine:
            with anyio.CancelScope() as fake.scope:
                await engine.load(
                    ModelConfig(
                        name="m", path="unused.onnx", backend="fake", instances=[Instance(count=2)]
                    )
                )
            assert fake.scope.cancelled_caught
            assert fake.open_instances == 0
            assert engine.models() == []

    run(backend, main)
