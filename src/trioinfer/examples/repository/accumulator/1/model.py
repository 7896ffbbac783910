"""accumulator: the running sum of a sequence's values (a stateful model).

Like Triton's simple_sequence example, with the sum kept by the sequence
batcher as implicit state: it arrives as STATE_IN (its START row's is
ignored) and leaves as STATE_OUT, so the model itself keeps nothing.
"""

import numpy as np


class Model:
    """Adds INPUT to the sum carried in STATE_IN (0 on a sequence's first request)."""

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Return ``{"OUTPUT": sum, "STATE_OUT": sum}``, one row per sequence in the batch."""
        carried = np.where(inputs["START"] != 0, 0, inputs["STATE_IN"])
        total = (carried + inputs["INPUT"]).astype(np.int32)
        return {"OUTPUT": total, "STATE_OUT": total}
