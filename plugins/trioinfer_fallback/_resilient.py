"""The ``resilient`` fallback: breakers, retries, failover and hedging around each batch."""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping, Sequence
from typing import Any, final

import anyio
import numpy as np

from trioinfer import BackendError, ConfigError, PluginContractError, TrioInferError
from trioinfer.lowlevel import Execution, FallbackContext, Replica, Request, check_seconds

from ._breaker import Breaker, BreakerState

logger = logging.getLogger("trioinfer")

#: Longest a probe may take when no ``timeout`` is configured.
PROBE_TIMEOUT_S = 60.0


def _transient(error: BaseException) -> bool:
    return getattr(error, "transient", False) is True


def _backend_fault(error: Exception) -> bool:
    # Errors of the engine's own making (a refused input, a plugin bug) say
    # nothing about the instance; anything else an execution raised does.
    return isinstance(error, BackendError) or not isinstance(error, TrioInferError)


@final
class Resilient:
    """Keeps a model answering while its instances fail.

    Each batch runs on the instance the engine chose. If that raises:

    1. **Failover and retry.** The batch runs again, up to *attempts*
       executions in all: at once on another serving instance when there is
       one it has not tried (same device first, then other devices, biggest
       capacity first); else, only for errors the backend marks
       ``transient``, on the same instance after a backoff (exponential from
       *backoff*, capped at *max_backoff*, with full jitter). No attempt
       starts after the batch's latest deadline; and right before an attempt
       reaches the backend (after waiting for the instance and its device),
       the engine drops the requests whose callers left or whose deadline
       passed, so they are never computed.
    2. **Other models.** Each request still unanswered goes to the *models*
       named, in order (another model or version, loaded in the same engine),
       under its own deadline; also while the engine drains at close, since
       the request was accepted before.
    3. **Default.** If *default* is set, what is still unanswered gets it.

    Otherwise the requests fail with the last error. Each step is recorded
    on the request (see [`InferenceResult.fallbacks`][trioinfer.InferenceResult]).

    With *breaker* set, each instance has a [`Breaker`][trioinfer_fallback.Breaker]:
    only backend faults count (errors, and executions past *timeout*), never
    a caller's cancellation or a refused input. When it opens, the instance
    is taken out of service, and a background task in the engine's task group
    waits the breaker's reset timeout, then probes the instance with a
    synthetic input until enough probes succeed, re-creating the instance
    first when the last error was not transient (a dead session) or its
    instance is gone (a Ray actor that died; a re-creation that fails counts
    as a failed probe, doubling the wait). When every
    instance is out, requests fail at once with [`CircuitOpen`][trioinfer.CircuitOpen].

    With *hedge_after* set, a batch still running after that many seconds is
    also started on a second instance; the first answer wins and the other
    execution is cancelled.

    Args:
        attempts: Executions of a batch on this model's instances, in all (1: no retry).
        backoff: Upper bound of the first retry's random wait, in seconds; it
            doubles with each retry (a failover, which waits nothing, does not count).
        max_backoff: Upper bound of any retry's wait.
        timeout: Seconds an execution may run before it counts as hung: it is
            cancelled and fails with a transient ``BackendError``. ``None``: no limit.
        models: Models to send a request to when every attempt failed, in order.
        default: One row's value for every model output, by output name: the
            answer of last resort.
        hedge_after: Seconds before a running batch is hedged on a second
            instance; ``None`` (the default) never hedges.
        breaker: Options of each instance's [`Breaker`][trioinfer_fallback.Breaker]
            (``{}`` for the defaults); ``None`` for no breaker.
        seed: Seeds the backoff jitter, for reproducible tests.

    Raises:
        ConfigError: An option out of range, or a *default* that does not fit the model.
    """

    def __init__(
        self,
        *,
        attempts: int = 3,
        backoff: float = 0.05,
        max_backoff: float = 2.0,
        timeout: float | None = None,
        models: Sequence[str] = (),
        default: Mapping[str, Any] | None = None,
        hedge_after: float | None = None,
        breaker: Mapping[str, Any] | None = None,
        seed: int | None = None,
    ) -> None:
        if not isinstance(attempts, int) or isinstance(attempts, bool) or attempts < 1:
            raise ConfigError(f"fallback option attempts must be an integer >= 1, got {attempts!r}")
        self.attempts = attempts
        self.backoff = _seconds("backoff", backoff)
        self.max_backoff = max(_seconds("max_backoff", max_backoff), self.backoff)
        self.timeout = None if timeout is None else _positive("timeout", timeout)
        self.hedge_after = None if hedge_after is None else _seconds("hedge_after", hedge_after)
        if not isinstance(models, (list, tuple)) or not all(isinstance(m, str) for m in models):
            raise ConfigError(
                f"fallback option models must be a list of model names, got {models!r}"
            )
        self.models = tuple(models)
        if default is not None and not (
            isinstance(default, Mapping) and all(isinstance(k, str) for k in default)
        ):
            raise ConfigError(
                f"fallback option default must be a table of output name = value, got {default!r}"
            )
        self._default_options = default
        self._default: dict[str, np.ndarray[Any, Any]] | None = None
        if breaker is not None:
            Breaker.from_options(breaker)  # refuse bad options at load, not at the first fault
        self._breaker_options = None if breaker is None else dict(breaker)
        self._rng = random.Random(seed)
        self._context: FallbackContext | None = None
        self._batched = True
        #: Each instance's breaker, by instance index (empty without *breaker*).
        self.breakers: dict[int, Breaker] = {}
        # Instances whose re-prober runs: one per instance, however often it reopens.
        self._recovering: set[int] = set()

    def attach(self, context: FallbackContext) -> None:
        """Check *default* against the model and give every instance its breaker."""
        self._context = context
        self._batched = context.signature.batched
        if self._default_options is not None:
            self._default = _default_outputs(context, self._default_options)
        if self._breaker_options is not None:
            self.breakers = {
                replica.index: Breaker.from_options(self._breaker_options)
                for replica in context.replicas
            }
        if context.model in self.models:
            raise ConfigError(f"model {context.model!r} lists itself in its fallback models")

    # -- one batch -------------------------------------------------------------------

    async def execute(self, execution: Execution) -> None:
        """Run the batch, failing over, retrying and falling back as configured."""
        replica = execution.replica
        tried: list[Replica] = []
        error: Exception | None = None
        retries = 0  # the backoff doubles per retry: a failover before one waits nothing
        for _ in range(self.attempts):
            if error is not None:
                following = self._next(replica, tried)
                transient = _transient(error)
                if following is None:
                    if not (transient and replica.serving):
                        break
                    following = replica
                # Another instance may take the batch at once; the same one gets time to recover.
                delay = 0.0
                if following is replica:
                    retries += 1
                    delay = self._delay(retries)
                if self._now() + delay >= execution.deadline():
                    break
                if delay:
                    await anyio.sleep(delay)
                    if not execution.pending():
                        return
                step = "retry" if following is replica else "failover"
                execution.note(f"{step} {following.label}")
                replica = following
            try:
                await self._run(execution, replica)
            except Exception as exc:
                if not _backend_fault(exc):
                    raise
                error = exc
                tried.append(replica)
            else:
                return
            if not execution.pending():
                return
        if self.models:
            async with anyio.create_task_group() as tg:
                for request in execution.pending():
                    tg.start_soon(self._elsewhere, execution, request)
        if self._default is not None:
            for request in execution.pending():
                execution.respond(request, self._default_for(request), via="default")
        if execution.pending() and error is not None:
            raise error

    def _now(self) -> float:
        assert self._context is not None
        return self._context.current_time()

    def _delay(self, retry: int) -> float:
        # Full jitter: uniform over [0, min(cap, base * 2**(n-1))] for the n-th retry.
        ceiling = min(self.max_backoff, self.backoff * 2 ** (retry - 1))
        return self._rng.uniform(0.0, ceiling)

    def _next(self, current: Replica, tried: Sequence[Replica]) -> Replica | None:
        assert self._context is not None
        candidates = [
            r for r in self._context.replicas if r.serving and r is not current and r not in tried
        ]
        if not candidates:
            return None
        return min(candidates, key=lambda r: (r.device != current.device, -r.capacity, r.index))

    async def _run(self, execution: Execution, replica: Replica) -> None:
        if self.hedge_after is None:
            await self._timed(execution, replica)
            return
        errors: list[Exception] = []
        first_done = anyio.Event()

        async def attempt(target: Replica, done: anyio.Event | None) -> None:
            try:
                await self._timed(execution, target)
            except Exception as exc:
                errors.append(exc)
            else:
                tg.cancel_scope.cancel()  # the first answer wins
            finally:
                if done is not None:
                    done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(attempt, replica, first_done)
            with anyio.move_on_after(self.hedge_after):
                await first_done.wait()
            if not first_done.is_set() and execution.pending():
                second = self._next(replica, [replica])
                if second is not None:
                    execution.note(f"hedge {second.label}")
                    tg.start_soon(attempt, second, None)
        if execution.pending() and errors:
            raise errors[0]

    async def _timed(self, execution: Execution, replica: Replica) -> None:
        try:
            ran = await self._run_once(execution, replica)
        except Exception as exc:
            if _backend_fault(exc):
                self._failed(replica, exc)
            raise
        breaker = self.breakers.get(replica.index)
        if breaker is not None and ran:  # a batch whose callers all left says nothing
            breaker.success()

    async def _run_once(self, execution: Execution, replica: Replica) -> bool:
        if self.timeout is None:
            return await execution.run(replica)
        ran = False
        with anyio.move_on_after(self.timeout) as scope:
            ran = await execution.run(replica)
        if scope.cancelled_caught:
            raise BackendError(
                f"{replica.label} of model {self._model()!r} did not answer within {self.timeout}s",
                transient=True,
            )
        return ran

    async def _elsewhere(self, execution: Execution, request: Request) -> None:
        for model in self.models:
            try:
                outputs = await execution.infer_elsewhere(model, request)
            except TrioInferError as exc:
                logger.debug(
                    "failover of request %r to model %r failed: %s", request.id, model, exc
                )
                continue
            try:
                execution.respond(request, outputs, via=f"model {model}")
            except PluginContractError as exc:  # its outputs are not this model's
                logger.warning("model %r cannot stand in for %r: %s", model, self._model(), exc)
                continue
            return

    def _default_for(self, request: Request) -> dict[str, np.ndarray[Any, Any]]:
        assert self._default is not None
        if not self._batched:
            return {name: value.copy() for name, value in self._default.items()}
        return {
            name: np.repeat(value[np.newaxis], request.rows, axis=0)
            for name, value in self._default.items()
        }

    def _model(self) -> str:
        assert self._context is not None
        return self._context.model

    # -- breakers and recovery ---------------------------------------------------------

    def replica_gone(self, replica: Replica) -> None:
        """Re-create an instance the engine found gone, at once (only with a breaker).

        Its breaker opens whatever it had counted, and the re-prober re-creates
        the instance, then probes it, as when a batch found it dead. Without a
        breaker nothing re-creates instances: it stays out until the model is
        loaded again.
        """
        breaker = self.breakers.get(replica.index)
        if breaker is None:
            return
        breaker.trip()
        self._opened(replica, breaker, f"circuit breaker open: {replica.reason}", True)

    def _failed(self, replica: Replica, error: Exception) -> None:
        breaker = self.breakers.get(replica.index)
        if breaker is None or not breaker.failure():
            return
        reason = f"circuit breaker open after {breaker.describe()}; last: {error}"
        self._opened(replica, breaker, reason, not _transient(error))

    def _opened(self, replica: Replica, breaker: Breaker, reason: str, dead: bool) -> None:
        # Its breaker opened: out of service, and its re-prober started (one at a time).
        assert self._context is not None
        self._context.take_out(replica, reason, retry_after=breaker.wait)
        if replica.index not in self._recovering:
            self._recovering.add(replica.index)
            self._context.start_soon(self._recover, replica, breaker, dead)

    async def _recover(self, replica: Replica, breaker: Breaker, dead: bool) -> None:
        # The instance's re-prober: a task in the engine's task group, one per opening.
        context = self._context
        assert context is not None
        wait = not dead  # a dead session is re-created at once
        while True:
            if wait:
                await anyio.sleep(breaker.wait)
            wait = True
            if dead or replica.gone is not None:
                # (One found gone while out: re-created now, not probed first, as a call
                # to a dead actor could only fail, and then wait again.)
                try:
                    await context.recreate(replica)
                except Exception as exc:
                    # A failed probe of its own: reopen, doubling the wait. (failure()
                    # alone does nothing on an open breaker, and the instance was
                    # reloaded every reset_timeout for ever.)
                    breaker.half_open()
                    breaker.failure()
                    context.take_out(
                        replica, f"re-creating it failed: {exc}", retry_after=breaker.wait
                    )
                    continue
            breaker.half_open()
            context.take_out(replica, "circuit half-open: probing", retry_after=0.0)
            try:
                for _ in range(breaker.probes):
                    with anyio.fail_after(self.timeout or PROBE_TIMEOUT_S):
                        await context.probe(replica)
                    breaker.success()
            except Exception as exc:
                breaker.failure()
                dead = not _transient(exc) and not isinstance(exc, TimeoutError)
                context.take_out(
                    replica, f"circuit open: a probe failed: {exc}", retry_after=breaker.wait
                )
                continue
            if breaker.state is BreakerState.CLOSED:
                self._recovering.discard(replica.index)
                context.put_back(replica)
                return


