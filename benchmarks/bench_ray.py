"""Per-batch overhead of a Ray instance over a local one; bytes moved with and without the codec.

Starts a local one-node Ray on 127.0.0.1 (two CPUs), loads the same model
locally (onnxruntime backend) and remotely (ray backend), and runs batches one
at a time through the engine, alternating local and remote, so that both see
the same machine load. Also times the two ways of waiting for an ObjectRef
from Trio (the ref's future with a callback waking the loop, as the backend
does; ``ray.get`` in a worker thread), and counts the tensor bytes one request
moves (inputs there, outputs back) with and without ``codec = "uint8"``.

    python benchmarks/bench_ray.py --batches 500
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np
import ray
import trio

import trioinfer_ray
from trioinfer import Instance, ModelConfig, open_engine
from trioinfer.testing import models


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3


async def overhead(name: str, path: Path, rows: int, batches: int, width: int) -> None:
    x = np.random.default_rng(0).standard_normal((rows, width), dtype=np.float32)
    times: dict[str, list[float]] = {"local": [], "ray": [], "ray-uint8": []}
    async with open_engine() as engine:
        threads = [Instance(threads=1)]
        await engine.load(ModelConfig(name="local", path=path, instances=threads))
        await engine.load(ModelConfig(name="ray", path=path, backend="ray", instances=threads))
        await engine.load(
            ModelConfig(
                name="ray-uint8",
                path=path,
                backend="ray",
                instances=threads,
                backend_options={"codec": "uint8"},
            )
        )
        for _ in range(20):  # warm up: sessions, Ray's connections, ORT's arenas
            for model in times:
                await engine.infer(model, {"input": x})
        for _ in range(batches):
            for model, samples in times.items():
                started = time.perf_counter()
                out = await engine.infer(model, {"input": x})
                samples.append(time.perf_counter() - started)
    local = times["local"]
    print(f"\n{name}, batches of {rows} rows, {batches} each, one at a time (ms):")
    print(f"  {'':<10}{'p50':>8}{'p90':>8}{'p99':>8}{'over local p50':>16}")
    for model, samples in times.items():
        extra = pct(samples, 0.5) - pct(local, 0.5)
        print(
            f"  {model:<10}{pct(samples, 0.5):>8.3f}{pct(samples, 0.9):>8.3f}"
            f"{pct(samples, 0.99):>8.3f}{extra:>16.3f}"
        )
    sent = {"input": x}
    raw = trioinfer_ray.wire_bytes(sent) + trioinfer_ray.wire_bytes(out)
    coded = trioinfer_ray.wire_bytes(trioinfer_ray.encode(sent)) + trioinfer_ray.wire_bytes(
        trioinfer_ray.encode(out)
    )
    print(
        f"  tensor bytes per batch (in + out): {raw:,} raw, {coded:,} with uint8 "
        f"({raw / coded:.2f}x fewer); per row {raw / rows:,.0f} / {coded / rows:,.0f}"
    )


async def bridges(path: Path, calls: int) -> None:
    config = ModelConfig(name="bridge", path=path, backend="ray", instances=[Instance(threads=1)])
    instance = await trioinfer_ray.RayBackend().load(config, config.placements()[0])
    x = {"input": np.zeros((1, 64), np.float32)}
    actor = instance.actor
    try:
        results: dict[str, list[float]] = {"future callback": [], "ray.get in a thread": []}
        for _ in range(calls):
            started = time.perf_counter()
            await trioinfer_ray.wait_ref(actor.execute.remote(x, math.inf))
            results["future callback"].append(time.perf_counter() - started)
            started = time.perf_counter()
            await trio.to_thread.run_sync(ray.get, actor.execute.remote(x, math.inf))
            results["ray.get in a thread"].append(time.perf_counter() - started)
    finally:
        await instance.aclose()
    print(f"\nwaiting for an ObjectRef from Trio, one-row digits batch, {calls} calls (ms):")
    for way, samples in results.items():
        print(f"  {way:<22} p50 {pct(samples, 0.5):.3f}  p90 {pct(samples, 0.9):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=500)
    args = parser.parse_args()
    temp = tempfile.mkdtemp(prefix="trioinfer-bench-ray-")
    ray.init(
        address="local",
        include_dashboard=False,
        num_cpus=2,
        _temp_dir=temp,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        digits = models.write_mlp(Path(temp) / "mlp.onnx")
        # Tensors of the wide MLP's shapes (1024 in, 1000 out) with far fewer weights, so
        # that bytes moved, not compute, dominate on this small machine.
        wide = models.write_mlp(Path(temp) / "wide.onnx", (1024, 256, 1000))
        trio.run(overhead, "digits MLP (64 -> 10)", digits, 1, args.batches, 64)
        trio.run(overhead, "digits MLP (64 -> 10)", digits, 32, args.batches, 64)
        trio.run(overhead, "MLP 1024 -> 256 -> 1000", wide, 32, args.batches, 1024)
        trio.run(bridges, digits, args.batches)
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


if __name__ == "__main__":
    main()
