"""Python models calling other models while they compute (Triton's BLS): ``models.infer``.

Over the engine (an async model and a plain one on its worker thread, deadlines,
a caller that leaves, the engine draining) and ``trioinfer serve`` (models named
as clients name them, versions included).
"""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any, ClassVar

import anyio
import attrs
import httpx
import numpy as np
import pytest
import trio
import trio.testing

import trioinfer
from test_server import run_server
from trioinfer import DeadlineExceeded, ModelConfig, open_engine
from trioinfer._stream import STREAM_AHEAD
from trioinfer.lowlevel import current_batch_deadline, current_callers_deadline, current_engine

pytestmark = pytest.mark.python_model

XY = {
    "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 4]}],
    "outputs": [{"name": "y", "dtype": "float32", "shape": ["batch", 4]}],
}
X = np.arange(4, dtype=np.float32).reshape(1, 4)


class Double:
    """y = 2 * x, after *delay* seconds (on the event loop)."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.finished = 0

    async def infer(self, inputs: dict[str, Any]) -> dict[str, Any]:
        await anyio.sleep(self.delay)
        Double.finished += 1
        return {"y": inputs["x"] * 2}


Double.finished = 0


class AsyncCaller:
    """y = double(x) + 1, by calling the model named *target*."""

    def __init__(self, models: Any, target: str = "double") -> None:
        self.models = models
        self.target = target

    async def infer(self, inputs: dict[str, Any]) -> dict[str, Any]:
        doubled = await self.models.infer(self.target, {"x": inputs["x"]})
        return {"y": doubled["y"] + 1}


class ThreadCaller:
    """The same from a plain def infer on the instance's worker thread."""

    def __init__(self, models: Any) -> None:
        self.models = models

    def infer(self, inputs: dict[str, Any]) -> dict[str, Any]:
        doubled = self.models.infer_blocking("double", {"x": inputs["x"]})
        return {"y": doubled["y"] + 1}


def python(name: str, cls: type, **options: Any) -> ModelConfig:
    return ModelConfig(name=name, backend="python", backend_options={"class": cls, **XY, **options})


@pytest.mark.parametrize("caller", [AsyncCaller, ThreadCaller])
async def test_a_model_calls_another_and_the_call_is_an_ordinary_request(caller: type) -> None:
    async with open_engine() as engine:
        await engine.load(python("double", Double))
        await engine.load(python("caller", caller))
        for _ in range(3):
            out = await engine.infer("caller", {"x": X})
            np.testing.assert_array_equal(out["y"], X * 2 + 1)
        stats = engine.statistics().models
        assert (stats["caller"].succeeded, stats["double"].succeeded) == (3, 3)


async def test_an_inline_plain_model_is_told_to_be_async() -> None:
    async with open_engine() as engine:
        await engine.load(python("double", Double))
        await engine.load(python("caller", ThreadCaller, dispatch="inline"))
        with pytest.raises(trioinfer.BackendError, match="was called on the event loop's thread"):
            await engine.infer("caller", {"x": X})


class SelfCaller(AsyncCaller):
    def __init__(self, models: Any) -> None:
        super().__init__(models, target="self")


async def test_a_model_cannot_call_itself_and_errors_come_as_raised() -> None:
    async with open_engine() as engine:
        await engine.load(python("self", SelfCaller))
        with pytest.raises(trioinfer.BackendError, match="model 'self' called itself"):
            await engine.infer("self", {"x": X})
        await engine.load(python("lost", AsyncCaller))  # "double" is not loaded
        # The caller's model is at fault, not its client (no 404 for a model it asked for).
        with pytest.raises(
            trioinfer.BackendError, match="model 'lost' called model 'double', which is not served"
        ):
            await engine.infer("lost", {"x": X})


async def test_the_callers_deadline_bounds_the_call_and_nothing_runs_after_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    Double.finished = 0
    async with open_engine() as engine:
        await engine.load(python("double", Double, parameters={"delay": 10.0}))
        await engine.load(python("caller", AsyncCaller))
        start = trio.current_time()
        with trio.move_on_after(1.0):
            await engine.infer("caller", {"x": X})
        assert trio.current_time() - start == pytest.approx(1.0)
        await trio.sleep(20)
        assert Double.finished == 0  # the call was cancelled with its caller
        stats = engine.statistics().models["double"]
        assert stats.succeeded == 0
        assert stats.cancelled + stats.expired == 1


