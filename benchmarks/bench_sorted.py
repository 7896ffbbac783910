#!/usr/bin/env python
"""The schedulers' hand-written sorted collections against ``sortedcontainers.SortedList``.

``trioinfer_scheduling._sorted`` holds two sorted collections: `SortedKeys`
(the priority scheduler's levels and level heads) and `TimeQueue` (the
deadline scheduler's requests by deadline, then by `Request.sequence`).
``sortedcontainers`` (which trio already installs) offers the same thing in
``SortedList``. This script runs both, side by side in one process, on the
operations the schedulers use, and prints the ratio ``sortedcontainers / ours``
(above 1: ours is faster):

(1) The collections alone, with 100 and 100,000 entries held: one add plus
    one pop of the first entry, and one add plus one remove of that same entry
    (a caller that gave up). Keys are (float, int) tuples for `SortedKeys`, as
    the priority scheduler's heads are; deadlines for `TimeQueue`, either from
    a few fixed budgets after arrival (as callers' ``fail_after`` scopes give)
    or anywhere in the next 1,000 s (every add lands somewhere new).

(2) The priority and deadline schedulers themselves, with 100 and 100,000
    requests queued (``bench_schedulers.py``'s requests and timing), once as
    they are and once with their collection swapped for the ``SortedList``
    adapter below.

The adapters subclass ``SortedList`` and add only the few methods whose names
differ; a priority scheduler that indexes a ``SortedList`` itself, instead of
calling ``first()``, measured the same.

Usage:  .venv/bin/python benchmarks/bench_sorted.py [--repeat 5] [--ops 20000]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import platform
import random
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from importlib.metadata import version
from typing import Any

import sortedcontainers
from bench_schedulers import LARGE, SCHEDULERS, SMALL, make_requests, memory_per_request
from sortedcontainers import SortedList

import trioinfer_scheduling._deadline
import trioinfer_scheduling._priority
from trioinfer_scheduling._sorted import SortedKeys, TimeQueue


class ListKeys(SortedList):
    """`SortedKeys`'s interface over ``SortedList``: add and remove are SortedList's own."""

    def first(self) -> Any:
        return self[0]

    def last(self) -> Any:
        return self[-1]

    def second(self) -> Any:
        return self[1]

    def pop_first(self) -> Any:
        return self.pop(0)


class ListQueue(SortedList):
    """`TimeQueue`'s interface over ``SortedList`` of ``(key, ticket, item)`` tuples.

    Tickets are unique, so two tuples never compare their items.
    """

    def __init__(self, ticket: Callable[[Any], int]) -> None:
        super().__init__()
        self._ticket = ticket

    def add(self, key: float, item: Any) -> None:
        SortedList.add(self, (key, self._ticket(item), item))

    def remove(self, key: float, item: Any) -> bool:
        held = len(self)
        self.discard((key, self._ticket(item), item))
        return len(self) != held

    def first(self) -> Any:
        return self[0][2]

    def pop_first(self) -> Any:
        return self.pop(0)[2]

    def count_until(self, key: float) -> int:
        # (key, inf) sorts after every (key, ticket, item): those with this key count.
        return self.bisect_right((key, math.inf))


class Item:
    """A queued thing with a ticket, like a request with its sequence."""

    __slots__ = ("ticket",)

    def __init__(self, ticket: int) -> None:
        self.ticket = ticket


def ticket(item: Item) -> int:
    return item.ticket


# -- (1) the collections alone -------------------------------------------------------


def keys_for(n: int, seed: int) -> list[tuple[tuple[float, int]]]:
    """Arguments for n adds to `SortedKeys`: unique (arrival, -level)-like keys."""
    rng = random.Random(seed)
    return [((rng.random(), -rng.randrange(1 << 30)),) for _ in range(n)]


def deadlines_for(n: int, seed: int, kind: str, start: float) -> list[tuple[float, Item]]:
    """Arguments for n adds to `TimeQueue`: a deadline and an item with a unique ticket."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        arrival = start + i * 1e-5
        if kind == "budgets":
            deadline = arrival + rng.choice((0.1, 0.5, 2.0, 10.0))
        else:
            deadline = arrival + rng.random() * 1e3
        out.append((deadline, Item(seed * 10_000_000 + i)))
    return out


