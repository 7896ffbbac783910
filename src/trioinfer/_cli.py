"""The ``trioinfer`` command line: a demo of the engine, and the list of installed plugins.

``trioinfer demo`` loads the bundled example model and drives it from many
concurrent Trio tasks, each request under its own cancel scope, then reports
what happened; ``trioinfer plugins`` lists what the registry finds and whether
each plugin imports. The console script ``trioinfer`` and ``python -m
trioinfer`` both run `main()`.
"""

from __future__ import annotations

import collections
import functools
import gc
import logging
import math
import os
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import anyio
import attrs
import click
import numpy as np
import numpy.typing as npt
import trio

from . import __version__
from ._config import Instance, ModelConfig
from ._engine import Engine, open_engine
from ._examples import digits_samples, example_repository
from ._exceptions import TrioInferError
from ._registry import Registry
from ._runner import ModelStatistics

if TYPE_CHECKING:
    from collections.abc import Callable

    from . import _bench

#: The example model the demo runs.
DEMO_MODEL: Final = "digits"
#: The demo's second phase sends this many requests at once.
TIGHT_REQUESTS: Final = 64
#: Phase 2's deadline, as a fraction of the time phase 1 took to answer TIGHT_REQUESTS requests.
TIGHT_FRACTION: Final = 0.25
#: ... but never under this many seconds.
MIN_TIGHT_DEADLINE: Final = 0.0005

_LABEL_WIDTH: Final = 18


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(
    __version__, "--version", prog_name="trioinfer", message="%(prog)s %(version)s"
)
def main() -> None:
    """trioinfer: structured-concurrency AI inference for Trio and anyio.

    trioinfer is a Python library: an engine opened with
    "async with trioinfer.open_engine()" owns every queue, batch loop and
    backend call, and "await engine.infer(...)" runs under the caller's own
    cancel scope, whose deadline travels with the request. Backends,
    schedulers, batchers and fallbacks are plugins found through entry points.

    This command shows the engine at work on a bundled example model (demo),
    serves a model repository over the KServe V2 HTTP protocol (serve),
    measures a V2 server or an engine under load (bench), and lists the
    installed plugins (plugins).
    """


# -- trioinfer demo ---------------------------------------------------------------------


def _not_nan(_ctx: click.Context, _param: click.Parameter, value: float) -> float:
    # FloatRange lets NaN through (every comparison with it is false).
    if math.isnan(value):
        raise click.BadParameter("must be a number of seconds > 0, not nan")
    return value


@main.command(short_help="Run the bundled example model under concurrent load and report.")
@click.option(
    "--requests",
    type=click.IntRange(min=1),
    default=2000,
    show_default=True,
    metavar="N",
    help="How many requests to send, one image each.",
)
@click.option(
    "--concurrency",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    metavar="TASKS",
    help="How many Trio tasks send requests at the same time.",
)
@click.option(
    "--instances",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    metavar="COUNT",
    help="How many model instances (ONNX Runtime sessions) to run, one CPU thread each.",
)
@click.option(
    "--deadline",
    type=click.FloatRange(min=0, min_open=True),
    callback=_not_nan,
    default=0.05,
    show_default=True,
    metavar="SECONDS",
    help="Each request's time limit: its caller wraps it in trio.move_on_after(SECONDS).",
)
def demo(requests: int, concurrency: int, instances: int, deadline: float) -> None:
    """Run the bundled digits model under concurrent load and report what happened.

    Loads the example model "digits" (a small MLP that classifies 8x8 images
    of handwritten digits) on COUNT CPU instances, one request per execution
    (no batching). Then N requests of one held-out image each are sent from
    TASKS concurrent Trio tasks, each request under its own
    trio.move_on_after(SECONDS): in trioinfer the caller's cancel scope is the
    timeout. The report gives where the model runs, the accuracy of the
    answers against the known labels, how many requests were answered, timed
    out or failed (by error class), wall time, throughput, latency percentiles
    of the answered requests, and the engine's own counters.

    A second phase sends 64 requests at once with a deadline of a quarter of
    the time the first phase took to answer 64 (at least 0.5 ms, at most
    SECONDS), shorter than most of them must wait in the queue. The engine's
    counters, read before and after, show how many were computed and how many
    left the queue when their callers gave up, never computed.

    Exits with status 1 if the model cannot be loaded.
    """
    try:
        trio.run(
            functools.partial(
                _demo,
                requests=requests,
                concurrency=concurrency,
                instances=instances,
                deadline=deadline,
            )
        )
    except TrioInferError as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from exc


