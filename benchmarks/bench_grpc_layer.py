#!/usr/bin/env python
"""The gRPC layer's CPU per call without a model, its socket faked: Trio and asyncio side by side.

Issue 21. What ``bench_grpc.py`` measures end to end moves by 10-30% between
windows on a busy machine, more than a change of a few microseconds to a
call. This bench takes the socket, the engine and the model out: one
`GrpcServer` connection (``server/_grpc_h2.py`` over ``server/_http2.py``)
is served as ``trioinfer serve`` serves it, on the real event loop, but its
socket is a fake that hands it a client's bytes made beforehand (``--calls``
unary calls, ``--per-read`` of them per read: HEADERS and one DATA frame each,
the headers as a client's hpack repeats them) and takes whatever it sends. The
handler answers a digits-sized request with a fixed digits-sized answer after
one checkpoint (as a handler that waits for the engine gives the loop a
turn). What is left is the layer's own per-call work: frames in, the call's
task and scope, the answer's frames out, the writer.

Printed: process CPU µs per call (the median of ``--rounds`` rounds, their
minimum, each round), on Trio and on asyncio (``--loops``), each in a
subprocess of its own, ``--tree LABEL=PATH`` (``PATH/src`` first on the
path) for each source tree to compare, the trees alternating.

Usage:  .venv/bin/python benchmarks/bench_grpc_layer.py [--calls 20000] [--rounds 5]
        [--tree main=/tmp/main --tree here=.]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

_CHILD = r"""
import struct, sys, time
import anyio, anyio.abc, anyio.lowlevel, hpack
from trioinfer.server import _grpc_h2, _http2

loop, calls, per_read, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
PATH = "/inference.GRPCInferenceService/ModelInfer"
HEAD = struct.Struct(">BHBBL")
REQUEST = bytes(range(256)) + b"\x00" * 64  # about a digits request (64 floats and names)
ANSWER = b"\x01" * 96  # about a digits answer (10 floats and names)


def frame(kind, flags, stream_id, payload):
    n = len(payload)
    return HEAD.pack(n >> 16, n & 0xFFFF, kind, flags, stream_id) + payload


def client_reads():
    encoder = hpack.Encoder()
    headers = [
        (":method", "POST"), (":scheme", "http"), (":path", PATH),
        (":authority", "127.0.0.1"), ("content-type", "application/grpc"), ("te", "trailers"),
    ]
    first, block = encoder.encode(headers), encoder.encode(headers)
    body = struct.pack(">BI", 0, len(REQUEST)) + REQUEST
    preface = _http2.PREFACE + frame(0x4, 0, 0, b"") + frame(0x8, 0, 0, struct.pack(">I", 1 << 30))
    reads, pending = [preface], []
    for i in range(calls):
        sid = 2 * i + 1
        pending.append(frame(0x1, 0x4, sid, first if i == 0 else block))
        pending.append(frame(0x0, 0x1, sid, body))
        if len(pending) >= 2 * per_read:
            reads.append(b"".join(pending))
            pending = []
    if pending:
        reads.append(b"".join(pending))
    return reads


class Socket:
    # What the connection needs of an anyio SocketStream: receive, send, aclose, extra.
    def __init__(self, reads, answered):
        self.reads, self.answered, self.sent = iter(reads), answered, 0

    async def receive(self, max_bytes=65536):
        await anyio.lowlevel.checkpoint()
        data = next(self.reads, None)
        if data is not None:
            return data
        while self.answered[0] < calls:  # every call answered, then the client leaves
            await anyio.lowlevel.checkpoint()
        for _ in range(8):
            await anyio.lowlevel.checkpoint()
        raise anyio.EndOfStream

    async def send(self, data):
        self.sent += len(data)
        await anyio.lowlevel.checkpoint()

    async def aclose(self):
        pass

    def extra(self, attribute, default=None):
        return default


async def one_round():
    answered = [0]

    async def handler(raw, call):
        await anyio.lowlevel.checkpoint()
        answered[0] += 1
        return ANSWER

    method = _grpc_h2.Method(handler, streaming=False)
    server = _grpc_h2.GrpcServer({PATH: method}, 1 << 20, head_timeout=60.0)
    socket = Socket(client_reads(), answered)
    t0 = time.process_time()
    await server.connection(socket)
    elapsed = time.process_time() - t0
    assert answered[0] == calls, answered
    assert socket.sent > calls * len(ANSWER), socket.sent
    return elapsed / calls * 1e6


def main():
    times = []
    for _ in range(rounds):
        if loop == "trio":
            import trio
            times.append(trio.run(one_round))
        else:
            import asyncio
            times.append(asyncio.run(one_round()))
    print(" ".join("%.2f" % t for t in times))


if "--profile" in sys.argv:
    import cProfile, pstats
    cProfile.run("main()", "/tmp/grpc_layer.prof")
    pstats.Stats("/tmp/grpc_layer.prof").sort_stats("tottime").print_stats(30)
else:
    main()
"""


def run_child(path: Path, loop: str, args: argparse.Namespace) -> list[float]:
    if not (path / "src" / "trioinfer").is_dir():
        # Else the installed trioinfer would be measured under this tree's name.
        raise SystemExit(f"{path} has no src/trioinfer")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(path / "src"), str(path)]))
    argv = [sys.executable, "-c", _CHILD, loop, str(args.calls), str(args.per_read), "1"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the {loop} child failed:\n{done.stderr}")
    return [float(t) for t in done.stdout.split()]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--per-read", type=int, default=16, help="calls per read (16: C=64 on 4)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--loops", default="trio,asyncio")
    parser.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="LABEL=PATH",
        help="a source tree to measure (repeatable); by default this script's own",
    )
    args = parser.parse_args()
    here = Path(__file__).resolve().parent.parent
    trees = [tuple(t.split("=", 1)) for t in args.tree] or [("here", str(here))]
    loops = args.loops.split(",")
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):  # the trees and loops alternate, round by round
        for label, path in trees:
            for loop in loops:
                times.setdefault((label, loop), []).extend(
                    run_child(Path(path).resolve(), loop, args)
                )
    print(f"gRPC layer, CPU us/call ({args.calls} calls, {args.per_read} per read)")
    print(f"{'tree':<10}{'loop':<9}{'median':>8}{'min':>8}  each round")
    for (label, loop), each in times.items():
        rounds = " ".join(f"{t:.2f}" for t in each)
        print(
            f"{label:<10}{loop:<9}{statistics.median(each):>8.2f}{min(each):>8.2f}  {rounds}",
            flush=True,
        )


if __name__ == "__main__":
    main()
