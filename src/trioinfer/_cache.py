"""The response cache: repeated requests answered without queueing, identical ones computed once.

One cache serves the whole engine, bounded in bytes and evicted least recently
used first; a model takes part when its config says ``response_cache = true``.
The key is the model's name (which holds its version when served from a
repository) and a 128-bit BLAKE2b digest of every input's name, dtype, shape
and bytes. Only the model's own successful answers are stored (not a
fallback's default answer, nor one from another model), as read-only copies,
so that no caller can change what another receives. Such an answer not kept
still answers the identical requests waiting for it, with its fallback steps.

Identical requests that arrive while the first is still being computed wait
for its answer instead of computing again (request coalescing). The
computation belongs to the cache, not to the caller whose miss started it: it
runs in a task of the engine's task group (nothing outlives the engine), under
the latest deadline of the callers waiting for it. A caller that gives up
(cancelled, or its deadline passed) leaves it to the others, with the work
done so far; the last one to leave cancels it, so that nothing is computed
for nobody, and a request nobody waits for never reaches a backend.
"""

from __future__ import annotations

import collections
import hashlib
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, final

import anyio
import anyio.abc
import anyio.lowlevel
import attrs
import numpy as np

from ._exceptions import DeadlineExceeded, EngineClosed, TrioInferError
from ._request import Outputs
from ._runner import DURATION_BUCKETS, Histogram, _copy_error, _Histogram
from ._threads import LoopClock

Arrays = Mapping[str, np.ndarray[Any, Any]]


@attrs.frozen
class CacheStatistics:
    """One model's use of the engine's response cache, in ``ModelStatistics.cache``.

    A request of a model with the cache on counts in *hits* when answered
    from the cache, in *misses* when it starts a computation (which goes on
    for the others if it leaves), in *coalesced* when it gets the answer of
    a computation another request started, and in *failed* when it gets that
    computation's error instead; one that waited and left counts in none.

    Attributes:
        hits: Requests answered from the cache, without queueing.
        misses: Requests that started a computation (the first of identical ones in flight).
        coalesced: Requests answered by an identical request computed meanwhile.
        evictions: Answers dropped to make room (least recently used first).
        entries: Answers the cache holds for the model now.
        bytes: What they take, in bytes: their arrays, and a fixed charge per
            answer and per array for what holds them.
        hit_duration: Seconds to answer each hit.
        miss_duration: Seconds each miss spent in the cache: looking the answer
            up, and storing it once computed (not computing it), as Triton's
            ``cache_miss`` statistics; one for each miss, failed ones too.
        failed: Requests that waited for an identical request computed meanwhile
            and got its error (the model's own statistics count only that
            request's failure; Triton's ``fail`` counts them all).
    """

    hits: int
    misses: int
    coalesced: int
    evictions: int
    entries: int
    bytes: int
    hit_duration: Histogram
    miss_duration: Histogram
    failed: int = 0


@final
class _Counters:
    __slots__ = (
        "bytes", "coalesced", "entries", "evictions", "failed", "hit", "hits", "miss", "misses",
    )  # fmt: skip

    def __init__(self) -> None:
        self.hits = self.misses = self.coalesced = self.evictions = self.failed = 0
        self.entries = self.bytes = 0
        self.hit = _Histogram(DURATION_BUCKETS)
        self.miss = _Histogram(DURATION_BUCKETS)


