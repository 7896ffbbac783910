"""SIGINT and SIGTERM at the start of ``trioinfer serve``, before the server watches them.

Importing trioinfer and the server takes a second or two; until ``serve_http``
(or the ``--workers`` supervisor) opened its signal receiver, Python's own
handling applied: a SIGTERM killed the process (status -15) and a SIGINT was a
KeyboardInterrupt traceback, where a signal a moment later stopped the start
with status 0. So the first lines of trioinfer that the command runs (the
package's ``__init__``) `hold` both signals when the process is ``trioinfer
serve``, and the server's watcher `replay`s what was held once it watches: the
start stops as it would have with the signal a moment later.

SIGTERM is held by a handler of ours. SIGINT cannot be: the event loop installs
its own SIGINT handler (Trio's KeyboardInterrupt protection, asyncio's cancel of
the main task) only over Python's default, so under ours it installed none, and
a Ctrl+C after the server's receiver closed (a second one at the end of the exit)
was a KeyboardInterrupt raised in the loop's own code (in Trio's: a
TrioInternalError). So SIGINT is blocked instead, Python's default handler left
in place: a Ctrl+C waits in the kernel, and reaches no thread of the process
(the threads started meanwhile, by imports, inherit the block) until the
command's event loop runs (`run`), whose first step puts our handler over the
loop's and unblocks it. Those threads keep it blocked (Python runs handlers on
the main thread anyway), and so would a process one of them started: hence the
unblock at the loop's first step, before the server starts any thread or
process, not at `replay`.

The hold cannot start earlier than this module's import: the console script
and ``python -m trioinfer`` both import the package ``trioinfer`` before any
other of its modules, its ``__init__`` imports this one first, and this one
imports nothing (but ``__future__``) that the interpreter's start had not. What
runs before is the interpreter's own start (``site`` and the environment's
``.pth`` files; for ``-m``, ``runpy`` too): some 20 ms where a signal still gets
Python's default handling, which no package can change (only a ``sitecustomize``
could).

No heavy import here: this runs before the rest of trioinfer is imported.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # typing's own costs its import
if TYPE_CHECKING:
    import signal as _signal
    from collections.abc import Awaitable, Callable
    from types import FrameType
    from typing import Any, TypeVar

    T = TypeVar("T")
else:
    # `signal` imports enum, and typing and threading more (tens of milliseconds in
    # all, with no signal held yet): `_signal` is its C part, with the same functions
    # (handlers and numbers as plain ints), which the interpreter imported at its start.
    import _signal

#: The signals held so far, in order; None before `hold` and after `replay`.
_held: list[int] | None = None
#: The handlers our handler replaced, which a signal after `replay` gets as before: for
#: SIGTERM, Python's default; for SIGINT, the event loop's (see `run`).
_before: dict[int, Any] = {}
#: The main thread's signal mask before `hold` blocked SIGINT; None while it is not blocked.
_unblocked: set[int] | None = None


def _launched_as_serve() -> bool:
    # ``trioinfer serve ...`` (the console script) or ``python [options] -m trioinfer serve``.
    argv = sys.argv
    if argv[1:2] != ["serve"]:
        return False
    if os.path.basename(argv[0]) == "trioinfer":
        return True
    # Under -m, sys.argv[0] is "-m" while Python finds the module, which imports its
    # package (then it is the module's path); the module's name is the word of the
    # original command line just before sys.argv[1:]: "trioinfer" after "-m", or
    # "-mtrioinfer" (Python's options take their value joined too: "-Imtrioinfer"). An
    # application's own package that imports trioinfer (``python -m app serve``) is not it.
    if argv[0] != "-m":
        return False
    orig = getattr(sys, "orig_argv", [])
    named = orig[-len(argv)] if len(orig) > len(argv) else ""
    return named == "trioinfer" or (named.startswith("-") and named.endswith("mtrioinfer"))


def _handler(signum: int, frame: FrameType | None) -> None:
    if _held is not None:
        _held.append(signum)
        return
    # Past the start (the server's watcher came and went): as before `hold`.
    before = _before.get(signum, _signal.SIG_DFL)
    if callable(before):
        before(signum, frame)  # the event loop's SIGINT handler (see `run`)
        return
    _signal.signal(signum, before)
    _signal.raise_signal(signum)


def hold() -> None:
    """Hold SIGINT and SIGTERM until `replay`, if this process is ``trioinfer serve``.

    Each signal only where Python's own handler is in place (an application that
    set its own keeps it, and a SIGINT ignored stays ignored: a shell script's
    ``trioinfer serve &`` starts with it so, and its SIGTERM is still held), and
    on the main thread, where signals are handled. SIGINT is blocked, not
    handled (see above), where the platform can block signals (not Windows).
    """
    global _held, _unblocked
    if _held is not None or not _launched_as_serve():
        return
    sigint = _signal.getsignal(_signal.SIGINT)
    try:
        # Setting a handler (the one in place) tells the main thread without `threading`.
        _signal.signal(_signal.SIGINT, sigint)
    except (ValueError, TypeError):  # not the main thread; a handler set in C (None) stays
        return
    if _signal.getsignal(_signal.SIGTERM) == _signal.SIG_DFL:
        _before[_signal.SIGTERM] = _signal.signal(_signal.SIGTERM, _handler)
    if sigint is _signal.default_int_handler and hasattr(_signal, "pthread_sigmask"):
        _unblocked = _signal.pthread_sigmask(_signal.SIG_BLOCK, {_signal.SIGINT})
    if _before or _unblocked is not None:
        _held = []


def _unblock() -> None:
    global _unblocked
    if _unblocked is not None:
        mask, _unblocked = _unblocked, None
        _signal.pthread_sigmask(_signal.SIG_SETMASK, mask)  # one that waited comes now


def replay() -> None:
    """Raise again the signals held since the start, now that a receiver watches them.

    Called right after the server's signal receiver is open: each held signal
    reaches it as if it arrived now. Later calls, and calls in a process that
    held nothing, do nothing.
    """
    global _held
    held, _held = _held, None
    _unblock()  # where `run` did not: a SIGINT that waited reaches the receiver
    for signum in held or ():
        _signal.raise_signal(signum)


def run(func: Callable[[], Awaitable[T]], *, backend: str) -> T:
    """``anyio.run(func, backend=backend)``, where SIGINT goes to the loop's handler past `replay`.

    The loop starts with SIGINT blocked and Python's default handler in place,
    so it installs its own. Its first step puts our handler over it, which holds
    SIGINT until `replay` and then hands each to the loop's, and unblocks SIGINT
    (one that waited is held now); the loop's handler is put back when *func*
    returns. Without a SIGINT blocked by `hold`: ``anyio.run`` alone.
    """
    import anyio

    if _held is None or _unblocked is None:
        return anyio.run(func, backend=backend)

    async def in_the_loop() -> T:
        loops = _before[_signal.SIGINT] = _signal.signal(_signal.SIGINT, _handler)
        _unblock()
        try:
            return await func()
        finally:
            if _signal.getsignal(_signal.SIGINT) is _handler:
                _signal.signal(_signal.SIGINT, loops)  # which the loop removes at its end

    try:
        return anyio.run(in_the_loop, backend=backend)
    finally:
        _unblock()  # where the loop stopped before its first step


hold()  # at import: trioinfer's __init__ imports this module before anything heavy
