"""Pipelines that batch their own requests: whole requests share one pass of the steps."""

from __future__ import annotations

import math
import re
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import anyio
import httpx
import numpy as np
import pytest
import trio
import trio.testing

import trioinfer
from _serve import start_serving
from _triton_config import own_setting
from trioinfer import (
    BackendError,
    ConfigError,
    DeadlineExceeded,
    InvalidInput,
    ModelConfig,
    example_repository,
    open_engine,
)
from trioinfer.lowlevel import current_batch_deadline

pytestmark = pytest.mark.pipeline

Arrays = dict[str, np.ndarray[Any, Any]]
X = np.ones((1, 4), np.float32)
POISON = -1.0  # a row holding it is refused by every step (InvalidInput)


def tensor(name: str, shape: tuple[Any, ...] = ("batch", 4)) -> dict[str, Any]:
    return {"name": name, "dtype": "float32", "shape": list(shape)}


class Rows:
    """y = x + 1 after *delay* seconds; records each call's rows and batch deadline."""

    rows: ClassVar[dict[str, list[int]]] = {}
    deadlines: ClassVar[dict[str, list[float]]] = {}

    def __init__(self, name: str, delay: float = 0.0, broken: bool = False) -> None:
        self.name, self.delay, self.broken = name, delay, broken

    async def infer(self, inputs: Arrays) -> Arrays:
        x = inputs["x"]
        Rows.rows.setdefault(self.name, []).append(len(x))
        Rows.deadlines.setdefault(self.name, []).append(current_batch_deadline())
        await anyio.sleep(self.delay)
        if self.broken:
            raise RuntimeError(f"{self.name} is broken")
        if (x == POISON).any():
            raise InvalidInput(f"{self.name} refuses {POISON}")
        return {"y": x + 1}


@pytest.fixture(autouse=True)
def _reset() -> None:
    Rows.rows.clear()
    Rows.deadlines.clear()


def step_model(name: str, batcher: str = "none", shape: tuple[Any, ...] = ("batch", 4), **kw: Any):
    batching: dict[str, Any] = {"batcher": batcher}
    if batcher == "dynamic":
        batching["batcher_options"] = {"max_batch_size": 64, "max_queue_delay": 0.001}
    return ModelConfig(
        name=name,
        path="-",
        backend="python",
        backend_options={
            "class": Rows,
            "parameters": {"name": name, **kw},
            "inputs": [tensor("x", shape)],
            "outputs": [tensor("y", shape)],
        },
        **batching,
    )


CHAIN = [
    {"model": "first", "input_map": {"x": "IN"}, "output_map": {"y": "A"}},
    {"model": "second", "input_map": {"x": "A"}, "output_map": {"y": "B"}},
    {"model": "third", "input_map": {"x": "B"}, "output_map": {"y": "OUT"}},
]


def pipeline(
    steps: list[dict[str, Any]] = CHAIN,
    max_batch_size: int = 8,
    delay: float = 0.01,
    shape: tuple[Any, ...] = ("batch", 4),
    **kw: Any,
) -> ModelConfig:
    options = {"inputs": [tensor("IN", shape)], "outputs": [tensor("OUT", shape)], "steps": steps}
    options.update(kw.pop("backend_options", {}))
    return ModelConfig(
        name="p",
        path="-",
        backend="pipeline",
        backend_options=options,
        batcher="dynamic",
        batcher_options={
            "max_batch_size": max_batch_size,
            "max_queue_delay": delay,
            **kw.pop("batcher_options", {}),
        },
        **kw,
    )


async def load_chain(
    engine: trioinfer.Engine, delays: tuple[float, float, float] = (0, 0, 0), **kw: Any
) -> None:
    for (name, delay), broken in zip(
        zip(("first", "second", "third"), delays, strict=True),
        (False, kw.pop("second_broken", False), False),
        strict=True,
    ):
        await engine.load(step_model(name, kw.pop(f"{name}_batcher", "none"), delay=delay,
                                     broken=broken))  # fmt: skip
    await engine.load(pipeline(**kw))


def row(i: int, poison: int | None = None) -> np.ndarray[Any, Any]:
    """Member *i*'s row: all *i*, or all POISON for the member numbered *poison*."""
    return np.full((1, 4), POISON if i == poison else i, np.float32)


async def answer(
    engine: trioinfer.Engine,
    x: np.ndarray[Any, Any],
    refusals: tuple[type[Exception], ...] = (InvalidInput,),
    **kw: Any,
) -> object:
    """The pipeline's OUT for *x*, or the error (one of *refusals*) it ended with."""
    try:
        return (await engine.infer("p", {"IN": x}, **kw))["OUT"]
    except refusals as exc:
        return exc


