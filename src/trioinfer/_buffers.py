"""A bounded pool of reusable batch input buffers.

When a batch holds several requests, their inputs are concatenated along the
batch dimension into one array per input. Taking those arrays from a pool
instead of allocating them means a model serving steady traffic allocates no
input memory per batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, final

import numpy as np

Array = np.ndarray[Any, Any]
# (input name, dtype, non-batch shape, rows held)
_Key = tuple[str, np.dtype[Any], tuple[int, ...], int]


@final
class BufferPool:
    """Preallocated arrays by input name, dtype, non-batch shape and size, reused across batches.

    A buffer holds a power-of-two number of rows, so a few sizes serve every
    batch size. At most *per_key* buffers are kept for each key; beyond that,
    buffers are allocated and dropped as usual, so the pool's memory is bounded.
    """

    __slots__ = ("_free", "_per_key", "allocated", "reused")

    def __init__(self, per_key: int) -> None:
        self._per_key = per_key
        self._free: dict[_Key, list[Array]] = {}
        #: Buffers allocated since the pool was made.
        self.allocated = 0
        #: Buffers served again from the pool.
        self.reused = 0

    def concatenate(
        self, parts: Mapping[str, Sequence[Array]], rows: int | None = None
    ) -> tuple[dict[str, Array], list[tuple[_Key, Array]]]:
        """Concatenate each input's parts along axis 0 into pooled buffers.

        Returns the batch inputs (views of the buffers, exactly as many rows as
        the parts have) and the buffers to hand back with `give_back()` once
        the backend is done with them. *rows*, when the caller knows it: the
        rows every input's parts hold together (else they are counted).
        """
        inputs: dict[str, Array] = {}
        taken: list[tuple[_Key, Array]] = []
        for name, arrays in parts.items():
            first = arrays[0]
            if rows is None:
                rows = sum(int(a.shape[0]) for a in arrays)
            key = (name, first.dtype, first.shape[1:], 1 << max(rows - 1, 0).bit_length())
            free = self._free.get(key)
            if free:
                buffer = free.pop()
                self.reused += 1
            else:
                buffer = np.empty((key[3], *key[2]), dtype=key[1])
                self.allocated += 1
            view = buffer[:rows]
            np.concatenate(arrays, axis=0, out=view)
            inputs[name] = view
            taken.append((key, buffer))
        return inputs, taken

    def give_back(
        self, taken: Sequence[tuple[_Key, Array]], outputs: Mapping[str, Array] | None
    ) -> None:
        """Return buffers after an execution; keep those no output can alias."""
        for key, buffer in taken:
            # A backend may return an output that is a view of its input (an
            # identity, say); reusing that buffer would change a caller's result.
            if outputs is not None and (
                # A backend that broke its contract (no mapping): its answer may alias
                # anything, and its error must not be hidden behind one of ours.
                not isinstance(outputs, Mapping)
                or any(np.may_share_memory(buffer, out) for out in outputs.values())
            ):
                continue
            free = self._free.setdefault(key, [])
            if len(free) < self._per_key:
                free.append(buffer)
