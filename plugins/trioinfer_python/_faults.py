"""What the python backend catches from a model's own code."""

from __future__ import annotations

from typing import Final

#: What a model's own code (its import, constructor, hooks, infer or execute) may raise
#: that fails only what it ran: any Exception, and SystemExit (a model.py whose argparse
#: finds no arguments, a sys.exit() in infer), which is no Exception and went on out of
#: the engine's task group, ending the server with every other model. KeyboardInterrupt
#: still goes on: on the event loop it may be the operator's Ctrl+C.
MODEL_FAULTS: Final = (Exception, SystemExit)
