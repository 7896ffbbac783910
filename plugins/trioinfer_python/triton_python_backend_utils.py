"""Triton's ``triton_python_backend_utils``, for Triton Python models served as they are.

A model repository brought from Triton holds ``<model>/<version>/model.py``
with ``class TritonPythonModel`` beside a ``config.pbtxt`` that says
``backend: "python"``. Such a model file does ``import
triton_python_backend_utils as pb_utils``: the ``python`` backend makes that
name lead here (an entry in ``sys.modules``, registered when it loads such a
model; nothing is installed under that name). What is here is the part of
Triton's module that models use: tensors, requests and responses, errors,
the response sender of a decoupled model, business logic scripting
(``InferenceRequest(...).exec()``), the config helpers, the logger and custom
metrics (``MetricFamily``, onto trioinfer's: `trioinfer.ModelMetrics`).
Anything else of Triton's module is an ``AttributeError`` that names it and
points at ``docs/how-to/from-triton.md``, never a stand-in that answers wrong.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import json
import logging
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, TypeVar

import numpy as np

from trioinfer import (
    CounterMetric,
    GaugeMetric,
    HistogramMetric,
    InvalidInput,
    InvalidMetric,
    ModelMetrics,
    SequenceFlags,
    TrioInferError,
)
from trioinfer.lowlevel import current_model_metrics

__all__ = [
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_END",
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_START",
    "TRITONSERVER_RESPONSE_COMPLETE_FINAL",
    "InferenceRequest",
    "InferenceResponse",
    "Logger",
    "Metric",
    "MetricFamily",
    "ModelConfig",
    "ResponseIterator",
    "ResponseSender",
    "Tensor",
    "TritonError",
    "TritonModelException",
    "get_input_config_by_name",
    "get_input_tensor_by_name",
    "get_output_config_by_name",
    "get_output_tensor_by_name",
    "numpy_to_triton_type",
    "triton_string_to_numpy",
]

#: The flag of a decoupled model's last response (``sender.send(flags=...)``).
TRITONSERVER_RESPONSE_COMPLETE_FINAL: Final = 1
#: ``request.flags()`` of a sequence's first request (a stateful model's).
TRITONSERVER_REQUEST_FLAG_SEQUENCE_START: Final = 1
#: ``request.flags()`` of a sequence's last request.
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END: Final = 2
#: Where what is not provided is said.
_DOCS: Final = "docs/how-to/from-triton.md ('Python models as they are')"

log = logging.getLogger("trioinfer.python")


def _not_provided(name: str) -> AttributeError:
    return AttributeError(
        f"triton_python_backend_utils.{name} is not provided by trioinfer's python backend; "
        f"see {_DOCS} for what is"
    )


def __getattr__(name: str) -> Any:
    # Triton's module has more than models use (dlpack, model config
    # auto-completion, ...): a name not provided says so, rather than a silent stand-in.
    if name.startswith("__"):
        raise AttributeError(name)
    raise _not_provided(name)


class _Partial(type):
    """The classes here: what Triton's have and these lack is named as not provided."""

    def __getattr__(cls, name: str) -> Any:
        # Class-level (Tensor.from_dlpack); instances go through _Provided.__getattr__.
        if name.startswith("__"):
            raise AttributeError(name)
        raise _not_provided(f"{cls.__name__}.{name}")


class _Provided(metaclass=_Partial):
    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        # Only for names the instance lacks (a method Triton's class has, to_dlpack).
        if name.startswith("__"):
            raise AttributeError(name)
        raise _not_provided(f"{type(self).__name__}.{name}")


class TritonModelException(Exception):
    """Triton's exception for a model's failure (raised by ``execute``, it fails its batch)."""


class TritonError(_Provided):
    """An error a response carries: ``InferenceResponse(error=TritonError("bad input"))``.

    It fails only the request of that response, with its message;
    ``code=TritonError.INVALID_ARG`` makes it the client's fault (HTTP 400,
    gRPC ``INVALID_ARGUMENT``), any other code the model's (HTTP 500).
    """

    UNKNOWN: Final = 0
    INTERNAL: Final = 1
    NOT_FOUND: Final = 2
    INVALID_ARG: Final = 3
    UNAVAILABLE: Final = 4
    UNSUPPORTED: Final = 5
    ALREADY_EXISTS: Final = 6
    CANCELLED: Final = 7

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        """An error with *message* and a Triton error *code* (``TritonError.INTERNAL``)."""
        self._message = str(message)
        self._code = code

    def message(self) -> str:
        """The error's message."""
        return self._message

    def code(self) -> int:
        """The error's code (``TritonError.INTERNAL`` unless given)."""
        return self._code

    def __repr__(self) -> str:
        return f"TritonError({self._message!r}, code={self._code})"