async def all_at_once(call: Callable[[int], Awaitable[None]], members: int) -> None:
    """Run call(0) ... call(members - 1) side by side, until each has ended."""
    async with anyio.create_task_group() as tg:
        for i in range(members):
            tg.start_soon(call, i)


async def test_whole_requests_share_one_pass_of_the_steps(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_engine() as engine:
        await load_chain(engine)
        info = engine.model("p")
        assert info.devices == ("cpu",)
        assert info.config.batcher == "dynamic"
        results: dict[int, np.ndarray[Any, Any]] = {}

        async def call(i: int) -> None:
            results[i] = (await engine.infer("p", {"IN": X * i}))["OUT"]

        await all_at_once(call, 8)
        for i in range(8):
            np.testing.assert_array_equal(results[i], X * i + 3)
        # One step request of 8 rows per step, not 8 of one row each.
        assert Rows.rows == {"first": [8], "second": [8], "third": [8]}
        stats = engine.statistics().models
        assert (stats["p"].succeeded, stats["p"].executions, stats["p"].in_flight) == (8, 1, 0)
        assert stats["p"].batch_size.count == 1
        assert stats["p"].batch_size.sum == 8
        assert stats["p"].request_duration.count == 8  # each member counted
        assert [stats[m].succeeded for m in ("first", "second", "third")] == [1, 1, 1]
        detailed = await engine.infer_detailed("p", {"IN": X})
        assert (detailed.model, detailed.instance, detailed.device) == ("p", 0, "cpu")


async def test_batched_steps_take_the_batch_as_one_request(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_engine() as engine:
        await load_chain(engine, second_batcher="dynamic")
        async with anyio.create_task_group() as tg:
            for i in range(5):
                tg.start_soon(engine.infer, "p", {"IN": X * i})
        assert Rows.rows == {"first": [5], "second": [5], "third": [5]}
        stats = engine.statistics().models["second"]
        assert (stats.succeeded, stats.executions) == (1, 1)


async def test_departed_members_are_dropped_before_the_next_step(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_engine() as engine:
        await load_chain(engine, delays=(1.0, 0.0, 0.0))
        results: dict[int, object] = {}

        async def call(i: int) -> None:
            with trio.move_on_after(0.5 if i % 2 else math.inf):
                results[i] = (await engine.infer("p", {"IN": X * i}))["OUT"]
                return
            results[i] = "left"

        await all_at_once(call, 4)
        assert results[1] == results[3] == "left"
        np.testing.assert_array_equal(results[0], X * 0 + 3)  # type: ignore[arg-type]
        np.testing.assert_array_equal(results[2], X * 2 + 3)  # type: ignore[arg-type]
        # Members 1 and 3 left while the first step ran: the next steps got two rows.
        assert Rows.rows == {"first": [4], "second": [2], "third": [2]}
        stats = engine.statistics().models["p"]
        assert (stats.succeeded, stats.cancelled, stats.in_flight) == (2, 2, 0)


async def test_members_past_their_queue_timeout_end_before_the_next_step(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_engine() as engine:
        # Priority 0 has a queue timeout (a deadline the caller did not set); 1 has none.
        await load_chain(engine, delays=(1.0, 0.0, 0.0), queue_timeouts={"0": 0.5})
        outcomes: dict[int, object] = {}

        async def call(i: int) -> None:
            outcomes[i] = await answer(engine, X, (DeadlineExceeded,), priority=i % 2)

        await all_at_once(call, 4)
        assert isinstance(outcomes[0], DeadlineExceeded)
        assert isinstance(outcomes[2], DeadlineExceeded)
        np.testing.assert_array_equal(outcomes[1], X + 3)  # type: ignore[arg-type]
        assert Rows.rows == {"first": [4], "second": [2], "third": [2]}
        stats = engine.statistics().models["p"]
        assert (stats.succeeded, stats.expired, stats.in_flight) == (2, 2, 0)


async def test_a_batch_whose_every_member_expired_stops(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_engine() as engine:
        await load_chain(engine, delays=(1.0, 0.0, 0.0), queue_timeouts={"0": 0.5})
        errors: list[BaseException] = []

        async def call() -> None:
            with pytest.raises(DeadlineExceeded) as info:
                await engine.infer("p", {"IN": X})
            errors.append(info.value)

        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(call)
        assert len(errors) == 3
        assert Rows.rows == {"first": [3]}  # nobody waited for the second step
        stats = engine.statistics().models["p"]
        assert (stats.expired, stats.succeeded, stats.in_flight) == (3, 0, 0)


async def test_a_member_that_expires_while_others_rerun_is_not_rerun(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_engine() as engine:
        # Priority 0 times out at 1.5 s; the batch's first step refuses it at 1 s, and
        # member 0's rerun of that step ends at 2 s: member 1 expired meanwhile.
        await load_chain(engine, delays=(1.0, 0.0, 0.0), queue_timeouts={"0": 1.5})
        outcomes: dict[int, object] = {}

        async def call(i: int, priority: int) -> None:
            refusals = (InvalidInput, DeadlineExceeded)
            outcomes[i] = await answer(engine, row(i, poison=2), refusals, priority=priority)

        async with anyio.create_task_group() as tg:
            for i, priority in ((0, 1), (1, 0), (2, 1)):
                tg.start_soon(call, i, priority)
                await trio.sleep(0.001)  # in this order (one batch: the delay is 10 ms)
        np.testing.assert_array_equal(outcomes[0], np.full((1, 4), 3, np.float32))  # type: ignore[arg-type]
        assert isinstance(outcomes[1], DeadlineExceeded)
        assert isinstance(outcomes[2], InvalidInput)
        assert Rows.rows == {"first": [3, 1, 1], "second": [1], "third": [1]}
        stats = engine.statistics().models["p"]
        assert (stats.succeeded, stats.expired, stats.failed, stats.in_flight) == (1, 1, 1, 0)


class Zed:
    async def infer(self, inputs: Arrays) -> Arrays:
        return {"z": inputs["x"]}


async def test_a_step_model_replaced_by_one_without_its_outputs(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_engine() as engine:
        await load_chain(engine)
        options = {"class": Zed, "inputs": [tensor("x")], "outputs": [tensor("z")]}
        await engine.load(
            ModelConfig(name="second", path="-", backend="python", backend_options=options),
            replace=True,
        )
        with pytest.raises(BackendError, match=r"step 1 \(model 'second'\): its model answered "
                           r"without outputs \['y'\]"):  # fmt: skip
            await engine.infer("p", {"IN": X})


@pytest.mark.parametrize(
    "latest",
    [
        pytest.param(30.0, id="the-latest-deadline"),
        # A member without a deadline lifts the step's deadline: the latest is none at all.
        pytest.param(math.inf, id="a-member-without-a-deadline-lifts-it"),
    ],
)
async def test_each_step_request_carries_the_latest_remaining_deadline(
    latest: float, autojump_clock: trio.testing.MockClock
) -> None:
    async with open_engine() as engine:
        await load_chain(engine, delays=(1.0, 1.0, 0.0))
        t0 = trio.current_time()
        scopes: dict[float, trio.CancelScope] = {}

        async def call(budget: float) -> None:
            with trio.move_on_after(budget) as scope:
                scopes[budget] = scope
                await engine.infer("p", {"IN": X})

        async with anyio.create_task_group() as tg:
            for budget in (10.0, latest, 20.0):
                tg.start_soon(call, budget)
            await trio.sleep(0.5)  # the batch is in its first step
            scopes[latest].cancel()
        assert Rows.deadlines["first"] == [t0 + latest]
        # The member with the latest deadline left: the next steps carry the latest left.
        assert Rows.deadlines["second"] == [t0 + 20]
        assert Rows.deadlines["third"] == [t0 + 20]
        assert Rows.rows["second"] == [2]


async def test_a_failing_step_fails_every_member_once_with_its_name(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_engine() as engine:
        await load_chain(engine, second_broken=True)
        errors: list[BaseException] = []

        async def call(i: int) -> None:
            try:
                await engine.infer("p", {"IN": X * i})
            except BackendError as exc:
                errors.append(exc)

        await all_at_once(call, 4)
        assert len(errors) == 4
        assert len({id(e) for e in errors}) == 4  # each caller its own exception object
        for error in errors:
            assert str(error).startswith("pipeline 'p', step 1 (model 'second'): ")
            assert "second is broken" in str(error)
        assert Rows.rows == {"first": [4], "second": [4]}  # tried once, for the batch
        stats = engine.statistics().models["p"]
        assert (stats.succeeded, stats.failed, stats.in_flight) == (0, 4, 0)


async def test_invalid_input_reruns_each_member_alone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_engine() as engine:
        await load_chain(engine)
        outcomes: dict[int, object] = {}

        async def call(i: int) -> None:
            outcomes[i] = await answer(engine, row(i, poison=2))

        await all_at_once(call, 4)
        for i in (0, 1, 3):
            np.testing.assert_array_equal(outcomes[i], np.full((1, 4), i + 3, np.float32))  # type: ignore[arg-type]
        assert isinstance(outcomes[2], InvalidInput)
        assert str(outcomes[2]).startswith("pipeline 'p', step 0 (model 'first'): first refuses")
        # The batch once, then each member alone, one after the other; the bad one stops.
        assert Rows.rows == {"first": [4, 1, 1, 1, 1], "second": [1, 1, 1], "third": [1, 1, 1]}
        stats = engine.statistics().models["p"]
        assert (stats.succeeded, stats.failed, stats.in_flight) == (3, 1, 0)


class Join:
    """y = a + b; records each call's rows."""

    calls: ClassVar[list[int]] = []

    async def infer(self, inputs: Arrays) -> Arrays:
        Join.calls.append(len(inputs["a"]))
        return {"y": inputs["a"] + inputs["b"]}


# IN -> first -> A; IN -> second -> B (side by side); A + B -> join -> OUT
DIAMOND = [
    {"model": "first", "input_map": {"x": "IN"}, "output_map": {"y": "A"}},
    {"model": "second", "input_map": {"x": "IN"}, "output_map": {"y": "B"}},
    {"model": "join", "input_map": {"a": "A", "b": "B"}, "output_map": {"y": "OUT"}},
]


async def test_side_by_side_steps_of_a_batch(autojump_clock: trio.testing.MockClock) -> None:
    Join.calls.clear()
    async with open_engine() as engine:
        await engine.load(step_model("first", delay=1.0))
        await engine.load(step_model("second", delay=1.0, broken=True))
        await engine.load(
            ModelConfig(
                name="join",
                path="-",
                backend="python",
                backend_options={
                    "class": Join,
                    "inputs": [tensor("a"), tensor("b")],
                    "outputs": [tensor("y")],
                },
            )
        )
        await engine.load(pipeline(DIAMOND))
        t0 = trio.current_time()
        errors: list[BaseException] = []

        async def call(i: int) -> None:
            try:
                await engine.infer("p", {"IN": X * i})
            except BackendError as exc:
                errors.append(exc)

        await all_at_once(call, 3)
        # first and second ran at once, on the batch; second's failure ended all three.
        assert Rows.rows == {"first": [3], "second": [3]}
        assert trio.current_time() - t0 < 1.1
        assert [str(e).split(": ")[0] for e in errors] == [
            "pipeline 'p', step 1 (model 'second')"
        ] * 3
        assert Join.calls == []
        # A side by side pipeline that works, and one member refused by the last step.
        await engine.load(step_model("second"), replace=True)
        outcomes: dict[int, object] = {}

        async def good(i: int) -> None:
            outcomes[i] = await answer(engine, row(i, poison=1))

        Rows.rows.clear()
        await all_at_once(good, 3)
        np.testing.assert_array_equal(outcomes[0], np.full((1, 4), 2, np.float32))  # type: ignore[arg-type]
        np.testing.assert_array_equal(outcomes[2], np.full((1, 4), 6, np.float32))  # type: ignore[arg-type]
        assert isinstance(outcomes[1], InvalidInput)
        # Both side by side steps refuse its row; whichever said so first is named.
        assert re.match(r"pipeline 'p', step [01] \(model '(first|second)'\): ", str(outcomes[1]))
        # The batch's round once, then each member alone from that round on. (first may
        # not have begun the batch's round when second refused the row: side by side, which
        # step starts first hangs on the inline slices, timed by the real clock.)
        first = Rows.rows["first"]
        assert first[0] in (1, 3), first
        assert first[1:] == [1] * (len(first) - 1), first
        assert sorted(Join.calls) == [1, 1]


async def test_a_lone_member_refused_by_a_step_is_not_rerun(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_engine() as engine:
        await load_chain(engine)
        with pytest.raises(InvalidInput, match=r"step 0 \(model 'first'\): first refuses"):
            await engine.infer("p", {"IN": np.full((1, 4), POISON, np.float32)})
        assert Rows.rows == {"first": [1]}


async def test_every_member_ends_exactly_once_under_cancellation(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_engine() as engine:
        await load_chain(engine, delays=(0.3, 0.3, 0.3), max_batch_size=4, delay=0.05,
                         first_batcher="dynamic")  # fmt: skip
        ended: dict[int, list[str]] = {i: [] for i in range(24)}

        async def call(i: int) -> None:
            x = np.full((1, 4), POISON if i % 7 == 3 else i, np.float32)
            with trio.move_on_after(0.05 + 0.1 * (i % 11) if i % 3 == 0 else math.inf) as scope:
                try:
                    await engine.infer("p", {"IN": x})
                    ended[i].append("ok")
                except InvalidInput:
                    ended[i].append("invalid")
            if scope.cancelled_caught:
                ended[i].append("cancelled")

        async with anyio.create_task_group() as tg:
            for i in range(24):
                tg.start_soon(call, i)
                await trio.sleep(0.02 * (i % 5))
        assert all(len(outcome) == 1 for outcome in ended.values()), ended
        stats = engine.statistics().models
        p = stats["p"]
        assert p.in_flight == 0
        assert p.succeeded + p.failed + p.cancelled + p.expired == 24
        assert p.succeeded == sum(o == ["ok"] for o in ended.values())
        assert p.failed == sum(o == ["invalid"] for o in ended.values())
        assert all(stats[m].in_flight == 0 for m in ("first", "second", "third"))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"step_shape": (1, 4)},
            r"step 0 \(model 'first'\) has no batch dimension: 'x' is float32\[1, 4\]",
        ),
        ({"shape": (4,)}, r"so its inputs and outputs need a batch dimension"),
        ({"backend_options": {"dispatch": "inline"}}, r"unknown option 'dispatch'"),
        (
            {"batcher_options": {"pad_axis": 1, "pad_buckets": [4]}},
            r"its batcher lays out batches itself \(padding with pad_axis",
        ),
    ],
)
async def test_a_batched_pipeline_is_refused_when_its_rows_cannot_be_batched(
    change: dict[str, Any], message: str
) -> None:
    async with open_engine() as engine:
        shape = change.pop("step_shape", change.get("shape", ("batch", 4)))
        await engine.load(step_model("first", shape=shape))
        steps = [{"model": "first", "input_map": {"x": "IN"}, "output_map": {"y": "OUT"}}]
        with pytest.raises(ConfigError, match=message):
            await engine.load(pipeline(steps, **change))
        assert [m.name for m in engine.models()] == ["first"]


async def test_a_pipeline_with_batcher_none_stays_unbatched() -> None:
    async with open_engine() as engine:
        await load_chain(engine)
        await engine.load(
            ModelConfig(
                name="q",
                path="-",
                backend="pipeline",
                backend_options=dict(pipeline().backend_options),
            )
        )
        assert engine.model("q").devices == ()  # the unbatched kind: no instances of its own
        out = await engine.infer("q", {"IN": X})
        np.testing.assert_array_equal(out["OUT"], X + 3)


async def test_the_bundled_batched_pipeline_over_http() -> None:
    """read_digit batches itself; a bad image fails alone, with the step named, over HTTP."""

    images, labels = trioinfer.digits_samples()
    names = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    answers: dict[int, httpx.Response] = {}
    async with trio.open_nursery() as nursery:
        listening = await start_serving(nursery, example_repository())
        async with httpx.AsyncClient(base_url=listening.urls[0]) as client:

            async def post(i: int) -> None:
                pixels = images[i].reshape(1, 8, 8).astype(np.uint8)
                if i == 5:
                    pixels[0, 0, 0] = 200
                body = {
                    "inputs": [
                        {
                            "name": "IMAGE",
                            "shape": [1, 8, 8],
                            "datatype": "UINT8",
                            "data": pixels.ravel().tolist(),
                        }
                    ]
                }
                answers[i] = await client.post("/v2/models/read_digit/infer", json=body)

            async with trio.open_nursery() as clients:
                for i in range(12):
                    clients.start_soon(post, i)
            config = (await client.get("/v2/models/read_digit/config")).json()
            stats = (await client.get("/v2/models/read_digit/stats")).json()
        nursery.cancel_scope.cancel()
    assert own_setting(config, "batcher") == "dynamic"
    assert config["max_batch_size"] == 32
    for i in range(12):
        if i == 5:
            assert answers[i].status_code == 400
            assert (
                answers[i]
                .json()["error"]
                .startswith(
                    "pipeline 'read_digit' (version 1), step 0 (model 'scale_image' (version 1)): "
                    "image holds an intensity of 200"
                )
            )
        else:
            assert answers[i].status_code == 200, answers[i].text
            assert answers[i].json()["outputs"][0]["data"] == [names[labels[i]]]
    (model,) = stats["model_stats"]
    assert model["inference_stats"]["success"]["count"] == 11
    assert model["inference_stats"]["fail"]["count"] == 1


def test_a_batched_pipeline_on_asyncio() -> None:
    """The same batching, departures and reruns on asyncio (the core is written on anyio)."""

    async def main() -> dict[int, object]:
        outcomes: dict[int, object] = {}
        async with open_engine() as engine:
            await load_chain(engine, delays=(0.2, 0.0, 0.0), delay=0.05)

            async def call(i: int) -> None:
                with anyio.move_on_after(0.1 if i == 1 else math.inf):
                    outcomes[i] = await answer(engine, row(i, poison=3))
                    return
                outcomes[i] = "left"

            await all_at_once(call, 4)
            assert engine.statistics().models["p"].in_flight == 0
        return outcomes

    outcomes = anyio.run(main, backend="asyncio")
    assert outcomes[1] == "left"
    assert isinstance(outcomes[3], InvalidInput)
    for i in (0, 2):
        np.testing.assert_array_equal(outcomes[i], np.full((1, 4), i + 3, np.float32))  # type: ignore[arg-type]
    # One batch of four, refused by the first step for member 3's row: the members still
    # waiting rerun alone (member 1 left meanwhile), the bad one stopping there.
    assert Rows.rows["first"] == [4, 1, 1, 1]
    assert Rows.rows["second"] == [1, 1]


async def test_a_member_rerun_alone_is_answered_when_its_own_run_ends(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_engine() as engine:
        # The batch's first step refuses member 1's row at 1 s; then each reruns alone
        # for a second: member 0 by 2 s, member 1 (refused again) by 3 s, member 2 by 4 s.
        await load_chain(engine, delays=(1.0, 0.0, 0.0))
        t0 = trio.current_time()
        ended: dict[int, float] = {}
        outcomes: dict[int, object] = {}

        async def call(i: int) -> None:
            # Member 0 may wait 3 s: its own answer is there at 2 s, the others' later.
            with trio.move_on_after(3.0 if i == 0 else math.inf):
                outcomes[i] = await answer(engine, row(i, poison=1))
                ended[i] = trio.current_time() - t0
                return
            outcomes[i] = "left"

        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(call, i)
                await trio.sleep(0.001)  # in this order (one batch: the delay is 10 ms)
        np.testing.assert_array_equal(outcomes[0], np.full((1, 4), 3, np.float32))  # type: ignore[arg-type]
        assert isinstance(outcomes[1], InvalidInput)
        np.testing.assert_array_equal(outcomes[2], np.full((1, 4), 5, np.float32))  # type: ignore[arg-type]
        assert ended[0] < ended[1] < ended[2]  # each as its own rerun ends
        stats = engine.statistics().models["p"]
        assert (stats.succeeded, stats.failed, stats.cancelled, stats.in_flight) == (2, 1, 0, 0)
        assert stats.request_duration.count == 2
        detailed = await engine.infer_detailed("p", {"IN": X})  # served_by as for a batch
        assert (detailed.instance, detailed.device) == (0, "cpu")


async def test_a_member_that_leaves_during_its_rerun_stops_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_engine() as engine:
        # The batch's first step refuses member 0's row at 1 s; member 0 reruns alone
        # until 2 s, then member 1, whose caller leaves at 2.5 s (not a deadline: a
        # client that went away), then member 2.
        await load_chain(engine, delays=(1.0, 0.0, 0.0))
        t0 = trio.current_time()
        scopes: dict[int, trio.CancelScope] = {}
        outcomes: dict[int, object] = {}

        async def call(i: int) -> None:
            with trio.CancelScope() as scopes[i]:
                outcomes[i] = await answer(engine, row(i, poison=0))
                return
            outcomes[i] = "left"

        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(call, i)
                await trio.sleep(0.001)  # in this order (one batch: the delay is 10 ms)
            await trio.sleep(2.5)
            scopes[1].cancel()
            await trio.sleep(0.5)
            # Member 1's rerun stopped as its caller left: member 2's runs since 2.5 s.
            assert Rows.rows["first"] == [3, 1, 1, 1]
            assert engine.statistics().models["first"].cancelled == 1
        assert trio.current_time() - t0 < 4.0
        assert isinstance(outcomes[0], InvalidInput)
        assert outcomes[1] == "left"
        np.testing.assert_array_equal(outcomes[2], np.full((1, 4), 5, np.float32))  # type: ignore[arg-type]
        stats = engine.statistics().models["p"]
        assert (stats.succeeded, stats.failed, stats.cancelled, stats.in_flight) == (1, 1, 1, 0)


async def test_reruns_alone_with_refusals_departures_and_deadlines_end_each_member_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Every way a member rerun alone can end, in one batch: each ends once, as counted.

    The first step takes 1 s and refuses member 0's row: the batch's pass ends at
    1 s, then each member reruns alone in turn, member 0 (refused again) until 2 s.
    Queue timeouts: member 1's (priority 0) passes at 2.5 s, during its own rerun;
    member 2's (priority 2) at 1.5 s, before its turn. Member 3 reruns from 2.5 s to
    3.5 s (only the first step is slow); member 5's caller leaves at 3 s, before its
    turn; member 4's at 4 s, during its own rerun; member 6 reruns from 4 s.
    """
    async with open_engine() as engine:
        await load_chain(engine, delays=(1.0, 0.0, 0.0), queue_timeouts={"0": 2.5, "2": 1.5})
        t0 = trio.current_time()
        scopes: dict[int, trio.CancelScope] = {}
        outcomes: dict[int, object] = {}

        async def call(i: int) -> None:
            with trio.CancelScope() as scopes[i]:
                refusals = (InvalidInput, DeadlineExceeded)
                priority = {1: 0, 2: 2}.get(i, 1)
                outcomes[i] = await answer(engine, row(i, poison=0), refusals, priority=priority)
                return
            outcomes[i] = "left"

        async def leave(i: int, at: float) -> None:
            await trio.sleep_until(t0 + at)
            scopes[i].cancel()

        async with anyio.create_task_group() as tg:
            for i in range(7):
                tg.start_soon(call, i)
                await trio.sleep(0.001)  # in this order (one batch: the delay is 10 ms)
            tg.start_soon(leave, 5, 3.0)
            tg.start_soon(leave, 4, 4.0)
        assert isinstance(outcomes[0], InvalidInput)
        assert isinstance(outcomes[1], DeadlineExceeded)
        assert isinstance(outcomes[2], DeadlineExceeded)
        np.testing.assert_array_equal(outcomes[3], np.full((1, 4), 6, np.float32))  # type: ignore[arg-type]
        assert outcomes[4] == outcomes[5] == "left"
        np.testing.assert_array_equal(outcomes[6], np.full((1, 4), 9, np.float32))  # type: ignore[arg-type]
        # The batch, then alone: 0 (refused), 1 (cut short), 3, 4 (left), 6.
        assert Rows.rows == {"first": [7, 1, 1, 1, 1, 1], "second": [1, 1], "third": [1, 1]}
        models = engine.statistics().models
        p = models["p"]
        assert (p.succeeded, p.failed, p.expired, p.cancelled, p.in_flight) == (2, 1, 2, 2, 0)
        assert (p.executions, p.request_duration.count) == (1, 2)
        first = models["first"]
        ended = first.succeeded + first.failed + first.expired + first.cancelled
        assert (ended, first.in_flight) == (6, 0)  # each step request once
        assert (first.succeeded, first.failed) == (2, 2)  # 3's and 6's; the batch's and 0's


class Flaky:
    """y = x + 1, failing (transiently) the first *fails* calls."""

    fails: ClassVar[int] = 0

    async def infer(self, inputs: Arrays) -> Arrays:
        x = inputs["x"]
        Rows.rows.setdefault("flaky", []).append(len(x))
        if Flaky.fails:
            Flaky.fails -= 1
            raise BackendError("flaky is down", transient=True)
        return {"y": x + 1}


async def test_a_retry_reruns_the_whole_batch_once_more(
    autojump_clock: trio.testing.MockClock,
) -> None:
    Flaky.fails = 1
    async with open_engine() as engine:
        await engine.load(step_model("first"))
        options = {"class": Flaky, "inputs": [tensor("x")], "outputs": [tensor("y")]}
        await engine.load(
            ModelConfig(name="second", path="-", backend="python", backend_options=options)
        )
        await engine.load(step_model("third"))
        await engine.load(
            pipeline(fallback="resilient", fallback_options={"attempts": 2, "seed": 1})
        )
        results: dict[int, trioinfer.InferenceResult] = {}

        async def call(i: int) -> None:
            results[i] = await engine.infer_detailed("p", {"IN": X * i})

        await all_at_once(call, 4)
        for i in range(4):
            np.testing.assert_array_equal(results[i].outputs["OUT"], X * i + 3)
            assert results[i].fallbacks == ("retry instance 0 (cpu)",)
        # The second step failed for the batch (transiently): the batch ran again, whole.
        assert Rows.rows == {"first": [4, 4], "flaky": [4, 4], "third": [4]}
        stats = engine.statistics().models["p"]
        assert (stats.succeeded, stats.failed, stats.executions, stats.in_flight) == (4, 0, 2, 0)
        assert stats.fallbacks == {"retry": 4}
        assert (stats.replicas[0].executions, stats.replicas[0].failures) == (2, 1)


async def test_a_hedged_batch_ends_every_member_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_engine() as engine:
        # Two graphs; a batch still in its steps after 0.5 s runs on the other as well
        # (its step requests then queue behind the first's: the steps are shared).
        await load_chain(engine, delays=(1.0, 0.0, 0.0), instances=[trioinfer.Instance(count=2)],
                         fallback="resilient", fallback_options={"hedge_after": 0.5})  # fmt: skip
        outcomes: dict[int, list[object]] = {i: [] for i in range(3)}

        async def call(i: int) -> None:
            outcomes[i].append(await answer(engine, row(i, poison=1)))

        await all_at_once(call, 3)
        assert all(len(outcome) == 1 for outcome in outcomes.values())
        assert isinstance(outcomes[1][0], InvalidInput)
        for i in (0, 2):
            np.testing.assert_array_equal(outcomes[i][0], np.full((1, 4), i + 3, np.float32))  # type: ignore[arg-type]
        stats = engine.statistics().models
        assert (stats["p"].succeeded, stats["p"].failed, stats["p"].in_flight) == (2, 1, 0)
        assert all(stats[m].in_flight == 0 for m in ("first", "second", "third"))


@pytest.mark.parametrize("scheduler", ["priority", "deadline", "fair"])
async def test_schedulers_and_instances_serve_a_batched_pipeline(
    scheduler: str, autojump_clock: trio.testing.MockClock
) -> None:
    async with open_engine() as engine:
        await load_chain(engine, delays=(1.0, 0.0, 0.0), instances=[trioinfer.Instance(count=2)],
                         scheduler=scheduler, max_batch_size=3)  # fmt: skip
        results: dict[int, np.ndarray[Any, Any]] = {}

        async def call(i: int) -> None:
            with trio.fail_after(100 + i):
                results[i] = (await engine.infer("p", {"IN": X * i}, priority=i % 3))["OUT"]

        await all_at_once(call, 9)
        for i in range(9):
            np.testing.assert_array_equal(results[i], X * i + 3)
        assert Rows.rows["first"] == [3, 3, 3]
        stats = engine.statistics().models["p"]
        assert (stats.succeeded, stats.executions, stats.in_flight) == (9, 3, 0)
        assert sum(replica.executions for replica in stats.replicas) == 3


@pytest.mark.parametrize("unload", ["p", "second"])
async def test_unloading_mid_batch_ends_every_member_once(
    unload: str, autojump_clock: trio.testing.MockClock
) -> None:
    async with open_engine(drain_period=0.25) as engine:
        await load_chain(engine, delays=(1.0, 0.0, 0.0))
        errors: dict[int, list[BaseException]] = {i: [] for i in range(3)}

        async def call(i: int) -> None:
            try:
                await engine.infer("p", {"IN": X * i})
            except trioinfer.TrioInferError as exc:
                errors[i].append(exc)

        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(call, i)
            await trio.sleep(0.5)  # the batch is in its first step
            await engine.unload(unload)
        assert all(len(e) == 1 for e in errors.values()), errors
        if unload == "p":
            # Not done within the drain period: each member ends with EngineClosed.
            assert all(isinstance(e[0], trioinfer.EngineClosed) for e in errors.values())
            assert engine.statistics().models["first"].in_flight == 0
        else:
            # The second step's model is gone when the batch reaches it.
            for e in errors.values():
                assert isinstance(e[0], trioinfer.ModelNotFound)
                assert str(e[0]).startswith("pipeline 'p', step 1 (model 'second'): ")
            stats = engine.statistics().models["p"]
            assert (stats.failed, stats.in_flight) == (3, 0)


def test_a_member_leaving_during_its_rerun_on_asyncio() -> None:
    """On asyncio too, a caller leaving stops its own rerun, and the others go on."""

    async def main() -> tuple[dict[int, object], int]:
        outcomes: dict[int, object] = {}
        async with open_engine() as engine:
            await load_chain(engine, delays=(0.2, 0.0, 0.0), delay=0.05)
            scopes: dict[int, anyio.CancelScope] = {}

            async def call(i: int) -> None:
                with anyio.CancelScope() as scopes[i]:
                    outcomes[i] = await answer(engine, row(i, poison=0))
                    return
                outcomes[i] = "left"

            async with anyio.create_task_group() as tg:
                for i in range(3):
                    tg.start_soon(call, i)
                    await anyio.sleep(0.001)  # in this order (one batch: the delay is 50 ms)
                # The batch, member 0's rerun (refused), then member 1's: it leaves there.
                while len(Rows.rows.get("first", [])) < 3:  # noqa: ASYNC110  # a test counter, no event
                    await anyio.sleep(0.01)
                scopes[1].cancel()
            stats = engine.statistics().models
            assert stats["p"].in_flight == 0
            return outcomes, stats["first"].cancelled

    outcomes, aborted = anyio.run(main, backend="asyncio")
    assert isinstance(outcomes[0], InvalidInput)
    assert outcomes[1] == "left"
    np.testing.assert_array_equal(outcomes[2], np.full((1, 4), 5, np.float32))  # type: ignore[arg-type]
    assert aborted == 1  # member 1's rerun of the first step, stopped as it left
    assert Rows.rows["first"] == [3, 1, 1, 1]


async def test_the_engine_closing_mid_batch_ends_every_member_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    errors: dict[int, list[BaseException]] = {i: [] for i in range(3)}
    async with trio.open_nursery() as nursery, open_engine(drain_period=0.25) as engine:
        await load_chain(engine, delays=(1.0, 0.0, 0.0))

        async def call(i: int) -> None:
            try:
                await engine.infer("p", {"IN": X * i})
            except trioinfer.TrioInferError as exc:
                errors[i].append(exc)

        for i in range(3):
            nursery.start_soon(call, i)
        await trio.sleep(0.5)  # the batch is in its first step: the engine closes
    assert all(len(e) == 1 for e in errors.values()), errors
    assert all(isinstance(e[0], trioinfer.EngineClosed) for e in errors.values())
