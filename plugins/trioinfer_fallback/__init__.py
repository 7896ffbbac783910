"""First-party fallback plugins (entry-point group ``trioinfer.fallbacks``).

- ``none`` ([`NoFallback`][trioinfer_fallback.NoFallback]): run each batch once
  where the engine sent it.
- ``resilient`` ([`Resilient`][trioinfer_fallback.Resilient]): per-instance
  circuit breakers with background probing and re-creation of dead sessions,
  retries with backoff, failover to other instances, devices and models, a
  static default answer, and optional hedging.
"""

from __future__ import annotations

from typing import final

from trioinfer.lowlevel import Execution

from ._breaker import Breaker, BreakerState
from ._resilient import Resilient

__all__ = ["Breaker", "BreakerState", "NoFallback", "Resilient"]


@final
class NoFallback:
    """No retries, no failover: a failed execution fails its requests. Takes no options."""

    __slots__ = ()

    async def execute(self, execution: Execution) -> None:
        """Run the batch once, as the engine dispatched it."""
        await execution.run()
