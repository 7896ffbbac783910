"""The KServe V2 gRPC endpoint, as Triton serves it: ``inference.GRPCInferenceService``.

`serve_grpc` serves gRPC beside the HTTP server, in the same
process, on the same engine and `ServerState`: every answer comes from the
functions the HTTP routes use (``_app``, ``_codec``), so the two protocols
cannot drift.

How gRPC is served. There is no grpcio server: `_grpc_h2` speaks gRPC over
HTTP/2 (its own frame layer, ``_http2``, with python-hyper's ``hpack``) on
the serving loop itself, Trio or asyncio, one task per connection and one
running each call (on Trio a task runs a connection's calls one after
another), so a call's handler runs the request directly, under a cancel
scope whose deadline is the client's (``grpc-timeout``); a client that
cancels (RST_STREAM) or goes away cancels the call's scope, and with it the
request in the engine. A ``ModelStreamInfer`` call runs its requests side by
side, each in a task of the call's own, as Triton's stream does
(`_Service.ModelStreamInfer`). grpc.aio (on a loop in a thread, bridged to Trio) and
grpcio's threaded server were served before and cost two to three times as
much server CPU per call, and python-hyper's ``h2`` after them twice as much
(docs/reference/server.md, benchmarks/RESULTS.md).
"""

from __future__ import annotations

import inspect
import logging
import math
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Final, final

import anyio
import anyio.abc
import attrs
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
from .._request import Parameter
from .._stream import STREAM_AHEAD
from . import _grpc_h2 as status
from . import _grpc_proto as pb
from ._app import (
    RESERVED_PARAMETERS,
    ROUTING_KEY_HEADER,
    ServerState,
    _check_outputs,
    _classified,
    _one_process_only,
    _schedule_parameters,
    apply_log_settings,
    extensions,
    infer_in_time,
    load_model,
    load_override,
    model_config_document,
    model_metadata_document,
    not_ready,
    repository_index_document,
    requested_names,
    response_parameters,
    send_whole,
    statistics_document,
    stream_sequence,
    trace_setting_document,
    unload_model,
    with_headers,
)
from ._codec import (
    InferRequest,
    Limits,
    PayloadTooLarge,
    RawOutput,
    RequestError,
    _from_binary,
    _Input,
    decode_infer_parts,
    encode_raw_outputs,
    raw_output_encoder,
)
from ._errors import NotReady, Unauthorized
from ._forward import forward_regex, forwarded_headers
from ._grpc_h2 import GrpcCall, GrpcError, GrpcServer, Method, Send
from ._http2 import ProtocolError
from ._models import ServedVersion
from ._tls import ReloadingContext, handshake

log = logging.getLogger("trioinfer.server")

_STATUS: Final[tuple[tuple[type[BaseException], int], ...]] = (
    (PayloadTooLarge, status.RESOURCE_EXHAUSTED),
    (Unauthorized, status.UNAUTHENTICATED),
    (ModelNotFound, status.NOT_FOUND),
    (InvalidInput, status.INVALID_ARGUMENT),  # RequestError too
    (ConfigError, status.INVALID_ARGUMENT),
    (PluginContractError, status.INTERNAL),
    (QueueFull, status.UNAVAILABLE),
    (CircuitOpen, status.UNAVAILABLE),
    (BackendUnavailable, status.UNAVAILABLE),
    (EngineClosed, status.UNAVAILABLE),
    (NotReady, status.UNAVAILABLE),
    (DeadlineExceeded, status.DEADLINE_EXCEEDED),
)


def grpc_status_for(error: BaseException) -> int:
    """The gRPC status code (an integer) for an error raised while serving a call.

    The only such mapping, onto `_grpc_h2`'s table of codes.

    The same classes as `status_for` gives HTTP statuses, in Triton's gRPC
    terms: a client's fault is ``INVALID_ARGUMENT``, an unknown model
    ``NOT_FOUND``, a full queue or a stopping server ``UNAVAILABLE``, a
    passed deadline ``DEADLINE_EXCEEDED``, anything else ``INTERNAL``.
    """
    for kind, code in _STATUS:
        if isinstance(error, kind):
            return code
    return status.INTERNAL


class _ClientGone(TrioInferError):
    """The client cancelled the call or went away: nobody is left to answer."""


class _CallExpired(DeadlineExceeded):
    """The call's own deadline (``grpc-timeout``) passed, not a request's ``timeout``."""


#: How long before its deadline a call that ends is taken to have ended by it. grpcio
#: resets its stream when its own deadline passes, which it counted from before the
#: request left: the reset may come a little before the deadline as the server counts it.
_DEADLINE_SLACK_S: Final = 0.05


def _deadline_passed(expires: float | None) -> bool:
    """Whether a call's deadline (`GrpcCall.expires`) passed, or all but (`_DEADLINE_SLACK_S`)."""
    return expires is not None and time.monotonic() >= expires - _DEADLINE_SLACK_S


# -- the service ------------------------------------------------------------------------