class Waiter:
    """A plain model that calls "double" with whatever deadline its execution has."""

    def __init__(self, models: Any) -> None:
        self.models = models

    def infer(self, inputs: dict[str, Any]) -> dict[str, Any]:
        try:
            return self.models.infer_blocking("double", {"x": inputs["x"]})
        except DeadlineExceeded as exc:
            Waiter.said = str(exc)
            raise


Waiter.said = ""


async def test_a_threads_call_takes_its_executions_deadline() -> None:
    async with open_engine() as engine:
        await engine.load(python("double", Double, parameters={"delay": 30.0}))
        await engine.load(python("waiter", Waiter))
        with trio.move_on_after(0.5):
            await engine.infer("waiter", {"x": X})
        # The thread's call ended at the deadline, not 30 s later.
        with trio.fail_after(10):
            while not Waiter.said:  # noqa: ASYNC110  # the thread reports when it is told
                await trio.sleep(0.01)
        assert "did not end before the deadline" in Waiter.said
        # Each name in quotes once, no "'waiter''s" (a quote doubled by the possessive).
        assert "a call by model 'waiter' to model 'double'" in Waiter.said, Waiter.said


class SlowCaller:
    """Waits, then calls "double": its call comes while the engine drains."""

    def __init__(self, models: Any) -> None:
        self.models = models

    async def infer(self, inputs: dict[str, Any]) -> dict[str, Any]:
        await anyio.sleep(1.0)
        return await self.models.infer("double", {"x": inputs["x"]})


async def test_calls_go_on_while_the_engine_drains(autojump_clock: trio.testing.MockClock) -> None:
    answers: list[Any] = []
    async with trio.open_nursery() as callers, open_engine(drain_period=5.0) as engine:
        await engine.load(python("double", Double))
        await engine.load(python("slow", SlowCaller))

        async def call() -> None:
            answers.append(await engine.infer("slow", {"x": X}))

        callers.start_soon(call)
        await trio.sleep(0.1)  # computing: its call to "double" comes at 1 s
        # The block was left at 0.1 s: the engine drained, and the call, made while it
        # did, was admitted as a pipeline's steps are (engine.infer refuses then).
    assert len(answers) == 1
    np.testing.assert_array_equal(answers[0]["y"], X * 2)


def test_current_engine_is_known_only_where_an_engine_loads() -> None:
    with pytest.raises(RuntimeError, match="only known in a backend's load"):
        current_engine()


SCALE_PY = """
class Model:
    def infer(self, inputs):
        return {"y": inputs["x"] * FACTOR}
"""
CALLER_PY = """
import numpy as np


class Model:
    def __init__(self, models):
        self.models = models

    async def infer(self, inputs):
        latest = await self.models.infer("scale", {"x": inputs["x"]})
        first = await self.models.infer("scale:1", {"x": inputs["x"]})
        async with self.models.infer_stream("scale:1", {"x": inputs["x"]}) as responses:
            streamed = [outputs async for outputs in responses]
        return {"y": latest["y"] + first["y"] + streamed[0]["y"]}
"""
SCALE_TOML = """
backend = "python"
version_policy = "all"
[backend_options]
inputs = [{ name = "x", dtype = "float32", shape = ["batch", 4] }]
outputs = [{ name = "y", dtype = "float32", shape = ["batch", 4] }]
"""


def test_served_models_call_others_by_the_names_clients_use(tmp_path: Path) -> None:
    repository = tmp_path / "repository"
    for version, factor in ((1, 2), (2, 3)):
        (repository / "scale" / str(version)).mkdir(parents=True)
        (repository / "scale" / str(version) / "model.py").write_text(
            SCALE_PY.replace("FACTOR", str(factor))
        )
    (repository / "scale" / "config.toml").write_text(SCALE_TOML)
    (repository / "caller" / "1").mkdir(parents=True)
    (repository / "caller" / "1" / "model.py").write_text(CALLER_PY)
    (repository / "caller" / "config.toml").write_text(
        SCALE_TOML.replace('version_policy = "all"\n', "")
    )
    body = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
    with run_server(repository, log=tmp_path / "log") as server:
        answer = httpx.post(f"{server.url}/v2/models/caller/infer", json=body, timeout=30)
        assert answer.status_code == 200, answer.text
        # version 2 (the latest) triples, version 1 doubles (called, then streamed): 7x.
        assert answer.json()["outputs"][0]["data"] == [7.0, 14.0, 21.0, 28.0]
        stats = httpx.get(f"{server.url}/v2/models/scale/stats", timeout=30).json()
        counts = {
            s["version"]: s["inference_stats"]["success"]["count"] for s in stats["model_stats"]
        }
        assert counts == {"1": 2, "2": 1}


