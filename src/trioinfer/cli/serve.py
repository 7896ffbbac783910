"""``trioinfer serve``: one engine behind the KServe V2 HTTP server, until SIGINT or SIGTERM."""

from __future__ import annotations

import difflib
import errno
import functools
import gc
import importlib.util
import ipaddress
import logging
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import anyio
import anyio.abc
import attrs
import click

from .. import __version__, _exit, _start_signals
from .._config import parse_toml
from .._examples import example_repository
from .._exceptions import ConfigError, TrioInferError
from .._util import check_token
from ._params import (
    TAKES_NO_ARGUMENTS,
    ByteSize,
    Seconds,
    needs_extra,
    no_arguments,
    not_nan,
)

#: Triton's gRPC port.
DEFAULT_GRPC_PORT: Final = 8001

#: Keys a ``--config`` file may hold; its [limits] table takes trioinfer.server.Limits fields.
_SERVE_KEYS: Final = frozenset(
    {
        "model_repository",
        "host",
        "port",
        "grpc",
        "grpc_port",
        "grpc_use_ssl",
        "grpc_use_ssl_mutual",
        "grpc_server_cert",
        "grpc_server_key",
        "grpc_root_cert",
        "http_ssl_cert",
        "http_ssl_key",
        "models",
        "drain_period",
        "exit_timeout_secs",
        "repository_poll_secs",
        "strict_readiness",
        "exit_on_error",
        "disable_auto_complete_config",
        "cache_size",
        "admin_token",
        "protect_inference",
        "log_level",
        "log_format",
        "access_log",
        "loop",
        "limits",
        "trace_exporter",
        "trace_rate",
        "workers",
        "rate_limit",
        "rate_limit_resource",
        "metrics_interval_ms",
        "allow_cpu_metrics",
        "allow_gpu_metrics",
        "http_header_forward_pattern",
        "grpc_header_forward_pattern",
    }
)

#: With no --exit-timeout-secs, how long past the drain period the exit may take (see
#: `trioinfer._exit`).
EXIT_MARGIN_S: Final = _exit.EXIT_MARGIN_S

#: Most worker processes --workers starts. Each is a whole server (an engine, its
#: sessions, its threads) and past the cores adds only contention; --workers 100000 (a
#: typo, an extra zero or three) started processes until the host ran out of memory.
MAX_WORKERS: Final = 256