@attrs.define(eq=False)
class _Outcomes:
    # What the callers saw, tallied as their requests end.
    ok: int = 0
    correct: int = 0
    timed_out: int = 0
    errors: collections.Counter[str] = attrs.field(factory=collections.Counter)
    latencies: list[float] = attrs.field(factory=list)

    @property
    def failed(self) -> int:
        return sum(self.errors.values())


async def _demo(*, requests: int, concurrency: int, instances: int, deadline: float) -> None:
    config = ModelConfig.from_toml(example_repository() / DEMO_MODEL / "config.toml")
    config = attrs.evolve(
        config,
        instances=(Instance("cpu", count=instances, threads=1),),
        # One request per execution, so that executions count requests in phase 2.
        batcher="none",
        batcher_options={},
    )
    images, labels = digits_samples()
    async with open_engine() as engine:
        info = await engine.load(config)
        click.echo(f"trioinfer {__version__} demo\n")
        _row("model", f"{info.name}, version {config.path.parent.name}")
        _row("file", str(config.path))
        _row("runs on", f"{_devices(info.devices)}  (1 compute thread per instance)")

        click.echo()
        _row(
            "phase 1",
            f"{requests} requests from {concurrency} tasks, "
            f"each under trio.move_on_after({deadline:g})",
        )
        start = trio.current_time()
        seen = await _send(
            engine, images, labels, requests=requests, concurrency=concurrency, deadline=deadline
        )
        wall = trio.current_time() - start
        _report_outcomes(seen)
        if seen.ok:
            accuracy = f"{seen.correct / seen.ok:.3f}  ({seen.correct} of {seen.ok} answers right)"
        else:
            accuracy = "n/a  (no request was answered)"
        _row("accuracy", accuracy, indent=2)
        _row("wall time", f"{wall:.2f} s", indent=2)
        _row("throughput", f"{requests / wall:.0f} requests/s", indent=2)
        if seen.latencies:
            p50, p90, p99 = np.percentile(np.array(seen.latencies) * 1000, [50, 90, 99])
            _row(
                "latency",
                f"p50 {p50:.2f} ms   p90 {p90:.2f} ms   p99 {p99:.2f} ms"
                "  (answered requests: queue wait + compute)",
                indent=2,
            )
        stats = _model_statistics(engine)
        _row(
            "engine",
            f"executions {stats.executions}   expired {stats.expired}   "
            f"cancelled {stats.cancelled}   refused {stats.refused}   "
            f"mean execution {stats.mean_execution_s * 1000:.2f} ms",
            indent=2,
        )

        # Phase 2: a deadline well under the time the queue takes to drain, so that most
        # callers give up while their request waits. Scaled by phase 1's rate so that it
        # is "too tight" on a fast machine as on a slow one.
        rate = seen.ok / wall
        drain = TIGHT_REQUESTS / rate if rate else math.inf
        tight = max(MIN_TIGHT_DEADLINE, min(TIGHT_FRACTION * drain, deadline))
        click.echo()
        _row(
            "phase 2",
            f"{TIGHT_REQUESTS} requests at once, each under trio.move_on_after({tight:.2g}):",
        )
        if rate:
            _row("", f"(phase 1 answered {TIGHT_REQUESTS} requests every {drain * 1000:.1f} ms)")
        before = _model_statistics(engine)
        burst = await _send(
            engine,
            images,
            labels,
            requests=TIGHT_REQUESTS,
            concurrency=TIGHT_REQUESTS,
            deadline=tight,
        )
        after = _model_statistics(engine)
        _report_outcomes(burst)
        executions = after.executions - before.executions
        expired = after.expired - before.expired
        refused = after.refused - before.refused
        cancelled = after.cancelled - before.cancelled
        never = TIGHT_REQUESTS - executions
        _row(
            "computed",
            f"{executions:>6}  backend executions (engine.statistics() before/after)",
            indent=2,
        )
        _row(
            "never computed",
            f"{never:>6}  cancelled while queued {never - expired - refused}, "
            f"expired in the queue {expired}, refused {refused}",
            indent=2,
        )
        _row(
            "engine",
            f"executions +{executions}   expired +{expired}   cancelled +{cancelled}   "
            f"refused +{refused}",
            indent=2,
        )


