"""Conformance checks for plugins: run them against your plugin in your own tests."""

from __future__ import annotations

import collections
import itertools
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

import anyio
import anyio.lowlevel
import numpy as np

from .._config import Device, Instance, ModelConfig, Placement
from .._exceptions import BackendError, TrioInferError
from .._inline import restart_inline_slice
from .._model_tasks import ModelTasks, loading_for, open_model_tasks
from .._request import NO_PARAMETERS, checked_parameters
from .._request import Request as _Request
from .._runner import CLEANUP_S
from .._sequence import SequenceFlags
from .._tensors import ModelSignature
from .._tensors import rows as _rows
from .._threads import _OSThread
from ..abc import (
    AssemblingBatcher,
    Backend,
    BackendInstance,
    Batcher,
    BoundedBatcher,
    Fallback,
    Request,
    Scheduler,
    Status,
)

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
    sequence_flags: SequenceFlags | None = None,
    parameters: Mapping[str, bool | int | float | str] | None = None,
) -> Request:
    """A [`Request`][trioinfer.lowlevel.Request] for scheduler and batcher tests.

    Only the engine makes requests; this is the way in for a plugin's tests.
    Without *arrival*, each request arrives one tick after the previous one.
    *sequence_flags* make it part of a sequence, for a sequence batcher's tests;
    *parameters* are its request parameters, checked as ``engine.infer`` checks them.

    Raises:
        InvalidInput: *parameters* are not names to bool, int, float or str values.
    """
    return _Request(
        model,
        inputs if inputs is not None else {},
        priority=priority,
        tenant=tenant,
        deadline=deadline,
        arrival=float(next(_arrivals)) if arrival is None else arrival,
        rows=rows,
        sequence_flags=sequence_flags,
        parameters=NO_PARAMETERS if parameters is None else checked_parameters(parameters),
    )


def _fail(what: str) -> NoReturn:
    raise AssertionError(what)


def check_scheduler(make_scheduler: Callable[[], Scheduler]) -> None:
    """Check that a scheduler keeps the [`Scheduler`][trioinfer.abc.Scheduler] contract.

    Checks that an empty scheduler, new or emptied, pops and peeks
    ``IndexError``; that `peek()` shows what `pop()` takes next; that every
    pushed request is popped exactly once, whether alike or not; that
    ``remove`` takes a request out once (returning ``True``, then ``False``,
    and ``False`` for one already popped) and that a removed request is never
    peeked or popped, the one `peek()` had just shown included; that a
    second `push()` of a request held already raises
    ``ValueError`` and changes nothing (each request is pushed once; one
    counted twice would keep ``len`` above 0 for good); and that ``len``
    follows along. Which request comes next is
    the scheduler's own policy, so no order is checked: a last-in-first-out
    scheduler passes as a first-in-first-out one does.

    Args:
        make_scheduler: Returns a new, empty scheduler on each call.

    Raises:
        AssertionError: Saying which part of the contract was broken.
    """
    scheduler = make_scheduler()
    if len(scheduler) != 0:
        _fail(f"a new scheduler has len {len(scheduler)}, expected 0")
    _check_empty(scheduler, "a new scheduler")
    if (got := scheduler.remove(make_request())) is not False:
        _fail(f"remove() of a request never pushed returned {got!r}, expected False")

    # Alike requests: nothing tells them apart but identity (and arrival).
    alike = [make_request(priority=1, tenant="t", deadline=100.0) for _ in range(50)]
    for i, request in enumerate(alike):
        scheduler.push(request)
        if len(scheduler) != i + 1:
            _fail(f"len is {len(scheduler)} after {i + 1} pushes")
    popped = [scheduler.pop() for _ in alike]
    if len(set(popped)) != len(alike) or set(popped) != set(alike):
        _fail(
            f"popping {len(alike)} alike requests gave {len(set(popped) & set(alike))} of them "
            "(some twice, or others)"
        )
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
        if (got := scheduler.remove(request)) is not True:
            _fail(f"remove() of a held request returned {got!r}, expected True")
        if (got := scheduler.remove(request)) is not False:
            _fail(f"remove() of an already removed request returned {got!r}, expected False")
    if len(scheduler) != len(mixed) - len(removed):
        _fail(f"len is {len(scheduler)}, expected {len(mixed) - len(removed)} after removals")
    # What peek() shows, its caller may leave: remove() takes it out, and neither
    # peek() nor pop() shows it again (a peek kept until the next pop() must not
    # outlive a remove(): the engine would hand out a request nobody waits for).
    shown = scheduler.peek()
    if (got := scheduler.remove(shown)) is not True:
        _fail(f"remove() of the request peek() had just returned gave {got!r}, expected True")
    removed.append(shown)
    out = []
    while len(scheduler):
        head = scheduler.peek()
        if head in removed:
            _fail("peek() returned a request remove() took out (a peek kept past a remove())")
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
    # The engine may call remove() for a request that already left by pop() (its
    # caller gave up as it was taken): the scheduler no longer holds it.
    if (got := scheduler.remove(out[0])) is not False:
        _fail(f"remove() of a request pop() already returned gave {got!r}, expected False")
    if len(scheduler) != 0:
        _fail(f"len is {len(scheduler)} after popping everything and a remove()")
    _check_empty(scheduler, "a scheduler emptied by pop()")
    _check_pushed_twice(scheduler)


