"""The ``python`` backend: a model that is a Python class, with a declared signature.

A model repository holds it as ``<model>/<version>/model.py`` beside
``<model>/config.toml``::

    backend = "python"

    [backend_options]
    class = "Model"                 # the class in model.py (the default)
    parameters = { vocabulary = "vocab.txt" }   # keyword arguments of its constructor

    [[backend_options.inputs]]
    name = "text"
    dtype = "string"
    shape = ["batch"]

    [[backend_options.outputs]]
    name = "ids"
    dtype = "int64"
    shape = ["batch", 16]

In code, ``backend_options={"class": Model, ...}`` names the class itself and
``path`` is not read. The class:

- ``__init__(self, **parameters)``; a ``device`` keyword, if it takes one,
  gets where the instance was placed (``"cpu"``, ``"cuda:0"``).
- ``infer(self, inputs) -> outputs``, dicts of numpy arrays by tensor name.
  ``async def infer`` runs on the event loop and is cancelled when every
  caller of its batch has left (the caller's deadline, a client going away);
  a plain ``def infer`` runs on the instance's own worker thread, and Python
  cannot interrupt it: a cancelled call runs to its end (an ``abort(self)``
  method, if the class has one, is called from the event loop then, to ask
  it to stop early).
- optional ``load(self)`` and ``close(self)``, sync (on the worker thread) or
  async, called once per instance after construction and at unload.

The engine checks inputs against the declared signature before they queue,
as for an ONNX model, and this backend checks every output against it: a
missing or extra output, another dtype, rank or fixed size is a
``BackendError`` naming the output. A model whose every input and output
has a symbolic first dimension receives batches from the ``dynamic``
batcher, and must return one row per input row.
"""

from __future__ import annotations

import importlib.util
import inspect
import itertools
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, final

import anyio
import numpy as np

from trioinfer import (
    BackendError,
    ConfigError,
    ModelConfig,
    ModelSignature,
    Placement,
    TensorSpec,
    WorkerThread,
)

__all__ = ["PythonBackend", "PythonInstance", "parse_signature"]

Arrays = Mapping[str, np.ndarray[Any, Any]]

#: The options this backend takes, with what each means.
OPTIONS: Mapping[str, str] = {
    "class": "the model's class: its name in the model file (default 'Model'), or in Python "
    "the class itself",
    "parameters": "keyword arguments for the class's constructor (a table)",
    "inputs": "the model's inputs: a list of tables with name, dtype and shape",
    "outputs": "the model's outputs: a list of tables with name, dtype and shape",
}

# dtype spellings accepted in a declared signature: numpy names, and the V2
# protocol's and Triton's names, so that a Triton config's types read as they are.
_V2_TYPES = {
    "BOOL": "bool", "UINT8": "uint8", "UINT16": "uint16", "UINT32": "uint32",
    "UINT64": "uint64", "INT8": "int8", "INT16": "int16", "INT32": "int32",
    "INT64": "int64", "FP16": "float16", "FP32": "float32", "FP64": "float64",
    "BYTES": "string", "STRING": "string",
}  # fmt: skip
_ONNX_NAMES = {
    "bool": "tensor(bool)", "uint8": "tensor(uint8)", "uint16": "tensor(uint16)",
    "uint32": "tensor(uint32)", "uint64": "tensor(uint64)", "int8": "tensor(int8)",
    "int16": "tensor(int16)", "int32": "tensor(int32)", "int64": "tensor(int64)",
    "float16": "tensor(float16)", "float32": "tensor(float)", "float64": "tensor(double)",
    "string": "tensor(string)",
}  # fmt: skip
_modules = itertools.count()


def parse_signature(model: str, options: Mapping[str, Any]) -> ModelSignature:
    """Read ``inputs`` and ``outputs`` from *options* into a signature.

    Each tensor is a table ``{name, dtype, shape}``. ``dtype`` is a numpy name
    (``"float32"``, ``"int64"``, ``"bool"``, ``"string"``) or a V2/Triton name
    (``"FP32"``, ``"TYPE_INT64"``, ``"BYTES"``). ``shape`` lists each
    dimension: an int for a fixed size, a name for a symbolic size shared
    between tensors (``"batch"``), or -1 for a size left open.

    Raises:
        ConfigError: Naming the tensor and what is wrong with it.
    """
    return ModelSignature(
        inputs=_tensors(model, "inputs", options.get("inputs")),
        outputs=_tensors(model, "outputs", options.get("outputs")),
    )