@pytest.mark.parametrize("name", ["models", "device"])
async def test_parameters_may_not_set_what_the_backend_passes(name: str) -> None:
    async with open_engine() as engine:
        with pytest.raises(trioinfer.ConfigError, match=f"sets '{name}', which the backend passes"):
            await engine.load(python("caller", AsyncCaller, parameters={name: "mine"}))


SELF_PY = """
class Model:
    def __init__(self, models):
        self.models = models

    async def infer(self, inputs):
        return await self.models.infer("loop", {"x": inputs["x"]})
"""


def test_a_served_model_cannot_call_itself_by_the_name_clients_use(tmp_path: Path) -> None:
    # The engine knows it as "loop.v1": the call to "loop" is to itself all the same, and
    # would wait for its own instance (for ever, without a deadline).
    (tmp_path / "repository" / "loop" / "1").mkdir(parents=True)
    (tmp_path / "repository" / "loop" / "1" / "model.py").write_text(SELF_PY)
    (tmp_path / "repository" / "loop" / "config.toml").write_text(SCALE_TOML)
    body = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
    with run_server(tmp_path / "repository", log=tmp_path / "log") as server:
        answer = httpx.post(f"{server.url}/v2/models/loop/infer", json=body, timeout=30)
    assert answer.status_code == 500
    assert "called itself (as 'loop')" in answer.json()["error"]


@pytest.mark.parametrize("caller", [AsyncCaller, ThreadCaller])
async def test_a_queue_timeout_does_not_cut_a_running_models_call_short(
    autojump_clock: trio.testing.MockClock, caller: type
) -> None:
    # The caller's model bounds its requests' wait to start (queue_timeouts), not their
    # run: a client that set no deadline waits for the call, as for any execution.
    async with open_engine() as engine:
        await engine.load(python("double", Double, parameters={"delay": 2.0}))
        config = python("caller", caller)
        await engine.load(attrs.evolve(config, queue_timeouts={0: 0.5}))
        start = trio.current_time()
        out = await engine.infer("caller", {"x": X})
        assert trio.current_time() - start >= 2.0
        np.testing.assert_array_equal(out["y"], X * 2 + 1)


class Seer:
    """y = x, recording the deadlines its execution sees (batch's, callers' own)."""

    seen: ClassVar[list[tuple[float, float]]] = []

    async def infer(self, inputs: dict[str, Any]) -> dict[str, Any]:
        Seer.seen.append((current_batch_deadline(), current_callers_deadline()))
        return {"y": inputs["x"]}


class ScopeSeer(AsyncCaller):
    """AsyncCaller, recording the effective deadline of the task its infer runs in."""

    scopes: ClassVar[list[float]] = []

    async def infer(self, inputs: dict[str, Any]) -> dict[str, Any]:
        ScopeSeer.scopes.append(anyio.current_effective_deadline())
        return await super().infer(inputs)


def caller_in(mode: str) -> ModelConfig:
    """The caller model of each mode: async infer in its caller's task, or in the engine's
    worker task (a dynamic batcher queues every request), or plain on its worker thread."""
    if mode == "caller's task":
        return python("caller", ScopeSeer)
    if mode == "worker task":
        return attrs.evolve(
            python("caller", ScopeSeer),
            batcher="dynamic",
            batcher_options={"max_batch_size": 1},
        )
    return python("caller", ThreadCaller)


MODES = ["caller's task", "worker task", "thread"]