class Tensor(_Provided):
    """A named tensor: ``Tensor("OUTPUT0", array)``.

    String (``BYTES``) tensors are object arrays of ``bytes``, as in Triton;
    an array of ``str`` or fixed-width bytes is made one.
    """

    __slots__ = ("_array", "_name")

    def __init__(self, name: str, tensor: Any) -> None:
        """Wrap *tensor* (a numpy array, or what ``numpy.asarray`` takes) as *name*."""
        array = np.asarray(tensor)
        if array.dtype.kind in "US":
            array = array.astype(object)
        self._name = str(name)
        self._array = array

    def name(self) -> str:
        """The tensor's name."""
        return self._name

    def as_numpy(self) -> np.ndarray[Any, Any]:
        """The tensor as a numpy array (an input's is read-only: change a copy)."""
        return self._array

    def shape(self) -> list[int]:
        """The tensor's shape."""
        return list(self._array.shape)

    def is_cpu(self) -> bool:
        """Always True: tensors here are numpy arrays in host memory."""
        return True

    def __repr__(self) -> str:
        return f"Tensor({self._name!r}, shape={list(self._array.shape)}, dtype={self._array.dtype})"


class InferenceResponse(_Provided):
    """A model's answer to one request: its output tensors, or an error, and its parameters."""

    __slots__ = ("_error", "_outputs", "_parameters")

    def __init__(
        self,
        output_tensors: Sequence[Tensor] | None = None,
        error: TritonError | None = None,
        parameters: Mapping[str, bool | int | str] | None = None,
    ) -> None:
        """A response holding *output_tensors*, or failing its request with *error*.

        *parameters*, as in Triton a dict of str names to bool, int or str
        values, reach the client as the response's ``parameters`` (HTTP and
        gRPC infer, each response of a stream; a generate response's keys).

        Raises:
            TypeError: *output_tensors* is not a list of `Tensor`.
            ValueError: Two tensors have one name.
            TritonModelException: *parameters* is not such a dict (Triton refuses
                it alike: a float value, say).
        """
        self._parameters = _response_parameters(parameters)
        # Checked here, where the model's line is (Triton's constructor refuses them too).
        if isinstance(output_tensors, Tensor):
            raise TypeError("InferenceResponse takes a list of pb_utils.Tensor, got Tensor")
        self._outputs = list(output_tensors or ())
        names = set()
        for tensor in self._outputs:
            if not isinstance(tensor, Tensor):
                raise TypeError(
                    "InferenceResponse takes a list of pb_utils.Tensor, got "
                    f"{type(tensor).__name__} in it (wrap an array: pb_utils.Tensor(name, array))"
                )
            if tensor.name() in names:
                raise ValueError(f"InferenceResponse got output {tensor.name()!r} twice")
            names.add(tensor.name())
        self._error = error

    def output_tensors(self) -> list[Tensor]:
        """The response's tensors."""
        return list(self._outputs)

    def has_error(self) -> bool:
        """Whether the response carries an error."""
        return self._error is not None

    def error(self) -> TritonError | None:
        """The error, or None."""
        return self._error

    def parameters(self) -> str:
        """The response's parameters as a JSON object text (``"{}"`` when none), as Triton's."""
        return json.dumps(self._parameters)


def _response_parameters(parameters: object) -> dict[str, bool | int | str]:
    # InferenceResponse(parameters=...), checked as Triton's constructor checks it.
    if parameters is None:
        return {}
    if not isinstance(parameters, dict):
        raise TritonModelException(
            f"InferenceResponse(parameters=...) takes a dict, got {type(parameters).__name__}"
        )
    for key, value in parameters.items():
        if not isinstance(key, str):
            raise TritonModelException(
                "InferenceResponse(parameters=...): names must be str, got "
                f"{type(key).__name__} {key!r:.80}"
            )
        if not isinstance(value, bool | int | str):
            raise TritonModelException(
                f"InferenceResponse(parameters=...): parameter {key!r} must be a bool, int or "
                f"str (as in Triton), got {type(value).__name__} {value!r:.80}"
            )
    return dict(parameters)


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    """The tensor called *name* of *response* (a BLS call's), or None."""
    for tensor in response.output_tensors():
        if tensor.name() == name:
            return tensor
    return None