def _tensors(model: str, kind: str, value: object) -> tuple[TensorSpec, ...]:
    where = f"backend option {kind} of model {model!r}"
    if not isinstance(value, Sequence) or isinstance(value, str) or not value:
        raise ConfigError(
            f"{where} must be a non-empty list of tables with name, dtype and shape "
            f"(the python backend has no model file to read them from), got {value!r}"
        )
    specs: list[TensorSpec] = []
    for item in value:
        if not isinstance(item, Mapping) or set(item) != {"name", "dtype", "shape"}:
            raise ConfigError(
                f"each of {where} must be a table of name, dtype, shape; got {item!r}"
            )
        name, dtype, shape = item["name"], item["dtype"], item["shape"]
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}: a tensor name must be a non-empty string, got {name!r}")
        if any(spec.name == name for spec in specs):
            raise ConfigError(f"{where}: {name!r} is declared twice")
        numpy, onnx = _dtype(f"{where}, {name!r}", dtype)
        specs.append(TensorSpec(name, numpy, _shape(where, name, shape), onnx))
    return tuple(specs)


def _dtype(where: str, value: object) -> tuple[np.dtype[Any], str]:
    text = value.upper().removeprefix("TYPE_") if isinstance(value, str) else None
    name = _V2_TYPES.get(text or "") or (value.lower() if isinstance(value, str) else None)
    if name in ("object", "bytes", "str"):
        name = "string"
    if name not in _ONNX_NAMES:
        raise ConfigError(
            f"{where}: dtype {value!r} is not one of {', '.join(sorted(_ONNX_NAMES))} "
            "(or a V2 name such as 'FP32', 'INT64', 'BYTES')"
        )
    return np.dtype(object) if name == "string" else np.dtype(name), _ONNX_NAMES[name]


def _shape(where: str, name: str, value: object) -> tuple[int | str | None, ...]:
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise ConfigError(f"{where}, {name!r}: shape must be a list of dimensions, got {value!r}")
    dims: list[int | str | None] = []
    for dim in value:
        if (
            isinstance(dim, bool)
            or not isinstance(dim, (int, str))
            or dim == ""
            or (isinstance(dim, int) and dim < -1)
        ):
            raise ConfigError(
                f"{where}, {name!r}: each dimension must be a size >= 0, a symbolic name or "
                f"-1 (open); got {dim!r}"
            )
        dims.append(None if dim == -1 else dim)
    return tuple(dims)


@final
class PythonBackend:
    """Loads a Python class as a model: one object per instance (see the module's docs)."""

    async def load(self, config: ModelConfig, placement: Placement) -> PythonInstance:
        """Import the class, build one object for *placement*, and run its ``load``.

        Raises:
            ConfigError: An unknown option, or a signature that cannot be read.
            BackendError: The file or class is missing, or constructing or
                loading the object raised (chained).
        """
        options = config.backend_options
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise ConfigError(
                f"model {config.name!r}: unknown python backend option "
                f"{', '.join(map(repr, unknown))}; known: {', '.join(OPTIONS)}"
            )
        signature = parse_signature(config.name, options)
        cls = _model_class(config)
        parameters = options.get("parameters", {})
        if not isinstance(parameters, Mapping) or not all(isinstance(k, str) for k in parameters):
            raise ConfigError(
                f"backend option parameters of model {config.name!r} must be a table of "
                f"name = value, got {parameters!r}"
            )
        device = str(placement.device)
        kwargs = dict(parameters)
        if _takes(cls, "device"):
            kwargs["device"] = device
        label = f"model {config.name!r} instance {placement.index}"
        needs_thread = any(
            callable(getattr(cls, hook, None))
            and not inspect.iscoroutinefunction(getattr(cls, hook))
            for hook in ("infer", "load", "close")
        )
        worker = (
            await WorkerThread.start(
                f"trioinfer-python-{config.name}-{placement.index}",
                cpu_affinity=placement.cpu_affinity,
            )
            if needs_thread
            else None
        )
        try:
            instance = PythonInstance(
                _construct(cls, kwargs, label), signature, device, label, worker
            )
            await instance._call_hook("load")
        except BaseException:
            if worker is not None:
                await worker.aclose()
            raise
        return instance


def _construct(cls: type, kwargs: dict[str, Any], label: str) -> Any:
    try:
        model = cls(**kwargs)
    except Exception as exc:
        raise BackendError(
            f"{label}: {cls.__name__}(...) raised {type(exc).__name__}: {exc}"
        ) from exc
    infer = getattr(model, "infer", None)
    if not callable(infer):
        raise BackendError(f"{label}: class {cls.__name__} has no infer(self, inputs)")
    if inspect.isasyncgenfunction(infer) or inspect.isgeneratorfunction(infer):
        raise BackendError(
            f"{label}: {cls.__name__}.infer is a generator; a model answers each request "
            "with one dict of outputs (streaming models are not supported yet)"
        )
    return model


def _takes(cls: type, name: str) -> bool:
    try:
        parameters = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters


def _model_class(config: ModelConfig) -> type:
    chosen = config.backend_options.get("class", "Model")
    if isinstance(chosen, type):
        return chosen
    if not isinstance(chosen, str) or not chosen.isidentifier():
        raise ConfigError(
            f"backend option class of model {config.name!r} must be a class name such as "
            f"'Model' (or, in Python, the class itself), got {chosen!r}"
        )
    module = _import(config.name, config.path)
    cls = getattr(module, chosen, None)
    if not isinstance(cls, type):
        raise BackendError(
            f"model {config.name!r}: {config.path.name} defines no class {chosen!r} "
            "(set backend option class to the model's class)"
        )
    return cls


