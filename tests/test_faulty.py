"""The fault-injection kit: FaultyBackend's faults, and the helpers that check every request ended.

The sections marked ``--8<--`` are shown on docs/how-to/testing.md: they are a
user's application and its tests, run here as they are shown there.
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio
import numpy as np
import pytest
import trio
import trio.testing

import trioinfer
from trioinfer import BackendError, Device, Instance, ModelConfig, open_engine
from trioinfer.lowlevel import Placement
from trioinfer.testing import (
    FakeBackend,
    FaultStatistics,
    FaultyBackend,
    FaultyInstance,
    RequestLedger,
    assert_all_ended,
    assert_no_tasks_left,
    check_backend,
)

X = np.ones((1, 4), dtype=np.float32)
CPU0 = Placement(Device("cpu"), 0)


def config(name: str = "m", **kw: Any) -> ModelConfig:
    return ModelConfig(name=name, path="unused.onnx", backend="faulty", **kw)


async def load(backend: FaultyBackend, placement: Placement = CPU0) -> FaultyInstance:
    return await backend.load(config(), placement)


async def run_calls(instance: FaultyInstance, n: int) -> None:
    # Errors are the point here; hangs are not configured by the callers of this.
    for _ in range(n):
        with contextlib.suppress(BackendError):
            await instance.execute({"x": X})


# -- conformance ---------------------------------------------------------------------------


async def test_passes_check_backend_without_faults() -> None:
    await check_backend(FaultyBackend(), config(), {"x": X})


async def test_passes_check_backend_with_latency(autojump_clock: trio.testing.MockClock) -> None:
    await check_backend(FaultyBackend(latency=(0.01, 0.02)), config(), {"x": X})


async def test_without_faults_it_is_the_inner_backend(
    autojump_clock: trio.testing.MockClock,
) -> None:
    inner = FakeBackend(delay=0.5)
    backend = FaultyBackend(inner)
    instance = await load(backend)
    t0 = trio.current_time()
    out = await instance.execute({"x": X})
    assert trio.current_time() - t0 == 0.5
    np.testing.assert_array_equal(out["y"], 2 * X)
    assert instance.signature == inner.signature
    assert instance.device == "cpu"
    assert instance.pipeline_depth == 1
    assert inner.executions == [1]
    assert backend.statistics() == FaultStatistics(calls=1, forwarded=1)
    await instance.aclose()
    assert inner.open_instances == 0


# -- determinism ---------------------------------------------------------------------------


async def test_same_seed_gives_the_same_faults() -> None:
    histories = []
    for seed in (7, 7, 8):
        instance = await load(FaultyBackend(seed=seed, error_rate=0.3))
        await run_calls(instance, 200)
        histories.append(instance.history)
    assert histories[0] == histories[1]
    assert histories[0] != histories[2]
    assert set(histories[0]) == {"ok", "error"}


async def test_each_instance_has_its_own_sequence_whatever_the_interleaving() -> None:
    alone = FaultyBackend(seed=3, error_rate=0.5)
    first, second = await load(alone, CPU0), await load(alone, Placement(Device("cpu"), 1))
    await run_calls(first, 50)
    await run_calls(second, 50)
    assert first.history != second.history  # instances draw from different streams

    together = FaultyBackend(seed=3, error_rate=0.5)
    # Loaded in the other order, and called alternately.
    b, a = await load(together, Placement(Device("cpu"), 1)), await load(together, CPU0)
    for _ in range(50):
        await run_calls(a, 1)
        await run_calls(b, 1)
    assert a.history == first.history
    assert b.history == second.history


async def test_each_calls_faults_depend_only_on_seed_and_call_number() -> None:
    # Adding fail_on must not shift the random faults of later calls.
    plain = await load(FaultyBackend(seed=5, error_rate=0.3))
    planned = await load(FaultyBackend(seed=5, error_rate=0.3, fail_on={2, 4}))
    await run_calls(plain, 30)
    await run_calls(planned, 30)
    for i, (p, q) in enumerate(zip(plain.history, planned.history, strict=True), start=1):
        assert q == ("planned_error" if i in (2, 4) else p)


# -- each fault ----------------------------------------------------------------------------


async def test_error_rate_injects_typed_transient_errors() -> None:
    backend = FaultyBackend(seed=1, error_rate=0.25)
    instance = await load(backend)
    errors = []
    for _ in range(1000):
        try:
            await instance.execute({"x": X})
        except BackendError as exc:
            errors.append(exc)
    stats = backend.statistics()
    assert stats.calls == 1000
    assert stats.errors == len(errors)
    assert stats.forwarded + stats.errors == 1000
    assert 200 < stats.errors < 300  # this seed's draw; fixed, not flaky
    assert all(getattr(e, "transient", None) is True for e in errors)
    assert "injected fault: error_rate on call" in str(errors[0])


async def test_error_factory_and_transient_flag() -> None:
    class Flaky(trioinfer.TrioInferError):
        pass

    instance = await load(FaultyBackend(fail_on={1}, error=Flaky, transient=False))
    with pytest.raises(Flaky, match="fail_on on call 1") as caught:
        await instance.execute({"x": X})
    assert caught.value.transient is False  # type: ignore[attr-defined]


async def test_fail_on_fails_exactly_those_calls() -> None:
    backend = FaultyBackend(fail_on=[1, 3, 6])
    instance = await load(backend)
    await run_calls(instance, 7)
    expected = ["planned_error", "ok", "planned_error", "ok", "ok", "planned_error", "ok"]
    assert instance.history == expected
    assert backend.statistics().planned_errors == 3


async def test_crash_after_leaves_a_dead_instance() -> None:
    backend = FaultyBackend(crash_after=2, transient=True)
    instance = await load(backend)
    await instance.execute({"x": X})
    assert not instance.dead
    await instance.execute({"x": X})
    assert instance.dead
    for number in (3, 4):
        with pytest.raises(BackendError, match=f"crashed on call {number}") as caught:
            await instance.execute({"x": X})
        assert caught.value.transient is False
    assert backend.statistics() == FaultStatistics(calls=4, forwarded=2, dead_calls=2)
    await instance.aclose()  # a dead instance still closes


async def test_crash_after_zero_is_dead_from_the_start() -> None:
    instance = await load(FaultyBackend(crash_after=0))
    assert instance.dead
    with pytest.raises(BackendError, match="crashed"):
        await instance.execute({"x": X})


async def test_latency_runs_on_the_event_loops_clock(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fixed = await load(FaultyBackend(latency=0.25))
    t0 = trio.current_time()
    await fixed.execute({"x": X})
    assert trio.current_time() - t0 == 0.25

    backend = FaultyBackend(latency=(0.1, 0.2))
    ranged = await load(backend)
    t0 = trio.current_time()
    for _ in range(20):
        t = trio.current_time()
        await ranged.execute({"x": X})
        assert 0.1 <= trio.current_time() - t <= 0.2
    assert backend.statistics().added_latency == pytest.approx(trio.current_time() - t0)


async def test_a_call_cancelled_during_its_latency(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FaultyBackend(latency=1.0)
    instance = await load(backend)
    with trio.move_on_after(0.5):
        await instance.execute({"x": X})
    assert instance.history == ["cancelled"]
    assert backend.statistics() == FaultStatistics(calls=1, added_latency=1.0)


async def test_a_hang_lasts_until_cancelled(autojump_clock: trio.testing.MockClock) -> None:
    backend = FaultyBackend(hang_on={1})
    instance = await load(backend)
    t0 = trio.current_time()
    with trio.move_on_after(5) as scope:
        await instance.execute({"x": X})
    assert scope.cancelled_caught
    assert trio.current_time() - t0 == 5
    await instance.execute({"x": X})  # the instance is usable again
    assert instance.history == ["hang", "ok"]
    assert backend.statistics().hangs == 1


async def test_hang_rate(autojump_clock: trio.testing.MockClock) -> None:
    backend = FaultyBackend(seed=2, hang_rate=0.2, error_rate=0.3)
    instance = await load(backend)
    for _ in range(500):
        with trio.move_on_after(1):
            with contextlib.suppress(BackendError):
                await instance.execute({"x": X})
    stats = backend.statistics()
    assert 70 < stats.hangs < 130
    assert 120 < stats.errors < 180
    assert stats.forwarded + stats.errors + stats.hangs == 500


async def test_a_hang_is_cancelled_by_the_callers_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FaultyBackend(hang_on={1})
    with assert_no_tasks_left():
        async with open_engine(registry=backend.registry()) as engine:
            await engine.load(config())
            t0 = trio.current_time()
            with trio.move_on_after(1.0) as scope:
                await engine.infer("m", {"x": X})
            assert scope.cancelled_caught
            assert trio.current_time() - t0 == 1.0
            # Nobody waits for the hung execution any more: the engine aborted it.
            out = await engine.infer("m", {"x": X})
            np.testing.assert_array_equal(out["y"], 2 * X)
            assert_all_ended(engine, accepted=2)
            stats = engine.statistics().models["m"]
            assert (stats.cancelled, stats.succeeded) == (1, 1)


async def test_a_crashed_instance_fails_every_request_through_the_engine() -> None:
    backend = FaultyBackend(crash_after=1)
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(config())
        await engine.infer("m", {"x": X})
        for _ in range(3):
            with pytest.raises(BackendError, match="crashed") as caught:
                await engine.infer("m", {"x": X})
            assert caught.value.transient is False  # type: ignore[attr-defined]
        assert_all_ended(engine, accepted=4)
        assert engine.statistics().models["m"].failed == 3


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"error_rate": 1.5}, "error_rate must be a probability"),
        ({"hang_rate": -0.1}, "hang_rate must be a probability"),
        ({"error_rate": 0.6, "hang_rate": 0.6}, "must not exceed 1"),
        ({"latency": -1.0}, "latency must be"),
        ({"latency": (0.2, 0.1)}, "latency must be"),
        ({"crash_after": -1}, "crash_after must be"),
        ({"fail_on": [0]}, "fail_on must hold call numbers >= 1"),
        ({"hang_on": [1.5]}, "hang_on must hold call numbers >= 1"),
    ],
)
def test_options_out_of_range_are_refused(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FaultyBackend(**options)


def test_devices_given_as_one_string_is_refused() -> None:
    # A string is an iterable of one-letter devices: it said device 'c' is not one.
    with pytest.raises(
        TypeError, match=r"devices must be a list of device names, e.g. devices=\['cuda:0'\]"
    ):
        FaultyBackend(devices="cuda:0")


async def test_registry_can_stand_in_for_another_backend_name() -> None:
    backend = FaultyBackend(fail_on={1})
    async with open_engine(registry=backend.registry("onnxruntime")) as engine:
        # The application's own config, naming the real backend, is used unchanged.
        await engine.load(ModelConfig(name="m", path="model.onnx", batcher="dynamic"))
        with pytest.raises(BackendError):
            await engine.infer("m", {"x": X})
        await engine.infer("m", {"x": X})
    assert len(backend.instances) == 1


# -- the helpers ---------------------------------------------------------------------------


async def test_assert_all_ended_names_the_counter_that_is_off(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FaultyBackend(hang_on={2})
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(config())
        await engine.infer("m", {"x": X})
        assert_all_ended(engine)
        assert_all_ended(engine.statistics(), accepted=1)
        assert_all_ended(engine.statistics().models["m"], accepted=1)
        with pytest.raises(AssertionError, match="3 requests accepted but 1 ended") as caught:
            assert_all_ended(engine, accepted=3)
        assert "some never ended" in str(caught.value)
        assert "'m': succeeded 1 + failed 0 + cancelled 0 + expired 0" in str(caught.value)
        with pytest.raises(AssertionError, match="some ended more than once"):
            assert_all_ended(engine, accepted=0)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.infer, "m", {"x": X})  # hangs
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(AssertionError, match="queued 0, in_flight 1"):
                assert_all_ended(engine)
            nursery.cancel_scope.cancel()
        final = engine.statistics()
        assert_all_ended(final, accepted=2)
    with pytest.raises(AssertionError, match=r"take engine.statistics\(\) inside its block"):
        assert_all_ended(engine)
    assert_all_ended(final, accepted=2)  # a snapshot outlives the engine


async def test_ledger_records_one_outcome_per_call(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ledger = RequestLedger()

    async def app_call(value: int, *, fail: BaseException | None = None) -> int:
        await trio.sleep(1)
        if fail is not None:
            raise fail
        return value

    call = ledger.wrap(app_call)
    assert call.__name__ == "app_call"
    assert await call(3) == 3
    assert await ledger.call(app_call, 4) == 4
    with pytest.raises(trioinfer.QueueFull):
        await call(0, fail=trioinfer.QueueFull("full", retry_after=1.0))
    with trio.move_on_after(0.5):
        await call(5)
    with pytest.raises(KeyError):
        await call(0, fail=KeyError("oops"))
    stats = ledger.statistics()
    assert (stats.calls, stats.pending, stats.succeeded, stats.cancelled) == (5, 0, 2, 1)
    assert stats.errors == {"QueueFull": 1}
    assert stats.untyped == {"KeyError": 1}
    with pytest.raises(AssertionError, match="outside TrioInferError: KeyError x1") as caught:
        ledger.assert_all_ended()
    assert isinstance(caught.value.__cause__, KeyError)


async def test_ledger_names_calls_that_never_ended(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ledger = RequestLedger()
    async with trio.open_nursery() as nursery:
        for i in range(12):
            nursery.start_soon(ledger.call, trio.sleep, 10 + i)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(AssertionError, match="12 of 12 calls never ended") as caught:
            ledger.assert_all_ended()
        assert "call 1: sleep(" in str(caught.value)
        assert "and 2 more" in str(caught.value)
    ledger.assert_all_ended()
    assert ledger.statistics().succeeded == 12


async def test_assert_no_tasks_left_names_tasks_and_threads(
    nursery: trio.Nursery,
) -> None:
    with assert_no_tasks_left():
        async with trio.open_nursery() as inner:
            inner.start_soon(trio.sleep, 0)

    async def lingering() -> None:
        await trio.sleep_forever()

    with (
        pytest.raises(AssertionError, match=r"1 tasks \[.*lingering'\], 0 threads"),
        assert_no_tasks_left(),
    ):
        nursery.start_soon(lingering)
    nursery.cancel_scope.cancel()

    release = threading.Event()
    thread = threading.Thread(target=release.wait, name="trioinfer-left-behind")
    try:
        with (
            pytest.raises(AssertionError, match=r"1 threads \['trioinfer-left-behind'\]"),
            assert_no_tasks_left(),
        ):
            thread.start()
    finally:
        release.set()
        thread.join()


def test_helpers_work_on_asyncio() -> None:
    async def main() -> None:
        backend = FaultyBackend(fail_on={2}, hang_on={3})
        ledger = RequestLedger()
        infer = ledger.wrap(trioinfer.Engine.infer)
        with assert_no_tasks_left():
            async with open_engine(registry=backend.registry()) as engine:
                await engine.load(config())
                await infer(engine, "m", {"x": X})
                with pytest.raises(BackendError):
                    await infer(engine, "m", {"x": X})
                with anyio.move_on_after(0.01):
                    await infer(engine, "m", {"x": X})
                assert_all_ended(engine, accepted=3)
        ledger.assert_all_ended()
        stats = ledger.statistics()
        assert (stats.succeeded, stats.cancelled, dict(stats.errors)) == (1, 1, {"BackendError": 1})

    anyio.run(main, backend="asyncio")


# -- chaos ---------------------------------------------------------------------------------


async def test_chaos_every_request_ends_exactly_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """1,000 requests, 3 faulty instances, 30% of callers cancelled at random moments."""
    rng = random.Random(1234)
    backend = FaultyBackend(
        FakeBackend(delay=0.002), seed=1234, error_rate=0.10, hang_rate=0.05, latency=(0, 0.003)
    )
    ledger = RequestLedger()
    infer = ledger.wrap(trioinfer.Engine.infer)
    wrong: list[int] = []

    async def cancel_later(scope: trio.CancelScope, delay: float) -> None:
        await trio.sleep(delay)
        scope.cancel()  # like a client that disconnects

    async def caller(engine: trioinfer.Engine, nursery: trio.Nursery, i: int) -> None:
        await trio.sleep(rng.uniform(0, 2.0))
        x = np.full((1, 4), i, np.float32)
        with trio.CancelScope() as scope:
            if rng.random() < 0.3:
                nursery.start_soon(cancel_later, scope, rng.uniform(0, 0.05))
            with trio.move_on_after(0.25):  # every caller has a deadline: hangs end
                try:
                    out = await infer(engine, "m", {"x": x})
                except trioinfer.TrioInferError:
                    return
                if not np.array_equal(out["y"], 2 * x):
                    wrong.append(i)

    with assert_no_tasks_left():
        async with open_engine(registry=backend.registry()) as engine:
            await engine.load(
                config(
                    instances=[Instance(count=3)],
                    batcher="dynamic",
                    batcher_options={"max_batch_size": 8, "max_queue_delay": 0.002},
                )
            )
            async with trio.open_nursery() as nursery:
                for i in range(1000):
                    nursery.start_soon(caller, engine, nursery, i)
            stats = engine.statistics().models["m"]
            assert_all_ended(engine)

    ledger.assert_all_ended()
    calls = ledger.statistics()
    faults = backend.statistics()
    assert wrong == []
    assert calls.calls == 1000
    assert calls.succeeded + calls.cancelled + sum(calls.errors.values()) == 1000
    # From the engine's side: what ended adds up to what it accepted, and each
    # caller-side outcome matches the engine's count of it.
    ended = stats.succeeded + stats.failed + stats.cancelled + stats.expired
    assert ended + stats.refused <= 1000  # the rest were cancelled on their way in
    assert calls.succeeded == stats.succeeded
    assert dict(calls.errors) == {"BackendError": stats.failed}
    # Expired requests reach their callers as the scope's own cancellation.
    assert calls.cancelled >= stats.cancelled + stats.expired
    # Every execution went to the faulty backend, and each kind of fault happened.
    assert faults.calls == stats.executions
    assert faults.errors > 0
    assert faults.hangs > 0
    assert stats.cancelled > 0
    assert stats.succeeded > 500


# -- the how-to's example (docs/how-to/testing.md) ---------------------------------------

Infer = Callable[..., Awaitable[Mapping[str, np.ndarray[Any, Any]]]]


# --8<-- [start:app]
async def score_all(infer: Infer, rows: list[np.ndarray], *, budget: float) -> list[float | None]:
    """The application under test: score each row within *budget* seconds, or give None."""
    scores: list[float | None] = []
    for row in rows:
        score = None
        with trio.move_on_after(budget):
            try:
                out = await infer("scorer", {"x": row[None, :]})
                score = float(out["y"].sum())
            except trioinfer.BackendError:
                pass  # this app's policy: a failed row scores None
        scores.append(score)
    return scores


# --8<-- [end:app]


# --8<-- [start:exact]
async def test_score_all_gives_none_for_a_failure_and_a_hang(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Calls 2 and 4 go wrong; the app's own config, naming "onnxruntime", is untouched.
    backend = FaultyBackend(fail_on={2}, hang_on={4})
    config = ModelConfig(name="scorer", path="scorer.onnx")
    ledger = RequestLedger()
    rows = [np.full(4, i, np.float32) for i in range(5)]

    with assert_no_tasks_left():
        async with open_engine(registry=backend.registry("onnxruntime")) as engine:
            await engine.load(config)
            t0 = trio.current_time()
            scores = await score_all(ledger.wrap(engine.infer), rows, budget=2.0)
            # Virtual time: the hang cost exactly its budget, and nothing else took any.
            assert trio.current_time() - t0 == 2.0
            assert_all_ended(engine, accepted=5)

    assert scores == [0.0, None, 16.0, None, 32.0]
    ledger.assert_all_ended()
    outcomes = ledger.statistics()
    assert (outcomes.succeeded, outcomes.cancelled) == (3, 1)
    assert outcomes.errors == {"BackendError": 1}


# --8<-- [end:exact]


# --8<-- [start:chaos]
@pytest.mark.parametrize("seed", range(5))
async def test_score_all_under_random_faults(
    seed: int, autojump_clock: trio.testing.MockClock
) -> None:
    backend = FaultyBackend(seed=seed, error_rate=0.1, hang_rate=0.05, latency=(0.01, 0.1))
    config = ModelConfig(name="scorer", path="scorer.onnx")
    ledger = RequestLedger()
    rows = [np.full(4, i, np.float32) for i in range(200)]

    with assert_no_tasks_left():
        async with open_engine(registry=backend.registry("onnxruntime")) as engine:
            await engine.load(config)
            scores = await score_all(ledger.wrap(engine.infer), rows, budget=1.0)
            assert_all_ended(engine, accepted=200)

    faults = backend.statistics()
    ledger.assert_all_ended()
    outcomes = ledger.statistics()
    # Each row got one score or None, and each None is one injected fault.
    assert scores.count(None) == faults.errors + faults.hangs
    assert outcomes.errors == ({"BackendError": faults.errors} if faults.errors else {})
    assert outcomes.cancelled == faults.hangs
    assert all(s == 8.0 * i for i, s in enumerate(scores) if s is not None)


# --8<-- [end:chaos]
