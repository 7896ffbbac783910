"""Whose fault each error is: the class says it, the HTTP layer maps it, nothing is swallowed."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import trio
import trio.lowlevel

import trioinfer
from trioinfer import ModelConfig, open_engine
from trioinfer.lowlevel import Execution, Placement, Request, RequestQueue
from trioinfer.server import status_for
from trioinfer.testing import FakeBackend

X = np.ones((1, 4), dtype=np.float32)


def config(**kw: Any) -> ModelConfig:
    return ModelConfig(name="m", path="unused.onnx", backend="fake", **kw)


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (trioinfer.ConfigError("a bad config"), 400),
        (trioinfer.PluginError("no batcher plugin named 'dynamc'"), 400),
        (trioinfer.PluginLoadError("x", group="g", name="n", distribution=None), 400),
        (trioinfer.PluginContractError("broke it", kind="batchers", plugin="b"), 500),
        (trioinfer.BackendError("device on fire"), 500),
        (trioinfer.InvalidInput("wrong shape"), 400),
    ],
)
def test_the_class_says_whose_fault_it_is(error: Exception, status: int) -> None:
    assert status_for(error) == status


def test_a_misnamed_plugin_is_a_configuration_error() -> None:
    assert issubclass(trioinfer.PluginError, trioinfer.ConfigError)
    assert issubclass(trioinfer.PluginLoadError, trioinfer.ConfigError)
    assert not issubclass(trioinfer.PluginContractError, trioinfer.ConfigError)


async def test_unknown_plugin_names_fail_the_load_as_configuration() -> None:
    async with open_engine(registry=FakeBackend().registry()) as engine:
        with pytest.raises(trioinfer.ConfigError, match="no batcher plugin named 'dynamc'"):
            await engine.load(config(batcher="dynamc"))


class DividesByZero:
    """A batcher whose assemble() has a bug."""

    async def next_batch(self, queue: RequestQueue) -> list[Request]:
        await queue.wait_not_empty()
        return [queue.pop_nowait()]

    def assemble(self, requests: Any) -> Any:
        return 1 // 0


async def test_a_broken_batcher_is_logged_with_its_name_and_fails_as_a_contract_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    registry = trioinfer.Registry(
        extra={"backends": {"fake": FakeBackend}, "batchers": {"zero": DividesByZero}}
    )
    async with open_engine(registry=registry) as engine:
        await engine.load(config(batcher="zero"))
        with pytest.raises(trioinfer.PluginContractError) as caught:
            await engine.infer("m", {"x": X})
    error = caught.value
    assert (error.kind, error.plugin) == ("batchers", "zero")
    assert isinstance(error.__cause__, ZeroDivisionError)
    assert status_for(error) == 500
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "batcher 'zero' of model 'm' broke its contract" in record.getMessage()
    assert "ZeroDivisionError" in record.getMessage()


async def test_a_fallback_that_answers_without_every_output_is_logged_with_its_name(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Careless:
        async def execute(self, execution: Execution) -> None:
            for request in execution.pending():
                execution.respond(request, {}, via="default")

    registry = trioinfer.Registry(
        extra={"backends": {"fake": FakeBackend}, "fallbacks": {"careless": Careless}}
    )
    async with open_engine(registry=registry) as engine:
        await engine.load(config(fallback="careless"))
        with pytest.raises(trioinfer.PluginContractError, match=r"without outputs \['y'\]"):
            await engine.infer("m", {"x": X})
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "fallback 'careless' of model 'm'" in record.getMessage()


async def test_a_scheduler_whose_push_fails_is_a_contract_error() -> None:
    class Refuses:
        def push(self, request: Request) -> None:
            raise KeyError(request.id)

        def peek(self) -> Request:
            raise IndexError

        def pop(self) -> Request:
            raise IndexError

        def remove(self, request: Request) -> bool:
            return False

        def __len__(self) -> int:
            return 0

    registry = trioinfer.Registry(
        extra={"backends": {"fake": FakeBackend}, "schedulers": {"refuses": Refuses}}
    )
    async with open_engine(registry=registry) as engine:
        await engine.load(config(scheduler="refuses"))
        with pytest.raises(trioinfer.PluginContractError, match=r"scheduler 'refuses'.*KeyError"):
            await engine.infer("m", {"x": X})
        assert engine.statistics().models["m"].refused == 1


async def test_a_batcher_that_raises_in_next_batch_fails_its_callers_naming_it() -> None:
    class Raises:
        async def next_batch(self, queue: RequestQueue) -> list[Request]:
            await queue.wait_not_empty()
            raise ZeroDivisionError("division by zero")

    registry = trioinfer.Registry(
        extra={"backends": {"fake": FakeBackend}, "batchers": {"raises": Raises}}
    )
    async with open_engine(registry=registry) as engine:
        await engine.load(config(batcher="raises"))
        # It raises again with the request still queued: the model goes out of service.
        with pytest.raises(trioinfer.PluginContractError, match=r"batcher 'raises'.*next_batch"):
            await engine.infer("m", {"x": X})
        with pytest.raises(trioinfer.PluginContractError, match=r"model 'm' is out of service"):
            await engine.infer("m", {"x": X})


class FailsOnSomeDevices(FakeBackend):
    async def load(self, config: ModelConfig, placement: Placement) -> Any:
        if placement.index > 0:
            raise trioinfer.BackendUnavailable(f"no GPU for instance {placement.index}")
        return await super().load(config, placement)


async def test_every_instance_load_failure_is_reported() -> None:
    backend = FailsOnSomeDevices()
    async with open_engine(registry=backend.registry()) as engine:
        with pytest.raises(trioinfer.BackendUnavailable) as caught:
            await engine.load(config(instances=[trioinfer.Instance(count=3)]))
    message = str(caught.value)
    assert "2 of 3 instances of model 'm' failed to load" in message
    assert "instance 1 (cpu): no GPU for instance 1" in message
    assert "instance 2 (cpu): no GPU for instance 2" in message
    group = caught.value.__cause__
    assert isinstance(group, ExceptionGroup)
    assert len(group.exceptions) == 2
    # The one that loaded was closed again.
    assert backend.open_instances == 0


class FailsAlike(FakeBackend):
    async def load(self, config: ModelConfig, placement: Placement) -> Any:
        raise trioinfer.BackendUnavailable("no ONNX Runtime here: install the cpu extra")


async def test_instances_that_fail_alike_are_reported_once() -> None:
    # Without ONNX Runtime every instance fails the same way: one entry, not one per instance.
    backend = FailsAlike()
    async with open_engine(registry=backend.registry()) as engine:
        with pytest.raises(trioinfer.BackendUnavailable) as caught:
            await engine.load(config(instances=[trioinfer.Instance(count=2)]))
    assert str(caught.value) == (
        "2 of 2 instances of model 'm' failed to load: "
        "instances 0, 1 (cpu): no ONNX Runtime here: install the cpu extra"
    )
    assert len(caught.value.__cause__.exceptions) == 2  # type: ignore[union-attr]


async def test_many_failed_instances_make_a_bounded_message() -> None:
    # Each reason names its instance, so none group: count = 100000 once made a 12 MB
    # message. Five reasons are named, then a count of the rest; all stay in the cause.
    backend = FailsOnSomeDevices()
    async with open_engine(registry=backend.registry()) as engine:
        with pytest.raises(trioinfer.BackendUnavailable) as caught:
            await engine.load(config(instances=[trioinfer.Instance(count=40)]))
    message = str(caught.value)
    assert message.startswith("39 of 40 instances of model 'm' failed to load: ")
    assert "instance 5 (cpu): no GPU for instance 5" in message
    assert "instance 6 " not in message
    assert message.endswith("; and 34 more, for 34 other reasons")
    assert len(caught.value.__cause__.exceptions) == 39  # type: ignore[union-attr]
    assert backend.open_instances == 0


async def test_many_instances_failing_alike_name_ten_numbers() -> None:
    backend = FailsAlike()
    async with open_engine(registry=backend.registry()) as engine:
        with pytest.raises(trioinfer.BackendUnavailable) as caught:
            await engine.load(config(instances=[trioinfer.Instance(count=12)]))
    assert str(caught.value) == (
        "12 of 12 instances of model 'm' failed to load: instances 0, 1, 2, 3, 4, 5, 6, 7, 8, "
        "9, ... (12 in all) (cpu): no ONNX Runtime here: install the cpu extra"
    )


async def test_a_failing_aclose_is_logged_with_the_instance(
    caplog: pytest.LogCaptureFixture,
) -> None:
    backend = FakeBackend()

    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(config(instances=[trioinfer.Instance(count=2)]))
        first = backend.loaded[0]

        async def broken_aclose() -> None:
            raise RuntimeError("session will not close")

        first.aclose = broken_aclose  # type: ignore[method-assign]
    [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert "model 'm': closing backend instance" in record.getMessage()
    assert repr(first) in record.getMessage()
    assert record.exc_info is not None
    assert isinstance(record.exc_info[1], RuntimeError)
    # The other instance was closed anyway.
    assert backend.loaded[1].closed


async def test_a_batcher_that_groups_for_an_unbatched_model_fails_that_batch_only() -> None:
    f32 = np.dtype(np.float32)
    fixed = trioinfer.ModelSignature(
        inputs=(trioinfer.TensorSpec("x", f32, (1, 4), "tensor(float)"),),
        outputs=(trioinfer.TensorSpec("y", f32, (1, 4), "tensor(float)"),),
    )

    class Pairs:
        async def next_batch(self, queue: RequestQueue) -> list[Request]:
            while len(queue) < 2:
                await queue.wait_not_empty()
                await trio.lowlevel.checkpoint()
            return [queue.pop_nowait(), queue.pop_nowait()]

    registry = trioinfer.Registry(
        extra={"backends": {"fake": lambda: FakeBackend(signature=fixed)}, "batchers": {"p": Pairs}}
    )
    outcomes: list[BaseException] = []

    async def call(engine: trioinfer.Engine) -> None:
        try:
            await engine.infer("m", {"x": X})
        except trioinfer.TrioInferError as exc:
            outcomes.append(exc)

    async with open_engine(registry=registry) as engine:
        await engine.load(config(batcher="p"))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(call, engine)
            nursery.start_soon(call, engine)
        assert [type(e) for e in outcomes] == [trioinfer.PluginContractError] * 2
        assert "grouped 2 requests, but the model has no batch dimension" in str(outcomes[0])
        assert outcomes[0] is not outcomes[1]  # each caller its own
        assert engine.statistics().models["m"].failed == 2
