"""The engine owns its work: load, unload, drain, shutdown, and nothing left behind."""

from __future__ import annotations

import gc
import math
import shutil
import threading
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime
import pytest
import trio
import trio.lowlevel
import trio.testing

import trioinfer
from trioinfer import Instance, ModelConfig, open_engine
from trioinfer.lowlevel import Request, RequestQueue
from trioinfer.testing import FakeBackend

X = np.ones((1, 4), dtype=np.float32)


def fake_config(name: str = "m", **kw: object) -> ModelConfig:
    return ModelConfig(name=name, path="unused.onnx", backend="fake", **kw)  # type: ignore[arg-type]


def count_tasks() -> int:
    def walk(task: trio.lowlevel.Task) -> int:
        return 1 + sum(walk(t) for n in task.child_nurseries for t in n.child_tasks)

    return walk(trio.lowlevel.current_root_task())


def trioinfer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("trioinfer-")]


def live_sessions() -> int:
    gc.collect()
    return sum(isinstance(o, onnxruntime.InferenceSession) for o in gc.get_objects())


async def test_quickstart_on_real_onnx_model(add_model: Path) -> None:
    async with open_engine() as engine:
        info = await engine.load(
            ModelConfig(name="add", path=add_model, instances=[Instance("cpu", count=2)])
        )
        assert info.devices == ("cpu", "cpu")
        assert [s.name for s in info.signature.inputs] == ["a", "b"]
        a = np.arange(8, dtype=np.float32).reshape(2, 4)
        with trio.fail_after(5):
            out = await engine.infer("add", {"a": a, "b": a})
        np.testing.assert_array_equal(out["sum"], a + a)
        np.testing.assert_array_equal(out["diff"], a - a)
        assert [m.name for m in engine.models()] == ["add"]


async def test_nothing_outlives_the_engine(add_model: Path) -> None:
    tasks_before = count_tasks()
    assert live_sessions() == 0
    async with open_engine() as engine:
        await engine.load(ModelConfig(name="add", path=add_model, instances=[Instance(count=3)]))
        assert len(trioinfer_threads()) == 3
        assert live_sessions() == 3
        assert count_tasks() > tasks_before
        async with trio.open_nursery() as nursery:
            for _ in range(20):
                nursery.start_soon(engine.infer, "add", {"a": X, "b": X})
    assert trioinfer_threads() == []
    assert live_sessions() == 0
    assert count_tasks() == tasks_before


async def test_load_unload_while_running(add_model: Path) -> None:
    async with open_engine() as engine:
        await engine.load(ModelConfig(name="one", path=add_model))
        await engine.load(ModelConfig(name="two", path=add_model))
        assert [m.name for m in engine.models()] == ["one", "two"]
        await engine.unload("one")
        assert [m.name for m in engine.models()] == ["two"]
        with pytest.raises(trioinfer.ModelNotFound, match="loaded: 'two'"):
            await engine.infer("one", {"a": X, "b": X})
        await engine.infer("two", {"a": X, "b": X})
        with pytest.raises(trioinfer.ModelNotFound):
            await engine.unload("one")
        assert len(trioinfer_threads()) == 1


async def test_loading_a_name_twice_is_refused(add_model: Path) -> None:
    async with open_engine() as engine:
        await engine.load(ModelConfig(name="add", path=add_model))
        with pytest.raises(trioinfer.ConfigError, match="loaded already"):
            await engine.load(ModelConfig(name="add", path=add_model))


@pytest.mark.parametrize(
    ("config", "replace", "said"),
    [
        (None, False, "a ModelConfig, got None"),
        ({"name": "m"}, False, r"ModelConfig.from_dict\(\)"),
        (fake_config(), "yes", "replace must be True or False, got 'yes'"),
    ],
)
async def test_load_refuses_what_is_not_a_config_with_a_config_error(
    config: Any, replace: Any, said: str
) -> None:
    # A dict (a TOML file's table) or None ended in AttributeError, a 500 in a
    # caller's server; replace="no" replaced the model.
    backend = FakeBackend()
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(fake_config())
        with pytest.raises(trioinfer.ConfigError, match=said):
            await engine.load(config, replace=replace)
        assert len(backend.loaded) == 1


async def test_replace_swaps_models_without_dropping_requests(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FakeBackend(delay=1.0)
    async with open_engine(registry=backend.registry(), drain_period=60) as engine:
        await engine.load(fake_config())
        old = backend.loaded[0]
        results: list[np.ndarray] = []

        async def call() -> None:
            results.append((await engine.infer("m", {"x": X}))["y"])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call)  # accepted by the old model, still running
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(trioinfer.ConfigError, match="replace=True"):
                await engine.load(fake_config())
            await engine.load(fake_config(), replace=True)
            new = backend.loaded[1]
            nursery.start_soon(call)  # goes to the new model
        assert len(results) == 2
        assert (old.executions, new.executions) == (1, 1)
        assert old.closed
        assert not new.closed
        assert [m.name for m in engine.models()] == ["m"]