@click.command(
    short_help="Serve a model repository over KServe V2 HTTP and gRPC (Triton-compatible).",
    context_settings=TAKES_NO_ARGUMENTS,
)
@click.option(
    "--model-repository",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    metavar="DIR",
    help="<DIR>/<model>/<version>/model.onnx, with an optional <DIR>/<model>/config.toml "
    "(or Triton's config.pbtxt); a Python model is <version>/model.py, with backend = "
    '"python" and its inputs and outputs in config.toml (or a Triton Python model\'s '
    'config.pbtxt with backend: "python", as it is). Default: the bundled example '
    "repository.",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=8000,
    show_default=True,
    help="Port to listen on; 0 picks a free one.",
)
@click.option(
    "--http-ssl-cert",
    type=click.Path(dir_okay=False, path_type=str),
    default=None,
    metavar="FILE",
    help="Serve HTTPS (ALPN http/1.1) with this PEM certificate (and its chain) and "
    "--http-ssl-key. trioinfer's own flag: Triton serves no HTTPS.",
)
@click.option(
    "--http-ssl-key",
    type=click.Path(dir_okay=False, path_type=str),
    default=None,
    metavar="FILE",
    help="The PEM private key of --http-ssl-cert (not encrypted).",
)
@click.option(
    "--grpc/--no-grpc",
    default=True,
    show_default=True,
    help="Also serve V2 gRPC (Triton's inference.GRPCInferenceService, for tritonclient.grpc) "
    "from the same engine. Needs the 'grpc' extra; without it, serve says so and serves HTTP.",
)
@click.option(
    "--grpc-port",
    type=click.IntRange(0, 65535),
    default=DEFAULT_GRPC_PORT,
    show_default=True,
    help="Port for gRPC, on the same --host; 0 picks a free one (the default with --port 0).",
)
@click.option(
    "--grpc-use-ssl",
    type=click.BOOL,
    is_flag=False,
    flag_value=True,
    default=False,
    show_default=True,
    metavar="[BOOL]",
    help="Serve gRPC over TLS (ALPN h2), with --grpc-server-cert and --grpc-server-key; "
    "as Triton's, it takes a value too (--grpc-use-ssl=1, --grpc-use-ssl=true).",
)
@click.option(
    "--grpc-use-ssl-mutual",
    type=click.BOOL,
    is_flag=False,
    flag_value=True,
    default=False,
    show_default=True,
    metavar="[BOOL]",
    help="Serve gRPC over mutual TLS: as --grpc-use-ssl (which it implies), and every "
    "client must present a certificate signed by --grpc-root-cert.",
)
@click.option(
    "--grpc-server-cert",
    type=click.Path(dir_okay=False, path_type=str),
    default=None,
    metavar="FILE",
    help="The server's PEM certificate (and its chain) for gRPC over TLS.",
)
@click.option(
    "--grpc-server-key",
    type=click.Path(dir_okay=False, path_type=str),
    default=None,
    metavar="FILE",
    help="The PEM private key of --grpc-server-cert (not encrypted).",
)
@click.option(
    "--grpc-root-cert",
    type=click.Path(dir_okay=False, path_type=str),
    default=None,
    metavar="FILE",
    help="PEM certificate(s) that client certificates must be signed by; used with "
    "--grpc-use-ssl-mutual only (as Triton's).",
)
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    default=None,
    metavar="FILE",
    help=f"A TOML file with any of these options ({', '.join(sorted(_SERVE_KEYS - {'limits'}))}) "
    "and a [limits] table; options given on the command line win.",
)
@click.option(
    "--model",
    "models",
    multiple=True,
    metavar="NAME",
    help="Load only this model at start (repeatable). Default: every model in the repository.",
)
@click.option(
    "--drain-period",
    type=Seconds(zero=True),
    default=10.0,
    show_default=True,
    metavar="SECONDS",
    help="On SIGINT/SIGTERM, how long in-flight requests may take to finish.",
)
@click.option(
    "--exit-timeout-secs",
    type=Seconds(zero=True),
    default=None,
    metavar="SECONDS",
    help="On SIGINT/SIGTERM, how long the whole exit may take (the drain, then cancelling "
    "what still runs and closing the models): past it the process ends anyway with exit "
    "status 1, naming in the log the executions that still run (a Python model's plain def "
    "infer cannot be interrupted). Triton's --exit-timeout-secs. At least --drain-period. "
    f"Default: the drain period + {EXIT_MARGIN_S:.0f}s. With --workers the supervisor kills "
    "the workers still running half a second past it (as one process gives its last "
    "cancel) and exits with status 1, naming them.",
)
@click.option(
    "--repository-poll-secs",
    type=Seconds(zero=True),
    default=0.0,
    show_default=True,
    metavar="SECONDS",
    help="Read the model repository every SECONDS and load the models that appeared, "
    "reload those whose files changed and unload those that went away (Triton's "
    "--model-control-mode=poll); meanwhile the repository API's load and unload are "
    "refused. 0: never. Not with --model.",
)
@click.option(
    "--strict-readiness/--no-strict-readiness",
    default=False,
    show_default=True,
    help="Say ready (/v2/health/ready, gRPC ServerReady) only while every model the server "
    "tried to load serves: one whose load failed makes it not ready (Triton's "
    "--strict-readiness, on there by default).",
)
@click.option(
    "--exit-on-error/--no-exit-on-error",
    default=False,
    show_default=True,
    help="Stop (exit status 1) when a model fails to load at start, instead of serving the "
    "others (Triton's --exit-on-error, on there by default).",
)
@click.option(
    "--disable-auto-complete-config",
    is_flag=True,
    default=False,
    help="Serve each config.pbtxt as written (Triton's flag): a Triton Python model's "
    "auto_complete_config is not run, and a model whose config.pbtxt declares no input or "
    "output fails its load, ONNX models included (their graph is not read for them). "
    "Models with a config.toml, or no config file, read their tensors from the model file "
    "as ever.",
)
@click.option(
    "--cache-size",
    type=ByteSize(),
    default="0",
    show_default=True,
    metavar="BYTES",
    help="The response cache's size (e.g. 256MiB, 1GB) for the models whose config.toml "
    "sets response_cache = true; 0: no cache.",
)
@click.option(
    "--rate-limit",
    type=click.Choice(["off", "execution_count"]),
    default="off",
    show_default=True,
    help="As Triton's: with execution_count, an instance runs an execution only once it "
    "has taken the resources its instance group declares (config.pbtxt's "
    "rate_limiter, config.toml's resources and global_resources) from the pools shared "
    "by every model; off runs instances as if they declared none.",
)
@click.option(
    "--rate-limit-resource",
    multiple=True,
    metavar="NAME:COUNT[:DEVICE]",
    help="A resource pool's size (repeatable), as Triton's: on DEVICE (a GPU number, or "
    "cpu / cuda:N), or without it on every device (and for a global resource). A pool "
    "not sized holds the largest need of any loaded instance.",
)
@click.option(
    "--metrics-interval-ms",
    type=int,
    default=2000,
    show_default=True,
    metavar="MS",
    help="Sample the machine's CPU, memory and GPUs for /metrics every MS milliseconds "
    "(1 to 86400000, a day), off the event loop; a scrape reads the last sample, and the "
    "CPU's utilization is over the last interval (Triton's --metrics-interval-ms).",
)
@click.option(
    "--allow-cpu-metrics/--no-allow-cpu-metrics",
    default=True,
    show_default=True,
    help="Report the machine's CPU utilization and memory on /metrics, from /proc "
    "(Triton's --allow-cpu-metrics).",
)
@click.option(
    "--allow-gpu-metrics/--no-allow-gpu-metrics",
    default=True,
    show_default=True,
    help="Report each GPU's utilization, memory and power on /metrics, through NVML "
    "(the nvidia-ml-py package of the gpu extra), where it finds a driver (Triton's "
    "--allow-gpu-metrics).",
)
@click.option(
    "--http-header-forward-pattern",
    default=None,
    metavar="REGEX",
    help="Forward the HTTP request headers whose names REGEX matches (searched, "
    "case-insensitively; a leading (?-i) makes it case-sensitive) to the model as string "
    "parameters, on infer, generate and generate_stream; a header wins over a body "
    "parameter of its name (Triton's --http-header-forward-pattern). Default: none.",
)
@click.option(
    "--grpc-header-forward-pattern",
    default=None,
    metavar="REGEX",
    help="The same for gRPC metadata (ModelInfer, ModelStreamInfer); binary (-bin) "
    "metadata is never forwarded (Triton's --grpc-header-forward-pattern).",
)
@click.option(
    "--admin-token",
    envvar="TRIOINFER_ADMIN_TOKEN",
    default=None,
    metavar="TOKEN",
    help="Require 'Authorization: Bearer TOKEN' for repository load/unload "
    "(also read from $TRIOINFER_ADMIN_TOKEN).",
)
@click.option(
    "--protect-inference",
    is_flag=True,
    default=False,
    help="Require the admin token for inference and metadata too.",
)
@click.option(
    "--trace-exporter",
    type=click.Choice(["otlp", "console", "none"]),
    default=None,
    help="Send OpenTelemetry spans of each request (queue, batch, compute) to an OTLP "
    "collector over HTTP (endpoint from OTEL_EXPORTER_OTLP_ENDPOINT, default "
    "http://localhost:4318), print them (console), or not at all. Default: "
    "$OTEL_TRACES_EXPORTER, else none. Needs the otel extra.",
)
@click.option(
    "--trace-rate",
    type=click.FloatRange(0, 1),
    callback=not_nan("a ratio between 0 and 1"),
    default=None,
    metavar="RATIO",
    help="The share of requests that start a trace which are traced (0.001 = 1 in 1000); "
    "a request with a sampled traceparent header is always traced. Default: from "
    "OTEL_TRACES_SAMPLER and OTEL_TRACES_SAMPLER_ARG, else 1. Changed at run time by "
    "POST /v2/trace/setting.",
)
@click.option(
    "--loop",
    type=click.Choice(["trio", "asyncio"]),
    default="trio",
    show_default=True,
    help="The event loop: Trio, or asyncio (the same HTTP/1.1 server runs on both).",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1, max=MAX_WORKERS),
    default=1,
    show_default=True,
    metavar="N",
    help="Serve from N processes on one port (SO_REUSEPORT), each with its own engine; "
    "this process supervises them (restarts one that dies). Each serves gRPC too, on "
    "the one --grpc-port. For when one event loop is the limit; 1 serves from this "
    f"process alone. At most {MAX_WORKERS}.",
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    show_default=True,
    help="Log verbosity (logs go to stderr); /v2/logging changes it while serving.",
)
@click.option(
    "--log-format",
    type=click.Choice(["default", "ISO8601", "json"]),
    default="default",
    show_default=True,
    help="The log lines' form: default (local time), ISO8601 (UTC times; both Triton's), or "
    "json: one JSON object per line (time, level, logger, message, pid, and the fields a "
    "line carries: model, status, ...) for Loki, ELK or Cloud Logging. /v2/logging's "
    "log_format changes it while serving.",
)
@click.option(
    "--access-log/--no-access-log",
    default=False,
    show_default=True,
    help="Log every HTTP request and gRPC call (method, path, model, version, status, "
    "duration, request id, peer, bytes) at INFO on the trioinfer.access logger, as "
    "uvicorn's access log. /v2/logging's access_log switches it while serving.",
)
@click.pass_context
def serve(ctx: click.Context, /, **options: Any) -> None:
    """Serve a model repository over the KServe V2 protocol (Open Inference Protocol).

    Opens one engine, loads every model of the repository (each version its
    config.toml's version_policy selects, or Triton's config.pbtxt read as it
    is; without either, defaults completed from the ONNX file), and serves the
    V2 REST API on Trio (or asyncio, --loop): health, server and model
    metadata, model config, inference with JSON or binary tensors, system
    shared memory, classification, the model repository extension (index,
    load, unload), statistics, Prometheus metrics at /metrics, trace
    settings at /v2/trace/setting (OpenTelemetry, with --trace-exporter), and
    log settings at /v2/logging (the level and time format of the logs).
    With the 'grpc' extra it serves the same over V2 gRPC too (Triton's
    inference.GRPCInferenceService, streaming included), from the same engine
    with the same limits and token (sent as 'authorization' metadata).
    NVIDIA's tritonclient (http and grpc) works against it unchanged.
    --grpc-use-ssl (or --grpc-use-ssl-mutual, which requires client
    certificates) serves gRPC over TLS with Triton's flags; --http-ssl-cert
    and --http-ssl-key serve HTTPS (trioinfer's own flags). The certificate
    files are checked before anything loads.

    With no options it serves the bundled example repository on
    http://127.0.0.1:8000 and gRPC on 127.0.0.1:8001: "digits" (an ONNX MLP
    over 8x8 images), "scale_image" and "digit_names" (Python models),
    "read_digit" (a pipeline of those three that batches whole requests, up
    to 32 in 2 ms), "repeat_int32" (a streaming model) and "accumulator" (a
    stateful model: sequences, the sum kept as implicit state). SIGINT or SIGTERM
    makes it not ready at once, lets in-flight requests finish for up to the
    drain period (a pipeline's request runs its remaining steps), and exits 0.
    An execution that cannot be interrupted (a Python model's plain def infer
    stuck on its thread) would hold the exit for ever: past --exit-timeout-secs
    (or 1 s after a second signal) the process ends anyway with exit status
    1, the log naming what still ran. A signal at any moment of the start
    (the imports included) stops it, with exit status 0. Any other failure
    to start exits 1, and invalid options or settings 2.

    With --workers N, N processes serve the same port, each with its own
    engine and sessions on the same devices, and this process supervises
    them: it restarts one that dies (its in-flight requests fail with their
    connections), applies repository load/unload (and trace and log
    settings) on every worker before answering, adds up statistics and
    /metrics across them (a Python model's own gauge combines as it declares),
    and on SIGINT or SIGTERM drains them all. A worker
    that cannot start stops serve with its error. Every worker serves gRPC
    too, on the one --grpc-port (SO_REUSEPORT, as HTTP). Shared-memory
    regions need --workers 1 (each process maps its own).
    """
    try:
        from ..server import Limits, ServerConfig
        from ..server._logging import install_handler
    except ModuleNotFoundError as exc:
        raise needs_extra("serve", exc) from exc

    if ctx.args:
        # `trioinfer serve models/`, as other servers take it.
        meant = (
            "the model repository is --model-repository {arg}"
            if Path(ctx.args[0]).is_dir()
            else "the model repository is --model-repository DIR, and one of its models "
            "--model {arg}"
        )
        no_arguments(ctx, meant)
    settings = _serve_settings(ctx, options)
    _check_admin_token(ctx, settings)
    if settings["protect_inference"] is True and settings["admin_token"] is None:
        # Said here in the words the user set it with (the config's own check names keys).
        raise click.UsageError(
            f"invalid server settings: {_said(settings, 'protect_inference')} needs an admin "
            "token to check: give --admin-token, $TRIOINFER_ADMIN_TOKEN or admin_token in the "
            "--config file"
        )
    install_handler(
        settings["log_level"], log_format=settings["log_format"], requests=settings["access_log"]
    )
    workers = settings["workers"]
    if not isinstance(workers, int) or isinstance(workers, bool) or not 1 <= workers <= MAX_WORKERS:
        raise click.UsageError(
            f"invalid server settings: workers must be from 1 to {MAX_WORKERS}, got {workers!r}"
        )
    _check_host(settings["host"], settings)
    try:
        limits = Limits(**settings.get("limits", {}))
        # Under --workers each worker builds its own provider: here they are only checked.
        tracing = _tracing(settings, build=workers == 1)
        config = ServerConfig(
            limits=limits,
            admin_token=settings["admin_token"],
            protect_inference=settings["protect_inference"],
            drain_period=settings["drain_period"],
            cache_size=ByteSize().convert(settings["cache_size"], None, ctx),
            tracer_provider=tracing[0] if tracing else None,
            trace_rate=tracing[1] if tracing else 1.0,
            repository_poll_s=settings["repository_poll_secs"],
            strict_readiness=settings["strict_readiness"],
            exit_on_error=settings["exit_on_error"],
            disable_auto_complete_config=settings["disable_auto_complete_config"],
            rate_limit=settings["rate_limit"],
            rate_limit_resources=settings["rate_limit_resource"],
            metrics_interval_s=settings["metrics_interval_ms"] / 1000,
            allow_cpu_metrics=settings["allow_cpu_metrics"],
            allow_gpu_metrics=settings["allow_gpu_metrics"],
            grpc_tls=_grpc_tls(settings),
            http_tls=_http_tls(settings),
            http_header_forward_pattern=settings["http_header_forward_pattern"],
            grpc_header_forward_pattern=settings["grpc_header_forward_pattern"],
        )
    except (TypeError, TrioInferError) as exc:
        raise click.UsageError(f"invalid server settings: {exc}") from exc
    if config.repository_poll_s and settings["models"]:
        # The poll serves what the repository holds; --model would serve a part of it.
        raise click.UsageError(
            "invalid server settings: --model and --repository-poll-secs do not go "
            "together: a polled server serves every model of its repository (as Triton's "
            "poll mode); move the others out of it, or drop one of the two"
        )
    exit_timeout = _exit_timeout(settings, config.drain_period)
    repository = settings["model_repository"] or example_repository()
    grpc_port = _grpc_port(ctx, settings)
    if grpc_port is None and settings["grpc_header_forward_pattern"] is not None:
        # It would forward nothing, unnoticed: whoever gave it expects gRPC to be served.
        raise click.UsageError(
            "invalid server settings: "
            f"{_said_key(settings, 'grpc_header_forward_pattern')} forwards gRPC metadata, "
            f"but {_said(settings, 'grpc')} serves no gRPC; drop one of the two"
        )
    if config.grpc_tls is not None:
        if grpc_port is None:
            raise click.UsageError(
                f"invalid server settings: {_said_tls(settings)} serves gRPC over TLS, but "
                f"{_said(settings, 'grpc')} serves no gRPC; drop one of the two"
            )
        _check_tls_files(config.grpc_tls, settings)
    if config.http_tls is not None:
        _check_tls_files(config.http_tls, settings, http=True)
    try:
        # Not anyio.run: a SIGINT held since the start goes to the loop's own handling.
        if workers == 1:
            _start_signals.run(
                functools.partial(
                    _serve,
                    repository,
                    host=settings["host"],
                    port=settings["port"],
                    config=config,
                    models=list(settings["models"]) or None,
                    grpc_port=grpc_port,
                    exit_timeout=exit_timeout,
                ),
                backend=settings["loop"],
            )
        else:
            # The supervisor runs on Trio whatever --loop says; the workers run on --loop.
            _start_signals.run(
                functools.partial(
                    _serve_workers,
                    repository,
                    workers=workers,
                    host=settings["host"],
                    port=settings["port"],
                    config=config,
                    models=list(settings["models"]) or None,
                    grpc_port=grpc_port,
                    loop=settings["loop"],
                    log_level=settings["log_level"],
                    log_format=settings["log_format"],
                    access_log=settings["access_log"],
                    trace=(settings.get("trace_exporter"), settings.get("trace_rate")),
                    # Not given: the supervisor's own margin past the drain period.
                    exit_timeout=(
                        exit_timeout if settings.get("exit_timeout_secs") is not None else None
                    ),
                ),
                backend="trio",
            )
    except (TrioInferError, OSError, BaseExceptionGroup) as exc:
        # Task groups wrap what fails at start-up; say the one cause plainly.
        from ..server._workers import WorkerFailed

        cause = _only_cause(exc)
        if isinstance(cause, WorkerFailed) and cause.logged:
            # The supervisor's ERROR line said it, with the workers' pids (a
            # WorkerFailed at the exit timeout): printing it again only repeats it.
            raise click.exceptions.Exit(1) from exc
        if isinstance(cause, TrioInferError):
            raise click.ClickException(f"{type(cause).__name__}: {cause}") from exc
        if isinstance(cause, OSError):  # e.g. the port is taken
            said = cause.strerror or str(cause)
            if said.startswith("cannot listen"):  # the gRPC layer names its own address
                raise click.ClickException(said) from exc
            why = cause.strerror or str(cause)
            if cause.errno == errno.EADDRNOTAVAIL:
                why += " (it is not an address of this host; 0.0.0.0 listens on all of them)"
            elif cause.errno == errno.EADDRINUSE:
                why += (
                    " (another process listens there, perhaps another trioinfer serve: stop "
                    "it, or choose another --port; --port 0 picks a free one)"
                )
            raise click.ClickException(
                f"cannot listen on {settings['host']}:{settings['port']}: {why}"
            ) from exc
        raise
    finally:
        if tracing and tracing[0] is not None:
            tracing[0].shutdown()  # sends the spans still buffered