@pytest.mark.parametrize("mode", MODES)
async def test_a_calls_request_carries_its_callers_deadline(
    mock_clock: trio.testing.MockClock, mode: str
) -> None:
    # A clock that stands still: a worker thread's real time passes no deadline.
    Seer.seen, ScopeSeer.scopes = [], []
    async with open_engine() as engine:
        await engine.load(python("double", Seer))
        await engine.load(caller_in(mode))
        start = trio.current_time()
        with trio.fail_after(5.0):
            await engine.infer("caller", {"x": X})
        await engine.infer("caller", {"x": X})  # no deadline: none
    if mode != "thread":  # the mode is the one named: a scope of the caller's, or none
        first = start + 5.0 if mode == "caller's task" else math.inf
        assert ScopeSeer.scopes == [first, math.inf]
    assert Seer.seen == [(start + 5.0, start + 5.0), (math.inf, math.inf)]


class Lagging:
    """A FIFO scheduler whose first pop takes *lag* seconds: its head expires meanwhile."""

    def __init__(self, clock: trio.testing.MockClock, lag: float) -> None:
        self.clock = clock
        self.lag = lag
        self.queue: dict[Any, None] = {}

    def push(self, request: Any) -> None:
        self.queue[request] = None

    def peek(self) -> Any:
        if not self.queue:
            raise IndexError("empty")
        return next(iter(self.queue))

    def pop(self) -> Any:
        request = self.peek()
        del self.queue[request]
        self.clock.jump(self.lag)
        self.lag = 0.0
        return request

    def remove(self, request: Any) -> bool:
        return self.queue.pop(request, False) is None

    def __len__(self) -> int:
        return len(self.queue)


@pytest.mark.parametrize("mode", MODES)
async def test_the_callees_queue_drops_a_call_past_its_callers_deadline(
    mock_clock: trio.testing.MockClock, mode: str
) -> None:
    # The callee's queue takes 1 s to hand the call over, past the caller's 0.5 s: it
    # drops the request there, uncomputed, and counts it as expired (not cancelled).
    # The clock moves only then (a worker thread's real time passes no deadline).
    Double.finished = 0
    scheduler = Lagging(mock_clock, lag=1.0)
    registry = trioinfer.Registry(extra={"schedulers": {"lagging": lambda: scheduler}})
    async with open_engine(registry=registry) as engine:
        await engine.load(attrs.evolve(python("double", Double), scheduler="lagging"))
        await engine.load(caller_in(mode))
        with trio.move_on_after(0.5):
            await engine.infer("caller", {"x": X})
        stats = engine.statistics().models["double"]
    assert Double.finished == 0
    assert (stats.expired, stats.cancelled, stats.succeeded) == (1, 0, 0)


class Counting:
    """A decoupled model: y = x + i for i in 0, 1, ... up to *n* - 1, one response each,
    after *pause* seconds; records what it yielded and whether it was stopped at a yield."""

    log: ClassVar[list[str]] = []

    def __init__(self, n: int = 3, pause: float = 0.0) -> None:
        self.n = n
        self.pause = pause

    async def infer(self, inputs: dict[str, Any]) -> Any:
        try:
            for i in range(self.n):
                await anyio.sleep(self.pause)
                Counting.log.append(f"yield {i}")
                yield {"y": inputs["x"] + i}
            Counting.log.append("done")
        except GeneratorExit:
            Counting.log.append("closed")
            raise
        except anyio.get_cancelled_exc_class():
            Counting.log.append("cancelled")
            raise


def counting(name: str = "counting", **parameters: Any) -> ModelConfig:
    return python(name, Counting, decoupled=True, parameters=parameters)


class StreamSummer:
    """y = the sum of *target*'s responses to x, read through models.infer_stream; reads
    at most *take* of them (then leaves the block)."""

    def __init__(self, models: Any, target: str = "counting", take: int = 1_000) -> None:
        self.models = models
        self.target = target
        self.take = take

    async def infer(self, inputs: dict[str, Any]) -> dict[str, Any]:
        total = np.zeros_like(inputs["x"])
        read = 0
        async with self.models.infer_stream(self.target, {"x": inputs["x"]}) as responses:
            async for outputs in responses:
                total = total + outputs["y"]
                read += 1
                if read == self.take:
                    break
        return {"y": total}


