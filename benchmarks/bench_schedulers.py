#!/usr/bin/env python
"""What the scheduler plugins cost, and what fair sharing buys a small tenant.

(c) Cost: for each scheduler, the time of one push plus one pop (and of one push
    plus one remove, a cancelled caller) with 100 and with 100,000 requests
    already queued, and the ratio between the two (the issue's target: <= 2x);
    then the memory one queued request takes with 100,000 queued, measured
    with tracemalloc: the scheduler's own bookkeeping, and that plus the request
    itself (a frozen Request carrying a float32[1, 64] input, like a digits
    request). Target: <= 4 KB.

(d) Fairness: a real engine (FakeBackend, one instance, no batching, a fixed
    execution time) on Trio's MockClock, so that the run is exact and repeatable
    and takes a second of real time. Tenant A sends 10x tenant B's rate, with
    Poisson arrivals; B's latency percentiles under ``fifo`` and ``fair``, at a
    load just under the instance's capacity and just over it.

Usage:  .venv/bin/python benchmarks/bench_schedulers.py [--part c|d|cd] [--repeat 5]
        .venv/bin/python benchmarks/bench_schedulers.py --part d --duration 120 --real-time
"""

from __future__ import annotations

import argparse
import gc
import math
import platform
import random
import sys
import time
import tracemalloc
from collections.abc import Callable, Sequence
from importlib.metadata import version
from typing import Any

import numpy as np
import trio
import trio.testing

import trioinfer
from trioinfer.abc import Scheduler
from trioinfer.lowlevel import Request
from trioinfer.testing import FakeBackend, make_request
from trioinfer_scheduling import DeadlineScheduler, FairScheduler, FifoScheduler, PriorityScheduler

SMALL, LARGE = 100, 100_000


class Context:
    """Stands in for the engine's SchedulerContext: a real clock, a set execution estimate."""

    model = "bench"
    instances = 1

    def __init__(self, estimate: float) -> None:
        self.estimate = estimate

    def current_time(self) -> float:
        return time.monotonic()

    def execution_estimate(self) -> float:
        return self.estimate


def attached(scheduler: Any, estimate: float = 1e-9) -> Scheduler:
    scheduler.attach(Context(estimate))
    return scheduler  # type: ignore[no-any-return]


# name: (make a scheduler for a queue of n, deadlines of the backlog, of the new requests)
SCHEDULERS: dict[str, tuple[Callable[[int], Scheduler], str, str]] = {
    "fifo": (lambda n: FifoScheduler(), "budgets", "budgets"),
    "priority": (lambda n: attached(PriorityScheduler(max_wait=1.0)), "budgets", "budgets"),
    "priority (strict)": (lambda n: PriorityScheduler(max_wait=None), "budgets", "budgets"),
    "deadline": (lambda n: DeadlineScheduler(), "budgets", "budgets"),
    "deadline, random": (lambda n: DeadlineScheduler(), "random", "random"),
    # A tiny estimate: the cheap upper bound admits at once, as in a healthy system.
    "deadline (refuse_late)": (
        lambda n: attached(DeadlineScheduler(refuse_late=True)),
        "budgets",
        "budgets",
    ),
    # The queue is long enough that only an exact count of those ahead admits each
    # new (urgent) request: the O(log n) rank on every push.
    "deadline (refuse_late, counted)": (
        lambda n: attached(DeadlineScheduler(refuse_late=True), estimate=URGENT / n),
        "budgets",
        "urgent",
    ),
    "fair": (lambda n: FairScheduler(weights={"t0": 4.0, "t1": 2.0}), "budgets", "budgets"),
}
BUDGETS = (0.1, 0.5, 2.0, 10.0)
URGENT = 1000.0


def make_requests(n: int, seed: int, deadlines: str, start: float) -> list[Request]:
    """Requests like the engine's: 4 priority levels, 16 tenants, 7 in 8 with a deadline.

    They arrive 10 us apart from *start*. With ``deadlines="budgets"`` a deadline
    is the arrival plus one of a few budgets, as callers' ``fail_after`` scopes
    give; with ``"random"`` it is anywhere in the next 1000 s (the worst case
    for the deadline scheduler: every insertion lands somewhere new).
    """
    rng = random.Random(seed)
    x = np.zeros((1, 64), dtype=np.float32)
    out = []
    for i in range(n):
        arrival = start + i * 1e-5
        if not i % 8:
            deadline = math.inf
        elif deadlines == "budgets":
            deadline = arrival + 1e6 + rng.choice(BUDGETS)
        elif deadlines == "urgent":
            deadline = arrival + URGENT  # before any of the backlog's
        else:
            deadline = arrival + 1e6 + rng.random() * 1e3
        out.append(
            make_request(
                model="bench",
                inputs={"input": x.copy()},
                priority=rng.randrange(4),
                tenant=f"t{rng.randrange(16)}",
                deadline=deadline,
                arrival=arrival,
                rows=1,
            )
        )
    return out


