"""Small streamed responses per second, one stream at a time, side by side in one run.

The model is the bundled ``repeat_int32`` (a decoupled Python model): one request
with IN of N elements and no delays gets N responses of two one-element tensors.
Ways, each a stream of N responses read to its end, repeated for --duration s:

  generator     the model's own ``infer`` generator iterated directly: the ceiling
                (no engine, no checks, no task hand-over)
  engine/trio   ``engine.infer_stream`` on Trio (each response checked against the
                signature and handed from the model's task to the reader's)
  engine/trio deadline  the same under a deadline (an hour away): the reader reads the
                clock against it for each response
  engine/asyncio  the same on asyncio (anyio)
  sse           ``POST /v2/models/repeat_int32/generate_stream`` on one keep-alive
                connection to the lean HTTP server in this process, read by a bare
                socket client that counts the ``data:`` events (JSON encoding,
                chunked framing and a socket write per response included)
  grpc          ``ModelStreamInfer`` on one HTTP/2 connection to the gRPC server of
                the same lean server, one call per stream, read by a bare client
                (frames parsed by hand, no h2 or grpcio) that counts the messages
                (protobuf encoding, gRPC and HTTP/2 framing, socket writes included)

Each way prints responses/s and the process's CPU µs per response (the client's
share included: small for the bare clients, none for the others' readers). CPU
time moves less than rates on a busy machine: to compare two source trees, run
this script once per tree with that tree's ``src`` first on PYTHONPATH, in turns
(``--ways sse,grpc`` keeps it short).

With --tracing, two more ways: ``engine/trio`` and ``sse`` with OpenTelemetry
tracing on at 1 in 1000 (an SDK tracer provider with no exporter: the spans of
a sampled stream are made and dropped), beside the same ways with tracing off.

Usage:  .venv/bin/python benchmarks/bench_streaming.py [--responses 1000] [--duration 3]
                [--rounds 3] [--tracing] [--ways generator,engine/trio,...]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import platform
import statistics
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import hpack
import numpy as np
import trio

import trioinfer
from trioinfer.server import ServerConfig, serve_http
from trioinfer.server import _grpc_proto as pb

REPO = trioinfer.example_repository()


def inputs(n: int) -> dict[str, np.ndarray[Any, Any]]:
    return {
        "IN": np.arange(n, dtype=np.int32),
        "DELAY": np.zeros(n, np.uint32),
        "WAIT": np.zeros(1, np.uint32),
    }


#: A way's figures: responses per second, the process's CPU µs per response.
Figures = tuple[float, float]


async def rate(run_one: Callable[[], Awaitable[int]], duration: float) -> Figures:
    """Responses per second, and CPU µs per response, over streams run back to back."""
    await run_one()  # warm up
    done, start, cpu = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - start < duration:
        done += await run_one()
    return done / (time.perf_counter() - start), (time.process_time() - cpu) / done * 1e6


async def generator(args: argparse.Namespace) -> Figures:
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


async def engine(args: argparse.Namespace, traced: bool = False, deadline: bool = False) -> Figures:
    config = trioinfer.ModelConfig.from_toml(REPO / "repeat_int32" / "config.toml")
    request = inputs(args.responses)
    async with trioinfer.open_engine(**tracing(traced)) as engine:
        await engine.load(config)

        async def run_one() -> int:
            count = 0
            # *deadline*: under one an hour away, which the reader checks per response.
            with anyio.move_on_after(3600 if deadline else math.inf):
                async with engine.infer_stream("repeat_int32", request) as responses:
                    async for _ in responses:
                        count += 1
            return count

        return await rate(run_one, args.duration)


async def sse(args: argparse.Namespace, traced: bool = False) -> Figures:
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


_FRAME = struct.Struct(">BHBBL")
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_BIG_WINDOW = (1 << 31) - 1


def _frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    n = len(payload)
    return _FRAME.pack(n >> 16, n & 0xFFFF, kind, flags, stream_id) + payload


def stream_request(n: int) -> bytes:
    """The ModelStreamInfer message of one request for *n* responses, with its gRPC prefix."""
    request = pb.ModelInferRequest(model_name="repeat_int32", id="bench")
    for name, datatype, shape in (
        ("IN", "INT32", n),
        ("DELAY", "UINT32", n),
        ("WAIT", "UINT32", 1),
    ):
        tensor = request.inputs.add()
        tensor.name, tensor.datatype = name, datatype
        tensor.shape.append(shape)
    for array in inputs(n).values():
        request.raw_input_contents.append(array.tobytes())
    data = request.SerializeToString()
    return struct.pack(">BI", 0, len(data)) + data


async def grpc(args: argparse.Namespace) -> Figures:
    n = args.responses
    message = stream_request(n)
    encoder = hpack.Encoder()
    headers = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/inference.GRPCInferenceService/ModelStreamInfer"),
        (":authority", "bench"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]
    async with trio.open_nursery() as nursery:
        listening = await nursery.start(
            lambda task_status: serve_http(
                REPO,
                host="127.0.0.1",
                port=0,
                grpc_port=0,
                handle_signals=False,
                task_status=task_status,
            )
        )
        host, port = listening.grpc.rsplit(":", 1)
        async with await trio.open_tcp_stream(host, int(port)) as sock:
            # Windows as large as HTTP/2 allows: the client never holds the server back.
            settings = struct.pack(">HI", 4, _BIG_WINDOW)
            await sock.send_all(
                _PREFACE
                + _frame(4, 0, 0, settings)
                + _frame(8, 0, 0, struct.pack(">I", _BIG_WINDOW - 65535))
            )
            stream_id = -1
            buffer = bytearray()

            async def run_one() -> int:
                nonlocal stream_id, buffer
                stream_id += 2
                await sock.send_all(
                    _frame(1, 4, stream_id, encoder.encode(headers))
                    + _frame(0, 1, stream_id, message)
                )
                body, received, ended = bytearray(), 0, False
                while not ended:
                    buffer += await sock.receive_some(1 << 20)
                    pos = 0
                    while len(buffer) - pos >= 9:
                        high, low, kind, flags, sid = _FRAME.unpack_from(buffer, pos)
                        size = high << 16 | low
                        if len(buffer) - pos - 9 < size:
                            break
                        payload = buffer[pos + 9 : pos + 9 + size]
                        pos += 9 + size
                        if kind == 0:
                            body += payload
                            received += size
                        elif kind == 4 and not flags & 1:
                            await sock.send_all(_frame(4, 1, 0, b""))
                        ended = ended or (sid == stream_id and kind == 1 and bool(flags & 1))
                    del buffer[:pos]
                # The connection's window back (each stream has a large one of its own).
                await sock.send_all(_frame(8, 0, 0, struct.pack(">I", received)))
                count = at = 0
                while at < len(body):
                    at += 5 + int.from_bytes(body[at + 1 : at + 5], "big")
                    count += 1
                assert count == n, (count, bytes(body[-200:]))
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
    parser.add_argument("--ways", default="", help="comma-separated ways to run (default: all)")
    args = parser.parse_args()
    ways: dict[str, Callable[[], Figures]] = {
        "generator": lambda: trio.run(generator, args),
        "engine/trio": lambda: trio.run(engine, args),
        "engine/trio deadline": lambda: trio.run(engine, args, False, True),
        "engine/asyncio": lambda: anyio.run(engine, args, backend="asyncio"),
        "sse": lambda: trio.run(sse, args),
        "grpc": lambda: trio.run(grpc, args),
    }
    if args.tracing:
        ways["engine/trio 1e-3"] = lambda: trio.run(engine, args, True)
        ways["sse 1e-3"] = lambda: trio.run(sse, args, True)
    if args.ways:
        wanted = args.ways.split(",")
        if unknown := set(wanted) - set(ways):
            parser.error(f"unknown ways {sorted(unknown)}; the ways are {', '.join(ways)}")
        ways = {name: ways[name] for name in wanted}
    print(
        f"python {platform.python_version()}, trio {trio.__version__}, anyio "
        f"{importlib.metadata.version('anyio')}, trioinfer {trioinfer.__version__}; "
        f"{args.responses} responses per stream, {args.duration:g} s x {args.rounds} rounds"
    )
    figures: dict[str, list[Figures]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, way in ways.items():  # interleaved, so that a busy spell hits every way
            figures[name].append(way())
    print(
        f"{'way':<21}{'responses/s (median)':>22}{'CPU µs/response (median)':>26}"
        f"{'rounds (responses/s, µs)':>36}"
    )
    for name, values in figures.items():
        rate_median = statistics.median(v[0] for v in values)
        cpu_median = statistics.median(v[1] for v in values)
        rounds = ", ".join(f"{r:,.0f} {c:.1f}" for r, c in values)
        print(f"{name:<21}{rate_median:>22,.0f}{cpu_median:>26.1f}    {rounds}")


if __name__ == "__main__":
    main()
