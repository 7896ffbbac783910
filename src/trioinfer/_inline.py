"""The event loop's inline slice: how long inline executions have held the loop since they yielded.

Backends that run executions on the event loop's thread (ONNX Runtime's
``dispatch = "inline"``) share one slice per thread: back-to-back runs, of
any model, yield to the loop once they have held it for a budget's worth of
wall time, not before every run. The engine reads the same slice, so that a
request run in its caller's task yields *before* it claims such an instance
rather than while holding it (callers arriving meanwhile would queue).
"""

from __future__ import annotations

import math
import threading
import time


class _Slice(threading.local):
    start = -math.inf  # never yielded yet: the first run yields
    # Set by the engine for the one execution it starts next, having just
    # checked the slice itself (and yielded if it was spent): that execution
    # must not yield while its caller holds the model.
    granted = False


_slice = _Slice()

#: The slice (seconds) the engine keeps for an `trioinfer.abc.InlineInstance` that
#: has no ``inline_budget_s`` of its own: ONNX Runtime's default budget.
DEFAULT_SLICE_S = 250e-6
_wall = time.perf_counter  # the loop is held for wall time


def inline_slice_spent(budget_s: float) -> bool:
    """Whether inline executions on this thread's loop have held it over *budget_s* seconds.

    Held since the last `restart_inline_slice` on this thread (or ever, before the first).
    False for an execution the engine starts right after checking the slice
    itself (a pipeline's step run in its caller's task, which yields first).
    """
    if _slice.granted:
        _slice.granted = False
        return False
    return _wall() - _slice.start > budget_s


def restart_inline_slice() -> None:
    """Start the slice anew: call it right after yielding to the event loop."""
    _slice.start = _wall()
