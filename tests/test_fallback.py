"""The fallback layer: breakers, retries, failover, hedging, recovery (plugin ``resilient``).

Faults come from `trioinfer.testing.FaultyBackend` around a `FakeBackend`
(``y = 2 * x``); time is a MockClock's, so every wait is exact and instant.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
import numpy as np
import pytest
import trio
import trio.testing

import trioinfer
from trioinfer import (
    BackendError,
    CircuitOpen,
    ConfigError,
    Engine,
    Instance,
    ModelConfig,
    open_engine,
)
from trioinfer.lowlevel import Execution
from trioinfer.testing import FakeBackend, FaultyBackend, assert_all_ended, check_fallback
from trioinfer_fallback import Breaker, BreakerState, NoFallback, Resilient

X = np.arange(4, dtype=np.float32).reshape(1, 4)


def config(
    name: str = "m",
    *,
    instances: list[Instance] | None = None,
    options: Mapping[str, Any] | None = None,
    fallback: str = "resilient",
) -> ModelConfig:
    return ModelConfig(
        name=name,
        path="-",
        backend="faulty",
        instances=instances or [Instance(count=2)],
        fallback=fallback,
        fallback_options=dict(options or {}),
    )


@asynccontextmanager
async def engine_with(
    backend: FaultyBackend, *configs: ModelConfig
) -> AsyncIterator[trioinfer.Engine]:
    async with open_engine(registry=backend.registry()) as engine:
        for c in configs:
            await engine.load(c)
        yield engine


def replicas(engine: Engine, model: str = "m") -> list[trioinfer.ReplicaStatistics]:
    return list(engine.statistics().models[model].replicas)


# -- the breaker's state machine ------------------------------------------------------


def test_breaker_opens_after_consecutive_failures_and_a_success_resets_the_count() -> None:
    breaker = Breaker(fail_max=3)
    assert not breaker.failure()
    assert not breaker.failure()
    assert not breaker.success()
    assert not breaker.failure()
    assert not breaker.failure()
    assert breaker.failure()
    assert breaker.state is BreakerState.OPEN
    assert breaker.describe() == "3 consecutive failures"
    assert not breaker.failure()  # open already: no second "opened" event


def test_breaker_opens_on_failure_rate_over_a_full_window() -> None:
    breaker = Breaker(fail_max=100, failure_rate=0.5, window=4)
    for failed in (True, False, True):
        assert not (breaker.failure() if failed else breaker.success())
    assert breaker.state is BreakerState.CLOSED  # 2 of 3: the window is not full yet
    assert breaker.failure()  # 3 of the last 4 >= 50%
    assert "3 of the last 4 calls failed" in breaker.describe()


def test_breaker_rate_counts_only_the_window() -> None:
    breaker = Breaker(fail_max=100, failure_rate=0.75, window=4)
    for failed in (True, True, False, False, False, True, True):
        assert not (breaker.failure() if failed else breaker.success())
    assert breaker.failure()  # the window is now F, T, T, T


def test_half_open_needs_every_probe_and_reopening_backs_off() -> None:
    breaker = Breaker(fail_max=1, reset_timeout=2.0, max_reset_timeout=5.0, probes=2)
    assert breaker.failure()
    breaker.half_open()
    assert breaker.failure()  # a failed probe reopens it...
    assert breaker.wait == 4.0  # ...for twice as long
    breaker.half_open()
    assert breaker.failure()
    assert breaker.wait == 5.0  # capped
    breaker.half_open()
    assert not breaker.success()
    assert breaker.success()  # the second probe closes it
    assert breaker.state is BreakerState.CLOSED
    assert breaker.wait == 2.0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"fail_max": 0}, "fail_max must be a positive integer"),
        ({"failure_rate": 1.5}, "failure_rate must be a share"),
        ({"failure_rate": True}, "failure_rate must be a share"),
        ({"reset_timeout": -1}, "reset_timeout must be a number of seconds"),
        ({"probes": True}, "probes must be a positive integer"),
        ({"fail_mx": 3}, "unknown breaker options ['fail_mx']"),
    ],
)
def test_breaker_options_are_checked(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Breaker.from_options(options)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"attempts": 0}, "attempts must be an integer >= 1"),
        ({"backoff": -0.1}, "backoff must be a number of seconds from .*, or 0; got -0.1"),
        ({"timeout": 0}, r"timeout must be a number of seconds from .* years\); got 0"),
        ({"models": "other"}, "models must be a list of model names"),
        ({"default": [1, 2]}, "default must be a table"),
        ({"breaker": {"window": 0}}, "window must be a positive integer"),
        ({"breaker": 5}, "breaker must be a table"),
    ],
)
def test_resilient_options_are_checked(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Resilient(**options)


@pytest.mark.parametrize(
    ("default", "message"),
    [
        ({"z": [0, 0, 0, 0]}, r"unknown: \['z'\], missing: \['y'\]"),
        (
            {"y": [0, 0, 0]},
            r"has shape \(3,\); one row of output 'y' has shape \('batch', 4\)|"
            r"has shape \(3,\); one row of output 'y' has shape \(4,\)",
        ),
        ({"y": ["a", "b", "c", "d"]}, "is not a float32 array"),
    ],
)
async def test_a_default_that_does_not_fit_the_model_is_refused_at_load(
    autojump_clock: trio.testing.MockClock, default: dict[str, Any], message: str
) -> None:
    backend = FaultyBackend()
    async with open_engine(registry=backend.registry()) as engine:
        with pytest.raises(ConfigError, match=message):
            await engine.load(config(options={"default": default}))
        assert engine.models() == []
    assert all(instance.inner.closed for instance in backend.instances)  # type: ignore[attr-defined]


async def test_a_model_cannot_fail_over_to_itself(autojump_clock: trio.testing.MockClock) -> None:
    async with open_engine(registry=FaultyBackend().registry()) as engine:
        with pytest.raises(ConfigError, match="lists itself"):
            await engine.load(config(options={"models": ["m"]}))


# -- failover and retry ------------------------------------------------------------------


async def test_a_failed_execution_fails_over_to_another_instance_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The first call of the "GPU" fails, not transient: no waiting, straight to the CPU.
    backend = FaultyBackend(fail_on=[1], transient=False, devices=["cuda:0"])
    instances = [Instance(device="cuda:0", capacity=8), Instance()]
    async with engine_with(backend, config(instances=instances)) as engine:
        start = trio.current_time()
        result = await engine.infer_detailed("m", {"x": X})
        assert trio.current_time() == start  # no backoff before a failover
        np.testing.assert_array_equal(result.outputs["y"], X * 2)
        assert result.fallbacks == ("failover instance 1 (cpu)",)
        assert (result.model, result.instance, result.device) == ("m", 1, "cpu")
        stats = engine.statistics().models["m"]
        assert stats.fallbacks == {"failover": 1}
        assert [r.failures for r in stats.replicas] == [1, 0]
        assert stats.succeeded == 1


async def test_a_transient_error_is_retried_in_place_after_a_jittered_backoff(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FaultyBackend(fail_on=[1, 2], transient=True)
    options = {"attempts": 3, "backoff": 0.5, "max_backoff": 0.75, "seed": 7}
    async with engine_with(backend, config(instances=[Instance()], options=options)) as engine:
        start = trio.current_time()
        result = await engine.infer_detailed("m", {"x": X})
        waited = trio.current_time() - start
        assert result.fallbacks == ("retry instance 0 (cpu)", "retry instance 0 (cpu)")
        assert 0 < waited <= 0.5 + 0.75  # full jitter under caps 0.5, then 0.75 (not 1.0)
        assert backend.statistics().planned_errors == 2


async def test_inferences_count_the_rows_that_succeeded_once_not_the_attempts(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Triton's inference_count: a request retried twice counts its rows once; a
    # request that fails counts none, though both ran (executions counts them).
    backend = FaultyBackend(fail_on=[1, 2, 4, 5, 6], transient=True)
    options = {"attempts": 3, "backoff": 0.01}
    rows = np.ones((3, 4), dtype=np.float32)
    async with engine_with(backend, config(instances=[Instance()], options=options)) as engine:
        await engine.infer("m", {"x": rows})  # calls 1, 2 fail; 3 answers
        stats = engine.statistics().models["m"]
        assert (stats.inferences, stats.succeeded, stats.executions) == (3, 1, 3)
        with pytest.raises(BackendError):
            await engine.infer("m", {"x": rows[:2]})  # calls 4, 5, 6: every attempt fails
        stats = engine.statistics().models["m"]
        assert (stats.inferences, stats.succeeded, stats.failed) == (3, 1, 1)
        assert stats.executions == 6


async def test_successful_executions_count_the_runs_that_answered_not_the_attempts(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Triton's execution_count: only runs whose outputs went to their requests.
    # executions counts every run started, failed attempts included.
    backend = FaultyBackend(fail_on=[1, 2, 4, 5, 6], transient=True)
    options = {"attempts": 3, "backoff": 0.01}
    async with engine_with(backend, config(instances=[Instance()], options=options)) as engine:
        await engine.infer("m", {"x": X})  # calls 1, 2 fail; 3 answers
        stats = engine.statistics().models["m"]
        assert (stats.successful_executions, stats.executions) == (1, 3)
        with pytest.raises(BackendError):
            await engine.infer("m", {"x": X})  # calls 4, 5, 6: every attempt fails
        stats = engine.statistics().models["m"]
        assert (stats.successful_executions, stats.executions) == (1, 6)
        await engine.infer("m", {"x": X})  # call 7 answers at once
        stats = engine.statistics().models["m"]
        assert (stats.successful_executions, stats.executions) == (2, 7)


async def test_a_permanent_error_on_the_only_instance_is_not_retried(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FaultyBackend(fail_on=[1], transient=False)
    async with engine_with(backend, config(instances=[Instance()])) as engine:
        with pytest.raises(BackendError, match="fail_on on call 1"):
            await engine.infer("m", {"x": X})
        assert backend.statistics().calls == 1


async def test_attempts_bound_every_execution_of_a_batch(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FaultyBackend(error_rate=1.0, transient=True)
    options = {"attempts": 4, "backoff": 0.01}
    async with engine_with(backend, config(instances=[Instance(count=3)], options=options)) as e:
        with pytest.raises(BackendError, match="injected fault"):
            await e.infer("m", {"x": X})
        assert backend.statistics().calls == 4


async def test_no_retry_starts_after_the_callers_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The retry would wait up to 100 s; the caller gives the request 1 s.
    backend = FaultyBackend(fail_on=[1], transient=True)
    options = {"backoff": 100.0, "max_backoff": 100.0, "seed": 1}
    async with engine_with(backend, config(instances=[Instance()], options=options)) as engine:
        start = trio.current_time()
        with trio.fail_after(1), pytest.raises(BackendError):
            await engine.infer("m", {"x": X})
        assert trio.current_time() == start  # it gave up at once rather than sleep past 1 s
        assert backend.statistics().calls == 1


async def test_a_caller_that_leaves_during_the_backoff_is_not_sent_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FaultyBackend(fail_on=[1], transient=True)
    options = {"backoff": 10.0, "max_backoff": 10.0, "seed": 3}
    async with engine_with(backend, config(instances=[Instance()], options=options)) as engine:
        async with trio.open_nursery() as nursery:
            # Cancelled from outside: the request has no deadline the plugin could see.
            nursery.start_soon(engine.infer, "m", {"x": X})
            await trio.sleep(0.001)  # the first call has failed; the retry waits
            nursery.cancel_scope.cancel()
        await trio.sleep(20)
        assert backend.statistics().calls == 1
        assert_all_ended(engine)
        assert engine.statistics().models["m"].cancelled == 1


async def test_a_hung_execution_times_out_and_fails_over(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FaultyBackend(hang_on=[1], devices=["cuda:0"])
    options = {"timeout": 2.0}
    instances = [Instance(device="cuda:0", capacity=8), Instance()]
    async with engine_with(backend, config(instances=instances, options=options)) as engine:
        start = trio.current_time()
        result = await engine.infer_detailed("m", {"x": X})
        assert trio.current_time() - start == pytest.approx(2.0)
        assert result.fallbacks == ("failover instance 1 (cpu)",)
        assert backend.statistics().hangs == 1


async def test_a_hedge_answers_first_and_the_slow_execution_is_cancelled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    slow = FakeBackend(delay=0.0)
    backend = FaultyBackend(slow, hang_on=[1], devices=["cuda:0"])
    options = {"hedge_after": 0.1}
    instances = [Instance(device="cuda:0", capacity=8), Instance()]
    async with engine_with(backend, config(instances=instances, options=options)) as engine:
        start = trio.current_time()
        result = await engine.infer_detailed("m", {"x": X})
        assert trio.current_time() - start == pytest.approx(0.1)
        assert result.fallbacks == ("hedge instance 1 (cpu)",)
        assert result.instance == 1
        assert all(instance.running == 0 for instance in slow.loaded)
        # The hung call was cancelled by the winner, not by a fault: no breaker counts it.
        assert [r.failures for r in replicas(engine)] == [0, 0]


async def test_failover_prefers_the_same_device_then_bigger_capacity(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FaultyBackend(fail_on=[1], transient=False, devices=["cuda:0"])
    instances = [
        Instance(device="cuda:0", capacity=8),
        Instance(device="cpu", capacity=1),
        Instance(device="cpu", capacity=2),
    ]
    async with engine_with(backend, config(instances=instances)) as engine:
        result = await engine.infer_detailed("m", {"x": X})
    # FakeBackend reports the placement's device, so the "GPU" shows as cuda:0 here.
    assert result.fallbacks == ("failover instance 2 (cpu)",)


async def test_a_request_accepted_before_the_engine_closed_fails_over_while_it_drains(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Its failover to another model is admitted in the drain period; outside callers are not."""
    failing = FaultyBackend(error_rate=1.0, transient=False, latency=1.0)
    registry = trioinfer.Registry(
        extra={"backends": {"faulty": lambda: failing, "fake": FakeBackend}}
    )
    results: list[trioinfer.InferenceResult] = []

    async def call(engine: trioinfer.Engine) -> None:
        results.append(await engine.infer_detailed("m", {"x": X}))

    async with trio.open_nursery() as nursery:
        async with open_engine(registry=registry, drain_period=5) as engine:
            await engine.load(
                config(instances=[Instance()], options={"models": ["backup"], "attempts": 1})
            )
            await engine.load(ModelConfig(name="backup", path="-", backend="fake"))
            nursery.start_soon(call, engine)
            await trio.testing.wait_all_tasks_blocked()
            t0 = trio.current_time()
        # Its one attempt failed 1 s in, in the drain period; then backup answered it.
        assert trio.current_time() - t0 == 1.0
        with pytest.raises(trioinfer.EngineClosed):
            await engine.infer("backup", {"x": X})
    [result] = results
    assert result.model == "backup"
    assert result.fallbacks == ("model backup",)
    np.testing.assert_array_equal(result.outputs["y"], X * 2)


