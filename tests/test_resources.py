"""The rate limiter: named resource pools that instances take before each execution."""

from __future__ import annotations

import anyio
import attrs
import numpy as np
import pytest
import trio
import trio.testing

import trioinfer
from trioinfer import Device, Instance, ModelConfig, open_engine
from trioinfer._runner import ModelRunner
from trioinfer.abc import BackendInstance, Placement
from trioinfer.testing import FakeBackend

X = np.ones((1, 4), dtype=np.float32)


def config(name: str, *instances: Instance) -> ModelConfig:
    return ModelConfig(
        name=name, path="unused.onnx", backend="fake", batcher="none", instances=list(instances)
    )


async def most_running(backend: FakeBackend, task_status: trio.TaskStatus[list[int]]) -> None:
    # The most executions running at once, sampled at every virtual tick.
    seen = [0]
    task_status.started(seen)
    while True:
        await trio.sleep(0.125)
        seen[0] = max(seen[0], sum(i.running for i in backend.loaded))


async def burst(engine: trioinfer.Engine, *models: str) -> None:
    async with trio.open_nursery() as nursery:
        for model in models:
            nursery.start_soon(engine.infer, model, {"x": X})


async def test_two_models_sharing_a_pool_never_exceed_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Four instances of two models, one of R each, a pool of 2: two run at a time."""
    backend = FakeBackend(delay=1.0)
    async with open_engine(registry=backend.registry(), resources={"R": 2}) as engine:
        await engine.load(config("a", Instance(count=2, global_resources={"R": 1})))
        await engine.load(config("b", Instance(count=2, global_resources={"R": 1})))
        async with trio.open_nursery() as nursery:
            seen = await nursery.start(most_running, backend)
            t0 = trio.current_time()
            await burst(engine, *["a", "b"] * 4)
            assert trio.current_time() - t0 == 4.0  # 8 one-second executions, 2 at a time
            assert seen == [2]
            nursery.cancel_scope.cancel()
        (pool,) = engine.statistics().resources
        assert (pool.name, pool.device, pool.size, pool.in_use, pool.waiting) == (
            "R",
            None,
            2,
            0,
            0,
        )
        assert pool.waits > 0
        assert pool.wait_s > 0


async def test_pool_defaults_to_the_largest_need(autojump_clock: trio.testing.MockClock) -> None:
    """No size given: the pool holds the most any instance needs, as Triton sizes it."""
    backend = FakeBackend(delay=1.0)
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(config("a", Instance(count=2, resources={"R": 3})))
        await engine.load(config("b", Instance(resources={"R": 1})))
        (pool,) = engine.statistics().resources
        assert (pool.device, pool.size) == ("cpu", 3)
        t0 = trio.current_time()
        await burst(engine, "a", "a")
        assert trio.current_time() - t0 == 2.0  # 3 + 3 > 3: one after the other
        t0 = trio.current_time()
        await burst(engine, "b", "b")  # one instance of b: its slot serializes it anyway
        assert trio.current_time() - t0 == 2.0
        await engine.unload("a")
        (pool,) = engine.statistics().resources
        assert pool.size == 1  # a's needs no longer size it


async def test_an_instance_whose_needs_are_not_free_waits(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Pool of 3: a takes 2, so b (needs 2) waits until a ends, though 1 is free."""
    backend = FakeBackend(delay=1.0)
    async with open_engine(registry=backend.registry(), resources={"R": 3}) as engine:
        await engine.load(config("a", Instance(resources={"R": 2})))
        await engine.load(config("b", Instance(resources={"R": 2})))
        await engine.load(config("c", Instance(resources={"R": 1})))
        ends: dict[str, float] = {}

        async def run(model: str) -> None:
            await engine.infer(model, {"x": X})
            ends[model] = trio.current_time()

        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            for model in ("a", "b", "c"):
                nursery.start_soon(run, model)
                await trio.testing.wait_all_tasks_blocked()
        # c fits beside a (2 + 1 = 3); b waited for a; c, arriving after b, waited
        # behind it: the head waiter is served first.
        assert {m: t - t0 for m, t in ends.items()} == {"a": 1.0, "b": 2.0, "c": 2.0}