async def _send(
    engine: Engine,
    images: npt.NDArray[np.float32],
    labels: npt.NDArray[np.int64],
    *,
    requests: int,
    concurrency: int,
    deadline: float,
) -> _Outcomes:
    # `concurrency` tasks take request numbers from one shared iterator until it runs out.
    seen = _Outcomes()
    numbers = iter(range(requests))

    async def client() -> None:
        for n in numbers:
            row = n % len(images)
            start = trio.current_time()
            with trio.move_on_after(deadline) as scope:
                try:
                    outputs = await engine.infer(DEMO_MODEL, {"input": images[row : row + 1]})
                except TrioInferError as exc:
                    seen.errors[type(exc).__name__] += 1
                else:
                    seen.latencies.append(trio.current_time() - start)
                    seen.ok += 1
                    seen.correct += int(outputs["label"][0] == labels[row])
            if scope.cancelled_caught:
                seen.timed_out += 1

    async with trio.open_nursery() as nursery:
        for _ in range(min(concurrency, requests)):
            nursery.start_soon(client)
    return seen


def _model_statistics(engine: Engine) -> ModelStatistics:
    return engine.statistics().models[DEMO_MODEL]


def _report_outcomes(seen: _Outcomes) -> None:
    _row("ok", f"{seen.ok:>6}  answered", indent=2)
    _row("timed out", f"{seen.timed_out:>6}  (the caller's scope expired)", indent=2)
    kinds = ", ".join(f"{name} {count}" for name, count in sorted(seen.errors.items()))
    _row("errors", f"{seen.failed:>6}" + (f"  ({kinds})" if kinds else ""), indent=2)


def _devices(devices: Sequence[str]) -> str:
    counts = collections.Counter(devices)
    return ", ".join(f"{count} x {device}" for device, count in counts.items())


def _row(label: str, text: str, *, indent: int = 0) -> None:
    click.echo(" " * indent + label.ljust(_LABEL_WIDTH - indent) + text)


# -- trioinfer serve --------------------------------------------------------------------

#: Keys a ``--config`` file may hold; its [limits] table takes trioinfer.server.Limits fields.
_SERVE_KEYS: Final = frozenset(
    {
        "model_repository",
        "host",
        "port",
        "models",
        "drain_period",
        "admin_token",
        "protect_inference",
        "log_level",
        "loop",
        "limits",
    }
)


