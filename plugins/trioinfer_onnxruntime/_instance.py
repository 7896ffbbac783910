"""An instance: one session, its worker thread, and where each execution runs.

The ``dispatch`` option picks the way off the event loop: ``"thread"`` (the
instance's worker thread), ``"ort_async"`` (ONNX Runtime's ``run_async``,
its callback waking the loop), ``"inline"`` (on the loop's thread, within a
time budget) or ``"auto"`` (measured on the thread, then inline when that is
cheaper than the hop). A cancelled execution off the loop is aborted with
``RunOptions.terminate``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final, final

import anyio
import anyio.lowlevel
import numpy as np
import sniffio

from trioinfer import BackendError, ModelSignature
from trioinfer.lowlevel import (
    CallbackWaiter,
    WorkerThread,
    inline_slice_spent,
    restart_inline_slice,
)

from ._options import DEFAULT_INLINE_BUDGET_US
from ._ort import _one_line, _ort, _signature, log
from ._tuning import preferred_batch_size

#: Executions an 'auto' instance measures on its thread before it may go inline.
AUTO_SAMPLES: Final = 32
#: ``auto`` tries inline when the median on the thread is under this many budgets.
#: On the thread an execution shares the cores with the busy event loop and
#: costs up to three times the CPU it costs inline (a 32-row digits batch: about
#: 300 us there, 100 us inline), so the thread's figure only rules out models
#: that could hold the loop for long; the inline rule decides.
AUTO_TRIAL_BUDGETS: Final = 4


@final
class OnnxRuntimeInstance:
    """One ONNX Runtime session and the worker thread that runs it."""

    __slots__ = (
        "_auto",
        "_budget",
        "_callbacks",
        "_checkpoint_if_cancelled",
        "_clock",
        "_closed",
        "_device",
        "_dispatch",
        "_inline_average",
        "_label",
        "_measure_cpu",
        "_outputs",
        "_reshape_inputs",
        "_reshape_outputs",
        "_samples",
        "_session",
        "_signature",
        "_wall",
        "_worker",
        "aborted",
        "batch_rates",
        "checks_outputs",
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
        *,
        checks_outputs: bool = False,
        signature: ModelSignature | None = None,
        reshape_inputs: Mapping[str, tuple[int, ...]] | None = None,
        reshape_outputs: Mapping[str, tuple[int, ...]] | None = None,
    ) -> None:
        #: Whether its answers fit its signature by construction, so that the engine
        #: checks only their names and rows (1 us of a three-step pipeline's 34). ONNX
        #: Runtime holds answers to the graph's declared types but not to its declared
        #: shapes (it only warns of a misfit), so the backend says True only where ONNX's
        #: shape inference derives every rank and fixed size the signature declares
        #: (see _proof.py); else the engine checks each answer in full.
        self.checks_outputs = checks_outputs
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
        # run_async's callbacks wake the loop through a socket of the instance's
        # own (see bench_hop.py: 15-20 us of the loop's CPU a batch less).
        self._callbacks = CallbackWaiter() if dispatch == "ort_async" else None
        self._auto = dispatch == "auto"
        self._budget = inline_budget_s
        # What an inline execution costs the loop (see _compute_clock).
        self._clock = _compute_clock(device, threads)
        self._label = label
        self._samples: list[float] = []
        self._inline_average: float | None = None
        self._measure_cpu = False  # read the CPU clock on the next inline run (_run_inline)
        # The graph's, or as the config narrowed it (the backend's _narrowed).
        self._signature = _signature(session) if signature is None else signature
        self._outputs = [spec.name for spec in self._signature.outputs]
        # Triton's reshape: the shape the graph takes of each such input, and the one
        # clients receive of each such output (-1 first: the batch dimension, kept).
        self._reshape_inputs = dict(reshape_inputs or {})
        self._reshape_outputs = dict(reshape_outputs or {})
        self._closed = False
        self._wall = time.perf_counter  # the loop is held for wall time
        self._checkpoint_if_cancelled = _checkpoint_if_cancelled()
        #: Executions that ONNX Runtime cut short because their caller was cancelled.
        self.aborted = 0

    @property
    def signature(self) -> ModelSignature:
        """The model's inputs and outputs as the session reports them.

        With the sizes the ``inputs`` and ``outputs`` options fix where the graph
        leaves them symbolic or open.
        """
        return self._signature

    @property
    def device(self) -> str:
        """Where the session runs: ``"cpu"``, ``"cuda:N"`` or ``"tensorrt:N"``."""
        return self._device

    @property
    def session(self) -> Any:
        """The underlying ``onnxruntime.InferenceSession`` (``None`` once closed)."""
        return self._session

    async def execute(
        self, inputs: Mapping[str, np.ndarray[Any, Any]], outputs: Sequence[str] | None = None
    ) -> dict[str, Any]:
        """Run the session once off the event loop; abort it with ``terminate`` if cancelled.

        *outputs*: the names of those to compute, alone (`execute_outputs`); None: all.
        """
        # A list, as ONNX Runtime takes them; it returns (and copies out) those alone.
        names = self._outputs if outputs is None else list(outputs)
        session = self._session
        if session is None:
            raise BackendError(f"instance on {self._device} is closed")
        if self._reshape_inputs:
            inputs = _reshaped(inputs, self._reshape_inputs)
        dispatch = self._dispatch
        if dispatch == "inline":
            # On the loop's thread nothing can abort a run midway: no RunOptions.
            try:
                values = await self._run_inline(session, inputs, names)
            except Exception as exc:
                raise BackendError(
                    f"ONNX Runtime failed on {self._device}: {_one_line(exc)}"
                ) from exc
            return self._answer(values, names)
        run_options = _ort().RunOptions()

        def abort() -> None:
            run_options.terminate = True

        try:
            if dispatch == "thread":
                values = await self._worker.run_sync(
                    self._run, session, inputs, names, run_options, abort=abort
                )
            elif dispatch == "auto":
                values = await self._worker.run_sync(
                    self._run_timed, session, inputs, names, run_options, abort=abort
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

                    session.run_async(names, inputs, done, None, run_options)

                assert self._callbacks is not None  # made for "ort_async", which stays
                values = await self._callbacks.wait_on_callback(start, abort=abort)
        except Exception as exc:
            raise BackendError(f"ONNX Runtime failed on {self._device}: {_one_line(exc)}") from exc
        return self._answer(values, names)

    async def execute_outputs(
        self, inputs: Mapping[str, np.ndarray[Any, Any]], outputs: tuple[str, ...]
    ) -> dict[str, Any]:
        """Run the session once for the named *outputs* alone (`trioinfer.abc.OutputsInstance`).

        ONNX Runtime returns those alone (from a GPU, copies only those out); its
        inference builds still run every node of the graph (onnxruntime#16483).
        """
        return await self.execute(inputs, outputs)

    def _answer(self, values: Any, names: list[str]) -> dict[str, Any]:
        # The session's outputs by name, reshaped ones as clients see them.
        outputs = dict(zip(names, values, strict=True))
        if self._reshape_outputs:
            try:
                outputs = _reshaped(outputs, self._reshape_outputs)
            except ValueError as exc:
                raise BackendError(
                    f"ONNX Runtime on {self._device}: an output does not fit the config's "
                    f"reshape: {exc}"
                ) from exc
        return outputs

    @property
    def runs_inline(self) -> bool:
        """True while executions run on the event loop's thread (``dispatch`` inline).

        Then `execute` suspends only at its start, when the loop's inline slice
        is spent (`inline_budget_s`), or when its caller is cancelled: an
        `trioinfer.abc.InlineInstance` in slices. ``auto`` may move to inline
        and back to the thread; this says where the next execution runs.
        """
        return self._dispatch == "inline"

    @property
    def inline_budget_s(self) -> float:
        """The time inline executions may hold the loop, in all, before one yields."""
        return self._budget

    async def _run_inline(self, session: Any, inputs: Any, names: list[str]) -> Any:
        # Back-to-back inline executions must not starve the event loop: yield
        # once they have held it for a budget's worth of time since the last
        # yield (one slice for every instance on this thread's loop: several
        # models' runs hold it for a budget in all, not a budget each). Not
        # before every run: that let each loop pass carry one request through
        # each model and woke every model's worker for a single request.
        if inline_slice_spent(self._budget):
            await anyio.lowlevel.checkpoint()
            restart_inline_slice()
        else:
            await self._checkpoint_if_cancelled()
        # The model's cost is its CPU time with one CPU thread (_compute_clock),
        # but that clock is a system call (1.7 us a read on a VM, twice per run).
        # Wall time, cheap, bounds it from above: a run well within the budget by
        # the wall is within it by the CPU too, and counts its wall time. Only
        # a run that comes near the budget by the wall, or follows one that did,
        # reads the CPU clock (the run after one that came near is measured so).
        clock = self._clock
        cpu = clock is not time.perf_counter and self._measure_cpu
        wall = self._wall()
        started = clock() if cpu else wall
        try:
            return session.run(names, inputs)
        finally:
            ended = self._wall()
            near = ended - wall > 0.5 * self._budget
            if cpu:
                took: float | None = clock() - started
            elif clock is time.perf_counter or not near:
                took = ended - wall
            else:
                took = None  # near the budget by the wall: the next run reads the CPU
            self._measure_cpu = near
            # A session's first run allocates and is several times slower: it
            # only seeds the average. After it, a moving average forgives one slow
            # run (a page fault); a run ten times over the budget is not forgiven.
            average = self._inline_average
            if average is None:
                self._inline_average = min(ended - wall if took is None else took, self._budget)
            elif took is not None:
                self._inline_average = average = average + 0.1 * (took - average)
            else:
                average = None  # not counted: nothing to decide
            if (
                average is not None
                and took is not None
                and (average > self._budget or took > 10 * self._budget)
            ):
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

    def _run_timed(self, session: Any, inputs: Any, names: list[str], run_options: Any) -> Any:
        # Runs on the worker thread; measures the compute alone, without the hop.
        started = self._clock()
        values = self._run(session, inputs, names, run_options)
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

    def _run(self, session: Any, inputs: Any, names: list[str], run_options: Any) -> Any:
        # Runs on the worker thread.
        try:
            return session.run(names, inputs, run_options)
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
        if self._callbacks is not None:
            self._callbacks.close()
        await self._worker.aclose()


def _reshaped(arrays: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """*arrays* with those named in *shapes* reshaped (a leading -1 keeps the batch's rows).

    Raises:
        ValueError: An array whose elements do not fill its shape, saying which.
    """
    out = dict(arrays)
    for name, shape in shapes.items():
        array = out.get(name)
        if array is None:
            continue  # an output not asked for (execute_outputs)
        target = (array.shape[0], *shape[1:]) if shape[:1] == (-1,) and array.ndim else shape
        try:
            out[name] = array.reshape(target)
        except ValueError:
            raise ValueError(
                f"{name!r} of shape {list(array.shape)} cannot be reshaped to {list(target)}"
            ) from None
    return out


def _checkpoint_if_cancelled() -> Callable[[], Awaitable[None]]:
    # Bound once, for the loop the instance is loaded in: anyio's portable
    # function finds the backend on every call (0.9 us against Trio's own 0.2,
    # paid per inline execution).
    try:
        library = sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        library = None
    if library == "trio":
        import trio

        return trio.lowlevel.checkpoint_if_cancelled
    return anyio.lowlevel.checkpoint_if_cancelled


def _compute_clock(device: str, threads: int) -> Callable[[], float]:
    # The clock that measures the model's own cost. With one compute thread on the
    # CPU, that thread's CPU time: being preempted by another process is not the
    # model's cost. On a GPU, or with intra-op threads the caller waits for, the
    # thread may sleep while others work, yet the caller (an inline execution's
    # event loop, say) is held all along: wall time.
    return time.thread_time if device == "cpu" and threads == 1 else time.perf_counter