def _exit_timeout(settings: Mapping[str, Any], drain_period: float) -> float:
    """The bound on the exit after the first signal, in seconds (see `_watch_the_exit`).

    With --workers the supervisor bounds it (`serve_workers`' *exit_timeout*).
    """
    given = settings.get("exit_timeout_secs")
    if given is None:
        return drain_period + EXIT_MARGIN_S
    if given < drain_period:
        raise click.UsageError(
            f"invalid server settings: {_said(settings, 'exit_timeout_secs')} is shorter than "
            f"{_said(settings, 'drain_period')}: the process would end in the middle of the "
            "drain; the drain period is what requests in flight get, the exit timeout what the "
            "whole exit gets (at least as long)"
        )
    return float(given)


def _check_admin_token(ctx: click.Context, settings: Mapping[str, Any]) -> None:
    # Checked here, not only by ServerConfig, to name the flag, variable or key the
    # token came from: ServerConfig's own message names its field, admin_token, which
    # `--admin-token=` never typed. The token itself is not shown.
    token = settings["admin_token"]
    from_environment = (
        ctx.get_parameter_source("admin_token") is click.core.ParameterSource.ENVIRONMENT
    )
    if token is None and os.environ.get("TRIOINFER_ADMIN_TOKEN") == "":
        # click reads an empty variable as unset, which would serve with no token at all.
        token, from_environment = "", True
    if token is None:
        return
    if from_environment and "admin_token" not in settings.get(_FROM_FILE, {}):
        name = "$TRIOINFER_ADMIN_TOKEN"
    else:
        name = _said_key(settings, "admin_token")
    try:
        check_token(token, name=name)
    except ConfigError as exc:
        raise click.UsageError(f"invalid server settings: {exc}") from None


