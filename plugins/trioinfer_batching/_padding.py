"""Padding one ragged dimension to buckets: the dynamic batcher's ``pad_axis`` options.

Requests whose ragged length (a sequence length, say) differs cannot be
concatenated as they are. Padding each to the smallest configured bucket that
holds it lets requests of nearby lengths share an execution, while the few
bucket sizes keep the shapes a runtime sees (and plans, or compiles, for)
few. The batcher groups requests by bucket; `Padding.assemble` builds the
padded batch and a function that cuts each caller's share back out.
"""

from __future__ import annotations

import bisect
import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from numbers import Real
from typing import Any, final

import numpy as np

from trioinfer import ConfigError, ModelSignature
from trioinfer.lowlevel import Request

Array = np.ndarray[Any, Any]
Arrays = Mapping[str, Array]
Split = Callable[[Arrays], list[dict[str, Array]]]

log = logging.getLogger("trioinfer.batching")

# Buffers kept per (input, dtype, non-batch shape, row capacity); a few serve
# every instance that runs a batch while the next one is assembled.
_PER_KEY = 4

# Marks a key whose request cannot be padded (its ragged inputs disagree on the
# length, or one lacks the axis): such requests only join identical shapes.
_UNPADDED = "unpadded"


@final
class Padding:
    """How a batch is padded on one axis, and the buffers it reuses to do so.

    Built by [`DynamicBatcher`][trioinfer_batching.DynamicBatcher] from its
    options, already checked by `from_options`.
    """

    __slots__ = ("_free", "axis", "buckets", "inputs", "mask", "outputs", "value", "values")

    def __init__(
        self,
        *,
        axis: int,
        buckets: tuple[int, ...],
        value: float | int,
        values: dict[str, float | int],
        inputs: frozenset[str] | None,
        mask: str | None,
        outputs: dict[str, int],
    ) -> None:
        self.axis = axis
        self.buckets = buckets
        self.value = value
        self.values = values
        self.inputs = inputs
        self.mask = mask
        self.outputs = outputs
        self._free: dict[tuple[str, np.dtype[Any], tuple[int, ...], int], list[Array]] = {}

    @classmethod
    def from_options(
        cls,
        *,
        pad_axis: object,
        pad_buckets: object,
        pad_value: object,
        pad_values: object,
        pad_inputs: object,
        mask_input: object,
        ragged_outputs: object,
    ) -> Padding | None:
        """Check the padding options; ``None`` when ``pad_axis`` is not set.

        Raises:
            ConfigError: An option has the wrong type or value, or options are
                combined in a way that cannot work.
        """
        if pad_axis is None:
            given = {
                "pad_buckets": not (isinstance(pad_buckets, Sequence) and len(pad_buckets) == 0),
                "pad_value": pad_value != 0,
                "pad_values": bool(pad_values),
                "pad_inputs": pad_inputs is not None,
                "mask_input": mask_input is not None,
                "ragged_outputs": bool(ragged_outputs),
            }
            for name, set_ in given.items():
                if set_:
                    raise ConfigError(
                        f"batcher option {name} needs pad_axis, the axis to pad; "
                        "pad_axis is not set"
                    )
            return None
        axis = _check_axis("pad_axis", pad_axis)
        buckets = _check_buckets(pad_buckets)
        value = _check_number("pad_value", pad_value)
        values = {
            name: _check_number(f"pad_values[{name!r}]", v)
            for name, v in _check_mapping("pad_values", pad_values).items()
        }
        inputs = _check_inputs(pad_inputs)
        if mask_input is not None and not isinstance(mask_input, str):
            raise ConfigError(
                "batcher option mask_input must be an input name, "
                f"got {mask_input!r} of type {type(mask_input).__name__}"
            )
        if inputs is not None:
            for name in [*values, *([mask_input] if mask_input else [])]:
                if name not in inputs:
                    raise ConfigError(
                        f"batcher option pad_values or mask_input names input {name!r}, "
                        f"which is not among pad_inputs {sorted(inputs)}"
                    )
        if mask_input is not None and mask_input in values:
            raise ConfigError(
                f"batcher option pad_values sets a value for {mask_input!r}, the mask_input; "
                "a mask is always padded with 0, so leave it out of pad_values"
            )
        outputs = {
            name: _check_axis(f"ragged_outputs[{name!r}]", ax)
            for name, ax in _check_mapping("ragged_outputs", ragged_outputs).items()
        }
        if mask_input is not None:
            values[mask_input] = 0
        return cls(
            axis=axis,
            buckets=buckets,
            value=value,
            values=values,
            inputs=inputs,
            mask=mask_input,
            outputs=outputs,
        )

    def check(self, model: str, signature: ModelSignature) -> None:
        """Refuse padding that would feed the model a size its signature fixes.

        Every request passes the signature's check before it reaches the
        batcher, so a padded input the model fixes at F on the axis arrives
        with length F; padding it to a larger bucket would hand the backend a
        shape it never accepted (or, where config dims narrow a looser graph,
        give callers more positions than the config declares). A size that
        padding leaves alone (a bucket itself, or above every bucket) is fine.

        Raises:
            ConfigError: Naming the model, the input, its fixed size and the
                bucket it would be padded to.
        """
        axis = self.axis
        for spec in signature.inputs:
            if self.inputs is None:
                if spec.rank <= axis:
                    continue
            elif spec.name not in self.inputs or spec.rank <= axis:
                continue
            size = spec.shape[axis]
            if not isinstance(size, int) or isinstance(size, bool):
                continue
            target = self.target(size)
            if target != size:
                hint = (
                    f"leave {spec.name!r} out of pad_inputs"
                    if self.inputs is not None
                    else f"name the inputs that vary on axis {axis} in pad_inputs, "
                    f"without {spec.name!r}"
                )
                raise ConfigError(
                    f"model {model!r}: the dynamic batcher pads axis {axis} (pad_axis) of input "
                    f"{spec.name!r}, which the model fixes at {size} ({spec.describe()}), to "
                    f"pad_buckets {list(self.buckets)}: a request of length {size} would reach "
                    f"the model as {target}. Expected padded inputs whose size on axis {axis} "
                    f"is left open, or a fixed size that is one of pad_buckets or above them "
                    f"all; {hint}, or leave the axis open in the model's dims"
                )

    def describe(self) -> str:
        """The options, as the batcher's repr shows them."""
        parts = [f"pad_axis={self.axis}", f"pad_buckets={list(self.buckets)}"]
        if self.value != 0:
            parts.append(f"pad_value={self.value!r}")
        values = {k: v for k, v in self.values.items() if k != self.mask}
        if values:
            parts.append(f"pad_values={values!r}")
        if self.inputs is not None:
            parts.append(f"pad_inputs={sorted(self.inputs)}")
        if self.mask is not None:
            parts.append(f"mask_input={self.mask!r}")
        if self.outputs:
            parts.append(f"ragged_outputs={self.outputs!r}")
        return ", ".join(parts)

    # -- grouping ------------------------------------------------------------------

    def _padded(self, name: str, array: Array) -> bool:
        # pad_inputs names them; by default every input that has the axis is ragged.
        if self.inputs is None:
            return array.ndim > self.axis
        return name in self.inputs

    def length(self, inputs: Arrays) -> int | None:
        """The request's ragged length, or ``None`` if its inputs cannot be padded.

        They cannot when a ragged input lacks the axis, when two ragged inputs
        disagree on its length, or when no input is ragged at all.
        """
        length: int | None = None
        axis = self.axis
        for name, array in inputs.items():
            if not self._padded(name, array):
                continue
            if array.ndim <= axis:
                return None
            if length is None:
                length = int(array.shape[axis])
            elif array.shape[axis] != length:
                return None
        return length

    def target(self, length: int) -> int:
        """The bucket a ragged *length* is padded to; itself when above every bucket."""
        index = bisect.bisect_left(self.buckets, length)
        return self.buckets[index] if index < len(self.buckets) else length

    def key(self, inputs: Arrays) -> object:
        """What must match for requests to share a batch: shapes, with the bucket for the length."""
        length = self.length(inputs)
        if length is None:
            return (_UNPADDED, *((n, a.shape[1:], a.dtype) for n, a in inputs.items()))
        target = self.target(length)
        pos = self.axis - 1  # in the non-batch dims
        return tuple(
            (
                name,
                (*a.shape[1:][:pos], target, *a.shape[1:][pos + 1 :])
                if self._padded(name, a)
                else a.shape[1:],
                a.dtype,
            )
            for name, a in inputs.items()
        )

    # -- assembling ----------------------------------------------------------------

    def assemble(self, requests: Sequence[Request]) -> tuple[Arrays, Split]:
        """Build the padded batch inputs and the function that cuts each share back out.

        The batcher only groups requests of one key, so every request here has
        the same padded shapes. Each input of the batch is one buffer (reused
        across batches once the backend is done with it); each request's rows
        are copied into place and the rest of its ragged axis is filled with
        the input's pad value. A lone request whose length already is its
        bucket's goes to the backend as it is, without a copy.
        """
        first = requests[0].inputs
        length = self.length(first)
        if length is None:
            # Unpaddable: the key grouped only identical shapes, so plain concatenation.
            return self._concatenate(requests)
        target = self.target(length)
        lengths = [length] if len(requests) == 1 else [self.length(r.inputs) for r in requests]
        alone = len(requests) == 1
        axis = self.axis
        inputs: dict[str, Array] = {}
        taken: list[tuple[tuple[str, np.dtype[Any], tuple[int, ...], int], Array]] = []
        for name, array in first.items():
            padded = self._padded(name, array)
            if alone and (not padded or length == target):
                inputs[name] = array
                continue
            rows = sum(int(r.inputs[name].shape[0]) for r in requests)
            shape = list(array.shape[1:])
            if padded:
                shape[axis - 1] = target
            view, key, buffer = self._take(name, array.dtype, tuple(shape), rows)
            taken.append((key, buffer))
            fill = self._fill_value(name, array) if padded else None
            start = 0
            for request, own in zip(requests, lengths, strict=True):
                part = request.inputs[name]
                stop = start + int(part.shape[0])
                if fill is None or own is None:
                    view[start:stop] = part
                else:
                    view[_along(axis, start, stop, 0, own)] = part
                    if own < target:
                        view[_along(axis, start, stop, own, target)] = fill
                start = stop
            inputs[name] = view
        return inputs, self._splitter(requests, lengths, target, taken)

    def _concatenate(self, requests: Sequence[Request]) -> tuple[Arrays, Split]:
        if len(requests) == 1:
            return requests[0].inputs, _alone
        inputs = {
            name: np.concatenate([r.inputs[name] for r in requests], axis=0)
            for name in requests[0].inputs
        }
        return inputs, self._splitter(requests, [None] * len(requests), 0, [])

    def _take(
        self, name: str, dtype: np.dtype[Any], shape: tuple[int, ...], rows: int
    ) -> tuple[Array, tuple[str, np.dtype[Any], tuple[int, ...], int], Array]:
        # Power-of-two row capacities, as the engine's own pool: few sizes serve all.
        key = (name, dtype, shape, 1 << max(rows - 1, 0).bit_length())
        free = self._free.get(key)
        buffer = free.pop() if free else np.empty((key[3], *shape), dtype=dtype)
        return buffer[:rows], key, buffer

    def _fill_value(self, name: str, array: Array) -> Array:
        dtype = array.dtype
        if dtype.kind == "O":
            # A string (BYTES) input: pad_value is a number, which would put an int
            # among its strings; an empty string of its elements' type (all bytes, or
            # all str, once the engine checked them: TensorSpec.utf8) instead.
            first = array.flat[0] if array.size else ""
            return np.array(b"" if isinstance(first, bytes) else "", dtype=object)
        value = self.values.get(name, self.value)
        # Cast as astype does, never raising: a pad value out of an integer
        # dtype's range wraps rather than failing every batch at run time.
        with np.errstate(all="ignore"):
            return np.asarray(value).astype(dtype, casting="unsafe")

    def _splitter(
        self,
        requests: Sequence[Request],
        lengths: Sequence[int | None],
        target: int,
        taken: list[tuple[tuple[str, np.dtype[Any], tuple[int, ...], int], Array]],
    ) -> Split:
        alone = len(requests) == 1

        def split(outputs: Arrays) -> list[dict[str, Array]]:
            self._give_back(taken, outputs)
            shares: list[dict[str, Array]] = [{} for _ in requests]
            for name, array in outputs.items():
                axis = self.outputs.get(name)
                if axis is not None and (array.ndim <= axis or array.shape[axis] != target):
                    if lengths[0] is not None:  # padded, yet this output is not: misconfigured
                        log.warning(
                            "ragged output %r has shape %s, without the padded length %d "
                            "on axis %d; returning it without removing the padding",
                            name,
                            array.shape,
                            target,
                            axis,
                        )
                    axis = None
                start = 0
                for share, request, own in zip(shares, requests, lengths, strict=True):
                    stop = start + request.rows
                    rows = slice(None) if alone else slice(start, stop)
                    if axis is None or own is None:
                        share[name] = array[rows]
                    else:
                        share[name] = array[_along(axis, rows.start, rows.stop, 0, own)]
                    start = stop
            return shares

        return split

    def _give_back(
        self,
        taken: list[tuple[tuple[str, np.dtype[Any], tuple[int, ...], int], Array]],
        outputs: Arrays,
    ) -> None:
        for key, buffer in taken:
            # An output that is a view of its input (an identity model) would
            # change under a caller's feet if the buffer were filled again.
            if any(np.may_share_memory(buffer, out) for out in outputs.values()):
                continue
            free = self._free.setdefault(key, [])
            if len(free) < _PER_KEY:
                free.append(buffer)