async def test_failed_replace_keeps_the_old_model_serving(tmp_path: Path, add_model: Path) -> None:
    async with open_engine() as engine:
        await engine.load(ModelConfig(name="add", path=add_model))
        with pytest.raises(trioinfer.BackendError):
            await engine.load(ModelConfig(name="add", path=tmp_path / "gone.onnx"), replace=True)
        out = await engine.infer("add", {"a": X, "b": X})
        np.testing.assert_array_equal(out["sum"], X + X)


async def test_statistics_histograms(autojump_clock: trio.testing.MockClock) -> None:
    backend = FakeBackend(delay=0.002)
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(
            fake_config(
                batcher="dynamic", batcher_options={"max_batch_size": 4, "max_queue_delay": 0.001}
            )
        )
        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(engine.infer, "m", {"x": np.ones((2, 4), np.float32)})
        stats = engine.statistics().models["m"]
    assert stats.batch_size.count == stats.executions == 2
    assert stats.batch_size.sum == 8
    assert stats.batch_size.counts[stats.batch_size.bounds.index(4)] == 2
    assert stats.queue_duration.count == stats.compute_duration.count == 4
    assert stats.request_duration.count == 4
    assert stats.compute_duration.sum == pytest.approx(4 * 0.002)
    # Each request waited for its batch, then ran: its latency is its wait plus the execution.
    assert stats.request_duration.sum == pytest.approx(
        stats.queue_duration.sum + stats.compute_duration.sum
    )
    assert sum(stats.queue_duration.counts) == 4


async def test_missing_model_file_is_a_backend_error(tmp_path: Path) -> None:
    async with open_engine() as engine:
        with pytest.raises(trioinfer.BackendError, match="no model file"):
            await engine.load(ModelConfig(name="m", path=tmp_path / "nope.onnx"))
        assert engine.models() == []
    assert trioinfer_threads() == []


async def test_a_model_directory_as_the_path_names_the_file_meant(
    add_model: Path, tmp_path: Path
) -> None:
    # path = the model's directory of a repository, not its version's file: "no model file
    # at <a directory that exists>" left the user to guess what was wrong with it.
    (tmp_path / "m" / "1").mkdir(parents=True)
    shutil.copyfile(add_model, tmp_path / "m" / "1" / "model.onnx")
    async with open_engine() as engine:
        with pytest.raises(trioinfer.BackendError) as caught:
            await engine.load(ModelConfig(name="m", path=tmp_path / "m"))
    message = str(caught.value)
    assert f"{tmp_path / 'm'} is a directory" in message
    assert f"e.g. {tmp_path / 'm' / '1' / 'model.onnx'}" in message
    # A directory with no model file in it: what the path must name, without an example.
    (tmp_path / "empty").mkdir()
    async with open_engine() as engine:
        with pytest.raises(trioinfer.BackendError) as caught:
            await engine.load(ModelConfig(name="m", path=tmp_path / "empty"))
    assert "is a directory; path names the model's .onnx file" in str(caught.value)
    # A child named by a digit that is no decimal one ("²".isdigit(), but int() refuses
    # it): the same message, not a ValueError from looking for an example.
    (tmp_path / "odd" / "\u00b2").mkdir(parents=True)
    (tmp_path / "odd" / "\u00b2" / "model.onnx").touch()
    async with open_engine() as engine:
        with pytest.raises(trioinfer.BackendError) as caught:
            await engine.load(ModelConfig(name="m", path=tmp_path / "odd"))
    assert "is a directory; path names the model's .onnx file" in str(caught.value)


