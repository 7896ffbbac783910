"""Model warm-up: request samples every instance runs at load, before the model serves.

Triton's ``model_warmup``: a runtime's first executions are often far slower than
the rest (kernels chosen and compiled, TensorRT engines built, memory arenas
grown), and without a warm-up the first callers pay for them. A model config
lists samples (`Warmup`), each input made of zeros, random values or a file's
raw bytes (`WarmupInput`); at load the engine checks them against the model's
signature, then each instance runs each sample ``count`` times, in order (``_runner.warm_up``),
instances side by side. A sample that does not fit the model, or an execution
that fails or answers with outputs that do not fit its declared ones, fails the
load (a model it would replace serves on). Warm-up executions are not requests:
no statistics or metrics count them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from ._exceptions import ConfigError, InvalidInput
from ._tensors import (
    InputLimits,
    ModelSignature,
    declared_dtype,
    dtype_name,
    validate_inputs,
)

#: How an input's values are made, besides a file: Triton's zero_data and random_data.
FILLS = ("zero", "random")


def _to_dims(value: object) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ConfigError(f"warm-up dims must be a list of sizes, e.g. [64], got {value!r}")
    dims = tuple(value)
    if not all(type(d) is int and d >= 0 for d in dims):
        raise ConfigError(f"warm-up dims must be sizes of 0 or more, got {list(dims)!r}")
    return dims


def _to_data(value: object) -> str | Path:
    if isinstance(value, str) and value in FILLS:
        return value
    if isinstance(value, os.PathLike):
        return Path(value)
    raise ConfigError(
        f"warm-up data must be 'zero', 'random' or a file (a Path; in config.toml, "
        f"file = '<name>', read from the model's warmup/ directory), got {value!r}"
    )


def _to_dtype(value: object) -> str | None:
    if value is None:
        return None
    numpy = declared_dtype(value)
    if numpy is None:
        raise ConfigError(
            f"warm-up dtype {value!r} is not a numpy name such as 'float32' or a V2/Triton "
            "name such as 'FP32' or 'TYPE_INT64'"
        )
    return numpy


@attrs.frozen
class WarmupInput:
    """How one input of a warm-up sample is made (Triton's ``model_warmup`` input).

    Attributes:
        dims: The input's shape in one sample: for a model that batches, without
            the batch dimension (as Triton's ``dims``), else its whole shape.
        data: ``"zero"``: zeros (empty strings for a ``BYTES`` input);
            ``"random"``: floats uniform in [0, 1), integers and booleans 0 or
            1 (strings as ``"zero"``, as in Triton); or a file (a `Path`) of the
            sample's raw values in row-major order, little-endian, and for
            ``BYTES`` each element a 4-byte length then its bytes (Triton's
            ``input_data_file``). In ``config.toml``, ``file = "<name>"`` reads
            ``<model>/warmup/<name>``, as Triton does.
        dtype: The input's element type (a numpy name, or a V2/Triton one such as
            ``"FP32"`` or ``"TYPE_INT64"``); by default the model's. One that is
            not the model's fails the load.
    """

    dims: tuple[int, ...] = attrs.field(converter=_to_dims)
    data: str | Path = attrs.field(default="zero", converter=_to_data)
    dtype: str | None = attrs.field(default=None, converter=_to_dtype)


def _to_inputs(value: object) -> Mapping[str, WarmupInput]:
    if not isinstance(value, Mapping) or not value:
        raise ConfigError(
            "warm-up inputs must be a non-empty table of input name to "
            f"{{dims, data or file, dtype}}, got {value!r}"
        )
    out: dict[str, WarmupInput] = {}
    for name, item in value.items():
        if not isinstance(name, str):
            raise ConfigError(f"warm-up input names must be strings, got {name!r}")
        if isinstance(item, WarmupInput):
            out[name] = item
            continue
        if not isinstance(item, Mapping):
            raise ConfigError(
                f"warm-up input {name!r} must be a table of dims, data (or file) and dtype, "
                f"got {item!r}"
            )
        known = {"dims", "data", "file", "dtype"}
        if unknown := set(item) - known:
            raise ConfigError(
                f"warm-up input {name!r}: unknown key {', '.join(map(repr, sorted(unknown)))}; "
                f"known keys are {', '.join(sorted(known))}"
            )
        if "data" in item and "file" in item:
            raise ConfigError(f"warm-up input {name!r}: give data or file, not both")
        if "dims" not in item:
            raise ConfigError(f"warm-up input {name!r} needs dims (its shape in one sample)")
        data: object = item.get("data", "zero")
        if "file" in item:
            if not isinstance(item["file"], (str, os.PathLike)):
                raise ConfigError(
                    f"warm-up input {name!r}: file must be a file name, got {item['file']!r}"
                )
            data = Path(item["file"])
        try:
            out[name] = WarmupInput(item["dims"], data, item.get("dtype"))
        except ConfigError as exc:
            raise ConfigError(f"warm-up input {name!r}: {exc}") from None
    return out


def _count(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if type(value) is not int or value < 1:
        raise ConfigError(
            f"warm-up {attribute.name} must be an integer of 1 or more, got {value!r}"
        )


def _sample_name(_inst: object, _attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"a warm-up sample's name must be a non-empty string, got {value!r}")


@attrs.frozen
class Warmup:
    """A request sample every instance of a model runs at load, before it serves.

    Triton's ``model_warmup``; in ``config.toml``, a ``[[warmup]]`` table.

    Attributes:
        name: The sample's name, for errors and logs.
        inputs: Every input of the model (a stateful model's control and state
            inputs too), by name: a `WarmupInput` or a table of its fields.
        batch_size: For a model that batches, the rows the sample is repeated
            to; 1 for a model that does not.
        count: How many times each instance runs the sample.
    """

    name: str = attrs.field(validator=_sample_name)
    inputs: Mapping[str, WarmupInput] = attrs.field(converter=_to_inputs)
    batch_size: int = attrs.field(default=1, validator=_count)
    count: int = attrs.field(default=1, validator=_count)

    def arrays(
        self,
        model: str,
        signature: ModelSignature,
        limits: InputLimits,
        max_batch_size: int | None = None,
    ) -> dict[str, np.ndarray[Any, Any]]:
        """The sample's inputs, made and checked against *signature* as a request's are.

        *max_batch_size* is the most rows a batch of the model holds (its batcher's),
        None where nothing bounds them.

        Raises:
            ConfigError: The sample does not fit the model (names, dtypes, dims,
                a file's size, a batch_size above *max_batch_size*), saying what the
                model expects.
        """
        where = f"model {model!r}, warm-up sample {self.name!r}"
        if not signature.batched and self.batch_size != 1:
            raise ConfigError(
                f"{where}: batch_size is {self.batch_size}, but the model does not batch "
                f"({signature.unbatched_reason}); its samples have batch_size 1 and their "
                "dims are the inputs' whole shapes"
            )
        if max_batch_size is not None and self.batch_size > max_batch_size:
            # Triton refuses it at load too: no batch the model serves is that big, so
            # the sample would warm up a shape no request brings.
            raise ConfigError(
                f"{where}: batch_size is {self.batch_size}, more than the model's "
                f"max_batch_size ({max_batch_size}); expected at most {max_batch_size}"
            )
        expected = [spec.name for spec in signature.inputs]
        required = [spec.name for spec in signature.inputs if not spec.optional]
        if missing := [name for name in required if name not in self.inputs]:
            raise ConfigError(
                f"{where} gives no {', '.join(map(repr, missing))}; a sample gives every "
                f"input of the model but its optional ones: {', '.join(map(repr, required))}"
            )
        # An optional input the sample leaves out is left out of its request too.
        present = [spec for spec in signature.inputs if spec.name in self.inputs]
        if unknown := [name for name in self.inputs if name not in expected]:
            raise ConfigError(
                f"{where}: the model has no input {', '.join(map(repr, unknown))}; its "
                f"inputs are {', '.join(map(repr, expected))}"
            )
        # The element caps a request's inputs meet, checked before anything is made:
        # a load override comes over the network, and dims or a batch_size too large
        # would be a MemoryError (a 500), or gigabytes of zeros, rather than its error.
        rows = self.batch_size if signature.batched else 1
        total = 0
        for spec in present:
            each = math.prod(self.inputs[spec.name].dims)
            elements = each * rows
            total += elements
            if elements > limits.max_elements_per_input:
                per_row = f" ({each} in each of {rows} rows)" if rows != 1 else ""
                raise ConfigError(
                    f"{where}: input {spec.name!r} would hold {elements} elements{per_row}; "
                    f"at most {limits.max_elements_per_input} are accepted in one input"
                )
        if total > limits.max_elements_per_request:
            raise ConfigError(
                f"{where}: the sample's inputs would hold {total} elements together; at most "
                f"{limits.max_elements_per_request} are accepted in one request"
            )
        arrays: dict[str, np.ndarray[Any, Any]] = {}
        for spec in present:
            made = self.inputs[spec.name]
            dtype = spec.dtype
            if dtype is None:
                raise ConfigError(
                    f"{where}: input {spec.name!r} is {spec.describe()}, a type numpy cannot "
                    "hold, so it cannot be warmed up"
                )
            if made.dtype is not None and dtype_name(dtype) != made.dtype:
                raise ConfigError(
                    f"{where}: input {spec.name!r} is {spec.describe()}, not {made.dtype}"
                )
            try:
                value = _values(made, dtype)
            except ConfigError as exc:
                raise ConfigError(f"{where}, input {spec.name!r}: {exc}") from None
            if signature.batched:
                value = np.repeat(value[np.newaxis], self.batch_size, axis=0)
            arrays[spec.name] = value
        try:
            return validate_inputs(model, signature, arrays, limits)
        except InvalidInput as exc:
            raise ConfigError(f"{where} does not fit the model: {exc}") from None


def _values(made: WarmupInput, dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    # One sample of an input: made.dims, of the model's dtype.
    shape = made.dims
    if isinstance(made.data, Path):
        return _from_file(made.data, shape, dtype)
    if dtype.kind == "O":
        return np.full(shape, b"", dtype=object)  # random strings are zero ones, as in Triton
    if made.data == "zero":
        return np.zeros(shape, dtype)
    rng = np.random.default_rng()
    if dtype.kind == "f":
        return rng.random(shape).astype(dtype)
    return rng.integers(0, 2, shape).astype(dtype)


def _from_file(path: Path, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read warm-up data {path}: {exc.strerror or exc}") from None
    count = math.prod(shape)
    if dtype.kind == "O":
        elements: list[bytes] = []
        at = 0
        while at < len(data):
            if at + 4 > len(data):
                raise ConfigError(f"{path} ends inside an element's 4-byte length")
            size = int.from_bytes(data[at : at + 4], "little")
            at += 4
            if at + size > len(data):
                raise ConfigError(f"{path}: element {len(elements)} runs past the file's end")
            elements.append(data[at : at + size])
            at += size
        if len(elements) != count:
            raise ConfigError(
                f"{path} holds {len(elements)} strings; dims {list(shape)} take {count}"
            )
        array = np.empty(count, dtype=object)
        array[:] = elements
        return array.reshape(shape)
    wanted = count * dtype.itemsize
    if len(data) != wanted:
        raise ConfigError(
            f"{path} holds {len(data)} bytes; dims {list(shape)} of {dtype.name} take {wanted}"
        )
    return np.frombuffer(data, dtype.newbyteorder("<")).astype(dtype).reshape(shape)
