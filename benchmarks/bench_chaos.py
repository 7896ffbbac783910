#!/usr/bin/env python
"""Chaos at scale: 100,000 requests on real ONNX Runtime sessions while everything goes wrong.

Issue 4, section 6. The bundled ``digits`` model (``trioinfer.example_repository()``)
runs on ``--instances`` CPU instances (ONNX Runtime, one intra-op thread each,
``dispatch = "inline"``, ``inline_budget_us = 1000``), each wrapped in
``trioinfer.testing.FaultyBackend``:

  --error-rate   share of executions that fail with a transient BackendError (default 0.10)
  --hang-rate    share that hang until the fallback's ``timeout`` cancels them (default 0.05)
  --latency      extra seconds per execution, on the event loop (default 0.005): it makes
                 the instances, not the event loop, the bottleneck, so that the overload
                 below is an overload of the instances
  --crash-at     when that share of the requests has arrived, instance 0's session dies
                 (every call fails, not transient) until the fallback re-creates it

behind ``fallback = "resilient"`` (breaker fail_max 3, reset 50 ms; retries with
backoff; ``timeout`` 50 ms), the dynamic batcher (``--max-batch-size``, 1 ms) and
a bounded queue (``--max-queue-size``). First, with no fault, a closed loop of
``--concurrency`` callers measures what the instances serve (req/s). Then
``--requests`` callers arrive open-loop (Poisson, ``--seed``) at ``--overload``
times that rate, at most ``--concurrency`` waiting at once (beyond that the
arrivals wait, and the achieved rate is printed). ``--cancel-rate`` of them give
up early: half at a deadline the engine knows (``move_on_after``), half by a
cancellation from another task (a client that disconnects), after a uniform
random delay of up to ``--cancel-within`` seconds. After the storm the faults
stop; the script waits for every instance to serve again and sends a few more
requests.

Why inline dispatch: the digits model runs in about 50 us, and under overload
the event loop is busy all the time (refusing requests is work too). With
``dispatch = "thread"`` each execution's hand-over between the worker thread
and the busy event-loop thread waits for the GIL (``sys.getswitchinterval()``,
5 ms, per hand-over), so an execution takes tens of milliseconds and the
instances, not the faults, decide the figures. ``--dispatch thread`` shows it.

Printed: each outcome's count (ok, each error class, cancelled), the engine's
counters (refused, expired, failed, fallback steps, replicas), latency
percentiles of the requests that got outputs with and without a fallback step,
the crash's figures (from instance 0's first failed execution to the first
answer failed over to another instance, and to instance 0 serving again), and
the process's RSS before and after. ``--json PATH`` writes the same figures as
JSON. Nothing is asserted: this is a measurement, not a test.

Usage:  .venv/bin/python benchmarks/bench_chaos.py                  # 100,000 requests
        .venv/bin/python benchmarks/bench_chaos.py --requests 2000  # a quick smoke run
See benchmarks/README.md ("Chaos") for figures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import resource
import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import trio

import trioinfer
from trioinfer import Instance, ModelConfig, Registry
from trioinfer.abc import Backend, BackendInstance
from trioinfer.lowlevel import Placement
from trioinfer.testing import FaultyBackend, RequestLedger, assert_all_ended, assert_no_tasks_left

MODEL = "digits"
#: The sample images, one request's row each.
ROWS = np.ascontiguousarray(trioinfer.digits_samples()[0], dtype=np.float32)
Arrays = Mapping[str, np.ndarray[Any, Any]]


def rss_mib() -> float:
    """The process's resident set size now, in MiB (Linux; else the peak)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:  # not Linux: the peak is the best we have
        pass
    return peak_rss_mib()


