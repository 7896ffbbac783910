"""The conformance kits themselves: first-party plugins pass, broken ones fail saying why."""

from __future__ import annotations

import contextlib
import functools
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio
import numpy as np
import pytest
import trio
import trio.testing

from trioinfer import BackendError, ModelConfig
from trioinfer.abc import Batcher, Split
from trioinfer.lowlevel import Placement, Request, RequestQueue, WorkerThread
from trioinfer.testing import (
    FakeBackend,
    check_backend,
    check_batcher,
    check_scheduler,
    make_request,
)
from trioinfer_batching import DynamicBatcher, NoBatcher

FIRST_PARTY: dict[str, Callable[[], Batcher]] = {
    "none": NoBatcher,
    "dynamic": DynamicBatcher,
    "dynamic, small": functools.partial(DynamicBatcher, max_batch_size=3, max_queue_delay=0),
    "dynamic, preferred sizes": functools.partial(
        DynamicBatcher, max_batch_size=8, preferred_batch_sizes=[2, 4]
    ),
    "dynamic, padded": functools.partial(DynamicBatcher, pad_axis=1, pad_buckets=[4, 8]),
    "dynamic, padded, ragged outputs": functools.partial(
        DynamicBatcher, pad_axis=1, pad_buckets=[8], ragged_outputs={"x": 1}
    ),
}


@pytest.mark.parametrize("name", FIRST_PARTY)
async def test_first_party_batchers_pass_check_batcher(name: str) -> None:
    await check_batcher(FIRST_PARTY[name])


async def test_check_batcher_runs_on_virtual_time(autojump_clock: trio.testing.MockClock) -> None:
    await check_batcher(functools.partial(DynamicBatcher, max_queue_delay=1.0))


def test_check_batcher_runs_on_asyncio() -> None:
    anyio.run(check_batcher, DynamicBatcher, backend="asyncio")


async def test_check_batcher_holds_a_batcher_to_the_bound_it_declares() -> None:
    await check_batcher(functools.partial(DynamicBatcher, max_batch_size=4), max_batch_size=4)
    with pytest.raises(AssertionError, match="more than max_batch_size 2"):
        await check_batcher(functools.partial(DynamicBatcher, max_batch_size=4), max_batch_size=2)


class Overpromising:
    """Says batches hold at most 2 rows (trioinfer.abc.BoundedBatcher); forms them up to 4."""

    def __init__(self) -> None:
        self._inner = DynamicBatcher(max_batch_size=4)

    @property
    def max_batch_size(self) -> int:
        return 2

    async def next_batch(self, queue: Any) -> Any:
        return await self._inner.next_batch(queue)


async def test_check_batcher_holds_a_batcher_to_the_bound_it_says_by_default() -> None:
    with pytest.raises(AssertionError, match="more than max_batch_size 2"):
        await check_batcher(Overpromising)


# -- broken batchers: each breaks one rule, and the check says which ----------------


async def _first(queue: RequestQueue) -> Request:
    while True:
        await queue.wait_not_empty()
        try:
            return queue.pop_nowait()
        except anyio.WouldBlock:
            continue


def _layout(request: Request) -> tuple[Any, ...]:
    x = request.inputs["x"]
    return x.shape[1:], x.dtype


class EmptyHanded:
    async def next_batch(self, queue: RequestQueue) -> list[Request]:
        await queue.wait_not_empty()
        return []


class Twice:
    async def next_batch(self, queue: RequestQueue) -> list[Request]:
        request = await _first(queue)
        return [request, request]


class Keeper:
    """Takes two and hands out one, keeping the other for its next call (the old dynamic way)."""

    def __init__(self) -> None:
        self.kept: list[Request] = []

    async def next_batch(self, queue: RequestQueue) -> list[Request]:
        if self.kept:
            return [self.kept.pop()]
        first = await _first(queue)
        with contextlib.suppress(anyio.WouldBlock):
            self.kept.append(queue.pop_nowait())
        return [first]


class WaitsForCompany:
    """Takes what is waiting, then waits a while for more: a cancellation may catch it holding."""

    def __init__(self, give_back: Callable[[RequestQueue, list[Request]], None]) -> None:
        self.give_back = give_back

    async def next_batch(self, queue: RequestQueue) -> list[Request]:
        batch = [await _first(queue)]
        try:
            while len(batch) < (3 if queue.batched else 1):
                try:
                    if _layout(queue.peek_nowait()) != _layout(batch[0]):
                        break
                    batch.append(queue.pop_nowait())
                except anyio.WouldBlock:
                    break
            await anyio.sleep(0.01)
        except BaseException:
            self.give_back(queue, batch)
            raise
        return batch


