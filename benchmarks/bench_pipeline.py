"""A three-step pipeline against the same three steps written by hand, one function per request.

The steps are the bundled repository's: ``scale_image`` (Python: an 8x8 image to a
float row), ``digits`` (ONNX Runtime) and ``digit_names`` (Python: probabilities to a
name). Eleven arms, C client tasks each sending one image at a time:

  hand        one async function per request: the request's input checked (dtype and
              shape, as the pipeline checks its input), the two Python steps called
              inline (as their ``dispatch = "inline"`` runs them), the ONNX session run
              the way the pipeline's ``digits`` instance runs it (``--dispatch``): on a
              worker thread of its own (one run at a time), or on the event loop
              after a checkpoint
  hand-model  the hand function served as one Python model (``async def infer``,
              batcher "none") by the engine: what a user writes instead of a
              pipeline, and the engine's cost for one request, beside the pipeline's
              for a request and its three steps
  hand-model-sync  the same as a plain ``def infer`` model, ``dispatch`` = ``--dispatch``
              (inline: on the event loop; thread: the whole function on the
              instance's worker thread): the engine's cost of one request when the
              model never suspends
  hand-model-noawait  the same plain call in an ``async def infer`` that never awaits
              (the ONNX session on the event loop, whatever ``--dispatch``): the
              engine's cost of one request to an async model that does not suspend
  chained     the same three models as the pipeline's, loaded the same way, called by
              hand through the engine: one async function per request awaiting
              ``engine.infer`` on each in turn (what a user writes without a
              pipeline); its every step unbatched, as the pipeline arm's
  chained-batched  the same, with the dynamic batcher on the ONNX model (as onnx-batched)
  pipeline    the ``read_digit`` pipeline, every step unbatched (batcher "none")
  batched     the same pipeline, every step with the dynamic batcher (32 rows, 2 ms)
  onnx-batched  the same pipeline, only the ONNX model (``digits``) with the dynamic
              batcher: the Python steps, a few microseconds each, run unbatched (in the
              request's own task when their model is idle)
  pipeline-batched  the pipeline itself with the dynamic batcher (32 rows, 2 ms), every
              step unbatched: whole requests are batched, and each batch takes one pass
              of the steps, one step request per step carrying the whole batch (as the
              bundled ``read_digit`` is configured)
  pipeline-batched-steps  the same, and every step with the dynamic batcher as well
  ceiling-bare  a study, not a way to serve (``--dispatch inline`` only): the pipeline's
              request validated by the pipeline, then the three loaded instances' own
              calls (the Python steps' ``infer``, the ONNX session's ``run``) in turn, a
              look at each instance's slot, each answer's rows, each step counted in
              its model's statistics: the least any engine that keeps a pipeline's
              steps as models could do per request, with none of a Python model's checks
  ceiling-checked  the same, and the Python steps called as their backend calls them:
              read-only views of their inputs, their outputs checked against the
              declared signature (what the python backend promises every model)

``--arms`` runs every arm but the two ceilings unless it names them. The pipeline arms
other than the last two (before the ceilings) load ``read_digit`` with ``batcher = "none"``
(each request its own pass of the steps). ``--arms hand,batched,pipeline-batched`` runs
only those; ``--pipeline-instances N`` gives the batched pipeline N graph instances (N
batches in flight at once).

Both arms do the same work: one session, one compute thread, one ``RunOptions`` per
run on a worker thread and none inline (as the ONNX Runtime instance runs it; until
2026-12-06 19:10 UTC the hand arm made one inline too); only the engine (queues,
step requests, output checks) is extra. Each arm runs
in its own event loop after a warm-up, the arms alternate (the order reverses every
round), and beside req/s each prints the process's CPU time per request (all threads),
which machine load moves far less than req/s.

Usage:  .venv/bin/python benchmarks/bench_pipeline.py [--duration 5] [--rounds 3]
            [--dispatch thread|inline] [--arms hand,pipeline,...] [--pipeline-instances 1]
            [--hidden H] [--depth 1]

``--hidden H`` runs the ONNX step (in every arm) on an MLP of the digits model's
signature, 64 -> H -> H -> 10 with random weights, instead of the bundled model: the
step's cost as a dial, to show how much of a request the engine's fixed cost per step
is as the steps' own work grows. ``--depth`` sets that model's ``pipeline_depth``.
"""

