"""The response cache: hits without queueing, coalescing (kept while anyone waits), LRU by bytes."""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
import pytest
import trio
import trio.testing

from _serve import start_serving
from trioinfer import (
    BackendError,
    ConfigError,
    DeadlineExceeded,
    ModelConfig,
    QueueFull,
    open_engine,
)
from trioinfer._cache import ARRAY_OVERHEAD, ENTRY_OVERHEAD, digest
from trioinfer.testing import FakeBackend

pytestmark = pytest.mark.cache

# What one float32[1, 4] answer is charged: its 16 bytes, and what holds them.
ROW = ENTRY_OVERHEAD + ARRAY_OVERHEAD + 4 * 4


def cached(**kw: Any) -> ModelConfig:
    return ModelConfig(name="m", path="-", backend="fake", response_cache=True, **kw)


def x(value: float) -> np.ndarray[Any, Any]:
    return np.full((1, 4), value, np.float32)


async def test_a_repeated_request_is_answered_without_queueing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FakeBackend(delay=1.0)
    async with open_engine(registry=backend.registry(), cache_size=1 << 20) as engine:
        await engine.load(cached())
        first = await engine.infer("m", {"x": x(1)})
        t0 = trio.current_time()
        again = await engine.infer("m", {"x": x(1)})
        assert trio.current_time() == t0  # no queue, no execution
        other = await engine.infer("m", {"x": x(2)})
        stats = engine.statistics()
    assert backend.executions == [1, 1]
    np.testing.assert_array_equal(again["y"], first["y"])
    np.testing.assert_array_equal(other["y"], x(4))
    cache = stats.models["m"].cache
    assert cache is not None
    assert (cache.hits, cache.misses, cache.coalesced, cache.entries) == (1, 2, 0, 2)
    assert cache.bytes == stats.cache_bytes == 2 * ROW
    assert (cache.hit_duration.count, cache.miss_duration.count) == (1, 2)
    assert stats.models["m"].succeeded == 2  # the hit never reached the model


