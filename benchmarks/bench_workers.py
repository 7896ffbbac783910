#!/usr/bin/env python
"""``trioinfer serve --workers N`` over HTTP: N worker processes against one, in one run.

Issue 20, goal 4. The same temporary repository and config.toml as
``bench_http.py`` (``digits`` by default: dynamic batching, max batch 32,
5 ms, one CPU instance of one ORT thread per worker, dispatch "thread"),
served by ``sys.executable -m trioinfer serve --port 0 --log-level warning
--workers N`` for each N of ``--workers`` (default 1,2), one server at a time,
interleaved within each repeat (1, 2, 1, 2, ...). Each server is started,
checked (one request of each encoding against ONNX Runtime's answer), measured
with wrk at each concurrency and encoding, and stopped (SIGTERM) before the
next starts.

The load generator is bench_http's: ``wrk -t1 -cC --latency`` with a Lua script
sending one V2 infer request as is on every keep-alive connection (a closed
loop). wrk holds C connections for the whole window, and the kernel spreads
them over the workers when they are opened (SO_REUSEPORT hashes each
connection), so at low C the split can be uneven; at C=64 it is close to even.

Columns: ``req/s``; ``p50 ms``, ``p99 ms`` (wrk's); ``srv us/req`` and
``srv cores``: the CPU time of the supervisor and every worker (``/proc``,
all threads) over the window, per request and per second; ``wrk us/req``:
wrk's own CPU per request; ``rows/batch``: the server's inference_count over
execution_count (statistics added up over the workers). ``xN/1`` is the
throughput against the one-worker server of the same repeat, encoding and
concurrency. On a machine with fewer cores than workers plus wrk, the
workers share cores with each other and with wrk: what shows then is how much
one process leaves unused, not how far N processes scale.

Usage:  .venv/bin/python benchmarks/bench_workers.py                    # 1 and 2 workers, C=64
        .venv/bin/python benchmarks/bench_workers.py --workers 1,2,4 --concurrency 64,256
        .venv/bin/python benchmarks/bench_workers.py --duration 3 --repeat 3 --encodings json
Other options are bench_http.py's (--models, --threads, --instances, --wrk, ...).
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import bench_http  # a sibling script: benchmarks/, the script's directory, is on sys.path
from bench_engine import versions

HEADER = (
    f"{'workers':>7} {'enc':>6} {'conc':>5} {'rep':>3} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} "
    f"{'srv us/req':>10} {'srv cores':>9} {'wrk us/req':>10} {'rows/batch':>10} {'xN/1':>6}"
)


class Servers(bench_http.Server):
    """bench_http's server, with the CPU time of its workers counted too."""

    def cpu_s(self) -> float:
        """User + system CPU of the supervisor and every worker (all threads)."""
        pids = [self.process.pid, *_children(self.process.pid)]
        total = 0.0
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue  # a worker that just exited
            total += (int(fields[11]) + int(fields[12])) / bench_http.CLK_TCK
        return total


