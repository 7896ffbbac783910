#!/usr/bin/env python
"""Dynamic batching against the raw ONNX Runtime ceiling, in one process and one run.

Issue 3, section 6 (a) and (b). Every ONNX Runtime session here, raw or inside
trioinfer, has the same thread settings: ``intra_op_num_threads = --threads``
(default 1), inter-op threads left to ORT (sequential execution, so unused),
graph optimisation ``all``, CPU provider. Those are the options the trioinfer
ONNX Runtime backend uses, with ``Instance(threads=...)`` giving the count.

Part ``wide`` (6a): the wide MLP of ``trioinfer.testing.models.write_wide_mlp``
(1024 -> 4096 -> 4096 -> 1000, float32, seeded weights, dynamic batch), written
to a temporary directory:

  ort32   raw ONNX Runtime: tight ``session.run`` loop at batch 32: the ceiling; measured
          before and after the trioinfer runs of each repeat, and the higher of the two
          is that repeat's ceiling (other work on the machine only ever lowers it)
  ort1    raw ONNX Runtime: tight ``session.run`` loop at batch 1
  none    trioinfer, one CPU instance, batcher "none", dispatch "thread"
  dyn2    trioinfer, as none with batcher "dynamic", max_batch_size 32, max_queue_delay 2 ms
  dyn5    as dyn2, max_queue_delay 5 ms

the trioinfer configurations at each concurrency C (default 1, 16, 64, 256):
C client tasks, each sending its next one-row request as soon as its last one
returns.

Part ``digits`` (6b): the bundled digits MLP (64 -> 10), one-row requests from
``trioinfer.digits_samples()``, concurrency 256 (``--digits-concurrency``):

  ort1, ort32   the raw loops, as above, for reference
  naive         C Trio tasks, each ``await trio.to_thread.run_sync(session.run, ...)``,
                one shared session (Trio's default limiter: up to 40 threads at once)
  dyn-thread    trioinfer, dynamic max 32, delay 2 ms, dispatch "thread"
  dyn-inline    as dyn-thread, dispatch "inline" (on the event loop's thread)
  dyn-inline+   as dyn-inline, with inline_budget_us 1000 instead of 250, so that it stays
                inline whatever the machine does to a 32-row execution's CPU time
  dyn-auto      as dyn-thread, dispatch "auto" (the default on the CPU: measures, then
                goes inline if cheap)

Each window warms up (``--warmup`` seconds, and until every client has had one
answer), then measures for ``--duration`` seconds: only requests that complete
inside the window count. ``--repeat`` repeats everything, interleaved, and the
ratios to the ceiling are taken within each repeat. The table is followed by
the issue's targets, met or missed, and a PNG plot of throughput against p99
latency for the wide MLP (``--plot``, needs matplotlib: ``trioinfer[bench]``).

Usage:  .venv/bin/python benchmarks/bench_batching.py                 # the full run
        .venv/bin/python benchmarks/bench_batching.py --models wide --concurrency 64,256
        .venv/bin/python benchmarks/bench_batching.py --duration 5 --repeat 3 --no-plot
See benchmarks/README.md ("Batching") for what each column means.
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import trio

# The versions line is the same as the in-process benchmark's (run as scripts from
# benchmarks/, so the sibling module imports directly).
from bench_engine import versions

import trioinfer

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PLOT = ROOT / "docs" / "img" / "batching.png"
MAX_BATCH = 32

DYN2 = {"max_batch_size": MAX_BATCH, "max_queue_delay": 0.002}
DYN5 = {"max_batch_size": MAX_BATCH, "max_queue_delay": 0.005}
# config: (batcher, batcher_options, backend_options); raw loops and naive are not here.
ENGINE_SETUPS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "none": ("none", {}, {"dispatch": "thread"}),
    "dyn2": ("dynamic", DYN2, {"dispatch": "thread"}),
    "dyn5": ("dynamic", DYN5, {"dispatch": "thread"}),
    "dyn2p": ("dynamic", DYN2, {"dispatch": "thread", "pipeline_depth": 2}),
    "dyn-thread": ("dynamic", DYN2, {"dispatch": "thread"}),
    "dyn-inline": ("dynamic", DYN2, {"dispatch": "inline"}),
    "dyn-inline+": ("dynamic", DYN2, {"dispatch": "inline", "inline_budget_us": 1000}),
    "dyn-auto": ("dynamic", DYN2, {"dispatch": "auto"}),
}
CONFIGS: dict[str, dict[str, str]] = {
    "wide": {
        "ort32": "raw ORT session.run loop, batch 32 (the ceiling)",
        "ort1": "raw ORT session.run loop, batch 1",
        "none": "trioinfer, batcher none, dispatch thread",
        "dyn2": "trioinfer, dynamic max 32 / 2 ms, dispatch thread",
        "dyn5": "trioinfer, dynamic max 32 / 5 ms, dispatch thread",
        "dyn2p": "as dyn2, with backend option pipeline_depth 2",
    },
    "digits": {
        "ort32": "raw ORT session.run loop, batch 32",
        "ort1": "raw ORT session.run loop, batch 1",
        "naive": "naive trio.to_thread.run_sync(session.run) per request",
        "dyn-thread": "trioinfer, dynamic max 32 / 2 ms, dispatch thread",
        "dyn-inline": "trioinfer, dynamic max 32 / 2 ms, dispatch inline",
        "dyn-inline+": "as dyn-inline, inline_budget_us 1000 (default 250)",
        "dyn-auto": "trioinfer, dynamic max 32 / 2 ms, dispatch auto (the CPU default)",
    },
}
BATCHING = ("dyn2", "dyn5", "dyn2p")  # the wide-MLP configurations the targets apply to
DIGITS_ENGINE = ("dyn-thread", "dyn-inline", "dyn-inline+", "dyn-auto")


# -- results ------------------------------------------------------------------------


@dataclass
class Result:
    model: str
    config: str
    concurrency: int
    rep: int
    seconds: float
    cpu_s: float
    loop_cpu_s: float
    latencies_ns: list[int] = field(repr=False)
    rows_per_call: int = 1  # 32 for the batch-32 raw loop
    executions: int | None = None  # backend executions in the window (trioinfer only)
    exec_s: float | None = None  # the engine's moving average of one execution
    notes: list[str] = field(default_factory=list)
    wait_s: float = math.nan  # time this process's threads spent runnable but not running

    @property
    def rows(self) -> int:
        return len(self.latencies_ns) * self.rows_per_call

    @property
    def rate(self) -> float:
        """Rows per second; for trioinfer (one row per request) requests per second."""
        return self.rows / self.seconds

    def percentile_ms(self, q: float) -> float:
        if not self.latencies_ns:
            return math.nan
        return float(np.percentile(np.asarray(self.latencies_ns), q)) / 1e6

    @property
    def rows_per_batch(self) -> float:
        if self.executions is None:
            return float(self.rows_per_call)
        return self.rows / self.executions if self.executions else math.nan

    @property
    def exec_ms(self) -> float:
        if self.exec_s is None:  # raw loop: the median session.run is the execution
            return self.percentile_ms(50)
        return self.exec_s * 1e3

    @property
    def cpu_us(self) -> float:
        return self.cpu_s / self.rows * 1e6 if self.rows else math.nan

    @property
    def loop_cpu_us(self) -> float:
        return self.loop_cpu_s / self.rows * 1e6 if self.rows else math.nan

    @property
    def cores(self) -> float:
        return self.cpu_s / self.seconds

    @property
    def loop_share(self) -> float:
        return self.loop_cpu_s / self.seconds

    @property
    def wait_share(self) -> float:
        return self.wait_s / self.seconds


# -- workloads -----------------------------------------------------------------------


Feeds = dict[str, np.ndarray[Any, Any]]  # one array per model input, by input name

# The element types of ONNX inputs a workload can feed.
ONNX_DTYPES = {
    "tensor(float)": np.float32,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(bool)": np.bool_,
}


@dataclass
class Workload:
    name: str
    model: Path
    rows: list[Feeds]  # batch-1 feeds, cycled through
    batch: Feeds  # MAX_BATCH rows of each input for the batch-32 loop


def make_workload(
    name: str, model: Path, data: np.ndarray[Any, Any] | Mapping[str, np.ndarray[Any, Any]]
) -> Workload:
    """One-row feeds for every input of *model*, cast to the types the model declares.

    *data* holds the rows of the model's only input, or, for a model with
    several (a transformer's ``input_ids`` and ``attention_mask``), the rows of
    each input by name, the same number of rows each.
    """
    inputs = make_session(model, 1).get_inputs()
    if not isinstance(data, Mapping):
        if len(inputs) != 1:
            raise ValueError(
                f"{name}: rows for one input, but the model has {[i.name for i in inputs]}"
            )
        data = {inputs[0].name: data}
    arrays = {i.name: np.ascontiguousarray(data[i.name], dtype=ONNX_DTYPES[i.type]) for i in inputs}
    count = len(next(iter(arrays.values())))
    rows = [{k: a[i : i + 1] for k, a in arrays.items()} for i in range(count)]
    batch = {
        k: np.ascontiguousarray(np.resize(a, (MAX_BATCH, *a.shape[1:]))) for k, a in arrays.items()
    }
    return Workload(name, model, rows, batch)


def wide_workload(directory: Path) -> Workload:
    from trioinfer.testing import models  # needs the onnx package (trioinfer[onnx])

    path = models.write_wide_mlp(directory / "wide_mlp.onnx", seed=0)
    data = np.random.default_rng(0).standard_normal((256, 1024), dtype=np.float32)
    return make_workload("wide", path, data)


def digits_workload() -> Workload:
    path = trioinfer.example_repository() / "digits" / "1" / "model.onnx"
    images, _labels = trioinfer.digits_samples()
    return make_workload("digits", path, images)


THREADS = 1  # set from --threads in main()


def make_session(model: Path, threads: int | None = None) -> Any:
    # The session options the trioinfer ONNX Runtime backend uses by default.
    so = ort.SessionOptions()
    so.intra_op_num_threads = THREADS if threads is None else threads
    so.inter_op_num_threads = 0
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3
    return ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])


def run_delays() -> dict[str, int] | None:
    """Nanoseconds each thread of this process has waited for a CPU while runnable (Linux).

    The second field of ``/proc/self/task/*/schedstat``, by thread id; ``None``
    where that is not available.
    """
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    delays = {}
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                delays[tid] = int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return delays


def waited_s(before: dict[str, int] | None, after: dict[str, int] | None) -> float:
    """Seconds the process's threads waited for a CPU between two `run_delays()`.

    Summed over the threads alive at the end; a thread that ended in between
    (an idle to_thread worker) takes its share with it, so this may undercount.
    """
    if before is None or after is None:
        return math.nan
    return sum(ns - before.get(tid, 0) for tid, ns in after.items()) / 1e9


# -- the raw loops -------------------------------------------------------------------


def run_raw(work: Workload, config: str, args: argparse.Namespace, rep: int) -> Result:
    session = make_session(work.model)
    run = session.run
    inputs = [work.batch] if config == "ort32" else work.rows
    n = len(inputs)
    perf = time.perf_counter_ns
    i = 0
    end = time.perf_counter() + args.warmup
    while i < 3 or time.perf_counter() < end:
        run(None, inputs[i % n])
        i += 1
    latencies: list[int] = []
    gc.collect()
    wait0, cpu0, t0 = run_delays(), time.process_time(), time.perf_counter()
    end_ns = int((t0 + args.duration) * 1e9)
    while True:
        start = perf()
        run(None, inputs[i % n])
        stop = perf()
        latencies.append(stop - start)
        i += 1
        if stop >= end_ns:
            break
    cpu1, t1, wait1 = time.process_time(), time.perf_counter(), run_delays()
    batch = MAX_BATCH if config == "ort32" else 1
    # One thread (with --threads 1): the loop thread is the process.
    result = Result(work.name, config, 1, rep, t1 - t0, cpu1 - cpu0, cpu1 - cpu0, latencies, batch)
    result.wait_s = waited_s(wait0, wait1)
    return result


# -- the closed-loop driver ----------------------------------------------------------


class Window:
    """The measurement window: warm up, then measure, then stop the clients."""

    def __init__(self, concurrency: int) -> None:
        self.measuring = False
        self.latencies: list[int] = []
        self.unanswered = concurrency
        self.all_answered = trio.Event()


Call = Callable[[Feeds], Awaitable[object]]
Counters = Callable[[], tuple[int, float]]  # (executions so far, mean execution seconds)


async def drive(
    call: Call,
    work: Workload,
    config: str,
    concurrency: int,
    args: argparse.Namespace,
    rep: int,
    counters: Counters | None = None,
) -> Result:
    """Run *concurrency* client tasks against *call*; warm up, then measure for a fixed time.

    The warm-up lasts ``args.warmup`` seconds and at least until every client
    has had one answer, so that a deep queue has turned over once before the
    window opens. When the window closes, the clients are cancelled: nothing
    waits for the queue to drain.
    """
    window = Window(concurrency)
    rows = work.rows
    n = len(rows)

    async def client(k: int) -> None:
        perf = time.perf_counter_ns
        latencies = window.latencies
        i = k
        first = True
        while True:
            feeds = rows[i % n]
            i += concurrency
            start = perf()
            await call(feeds)
            if window.measuring:
                latencies.append(perf() - start)
            if first:
                first = False
                window.unanswered -= 1
                if window.unanswered == 0:
                    window.all_answered.set()

    async with trio.open_nursery() as nursery:
        for k in range(concurrency):
            nursery.start_soon(client, k)
        await trio.sleep(args.warmup)
        with trio.move_on_after(60):
            await window.all_answered.wait()
        gc.collect()
        executions0 = counters()[0] if counters else 0
        wait0 = run_delays()
        cpu0, loop0, t0 = time.process_time(), time.thread_time(), time.perf_counter()
        window.measuring = True
        await trio.sleep(args.duration)
        window.measuring = False
        cpu1, loop1, t1 = time.process_time(), time.thread_time(), time.perf_counter()
        wait1 = run_delays()
        executions1, exec_s = counters() if counters else (0, 0.0)
        nursery.cancel_scope.cancel()
    result = Result(
        work.name, config, concurrency, rep, t1 - t0, cpu1 - cpu0, loop1 - loop0, window.latencies
    )
    result.wait_s = waited_s(wait0, wait1)
    if counters is not None:
        result.executions, result.exec_s = executions1 - executions0, exec_s
    return result


async def run_naive(work: Workload, concurrency: int, args: argparse.Namespace, rep: int) -> Result:
    session = make_session(work.model)
    run = session.run

    async def call(feeds: Feeds) -> object:
        return await trio.to_thread.run_sync(run, None, feeds)

    return await drive(call, work, "naive", concurrency, args, rep)


class Notes(logging.Handler):
    """Collects what the ONNX Runtime backend logs (e.g. where 'auto' dispatch settled)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


async def run_engine(
    work: Workload,
    config: str,
    concurrencies: Sequence[int],
    args: argparse.Namespace,
    rep: int,
    report: Callable[[Result], None],
) -> list[Result]:
    """Load the model once in one engine, then measure each concurrency in turn."""
    batcher, batcher_options, backend_options = ENGINE_SETUPS[config]
    model_config = trioinfer.ModelConfig(
        name=work.name,
        path=work.model,
        instances=[trioinfer.Instance(device="cpu", count=1, threads=THREADS)],
        batcher=batcher,
        batcher_options=batcher_options,
        backend_options=backend_options,
        max_queue_size=max(1024, 2 * max(concurrencies)),
    )
    notes = Notes()
    logger = logging.getLogger("trioinfer.onnxruntime")
    logger.addHandler(notes)
    logger.setLevel(logging.INFO)
    results = []
    try:
        async with trioinfer.open_engine(drain_period=0) as engine:
            await engine.load(model_config)

            async def call(feeds: Feeds) -> object:
                return await engine.infer(work.name, feeds)

            def counters() -> tuple[int, float]:
                stats = engine.statistics().models[work.name]
                return stats.executions, stats.mean_execution_s

            for conc in concurrencies:
                gc.collect()
                result = await drive(call, work, config, conc, args, rep, counters)
                result.notes, notes.messages = notes.messages, []
                report(result)
                results.append(result)
    finally:
        logger.removeHandler(notes)
    return results


# -- reporting -----------------------------------------------------------------------


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


HEADER = (
    f"{'model':<6} {'cfg':<11} {'conc':>4} {'rep':>3} {'rows/s':>9} {'x ceil':>6} "
    f"{'p50 ms':>8} {'p99 ms':>8} {'rows/bat':>8} {'exec ms':>7} {'CPU us/row':>10} "
    f"{'loop us/row':>11} {'cores':>5} {'loop':>5} {'wait':>5}"
)


LEGEND = """
columns:
  rows/s       rows per second in the window (trioinfer and naive: requests/s, one row each)
  x ceil       rows/s over the repeat's ceiling: its best ort32 run (raw ORT at batch 32)
               so far; the wide MLP's is measured before and after its trioinfer runs
  p50/p99 ms   latency as the client task sees it (raw loops: one session.run)
  rows/bat     rows per backend execution (executions counted by engine.statistics())
  exec ms      the engine's moving average of one execution, hop included (raw: median run)
  CPU us/row   process CPU time (all threads) over the window / rows
  loop us/row  event-loop thread CPU time / rows (for raw loops, the whole loop)
  cores        process CPU time / wall time
  loop         event-loop thread CPU time / wall time
  wait         time the process's threads were runnable but not running, / wall time:
               other processes had the CPUs (from /proc/self/task/*/schedstat)
