"""Running a plan: level after level, over HTTP or against an engine in this process.

`run_http` reads the model's metadata, encodes the requests, sizes an open
loop's connection pool with a short probe, then runs each level's `_LoadLoop`
while `_measure` counts; `run_in_process` does the same with worker tasks
calling ``engine.infer``.
"""

from __future__ import annotations

import functools
import math
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Final

import attrs
import trio

from .._config import ModelConfig
from .._engine import Engine, ModelInfo, open_engine
from .._exceptions import TrioInferError
from ..server import ModelRepository, v2_datatype
from ..server._models import ServedModels, public_names
from ._client import HttpTarget, _Connection
from ._grpc import GrpcClient, GrpcTarget, run_grpc_level
from ._inputs import BenchError, InputData, Tensor, generated_inputs, load_inputs
from ._load import (
    _BACKLOG_PER_CONNECTION,
    Arrivals,
    Send,
    _closed_level,
    _LoadLoop,
    _open_level,
    iter_arrivals,
)
from ._stats import Progress, Result, Settings, Status, _measure, _Recorder

# Open loop: the smallest pool to start with; a 1 ms hiccup at a few thousand req/s needs this many.
_MIN_POOL: Final = 32
#: Open loop: the most connections (in-process: workers) the tool opens by default.
DEFAULT_MAX_CONNECTIONS: Final = 1024
# Requests sent (one at a time) before an open-loop run to size its connection pool.
_PROBE_REQUESTS: Final = 10


@attrs.frozen
class Plan:
    """What to run: the levels and how to measure them.

    Attributes:
        concurrency: Closed-loop levels (workers); used when *rates* is empty.
        rates: Open-loop levels (requests per second).
        arrivals: ``constant`` or ``poisson`` (open loop).
        seed: Seeds the Poisson schedule and random inputs.
        max_connections: Open loop: the most connections (in-process: workers) to
            open; 0 for `DEFAULT_MAX_CONNECTIONS`.
        settings: Warm-up, window and stability settings.
    """

    concurrency: tuple[int, ...] = (1,)
    rates: tuple[float, ...] = ()
    arrivals: Arrivals = "poisson"
    seed: int = 0
    max_connections: int = 0
    settings: Settings = Settings()  # noqa: RUF009 - frozen (attrs): one shared default is safe

    @property
    def levels(self) -> int:
        """How many levels the plan runs."""
        return len(self.rates) or len(self.concurrency)


def _pool_limit(plan: Plan) -> int:
    return plan.max_connections or DEFAULT_MAX_CONNECTIONS


def _pool_size(plan: Plan, rate: float, probe_s: float) -> int:
    # The connections to open before the run: enough for the rate times a generous
    # latency, as Little's law says. A batching server's latency under load is
    # several times the probe's, so the loop opens more as requests find none free.
    return min(_pool_limit(plan), max(_MIN_POOL, math.ceil(rate * probe_s * 4)))


def _variants(
    specs: Sequence[Mapping[str, Any]],
    plan: Plan,
    input_files: Sequence[Path],
    shapes: Mapping[str, Sequence[int]] | None,
    input_data: InputData,
) -> list[list[Tensor]]:
    # Each distinct request's inputs: read from the files, else generated from the specs.
    if input_files:
        return [load_inputs(p) for p in input_files]
    return [generated_inputs(specs, shapes, input_data=input_data, seed=plan.seed)]


async def _run_levels(
    plan: Plan,
    run_closed: Callable[[int, _Recorder], Awaitable[Result]],
    run_open: Callable[[float, _Recorder], Awaitable[Result]],
) -> Run:
    results = []
    seen: dict[str, str] = {}
    for value in plan.rates or plan.concurrency:
        recorder = _Recorder()
        if plan.rates:
            results.append(await run_open(value, recorder))
        else:
            results.append(await run_closed(int(value), recorder))
        seen.update({str(k): v for k, v in recorder.first_error.items() if str(k) not in seen})
    return Run(tuple(results), seen)


@attrs.frozen
class Run:
    """A whole run's results.

    Attributes:
        results: One per level, in the order run.
        first_errors: For each error status seen, the first failed answer's text.
    """

    results: tuple[Result, ...]
    first_errors: dict[str, str]