async def test_a_miss_is_timed_by_its_lookup_and_insert_not_its_compute(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Triton's cache_miss: the time to look up and insert, not to compute (a second
    # here, on virtual time, where the cache's own work takes none).
    backend = FakeBackend(delay=1.0)
    async with open_engine(registry=backend.registry(), cache_size=1 << 20) as engine:
        await engine.load(cached())
        await engine.infer("m", {"x": x(1)})
        backend.error = BackendError("broken")
        with pytest.raises(BackendError):
            await engine.infer("m", {"x": x(2)})
        stats = engine.statistics().models["m"]
    cache = stats.cache
    assert cache is not None
    assert cache.misses == cache.miss_duration.count == 2  # a failed compute missed too
    assert cache.miss_duration.sum == 0
    assert stats.compute_duration.sum == 2.0


async def test_answers_from_the_cache_cannot_be_changed_by_their_callers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_engine(registry=FakeBackend().registry(), cache_size=1 << 20) as engine:
        await engine.load(cached())
        first = await engine.infer("m", {"x": x(1)})
        first["y"][...] = 99  # the computing caller's own answer: writable, not the cache's
        hit = await engine.infer("m", {"x": x(1)})
        with pytest.raises(ValueError, match="read-only"):
            hit["y"][...] = 99
        again = await engine.infer("m", {"x": x(1)})
    np.testing.assert_array_equal(again["y"], x(2))


async def test_identical_requests_in_flight_are_computed_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FakeBackend(delay=1.0)
    answers: list[np.ndarray[Any, Any]] = []
    async with open_engine(registry=backend.registry(), cache_size=1 << 20) as engine:
        await engine.load(cached())

        async def call() -> None:
            answers.append((await engine.infer("m", {"x": x(3)}))["y"])

        async with anyio.create_task_group() as tg:
            for _ in range(5):
                tg.start_soon(call)
        cache = engine.statistics().models["m"].cache
    assert backend.executions == [1]
    assert len(answers) == 5
    assert all(np.array_equal(a, x(6)) for a in answers)
    assert cache is not None
    assert (cache.misses, cache.coalesced, cache.hits) == (1, 4, 0)


async def test_when_the_computing_caller_leaves_a_waiting_one_gets_its_computation(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The computation belongs to the cache entry, not to the caller whose miss started
    # it: the one who stays gets it when it ends, computed once.
    backend = FakeBackend(delay=1.0)
    async with open_engine(registry=backend.registry(), cache_size=1 << 20) as engine:
        await engine.load(cached())
        outcome: dict[str, object] = {}

        async def leader() -> None:
            with anyio.move_on_after(0.5):
                await engine.infer("m", {"x": x(5)})
                outcome["leader"] = "answered"
            outcome.setdefault("leader", "gave up")

        async def follower() -> None:
            outcome["follower"] = (await engine.infer("m", {"x": x(5)}))["y"]
            outcome["at"] = trio.current_time()

        t0 = trio.current_time()
        async with anyio.create_task_group() as tg:
            tg.start_soon(leader)
            await trio.testing.wait_all_tasks_blocked()
            tg.start_soon(follower)
        stats = engine.statistics().models["m"]
    assert outcome["leader"] == "gave up"
    np.testing.assert_array_equal(outcome["follower"], x(10))  # type: ignore[arg-type]
    assert outcome["at"] == t0 + 1.0  # not restarted when the leader left
    assert backend.executions == [1]
    assert (stats.cancelled, stats.succeeded) == (0, 1)
    assert stats.cache is not None
    assert (stats.cache.misses, stats.cache.coalesced) == (1, 1)


async def test_a_computation_is_cancelled_when_its_last_caller_leaves(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FakeBackend(delay=1.0)
    async with open_engine(registry=backend.registry(), cache_size=1 << 20) as engine:
        await engine.load(cached())

        async def call(budget: float) -> None:
            with anyio.move_on_after(budget):
                await engine.infer("m", {"x": x(5)})
                raise AssertionError("answered after its deadline")

        async with anyio.create_task_group() as tg:
            tg.start_soon(call, 0.5)
            await trio.testing.wait_all_tasks_blocked()
            tg.start_soon(call, 0.8)
        await trio.sleep(5)  # nothing runs for nobody meanwhile
        stats = engine.statistics().models["m"]
    # One execution, aborted when the second caller left: none started again.
    assert backend.executions == [1]
    assert (stats.cancelled, stats.succeeded, stats.in_flight) == (1, 0, 0)
    assert stats.cache is not None
    assert (stats.cache.misses, stats.cache.coalesced, stats.cache.entries) == (1, 0, 0)


async def test_a_queued_computation_takes_the_deadline_of_those_still_waiting(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Queued behind another request, the computation outlives its first caller's
    # deadline: it is not expired while a caller with a later one still waits.
    backend = FakeBackend(delay=1.0)
    async with open_engine(registry=backend.registry(), cache_size=1 << 20) as engine:
        await engine.load(cached())
        answered: list[float] = []

        async def blocker() -> None:
            await engine.infer("m", {"x": x(9)})

        async def call(budget: float) -> None:
            with anyio.move_on_after(budget):
                await engine.infer("m", {"x": x(5)})
                answered.append(trio.current_time())

        t0 = trio.current_time()
        async with anyio.create_task_group() as tg:
            tg.start_soon(blocker)
            await trio.testing.wait_all_tasks_blocked()
            tg.start_soon(call, 0.5)
            await trio.testing.wait_all_tasks_blocked()
            tg.start_soon(call, 5.0)
        stats = engine.statistics().models["m"]
    assert answered == [t0 + 2.0]
    assert backend.executions == [1, 1]
    assert (stats.cancelled, stats.expired, stats.succeeded) == (0, 0, 2)


async def test_a_caller_who_leaves_a_computation_leaves_it_to_the_others(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FakeBackend(delay=1.0)
    async with open_engine(registry=backend.registry(), cache_size=1 << 20) as engine:
        await engine.load(cached())
        answers: list[np.ndarray[Any, Any]] = []

        async def call(budget: float) -> None:
            with anyio.move_on_after(budget):
                answers.append((await engine.infer("m", {"x": x(5)}))["y"])

        async with anyio.create_task_group() as tg:
            tg.start_soon(call, 9.0)
            await trio.testing.wait_all_tasks_blocked()
            tg.start_soon(call, 0.5)
            tg.start_soon(call, 9.0)
        stats = engine.statistics().models["m"]
    assert len(answers) == 2
    assert backend.executions == [1]
    assert stats.cache is not None
    assert (stats.cache.misses, stats.cache.coalesced) == (1, 1)


async def test_a_failure_is_not_stored_and_reaches_those_waiting(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FakeBackend(delay=1.0)
    backend.error = BackendError("broken")
    errors: list[BaseException] = []
    async with open_engine(registry=backend.registry(), cache_size=1 << 20) as engine:
        await engine.load(cached())

        async def call() -> None:
            try:
                await engine.infer("m", {"x": x(1)})
            except BackendError as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(call)
        backend.error = None
        fixed = await engine.infer("m", {"x": x(1)})
        stats = engine.statistics().models["m"]
        cache = stats.cache
    assert len(errors) == 3
    assert len({id(e) for e in errors}) == 3  # each caller its own exception object
    np.testing.assert_array_equal(fixed["y"], x(2))
    assert backend.executions == [1, 1]
    assert cache is not None
    assert cache.entries == 1
    # One computed and failed (the model's own statistics count it); the two that
    # waited for it failed too, and count here (Triton's `fail` adds them): they
    # were counted nowhere, and `fail` said 1 where 3 callers got the error.
    assert (cache.misses, cache.coalesced, cache.failed) == (2, 0, 2)
    assert stats.failed == 1


async def test_the_cache_is_bounded_in_bytes_least_recently_used_first(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FakeBackend()
    async with open_engine(registry=backend.registry(), cache_size=3 * ROW) as engine:
        await engine.load(cached())
        for value in (1, 2, 3):
            await engine.infer("m", {"x": x(value)})
        await engine.infer("m", {"x": x(1)})  # 1 is now the most recently used
        await engine.infer("m", {"x": x(4)})  # evicts 2
        executed = len(backend.executions)
        await engine.infer("m", {"x": x(1)})  # still there
        assert len(backend.executions) == executed
        await engine.infer("m", {"x": x(2)})  # gone: computed again
        assert len(backend.executions) == executed + 1
        stats = engine.statistics()
    cache = stats.models["m"].cache
    assert cache is not None
    assert stats.cache_bytes <= 3 * ROW
    assert cache.evictions == 2
    assert cache.entries == 3


async def test_reloading_a_model_forgets_its_answers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FakeBackend()
    async with open_engine(registry=backend.registry(), cache_size=1 << 20) as engine:
        await engine.load(cached())
        await engine.infer("m", {"x": x(1)})
        backend.fn = lambda inputs: {"y": inputs["x"] * 3}
        await engine.load(cached(), replace=True)
        out = await engine.infer("m", {"x": x(1)})
        assert engine.statistics().cache_bytes == ROW
    np.testing.assert_array_equal(out["y"], x(3))


async def test_reloading_a_model_starts_its_cache_counters_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # As the model's other statistics do: a hit counted before the reload beside a
    # success count that started again made the server's `success` count wrong.
    async with open_engine(registry=FakeBackend().registry(), cache_size=1 << 20) as engine:
        await engine.load(cached())
        for _ in range(3):
            await engine.infer("m", {"x": x(1)})
        await engine.load(cached(), replace=True)
        await engine.infer("m", {"x": x(1)})
        stats = engine.statistics().models["m"]
    assert stats.cache is not None
    assert (stats.cache.hits, stats.cache.misses, stats.succeeded) == (0, 1, 1)


async def test_models_without_response_cache_are_not_cached() -> None:
    backend = FakeBackend()
    async with open_engine(registry=backend.registry(), cache_size=1 << 20) as engine:
        await engine.load(ModelConfig(name="m", path="-", backend="fake"))
        for _ in range(2):
            await engine.infer("m", {"x": x(1)})
        assert engine.statistics().models["m"].cache is None
    assert len(backend.executions) == 2


async def test_response_cache_needs_an_engine_cache() -> None:
    async with open_engine(registry=FakeBackend().registry()) as engine:
        with pytest.raises(ConfigError, match=r"open_engine\(cache_size=\.\.\.\)"):
            await engine.load(cached())
    with pytest.raises(ConfigError, match="cache_size must be a number of bytes"):
        open_engine(cache_size=-1)
    with pytest.raises(ConfigError, match="response_cache must be true or false"):
        ModelConfig(name="m", path="-", response_cache="yes")  # type: ignore[arg-type]


def test_the_key_covers_names_dtypes_shapes_and_bytes() -> None:
    a = np.arange(4, dtype=np.float32)
    keys = {
        digest({"x": a}),
        digest({"y": a}),
        digest({"x": a.astype(np.float64)}),
        digest({"x": a.reshape(2, 2)}),
        digest({"x": a + 1}),
        digest({"x": np.array(["ab", "c"], dtype=object)}),
        digest({"x": np.array(["a", "bc"], dtype=object)}),
        digest({"x": np.array([b"\xff"], dtype=object)}),
        digest({"x": np.array(["\ud800"], dtype=object)}),  # a str UTF-8 cannot encode
    }
    assert len(keys) == 9
    # An optional input left out (no name) is not one sent: another key.
    assert digest({"x": a}) != digest({"x": a, "b": a[:0]})
    assert digest({"x": a}) == digest({"x": a.copy()})
    assert digest({"x": a[::2]}) == digest({"x": a[::2].copy()})  # strided: by content
    assert len(digest({"x": a})) == 16  # 128 bits


async def test_an_answer_computed_by_a_replaced_model_is_neither_kept_nor_shared(
    autojump_clock: trio.testing.MockClock,
) -> None:
    old, new = FakeBackend(delay=1.0), FakeBackend(lambda i: {"y": i["x"] * 3}, delay=1.0)
    backend = {"which": old}

    class Switch:
        async def load(self, config: ModelConfig, placement: Any) -> Any:
            return await backend["which"].load(config, placement)

    from trioinfer import Registry

    registry = Registry(extra={"backends": {"fake": Switch}})
    answers: dict[str, Any] = {}
    async with open_engine(registry=registry, cache_size=1 << 20) as engine:
        await engine.load(cached())
        async with anyio.create_task_group() as tg:

            async def before() -> None:
                answers["before"] = (await engine.infer("m", {"x": x(1)}))["y"]

            tg.start_soon(before)
            await anyio.sleep(0.5)  # computing on the old model
            backend["which"] = new
            await engine.load(cached(), replace=True)
            answers["after"] = (await engine.infer("m", {"x": x(1)}))["y"]
        answers["later"] = (await engine.infer("m", {"x": x(1)}))["y"]
    np.testing.assert_array_equal(answers["before"], x(2))
    np.testing.assert_array_equal(answers["after"], x(3))  # the new model's own
    np.testing.assert_array_equal(answers["later"], x(3))


async def test_a_pipelines_answers_are_forgotten_when_a_step_model_is_reloaded(
    autojump_clock: trio.testing.MockClock,
) -> None:
    step = FakeBackend()
    pipeline = ModelConfig(
        name="p",
        path="-",
        backend="pipeline",
        response_cache=True,
        backend_options={
            "inputs": [{"name": "IN", "dtype": "float32", "shape": ["batch", 4]}],
            "outputs": [{"name": "OUT", "dtype": "float32", "shape": ["batch", 4]}],
            "steps": [{"model": "m", "input_map": {"x": "IN"}, "output_map": {"y": "OUT"}}],
        },
    )
    async with open_engine(registry=step.registry(), cache_size=1 << 20) as engine:
        await engine.load(ModelConfig(name="m", path="-", backend="fake"))
        await engine.load(pipeline)
        first = await engine.infer("p", {"IN": x(1)})
        step.fn = lambda inputs: {"y": inputs["x"] * 5}
        await engine.load(ModelConfig(name="m", path="-", backend="fake"), replace=True)
        second = await engine.infer("p", {"IN": x(1)})
    np.testing.assert_array_equal(first["OUT"], x(2))
    np.testing.assert_array_equal(second["OUT"], x(5))


async def test_a_fallbacks_default_answer_is_not_kept(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FakeBackend()
    backend.error = BackendError("broken")
    config = cached(
        fallback="resilient", fallback_options={"attempts": 1, "default": {"y": [0, 0, 0, 0]}}
    )
    async with open_engine(registry=backend.registry(), cache_size=1 << 20) as engine:
        await engine.load(config)
        default = await engine.infer_detailed("m", {"x": x(1)})
        backend.error = None
        real = await engine.infer_detailed("m", {"x": x(1)})
    assert default.fallbacks == ("default",)
    np.testing.assert_array_equal(default.outputs["y"], np.zeros((1, 4), np.float32))
    assert real.fallbacks == ()
    np.testing.assert_array_equal(real.outputs["y"], x(2))


async def test_those_waiting_for_a_fallbacks_answer_are_told_it_is_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Identical requests in flight share the computing one's answer, a fallback's
    # default too; the others got it with no fallback steps and an empty
    # trioinfer_fallbacks, as if the model had answered.
    backend = FakeBackend(delay=1.0)
    backend.error = BackendError("broken")
    config = cached(
        fallback="resilient", fallback_options={"attempts": 1, "default": {"y": [0, 0, 0, 0]}}
    )
    results = []
    async with open_engine(registry=backend.registry(), cache_size=1 << 20) as engine:
        await engine.load(config)

        async def call() -> None:
            results.append(await engine.infer_detailed("m", {"x": x(1)}))

        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(call)
        cache = engine.statistics().models["m"].cache
    assert [r.fallbacks for r in results] == [("default",)] * 3
    assert [r.instance for r in results] == [None] * 3
    assert cache is not None
    assert (cache.misses, cache.coalesced, cache.entries) == (1, 2, 0)


async def test_hits_give_the_event_loop_its_turn(autojump_clock: trio.testing.MockClock) -> None:
    ran = 0

    async def sibling() -> None:
        nonlocal ran
        while True:
            ran += 1
            await trio.lowlevel.checkpoint()

    async with open_engine(registry=FakeBackend().registry(), cache_size=1 << 20) as engine:
        await engine.load(cached())
        await engine.infer("m", {"x": x(1)})
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sibling)
            for _ in range(100):
                await engine.infer("m", {"x": x(1)})
            nursery.cancel_scope.cancel()
        # A scope that expires during a run of hits fires.
        with trio.move_on_after(0) as scope:
            await engine.infer("m", {"x": x(1)})
        assert scope.cancelled_caught
    assert ran >= 90  # about once per hit (0 before hits yielded)


async def test_the_server_reports_hits_in_triton_statistics_and_metrics(tmp_path: Any) -> None:
    import shutil

    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from trioinfer import example_repository
    from trioinfer.server import ServerConfig

    repo = tmp_path / "repo"
    shutil.copytree(example_repository() / "digits", repo / "digits")
    toml = repo / "digits" / "config.toml"
    toml.write_text("response_cache = true\n" + toml.read_text())
    body = {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": [1] * 64}]}
    async with trio.open_nursery() as nursery:
        listening = await start_serving(nursery, repo, config=ServerConfig(cache_size=1 << 20))
        async with httpx.AsyncClient(base_url=listening.urls[0]) as client:
            answers = [
                (await client.post("/v2/models/digits/infer", json=body)).json() for _ in range(3)
            ]
            stats = (await client.get("/v2/models/digits/stats")).json()
            metrics = (await client.get("/metrics")).text
        nursery.cancel_scope.cancel()
    assert answers[0]["outputs"] == answers[2]["outputs"]
    inference = stats["model_stats"][0]["inference_stats"]
    assert (inference["cache_hit"]["count"], inference["cache_miss"]["count"]) == (2, 1)
    # As in Triton, the hits are successes too: three requests got outputs.
    assert inference["success"]["count"] == 3
    assert inference["success"]["ns"] >= inference["cache_hit"]["ns"] > 0
    samples = {
        s.name: s.value
        for family in text_string_to_metric_families(metrics)
        for s in family.samples
        if s.name.startswith("trioinfer_cache_")
    }
    assert samples["trioinfer_cache_hits_total"] == 2
    assert samples["trioinfer_cache_misses_total"] == 1
    assert samples["trioinfer_cache_bytes"] > 0


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_a_computation_outlives_its_first_caller_on_both_backends(backend: str) -> None:
    # The computation's task and scope, made by one caller and left to another, on
    # asyncio too (real time there: a short compute, a shorter first caller).
    fake = FakeBackend(delay=0.2)
    got: list[np.ndarray[Any, Any]] = []

    async def main() -> None:
        async with open_engine(registry=fake.registry(), cache_size=1 << 20) as engine:
            await engine.load(cached())

            async def leader() -> None:
                with anyio.move_on_after(0.05):
                    await engine.infer("m", {"x": x(5)})

            async def follower() -> None:
                await anyio.sleep(0.01)
                got.append((await engine.infer("m", {"x": x(5)}))["y"])

            async with anyio.create_task_group() as tg:
                tg.start_soon(leader)
                tg.start_soon(follower)

    anyio.run(main, backend=backend)
    assert fake.executions == [1]
    assert len(got) == 1
    np.testing.assert_array_equal(got[0], x(10))


async def test_a_pipelines_computation_outlives_its_first_caller(
    autojump_clock: trio.testing.MockClock,
) -> None:
    step = FakeBackend(delay=1.0)
    pipeline = ModelConfig(
        name="p",
        path="-",
        backend="pipeline",
        response_cache=True,
        backend_options={
            "inputs": [{"name": "IN", "dtype": "float32", "shape": ["batch", 4]}],
            "outputs": [{"name": "OUT", "dtype": "float32", "shape": ["batch", 4]}],
            "steps": [{"model": "m", "input_map": {"x": "IN"}, "output_map": {"y": "OUT"}}],
        },
    )
    async with open_engine(registry=step.registry(), cache_size=1 << 20) as engine:
        await engine.load(ModelConfig(name="m", path="-", backend="fake"))
        await engine.load(pipeline)
        answers: list[np.ndarray[Any, Any]] = []

        async def call(budget: float) -> None:
            with anyio.move_on_after(budget):
                answers.append((await engine.infer("p", {"IN": x(1)}))["OUT"])

        async def call_other(budget: float) -> None:
            with anyio.move_on_after(budget):
                answers.append((await engine.infer("p", {"IN": x(2)}))["OUT"])

        async with anyio.create_task_group() as tg:
            tg.start_soon(call, 0.5)
            await trio.testing.wait_all_tasks_blocked()
            tg.start_soon(call, 1.5)
        # Both gone before it ends: the step's execution is aborted, nothing else runs.
        async with anyio.create_task_group() as tg:
            tg.start_soon(call_other, 0.3)
            tg.start_soon(call_other, 0.6)
        await trio.sleep(5)
    assert len(answers) == 1
    np.testing.assert_array_equal(answers[0], x(2))
    assert step.executions == [1, 1]


async def test_a_queue_timeout_ends_a_wait_in_the_queue_not_a_run(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FakeBackend(delay=1.0)
    async with open_engine(registry=backend.registry(), cache_size=1 << 20) as engine:
        await engine.load(cached(queue_timeouts={0: 0.5}))
        outcome: list[object] = []

        async def call(value: float) -> None:
            try:
                outcome.append((await engine.infer("m", {"x": x(value)}))["y"][0, 0])
            except DeadlineExceeded:
                outcome.append("expired")

        async with anyio.create_task_group() as tg:
            tg.start_soon(call, 9)  # runs at once, for a second: its timeout does not cut it
            await trio.testing.wait_all_tasks_blocked()
            tg.start_soon(call, 5)  # queued behind it past its timeout: never computed
            tg.start_soon(call, 5)
        stats = engine.statistics().models["m"]
    assert sorted(map(str, outcome)) == ["18.0", "expired", "expired"]
    assert backend.executions == [1]
    assert (stats.expired, stats.cancelled) == (1, 0)  # as without the cache


async def test_a_computation_refused_at_admission_is_its_callers_error_alone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FakeBackend(delay=1.0)
    async with open_engine(registry=backend.registry(), cache_size=1 << 20) as engine:
        await engine.load(cached(max_queue_size=1))
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.infer, "m", {"x": x(9)})  # runs
            await trio.testing.wait_all_tasks_blocked()
            tg.start_soon(engine.infer, "m", {"x": x(8)})  # fills the queue
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(QueueFull):
                await engine.infer("m", {"x": x(5)})
        # Nothing of the refused one is left waiting to be joined: computed afresh.
        again = await engine.infer("m", {"x": x(5)})
        cache = engine.statistics().models["m"].cache
    np.testing.assert_array_equal(again["y"], x(10))
    assert backend.executions == [1, 1, 1]
    assert cache is not None
    assert (cache.misses, cache.miss_duration.count, cache.entries) == (4, 4, 3)
