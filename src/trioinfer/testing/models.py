"""Builders of small, real ONNX models for tests, documentation and benchmarks.

Each builder writes one model file with ``onnx.helper`` (opset 17, IR version 9), checks it
with ``onnx.checker``, and returns its path, so a test can make exactly the model it needs in
a temporary directory instead of relying on files checked into the repository. Weights come
from seeded numpy generators: the same arguments always write the same bytes.

This module needs the ``onnx`` package (the ``trioinfer[onnx]`` extra); it is imported only
when asked for, as ``from trioinfer.testing import models``.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

try:
    import onnx
    from onnx import TensorProto, helper, numpy_helper
except ModuleNotFoundError as exc:  # pragma: no cover - the tests install the extra
    if exc.name != "onnx":
        raise
    raise ModuleNotFoundError(
        "trioinfer.testing.models writes its models with onnx.helper, and the onnx package "
        "is not installed: install trioinfer with the 'onnx' extra, e.g. "
        "pip install -e '.[cpu,onnx]' in a clone",
        name="onnx",
    ) from exc

__all__ = [
    "write_accumulator",
    "write_add",
    "write_identity",
    "write_mlp",
    "write_slow",
    "write_two_branches",
    "write_wide_mlp",
]

_OPSET = 17
_IR_VERSION = 9
_PRODUCER = "trioinfer.testing.models"

# numpy dtypes with an exact ONNX element type. Strings have no fixed-width ONNX
# equivalent, so every numpy string kind maps to STRING separately (see _onnx_type).
_NUMPY_TO_ONNX: dict[np.dtype[Any], int] = {
    np.dtype(np.float16): TensorProto.FLOAT16,
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float64): TensorProto.DOUBLE,
    np.dtype(np.int8): TensorProto.INT8,
    np.dtype(np.int16): TensorProto.INT16,
    np.dtype(np.int32): TensorProto.INT32,
    np.dtype(np.int64): TensorProto.INT64,
    np.dtype(np.uint8): TensorProto.UINT8,
    np.dtype(np.uint16): TensorProto.UINT16,
    np.dtype(np.uint32): TensorProto.UINT32,
    np.dtype(np.uint64): TensorProto.UINT64,
    np.dtype(np.bool_): TensorProto.BOOL,
    np.dtype(np.complex64): TensorProto.COMPLEX64,
    np.dtype(np.complex128): TensorProto.COMPLEX128,
}

# The element types ONNX's Add and Sub (opset 14 onwards) accept that numpy can hold.
_ARITHMETIC_TYPES = frozenset(
    {
        TensorProto.FLOAT16,
        TensorProto.FLOAT,
        TensorProto.DOUBLE,
        TensorProto.INT8,
        TensorProto.INT16,
        TensorProto.INT32,
        TensorProto.INT64,
        TensorProto.UINT8,
        TensorProto.UINT16,
        TensorProto.UINT32,
        TensorProto.UINT64,
    }
)


def _onnx_type(dtype: npt.DTypeLike) -> int:
    """Return the ONNX element type for a numpy dtype, or raise ``ValueError``."""
    np_dtype = np.dtype(dtype)
    # numpy and ONNX Runtime exchange string tensors as object arrays of str, but callers
    # naturally say str or numpy.str_ (a fixed-width unicode dtype), so accept those too.
    if np_dtype.kind in "OUS":
        return int(TensorProto.STRING)
    try:
        return _NUMPY_TO_ONNX[np_dtype]
    except KeyError:
        raise ValueError(f"numpy dtype {np_dtype} has no ONNX element type") from None


def _save(graph: onnx.GraphProto, path: str | os.PathLike[str], doc: str) -> Path:
    """Wrap a graph in a model, check it, and write it (making parent directories)."""
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", _OPSET)],
        ir_version=_IR_VERSION,
        producer_name=_PRODUCER,
        doc_string=doc,
    )
    onnx.checker.check_model(model, full_check=True)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, out)
    return out


def write_mlp(
    path: str | os.PathLike[str],
    sizes: Sequence[int] = (64, 32, 10),
    *,
    seed: int = 0,
    input_name: str = "input",
    output_name: str = "output",
) -> Path:
    """Write a float32 multilayer perceptron with random weights.

    The model maps ``float32[batch, sizes[0]]`` to ``float32[batch, sizes[-1]]`` through one
    ``MatMul`` and ``Add`` per layer with ``Relu`` between layers, and no softmax at the end.
    Weights are scaled (He initialisation) so inputs of order one give outputs of order one.

    Args:
        path: Where to write the ``.onnx`` file.
        sizes: The width of each layer, input first: at least two positive ints.
        seed: Seed for the weights; the same seed writes the same bytes.
        input_name: The name of the model's input.
        output_name: The name of the model's output.

    Returns:
        The path written, as a `Path`.

    Raises:
        ValueError: If ``sizes`` has fewer than two entries or one is not positive, or the
            two names are equal.
    """
    sizes = tuple(sizes)
    if len(sizes) < 2 or any(isinstance(s, bool) or int(s) != s or s < 1 for s in sizes):
        raise ValueError(f"sizes must be at least two positive ints, got {sizes!r}")
    if input_name == output_name:
        raise ValueError(f"input and output need different names, both are {input_name!r}")

    rng = np.random.default_rng(seed)
    nodes = []
    initializers = []
    current = input_name
    n_layers = len(sizes) - 1
    for i, (n_in, n_out) in enumerate(itertools.pairwise(sizes)):
        last = i == n_layers - 1
        # He scaling keeps activations of order one through the Relus; the last layer has
        # no Relu after it, so it uses the plain 1/sqrt(fan-in) scaling instead.
        scale = np.float32(np.sqrt((1.0 if last else 2.0) / n_in))
        weight = rng.standard_normal((n_in, n_out), dtype=np.float32) * scale
        bias = rng.uniform(-0.1, 0.1, n_out).astype(np.float32)
        initializers += [
            numpy_helper.from_array(weight, f"layer{i}.weight"),
            numpy_helper.from_array(bias, f"layer{i}.bias"),
        ]
        matmul, added = f"layer{i}.matmul", output_name if last else f"layer{i}.add"
        nodes += [
            helper.make_node("MatMul", [current, f"layer{i}.weight"], [matmul], name=matmul),
            helper.make_node("Add", [matmul, f"layer{i}.bias"], [added], name=f"layer{i}.add"),
        ]
        current = added
        if not last:
            current = f"layer{i}.relu"
            nodes.append(helper.make_node("Relu", [added], [current], name=current))

    graph = helper.make_graph(
        nodes,
        "mlp",
        inputs=[helper.make_tensor_value_info(input_name, TensorProto.FLOAT, ["batch", sizes[0]])],
        outputs=[
            helper.make_tensor_value_info(output_name, TensorProto.FLOAT, ["batch", sizes[-1]])
        ],
        initializer=initializers,
    )
    widths = " -> ".join(str(s) for s in sizes)
    doc = f"Random float32 MLP ({widths}, Relu between layers, seed {seed}); no softmax."
    return _save(graph, path, doc)


def write_wide_mlp(path: str | os.PathLike[str], *, seed: int = 0) -> Path:
    """Write the benchmark MLP: ``float32[batch, 1024]`` to ``float32[batch, 1000]``.

    It is `write_mlp()` with layer sizes ``(1024, 4096, 4096, 1000)``: about 25 million
    weights, a file of roughly 100 MB, and enough arithmetic per row for batching to matter.

    Args:
        path: Where to write the ``.onnx`` file.
        seed: Seed for the weights.

    Returns:
        The path written.
    """
    return write_mlp(path, (1024, 4096, 4096, 1000), seed=seed)


def write_add(
    path: str | os.PathLike[str], *, dtype: npt.DTypeLike = np.float32, width: int = 4
) -> Path:
    """Write a model with two inputs and two outputs: their sum and their difference.

    Inputs ``a`` and ``b`` and outputs ``sum`` (``a + b``) and ``diff`` (``a - b``) all
    have shape ``[batch, width]`` and the given element type.

    Args:
        path: Where to write the ``.onnx`` file.
        dtype: A numpy float or integer dtype (float16/32/64, int8-64 or uint8-64).
        width: The fixed size of the second dimension.

    Returns:
        The path written.

    Raises:
        ValueError: If ONNX's ``Add`` does not take ``dtype`` (bool, strings, complex) or
            ``width`` is not positive.
    """
    elem_type = _onnx_type(dtype)
    if elem_type not in _ARITHMETIC_TYPES:
        raise ValueError(f"ONNX Add and Sub do not take {np.dtype(dtype)} tensors")
    if width < 1:
        raise ValueError(f"width must be positive, got {width}")
    shape: list[str | int] = ["batch", width]
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["a", "b"], ["sum"], name="add"),
            helper.make_node("Sub", ["a", "b"], ["diff"], name="sub"),
        ],
        "add",
        inputs=[helper.make_tensor_value_info(n, elem_type, shape) for n in ("a", "b")],
        outputs=[helper.make_tensor_value_info(n, elem_type, shape) for n in ("sum", "diff")],
    )
    doc = f"sum = a + b and diff = a - b, all {np.dtype(dtype)}[batch, {width}]."
    return _save(graph, path, doc)


def write_identity(
    path: str | os.PathLike[str],
    *,
    dtype: npt.DTypeLike = np.float32,
    shape: Sequence[int | str | None] = ("batch", 3),
) -> Path:
    """Write a model whose output ``y`` is its input ``x``.

    Useful for checking how dtypes and declared shapes travel through the stack without
    any arithmetic in the way.

    Args:
        path: Where to write the ``.onnx`` file.
        dtype: Any numpy dtype with an ONNX element type: floats, signed and unsigned ints,
            bool, complex, or a string dtype (``str``, ``numpy.str_``, ``object``), which
            becomes ONNX ``STRING``. ONNX Runtime refuses to load complex models, which
            makes them useful for testing how a backend reports a model it cannot load.
        shape: One entry per dimension: an int for a fixed size, a str for a symbolic
            size, or ``None`` for a dimension left unknown. ``()`` declares a scalar.

    Returns:
        The path written.

    Raises:
        ValueError: If ``dtype`` has no ONNX element type or a fixed size is negative.
    """
    elem_type = _onnx_type(dtype)
    dims: list[int | str | None] = list(shape)
    for dim in dims:
        if dim is not None and not isinstance(dim, str) and (isinstance(dim, bool) or dim < 0):
            raise ValueError(f"shape entries must be ints >= 0, str or None, got {shape!r}")
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"], name="identity")],
        "identity",
        inputs=[helper.make_tensor_value_info("x", elem_type, dims)],
        outputs=[helper.make_tensor_value_info("y", elem_type, dims)],
    )
    described = ", ".join("?" if d is None else str(d) for d in dims)
    type_name = TensorProto.DataType.Name(elem_type).lower()
    return _save(graph, path, f"y = x, {type_name}[{described}].")


def write_slow(
    path: str | os.PathLike[str], *, width: int = 512, depth: int = 1000, seed: int = 0
) -> Path:
    """Write a model that takes a long time to run, for testing cancellation and aborts.

    The graph is a chain of ``depth`` ``MatMul`` nodes that all multiply by one shared
    ``width`` x ``width`` weight, so the file stays small (one matrix) while the work grows
    with ``depth``. ONNX Runtime checks for termination between nodes, so a long chain of
    modest nodes can be stopped promptly. With the defaults a batch of 256 is about
    130 GFLOP, a node a millisecond or so: more than a second on one CPU thread of a
    current x86 server. Building the session takes about half a second.

    The weight is a random orthogonal matrix (entries about ``1/sqrt(width)``), so values
    keep their size through the whole chain instead of overflowing or sinking into
    denormals, whose slow arithmetic would make the timing erratic.

    Args:
        path: Where to write the ``.onnx`` file.
        width: The size of the second dimension of ``x`` and ``y`` (``float32[batch, width]``).
        depth: The number of ``MatMul`` nodes; the running time grows in proportion.
        seed: Seed for the weight.

    Returns:
        The path written.

    Raises:
        ValueError: If ``width`` or ``depth`` is not positive.
    """
    if width < 1 or depth < 1:
        raise ValueError(f"width and depth must be positive, got {width} and {depth}")
    weight = _orthogonal(width, seed)
    nodes = _matmul_chain("x", "y", depth)
    graph = helper.make_graph(
        nodes,
        "slow",
        inputs=[helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
        outputs=[helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", width])],
        initializer=[numpy_helper.from_array(weight, "weight")],
    )
    doc = (
        f"Deliberately slow: y = x @ W^{depth} as {depth} chained MatMuls by one shared "
        f"{width}x{width} orthogonal float32 matrix (seed {seed})."
    )
    return _save(graph, path, doc)


def write_two_branches(
    path: str | os.PathLike[str], *, width: int = 64, depth: int = 50, seed: int = 0
) -> Path:
    """Write a model of two branches, one cheap and one costly, for requested outputs.

    Input ``x``: ``float32[batch, width]``. Outputs: ``cheap = x + x``, one
    node; ``costly = x @ W^depth``, a chain of ``depth`` ``MatMul`` nodes by
    one shared orthogonal matrix (as `write_slow()`'s). A request that asks for
    ``cheap`` alone needs none of the chain: what a runtime that prunes its graph
    by the outputs fetched can skip (ONNX Runtime's inference builds run it all
    the same; see ``benchmarks/bench_outputs.py``).

    Args:
        path: Where to write the ``.onnx`` file.
        width: The second dimension of ``x`` and both outputs.
        depth: The number of ``MatMul`` nodes of the costly branch.
        seed: Seed for the weight.

    Returns:
        The path written.

    Raises:
        ValueError: If ``width`` or ``depth`` is not positive.
    """
    if width < 1 or depth < 1:
        raise ValueError(f"width and depth must be positive, got {width} and {depth}")
    weight = _orthogonal(width, seed)
    nodes = [helper.make_node("Add", ["x", "x"], ["cheap"], name="double")]
    nodes += _matmul_chain("x", "costly", depth)
    graph = helper.make_graph(
        nodes,
        "two_branches",
        inputs=[helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
        outputs=[
            helper.make_tensor_value_info("cheap", TensorProto.FLOAT, ["batch", width]),
            helper.make_tensor_value_info("costly", TensorProto.FLOAT, ["batch", width]),
        ],
        initializer=[numpy_helper.from_array(weight, "weight")],
    )
    doc = (
        f"Two branches: cheap = x + x; costly = x @ W^{depth} as {depth} chained MatMuls by "
        f"one shared {width}x{width} orthogonal float32 matrix (seed {seed})."
    )
    return _save(graph, path, doc)


def _orthogonal(width: int, seed: int) -> np.ndarray[Any, np.dtype[np.float32]]:
    # A random orthogonal matrix: values keep their size through a chain of products.
    rng = np.random.default_rng(seed)
    q, r = np.linalg.qr(rng.standard_normal((width, width)))
    # Fixing the signs by R's diagonal makes Q uniformly distributed (and seed-determined).
    return (q * np.sign(np.diag(r))).astype(np.float32)


def _matmul_chain(source: str, target: str, depth: int) -> list[onnx.NodeProto]:
    # *depth* MatMul nodes by the initializer "weight", from *source* to *target*.
    nodes = []
    current = source
    for i in range(depth):
        out = target if i == depth - 1 else f"{target}_h{i}"
        nodes.append(helper.make_node("MatMul", [current, "weight"], [out], name=f"matmul{i}"))
        current = out
    return nodes


def write_accumulator(path: str | os.PathLike[str]) -> Path:
    """Write a stateful accumulator: the running sum of a sequence's INPUTs, as implicit state.

    Inputs (each int32 ``[batch, 1]``): ``INPUT``, ``START`` (1 on a
    sequence's first request) and ``STATE_IN``; outputs ``OUTPUT`` and
    ``STATE_OUT``, both ``STATE_IN * (1 - START) + INPUT``. Served with
    ``batcher = "sequence"`` and a ``[sequence]`` table naming ``START`` as
    the ``start`` control and ``STATE_IN``/``STATE_OUT`` as the state, it
    answers each request with the sum of its sequence so far (Triton's
    ``simple_sequence``, as an ONNX model).

    Returns:
        The path written.
    """
    shape: list[str | int] = ["batch", 1]
    one = numpy_helper.from_array(np.array(1, dtype=np.int32), "one")
    graph = helper.make_graph(
        [
            helper.make_node("Sub", ["one", "START"], ["keep"], name="keep"),
            helper.make_node("Mul", ["STATE_IN", "keep"], ["carried"], name="carry"),
            helper.make_node("Add", ["carried", "INPUT"], ["OUTPUT"], name="add"),
            helper.make_node("Identity", ["OUTPUT"], ["STATE_OUT"], name="state"),
        ],
        "accumulator",
        inputs=[
            helper.make_tensor_value_info(name, TensorProto.INT32, shape)
            for name in ("INPUT", "START", "STATE_IN")
        ],
        outputs=[
            helper.make_tensor_value_info(name, TensorProto.INT32, shape)
            for name in ("OUTPUT", "STATE_OUT")
        ],
        initializer=[one],
    )
    doc = "OUTPUT = STATE_OUT = STATE_IN * (1 - START) + INPUT, int32[batch, 1]."
    return _save(graph, path, doc)
