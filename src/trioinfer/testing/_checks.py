"""Conformance checks for plugins: run them against your plugin in your own tests."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from typing import Any

import anyio
import numpy as np

from .._config import Device, Instance, ModelConfig, Placement
from .._exceptions import BackendError, TrioInferError
from .._request import Request
from .._tensors import ModelSignature
from .._tensors import rows as _rows
from ..abc import Backend, BackendInstance, Fallback, Scheduler

_arrivals = itertools.count()


def make_request(
    *,
    model: str = "model",
    inputs: Mapping[str, np.ndarray[Any, Any]] | None = None,
    priority: int = 0,
    tenant: str | None = None,
    deadline: float = math.inf,
    arrival: float | None = None,
    rows: int = 1,
) -> Request:
    """A [`Request`][trioinfer.Request] for scheduler and batcher tests.

    Without *arrival*, each request arrives one tick after the previous one.
    """
    return Request(
        model,
        inputs if inputs is not None else {},
        priority=priority,
        tenant=tenant,
        deadline=deadline,
        arrival=float(next(_arrivals)) if arrival is None else arrival,
        rows=rows,
    )


def _fail(what: str) -> None:
    raise AssertionError(what)


def check_scheduler(make_scheduler: Callable[[], Scheduler]) -> None:
    """Check that a scheduler keeps the [`Scheduler`][trioinfer.abc.Scheduler] contract.

    Checks that an empty scheduler pops and peeks ``IndexError``; that `peek()`
    shows what `pop()` takes next; that every pushed
    request is popped exactly once; that requests alike in priority, tenant
    and deadline come out in arrival order; that ``remove`` takes a request out
    once (returning ``True``, then ``False``) and that a removed request is
    never popped; and that ``len`` follows along.

    Args:
        make_scheduler: Returns a new, empty scheduler on each call.

    Raises:
        AssertionError: Saying which part of the contract was broken.
    """
    scheduler = make_scheduler()
    if len(scheduler) != 0:
        _fail(f"a new scheduler has len {len(scheduler)}, expected 0")
    try:
        scheduler.pop()
    except IndexError:
        pass
    else:
        _fail("pop() on an empty scheduler returned instead of raising IndexError")
    try:
        scheduler.peek()
    except IndexError:
        pass
    else:
        _fail("peek() on an empty scheduler returned instead of raising IndexError")
    if scheduler.remove(make_request()) is not False:
        _fail("remove() of a request never pushed did not return False")

    # Alike requests come out first in, first out.
    alike = [make_request(priority=1, tenant="t", deadline=100.0) for _ in range(50)]
    for i, request in enumerate(alike):
        scheduler.push(request)
        if len(scheduler) != i + 1:
            _fail(f"len is {len(scheduler)} after {i + 1} pushes")
    popped = [scheduler.pop() for _ in alike]
    if popped != alike:
        _fail("requests alike in priority, tenant and deadline did not come out in arrival order")
    if len(scheduler) != 0:
        _fail(f"len is {len(scheduler)} after popping everything")

    # Mixed requests: each comes out exactly once; removed ones never.
    mixed = [
        make_request(
            priority=i % 3,
            tenant=("a", "b", None)[i % 3],
            deadline=math.inf if i % 4 == 0 else float(1000 - i),
        )
        for i in range(60)
    ]
    for request in mixed:
        scheduler.push(request)
    removed = mixed[::5]
    for request in removed:
        if scheduler.remove(request) is not True:
            _fail("remove() of a held request did not return True")
        if scheduler.remove(request) is not False:
            _fail("remove() of an already removed request did not return False")
    if len(scheduler) != len(mixed) - len(removed):
        _fail(f"len is {len(scheduler)}, expected {len(mixed) - len(removed)} after removals")
    out = []
    while len(scheduler):
        head = scheduler.peek()
        taken = scheduler.pop()
        if taken is not head:
            _fail("pop() returned a different request from the one peek() had just returned")
        out.append(taken)
    if len(out) != len(set(out)):
        _fail("a request was popped more than once")
    expected = set(mixed) - set(removed)
    if set(out) != expected:
        _fail(
            f"popped {len(set(out) & expected)} of {len(expected)} held requests "
            f"and {len(set(out) - expected)} that were removed or never pushed"
        )


async def check_backend(
    backend: Backend,
    config: ModelConfig,
    inputs: Mapping[str, np.ndarray[Any, Any]],
    *,
    placement: Placement | None = None,
) -> None:
    """Check that a backend keeps the [`Backend`][trioinfer.abc.Backend] contract.

    Loads one instance and checks its signature; that ``execute`` returns every
    declared output with the declared dtype, rank and fixed dims; for a
    batched model, that every output has one row per input row, for the
    sample and for the sample twice over (the engine cuts each caller's rows
    out of a batch's outputs); that a
    cancelled ``execute`` propagates the cancellation and leaves the instance
    usable; that ``aclose`` is idempotent; and that ``execute`` after
    ``aclose`` raises [`BackendError`][trioinfer.BackendError].

    Args:
        backend: The backend under test.
        config: A model it can load.
        inputs: Valid inputs for that model.
        placement: Where to load it; the CPU by default.

    Raises:
        AssertionError: Saying which part of the contract was broken.
    """
    instance = await backend.load(config, placement or Placement(Device("cpu"), 0))
    try:
        if not isinstance(instance, BackendInstance):
            _fail(f"load() returned {type(instance).__name__}, not a BackendInstance")
        signature = instance.signature
        if not isinstance(signature, ModelSignature):
            _fail(f"signature is {type(signature).__name__}, not a ModelSignature")
        if not isinstance(instance.device, str) or not instance.device:
            _fail(f"device is {instance.device!r}, expected a non-empty str such as 'cpu'")
        names = {spec.name for spec in signature.inputs}
        if names != set(inputs):
            _fail(f"signature inputs are {sorted(names)}, the sample inputs {sorted(inputs)}")

        outputs = await instance.execute(inputs)
        _check_outputs(signature, outputs)
        if signature.batched:
            # The engine cuts each caller's rows out of a batch's outputs: they
            # must follow the input rows, whatever their number.
            rows = _rows(inputs)
            _check_rows(outputs, rows)
            doubled = {name: np.concatenate([array, array]) for name, array in inputs.items()}
            _check_rows(await instance.execute(doubled), 2 * rows)

        with anyio.CancelScope() as scope:
            scope.cancel()
            await instance.execute(inputs)
            _fail("execute() under a cancelled scope returned instead of raising Cancelled")
        if not scope.cancelled_caught:
            _fail("execute() under a cancelled scope did not raise Cancelled")

        async with anyio.create_task_group() as tg:
            tg.start_soon(instance.execute, inputs)
            await anyio.lowlevel.checkpoint()
            tg.cancel_scope.cancel()
        _check_outputs(signature, await instance.execute(inputs))
    finally:
        with anyio.CancelScope(shield=True):
            await instance.aclose()
    with anyio.CancelScope(shield=True):
        await instance.aclose()
    try:
        await instance.execute(inputs)
    except BackendError:
        pass
    else:
        _fail("execute() after aclose() returned instead of raising BackendError")


def _check_rows(outputs: Mapping[str, Any], rows: int) -> None:
    for name, array in outputs.items():
        got = array.shape[0] if array.ndim else "no"
        if got != rows:
            _fail(
                f"output {name!r} has {got} rows for {rows} input rows; a batched model's "
                "outputs must have one row per input row (or name their first dimension "
                "differently from the inputs' batch dimension)"
            )


def _check_outputs(signature: ModelSignature, outputs: object) -> None:
    if not isinstance(outputs, Mapping):
        _fail(f"execute() returned {type(outputs).__name__}, expected a dict of arrays")
        return
    declared = [spec.name for spec in signature.outputs]
    if sorted(outputs) != sorted(declared):
        _fail(f"execute() returned outputs {sorted(outputs)}, the signature declares {declared}")
    for spec in signature.outputs:
        array = outputs[spec.name]
        if not isinstance(array, np.ndarray):
            _fail(f"output {spec.name!r} is {type(array).__name__}, not a numpy array")
        if spec.dtype is not None and array.dtype != spec.dtype:
            _fail(f"output {spec.name!r} has dtype {array.dtype}, declared {spec.describe()}")
        if array.ndim != spec.rank:
            _fail(f"output {spec.name!r} has shape {array.shape}, declared {spec.describe()}")
        for size, dim in zip(array.shape, spec.shape, strict=True):
            if isinstance(dim, int) and size != dim:
                _fail(f"output {spec.name!r} has shape {array.shape}, declared {spec.describe()}")


async def check_fallback(make_fallback: Callable[[], Fallback]) -> None:
    """Check that a fallback keeps the [`Fallback`][trioinfer.abc.Fallback] contract.

    Runs the fallback in engines of two [`FakeBackend`][trioinfer.testing.FakeBackend]
    instances (``y = 2 * x``) and checks that: with healthy instances, every
    caller gets its own rows' outputs; when every execution fails, every
    caller cancelled while its batch runs gets ``Cancelled`` at once and the
    execution is aborted; when every execution fails, every caller gets a
    [`TrioInferError`][trioinfer.TrioInferError] other than "returned without
    answering", within a minute of the engine's clock; and the engine closes
    without waiting on anything the fallback started. Works on a real clock or a MockClock.

    Args:
        make_fallback: Makes the fallback under test; it is called with no
            arguments for each model loaded.

    Raises:
        AssertionError: Saying which part of the contract was broken.
    """
    # Imported here: the engine imports this package's siblings, not the other way.
    from .._engine import open_engine
    from .._registry import Registry
    from ._fake import FakeBackend

    backend = FakeBackend(delay=0.001)
    registry = Registry(
        extra={"backends": {"fake": lambda: backend}, "fallbacks": {"checked": make_fallback}}
    )
    config = ModelConfig(
        name="checked",
        path="-",
        backend="fake",
        fallback="checked",
        instances=[Instance(count=2)],
        batcher="dynamic",
        batcher_options={"max_batch_size": 4, "max_queue_delay": 0.001},
    )
    with anyio.move_on_after(120) as overall:
        async with open_engine(registry=registry, drain_period=1.0) as engine:
            await engine.load(config)
            outcomes: dict[int, object] = {}

            async def call(i: int) -> None:
                x = np.full((1 + i % 3, 4), i, np.float32)
                try:
                    outcomes[i] = (await engine.infer("checked", {"x": x}))["y"]
                except TrioInferError as exc:
                    outcomes[i] = exc

            async with anyio.create_task_group() as tg:
                for i in range(24):
                    tg.start_soon(call, i)
            for i, outcome in outcomes.items():
                if isinstance(outcome, BaseException):
                    _fail(f"with healthy instances request {i} failed: {outcome!r}")
                expected = np.full((1 + i % 3, 4), 2 * i, np.float32)
                if not np.array_equal(outcome, expected):  # type: ignore[arg-type]
                    _fail(f"request {i} got {outcome!r}, expected its own rows doubled")

            backend.delay = 30.0
            running_before = sum(instance.running for instance in backend.loaded)
            with anyio.move_on_after(0.5) as scope:
                await engine.infer("checked", {"x": np.ones((1, 4), np.float32)})
            if not scope.cancelled_caught:
                _fail("a request on a 30 s execution returned within 0.5 s")
            # Abort reaches the execution once nobody waits for it; give it a moment.
            with anyio.move_on_after(5):
                while sum(instance.running for instance in backend.loaded) > running_before:  # noqa: ASYNC110
                    await anyio.sleep(0.01)
            if sum(instance.running for instance in backend.loaded) > running_before:
                _fail("an execution nobody waits for was not aborted (cancellation swallowed?)")
            backend.delay = 0.001
            backend.error = BackendError("every execution fails (check_fallback)")
            outcomes.clear()
            with anyio.move_on_after(60) as scope:
                async with anyio.create_task_group() as tg:
                    for i in range(8):
                        tg.start_soon(call, i)
            if scope.cancelled_caught:
                _fail("with every execution failing, requests did not end within 60 s")
            for i, outcome in outcomes.items():
                if not isinstance(outcome, TrioInferError):
                    _fail(f"with every execution failing, request {i} got outputs {outcome!r}")
                if "returned without answering" in str(outcome):
                    _fail(f"execute() returned without answering request {i}: {outcome}")
            backend.error = None

    if overall.cancelled_caught:
        _fail("the engine did not close within 120 s: something the fallback started hangs")