def _check_host(host: object, settings: Mapping[str, Any] | None = None) -> None:
    # "localhost:8000" would fail later as an unknown name; say what --host takes now.
    if not isinstance(host, str) or not host.strip():
        said = _said(settings, "host") if settings is not None else f"--host {host!r}"
        raise click.UsageError(
            f"invalid server settings: {said} is not an address: give an address (127.0.0.1, "
            "0.0.0.0, ::1, or a host name)"
        )
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            said = _said(settings, "host") if settings is not None else f"--host {host!r}"
            # Where the port goes, beside where the host came from.
            port = "its own key, port" if not said.startswith("--") else "--port"
            raise click.UsageError(
                f"{said} is not an address: give the address alone (127.0.0.1, "
                f"0.0.0.0, ::1, or a host name) and the port with {port}"
            ) from None


def _tracing(settings: dict[str, Any], *, build: bool) -> tuple[Any, float] | None:
    # The tracer provider and rate (None: off); with *build* False, checked only (provider None).
    from .._trace_settings import check_trace_settings, provider_from_settings

    exporter, rate = settings.get("trace_exporter"), settings.get("trace_rate")
    if exporter is not None and exporter != "none":
        try:
            import opentelemetry.sdk  # noqa: F401  # only to say which extra is missing
        except ModuleNotFoundError as exc:
            raise click.ClickException(
                f"{_said(settings, 'trace_exporter')} needs the 'otel' extra, which is not "
                "installed "
                f"(no module named {exc.name!r}): install trioinfer with it, e.g. "
                "pip install -e '.[cpu,serve,otel]' in a clone"
            ) from exc
    if not build:
        checked = check_trace_settings(exporter, rate, environ=os.environ)
        return None if checked is None else (None, checked[1])
    return provider_from_settings(exporter, rate, environ=os.environ)