class Everything:
    """Takes every waiting request, whatever its shape and whether the model can batch."""

    async def next_batch(self, queue: RequestQueue) -> list[Request]:
        batch = [await _first(queue)]
        while True:
            try:
                batch.append(queue.pop_nowait())
            except anyio.WouldBlock:
                return batch


class FirstOfEachWidth:
    """Groups by layout, but unbatched models still get groups."""

    async def next_batch(self, queue: RequestQueue) -> list[Request]:
        first = await _first(queue)
        batch = [first]
        while True:
            try:
                request = queue.peek_nowait()
            except anyio.WouldBlock:
                return batch
            if _layout(request) != _layout(first):
                return batch
            batch.append(queue.pop_nowait())


class NotTheirRows:
    """Assembles each batch itself, but its split hands a request rows of the right size only."""

    async def next_batch(self, queue: RequestQueue) -> list[Request]:
        return [await _first(queue)]

    def assemble(self, requests: Sequence[Request]) -> tuple[dict[str, Any], Split]:
        def split(outputs: Any) -> list[dict[str, Any]]:
            return [{"x": np.full_like(r.inputs["x"], -1)} for r in requests]

        return {"x": np.concatenate([r.inputs["x"] for r in requests])}, split


class OverfillsUniformQueues:
    """Pops one request at a time, but overfills a batch from a uniform queue."""

    async def next_batch(self, queue: RequestQueue) -> Sequence[Request]:
        first = await _first(queue)
        if not queue.uniform:
            return [first]
        # Asks for every row there is: the batch outgrows any model's max_batch_size.
        return [first, *queue.take_nowait(1_000_000)]


BROKEN: dict[str, tuple[Callable[[], Any], str]] = {
    "empty batch": (EmptyHanded, "returned an empty batch"),
    "twice in a batch": (Twice, "holds one request more than once"),
    "keeps requests": (Keeper, "neither handed out nor given back with queue.put_back"),
    "gives back nothing": (
        functools.partial(WaitsForCompany, lambda queue, batch: None),
        "neither handed out nor given back",
    ),
    "gives back reversed": (
        functools.partial(WaitsForCompany, lambda queue, batch: queue.put_back(batch[::-1])),
        "not in the order they were taken",
    ),
    "mixes layouts": (Everything, "mixes inputs of different shapes or dtypes"),
    "groups an unbatched model": (FirstOfEachWidth, "the model has no batch dimension"),
    "hands out others' rows": (NotTheirRows, "rows of 'x' that are not its own"),
}


async def test_check_batcher_drives_the_uniform_queue_path() -> None:
    # Only a uniform queue (a fixed signature) takes a batcher down this path.
    with pytest.raises(AssertionError, match=r"uniform queue.*more than max_batch_size 8"):
        await check_batcher(OverfillsUniformQueues, max_batch_size=8)


@pytest.mark.parametrize("name", BROKEN)
async def test_check_batcher_fails_a_broken_batcher_saying_why(name: str) -> None:
    make, message = BROKEN[name]
    with pytest.raises(AssertionError, match=message):
        await check_batcher(make)


async def test_check_batcher_fails_a_batcher_that_hands_out_what_expired() -> None:
    class Hoarder:
        """Keeps every request it ever took and hands them out again later."""

        def __init__(self) -> None:
            self.seen: list[Request] = []

        async def next_batch(self, queue: RequestQueue) -> list[Request]:
            request = await _first(queue)
            self.seen.append(request)
            return [self.seen.pop(0)] if len(self.seen) > 1 else [request]

    with pytest.raises(AssertionError, match=r"never queued|two batches|deadline had passed"):
        await check_batcher(Hoarder)


async def test_check_batcher_fails_a_batcher_that_does_not_wait() -> None:
    class Hasty:
        async def next_batch(self, queue: RequestQueue) -> list[Request]:
            return [make_request()]  # not from the queue at all

    with pytest.raises(AssertionError, match="never queued"):
        await check_batcher(Hasty)


# -- check_scheduler asks for no order the contract does not state ----------------