async def test_every_instance_failing_goes_to_the_next_model_then_the_default(
    autojump_clock: trio.testing.MockClock,
) -> None:
    failing = FaultyBackend(error_rate=1.0, transient=False)
    backup = ModelConfig(name="backup", path="-", backend="faulty")
    options = {"models": ["missing", "backup"], "default": {"y": [9, 9, 9, 9]}}
    registry = trioinfer.Registry(
        extra={
            "backends": {"faulty": lambda: failing, "fake": FakeBackend},
        }
    )
    async with open_engine(registry=registry) as engine:
        await engine.load(config(options=options))
        await engine.load(config("other", options={"default": {"y": [9, 9, 9, 9]}}))
        await engine.load(ModelConfig(name="backup", path="-", backend="fake"))
        two_rows = np.ones((2, 4), np.float32)
        result = await engine.infer_detailed("m", {"x": two_rows})
        assert result.model == "backup"
        assert result.fallbacks == ("failover instance 1 (cpu)", "model backup")
        np.testing.assert_array_equal(result.outputs["y"], two_rows * 2)
        # Without a model to go to, the default answers, one row per input row.
        result = await engine.infer_detailed("other", {"x": two_rows})
        assert result.fallbacks == ("failover instance 1 (cpu)", "default")
        assert (result.instance, result.device) == (None, None)
        np.testing.assert_array_equal(result.outputs["y"], np.full((2, 4), 9, np.float32))
        assert engine.statistics().models["m"].fallbacks == {"failover": 1, "model": 1}
    del backup