def _grpc_port(ctx: click.Context, settings: dict[str, Any]) -> int | None:
    """The port to serve gRPC on, or None for HTTP only.

    Asked for explicitly (--grpc, --grpc-port, a --grpc-use-ssl* or
    --grpc-header-forward-pattern option, or their keys in --config) without
    the extra, it is an error; by default, serve says why there is no gRPC and
    serves HTTP. With --port 0 and no --grpc-port, gRPC takes a free port too,
    so that servers started on free ports never clash on 8001 (under --workers
    N the supervisor picks it, one port that every worker serves).
    """
    if not settings["grpc"]:
        return None
    source = click.core.ParameterSource
    from_file = settings.get(_FROM_FILE, {})
    port_given = (
        ctx.get_parameter_source("grpc_port") not in (None, source.DEFAULT)
        or "grpc_port" in from_file
        or settings["grpc_port"] != DEFAULT_GRPC_PORT
    )
    grpc_given = ctx.get_parameter_source("grpc") not in (None, source.DEFAULT) or (
        "grpc" in from_file
    )
    tls_given = bool(settings.get("grpc_use_ssl") or settings.get("grpc_use_ssl_mutual"))
    forward_given = settings.get("grpc_header_forward_pattern") is not None
    asked = port_given or grpc_given or tls_given or forward_given
    missing = [m for m in ("grpc", "grpc_tools", "google.protobuf") if not _importable(m)]
    if missing:
        why = (
            f"gRPC needs the 'grpc' extra, which is not installed (no module named "
            f"{missing[0]!r}): install trioinfer with it, e.g. pip install -e '.[cpu,grpc]' "
            "in a clone"
        )
        if asked:
            raise click.UsageError(why)
        logging.getLogger("trioinfer.server").warning("not serving gRPC: %s", why)
        return None
    if not port_given and settings["port"] == 0:
        return 0
    grpc_port = int(settings["grpc_port"])
    if grpc_port != 0 and grpc_port == settings["port"]:
        # Both would bind it, and the second would fail as "address in use".
        raise click.UsageError(
            f"{_said(settings, 'grpc_port')} is also the HTTP port "
            f"({_said(settings, 'port')}): HTTP and gRPC need a port each; pick another "
            f"{_said_key(settings, 'grpc_port')} (Triton's is 8001), or pass --no-grpc"
        )
    return grpc_port