def _children(pid: int) -> list[int]:
    # Every process whose parent is *pid* (the supervisor starts workers from a
    # thread, so /proc/PID/task/PID/children does not list them).
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue  # gone meanwhile
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, add_help=False
    )
    parser.add_argument("--workers", default="1,2", help="worker counts, one server each")
    parser.add_argument(
        "--wrk-threads",
        type=int,
        default=1,
        help="wrk's threads (-t; bench_http uses 1): more when one wrk thread cannot keep "
        "many workers busy",
    )
    parser.add_argument("-h", "--help", action="store_true")
    own, rest = parser.parse_known_args(argv)
    if own.help:
        parser.print_help()
        raise SystemExit(0)
    defaults = ["--models", "digits", "--concurrency", "64", "--duration", "3"]
    args = bench_http.parse_args([*defaults, *rest])
    args.wrk_threads = own.wrk_threads
    if args.wrk_threads < 1:
        parser.error("--wrk-threads must be >= 1")
    try:
        args.workers = [int(n) for n in own.workers.split(",") if n.strip()]
    except ValueError:
        parser.error(f"--workers takes integers, got {own.workers!r}")
    if not args.workers or any(n < 1 for n in args.workers):
        parser.error("--workers: each count must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    found = shutil.which(args.wrk)
    if found is None:
        print(f"{args.wrk!r} is not installed (see bench_http.py)", file=sys.stderr)
        return 2
    args.wrk = found
    if args.wrk_threads > 1:
        wrapper = Path(tempfile.mkdtemp(prefix="trioinfer-wrk-")) / "wrk"
        # bench_http runs "wrk -t1 ..."; this wrapper gives wrk more threads.
        wrapper.write_text(
            f'#!/bin/sh\nshift\nexec {shlex.quote(found)} -t{args.wrk_threads} "$@"\n'
        )
        wrapper.chmod(0o755)
        args.wrk = str(wrapper)
    started = time.perf_counter()
    print(versions())
    print(
        f"cores: {os.cpu_count()}; workers {args.workers}; models {args.models}; "
        f"wrk threads {args.wrk_threads}"
    )
    print(
        f"each worker: {args.instances} instance(s) x {args.threads} ORT thread(s), dynamic "
        f"batching max {bench_http.MAX_BATCH} / {bench_http.MAX_QUEUE_DELAY * 1e3:g} ms; "
        f"warm-up {args.warmup}s, measure {args.duration}s, repeat {args.repeat}; "
        f"concurrency {args.concurrency}; encodings {args.encodings}"
    )
    rows: list[tuple[int, bench_http.Row]] = []
    with tempfile.TemporaryDirectory(prefix="trioinfer-bench-workers-") as tmp:
        root = Path(tmp)
        models = bench_http.write_repository(root / "models", args, skipped={})
        server_args = args.server_args
        print(HEADER, flush=True)
        for rep in range(1, args.repeat + 1):
            for count in args.workers:
                args.server_args = f"{server_args} --workers {count}"
                plain = bench_http.start_server(root / "models", args, root / "server.log")
                server = Servers(plain.process, plain.base, plain.log)
                try:
                    for model in models.values():
                        for encoding in args.encodings:
                            script = bench_http.write_script(root, model, encoding, server)
                            path = f"/v2/models/{model.name}/infer"
                            for conc in args.concurrency:
                                row = bench_http.run_http(
                                    server,
                                    path,
                                    script.path,
                                    conc,
                                    args,
                                    rep,
                                    model=model.name,
                                    how=encoding,
                                )
                                rows.append((count, row))
                                print(_line(count, row, rows), flush=True)
                finally:
                    bench_http.stop_server(server.process)
    print("\nmedian over the repeats:")
    print(HEADER)
    for model in args.models:
        for encoding in args.encodings:
            for conc in args.concurrency:
                for count in args.workers:
                    chosen = [
                        r
                        for n, r in rows
                        if (n, r.model, r.how, r.concurrency) == (count, model, encoding, conc)
                    ]
                    if chosen:
                        print(_median_line(count, chosen, rows))
    load = "/".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"\nload average at the end: {load}; the run took {time.perf_counter() - started:.0f} s")
    return 0


def _ratio(count: int, row: bench_http.Row, rows: list[tuple[int, bench_http.Row]]) -> float:
    for n, r in rows:
        if n == 1 and (r.model, r.how, r.concurrency, r.rep) == (
            row.model,
            row.how,
            row.concurrency,
            row.rep,
        ):
            return row.rate / r.rate if r.rate else math.nan
    return math.nan


def _line(count: int, r: bench_http.Row, rows: list[tuple[int, bench_http.Row]]) -> str:
    errors = f"  errors {r.errors}" if r.errors else ""
    return (
        f"{count:>7} {r.how:>6} {r.concurrency:>5} {r.rep:>3} {r.rate:>9,.0f} {r.p50_ms:>8.2f} "
        f"{r.p99_ms:>8.2f} {r.cpu_us:>10.0f} {r.cores:>9.2f} {r.gen_us:>10.0f} "
        f"{r.rows_per_batch:>10.1f} {_ratio(count, r, rows):>6.2f}{errors}"
    )


def _median_line(
    count: int, chosen: list[bench_http.Row], rows: list[tuple[int, bench_http.Row]]
) -> str:
    def median(attribute: str) -> float:
        return statistics.median(getattr(r, attribute) for r in chosen)

    ratios = [_ratio(count, r, rows) for r in chosen]
    first = chosen[0]
    return (
        f"{count:>7} {first.how:>6} {first.concurrency:>5} {'med':>3} {median('rate'):>9,.0f} "
        f"{median('p50_ms'):>8.2f} {median('p99_ms'):>8.2f} {median('cpu_us'):>10.0f} "
        f"{median('cores'):>9.2f} {median('gen_us'):>10.0f} {median('rows_per_batch'):>10.1f} "
        f"{statistics.median(ratios):>6.2f}"
    )


if __name__ == "__main__":
    sys.exit(main())
