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

In code, ``backend_options={"class": Model, ...}`` names the class itself, and
``ModelConfig`` needs no ``path`` (a class given by name without one is a
``ConfigError`` at load that says so). The class:

- ``__init__(self, **parameters)``; a ``device`` keyword, if it takes one,
  gets where the instance was placed (``"cpu"``, ``"cuda:0"``). Parameters
  it cannot take (one missing, one it does not know) are a ``ConfigError``
  at load. It runs on a worker thread, once per instance, so a slow one
  (reading weights, a tokenizer) stalls no other model meanwhile; a load
  cancelled while it runs waits for it to return. The instances of one load
  are built at once, on threads of their own: guard what they share (a
  class attribute). Off the loop, it sees the load's context
  (``trioinfer.lowlevel.current_engine()``, its ``metrics``) and may make
  anyio's primitives, but what needs the running event loop
  (``trio.lowlevel.current_trio_token()``, ``asyncio.get_running_loop()``,
  ``anyio.current_time()``) raises there: call it in an ``async def load``.
- ``infer(self, inputs) -> outputs``, dicts of numpy arrays by tensor name.
  The input arrays are read-only views: they may be the caller's own arrays
  (``engine.infer`` copies nothing), another pipeline step's answer (which
  the pipeline may also return, or the response cache keep), or a client's
  request body, so a write through one (``inputs["x"] *= 2``,
  ``x[0] = 0``) raises numpy's ``ValueError: ... read-only``, a
  ``BackendError`` that says so. Change a copy (``x = inputs["x"].copy()``,
  or ``x = inputs["x"] * 2``). The dict itself is the model's own. An input
  returned as an output (``{"y": inputs["x"]}``) reaches the caller
  read-only, as a cached answer does.
  An exception it raises fails its batch as a ``BackendError`` whose message
  names the line of the model's code that raised it (``(model.py, line 5, in
  infer)``; the logger ``trioinfer.python`` gets the traceback, once per
  place it fails at), unless it is a ``TrioInferError`` (raise
  ``trioinfer.InvalidInput`` for input the model refuses: a 400 over HTTP),
  which reaches the callers as it is.
  ``async def infer`` runs on the event loop and is cancelled when every
  caller of its batch has left (the caller's deadline, a client going away);
  it runs in the engine's task, so ``anyio.current_effective_deadline()``
  there is not the callers': ``trioinfer.lowlevel.current_batch_deadline()``
  is the latest of theirs, to pass on to a service the model calls;
  a plain ``def infer`` runs on the instance's own worker thread, and Python
  cannot interrupt it: a cancelled call runs to its end (an ``abort(self)``
  method, if the class has one, is called from the event loop then, to ask
  it to stop early).
  If ``infer`` takes a ``parameters`` keyword (or ``**kwargs``), it gets the request
  parameters its callers sent (``engine.infer(..., parameters={...})``;
  over HTTP the infer body's ``"parameters"``, over gRPC the request's
  ``parameters`` map, the generate extension's extra JSON keys): an
  unbatched model (no batch axis) one dict, a batched model one dict per row
  of its batch (a request of 3 rows contributes 3 copies of its own), so that
  requests with different parameters still share a batch; a decoupled
  model's generator one dict. A request that sent none gives ``{}``.
- optional ``load(self)`` and ``close(self)``, sync (on the worker thread) or
  async, called once per instance after construction and at unload.
- a ``models`` keyword, if ``__init__`` takes one, gets a `Models`: the other
  models of the engine, to call while it computes (Triton's business logic
  scripting). ``await models.infer("digits", inputs)`` from ``async def
  infer``, ``models.infer_blocking(...)`` from a plain ``def infer`` on the
  worker thread; each call is an ordinary request to that model, ended when
  the requests being computed have all ended (see `Models`), and a decoupled
  model's responses come from ``models.infer_stream(...)`` (from a thread,
  ``models.infer_stream_blocking(...)``). In
  ``trioinfer serve`` a model is named as clients name it (``"digits"``, or
  ``"digits:2"`` for one version).
- a ``metrics`` keyword, if ``__init__`` takes one, gets a
  `trioinfer.ModelMetrics`: where the model declares its own metric
  families (Triton's custom metrics, ``pb_utils.MetricFamily``), which
  ``trioinfer serve`` shows on ``/metrics`` beside its own and an in-process
  user reads with ``engine.custom_metrics()``::

      def __init__(self, metrics):
          tokens = metrics.counter("tokens", "Tokens generated.", labels=["kind"])
          self.tokens = tokens.metric(kind="output")
          self.latency = metrics.histogram(
              "decode_seconds", "Time to decode.", buckets=[0.01, 0.1, 1.0]
          ).metric()

      def infer(self, inputs):
          self.tokens.increment(len(inputs["x"]))   # from a thread or the loop alike

  Every instance of a load shares the same series (declaring a family
  again, alike, returns it); they go when the model is unloaded or loaded
  anew. A bad declaration or update (see `trioinfer.InvalidMetric`) fails
  the load or the execution with a ``BackendError`` naming the line.

The model file is imported on a thread, so that its imports (of a deep
learning framework, say) do not stall the other models' requests, and
afresh at each load, compiled from its source as it is then (no
``__pycache__`` is read or written), as a module of its own; the
constructor runs on a thread too, for the same reason.

A streaming (decoupled) model's ``infer`` is an async generator: ``async def
infer(self, inputs)`` that yields one dict of outputs per response, any
number of them, with ``decoupled = true`` in ``backend_options`` (the two
must agree: either without the other is a ``ConfigError`` at load; a plain
``def`` generator is refused). It is served only by ``engine.infer_stream``
and HTTP ``generate``/``generate_stream`` (``engine.infer`` on it is an
``InvalidInput``); each request is one call, unbatched, with its inputs as
sent. Each response is checked against the declared outputs like an answer
above. The generator runs on the event loop, at most 16 responses ahead of
the reader (``infer_stream``'s ``ahead``); when the caller stops reading,
leaves or is cancelled, it is closed at the ``yield`` it waits at
(``GeneratorExit`` there), or cancelled in the ``await`` it is in: put
clean-up in ``finally``. An exception it
raises ends the stream after the responses before it, as for ``infer``.

``dispatch = "inline"`` runs a plain ``infer`` (and ``load``, ``close``) on the
event loop instead: for numpy code of a few hundred microseconds at most,
cheaper there than a hop to a thread and back; the loop waits while it runs.
With ``batcher = "none"`` (and no other plugin in the way), a request to
such a model, or a pipeline's step on it, runs in its caller's task when
nothing is queued and the instance is idle: no queue, worker or wake-up.
Such requests yield to the loop once inline runs have held it for 250
microseconds in all, so that callers looping on the model never starve the
rest of the program.

The engine checks inputs against the declared signature before they queue,
as for an ONNX model, and every output against it, on every execution and
every streamed response: a missing or extra output, another dtype, rank or
fixed size (any size where the shape says -1 or a name), or, batched, other
than one row per input row, is a ``BackendError`` naming the model, the
output, what came and what the config declares; the request(s) of that
execution end with it (a 500 over HTTP: the model's fault, not the
client's). An array of another dtype is refused, not cast (as Triton
does): the model's metadata tells clients the declared dtype, and a float64
answer under FP32 metadata is a bug to fix where the model computes it
(``astype``), not to round silently. A value that is not an array (a list,
a number) is converted to the declared dtype. A ``BYTES`` (``string``)
input reaches the model as an object array of ``bytes``, as Triton's Python
backend gives it, however it was sent (``engine.infer`` with ``bytes`` or
``str``, HTTP JSON strings or binary data, gRPC): any bytes pass, an image
say, and a ``str`` is encoded as UTF-8. A model that wants text declares the
input ``utf8 = true`` (``{ name = "prompt", dtype = "string", shape = [1],
utf8 = true }``): it then gets ``str``, and bytes that are not UTF-8 are
refused before they queue (an ``InvalidInput`` naming the element: HTTP 400,
gRPC ``INVALID_ARGUMENT``), as for an ONNX model's string input. A ``BYTES``
output may hold ``bytes`` or ``str``. A model whose every input and output
has a symbolic first dimension receives batches from the ``dynamic``
batcher, and must return one row per input row. An input declared
``optional = true`` may be left out of a request: ``inputs`` then holds
only the inputs that were sent (a batch holds requests that sent the same
ones), so the model reads it with ``inputs.get(name)`` or ``in``.
"""

from __future__ import annotations

import difflib
import functools
import importlib.machinery
import importlib.util
import inspect
import itertools
import logging
import sys
import sysconfig
import traceback
from collections.abc import AsyncGenerator, Mapping, Sequence
from pathlib import Path
from types import CodeType, ModuleType
from typing import Any, final

import anyio
import numpy as np

from trioinfer import (
    BackendError,
    ConfigError,
    InvalidMetric,
    ModelConfig,
    ModelSignature,
    TensorSpec,
    TrioInferError,
)
from trioinfer.lowlevel import (
    Placement,
    Request,
    WorkerThread,
    current_engine,
    current_model_metrics,
    current_stream_parameters,
)

from . import _triton
from ._faults import MODEL_FAULTS, pass_on_ctrl_c
from ._models import BlockingResponses, Models

__all__ = ["BlockingResponses", "Models", "PythonBackend", "PythonInstance"]

log = logging.getLogger("trioinfer.python")

Arrays = Mapping[str, np.ndarray[Any, Any]]
_modules = itertools.count()
#: The names model files are imported under, each load its own.
_MODULE_PREFIX = "trioinfer_python_model_"

#: The options this backend takes, with what each means.
OPTIONS: Mapping[str, str] = {
    "class": "the model's class: its name in the model file (default 'Model'), or in Python "
    "the class itself",
    "parameters": "keyword arguments for the class's constructor (a table)",
    "dispatch": "where a plain def infer (and load, close) runs: 'thread' (the default, the "
    "instance's own worker thread) or 'inline' (on the event loop: for code cheaper than a "
    "thread hop, a few hundred microseconds at most, since the loop waits for it)",
    "decoupled": "true for a model whose infer is an async generator (async def with yield): "
    "it answers each request with a stream of responses, any number of them, served by "
    "engine.infer_stream and HTTP generate_stream (default false)",
    "inputs": "the model's inputs: a list of tables with name, dtype and shape, and for a "
    "string (BYTES) input optionally utf8 = true to get str rather than bytes, and "
    "optional = true for an input requests may leave out (the model gets the inputs sent) "
    "(see ModelSignature.declared)",
    "outputs": "the model's outputs, as inputs",
    "triton": "the Triton configuration (config.pbtxt's, as JSON) of a Triton Python model: "
    "model.py's class TritonPythonModel, served as Triton serves it (set by reading a "
    'config.pbtxt that says backend: "python"; see docs/how-to/from-triton.md)',
}


#: Where library code lives: frames there are not the model author's (numpy's, the stdlib's,
#: trioinfer's own), so the location an error names is the last frame outside them.
_LIBRARY_DIRS: tuple[str, ...] = tuple(
    sorted(
        {
            *(
                str(Path(path).resolve()) + "/"
                for key, path in sysconfig.get_paths().items()
                if key in ("stdlib", "platstdlib", "purelib", "platlib")
            ),
            f"{Path(__file__).resolve().parent}/",  # this backend
            f"{Path(inspect.getfile(ModelConfig)).resolve().parent}/",  # trioinfer
        }
    )
)
#: How many places (exception type, file, line) of one instance get their traceback logged.
_LOGGED_AT_MOST: int = 256


def _raised(what: str, exc: BaseException) -> str:
    """``<what> raised <Type>: <message> (<file>, line <n>, in <function>)``.

    The location is the innermost frame of the model's own code, as Python's
    own ``SyntaxError`` says where: without it, a ``KeyError: 'X'`` from
    ``infer`` (over HTTP a 500) leaves its author guessing which line. Every
    handler of `MODEL_FAULTS` says what was raised here, so here a Ctrl+C goes on
    (`pass_on_ctrl_c`).
    """
    pass_on_ctrl_c(exc)
    frame = _own_frame(exc)
    where = "" if frame is None else f" ({Path(frame[0]).name}, line {frame[1]}, in {frame[2]})"
    return f"{what} raised {type(exc).__name__}: {exc}{where}"


def _own_frame(exc: BaseException) -> tuple[str, int | None, str] | None:
    # The innermost frame outside library code: the model author's line.
    for summary in reversed(traceback.extract_tb(exc.__traceback__)):
        try:
            path = str(Path(summary.filename).resolve())
        except (OSError, RuntimeError, ValueError):  # pragma: no cover  # an odd file name
            continue
        if not path.startswith(_LIBRARY_DIRS) and not summary.filename.startswith("<"):
            return summary.filename, summary.lineno, summary.name
    return None


@final
class PythonBackend:
    """Loads a Python class as a model: one object per instance (see the module's docs)."""

    async def load(
        self, config: ModelConfig, placement: Placement
    ) -> PythonInstance | _triton.TritonInstance:
        """Import the class, build one object for *placement*, and run its ``load``.

        Raises:
            ConfigError: An unknown option, a signature that cannot be read, or
                parameters that the class's constructor cannot take.
            BackendError: The file or class is missing, or constructing or
                loading the object raised (chained).
        """
        options = config.backend_options
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            # A typo (ouputs) is the usual cause: name the option it was meant to be.
            hints = "".join(
                f"; did you mean {close[0]!r} for {key!r}?"
                for key in unknown
                if (close := difflib.get_close_matches(key, OPTIONS, n=1))
            )
            raise ConfigError(
                f"model {config.name!r}: unknown python backend option "
                f"{', '.join(map(repr, unknown))}; known: {', '.join(OPTIONS)}{hints}"
            )
        signature = ModelSignature.declared(
            options.get("inputs"), options.get("outputs"), model=config.name
        )
        triton = options.get("triton")
        if triton is not None:
            if not isinstance(triton, Mapping):
                raise ConfigError(
                    f"backend option triton of model {config.name!r} must be a Triton model "
                    f"configuration (a table), got {triton!r}"
                )
            # Before model.py is imported: it imports triton_python_backend_utils.
            _triton.register_module()
        # On a thread: a model file's imports (torch, say) can take seconds, which on
        # the event loop would stall every other model's requests meanwhile.
        cls, module = await anyio.to_thread.run_sync(_model_class, config)
        try:
            if triton is not None:
                return await _triton.load(config, placement, signature, cls, module, triton)
            return await self._instance(config, placement, signature, cls, module)
        except BaseException:
            # A load that fails leaves no instance to drop the module at aclose: drop it
            # here, or every failed try (a repository poll retrying a broken model.py)
            # keeps a module, and whatever its top level holds, for the process's life.
            _forget(module)
            raise

    def complete_triton_config(
        self, config: Mapping[str, Any], path: Path
    ) -> dict[str, Any] | None:
        """Run ``TritonPythonModel.auto_complete_config`` of *path* on *config*, if it has one.

        *path* is imported afresh (with its folder first on ``sys.path``, as
        at load), and dropped afterwards: as in Triton, nothing made here
        lives on into the model's load. Returns None when the class has no
        ``auto_complete_config``.

        Raises:
            ConfigError: ``auto_complete_config`` raised ``ValueError`` (a
                conflict with config.pbtxt, as Triton's ``pb_utils.ModelConfig``
                raises), or returned something else than a ``pb_utils.ModelConfig``.
            BackendError: The file or its class is missing, or the model's code raised.
        """
        _triton.register_module()
        name = str(config.get("name") or path.parent.parent.name)
        module = _triton.import_beside(path.parent, lambda: _import(name, path))
        try:
            cls = getattr(module, _triton.CLASS_NAME, None)
            if not isinstance(cls, type):
                raise BackendError(
                    f"model {name!r}: {path.name} defines no class {_triton.CLASS_NAME!r}"
                )
            return _triton.auto_complete(cls, config, name)
        finally:
            _forget(module.__name__)

    async def _instance(
        self,
        config: ModelConfig,
        placement: Placement,
        signature: ModelSignature,
        cls: type,
        module: str | None,
    ) -> PythonInstance:
        options = config.backend_options
        decoupled = options.get("decoupled", False)
        if not isinstance(decoupled, bool):
            raise ConfigError(
                f"backend option decoupled of model {config.name!r} must be true or false, "
                f"got {decoupled!r}"
            )
        parameters = options.get("parameters", {})
        if not isinstance(parameters, Mapping) or not all(isinstance(k, str) for k in parameters):
            raise ConfigError(
                f"backend option parameters of model {config.name!r} must be a table of "
                f"name = value, got {parameters!r}"
            )
        device = str(placement.device)
        if given := sorted({"device", "models", "metrics"} & set(parameters)):
            raise ConfigError(
                f"backend option parameters of model {config.name!r} sets "
                f"{', '.join(map(repr, given))}, which the backend passes itself (where the "
                "instance runs, the other models to call, the model's own metrics): rename "
                "the parameter"
            )
        kwargs = dict(parameters)
        if _takes(cls, "device"):
            kwargs["device"] = device
        models = Models(current_engine(), config.name) if _takes(cls, "models") else None
        if models is not None:
            kwargs["models"] = models
        if _takes(cls, "metrics"):
            kwargs["metrics"] = current_model_metrics()
        label = f"model {config.name!r} instance {placement.index}"
        dispatch = options.get("dispatch", "thread")
        if dispatch not in ("thread", "inline"):
            raise ConfigError(
                f"backend option dispatch of model {config.name!r} must be 'thread' or "
                f"'inline', got {dispatch!r}"
            )
        # On a thread, as the import: a constructor that reads weights or a tokenizer
        # would stall every other model's requests (and health checks) on the loop. A
        # load cancelled meanwhile waits for it to return: a thread cannot be stopped.
        model = await anyio.to_thread.run_sync(_construct, cls, kwargs, label, decoupled)
        # A ``**kwargs`` takes them too, as any keyword would be passed to it.
        named = _takes(model.infer, "parameters")
        takes_parameters = named or _takes_any_keyword(model.infer)
        if takes_parameters and (layout := _laid_out_by(config)) is not None:
            if named:
                raise ConfigError(
                    f"model {config.name!r}: its infer takes parameters, one per request, "
                    f"but {layout} lays out each batch itself, so the engine cannot tell "
                    "which row is whose: drop the parameters keyword (or that batcher)"
                )
            # Only a **kwargs, which asked for nothing by name: none are passed, as before.
            takes_parameters = False
        # The object's hooks, not the class's: a constructor may set infer itself.
        needs_thread = dispatch == "thread" and any(
            callable(getattr(model, hook, None))
            and not inspect.iscoroutinefunction(getattr(model, hook))
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
            # One whose infer takes parameters gets each execution's requests (to
            # read theirs); any other, their inputs, joined by the engine.
            kind = _ParameterisedInstance if takes_parameters else PythonInstance
            instance = kind(model, signature, device, label, worker, module, models)
            await instance._call_hook("load")
        except BaseException:
            if worker is not None:
                await worker.aclose()
            raise
        return instance


def _construct(cls: type, kwargs: dict[str, Any], label: str, decoupled: bool) -> Any:
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # no signature to read: the call itself says
        signature = None
    if signature is not None:
        try:
            signature.bind(**kwargs)
        except TypeError as exc:
            # The constructor's arguments come from config.toml: say where to set them,
            # rather than leave the bare TypeError of a call the author never wrote.
            given = ", ".join(sorted(kwargs)) or "none"
            takes = ", ".join(
                str(p).split(":")[0].split("=")[0] for p in signature.parameters.values()
            )
            raise ConfigError(
                f"{label}: {cls.__name__}({takes}) cannot be called with the backend "
                f"option parameters ({given}): {exc}; set its arguments with "
                "parameters = { name = value, ... } in [backend_options]"
            ) from None
    try:
        model = cls(**kwargs)
    except MODEL_FAULTS as exc:
        raise BackendError(_raised(f"{label}: {cls.__name__}(...)", exc)) from exc
    infer = getattr(model, "infer", None)
    if not callable(infer):
        raise BackendError(f"{label}: class {cls.__name__} has no infer(self, inputs)")
    if inspect.isgeneratorfunction(infer):
        raise ConfigError(
            f"{label}: {cls.__name__}.infer is a plain generator; a streaming model's infer "
            "must be an async generator (async def with yield), with decoupled = true"
        )
    if inspect.isasyncgenfunction(infer) and not decoupled:
        raise ConfigError(
            f"{label}: {cls.__name__}.infer is an async generator, which answers with a stream "
            "of responses: set backend option decoupled = true (and call it with "
            "engine.infer_stream)"
        )
    if decoupled and not inspect.isasyncgenfunction(infer):
        raise ConfigError(
            f"{label}: backend option decoupled = true needs {cls.__name__}.infer to be an "
            "async generator (async def with yield), one dict of outputs per response"
        )
    return model


def _takes(cls: Any, name: str) -> bool:
    # Whether the callable *cls* (a class: its constructor) takes a keyword *name*.
    try:
        parameters = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters


def _takes_any_keyword(function: Any) -> bool:
    # Whether *function* has a ``**kwargs``.
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def _laid_out_by(config: ModelConfig) -> str | None:
    # The batcher that would lay out the model's batches itself (an AssemblingBatcher,
    # which the engine refuses for instances that take each request's own inputs).
    if config.sequence is not None or config.batcher == "sequence":
        return "the sequence batcher of a stateful model"
    if config.batcher == "dynamic" and config.batcher_options.get("pad_axis") is not None:
        return "the dynamic batcher with pad_axis"
    return None


def _model_class(config: ModelConfig) -> tuple[type, str | None]:
    # The class, and the name of the module this load imported for it (None: given in code).
    options = config.backend_options
    chosen = options.get("class", _triton.CLASS_NAME if "triton" in options else "Model")
    if isinstance(chosen, type):
        return chosen, None
    if not isinstance(chosen, str) or not chosen.isidentifier():
        raise ConfigError(
            f"backend option class of model {config.name!r} must be a class name such as "
            f"'Model' (or, in Python, the class itself), got {chosen!r}"
        )
    path = config.model_file(
        f"the model.py that defines class {chosen!r} (or, in Python, "
        "backend_options={'class': TheClass})"
    )
    if "triton" in options:
        module = _triton.import_beside(path.parent, lambda: _import(config.name, path))
    else:
        module = _import(config.name, path)
    cls = getattr(module, chosen, None)
    if not isinstance(cls, type):
        sys.modules.pop(module.__name__, None)  # no instance will use it
        raise BackendError(
            f"model {config.name!r}: {path.name} defines no class {chosen!r} "
            "(set backend option class to the model's class)"
        )
    return cls, module.__name__


def _import(model: str, path: Path) -> ModuleType:
    # Each load imports the file afresh under its own module name, so that a
    # new version of model.py is what a reload runs, and two models' files
    # never share (or replace) each other's module.
    if not path.is_file():
        raise BackendError(f"model {model!r}: no model file {path.name} at the configured path")
    name = f"{_MODULE_PREFIX}{next(_modules)}"
    spec = importlib.util.spec_from_file_location(name, path, loader=_SourceLoader(name, str(path)))
    if spec is None or spec.loader is None:  # pragma: no cover  # a .py file always has one
        raise BackendError(f"model {model!r}: {path.name} cannot be imported")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look a class's module up there
    try:
        spec.loader.exec_module(module)
    except MODEL_FAULTS as exc:
        del sys.modules[name]
        raise BackendError(_raised(f"model {model!r}: importing {path.name}", exc)) from exc
    return module


@final
class _SourceLoader(importlib.machinery.SourceFileLoader):
    """Compiles model.py from its source every time: no ``__pycache__`` read or written.

    Python's bytecode cache trusts a source whose modification time (in whole
    seconds) and size match: model.py edited within the second it was loaded,
    to a file of the same size (``0.5`` made ``0.7``), would reload as the
    old code.
    """

    def get_code(self, fullname: str) -> CodeType:
        """The module's code, compiled from the file as it is now."""
        return self.source_to_code(self.get_data(self.path), self.path)


class PythonInstance:
    """One object of a Python model's class, on its placement."""

    # Not final: the instance of a model whose infer takes parameters is a subclass's.

    #: Every answer (and streamed response) is checked against the declared signature
    #: here, where lists are converted too: the engine need check only names and rows.
    checks_outputs = True

    def __init__(
        self,
        model: Any,
        signature: ModelSignature,
        device: str,
        label: str,
        worker: WorkerThread | None,
        module: str | None = None,
        models: Models | None = None,
    ) -> None:
        self._model = model
        #: What the model calls other models with, if its class takes ``models``.
        self._models = models
        #: The module this instance's load imported model.py as (None: a class given in code).
        self._module = module
        self._signature = signature
        self._device = device
        self._label = label
        self._worker = worker
        self._infer = model.infer
        self._async = inspect.iscoroutinefunction(self._infer)
        self._decoupled = inspect.isasyncgenfunction(self._infer)
        abort = getattr(model, "abort", None)
        self._abort = abort if callable(abort) else None
        self._closed = False
        #: Where infer failed so far, each logged once with its traceback (see _failed).
        self._logged: set[tuple[str, str, int | None]] = set()
        # (name, dtype, rank, fixed (axis, size) pairs) of each declared output:
        # what _checked compares an answer of arrays against, in a few comparisons.
        self._expected = tuple(
            (
                spec.name,
                spec.dtype,
                spec.rank,
                tuple((axis, dim) for axis, dim in enumerate(spec.shape) if isinstance(dim, int)),
            )
            for spec in signature.outputs
        )

    @property
    def signature(self) -> ModelSignature:
        """The signature declared in the config."""
        return self._signature

    @property
    def device(self) -> str:
        """Where the instance was placed (Python code runs where it likes)."""
        return self._device

    @property
    def runs_inline(self) -> bool:
        """Whether `execute` never suspends: a plain ``def infer`` run on the event loop.

        So says `trioinfer.abc.InlineInstance`: a pipeline's step run in its
        caller's task then needs no cancel scope of its own.
        """
        return not self._async and self._worker is None

    @property
    def starts_inline(self) -> bool:
        """Whether `execute` runs on the event loop until ``infer`` first awaits (``async def``).

        So the engine may start it in its caller's task (`trioinfer.abc.InlineInstance`):
        done there at once if ``infer`` never suspends, carried on there if it does.
        """
        return self._async

    @property
    def decoupled(self) -> bool:
        """Whether ``infer`` is an async generator (``decoupled = true``): a stream per request."""
        return self._decoupled

    async def stream(self, inputs: Arrays) -> AsyncGenerator[dict[str, np.ndarray[Any, Any]], None]:
        """Run a decoupled model's ``infer`` generator on *inputs*, checking each response.

        Closing this generator closes the model's at the ``yield`` it waits at.

        Raises:
            BackendError: ``infer`` raised (chained), or a response does not fit
                the declared signature; the responses before it were yielded.
        """
        if self._closed:
            raise BackendError(f"{self._label} is closed")
        if not self._decoupled:
            raise BackendError(f"{self._label} is not decoupled: it answers with execute()")
        generator = self._call_infer()(_read_only(inputs))
        try:
            while True:
                try:
                    outputs = await generator.__anext__()
                except StopAsyncIteration:
                    return
                except InvalidMetric as exc:  # the model's bug, as in execute
                    raise self._failed(exc) from exc
                except (anyio.get_cancelled_exc_class(), TrioInferError):
                    raise
                except MODEL_FAULTS as exc:
                    raise self._failed(exc) from exc
                yield self._checked(outputs)
        finally:
            await generator.aclose()

    def _call_infer(self) -> Any:
        # What a stream calls: infer, given the stream's parameters if it takes them.
        return self._infer

    async def execute(self, inputs: Arrays) -> dict[str, np.ndarray[Any, Any]]:
        """Run the object's ``infer`` on *inputs* and check what it returns.

        Raises:
            BackendError: ``infer`` raised (chained), or its outputs do not fit
                the declared signature.
        """
        return await self._execute(self._infer, inputs)

    async def _execute(self, infer: Any, inputs: Arrays) -> dict[str, np.ndarray[Any, Any]]:
        if self._closed:
            raise BackendError(f"{self._label} is closed")
        try:
            if self._async:
                outputs = await infer(_read_only(inputs))
            elif self._worker is None:  # dispatch = "inline": cheaper than a thread hop
                outputs = infer(_read_only(inputs))
            elif self._models is None:
                outputs = await self._worker.run_sync(infer, _read_only(inputs), abort=self._abort)
            else:  # its calls to other models end when it is aborted
                outputs = await self._models._run(
                    self._worker, infer, _read_only(inputs), self._abort
                )
        except InvalidMetric as exc:  # a bug of the model's (a counter going down), not a choice
            raise self._failed(exc) from exc
        except (anyio.get_cancelled_exc_class(), TrioInferError):
            raise  # the model chose the error's class (InvalidInput is the client's fault)
        except MODEL_FAULTS as exc:
            raise self._failed(exc) from exc
        return self._checked(outputs)

    def _failed(self, exc: BaseException) -> BackendError:
        # The error callers get names the line; the log gets the whole traceback, once per
        # place (a model failing every request would otherwise flood it).
        said = _raised(f"{self._label}: infer", exc)
        if isinstance(exc, ValueError) and "read-only" in str(exc):
            # numpy's "output array is read-only" names no array: say which ones are.
            said += (
                "; a model's inputs are read-only (they may be its caller's arrays): change "
                f"a copy, inputs[{self._signature.inputs[0].name!r}].copy()"
            )
        error = BackendError(said)
        frame = _own_frame(exc)
        place = (type(exc).__name__, *(("", None) if frame is None else frame[:2]))
        if place not in self._logged and len(self._logged) < _LOGGED_AT_MOST:
            self._logged.add(place)
            log.error(
                "%s; its traceback (logged once per place it fails at):",
                error,
                exc_info=exc,
            )
        return error

    def _checked(self, outputs: object) -> dict[str, np.ndarray[Any, Any]]:
        expected = self._expected
        if type(outputs) is dict and len(outputs) == len(expected):
            # The usual answer: a dict of arrays that fit as they are. Anything else
            # (or anything wrong) takes the checks below, which say what is wrong.
            fits: dict[str, np.ndarray[Any, Any]] = {}
            for name, dtype, rank, fixed in expected:
                value = outputs.get(name)
                if type(value) is not np.ndarray or value.dtype != dtype or value.ndim != rank:
                    break
                shape = value.shape
                # A loop, not any() over a generator: a third of the cost per output.
                misfit = False
                for axis, size in fixed:
                    if shape[axis] != size:
                        misfit = True
                        break
                if misfit:
                    break
                fits[name] = value
            else:
                return fits
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
            if (
                array.dtype != spec.dtype
                and not (spec.dtype == np.object_ and array.dtype.kind in "US")
                # The declared dtype in the other byte order: the same values, which
                # every codec sends little-endian (numpy.frombuffer(blob, ">f4")).
                and (array.dtype.isnative or array.dtype.newbyteorder("=") != spec.dtype)
            ):
                # numpy's default float64 under a float32 declaration is the usual case.
                hint = (
                    f" (return it with .astype(numpy.{spec.dtype.name}), or declare "
                    f'dtype = "{array.dtype.name}" in config.toml)'
                    if spec.dtype is not None and spec.dtype != np.object_
                    else ""
                )
                raise BackendError(
                    f"{where} has dtype {array.dtype.name}; the config declares "
                    f"{spec.describe()}{hint}"
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
            elif self._worker is None:  # dispatch = "inline"
                hook()
            else:
                await self._worker.run_sync(hook)
        except anyio.get_cancelled_exc_class():
            raise
        except MODEL_FAULTS as exc:
            raise BackendError(_raised(f"{self._label}: {name}()", exc)) from exc

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
            # The module this instance's import of model.py made: nothing else uses it.
            _forget(self._module)


class _ParameterisedInstance(PythonInstance):
    """A model whose ``infer`` takes ``parameters``: it gets each execution's requests."""

    def _call_infer(self) -> Any:
        return functools.partial(self._infer, parameters=dict(current_stream_parameters()))

    async def execute(self, inputs: Arrays) -> dict[str, np.ndarray[Any, Any]]:
        """Run ``infer`` on what no request made (a warm-up sample, a probe): no parameters."""
        rows = _rows(inputs) if self._signature.batched else 0
        return await self._execute(self._given([({}, rows)]), inputs)

    async def execute_requests(
        self, requests: Sequence[Request]
    ) -> list[dict[str, np.ndarray[Any, Any]] | Exception]:
        """Run ``infer`` once on *requests*' inputs, joined, with their parameters.

        Raises:
            BackendError: As `execute`, or the requests sent different inputs
                (a batched model's optional ones), which cannot be joined.
        """
        if len(requests) == 1 or not self._signature.batched:
            # (An unbatched model's execution holds one request.)
            return [
                await self._execute(self._given([(r.parameters, r.rows)]), r.inputs)
                for r in requests
            ]
        names = requests[0].inputs.keys()
        if any(r.inputs.keys() != names for r in requests):
            raise BackendError(
                f"{self._label}: the requests of one batch sent different inputs, which "
                "cannot be joined into one batch for an infer that takes parameters"
            )
        inputs = {name: np.concatenate([r.inputs[name] for r in requests]) for name in names}
        outputs = await self._execute(
            self._given([(r.parameters, r.rows) for r in requests]), inputs
        )
        answers: list[dict[str, np.ndarray[Any, Any]] | Exception] = []
        start = 0
        for request in requests:
            end = start + request.rows
            answers.append({name: array[start:end] for name, array in outputs.items()})
            start = end
        return answers

    def _given(self, parameters: list[tuple[Mapping[str, Any], int]]) -> Any:
        # infer with its parameters: one dict (unbatched), or one per row (batched), each
        # the model's own to change (shallow copies: a long string is not copied).
        if not self._signature.batched:
            return functools.partial(self._infer, parameters=dict(parameters[0][0]))
        per_row = [dict(given) for given, rows in parameters for _ in range(rows)]
        return functools.partial(self._infer, parameters=per_row)


def _rows(inputs: Arrays) -> int:
    # A batched execution's rows: the first axis of its inputs.
    return next((len(array) for array in inputs.values() if array.ndim), 0)


def _read_only(inputs: Arrays) -> dict[str, np.ndarray[Any, Any]]:
    # The model's inputs as read-only views: they are the caller's own arrays (engine.infer
    # copies nothing), another step's answer that the pipeline also returns, or views
    # shared with other requests' rows; a write through one (x *= 2) changed them for
    # everyone. A view costs about 0.3 us and no copy of the data (asking whether an
    # array is read-only already costs a third of that: every one gets a view).
    views: dict[str, np.ndarray[Any, Any]] = {}
    for name, value in inputs.items():
        if value.__class__ is np.ndarray:
            value = value.view()
            value.setflags(write=False)
        views[name] = value
    return views


def _forget(module: str | None) -> None:
    # Drop the module one load's import of model.py made (its own name, not the class's
    # __module__: model.py may import its class from elsewhere). None: a class in code.
    if module is not None:
        sys.modules.pop(module, None)
