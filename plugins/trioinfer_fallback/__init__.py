"""First-party fallback plugins (entry-point group ``trioinfer.fallbacks``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, final

import numpy as np

from trioinfer import Request

__all__ = ["NoFallback"]


@final
class NoFallback:
    """No retries, no failover: a failed execution fails its requests. Takes no options."""

    __slots__ = ()

    async def execute(
        self,
        requests: Sequence[Request],
        call: Callable[[], Awaitable[dict[str, np.ndarray[Any, Any]]]],
    ) -> dict[str, np.ndarray[Any, Any]]:
        """Run the batch once, as the engine dispatched it."""
        return await call()
