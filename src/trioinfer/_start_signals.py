"""SIGINT and SIGTERM at the start of ``trioinfer serve``, before the server watches them.

Importing trioinfer and the server takes a second or two; until ``serve_http``
(or the ``--workers`` supervisor) opened its signal receiver, Python's own
handling applied: a SIGTERM killed the process (status -15) and a SIGINT was a
KeyboardInterrupt traceback, where a signal a moment later stopped the start
with status 0. So the first lines of trioinfer that the command runs (the
package's ``__init__``) `hold` both signals when the process is ``trioinfer
serve``, and the server's watcher `replay`s what was held once it watches: the
start stops as it would have with the signal a moment later.

No heavy import here: this runs before the rest of trioinfer is imported.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType
from typing import Any, Final

_SIGNALS: Final = (signal.SIGINT, signal.SIGTERM)

#: The signals held so far, in order; None before `hold` and after `replay`.
_held: list[int] | None = None
#: The handlers `hold` replaced, which a signal after `replay` gets as before.
_before: dict[int, Any] = {}


def _launched_as_serve() -> bool:
    # ``trioinfer serve ...`` (the console script) or ``python [options] -m trioinfer serve``
    # (sys.argv[0] is "-m" while the package is imported, then its __main__.py).
    argv, orig = sys.argv, getattr(sys, "orig_argv", [])
    if argv[1:2] != ["serve"]:
        return False
    if os.path.basename(argv[0]) == "trioinfer":
        return True
    return "-m" in orig and orig[orig.index("-m") + 1 :][:1] == ["trioinfer"]


def _handler(signum: int, frame: FrameType | None) -> None:
    if _held is not None:
        _held.append(signum)
        return
    # Past the start (the server's watcher came and went): as before `hold`.
    before = _before.get(signum, signal.SIG_DFL)
    if callable(before):
        before(signum, frame)  # Python's default SIGINT handler: KeyboardInterrupt
        return
    signal.signal(signum, before)
    signal.raise_signal(signum)


def hold() -> None:
    """Hold SIGINT and SIGTERM until `replay`, if this process is ``trioinfer serve``.

    Each signal only where Python's own handler is in place (an application that
    set its own keeps it, and a SIGINT ignored stays ignored: a shell script's
    ``trioinfer serve &`` starts with it so, and its SIGTERM is still held), and
    on the main thread, where signals are handled.
    """
    global _held
    if _held is not None or not _launched_as_serve():
        return
    if threading.current_thread() is not threading.main_thread():
        return
    defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
    ours = [signum for signum in _SIGNALS if signal.getsignal(signum) is defaults[signum]]
    if not ours:
        return
    _held = []
    for signum in ours:
        _before[signum] = signal.signal(signum, _handler)


def replay() -> None:
    """Raise again the signals held since the start, now that a receiver watches them.

    Called right after the server's signal receiver is open: each held signal
    reaches it as if it arrived now. Later calls, and calls in a process that
    held nothing, do nothing.
    """
    global _held
    held, _held = _held, None
    for signum in held or ():
        signal.raise_signal(signum)


hold()  # at import: trioinfer's __init__ imports this module before anything heavy
