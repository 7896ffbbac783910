"""The dynamic batcher: size-or-delay dispatch with preferred sizes, as in Triton."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, final

import anyio
import numpy as np

from trioinfer import ConfigError
from trioinfer.lowlevel import BatcherContext, Request, RequestQueue, Status, check_seconds

from ._padding import Arrays, Padding, Split

# Enum members read once: Status.X costs a metaclass lookup on every use (Python 3.11).
_QUEUED = Status.QUEUED

# Why filling a batch stopped.
_FULL = 0  # max_batch_size rows reached
_BLOCKED = 1  # the next request is incompatible or would overflow: it starts the next batch
_EMPTY = 2  # nothing more is waiting right now

# What must match for requests to share a batch: without padding, (input name,
# non-batch dims, dtype) for every input of a request.
_Key = object


class DynamicBatcher:
    """Groups waiting requests into one execution: dispatch on size or on delay.

    The entry point is ``dynamic``; its options are the model's
    ``batcher_options``:

    ```toml
    batcher = "dynamic"
    batcher_options = { max_batch_size = 32, max_queue_delay = 0.005 }
    ```

    When an instance is free, the batcher takes the first request in the
    scheduler's order, then the next ones, in that order, while they are
    *compatible* with it (every input has the same non-batch dimensions and
    dtype) and fit (the rows stay within ``max_batch_size``). It dispatches:

    - at once when the batch holds ``max_batch_size`` rows;
    - at once when the next waiting request is incompatible or would overflow
      the batch: that request starts the next batch. The batcher never skips
      ahead of it, so the scheduler's order holds;
    - when the oldest request in the batch has waited ``max_queue_delay``
      since it arrived, counted from its admission, not from when the batcher
      saw it. So a request waits at most ``max_queue_delay`` for company once
      an instance is free, and one that already waited that long while every
      instance was busy leaves at once with whatever is queued behind it;
    - with ``preferred_batch_sizes``, at once when a preferred size can be
      formed from what is waiting: the batch is cut at the largest preferred
      size it reaches, and the requests after the cut head the next batch.
      When nothing preferred can be formed, the size-or-delay rules apply.
      Without the option, the sizes the model's backend advertises
      ([`RequestQueue.preferred_batch_sizes`][trioinfer.lowlevel.RequestQueue], e.g.
      from the ONNX Runtime backend's ``tune_batch_sizes``) are used.

    The delay trades latency for throughput: each execution has a fixed cost
    (a thread hop, a kernel launch), so more rows per execution serve more
    requests per second, at the price of up to ``max_queue_delay`` extra
    latency for a request that arrives when the queue is quiet.

    Some edge cases:

    - A request with more rows than ``max_batch_size`` is never split: it runs
      alone, at once. Every other batch has at most ``max_batch_size`` rows.
    - A model without a batch dimension (a fixed or missing first dimension,
      as [`RequestQueue.batched`][trioinfer.lowlevel.RequestQueue] says) cannot
      concatenate requests: the batcher then sends one request per execution.
    - Requests whose caller left while they waited in a partial batch are
      dropped before it is returned; requests whose deadline passed are dropped
      by the queue (and, at the last moment, by the engine), never computed.
    - Requests taken from the queue beyond a preferred-size cut go back to
      the head of the queue, in order, and open the model's next batch.

    The outputs each caller receives are views into the batch's output arrays,
    not copies: see the tutorial "Tuning dynamic batching".

    With ``pad_axis`` and ``pad_buckets``, requests that differ in one ragged
    dimension (a sequence length) share a batch too: each is padded to the
    smallest bucket that holds its length, and only requests of the same
    bucket (and the same other dimensions and dtypes) go together. A request
    longer than the largest bucket is not padded: it shares a batch only with
    requests of exactly its length. Each caller gets its own rows of every
    output and, for the outputs named in ``ragged_outputs``, only its own
    length on their ragged axis: the padding never reaches a caller. A request
    whose ragged inputs disagree on the length (or one of which lacks the
    axis) is not padded either and shares a batch only with identical shapes.
    Without ``pad_axis`` the batcher leaves concatenating and splitting to the
    engine, which pools its buffers.

    Args:
        max_batch_size: Most rows (the sum of the requests' first dimensions)
            in one batch. A positive integer.
        max_queue_delay: Longest a request waits for others to join its batch,
            in seconds, counted from its arrival. A finite number >= 0; 0 sends
            whatever is waiting whenever an instance is free.
        preferred_batch_sizes: Row counts to dispatch at once as soon as they
            can be formed (e.g. the batch sizes a TensorRT engine was built for).
            Strictly increasing positive integers, none above ``max_batch_size``.
            Empty (the default): those the backend advertises, if any.
        pad_axis: The axis of the ragged dimension, >= 1 (axis 0 is the batch),
            the same in every padded input. Unset: no padding.
        pad_buckets: The lengths requests are padded to, strictly increasing
            positive integers; required with ``pad_axis``.
        pad_value: What fills the padding, cast to each input's dtype; default 0.
        pad_values: Per-input overrides of ``pad_value``, by input name.
        pad_inputs: The inputs that hold the ragged dimension. Default: every
            input with more than ``pad_axis`` dimensions.
        mask_input: An input that masks the ragged axis (an attention mask):
            its padding is always 0, so the model ignores padded positions.
            Callers send it as usual, covering their real positions.
        ragged_outputs: Output name to the axis (>= 1) that holds the ragged
            dimension in that output; each caller's share is cut back to its
            own length there. Other outputs are split on axis 0 only.

    Raises:
        ConfigError: An option has the wrong type or an impossible value.
    """

    __slots__ = ("_delay", "_key", "_max", "_padding", "_preferred")

    def __new__(cls, *, pad_axis: int | None = None, **_options: object) -> DynamicBatcher:
        # As pathlib.Path picks PosixPath: with padding, the batcher is one with an
        # assemble() hook (a trioinfer.abc.AssemblingBatcher); without, the engine
        # finds no hook and keeps its own pooled concatenation, the fast path.
        if cls is DynamicBatcher and pad_axis is not None:
            cls = _PaddingBatcher
        return super().__new__(cls)

    def __init__(
        self,
        *,
        max_batch_size: int = 32,
        max_queue_delay: float = 0.005,
        preferred_batch_sizes: Sequence[int] = (),
        pad_axis: int | None = None,
        pad_buckets: Sequence[int] = (),
        pad_value: float = 0,
        pad_values: Mapping[str, float] | None = None,
        pad_inputs: Sequence[str] | None = None,
        mask_input: str | None = None,
        ragged_outputs: Mapping[str, int] | None = None,
    ) -> None:
        self._max = _check_size("max_batch_size", max_batch_size)
        self._delay = _check_delay(max_queue_delay)
        self._preferred = _check_preferred(preferred_batch_sizes, self._max)
        self._padding = Padding.from_options(
            pad_axis=pad_axis,
            pad_buckets=pad_buckets,
            pad_value=pad_value,
            pad_values={} if pad_values is None else pad_values,
            pad_inputs=pad_inputs,
            mask_input=mask_input,
            ragged_outputs={} if ragged_outputs is None else ragged_outputs,
        )
        self._key: Callable[[Arrays], _Key] = _key
        if self._padding is not None:
            self._key = self._padding.key

    @property
    def max_batch_size(self) -> int:
        """Most rows in one batch (a single bigger request still runs, alone)."""
        return self._max

    @property
    def max_queue_delay(self) -> float:
        """Longest a request waits for others to join its batch, in seconds."""
        return self._delay

    @property
    def preferred_batch_sizes(self) -> tuple[int, ...]:
        """The configured row counts dispatched as soon as they can be formed, increasing.

        Empty when the option is not set; the batcher then uses the backend's.
        """
        return tuple(sorted(self._preferred))

    @property
    def pad_buckets(self) -> tuple[int, ...]:
        """The lengths the ragged axis is padded to; empty without padding."""
        return () if self._padding is None else self._padding.buckets

    def __repr__(self) -> str:
        padding = "" if self._padding is None else ", " + self._padding.describe()
        return (
            f"DynamicBatcher(max_batch_size={self._max}, max_queue_delay={self._delay}, "
            f"preferred_batch_sizes={list(self.preferred_batch_sizes)}{padding})"
        )

    async def next_batch(self, queue: RequestQueue) -> list[Request]:
        """Wait until a batch should be dispatched and return its requests, in order.

        Waits for a first request, then at most until the oldest request in
        the batch has waited ``max_queue_delay``; returns earlier when the
        batch is full, when a preferred size is formed, or when the next
        waiting request cannot join. If cancelled, gives every request it
        holds back with [`RequestQueue.put_back()`][trioinfer.lowlevel.RequestQueue.put_back].
        """
        batch: list[Request] = []
        try:
            while not batch:  # empty again when every caller in it left
                batch.append(await _first(queue))
                await self._grow(queue, batch)
        except BaseException:
            queue.put_back(batch)
            raise
        return batch

    async def _grow(self, queue: RequestQueue, batch: list[Request]) -> None:
        """Add to *batch* (one request so far) until it should go; it may end up empty."""
        first = batch[0]
        if first.rows >= self._max or not queue.batched or _unbatchable(first.inputs):
            return
        # A uniform queue's requests all fit together (and padding has nothing to
        # tell apart): no key to compare, and the queue hands them over in bulk.
        key = None if queue.uniform and self._padding is None else self._key(first.inputs)
        rows = first.rows
        while True:
            rows, stop = self._fill(queue, batch, key, rows)
            preferred = self._preferred or queue.preferred_batch_sizes
            if preferred:
                cut = _preferred_cut(batch, preferred)
                if cut:
                    # What is past the cut opens the next batch, from the head of the
                    # queue: the batcher keeps nothing from one batch to the next.
                    queue.put_back(batch[cut:])
                    del batch[cut:]
                    return
            if stop != _EMPTY:
                return
            flush_at = min(request.arrival for request in batch) + self._delay
            if anyio.current_time() >= flush_at:
                return
            with anyio.CancelScope(deadline=flush_at):
                await queue.wait_not_empty()
            # Callers may have left while we waited: their rows free up, and the
            # delay now counts from the oldest request still in the batch.
            batch[:] = [request for request in batch if _live(request)]
            if not batch:
                return
            rows = sum(request.rows for request in batch)

    def _fill(
        self, queue: RequestQueue, batch: list[Request], key: _Key | None, rows: int
    ) -> tuple[int, int]:
        """Take what is waiting now, in order, while it is compatible and fits."""
        limit = self._max
        if key is None:  # a uniform queue: every request is compatible
            taken = queue.take_nowait(limit - rows)
            if taken:
                batch += taken
                for request in taken:
                    rows += request.rows
            if rows == limit:
                return rows, _FULL
            # take_nowait() stops at an empty queue, or at a live request that does not fit.
            return rows, _BLOCKED if len(queue) else _EMPTY
        while True:
            try:
                request = queue.peek_nowait()
            except anyio.WouldBlock:
                return rows, _EMPTY
            if rows + request.rows > limit or self._key(request.inputs) != key:
                return rows, _BLOCKED
            queue.pop_nowait()  # the live request peek_nowait() just returned
            batch.append(request)
            rows += request.rows
            if rows == limit:
                return rows, _FULL


@final
class _PaddingBatcher(DynamicBatcher):
    """A dynamic batcher with ``pad_axis``: it lays out its batches' inputs itself."""

    __slots__ = ()

    def attach(self, context: BatcherContext) -> None:
        """Refuse, at load, padding an axis whose size the model's signature fixes."""
        assert self._padding is not None  # DynamicBatcher.__new__ chose this class for it
        self._padding.check(context.model, context.signature)

    def assemble(self, requests: Sequence[Request]) -> tuple[Arrays, Split]:
        """Pad each request to its bucket in reused buffers; the split cuts the padding off."""
        assert self._padding is not None  # DynamicBatcher.__new__ chose this class for it
        return self._padding.assemble(requests)


def _preferred_cut(batch: list[Request], preferred: Collection[int]) -> int:
    """How many requests make the largest preferred size, or 0 if none does."""
    cut = 0
    rows = 0
    for index, request in enumerate(batch, 1):
        rows += request.rows
        if rows in preferred:
            cut = index
    return cut


async def _first(queue: RequestQueue) -> Request:
    while True:
        await queue.wait_not_empty()
        try:
            return queue.pop_nowait()
        except anyio.WouldBlock:
            continue  # every waiting request had expired


def _live(request: Request) -> bool:
    return request.status is _QUEUED and not request.abandoned


def _unbatchable(inputs: Mapping[str, np.ndarray[Any, Any]]) -> bool:
    # No axis to concatenate along: scalar inputs, or no inputs at all.
    return not inputs or any(array.ndim == 0 for array in inputs.values())


def _key(inputs: Mapping[str, np.ndarray[Any, Any]]) -> _Key:
    # The names are part of it: requests that send different inputs (one leaves a
    # model's optional input out) cannot be concatenated, as shapes that differ cannot.
    if len(inputs) == 1:  # the usual case, without a generator per request
        for name, array in inputs.items():
            return ((name, array.shape[1:], array.dtype),)
    return tuple((name, array.shape[1:], array.dtype) for name, array in inputs.items())


def _check_size(name: str, value: object) -> int:
    if not isinstance(value, int | np.integer) or isinstance(value, bool):
        raise ConfigError(
            f"batcher option {name} must be a positive integer (rows per batch), "
            f"got {value!r} of type {type(value).__name__}"
        )
    size = int(value)
    if size < 1:
        raise ConfigError(f"batcher option {name} must be a positive integer, got {size}")
    return size


def _check_delay(value: object) -> float:
    return check_seconds("batcher option max_queue_delay", value, zero=True)


def _check_preferred(value: object, max_batch_size: int) -> frozenset[int]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise ConfigError(
            "batcher option preferred_batch_sizes must be a list of positive integers, "
            f"got {value!r} of type {type(value).__name__}"
        )
    sizes = [_check_size("preferred_batch_sizes", size) for size in value]
    if any(a >= b for a, b in itertools.pairwise(sizes)):
        raise ConfigError(
            "batcher option preferred_batch_sizes must be strictly increasing, without "
            f"duplicates, got {list(sizes)}"
        )
    if sizes and sizes[-1] > max_batch_size:
        raise ConfigError(
            f"batcher option preferred_batch_sizes holds {sizes[-1]}, more than "
            f"max_batch_size {max_batch_size}; every preferred size must be <= max_batch_size"
        )
    return frozenset(sizes)
