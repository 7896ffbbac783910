"""Properties of the dynamic batcher under random arrivals, sizes, shapes and budgets."""

from __future__ import annotations

import math

import attrs
import numpy as np
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

import trioinfer
import trioinfer.lowlevel
from trioinfer import Instance, ModelConfig, ModelSignature, TensorSpec, open_engine
from trioinfer.testing import FakeBackend

F32 = np.dtype(np.float32)
SIGNATURE = ModelSignature(
    inputs=(TensorSpec("x", F32, ("batch", "n"), "tensor(float)"),),
    outputs=(TensorSpec("y", F32, ("batch", "n"), "tensor(float)"),),
)
# Every dimension but the batch fixed: the queue is uniform, and the batcher
# fills batches with take_nowait() instead of comparing shapes request by request.
FIXED = ModelSignature(
    inputs=(TensorSpec("x", F32, ("batch", 4), "tensor(float)"),),
    outputs=(TensorSpec("y", F32, ("batch", 4), "tensor(float)"),),
)


@attrs.frozen
class Call:
    gap: float  # seconds after the previous call started
    rows: int
    width: int
    budget: float  # the caller's own move_on_after


@attrs.frozen
class Scenario:
    max_batch_size: int
    max_queue_delay: float
    preferred: tuple[int, ...]
    instances: int
    execution_s: float
    calls: tuple[Call, ...]
    uniform: bool = False  # the FIXED signature, every request 4 wide


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    max_batch_size = draw(st.integers(1, 8))
    preferred = draw(st.lists(st.integers(1, max_batch_size), unique=True, max_size=3))
    uniform = draw(st.booleans())
    calls = st.builds(
        Call,
        gap=st.sampled_from([0.0, 0.0, 0.0625, 0.25, 1.0]),
        rows=st.integers(1, 10),
        width=st.sampled_from([4] if uniform else [4, 4, 4, 8]),
        budget=st.sampled_from([math.inf, math.inf, 0.125, 0.5, 2.0]),
    )
    return Scenario(
        max_batch_size=max_batch_size,
        max_queue_delay=draw(st.sampled_from([0.0, 0.125, 0.5])),
        preferred=tuple(sorted(preferred)),
        instances=draw(st.integers(1, 2)),
        execution_s=draw(st.sampled_from([0.0, 0.25, 1.0])),
        calls=tuple(draw(st.lists(calls, max_size=25))),
        uniform=uniform,
    )


@attrs.define
class Execution:
    start: float
    ids: list[int]
    rows: int
    widths: set[int]


class RecordingFallback:
    """Runs every batch unchanged and records, as it starts, what is in it."""

    def __init__(self) -> None:
        self.executions: list[Execution] = []

    async def execute(self, execution: trioinfer.lowlevel.Execution) -> None:
        requests = execution.requests
        self.executions.append(
            Execution(
                start=trio.current_time(),
                ids=[int(r.id) for r in requests],
                rows=sum(r.rows for r in requests),
                widths={r.inputs["x"].shape[1] for r in requests},
            )
        )
        await execution.run()


@settings(max_examples=80, deadline=None)
@given(scenarios())
def test_dynamic_batcher_invariants(scenario: Scenario) -> None:
    signature = FIXED if scenario.uniform else SIGNATURE
    backend = FakeBackend(signature=signature, delay=scenario.execution_s)
    fallback = RecordingFallback()
    registry = trioinfer.Registry(
        extra={"backends": {"fake": lambda: backend}, "fallbacks": {"rec": lambda: fallback}}
    )
    arrivals: dict[int, float] = {}
    outcomes: dict[int, str] = {}

    async def caller(engine: trioinfer.Engine, i: int, call: Call) -> None:
        x = np.full((call.rows, call.width), i, np.float32)
        with trio.move_on_after(call.budget):
            arrivals[i] = trio.current_time()
            out = await engine.infer("m", {"x": x}, request_id=str(i))
            assert i not in outcomes
            np.testing.assert_array_equal(out["y"], 2 * x)  # its own rows, and only those
            outcomes[i] = "ok"
        outcomes.setdefault(i, "cancelled")

    async def main() -> None:
        async with open_engine(registry=registry) as engine:
            await engine.load(
                ModelConfig(
                    name="m",
                    path="-",
                    backend="fake",
                    fallback="rec",
                    batcher="dynamic",
                    batcher_options={
                        "max_batch_size": scenario.max_batch_size,
                        "max_queue_delay": scenario.max_queue_delay,
                        "preferred_batch_sizes": list(scenario.preferred),
                    },
                    instances=[Instance(count=scenario.instances)],
                )
            )
            assert engine._runners["m"].queue.uniform == scenario.uniform  # type: ignore[union-attr]
            async with trio.open_nursery() as nursery:
                for i, call in enumerate(scenario.calls):
                    await trio.sleep(call.gap)
                    nursery.start_soon(caller, engine, i, call)
                    await trio.testing.wait_all_tasks_blocked()
            stats = engine.statistics().models["m"]
            assert stats.in_flight == stats.queued == 0

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))

    # Every caller ended exactly once.
    assert sorted(outcomes) == list(range(len(scenario.calls)))
    executions = fallback.executions
    sent = [i for execution in executions for i in execution.ids]
    # Nothing sent twice; everything answered was sent; in the scheduler's (FIFO) order.
    assert sent == sorted(set(sent))
    assert {i for i, outcome in outcomes.items() if outcome == "ok"} <= set(sent)
    for execution in executions:
        # Never more than max_batch_size rows, except a single bigger request alone.
        assert execution.rows <= scenario.max_batch_size or len(execution.ids) == 1
        assert len(execution.widths) == 1  # only compatible requests share a batch
    if scenario.instances == 1:
        # Once the instance is free, no request waits longer than max_queue_delay.
        free_at = -math.inf
        for execution in executions:
            oldest = min(arrivals[i] for i in execution.ids)
            assert execution.start <= max(free_at, oldest + scenario.max_queue_delay)
            free_at = execution.start + scenario.execution_s
