"""The ``fifo`` scheduler: first come, first served."""

from __future__ import annotations

from collections import OrderedDict
from typing import final

from trioinfer.lowlevel import Request

from ._options import already_held


@final
class FifoScheduler:
    """First come, first served: requests run in the order they were admitted.

    Push, pop and remove are O(1): an insertion-ordered dict keyed by request.
    Takes no options.
    """

    __slots__ = ("_queue",)

    def __init__(self) -> None:
        self._queue: OrderedDict[Request, None] = OrderedDict()

    def push(self, request: Request) -> None:
        """Add *request* at the back.

        Raises:
            ValueError: *request* is held already (each request is pushed once).
        """
        queue = self._queue
        if request in queue:
            already_held("fifo", request)
        queue[request] = None

    def peek(self) -> Request:
        """Return the oldest request without removing it; ``IndexError`` if empty."""
        try:
            return next(iter(self._queue))
        except StopIteration:
            raise IndexError("peek into an empty FifoScheduler") from None

    def pop(self) -> Request:
        """Remove and return the oldest request; ``IndexError`` if empty."""
        try:
            return self._queue.popitem(last=False)[0]
        except KeyError:
            raise IndexError("pop from an empty FifoScheduler") from None

    def remove(self, request: Request) -> bool:
        """Remove *request* if held; return whether it was."""
        return self._queue.pop(request, False) is None

    def __len__(self) -> int:
        return len(self._queue)