async def test_per_device_resources_have_a_pool_per_device(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FakeBackend(delay=1.0)
    async with open_engine(registry=backend.registry(), resources={"R": 1}) as engine:
        await engine.load(config("a", Instance(device="cpu", resources={"R": 1})))
        await engine.load(config("b", Instance(device="cuda:0", resources={"R": 1})))
        t0 = trio.current_time()
        await burst(engine, "a", "b")
        assert trio.current_time() - t0 == 1.0  # one pool on each device
        assert [(p.device, p.size) for p in engine.statistics().resources] == [
            ("cpu", 1),
            ("cuda:0", 1),
        ]


@attrs.define
class FallingBack:
    """A backend whose instances of model "a" are re-created on the CPU once *lost* is set.

    As a CUDA instance whose GPU is lost comes back on the CPU (``cpu_fallback``).
    """

    fake: FakeBackend
    lost: bool = False

    async def load(self, config: ModelConfig, placement: Placement) -> BackendInstance:
        if self.lost and config.name == "a":
            placement = attrs.evolve(placement, device=Device.parse("cpu"))
        return await self.fake.load(config, placement)


async def test_a_recreated_instance_takes_from_the_pools_of_its_new_device(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """a's instance, re-created on the CPU, contends with b there for the CPU's pool of R."""
    backend = FallingBack(FakeBackend(delay=1.0))
    registry = trioinfer.Registry(extra={"backends": {"fake": lambda: backend}})
    async with open_engine(registry=registry) as engine:
        await engine.load(config("a", Instance(device="cuda:0", resources={"R": 1})))
        await engine.load(config("b", Instance(device="cpu", resources={"R": 1})))
        t0 = trio.current_time()
        await burst(engine, "a", "b")
        assert trio.current_time() - t0 == 1.0  # a pool on each device
        backend.lost = True
        runner = engine._runner("a")
        assert isinstance(runner, ModelRunner)
        (replica,) = runner.replicas
        await runner.recreate(replica)
        assert replica.device == "cpu"
        t0 = trio.current_time()
        await burst(engine, "a", "b")
        assert trio.current_time() - t0 == 2.0  # one R on the CPU: one after the other
        # The CUDA pool, which no instance takes from any more, is not listed.
        (cpu,) = engine.statistics().resources
        assert cpu.device == "cpu"
        assert cpu.waits == 1  # the second of the burst waited on the CPU's pool


async def test_a_recreated_instance_needing_more_than_its_new_devices_pool_is_refused(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FallingBack(FakeBackend())
    registry = trioinfer.Registry(extra={"backends": {"fake": lambda: backend}})
    sizes = {"R": {"cuda:0": 4, "cpu": 2}}
    async with open_engine(registry=registry, resources=sizes) as engine:
        await engine.load(config("a", Instance(device="cuda:0", resources={"R": 3})))
        backend.lost = True
        runner = engine._runner("a")
        assert isinstance(runner, ModelRunner)
        (replica,) = runner.replicas
        with pytest.raises(trioinfer.ConfigError, match=r"needs 3 of resource 'R' on cpu"):
            await runner.recreate(replica)
        assert backend.fake.open_instances == 0  # the old one closed, the new one too


async def test_per_device_size(autojump_clock: trio.testing.MockClock) -> None:
    backend = FakeBackend(delay=1.0)
    sizes = {"R": {"cuda:0": 2, "*": 6}}
    async with open_engine(registry=backend.registry(), resources=sizes) as engine:
        await engine.load(config("a", Instance(device="cuda:0", count=2, resources={"R": 2})))
        await engine.load(config("b", Instance(device="cpu", count=2, resources={"R": 5})))
        assert [(p.device, p.size) for p in engine.statistics().resources] == [
            ("cpu", 6),  # not named for the CPU: every other device's
            ("cuda:0", 2),
        ]


async def test_cancellation_gives_resources_back(autojump_clock: trio.testing.MockClock) -> None:
    """A running execution whose caller leaves, and a waiting one, both hand R on."""
    backend = FakeBackend(delay=1.0)
    async with open_engine(registry=backend.registry(), resources={"R": 1}) as engine:
        await engine.load(config("a", Instance(global_resources={"R": 1})))
        await engine.load(config("b", Instance(global_resources={"R": 1})))
        await engine.load(config("c", Instance(global_resources={"R": 1})))
        ends: dict[str, float] = {}
        t0 = trio.current_time()

        async def run(model: str, budget: float) -> None:
            with trio.move_on_after(budget):
                await engine.infer(model, {"x": X})
                ends[model] = trio.current_time() - t0

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "a", 0.5)  # runs, then leaves at 0.5
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(run, "b", 0.25)  # waits for R, then leaves at 0.25
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(run, "c", 10.0)
        assert ends == {"c": 1.5}  # c ran once a was aborted, not behind b
        (pool,) = engine.statistics().resources
        assert (pool.in_use, pool.waiting) == (0, 0)


async def test_failure_gives_resources_back(autojump_clock: trio.testing.MockClock) -> None:
    backend = FakeBackend(delay=1.0)
    backend.error = RuntimeError("boom")
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(config("a", Instance(global_resources={"R": 1})))
        for _ in range(2):
            with pytest.raises(trioinfer.BackendError):
                await engine.infer("a", {"x": X})
        (pool,) = engine.statistics().resources
        assert pool.in_use == 0


async def test_overlapping_needs_never_deadlock(autojump_clock: trio.testing.MockClock) -> None:
    """a needs R1 and R2, b needs R2 and R1, c only R1: everything is answered."""
    backend = FakeBackend(delay=1.0)
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(config("a", Instance(count=3, global_resources={"R1": 1, "R2": 1})))
        await engine.load(config("b", Instance(count=3, global_resources={"R2": 1, "R1": 1})))
        await engine.load(config("c", Instance(count=2, global_resources={"R1": 1})))
        with trio.fail_after(100):
            t0 = trio.current_time()
            await burst(engine, *["a", "b", "c"] * 5)
        assert trio.current_time() - t0 == 15.0  # everyone needs R1 (a pool of 1)


@pytest.mark.parametrize("count", [1, 2])
async def test_priority_weights_grants(autojump_clock: trio.testing.MockClock, count: int) -> None:
    """While both have work, priority 1 is granted twice as often as priority 2 (Triton).

    With one instance each too: the one that gives R back and asks again at once
    takes its turn by its priority, not behind the other.
    """
    backend = FakeBackend(delay=1.0)
    async with open_engine(registry=backend.registry()) as engine:
        a = Instance(count=count, global_resources={"R": 1}, resource_priority=1)
        b = Instance(count=count, global_resources={"R": 1}, resource_priority=2)
        await engine.load(config("a", a))
        await engine.load(config("b", b))
        done: list[str] = []

        async def run(model: str) -> None:
            await engine.infer(model, {"x": X})
            done.append(model)

        with trio.move_on_after(30.5):
            async with trio.open_nursery() as nursery:
                for model in ["a", "b"] * 40:
                    nursery.start_soon(run, model)
        assert (done.count("a"), done.count("b")) == (20, 10)


async def test_priorities_weight_grants_when_executions_end_together(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Priorities 1, 2, 3, two instances each, a pool of 3: grants go 6:3:2, as Triton weighs them.

    Three executions end at once, and the first waiter wakes and grants before the
    instances that gave back ask again: they must keep their turn, not lose it to
    the clock those grants moved (which gave 4:3:2). Within one grant of the ideal:
    the first round, everyone at pass 0, is one grant each.
    """
    backend = FakeBackend(delay=1.0)
    async with open_engine(registry=backend.registry(), resources={"R": 3}) as engine:
        for model, priority in [("a", 1), ("b", 2), ("c", 3)]:
            instance = Instance(count=2, global_resources={"R": 1}, resource_priority=priority)
            await engine.load(config(model, instance))
        done: list[str] = []

        async def run(model: str) -> None:
            await engine.infer(model, {"x": X})
            done.append(model)

        with trio.move_on_after(66.5):  # 198 grants: 108, 54 and 36
            async with trio.open_nursery() as nursery:
                for model in ["a", "b", "c"] * 120:
                    nursery.start_soon(run, model)
        counts = [done.count(model) for model in "abc"]
        assert all(abs(n - ideal) <= 1 for n, ideal in zip(counts, [108, 54, 36], strict=True)), (
            counts
        )


async def test_needs_bigger_than_the_pool_are_refused_at_load() -> None:
    backend = FakeBackend()
    async with open_engine(registry=backend.registry(), resources={"R": 2}) as engine:
        with pytest.raises(trioinfer.ConfigError, match=r"needs 3 of resource 'R'.*at most 2"):
            await engine.load(config("a", Instance(resources={"R": 3})))
        assert backend.open_instances == 0
        await engine.load(config("b", Instance(resources={"R": 2})))
        with pytest.raises(trioinfer.ConfigError, match="global for this model, but per device"):
            await engine.load(config("c", Instance(global_resources={"R": 1})))
        assert engine.models()[0].name == "b"


async def test_a_refused_or_unloaded_model_does_not_fix_a_resources_kind() -> None:
    # Whether a resource is global or per device binds the models loaded together, not
    # one that was refused at load, nor one unloaded since.
    backend = FakeBackend()
    async with open_engine(registry=backend.registry(), resources={"R": 2, "S": 2}) as engine:
        with pytest.raises(trioinfer.ConfigError, match=r"needs 3 of resource 'R'"):
            await engine.load(config("a", Instance(global_resources={"R": 3})))
        with pytest.raises(trioinfer.ConfigError, match=r"needs 3 of resource 'S'"):
            # Its first group fits: the second's refusal undoes the first's too.
            await engine.load(
                config("a", Instance(resources={"R": 1}), Instance(global_resources={"S": 3}))
            )
        await engine.load(config("b", Instance(resources={"S": 1})))
        await engine.unload("b")
        await engine.load(config("c", Instance(global_resources={"S": 1})))
        await engine.load(config("d", Instance(global_resources={"R": 1})))
        await engine.infer("c", {"x": X})
        await engine.infer("d", {"x": X})
        with pytest.raises(trioinfer.ConfigError, match="per device for this model, but global"):
            await engine.load(config("e", Instance(resources={"S": 1})))
        # Its own groups disagreeing is said as such, not blamed on another model.
        with pytest.raises(trioinfer.ConfigError, match="declared both global and per device"):
            await engine.load(
                config("e", Instance(resources={"T": 1}), Instance(global_resources={"T": 1}))
            )


async def test_statistics_list_only_the_pools_loaded_models_use() -> None:
    # A pool nobody loaded uses any more would show its old size as if it still applied.
    backend = FakeBackend()
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(config("a", Instance(device="cpu", resources={"R": 3})))
        await engine.load(config("b", Instance(device="cpu", resources={"S": 1})))
        await engine.infer("a", {"x": X})
        await engine.unload("a")
        await engine.load(config("c", Instance(device="cpu", global_resources={"R": 2})))
        pools = [(p.name, p.device, p.size) for p in engine.statistics().resources]
        assert pools == [("R", None, 2), ("S", "cpu", 1)]
        await engine.unload("c")
        # Used again, per device: the pool is sized afresh, by the need loaded now.
        await engine.load(config("d", Instance(device="cpu", resources={"R": 1})))
        await engine.infer("d", {"x": X})
        pools = [(p.name, p.device, p.size, p.in_use) for p in engine.statistics().resources]
        assert pools == [("R", "cpu", 1, 0), ("S", "cpu", 1, 0)]


async def test_a_moved_instance_leaves_its_old_devices_pool_out_of_the_statistics(
    autojump_clock: trio.testing.MockClock,
) -> None:
    backend = FallingBack(FakeBackend(delay=1.0))
    registry = trioinfer.Registry(extra={"backends": {"fake": lambda: backend}})
    async with open_engine(registry=registry) as engine:
        await engine.load(config("a", Instance(device="cuda:0", resources={"R": 1})))
        backend.lost = True
        runner = engine._runner("a")
        assert isinstance(runner, ModelRunner)
        (replica,) = runner.replicas
        await runner.recreate(replica)
        await engine.infer("a", {"x": X})
        assert [(p.device, p.size) for p in engine.statistics().resources] == [("cpu", 1)]


async def test_a_request_waiting_on_a_pool_is_not_disturbed_by_an_unload(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # b unloads while a's requests hold and wait on the pool they share: a's go on.
    backend = FakeBackend(delay=1.0)
    async with open_engine(registry=backend.registry(), resources={"R": 1}) as engine:
        await engine.load(config("a", Instance(count=2, resources={"R": 1})))
        await engine.load(config("b", Instance(resources={"R": 1})))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(burst, engine, "a", "a")
            await trio.testing.wait_all_tasks_blocked()
            (pool,) = engine.statistics().resources
            assert (pool.in_use, pool.waiting) == (1, 1)
            await engine.unload("b")
        (pool,) = engine.statistics().resources
        assert (pool.size, pool.in_use, pool.waiting, pool.waits) == (1, 0, 0, 1)


@pytest.mark.parametrize(
    ("sizes", "match"),
    [
        ({"R": 0}, "positive integer"),
        ({"R": {"gpu": 1}}, "device"),
        ({"": 1}, "name"),
        ([("R", 1)], "must map"),
    ],
)
async def test_bad_pool_sizes_are_refused(sizes: object, match: str) -> None:
    with pytest.raises(trioinfer.ConfigError, match=match):
        async with open_engine(resources=sizes):  # type: ignore[arg-type]
            pass  # pragma: no cover


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"resources": {"R": 0}}, r"resources\['R'\] must be a positive integer"),
        ({"global_resources": ["R"]}, "global_resources must be a table"),
        ({"resources": {"": 1}}, "non-empty string"),
        ({"resource_priority": 0}, "resource_priority must be a positive integer"),
    ],
)
def test_bad_needs_are_refused(fields: dict[str, object], match: str) -> None:
    with pytest.raises(trioinfer.ConfigError, match=match):
        Instance(**fields)  # type: ignore[arg-type]


def test_a_pipeline_takes_no_resources() -> None:
    with pytest.raises(trioinfer.ConfigError, match="a pipeline takes no resources"):
        ModelConfig(name="p", backend="pipeline", instances=[Instance(global_resources={"R": 1})])


def test_config_toml_declares_needs() -> None:
    cfg = ModelConfig.from_dict(
        {
            "name": "m",
            "path": "m.onnx",
            "instances": [
                {"device": "cpu", "count": 2, "resources": {"R1": 4}},
                {"global_resources": {"G": 1}, "resource_priority": 2},
            ],
        }
    )
    assert dict(cfg.instances[0].resources) == {"R1": 4}
    assert dict(cfg.instances[1].global_resources) == {"G": 1}
    assert cfg.instances[1].resource_priority == 2
    assert Instance() == Instance(resources={})


@pytest.mark.parametrize("anyio_backend", ["trio", "asyncio"])
def test_pools_on_both_event_loops(anyio_backend: str) -> None:
    """The pools use anyio only: on asyncio too, a pool of 1 is never exceeded."""
    held: list[int] = []
    engine: trioinfer.Engine | None = None

    def fn(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        assert engine is not None
        held.append(engine.statistics().resources[0].in_use)
        return {"y": inputs["x"]}

    async def main() -> None:
        nonlocal engine
        backend = FakeBackend(fn)
        async with open_engine(registry=backend.registry(), resources={"R": 1}) as engine:
            await engine.load(config("a", Instance(count=3, global_resources={"R": 1})))
            await engine.load(config("b", Instance(count=3, global_resources={"R": 1})))
            async with anyio.create_task_group() as tg:
                for model in ["a", "b"] * 10:
                    tg.start_soon(engine.infer, model, {"x": X})
            assert engine.statistics().resources[0].in_use == 0

    anyio.run(main, backend=anyio_backend)
    assert held == [1] * 20


async def test_rate_limit_off_ignores_needs(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Triton's --rate-limit=off: declared needs are read, said, and not taken."""
    backend = FakeBackend(delay=1.0)
    async with open_engine(registry=backend.registry(), rate_limit=False) as engine:
        await engine.load(config("a", Instance(count=2, global_resources={"R": 1})))
        t0 = trio.current_time()
        await burst(engine, "a", "a")
        assert trio.current_time() - t0 == 1.0
        assert engine.statistics().resources == ()
    assert "model 'a': its instances' resources are not taken: rate limiting is off" in (
        caplog.text
    )
