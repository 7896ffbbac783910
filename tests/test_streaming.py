"""Streaming responses: decoupled Python models through ``engine.infer_stream``."""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import attrs
import numpy as np
import pytest
import trio
import trio.testing

import trioinfer
from trioinfer import (
    BackendError,
    ConfigError,
    EngineClosed,
    InvalidInput,
    ModelConfig,
    QueueFull,
    open_engine,
)
from trioinfer._inline import restart_inline_slice
from trioinfer._stream import STREAM_AHEAD, ResponseStream
from trioinfer.testing import assert_all_ended

pytestmark = pytest.mark.streaming

Arrays = dict[str, np.ndarray[Any, Any]]
SIGNATURE = {
    "inputs": [{"name": "n", "dtype": "int32", "shape": [1]}],
    "outputs": [{"name": "i", "dtype": "int32", "shape": [1]}],
}
REPEAT = trioinfer.example_repository() / "repeat_int32" / "config.toml"


def repeat_inputs(values: list[int], delay_ms: int = 0, wait_ms: int = 0) -> Arrays:
    return {
        "IN": np.array(values, np.int32),
        "DELAY": np.full(len(values), delay_ms, np.uint32),
        "WAIT": np.array([wait_ms], np.uint32),
    }


class Probe:
    """What a counting model did: responses made, and how its generator ended."""

    def __init__(self) -> None:
        self.made = 0
        self.ended: str | None = None
        self.deadline: float | None = None
        self.closed = anyio.Event()


def counting(probe: Probe, *, pause: float = 0.0, fail_after: int | None = None) -> type:
    """A decoupled model yielding 0, 1, ... up to n - 1, recording what it did in *probe*."""

    class Counting:
        async def infer(self, inputs: Arrays) -> AsyncIterator[Arrays]:
            probe.deadline = anyio.current_effective_deadline()
            try:
                for i in range(int(inputs["n"][0])):
                    if pause:
                        await anyio.sleep(pause)
                    if fail_after is not None and i == fail_after:
                        refuse(i)
                    probe.made += 1
                    yield {"i": np.array([i], np.int32)}
            except GeneratorExit:
                probe.ended = "closed at its yield"
                raise
            except BaseException as exc:
                probe.ended = type(exc).__name__
                raise
            else:
                probe.ended = "returned"
            finally:
                probe.closed.set()

    return Counting


async def collect(
    engine: trioinfer.Engine, model: str, inputs: Arrays, into: list[Arrays] | None = None
) -> list[Arrays]:
    """Every response of one stream (into *into* as they come, if given)."""
    got = into if into is not None else []
    async with engine.infer_stream(model, inputs) as responses:
        async for outputs in responses:
            got.append(outputs)
    return got


def refuse(i: int) -> None:
    raise ValueError(f"no response {i}")


def config(cls: type, name: str = "m", **fields: Any) -> ModelConfig:
    options = {"class": cls, "decoupled": True, **SIGNATURE}
    return ModelConfig(name=name, path="-", backend="python", backend_options=options, **fields)


def n(count: int) -> Arrays:
    return {"n": np.array([count], np.int32)}


