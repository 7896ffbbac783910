"""The KServe V2 gRPC endpoint, as Triton serves it: ``inference.GRPCInferenceService``.

`serve_grpc` runs grpcio's server beside the HTTP one, in the same process,
on the same engine and `ServerState`: every answer comes from the functions
the HTTP routes use (``_app``, ``_codec``), so the two protocols cannot drift.

How grpcio meets the event loop: grpcio's own threaded server receives each
call on one of its worker threads; the thread turns the protobuf message into
plain values, hands the work to the event loop (`_Portal`, one
``run_sync_soon`` / ``call_soon_threadsafe``), and waits for the answer on a
`concurrent.futures.Future`. On the loop the work runs as a task of
`serve_grpc`'s own task group, under a cancel scope whose deadline is the
client's (``grpc-timeout``); a client that cancels or goes away makes grpcio
call the RPC's termination callback, which cancels that scope, and with it the
request in the engine. This works on Trio and on asyncio alike (``serve
--loop``); ``grpc.aio`` would need asyncio, and the bridge costs about as
much as one HTTP request's parsing (see docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
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
    _fallback_parameters,
    _schedule_parameters,
    infer_in_time,
    load_override,
    model_config_document,
    model_metadata_document,
    repository_index_document,
    statistics_document,
)
from ._codec import PayloadTooLarge, RequestError, decode_infer_parts, encode_raw_outputs
from ._errors import NotReady, Unauthorized

log = logging.getLogger("trioinfer.server")

#: grpcio worker threads: each call in progress holds one (a stream, for its whole life).
WORKERS: Final = 256

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


class _Unimplemented(TrioInferError):
    """A call this server does not implement (``UNIMPLEMENTED``)."""


# -- from grpcio's threads to the event loop -----------------------------------------


@final
class _Portal:
    """Hands work from grpcio's threads to the event loop, without waiting for it to start.

    The thread posts to a memory channel with one non-blocking hop onto the
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
        if self.future is not None and not self.future.done():
            self.future.set_exception(error)

    def cancel(self) -> None:
        """On the event loop: the client left; withdraw its request."""
        self.gone = True
        if self.scope is not None:
            self.scope.cancel()


# -- the service ------------------------------------------------------------------------