def peak_rss_mib() -> float:
    """The process's peak resident set size so far, in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# -- a session that dies at a chosen moment --------------------------------------------------


class Crashable:
    """A backend around another whose instance can be killed, as a crashed session would be.

    ``FaultyBackend(crash_after=N)`` kills every instance after N calls each;
    here one instance dies at a moment the benchmark chooses, so that the time
    to fail over can be measured from it. A re-created instance (a new
    ``load``) is alive again.
    """

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        #: The live instance at each index.
        self.current: dict[int, CrashableInstance] = {}
        #: When the first execution failed on a killed instance (``trio.current_time()``).
        self.first_failure: float | None = None
        #: Set at that first failure.
        self.failed = trio.Event()

    def registry(self) -> Registry:
        """A registry in which this backend is the backend called ``chaos``."""
        return Registry(extra={"backends": {"chaos": lambda: self}})

    async def load(self, config: ModelConfig, placement: Placement) -> CrashableInstance:
        """Load an instance of the inner backend, alive."""
        instance = CrashableInstance(self, await self.inner.load(config, placement))
        self.current[placement.index] = instance
        return instance

    def crash(self, index: int) -> None:
        """Kill the instance at *index*: every execution fails until it is re-created."""
        self.current[index].dead = True


class CrashableInstance:
    """An instance of `Crashable`."""

    def __init__(self, backend: Crashable, inner: BackendInstance) -> None:
        self._backend = backend
        self.inner = inner
        self.signature = inner.signature
        self.device = inner.device
        self.dead = False

    async def execute(self, inputs: Arrays) -> dict[str, np.ndarray[Any, Any]]:
        """Fail at once if killed (as a dead session does), else run on the wrapped instance."""
        if self.dead:
            if self._backend.first_failure is None:
                self._backend.first_failure = trio.current_time()
                self._backend.failed.set()
            error = trioinfer.BackendError("the session has died")
            error.__dict__["transient"] = False  # FaultyBackend's convention: do not retry here
            raise error
        return dict(await self.inner.execute(inputs))

    async def aclose(self) -> None:
        """Close the wrapped instance."""
        await self.inner.aclose()


# -- the run ------------------------------------------------------------------------------


@attrs.define
class Tally:
    """What the callers saw."""

    outcomes: Counter[str] = attrs.field(factory=Counter)
    #: Latency (s) of calls that got outputs without, and with, a fallback step.
    plain: list[float] = attrs.field(factory=list)
    fallen_back: list[float] = attrs.field(factory=list)
    #: (time answered, instance, fallback steps) of calls that got outputs.
    answers: list[tuple[float, int | None, tuple[str, ...]]] = attrs.field(factory=list)
    wrong: int = 0


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50 and p99 in milliseconds (``None`` for no values)."""
    if not values:
        return {"n": 0, "p50_ms": None, "p99_ms": None}
    array = np.asarray(values) * 1000
    return {
        "n": len(values),
        "p50_ms": round(float(np.percentile(array, 50)), 3),
        "p99_ms": round(float(np.percentile(array, 99)), 3),
    }


def model_config(args: argparse.Namespace) -> ModelConfig:
    """The digits model's own config, on the chaos backend, with the benchmark's settings."""
    base = ModelConfig.from_toml(trioinfer.example_repository() / MODEL / "config.toml")
    return attrs.evolve(
        base,
        backend="chaos",
        instances=[Instance(count=args.instances, threads=1)],
        backend_options={"dispatch": args.dispatch, "inline_budget_us": 1000},
        batcher="dynamic",
        batcher_options={"max_batch_size": args.max_batch_size, "max_queue_delay": 0.001},
        fallback="resilient",
        fallback_options={
            "seed": args.seed,
            "timeout": args.timeout,
            "breaker": {"fail_max": 3, "reset_timeout": 0.05, "max_reset_timeout": 0.5},
        },
        max_queue_size=args.max_queue_size,
    )


async def calibrate(engine: trioinfer.Engine, rows: np.ndarray[Any, Any], seconds: float) -> float:
    """Requests per second the model serves to a closed loop of 64 callers, with no fault."""
    done = 0
    deadline = trio.current_time() + seconds

    async def loop(i: int) -> None:
        nonlocal done
        while trio.current_time() < deadline:
            await engine.infer(MODEL, {"input": rows[i % len(rows)][None]})
            done += 1

    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        for i in range(64):
            nursery.start_soon(loop, i)
    return done / (trio.current_time() - t0)


