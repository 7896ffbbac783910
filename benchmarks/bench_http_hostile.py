#!/usr/bin/env python
"""Memory a ``trioinfer serve`` process holds for clients that pipeline and never read.

Starts ``sys.executable -m trioinfer serve --port 0 --log-level warning`` (plus
``--server-args``, e.g. ``"--loop asyncio"``) on the bundled example repository,
then opens ``--clients`` connections on 127.0.0.1 (default 200) that each send
up to ``--bytes`` (default 256 KiB) of pipelined ``GET /v2/health/ready``
requests and never read an answer. Each client sends what the server and the
kernel take within ``--send-s`` seconds, holds the connection for ``--hold-s``
seconds, then closes. The server's resident memory (``VmRSS`` of
``/proc/<pid>/status``) is sampled every 0.1 s: before the clients connect,
its peak while they are there, and after they left and the server settled.

This is the check behind the issue's finding (200 such clients grew the
server by 325 MB, never given back), not a timed test: run it by hand, on a
machine as quiet as you can get. Loopback only; every request loop is bounded.

Usage:  .venv/bin/python benchmarks/bench_http_hostile.py
        .venv/bin/python benchmarks/bench_http_hostile.py --server-args "--loop asyncio"
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

import trio

REQUEST = b"GET /v2/health/ready HTTP/1.1\r\nHost: bench\r\n\r\n"


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        match = re.search(r"VmRSS:\s+(\d+) kB", f.read())
    assert match is not None
    return int(match.group(1)) / 1024


def start_server(server_args: str) -> tuple[subprocess.Popen[str], int]:
    command = [
        sys.executable,
        "-m",
        "trioinfer",
        "serve",
        "--port",
        "0",
        "--log-level",
        "warning",
        *shlex.split(server_args),
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    for line in process.stdout:
        match = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        if match:
            return process, int(match.group(1))
    raise SystemExit(f"the server did not start: exit code {process.wait()}")


async def non_reader(port: int, size: int, send_s: float, hold_s: float, sent: list[int]) -> None:
    sock = trio.socket.socket()
    with sock:
        await sock.connect(("127.0.0.1", port))
        data = REQUEST * (size // len(REQUEST))
        view = memoryview(data)
        total = 0
        with trio.move_on_after(send_s):
            try:
                while total < len(data):
                    total += await sock.send(view[total:])
            except OSError:
                pass  # the server hung up: it gave up on us
        sent.append(total)
        await trio.sleep(hold_s)


async def attack(pid: int, port: int, args: argparse.Namespace) -> dict[str, float]:
    sent: list[int] = []
    peak = 0.0

    async def sample(stop: trio.Event) -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, rss_mb(pid))
            await trio.sleep(0.1)

    stop = trio.Event()
    async with trio.open_nursery() as outer:
        outer.start_soon(sample, stop)
        async with trio.open_nursery() as clients:
            for _ in range(args.clients):
                clients.start_soon(non_reader, port, args.bytes, args.send_s, args.hold_s, sent)
        await trio.sleep(args.settle_s)
        stop.set()
    return {"peak": peak, "sent_mb": sum(sent) / 2**20}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--bytes", type=int, default=256 * 1024, help="pipelined bytes per client")
    parser.add_argument("--send-s", type=float, default=3.0, help="how long each client sends")
    parser.add_argument("--hold-s", type=float, default=5.0, help="then holds the connection")
    parser.add_argument("--settle-s", type=float, default=3.0, help="wait after they left")
    parser.add_argument("--server-args", default="", help="extra 'trioinfer serve' arguments")
    args = parser.parse_args(argv)
    process, port = start_server(args.server_args)
    try:
        time.sleep(1.0)
        before = rss_mb(process.pid)
        result = trio.run(attack, process.pid, port, args)
        after = rss_mb(process.pid)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as check:
            check.sendall(REQUEST)
            alive = check.recv(100).startswith(b"HTTP/1.1 200")
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    print(
        f"server args {args.server_args!r}: {args.clients} clients pipelining up to "
        f"{args.bytes // 1024} KiB each, never reading; they sent {result['sent_mb']:.1f} MiB"
    )
    print(
        f"server RSS: before {before:.0f} MB, peak {result['peak']:.0f} MB "
        f"(+{result['peak'] - before:.0f}), after they left {after:.0f} MB "
        f"(+{after - before:.0f}); still serving: {alive}"
    )
    print(f"load average at the end: {'/'.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