@final
class _Flight:
    # One computation that identical requests wait for. It belongs to the cache, not
    # to the caller that started it: it runs in a task of the engine's task group,
    # and is cancelled only when no caller is left waiting for it.
    __slots__ = (
        "computed", "deadline", "deadlines", "done", "error", "expire", "leader", "origin",
        "outputs", "retarget", "scope", "started",
    )  # fmt: skip

    def __init__(
        self,
        deadline: float,
        retarget: Callable[[float, bool], float],
        started: Callable[[], bool],
        expire: Callable[[], bool],
    ) -> None:
        self.done = anyio.Event()
        self.outputs: Outputs | None = None  # the cache's read-only copy, for those who waited
        self.computed: Outputs | None = None  # as computed: the caller who started it gets these
        self.error: BaseException | None = None
        self.origin: object = None
        # Made here, entered by the task: a caller that leaves before the task
        # starts cancels it all the same.
        self.scope = anyio.CancelScope()
        # The deadline of each caller waiting for it.
        self.deadlines: list[float] = []
        # The deadline the computation has (its first caller's at first), and how to
        # move it towards the latest of theirs (`ResponseCache._wait`, `_leave`).
        self.deadline = deadline
        self.retarget = retarget
        # Whether it has left the queue (a caller with the model's queue timeout
        # leaves only a computation that has not); and, for the last such caller,
        # ending it as expired in the queue, as the model's own request (False: not
        # queued yet, it is cancelled instead).
        self.started = started
        self.expire = expire
        self.leader = True  # whether the next caller to join is the one that started it


#: What an answer costs beyond its arrays' bytes: its key, its place in the LRU order,
#: its dict, and each array's header. Charged so that many small answers stay bounded too.
ENTRY_OVERHEAD = 512
ARRAY_OVERHEAD = 128

#: A computation's answer, and whether it may be kept (a fallback's default answer,
#: or one from another model, answers those waiting now but is not kept), and, for
#: one not kept, where it came from: given to those it answers, who must say so too.
Computed = tuple[Outputs, bool, object]


