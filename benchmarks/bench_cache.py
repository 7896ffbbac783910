"""The response cache on a 90%-repeat workload: throughput with the cache on against off.

In-process, the wide MLP (``float32[batch, 1024] -> float32[batch, 1000]``), dynamic
batching, C client tasks. Each request repeats one of a small set of earlier inputs
with probability ``--repeat`` (0.9), and is a fresh random input otherwise. The two
settings alternate within each round, so that the machine's drift hits both alike.

Usage:  .venv/bin/python benchmarks/bench_cache.py [--duration 5] [--rounds 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import trio

import trioinfer
from trioinfer.testing import models


async def run(path: Path, *, cache: bool, args: argparse.Namespace) -> tuple[float, int, int]:
    size = args.cache_mib << 20
    config = trioinfer.ModelConfig(
        name="wide",
        path=path,
        instances=[trioinfer.Instance("cpu", threads=args.threads)],
        batcher="dynamic",
        batcher_options={"max_batch_size": 32, "max_queue_delay": 0.002},
        response_cache=cache,
    )
    rng = np.random.default_rng(0)
    hot = [rng.standard_normal((1, 1024), dtype=np.float32) for _ in range(args.hot)]
    choose = random.Random(1)
    done = 0
    async with trioinfer.open_engine(cache_size=size if cache else 0) as engine:
        await engine.load(config)

        async def client() -> None:
            nonlocal done
            while True:
                if choose.random() < args.repeat:
                    x = hot[choose.randrange(len(hot))]
                else:
                    x = rng.standard_normal((1, 1024), dtype=np.float32)
                await engine.infer("wide", {"input": x})
                done += 1

        async with trio.open_nursery() as nursery:
            for _ in range(args.concurrency):
                nursery.start_soon(client)
            await trio.sleep(args.warmup)
            start_done, start = done, time.perf_counter()
            await trio.sleep(args.duration)
            rate = (done - start_done) / (time.perf_counter() - start)
            nursery.cancel_scope.cancel()
        stats = engine.statistics()
    return rate, stats.cache_bytes, stats.cache_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=5.0, help="seconds measured per run")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--repeat", type=float, default=0.9, help="share of repeated requests")
    parser.add_argument("--hot", type=int, default=256, help="distinct repeated inputs")
    parser.add_argument("--cache-mib", type=int, default=8, help="cache size in MiB")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = models.write_wide_mlp(Path(tmp) / "wide.onnx")
        rates: dict[bool, list[float]] = {False: [], True: []}
        for round_ in range(args.rounds):
            for cache in (False, True) if round_ % 2 == 0 else (True, False):
                rate, used, size = trio.run(lambda c=cache: run(path, cache=c, args=args))
                rates[cache].append(rate)
                extra = f"  cache {used / 2**20:.2f} of {size / 2**20:.0f} MiB" if cache else ""
                setting = "on " if cache else "off"
                print(f"round {round_ + 1}: cache {setting} {rate:8.0f} req/s{extra}")
    off, on = statistics.median(rates[False]), statistics.median(rates[True])
    ratios = [b / a for a, b in zip(rates[False], rates[True], strict=True)]
    print(
        f"median: off {off:.0f} req/s, on {on:.0f} req/s; on/off {on / off:.2f}x "
        f"(per round: {', '.join(f'{r:.2f}' for r in ratios)}); {args.repeat:.0%} repeats, "
        f"C={args.concurrency}"
    )


if __name__ == "__main__":
    main()