@main.command(short_help="Serve a model repository over KServe V2 HTTP (Triton-compatible).")
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
    "drain_period, admin_token, protect_inference, log_level) and a [limits] table; "
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
    """
    from .server import Limits, ServerConfig

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
        )
    except (TypeError, TrioInferError) as exc:
        raise click.UsageError(f"invalid server settings: {exc}") from exc
    repository = settings["model_repository"] or example_repository()
    try:
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
    from .server import serve_http

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


# -- trioinfer bench --------------------------------------------------------------------


def _numbers(kind: type[int] | type[float]) -> Any:
    def parse(_ctx: click.Context, _param: click.Parameter, value: str | None) -> Any:
        if value is None:
            return ()
        try:
            numbers = tuple(kind(part) for part in value.split(",") if part.strip())
        except ValueError:
            numbers = ()
        if not numbers or not all(n > 0 and math.isfinite(n) for n in numbers):
            raise click.BadParameter(
                f"expected positive numbers separated by commas, got {value!r}"
            )
        return numbers

    return parse


def _shapes(_ctx: click.Context, _param: click.Parameter, value: Sequence[str]) -> dict[str, Any]:
    shapes: dict[str, list[int]] = {}
    for item in value:
        name, _, dims = item.partition("=")
        try:
            shapes[name] = [int(d) for d in dims.split(",")]
        except ValueError:
            raise click.BadParameter(f"expected NAME=D1,D2,..., got {item!r}") from None
    return shapes


@main.command(short_help="Load-test a KServe V2 server (or an engine in-process) and report.")
@click.option(
    "--url",
    default="http://127.0.0.1:8000",
    show_default=True,
    metavar="URL",
    help="The V2 server (trioinfer, Triton, MLServer, KServe): http://HOST:PORT.",
)
@click.option("-m", "--model", default=None, metavar="NAME", help="The model to load-test.")
@click.option(
    "--model-version",
    default=None,
    metavar="VERSION",
    help="A model version (default: the server's).",
)
@click.option(
    "--concurrency",
    callback=_numbers(int),
    default="1",
    show_default=True,
    metavar="C1,C2,...",
    help="Closed loop: this many requests in flight, one per connection; one level each.",
)
@click.option(
    "--request-rate",
    callback=_numbers(float),
    default=None,
    metavar="R1,R2,...",
    help="Open loop instead: requests per second offered, one level each; latency counts "
    "from when each request was due.",
)
@click.option(
    "--arrivals",
    type=click.Choice(["poisson", "constant"]),
    default="poisson",
    show_default=True,
    help="Open loop: random (Poisson) or evenly spaced arrivals.",
)
@click.option(
    "--max-connections",
    type=click.IntRange(min=0),
    default=0,
    metavar="N",
    help="Open loop: the most connections (in-process: workers) to open; more open as "
    "requests find all busy, up to N (default: 1024).",
)
@click.option(
    "--input-data",
    "input_files",
    multiple=True,
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    metavar="FILE",
    help="Inputs from a .npz (one array per input) or .json (a V2 infer request) file, "
    "instead of random data shaped from the model's metadata; repeat to cycle through several.",
)
@click.option(
    "--shape",
    multiple=True,
    callback=_shapes,
    metavar="NAME=D1,D2",
    help="Random data: the shape of input NAME (default: its metadata, -1 taken as 1).",
)
@click.option(
    "--encoding",
    type=click.Choice(["json", "binary"]),
    default="json",
    show_default=True,
    help="Tensors as JSON data, or Triton's binary tensor extension.",
)
@click.option(
    "--warmup",
    type=click.FloatRange(min=0),
    callback=_not_nan,
    default=1.0,
    show_default=True,
    metavar="SECONDS",
    help="Load before measuring each level, not counted.",
)
@click.option(
    "--window",
    type=click.FloatRange(min=0, min_open=True),
    callback=_not_nan,
    default=1.0,
    show_default=True,
    metavar="SECONDS",
    help="The length of one measurement window.",
)
@click.option(
    "--stability",
    type=click.FloatRange(min=0),
    default=10.0,
    show_default=True,
    metavar="PERCENT",
    help="Measure until the last 3 windows' throughput and p99 are within PERCENT of their mean.",
)
@click.option(
    "--max-windows",
    type=click.IntRange(min=1),
    default=10,
    show_default=True,
    metavar="N",
    help="Give up on stability after N windows (the last 3 count).",
)
@click.option(
    "--windows",
    type=click.IntRange(min=0),
    default=0,
    metavar="N",
    help="Measure exactly N windows and count them all, instead of waiting for stability.",
)
@click.option(
    "--seed", type=int, default=0, show_default=True, help="Seeds random inputs and arrivals."
)
@click.option(
    "--in-process",
    is_flag=True,
    default=False,
    help="Drive an engine in this process (no HTTP): needs --model-file, or "
    "--model-repository and --model.",
)
@click.option(
    "--model-file",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    default=None,
    metavar="FILE",
    help="In-process: an ONNX model, loaded with default settings.",
)
@click.option(
    "--model-repository",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    default=None,
    metavar="DIR",
    help="In-process: a model repository; --model's config.toml applies.",
)
@click.option(
    "--json",
    "json_file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    metavar="FILE",
    help="Also write the results as JSON.",
)
@click.option(
    "--csv",
    "csv_file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    metavar="FILE",
    help="Also write the results as CSV.",
)
@click.option(
    "--plot",
    "plot_file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    metavar="FILE.png",
    help="Plot latency percentiles against throughput (pip install 'trioinfer[bench]').",
)
def bench(**options: Any) -> None:
    """Load-test a model on a KServe V2 server, or on an engine in-process, and report.

    Over HTTP it speaks only the V2 protocol (model metadata and infer), so it
    works against trioinfer, Triton, MLServer or KServe. Inputs are random data
    shaped from the model's metadata (GET /v2/models/NAME), or read from
    files; each distinct request is encoded once, before the run.

    Closed loop (--concurrency 1,16,64): C keep-alive connections, each sending
    its next request when the last is answered. Open loop (--request-rate
    500,1000): requests are due at Poisson (or constant) times whatever the
    server does, and latency counts from when each was due; a request that
    finds every connection busy goes out on a new one, up to --max-connections,
    then waits (counted "late"; with too many waiting, new ones are
    "dropped"), so an overloaded server shows as latency, not as a politely
    slower client.

    Each level warms up (not counted), then measures windows until the last
    three agree within --stability (or --windows N). The table (on stdout)
    gives throughput, latency percentiles of successful requests, errors, and
    the tool's own CPU time per request and cores used, progress display
    included (in-process: the whole process, engine included). While it runs,
    a progress bar shows on stderr when stderr is a terminal (drawn by rich
    when installed: pip install 'trioinfer[bench]').

    Exits with status 1 when the server cannot be reached or does not serve
    the model, or when any request failed (errors by status are printed).
    """
    from . import _bench

    if options["request_rate"] and options["concurrency"] != (1,):
        raise click.UsageError("give --concurrency or --request-rate, not both")
    local = options["model_file"] is not None or options["model_repository"] is not None
    if options["in_process"] and not local:
        raise click.UsageError("--in-process needs --model-file, or --model-repository and --model")
    if local and not options["in_process"]:
        raise click.UsageError("--model-file and --model-repository go with --in-process")
    plan = _bench.Plan(
        concurrency=options["concurrency"],
        rates=options["request_rate"],
        arrivals=options["arrivals"],
        seed=options["seed"],
        max_connections=options["max_connections"],
        settings=_bench.Settings(
            warmup_s=options["warmup"],
            window_s=options["window"],
            stability=options["stability"],
            max_windows=options["max_windows"],
            windows=options["windows"],
        ),
    )
    try:
        with _bench.open_progress() as progress:
            run = trio.run(functools.partial(_bench_run, options, plan, progress))
    except TrioInferError as exc:
        raise click.ClickException(str(exc)) from exc
    _bench.print_table(run.results)
    about = {
        "target": "in-process" if options["in_process"] else options["url"],
        "model": options["model"] or (options["model_file"] and str(options["model_file"])),
        "model_version": options["model_version"],
        "encoding": None if options["in_process"] else options["encoding"],
        "arrivals": options["arrivals"] if plan.rates else None,
        "window_s": options["window"],
        "warmup_s": options["warmup"],
    }
    try:
        if options["json_file"]:
            _bench.write_json(options["json_file"], run.results, about)
        if options["csv_file"]:
            _bench.write_csv(options["csv_file"], run.results)
        if options["plot_file"]:
            _bench.write_plot(
                options["plot_file"], run.results, f"{about['model']} @ {about['target']}"
            )
    except (OSError, TrioInferError) as exc:
        raise click.ClickException(str(exc)) from exc
    failed = sum(sum(r.errors.values()) for r in run.results)
    if failed:
        for status, text in run.first_errors.items():
            click.echo(f"first {status} answer: {' '.join(text.split())[:300]}", err=True)
        raise click.ClickException(f"{failed} requests failed (see the errors column)")


async def _bench_run(
    options: dict[str, Any],
    plan: _bench.Plan,
    progress: Callable[[_bench.Progress], None] | None,
) -> _bench.Run:
    from . import _bench

    if options["in_process"]:
        version = options["model_version"]
        async with _bench.open_local_model(
            model_file=options["model_file"],
            repository=options["model_repository"],
            model=options["model"],
            version=int(version) if version is not None else None,
        ) as (engine, name, specs):
            return await _bench.run_in_process(
                engine,
                name,
                specs,
                plan,
                input_files=options["input_files"],
                shapes=options["shape"],
                progress=progress,
            )
    if not options["model"]:
        raise click.UsageError("--model is required (or --in-process with --model-file)")
    target = _bench.HttpTarget.from_url(options["url"], options["model"], options["model_version"])
    return await _bench.run_http(
        target,
        plan,
        input_files=options["input_files"],
        shapes=options["shape"],
        binary=options["encoding"] == "binary",
        progress=progress,
    )


# -- trioinfer plugins ------------------------------------------------------------------


@main.command()
def plugins() -> None:
    """List the installed plugins and whether each one loads.

    Shows every backend, scheduler, batcher and fallback declared through the
    entry-point groups trioinfer.backends, trioinfer.schedulers,
    trioinfer.batchers and trioinfer.fallbacks: its kind, the name configs
    use, the module:attribute it points to, the distribution that declares it,
    and `ok` if it imports or the error if it does not.

    Exits with status 0 if every plugin loads, 1 if any fails.
    """
    registry = Registry()
    found = registry.plugins()
    if not found:
        click.echo("no plugins found in the trioinfer.* entry-point groups")
        return
    rows: list[Sequence[str]] = [("KIND", "NAME", "TARGET", "DISTRIBUTION", "STATUS")]
    failures = 0
    for info in found:
        error = registry.check(info)
        failures += error is not None
        status = "ok" if error is None else " ".join(error.split())
        rows.append((info.kind, info.name, info.target, info.distribution or "-", status))
    _table(rows)
    if failures:
        click.echo(f"{failures} of {len(found)} plugins failed to load", err=True)
        click.get_current_context().exit(1)


def _table(rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        click.echo("  ".join([*cells, row[-1]]))
