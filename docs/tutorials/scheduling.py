"""Priorities, deadlines and fairness: the scheduler plugins, side by side.

Run it with ``python docs/tutorials/scheduling.py``; the docs' test suite runs it too.
It takes a couple of seconds. The model is a stand-in (trioinfer.testing.FakeBackend)
whose every execution takes 10 ms, so that queues form and orders show.
"""

# --8<-- [start:setup]
import functools
from collections.abc import Mapping
from typing import TypedDict

import numpy as np
import trio
from trio.testing import wait_all_tasks_blocked

import trioinfer
from trioinfer.testing import FakeBackend

EXECUTION_S = 0.01  # every execution of the stand-in model takes 10 ms
X = np.ones((1, 4), dtype=np.float32)
backend = FakeBackend(delay=EXECUTION_S)


async def load(
    engine: trioinfer.Engine,
    name: str,
    scheduler: str,
    scheduler_options: Mapping[str, object] | None = None,
    queue_timeouts: Mapping[int, float] | None = None,
) -> None:
    """Load the stand-in model as *name*: one instance, one request per execution."""
    config = trioinfer.ModelConfig(
        name=name,
        path="unused",
        backend="fake",
        scheduler=scheduler,
        scheduler_options=scheduler_options or {},
        queue_timeouts=queue_timeouts or {},
    )
    await engine.load(config)


class Call(TypedDict, total=False):
    """How one queued request is made: ``engine.infer`` keywords, and the caller's budget."""

    priority: int
    tenant: str
    budget: float  # seconds for the caller's own trio.move_on_after scope


async def in_order(engine: trioinfer.Engine, model: str, calls: dict[str, Call]) -> list[str]:
    """Queue one request per entry of *calls* while the instance is held; return who ended when."""
    done: list[str] = []

    async def call(
        label: str, priority: int = 0, tenant: str | None = None, budget: float = 60.0
    ) -> None:
        with trio.move_on_after(budget):
            await engine.infer(model, {"x": X}, priority=priority, tenant=tenant)
            done.append(label)

    gate = trio.CancelScope()

    async def hold_the_instance() -> None:
        with gate:
            await engine.infer(model, {"x": X})

    async with trio.open_nursery() as nursery:
        backend.delay = 3600  # the next execution lasts until its caller gives up
        nursery.start_soon(hold_the_instance)
        await wait_all_tasks_blocked()
        backend.delay = EXECUTION_S
        for label, kwargs in calls.items():
            nursery.start_soon(functools.partial(call, label, **kwargs))
            await wait_all_tasks_blocked()  # queued in this order
        gate.cancel()  # the instance is free: the queue drains in the scheduler's order
    return done


# --8<-- [end:setup]


# --8<-- [start:priority]
async def priorities(engine: trioinfer.Engine) -> None:
    # Strict priority (no aging), so that the order shows priority alone, however long
    # the queueing takes on a busy machine; the next section turns aging on.
    await load(engine, "ranked", scheduler="priority", scheduler_options={"max_wait": None})
    order = await in_order(
        engine,
        "ranked",
        {
            "report": {"priority": -1},
            "chat-1": {"priority": 10},
            "default": {},
            "chat-2": {"priority": 10},
            "search": {"priority": 5},
        },
    )
    print(f"priority: {order}")


# --8<-- [end:priority]


# --8<-- [start:aging]
async def aging(engine: trioinfer.Engine) -> None:
    await load(engine, "aged", scheduler="priority", scheduler_options={"max_wait": 0.1})
    flood_done = 0

    async def urgent() -> None:
        nonlocal flood_done
        await engine.infer("aged", {"x": X}, priority=10)
        flood_done += 1

    async with trio.open_nursery() as nursery:
        for _ in range(40):  # 40 x 10 ms of high-priority work: 0.4 s
            nursery.start_soon(urgent)
        await wait_all_tasks_blocked()
        start = trio.current_time()
        await engine.infer("aged", {"x": X}, priority=-1)
        waited = trio.current_time() - start
        left = 40 - flood_done
    print(
        f"aging: the low-priority request ran while {'some' if left else 'no'} "
        f"high-priority work was still queued"
    )
    print(f"aging: it waited {waited:.2f} s; max_wait is 0.1 s, one execution 0.01 s")


# --8<-- [end:aging]


# --8<-- [start:queue_timeouts]
async def queue_timeouts(engine: trioinfer.Engine) -> None:
    await load(
        engine,
        "policed",
        scheduler="priority",
        queue_timeouts={-1: 0.03},  # priority -1 may wait 30 ms at most, unless given a deadline
    )
    async with trio.open_nursery() as nursery:
        for _ in range(10):  # 100 ms of work ahead of it
            nursery.start_soon(functools.partial(engine.infer, "policed", {"x": X}, priority=5))
        await wait_all_tasks_blocked()
        try:
            await engine.infer("policed", {"x": X}, priority=-1)
        except trioinfer.DeadlineExceeded:
            print("queue_timeouts: the background request gave up after 30 ms in the queue")


# --8<-- [end:queue_timeouts]


# --8<-- [start:deadline]
async def deadlines(engine: trioinfer.Engine) -> None:
    await load(engine, "edf", scheduler="deadline", scheduler_options={"refuse_late": True})
    order = await in_order(
        engine,
        "edf",
        {
            "no deadline": {},
            "within 50 s": {"budget": 50.0},
            "within 10 s": {"budget": 10.0},
            "within 30 s": {"budget": 30.0},
        },
    )
    print(f"deadline: {order}")

    # Now the engine has seen executions of about 10 ms. A request that must be
    # answered within 2 ms cannot be: refused at once, nothing is computed.
    try:
        with trio.fail_after(0.002):
            await engine.infer("edf", {"x": X})
    except trioinfer.DeadlineExceeded as exc:
        print(f"refuse_late: {exc}")
    refused = engine.statistics().models["edf"].refused
    print(f"refuse_late: {refused} refused in the model's statistics")


# --8<-- [end:deadline]


# --8<-- [start:fair]
async def fairness(engine: trioinfer.Engine, scheduler: str) -> None:
    await load(engine, scheduler, scheduler=scheduler)
    calls: dict[str, Call] = {f"batch-{i}": {"tenant": "batch-job"} for i in range(30)}
    calls["interactive"] = {"tenant": "alice"}
    order = await in_order(engine, scheduler, calls)
    position = order.index("interactive") + 1
    print(f"{scheduler}: alice's request ended {position} of {len(order)}")


async def weighted(engine: trioinfer.Engine) -> None:
    await load(engine, "shared", scheduler="fair", scheduler_options={"weights": {"gold": 3}})
    calls: dict[str, Call] = {}
    for i in range(20):
        calls[f"gold-{i}"] = {"tenant": "gold"}
        calls[f"free-{i}"] = {"tenant": "free"}
    order = await in_order(engine, "shared", calls)
    first = [label.split("-")[0] for label in order[:16]]
    print(f"weights: of the first 16, gold {first.count('gold')}, free {first.count('free')}")


# --8<-- [end:fair]


# --8<-- [start:main]
async def main() -> None:
    async with trioinfer.open_engine(registry=backend.registry("fake")) as engine:
        await priorities(engine)
        await aging(engine)
        await queue_timeouts(engine)
        await deadlines(engine)
        await fairness(engine, "fifo")
        await fairness(engine, "fair")
        await weighted(engine)


# --8<-- [end:main]


# --8<-- [start:run]
if __name__ == "__main__":
    trio.run(main)
# --8<-- [end:run]