class LastInFirstOut:
    def __init__(self) -> None:
        self._held: OrderedDict[Request, None] = OrderedDict()

    def push(self, request: Request) -> None:
        if request in self._held:
            raise ValueError("already held")
        self._held[request] = None

    def peek(self) -> Request:
        if not self._held:
            raise IndexError("empty")
        return next(reversed(self._held))

    def pop(self) -> Request:
        if not self._held:
            raise IndexError("empty")
        return self._held.popitem(last=True)[0]

    def remove(self, request: Request) -> bool:
        return self._held.pop(request, False) is None

    def __len__(self) -> int:
        return len(self._held)


def test_a_last_in_first_out_scheduler_passes_check_scheduler() -> None:
    check_scheduler(LastInFirstOut)


def test_check_scheduler_fails_a_scheduler_that_pops_one_request_twice() -> None:
    class Stutters(LastInFirstOut):
        def pop(self) -> Request:
            request = self.peek()
            if len(self._held) % 2:
                self._held.popitem(last=True)
            return request

        def __len__(self) -> int:
            return len(self._held)

    with pytest.raises(AssertionError, match=r"popped more than once|some twice|len is"):
        check_scheduler(Stutters)


@pytest.mark.parametrize(
    ("push", "message"),
    [
        (lambda held, request: held.__setitem__(request, None), r"held already returned"),
        (lambda held, request: {}[request], r"held already raised KeyError"),
    ],
    ids=["accepts", "wrong-exception"],
)
def test_check_scheduler_fails_a_scheduler_that_takes_a_request_twice(
    push: Callable[[OrderedDict[Request, None], Request], object], message: str
) -> None:
    # A duplicate push kept in an OrderedDict is idempotent, but unsaid: the contract
    # asks for ValueError, so that a caller pushing twice learns of it.
    class Lenient(LastInFirstOut):
        def push(self, request: Request) -> None:
            if request in self._held:
                push(self._held, request)
            self._held[request] = None

    with pytest.raises(AssertionError, match=message):
        check_scheduler(Lenient)


def test_check_scheduler_names_the_wrong_exception_from_an_empty_peek() -> None:
    class KeyErrorWhenEmpty(LastInFirstOut):
        def peek(self) -> Request:
            if not self._held:
                raise KeyError("nothing held")
            return super().peek()

    with pytest.raises(AssertionError, match=r"peek\(\) on a new scheduler raised KeyError"):
        check_scheduler(KeyErrorWhenEmpty)


def test_check_scheduler_fails_a_scheduler_that_still_removes_a_popped_request() -> None:
    class RemembersPopped(LastInFirstOut):
        def __init__(self) -> None:
            super().__init__()
            self._seen: set[Request] = set()

        def push(self, request: Request) -> None:
            self._seen.add(request)
            super().push(request)

        def remove(self, request: Request) -> bool:
            self._held.pop(request, None)
            known = request in self._seen
            self._seen.discard(request)
            return known

    with pytest.raises(AssertionError, match=r"remove\(\) of a request pop\(\) already returned"):
        check_scheduler(RemembersPopped)


def test_check_scheduler_fails_a_scheduler_whose_peek_outlives_a_remove() -> None:
    # A peek cached until the next pop (as the priority scheduler's is, so that pop()
    # takes what peek() showed even if time moved on) must not outlive remove() of
    # the request it shows: the engine would hand out a request whose caller left.
    class CachesPeek(LastInFirstOut):
        def __init__(self) -> None:
            super().__init__()
            self._peeked: Request | None = None

        def peek(self) -> Request:
            if self._peeked is None:
                self._peeked = super().peek()
            return self._peeked

        def pop(self) -> Request:
            request = self._peeked if self._peeked is not None else super().peek()
            self._peeked = None
            self._held.pop(request, None)
            return request

    with pytest.raises(AssertionError, match=r"peek\(\) returned a request remove\(\) took out"):
        check_scheduler(CachesPeek)


# -- check_backend -------------------------------------------------------------------


class _Doubler:
    """``y = 2 * x`` on a worker thread, x: float32[batch, 4]; subclasses break a rule."""

    def __init__(self, worker: WorkerThread) -> None:
        self.worker = worker
        self.closed = False
        self.signature = FakeBackend().signature
        self.device = "cpu"

    async def execute(self, inputs: Mapping[str, np.ndarray[Any, Any]]) -> dict[str, Any]:
        if self.closed:
            raise BackendError("closed")
        return {"y": await self.worker.run_sync(np.multiply, inputs["x"], 2)}

    async def aclose(self) -> None:
        self.closed = True
        await self.worker.aclose()


