"""What a request carries: its input tensors, random from model metadata or read from files.

`BenchError` is the tool's own error: the benchmark cannot run.
"""

from __future__ import annotations

import math
import zipfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import attrs
import numpy as np
import numpy.typing as npt

from .._exceptions import TrioInferError
from ..server import Limits, decode_infer_request, v2_datatype, v2_numpy_dtype


class BenchError(TrioInferError):
    """The benchmark cannot run: no server, no such model, unusable input data."""


@attrs.frozen(eq=False)
class Tensor:
    """One input tensor of one request variant.

    Attributes:
        name: The model input's name.
        datatype: Its V2 datatype (``"FP32"``, ``"BYTES"``, ...).
        array: The values.
    """

    name: str
    datatype: str
    array: npt.NDArray[Any]


#: What ``--input-data`` generates when it names no file: random values, or zeros.
InputData = Literal["random", "zero"]


def random_inputs(
    specs: Sequence[Mapping[str, Any]],
    shapes: Mapping[str, Sequence[int]] | None = None,
    *,
    seed: int = 0,
) -> list[Tensor]:
    """Make one request's inputs from V2 model metadata (``inputs``: name, datatype, shape).

    Integers are drawn from 0 to 99, floats from [0, 1), booleans half true,
    strings 8 lowercase letters. Variable dimensions (``-1``) become 1 unless
    *shapes* gives the input's whole shape.

    Raises:
        BenchError: A datatype that has no numpy type, or a *shapes* entry for no input.
    """
    rng = np.random.default_rng(seed)

    def fill(datatype: str, dtype: np.dtype[Any], shape: tuple[int, ...]) -> npt.NDArray[Any]:
        if datatype == "BYTES":
            letters = rng.integers(97, 123, size=(*shape, 8), dtype=np.uint8)
            return np.array(
                [row.tobytes().decode() for row in letters.reshape(-1, 8)], dtype=object
            ).reshape(shape)
        if dtype.kind == "b":
            return rng.random(shape) < 0.5
        if dtype.kind in "iu":
            return rng.integers(0, 100, size=shape).astype(dtype)
        return rng.random(shape).astype(dtype)

    return _generated(specs, shapes, fill)


def zero_inputs(
    specs: Sequence[Mapping[str, Any]],
    shapes: Mapping[str, Sequence[int]] | None = None,
) -> list[Tensor]:
    """Make one request's inputs of zeros from V2 model metadata, as `random_inputs` shapes them.

    Numbers are 0, booleans false, and strings ``"0"``: perf_analyzer's
    ``--input-data zero`` leaves strings random, but ``"0"`` is what a model
    that reads numbers from strings accepts, and it is as plain a value.

    Raises:
        BenchError: A datatype that has no numpy type, or a *shapes* entry for no input.
    """

    def fill(datatype: str, dtype: np.dtype[Any], shape: tuple[int, ...]) -> npt.NDArray[Any]:
        if datatype == "BYTES":
            return np.full(shape, "0", dtype=object)
        return np.zeros(shape, dtype=dtype)

    return _generated(specs, shapes, fill)


#: The most elements the tool generates for one input: what a server with default
#: limits takes in one tensor.
_MOST_ELEMENTS = Limits().max_elements_per_tensor


def _generated(
    specs: Sequence[Mapping[str, Any]],
    shapes: Mapping[str, Sequence[int]] | None,
    fill: Callable[[str, np.dtype[Any], tuple[int, ...]], npt.NDArray[Any]],
) -> list[Tensor]:
    shapes = dict(shapes or {})
    unknown = sorted(set(shapes) - {str(spec.get("name")) for spec in specs})
    if unknown:
        raise BenchError(
            f"--shape names {', '.join(map(repr, unknown))}, which the model has not; its "
            f"inputs are {', '.join(repr(spec.get('name')) for spec in specs)}"
        )
    tensors = []
    for spec in specs:
        name = str(spec["name"])
        datatype = str(spec["datatype"])
        shape = tuple(shapes.get(name, [max(int(d), 1) for d in spec.get("shape", [])]))
        declared = [int(d) for d in spec.get("shape", [])]
        if name in shapes and declared and not _fits(shape, declared):
            # The server would refuse every request (400s the tool would put down to
            # its random values): say so before the run.
            raise BenchError(
                f"--shape {name}={','.join(map(str, shape))} does not fit input {name!r}, "
                f"whose shape is {declared} (-1: any size); give a size for each "
                "dimension, the model's where it is fixed"
            )
        if any(d < 0 for d in shape):
            # numpy would fail deep inside with a traceback; -1 is the metadata's wildcard,
            # never a size the tool can fill.
            raise BenchError(
                f"--shape {name}={','.join(map(str, shape))}: a dimension is negative; "
                "give every dimension as a size of 0 or more"
            )
        elements = math.prod(shape)
        if elements > _MOST_ELEMENTS:
            # numpy would fail with a MemoryError traceback, or take gigabytes for
            # requests that a server refuses.
            raise BenchError(
                f"--shape {name}={','.join(map(str, shape))} is {elements} elements; a server "
                f"with default limits takes at most {_MOST_ELEMENTS} per input"
            )
        dtype = v2_numpy_dtype(datatype)
        if dtype is None:
            raise BenchError(
                f"input {name!r} has datatype {datatype!r}, which the tool cannot generate; "
                "pass --input-data with its values"
            )
        tensors.append(Tensor(name, datatype, fill(datatype, dtype, shape)))
    return tensors


def _fits(shape: Sequence[int], declared: Sequence[int]) -> bool:
    return len(shape) == len(declared) and all(
        d == want for d, want in zip(shape, declared, strict=True) if want >= 0
    )


def generated_inputs(
    specs: Sequence[Mapping[str, Any]],
    shapes: Mapping[str, Sequence[int]] | None = None,
    *,
    input_data: InputData = "random",
    seed: int = 0,
) -> list[Tensor]:
    """`random_inputs` or `zero_inputs`, as *input_data* says."""
    if input_data == "zero":
        return zero_inputs(specs, shapes)
    return random_inputs(specs, shapes, seed=seed)


def load_inputs(path: Path) -> list[Tensor]:
    """Read one request's inputs from a ``.npz`` (one array per input) or ``.json`` file.

    A JSON file is a V2 infer request body: ``{"inputs": [{"name", "shape",
    "datatype", "data"}, ...]}``, decoded by the server's own codec.

    Raises:
        BenchError: The file cannot be read or holds no usable inputs.
    """
    # np.load reads whatever the file holds: a lone .npy array (which is no context manager:
    # a TypeError traceback), or, for anything else, says it is pickled.
    if path.suffix == ".npz" and path.is_file() and not zipfile.is_zipfile(path):
        raise BenchError(
            f"cannot read inputs from {path}: it is not an .npz archive; write one with "
            "numpy.savez(path, input=array), one array per input, named as the input"
        )
    try:
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as npz:
                arrays = {name: npz[name] for name in npz.files}
        else:
            arrays = decode_infer_request(path.read_bytes(), None, Limits()).inputs
    except (OSError, ValueError, TrioInferError) as exc:
        raise BenchError(
            f"cannot read inputs from {path}: {exc}; expected an .npz file with one array per "
            "input, or a V2 infer request as JSON"
        ) from None
    if not arrays:
        raise BenchError(f"{path} holds no inputs")
    try:
        return [Tensor(name, v2_datatype(a.dtype), np.asarray(a)) for name, a in arrays.items()]
    except ValueError as exc:
        raise BenchError(f"{path}: {exc}") from None
