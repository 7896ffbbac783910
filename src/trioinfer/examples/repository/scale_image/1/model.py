"""Preprocess for the digits model: 8x8 images of 0-16 intensities, flattened to float rows."""

import numpy as np

import trioinfer


class Model:
    """Flattens each image into the row the digits model takes."""

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Flatten each 8x8 image; refuse intensities past 16."""
        images = inputs["image"]
        if images.max(initial=0) > 16:
            raise trioinfer.InvalidInput(
                f"image holds an intensity of {images.max()}; they run from 0 to 16, as in "
                "scikit-learn's digits"
            )
        return {"input": images.reshape(len(images), 64).astype(np.float32)}
