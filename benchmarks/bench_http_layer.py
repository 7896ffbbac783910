#!/usr/bin/env python
"""The HTTP/1.1 layer's CPU per request, with its sockets faked: source trees side by side.

What ``bench_http_ab.py`` measures end to end swings by 30% between windows
on a busy machine, more than a change of a microsecond or two to the request
loop. This bench takes the sockets, the engine and the app's work out: a
fake socket hands a digits-sized V2 JSON request to every ``recv`` and takes
every ``send``, the wait for readability returns at once, and the ASGI app
answers with a fixed 300-byte body through ``send``. What is left is
trioinfer's own per-request work in ``server/_framing.py`` (the parser's
callbacks), ``server/_connection.py`` (the request loop) and
``server/_cycle.py`` (scope, receive, send, the response head), timed in
process CPU time (best of ``--repeat`` runs of ``--requests`` requests each),
one subprocess per tree (``LABEL=PATH``, ``PATH/src`` first on the path),
the trees alternating for ``--rounds`` rounds.

Usage:  .venv/bin/python benchmarks/bench_http_layer.py main=/tmp/main here=. --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

_CHILD = r"""
import sys, time
import trio
from trioinfer.server import _connection, _io

n, repeat = int(sys.argv[1]), int(sys.argv[2])
values = ",".join("%.1f" % (i % 17) for i in range(64))
tensor = '{"name":"input","shape":[1,64],"datatype":"FP32","data":[%s]}' % values
body = ('{"inputs":[%s]}' % tensor).encode()
request = (
    b"POST /v2/models/digits/infer HTTP/1.1\r\nHost: 127.0.0.1:8000\r\n"
    b"Content-Length: %d\r\nContent-Type: application/json\r\n\r\n" % len(body)
) + body
response = b"y" * 300
start = {
    "type": "http.response.start",
    "status": 200,
    "headers": [(b"content-length", b"300"), (b"content-type", b"application/json")],
}


class Sock:
    def __init__(self):
        self.left = n

    def recv(self, size):
        if self.left == 0:
            return b""
        self.left -= 1
        return request

    def send(self, data):
        return len(data)

    def shutdown(self, how):
        pass

    def fileno(self):
        return -1


async def app(scope, receive, send):
    await receive()
    await send(start)
    await send({"type": "http.response.body", "body": response})


async def ready(sock):
    pass


async def main():
    io = _io.open_io()
    io.wait_readable = ready
    shared = _connection.Shared(
        app, io, {}, head_timeout=5.0, body_timeout=5.0, send_timeout=5.0,
        max_head_bytes=8192, max_headers=100,
    )
    best = float("inf")
    for _ in range(repeat):
        conn = _connection.Connection(shared, Sock(), ("127.0.0.1", 1), ("127.0.0.1", 2))
        began = time.process_time()
        await conn.run()
        best = min(best, (time.process_time() - began) / n * 1e6)
    print(best)


trio.run(main)
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("trees", nargs="+", help="LABEL=PATH of each source tree")
    parser.add_argument("--rounds", type=int, default=3, help="alternations (default 3)")
    parser.add_argument("--requests", type=int, default=20000, help="requests per run")
    parser.add_argument("--repeat", type=int, default=7, help="runs per round (best kept)")
    args = parser.parse_args(argv)
    for tree in args.trees:
        if "=" not in tree:
            parser.error(f"expected LABEL=PATH, got {tree!r}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the rounds and print each tree's figures."""
    args = parse_args(argv)
    trees = [tuple(t.split("=", 1)) for t in args.trees]
    results: dict[str, list[float]] = {label: [] for label, _ in trees}
    for r in range(args.rounds):
        for label, path in trees if r % 2 == 0 else trees[::-1]:
            env = dict(os.environ, PYTHONPATH=f"{Path(path).resolve()}/src")
            out = subprocess.run(
                [sys.executable, "-c", _CHILD, str(args.requests), str(args.repeat)],
                env=env,
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            results[label].append(float(out))
            print(f"round {r} {label:10} {results[label][-1]:6.2f} us/req", flush=True)
    print()
    for label, figures in results.items():
        print(
            f"{label:10} HTTP/1.1 layer us/req median {statistics.median(figures):6.2f} "
            f"min {min(figures):6.2f} ({', '.join(f'{x:.2f}' for x in figures)})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
