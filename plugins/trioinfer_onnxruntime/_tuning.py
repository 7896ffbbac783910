"""Batch-size tuning: the ``tune_batch_sizes`` option.

An instance times the model at each listed batch size when it loads (off the
event loop, on its worker thread) and advertises the smallest that serves
about as many rows per second as the best as its ``preferred_batch_sizes``.
Figures are kept per model file, device, thread count and sizes, so that a
model loaded again does not measure again.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from typing import Any, Final

import numpy as np

from trioinfer import BackendError, ConfigError, ModelSignature, TensorSpec
from trioinfer.lowlevel import WorkerThread

from ._ort import _one_line, _ort

#: ``tune_batch_sizes`` prefers the smallest batch whose rows/s is within this
#: fraction of the best: timings on a shared machine move by a few percent, and
#: of two sizes that serve alike the smaller answers its requests sooner.
TUNE_TOLERANCE: Final = 0.05
#: What the engine adds to each execution beyond ``session.run`` (a hop to the
#: worker thread and back, concatenating and splitting), counted when comparing
#: sizes: a model whose rows cost the same at any batch size but run in
#: microseconds still serves far more rows in big batches.
TUNE_OVERHEAD_S: Final = 150e-6
#: Each tuned size runs once untimed (a new shape allocates), then is timed at
#: least TUNE_RUNS times and TUNE_MIN_S in all, but no more once the timed runs
#: add up to TUNE_MAX_S; its figure is the fastest run, the one least disturbed.
TUNE_RUNS: Final = 3
TUNE_MIN_S: Final = 0.05
TUNE_MAX_S: Final = 1.0


def preferred_batch_size(rates: Mapping[int, float], overhead_s: float = TUNE_OVERHEAD_S) -> int:
    """The batch size to prefer, given raw rows/s by batch size.

    Each size's rate is first charged *overhead_s* per execution (what serving
    a batch costs beyond running the model); the answer is the smallest size
    whose charged rate is within `TUNE_TOLERANCE` of the best charged rate.

    Raises:
        ValueError: If *rates* is empty.
    """
    if not rates:
        raise ValueError("no batch sizes were timed")
    served = {size: size / (size / rate + overhead_s) for size, rate in rates.items()}
    floor = (1 - TUNE_TOLERANCE) * max(served.values())
    return min(size for size, rate in served.items() if rate >= floor)


#: Rows/s by batch size already measured in this process, by model file (path and
#: modification time), device, thread count and sizes: an instance re-created
#: after a failure, or a model loaded again, does not measure again.
_tuned: dict[tuple[Any, ...], dict[int, float]] = {}


def _mtime(path: str | os.PathLike[str]) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return math.nan


async def _tune(
    worker: WorkerThread,
    session: Any,
    signature: ModelSignature,
    label: str,
    sizes: list[int],
    clock: Callable[[], float],
) -> dict[int, float]:
    # Off the loop on the instance's own thread; a cancelled load stops the run in progress.
    run_options = _ort().RunOptions()

    def abort() -> None:
        run_options.terminate = True

    return await worker.run_sync(
        _time_batch_sizes, session, signature, label, sizes, clock, run_options, abort=abort
    )


def _time_batch_sizes(
    session: Any,
    signature: ModelSignature,
    label: str,
    sizes: list[int],
    clock: Callable[[], float],
    run_options: Any,
) -> dict[int, float]:
    # Runs on the worker thread, before the instance serves anything; a cancelled
    # load sets run_options.terminate, which stops the run in progress. The signature
    # is the instance's (sizes the config fixes included, so those can be sampled).
    _check_tunable(label, signature)
    outputs = [spec.name for spec in signature.outputs]
    rng = np.random.default_rng(0)
    rates: dict[int, float] = {}
    for size in sizes:
        try:
            inputs = {spec.name: _sample(spec, size, rng) for spec in signature.inputs}
            session.run(outputs, inputs, run_options)
            runs, spent, fastest = 0, 0.0, math.inf
            while (runs < TUNE_RUNS or spent < TUNE_MIN_S) and not (runs and spent >= TUNE_MAX_S):
                started = clock()
                session.run(outputs, inputs, run_options)
                took = clock() - started
                runs, spent, fastest = runs + 1, spent + took, min(fastest, took)
        except Exception as exc:
            raise BackendError(
                f"{label}: tune_batch_sizes could not run a batch of {size} rows of sample "
                f"data: {_one_line(exc)}"
            ) from exc
        rates[size] = size / max(fastest, 1e-9)
    return rates


def _sample(spec: TensorSpec, rows: int, rng: np.random.Generator) -> np.ndarray[Any, Any]:
    # Normal noise for floating-point inputs; zeros, a valid index into any
    # table, for integer ones (token ids, masks, categories).
    shape = (rows, *[d for d in spec.shape[1:] if isinstance(d, int)])  # all are: checked
    dtype = spec.dtype
    assert dtype is not None  # _check_tunable refused the rest
    if dtype.kind == "f":
        noise = rng.standard_normal(shape, dtype=np.float64 if dtype.itemsize > 4 else np.float32)
        return noise.astype(dtype, copy=False)
    return np.zeros(shape, dtype)


def _check_tunable(label: str, signature: ModelSignature) -> None:
    # tune_batch_sizes makes its own sample batches: every dimension but the first must be known.
    instead = "; set the batcher's preferred_batch_sizes yourself instead"
    if not signature.batched:
        kind, spec = next(
            (kind, t)
            for kind, tensors in (("input", signature.inputs), ("output", signature.outputs))
            for t in tensors
            if not t.shape or isinstance(t.shape[0], int)
        )
        raise ConfigError(
            f"{label}: tune_batch_sizes needs a batch dimension (a variable first dimension "
            f"on every input and output); {kind} {spec.name!r} is {spec.describe()}{instead}"
        )
    for spec in signature.inputs:
        if spec.dtype is None or spec.dtype.kind not in "fiub":
            raise ConfigError(
                f"{label}: tune_batch_sizes can only make sample data for numeric or "
                f"boolean inputs; input {spec.name!r} is {spec.describe()}{instead}"
            )
        if not all(isinstance(d, int) and d > 0 for d in spec.shape[1:]):
            raise ConfigError(
                f"{label}: tune_batch_sizes needs every input dimension after the first "
                f"to be fixed, to make sample batches; input {spec.name!r} is "
                f"{spec.describe()}{instead}"
            )
