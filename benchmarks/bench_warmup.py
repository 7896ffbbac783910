"""What a model warm-up spares the first callers: their latency with and without one.

Loads a model afresh, again and again, alternating a config with no ``warmup`` and
one whose sample runs each instance once at the batch size the callers send; after
each load, times the first request and the next ones (one caller, one at a time),
and the load itself. Prints medians per arm. The model is the bundled digits MLP or
the wide MLP of ``trioinfer.testing.models`` (``--model wide``, 100 MB, where the
runtime's first runs cost far more), on the CPU (or ``--device cuda:0``).

Usage:  .venv/bin/python benchmarks/bench_warmup.py [--model digits|wide]
            [--rows 1] [--loads 10] [--device cpu]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import trio

import trioinfer
from trioinfer import Instance, ModelConfig, Warmup, WarmupInput
from trioinfer.testing import models


def model_file(name: str, directory: Path) -> tuple[Path, str, int]:
    """The model's file, its input's name and its row width."""
    if name == "wide":
        return models.write_wide_mlp(directory / "wide.onnx"), "input", 1024
    return trioinfer.example_repository() / "digits" / "1" / "model.onnx", "input", 64


async def one_load(
    path: Path, input_name: str, width: int, rows: int, device: str, warm: bool
) -> tuple[float, float, float]:
    """(load seconds, first request seconds, median of the next 20) for one fresh load."""
    warmup = (
        [Warmup("callers", {input_name: WarmupInput([width], "random")}, batch_size=rows)]
        if warm
        else []
    )
    config = ModelConfig(
        name="m", path=path, instances=[Instance(device)], warmup=warmup, batcher="none"
    )
    x = np.random.default_rng(0).random((rows, width), dtype=np.float32)
    async with trioinfer.open_engine() as engine:
        start = time.perf_counter()
        await engine.load(config)
        loaded = time.perf_counter() - start
        start = time.perf_counter()
        await engine.infer("m", {input_name: x})
        first = time.perf_counter() - start
        later = []
        for _ in range(20):
            start = time.perf_counter()
            await engine.infer("m", {input_name: x})
            later.append(time.perf_counter() - start)
    return loaded, first, statistics.median(later)


async def main(args: argparse.Namespace) -> None:
    print(
        f"# {platform.node()}, Python {platform.python_version()}, onnxruntime "
        f"{ort.__version__}, trioinfer {trioinfer.__version__}; model {args.model}, "
        f"{args.rows} row(s) a request, {args.loads} loads an arm, device {args.device}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        path, input_name, width = model_file(args.model, Path(tmp))
        figures: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}
        for i in range(args.loads * 2):
            warm = (i % 2 == 1) if (i // 2) % 2 == 0 else (i % 2 == 0)  # alternate the order
            figures[warm].append(
                await one_load(path, input_name, width, args.rows, args.device, warm)
            )
    print("arm        load ms   first request ms   later requests ms (median)")
    for warm, runs in figures.items():
        load, first, later = (statistics.median(column) for column in zip(*runs, strict=True))
        name = "warm-up" if warm else "none"
        print(f"{name:<10} {load * 1e3:8.1f}   {first * 1e3:16.3f}   {later * 1e3:12.3f}")
    cold = statistics.median(run[1] for run in figures[False])
    warm_first = statistics.median(run[1] for run in figures[True])
    print(f"first request, no warm-up / warm-up: {cold / warm_first:.1f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("digits", "wide"), default="digits")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--loads", type=int, default=10)
    parser.add_argument("--device", default="cpu")
    trio.run(main, parser.parse_args())