@pytest.mark.streaming
async def test_a_model_reads_a_decoupled_models_stream() -> None:
    Counting.log = []
    async with open_engine() as engine:
        await engine.load(counting())
        await engine.load(python("summer", StreamSummer))
        out = await engine.infer("summer", {"x": X})
        stats = engine.statistics().models["counting"]
    np.testing.assert_array_equal(out["y"], 3 * X + 0 + 1 + 2)
    assert Counting.log == ["yield 0", "yield 1", "yield 2", "done"]
    assert stats.succeeded == 1


@pytest.mark.streaming
async def test_leaving_the_block_stops_the_callee_at_its_next_yield() -> None:
    Counting.log = []
    async with open_engine() as engine:
        # More responses than it may make ahead: it cannot have ended when the reader leaves.
        await engine.load(counting(n=2 + STREAM_AHEAD + 10))
        await engine.load(python("summer", StreamSummer, parameters={"take": 2}))
        out = await engine.infer("summer", {"x": X})
        stats = engine.statistics().models["counting"]
    np.testing.assert_array_equal(out["y"], 2 * X + 1)
    # At most STREAM_AHEAD responses ahead of the reader, then closed at the yield it
    # waited at (or cancelled in the await it was in).
    *made, last = Counting.log
    assert made == [f"yield {i}" for i in range(len(made))]
    assert 2 <= len(made) <= 2 + STREAM_AHEAD
    assert last in ("closed", "cancelled")
    assert (stats.succeeded, stats.cancelled) == (0, 1)


@pytest.mark.streaming
async def test_a_stream_from_a_model_that_is_not_decoupled_is_its_one_answer() -> None:
    async with open_engine() as engine:
        await engine.load(python("double", Double))
        await engine.load(python("summer", StreamSummer, parameters={"target": "double"}))
        out = await engine.infer("summer", {"x": X})
    np.testing.assert_array_equal(out["y"], X * 2)


@pytest.mark.streaming
async def test_a_decoupled_model_called_for_one_answer_is_the_callers_fault() -> None:
    # Triton's exec() without decoupled=True: here a BackendError (a 500: the calling
    # model's code is wrong, not its client's request) that names the way to call it.
    async with open_engine() as engine:
        await engine.load(python("double", Counting, decoupled=True))
        for caller in (AsyncCaller, ThreadCaller):
            await engine.load(python("caller", caller))
            with pytest.raises(
                trioinfer.BackendError,
                match=r"model 'caller' called model 'double' for one answer, but it is "
                r"decoupled.*models\.infer_stream",
            ):
                await engine.infer("caller", {"x": X})
            await engine.unload("caller")


@pytest.mark.streaming
async def test_a_streamed_call_to_itself_or_to_no_model_is_refused() -> None:
    async with open_engine() as engine:
        await engine.load(python("self", StreamSummer, parameters={"target": "self"}))
        with pytest.raises(trioinfer.BackendError, match="model 'self' called itself"):
            await engine.infer("self", {"x": X})
        await engine.load(python("lost", StreamSummer))
        with pytest.raises(
            trioinfer.BackendError,
            match="model 'lost' called model 'counting', which is not served",
        ):
            await engine.infer("lost", {"x": X})


@pytest.mark.streaming
@pytest.mark.parametrize("mode", ["caller's task", "worker task"])
async def test_the_callers_deadline_ends_the_stream_at_the_callees_yield(
    autojump_clock: trio.testing.MockClock, mode: str
) -> None:
    Counting.log = []
    async with open_engine() as engine:
        await engine.load(counting(n=10, pause=1.0))
        summer = python("summer", StreamSummer)
        if mode == "worker task":
            summer = attrs.evolve(summer, batcher="dynamic", batcher_options={"max_batch_size": 1})
        await engine.load(summer)
        start = trio.current_time()
        with trio.move_on_after(2.5):
            await engine.infer("summer", {"x": X})
        assert trio.current_time() - start == pytest.approx(2.5)
        await trio.sleep(20)
        stats = engine.statistics().models["counting"]
    # Stopped in its third pause: nothing after, however long the engine stayed open.
    assert Counting.log == ["yield 0", "yield 1", "cancelled"]
    assert (stats.succeeded, stats.cancelled) == (0, 1)