def _grpc_tls(settings: Mapping[str, Any]) -> Any:
    """The gRPC endpoint's `TlsFiles` from the --grpc-use-ssl* options, or None for plaintext.

    As Triton's: --grpc-use-ssl-mutual implies --grpc-use-ssl, and the files are
    ignored without either (said on the log, since a forgotten flag would
    otherwise serve plaintext unnoticed).
    """
    from ..server._tls import TlsFiles

    mutual = bool(settings.get("grpc_use_ssl_mutual"))
    files = {k: settings.get(f"grpc_{k}") for k in ("server_cert", "server_key", "root_cert")}
    if not (settings.get("grpc_use_ssl") or mutual):
        given = [_said_key(settings, f"grpc_{k}") for k, v in files.items() if v is not None]
        if given:
            logging.getLogger("trioinfer.server").warning(
                "%s given without --grpc-use-ssl or --grpc-use-ssl-mutual: ignored, gRPC is "
                "served in plaintext",
                ", ".join(given),
            )
        return None
    missing = [_said_key(settings, f"grpc_{k}") for k in ("server_cert", "server_key")]
    missing = [
        m for m, k in zip(missing, ("server_cert", "server_key"), strict=True) if not files[k]
    ]
    if missing:
        raise click.UsageError(
            f"invalid server settings: {_said_tls(settings)} needs the server's certificate and "
            f"key, and {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not given"
        )
    if mutual and not files["root_cert"]:
        raise click.UsageError(
            f"invalid server settings: {_said(settings, 'grpc_use_ssl_mutual')} needs "
            f"{_said_key(settings, 'grpc_root_cert')}, the certificate(s) client certificates "
            "must be signed by"
        )
    return TlsFiles(
        files["server_cert"], files["server_key"], files["root_cert"] if mutual else None, mutual
    )


def _said_tls(settings: Mapping[str, Any]) -> str:
    # Which of the two switches turned TLS on, as the user gave it.
    key = "grpc_use_ssl_mutual" if settings.get("grpc_use_ssl_mutual") else "grpc_use_ssl"
    return _said(settings, key)


def _http_tls(settings: Mapping[str, Any]) -> Any:
    """The HTTP endpoint's `TlsFiles` from --http-ssl-cert and --http-ssl-key, or None."""
    from ..server._tls import TlsFiles

    cert, key = settings.get("http_ssl_cert"), settings.get("http_ssl_key")
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        given, missing = ("http_ssl_cert", "http_ssl_key")[:: 1 if cert is not None else -1]
        raise click.UsageError(
            f"invalid server settings: {_said_key(settings, given)} needs "
            f"{_said_key(settings, missing)} too (HTTPS needs the certificate and its key)"
        )
    return TlsFiles(cert, key)


def _check_tls_files(files: Any, settings: Mapping[str, Any], *, http: bool = False) -> None:
    # Read once here, before a model loads or a worker starts: a bad file stops serve now.
    from ..server._tls import server_context

    keys = (
        {"cert": "http_ssl_cert", "key": "http_ssl_key"}
        if http
        else {"cert": "grpc_server_cert", "key": "grpc_server_key", "root": "grpc_root_cert"}
    )
    flags = {which: _said_key(settings, key) for which, key in keys.items()}
    try:
        server_context(files, alpn="http/1.1" if http else "h2", flags=flags)
    except TrioInferError as exc:
        what = "HTTPS" if http else "gRPC over TLS"
        raise click.ClickException(f"cannot serve {what}: {exc}") from None


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ModuleNotFoundError, ValueError):  # a parent package is missing, or blocked
        return False


