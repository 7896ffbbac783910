#!/usr/bin/env python
"""Requested outputs on ONNX Runtime: a request for every output against one for the cheap one.

The model is `trioinfer.testing.models.write_two_branches`: ``cheap = x + x``
(one node) and ``costly = x @ W^depth`` (``--depth`` chained ``MatMul`` nodes,
``--width`` wide). Arms, side by side in one process, alternating for
``--rounds`` rounds, each with C client tasks sending one request after another:

  session-all    ``session.run(["cheap", "costly"], ...)`` in a tight loop: the ceiling
  session-cheap  ``session.run(["cheap"], ...)``: what ONNX Runtime saves by itself
  all            ``engine.infer`` with no ``outputs``: every output computed
  cheap          ``engine.infer(outputs=["cheap"])``: the instance runs the session
                 for ``cheap`` alone

ONNX Runtime's inference builds run every node whatever the outputs fetched
(onnxruntime#16483; ``RunOptions.only_execute_path_to_fetches`` works in training
builds only), so ``session-cheap`` and ``cheap`` are expected no faster than their
``all`` arms: the benchmark says whether a build at hand prunes.

Usage:  .venv/bin/python benchmarks/bench_outputs.py [--depth 20] [--width 256]
            [--rows 1] [--concurrency 1] [--dispatch auto] [--duration 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime
import trio

import trioinfer
from trioinfer.testing import models

ARMS = ("session-all", "session-cheap", "all", "cheap")


async def measure(call: Callable[[], Awaitable[object]], clients: int, args: Any) -> float:
    """Requests per second of *clients* tasks awaiting *call* in turn, after a warm-up."""
    done = 0
    counting = False

    async def client() -> None:
        nonlocal done
        while True:
            await call()
            if counting:
                done += 1

    async with trio.open_nursery() as nursery:
        for _ in range(clients):
            nursery.start_soon(client)
        await trio.sleep(args.warmup)
        counting = True
        started = time.perf_counter()
        await trio.sleep(args.duration)
        counting = False
        elapsed = time.perf_counter() - started
        nursery.cancel_scope.cancel()
    return done / elapsed


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = models.write_two_branches(Path(tmp) / "two.onnx", width=args.width, depth=args.depth)
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = 1
        session = onnxruntime.InferenceSession(
            str(path), options, providers=["CPUExecutionProvider"]
        )
        x = np.random.default_rng(0).standard_normal((args.rows, args.width)).astype(np.float32)
        inputs = {"x": x}
        async with trioinfer.open_engine() as engine:
            await engine.load(
                trioinfer.ModelConfig(
                    name="two",
                    path=path,
                    instances=[trioinfer.Instance(threads=1)],
                    backend_options={"dispatch": args.dispatch},
                )
            )

            async def session_all() -> None:
                session.run(["cheap", "costly"], inputs)
                await trio.lowlevel.checkpoint()

            async def session_cheap() -> None:
                session.run(["cheap"], inputs)
                await trio.lowlevel.checkpoint()

            async def infer_all() -> None:
                await engine.infer("two", inputs)

            async def infer_cheap() -> None:
                await engine.infer("two", inputs, outputs=["cheap"])

            calls = dict(
                zip(ARMS, (session_all, session_cheap, infer_all, infer_cheap), strict=True)
            )
            rates: dict[str, list[float]] = {arm: [] for arm in ARMS}
            for _ in range(args.rounds):
                for arm in ARMS:
                    clients = 1 if arm.startswith("session") else args.concurrency
                    rates[arm].append(await measure(calls[arm], clients, args))
    print(
        f"two branches: width {args.width}, costly depth {args.depth}, rows {args.rows}, "
        f"dispatch {args.dispatch}, C={args.concurrency}, {args.rounds} rounds of "
        f"{args.duration:g} s (median, then each round)"
    )
    print(f"{'arm':<14} {'req/s':>9}  rounds")
    for arm in ARMS:
        each = "  ".join(f"{rate:9.0f}" for rate in rates[arm])
        print(f"{arm:<14} {statistics.median(rates[arm]):9.0f}  {each}")
    all_, cheap = statistics.median(rates["all"]), statistics.median(rates["cheap"])
    print(
        f"engine: cheap alone {cheap:.0f} req/s against all outputs {all_:.0f} "
        f"({cheap / all_:.1f}x)"
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--width", type=int, default=256, help="the model's second dimension")
    parser.add_argument("--depth", type=int, default=20, help="MatMul nodes of the costly branch")
    parser.add_argument("--rows", type=int, default=1, help="rows per request")
    parser.add_argument("--concurrency", type=int, default=1, help="engine client tasks")
    parser.add_argument(
        "--dispatch", default="auto", choices=("auto", "thread", "inline", "ort_async")
    )
    parser.add_argument("--duration", type=float, default=2.0, help="seconds measured per arm")
    parser.add_argument("--warmup", type=float, default=0.3, help="seconds of warm-up per arm")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of every arm")
    return parser.parse_args(argv)


if __name__ == "__main__":
    trio.run(main, parse_args())
