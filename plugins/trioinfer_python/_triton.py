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

import contextlib
import functools
import inspect
import json
import logging
import sys
import threading
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Final, final

import anyio
import anyio.from_thread
import anyio.lowlevel
import numpy as np

from trioinfer import (
    BackendError,
    ConfigError,
    InvalidInput,
    ModelConfig,
    ModelSignature,
    SequenceFlags,
    TrioInferError,
)
from trioinfer.lowlevel import (
    ModelTasks,
    Placement,
    Request,
    Status,
    WorkerThread,
    caller_request_id,
    current_engine,
    current_model_tasks,
    current_stream_request,
    set_response_parameters,
)

from . import triton_python_backend_utils as pb_utils
from ._faults import MODEL_FAULTS
from ._models import Models

#: The name Triton's model files import the module by.
MODULE_NAME: Final = "triton_python_backend_utils"
#: The class a Triton model file defines.
CLASS_NAME: Final = "TritonPythonModel"
#: How many responses of a decoupled model's request wait for a slow reader at most.
STREAM_BUFFER: Final = 64

log = logging.getLogger("trioinfer.python")

Outputs = dict[str, np.ndarray[Any, Any]]


def register_module() -> None:
    """Make ``import triton_python_backend_utils`` find this backend's module."""
    if sys.modules.get(MODULE_NAME) is not pb_utils:
        sys.modules[MODULE_NAME] = pb_utils


#: One model file imported at a time: its folder is on sys.path meanwhile.
_import_lock = threading.Lock()


def import_beside(folder: Path, load: Callable[[], ModuleType]) -> ModuleType:
    """Run *load* (the import of a model's ``model.py``) with *folder* first on ``sys.path``.

    Triton puts the version folder on ``sys.path``, so that ``model.py``
    imports the modules beside it (``import helper``); each Triton model has
    a process of its own there, so two models' ``helper.py`` never meet.
    Here the modules the import found in *folder* are the model's: taken out
    of ``sys.modules`` afterwards (the model's globals keep them), so that
    another model's module of the same name is its own and a reload reads
    the folder afresh. An import of such a module inside ``execute`` finds
    none: import them at the top of ``model.py``.
    """
    where = str(folder)
    with _import_lock:
        before = set(sys.modules)
        sys.path.insert(0, where)
        module: ModuleType | None = None
        try:
            module = load()
            return module
        finally:
            sys.path.remove(where)  # (the first: the one inserted)
            for name in set(sys.modules) - before:
                imported = sys.modules[name]
                file = getattr(imported, "__file__", None)
                if imported is not module and file and Path(file).is_relative_to(folder):
                    del sys.modules[name]


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
    except MODEL_FAULTS as exc:
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
    instance._controls = _controls(config, signature)
    try:
        if decoupled and instance._async:
            instance._task_group = _Tasks(current_model_tasks())
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
        with anyio.CancelScope(shield=True):
            if instance._task_group is not None:
                await instance._task_group.aclose()
            if worker is not None:
                await worker.aclose()
        raise
    return instance