async def wait_all_serving(engine: trioinfer.Engine, limit: float) -> float:
    """Wait (at most *limit* seconds) until every instance serves; return how long it took."""
    t0 = trio.current_time()
    with trio.move_on_after(limit):
        # The engine has no event for a replica's return; its statistics are public.
        while any(r.state != "serving" for r in engine.statistics().models[MODEL].replicas):  # noqa: ASYNC110
            await trio.sleep(0.005)
    return trio.current_time() - t0


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark and return its figures."""
    rng = random.Random(args.seed)
    rows = ROWS
    inner = Registry().create("backends", "onnxruntime")
    faulty = FaultyBackend(inner, seed=args.seed, latency=args.latency)
    crashable = Crashable(faulty)
    ledger = RequestLedger()
    tally = Tally()
    figures: dict[str, Any] = {}
    waiting = trio.Semaphore(args.concurrency)
    crash_time: float | None = None
    back_serving: float | None = None

    async def cancel_later(scope: trio.CancelScope, delay: float) -> None:
        await trio.sleep(delay)
        scope.cancel()

    async def caller(engine: trioinfer.Engine, nursery: trio.Nursery, i: int) -> None:
        try:
            roll = rng.random()
            with trio.CancelScope() as scope:
                if roll < args.cancel_rate / 2:
                    scope.deadline = trio.current_time() + rng.uniform(0, args.cancel_within)
                elif roll < args.cancel_rate:
                    nursery.start_soon(cancel_later, scope, rng.uniform(0, args.cancel_within))
                t0 = trio.current_time()
                try:
                    result = await infer(i)
                except trioinfer.TrioInferError as exc:
                    tally.outcomes[type(exc).__name__] += 1
                    return
                ended = trio.current_time()
                tally.outcomes["ok"] += 1
                (tally.fallen_back if result.fallbacks else tally.plain).append(ended - t0)
                tally.answers.append((ended, result.instance, result.fallbacks))
                if result.outputs["label"][0] != expected[i % len(rows)]:
                    tally.wrong += 1
            if scope.cancelled_caught:
                tally.outcomes["cancelled"] += 1
        finally:
            waiting.release()

    async def watch_instance_0(engine: trioinfer.Engine) -> None:
        # When the killed instance serves again (re-created, probed, put back).
        nonlocal back_serving
        await crashable.failed.wait()
        while True:  # polled, as in wait_all_serving; 1 ms is the resolution of the figure
            replica = engine.statistics().models[MODEL].replicas[0]
            if replica.state == "serving" and replica.recreated:
                back_serving = trio.current_time()
                return
            await trio.sleep(0.001)

    with assert_no_tasks_left():
        async with trioinfer.open_engine(registry=crashable.registry()) as engine:
            await engine.load(model_config(args))

            # What the ledger records: the ledger keeps each call's arguments as
            # repr() for its messages, and the engine's repr is long (it holds every
            # request in flight), so the call takes the row number only.
            @ledger.wrap
            async def infer(i: int) -> trioinfer.InferenceResult:
                return await engine.infer_detailed(MODEL, {"input": rows[i % len(rows)][None]})

            # Each row's label with no fault, to check every answer of the storm against.
            expected = [
                int((await engine.infer(MODEL, {"input": r[None]}))["label"][0]) for r in rows
            ]
            capacity = await calibrate(engine, rows, args.calibrate)
            rate = capacity * args.overload
            figures["capacity_rps"] = round(capacity)
            figures["target_arrival_rps"] = round(rate)
            print(f"capacity without faults: {capacity:,.0f} req/s; arrivals at {rate:,.0f}/s")
            before = engine.statistics().models[MODEL]
            figures["rss_before_mib"] = round(rss_mib(), 1)

            faulty.error_rate, faulty.hang_rate = args.error_rate, args.hang_rate
            crash_at = math.floor(args.crash_at * args.requests) if args.crash_at < 1 else None
            cpu0 = time.process_time()
            t0 = trio.current_time()
            async with trio.open_nursery() as nursery:
                watcher = trio.CancelScope()

                async def watch() -> None:
                    with watcher:
                        await watch_instance_0(engine)

                nursery.start_soon(watch)
                async with trio.open_nursery() as callers:
                    arrival = t0
                    for i in range(args.requests):
                        if i == crash_at:
                            crashable.crash(0)
                            crash_time = trio.current_time()
                        arrival += rng.expovariate(rate)
                        if arrival > trio.current_time():
                            # Callers due by now start together: a checkpoint per
                            # arrival would cost the event loop a scheduling pass each.
                            await trio.sleep_until(arrival)
                        if not waiting.value:
                            await waiting.acquire()  # --concurrency callers wait: hold arrivals
                        else:
                            waiting.acquire_nowait()
                        callers.start_soon(caller, engine, callers, i)
                    arrived = trio.current_time() - t0
                figures["storm_s"] = round(trio.current_time() - t0, 2)
                figures["achieved_arrival_rps"] = round(args.requests / arrived)
                figures["cpu_s"] = round(time.process_time() - cpu0, 2)
                storm = engine.statistics().models[MODEL]
                assert_all_ended(storm)

                # The faults stop: every instance serves again, and answers with no fallback.
                faulty.error_rate = faulty.hang_rate = 0.0
                figures["all_serving_after_s"] = round(await wait_all_serving(engine, 10.0), 3)
                calm = [await engine.infer_detailed(MODEL, {"input": r[None]}) for r in rows[:30]]
                figures["calm_fallback_steps"] = sum(len(r.fallbacks) for r in calm)
                figures["calm_instances"] = sorted(
                    {r.instance for r in calm if r.instance is not None}
                )
                watcher.cancel()
            figures["rss_after_mib"] = round(rss_mib(), 1)
    figures["rss_peak_mib"] = round(peak_rss_mib(), 1)
    ledger.assert_all_ended()

    calls = ledger.statistics()
    figures["outcomes"] = dict(sorted(tally.outcomes.items()))
    figures["wrong_outputs"] = tally.wrong
    # The storm's share of the counters (the calibration ran before it).
    figures["engine"] = {
        name: getattr(storm, name) - getattr(before, name)
        for name in ("succeeded", "failed", "cancelled", "expired", "refused", "executions")
    } | {
        "fallbacks": dict(storm.fallbacks),
        "replicas": [attrs.asdict(r) for r in storm.replicas],
    }
    figures["faults"] = attrs.asdict(faulty.statistics())
    figures["latency_plain"] = percentiles(tally.plain)
    figures["latency_with_fallback"] = percentiles(tally.fallen_back)
    figures["ledger"] = {"calls": calls.calls, "pending": calls.pending}
    if crash_time is not None:
        first = crashable.first_failure
        figures["crash"] = {"at_s": round(crash_time - t0, 3)}
        if first is not None:
            over = [
                t
                for t, instance, steps in tally.answers
                if t >= first
                and instance not in (0, None)
                and any(s.startswith("failover") for s in steps)
            ]
            figures["crash"]["first_failure_after_crash_ms"] = round((first - crash_time) * 1000, 3)
            figures["crash"]["failed_over_after_ms"] = (
                round((min(over) - first) * 1000, 3) if over else None
            )
            figures["crash"]["back_in_service_after_ms"] = (
                round((back_serving - first) * 1000, 3) if back_serving is not None else None
            )
    return figures


def show(figures: Mapping[str, Any]) -> None:
    """Print the figures, one group a line."""
    outcomes = figures["outcomes"]
    total = sum(outcomes.values())
    print(
        f"storm: {figures['storm_s']} s, arrivals {figures['achieved_arrival_rps']:,}/s "
        f"(target {figures['target_arrival_rps']:,}), CPU {figures['cpu_s']} s"
    )
    print(
        "outcomes: "
        + ", ".join(f"{k} {v:,} ({v / total:.1%})" for k, v in outcomes.items())
        + f"; total {total:,}; wrong outputs {figures['wrong_outputs']}"
    )
    engine = figures["engine"]
    print(
        "engine: "
        + ", ".join(
            f"{k} {engine[k]:,}"
            for k in ("succeeded", "failed", "cancelled", "expired", "refused", "executions")
        )
    )
    print(f"fallback steps: {engine['fallbacks']}")
    for r in engine["replicas"]:
        print(
            f"  instance {r['index']}: {r['state']}, executions {r['executions']:,}, "
            f"failures {r['failures']:,}, taken out {r['taken_out']}, re-created {r['recreated']}"
        )
    faults = figures["faults"]
    print(
        f"faults injected: errors {faults['errors']:,}, hangs {faults['hangs']:,}, "
        f"of {faults['calls']:,} executions"
    )
    for name in ("latency_plain", "latency_with_fallback"):
        p = figures[name]
        print(f"{name}: n {p['n']:,}, p50 {p['p50_ms']} ms, p99 {p['p99_ms']} ms")
    if "crash" in figures:
        print(f"crash of instance 0: {figures['crash']}")
    print(
        f"after the faults: all instances serving after {figures['all_serving_after_s']} s; "
        f"30 calm requests took {figures['calm_fallback_steps']} fallback steps, "
        f"answered by instances {figures['calm_instances']}"
    )
    print(
        f"RSS: before {figures['rss_before_mib']} MiB, after {figures['rss_after_mib']} MiB, "
        f"peak {figures['rss_peak_mib']} MiB"
    )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument(
        "--concurrency", type=int, default=1024, help="most callers waiting at once"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--instances", type=int, default=3)
    parser.add_argument("--max-batch-size", type=int, default=2)
    parser.add_argument("--max-queue-size", type=int, default=64)
    parser.add_argument("--overload", type=float, default=5.0, help="arrivals / capacity")
    parser.add_argument("--error-rate", type=float, default=0.10)
    parser.add_argument("--hang-rate", type=float, default=0.05)
    parser.add_argument("--latency", type=float, default=0.005)
    parser.add_argument("--timeout", type=float, default=0.05, help="the fallback's hang timeout")
    parser.add_argument("--cancel-rate", type=float, default=0.30)
    parser.add_argument("--cancel-within", type=float, default=0.02)
    parser.add_argument("--crash-at", type=float, default=0.5, help="share of arrivals; 1: never")
    parser.add_argument("--calibrate", type=float, default=1.0, help="seconds")
    parser.add_argument(
        "--dispatch",
        default="inline",
        help="the ONNX Runtime backend's dispatch; see the module docstring for why inline",
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Run it and print the figures."""
    args = parse(argv)
    print(
        f"bench_chaos: {args.requests:,} requests, seed {args.seed}, {args.instances} instances; "
        f"{platform.python_implementation()} {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}"
    )
    figures = trio.run(run, args)
    figures["args"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    show(figures)
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
