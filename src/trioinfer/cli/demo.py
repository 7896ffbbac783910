"""``trioinfer demo``: the bundled example model under load, each request in its own scope."""

from __future__ import annotations

import collections
import functools
import math
from collections.abc import Sequence
from typing import Final

import attrs
import click
import numpy as np
import numpy.typing as npt
import trio

from .. import __version__
from .._config import MAX_INSTANCES, Instance, ModelConfig
from .._engine import Engine, open_engine
from .._examples import digits_samples, example_repository
from .._exceptions import TrioInferError
from .._runner import ModelStatistics
from ._params import Seconds

#: The example model the demo runs.
DEMO_MODEL: Final = "digits"
#: The demo's second phase sends this many requests at once.
TIGHT_REQUESTS: Final = 64
#: Phase 2's deadline, as a fraction of the time phase 1 took to answer TIGHT_REQUESTS requests.
TIGHT_FRACTION: Final = 0.25
#: ... but never under this many seconds.
MIN_TIGHT_DEADLINE: Final = 0.0005


_LABEL_WIDTH: Final = 18


@click.command(short_help="Run the bundled example model under concurrent load and report.")
@click.option(
    "--requests",
    type=click.IntRange(min=1),
    default=2000,
    show_default=True,
    metavar="N",
    help="How many requests to send, one image each.",
)
@click.option(
    "--concurrency",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    metavar="TASKS",
    help="How many Trio tasks send requests at the same time.",
)
@click.option(
    "--instances",
    # A model's bound: past it the model would fail to load (exit 1), not be refused as usage.
    type=click.IntRange(1, MAX_INSTANCES),
    default=2,
    show_default=True,
    metavar="COUNT",
    help="How many model instances (ONNX Runtime sessions) to run, one CPU thread each.",
)
@click.option(
    "--deadline",
    type=Seconds(),
    default=0.05,
    show_default=True,
    metavar="SECONDS",
    help="Each request's time limit: its caller wraps it in trio.move_on_after(SECONDS).",
)
def demo(requests: int, concurrency: int, instances: int, deadline: float) -> None:
    """Run the bundled digits model under concurrent load and report what happened.

    Loads the example model "digits" (a small MLP that classifies 8x8 images
    of handwritten digits) on COUNT CPU instances, one request per execution
    (no batching). Then N requests of one held-out image each are sent from
    TASKS concurrent Trio tasks, each request under its own
    trio.move_on_after(SECONDS): in trioinfer the caller's cancel scope is the
    timeout. The report gives where the model runs, the accuracy of the
    answers against the known labels, how many requests were answered, timed
    out or failed (by error class), wall time, throughput, latency percentiles
    of the answered requests, and the engine's own counters.

    A second phase sends 64 requests at once with a deadline of a quarter of
    the time the first phase took to answer 64 (at least 0.5 ms, at most
    SECONDS), shorter than most of them must wait in the queue. The engine's
    counters, read before and after, show how many were computed and how many
    left the queue when their callers gave up, never computed.

    Exits with status 1 if the model cannot be loaded.
    """
    try:
        trio.run(
            functools.partial(
                _demo,
                requests=requests,
                concurrency=concurrency,
                instances=instances,
                deadline=deadline,
            )
        )
    except TrioInferError as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from exc


@attrs.define(eq=False)
class _Outcomes:
    # What the callers saw, tallied as their requests end.
    ok: int = 0
    correct: int = 0
    timed_out: int = 0
    errors: collections.Counter[str] = attrs.field(factory=collections.Counter)
    latencies: list[float] = attrs.field(factory=list)

    @property
    def failed(self) -> int:
        return sum(self.errors.values())


