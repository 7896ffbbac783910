"""Run the V2 server: one engine, the repository's models, the HTTP/1.1 server, graceful stop.

`serve_http` opens the engine, loads the repository, binds the socket and
serves until SIGINT/SIGTERM (or until its caller cancels it). On the first
signal readiness turns false at once, the listener closes, in-flight requests
get `ServerConfig.drain_period` seconds to finish, and the function returns
normally; a second signal stops at once. The whole exit is bounded
(``trioinfer._exit``): past it the process ends.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import ssl
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import attrs
from starlette.types import ASGIApp

from .._engine import Engine, open_engine
from .._exceptions import ConfigError
from .._exit import EXIT_MARGIN_S, bounded_exit
from .._registry import Registry
from ._app import ServerConfig, ServerState, create_app
from ._host_metrics import host_metrics_for
from ._http_server import check_bindable, serve_asgi
from ._metrics import InFlight, Metrics
from ._models import ServedModels, public_names
from ._poll import Fingerprint, poll_repository, snapshot
from ._repository import ModelRepository
from ._tls import HTTP_TLS_FLAGS, ReloadingContext

if TYPE_CHECKING:
    from ._workers import WorkerLink

log = logging.getLogger("trioinfer.server")


class _PublicNames(logging.Filter):
    # The engine names a served version 'digits.v1'; errors and answers say
    # 'digits' (version 1). trioinfer's log lines say it that way too.
    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith("trioinfer"):
            message = record.getMessage()
            public = public_names(message)
            if public != message:
                record.msg, record.args = public, ()
        return True


@contextlib.asynccontextmanager
async def _public_names_in_logs() -> AsyncIterator[None]:
    """While serving, trioinfer's log lines name model versions as answers do."""
    names = _PublicNames()
    handlers = [*logging.getLogger().handlers, *logging.getLogger("trioinfer").handlers]
    for handler in handlers:
        handler.addFilter(names)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(names)


@attrs.frozen
class Listening:
    """Where a started server listens, and what it serves; `serve_http` reports it when ready.

    Attributes:
        urls: The base URLs, e.g. ``("http://127.0.0.1:8000",)``.
        models: The served models and versions, e.g. ``{"digits": (1,)}``.
        failed: Models of the repository that could not be loaded (see the log).
        grpc: Where the V2 gRPC endpoint listens (``host:port``), or None when not served.
    """

    urls: tuple[str, ...]
    models: dict[str, tuple[int, ...]]
    failed: tuple[str, ...]
    grpc: str | None = None

    @property
    def port(self) -> int:
        """The port of the first URL (useful after binding port 0)."""
        return int(self.urls[0].rsplit(":", 1)[1])


