"""Deadlines and cancellation: what the engine does with the caller's cancel scope.

Run it with ``python docs/tutorials/deadlines.py``; the docs' test suite runs it too.
Each step prints what happened; times vary from machine to machine.
"""

# --8<-- [start:setup]
import tempfile
import time
from pathlib import Path

import numpy as np
import trio
from trio.testing import wait_all_tasks_blocked

import trioinfer
from trioinfer.testing import models

MODEL = "slow"
ONE_ROW = np.ones((1, 256), dtype=np.float32)  # answered in milliseconds
BIG = np.ones((16384, 256), dtype=np.float32)  # seconds of work: nobody waits for all of it


def stats(engine: trioinfer.Engine) -> trioinfer.ModelStatistics:
    return engine.statistics().models[MODEL]


async def occupy(engine: trioinfer.Engine, seconds: float) -> None:
    """Keep the model's only instance busy with BIG for *seconds*, then give up."""
    with trio.move_on_after(seconds):
        await engine.infer(MODEL, {"x": BIG})


# --8<-- [end:setup]


# --8<-- [start:scope]
async def scope_is_the_timeout(engine: trioinfer.Engine) -> None:
    with trio.fail_after(1):  # this request may take at most a second
        outputs = await engine.infer(MODEL, {"x": ONE_ROW})
    print(f"step 1: answered within the scope: y has shape {outputs['y'].shape}")


# --8<-- [end:scope]


# --8<-- [start:queued]
async def deadline_passes_in_the_queue(engine: trioinfer.Engine) -> None:
    before = stats(engine)

    async def impatient(i: int) -> None:
        with trio.move_on_after(0.1) as scope:
            await engine.infer(MODEL, {"x": ONE_ROW})
        if scope.cancelled_caught:
            print(f"step 2: impatient caller {i} gave up after 0.1 s")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(occupy, engine, 0.3)
        await wait_all_tasks_blocked()  # now BIG is running
        for i in range(3):
            nursery.start_soon(impatient, i)

    after = stats(engine)
    print(
        f"step 2: 4 requests, {after.executions - before.executions} execution; "
        f"{after.cancelled - before.cancelled} cancelled, {after.expired - before.expired} expired"
    )


# --8<-- [end:queued]


# --8<-- [start:running]
async def cancelled_while_running(engine: trioinfer.Engine) -> None:
    start = time.perf_counter()
    try:
        with trio.fail_after(0.2):
            await engine.infer(MODEL, {"x": BIG})
    except trio.TooSlowError:
        print(f"step 3: gave up on BIG after {time.perf_counter() - start:.2f} s")

    start = time.perf_counter()
    with trio.fail_after(1):
        await engine.infer(MODEL, {"x": ONE_ROW})
    # Had BIG run to the end, this request would have waited seconds for the instance.
    print(f"step 3: the next request was answered {time.perf_counter() - start:.3f} s later")


# --8<-- [end:running]


# --8<-- [start:queue_full]
async def queue_full(engine: trioinfer.Engine) -> None:
    before = stats(engine)
    retries: list[float] = []

    async def persistent(i: int) -> None:
        with trio.fail_after(2):  # the retries share this one deadline
            while True:
                try:
                    await engine.infer(MODEL, {"x": ONE_ROW})
                except trioinfer.QueueFull as exc:
                    retries.append(exc.retry_after)
                    await trio.sleep(exc.retry_after)
                else:
                    return

    async with trio.open_nursery() as nursery:
        nursery.start_soon(occupy, engine, 0.3)
        await wait_all_tasks_blocked()  # now BIG is running
        for i in range(6):
            nursery.start_soon(persistent, i)

    after = stats(engine)
    print(
        f"step 4: 6 callers, queue bound 3: {after.refused - before.refused} refusals "
        f"(first retry_after {retries[0]:.3f} s); "
        f"{after.succeeded - before.succeeded} answered in the end"
    )


# --8<-- [end:queue_full]


# --8<-- [start:main]
async def caller(engine: trioinfer.Engine, label: str, x: np.ndarray) -> None:
    try:
        await engine.infer(MODEL, {"x": x})
    except trioinfer.EngineClosed:
        print(f"step 5: {label}: EngineClosed (still running when the drain period ended)")
    else:
        print(f"step 5: {label}: answered during the drain")


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = models.write_slow(Path(tmp) / "slow.onnx", width=256, depth=400)
        config = trioinfer.ModelConfig(
            name=MODEL,
            path=path,
            instances=[trioinfer.Instance("cpu", count=1, threads=1)],
            max_queue_size=3,  # small, so that step 4 can fill the queue
        )
        async with trio.open_nursery() as callers:
            async with trioinfer.open_engine(drain_period=0.5) as engine:
                await engine.load(config)
                await scope_is_the_timeout(engine)
                await deadline_passes_in_the_queue(engine)
                await cancelled_while_running(engine)
                await queue_full(engine)

                # Two callers whose requests are in flight when the block ends:
                # a small one running, and BIG queued behind it.
                callers.start_soon(caller, engine, "small request", BIG[:64])
                await wait_all_tasks_blocked()
                callers.start_soon(caller, engine, "BIG request", BIG)
                await wait_all_tasks_blocked()
                print("step 5: leaving the engine block")
            print("step 5: the engine block has exited")

        try:
            await engine.infer(MODEL, {"x": ONE_ROW})
        except trioinfer.EngineClosed:
            print("step 5: a request after the block: EngineClosed")


# --8<-- [end:main]


# --8<-- [start:run]
if __name__ == "__main__":
    trio.run(main)
# --8<-- [end:run]