# -- (c) cost ------------------------------------------------------------------------


def time_ops(
    factory: Callable[[int], Scheduler],
    deadlines: tuple[str, str],
    ops: int,
    repeat: int,
) -> dict[int, tuple[float, float]]:
    """Best ns per push+pop and per push+remove, with SMALL and with LARGE requests waiting.

    The two queue lengths alternate within each of the *repeat* rounds, so that
    a burst of other load on the machine hits both sides of the ratio alike
    rather than only one.
    """
    now = time.monotonic()
    fresh = make_requests(ops, 2, deadlines[1], now)
    # Others for the removals: pop() need not take the request just pushed, so some of
    # *fresh* are still queued, and each request is pushed once (a second push is refused).
    fresh_removed = make_requests(ops, 3, deadlines[1], now)
    backlogs = {n: make_requests(n, 1, deadlines[0], now - n * 1e-5) for n in (SMALL, LARGE)}
    pop_ns: dict[int, list[float]] = {n: [] for n in backlogs}
    remove_ns: dict[int, list[float]] = {n: [] for n in backlogs}
    for _ in range(repeat):
        for queued, backlog in backlogs.items():
            scheduler = factory(queued)
            for request in backlog:
                scheduler.push(request)
            push, pop, remove = scheduler.push, scheduler.pop, scheduler.remove
            gc.collect()
            gc.disable()
            try:
                start = time.perf_counter_ns()
                for request in fresh:
                    push(request)
                    pop()
                pop_ns[queued].append((time.perf_counter_ns() - start) / ops)
                # Cancellation: push, then remove that same request again (not at the head).
                start = time.perf_counter_ns()
                for request in fresh_removed:
                    push(request)
                    remove(request)
                remove_ns[queued].append((time.perf_counter_ns() - start) / ops)
            finally:
                gc.enable()
    return {n: (min(pop_ns[n]), min(remove_ns[n])) for n in backlogs}


