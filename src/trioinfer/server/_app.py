"""The KServe V2 (Open Inference Protocol) REST app, and the one place errors become statuses.

Routes follow the protocol and Triton's extensions (binary tensor data, model
repository, statistics, schedule policy). The inference route is a raw ASGI
endpoint: it reads the body under the size limit, watches for the client
going away (which cancels the request in the engine), and writes the
response without the framework's per-request objects, because it is the hot
path. Every other route is an ordinary Starlette endpoint.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import inspect
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, final

import anyio
import attrs
import sniffio
import trio
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import __version__
from .._bounds import MAX_PRIORITY, MIN_PRIORITY, check_seconds
from .._config import PIPELINE, Instance, ModelConfig
from .._engine import InferenceResult
from .._exceptions import (
    BackendError,
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
from .._request import Parameter, checked_parameters
from .._resources import parse_resource_flags
from .._sequence import SequenceConfig, SequenceFlags
from .._tensors import ModelSignature, TensorSpec
from .._trace_settings import trace_settings, update_trace_settings
from .._util import check_token
from ._codec import (
    InferRequest,
    Limits,
    PayloadTooLarge,
    RequestError,
    UnsupportedEncoding,
    classify,
    config_datatype,
    decode_infer_request,
    decompress,
    dumps,
    encode_infer_response,
    loads_json,
    parse_header_length,
    v2_datatype,
)
from ._errors import ClientLeft, NotReady, Unauthorized, without_host_paths
from ._forward import forward_regex, forwarded_headers
from ._logging import REQUESTS, check_log_settings, log_request, log_settings, update_log_settings
from ._metrics import InFlight, Metrics, triton_entry
from ._models import ServedModels, ServedVersion
from ._poll import REFUSED as POLLING_REFUSED
from ._repository import VersionPolicy
from ._shm import SystemSharedMemory
from ._tls import TlsFiles
from ._triton import NARROWING_BACKENDS, own_parameters, rate_limiter_json, with_defaults

if TYPE_CHECKING:
    from ._workers import WorkerLink

log = logging.getLogger("trioinfer.server")

#: The protocol extensions this server implements, as ``GET /v2`` lists them.
EXTENSIONS: Final = (
    "binary_tensor_data",
    "classification",
    "generate",
    "logging",
    "model_configuration",
    "model_repository",
    "parameters",
    "schedule_policy",
    "sequence",
    "statistics",
    "system_shared_memory",
    "trace",
)

_JSON: Final = "application/json"

#: The longest host metrics' interval, a day, in seconds: a sample a day is no gauge.
MAX_METRICS_INTERVAL_S: Final = 86_400


#: Scope key set once a request's body has been read to its end.
_BODY_READ: Final = "trioinfer.body_read"
#: The headers of an all-JSON infer response (the server adds content-length).
_JSON_HEADERS: Final = ((b"content-type", b"application/json"),)


def _must_close(scope: Scope) -> bool:
    # An answer sent before the body was read leaves the rest of it on the
    # connection, so the server closes it: say so, or keep-alive clients would
    # send their next request down a closing connection.
    return scope["method"] not in ("GET", "HEAD") and not scope.get(_BODY_READ, False)


def status_for(error: BaseException) -> int:
    """The HTTP status for an error raised while serving a request: the only such mapping.

    Client faults are 4xx, and so is a configuration the operator must change
    (``ConfigError``: a model config, a misnamed or uninstalled plugin); a full
    queue, a closing engine or an unusable device are 503; a request whose
    deadline passed is 504; a failing backend, a plugin that broke its
    contract (``PluginContractError``) or a bug is 500.
    """
    for kind, status in _STATUS:
        if isinstance(error, kind):
            return status
    return 500


_STATUS: Final[tuple[tuple[type[BaseException], int], ...]] = (
    (PayloadTooLarge, 413),
    (UnsupportedEncoding, 415),
    (Unauthorized, 401),
    (ModelNotFound, 404),
    (InvalidInput, 400),  # RequestError too
    (ConfigError, 400),  # PluginError and PluginLoadError too
    (PluginContractError, 500),  # a plugin's fault, logged with its name where it broke
    (QueueFull, 503),
    (CircuitOpen, 503),
    (BackendUnavailable, 503),
    (EngineClosed, 503),
    (NotReady, 503),
    (DeadlineExceeded, 504),
)


def _error_headers(error: BaseException) -> dict[str, str]:
    headers = {}
    if isinstance(error, (QueueFull, CircuitOpen)):
        headers["retry-after"] = str(max(1, math.ceil(error.retry_after)))
    if isinstance(error, Unauthorized):
        headers["www-authenticate"] = "Bearer"
    return headers


def error_response(error: BaseException, message: str | None = None) -> Response:
    """A ``{"error": message}`` JSON response with the status `status_for` gives."""
    status = status_for(error)
    if status == 500:
        log.error("request failed: %s: %s", type(error).__name__, error)
    return Response(
        dumps({"error": without_host_paths(message or str(error) or type(error).__name__)}),
        status_code=status,
        headers=_error_headers(error),
        media_type=_JSON,
    )


#: The request header whose value picks a version by hash under a traffic split.
ROUTING_KEY_HEADER = "trioinfer-routing-key"


@attrs.frozen
class ServerConfig:
    """How the HTTP server behaves, besides which models it serves.

    Attributes:
        limits: Size caps checked before anything is allocated.
        admin_token: If set, repository load and unload require
            ``Authorization: Bearer <token>``.
        protect_inference: Require the token for inference (and metadata) too.
        drain_period: Seconds in-flight requests may take to finish at shutdown.
        cache_size: Bytes of the engine's response cache, for the models whose
            config sets ``response_cache``; 0 for no cache.
        tracer_provider: An OpenTelemetry ``TracerProvider`` to trace requests
            with (see `open_engine`); None for no tracing.
        trace_rate: The share of requests that start a trace which are traced;
            ``/v2/trace/setting`` changes it at run time.
        strict_readiness: ``/v2/health/ready`` (gRPC ``ServerReady``) says ready only
            while every model the server tried to load is served: one whose load
            failed, with no version of it serving, makes it not ready (Triton's
            ``--strict-readiness``).
        exit_on_error: A model that fails to load at start stops the server
            (exit status 1) instead of being served without (Triton's
            ``--exit-on-error``).
        disable_auto_complete_config: Serve each ``config.pbtxt`` as written
            (Triton's ``--disable-auto-complete-config``): a Triton Python
            model's ``auto_complete_config`` is not run, and a model whose
            file declares no input or output fails its load, ONNX models
            included (their graph is not read for them). Models configured by
            ``config.toml``, or by no file, are trioinfer's own and read their
            tensors from the model file as ever.
        repository_poll_s: Read the model repository every so many seconds and
            load, reload and unload what changed (Triton's poll mode; see
            ``trioinfer.server._poll``); the repository API's load and unload
            are refused meanwhile. 0: never.
        rate_limit: ``"execution_count"`` for instances to take the resources their
            config declares before each execution (Triton's rate limiter), or
            ``"off"`` (the default, as Triton's) to run them as if they declared none.
        rate_limit_resources: Pool sizes as Triton's ``--rate-limit-resource``
            flags, ``NAME:COUNT[:DEVICE]``; a pool not sized holds the largest need.
        metrics_interval_s: Seconds between two samples of the machine's CPU,
            memory and GPUs for ``/metrics`` (Triton's ``--metrics-interval-ms``,
            whose default is 2000 ms too); a scrape reads the last sample. Above
            0 and at most a day (86400).
        allow_cpu_metrics: Report the machine's CPU utilization and memory
            (Triton's ``--allow-cpu-metrics``).
        allow_gpu_metrics: Report each GPU's utilization, memory and power,
            through NVML (Triton's ``--allow-gpu-metrics``).
        grpc_tls: Serve gRPC over TLS with these files (Triton's ``--grpc-use-ssl``
            and ``--grpc-use-ssl-mutual``; a [`TlsFiles`][trioinfer.server.TlsFiles]);
            `serve_http` reads them before loading anything. None: plaintext.
        http_tls: Serve HTTPS with these files (``--http-ssl-cert`` and
            ``--http-ssl-key``; Triton has no HTTPS of its own); *mutual* is not
            supported there. None: plain HTTP.
        http_header_forward_pattern: A regular expression: the HTTP request
            headers whose names it matches reach the model as string parameters
            (Triton's ``--http-header-forward-pattern``; see
            ``trioinfer.server._forward``). None or empty: none are.
        grpc_header_forward_pattern: The same for gRPC metadata keys (Triton's
            ``--grpc-header-forward-pattern``).
    """

    limits: Limits = attrs.field(factory=Limits)
    admin_token: str | None = attrs.field(default=None)
    protect_inference: bool = False
    drain_period: float = attrs.field(default=10.0)
    cache_size: int = attrs.field(default=0)
    tracer_provider: Any = None
    trace_rate: float = 1.0
    strict_readiness: bool = False
    exit_on_error: bool = False
    disable_auto_complete_config: bool = False
    repository_poll_s: float = attrs.field(default=0.0)
    rate_limit: str = attrs.field(default="off")
    rate_limit_resources: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    metrics_interval_s: float = attrs.field(default=2.0)
    allow_cpu_metrics: bool = True
    allow_gpu_metrics: bool = True

    @metrics_interval_s.validator
    def _check_metrics_interval(self, _attribute: attrs.Attribute[Any], value: object) -> None:
        # The one check of the interval: the CLI's --metrics-interval-ms arrives here
        # (its ConfigError a usage error), and HostMetrics is made from this config.
        if (
            not isinstance(value, (int, float))
            or isinstance(value, bool)
            or not 0 < value <= MAX_METRICS_INTERVAL_S
        ):
            # Longer than a day is no gauge of anything; NaN fails the comparison too.
            raise ConfigError(
                f"metrics_interval_s must be a number of seconds above 0 and at most a day "
                f"({MAX_METRICS_INTERVAL_S}): the host metrics' sampling interval, which "
                f"--metrics-interval-ms (metrics_interval_ms in a --config file) gives in "
                f"milliseconds, 1 to {MAX_METRICS_INTERVAL_S * 1000}; got {value!r}"
            )

    grpc_tls: TlsFiles | None = None
    http_tls: TlsFiles | None = attrs.field(default=None)

    http_header_forward_pattern: str | None = attrs.field(default=None)
    grpc_header_forward_pattern: str | None = attrs.field(default=None)

    @http_header_forward_pattern.validator
    @grpc_header_forward_pattern.validator
    def _check_forward_pattern(self, attribute: attrs.Attribute[Any], value: object) -> None:
        # A bad pattern fails the start (serve: exit 2), not each request.
        name = attribute.name
        forward_regex(value, option=f"--{name.replace('_', '-')} ({name} in a --config file)")

    @http_tls.validator
    def _check_http_tls(self, _attribute: attrs.Attribute[Any], value: TlsFiles | None) -> None:
        if value is not None and value.mutual:
            raise ConfigError("http_tls: mutual TLS is served on gRPC only, not over HTTP")

    @rate_limit.validator
    def _check_rate_limit(self, _attribute: attrs.Attribute[Any], value: object) -> None:
        if value not in ("off", "execution_count"):
            raise ConfigError(f"rate_limit must be 'off' or 'execution_count', got {value!r}")

    @rate_limit_resources.validator
    def _check_resources(self, _attribute: attrs.Attribute[Any], value: tuple[str, ...]) -> None:
        parse_resource_flags(value)

    @property
    def resource_sizes(self) -> dict[str, dict[str, int]]:
        """``rate_limit_resources`` as `open_engine`'s ``resources``."""
        return parse_resource_flags(self.rate_limit_resources)

    @repository_poll_s.validator
    def _check_poll(self, _attribute: attrs.Attribute[Any], value: object) -> None:
        check_seconds("repository_poll_secs", value, zero=True)  # 0: no polling

    @cache_size.validator
    def _check_cache_size(self, _attribute: attrs.Attribute[Any], value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"cache_size must be a number of bytes >= 0, got {value!r}")

    @drain_period.validator
    def _check_drain(self, _attribute: attrs.Attribute[Any], value: float) -> None:
        check_seconds("drain_period", value, zero=True)

    @admin_token.validator
    def _check_token(self, _attribute: attrs.Attribute[Any], value: str | None) -> None:
        if value is not None:
            check_token(value)

    def __attrs_post_init__(self) -> None:
        if self.protect_inference and not self.admin_token:
            raise ConfigError("protect_inference needs an admin_token to check")


@final
@attrs.define(eq=False)
class ServerState:
    """What the routes share: the served models, the config, readiness, metrics, shared memory.

    Under ``trioinfer serve --workers N``, *cluster* links this worker to the
    others: repository changes go to all of them, statistics and metrics come
    from all of them.
    """

    models: ServedModels
    config: ServerConfig
    metrics: Metrics
    in_flight: InFlight
    ready: bool = False
    #: The registered shared-memory regions, system and CUDA (HTTP and gRPC share them).
    shm: SystemSharedMemory = attrs.field(factory=SystemSharedMemory)
    cluster: WorkerLink | None = None

    def check_token(self, headers: Mapping[str, str], *, admin: bool) -> None:
        """Raise `Unauthorized` unless the request carries the token it needs."""
        token = self.config.admin_token
        if token is None or not (admin or self.config.protect_inference):
            return
        given = headers.get("authorization", "")
        scheme, _, value = given.partition(" ")
        # Compare in constant time, so the token cannot be guessed byte by byte.
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            value.strip().encode(), token.encode()
        ):
            raise Unauthorized(
                "this endpoint needs 'Authorization: Bearer <token>' with the server's token"
            )


def create_app(state: ServerState) -> ASGIApp:
    """The ASGI app serving *state* over KServe V2 REST (and ``/metrics``).

    Inference requests go straight to their endpoint; every other request
    goes through a Starlette app (routing, middleware, error pages).
    """

    def endpoint(
        handler: Callable[[Request, ServerState], Awaitable[Response]],
    ) -> Callable[[Request], Awaitable[Response]]:
        async def run(request: Request) -> Response:
            try:
                return await handler(request, state)
            except TrioInferError as exc:
                response = error_response(exc, state.models.public_message(exc))
                if _must_close(request.scope):
                    response.headers["connection"] = "close"
                return response

        return run

    infer = _InferEndpoint(state)
    # Imported here: the generate endpoints use this module's helpers.
    from ._generate import GenerateEndpoint

    generate = GenerateEndpoint(state, stream=False)
    generate_stream = GenerateEndpoint(state, stream=True)
    routes = [
        _Route("/v2/health/live", endpoint(_live), methods=["GET"]),
        _Route("/v2/health/ready", endpoint(_ready), methods=["GET"]),
        _Route("/v2", endpoint(_server_metadata), methods=["GET"]),
        _Route("/v2/models/stats", endpoint(_stats), methods=["GET"]),
        _Route("/v2/models/{model}", endpoint(_model_metadata), methods=["GET"]),
        _Route("/v2/models/{model}/versions/{version}", endpoint(_model_metadata), methods=["GET"]),
        _Route("/v2/models/{model}/ready", endpoint(_model_ready), methods=["GET"]),
        _Route(
            "/v2/models/{model}/versions/{version}/ready",
            endpoint(_model_ready),
            methods=["GET"],
        ),
        _Route("/v2/models/{model}/config", endpoint(_model_config), methods=["GET"]),
        _Route(
            "/v2/models/{model}/versions/{version}/config",
            endpoint(_model_config),
            methods=["GET"],
        ),
        _Route("/v2/models/{model}/stats", endpoint(_stats), methods=["GET"]),
        _Route("/v2/models/{model}/traffic", endpoint(_traffic), methods=["GET"]),
        _Route("/v2/models/{model}/versions/{version}/stats", endpoint(_stats), methods=["GET"]),
        _Route("/v2/models/{model}/infer", infer, methods=["POST"]),
        _Route("/v2/models/{model}/versions/{version}/infer", infer, methods=["POST"]),
        _Route("/v2/models/{model}/generate", generate, methods=["POST"]),
        _Route("/v2/models/{model}/versions/{version}/generate", generate, methods=["POST"]),
        _Route("/v2/models/{model}/generate_stream", generate_stream, methods=["POST"]),
        _Route(
            "/v2/models/{model}/versions/{version}/generate_stream",
            generate_stream,
            methods=["POST"],
        ),
        _Route("/v2/repository/index", endpoint(_repository_index), methods=["POST"]),
        _Route("/v2/repository/models/{model}/load", endpoint(_load), methods=["POST"]),
        _Route("/v2/repository/models/{model}/unload", endpoint(_unload), methods=["POST"]),
        _Route("/v2/systemsharedmemory/status", endpoint(_shm_status), methods=["GET"]),
        _Route(
            "/v2/systemsharedmemory/region/{region}/status",
            endpoint(_shm_status),
            methods=["GET"],
        ),
        _Route(
            "/v2/systemsharedmemory/region/{region}/register",
            endpoint(_shm_register),
            methods=["POST"],
        ),
        _Route(
            "/v2/systemsharedmemory/region/{region}/unregister",
            endpoint(_shm_unregister),
            methods=["POST"],
        ),
        _Route("/v2/systemsharedmemory/unregister", endpoint(_shm_unregister), methods=["POST"]),
        # Where CUDA is not usable, registering says so and the rest answers as for an empty
        # registry, so that clients which clear both registries first (Triton's examples)
        # carry on.
        _Route("/v2/cudasharedmemory/status", endpoint(_cuda_status), methods=["GET"]),
        _Route(
            "/v2/cudasharedmemory/region/{region}/status",
            endpoint(_cuda_status),
            methods=["GET"],
        ),
        _Route(
            "/v2/cudasharedmemory/region/{region}/register",
            endpoint(_cuda_register),
            methods=["POST"],
        ),
        _Route(
            "/v2/cudasharedmemory/region/{region}/unregister",
            endpoint(_cuda_unregister),
            methods=["POST"],
        ),
        _Route("/v2/cudasharedmemory/unregister", endpoint(_cuda_unregister), methods=["POST"]),
        _Route("/metrics", endpoint(_metrics), methods=["GET"]),
        _Route("/v2/trace/setting", endpoint(_trace_setting), methods=["GET", "POST"]),
        _Route("/v2/logging", endpoint(_logging), methods=["GET", "POST"]),
        _Route(
            "/v2/models/{model}/trace/setting",
            endpoint(_trace_setting),
            methods=["GET", "POST"],
        ),
    ]

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        detail = exc.detail
        if exc.status_code == 404 and detail == "Not Found":
            # Starlette's router matched no route: say where the endpoints are.
            detail = f"no endpoint {request.method} {request.url.path}; {_ENDPOINTS}"
        return Response(
            dumps({"error": f"{detail}"}),
            status_code=exc.status_code,
            headers=dict(exc.headers or {}),
            media_type=_JSON,
        )

    async def server_error(_request: Request, exc: Exception) -> Response:
        log.exception("unexpected error", exc_info=exc)
        return Response(
            dumps({"error": f"internal error: {type(exc).__name__}"}),
            status_code=500,
            # Starlette raises it again once this is sent; the connection is then
            # closed, and a keep-alive client must know not to send on it.
            headers={"connection": "close"},
            media_type=_JSON,
        )

    return _FastInfer(
        infer,
        Starlette(
            routes=routes,
            exception_handlers={HTTPException: http_error, Exception: server_error},
        ),
    )


class _Route(Route):
    """A route whose 405 names the method it takes, as a JSON error like every other.

    Starlette's says only "Method Not Allowed", and its ``Allow`` header lists the
    methods in set order (it changes between runs).
    """

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve the request, or raise a 405 naming this route's methods."""
        if self.methods and scope["method"] not in self.methods:
            allowed = sorted(self.methods)
            # HEAD is allowed wherever GET is (Starlette serves it), so it goes in Allow,
            # but a person reading the message wants the method to use instead.
            use = [method for method in allowed if method != "HEAD"] or allowed
            raise HTTPException(
                405,
                detail=f"{'/'.join(use)} {scope['path']}: method {scope['method']} not allowed; "
                f"use {' or '.join(use)}",
                headers={"Allow": ", ".join(allowed)},
            )
        await super().handle(scope, receive, send)


#: What a 404 for a path no route matches lists: the endpoints people look for first.
_ENDPOINTS: Final = (
    "the main endpoints are GET /v2 (server metadata), /v2/health/live, "
    "/v2/health/ready, /v2/models/<model>[/versions/<version>] (metadata; /ready, /config, "
    "/stats below it), POST /v2/models/<model>[/versions/<version>]/infer, "
    "POST /v2/repository/index (the models), and GET /metrics (the reference page "
    "'HTTP server' lists them all)"
)

_INFER_PATH: Final = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?/infer")


@final
class _FastInfer:
    """Route ``POST .../infer`` without Starlette's router and middleware: the hot path."""

    __slots__ = ("_infer", "_other")

    def __init__(self, infer: _InferEndpoint, other: ASGIApp) -> None:
        # Without tracing, the endpoint's own `_serve`: one coroutine less per request.
        self._infer: Callable[[Scope, Receive, Send], Awaitable[None]] = (
            infer._serve if infer._tracing is None else infer
        )
        self._other = other

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The request log: off, one test and no frame more; on, `_logged` calls this again
        # with its mark in the scope.
        if REQUESTS.on and scope["type"] == "http" and _SERVED not in scope:
            await _logged(self, scope, receive, send)
            return
        if scope["type"] == "http" and scope["method"] == "POST":
            match = _INFER_PATH.fullmatch(scope["path"])
            if match is not None:
                model, version = match.groups()
                params = (
                    {"model": model} if version is None else {"model": model, "version": version}
                )
                scope["path_params"] = params
                await self._infer(scope, receive, send)
                return
        await self._other(scope, receive, send)


#: The scope key of the request log: (version, request id) of an inference, else None.
_SERVED: Final = "trioinfer.served"


@final
class _Exchange:
    """Wraps a request's ``send`` (and trioinfer's ``respond``) to note its status and size."""

    __slots__ = ("_respond", "_send", "bytes_out", "status")

    def __init__(self, send: Send, respond: Callable[..., Awaitable[None]] | None) -> None:
        self._send = send
        self._respond = respond
        self.status: int | None = None
        self.bytes_out = 0

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif message["type"] == "http.response.body":
            self.bytes_out += len(message.get("body", b""))
        await self._send(message)

    async def respond(
        self, status: int, headers: Sequence[tuple[bytes, bytes]], body: bytes
    ) -> None:
        # The same bound-method owner as `send`: the endpoint still takes the one-call path.
        self.status = status
        self.bytes_out = len(body)
        assert self._respond is not None
        await self._respond(status, headers, body)


async def _logged(app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
    """Serve the request with *app*, then log it on the request log (`log_request`)."""
    started = time.monotonic()
    extensions = scope.get("extensions")
    respond = extensions.get("trioinfer.respond") if extensions else None
    exchange = _Exchange(send, respond)
    scope[_SERVED] = None  # the mark; the infer endpoint puts its version and id there
    if extensions and respond is not None:
        scope["extensions"] = {**extensions, "trioinfer.respond": exchange.respond}
    error: BaseException | None = None
    try:
        await app(scope, receive, exchange.send)
    except BaseException as exc:
        error = exc
        raise
    finally:
        status = exchange.status
        if status is None:
            # 500: the server answers a failed app so; 499 (nginx's): the client left,
            # or the server stopped, before an answer.
            cancelled = isinstance(error, anyio.get_cancelled_exc_class())
            status = 500 if error is not None and not cancelled else 499
        params = scope.get("path_params") or {}
        version, request_id = scope[_SERVED] or (params.get("version"), None)
        client = scope.get("client")
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        log_request(
            scope["method"],
            scope["path"],
            status,
            started,
            model=params.get("model"),
            version=version,
            request_id=request_id,
            peer=f"{client[0]}:{client[1]}" if client else None,
            bytes_in=int(length) if length is not None and length.isdigit() else None,
            bytes_out=exchange.bytes_out,
        )


# -- health and metadata --------------------------------------------------------------


async def _live(_request: Request, _state: ServerState) -> Response:
    return Response(status_code=200)


async def _ready(_request: Request, state: ServerState) -> Response:
    why = not_ready(state)
    if why is not None:
        return error_response(NotReady(why))
    return Response(status_code=200)


def not_ready(state: ServerState) -> str | None:
    """Why the server is not ready (HTTP and gRPC readiness alike), or None when it is."""
    if not state.ready:
        return "the server is starting or shutting down"
    if state.config.strict_readiness and (failed := state.models.unavailable()):
        return (
            f"--strict-readiness: model(s) {', '.join(map(repr, failed))} failed to load and "
            "serve no version (see the repository index for why)"
        )
    return None


async def _server_metadata(_request: Request, state: ServerState) -> Response:
    return _json({"name": "trioinfer", "version": __version__, "extensions": extensions(state)})


def extensions(state: ServerState) -> list[str]:
    """The protocol extensions *state*'s server implements, as ``GET /v2`` lists them.

    `EXTENSIONS`, less what ``serve --workers N`` refuses: shared memory
    (`_one_process_only`) and sequences (a stateful model is not loaded there,
    each worker would keep its own sequences), so that a client reading
    ``GET /v2`` or gRPC ``ServerMetadata`` is not told of what it cannot use.
    """
    if state.cluster is None:
        return list(EXTENSIONS)
    return [name for name in EXTENSIONS if name not in _ONE_PROCESS_EXTENSIONS]


#: The extensions ``serve --workers N`` (N > 1) does not offer.
_ONE_PROCESS_EXTENSIONS: Final = frozenset({"sequence", "system_shared_memory"})


def _served(request: Request, state: ServerState) -> ServedVersion:
    state.check_token(request.headers, admin=False)
    params = request.path_params
    return state.models.resolve(params["model"], params.get("version"))


async def _model_metadata(request: Request, state: ServerState) -> Response:
    served = _served(request, state)
    return _json(
        model_metadata_document(state, served, one_version="version" in request.path_params)
    )


def model_metadata_document(
    state: ServerState, served: ServedVersion, *, one_version: bool
) -> dict[str, Any]:
    """A model's V2 metadata (HTTP and gRPC answer the same): its versions, platform and tensors."""
    if one_version:
        versions = [str(served.version)]
    else:
        versions = [str(s.version) for s in state.models.versions(served.model)]
    signature = served.info.signature
    return {
        "name": served.model,
        "versions": versions,
        "platform": _metadata_platform(served),
        "inputs": [_tensor_metadata(t) for t in signature.inputs],
        "outputs": [_tensor_metadata(t) for t in signature.outputs],
    }


async def _model_ready(request: Request, state: ServerState) -> Response:
    try:
        served = _served(request, state)
    except ModelNotFound as exc:
        # The protocol answers "not ready" with a 4xx; a model the repository
        # holds but does not serve is not ready (400), one it lacks is unknown (404).
        model = request.path_params["model"]
        try:
            state.models.repository.entry(model)
        except TrioInferError:
            return error_response(exc)
        return error_response(InvalidInput(f"model {model!r} is not ready: {exc}"))
    reason = state.models.not_ready(served)
    if reason is not None:
        # Loaded, but it answers nothing: a plugin of it broke its contract, or no
        # instance of it serves (each taken out, or gone).
        return error_response(InvalidInput(f"model {served.model!r} is not ready: {reason}"))
    return Response(status_code=200)


async def _model_config(request: Request, state: ServerState) -> Response:
    return _json(model_config_document(state, _served(request, state)))


def model_config_document(state: ServerState, served: ServedVersion) -> dict[str, Any]:
    """A served version's configuration in Triton's terms (HTTP and gRPC answer the same).

    It parses as Triton's ``inference.ModelConfig``, strictly: trioinfer's own
    settings are ``parameters`` named ``trioinfer.<setting>``, which a load
    override carrying the answer back reads again.
    """
    # Other models (steps, fallbacks) named as in the repository, not as in the engine.
    config = served.config if served.config is not None else served.info.config
    signature = served.info.signature
    batched = signature.batched and config.batcher != "none"
    batching = _effective_options(state, config.batcher, config.batcher_options)
    max_batch = int(batching.get("max_batch_size", 0)) if batched else 0
    if config.sequence is not None:
        max_batch = config.sequence.max_batch_size if signature.batched else 0
    # In Triton's terms: with max_batch_size > 0 the dims leave out the batch dimension.
    skip = 1 if max_batch > 0 else 0
    pipeline = config.backend == PIPELINE
    reshapes = _reshapes(config)
    body: dict[str, Any] = {
        "name": served.model,
        "platform": _platform(served),
        # Triton's ensembles have no backend (one that names one is refused on load).
        "backend": config.backend if not pipeline else "",
        "max_batch_size": max_batch,
        "input": [_tensor_config(t, skip, reshapes["inputs"]) for t in signature.inputs],
        "output": [_tensor_config(t, skip, reshapes["outputs"]) for t in signature.outputs],
        # Triton's ensembles have none (their steps' models do; one is refused on load).
        "instance_group": (
            _instance_groups(served.model, served.info.devices, config.instances)
            if not pipeline
            else []
        ),
    }
    # trioinfer's own settings, which Triton's ModelConfig has no field for, go where
    # Triton keeps free-form settings (parameters, strings), under a prefix: the answer
    # then parses as Triton's message, and a load override carrying it back reads them.
    own: dict[str, Any] = {
        "scheduler": config.scheduler,
        "scheduler_options": dict(config.scheduler_options),
        "batcher": config.batcher,
        "batcher_options": dict(config.batcher_options),
        "fallback": config.fallback,
        "fallback_options": dict(config.fallback_options),
        "max_queue_size": config.max_queue_size,
        "queue_timeouts": {str(k): v for k, v in config.queue_timeouts.items()},
        "queue_sizes": {str(k): v for k, v in config.queue_sizes.items()},
        "instances": [_instance(group) for group in config.instances],
    }
    if pipeline:
        # As Triton answers an ensemble: its steps, which a load override sends back.
        body["ensemble_scheduling"] = _ensemble_scheduling(config)
    if served.policy is not None:
        body["version_policy"] = _version_policy(served.policy)
    if served.info.decoupled:
        body["model_transaction_policy"] = {"decoupled": True}
    if config.response_cache:
        body["response_cache"] = {"enable": True}
    runner = state.models.engine._runners.get(served.engine_name)
    full = getattr(runner, "backend_signature", None)  # with the control and state inputs
    if config.warmup:
        body["model_warmup"] = _model_warmup(config, full)
    if config.sequence is not None:
        body["sequence_batching"] = _sequence_batching(config.sequence, full, skip)
        own["sequence"] = _sequence_table(config.sequence, full)
    elif max_batch > 0 and not pipeline:
        # (An ensemble's scheduling is its ensemble_scheduling: one of the three.)
        delay = batching.get("max_queue_delay")
        body["dynamic_batching"] = {
            "preferred_batch_size": list(batching.get("preferred_batch_sizes", [])),
            "max_queue_delay_microseconds": int(float(delay) * 1e6) if delay is not None else 0,
        }
    if served.triton is not None:
        # What config.pbtxt (or the override) says, as Triton answers it, over what
        # trioinfer worked out; what it leaves out (inputs, say) stays worked out.
        body.update(served.triton.json())
        body["name"] = served.model
        if served.fell_back:
            # A KIND_GPU group that runs on the CPU (the backend fell back, and said
            # why in the log): say what runs, as for a config.toml model, not what
            # config.pbtxt asked for.
            body["instance_group"] = _instance_groups(
                served.model, served.info.devices, config.instances
            )
    body["parameters"] = {**body.get("parameters", {}), **own_parameters(own)}
    # As Triton prints it: every field of its message at its default when unset, so
    # that the parts worked out here and those config.pbtxt gave read alike, and
    # what is answered loads back and is answered again.
    groups = body.get("instance_group")
    if isinstance(groups, list):
        # Triton names a group it was given without a name <model>_<n>, and gives one
        # without a count the one instance it runs, as here.
        body["instance_group"] = [
            {
                **group,
                "name": group.get("name") or f"{served.model}_{n}",
                "count": group.get("count") or 1,
            }
            if isinstance(group, dict)
            else group
            for n, group in enumerate(groups)
        ]
    return with_defaults(body)


def _model_warmup(config: ModelConfig, full: ModelSignature | None) -> list[dict[str, Any]]:
    """The warm-up samples as Triton's ``model_warmup`` (files named within ``<model>/warmup``)."""
    home = config.path.parent.parent / "warmup" if config.path is not None else None
    specs = {spec.name: spec for spec in full.inputs} if full is not None else {}
    samples = []
    for sample in config.warmup:
        inputs: dict[str, Any] = {}
        for name, made in sample.inputs.items():
            entry: dict[str, Any] = {"dims": list(made.dims)}
            if name in specs:
                entry["data_type"] = "TYPE_" + config_datatype(specs[name])
            if isinstance(made.data, Path):
                inside = home is not None and made.data.is_relative_to(home)
                file = made.data.relative_to(home) if home is not None and inside else made.data
                entry["input_data_file"] = str(file)
            else:
                entry[f"{made.data}_data"] = True
            inputs[name] = entry
        samples.append(
            {
                "name": sample.name,
                "batch_size": sample.batch_size,
                "inputs": inputs,
                "count": sample.count,
            }
        )
    return samples


def _instance(group: Instance) -> dict[str, Any]:
    """An ``[[instances]]`` table as ``config.toml`` writes it (threads and CPUs when set)."""
    table: dict[str, Any] = {"device": str(group.device), "count": group.count}
    table["capacity"] = group.capacity
    if group.threads:
        table["threads"] = group.threads
    if group.cpu_affinity is not None:
        table["cpu_affinity"] = list(group.cpu_affinity)
    if group.resources:
        table["resources"] = dict(group.resources)
    if group.global_resources:
        table["global_resources"] = dict(group.global_resources)
    if group.resource_priority != 1:
        table["resource_priority"] = group.resource_priority
    return table


def _ensemble_scheduling(config: ModelConfig) -> dict[str, Any]:
    """A pipeline's steps as Triton's ``ensemble_scheduling`` (a step's version: -1, the latest)."""
    steps = []
    for step in config.backend_options.get("steps", ()):
        model, _, version = str(step["model"]).partition(":")
        steps.append(
            {
                "model_name": model,
                "model_version": int(version) if version.isdigit() else -1,
                "input_map": dict(step["input_map"]),
                "output_map": dict(step["output_map"]),
            }
        )
    return {"step": steps}


def _instance_groups(
    model: str, devices: Sequence[str], instances: Sequence[Instance]
) -> list[dict[str, Any]]:
    """The instances' devices as Triton's ``instance_group``: kind, count, gpus, rate_limiter.

    Only Triton's fields, as Triton completes them (a group's name is
    ``<model>_<n>``), so that the answer reads as Triton's ``ModelInstanceGroup``
    and can be sent back in a load override; the devices as trioinfer names
    them are under ``trioinfer.instances``. *instances* (the config's groups, one
    entry per instance of *devices* once expanded) give each its resource needs.
    """
    each = [group for group in instances for _ in range(group.count)]
    limiters = [
        rate_limiter_json(g.resources, g.global_resources, g.resource_priority) for g in each
    ]
    if len(limiters) != len(devices):  # pragma: no cover  # a runner has one per instance
        limiters = [None] * len(devices)
    groups: list[dict[str, Any]] = []
    for device, limiter in zip(devices, limiters, strict=True):
        kind = "KIND_CPU" if device.startswith("cpu") else "KIND_GPU"
        number = device.rpartition(":")[2]
        gpus = [int(number)] if kind == "KIND_GPU" and number.isdigit() else []
        last = groups[-1] if groups else None
        if last is not None and (last["kind"], last["gpus"], last.get("rate_limiter")) == (
            kind,
            gpus,
            limiter,
        ):
            last["count"] += 1
        else:
            group = {"name": f"{model}_{len(groups)}", "kind": kind, "count": 1, "gpus": gpus}
            if limiter is not None:
                group["rate_limiter"] = limiter
            groups.append(group)
    return groups


def _sequence_batching(
    sequence: SequenceConfig, signature: ModelSignature | None, skip: int
) -> dict[str, Any]:
    """A ``[sequence]`` table in the terms of Triton's ``sequence_batching``.

    *signature* (the model's, with the inputs the batcher fills) gives each
    control its false/true pair and each state its type. What Triton cannot
    say (a state's non-zero initial value) is in the answer's
    ``trioinfer.sequence`` (HTTP) only.
    """
    specs = {t.name: t for t in signature.inputs} if signature is not None else {}
    strategy: dict[str, Any] = {}
    if sequence.max_candidate_sequences is not None:
        strategy["max_candidate_sequences"] = sequence.max_candidate_sequences
    states = []
    for s in sequence.state:
        state: dict[str, Any] = {"input_name": s.input, "output_name": s.output}
        if s.input in specs:
            state["data_type"] = _tensor_config(specs[s.input], skip)["data_type"]
        if s.shape is not None:
            state["dims"] = list(s.shape)
        elif s.input in specs:
            state["dims"] = _dims(specs[s.input])[skip:]
        if s.initial == 0:
            initial = {k: state[k] for k in ("data_type", "dims") if k in state}
            state["initial_state"] = [{**initial, "name": "initial", "zero_data": True}]
        states.append(state)
    return {
        "max_sequence_idle_microseconds": int(sequence.max_sequence_idle * 1e6),
        sequence.strategy: strategy,
        "control_input": [
            {"name": name, "control": [_control(kind, specs.get(name), skip)]}
            for kind, name in sequence.control.items()
        ],
        "state": states,
    }


def _control(kind: str, spec: TensorSpec | None, skip: int) -> dict[str, Any]:
    """One control in Triton's terms: its kind, and its false/true pair or data type."""
    control: dict[str, Any] = {"kind": f"CONTROL_SEQUENCE_{kind.upper()}"}
    if spec is None:
        return control
    data_type = _tensor_config(spec, skip)["data_type"]
    if kind == "corrid":
        control["data_type"] = data_type
    elif data_type == "TYPE_INT32":
        control["int32_false_true"] = [0, 1]
    elif data_type == "TYPE_FP32":
        control["fp32_false_true"] = [0, 1]
    elif data_type == "TYPE_BOOL":
        control["bool_false_true"] = [False, True]
    # Other types (int64, say) have no false/true field in Triton's message: kind only.
    return control


def _sequence_table(sequence: SequenceConfig, signature: ModelSignature | None) -> dict[str, Any]:
    """A ``[sequence]`` table as ``config.toml`` writes it.

    A state's ``shape`` shows only where it is not the one the model's input
    gives it (*signature*: the model's, with the inputs the batcher fills):
    ``sequence_batching`` says that one as the state's ``dims``, which a load
    override reads back as a ``shape``, and the answer to the loaded copy must
    be this one again, not this one with a ``shape`` added.
    """
    table = attrs.asdict(sequence)
    table["control"] = dict(sequence.control)
    table["state"] = [
        {
            k: list(v) if isinstance(v, tuple) else v
            for k, v in state.items()
            if v is not None
            and not (k == "shape" and list(v) == _model_state_shape(state, signature))
        }
        for state in table["state"]
    ]
    return {k: v for k, v in table.items() if v is not None}


def _model_state_shape(
    state: Mapping[str, Any], signature: ModelSignature | None
) -> list[int] | None:
    """The shape a state without one takes: its input's after the batch dimension, if fixed."""
    spec = (
        next((t for t in signature.inputs if t.name == state["input"]), None) if signature else None
    )
    if spec is None or signature is None:
        return None
    dims = spec.shape[1 if signature.batched else 0 :]
    if not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        return None
    return [int(d) for d in dims if d is not None]


def _version_policy(policy: VersionPolicy) -> dict[str, Any]:
    """A repository's version policy in Triton's terms."""
    if policy.kind == "latest":
        return {"latest": {"num_versions": policy.count}}
    if policy.kind == "specific":
        return {"specific": {"versions": list(policy.versions)}}
    return {"all": {}}


def _effective_options(state: ServerState, name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """A batcher's options as it runs with them: its defaults, then what the config sets."""
    defaults: dict[str, Any] = {}
    try:
        target = state.models.engine.registry.load("batchers", name)
    except TrioInferError:
        return dict(options)
    # A class's signature is its __new__'s when it has one (the dynamic batcher's takes
    # only pad_axis, to pick its class): read __init__'s defaults too, which then win.
    factory: Any = target
    callables = [factory.__new__, factory.__init__] if isinstance(target, type) else [factory]
    for function in callables:
        try:
            parameters = inspect.signature(function).parameters.values()
        except (TypeError, ValueError):
            continue
        for parameter in parameters:
            if parameter.default is not inspect.Parameter.empty:
                defaults[parameter.name] = parameter.default
    return defaults | dict(options)


def _platform(served: ServedVersion) -> str:
    # The config's platform, as Triton fills it in: its names, which its clients and
    # tools branch on (a pipeline is what Triton calls an ensemble, whether config.pbtxt
    # or config.toml declared it), and none for a model that only names a backend (a
    # Python model: Triton's python backend models have no platform either).
    backend = served.info.config.backend
    if backend == PIPELINE:
        return "ensemble"
    return "onnxruntime_onnx" if backend == "onnxruntime" else ""


def _metadata_platform(served: ServedVersion) -> str:
    # As Triton answers model metadata: the config's platform, else its backend's name
    # ("python" for a Python model, as Triton says of its python backend's).
    return _platform(served) or served.info.config.backend


def _dims(spec: TensorSpec) -> list[int]:
    return [d if isinstance(d, int) else -1 for d in spec.shape]


def _tensor_metadata(spec: TensorSpec) -> dict[str, Any]:
    return {
        "name": spec.name,
        "datatype": v2_datatype(spec.dtype, spec.type_name),
        "shape": _dims(spec),
    }


def _tensor_config(
    spec: TensorSpec, skip: int, reshapes: Mapping[str, list[int]] | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": spec.name,
        "data_type": "TYPE_" + config_datatype(spec),
        "dims": _dims(spec)[skip:],
    }
    if spec.optional:
        out["optional"] = True  # as Triton's ModelInput says it (its default left out)
    if reshapes and spec.name in reshapes:
        # The graph's shape, as Triton answers reshape (without the batch dimension).
        out["reshape"] = {"shape": reshapes[spec.name][skip:]}
    return out


def _reshapes(config: ModelConfig) -> dict[str, dict[str, list[int]]]:
    """The graph's shape of each tensor the ONNX Runtime backend reshapes, by kind.

    Its ``inputs``/``outputs`` options' ``reshape``, which a config.toml may give.
    GET .../config answers them as Triton's ``reshape``: without it, the answer sent
    back as a load override declared the clients' dims alone, which replaced the
    option, and the load failed on the graph's shape.
    """
    options: Any = config.backend_options
    if config.backend not in NARROWING_BACKENDS:
        return {"inputs": {}, "outputs": {}}
    if config.backend == "ray":
        options = options.get("onnxruntime", {})
    out: dict[str, dict[str, list[int]]] = {}
    for kind in ("inputs", "outputs"):
        entries = options.get(kind, []) if isinstance(options, Mapping) else []
        out[kind] = {
            entry["name"]: list(entry["reshape"])
            for entry in entries
            if isinstance(entry, Mapping) and "reshape" in entry
        }
    return out


# -- system shared memory ------------------------------------------------------------------


async def _shm_status(request: Request, state: ServerState) -> Response:
    state.check_token(request.headers, admin=False)
    regions = state.shm.status(request.path_params.get("region"))
    return _json([attrs.asdict(region) for region in regions])


def _one_process_only(state: ServerState) -> None:
    # Regions are mapped per process, and SO_REUSEPORT spreads connections over the
    # workers: a region registered through one would be unknown to the others.
    if state.cluster is not None:
        raise RequestError(
            "shared-memory regions are not supported with trioinfer serve --workers N "
            "(N > 1): each worker process maps its own, so a region registered through one "
            "would be unknown to the others; serve with --workers 1 to use shared memory"
        )


async def _shm_register(request: Request, state: ServerState) -> Response:
    state.check_token(request.headers, admin=True)
    _one_process_only(state)
    body = await _small_json(request, state) or {}
    unknown = sorted(set(body) - {"key", "offset", "byte_size"})
    if unknown or "key" not in body or "byte_size" not in body:
        raise RequestError(
            'registering a region takes {"key": "/shm_key", "offset": N, "byte_size": N} '
            f"(offset optional); got keys {sorted(body)}"
        )
    state.shm.register(
        request.path_params["region"], body["key"], body.get("offset", 0), body["byte_size"]
    )
    return Response(status_code=200)


async def _shm_unregister(request: Request, state: ServerState) -> Response:
    state.check_token(request.headers, admin=True)
    await _small_json(request, state)  # read (and bound) any body, though none is needed
    state.shm.unregister(request.path_params.get("region"))
    return Response(status_code=200)


async def _cuda_register(request: Request, state: ServerState) -> Response:
    state.check_token(request.headers, admin=True)
    _one_process_only(state)
    body = await _small_json(request, state) or {}
    handle = body.get("raw_handle")
    encoded = handle.get("b64") if isinstance(handle, dict) else None
    if set(body) - {"raw_handle", "device_id", "byte_size"} or not isinstance(encoded, str):
        raise RequestError(
            'registering a CUDA region takes {"raw_handle": {"b64": "<base64 '
            'cudaIpcMemHandle_t>"}, "device_id": N, "byte_size": N}; '
            f"got keys {sorted(body)}"
        )
    try:
        raw = base64.b64decode(encoded, validate=True)
    except binascii.Error:
        raise RequestError("raw_handle.b64 is not valid base64") from None
    state.shm.register_cuda(
        request.path_params["region"], raw, body.get("device_id", 0), body.get("byte_size", 0)
    )
    return Response(status_code=200)


async def _cuda_status(request: Request, state: ServerState) -> Response:
    state.check_token(request.headers, admin=False)
    regions = state.shm.cuda_status(request.path_params.get("region"))
    return _json([attrs.asdict(region) for region in regions])


async def _cuda_unregister(request: Request, state: ServerState) -> Response:
    state.check_token(request.headers, admin=True)
    await _small_json(request, state)
    state.shm.unregister_cuda(request.path_params.get("region"))
    return Response(status_code=200)


# -- statistics and metrics -------------------------------------------------------------


async def _stats(request: Request, state: ServerState) -> Response:
    state.check_token(request.headers, admin=False)
    model = request.path_params.get("model")
    version = request.path_params.get("version")
    return _json(await statistics_document(state, model, version))


async def statistics_document(
    state: ServerState, model: str | None, version: str | None
) -> dict[str, Any]:
    """The server's statistics in Triton's shape, of *model* (and *version*) or of all.

    The one place for HTTP's ``/v2/models/stats`` and gRPC's ``ModelStatistics``
    (the caller checks the token). Under ``serve --workers N`` they are every
    worker's, live and dead, added up by the supervisor (`StatsLedger`).

    Raises:
        ModelNotFound: *model* (or that version of it) is not served.
    """
    out = model_stats(state, model, version)
    if state.cluster is not None:
        out = await state.cluster.merged_stats(out, model, version)
    return {"model_stats": out}


def model_stats(state: ServerState, model: str | None, version: str | None) -> list[dict[str, Any]]:
    """This process's statistics of *model* (every model if None), Triton's ``model_stats``."""
    if model is None:
        chosen = state.models.all()
    elif version is not None:
        chosen = [state.models.resolve(model, version)]
    else:
        state.models.resolve(model)
        chosen = state.models.versions(model)
    return [triton_entry(counts) for counts in state.metrics.version_counts(chosen)]


async def _metrics(_request: Request, state: ServerState) -> Response:
    if state.cluster is not None:
        # This worker's counts go to the supervisor, which renders every worker's.
        return Response(await state.cluster.merged_metrics(), media_type=CONTENT_TYPE_LATEST)
    body, content_type = state.metrics.exposition()
    return Response(body, media_type=content_type)


# -- model repository -----------------------------------------------------------------------


async def _repository_index(request: Request, state: ServerState) -> Response:
    state.check_token(request.headers, admin=False)
    body = await _small_json(request, state)
    ready_only = False
    if body is not None:
        ready = body.get("ready", False)
        if not isinstance(ready, bool):
            raise RequestError(f"'ready' must be true or false, got {ready!r}")
        ready_only = ready
    return _json(repository_index_document(state, ready_only=ready_only))


def repository_index_document(state: ServerState, *, ready_only: bool) -> list[dict[str, Any]]:
    """The repository's models and their states (HTTP and gRPC answer the same)."""
    out: list[dict[str, Any]] = []
    for entry in state.models.repository.index():
        served = {s.version: s for s in state.models.versions(entry.name)}
        if entry.version is None and served:
            # The directory as it stands cannot be read, yet versions are served: loaded
            # before it broke, or with a load override that replaced what it gets wrong.
            states = [_served_state(state, served[v]) for v in sorted(served)]
            out.extend(s for s in states if s["state"] == "READY" or not ready_only)
            continue
        if entry.version is not None and entry.version in served:
            version = _served_state(state, served[entry.version])
            if version["state"] == "READY" or not ready_only:
                out.append(version)
        elif (
            not ready_only
            and entry.version is None
            and (again := state.models.reloadable_versions(entry.name))
        ):
            # Configured by a load override alone and unloaded: what a load brings back.
            reason = state.models.public_message(state.models.error(entry.name) or "unloaded")
            out.extend(
                {"name": entry.name, "version": str(v), "state": "UNAVAILABLE", "reason": reason}
                for v in again
            )
        elif not ready_only:
            item: dict[str, Any] = {
                "name": entry.name,
                "state": "UNAVAILABLE",
                "reason": state.models.public_message(
                    entry.reason or state.models.error(entry.name) or "unloaded"
                ),
            }
            if entry.version is not None:
                item["version"] = str(entry.version)
            out.append(item)
    return out


def _served_state(state: ServerState, served: ServedVersion) -> dict[str, Any]:
    # A served version's index entry: READY, or UNAVAILABLE (with why) where no
    # instance of it serves, as its readiness says.
    reason = state.models.not_ready(served)
    return {
        "name": served.model,
        "version": str(served.version),
        "state": "READY" if reason is None else "UNAVAILABLE",
        "reason": reason or "",
    }


async def _load(request: Request, state: ServerState) -> Response:
    state.check_token(request.headers, admin=True)
    model = request.path_params["model"]
    try:
        override = await _load_override(request, state)
    except RequestError as exc:
        # Triton's wording, which its clients look for in any load error; the class
        # (and so the status: 400, 413, 415) stays.
        exc.args = (f"failed to load {model!r}: {exc}",)
        raise
    await load_model(state, model, override)
    return Response(status_code=200)


async def load_model(state: ServerState, model: str, override: dict[str, Any] | None) -> None:
    """Load (or reload) *model*, with the config *override* if given: HTTP and gRPC alike.

    Under ``serve --workers N`` every worker loads it before this returns
    (and one that restarts later loads it too), through the supervisor.

    Raises:
        TrioInferError: What loading raised (`ModelNotFound`, `ConfigError`, ...);
            `WorkersDisagree` when some workers loaded it and others failed.
        ConfigError: The backend could not load what the repository holds (its
            `BackendError`, chained), but for `BackendUnavailable`.
    """
    _check_not_polling(state)
    try:
        if state.cluster is not None:
            # Every worker, and one that restarts later, gets the config itself.
            await state.cluster.load(model, state.models.effective_override(model, override))
        else:
            await state.models.load(model, override)
    except BackendUnavailable:
        raise  # the device, not the model: a 503, as for a request
    except BackendError as exc:
        # A model.py that raises at import, a model.onnx that is no ONNX file: the
        # repository's content, which its operator fixes as they fix a config.toml (and
        # Triton answers any load that fails with 400), not a fault of the server's (500).
        raise ConfigError(str(exc)) from exc


async def unload_model(state: ServerState, model: str) -> None:
    """Unload *model*: HTTP and gRPC alike; on every worker under ``serve --workers N``.

    Raises:
        ModelNotFound: *model* is not served.
    """
    _check_not_polling(state)
    if state.cluster is not None:
        await state.cluster.unload(model)
    else:
        await state.models.unload(model)


def _check_not_polling(state: ServerState) -> None:
    # Two writers of what is served would undo each other's work: Triton refuses too.
    if state.config.repository_poll_s:
        raise RequestError(
            f"{POLLING_REFUSED}: this server reads its repository every "
            f"{state.config.repository_poll_s:g} s (--repository-poll-secs) and loads, reloads "
            "and unloads what changed there; change the repository instead"
        )


async def _load_override(request: Request, state: ServerState) -> dict[str, Any] | None:
    body = await _small_json(request, state)
    override: dict[str, Any] | None = None
    if body is not None:
        parameters = body.get("parameters", {})
        if not isinstance(parameters, dict):
            raise RequestError("'parameters' must be an object")
        override = load_override(parameters, state.config.limits)
    return override


async def _traffic(request: Request, state: ServerState) -> Response:
    # The split in force: each served version's share of the requests that name none
    # (trioinfer's own; `trioinfer traffic` reads it, and changes it with a load override).
    state.check_token(request.headers, admin=False)
    model = request.path_params["model"]
    versions = state.models.versions(model)
    if not versions:
        state.models.resolve(model)  # raises ModelNotFound, naming the served models
    # Without a split, every such request goes to the highest version.
    shares = state.models.traffic(model) or {versions[-1].version: 1.0}
    return _json(
        {
            "name": model,
            "versions": [str(v.version) for v in versions],
            "traffic": {str(v): share for v, share in sorted(shares.items())},
        }
    )


def _rerouted(
    state: ServerState, served: ServedVersion, headers: Mapping[str, str], tracing: Any
) -> ServedVersion:
    # The version a request that named none goes to now (see ServedModels.reroute).
    now = state.models.reroute(served, headers.get(ROUTING_KEY_HEADER))
    if now is not served and tracing is not None:
        tracing.served_version(now.version)
    return now


def load_override(parameters: Mapping[str, Any], limits: Limits) -> dict[str, Any] | None:
    """The config override a repository load request's *parameters* carry, checked.

    Raises:
        RequestError: An unknown parameter, a file upload, or a config that is
            not a JSON object.
    """
    override: dict[str, Any] | None = None
    for key in parameters:
        if key.startswith("file:"):
            raise RequestError("uploading model files is not supported; put them in the repository")
        if key != "config":
            raise RequestError(f"unknown load parameter {key!r}; the only one is 'config'")
    if "config" in parameters:
        config = parameters["config"]
        if isinstance(config, str):
            config = loads_json(config.encode(), limits, "the config override")
        if not isinstance(config, dict):
            raise RequestError(
                "parameters.config must be a JSON object of model config keys (or a "
                f"string holding one), got {type(config).__name__}"
            )
        override = config
    return override


async def _unload(request: Request, state: ServerState) -> Response:
    state.check_token(request.headers, admin=True)
    body = await _small_json(request, state)
    if body is not None:
        parameters = body.get("parameters", {})
        if not isinstance(parameters, dict) or set(parameters) - {"unload_dependents"}:
            raise RequestError("the only unload parameter is 'unload_dependents'")
    await unload_model(state, request.path_params["model"])
    return Response(status_code=200)


async def _trace_setting(request: Request, state: ServerState) -> Response:
    # Triton's trace extension: read, and change, the sampling rate at run time.
    model = request.path_params.get("model")
    posted = request.method == "POST"
    state.check_token(request.headers, admin=posted)
    body = (await _small_json(request, state) or {}) if posted else None
    return _json(await trace_setting_document(state, model, body))


async def trace_setting_document(
    state: ServerState, model: str | None, settings: Mapping[str, Any] | None
) -> dict[str, Any]:
    """Triton's trace settings for the server or *model*, after applying *settings* if given.

    The one place for HTTP's ``/v2/trace/setting`` and gRPC's ``TraceSetting``
    (the caller checks the token). Under ``serve --workers N`` a change goes to
    every worker through the supervisor, as a repository change does.

    Raises:
        ModelNotFound: *model* is not served.
        ConfigError: A setting that cannot be applied (nothing is changed).
    """
    if model is not None:
        state.models.resolve(model)  # ModelNotFound for a model not served
    tracing = state.models.engine._tracing
    if settings is not None:
        if not isinstance(settings, Mapping):
            raise ConfigError("a trace settings request must be a JSON object")
        if state.cluster is not None:
            await state.cluster.trace_setting(model, settings)
        else:
            update_trace_settings(tracing, model, settings)
    return trace_settings(tracing, model)


async def _logging(request: Request, state: ServerState) -> Response:
    # Triton's logging extension, on trioinfer's Python loggers (see _logging).
    posted = request.method == "POST"
    state.check_token(request.headers, admin=posted)
    body = await _small_json(request, state) if posted else None
    return _json(await apply_log_settings(state, body or {}))


async def apply_log_settings(state: ServerState, settings: Mapping[str, Any]) -> dict[str, Any]:
    """Apply Triton's log *settings* (HTTP and gRPC alike; none: just read); return them all.

    Under ``serve --workers N`` the change goes to every worker through the
    supervisor. Refused settings (`ConfigError`) change nothing anywhere.
    """
    if settings:
        check_log_settings(settings)
        if state.cluster is not None:
            await state.cluster.log_settings(settings)
        else:
            update_log_settings(settings)
    return log_settings()


async def _small_json(request: Request, state: ServerState) -> dict[str, Any] | None:
    # Repository requests carry small JSON bodies, often none at all.
    limits = state.config.limits
    body = await _read_body(request.scope, request.receive, request.headers, limits)
    if not body:
        return None
    value = loads_json(body, limits, "the request body")
    if not isinstance(value, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(value).__name__}")
    return value


def _json(value: Any, status: int = 200) -> Response:
    return Response(dumps(value), status_code=status, media_type=_JSON)


# -- inference --------------------------------------------------------------------------------


async def _read_body(
    scope: Scope, receive: Receive, headers: Mapping[str, str], limits: Limits
) -> bytes:
    """Read the whole request body, refusing it as soon as it passes the limit."""
    cap = limits.max_body_bytes
    declared = headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > cap:
        raise PayloadTooLarge(
            f"the request body is {declared} bytes; the limit is {cap} (max_body_bytes)"
        )
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientLeft("the client disconnected before sending the whole body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > cap:
            raise PayloadTooLarge(
                f"the request body is over {cap} bytes, the limit (max_body_bytes)"
            )
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    scope[_BODY_READ] = True
    return decompress(body, headers.get("content-encoding"), limits)


def _check_outputs(request: InferRequest, served: ServedVersion) -> None:
    # Refuse an unknown output before the model runs, not after.
    if request.outputs is None:
        return
    known = [spec.name for spec in served.info.signature.outputs]
    for output in request.outputs:
        if output.name not in known:
            raise RequestError(
                f"requested output {output.name!r} is not an output of model "
                f"{served.model!r}; its outputs are {', '.join(map(repr, known))}"
            )


def _output_names(signature: ModelSignature) -> tuple[str, ...]:
    """*signature*'s output names in order, made once per signature rather than per response."""
    cached = _OUTPUT_NAMES.get(id(signature))
    if cached is not None and cached[0] is signature:
        return cached[1]
    names = tuple(spec.name for spec in signature.outputs)
    if len(_OUTPUT_NAMES) >= 256:
        _OUTPUT_NAMES.clear()
    # The signature is kept beside its id, so that an id reused after it is freed never matches.
    _OUTPUT_NAMES[id(signature)] = (signature, names)
    return names


_OUTPUT_NAMES: Final[dict[int, tuple[ModelSignature, tuple[str, ...]]]] = {}


def _fallback_parameters(
    state: ServerState, asked: ServedVersion, result: InferenceResult
) -> dict[str, str]:
    # Response parameters that tell a client a fallback answered, and which.
    if result.instance is None:
        where = "default answer"
    else:
        where = f"instance {result.instance} ({result.device})"
    steps = "; ".join(result.fallbacks)
    # Longest first, so that "m.v1" does not rewrite part of "m.v10".
    for served in sorted(state.models.all(), key=lambda s: -len(s.engine_name)):
        public = f"{served.model} version {served.version}"
        if served.engine_name == result.model and served is not asked:
            where = f"model {public}, {where}"
        steps = steps.replace(served.engine_name, public)
    return {"trioinfer_served_by": where, "trioinfer_fallbacks": steps}


def response_parameters(
    state: ServerState, asked: ServedVersion, result: InferenceResult
) -> dict[str, Parameter] | None:
    """The ``parameters`` of an infer response: the model's own, and a fallback's; None: none.

    The model's (Triton's response parameters, `InferenceResult.parameters`)
    as it gave them; where a fallback answered, the two saying which win.
    """
    if not result.fallbacks:
        return dict(result.parameters) if result.parameters else None
    return {**result.parameters, **_fallback_parameters(state, asked, result)}


def _classified(
    request: InferRequest, served: ServedVersion, outputs: Mapping[str, Any]
) -> Mapping[str, Any]:
    """*outputs* with those asked for with ``parameters.classification`` as their top classes."""
    if request.outputs is None or not any(o.classification for o in request.outputs):
        return outputs
    config = served.info.config
    if served.triton is not None:
        # As Triton: per batch entry when max_batch_size > 0 (an ensemble's too).
        batched = int(served.triton.doc.get("max_batch_size", 0)) > 0
    else:
        batched = served.info.signature.batched and config.batcher != "none"
    out = dict(outputs)
    for item in request.outputs:
        if item.classification and item.name in out:
            out[item.name] = classify(
                out[item.name],
                item.classification,
                served.labels.get(item.name, ()),
                batched=batched,
                what=f"output {item.name!r} of model {served.model!r}",
            )
    return out


def _schedule_parameters(
    request: InferRequest, served: ServedVersion | None = None
) -> tuple[int, float | None]:
    """`schedule_parameters` of a decoded infer request's parameters."""
    if not request.parameters and (served is None or served.triton is None):
        return 0, None  # what schedule_parameters answers for none, for less
    return schedule_parameters(request.parameters, served)


#: The first-party schedulers that do not order by priority (for `schedule_parameters`).
_PRIORITY_BLIND: Final = frozenset({"fifo", "deadline", "fair"})


def schedule_parameters(
    parameters: Mapping[str, Any], served: ServedVersion | None = None
) -> tuple[int, float | None]:
    """The engine priority and the timeout (seconds) a request's parameters ask for.

    For a model with Triton's ``priority_levels``, ``priority`` is a Triton
    level (1 the highest; 0, or any other number that is not one of its
    levels, the model's default level, as Triton reads it). A Triton model
    without levels whose ``default_queue_policy`` sets a timeout serves every
    request at level 0, as Triton does, unless its scheduler orders by
    priority. HTTP infer and generate and gRPC all read them here.
    """
    priority = parameters.get("priority", 0)
    if (
        isinstance(priority, bool)
        or not isinstance(priority, int)
        or not MIN_PRIORITY <= priority <= MAX_PRIORITY
    ):
        # Say the range: an integer past it (or one too big for JSON's parser, which gives
        # a float) is not "not an integer" to the client who sent it.
        raise RequestError(
            f"parameter 'priority' must be an integer from -2**31 to 2**31, got {priority!r}"
        )
    triton = served.triton if served is not None else None
    if triton is not None:
        if triton.priority_levels:
            priority = triton.engine_priority(priority)
        elif (
            triton.doc.get("dynamic_batching", {})
            .get("default_queue_policy", {})
            .get("default_timeout_microseconds")
            and served is not None
            and served.config is not None
            and served.config.scheduler in _PRIORITY_BLIND
        ):
            # Triton serves every request of a model without priority_levels at one
            # level: its default_queue_policy timeout (queue_timeouts' level 0) holds
            # for all, whatever priority a client sends. (A scheduler that reads
            # priorities keeps them: its levels are trioinfer's.)
            priority = 0
    timeout = parameters.get("timeout")
    seconds = None
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout < 0:
            raise RequestError(
                f"parameter 'timeout' must be a non-negative integer of microseconds, got "
                f"{timeout!r}"
            )
        # As in Triton, 0 sets no timeout (the model's own queue timeouts apply), rather than
        # one that has passed before the request is read: a client that sends 0 for "none"
        # would otherwise get nothing but 504s.
        seconds = timeout / 1e6 if timeout else None
    return priority, seconds


#: The request parameters the server reads itself, which no model sees: those Triton
#: reserves (with every key that starts with "triton_") and the binary data extension's.
RESERVED_PARAMETERS: Final = frozenset(
    {
        "sequence_id",
        "sequence_start",
        "sequence_end",
        "priority",
        "timeout",
        "headers",
        "binary_data_output",
    }
)


def model_parameters(parameters: Mapping[str, Any]) -> Mapping[str, Parameter] | None:
    """The parameters of a request (HTTP, gRPC, generate) that reach its model, checked.

    All but `RESERVED_PARAMETERS` and keys starting with ``triton_``; None
    when that leaves none (the engine's way for a request without any).

    Raises:
        InvalidInput: A value is not a bool, int, float or str (a nested
            object, a list, null), naming its key: a 400 / INVALID_ARGUMENT.
    """
    if not parameters:
        return None
    own = {
        key: value
        for key, value in parameters.items()
        if key not in RESERVED_PARAMETERS and not key.startswith("triton_")
    }
    return checked_parameters(own) or None


def with_headers(
    parameters: Mapping[str, Any], headers: Mapping[str, str] | None
) -> Mapping[str, Parameter] | None:
    """`model_parameters` of a request, with its forwarded *headers* among them.

    *headers* (see ``trioinfer.server._forward``) win over the request's
    parameters of their names, as in Triton, which sets them after the body's.
    """
    return model_parameters(parameters if headers is None else {**parameters, **headers})


def http_forwarded(
    regex: re.Pattern[str] | None, raw: Iterable[tuple[bytes, bytes]]
) -> dict[str, str] | None:
    """The headers of an HTTP request that *regex* forwards to the model (None: none)."""
    if regex is None:
        return None
    pairs = ((name.decode("latin-1"), value.decode("latin-1")) for name, value in raw)
    return forwarded_headers(regex, pairs, RESERVED_PARAMETERS)


def stream_sequence(served: ServedVersion, parameters: Mapping[str, Any]) -> SequenceFlags | None:
    """A request's sequence flags (HTTP generate, gRPC streams), refused for a decoupled model.

    Streams bypass the sequence batcher (a model is decoupled or stateful, never
    both): run, such a request would silently belong to no sequence at all.

    Raises:
        InvalidInput: *parameters* name a sequence and the model streams.
    """
    sequence = SequenceFlags.from_parameters(parameters) if parameters else None
    if sequence is not None and served.info.decoupled:
        raise InvalidInput(
            f"model {served.model!r} is decoupled (it streams responses), not stateful, "
            f"so its requests take no sequence; got sequence_id {sequence.id!r} (send "
            "sequence_id, sequence_start and sequence_end only to a stateful model)"
        )
    return sequence


def requested_names(request: InferRequest) -> tuple[str, ...] | None:
    """The names of the outputs *request* asked for (the engine's ``outputs``); None: all."""
    if request.outputs is None:
        return None
    return tuple(output.name for output in request.outputs)


async def infer_in_time(
    state: ServerState,
    served: ServedVersion,
    request: InferRequest,
    priority: int,
    timeout_s: float | None,
    headers: Mapping[str, str] | None = None,
) -> InferenceResult:
    """The engine call, under the request's own ``timeout`` parameter if it has one.

    HTTP and gRPC both run a decoded request through here; the caller's
    cancel scope (a client's deadline, its disconnecting) bounds it too.
    *headers* are the request's forwarded headers (`with_headers`).
    """
    engine = state.models.engine
    # Triton's sequence_id / sequence_start / sequence_end, for stateful models.
    sequence = SequenceFlags.from_parameters(request.parameters) if request.parameters else None
    parameters = with_headers(request.parameters, headers)
    outputs = requested_names(request)
    if timeout_s is None:
        return await engine.infer_detailed(
            served.engine_name,
            request.inputs,
            priority=priority,
            request_id=request.id,
            sequence=sequence,
            parameters=parameters,
            outputs=outputs,
        )
    with anyio.move_on_after(timeout_s):
        return await engine.infer_detailed(
            served.engine_name,
            request.inputs,
            priority=priority,
            request_id=request.id,
            sequence=sequence,
            parameters=parameters,
            outputs=outputs,
        )
    raise DeadlineExceeded(
        f"the request's timeout of {timeout_s * 1e6:.0f} µs passed before it finished"
    )


async def send_whole(
    scope: anyio.CancelScope, send: Callable[..., Awaitable[None]], *args: Any
) -> None:
    """``await send(*args)`` with *scope*'s deadline (a request's own ``timeout``) held off.

    A stream's responses are written inside their request's timeout: one cut
    part-way would leave half a message on the wire (over gRPC, the next message
    is then read as its rest; over HTTP, the connection is closed under it, with
    no error event). What has begun goes out whole; the client's own deadline and
    its leaving still reach it. Past the timeout, the stream's next read raises.
    """
    deadline = scope.deadline
    if deadline == math.inf:  # no timeout (the usual stream): nothing to hold off
        await send(*args)
        return
    scope.deadline = math.inf
    try:
        await send(*args)
    finally:
        scope.deadline = deadline


@final
class _InferEndpoint:
    """``POST /v2/models/{m}[/versions/{v}]/infer`` as a raw ASGI app."""

    def __init__(self, state: ServerState) -> None:
        self._state = state
        self._trio: bool | None = None
        self._tracing = state.models.engine._tracing
        self._forward = forward_regex(
            state.config.http_header_forward_pattern, option="http_header_forward_pattern"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._tracing is None:
            await self._serve(scope, receive, send)
        else:
            await self._tracing.serve_http(
                scope, send, lambda send: self._serve(scope, receive, send)
            )

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = self._state
        headers = _Headers(scope["headers"])
        params = scope["path_params"]
        model = params["model"]
        state.in_flight.http += 1
        picked: list[ServedVersion] = []  # the version it went to, once picked
        try:
            try:
                status, body, extra = await self._infer(
                    scope, headers, params, receive, model, params.get("version"), picked
                )
            except ClientLeft:
                return  # there is nobody to answer
            except TrioInferError as exc:
                state.metrics.count(model, params.get("version"), exc, *picked)
                status = status_for(exc)
                if status == 500:  # as error_response and gRPC do: the server's fault
                    log.error("request failed: %s: %s", type(exc).__name__, exc)  # noqa: TRY400
                body = dumps({"error": state.models.public_message(exc)})
                extra = [(k.encode(), v.encode()) for k, v in _error_headers(exc).items()]
                extra.append((b"content-type", b"application/json"))
                if _must_close(scope):
                    extra.append((b"connection", b"close"))
            if status is None:  # the client left: there is nobody to answer
                return
            extensions = scope.get("extensions")
            respond = extensions.get("trioinfer.respond") if extensions else None
            # Only where `send` is the server's own: whatever wraps it (tracing, a
            # middleware around this app) reads the messages it is given.
            if respond is not None and getattr(send, "__self__", None) is respond.__self__:
                # trioinfer's own server: one call, the length framed by the server.
                await respond(status, tuple(extra), body)
                return
            await send(
                {
                    "type": "http.response.start",
                    "status": status,
                    "headers": [(b"content-length", str(len(body)).encode()), *extra],
                }
            )
            await send({"type": "http.response.body", "body": body})
        finally:
            state.in_flight.http -= 1

    async def _infer(
        self,
        scope: Scope,
        headers: _Headers,
        params: Mapping[str, str],
        receive: Receive,
        model: str,
        version: str | None,
        picked: list[ServedVersion],
    ) -> tuple[int | None, bytes, Sequence[tuple[bytes, bytes]]]:
        state = self._state
        if not state.ready:
            raise NotReady("the server is shutting down and takes no new requests")
        state.check_token(headers, admin=False)
        # A request that names no version follows the model's traffic split; one with a
        # routing key (a user or tenant id) stays on one version while the split does.
        served = state.models.resolve(model, version, key=headers.get(ROUTING_KEY_HEADER))
        if self._tracing is not None:
            self._tracing.served_version(served.version)
        limits = state.config.limits
        body = await _read_body(scope, receive, headers, limits)
        if version is None:
            # A version retired while the body arrived (a canary's old one): the split
            # routes the request again, rather than a 404 for a version it never named.
            served = _rerouted(state, served, headers, self._tracing)
        header_length = parse_header_length(
            headers.get("inference-header-content-length"), len(body)
        )
        # Regions the request reads or writes stay mapped until its answer is built.
        # (All of the request is served in this one coroutine, the engine called
        # directly when no timeout or sequence applies: every suspension of the
        # engine call passes through each frame above it.)
        with state.shm.lease() as lease:
            request = decode_infer_request(body, header_length, limits, lease)
            # Read as a request, it goes to *served*: its errors count on that version
            # from here on. Before, they are no version's (see Metrics.count).
            picked.append(served)
            if REQUESTS.on:  # what the request log says of it (see `_logged`)
                scope[_SERVED] = (str(served.version), request.id)
            _check_outputs(request, served)
            priority, timeout = _schedule_parameters(request, served)
            forwarded = http_forwarded(self._forward, scope["headers"]) if self._forward else None
            # The lean HTTP layer watches for a disconnect itself, with one task per
            # connection, and cancels this task if the client goes (the connection
            # then closes: nobody is left on it); other layers need a task of ours
            # calling `receive`.
            watch = scope.get("extensions", {}).get("trioinfer.cancel_on_disconnect")
            if watch is not None and watch():
                try:
                    if timeout is None and not request.parameters and forwarded is None:
                        result: InferenceResult | None = await state.models.engine.infer_detailed(
                            served.engine_name,
                            request.inputs,
                            priority=priority,
                            request_id=request.id,
                            outputs=requested_names(request),
                        )
                    else:
                        result = await infer_in_time(
                            state, served, request, priority, timeout, forwarded
                        )
                except anyio.get_cancelled_exc_class():
                    # The client left, or the server stops without waiting: nobody gets this answer.
                    state.metrics.cancelled(served)
                    raise
            else:
                result = await self._run(served, request, priority, timeout, forwarded, receive)
            if result is None:
                state.metrics.cancelled(served)
                return None, b"", ()
            state.models.mark_inference(served)
            state.metrics.succeeded(served)
            response, json_length = encode_infer_response(
                model_name=served.model,
                model_version=str(served.version),
                request=request,
                outputs=_classified(request, served, result.outputs),
                output_order=_output_names(served.info.signature),
                parameters=response_parameters(state, served, result),
                shm=lease,
            )
            if json_length is None:
                return 200, response, _JSON_HEADERS
            return (
                200,
                response,
                (
                    (b"content-type", b"application/octet-stream"),
                    (b"inference-header-content-length", str(json_length).encode()),
                ),
            )

    async def _run(
        self,
        served: ServedVersion,
        request: InferRequest,
        priority: int,
        timeout_s: float | None,
        forwarded: Mapping[str, str] | None,
        receive: Receive,
    ) -> InferenceResult | None:
        """Run the request; None if the client disconnected first (its request is withdrawn)."""
        left = False

        async def watch(scope: anyio.CancelScope) -> None:
            nonlocal left
            while True:
                message: Message = await receive()
                if message["type"] == "http.disconnect":
                    left = True
                    scope.cancel()
                    return

        outputs: InferenceResult | None = None
        error: TrioInferError | None = None
        async with self._open_group() as group:
            group.start_soon(watch, group.cancel_scope)
            try:
                outputs = await infer_in_time(
                    self._state, served, request, priority, timeout_s, forwarded
                )
            except TrioInferError as exc:
                # Raised out of the task group it would arrive wrapped in an ExceptionGroup.
                error = exc
            finally:
                group.cancel_scope.cancel()
        if left:
            return None
        if error is not None:
            raise error
        assert outputs is not None  # only a disconnect ends the call without outputs or error
        return outputs

    def _open_group(self) -> Any:
        # On Trio a nursery is a good deal cheaper than anyio's task group over one,
        # and this runs once per request.
        if self._trio is None:
            self._trio = sniffio.current_async_library() == "trio"
        return trio.open_nursery() if self._trio else anyio.create_task_group()


@final
class _Headers(Mapping[str, str]):
    """An ASGI scope's raw headers as a read-only, lower-case-keyed mapping.

    ASGI gives header names in lower case already. The raw pairs go into a
    dict as they are (one call in C); a value is decoded only when it is
    asked for, and a route reads four or five of them, most of which the
    request lacks. Decoding every name and value up front cost more than
    all of those lookups. A repeated field keeps its last value, as before.
    """

    __slots__ = ("_raw",)

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self._raw: dict[bytes, bytes] = dict(raw)

    def __getitem__(self, key: str) -> str:
        return self._raw[_header_key(key)].decode("latin-1")

    # Mapping's own get() and `in` go through __getitem__ and catch its KeyError:
    # a raised exception for every header a request lacks, several per request.
    def get(self, key: str, default: Any = None) -> Any:
        value = self._raw.get(_HEADER_KEYS.get(key) or _header_key(key))
        return default if value is None else value.decode("latin-1")

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and _header_key(key) in self._raw

    def __iter__(self) -> Any:
        return (name.decode("latin-1") for name in self._raw)

    def __len__(self) -> int:
        return len(self._raw)


def _header_key(key: str) -> bytes:
    return key.lower().encode("latin-1", "replace")


#: The names the infer route looks up, as bytes: spares an encode per lookup.
_HEADER_KEYS: Final = {
    name: name.encode()
    for name in (
        "authorization",
        "content-encoding",
        "content-length",
        "inference-header-content-length",
        ROUTING_KEY_HEADER,
    )
}
