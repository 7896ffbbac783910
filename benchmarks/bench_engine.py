#!/usr/bin/env python
"""Per-request overhead of trioinfer against a direct loop and a naive to_thread bridge.

Runs, side by side in one process and one invocation, batch-1 requests on one
ONNX model (the bundled ``digits`` MLP by default):

  a      direct ``session.run`` tight loop on one thread (intra_op_num_threads=1): the ceiling
  b      naive bridge: C Trio tasks, each ``await trio.to_thread.run_sync(session.run, ...)``,
         one shared session, threads=1 (Trio's default limiter: up to 40 threads at once)
  b1     as b, but ``limiter=trio.CapacityLimiter(1)``: one run at a time, like one instance
  b2     as b, with a threads=2 session (b' in the issue: the fair baseline for d)
  c      trioinfer ``engine.infer``, one CPU instance, threads=1, dispatch "thread"
  d      trioinfer, one CPU instance, threads=2, dispatch "ort_async"
  e      trioinfer, two CPU instances, threads=1 each, dispatch "thread"
  f      trioinfer, one CPU instance, threads=1, dispatch "inline" (on the event loop's thread)
  A      direct ``session.run`` tight loop at the batch size the engine forms (C requests'
         rows, at most ``--max-batch``, with ``--batcher dynamic``): the ceiling for
         batched and multi-row runs, which the ``rows/s X / A`` ratios compare against

at each concurrency C (C client tasks, each sending its next request as soon as the
previous one returns). Every run warms up first, then measures for a fixed time:
requests completed in the window, their latencies, and the process's CPU time
(all threads) and the event-loop thread's CPU time over the window.

With ``--batcher dynamic`` every trioinfer configuration batches (``--max-batch``,
``--delay``); ``--rows N`` sends N-row requests; ``--device cuda:0`` puts every
session, raw and trioinfer, on that GPU (CUDA execution provider, onnxruntime-gpu);
``--model wide`` writes the wide MLP of ``trioinfer.testing.models.write_wide_mlp``
to a temporary directory and runs it.

Usage:  .venv/bin/python benchmarks/bench_engine.py [--duration 3] [--repeat 2]
        .venv/bin/python benchmarks/bench_engine.py --profile c:64
        .venv/bin/python benchmarks/bench_engine.py --batcher dynamic --configs c,f \
            --concurrency 256
        .venv/bin/python benchmarks/bench_engine.py --model wide --rows 32 --batcher dynamic \
            --max-batch 128 --configs A,c --concurrency 16 [--device cuda:0]
See benchmarks/README.md for what each column means.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import math
import os
import platform
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from importlib.metadata import PackageNotFoundError, entry_points, version
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import trio

import trioinfer

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "src" / "trioinfer" / "examples"
DEFAULT_MODEL = EXAMPLES / "repository" / "digits" / "1" / "model.onnx"
DEFAULT_SAMPLES = EXAMPLES / "digits_samples.npz"

CONFIGS: dict[str, str] = {
    "a": "direct session.run loop, threads=1",
    "b": "naive to_thread, shared session, threads=1",
    "b1": "naive to_thread, CapacityLimiter(1), threads=1",
    "b2": "naive to_thread, shared session, threads=2 (b')",
    "c": "trioinfer 1 instance, threads=1, dispatch=thread",
    "d": "trioinfer 1 instance, threads=2, dispatch=ort_async",
    "e": "trioinfer 2 instances, threads=1 each, dispatch=thread",
    "f": "trioinfer 1 instance, threads=1, dispatch=inline",
    "A": "direct session.run loop at the engine's batch size",
}
DEFAULT_CONFIGS = "a,b,b1,b2,c,d,e,f"
#: Configurations measured once per repeat, at concurrency 1.
DIRECT = ("a", "A")


# -- results ------------------------------------------------------------------------


@dataclass
class Result:
    config: str
    concurrency: int
    rep: int
    seconds: float
    cpu_s: float
    loop_cpu_s: float
    latencies_ns: list[int] = field(repr=False)
    rows: int = 1  # rows per request (per session.run for a and A)

    @property
    def requests(self) -> int:
        return len(self.latencies_ns)

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    def percentile_us(self, q: float) -> float:
        if not self.latencies_ns:
            return math.nan
        return float(np.percentile(np.asarray(self.latencies_ns), q)) / 1e3

    @property
    def rows_per_s(self) -> float:
        return self.requests * self.rows / self.seconds

    @property
    def cpu_us(self) -> float:
        return self.cpu_s / self.requests * 1e6 if self.requests else math.nan

    @property
    def loop_cpu_us(self) -> float:
        return self.loop_cpu_s / self.requests * 1e6 if self.requests else math.nan

    @property
    def cores(self) -> float:
        return self.cpu_s / self.seconds


# -- workloads -----------------------------------------------------------------------


@dataclass
class Workload:
    model: Path
    input_name: str
    inputs: list[np.ndarray[Any, Any]]  # one request's arrays, cycled through
    rows: int  # rows per request
    device: str
    images: np.ndarray[Any, Any]  # every sample row

    def batch(self, rows: int) -> list[np.ndarray[Any, Any]]:
        """Arrays of *rows* rows each, cut from the samples."""
        images = self.images
        if len(images) < rows:
            images = np.concatenate([images] * (rows // len(images) + 1))
        return [images[i : i + rows] for i in range(0, len(images) - rows + 1, rows)]


def load_workload(model: Path, samples: Path | None, rows: int, device: str) -> Workload:
    session = make_session(model, 1, device)
    spec = session.get_inputs()[0]
    if len(session.get_inputs()) != 1:
        sys.exit(
            f"{model}: the benchmark feeds one input; this model has {len(session.get_inputs())}"
        )
    if spec.type != "tensor(float)":
        sys.exit(f"{model}: the benchmark feeds float32; input {spec.name!r} is {spec.type}")
    shape = [1] + [d if isinstance(d, int) else 1 for d in spec.shape[1:]]
    images = None
    if samples is not None and samples.is_file():
        with np.load(samples) as data:
            images = np.ascontiguousarray(data["images"], dtype=np.float32)
        if list(images.shape[1:]) != shape[1:]:
            images = None
    if images is None:
        rng = np.random.default_rng(0)
        images = rng.random((256, *shape[1:]), dtype=np.float32)
    work = Workload(model, spec.name, [], rows, device, images)
    work.inputs = work.batch(rows)
    return work


def make_session(model: Path, threads: int, device: str = "cpu") -> Any:
    # The same session options the trioinfer ONNX Runtime backend uses by default.
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 0
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3
    providers: list[Any] = ["CPUExecutionProvider"]
    if device.startswith("cuda"):
        index = int(device.partition(":")[2] or 0)
        providers.insert(0, ("CUDAExecutionProvider", {"device_id": index}))
    return ort.InferenceSession(str(model), so, providers=providers)


class Window:
    """The measurement window: warm up, then measure, then stop the clients."""

    def __init__(self) -> None:
        self.measuring = False
        self.stop = False
        self.latencies: list[int] = []


def run_direct(
    work: Workload, warmup: float, duration: float, rep: int, config: str = "a", batch: int = 0
) -> Result:
    session = make_session(work.model, 1, work.device)
    batch = batch or work.rows
    run, name, inputs = session.run, work.input_name, work.batch(batch)
    n = len(inputs)
    perf = time.perf_counter_ns
    i = 0
    end = time.perf_counter() + warmup
    while time.perf_counter() < end:
        run(None, {name: inputs[i % n]})
        i += 1
    latencies: list[int] = []
    gc.collect()
    cpu0, t0 = time.process_time(), time.perf_counter()
    end = t0 + duration
    while True:
        start = perf()
        run(None, {name: inputs[i % n]})
        stop = perf()
        latencies.append(stop - start)
        i += 1
        if stop * 1e-9 >= end:
            break
    cpu1, t1 = time.process_time(), time.perf_counter()
    # Single-threaded: the loop thread is the process.
    return Result(config, 1, rep, t1 - t0, cpu1 - cpu0, cpu1 - cpu0, latencies, batch)


Call = Callable[[np.ndarray[Any, Any]], Awaitable[object]]


async def drive(
    call: Call,
    work: Workload,
    config: str,
    concurrency: int,
    warmup: float,
    duration: float,
    rep: int,
    profiler: Profiler | None = None,
) -> Result:
    """Run *concurrency* client tasks against *call*; measure after *warmup* for *duration*."""
    window = Window()
    inputs = work.inputs
    n = len(inputs)

    async def client(k: int) -> None:
        perf = time.perf_counter_ns
        latencies = window.latencies
        i = k
        while not window.stop:
            x = inputs[i % n]
            i += concurrency
            start = perf()
            await call(x)
            if window.measuring:
                latencies.append(perf() - start)

    async with trio.open_nursery() as nursery:
        for k in range(concurrency):
            nursery.start_soon(client, k)
        await trio.sleep(warmup)
        gc.collect()
        if profiler is not None:
            profiler.start()
        cpu0, loop0, t0 = time.process_time(), time.thread_time(), time.perf_counter()
        window.measuring = True
        await trio.sleep(duration)
        window.measuring = False
        cpu1, loop1, t1 = time.process_time(), time.thread_time(), time.perf_counter()
        if profiler is not None:
            profiler.stop()
        window.stop = True
    return Result(
        config,
        concurrency,
        rep,
        t1 - t0,
        cpu1 - cpu0,
        loop1 - loop0,
        window.latencies,
        work.rows,
    )


async def run_naive(
    work: Workload,
    config: str,
    concurrency: int,
    warmup: float,
    duration: float,
    rep: int,
    sessions: dict[int, Any],
    profiler: Profiler | None = None,
) -> Result:
    threads = 2 if config == "b2" else 1
    if threads not in sessions:
        sessions[threads] = make_session(work.model, threads, work.device)
    session = sessions[threads]
    run, name = session.run, work.input_name
    limiter = trio.CapacityLimiter(1) if config == "b1" else None

    async def call(x: np.ndarray[Any, Any]) -> object:
        if limiter is None:
            return await trio.to_thread.run_sync(run, None, {name: x})
        return await trio.to_thread.run_sync(partial(run, None, {name: x}), limiter=limiter)

    return await drive(call, work, config, concurrency, warmup, duration, rep, profiler)


ENGINE_SETUPS: dict[str, tuple[int, int, str]] = {
    # config: (instances, threads per instance, dispatch)
    "c": (1, 1, "thread"),
    "d": (1, 2, "ort_async"),
    "e": (2, 1, "thread"),
    "f": (1, 1, "inline"),
}


async def run_engine(
    work: Workload,
    config: str,
    concurrency: int,
    warmup: float,
    duration: float,
    rep: int,
    profiler: Profiler | None = None,
    batching: Mapping[str, Any] | None = None,
    depth: int = 1,
) -> Result:
    count, threads, dispatch = ENGINE_SETUPS[config]
    options: dict[str, Any] = {"dispatch": dispatch}
    if work.device != "cpu" and dispatch != "thread":
        options = {}  # the GPU's own default dispatch
    if depth > 1:
        options["pipeline_depth"] = depth
    model_config = trioinfer.ModelConfig(
        name="bench",
        path=work.model,
        instances=[trioinfer.Instance(device=work.device, count=count, threads=threads)],
        backend_options=options,
        max_queue_size=max(1024, 2 * concurrency),
        batcher="dynamic" if batching else "none",
        batcher_options=dict(batching or {}),
    )
    name = work.input_name
    async with trioinfer.open_engine(registry=registry()) as engine:
        await engine.load(model_config)

        async def call(x: np.ndarray[Any, Any]) -> object:
            return await engine.infer("bench", {name: x})

        return await drive(call, work, config, concurrency, warmup, duration, rep, profiler)


def run_one(
    work: Workload,
    config: str,
    concurrency: int,
    args: argparse.Namespace,
    rep: int,
    sessions: dict[int, Any],
    profiler: Profiler | None = None,
) -> Result:
    gc.collect()
    if config == "a":
        return run_direct(work, args.warmup, args.duration, rep)
    if config == "A":
        return run_direct(work, args.warmup, args.duration, rep, "A", engine_batch(args, work))
    if config.startswith("b"):
        fn: Any = partial(run_naive, sessions=sessions)
    else:
        fn = partial(run_engine, batching=batching(args), depth=args.depth)
    return trio.run(
        partial(fn, work, config, concurrency, args.warmup, args.duration, rep, profiler=profiler)
    )


def registry() -> trioinfer.Registry | None:
    """The installed plugins; or, in a bare checkout (``PYTHONPATH=src:plugins``), ours.

    Without an installed trioinfer there are no entry points, so the first-party
    plugins this script needs are named here (a GPU box with only numpy, trio,
    attrs, onnx and onnxruntime-gpu runs it that way).
    """
    if any(ep.name == "onnxruntime" for ep in entry_points(group="trioinfer.backends")):
        return None
    sys.path.insert(0, str(ROOT / "plugins"))
    import trioinfer_batching
    import trioinfer_fallback
    import trioinfer_onnxruntime
    import trioinfer_scheduling

    return trioinfer.Registry(
        extra={
            "backends": {"onnxruntime": trioinfer_onnxruntime.OnnxRuntimeBackend},
            "schedulers": {"fifo": trioinfer_scheduling.FifoScheduler},
            "batchers": {
                "none": trioinfer_batching.NoBatcher,
                "dynamic": trioinfer_batching.DynamicBatcher,
            },
            "fallbacks": {"none": trioinfer_fallback.NoFallback},
        }
    )


def batching(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.batcher != "dynamic":
        return None
    return {"max_batch_size": args.max_batch, "max_queue_delay": args.delay}


def engine_batch(args: argparse.Namespace, work: Workload) -> int:
    """The rows of the batches the engine forms at full load: the ceiling's batch size."""
    if args.batcher != "dynamic":
        return work.rows
    return max(args.max_batch // work.rows, 1) * work.rows


# -- profiling -----------------------------------------------------------------------


class Profiler:
    """Profiles the event-loop thread during the measurement window only."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._cprofile: cProfile.Profile | None = None
        self._pyinstrument: Any = None

    def start(self) -> None:
        if self.kind == "cprofile":
            self._cprofile = cProfile.Profile()
            self._cprofile.enable()
        else:
            import pyinstrument  # optional: pip install pyinstrument

            self._pyinstrument = pyinstrument.Profiler(interval=0.0002, async_mode="disabled")
            self._pyinstrument.start()

    def stop(self) -> None:
        if self._cprofile is not None:
            self._cprofile.disable()
        if self._pyinstrument is not None:
            self._pyinstrument.stop()

    def report(self, requests: int, top: int) -> None:
        if self._pyinstrument is not None:
            print(self._pyinstrument.output_text(unicode=True, color=False, show_all=False))
            return
        assert self._cprofile is not None
        stats = pstats.Stats(self._cprofile)
        rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)  # type: ignore[attr-defined]
        total = sum(v[2] for _, v in rows)
        print(
            f"cProfile of the event-loop thread, {requests} requests; "
            f"profiled self time {total / requests * 1e6:.1f} us/request "
            "(cProfile inflates small calls; compare shares, not absolutes)"
        )
        print(f"{'self us/req':>11} {'cum us/req':>11} {'calls/req':>9}  function")
        for (filename, line, func), (_cc, nc, tt, ct, _callers) in rows[:top]:
            where = _short(filename)
            print(
                f"{tt / requests * 1e6:11.2f} {ct / requests * 1e6:11.2f} {nc / requests:9.2f}"
                f"  {func} ({where}:{line})"
            )
        # trioinfer's own functions (core and first-party plugins), with what each one calls.
        stats.calc_callees()
        callees = stats.all_callees  # type: ignore[attr-defined]
        own = [kv for kv in rows if "trioinfer" in _short(kv[0][0]).split("/", 1)[0]]
        own.sort(key=lambda kv: kv[1][3], reverse=True)
        print("\ntrioinfer's own functions by cumulative time, and their direct callees")
        print(f"{'self us/req':>11} {'cum us/req':>11} {'calls/req':>9}  function")
        for key, (_cc, nc, tt, ct, _callers) in own:
            print(
                f"{tt / requests * 1e6:11.2f} {ct / requests * 1e6:11.2f} {nc / requests:9.2f}"
                f"  {key[2]} ({_short(key[0])}:{key[1]})"
            )
            children = sorted(callees.get(key, {}).items(), key=lambda kv: kv[1][3], reverse=True)
            for (cfile, cline, cfunc), (cnc, _ccc, _ctt, cct) in children[:8]:
                if cct / requests * 1e6 < 0.5:
                    break
                print(
                    f"{'':11} {cct / requests * 1e6:11.2f} {cnc / requests:9.2f}"
                    f"      -> {cfunc} ({_short(cfile)}:{cline})"
                )


def _short(filename: str) -> str:
    for marker in ("site-packages/", "/src/", "/plugins/", "/lib/python"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    return filename


# -- reporting -----------------------------------------------------------------------


def versions() -> str:
    def v(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "?"

    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 0
    return (
        f"python {platform.python_version()} ({platform.python_implementation()}), "
        f"trio {trio.__version__}, anyio {v('anyio')}, onnxruntime {ort.__version__}, "
        f"numpy {np.__version__}, trioinfer {trioinfer.__version__}\n"
        f"machine: {platform.machine()}, os.cpu_count()={os.cpu_count()}, usable CPUs={cpus}, "
        f"load average {'/'.join(f'{x:.2f}' for x in os.getloadavg())}"
    )


HEADER = (
    f"{'cfg':<3} {'conc':>4} {'rep':>3} {'req/s':>9} {'rows/s':>9} {'p50 us':>9} {'p99 us':>9} "
    f"{'CPU us/req':>10} {'loop us/req':>11} {'cores':>5}  description"
)


def row(r: Result) -> str:
    return (
        f"{r.config:<3} {r.concurrency:>4} {r.rep:>3} {r.rps:9.0f} {r.rows_per_s:9.0f} "
        f"{r.percentile_us(50):9.1f} "
        f"{r.percentile_us(99):9.1f} {r.cpu_us:10.1f} {r.loop_cpu_us:11.1f} {r.cores:5.2f}"
        f"  {CONFIGS[r.config]}"
    )


def print_ratios(
    results: Sequence[Result],
    concurrencies: Sequence[int],
    reps: int,
    batched: bool,
    digits_rows_1: bool = False,
) -> None:
    def get(config: str, conc: int, rep: int) -> Result | None:
        if config in DIRECT:
            conc = 1
        for r in results:
            if (r.config, r.concurrency, r.rep) == (config, conc, rep):
                return r
        return None

    def ratio(
        label: str,
        conc: int,
        metric: Callable[[Result, Result, Result | None], float],
        num: str,
        den: str,
    ) -> float | None:
        values = []
        for rep in range(1, reps + 1):
            x, y, a = get(num, conc, rep), get(den, conc, rep), get("a", conc, rep)
            if x is not None and y is not None:
                values.append(metric(x, y, a))
        if not values:
            return None
        each = ", ".join(f"{v:.2f}" for v in values)
        print(f"  {label:<52} {statistics.median(values):6.2f}   (per rep: {each})")
        return statistics.median(values)

    def cpu(x: Result, y: Result, _a: Result | None) -> float:
        return x.cpu_us / y.cpu_us

    def overhead(x: Result, y: Result, a: Result | None) -> float:
        if a is None:
            return math.nan
        return (x.cpu_us - a.cpu_us) / (y.cpu_us - a.cpu_us)

    def loop(x: Result, y: Result, _a: Result | None) -> float:
        return x.loop_cpu_us / y.loop_cpu_us

    def rps(x: Result, y: Result, _a: Result | None) -> float:
        return x.rps / y.rps

    def rows(x: Result, y: Result, _a: Result | None) -> float:
        return x.rows_per_s / y.rows_per_s

    def loop_us(x: Result, _y: Result, _a: Result | None) -> float:
        return x.loop_cpu_us

    print("\nratios (median over repeats; a is measured once per repeat, at concurrency 1)")
    for conc in concurrencies:
        print(f" concurrency {conc}:")
        goal = ratio("CPU/request   c / b   (goal <= 1.3)", conc, cpu, "c", "b")
        ratio("CPU/request above a   (c-a) / (b-a)", conc, overhead, "c", "b")
        ratio("loop-thread CPU/request   c / b", conc, loop, "c", "b")
        ratio("CPU/request   c / b1  (both one run at a time)", conc, cpu, "c", "b1")
        ratio("CPU/request   d / b'", conc, cpu, "d", "b2")
        ratio("CPU/request   e / b", conc, cpu, "e", "b")
        ratio("CPU/request   f / b", conc, cpu, "f", "b")
        ratio("throughput    c / b", conc, rps, "c", "b")
        ratio("throughput    c / b1", conc, rps, "c", "b1")
        ratio("throughput    c / a", conc, rps, "c", "a")
        ratio("throughput    d / b'", conc, rps, "d", "b2")
        ratio("throughput    e / b", conc, rps, "e", "b")
        ratio("throughput    f / b", conc, rps, "f", "b")
        for config in "cdef":
            ceiling = ratio(f"rows/s        {config} / A  (goal >= 0.85)", conc, rows, config, "A")
            if ceiling is not None and config == "c":
                verdict = "meets" if ceiling >= 0.85 else "MISSES"
                print(f"  -> rows/s c vs A: {ceiling:.2f}x, {verdict} the >= 0.85x goal")
        if batched and digits_rows_1:
            for config in "cf":
                us = ratio(
                    f"loop us/req   {config}  (goal <= 8, digits)", conc, loop_us, config, config
                )
                if us is not None:
                    verdict = "meets" if us <= 8 else "MISSES"
                    print(f"  -> loop us/req {config}: {us:.1f}, {verdict} the <= 8 us goal")
        if goal is not None:
            verdict = "meets" if goal <= 1.3 else "MISSES"
            print(f"  -> CPU/request c vs b: {goal:.2f}x, {verdict} the issue's <= 1.3x goal")


# -- main ------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=3.0, help="seconds measured per run")
    parser.add_argument("--warmup", type=float, default=0.5, help="seconds of warm-up per run")
    parser.add_argument(
        "--concurrency", default="1,64,256", help="comma-separated client-task counts"
    )
    parser.add_argument("--repeat", type=int, default=2, help="interleaved repeats of everything")
    parser.add_argument(
        "--configs", default=DEFAULT_CONFIGS, help=f"which of {','.join(CONFIGS)} to run"
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=DEFAULT_MODEL,
        help="an ONNX model file, or 'wide' for the wide MLP (written to a temporary directory)",
    )
    parser.add_argument(
        "--batcher",
        choices=("none", "dynamic"),
        default="none",
        help="the trioinfer configurations' batcher",
    )
    parser.add_argument("--max-batch", type=int, default=32, help="dynamic: max_batch_size (rows)")
    parser.add_argument(
        "--delay", type=float, default=0.002, help="dynamic: max_queue_delay (seconds)"
    )
    parser.add_argument("--rows", type=int, default=1, help="rows per request")
    parser.add_argument(
        "--depth", type=int, default=1, help="trioinfer: the backend's pipeline_depth"
    )
    parser.add_argument(
        "--device", default="cpu", help="cpu, or cuda:N for every session (onnxruntime-gpu)"
    )
    parser.add_argument(
        "--samples",
        type=Path,
        default=DEFAULT_SAMPLES,
        help="an .npz with key 'images' of inputs; random data if absent or the wrong shape",
    )
    parser.add_argument(
        "--profile",
        metavar="CONFIG:CONC",
        help="instead of the table, profile one run's event-loop thread, e.g. c:64",
    )
    parser.add_argument("--profiler", choices=("cprofile", "pyinstrument"), default="cprofile")
    parser.add_argument("--top", type=int, default=35, help="functions listed by --profile")
    args = parser.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(args.configs) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown configs {unknown}; known: {', '.join(CONFIGS)}")
    if any(c < 1 for c in args.concurrency) or args.repeat < 1:
        parser.error("concurrency and repeat must be >= 1")
    if args.rows < 1 or args.max_batch < 1:
        parser.error("--rows and --max-batch must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    print(versions())
    with tempfile.TemporaryDirectory() as tmp:
        if str(args.model) == "wide":
            from trioinfer.testing.models import write_wide_mlp

            args.model = write_wide_mlp(Path(tmp) / "wide.onnx")
        run_all(args)


def run_all(args: argparse.Namespace) -> None:
    work = load_workload(args.model, args.samples, args.rows, args.device)
    print(
        f"model {args.model} (input {work.input_name!r}, requests of shape "
        f"{list(work.inputs[0].shape)}) on {args.device}, batcher {args.batcher}"
        + (
            f" (max_batch_size {args.max_batch}, max_queue_delay {args.delay}s; "
            f"A runs batches of {engine_batch(args, work)} rows)"
            if args.batcher == "dynamic"
            else ""
        )
        + (f", pipeline_depth {args.depth}" if args.depth > 1 else "")
        + f", warm-up {args.warmup}s, measure {args.duration}s per run, repeat {args.repeat}"
    )
    sessions: dict[int, Any] = {}

    if args.profile:
        config, _, conc = args.profile.partition(":")
        if config not in CONFIGS or config in DIRECT:
            sys.exit(f"--profile needs one of {', '.join(c for c in CONFIGS if c not in DIRECT)}")
        profiler = Profiler(args.profiler)
        result = run_one(work, config, int(conc or 64), args, 1, sessions, profiler)
        print(HEADER)
        print(row(result))
        profiler.report(result.requests, args.top)
        return

    print("\nconfigs:")
    for key in args.configs:
        print(f"  {key:<3} {CONFIGS[key]}")
    print()
    print(HEADER)
    results: list[Result] = []
    for rep in range(1, args.repeat + 1):
        for config in DIRECT:
            if config in args.configs:
                results.append(run_one(work, config, 1, args, rep, sessions))
                print(row(results[-1]), flush=True)
        for conc in args.concurrency:
            for config in args.configs:
                if config in DIRECT:
                    continue
                results.append(run_one(work, config, conc, args, rep, sessions))
                print(row(results[-1]), flush=True)

    print("\nby concurrency (all repeats):")
    print(HEADER)
    for conc in args.concurrency:
        for config in args.configs:
            for r in results:
                if r.config == config and (r.concurrency == conc or config in DIRECT):
                    print(row(r))
        print()
    print_ratios(
        results,
        args.concurrency,
        args.repeat,
        args.batcher == "dynamic",
        args.model == DEFAULT_MODEL and args.rows == 1,
    )
    print(f"\nload average at the end: {'/'.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
