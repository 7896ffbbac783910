#!/usr/bin/env python
"""What one execution's hop off the event loop costs the loop's thread, by way of dispatch.

Times, side by side in one Trio run and alternating, back-to-back executions of
one batch of the bundled ``digits`` MLP, awaited from the event loop:

  inline   ``session.run`` on the loop's own thread (threads=1): the loop pays the compute
  thread   ``WorkerThread.run_sync(session.run, ...)``, as ``dispatch = "thread"`` does
           (threads=1; the result wakes the loop through the worker's own socket)
  cb       ``session.run_async`` awaited through ``wait_on_callback``, as
           ``dispatch = "ort_async"`` does (threads=2, no spinning; the callback
           wakes the loop through ``TrioToken.run_sync_soon``)
  sock     ``session.run_async`` whose callback writes a byte to a socket pair the
           loop waits on (the worker's wake-up, applied to ``ort_async``: a prototype)

For each: the loop thread's CPU (``time.thread_time``), the process's CPU and the
wall time per execution, and the loop thread's involuntary and voluntary context
switches per execution (``getrusage(RUSAGE_THREAD)``, Linux). Per request at
dynamic batching's batch of 32, divide by 32.

Usage:  .venv/bin/python benchmarks/bench_hop.py [--rows 32] [--trips 2000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import trio

from trioinfer.lowlevel import WorkerThread, wait_on_callback

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
    receiver, sender = socket.socketpair()
    receiver.setblocking(False)
    sender.setblocking(False)

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

    async def sock() -> Any:
        box: list[Any] = []

        def done(values: Any, _user: object, error: str) -> None:
            box.append(values)
            with contextlib.suppress(OSError):
                sender.send(b"\0")

        two.run_async(outputs, feed, done, None, ort.RunOptions())
        while not box:
            await trio.lowlevel.wait_readable(receiver)
            with contextlib.suppress(BlockingIOError):
                receiver.recv(4096)
        await trio.lowlevel.cancel_shielded_checkpoint()
        return box[0]

    ways: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
        ("inline", inline),
        ("thread", thread),
        ("cb", cb),
        ("sock", sock),
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
    receiver.close()
    sender.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32, help="rows per execution")
    parser.add_argument("--trips", type=int, default=2000, help="executions per figure")
    parser.add_argument("--repeat", type=int, default=3, help="alternating rounds")
    trio.run(main, parser.parse_args())
