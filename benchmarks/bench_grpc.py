#!/usr/bin/env python
"""V2 gRPC beside V2 HTTP with binary tensors, from one ``trioinfer serve``, in one run.

Issue 21. Two parts:

1. One call at a time, per call on loopback: a sync grpcio client sends
   ``ModelReady`` (``--calls`` times) and the p50/p99 of each is printed, for

     trioinfer     trioinfer's endpoint on Trio (gRPC over h2 on serve's own loop, the
                   call a task that looks the model up): what serve runs by default
     trioinfer-aio the same under asyncio (serve --loop asyncio)
     aio-native    a bare grpc.aio server on asyncio answering in its handler (grpcio's
                   own floor; serve used grpc.aio before h2)
     threads-only  grpcio's threaded server answering on its worker thread: the
                   floor of the threaded server, no event loop involved

2. Inference at ``--concurrency`` (default 64) on the models of
   ``bench_http.py`` (digits, wide; the same config.toml: dynamic batching,
   max 32, 5 ms), one server process serving both protocols: ``trioinfer bench``
   closed loop, once with ``--encoding binary`` over HTTP and once with
   ``--protocol grpc`` (raw tensor contents), interleaved ``--repeat`` times.
   Both clients are trioinfer bench (epoll loops over raw sockets in a thread:
   HTTP/1.1, and a minimal HTTP/2 for gRPC; ``--grpc-clients raw,aio`` adds
   grpcio's grpc.aio client as row ``grpc-aio``); each reports its own CPU
   per request, printed beside the server's (from ``/proc/<pid>/stat`` around
   the whole bench call, warm-up included, over the requests the measured
   window completed scaled by (warm-up + window) / window), since on a small
   machine the client shares the cores with the server. ``loop us/req`` is the
   server's main thread alone (the event loop: the protocols' own work, not the
   model's compute on its instance thread), and ``rows/batch`` the mean rows per
   execution over the same span (``trioinfer_inference_batch_rows`` from
   ``/metrics``): with the model's compute the same, these say whether a
   difference in req/s came from the protocol's CPU or from the batches.

Usage:  .venv/bin/python benchmarks/bench_grpc.py [--duration 5] [--repeat 2] [--no-bridge]
        [--pin 0:1] [--grpc-clients raw,aio]

To compare with another tree, run the same script with that tree's ``src``
first on ``PYTHONPATH`` (serve and bench are started as ``python -m trioinfer``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import bench_http  # the same repository and model configs as the HTTP benchmark


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="digits,wide")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per window")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--calls", type=int, default=2000, help="calls per bridge variant")
    parser.add_argument("--server-args", default="")
    parser.add_argument("--no-bridge", action="store_true", help="skip part 1 (one call at a time)")
    parser.add_argument(
        "--grpc-clients",
        default="raw",
        metavar="raw,aio",
        help="part 2's gRPC load clients (trioinfer bench --grpc-client), one row each: raw "
        "(the lean one, row 'grpc') and/or aio (grpcio's grpc.aio, row 'grpc-aio')",
    )
    parser.add_argument(
        "--pin",
        default="",
        metavar="SERVER:CLIENT",
        help="pin part 2's server and clients to these CPUs with taskset (e.g. 0:1), so that "
        "a client's own cost per request does not take the server's core",
    )
    args = parser.parse_args(argv)
    args.models = args.models.split(",")
    args.grpc_clients = args.grpc_clients.split(",")
    if not set(args.grpc_clients) <= {"raw", "aio"}:
        parser.error(f"--grpc-clients takes raw and/or aio, got {','.join(args.grpc_clients)}")
    server, _, client = args.pin.partition(":")
    args.server_prefix = ["taskset", "-c", server] if server else []
    args.client_prefix = ["taskset", "-c", client] if client else []
    return args


# -- part 1: the bridge ---------------------------------------------------------------


def _live_p50(address: str, calls: int) -> tuple[float, float]:
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = service_pb2.ModelReadyRequest(name="none")
        for _ in range(200):
            stub.ModelReady(request)
        times = []
        for _ in range(calls):
            start = time.perf_counter_ns()
            stub.ModelReady(request)
            times.append(time.perf_counter_ns() - start)
    times.sort()
    return times[len(times) // 2] / 1e6, times[int(len(times) * 0.99)] / 1e6


def bridge_trioinfer(calls: int, backend: str = "trio") -> tuple[float, float]:
    import functools

    import anyio

    from trioinfer.server import serve_http

    result: list[tuple[float, float]] = []

    async def main() -> None:
        stop = anyio.Event()
        with tempfile.TemporaryDirectory() as repo:
            async with anyio.create_task_group() as group:
                listening = await group.start(
                    functools.partial(
                        serve_http, repo, port=0, grpc_port=0, handle_signals=False, shutdown=stop
                    )
                )
                result.append(await anyio.to_thread.run_sync(_live_p50, listening.grpc, calls))
                stop.set()

    anyio.run(main, backend=backend)
    return result[0]


def bridge_trioinfer_asyncio(calls: int) -> tuple[float, float]:
    return bridge_trioinfer(calls, "asyncio")


def _live_handler(grpc: Any) -> Any:
    from tritonclient.grpc import service_pb2

    answer = service_pb2.ModelReadyResponse(ready=False).SerializeToString()
    return grpc.method_handlers_generic_handler(
        "inference.GRPCInferenceService",
        {"ModelReady": grpc.unary_unary_rpc_method_handler(lambda _req, _ctx: answer)},
    )


def bridge_aio_native(calls: int) -> tuple[float, float]:
    import asyncio

    import grpc
    from tritonclient.grpc import service_pb2

    answer = service_pb2.ModelReadyResponse(ready=False).SerializeToString()

    async def live(_request: bytes, _context: Any) -> bytes:
        return answer

    handler = grpc.method_handlers_generic_handler(
        "inference.GRPCInferenceService",
        {"ModelReady": grpc.unary_unary_rpc_method_handler(live)},
    )

    async def main() -> tuple[float, float]:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            return await asyncio.to_thread(_live_p50, f"127.0.0.1:{port}", calls)
        finally:
            await server.stop(0)

    return asyncio.run(main())


def bridge_threads_only(calls: int) -> tuple[float, float]:
    import grpc

    server = grpc.server(ThreadPoolExecutor(max_workers=8))
    server.add_generic_rpc_handlers((_live_handler(grpc),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        return _live_p50(f"127.0.0.1:{port}", calls)
    finally:
        server.stop(0)


# -- part 2: inference -----------------------------------------------------------------


@contextmanager
def serve(
    repository: Path, extra: str, prefix: Sequence[str] = ()
) -> Iterator[tuple[str, str, int]]:
    command = [*prefix, sys.executable, "-m", "trioinfer", "serve", "--port", "0", "--log-level"]
    command += ["warning", "--model-repository", str(repository), *shlex.split(extra)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    grpc_address = url = ""
    try:
        for line in process.stdout:
            if match := re.search(r"gRPC on (\S+)", line):
                grpc_address = match.group(1)
            if match := re.search(r"listening on (\S+)", line):
                url = match.group(1)
                break
        if not (url and grpc_address):
            raise SystemExit("the server did not start (or serves no gRPC)")
        threading.Thread(target=process.stdout.read, daemon=True).start()
        yield url, grpc_address, process.pid
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)


def cpu_s(pid: int, thread: bool = False) -> float:
    # The process's CPU time (all threads), or its main thread's: serve's event loop.
    stat = f"/proc/{pid}/task/{pid}/stat" if thread else f"/proc/{pid}/stat"
    fields = Path(stat).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def batch_rows(url: str, model: str) -> tuple[float, float]:
    """The server's ``trioinfer_inference_batch_rows`` sum and count for *model*."""
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    found = {"sum": 0.0, "count": 0.0}
    for line in text.splitlines():
        match = re.match(r"trioinfer_inference_batch_rows_(sum|count)\{(.*)\} (\S+)", line)
        if match and f'model="{model}"' in match.group(2):
            found[match.group(1)] += float(match.group(3))
    return found["sum"], found["count"]