def _check_pushed_twice(scheduler: Scheduler) -> None:
    # Each request is pushed once: a second push of one held (alike or not) is
    # refused with ValueError and leaves the scheduler as it was.
    held = [
        make_request(priority=1, tenant="t", deadline=100.0),
        make_request(priority=1, tenant="t", deadline=100.0),
        make_request(priority=2, tenant=None),
    ]
    for request in held:
        scheduler.push(request)
    for request in held:
        try:
            scheduler.push(request)
        except ValueError:
            pass
        except Exception as exc:
            _fail(
                f"push() of a request held already raised {type(exc).__name__}: {exc}; "
                "expected ValueError"
            )
        else:
            _fail(
                f"push() of a request held already returned (len is now {len(scheduler)}); "
                "each request is pushed once: refuse a second push with ValueError"
            )
    if len(scheduler) != len(held):
        _fail(f"len is {len(scheduler)} after refused second pushes, expected {len(held)}")
    out = [scheduler.pop() for _ in held]
    if set(out) != set(held) or len(scheduler) != 0:
        _fail("after refused second pushes, the requests held did not come out once each")
    _check_empty(scheduler, "a scheduler emptied after refused second pushes")


def _check_empty(scheduler: Scheduler, which: str) -> None:
    for method in ("pop", "peek"):
        try:
            got = getattr(scheduler, method)()
        except IndexError:
            continue
        except Exception as exc:
            _fail(f"{method}() on {which} raised {type(exc).__name__}: {exc}; expected IndexError")
        _fail(f"{method}() on {which} returned {got!r} instead of raising IndexError")


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
    usable (for an instance whose ``runs_inline`` is True, an
    [`InlineInstance`][trioinfer.abc.InlineInstance], that ``execute``
    ends without suspending instead); that ``aclose`` raises nothing, is idempotent, and stops
    every [`WorkerThread`][trioinfer.lowlevel.WorkerThread] the instance
    started; and that ``execute`` after ``aclose`` raises
    [`BackendError`][trioinfer.BackendError]. The sample *inputs* are checked
    against the signature first (names, dtypes, ranks, fixed dims). The load
    gets a model's task group, as in an engine
    ([`current_model_tasks()`][trioinfer.lowlevel.current_model_tasks]),
    whose tasks are cancelled once the instance closed.

    Args:
        backend: The backend under test.
        config: A model it can load.
        inputs: Valid inputs for that model.
        placement: Where to load it; the CPU by default.

    Raises:
        AssertionError: Saying which part of the contract was broken.
    """
    failure: Exception | None = None
    async with anyio.create_task_group() as group:
        # The model's task group, as the engine's load gives one (current_model_tasks).
        tasks = await open_model_tasks(config.name, group)
        try:
            await _check_backend(backend, config, inputs, placement, tasks)
        except Exception as exc:
            failure = exc
        finally:
            await tasks.aclose(CLEANUP_S)
    if failure is not None:
        raise failure  # as the check raised it, not wrapped by the task group


async def _check_backend(
    backend: Backend,
    config: ModelConfig,
    inputs: Mapping[str, np.ndarray[Any, Any]],
    placement: Placement | None,
    tasks: ModelTasks,
) -> None:
    threads_before = set(threading.enumerate())
    with loading_for(tasks):
        instance = await backend.load(config, placement or Placement(Device("cpu"), 0))
    checked = False
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
        for spec in signature.inputs:
            # The engine validates callers' inputs before execute() sees them; this
            # check does not, so a wrong sample would fail inside the backend instead.
            sample = np.asarray(inputs[spec.name])
            if (
                (spec.dtype is not None and sample.dtype != spec.dtype)
                or sample.ndim != spec.rank
                or any(
                    isinstance(dim, int) and size != dim
                    for size, dim in zip(sample.shape, spec.shape, strict=True)
                )
            ):
                _fail(
                    f"sample input {spec.name!r} is {sample.dtype}{list(sample.shape)}, the "
                    f"signature declares {spec.describe()}: pass inputs the model accepts"
                )

        outputs = await instance.execute(inputs)
        _check_outputs(signature, outputs)
        if signature.batched:
            # The engine cuts each caller's rows out of a batch's outputs: they
            # must follow the input rows, whatever their number.
            rows = _rows(inputs)
            _check_rows(outputs, rows)
            doubled = {name: np.concatenate([array, array]) for name, array in inputs.items()}
            _check_rows(await instance.execute(doubled), 2 * rows)

        if getattr(instance, "runs_inline", False) is True:
            # It says it never suspends (an InlineInstance): then it cannot see a
            # cancellation either, and must end without yielding to the loop.
            if type(getattr(instance, "inline_budget_s", None)) in (float, int):
                restart_inline_slice()  # a fresh slice: nothing to yield for
            run = instance.execute(inputs)
            try:
                run.send(None)
            except StopIteration as done:
                _check_outputs(signature, done.value)
            else:
                run.close()
                _fail("runs_inline is True, but execute() suspended")
        else:
            with anyio.CancelScope() as scope:
                scope.cancel()
                await instance.execute(inputs)
                _fail(
                    "execute() under a cancelled scope returned instead of raising Cancelled: "
                    "it never reached a checkpoint, or it shielded or caught the cancellation. "
                    "Does it compute on the event loop? Run the compute on a WorkerThread, "
                    "or, if execute() never suspends, say so with runs_inline = True (an "
                    "InlineInstance). Does it wrap its work in CancelScope(shield=True), or "
                    "return from an except clause that catches Cancelled (except "
                    "BaseException, say)? Let Cancelled propagate once the instance can "
                    "take its next call"
                )
            if not scope.cancelled_caught:
                _fail("execute() under a cancelled scope did not raise Cancelled")

        async with anyio.create_task_group() as tg:
            tg.start_soon(instance.execute, inputs)
            await anyio.lowlevel.checkpoint()
            tg.cancel_scope.cancel()
        _check_outputs(signature, await instance.execute(inputs))
        checked = True
    finally:
        with anyio.CancelScope(shield=True):
            try:
                await instance.aclose()
            except Exception as exc:
                if checked:  # else the check already failed: that failure is the one to see
                    _fail(
                        f"aclose() raised {type(exc).__name__}: {exc}; closing a healthy "
                        "instance must not raise"
                    )
    with anyio.CancelScope(shield=True):
        try:
            await instance.aclose()
        except Exception as exc:
            _fail(
                f"a second aclose() raised {type(exc).__name__}: {exc}; aclose() must be idempotent"
            )
    left = sorted(
        thread.name
        for thread in threading.enumerate()
        if isinstance(thread, _OSThread) and thread not in threads_before
    )
    if left:
        _fail(f"aclose() left worker threads {left} running: close every WorkerThread it started")
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
    answering", or outputs of its own rows that the fallback answered with
    itself (``execution.respond()``, a default answer), within a minute of the
    engine's clock; and the engine closes
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
                    # Answered by the fallback itself (a default, say), the only way
                    # outputs come while every execution fails: the engine checked them.
                    continue
                if "returned without answering" in str(outcome):
                    _fail(f"execute() returned without answering request {i}: {outcome}")
            backend.error = None

    if overall.cancelled_caught:
        _fail("the engine did not close within 120 s: something the fallback started hangs")


#: How long `check_batcher` waits for one ``next_batch()`` call, on the event loop's clock.
_BATCH_WAIT_S = 10.0


class _Fifo:
    # The scheduler under the queue check_batcher drives: first in, first out.
    def __init__(self) -> None:
        self._held: collections.OrderedDict[_Request, None] = collections.OrderedDict()

    def push(self, request: _Request) -> None:
        self._held[request] = None

    def peek(self) -> _Request:
        if not self._held:
            raise IndexError("peek into an empty queue")
        return next(iter(self._held))

    def pop(self) -> _Request:
        if not self._held:
            raise IndexError("pop from an empty queue")
        return self._held.popitem(last=False)[0]

    def remove(self, request: _Request) -> bool:
        return self._held.pop(request, False) is None

    def __len__(self) -> int:
        return len(self._held)


class _BatcherHarness:
    """The engine's side of one queue for `check_batcher`: it queues requests, checks batches."""

    def __init__(
        self,
        batcher: Batcher,
        what: str,
        *,
        batched: bool = True,
        preferred_batch_sizes: tuple[int, ...] = (),
        max_batch_size: int | None = None,
        uniform: bool = False,
    ) -> None:
        # The engine's own queue, so that the batcher meets exactly what it will in
        # an engine. Imported here: the queue belongs to the engine, which this
        # package's siblings (the fakes) must not need.
        from .._runner import RequestQueue

        self.batcher = batcher
        self.what = what
        self.max_batch_size = max_batch_size
        self.queue = RequestQueue._create(
            _Fifo(), self._expire, batched, preferred_batch_sizes, uniform=uniform
        )
        self.pushed: list[_Request] = []
        self.handed: set[_Request] = set()
        self.expired: set[_Request] = set()

    def _expire(self, request: _Request, now: float) -> None:
        # What the engine does to a request the queue found expired: it ends.
        request._state.status = Status.DONE
        self.expired.add(request)

    def push(
        self, rows: int, width: int, dtype: type = np.float32, deadline: float = math.inf
    ) -> None:
        # Every row of a request holds its number, so that rows that reach the
        # wrong request show.
        number = len(self.pushed)
        request = make_request(
            inputs={"x": np.full((rows, width), number, dtype)},
            rows=rows,
            deadline=deadline,
            arrival=anyio.current_time(),
        )
        assert isinstance(request, _Request)
        self.pushed.append(request)
        self.queue._push(request)

    async def next_batch(self) -> Sequence[Request]:
        called = anyio.current_time()
        waiting = len(self.queue)
        batch: Sequence[Request] | None = None
        with anyio.move_on_after(_BATCH_WAIT_S):
            batch = await self.batcher.next_batch(self.queue)
        if batch is None:
            _fail(
                f"{self.what}: next_batch() did not return within {_BATCH_WAIT_S:g}s with "
                f"{waiting} requests waiting"
            )
        assert batch is not None
        self.check(batch, called)
        return batch

    def check(self, batch: object, called: float) -> None:
        """Check one batch the batcher returned from a call begun at *called*."""
        what = self.what
        if not isinstance(batch, Sequence) or isinstance(batch, str | bytes):
            _fail(f"{what}: next_batch() returned {type(batch).__name__}, not a sequence")
        assert isinstance(batch, Sequence)
        if not batch:
            _fail(f"{what}: next_batch() returned an empty batch; a batch holds a request or more")
        pushed = set(self.pushed)
        for request in batch:
            if request not in pushed:
                _fail(f"{what}: next_batch() returned {request!r}, which was never queued")
            if request in self.expired:
                _fail(
                    f"{what}: next_batch() returned request {request.id!r}, which the queue had "
                    "failed as expired (a batcher must hold no request from one call to the next)"
                )
            if request.deadline <= called:
                _fail(
                    f"{what}: next_batch() returned request {request.id!r}, whose deadline had "
                    "passed before the call began"
                )
            if request in self.handed:
                _fail(f"{what}: request {request.id!r} was handed out in two batches")
        if len(set(batch)) != len(batch):
            _fail(f"{what}: a batch holds one request more than once")
        if not self.queue.batched and len(batch) > 1:
            _fail(
                f"{what}: a batch holds {len(batch)} requests, but the model has no batch "
                "dimension (queue.batched is false): each request must run alone"
            )
        rows = sum(request.rows for request in batch)
        if self.max_batch_size is not None and len(batch) > 1 and rows > self.max_batch_size:
            _fail(
                f"{what}: a batch of {len(batch)} requests holds {rows} rows, more than "
                f"max_batch_size {self.max_batch_size}"
            )
        if isinstance(self.batcher, AssemblingBatcher):
            self._check_assembly(batch)
        else:
            layouts = {_layout(request) for request in batch}
            if len(layouts) > 1:
                _fail(
                    f"{what}: a batch mixes inputs of different shapes or dtypes "
                    f"({sorted(map(str, layouts))}), which cannot be concatenated; only a batcher "
                    "with an assemble() hook may group those"
                )
        self.handed.update(batch)
        for request in batch:
            # Answered, as far as the queue can tell: a give-back no longer takes it.
            assert isinstance(request, _Request)
            request._state.status = Status.DONE
        self.check_accounts()

    def _check_assembly(self, batch: Sequence[Request]) -> None:
        assert isinstance(self.batcher, AssemblingBatcher)
        inputs, split = self.batcher.assemble(batch)
        # An identity model: each output is its input, so every caller must get its own rows.
        shares = split({name: np.asarray(array) for name, array in inputs.items()})
        if len(shares) != len(batch):
            _fail(
                f"{self.what}: assemble()'s split gave {len(shares)} shares for a batch of "
                f"{len(batch)} requests"
            )
        for request, share in zip(batch, shares, strict=False):
            for name, array in share.items():
                if array.shape[0] != request.rows:
                    _fail(
                        f"{self.what}: assemble()'s split gave request {request.id!r} "
                        f"{array.shape[0]} rows of {name!r}; it has {request.rows}"
                    )
                mine = request.inputs.get(name)
                if (
                    mine is not None
                    and mine.shape == array.shape
                    and not np.array_equal(mine, array)
                ):
                    _fail(
                        f"{self.what}: assemble()'s split gave request {request.id!r} rows "
                        f"of {name!r} that are not its own"
                    )

    def check_accounts(self) -> None:
        """Every request is queued, handed out or ended: none is kept or lost.

        And what was given back is in the order it was taken: the queue is
        first in, first out, so in the order the requests were made.
        """
        missing = len(self.pushed) - len(self.handed) - len(self.expired) - len(self.queue)
        if missing:
            _fail(
                f"{self.what}: {missing} requests taken from the queue were neither handed out "
                "nor given back with queue.put_back()"
            )
        given_back = [request.sequence for request in self.queue._front]
        if given_back != sorted(given_back):
            _fail(
                f"{self.what}: the requests given back are not in the order they were taken "
                f"(queue.put_back() keeps the order it is given)"
            )

    def drain(self) -> list[_Request]:
        """Take every live request left in the queue, in its order."""
        left: list[_Request] = []
        while True:
            try:
                request = self.queue.pop_nowait()
            except anyio.WouldBlock:
                return left
            assert isinstance(request, _Request)
            left.append(request)


