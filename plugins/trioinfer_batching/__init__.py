"""First-party batcher plugins (entry-point group ``trioinfer.batchers``).

- ``none`` ([`NoBatcher`][trioinfer_batching.NoBatcher]): one request per
  execution, the default.
- ``dynamic`` ([`DynamicBatcher`][trioinfer_batching.DynamicBatcher]): groups
  compatible requests, dispatching on size, on delay, or at a preferred size.
- ``sequence`` ([`SequenceBatcher`][trioinfer_batching.SequenceBatcher]): for
  stateful models (a ``[sequence]`` config): each sequence on one instance,
  its requests in order, with control inputs and implicit state.
"""

from __future__ import annotations

from typing import final

import anyio

from trioinfer.lowlevel import Request, RequestQueue

from ._dynamic import DynamicBatcher as DynamicBatcher
from ._sequence import SequenceBatcher as SequenceBatcher

__all__ = ["DynamicBatcher", "NoBatcher", "SequenceBatcher"]


@final
class NoBatcher:
    """One request per execution, dispatched as soon as an instance is free.

    Takes no options. Adds no delay, so it suits models that see little
    concurrency or cannot batch.
    """

    __slots__ = ()

    @property
    def max_batch_size(self) -> None:
        """None: a batch is one request, of however many rows it sends."""
        return None

    async def next_batch(self, queue: RequestQueue) -> list[Request]:
        """Wait for a live request and return it alone."""
        while True:
            await queue.wait_not_empty()
            try:
                return [queue.pop_nowait()]
            except anyio.WouldBlock:
                continue  # every waiting request had expired