@final
class _Service:
    """The RPCs: each runs in its call's own task on the serving loop."""

    def __init__(self, state: ServerState) -> None:
        self._state = state
        self._forward = forward_regex(
            state.config.grpc_header_forward_pattern, option="grpc_header_forward_pattern"
        )

    # -- plumbing --

    async def _run(self, call: GrpcCall, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` (sync or async) for *call*, under the client's deadline."""
        if call.gone:
            raise _ClientGone("the client left before its request started")
        if call.expires is None:  # no deadline: no scope of its own to pay for
            result = fn(*args)
            return await result if inspect.isawaitable(result) else result
        with anyio.CancelScope() as scope:
            scope.deadline = anyio.current_time() + (call.expires - time.monotonic())
            result = fn(*args)
            if inspect.isawaitable(result):
                result = await result
            return result
        raise _CallExpired("the client's deadline passed before the request finished")

    def _error(self, error: BaseException) -> GrpcError:
        code = grpc_status_for(error)
        if isinstance(error, _ClientGone):
            code = status.CANCELLED
        if isinstance(error, TrioInferError):
            message = self._state.models.public_message(error)
        else:
            message = f"internal error: {type(error).__name__}"
        if code == status.INTERNAL:
            log.error("gRPC call failed: %s: %s", type(error).__name__, error)
        return GrpcError(code, message)

    def unary(
        self, request_type: Any, method: Callable[[Any, Any, GrpcCall], Awaitable[Any]]
    ) -> Callable[[bytes, GrpcCall], Awaitable[bytes]]:
        """A unary handler over raw bytes: parse, call *method*, map errors to statuses."""

        async def handle(raw: bytes, call: GrpcCall) -> bytes:
            try:
                request = _parse(request_type, raw)
                response = await method(request, call, call)
            except Exception as exc:  # every failure becomes a status, never a crash
                raise self._error(exc) from None
            data: bytes = response.SerializeToString()
            return data

        return handle

    # -- health and metadata --

    async def ServerLive(self, _request: Any, _context: Any, _call: GrpcCall) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, _request: Any, _context: Any, _call: GrpcCall) -> Any:
        return pb.ServerReadyResponse(ready=not_ready(self._state) is None)

    async def ModelReady(self, request: Any, context: Any, call: GrpcCall) -> Any:
        metadata = _metadata(context)

        def ready() -> bool:
            self._state.check_token(metadata, admin=False)
            try:
                served = self._state.models.resolve(request.name, request.version or None)
            except ModelNotFound:
                return False
            return self._state.models.not_ready(served) is None

        return pb.ModelReadyResponse(ready=await self._run(call, ready))

    async def ServerMetadata(self, _request: Any, _context: Any, _call: GrpcCall) -> Any:
        return pb.ServerMetadataResponse(
            name="trioinfer", version=__version__, extensions=extensions(self._state)
        )

    async def ModelMetadata(self, request: Any, context: Any, call: GrpcCall) -> Any:
        metadata = _metadata(context)

        def document() -> dict[str, Any]:
            self._state.check_token(metadata, admin=False)
            served = self._state.models.resolve(request.name, request.version or None)
            return model_metadata_document(self._state, served, one_version=bool(request.version))

        return json_format.ParseDict(await self._run(call, document), pb.ModelMetadataResponse())

    async def ModelConfig(self, request: Any, context: Any, call: GrpcCall) -> Any:
        metadata = _metadata(context)

        def document() -> dict[str, Any]:
            self._state.check_token(metadata, admin=False)
            served = self._state.models.resolve(request.name, request.version or None)
            return model_config_document(self._state, served)

        response = pb.ModelConfigResponse()
        # The document is Triton's ModelConfig as JSON (trioinfer's settings among its
        # parameters): parsed strictly, a key it lacks is a bug here, not a dropped field.
        document_ = await self._run(call, document)
        json_format.ParseDict(document_, response.config)
        return response

    async def LogSettings(self, request: Any, context: Any, call: GrpcCall) -> Any:
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

    async def ModelStatistics(self, request: Any, context: Any, call: GrpcCall) -> Any:
        metadata = _metadata(context)

        async def document() -> dict[str, Any]:
            self._state.check_token(metadata, admin=False)
            return await statistics_document(
                self._state, request.name or None, request.version or None
            )

        return json_format.ParseDict(await self._run(call, document), pb.ModelStatisticsResponse())

    # -- model repository --

    async def RepositoryIndex(self, request: Any, context: Any, call: GrpcCall) -> Any:
        metadata = _metadata(context)

        def document() -> list[dict[str, Any]]:
            self._state.check_token(metadata, admin=False)
            return repository_index_document(self._state, ready_only=request.ready)

        return json_format.ParseDict(
            {"models": await self._run(call, document)}, pb.RepositoryIndexResponse()
        )

    async def RepositoryModelLoad(self, request: Any, context: Any, call: GrpcCall) -> Any:
        metadata = _metadata(context)
        parameters = _repository_parameters(request.parameters)

        async def load() -> None:
            self._state.check_token(metadata, admin=True)
            override = load_override(parameters, self._state.config.limits)
            await load_model(self._state, request.model_name, override)

        await self._run(call, load)
        return pb.message("RepositoryModelLoadResponse")()

    async def RepositoryModelUnload(self, request: Any, context: Any, call: GrpcCall) -> Any:
        metadata = _metadata(context)
        parameters = _repository_parameters(request.parameters)

        async def unload() -> None:
            self._state.check_token(metadata, admin=True)
            if set(parameters) - {"unload_dependents"}:
                raise RequestError("the only unload parameter is 'unload_dependents'")
            await unload_model(self._state, request.model_name)

        await self._run(call, unload)
        return pb.message("RepositoryModelUnloadResponse")()

    # -- shared memory --

    async def SystemSharedMemoryStatus(self, request: Any, context: Any, call: GrpcCall) -> Any:
        return await self._regions(
            context, call, lambda: self._state.shm.status(request.name or None), "System"
        )

    async def _regions(
        self, context: Any, call: GrpcCall, status: Callable[[], list[Any]], kind: str
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

    async def SystemSharedMemoryRegister(self, request: Any, context: Any, call: GrpcCall) -> Any:
        metadata = _metadata(context)

        def register() -> None:
            self._state.check_token(metadata, admin=True)
            _one_process_only(self._state)
            self._state.shm.register(request.name, request.key, request.offset, request.byte_size)

        await self._run(call, register)
        return pb.message("SystemSharedMemoryRegisterResponse")()

    async def SystemSharedMemoryUnregister(self, request: Any, context: Any, call: GrpcCall) -> Any:
        metadata = _metadata(context)

        def unregister() -> None:
            self._state.check_token(metadata, admin=True)
            self._state.shm.unregister(request.name or None)

        await self._run(call, unregister)
        return pb.message("SystemSharedMemoryUnregisterResponse")()

    async def CudaSharedMemoryStatus(self, request: Any, context: Any, call: GrpcCall) -> Any:
        return await self._regions(
            context, call, lambda: self._state.shm.cuda_status(request.name or None), "Cuda"
        )

    async def CudaSharedMemoryRegister(self, request: Any, context: Any, call: GrpcCall) -> Any:
        metadata = _metadata(context)

        def register() -> None:
            self._state.check_token(metadata, admin=True)
            _one_process_only(self._state)
            self._state.shm.register_cuda(
                request.name, request.raw_handle, request.device_id, request.byte_size
            )

        await self._run(call, register)
        return pb.message("CudaSharedMemoryRegisterResponse")()

    async def CudaSharedMemoryUnregister(self, request: Any, context: Any, call: GrpcCall) -> Any:
        metadata = _metadata(context)

        def unregister() -> None:
            self._state.check_token(metadata, admin=True)
            self._state.shm.unregister_cuda(request.name or None)

        await self._run(call, unregister)
        return pb.message("CudaSharedMemoryUnregisterResponse")()

    # -- trace settings --

    async def TraceSetting(self, request: Any, context: Any, call: GrpcCall) -> Any:
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

    def infer_handler(self) -> Callable[[bytes, GrpcCall], Awaitable[bytes]]:
        """ModelInfer over raw bytes: a request laid out as one seen before skips its checks.

        The request's bytes but for its id and raw_input_contents are the key of
        a plan (`_Plan`) that holds what they decoded to; each request's own raw
        contents are still cut by the plan's sizes, and BOOL data checked. Any
        other request, or one whose contents do not fit, goes the long way.
        """
        state = self._state

        async def handle(raw: bytes, call: GrpcCall) -> bytes:
            try:
                split = _wire_split(raw)
                planned = None
                if split is not None:
                    key, request_id, contents = split
                    plan = _PLANS.get(key)
                    if (
                        plan is not None
                        and plan.limits is state.config.limits
                        and plan.fits(contents)
                    ):
                        planned = _Planned(plan, contents, request_id)
                message: Any
                parts: dict[str, Any] | _Planned
                if planned is not None:
                    message = parts = planned
                else:
                    message = _parse(pb.ModelInferRequest, raw)
                    parts = _infer_parts(message)
                    if split is not None:
                        parts["plan_key"] = split[0]
                if call.expires is None and state.models.engine._tracing is None and not call.gone:
                    # As `_infer`, one coroutine frame fewer on every resume.
                    answer = await self._infer_in_loop(message, parts, _metadata(call))
                    assert answer is not None
                else:
                    answer = await self._infer(message, parts, call)
            except Exception as exc:  # every failure becomes a status, never a crash
                raise self._error(exc) from None
            return _response_bytes(*answer)

        return handle

    async def _infer(
        self, message: Any, parts: dict[str, Any] | _Planned, call: GrpcCall
    ) -> tuple[Any, ...]:
        metadata = _metadata(call)
        if call.expires is None and self._state.models.engine._tracing is None and not call.gone:
            # The usual call (no deadline, tracing off): what `_run` and `_traced_infer`
            # would do, without their two coroutine frames on every resume.
            answer = await self._infer_in_loop(message, parts, metadata)
        else:
            answer = await self._run(
                call, self._traced_infer, message, parts, metadata, None, call.expires
            )
        assert answer is not None  # without an emit nothing is streamed
        return answer

    async def ModelInfer(self, request: Any, context: Any, call: GrpcCall) -> Any:
        # Served by `infer_handler`; kept for the service's full set of methods.
        return _infer_response(*await self._infer(request, _infer_parts(request), context))

    async def _traced_infer(
        self,
        message: Any,
        parts: dict[str, Any] | _Planned,
        metadata: Mapping[str, str],
        stream: _StreamState | None = None,
        expires: float | None = None,
    ) -> tuple[Any, ...] | None:
        # In a server span parented by the call's traceparent metadata, when tracing is on.
        tracing = self._state.models.engine._tracing
        if tracing is None:
            return await self._infer_in_loop(message, parts, metadata, stream, expires)
        return await tracing.serve_grpc(
            "ModelInfer" if stream is None else "ModelStreamInfer",
            metadata,
            message.model_name,
            message.model_version or None,
            lambda: self._infer_in_loop(message, parts, metadata, stream, expires),
        )

    async def _infer_in_loop(
        self,
        message: Any,
        parts: dict[str, Any] | _Planned,
        metadata: Mapping[str, str],
        stream: _StreamState | None = None,
        expires: float | None = None,
    ) -> tuple[Any, ...] | None:
        """Answer one request; a decoupled model's responses go to *stream* (a call's), then None.

        *expires* is the call's deadline (`GrpcCall.expires`): a request
        cancelled once it passed is counted as expired, as an HTTP request
        whose timeout passed is, not as one whose client left.
        """
        state = self._state
        model, version = message.model_name, message.model_version or None
        picked: ServedVersion | None = None  # the version it went to, once picked
        state.in_flight.grpc += 1
        try:
            if not state.ready:
                raise NotReady("the server is shutting down and takes no new requests")
            state.check_token(metadata, admin=False)
            served = state.models.resolve(model, version, key=metadata.get(ROUTING_KEY_HEADER))
            tracing = state.models.engine._tracing
            if tracing is not None:  # the server span says which version answered, as HTTP's
                tracing.served_version(served.version)
            # The lease holds the regions the request names until its outputs are written.
            with state.shm.lease() as lease:
                if isinstance(parts, _Planned):
                    request = parts.decode()
                else:
                    key = parts.pop("plan_key", None)
                    request = decode_infer_parts(limits=state.config.limits, shm=lease, **parts)
                    if key is not None:
                        _remember(key, parts, request, state.config.limits, message)
                picked = served  # read as a request: its errors count on *served* (as HTTP's)
                _check_outputs(request, served)
                priority, timeout = _schedule_parameters(request, served)
                order = [spec.name for spec in served.info.signature.outputs]
                try:
                    forwarded = (
                        forwarded_headers(self._forward, metadata.items(), RESERVED_PARAMETERS)
                        if self._forward is not None
                        else None
                    )
                    if stream is not None and served.info.decoupled:
                        stream_sequence(served, request.parameters)  # refused there
                        await _stream(
                            state,
                            served,
                            request,
                            priority,
                            timeout,
                            order,
                            stream,
                            lease,
                            forwarded,
                        )
                        result = None
                    else:
                        result = await infer_in_time(
                            state, served, request, priority, timeout, forwarded
                        )
                except anyio.get_cancelled_exc_class():
                    if _deadline_passed(expires):
                        state.metrics.expired(served)
                    else:
                        state.metrics.cancelled(served)
                    raise
                if result is not None:
                    # Views of the outputs' arrays: copied once, into the answer's bytes
                    # (`_response_bytes`, or the protobuf message), as soon as this returns.
                    outputs = encode_raw_outputs(
                        request,
                        _classified(request, served, result.outputs),
                        order,
                        shm=lease,
                        copy=False,
                    )
        except TrioInferError as exc:
            state.metrics.count(model, version, exc, picked)
            raise
        finally:
            state.in_flight.grpc -= 1
        state.models.mark_inference(served)
        state.metrics.succeeded(served)
        if result is None:
            return None
        return (
            served.model,
            str(served.version),
            request.id,
            outputs,
            response_parameters(state, served, result),
        )

    async def ModelStreamInfer(
        self,
        requests: AsyncIterator[bytes],
        call: GrpcCall,
        send: Send,
    ) -> None:
        """Each request run as it arrives, beside the stream's others, as Triton's stream does.

        The requests are read in order and each starts in a task of the call's
        own as soon as it is read; responses go back as they are ready (each
        carries its request's id), so one stream may answer out of order.
        At most `STREAM_CONCURRENCY` of a stream's requests run at once: past
        it no further request is read until one ends, and HTTP/2 flow control
        holds the client. Requests naming one sequence (``sequence_id``) of a
        model run one after another, in the order they came, since a sequence
        batcher takes them in order of arrival. A decoupled model's responses
        to one request go in their order. A failed request answers with its
        error_message (and its id, as Triton's) and the stream goes on; the
        client going away or the call's deadline cancels every request in
        flight, while a request's own ``timeout`` ends that request only.
        """
        metadata = _metadata(call)
        stream = _StreamState(send)
        try:
            async with anyio.create_task_group() as group:
                async for raw in requests:
                    await stream.slots.acquire()
                    try:
                        request = _parse(pb.ModelInferRequest, raw)
                    except RequestError as exc:
                        stream.slots.release()
                        await stream.send(self._stream_error(exc, ""))
                        continue
                    key = _sequence_key(request)
                    after = stream.tails.get(key) if key is not None else None
                    done = None
                    if key is not None:
                        stream.tails[key] = done = anyio.Event()
                    group.start_soon(
                        self._stream_one, request, metadata, call, stream, key, after, done
                    )
        except* ProtocolError as failed:
            # The stream or connection closed under an answer: the transport's own end.
            raise failed.exceptions[0] from None

    async def _stream_one(
        self,
        request: Any,
        metadata: Mapping[str, str],
        call: GrpcCall,
        stream: _StreamState,
        key: tuple[str, int | str] | None,
        after: anyio.Event | None,
        done: anyio.Event | None,
    ) -> None:
        # One request of a stream, in its own task of the call's task group.
        try:
            if after is not None:
                await after.wait()  # the sequence's previous request, ended
            await self._stream_request(request, metadata, call, stream)
        except Exception as exc:  # the stream goes on; this request's error goes back
            if not isinstance(exc, TrioInferError):
                log.exception("gRPC stream request failed", exc_info=exc)
            await stream.send(self._stream_error(exc, request.id))
        finally:
            stream.slots.release()
            if key is not None and done is not None:  # (both, or neither)
                done.set()
                if stream.tails.get(key) is done:  # the sequence's last request read
                    del stream.tails[key]

    def _stream_error(self, error: BaseException, request_id: str) -> bytes:
        """A failed stream request's response: its error_message, and its id, as Triton's.

        Triton's stream handler clears the response and sets the request's id
        on it ("so that client knows which request failed"): with requests in
        flight side by side, the id is how a client tells which one failed.
        """
        if isinstance(error, TrioInferError):
            text = self._state.models.public_message(error)
        else:
            text = f"internal error: {type(error).__name__}"
        data: bytes = pb.ModelStreamInferResponse(
            error_message=text, infer_response=pb.ModelInferResponse(id=request_id)
        ).SerializeToString()
        return data

    async def _stream_request(
        self,
        request: Any,
        metadata: Mapping[str, str],
        call: GrpcCall,
        stream: _StreamState,
    ) -> None:
        # Responses are sent as they come, in the request's own task: a client that
        # reads slower than the model answers holds the model's generator back
        # (HTTP/2 flow control) once its stream's buffer is full (`_StreamState.lend`:
        # the call's requests share a bound), instead of its responses piling up here.
        parts = _infer_parts(request)
        # No scope of its own for the call's deadline: the call's task group is under
        # it already (`_grpc_h2`), and its passing ends the whole stream.
        result = await self._traced_infer(request, parts, metadata, stream, call.expires)
        if result is not None:
            model, version, request_id, outputs, given = result
            asked = request.parameters.get("triton_enable_empty_final_response")
            if asked is not None and _parameter(asked) is True:
                # A model that is not decoupled: its one response is also its last, and
                # says so as Triton's does; a client reading until the flag would wait
                # forever for an empty final response that never comes.
                given = {**(given or {}), **_FINAL}
            await stream.send(_stream_response(model, version, request_id, outputs, given))


#: The most requests of one ModelStreamInfer call that run at once: as many as one
#: connection runs calls (`_grpc_h2`'s ``max_streams``), so that a stream holds no more
#: than the same client could with unary calls. Past it the stream reads no further
#: request until one ends, and HTTP/2 flow control then holds the client.
STREAM_CONCURRENCY: Final = 1024
#: The responses a ModelStreamInfer call's decoupled requests may have made ahead of its
#: writer between them, beyond one each (`_StreamState.lend`): with STREAM_CONCURRENCY
#: requests in flight, at most 2,048 wait in the engine's buffers (and at most as many in
#: runs being written), where 16 each let 16,384 wait (and as many be written).
STREAM_CALL_AHEAD: Final = 1024


@final
class _Lease:
    """What one decoupled request of a call may make ahead of its writer (`_StreamState.lend`)."""

    __slots__ = ("ahead", "responses")

    def __init__(self, ahead: int) -> None:
        self.ahead = ahead
        #: Its stream, once open: where more ``ahead`` goes as the call's pool frees.
        self.responses: Any = None


@final
class _StreamState:
    """A ModelStreamInfer call's shared parts: one writer at a time, its slots, its sequences.

    And what its requests may make ahead of their reader, between them (`lend`).
    """

    __slots__ = ("_lock", "_send", "_short", "_spare", "slots", "tails")

    def __init__(self, send: Send) -> None:
        self._send = send
        self._spare = STREAM_CALL_AHEAD
        # Requests streaming with less than STREAM_AHEAD, the longest streaming first:
        # they get what the others give back (`repay`), instead of keeping to the end
        # the one response ahead they got while the call was busy.
        self._short: dict[_Lease, None] = {}
        # A response larger than the client's window goes out in pieces, with waits
        # between them: two of them at once would interleave their bytes.
        self._lock = anyio.Lock()
        self.slots = anyio.Semaphore(STREAM_CONCURRENCY)
        #: Each sequence's (model, sequence_id) last request read: set when it ended.
        self.tails: dict[tuple[str, int | str], anyio.Event] = {}

    def lend(self) -> _Lease:
        """A decoupled request's ``ahead``: `STREAM_AHEAD`, or less when the call is busy.

        One is every request's own (a stream cannot make less); the rest
        (up to `STREAM_AHEAD` in all) come from the call's `STREAM_CALL_AHEAD`
        while it has them: the first 68 requests in flight at once get 16, the
        ones after them what is left, then 1. Once its stream is open
        (`attach`), a request with less gets more as others give theirs back
        (`repay`), up to `STREAM_AHEAD`: the call's requests never hold more
        than `STREAM_CALL_AHEAD` beyond one each.
        """
        extra = min(STREAM_AHEAD - 1, self._spare)
        self._spare -= extra
        return _Lease(1 + extra)

    def attach(self, lease: _Lease, responses: Any) -> None:
        """*lease*'s request has opened its stream, *responses* (a `ResponseStream`)."""
        lease.responses = responses
        if lease.ahead < STREAM_AHEAD:
            self._short[lease] = None
            self._top_up()

    def repay(self, lease: _Lease) -> None:
        """The request that `lend` gave *lease* to has ended."""
        self._short.pop(lease, None)
        self._spare += lease.ahead - 1
        self._top_up()

    def _top_up(self) -> None:
        # What the call has to spare, to its requests streaming with less, in turn.
        short = self._short
        while self._spare and short:
            lease = next(iter(short))
            extra = min(STREAM_AHEAD - lease.ahead, self._spare)
            self._spare -= extra
            lease.ahead += extra
            lease.responses._widen(lease.ahead)
            if lease.ahead == STREAM_AHEAD:
                del short[lease]

    async def send(self, *messages: bytes) -> None:
        """Send *messages* together (`Send`), never beside another's bytes."""
        lock = self._lock
        try:
            lock.acquire_nowait()  # the usual case: no checkpoint when nobody is sending
        except anyio.WouldBlock:
            await lock.acquire()
        try:
            await self._send(*messages)
        finally:
            lock.release()


def _sequence_key(request: Any) -> tuple[str, int | str] | None:
    """The (model, sequence_id) a request belongs to, or None outside a sequence.

    0 and "" name no sequence (Triton reserves them); an id of another type
    gets none: its request fails where the parameters are checked.
    """
    value = request.parameters.get("sequence_id")
    if value is None:
        return None
    sequence_id = _parameter(value)
    if not sequence_id or not isinstance(sequence_id, int | str):
        return None
    return request.model_name, sequence_id


async def _stream(
    state: ServerState,
    served: Any,
    request: Any,
    priority: int,
    timeout_s: float | None,
    order: list[str],
    stream: _StreamState,
    lease: Any,
    forwarded: Mapping[str, str] | None,
) -> None:
    """Send a decoupled model's responses on *stream*, as Triton's gRPC stream sends them.

    With ``triton_enable_empty_final_response`` (tritonclient's
    ``enable_empty_final_response=True``) each response carries
    ``triton_final_response: false`` and an empty one with ``true`` ends the
    request's responses, as in Triton; without it the responses just stop. (A
    model that is not decoupled answers with one response carrying ``true``.)

    Responses made while the stream has its next one at hand
    (`ResponseStream.ready`) wait for it, up to `_RUN_BYTES`, and a model's run
    of responses leaves in one send: one DATA frame, one wake of the
    connection's writer (a send each cost about a third of a response's CPU).
    The model makes at most `_StreamState.lend`'s ``ahead`` responses that
    are not read: a call's requests in flight share a bound (and a request
    lent less while the call was busy gets more as it frees).
    """
    final = request.parameters.get("triton_enable_empty_final_response") is True
    model, version, request_id = served.model, str(served.version), request.id
    # Views of the arrays: copied into each response's bytes at once.
    encode = raw_output_encoder(request, order, lease, copy=False)
    run: list[bytes] = []  # responses made and not sent yet
    held = 0  # their bytes
    # What this request may make ahead of the writer (not *lease*: the request's
    # shared-memory lease, which the encoder holds).
    share = stream.lend()
    scope = anyio.CancelScope(deadline=math.inf)

    async def emit(*messages: bytes) -> None:
        # A message larger than the client's window goes in pieces: the request's
        # timeout must not leave one half-sent (`send_whole`).
        await send_whole(scope, stream.send, *messages)

    try:
        if timeout_s is not None:
            scope.deadline = anyio.current_time() + timeout_s
        with scope:
            try:
                async with state.models.engine.infer_stream(
                    served.engine_name,
                    request.inputs,
                    priority=priority,
                    request_id=request_id,
                    parameters=with_headers(request.parameters, forwarded),
                    outputs=requested_names(request),
                    ahead=share.ahead,
                ) as responses:
                    stream.attach(share, responses)
                    async for outputs in responses:
                        encoded = encode(outputs)
                        given = responses.parameters
                        if final:
                            given = {**given, **_NOT_FINAL} if given else _NOT_FINAL
                        data = _stream_response(model, version, request_id, encoded, given)
                        run.append(data)
                        held += len(data)
                        if held >= _RUN_BYTES or not responses.ready:
                            messages, held = tuple(run), 0
                            run.clear()
                            await emit(*messages)
            except Exception:
                if run:  # the responses before the error, then (from the caller) the error
                    await emit(*run)
                raise
        if scope.cancelled_caught:
            # The run held for the rest of it leaves first (as the SSE writer's): the
            # stream gave it before the deadline. Then (from the caller) the error.
            if run:
                await emit(*run)
            raise DeadlineExceeded(
                f"the request's timeout of {timeout_s} s passed before its last response"
            )
        if final:
            run.append(_stream_response(model, version, request_id, [], _FINAL))
        if run:
            await emit(*run)
    finally:
        stream.repay(share)  # its last run sent, or dropped


#: The most bytes of a stream's responses held for the rest of their run (`_stream`).
_RUN_BYTES: Final = 64 * 1024
#: The parameter on each of a stream's responses, when the client asked for a final one.
_NOT_FINAL: Final[Mapping[str, Parameter]] = {"triton_final_response": False}
#: The parameter on a request's last response, when the client asked for one.
_FINAL: Final[Mapping[str, Parameter]] = {"triton_final_response": True}


# -- messages to plain values and back ----------------------------------------------------


def _parse(request_type: Any, raw: bytes) -> Any:
    try:
        return request_type.FromString(raw)
    except DecodeError as exc:
        raise RequestError(
            f"the request is not a valid {request_type.DESCRIPTOR.name} message: {exc}"
        ) from None


def _metadata(call: GrpcCall) -> dict[str, str]:
    # gRPC metadata keys are lower-case; binary ("-bin") values are no token or key.
    return call.metadata


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
    # bytes_contents stay bytes, as sent: the engine decodes them for a model that
    # takes text (TensorSpec.utf8), and refuses there what is not UTF-8.
    return list(getattr(tensor.contents, expected))


def _infer_response(
    model: str,
    version: str,
    request_id: str | None,
    outputs: list[RawOutput],
    parameters: Mapping[str, Parameter] | None,
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
        response.raw_output_contents.append(bytes(data))
    for key, value in (parameters or {}).items():
        _set_parameter(response.parameters[key], value)
    return response


def _set_parameter(target: Any, value: Parameter) -> None:
    # An InferParameter holding *value* in the field of its type (bool before int:
    # a bool is an int in Python).
    if isinstance(value, bool):
        target.bool_param = value
    elif isinstance(value, int):
        target.int64_param = value
    elif isinstance(value, float):
        target.double_param = value
    else:
        target.string_param = value


# -- plans: a ModelInfer request laid out as one seen before ---------------------------------


def _wire_split(data: bytes) -> tuple[bytes, str, list[memoryview]] | None:
    """A ModelInferRequest's bytes as (the rest, its id, its raw_input_contents).

    "The rest" is every top-level field but the id (3) and the raw contents
    (7), as sent: two requests with the same rest parse alike but for those.
    None for anything unusual (a field that is not length-delimited, a tag of
    more than one byte, a repeated or non-UTF-8 id, bytes cut short): the long
    way parses it and says what is wrong.
    """
    rest: list[bytes] = []
    contents: list[memoryview] = []
    request_id = b""
    seen_id = False
    view = memoryview(data)
    pos, end = 0, len(data)
    while pos < end:
        start = pos
        tag = data[pos]
        if tag & 0x87 != 2:  # wire type 2 (length-delimited), a one-byte tag
            return None
        pos += 1
        length = shift = 0
        while True:
            if pos >= end or shift > 28:
                return None
            byte = data[pos]
            pos += 1
            length |= (byte & 0x7F) << shift
            if byte < 0x80:
                break
            shift += 7
        stop = pos + length
        if stop > end:
            return None
        field = tag >> 3
        if field == 7:
            contents.append(view[pos:stop])
        elif field == 3:
            if seen_id:
                return None
            seen_id = True
            request_id = data[pos:stop]
        else:
            rest.append(data[start:stop])
        pos = stop
    try:
        return b"".join(rest), request_id.decode("utf-8"), contents
    except UnicodeDecodeError:
        return None


@final
class _Plan:
    """What a ModelInferRequest's rest (`_wire_split`) decoded to: the inputs' specs and the rest.

    Only requests whose inputs are all raw contents of fixed-size datatypes,
    without parameters, and whose outputs are not in shared memory are
    planned: nothing a plan skips can differ between two such requests.
    """

    __slots__ = ("limits", "model_name", "model_version", "request", "sizes", "specs")

    def __init__(
        self, limits: Limits, message: Any, request: InferRequest, specs: tuple[_Input, ...]
    ) -> None:
        self.limits = limits
        self.model_name: str = message.model_name
        self.model_version: str = message.model_version
        self.request = request  # without inputs or id (each request has its own)
        self.specs = specs
        self.sizes = [spec.binary_size for spec in specs]

    def fits(self, contents: list[memoryview]) -> bool:
        """Whether *contents* are one entry per input of the planned sizes (else: the long way)."""
        return [len(c) for c in contents] == self.sizes


@final
class _Planned:
    """One request on a plan: its own raw contents and id; decoded in its call."""

    __slots__ = ("contents", "id", "model_name", "model_version", "plan")

    def __init__(self, plan: _Plan, contents: list[memoryview], request_id: str) -> None:
        self.plan = plan
        self.contents = contents
        self.id = request_id
        self.model_name = plan.model_name
        self.model_version = plan.model_version

    def decode(self) -> InferRequest:
        """The request, its inputs cut from its raw contents (BOOL data checked)."""
        r = self.plan.request
        inputs = {
            spec.name: _from_binary(spec, chunk)
            for spec, chunk in zip(self.plan.specs, self.contents, strict=True)
        }
        return InferRequest(self.id or None, inputs, r.outputs, r.binary_output, r.parameters)


def _remember(
    key: bytes, parts: dict[str, Any], request: InferRequest, limits: Limits, message: Any
) -> None:
    """After the long way: a plan for *key*, the second time it is seen, if it may have one."""
    inputs = parts["inputs"]
    if (
        len(key) > _PLAN_BYTES
        or len(parts["raw"]) != len(inputs)
        or any("parameters" in item or item["datatype"] == "BYTES" for item in inputs)
        or any(output.shm is not None for output in request.outputs or ())
    ):
        return
    if key not in _PLANS:
        # Seen once: a client that changes its requests' layout each time makes no plans.
        if len(_PLANS) >= _PLAN_COUNT:
            _PLANS.clear()
        _PLANS[key] = None
        return
    specs = []
    for item, chunk in zip(inputs, parts["raw"], strict=True):
        array = request.inputs[item["name"]]
        shape = tuple(array.shape)
        specs.append(
            _Input(item["name"], item["datatype"], shape, math.prod(shape), None, len(chunk), ())
        )
    r = request
    _PLANS[key] = _Plan(
        limits,
        message,
        InferRequest(None, {}, r.outputs, r.binary_output, r.parameters),
        tuple(specs),
    )


#: Recent requests' rests (`_wire_split`, at most `_PLAN_BYTES`) and their plans
#: (None: seen once); emptied when `_PLAN_COUNT` are kept.
_PLANS: Final[dict[bytes, _Plan | None]] = {}
_PLAN_BYTES: Final = 4096
_PLAN_COUNT: Final = 256


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _response_pieces(
    model: str,
    version: str,
    request_id: str | None,
    outputs: list[RawOutput],
    parameters: Mapping[str, Parameter] | None,
) -> list[bytes | memoryview]:
    """`_infer_response` serialised, in pieces; its usual form from memos but the id and data.

    Protobuf reads fields in any order: the memo's fields (model, version, the
    outputs' names, datatypes and shapes) come first, then the parameters
    (`_parameters_bytes`), the id and each output's raw contents, each a tag
    and a length before the bytes as they are.
    """
    key: list[Any] = [model, version]
    for name, datatype, shape, _, where in outputs:
        if where:  # in shared memory: rare, the long way
            data: bytes = _infer_response(
                model, version, request_id, outputs, parameters
            ).SerializeToString()
            return [data]
        key.append((name, datatype, shape))
    head = _HEADS.get(memo := tuple(key))
    if head is None:
        message = _infer_response(
            model, version, None, [(n, t, s, b"", None) for n, t, s, _, _ in outputs], None
        )
        message.ClearField("raw_output_contents")
        head = message.SerializeToString()
        if len(_HEADS) >= _PLAN_COUNT:
            _HEADS.clear()
        _HEADS[memo] = head
    pieces: list[bytes | memoryview] = [head]
    if parameters:
        pieces.append(_parameters_bytes(parameters))
    if request_id:
        encoded = request_id.encode("utf-8")
        pieces += (
            _ID_TAGS[len(encoded)] if len(encoded) < 0x80 else b"\x1a" + _varint(len(encoded)),
            encoded,
        )
    for output in outputs:
        blob = output[3]
        size = len(blob)
        pieces += (_RAW_TAGS[size] if size < 0x80 else b"\x32" + _varint(size), blob)
    return pieces


#: ModelInferResponse's field tags and one-byte lengths, of 0-127 bytes: a raw output's
#: (6), the id's (3).
_RAW_TAGS: Final = [bytes((0x32, n)) for n in range(0x80)]
_ID_TAGS: Final = [bytes((0x1A, n)) for n in range(0x80)]
#: ModelStreamInferResponse's infer_response (2) tag and one-byte lengths.
_STREAM_TAGS: Final = [bytes((0x12, n)) for n in range(0x80)]


def _response_bytes(
    model: str,
    version: str,
    request_id: str | None,
    outputs: list[RawOutput],
    parameters: Mapping[str, Parameter] | None,
) -> bytes:
    """`_infer_response` serialised (see `_response_pieces`)."""
    return b"".join(_response_pieces(model, version, request_id, outputs, parameters))


def _stream_response(
    model: str,
    version: str,
    request_id: str | None,
    outputs: list[RawOutput],
    parameters: Mapping[str, Parameter] | None,
) -> bytes:
    """A ModelStreamInferResponse serialised: `_response_bytes` as its infer_response (2)."""
    pieces = _response_pieces(model, version, request_id, outputs, parameters)
    size = sum(map(len, pieces))
    return b"".join([_STREAM_TAGS[size] if size < 0x80 else b"\x12" + _varint(size), *pieces])


def _parameters_bytes(parameters: Mapping[str, Parameter]) -> bytes:
    """A ModelInferResponse's parameters (4) serialised; short ones from a memo.

    A stream's responses repeat theirs (``triton_final_response``, a model's
    own). The memo's key is each value's repr, which tells True from 1 and
    -0.0 from 0.0 (equal, and alike as keys, but not on the wire).
    """
    key = tuple([(name, repr(value)) for name, value in parameters.items()])
    data = _PARAMETERS.get(key)
    if data is None:
        message = pb.ModelInferResponse()
        for name, value in parameters.items():
            _set_parameter(message.parameters[name], value)
        data = message.SerializeToString()
        if len(data) <= _PARAMETERS_MEMO_BYTES:
            if len(_PARAMETERS) >= _PLAN_COUNT:
                _PARAMETERS.clear()
            _PARAMETERS[key] = data
    return data


#: Serialised ModelInferResponses without id or raw contents, by model, version and outputs.
_HEADS: Final[dict[tuple[Any, ...], bytes]] = {}
#: Serialised response parameters (`_parameters_bytes`), by their names and values' reprs.
_PARAMETERS: Final[dict[tuple[tuple[str, str], ...], bytes]] = {}
#: The longest serialised parameters kept in `_PARAMETERS`.
_PARAMETERS_MEMO_BYTES: Final = 1024


# -- the server ------------------------------------------------------------------------------


def _methods(service: _Service) -> dict[str, Method]:
    methods: dict[str, Method] = {}
    for method in pb.FILE.services_by_name["GRPCInferenceService"].methods:
        path = f"/{pb.SERVICE}/{method.name}"
        if method.client_streaming:
            methods[path] = Method(getattr(service, method.name), streaming=True)
        else:
            request_type = message_factory.GetMessageClass(method.input_type)
            handler = (
                service.infer_handler()
                if method.name == "ModelInfer"
                else service.unary(request_type, getattr(service, method.name))
            )
            methods[path] = Method(handler, streaming=False, logged=_logged_fields(method))
    return methods


def _logged_fields(method: Any) -> dict[int, str]:
    """The request message's fields the request log names, by number (see `Method`)."""
    names = {"model_name": "model", "model_version": "version", "id": "request_id"}
    if method.name.startswith("Model"):  # elsewhere "name" is a shared-memory region's
        names |= {"name": "model", "version": "version"}
    return {
        field.number: names[field.name]
        for field in method.input_type.fields
        if field.name in names and field.type == field.TYPE_STRING
    }


async def serve_grpc(
    state: ServerState,
    host: str,
    port: int,
    *,
    shutdown: anyio.Event,
    reuse_port: bool = False,
    ssl_context: ssl.SSLContext | ReloadingContext | None = None,
    task_status: anyio.abc.TaskStatus[str] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve *state* over V2 gRPC on *host*:*port* until *shutdown* is set, then drain.

    Reports ``host:port`` (the bound port, for port 0) once listening. On
    *shutdown* each connection gets a GOAWAY (new calls are refused) and calls
    in progress get the drain period to finish; then they are cancelled, in
    the engine too. Requests are capped at ``max_body_bytes``, as over HTTP.
    With *reuse_port* the listener is bound with ``SO_REUSEPORT``, as the HTTP
    one is under ``serve --workers N``: every worker listens on the one gRPC
    port and the kernel spreads new connections (not calls: a connection's
    calls stay with the worker that accepted it) among them.

    With *ssl_context* (from `server_context`, offering ALPN ``h2``, or a
    `ReloadingContext`, which picks up renewed files for new connections) every
    connection is TLS: its handshake runs in the connection's own task and must
    end within ``head_timeout``, or the client is dropped (as is one that fails
    it: plaintext, or without a trusted certificate under mutual TLS).

    Raises:
        OSError: The address cannot be bound.
    """
    limits = state.config.limits
    server = GrpcServer(
        _methods(_Service(state)),
        limits.max_body_bytes,
        head_timeout=limits.head_timeout,
        body_timeout=limits.body_timeout,
        send_timeout=limits.send_timeout,
    )
    try:
        listener = await anyio.create_tcp_listener(
            local_host=host, local_port=port, reuse_port=reuse_port
        )
    except OSError as exc:
        raise listen_error(host, port, exc) from None
    bound = listener.extra(anyio.abc.SocketAttribute.local_port)
    address = f"{_bracket(host)}:{bound}"
    handler: Callable[[Any], Awaitable[None]] = server.connection
    if ssl_context is not None:
        context, timeout = ssl_context, limits.head_timeout

        async def handler(stream: anyio.abc.SocketStream) -> None:
            # Each handshake in its connection's task: a slow one holds no other.
            secured = await handshake(stream, context, timeout, "gRPC")
            if secured is not None:
                await server.connection(secured)

    async with anyio.create_task_group() as connections:
        accepting = anyio.CancelScope()

        async def accept() -> None:
            with accepting:
                async with listener:
                    await listener.serve(handler, task_group=connections)

        connections.start_soon(accept)
        log.info("serving gRPC%s on %s", " over TLS" if ssl_context is not None else "", address)
        task_status.started(address)
        try:
            await shutdown.wait()
            accepting.cancel()
            await server.drain(state.config.drain_period)
        finally:
            # Whatever still runs is cancelled (its client gets UNAVAILABLE).
            connections.cancel_scope.cancel()
    log.info("stopped serving gRPC")


def listen_error(host: str, port: int, exc: OSError) -> OSError:
    """*exc*, from binding the gRPC port, as an error that names the gRPC address."""
    return OSError(
        exc.errno,
        f"cannot listen for gRPC on {_bracket(host)}:{port}: {exc.strerror or exc} (the "
        "port is in use, or the address is not one of this host's: --grpc-port, --host; "
        "--no-grpc serves HTTP alone)",
    )


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
