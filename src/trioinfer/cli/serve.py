"""``trioinfer serve``: one engine behind the KServe V2 HTTP server, until SIGINT or SIGTERM."""

from __future__ import annotations

import functools
import gc
import logging
import os
import tomllib
from pathlib import Path
from typing import Any, Final

import anyio
import click

from .. import __version__
from .._examples import example_repository
from .._exceptions import TrioInferError
from ._params import ByteSize, _not_nan, needs_extra

#: Keys a ``--config`` file may hold; its [limits] table takes trioinfer.server.Limits fields.
_SERVE_KEYS: Final = frozenset(
    {
        "model_repository",
        "host",
        "port",
        "models",
        "drain_period",
        "cache_size",
        "admin_token",
        "protect_inference",
        "log_level",
        "loop",
        "limits",
        "workers",
    }
)


@click.command(short_help="Serve a model repository over KServe V2 HTTP (Triton-compatible).")
@click.option(
    "--model-repository",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    metavar="DIR",
    help="<DIR>/<model>/<version>/model.onnx, with an optional <DIR>/<model>/config.toml. "
    "Default: the bundled example repository.",
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
    "--config",
    "config_file",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    default=None,
    metavar="FILE",
    help="A TOML file with any of these options (model_repository, host, port, models, "
    "drain_period, cache_size, admin_token, protect_inference, log_level, workers) and a "
    "[limits] table; "
    "options given on the command line win.",
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
    type=click.FloatRange(min=0),
    callback=_not_nan,
    default=10.0,
    show_default=True,
    metavar="SECONDS",
    help="On SIGINT/SIGTERM, how long in-flight requests may take to finish.",
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
    "--loop",
    type=click.Choice(["trio", "asyncio"]),
    default="trio",
    show_default=True,
    help="The event loop: Trio, or asyncio (the same HTTP/1.1 server runs on both).",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    metavar="N",
    help="Serve from N processes on one port (SO_REUSEPORT), each with its own engine; "
    "this process supervises them (restarts one that dies). For when one event loop is "
    "the limit; 1 serves from this process alone.",
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    show_default=True,
    help="Log verbosity (logs go to stderr).",
)
@click.pass_context
def serve(ctx: click.Context, /, **options: Any) -> None:
    """Serve a model repository over the KServe V2 protocol (Open Inference Protocol).

    Opens one engine, loads every model of the repository (each version its
    config.toml's version_policy selects; without config.toml, defaults
    completed from the ONNX file), and serves the V2 REST API on Trio (or
    asyncio, --loop): health, server and model metadata, model config,
    inference with JSON or binary tensors, the model repository extension
    (index, load, unload), statistics, and Prometheus metrics at /metrics.
    NVIDIA's tritonclient works against it unchanged.

    With no options it serves the bundled example model "digits" on
    http://127.0.0.1:8000. SIGINT or SIGTERM makes it not ready at once,
    lets in-flight requests finish for up to the drain period, and exits 0.

    With --workers N, N processes serve the same port, each with its own
    engine and sessions on the same devices, and this process supervises
    them: it restarts one that dies (its in-flight requests fail with their
    connections), applies repository load/unload on every worker before
    answering, adds up statistics and /metrics across them, and on SIGINT or
    SIGTERM drains them all. A worker that cannot start stops serve with its
    error.
    """
    try:
        from ..server import Limits, ServerConfig
    except ModuleNotFoundError as exc:
        raise needs_extra("serve", exc) from exc

    settings = _serve_settings(ctx, options)
    if settings["admin_token"] is None and os.environ.get("TRIOINFER_ADMIN_TOKEN") == "":
        # click reads an empty variable as unset, which would serve with no token at all.
        raise click.UsageError(
            "invalid server settings: admin_token must be a non-empty string, but "
            "TRIOINFER_ADMIN_TOKEN is set and empty; set a token or unset the variable"
        )
    logging.basicConfig(
        level=settings["log_level"].upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    try:
        limits = Limits(**settings.get("limits", {}))
        config = ServerConfig(
            limits=limits,
            admin_token=settings["admin_token"],
            protect_inference=settings["protect_inference"],
            drain_period=settings["drain_period"],
            cache_size=ByteSize().convert(settings["cache_size"], None, ctx),
        )
    except (TypeError, TrioInferError) as exc:
        raise click.UsageError(f"invalid server settings: {exc}") from exc
    repository = settings["model_repository"] or example_repository()
    workers = settings["workers"]
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise click.UsageError(f"invalid server settings: workers must be >= 1, got {workers!r}")
    try:
        if workers == 1:
            anyio.run(
                functools.partial(
                    _serve,
                    repository,
                    host=settings["host"],
                    port=settings["port"],
                    config=config,
                    models=list(settings["models"]) or None,
                ),
                backend=settings["loop"],
            )
        else:
            # The supervisor runs on Trio whatever --loop says; the workers run on --loop.
            anyio.run(
                functools.partial(
                    _serve_workers,
                    repository,
                    workers=workers,
                    host=settings["host"],
                    port=settings["port"],
                    config=config,
                    models=list(settings["models"]) or None,
                    loop=settings["loop"],
                    log_level=settings["log_level"],
                ),
                backend="trio",
            )
    except (TrioInferError, OSError, BaseExceptionGroup) as exc:
        # Task groups wrap what fails at start-up; say the one cause plainly.
        cause = _only_cause(exc)
        if isinstance(cause, TrioInferError):
            raise click.ClickException(f"{type(cause).__name__}: {cause}") from exc
        if isinstance(cause, OSError):  # e.g. the port is taken
            raise click.ClickException(
                f"cannot listen on {settings['host']}:{settings['port']}: {cause.strerror or cause}"
            ) from exc
        raise


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
        with config_file.open("rb") as f:
            data = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise click.BadParameter(f"{config_file}: {exc}", param_hint="--config") from exc
    unknown = sorted(set(data) - _SERVE_KEYS)
    if unknown:
        raise click.BadParameter(
            f"{config_file}: unknown key {', '.join(map(repr, unknown))}; known keys are "
            f"{', '.join(sorted(_SERVE_KEYS))}",
            param_hint="--config",
        )
    if "model_repository" in data:
        data["model_repository"] = config_file.parent / str(data["model_repository"])
    for key, value in data.items():
        source = ctx.get_parameter_source(key) if key in settings else None
        if key == "limits" or source in (None, click.core.ParameterSource.DEFAULT):
            settings[key] = value
    return settings


async def _serve(
    repository: Path,
    *,
    host: str,
    port: int,
    config: Any,
    models: list[str] | None,
) -> None:
    from ..server import serve_http

    async with anyio.create_task_group() as tg:
        listening = await tg.start(
            functools.partial(
                serve_http,
                repository,
                host=host,
                port=port,
                config=config,
                models=models,
            )
        )
        served = ", ".join(
            f"{name} (v{', v'.join(map(str, versions))})"
            for name, versions in listening.models.items()
        )
        _settle_gc()
        url = listening.urls[0]
        click.echo(f"trioinfer {__version__} serving {served or 'no models'} from {repository}")
        if listening.failed:
            click.echo(f"could not load: {', '.join(listening.failed)} (see the log above)")
        click.echo(f"listening on {url} (Ctrl+C to stop)")
        if listening.models:
            first = next(iter(listening.models))
            click.echo(f"try: curl -s {url}/v2/models/{first}")
        click.echo("", nl=True)


async def _serve_workers(repository: Path, *, workers: int, **options: Any) -> None:
    from ..server._workers import serve_workers

    async with anyio.create_task_group() as tg:
        listening = await tg.start(
            functools.partial(serve_workers, repository, workers=workers, **options)
        )
        served = ", ".join(
            f"{name} (v{', v'.join(map(str, versions))})"
            for name, versions in listening.models.items()
        )
        url = listening.urls[0]
        click.echo(f"trioinfer {__version__} serving {served or 'no models'} from {repository}")
        if listening.failed:
            click.echo(f"could not load: {', '.join(listening.failed)} (see the log above)")
        pids = ", ".join(map(str, listening.pids))
        click.echo(f"{workers} workers (pids {pids}) listening on {url} (Ctrl+C to stop)")
        if listening.models:
            first = next(iter(listening.models))
            click.echo(f"try: curl -s {url}/v2/models/{first}")
        click.echo("", nl=True)


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
