"""The response cache: repeated requests answered without queueing, identical ones computed once.

One cache serves the whole engine, bounded in bytes and evicted least recently
used first; a model takes part when its config says ``response_cache = true``.
The key is the model's name (which holds its version when served from a
repository) and a 128-bit BLAKE2b digest of every input's name, dtype, shape
and bytes, and of the request's parameters. Only the model's own successful
answers are stored (not a fallback's default answer, nor one from another
model), as read-only copies, so that no caller can change what another
receives. Such an answer not kept still answers the identical requests
waiting for it, with its fallback steps.

Identical requests that arrive while the first is still being computed wait
for its answer instead of computing again (request coalescing). The
computation belongs to the cache, not to the caller whose miss started it (see
`Computation`: the model's request, run by its runner, or a pipeline's run in
a task of the engine's task group; nothing outlives the engine), under the
latest deadline of the callers waiting for it. A caller that gives up
(cancelled, or its deadline passed) leaves it to the others, with the work
done so far; the last one to leave cancels it, so that nothing is computed
for nobody, and a request nobody waits for never reaches a backend.
"""

from __future__ import annotations

import collections
import hashlib
import sys
from collections.abc import Callable, Mapping
from typing import Any, Protocol, final

import anyio
import anyio.lowlevel
import attrs
import numpy as np

from ._exceptions import DeadlineExceeded, TrioInferError
from ._request import Outputs
from ._runner import DURATION_BUCKETS, Histogram, _copy_error, _Histogram
from ._threads import EventLike, LoopClock

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


class Event(EventLike, Protocol):
    """An event many tasks may wait for: trio's, asyncio's."""

    def is_set(self) -> bool:
        """Whether it was set."""


class Computation(Protocol):
    """One computation of an answer, for every identical request waiting for it.

    Made by the engine for a miss: the model's request, admitted to its queue
    and run by its runner (no task of its own: the engine's runner owns it),
    or a pipeline's run in a task of the engine's task group. Either way
    nothing of it outlives the engine, and it ends on its own: no caller's
    task carries it, so a caller that leaves does not end it.
    """

    #: Set when it ends (computed, failed, or abandoned).
    done: Event

    def start(self) -> None:
        """Start it, or raise why it cannot start (a full queue, say)."""

    def outcome(self) -> Computed | BaseException:
        """Once done: the answer, whether to keep it and where it came from; or the error."""

    def abandon(self) -> None:
        """Nobody waits any more: take it out of the queue, or abort its run."""

    def retarget(self, deadline: float, requeue: bool) -> float:
        """Move its deadline towards *deadline*; return the one it has now.

        *requeue*: also while queued, where the scheduler may order by deadline
        (it then loses its place); without, only once out of the queue.
        """

    def started(self) -> bool:
        """Whether it has left the queue (a run is never cut by a queue timeout)."""

    def expire(self) -> bool:
        """End it, still queued, as expired (the last caller's queue timeout); False: cannot."""


#: A cached answer's key: the model, its generation, the digest of the inputs and
#: parameters, and the outputs the request asked for (empty: all).
_Key = tuple[str, int, bytes, tuple[str, ...]]