@final
class ResponseCache:
    """The engine's response cache, *size* bytes at most. Only the engine creates it."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.bytes = 0
        # Keyed by (model, its generation, digest): a model loaded again, or unloaded,
        # starts a new generation, so nothing computed by the old one is found or kept.
        self._entries: collections.OrderedDict[tuple[str, int, bytes], tuple[Outputs, int]] = (
            collections.OrderedDict()
        )
        self._flights: dict[tuple[str, int, bytes], _Flight] = {}
        self._generations: dict[str, int] = {}
        self._counters: dict[str, _Counters] = {}
        self._clock = LoopClock()

    async def answer(
        self,
        model: str,
        inputs: Arrays,
        compute: Callable[[], Awaitable[Computed]],
        *,
        deadline: float,
        own_deadline: bool,
        task_group: anyio.abc.TaskGroup,
        retarget: Callable[[float, bool], float],
        started: Callable[[], bool],
        expire: Callable[[], bool],
    ) -> tuple[Outputs, object]:
        """The cached answer to *inputs*, or an identical request's, or ``compute()``'s.

        A miss starts ``compute()`` in *task_group* (the engine's), where every
        identical request arriving meanwhile waits for it too. It runs while
        anyone waits: a caller that leaves (cancelled, or its deadline passed)
        leaves it to the others, and ``retarget(latest, requeue)`` moves its
        deadline to the latest of theirs and returns the one it has then
        (*requeue*: even in the queue, where the one it had would expire it
        while a caller still waits); the last one to leave cancels it, so
        that nothing is computed for nobody. *deadline* is this caller's;
        *own_deadline* False: the model's queue timeout, which ends the wait of
        a request still queued (`DeadlineExceeded`), never one running.
        ``started()`` says whether the computation has left the queue, and
        ``expire()`` ends it there, expired, for the last caller's queue timeout.

        With the answer comes the origin ``compute()`` gave with it when it
        was an identical request's, not kept (a fallback's); ``None`` otherwise.

        Raises:
            TrioInferError: What ``compute()`` raised, for each caller waiting
                for it (each their own copy).
            EngineClosed: The engine closed before the computation ended.
        """
        key = (model, self._generations.get(model, 0), digest(inputs))
        counters = self._counters.setdefault(model, _Counters())
        started_at = self._clock.current_time()
        while True:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                counters.hits += 1
                counters.hit.observe(self._clock.current_time() - started_at)
                # A hit never waits: give the event loop its turn (and a scope
                # that expired, its chance to fire) as a queued request would.
                await anyio.lowlevel.checkpoint()
                return dict(entry[0]), None
            flight = self._flights.get(key)
            if flight is None:
                flight = self._flights[key] = _Flight(deadline, retarget, started, expire)
                counters.misses += 1
                # A miss is timed as Triton times it: the lookup and the insert, not the
                # compute (the task adds the insert's time).
                lookup = self._clock.current_time() - started_at
                task_group.start_soon(self._compute, key, counters, flight, compute, lookup)
            leader, flight.leader = flight.leader, False
            await self._wait(flight, key, deadline, own_deadline, leader)
            if flight.outputs is not None:
                if leader:
                    assert flight.computed is not None
                    return flight.computed, None  # its own request says where it came from
                counters.coalesced += 1
                return dict(flight.outputs), flight.origin
            error = flight.error
            if (
                not leader
                and isinstance(error, DeadlineExceeded)
                and self._clock.current_time() < deadline
            ):
                # Expired in the queue just as the caller whose deadline it had left,
                # before it could be moved to ours: nothing was computed; again.
                continue
            if error is None:
                raise EngineClosed(
                    f"the engine closed before the answer to a request for model {model!r} "
                    "was computed"
                )
            if not leader:
                counters.failed += 1
            if isinstance(error, DeadlineExceeded) and own_deadline:
                # Our own deadline passed: let our scope say so, as a queued request's would.
                await self._clock.checkpoint_if_cancelled()
            if isinstance(error, TrioInferError):
                raise _copy_error(error, cause=error.__cause__)
            raise error

    async def _wait(
        self,
        flight: _Flight,
        key: tuple[str, int, bytes],
        deadline: float,
        own_deadline: bool,
        leader: bool,
    ) -> None:
        # Wait for *flight* among its callers, under this caller's deadline.
        flight.deadlines.append(deadline)
        if not leader and deadline > flight.deadline:
            # Out of the queue already, its checks before each attempt read the latest
            # deadline; in the queue, it keeps its place (and its deadline, until the
            # caller whose deadline it is leaves: _leave).
            flight.deadline = flight.retarget(deadline, False)
        try:
            if own_deadline:
                await flight.done.wait()
                return
            with anyio.CancelScope(deadline=deadline):
                await flight.done.wait()
                return
            # The model's queue timeout passed: it ends a wait in the queue, not a run.
            if flight.started() or (len(flight.deadlines) == 1 and flight.expire()):
                await flight.done.wait()  # its answer, or (expired) its DeadlineExceeded
                return
        except BaseException:
            self._leave(flight, key, deadline)
            raise
        self._leave(flight, key, deadline)
        raise DeadlineExceeded(
            f"a request for model {key[0]!r} reached its queue timeout waiting for an "
            "identical request to run; nothing was computed for it"
        )

    def _leave(self, flight: _Flight, key: tuple[str, int, bytes], deadline: float) -> None:
        # A caller gave up waiting for *flight*: the others keep it, or nobody does.
        if flight.done.is_set():
            return
        deadlines = flight.deadlines
        deadlines.remove(deadline)
        if not deadlines:
            # Nobody waits: stop the computation, and let the next caller start another.
            if self._flights.get(key) is flight:
                del self._flights[key]
            flight.scope.cancel()
            return
        latest = max(deadlines)
        if flight.deadline < latest:
            # It had the deadline of one who left, and would expire with those who stay.
            flight.deadline = flight.retarget(latest, True)
        elif flight.deadline > latest:
            # Nobody waits that long any more: expire it when the last of them would.
            flight.deadline = flight.retarget(latest, False)

    async def _compute(
        self,
        key: tuple[str, int, bytes],
        counters: _Counters,
        flight: _Flight,
        compute: Callable[[], Awaitable[Computed]],
        spent: float,
    ) -> None:
        # The task computing *flight*: what it ends with is every waiting caller's.
        try:
            with flight.scope:
                if flight.scope.cancel_called:
                    return  # every caller left before it started: nothing reaches the model
                try:
                    outputs, keep, origin = await compute()
                except Exception as exc:  # every caller's; it must not end the engine's tasks
                    flight.error = exc
                else:
                    inserting = self._clock.current_time()
                    flight.computed = outputs
                    flight.outputs = self._store(key, counters, outputs, keep)
                    flight.origin = None if keep else origin
                    spent += self._clock.current_time() - inserting
        finally:
            counters.miss.observe(spent)
            if self._flights.get(key) is flight:
                del self._flights[key]
            flight.done.set()

    def _store(
        self, key: tuple[str, int, bytes], counters: _Counters, outputs: Outputs, keep: bool
    ) -> Outputs:
        # Copies: a caller's answer is a view of its batch's output, which would
        # keep the whole batch alive and could be written to by its caller.
        stored: Outputs = {}
        size = ENTRY_OVERHEAD
        for name, array in outputs.items():
            copy = np.array(array, copy=True)
            copy.flags.writeable = False
            stored[name] = copy
            size += ARRAY_OVERHEAD + _nbytes(copy)
        if not keep or size > self.size or key[1] != self._generations.get(key[0], 0):
            return stored  # answers those waiting now; not kept
        while self.bytes + size > self.size:
            (model, _, _), (_, evicted) = self._entries.popitem(last=False)
            owner = self._counters[model]
            owner.evictions += 1
            owner.entries -= 1
            owner.bytes -= evicted
            self.bytes -= evicted
        self._entries[key] = (stored, size)
        self.bytes += size
        counters.entries += 1
        counters.bytes += size
        return stored

    def forget(self, model: str, *, restart: bool = False) -> None:
        """Drop *model*'s answers and start its next generation.

        For a model loaded again or unloaded: its answers may no longer hold,
        and an answer still being computed by the old one is neither kept nor
        given to requests that arrive from now on. With *restart* (the model
        itself was loaded again, not one of its pipeline's steps), its counters
        start again too, as the model's other statistics do.
        """
        self._generations[model] = self._generations.get(model, 0) + 1
        for key in [k for k in self._entries if k[0] == model]:
            _, size = self._entries.pop(key)
            self.bytes -= size
        counters = self._counters.get(model)
        if counters is not None:
            counters.entries = counters.bytes = 0
        if restart:
            # Requests still answering on the old model count in the old object.
            self._counters.pop(model, None)

    def statistics(self, model: str) -> CacheStatistics:
        """A snapshot of *model*'s counters."""
        c = self._counters.get(model) or _Counters()
        return CacheStatistics(
            c.hits, c.misses, c.coalesced, c.evictions, c.entries, c.bytes,
            c.hit.snapshot(), c.miss.snapshot(), c.failed,
        )  # fmt: skip


def digest(inputs: Arrays) -> bytes:
    """A 128-bit BLAKE2b digest of every input's name, dtype, shape and contents.

    128 bits make a collision between two different requests practically
    impossible (Triton's cache uses 64 and documents collisions as a risk).
    """
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(inputs):
        array = inputs[name]
        h.update(f"{name}\0{array.dtype.str}\0{array.shape}\0".encode())
        if array.dtype == np.object_:
            for item in array.ravel():
                # surrogatepass: a str holding a lone surrogate (Python allows it) has a
                # key too, distinct from every other str's, rather than an encoding error.
                data = (
                    item if isinstance(item, bytes) else str(item).encode("utf-8", "surrogatepass")
                )
                h.update(len(data).to_bytes(8, "little"))
                h.update(data)
        else:
            h.update(np.ascontiguousarray(array).view(np.uint8).data)
    return h.digest()


def _nbytes(array: np.ndarray[Any, Any]) -> int:
    if array.dtype != np.object_:
        return int(array.nbytes)
    return int(array.nbytes) + sum(sys.getsizeof(item) for item in array.ravel())
