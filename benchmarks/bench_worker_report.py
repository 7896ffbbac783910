#!/usr/bin/env python
"""What a ``--workers`` worker's report of its counts costs its event loop, tree against tree.

Every worker of ``trioinfer serve --workers N`` reports its counts to the
supervisor each second it serves (``WorkerLink._report_counts``), so that a
worker that dies leaves them in the totals. Whatever the report does on the
worker's event loop, every request arriving meanwhile waits for. This script
serves the same repository from each source tree given (``--tree``, e.g. main
exported beside this one), in turn within each repeat (A, B, then B, A, ...), with
``--workers 2``, drives it with wrk, and reports:

- ``reports``: the reports the workers sent in the window (both workers);
- ``loop us/report``: the event loop's time in the report task per report,
  summed over its steps (every step of the task named ``*_report_counts``,
  timed by a Trio instrument that a ``sitecustomize`` this script writes
  adds to each worker's ``trio.run``; nothing in the trees is changed);
- ``cpu us/report``: the same steps' CPU time (``time.thread_time``): the
  part of the above that was the report's own work, not the thread waiting
  for a core the machine's other processes held; ``steps/report``: how many
  steps (the loop ran other tasks in between);
- ``longest us``: the report task's longest single step, the longest a
  request could wait behind a report;
- ``loop us/s``: the report's loop time per second of the window, per worker;
- ``sup ms/s``: the supervisor's CPU per second (all threads), where the
  rendering may have moved;
- wrk's ``req/s``, ``p50``, ``p99``, ``p99.9`` and ``max`` latency.

``--idle-models K`` adds K idle copies of the digits model to the repository:
each adds its families to every report (with 3, the exposition is about the
41 KB of a four-model server). Only the digits model gets requests.

The workers must run Trio (the default ``--loop``). The tree's ``src`` and
``plugins`` go first on the servers' PYTHONPATH; this script imports
trioinfer from its own (for the model and the request body only).

Usage:  git archive main | tar -x -C /tmp/base
        .venv/bin/python benchmarks/bench_worker_report.py --tree /tmp/base --tree .
        .venv/bin/python benchmarks/bench_worker_report.py --tree /tmp/base --tree . \\
            --idle-models 3 --duration 10 --repeat 3 --concurrency 64
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import bench_http  # a sibling script: benchmarks/, the script's directory, is on sys.path
from bench_engine import versions
from bench_workers import _children

#: Written into a directory put on the servers' PYTHONPATH: Python imports it at
#: start-up in every process, and it acts only in a worker (the variable below).
SITECUSTOMIZE = '''\
"""bench_worker_report.py's probe: times the report task's steps on a worker's loop."""
import atexit, json, os, time

OUT = os.environ.get("BENCH_WORKER_REPORT_OUT")
if OUT and "TRIOINFER_WORKER_SPEC" in os.environ:
    import anyio
    import trio

    seen = {
        "steps_s": 0.0, "cpu_s": 0.0, "longest_s": 0.0, "steps": 0, "reports": 0, "started": 0.0
    }
    timing = {}

    def mine(task):
        # The report task, whatever module runs it (a worker runs as __main__).
        return task.name.endswith("_report_counts")

    class Probe(trio.abc.Instrument):
        def before_run(self):
            seen["started"] = time.perf_counter()

        def before_task_step(self, task):
            if mine(task):
                timing[task] = (time.perf_counter(), time.thread_time())

        def after_task_step(self, task):
            begun = timing.pop(task, None)
            if begun is not None:
                took = time.perf_counter() - begun[0]
                seen["cpu_s"] += time.thread_time() - begun[1]
                seen["steps_s"] += took
                seen["steps"] += 1
                seen["longest_s"] = max(seen["longest_s"], took)

    def write():
        seen["pid"] = os.getpid()
        with open(OUT, "a") as f:
            f.write(json.dumps(seen) + "\\n")

    def reset(signum, frame):
        # The window starts: what start-up and warm-up cost is not counted.
        for key in ("steps_s", "cpu_s", "longest_s", "steps", "reports"):
            seen[key] = 0 if key in ("steps", "reports") else 0.0
        seen["started"] = time.perf_counter()

    def report(signum, frame):
        seen["ended"] = time.perf_counter()
        write()

    import signal
    signal.signal(signal.SIGUSR1, reset)
    signal.signal(signal.SIGUSR2, report)
    run = anyio.run

    def run_probed(func, *args, backend="asyncio", backend_options=None):
        import sys
        link = getattr(sys.modules.get("__main__"), "WorkerLink", None)
        if link is not None:
            # Reports are counted where the counts are taken (WorkerLink._counts, in
            # every tree so far), from the report task only (a scrape takes them too).
            take = link._counts

            def counted(self, *args, **kwargs):
                if mine(trio.lowlevel.current_task()):
                    seen["reports"] += 1
                return take(self, *args, **kwargs)

            link._counts = counted
        if backend == "trio":
            options = dict(backend_options or {})
            options["instruments"] = [*options.get("instruments", ()), Probe()]
            backend_options = options
        return run(func, *args, backend=backend, backend_options=backend_options)

    anyio.run = run_probed