async def _open_sockets(address: tuple[str, int], count: int) -> list[socket.socket]:
    opened: list[socket.socket] = []
    try:
        for _ in range(count):
            conn = _Connection(_Recorder())
            await conn.connect(address)
            assert conn.sock is not None
            opened.append(conn.sock)
    except OSError as exc:
        for sock in opened:
            sock.close()
        raise BenchError(
            f"cannot open {count} connections to http://{address[0]}:{address[1]}: "
            f"{exc.strerror or exc}"
        ) from None
    except BaseException:
        for sock in opened:
            sock.close()
        raise
    return opened


async def run_http(
    target: HttpTarget,
    plan: Plan,
    *,
    input_files: Sequence[Path] = (),
    input_data: InputData = "random",
    shapes: Mapping[str, Sequence[int]] | None = None,
    binary: bool = False,
    progress: Callable[[Progress], None] | None = None,
) -> Run:
    """Benchmark a V2 server's model over HTTP; one `Result` per level.

    Each request's inputs are read from *input_files* (cycled through), else
    generated from the model's metadata as *input_data* says: random or zeros.

    Raises:
        BenchError: No server, no such model, or unusable inputs.
    """
    metadata = await target.metadata()
    variants = _variants(metadata["inputs"], plan, input_files, shapes, input_data)
    requests = target.requests(variants, binary=binary)
    address = (target.host, target.port)

    probe_s = 0.0
    if plan.rates and not plan.max_connections:
        probe = _Connection(_Recorder())
        try:
            for n in range(_PROBE_REQUESTS):
                start = time.perf_counter()
                if probe.sock is None:
                    await probe.connect(address)
                await probe.request(requests[n % len(requests)])
                probe_s = max(probe_s, time.perf_counter() - start)
        except OSError as exc:
            raise BenchError(
                f"cannot connect to http://{target.host}:{target.port}: {exc.strerror or exc}"
            ) from None
        finally:
            probe.close()

    index = 0

    async def level(
        count: int, recorder: _Recorder, load: str, value: float, **loop_options: Any
    ) -> Result:
        nonlocal index
        socks = await _open_sockets(address, count)
        loop = _LoadLoop(address, requests, recorder, socks, **loop_options)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(functools.partial(trio.to_thread.run_sync, loop.run))
                try:
                    result = await _measure(
                        recorder, plan.settings, load, value, progress, (index, plan.levels)
                    )
                finally:
                    loop.stop()  # the thread returns, and the nursery with it
        finally:
            loop.close()
        index += 1
        return result

    async def run_closed(count: int, recorder: _Recorder) -> Result:
        return await level(count, recorder, "concurrency", count)

    async def run_open(rate: float, recorder: _Recorder) -> Result:
        pool, most = _pool_size(plan, rate, probe_s), _pool_limit(plan)
        schedule = iter_arrivals(rate, plan.arrivals, plan.seed)
        return await level(
            pool,
            recorder,
            "rate",
            rate,
            schedule=schedule,
            backlog_limit=_BACKLOG_PER_CONNECTION * most,
            max_connections=most,
        )

    return await _run_levels(plan, run_closed, run_open)


async def run_grpc(
    target: GrpcTarget,
    plan: Plan,
    *,
    input_files: Sequence[Path] = (),
    input_data: InputData = "random",
    shapes: Mapping[str, Sequence[int]] | None = None,
    progress: Callable[[Progress], None] | None = None,
    client: GrpcClient = "raw",
) -> Run:
    """Benchmark a V2 gRPC server's model (closed loop); one `Result` per level.

    *client*: the lean load client (``"raw"``) or grpcio's ``grpc.aio`` (``"aio"``).
    Inputs are read or generated as `run_http` does.

    Raises:
        BenchError: Open-loop levels (not implemented over gRPC), no server, no
            such model, or unusable inputs.
    """
    if plan.rates:
        raise BenchError("--protocol grpc runs closed-loop levels (--concurrency) only")
    metadata = await target.metadata()
    variants = _variants(metadata["inputs"], plan, input_files, shapes, input_data)
    requests = target.requests(variants)
    index = 0

    async def run_closed(count: int, recorder: _Recorder) -> Result:
        nonlocal index

        async def measure(recorder: _Recorder) -> Result:
            return await _measure(
                recorder, plan.settings, "concurrency", count, progress, (index, plan.levels)
            )

        result = await run_grpc_level(target, requests, count, recorder, measure, client=client)
        index += 1
        return result

    async def run_open(rate: float, recorder: _Recorder) -> Result:  # pragma: no cover
        raise AssertionError("refused above")

    return await _run_levels(plan, run_closed, run_open)


