"""The dynamic batcher: size-or-delay dispatch, preferred sizes, compatibility, order."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import attrs
import numpy as np
import pytest
import trio
import trio.testing

import trioinfer
from trioinfer import Instance, ModelConfig, ModelSignature, TensorSpec, open_engine
from trioinfer.lowlevel import Request, RequestQueue
from trioinfer.testing import FakeBackend
from trioinfer_batching import DynamicBatcher

F32 = np.dtype(np.float32)


def config(name: str = "m", *, instances: int = 1, **options: object) -> ModelConfig:
    return ModelConfig(
        name=name,
        path="unused.onnx",
        backend="fake",
        batcher="dynamic",
        batcher_options=options,
        instances=[Instance(count=instances)],
    )


def rows_of(value: float, rows: int = 1, width: int = 4) -> np.ndarray:
    return np.full((rows, width), value, np.float32)


class Recorder:
    """A FakeBackend function (y = 2x) that remembers each execution's first column."""

    def __init__(self) -> None:
        self.batches: list[list[float]] = []

    def __call__(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.batches.append(inputs["x"][:, 0].tolist())
        return {"y": inputs["x"] * 2}

    def ids(self) -> list[list[int]]:
        """Each execution's requests, by the value each request's rows hold, in order."""
        return [list(dict.fromkeys(int(v) for v in batch)) for batch in self.batches]


class Calls:
    """Callers started at chosen times; remembers when each finished and what it got."""

    def __init__(self, engine: trioinfer.Engine, nursery: trio.Nursery, model: str = "m") -> None:
        self.engine = engine
        self.nursery = nursery
        self.model = model
        self.done: dict[int, float] = {}
        self.outputs: dict[int, np.ndarray] = {}
        self.cancelled: set[int] = set()

    def start(self, i: int, x: np.ndarray | None = None, *, budget: float = math.inf) -> None:
        self.nursery.start_soon(self._call, i, rows_of(i) if x is None else x, budget)

    async def send(self, i: int, x: np.ndarray | None = None, *, budget: float = math.inf) -> None:
        """Start caller *i* and let it queue its request before going on: a fixed order."""
        self.start(i, x, budget=budget)
        await trio.testing.wait_all_tasks_blocked()

    async def _call(self, i: int, x: np.ndarray, budget: float) -> None:
        with trio.move_on_after(budget) as scope:
            out = await self.engine.infer(self.model, {"x": x})
            self.outputs[i] = out["y"]
            np.testing.assert_array_equal(out["y"], 2 * x)
            self.done[i] = trio.current_time()
        if scope.cancelled_caught:
            self.cancelled.add(i)


async def test_full_batch_dispatches_at_once(autojump_clock: trio.testing.MockClock) -> None:
    backend = FakeBackend(delay=1.0)
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(config(max_batch_size=4, max_queue_delay=10.0))
        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            calls = Calls(engine, nursery)
            for i in range(4):
                calls.start(i)
    assert backend.executions == [4]
    assert calls.done == dict.fromkeys(range(4), t0 + 1.0)


async def test_lone_request_flushes_at_max_queue_delay(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FakeBackend()
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(config(max_batch_size=8, max_queue_delay=0.25))
        t0 = trio.current_time()
        await engine.infer("m", {"x": rows_of(1)})
        assert trio.current_time() == t0 + 0.25
        # The next one waits its own full delay, counted from its own arrival.
        await trio.sleep(0.5)
        await engine.infer("m", {"x": rows_of(1)})
        assert trio.current_time() == t0 + 0.25 + 0.5 + 0.25
    assert backend.executions == [1, 1]


async def test_delay_counts_from_the_oldest_arrival(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FakeBackend(delay=1.0)
    async with open_engine(registry=backend.registry()) as engine, trio.open_nursery() as nursery:
        await engine.load(config(max_batch_size=8, max_queue_delay=0.25))
        calls = Calls(engine, nursery)
        t0 = trio.current_time()
        calls.start(0)  # alone: leaves at 0.25, the instance is busy until 1.25
        await trio.sleep_until(t0 + 0.5)
        calls.start(1)  # has waited 0.75 when the instance frees
        await trio.sleep_until(t0 + 1.125)
        calls.start(2)  # has waited 0.125 only, but rides with 1: no wait at all
        await trio.sleep_until(t0 + 2.125)
        calls.start(3)  # the instance frees at 2.25; 3 has waited 0.125 of its 0.25
    assert calls.done == {
        0: t0 + 0.25 + 1.0,
        1: t0 + 1.25 + 1.0,
        2: t0 + 1.25 + 1.0,
        3: t0 + 2.125 + 0.25 + 1.0,
    }
    assert backend.executions == [1, 2, 1]


async def test_preferred_size_dispatches_without_waiting(
    autojump_clock: trio.testing.MockClock,
) -> None:
    recorder = Recorder()
    backend = FakeBackend(recorder, delay=1.0)
    async with open_engine(registry=backend.registry()) as engine, trio.open_nursery() as nursery:
        await engine.load(
            config(max_batch_size=8, max_queue_delay=0.5, preferred_batch_sizes=[2, 4])
        )
        calls = Calls(engine, nursery)
        t0 = trio.current_time()
        await calls.send(0)  # 1 is not preferred: waits the delay, runs from 0.5 to 1.5
        await trio.sleep_until(t0 + 0.75)
        for i in range(1, 8):
            await calls.send(i)
        await trio.sleep_until(t0 + 2.0)
        await calls.send(8)
        await calls.send(9)
    # At 1.5, 7 wait: 4 is the largest preferred size they reach, 3 are held back.
    # At 2.5, those 3 and 2 more: 4 again. At 3.5, 9 has waited more than the delay.
    assert recorder.ids() == [[0], [1, 2, 3, 4], [5, 6, 7, 8], [9]]
    assert calls.done == {
        0: t0 + 1.5,
        **dict.fromkeys(range(1, 5), t0 + 2.5),
        **dict.fromkeys(range(5, 9), t0 + 3.5),
        9: t0 + 4.5,
    }


@pytest.mark.parametrize(
    ("advertised", "option", "expected"),
    [
        ((4,), [], [4, 4, 4, 4, 1]),  # the backend's size, when the option is unset
        ((4,), [2], [2, 2, 2, 2, 2, 2, 2, 2, 1]),  # the option wins
        ((), [], [8, 8, 1]),  # neither: size-or-delay, as before
        ((16,), [], [8, 8, 1]),  # above max_batch_size: never formed
    ],
)
async def test_backend_advertised_preferred_size_cuts_batches(
    autojump_clock: trio.testing.MockClock,
    advertised: tuple[int, ...],
    option: list[int],
    expected: list[int],
) -> None:
    recorder = Recorder()
    backend = FakeBackend(recorder, delay=1.0, preferred_batch_sizes=advertised)
    async with open_engine(registry=backend.registry()) as engine:
        info = await engine.load(
            config(max_batch_size=8, max_queue_delay=0.5, preferred_batch_sizes=option)
        )
        assert info.preferred_batch_sizes == advertised
        async with trio.open_nursery() as nursery:
            calls = Calls(engine, nursery)
            for i in range(17):  # all queued at once; the odd one out waits the delay
                await calls.send(i)
    assert backend.executions == expected
    assert [i for batch in recorder.ids() for i in batch] == list(range(17))


@pytest.mark.parametrize("advertised", [(4, 2), (2, 2), (0,), (2.0,), (True,), 4, None, "4"])
async def test_nonsense_advertised_by_a_backend_is_ignored(
    autojump_clock: trio.testing.MockClock, advertised: Any, caplog: pytest.LogCaptureFixture
) -> None:
    backend = FakeBackend(delay=1.0, preferred_batch_sizes=advertised)
    async with open_engine(registry=backend.registry()) as engine:
        info = await engine.load(config(max_batch_size=8, max_queue_delay=0.5))
        assert info.preferred_batch_sizes == ()
        assert caplog.messages == [
            f"model 'm': its backend instance says preferred_batch_sizes = {advertised!r}; "
            "expected a tuple of increasing positive integers, so it is ignored"
        ]
        async with trio.open_nursery() as nursery:
            calls = Calls(engine, nursery)
            for i in range(9):
                await calls.send(i)
    assert backend.executions == [8, 1]


async def test_a_trickle_waits_for_a_preferred_size_or_the_delay(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FakeBackend()
    async with open_engine(registry=backend.registry()) as engine, trio.open_nursery() as nursery:
        await engine.load(config(max_batch_size=8, max_queue_delay=1.0, preferred_batch_sizes=[3]))
        calls = Calls(engine, nursery)
        t0 = trio.current_time()
        for i in range(5):
            calls.start(i)
            await trio.sleep(0.125)
    assert backend.executions == [3, 2]
    assert calls.done[2] == t0 + 0.25  # the third makes 3: at once
    assert calls.done[4] == t0 + 0.375 + 1.0  # the fourth waits its full delay


async def test_incompatible_shapes_split_in_order(autojump_clock: trio.testing.MockClock) -> None:
    recorder = Recorder()
    signature = ModelSignature(
        inputs=(TensorSpec("x", F32, ("batch", "n"), "tensor(float)"),),
        outputs=(TensorSpec("y", F32, ("batch", "n"), "tensor(float)"),),
    )
    backend = FakeBackend(recorder, signature=signature, delay=1.0)
    async with open_engine(registry=backend.registry()) as engine, trio.open_nursery() as nursery:
        await engine.load(config(max_batch_size=8, max_queue_delay=0.25))
        calls = Calls(engine, nursery)
        t0 = trio.current_time()
        calls.start(0)
        await trio.sleep(0.5)
        for i, width in enumerate([4, 4, 8, 8, 4, 8], 1):
            calls.start(i, rows_of(i, width=width))
            await trio.testing.wait_all_tasks_blocked()
    # Never skipping ahead of an incompatible request: each change of shape cuts.
    assert recorder.ids() == [[0], [1, 2], [3, 4], [5], [6]]
    assert [calls.done[i] for i in (2, 4, 5, 6)] == [t0 + 2.25, t0 + 3.25, t0 + 4.25, t0 + 5.25]


async def test_multi_row_requests_are_concatenated_and_split_back(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FakeBackend(delay=0.5)
    async with open_engine(registry=backend.registry()) as engine, trio.open_nursery() as nursery:
        await engine.load(config(max_batch_size=10, max_queue_delay=0.125))
        calls = Calls(engine, nursery)
        for i in range(1, 9):
            await calls.send(i, rows_of(i, rows=i % 4 + 1))
    # 2+3+4+1 = 10 rows fill the first batch; 2+3+4+1 = 10 the second.
    assert backend.executions == [10, 10]
    for i in range(1, 9):
        np.testing.assert_array_equal(calls.outputs[i], rows_of(2 * i, rows=i % 4 + 1))
        # Each caller's share is a view into the batch's output, not a copy.
        assert calls.outputs[i].base is not None
        assert calls.outputs[i].base.shape[0] == 10


async def test_a_request_bigger_than_max_batch_size_goes_alone_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FakeBackend(delay=1.0)
    async with open_engine(registry=backend.registry()) as engine, trio.open_nursery() as nursery:
        await engine.load(config(max_batch_size=4, max_queue_delay=0.5))
        calls = Calls(engine, nursery)
        t0 = trio.current_time()
        await calls.send(0, rows_of(0, rows=6))
        await trio.sleep(0.25)
        await calls.send(1, rows_of(1, rows=3))
        await calls.send(2, rows_of(2, rows=3))  # would overflow the batch of 1
    assert backend.executions == [6, 3, 3]
    assert calls.done == {0: t0 + 1.0, 1: t0 + 2.0, 2: t0 + 3.0}


async def test_expired_requests_are_never_sent(autojump_clock: trio.testing.MockClock) -> None:
    recorder = Recorder()
    backend = FakeBackend(recorder, delay=1.0)
    async with open_engine(registry=backend.registry()) as engine, trio.open_nursery() as nursery:
        await engine.load(config(max_batch_size=8, max_queue_delay=0.5))
        calls = Calls(engine, nursery)
        t0 = trio.current_time()
        await calls.send(0, budget=0.25)  # leaves the batcher's partial batch before it goes
        await trio.sleep_until(t0 + 1.0)
        await calls.send(1)  # runs from 1.5 to 2.5
        await trio.sleep_until(t0 + 1.625)
        for i in range(2, 5):  # 2 and 4 give up in the queue, 3 waits
            await calls.send(i, budget=2.0 if i == 3 else 0.25)
        await trio.sleep(5)
        stats = engine.statistics().models["m"]
    assert recorder.ids() == [[1], [3]]
    assert calls.cancelled == {0, 2, 4}
    assert (stats.succeeded, stats.cancelled + stats.expired) == (2, 3)


class SlowScheduler:
    """FIFO whose first pop takes *lag* seconds of virtual time: the head expires meanwhile."""

    def __init__(self, clock: trio.testing.MockClock, lag: float) -> None:
        self.clock = clock
        self.lag = lag
        self.queue: dict[Request, None] = {}

    def push(self, request: Request) -> None:
        self.queue[request] = None

    def peek(self) -> Request:
        if not self.queue:
            raise IndexError("empty")
        return next(iter(self.queue))

    def pop(self) -> Request:
        request = self.peek()
        del self.queue[request]
        self.clock.jump(self.lag)
        self.lag = 0.0
        return request

    def remove(self, request: Request) -> bool:
        return self.queue.pop(request, False) is None

    def __len__(self) -> int:
        return len(self.queue)


async def test_a_request_that_expires_as_it_is_taken_is_skipped(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FakeBackend()
    scheduler = SlowScheduler(autojump_clock, lag=1.0)
    registry = trioinfer.Registry(
        extra={"backends": {"fake": lambda: backend}, "schedulers": {"slow": lambda: scheduler}}
    )
    async with open_engine(registry=registry) as engine, trio.open_nursery() as nursery:
        await engine.load(attrs.evolve(config(max_queue_delay=0.25), scheduler="slow"))
        calls = Calls(engine, nursery)
        await calls.send(0, budget=0.5)  # expired by the time the scheduler hands it over
        await calls.send(1)
        await trio.sleep(1)
        assert engine.statistics().models["m"].expired == 1
    assert calls.cancelled == {0}
    assert backend.executions == [1]


async def test_held_requests_whose_callers_left_are_dropped(
    autojump_clock: trio.testing.MockClock,
) -> None:
    recorder = Recorder()
    backend = FakeBackend(recorder, delay=1.0)
    async with open_engine(registry=backend.registry()) as engine, trio.open_nursery() as nursery:
        await engine.load(config(max_batch_size=8, max_queue_delay=0.5, preferred_batch_sizes=[2]))
        calls = Calls(engine, nursery)
        t0 = trio.current_time()
        await calls.send(0)  # runs from 0.5 to 1.5
        await trio.sleep_until(t0 + 0.75)
        for i in range(1, 6):  # at 1.5: 1 and 2 go, 3, 4 and 5 are held back
            await calls.send(i, budget=1.0 if i in (3, 5) else math.inf)
    # 3 and 5 left at 1.75, while held: at 2.5, 4 goes alone (its delay has passed).
    assert recorder.ids() == [[0], [1, 2], [4]]
    assert calls.done[4] == t0 + 3.5
    assert calls.cancelled == {3, 5}


async def test_a_caller_leaving_a_partial_batch_frees_its_rows(
    autojump_clock: trio.testing.MockClock,
) -> None:
    recorder = Recorder()
    backend = FakeBackend(recorder)
    async with open_engine(registry=backend.registry()) as engine, trio.open_nursery() as nursery:
        await engine.load(config(max_batch_size=4, max_queue_delay=1.0))
        calls = Calls(engine, nursery)
        t0 = trio.current_time()
        await calls.send(0, rows_of(0, rows=2))
        await calls.send(1, budget=0.25)
        await trio.sleep_until(t0 + 0.5)
        await calls.send(2, rows_of(2, rows=2))  # 1 left: 0 and 2 make a full batch at once
        await trio.sleep_until(t0 + 1.0)
        await calls.send(3, budget=0.25)  # the oldest leaves: the delay counts from 4's arrival
        await trio.sleep_until(t0 + 1.125)
        await calls.send(4)
    assert recorder.ids() == [[0, 2], [4]]
    assert calls.done == {0: t0 + 0.5, 2: t0 + 0.5, 4: t0 + 1.125 + 1.0}
    assert calls.cancelled == {1, 3}


async def test_two_instances_batch_independently(autojump_clock: trio.testing.MockClock) -> None:
    recorder = Recorder()
    backend = FakeBackend(recorder, delay=1.0)
    async with open_engine(registry=backend.registry()) as engine, trio.open_nursery() as nursery:
        await engine.load(config(instances=2, max_batch_size=4, max_queue_delay=0.25))
        calls = Calls(engine, nursery)
        t0 = trio.current_time()
        for i in range(6):  # 4 fill the first instance's batch; 2 wait for the second
            calls.start(i)
            await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(0.125)
        calls.start(6)  # joins them on the second instance, which flushes at 0.25
        await trio.sleep(0.5)
        calls.start(7)  # both busy: waits until 1.0, when its delay has passed
    assert recorder.ids() == [[0, 1, 2, 3], [4, 5, 6], [7]]
    assert calls.done == {
        **dict.fromkeys(range(4), t0 + 1.0),
        **dict.fromkeys(range(4, 7), t0 + 1.25),
        7: t0 + 2.0,
    }
    assert [instance.executions for instance in backend.loaded] in ([2, 1], [1, 2])


async def test_models_without_a_batch_dimension_get_one_request_per_batch(
    autojump_clock: trio.testing.MockClock,
) -> None:
    scalar = TensorSpec("x", F32, (), "tensor(float)")
    signature = ModelSignature(inputs=(scalar,), outputs=(attrs.evolve(scalar, name="y"),))
    backend = FakeBackend(signature=signature)
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(config(max_batch_size=8, max_queue_delay=1.0))
        t0 = trio.current_time()
        results: list[float] = []

        async def call(i: int) -> None:
            results.append(float((await engine.infer("m", {"x": np.float32(i)}))["y"]))

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(call, i)
        assert trio.current_time() == t0  # no delay: they could never have company
    assert backend.executions == [1, 1, 1]
    assert sorted(results) == [0.0, 2.0, 4.0]


async def test_one_batcher_shared_by_two_models_keeps_their_requests_apart(
    autojump_clock: trio.testing.MockClock,
) -> None:
    shared = DynamicBatcher(max_batch_size=8, max_queue_delay=0.5, preferred_batch_sizes=[2])
    narrow = FakeBackend(delay=1.0)
    wide = FakeBackend(
        signature=ModelSignature(
            inputs=(TensorSpec("x", F32, ("batch", 8), "tensor(float)"),),
            outputs=(TensorSpec("y", F32, ("batch", 8), "tensor(float)"),),
        ),
        delay=1.0,
    )
    registry = trioinfer.Registry(
        extra={
            "backends": {"narrow": lambda: narrow, "wide": lambda: wide},
            "batchers": {"shared": lambda: shared},
        }
    )
    async with open_engine(registry=registry) as engine, trio.open_nursery() as nursery:
        t0 = trio.current_time()
        widths = {"narrow": 4, "wide": 8}
        calls = {name: Calls(engine, nursery, name) for name in widths}
        for name in widths:
            await engine.load(ModelConfig(name=name, path="-", backend=name, batcher="shared"))
            await calls[name].send(0, rows_of(0, width=widths[name]))  # runs 0.5 to 1.5
        await trio.sleep_until(t0 + 0.75)
        for i in range(1, 4):  # at 1.5: 2 (preferred) go, the third is held back
            for name, width in widths.items():
                await calls[name].send(i, rows_of(i, width=width))
    assert narrow.executions == wide.executions == [1, 2, 1]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_batch_size": 0}, "max_batch_size must be a positive integer, got 0"),
        ({"max_batch_size": 2.5}, "max_batch_size must be a positive integer .* float"),
        ({"max_batch_size": True}, "max_batch_size must be a positive integer .* bool"),
        ({"max_queue_delay": -0.1}, "max_queue_delay must be a number of seconds .* got -0.1"),
        ({"max_queue_delay": math.inf}, "must be a number of seconds from .*, or 0; got inf"),
        ({"max_queue_delay": "5ms"}, "must be a number of seconds .* got '5ms'"),
        ({"preferred_batch_sizes": [8, 4]}, "strictly increasing, without duplicates"),
        ({"preferred_batch_sizes": [4, 4]}, "strictly increasing, without duplicates"),
        ({"preferred_batch_sizes": [0]}, "preferred_batch_sizes must be a positive integer"),
        ({"preferred_batch_sizes": "16"}, "must be a list of positive integers, got '16'"),
        ({"preferred_batch_sizes": [2.0]}, "preferred_batch_sizes must be a positive integer"),
        (
            {"max_batch_size": 16, "preferred_batch_sizes": [8, 32]},
            "holds 32, more than max_batch_size 16",
        ),
    ],
)
async def test_invalid_options_are_refused_at_load(options: dict[str, Any], message: str) -> None:
    backend = FakeBackend()
    async with open_engine(registry=backend.registry()) as engine:
        with pytest.raises(trioinfer.ConfigError, match=message):
            await engine.load(config(**options))
        assert engine.models() == []
        await engine.load(config())  # the defaults are fine
    assert backend.loaded[0].closed


def test_options_are_kept() -> None:
    batcher = DynamicBatcher(
        max_batch_size=np.int64(16), max_queue_delay=1, preferred_batch_sizes=(4, 8)
    )
    assert (batcher.max_batch_size, batcher.max_queue_delay) == (16, 1.0)
    assert batcher.preferred_batch_sizes == (4, 8)
    assert repr(batcher) == (
        "DynamicBatcher(max_batch_size=16, max_queue_delay=1.0, preferred_batch_sizes=[4, 8])"
    )
    assert trioinfer.Registry().load("batchers", "dynamic") is DynamicBatcher


def test_options_from_config_toml(tmp_path: Path) -> None:
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "1" / "model.onnx").write_bytes(b"")
    (tmp_path / "m" / "config.toml").write_text(
        'batcher = "dynamic"\n'
        "[batcher_options]\n"
        "max_batch_size = 16\n"
        "max_queue_delay = 0.002\n"
        "preferred_batch_sizes = [4, 8, 16]\n"
    )
    loaded = ModelConfig.from_toml(tmp_path / "m" / "config.toml")
    batcher = DynamicBatcher(**loaded.batcher_options)
    assert (batcher.max_batch_size, batcher.max_queue_delay) == (16, 0.002)
    assert batcher.preferred_batch_sizes == (4, 8, 16)


async def test_unknown_options_are_refused() -> None:
    async with open_engine(registry=FakeBackend().registry()) as engine:
        with pytest.raises(trioinfer.PluginLoadError, match="max_batch"):
            await engine.load(config(max_batch=4))


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_real_onnx_model_batches_concurrent_requests(backend: str, add_model: Path) -> None:
    async def main() -> trioinfer.ModelStatistics:
        async with open_engine() as engine:
            await engine.load(ModelConfig(name="add", path=add_model, batcher="dynamic"))

            async def call(i: int) -> None:
                a = np.arange(4, dtype=np.float32)[None] + i
                b = np.full((1, 4), 10 * i, np.float32)
                with anyio.fail_after(10):
                    sums[i] = (await engine.infer("add", {"a": a, "b": b}))["sum"]

            async with anyio.create_task_group() as tg:
                for i in range(64):
                    tg.start_soon(call, i)
            await call(64)  # alone: flushed after max_queue_delay
            return engine.statistics().models["add"]

    sums: dict[int, np.ndarray] = {}
    stats = anyio.run(main, backend=backend)
    for i in range(65):
        np.testing.assert_array_equal(sums[i], np.arange(4, dtype=np.float32)[None] + 11 * i)
    assert stats.succeeded == 65
    assert stats.executions <= 9  # one request per execution would be 65


class _BrokenAssembly:
    """A batcher whose assemble (or split) raises on the first batch only."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.calls = 0

    async def next_batch(self, queue: RequestQueue) -> list[Request]:
        await queue.wait_not_empty()
        return [queue.pop_nowait()]

    def assemble(self, requests: Any) -> Any:
        self.calls += 1
        broken = self.calls == 1
        if broken and self.where == "assemble":
            raise RuntimeError("no layout for this")

        def split(outputs: Any) -> Any:
            if broken and self.where == "split":
                raise RuntimeError("cannot cut this")
            return [outputs]

        return requests[0].inputs, split


@pytest.mark.parametrize("where", ["assemble", "split"])
async def test_a_failing_assemble_fails_its_batch_not_the_worker(where: str) -> None:
    backend = FakeBackend()
    batcher = _BrokenAssembly(where)
    registry = trioinfer.Registry(
        extra={"backends": {"fake": lambda: backend}, "batchers": {"broken": lambda: batcher}}
    )
    x = np.ones((1, 4), np.float32)
    async with open_engine(registry=registry) as engine:
        await engine.load(ModelConfig(name="m", path="unused", backend="fake", batcher="broken"))
        with pytest.raises(trioinfer.PluginContractError, match=f"failed to {where}") as caught:
            await engine.infer("m", {"x": x})
        assert isinstance(caught.value.__cause__, RuntimeError)
        out = await engine.infer("m", {"x": x})  # the worker lives on
        np.testing.assert_array_equal(out["y"], 2 * x)
        stats = engine.statistics().models["m"]
        assert (stats.failed, stats.succeeded) == (1, 1)
