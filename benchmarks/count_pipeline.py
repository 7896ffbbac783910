"""Run one ``bench_pipeline.py`` arm for a fixed number of requests: for instruction counts.

On a loaded shared machine wall time and even CPU time per request move by more
than the engine's own cost; the instructions a request executes do not. Run this
under cachegrind twice, at two request counts, and divide the difference::

    PYTHONHASHSEED=0 VIRTUAL_RUN_US=300 valgrind --tool=cachegrind --cache-sim=no \\
        python benchmarks/count_pipeline.py 200 --arms pipeline --dispatch inline
    # ... and again with 2200; (I refs at 2200 - I refs at 200) / 2000 per request

The arguments after the count are ``bench_pipeline.py``'s (``--arms`` names one
arm; C client tasks as there). ``VIRTUAL_RUN_US=V`` replaces the wall clock of
the event loop's inline slice with one that each ONNX Runtime run moves on by V
microseconds and nothing else moves: under valgrind every run is some fifty
times slower, so with the real clock every step would find the slice spent.
V=300 gives the regime of a step of a few hundred microseconds (``--hidden
2048``: the slice spent once a request, after the ONNX step), V=6 the digits
model's (seldom spent).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import trio

import trioinfer
import trioinfer._inline

sys.path.insert(0, str(Path(__file__).parent))
import bench_pipeline


def main() -> None:
    requests = int(sys.argv[1])
    sys.argv = [sys.argv[0], *sys.argv[2:]]

    async def closed_loop(call: Any, args: Any) -> tuple[float, float]:
        images = trioinfer.digits_samples()[0].reshape(-1, 8, 8).astype(np.uint8)
        done = 0

        async def client(i: int) -> None:
            nonlocal done
            while done < requests:
                await call(images[(i + done) % len(images)][np.newaxis])
                done += 1

        async with trio.open_nursery() as nursery:
            for i in range(args.concurrency):
                nursery.start_soon(client, i)
        return 0.0, 0.0

    bench_pipeline.closed_loop = closed_loop  # type: ignore[assignment]
    if os.environ.get("VIRTUAL_RUN_US"):
        from onnxruntime.capi import onnxruntime_inference_collection as ort_session

        step = float(os.environ["VIRTUAL_RUN_US"]) * 1e-6
        clock = [1000.0]
        trioinfer._inline._wall = lambda: clock[0]  # type: ignore[assignment]
        run = ort_session.Session.run

        def timed_run(self: Any, *args: Any, **kwargs: Any) -> Any:
            clock[0] += step
            return run(self, *args, **kwargs)

        ort_session.Session.run = timed_run  # type: ignore[method-assign]
    bench_pipeline.main()


if __name__ == "__main__":
    main()
