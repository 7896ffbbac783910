"""A plugin that breaks its contract at run time fails its requests, never the engine.

A scheduler, batcher or fallback is third-party code running in a model's
worker loop. When one raises (or returns what is no batch), the requests it
touched end once with a `PluginContractError` naming the plugin and the model,
its exception chained; the model goes on when it can, and is taken out of
service (queued requests failed, later ones refused, logged once) when its
state can no longer be trusted. The engine, and every other model, keep serving.
"""

from __future__ import annotations

import collections
import logging
import math
import shutil
from pathlib import Path
from typing import Any

import anyio
import httpx
import numpy as np
import pytest
import trio
import trio.testing

import trioinfer
from _serve import start_serving
from trioinfer import ModelConfig, open_engine
from trioinfer.lowlevel import Execution, Request, RequestQueue
from trioinfer.server import Listening, status_for
from trioinfer.testing import FakeBackend

X = np.ones((1, 4), dtype=np.float32)


def config(name: str = "m", **kw: Any) -> ModelConfig:
    return ModelConfig(name=name, path="unused.onnx", backend="fake", **kw)


class Breaks:
    """A FIFO scheduler whose ``pop()`` (or ``remove()``) raises once told to."""

    def __init__(self) -> None:
        self._items: collections.deque[Request] = collections.deque()
        self.pop_raises = False
        self.remove_raises = False

    def push(self, request: Request) -> None:
        self._items.append(request)

    def peek(self) -> Request:
        if not self._items:
            raise IndexError("empty")
        return self._items[0]

    def pop(self) -> Request:
        if self.pop_raises:
            raise RuntimeError("heap invariant violated")
        if not self._items:
            raise IndexError("empty")
        return self._items.popleft()

    def remove(self, request: Request) -> bool:
        if self.remove_raises:
            raise RuntimeError("index out of sync")
        try:
            self._items.remove(request)
        except ValueError:
            return False
        return True

    def __len__(self) -> int:
        return len(self._items)


class Flaky:
    """A batcher whose ``next_batch()`` raises for its next *failures* batches, holding one."""

    def __init__(self) -> None:
        self.failures = 0
        self.junk = 0

    async def next_batch(self, queue: RequestQueue) -> list[Any]:
        while True:
            await queue.wait_not_empty()
            try:
                request = queue.pop_nowait()
            except anyio.WouldBlock:
                continue
            break
        if self.failures:
            self.failures -= 1
            raise ZeroDivisionError("bad batch arithmetic")
        if self.junk:
            self.junk -= 1
            return [request, "not a request"]
        return [request]


def registry(backend: FakeBackend, **plugins: dict[str, Any]) -> trioinfer.Registry:
    """A registry of *backend* as "fake" and of *plugins*: by kind, then name, each a factory."""
    return trioinfer.Registry(extra={"backends": {"fake": lambda: backend}, **plugins})


async def outcome(engine: trioinfer.Engine, model: str) -> BaseException | None:
    """What engine.infer() ends with: None for outputs, else its error."""
    try:
        out = await engine.infer(model, {"x": X})
    except trioinfer.TrioInferError as exc:
        return exc
    np.testing.assert_array_equal(out["y"], 2 * X)
    return None


def errors(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.ERROR and r.name == "trioinfer"]


