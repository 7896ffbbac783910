"""The actor: one ONNX Runtime instance in a Ray worker process on a cluster node.

`ModelActor` is a plain class; the backend makes it an async Ray actor with
``ray.remote`` when it creates one, so that this module imports without Ray.
Its methods run on the actor's asyncio event loop, where the ONNX Runtime
backend's instance runs as it would in an engine (its own worker thread;
``RunOptions.terminate`` when cancelled). ``ray.cancel`` on a call raises
``CancelledError`` in it, which aborts the run.

A traced call (`ModelActor.execute_traced`) comes with the W3C trace context
of the engine's ``compute`` span and goes back with the times it spent here,
measured on this node's clock: the driver records them as child spans
(``trioinfer.lowlevel.record_span``), because an actor usually has no
exporter of its own and spans made here would be lost.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import importlib
import math
import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio

from trioinfer import DeadlineExceeded, ModelConfig, TrioInferError
from trioinfer.lowlevel import Placement
from trioinfer_onnxruntime import OnnxRuntimeBackend

from . import _codec


class ModelActor:
    """Holds one ONNX Runtime instance of a model; made a Ray actor by the backend.

    The counters say what the actor did with the calls it got: ``computed``
    (runs started), ``expired`` (refused uncomputed: the batch's deadline had
    passed when it reached the actor, or when its turn to run came),
    ``cancelled`` (calls cancelled while they waited or ran) and ``aborted``
    (runs ONNX Runtime cut short); ``last_remaining`` is the time left that
    the last call came with (``inf`` without a deadline), and ``last_hop`` the
    seconds it spent on the way (``nan`` where the driver's clock is not this
    node's, see `execute`), else ``last_allowance`` what the driver said the
    way there and back takes at least (``nan`` where the clocks are one);
    ``in_flight`` counts the calls in the actor now.
    """

    def __init__(self) -> None:
        self._instance: Any = None
        self._codec = False
        # Whether the driver's monotonic clock is this process's (see clock_id).
        self._same_clock = False
        self.last_hop = math.nan
        self.last_allowance = math.nan
        self.computed = 0
        self.expired = 0
        self.cancelled = 0
        self.last_remaining = math.nan
        # Calls in this actor now, and when its last run ended (time.time_ns()):
        # what a traced call's timings are derived from.
        self._in_flight = 0
        self._last_end = 0
        self._serial = True
        # Serial sessions take one call at a time: the others wait here, not in the
        # session's queue, so that each is checked against its deadline right before
        # it runs (created in load(), on the actor's event loop).
        self._turn: asyncio.Lock | None = None
        # Set by close(): ends the driver's watch() call (made in load(), on the loop).
        self._closed: asyncio.Event | None = None

    async def load(
        self,
        name: str,
        path: str,
        model_bytes: bytes | None,
        ort_options: Mapping[str, Any],
        batcher: str,
        batcher_options: Mapping[str, Any],
        placement: Placement,
        codec: bool,
        driver_clock: str | None = None,
    ) -> dict[str, Any]:
        """Create the session (from *model_bytes* when given, else from *path* on this node).

        *model_bytes* go to a temporary file for ONNX Runtime to read, removed
        as soon as the session is made (or could not be). *driver_clock* is
        the driver's `clock_id`: where it is this node's, the times calls are
        sent at are read on this node's monotonic clock.

        Returns what the driver needs: the signature, the device, the node,
        preferred batch sizes.
        """
        ray: Any = importlib.import_module("ray")  # only actors import it, in Ray's workers

        shipped = None
        if model_bytes is not None:
            fd, shipped = tempfile.mkstemp(prefix=f"trioinfer-{name}-", suffix=".onnx")
            with os.fdopen(fd, "wb") as f:
                f.write(model_bytes)
            path = shipped
        config = ModelConfig(
            name=name,
            path=Path(path),
            backend="onnxruntime",
            backend_options=dict(ort_options),
            batcher=batcher,
            batcher_options=dict(batcher_options),
            cpu_fallback=placement.cpu_fallback,
        )
        node_id = ray.get_runtime_context().get_node_id()
        node_ip = ray.util.get_node_ip_address()
        try:
            self._instance = await self._open_instance(config, placement)
        except TrioInferError as exc:
            # "no model file at /models/digits.onnx" is about this node's disk: say which.
            raise _on_node(exc, f"on Ray node {node_id[:12]} ({node_ip})") from exc
        finally:
            # The session has read the shipped file (or could not): removed now, not at
            # close, which an actor killed or lost with its driver never reaches.
            if shipped is not None:
                await anyio.Path(shipped).unlink(missing_ok=True)
        self._codec = codec
        self._same_clock = driver_clock is not None and driver_clock == clock_id()
        # Every dispatch but ort_async runs the session one call at a time, in order.
        self._serial = ort_options.get("dispatch") != "ort_async"
        self._turn = asyncio.Lock() if self._serial else None
        self._closed = asyncio.Event()
        return {
            "signature": self._instance.signature,
            "device": self._instance.device,
            "node_id": node_id,
            "node_ip": node_ip,
            "pid": os.getpid(),
            "preferred_batch_sizes": tuple(self._instance.preferred_batch_sizes),
        }

    async def _open_instance(self, config: ModelConfig, placement: Placement) -> Any:
        # The backend instance this actor serves: an ONNX Runtime session, as the
        # onnxruntime backend makes it in an engine.
        return await OnnxRuntimeBackend().load(config, placement)

    async def execute(
        self,
        inputs: Mapping[str, Any],
        remaining: float,
        sent: float | None = None,
        allowance: float = 0.0,
    ) -> tuple[dict[str, Any], float]:
        """Run one batch, unless its deadline passes first (*remaining* seconds from sending).

        *sent* is when the call left the driver, on the driver's monotonic
        clock. Where that clock is this node's (the driver runs on this
        machine: the same kernel boot), the deadline counts from then, so
        the whole hop is counted: serializing, moving the tensors, and Ray's
        queue for this actor, where a call waits while the actor's event
        loop is busy. On another machine the clocks are not comparable: the
        deadline counts from when this coroutine began, less *allowance*,
        the least time the driver measured a call of this actor to spend
        outside it, there and back (its round trip less the seconds the
        actor said it held the call). A batch with less time left than that
        could not be answered in time even with nothing to compute. A call
        that waits in the actor for the run before it (the engine's
        ``pipeline_depth`` above 1) is checked again when its turn comes,
        right before the session runs it.

        Returns:
            The outputs, and the seconds the call spent in this actor (from
            when this coroutine began), for the driver's measure of the trip.

        Raises:
            DeadlineExceeded: The deadline passed before the run began: nobody
                waits for this batch, and nothing was computed.
            BackendError: ONNX Runtime failed.
        """
        received = time.monotonic()
        outputs = await self._execute(inputs, remaining, sent, allowance, received, None)
        return outputs, time.monotonic() - received

    async def execute_traced(
        self,
        inputs: Mapping[str, Any],
        remaining: float,
        trace_context: Mapping[str, str],
        sent: float | None = None,
        allowance: float = 0.0,
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """`execute`, for a traced batch: its outputs, and the times it spent here.

        *trace_context* is the W3C context of the engine's compute span: the
        parent of this call's work. The actor makes no spans (it has no
        exporter); the driver records them from the times returned, which
        are ``time.time_ns()`` on this node:
        ``received``, ``run_start``, ``run_end``, ``replied``, with
        ``in_flight`` (calls in the actor when this one came, itself
        included) and ``queued`` (whether ``run_start`` is known: with every
        dispatch but ``ort_async`` the session runs one call at a time, in
        order, so a call's run starts when it came or when the run before it
        ended, whichever is later; with ``ort_async`` runs overlap, and
        ``run_start`` is when the call reached the session); ``held`` is the
        seconds the call spent here (`execute` returns it too).
        """
        received = time.monotonic()
        timings: dict[str, Any] = {"received": time.time_ns()}
        outputs = await self._execute(inputs, remaining, sent, allowance, received, timings)
        timings["replied"] = time.time_ns()
        timings["held"] = time.monotonic() - received
        return outputs, timings

    async def _execute(
        self,
        inputs: Mapping[str, Any],
        remaining: float,
        sent: float | None,
        allowance: float,
        received: float,
        timings: dict[str, Any] | None,
    ) -> dict[str, Any]:
        self.last_remaining = remaining
        # The hop, where the driver's clock is ours; a time from the future means it is
        # not (a time namespace of its own), and the hop is not known.
        hop = received - sent if self._same_clock and sent is not None else math.nan
        self.last_hop = hop if hop >= 0 else math.nan
        if hop >= 0:
            self.last_allowance = math.nan
            left = remaining - hop
            late = (
                f"before it reached the actor (it left with {remaining:.6f}s, after "
                f"{hop:.6f}s on the way)"
            )
        else:
            # Not finite, negative or not a number: no measure, none taken off.
            allowance = allowance if math.isfinite(allowance) and allowance > 0 else 0.0
            self.last_allowance = allowance
            left = remaining - allowance
            late = (
                f"before it could be answered (it left with {remaining:.6f}s, and a call's way "
                f"here and back takes at least {allowance:.6f}s, as the driver measured it: "
                "this node's clock is not the driver's)"
                if allowance
                else "before it reached the actor"
            )
        deadline = received + left if math.isfinite(left) else math.inf
        if deadline <= received:
            self.expired += 1
            raise DeadlineExceeded(
                f"the batch's deadline passed {-left:.6f}s {late}; nothing was computed"
            )
        self._in_flight += 1
        if timings is not None:
            timings["in_flight"] = self._in_flight
        try:
            if self._turn is None:
                outputs = await self._run(inputs, deadline, received, timings)
            else:
                async with self._turn:
                    outputs = await self._run(inputs, deadline, received, timings)
        except BaseException as exc:
            if _is_cancelled(exc):
                self.cancelled += 1
            raise
        finally:
            self._in_flight -= 1
        return _codec.encode(outputs) if self._codec else outputs

    async def _run(
        self,
        inputs: Mapping[str, Any],
        deadline: float,
        received: float,
        timings: dict[str, Any] | None,
    ) -> Any:
        # The session's turn for this call: its last chance to be refused uncomputed.
        now = time.monotonic()
        if deadline <= now:
            self.expired += 1
            raise DeadlineExceeded(
                f"the batch's deadline passed while it waited {now - received:.6f}s in the "
                "actor for the run before it; nothing was computed"
            )
        arrays = _codec.decode(inputs) if self._codec else inputs
        self.computed += 1
        if timings is not None:
            timings["run_start"] = time.time_ns()
        try:
            return await self._instance.execute(arrays)
        finally:
            ended, last = time.time_ns(), self._last_end
            self._last_end = ended
            if timings is not None:
                timings["run_end"] = ended
                timings["queued"] = self._serial
                if self._serial:  # it ran once the run before it (the last to end) had
                    timings["run_start"] = max(timings["run_start"], last)

    def statistics(self) -> dict[str, Any]:
        """The actor's counters, and what its ONNX Runtime instance aborted."""
        return {
            "computed": self.computed,
            "expired": self.expired,
            "cancelled": self.cancelled,
            "aborted": getattr(self._instance, "aborted", 0),
            "last_remaining": self.last_remaining,
            "last_hop": self.last_hop,
            "last_allowance": self.last_allowance,
            "in_flight": self._in_flight,
        }

    async def watch(self) -> None:
        """Return when the actor closes: a call the driver keeps pending while it lives.

        It fails (``RayActorError``) when the actor dies, is killed or loses its
        node, which tells the driver at once, with no batch sent to learn it.
        """
        if self._closed is not None:
            await self._closed.wait()

    async def close(self) -> None:
        """Close the instance, and end `watch`. Idempotent."""
        if self._closed is not None:
            self._closed.set()
        instance, self._instance = self._instance, None
        if instance is not None:
            await instance.aclose()


@functools.cache
def clock_id() -> str | None:
    """What names this machine's monotonic clock: the kernel's boot id (Linux), else None.

    Two processes with the same boot id run on one kernel, whose
    ``CLOCK_MONOTONIC`` (Python's ``time.monotonic``) they share: a time one
    reads is a time the other can compare with its own. None where the boot
    id cannot be read; the clocks are then never taken to be the same.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _is_cancelled(exc: BaseException) -> bool:
    return isinstance(exc, asyncio.CancelledError)


def _on_node(exc: TrioInferError, where: str) -> TrioInferError:
    # The same error, of the same class (the engine and the fallbacks read the class),
    # its message saying where it happened.
    try:
        error = copy.copy(exc)
    except Exception:  # a class that cannot be rebuilt from its args: as it is, then
        return exc
    error.args = (f"{exc} ({where})", *exc.args[1:])
    return error
