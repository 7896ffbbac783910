"""Run the V2 server: one engine, the repository's models, Hypercorn on Trio, graceful stop.

`serve_http` opens the engine, loads the repository, binds the socket and
serves until SIGINT/SIGTERM (or until its caller cancels it). On the first
signal readiness turns false at once, the listener closes, in-flight requests
get `ServerConfig.drain_period` seconds to finish, and the function returns
normally; a second signal stops at once.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Sequence

import attrs
import hypercorn.config
import hypercorn.trio
import trio

from .._engine import open_engine
from .._exceptions import ConfigError
from .._registry import Registry
from ._app import ServerConfig, ServerState, create_app
from ._metrics import InFlight, Metrics
from ._models import ServedModels
from ._repository import ModelRepository

log = logging.getLogger("trioinfer.server")


@attrs.frozen
class Listening:
    """Where a started server listens, and what it serves; `serve_http` reports it when ready.

    Attributes:
        urls: The base URLs, e.g. ``("http://127.0.0.1:8000",)``.
        models: The served models and versions, e.g. ``{"digits": (1,)}``.
        failed: Models of the repository that could not be loaded (see the log).
    """

    urls: tuple[str, ...]
    models: dict[str, tuple[int, ...]]
    failed: tuple[str, ...]

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
    task_status: trio.TaskStatus[Listening] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve *repository* over KServe V2 REST until a signal (or cancellation) stops it.

    Args:
        repository: The model repository directory (``<model>/<version>/model.onnx``).
        host: The address to listen on; loopback by default.
        port: The port; 0 picks a free one (see [`Listening.port`][trioinfer.server.Listening]).
        config: Limits, tokens and the drain period (defaults if None).
        registry: The plugin registry for the engine (entry points by default).
        models: Names of the models to load at start (all of the repository's by default).
        handle_signals: Stop gracefully on SIGINT and SIGTERM (main thread only).
        task_status: Reports a [`Listening`][trioinfer.server.Listening] once ready,
            for ``nursery.start``.

    Raises:
        ConfigError: The repository is missing, or a named model does not exist.
    """
    if not 0 <= port <= 65535:
        raise ConfigError(f"port must be 0-65535, got {port}")
    if config is None:
        config = ServerConfig()
    repo = ModelRepository(repository)
    async with open_engine(registry=registry, drain_period=config.drain_period) as engine:
        served = ServedModels(engine, repo)
        if models is None:
            failed = await served.load_all()
        else:
            failed = []
            for name in models:
                await served.load(name)
        in_flight = InFlight()
        state = ServerState(served, config, Metrics(served, in_flight), in_flight)
        settings = hypercorn.config.Config()
        settings.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
        settings.graceful_timeout = config.drain_period
        settings.accesslog = None
        settings.errorlog = logging.getLogger("hypercorn.error")
        stop = trio.Event()
        app = create_app(state)

        async def run_hypercorn(*, task_status: trio.TaskStatus[list[str]]) -> None:
            await hypercorn.trio.serve(
                app,  # type: ignore[arg-type]  # Starlette's ASGI types are looser than Hypercorn's
                settings,
                shutdown_trigger=stop.wait,
                task_status=task_status,
            )
            nursery.cancel_scope.cancel()  # drained: the signal watcher may go too

        async with trio.open_nursery() as nursery:
            if handle_signals:
                await nursery.start(_watch_signals, state, stop, nursery.cancel_scope)
            urls = await nursery.start(run_hypercorn)
            state.ready = True
            task_status.started(
                Listening(
                    tuple(urls),
                    {m: tuple(s.version for s in served.versions(m)) for m in _names(served)},
                    tuple(failed),
                )
            )
            try:
                await stop.wait()
            finally:
                state.ready = False
            # Hypercorn is closing its listener and draining its connections; when it
            # returns, nothing is left to wait for.
        log.info("stopped serving; closing the engine")


def _names(served: ServedModels) -> list[str]:
    return sorted({s.model for s in served.all()})


async def _watch_signals(
    state: ServerState,
    stop: trio.Event,
    scope: trio.CancelScope,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started()
        async for signum in signals:
            if not stop.is_set():
                state.ready = False
                log.info(
                    "%s: not ready; draining in-flight requests for up to %.1fs",
                    signal.Signals(signum).name,
                    state.config.drain_period,
                )
                stop.set()
            else:
                log.info("second signal: stopping now")
                scope.cancel()
                return
