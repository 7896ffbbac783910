"""What every part of the backend shares: ONNX Runtime itself, imported on first use.

Also how a session's inputs and outputs read as a `ModelSignature`, how ONNX
Runtime's errors read in one line, and the plugin's logger.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Collection, Mapping
from typing import Any, Final

import attrs

from trioinfer import BackendUnavailable, ConfigError, ModelSignature, TensorSpec
from trioinfer.lowlevel import numpy_dtype

log = logging.getLogger("trioinfer.onnxruntime")


#: How to get ONNX Runtime, said where it is missing.
_INSTALL_ORT: Final = (
    "install trioinfer with the 'cpu' extra (onnxruntime) or the 'gpu' extra "
    "(onnxruntime-gpu), one of them, e.g. pip install -e '.[cpu]' in a clone"
)


def _ort() -> Any:
    # Imported on first use so that listing plugins stays cheap. ONNX Runtime is not a
    # dependency of the core: the cpu or gpu extra picks its build.
    try:
        import onnxruntime
    except ImportError as exc:
        raise BackendUnavailable(
            f"the onnxruntime backend needs ONNX Runtime, which does not import here ({exc}): "
            f"{_INSTALL_ORT}"
        ) from exc
    return onnxruntime


def missing_ort() -> str | None:
    """ONNX Runtime, if it is not installed here; else None. Imports nothing."""
    if importlib.util.find_spec("onnxruntime") is None:
        return f"ONNX Runtime is not installed: {_INSTALL_ORT}"
    return None


def _signature(session: Any, optional: frozenset[str] = frozenset()) -> ModelSignature:
    """The session's inputs and outputs; *optional*: its inputs that requests may leave out.

    ONNX Runtime lists an input with an initializer apart (see `_check_optional`):
    those of them the config declares optional follow the others, marked so.
    """

    def spec(arg: Any, optional: bool = False) -> TensorSpec:
        shape = tuple(d if isinstance(d, (int, str)) else None for d in arg.shape)
        # ONNX strings are UTF-8 text: the engine decodes bytes elements for it.
        utf8 = arg.type == "tensor(string)"
        dtype = numpy_dtype(arg.type)
        return TensorSpec(arg.name, dtype, shape, arg.type, utf8=utf8, optional=optional)

    inputs = tuple(spec(a) for a in session.get_inputs())
    if optional:
        overridable = session.get_overridable_initializers()
        inputs += tuple(spec(a, True) for a in overridable if a.name in optional)
    return ModelSignature(inputs, tuple(spec(a) for a in session.get_outputs()))


def _narrowed(
    signature: ModelSignature,
    inputs: Mapping[str, tuple[int | str, ...]],
    outputs: Mapping[str, tuple[int | str, ...]],
    model: str,
) -> ModelSignature:
    """*signature* with the sizes the ``inputs`` and ``outputs`` options fix.

    The graph's own signature with each size it leaves symbolic or open that the
    options fix (as Triton takes a config's dims for the model's): what metadata
    reports, what requests are checked against and what answers must fit. A name
    fills an open size only (a symbol of the graph's stays, as the batch dimension's
    ties inputs to outputs); -1 keeps the graph's size.

    Raises:
        ConfigError: A tensor the graph does not have, another rank, or a size the
            graph fixes otherwise.
    """
    if not inputs and not outputs:
        return signature

    def narrow(kind: str, specs: tuple[TensorSpec, ...], declared: Mapping[str, Any]) -> Any:
        names = [spec.name for spec in specs]
        strays = [name for name in declared if name not in names]
        if strays:
            raise ConfigError(
                f"model {model!r}: the config declares {kind} {strays[0]!r}, which the graph "
                f"does not have; its {kind}s are {', '.join(map(repr, names))}"
            )
        out = []
        for spec in specs:
            shape = declared.get(spec.name)
            if shape is None:
                out.append(spec)
                continue
            graph = ", ".join("-1" if d is None else str(d) for d in spec.shape)
            misfit = len(shape) != spec.rank or any(
                isinstance(g, int) and g >= 0 and isinstance(d, int) and d not in (-1, g)
                for g, d in zip(spec.shape, shape, strict=False)
            )
            if misfit:
                raise ConfigError(
                    f"model {model!r}: the config declares {kind} {spec.name!r} with shape "
                    f"[{', '.join(map(str, shape))}] (a batched model's batch dimension "
                    f"first, as -1); the graph's is [{graph}], and a size the graph fixes "
                    "cannot be changed"
                )
            dims = tuple(
                d if (isinstance(d, int) and d >= 0) or (isinstance(d, str) and g is None) else g
                for g, d in zip(spec.shape, shape, strict=True)
            )
            out.append(attrs.evolve(spec, shape=dims))
        return tuple(out)

    return ModelSignature(
        narrow("input", signature.inputs, inputs), narrow("output", signature.outputs, outputs)
    )


def _reshaped(
    signature: ModelSignature,
    inputs: Mapping[str, tuple[int, ...]],
    outputs: Mapping[str, tuple[int, ...]],
) -> ModelSignature:
    """*signature* (the graph's terms) as clients see it: reshaped tensors in their shapes.

    Each shape is fixed but for a leading -1, the batch dimension, which keeps the
    graph's (its symbol ties inputs to outputs). The elements are the same (the
    options' check), so that only the shape differs.
    """
    if not inputs and not outputs:
        return signature

    def client(specs: tuple[TensorSpec, ...], shapes: Mapping[str, tuple[int, ...]]) -> Any:
        return tuple(
            spec
            if spec.name not in shapes
            else attrs.evolve(
                spec,
                shape=tuple(
                    spec.shape[0] if i == 0 and d == -1 else d
                    for i, d in enumerate(shapes[spec.name])
                ),
            )
            for spec in specs
        )

    return ModelSignature(client(signature.inputs, inputs), client(signature.outputs, outputs))


def _check_optional(
    session: Any, optional: frozenset[str], model: str, declared: Collection[str] = ()
) -> None:
    """Refuse an optional flag the graph disagrees with.

    Only an input with an initializer may be left out, and such an input is
    served only as optional. ONNX Runtime lists a graph input that has an
    initializer (a value of the graph's own) apart from the others, as an
    overridable initializer: a run without it uses that value, as Triton runs a
    request without an optional input. *declared*: every input the config names
    (optional or not).
    """
    required = {arg.name for arg in session.get_inputs()}
    overridable = {arg.name for arg in session.get_overridable_initializers()}
    for name in sorted(optional):
        if name in required:
            raise ConfigError(
                f"model {model!r}: the config declares input {name!r} optional, but the graph "
                "needs it (it has no initializer that a run without it would use); "
                "remove optional, or give the input an initializer in the graph"
            )
        if name not in overridable:
            raise ConfigError(
                f"model {model!r}: the config declares input {name!r} optional, which the graph "
                f"does not have; its inputs are {', '.join(map(repr, sorted(required)))}"
            )
    for name in sorted(set(declared) - optional):
        if name in overridable:
            # Not listed among the graph's inputs, it read as one the graph lacks.
            raise ConfigError(
                f"model {model!r}: the config declares input {name!r} required, but the graph "
                "gives it a value of its own (an initializer), which a request may override "
                "or leave to the graph; declare it optional (optional: true in config.pbtxt, "
                "optional = true in the inputs option)"
            )


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    # ORT prefixes "[ONNXRuntimeError] : 1 : FAIL : "; the rest is the message.
    if text.startswith("[ONNXRuntimeError]"):
        text = text.split(" : ", 3)[-1]
    return text.splitlines()[0] if text else type(exc).__name__