def bench(
    target: list[str], model: str, args: argparse.Namespace, pid: int, url: str
) -> dict[str, Any]:
    rows_before = batch_rows(url, model)
    before, loop_before = cpu_s(pid), cpu_s(pid, thread=True)
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run(
            [
                *args.client_prefix,
                sys.executable,
                "-m",
                "trioinfer",
                "bench",
                *target,
                "-m",
                model,
                "--concurrency",
                str(args.concurrency),
                "--warmup",
                str(args.warmup),
                "--window",
                str(args.duration),
                "--windows",
                "1",
                "--json",
                out.name,
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        result: dict[str, Any] = json.loads(Path(out.name).read_text())["results"][0]
    requests = result["completed"] * (args.warmup + args.duration) / args.duration
    result["server_us_per_request"] = (cpu_s(pid) - before) / max(requests, 1) * 1e6
    result["loop_us_per_request"] = (cpu_s(pid, True) - loop_before) / max(requests, 1) * 1e6
    rows_after = batch_rows(url, model)
    executions = rows_after[1] - rows_before[1]
    # Warm-up included: rows per execution over the whole bench call.
    result["rows_per_batch"] = (rows_after[0] - rows_before[0]) / max(executions, 1)
    return result


def main() -> None:
    args = parse_args()
    if not args.no_bridge:
        print("part 1: ModelReady, one call at a time on loopback (ms)", flush=True)
        print(f"{'bridge':<15}{'p50':>8}{'p99':>8}")
        for name, fn in (
            ("trioinfer", bridge_trioinfer),
            ("trioinfer-aio", bridge_trioinfer_asyncio),
            ("aio-native", bridge_aio_native),
            ("threads-only", bridge_threads_only),
        ):
            p50, p99 = fn(args.calls)
            print(f"{name:<15}{p50:>8.3f}{p99:>8.3f}", flush=True)

    http_args = bench_http.parse_args(["--models", ",".join(args.models)])
    rows: dict[tuple[str, str], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        bench_http.write_repository(Path(tmp), http_args, skipped={})
        with serve(Path(tmp), args.server_args, args.server_prefix) as (url, address, pid):
            for _ in range(args.repeat):
                for model in args.models:
                    grpc_target = ["--protocol", "grpc", "--url", f"grpc://{address}"]
                    for protocol, target in (
                        ("http-binary", ["--url", url, "--encoding", "binary"]),
                        *(
                            (
                                "grpc" if client == "raw" else f"grpc-{client}",
                                [*grpc_target, "--grpc-client", client],
                            )
                            for client in args.grpc_clients
                        ),
                    ):
                        rows.setdefault((model, protocol), []).append(
                            bench(target, model, args, pid, url)
                        )
    print(f"\npart 2: inference at C={args.concurrency}, median of {args.repeat} windows")
    print(
        f"{'model':<8}{'protocol':<13}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}"
        f"{'errors':>8}{'server us/req':>15}{'loop us/req':>13}{'client us/req':>15}"
        f"{'rows/batch':>12}"
    )
    for (model, protocol), results in rows.items():
        med = {
            k: statistics.median(r[k] for r in results)
            for k in results[0]
            if k != "load" and isinstance(results[0][k], int | float)
        }
        print(
            f"{model:<8}{protocol:<13}{med['throughput']:>9.0f}{med['p50_ms']:>9.2f}"
            f"{med['p99_ms']:>9.2f}{med['errors']:>8.0f}{med['server_us_per_request']:>15.0f}"
            f"{med['loop_us_per_request']:>13.0f}{med['cpu_us_per_request']:>15.0f}"
            f"{med['rows_per_batch']:>12.1f}"
        )
        if len(results) > 1:
            each = " / ".join(
                f"{r['throughput']:.0f} {r['server_us_per_request']:.0f} "
                f"{r['loop_us_per_request']:.0f}"
                for r in results
            )
            print(f"{'':<21}each window (req/s, server us, loop us): {each}")


if __name__ == "__main__":
    main()
