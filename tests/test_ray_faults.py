"""The ray backend on a real one-node Ray on loopback: dead and killed actors, deadlines and
cancellation across the hop, nothing left behind at exit or SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import ray
import trio

import trioinfer
import trioinfer_ray
from _ray import Recording, actor_gone, driver_refs, wait_for_counter
from trioinfer import (
    BackendError,
    BackendUnavailable,
    DeadlineExceeded,
    Instance,
    ModelConfig,
    open_engine,
)
from trioinfer.lowlevel import Placement

if TYPE_CHECKING:
    pass

pytestmark = pytest.mark.ray


async def test_a_dead_actor_is_backend_unavailable(local_ray: None, mlp_model: Path) -> None:
    config = ModelConfig(name="m", path=mlp_model, backend="ray")
    instance = await trioinfer_ray.RayBackend().load(config, config.placements()[0])
    try:
        ray.kill(instance.actor)
        with pytest.raises(BackendUnavailable, match="is gone"):  # noqa: PT012
            with trio.fail_after(60):
                while True:  # the kill lands a moment after it returns
                    await instance.execute({"input": np.zeros((1, 64), np.float32)})
    finally:
        await instance.aclose()


async def test_a_lone_actor_killed_leaves_its_model_not_ready_until_loaded_again(
    local_ray: None, mlp_model: Path
) -> None:
    """Without the resilient fallback, a lone actor killed (or lost with its node) left its
    model ready while every request failed. Its death is known with no request sent (the
    actor's pending watch call fails): the instance shows as out, the model not ready,
    requests fail naming the dead actor, and loading the model again brings it back."""
    recording = Recording()
    xs = np.zeros((1, 64), np.float32)
    config = ModelConfig(name="m", path=mlp_model, backend="ray")
    async with open_engine(registry=recording.registry()) as engine:
        await engine.load(config)
        (instance,) = recording.instances
        assert engine.model("m").unavailable is None
        assert instance.gone is None
        ray.kill(instance.actor)
        with trio.fail_after(60):
            while engine.model("m").unavailable is None:  # noqa: ASYNC110  # Ray's news
                await trio.sleep(0.01)
        unavailable = engine.model("m").unavailable
        assert unavailable is not None
        assert "no instance of model 'm' serves it" in unavailable
        assert "is gone (ActorDiedError)" in unavailable
        assert "killed by `ray.kill`" in unavailable  # Ray says why
        assert instance.node_id[:12] in unavailable  # which actor, on which node
        (replica,) = engine.statistics().models["m"].replicas
        assert replica.state == "out"
        assert str(replica.reason).startswith("gone: ")
        with pytest.raises(BackendUnavailable, match="is gone") as failed:
            await engine.infer("m", {"input": xs})
        assert "'m' instance 0 (ray)" in str(failed.value)
        await engine.load(config, replace=True)
        assert engine.model("m").unavailable is None
        assert (await engine.infer("m", {"input": xs}))["output"].shape == (1, 10)
    assert all(actor_gone(handle) for handle in recording.handles)


async def test_no_remote_compute_for_requests_that_expired_or_left_while_queued(
    local_ray: None, slow_model: Path
) -> None:
    recording = Recording()
    xs = np.ones((256, 512), np.float32)
    async with open_engine(registry=recording.registry()) as engine:
        await engine.load(
            ModelConfig(
                name="slow", path=slow_model, backend="ray", instances=[Instance(threads=1)]
            )
        )
        (instance,) = recording.instances
        outcomes: list[str] = []
        running = trio.Event()

        async def long_batch() -> None:
            running.set()
            await engine.infer("slow", {"x": xs})  # a second or so: the others arrive meanwhile
            outcomes.append("long")

        async def expires() -> None:
            with pytest.raises(trio.TooSlowError), trio.fail_after(0.05):
                await engine.infer("slow", {"x": xs[:1]})
            outcomes.append("expired")

        async def leaves() -> None:
            with trio.CancelScope() as scope:
                nursery.start_soon(cancel_soon, scope)
                await engine.infer("slow", {"x": xs[:1]})
            outcomes.append("left")

        async def cancel_soon(scope: trio.CancelScope) -> None:
            await trio.sleep(0.05)
            scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(long_batch)
            await running.wait()
            await trio.sleep(0.01)
            nursery.start_soon(expires)
            nursery.start_soon(leaves)
        stats = await instance.remote_statistics()
    assert sorted(outcomes) == ["expired", "left", "long"]
    assert stats["computed"] == 1  # the long batch alone: nothing for those that did not wait
    assert stats["expired"] == 0  # refused in the driver, never sent


async def test_fail_after_cancels_the_remote_run_and_the_actor_takes_the_next_call(
    local_ray: None, slow_model: Path
) -> None:
    recording = Recording()
    xs = np.ones((256, 512), np.float32)
    async with open_engine(registry=recording.registry()) as engine:
        await engine.load(
            ModelConfig(
                name="slow", path=slow_model, backend="ray", instances=[Instance(threads=1)]
            )
        )
        (instance,) = recording.instances
        with pytest.raises(trio.TooSlowError):
            with trio.fail_after(0.3):
                await engine.infer("slow", {"x": xs})
        # Ray answers the cancelled call at once; the actor's coroutine ends a moment later.
        stats = await wait_for_counter(instance, "cancelled", 1)
        assert stats["cancelled"] == 1  # ray.cancel reached the actor's call ...
        assert stats["aborted"] == 1  # ... which stopped ONNX Runtime (RunOptions.terminate)
        assert stats["expired"] == 0  # ... and it counts once, as cancelled
        model = engine.statistics().models["slow"]
        # The caller's scope fired first: one request, ended once, as a local one would.
        assert (model.cancelled, model.expired, model.failed, model.succeeded) == (1, 0, 0, 0)
        assert model.successful_executions == 0  # nothing delivered
        out = await engine.infer("slow", {"x": xs[:1]})
        assert out["y"].shape == (1, 512)
        assert (await instance.remote_statistics())["computed"] == 2


@pytest.mark.parametrize("how", ["exit", "cancelled"])
async def test_engine_exit_leaves_no_actor(local_ray: None, mlp_model: Path, how: str) -> None:
    recording = Recording()
    with trio.CancelScope() as scope:
        async with open_engine(registry=recording.registry()) as engine:
            await engine.load(
                ModelConfig(name="m", path=mlp_model, backend="ray", instances=[Instance(count=2)])
            )
            await engine.infer("m", {"input": np.zeros((1, 64), np.float32)})
            if how == "cancelled":
                scope.cancel()
                await trio.sleep_forever()
    assert len(recording.handles) == 2
    assert all(instance.actor is None for instance in recording.instances)
    assert all(actor_gone(handle) for handle in recording.handles)


# -- the audit: deadlines, cancellation, loss, backpressure and leaks across the hop ------


def slow_config(**kwargs: Any) -> ModelConfig:
    """The slow model on one actor thread, pipelined: a second batch waits in the actor."""
    options = kwargs.pop("backend_options", {})
    return ModelConfig(
        name="slow",
        path=kwargs.pop("path"),
        backend="ray",
        instances=kwargs.pop("instances", [Instance(threads=1)]),
        backend_options={"onnxruntime": {"dispatch": "thread", "pipeline_depth": 2}, **options},
        **kwargs,
    )


@pytest.mark.parametrize("whose", ["queue_timeouts", "caller", "queue_timeouts+breaker"])
async def test_a_batch_whose_time_runs_out_queued_in_the_actor_is_never_computed(
    local_ray: None, slow_model: Path, whose: str
) -> None:
    """With pipeline_depth 2 a second batch is sent while the first runs, and waits in the
    actor: its deadline passes there (the caller's own, or its queue timeout), and the
    session must not run it once the first ends. The actor's refusal is no fault of the
    instance: a breaker does not count it."""
    recording = Recording()
    xs = np.ones((256, 512), np.float32)
    timeouts = {0: 0.2} if whose.startswith("queue_timeouts") else {}
    breaker: dict[str, Any] = {}
    if whose.endswith("breaker"):
        breaker = {"fallback": "resilient", "fallback_options": {"breaker": {"fail_max": 1}}}
    async with open_engine(registry=recording.registry()) as engine:
        await engine.load(slow_config(path=slow_model, queue_timeouts=timeouts, **breaker))
        (instance,) = recording.instances
        running = trio.Event()
        outcome: list[str] = []

        async def long_batch() -> None:
            running.set()
            await engine.infer("slow", {"x": xs})

        async def short() -> None:
            try:
                if whose == "caller":
                    with trio.fail_after(0.2):
                        await engine.infer("slow", {"x": xs[:1]})
                else:
                    await engine.infer("slow", {"x": xs[:1]})
                outcome.append("answered")
            except (DeadlineExceeded, trio.TooSlowError) as exc:
                outcome.append(type(exc).__name__)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(long_batch)
            await running.wait()
            await wait_for_counter(instance, "computed", 1)  # the long batch runs
            nursery.start_soon(short)
        stats = await instance.remote_statistics()
        model = engine.statistics().models["slow"]
    expected = "TooSlowError" if whose == "caller" else "DeadlineExceeded"
    assert outcome == [expected]
    assert stats["computed"] == 1  # the long batch alone
    assert model.replicas[0].state == "serving"
    assert model.replicas[0].taken_out == 0
    assert model.succeeded == 1
    assert model.expired + model.cancelled == 1  # the short request, counted once
    assert model.failed == 0


async def test_many_concurrent_deadlines_end_once_and_the_hop_stays_bounded(
    local_ray: None, mlp_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """200 callers with deadlines from 1 ms to none: each ends once; at most pipeline_depth
    calls per actor are in flight across the hop, however many callers wait."""
    in_flight = peak = 0
    real_wait = trioinfer_ray._backend.wait_ref

    async def counting(ref: Any, **kwargs: Any) -> Any:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            return await real_wait(ref, **kwargs)
        finally:
            in_flight -= 1

    monkeypatch.setattr(trioinfer_ray._backend, "wait_ref", counting)
    rng = np.random.default_rng(2)
    ends: Counter[str] = Counter()
    async with open_engine() as engine:
        await engine.load(
            ModelConfig(
                name="m",
                path=mlp_model,
                backend="ray",
                instances=[Instance(count=2, threads=1)],
                max_queue_size=1000,
                batcher="dynamic",
                batcher_options={"max_batch_size": 4, "max_queue_delay": 0.001},
                backend_options={"onnxruntime": {"dispatch": "thread", "pipeline_depth": 2}},
            )
        )

        async def one(i: int) -> None:
            # 5 s: ample for this load on a quiet machine; 0.5 s answered 22 of 40 on a
            # busy one (a make test of 4 processes beside other work on 2 cores).
            budget = [0.001, 0.01, 0.05, 5.0, math.inf][i % 5]
            x = rng.standard_normal((1, 64), dtype=np.float32)
            try:
                with trio.fail_after(budget):
                    out = await engine.infer("m", {"input": x})
                assert out["output"].shape == (1, 10)
                ends["answered"] += 1
            except trio.TooSlowError:
                ends["too slow"] += 1

        async with trio.open_nursery() as nursery:
            for i in range(200):
                nursery.start_soon(one, i)
        stats = engine.statistics().models["m"]
    assert sum(ends.values()) == 200
    assert ends["answered"] >= 80  # those without a deadline, and those of 5 s, at least
    assert stats.in_flight == 0
    assert stats.succeeded + stats.cancelled + stats.expired == 200
    assert stats.failed == 0
    assert 1 <= peak <= 2 * 2  # two actors, two calls each


@pytest.mark.parametrize("how", ["ray.kill", "process crash"])
async def test_an_actor_killed_mid_request_ends_it_once_with_backend_unavailable(
    local_ray: None, slow_model: Path, how: str
) -> None:
    """One batch running in the actor and one waiting there behind it: each ends once,
    whether Ray kills the actor or its process dies (SIGKILL: a crash in ONNX Runtime,
    the kernel's OOM killer)."""
    recording = Recording()
    xs = np.ones((256, 512), np.float32)
    async with open_engine(registry=recording.registry()) as engine:
        await engine.load(slow_config(path=slow_model))
        (instance,) = recording.instances
        errors: list[BaseException] = []

        async def caller(rows: int) -> None:
            try:
                await engine.infer("slow", {"x": xs[:rows]})
            except BackendUnavailable as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(caller, 256)
            await wait_for_counter(instance, "computed", 1)
            nursery.start_soon(caller, 1)
            with trio.fail_after(30):
                while engine.statistics().models["slow"].queued:  # noqa: ASYNC110
                    await trio.sleep(0.01)  # both sent: the second waits in the actor
            if how == "ray.kill":
                ray.kill(instance.actor)
            else:
                os.kill(instance.pid, signal.SIGKILL)  # the actor's node is this machine
        assert len(errors) == 2
        for error in errors:
            assert "is gone" in str(error)
            assert "'slow'" in str(error)  # which model and instance, and its node
            assert instance.node_id[:12] in str(error)
        stats = engine.statistics().models["slow"]
        assert (stats.failed, stats.succeeded, stats.in_flight) == (2, 0, 0)
        # Without the resilient fallback nothing replaces the instance: it is out of
        # service, and requests are refused saying why (fallback = "resilient" re-creates
        # it, see below).
        with pytest.raises(BackendUnavailable, match="is gone"):
            await engine.infer("slow", {"x": xs[:1]})


async def test_resilient_fails_over_a_killed_actor_and_recreates_it(
    local_ray: None, slow_model: Path
) -> None:
    """Two actors; one is killed while it computes: its batch is answered by the other, the
    breaker takes the instance out, and it is re-created as a new actor that serves."""
    recording = Recording()
    xs = np.ones((128, 512), np.float32)
    config = slow_config(
        path=slow_model,
        instances=[Instance(count=2, threads=1)],
        fallback="resilient",
        fallback_options={"attempts": 3, "breaker": {"fail_max": 1, "reset_timeout": 0.1}},
    )
    async with open_engine(registry=recording.registry()) as engine:
        await engine.load(config)
        results: list[Any] = []

        async def caller() -> None:
            results.append(await engine.infer_detailed("slow", {"x": xs}))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(caller)
            with trio.fail_after(60):
                while True:
                    running = [i for i in recording.instances[:2] if i.actor is not None]
                    counts = [(await i.remote_statistics())["computed"] for i in running]
                    if any(counts):
                        break
                    await trio.sleep(0.01)
            victim = running[counts.index(1)]
            ray.kill(victim.actor)
        (result,) = results  # answered once, on the other actor
        assert result.outputs["y"].shape == (128, 512)
        assert any(step.startswith("failover") for step in result.fallbacks)
        with trio.fail_after(60):
            while True:  # the breaker's re-prober, in the engine's task group
                replicas = engine.statistics().models["slow"].replicas
                if all(r.state == "serving" for r in replicas) and any(
                    r.recreated for r in replicas
                ):
                    break
                await trio.sleep(0.05)
        assert len(recording.instances) == 3  # a new actor for the lost one
        assert victim.actor is None  # the lost instance was closed
        out = await engine.infer("slow", {"x": xs[:1]})
        assert out["y"].shape == (1, 512)
    assert all(actor_gone(handle) for handle in recording.handles)


async def test_a_lone_killed_actor_is_not_retried_in_place_but_recreated(
    local_ray: None, slow_model: Path
) -> None:
    """One instance, resilient with retries: a lost actor is no transient fault, so its
    batch is not retried on it (it fails once, BackendUnavailable); the breaker re-creates
    the instance, and the next request is served by the new actor."""
    recording = Recording()
    xs = np.ones((256, 512), np.float32)
    config = slow_config(
        path=slow_model,
        fallback="resilient",
        fallback_options={"attempts": 3, "breaker": {"fail_max": 1, "reset_timeout": 0.1}},
    )
    async with open_engine(registry=recording.registry()) as engine:
        await engine.load(config)
        (instance,) = recording.instances
        errors: list[BaseException] = []

        async def caller() -> None:
            try:
                await engine.infer("slow", {"x": xs})
            except BackendUnavailable as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(caller)
            await wait_for_counter(instance, "computed", 1)
            ray.kill(instance.actor)
        (error,) = errors
        assert "is gone" in str(error)
        with trio.fail_after(60):
            while True:  # the breaker's re-prober, in the engine's task group
                (replica,) = engine.statistics().models["slow"].replicas
                if replica.state == "serving" and replica.recreated >= 1:
                    break
                await trio.sleep(0.05)
        assert len(recording.instances) == 2
        out = await engine.infer("slow", {"x": xs[:1]})
        assert out["y"].shape == (1, 512)
        stats = engine.statistics().models["slow"]
        assert (stats.failed, stats.succeeded) == (1, 1)
    assert all(actor_gone(handle) for handle in recording.handles)


async def test_unload_and_exit_leave_no_actor_task_or_object_ref(
    local_ray: None, mlp_model: Path, slow_model: Path
) -> None:
    recording = Recording()
    total = ray.cluster_resources()["CPU"]
    before = set(driver_refs())
    xs = np.ones((64, 512), np.float32)
    with trio.CancelScope() as scope:
        async with open_engine(registry=recording.registry()) as engine:
            await engine.load(ModelConfig(name="m", path=mlp_model, backend="ray"))
            await engine.load(slow_config(path=slow_model))
            await engine.infer("m", {"input": np.zeros((1, 64), np.float32)})
            await engine.unload("m")
            async with trio.open_nursery() as nursery:
                for _ in range(3):  # one running, one queued in the actor, one in the driver
                    nursery.start_soon(engine.infer, "slow", {"x": xs})
                await wait_for_counter(recording.instances[1], "computed", 1)
                scope.cancel()  # the driver leaves with calls in flight
    # Ray lets go of a ref whose future completed, and of an actor's CPU, a moment later.
    with trio.fail_after(10):
        while set(driver_refs()) - before:  # noqa: ASYNC110  # Ray's state
            await trio.sleep(0.05)
    with trio.fail_after(30):
        while ray.available_resources().get("CPU", 0) < total:  # noqa: ASYNC110  # Ray's state
            await trio.sleep(0.05)
    assert all(actor_gone(handle) for handle in recording.handles)


@pytest.mark.parametrize("how", ["killed", "failed-to-load"])
async def test_a_shipped_model_file_is_not_left_on_the_node(
    local_ray: None, tmp_path: Path, mlp_model: Path, how: str
) -> None:
    """ship_model = true writes the model to a temporary file on the node for ONNX
    Runtime to read. Only the actor's close removed it: an actor killed (or lost with
    its driver) and a load that failed left a copy of the weights in the node's /tmp.
    It goes once the session is made, or could not be."""
    name = f"shipped-{how}"
    left = Path(tempfile.gettempdir()).glob  # the actor's node is this machine
    path = mlp_model
    if how == "failed-to-load":
        path = tmp_path / "broken.onnx"
        path.write_bytes(b"not an ONNX model")
    config = ModelConfig(name=name, path=path, backend="ray", backend_options={"ship_model": True})
    if how == "failed-to-load":
        with pytest.raises(BackendError, match="on Ray node"):
            await trioinfer_ray.RayBackend().load(config, config.placements()[0])
    else:
        instance = await trioinfer_ray.RayBackend().load(config, config.placements()[0])
        handle = instance.actor
        try:
            out = await instance.execute({"input": np.zeros((1, 64), np.float32)})
            assert out["output"].shape == (1, 10)  # the session runs without its file
            ray.kill(handle)
            assert actor_gone(handle)
        finally:
            await instance.aclose()
    assert not list(left(f"trioinfer-{name}-*.onnx"))


async def test_unload_while_requests_run_answers_them_then_kills_the_actor(
    local_ray: None, slow_model: Path
) -> None:
    """engine.unload with one batch running in the actor, one waiting there and one in
    the driver's queue: all three are answered, then the actor is killed."""
    recording = Recording()
    xs = np.ones((64, 512), np.float32)
    before = set(driver_refs())
    answered: list[tuple[int, ...]] = []
    async with open_engine(registry=recording.registry()) as engine:
        await engine.load(slow_config(path=slow_model))
        (instance,) = recording.instances
        handle = instance.actor

        async def caller() -> None:
            answered.append((await engine.infer("slow", {"x": xs}))["y"].shape)

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(caller)
            await wait_for_counter(instance, "computed", 1)
            await engine.unload("slow")
            assert instance.actor is None
    assert answered == [(64, 512)] * 3
    with trio.fail_after(10):
        while set(driver_refs()) - before:  # noqa: ASYNC110  # Ray's state
            await trio.sleep(0.05)
    assert actor_gone(handle)  # (after: its own failed call is a ref in a cycle)


# -- the hop, on a gate: the model on the actor waits until the test opens it -------------


def gated_actor(gate: Path, *, blocking: bool) -> Any:
    """The ray backend's actor, its model recording each run and holding it at a gate.

    Each run appends a line to ``gate / "runs"``, then waits until ``gate / "open"``
    exists before ONNX Runtime computes, as an async model does (later calls reach the
    actor and wait there for their turn). ``blocking`` first holds the actor's event
    loop until ``gate / "loop"`` exists, as a CPU-bound run on it would: calls sent to
    the actor meanwhile wait in Ray's queue, before the actor's code sees them.
    Defined here so that Ray ships the classes by value to the actor's process.
    """

    class Gated:
        def __init__(self, inner: Any) -> None:
            self.inner = inner
            self.signature = inner.signature
            self.device = inner.device
            self.preferred_batch_sizes = inner.preferred_batch_sizes

        async def execute(self, inputs: Any) -> Any:
            with (gate / "runs").open("a") as log:  # a line, before the gate
                log.write("run\n")
            while blocking and not (gate / "loop").exists():
                time.sleep(0.005)  # noqa: ASYNC251  # holding the loop is the point
            while not (gate / "open").exists():  # noqa: ASYNC110  # another process opens it
                await asyncio.sleep(0.005)
            return await self.inner.execute(inputs)

        async def aclose(self) -> None:
            await self.inner.aclose()

    class GatedActor(trioinfer_ray.ModelActor):
        async def _open_instance(self, config: ModelConfig, placement: Placement) -> Any:
            return Gated(await super()._open_instance(config, placement))

    return ray.remote(GatedActor)


def runs(gate: Path) -> int:
    """Runs the gated model began."""
    path = gate / "runs"
    return len(path.read_text().splitlines()) if path.exists() else 0


async def wait_for_runs(gate: Path, value: int) -> None:
    with trio.fail_after(60):
        while runs(gate) < value:  # noqa: ASYNC110  # a file the actor writes
            await trio.sleep(0.01)


def count_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The calls to actors the driver waits on now: sent, and not yet answered."""
    waiting = [0]
    real_wait = trioinfer_ray._backend.wait_ref

    async def counting(ref: Any, **kwargs: Any) -> Any:
        waiting[0] += 1
        try:
            return await real_wait(ref, **kwargs)
        finally:
            waiting[0] -= 1

    monkeypatch.setattr(trioinfer_ray._backend, "wait_ref", counting)
    return waiting


async def wait_until_sent(waiting: list[int], calls: int) -> None:
    """Until the driver waits on *calls* calls to actors (`count_calls`)."""
    with trio.fail_after(60):
        while waiting[0] < calls:  # noqa: ASYNC110  # counted by the driver's tasks
            await trio.sleep(0.01)


def gated_config(mlp_model: Path, **kwargs: Any) -> ModelConfig:
    """One actor, two calls in flight to it: the second waits behind the gated first."""
    return ModelConfig(
        name="gated",
        path=mlp_model,
        backend="ray",
        instances=[Instance(threads=1)],
        backend_options={"onnxruntime": {"dispatch": "thread", "pipeline_depth": 2}},
        **kwargs,
    )


async def test_a_call_whose_deadline_passes_in_rays_queue_is_never_computed(
    local_ray: None, mlp_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run holds the actor's event loop; a second call, sent meanwhile, waits in Ray's
    queue for the actor past its deadline. The actor counted the time left from when
    its code first saw the call, so it computed it, for nobody. It counts from when the
    call left the driver (same machine, same clock): refused, uncomputed, with the
    DeadlineExceeded the engine gives locally."""
    monkeypatch.setattr(
        trioinfer_ray._backend, "_actor_class", gated_actor(tmp_path, blocking=True)
    )
    waiting = count_calls(monkeypatch)
    recording = Recording()
    budget = 0.2
    x = np.zeros((1, 64), np.float32)
    # Priority 0 waits at most `budget` to start; priority 1, the first call, has no limit.
    async with open_engine(registry=recording.registry()) as engine:
        await engine.load(gated_config(mlp_model, queue_timeouts={0: budget}))
        (instance,) = recording.instances
        outcomes: list[str] = []

        async def first() -> None:
            await engine.infer("gated", {"input": x}, priority=1)
            outcomes.append("first answered")

        async def second() -> None:
            with pytest.raises(DeadlineExceeded, match="before it reached the actor"):
                await engine.infer("gated", {"input": x})
            outcomes.append("second expired")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(first)
            await wait_for_runs(tmp_path, 1)  # the actor's loop is held from here on
            nursery.start_soon(second)
            await wait_until_sent(waiting, 2)
            await trio.sleep(budget)  # its deadline passes (at most `budget` after sending)
            (tmp_path / "loop").touch()
            (tmp_path / "open").touch()
        stats = await instance.remote_statistics()
        model = engine.statistics().models["gated"]
    assert sorted(outcomes) == ["first answered", "second expired"]
    assert runs(tmp_path) == 1  # the model saw the first call alone
    assert (stats["computed"], stats["expired"]) == (1, 1)
    assert stats["last_hop"] >= stats["last_remaining"]  # the hop outlasted its time left
    assert (model.succeeded, model.expired, model.failed) == (1, 1, 0)


@pytest.mark.parametrize("where", ["running", "queued in the actor", "queued in Ray"])
async def test_a_caller_that_leaves_has_its_remote_call_cancelled(
    local_ray: None, mlp_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """An async model's run, a call waiting in the actor for its turn, and one waiting in
    Ray's queue while a run holds the actor's event loop: a caller that leaves has its
    call cancelled, counted by the actor, and a queued call is never computed. The last
    one ray.cancel missed (Ray had handed it to the busy loop, and it ran once the loop
    was free): the driver's drop, which follows ray.cancel, cancels it in the actor."""
    blocking = where == "queued in Ray"
    monkeypatch.setattr(
        trioinfer_ray._backend, "_actor_class", gated_actor(tmp_path, blocking=blocking)
    )
    waiting = count_calls(monkeypatch)
    recording = Recording()
    x = np.zeros((1, 64), np.float32)
    async with open_engine(registry=recording.registry()) as engine:
        await engine.load(gated_config(mlp_model))
        (instance,) = recording.instances
        answered: list[str] = []

        async def caller(name: str, scope: trio.CancelScope) -> None:
            with scope:
                await engine.infer("gated", {"input": x})
                answered.append(name)

        first, second = trio.CancelScope(), trio.CancelScope()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(caller, "first", first)
            await wait_for_runs(tmp_path, 1)  # the first runs, held at the gate
            if where == "running":
                first.cancel()
                await wait_for_counter(instance, "cancelled", 1)
            else:
                nursery.start_soon(caller, "second", second)
                await wait_until_sent(waiting, 2)
                if not blocking:
                    await wait_for_counter(instance, "in_flight", 2)  # it waits for its turn
                second.cancel()
                (tmp_path / "loop").touch()  # the loop is free; the first still runs
                await wait_for_counter(instance, "cancelled", 1)
            (tmp_path / "open").touch()
        stats = await instance.remote_statistics()
        model = engine.statistics().models["gated"]
        seen = runs(tmp_path)
        after = await engine.infer("gated", {"input": x})  # the actor serves on
    assert after["output"].shape == (1, 10)
    assert seen == 1  # the cancelled call never reached the model
    assert answered == ([] if where == "running" else ["first"])
    assert (stats["computed"], stats["cancelled"]) == (1, 1)
    assert (model.cancelled, model.failed) == (1, 0)


def test_a_driver_that_handles_sigterm_keeps_its_handler(mlp_model: Path) -> None:
    """ray.init (in the thread the load starts Ray from) put Ray's crash handler on
    SIGTERM: `trioinfer serve` stopped by SIGTERM printed "*** SIGTERM received" with a
    stack dump, and exited with status 134 (aborted) after its graceful stop, not 0. The
    process's own handler is put back: it gets SIGTERM as it did before Ray started. In a
    process of its own, which starts its own Ray (this one is connected to the tests')."""
    program = f"""
import os, signal, trio
import trioinfer
import trioinfer_ray
from trioinfer import ModelConfig

async def main():
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        config = ModelConfig(name="m", path={str(mlp_model)!r}, backend="ray")
        instance = await trioinfer_ray.RayBackend().load(config, config.placements()[0])
        os.kill(os.getpid(), signal.SIGTERM)
        async for signum in signals:
            print("stopping on", signal.Signals(signum).name, flush=True)
            break
        await instance.aclose()

trio.run(main)
"""
    with tempfile.TemporaryDirectory(prefix="ray", dir="/tmp") as temp:  # short: Ray's sockets
        result = subprocess.run(
            [sys.executable, "-c", program],
            capture_output=True,
            text=True,
            timeout=540,
            env={**os.environ, "RAY_TMPDIR": temp},
            check=False,
        )
    assert "stopping on SIGTERM" in result.stdout, result.stdout + result.stderr
    assert "SIGTERM received" not in result.stderr
    assert result.returncode == 0, result.stderr


def _tree(root: int) -> dict[int, tuple[bytes, str]]:
    """The running processes under *root* (its children, theirs, ...): by pid, their start
    time (so that a pid used again is not taken for them) and command line."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (entry / "stat").read_bytes()
            parents.setdefault(int(stat[stat.rfind(b")") + 2 :].split()[1]), []).append(
                int(entry.name)
            )
    found: dict[int, tuple[bytes, str]] = {}
    todo = [root]
    while todo:
        for pid in parents.get(todo.pop(), ()):
            todo.append(pid)
            if (running := _running(pid)) is not None:
                found[pid] = running
    return found


def _running(pid: int) -> tuple[bytes, str] | None:
    # The start time and command line of *pid*, if it runs (a zombie does not).
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()
    if fields[0] == b"Z":
        return None
    return fields[19], cmdline.replace(b"\0", b" ").decode(errors="replace").strip()[:120]


#: `trioinfer serve`, with a Ray whose start ends (``ray.init`` returns) only a minute after
#: Ray's processes run, as on a loaded machine (where it took 25 s): it says when they run.
SLOW_RAY_START = """
import pathlib, sys, time
import ray
from trioinfer.cli import main

real_init = ray.init


def init(*args, **kwargs):
    started = real_init(*args, **kwargs)
    pathlib.Path(sys.argv[1]).touch()
    time.sleep(60)
    return started


ray.init = init
main(sys.argv[2:])
"""


def test_sigterm_while_a_load_starts_a_local_ray_leaves_no_ray_process(tmp_path: Path) -> None:
    """`trioinfer serve` of a ray model, stopped by SIGTERM while its load starts a local Ray
    (ray.init on a thread, which no cancel interrupts): the exit timeout ended the process
    with os._exit, which runs no atexit handler (Ray's shutdown), and Ray's two agents were
    left running for ever. The server ends every process it started before it exits."""
    repository = tmp_path / "repository"
    (repository / "digits" / "1").mkdir(parents=True)
    source = trioinfer.example_repository() / "digits" / "1" / "model.onnx"
    (repository / "digits" / "1" / "model.onnx").write_bytes(source.read_bytes())
    (repository / "digits" / "config.toml").write_text('backend = "ray"\n')
    log = tmp_path / "server.log"
    started = tmp_path / "ray-started"
    command = [sys.executable, "-c", SLOW_RAY_START, str(started), "serve", "--port", "0"]
    command += ["--no-grpc", "--host", "127.0.0.1", "--model-repository", str(repository)]
    command += ["--drain-period", "0.2", "--exit-timeout-secs", "1"]
    with tempfile.TemporaryDirectory(prefix="ray", dir="/tmp") as temp:  # short: Ray's sockets
        env = {**os.environ, "RAY_TMPDIR": temp}
        with log.open("wb") as out:
            server = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env
            )
        started_by_it: dict[int, tuple[bytes, str]] = {}

        def left() -> list[str]:
            # Those that still run (the same start time: not a pid used again since).
            return [
                name
                for pid, (start, name) in started_by_it.items()
                if (now := _running(pid)) is not None and now[0] == start
            ]

        try:
            give_up = time.monotonic() + 300
            while not started.exists():
                assert server.poll() is None, log.read_text(errors="replace")[-4000:]
                assert time.monotonic() < give_up, "Ray did not start"
                time.sleep(0.05)
            # Ray's agents run (raylet starts them, named "ray::DashboardAgent" once set up).
            while True:
                started_by_it = _tree(server.pid)
                if any("agent" in name.lower() for _, name in started_by_it.values()):
                    break
                assert time.monotonic() < give_up, started_by_it
                time.sleep(0.05)
            server.send_signal(signal.SIGTERM)
            code = server.wait(timeout=120)
            said = log.read_text(errors="replace")
            assert code == 1, said[-4000:]  # ended at the exit timeout
            give_up = time.monotonic() + 30
            while still := left():  # a killed process may take a moment to go
                assert time.monotonic() < give_up, f"left running: {still}\n{said[-4000:]}"
                time.sleep(0.1)
            assert "ended the" in said, said[-4000:]  # and said which
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
            for pid, (start, _) in started_by_it.items():
                if (now := _running(pid)) is not None and now[0] == start:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
