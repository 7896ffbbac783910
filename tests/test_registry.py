"""The plugin registry: entry points found without importing, loaded on first use."""

from __future__ import annotations

import importlib.metadata
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from trioinfer import (
    BackendError,
    ConfigError,
    ModelConfig,
    PluginContractError,
    PluginError,
    PluginLoadError,
    Registry,
    open_engine,
)
from trioinfer.lowlevel import Request
from trioinfer.testing import check_scheduler
from trioinfer_batching import NoBatcher
from trioinfer_fallback import NoFallback
from trioinfer_onnxruntime import OnnxRuntimeBackend
from trioinfer_scheduling import FifoScheduler


@pytest.fixture
def third_party(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An installed distribution 'acme-trioinfer' that declares plugins, one of them broken."""
    (tmp_path / "acme_plugins.py").write_text(
        textwrap.dedent(
            """
            from collections import OrderedDict

            IMPORTED = True

            class LifoScheduler:
                def __init__(self, *, limit=10):
                    if limit < 0:
                        raise ValueError("limit must be >= 0")
                    self.limit = limit
                    self._items = OrderedDict()
                def push(self, request):
                    self._items[request] = None
                def peek(self):
                    if not self._items:
                        raise IndexError("empty")
                    return next(reversed(self._items))
                def pop(self):
                    if not self._items:
                        raise IndexError("empty")
                    return self._items.popitem(last=True)[0]
                def remove(self, request):
                    return self._items.pop(request, False) is None
                def __len__(self):
                    return len(self._items)

            NOT_CALLABLE = 42

            class PushRaises(LifoScheduler):
                def push(self, request):
                    raise RuntimeError("heap out of order")

            class AnswersBadly:
                async def execute(self, execution):
                    for request in execution.pending():
                        execution.respond(request, {}, via="default")

            def not_a_scheduler(**options):
                return {"options": options}

            class NoSignature:
                # Its instances have no signature: no trioinfer.abc.BackendInstance.
                async def load(self, config, placement):
                    return NoSignature.Instance()

                class Instance:
                    device = "cpu"
                    async def execute(self, inputs):
                        return {}
                    async def aclose(self):
                        pass

            class SyncLoad:
                def load(self, config, placement):
                    return None

            class Doubles:
                # Returns each request twice in its batch, which its contract forbids.
                async def next_batch(self, queue):
                    from anyio import WouldBlock
                    while True:
                        await queue.wait_not_empty()
                        try:
                            request = queue.pop_nowait()
                        except WouldBlock:
                            continue
                        return [request, request]

            class LoadsOnce:
                # Its first load works (a FakeBackend's), its next fails: a re-creation.
                def __init__(self):
                    from trioinfer.testing import FakeBackend
                    self.inner, self.loads = FakeBackend(), 0
                async def load(self, config, placement):
                    self.loads += 1
                    if self.loads > 1:
                        raise OSError("device lost")
                    return await self.inner.load(config, placement)

            class LoadsJunk(LoadsOnce):
                # Its first load works, its next returns what is no instance: a
                # re-creation gets no check of it at load.
                def __init__(self, junk):
                    super().__init__()
                    self.junk = junk
                async def load(self, config, placement):
                    self.loads += 1
                    if self.loads > 1:
                        return self.junk
                    return await self.inner.load(config, placement)

            class LoadFails:
                async def load(self, config, placement):
                    raise OSError("libacme.so: cannot open shared object file")
            """
        )
    )
    (tmp_path / "acme_broken.py").write_text("raise ImportError('needs libacme.so')\n")
    info = tmp_path / "acme_trioinfer-1.2.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-trioinfer\nVersion: 1.2\n")
    (info / "entry_points.txt").write_text(
        "[trioinfer.schedulers]\nlifo = acme_plugins:LifoScheduler\n"
        "notsched = acme_plugins:not_a_scheduler\n"
        "number = acme_plugins:NOT_CALLABLE\n"
        "pushraises = acme_plugins:PushRaises\n\n"
        "[trioinfer.fallbacks]\nbadly = acme_plugins:AnswersBadly\n\n"
        "[trioinfer.batchers]\ndoubles = acme_plugins:Doubles\n\n"
        "[trioinfer.backends]\nacme = acme_broken:Backend\n"
        "nosignature = acme_plugins:NoSignature\nsyncload = acme_plugins:SyncLoad\n"
        "loadfails = acme_plugins:LoadFails\nloadsonce = acme_plugins:LoadsOnce\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("acme_plugins", None)


def test_first_party_plugins_are_found_through_entry_points() -> None:
    registry = Registry()
    assert registry.load("backends", "onnxruntime") is OnnxRuntimeBackend
    assert registry.load("schedulers", "fifo") is FifoScheduler
    assert registry.load("batchers", "none") is NoBatcher
    assert registry.load("fallbacks", "none") is NoFallback
    info = next(p for p in registry.plugins("backends") if p.name == "onnxruntime")
    assert info.target == "trioinfer_onnxruntime:OnnxRuntimeBackend"
    assert info.distribution is not None
    assert info.distribution.startswith("trioinfer ")


def test_third_party_plugin_is_found_without_importing(third_party: Path) -> None:
    registry = Registry()
    names = {(p.kind, p.name, p.distribution) for p in registry.plugins()}
    assert ("schedulers", "lifo", "acme-trioinfer 1.2") in names
    assert "acme_plugins" not in sys.modules  # listed from metadata only
    scheduler = registry.create("schedulers", "lifo", {"limit": 3})
    assert scheduler.limit == 3
    assert "acme_plugins" in sys.modules


def test_broken_plugin_is_reported_and_does_not_break_others(third_party: Path) -> None:
    registry = Registry()
    with pytest.raises(
        PluginLoadError, match=r"from acme-trioinfer 1\.2.*needs libacme\.so"
    ) as info:
        registry.load("backends", "acme")
    assert (info.value.group, info.value.name) == ("trioinfer.backends", "acme")
    assert info.value.distribution == "acme-trioinfer 1.2"
    assert registry.load("backends", "onnxruntime") is OnnxRuntimeBackend
    broken = next(p for p in registry.plugins("backends") if p.name == "acme")
    assert "ImportError" in str(registry.check(broken))
    ok = next(p for p in registry.plugins("backends") if p.name == "onnxruntime")
    assert registry.check(ok) is None
    # A class that lacks its contract's method is not "ok" either: no model could use it.
    registry = Registry(extra={"backends": {"noload": FifoScheduler}})
    noload = next(p for p in registry.plugins("backends") if p.name == "noload")
    assert registry.check(noload) == (
        "backend plugin 'noload' does not implement trioinfer.abc.Backend: "
        "FifoScheduler lacks load()"
    )
    # Every first-party plugin passes.
    first_party = [p for p in Registry().plugins() if str(p.distribution).startswith("trioinfer ")]
    assert len(first_party) >= 12
    assert [p.name for p in first_party if Registry().check(p)] == []


def test_a_constructor_error_names_the_plugins_distribution(third_party: Path) -> None:
    # An operator told that a model cannot load with a plugin's options must be able
    # to tell which installed package that plugin came from.
    registry = Registry()
    with pytest.raises(PluginLoadError, match=r"does not accept options \['depth'\]") as info:
        registry.create("schedulers", "lifo", {"depth": 3})
    assert info.value.distribution == "acme-trioinfer 1.2"
    with pytest.raises(
        PluginLoadError,
        match=r"'lifo' \(from acme-trioinfer 1\.2\) failed to start .*ValueError: limit must",
    ) as info:
        registry.create("schedulers", "lifo", {"limit": -1})
    assert info.value.distribution == "acme-trioinfer 1.2"
    local = Registry(extra={"schedulers": {"lifo": _Refuses}})
    with pytest.raises(PluginLoadError, match=r"'lifo' failed to start") as info:
        local.create("schedulers", "lifo", {})
    assert info.value.distribution is None  # in-process: it shadows the entry point


class _Refuses:
    def __init__(self) -> None:
        raise ValueError("no")


def test_a_plugin_that_loads_may_say_what_it_lacks() -> None:
    class Lacking:
        @staticmethod
        def missing_requirements() -> str | None:
            return "libfoo is not installed: pip install foo"

    class Broken:
        @staticmethod
        def missing_requirements() -> str | None:
            raise RuntimeError("cannot tell")

    class Whole:
        @staticmethod
        def missing_requirements() -> str | None:
            return None

    registry = Registry(
        extra={"backends": {"lacking": Lacking, "broken": Broken, "whole": Whole, "plain": object}}
    )
    said = {p.name: registry.missing(p) for p in registry.plugins("backends")}
    assert said["lacking"] == "libfoo is not installed: pip install foo"
    assert said["broken"] == (
        "backend plugin 'broken': missing_requirements() raised RuntimeError: cannot tell"
    )
    assert said["whole"] is None
    assert said["plain"] is None  # a plugin without the hook lacks nothing it can tell
    # What a plugin lacks to run is no load error (these test doubles lack load() itself).
    installed = [p for p in registry.plugins("backends") if p.distribution]
    assert installed
    assert all(registry.check(p) is None for p in installed)


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(
        PluginError,
        match=(
            "no scheduler plugin named 'edf'; "
            "known schedulers: 'deadline', 'fair', 'fifo', 'priority'"
        ),
    ):
        Registry().load("schedulers", "edf")
    # A misspelt name, the usual cause, is pointed at the near one.
    with pytest.raises(PluginError, match=r"known schedulers: .*; did you mean 'fifo'\?$"):
        Registry().load("schedulers", "fifp")
    with pytest.raises(PluginError, match=r"'priority'$"):  # nothing near: no guess
        Registry().load("schedulers", "edf")
    # A package that declares it in a misspelt group: found nowhere, and said so.
    stray = importlib.metadata.EntryPoint("lifo", "acme:Lifo", "trioinfer.scheduler")
    with pytest.raises(PluginError) as caught:
        Registry(entry_points=[stray]).load("schedulers", "lifo")
    assert str(caught.value) == (
        "no scheduler plugin named 'lifo'; known schedulers: none; a distribution declares "
        "'lifo' in the entry-point group 'trioinfer.scheduler', which trioinfer does not "
        "read: the group is 'trioinfer.schedulers'"
    )
    with pytest.raises(PluginError, match="unknown plugin kind 'widgets'"):
        Registry().load("widgets", "x")  # type: ignore[arg-type]


def test_options_a_plugin_refuses_are_reported() -> None:
    with pytest.raises(PluginLoadError, match=r"does not accept options \['depth'\]"):
        Registry().create("schedulers", "fifo", {"depth": 3})


def test_a_refused_option_is_named_with_the_ones_the_plugin_takes() -> None:
    # DynamicBatcher's __new__ takes **options; its __init__ says what it takes.
    with pytest.raises(PluginLoadError) as caught:
        Registry().create("batchers", "dynamic", {"max_batch": 8, "max_queue_delay": 0.001})
    assert str(caught.value) == (
        "batcher plugin 'dynamic' does not accept options ['max_batch']; it takes: mask_input, "
        "max_batch_size, max_queue_delay, pad_axis, pad_buckets, pad_inputs, pad_value, "
        "pad_values, preferred_batch_sizes, ragged_outputs; "
        "did you mean 'max_batch_size' for 'max_batch'?"
    )
    with pytest.raises(PluginLoadError, match=r"\['depth'\]; it takes: none$"):
        Registry().create("schedulers", "fifo", {"depth": 3})


def test_a_plugin_without_named_options_is_reported_by_its_own_error() -> None:
    def takes_anything(**options: object) -> object:
        raise TypeError(f"no use for {sorted(options)}")

    def strict(*, size: int) -> object:
        raise TypeError(f"size must be an int, got {size!r}")

    registry = Registry(entry_points=[])
    registry._loaded["schedulers", "loose"] = takes_anything
    registry._loaded["schedulers", "strict"] = strict
    with pytest.raises(PluginLoadError, match=r"options \['x'\]: no use for \['x'\]$"):
        registry.create("schedulers", "loose", {"x": 1})
    # Every name is known: the value was refused, and the plugin's own words say why.
    with pytest.raises(PluginLoadError, match=r"refused its options \['size'\]: size must be"):
        registry.create("schedulers", "strict", {"size": "8"})
    # A required one is missing: named, with where to set it (Python's own TypeError
    # said "__init__() missing 1 required keyword-only argument", no word of options).
    with pytest.raises(PluginLoadError) as caught:
        registry.create("schedulers", "strict")
    assert str(caught.value) == (
        "scheduler plugin 'strict' needs options ['size'], which the model's "
        "scheduler_options do not set (it takes: size)"
    )


def test_a_plugin_that_raises_as_it_is_created_fails_with_plugin_load_error() -> None:
    """A ValueError for an option's value, or a plugin's own bug, escaped Engine.load bare."""

    def picky(*, max_batch_size: int = 2) -> object:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")

    def buggy() -> object:
        return {}["nope"]

    def says_so(*, size: int = 1) -> object:
        raise ConfigError(f"size {size} is too big for this scheduler")

    registry = Registry(entry_points=[])
    registry._loaded["batchers", "picky"] = picky
    registry._loaded["schedulers", "buggy"] = buggy
    registry._loaded["schedulers", "says-so"] = says_so
    with pytest.raises(PluginLoadError) as caught:
        registry.create("batchers", "picky", {"max_batch_size": 0})
    assert str(caught.value) == (
        "batcher plugin 'picky' failed to start with options {'max_batch_size': 0}: "
        "ValueError: max_batch_size must be >= 1, got 0"
    )
    assert isinstance(caught.value, ConfigError)
    assert isinstance(caught.value.__cause__, ValueError)
    with pytest.raises(
        PluginLoadError, match=r"'buggy' failed to start with options \{\}: KeyError"
    ):
        registry.create("schedulers", "buggy", {})
    # A backend is created with no options at all: none are named.
    registry._loaded["backends", "buggy"] = buggy
    with pytest.raises(PluginLoadError, match=r"^backend plugin 'buggy' failed to start: KeyError"):
        registry.create("backends", "buggy")
    # A TrioInferError is the plugin's own word: it passes as it is.
    with pytest.raises(ConfigError, match=r"^size 9 is too big") as refused:
        registry.create("schedulers", "says-so", {"size": 9})
    assert not isinstance(refused.value, PluginLoadError)


async def test_engine_uses_a_third_party_scheduler(third_party: Path, add_model: Path) -> None:
    async with open_engine() as engine:
        await engine.load(ModelConfig(name="add", path=add_model, scheduler="lifo"))
        x = np.ones((1, 4), np.float32)
        out = await engine.infer("add", {"a": x, "b": x})
        assert out["sum"][0, 0] == 2


async def test_a_third_party_plugin_of_the_wrong_type_names_its_distribution(
    third_party: Path, add_model: Path
) -> None:
    # The operator reading "does not implement" must learn which package to blame.
    async with open_engine() as engine:
        with pytest.raises(
            PluginContractError,
            match=r"^scheduler 'notsched' \(from acme-trioinfer 1\.2\) of model 'add' does not "
            r"implement trioinfer\.abc\.Scheduler: got dict, which lacks peek\(\), push\(\), "
            r"remove\(\)$",
        ) as info:
            await engine.load(ModelConfig(name="add", path=add_model, scheduler="notsched"))
        assert (info.value.kind, info.value.plugin) == ("schedulers", "notsched")


def test_an_entry_point_to_something_not_callable_names_its_distribution(
    third_party: Path,
) -> None:
    with pytest.raises(
        PluginLoadError,
        match=r"^scheduler plugin 'number' \(from acme-trioinfer 1\.2\) cannot be created: its "
        r"entry point names 42, which is not callable",
    ) as info:
        Registry().create("schedulers", "number")
    assert info.value.distribution == "acme-trioinfer 1.2"
    assert (info.value.group, info.value.name) == ("trioinfer.schedulers", "number")
    # `trioinfer plugins` says so too, rather than "ok" for a plugin no model can use.
    registry = Registry()
    number = next(p for p in registry.plugins("schedulers") if p.name == "number")
    assert "which is not callable" in str(registry.check(number))


async def test_a_third_party_plugin_breaking_its_contract_at_run_time_names_its_distribution(
    third_party: Path, add_model: Path
) -> None:
    async with open_engine() as engine:
        await engine.load(ModelConfig(name="add", path=add_model, scheduler="pushraises"))
        x = np.ones((1, 4), np.float32)
        with pytest.raises(
            PluginContractError,
            match=r"^scheduler 'pushraises' \(from acme-trioinfer 1\.2\) of model 'add' broke "
            r"its contract: raised RuntimeError in push\(\): heap out of order",
        ):
            await engine.infer("add", {"a": x, "b": x})
        await engine.load(ModelConfig(name="add2", path=add_model, fallback="badly"))
        with pytest.raises(
            PluginContractError,
            match=r"^fallback 'badly' \(from acme-trioinfer 1\.2\) of model 'add2' answered "
            r"request .* without outputs \['sum', 'diff'\]",
        ):
            await engine.infer("add2", {"a": x, "b": x})
        await engine.load(ModelConfig(name="add3", path=add_model, batcher="doubles"))
        with pytest.raises(
            PluginContractError,
            match=r"^batcher 'doubles' \(from acme-trioinfer 1\.2\) of model 'add3' broke its "
            r"contract: returned request .* twice in one batch",
        ):
            await engine.infer("add3", {"a": x, "b": x})


@pytest.mark.parametrize(
    ("backend", "error", "said"),
    [
        (
            "nosignature",
            PluginContractError,
            r"^backend 'nosignature' \(from acme-trioinfer 1\.2\) broke its contract: load\(\) "
            r"of instance 0 of model 'add' returned a 'Instance' object, not a "
            r"trioinfer\.abc\.BackendInstance",
        ),
        (
            "syncload",
            PluginContractError,
            r"^backend 'syncload' \(from acme-trioinfer 1\.2\) broke its contract: its load\(\) "
            r"returned a 'NoneType' object for instance 0 of model 'add' instead of an awaitable",
        ),
        (
            "loadfails",
            BackendError,
            r"^backend 'loadfails' \(from acme-trioinfer 1\.2\) could not load instance 0 of "
            r"model 'add': OSError: libacme\.so",
        ),
    ],
)
async def test_a_third_party_backend_failing_at_load_names_its_distribution(
    third_party: Path, add_model: Path, backend: str, error: type[Exception], said: str
) -> None:
    # Its load errors named the backend alone, while its schedulers' and fallbacks'
    # named the package too: the operator must know which installed package to tell.
    async with open_engine() as engine:
        with pytest.raises(error, match=said) as info:
            await engine.load(ModelConfig(name="add", path=add_model, backend=backend))
        if isinstance(info.value, PluginContractError):
            assert (info.value.kind, info.value.plugin) == ("backends", backend)
        assert engine.models() == []


async def test_a_third_party_backend_failing_to_re_create_an_instance_names_its_distribution(
    third_party: Path, add_model: Path
) -> None:
    async with open_engine() as engine:
        await engine.load(ModelConfig(name="add", path=add_model, backend="loadsonce"))
        runner = engine._runners["add"]
        with pytest.raises(
            BackendError,
            match=r"^backend 'loadsonce' \(from acme-trioinfer 1\.2\) could not re-create "
            r"instance 0 \(cpu\) of model 'add': OSError: device lost$",
        ):
            await runner.recreate(runner.replicas[0])


@pytest.mark.parametrize(
    ("junk", "said"),
    [
        (
            "{'signature': None}",
            r"a 'dict' object, not a trioinfer\.abc\.BackendInstance \(.*\): "
            r"it lacks aclose\(\), device, execute\(\), signature",
        ),
        (
            "NoSignature.Instance()",
            r"a 'Instance' object, not a trioinfer\.abc\.BackendInstance \(.*\): "
            r"it lacks signature$",
        ),
        (
            "LoadsJunk.Sigless()",
            r"an instance whose signature is a 'NoneType' object, not a trioinfer\.ModelSignature",
        ),
    ],
)
async def test_a_re_created_instance_gets_the_check_a_loaded_one_does(
    third_party: Path, add_model: Path, monkeypatch: pytest.MonkeyPatch, junk: str, said: str
) -> None:
    # A backend whose load() returns no instance when the circuit breaker re-creates
    # one was not caught there (an AttributeError, or a dict served as an instance),
    # while the same answer at load is the backend's broken contract.
    import acme_plugins

    class Sigless:
        signature = None
        device = "cpu"
        closed = False

        async def execute(self, inputs: object) -> dict[str, object]:
            return {}

        async def aclose(self) -> None:
            Sigless.closed = True

    monkeypatch.setattr(acme_plugins.LoadsJunk, "Sigless", Sigless, raising=False)
    made = eval(junk, vars(acme_plugins))
    registry = Registry(extra={"backends": {"loadsjunk": lambda: acme_plugins.LoadsJunk(made)}})
    async with open_engine(registry=registry) as engine:
        await engine.load(ModelConfig(name="add", path=add_model, backend="loadsjunk"))
        runner = engine._runners["add"]
        with pytest.raises(
            PluginContractError,
            match=r"^backend 'loadsjunk' broke its contract: load\(\), re-creating instance 0 "
            r"\(cpu\) of model 'add', returned " + said,
        ) as info:
            await runner.recreate(runner.replicas[0])
        assert (info.value.kind, info.value.plugin) == ("backends", "loadsjunk")
        assert runner.replicas[0].recreated == 0
        if isinstance(made, Sigless):
            assert Sigless.closed  # an instance refused is closed, as at load


async def test_engine_reports_unknown_plugins_at_load(add_model: Path) -> None:
    async with open_engine() as engine:
        with pytest.raises(PluginError, match="no batcher plugin named 'adaptive'"):
            await engine.load(ModelConfig(name="add", path=add_model, batcher="adaptive"))


async def test_a_plugin_that_is_not_a_scheduler_is_refused(add_model: Path) -> None:
    class NoRemove(FifoScheduler):
        remove = None  # type: ignore[assignment]

    registry = Registry(extra={"schedulers": {"bad": object, "noremove": NoRemove}})
    async with open_engine(registry=registry) as engine:
        with pytest.raises(
            PluginContractError,
            match=r"does not implement trioinfer\.abc\.Scheduler: got object, which lacks "
            r"__len__\(\), peek\(\), pop\(\), push\(\), remove\(\)$",
        ):
            await engine.load(ModelConfig(name="add", path=add_model, scheduler="bad"))
        # Its author learns which method to add, not only that one is missing.
        with pytest.raises(PluginContractError, match=r"got NoRemove, which lacks remove\(\)$"):
            await engine.load(ModelConfig(name="add", path=add_model, scheduler="noremove"))


def test_fifo_passes_the_scheduler_conformance_check() -> None:
    check_scheduler(FifoScheduler)


def test_conformance_check_catches_a_broken_scheduler() -> None:
    class DropsRemoved:
        def __init__(self) -> None:
            self.inner = FifoScheduler()

        def push(self, request: Request) -> None:
            self.inner.push(request)

        def peek(self) -> Request:
            return self.inner.peek()

        def pop(self) -> Request:
            return self.inner.pop()

        def remove(self, request: Request) -> bool:
            return True  # claims to remove, but keeps it

        def __len__(self) -> int:
            return len(self.inner)

    with pytest.raises(AssertionError, match="remove"):
        check_scheduler(DropsRemoved)
