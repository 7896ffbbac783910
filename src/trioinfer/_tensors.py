"""Tensor signatures and the checks that run on inputs before they queue.

A backend reports its model's signature as [`ModelSignature`][trioinfer.ModelSignature]; the engine
checks every request against it (names, dtypes, ranks, fixed and symbolic
dims, element caps) before the request can take a place in a queue, so a bad
request costs neither queue space nor compute.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Final, Literal, NoReturn, Protocol, cast, final

import attrs
import numpy as np

from ._exceptions import BackendError, ConfigError, InvalidInput

#: A dimension: a fixed size, a symbolic name shared between tensors, or ``None`` (unknown).
Dim = int | str | None

#: How far the engine may convert an input's dtype to the model's (numpy casting rules).
Casting = Literal["no", "safe", "same_kind"]

# ONNX tensor element types, as ONNX Runtime spells them, with their numpy dtypes.
_ONNX_TO_NUMPY: dict[str, np.dtype[Any]] = {
    "tensor(float)": np.dtype(np.float32),
    "tensor(double)": np.dtype(np.float64),
    "tensor(float16)": np.dtype(np.float16),
    "tensor(int8)": np.dtype(np.int8),
    "tensor(int16)": np.dtype(np.int16),
    "tensor(int32)": np.dtype(np.int32),
    "tensor(int64)": np.dtype(np.int64),
    "tensor(uint8)": np.dtype(np.uint8),
    "tensor(uint16)": np.dtype(np.uint16),
    "tensor(uint32)": np.dtype(np.uint32),
    "tensor(uint64)": np.dtype(np.uint64),
    "tensor(bool)": np.dtype(np.bool_),
    "tensor(string)": np.dtype(np.object_),
}


# A declared signature's dtype names: numpy's (and "string"), with the ONNX type each
# stands for; and the V2 protocol's (Triton's with "TYPE_"), as the numpy name.
_DECLARED = {
    ("string" if dtype == np.object_ else dtype.name): onnx
    for onnx, dtype in _ONNX_TO_NUMPY.items()
}
_V2_NAMES = {
    "BOOL": "bool", "UINT8": "uint8", "UINT16": "uint16", "UINT32": "uint32",
    "UINT64": "uint64", "INT8": "int8", "INT16": "int16", "INT32": "int32",
    "INT64": "int64", "FP16": "float16", "FP32": "float32", "FP64": "float64",
    "BYTES": "string", "STRING": "string",
}  # fmt: skip
# The V2 protocol's name for each numpy dtype name, for error messages.
_V2_OF_NUMPY = {numpy: v2 for v2, numpy in _V2_NAMES.items() if v2 != "STRING"}


def declared_dtype(dtype: object) -> str | None:
    """The numpy name a config's element type stands for (``"string"`` for ``BYTES``), or None.

    Takes a numpy name (``"float32"``, ``"string"``) or a V2/Triton one
    (``"FP32"``, ``"TYPE_INT64"``, ``"BYTES"``), in any case.
    """
    if not isinstance(dtype, str):
        return None
    numpy = _V2_NAMES.get(dtype.upper().removeprefix("TYPE_")) or dtype.lower()
    numpy = "string" if numpy in ("object", "bytes", "str") else numpy
    return numpy if numpy in _DECLARED else None


def dtype_name(dtype: np.dtype[Any]) -> str:
    """The name `declared_dtype` gives *dtype*: its numpy name, ``"string"`` for ``object``."""
    return "string" if dtype.kind == "O" else dtype.name


def numpy_dtype(onnx_type: str) -> np.dtype[Any] | None:
    """Return the numpy dtype for an ONNX Runtime type string such as ``"tensor(float)"``.

    Returns ``None`` for element types numpy cannot hold (e.g. ``tensor(bfloat16)``).
    """
    return _ONNX_TO_NUMPY.get(onnx_type)


@attrs.frozen
class TensorSpec:
    """One input or output of a model.

    Attributes:
        name: The tensor's name in the model.
        dtype: The numpy dtype callers pass or receive (``object`` for strings), or
            ``None`` when the element type has no numpy equivalent.
        shape: One entry per dimension: an int for a fixed size, a str for a symbolic
            size (the same name means the same size across the model's tensors), or
            ``None`` for a size the model leaves open.
        type_name: The element type as the backend spells it, e.g. ``"tensor(float)"``.
        utf8: For a string (``BYTES``) input: what its elements reach the model
            as, however the request came (``engine.infer``, HTTP JSON or binary,
            gRPC). True: ``str``, UTF-8 text, as an ONNX string tensor reads
            them: the engine decodes ``bytes`` elements as it checks the request
            (ONNX Runtime would take a ``bytes`` element's ``repr``, ``"b'a'"``)
            and refuses bytes that are not UTF-8 (`InvalidInput`, naming the
            element). False (a declared signature's default, as for a Python
            model): ``bytes``, as Triton's Python backend gives them: any bytes
            pass (an image, say), and a ``str`` element is encoded as UTF-8.
        optional: For an input: whether a request may leave it out (Triton's
            ``optional: true``). The model then runs without it (an ONNX graph
            uses its initializer, a Python model gets only the inputs sent); a
            request that sends it sends it whole, checked as any other input.
    """

    name: str
    dtype: np.dtype[Any] | None
    shape: tuple[Dim, ...]
    type_name: str = ""
    utf8: bool = attrs.field(default=False, kw_only=True)
    optional: bool = attrs.field(default=False, kw_only=True)

    @property
    def rank(self) -> int:
        """The number of dimensions."""
        return len(self.shape)

    def describe(self) -> str:
        """Say the spec in a form fit for an error message, e.g. ``float32[batch, 64]``."""
        dims = ", ".join("?" if d is None else str(d) for d in self.shape)
        dtype = self.dtype.name if self.dtype is not None else self.type_name
        return f"{dtype}[{dims}]"


def _named(dim: Dim) -> bool:
    # A symbol the model's author chose. Converters name dimensions they could
    # not infer "unk__0", "unk__1", ...: those say nothing, like an unnamed one.
    return isinstance(dim, str) and not dim.startswith("unk__")


@attrs.frozen
class ModelSignature:
    """The inputs and outputs of a loaded model, in the model's order."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    _input_names: frozenset[str] = attrs.field(init=False, eq=False, repr=False)
    # The inputs every request must send: all but the optional ones.
    _required_names: frozenset[str] = attrs.field(init=False, eq=False, repr=False)
    _unbatched_reason: str | None = attrs.field(init=False, eq=False, repr=False)
    # For validate_inputs' fast path: (name, dtype, non-batch dims) of every input,
    # when the signature fixes everything but the batch dimension; else None.
    _fixed: tuple[tuple[str, np.dtype[Any], tuple[int, ...]], ...] | None = attrs.field(
        init=False, eq=False, repr=False
    )

    @_input_names.default
    def _names_default(self) -> frozenset[str]:
        return frozenset(spec.name for spec in self.inputs)

    @_required_names.default
    def _required_default(self) -> frozenset[str]:
        return frozenset(spec.name for spec in self.inputs if not spec.optional)

    @_unbatched_reason.default
    def _unbatched_default(self) -> str | None:
        tensors = self.inputs + self.outputs
        if not tensors:
            return "it has no inputs or outputs"
        for t in tensors:
            if t.rank == 0 or isinstance(t.shape[0], int):
                return f"{t.name!r} is {t.describe()}, without a variable first dimension"
        # Requests share an execution only if every output's first dimension is
        # the batch: the engine cuts each caller's rows out of it. An output
        # whose first dimension the model names differently (Reshape to
        # [pairs, 2], say) could not be cut that way.
        batch = {t.shape[0] for t in self.inputs}
        if batch and all(_named(d) for d in batch):
            for t in self.outputs:
                if _named(t.shape[0]) and t.shape[0] not in batch:
                    names = ", ".join(repr(d) for d in sorted(batch, key=str))
                    return (
                        f"output {t.name!r} is {t.describe()}: its first dimension is not the "
                        f"inputs' ({names}), so it cannot be cut into each request's rows"
                    )
        return None

    @_fixed.default
    def _fixed_default(self) -> tuple[tuple[str, np.dtype[Any], tuple[int, ...]], ...] | None:
        if self._unbatched_reason is not None or not self.inputs:
            return None
        if self._required_names != self._input_names:
            # Requests may send different sets of inputs: the fast paths (and a
            # uniform queue, whose requests all batch together) assume one set.
            return None
        fixed = []
        for spec in self.inputs:
            tail = spec.shape[1:]
            if spec.dtype is None or spec.dtype.kind == "O":
                return None
            if not all(isinstance(d, int) and not isinstance(d, bool) for d in tail):
                return None
            fixed.append((spec.name, spec.dtype, cast(tuple[int, ...], tail)))
        return tuple(fixed)

    @classmethod
    def declared(cls, inputs: object, outputs: object, *, model: str) -> ModelSignature:
        """A signature written in a config, for models with no file to read it from.

        *inputs* and *outputs* are lists of tables ``{name, dtype, shape}``,
        and for a string input optionally ``utf8``: true if the model wants
        its elements as ``str`` (UTF-8 text), else they arrive as ``bytes``
        (see `TensorSpec.utf8`).
        ``dtype`` is a numpy name (``"float32"``, ``"int64"``, ``"bool"``,
        ``"string"``) or a V2/Triton name (``"FP32"``, ``"TYPE_INT64"``,
        ``"BYTES"``). ``shape`` lists each dimension: an int for a fixed size,
        a name for a symbolic size shared between tensors (``"batch"``), or -1
        for a size left open. An input may say ``optional``: true if requests
        may leave it out (the model gets the inputs that were sent; see
        `TensorSpec.optional`).

        Raises:
            ConfigError: Naming the model, the tensor and what is wrong with it.
        """
        return cls(_declared(model, "inputs", inputs), _declared(model, "outputs", outputs))

    def input(self, name: str) -> TensorSpec:
        """Return the input called *name*; raises ``KeyError`` if there is none."""
        for spec in self.inputs:
            if spec.name == name:
                return spec
        raise KeyError(name)

    def output(self, name: str) -> TensorSpec:
        """Return the output called *name*; raises ``KeyError`` if there is none."""
        for spec in self.outputs:
            if spec.name == name:
                return spec
        raise KeyError(name)

    @property
    def batched(self) -> bool:
        """Whether requests may share an execution, each getting its own rows of every output.

        True when every input and output has a variable first dimension and
        no output names its first dimension differently from the inputs'
        (``y[pairs, 2]`` from ``x[batch, 4]``); see `unbatched_reason`.
        """
        return self._unbatched_reason is None

    @property
    def unbatched_reason(self) -> str | None:
        """Why the model is not batched (each request then runs alone), or ``None`` if it is."""
        return self._unbatched_reason


def _declared(model: str, kind: str, value: object) -> tuple[TensorSpec, ...]:
    where = f"{kind} of model {model!r}"
    if not isinstance(value, Sequence) or isinstance(value, str) or not value:
        missing = " (none declared)" if value is None else f", got {value!r}"
        raise ConfigError(
            f"{where} must be a non-empty list of tables with name, dtype and shape{missing}: "
            f"in config.toml, {kind} = [{{ name = ..., dtype = ..., shape = [...] }}] in "
            "[backend_options]"
        )
    specs: list[TensorSpec] = []
    for item in value:
        if not isinstance(item, Mapping) or not _KEYS <= set(item) <= _KEYS | _INPUT_KEYS:
            raise ConfigError(
                f"each of {where} must be a table of name, dtype, shape (and, for a string "
                f"input, utf8; for an input, optional): {item!r}"
            )
        name = item["name"]
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}: a tensor name must be a non-empty string, got {name!r}")
        if any(spec.name == name for spec in specs):
            raise ConfigError(f"{where}: {name!r} is declared twice")
        here = f"{where}, {name!r}"
        dtype = item["dtype"]
        numpy = declared_dtype(dtype)
        if numpy is None:
            raise ConfigError(
                f"{here}: dtype {dtype!r} is not one of {', '.join(sorted(_DECLARED))} "
                "(or a V2 name such as 'FP32', 'INT64', 'BYTES')"
            )
        onnx = _DECLARED[numpy]
        utf8 = item.get("utf8", False)
        if "utf8" in item and kind != "inputs":
            raise ConfigError(
                f"{here}: utf8 says what a string input reaches the model as; an output "
                "takes no utf8 (its elements may be str or bytes)"
            )
        if not isinstance(utf8, bool) or (utf8 and numpy != "string"):
            raise ConfigError(
                f"{here}: utf8 must be true or false, and only a string (BYTES) tensor takes "
                f"it; got utf8 = {utf8!r} for dtype {dtype!r}"
            )
        optional = item.get("optional", False)
        if "optional" in item and kind != "inputs":
            raise ConfigError(
                f"{here}: optional says that requests may leave an input out; an output "
                "takes no optional"
            )
        if not isinstance(optional, bool):
            raise ConfigError(f"{here}: optional must be true or false, got {optional!r}")
        shape = _declared_shape(here, item["shape"])
        specs.append(
            TensorSpec(name, _ONNX_TO_NUMPY[onnx], shape, onnx, utf8=utf8, optional=optional)
        )
    return tuple(specs)


_KEYS: Final = frozenset({"name", "dtype", "shape"})
_INPUT_KEYS: Final = frozenset({"utf8", "optional"})


def _declared_shape(where: str, value: object) -> tuple[Dim, ...]:
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise ConfigError(f"{where}: shape must be a list of dimensions, got {value!r}")
    dims: list[Dim] = []
    for dim in value:
        if (
            isinstance(dim, bool)
            or not isinstance(dim, (int, str))
            or dim == ""
            or (isinstance(dim, int) and dim < -1)
        ):
            raise ConfigError(
                f"{where}: each dimension must be a size >= 0, a symbolic name or -1 (open); "
                f"got {dim!r}"
            )
        dims.append(None if dim == -1 else dim)
    return tuple(dims)


@attrs.frozen
class InputLimits:
    """Caps checked before any input is copied or queued.

    Attributes:
        max_elements_per_input: Most elements one input tensor may hold.
        max_elements_per_request: Most elements all of a request's inputs may hold together.
        casting: Which dtype conversions the engine may make (numpy casting rule);
            ``"no"`` refuses any input whose dtype differs from the model's.
    """

    max_elements_per_input: int = 1 << 26
    max_elements_per_request: int = 1 << 27
    casting: Casting = "no"


def validate_inputs(
    model: str, signature: ModelSignature, inputs: object, limits: InputLimits
) -> dict[str, np.ndarray[Any, Any]]:
    """Check *inputs* against *signature* and return them as numpy arrays.

    Checks names (missing, unknown), element caps (before converting anything
    that is not already an array), dtypes (no conversion beyond ``limits.casting``),
    ranks, fixed dims, and that a symbolic dim has one size across all inputs
    (so inputs that disagree on the batch size are refused).

    Raises:
        InvalidInput: With a message naming the input, what it was and what the
            model expects.
    """
    fixed = signature._fixed
    if fixed is not None and type(inputs) is dict and len(inputs) == len(fixed):
        # The common case, checked in a few comparisons: arrays of the model's
        # dtypes whose every dimension but the batch is fixed by the signature.
        # Anything else (or anything wrong) takes the full checks below, which
        # say what is wrong.
        checked = _fixed_arrays(fixed, inputs, limits)
        if checked is not None:
            return checked[0]
    return _validate(model, signature, inputs, limits)


def validate_rows(
    model: str, signature: ModelSignature, inputs: object, limits: InputLimits, batched: bool
) -> tuple[dict[str, np.ndarray[Any, Any]], int]:
    """`validate_inputs()`, and the request's rows: its batch size if *batched*, else 1."""
    fixed = signature._fixed
    if batched and fixed is not None and type(inputs) is dict and len(inputs) == len(fixed):
        if len(fixed) == 1:
            # One input, as most models have: _fixed_arrays' checks in line.
            name, dtype, tail = fixed[0]
            array = inputs.get(name)
            if type(array) is np.ndarray and (array.dtype is dtype or array.dtype == dtype):
                shape = array.shape
                if shape and shape[0] and shape[1:] == tail:
                    size = array.size
                    if (
                        size <= limits.max_elements_per_input
                        and size <= limits.max_elements_per_request
                    ):
                        return {name: array}, shape[0]
        else:
            checked = _fixed_arrays(fixed, inputs, limits)
            if checked is not None:
                return checked
    elif fixed is not None and type(inputs) is dict and len(inputs) == len(fixed):
        # Unbatched (a pipeline's request keeps its rows): the same checks, one "row".
        checked = _fixed_arrays(fixed, inputs, limits)
        if checked is not None:
            return checked[0], 1
    arrays = _validate(model, signature, inputs, limits)
    return arrays, rows(arrays) if batched else 1


def rows_validator(
    model: str, signature: ModelSignature, limits: InputLimits, batched: bool
) -> Callable[[object], tuple[dict[str, np.ndarray[Any, Any]], int]]:
    """``validate_rows(model, signature, inputs, limits, batched)`` as a function of *inputs*.

    For a model with one input whose signature fixes all but the batch, the
    common case is checked with everything it compares bound once (the
    request path validates every request); anything else, or anything
    wrong, goes to `validate_rows`, which says what is wrong. Unbatched (a
    pipeline's request, which keeps its rows), the same checks, one "row".
    """
    fixed = signature._fixed
    if not (fixed is not None and len(fixed) == 1):
        return functools.partial(_validate_rows_of, model, signature, limits, batched)
    name, dtype, tail = fixed[0]
    cap = min(limits.max_elements_per_input, limits.max_elements_per_request)
    ndarray = np.ndarray

    def validate(inputs: object) -> tuple[dict[str, np.ndarray[Any, Any]], int]:
        if type(inputs) is dict and len(inputs) == 1:
            array = inputs.get(name)
            if type(array) is ndarray and (array.dtype is dtype or array.dtype == dtype):
                shape = array.shape
                if shape and shape[0] and shape[1:] == tail and array.size <= cap:
                    return {name: array}, shape[0] if batched else 1
        return validate_rows(model, signature, inputs, limits, batched)

    return validate


def _validate_rows_of(
    model: str, signature: ModelSignature, limits: InputLimits, batched: bool, inputs: object
) -> tuple[dict[str, np.ndarray[Any, Any]], int]:
    return validate_rows(model, signature, inputs, limits, batched)


def _validate(
    model: str, signature: ModelSignature, inputs: object, limits: InputLimits
) -> dict[str, np.ndarray[Any, Any]]:
    # validate_inputs' full checks, which say what is wrong.
    if not isinstance(inputs, Mapping):
        raise InvalidInput(
            f"inputs for model {model!r} must be a mapping of input name to array, "
            f"got {type(inputs).__name__}"
        )
    keys = inputs.keys()
    # Only optional inputs may be left out (and not all of them, when every input
    # is optional: a request must say something, and its rows).
    if keys != signature._input_names and (
        not signature._required_names <= keys <= signature._input_names or not keys
    ):
        _refuse_names(model, signature, inputs)

    arrays: dict[str, np.ndarray[Any, Any]] = {}
    total = 0
    symbols: dict[str, tuple[int, str]] = {}
    batch: tuple[int, str] | None = None
    batched = signature.batched
    for spec in signature.inputs:
        if spec.optional and spec.name not in inputs:
            continue  # left out: the model runs without it
        value = inputs[spec.name]
        if type(value) is np.ndarray and value.dtype == spec.dtype:
            array = value  # the common case: no conversion, no copy
            if array.size > limits.max_elements_per_input:
                _refuse_size(model, spec, array, limits)
        else:
            array = _as_array(model, spec, value, limits)
        total += array.size
        if total > limits.max_elements_per_request:
            raise InvalidInput(
                f"request for model {model!r} holds more than "
                f"{limits.max_elements_per_request} elements in all; send fewer rows per request"
            )
        if array.ndim != spec.rank:
            raise InvalidInput(
                f"input {spec.name!r} of model {model!r} has shape {list(array.shape)} "
                f"(rank {array.ndim}); the model expects {spec.describe()} (rank {spec.rank})"
            )
        for axis, (size, dim) in enumerate(zip(array.shape, spec.shape, strict=True)):
            if dim is None:
                continue
            if isinstance(dim, int):
                if size != dim:
                    raise InvalidInput(
                        f"input {spec.name!r} of model {model!r} has size {size} in dimension "
                        f"{axis}; the model expects {spec.describe()}"
                    )
            else:
                seen = symbols.setdefault(dim, (size, spec.name))
                if seen[0] != size:
                    raise InvalidInput(
                        f"inputs of model {model!r} disagree on dimension {dim!r}: "
                        f"{seen[1]!r} has {seen[0]}, {spec.name!r} has {size}"
                    )
        if batched:
            rows = array.shape[0]
            if batch is None:
                if rows == 0:
                    raise InvalidInput(
                        f"input {spec.name!r} of model {model!r} has 0 rows; send at least one"
                    )
                batch = (rows, spec.name)
            elif rows != batch[0]:
                raise InvalidInput(
                    f"inputs of model {model!r} disagree on the batch size: "
                    f"{batch[1]!r} has {batch[0]} rows, {spec.name!r} has {rows}"
                )
        if spec.dtype is not None and spec.dtype.kind == "O":
            array = _check_strings(model, spec, array)
        arrays[spec.name] = array
    return arrays


_STRING_TYPES: Final = frozenset({str, bytes})


def _check_strings(
    model: str, spec: TensorSpec, array: np.ndarray[Any, Any]
) -> np.ndarray[Any, Any]:
    # A string tensor's elements are str or bytes. An object array holds anything, and
    # ONNX Runtime turns what is not a string into its str() ("1", "None") without a
    # word: refuse it here, where the message can say which element it was. Only
    # string inputs come here (their signature has no fast path), so numeric ones
    # pay nothing for it.
    elements = array.ravel().tolist()  # of an object array: the elements themselves
    types = set(map(type, elements))
    if not types <= _STRING_TYPES:
        found = next(
            ((i, v) for i, v in enumerate(elements) if not isinstance(v, (str, bytes))), None
        )
        if found is not None:
            index, bad = found
            raise InvalidInput(
                f"input {spec.name!r} of model {model!r} is a string (BYTES) tensor: its "
                f"elements must be bytes or str, got {type(bad).__name__} {_shown(bad)} at "
                f"index {_index(array, index)}"
            )
        # else subclasses of str or bytes (numpy.str_, numpy.bytes_)
    if spec.utf8:
        if bytes in types or not types <= _STRING_TYPES:
            return _recoded(model, spec, array, elements)
        return array
    if types == _JUST_BYTES:
        return array
    return _recoded(model, spec, array, elements)


_JUST_BYTES: Final = frozenset({bytes})


def _recoded(
    model: str, spec: TensorSpec, array: np.ndarray[Any, Any], elements: list[Any]
) -> np.ndarray[Any, Any]:
    # A string input's elements as its model reads them, in a new array (the caller's
    # is left as it was). A bytes input's str elements as UTF-8: the model gets bytes
    # whether the caller sent bytes (gRPC, HTTP binary) or text (JSON, a str from
    # Python), as Triton's Python backend gives them. A UTF-8 string input's bytes
    # elements as str: ONNX Runtime reads an object array's elements by their str(),
    # which for bytes is their repr.
    utf8 = spec.utf8
    other: type[Any] = bytes if utf8 else str
    out: list[Any] = []
    for index, value in enumerate(elements):
        if isinstance(value, other):
            try:
                value = value.decode("utf-8") if utf8 else value.encode("utf-8")
            except (UnicodeEncodeError, UnicodeDecodeError) as exc:
                where = _index(array, index)
                raise InvalidInput(
                    f"input {spec.name!r} of model {model!r} is a string tensor of UTF-8 "
                    f"text, but its element at index {where} is not UTF-8 ({exc.reason} at "
                    f"byte {exc.start} of {_shown(value)}); send UTF-8 encoded bytes, or str"
                    if utf8
                    else f"input {spec.name!r} of model {model!r} is a BYTES tensor, and its "
                    f"str element at index {where} cannot be encoded as UTF-8 ({exc.reason} "
                    f"at character {exc.start} of {_shown(value)}); send bytes, or str "
                    "without lone surrogates"
                ) from None
        out.append(value)
    recoded = np.empty(len(out), dtype=object)
    recoded[:] = out
    return recoded.reshape(array.shape)


def _index(array: np.ndarray[Any, Any], index: int) -> int | list[int]:
    # Where element *index* of the flattened *array* is, as the caller indexes it.
    return index if array.ndim == 1 else [int(i) for i in np.unravel_index(index, array.shape)]


def _shown(value: object) -> str:
    shown = repr(value)
    return shown if len(shown) <= 40 else shown[:37] + "..."


def _fixed_arrays(
    fixed: tuple[tuple[str, np.dtype[Any], tuple[int, ...]], ...],
    inputs: dict[Any, Any],
    limits: InputLimits,
) -> tuple[dict[str, np.ndarray[Any, Any]], int] | None:
    # validate_inputs' fast path: the inputs as they are, and their rows, if they
    # pass every check the full path makes, else None (and the full path finds
    # what is wrong).
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    batch = 0
    total = 0
    cap = limits.max_elements_per_input
    for name, dtype, tail in fixed:
        array = inputs.get(name)
        if type(array) is not np.ndarray or array.dtype != dtype:
            return None
        shape = array.shape
        if shape[1:] != tail or not shape:
            return None
        if batch != shape[0]:
            # A first input of 0 rows left batch at 0: a later one must not set it
            # (the full checks refuse 0 rows, and inputs that disagree on them).
            if batch or not shape[0] or arrays:
                return None
            batch = shape[0]
        size = array.size
        if size > cap:
            return None
        total += size
        arrays[name] = array
    if not batch or total > limits.max_elements_per_request:
        return None
    return arrays, batch


def _refuse_names(model: str, signature: ModelSignature, inputs: Mapping[Any, Any]) -> NoReturn:
    expected = signature._input_names
    unknown = sorted(map(str, set(inputs) - expected))
    if unknown:
        raise InvalidInput(
            f"model {model!r} has no input named {', '.join(map(repr, unknown))}; "
            f"its inputs are {_names(signature.inputs)}"
        )
    missing = sorted(signature._required_names - set(inputs))
    if not missing:  # every input is optional, and none was sent
        raise InvalidInput(
            f"request for model {model!r} sends no input; send at least one of "
            f"{_names(signature.inputs)}"
        )
    raise InvalidInput(
        f"model {model!r} needs input {', '.join(map(repr, missing))}; "
        f"its inputs are {_names(signature.inputs)}"
    )


def _refuse_size(
    model: str, spec: TensorSpec, array: np.ndarray[Any, Any], limits: InputLimits
) -> NoReturn:
    raise InvalidInput(
        f"input {spec.name!r} of model {model!r} has {array.size} elements; at most "
        f"{limits.max_elements_per_input} are allowed per input"
    )


def _as_array(
    model: str, spec: TensorSpec, value: object, limits: InputLimits
) -> np.ndarray[Any, Any]:
    where = f"input {spec.name!r} of model {model!r}"
    if isinstance(value, np.ndarray):
        array = value
    elif isinstance(value, (list, tuple, int, float, bool, str, np.generic)):
        # Conversion allocates; cap what a nested list could expand to afterwards.
        try:
            array = np.asarray(value)
        except ValueError as exc:
            raise InvalidInput(f"{where} is not a rectangular array: {exc}") from None
    else:
        raise InvalidInput(
            f"{where} must be a numpy array (or a nested list), got {type(value).__name__}"
        )
    if array.size > limits.max_elements_per_input:
        _refuse_size(model, spec, array, limits)
    want = spec.dtype
    if want is None:
        raise InvalidInput(f"{where} has element type {spec.type_name}, which numpy cannot hold")
    if array.dtype == want:
        return array
    if want == np.object_ and array.dtype.kind in "US":
        # Strings arrive as numpy unicode/bytes arrays; ONNX Runtime takes them as objects.
        return array.astype(object)
    if limits.casting != "no" and np.can_cast(array.dtype, want, casting=limits.casting):
        return array.astype(want)
    numbers_in_a_list = isinstance(value, (list, tuple)) and array.dtype.kind in "biuf"
    if limits.casting != "no":
        hint = f"the configured casting {limits.casting!r} does not allow that conversion"
    elif want == np.object_:
        # numpy.object is no name, and "object" is no V2 datatype: say what strings are.
        hint = (
            "send str or bytes elements (an array of dtype str, bytes or object), or over "
            "HTTP or gRPC send it as datatype BYTES"
        )
    elif numbers_in_a_list:
        # A nested list has no .astype; numpy made Python floats float64, ints int64.
        hint = f"pass numpy.asarray(..., dtype=numpy.{want.name})"
    else:
        hint = (
            f"convert it with .astype(numpy.{want.name}), or over HTTP or gRPC send it as "
            f"datatype {_V2_OF_NUMPY.get(want.name, want.name)}"
        )
    got = array.dtype.name
    if numbers_in_a_list:
        got = f"{got} (a list of Python numbers, as numpy reads it)"
    if not array.dtype.isnative and array.dtype.newbyteorder("=") == want:
        # The model's dtype in the other byte order: say so, not "float32; expects float32".
        got = f"{got} in the other byte order ({array.dtype.str!r}), not the machine's"
    raise InvalidInput(f"{where} has dtype {got}; the model expects {spec.describe()} ({hint})")


def _names(specs: tuple[TensorSpec, ...]) -> str:
    return (
        ", ".join(f"{s.name!r} {s.describe()}{' (optional)' if s.optional else ''}" for s in specs)
        or "(none)"
    )


class Labelled(Protocol):
    """What answered an execution, as an error message names it (a replica)."""

    @property
    def label(self) -> str:
        """E.g. ``"instance 0 (cpu)"``."""
        ...


class OutputCheck:
    """A model's declared outputs, as the engine checks every execution's answer against them.

    Made once per model at load. An answer fits when it is a ``dict`` with
    exactly the declared names, each an ``np.ndarray`` of the declared dtype
    (in either byte order; a ``BYTES`` output: an ``object``, ``str_`` or
    ``bytes_`` array), rank
    and fixed sizes, and, for a batched execution, one row per input row.
    Symbolic and open (``None``, ``-1`` in a config) sizes take any size. An
    answer that does not fit fails its execution's requests with a
    [`BackendError`][trioinfer.BackendError] naming the model, the
    instance, the output, what came and what was declared: the backend's
    fault, a 500 over HTTP. Nothing is converted: metadata says what a client
    receives, and a model that answers otherwise is wrong, not rounded (as
    Triton refuses such outputs, "unexpected datatype").

    On the request path: the usual answer is judged in a few identity and
    integer comparisons per output; anything else takes the slow path, which
    says what is wrong. An instance whose answers fit by construction or by
    its own check (ONNX Runtime's, the Python backend's) says
    ``checks_outputs = True``: then only the names and the batch's rows are
    checked here (`for_instances`).
    """

    __slots__ = ("_expected", "_model", "_specs", "names")

    #: Whether it checks dtypes and shapes too (not only names and rows).
    full = True
    #: The declared output names.
    names: frozenset[str]

    @staticmethod
    def for_instances(
        model: str, signature: ModelSignature, instances: Sequence[object]
    ) -> OutputCheck:
        """The check for a model served by *instances*: less where each checks its own.

        Less only where every instance says ``checks_outputs = True`` of the very
        signature checked here (its own ``signature``): an instance vouches for the
        outputs it declares, not for a signature that fixes more than those.
        """
        if instances and all(
            getattr(i, "checks_outputs", False) is True
            and getattr(i, "signature", None) == signature
            for i in instances
        ):
            return _NamesAndRows(model, signature)
        return OutputCheck(model, signature)

    def __init__(self, model: str, signature: ModelSignature) -> None:
        self._model = model
        self._specs = signature.outputs
        self.names = frozenset(spec.name for spec in signature.outputs)
        # (name, dtype, rank, fixed (axis, size) pairs) of each declared output.
        self._expected = tuple(
            (
                spec.name,
                spec.dtype,
                spec.rank,
                tuple(
                    (axis, dim)
                    for axis, dim in enumerate(spec.shape)
                    if isinstance(dim, int) and not isinstance(dim, bool) and dim >= 0
                ),
            )
            for spec in signature.outputs
        )

    def check(self, outputs: object, rows: int, who: Labelled) -> None:
        """Raise `BackendError` unless *outputs* fit the signature (*rows* rows each; 0: unbatched).

        *who* answered: its ``label`` names it in the message (read only then:
        a replica's is formatted on each read).
        """
        if outputs.__class__ is dict and outputs.keys() == self.names:
            for name, dtype, rank, fixed in self._expected:
                array = outputs[name]
                if array.__class__ is not np.ndarray:
                    break
                # Most are numpy's own dtype objects; ONNX Runtime's arrays carry equal copies.
                got = array.dtype
                if got is not dtype and got != dtype:
                    break
                shape = array.shape
                # (Batched, every output has a first dimension: ModelSignature.batched.)
                if len(shape) != rank or (rows and shape[0] != rows):
                    break
                # A loop, not any() over a generator: a third of the cost per output.
                misfit = False
                for axis, size in fixed:
                    if shape[axis] != size:
                        misfit = True
                        break
                if misfit:
                    break
            else:
                return
        self._explain(outputs, rows, who)

    def requested(
        self, outputs: object, wanted: tuple[str, ...], rows: int, who: Labelled
    ) -> dict[str, Any]:
        """*outputs* narrowed to *wanted* (a request's requested outputs), each checked.

        A `RequestsInstance` may answer a request that asked for some outputs
        with those alone; what it answers beyond them is dropped unchecked.

        Raises:
            BackendError: *outputs* is not a mapping, lacks one of *wanted*, or
                one of them does not fit (as `check` says).
        """
        if not isinstance(outputs, Mapping):
            self._explain(outputs, rows, who)  # (raises: not a mapping)
        assert isinstance(outputs, Mapping)
        missing = [name for name in wanted if name not in outputs]
        if missing:
            raise BackendError(
                f"model {self._model!r}: {who.label} returned outputs "
                f"{sorted(map(str, outputs))} for a request that asked for {list(wanted)} "
                f"(missing {missing}); answer every requested output"
            )
        narrowed = {name: outputs[name] for name in wanted}
        # Each as `_explain` checks one (this is no fast path: its model reads requests).
        for spec in self._specs:
            if spec.name in narrowed:
                problem = output_misfit(spec, narrowed[spec.name], rows)
                if problem is not None:
                    raise BackendError(
                        f"model {self._model!r}: {who.label} returned output {spec.name!r} "
                        f"{problem}"
                    )
        return narrowed

    def _explain(self, outputs: object, rows: int, who: Labelled) -> None:
        # The slow path: raise with what is wrong, or return for an answer the fast
        # path could not judge (a dtype equal but not the same object, a BYTES output
        # as str_, a dtype the signature leaves open, a mapping that is not a dict).
        where = f"model {self._model!r}: {who.label}"
        declared = [spec.name for spec in self._specs]
        if not isinstance(outputs, Mapping):
            raise BackendError(
                f"{where} returned a {type(outputs).__name__!r} object; a backend's execute() "
                f"returns a dict of its outputs by name ({declared})"
            )
        got = sorted(map(str, outputs))
        if got != sorted(declared):
            missing = sorted(set(declared) - set(got))
            extra = sorted(set(got) - set(declared))
            raise BackendError(
                f"{where} returned outputs {got}, but its signature declares {declared} "
                f"(missing {missing}, undeclared {extra}); a backend returns every declared "
                "output, and only those"
            )
        for spec in self._specs:
            problem = output_misfit(spec, outputs[spec.name], rows)
            if problem is not None:
                raise BackendError(f"{where} returned output {spec.name!r} {problem}")


@final
class _NamesAndRows(OutputCheck):
    # For instances that check dtypes and shapes themselves: the names, and each
    # output's rows (which only the engine knows). What is wrong, _explain says.
    __slots__ = ()
    full = False

    def check(self, outputs: object, rows: int, who: Labelled) -> None:
        if outputs.__class__ is dict and outputs.keys() == self.names:
            if not rows:
                return
            for array in outputs.values():
                if array.__class__ is not np.ndarray or not array.ndim or len(array) != rows:
                    break
            else:
                return
        self._explain(outputs, rows, who)


def output_misfit(spec: TensorSpec, array: object, rows: int) -> str | None:
    """What is wrong with *array* as output *spec* (*rows* rows; 0: unbatched), or None.

    The text follows "returned output 'name'" in a message.
    """
    # A numpy scalar (x.sum(), say) is a rank-0 array in all but its class: accepted.
    if not isinstance(array, np.ndarray | np.generic):
        return (
            f"as a {type(array).__name__!r} object; its signature declares a numpy array "
            f"{spec.describe()}"
        )
    want = spec.dtype
    if (
        want is not None
        and array.dtype != want
        and not (want.kind == "O" and array.dtype.kind in "US")
        # The declared dtype in the other byte order holds the same values, and every
        # codec sends them little-endian: a float32 from numpy.frombuffer(b, ">f4").
        and (array.dtype.isnative or array.dtype.newbyteorder("=") != want)
    ):
        return (
            f"with dtype {array.dtype.name}; its signature declares {spec.describe()} (the "
            "engine does not convert outputs: clients are told the declared dtype)"
        )
    shape = array.shape
    if rows and (not shape or shape[0] != rows):
        return (
            f"with shape {list(shape)} for a batch of {rows} rows; every output of a batched "
            "model must have one row per input row, or no request could be given its own rows "
            "(an output whose first dimension is not the batch must be named differently from "
            "the inputs' in the model; then each request runs alone)"
        )
    if len(shape) != spec.rank or any(
        isinstance(dim, int) and not isinstance(dim, bool) and dim >= 0 and dim != size
        for dim, size in zip(spec.shape, shape, strict=True)
    ):
        return f"with shape {list(shape)}; its signature declares {spec.describe()}"
    return None


def rows(arrays: Mapping[str, np.ndarray[Any, Any]]) -> int:
    """The batch size of a set of validated, batched inputs (1 for inputs without rows)."""
    for array in arrays.values():
        return int(array.shape[0]) if array.ndim else 1
    return 1


def requested_outputs(model: str, signature: ModelSignature, outputs: object) -> tuple[str, ...]:
    """The names of *outputs* (a request's ``outputs=``), checked against *signature*.

    Each once, in the caller's order; empty: every output.

    Raises:
        InvalidInput: *outputs* is not a sequence of strings, or names an output
            the model does not have.
    """
    if isinstance(outputs, str) or not isinstance(outputs, Sequence | Collection):
        raise InvalidInput(
            f"outputs of a request to model {model!r} must be a list of output names, got "
            f"{outputs!r:.80}"
        )
    names = tuple(dict.fromkeys(outputs))
    declared = [spec.name for spec in signature.outputs]
    for name in names:
        if name not in declared or not isinstance(name, str):
            raise InvalidInput(
                f"model {model!r} has no output {name!r:.80}; its outputs are "
                f"{', '.join(map(repr, declared))}"
            )
    return names
