"""A pipeline that batches its own requests: whole pipeline requests share one pass of the steps.

A pipeline whose config names a batcher (``batcher = "dynamic"`` with its
``batcher_options``, as for any model) is served by an ordinary
`ModelRunner`: its queue, scheduler, batcher, deadlines and statistics are a
model's. Its "instances" are graph executors (`_Graph`): each runs the steps
once per batch, every step getting one request that carries the whole batch.
So a batch of 32 pipeline requests costs three step requests, not 96.

The runner hands the graph its batch through the batcher's ``assemble`` hook
(`_MemberBatcher`, around the configured batcher): the inputs, concatenated,
in a `_Members` mapping that also carries the batch's requests, so that the
graph can tell who is still waiting before each step:

- members whose callers left (or whose deadline passed) are dropped before
  each step, their rows with them: no step computes for nobody;
- each step request's deadline is the latest of the remaining members';
- a step's failure fails every member once (the runner fans it out), the step
  named in the message;
- an `InvalidInput` from a step, for a batch of several members (one bad row
  poisons the batch), makes each member rerun the rest of the pipeline alone,
  one after the other (so that the step model's own batcher cannot group
  them again): only the bad one fails. Each is answered as its own rerun
  ends, and a caller leaving stops its own rerun (not the others');
- a step request carries the request parameters its members share (those
  of `Engine.infer`'s ``parameters=``); a batch whose members' parameters
  differ runs each member alone from the first step, so that each step sees
  its own, as above but side by side (nothing poisons a batch here: a step
  model's own batcher may join their step requests again).

With tracing on, a step request for the batch is a child of the pipeline's
``compute`` span linked to every traced member it carries, and one for a
member rerun alone a child of that member's own request span
(`trioinfer._tracing.Tracing.pipeline_step`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast, final

import anyio
import anyio.lowlevel
import numpy as np

from ._config import ModelConfig, Placement
from ._exceptions import BackendError, ConfigError, InvalidInput, TrioInferError
from ._inline import restart_inline_slice
from ._pipeline import Infer, Step, _check_graph, _declared, step_outputs
from ._request import NO_PARAMETERS, GeneratedId, Outputs, Parameter, Request, step_request_id
from ._runner import _copy_error, _Running, _split
from ._tensors import ModelSignature
from .abc import AssemblingBatcher, Batcher, Status
from .abc import Request as RequestView
from .abc import RequestQueue as QueueView

if TYPE_CHECKING:
    from ._dispatch import Replica
    from ._runner import ModelRunner
    from ._tracing import Tracing

_RUNNING = Status.RUNNING

#: A step request's id prefix, priority and tenant, from the members it carries; the
#: members themselves, and whether it is a member's rerun alone (for its trace); and the
#: request parameters they all carry (run() runs members whose parameters differ alone).
_Who = tuple[str, int, str | None, tuple[Request, ...], bool, Mapping[str, Parameter]]


class _Members(dict[str, Any]):
    """A batch's concatenated inputs, and the requests whose rows they are, in order."""

    __slots__ = ("requests",)

    def __init__(self, inputs: Mapping[str, Any], requests: Sequence[Request]) -> None:
        super().__init__(inputs)
        self.requests = requests


@final
class _MemberBatcher:
    """The pipeline's batcher, with an ``assemble`` hook that tells the graph who is in a batch.

    It forms batches as the configured batcher does (``next_batch`` is its);
    ``assemble`` concatenates the members' inputs, as the engine would, into
    a `_Members` mapping, and splits the outputs as the engine would.
    """

    __slots__ = ("_inner",)

    def __init__(self, inner: Batcher) -> None:
        self._inner = inner

    def __repr__(self) -> str:
        return f"pipeline batches of {self._inner!r}"

    async def next_batch(self, queue: QueueView) -> Sequence[RequestView]:
        """The configured batcher's next batch."""
        return await self._inner.next_batch(queue)

    def assemble(
        self, requests: Sequence[RequestView]
    ) -> tuple[_Members, Callable[[Outputs], Sequence[Outputs]]]:
        """The members' inputs, concatenated, with the members; and the engine's own split."""
        members = cast(list[Request], list(requests))  # only the engine makes requests
        if len(members) == 1:
            inputs: Mapping[str, Any] = members[0].inputs
        else:
            inputs = {
                name: np.concatenate([member.inputs[name] for member in members])
                for name in members[0].inputs
            }
        rows = sum(member.rows for member in members)
        return _Members(inputs, members), functools.partial(_split, members, rows)


