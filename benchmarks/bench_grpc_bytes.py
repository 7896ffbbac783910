#!/usr/bin/env python
"""The gRPC server's byte path per call, in-process: frames in, messages cut, answers framed out.

Issue 21 (wide tensors): what the transport (``server/_http2.py`` and
``server/_grpc_h2.py``) and the request/answer bytes (``server/_grpc.py``'s
``_wire_split`` and ``_response_bytes``) cost per call at a model's request
and answer sizes, without sockets, the engine or the event loop's scheduling
of calls (each call's handler is run inline): what per-byte work a wide
request adds to a digits one.

For each size: a client's bytes for ``--calls`` unary calls, ``--per-read``
of them per read (HEADERS and one DATA frame each, as trioinfer bench's and
grpcio's clients send a message that fits a frame; ``--frame`` cuts each
message into DATA frames of that size instead), are made beforehand; then
timed: each read fed to one ``_Connection`` (``_event`` for each event), each
call's message split (``_wire_split``), answered (``_response_bytes`` of an
output row, then headers, the message, trailers) and its stream forgotten,
and the connection's bytes to send taken out, as its writer does.

Usage:  .venv/bin/python benchmarks/bench_grpc_bytes.py [--calls 8000] [--rounds 5]

To compare with another tree, run the same script with that tree's ``src``
first on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import statistics
import struct
import time
import types
from typing import Any

import hpack
import numpy as np
import trio

from trioinfer.server import _grpc, _grpc_h2, _http2

#: (name, input floats, output floats): digits (64 -> 10) and wide (1024 -> 1000).
SIZES = {"digits": (64, 10), "wide": (1024, 1000)}
PATH = "/inference.GRPCInferenceService/ModelInfer"
HEAD = struct.Struct(">BHBBL")


def frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    n = len(payload)
    return HEAD.pack(n >> 16, n & 0xFFFF, kind, flags, stream_id) + payload


def request_message(model: str, width: int) -> bytes:
    request = _grpc.pb.ModelInferRequest(model_name=model)
    tensor = request.inputs.add()
    tensor.name, tensor.datatype = "input", "FP32"
    tensor.shape.extend([1, width])
    request.raw_input_contents.append(np.ones(width, np.float32).tobytes())
    data: bytes = request.SerializeToString()
    return data


def client_reads(message: bytes, calls: int, per_read: int, frame_size: int) -> list[bytes]:
    # As a client's hpack does: the headers enter its table on the first call, and
    # every later call's block is the same table indexes.
    encoder = hpack.Encoder()
    headers = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", PATH),
        (":authority", "127.0.0.1"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]
    first, block = encoder.encode(headers), encoder.encode(headers)
    body = struct.pack(">BI", 0, len(message)) + message
    chunks = [body[i : i + frame_size] for i in range(0, len(body), frame_size)]
    preface = _http2.PREFACE + frame(0x4, 0, 0, b"") + frame(0x8, 0, 0, struct.pack(">I", 1 << 30))
    reads, sid, pending = [preface], 1, []
    for _ in range(calls):
        pending.append(frame(0x1, 0x4, sid, first if sid == 1 else block))
        for i, chunk in enumerate(chunks):
            pending.append(frame(0x0, 0x1 if i == len(chunks) - 1 else 0, sid, chunk))
        sid += 2
        if len(pending) >= per_read * (1 + len(chunks)):
            reads.append(b"".join(pending))
            pending = []
    if pending:
        reads.append(b"".join(pending))
    return reads


async def one_round(args: argparse.Namespace, model: str) -> float:
    width, outputs = SIZES[model]
    message = request_message(model, width)
    reads = client_reads(message, args.calls, args.per_read, args.frame)
    row = np.ones((32, outputs), np.float32)
    started: list[Any] = []
    method = _grpc_h2.Method(handler=None, streaming=False)  # type: ignore[arg-type]
    server = types.SimpleNamespace(max_buffered=1 << 26)
    # No socket: the connection only asks it for its raw socket (none here).
    socket = types.SimpleNamespace(extra=lambda attribute, default=None: default)
    conn = _grpc_h2._Connection(socket, {PATH: method}, 1 << 24, server)  # type: ignore[arg-type]
    conn._start = started.append  # type: ignore[method-assign]
    conn._h2.initiate_connection()
    conn._h2.increment_flow_control_window(_grpc_h2._WINDOW * 16)
    conn._h2.receive_data(reads[0])
    conn._h2.data_to_send()
    sent = 0
    t0 = time.process_time()
    for data in reads[1:]:
        for event in conn._h2.receive_data(data):
            conn._event(event)
        for stream in started:
            split = _grpc._wire_split(stream.messages[0])
            assert split is not None
            assert len(split[2][0]) == width * 4
            answer = _grpc._response_bytes(
                model, "1", None, [("output", "FP32", (1, outputs), row[3].tobytes(), None)], None
            )
            conn._headers(stream)
            coro = conn._send_message(stream, answer)
            try:
                coro.send(None)
            except StopIteration:
                pass
            else:
                raise SystemExit("an answer waited for the window")
            conn._streams.pop(stream.stream_id, None)
            conn._forget(stream)
            conn._finish(stream, 0, "", True)
        started.clear()
        out = conn._h2.data_to_send()
        if conn._extra:
            out, conn._extra = conn._extra + out, b""
        sent += len(out)
    elapsed = time.process_time() - t0
    assert sent > args.calls * outputs * 4
    return elapsed / args.calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="digits,wide")
    parser.add_argument("--calls", type=int, default=8000)
    parser.add_argument("--per-read", type=int, default=16, help="calls per read (16: C=64 on 4)")
    parser.add_argument("--frame", type=int, default=16384, help="DATA frame size the client cuts")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(f"{'model':<8}{'CPU us/call, median':>22}  (min; each round)")
    for model in args.models.split(","):
        times = [trio.run(one_round, args, model) for _ in range(args.rounds)]
        each = ", ".join(f"{t:.2f}" for t in times)
        print(
            f"{model:<8}{statistics.median(times):>22.2f}  ({min(times):.2f}; {each})", flush=True
        )


if __name__ == "__main__":
    main()
