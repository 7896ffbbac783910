"""The cost of OpenTelemetry tracing: off, 1 in 1000, and every request, in one run.

In-process, the bundled digits MLP (``float32[batch, 64] -> 10 classes``), dynamic
batching, C client tasks calling ``engine.infer``. Traced runs use the SDK's
``TracerProvider`` with a ``BatchSpanProcessor`` in front of an exporter that
drops what it is given, so the figure is trioinfer's spans and the SDK's work,
not a network. The settings rotate within each round, so that the machine's
drift hits all alike; the ratios are to tracing off. Beside throughput it
reports the process's CPU time per request (every thread's, ONNX Runtime's
included), which other work on a shared machine disturbs far less than
throughput: on a busy machine, read the CPU figures.

With ``--http`` it measures ``trioinfer serve`` instead, through
``bench_http.py``'s helpers: one server process per run (``--trace-exporter
otlp --trace-rate R`` for the traced settings, its collector a closed port, so
that spans are made and dropped as when a collector is down), wrk at 64
connections sending the binary digits request, and the server's CPU time per
request from ``/proc`` (all its threads).

Usage:  .venv/bin/python benchmarks/bench_tracing.py [--duration 5] [--rounds 3] [--http]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import trio
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

import trioinfer

SETTINGS = {"off": None, "1/1000": 0.001, "100%": 1.0}


class Discard(SpanExporter):
    """Counts the spans it is given and keeps none."""

    def __init__(self) -> None:
        self.spans = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.spans += len(spans)
        return SpanExportResult.SUCCESS


async def run(rate: float | None, args: argparse.Namespace) -> tuple[float, float, int]:
    config = trioinfer.ModelConfig(
        name="digits",
        path=trioinfer.example_repository() / "digits" / "1" / "model.onnx",
        instances=[trioinfer.Instance("cpu", threads=args.threads)],
        batcher="dynamic",
        batcher_options={"max_batch_size": 64, "max_queue_delay": 0.001},
    )
    provider: Any = None
    exporter = Discard()
    if rate is not None:
        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=65536))
    x = trioinfer.digits_samples()[0][:1]
    done = 0
    async with trioinfer.open_engine(tracer_provider=provider, trace_rate=rate or 1.0) as engine:
        await engine.load(config)

        async def client() -> None:
            nonlocal done
            while True:
                await engine.infer("digits", {"input": x})
                done += 1

        async with trio.open_nursery() as nursery:
            for _ in range(args.concurrency):
                nursery.start_soon(client)
            await trio.sleep(args.warmup)
            start_done, start, cpu = done, time.perf_counter(), time.process_time()
            await trio.sleep(args.duration)
            throughput = (done - start_done) / (time.perf_counter() - start)
            cpu_us = (time.process_time() - cpu) / (done - start_done) * 1e6
            nursery.cancel_scope.cancel()
    if provider is not None:
        provider.shutdown()
    return throughput, cpu_us, exporter.spans


def http_runner(args: argparse.Namespace, tmp: Path) -> Callable[[float | None], Any]:
    """A function that serves digits with one tracing setting and measures it with wrk."""
    sys.path.insert(0, str(Path(__file__).parent))
    import bench_http

    http_args = bench_http.parse_args(
        [
            "--models",
            "digits",
            "--encodings",
            "binary",
            "--concurrency",
            str(args.concurrency),
            "--duration",
            str(max(1, round(args.duration))),
            "--warmup",
            str(max(1, round(args.warmup))),
        ]
    )
    models = bench_http.write_repository(tmp / "repo", http_args, skipped={})
    # Spans go to a port nothing listens on: made, exported in vain, dropped.
    os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = "http://127.0.0.1:9"
    os.environ.pop("OTEL_TRACES_EXPORTER", None)
    runs = 0

    def run_http(rate: float | None) -> tuple[float, float, int]:
        nonlocal runs
        runs += 1
        http_args.server_args = "" if rate is None else f"--trace-exporter otlp --trace-rate {rate}"
        server = bench_http.start_server(tmp / "repo", http_args, tmp / f"server-{runs}.log")
        try:
            script = bench_http.write_script(tmp, models["digits"], "binary", server)
            row = bench_http.run_http(
                server,
                "/v2/models/digits/infer",
                script.path,
                args.concurrency,
                http_args,
                runs,
                model="digits",
                how="binary",
            )
        finally:
            bench_http.stop_server(server.process)
        if row.errors:
            raise SystemExit(f"wrk saw errors: {row.errors}")
        return row.rate, row.cpu_us, 0

    return run_http


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=5.0, help="seconds measured per run")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--http", action="store_true", help="measure trioinfer serve with wrk")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.http:
            measure = http_runner(args, Path(tmp))
        else:

            def measure(rate: float | None) -> tuple[float, float, int]:
                return trio.run(run, rate, args)

        report(measure, args)


def report(measure: Callable[[float | None], Any], args: argparse.Namespace) -> None:
    names = list(SETTINGS)
    rates: dict[str, list[float]] = {name: [] for name in names}
    cpus: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        order = names[round_ % len(names) :] + names[: round_ % len(names)]
        for name in order:
            throughput, cpu_us, spans = measure(SETTINGS[name])
            rates[name].append(throughput)
            cpus[name].append(cpu_us)
            print(
                f"round {round_ + 1}: tracing {name:>6} {throughput:8.0f} req/s "
                f"{cpu_us:7.1f} us CPU/request" + (f"  {spans} spans" if not args.http else "")
            )
    off, off_cpu = rates["off"], cpus["off"]
    print(
        f"off: {statistics.median(off):.0f} req/s, {statistics.median(off_cpu):.1f} us CPU "
        f"per request (medians); C={args.concurrency}"
    )
    for name in names[1:]:
        ratios = [b / a for a, b in zip(off, rates[name], strict=True)]
        cpu_ratios = [b / a for a, b in zip(off_cpu, cpus[name], strict=True)]
        print(
            f"{name}: throughput {statistics.median(ratios):.3f}x of off "
            f"(per round: {', '.join(f'{r:.3f}' for r in ratios)}); CPU per request "
            f"{statistics.median(cpu_ratios):.3f}x of off "
            f"(per round: {', '.join(f'{r:.3f}' for r in cpu_ratios)})"
        )


if __name__ == "__main__":
    main()
