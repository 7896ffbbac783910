"""What the python backend catches from a model's own code."""

from __future__ import annotations

import functools
import signal
from typing import Final

#: What a model's own code (its import, constructor, hooks, infer or execute) may raise
#: that fails only what it ran: any Exception, SystemExit (a model.py whose argparse finds
#: no arguments, a sys.exit() in infer) and KeyboardInterrupt (a script's own
#: ``raise KeyboardInterrupt``), which are no Exception and went on out of the engine's
#: task group, ending the server with every other model. The operator's Ctrl+C, which
#: reaches model code running on the event loop as a KeyboardInterrupt too, still goes
#: on: `pass_on_ctrl_c`.
MODEL_FAULTS: Final = (Exception, SystemExit, KeyboardInterrupt)


def pass_on_ctrl_c(exc: BaseException) -> None:
    """Raise *exc* again if it is a KeyboardInterrupt that a SIGINT raised, not the model.

    Trio's SIGINT handler raises KeyboardInterrupt right where the event loop's
    thread was (model code among it): the exception's innermost frame is then the
    handler's. A model's own ``raise KeyboardInterrupt`` (on any thread: signals
    only reach the main one) ends in the model's code instead. Where the handler
    is Python's default (C code, leaving no frame) the two look alike: the
    exception goes on, as a Ctrl+C must.
    """
    if not isinstance(exc, KeyboardInterrupt):
        return
    handler = signal.getsignal(signal.SIGINT)
    while isinstance(handler, functools.partial):  # asyncio.Runner's: a partial of a method
        handler = handler.func
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    code = getattr(handler, "__code__", None)
    if handler is signal.default_int_handler or (
        tb is not None and code is not None and tb.tb_frame.f_code is code
    ):
        raise exc
