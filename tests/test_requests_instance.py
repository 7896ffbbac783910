"""The ``RequestsInstance`` hook: an instance that takes an execution's requests as they came.

(Triton's Python backend's ``execute(requests)`` runs on it: tests/test_triton_python.py.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import trio
import trio.lowlevel
import trio.testing

import trioinfer
from trioinfer import BackendError, ConfigError, InvalidInput, SequenceFlags
from trioinfer.abc import RequestsInstance
from trioinfer.lowlevel import Request
from trioinfer_batching import SequenceBatcher

SIGNATURE = trioinfer.ModelSignature(
    (
        trioinfer.TensorSpec("x", np.dtype(np.float32), ("batch", 1), "tensor(float)"),
        trioinfer.TensorSpec(
            "extra", np.dtype(np.float32), ("batch", 1), "tensor(float)", optional=True
        ),
    ),
    (trioinfer.TensorSpec("y", np.dtype(np.float32), ("batch", 1), "tensor(float)"),),
)


class PerRequest:
    """Answers x * 2 per request; x 13 is that request's InvalidInput; x 7: a misfit answer;
    x 99: the whole call raises; x 42: one answer too few."""

    signature = SIGNATURE
    device = "cpu"

    def __init__(self) -> None:
        self.calls: list[list[tuple[str, int, tuple[str, ...]]]] = []
        self.executed = 0

    async def execute(self, inputs: Any) -> dict[str, Any]:
        # What no request made (a probe, a warm-up sample) comes here.
        self.executed += 1
        return {"y": inputs["x"] * 2}

    async def execute_requests(self, requests: Sequence[Request]) -> list[Any]:
        await trio.lowlevel.checkpoint()
        self.calls.append([(r.id, r.rows, tuple(sorted(r.inputs))) for r in requests])
        xs = [float(r.inputs["x"][0, 0]) for r in requests]
        if 99 in xs:
            raise RuntimeError("the whole call broke")
        answers: list[Any] = []
        for request, x in zip(requests, xs, strict=True):
            if x == 13:
                answers.append(InvalidInput("13 is refused"))
            elif x == 7:
                answers.append({"y": np.zeros((5, 1), np.float32)})
            else:
                answers.append({"y": request.inputs["x"] * 2})
        return answers[:-1] if 42 in xs else answers

    async def aclose(self) -> None:
        pass


def engine_with(instance: PerRequest, **options: Any) -> tuple[trioinfer.Registry, Any]:
    class Backend:
        async def load(self, config: Any, placement: Any) -> PerRequest:
            return instance

    registry = trioinfer.Registry(extra={"backends": {"b": Backend}})
    config = trioinfer.ModelConfig(name="m", path="none", backend="b", **options)
    return registry, config


BATCHED = {"batcher": "dynamic", "batcher_options": {"max_batch_size": 8, "max_queue_delay": 1.0}}


async def test_each_request_gets_its_own_answer_or_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    instance = PerRequest()
    assert isinstance(instance, RequestsInstance)
    registry, config = engine_with(instance, **BATCHED)
    results: dict[str, Any] = {}
    async with trioinfer.open_engine(registry=registry) as engine:
        await engine.load(config)

        async def one(name: str, x: float, rows: int, extra: bool = False) -> None:
            inputs = {"x": np.full((rows, 1), x, np.float32)}
            if extra:  # requests that send different optional inputs share the execution
                inputs["extra"] = np.zeros((rows, 1), np.float32)
            try:
                results[name] = await engine.infer("m", inputs, request_id=name)
            except trioinfer.TrioInferError as exc:
                results[name] = exc

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, "a", 1, 2)
            nursery.start_soon(one, "b", 13, 1)
            nursery.start_soon(one, "c", 3, 1, True)
            nursery.start_soon(one, "d", 7, 1)
        stats = engine.statistics().models["m"]
    entries = sorted(entry for call in instance.calls for entry in call)
    assert entries == [
        ("a", 2, ("x",)),
        ("b", 1, ("x",)),
        ("c", 1, ("extra", "x")),
        ("d", 1, ("x",)),
    ]
    assert max(len(call) for call in instance.calls) > 1  # (c sent other inputs: apart)
    assert results["a"]["y"].tolist() == [[2.0], [2.0]]
    assert results["c"]["y"].tolist() == [[6.0]]
    assert isinstance(results["b"], InvalidInput)
    assert "13 is refused" in str(results["b"])
    assert isinstance(results["d"], BackendError)
    assert "'y'" in str(results["d"])
    assert stats.failed == 2
    assert stats.succeeded == 2
    assert instance.executed == 0


async def test_a_call_that_raises_or_answers_too_few_fails_them_all(
    autojump_clock: trio.testing.MockClock,
) -> None:
    instance = PerRequest()
    registry, config = engine_with(instance, **BATCHED)
    async with trioinfer.open_engine(registry=registry) as engine:
        await engine.load(config)
        errors: dict[float, list[BaseException]] = {99: [], 42: []}

        async def one(x: float, batch: float) -> None:
            try:
                await engine.infer("m", {"x": np.full((1, 1), x, np.float32)})
            except BackendError as exc:
                errors[batch].append(exc)

        for x in errors:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, x, x)
                nursery.start_soon(one, 1, x)
    for x, said in ((99, "the whole call broke"), (42, "answered 1 for 2 requests")):
        assert len(errors[x]) == 2
        assert all(said in str(error) for error in errors[x])


async def test_an_unbatched_model_runs_each_request_alone() -> None:
    instance = PerRequest()
    registry, config = engine_with(instance)
    async with trioinfer.open_engine(registry=registry) as engine:
        await engine.load(config)
        out = await engine.infer("m", {"x": np.ones((3, 1), np.float32)}, request_id="r")
        with pytest.raises(InvalidInput, match="13 is refused"):
            await engine.infer("m", {"x": np.full((1, 1), 13, np.float32)})
    assert out["y"].tolist() == [[2.0]] * 3
    assert instance.calls[0] == [("r", 3, ("x",))]


async def test_an_assembling_batcher_is_refused_with_it() -> None:
    class Assembling:
        async def next_batch(self, queue: Any) -> list[Any]:
            await queue.wait_not_empty()
            return [queue.pop_nowait()]

        def assemble(self, requests: Any) -> Any:
            raise AssertionError("never called")

    instance = PerRequest()

    class Backend:
        async def load(self, config: Any, placement: Any) -> PerRequest:
            return instance

    registry = trioinfer.Registry(
        extra={"backends": {"b": Backend}, "batchers": {"assembling": Assembling}}
    )
    config = trioinfer.ModelConfig(name="m", path="none", backend="b", batcher="assembling")
    async with trioinfer.open_engine(registry=registry) as engine:
        with pytest.raises(ConfigError, match="take each request's own inputs"):
            await engine.load(config)


async def test_a_sequence_batcher_with_implicit_state_is_refused() -> None:
    # Its state comes from the batch's outputs, which execute_requests does not give.
    instance = PerRequest()
    sequence = {"state": [{"input": "extra", "output": "y", "shape": [1]}]}
    registry, config = engine_with(instance, batcher="sequence", sequence=sequence)
    async with trioinfer.open_engine(registry=registry) as engine:
        with pytest.raises(ConfigError, match="no batch outputs to keep implicit state from"):
            await engine.load(config)


@pytest.mark.tracing
async def test_a_traced_execution_of_requests(autojump_clock: trio.testing.MockClock) -> None:
    # Traced, the call is the batch's compute span, and each request still ends its own way.
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from _spans import named, provider_for

    exporter = InMemorySpanExporter()
    instance = PerRequest()
    registry, config = engine_with(instance, **BATCHED)
    results: dict[float, Any] = {}
    async with trioinfer.open_engine(
        registry=registry, tracer_provider=provider_for(exporter)
    ) as engine:
        await engine.load(config)

        async def one(x: float) -> None:
            try:
                results[x] = await engine.infer("m", {"x": np.full((1, 1), x, np.float32)})
            except InvalidInput as exc:
                results[x] = exc

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, 2)
            nursery.start_soon(one, 13)
    assert results[2]["y"].tolist() == [[4.0]]
    assert isinstance(results[13], InvalidInput)
    (compute,) = named(exporter.get_finished_spans(), "compute m")
    assert compute.attributes is not None
    assert [len(call) for call in instance.calls] == [2]


class Delegating:
    """The first-party sequence batcher behind the methods a third party's would have,
    counting the calls of assemble; with *computed* False, it has no computed()."""

    def __init__(self, computed: bool) -> None:
        self.inner = SequenceBatcher()
        self.assembled = 0
        if computed:
            self.computed = self.inner.computed

    @property
    def max_batch_size(self) -> int | None:
        return self.inner.max_batch_size

    def attach(self, context: Any) -> None:
        self.inner.attach(context)

    def admit(self, request: Request) -> None:
        self.inner.admit(request)

    def withdrawn(self, request: Request) -> None:
        self.inner.withdrawn(request)

    async def next_batch(self, queue: Any) -> Any:
        return await self.inner.next_batch(queue)

    async def next_batch_for(self, queue: Any, replica: Any, previous: Any) -> Any:
        return await self.inner.next_batch_for(queue, replica, previous)

    def assemble(self, requests: Sequence[Request]) -> Any:
        self.assembled += 1
        return self.inner.assemble(requests)


@pytest.mark.parametrize("computed", [True, False])
async def test_a_sequence_batcher_hears_what_was_computed_without_laying_out_inputs(
    computed: bool,
) -> None:
    # A sequence batcher laid out each batch's inputs (and controls) that such an
    # instance never reads, only to learn which requests were computed: one with
    # computed() is told so instead; one without still learns it through assemble.
    instance = PerRequest()
    batcher = Delegating(computed)

    class Backend:
        async def load(self, config: Any, placement: Any) -> PerRequest:
            return instance

    registry = trioinfer.Registry(
        extra={"backends": {"b": Backend}, "batchers": {"seq": lambda: batcher}}
    )
    config = trioinfer.ModelConfig(
        name="m",
        path="none",
        backend="b",
        batcher="seq",
        sequence={"max_batch_size": 4, "max_sequence_idle": 60.0},
    )

    async with trioinfer.open_engine(registry=registry) as engine:
        await engine.load(config)

        async def run(sequence_id: int) -> None:
            for i in range(3):
                x = np.full((1, 1), sequence_id + i, np.float32)
                flags = SequenceFlags(sequence_id, start=i == 0, end=i == 2)
                out = await engine.infer("m", {"x": x}, sequence=flags)
                np.testing.assert_array_equal(out["y"], x * 2)

        async with trio.open_nursery() as nursery:
            for sequence_id in (1, 2, 3):
                nursery.start_soon(run, sequence_id)
    assert sum(len(call) for call in instance.calls) == 9
    assert (batcher.assembled == 0) is computed