@final
class BatchedPipeline:
    """The backend of a pipeline that batches: it loads graph executors, one per instance.

    Only the engine creates it (when a pipeline's config names a batcher), and
    attaches the runner that serves it before the first request.
    """

    def __init__(
        self,
        config: ModelConfig,
        infer: Infer,
        signatures: Callable[[str], ModelSignature],
        steps_of: Callable[[str], Sequence[str]],
        step_runner: Callable[[str], ModelRunner | None],
        batcher: Batcher,
    ) -> None:
        name = config.name
        self.config = config
        self.signature, self.steps = _declared(config)
        rounds = _check_graph(name, self.signature, self.steps, signatures, steps_of)
        where = f"pipeline {name!r} batches its requests (batcher {config.batcher!r})"
        if isinstance(batcher, AssemblingBatcher):
            raise ConfigError(
                f"{where}, but its batcher lays out batches itself (padding with pad_axis, or a "
                "sequence batcher): a pipeline's batch is its members' inputs concatenated as "
                "they are, so only requests of the same shapes may share one; drop pad_axis "
                "(requests of other shapes then form batches of their own), or set "
                "batcher = 'none' on the pipeline and batch its steps instead"
            )
        if not self.signature.batched:
            raise ConfigError(
                f"{where}, so its inputs and outputs need a batch dimension, but "
                f"{self.signature.unbatched_reason}; declare every tensor's first dimension "
                "'batch' (or -1), or set batcher = 'none'"
            )
        for index, step in enumerate(self.steps):
            model = signatures(step.model)
            if not model.batched:
                raise ConfigError(
                    f"{where}, so each step gets a whole batch as one request; but step {index} "
                    f"(model {step.model!r}) has no batch dimension: {model.unbatched_reason}. "
                    "A step model must take many rows at once (a variable first dimension in "
                    "every input and output), or the pipeline must not batch (batcher = 'none')"
                )
        self._rounds = tuple(tuple(ready) for ready in rounds)
        self._maps = tuple(
            (tuple(step.input_map.items()), tuple(step.output_map.items())) for step in self.steps
        )
        # The outputs each step's request names (step_outputs), decided once per step.
        self._wanted = tuple(step_outputs(step, signatures(step.model)) for step in self.steps)
        self._output_names = tuple(spec.name for spec in self.signature.outputs)
        self._infer = infer
        self._step_runner = step_runner
        self.batcher = _MemberBatcher(batcher)
        self.runner: ModelRunner | None = None
        self._tracing: Tracing | None = None

    def step_model_loaded(self, model: str, signature: ModelSignature) -> None:
        """*model* was loaded anew, with *signature*: as `Pipeline.step_model_loaded`."""
        self._wanted = tuple(
            step_outputs(step, signature) if step.model == model else wanted
            for step, wanted in zip(self.steps, self._wanted, strict=True)
        )

    def attach(self, runner: ModelRunner) -> None:
        """Serve through *runner*: the graphs end and drop members through it."""
        self.runner = runner
        self._tracing = runner.tracing

    async def load(self, config: ModelConfig, placement: Placement) -> _Graph:
        """One graph executor; it holds nothing but its place."""
        return _Graph(self, placement)

    # -- running a batch (for _Graph.execute) ----------------------------------------

    async def run(self, inputs: Mapping[str, Any], graph: _Graph) -> Outputs:
        """Run the batch in *inputs* through the steps, on *graph*: one output row per input row.

        *inputs* is a `_Members` mapping for a batch the runner formed; rows of
        members that ended on the way are left unset (the runner answers only
        those still waiting). Members rerun alone (after an ``InvalidInput``)
        are answered here, each as its own rerun ends: then nothing is left
        for the runner to answer, and the outputs are empty. Anything else
        (a fallback's probe) runs as it is.

        Raises:
            TrioInferError: A step's error, the step named in its message, for
                every member still waiting (an ``InvalidInput`` only for a lone one).
        """
        members = inputs.requests if type(inputs) is _Members else None
        tensors: dict[str, Any] = dict(inputs)
        if members is None:
            # Inputs with no members behind them (a fallback's probe): every row counts.
            await self._rounds_from(0, tensors, None)
            return self._outputs(tensors)
        current = list(range(len(members)))
        first = members[0].parameters
        if len(members) > 1 and any(
            m.parameters is not first and m.parameters != first for m in members
        ):
            # A step request carries one set of request parameters: members whose
            # parameters differ each run the pipeline alone, with their own, side by
            # side (a step model's batcher joins them again: nothing poisons a batch).
            await self._alone(members, current, tensors, 0, graph, together=True)
            return {}
        start = await self._batch(members, current, tensors)
        if start is None:
            return self._gather(members, current, tensors)
        # A step refused the batch's inputs (InvalidInput): one member's rows, it may
        # be. Each member still waiting runs the rest alone, one after the other.
        await self._alone(members, current, tensors, start, graph)
        return {}  # every member ended (answered, failed, left or expired) in _alone

    async def _batch(
        self, members: Sequence[Request], current: list[int], tensors: dict[str, Any]
    ) -> int | None:
        # The batch through every round of steps, the departed dropped before each.
        # Returns the round an InvalidInput stopped it at, if one did; else the rows
        # in *tensors* are those of the members in *current* (none if all left). Other
        # step errors propagate (the runner fails every member still waiting with one).
        who = _who([members[i] for i in current])
        for number, ready in enumerate(self._rounds):
            done = False
            while not done:
                # Again after a round the members' latest deadline cut short: it ends them.
                waiting = len(current)
                deadline = self._keep_live(members, current, tensors)
                if not current:
                    return None
                if len(current) != waiting:
                    who = _who([members[i] for i in current])
                try:
                    done = await self._round(ready, tensors, who, deadline)
                except InvalidInput:
                    if len(current) == 1:
                        raise
                    return number
        return None

    async def _alone(
        self,
        members: Sequence[Request],
        current: list[int],
        tensors: dict[str, Any],
        start: int,
        graph: _Graph,
        *,
        together: bool = False,
    ) -> None:
        # Each member in *current* still waiting runs the rounds from *start* alone, and
        # is answered (or failed) as soon as its own run ends: not when the others' do.
        # Its run has a cancel scope of its own, which its caller leaving cancels (as
        # the runner aborts a batch nobody waits for): no step computes for nobody
        # while the others wait their turn. One after the other (after an InvalidInput:
        # the step model's batcher must not join the bad rows to the others again), or
        # *together*, each in a task of its own (members whose parameters differ).
        runner = self.runner
        assert runner is not None
        replica = next(r for r in runner.replicas if r._backend_instance is graph)
        cuts = np.cumsum([0, *(members[i].rows for i in current)])
        reruns = []
        for position, index in enumerate(current):
            a, b = int(cuts[position]), int(cuts[position + 1])
            own = {name: value[a:b] for name, value in tensors.items()}
            reruns.append(functools.partial(self._rerun, members[index], own, start, replica))
        if not together:
            for rerun in reruns:
                await rerun()
            return
        failed: list[Exception] = []

        async def run(rerun: Callable[[], Awaitable[None]]) -> None:
            try:
                await rerun()
            except Exception as exc:  # (not a TrioInferError: _rerun ends its member with one)
                failed.append(exc)

        async with anyio.create_task_group() as tg:
            for rerun in reruns:
                tg.start_soon(run, rerun)
        if failed:
            raise failed[0]  # as the first rerun one after the other would have

    async def _rerun(
        self, member: Request, own: dict[str, Any], start: int, replica: Replica
    ) -> None:
        # One member's rerun alone (for _alone), on its own rows *own*, from round *start*.
        runner = self.runner
        assert runner is not None
        state = member._state
        if state.status is not _RUNNING:
            return
        # The runner's execution it waits for: its caller leaving then cancels this
        # rerun alone. Unless another execution of the batch (a hedge) reruns it too.
        batch: _Running = state.batch
        mine = type(batch) is not _Rerun
        scope = anyio.CancelScope()
        if mine:
            state.batch = _Rerun(scope)
        try:
            with scope:
                await self._rounds_from(start, own, [member])
                runner._succeed(
                    (member,), (self._outputs(own),), replica, runner.clock.current_time()
                )
        except _Departed:
            pass
        except TrioInferError as exc:
            runner.finish(member, error=exc)  # its own error object: its own run's
        finally:
            if mine:
                if state.status is _RUNNING:
                    state.batch = batch  # (a BaseException on its way out)
                else:
                    batch.waiting -= 1  # it waits for the batch no more

    async def _rounds_from(
        self,
        start: int,
        tensors: dict[str, Any],
        members: list[Request] | None,
        label: str = "probe",
    ) -> None:
        # One member's (or the probe's) way through the rounds from *start*.
        who: _Who = (
            (label, 0, None, (), False, NO_PARAMETERS)
            if members is None
            else _who(members, alone=True)
        )
        for ready in self._rounds[start:]:
            done = False
            while not done:
                deadline = math.inf
                if members is not None:
                    assert self.runner is not None
                    members, _rows, deadline = self.runner._live(members)
                    if not members:
                        raise _Departed
                done = await self._round(ready, tensors, who, deadline)

    def _keep_live(
        self, members: Sequence[Request], current: list[int], tensors: dict[str, Any]
    ) -> float:
        # Drops the members whose caller left or whose deadline passed (the runner ends
        # the latter), and their rows from *tensors*; returns the latest deadline left.
        assert self.runner is not None
        waiting = [members[i] for i in current]
        live, _rows, deadline = self.runner._live(waiting)
        if len(live) == len(waiting):
            return deadline
        kept = {id(request) for request in live}
        rows: list[np.ndarray[Any, Any]] = []
        offset = 0
        survivors = []
        for index in current:
            member = members[index]
            if id(member) in kept:
                rows.append(np.arange(offset, offset + member.rows))
                survivors.append(index)
            offset += member.rows
        current[:] = survivors
        if survivors:
            taken = np.concatenate(rows)
            for name, value in tensors.items():
                tensors[name] = value[taken]
        return deadline

    async def _round(
        self,
        ready: Sequence[tuple[int, Step]],
        tensors: dict[str, Any],
        who: _Who,
        deadline: float,
    ) -> bool:
        # The round's steps (those not done already: a rerun repeats a round), side by
        # side when there are several; the first failure cancels the others. False if
        # *deadline*, the latest of the members', passed first (the caller then ends them).
        todo = [
            (index, step)
            for index, step in ready
            if not all(shared in tensors for shared in step.output_map.values())
        ]
        if deadline == math.inf:  # no member has one: no scope to set up
            await self._steps(todo, tensors, who)
            return True
        with anyio.CancelScope(deadline=deadline) as scope:
            await self._steps(todo, tensors, who)
        return not scope.cancelled_caught

    async def _steps(
        self, todo: Sequence[tuple[int, Step]], tensors: dict[str, Any], who: _Who
    ) -> None:
        if len(todo) == 1:
            index, step = todo[0]
            await self._step(index, step, tensors, who)
            return
        failure: list[TrioInferError] = []

        async def run(index: int, step: Step, scope: anyio.CancelScope) -> None:
            try:
                await self._step(index, step, tensors, who)
            except TrioInferError as exc:
                failure.append(exc)
                scope.cancel()

        async with anyio.create_task_group() as tg:
            for index, step in todo:
                tg.start_soon(run, index, step, tg.cancel_scope)
        if failure:
            raise failure[0]

    async def _step(self, index: int, step: Step, tensors: dict[str, Any], who: _Who) -> None:
        # One step request carrying every row in *tensors*; its outputs join them. Its
        # error keeps its class, the step named in its message.
        ins, outs = self._maps[index]
        inputs = {own: tensors[shared] for own, shared in ins}
        model = step.model
        try:
            outputs = await self._call(model, inputs, index, who)
            missing = sorted(set(step.output_map) - set(outputs))
            if missing:  # the step's model was replaced by one with other outputs
                raise BackendError(f"its model answered without outputs {missing}")
            rows = len(next(iter(tensors.values())))
            for own, shared in outs:
                value = outputs[own]
                if not np.ndim(value) or len(value) != rows:
                    raise BackendError(
                        f"its model answered {own!r} with shape {list(np.shape(value))} for "
                        f"{rows} rows; a batched pipeline needs one row per input row"
                    )
                tensors[shared] = value
        except TrioInferError as exc:
            raise self._named(index, step, exc) from exc

    def _named(self, index: int, step: Step, exc: TrioInferError) -> TrioInferError:
        where = f"pipeline {self.config.name!r}, step {index} (model {step.model!r})"
        return _copy_error(exc, cause=exc, message=f"{where}: {exc}")

    async def _call(self, model: str, inputs: dict[str, Any], index: int, who: _Who) -> Outputs:
        # The step's model: in this task on an idle instance of a model that would pass
        # the request straight through (as the unbatched pipeline's steps run), else
        # through engine.infer, its queue and its batcher; with tracing on, in the
        # traces of the members it carries (no step runs in this task then).
        label, priority, tenant, members, alone, parameters = who
        request_id = step_request_id(label, index)
        wanted = self._wanted[index]
        tracing = self._tracing
        if tracing is not None or parameters:
            # (Its parameters travel by engine.infer's way, in the step's request.)
            call = functools.partial(
                self._infer,
                model,
                inputs,
                priority=priority,
                tenant=tenant,
                request_id=request_id,
                parameters=parameters or None,
                outputs=wanted,
            )
            if tracing is None:
                outputs: Outputs = await call()
                restart_inline_slice()  # it waited for its answer: the loop had its turns
                return outputs
            return cast(Outputs, await tracing.pipeline_step(members, alone, call))
        runner = self._step_runner(model)
        replica = None if runner is None else runner.idle_replica()
        if replica is not None and runner is not None and runner.slice_spent(replica):
            await anyio.lowlevel.checkpoint()
            restart_inline_slice()
            runner = self._step_runner(model)
            replica = None if runner is None else runner.idle_replica()
        if replica is not None and runner is not None:
            arrays, rows = runner.validate(inputs)  # as engine.infer checks them
            clock = runner.clock
            deadline = clock.current_effective_deadline()
            if deadline != -math.inf:  # else a cancellation, for engine.infer to raise
                return await runner.run_here(
                    replica,
                    arrays,
                    rows,
                    request_id,
                    priority,
                    tenant,
                    deadline,
                    clock.current_time(),
                    wanted=wanted,
                )
        outputs = await self._infer(
            model, inputs, priority=priority, tenant=tenant, request_id=request_id, outputs=wanted
        )
        restart_inline_slice()  # it waited for its answer: the loop has had its turns
        return outputs

    def _outputs(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        return {name: tensors[name] for name in self._output_names}

    def _gather(
        self, members: Sequence[Request], current: list[int], tensors: Mapping[str, Any]
    ) -> Outputs:
        # The batch's outputs, one row per input row, from the rows of the members in
        # *current*: the common case is every member. Rows of members that ended are
        # left unset (the runner answers only those still waiting).
        if len(current) == len(members):
            return self._outputs(tensors)
        if not current:
            return {}  # nobody is waiting: nothing to cut (the runner answers nobody)
        starts = np.cumsum([0, *(member.rows for member in members)])
        rows = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in current])
        full = {}
        for name in self._output_names:
            value = np.asarray(tensors[name])
            full[name] = np.empty((int(starts[-1]), *value.shape[1:]), value.dtype)
            full[name][rows] = value
        return full