from __future__ import annotations

import argparse
import atexit
import bisect
import importlib.util
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import trio

import trioinfer
from trioinfer.lowlevel import WorkerThread

REPO = trioinfer.example_repository()

#: The ONNX step's model file: the bundled digits model, or (``--hidden H``) an MLP of the
#: same signature, 64 -> H -> H -> 10, written at start-up: the step's cost as a dial.
ONNX_PATH = REPO / "digits" / "1" / "model.onnx"

#: (requests per second, CPU seconds per request) of one arm's run.
Figures = tuple[float, float]

#: Every arm, in the order they run (reversed every other round).
ARMS = (
    "hand",
    "hand-model",
    "hand-model-sync",
    "hand-model-noawait",
    "chained",
    "chained-batched",
    "pipeline",
    "batched",
    "onnx-batched",
    "pipeline-batched",
    "pipeline-batched-steps",
    "ceiling-bare",
    "ceiling-checked",
)

#: The arms that call the loaded instances' own code on the event loop.
CEILINGS = ("ceiling-bare", "ceiling-checked")


def _model_class(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / name / "1" / "model.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Model


async def closed_loop(call: Callable[[np.ndarray], Awaitable[object]], args: Any) -> Figures:
    images = trioinfer.digits_samples()[0].reshape(-1, 8, 8).astype(np.uint8)
    done = 0

    async def client(i: int) -> None:
        nonlocal done
        while True:
            await call(images[(i + done) % len(images)][np.newaxis])
            done += 1

    async with trio.open_nursery() as nursery:
        for i in range(args.concurrency):
            nursery.start_soon(client, i)
        await trio.sleep(args.warmup)
        start_done, start, start_cpu = done, time.perf_counter(), time.process_time()
        await trio.sleep(args.duration)
        requests = done - start_done
        rate = requests / (time.perf_counter() - start)
        cpu = (time.process_time() - start_cpu) / max(requests, 1)
        nursery.cancel_scope.cancel()
    return rate, cpu


class _Hand:
    """The three steps by hand, one async call per request (``--dispatch`` for the session)."""

    def __init__(self, worker: WorkerThread | None) -> None:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        self.session = ort.InferenceSession(str(ONNX_PATH), options)
        self.scale = _model_class("scale_image")()
        self.names = _model_class("digit_names")(threshold=0.5)
        self.worker = worker
        self.one_run = trio.Lock()  # one session, one run at a time: one instance of depth 1

    def infer_sync(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The three steps in one plain call: where it runs is its caller's choice."""
        row = self.scale.infer({"image": inputs["IMAGE"]})["input"]
        # No RunOptions: nothing can abort a plain call (as the instance runs inline).
        values = self.session.run(["probabilities"], {"input": row})
        named = self.names.infer({"probabilities": values[0]})
        return {"NAME": named["name"], "CONFIDENCE": named["confidence"]}

    async def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        image = inputs["IMAGE"]
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[1:] != (8, 8):
            raise trioinfer.InvalidInput(f"IMAGE must be uint8 [batch, 8, 8], got {image.shape}")
        row = self.scale.infer({"image": image})["input"]
        if self.worker is not None:
            # One RunOptions a run, as the instance makes on its thread (to abort it).
            async with self.one_run:
                values = await self.worker.run_sync(
                    self.session.run, ["probabilities"], {"input": row}, ort.RunOptions()
                )
        else:
            # As an inline execution: a yield first, and no RunOptions (nothing can
            # abort a run on the loop's thread).
            await trio.lowlevel.checkpoint()
            values = self.session.run(["probabilities"], {"input": row})
        named = self.names.infer({"probabilities": values[0]})
        return {"NAME": named["name"], "CONFIDENCE": named["confidence"]}


class _Served:
    """The hand function as a Python model's class: one instance, the same calls."""

    def __init__(self, hand: _Hand) -> None:
        self.hand = hand

    async def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return await self.hand.infer(inputs)


class _ServedSync(_Served):
    """The same as a plain ``def infer`` (a method of the class, as the backend looks for)."""

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:  # type: ignore[override]
        return self.hand.infer_sync(inputs)


class _ServedNoAwait(_Served):
    """The same plain call in an ``async def infer`` that never awaits."""

    async def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.hand.infer_sync(inputs)


async def by_hand(
    args: argparse.Namespace, *, served: bool = False, sync: bool = False, eager: bool = False
) -> Figures:
    # sync: the model's plain def infer runs where its dispatch says, not on our worker;
    # eager: an async def infer that never awaits (the session on the event loop).
    worker = (
        await WorkerThread.start("hand-digits")
        if args.dispatch == "thread" and not (sync or eager)
        else None
    )
    hand = _Hand(worker)
    try:
        if not served:

            async def call(image: np.ndarray) -> object:
                return (await hand.infer({"IMAGE": image}))["NAME"]

            return await closed_loop(call, args)
        bundled = trioinfer.ModelConfig.from_toml(REPO / "read_digit" / "config.toml")
        signature = {k: bundled.backend_options[k] for k in ("inputs", "outputs")}
        async with trioinfer.open_engine() as engine:
            await engine.load(
                trioinfer.ModelConfig.from_dict(
                    {
                        "name": "hand",
                        "path": "-",
                        "backend": "python",
                        "backend_options": {
                            "class": _ServedSync if sync else _ServedNoAwait if eager else _Served,
                            "parameters": {"hand": hand},
                            **({"dispatch": args.dispatch} if sync else {}),
                            **signature,
                        },
                        "batcher": "none",
                    }
                )
            )

            async def served_call(image: np.ndarray) -> object:
                return (await engine.infer("hand", {"IMAGE": image}))["NAME"]

            return await closed_loop(served_call, args)
    finally:
        if worker is not None:
            await worker.aclose()


DYNAMIC = {
    "batcher": "dynamic",
    "batcher_options": {"max_batch_size": 32, "max_queue_delay": 0.002},
}


async def load_steps(
    engine: trioinfer.Engine, args: argparse.Namespace, *, batched: bool, only_onnx: bool
) -> None:
    """Load the pipeline's three models (batched: with the dynamic batcher; only_onnx: digits)."""
    dynamic = DYNAMIC
    for name in ("scale_image", "digits", "digit_names"):
        config = trioinfer.ModelConfig.from_toml(REPO / name / "config.toml")
        on = batched and (not only_onnx or config.backend == "onnxruntime")
        batching = dynamic if on else {"batcher": "none"}
        data = {**config.backend_options}
        path = config.path
        if config.backend == "onnxruntime":
            data["dispatch"] = args.dispatch  # as the hand arm runs it
            data["pipeline_depth"] = args.depth
            if args.dispatch == "inline":
                # Inline however long a run takes, as the hand arm runs it: past the
                # default budget (250 us, a large --hidden) the instance would move
                # its runs to its worker thread, and the arms would differ in that.
                data["inline_budget_us"] = 10_000_000  # the most the option takes
            path = str(ONNX_PATH)
        await engine.load(
            trioinfer.ModelConfig.from_dict(
                {
                    "name": name,
                    "path": path,
                    "backend": config.backend,
                    "backend_options": data,
                    "instances": [{"threads": 1}],
                    **batching,
                }
            )
        )


async def chained(args: argparse.Namespace, *, batched: bool) -> Figures:
    """The pipeline's three models, called in turn by one function per request."""
    async with trioinfer.open_engine() as engine:
        await load_steps(engine, args, batched=batched, only_onnx=True)

        async def call(image: np.ndarray) -> object:
            row = (await engine.infer("scale_image", {"image": image}))["input"]
            scores = (await engine.infer("digits", {"input": row}))["probabilities"]
            return (await engine.infer("digit_names", {"probabilities": scores}))["name"]

        return await closed_loop(call, args)


async def load_pipeline(engine: trioinfer.Engine, args: argparse.Namespace, *, whole: bool) -> None:
    """Load the bundled ``read_digit`` pipeline (whole: batching whole requests)."""
    bundled = trioinfer.ModelConfig.from_toml(REPO / "read_digit" / "config.toml")
    await engine.load(
        trioinfer.ModelConfig.from_dict(
            {
                "name": "read_digit",
                "path": bundled.path,
                "backend": "pipeline",
                "backend_options": dict(bundled.backend_options),
                "instances": [{"count": args.pipeline_instances}],
                **(DYNAMIC if whole else {"batcher": "none"}),
            }
        )
    )


async def as_pipeline(
    args: argparse.Namespace, *, batched: bool, only_onnx: bool = False, whole: bool = False
) -> Figures:
    # batched: the steps' models batch (only_onnx: only digits); whole: the pipeline does.
    async with trioinfer.open_engine() as engine:
        await load_steps(engine, args, batched=batched, only_onnx=only_onnx)
        await load_pipeline(engine, args, whole=whole)

        async def call(image: np.ndarray) -> object:
            return (await engine.infer("read_digit", {"IMAGE": image}))["NAME"]

        return await closed_loop(call, args)


async def ceiling(args: argparse.Namespace, *, checked: bool) -> Figures:
    """The least per request of an engine that keeps the steps as models (see the arms)."""
    async with trioinfer.open_engine() as engine:
        await load_steps(engine, args, batched=False, only_onnx=False)
        await load_pipeline(engine, args, whole=False)
        return await closed_loop(ceiling_chain(engine, checked=checked), args)


def ceiling_chain(
    engine: trioinfer.Engine, *, checked: bool
) -> Callable[[np.ndarray], Awaitable[object]]:
    """A ceiling arm's call for one image: the loaded ``read_digit``'s steps, by hand.

    Reads the engine's private state (the loaded runners, replicas and instances):
    a study of where the unbatched pipeline's time could go, not an API. Its
    answer is the pipeline's ``NAME``.
    """
    from trioinfer._inline import DEFAULT_SLICE_S, inline_slice_spent, restart_inline_slice
    from trioinfer_python import _read_only

    pipeline = engine._pipes["read_digit"]
    clock = pipeline.clock
    steps = []
    for index, step in enumerate(pipeline.steps):
        runner = engine._plain[step.model]
        replica = runner._biggest_first[0]
        instance = replica._backend_instance
        if step.model == "digits":

            def run(
                inputs: dict[str, Any],
                session: Any = instance.session,
                names: list[str] = ["probabilities"],  # noqa: B006  (the step keeps it alone)
            ) -> dict[str, Any]:
                return dict(zip(names, session.run(names, inputs), strict=True))

        elif checked:

            def run(inputs: dict[str, Any], instance: Any = instance) -> dict[str, Any]:
                return instance._checked(instance._infer(_read_only(inputs)))

        else:
            run = instance._infer
        ins, outs, _ = pipeline._maps[index]
        steps.append((runner, replica._slot, run, ins, outs, runner._answered_here))

    async def call(image: np.ndarray) -> object:
        arrays, rows = pipeline.validate({"IMAGE": image})
        if clock.current_effective_deadline() <= clock.current_time():
            raise trioinfer.DeadlineExceeded("past its deadline")
        if inline_slice_spent(DEFAULT_SLICE_S):
            # As the pipeline leaves the loop its turns.
            await trio.lowlevel.checkpoint()
            restart_inline_slice()
        tensors = dict(arrays)
        for runner, slot, run, ins, outs, here in steps:
            if not slot.free or slot._waiters:
                raise RuntimeError("an instance was busy: nothing else calls it here")
            inputs = {}
            for own, shared in ins:
                inputs[own] = tensors[shared]
            start = clock.current_time()
            answer = run(inputs)
            for array in answer.values():
                if type(array) is not np.ndarray or len(array) != rows:
                    raise trioinfer.BackendError("an answer of other rows")
            elapsed = clock.current_time() - start
            here.counts[bisect.bisect_left(here.bounds, elapsed)] += 1
            here.count += 1
            here.sum += elapsed
            runner.succeeded += 1
            runner.inferences += rows
            for own, shared in outs:
                tensors[shared] = answer[own]
        pipeline.succeeded += 1
        return tensors["NAME"]

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument(
        "--dispatch",
        choices=("thread", "inline"),
        default="thread",
        help="where both arms run the ONNX session: a worker thread, or the event loop",
    )
    parser.add_argument(
        "--arms",
        default=",".join(arm for arm in ARMS if arm not in CEILINGS),
        help=f"the arms to run, comma-separated, from {', '.join(ARMS)} (default: all but "
        "the ceilings, which run only when named)",
    )
    parser.add_argument(
        "--pipeline-instances",
        type=int,
        default=1,
        help="graph instances of a batched pipeline (batches in flight at once)",
    )
    parser.add_argument(
        "--hidden",
        type=int,
        default=0,
        help="run the ONNX step on an MLP 64 -> H -> H -> 10 of random weights instead of "
        "the bundled digits model (0, the default): how the ratios move with the step's cost",
    )
    parser.add_argument(
        "--depth",
        type=int,
        default=1,
        help="the ONNX step model's pipeline_depth (executions its instance may hold at once)",
    )
    args = parser.parse_args()
    arms = [arm.strip() for arm in args.arms.split(",") if arm.strip()]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown or not arms:
        parser.error(f"unknown arm {', '.join(unknown) or '(none)'}; known: {', '.join(ARMS)}")
    if args.pipeline_instances < 1:
        parser.error("--pipeline-instances must be at least 1")
    if args.dispatch != "inline" and set(arms) & set(CEILINGS):
        parser.error(f"{', '.join(CEILINGS)} run the session on the event loop: --dispatch inline")
    if args.hidden < 0:
        parser.error("--hidden must be 0 (the digits model) or a layer width")
    global ONNX_PATH
    if args.hidden:
        from trioinfer.testing.models import write_mlp

        folder = Path(tempfile.mkdtemp(prefix="bench_pipeline-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        ONNX_PATH = write_mlp(
            folder / "mlp.onnx", (64, args.hidden, args.hidden, 10), output_name="probabilities"
        )
    every: dict[str, Callable[[], Awaitable[Figures]]] = {
        "hand": lambda: by_hand(args),
        "hand-model": lambda: by_hand(args, served=True),
        "hand-model-sync": lambda: by_hand(args, served=True, sync=True),
        "hand-model-noawait": lambda: by_hand(args, served=True, eager=True),
        "chained": lambda: chained(args, batched=False),
        "chained-batched": lambda: chained(args, batched=True),
        "pipeline": lambda: as_pipeline(args, batched=False),
        "batched": lambda: as_pipeline(args, batched=True),
        "onnx-batched": lambda: as_pipeline(args, batched=True, only_onnx=True),
        "pipeline-batched": lambda: as_pipeline(args, batched=False, whole=True),
        "pipeline-batched-steps": lambda: as_pipeline(args, batched=True, whole=True),
        "ceiling-bare": lambda: ceiling(args, checked=False),
        "ceiling-checked": lambda: ceiling(args, checked=True),
    }
    runs = {name: every[name] for name in ARMS if name in arms}
    figures: dict[str, list[Figures]] = {name: [] for name in runs}
    for round_ in range(args.rounds):
        order = list(runs) if round_ % 2 == 0 else list(reversed(runs))
        for name in order:
            rate, cpu = trio.run(runs[name])
            figures[name].append((rate, cpu))
            print(f"round {round_ + 1}: {name:<22} {rate:8.0f} req/s {cpu * 1e6:6.0f} us CPU/req")
    hand = figures.get("hand")
    for name in runs:
        if name == "hand":
            continue
        line = (
            f"{name}: median {statistics.median(f[0] for f in figures[name]):.0f} req/s, "
            f"CPU/req {statistics.median(f[1] for f in figures[name]) * 1e6:.0f} us"
        )
        if hand is not None:
            ratios = [b[0] / a[0] for a, b in zip(hand, figures[name], strict=True)]
            cpu_ratios = [a[1] / b[1] for a, b in zip(hand, figures[name], strict=True)]
            line += (
                f"; {statistics.median(ratios):.2f}x hand "
                f"({', '.join(f'{r:.2f}' for r in ratios)}), hand's CPU/req over its "
                f"{statistics.median(cpu_ratios):.2f}x"
            )
        print(line)
    if hand is not None:
        print(
            f"hand: median {statistics.median(f[0] for f in hand):.0f} req/s, CPU/req "
            f"{statistics.median(f[1] for f in hand) * 1e6:.0f} us"
        )
    print(
        f"C={args.concurrency}, dispatch {args.dispatch}, pipeline instances "
        f"{args.pipeline_instances}, ONNX step "
        + (f"MLP 64-{args.hidden}-{args.hidden}-10" if args.hidden else "digits")
        + f", pipeline_depth {args.depth}; the hand arm runs the session as the instance "
        + (
            "does inline (a yield first, no RunOptions)"
            if args.dispatch == "inline"
            else "does on its thread (one RunOptions a run)"
        )
    )


if __name__ == "__main__":
    main()
