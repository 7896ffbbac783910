"""A circuit breaker's state machine, without I/O; the `resilient` fallback has one per instance."""

from __future__ import annotations

import collections
import enum
import math
from collections.abc import Mapping
from typing import Any, final

from trioinfer import ConfigError
from trioinfer.lowlevel import check_seconds


class BreakerState(enum.Enum):
    """Where a [`Breaker`][trioinfer_fallback.Breaker] is."""

    CLOSED = "closed"
    """Calls go through; failures are counted."""
    OPEN = "open"
    """The instance is out of service until `reset_timeout` has passed."""
    HALF_OPEN = "half_open"
    """Probes test the instance; enough successes close the breaker, one failure reopens it."""


@final
class Breaker:
    """Consecutive-failure and failure-rate circuit breaker (pybreaker's state machine).

    Closed -> open after `fail_max` consecutive failures, or when at least
    `failure_rate` of the last `window` calls failed (once `window` calls
    were seen); open -> half-open when the owner decides `reset_timeout`
    has passed; half-open -> closed after `probes` successes in a row, or
    back to open on a failure. Each reopening doubles the wait, up to
    `max_reset_timeout`. The breaker only records; its owner acts on it.

    Args:
        fail_max: Consecutive failures that open it.
        failure_rate: Failed share of the last *window* calls that opens it
            (``None``: consecutive failures only).
        window: How many recent calls the rate looks at.
        reset_timeout: Seconds open before the first probe.
        max_reset_timeout: Longest wait between probes after repeated reopening.
        probes: Successful probes in a row that close it.

    Raises:
        ConfigError: An option out of range.
    """

    __slots__ = (
        "_consecutive",
        "_failures_in_window",
        "_recent",
        "_successes",
        "fail_max",
        "failure_rate",
        "max_reset_timeout",
        "probes",
        "reset_timeout",
        "state",
        "wait",
        "window",
    )

    def __init__(
        self,
        *,
        fail_max: int = 5,
        failure_rate: float | None = None,
        window: int = 20,
        reset_timeout: float = 30.0,
        max_reset_timeout: float = 300.0,
        probes: int = 1,
    ) -> None:
        self.fail_max = _count("fail_max", fail_max)
        if failure_rate is not None and not (
            # bool is an int, and True would pass as 1.0: refused, as every other option refuses it
            isinstance(failure_rate, (int, float))
            and not isinstance(failure_rate, bool)
            and 0.0 < failure_rate <= 1.0
        ):
            raise ConfigError(
                f"breaker option failure_rate must be a share in (0, 1] or unset, "
                f"got {failure_rate!r}"
            )
        self.failure_rate = failure_rate
        self.window = _count("window", window)
        self.reset_timeout = _seconds("reset_timeout", reset_timeout)
        self.max_reset_timeout = max(
            _seconds("max_reset_timeout", max_reset_timeout), self.reset_timeout
        )
        self.probes = _count("probes", probes)
        self.state = BreakerState.CLOSED
        #: Seconds to stay open before the next probe.
        self.wait = self.reset_timeout
        self._consecutive = 0
        self._recent: collections.deque[bool] = collections.deque(maxlen=self.window)
        self._failures_in_window = 0
        self._successes = 0

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> Breaker:
        """Build one from a config table, naming unknown keys in the error.

        Raises:
            ConfigError: Unknown keys or values out of range.
        """
        if not isinstance(options, Mapping):
            raise ConfigError(
                f"fallback option breaker must be a table of breaker options, got {options!r}"
            )
        known = {
            "fail_max", "failure_rate", "window", "reset_timeout", "max_reset_timeout", "probes"
        }  # fmt: skip
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(
                f"unknown breaker options {unknown}; known: {', '.join(sorted(known))}"
            )
        return cls(**options)

    def _record(self, failed: bool) -> None:
        if len(self._recent) == self._recent.maxlen and self._recent[0]:
            self._failures_in_window -= 1
        self._recent.append(failed)
        self._failures_in_window += failed

    def success(self) -> bool:
        """Record a successful call or probe; return whether the breaker closed now."""
        if self.state is BreakerState.HALF_OPEN:
            self._successes += 1
            if self._successes >= self.probes:
                self.close()
                return True
            return False
        self._consecutive = 0
        self._record(False)
        return False

    def failure(self) -> bool:
        """Record a failed call or probe; return whether the breaker opened now."""
        if self.state is BreakerState.OPEN:
            return False
        if self.state is BreakerState.HALF_OPEN:
            self.wait = min(self.wait * 2, self.max_reset_timeout)
            self.state = BreakerState.OPEN
            return True
        self._consecutive += 1
        self._record(True)
        rate = self.failure_rate
        if self._consecutive >= self.fail_max or (
            rate is not None
            and len(self._recent) == self.window
            and self._failures_in_window >= math.ceil(rate * self.window)
        ):
            self.state = BreakerState.OPEN
            return True
        return False

    def trip(self) -> bool:
        """Open it now, whatever the counts (its instance is known dead); whether it opened now."""
        if self.state is BreakerState.OPEN:
            return False
        self.state = BreakerState.OPEN
        return True

    def half_open(self) -> None:
        """Let probes through: the owner calls it once `wait` has passed."""
        self.state = BreakerState.HALF_OPEN
        self._successes = 0

    def close(self) -> None:
        """Back to normal: counts and the reopening wait start afresh."""
        self.state = BreakerState.CLOSED
        self.wait = self.reset_timeout
        self._consecutive = 0
        self._recent.clear()
        self._failures_in_window = 0

    def describe(self) -> str:
        """Why it opened, for logs and the instance's ``reason``."""
        if self._consecutive >= self.fail_max:
            n = self._consecutive
            return f"{n} consecutive failure{'s' if n != 1 else ''}"
        return f"{self._failures_in_window} of the last {len(self._recent)} calls failed"


def _count(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"breaker option {name} must be a positive integer, got {value!r}")
    return value


def _seconds(name: str, value: object) -> float:
    return check_seconds(f"breaker option {name}", value, zero=True)