def _import(model: str, path: Path) -> ModuleType:
    # Each load imports the file afresh under its own module name, so that a
    # new version of model.py is what a reload runs, and two models' files
    # never share (or replace) each other's module.
    if not path.is_file():
        raise BackendError(f"model {model!r}: no model file {path.name} at the configured path")
    name = f"trioinfer_python_model_{next(_modules)}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:  # pragma: no cover  # a .py file always has one
        raise BackendError(f"model {model!r}: {path.name} cannot be imported")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look a class's module up there
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise BackendError(
            f"model {model!r}: importing {path.name} raised {type(exc).__name__}: {exc}"
        ) from exc
    return module


@final
class PythonInstance:
    """One object of a Python model's class, on its placement."""

    def __init__(
        self,
        model: Any,
        signature: ModelSignature,
        device: str,
        label: str,
        worker: WorkerThread | None,
    ) -> None:
        self._model = model
        self._signature = signature
        self._device = device
        self._label = label
        self._worker = worker
        self._infer = model.infer
        self._async = inspect.iscoroutinefunction(self._infer)
        abort = getattr(model, "abort", None)
        self._abort = abort if callable(abort) else None
        self._closed = False

    @property
    def signature(self) -> ModelSignature:
        """The signature declared in the config."""
        return self._signature

    @property
    def device(self) -> str:
        """Where the instance was placed (Python code runs where it likes)."""
        return self._device

    async def execute(self, inputs: Arrays) -> dict[str, np.ndarray[Any, Any]]:
        """Run the object's ``infer`` on *inputs* and check what it returns.

        Raises:
            BackendError: ``infer`` raised (chained), or its outputs do not fit
                the declared signature.
        """
        if self._closed:
            raise BackendError(f"{self._label} is closed")
        try:
            if self._async:
                outputs = await self._infer(dict(inputs))
            else:
                assert self._worker is not None
                outputs = await self._worker.run_sync(self._infer, dict(inputs), abort=self._abort)
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:
            raise BackendError(f"{self._label}: infer raised {type(exc).__name__}: {exc}") from exc
        return self._checked(outputs)

    def _checked(self, outputs: object) -> dict[str, np.ndarray[Any, Any]]:
        if not isinstance(outputs, Mapping):
            raise BackendError(
                f"{self._label}: infer returned {type(outputs).__name__}; expected a dict of "
                "arrays by output name"
            )
        declared = [spec.name for spec in self._signature.outputs]
        if set(outputs) != set(declared):
            missing = sorted(set(declared) - set(outputs))
            extra = sorted(map(str, set(outputs) - set(declared)))
            raise BackendError(
                f"{self._label}: infer returned outputs {sorted(map(str, outputs))}; the "
                f"config declares {declared} (missing {missing}, undeclared {extra})"
            )
        checked: dict[str, np.ndarray[Any, Any]] = {}
        for spec in self._signature.outputs:
            checked[spec.name] = self._output(spec, outputs[spec.name])
        return checked

    def _output(self, spec: TensorSpec, value: object) -> np.ndarray[Any, Any]:
        where = f"{self._label}: output {spec.name!r}"
        if isinstance(value, np.ndarray):
            array = value
            if array.dtype != spec.dtype and not (
                spec.dtype == np.object_ and array.dtype.kind in "US"
            ):
                raise BackendError(
                    f"{where} has dtype {array.dtype.name}; the config declares {spec.describe()}"
                )
            if spec.dtype == np.object_ and array.dtype != np.object_:
                array = array.astype(object)
        else:
            try:
                array = np.asarray(value, dtype=spec.dtype)
            except (TypeError, ValueError) as exc:
                raise BackendError(
                    f"{where} is {type(value).__name__}, not convertible to {spec.describe()}: "
                    f"{exc}"
                ) from None
        if array.ndim != spec.rank or any(
            isinstance(dim, int) and dim != size
            for dim, size in zip(spec.shape, array.shape, strict=True)
        ):
            raise BackendError(
                f"{where} has shape {list(array.shape)}; the config declares {spec.describe()}"
            )
        return array

    async def _call_hook(self, name: str) -> None:
        hook = getattr(self._model, name, None)
        if not callable(hook):
            return
        try:
            if inspect.iscoroutinefunction(hook):
                await hook()
            else:
                assert self._worker is not None
                await self._worker.run_sync(hook)
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:
            raise BackendError(
                f"{self._label}: {name}() raised {type(exc).__name__}: {exc}"
            ) from exc

    async def aclose(self) -> None:
        """Run the object's ``close`` once, then stop the worker thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            with anyio.CancelScope(shield=True):
                await self._call_hook("close")
        finally:
            if self._worker is not None:
                await self._worker.aclose()