async def test_repeat_int32_streams_one_response_per_element() -> None:
    async with open_engine() as engine:
        await engine.load(ModelConfig.from_toml(REPEAT))
        async with engine.infer_stream("repeat_int32", repeat_inputs([4, 2, 0, 1])) as responses:
            got = [(int(r["OUT"][0]), int(r["IDX"][0])) async for r in responses]
        assert got == [(4, 0), (2, 1), (0, 2), (1, 3)]
        async with engine.infer_stream("repeat_int32", repeat_inputs([])) as responses:
            assert [r async for r in responses] == []
        stats = engine.statistics().models["repeat_int32"]
        assert (stats.succeeded, stats.failed, stats.cancelled, stats.in_flight) == (2, 0, 0, 0)


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_streams_on_trio_and_asyncio(backend: str) -> None:
    """The whole contract on both event loops: order, early stop, error, deadline."""
    seen: dict[str, Any] = {}

    async def main() -> None:
        full, early, failing, slow = Probe(), Probe(), Probe(), Probe()
        async with open_engine() as engine:
            await engine.load(config(counting(full), "full"))
            await engine.load(config(counting(early), "early"))
            await engine.load(config(counting(failing, fail_after=2), "failing"))
            await engine.load(config(counting(slow, pause=0.02), "slow"))
            async with engine.infer_stream("full", n(5)) as responses:
                seen["full"] = [int(r["i"][0]) async for r in responses]
            async with engine.infer_stream("early", n(1000)) as responses:
                async for r in responses:
                    if r["i"][0] == 2:
                        break
            with anyio.fail_after(5):  # a generator left open would never get here
                await early.closed.wait()
            seen["early"] = (early.made, early.ended)
            got: list[Arrays] = []
            with pytest.raises(BackendError, match=r"infer raised ValueError: no response 2"):
                await collect(engine, "failing", n(5), got)
            seen["failing"] = ([int(r["i"][0]) for r in got], failing.ended)
            with anyio.move_on_after(0.1) as scope:
                async with engine.infer_stream("slow", n(1000)) as responses:
                    async for _ in responses:
                        pass
            with anyio.fail_after(5):
                await slow.closed.wait()
            seen["slow"] = (scope.cancelled_caught, slow.ended, slow.deadline == scope.deadline)
            assert_all_ended(engine, accepted=4)
            seen["stats"] = {
                name: (s.succeeded, s.failed, s.cancelled)
                for name, s in engine.statistics().models.items()
            }

    anyio.run(main, backend=backend)
    assert seen["full"] == [0, 1, 2, 3, 4]
    # Read 0, 1, 2; the model had made at most STREAM_AHEAD more, and stopped at its yield.
    made, ended = seen["early"]
    assert 3 <= made <= 3 + STREAM_AHEAD
    assert ended == "closed at its yield"
    assert seen["failing"] == ([0, 1], "ValueError")
    cancelled = "CancelledError" if backend == "asyncio" else "Cancelled"
    # The caller's deadline reached the model: cancelled in its pause between responses,
    # or closed at its yield when the deadline came while a response waited to be read
    # (a loaded machine's scheduling decides which).
    caught, ended, same_deadline = seen["slow"]
    assert (caught, same_deadline) == (True, True)
    assert ended in (cancelled, "closed at its yield")
    assert seen["stats"] == {
        "early": (0, 0, 1),
        "failing": (0, 1, 0),
        "full": (1, 0, 0),
        "slow": (0, 0, 1),
    }


@pytest.mark.parametrize("given", [1, 4, None])
async def test_a_slow_reader_slows_the_model(
    autojump_clock: trio.testing.MockClock, given: int | None
) -> None:
    """Backpressure: the model is never more than ``ahead`` responses ahead of the reader."""
    probe = Probe()
    ahead = []
    async with open_engine() as engine:
        await engine.load(config(counting(probe)))
        read = 0
        extra = {} if given is None else {"ahead": given}
        async with engine.infer_stream("m", n(50), **extra) as responses:
            async for _ in responses:
                read += 1
                await trio.sleep(1)  # a slow reader; the model could run on meanwhile
                ahead.append(probe.made - read)
    assert read == 50
    # With 1: one made while the reader held the last, no more; else as many as allowed.
    assert max(ahead) == (STREAM_AHEAD if given is None else given)
    assert probe.ended == "returned"


