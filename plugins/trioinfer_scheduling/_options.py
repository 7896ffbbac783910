"""Checking scheduler options and pushes, and the clock a scheduler reads before attach()."""

from __future__ import annotations

import math
from collections.abc import Callable
from numbers import Real
from typing import NoReturn

import anyio

from trioinfer import ConfigError
from trioinfer.lowlevel import Request


def positive_number(
    scheduler: str, option: str, value: object, what: str = "a number", *, finite: bool = True
) -> float:
    """Return *value* as a float if it is a real number above 0 (and finite, if *finite*).

    Raises:
        ConfigError: *value* is not a number (``True`` and ``"1"`` are not), not
            above 0, or infinite where that is not allowed.
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, Real)
        or not float(value) > 0
        or (finite and not math.isfinite(value))
    ):
        kind = f"a finite {what.removeprefix('a ')}" if finite else what
        raise ConfigError(
            f"{scheduler} scheduler: {option} must be {kind} greater than 0, got {value!r}"
        )
    return float(value)


def event_loop_clock() -> Callable[[], float]:
    """The clock to read before the engine attaches a context: the running loop's, if any.

    The function returned gives ``-inf`` where no event loop runs (a scheduler
    exercised from plain synchronous code, such as ``check_scheduler``), so
    that nothing there ever looks as if it had waited.
    """

    def now() -> float:
        try:
            return anyio.current_time()
        except RuntimeError:  # anyio's NoEventLoopError: no event loop in this thread
            return -math.inf

    return now


def already_held(scheduler: str, request: Request) -> NoReturn:
    """Refuse a second `push()` of *request*, which the scheduler holds already.

    Raises:
        ValueError: Always, naming the scheduler and the request.
    """
    raise ValueError(
        f"{scheduler} scheduler: request {request.id!r} is already queued; each request "
        "is pushed once, when admitted (one a batcher gives back goes to the head of the "
        "engine's queue with RequestQueue.put_back(), not through push() again)"
    )
