"""The engine's correctness guarantees at their edges.

- One caller never receives another's rows: a batched execution's outputs
  are split only when every output has the batch's rows; a model whose
  outputs have another first dimension runs each request alone.
- No row is computed for a caller who left, or whose deadline passed, before
  its attempt started: the check sits after every wait (an instance's slot
  during failover, a device limit).
- Per-priority queue bounds keep room for high-priority requests under overload.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import anyio
import numpy as np
import onnx
import pytest
import trio
import trio.testing
from onnx import TensorProto, helper

import trioinfer
from trioinfer import (
    BackendError,
    DeadlineExceeded,
    Instance,
    ModelConfig,
    ModelSignature,
    QueueFull,
    TensorSpec,
    open_engine,
)
from trioinfer.lowlevel import Placement
from trioinfer.testing import FakeBackend, check_backend

F32 = np.dtype(np.float32)
Arrays = Mapping[str, np.ndarray[Any, Any]]


def rows_of(value: float, n: int = 1) -> np.ndarray[Any, Any]:
    """*n* rows whose every element is *value*: the row says whose it is."""
    return np.full((n, 4), value, np.float32)


class Recorder:
    """A backend whose instances double ``x`` and record every row sent to them.

    Each instance has its own delay and may fail, so a test can make one
    instance busy and another broken. ``computed`` holds (instance index, the
    row's value) for every row that reached an instance's ``execute``.
    """

    def __init__(self, *, delays: Mapping[int, float] | None = None) -> None:
        self.delays = dict(delays or {})
        self.failing: set[int] = set()
        self.computed: list[tuple[int, float]] = []
        self.signature = FakeBackend().signature

    def registry(self) -> trioinfer.Registry:
        return trioinfer.Registry(extra={"backends": {"recorder": lambda: self}})

    async def load(self, config: ModelConfig, placement: Placement) -> RecorderInstance:
        await anyio.lowlevel.checkpoint()
        return RecorderInstance(self, placement.index)

    def rows_on(self, index: int) -> list[float]:
        return [value for i, value in self.computed if i == index]


class RecorderInstance:
    device = "cpu"

    def __init__(self, backend: Recorder, index: int) -> None:
        self._backend = backend
        self.index = index
        self.signature = backend.signature

    async def execute(self, inputs: Arrays) -> dict[str, np.ndarray[Any, Any]]:
        x = inputs["x"]
        self._backend.computed.extend((self.index, float(row[0])) for row in x)
        await anyio.sleep(self._backend.delays.get(self.index, 0.0))
        if self.index in self._backend.failing:
            raise BackendError(f"instance {self.index} is broken")
        return {"y": x * 2}

    async def aclose(self) -> None:
        pass


# -- outputs are split only when they fit -------------------------------------------


def write_reshape(path: Path, out_shape: list[Any]) -> Path:
    """x: float32[batch, 4] -> y = Reshape(x, [-1, 2]), y declared as *out_shape*."""
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["y"])],
        "reshape",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)],
        initializer=[helper.make_tensor("shape", TensorProto.INT64, [2], [-1, 2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def reshape_config(path: Path) -> ModelConfig:
    return ModelConfig(
        name="pairs",
        path=path,
        batcher="dynamic",
        batcher_options={"max_batch_size": 8, "max_queue_delay": 0.05},
    )


async def three_callers(engine: trioinfer.Engine, model: str) -> dict[int, object]:
    """Three callers at once, caller i sending one row of value i; what each got."""
    outcomes: dict[int, object] = {}

    async def call(i: int) -> None:
        try:
            outcomes[i] = (await engine.infer(model, {"x": rows_of(i)}))["y"]
        except trioinfer.TrioInferError as exc:
            outcomes[i] = exc

    async with anyio.create_task_group() as tg:
        for i in (1, 2, 3):
            tg.start_soon(call, i)
    return outcomes


async def test_a_model_whose_output_is_not_the_batch_runs_each_request_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """x[batch, 4] -> Reshape -> y[pairs, 2]: the signature says y cannot be cut by rows."""
    path = write_reshape(tmp_path / "pairs.onnx", ["pairs", 2])
    caplog.set_level(logging.WARNING, logger="trioinfer")
    async with open_engine() as engine:
        info = await engine.load(reshape_config(path))
        assert not info.signature.batched
        assert "output 'y' is float32[pairs, 2]" in str(info.signature.unbatched_reason)
        assert "'dynamic' batcher will not group requests" in caplog.text
        outcomes = await three_callers(engine, "pairs")
        stats = engine.statistics().models["pairs"]
    for i in (1, 2, 3):
        np.testing.assert_array_equal(outcomes[i], np.full((2, 2), i, np.float32))
    assert stats.executions == 3
    assert stats.batch_size.counts[0] == 3  # every execution held one request's row


async def test_outputs_whose_rows_do_not_match_the_batch_fail_every_member(
    tmp_path: Path,
) -> None:
    """y's first dimension is left open, so the model batches; run time refuses its outputs."""
    path = write_reshape(tmp_path / "open.onnx", [None, 2])
    async with open_engine() as engine:
        info = await engine.load(reshape_config(path))
        assert info.signature.batched
        outcomes = await three_callers(engine, "pairs")
        stats = engine.statistics().models["pairs"]
        # Alone too, whatever the load: a model fails the same way every time.
        with pytest.raises(BackendError, match=r"shape \[2, 2\] for a batch of 1 rows"):
            await engine.infer("pairs", {"x": rows_of(7)})
    for i in (1, 2, 3):
        error = outcomes[i]
        assert isinstance(error, BackendError), error
        assert "'pairs'" in str(error)
        assert "output 'y' with shape [6, 2] for a batch of 3 rows" in str(error)
    assert (stats.failed, stats.succeeded) == (3, 0)
    assert stats.replicas[0].failures == 1


@pytest.mark.parametrize(
    ("change", "shape"),
    [
        (lambda y: y[:-1], "[2, 4]"),  # one row too few: the last caller would get nothing
        (lambda y: np.concatenate([y, y[:1]]), "[4, 4]"),  # one too many: silently dropped
        (lambda y: y[0], "[4]"),  # a row where a batch was due
    ],
    ids=["short", "long", "unbatched"],
)
async def test_a_backend_returning_the_wrong_rows_fails_the_batch_and_the_breaker_sees_it(
    autojump_clock: trio.testing.MockClock, change: Any, shape: str
) -> None:
    backend = FakeBackend(lambda inputs: {"y": change(inputs["x"] * 2)}, delay=0.01)
    config = ModelConfig(
        name="m",
        path="-",
        backend="fake",
        batcher="dynamic",
        batcher_options={"max_batch_size": 3, "max_queue_delay": 0.01},
        fallback="resilient",
        fallback_options={"attempts": 1, "breaker": {"fail_max": 1}},
    )
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(config)
        outcomes = await three_callers(engine, "m")
        replica = engine.statistics().models["m"].replicas[0]
    assert backend.executions[0] == 3  # one batch of three (then the breaker's probes)
    for i in (1, 2, 3):
        assert isinstance(outcomes[i], BackendError), outcomes[i]
        assert f"returned output 'y' with shape {shape} for a batch of 3 rows" in str(outcomes[i])
    assert replica.failures == 1
    assert replica.state == "out"  # the breaker opened on it


# -- nothing computed for a caller that left or whose deadline passed --------------


async def test_a_failover_onto_a_busy_instance_never_starts_after_the_queue_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Instance 0 fails at once; instance 1 is busy for 1 s; the request may wait 0.2 s."""
    backend = Recorder(delays={1: 1.0})
    backend.failing.add(0)
    config = ModelConfig(
        name="m",
        path="-",
        backend="recorder",
        # Instance 1 has the higher capacity, so the long request goes there first.
        instances=[Instance(capacity=1.0), Instance(capacity=2.0)],
        fallback="resilient",
        fallback_options={"attempts": 2},
        queue_timeouts={1: 0.2},
    )
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(config)
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.infer, "m", {"x": rows_of(100)})
            await anyio.sleep(0.01)  # instance 1 now runs the long request
            assert backend.rows_on(1) == [100]
            t0 = anyio.current_time()
            with pytest.raises(DeadlineExceeded, match="nothing was computed"):
                await engine.infer("m", {"x": rows_of(7)}, priority=1)
            ended = anyio.current_time() - t0
        stats = engine.statistics().models["m"]
    assert backend.rows_on(0) == [7]  # the first attempt started in time, and failed
    assert backend.rows_on(1) == [100]  # the failover waited past 0.2 s: never sent
    assert ended == pytest.approx(0.99)  # it learned so when instance 1 became free
    assert stats.expired == 1


class CarelessRetry:
    """A fallback that retries after a backoff without looking at any deadline."""

    ran: ClassVar[list[bool]] = []

    async def execute(self, execution: trioinfer.Execution) -> None:
        try:
            await execution.run()
        except BackendError:
            await anyio.sleep(10)  # the request's 0.5 s queue timeout passes meanwhile
            CarelessRetry.ran.append(await execution.run())


async def test_a_retry_started_past_the_deadline_computes_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The engine's own check, right before the backend call, whatever the fallback does."""
    backend = Recorder()
    backend.failing.add(0)
    registry = trioinfer.Registry(
        extra={"backends": {"recorder": lambda: backend}, "fallbacks": {"careless": CarelessRetry}}
    )
    config = ModelConfig(
        name="m", path="-", backend="recorder", fallback="careless", queue_timeouts={0: 0.5}
    )
    CarelessRetry.ran = []
    async with open_engine(registry=registry) as engine:
        await engine.load(config)
        with pytest.raises(DeadlineExceeded, match="nothing was computed"):
            await engine.infer("m", {"x": rows_of(5)})
    assert backend.rows_on(0) == [5]  # the first attempt only
    assert CarelessRetry.ran == [False]  # the retry ran nothing, and says so


async def test_a_batch_whose_callers_all_expired_does_not_count_as_a_success(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Its breaker sees nothing: an execution that never ran says nothing of the instance."""
    backend = Recorder(delays={0: 1.0})
    config = ModelConfig(
        name="m",
        path="-",
        backend="recorder",
        instances=[Instance(capacity=2.0), Instance(capacity=1.0)],
        fallback="resilient",
        fallback_options={"attempts": 1, "breaker": {"fail_max": 2}},
        queue_timeouts={1: 0.5},
    )
    async with open_engine(registry=backend.registry(), device_limits={"cpu": 1}) as engine:
        await engine.load(config)

        async def on_instance_1(value: float, priority: int = 0) -> object:
            # Instance 0 (preferred) holds the device for 1 s; instance 1 takes the request.
            outcome: object = None
            async with anyio.create_task_group() as tg:
                tg.start_soon(engine.infer, "m", {"x": rows_of(100)})
                await anyio.sleep(0.05)
                try:
                    await engine.infer("m", {"x": rows_of(value)}, priority=priority)
                except trioinfer.TrioInferError as exc:
                    outcome = exc
            return outcome

        backend.failing.add(1)
        assert isinstance(await on_instance_1(9), BackendError)  # instance 1's first failure
        backend.failing.discard(1)
        # Expires while instance 1 waits for the device: nothing ran.
        assert isinstance(await on_instance_1(1, priority=1), DeadlineExceeded)
        # Had that empty batch counted as a success, one more failure would not open it.
        backend.failing.add(1)
        assert isinstance(await on_instance_1(2), BackendError)
        assert engine.statistics().models["m"].replicas[1].state == "out"


async def test_a_batch_waiting_for_its_device_drops_the_members_that_left_or_expired(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two instances share a device limited to one execution; one runs for 1 s.

    The other forms a batch of three and waits for the device. Meanwhile one
    caller gives up and another's queue timeout passes: only the third row is
    computed, and each caller is answered once.
    """
    backend = Recorder(delays={0: 1.0, 1: 0.01})
    config = ModelConfig(
        name="m",
        path="-",
        backend="recorder",
        instances=[Instance(capacity=2.0), Instance(capacity=1.0)],
        batcher="dynamic",
        batcher_options={"max_batch_size": 3, "max_queue_delay": 0.01},
        queue_timeouts={1: 0.5},
    )
    outcomes: dict[str, object] = {}

    async def call(name: str, value: float, priority: int = 0, give_up: float = math.inf) -> None:
        with anyio.move_on_after(give_up):
            try:
                outcomes[name] = (
                    await engine.infer("m", {"x": rows_of(value)}, priority=priority)
                )["y"]
            except trioinfer.TrioInferError as exc:
                outcomes[name] = exc
            return
        outcomes[name] = "gave up"

    async with open_engine(registry=backend.registry(), device_limits={"cpu": 1}) as engine:
        await engine.load(config)
        async with anyio.create_task_group() as tg:
            tg.start_soon(call, "long", 100)
            await anyio.sleep(0.05)  # instance 0 holds the device until 1.01
            tg.start_soon(call, "leaves", 1, 0, 0.3)
            tg.start_soon(call, "expires", 2, 1)
            tg.start_soon(call, "stays", 3)
        stats = engine.statistics().models["m"]
    assert backend.computed == [(0, 100), (1, 3)]
    assert outcomes["leaves"] == "gave up"
    assert isinstance(outcomes["expires"], DeadlineExceeded)
    np.testing.assert_array_equal(outcomes["stays"], rows_of(6))
    assert (stats.succeeded, stats.cancelled, stats.expired) == (2, 1, 1)
    assert stats.batch_size.sum == 2  # the long request's row, and the one that stayed


async def test_a_batch_whose_every_member_expired_while_waiting_never_runs(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = Recorder(delays={0: 1.0})
    config = ModelConfig(
        name="m",
        path="-",
        backend="recorder",
        instances=[Instance(capacity=2.0), Instance(capacity=1.0)],
        queue_timeouts={1: 0.5},
    )
    async with open_engine(registry=backend.registry(), device_limits={"cpu": 1}) as engine:
        await engine.load(config)
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.infer, "m", {"x": rows_of(100)})
            await anyio.sleep(0.05)
            with pytest.raises(DeadlineExceeded):
                await engine.infer("m", {"x": rows_of(1)}, priority=1)
        assert engine.statistics().models["m"].executions == 1
    assert backend.computed == [(0, 100)]


# -- admission by priority ---------------------------------------------------------


async def test_queue_sizes_keep_room_for_higher_priorities_under_overload(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FakeBackend(delay=1.0)
    config = ModelConfig(
        name="m",
        path="-",
        backend="fake",
        scheduler="priority",
        max_queue_size=10,
        queue_sizes={0: 6},
    )
    outcomes: dict[tuple[int, int], object] = {}

    async def call(priority: int, i: int) -> None:
        try:
            await engine.infer("m", {"x": rows_of(i)}, priority=priority)
            outcomes[priority, i] = "ok"
        except QueueFull as exc:
            outcomes[priority, i] = exc

    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(config)
        async with anyio.create_task_group() as tg:
            tg.start_soon(call, 0, -1)  # runs at once, holding the instance for 1 s
            await anyio.sleep(0.01)
            for i in range(20):  # 5x overload of low-priority work
                tg.start_soon(call, 0, i)
            await anyio.sleep(0.01)
            for i in range(5):
                tg.start_soon(call, 1, i)
        refused = {key for key, outcome in outcomes.items() if isinstance(outcome, QueueFull)}
        stats = engine.statistics().models["m"]
    # Six low-priority requests queued; the other fourteen met the bound of their level.
    assert sum(key[0] == 0 for key in refused) == 14
    # High priority got the four places the bound kept free; the fifth met max_queue_size.
    assert sum(key[0] == 1 for key in refused) == 1
    low = next(outcomes[key] for key in refused if key[0] == 0)
    assert "6 requests of priority 0 queued, its queue_sizes bound" in str(low)
    high = next(outcomes[key] for key in refused if key[0] == 1)
    assert "10 requests queued, its max_queue_size" in str(high)
    assert (stats.refused, stats.succeeded) == (15, 11)


async def test_queue_sizes_count_every_way_out_of_the_queue(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Requests that ran, left, or expired give their level's places back."""
    backend = FakeBackend(delay=1.0)
    config = ModelConfig(
        name="m",
        path="-",
        backend="fake",
        batcher="dynamic",
        batcher_options={"max_batch_size": 2, "max_queue_delay": 0.01},
        queue_sizes={0: 2},
        queue_timeouts={0: 0.5},
    )
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(config)
        for _round in range(3):
            async with anyio.create_task_group() as tg:
                tg.start_soon(engine.infer, "m", {"x": rows_of(0)})  # runs
                await anyio.sleep(0.02)
                with anyio.move_on_after(0.1):  # leaves
                    await engine.infer("m", {"x": rows_of(1)})
                with pytest.raises(DeadlineExceeded):  # expires after 0.5 s in the queue
                    await engine.infer("m", {"x": rows_of(2)})
        # Had a place not been given back, a later round would meet QueueFull.
        assert engine.statistics().models["m"].refused == 0


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"low": 3}, "'low' is not an integer priority level"),
        ({0: 0}, "level 0 needs a positive integer, got 0"),
        ({0: 2.5}, "level 0 needs a positive integer, got 2.5"),
        ({0: True}, "level 0 needs a positive integer, got True"),
        ([1, 2], "queue_sizes must be a table of priority level"),
    ],
)
def test_queue_sizes_are_validated(value: object, message: str) -> None:
    with pytest.raises(trioinfer.ConfigError, match=message):
        ModelConfig(name="m", path="-", queue_sizes=value)  # type: ignore[arg-type]