async def serve_http(
    repository: str | os.PathLike[str],
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    config: ServerConfig | None = None,
    registry: Registry | None = None,
    models: Sequence[str] | None = None,
    handle_signals: bool = True,
    shutdown: anyio.Event | None = None,
    grpc_port: int | None = None,
    reuse_port: bool = False,
    worker: WorkerLink | None = None,
    exit_timeout: float | None = None,
    task_status: anyio.abc.TaskStatus[Listening] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve *repository* over KServe V2 REST (and gRPC) until a signal (or *shutdown*) stops it.

    Runs on Trio or asyncio (under ``anyio.run(..., backend="asyncio")``),
    over the same HTTP/1.1 server on either (``serve_asgi``, on the llhttp
    parser), with the limits of ``config.limits`` (head size and time, body
    and send timeouts, body size). Cancelling it stops at once, without
    draining.

    Args:
        repository: The model repository directory (``<model>/<version>/model.onnx``).
        host: The address to listen on; loopback by default.
        port: The port; 0 picks a free one (see [`Listening.port`][trioinfer.server.Listening]).
        config: Limits, tokens and the drain period (defaults if None).
        registry: The plugin registry for the engine (entry points by default).
        models: Names of the models to load at start (all of the repository's by default).
        handle_signals: Stop gracefully on SIGINT and SIGTERM (main thread only),
            within *exit_timeout*: a second signal stops at once, a third ends the
            process. A signal while the models load stops at once.
        shutdown: Setting this event stops gracefully, as the first signal does.
        grpc_port: Also serve V2 gRPC (Triton's ``inference.GRPCInferenceService``)
            on this port of *host*, from the same engine; 0 picks a free one. Needs
            the ``grpc`` extra. None: HTTP only.
        reuse_port: Bind with ``SO_REUSEPORT`` (HTTP and gRPC alike), so that
            several processes serve one port (the kernel spreads connections
            among them).
        worker: Internal: this process is one of ``trioinfer serve --workers N``'s.
        exit_timeout: With *handle_signals*: how long the whole exit may take from
            the first signal (the drain, then cancelling what still runs and closing
            the engine), as ``trioinfer serve --exit-timeout-secs``; past it (or 1
            second after a second signal) the process ends with exit status 1, the
            ERROR line naming ``exit_timeout`` and the executions still running (an
            execution on a thread cannot be interrupted, and would hold the process
            for ever). None: the drain period + 10 seconds, the command's default;
            ``math.inf``: unbounded. At least ``config.drain_period``.
        task_status: Reports a [`Listening`][trioinfer.server.Listening] once ready,
            for ``nursery.start``.

    Raises:
        ConfigError: The repository is missing, a named model does not exist, a
            file of ``config.grpc_tls`` or ``config.http_tls`` cannot be read or
            used (checked first), or *exit_timeout* is shorter than the drain period.
        ModuleNotFoundError: *grpc_port* is given but the ``grpc`` extra is not installed.
        OSError: A port cannot be bound (checked before the models load).
    """
    for what, number in (("port", port), ("grpc_port", grpc_port)):
        if number is not None and not 0 <= number <= 65535:
            raise ConfigError(f"{what} must be 0-65535, got {number}")
    serve_grpc = _grpc_layer() if grpc_port is not None else None
    if config is None:
        config = ServerConfig()
    if exit_timeout is None:
        exit_timeout = config.drain_period + EXIT_MARGIN_S
    if not exit_timeout >= config.drain_period:  # NaN too
        raise ConfigError(
            f"exit_timeout must be at least the drain period ({config.drain_period}s): the "
            f"process would end in the middle of the drain; got {exit_timeout}"
        )
    # The certificate files are read now: a bad one stops the start, not a handshake later.
    # Renewed files are picked up for new connections while serving (ReloadingContext).
    grpc_tls = (
        ReloadingContext.load(config.grpc_tls)
        if serve_grpc is not None and config.grpc_tls is not None
        else None
    )
    http_tls = (
        ReloadingContext.load(config.http_tls, alpn="http/1.1", flags=HTTP_TLS_FLAGS)
        if config.http_tls is not None
        else None
    )
    repo = ModelRepository(repository)
    if not reuse_port:
        await _check_ports(host, port, grpc_port)
    stop = shutdown if shutdown is not None else anyio.Event()
    serving = anyio.Event()  # the first signal drains from then on (it cancels before)
    async with (
        bounded_exit(stop, serving, exit_timeout) if handle_signals else contextlib.nullcontext(),
        _public_names_in_logs(),
        _watch_the_close() as watch_the_close,
        _known_until_closed() as make_known,
        open_engine(
            registry=registry,
            drain_period=config.drain_period,
            cache_size=config.cache_size,
            tracer_provider=config.tracer_provider,
            trace_rate=config.trace_rate,
            resources=config.resource_sizes,
            rate_limit=config.rate_limit != "off",
        ) as engine,
    ):
        make_known(engine)
        served = ServedModels(
            engine,
            repo,
            worker=None if worker is None else (worker.index, worker.count),
            auto_complete=not config.disable_auto_complete_config,
        )
        # Polled by this process alone (under --workers, by the supervisor), from what
        # the repository held before its models loaded.
        polling = config.repository_poll_s if worker is None else 0.0
        baseline = await anyio.to_thread.run_sync(snapshot, repo) if polling else None
        # A restarted worker loads what the first workers loaded at start, not every
        # model on disk now, each with its last load's override (then takes the
        # changes made since).
        overrides = worker.start_overrides if worker is not None else {}
        if models is None:
            failed = await served.load_all(
                worker.start_models if worker is not None else None, overrides
            )
        else:
            failed = []
            for name in models:
                await served.load(name, overrides.get(name))
        if failed and config.exit_on_error:
            # Said in the log already, each with why: stop before serving anything.
            raise ConfigError(
                f"--exit-on-error: model(s) {', '.join(map(repr, failed))} failed to load at "
                "start (the log says why); fix or remove them, or serve without --exit-on-error"
            )
        in_flight = InFlight()
        # The machine's metrics once per server: under --workers, the supervisor's.
        machine = host_metrics_for(config) if worker is None else None
        metrics = Metrics(served, in_flight, host=machine)
        state = ServerState(served, config, metrics, in_flight, cluster=worker)
        app = create_app(state)

        async def run_layers(
            *, task_status: anyio.abc.TaskStatus[tuple[list[str], str | None]]
        ) -> None:
            # HTTP and gRPC drain side by side; when both are done, so is serving.
            async with anyio.create_task_group() as layers:
                urls = await layers.start(
                    functools.partial(
                        _serve_lean,
                        app,
                        host,
                        port,
                        config,
                        stop,
                        reuse_port=reuse_port,
                        ssl_context=http_tls,
                    )
                )
                address = None
                if serve_grpc is not None:
                    address = await layers.start(
                        functools.partial(
                            serve_grpc,
                            state,
                            host,
                            grpc_port,
                            shutdown=stop,
                            reuse_port=reuse_port,
                            ssl_context=grpc_tls,
                        )
                    )
                task_status.started((urls, address))
            tg.cancel_scope.cancel()  # drained: the host metrics may go too

        async with anyio.create_task_group() as tg:
            if machine is not None:
                # Sampled while serving, from before the first scrape; stopped (NVML
                # shut down) with the rest of the server's tasks.
                await tg.start(machine.run)
            if worker is not None:
                # Joins the other workers: takes the repository changes made
                # before it started, then receives each one as they do.
                await tg.start(worker.serve_control, state)
            urls, address = await tg.start(run_layers)
            state.ready = True
            listening = Listening(
                tuple(urls),
                {m: tuple(s.version for s in served.versions(m)) for m in _names(served)},
                tuple(failed),
                address,
            )
            if worker is not None:
                await worker.report_ready(listening)
            task_status.started(listening)
            serving.set()
            poll = anyio.CancelScope()  # entered by the poll's task
            if polling:
                tg.start_soon(_poll_until, poll, repo, polling, served, baseline)
            try:
                await stop.wait()
            finally:
                poll.cancel()  # nothing loads or unloads while the server drains
                state.ready = False
                log.info(
                    "not ready; draining in-flight requests for up to %.1fs", config.drain_period
                )
            # The HTTP layer is closing its listener and draining its connections;
            # when it returns, nothing is left to wait for.
        log.info("stopped serving; closing the engine")
        watch_the_close()


#: The engines of the `serve_http` calls running in this process (one under ``trioinfer
#: serve``), for `still_executing`.
_OPEN_ENGINES: list[Engine] = []


@contextlib.asynccontextmanager
async def _known_until_closed() -> AsyncIterator[Callable[[Engine], None]]:
    # Entered before the engine opens, so that it is known until it has closed: its
    # close is what can be held. Yields the function that makes it known.
    known: list[Engine] = []

    def make_known(engine: Engine) -> None:
        known.append(engine)
        _OPEN_ENGINES.append(engine)

    try:
        yield make_known
    finally:
        for engine in known:
            _OPEN_ENGINES.remove(engine)


def still_executing() -> list[str]:
    """The executions and loads in progress in the engines `serve_http` has open in this process.

    For ``trioinfer serve``, which must name them when it ends a process whose
    exit they hold: ``model 'm': instance 0 (cpu), running for 12.3s`` each, and
    ``model 'm': its load, running for 40.0s`` (a Python model's constructor, on a
    thread, say); the model as the engine names it (the log's filter turns ``m.v1``
    into ``'m' (version 1)``).
    """
    return [line for engine in _OPEN_ENGINES for line in engine._executing()]


async def _poll_until(
    scope: anyio.CancelScope,
    repo: ModelRepository,
    interval: float,
    served: ServedModels,
    baseline: dict[str, Fingerprint] | None,
) -> None:
    # The repository poll, until *scope* (the server's serving) is cancelled.
    with scope:
        await poll_repository(repo, interval, served.load, served.unload, baseline=baseline)


#: How long closing the engine may take, after serving stopped, before the log says
#: what it waits for (executions that cannot be interrupted).
CLOSE_NOTICE_S = 5.0


@contextlib.asynccontextmanager
async def _watch_the_close() -> AsyncIterator[Callable[[], object]]:
    # Yields a function to call once serving has stopped: if what follows (the
    # engine's close) takes longer than CLOSE_NOTICE_S, the log says why.
    async with anyio.create_task_group() as tg:
        yield functools.partial(tg.start_soon, _say_what_closing_waits_for)
        tg.cancel_scope.cancel()  # closed: nothing to say


async def _say_what_closing_waits_for() -> None:
    # An execution on a thread (a Python model's plain def infer, say) runs to its
    # end whatever cancels it, and the engine waits for it: without this line the
    # process would seem to hang after "closing the engine".
    await anyio.sleep(CLOSE_NOTICE_S)
    log.warning(
        "still closing the engine %.0fs after serving stopped: waiting for executions that "
        "cannot be interrupted (a Python model's plain def infer runs to its end on its "
        "thread); a second SIGINT or SIGTERM stops at once",
        CLOSE_NOTICE_S,
    )


def _grpc_layer() -> Any:
    # Imported only when asked for: hpack and protobuf stay out of HTTP-only servers.
    try:
        from ._grpc import serve_grpc
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            "serving gRPC needs the 'grpc' extra (install trioinfer with it, e.g. pip "
            f"install -e '.[cpu,grpc]' in a clone); {exc}",
            name=exc.name,
        ) from exc
    return serve_grpc


async def _check_ports(host: str, port: int, grpc_port: int | None) -> None:
    # Loading a repository can take minutes; a port that is taken is said before it.
    # (Workers share their port: the supervisor checks it for them.)
    if port:
        await check_bindable(host, port)
    if grpc_port:
        try:
            await check_bindable(host, grpc_port)
        except OSError as exc:
            from ._grpc import listen_error

            raise listen_error(host, grpc_port, exc) from None


def _names(served: ServedModels) -> list[str]:
    return sorted({s.model for s in served.all()})


async def _serve_lean(
    app: ASGIApp,
    host: str,
    port: int,
    config: ServerConfig,
    stop: anyio.Event,
    *,
    reuse_port: bool = False,
    ssl_context: ssl.SSLContext | ReloadingContext | None = None,
    task_status: anyio.abc.TaskStatus[list[str]],
) -> None:
    limits = config.limits
    await serve_asgi(
        app,
        host,
        port,
        shutdown=stop,
        graceful_timeout=config.drain_period,
        head_timeout=limits.head_timeout,
        body_timeout=limits.body_timeout,
        send_timeout=limits.send_timeout,
        max_head_bytes=limits.max_head_bytes,
        max_headers=limits.max_headers,
        reuse_port=reuse_port,
        ssl_context=ssl_context,
        task_status=task_status,
    )
