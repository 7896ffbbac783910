"""Pipelines: a model that is a graph of steps over other loaded models (Triton's ensembles).

A pipeline is loaded like a model, with ``backend = "pipeline"``::

    backend = "pipeline"

    [backend_options]
    inputs = [{ name = "IMAGE", dtype = "float32", shape = ["batch", 64] }]
    outputs = [{ name = "NAME", dtype = "string", shape = ["batch"] }]

    [[backend_options.steps]]
    model = "digits"
    input_map = { input = "IMAGE" }              # the step model's input <- a pipeline tensor
    output_map = { probabilities = "SCORES" }    # the step model's output -> a pipeline tensor

    [[backend_options.steps]]
    model = "names"
    input_map = { probabilities = "SCORES" }
    output_map = { name = "NAME" }

It has no instances and no queue of its own. A request runs in its caller's
task: each step is an ``engine.infer`` on the step's model, so it goes
through that model's own queue, batcher and instances, under the caller's
cancel scope (its deadline and cancellation reach every step). A step starts
as soon as its inputs are there; steps whose inputs are there run at once,
side by side, each in a task of its own. Leading steps that have nothing
beside them (all of a chain's) run in turn in the caller's task, with no task
or wake-up of their own. A step on a model that would pass a lone request
straight through, with an idle instance and nothing queued, skips even the
queue: it runs on that instance in this task (``ModelRunner.run_here``).
``engine.infer`` runs a chain whose every step's model is idle and never
suspends as plain calls (``Pipeline.run_now``): no request object, coroutine
or task for the pipeline or its steps; where a step cannot run so, ``call``
goes on from that step.
The first step to fail cancels the others and ends the request with its
error, the step named in the message.

All of this is a pipeline without a batcher (``batcher = "none"``, the
default). One that names a batcher batches whole requests: see
``trioinfer._pipeline_batched``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast, final

import anyio
import anyio.abc
import anyio.lowlevel
import attrs
import numpy as np

from ._config import PIPELINE, ModelConfig
from ._exceptions import (
    BackendError,
    ConfigError,
    DeadlineExceeded,
    EngineClosed,
    QueueFull,
    TrioInferError,
)
from ._inline import restart_inline_slice
from ._request import Outputs, Request, step_request_id
from ._runner import (
    BATCH_BUCKETS,
    CLEANUP_S,
    DURATION_BUCKETS,
    ModelRunner,
    ModelStatistics,
    Unfinished,
    _copy_error,
    _Histogram,
)
from ._tensors import ModelSignature, TensorSpec, rows_validator
from ._threads import LoopClock
from .abc import Status

Infer = Callable[..., Any]


@final
class _Later:
    """What `Pipeline._step_now` says of a step it left whole to `Pipeline._step`."""


_LATER = _Later()
_SPENT = _Later()


@final
@attrs.frozen
class Resume:
    """Where `Pipeline.run_now` stopped: what `Pipeline.call` goes on from.

    *at*: the position in the steps run in turn; *tensors*: the request's
    tensors so far (None: from its inputs); *left*: what that step still needs
    (`Pipeline._step_now`'s answer).
    """

    at: int
    tensors: dict[str, Any] | None
    left: Unfinished | _Later

    @property
    def spent(self) -> bool:
        """Whether it stopped only because the loop's inline slice was spent before a step."""
        return self.left is _SPENT


_FROM_START = Resume(0, None, _LATER)


@attrs.frozen
class Step:
    """One step of a pipeline: a model, and where its inputs come from and outputs go."""

    model: str
    input_map: Mapping[str, str]
    output_map: Mapping[str, str]


#: Steps with their positions, in the order they start.
_Steps = tuple[tuple[int, Step], ...]


def step_outputs(step: Step, model: ModelSignature) -> tuple[str, ...]:
    """The outputs *step* asks its model for: those its ``output_map`` keeps, if not all.

    Empty where it keeps every output of *model* (its signature): the usual step,
    whose request names none. Else its request names those, as Triton's ensemble
    asks each step for the outputs it maps, so that a model that can skip the
    others (an `trioinfer.abc.OutputsInstance`) does. Those *model* has alone: a
    model loaded anew may lack some (`Pipeline.step_model_loaded`), which its
    answer then lacks too, as the step's error says.
    """
    names = {spec.name for spec in model.outputs}
    kept = tuple(name for name in step.output_map if name in names)
    if names <= set(kept):
        return ()
    return kept


def _steps(name: str, value: object) -> tuple[Step, ...]:
    where = f"backend option steps of pipeline {name!r}"
    if not isinstance(value, Sequence) or isinstance(value, str) or not value:
        raise ConfigError(
            f"{where} must be a non-empty list of tables with model, input_map, output_map"
        )
    steps = []
    for i, item in enumerate(value):
        if not isinstance(item, Mapping) or set(item) != {"model", "input_map", "output_map"}:
            raise ConfigError(
                f"{where}: step {i} must be a table of model, input_map and output_map, "
                f"got {item!r}"
            )
        maps = []
        for key in ("input_map", "output_map"):
            table = item[key]
            if (
                not isinstance(table, Mapping)
                or not table
                or not all(isinstance(k, str) and isinstance(v, str) for k, v in table.items())
            ):
                raise ConfigError(
                    f"{where}: step {i}'s {key} must be a table of the model's tensor name = "
                    f"a pipeline tensor name, got {table!r}"
                )
            maps.append(dict(table))
        if not isinstance(item["model"], str) or not item["model"]:
            raise ConfigError(f"{where}: step {i}'s model must be a model name")
        steps.append(Step(item["model"], maps[0], maps[1]))
    return tuple(steps)


def _declared(config: ModelConfig) -> tuple[ModelSignature, tuple[Step, ...]]:
    """A pipeline config's signature and steps, its options checked (batched or not)."""
    options = config.backend_options
    if "steps" not in options:
        # Most often another model's config with backend = "pipeline" (a load override
        # that set only the backend): say what a pipeline is, not what its inputs lack.
        have = ", ".join(map(repr, sorted(options))) or "none"
        raise ConfigError(
            f"model {config.name!r} has backend 'pipeline' but its backend_options describe "
            f"no pipeline (they hold {have}): a pipeline needs backend_options.steps (the "
            "models it runs, each a table of model, input_map and output_map) and "
            "backend_options.inputs and .outputs (its tensors, each a table of name, dtype "
            "and shape); set them, or another backend"
        )
    unknown = sorted(set(options) - {"inputs", "outputs", "steps"})
    if unknown:
        raise ConfigError(
            f"pipeline {config.name!r}: unknown option {', '.join(map(repr, unknown))}; "
            "known: inputs, outputs, steps"
        )
    signature = ModelSignature.declared(
        options.get("inputs"), options.get("outputs"), model=config.name
    )
    optional = [spec.name for spec in signature.inputs if spec.optional]
    if optional:
        # A step's input mapped from a tensor the request left out would have no value:
        # a step leaves its model's optional inputs out by mapping nothing to them.
        raise ConfigError(
            f"pipeline {config.name!r}: input {optional[0]!r} is optional, which a "
            "pipeline's inputs cannot be; leave an optional input of a step's model out "
            "of its input_map instead, and the step runs without it"
        )
    return signature, _steps(config.name, options.get("steps"))


@final
class Pipeline:
    """A loaded pipeline, as the engine holds it beside its model runners.

    It answers the engine as a runner does (``call``, ``statistics``,
    ``wait_idle``, ``stop``), so that it looks like one model from outside.
    Only the engine creates it.
    """

    def __init__(
        self,
        config: ModelConfig,
        infer: Infer,
        signatures: Callable[[str], ModelSignature],
        steps_of: Callable[[str], Sequence[str]] = lambda model: (),
        step_runner: Callable[[str], ModelRunner | None] = lambda model: None,
    ) -> None:
        self.config = config
        self.signature, self.steps = _declared(config)
        self._infer = infer
        # The runner of a step's model when its requests may run in the pipeline's
        # task (the engine's say; the runner's idle_replica has the rest), else None.
        self._step_runner = step_runner
        rounds = _check_graph(config.name, self.signature, self.steps, signatures, steps_of)
        # The leading steps that can only run one at a time (each the only one
        # whose inputs are there), in order: they run in turn in the caller's
        # task; the rest (none, for a chain) side by side, each in a task.
        alone = 0
        while alone < len(rounds) and len(rounds[alone]) == 1:
            alone += 1
        self._in_turn = tuple(step for ready in rounds[:alone] for step in ready)
        self._side_by_side = tuple(sorted(step for ready in rounds[alone:] for step in ready))
        # Each step's (model tensor, pipeline tensor) pairs, in and out, as tuples, and
        # the outputs its request names (step_outputs: decided here, once per step).
        self._maps = tuple(
            (
                tuple(step.input_map.items()),
                tuple(step.output_map.items()),
                step_outputs(step, signatures(step.model)),
            )
            for step in self.steps
        )
        self._output_names = tuple(spec.name for spec in self.signature.outputs)
        # By the outputs a request named (Request.requested_outputs): the steps it
        # needs, in turn and side by side (`_needed`).
        self._needs: dict[frozenset[str], tuple[_Steps, _Steps]] = {}
        self.input_limits = config.input_limits
        self.queue_timeouts = config.queue_timeouts
        # Requests keep their rows (each step batches on its own); with a batch
        # dimension, their rows are counted (inferences, Triton's inference_count), as
        # a model's are: the checks are the same either way.
        self.batched = self.signature.batched
        #: ``validate_rows`` for this pipeline's inputs, as a model runner's.
        self.validate = rows_validator(config.name, self.signature, self.input_limits, self.batched)
        self.clock = LoopClock()
        self.devices: tuple[str, ...] = ()
        self._in_flight = 0
        self._idle: anyio.Event | None = None
        self._stopped = False
        # Set by stop() at the end of the drain period: the requests still in flight
        # end (EngineClosed), each at its next step or at the wait it is in. Where a
        # step waits on its model, its request to that model is in _held (a plain
        # model's: parked in it, queued or running there), or its wait is in a scope
        # in _scopes (any other way). A step run inline with no await needs neither.
        self._cut = False
        self._held: dict[Request, ModelRunner] = {}
        self._scopes: set[anyio.CancelScope] = set()
        self._stop = anyio.Event()
        self.succeeded = self.failed = self.cancelled = self.refused = self.expired = 0
        self.inferences = 0
        self._request_duration = _Histogram(DURATION_BUCKETS)

    @property
    def preferred_batch_sizes(self) -> tuple[int, ...]:
        """Nothing: a pipeline forms no batches of its own."""
        return ()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """Hold the pipeline's place in the engine's task group until stopped."""
        task_status.started()
        await self._stop.wait()

    def run_now(
        self, arrays: dict[str, Any], rows: int, deadline: float, now: float
    ) -> Outputs | Resume:
        """Run a request's steps as plain calls, from `validate` with no await since.

        *deadline* (the caller's effective deadline, not -inf) and *now* read
        then. When every step's model is idle, never suspends and the loop's
        inline slice lasts (`_step_now`), the request ends here, counted, with
        no request object, coroutine or task: its outputs. Else a `Resume` to
        pass to `call` at once (no await before), which goes on where this
        stopped; the steps run so far are not run again. One that stopped
        only because the slice was spent (`Resume.spent`) may go to
        `run_after_yield` instead.

        Raises:
            What a step's inputs or outputs failed with, the step named.
        """
        if (
            self._stopped
            or self._side_by_side
            or self._in_flight >= self.config.max_queue_size
            or deadline <= now
        ):
            return _FROM_START  # call's way: the errors it raises, side by side steps
        tensors: dict[str, Any] = dict(arrays)
        stopped = self._steps_now(tensors, 0, False, deadline)
        if stopped is not None:
            return stopped
        return self._answered(tensors, rows, now)

    async def run_after_yield(self, rows: int, resume: Resume, arrival: float) -> Outputs | Resume:
        """Yield for the loop's inline slice, then run on from *resume* as `run_now` does.

        For a request that `run_now` stopped only because the slice was spent
        before a step (`Resume.spent`), at once (no await before); *arrival*:
        the *now* it was given. With a step of a few hundred microseconds that
        is every request: here it costs the yield, not a request object and
        `call` (its bookkeeping, a coroutine, its cancel checks). The request
        counts as in flight meanwhile (`stop` and `wait_idle` wait for it,
        ``max_queue_size`` counts it). Its outputs, or a `Resume` for `call`
        (a step whose model is busy, a deadline gone by).

        Raises:
            What `run_now` raises; ``Cancelled`` if its caller was cancelled
            meanwhile (counted cancelled), `EngineClosed` if the pipeline
            was stopped meanwhile (counted failed, as `call` counts one it cuts off).
        """
        assert resume.tensors is not None  # (run_now's, which ran a step or none)
        clock = self.clock
        self._in_flight += 1
        try:
            while True:
                try:
                    await clock.checkpoint()
                except anyio.get_cancelled_exc_class():
                    self.cancelled += 1
                    raise
                restart_inline_slice()
                if self._stopped:
                    self.failed += 1
                    raise EngineClosed(
                        f"pipeline {self.config.name!r} was unloaded or the engine closed "
                        "before a request's steps ended"
                    )
                deadline = clock.current_effective_deadline()
                if deadline <= clock.current_time():
                    return Resume(resume.at, resume.tensors, _LATER)  # call raises it
                stopped = self._steps_now(resume.tensors, resume.at, True, deadline)
                if stopped is None:
                    return self._answered(resume.tensors, rows, arrival)
                if not stopped.spent:
                    return stopped
                resume = stopped  # spent again before a later step: yield again
        finally:
            self._in_flight -= 1
            if not self._in_flight and self._idle is not None:
                self._idle.set()
                self._idle = None

    def _steps_now(
        self, tensors: dict[str, Any], at: int, yielded: bool, deadline: float
    ) -> Resume | None:
        # The steps in turn from position *at* as plain calls (_step_now), their
        # outputs into *tensors*: None once all have run, else where it stopped.
        # *yielded*: the first of them need not look at the slice (just restarted).
        try:
            for index, step in self._in_turn[at:] if at else self._in_turn:
                left = self._step_now(index, step, tensors, yielded, deadline)
                if left is not None:
                    return Resume(at, tensors, left)
                yielded = False
                at += 1
        except TrioInferError:
            self.failed += 1
            raise
        return None

    def _answered(self, tensors: dict[str, Any], rows: int, arrival: float) -> Outputs:
        # A request whose steps all ran as plain calls: counted, its outputs.
        outputs = self._outputs(tensors, self._output_names)
        self.succeeded += 1
        self.inferences += rows or 1
        self._request_duration.observe(self.clock.current_time() - arrival)
        return outputs

    async def call(
        self, request: Request, *, own_deadline: bool = True, resume: Resume = _FROM_START
    ) -> Outputs:
        """Run *request* through the steps, in the caller's task, and return its outputs.

        *resume*: where `run_now` stopped, for its request (else from the start).
        """
        state = request._state
        if self._stopped:
            raise EngineClosed(f"pipeline {self.config.name!r} was unloaded")
        if self._in_flight >= self.config.max_queue_size:
            self.refused += 1
            raise QueueFull(
                f"pipeline {self.config.name!r} has {self._in_flight} requests in flight, its "
                "max_queue_size; retry later",
                retry_after=0.01,
            )
        self._in_flight += 1
        state.status = Status.RUNNING
        try:
            if own_deadline:
                outputs = await self._run(request, resume)
            else:
                outputs = await self._run_by_deadline(request)
        except anyio.get_cancelled_exc_class():
            self.cancelled += 1
            raise
        except BaseException as exc:
            if self._cut and isinstance(exc, TrioInferError):
                # Cut off by stop(): the error a model's request gets when its runner stops.
                self.failed += 1
                raise EngineClosed(
                    f"model {self.config.name!r} was unloaded or the engine closed before "
                    f"request {request.id!r} ended"
                ) from None
            if isinstance(exc, DeadlineExceeded):
                self.expired += 1
            else:
                self.failed += 1
            raise
        else:
            self.succeeded += 1
            self.inferences += request.rows or 1
            self._request_duration.observe(self.clock.current_time() - request.arrival)
            state.outputs = outputs
            return outputs
        finally:
            state.status = Status.DONE
            self._in_flight -= 1
            if not self._in_flight and self._idle is not None:
                self._idle.set()
                self._idle = None

    async def _run_by_deadline(self, request: Request) -> Outputs:
        # The pipeline's queue_timeouts: a deadline its caller did not set.
        with anyio.CancelScope(deadline=request.deadline):
            return await self._run(request)
        raise DeadlineExceeded(
            f"request {request.id!r} for pipeline {self.config.name!r} reached its deadline "
            "before its steps ended"
        )

    async def _run(self, request: Request, resume: Resume = _FROM_START) -> Outputs:
        tensors = dict(request.inputs) if resume.tensors is None else resume.tensors
        left: Unfinished | _Later | None = resume.left
        in_turn, side_by_side = self._in_turn, self._side_by_side
        if request.requested_outputs:
            # (Only call() sees such a request, from its start: run_now never does.)
            in_turn, side_by_side = self._needed(request.requested_outputs)
        for index, step in in_turn[resume.at :]:
            # No task group, task or wake-up for a step that has nothing beside it,
            # and, on an idle model that never suspends, not even a coroutine.
            if left is _LATER and not request.parameters:
                # (Not run_now's answer for this step: ask now. A request with
                # parameters takes _step's way, which passes them to the step.)
                left = self._step_now(index, step, tensors)
            if left is _SPENT:
                # The loop's inline slice is spent: yield now, holding nothing, then
                # try again (anything may have changed meanwhile).
                await self.clock.checkpoint()
                restart_inline_slice()
                left = self._step_now(index, step, tensors, yielded=True)
            if left is not None:
                await self._step(request, index, step, tensors, left)
            left = _LATER
        if side_by_side:
            await self._run_side_by_side(request, tensors, side_by_side)
        return self._outputs(tensors, request.requested_outputs or self._output_names)

    def _needed(self, wanted: tuple[str, ...]) -> tuple[_Steps, _Steps]:
        # The steps, in turn and side by side, of a request that named *wanted* of the
        # pipeline's outputs: those that make them and those that make what those
        # need, no other (as a Triton ensemble prunes its steps by the requested
        # outputs). All named: every step.
        key = frozenset(wanted)
        found = self._needs.get(key)
        if found is None:
            if len(key) == len(self._output_names):
                found = (self._in_turn, self._side_by_side)
            else:
                producer = {t: i for i, s in enumerate(self.steps) for t in s.output_map.values()}
                keep: set[int] = set()
                todo = list(key)
                while todo:
                    index = producer.get(todo.pop())  # None: a pipeline input
                    if index is not None and index not in keep:
                        keep.add(index)
                        todo.extend(self.steps[index].input_map.values())
                found = (
                    tuple(pair for pair in self._in_turn if pair[0] in keep),
                    tuple(pair for pair in self._side_by_side if pair[0] in keep),
                )
            if len(self._needs) >= 64:  # a bound: a pipeline has few outputs, but still
                self._needs.clear()
            self._needs[key] = found
        return found

    def _outputs(self, tensors: dict[str, Any], names: tuple[str, ...]) -> Outputs:
        outputs = {}
        for name in names:
            value = tensors[name]
            # Arrays already, from every backend that checks its outputs.
            outputs[name] = value if type(value) is np.ndarray else np.asarray(value)
        return outputs

    def _step_now(
        self,
        index: int,
        step: Step,
        tensors: dict[str, Any],
        yielded: bool = False,
        deadline: float | None = None,
    ) -> Unfinished | _Later | None:
        # One step run to its end as a plain call, when its model is idle, never
        # suspends and its inline slice is not spent (ModelRunner.run_now): its
        # outputs join *tensors*, and None says so. Else what _step must do:
        # _LATER (all of it), or an Unfinished to end. *deadline*: the caller's
        # effective deadline, from run_now, which read it with no await since (no
        # other task has run, so it stands): reading it again walked up the caller's
        # cancel scopes once per step (some 30 Python lines each, five scopes deep).
        runner = self._step_runner(step.model)
        if runner is None or self._cut:
            return _LATER
        replica = runner.idle_inline_now(yielded)
        if replica is None:
            # Busy, or an instance that may suspend (an async def model): run_here
            # starts that one in a cancel scope of its own (_step's way).
            return _LATER
        if replica is False:
            return _SPENT
        inputs = {}
        for own, shared in self._maps[index][0]:
            inputs[own] = tensors[shared]
        try:
            arrays, rows = runner.validate(inputs)
        except TrioInferError as exc:
            raise self._step_error(index, step, exc) from exc
        clock = runner.clock
        if deadline is None:
            deadline = clock.current_effective_deadline()
        now = clock.current_time()
        if deadline <= now:
            # A cancelled caller (-inf) or a deadline gone by: _step's way raises it.
            return _LATER
        done = runner.run_now(replica, arrays, rows, deadline, now, self._maps[index][2])
        if done.__class__ is Unfinished:
            return done
        self._keep(index, step, done, tensors)  # type: ignore[arg-type]  # (not Unfinished)
        return None

    def _keep(self, index: int, step: Step, outputs: Outputs, tensors: dict[str, Any]) -> None:
        # A step's outputs, into the pipeline's tensors by its output map.
        try:
            for own, shared in self._maps[index][1]:
                tensors[shared] = outputs[own]
        except KeyError:
            # The step's model was replaced by one with other outputs.
            missing = sorted(set(step.output_map) - set(outputs))
            error = BackendError(f"its model answered without outputs {missing}")
            raise self._step_error(index, step, error) from None

    def _step_error(self, index: int, step: Step, exc: TrioInferError) -> TrioInferError:
        # A step's error keeps its class (a client's fault stays a client's fault),
        # its message naming the step.
        where = f"pipeline {self.config.name!r}, step {index} (model {step.model!r})"
        return _copy_error(exc, cause=exc, message=f"{where}: {exc}")

    async def _step(
        self,
        request: Request,
        index: int,
        step: Step,
        tensors: dict[str, Any],
        left: Unfinished | _Later = _LATER,
    ) -> None:
        # One step's request to its model, the way _step_now could not take (or
        # the end of what it began: *left*); its outputs join *tensors*.
        try:
            if left.__class__ is Unfinished:
                runner = self._step_runner(step.model)
                assert runner is not None  # (no await since _step_now had it)
                outputs = await runner.finish_here(
                    left,
                    step_request_id(request.id, index),
                    request.priority,
                    request.tenant,
                    self._held,
                )
            else:
                outputs = await self._step_request(request, index, step, tensors)
        except TrioInferError as exc:
            raise self._step_error(index, step, exc) from exc
        self._keep(index, step, outputs, tensors)

    async def _step_request(
        self, request: Request, index: int, step: Step, tensors: dict[str, Any]
    ) -> Outputs:
        if self._cut:
            raise EngineClosed(f"pipeline {self.config.name!r} stopped before step {index}")
        ins = self._maps[index][0]
        inputs = {}
        for own, shared in ins:
            inputs[own] = tensors[shared]
        model = step.model
        runner = self._step_runner(model)
        replica = None if runner is None else runner.idle_replica()
        if replica is not None and runner is not None and runner.slice_spent(replica):
            # The loop's inline slice is spent: yield now, holding nothing, not
            # in the instance's execute while it holds the model (whoever came
            # by meanwhile would queue, and the queue then seldom empties).
            await self.clock.checkpoint()
            restart_inline_slice()
            if self._cut:
                raise EngineClosed(f"pipeline {self.config.name!r} stopped before step {index}")
            # Anything may have changed meanwhile (the model replaced, the engine
            # closing, tracing turned on): ask the engine again, as a later step does.
            runner = self._step_runner(model)
            replica = None if runner is None else runner.idle_replica()
        if request.parameters:
            replica = None  # the step's request carries them: engine.infer's way, below
        deadline = -math.inf
        if replica is not None:
            # The model is idle: run the step here, in this task, under the caller's
            # scope, with no queue, worker or wake-up (what engine.infer does up to
            # the queue, then run_alone, or less: run_here). The check and the run
            # have no await between.
            assert runner is not None
            # As engine.infer checks them, with their rows, which run_here counts.
            arrays, rows = runner.validate(inputs)
            clock = runner.clock
            deadline = clock.current_effective_deadline()
        if deadline != -math.inf:  # else busy, or a cancellation for engine.infer to raise
            assert runner is not None
            assert replica is not None
            return await runner.run_here(
                replica,
                arrays,
                rows,
                step_request_id(request.id, index),
                request.priority,
                request.tenant,
                deadline,
                clock.current_time(),
                self._held,
                self._maps[index][2],
            )
        outputs = await self._infer(
            model,
            inputs,
            priority=request.priority,
            tenant=request.tenant,
            request_id=step_request_id(request.id, index),
            held=self._held,
            scopes=self._scopes,
            parameters=request.parameters,
            outputs=self._maps[index][2],
        )
        # It waited for its answer: the loop has had its turns meanwhile. Else
        # the slice would look spent, and the next inline step yield again.
        restart_inline_slice()
        return cast(Outputs, outputs)

    async def _run_side_by_side(
        self, request: Request, tensors: dict[str, Any], steps: _Steps
    ) -> None:
        pending = list(steps)
        changed = anyio.Event()
        running: set[int] = set()
        failure: TrioInferError | None = None

        async def run_step(index: int, step: Step, cancel: anyio.CancelScope) -> None:
            nonlocal changed, failure
            try:
                await self._step(request, index, step, tensors)
            except TrioInferError as exc:
                # The first failure is the answer; the steps still running are cancelled.
                if failure is None:
                    failure = exc
                cancel.cancel()
                return
            running.discard(index)
            changed.set()
            changed = anyio.Event()

        async with anyio.create_task_group() as tg:
            while (pending or running) and failure is None:
                for index, step in [
                    (i, s) for i, s in pending if all(t in tensors for t in s.input_map.values())
                ]:
                    pending.remove((index, step))
                    running.add(index)
                    tg.start_soon(run_step, index, step, tg.cancel_scope)
                if running:
                    await changed.wait()
        if failure is not None:
            raise failure

    def step_model_loaded(self, model: str, signature: ModelSignature) -> None:
        """*model* was loaded anew, with *signature*: its steps ask it for what it has.

        The outputs each step of *model* names (`step_outputs`) were decided for
        the model loaded before; the engine calls this as it puts a model in place.
        """
        self._maps = tuple(
            (ins, outs, step_outputs(step, signature)) if step.model == model else maps
            for step, maps, (ins, outs, _) in zip(self.steps, self._maps, self._maps, strict=True)
        )

    async def wait_idle(self) -> None:
        """Wait until no request is in flight."""
        while self._in_flight:
            if self._idle is None:
                self._idle = anyio.Event()
            await self._idle.wait()

    async def stop(self) -> None:
        """Refuse new requests, end those in flight, wait for them, and leave the task group.

        What stopping a model's runner does to its requests: each request still
        in flight (the drain period is over) ends with
        [`EngineClosed`][trioinfer.EngineClosed], its step requests with it,
        taken out of their models' queues or their executions aborted as if
        their callers had left; none of them answers after this returns.
        """
        self._stopped = True
        if self._in_flight:
            self._cut = True
            for step_request, runner in list(self._held.items()):
                runner.cut_off(
                    step_request,
                    EngineClosed(
                        f"pipeline {self.config.name!r} was unloaded or the engine closed "
                        f"before step request {step_request.id!r} ended"
                    ),
                )
            for scope in list(self._scopes):
                scope.cancel()
            # Each ends at once, at the wait it was woken from; a step whose instance
            # broke its word to run inline ends when it returns (nothing can abort it).
            with anyio.move_on_after(CLEANUP_S, shield=True):
                await self.wait_idle()
        self._stop.set()

    def statistics(self) -> ModelStatistics:
        """The pipeline's counters (its steps' are their models' own)."""
        empty = _Histogram(DURATION_BUCKETS).snapshot()
        return ModelStatistics(
            name=self.config.name,
            devices=(),
            queued=0,
            in_flight=self._in_flight,
            succeeded=self.succeeded,
            failed=self.failed,
            cancelled=self.cancelled,
            refused=self.refused,
            expired=self.expired,
            executions=0,
            mean_execution_s=0.0,
            buffers_allocated=0,
            buffers_reused=0,
            queue_duration=empty,
            compute_duration=empty,
            request_duration=self._request_duration.snapshot(),
            batch_size=_Histogram(BATCH_BUCKETS).snapshot(),
            inferences=self.inferences,
        )


def _check_graph(
    name: str,
    signature: ModelSignature,
    steps: Sequence[Step],
    signatures: Callable[[str], ModelSignature],
    steps_of: Callable[[str], Sequence[str]],
) -> list[list[tuple[int, Step]]]:
    """Refuse a pipeline whose steps do not fit their models or each other.

    Returns the steps in rounds: the first round's steps need only the
    pipeline's inputs, each later round's only what the rounds before it make.
    """
    where = f"pipeline {name!r}"
    producers: dict[str, TensorSpec] = {spec.name: spec for spec in signature.inputs}
    waiting = list(enumerate(steps))
    rounds: list[list[tuple[int, Step]]] = []
    while waiting:
        ready = [(i, s) for i, s in waiting if all(t in producers for t in s.input_map.values())]
        rounds.append(ready)
        if not ready:
            i, step = waiting[0]
            missing = sorted(set(step.input_map.values()) - set(producers))
            raise ConfigError(
                f"{where}: step {i} (model {step.model!r}) needs {missing}, which no pipeline "
                "input or earlier step provides (or the steps form a cycle)"
            )
        for i, step in ready:
            waiting.remove((i, step))
            if step.model == name or name in _reachable(step.model, steps_of):
                raise ConfigError(
                    f"{where}: step {i} (model {step.model!r}) leads back to the pipeline "
                    "itself; a pipeline's steps must not call it"
                )
            try:
                model = signatures(step.model)
            except ConfigError as exc:  # a model no step can call (a decoupled one)
                raise ConfigError(f"{where}: step {i}: {exc}") from None
            for own, shared in step.input_map.items():
                _fits(where, f"step {i}: input {own!r} of model {step.model!r}", model.inputs,
                      own, producers[shared])  # fmt: skip
            # An optional input the step maps nothing to is left out: its model runs without.
            required = {s.name for s in model.inputs if not s.optional}
            missing_inputs = sorted(required - set(step.input_map))
            if missing_inputs:
                raise ConfigError(
                    f"{where}: step {i} maps no pipeline tensor to {missing_inputs}, "
                    f"inputs of model {step.model!r}"
                )
            outputs = {spec.name: spec for spec in model.outputs}
            for own, shared in step.output_map.items():
                if own not in outputs:
                    raise ConfigError(
                        f"{where}: step {i} maps output {own!r}, which model {step.model!r} "
                        f"does not have; its outputs are {sorted(outputs)}"
                    )
                if shared in producers:
                    raise ConfigError(
                        f"{where}: step {i} writes tensor {shared!r}, which something else "
                        "writes already; every pipeline tensor has one producer"
                    )
                producers[shared] = outputs[own]
    for spec in signature.outputs:
        if spec.name not in producers:
            raise ConfigError(f"{where}: no step produces its output {spec.name!r}")
        if producers[spec.name].dtype != spec.dtype or _sizes_differ(spec, producers[spec.name]):
            raise ConfigError(
                f"{where}: output {spec.name!r} is declared {spec.describe()}, but its step "
                f"produces {producers[spec.name].describe()}"
            )
    return rounds


def _reachable(model: str, steps_of: Callable[[str], Sequence[str]]) -> set[str]:
    # Every model a request to *model* may reach through pipelines' steps.
    seen: set[str] = set()
    todo = [model]
    while todo:
        for step in steps_of(todo.pop()):
            if step not in seen:
                seen.add(step)
                todo.append(step)
    return seen


def _fits(where: str, what: str, specs: Sequence[TensorSpec], own: str, source: TensorSpec) -> None:
    spec = next((s for s in specs if s.name == own), None)
    if spec is None:
        raise ConfigError(f"{where}, {what}: the model has no such input")
    if spec.dtype != source.dtype or _sizes_differ(spec, source):
        raise ConfigError(
            f"{where}, {what} is {spec.describe()}, but its tensor {source.name!r} is "
            f"{source.describe()}"
        )


def _sizes_differ(a: TensorSpec, b: TensorSpec) -> bool:
    # Ranks that differ, or a dimension both fix at different sizes: no tensor fits both,
    # so every request would fail at that step (an input), or the pipeline would answer
    # other shapes than its metadata says (an output). Symbolic and unknown sizes fit any.
    if a.rank != b.rank:
        return True
    return any(
        isinstance(x, int) and isinstance(y, int) and x != y
        for x, y in zip(a.shape, b.shape, strict=True)
    )


__all__ = ["PIPELINE", "Pipeline", "Step"]