"""


def row(r: Result, ceiling: float | None) -> str:
    ratio = f"{r.rate / ceiling:6.2f}" if ceiling else f"{'':>6}"
    text = (
        f"{r.model:<6} {r.config:<11} {r.concurrency:>4} {r.rep:>3} {r.rate:9.0f} {ratio} "
        f"{r.percentile_ms(50):8.2f} {r.percentile_ms(99):8.2f} {r.rows_per_batch:8.1f} "
        f"{r.exec_ms:7.2f} {r.cpu_us:10.1f} {r.loop_cpu_us:11.1f} {r.cores:5.2f} "
        f"{r.loop_share:5.2f} {r.wait_share:5.2f}"
    )
    for note in r.notes:
        text += f"\n{'':>12}backend: {note}"
    return text


def find(results: Sequence[Result], model: str, config: str, conc: int, rep: int) -> Result | None:
    for r in results:
        if (r.model, r.config, r.rep) == (model, config, rep) and (
            r.concurrency == conc or config.startswith("ort")
        ):
            return r
    return None


def raw32(results: Sequence[Result], model: str, rep: int) -> list[Result]:
    return [r for r in results if (r.model, r.config, r.rep) == (model, "ort32", rep)]


def ceiling_of(results: Sequence[Result], model: str, rep: int) -> float | None:
    """The repeat's ceiling: the best of its batch-32 raw loops (other load only lowers it)."""
    runs = raw32(results, model, rep)
    return max(r.rate for r in runs) if runs else None