def _alone(outputs: Arrays) -> list[dict[str, Array]]:
    return [dict(outputs)]


def _along(axis: int, start: int | None, stop: int | None, lo: int, hi: int) -> tuple[slice, ...]:
    """Index rows ``start:stop`` on axis 0 and ``lo:hi`` on *axis*."""
    return (slice(start, stop), *itertools.repeat(slice(None), axis - 1), slice(lo, hi))


def _check_axis(name: str, value: object) -> int:
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 1:
        raise ConfigError(
            f"batcher option {name} must be an axis >= 1 (axis 0 is the batch), got {value!r}"
        )
    return int(value)


def _check_buckets(value: object) -> tuple[int, ...]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence) or not value:
        raise ConfigError(
            "batcher option pad_buckets must be a non-empty list of increasing positive "
            f"lengths when pad_axis is set, got {value!r}"
        )
    sizes: list[int] = []
    for size in value:
        if not isinstance(size, int | np.integer) or isinstance(size, bool) or size < 1:
            raise ConfigError(
                f"batcher option pad_buckets must hold positive integers, got {size!r}"
            )
        sizes.append(int(size))
    if any(a >= b for a, b in itertools.pairwise(sizes)):
        raise ConfigError(
            f"batcher option pad_buckets must be strictly increasing, got {list(sizes)}"
        )
    return tuple(sizes)


def _check_number(name: str, value: object) -> float | int:
    if not isinstance(value, Real) or isinstance(value, bool):
        raise ConfigError(
            f"batcher option {name} must be a number, got {value!r} of type {type(value).__name__}"
        )
    return int(value) if isinstance(value, int | np.integer) else float(value)


def _check_mapping(name: str, value: object) -> dict[str, object]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ConfigError(
            f"batcher option {name} must be a table of input or output names, got {value!r}"
        )
    return dict(value)


def _check_inputs(value: object) -> frozenset[str] | None:
    if value is None:
        return None
    if (
        isinstance(value, str | bytes)
        or not isinstance(value, Sequence)
        or not value
        or not all(isinstance(name, str) for name in value)
    ):
        raise ConfigError(
            f"batcher option pad_inputs must be a non-empty list of input names, got {value!r}"
        )
    return frozenset(value)
