"""The ``lifo`` scheduler: the newest waiting request runs first."""

from __future__ import annotations

from collections import OrderedDict
from typing import final

from trioinfer.lowlevel import Request


@final
class LifoScheduler:
    """Last in, first out: under overload, serve the callers who just came.

    The oldest requests wait longest, and their callers' deadlines take them
    out of the queue; a fresh request is one whose caller surely still waits.
    Every method is O(1): an insertion-ordered dict keyed by request (requests
    hash by identity). Takes no options.
    """

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: OrderedDict[Request, None] = OrderedDict()

    def push(self, request: Request) -> None:
        """Add *request* on top: each request is pushed once, when admitted.

        Raises:
            ValueError: *request* is held already (a second push would count it twice).
        """
        if request in self._held:
            raise ValueError(f"lifo scheduler: request {request.id!r} is already queued")
        self._held[request] = None

    def peek(self) -> Request:
        """Return the newest request; ``IndexError`` if none is held."""
        if not self._held:
            raise IndexError("peek into an empty LifoScheduler")
        return next(reversed(self._held))

    def pop(self) -> Request:
        """Remove and return the newest request; ``IndexError`` if none is held."""
        if not self._held:
            raise IndexError("pop from an empty LifoScheduler")
        return self._held.popitem(last=True)[0]

    def remove(self, request: Request) -> bool:
        """Forget *request* (its caller gave up); return whether it was held."""
        return self._held.pop(request, False) is None

    def __len__(self) -> int:
        """The number of requests held."""
        return len(self._held)
