"""Postprocess for the digits model: each row's most likely digit, by name, and how sure."""

import numpy as np

NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


class Model:
    """Names the most likely digit, or says "unsure" below *threshold*."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold
        self.names = np.array(NAMES, dtype=object)

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Each row's most likely digit by name, and its probability."""
        p = inputs["probabilities"]
        confidence = p.max(axis=1)
        name = np.where(confidence >= self.threshold, self.names[p.argmax(axis=1)], "unsure")
        return {"name": name.astype(object), "confidence": confidence}
