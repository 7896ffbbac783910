"""Run the stress test's plans (tests/test_stress.py) by the thousand, seeded, for rare races.

Hypothesis shrinks and replays, which a search for a 1-in-1000 interleaving does
not need: this draws plans from a seeded `random.Random` (seed *i* is plan *i*,
so a failure is replayed by its seed alone), runs each as the stress test does,
and prints the seed and the plan of each that fails. The callers' models and the
reloads can be narrowed to some models (a batched pipeline and its steps, say),
which makes a race there many times likelier per plan.

Usage, from the repository root::

    PYTHONPATH=$PWD/src:$PWD/plugins python scripts/stress_loop.py \\
        --backend trio|trio-real|asyncio --seed 0 --plans 2000 \\
        [--models p_batched,p_batched,d_batched] [--reloads p_batched,b_inline,b_async]
"""

from __future__ import annotations

import argparse
import faulthandler
import random
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import anyio
import trio.testing

import test_stress as ts
from trioinfer.testing import models

TIMES = [0.0, 0.0, 0.0005, 0.001, 0.002, 0.005]


def plan(rng: random.Random, called: list[str], reloaded: list[str]) -> ts.Plan:
    """A plan as test_stress._plans draws them, from *rng*."""
    callers = [
        ts.Caller(
            rng.choice(called),
            rng.choice(["infer", "infer", "infer_detailed", "infer_stream"]),
            rng.choice(ts.VALUES),
            rng.randint(1, 3),
            rng.choice(TIMES),
            rng.choice(["none", "none", "before", "checkpoints", "after", "deadline"]),
            rng.choice([0, 1, 2, 3, 5, 0.0005, 0.001, 0.003]),
        )
        for _ in range(rng.randint(1, 14))
    ]
    reloads = [
        (rng.choice(TIMES), rng.choice(reloaded), rng.choice([*TIMES, -1.0]))
        for _ in range(rng.randint(0, 2))
    ]
    return ts.Plan(
        callers,
        reloads,
        rng.choice([0.0, 0.001, 0.003, 0.01, 1.0]),
        rng.choice([0.0, 0.002, 10.0]),
        rng.randint(0, 2**32 - 1),
    )


class _Patches:
    """monkeypatch.setattr's part that _random_slice uses, undone after each plan."""

    def __init__(self) -> None:
        self.undo: list[tuple[Any, str, Any]] = []

    def setattr(self, target: Any, name: str, value: Any) -> None:
        self.undo.append((target, name, getattr(target, name)))
        setattr(target, name, value)

    def reset(self) -> None:
        for target, name, value in reversed(self.undo):
            setattr(target, name, value)
        self.undo.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("trio", "trio-real", "asyncio"), default="trio")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plans", type=int, default=1000)
    parser.add_argument("--models", default=",".join(ts.CALLED))
    steps = sorted({step for used in ts.PIPELINES.values() for step in used})
    parser.add_argument("--reloads", default=",".join([*ts.CALLED, *steps]))
    parser.add_argument("--hang-s", type=float, default=120.0, help="dump the stacks and exit")
    args = parser.parse_args()
    called, reloaded = args.models.split(","), args.reloads.split(",")
    add = models.write_add(Path(tempfile.mkdtemp()) / "add.onnx")
    failed = 0
    for seed in range(args.seed, args.seed + args.plans):
        if seed % 100 == 0:
            print(f"at seed {seed}", flush=True)
        p = plan(random.Random(seed), called, reloaded)
        patches = _Patches()
        ts._random_slice(patches, p.slice_seed)  # type: ignore[arg-type]
        faulthandler.dump_traceback_later(args.hang_s, exit=True)
        try:
            if args.backend == "trio":
                clock = trio.testing.MockClock(autojump_threshold=0)
                anyio.run(ts.run_plan, p, add, backend="trio", backend_options={"clock": clock})
            else:
                backend = "trio" if args.backend == "trio-real" else "asyncio"
                anyio.run(ts.run_plan, p, add, True, backend=backend)
        except Exception:
            failed += 1
            print(f"FAILED seed {seed}: {p!r}", flush=True)
            traceback.print_exc()
        finally:
            faulthandler.cancel_dump_traceback_later()
            patches.reset()
    print(f"{args.plans} plans from seed {args.seed}: {failed} failed", flush=True)


if __name__ == "__main__":
    main()
