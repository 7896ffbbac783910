#!/usr/bin/env python
"""What one execution's hop off the event loop costs the loop's thread, by way of dispatch.

Times, side by side in one Trio run and alternating, back-to-back executions of
one batch of the bundled ``digits`` MLP, awaited from the event loop:

  inline   ``session.run`` on the loop's own thread (threads=1): the loop pays the compute
  thread   ``WorkerThread.run_sync(session.run, ...)``, as ``dispatch = "thread"`` does
           (threads=1; the result wakes the loop through the worker's own socket)
  cb       ``session.run_async`` awaited through ``wait_on_callback`` (threads=2, no
           spinning; the callback wakes the loop through ``TrioToken.run_sync_soon``):
           what ``dispatch = "ort_async"`` did before ``CallbackWaiter``
  waiter   ``session.run_async`` awaited through a ``CallbackWaiter``, whose callback
           writes a byte to a socket pair the loop waits on: ``ort_async`` now

For each: the loop thread's CPU (``time.thread_time``), the process's CPU and the
wall time per execution, and the loop thread's involuntary and voluntary context
switches per execution (``getrusage(RUSAGE_THREAD)``, Linux). Per request at
dynamic batching's batch of 32, divide by 32.

With ``--overlap``, instead: does the worker thread compute while the loop is
busy? The loop submits one batch to a `WorkerThread`, then runs Python for
``--busy-us`` (about what waking a batch's 32 callers costs it) without a
system call, then waits for the result; the worker notes when ``session.run``
starts. Per placement (both threads free; both on CPU 0; loop on CPU 0 and
worker on CPU 1): when the worker started after the submit (median), the share
of batches it started only once the loop's busy stretch was over, and when the
result was back. The worker needs the GIL to take the job and call
``session.run``; the figures show whether it gets it before the loop lets go.

Usage:  .venv/bin/python benchmarks/bench_hop.py [--rows 32] [--trips 2000] [--repeat 3]
        .venv/bin/python benchmarks/bench_hop.py --overlap [--busy-us 200] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import trio

from trioinfer.lowlevel import CallbackWaiter, WorkerThread, wait_on_callback

MODEL = (
    Path(__file__).resolve().parent.parent / "src/trioinfer/examples/repository/digits/1/model.onnx"
)


def session(threads: int) -> Any:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if threads > 1:  # as the bench's ort_async advice: an idle spinning thread eats a core
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(MODEL), options, providers=["CPUExecutionProvider"])


async def main(args: argparse.Namespace) -> None:
    one, two = session(1), session(2)
    outputs = [spec.name for spec in one.get_outputs()]
    feed = {one.get_inputs()[0].name: np.random.rand(args.rows, 64).astype(np.float32)}
    worker = await WorkerThread.start("bench-hop")
    callbacks = CallbackWaiter()

    async def inline() -> Any:
        await trio.lowlevel.checkpoint()
        return one.run(outputs, feed)

    async def thread() -> Any:
        return await worker.run_sync(one.run, outputs, feed, ort.RunOptions())

    async def cb() -> Any:
        def start(resolve: Any) -> None:
            def done(values: Any, _user: object, error: str) -> None:
                resolve(None, RuntimeError(error)) if error else resolve(values, None)

            two.run_async(outputs, feed, done, None, ort.RunOptions())

        return await wait_on_callback(start)

    async def waiter() -> Any:
        def start(resolve: Any) -> None:
            def done(values: Any, _user: object, error: str) -> None:
                resolve(None, RuntimeError(error)) if error else resolve(values, None)

            two.run_async(outputs, feed, done, None, ort.RunOptions())

        return await callbacks.wait_on_callback(start)

    ways: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
        ("inline", inline),
        ("thread", thread),
        ("cb", cb),
        ("waiter", waiter),
    ]
    print(
        f"digits, {args.rows} rows an execution, {args.trips} executions per figure; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    print("way      loop us  proc us  wall us  invol/exec  vol/exec")
    for _ in range(args.repeat):
        for name, way in ways:
            for _ in range(args.trips // 10):
                await way()
            before = resource.getrusage(resource.RUSAGE_THREAD)
            loop0, proc0, wall0 = time.thread_time(), time.process_time(), time.perf_counter()
            for _ in range(args.trips):
                await way()
            loop1, proc1, wall1 = time.thread_time(), time.process_time(), time.perf_counter()
            after = resource.getrusage(resource.RUSAGE_THREAD)
            n = args.trips
            invol = (after.ru_nivcsw - before.ru_nivcsw) / n
            vol = (after.ru_nvcsw - before.ru_nvcsw) / n
            print(
                f"{name:7s} {(loop1 - loop0) / n * 1e6:8.1f} {(proc1 - proc0) / n * 1e6:8.1f} "
                f"{(wall1 - wall0) / n * 1e6:8.1f} {invol:11.2f} {vol:9.2f}"
            )
    await worker.aclose()
    callbacks.close()


async def overlap(args: argparse.Namespace) -> None:
    one = session(1)
    outputs = [spec.name for spec in one.get_outputs()]
    feed = {one.get_inputs()[0].name: np.random.rand(args.rows, 64).astype(np.float32)}
    placements: list[tuple[str, tuple[int, ...] | None, tuple[int, ...] | None]] = [
        ("free", None, None),
        ("one core", (0,), (0,)),
        ("two cores", (0,), (1,)),
    ]
    print(
        f"digits, {args.rows} rows, loop busy {args.busy_us:.0f} us after each submit, "
        f"{args.trips // 5} batches per figure; load average {os.getloadavg()[0]:.2f}"
    )
    print("placement   worker starts (us)  after the busy stretch  result back (us)")
    everywhere = os.sched_getaffinity(0)
    busy = args.busy_us / 1e6
    for _ in range(args.repeat):
        for name, loop_cpus, worker_cpus in placements:
            os.sched_setaffinity(0, loop_cpus or everywhere)
            worker = await WorkerThread.start("bench-hop", cpu_affinity=worker_cpus)
            starts: list[float] = []

            def run(starts: list[float] = starts) -> Any:
                starts.append(time.perf_counter())
                return one.run(outputs, feed)

            started, back, late = [], [], 0
            for _ in range(args.trips // 5):
                marks: dict[str, float] = {}

                async def submit(
                    marks: dict[str, float] = marks, worker: WorkerThread = worker
                ) -> None:
                    marks["put"] = time.perf_counter()
                    await worker.run_sync(run)
                    marks["back"] = time.perf_counter()

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(submit)
                    while "put" not in marks:  # the submit has run up to its wait
                        await trio.lowlevel.checkpoint()
                    t0 = time.perf_counter()
                    while time.perf_counter() - t0 < busy:
                        pass
                    busy_end = time.perf_counter()
                started.append(starts[-1] - marks["put"])
                back.append(marks["back"] - marks["put"])
                late += starts[-1] >= busy_end
            await worker.aclose()
            print(
                f"{name:10s} {statistics.median(started) * 1e6:19.0f} "
                f"{late / len(started) * 100:22.0f}% {statistics.median(back) * 1e6:17.0f}"
            )
    os.sched_setaffinity(0, everywhere)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32, help="rows per execution")
    parser.add_argument("--trips", type=int, default=2000, help="executions per figure")
    parser.add_argument("--repeat", type=int, default=3, help="alternating rounds")
    parser.add_argument("--overlap", action="store_true", help="the overlap test (see above)")
    parser.add_argument("--busy-us", type=float, default=200.0, help="--overlap: loop busy time")
    parsed = parser.parse_args()
    trio.run(overlap if parsed.overlap else main, parsed)