async def test_a_scheduler_whose_pop_raises_takes_its_model_out_of_service(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    made: list[Breaks] = []

    def make() -> Breaks:
        made.append(Breaks())
        return made[-1]

    backend = FakeBackend(delay=1.0)
    with trio.fail_after(60):
        async with open_engine(registry=registry(backend, schedulers={"breaks": make})) as engine:
            await engine.load(config(scheduler="breaks"))
            await engine.load(config("other"))
            results: list[BaseException | None] = []

            async def call() -> None:
                results.append(await outcome(engine, "m"))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(call)  # runs for 1 s
                await trio.sleep(0.5)
                for _ in range(3):
                    nursery.start_soon(call)  # queued behind it
                await trio.sleep(0.1)
                made[-1].pop_raises = True
            # The running request was answered; every queued caller got the clear
            # error, and none was left waiting.
            assert len(results) == 4
            failed = [error for error in results if error is not None]
            assert len(failed) == 3
            for error in failed:
                assert isinstance(error, trioinfer.PluginContractError)
                assert (error.kind, error.plugin) == ("schedulers", "breaks")
                assert "scheduler 'breaks' of model 'm' broke its contract" in str(error)
                assert "RuntimeError in pop(): heap invariant violated" in str(error)
                assert isinstance(error.__cause__, RuntimeError)
                assert status_for(error) == 500
            # Later requests are refused at once, saying why.
            refused = await outcome(engine, "m")
            assert isinstance(refused, trioinfer.PluginContractError)
            assert "model 'm' is out of service: scheduler 'breaks'" in str(refused)
            # The engine and the other model go on.
            assert await outcome(engine, "other") is None
            stats = engine.statistics().models["m"]
            assert (stats.succeeded, stats.failed, stats.refused) == (1, 3, 1)
            assert stats.queued == 0
            assert stats.in_flight == 0
            assert stats.out_of_service is not None
            assert "scheduler 'breaks'" in stats.out_of_service
            assert engine.statistics().models["other"].out_of_service is None
            assert engine.model("m").out_of_service == stats.out_of_service
            # Loaded again (a fresh scheduler), the model serves again.
            await engine.load(config(scheduler="breaks"), replace=True)
            assert await outcome(engine, "m") is None
    # Logged once, with the scheduler's traceback.
    [record] = errors(caplog)
    assert "model 'm' is out of service" in record.getMessage()
    assert record.exc_info is not None
    assert isinstance(record.exc_info[1], RuntimeError)


async def test_a_scheduler_whose_remove_raises_as_a_caller_leaves(
    autojump_clock: trio.testing.MockClock,
) -> None:
    scheduler = Breaks()
    backend = FakeBackend(delay=10.0)
    with trio.fail_after(60):
        async with open_engine(
            registry=registry(backend, schedulers={"breaks": lambda: scheduler})
        ) as engine:
            await engine.load(config(scheduler="breaks"))
            results: list[BaseException | None] = []

            async def call() -> None:
                results.append(await outcome(engine, "m"))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(call)  # runs for 10 s
                await trio.sleep(1)
                scheduler.remove_raises = True
                with trio.move_on_after(1) as scope:
                    await engine.infer("m", {"x": X})  # queued, then its caller leaves
                assert scope.cancelled_caught  # the caller's own cancellation, untouched
                refused = await outcome(engine, "m")
                assert isinstance(refused, trioinfer.PluginContractError)
                assert "remove()" in str(refused)
            # The execution already running finished and answered its caller.
            assert results == [None]
            stats = engine.statistics().models["m"]
            assert (stats.succeeded, stats.refused, stats.in_flight) == (1, 1, 0)


class Miscounts(Breaks):
    """A scheduler whose answers go wrong, silently, once told to: it raises nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.drops = False  # push() keeps nothing: the caller would wait for ever
        self.len_zero = False  # len() says 0 while it holds requests
        self.pops_twice = False  # pop() keeps what it returns: hands it out again
        self.pops_none = False  # pop() returns None, not a request

    def push(self, request: Request) -> None:
        if not self.drops:
            super().push(request)

    def pop(self) -> Request:
        request = super().pop()
        if self.pops_twice:
            self._items.appendleft(request)
        if self.pops_none:
            return None  # type: ignore[return-value]  # the mistake under test
        return request

    def __len__(self) -> int:
        return 0 if self.len_zero else super().__len__()


@pytest.mark.parametrize(
    ("fault", "said"),
    [
        ("drops", "len() is 0, but 3 requests were pushed into it"),
        ("len_zero", "len() is 0, but 3 requests were pushed into it"),
        # Seen in len() (one more than pushed) or in pop(), whichever the batcher asks first.
        ("pops_twice", "which it had already returned | it lost requests, or miscounts them"),
        ("pops_none", "pop() returned a 'NoneType' object, not a request pushed into it"),
    ],
)
@pytest.mark.parametrize("batcher", ["none", "dynamic"])
async def test_a_scheduler_that_loses_or_repeats_requests_takes_its_model_out(
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
    fault: str,
    said: str,
    batcher: str,
) -> None:
    """Its callers get the scheduler's name at once: none waits for ever, the loop never spins.

    A scheduler that drops a request, or miscounts, left its callers waiting
    with no deadline for ever; one whose pop() handed a request out again had
    the queue fail it as expired and pop it again, in a loop that never
    yielded (the whole event loop hung, cancel scopes and all).
    """
    scheduler = Miscounts()
    backend = FakeBackend(delay=1.0)
    with trio.fail_after(60):
        async with open_engine(
            registry=registry(backend, schedulers={"miscounts": lambda: scheduler})
        ) as engine:
            await engine.load(config(scheduler="miscounts", batcher=batcher))
            await engine.load(config("other"))
            results: dict[int, BaseException | None] = {}

            async def call(i: int, deadline: float) -> None:
                with trio.move_on_after(deadline):
                    results[i] = await outcome(engine, "m")

            async with trio.open_nursery() as nursery:
                nursery.start_soon(call, 0, 30)  # runs for 1 s
                await trio.sleep(0.5)
                setattr(scheduler, fault, True)
                for i, deadline in enumerate((0.7, 30, 30), 1):  # the first may expire queued
                    nursery.start_soon(call, i, deadline)
                await trio.sleep(0.1)
            assert results.pop(0) is None  # the running request was answered
            # Each queued caller that was not cut off by its deadline was answered: the
            # request handed out first may have run; the others got the error.
            assert len(results) >= 2, "queued callers were left waiting, not answered"
            failed = [error for error in results.values() if error is not None]
            assert failed
            for error in failed:
                assert isinstance(error, trioinfer.PluginContractError), error
                assert (error.kind, error.plugin) == ("schedulers", "miscounts")
                assert "scheduler 'miscounts' of model 'm' broke its contract" in str(error)
                assert any(part in str(error) for part in said.split(" | ")), error
            refused = await outcome(engine, "m")
            assert isinstance(refused, trioinfer.PluginContractError)
            assert await outcome(engine, "other") is None
            assert engine.statistics().models["m"].in_flight == 0
    [record] = errors(caplog)
    assert "model 'm' is out of service" in record.getMessage()


async def test_a_batcher_that_raises_once_fails_what_it_held_and_the_model_goes_on(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    batcher = Flaky()
    with trio.fail_after(60):
        async with open_engine(
            registry=registry(FakeBackend(), batchers={"flaky": lambda: batcher})
        ) as e:
            await e.load(config(batcher="flaky"))
            batcher.failures = 1
            error = await outcome(e, "m")
            assert isinstance(error, trioinfer.PluginContractError)
            assert (error.kind, error.plugin) == ("batchers", "flaky")
            assert "batcher 'flaky' of model 'm' broke its contract" in str(error)
            assert "ZeroDivisionError in next_batch(): bad batch arithmetic" in str(error)
            assert isinstance(error.__cause__, ZeroDivisionError)
            assert await outcome(e, "m") is None
            stats = e.statistics().models["m"]
            assert (stats.succeeded, stats.failed, stats.out_of_service) == (1, 1, None)
    [record] = errors(caplog)
    assert record.exc_info is not None
    assert isinstance(record.exc_info[1], ZeroDivisionError)


async def test_a_batcher_that_fails_twice_in_a_row_takes_its_model_out(
    autojump_clock: trio.testing.MockClock,
) -> None:
    batcher = Flaky()
    with trio.fail_after(60):
        async with open_engine(
            registry=registry(FakeBackend(), batchers={"flaky": lambda: batcher})
        ) as e:
            await e.load(config(batcher="flaky"))
            await e.load(config("other"))
            batcher.failures = 2
            first, second = await outcome(e, "m"), await outcome(e, "m")
            assert isinstance(first, trioinfer.PluginContractError)
            assert isinstance(second, trioinfer.PluginContractError)
            assert "failed again with no batch formed since" in str(second)
            refused = await outcome(e, "m")
            assert isinstance(refused, trioinfer.PluginContractError)
            assert "model 'm' is out of service: batcher 'flaky'" in str(refused)
            assert await outcome(e, "other") is None
            stats = e.statistics().models["m"]
            assert (stats.failed, stats.refused) == (2, 1)
            assert stats.out_of_service is not None


async def test_a_batcher_that_returns_something_else_than_requests(
    autojump_clock: trio.testing.MockClock,
) -> None:
    batcher = Flaky()
    with trio.fail_after(60):
        async with open_engine(
            registry=registry(FakeBackend(), batchers={"flaky": lambda: batcher})
        ) as e:
            await e.load(config(batcher="flaky"))
            batcher.junk = 1
            error = await outcome(e, "m")
            assert isinstance(error, trioinfer.PluginContractError)
            assert "returned a batch holding 1 'str' objects among its 2 items" in str(error)
            assert await outcome(e, "m") is None  # it goes on
            stats = e.statistics().models["m"]
            assert (stats.succeeded, stats.failed) == (1, 1)


async def test_a_batcher_that_returns_empty_batches(
    autojump_clock: trio.testing.MockClock,
) -> None:
    class Empty:
        async def next_batch(self, queue: RequestQueue) -> list[Request]:
            await queue.wait_not_empty()
            return []  # breaks the contract: a batch has at least one request

    with trio.fail_after(60):
        async with open_engine(registry=registry(FakeBackend(), batchers={"empty": Empty})) as e:
            await e.load(config(batcher="empty"))
            await e.load(config("other"))
            error = await outcome(e, "m")
            assert isinstance(error, trioinfer.PluginContractError)
            assert "returned an empty batch" in str(error)
            assert await outcome(e, "other") is None


async def test_a_batcher_that_returns_a_request_it_only_peeked_at_is_blamed_not_the_scheduler(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The request is still in the scheduler: run as it is, it was handed out twice
    # and the scheduler's next peek() returned an ended request, so the model went
    # out of service blaming 'fifo', which did nothing wrong.
    class PeeksOnly:
        def __init__(self) -> None:
            self.pop_after = 0  # batches formed wrongly before it pops as it should

        async def next_batch(self, queue: RequestQueue) -> list[Request]:
            while True:
                await queue.wait_not_empty()
                try:
                    if self.pop_after:
                        self.pop_after -= 1
                        return [queue.peek_nowait()]
                    return [queue.pop_nowait()]
                except anyio.WouldBlock:
                    continue

    batcher = PeeksOnly()
    with trio.fail_after(60):
        async with open_engine(
            registry=registry(FakeBackend(), batchers={"peeks": lambda: batcher})
        ) as e:
            await e.load(config(batcher="peeks"))
            batcher.pop_after = 1
            # The request stays queued, and runs when the batcher next takes it.
            assert await outcome(e, "m") is None
            batcher.pop_after = 2
            error = await outcome(e, "m")
            assert isinstance(error, trioinfer.PluginContractError)
            assert (error.kind, error.plugin) == ("batchers", "peeks")
            assert "which it had not taken from its queue" in str(error)
            assert "failed again with no batch formed since" in str(error)
            stats = e.statistics().models["m"]
            assert stats.out_of_service is not None
            assert "batcher 'peeks'" in stats.out_of_service
            assert (stats.succeeded, stats.failed) == (1, 1)


async def test_a_batcher_that_returns_a_request_twice_in_one_batch_is_blamed(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    # Its contract: no request twice in a batch. It ran once, without a word, which
    # hid the batcher's miscount (the request it meant may have been left behind).
    class Doubles:
        def __init__(self) -> None:
            self.double = 0  # batches formed wrongly before it forms them as it should

        async def next_batch(self, queue: RequestQueue) -> list[Request]:
            while True:
                await queue.wait_not_empty()
                try:
                    request = queue.pop_nowait()
                except anyio.WouldBlock:
                    continue
                if self.double:
                    self.double -= 1
                    return [request, request]
                return [request]

    backend = FakeBackend()
    batcher = Doubles()
    with trio.fail_after(60):
        async with open_engine(
            registry=registry(backend, batchers={"doubles": lambda: batcher})
        ) as e:
            await e.load(config(batcher="doubles"))
            batcher.double = 1
            error = await outcome(e, "m")
            assert isinstance(error, trioinfer.PluginContractError)
            assert (error.kind, error.plugin) == ("batchers", "doubles")
            assert str(error).startswith("batcher 'doubles' of model 'm' broke its contract: ")
            assert "twice in one batch" in str(error)
            assert status_for(error) == 500
            assert backend.executions == []  # nothing ran
            assert [r.getMessage() for r in errors(caplog)] == [str(error)]
            # One broken batch: the model goes on.
            assert await outcome(e, "m") is None
            batcher.double = 2
            assert isinstance(await outcome(e, "m"), trioinfer.PluginContractError)
            error = await outcome(e, "m")
            assert isinstance(error, trioinfer.PluginContractError)
            assert "failed again with no batch formed since" in str(error)
            stats = e.statistics().models["m"]
            assert stats.out_of_service is not None
            assert "batcher 'doubles'" in stats.out_of_service
            assert (stats.succeeded, stats.failed) == (1, 3)


async def test_a_plugin_exception_without_a_message_is_said_to_have_none(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A def next_batch() popping an empty queue raised a bare anyio.WouldBlock, and the
    # error ended "raised WouldBlock in next_batch(): ", which reads as cut off.
    class Mute:
        async def execute(self, execution: Execution) -> None:
            raise anyio.WouldBlock

    with trio.fail_after(60):
        async with open_engine(registry=registry(FakeBackend(), fallbacks={"mute": Mute})) as e:
            await e.load(config(fallback="mute"))
            error = await outcome(e, "m")
    assert isinstance(error, trioinfer.PluginContractError)
    assert str(error).endswith("raised WouldBlock in execute(), with no message"), error


async def test_a_fallback_that_raises_fails_its_batch_naming_it(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    class Buggy:
        def __init__(self) -> None:
            self.calls = 0

        async def execute(self, execution: Execution) -> None:
            self.calls += 1
            if self.calls == 1:
                raise KeyError("replica 7")
            await execution.run()

    with trio.fail_after(60):
        async with open_engine(registry=registry(FakeBackend(), fallbacks={"buggy": Buggy})) as e:
            await e.load(config(fallback="buggy"))
            error = await outcome(e, "m")
            assert isinstance(error, trioinfer.PluginContractError)
            assert (error.kind, error.plugin) == ("fallbacks", "buggy")
            assert "fallback 'buggy' of model 'm' broke its contract" in str(error)
            assert "KeyError in execute(): 'replica 7'" in str(error)
            assert isinstance(error.__cause__, KeyError)
            assert await outcome(e, "m") is None
            stats = e.statistics().models["m"]
            assert (stats.succeeded, stats.failed, stats.out_of_service) == (1, 1, None)
    [record] = errors(caplog)
    assert record.exc_info is not None
    assert isinstance(record.exc_info[1], KeyError)


async def test_a_backend_error_passed_on_by_a_fallback_is_the_backends(
    autojump_clock: trio.testing.MockClock,
) -> None:
    class PassesOn:
        async def execute(self, execution: Execution) -> None:
            await execution.run()

    backend = FakeBackend()
    with trio.fail_after(60):
        async with open_engine(registry=registry(backend, fallbacks={"on": PassesOn})) as e:
            await e.load(config(fallback="on"))
            backend.error = RuntimeError("device on fire")
            error = await outcome(e, "m")
            assert type(error) is trioinfer.BackendError
            assert "device on fire" in str(error)


async def test_a_plugin_whose_attach_raises_fails_the_load_naming_it() -> None:
    class Unattachable(Breaks):
        def attach(self, context: object) -> None:
            raise TypeError("attach() takes no context")

    async with open_engine(
        registry=registry(FakeBackend(), schedulers={"u": Unattachable})
    ) as engine:
        with pytest.raises(trioinfer.PluginContractError, match=r"scheduler 'u'.*attach\(\)"):
            await engine.load(config(scheduler="u"))


class _Returns:
    """A backend whose load() returns what *make* makes of a good FakeInstance."""

    def __init__(self, make: Any) -> None:
        self._make = make
        self.closed = 0

    async def load(self, config: ModelConfig, placement: Any) -> Any:
        instance = await FakeBackend().load(config, placement)
        made = self._make(instance)
        if made is not instance:
            await instance.aclose()
        return made


class _Dressed:
    """A FakeInstance with one attribute replaced."""

    def __init__(self, instance: Any, owner: _Returns, **override: Any) -> None:
        self._instance = instance
        self._owner = owner
        self._override = override

    def __getattr__(self, name: str) -> Any:
        return self._override.get(name, getattr(self._instance, name))

    @property
    def signature(self) -> Any:
        return self._override.get("signature", self._instance.signature)

    @property
    def device(self) -> Any:
        return self._override.get("device", self._instance.device)

    async def execute(self, inputs: Any) -> Any:
        return await self._instance.execute(inputs)

    async def aclose(self) -> None:
        self._owner.closed += 1
        await self._instance.aclose()


@pytest.mark.parametrize(
    ("what", "said"),
    [
        ("none", "returned a 'NoneType' object, not a trioinfer.abc.BackendInstance"),
        ("dict signature", "whose signature is a 'dict' object, not a trioinfer.ModelSignature"),
        ("no device", "whose device is '', not a non-empty str"),
    ],
)
async def test_a_backend_whose_load_returns_no_instance_fails_the_load_naming_it(
    what: str, said: str
) -> None:
    """load() returning None failed with "instances report different signatures";
    a signature that was a dict, with a bare TypeError (unhashable type)."""
    backend: _Returns
    makers = {
        "none": lambda instance: None,
        "dict signature": lambda instance: _Dressed(instance, backend, signature={"x": 1}),
        "no device": lambda instance: _Dressed(instance, backend, device=""),
    }
    backend = _Returns(makers[what])
    reg = trioinfer.Registry(extra={"backends": {"odd": lambda: backend}})
    async with open_engine(registry=reg) as engine:
        with pytest.raises(trioinfer.PluginContractError) as caught:
            await engine.load(
                ModelConfig(
                    name="m",
                    path="unused.onnx",
                    backend="odd",
                    instances=[trioinfer.Instance("cpu", count=2)],
                )
            )
        assert (caught.value.kind, caught.value.plugin) == ("backends", "odd")
        assert "backend 'odd' broke its contract: load() of instance" in str(caught.value)
        assert said in str(caught.value)
        assert status_for(caught.value) == 500
        assert engine.models() == []
    if what != "none":
        assert backend.closed == 2  # what it did load is closed, not leaked


class _InlineOutputs:
    """An instance that never suspends (an InlineInstance) and returns *outputs* of x."""

    runs_inline = True

    def __init__(self, make: Any) -> None:
        self._make = make
        self.signature = FakeBackend().signature
        self.device = "cpu"

    async def execute(self, inputs: Any) -> Any:
        return self._make(inputs)

    async def aclose(self) -> None:
        pass


class _HopingOutputs(_InlineOutputs):
    """The same as an instance that may suspend but says it starts inline (starts_inline)."""

    runs_inline = False
    starts_inline = True


def _outputs_registry(make: Any, path: str) -> trioinfer.Registry:
    """A registry whose backend "fake" answers *make*(inputs), on the execution *path* given.

    "alone" and "dynamic": a worker's execution (the config picks the batcher);
    "inline": an instance that never suspends; "hoping": one that may end first.
    """
    backend: Any = FakeBackend(make)
    if path in ("inline", "hoping"):
        kind = _InlineOutputs if path == "inline" else _HopingOutputs

        class Inline:
            async def load(self, config: ModelConfig, placement: Any) -> _InlineOutputs:
                return kind(make)

        backend = Inline()
    return trioinfer.Registry(extra={"backends": {"fake": lambda: backend}})


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (lambda i: {"z": i["x"] * 2}, "returned outputs ['z'], but its signature declares ['y']"),
        (
            lambda i: {"y": i["x"] * 2, "extra": i["x"]},
            "returned outputs ['extra', 'y'], but its signature declares ['y'] "
            "(missing [], undeclared ['extra'])",
        ),
        (lambda i: {}, "returned outputs [], but its signature declares ['y'] (missing ['y']"),
        (lambda i: [i["x"] * 2], "returned a 'list' object; a backend's execute() returns a dict"),
    ],
)
@pytest.mark.parametrize("path", ["alone", "dynamic", "inline", "hoping"])
async def test_a_backend_that_returns_other_outputs_fails_with_a_backend_error(
    make: Any, said: str, path: str
) -> None:
    """Callers got a mapping without the outputs the signature promised (the server then
    failed with a 500 of its own, or told a client that asked for 'y' that the model has
    no such output, "it has 'y'")."""
    reg = _outputs_registry(make, path)
    with trio.fail_after(10):
        async with open_engine(registry=reg) as engine:
            await engine.load(config(batcher="dynamic" if path == "dynamic" else "none"))
            results: list[BaseException] = []

            async def call() -> None:
                with pytest.raises(trioinfer.BackendError) as caught:
                    await engine.infer("m", {"x": X})
                results.append(caught.value)

            async with trio.open_nursery() as nursery:
                for _ in range(3 if path == "dynamic" else 1):
                    nursery.start_soon(call)
            for error in results:
                assert "model 'm': instance 0 (cpu) " + said in str(error)
                assert status_for(error) == 500


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (
            lambda i: {"y": i["x"].astype(np.float64)},
            "returned output 'y' with dtype float64; its signature declares float32[batch, 4]",
        ),
        (
            lambda i: {"y": i["x"][:, 0]},  # a wrong rank: the fixed dimension is missing
            "returned output 'y' with shape [1]; its signature declares float32[batch, 4]",
        ),
        (
            lambda i: {"y": i["x"][:, :3]},
            "returned output 'y' with shape [1, 3]; its signature declares float32[batch, 4]",
        ),
        (
            lambda i: {"y": np.concatenate([i["x"], i["x"]])},
            "returned output 'y' with shape [2, 4] for a batch of 1 rows",
        ),
        (
            lambda i: {"y": i["x"].tolist()},
            "returned output 'y' as a 'list' object; its signature declares a numpy array",
        ),
    ],
    ids=["dtype", "rank", "fixed", "rows", "list"],
)
@pytest.mark.parametrize("path", ["alone", "dynamic", "inline", "hoping"])
async def test_a_backend_whose_outputs_do_not_fit_its_signature_fails_with_a_backend_error(
    make: Any, said: str, path: str
) -> None:
    """A float64 answer for FP32 reached clients as FP64 while metadata said FP32; the
    engine checked names only. Every path an execution takes checks the same way."""
    reg = _outputs_registry(make, path)
    with trio.fail_after(10):
        async with open_engine(registry=reg) as engine:
            await engine.load(config(batcher="dynamic" if path == "dynamic" else "none"))
            with pytest.raises(trioinfer.BackendError) as caught:
                await engine.infer("m", {"x": X})
            stats = engine.statistics().models["m"]
    assert str(caught.value).startswith("model 'm': instance 0 (cpu) " + said)
    assert status_for(caught.value) == 500
    assert (stats.failed, stats.replicas[0].failures) == (1, 1)


async def test_an_instance_that_checks_its_outputs_itself_gets_names_and_rows_checked() -> None:
    """checks_outputs = True (the Python backend's): the engine trusts its dtypes and
    shapes, and still checks what only it knows, the batch's rows, and the names."""
    answer: dict[str, Any] = {"y": X.astype(np.float64)}

    class Trusted(_InlineOutputs):
        checks_outputs = True

    class Backend:
        async def load(self, config: ModelConfig, placement: Any) -> _InlineOutputs:
            return Trusted(lambda inputs: answer)

    reg = trioinfer.Registry(extra={"backends": {"fake": Backend}})
    async with open_engine(registry=reg) as engine:
        await engine.load(config())
        assert (await engine.infer("m", {"x": X}))["y"].dtype == np.float64  # its word
        answer = {"y": np.zeros((2, 4), np.float32)}
        with pytest.raises(trioinfer.BackendError, match=r"shape \[2, 4\] for a batch of 1"):
            await engine.infer("m", {"x": X})
        answer = {"z": X}
        with pytest.raises(trioinfer.BackendError, match=r"returned outputs \['z'\]"):
            await engine.infer("m", {"x": X})


async def test_outputs_that_fit_in_another_form_pass_as_they_are() -> None:
    """Open sizes take any size; a BYTES output may be str_ or object; a numpy scalar is
    a rank-0 array; a dtype equal to the declared one passes though not the same object."""
    signature = trioinfer.ModelSignature(
        inputs=(trioinfer.TensorSpec("x", np.dtype(np.float32), ("batch", 4)),),
        outputs=(
            trioinfer.TensorSpec("y", np.dtype(np.float32), ("batch", None)),
            trioinfer.TensorSpec("s", np.dtype(object), (None,)),
            trioinfer.TensorSpec("n", np.dtype(np.int64), ()),
        ),
    )
    little = np.dtype("<f4").newbyteorder("=")  # float32, built afresh

    def answer(inputs: Any) -> dict[str, Any]:
        return {
            "y": inputs["x"][:, :3].astype(little),
            "s": np.array(["a", "b"]),
            "n": np.int64(len(inputs["x"])),
        }

    backend = FakeBackend(answer, signature=signature)
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(config())
        out = await engine.infer("m", {"x": X})
    assert out["y"].shape == (1, 3)
    assert out["s"].tolist() == ["a", "b"]
    assert int(out["n"]) == 1


async def test_an_output_in_the_other_byte_order_passes_as_it_is() -> None:
    """A float32 array in big-endian order (numpy.frombuffer(blob, ">f4"), say) holds float32
    values: the check refused it as "dtype float32; its signature declares float32", while
    the server's codec sends any byte order little-endian, as V2 wants."""
    big = np.dtype(">f4")

    def answer(inputs: Any) -> dict[str, Any]:
        return {"y": inputs["x"].astype(big)}

    backend = FakeBackend(answer)
    async with open_engine(registry=backend.registry()) as engine:
        await engine.load(config())
        out = await engine.infer("m", {"x": X})
        assert out["y"].dtype == big
        assert out["y"].tolist() == X.tolist()


async def test_a_fallback_answering_with_outputs_that_do_not_fit_breaks_its_contract() -> None:
    """A fallback's answer (a default, another model's outputs) is checked as a backend's."""

    class Default:
        def __init__(self) -> None:
            self.answer: dict[str, Any] = {"y": [[0.0, 0.0, 0.0, 0.0]]}  # float64 from a list

        async def execute(self, execution: Execution) -> None:
            for request in execution.pending():
                execution.respond(request, self.answer, via="default")

    fallback = Default()
    reg = registry(FakeBackend(), fallbacks={"default": lambda: fallback})
    async with open_engine(registry=reg) as engine:
        await engine.load(config(fallback="default"))
        with pytest.raises(trioinfer.PluginContractError) as caught:
            await engine.infer("m", {"x": X}, request_id="r1")
        fallback.answer = {"y": np.zeros((2, 4), np.float32)}  # two rows for a one-row request
        with pytest.raises(trioinfer.PluginContractError, match=r"shape \[2, 4\] for a batch"):
            await engine.infer("m", {"x": X})
        fallback.answer = {"y": np.zeros((1, 4), np.float32)}
        out = await engine.infer("m", {"x": X})
    assert str(caught.value) == (
        "fallback 'default' of model 'm' answered request 'r1' of model 'm' (default) with "
        "output 'y' "
        "with dtype float64; its signature declares float32[batch, 4] (the engine does not "
        "convert outputs: clients are told the declared dtype)"
    )
    assert status_for(caught.value) == 500
    assert out["y"].dtype == np.float32


def _repository(root: Path) -> Path:
    source = trioinfer.example_repository() / "digits"
    shutil.copytree(source, root / "digits")
    (root / "digits" / "config.toml").write_text('name = "digits"\nscheduler = "breaks"\n')
    shutil.copytree(source, root / "small")
    (root / "small" / "config.toml").write_text('name = "small"\n')
    return root


async def test_over_http_the_server_stays_up_and_answers_500(tmp_path: Path) -> None:
    from trioinfer_onnxruntime import OnnxRuntimeBackend

    scheduler = Breaks()
    scheduler.pop_raises = True
    plugins = trioinfer.Registry(
        extra={
            "backends": {"onnxruntime": OnnxRuntimeBackend},
            "schedulers": {"breaks": lambda: scheduler},
        }
    )
    images, _ = trioinfer.digits_samples()
    body = {
        "inputs": [
            {
                "name": "input",
                "datatype": "FP32",
                "shape": [1, 64],
                "data": [float(v) for v in images[0].ravel()],
            }
        ]
    }
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            stop = trio.Event()
            listening: Listening = await start_serving(
                nursery, _repository(tmp_path), registry=plugins, shutdown=stop
            )
            async with httpx.AsyncClient(base_url=listening.urls[0]) as client:
                response = await client.post("/v2/models/digits/infer", json=body)
                assert response.status_code == 500
                assert "scheduler 'breaks' of model 'digits" in response.json()["error"]
                assert "RuntimeError in pop()" in response.json()["error"]
                response = await client.post("/v2/models/digits/infer", json=body)
                assert response.status_code == 500
                assert "out of service" in response.json()["error"]
                response = await client.post("/v2/models/small/infer", json=body)
                assert response.status_code == 200
                # The model is loaded but not ready; the server and its other models are.
                response = await client.get("/v2/models/digits/ready")
                assert response.status_code == 400
                assert "is not ready: scheduler 'breaks'" in response.json()["error"]
                assert (await client.get("/v2/models/small/ready")).status_code == 200
                assert (await client.get("/v2/health/ready")).status_code == 200
                assert (await client.get("/v2/health/live")).status_code == 200
            stop.set()


@pytest.mark.python_model
async def test_an_http_500_is_logged_and_a_python_models_traceback_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The server reference says a 500 is logged at ERROR: gRPC and the other endpoints did,
    # the HTTP infer path did not, so a newcomer's failing model left the log silent.
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "config.toml").write_text(
        'backend = "python"\n[backend_options]\n'
        'inputs = [{ name = "x", dtype = "float32", shape = ["batch", 4] }]\n'
        'outputs = [{ name = "y", dtype = "float32", shape = ["batch", 4] }]\n'
    )
    (tmp_path / "m" / "1" / "model.py").write_text(
        'class Model:\n    def infer(self, inputs):\n        return {"y": inputs["X"]}\n'
    )
    caplog.set_level(logging.ERROR)
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            listening: Listening = await start_serving(nursery, tmp_path)
            async with httpx.AsyncClient(base_url=listening.urls[0]) as client:
                for _ in range(2):
                    response = await client.post("/v2/models/m/infer", json=body)
                    assert response.status_code == 500
                    assert response.json()["error"] == (
                        "model 'm' (version 1) instance 0: infer raised KeyError: 'X' "
                        "(model.py, line 3, in infer)"
                    )
            nursery.cancel_scope.cancel()
    failed = [r for r in caplog.records if r.getMessage().startswith("request failed: ")]
    assert [r.name for r in failed] == ["trioinfer.server"] * 2
    [traceback] = [r for r in caplog.records if r.exc_info is not None]
    assert traceback.name == "trioinfer.python"


async def test_closing_past_an_execute_that_ignores_cancellation_says_which_instance(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine cannot abandon the task, but it no longer waits mute: the log names it."""

    class Deaf:
        signature = FakeBackend().signature
        device = "cpu"

        async def execute(self, inputs: Any) -> Any:
            with trio.CancelScope(shield=True):  # the mistake under test
                await trio.sleep(100)
            return {"y": 2 * inputs["x"]}

        async def aclose(self) -> None:
            pass

    class DeafBackend:
        async def load(self, config: ModelConfig, placement: Any) -> Deaf:
            return Deaf()

    reg = trioinfer.Registry(extra={"backends": {"fake": DeafBackend}})
    start = trio.current_time()
    async with open_engine(registry=reg, drain_period=0) as engine:
        await engine.load(config())
        with trio.move_on_after(1):
            await engine.infer("m", {"x": X})
    assert trio.current_time() - start >= 100  # it did wait: nothing abandons a task
    [record] = errors(caplog)
    assert "model 'm': stopping it has waited 10.0s for instance 0 (cpu)" in record.getMessage()
    assert "must let Cancelled propagate" in record.getMessage()


@pytest.mark.parametrize("path", ["alone", "inline"])
async def test_a_mapping_of_the_declared_outputs_that_is_no_dict_still_answers(path: str) -> None:
    """The names check looks at a dict's keys at once; any other mapping is judged by its
    names, not refused for its class."""
    import types

    make = lambda i: types.MappingProxyType({"y": i["x"] * 2})  # noqa: E731
    backend: Any = FakeBackend(make)
    if path == "inline":

        class Inline:
            async def load(self, config: ModelConfig, placement: Any) -> _InlineOutputs:
                return _InlineOutputs(make)

        backend = Inline()
    reg = trioinfer.Registry(extra={"backends": {"fake": lambda: backend}})
    async with open_engine(registry=reg) as engine:
        await engine.load(config(batcher="none"))
        out = await engine.infer("m", {"x": X})
        np.testing.assert_array_equal(out["y"], X * 2)


async def test_a_backend_whose_load_is_not_async_fails_the_load_naming_the_contract() -> None:
    """A plain ``def load()`` failed with "object ... can't be used in 'await' expression",
    and the instance it had made was never closed."""
    made: list[_InlineOutputs] = []
    closed: list[object] = []

    class Closing(_InlineOutputs):
        async def aclose(self) -> None:
            closed.append(self)

    class Plain:
        def load(self, config: ModelConfig, placement: Any) -> _InlineOutputs:
            made.append(Closing(lambda i: {"y": i["x"]}))
            return made[-1]

    reg = trioinfer.Registry(extra={"backends": {"plain": lambda: Plain()}})
    async with open_engine(registry=reg) as engine:
        with pytest.raises(trioinfer.PluginContractError) as caught:
            await engine.load(
                ModelConfig(
                    name="m",
                    path="unused.onnx",
                    backend="plain",
                    instances=[trioinfer.Instance("cpu", count=2)],
                )
            )
        assert (caught.value.kind, caught.value.plugin) == ("backends", "plain")
        assert "its load() returned a 'Closing' object" in str(caught.value)
        assert "load() is an async def" in str(caught.value)
        assert engine.models() == []
    assert len(made) == 2
    assert sorted(map(id, closed)) == sorted(map(id, made))  # none leaked


@pytest.mark.parametrize("budget", [math.inf, math.nan, -1.0, 0, True, "0.001"])
def test_an_inline_budget_that_is_no_positive_finite_number_counts_as_none(budget: object) -> None:
    # A third-party instance's inf (or nan) never yielded: callers looping on it kept
    # every other task waiting. It gets the engine's slice, as one without a budget.
    from types import SimpleNamespace

    from trioinfer._runner import DEFAULT_SLICE_S, inline_budget

    replica = SimpleNamespace(_backend_instance=SimpleNamespace(inline_budget_s=budget))
    assert inline_budget(replica) == DEFAULT_SLICE_S  # type: ignore[arg-type]
    replica._backend_instance.inline_budget_s = 0.002
    assert inline_budget(replica) == 0.002  # type: ignore[arg-type]


async def test_a_batcher_that_returns_a_request_in_a_later_batch_is_blamed(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    # Its contract: each request of a batch taken during that call; a request taken
    # and left out goes back before the call returns. One held over and returned in
    # a later batch broke it, as one returned twice does: a PluginContractError
    # naming the batcher, not a run that hides the batcher's miscount.
    class Hoards:
        def __init__(self) -> None:
            self.hoard = False  # take two, return the first, keep the second for later
            self.kept: list[Request] = []

        async def next_batch(self, queue: RequestQueue) -> list[Request]:
            if self.kept:
                kept, self.kept = self.kept, []
                return kept
            while True:
                await queue.wait_not_empty()
                try:
                    request = queue.pop_nowait()
                except anyio.WouldBlock:
                    continue
                if self.hoard:
                    self.hoard = False
                    await queue.wait_not_empty()
                    self.kept = [queue.pop_nowait()]
                return [request]

    backend = FakeBackend()
    batcher = Hoards()
    with trio.fail_after(60):
        async with open_engine(
            registry=registry(backend, batchers={"hoards": lambda: batcher})
        ) as e:
            await e.load(config(batcher="hoards"))
            batcher.hoard = True
            results: list[BaseException | None] = []

            async def call() -> None:
                results.append(await outcome(e, "m"))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(call)
                nursery.start_soon(call)
            # One ran in the batch it was taken in; the kept one failed. Which ends
            # first depends on when the runner asks for the next batch: not on order.
            assert results.count(None) == 1, results
            (error,) = [r for r in results if r is not None]
            assert isinstance(error, trioinfer.PluginContractError), results
            assert (error.kind, error.plugin) == ("batchers", "hoards")
            assert str(error).startswith("batcher 'hoards' of model 'm' broke its contract: ")
            assert "in a later batch than the one it was taken in" in str(error)
            assert status_for(error) == 500
            assert len(backend.executions) == 1  # the kept one never ran
            assert [r.getMessage() for r in errors(caplog)] == [str(error)]
            # One broken batch: the model goes on.
            assert await outcome(e, "m") is None
            stats = e.statistics().models["m"]
            assert (stats.succeeded, stats.failed) == (2, 1)


async def test_a_batcher_that_mixes_requests_that_send_different_inputs_is_blamed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # b is optional: one request sends it, one does not. Their inputs cannot be
    # concatenated (no rows to give b for the one that left it out); a batcher that puts
    # them together fails that batch, and the model goes on.
    class Greedy:
        async def next_batch(self, queue: RequestQueue) -> list[Request]:
            while len(queue) < 2:
                await queue.wait_not_empty()
                await trio.sleep(1)
            return [queue.pop_nowait(), queue.pop_nowait()]

    signature = trioinfer.ModelSignature.declared(
        [
            {"name": "x", "dtype": "float32", "shape": ["batch", 4]},
            {"name": "b", "dtype": "float32", "shape": ["batch", 4], "optional": True},
        ],
        [{"name": "y", "dtype": "float32", "shape": ["batch", 4]}],
        model="m",
    )
    backend = FakeBackend(lambda inputs: {"y": inputs["x"] * 2}, signature=signature)
    with trio.fail_after(60):
        async with open_engine(registry=registry(backend, batchers={"greedy": Greedy})) as e:
            await e.load(config(batcher="greedy"))
            outcomes: list[BaseException | None] = []

            async def one(inputs: dict[str, np.ndarray]) -> None:
                try:
                    await e.infer("m", inputs)
                except trioinfer.TrioInferError as exc:
                    outcomes.append(exc)
                else:
                    outcomes.append(None)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, {"x": X})
                nursery.start_soon(one, {"x": X, "b": X})
            assert len(outcomes) == 2
            for error in outcomes:
                assert isinstance(error, trioinfer.PluginContractError)
                assert "send different inputs (['b', 'x'] and ['x'])" in str(error)
            # It goes on: two requests that send the same inputs share a batch.
            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, {"x": X})
                nursery.start_soon(one, {"x": X})
            assert outcomes[2:] == [None, None]
            assert backend.executions == [2]