class SlowStreamer(StreamSummer):
    """Waits 1 s, then reads its stream: the stream opens while the engine drains."""

    async def infer(self, inputs: dict[str, Any]) -> dict[str, Any]:
        await anyio.sleep(1.0)
        return await super().infer(inputs)


@pytest.mark.streaming
async def test_streamed_calls_open_while_the_engine_drains(
    autojump_clock: trio.testing.MockClock,
) -> None:
    answers: list[Any] = []
    for target in ("counting", "double"):  # decoupled, and not
        async with trio.open_nursery() as callers, open_engine(drain_period=5.0) as engine:
            await engine.load(counting())
            await engine.load(python("double", Double))
            await engine.load(python("slow", SlowStreamer, parameters={"target": target}))

            async def call() -> None:
                answers.append(await engine.infer("slow", {"x": X}))

            callers.start_soon(call)
            await trio.sleep(0.1)  # computing: its stream opens at 1 s, as the engine drains
    np.testing.assert_array_equal(answers[0]["y"], 3 * X + 3)
    np.testing.assert_array_equal(answers[1]["y"], 2 * X)


class ThreadStreamSummer:
    """StreamSummer from a plain def infer on the worker thread (infer_stream_blocking);
    *close*: how it stops after *take* responses ("with", "close", or "leave" it open)."""

    def __init__(
        self, models: Any, target: str = "counting", take: int = 1_000, close: str = "with"
    ) -> None:
        self.models = models
        self.target = target
        self.take = take
        self.close = close

    def infer(self, inputs: dict[str, Any]) -> dict[str, Any]:
        total = np.zeros_like(inputs["x"])
        responses = self.models.infer_stream_blocking(self.target, {"x": inputs["x"]})
        if self.close == "with":
            with responses:
                total = self._sum(responses, total)
        else:
            total = self._sum(responses, total)
            if self.close == "close":
                responses.close()
                Counting.log.append("close returned")
        return {"y": total}

    def _sum(self, responses: Any, total: Any) -> Any:
        for read, outputs in enumerate(responses, 1):
            total = total + outputs["y"]
            if read == self.take:
                break
        return total


@pytest.mark.streaming
async def test_a_thread_reads_a_decoupled_models_stream() -> None:
    Counting.log = []
    async with open_engine() as engine:
        await engine.load(counting())
        await engine.load(python("summer", ThreadStreamSummer))
        out = await engine.infer("summer", {"x": X})
        await engine.load(python("single", ThreadStreamSummer, parameters={"target": "double"}))
        await engine.load(python("double", Double))
        single = await engine.infer("single", {"x": X})
    np.testing.assert_array_equal(out["y"], 3 * X + 3)
    assert Counting.log == ["yield 0", "yield 1", "yield 2", "done"]
    np.testing.assert_array_equal(single["y"], 2 * X)  # not decoupled: its one answer


@pytest.mark.streaming
@pytest.mark.parametrize("close", ["with", "close", "leave"])
async def test_a_threads_stream_stops_when_closed_or_when_infer_returns(close: str) -> None:
    Counting.log = []
    async with open_engine() as engine:
        await engine.load(counting(n=10))
        await engine.load(
            python("summer", ThreadStreamSummer, parameters={"take": 2, "close": close})
        )
        out = await engine.infer("summer", {"x": X})
        stats = engine.statistics().models["counting"]
    np.testing.assert_array_equal(out["y"], 2 * X + 1)
    # Stopped at most one response ahead of the thread; with close(), before it returned.
    log = [entry for entry in Counting.log if entry != "close returned"]
    assert log[:2] == ["yield 0", "yield 1"]
    assert log[2:] in (["closed"], ["cancelled"], ["yield 2", "closed"])
    if close == "close":
        assert Counting.log[-1] == "close returned"
    assert (stats.succeeded, stats.cancelled) == (0, 1)


class ThreadStreamWaiter(ThreadStreamSummer):
    """Records the error its stream's iteration ended with."""

    said: ClassVar[str] = ""

    def infer(self, inputs: dict[str, Any]) -> dict[str, Any]:
        try:
            return super().infer(inputs)
        except DeadlineExceeded as exc:
            ThreadStreamWaiter.said = str(exc)
            raise