@final
class _Flight:
    # A computation that identical requests wait for, and what it ended with.
    __slots__ = (
        "computation", "computed", "counters", "deadline", "deadlines", "done", "error",
        "finished", "key", "origin", "outputs", "spent",
    )  # fmt: skip

    def __init__(
        self,
        key: _Key,
        counters: _Counters,
        computation: Computation,
        deadline: float,
        spent: float,
    ) -> None:
        self.key = key
        self.counters = counters
        self.computation = computation
        self.done = computation.done
        self.finished = False
        self.outputs: Outputs | None = None  # the cache's read-only copy, for those who waited
        self.computed: Outputs | None = None  # as computed: the caller who started it gets these
        self.error: BaseException | None = None
        self.origin: object = None
        # The deadline of each caller waiting for it, and the one the computation has
        # (its first caller's at first), moved towards the latest of theirs (_wait, _leave).
        self.deadlines: list[float] = []
        self.deadline = deadline
        # Its time in the cache, as Triton's cache_miss: the lookup, then the insert.
        self.spent = spent


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
        self._entries: collections.OrderedDict[_Key, tuple[Outputs, int]] = (
            collections.OrderedDict()
        )
        self._flights: dict[_Key, _Flight] = {}
        self._generations: dict[str, int] = {}
        self._counters: dict[str, _Counters] = {}
        self._clock = LoopClock()

    async def answer(
        self,
        model: str,
        inputs: Arrays,
        computation: Callable[[], Computation],
        *,
        deadline: float,
        own_deadline: bool,
        parameters: Mapping[str, object] | None = None,
        requested_outputs: tuple[str, ...] = (),
    ) -> tuple[Outputs, object, bool]:
        """The cached answer to *inputs*, or that of a computation under way, or a new one's.

        A miss starts ``computation()``, and every identical request arriving
        meanwhile waits for it too. It goes on while anyone waits: a caller
        that leaves (cancelled, or its deadline passed) leaves it to the
        others, its deadline moved to the latest of theirs; the last one to
        leave abandons it, so that nothing is computed for nobody. *deadline*
        is this caller's; *own_deadline* False: the model's queue timeout,
        which ends the wait of a request still queued (`DeadlineExceeded`),
        never one running. *parameters* and *requested_outputs*, the request's,
        are part of the key (a model may answer the requested outputs alone).

        Returns:
            The answer; the origin ``computation()`` gave with it when it was
            another request's, not kept (a fallback's), ``None`` otherwise;
            and whether this caller started the computation (its own request
            holds the answer and where it came from).

        Raises:
            TrioInferError: What the computation ended with, for each caller
                waiting for it (each their own copy), or what refused it.
        """
        key = (
            model,
            self._generations.get(model, 0),
            digest(inputs, parameters),
            requested_outputs,
        )
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
                return dict(entry[0]), None, False
            flight = self._flights.get(key)
            leader = flight is None
            if flight is None:
                counters.misses += 1
                # A miss is timed as Triton times it: the lookup and the insert, not the compute.
                lookup = self._clock.current_time() - started_at
                made = computation()
                try:
                    made.start()
                except BaseException:
                    counters.miss.observe(lookup)
                    raise
                flight = self._flights[key] = _Flight(key, counters, made, deadline, lookup)
            await self._wait(flight, deadline, own_deadline, leader)
            self._finish(flight)
            if flight.outputs is not None:
                if leader:
                    assert flight.computed is not None
                    return flight.computed, None, True
                counters.coalesced += 1
                return dict(flight.outputs), flight.origin, False
            error = flight.error
            assert error is not None
            if (
                not leader
                and isinstance(error, DeadlineExceeded)
                and self._clock.current_time() < deadline
            ):
                # Expired in the queue just as the caller whose deadline it had left,
                # before it could be moved to ours: nothing was computed; again.
                continue
            if not leader:
                counters.failed += 1
            if isinstance(error, DeadlineExceeded) and own_deadline:
                # Our own deadline passed: let our scope say so, as a queued request's would.
                await self._clock.checkpoint_if_cancelled()
            if isinstance(error, TrioInferError):
                raise _copy_error(error, cause=error.__cause__)
            raise error

    async def _wait(
        self, flight: _Flight, deadline: float, own_deadline: bool, leader: bool
    ) -> None:
        # Wait for *flight* among its callers, under this caller's deadline.
        flight.deadlines.append(deadline)
        computation = flight.computation
        if not leader and deadline > flight.deadline:
            # Out of the queue already, its checks before each attempt read the latest
            # deadline; in the queue, it keeps its place (and its deadline, until the
            # caller whose deadline it is leaves: _leave).
            flight.deadline = computation.retarget(deadline, False)
        try:
            if own_deadline:
                await flight.done.wait()
                return
            with anyio.CancelScope(deadline=deadline):
                await flight.done.wait()
                return
            # The model's queue timeout passed: it ends a wait in the queue, not a run;
            # the last caller's ends the computation there, expired, as the model's own.
            if computation.started() or (len(flight.deadlines) == 1 and computation.expire()):
                await flight.done.wait()
                return
        except BaseException:
            self._leave(flight, deadline)
            raise
        self._leave(flight, deadline)
        raise DeadlineExceeded(
            f"a request for model {flight.key[0]!r} reached its queue timeout waiting for an "
            "identical request to run; nothing was computed for it"
        )

    def _leave(self, flight: _Flight, deadline: float) -> None:
        # A caller gave up waiting for *flight*: the others keep it, or nobody does.
        if flight.done.is_set():
            self._finish(flight)  # it ended as the caller left: its answer is kept still
            return
        deadlines = flight.deadlines
        deadlines.remove(deadline)
        if not deadlines:
            # Nobody waits: abandon it, and let the next caller start another.
            flight.finished = True
            if self._flights.get(flight.key) is flight:
                del self._flights[flight.key]
            flight.counters.miss.observe(flight.spent)
            flight.computation.abandon()
            return
        latest = max(deadlines)
        if flight.deadline < latest:
            # It had the deadline of one who left, and would expire with those who stay.
            flight.deadline = flight.computation.retarget(latest, True)
        elif flight.deadline > latest:
            # Nobody waits that long any more: expire it when the last of them would.
            flight.deadline = flight.computation.retarget(latest, False)

    def _finish(self, flight: _Flight) -> None:
        # The first caller to wake after *flight* ended stores its answer, for all.
        if flight.finished:
            return
        flight.finished = True
        key = flight.key
        if self._flights.get(key) is flight:
            del self._flights[key]
        outcome = flight.computation.outcome()
        if isinstance(outcome, BaseException):
            flight.error = outcome
        else:
            outputs, keep, origin = outcome
            inserting = self._clock.current_time()
            flight.computed = outputs
            flight.outputs = self._store(key, flight.counters, outputs, keep)
            flight.origin = None if keep else origin
            flight.spent += self._clock.current_time() - inserting
        flight.counters.miss.observe(flight.spent)

    def _store(self, key: _Key, counters: _Counters, outputs: Outputs, keep: bool) -> Outputs:
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
            (model, _, _, _), (_, evicted) = self._entries.popitem(last=False)
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


def digest(inputs: Arrays, parameters: Mapping[str, object] | None = None) -> bytes:
    """A 128-bit BLAKE2b digest of every input's name, dtype, shape and contents, and *parameters*.

    Two requests that differ only in their parameters (``temperature`` 0.1 and
    0.9) differ in key; a parameter's type counts (``1``, ``1.0`` and
    ``True`` are three keys), as the model may tell them apart.

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
    if parameters:
        # After a marker no input's header can make (it holds no NUL-separated shape).
        h.update(b"\0parameters\0")
        for key in sorted(parameters):
            value = parameters[key]
            h.update(repr((key, type(value).__name__, value)).encode("utf-8", "surrogatepass"))
            h.update(b"\0")
    return h.digest()


def _nbytes(array: np.ndarray[Any, Any]) -> int:
    if array.dtype != np.object_:
        return int(array.nbytes)
    return int(array.nbytes) + sum(sys.getsizeof(item) for item in array.ravel())