def auto_complete(cls: type, config: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    """*config* as ``cls.auto_complete_config`` completes it; None if the class has none.

    Raises:
        ConfigError: It raised ``ValueError`` (``pb_utils.ModelConfig``'s
            conflicts), or returned something else than a ``pb_utils.ModelConfig``.
        BackendError: It raised anything else (chained).
    """
    complete = getattr(cls, "auto_complete_config", None)
    if complete is None:
        return None
    what = f"model {name!r}: {cls.__name__}.auto_complete_config"
    given = pb_utils.ModelConfig(config)
    try:
        returned = complete(given)
    except ValueError as exc:
        raise ConfigError(_raised(what, exc)) from None
    except MODEL_FAULTS as exc:
        raise BackendError(_raised(what, exc)) from exc
    if not isinstance(returned, pb_utils.ModelConfig):
        raise ConfigError(
            f"{what} returned {type(returned).__name__}; it must return the "
            "pb_utils.ModelConfig it was given, completed"
        )
    return returned.as_dict()


#: A control input the instance feeds each request of a sequence: (kind, name, dtype, shape).
Control = tuple[str, str, "np.dtype[Any]", tuple[int, ...]]


def _controls(config: ModelConfig, signature: ModelSignature) -> tuple[Control, ...]:
    # The sequence_batching control inputs, which the sequence batcher would lay out in
    # a batch: a Triton Python model takes each request on its own, so they are fed
    # here, one row per request (Triton's shape: [1] per request, [1, 1] with a batch).
    sequence = config.sequence
    if sequence is None:
        return ()
    specs = {spec.name: spec for spec in signature.inputs}
    out = []
    for kind, name in sequence.control.items():
        spec = specs.get(name)
        if spec is None or spec.dtype is None:
            continue  # the sequence batcher names what is missing when it attaches
        shape = tuple(d if isinstance(d, int) and d >= 0 else 1 for d in spec.shape)
        out.append((kind, name, spec.dtype, shape))
    return tuple(out)


def _control_tensors(
    controls: Sequence[Control], flags: SequenceFlags
) -> dict[str, np.ndarray[Any, Any]]:
    # Each control's value for one request, in the input's own dtype (as the batcher's).
    arrays = {}
    for kind, name, dtype, shape in controls:
        value: object = {"start": flags.start, "end": flags.end, "ready": True}.get(kind, flags.id)
        if dtype.kind == "O":
            # A string CORRID: the id as text, as bytes (as Triton's BYTES tensors are).
            value = str(value).encode("utf-8", "surrogatepass")
            array = np.full(shape, value, dtype=object)
        else:
            array = np.full(shape, value, dtype=dtype)
        arrays[name] = array
    return arrays


def _flags(flags: SequenceFlags | None) -> int:
    # Triton's request flags: SEQUENCE_START and SEQUENCE_END, as pb_utils names them.
    if flags is None:
        return 0
    return (pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START if flags.start else 0) | (
        pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END if flags.end else 0
    )


def _ended(request: Request) -> bool:
    return request.abandoned or request.status is Status.DONE


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
        # Built in the model's load: its executes may make pb_utils.MetricFamily too.
        self._execute = pb_utils._declaring_in(model.execute)
        self._async = inspect.iscoroutinefunction(self._execute)
        self._models: Models | None = None
        self._outputs = [spec.name for spec in signature.outputs]
        self._closed = False
        # A decoupled model's executes, beside the reading of their streams (`stream`).
        self._execute_lock = threading.Lock()
        self._threads = _Threads(f"trioinfer-triton-{name}-execute")
        self._task_group: _Tasks | None = None
        # A stateful model's control inputs, fed to each request (`_controls`).
        self._controls: tuple[Control, ...] = ()

    def __repr__(self) -> str:
        # What the engine's logs name the instance by (a failed close, say).
        return f"<{self._label}>"

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
        requested: Sequence[str] = (),
        flags: int = 0,
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
            # Triton's: the outputs the client asked for, every output where it named none.
            requested_output_names=requested or self._outputs,
            inputs=tensors,
            request_id=request_id,
            correlation_id=correlation_id,
            flags=flags,
            parameters=parameters,
        )

    async def execute(self, inputs: Mapping[str, np.ndarray[Any, Any]]) -> Outputs:
        """Run ``execute`` on one request made of *inputs* (a warm-up sample, a probe).

        Raises:
            BackendError: ``execute`` raised, or answered wrong.
            TrioInferError: The response's error.
        """
        (response,) = await self._run([self._request(inputs, "", 0)])
        answer = self._answer(response)
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
            inputs = request.inputs
            if flags is not None and self._controls:
                inputs = {**inputs, **_control_tensors(self._controls, flags)}
            made.append(
                self._request(
                    inputs,
                    caller_request_id(request),  # Triton's: "" when the client sent none
                    flags.id if flags else 0,
                    request.parameters,
                    request.requested_outputs,
                    _flags(flags),
                )
            )
            # Ended from outside while it runs: its caller left, or its deadline passed.
            made[-1]._ended = functools.partial(_ended, request)
        answers: list[Outputs | Exception] = []
        for request, response in zip(requests, await self._run(made), strict=True):
            if response._parameters:
                set_response_parameters(request, response._parameters)
            answers.append(self._answer(response))
        return answers

    async def _run(
        self, requests: list[pb_utils.InferenceRequest]
    ) -> list[pb_utils.InferenceResponse]:
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
        except MODEL_FAULTS as exc:
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
        return list(responses)

    async def _call_execute(self, requests: list[pb_utils.InferenceRequest]) -> Any:
        models = self._models
        if self._async:
            token = pb_utils._async_calls.set(models)
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
        pb_utils._calls.value = models
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

        ``execute`` runs beside the reading, so that each response reaches the
        caller as it is sent: a plain ``def execute`` on a thread the instance
        owns, one execute at a time per instance (as Triton runs it on the
        instance's thread), an ``async def execute`` as a task of the model's
        task group (`_Tasks`). The stream ends at the response sent with
        ``TRITONSERVER_RESPONSE_COMPLETE_FINAL``. At most `STREAM_BUFFER`
        responses wait for the reader: a sender on a thread of its own
        blocks while they do (a slow reader slows the model), and one on the
        event loop's thread (an ``async def execute``) gets a
        ``TritonModelException``. Once the caller left, ``is_cancelled()``
        says so and what the model sends is dropped, a blocked sender
        released; an ``async def execute`` is cancelled.

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
            tuple[pb_utils.InferenceResponse | None, bool]
        ](max_buffer_size=STREAM_BUFFER)
        gone = threading.Event()
        errors: list[Exception] = []  # what ended the stream early: execute's failure

        def put(response: pb_utils.InferenceResponse | None, final: bool) -> None:
            if gone.is_set():
                return  # the caller left: dropped, as Triton drops it
            try:
                if threading.get_ident() != loop:
                    # Blocks while the buffer is full; released when the reader leaves.
                    anyio.from_thread.run(send.send, (response, final), token=token)
                    return
                try:
                    send.send_nowait((response, final))
                except anyio.WouldBlock:
                    raise pb_utils.TritonModelException(
                        f"model {self._name!r}: {STREAM_BUFFER} responses wait for a reader "
                        "slower than execute sends them; an async def execute sends on the "
                        "event loop's thread, which must not block: await between sends"
                    ) from None
            except (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.RunFinishedError):
                gone.set()

        def end(error: Exception) -> None:
            # execute failed: the stream ends after the responses sent before.
            errors.append(error)
            if threading.get_ident() == loop:
                send.close()
            else:
                with contextlib.suppress(anyio.RunFinishedError):
                    anyio.from_thread.run_sync(send.close, token=token)

        streamed = current_stream_request()
        request = (
            self._request(inputs, "", 0)
            if streamed is None  # (called outside the engine's stream)
            else self._request(
                inputs,
                caller_request_id(streamed),
                0,
                streamed.parameters,
                streamed.requested_outputs,
            )
        )
        request._sender = pb_utils.ResponseSender(put, gone.is_set)
        scope = anyio.CancelScope()
        try:
            if self._async:
                self._tasks().start_soon(self._async_stream, request, scope, end)
            else:
                self._threads.start(self._sync_stream, request, end)
            async for response, final in receive:
                if response is not None:
                    answer = self._answer(response)
                    if isinstance(answer, Exception):
                        raise answer
                    if response._parameters and streamed is not None:
                        set_response_parameters(streamed, response._parameters)
                    yield answer
                if final:
                    return
            raise errors[0]  # (only end() closes the sending side)
        finally:
            gone.set()
            scope.cancel()
            receive.close()
            send.close()

    def _failed(self, exc: BaseException) -> Exception:
        if isinstance(exc, TrioInferError):
            return exc
        failure = BackendError(_raised(f"{self._label}: execute", exc))
        failure.__cause__ = exc
        return failure

    def _sync_stream(
        self, request: pb_utils.InferenceRequest, end: Callable[[Exception], None]
    ) -> None:
        # On a thread of the instance's own (`_Threads`), one execute at a time on the
        # instance, as Triton runs execute on the instance's thread.
        with self._execute_lock:
            try:
                returned = self._sync_execute([request])
            except MODEL_FAULTS as exc:
                end(self._failed(exc))
                return
        if returned is not None:
            end(BackendError(self._returned(returned)))

    async def _async_stream(
        self,
        request: pb_utils.InferenceRequest,
        scope: anyio.CancelScope,
        end: Callable[[Exception], None],
    ) -> None:
        # A task of the model's group (`_Tasks`): cancelled when its caller leaves
        # (scope) or the instance closes.
        models = self._models
        token = pb_utils._async_calls.set(models)
        try:
            with scope:
                try:
                    returned = await self._execute([request])
                except anyio.get_cancelled_exc_class():
                    end(BackendError(f"{self._label} closed while execute ran"))
                    raise
                except MODEL_FAULTS as exc:
                    end(self._failed(exc))
                    return
                if returned is not None:
                    end(BackendError(self._returned(returned)))
        finally:
            pb_utils._async_calls.reset(token)

    def _tasks(self) -> _Tasks:
        assert self._task_group is not None  # opened at load for an async decoupled model
        return self._task_group

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
        # initialize() declares pb_utils.MetricFamily for the model being loaded.
        function = pb_utils._declaring_in(function)
        try:
            if inspect.iscoroutinefunction(function):
                await function(*args)
            else:
                assert self._worker is not None
                await self._worker.run_sync(function, *args)
        except anyio.get_cancelled_exc_class():
            raise
        except MODEL_FAULTS as exc:
            raise BackendError(_raised(f"{self._label}: {hook}()", exc)) from exc

    async def aclose(self) -> None:
        """Wait for a decoupled model's executes, run ``finalize`` once, stop the threads.

        The wait is bounded by the caller's cancel scope (the engine's cleanup
        bound at an unload): an execute still running then is named in a
        warning and left to end (a thread cannot be stopped; an ``async def
        execute`` is cancelled). Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        tasks = self._task_group
        try:
            try:
                await self._threads.wait()
                if tasks is not None:
                    await tasks.wait()
            finally:
                with anyio.CancelScope(shield=True):
                    running = self._threads.running() + (tasks.running() if tasks else 0)
                    if running:
                        log.warning(
                            "model %r: unload stopped waiting for %d execute(s) of %s still "
                            "running; finalize() runs beside them",
                            self._name,
                            running,
                            self._label,
                        )
                    if tasks is not None:
                        await tasks.aclose()
                    await self._call("finalize")
        finally:
            with anyio.CancelScope(shield=True):
                if self._worker is not None:
                    await self._worker.aclose()
            if self._module is not None:
                sys.modules.pop(self._module, None)


@final
class _Threads:
    # The threads a decoupled model's plain def execute runs on, one per request (the
    # request's stream is read meanwhile): the instance's, waited for at its close.
    __slots__ = ("_done", "_lock", "_name", "_running")

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._running = 0
        self._done = threading.Condition(self._lock)

    def start(self, fn: Callable[..., object], *args: Any) -> None:
        with self._lock:
            self._running += 1
        try:
            threading.Thread(
                target=self._run, args=(fn, *args), name=self._name, daemon=True
            ).start()
        except BaseException:
            self._ended()
            raise

    def _run(self, fn: Callable[..., object], *args: Any) -> None:
        try:
            fn(*args)
        finally:
            self._ended()

    def _ended(self) -> None:
        with self._lock:
            self._running -= 1
            self._done.notify_all()

    def running(self) -> int:
        with self._lock:
            return self._running

    def _wait_blocking(self, gone: threading.Event) -> None:
        with self._lock:
            while self._running and not gone.is_set():
                self._done.wait(0.1)

    async def wait(self) -> None:
        """Return when no thread runs (cancellable: the waiting thread stops too)."""
        if not self.running():
            return
        gone = threading.Event()
        try:
            await anyio.to_thread.run_sync(self._wait_blocking, gone, abandon_on_cancel=True)
        finally:
            gone.set()


@final
class _Tasks:
    # A decoupled model's async def executes, each a task of the model's task group
    # (lowlevel.current_model_tasks): a stream's generator must not hold a task group
    # across its yields, so an execute runs beside the reading of its stream, in a
    # group that outlives the streams. The instance's own are counted, so that its
    # close waits for them, then cancels those left (the model's group ends later,
    # after every instance closed; a re-created instance's must end with it).
    __slots__ = ("_group", "_idle", "_running", "_scopes")

    def __init__(self, group: ModelTasks) -> None:
        self._group = group
        self._scopes: set[anyio.CancelScope] = set()
        self._running = 0
        self._idle = anyio.Event()
        self._idle.set()

    def start_soon(self, fn: Callable[..., Awaitable[object]], *args: Any) -> None:
        scope = anyio.CancelScope()
        self._group.start_soon(self._run, scope, fn, *args)
        self._scopes.add(scope)
        self._running += 1
        self._idle = anyio.Event() if self._running == 1 else self._idle

    async def _run(
        self, scope: anyio.CancelScope, fn: Callable[..., Awaitable[object]], *args: Any
    ) -> None:
        try:
            with scope:
                await fn(*args)
        finally:
            self._scopes.discard(scope)
            self._running -= 1
            if not self._running:
                self._idle.set()

    def running(self) -> int:
        return self._running

    async def wait(self) -> None:
        await self._idle.wait()

    async def aclose(self) -> None:
        # Those left are cancelled, and waited for (by the caller's bound: the engine's).
        for scope in self._scopes:
            scope.cancel()
        await self._idle.wait()
