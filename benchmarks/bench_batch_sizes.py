#!/usr/bin/env python
"""Raw ONNX Runtime rows/s at each batch size: where batching stops paying per row.

For each model of ``--models`` (the compare set: digits, wide, minilm, made as
``bench_http.py`` makes them), a tight ``session.run`` loop at each batch size
of ``--batch-sizes``, ``--duration`` seconds each, with the same session
settings as every other benchmark here (``--threads`` intra-op threads,
sequential). The sizes are measured in turn within each of ``--repeat``
rounds, so a burst of other load hits every size alike; the table gives the
median rows/s of the rounds (each round's value in brackets) and each size over
the model's best.

On the MLPs rows/s climbs with the batch: a row is a matrix-vector product and
batching turns it into matrix-matrix work. On a transformer a single row is
already a matrix product (one row per token), so batching saves next to
nothing, and a big batch can cost *more* per row: its activations outgrow the
caches. A dynamic batcher then serves more rows/s with a smaller batch
(``max_batch_size`` or ``preferred_batch_sizes``) than with the largest it may
form; benchmarks/RESULTS.md ("On a transformer") shows it for MiniLM.

Usage:  .venv/bin/python benchmarks/bench_batch_sizes.py --models minilm --repeat 2
        .venv/bin/python benchmarks/bench_batch_sizes.py --models digits,wide --batch-sizes 1,8,32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import bench_batching
import bench_http
import numpy as np
import onnxruntime as ort
from bench_batching import Feeds, make_session
from bench_engine import versions


def rows_per_second(session: ort.InferenceSession, feed: Feeds, rows: int, seconds: float) -> float:
    """A tight loop of ``session.run`` on *feed* (*rows* rows) for *seconds*: rows/s."""
    run = session.run
    run(None, feed)  # the first run of a shape plans it; not counted
    count, start = 0, time.perf_counter()
    end = start + seconds
    while True:
        run(None, feed)
        count += 1
        now = time.perf_counter()
        if now >= end:
            return count * rows / (now - start)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="digits,wide", help="which of digits,wide,minilm")
    parser.add_argument(
        "--batch-sizes", default="1,2,4,8,16,32", help="rows per run, comma-separated"
    )
    parser.add_argument("--duration", type=float, default=4.0, help="seconds per size per round")
    parser.add_argument("--repeat", type=int, default=2, help="rounds over every size")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    bench_http.add_minilm_options(parser)
    args = parser.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(args.models) - set(bench_http.MODELS))
    if unknown or not args.models:
        parser.error(f"--models: unknown {unknown}; choose from {', '.join(bench_http.MODELS)}")
    try:
        args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    except ValueError:
        parser.error(f"--batch-sizes takes integers, got {args.batch_sizes!r}")
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        parser.error("--batch-sizes must be positive integers")
    if args.duration <= 0 or args.repeat < 1 or args.threads < 1:
        parser.error("--duration must be > 0, --repeat and --threads >= 1")
    # What bench_http.write_repository reads besides the models.
    args.pipeline_depth, args.tune_batch_sizes, args.concurrency = 1, [], [1]
    args.instances = 1
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    bench_batching.THREADS = args.threads
    with tempfile.TemporaryDirectory(prefix="trioinfer-batch-sizes-") as tmp:
        models = bench_http.write_repository(Path(tmp), args, skipped={})
        for name, model in models.items():
            session = make_session(model.work.model, args.threads)
            rows = model.work.rows
            feeds = {
                size: {
                    k: np.concatenate([rows[i % len(rows)][k] for i in range(size)])
                    for k in rows[0]
                }
                for size in args.batch_sizes
            }
            rates: dict[int, list[float]] = {size: [] for size in args.batch_sizes}
            for round_ in range(1, args.repeat + 1):
                for size, feed in feeds.items():
                    rate = rows_per_second(session, feed, size, args.duration)
                    rates[size].append(rate)
                    print(
                        f"  round {round_} {name:<7} batch {size:3d}: {rate:10,.1f} rows/s",
                        flush=True,
                    )
            best = max(statistics.median(r) for r in rates.values())
            print(
                f"\n{name}: raw ONNX Runtime, {args.threads} intra-op thread(s), "
                f"median of {args.repeat} round(s)"
            )
            print(f"{'batch':>6} {'rows/s (each round)':>36} {'x best':>7}")
            for size, values in rates.items():
                each = "/".join(f"{v:,.1f}" for v in values)
                median = statistics.median(values)
                print(f"{size:>6} {f'{median:,.1f} ({each})':>36} {median / best:7.2f}")
            print()
    print(versions())
    return 0


if __name__ == "__main__":
    sys.exit(main())
