"""Small streamed responses per second, one stream at a time, side by side in one run.

The model is the bundled ``repeat_int32`` (a decoupled Python model): one request
with IN of N elements and no delays gets N responses of two one-element tensors.
Ways, each a stream of N responses read to its end, repeated for --duration s:

  generator     the model's own ``infer`` generator iterated directly: the ceiling
                (no engine, no checks, no task hand-over)
  engine/trio   ``engine.infer_stream`` on Trio (each response checked against the
                signature and handed from the model's task to the reader's)
  engine/asyncio  the same on asyncio (anyio)
  sse           ``POST /v2/models/repeat_int32/generate_stream`` on one keep-alive
                connection to the lean HTTP server in this process, read by a bare
                socket client that counts the ``data:`` events (JSON encoding,
                chunked framing and a socket write per response included)

With --tracing, two more ways: ``engine/trio`` and ``sse`` with OpenTelemetry
tracing on at 1 in 1000 (an SDK tracer provider with no exporter: the spans of
a sampled stream are made and dropped), beside the same ways with tracing off.

Usage:  .venv/bin/python benchmarks/bench_streaming.py [--responses 1000] [--duration 3]
                [--rounds 3] [--tracing]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import platform
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import numpy as np
import trio

import trioinfer
from trioinfer.server import ServerConfig, serve_http

REPO = trioinfer.example_repository()


def inputs(n: int) -> dict[str, np.ndarray[Any, Any]]:
    return {
        "IN": np.arange(n, dtype=np.int32),
        "DELAY": np.zeros(n, np.uint32),
        "WAIT": np.zeros(1, np.uint32),
    }


async def rate(run_one: Callable[[], Awaitable[int]], duration: float) -> float:
    """Responses per second over streams run back to back for *duration* seconds."""
    await run_one()  # warm up
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < duration:
        done += await run_one()
    return done / (time.perf_counter() - start)


async def generator(args: argparse.Namespace) -> float:
    spec = importlib.util.spec_from_file_location("bench_repeat", REPO / "repeat_int32/1/model.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model, request = module.Model(), inputs(args.responses)

    async def run_one() -> int:
        count = 0
        async for _ in model.infer(request):
            count += 1
        return count

    return await rate(run_one, args.duration)


def tracing(on: bool) -> dict[str, Any]:
    """``open_engine``'s tracing arguments: off, or on at 1 in 1000."""
    if not on:
        return {}
    from opentelemetry.sdk.trace import TracerProvider

    return {"tracer_provider": TracerProvider(), "trace_rate": 0.001}


async def engine(args: argparse.Namespace, traced: bool = False) -> float:
    config = trioinfer.ModelConfig.from_toml(REPO / "repeat_int32" / "config.toml")
    request = inputs(args.responses)
    async with trioinfer.open_engine(**tracing(traced)) as engine:
        await engine.load(config)

        async def run_one() -> int:
            count = 0
            async with engine.infer_stream("repeat_int32", request) as responses:
                async for _ in responses:
                    count += 1
            return count

        return await rate(run_one, args.duration)


async def sse(args: argparse.Namespace, traced: bool = False) -> float:
    n = args.responses
    body = json.dumps({"IN": list(range(n)), "DELAY": [0] * n, "WAIT": 0}).encode()
    request = (
        b"POST /v2/models/repeat_int32/generate_stream HTTP/1.1\r\nhost: bench\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body)
    )
    async with trio.open_nursery() as nursery:
        listening = await nursery.start(
            lambda task_status: serve_http(
                REPO,
                host="127.0.0.1",
                port=0,
                config=ServerConfig(**tracing(traced)),
                handle_signals=False,
                task_status=task_status,
            )
        )
        host, port = listening.urls[0].removeprefix("http://").rsplit(":", 1)
        async with await trio.open_tcp_stream(host, int(port)) as sock:

            async def run_one() -> int:
                await sock.send_all(request)
                data = b""
                while not data.endswith(b"\r\n0\r\n\r\n"):
                    data += await sock.receive_some(1 << 20)
                count = data.count(b"data: ")
                assert count == n, (count, data[-200:])
                return count

            result = await rate(run_one, args.duration)
        nursery.cancel_scope.cancel()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--responses", type=int, default=1000, help="responses per stream")
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every way")
    parser.add_argument(
        "--tracing", action="store_true", help="also engine/trio and sse traced at 1 in 1000"
    )
    args = parser.parse_args()
    ways: dict[str, Callable[[], float]] = {
        "generator": lambda: trio.run(generator, args),
        "engine/trio": lambda: trio.run(engine, args),
        "engine/asyncio": lambda: anyio.run(engine, args, backend="asyncio"),
        "sse": lambda: trio.run(sse, args),
    }
    if args.tracing:
        ways["engine/trio 1e-3"] = lambda: trio.run(engine, args, True)
        ways["sse 1e-3"] = lambda: trio.run(sse, args, True)
    print(
        f"python {platform.python_version()}, trio {trio.__version__}, anyio "
        f"{importlib.metadata.version('anyio')}, trioinfer {trioinfer.__version__}; "
        f"{args.responses} responses per stream, {args.duration:g} s x {args.rounds} rounds"
    )
    rates: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, way in ways.items():  # interleaved, so that a busy spell hits every way
            rates[name].append(way())
    ceiling = statistics.median(rates["generator"])
    print(f"{'way':<16}{'responses/s (median)':>22}{'rounds':>30}{'x generator':>13}")
    for name, values in rates.items():
        median = statistics.median(values)
        rounds = ", ".join(f"{v:,.0f}" for v in values)
        print(f"{name:<16}{median:>22,.0f}{rounds:>30}{median / ceiling:>13.3f}")


if __name__ == "__main__":
    main()
