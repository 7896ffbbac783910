"""Running a plan: level after level, over HTTP or against an engine in this process.

`run_http` reads the model's metadata, encodes the requests, sizes an open
loop's connection pool with a short probe, then runs each level's `_LoadLoop`
while `_measure` counts; `run_in_process` does the same with worker tasks
calling ``engine.infer``.
"""

from __future__ import annotations

import functools
import itertools
import math
import socket
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Hashable,
    Iterator,
    Mapping,
    Sequence,
)
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any, Final

import attrs
import trio

from .._bounds import MAX_RATE, MIN_RATE, RATE_RANGE
from .._config import ModelConfig
from .._engine import Engine, ModelInfo, open_engine
from .._exceptions import TrioInferError
from .._sequence import SequenceFlags
from ..server import ModelRepository, v2_datatype
from ..server._models import ServedModels, public_names
from ._client import HttpTarget, _Connection
from ._grpc import WORKERS_PER_CHANNEL, GrpcClient, GrpcTarget, run_grpc_level
from ._inputs import BenchError, InputData, Tensor, generated_inputs, load_inputs
from ._load import (
    _BACKLOG_PER_CONNECTION,
    Arrivals,
    Send,
    _closed_level,
    _LoadLoop,
    _open_level,
    iter_arrivals,
    iter_intervals,
)
from ._modes import (
    Modes,
    SequenceStep,
    ShmRegion,
    _Sequencer,
    check_model,
    open_regions,
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
        modes: Streaming, sequences, shared memory (perf_analyzer's modes); each
            is checked against the model before the run.
        intervals: Open loop: the gaps between requests (ns), in turn and cycled,
            instead of *arrivals* (perf_analyzer's ``--request-intervals``); *rates*
            then holds one level, at their mean rate (`from_intervals` makes both).
    """

    concurrency: tuple[int, ...] = (1,)
    rates: tuple[float, ...] = ()
    arrivals: Arrivals = "poisson"
    seed: int = 0
    max_connections: int = 0
    settings: Settings = Settings()  # noqa: RUF009 - frozen (attrs): one shared default is safe
    modes: Modes = Modes()  # noqa: RUF009 - frozen too
    intervals: tuple[int, ...] = ()

    @property
    def levels(self) -> int:
        """How many levels the plan runs."""
        return len(self.rates) or len(self.concurrency)

    @classmethod
    def from_intervals(cls, intervals_ns: Sequence[int], **fields: Any) -> Plan:
        """One open level whose requests are *intervals_ns* apart, in turn and cycled.

        The level is reported at the intervals' mean rate.

        Raises:
            BenchError: No intervals, a negative one, none above 0, or a mean
                rate outside `--request-rate`'s range (one request in 1000 s to
                one a microsecond: beyond it a level would see no request, or
                every one due at once).
        """
        if not intervals_ns or min(intervals_ns) < 0 or not sum(intervals_ns) > 0:
            raise BenchError(
                "request intervals must be whole numbers of nanoseconds, none negative and "
                "not all 0"
            )
        rate = len(intervals_ns) * 1e9 / sum(intervals_ns)
        if not MIN_RATE <= rate <= MAX_RATE:
            # A gap of hours (microseconds read as something else) printed as 2e-23/s.
            mean = sum(intervals_ns) / len(intervals_ns)
            raise BenchError(
                f"request intervals must average from {1e6 / MAX_RATE:g} µs to "
                f"{1 / MIN_RATE:g} s (a rate from {RATE_RANGE}, as --request-rate takes), "
                f"got a mean of {mean / 1e9:.3g} s ({rate:.3g} requests per second)"
            )
        return cls(rates=(rate,), intervals=tuple(intervals_ns), **fields)

    def schedule(self, rate: float) -> Iterator[int]:
        """An open level's due times (ns after its start): *intervals*, else *arrivals*."""
        if self.intervals:
            return iter_intervals(self.intervals)
        return iter_arrivals(rate, self.arrivals, self.seed)


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
    modes = _check_modes(
        check_model(await target.config(), plan.modes, target.model), plan, input_files
    )
    variants = _variants(metadata["inputs"], plan, input_files, shapes, input_data)
    sequences = modes.sequence_length is not None
    if modes.streaming:
        requests = target.stream_requests(variants)
    else:
        requests = target.requests(variants, binary=binary)
    address = (target.host, target.port)

    shm_requests: list[bytes] = []  # one per connection, with --shared-memory
    probe_s = 0.0
    # (Sequences: the pool is the sequences in flight, and a request outside one is refused.)
    if plan.rates and not plan.max_connections and not sequences:
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
        if sequences:
            loop_options["next_request"] = _sequence_maker(
                _Sequencer(modes, plan.seed),
                target.sequence_requests(variants, binary=binary),
            )
        elif shm_requests:
            loop_options["next_request"] = _per_connection(shm_requests)
        socks = await _open_sockets(address, count)
        loop = _LoadLoop(
            address, requests, recorder, socks, streaming=modes.streaming, **loop_options
        )
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(functools.partial(trio.to_thread.run_sync, loop.run))
                try:
                    result = await _measure(
                        recorder,
                        plan.settings,
                        load,
                        value,
                        progress,
                        (index, plan.levels),
                        streaming=modes.streaming,
                    )
                finally:
                    loop.stop()  # the thread returns, and the nursery with it
        finally:
            loop.close()
        index += 1
        return result

    async def run_closed(count: int, recorder: _Recorder) -> Result:
        return await level(count, recorder, "concurrency", count)

    # Open loop: the pool grows as requests find every connection busy, except where
    # each connection holds something of its own made before the level: a sequence
    # (as many as --num-of-sequences, taking due requests in turn), a region.
    fixed_pool = 0
    if plan.rates and sequences:
        fixed_pool = modes.open_sequences
    elif plan.rates and modes.shared_memory != "none":
        fixed_pool = plan.max_connections or max(_pool_size(plan, r, probe_s) for r in plan.rates)

    async def run_open(rate: float, recorder: _Recorder) -> Result:
        pool, most = _pool_size(plan, rate, probe_s), _pool_limit(plan)
        if fixed_pool:
            pool = most = fixed_pool
        return await level(
            pool,
            recorder,
            "rate",
            rate,
            schedule=plan.schedule(rate),
            backlog_limit=_BACKLOG_PER_CONNECTION * most,
            max_connections=most,
            in_turn=sequences,
        )

    if modes.shared_memory == "none":
        return await _run_levels(plan, run_closed, run_open)
    # A region per connection: a closed loop's connections are its workers.
    count = fixed_pool or max(plan.concurrency)
    async with _regions(target, metadata, variants, modes, count) as regions:
        shm_requests.extend(target.shm_requests(regions))
        return await _run_levels(plan, run_closed, run_open)


def _regions(
    target: HttpTarget | GrpcTarget,
    metadata: Mapping[str, Any],
    variants: Sequence[Sequence[Tensor]],
    modes: Modes,
    count: int,
) -> AbstractAsyncContextManager[list[ShmRegion]]:
    outputs = [str(o["name"]) for o in metadata.get("outputs", [])]
    return open_regions(target, count, variants[0], outputs, modes.output_shm_size)


def _check_modes(modes: Modes, plan: Plan, input_files: Sequence[Path]) -> Modes:
    # Shared memory goes alone, with one request's inputs.
    shm = modes.shared_memory != "none"
    if shm and modes.streaming:
        raise BenchError("--shared-memory does not go with --streaming: leave one out")
    if shm and modes.sequence_length is not None:
        # Said of a stateful model whatever the flags: its requests are sequences.
        raise BenchError(
            "--shared-memory does not go with sequences, and every request to a stateful "
            "model is part of one: bench it without --shared-memory"
        )
    if shm and len(input_files) > 1:
        raise BenchError("--shared-memory puts one request's inputs in memory: give one input file")
    first, end = modes.sequence_ids
    if modes.sequence_length is not None and end is not None:
        # Before any level runs (a sweep's last level may be the one with too few ids),
        # naming the flag that set the sequences in flight: each needs an id of its own.
        if plan.rates:
            in_flight, flag = modes.open_sequences, "--num-of-sequences"
        else:
            in_flight, flag = max(plan.concurrency), "--concurrency"
        if end - first < in_flight:
            raise BenchError(
                f"--sequence-id-range {first}:{end} has {end - first} ids, fewer than the "
                f"{in_flight} sequences in flight at {flag} {in_flight}; ids would collide: "
                f"widen the range (to {first}:{first + in_flight} or more)"
            )
    return modes


def _sequence_maker(
    sequencer: _Sequencer, make: Callable[[int, SequenceStep], bytes]
) -> Callable[[Hashable], bytes]:
    # Each worker (an HTTP connection; a gRPC connection's worker) runs one sequence
    # at a time: its own steps, one request each.
    slots: dict[Hashable, Iterator[SequenceStep]] = {}
    counter = itertools.count()

    def next_request(worker: Hashable) -> bytes:
        slot = slots.get(worker)
        if slot is None:
            slot = slots[worker] = sequencer.slot()
        return make(next(counter), next(slot))

    return next_request


def _per_connection(requests: Sequence[bytes]) -> Callable[[_Connection], bytes]:
    # Shared memory: each connection sends the request of a region of its own.
    assigned: dict[_Connection, bytes] = {}

    def next_request(conn: _Connection) -> bytes:
        request = assigned.get(conn)
        if request is None:
            request = assigned[conn] = requests[len(assigned)]
        return request

    return next_request


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
    """Benchmark a V2 gRPC server's model; one `Result` per level.

    *client*: the lean load client (``"raw"``) or grpcio's ``grpc.aio`` (``"aio"``).
    Inputs are read or generated as `run_http` does. An open loop's workers
    (calls in flight at most) are a fixed pool: *plan*'s ``max_connections``
    (0: `DEFAULT_MAX_CONNECTIONS`), or with sequences ``modes.open_sequences``.

    Raises:
        BenchError: A mode or an open loop with the aio client, no server, no
            such model, or unusable inputs.
    """
    metadata = await target.metadata()
    modes = _check_modes(
        check_model(await target.config(), plan.modes, target.model), plan, input_files
    )
    sequences = modes.sequence_length is not None
    shm = modes.shared_memory != "none"
    if (modes.streaming or sequences or shm or plan.rates) and client != "raw":
        raise BenchError(
            "--streaming, sequences, --shared-memory and --request-rate run on the raw gRPC "
            "client (--grpc-client raw, the default)"
        )
    open_workers = modes.open_sequences if sequences else _pool_limit(plan)
    variants = _variants(metadata["inputs"], plan, input_files, shapes, input_data)
    requests = target.requests(variants)
    shm_requests: list[bytes] = []
    index = 0

    def maker(count: int) -> Callable[[int, int], bytes] | None:
        # Requests per worker (sequences) or per connection (shared memory).
        if sequences:
            make = _sequence_maker(_Sequencer(modes, plan.seed), target.sequence_requests(variants))
            return lambda conn, worker: make((conn, worker))
        if shm:
            return lambda conn, _worker: shm_requests[conn]
        return None

    async def level(
        count: int, recorder: _Recorder, load: str, value: float, **loop_options: Any
    ) -> Result:
        nonlocal index

        async def measure(recorder: _Recorder) -> Result:
            return await _measure(
                recorder,
                plan.settings,
                load,
                value,
                progress,
                (index, plan.levels),
                streaming=modes.streaming,
            )

        result = await run_grpc_level(
            target,
            requests,
            count,
            recorder,
            measure,
            client=client,
            streaming=modes.streaming,
            next_request=maker(count),
            **loop_options,
        )
        index += 1
        return result

    async def run_closed(count: int, recorder: _Recorder) -> Result:
        return await level(count, recorder, "concurrency", count)

    async def run_open(rate: float, recorder: _Recorder) -> Result:
        return await level(
            open_workers,
            recorder,
            "rate",
            rate,
            schedule=plan.schedule(rate),
            backlog_limit=_BACKLOG_PER_CONNECTION * open_workers,
        )

    if not shm:
        return await _run_levels(plan, run_closed, run_open)
    # A region per HTTP/2 connection, each carrying WORKERS_PER_CHANNEL workers' calls.
    workers = open_workers if plan.rates else max(plan.concurrency)
    connections = math.ceil(workers / WORKERS_PER_CHANNEL)
    async with _regions(target, metadata, variants, modes, connections) as regions:
        shm_requests.extend(target.shm_requests(regions))
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
    info = engine.model(model)
    config: dict[str, Any] = {"model_transaction_policy": {"decoupled": info.decoupled}}
    if info.config.sequence is not None:
        config["sequence_batching"] = {}
    modes = _check_modes(check_model(config, plan.modes, model), plan, input_files)
    if modes.shared_memory != "none":
        raise BenchError("--shared-memory is for servers: in-process there is nothing to share")
    variants = _variants(specs, plan, input_files, shapes, input_data)
    inputs = [{t.name: t.array for t in v} for v in variants]
    index = 0

    def senders(count: int, recorder: _Recorder) -> list[Send]:
        def failed(exc: TrioInferError) -> Status:
            name = type(exc).__name__
            recorder.first_error.setdefault(name, public_names(str(exc)))
            return name

        async def send(n: int, _due: int) -> Status:
            try:
                await engine.infer(model, inputs[n % len(inputs)])
            except TrioInferError as exc:
                return failed(exc)
            return 200

        async def stream(n: int, due: int) -> Status:
            # The first response's time counts from when the request was due (open
            # loop: a request that waited for a free worker waited on its clock), as
            # its latency does and as perf_analyzer counts it.
            first, responses = 0, 0
            try:
                async with engine.infer_stream(model, inputs[n % len(inputs)]) as answers:
                    async for _ in answers:
                        if not responses:
                            first = time.perf_counter_ns()
                        responses += 1
            except TrioInferError as exc:
                return failed(exc)
            if responses:
                recorder.window.first.append(first - due)
                recorder.window.responses += responses
            return 200

        def in_sequence(steps: Iterator[SequenceStep]) -> Send:
            async def send_step(n: int, _due: int) -> Status:
                step = next(steps)
                flags = SequenceFlags(step.id, start=step.start, end=step.end)
                try:
                    await engine.infer(model, inputs[n % len(inputs)], sequence=flags)
                except TrioInferError as exc:
                    return failed(exc)
                return 200

            return send_step

        if modes.streaming:
            return [stream] * count
        if modes.sequence_length is not None:
            sequencer = _Sequencer(modes, plan.seed)
            return [in_sequence(sequencer.slot()) for _ in range(count)]
        return [send] * count

    async def measure(recorder: _Recorder, load: str, value: float) -> Result:
        nonlocal index
        result = await _measure(
            recorder,
            plan.settings,
            load,
            value,
            progress,
            (index, plan.levels),
            streaming=modes.streaming,
        )
        index += 1
        return result

    async def run_closed(count: int, recorder: _Recorder) -> Result:
        return await _closed_level(senders(count, recorder), recorder, measure)

    async def run_open(rate: float, recorder: _Recorder) -> Result:
        # Workers are only tasks: start them all; each sleeps until the time it claimed.
        # Sequences: one worker per sequence in flight, each running its own in order.
        workers = modes.open_sequences if modes.sequence_length is not None else 0
        return await _open_level(
            senders(workers or _pool_limit(plan), recorder),
            recorder,
            measure,
            rate=rate,
            schedule=plan.schedule(rate),
        )

    return await _run_levels(plan, run_closed, run_open)
