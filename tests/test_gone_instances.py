"""An instance that says it is gone (a Ray actor that died) leaves its model's rotation.

No Ray here: a backend whose instances can be marked gone, as the ray backend's are when
their actor dies (their ``gone`` says why, and their executions fail).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import trio
import trio.testing

from test_plugin_faults import Breaks
from trioinfer import (
    BackendError,
    BackendUnavailable,
    CircuitOpen,
    Instance,
    InvalidInput,
    ModelConfig,
    ModelSignature,
    PluginContractError,
    Registry,
    SequenceError,
    SequenceFlags,
    TensorSpec,
    TrioInferError,
    open_engine,
)
from trioinfer.abc import Arrays, FallbackContext, RecoveringFallback, Replica
from trioinfer.lowlevel import Execution, Placement
from trioinfer.testing import FakeBackend
from trioinfer.testing._fake import FakeInstance
from trioinfer_fallback import Resilient

X = {"x": np.ones((1, 4), np.float32)}


class Mortal:
    """Loads `MortalInstance`s, keeping every one (the latest by index, and all in order)."""

    def __init__(self) -> None:
        self.fake = FakeBackend()
        self.instances: dict[int, MortalInstance] = {}
        self.loaded: list[MortalInstance] = []

    async def load(self, config: ModelConfig, placement: Placement) -> MortalInstance:
        instance = MortalInstance(await self.fake.load(config, placement))
        self.instances[placement.index] = instance
        self.loaded.append(instance)
        return instance

    def registry(self) -> Registry:
        return Registry(extra={"backends": {"mortal": lambda: self}})


class MortalInstance:
    def __init__(self, inner: FakeInstance) -> None:
        self.inner = inner
        self.gone: str | None = None
        self.calls = 0
        # Raised by the next execution, once.
        self.error: Exception | None = None
        # True: the next execution waits in the instance until `release` is set.
        self.hold = False
        self.running = trio.Event()
        self.release = trio.Event()

    @property
    def signature(self) -> ModelSignature:
        return self.inner.signature

    @property
    def device(self) -> str:
        return self.inner.device

    async def execute(self, inputs: Arrays) -> dict[str, Any]:
        self.calls += 1
        if self.hold:
            self.hold = False
            self.running.set()
            await self.release.wait()
        if self.gone is not None:
            raise BackendUnavailable(f"instance {self.gone}")
        error, self.error = self.error, None
        if error is not None:
            raise error
        return await self.inner.execute(inputs)

    async def aclose(self) -> None:
        await self.inner.aclose()


def two_instances(**fields: Any) -> ModelConfig:
    config = ModelConfig(name="m", path=Path("m.onnx"), backend="mortal", **fields)
    return attrs.evolve(config, instances=[Instance(count=2, device="cpu")])


async def test_a_gone_instance_gets_no_batch_and_the_other_serves() -> None:
    """Without the resilient fallback, batches still went to an instance whose actor had
    died, and failed, while the model's other instance was healthy. Found gone, it is
    taken out of service: every request is served by the other one."""
    mortal = Mortal()
    async with open_engine(registry=mortal.registry()) as engine:
        await engine.load(two_instances())
        first, second = mortal.instances[0], mortal.instances[1]
        first.gone = "0's actor is gone (ActorDiedError): killed"
        for _ in range(20):
            await engine.infer("m", X)
        assert (first.calls, second.calls) == (0, 20)
        stats = engine.statistics().models["m"]
        assert (stats.succeeded, stats.failed) == (20, 0)
        out, serving = stats.replicas
        assert (out.state, out.reason, out.taken_out) == (
            "out",
            "gone: 0's actor is gone (ActorDiedError): killed",
            1,
        )
        assert (serving.state, serving.executions) == ("serving", 20)
        assert engine.model("m").unavailable is None


async def test_the_batch_running_on_an_instance_that_dies_fails_once_and_later_ones_go_on() -> None:
    """The batch in flight when its instance dies fails once, naming the instance and why;
    the batches after it go to the instance that lives."""
    mortal = Mortal()
    async with open_engine(registry=mortal.registry()) as engine:
        await engine.load(two_instances())
        first, second = mortal.instances[0], mortal.instances[1]
        # Whichever takes the first batch holds it.
        first.hold = second.hold = True
        first.running = second.running = trio.Event()
        errors: list[BaseException] = []

        async def caller() -> None:
            try:
                await engine.infer("m", X)
            except BackendUnavailable as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(caller)
            with trio.fail_after(10):
                await first.running.wait()
            dying, living = (first, second) if first.calls else (second, first)
            living.hold = False
            dying.gone = "actor is gone (ActorDiedError): its node died"
            dying.release.set()
        (error,) = errors
        assert "actor is gone (ActorDiedError): its node died" in str(error)
        calls = dying.calls
        for _ in range(10):
            await engine.infer("m", X)
        assert dying.calls == calls  # nothing more sent to it
        stats = engine.statistics().models["m"]
        assert (stats.succeeded, stats.failed) == (10, 1)
        (index,) = [i for i, instance in mortal.instances.items() if instance is dying]
        assert stats.replicas[index].state == "out"


async def test_with_every_instance_gone_requests_are_refused_at_once_saying_why() -> None:
    """Nothing is coming back (no fallback re-creates instances): requests are refused
    with BackendUnavailable naming each instance and why it is gone, not left waiting."""
    mortal = Mortal()
    async with open_engine(registry=mortal.registry()) as engine:
        await engine.load(two_instances())
        mortal.instances[0].gone = "0's actor is gone: killed"
        mortal.instances[1].gone = "1's actor is gone: its node died"
        with pytest.raises(BackendUnavailable) as first:
            await engine.infer("m", X)
        assert "none is coming back: load the model again" in str(first.value)
        assert "instance 0 (cpu): gone: 0's actor is gone: killed" in str(first.value)
        assert "instance 1 (cpu): gone: 1's actor is gone: its node died" in str(first.value)
        with pytest.raises(BackendUnavailable, match="none is coming back"):
            await engine.infer("m", X)
        stats = engine.statistics().models["m"]
        assert stats.refused >= 1  # refused at admission: no batch formed for it
        assert (mortal.instances[0].calls, mortal.instances[1].calls) == (0, 0)
        unavailable = engine.model("m").unavailable
        assert unavailable is not None
        assert "no instance of model 'm' serves it" in unavailable
        await engine.load(two_instances(), replace=True)
        await engine.infer("m", X)


async def test_resilient_re_creates_an_idle_instance_found_gone() -> None:
    """The engine takes a gone instance out before any batch fails on it, so a breaker
    that counts failures would never open: the resilient fallback is told instead (a
    RecoveringFallback), and re-creates the instance at once."""
    mortal = Mortal()
    config = two_instances(
        fallback="resilient",
        fallback_options={"breaker": {"fail_max": 5, "reset_timeout": 30.0}},
    )
    async with open_engine(registry=mortal.registry()) as engine:
        await engine.load(config)
        first = mortal.instances[0]
        first.gone = "0's actor is gone: killed"
        for _ in range(4):
            await engine.infer("m", X)
        assert first.calls == 0
        with trio.fail_after(10):
            while engine.statistics().models["m"].replicas[0].state != "serving":  # noqa: ASYNC110
                await trio.sleep(0.01)
        replica = engine.statistics().models["m"].replicas[0]
        assert (replica.recreated, replica.taken_out) == (1, 1)
        assert mortal.instances[0] is not first  # a fresh one
        stats = engine.statistics().models["m"]
        assert (stats.succeeded, stats.failed) == (4, 0)


async def test_resilient_re_creates_an_instance_found_gone_while_its_breaker_is_open(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """An instance out with its breaker open (a transient failure), found gone before the
    breaker's wait ends, was probed when it ended (a call to a dead actor), and re-created
    only after another wait. Now it is re-created when the wait ends, unprobed."""
    mortal = Mortal()
    config = two_instances(
        fallback="resilient",
        fallback_options={"breaker": {"fail_max": 1, "reset_timeout": 30.0}},
    )
    async with open_engine(registry=mortal.registry()) as engine:
        await engine.load(config)
        first = mortal.instances[0]
        first.error = BackendError("a blip", transient=True)
        while first.error is not None:
            await engine.infer("m", X)  # failed over to the other instance
        assert engine.statistics().models["m"].replicas[0].state == "out"
        calls = first.calls
        first.gone = "0's actor is gone: killed"
        opened = trio.current_time()
        while engine.statistics().models["m"].replicas[0].recreated == 0:  # noqa: ASYNC110
            await trio.sleep(1.0)
        assert trio.current_time() - opened <= 31.0  # when the breaker's first wait ends
        assert first.calls == calls  # never probed, gone
        assert mortal.instances[0] is not first
        with trio.fail_after(10):
            while engine.statistics().models["m"].replicas[0].state != "serving":  # noqa: ASYNC110
                await trio.sleep(0.01)


async def test_requests_queued_when_the_only_instance_is_found_gone_hear_it_comes_back() -> None:
    """The resilient fallback re-creates an instance found gone, but the requests queued
    behind the batch that found it were refused first, told that none is coming back
    and to load the model again (BackendUnavailable). Now each is told what the next
    request is: every instance is out of service, retry later (CircuitOpen)."""
    mortal = Mortal()
    config = ModelConfig(
        name="m",
        path=Path("m.onnx"),
        backend="mortal",
        fallback="resilient",
        fallback_options={"breaker": {"fail_max": 5, "reset_timeout": 30.0}},
    )
    errors: list[BaseException] = []
    async with open_engine(registry=mortal.registry()) as engine:
        await engine.load(config)
        mortal.instances[0].gone = "0's actor is gone: killed"

        async def caller() -> None:
            try:
                await engine.infer("m", X)
            except TrioInferError as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(caller)
    assert len(errors) == 3
    for error in errors:
        assert isinstance(error, CircuitOpen), error
        assert "circuit breaker open: gone: 0's actor is gone: killed" in str(error)
        assert "none is coming back" not in str(error)


def test_resilient_is_a_recovering_fallback() -> None:
    assert isinstance(Resilient(), RecoveringFallback)


async def test_an_instance_gone_in_a_model_out_of_service_stops_nothing_else() -> None:
    """A model taken out of service (its scheduler broke its contract) whose instance is
    then found gone: nothing is left to take out, and its worker goes on waiting as the
    model's others do; the engine and its other models go on."""
    mortal = Mortal()
    made: list[Breaks] = []

    def make() -> Breaks:
        made.append(Breaks())
        return made[-1]

    registry = Registry(
        extra={"backends": {"mortal": lambda: mortal}, "schedulers": {"breaks": make}}
    )
    config = ModelConfig(name="m", path=Path("m.onnx"), backend="mortal", scheduler="breaks")
    async with open_engine(registry=registry) as engine:
        await engine.load(config)
        instance = mortal.instances[0]
        await engine.load(attrs.evolve(config, name="other", scheduler="fifo"))
        instance.hold = True
        errors: list[BaseException] = []

        async def caller(scope: trio.CancelScope | None = None) -> None:
            try:
                with scope or trio.CancelScope():
                    await engine.infer("m", X)
            except BackendUnavailable as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(caller)
            with trio.fail_after(10):
                await instance.running.wait()
            queued = trio.CancelScope()
            nursery.start_soon(caller, queued)
            with trio.fail_after(10):
                while engine.statistics().models["m"].queued < 1:  # noqa: ASYNC110
                    await trio.sleep(0.01)
            made[-1].remove_raises = True
            queued.cancel()  # its withdrawal breaks the scheduler: the model is out
            with trio.fail_after(10):
                while engine.model("m").out_of_service is None:  # noqa: ASYNC110
                    await trio.sleep(0.01)
            instance.gone = "0's actor is gone: killed"
            instance.release.set()
        (error,) = errors  # the running batch failed, once
        assert "0's actor is gone: killed" in str(error)
        with pytest.raises(PluginContractError, match="model 'm' is out of service"):
            await engine.infer("m", X)
        await engine.infer("other", X)