def test_queue_sizes_from_toml(tmp_path: Path) -> None:
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "1" / "model.onnx").write_bytes(b"")
    (tmp_path / "m" / "config.toml").write_text('queue_sizes = { "0" = 768, "-1" = 16 }\n')
    config = ModelConfig.from_toml(tmp_path / "m" / "config.toml")
    assert config.queue_sizes == {0: 768, -1: 16}


# -- the conformance kit ---------------------------------------------------------------


async def test_check_backend_refuses_outputs_that_do_not_follow_the_rows() -> None:
    backend = FakeBackend(lambda inputs: {"y": (inputs["x"] * 2).reshape(-1, 4)[:1]})
    config = ModelConfig(name="m", path="-", backend="fake")
    with pytest.raises(AssertionError, match=r"output 'y' has 1 rows for 2 input rows"):
        await check_backend(backend, config, {"x": rows_of(1, 1)})


def test_unbatched_reasons() -> None:
    def sig(inputs: list[tuple[Any, ...]], outputs: list[tuple[Any, ...]]) -> ModelSignature:
        return ModelSignature(
            tuple(TensorSpec(f"i{n}", F32, s) for n, s in enumerate(inputs)),
            tuple(TensorSpec(f"o{n}", F32, s) for n, s in enumerate(outputs)),
        )

    assert sig([("b", 4)], [("b", 2)]).batched
    assert sig([("b", 4)], [(None, 2)]).batched  # unknown: checked at run time
    assert sig([(None, 4)], [("p", 2)]).batched  # the inputs name no batch dimension
    assert sig([("a", 4), ("b", 4)], [("b", 2)]).batched
    # A converter's placeholder names (tf2onnx, ONNX Runtime) say nothing: checked at run time.
    assert sig([("batch", 4)], [("unk__0", 2)]).batched
    assert sig([("unk__3", 4)], [("unk__7", 2)]).batched
    assert sig([("b", 4)], [("p", 2)]).unbatched_reason == (
        "output 'o0' is float32[p, 2]: its first dimension is not the inputs' ('b'), "
        "so it cannot be cut into each request's rows"
    )
    assert "without a variable first dimension" in str(sig([(3, 4)], [("b", 2)]).unbatched_reason)
    assert "without a variable first dimension" in str(sig([("b", 4)], [()]).unbatched_reason)
    assert sig([], []).unbatched_reason == "it has no inputs or outputs"


