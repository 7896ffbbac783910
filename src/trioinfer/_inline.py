"""The event loop's inline slice: how long inline executions have held the loop since they yielded.

Backends that run executions on the event loop's thread (ONNX Runtime's
``dispatch = "inline"``) share one slice per thread: back-to-back runs, of
any model, yield to the loop once they have held it for a budget's worth of
wall time, not before every run. The engine reads the same slice, so that a
request run in its caller's task yields *before* it claims such an instance
rather than while holding it (callers arriving meanwhile would queue).

On Trio, the slice also starts anew each time the loop has polled for I/O
(`restart_slice_at_each_poll`, for as long as an engine is open, from the
first yield for the slice on): a caller back from a wait (a socket, a
client, a sleep) finds a fresh slice, not one spent while the loop sat
idle, and does not yield at once for nothing.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import sniffio
import trio
import trio.lowlevel


class _Slice(threading.local):
    start = -math.inf  # never yielded yet: the first run yields
    # Set by the engine for the one execution it starts next, having just
    # checked the slice itself (and yielded if it was spent): that execution
    # must not yield while its caller holds the model.
    granted = False
    # The run's restarter while an engine is open on this thread's loop and no
    # inline work has yielded for the slice yet: the first restart_inline_slice
    # adds it to the loop, so that a program without inline work never pays
    # for its hook.
    pending: _RestartAtEachPoll | None = None


_slice = _Slice()

#: The slice (seconds) the engine keeps for an `trioinfer.abc.InlineInstance` that
#: has no ``inline_budget_s`` of its own: ONNX Runtime's default budget.
DEFAULT_SLICE_S = 250e-6
_wall = time.perf_counter  # the loop is held for wall time


def inline_slice_spent(budget_s: float) -> bool:
    """Whether inline executions on this thread's loop have held it over *budget_s* seconds.

    Held since the last `restart_inline_slice` on this thread (or ever, before the
    first), or, on Trio while an engine is open, since the loop last polled for I/O
    (the time it sat idle is nobody's).
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
    if _slice.pending is not None:
        restarter = _slice.pending
        _slice.pending = None
        trio.lowlevel.add_instrument(restarter)
        restarter.added = True


class _RestartAtEachPoll(trio.abc.Instrument):
    # A Trio instrument with one hook: the loop has just polled for I/O, and the
    # tasks runnable now (and any that the poll woke) are about to run. Every
    # other task has had its turn since the slice began: it starts anew. Without
    # it a caller back from a wait found the slice spent (the idle time counted)
    # and yielded at its first request: a loop pass, and the hot path's caches
    # disturbed, for every request of a lone caller whose client waits between
    # requests.
    __slots__ = ("added", "users")

    def __init__(self) -> None:
        self.users = 0  # the engines open in this run that asked for it
        self.added = False  # to the loop's instruments (by restart_inline_slice)

    def after_io_wait(self, timeout: float) -> None:
        _slice.start = _wall()


_RESTARTER: trio.lowlevel.RunVar[_RestartAtEachPoll] = trio.lowlevel.RunVar(
    "trioinfer_inline_slice_restarter"
)


@contextmanager
def restart_slice_at_each_poll() -> Iterator[None]:
    """Within the block, on Trio, start this thread's slice anew each time the loop polls.

    From the first `restart_inline_slice` on (the first yield for the slice):
    a loop without inline work never calls the hook, 0.4 us a loop pass.
    Engines nest and share one instrument per run; the last to leave removes
    it. On another event loop (asyncio) it does nothing: the slice then runs
    from the last `restart_inline_slice` alone.
    """
    if sniffio.current_async_library() != "trio":
        yield
        return
    try:
        restarter = _RESTARTER.get()
    except LookupError:
        restarter = _RestartAtEachPoll()
        _RESTARTER.set(restarter)
    if not restarter.users and not restarter.added:
        _slice.pending = restarter
    restarter.users += 1
    try:
        yield
    finally:
        restarter.users -= 1
        if not restarter.users:
            _slice.pending = None
            if restarter.added:
                restarter.added = False
                # (Already gone if the caller removed it, or Trio did when it raised.)
                with suppress(KeyError):
                    trio.lowlevel.remove_instrument(restarter)