def _backend(instance_class: type[_Doubler]) -> Any:
    class Backend:
        async def load(self, config: ModelConfig, placement: Placement) -> _Doubler:
            return instance_class(await WorkerThread.start(f"doubler-{placement.index}"))

    return Backend()


X4 = {"x": np.ones((2, 4), np.float32)}
CONFIG = ModelConfig(name="doubler", path="-", backend="doubler")


async def test_check_backend_passes_a_backend_that_keeps_the_contract() -> None:
    await check_backend(_backend(_Doubler), CONFIG, X4)


async def test_check_backend_fails_an_instance_that_leaves_its_worker_thread_running() -> None:
    leaked: list[WorkerThread] = []

    class Leaky(_Doubler):
        async def aclose(self) -> None:
            self.closed = True
            leaked.append(self.worker)

    try:
        with pytest.raises(AssertionError, match=r"aclose\(\) left worker threads \['doubler-0'\]"):
            await check_backend(_backend(Leaky), CONFIG, X4)
    finally:
        for worker in leaked:
            await worker.aclose()


async def test_check_backend_says_which_sample_input_does_not_fit_the_signature() -> None:
    with pytest.raises(
        AssertionError, match=r"sample input 'x' is float32\[2, 3\], the signature declares"
    ):
        await check_backend(_backend(_Doubler), CONFIG, {"x": np.ones((2, 3), np.float32)})
    with pytest.raises(AssertionError, match=r"sample input 'x' is float64\[2, 4\]"):
        await check_backend(_backend(_Doubler), CONFIG, {"x": np.ones((2, 4))})


async def test_check_backend_says_why_a_cancelled_execute_may_return() -> None:
    class OnTheLoop(_Doubler):
        async def execute(self, inputs: Mapping[str, np.ndarray[Any, Any]]) -> dict[str, Any]:
            if self.closed:
                raise BackendError("closed")
            return {"y": inputs["x"] * 2}  # computes on the event loop, never awaits

    with pytest.raises(AssertionError, match=r"Does it compute on the event loop\?"):
        await check_backend(_backend(OnTheLoop), CONFIG, X4)


async def test_check_backend_says_a_shielded_execute_may_be_why_it_returned() -> None:
    """Its message named only computing on the event loop, which this instance does not do."""

    class Shielded(_Doubler):
        async def execute(self, inputs: Mapping[str, np.ndarray[Any, Any]]) -> dict[str, Any]:
            with anyio.CancelScope(shield=True):
                return await super().execute(inputs)

    with pytest.raises(AssertionError, match=r"CancelScope\(shield=True\)"):
        await check_backend(_backend(Shielded), CONFIG, X4)


async def test_check_backend_fails_an_aclose_that_is_not_idempotent() -> None:
    """A second aclose() that raised escaped the check as itself, not as a broken rule."""

    class ClosesOnce(_Doubler):
        async def aclose(self) -> None:
            if self.closed:
                raise RuntimeError("already closed")
            await super().aclose()

    with pytest.raises(AssertionError, match=r"a second aclose\(\) raised RuntimeError: already"):
        await check_backend(_backend(ClosesOnce), CONFIG, X4)


async def test_check_backend_fails_an_aclose_that_raises() -> None:
    class CloseRaises(_Doubler):
        async def aclose(self) -> None:
            await super().aclose()
            raise OSError("device memory not freed")

    with pytest.raises(AssertionError, match=r"aclose\(\) raised OSError: device memory"):
        await check_backend(_backend(CloseRaises), CONFIG, X4)


async def test_check_backend_reports_the_first_broken_rule_when_aclose_raises_too() -> None:
    class Both(_Doubler):
        async def execute(self, inputs: Mapping[str, np.ndarray[Any, Any]]) -> dict[str, Any]:
            return {"z": await self.worker.run_sync(np.multiply, inputs["x"], 2)}

        async def aclose(self) -> None:
            await super().aclose()
            raise OSError("device memory not freed")

    with pytest.raises(AssertionError, match=r"execute\(\) returned outputs \['z'\]"):
        await check_backend(_backend(Both), CONFIG, X4)