@final
class _Service:
    """The RPCs, each run on a grpcio worker thread."""

    def __init__(self, state: ServerState, portal: _Portal) -> None:
        self._state = state
        self._portal = portal

    # -- plumbing --

    def _open(self, context: grpc.ServicerContext) -> _Call:
        """Watch *context* for its client leaving; note its deadline."""
        remaining = context.time_remaining()
        expires = None
        if remaining is not None and remaining < _NO_DEADLINE:
            expires = time.monotonic() + remaining
        call = _Call(expires)

        def on_termination() -> None:
            # grpcio calls this when the RPC ends for any reason; only a call
            # still waiting for its answer needs cancelling.
            if call.future is not None and not call.future.done():
                self._portal.submit(call, None)

        context.add_callback(on_termination)
        return call

    def _run(self, call: _Call, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` (sync or async) on the event loop for *call*; return its result."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        call.future = future
        if not self._portal.submit(call, fn, *args):
            raise NotReady("the server is stopping and takes no new requests")
        return future.result()

    async def run_calls(
        self,
        receive: MemoryObjectReceiveStream[tuple[_Call, Any, tuple[Any, ...]]],
        group: anyio.abc.TaskGroup,
    ) -> None:
        """Start each call the threads hand over as a task of *group*; cancel a left one's."""
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
            future.set_result(await self._in_scope(call, fn, *args))
        except TrioInferError as exc:
            future.set_exception(exc)
        except Exception as exc:
            log.exception("gRPC call failed", exc_info=exc)
            future.set_exception(exc)
        finally:
            call.scope = None
            if not future.done():  # cancelled from outside: the server stops now
                future.set_exception(NotReady("the server stopped before the request finished"))

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

    def _abort(self, context: grpc.ServicerContext, error: BaseException) -> NoReturn:
        status = grpc_status_for(error)
        if isinstance(error, _ClientGone):
            status = grpc.StatusCode.CANCELLED
        elif isinstance(error, _Unimplemented):
            status = grpc.StatusCode.UNIMPLEMENTED
        if isinstance(error, TrioInferError):
            message = self._state.models.public_message(error)
        else:
            message = f"internal error: {type(error).__name__}"
        if status == grpc.StatusCode.INTERNAL:
            log.error("gRPC call failed: %s: %s", type(error).__name__, error)
        context.abort(status, message)
        raise AssertionError("unreachable: context.abort raises")  # pragma: no cover

    def unary(
        self, request_type: Any, method: Callable[[Any, grpc.ServicerContext, _Call], Any]
    ) -> Callable[[bytes, grpc.ServicerContext], bytes]:
        """A grpcio unary handler over raw bytes: parse, call *method*, map errors to statuses."""

        def handle(raw: bytes, context: grpc.ServicerContext) -> bytes:
            try:
                request = _parse(request_type, raw)
                call = self._open(context)
                response = method(request, context, call)
            except Exception as exc:  # every failure becomes a status, never a crash
                self._abort(context, exc)
            data: bytes = response.SerializeToString()
            return data

        return handle

    # -- health and metadata --

    def ServerLive(self, _request: Any, _context: Any, _call: _Call) -> Any:
        return pb.ServerLiveResponse(live=True)

    def ServerReady(self, _request: Any, _context: Any, _call: _Call) -> Any:
        return pb.ServerReadyResponse(ready=self._state.ready)

    def ModelReady(self, request: Any, context: Any, call: _Call) -> Any:
        metadata = _metadata(context)

        def ready() -> bool:
            self._state.check_token(metadata, admin=False)
            try:
                self._state.models.resolve(request.name, request.version or None)
            except ModelNotFound:
                return False
            return True

        return pb.ModelReadyResponse(ready=self._run(call, ready))

    def ServerMetadata(self, _request: Any, _context: Any, _call: _Call) -> Any:
        return pb.ServerMetadataResponse(
            name="trioinfer", version=__version__, extensions=list(EXTENSIONS)
        )

    def ModelMetadata(self, request: Any, context: Any, call: _Call) -> Any:
        metadata = _metadata(context)

        def document() -> dict[str, Any]:
            self._state.check_token(metadata, admin=False)
            served = self._state.models.resolve(request.name, request.version or None)
            return model_metadata_document(self._state, served, one_version=bool(request.version))

        return json_format.ParseDict(self._run(call, document), pb.ModelMetadataResponse())

    def ModelConfig(self, request: Any, context: Any, call: _Call) -> Any:
        metadata = _metadata(context)

        def document() -> dict[str, Any]:
            self._state.check_token(metadata, admin=False)
            served = self._state.models.resolve(request.name, request.version or None)
            return model_config_document(self._state, served)

        response = pb.ModelConfigResponse()
        # Keys Triton's ModelConfig lacks (trioinfer's own settings, devices) stay HTTP-only.
        document_ = self._run(call, document)
        json_format.ParseDict(document_, response.config, ignore_unknown_fields=True)
        return response

    def ModelStatistics(self, request: Any, context: Any, call: _Call) -> Any:
        metadata = _metadata(context)

        def document() -> dict[str, Any]:
            self._state.check_token(metadata, admin=False)
            return statistics_document(self._state, request.name or None, request.version or None)

        return json_format.ParseDict(self._run(call, document), pb.ModelStatisticsResponse())

    # -- model repository --

    def RepositoryIndex(self, request: Any, context: Any, call: _Call) -> Any:
        metadata = _metadata(context)

        def document() -> list[dict[str, Any]]:
            self._state.check_token(metadata, admin=False)
            return repository_index_document(self._state, ready_only=request.ready)

        return json_format.ParseDict(
            {"models": self._run(call, document)}, pb.RepositoryIndexResponse()
        )

    def RepositoryModelLoad(self, request: Any, context: Any, call: _Call) -> Any:
        metadata = _metadata(context)
        parameters = _repository_parameters(request.parameters)

        async def load() -> None:
            self._state.check_token(metadata, admin=True)
            override = load_override(parameters, self._state.config.limits)
            await self._state.models.load(request.model_name, override)

        self._run(call, load)
        return pb.message("RepositoryModelLoadResponse")()

    def RepositoryModelUnload(self, request: Any, context: Any, call: _Call) -> Any:
        metadata = _metadata(context)
        parameters = _repository_parameters(request.parameters)

        async def unload() -> None:
            self._state.check_token(metadata, admin=True)
            if set(parameters) - {"unload_dependents"}:
                raise RequestError("the only unload parameter is 'unload_dependents'")
            await self._state.models.unload(request.model_name)

        self._run(call, unload)
        return pb.message("RepositoryModelUnloadResponse")()

    # -- shared memory --

    def _no_shared_memory(self, _request: Any, _context: Any, _call: _Call) -> Any:
        raise _Unimplemented(
            "shared memory is not supported by this server yet; send tensors in the request "
            "(raw_input_contents)"
        )

    SystemSharedMemoryStatus = _no_shared_memory
    SystemSharedMemoryRegister = _no_shared_memory
    SystemSharedMemoryUnregister = _no_shared_memory

    def _no_cuda_memory(self, _request: Any, _context: Any, _call: _Call) -> Any:
        raise _Unimplemented(
            "CUDA shared memory is not supported on this server; send tensors in the request "
            "(raw_input_contents)"
        )

    CudaSharedMemoryStatus = _no_cuda_memory
    CudaSharedMemoryRegister = _no_cuda_memory
    CudaSharedMemoryUnregister = _no_cuda_memory

    # -- inference --

    def ModelInfer(self, request: Any, context: Any, call: _Call) -> Any:
        return self._infer(request, _metadata(context), call)

    def _infer(self, request: Any, metadata: Mapping[str, str], call: _Call) -> Any:
        parts = _infer_parts(request)
        answer = self._run(call, self._infer_in_loop, request, parts, metadata)
        return _infer_response(*answer)

    async def _infer_in_loop(
        self, message: Any, parts: dict[str, Any], metadata: Mapping[str, str]
    ) -> tuple[Any, ...]:
        state = self._state
        model, version = message.model_name, message.model_version or None
        state.in_flight.value += 1
        try:
            if not state.ready:
                raise NotReady("the server is shutting down and takes no new requests")
            state.check_token(metadata, admin=False)
            served = state.models.resolve(model, version, key=metadata.get(ROUTING_KEY_HEADER))
            request = decode_infer_parts(limits=state.config.limits, **parts)
            _check_outputs(request, served)
            priority, timeout = _schedule_parameters(request)
            try:
                result = await infer_in_time(state, served, request, priority, timeout)
            except anyio.get_cancelled_exc_class():
                state.metrics.cancelled(served)
                raise
        except TrioInferError as exc:
            state.metrics.count(model, version, exc)
            raise
        finally:
            state.in_flight.value -= 1
        state.models.mark_inference(served)
        state.metrics.succeeded(served)
        outputs = encode_raw_outputs(
            request, result.outputs, [spec.name for spec in served.info.signature.outputs]
        )
        parameters = _fallback_parameters(state, served, result) if result.fallbacks else None
        return served.model, str(served.version), request.id, outputs, parameters

    def ModelStreamInfer(
        self, requests: Iterator[bytes], context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        """One response per request, in order; a failed request answers with its error_message."""
        metadata = _metadata(context)
        call = self._open(context)
        for raw in requests:
            try:
                request = _parse(pb.ModelInferRequest, raw)
                response = self._infer(request, metadata, call)
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
            else:
                yield pb.ModelStreamInferResponse(infer_response=response).SerializeToString()


# -- messages to plain values and back ----------------------------------------------------


def _parse(request_type: Any, raw: bytes) -> Any:
    try:
        return request_type.FromString(raw)
    except DecodeError as exc:
        raise RequestError(
            f"the request is not a valid {request_type.DESCRIPTOR.name} message: {exc}"
        ) from None


def _metadata(context: grpc.ServicerContext) -> dict[str, str]:
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
        if not raw:
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
    outputs: list[tuple[str, str, tuple[int, ...], bytes]],
    parameters: Mapping[str, str] | None,
) -> Any:
    response = pb.ModelInferResponse(model_name=model, model_version=version, id=request_id or "")
    for name, datatype, shape, data in outputs:
        tensor = response.outputs.add()
        tensor.name = name
        tensor.datatype = datatype
        tensor.shape.extend(shape)
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
    period to finish; then they are cancelled, in the engine too.

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
    executor = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="trioinfer-grpc")
    send, receive = anyio.create_memory_object_stream[tuple[_Call, Any, tuple[Any, ...]]](math.inf)
    async with anyio.create_task_group() as group:
        service = _Service(state, _Portal(send))
        group.start_soon(service.run_calls, receive, group)
        server = grpc.server(executor, options=options)
        server.add_generic_rpc_handlers((_handlers(service),))
        try:
            bound = server.add_insecure_port(f"{_bracket(host)}:{port}")
        except RuntimeError as exc:
            executor.shutdown(wait=False)
            raise OSError(f"cannot listen for gRPC on {host}:{port}: {exc}") from None
        server.start()
        address = f"{_bracket(host)}:{bound}"
        log.info("serving gRPC on %s", address)
        try:
            task_status.started(address)
            await shutdown.wait()
            drained = server.stop(state.config.drain_period)
            await anyio.to_thread.run_sync(drained.wait)
        finally:
            # Whatever still runs is cancelled (its thread then answers UNAVAILABLE),
            # and every grpcio thread has finished before the event loop may stop.
            send.close()
            group.cancel_scope.cancel()
            with anyio.CancelScope(shield=True):
                server.stop(0)
                await anyio.to_thread.run_sync(executor.shutdown)
    log.info("stopped serving gRPC")


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