def compute_ms(results: Sequence[Result], model: str, rep: int) -> float | None:
    """The repeat's batch-32 compute time: the fastest median run of its raw loops."""
    runs = raw32(results, model, rep)
    return min(r.percentile_ms(50) for r in runs) if runs else None


def raw_cpu_us(results: Sequence[Result], model: str, rep: int) -> float | None:
    """CPU per row of the repeat's batch-32 raw loops (the cheaper one)."""
    runs = raw32(results, model, rep)
    return min(r.cpu_us for r in runs) if runs else None


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def each(values: Sequence[float], fmt: str = ".2f") -> str:
    return ", ".join(format(v, fmt) for v in values)


def delay_of(config: str) -> float:
    return float(ENGINE_SETUPS[config][1].get("max_queue_delay", 0.0))


def print_targets(results: Sequence[Result], args: argparse.Namespace) -> list[str]:
    """Print the issue's targets, met or missed, and return the verdict lines."""
    verdicts: list[str] = []
    reps = range(1, args.repeat + 1)
    print("\ntargets (issue 3, section 6): median over repeats, then each repeat")
    if "wide" in args.models:
        ceilings = [c for rep in reps if (c := ceiling_of(results, "wide", rep))]
        t32 = [t for rep in reps if (t := compute_ms(results, "wide", rep))]
        one = [r.rate for rep in reps if (r := find(results, "wide", "ort1", 1, rep))]
        print(
            f"\n wide MLP, each repeat's best ort32 run: ceiling {median(ceilings):.0f} rows/s "
            f"({each(ceilings, '.0f')}), batch-32 compute (median run) {median(t32):.2f} ms "
            f"({each(t32)}); batch 1: {median(one):.0f} rows/s ({each(one, '.0f')})"
        )
        print(
            "\n (a1) throughput / ceiling at batch 32; target >= 0.85 at concurrency >= 64."
            "\n      'CPU' is ort32's CPU per row / this one's: how much of the CPU it used went"
            "\n      into the model, however many cores other processes left free."
        )
        print(f"  {'cfg':<6} {'conc':>4} {'ratio':>6}  {'per repeat':<14} {'CPU':>5}  per repeat")
        for config in ("none", *BATCHING):
            for conc in args.concurrency:
                values, cpus = [], []
                for rep in reps:
                    r, c, cpu = (
                        find(results, "wide", config, conc, rep),
                        ceiling_of(results, "wide", rep),
                        raw_cpu_us(results, "wide", rep),
                    )
                    if r is not None and c and cpu:
                        values.append(r.rate / c)
                        cpus.append(cpu / r.cpu_us)
                if not values:
                    continue
                verdict = ""
                if config in BATCHING and conc >= 64:
                    met = median(values) >= 0.85
                    verdict = "meets" if met else "MISSES"
                    verdicts.append(
                        f"(a1) {config} at {conc}: {median(values):.2f}x the batch-32 ceiling, "
                        f"{verdict} >= 0.85x"
                    )
                print(
                    f"  {config:<6} {conc:>4} {median(values):6.2f}  {'(' + each(values) + ')':<14}"
                    f" {median(cpus):5.2f}  {'(' + each(cpus) + ')':<14}  {verdict}"
                )
        print(
            "\n (a2) p99 <= max_queue_delay + 2 x batch-32 compute (both sides, ms; the bound uses"
            "\n      the same repeat's batch-32 compute). 'floor' is concurrency / throughput: the"
            "\n      mean latency any closed loop of that many clients must see (Little's law)."
        )
        print(
            f"  {'cfg':<6} {'conc':>4} {'p99':>8} {'bound':>8} {'floor':>8}  per repeat p99/bound"
        )
        for config in BATCHING:
            for conc in args.concurrency:
                p99s, bounds, floors = [], [], []
                for rep in reps:
                    r, t = (
                        find(results, "wide", config, conc, rep),
                        compute_ms(results, "wide", rep),
                    )
                    if r is None or t is None:
                        continue
                    p99s.append(r.percentile_ms(99))
                    bounds.append(delay_of(config) * 1e3 + 2 * t)
                    floors.append(conc / r.rate * 1e3 if r.rate else math.nan)
                if not p99s:
                    continue
                p99, bound = median(p99s), median(bounds)
                verdict = "meets" if p99 <= bound else "MISSES"
                verdicts.append(
                    f"(a2) {config} at {conc}: p99 {p99:.1f} ms vs bound {bound:.1f} ms, {verdict}"
                    + (
                        f" (Little's-law floor {median(floors):.1f} ms)"
                        if median(floors) > bound
                        else ""
                    )
                )
                pairs = ", ".join(f"{p:.1f}/{b:.1f}" for p, b in zip(p99s, bounds, strict=True))
                print(
                    f"  {config:<6} {conc:>4} {p99:8.1f} {bound:8.1f} {median(floors):8.1f}"
                    f"  ({pairs})  {verdict}"
                )
    if "digits" in args.models:
        conc = args.digits_concurrency
        print(f"\n (b) digits MLP at concurrency {conc}: trioinfer / naive to_thread; target >= 5")

        def against_naive(config: str, ratio: Callable[[Result, Result], float]) -> list[float]:
            # One value per repeat in which both trioinfer's and the naive run were measured.
            pairs = [
                (
                    find(results, "digits", config, conc, rep),
                    find(results, "digits", "naive", conc, rep),
                )
                for rep in reps
            ]
            return [
                ratio(r, b)
                for r, b in pairs
                if r is not None and b is not None and r.rows and b.rows
            ]

        for config in DIGITS_ENGINE:
            values = against_naive(config, lambda r, b: r.rate / b.rate)
            if not values:
                continue
            verdict = "meets" if median(values) >= 5 else "MISSES"
            verdicts.append(f"(b) {config}: {median(values):.2f}x naive, {verdict} >= 5x")
            print(f"  {config:<11} {median(values):6.2f}x  ({each(values)})  {verdict}")
        print(
            "  CPU per request, naive / trioinfer (how much cheaper each request is, whatever the"
            "\n  free cores; the naive bridge spreads over many threads, trioinfer's loop is one)"
        )
        for config in DIGITS_ENGINE:
            values = against_naive(config, lambda r, b: b.cpu_us / r.cpu_us)
            if values:
                print(f"  {config:<11} {median(values):6.2f}x  ({each(values)})")
    print("\nverdicts:")
    for line in verdicts:
        print(f"  {line}")
    return verdicts