@asynccontextmanager
async def open_local_model(
    *,
    model_file: Path | None = None,
    repository: Path | None = None,
    model: str | None = None,
    version: int | None = None,
) -> AsyncIterator[tuple[Engine, str, list[dict[str, Any]]]]:
    """Open an engine with one model; yield it, the engine's name for it and V2-style input specs.

    Either *model_file* (defaults for everything), or *repository* and *model*:
    then the model is loaded as ``trioinfer serve`` would serve it (its
    ``config.toml`` or ``config.pbtxt``, its version policy), and a pipeline's
    step models, pipelines among them, are loaded from the same repository
    first. *version* picks one of the versions the policy serves (default: the
    highest).

    Raises:
        BenchError: Neither given, the model or a step's model cannot be found or
            loaded, or *version* is not served.
    """
    async with open_engine() as engine:
        if model_file is not None:
            info = await engine.load(ModelConfig(name=model or "model", path=model_file))
        elif repository is not None and model is not None:
            info = await _load_from_repository(engine, repository, model, version)
        else:
            raise BenchError("--in-process needs --model-file, or --model-repository and --model")
        specs = []
        for spec in info.signature.inputs:
            shape = [d if isinstance(d, int) else -1 for d in spec.shape]
            specs.append(
                {
                    "name": spec.name,
                    "datatype": v2_datatype(spec.dtype, spec.type_name),
                    "shape": shape,
                }
            )
        yield engine, info.name, specs


async def _load_from_repository(
    engine: Engine, repository: Path, model: str, version: int | None
) -> ModelInfo:
    # The server's own table loads it: the same configs, versions and engine names
    # (a pipeline's steps call 'digits.v1', not 'digits') as `trioinfer serve`.
    try:
        served = ServedModels(engine, ModelRepository(repository))
        await served.load_with_steps(model)
        return served.resolve(model, None if version is None else str(version)).info
    except TrioInferError as exc:
        raise BenchError(
            f"cannot bench {model!r} from the model repository {repository}: "
            f"{public_names(str(exc))}"
        ) from None


async def run_in_process(
    engine: Engine,
    model: str,
    specs: Sequence[Mapping[str, Any]],
    plan: Plan,
    *,
    input_files: Sequence[Path] = (),
    input_data: InputData = "random",
    shapes: Mapping[str, Sequence[int]] | None = None,
    progress: Callable[[Progress], None] | None = None,
) -> Run:
    """Benchmark *model* on *engine* directly (no HTTP); one `Result` per level.

    CPU figures here are the whole process's: the engine's work included.
    Inputs are read or generated as `run_http` does.
    """
    variants = _variants(specs, plan, input_files, shapes, input_data)
    inputs = [{t.name: t.array for t in v} for v in variants]
    index = 0

    def senders(count: int, recorder: _Recorder) -> list[Send]:
        async def send(n: int) -> Status:
            try:
                await engine.infer(model, inputs[n % len(inputs)])
            except TrioInferError as exc:
                name = type(exc).__name__
                recorder.first_error.setdefault(name, public_names(str(exc)))
                return name
            return 200

        return [send] * count

    async def measure(recorder: _Recorder, load: str, value: float) -> Result:
        nonlocal index
        result = await _measure(
            recorder, plan.settings, load, value, progress, (index, plan.levels)
        )
        index += 1
        return result

    async def run_closed(count: int, recorder: _Recorder) -> Result:
        return await _closed_level(senders(count, recorder), recorder, measure)

    async def run_open(rate: float, recorder: _Recorder) -> Result:
        # Workers are only tasks: start them all; each sleeps until the time it claimed.
        return await _open_level(
            senders(_pool_limit(plan), recorder),
            recorder,
            measure,
            rate=rate,
            arrivals=plan.arrivals,
            seed=plan.seed,
        )

    return await _run_levels(plan, run_closed, run_open)