@pytest.mark.streaming
async def test_a_threads_stream_ends_at_its_callers_deadline() -> None:
    Counting.log = []
    ThreadStreamWaiter.said = ""
    async with open_engine() as engine:
        await engine.load(counting(n=10, pause=30.0))
        await engine.load(python("waiter", ThreadStreamWaiter))
        with trio.move_on_after(0.5):
            await engine.infer("waiter", {"x": X})
        with trio.fail_after(10):
            while not ThreadStreamWaiter.said:  # noqa: ASYNC110  # the thread reports it
                await trio.sleep(0.01)
        stats = engine.statistics().models["counting"]
    assert "did not end before the deadline" in ThreadStreamWaiter.said
    assert "''" not in ThreadStreamWaiter.said, ThreadStreamWaiter.said
    assert Counting.log == ["cancelled"]  # in its first pause, 30 s long
    assert stats.cancelled == 1


class LoadStreamer:
    def __init__(self, models: Any) -> None:
        self.models = models

    def load(self) -> None:
        self.models.infer_stream_blocking("counting", {"x": X})

    def infer(self, inputs: dict[str, Any]) -> dict[str, Any]:
        return {"y": inputs["x"]}


@pytest.mark.streaming
async def test_a_thread_streams_only_while_infer_runs() -> None:
    async with open_engine() as engine:
        await engine.load(counting())
        with pytest.raises(
            trioinfer.BackendError, match="works only on the thread that runs the model's infer"
        ):
            await engine.load(python("loader", LoadStreamer))
        await engine.load(python("inline", ThreadStreamSummer, dispatch="inline"))
        with pytest.raises(trioinfer.BackendError, match="was called on the event loop's"):
            await engine.infer("inline", {"x": X})


class StreamKeeper:
    """Reads one response in infer, leaves its stream open, and hands it to a thread of
    its own that reads on after infer returned; records how that read ended."""

    said: ClassVar[list[str]] = []
    done: ClassVar[threading.Event] = threading.Event()

    def __init__(self, models: Any) -> None:
        self.models = models

    def infer(self, inputs: dict[str, Any]) -> dict[str, Any]:
        responses = self.models.infer_stream_blocking("counting", {"x": inputs["x"]})
        first = next(responses)

        def later() -> None:
            try:
                StreamKeeper.said.append(f"read {len(list(responses))}")
            except Exception as exc:
                StreamKeeper.said.append(f"{type(exc).__name__}: {exc}")
            finally:
                StreamKeeper.done.set()

        threading.Thread(target=later).start()
        return {"y": first["y"]}


@pytest.mark.streaming
async def test_a_stream_read_after_infer_returned_says_so() -> None:
    # Not a deadline: nothing of the callers' ended, infer returned and its stream with it.
    Counting.log = []
    StreamKeeper.said = []
    StreamKeeper.done = threading.Event()
    async with open_engine() as engine:
        await engine.load(counting(n=10))
        await engine.load(python("keeper", StreamKeeper))
        out = await engine.infer("keeper", {"x": X})
        await trio.to_thread.run_sync(StreamKeeper.done.wait, 10.0)
    np.testing.assert_array_equal(out["y"], X)
    (said,) = StreamKeeper.said
    assert said.startswith("RuntimeError"), said
    assert "after its infer returned" in said, said


class HelperStreamer:
    """Opens a stream from a thread of its own while infer runs (and waits for it)."""

    said: ClassVar[str] = ""

    def __init__(self, models: Any) -> None:
        self.models = models

    def infer(self, inputs: dict[str, Any]) -> dict[str, Any]:
        def helper() -> None:
            try:
                self.models.infer_stream_blocking("counting", {"x": inputs["x"]})
            except RuntimeError as exc:
                HelperStreamer.said = str(exc)

        thread = threading.Thread(target=helper)
        thread.start()
        thread.join()
        return {"y": inputs["x"]}


@pytest.mark.streaming
async def test_a_stream_opened_from_another_thread_while_infer_runs_says_which_thread() -> None:
    HelperStreamer.said = ""
    async with open_engine() as engine:
        await engine.load(counting())
        await engine.load(python("helper", HelperStreamer))
        await engine.infer("helper", {"x": X})
    # infer runs meanwhile: what is wrong is the thread, not the time.
    assert "on the thread that runs the model's infer" in HelperStreamer.said, HelperStreamer.said