def _who(members: Sequence[Request], *, alone: bool = False) -> _Who:
    # What a step request for *members* says of them: an id naming the first member
    # (and how many more), their highest priority, and their tenant if they share one;
    # and the members (*alone*: one rerun alone), for their traces.
    first = members[0]
    tenant = first.tenant
    priority = first.priority
    for member in members:
        if member.priority > priority:
            priority = member.priority
        if member.tenant != tenant:
            tenant = None
    # A step request for several has no one caller's id to give its model: "" (as for
    # a request sent without one), where it reads one (caller_request_id).
    label = first.id if len(members) == 1 else GeneratedId(f"{first.id}+{len(members) - 1}")
    # The same for every member (run() runs those whose parameters differ alone).
    return label, priority, tenant, tuple(members), alone, first.parameters


class _Rerun(_Running):
    """A member's rerun alone, as the runner sees it: its caller leaving cancels *scope*."""

    __slots__ = ()

    def __init__(self, scope: anyio.CancelScope) -> None:
        super().__init__(scope, 1)  # one caller waits for it


class _Departed(Exception):
    """Nobody waits for a member rerun alone any more: it ended already."""


@final
class _Graph:
    """One instance of a batched pipeline: it runs a batch through the steps."""

    __slots__ = ("_pipeline", "device")

    def __init__(self, pipeline: BatchedPipeline, placement: Placement) -> None:
        self._pipeline = pipeline
        self.device = str(placement.device)

    def __repr__(self) -> str:
        return f"<graph of pipeline {self._pipeline.config.name!r}>"

    @property
    def signature(self) -> ModelSignature:
        """The pipeline's declared inputs and outputs."""
        return self._pipeline.signature

    async def execute(self, inputs: Mapping[str, Any]) -> Outputs:
        """Run the steps once for the batch in *inputs*; one output row per input row."""
        return await self._pipeline.run(inputs, self)

    async def aclose(self) -> None:
        """Nothing to release: the steps' models are loaded on their own."""
