"""repeat_int32: answers a request with one response per element of its input.

Like Triton's repeat example (a decoupled model): for each element IN[i] it
waits DELAY[i] milliseconds, then sends OUT = [IN[i]] and IDX = [i]; before
the first it waits WAIT milliseconds. An empty IN gets no response at all.
"""

from collections.abc import AsyncIterator

import anyio
import numpy as np

import trioinfer


class Model:
    """The repeat model: ``async def infer`` with ``yield``, so ``decoupled = true``."""

    async def infer(self, inputs: dict[str, np.ndarray]) -> AsyncIterator[dict[str, np.ndarray]]:
        """Yield one ``{"OUT": [IN[i]], "IDX": [i]}`` per element of IN."""
        values, delays = inputs["IN"], inputs["DELAY"]
        if len(delays) != len(values):
            # The client's fault, so InvalidInput: a 400 over HTTP, not a 500.
            raise trioinfer.InvalidInput(f"DELAY has {len(delays)} elements; IN has {len(values)}")
        wait = int(inputs["WAIT"][0])
        if wait:
            await anyio.sleep(wait / 1000)
        for i, (value, delay) in enumerate(zip(values, delays, strict=True)):
            if delay:
                await anyio.sleep(int(delay) / 1000)
            yield {"OUT": np.array([value], np.int32), "IDX": np.array([i], np.uint32)}