Times = dict[str, dict[int, tuple[float, float]]]


def time_side_by_side(
    makers: dict[str, Callable[[int], Any]],
    methods: Callable[[Any], tuple[Callable[..., Any], Callable[[], Any], Callable[..., Any]]],
    fresh: list[tuple[Any, ...]],
    backlogs: dict[int, list[tuple[Any, ...]]],
    repeat: int,
) -> Times:
    """Best ns per add+pop and per add+remove, by maker, with SMALL and LARGE entries held.

    *makers* build an empty collection (or scheduler) for a given backlog size;
    *methods* picks its add, pop-first and remove. *backlogs* are the argument
    tuples for the adds that fill it, by size; then each of *fresh* is added
    and the first entry popped, and each of *fresh* is added and removed
    again. Every maker at both sizes runs once in each of the *repeat*
    rounds, so that a burst of other load on the machine hits both sides of a
    ratio alike rather than only one.
    """
    ops = len(fresh)
    pop_ns: dict[tuple[str, int], list[float]] = {(m, n): [] for m in makers for n in backlogs}
    remove_ns: dict[tuple[str, int], list[float]] = {key: [] for key in pop_ns}
    for _ in range(repeat):
        for held, backlog in backlogs.items():
            for name, make in makers.items():
                collection = make(held)
                add, pop, remove = methods(collection)
                for entry in backlog:
                    add(*entry)
                gc.collect()
                gc.disable()
                try:
                    start = time.perf_counter_ns()
                    for entry in fresh:
                        add(*entry)
                        pop()
                    pop_ns[name, held].append((time.perf_counter_ns() - start) / ops)
                    # Cancellation: add, then remove that same entry again (not at the head).
                    start = time.perf_counter_ns()
                    for entry in fresh:
                        add(*entry)
                        remove(*entry)
                    remove_ns[name, held].append((time.perf_counter_ns() - start) / ops)
                finally:
                    gc.enable()
                del collection, add, pop, remove
    return {
        name: {n: (min(pop_ns[name, n]), min(remove_ns[name, n])) for n in backlogs}
        for name in makers
    }


def collection_methods(collection: Any) -> tuple[Any, Any, Any]:
    return collection.add, collection.pop_first, collection.remove


def scheduler_methods(scheduler: Any) -> tuple[Any, Any, Any]:
    return scheduler.push, scheduler.pop, scheduler.remove


def queue_bytes(make: Callable[[int], Any], n: int) -> float:
    """Bytes per queued item: the collection's own, not the items'."""
    entries = deadlines_for(n, 3, "budgets", 0.0)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        queue = make(n)
        for key, item in entries:
            queue.add(key, item)
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    del queue
    return used / n


# -- (2) the schedulers with either collection ---------------------------------------


@contextlib.contextmanager
def on_sortedcontainers() -> Iterator[None]:
    """Build priority and deadline schedulers on the ``SortedList`` adapters meanwhile."""
    priority, deadline = trioinfer_scheduling._priority, trioinfer_scheduling._deadline
    saved = priority.SortedKeys, deadline.TimeQueue
    priority.SortedKeys, deadline.TimeQueue = ListKeys, ListQueue
    try:
        yield
    finally:
        priority.SortedKeys, deadline.TimeQueue = saved


def swapped(factory: Callable[[int], Any]) -> Callable[[int], Any]:
    def make(n: int) -> Any:
        with on_sortedcontainers():
            return factory(n)

    return make


# -- report --------------------------------------------------------------------------

HEADER = (
    f"{'':<34}{'add+pop ns':>12}{'':>9}{'':>7}{'add+remove ns':>15}{'':>9}{'':>7}{'B/entry':>9}\n"
    f"{'':<34}{f'@{SMALL:,}':>12}{f'@{LARGE:,}':>9}{'ratio':>7}"
    f"{f'@{SMALL:,}':>15}{f'@{LARGE:,}':>9}{'ratio':>7}{f'@{LARGE:,}':>9}"
)


def row(name: str, times: dict[int, tuple[float, float]], memory: float | None) -> str:
    small, large = times[SMALL], times[LARGE]
    bytes_ = "" if memory is None else f"{memory:,.0f}"
    return (
        f"{name:<34}{small[0]:>12,.0f}{large[0]:>9,.0f}{large[0] / small[0]:>7.2f}"
        f"{small[1]:>15,.0f}{large[1]:>9,.0f}{large[1] / small[1]:>7.2f}{bytes_:>9}"
    )


