#!/usr/bin/env python
"""One gRPC ModelStreamInfer stream with N requests in flight: responses per second.

tritonclient's stream (``start_stream`` / ``async_stream_infer``), closed loop: N
requests are sent, and each response sends the next, for ``--duration`` seconds, so
that N are in flight all along (what ``perf_analyzer --streaming --concurrency-range N``
does). Two models:

  digits  the bundled ONNX model (64 floats in, a label out), dynamic batching
          (max 32 rows, 2 ms): requests in flight together make batches
  wait10  the bundled decoupled ``repeat_int32`` with one element and a 10 ms
          DELAY: a model that waits (I/O, a remote call) rather than computes

With ``--trees A,B`` each tree's ``src`` (and ``plugins``) goes first on the
server's PYTHONPATH, in turns (A, B, A, B, ... ``--repeat`` times), so that two
versions are compared in one run, on one machine's load: e.g. ``main``
exported with ``git archive main | tar -x -C /tmp/base`` against this checkout.

Usage:  .venv/bin/python benchmarks/bench_grpc_stream.py [--trees /tmp/base,.]
            [--in-flight 1,8,64] [--duration 3] [--repeat 2]
"""

from __future__ import annotations

import argparse
import os
import queue
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

import trioinfer

CONFIG_TOML = """\
batcher = "dynamic"
batcher_options = { max_batch_size = 32, max_queue_delay = 0.002 }
instances = [{ device = "cpu", count = 1, threads = 1 }]
"""


def write_repository(root: Path) -> None:
    """digits (dynamic batching) and repeat_int32, from the bundled repository."""
    bundled = trioinfer.example_repository()
    shutil.copytree(bundled / "digits", root / "digits")
    (root / "digits" / "config.toml").write_text(CONFIG_TOML)
    shutil.copytree(bundled / "repeat_int32", root / "repeat_int32")


@contextmanager
def serve(tree: Path, repository: Path) -> Iterator[str]:
    """``trioinfer serve`` from *tree*'s sources; its gRPC address."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(str(tree / p) for p in ("src", "plugins"))
    command = [sys.executable, "-m", "trioinfer", "serve", "--port", "0", "--grpc-port", "0"]
    command += ["--log-level", "warning", "--model-repository", str(repository)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env, cwd="/")
    assert process.stdout is not None
    address = ""
    try:
        for line in process.stdout:
            if match := re.search(r"gRPC on (\S+)", line):
                address = match.group(1)
            if "listening on" in line:
                break
        if not address:
            raise SystemExit(f"the server from {tree} did not start (or serves no gRPC)")
        threading.Thread(target=process.stdout.read, daemon=True).start()
        yield address
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)


def inputs(model: str) -> list[Any]:
    import tritonclient.grpc as grpcclient

    if model == "digits":
        arrays = [("input", np.ones((1, 64), np.float32), "FP32")]
    else:
        arrays = [
            ("IN", np.array([1], np.int32), "INT32"),
            ("DELAY", np.array([10], np.uint32), "UINT32"),
            ("WAIT", np.array([0], np.uint32), "UINT32"),
        ]
    out = []
    for name, array, datatype in arrays:
        out.append(grpcclient.InferInput(name, list(array.shape), datatype))
        out[-1].set_data_from_numpy(array)
    return out


def closed_loop(address: str, model: str, in_flight: int, duration: float) -> float:
    """Responses per second of one stream with *in_flight* requests in flight."""
    import tritonclient.grpc as grpcclient

    name = "digits" if model == "digits" else "repeat_int32"
    request = inputs(model)
    answers: queue.Queue[Any] = queue.Queue()
    with grpcclient.InferenceServerClient(address) as client:
        client.start_stream(callback=lambda result, error: answers.put(error))
        try:
            for i in range(in_flight):  # warm up: one round
                client.async_stream_infer(name, request, request_id=str(i))
            for _ in range(in_flight):
                if (error := answers.get(timeout=60)) is not None:
                    raise SystemExit(f"{model}: {error}")
            done = 0
            start = time.perf_counter()
            for i in range(in_flight):
                client.async_stream_infer(name, request, request_id=str(i))
            while time.perf_counter() - start < duration:
                if (error := answers.get(timeout=60)) is not None:
                    raise SystemExit(f"{model}: {error}")
                done += 1
                client.async_stream_infer(name, request, request_id=str(done))
            elapsed = time.perf_counter() - start
            for _ in range(in_flight):
                answers.get(timeout=60)
        finally:
            client.stop_stream()
    return done / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--trees", default=".", help="comma-separated source trees")
    parser.add_argument("--in-flight", default="1,8,64")
    parser.add_argument("--models", default="digits,wait10")
    parser.add_argument("--duration", type=float, default=3.0)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    trees = [Path(t).resolve() for t in args.trees.split(",")]
    levels = [int(n) for n in args.in_flight.split(",")]
    models = args.models.split(",")
    figures: dict[tuple[str, str, int], list[float]] = {}
    print(f"load average before: {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as tmp:
        repository = Path(tmp) / "repository"
        write_repository(repository)
        for _ in range(args.repeat):
            for tree in trees:
                with serve(tree, repository) as address:
                    for model in models:
                        for n in levels:
                            rate = closed_loop(address, model, n, args.duration)
                            figures.setdefault((str(tree), model, n), []).append(rate)
    print(f"load average after: {os.getloadavg()}")
    print(f"{'tree':<40} {'model':<8} {'in flight':>9} {'responses/s (median)':>22}  runs")
    for (tree, model, n), rates in figures.items():
        runs = " ".join(f"{r:.0f}" for r in rates)
        print(f"{tree:<40} {model:<8} {n:>9} {statistics.median(rates):>22.0f}  {runs}")


if __name__ == "__main__":
    main()