async def _demo(*, requests: int, concurrency: int, instances: int, deadline: float) -> None:
    config = ModelConfig.from_toml(example_repository() / DEMO_MODEL / "config.toml")
    config = attrs.evolve(
        config,
        instances=(Instance("cpu", count=instances, threads=1),),
        # One request per execution, so that executions count requests in phase 2.
        batcher="none",
        batcher_options={},
    )
    images, labels = digits_samples()
    async with open_engine() as engine:
        info = await engine.load(config)
        click.echo(f"trioinfer {__version__} demo\n")
        model_file = config.model_file("the .onnx file")
        _row("model", f"{info.name}, version {model_file.parent.name}")
        _row("file", str(model_file))
        _row("runs on", f"{_devices(info.devices)}  (1 compute thread per instance)")

        click.echo()
        _row(
            "phase 1",
            f"{requests} requests from {concurrency} tasks, "
            f"each under trio.move_on_after({deadline:g})",
        )
        start = trio.current_time()
        seen = await _send(
            engine, images, labels, requests=requests, concurrency=concurrency, deadline=deadline
        )
        wall = trio.current_time() - start
        _report_outcomes(seen)
        if seen.ok:
            accuracy = f"{seen.correct / seen.ok:.3f}  ({seen.correct} of {seen.ok} answers right)"
        else:
            accuracy = "n/a  (no request was answered)"
        _row("accuracy", accuracy, indent=2)
        _row("wall time", f"{wall:.2f} s", indent=2)
        _row("throughput", f"{requests / wall:.0f} requests/s", indent=2)
        if seen.latencies:
            p50, p90, p99 = np.percentile(np.array(seen.latencies) * 1000, [50, 90, 99])
            _row(
                "latency",
                f"p50 {p50:.2f} ms   p90 {p90:.2f} ms   p99 {p99:.2f} ms"
                "  (answered requests: queue wait + compute)",
                indent=2,
            )
        stats = _model_statistics(engine)
        _row(
            "engine",
            f"executions {stats.executions}   expired {stats.expired}   "
            f"cancelled {stats.cancelled}   refused {stats.refused}   "
            f"mean execution {stats.mean_execution_s * 1000:.2f} ms",
            indent=2,
        )

        # Phase 2: a deadline well under the time the queue takes to drain, so that most
        # callers give up while their request waits. Scaled by phase 1's rate so that it
        # is "too tight" on a fast machine as on a slow one.
        rate = seen.ok / wall
        drain = TIGHT_REQUESTS / rate if rate else math.inf
        tight = max(MIN_TIGHT_DEADLINE, min(TIGHT_FRACTION * drain, deadline))
        click.echo()
        _row(
            "phase 2",
            f"{TIGHT_REQUESTS} requests at once, each under trio.move_on_after({tight:.2g}):",
        )
        if rate:
            _row("", f"(phase 1 answered {TIGHT_REQUESTS} requests every {drain * 1000:.1f} ms)")
        before = _model_statistics(engine)
        burst = await _send(
            engine,
            images,
            labels,
            requests=TIGHT_REQUESTS,
            concurrency=TIGHT_REQUESTS,
            deadline=tight,
        )
        after = _model_statistics(engine)
        _report_outcomes(burst)
        executions = after.executions - before.executions
        expired = after.expired - before.expired
        refused = after.refused - before.refused
        cancelled = after.cancelled - before.cancelled
        never = TIGHT_REQUESTS - executions
        _row(
            "computed",
            f"{executions:>6}  backend executions (engine.statistics() before/after)",
            indent=2,
        )
        if executions > burst.ok:
            # Why more were computed than answered: a caller may give up mid-run.
            _row(
                "",
                f"{executions - burst.ok:>6}  of them started in time, but their caller's scope "
                "expired before the answer reached it: while the request ran (the run is "
                "then aborted where the backend can), or as it ended",
                indent=2,
            )
        _row(*_never_computed(never, expired, refused), indent=2)
        _row(
            "engine",
            f"executions +{executions}   expired +{expired}   cancelled +{cancelled}   "
            f"refused +{refused}",
            indent=2,
        )


async def _send(
    engine: Engine,
    images: npt.NDArray[np.float32],
    labels: npt.NDArray[np.int64],
    *,
    requests: int,
    concurrency: int,
    deadline: float,
) -> _Outcomes:
    # `concurrency` tasks take request numbers from one shared iterator until it runs out.
    seen = _Outcomes()
    numbers = iter(range(requests))

    async def client() -> None:
        for n in numbers:
            row = n % len(images)
            start = trio.current_time()
            with trio.move_on_after(deadline) as scope:
                try:
                    outputs = await engine.infer(DEMO_MODEL, {"input": images[row : row + 1]})
                except TrioInferError as exc:
                    seen.errors[type(exc).__name__] += 1
                else:
                    seen.latencies.append(trio.current_time() - start)
                    seen.ok += 1
                    seen.correct += int(outputs["label"][0] == labels[row])
            if scope.cancelled_caught:
                seen.timed_out += 1

    async with trio.open_nursery() as nursery:
        for _ in range(min(concurrency, requests)):
            nursery.start_soon(client)
    return seen


def _never_computed(never: int, expired: int, refused: int) -> tuple[str, str]:
    """The report's row on the requests of phase 2 that no execution computed.

    Those neither expired nor refused were cancelled by their caller's scope: in
    the queue, or at the yield before an inline request (the engine counts both
    as cancelled).
    """
    return (
        "never computed",
        f"{never:>6}  cancelled by their caller {never - expired - refused}, expired in "
        f"the queue {expired}, refused {refused}",
    )


def _model_statistics(engine: Engine) -> ModelStatistics:
    return engine.statistics().models[DEMO_MODEL]


def _report_outcomes(seen: _Outcomes) -> None:
    _row("ok", f"{seen.ok:>6}  answered", indent=2)
    _row("timed out", f"{seen.timed_out:>6}  (the caller's scope expired)", indent=2)
    kinds = ", ".join(f"{name} {count}" for name, count in sorted(seen.errors.items()))
    _row("errors", f"{seen.failed:>6}" + (f"  ({kinds})" if kinds else ""), indent=2)


def _devices(devices: Sequence[str]) -> str:
    counts = collections.Counter(devices)
    return ", ".join(f"{count} x {device}" for device, count in counts.items())


def _row(label: str, text: str, *, indent: int = 0) -> None:
    click.echo(" " * indent + label.ljust(_LABEL_WIDTH - indent) + text)