def _layout(request: Request) -> tuple[tuple[str, tuple[int, ...], str], ...]:
    return tuple(
        (name, tuple(array.shape[1:]), str(array.dtype))
        for name, array in sorted(request.inputs.items())
    )


async def check_batcher(
    make_batcher: Callable[[], Batcher], *, max_batch_size: int | None = None
) -> None:
    """Check that a batcher keeps the [`Batcher`][trioinfer.abc.Batcher] contract.

    Drives ``next_batch()`` against the engine's own request queue (first in,
    first out underneath), with requests of mixed row counts, widths and
    dtypes, and checks every batch it returns: at least one request; only
    requests that were queued, each handed out once; none whose deadline had
    passed when the call began (the queue never hands those out, so a batcher
    that keeps requests from one call to the next is caught here); one
    request per batch when ``queue.batched`` is false; one input layout per
    batch unless the batcher is an
    [`AssemblingBatcher`][trioinfer.abc.AssemblingBatcher], whose split must
    then give each request its own rows of an identity model's outputs; at
    most *max_batch_size* rows when a batch holds more than one request. It
    runs with and without the queue's ``preferred_batch_sizes``, and on a
    ``uniform`` queue (the model's signature fixes every dimension but the
    batch: where a batcher may fill a batch with ``take_nowait()``). After every
    call each request is queued, handed out or ended, never kept or lost; a
    call on an empty queue waits for a request; and a call cancelled at any
    of its awaits gives back what it took, in the order taken. Works on a
    real clock or a MockClock.

    Args:
        make_batcher: Returns a new batcher on each call (one per model, as the
            engine makes them).
        max_batch_size: The most rows the batcher promises a batch of two
            requests or more holds, if it promises a bound; by default the
            batcher's own [`BoundedBatcher.max_batch_size`][trioinfer.abc.BoundedBatcher],
            where it says one.

    Raises:
        AssertionError: Saying which part of the contract was broken.
    """
    if max_batch_size is None:
        batcher = make_batcher()
        if isinstance(batcher, BoundedBatcher):
            max_batch_size = batcher.max_batch_size  # its promise, held to it below
    widths = (4, 4, 6, 4)  # two layouts in most batches, and a dtype of its own below
    layouts = [
        (1 + i % 3, widths[i % 4], np.float64 if i % 7 == 6 else np.float32) for i in range(36)
    ]

    # A uniform queue (the model's signature fixes every dimension but the
    # batch) is where batchers may take a batch's worth with take_nowait().
    alike = [(1 + i % 3, 4, np.float32) for i in range(36)]
    for batched, preferred, uniform in (
        (True, (), False),
        (True, (2, 4), False),
        (False, (), False),
        (True, (), True),
        (True, (2, 4), True),
    ):
        what = f"batched={batched}, preferred_batch_sizes={list(preferred)}" + (
            ", uniform queue" if uniform else ""
        )
        harness = _BatcherHarness(
            make_batcher(),
            what,
            batched=batched,
            preferred_batch_sizes=preferred,
            max_batch_size=max_batch_size,
            uniform=uniform,
        )
        for rows, width, dtype in alike if uniform else layouts:
            harness.push(rows, width, dtype)
        while len(harness.queue):
            await harness.next_batch()
        if harness.handed != set(harness.pushed):
            _fail(f"{what}: {len(harness.pushed) - len(harness.handed)} requests never came out")

    # Expired requests: those already expired are failed by the queue, and those
    # that expire between two calls must not come out of the second.
    harness = _BatcherHarness(make_batcher(), "with deadlines", max_batch_size=max_batch_size)
    now = anyio.current_time()
    for i, (rows, width, dtype) in enumerate(layouts):
        deadline = now - 1.0 if i % 3 == 0 else now + 0.05 if i % 3 == 1 else math.inf
        harness.push(rows, width, dtype, deadline)
    await harness.next_batch()
    await anyio.sleep(0.1)
    while len(harness.queue):
        try:
            harness.queue.peek_nowait()  # fails what expired at the head, as a batcher would
        except anyio.WouldBlock:
            break
        await harness.next_batch()
    harness.check_accounts()

    # An empty queue: the call waits, and returns once a request comes.
    harness = _BatcherHarness(make_batcher(), "on an empty queue", max_batch_size=max_batch_size)
    async with anyio.create_task_group() as tg:
        returned: list[Sequence[Request]] = []

        async def first_batch() -> None:
            returned.append(await harness.next_batch())

        tg.start_soon(first_batch)
        for _ in range(10):
            await anyio.lowlevel.checkpoint()
        if returned:
            _fail("on an empty queue: next_batch() returned instead of waiting for a request")
        harness.push(1, 4)
    if not returned or list(returned[0]) != harness.pushed:
        _fail("on an empty queue: the batch after one request came did not hold just that request")

    # Cancelled at each await in turn: what it took goes back, in the order taken.
    for steps in range(40):
        what = f"cancelled after {steps} checkpoints"
        harness = _BatcherHarness(make_batcher(), what, max_batch_size=max_batch_size)
        for _ in range(3):  # alike: most batchers wait for company, holding them
            harness.push(1, 4)
        done: list[Sequence[Request]] = []

        async def form(harness: _BatcherHarness, done: list[Sequence[Request]]) -> None:
            called = anyio.current_time()
            batch = await harness.batcher.next_batch(harness.queue)
            harness.check(batch, called)
            done.append(batch)

        async with anyio.create_task_group() as tg:
            tg.start_soon(form, harness, done)
            for _ in range(steps):
                await anyio.lowlevel.checkpoint()
            tg.cancel_scope.cancel()
        harness.check_accounts()
        left = harness.drain()
        expected = [request for request in harness.pushed if request not in harness.handed]
        if left != expected:
            _fail(
                f"{what}: the requests given back are not in the order they were taken "
                f"(queue order {[r.id for r in left]}, expected {[r.id for r in expected]})"
            )