async def test_two_models_failing_over_to_each_other_do_not_loop(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FaultyBackend(error_rate=1.0, transient=False)
    async with engine_with(
        backend,
        config("a", instances=[Instance()], options={"models": ["b"]}),
        config("b", instances=[Instance()], options={"models": ["a"]}),
    ) as engine:
        with pytest.raises(BackendError, match="injected fault"):
            await engine.infer("a", {"x": X})
        assert backend.statistics().calls == 2  # a once, b once, and no further


# -- breakers, taking out, recovery ---------------------------------------------------


async def test_an_open_breaker_takes_the_instance_out_until_a_probe_succeeds(
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="trioinfer")
    backend = FaultyBackend(fail_on=[1], transient=True, devices=["cuda:0"])
    options = {"breaker": {"fail_max": 1, "reset_timeout": 5.0}, "attempts": 1}
    instances = [Instance(device="cuda:0", capacity=8), Instance(device="cpu")]
    async with engine_with(backend, config(instances=instances, options=options)) as engine:
        with pytest.raises(BackendError):  # attempts=1: the failure reaches the caller
            await engine.infer("m", {"x": X})
        gpu, cpu = replicas(engine)
        assert (gpu.state, gpu.taken_out, cpu.state) == ("out", 1, "serving")
        assert gpu.reason is not None
        assert "1 consecutive failure;" in gpu.reason
        # Out of service, the GPU gets no batch although it has the bigger capacity.
        for _ in range(3):
            assert (await engine.infer_detailed("m", {"x": X})).fallbacks == ()
        (faulty_gpu,) = [i for i in backend.instances if i.device == "cuda:0"]
        assert faulty_gpu.statistics().calls == 1
        await trio.sleep(5.5)  # the reset timeout passes; the background probe (call 2) succeeds
        gpu, _ = replicas(engine)
        assert (gpu.state, gpu.reason) == ("serving", None)
        result = await engine.infer_detailed("m", {"x": X})
        assert (result.device, result.fallbacks) == ("cuda:0", ())
    messages = [r.getMessage() for r in caplog.records if "instance 0" in r.getMessage()]
    assert messages == [
        "model 'm': instance 0 (cuda:0) taken out of service: circuit breaker open after "
        "1 consecutive failure; last: injected fault: fail_on on call 1 of 0/m/cuda:0/0",
        "model 'm': instance 0 (cuda:0) back in service",
    ]


async def test_with_every_instance_out_requests_fail_at_once_with_circuit_open(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FaultyBackend(fail_on=[1], transient=True)
    options = {"breaker": {"fail_max": 1, "reset_timeout": 10.0}}
    async with engine_with(backend, config(options=options)) as engine:
        waiting: list[BaseException] = []

        async def queued() -> None:
            try:
                await engine.infer("m", {"x": X})
            except trioinfer.TrioInferError as exc:
                waiting.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(queued)  # runs first and takes both instances down
            nursery.start_soon(queued)
            nursery.start_soon(queued)
        # The first batches took both instances down (which callers' batches ran
        # depends on scheduling); those still queued then failed at once rather
        # than wait for a deadline.
        kinds = Counter(type(e) for e in waiting)
        assert set(kinds) == {BackendError, CircuitOpen}
        assert kinds.total() == 3
        start = trio.current_time()
        with pytest.raises(CircuitOpen, match="every instance of model 'm' is out") as info:
            await engine.infer("m", {"x": X})
        assert trio.current_time() == start
        assert info.value.retry_after == pytest.approx(10.0)
        stats = engine.statistics().models["m"]
        assert stats.refused == 1
        assert_all_ended(engine)
        await trio.sleep(10.5)
        np.testing.assert_array_equal((await engine.infer("m", {"x": X}))["y"], X * 2)


async def test_a_dead_instance_is_recreated_and_serves_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FaultyBackend(crash_after=2)
    options = {"breaker": {"fail_max": 1, "reset_timeout": 3.0}}
    async with engine_with(backend, config(instances=[Instance()], options=options)) as engine:
        for _ in range(2):
            await engine.infer("m", {"x": X})
        with pytest.raises(BackendError, match="crashed"):
            await engine.infer("m", {"x": X})
        start = trio.current_time()
        while replicas(engine)[0].state != "serving":  # noqa: ASYNC110  # polls engine state
            await trio.sleep(0.01)
        # A dead session is re-created at once, without waiting the reset timeout.
        assert trio.current_time() - start < 3.0
        (replica,) = replicas(engine)
        assert (replica.recreated, replica.taken_out) == (1, 1)
        assert len(backend.instances) == 2
        await engine.infer("m", {"x": X})
    assert all(instance.inner.closed for instance in backend.instances)  # type: ignore[attr-defined]


async def test_cancelled_callers_never_trip_a_breaker(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FaultyBackend(hang_on=[1, 2, 3])
    options = {"breaker": {"fail_max": 1}}
    async with engine_with(backend, config(instances=[Instance()], options=options)) as engine:
        for _ in range(3):
            with trio.move_on_after(1):
                await engine.infer("m", {"x": X})
        (replica,) = replicas(engine)
        assert (replica.state, replica.failures) == ("serving", 0)
        assert backend.statistics().hangs == 3


async def test_none_fallback_runs_each_batch_once(autojump_clock: trio.testing.MockClock) -> None:
    backend = FaultyBackend(fail_on=[1], transient=True)
    async with engine_with(backend, config(fallback="none")) as engine:
        with pytest.raises(BackendError):
            await engine.infer("m", {"x": X})
        assert backend.statistics().calls == 1


async def test_a_fallback_that_answers_nobody_fails_its_requests_with_a_contract_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    class Lazy:
        async def execute(self, execution: Execution) -> None:
            return None

    registry = trioinfer.Registry(
        extra={"backends": {"faulty": FaultyBackend}, "fallbacks": {"lazy": Lazy}}
    )
    async with open_engine(registry=registry) as engine:
        await engine.load(config(fallback="lazy"))
        with pytest.raises(
            trioinfer.PluginContractError, match=r"fallback .lazy.*returned without answering"
        ):
            await engine.infer("m", {"x": X})


async def test_probe_inputs_follow_the_signature(autojump_clock: trio.testing.MockClock) -> None:
    seen: list[dict[str, np.ndarray[Any, Any]]] = []

    def record(inputs: Mapping[str, np.ndarray[Any, Any]]) -> dict[str, np.ndarray[Any, Any]]:
        seen.append(dict(inputs))
        return {"y": inputs["x"] * 2}

    backend = FaultyBackend(FakeBackend(record), fail_on=[1], transient=True)
    options = {"breaker": {"fail_max": 1, "reset_timeout": 1.0}, "attempts": 1}
    async with engine_with(backend, config(instances=[Instance()], options=options)) as engine:
        with pytest.raises(BackendError):
            await engine.infer("m", {"x": X})
        await trio.sleep(1.5)
    (probe,) = seen
    assert probe["x"].shape == (1, 4)
    assert probe["x"].dtype == np.float32
    assert not probe["x"].any()


# -- the conformance check ---------------------------------------------------------------


async def test_first_party_fallbacks_pass_check_fallback(
    autojump_clock: trio.testing.MockClock,
) -> None:
    await check_fallback(NoFallback)
    await check_fallback(Resilient)
    await check_fallback(
        lambda: Resilient(timeout=1.0, hedge_after=0.01, breaker={"fail_max": 2}, attempts=5)
    )
    # One that answers every failed execution with a default keeps the contract too
    # (check_fallback refused it: "with every execution failing, request 0 got outputs").
    await check_fallback(lambda: Resilient(default={"y": [0.0] * 4}))


class _Lazy:
    async def execute(self, execution: Execution) -> None:
        return None


class _Shielded:
    async def execute(self, execution: Execution) -> None:
        with trio.CancelScope(shield=True):  # so nothing can abort the execution
            await execution.run()


class _Silent:
    async def execute(self, execution: Execution) -> None:
        with contextlib.suppress(trioinfer.BackendError):
            await execution.run()


@pytest.mark.parametrize(
    ("fallback", "message"),
    [
        (_Lazy, "with healthy instances request .* returned without answering"),
        (_Silent, "returned without answering"),
        (_Shielded, "was not aborted"),
    ],
)
async def test_check_fallback_catches_broken_fallbacks(
    autojump_clock: trio.testing.MockClock, fallback: type[Any], message: str
) -> None:
    with pytest.raises(AssertionError, match=message):
        await check_fallback(fallback)


def test_resilient_passes_check_fallback_on_asyncio() -> None:
    # The core runs on anyio; the fallback layer must too (real clock: a few seconds).
    anyio.run(check_fallback, Resilient, backend="asyncio")


def test_probe_inputs_of_a_bytes_input_are_bytes() -> None:
    # A BYTES input reaches a Python model as bytes (utf8 false), an ONNX one's as str:
    # a probe gives each what its requests give it (it gave str "" to both, and a model
    # that decodes its bytes failed every probe, keeping its circuit open).
    from trioinfer._runner import _probe_inputs

    signature = trioinfer.ModelSignature(
        inputs=(
            trioinfer.TensorSpec("raw", np.dtype(object), (None,)),
            trioinfer.TensorSpec("text", np.dtype(object), (None,), utf8=True),
        ),
        outputs=(),
    )
    probe = _probe_inputs(signature)
    assert probe["raw"].tolist() == [b""]
    assert probe["text"].tolist() == [""]


class _ReloadFails(FaultyBackend):
    """A FaultyBackend whose every load after the first fails, stamping when it was tried."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.loads: list[float] = []

    async def load(self, config: ModelConfig, placement: Any) -> Any:
        self.loads.append(trio.current_time())
        if len(self.loads) > 1:
            raise RuntimeError("the device is gone")
        return await super().load(config, placement)


async def test_a_failing_re_creation_backs_off_like_a_failing_probe(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A dead instance whose device is gone: each re-creation (a model load, the
    # costliest thing an engine does) fails. Like a failed probe, each failure
    # reopens the breaker with its wait doubled, up to max_reset_timeout, rather
    # than reloading every reset_timeout for ever.
    backend = _ReloadFails(crash_after=0)
    breaker = {"fail_max": 1, "reset_timeout": 1.0, "max_reset_timeout": 8.0}
    options = {"breaker": breaker, "attempts": 1}
    async with engine_with(backend, config(instances=[Instance()], options=options)) as engine:
        with pytest.raises(BackendError, match="crashed"):
            await engine.infer("m", {"x": X})
        await trio.sleep(40)
        (replica,) = replicas(engine)
        assert replica.state == "out"
        assert replica.reason is not None
        assert "re-creating it failed" in replica.reason
        gaps = [b - a for a, b in zip(backend.loads[1:], backend.loads[2:], strict=False)]
        assert gaps[:4] == pytest.approx([2.0, 4.0, 8.0, 8.0])


async def test_the_first_retry_waits_up_to_backoff_even_after_a_failover(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # As documented ("the first transient retry waits up to 50 ms, then doubling"):
    # the waits double with each retry, not with each execution, so a failover
    # (which waits nothing) before the first retry does not double its bound.
    backend = FaultyBackend(fail_on=[1, 2], transient=True)
    options = {"attempts": 3, "backoff": 0.5, "max_backoff": 4.0, "seed": 0}  # draws 0.844
    async with engine_with(backend, config(options=options)) as engine:
        start = trio.current_time()
        with pytest.raises(BackendError):
            await engine.infer_detailed("m", {"x": X})
        waited = trio.current_time() - start
        assert 0 < waited <= 0.5
        assert backend.statistics().planned_errors == 3