def plot(results: Sequence[Result], args: argparse.Namespace, path: Path) -> None:
    """Throughput against p99 latency for the wide MLP, medians over repeats."""
    try:
        import matplotlib
    except ImportError:
        print("\nno plot: matplotlib is not installed (pip install 'trioinfer[bench]')")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reps = range(1, args.repeat + 1)
    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=120)
    styles = {  # colour, label, where the concurrency labels go (points)
        "none": ("tab:gray", "trioinfer, no batching", (7, -3)),
        "dyn2": ("tab:blue", "trioinfer, dynamic, max 32, delay 2 ms", (6, 6)),
        "dyn5": ("tab:orange", "trioinfer, dynamic, max 32, delay 5 ms", (7, -12)),
        "dyn2p": ("tab:green", "trioinfer, dynamic, max 32, delay 2 ms, pipeline depth 2", (6, 6)),
    }
    t32 = median([t for rep in reps if (t := compute_ms(results, "wide", rep))])
    ceiling = median([c for rep in reps if (c := ceiling_of(results, "wide", rep))])
    one = median([r.rate for rep in reps if (r := find(results, "wide", "ort1", 1, rep))])
    right = 0.0
    for config in ("none", *BATCHING):
        xs, ys, concs = [], [], []
        for conc in args.concurrency:
            runs = [r for rep in reps if (r := find(results, "wide", config, conc, rep))]
            if runs:
                xs.append(median([r.rate for r in runs]))
                ys.append(median([r.percentile_ms(99) for r in runs]))
                concs.append(conc)
        if not xs:
            continue
        colour, label, offset = styles[config]
        right = max(right, *xs)
        ax.plot(xs, ys, "o-", color=colour, label=label, zorder=3)
        for x, y, conc in zip(xs, ys, concs, strict=True):
            ax.annotate(
                f"C={conc}",
                (x, y),
                textcoords="offset points",
                xytext=offset,
                ha="right" if offset[0] < 0 else "left",
                fontsize=8,
                color=colour,
            )
        if config in BATCHING and not math.isnan(t32):
            bound = delay_of(config) * 1e3 + 2 * t32
            ax.axhline(
                bound,
                color=colour,
                linestyle=":",
                linewidth=1.2,
                label=f"p99 target, {delay_of(config) * 1e3:.0f} ms + 2 x {t32:.1f} ms"
                f" = {bound:.0f} ms",
            )
    if not math.isnan(ceiling):
        right = max(right, ceiling)
        ax.axvline(
            ceiling, color="black", linewidth=1.5, label=f"raw ORT at batch 32: {ceiling:.0f}/s"
        )
        ax.axvline(
            0.85 * ceiling,
            color="black",
            linestyle="--",
            linewidth=1,
            label=f"0.85 x that (throughput target): {0.85 * ceiling:.0f}/s",
        )
    if not math.isnan(one):
        ax.axvline(
            one, color="gray", linestyle="-.", linewidth=1, label=f"raw ORT at batch 1: {one:.0f}/s"
        )
    ax.set_yscale("log")
    ax.set_xlim(0, right * 1.12 if right else None)
    ax.set_xlabel("throughput (requests/s, one row each)")
    ax.set_ylabel("p99 latency (ms, log scale)")
    ax.set_title(
        "Wide MLP (1024-4096-4096-1000, float32) on CPU, one instance, "
        f"{THREADS} ORT thread{'s' if THREADS != 1 else ''}; C = concurrency",
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(0.12, 1.0), fontsize=8, framealpha=0.9)
    fig.text(
        0.99,
        0.005,
        f"points: medians of {args.repeat} repeat(s) of {args.duration:g} s windows; "
        f"{os.cpu_count()} CPUs; onnxruntime {ort.__version__}; "
        f"{time.strftime('%Y-%m-%d')}; benchmarks/bench_batching.py",
        ha="right",
        va="bottom",
        fontsize=7,
        color="gray",
    )
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    print(f"\nplot written to {path}")