def _only_cause(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _serve_settings(ctx: click.Context, options: dict[str, Any]) -> dict[str, Any]:
    settings = dict(options)
    config_file: Path | None = settings.pop("config_file")
    if config_file is None:
        return settings
    try:
        data = parse_toml(config_file.read_bytes(), str(config_file))
    except OSError as exc:
        raise click.BadParameter(f"{config_file}: {exc}", param_hint="--config") from exc
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--config") from exc
    unknown = sorted(set(data) - _SERVE_KEYS)
    if unknown:
        raise click.BadParameter(
            f"{config_file}: unknown key {', '.join(map(repr, unknown))}; known keys are "
            f"{', '.join(sorted(_SERVE_KEYS))}{_did_you_mean(unknown, _SERVE_KEYS)}",
            param_hint="--config",
        )
    if "limits" in data:
        _check_limits(data["limits"], config_file)
    if "model_repository" in data:
        _check_string(config_file, "model_repository", data["model_repository"])
        data["model_repository"] = config_file.parent / data["model_repository"]
    for key in (
        "grpc_server_cert",
        "grpc_server_key",
        "grpc_root_cert",
        "http_ssl_cert",
        "http_ssl_key",
    ):
        if key in data:
            # Beside the file, as model_repository is.
            _check_string(config_file, key, data[key])
            data[key] = str(config_file.parent / data[key])
    params = {param.name: param for param in ctx.command.params}
    from_file: dict[str, Path] = {}
    for key, value in data.items():
        if key not in ("limits", "model_repository"):
            # Checked where the command line wins too: `port = "x"` beside --port 0 was
            # taken without a word, and failed only once the flag was dropped.
            value = _file_value(ctx, params[key], config_file, key, value)
        source = ctx.get_parameter_source(key) if key in settings else None
        if source not in (None, click.core.ParameterSource.DEFAULT):
            continue  # the command line wins (model_repository's once did not)
        settings[key] = value
        from_file[key] = config_file
    settings[_FROM_FILE] = from_file
    return settings


#: The settings key under which `_serve_settings` notes which came from --config (and its path).
_FROM_FILE: Final = "_from_file"


def _said(settings: Mapping[str, Any], key: str) -> str:
    """*key* as the user set it, for a message: ``--grpc-port 9001`` or ``grpc_port = 9001 in F``.

    A message that names a flag the user never typed (they wrote the key in
    their --config file) sends them looking for it on a command line they
    did not write.
    """
    value = settings[key]
    where = settings.get(_FROM_FILE, {}).get(key)
    if where is not None:
        shown = str(value).lower() if isinstance(value, bool) else repr(value)
        return f"{key} = {shown} in {where}"
    flag = "--" + key.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else f"--no-{key.replace('_', '-')}"
    if isinstance(value, str) and not value.isidentifier():
        return f"{flag} {value!r}"  # quoted where a shell would need it: 'localhost:8000'
    return f"{flag} {value}"


def _said_key(settings: Mapping[str, Any], key: str) -> str:
    """*key*'s name as the user gave it: ``--grpc-port``, or ``grpc_port in F``."""
    where = settings.get(_FROM_FILE, {}).get(key)
    return f"{key} in {where}" if where is not None else "--" + key.replace("_", "-")


def _file_value(
    ctx: click.Context, param: click.Parameter, config_file: Path, key: str, value: Any
) -> Any:
    """*value* of the --config file's *key*, checked and converted as the option's own.

    Without this a file's value reached the server unchecked: ``port = "x"`` ended in a
    TypeError traceback, ``log_level = 3`` in an AttributeError, ``models = "digits"``
    loaded the models 'd', 'i', ...
    """
    if isinstance(param.type, click.types.StringParamType) and not param.multiple:
        _check_string(config_file, key, value)  # click would make 5 the string "5"
    if (
        isinstance(param.type, click.types.StringParamType)
        and param.multiple
        and not (isinstance(value, list) and all(isinstance(item, str) for item in value))
    ):
        # models = [1] would load a model named '1'; models = "digits" said only "Value
        # must be an iterable".
        hint = f' (write {key} = ["{value}"])' if isinstance(value, str) else ""
        raise click.BadParameter(
            f"{config_file}: {key} must be a list of strings, got {value!r}{hint}",
            param_hint="--config",
        )
    if isinstance(value, bool) and not isinstance(param.type, click.types.BoolParamType):
        # click would make true the number 1: port = true would listen on port 1.
        what = (
            "an integer"
            if isinstance(param.type, click.types.IntParamType)
            else "a number"
            if isinstance(param.type, click.types.FloatParamType)
            else f"a {param.type.name} value"
        )
        raise click.BadParameter(
            f"{config_file}: {key} = {str(value).lower()}: expected {what}, not a boolean",
            param_hint="--config",
        )
    if isinstance(value, float) and isinstance(param.type, click.types.IntParamType):
        # click would cut 1.5 to 1: metrics_interval_ms = 1.5 would sample every 1 ms.
        raise click.BadParameter(
            f"{config_file}: {key} = {value!r}: expected an integer", param_hint="--config"
        )
    try:
        return param.process_value(ctx, value)
    except click.BadParameter as exc:
        raise click.BadParameter(
            f"{config_file}: {key} = {value!r}: {exc.message}", param_hint="--config"
        ) from None


def _did_you_mean(unknown: Sequence[str], known: Iterable[str]) -> str:
    """``; did you mean 'port' for 'prot'?`` for each unknown key close to a known one."""
    known = sorted(known)
    hints = [
        f"; did you mean {close[0]!r} for {key!r}?"
        for key in unknown
        if (close := difflib.get_close_matches(key, known, n=1))
    ]
    return "".join(hints)


def _check_string(config_file: Path, key: str, value: Any) -> None:
    if not isinstance(value, str):
        raise click.BadParameter(
            f"{config_file}: {key} must be a string, got {value!r}", param_hint="--config"
        )


def _check_limits(limits: Any, config_file: Path) -> None:
    from ..server import Limits

    known = sorted(field.name for field in attrs.fields(Limits))
    if not isinstance(limits, dict):
        raise click.BadParameter(
            f"{config_file}: limits must be a table ([limits]) of {', '.join(known)}; "
            f"got {limits!r}",
            param_hint="--config",
        )
    unknown = sorted(set(limits) - set(known))
    if unknown:
        raise click.BadParameter(
            f"{config_file}: unknown key {', '.join(map(repr, unknown))} in [limits]; "
            f"known keys are {', '.join(known)}{_did_you_mean(unknown, known)}",
            param_hint="--config",
        )
    try:
        Limits(**limits)
    except (TypeError, TrioInferError) as exc:
        # Said with the file it is in, as the file's other errors are (the server's
        # settings are checked again, whole, where the command line's join them).
        raise click.BadParameter(f"{config_file}: [limits] {exc}", param_hint="--config") from None


async def _serve(
    repository: Path,
    *,
    host: str,
    port: int,
    config: Any,
    models: list[str] | None,
    grpc_port: int | None,
    exit_timeout: float,
) -> None:
    from ..server import serve_http

    def banner(listening: Any) -> None:
        _settle_gc()
        url = listening.urls[0]
        _banner(
            listening.models,
            listening.failed,
            repository,
            url,
            _grpc_line(listening.grpc, config.grpc_tls),
            f"listening on {url} (Ctrl+C to stop)",
            protected=config.protect_inference,
        )

    _exit.EXIT_TIMEOUT_SAID.set("--exit-timeout-secs")  # the log names the flag, not serve_http's
    await serve_http(
        repository,
        host=host,
        port=port,
        config=config,
        models=models,
        grpc_port=grpc_port,
        exit_timeout=exit_timeout,
        task_status=_OnStarted(banner),
    )


async def _serve_workers(repository: Path, *, workers: int, **options: Any) -> None:
    from ..server._workers import serve_workers

    def banner(listening: Any) -> None:
        url = listening.urls[0]
        pids = ", ".join(map(str, listening.pids))
        # A worker stopped at start to be restarted (it served other things than the
        # others) is not named: its pid would be another's a moment later.
        how_many = (
            f"{workers} workers"
            if len(listening.pids) == workers
            else f"{len(listening.pids)} of {workers} workers (the others restart)"
        )
        _banner(
            listening.models,
            listening.failed,
            repository,
            url,
            _grpc_line(listening.grpc, options["config"].grpc_tls),
            f"{how_many} (pids {pids}) listening on {url} (Ctrl+C to stop)",
            protected=options["config"].protect_inference,
        )

    await serve_workers(repository, workers=workers, **options, task_status=_OnStarted(banner))


class _OnStarted(anyio.abc.TaskStatus[Any]):
    """A task status that calls *then* with what the server reports once it listens.

    Not ``nursery.start``: a signal while the models load stops the server
    before it listens, which ``start`` would take for a bug (a RuntimeError).
    """

    def __init__(self, then: Callable[[Any], object]) -> None:
        self._then = then

    def started(self, value: Any = None) -> None:
        """Call *then* with *value* (a `Listening` or a `WorkersListening`)."""
        self._then(value)


def _grpc_line(address: str | None, tls: Any = None) -> str | None:
    """The banner's gRPC line, or None when gRPC is not served; *tls*: its `TlsFiles`."""
    if address is None:
        return None
    over = ""
    if tls is not None:
        over = " over mutual TLS" if tls.mutual else " over TLS"
    return f"gRPC on {address} (inference.GRPCInferenceService{over})"


def _banner(
    models: Mapping[str, Sequence[int]],
    failed: Sequence[str],
    repository: Path,
    url: str,
    grpc_line: str | None,
    listening_line: str,
    *,
    protected: bool = False,
) -> None:
    """Print what is served and where, and a first request to try, on stdout.

    *protected*: the index needs the admin token (``--protect-inference``), so the
    request to try sends it (a placeholder: the token is never printed).

    A stdout nobody reads any more (``serve | head -1``, a closed terminal)
    does not stop the server: a WARNING says so, and stdout goes to
    ``/dev/null`` from then on.
    """
    served = ", ".join(f"{name} (v{', v'.join(map(str, v))})" for name, v in models.items())
    lines = [f"trioinfer {__version__} serving {served or 'no models'} from {repository}"]
    if failed:
        lines.append(f"could not load: {', '.join(failed)} (see the log above)")
    if grpc_line is not None:
        lines.append(grpc_line)
    lines.append(listening_line)
    if models:
        # The repository index names every model and its state: a better first
        # request than whichever model sorts first (often a pipeline's step).
        token = "-H 'Authorization: Bearer <admin token>' " if protected else ""
        lines.append(f"try: curl -s -X POST {token}{url}/v2/repository/index")
    try:
        for line in lines:
            click.echo(line)
        click.echo("", nl=True)
    except OSError as exc:
        # The banner is for a person; the server serves on. What stdout still buffers,
        # and Python's flush at exit, go to /dev/null rather than fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):  # no file descriptor (a test's captured stdout)
            pass
        finally:
            os.close(devnull)
        logging.getLogger("trioinfer.server").warning(
            "could not print the banner on stdout (%s); serving on", exc.strerror or exc
        )


#: The garbage collector's first threshold while serving (Python's default is 700).
SERVE_GC_THRESHOLD: Final = 5_000


def _settle_gc() -> None:
    """Tune the garbage collector for a process that, from now on, only serves.

    What start-up made (modules, sessions, the app) lives until exit:
    `gc.freeze` keeps the collector from walking it again, which on the
    oldest generation cost about 25 ms a time, every few seconds under load.
    A request's objects die by reference counting; with Python's default
    first threshold, the young ones alive at once across a few dozen waiting
    requests still started a collection every few dozen requests (about 4%
    of the server's CPU on small requests, measured on the digits MLP at 64
    connections, before and after). The process is ours, so this is done
    here and not in `serve_http`, which an application may embed.
    """
    gc.freeze()
    first, second, third = gc.get_threshold()
    gc.set_threshold(max(first, SERVE_GC_THRESHOLD), second, third)
    logging.getLogger("trioinfer.server").info(
        "garbage collector: %d objects from start-up frozen; first threshold %d",
        gc.get_freeze_count(),
        gc.get_threshold()[0],
    )
