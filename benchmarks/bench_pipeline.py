"""A three-step pipeline against the same three steps written by hand, one function per request.

The steps are the bundled repository's: ``scale_image`` (Python: an 8x8 image to a
float row), ``digits`` (ONNX Runtime) and ``digit_names`` (Python: probabilities to a
name). Three ways, side by side in one run, C client tasks each sending one image
at a time:

  hand        one async function per request: the Python steps inline, the ONNX
              session on a worker thread (``trio.to_thread.run_sync``), as one would
              write it without trioinfer
  pipeline    the ``read_digit`` pipeline, every step unbatched (batcher "none")
  batched     the same pipeline, every step with the dynamic batcher (32 rows, 2 ms)

Usage:  .venv/bin/python benchmarks/bench_pipeline.py [--duration 5] [--rounds 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import trio

import trioinfer

REPO = trioinfer.example_repository()


def _model_class(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / name / "1" / "model.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Model


async def closed_loop(call: Callable[[np.ndarray], Awaitable[object]], args: Any) -> float:
    images = trioinfer.digits_samples()[0].reshape(-1, 8, 8).astype(np.uint8)
    done = 0

    async def client(i: int) -> None:
        nonlocal done
        while True:
            await call(images[(i + done) % len(images)][np.newaxis])
            done += 1

    async with trio.open_nursery() as nursery:
        for i in range(args.concurrency):
            nursery.start_soon(client, i)
        await trio.sleep(args.warmup)
        start_done, start = done, time.perf_counter()
        await trio.sleep(args.duration)
        rate = (done - start_done) / (time.perf_counter() - start)
        nursery.cancel_scope.cancel()
    return rate


async def by_hand(args: argparse.Namespace) -> float:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(REPO / "digits" / "1" / "model.onnx"), options)
    scale, names = _model_class("scale_image")(), _model_class("digit_names")(threshold=0.5)
    limiter = trio.CapacityLimiter(1)  # one session, as one instance

    async def call(image: np.ndarray) -> object:
        row = scale.infer({"image": image})["input"]
        probabilities = await trio.to_thread.run_sync(
            lambda: session.run(["probabilities"], {"input": row})[0], limiter=limiter
        )
        return names.infer({"probabilities": probabilities})["name"]

    return await closed_loop(call, args)


async def as_pipeline(args: argparse.Namespace, *, batched: bool) -> float:
    batching = (
        {"batcher": "dynamic", "batcher_options": {"max_batch_size": 32, "max_queue_delay": 0.002}}
        if batched
        else {"batcher": "none"}
    )
    async with trioinfer.open_engine() as engine:
        for name in ("scale_image", "digits", "digit_names"):
            config = trioinfer.ModelConfig.from_toml(REPO / name / "config.toml")
            data = {**config.backend_options}
            await engine.load(
                trioinfer.ModelConfig.from_dict(
                    {
                        "name": name,
                        "path": config.path,
                        "backend": config.backend,
                        "backend_options": data,
                        "instances": [{"threads": 1}],
                        **batching,
                    }
                )
            )
        await engine.load(trioinfer.ModelConfig.from_toml(REPO / "read_digit" / "config.toml"))

        async def call(image: np.ndarray) -> object:
            return (await engine.infer("read_digit", {"IMAGE": image}))["NAME"]

        return await closed_loop(call, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()
    runs: dict[str, Callable[[], Awaitable[float]]] = {
        "hand": lambda: by_hand(args),
        "pipeline": lambda: as_pipeline(args, batched=False),
        "batched": lambda: as_pipeline(args, batched=True),
    }
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(args.rounds):
        order = list(runs) if round_ % 2 == 0 else list(reversed(runs))
        for name in order:
            rate = trio.run(runs[name])
            rates[name].append(rate)
            print(f"round {round_ + 1}: {name:<9} {rate:8.0f} req/s")
    hand = statistics.median(rates["hand"])
    for name in ("pipeline", "batched"):
        ratios = [b / a for a, b in zip(rates["hand"], rates[name], strict=True)]
        print(
            f"{name}: median {statistics.median(rates[name]):.0f} req/s, "
            f"{statistics.median(ratios):.2f}x hand ({', '.join(f'{r:.2f}' for r in ratios)})"
        )
    print(f"hand: median {hand:.0f} req/s; C={args.concurrency}, {Path(REPO).name}")


if __name__ == "__main__":
    main()