# -- main ------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=3.0, help="seconds measured per window")
    parser.add_argument(
        "--warmup",
        type=float,
        default=0.5,
        help="seconds of warm-up per window (and until every client has had an answer)",
    )
    parser.add_argument(
        "--concurrency", default="1,16,64,256", help="client-task counts for the wide MLP"
    )
    parser.add_argument(
        "--digits-concurrency", type=int, default=256, help="client tasks for the digits MLP"
    )
    parser.add_argument("--repeat", type=int, default=2, help="interleaved repeats of everything")
    parser.add_argument("--models", default="wide,digits", help="which of wide,digits to run")
    parser.add_argument(
        "--threads", type=int, default=1, help="intra-op threads of every ORT session (default 1)"
    )
    parser.add_argument("--plot", type=Path, default=DEFAULT_PLOT, help="where the PNG goes")
    parser.add_argument("--no-plot", action="store_true", help="do not draw the plot")
    args = parser.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(args.models) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown models {unknown}; known: {', '.join(CONFIGS)}")
    if any(c < 1 for c in args.concurrency) or args.repeat < 1 or args.digits_concurrency < 1:
        parser.error("concurrency and repeat must be >= 1")
    if args.threads < 1:
        parser.error("--threads must be >= 1 (the same for every session)")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    global THREADS
    args = parse_args(argv)
    THREADS = args.threads
    started = time.perf_counter()
    print(versions())
    print(
        f"every ONNX Runtime session, raw and in trioinfer: intra_op_num_threads={THREADS}, "
        "sequential, graph optimisation all, CPU provider; one trioinfer instance"
    )
    print(
        f"warm-up {args.warmup}s (and until every client has had an answer), "
        f"measure {args.duration}s per window, repeat {args.repeat}"
    )
    with tempfile.TemporaryDirectory(prefix="trioinfer-bench-") as tmp:
        works: dict[str, Workload] = {}
        if "wide" in args.models:
            works["wide"] = wide_workload(Path(tmp))
            size = works["wide"].model.stat().st_size / 1e6
            print(
                f"wide: {works['wide'].model.name} ({size:.0f} MB, seed 0), 1024 -> 4096 -> 4096"
                f" -> 1000, one-row requests; concurrency {args.concurrency}"
            )
        if "digits" in args.models:
            works["digits"] = digits_workload()
            print(
                f"digits: the bundled example model, one-row requests of "
                f"trioinfer.digits_samples(); concurrency {args.digits_concurrency}"
            )
        print("\nconfigs:")
        for model in args.models:
            for key, text in CONFIGS[model].items():
                print(f"  {model:<6} {key:<11} {text}")
        print(LEGEND)
        print(HEADER)
        results: list[Result] = []

        def report(r: Result) -> None:
            results.append(r)
            print(row(r, ceiling_of(results, r.model, r.rep)), flush=True)

        for rep in range(1, args.repeat + 1):
            for model in args.models:
                work = works[model]
                report(run_raw(work, "ort32", args, rep))
                report(run_raw(work, "ort1", args, rep))
                if model == "wide":
                    for config in ("none", *BATCHING):
                        trio.run(
                            partial(run_engine, work, config, args.concurrency, args, rep, report)
                        )
                    report(run_raw(work, "ort32", args, rep))  # the ceiling again, after
                else:
                    conc = args.digits_concurrency
                    report(trio.run(run_naive, work, conc, args, rep))
                    for config in DIGITS_ENGINE:
                        trio.run(partial(run_engine, work, config, [conc], args, rep, report))

    print("\nall repeats, by model and configuration:")
    print(HEADER)
    for model in args.models:
        for config in CONFIGS[model]:
            for r in results:
                if (r.model, r.config) == (model, config):
                    print(row(r, ceiling_of(results, model, r.rep)).split("\n")[0])
        print()
    print_targets(results, args)
    if not args.no_plot and "wide" in args.models:
        plot(results, args, args.plot)
    elapsed = time.perf_counter() - started
    print(f"\nload average at the end: {load()}; the run took {elapsed:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
