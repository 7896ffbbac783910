"""Triton Python models, served as they are: ``class TritonPythonModel`` in ``model.py``.

A ``config.pbtxt`` that says ``backend: "python"`` becomes a ``python``
backend model whose ``triton`` option holds the Triton configuration
(``server/_triton.py``); this module is what the backend does with it:

- ``import triton_python_backend_utils as pb_utils`` in the model file finds
  `trioinfer_python.triton_python_backend_utils` (registered in
  ``sys.modules`` before the file is imported);
- ``initialize(args)`` gets Triton's arguments, on the instance's worker
  thread (or awaited, if ``async def``); ``finalize()`` at unload;
- ``execute(requests)`` gets one `InferenceRequest` per request of the
  engine's batch, each with its own tensors (`TritonInstance.execute_requests`,
  the ``RequestsInstance`` hook), and returns one `InferenceResponse` per
  request: a response with an error fails that request only, an exception
  (or a list of another length) fails them all;
- a decoupled model (``model_transaction_policy { decoupled: true }``)
  answers through ``request.get_response_sender()``: a stream
  (`TritonInstance.stream`).
"""

from __future__ import annotations

import inspect
import json
import math
import sys
import threading
from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import Any, Final, final

import anyio
import anyio.from_thread
import anyio.lowlevel
import numpy as np

from trioinfer import BackendError, InvalidInput, ModelConfig, ModelSignature, TrioInferError
from trioinfer.lowlevel import (
    Placement,
    Request,
    WorkerThread,
    current_engine,
    current_stream_parameters,
)

from . import triton_python_backend_utils as pb_utils
from ._models import Models

#: The name Triton's model files import the module by.
MODULE_NAME: Final = "triton_python_backend_utils"
#: The class a Triton model file defines.
CLASS_NAME: Final = "TritonPythonModel"

Outputs = dict[str, np.ndarray[Any, Any]]


def register_module() -> None:
    """Make ``import triton_python_backend_utils`` find this backend's module."""
    if sys.modules.get(MODULE_NAME) is not pb_utils:
        sys.modules[MODULE_NAME] = pb_utils


def _raised(what: str, exc: BaseException) -> str:
    from . import _raised as raised  # (the backend's own: it names the model's line)

    return raised(what, exc)


async def load(
    config: ModelConfig,
    placement: Placement,
    signature: ModelSignature,
    cls: type,
    module: str | None,
    triton: Mapping[str, Any],
) -> TritonInstance:
    """Build one `TritonInstance` of *cls* for *placement* and run its ``initialize``.

    Raises:
        BackendError: The class cannot be built, has no ``execute``, or
            ``initialize`` raised (chained).
    """
    name = str(triton.get("name") or config.name)
    label = f"model {name!r} instance {placement.index}"
    try:
        model = await anyio.to_thread.run_sync(cls)
    except Exception as exc:
        raise BackendError(_raised(f"{label}: {cls.__name__}()", exc)) from exc
    execute = getattr(model, "execute", None)
    if not callable(execute):
        raise BackendError(f"{label}: class {cls.__name__} has no execute(self, requests)")
    decoupled = bool(triton.get("model_transaction_policy", {}).get("decoupled", False))
    hooks = [getattr(model, hook, None) for hook in ("execute", "initialize", "finalize")]
    worker = None
    if any(callable(h) and not inspect.iscoroutinefunction(h) for h in hooks):
        worker = await WorkerThread.start(
            f"trioinfer-triton-{name}-{placement.index}", cpu_affinity=placement.cpu_affinity
        )
    instance = TritonInstance(
        model, signature, str(placement.device), label, worker, module, name, decoupled
    )
    try:
        instance._models = Models(current_engine(), config.name)
        path = config.path
        device = str(placement.device)
        args = {
            "model_config": json.dumps(dict(triton)),
            "model_instance_kind": "GPU" if device.startswith(("cuda", "tensorrt")) else "CPU",
            "model_instance_device_id": device.partition(":")[2] or "0",
            "model_repository": str(path.parent.parent) if path is not None else "",
            "model_version": path.parent.name if path is not None else "1",
            "model_name": name,
            "model_instance_name": f"{name}_0_{placement.index}",
        }
        await instance._call("initialize", args)
    except BaseException:
        if worker is not None:
            await worker.aclose()
        raise
    return instance


