"""The ONNX Runtime backend plugin: one InferenceSession per instance, on CPU, CUDA or TensorRT.

Entry point ``onnxruntime`` in group ``trioinfer.backends``. Before a session
is created on a GPU execution provider, the backend checks (once per device)
that the provider really works here, and says why in one line when it does
not; it then falls back to the CPU only if the model's config allows it.

Where compute runs is chosen by the ``dispatch`` backend option: ``"thread"``
runs ``session.run`` on the instance's own worker thread; ``"ort_async"`` uses
ONNX Runtime's ``run_async``, whose callback wakes the event loop; ``"inline"``
runs it on the event loop's thread within a time budget; ``"auto"`` (the
default on the CPU) measures on the thread and goes inline when that is
cheaper than the hop. Off the loop, a cancelled execution is aborted with
``RunOptions.terminate``.

With the ``tune_batch_sizes`` option an instance times the model at each of
those batch sizes when it loads and advertises the smallest that serves about
as many rows per second as the best (within ``TUNE_TOLERANCE``, counting
``TUNE_OVERHEAD_S`` per execution) as its ``preferred_batch_sizes``, which the
dynamic batcher then cuts batches at.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import logging
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final, final

import anyio
import anyio.lowlevel
import numpy as np

from trioinfer import (
    BackendError,
    BackendUnavailable,
    ConfigError,
    Device,
    ModelConfig,
    ModelSignature,
    TensorSpec,
)
from trioinfer.lowlevel import Placement, WorkerThread, numpy_dtype, wait_on_callback

__all__ = [
    "AUTO_SAMPLES",
    "OPTIONS",
    "TUNE_OVERHEAD_S",
    "TUNE_TOLERANCE",
    "OnnxRuntimeBackend",
    "OnnxRuntimeInstance",
    "preferred_batch_size",
    "probe_device",
]

log = logging.getLogger("trioinfer.onnxruntime")

_PROVIDERS: Final = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}
_DISPATCH: Final = ("thread", "ort_async", "inline", "auto")
#: Executions an 'auto' instance measures on its thread before it may go inline.
AUTO_SAMPLES: Final = 32
#: ``auto`` tries inline when the median on the thread is under this many budgets.
#: On the thread an execution shares the cores with the busy event loop and
#: costs up to three times the CPU it costs inline (a 32-row digits batch: about
#: 300 us there, 100 us inline), so the thread's figure only rules out models
#: that could hold the loop for long; the inline rule decides.
AUTO_TRIAL_BUDGETS: Final = 4
_OPT_LEVELS: Final = {
    "disable": "ORT_DISABLE_ALL",
    "basic": "ORT_ENABLE_BASIC",
    "extended": "ORT_ENABLE_EXTENDED",
    "all": "ORT_ENABLE_ALL",
}
#: The default ``inline_budget_us``. A hop to a worker thread and back costs
#: 100-150 us of CPU on a small machine; an execution of up to about two hops
#: is cheaper on the loop's thread than handed off (a 32-row batch of the
#: digits MLP costs about 100 us there, its caches cold from the loop's other
#: work), and holds the loop no longer than a few hops would.
DEFAULT_INLINE_BUDGET_US: Final = 250
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
#: Every ``backend_options`` key this backend accepts, with what it means.
OPTIONS: Final[Mapping[str, str]] = {
    "dispatch": "'thread': session.run on the instance's worker thread (default on a GPU); "
    "'ort_async': ONNX Runtime's run_async (needs threads >= 2); "
    "'inline': on the event loop's thread, for models far cheaper than a thread hop, "
    "within inline_budget_us; 'auto' (default on the CPU): measure on the thread, "
    "go inline if cheap enough",
    "inline_budget_us": "execution time, in microseconds, allowed on the event loop's thread "
    "(moving average; one run may take up to 10x) before an 'inline' or 'auto' instance "
    f"moves to its worker thread (default {DEFAULT_INLINE_BUDGET_US})",
    "inter_op_threads": "threads for running independent nodes in parallel (0: ORT default)",
    "graph_optimization_level": "'disable', 'basic', 'extended' or 'all' (default)",
    "execution_mode": "'sequential' (default) or 'parallel'",
    "enable_mem_arena": "use ORT's CPU memory arena (default true)",
    "enable_mem_pattern": "let ORT plan memory from the first run's pattern (default true)",
    "provider_options": "a table passed to the GPU execution provider "
    "(e.g. gpu_mem_limit, trt_fp16_enable, trt_engine_cache_path)",
    "log_severity": "ORT log level for the session, 0 (verbose) to 4 (fatal); default 3",
    "pipeline_depth": "executions the engine may hand one instance at once (default 1); with 2 "
    "the next batch waits on the worker thread while one runs, so compute never waits for the "
    "loop, but that batch has left the engine's queue (a caller that leaves aborts it there)",
    "allow_spinning": "let idle intra-op threads spin for new work (default true, as in ORT); "
    "false saves CPU on a shared machine, at some latency",
    "tune_batch_sizes": "batch sizes the model's first instance times when it loads, e.g. "
    "[1, 2, 4, 8, 16, 32] (default []: none); the smallest whose rows/s (charged "
    f"{TUNE_OVERHEAD_S * 1e6:.0f} us per execution) is within {TUNE_TOLERANCE:.0%} of the best "
    "becomes the model's preferred batch size, which the dynamic batcher cuts batches at "
    "unless its preferred_batch_sizes is set",
}


def _ort() -> Any:
    # Imported on first use so that listing plugins stays cheap.
    import onnxruntime

    return onnxruntime


@final
class OnnxRuntimeBackend:
    """Loads ONNX models into ONNX Runtime sessions, one per instance."""

    __slots__ = ()

    async def load(self, config: ModelConfig, placement: Placement) -> OnnxRuntimeInstance:
        """Create the instance's worker thread and its session on the placed device.

        Raises:
            ConfigError: Unknown or invalid ``backend_options``.
            BackendUnavailable: The device is not usable and ``cpu_fallback`` is off.
            BackendError: The model file is missing or ONNX Runtime refuses it.
        """
        options = _check_options(config, placement)
        name = f"trioinfer-{config.name}-{placement.index}"
        try:
            worker = await WorkerThread.start(name, cpu_affinity=placement.cpu_affinity)
        except OSError as exc:
            raise ConfigError(
                f"model {config.name!r} instance {placement.index}: cpu_affinity "
                f"{list(placement.cpu_affinity or ())} cannot be applied here: {exc}"
            ) from exc
        label = f"model {config.name!r} instance {placement.index}"
        threads = _compute_threads(placement)
        rates: dict[int, float] = {}
        try:
            session, device = await worker.run_sync(_create_session, config, placement, options)
            # The engine reads the first instance's figures; others would only
            # disturb its measurement by running at the same time.
            if options["tune_batch_sizes"] and placement.index == 0:
                key = (str(config.path), _mtime(config.path), device, threads)
                key += tuple(options["tune_batch_sizes"])
                clock = _compute_clock(device, threads)
                sizes = options["tune_batch_sizes"]
                rates = _tuned.get(key) or await _tune(worker, session, label, sizes, clock)
                _tuned[key] = rates
        except BaseException:
            await worker.aclose()
            raise
        instance = OnnxRuntimeInstance(
            session,
            device,
            worker,
            options["dispatch"],
            options["inline_budget_us"] / 1e6,
            label,
            options["pipeline_depth"],
            threads,
            rates,
        )
        if rates:
            log.info(
                "%s: rows/s by batch size: %s; preferred batch size %d",
                label,
                ", ".join(f"{size}: {rate:,.1f}" for size, rate in rates.items()),
                instance.preferred_batch_sizes[0],
            )
        return instance


@final
class OnnxRuntimeInstance:
    """One ONNX Runtime session and the worker thread that runs it."""

    __slots__ = (
        "_auto",
        "_budget",
        "_clock",
        "_closed",
        "_device",
        "_dispatch",
        "_inline_average",
        "_label",
        "_outputs",
        "_samples",
        "_session",
        "_signature",
        "_worker",
        "aborted",
        "batch_rates",
        "pipeline_depth",
        "preferred_batch_sizes",
    )

    def __init__(
        self,
        session: Any,
        device: str,
        worker: WorkerThread,
        dispatch: str,
        inline_budget_s: float = DEFAULT_INLINE_BUDGET_US / 1e6,
        label: str = "instance",
        pipeline_depth: int = 1,
        threads: int = 1,
        batch_rates: Mapping[int, float] | None = None,
    ) -> None:
        #: Executions the engine may have in flight on this instance at once.
        self.pipeline_depth = pipeline_depth
        #: Rows per second measured at each tuned batch size (empty when not tuned).
        self.batch_rates: Mapping[int, float] = dict(batch_rates or {})
        #: The batch size the dynamic batcher should cut at (the engine reads it
        #: from the model's first instance); empty when not tuned.
        self.preferred_batch_sizes: tuple[int, ...] = (
            (preferred_batch_size(self.batch_rates),) if self.batch_rates else ()
        )
        self._session = session
        self._device = device
        self._worker = worker
        self._dispatch = dispatch
        self._auto = dispatch == "auto"
        self._budget = inline_budget_s
        # What an inline execution costs the loop (see _compute_clock).
        self._clock = _compute_clock(device, threads)
        self._label = label
        self._samples: list[float] = []
        self._inline_average: float | None = None
        self._signature = _signature(session)
        self._outputs = [spec.name for spec in self._signature.outputs]
        self._closed = False
        #: Executions that ONNX Runtime cut short because their caller was cancelled.
        self.aborted = 0

    @property
    def signature(self) -> ModelSignature:
        """The model's inputs and outputs as the session reports them."""
        return self._signature

    @property
    def device(self) -> str:
        """Where the session runs: ``"cpu"``, ``"cuda:N"`` or ``"tensorrt:N"``."""
        return self._device

    @property
    def session(self) -> Any:
        """The underlying ``onnxruntime.InferenceSession`` (``None`` once closed)."""
        return self._session

    async def execute(self, inputs: Mapping[str, np.ndarray[Any, Any]]) -> dict[str, Any]:
        """Run the session once off the event loop; abort it with ``terminate`` if cancelled."""
        session = self._session
        if session is None:
            raise BackendError(f"instance on {self._device} is closed")
        run_options = _ort().RunOptions()

        def abort() -> None:
            run_options.terminate = True

        dispatch = self._dispatch
        try:
            if dispatch == "inline":
                values = await self._run_inline(session, inputs, run_options)
            elif dispatch == "thread":
                values = await self._worker.run_sync(
                    self._run, session, inputs, run_options, abort=abort
                )
            elif dispatch == "auto":
                values = await self._worker.run_sync(
                    self._run_timed, session, inputs, run_options, abort=abort
                )
                self._consider_inline()
            else:

                def start(resolve: Any) -> None:
                    def done(values: Any, _user_data: object, error: str) -> None:
                        if error:
                            self._count_abort(run_options)
                            resolve(None, RuntimeError(error))
                        else:
                            resolve(values, None)

                    session.run_async(self._outputs, inputs, done, None, run_options)

                values = await wait_on_callback(start, abort=abort)
        except Exception as exc:
            raise BackendError(f"ONNX Runtime failed on {self._device}: {_one_line(exc)}") from exc
        return dict(zip(self._outputs, values, strict=True))

    async def _run_inline(self, session: Any, inputs: Any, run_options: Any) -> Any:
        # Yield first: back-to-back inline executions must not starve the event loop.
        await anyio.lowlevel.checkpoint()
        started = self._clock()
        try:
            return session.run(self._outputs, inputs, run_options)
        finally:
            took = self._clock() - started
            # A session's first run allocates and is several times slower: it
            # only seeds the average. After it, a moving average forgives one slow
            # run (a page fault); a run ten times over the budget is not forgiven.
            average = self._inline_average
            if average is None:
                self._inline_average = min(took, self._budget)
            else:
                self._inline_average = average = average + 0.1 * (took - average)
            if average is not None and (average > self._budget or took > 10 * self._budget):
                self._dispatch = "thread"
                # Expected when auto tries inline; a surprise when inline was asked for.
                log.log(
                    logging.INFO if self._auto else logging.WARNING,
                    "%s: inline executions take %.0f us (last %.0f us), over "
                    "inline_budget_us = %.0f; it runs on its worker thread from now on",
                    self._label,
                    average * 1e6,
                    took * 1e6,
                    self._budget * 1e6,
                )

    def _run_timed(self, session: Any, inputs: Any, run_options: Any) -> Any:
        # Runs on the worker thread; measures the compute alone, without the hop.
        started = self._clock()
        values = self._run(session, inputs, run_options)
        self._samples.append(self._clock() - started)
        return values

    def _consider_inline(self) -> None:
        if len(self._samples) < AUTO_SAMPLES:
            return
        median = sorted(self._samples)[len(self._samples) // 2]
        self._samples.clear()
        # Try inline unless the thread's (pessimistic) figure says an execution
        # could hold the loop for long; the inline rule then moves it back for
        # good if inline costs more than the budget after all.
        self._dispatch = "inline" if median < AUTO_TRIAL_BUDGETS * self._budget else "thread"
        log.info(
            "%s: median execution %.0f us over %d runs; dispatch %s",
            self._label,
            median * 1e6,
            AUTO_SAMPLES,
            self._dispatch,
        )

    @property
    def dispatch(self) -> str:
        """How executions leave the event loop now (``'auto'`` settles on one of the others)."""
        return self._dispatch

    def _run(self, session: Any, inputs: Any, run_options: Any) -> Any:
        # Runs on the worker thread.
        try:
            return session.run(self._outputs, inputs, run_options)
        except Exception:
            self._count_abort(run_options)
            raise

    def _count_abort(self, run_options: Any) -> None:
        if run_options.terminate:
            self.aborted += 1

    async def aclose(self) -> None:
        """Drop the session and join the worker thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._session = None
        await self._worker.aclose()


def _compute_clock(device: str, threads: int) -> Callable[[], float]:
    # The clock that measures the model's own cost. With one compute thread on the
    # CPU, that thread's CPU time: being preempted by another process is not the
    # model's cost. On a GPU, or with intra-op threads the caller waits for, the
    # thread may sleep while others work, yet the caller (an inline execution's
    # event loop, say) is held all along: wall time.
    return time.thread_time if device == "cpu" and threads == 1 else time.perf_counter


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
    label: str,
    sizes: list[int],
    clock: Callable[[], float],
) -> dict[int, float]:
    # Off the loop on the instance's own thread; a cancelled load stops the run in progress.
    run_options = _ort().RunOptions()

    def abort() -> None:
        run_options.terminate = True

    return await worker.run_sync(
        _time_batch_sizes, session, label, sizes, clock, run_options, abort=abort
    )


def _time_batch_sizes(
    session: Any, label: str, sizes: list[int], clock: Callable[[], float], run_options: Any
) -> dict[int, float]:
    # Runs on the worker thread, before the instance serves anything; a cancelled
    # load sets run_options.terminate, which stops the run in progress.
    signature = _signature(session)
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


def _check_options(config: ModelConfig, placement: Placement) -> dict[str, Any]:
    options = dict(config.backend_options)
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConfigError(
            f"model {config.name!r}: onnxruntime backend has no option "
            f"{', '.join(map(repr, unknown))}; it knows {', '.join(sorted(OPTIONS))}"
        )
    # Inline is measured and bounded on the CPU; on a GPU it has not been tried here.
    options.setdefault("dispatch", "auto" if placement.device.kind == "cpu" else "thread")
    if options["dispatch"] not in _DISPATCH:
        raise ConfigError(
            f"model {config.name!r}: dispatch must be one of {', '.join(map(repr, _DISPATCH))}, "
            f"got {options['dispatch']!r}"
        )
    depth = options.setdefault("pipeline_depth", 1)
    if not isinstance(depth, int) or isinstance(depth, bool) or not 1 <= depth <= 8:
        raise ConfigError(
            f"model {config.name!r}: pipeline_depth must be an integer from 1 to 8, got {depth!r}"
        )
    budget = options.setdefault("inline_budget_us", DEFAULT_INLINE_BUDGET_US)
    if not isinstance(budget, (int, float)) or isinstance(budget, bool) or not budget > 0:
        raise ConfigError(
            f"model {config.name!r}: inline_budget_us must be a positive number, got {budget!r}"
        )
    if options["dispatch"] == "ort_async" and placement.threads == 1:
        raise ConfigError(
            f"model {config.name!r}: dispatch 'ort_async' runs on ONNX Runtime's intra-op "
            "thread pool, which needs threads >= 2 (or 0 for ORT's default); got threads = 1"
        )
    level = options.setdefault("graph_optimization_level", "all")
    if level not in _OPT_LEVELS:
        raise ConfigError(
            f"model {config.name!r}: graph_optimization_level must be one of "
            f"{', '.join(_OPT_LEVELS)}, got {level!r}"
        )
    mode = options.setdefault("execution_mode", "sequential")
    if mode not in ("sequential", "parallel"):
        raise ConfigError(
            f"model {config.name!r}: execution_mode must be 'sequential' or 'parallel', "
            f"got {mode!r}"
        )
    for key in ("inter_op_threads", "log_severity"):
        value = options.get(key, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(
                f"model {config.name!r}: {key} must be an integer >= 0, got {value!r}"
            )
    if not 0 <= options.setdefault("log_severity", 3) <= 4:
        raise ConfigError(f"model {config.name!r}: log_severity must be 0-4")
    for key in ("enable_mem_arena", "enable_mem_pattern", "allow_spinning"):
        if not isinstance(options.setdefault(key, True), bool):
            raise ConfigError(f"model {config.name!r}: {key} must be true or false")
    sizes = options.setdefault("tune_batch_sizes", [])
    if (
        not isinstance(sizes, list | tuple)
        or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes)
        or any(a >= b for a, b in itertools.pairwise(sizes))
    ):
        raise ConfigError(
            f"model {config.name!r}: tune_batch_sizes must be a list of strictly increasing "
            f"positive integers (batch sizes to time), e.g. [1, 2, 4, 8, 16, 32]; got {sizes!r}"
        )
    options["tune_batch_sizes"] = list(sizes)
    _check_tune_fits_batcher(config, options["tune_batch_sizes"])
    provider_options = options.setdefault("provider_options", {})
    if not isinstance(provider_options, Mapping):
        raise ConfigError(f"model {config.name!r}: provider_options must be a table")
    return options


def _check_tune_fits_batcher(config: ModelConfig, sizes: list[int]) -> None:
    # What the measurement is for: sizes a batcher can form. The first-party
    # batchers are known here; a third-party one may read the sizes as it likes.
    if not sizes:
        return
    if config.batcher == "none":
        raise ConfigError(
            f"model {config.name!r}: tune_batch_sizes needs a batcher that forms batches "
            "(batcher = 'dynamic'); with batcher 'none' every execution is one request"
        )
    if config.batcher == "dynamic":
        largest = config.batcher_options.get("max_batch_size", 32)
        if isinstance(largest, int) and sizes[-1] > largest:
            raise ConfigError(
                f"model {config.name!r}: tune_batch_sizes holds {sizes[-1]}, more than the "
                f"batcher's max_batch_size {largest}; list only sizes up to {largest}"
            )


def _create_session(
    config: ModelConfig, placement: Placement, options: dict[str, Any]
) -> tuple[Any, str]:
    ort = _ort()
    path = Path(config.path)
    if not path.is_file():
        raise BackendError(f"model {config.name!r}: no model file at {path}")
    device = placement.device
    reason = probe_device(device)
    if reason is not None:
        if not placement.cpu_fallback:
            raise BackendUnavailable(
                f"model {config.name!r} instance {placement.index}: {device} is not usable: "
                f"{reason} (set cpu_fallback = true to run on the CPU instead)"
            )
        log.warning(
            "model %r instance %d: %s is not usable (%s); running on the CPU",
            config.name,
            placement.index,
            device,
            reason,
        )
        device = Device("cpu")
    so = ort.SessionOptions()
    affinity = placement.cpu_affinity
    threads = _compute_threads(placement)
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = options.get("inter_op_threads", 0)
    so.graph_optimization_level = getattr(
        ort.GraphOptimizationLevel, _OPT_LEVELS[options["graph_optimization_level"]]
    )
    so.execution_mode = (
        ort.ExecutionMode.ORT_PARALLEL
        if options["execution_mode"] == "parallel"
        else ort.ExecutionMode.ORT_SEQUENTIAL
    )
    so.enable_cpu_mem_arena = options["enable_mem_arena"]
    so.enable_mem_pattern = options["enable_mem_pattern"]
    so.log_severity_level = options["log_severity"]
    if not options["allow_spinning"]:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if affinity is not None and threads > 1:
        # ORT pins intra-op threads 2..N itself; the first is the worker thread, pinned already.
        cpus = ",".join(map(str, affinity))
        so.add_session_config_entry(
            "session.intra_op_thread_affinities", ";".join([cpus] * (threads - 1))
        )
    try:
        session = ort.InferenceSession(str(path), so, providers=_providers(device, options))
    except Exception as exc:
        raise BackendError(
            f"model {config.name!r}: ONNX Runtime could not load {path}: {_one_line(exc)}"
        ) from exc
    return session, str(device)


def _compute_threads(placement: Placement) -> int:
    # With CPUs named but no thread count, one compute thread per named CPU; 0: ORT chooses.
    affinity = placement.cpu_affinity
    return placement.threads or (len(affinity) if affinity else 0)


def _providers(device: Device, options: Mapping[str, Any]) -> list[Any]:
    extra = dict(options.get("provider_options", {}))
    if device.kind == "cpu":
        return ["CPUExecutionProvider"]
    cuda = ("CUDAExecutionProvider", {"device_id": device.index})
    if device.kind == "cuda":
        return [("CUDAExecutionProvider", {**cuda[1], **extra}), "CPUExecutionProvider"]
    return [
        ("TensorrtExecutionProvider", {"device_id": device.index, **extra}),
        cuda,
        "CPUExecutionProvider",
    ]


_probe_lock = threading.Lock()
_probed: dict[Device, str | None] = {}


def probe_device(device: Device) -> str | None:
    """Say why *device* cannot run ONNX Runtime sessions here, or ``None`` if it can.

    For GPU devices this creates a trial session on a one-node model in a
    child process (once per device; the answer is cached), where ONNX
    Runtime's own error output stays, and reports the cause in one line, e.g.
    a CUDA library that cannot be found. Blocks; call it off the event loop.
    """
    if device.kind == "cpu":
        return None
    with _probe_lock:
        if device not in _probed:
            _probed[device] = _probe(device)
        return _probed[device]


#: Longest a device probe may take (a first CUDA start can be slow), in seconds.
_PROBE_TIMEOUT_S = 120.0
#: What starts the probing child's answer, the last line of its stdout.
_ANSWER = "trioinfer probe: "


def _probe(device: Device) -> str | None:
    ort = _ort()
    provider = _PROVIDERS[device.kind]
    if provider not in ort.get_available_providers():
        return (
            f"this ONNX Runtime build ({ort.__version__}) has no {provider}; "
            "install onnxruntime-gpu"
        )
    # The trial runs in a process of its own: ONNX Runtime and its CUDA loaders
    # write to the process's stdout and stderr (C++ log lines, preload_dlls'
    # prints), which only a child can hold back without swapping this process's
    # streams under every other thread. A driver that crashes takes only the child.
    code = f"from {__name__} import _probe_here; _probe_here({device.kind!r}, {device.index})"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    try:
        child = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            env=env,
            timeout=_PROBE_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"could not probe {device}: {_one_line(exc)}"
    answer = child.stdout.decode(errors="replace").rstrip().rpartition("\n")[2]
    if child.returncode != 0 or not answer.startswith(_ANSWER):
        said = child.stderr.decode(errors="replace").strip().splitlines()
        return f"probing {device} failed (exit status {child.returncode})" + (
            f": {said[-1]}" if said else ""
        )
    reason: str | None = json.loads(answer.removeprefix(_ANSWER))
    if reason is None and hasattr(ort, "preload_dlls"):
        # Load here too what the child loaded, for this process's own sessions:
        # quietly, since it loads.
        with contextlib.suppress(Exception):
            ort.preload_dlls()
    return reason


def _probe_here(kind: str, index: int) -> None:
    # The child's side of _probe: the answer is the last line it prints.
    ort = _ort()
    ort.set_default_logger_severity(4)
    device = Device(kind, index)  # type: ignore[arg-type]  # the parent's Device.kind
    if hasattr(ort, "preload_dlls"):
        with contextlib.suppress(Exception):
            ort.preload_dlls()
    reason: str | None
    try:
        session = ort.InferenceSession(_trial_model(), providers=_providers(device, {})[:1])
    except Exception as exc:
        reason = _one_line(exc)
    else:
        provider = _PROVIDERS[device.kind]
        reason = (
            None
            if session.get_providers()[0] == provider
            else _library_error(device.kind)
            or (
                f"ONNX Runtime could not start {provider} on device {device.index} "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})"
            )
        )
    print(_ANSWER + json.dumps(reason), flush=True)


def _library_error(kind: str) -> str | None:
    # ORT's own message is many lines of C++ log; dlopen's is one line naming what is missing.
    lib = Path(_ort().__file__).parent / "capi" / f"libonnxruntime_providers_{kind}.so"
    if not lib.exists():
        return None
    try:
        ctypes.CDLL(str(lib))
    except OSError as exc:
        return str(exc).replace(str(lib) + ": ", "")
    return None


def _trial_model() -> bytes:
    # A one-node Identity model written as protobuf bytes by hand, so that the
    # probe needs no `onnx` package: ir_version 8, opset 13, float input x -> y.
    def field(number: int, wire: int, payload: bytes) -> bytes:
        return _varint(number << 3 | wire) + payload

    def string(number: int, value: bytes) -> bytes:
        return field(number, 2, _varint(len(value)) + value)

    def value_info(name: bytes) -> bytes:
        tensor_type = field(1, 0, _varint(1)) + string(2, string(1, field(1, 0, _varint(1))))
        return string(1, name) + string(2, string(1, tensor_type))

    node = string(1, b"x") + string(2, b"y") + string(4, b"Identity")
    graph = string(1, node) + string(2, b"probe") + string(11, value_info(b"x"))
    graph += string(12, value_info(b"y"))
    opset = string(1, b"") + field(2, 0, _varint(13))
    return field(1, 0, _varint(8)) + string(7, graph) + string(8, opset)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _signature(session: Any) -> ModelSignature:
    def spec(arg: Any) -> TensorSpec:
        shape = tuple(d if isinstance(d, (int, str)) else None for d in arg.shape)
        return TensorSpec(arg.name, numpy_dtype(arg.type), shape, arg.type)

    return ModelSignature(
        tuple(spec(a) for a in session.get_inputs()),
        tuple(spec(a) for a in session.get_outputs()),
    )


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    # ORT prefixes "[ONNXRuntimeError] : 1 : FAIL : "; the rest is the message.
    if text.startswith("[ONNXRuntimeError]"):
        text = text.split(" : ", 3)[-1]
    return text.splitlines()[0] if text else type(exc).__name__
