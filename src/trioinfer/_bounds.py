"""The ranges of durations and priority levels: one place for every key and flag that takes one.

Each number a user writes for a duration (a model's ``queue_timeouts``, a
batcher's ``max_queue_delay``, a fallback's ``reset_timeout``, ``serve
--repository-poll-secs`` ...) goes through `check_seconds`, and each priority
level a config names through `check_priority_level`, so that ``1e300`` or
``1e-300`` or a level no request can have is refused with the same words
everywhere instead of being taken as given (an overflow in Triton's
``max_queue_delay_microseconds``, a repository read in a busy loop).
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Final

from ._exceptions import ConfigError

#: The shortest duration: a microsecond. Triton's durations are whole microseconds
#: (``max_queue_delay_microseconds``, ``default_timeout_microseconds``), so anything
#: shorter is 0 there; a "positive" 1e-300 here meant polling or waking in a busy loop.
MIN_SECONDS: Final = 1e-6

#: The longest duration: the whole seconds within 2**64 - 1 microseconds (Triton's
#: uint64), about 584,542 years. Anything longer cannot go out as a Triton config, and
#: means "never" (leave the key out, or use the option's own "never" where it has one).
MAX_SECONDS: Final = float((2**64 - 1) // 10**6)

#: The priority levels a request may carry, and so a config may name: a 32-bit
#: integer's range and one more (what the HTTP and gRPC parameter ``priority`` takes).
MIN_PRIORITY: Final = -(2**31)
MAX_PRIORITY: Final = 2**31

#: The request rates of `trioinfer bench`'s open loop, per second: one request in
#: 1000 s (no window sees one) to one a microsecond (the resolution of
#: --request-intervals, and of every duration). Beyond them the schedule broke: at
#: 1e300/s every request was due at 0 ns, at 1e-300/s its times overflowed int64
#: nanoseconds, and either hung the run.
MIN_RATE: Final = 1e-3
MAX_RATE: Final = 1e6
RATE_RANGE: Final = f"{MIN_RATE:g} to {MAX_RATE:.0f} requests per second"

_RANGE: Final = (
    f"from {MIN_SECONDS:g} (a microsecond) to {MAX_SECONDS:.0f} (about 2**64 microseconds, "
    "584,542 years)"
)


def check_seconds(what: str, value: object, *, zero: bool = False, never: bool = False) -> float:
    """Return *value* as a float of seconds if it is a duration trioinfer accepts.

    A duration is a real number (``True`` and ``"5ms"`` are not) from
    ``1e-06`` (a microsecond) to ``18446744073709`` (the whole seconds within
    ``2**64 - 1`` microseconds, Triton's uint64); 0 too where *zero* (for keys where 0
    means "none" or "at once"), and ``inf`` where *never* (for keys documented
    to take it as "never").

    Args:
        what: The key or flag as the user wrote it, for the message:
            ``"batcher option max_queue_delay"``.
        value: What the user gave.
        zero: Accept 0.
        never: Accept ``inf``.

    Raises:
        ConfigError: Naming *what*, *value* and the accepted range.
    """
    if isinstance(value, Real) and not isinstance(value, bool):
        try:
            seconds = float(value)
        except OverflowError:  # an int past a float's range: out of ours too
            seconds = math.nan
        if (
            MIN_SECONDS <= seconds <= MAX_SECONDS
            or (zero and seconds == 0)
            or (never and seconds == math.inf)
        ):
            return seconds
    also = "".join(f", or {word}" for word, allowed in (("0", zero), ("inf", never)) if allowed)
    raise ConfigError(f"{what} must be a number of seconds {_RANGE}{also}; got {value!r}")


def check_priority_level(what: str, value: int) -> int:
    """Return *value* if it is a priority level a request can have.

    Raises:
        ConfigError: Naming *what*, *value* and the accepted range.
    """
    if not MIN_PRIORITY <= value <= MAX_PRIORITY:
        raise ConfigError(
            f"{what}: priority level {value} is out of range: levels go from "
            f"{MIN_PRIORITY} (-2**31) to {MAX_PRIORITY} (2**31), the priorities a "
            "request can carry"
        )
    return value
