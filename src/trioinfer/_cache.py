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
for its answer instead of computing again (request coalescing). The first
caller computes under its own deadline; if it gives up (cancelled, or its
deadline passes), a waiting caller takes the computation over under its own,
rather than failing with it.
"""

from __future__ import annotations

import collections
import hashlib
import sys
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, final

import anyio
import anyio.lowlevel
import attrs
import numpy as np

from ._exceptions import DeadlineExceeded, TrioInferError
from ._request import Outputs
from ._runner import DURATION_BUCKETS, Histogram, _copy_error, _Histogram
from ._threads import LoopClock

Arrays = Mapping[str, np.ndarray[Any, Any]]


@attrs.frozen
class CacheStatistics:
    """One model's use of the engine's response cache, in ``ModelStatistics.cache``.

    A request of a model with the cache on counts in *hits* when answered
    from the cache, in *misses* when it computes (so does one that takes a
    computation over), in *coalesced* when it gets the answer of an
    identical request computed meanwhile, and in *failed* when it gets that
    request's error instead; one that waited and left counts in none.

    Attributes:
        hits: Requests answered from the cache, without queueing.
        misses: Requests that were computed (the first of identical ones in flight).
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
    # One computation that identical requests wait for.
    __slots__ = ("done", "error", "origin", "outputs")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.outputs: Outputs | None = None
        self.error: TrioInferError | None = None
        self.origin: object = None


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
        self, model: str, inputs: Arrays, compute: Callable[[], Awaitable[Computed]]
    ) -> tuple[Outputs, object]:
        """The cached answer to *inputs*, or an identical request's, or ``compute()``'s.

        With the answer comes the origin ``compute()`` gave with it when it
        was an identical request's, not kept (a fallback's); ``None`` otherwise.

        Raises:
            TrioInferError: What ``compute()`` raised, for its caller and for
                those who waited for it (each their own copy); a caller who
                gave up hands the computation to one who waits instead.
        """
        key = (model, self._generations.get(model, 0), digest(inputs))
        counters = self._counters.setdefault(model, _Counters())
        started = self._clock.current_time()
        while True:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                counters.hits += 1
                counters.hit.observe(self._clock.current_time() - started)
                # A hit never waits: give the event loop its turn (and a scope
                # that expired, its chance to fire) as a queued request would.
                await anyio.lowlevel.checkpoint()
                return dict(entry[0]), None
            flight = self._flights.get(key)
            if flight is None:
                break
            await flight.done.wait()
            if flight.outputs is not None:
                counters.coalesced += 1
                return dict(flight.outputs), flight.origin
            if flight.error is not None:
                counters.failed += 1
                raise _copy_error(flight.error, cause=flight.error.__cause__)
            # Its caller gave up without an answer: take the computation over.
        flight = self._flights[key] = _Flight()
        counters.misses += 1
        # A miss is timed as Triton times it: the lookup and the insert, not the compute.
        spent = self._clock.current_time() - started
        try:
            outputs, keep, origin = await compute()
        except TrioInferError as exc:
            if not isinstance(exc, DeadlineExceeded):  # the caller's own deadline: not theirs
                flight.error = exc
            raise
        else:
            inserting = self._clock.current_time()
            flight.outputs = self._store(key, counters, outputs, keep)
            flight.origin = None if keep else origin
            spent += self._clock.current_time() - inserting
            return outputs, None
        finally:
            counters.miss.observe(spent)
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
