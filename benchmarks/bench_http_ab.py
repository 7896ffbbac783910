#!/usr/bin/env python
"""Two (or more) source trees of trioinfer served side by side, their windows alternating.

The machine these figures come from is shared: one window can read 30% off
another of the same tree. Comparing two trees is only worth doing within one
run, with their windows interleaved. Each tree (``LABEL=PATH``, e.g. a
``git archive main`` export and this checkout) gets one ``trioinfer serve``
process with ``PYTHONPATH=PATH/src:PATH/plugins`` over the same repository as
``bench_http.py`` writes (the digits model, dynamic batching, one CPU
instance), and each window is one ``wrk -t1 -cC`` run against it after a
warm-up, in the order A B, then B A, and so on. Per window it prints the
server's CPU per request (all threads, from ``/proc``; user and system apart),
the event loop thread's alone, requests/s and wrk's p99; then each tree's
median and minimum.

Encodings (``--encodings``): ``json`` and ``binary`` are ``bench_http.py``'s
infer bodies; ``ready`` is ``GET /v2/health/ready`` (the HTTP layer and the
router, no model). Every tree's answers are checked against ONNX Runtime's
before anything is measured.

Usage:  .venv/bin/python benchmarks/bench_http_ab.py main=/tmp/main here=. --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_http


def cpu_s(pid: int, *, thread: bool = False) -> tuple[float, float]:
    """(user, system) CPU seconds of process *pid*, or of its main thread with *thread*."""
    path = f"/proc/{pid}/task/{pid}/stat" if thread else f"/proc/{pid}/stat"
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) / bench_http.CLK_TCK, int(fields[12]) / bench_http.CLK_TCK


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("trees", nargs="+", help="LABEL=PATH of each source tree")
    parser.add_argument("--rounds", type=int, default=5, help="alternations (default 5)")
    parser.add_argument("--duration", type=int, default=4, help="seconds per window")
    parser.add_argument("--warmup", type=int, default=1, help="seconds of warm-up per window")
    parser.add_argument("--encodings", default="json,binary", help="of json,binary,ready")
    parser.add_argument("--concurrency", type=int, default=64, help="wrk connections")
    parser.add_argument("--server-args", default="", help="extra 'trioinfer serve' arguments")
    args = parser.parse_args(argv)
    for tree in args.trees:
        if "=" not in tree:
            parser.error(f"expected LABEL=PATH, got {tree!r}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the windows and print the figures."""
    a = parse_args(argv)
    trees = [tuple(t.split("=", 1)) for t in a.trees]
    args = argparse.Namespace(
        models=["digits"],
        threads=1,
        pipeline_depth=1,
        tune_batch_sizes=[],
        instances=1,
        concurrency=[a.concurrency],
        server_args=a.server_args,
        wrk="wrk",
        timeout=10,
    )
    root = Path(tempfile.mkdtemp(prefix="bench-http-ab-"))
    (root / "repo").mkdir()
    model = bench_http.write_repository(root / "repo", args, skipped={})["digits"]
    servers: dict[str, bench_http.Server] = {}
    old = os.environ.get("PYTHONPATH")
    try:
        for label, path in trees:
            os.environ["PYTHONPATH"] = f"{Path(path).resolve()}/src:{Path(path).resolve()}/plugins"
            servers[label] = bench_http.start_server(root / "repo", args, root / f"{label}.log")
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
        encodings = a.encodings.split(",")
        scripts = {}
        for enc in encodings:
            if enc == "ready":
                scripts[enc] = root / "ready.lua"
                scripts[enc].write_text(bench_http.LUA_DONE)
                continue
            for server in servers.values():
                scripts[enc] = bench_http.write_script(root, model, enc, server).path
        results: dict[tuple[str, str], list[tuple[float, ...]]] = {}
        labels = list(servers)
        for r in range(a.rounds):
            for enc in encodings:
                for label in labels if r % 2 == 0 else labels[::-1]:
                    results.setdefault((enc, label), []).append(
                        window(servers[label], enc, scripts[enc], args, a, r, label)
                    )
        print()
        for enc in encodings:
            for label in labels:
                rows = results[(enc, label)]
                cols = list(zip(*rows, strict=True))
                print(
                    f"{enc:6} {label:10} server us/req median {statistics.median(cols[0]):6.1f} "
                    f"min {min(cols[0]):6.1f} ({', '.join(f'{x:.1f}' for x in cols[0])}) | "
                    f"loop median {statistics.median(cols[1]):6.1f} | req/s median "
                    f"{statistics.median(cols[2]):7,.0f} max {max(cols[2]):7,.0f} | "
                    f"p99 ms median {statistics.median(cols[3]):.2f}"
                )
    finally:
        for server in servers.values():
            bench_http.stop_server(server.process)
    return 0


def window(
    server: bench_http.Server,
    enc: str,
    script: Path,
    args: argparse.Namespace,
    a: argparse.Namespace,
    r: int,
    label: str,
) -> tuple[float, ...]:
    """One measured window: (server us/req, loop us/req, req/s, p99 ms)."""
    path = "/v2/health/ready" if enc == "ready" else "/v2/models/digits/infer"
    url = server.base + path
    if a.warmup:
        bench_http.wrk(args, script, url, a.concurrency, a.warmup)
    server.wait_idle()
    pid = server.process.pid
    before: Any = (cpu_s(pid), cpu_s(pid, thread=True))
    got = bench_http.wrk(args, script, url, a.concurrency, a.duration)
    after: Any = (cpu_s(pid), cpu_s(pid, thread=True))
    n = got["requests"]
    user = 1e6 * (after[0][0] - before[0][0]) / n
    system = 1e6 * (after[0][1] - before[0][1]) / n
    loop = 1e6 * (sum(after[1]) - sum(before[1])) / n
    rps = n / (got["duration_us"] / 1e6)
    p99 = got["p99_us"] / 1000
    errors = sum(got[k] for k in ("connect", "read", "write", "status", "timeout"))
    print(
        f"round {r} {enc:6} {label:10} server {user + system:6.1f} us/req (user {user:.1f}, "
        f"system {system:.1f}), loop {loop:6.1f} | {rps:7,.0f} req/s | p99 {p99:6.2f} ms | "
        f"errors {errors:.0f} | load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    return user + system, loop, rps, p99


if __name__ == "__main__":
    raise SystemExit(main())
