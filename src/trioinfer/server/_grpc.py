"""The KServe V2 gRPC endpoint, as Triton serves it: ``inference.GRPCInferenceService``.

`serve_grpc` runs a ``grpc.aio`` server beside the HTTP one, in the same
process, on the same engine and `ServerState`: every answer comes from the
functions the HTTP routes use (``_app``, ``_codec``), so the two protocols
cannot drift.

How grpcio meets the event loop. Under ``--loop asyncio`` grpc.aio runs on
serve's own loop; under Trio it runs on an asyncio loop of its own, in a
thread `serve_grpc` owns. Either way a handler turns the protobuf message into
plain values and hands the work to the serving loop (`_Portal`: one
``run_sync_soon`` / ``call_soon_threadsafe`` into a channel that a task of
`serve_grpc` reads), which runs it as a task of its own task group, under a
cancel scope whose deadline is the client's (``grpc-timeout``); the handler
awaits the answer. A client that cancels or goes away makes grpc.aio cancel
the handler (and call its done callback), which posts "cancel this call": the
scope is cancelled, and with it the request in the engine. grpcio's threaded
server, bridged the same way, was measured too and cost as much or more per
request, with a thread held per call and per open stream
(docs/reference/server.md, benchmarks/RESULTS.md).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Final, NoReturn, final

import anyio
import anyio.abc
import attrs
import grpc
import sniffio
import trio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from google.protobuf import json_format, message_factory
from google.protobuf.message import DecodeError

from .. import __version__
from .._exceptions import (
    BackendUnavailable,
    CircuitOpen,
    ConfigError,
    DeadlineExceeded,
    EngineClosed,
    InvalidInput,
    ModelNotFound,
    PluginContractError,
    QueueFull,
    TrioInferError,
)
from . import _grpc_proto as pb
from ._app import (
    EXTENSIONS,
    ROUTING_KEY_HEADER,
    ServerState,
    _check_outputs,
    _classified,
    _fallback_parameters,
    _one_process_only,
    _schedule_parameters,
    apply_log_settings,
    infer_in_time,
    load_override,
    model_config_document,
    model_metadata_document,
    repository_index_document,
    statistics_document,
    trace_setting_document,
)
from ._codec import PayloadTooLarge, RequestError, decode_infer_parts, encode_raw_outputs
from ._errors import NotReady, Unauthorized

log = logging.getLogger("trioinfer.server")

#: A ``time_remaining()`` above this means the client set no deadline.
_NO_DEADLINE: Final = 10 * 365 * 86400.0

_STATUS: Final[tuple[tuple[type[BaseException], grpc.StatusCode], ...]] = (
    (PayloadTooLarge, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Unauthorized, grpc.StatusCode.UNAUTHENTICATED),
    (ModelNotFound, grpc.StatusCode.NOT_FOUND),
    (InvalidInput, grpc.StatusCode.INVALID_ARGUMENT),  # RequestError too
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (PluginContractError, grpc.StatusCode.INTERNAL),
    (QueueFull, grpc.StatusCode.UNAVAILABLE),
    (CircuitOpen, grpc.StatusCode.UNAVAILABLE),
    (BackendUnavailable, grpc.StatusCode.UNAVAILABLE),
    (EngineClosed, grpc.StatusCode.UNAVAILABLE),
    (NotReady, grpc.StatusCode.UNAVAILABLE),
    (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
)


def grpc_status_for(error: BaseException) -> grpc.StatusCode:
    """The gRPC status for an error raised while serving a call: the only such mapping.

    The same classes as `status_for` gives HTTP statuses, in Triton's gRPC
    terms: a client's fault is ``INVALID_ARGUMENT``, an unknown model
    ``NOT_FOUND``, a full queue or a stopping server ``UNAVAILABLE``, a
    passed deadline ``DEADLINE_EXCEEDED``, anything else ``INTERNAL``.
    """
    for kind, status in _STATUS:
        if isinstance(error, kind):
            return status
    return grpc.StatusCode.INTERNAL


class _ClientGone(TrioInferError):
    """The client cancelled the call or went away: nobody is left to answer."""


# -- from grpc.aio's thread to the event loop -----------------------------------------


@final
class _Portal:
    """Hands work from grpc.aio's thread to the serving loop, without waiting for it to start.

    A handler posts to a memory channel with one non-blocking hop onto the
    loop (Trio's ``run_sync_soon``, asyncio's ``call_soon_threadsafe``); a task
    of `serve_grpc` reads the channel and starts each call as a task of its
    own task group, or cancels one whose client left.
    """

    def __init__(self, send: MemoryObjectSendStream[tuple[_Call, Any, tuple[Any, ...]]]) -> None:
        self._send = send
        self._soon: Callable[..., Any]
        if sniffio.current_async_library() == "trio":
            self._soon = trio.lowlevel.current_trio_token().run_sync_soon
        else:
            self._soon = asyncio.get_running_loop().call_soon_threadsafe

    def submit(self, call: _Call, fn: Any, *args: Any) -> bool:
        """From a thread: run ``fn(*args)`` for *call* (``fn`` None: cancel it); False if closed."""
        try:
            self._soon(self._deliver, call, fn, args)
        except (trio.RunFinishedError, RuntimeError):
            return False
        return True

    def _deliver(self, call: _Call, fn: Any, args: tuple[Any, ...]) -> None:
        # On the loop, outside any task: this must not raise (Trio would crash).
        try:
            self._send.send_nowait((call, fn, args))
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.WouldBlock):
            call.fail(NotReady("the server is stopping and takes no new requests"))


@final
@attrs.define(eq=False)
class _Call:
    """One RPC as the event loop sees it: its deadline, whether its client left, its scope."""

    #: ``time.monotonic()`` when the client's deadline passes, or None.
    expires: float | None
    future: concurrent.futures.Future[Any] | None = None
    scope: anyio.CancelScope | None = None
    gone: bool = False

    def fail(self, error: BaseException) -> None:
        if self.future is not None:
            _settle(self.future, error=error)

    def cancel(self) -> None:
        """On the event loop: the client left; withdraw its request."""
        self.gone = True
        if self.scope is not None:
            self.scope.cancel()


def _settle(
    future: concurrent.futures.Future[Any],
    *,
    result: Any = None,
    error: BaseException | None = None,
) -> None:
    """Answer *future* unless it is answered, or cancelled (with its handler)."""
    try:
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except concurrent.futures.InvalidStateError:
        pass


# -- the service ------------------------------------------------------------------------


@final
class _Service:
    """The RPCs: coroutines on grpc.aio's loop, each handing its call to the serving loop."""

    def __init__(self, state: ServerState, portal: _Portal, *, native: bool) -> None:
        self._state = state
        self._portal = portal
        # grpc.aio runs on the serving loop itself (asyncio): no hop to make.
        self._native = native

    # -- plumbing --

    def _open(self, context: Any) -> _Call:
        """Watch *context* for its client leaving; note its deadline."""
        remaining = context.time_remaining()
        expires = None
        if remaining is not None and remaining < _NO_DEADLINE:
            expires = time.monotonic() + remaining
        call = _Call(expires)

        def on_done(_context: Any) -> None:
            # grpc.aio calls this when the RPC ends for any reason; only a call
            # still waiting for its answer needs cancelling.
            if call.future is not None and not call.future.done():
                self._portal.submit(call, None)

        context.add_done_callback(on_done)
        return call

    async def _run(self, call: _Call, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` (sync or async) on the serving loop for *call*; return its result."""
        if self._native:
            # In the handler's own task: a client that leaves cancels it, and the request.
            return await self._in_scope(call, fn, *args)
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        call.future = future
        if not self._portal.submit(call, fn, *args):
            raise NotReady("the server is stopping and takes no new requests")
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # grpc.aio cancels the handler when the client cancels, leaves or runs
            # out of time: withdraw the request in the engine too.
            self._portal.submit(call, None)
            raise

    async def run_calls(
        self,
        receive: MemoryObjectReceiveStream[tuple[_Call, Any, tuple[Any, ...]]],
        group: anyio.abc.TaskGroup,
    ) -> None:
        """Start each call the handlers hand over as a task of *group*; cancel a left one's."""
        async with receive:
            async for call, fn, args in receive:
                if fn is None:
                    call.cancel()
                else:
                    group.start_soon(self._task, call, fn, *args)

    async def _task(self, call: _Call, fn: Callable[..., Any], *args: Any) -> None:
        future = call.future
        assert future is not None
        try:
            _settle(future, result=await self._in_scope(call, fn, *args))
        except TrioInferError as exc:
            _settle(future, error=exc)
        except Exception as exc:
            log.exception("gRPC call failed", exc_info=exc)
            _settle(future, error=exc)
        finally:
            call.scope = None
            if not future.done():  # cancelled from outside: the server stops now
                _settle(future, error=NotReady("the server stopped before the request finished"))

    async def _in_scope(self, call: _Call, fn: Callable[..., Any], *args: Any) -> Any:
        # Under the client's deadline, cancelled if the client leaves.
        if call.gone:
            raise _ClientGone("the client left before its request started")
        with anyio.CancelScope() as scope:
            if call.expires is not None:
                scope.deadline = anyio.current_time() + (call.expires - time.monotonic())
            call.scope = scope
            result = fn(*args)
            if inspect.isawaitable(result):
                result = await result
            return result
        if call.gone:
            raise _ClientGone("the client cancelled the call")
        raise DeadlineExceeded("the client's deadline passed before the request finished")

    async def _abort(self, context: Any, error: BaseException) -> NoReturn:
        status = grpc_status_for(error)
        if isinstance(error, _ClientGone):
            status = grpc.StatusCode.CANCELLED
        if isinstance(error, TrioInferError):
            message = self._state.models.public_message(error)
        else:
            message = f"internal error: {type(error).__name__}"
        if status == grpc.StatusCode.INTERNAL:
            log.error("gRPC call failed: %s: %s", type(error).__name__, error)
        await context.abort(status, message)
        raise AssertionError("unreachable: context.abort raises")  # pragma: no cover

    def unary(
        self, request_type: Any, method: Callable[[Any, Any, _Call], Awaitable[Any]]
    ) -> Callable[[bytes, Any], Awaitable[bytes]]:
        """A grpc.aio unary handler over raw bytes: parse, call *method*, map errors to statuses."""

        async def handle(raw: bytes, context: Any) -> bytes:
            try:
                request = _parse(request_type, raw)
                call = self._open(context)
                response = await method(request, context, call)
            except Exception as exc:  # every failure becomes a status, never a crash
                await self._abort(context, exc)
            data: bytes = response.SerializeToString()
            return data

        return handle

    # -- health and metadata --

    async def ServerLive(self, _request: Any, _context: Any, _call: _Call) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, _request: Any, _context: Any, _call: _Call) -> Any:
        return pb.ServerReadyResponse(ready=self._state.ready)

    async def ModelReady(self, request: Any, context: Any, call: _Call) -> Any:
        metadata = _metadata(context)

        def ready() -> bool:
            self._state.check_token(metadata, admin=False)
            try:
                self._state.models.resolve(request.name, request.version or None)
            except ModelNotFound:
                return False
            return True

        return pb.ModelReadyResponse(ready=await self._run(call, ready))

    async def ServerMetadata(self, _request: Any, _context: Any, _call: _Call) -> Any:
        return pb.ServerMetadataResponse(
            name="trioinfer", version=__version__, extensions=list(EXTENSIONS)
        )

    async def ModelMetadata(self, request: Any, context: Any, call: _Call) -> Any:
        metadata = _metadata(context)

        def document() -> dict[str, Any]:
            self._state.check_token(metadata, admin=False)
            served = self._state.models.resolve(request.name, request.version or None)
            return model_metadata_document(self._state, served, one_version=bool(request.version))

        return json_format.ParseDict(await self._run(call, document), pb.ModelMetadataResponse())

    async def ModelConfig(self, request: Any, context: Any, call: _Call) -> Any:
        metadata = _metadata(context)

        def document() -> dict[str, Any]:
            self._state.check_token(metadata, admin=False)
            served = self._state.models.resolve(request.name, request.version or None)
            return model_config_document(self._state, served)

        response = pb.ModelConfigResponse()
        # Keys Triton's ModelConfig lacks (trioinfer's own settings, devices) stay HTTP-only.
        document_ = await self._run(call, document)
        json_format.ParseDict(document_, response.config, ignore_unknown_fields=True)
        return response

    async def LogSettings(self, request: Any, context: Any, call: _Call) -> Any:
        metadata = _metadata(context)
        settings: dict[str, Any] = {}
        for key, value in request.settings.items():
            choice = value.WhichOneof("parameter_choice")
            if choice is None:
                raise RequestError(f"log setting {key!r} has no value")
            settings[key] = getattr(value, choice)

        async def apply() -> dict[str, Any]:
            self._state.check_token(metadata, admin=bool(settings))
            return await apply_log_settings(self._state, settings)

        response = pb.message("LogSettingsResponse")()
        for key, value in (await self._run(call, apply)).items():
            kind = (
                "bool_param"
                if isinstance(value, bool)
                else "uint32_param"
                if isinstance(value, int)
                else "string_param"
            )
            setattr(response.settings[key], kind, value)
        return response

    async def ModelStatistics(self, request: Any, context: Any, call: _Call) -> Any:
        metadata = _metadata(context)

        def document() -> dict[str, Any]:
            self._state.check_token(metadata, admin=False)
            return statistics_document(self._state, request.name or None, request.version or None)

        return json_format.ParseDict(await self._run(call, document), pb.ModelStatisticsResponse())

    # -- model repository --

    async def RepositoryIndex(self, request: Any, context: Any, call: _Call) -> Any:
        metadata = _metadata(context)

        def document() -> list[dict[str, Any]]:
            self._state.check_token(metadata, admin=False)
            return repository_index_document(self._state, ready_only=request.ready)

        return json_format.ParseDict(
            {"models": await self._run(call, document)}, pb.RepositoryIndexResponse()
        )

    async def RepositoryModelLoad(self, request: Any, context: Any, call: _Call) -> Any:
        metadata = _metadata(context)
        parameters = _repository_parameters(request.parameters)

        async def load() -> None:
            self._state.check_token(metadata, admin=True)
            override = load_override(parameters, self._state.config.limits)
            await self._state.models.load(request.model_name, override)

        await self._run(call, load)
        return pb.message("RepositoryModelLoadResponse")()

    async def RepositoryModelUnload(self, request: Any, context: Any, call: _Call) -> Any:
        metadata = _metadata(context)
        parameters = _repository_parameters(request.parameters)

        async def unload() -> None:
            self._state.check_token(metadata, admin=True)
            if set(parameters) - {"unload_dependents"}:
                raise RequestError("the only unload parameter is 'unload_dependents'")
            await self._state.models.unload(request.model_name)

        await self._run(call, unload)
        return pb.message("RepositoryModelUnloadResponse")()

    # -- shared memory --

    async def SystemSharedMemoryStatus(self, request: Any, context: Any, call: _Call) -> Any:
        return await self._regions(
            context, call, lambda: self._state.shm.status(request.name or None), "System"
        )

    async def _regions(
        self, context: Any, call: _Call, status: Callable[[], list[Any]], kind: str
    ) -> Any:
        # A shared-memory status call (System or Cuda): the token, then the registry's answer.
        metadata = _metadata(context)

        def regions() -> list[Any]:
            self._state.check_token(metadata, admin=False)
            return status()

        response = pb.message(f"{kind}SharedMemoryStatusResponse")()
        for region in await self._run(call, regions):
            json_format.ParseDict(attrs.asdict(region), response.regions[region.name])
        return response

    async def SystemSharedMemoryRegister(self, request: Any, context: Any, call: _Call) -> Any:
        metadata = _metadata(context)

        def register() -> None:
            self._state.check_token(metadata, admin=True)
            _one_process_only(self._state)
            self._state.shm.register(request.name, request.key, request.offset, request.byte_size)

        await self._run(call, register)
        return pb.message("SystemSharedMemoryRegisterResponse")()

    async def SystemSharedMemoryUnregister(self, request: Any, context: Any, call: _Call) -> Any:
        metadata = _metadata(context)

        def unregister() -> None:
            self._state.check_token(metadata, admin=True)
            self._state.shm.unregister(request.name or None)

        await self._run(call, unregister)
        return pb.message("SystemSharedMemoryUnregisterResponse")()

    async def CudaSharedMemoryStatus(self, request: Any, context: Any, call: _Call) -> Any:
        return await self._regions(
            context, call, lambda: self._state.shm.cuda_status(request.name or None), "Cuda"
        )

    async def CudaSharedMemoryRegister(self, request: Any, context: Any, call: _Call) -> Any:
        metadata = _metadata(context)

        def register() -> None:
            self._state.check_token(metadata, admin=True)
            _one_process_only(self._state)
            self._state.shm.register_cuda(
                request.name, request.raw_handle, request.device_id, request.byte_size
            )

        await self._run(call, register)
        return pb.message("CudaSharedMemoryRegisterResponse")()

    async def CudaSharedMemoryUnregister(self, request: Any, context: Any, call: _Call) -> Any:
        metadata = _metadata(context)

        def unregister() -> None:
            self._state.check_token(metadata, admin=True)
            self._state.shm.unregister_cuda(request.name or None)

        await self._run(call, unregister)
        return pb.message("CudaSharedMemoryUnregisterResponse")()

    # -- trace settings --

    async def TraceSetting(self, request: Any, context: Any, call: _Call) -> Any:
        """Triton's trace settings: read them (no settings), or change them, as HTTP does."""
        metadata = _metadata(context)
        model = request.model_name or None
        settings: dict[str, Any] | None = None
        if request.settings:
            # Each value is a list of strings (Triton's gRPC form); none clears the setting.
            settings = {
                name: list(value.value) if value.value else None
                for name, value in request.settings.items()
            }

        async def apply() -> dict[str, Any]:
            self._state.check_token(metadata, admin=settings is not None)
            return await trace_setting_document(self._state, model, settings)

        response = pb.message("TraceSettingResponse")()
        for name, value in (await self._run(call, apply)).items():
            response.settings[name].value.extend(value if isinstance(value, list) else [value])
        return response

    # -- inference --

    async def ModelInfer(self, request: Any, context: Any, call: _Call) -> Any:
        return await self._infer(request, _metadata(context), call)

    async def _infer(self, request: Any, metadata: Mapping[str, str], call: _Call) -> Any:
        parts = _infer_parts(request)
        answer = await self._run(call, self._traced_infer, request, parts, metadata)
        assert answer is not None  # without an emit nothing is streamed
        return _infer_response(*answer)

    async def _traced_infer(
        self,
        message: Any,
        parts: dict[str, Any],
        metadata: Mapping[str, str],
        emit: Callable[[Any], None] | None = None,
    ) -> tuple[Any, ...] | None:
        # In a server span parented by the call's traceparent metadata, when tracing is on.
        tracing = self._state.models.engine._tracing
        if tracing is None:
            return await self._infer_in_loop(message, parts, metadata, emit)
        return await tracing.serve_grpc(
            "ModelInfer" if emit is None else "ModelStreamInfer",
            metadata,
            message.model_name,
            message.model_version or None,
            lambda: self._infer_in_loop(message, parts, metadata, emit),
        )

    async def _infer_in_loop(
        self,
        message: Any,
        parts: dict[str, Any],
        metadata: Mapping[str, str],
        emit: Callable[[Any], None] | None = None,
    ) -> tuple[Any, ...] | None:
        """Answer one request; a decoupled model's responses go to *emit* (a stream), then None."""
        state = self._state
        model, version = message.model_name, message.model_version or None
        state.in_flight.value += 1
        try:
            if not state.ready:
                raise NotReady("the server is shutting down and takes no new requests")
            state.check_token(metadata, admin=False)
            served = state.models.resolve(model, version, key=metadata.get(ROUTING_KEY_HEADER))
            # The lease holds the regions the request names until its outputs are written.
            with state.shm.lease() as lease:
                request = decode_infer_parts(limits=state.config.limits, shm=lease, **parts)
                _check_outputs(request, served)
                priority, timeout = _schedule_parameters(request, served)
                order = [spec.name for spec in served.info.signature.outputs]
                try:
                    if emit is not None and served.info.decoupled:
                        await _stream(state, served, request, priority, timeout, order, emit, lease)
                        result = None
                    else:
                        result = await infer_in_time(state, served, request, priority, timeout)
                except anyio.get_cancelled_exc_class():
                    state.metrics.cancelled(served)
                    raise
                if result is not None:
                    outputs = encode_raw_outputs(
                        request, _classified(request, served, result.outputs), order, shm=lease
                    )
        except TrioInferError as exc:
            state.metrics.count(model, version, exc)
            raise
        finally:
            state.in_flight.value -= 1
        state.models.mark_inference(served)
        state.metrics.succeeded(served)
        if result is None:
            return None
        parameters = _fallback_parameters(state, served, result) if result.fallbacks else None
        return served.model, str(served.version), request.id, outputs, parameters

    async def ModelStreamInfer(self, requests: AsyncIterator[bytes], context: Any) -> Any:
        """Each request's responses, in order: one, or a decoupled model's stream of them.

        A failed request answers with its error_message and the stream goes on.
        """
        metadata = _metadata(context)
        call = self._open(context)
        async for raw in requests:
            try:
                request = _parse(pb.ModelInferRequest, raw)
                async for response in self._stream_request(request, metadata, call):
                    yield pb.ModelStreamInferResponse(infer_response=response).SerializeToString()
            except _ClientGone:
                return
            except Exception as exc:  # the stream goes on; this request's error goes back
                if isinstance(exc, TrioInferError):
                    text = self._state.models.public_message(exc)
                else:
                    log.exception("gRPC stream request failed", exc_info=exc)
                    text = f"internal error: {type(exc).__name__}"
                yield pb.ModelStreamInferResponse(error_message=text).SerializeToString()
                if isinstance(exc, DeadlineExceeded) and call.expires is not None:
                    return  # the stream's own deadline passed: nothing more can run

    async def _stream_request(
        self, request: Any, metadata: Mapping[str, str], call: _Call
    ) -> AsyncIterator[Any]:
        # The serving loop emits each response onto grpc.aio's loop as it comes; the
        # call's answer (None for a decoupled model) comes after the last of them.
        loop = asyncio.get_running_loop()
        responses: asyncio.Queue[Any] = asyncio.Queue()

        def emit(response: Any) -> None:
            if self._native:
                responses.put_nowait(response)
            else:
                loop.call_soon_threadsafe(responses.put_nowait, response)

        parts = _infer_parts(request)
        answer = asyncio.ensure_future(
            self._run(call, self._traced_infer, request, parts, metadata, emit)
        )
        try:
            while not answer.done():
                getter = asyncio.ensure_future(responses.get())
                await asyncio.wait({getter, answer}, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    yield getter.result()
                else:
                    getter.cancel()
            while not responses.empty():
                yield responses.get_nowait()
            result = answer.result()
            if result is not None:
                yield _infer_response(*result)
        finally:
            if not answer.done():  # the client left: the request (and generator) stops
                answer.cancel()
                with contextlib.suppress(BaseException):
                    await answer


async def _stream(
    state: ServerState,
    served: Any,
    request: Any,
    priority: int,
    timeout_s: float | None,
    order: list[str],
    emit: Callable[[Any], None],
    lease: Any,
) -> None:
    """Emit a decoupled model's responses, as Triton's gRPC stream sends them.

    With ``triton_enable_empty_final_response`` (tritonclient's
    ``enable_empty_final_response=True``) each response carries
    ``triton_final_response: false`` and an empty one with ``true`` ends the
    request's responses, as in Triton; without it the responses just stop.
    """
    final = request.parameters.get("triton_enable_empty_final_response") is True
    version = str(served.version)
    with anyio.move_on_after(timeout_s if timeout_s is not None else math.inf) as scope:
        async with state.models.engine.infer_stream(
            served.engine_name, request.inputs, priority=priority, request_id=request.id
        ) as responses:
            async for outputs in responses:
                encoded = encode_raw_outputs(request, outputs, order, shm=lease)
                response = _infer_response(served.model, version, request.id, encoded, None)
                if final:
                    response.parameters["triton_final_response"].bool_param = False
                emit(response)
    if scope.cancelled_caught:
        raise DeadlineExceeded(
            f"the request's timeout of {timeout_s} s passed before its last response"
        )
    if final:
        last = pb.ModelInferResponse(
            model_name=served.model, model_version=version, id=request.id or ""
        )
        last.parameters["triton_final_response"].bool_param = True
        emit(last)


# -- messages to plain values and back ----------------------------------------------------


def _parse(request_type: Any, raw: bytes) -> Any:
    try:
        return request_type.FromString(raw)
    except DecodeError as exc:
        raise RequestError(
            f"the request is not a valid {request_type.DESCRIPTOR.name} message: {exc}"
        ) from None


def _metadata(context: Any) -> dict[str, str]:
    # gRPC metadata keys are lower-case; binary ("-bin") values are no token or key.
    return {key: value for key, value in context.invocation_metadata() if isinstance(value, str)}


def _parameter(value: Any) -> Any:
    kind = value.WhichOneof("parameter_choice")
    return None if kind is None else getattr(value, kind)


def _repository_parameters(parameters: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in parameters.items():
        if value.WhichOneof("parameter_choice") == "bytes_param":
            raise RequestError(
                f"load parameter {key!r}: uploading model files is not supported; put them in "
                "the repository"
            )
        out[key] = _parameter(value)
    return out


#: Which typed contents field holds each datatype's values.
_CONTENTS: Final = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def _infer_parts(message: Any) -> dict[str, Any]:
    """A ModelInferRequest as the codec's plain parts (see `decode_infer_parts`)."""
    raw = list(message.raw_input_contents)
    inputs = []
    for tensor in message.inputs:
        item: dict[str, Any] = {
            "name": tensor.name,
            "datatype": tensor.datatype,
            "shape": list(tensor.shape),
        }
        if tensor.parameters:
            item["parameters"] = {k: _parameter(v) for k, v in tensor.parameters.items()}
        if "shared_memory_region" in item.get("parameters", {}):
            if tensor.contents.ListFields():
                raise RequestError(
                    f"input {tensor.name[:64]!r} is in shared memory and also has contents; "
                    "send its values one way"
                )
        elif not raw:
            item["data"] = _contents(tensor)
        elif tensor.contents.ListFields():
            raise RequestError(
                f"input {tensor.name[:64]!r} has contents, but the request sends "
                "raw_input_contents: send every input one way or the other"
            )
        inputs.append(item)
    outputs = [
        {"name": o.name, "parameters": {k: _parameter(v) for k, v in o.parameters.items()}}
        for o in message.outputs
    ]
    return {
        "request_id": message.id or None,
        "parameters": {k: _parameter(v) for k, v in message.parameters.items()},
        "inputs": inputs,
        "raw": raw,
        "outputs": outputs or None,
    }


def _contents(tensor: Any) -> list[Any]:
    where = f"input {tensor.name[:64]!r}"
    present = [field.name for field, _ in tensor.contents.ListFields()]
    expected = _CONTENTS.get(tensor.datatype)
    if not present:
        # An empty tensor may send no values at all.
        if 0 in tensor.shape:
            return []
        how = f"contents.{expected} or " if expected else ""
        raise RequestError(f"{where} has no values; send them in {how}raw_input_contents")
    if expected is None or present != [expected]:
        wanted = f"contents.{expected}" if expected else "raw_input_contents (no typed field)"
        raise RequestError(
            f"{where} is {tensor.datatype or 'without a datatype'} and takes {wanted}; it "
            f"sent {', '.join('contents.' + name for name in present)}"
        )
    values = list(getattr(tensor.contents, expected))
    if expected == "bytes_contents":
        try:
            return [value.decode("utf-8") for value in values]
        except UnicodeDecodeError:
            raise RequestError(
                f"{where}: a BYTES element is not valid UTF-8; this server hands BYTES to "
                "models as text (ONNX Runtime string tensors)"
            ) from None
    return values


def _infer_response(
    model: str,
    version: str,
    request_id: str | None,
    outputs: list[tuple[str, str, tuple[int, ...], bytes, dict[str, Any] | None]],
    parameters: Mapping[str, str] | None,
) -> Any:
    response = pb.ModelInferResponse(model_name=model, model_version=version, id=request_id or "")
    for name, datatype, shape, data, where in outputs:
        tensor = response.outputs.add()
        tensor.name = name
        tensor.datatype = datatype
        tensor.shape.extend(shape)
        for key, value in (where or {}).items():
            # An output written to shared memory says where; its raw entry stays empty.
            if isinstance(value, str):
                tensor.parameters[key].string_param = value
            else:
                tensor.parameters[key].int64_param = value
        response.raw_output_contents.append(data)
    for key, value in (parameters or {}).items():
        response.parameters[key].string_param = value
    return response


# -- the server ------------------------------------------------------------------------------


def _handlers(service: _Service) -> grpc.GenericRpcHandler:
    methods: dict[str, grpc.RpcMethodHandler] = {}
    for method in pb.FILE.services_by_name["GRPCInferenceService"].methods:
        request_type = message_factory.GetMessageClass(method.input_type)
        if method.client_streaming:
            methods[method.name] = grpc.stream_stream_rpc_method_handler(
                getattr(service, method.name)
            )
        else:
            methods[method.name] = grpc.unary_unary_rpc_method_handler(
                service.unary(request_type, getattr(service, method.name))
            )
    return grpc.method_handlers_generic_handler(pb.SERVICE, methods)


async def serve_grpc(
    state: ServerState,
    host: str,
    port: int,
    *,
    shutdown: anyio.Event,
    task_status: anyio.abc.TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve *state* over V2 gRPC on *host*:*port* until *shutdown* is set, then drain.

    Reports ``host:port`` (the bound port, for port 0) once listening. On
    *shutdown* new calls are refused and calls in progress get the drain
    period to finish; then they are cancelled, in the engine too. The gRPC
    server's thread has ended when this returns.

    Raises:
        OSError: The address cannot be bound.
    """
    limits = state.config.limits
    options = [
        # The same cap on a request as HTTP's max_body_bytes; answers are not capped.
        ("grpc.max_receive_message_length", limits.max_body_bytes),
        ("grpc.max_send_message_length", -1),
        # One server per port: never share it with another process.
        ("grpc.so_reuseport", 0),
        # Clients that keep idle connections alive with pings (tritonclient's
        # KeepAliveOptions) are not cut off for it.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ]
    send, receive = anyio.create_memory_object_stream[tuple[_Call, Any, tuple[Any, ...]]](math.inf)
    async with anyio.create_task_group() as group:
        # On asyncio, grpc.aio runs on this very loop; on Trio, on a loop in a thread.
        native = sniffio.current_async_library() == "asyncio"
        service = _Service(state, _Portal(send), native=native)
        group.start_soon(service.run_calls, receive, group)
        thread = _GrpcThread(_handlers(service), options, f"{_bracket(host)}:{port}")
        ended = anyio.Event()

        async def run_thread() -> None:
            try:
                if native:
                    await thread.serve()
                else:
                    # Not abandoned on cancel: the thread always ends before this task does.
                    await anyio.to_thread.run_sync(thread.run, abandon_on_cancel=False)
            finally:
                ended.set()

        group.start_soon(run_thread)
        try:
            bound = await anyio.to_thread.run_sync(thread.bound.result, abandon_on_cancel=True)
            address = f"{_bracket(host)}:{bound}"
            log.info("serving gRPC on %s", address)
            task_status.started(address)
            await shutdown.wait()
            thread.stop(state.config.drain_period)
            await ended.wait()
        finally:
            # Whatever still runs is cancelled (its client gets UNAVAILABLE), and the
            # gRPC thread has ended before the event loop may stop.
            thread.stop(0)
            send.close()
            group.cancel_scope.cancel()
    log.info("stopped serving gRPC")


@final
class _GrpcThread:
    """A grpc.aio server, on a loop of its own in a thread `serve_grpc` owns, or on asyncio's.

    `run` blocks a thread on a new asyncio loop (under Trio); `serve` runs on
    the running asyncio loop (under ``--loop asyncio``).
    """

    def __init__(self, handler: Any, options: list[tuple[str, Any]], address: str) -> None:
        self._handler = handler
        self._options = options
        self._address = address
        #: The bound port, or the reason binding failed.
        self.bound: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._grace: float | None = None
        self._lock = threading.Lock()

    def run(self) -> None:
        """Serve until `stop` (blocks the calling thread)."""
        try:
            asyncio.run(self.serve())
        finally:
            if not self.bound.done():  # pragma: no cover - serve reports before anything else
                self.bound.set_exception(OSError("the gRPC server did not start"))

    def stop(self, grace: float) -> None:
        """From any thread: refuse new calls, give calls in progress *grace* seconds, stop."""
        with self._lock:
            if self._grace is None or grace < self._grace:
                self._grace = grace
            if self._loop is not None and self._stop is not None:
                with contextlib.suppress(RuntimeError):  # its loop has closed: stopped already
                    self._loop.call_soon_threadsafe(self._stop.set)

    async def serve(self) -> None:
        """Serve until `stop`, on the running asyncio loop."""
        server = grpc.aio.server(options=self._options)
        server.add_generic_rpc_handlers((self._handler,))
        try:
            port = server.add_insecure_port(self._address)
        except RuntimeError:
            # grpcio's message only says to turn its debug log on; it logs the cause itself.
            self.bound.set_exception(
                OSError(
                    f"cannot listen for gRPC on {self._address}: the port is in use, or the "
                    "address is not one of this host's (--grpc-port, --host)"
                )
            )
            return
        stop = asyncio.Event()
        with self._lock:
            self._loop, self._stop = asyncio.get_running_loop(), stop
            stopped_early = self._grace is not None
        await server.start()
        self.bound.set_result(port)
        try:
            if not stopped_early:
                await stop.wait()
        finally:
            with anyio.CancelScope(shield=True):
                await server.stop(self._grace or 0)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