'''

LUA_DONE = """\
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "BENCH_HTTP requests=%.0f duration_us=%.0f errors=%.0f p50_us=%.1f p99_us=%.1f " ..
    "p999_us=%.1f max_us=%.1f\\n",
    summary.requests, summary.duration, e.connect + e.read + e.write + e.status + e.timeout,
    latency:percentile(50), latency:percentile(99), latency:percentile(99.9), latency.max))
end
"""

HEADER = (
    f"{'tree':<14} {'rep':>3} {'req/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'p99.9 ms':>8} "
    f"{'max ms':>7} {'reports':>7} {'loop us/report':>14} {'cpu us/report':>13} "
    f"{'steps/report':>12} {'longest us':>10} {'loop us/s':>9} "
    f"{'sup ms/s':>8}"
)


@dataclass
class Row:
    tree: str
    rep: int
    rate: float
    p50_ms: float
    p99_ms: float
    p999_ms: float
    max_ms: float
    reports: int
    loop_us_per_report: float
    cpu_us_per_report: float
    steps_per_report: float
    longest_us: float
    loop_us_per_s: float
    supervisor_ms_per_s: float
    errors: int

    def text(self) -> str:
        errors = f"  errors {self.errors}" if self.errors else ""
        return (
            f"{self.tree:<14} {self.rep:>3} {self.rate:>8,.0f} {self.p50_ms:>7.2f} "
            f"{self.p99_ms:>7.2f} {self.p999_ms:>8.2f} {self.max_ms:>7.1f} {self.reports:>7} "
            f"{self.loop_us_per_report:>14.0f} {self.cpu_us_per_report:>13.0f} "
            f"{self.steps_per_report:>12.1f} {self.longest_us:>10.0f} "
            f"{self.loop_us_per_s:>9.0f} {self.supervisor_ms_per_s:>8.2f}{errors}"
        )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tree",
        action="append",
        default=[],
        help="a source tree (with src/ and plugins/) to serve from; repeat to compare "
        "(default: this script's tree)",
    )
    parser.add_argument("--workers", type=int, default=2, help="--workers of every server")
    parser.add_argument("--concurrency", type=int, default=64, help="wrk's connections")
    parser.add_argument("--duration", type=int, default=10, help="whole seconds measured")
    parser.add_argument("--warmup", type=int, default=2, help="whole seconds of warm-up")
    parser.add_argument("--repeat", type=int, default=2, help="interleaved repeats")
    parser.add_argument(
        "--idle-models", type=int, default=0, help="idle copies of digits in the repository"
    )
    parser.add_argument("--encoding", default="binary", choices=bench_http.ENCODINGS)
    parser.add_argument("--wrk", default="wrk", help="the wrk executable")
    args = parser.parse_args(argv)
    if not args.tree:
        args.tree = [str(Path(__file__).resolve().parent.parent)]
    for tree in args.tree:
        if not (Path(tree) / "src" / "trioinfer").is_dir():
            parser.error(f"--tree {tree}: expected a source tree with src/trioinfer in it")
    if min(args.workers, args.concurrency, args.duration, args.repeat) < 1 or args.warmup < 0:
        parser.error("--workers, --concurrency, --duration and --repeat must be >= 1")
    if args.idle_models < 0:
        parser.error("--idle-models must be >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    wrk = shutil.which(args.wrk)
    if wrk is None:
        print(f"{args.wrk!r} is not installed (see bench_http.py)", file=sys.stderr)
        return 2
    started = time.perf_counter()
    print(versions())
    names = _labels(args.tree)
    print(
        f"cores: {os.cpu_count()}; trees: "
        + ", ".join(f"{n} = {t}" for n, t in zip(names, args.tree, strict=True))
    )
    print(
        f"--workers {args.workers}; digits ({args.encoding}) at concurrency {args.concurrency} "
        f"+ {args.idle_models} idle copies; warm-up {args.warmup}s, measure {args.duration}s, "
        f"repeat {args.repeat}; load average at the start: {_load()}"
    )
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="trioinfer-bench-report-") as tmp:
        root = Path(tmp)
        probe = root / "probe"
        probe.mkdir()
        (probe / "sitecustomize.py").write_text(SITECUSTOMIZE)
        options = bench_http.parse_args(["--models", "digits", "--concurrency", "64"])
        models = bench_http.write_repository(root / "models", options, skipped={})
        digits = models["digits"]
        for i in range(args.idle_models):
            shutil.copytree(root / "models" / "digits", root / "models" / f"idle{i}")
        body, headers = bench_http.request_body(digits, args.encoding)
        print(HEADER, flush=True)
        for rep in range(1, args.repeat + 1):
            # A, B, then B, A: a machine that gets busier or quieter during the run
            # favours no tree.
            order = list(zip(names, args.tree, strict=True))
            for name, tree in order if rep % 2 else order[::-1]:
                row = _window(root, probe, Path(tree), name, rep, args, wrk, digits, body, headers)
                rows.append(row)
                print(row.text(), flush=True)
    print("\nmedian over the repeats:")
    print(HEADER)
    for name in names:
        chosen = [r for r in rows if r.tree == name]

        def median(attribute: str, chosen: list[Row] = chosen) -> float:
            return statistics.median(getattr(r, attribute) for r in chosen)

        print(
            Row(
                name,
                0,
                *(median(a) for a in ("rate", "p50_ms", "p99_ms", "p999_ms", "max_ms")),
                round(median("reports")),
                *(
                    median(a)
                    for a in (
                        "loop_us_per_report",
                        "cpu_us_per_report",
                        "steps_per_report",
                        "longest_us",
                        "loop_us_per_s",
                        "supervisor_ms_per_s",
                    )
                ),
                0,
            ).text()
        )
    print(
        f"\nload average at the end: {_load()}; the run took {time.perf_counter() - started:.0f} s"
    )
    return 0


def _window(
    root: Path,
    probe: Path,
    tree: Path,
    name: str,
    rep: int,
    args: argparse.Namespace,
    wrk: str,
    digits: bench_http.Model,
    body: bytes,
    headers: dict[str, str],
) -> Row:
    out = root / f"probe-{name}-{rep}.jsonl"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(tree / "src"), str(tree / "plugins"), str(probe), os.environ.get("PYTHONPATH", "")]
        ),
        "BENCH_WORKER_REPORT_OUT": str(out),
    }
    command = [
        sys.executable,
        "-m",
        "trioinfer",
        "serve",
        "--port",
        "0",
        "--log-level",
        "warning",
        "--model-repository",
        str(root / "models"),
        "--workers",
        str(args.workers),
    ]
    log = root / f"server-{name}-{rep}.log"
    with log.open("wb") as err:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, env=env)
    try:
        base, _ = bench_http.read_url(process, log)
        bench_http.wait_ready(base, process, log)
        server = bench_http.Server(process, base, log)
        bench_http.check_answer(base, digits, args.encoding, body, headers)
        script = _script(root, body, headers)
        url = f"{base}/v2/models/digits/infer"
        workers = _children(process.pid)
        if len(workers) != args.workers:
            raise SystemExit(f"found worker processes {workers}, expected {args.workers}")
        if args.warmup:
            _wrk(wrk, script, url, args.concurrency, args.warmup)
        _signal(workers, "SIGUSR1")  # the probes start counting now
        supervisor0 = server.cpu_s()
        values = _wrk(wrk, script, url, args.concurrency, args.duration)
        supervisor1 = server.cpu_s()
        _signal(workers, "SIGUSR2")  # and write what they counted
        seen = _read_probes(out, len(workers))
    finally:
        bench_http.stop_server(process)
    seconds = values["duration_us"] / 1e6
    reports = sum(s["reports"] for s in seen)
    steps_s = sum(s["steps_s"] for s in seen)
    window_s = statistics.mean(s["ended"] - s["started"] for s in seen)
    return Row(
        name,
        rep,
        values["requests"] / seconds,
        values["p50_us"] / 1e3,
        values["p99_us"] / 1e3,
        values["p999_us"] / 1e3,
        values["max_us"] / 1e3,
        reports,
        steps_s / reports * 1e6 if reports else math.nan,
        sum(s["cpu_s"] for s in seen) / reports * 1e6 if reports else math.nan,
        sum(s["steps"] for s in seen) / reports if reports else math.nan,
        max(s["longest_s"] for s in seen) * 1e6,
        steps_s / len(seen) / window_s * 1e6,
        (supervisor1 - supervisor0) / seconds * 1e3,
        int(values["errors"]),
    )


def _script(root: Path, body: bytes, headers: dict[str, str]) -> Path:
    body_path = root / "request.body"
    body_path.write_bytes(body)
    extra = "".join(
        f"wrk.headers[{json.dumps(k)}] = {json.dumps(v)}\n"
        for k, v in headers.items()
        if k != "Content-Type"
    )
    lua = root / "request.lua"
    lua.write_text(
        bench_http.LUA_REQUEST.format(
            body=json.dumps(str(body_path)),
            content_type=json.dumps(headers["Content-Type"]),
            extra_headers=extra,
        )
        + LUA_DONE
    )
    return lua


def _wrk(wrk: str, script: Path, url: str, conc: int, seconds: int) -> dict[str, float]:
    command = [wrk, "-t1", f"-c{conc}", f"-d{seconds}s", "--latency", "-s", str(script), url]
    done = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 60)
    match = bench_http.WRK_LINE.search(done.stdout)
    if done.returncode != 0 or match is None:
        raise SystemExit(
            f"wrk failed (exit status {done.returncode}): {shlex.join(command)}\n"
            f"{done.stdout}\n{done.stderr}"
        )
    return {k: float(v) for k, v in (item.split("=") for item in match.group(1).split())}


def _signal(pids: list[int], name: str) -> None:
    for pid in pids:
        os.kill(pid, getattr(__import__("signal"), name))


def _read_probes(out: Path, count: int) -> list[dict[str, float]]:
    end = time.monotonic() + 10
    while time.monotonic() < end:
        lines = out.read_text().splitlines() if out.exists() else []
        if len(lines) >= count:
            return [json.loads(line) for line in lines]
        time.sleep(0.05)
    raise SystemExit(f"the workers' probes wrote {out} with fewer than {count} lines")


def _labels(trees: Sequence[str]) -> list[str]:
    names = [Path(t).resolve().name for t in trees]
    if len(set(names)) < len(names):
        names = [f"{i}:{n}" for i, n in enumerate(names)]
    return names


def _load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    sys.exit(main())