def versus(times: Times) -> str:
    ours, theirs = times["ours"], times["sortedcontainers"]
    cells = [theirs[n][op] / ours[n][op] for op in (0, 1) for n in (SMALL, LARGE)]
    return (
        f"{'  sortedcontainers / ours':<34}{cells[0]:>12.2f}{cells[1]:>9.2f}{'':>7}"
        f"{cells[2]:>15.2f}{cells[3]:>9.2f}"
    )


def part_collections(args: argparse.Namespace) -> None:
    print("(1) the collections alone; ratio: 100,000 held / 100 held")
    print(HEADER)
    makers: dict[str, Callable[[int], Any]] = {
        "ours": lambda n: SortedKeys(),
        "sortedcontainers": lambda n: ListKeys(),
    }
    keys = {n: keys_for(n, 1) for n in (SMALL, LARGE)}
    times = time_side_by_side(makers, collection_methods, keys_for(args.ops, 2), keys, args.repeat)
    print(row("SortedKeys, (float, int) keys", times["ours"], None))
    print(row("  on SortedList", times["sortedcontainers"], None))
    print(versus(times))
    queues: dict[str, Callable[[int], Any]] = {
        "ours": lambda n: TimeQueue(ticket),
        "sortedcontainers": lambda n: ListQueue(ticket),
    }
    for kind in ("budgets", "random"):
        now = time.monotonic()
        backlogs = {n: deadlines_for(n, 1, kind, now - n * 1e-5) for n in (SMALL, LARGE)}
        fresh = deadlines_for(args.ops, 2, kind, now)
        times = time_side_by_side(queues, collection_methods, fresh, backlogs, args.repeat)
        memory = {name: queue_bytes(make, LARGE) for name, make in queues.items()}
        print(row(f"TimeQueue, {kind} deadlines", times["ours"], memory["ours"]))
        print(row("  on SortedList", times["sortedcontainers"], memory["sortedcontainers"]))
        print(versus(times))
    print()


def part_schedulers(args: argparse.Namespace) -> None:
    print("(2) the schedulers; B/entry: the scheduler's own bytes per queued request")
    print(HEADER)
    for name, (factory, backlog_deadlines, fresh_deadlines) in SCHEDULERS.items():
        if not name.startswith(("priority", "deadline")):
            continue  # fifo and fair hold no sorted collection
        makers = {"ours": factory, "sortedcontainers": swapped(factory)}
        now = time.monotonic()
        fresh = [(r,) for r in make_requests(args.ops, 2, fresh_deadlines, now)]
        backlogs = {
            n: [(r,) for r in make_requests(n, 1, backlog_deadlines, now - n * 1e-5)]
            for n in (SMALL, LARGE)
        }
        times = time_side_by_side(makers, scheduler_methods, fresh, backlogs, args.repeat)
        memory = {
            side: memory_per_request(make, backlog_deadlines, LARGE)[0]
            for side, make in makers.items()
        }
        print(row(name, times["ours"], memory["ours"]))
        print(row("  on SortedList", times["sortedcontainers"], memory["sortedcontainers"]))
        print(versus(times))
    print()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--part", default="12", help="1 (collections), 2 (schedulers) or 12")
    parser.add_argument("--repeat", type=int, default=5, help="runs per measurement")
    parser.add_argument("--ops", type=int, default=20_000, help="operations per run")
    args = parser.parse_args(argv)
    print(
        f"Python {platform.python_version()}, sortedcontainers {sortedcontainers.__version__}, "
        f"trio {version('trio')}, {platform.machine()}"
    )
    print(
        f"best of {args.repeat} runs of {args.ops:,} operation pairs each; ns per pair; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    print()
    if "1" in args.part:
        part_collections(args)
    if "2" in args.part:
        part_schedulers(args)
    print(
        "sortedcontainers / ours: above 1, ours is faster by that factor; below 1, slower. "
        f"Load average now {os.getloadavg()[0]:.2f}."
    )


if __name__ == "__main__":
    main(sys.argv[1:])