def memory_per_request(
    factory: Callable[[int], Scheduler], deadlines: str, n: int
) -> tuple[float, float]:
    """Bytes per queued request: the scheduler's bookkeeping, and that plus the request."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        requests = make_requests(n, 3, deadlines, time.monotonic())
        with_requests = tracemalloc.get_traced_memory()[0]
        scheduler = factory(n)
        for request in requests:
            scheduler.push(request)
        gc.collect()
        full = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    del scheduler, requests
    return (full - with_requests) / n, (full - base) / n


def part_c(args: argparse.Namespace) -> None:
    print("(c) scheduler cost: push+pop and push+remove per request, memory per queued request")
    print(f"    best of {args.repeat} runs of {args.ops:,} operations each; ns = nanoseconds")
    print()
    header = (
        f"{'scheduler':<32}{'push+pop ns':>13}{'':>10}{'ratio':>7}"
        f"{'push+remove ns':>17}{'':>10}{'ratio':>7}{'sched B/req':>13}{'total B/req':>13}"
    )
    print(
        f"{'':<32}{f'@{SMALL:,}':>13}{f'@{LARGE:,}':>10}{'':>7}{f'@{SMALL:,}':>17}{f'@{LARGE:,}':>10}"
    )
    print(header)
    print("-" * len(header))
    worst = 0.0
    worst_memory = 0.0
    for name, (factory, *deadlines) in SCHEDULERS.items():
        times = time_ops(factory, (deadlines[0], deadlines[1]), args.ops, args.repeat)
        small, large = times[SMALL], times[LARGE]
        own, total = memory_per_request(factory, deadlines[0], LARGE)
        ratios = (large[0] / small[0], large[1] / small[1])
        worst = max(worst, *ratios)
        worst_memory = max(worst_memory, total)
        print(
            f"{name:<32}{small[0]:>13,.0f}{large[0]:>10,.0f}{ratios[0]:>7.2f}"
            f"{small[1]:>17,.0f}{large[1]:>10,.0f}{ratios[1]:>7.2f}{own:>13,.0f}{total:>13,.0f}"
        )
    print()
    print(
        f"worst ratio 100,000 / 100 queued: {worst:.2f} (target <= 2: "
        f"{'met' if worst <= 2 else 'NOT met'}); worst memory per queued request: "
        f"{worst_memory:,.0f} B (target <= 4096: {'met' if worst_memory <= 4096 else 'NOT met'})"
    )
    print()


# -- (d) fairness --------------------------------------------------------------------


async def fairness_run(
    scheduler: str, load: float, args: argparse.Namespace
) -> dict[str, list[float]]:
    execution = args.execution_ms / 1e3
    capacity = 1 / execution  # requests per second, one instance, one request per execution
    rate_b = load * capacity / 11  # A sends 10x B's rate: together, `load` of capacity
    rates = {"A": 10 * rate_b, "B": rate_b}
    backend = FakeBackend(delay=execution)
    latencies: dict[str, list[float]] = {"A": [], "B": []}
    x = np.ones((1, 4), dtype=np.float32)
    config = trioinfer.ModelConfig(
        name="m",
        path="unused.onnx",
        backend="fake",
        scheduler=scheduler,
        max_queue_size=1_000_000,
    )
    async with trioinfer.open_engine(registry=backend.registry()) as engine:
        await engine.load(config)

        async def one(tenant: str) -> None:
            start = trio.current_time()
            await engine.infer("m", {"x": x}, tenant=tenant)
            if start >= warmup_end:
                latencies[tenant].append(trio.current_time() - start)

        async def sender(tenant: str, seed: int) -> None:
            rng = random.Random(seed)
            async with trio.open_nursery() as nursery:
                while trio.current_time() < end:
                    await trio.sleep(rng.expovariate(rates[tenant]))
                    nursery.start_soon(one, tenant)

        warmup_end = trio.current_time() + args.warmup
        end = warmup_end + args.duration
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender, "A", 1)
            nursery.start_soon(sender, "B", 2)
    return latencies


def percentile_ms(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3 if values else math.nan


def part_d(args: argparse.Namespace) -> None:
    clock = "real time" if args.real_time else "MockClock (virtual time)"
    print(
        f"(d) fairness: one instance, {args.execution_ms:g} ms per execution (FakeBackend), no "
        f"batching, {clock};"
    )
    print(
        f"    tenant A sends 10x tenant B's rate (Poisson); {args.duration:g} s measured after "
        f"{args.warmup:g} s of warm-up; latencies in ms"
    )
    print()
    header = (
        f"{'load':>6}{'scheduler':>10}{'A req/s':>9}{'B req/s':>9}"
        f"{'B p50':>9}{'B p99':>9}{'B max':>9}{'A p50':>9}{'A p99':>9}"
    )
    print(header)
    print("-" * len(header))
    for load in args.loads:
        p99 = {}
        for scheduler in ("fifo", "fair"):
            run = lambda s=scheduler, lo=load: fairness_run(s, lo, args)  # noqa: E731
            if args.real_time:
                latencies = trio.run(run)
            else:
                latencies = trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))
            a, b = latencies["A"], latencies["B"]
            p99[scheduler] = percentile_ms(b, 99)
            print(
                f"{load:>6.0%}{scheduler:>10}{len(a) / args.duration:>9.1f}"
                f"{len(b) / args.duration:>9.1f}{percentile_ms(b, 50):>9.1f}"
                f"{p99[scheduler]:>9.1f}{max(b) * 1e3:>9.1f}{percentile_ms(a, 50):>9.1f}"
                f"{percentile_ms(a, 99):>9.1f}"
            )
        print(f"{'':>6}B's p99, fifo / fair: {p99['fifo'] / p99['fair']:.1f}x")
    print()
    print(
        "Req/s count requests that arrived in the window and completed; over capacity, "
        "fifo's queue (and every latency) grows for as long as the run lasts."
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--part", default="cd", help="c (cost), d (fairness) or cd")
    parser.add_argument("--repeat", type=int, default=5, help="(c) runs per measurement")
    parser.add_argument("--ops", type=int, default=20_000, help="(c) operations per run")
    parser.add_argument("--duration", type=float, default=300.0, help="(d) seconds measured")
    parser.add_argument("--warmup", type=float, default=10.0, help="(d) seconds before measuring")
    parser.add_argument("--execution-ms", type=float, default=10.0, help="(d) per execution")
    parser.add_argument(
        "--loads",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[0.9, 1.1],
        help="(d) offered load as a fraction of capacity, comma-separated",
    )
    parser.add_argument("--real-time", action="store_true", help="(d) run on the real clock")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    print(
        f"Python {platform.python_version()}, trio {version('trio')}, "
        f"numpy {np.__version__}, "
        f"{platform.machine()}"
    )
    print()
    if "c" in args.part:
        part_c(args)
    if "d" in args.part:
        part_d(args)


if __name__ == "__main__":
    main(sys.argv[1:])