# -- an honest retry_after ---------------------------------------------------------


async def test_retry_after_counts_the_large_request_that_holds_the_instance(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """An execution takes 10 ms a row here; a 50-row request holds the only instance."""

    class PerRow(Recorder):
        async def load(
            self, config: ModelConfig, placement: trioinfer.Placement
        ) -> RecorderInstance:
            instance = await super().load(config, placement)
            original = instance.execute

            async def execute(inputs: Arrays) -> dict[str, np.ndarray[Any, Any]]:
                await anyio.sleep(0.01 * len(inputs["x"]))
                return await original(inputs)

            instance.execute = execute  # type: ignore[method-assign]
            return instance

    backend = PerRow()
    config = ModelConfig(name="m", path="-", backend="recorder", max_queue_size=2)
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(config)
        for n in (1, 4, 1, 8, 2):  # history: executions of several sizes
            await engine.infer("m", {"x": rows_of(0, n)})

        async def refused_hint(big_deadline: float) -> float:
            async with anyio.create_task_group() as tg:

                async def big() -> None:
                    with anyio.move_on_after(big_deadline):
                        await engine.infer("m", {"x": rows_of(1, 50)})

                tg.start_soon(big)
                await anyio.sleep(0.1)  # 0.1 s into its 0.5 s
                for _ in range(2):
                    tg.start_soon(engine.infer, "m", {"x": rows_of(2)})
                await trio.testing.wait_all_tasks_blocked()
                with pytest.raises(QueueFull) as info:
                    await engine.infer("m", {"x": rows_of(3)})
            return info.value.retry_after

        # Its caller leaves at 0.25 s, and the execution is aborted then (so
        # it teaches nothing of how long 50 rows take).
        capped = await refused_hint(0.25)
        # 0.4 s left of the big one, then two queued executions of the usual size.
        full = await refused_hint(math.inf)
        assert 0.4 <= full <= 0.5
        assert capped == pytest.approx(full - 0.25, abs=0.02)


def test_retry_after_before_any_execution_guesses_ten_milliseconds_each() -> None:
    from trioinfer._runner import _Cost

    cost = _Cost()
    assert cost.estimate(100) == 0.01
    for _ in range(5):
        cost.observe(4, 2, 0.04)
    assert cost.estimate(4) == pytest.approx(0.04)
    assert cost.estimate(8) == pytest.approx(0.08)  # one size seen: proportional
    for rows, seconds in [(1, 0.012), (16, 0.042), (1, 0.012), (16, 0.042)] * 5:
        cost.observe(rows, 1, seconds)
    assert cost.estimate(31) == pytest.approx(0.072, rel=0.05)  # 10 ms + 2 ms a row


async def test_queue_sizes_count_only_the_bounded_levels(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A client may send any priority: only the levels with a bound are counted."""
    config = ModelConfig(name="m", path="-", backend="fake", queue_sizes={0: 4})
    async with open_engine(registry=FakeBackend().registry()) as engine:
        await engine.load(config)
        for priority in range(1, 200):
            await engine.infer("m", {"x": rows_of(1)}, priority=priority)
        levels = engine._runner("m").queue._levels  # what it keeps, not what it answers
    assert levels == {0: 0}


class PadToFour:
    """A batcher that pads the batch axis to 4 rows with its own assemble and split."""

    async def next_batch(self, queue: trioinfer.lowlevel.RequestQueue) -> list[Any]:
        while True:
            await queue.wait_not_empty()
            try:
                return [queue.pop_nowait()]
            except anyio.WouldBlock:
                continue

    def assemble(self, requests: Any) -> tuple[dict[str, Any], Any]:
        x = np.concatenate([r.inputs["x"] for r in requests])
        padded = np.concatenate([x, np.zeros((4 - len(x), 4), np.float32)])
        rows = [r.rows for r in requests]

        def split(outputs: Arrays) -> list[dict[str, Any]]:
            return [{"y": outputs["y"][: rows[0]]}]

        return {"x": padded}, split


async def test_a_batcher_that_pads_the_batch_axis_is_checked_against_what_it_built(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FakeBackend()
    registry = trioinfer.Registry(
        extra={"backends": {"fake": lambda: backend}, "batchers": {"pad4": PadToFour}}
    )
    config = ModelConfig(name="m", path="-", backend="fake", batcher="pad4")
    async with open_engine(registry=registry) as engine:
        await engine.load(config)
        out = await engine.infer("m", {"x": rows_of(3)})
    assert backend.executions == [4]  # the padded batch ran
    np.testing.assert_array_equal(out["y"], rows_of(6))