def _error(model: str, error: object) -> Exception:
    # What a response's TritonError fails its request with: the client's fault for
    # INVALID_ARG (a 400), the model's otherwise (a 500), its message kept.
    if not isinstance(error, pb_utils.TritonError):
        return BackendError(
            f"model {model!r}: a response's error is {type(error).__name__}, not a "
            "pb_utils.TritonError"
        )
    message = f"model {model!r}: {error.message()}"
    if error.code() == pb_utils.TritonError.INVALID_ARG:
        return InvalidInput(message)
    return BackendError(message)


@final
class TritonInstance:
    """One ``TritonPythonModel`` object on its placement (see the module's docs)."""

    def __init__(
        self,
        model: Any,
        signature: ModelSignature,
        device: str,
        label: str,
        worker: WorkerThread | None,
        module: str | None,
        name: str,
        decoupled: bool,
    ) -> None:
        self._model = model
        self._signature = signature
        self._device = device
        self._label = label
        self._worker = worker
        self._module = module
        self._name = name
        self._decoupled = decoupled
        self._execute = model.execute
        self._async = inspect.iscoroutinefunction(self._execute)
        self._models: Models | None = None
        self._outputs = [spec.name for spec in signature.outputs]
        self._closed = False

    @property
    def signature(self) -> ModelSignature:
        """The signature config.pbtxt declares."""
        return self._signature

    @property
    def device(self) -> str:
        """Where the instance was placed."""
        return self._device

    @property
    def decoupled(self) -> bool:
        """Whether config.pbtxt says ``model_transaction_policy { decoupled: true }``."""
        return self._decoupled

    def _request(
        self,
        inputs: Mapping[str, np.ndarray[Any, Any]],
        request_id: str,
        correlation_id: int | str,
        parameters: Mapping[str, Any] | None = None,
    ) -> pb_utils.InferenceRequest:
        tensors = []
        for name, value in inputs.items():
            if value.__class__ is np.ndarray:
                # The caller's own arrays (or another request's rows): read-only views.
                value = value.view()
                value.setflags(write=False)
            tensors.append(pb_utils.Tensor(name, value))
        return pb_utils.InferenceRequest(
            model_name=self._name,
            requested_output_names=self._outputs,
            inputs=tensors,
            request_id=request_id,
            correlation_id=correlation_id,
            parameters=parameters,
        )

    async def execute(self, inputs: Mapping[str, np.ndarray[Any, Any]]) -> Outputs:
        """Run ``execute`` on one request made of *inputs* (a warm-up sample, a probe).

        Raises:
            BackendError: ``execute`` raised, or answered wrong.
            TrioInferError: The response's error.
        """
        (answer,) = await self._run([self._request(inputs, "", 0)])
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def execute_requests(self, requests: Sequence[Request]) -> list[Outputs | Exception]:
        """Run ``execute`` on *requests*, each its own `pb_utils.InferenceRequest`.

        Returns each request's outputs, or the error its response carries.

        Raises:
            BackendError: ``execute`` raised (chained), or did not return one
                ``InferenceResponse`` per request.
        """
        made = []
        for request in requests:
            flags = request.sequence_flags
            made.append(
                self._request(
                    request.inputs, request.id, flags.id if flags else 0, request.parameters
                )
            )
        return await self._run(made)

    async def _run(self, requests: list[pb_utils.InferenceRequest]) -> list[Outputs | Exception]:
        if self._closed:
            raise BackendError(f"{self._label} is closed")
        if self._decoupled:
            raise InvalidInput(
                f"model {self._name!r} is decoupled (it answers with a stream of responses): "
                "call it with a stream (gRPC ModelStreamInfer, HTTP generate_stream, "
                "engine.infer_stream)"
            )
        try:
            responses = await self._call_execute(requests)
        except (anyio.get_cancelled_exc_class(), TrioInferError):
            raise
        except Exception as exc:
            raise BackendError(_raised(f"{self._label}: execute", exc)) from exc
        if not isinstance(responses, (list, tuple)) or len(responses) != len(requests):
            got = (
                f"{len(responses)} items"
                if isinstance(responses, (list, tuple))
                else type(responses).__name__
            )
            raise BackendError(
                f"model {self._name!r}: execute returned {got} for {len(requests)} requests; "
                "it must return a list of one pb_utils.InferenceResponse per request, in order"
            )
        odd = [r for r in responses if not isinstance(r, pb_utils.InferenceResponse)]
        if odd:
            raise BackendError(
                f"model {self._name!r}: execute returned a list holding "
                f"{type(odd[0]).__name__}; it must hold one pb_utils.InferenceResponse per "
                "request"
            )
        return [self._answer(response) for response in responses]

    async def _call_execute(self, requests: list[pb_utils.InferenceRequest]) -> Any:
        models = self._models
        if self._async:
            token = pb_utils._async_calls.set(None if models is None else models.infer)
            try:
                return await self._execute(requests)
            finally:
                pb_utils._async_calls.reset(token)
        assert self._worker is not None
        if models is None:  # pragma: no cover  # set at load
            return await self._worker.run_sync(self._execute, requests)
        # Its BLS calls (exec()) are bound to the requests it computes for.
        return await models._run(self._worker, self._sync_execute, requests, None)

    def _sync_execute(self, requests: list[pb_utils.InferenceRequest]) -> Any:
        # On the worker thread: execute, with exec() calling other models through models.
        models = self._models
        pb_utils._calls.value = None if models is None else models.infer_blocking
        try:
            return self._execute(requests)
        finally:
            pb_utils._calls.value = None

    def _answer(self, response: pb_utils.InferenceResponse) -> Outputs | Exception:
        if response.has_error():
            return _error(self._name, response.error())
        return {tensor.name(): tensor.as_numpy() for tensor in response.output_tensors()}

    async def stream(
        self, inputs: Mapping[str, np.ndarray[Any, Any]]
    ) -> AsyncGenerator[Outputs, None]:
        """Run a decoupled model's ``execute`` on one request: its responses as they are sent.

        A plain ``def execute`` runs on a thread of the request's own, so that
        each response reaches the caller as it is sent; the stream ends at the
        response sent with ``TRITONSERVER_RESPONSE_COMPLETE_FINAL``. A
        response the model sends once the caller stopped reading is dropped
        (``sender.is_cancelled()`` says so).

        Raises:
            BackendError: ``execute`` raised, or returned responses (a
                decoupled model sends them).
            TrioInferError: A response's error.
        """
        if self._closed:
            raise BackendError(f"{self._label} is closed")
        token = anyio.lowlevel.current_token()
        loop = threading.get_ident()
        send, receive = anyio.create_memory_object_stream[
            tuple[pb_utils.InferenceResponse | None, bool, Exception | None]
        ](max_buffer_size=math.inf)
        gone = threading.Event()

        def put(
            response: pb_utils.InferenceResponse | None,
            final: bool,
            error: Exception | None = None,
        ) -> None:
            if gone.is_set():
                return
            item = (response, final, error)
            try:
                if threading.get_ident() == loop:
                    send.send_nowait(item)
                else:
                    anyio.from_thread.run_sync(send.send_nowait, item, token=token)
            except (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.RunFinishedError):
                gone.set()

        request = self._request(inputs, "", 0, current_stream_parameters())
        request._sender = pb_utils.ResponseSender(put, gone.is_set)

        def run() -> None:
            try:
                returned = self._sync_execute([request])
            except Exception as exc:
                put(None, True, BackendError(_raised(f"{self._label}: execute", exc)))
                return
            if returned is not None:
                put(None, True, BackendError(self._returned(returned)))

        try:
            if self._async:
                try:
                    returned = await self._execute([request])
                except (anyio.get_cancelled_exc_class(), TrioInferError):
                    raise
                except Exception as exc:
                    raise BackendError(_raised(f"{self._label}: execute", exc)) from exc
                if returned is not None:
                    raise BackendError(self._returned(returned))
            else:
                # Not the instance's worker: a decoupled execute may send for as long as
                # the request lasts, and other requests' streams must not wait behind it.
                threading.Thread(
                    target=run, name=f"trioinfer-triton-{self._name}-stream", daemon=True
                ).start()
            async for response, final, error in receive:
                if error is not None:
                    raise error
                if response is not None:
                    answer = self._answer(response)
                    if isinstance(answer, Exception):
                        raise answer
                    yield answer
                if final:
                    return
        finally:
            gone.set()
            receive.close()
            send.close()

    def _returned(self, returned: object) -> str:
        return (
            f"model {self._name!r} is decoupled: its execute sends responses with "
            "request.get_response_sender() and returns None, but it returned "
            f"{type(returned).__name__}"
        )

    async def _call(self, hook: str, *args: Any) -> None:
        function = getattr(self._model, hook, None)
        if not callable(function):
            return
        try:
            if inspect.iscoroutinefunction(function):
                await function(*args)
            else:
                assert self._worker is not None
                await self._worker.run_sync(function, *args)
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:
            raise BackendError(_raised(f"{self._label}: {hook}()", exc)) from exc

    async def aclose(self) -> None:
        """Run ``finalize`` once, then stop the worker thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            with anyio.CancelScope(shield=True):
                await self._call("finalize")
        finally:
            if self._worker is not None:
                await self._worker.aclose()
            if self._module is not None:
                sys.modules.pop(self._module, None)