async def test_a_fallback_putting_a_gone_instance_back_in_replica_gone_is_blamed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A RecoveringFallback that put the gone instance back inside replica_gone (its
    contract: re-create it first, in a task) failed an AssertionError in the model's
    worker task, which ended the engine. Now the fallback is named as the one that broke
    its contract, the instance stays out, and the other instance serves."""

    class PutsBack:
        def __init__(self) -> None:
            self.context: FallbackContext | None = None
            self.gone: list[int] = []

        def attach(self, context: FallbackContext) -> None:
            self.context = context

        async def execute(self, execution: Execution) -> None:
            await execution.run()

        def replica_gone(self, replica: Replica) -> None:
            assert self.context is not None
            self.gone.append(replica.index)
            self.context.put_back(replica)  # still gone: breaks its contract

    fallback = PutsBack()
    mortal = Mortal()
    registry = Registry(
        extra={"backends": {"mortal": lambda: mortal}, "fallbacks": {"puts": lambda: fallback}}
    )
    async with open_engine(registry=registry) as engine:
        await engine.load(two_instances(fallback="puts"))
        first, second = mortal.instances[0], mortal.instances[1]
        first.gone = "0's actor is gone: killed"
        with trio.fail_after(10):
            for _ in range(10):
                await engine.infer("m", X)
        assert (first.calls, second.calls) == (0, 10)
        assert fallback.gone == [0]
        out, serving = engine.statistics().models["m"].replicas
        assert (out.state, out.reason) == ("out", "gone: 0's actor is gone: killed")
        assert serving.state == "serving"
        assert engine.model("m").out_of_service is None
    (message,) = [r.getMessage() for r in caplog.records if "broke its contract" in r.getMessage()]
    assert "fallback 'puts' of model 'm' broke its contract" in message
    assert "put back instance 0 (cpu) in replica_gone()" in message


#: A stateful model's signature (a START control), for `Mortal` with the sequence batcher.
SEQUENCE_SIGNATURE = ModelSignature(
    inputs=(
        TensorSpec("x", np.dtype(np.float32), ("batch", 4), "tensor(float)"),
        TensorSpec("START", np.dtype(np.float32), ("batch", 1), "tensor(float)"),
    ),
    outputs=(TensorSpec("y", np.dtype(np.float32), ("batch", 4), "tensor(float)"),),
)


@pytest.mark.parametrize("strategy", ["oldest", "direct"])
async def test_a_new_sequence_on_an_instance_found_gone_fails_and_the_next_go_elsewhere(
    strategy: str, autojump_clock: trio.testing.MockClock
) -> None:
    """The sequence batcher bound a new sequence to the instance whose worker formed its
    batch first, also one that had just died: the engine then found it gone and put the
    batch back in the queue, where the batcher never looks again (it holds its requests
    in their sequences), and the request waited for ever. Now it fails, saying so, and
    the next new sequences go to the instance that serves."""
    mortal = Mortal()
    mortal.fake = FakeBackend(lambda inputs: {"y": inputs["x"] * 2}, signature=SEQUENCE_SIGNATURE)
    config = two_instances(
        batcher="sequence",
        sequence={"strategy": strategy, "control": {"start": "START"}},
    )
    outcomes: dict[int, str] = {}
    async with open_engine(registry=mortal.registry()) as engine:
        await engine.load(config)
        dead, alive = mortal.instances[0], mortal.instances[1]
        await trio.testing.wait_all_tasks_blocked()  # both workers wait for sequences
        dead.gone = "0's actor is gone: killed"
        alive.hold = True  # its first batch waits: its worker forms no other meanwhile

        async def sequence(sequence_id: int) -> None:
            flags = SequenceFlags(sequence_id, start=True, end=True)
            try:
                await engine.infer("m", X, sequence=flags)
            except BackendUnavailable as exc:
                outcomes[sequence_id] = str(exc)
            else:
                outcomes[sequence_id] = "answered"

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                # One of these reached the dead instance's worker, waiting alone.
                for sequence_id in (1, 2):
                    nursery.start_soon(sequence, sequence_id)
                    await trio.testing.wait_all_tasks_blocked()
                alive.release.set()
            for sequence_id in (3, 4):  # the dead instance is out: none reaches it
                await sequence(sequence_id)
        [failed] = [text for text in outcomes.values() if text != "answered"]
        assert "which holds the sequence of request" in failed
        assert "(gone: 0's actor is gone: killed)" in failed
        assert (outcomes[3], outcomes[4]) == ("answered", "answered")
        assert dead.calls == 0
        stats = engine.statistics().models["m"]
        assert (stats.succeeded, stats.failed) == (3, 1)


@pytest.mark.parametrize("strategy", ["oldest", "direct"])
async def test_the_sequences_of_an_instance_found_gone_end_saying_so(strategy: str) -> None:
    """A sequence's next request, once its instance was gone (its state with it), waited
    for ever: put back where the sequence batcher never looks, then held for the
    instance. Now it fails, and the sequence's later requests are refused, saying why;
    new sequences go on, on the instance that serves."""
    mortal = Mortal()
    mortal.fake = FakeBackend(lambda inputs: {"y": inputs["x"] * 2}, signature=SEQUENCE_SIGNATURE)
    config = two_instances(
        batcher="sequence",
        sequence={"strategy": strategy, "control": {"start": "START"}, "max_batch_size": 4},
    )
    async with open_engine(registry=mortal.registry()) as engine:
        await engine.load(config)
        on: dict[int, MortalInstance] = {}  # each sequence's instance
        for sequence_id in range(1, 7):
            before = {instance: instance.calls for instance in mortal.instances.values()}
            await engine.infer("m", X, sequence=SequenceFlags(sequence_id, start=True))
            [on[sequence_id]] = [i for i, calls in before.items() if i.calls > calls]
        dead = on[1]
        dead.gone = "its actor is gone: killed"
        with trio.fail_after(30):
            with pytest.raises(BackendUnavailable, match="which holds the sequence of request"):
                await engine.infer("m", X, sequence=SequenceFlags(1))
            for sequence_id in range(1, 7):
                last = SequenceFlags(sequence_id, end=True)
                if on[sequence_id] is dead:  # ended, also those with no request waiting
                    with pytest.raises(SequenceError, match="out of service: gone: its actor"):
                        await engine.infer("m", X, sequence=last)
                else:  # those on the instance that serves go on
                    await engine.infer("m", X, sequence=last)
            await engine.infer("m", X, sequence=SequenceFlags(7, start=True, end=True))
        assert dead.calls == sum(instance is dead for instance in on.values())


class MortalStreams:
    """Loads instances of a decoupled model (`MortalStreamInstance`) that can be gone."""

    def __init__(self) -> None:
        self.instances: dict[int, MortalStreamInstance] = {}

    async def load(self, config: ModelConfig, placement: Placement) -> MortalStreamInstance:
        instance = MortalStreamInstance(str(placement.device))
        self.instances[placement.index] = instance
        return instance

    def registry(self) -> Registry:
        return Registry(extra={"backends": {"mortal": lambda: self}})


class MortalStreamInstance:
    decoupled = True

    def __init__(self, device: str) -> None:
        self.device = device
        self.signature = FakeBackend().signature
        self.gone: str | None = None
        self.streams = 0

    async def execute(self, inputs: Arrays) -> dict[str, Any]:  # pragma: no cover  # never
        raise AssertionError("a decoupled model is served through its streams")

    async def stream(self, inputs: Arrays) -> AsyncIterator[dict[str, Any]]:
        self.streams += 1
        if self.gone is not None:
            raise BackendUnavailable(f"instance {self.gone}")
        yield {"y": inputs["x"] * 2}

    async def aclose(self) -> None:
        pass


async def test_a_stream_never_goes_to_an_instance_that_is_gone() -> None:
    """Streams went to the instance with the fewest open, one that was gone too (its
    streams failing at once, it always had the fewest): every stream failed while the
    model's other instance served. Streams go to the instances that serve."""
    backend = MortalStreams()
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(two_instances())
        dead, alive = backend.instances[0], backend.instances[1]
        dead.gone = "0's actor is gone: killed"
        for _ in range(4):
            async with engine.infer_stream("m", X) as responses:
                assert [r["y"].tolist() for r in [r async for r in responses]] == [[[2.0] * 4]]
        assert (dead.streams, alive.streams) == (0, 4)
        assert engine.statistics().models["m"].replicas[0].reason == (
            "gone: 0's actor is gone: killed"
        )
        dead.gone, alive.gone = None, "1's actor is gone: killed"
        with pytest.raises(BackendUnavailable, match="none is coming back"):
            async with engine.infer_stream("m", X) as responses:
                pass  # pragma: no cover  # refused at the door