async def test_a_streams_ahead_can_grow_while_it_runs(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """`ResponseStream._widen`: a server that lent a stream less lets it make more later.

    With ``ahead`` fixed at the start, a stream lent 1 while its gRPC call was busy made
    one response at a time to its end, whatever the call gave back meanwhile.
    """
    probe = Probe()
    async with open_engine() as engine:
        await engine.load(config(counting(probe)))
        async with engine.infer_stream("m", n(50), ahead=1) as responses:
            await trio.sleep(1)
            assert probe.made == 1  # one made, none read
            responses._widen(4)
            await trio.sleep(1)
            assert probe.made == 4  # the model went on, up to the new bound, no further
            read = 0
            async for _ in responses:
                read += 1
                await trio.sleep(1)
                assert probe.made - read <= 4
            assert read == 50
    assert probe.ended == "returned"


async def test_a_stream_widened_after_it_closed_is_left_as_it_was() -> None:
    """A gRPC call gives back what a request lent (`_StreamState._top_up`) to a stream
    whose block has ended and whose request has not repaid yet: nothing waits, nothing
    breaks (review4 looked)."""
    probe = Probe()
    async with open_engine() as engine:
        await engine.load(config(counting(probe)))
        async with engine.infer_stream("m", n(50), ahead=1) as responses:
            await responses.__anext__()
        responses._widen(STREAM_AHEAD)
        assert responses._room is None
        with pytest.raises(trioinfer.StreamClosed):
            await responses.__anext__()
        assert_all_ended(engine, accepted=1)


@pytest.mark.parametrize("ahead", [0, -1, 1.5, True, "2"])
async def test_ahead_must_be_a_positive_integer(ahead: object) -> None:
    async with open_engine() as engine:
        await engine.load(config(counting(Probe())))
        with pytest.raises(InvalidInput, match=r"ahead must be an integer of at least 1"):
            engine.infer_stream("m", n(1), ahead=ahead)  # type: ignore[arg-type]


async def test_a_run_of_responses_is_read_without_a_pass_of_the_loop() -> None:
    """Responses waiting in the buffer are read at once, and ``ready`` says when one is."""
    probe = Probe()
    async with open_engine() as engine:
        await engine.load(config(counting(probe)))
        async with engine.infer_stream("m", n(40)) as responses:
            assert not responses.ready  # the model has not run yet
            await responses.__anext__()  # (its first may come alone: the loop's slice)
            await responses.__anext__()  # waits: the model runs meanwhile, ahead
            made = probe.made
            at_hand = 0
            while responses.ready:
                await responses.__anext__()
                at_hand += 1
            # Read with no pass of the loop: the model made none meanwhile. (How many it
            # made in one go depends on the loop's inline slice too: a model holds the
            # loop no longer than it, whatever room the buffer has.)
            assert probe.made == made
            assert 1 <= at_hand == made - 2 <= STREAM_AHEAD
            rest = [r async for r in responses]
            assert responses.ready  # ended: its end is at hand
    assert len(rest) == 40 - made


async def test_ready_counts_a_response_handed_over_as_the_slice_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A model that yields for the loop's slice as it hands a response over has it counted.

    The yield came between the response entering the buffer and its count: a reader
    that looked meanwhile (a busy machine spends the slice often) took it for none,
    and from then on ``ready`` said False with one at hand.
    """
    monkeypatch.setattr(trioinfer._stream, "inline_slice_spent", lambda budget: True)
    probe = Probe()
    async with open_engine() as engine:
        await engine.load(config(counting(probe)))
        async with engine.infer_stream("m", n(40)) as responses:
            await responses.__anext__()  # the model runs, yielding at each hand-over
            taken = 1
            while taken < 40:
                # One pass of the loop: the model, yielding after its next hand-over,
                # runs before or after this task in the next (Trio orders them at random).
                await trio.lowlevel.checkpoint()
                assert responses.ready, f"response {taken} at hand, not counted"
                await responses.__anext__()
                taken += 1
            assert [r async for r in responses] == []
    assert probe.made == 40


async def test_a_reader_past_its_deadline_takes_no_response_at_hand(
    mock_clock: trio.testing.MockClock,
) -> None:
    """Responses waiting in the buffer are not read once the deadline has passed.

    The loop sees a deadline only at its next pass; a reader that takes a response at
    hand makes none, so without a clock read of its own it would read the buffer out.
    """
    async with open_engine() as engine:
        await engine.load(config(counting(Probe())))
        taken = 0
        with trio.move_on_after(10) as scope:
            async with engine.infer_stream("m", n(40)) as responses:
                await responses.__anext__()
                await responses.__anext__()  # waits: the model runs meanwhile, ahead
                assert responses.ready
                mock_clock.jump(20)  # the deadline passes with no pass of the loop
                async for _ in responses:
                    taken += 1
        assert scope.cancelled_caught
        assert taken == 0


def test_a_reader_past_its_deadline_takes_no_response_at_hand_on_asyncio() -> None:
    """The same on asyncio, whose timer may need more than one pass of the loop to fire."""

    async def main() -> tuple[bool, int]:
        async with open_engine() as engine:
            await engine.load(config(counting(Probe())))
            taken = 0
            with anyio.move_on_after(0.2) as scope:
                async with engine.infer_stream("m", n(40)) as responses:
                    await responses.__anext__()
                    await responses.__anext__()
                    # The deadline passes with no pass of the loop (no clock to jump here).
                    time.sleep(0.3)  # noqa: ASYNC251
                    async for _ in responses:
                        taken += 1
            return scope.cancelled_caught, taken

    assert anyio.run(main, backend="asyncio") == (True, 0)


def test_a_response_lost_to_asyncios_own_cancellation_does_not_stall_the_stream() -> None:
    """A read cancelled by asyncio itself (``asyncio.wait_for`` timing out) just as a
    response was handed to it loses that response (anyio's channel drops it); the
    stream counted it as unread for ever, and with ``ahead`` of those its model waited
    for room that never came while its reader waited for a response: both until the
    deadline. The stream goes on with the next response."""
    readers: list[asyncio.Task[Any]] = []
    at_hand: list[ResponseStream] = []

    class CancelsItsReader:
        async def infer(self, inputs: Arrays) -> AsyncIterator[Arrays]:
            yield {"i": np.array([0], np.int32)}
            # Until its reader waits in the channel's receive (no event says so).
            receive: Any = at_hand[0]._receive
            while receive.statistics().tasks_waiting_receive == 0:  # noqa: ASYNC110
                await asyncio.sleep(0)
            # Its reader's timeout fires after the hand-over, in the same pass of the loop
            # (the hand-over then is at once: the loop's inline slice is fresh).
            asyncio.get_running_loop().call_soon(readers[0].cancel)
            restart_inline_slice()
            for i in (1, 2, 3):
                yield {"i": np.array([i], np.int32)}

    async def main() -> tuple[list[object], bool]:
        got: list[object] = []
        async with open_engine() as engine:
            await engine.load(config(CancelsItsReader))
            with anyio.move_on_after(10) as scope:  # (a stalled stream: its reader's deadline)
                async with engine.infer_stream("m", n(4), ahead=1) as responses:
                    at_hand.append(responses)
                    got.append(int((await responses.__anext__())["i"][0]))

                    async def read() -> object:
                        readers.append(asyncio.current_task())  # type: ignore[arg-type]
                        try:
                            return int((await responses.__anext__())["i"][0])
                        except asyncio.CancelledError:
                            return "cancelled"

                    got.append(await asyncio.create_task(read()))
                    got.extend([int(r["i"][0]) async for r in responses])
        return got, scope.cancelled_caught

    got, stalled = anyio.run(main, backend="asyncio")
    assert not stalled
    assert got == [0, "cancelled", 2, 3]  # (1: lost, as anyio's channel loses it)


async def test_a_deadline_moved_later_lets_the_reader_read_on(
    mock_clock: trio.testing.MockClock,
) -> None:
    """The deadline read at open is only a first guess: the reader's own scope decides."""
    async with open_engine() as engine:
        await engine.load(config(counting(Probe())))
        with trio.move_on_after(10) as scope:
            async with engine.infer_stream("m", n(40)) as responses:
                await responses.__anext__()
                scope.deadline += 100
                mock_clock.jump(20)  # past the deadline the stream was opened under
                rest = [int(r["i"][0]) async for r in responses]
        assert not scope.cancelled_caught
        assert rest == list(range(1, 40))


async def test_cancelling_the_caller_cancels_the_model_where_it_waits() -> None:
    probe = Probe()
    async with open_engine() as engine:
        await engine.load(config(counting(probe, pause=math.inf)))
        with trio.CancelScope() as scope:
            async with engine.infer_stream("m", n(5)) as responses:
                scope.cancel()
                async for _ in responses:
                    pass  # pragma: no cover  # the model never answers
        assert probe.ended == "Cancelled"
        assert_all_ended(engine, accepted=1)
        assert engine.statistics().models["m"].cancelled == 1


async def test_a_model_s_own_error_reaches_the_caller_as_it_is() -> None:
    class Refuses:
        async def infer(self, inputs: Arrays) -> AsyncIterator[Arrays]:
            yield {"i": np.array([0], np.int32)}
            raise InvalidInput("n must be small")

    class Misshapen:
        async def infer(self, inputs: Arrays) -> AsyncIterator[Arrays]:
            yield {"i": np.array([0, 1], np.int32)}

    async with open_engine() as engine:
        await engine.load(config(Refuses, "refuses"))
        await engine.load(config(Misshapen, "misshapen"))
        got: list[Arrays] = []
        with pytest.raises(InvalidInput, match=r"^n must be small$"):
            await collect(engine, "refuses", n(1), got)
        assert len(got) == 1
        with pytest.raises(BackendError, match=r"output 'i' has shape \[2\]; the config"):
            await collect(engine, "misshapen", n(1))
        assert_all_ended(engine, accepted=2)


class _Yields:
    """A third-party decoupled instance: its stream yields *responses* as they are."""

    decoupled = True
    device = "cpu"

    def __init__(self, responses: list[Any]) -> None:
        self.signature = trioinfer.ModelSignature.declared(
            SIGNATURE["inputs"], SIGNATURE["outputs"], model="m"
        )
        self._responses = responses

    async def execute(self, inputs: Arrays) -> Arrays:  # pragma: no cover  # never called
        raise AssertionError("a decoupled instance is only streamed")

    async def stream(self, inputs: Arrays) -> AsyncIterator[Arrays]:
        for response in self._responses:
            yield response

    async def aclose(self) -> None:
        pass


@pytest.mark.parametrize(
    ("bad", "said"),
    [
        (np.array([1.0]), "with dtype float64; its signature declares int32[1]"),
        (np.array([[1]], np.int32), "with shape [1, 1]; its signature declares int32[1]"),
        (np.array([1, 2], np.int32), "with shape [2]; its signature declares int32[1]"),
    ],
    ids=["dtype", "rank", "fixed"],
)
@pytest.mark.parametrize("traced", [False, pytest.param(True, marks=pytest.mark.tracing)])
async def test_a_third_party_stream_s_responses_are_checked_against_the_signature(
    bad: Any, said: str, traced: bool
) -> None:
    """The Python backend checks its own; the engine checks any backend's, per response."""
    instance = _Yields([{"i": np.array([0], np.int32)}, {"i": bad}, {"i": np.array([2])}])

    class Backend:
        async def load(self, config: ModelConfig, placement: Any) -> _Yields:
            return instance

    registry = trioinfer.Registry(extra={"backends": {"third": Backend}})
    kwargs: dict[str, Any] = {}
    if traced:  # a sampled stream's responses take the traced loop
        sdk = pytest.importorskip("opentelemetry.sdk.trace")
        kwargs["tracer_provider"] = sdk.TracerProvider()
    async with open_engine(registry=registry, **kwargs) as engine:
        await engine.load(ModelConfig(name="m", path="-", backend="third"))
        got: list[Arrays] = []
        said = re.escape(f"model 'm': instance 0 (cpu) returned output 'i' {said}")
        with pytest.raises(BackendError, match=f"^{said}"):
            await collect(engine, "m", n(3), got)
        assert [r["i"].tolist() for r in got] == [[0]]  # the responses before it came
        assert_all_ended(engine, accepted=1)


async def test_every_stream_ends_exactly_once() -> None:
    """Many streams at once, ending every way there is; the counters add up."""
    probe = Probe()
    async with open_engine() as engine:
        await engine.load(config(counting(probe, fail_after=7), "m", max_queue_size=100))
        outcomes: list[str] = []

        async def one(k: int) -> None:
            try:
                with trio.move_on_after(0 if k % 4 == 3 else math.inf):
                    # Those that leave early read one ahead: with more, their model
                    # would have made its last response (or failed) before they left,
                    # and the stream ended then, as succeeded (or failed).
                    ahead = 1 if k % 4 == 1 else STREAM_AHEAD
                    async with engine.infer_stream("m", n(k % 10), ahead=ahead) as responses:
                        async for r in responses:
                            if k % 4 == 1 and r["i"][0] == 1:
                                outcomes.append("left")
                                return
                    outcomes.append("done")
                    return
                outcomes.append("cancelled")
            except BackendError:
                outcomes.append("failed")

        async with trio.open_nursery() as nursery:
            for k in range(40):
                nursery.start_soon(one, k)
        assert len(outcomes) == 40
        stats = engine.statistics().models["m"]
        assert_all_ended(engine, accepted=40 - outcomes.count("cancelled"))
        assert stats.failed == outcomes.count("failed") > 0
        assert stats.cancelled == outcomes.count("left") > 0


async def test_admission_bounds_open_streams() -> None:
    probe = Probe()
    async with open_engine() as engine:
        await engine.load(config(counting(probe, pause=math.inf), max_queue_size=2))
        async with (
            engine.infer_stream("m", n(1)),
            engine.infer_stream("m", n(1)),
        ):
            with pytest.raises(QueueFull, match=r"has 2 streams open, its max_queue_size"):
                async with engine.infer_stream("m", n(1)):
                    pass  # pragma: no cover
        # Both left: their places are free again.
        async with engine.infer_stream("m", n(1)), engine.infer_stream("m", n(1)):
            pass
        stats = engine.statistics().models["m"]
        assert (stats.refused, stats.cancelled, stats.in_flight) == (1, 4, 0)


async def test_streams_go_to_the_least_busy_instance() -> None:
    devices: list[int] = []

    class Where:
        def __init__(self, device: str) -> None:
            self.me = id(self)

        async def infer(self, inputs: Arrays) -> AsyncIterator[Arrays]:
            devices.append(self.me)
            await anyio.sleep(math.inf)
            yield {}  # pragma: no cover

    async with open_engine() as engine:
        await engine.load(config(Where, instances=[trioinfer.Instance(count=2)]))
        async with engine.infer_stream("m", n(1)) as a, engine.infer_stream("m", n(1)) as b:
            for stream in (a, b):
                with trio.move_on_after(0.01):
                    await stream.__anext__()
    assert len(devices) == 2
    assert len(set(devices)) == 2


async def test_unloading_ends_an_open_stream_with_engine_closed() -> None:
    probe = Probe()
    async with open_engine(drain_period=0) as engine:
        await engine.load(config(counting(probe, pause=math.inf)))
        ended = []

        async def read() -> None:
            with pytest.raises(EngineClosed, match=r"model 'm' was unloaded or the engine closed"):
                await collect(engine, "m", n(3))
            ended.append(probe.ended)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            await trio.testing.wait_all_tasks_blocked()
            await engine.unload("m")
        assert ended == ["Cancelled"]


async def test_a_models_instances_close_after_its_streams() -> None:
    """Unloading ends the streams first: no generator runs on a model already closed."""
    events: list[str] = []

    class Model:
        async def infer(self, inputs: Arrays) -> AsyncIterator[Arrays]:
            try:
                await anyio.sleep(math.inf)
                yield {}  # pragma: no cover
            finally:
                with anyio.CancelScope(shield=True):
                    await anyio.sleep(0.05)  # clean-up that takes a while
                events.append("generator closed")

        def close(self) -> None:
            events.append("instance closed")

    async with open_engine(drain_period=0) as engine:
        await engine.load(config(Model))

        async def read() -> None:
            with pytest.raises(EngineClosed):
                await collect(engine, "m", n(1))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            await trio.testing.wait_all_tasks_blocked()
            await engine.unload("m")
    assert events == ["generator closed", "instance closed"]


async def test_nothing_a_stream_started_outlives_the_engine() -> None:
    """A stream read from outside the engine's block ends when the engine does."""
    probe = Probe()
    outcome = []

    class SlowToClose:
        async def infer(self, inputs: Arrays) -> AsyncIterator[Arrays]:
            try:
                await anyio.sleep(math.inf)
                yield {}  # pragma: no cover
            finally:
                with anyio.CancelScope(shield=True):
                    await anyio.sleep(0.05)  # clean-up that takes a while
                probe.ended = "cleaned up"

    async def read(engine: trioinfer.Engine) -> None:
        try:
            await collect(engine, "m", n(3))
        except EngineClosed:
            outcome.append("EngineClosed")

    async with trio.open_nursery() as nursery:
        async with open_engine(drain_period=0) as engine:
            await engine.load(config(SlowToClose))
            assert engine.model("m").decoupled
            nursery.start_soon(read, engine)
            await trio.testing.wait_all_tasks_blocked()
        # The engine's block has returned: the model's generator has closed already.
        assert probe.ended == "cleaned up"
    assert outcome == ["EngineClosed"]


async def test_infer_and_infer_stream_on_the_other_kind_of_model() -> None:
    class Plain:
        async def infer(self, inputs: Arrays) -> Arrays:
            return {"i": inputs["n"] * 2}

    async with open_engine() as engine:
        await engine.load(config(counting(Probe()), "stream"))
        await engine.load(
            ModelConfig(
                name="plain",
                path="-",
                backend="python",
                backend_options={"class": Plain, **SIGNATURE},
            )
        )
        assert not engine.model("plain").decoupled
        with pytest.raises(InvalidInput, match=r"model 'stream' is decoupled.*infer_stream"):
            await engine.infer("stream", n(3))
        async with engine.infer_stream("plain", n(21)) as responses:
            assert [int(r["i"][0]) async for r in responses] == [42]
        with pytest.raises(InvalidInput, match=r"expected|dtype|int32"):
            async with engine.infer_stream("stream", {"n": np.array([1.5])}):
                pass  # pragma: no cover


async def test_decoupled_must_match_the_model_class() -> None:
    class Plain:
        async def infer(self, inputs: Arrays) -> Arrays:
            return {}  # pragma: no cover

    class SyncGenerator:
        def infer(self, inputs: Arrays) -> Any:
            yield {}  # pragma: no cover

    async with open_engine() as engine:
        with pytest.raises(ConfigError, match=r"decoupled = true needs Plain.infer to be an async"):
            await engine.load(config(Plain))
        with pytest.raises(ConfigError, match=r"is an async generator.*set backend option decoup"):
            await engine.load(
                ModelConfig(
                    name="m",
                    path="-",
                    backend="python",
                    backend_options={"class": counting(Probe()), **SIGNATURE},
                )
            )
        with pytest.raises(ConfigError, match=r"plain generator"):
            await engine.load(config(SyncGenerator))
        with pytest.raises(ConfigError, match=r"decoupled of model 'm' must be true or false"):
            await engine.load(_bad_flag())


async def test_a_generator_in_a_model_file_needs_decoupled(tmp_path: Path) -> None:
    (tmp_path / "model.py").write_text(
        "class Model:\n    async def infer(self, inputs):\n        yield {'i': inputs['n']}\n"
    )
    options = {"class": "Model", **SIGNATURE}
    on_disk = ModelConfig(
        name="m", path=tmp_path / "model.py", backend="python", backend_options=options
    )
    async with open_engine() as engine:
        with pytest.raises(ConfigError, match=r"Model.infer is an async generator"):
            await engine.load(on_disk)
        await engine.load(attrs.evolve(on_disk, backend_options={**options, "decoupled": True}))
        async with engine.infer_stream("m", n(5)) as responses:
            assert [int(r["i"][0]) async for r in responses] == [5]


def _bad_flag() -> ModelConfig:
    options = {"class": counting(Probe()), "decoupled": "yes", **SIGNATURE}
    return ModelConfig(name="m", path="-", backend="python", backend_options=options)


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_the_stream_refuses_use_outside_its_block(backend: str) -> None:
    """Iterating a stream after its block is a typed error saying so, on either loop."""
    errors: list[trioinfer.StreamClosed] = []

    async def main() -> None:
        async with open_engine() as engine:
            await engine.load(config(counting(Probe())))
            async with engine.infer_stream("m", n(3), request_id="r") as responses:
                pass
            with pytest.raises(trioinfer.StreamClosed) as left:
                await responses.__anext__()
            errors.append(left.value)
            # Read to its end inside, then iterated again outside: the same error.
            async with engine.infer_stream("m", n(2)) as finished:
                assert [int(r["i"][0]) async for r in finished] == [0, 1]
            with pytest.raises(trioinfer.StreamClosed):
                async for _ in finished:
                    pass

    anyio.run(main, backend=backend)
    (error,) = errors
    assert isinstance(error, trioinfer.TrioInferError)
    assert isinstance(error, anyio.ClosedResourceError)  # as it was before it had a class
    assert str(error) == (
        "the response stream of request 'r' is closed: its `async with "
        "engine.infer_stream(...)` block has ended; iterate it inside that block"
    )


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_aclose_stops_the_model_as_leaving_the_block_does(backend: str) -> None:
    """An iterator held apart from its block (contextlib.aclosing) closes the model at its
    yield: once aclose() returns, the model makes no response more; a second is a no-op."""
    seen: dict[str, Any] = {}

    async def main() -> None:
        probe, waiting = Probe(), Probe()
        async with open_engine() as engine:
            await engine.load(config(counting(probe)))
            await engine.load(config(counting(waiting, pause=60), "waiting"))
            async with engine.infer_stream("m", n(1000), request_id="r") as responses:
                got = [int((await responses.__anext__())["i"][0]) for _ in range(3)]
                await responses.aclose()
                made = probe.made
                for _ in range(10):  # time for the model to run on, were it still running
                    await anyio.lowlevel.checkpoint()
                seen["after"] = probe.made - made
                await responses.aclose()  # idempotent
                with pytest.raises(trioinfer.StreamClosed) as closed:
                    await responses.__anext__()
                seen["closed"] = str(closed.value)
            seen["got"], seen["ended"] = got, probe.ended
            # contextlib.aclosing, in an await of the model's own (not at a yield).
            async with engine.infer_stream("waiting", n(5)) as responses:
                async with contextlib.aclosing(responses):
                    with anyio.move_on_after(0.01):
                        await responses.__anext__()
                seen["waiting"] = (waiting.made, waiting.ended)
            # Read to its end, or not decoupled: nothing to stop, and not a cancellation.
            async with engine.infer_stream("m", n(2)) as finished:
                assert [int(r["i"][0]) async for r in finished] == [0, 1]
                await finished.aclose()

            class Slow:  # not decoupled: its one answer, by engine.infer, cancelled
                async def infer(self, inputs: Arrays) -> Arrays:
                    await anyio.sleep(60)
                    raise AssertionError("not cancelled")  # pragma: no cover

            options = {"class": Slow, **SIGNATURE}
            await engine.load(
                ModelConfig(name="plain", path="-", backend="python", backend_options=options)
            )
            async with engine.infer_stream("plain", n(1)) as one:
                await anyio.sleep(0.01)  # in the model's await
                await one.aclose()
                with pytest.raises(trioinfer.StreamClosed):
                    await one.__anext__()
            assert_all_ended(engine, accepted=4)
            seen["stats"] = {
                name: (s.succeeded, s.failed, s.cancelled)
                for name, s in engine.statistics().models.items()
            }

    anyio.run(main, backend=backend)
    assert seen["got"] == [0, 1, 2]
    assert seen["after"] == 0
    assert seen["ended"] == "closed at its yield"
    cancelled = "CancelledError" if backend == "asyncio" else "Cancelled"
    assert seen["waiting"] == (0, cancelled)
    assert seen["closed"] == (
        "the response stream of request 'r' is closed: its aclose() was called; it has no "
        "more responses"
    )
    assert seen["stats"]["m"] == (1, 0, 1)
    assert seen["stats"]["waiting"] == (0, 0, 1)
    assert seen["stats"]["plain"] == (0, 0, 1)


async def test_a_decoupled_model_cannot_be_stateful() -> None:
    # Streams bypass the sequence batcher, so its controls and state would never come.
    closed: list[str] = []

    class Closing(counting(Probe())):  # type: ignore[misc]
        def close(self) -> None:
            closed.append("closed")

    async with open_engine() as engine:
        with pytest.raises(ConfigError, match=r"is decoupled .* and stateful"):
            await engine.load(config(Closing, batcher="sequence", sequence={"strategy": "oldest"}))
        assert closed == ["closed"]  # its instance was closed, not left behind
        with pytest.raises(trioinfer.ModelNotFound):
            engine.model("m")


async def test_a_decoupled_model_may_not_need_resources() -> None:
    """Its streams run outside executions, where the rate limiter takes resources."""

    class Backend:
        async def load(self, config: ModelConfig, placement: Any) -> _Yields:
            return _Yields([])

    registry = trioinfer.Registry(extra={"backends": {"third": Backend}})
    async with open_engine(registry=registry) as engine:
        needs = trioinfer.Instance(resources={"R": 1})
        with pytest.raises(trioinfer.ConfigError, match=r"decoupled.*expected no resources"):
            await engine.load(ModelConfig(name="m", path="-", backend="third", instances=[needs]))
        assert engine.models() == []
        assert engine.statistics().resources == ()


async def test_a_stream_whose_model_has_ended_counts_as_such_when_its_reader_leaves() -> None:
    """Its model made every response (they wait in the buffer): the stream has succeeded."""
    probe = Probe()
    async with open_engine() as engine:
        await engine.load(config(counting(probe)))
        async with engine.infer_stream("m", n(5)) as responses:
            async for _ in responses:
                break
            with trio.fail_after(5):
                await probe.closed.wait()  # the other four made (room for them), unread
        assert probe.ended == "returned"
        stats = engine.statistics().models["m"]
        assert (stats.succeeded, stats.cancelled) == (1, 0)
        assert_all_ended(engine, accepted=1)