async def test_failed_instance_closes_the_loaded_ones(add_model: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not an onnx model")
    async with open_engine() as engine:
        with pytest.raises(trioinfer.BackendError, match="could not load"):
            await engine.load(ModelConfig(name="m", path=bad, instances=[Instance(count=2)]))
    assert trioinfer_threads() == []
    assert live_sessions() == 0


async def test_exit_drains_in_flight_work(autojump_clock: trio.testing.MockClock) -> None:
    backend = FakeBackend(delay=1.0)
    results: list[object] = []

    async def call(engine: trioinfer.Engine) -> None:
        results.append(await engine.infer("m", {"x": X}))

    async with trio.open_nursery() as nursery:
        async with open_engine(registry=backend.registry(), drain_period=5.0) as engine:
            await engine.load(fake_config())
            for _ in range(3):
                nursery.start_soon(call, engine)
            await trio.sleep(0.5)
            t0 = trio.current_time()
        # Three 1 s executions on one instance: 0.5 s was spent before the exit.
        assert trio.current_time() - t0 == 2.5
    assert len(results) == 3
    assert backend.open_instances == 0


async def test_exit_cancels_what_the_drain_period_leaves(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FakeBackend(delay=1.0)
    outcomes: list[str] = []

    async def call(engine: trioinfer.Engine) -> None:
        try:
            await engine.infer("m", {"x": X})
            outcomes.append("ok")
        except trioinfer.EngineClosed:
            outcomes.append("closed")

    async with trio.open_nursery() as nursery:
        async with open_engine(registry=backend.registry(), drain_period=1.5) as engine:
            await engine.load(fake_config())
            for _ in range(4):
                nursery.start_soon(call, engine)
            await trio.testing.wait_all_tasks_blocked()
            t0 = trio.current_time()
        assert trio.current_time() - t0 == 1.5
        with pytest.raises(trioinfer.EngineClosed, match="has closed"):
            await engine.infer("m", {"x": X})
        with pytest.raises(trioinfer.EngineClosed):
            await engine.load(fake_config("other"))
        with pytest.raises(trioinfer.EngineClosed, match="has closed"):
            await engine.unload("m")  # not ModelNotFound: "loaded: none" said too little
    # One finished in the drain period; the one running and the two queued ended closed.
    assert sorted(outcomes) == ["closed", "closed", "closed", "ok"]
    assert backend.executions == [1, 1]
    assert backend.open_instances == 0


async def test_exit_with_an_exception_skips_the_drain(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FakeBackend(delay=10.0)
    outcomes: list[str] = []
    t0 = trio.current_time()

    async def call(engine: trioinfer.Engine) -> None:
        try:
            await engine.infer("m", {"x": X})
        except trioinfer.EngineClosed:
            outcomes.append("closed")

    async def fail_inside_the_engine(nursery: trio.Nursery) -> None:
        async with open_engine(registry=backend.registry(), drain_period=100) as engine:
            await engine.load(fake_config())
            nursery.start_soon(call, engine)
            await trio.sleep(1)
            raise KeyError(engine)

    async with trio.open_nursery() as nursery:
        with pytest.raises(KeyError) as info:
            await fail_inside_the_engine(nursery)
        # The 10 s execution in flight was not waited for.
        assert trio.current_time() == t0 + 1
    assert info.value.args[0].closing
    assert outcomes == ["closed"]


async def test_a_group_from_the_callers_own_nursery_leaves_the_block_as_raised(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The engine's task group, cancelled on the way out, re-raises a copy of a group
    # (trio splits Cancelled out of it): the block must still hand back the caller's
    # group as it was, not that copy wrapped in a second group.
    backend = FakeBackend(delay=10.0)
    with pytest.RaisesGroup(KeyError) as info:  # exactly one level: the caller's nursery's
        async with open_engine(registry=backend.registry()) as engine:
            await engine.load(fake_config())
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(engine.infer, "m", {"x": X}))
                await trio.sleep(1)
                raise KeyError("mine")
    assert info.value.exceptions[0].args == ("mine",)
    assert backend.open_instances == 0

    assert backend.open_instances == 0


async def test_the_callers_exception_leaves_the_block_alone_when_an_outer_scope_cancels(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The engine's tasks run inside the caller's scopes: one cancelled around the
    # block sends them a Cancelled of its own, which their task group gathered with the
    # caller's exception. That Cancelled is the outer scope's to catch; the caller's own
    # exception must still leave the block as it was raised.
    backend = FakeBackend(delay=10.0)
    with pytest.RaisesGroup(KeyError):  # exactly one level: the caller's nursery's
        async with (
            trio.open_nursery() as nursery,
            open_engine(registry=backend.registry()) as engine,
        ):
            await engine.load(fake_config())
            await engine.load(fake_config("other"))
            nursery.cancel_scope.cancel()
            raise KeyError("mine")
    assert backend.open_instances == 0


async def test_leaving_the_block_ends_a_load_in_another_task_first(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A load runs in its caller's task; the engine's block must not end while it goes
    # on, holding instances (and their threads) that nothing would close.
    class SlowSecondLoad(FakeBackend):
        async def load(self, config: ModelConfig, placement: Any) -> Any:
            if placement.index == 1:
                await trio.sleep_forever()  # until cancelled
            return await super().load(config, placement)

    backend = SlowSecondLoad()
    outcomes: list[str] = []

    async def load(engine: trioinfer.Engine) -> None:
        try:
            await engine.load(fake_config(instances=[Instance("cpu", count=2)]))
        except trioinfer.EngineClosed as exc:
            outcomes.append(str(exc))

    async with trio.open_nursery() as nursery:
        async with open_engine(registry=backend.registry()) as engine:
            nursery.start_soon(load, engine)
            await trio.testing.wait_all_tasks_blocked()
            assert backend.open_instances == 1
            t0 = trio.current_time()
        # Cancelled at once, it closed what it had loaded before the block ended.
        assert outcomes == ["the engine closed while model 'm' was loading"]
        assert backend.open_instances == 0
        assert trio.current_time() == t0


async def test_a_model_being_unloaded_drains_with_the_engine(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # An unload in another task when the block ends: its accepted request may finish in
    # the engine's drain period, and the unload ends before the block does.
    backend = FakeBackend(delay=3.0)
    outcomes: list[str] = []

    async def call(engine: trioinfer.Engine) -> None:
        await engine.infer("m", {"x": X})
        outcomes.append("answered")

    async def unload(engine: trioinfer.Engine) -> None:
        await engine.unload("m")
        outcomes.append("unloaded")

    async with trio.open_nursery() as nursery:
        async with open_engine(registry=backend.registry(), drain_period=5) as engine:
            await engine.load(fake_config())
            nursery.start_soon(call, engine)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(unload, engine)
            await trio.testing.wait_all_tasks_blocked()
            t0 = trio.current_time()
        outcomes.append("exited")
        assert trio.current_time() == t0 + 3
    assert outcomes == ["answered", "unloaded", "exited"]
    assert backend.open_instances == 0


async def test_backend_failure_fails_only_its_requests() -> None:
    backend = FakeBackend()
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(fake_config())
        backend.error = RuntimeError("device on fire")
        with pytest.raises(trioinfer.BackendError, match="device on fire") as info:
            await engine.infer("m", {"x": X})
        assert isinstance(info.value.__cause__, RuntimeError)
        backend.error = None
        out = await engine.infer("m", {"x": X})
        np.testing.assert_array_equal(out["y"], 2 * X)
        stats = engine.statistics().models["m"]
        assert (stats.succeeded, stats.failed, stats.executions) == (1, 1, 2)


async def test_a_broken_batcher_fails_its_callers_not_the_engine() -> None:
    class BrokenBatcher:
        async def next_batch(self, queue: RequestQueue) -> list[Request]:
            await queue.wait_not_empty()
            return []  # breaks the contract: a batch has at least one request

    registry = trioinfer.Registry(
        extra={"backends": {"fake": FakeBackend}, "batchers": {"broken": BrokenBatcher}}
    )
    async with open_engine(registry=registry) as engine:
        await engine.load(fake_config(batcher="broken"))
        await engine.load(fake_config(name="other"))
        # The caller is not left hanging: its request ends with a typed error naming the
        # plugin, and the engine (with its other models) goes on.
        with pytest.raises(trioinfer.PluginContractError, match=r"batcher .broken.*empty batch"):
            await engine.infer("m", {"x": X})
        out = await engine.infer("other", {"x": X})
        np.testing.assert_array_equal(out["y"], 2 * X)


async def test_statistics_snapshot_is_frozen() -> None:
    backend = FakeBackend()
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(fake_config())
        snapshot = engine.statistics()
        await engine.infer("m", {"x": X})
        assert snapshot.models["m"].succeeded == 0
        assert engine.statistics().models["m"].succeeded == 1


async def test_drain_period_must_be_a_non_negative_number() -> None:
    with pytest.raises(trioinfer.ConfigError, match="drain_period"):
        async with open_engine(drain_period=-1):
            pass  # pragma: no cover


def test_open_engine_used_without_async_with_says_what_to_write() -> None:
    manager: Any = open_engine()
    with pytest.raises(TypeError, match="async with open_engine"), manager:
        pass  # pragma: no cover
    with pytest.raises(AttributeError, match=r"no 'infer'.*async with open_engine"):
        manager.infer("m", {"x": X})


async def test_unload_drains_then_stops_even_if_its_caller_is_cancelled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FakeBackend(delay=5.0)
    async with open_engine(registry=backend.registry(), drain_period=60) as engine:
        await engine.load(fake_config())
        errors: list[Exception] = []

        async def call() -> None:
            try:
                await engine.infer("m", {"x": X})
            except trioinfer.EngineClosed as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call)
            await trio.testing.wait_all_tasks_blocked()
            t0 = trio.current_time()
            with trio.move_on_after(1):
                await engine.unload("m")
            assert trio.current_time() - t0 == 1
        assert backend.open_instances == 0
        assert engine.models() == []
        assert len(errors) == 1
        assert "unloaded" in str(errors[0])


async def test_free_instance_with_most_capacity_takes_the_work(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FakeBackend(delay=1.0)
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(
            fake_config(instances=[Instance("cpu", count=2), Instance("cuda:0", capacity=8)])
        )
        cpu_a, cpu_b, gpu = sorted(backend.loaded, key=lambda instance: instance.device)
        assert (cpu_a.device, gpu.device) == ("cpu", "cuda:0")
        for _ in range(5):  # one at a time: the GPU is always free, so it takes each
            await engine.infer("m", {"x": X})
        assert (cpu_a.executions, cpu_b.executions, gpu.executions) == (0, 0, 5)
        async with trio.open_nursery() as nursery:  # three at once: everyone works
            for _ in range(3):
                nursery.start_soon(engine.infer, "m", {"x": X})
        assert (cpu_a.executions, cpu_b.executions, gpu.executions) == (1, 1, 6)


async def test_device_limits_cap_executions_across_models(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FakeBackend(delay=1.0)
    async with open_engine(registry=backend.registry(), device_limits={"cpu": 1}) as engine:
        await engine.load(fake_config("a", instances=[Instance(count=2)]))
        await engine.load(fake_config("b"))
        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            for model in ("a", "a", "b"):
                nursery.start_soon(engine.infer, model, {"x": X})
        # Three 1 s executions, one CPU execution at a time.
        assert trio.current_time() - t0 == 3.0
    with pytest.raises(trioinfer.ConfigError, match="positive integer"):
        async with open_engine(device_limits={"cpu": 0}):
            pass  # pragma: no cover
    with pytest.raises(trioinfer.ConfigError, match="device"):
        async with open_engine(device_limits={"gpu": 1}):
            pass  # pragma: no cover


async def test_one_waiter_event_behaves_like_trio_event() -> None:
    """The per-request wake-up: set wakes the waiter; a cancelled wait leaves it unset."""
    from trioinfer._threads import native_waiter_factory

    new = native_waiter_factory()
    event = new()
    with trio.move_on_after(0.01) as scope:
        await event.wait()
    assert scope.cancelled_caught  # not set: the wait was cancelled, nothing changed
    woke: list[float] = []

    async def waiter() -> None:
        await event.wait()
        woke.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        assert woke == []
        event.set()
        event.set()  # a second set is harmless
    assert len(woke) == 1
    with trio.testing.assert_checkpoints():
        await event.wait()  # already set: returns at once, at a checkpoint


async def test_fast_effective_deadline_agrees_with_trio() -> None:
    """The request path's deadline read says what Trio's own function says, scope by scope."""
    from trioinfer._threads import LoopClock, _trio_effective_deadline

    assert LoopClock().current_effective_deadline is _trio_effective_deadline
    now = trio.current_time()

    async def same() -> None:
        assert _trio_effective_deadline() == trio.current_effective_deadline()
        # A checkpoint that raises nothing, so that each scope below is awaited in.
        await trio.lowlevel.cancel_shielded_checkpoint()

    await same()  # no deadline anywhere: inf
    with trio.CancelScope(deadline=now + 5):
        await same()
        with trio.CancelScope(deadline=now + 9):
            await same()  # the outer, earlier deadline wins
            with trio.CancelScope(deadline=now + 2) as inner:
                await same()  # the inner, earlier one wins
                inner.deadline = now + 20
                await same()  # moved later: the outer's again
        with trio.CancelScope(shield=True, deadline=now + 7):
            await same()  # a shield hides the outer deadline
            with trio.CancelScope(deadline=now + 8):
                await same()
        with trio.fail_after(3):  # a relative deadline, made absolute on entry
            await same()
        with trio.CancelScope() as cancelled:
            cancelled.cancel()
            await same()  # a cancellation in effect: -inf
            with trio.CancelScope(deadline=now + 1):
                await same()  # inside it, too
            with trio.CancelScope(shield=True, deadline=now + 4):
                await same()  # but not behind a shield
    async with trio.open_nursery() as nursery:
        nursery.cancel_scope.deadline = now + 6

        async def child() -> None:
            await same()  # a task inherits its nursery's scopes
            with trio.CancelScope(deadline=now + 1):
                await same()

        nursery.start_soon(child)


async def test_a_deadline_reader_that_disagrees_with_trio_is_not_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Trio whose cancel scopes changed meaning gets Trio's own reader, not a wrong fast one."""
    from trioinfer import _threads

    def ignores_shields() -> float:
        # What the fast reader would read if Trio's ``_shield`` stopped meaning a shield.
        status = _threads._trio_run.GLOBAL_RUN_CONTEXT.task._cancel_status
        deadline = math.inf
        while status is not None:
            deadline = min(deadline, status._scope._deadline)
            status = status._parent
        return -math.inf if trio.current_effective_deadline() == -math.inf else deadline

    monkeypatch.setattr(_threads, "_trio_effective_deadline", ignores_shields)
    assert _threads.LoopClock().current_effective_deadline is trio.current_effective_deadline
    monkeypatch.setattr(_threads, "_trio_run", None)  # a Trio that moved the module
    assert _threads.LoopClock().current_effective_deadline is trio.current_effective_deadline


def test_split_gives_each_request_views_of_its_own_rows() -> None:
    """The batch's outputs cut by rows: every output, one output, or none at all."""
    from trioinfer._request import make_request
    from trioinfer._runner import _split

    requests = [
        make_request("m", {}, str(i), 0, None, 1.0, 0.0, n) for i, n in enumerate((1, 3, 2))
    ]
    outputs = {"a": np.arange(6), "b": np.arange(12).reshape(6, 2)}
    shares = _split(requests, 6, outputs)
    assert [s["a"].tolist() for s in shares] == [[0], [1, 2, 3], [4, 5]]
    assert [s["b"].shape for s in shares] == [(1, 2), (3, 2), (2, 2)]
    assert all(np.shares_memory(s["b"], outputs["b"]) for s in shares)  # views, not copies
    assert [s["a"].tolist() for s in _split(requests, 6, {"a": outputs["a"]})] == [
        [0], [1, 2, 3], [4, 5]
    ]  # fmt: skip
    assert _split(requests, 6, {}) == [{}, {}, {}]
    # One row each: the rows as numpy iterates them, the same views.
    ones = [make_request("m", {}, str(i), 0, None, 1.0, 0.0, 1) for i in range(6)]
    three = {**outputs, "c": np.arange(18).reshape(6, 3, 1)}
    for batch in ({"a": outputs["a"]}, outputs, three):
        shares = _split(ones, 6, batch)
        assert len(shares) == 6
        for i, share in enumerate(shares):
            assert share.keys() == batch.keys()
            for name, array in batch.items():
                assert share[name].shape == (1, *array.shape[1:])
                assert share[name].tolist() == array[i : i + 1].tolist()
                assert np.shares_memory(share[name], array)
    assert _split(ones, 6, {}) == [{}] * 6


async def test_a_backend_sees_its_batch_deadline(autojump_clock: trio.testing.MockClock) -> None:
    """lowlevel.current_batch_deadline(): the latest deadline among the rows being computed."""
    from trioinfer.lowlevel import current_batch_deadline

    seen: list[float] = []

    class Recorder:
        signature = trioinfer.ModelSignature(
            (trioinfer.TensorSpec("x", np.dtype(np.float32), ("batch", 1), "tensor(float)"),),
            (trioinfer.TensorSpec("y", np.dtype(np.float32), ("batch", 1), "tensor(float)"),),
        )
        device = "cpu"

        async def execute(self, inputs: Any) -> dict[str, Any]:
            seen.append(current_batch_deadline())
            await trio.sleep(0.1)
            return {"y": inputs["x"]}

        async def aclose(self) -> None:
            pass

    class Backend:
        async def load(self, config: Any, placement: Any) -> Recorder:
            return Recorder()

    registry = trioinfer.Registry(extra={"backends": {"b": Backend}})
    config = trioinfer.ModelConfig(
        name="m",
        path="none",
        backend="b",
        batcher="dynamic",
        batcher_options={"max_batch_size": 4, "max_queue_delay": 0.01},
    )
    x = np.zeros((1, 1), np.float32)
    assert current_batch_deadline() == math.inf  # outside an execution
    async with trioinfer.open_engine(registry=registry) as engine:
        await engine.load(config)
        start = trio.current_time()

        async def call(budget: float) -> None:
            with trio.fail_after(budget):
                await engine.infer("m", {"x": x})

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call, 5.0)
            nursery.start_soon(call, 7.0)
        await engine.infer("m", {"x": x})  # no deadline
    assert seen == [start + 7.0, math.inf]


async def test_a_backend_sees_its_callers_own_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """lowlevel.current_callers_deadline(): a queue_timeouts deadline counts as none (its
    caller waits for the run), where current_batch_deadline() counts it."""
    from trioinfer.lowlevel import current_batch_deadline, current_callers_deadline

    seen: list[tuple[float, float]] = []

    def infer(inputs: Any) -> dict[str, Any]:
        seen.append((current_batch_deadline(), current_callers_deadline()))
        return {"y": inputs["x"]}

    backend = trioinfer.testing.FakeBackend(infer)
    registry = trioinfer.Registry(extra={"backends": {"b": lambda: backend}})
    config = trioinfer.ModelConfig(name="m", path="none", backend="b", queue_timeouts={0: 2.0})
    x = np.zeros((1, 4), np.float32)
    assert current_callers_deadline() == math.inf  # outside an execution
    async with trioinfer.open_engine(registry=registry) as engine:
        await engine.load(config)
        start = trio.current_time()
        with trio.fail_after(5.0):
            await engine.infer("m", {"x": x})
        await engine.infer("m", {"x": x})  # its deadline is the queue timeout's
    assert seen == [(start + 5.0, start + 5.0), (start + 2.0, math.inf)]


@pytest.mark.parametrize(
    "scenario", ["queue full", "deadlines", "same instant", "cancelled", "unload", "replace"]
)
async def test_infer_and_infer_detailed_end_requests_alike(
    scenario: str, autojump_clock: trio.testing.MockClock
) -> None:
    """``infer`` takes a plain model's request in its own frame, ``infer_detailed`` through
    ``_submit`` and ``ModelRunner.call``, and an unbatched pipeline's step (``_infer_held``)
    in a copy of ``infer``'s frame: the three ways must end requests and count them alike."""

    async def held_step(engine: trioinfer.Engine, model: str, inputs: Any) -> object:
        return await engine._infer_held(
            model,
            inputs,
            priority=0,
            tenant=None,
            request_id=str(trioinfer._request.next_request_id()),
            held={},
            scopes=set(),
        )

    async def run(fast: bool | None) -> tuple[list[tuple[str, str]], dict[str, int] | None]:
        backend = FakeBackend(delay=1.0)
        ended: list[tuple[str, str]] = []
        async with open_engine(registry=backend.registry()) as engine:
            # Trio may start a nursery's tasks in either order: only "queue full" fills it.
            size = 2 if scenario == "queue full" else 8
            await engine.load(fake_config(max_queue_size=size))
            if fast is None:
                call: Any = partial(held_step, engine)
            else:
                call = engine.infer if fast else engine.infer_detailed

            async def one(tag: str, budget: float = math.inf, cancelled: bool = False) -> None:
                with trio.move_on_after(budget) as scope:
                    if cancelled:
                        scope.cancel()
                    try:
                        await call("m", {"x": X})
                    except trioinfer.TrioInferError as exc:
                        ended.append((tag, type(exc).__name__))
                        return
                ended.append((tag, "cancelled" if scope.cancelled_caught else "ok"))

            async with trio.open_nursery() as nursery:
                if scenario == "queue full":
                    for _ in range(5):
                        nursery.start_soon(one, "q")
                elif scenario == "deadlines":
                    # One at a time: Trio may run tasks started together in either order.
                    for tag, budget in (("a", math.inf), ("b", 0.5), ("c", 1.5)):
                        nursery.start_soon(one, tag, budget)
                        await trio.testing.wait_all_tasks_blocked()
                elif scenario == "same instant":
                    # Each caller's deadline falls when its execution ends: the answer
                    # (on Trio's fast path, the parked task rescheduled) and the
                    # cancellation meet in one instant.
                    for tag, budget in (("a", 1.0), ("b", 2.0), ("c", 2.0)):
                        nursery.start_soon(one, tag, budget)
                        await trio.testing.wait_all_tasks_blocked()
                elif scenario == "cancelled":
                    nursery.start_soon(one, "a")
                    await trio.testing.wait_all_tasks_blocked()
                    nursery.start_soon(partial(one, "before", cancelled=True))
                    nursery.start_soon(one, "queued", 0.25)
                else:
                    for tag in ("a", "b"):
                        nursery.start_soon(one, tag)
                        await trio.testing.wait_all_tasks_blocked()
                    if scenario == "unload":
                        await engine.unload("m")
                    else:
                        await engine.load(fake_config(max_queue_size=size), replace=True)
                    nursery.start_soon(one, "after")
            stats = engine.statistics().models.get("m")
            counted = None
            if stats is not None:
                counted = {
                    name: getattr(stats, name)
                    for name in ("in_flight", "succeeded", "failed", "cancelled", "refused")
                }
                counted |= {"expired": stats.expired, "executions": stats.executions}
        return sorted(ended), counted

    if scenario != "same instant":
        fast = await run(fast=True)
        assert fast == await run(fast=False)
        assert fast == await run(fast=None)
        return
    # Which comes first in one instant, the answer or the cancellation, is Trio's
    # (random) choice: each way must end every caller once and count every request
    # once. (A request answered as its caller's cancellation is delivered counts
    # as succeeded, though its caller sees the cancellation.)
    for way in (True, False, None):
        ended, counted = await run(way)
        assert counted is not None
        assert sorted(tag for tag, _ in ended) == ["a", "b", "c"]
        assert counted["in_flight"] == 0
        assert counted["succeeded"] + counted["cancelled"] + counted["expired"] == 3
        assert [outcome for _, outcome in ended].count("ok") <= counted["succeeded"]


class _StubbornInstance:
    # Computes y = 2x after *delay* seconds, shielded: like a run on a thread
    # that nothing can stop, it ends even after its callers have left.
    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.signature = FakeBackend().signature
        self.device = "cpu"

    async def execute(self, inputs: Any) -> dict[str, np.ndarray[Any, Any]]:
        with trio.CancelScope(shield=True):
            await trio.sleep(self.delay)
        return {"y": 2 * inputs["x"]}

    async def aclose(self) -> None:
        pass


@pytest.mark.parametrize("batched", [False, True], ids=["one request", "a batch of two"])
async def test_a_caller_gone_before_its_run_ends_is_not_answered(
    autojump_clock: trio.testing.MockClock, batched: bool
) -> None:
    """A run that outlives its caller answers only those still waiting, and counts them once."""

    class Stubborn:
        async def load(self, config: ModelConfig, placement: object) -> _StubbornInstance:
            return _StubbornInstance(0.01)

    registry = trioinfer.Registry(extra={"backends": {"stubborn": Stubborn}})
    batching: dict[str, Any] = (
        {"batcher": "dynamic", "batcher_options": {"max_batch_size": 2, "max_queue_delay": 0.001}}
        if batched
        else {}
    )
    async with open_engine(registry=registry) as engine:
        await engine.load(ModelConfig(name="m", path="unused", backend="stubborn", **batching))
        answered: list[np.ndarray[Any, Any]] = []

        async def stays() -> None:
            answered.append((await engine.infer("m", {"x": X}))["y"])

        async with trio.open_nursery() as nursery:
            if batched:
                nursery.start_soon(stays)
            with trio.move_on_after(0.005):  # leaves while the run is under way
                await engine.infer("m", {"x": X})
        await trio.sleep(0.02)  # the run has ended
        await stays()  # one more, answered alone
        stats = engine.statistics().models["m"]
    assert stats.executions == 2
    assert stats.cancelled == 1
    assert stats.succeeded == stats.request_duration.count == (2 if batched else 1)
    assert len(answered) == stats.succeeded


@pytest.mark.parametrize(
    "values",
    [[], [0.003], [0.003, 0.0031, 0.0049], [1e-5, 0.003, 0.02, 99.0], [0.005, 0.005, 0.0050001]],
)
def test_a_batch_of_observations_counts_as_one_at_a_time(values: list[float]) -> None:
    """_Histogram.observe_each (a batch's latencies at once) counts as observe() each would."""
    from trioinfer._runner import DURATION_BUCKETS, _Histogram

    batch, each = _Histogram(DURATION_BUCKETS), _Histogram(DURATION_BUCKETS)
    batch.observe_each(values)
    for value in values:
        each.observe(value)
    assert batch.snapshot() == each.snapshot()


async def test_a_follow_up_past_its_deadline_names_the_calling_model_cleanly(
    autojump_clock: trio.testing.MockClock,
) -> None:
    from trioinfer.lowlevel import infer_follow_up, infer_stream_follow_up

    backend = FakeBackend(delay=10.0)
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(fake_config())
        deadline = trio.current_time() + 1.0
        with pytest.raises(trioinfer.DeadlineExceeded) as call:
            await infer_follow_up(engine, "m", {"x": X}, caller="bls", deadline=deadline)

        async def read_stream() -> None:
            deadline = trio.current_time() + 1.0
            async with infer_stream_follow_up(
                engine, "m", {"x": X}, caller="bls", deadline=deadline
            ) as responses:
                async for _ in responses:
                    pass

        with pytest.raises(trioinfer.DeadlineExceeded) as stream:
            await read_stream()
    # Each name in quotes once: no "model 'bls''s call" (a quote doubled by the possessive).
    assert str(call.value).startswith("a call by model 'bls' to model 'm' did not end"), call
    assert str(stream.value).startswith(
        "a stream from model 'm' opened by model 'bls' did not end"
    ), stream