class ResponseSender(_Provided):
    """What a decoupled model sends its responses with: ``request.get_response_sender()``.

    ``send(response)`` any number of times, from ``execute`` or a thread of
    the model's own, then ``send(flags=TRITONSERVER_RESPONSE_COMPLETE_FINAL)``
    (with a last response or without): the request's stream ends there.
    """

    __slots__ = ("_cancelled", "_closed", "_put")

    def __init__(
        self,
        put: Callable[[InferenceResponse | None, bool], None],
        cancelled: Callable[[], bool],
    ) -> None:
        """Made by the backend: *put* hands a response on; *cancelled* says nobody reads."""
        self._put = put
        self._cancelled = cancelled
        self._closed = False

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        """Send *response* (None: none); *flags* ``TRITONSERVER_RESPONSE_COMPLETE_FINAL`` ends.

        A response sent once the caller stopped reading is dropped (see
        `is_cancelled`).

        Raises:
            TritonModelException: A response after the final one, or not an
                InferenceResponse.
        """
        if self._closed:
            raise TritonModelException("a response was sent after the final flag")
        if response is not None and not isinstance(response, InferenceResponse):
            raise TritonModelException(
                f"send() takes an InferenceResponse, got {type(response).__name__}"
            )
        final = bool(flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        self._closed = final
        self._put(response, final)

    def is_cancelled(self) -> bool:
        """Whether the request's caller stopped reading: stop sending then."""
        return self._cancelled()


class ResponseIterator(_Provided):
    """The responses of a decoupled model to a request made with ``exec(decoupled=True)``.

    Iterate it (a plain ``for``); ``cancel()`` stops the stream early (the
    other model's generator stops at its ``yield``). The iteration ends after
    the model's last response; a model that ends with a final flag alone adds
    no empty response.
    """

    __slots__ = ("_cancel", "_responses")

    def __init__(self, responses: Any, cancel: Callable[[], None] | None = None) -> None:
        """Made by ``exec``/``async_exec``: *responses* iterated, *cancel* stops them."""
        self._responses = iter(responses)
        self._cancel = cancel

    def __iter__(self) -> ResponseIterator:
        return self

    def __next__(self) -> InferenceResponse:
        """The next response (waited for, from ``exec``)."""
        return next(self._responses)  # type: ignore[no-any-return]

    def cancel(self) -> None:
        """Stop the stream now: no further response comes."""
        if self._cancel is not None:
            self._cancel()
        self._responses = iter(())


#: What a running execution calls other models with (BLS): the backend sets it to the
#: model's `trioinfer_python.Models`. A thread-local for a plain ``def execute`` on its
#: worker thread, a context variable for an ``async def execute`` on the event loop.
_calls = threading.local()
_async_calls: contextvars.ContextVar[Any] = contextvars.ContextVar("trioinfer_pb_calls")


class InferenceRequest(_Provided):
    """A request: one of those ``execute(requests)`` gets, or one a model makes (BLS).

    A model makes one to call another model of the server, business logic
    scripting: ``InferenceRequest(model_name="m", requested_output_names=["y"],
    inputs=[Tensor("x", x)]).exec()`` from a plain ``def execute`` (``await
    ....async_exec()`` from an ``async def execute``). The call is an ordinary
    request to that model, carrying the deadline of the requests being
    computed; its failure is the response's error (``response.has_error()``).
    """

    def __init__(
        self,
        model_name: str = "",
        requested_output_names: Sequence[str] = (),
        inputs: Sequence[Tensor] = (),
        request_id: str = "",
        correlation_id: int | str = 0,
        flags: int = 0,
        timeout: int = 0,
        model_version: int = -1,
        parameters: Mapping[str, Any] | str | None = None,
        **unsupported: Any,
    ) -> None:
        """A request to *model_name* with *inputs*, asking for *requested_output_names*."""
        if unsupported:
            raise NotImplementedError(
                f"InferenceRequest({', '.join(sorted(unsupported))}=...) is not supported by "
                f"trioinfer's python backend; see {_DOCS}"
            )
        #: The model as the engine names it: "m", or "m:2" for one version.
        self._model_name = model_name if model_version < 0 else f"{model_name}:{model_version}"
        self._requested = list(requested_output_names)
        self._inputs = list(inputs)
        self._request_id = request_id
        self._correlation_id = correlation_id
        self._flags = flags
        self._timeout = timeout
        self._model_version = model_version
        self._parameters = (
            parameters if isinstance(parameters, str) else json.dumps(dict(parameters or {}))
        )
        self._sender: ResponseSender | None = None
        #: Whether the request's caller left (the backend's, for a request execute gets).
        self._ended: Callable[[], bool] | None = None

    def inputs(self) -> list[Tensor]:
        """The request's input tensors."""
        return list(self._inputs)

    def request_id(self) -> str:
        """The request's id as its client sent it (HTTP and gRPC ``id``); ``""`` when none.

        As Triton's: empty for a request sent without an id, and for a
        warm-up sample.
        """
        return self._request_id

    def correlation_id(self) -> int | str:
        """The sequence the request belongs to (a stateful model's sequence id), else 0."""
        return self._correlation_id

    def flags(self) -> int:
        """The request's flags: a sequence's first and last request say so, else 0.

        ``TRITONSERVER_REQUEST_FLAG_SEQUENCE_START`` on a sequence's first
        request, ``TRITONSERVER_REQUEST_FLAG_SEQUENCE_END`` on its last (both,
        OR-ed, on a sequence of one request), as Triton sets them.
        """
        return self._flags

    def timeout(self) -> int:
        """The request's timeout in microseconds as Triton's clients set it (0: none here)."""
        return self._timeout

    def model_name(self) -> str:
        """The model the request is for."""
        return self._model_name

    def parameters(self) -> str:
        """The request's parameters as a JSON object text (``"{}"`` when none)."""
        return self._parameters

    def requested_output_names(self) -> list[str]:
        """The outputs to answer with: those the client asked for; every output if it named none.

        A response may hold these alone (any others it holds are dropped).
        """
        return list(self._requested)

    def is_cancelled(self) -> bool:
        """Whether the request ended before its answer: its caller left, or its deadline passed.

        A long ``execute`` may stop then: its answer would reach nobody. A
        request the model made (BLS) never says so (False).
        """
        if self._sender is not None:
            return self._sender.is_cancelled()
        return self._ended is not None and self._ended()

    def get_response_sender(self) -> ResponseSender:
        """What a decoupled model sends this request's responses with.

        Raises:
            TritonModelException: The model is not decoupled (no
                ``model_transaction_policy { decoupled: true }``), or the
                request is one the model made.
        """
        if self._sender is None:
            raise TritonModelException(
                "get_response_sender() needs a decoupled model (model_transaction_policy "
                "{ decoupled: true } in config.pbtxt); this request has no response sender"
            )
        return self._sender

    def exec(self, decoupled: bool = False) -> Any:
        """Run the request on its model and wait for the response (from ``def execute``).

        With *decoupled* True (a decoupled model's request): a `ResponseIterator`
        of its responses, each waited for as it is iterated; an error ends it as
        a last response that carries the error.
        """
        models = getattr(_calls, "value", None)
        if models is None:
            raise TritonModelException(
                "InferenceRequest.exec() works only in a plain def execute while it runs (in "
                "an async def execute, await request.async_exec())"
            )
        if decoupled and self._sequence_named(models):
            # No decoupled model is stateful here: a stateful one answers once, as Triton's.
            return ResponseIterator([self.exec()])
        if decoupled:
            try:
                stream = models.infer_stream_blocking(
                    self._model_name, self._arrays(), parameters=self._parsed_parameters()
                )
            except TrioInferError as exc:
                return ResponseIterator([InferenceResponse(error=_triton_error(exc))])
            except RuntimeError as exc:  # not on the thread of an execute the engine runs
                raise TritonModelException(
                    f"InferenceRequest.exec(decoupled=True): {exc} (a decoupled model's own "
                    "execute cannot stream another model's responses here; see "
                    f"{_DOCS})"
                ) from None
            return ResponseIterator(self._streamed(stream), stream.close)
        return self._respond(
            lambda: models.infer_blocking(
                self._model_name,
                self._arrays(),
                parameters=self._parsed_parameters(),
                sequence=self._sequence(models),
            )
        )

    def _streamed(self, stream: Any) -> Any:
        # A stream's responses as InferenceResponses; its error as a last one.
        try:
            for outputs in stream:
                yield self._response(outputs)
        except TrioInferError as exc:
            yield InferenceResponse(error=_triton_error(exc))

    async def async_exec(self, decoupled: bool = False) -> Any:
        """Run the request on its model and return the response (from ``async def execute``).

        With *decoupled* True: a `ResponseIterator` of its responses, read to the
        end before it returns (it is iterated with a plain ``for``, as Triton's,
        which must not wait on the event loop); an error ends it as a last
        response that carries the error.
        """
        models = _async_calls.get(None)
        if models is None:
            raise TritonModelException(
                "InferenceRequest.async_exec() works only in an async def execute while it runs "
                "(in a plain def execute, call request.exec())"
            )
        if decoupled and self._sequence_named(models):
            # No decoupled model is stateful here: a stateful one answers once, as Triton's.
            return ResponseIterator([await self.async_exec()])
        arrays, parameters = self._arrays(), self._parsed_parameters()
        if decoupled:
            responses = []
            try:
                async with models.infer_stream(
                    self._model_name, arrays, parameters=parameters
                ) as stream:
                    async for outputs in stream:
                        responses.append(self._response(outputs))
            except TrioInferError as exc:
                responses.append(InferenceResponse(error=_triton_error(exc)))
            return ResponseIterator(responses)
        try:
            outputs = await models.infer(
                self._model_name, arrays, parameters=parameters, sequence=self._sequence(models)
            )
        except TrioInferError as exc:
            return InferenceResponse(error=_triton_error(exc))
        return self._response(outputs)

    def _sequence_named(self, models: Any) -> bool:
        # 0 and "" name no sequence (Triton reserves them); read on each BLS call. Triton
        # hands correlation_id and flags to a stateful model's sequence batcher and
        # ignores them for any other model: so do we (the engine refuses a sequence
        # given to a model that is not stateful).
        correlation_id = self._correlation_id
        named = bool(self._flags) or not (correlation_id == 0 or correlation_id == "")
        return named and models._stateful(self._model_name)

    def _sequence(self, models: Any) -> SequenceFlags | None:
        # The sequence a request made here goes on (BLS: correlation_id and flags, as
        # Triton passes them on): read as the server reads a client's, by the one parser
        # (a flag without an id is an error response, InvalidInput).
        if not self._sequence_named(models):
            return None
        return SequenceFlags.from_parameters(
            {
                "sequence_id": self._correlation_id,
                "sequence_start": bool(self._flags & TRITONSERVER_REQUEST_FLAG_SEQUENCE_START),
                "sequence_end": bool(self._flags & TRITONSERVER_REQUEST_FLAG_SEQUENCE_END),
            }
        )

    def _parsed_parameters(self) -> Any:
        # The parameters given as JSON text: text that is not JSON is an error response
        # (as one that is not an object of scalars is, from the engine), not an exception.
        try:
            return json.loads(self._parameters)
        except ValueError as exc:
            raise InvalidInput(
                f"InferenceRequest(parameters={self._parameters!r:.80}): the parameters "
                f"text is not JSON ({exc}); give a dict or a JSON object's text"
            ) from None

    def _arrays(self) -> dict[str, np.ndarray[Any, Any]]:
        return {tensor.name(): tensor.as_numpy() for tensor in self._inputs}

    def _respond(self, call: Callable[[], Mapping[str, np.ndarray[Any, Any]]]) -> InferenceResponse:
        try:
            outputs = call()
        except TrioInferError as exc:
            return InferenceResponse(error=_triton_error(exc))
        return self._response(outputs)

    def _response(self, outputs: Mapping[str, np.ndarray[Any, Any]]) -> InferenceResponse:
        wanted = self._requested or list(outputs)
        missing = [name for name in wanted if name not in outputs]
        if missing:
            return InferenceResponse(
                error=TritonError(
                    f"model {self._model_name!r} has no output {missing[0]!r}; its outputs "
                    f"are {', '.join(map(repr, outputs))}",
                    TritonError.INVALID_ARG,
                )
            )
        return InferenceResponse([Tensor(name, outputs[name]) for name in wanted])


def _triton_error(exc: TrioInferError) -> TritonError:
    code = TritonError.INVALID_ARG if isinstance(exc, InvalidInput) else TritonError.INTERNAL
    return TritonError(str(exc), code)


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    """The input tensor called *name* of *request*, or None when it has none."""
    for tensor in request.inputs():
        if tensor.name() == name:
            return tensor
    return None


def _config_entry(model_config: Mapping[str, Any], kind: str, name: str) -> dict[str, Any] | None:
    for entry in model_config.get(kind, ()):
        if isinstance(entry, Mapping) and entry.get("name") == name:
            return dict(entry)
    return None


def get_input_config_by_name(model_config: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    """The ``input`` entry called *name* of *model_config* (the parsed JSON), or None."""
    return _config_entry(model_config, "input", name)


def get_output_config_by_name(model_config: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    """The ``output`` entry called *name* of *model_config* (the parsed JSON), or None."""
    return _config_entry(model_config, "output", name)


_TYPES: Final[dict[str, type[Any]]] = {
    "TYPE_BOOL": np.bool_,
    "TYPE_UINT8": np.uint8,
    "TYPE_UINT16": np.uint16,
    "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64,
    "TYPE_INT8": np.int8,
    "TYPE_INT16": np.int16,
    "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64,
    "TYPE_FP16": np.float16,
    "TYPE_FP32": np.float32,
    "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
}


def triton_string_to_numpy(triton_type_string: str) -> type[Any]:
    """The numpy type of a config's data type: ``"TYPE_FP32"`` -> ``numpy.float32``.

    Raises:
        TritonModelException: A type numpy cannot hold (``TYPE_BF16``) or no type.
    """
    found = _TYPES.get(triton_type_string)
    if found is None:
        raise TritonModelException(
            f"no numpy type for {triton_type_string!r}; known: {', '.join(_TYPES)}"
        )
    return found


def numpy_to_triton_type(data_type: Any) -> str | None:
    """The config data type of a numpy type (``numpy.float32`` -> ``"TYPE_FP32"``), or None."""
    kind = np.dtype(data_type)
    if kind.kind in "OSU":
        return "TYPE_STRING"
    for name, numpy in _TYPES.items():
        if numpy is not np.object_ and np.dtype(numpy) == kind:
            return name
    return None


class ModelConfig(_Provided):
    """The configuration ``TritonPythonModel.auto_complete_config`` completes, as Triton's.

    Built from ``config.pbtxt`` (every field printed, as ``initialize``'s
    ``model_config``) when the model loads; what the staticmethod returns is
    the model's configuration from then on: its inputs, outputs,
    ``max_batch_size``, dynamic batching and transaction policy. The
    additions check what the file says, as Triton's do: a conflict is a
    ``ValueError`` naming the model and what differs, which fails the load.
    """

    __slots__ = ("_config",)

    _INPUT_KEYS: Final = ("name", "data_type", "dims", "optional")
    _OUTPUT_KEYS: Final = ("name", "data_type", "dims")

    def __init__(self, model_config: Mapping[str, Any] | str) -> None:
        """A configuration to complete: a mapping, or its JSON text."""
        config = json.loads(model_config) if isinstance(model_config, str) else model_config
        self._config: dict[str, Any] = json.loads(json.dumps(config))  # the caller's stays
        self._config.setdefault("input", [])
        self._config.setdefault("output", [])
        self._config.setdefault("max_batch_size", 0)

    def as_dict(self) -> dict[str, Any]:
        """The configuration as it is now (Triton's JSON form): read it; the setters change it."""
        return self._config

    def _where(self) -> str:
        return f"auto-complete-config of model {self._config.get('name', '')!r}"

    def set_max_batch_size(self, max_batch_size: int) -> None:
        """Set ``max_batch_size``; at least what config.pbtxt says, or a ``ValueError``."""
        said = self._config["max_batch_size"]
        if said > max_batch_size:
            raise ValueError(
                f"{self._where()}: config.pbtxt says max_batch_size {said}, more than the "
                f"{max_batch_size} it sets"
            )
        self._config["max_batch_size"] = max_batch_size

    def set_dynamic_batching(self) -> None:
        """Batch dynamically (``dynamic_batching {}``), unless config.pbtxt schedules otherwise."""
        for other in ("sequence_batching", "ensemble_scheduling"):
            if other in self._config:
                raise ValueError(
                    f"{self._where()}: config.pbtxt sets {other}, and dynamic_batching cannot "
                    "be set beside it"
                )
        self._config.setdefault("dynamic_batching", {})

    def add_input(self, input: Mapping[str, Any]) -> None:  # Triton's name
        """Add an input (``name``, ``data_type``, ``dims``, optionally ``optional``).

        One config.pbtxt declares already must agree with it (its data type,
        dims and optional flag where it says them), and is completed by it.
        """
        self._add("input", input, self._INPUT_KEYS)

    def add_output(self, output: Mapping[str, Any]) -> None:
        """Add an output (``name``, ``data_type``, ``dims``), as `add_input`."""
        self._add("output", output, self._OUTPUT_KEYS)

    def _add(self, kind: str, tensor: Mapping[str, Any], keys: tuple[str, ...]) -> None:
        if not isinstance(tensor, Mapping):
            # A ValueError, as Triton's: the load's error for what the model got wrong.
            raise ValueError(f"{self._where()}: an {kind} is a dict, got {tensor!r}")  # noqa: TRY004
        label = f"{kind} {tensor.get('name')!r}"
        if stray := sorted(set(tensor) - set(keys)):
            raise ValueError(
                f"{self._where()}: {label} has {', '.join(map(repr, stray))}; an {kind} takes "
                f"{', '.join(map(repr, keys))}"
            )
        if missing := [key for key in keys[:3] if key not in tensor]:
            raise ValueError(f"{self._where()}: {label} is missing {', '.join(map(repr, missing))}")
        for current in self._config[kind]:
            if current.get("name") != tensor["name"]:
                continue
            said = current.get("data_type", "TYPE_INVALID")
            if said != "TYPE_INVALID" and said != tensor["data_type"]:
                raise ValueError(
                    f"{self._where()}: config.pbtxt says {label} is {said}, the model says "
                    f"{tensor['data_type']}"
                )
            if current.get("dims") and list(current["dims"]) != list(tensor["dims"]):
                raise ValueError(
                    f"{self._where()}: config.pbtxt says {label} has dims {current['dims']}, "
                    f"the model says {list(tensor['dims'])}"
                )
            if (
                "optional" in tensor
                and current.get("optional", tensor["optional"]) != (tensor["optional"])
            ):
                raise ValueError(
                    f"{self._where()}: config.pbtxt says {label} optional "
                    f"{current['optional']}, the model says {tensor['optional']}"
                )
            current.update({key: tensor[key] for key in keys if key in tensor})
            return
        self._config[kind].append(dict(tensor))

    def set_model_transaction_policy(self, transaction_policy_dict: Mapping[str, Any]) -> None:
        """Set ``model_transaction_policy`` (``{"decoupled": True}``), not against the file's."""
        if stray := sorted(set(transaction_policy_dict) - {"decoupled"}):
            raise ValueError(
                f"{self._where()}: model_transaction_policy takes 'decoupled' only, got "
                f"{', '.join(map(repr, stray))}"
            )
        policy = self._config.setdefault("model_transaction_policy", {})
        if "decoupled" in transaction_policy_dict:
            wanted = transaction_policy_dict["decoupled"]
            if "decoupled" in policy and policy["decoupled"] != wanted:
                raise ValueError(
                    f"{self._where()}: config.pbtxt says decoupled {policy['decoupled']}; it "
                    f"cannot be changed to {wanted}"
                )
            policy["decoupled"] = wanted


class Logger(_Provided):
    """Triton's model logger: to trioinfer's log (the logger ``trioinfer.python``)."""

    INFO: Final = 0
    WARNING: Final = 1
    ERROR: Final = 2
    VERBOSE: Final = 3
    _LEVELS: Final = {0: logging.INFO, 1: logging.WARNING, 2: logging.ERROR, 3: logging.DEBUG}

    @staticmethod
    def log(message: str, level: int = 0) -> None:
        """Log *message* at *level* (``Logger.INFO`` unless given)."""
        log.log(Logger._LEVELS.get(level, logging.INFO), "%s", message)

    @staticmethod
    def log_info(message: str) -> None:
        """Log *message* as information."""
        log.info("%s", message)

    @staticmethod
    def log_warn(message: str) -> None:
        """Log *message* as a warning."""
        log.warning("%s", message)

    @staticmethod
    def log_error(message: str) -> None:
        """Log *message* as an error."""
        log.error("%s", message)

    @staticmethod
    def log_verbose(message: str) -> None:
        """Log *message* at debug level (Triton's verbose)."""
        log.debug("%s", message)


#: Where the custom metrics of trioinfer are said (what `MetricFamily` maps onto).
_METRICS_DOCS: Final = "docs/how-to/from-triton.md ('Custom metrics of a Triton model')"

#: The model whose ``initialize`` runs: a plain one's on its worker thread (a
#: thread-local), an ``async def`` one's on the event loop (a context variable).
_declaring = threading.local()
_async_declaring: contextvars.ContextVar[ModelMetrics | None] = contextvars.ContextVar(
    "trioinfer_pb_metrics", default=None
)

F = TypeVar("F", bound=Callable[..., Any])

#: The kind of each family a load of a model made (`MetricFamily`), by its load.
_kinds: weakref.WeakKeyDictionary[Any, dict[str, str]] = weakref.WeakKeyDictionary()
_kinds_lock = threading.Lock()


def _declaring_in(hook: F) -> F:
    """*hook* (``initialize``, ``execute``), made to declare `MetricFamily` for its model.

    Called by the backend in the engine's load of the model, where
    `trioinfer.lowlevel.current_model_metrics` knows the model; *hook* runs
    later, maybe on the instance's worker thread, where it does not. Outside a
    load (``finalize``) *hook* is returned as it is.
    """
    try:
        metrics = current_model_metrics()
    except RuntimeError:
        return hook
    if inspect.iscoroutinefunction(hook):

        @functools.wraps(hook)
        async def declaring_async(*args: Any) -> Any:
            token = _async_declaring.set(metrics)
            try:
                return await hook(*args)
            finally:
                _async_declaring.reset(token)

        return declaring_async  # type: ignore[return-value]

    @functools.wraps(hook)
    def declaring(*args: Any) -> Any:
        _declaring.value = metrics
        try:
            return hook(*args)
        finally:
            _declaring.value = None

    return declaring  # type: ignore[return-value]


def _model_metrics() -> ModelMetrics:
    metrics: ModelMetrics | None = getattr(_declaring, "value", None) or _async_declaring.get()
    if metrics is not None:
        return metrics
    try:
        # The model's __init__ and the top of model.py run in the engine's load too.
        return current_model_metrics()
    except RuntimeError:
        raise TritonModelException(
            "pb_utils.MetricFamily(...) is made while the model loads or executes here "
            "(in initialize(), __init__, at the top of model.py or in execute), where "
            "trioinfer knows which model it belongs to, not on a thread of the model's "
            "own: make it in initialize(), keep it on self, and update its metrics "
            f"anywhere (family.Metric(...) works anywhere); see {_METRICS_DOCS}"
        ) from None


class Metric(_Provided):
    """One series of a `MetricFamily`: ``family.Metric(labels={...})``."""

    __slots__ = ("_name", "_series")

    def __init__(self, name: str, series: CounterMetric | GaugeMetric | HistogramMetric) -> None:
        """Made by `MetricFamily.Metric`: *series* is trioinfer's."""
        self._name = name
        self._series = series

    def _refused(self, what: str) -> TritonModelException:
        kind = type(self._series).__name__.removesuffix("Metric").lower()
        return TritonModelException(
            f"metric {self._name!r} is a {kind}: {what} is not one of its operations"
        )

    def _update(self, update: Callable[[float], None], value: float) -> None:
        try:
            update(value)
        except InvalidMetric as exc:
            raise TritonModelException(str(exc)) from exc

    def increment(self, value: float) -> None:
        """Add *value* to a counter (not negative) or a gauge."""
        if isinstance(self._series, HistogramMetric):
            raise self._refused("increment()")
        self._update(self._series.increment, value)

    def set(self, value: float) -> None:
        """Set a gauge to *value*."""
        if not isinstance(self._series, GaugeMetric):
            raise self._refused("set()")
        self._update(self._series.set, value)

    def observe(self, value: float) -> None:
        """Count *value* in a histogram."""
        if not isinstance(self._series, HistogramMetric):
            raise self._refused("observe()")
        self._update(self._series.observe, value)

    def value(self) -> float:
        """A counter's or gauge's value now."""
        if isinstance(self._series, HistogramMetric):
            raise self._refused("value()")
        return self._series.value()


#: (Its name inside MetricFamily is the method's.)
_Series = Metric


class MetricFamily(_Provided):
    """Triton's custom metric family, kept as one of trioinfer's custom metrics.

    ``MetricFamily(name, description, kind=MetricFamily.COUNTER)`` in
    ``initialize``, then ``family.Metric(labels={...})`` (a histogram's with
    ``buckets=[...]``) for each series. Its series show on ``/metrics`` of
    ``trioinfer serve`` (a counter's as ``name_total``), each sample labelled
    with ``model`` and ``version`` too, and in ``engine.custom_metrics()``;
    they go with the model at an unload or reload.

    Unlike Triton's, a family has one set of label names (those of its first
    ``Metric``) and a histogram one set of buckets (at least one); label
    names are Prometheus's, not ``model``, ``version``, ``le`` or ``pid``;
    names may not start with ``trioinfer_``. A gauge's series of ``trioinfer
    serve --workers`` workers add up.
    """

    COUNTER: Final = 0
    GAUGE: Final = 1
    HISTOGRAM: Final = 2
    _KINDS: Final = {0: "counter", 1: "gauge", 2: "histogram"}

    __slots__ = ("_description", "_kind", "_metrics", "_name")

    def __init__(self, name: str, description: str, kind: int) -> None:
        """Declare the family *name* of *kind* for the model being loaded.

        Raises:
            TritonModelException: Outside the model's load (in ``execute``), an
                unknown *kind*, a name that is not a Prometheus name or is
                ``trioinfer_*``, or one declared already as another kind.
        """
        kind_name = self._KINDS.get(kind) if isinstance(kind, int) else None
        if kind_name is None:
            raise TritonModelException(
                f"pb_utils.MetricFamily {name!r}: kind must be MetricFamily.COUNTER, GAUGE or "
                f"HISTOGRAM, got {kind!r}"
            )
        self._metrics = _model_metrics()
        self._name = name
        self._description = description
        self._kind = kind_name
        # Triton refuses a name declared as another kind at once; the labels (and
        # buckets) trioinfer declares with come with the first Metric, so the kinds of
        # the families this load made are kept here. (Another model's family of the
        # name is refused at the first Metric, by trioinfer: a reload may change it.)
        shown = name.removesuffix("_total") if kind_name == "counter" else name
        with _kinds_lock:
            kinds = _kinds.setdefault(self._metrics._owner, {})
            theirs = kinds.get(shown)
            if theirs is not None and theirs != kind_name:
                raise TritonModelException(
                    f"pb_utils.MetricFamily {name!r} is declared already as a {theirs}, "
                    f"not a {kind_name}: choose another name"
                )
            kinds[shown] = kind_name

    def Metric(  # (Triton's name, capitalised)
        self, labels: Mapping[str, str] | None = None, buckets: Sequence[float] | None = None
    ) -> _Series:
        """The model's series with these *labels* (a histogram's counted in *buckets*).

        Raises:
            TritonModelException: What trioinfer refuses (label names other than
                the family's first ones, reserved or not Prometheus's; a
                histogram without buckets, or with other buckets than its first
                series; buckets for a counter or gauge), with why.
        """
        given = dict(labels or {})
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in given.items()):
            raise TritonModelException(
                f"pb_utils.MetricFamily {self._name!r}: labels must map str names to str "
                f"values, got {labels!r}"
            )
        if self._kind != "histogram" and buckets is not None:
            raise TritonModelException(
                f"pb_utils.MetricFamily {self._name!r}: buckets are for a HISTOGRAM's Metric, "
                f"this family is a {self._kind}"
            )
        if self._kind == "histogram" and not buckets:
            raise TritonModelException(
                f"pb_utils.MetricFamily {self._name!r}: a HISTOGRAM's Metric takes buckets, "
                "at least one increasing upper bound such as [0.1, 1.0] (+Inf is always there; "
                f"Triton allows buckets=[], trioinfer does not), got {buckets!r}"
            )
        names = sorted(given)  # one declaration whatever order a model gives labels in
        metrics = self._metrics
        try:
            series: CounterMetric | GaugeMetric | HistogramMetric
            if self._kind == "counter":
                series = metrics.counter(self._name, self._description, labels=names).metric(
                    **given
                )
            elif self._kind == "gauge":
                series = metrics.gauge(self._name, self._description, labels=names).metric(**given)
            else:
                series = metrics.histogram(
                    self._name, self._description, labels=names, buckets=list(buckets or ())
                ).metric(**given)
        except InvalidMetric as exc:
            raise TritonModelException(
                f"pb_utils.MetricFamily {self._name!r}: {exc} (trioinfer declares a family "
                "with the label names and buckets of its first Metric, and every Metric of it "
                f"has those; see {_METRICS_DOCS})"
            ) from exc
        return _Series(self._name, series)
