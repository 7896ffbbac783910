"""``simple_sequence``: a stateful accumulator model for tests and tutorials, as Triton ships one.

Two Python classes for the ``python`` backend, and
[`simple_sequence_config()`][trioinfer.testing.simple_sequence_config], which
serves either with the ``sequence`` batcher. Each answers OUTPUT, the running
sum of the INPUT values its sequence sent so far:

- [`SimpleSequence`][trioinfer.testing.SimpleSequence] keeps one sum per batch
  slot itself, reset at START and advanced on READY rows, as Triton's own
  example does: it needs the ``direct`` strategy, which keeps a sequence in
  one slot.
- [`SequenceAccumulator`][trioinfer.testing.SequenceAccumulator] keeps
  nothing: its sum is implicit state (STATE_IN fed back from STATE_OUT by the
  batcher), so it works under either strategy.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from .._config import Instance, ModelConfig

Array = np.ndarray[Any, Any]


class SimpleSequence:
    """OUTPUT = the running sum of INPUT per batch slot; ID echoes CORRID (``direct`` only).

    Inputs (each ``[batch, 1]``): INPUT int32, START int32, READY int32,
    CORRID uint64. Outputs: OUTPUT int32, ID uint64. A row with READY = 0 is
    padding: its slot's sum is left alone and it answers 0.
    """

    def __init__(self, slots: int = 8) -> None:
        self.sums = np.zeros(slots, dtype=np.int32)

    def infer(self, inputs: dict[str, Array]) -> dict[str, Array]:
        """Advance each ready slot's sum by its INPUT (from 0 on START) and answer it."""
        rows = len(inputs["INPUT"])
        value = inputs["INPUT"][:, 0]
        ready = inputs["READY"][:, 0] != 0
        start = (inputs["START"][:, 0] != 0) & ready
        sums = self.sums[:rows]  # a view: the slots are the batch's rows
        sums[start] = 0
        sums[ready] += value[ready]
        output = np.where(ready, sums, 0).astype(np.int32).reshape(rows, 1)
        return {"OUTPUT": output, "ID": inputs["CORRID"].astype(np.uint64)}


class SequenceAccumulator:
    """OUTPUT = STATE_OUT = STATE_IN + INPUT, from 0 on START: a running sum as implicit state.

    Inputs (each ``[batch, 1]``): INPUT int32, START int32, STATE_IN int32.
    Outputs: OUTPUT int32, STATE_OUT int32. Stateless itself: the batcher
    feeds STATE_OUT of one request back as STATE_IN of the next.
    """

    def infer(self, inputs: dict[str, Array]) -> dict[str, Array]:
        """Add INPUT to the carried sum (to 0 on START)."""
        carried = np.where(inputs["START"] != 0, 0, inputs["STATE_IN"])
        total = (carried + inputs["INPUT"]).astype(np.int32)
        return {"OUTPUT": total, "STATE_OUT": total.copy()}


def _tensor(name: str, dtype: str) -> dict[str, Any]:
    return {"name": name, "dtype": dtype, "shape": ["batch", 1]}


def simple_sequence_config(
    name: str = "simple_sequence",
    *,
    strategy: Literal["direct", "oldest"] = "direct",
    max_batch_size: int = 4,
    instances: int = 1,
    max_sequence_idle: float = 5.0,
) -> ModelConfig:
    """A stateful accumulator model, served by the ``python`` backend and ``sequence`` batcher.

    With ``strategy="direct"``, [`SimpleSequence`][trioinfer.testing.SimpleSequence]
    (controls START, READY, CORRID; the model keeps the sums); with
    ``"oldest"``, [`SequenceAccumulator`][trioinfer.testing.SequenceAccumulator]
    (control START and implicit state STATE_IN/STATE_OUT). Callers send INPUT
    (int32 ``[1, 1]``) and receive OUTPUT, the running sum of their sequence.
    """
    if strategy == "direct":
        options: dict[str, Any] = {
            "class": SimpleSequence,
            "parameters": {"slots": max_batch_size},
            "inputs": [
                _tensor("INPUT", "int32"),
                _tensor("START", "int32"),
                _tensor("READY", "int32"),
                _tensor("CORRID", "uint64"),
            ],
            "outputs": [_tensor("OUTPUT", "int32"), _tensor("ID", "uint64")],
        }
        sequence: dict[str, Any] = {
            "control": {"start": "START", "ready": "READY", "corrid": "CORRID"}
        }
    else:
        options = {
            "class": SequenceAccumulator,
            "inputs": [
                _tensor("INPUT", "int32"),
                _tensor("START", "int32"),
                _tensor("STATE_IN", "int32"),
            ],
            "outputs": [_tensor("OUTPUT", "int32"), _tensor("STATE_OUT", "int32")],
        }
        sequence = {
            "control": {"start": "START"},
            "state": [{"input": "STATE_IN", "output": "STATE_OUT"}],
        }
    options["dispatch"] = "inline"  # a few microseconds of numpy
    return ModelConfig(
        name=name,
        path="model.py",
        backend="python",
        batcher="sequence",
        backend_options=options,
        instances=[Instance(count=instances)],
        sequence={
            "strategy": strategy,
            "max_batch_size": max_batch_size,
            "max_sequence_idle": max_sequence_idle,
            **sequence,
        },
    )