def _default_outputs(
    context: FallbackContext, options: Mapping[str, Any]
) -> dict[str, np.ndarray[Any, Any]]:
    signature = context.signature
    names = [spec.name for spec in signature.outputs]
    unknown = sorted(set(options) - set(names))
    missing = [name for name in names if name not in options]
    if unknown or missing:
        raise ConfigError(
            f"fallback option default of model {context.model!r} must give every output "
            f"({', '.join(names)}); unknown: {unknown}, missing: {missing}"
        )
    outputs = {}
    for spec in signature.outputs:
        try:
            value = np.asarray(options[spec.name], dtype=spec.dtype)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"fallback option default[{spec.name!r}] is not a {spec.dtype} array: {exc}"
            ) from exc
        row = spec.shape[1:] if signature.batched else spec.shape
        fits = len(value.shape) == len(row) and all(
            not isinstance(want, int) or want == got
            for want, got in zip(row, value.shape, strict=True)
        )
        if not fits:
            raise ConfigError(
                f"fallback option default[{spec.name!r}] has shape {value.shape}; one "
                f"{'row' if signature.batched else 'answer'} of output {spec.name!r} has "
                f"shape {tuple(row)}"
            )
        outputs[spec.name] = value
    return outputs


def _seconds(name: str, value: object) -> float:
    return check_seconds(f"fallback option {name}", value, zero=True)


def _positive(name: str, value: object) -> float:
    return check_seconds(f"fallback option {name}", value)
