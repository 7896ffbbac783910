#!/usr/bin/env python
"""A model's queue in the engine with 100 and with 100,000 requests waiting, side by side.

``bench_schedulers.py --part c`` times each scheduler alone. This script times
the engine's whole queue around it, per request, with N requests queued
(N = 100 and 100,000, alternating, best of ``--repeat`` rounds):

  admit   N caller tasks call ``engine.infer`` while the model's one instance is
          busy: validation, the request, admission, the scheduler's push, the
          caller going to sleep. Event-loop CPU per request.
  drain   the instance comes free and runs every queued request (batcher
          ``none``: one pop per execution; a FakeBackend whose executions take
          virtual time, passed by Trio's MockClock autojump), each caller woken
          with its outputs. Event-loop CPU per request, the clock's jumps included.
  cancel  as admit, then every caller is cancelled while queued: the
          scheduler's remove. CPU per request.
  memory  what one queued request holds with 100,000 queued (tracemalloc, after
          admission, in its own round): in all, and the engine's part, which is
          that less what a bare caller task holding its input under the same
          ``fail_after`` scope costs (the caller's task and coroutine frames are
          the application's). Target for the engine's part: at most 4 KB.

Each scheduler is the first-party one (``fifo``, ``priority``, ``deadline``,
``fair``), requests as in ``bench_schedulers.py``: 4 priority levels, 16
tenants, 7 in 8 with a deadline (a ``fail_after`` scope) a few budgets ahead.
The instance is held busy with Trio's MockClock: the FakeBackend's executions
take virtual time, which only passes when the script says so.

Usage:  .venv/bin/python benchmarks/bench_queue.py [--repeat 3] [--schedulers fifo,deadline]
"""

from __future__ import annotations

import argparse
import gc
import math
import platform
import time
import tracemalloc
from collections.abc import Sequence

import numpy as np
import trio
import trio.lowlevel
import trio.testing

import trioinfer
from trioinfer.testing import FakeBackend

SMALL, LARGE = 100, 100_000
SCHEDULERS = ("fifo", "priority", "deadline", "fair")
BUDGETS = (1e6, 2e6, 5e6, 1e7)  # seconds of virtual time: never reached


async def one_round(scheduler: str, n: int, part: str) -> float:
    """Return the loop's CPU seconds per request for *part* (bytes per request for "memory").

    *scheduler* ``"bare"`` (memory only) stands for callers without an engine:
    tasks that hold their input and sleep, under the same ``fail_after`` scopes.
    """
    backend = FakeBackend(delay=1.0)
    clock = trio.lowlevel.current_clock()
    assert isinstance(clock, trio.testing.MockClock)
    x = np.ones((1, 4), np.float32)
    done = 0
    all_done = trio.Event()

    async def caller(k: int) -> None:
        nonlocal done
        deadline = BUDGETS[k % 4] if k % 8 else None
        with trio.fail_after(deadline if deadline is not None else math.inf):
            if scheduler == "bare":
                await _bare({"x": x})
            else:
                await engine.infer("q", {"x": x}, priority=k % 4, tenant=f"t{k % 16}")
        done += 1
        if done == n + 1:
            all_done.set()

    async with trioinfer.open_engine(registry=backend.registry()) as engine:
        if scheduler != "bare":
            config = trioinfer.ModelConfig(
                name="q",
                path="unused.onnx",
                backend="fake",
                scheduler=scheduler,
                max_queue_size=n + 16,
            )
            await engine.load(config)
        async with trio.open_nursery() as callers:
            callers.start_soon(caller, 8)  # no deadline: holds the instance for 1 s
            await trio.testing.wait_all_tasks_blocked()
            gc.collect()
            gc.disable()
            if part == "memory":
                tracemalloc.start()
            before = tracemalloc.get_traced_memory()[0]
            t0 = time.thread_time()
            for k in range(n):
                callers.start_soon(caller, k)
            await trio.testing.wait_all_tasks_blocked()
            admit_s = time.thread_time() - t0
            held = tracemalloc.get_traced_memory()[0] - before
            tracemalloc.stop()
            t0 = time.thread_time()
            if part in ("cancel", "memory"):
                callers.cancel_scope.cancel()
            else:
                assert engine.statistics().models["q"].queued == n
                clock.autojump_threshold = 0  # virtual time runs: every execution ends at once
                await all_done.wait()
        cpu = time.thread_time() - t0
        gc.enable()
    return {"admit": admit_s, "drain": cpu, "cancel": cpu, "memory": held}[part] / n


async def _bare(inputs: object) -> None:
    await trio.sleep_forever()


def measure(scheduler: str, part: str, repeat: int) -> dict[int, float]:
    best: dict[int, float] = {}
    for _ in range(repeat):
        for n in (SMALL, LARGE):
            value = trio.run(one_round, scheduler, n, part, clock=trio.testing.MockClock())
            best[n] = min(value, best.get(n, value))
    return best


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeat", type=int, default=3, help="rounds; the best counts")
    parser.add_argument("--schedulers", default=",".join(SCHEDULERS))
    parser.add_argument("--parts", default="admit,drain,cancel")
    args = parser.parse_args(argv)
    print(
        f"Python {platform.python_version()}, trio {trio.__version__}, numpy {np.__version__}, "
        f"trioinfer {trioinfer.__version__}; best of {args.repeat} rounds; "
        "us = event-loop CPU microseconds per request"
    )
    rows: list[tuple[str, str, float, float, float]] = []
    print(f"{'scheduler':<10} {'part':<7} {'@100 us':>9} {'@100,000 us':>12} {'ratio':>6}")
    schedulers = args.schedulers.split(",")
    for scheduler in schedulers:
        for part in args.parts.split(","):
            best = measure(scheduler, part, args.repeat)
            small, large = best[SMALL] * 1e6, best[LARGE] * 1e6
            rows.append((scheduler, part, small, large, large / small))
            print(f"{scheduler:<10} {part:<7} {small:9.2f} {large:12.2f} {large / small:6.2f}")
    bare = trio.run(one_round, "bare", LARGE, "memory", clock=trio.testing.MockClock())
    print(
        "\nbytes held per queued request with 100,000 queued: in all (the caller's task, its "
        "scope and input, and the engine's), and the engine's part (in all less a bare caller "
        f"task that holds its input and sleeps under the same scopes: {bare:,.0f} B)"
    )
    memory = {}
    for scheduler in schedulers:
        held = trio.run(one_round, scheduler, LARGE, "memory", clock=trio.testing.MockClock())
        memory[scheduler] = held - bare
        print(f"  {scheduler:<10} {held:8,.0f} in all, {held - bare:8,.0f} the engine's")
    worst = max(rows, key=lambda r: r[4])
    verdict = "met" if worst[4] <= 2 else "NOT met"
    most = max(memory.values())
    print(
        f"\nworst ratio 100,000 / 100 queued: {worst[4]:.2f} ({worst[0]}, {worst[1]}; target <= 2:"
        f" {verdict}); most engine memory per queued request: {most:,.0f} B (target <= 4096: "
        f"{'met' if most <= 4096 else 'NOT met'})"
    )


if __name__ == "__main__":
    main()