class ExecuteRefused(MortalStreamInstance):
    """A decoupled instance whose ``execute`` is refused, as the Python backend's is."""

    async def execute(self, inputs: Arrays) -> dict[str, Any]:
        raise InvalidInput("model 'm' is decoupled (it answers with a stream of responses)")


@pytest.mark.streaming
async def test_resilient_brings_back_a_decoupled_instance_found_gone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The resilient fallback re-created a decoupled model's instance found gone, then
    probed it with ``execute``, which a decoupled instance refuses: every probe failed,
    and the instance stayed out for ever (re-created at each wait). It is probed through
    a stream now, and serves again."""
    backend = MortalStreams()
    backend.load = _refusing(backend)  # type: ignore[method-assign]
    config = two_instances(
        fallback="resilient",
        fallback_options={"breaker": {"fail_max": 5, "reset_timeout": 30.0}},
    )
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(config)
        dead = backend.instances[0]
        dead.gone = "0's actor is gone: killed"
        async with engine.infer_stream("m", X) as responses:
            assert [r["y"].tolist() async for r in responses] == [[[2.0] * 4]]
        with trio.fail_after(600):  # mock time: twenty breaker waits
            while engine.statistics().models["m"].replicas[0].state != "serving":  # noqa: ASYNC110
                await trio.sleep(1.0)
        assert backend.instances[0] is not dead
        assert engine.statistics().models["m"].replicas[0].recreated == 1


def _refusing(backend: MortalStreams) -> Any:
    async def load(config: ModelConfig, placement: Placement) -> MortalStreamInstance:
        instance = ExecuteRefused(str(placement.device))
        backend.instances[placement.index] = instance
        return instance

    return load


async def test_a_gone_instance_put_back_in_replica_gone_is_taken_out_once() -> None:
    """A fallback that put a gone instance back in replica_gone had it taken out again:
    its ``taken_out`` counted 2 for the one time the engine took it out."""

    class PutsBack:
        def __init__(self) -> None:
            self.context: FallbackContext | None = None

        def attach(self, context: FallbackContext) -> None:
            self.context = context

        async def execute(self, execution: Execution) -> None:
            await execution.run()

        def replica_gone(self, replica: Replica) -> None:
            assert self.context is not None
            self.context.put_back(replica)  # still gone: breaks its contract

    fallback = PutsBack()
    mortal = Mortal()
    registry = Registry(
        extra={"backends": {"mortal": lambda: mortal}, "fallbacks": {"puts": lambda: fallback}}
    )
    async with open_engine(registry=registry) as engine:
        await engine.load(two_instances(fallback="puts"))
        mortal.instances[0].gone = "0's actor is gone: killed"
        for _ in range(4):
            await engine.infer("m", X)
        out = engine.statistics().models["m"].replicas[0]
        assert (out.state, out.taken_out) == ("out", 1)


@pytest.mark.sequence
@pytest.mark.parametrize("strategy", ["oldest", "direct"])
async def test_a_new_sequence_taken_in_when_the_last_instance_leaves_is_refused(
    strategy: str, autojump_clock: trio.testing.MockClock
) -> None:
    """A new sequence's request that the sequence batcher had taken in when the last
    serving instance left (a stateful model has no fallback: found gone is the only way
    out) ends, saying so; it does not wait for an instance for ever (review3's suspicion,
    refuted: this pins it)."""
    mortal = Mortal()
    mortal.fake = FakeBackend(lambda inputs: {"y": inputs["x"] * 2}, signature=SEQUENCE_SIGNATURE)
    config = two_instances(
        batcher="sequence",
        sequence={"strategy": strategy, "control": {"start": "START"}},
    )
    outcome: dict[int, str] = {}
    async with open_engine(registry=mortal.registry()) as engine:
        await engine.load(config)
        first, second = mortal.instances[0], mortal.instances[1]
        first.gone = "0's actor is gone: killed"
        while engine.statistics().models["m"].replicas[0].state != "out":
            # (A new sequence bound to it while the engine had not seen it gone fails.)
            with contextlib.suppress(BackendUnavailable):
                await engine.infer("m", X, sequence=SequenceFlags(9, start=True, end=True))
        second.hold = True  # its next batch waits in the instance

        async def sequence(sequence_id: int) -> None:
            try:
                await engine.infer(
                    "m",
                    X,
                    sequence=SequenceFlags(sequence_id, start=True),
                    request_id=f"s{sequence_id}",
                )
            except TrioInferError as exc:
                outcome[sequence_id] = str(exc)
            else:
                outcome[sequence_id] = "answered"

        with trio.fail_after(3600):  # mock time
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sequence, 1)  # runs on the second, held
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(sequence, 2)  # taken in, waits for an instance
                await trio.testing.wait_all_tasks_blocked()
                second.gone = "1's actor is gone: killed"
                second.release.set()  # its batch fails: the engine sees it gone
        # Each ended, saying why: the one that ran on the second with its batch, the
        # other (taken in, bound to no instance that serves) as out of service.
        assert sorted(outcome) == [1, 2]
        assert all("gone: killed" in text for text in outcome.values()), outcome
