"""Tuning dynamic batching: what max_batch_size, max_queue_delay and preferred sizes trade.

Run it with ``python docs/tutorials/batching.py``; the docs' test suite runs it too.
It prints a table per step; the figures depend on your machine, the outcomes do not.
"""

# --8<-- [start:setup]
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import trio

import trioinfer
from trioinfer.testing import models

ROWS = np.random.default_rng(0).standard_normal((64, 256), dtype=np.float32)


async def load(
    engine: trioinfer.Engine, name: str, path: Path, batcher: str = "none", **options: Any
) -> str:
    """Load the model file at *path* as model *name*, with the given batcher."""
    await engine.load(
        trioinfer.ModelConfig(
            name=name,
            path=path,
            instances=[trioinfer.Instance("cpu", threads=1)],
            batcher=batcher,
            batcher_options=options,
        )
    )
    return name


# --8<-- [end:setup]


# --8<-- [start:measure]
async def measure(
    engine: trioinfer.Engine, model: str, callers: int, requests: int
) -> tuple[dict[int, np.ndarray], list[float]]:
    """Run *callers* tasks, each sending *requests* one-row requests one after another.

    Prints requests per second, median and 99th-percentile latency, and the
    average rows per execution; returns every answer by request number, and
    every request's latency in seconds.
    """
    answers: dict[int, np.ndarray] = {}
    latencies: list[float] = []
    before = engine.statistics().models[model]

    async def caller(c: int) -> None:
        for r in range(requests):
            i = c * requests + r
            sent = time.perf_counter()
            out = await engine.infer(model, {"input": ROWS[i % 64 : i % 64 + 1]})
            latencies.append(time.perf_counter() - sent)
            answers[i] = out["output"]

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for c in range(callers):
            nursery.start_soon(caller, c)
    elapsed = time.perf_counter() - start
    after = engine.statistics().models[model]
    executions = after.executions - before.executions
    p50, p99 = np.percentile(latencies, [50, 99]) * 1000
    print(
        f"  {model:<22} {callers:>3} callers  {len(latencies) / elapsed:>7.0f} req/s  "
        f"p50 {p50:6.2f} ms  p99 {p99:6.2f} ms  {len(latencies) / executions:5.1f} rows/execution"
    )
    return answers, latencies


# --8<-- [end:measure]


# --8<-- [start:load]
async def under_load(engine: trioinfer.Engine, path: Path) -> None:
    print("step 1: 64 callers, 10 one-row requests each")
    none = await load(engine, "none", path)
    small = await load(engine, "dynamic-max-8", path, "dynamic", max_batch_size=8)
    large = await load(engine, "dynamic-max-32", path, "dynamic", max_batch_size=32)
    reference, _ = await measure(engine, none, callers=64, requests=10)
    for model in (small, large):
        answers, _ = await measure(engine, model, callers=64, requests=10)
        same = sum(np.allclose(answers[i], reference[i], atol=1e-5) for i in reference)
        print(f"step 1: {model}: {same} of {len(reference)} answers match the unbatched model")


# --8<-- [end:load]


# --8<-- [start:quiet]
async def quiet_queue(engine: trioinfer.Engine, path: Path) -> None:
    print("step 2: one caller, 20 requests one after another")
    await measure(engine, "none", callers=1, requests=20)
    for delay in (0.0, 0.002, 0.01):
        name = await load(
            engine, f"dynamic-{delay * 1000:g}ms", path, "dynamic", max_queue_delay=delay
        )
        _, latencies = await measure(engine, name, callers=1, requests=20)
        waited = min(latencies) >= delay
        print(f"step 2: {name}: no lone request came back before the delay: {waited}")
    print("step 2: 64 callers: the delay hardly matters when the queue is full")
    await measure(engine, "dynamic-0ms", callers=64, requests=10)
    await measure(engine, "dynamic-10ms", callers=64, requests=10)


# --8<-- [end:quiet]


# --8<-- [start:preferred]
async def preferred_sizes(engine: trioinfer.Engine, path: Path) -> None:
    sizes = [1, 2, 4, 8, 16, 32]
    name = "dynamic-preferred"
    await load(engine, name, path, "dynamic", max_queue_delay=0.01, preferred_batch_sizes=sizes)
    print(f"step 3: preferred_batch_sizes {sizes}, max_queue_delay 10 ms")
    await measure(engine, name, callers=1, requests=20)
    await measure(engine, name, callers=64, requests=10)


# --8<-- [end:preferred]


# --8<-- [start:views]
async def outputs_are_views(engine: trioinfer.Engine, path: Path) -> None:
    model = await load(engine, "pairs", path, "dynamic", max_batch_size=2, max_queue_delay=1)
    outputs: list[np.ndarray] = []

    async def call(i: int) -> None:
        outputs.append((await engine.infer(model, {"input": ROWS[i : i + 1]}))["output"])

    async with trio.open_nursery() as nursery:  # two callers: one full batch of 2
        nursery.start_soon(call, 0)
        nursery.start_soon(call, 1)
    first, second = outputs
    batch = first.base  # the array a view looks into; None for an array that owns its data
    assert batch is not None, "the answer is a copy, not a view of the batch's output"
    print(f"step 4: both answers are views of one {batch.shape} array: {batch is second.base}")
    kept = first.copy()  # a copy holds only its own row, not the whole batch output
    print(f"step 4: a copy owns its data: {kept.base is None}")


# --8<-- [end:views]


# --8<-- [start:main]
async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        # float32[batch, 256] -> float32[batch, 10]: a little compute per row.
        path = models.write_mlp(Path(tmp) / "mlp.onnx", sizes=(256, 256, 10))
        async with trioinfer.open_engine() as engine:
            await under_load(engine, path)
            await quiet_queue(engine, path)
            await preferred_sizes(engine, path)
            await outputs_are_views(engine, path)


# --8<-- [end:main]


# --8<-- [start:run]
if __name__ == "__main__":
    trio.run(main)
# --8<-- [end:run]
