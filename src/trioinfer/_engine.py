"""The engine: a task group that owns every model runner, queue and backend call.

``async with open_engine() as engine`` starts it; models load and unload
while it runs; leaving the block drains in-flight work for at most
``drain_period`` seconds, cancels the rest, and closes every backend instance.
Nothing the engine started outlives the block.
"""

from __future__ import annotations

import inspect
import logging
import math
import operator
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Iterator,
    Mapping,
    Sequence,
)
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Final, NoReturn, SupportsIndex, cast, final

import anyio
import anyio.abc
import anyio.lowlevel
import attrs
import trio.lowlevel

from ._cache import Computation, Computed, Event, ResponseCache
from ._config import Device, ModelConfig, Placement
from ._custom_metrics import CustomMetricFamily, CustomMetrics, _current_owner, _Owner
from ._exceptions import (
    BackendError,
    ConfigError,
    DeadlineExceeded,
    EngineClosed,
    InvalidInput,
    ModelNotFound,
    PluginContractError,
    TrioInferError,
)
from ._inline import restart_inline_slice, restart_slice_at_each_poll
from ._model_tasks import loading_for, open_model_tasks
from ._pipeline import PIPELINE, Pipeline, Resume, Step, _steps
from ._pipeline_batched import BatchedPipeline
from ._registry import Kind, Registry, missing_members, plugin_label
from ._request import (
    NO_PARAMETERS,
    Outputs,
    Parameter,
    Request,
    checked_parameters,
    make_request,
    next_request_id,
)
from ._resources import ResourcePools, ResourcePoolStatistics, to_resource_sizes
from ._runner import (
    CLEANUP_S,
    ModelRunner,
    ModelStatistics,
    Unfinished,
    _not_an_instance,
    close_instances,
    runs_inline,
    warm_up,
)
from ._sequence import SequenceFlags
from ._stream import STREAM_AHEAD, ResponseStream, StreamGate, decoupled, open_stream
from ._tensors import ModelSignature, requested_outputs, validate_rows
from ._threads import current_callers_deadline
from .abc import Backend, BackendInstance, Batcher, Fallback, Scheduler, Status, StreamingInstance

if TYPE_CHECKING:
    from ._dispatch import Replica
    from ._tracing import Tracing

logger = logging.getLogger("trioinfer")

# Used only by the fast path of a runner on Trio (ModelRunner.on_trio).
_current_task = trio.lowlevel.current_task

_park: Callable[[Callable[[Any], trio.lowlevel.Abort]], Awaitable[Any]]
try:
    from trio._core._traps import WaitTaskRescheduled as _WaitTaskRescheduled
    from trio._core._traps import _async_yield

    def _park(abort: Callable[[Any], trio.lowlevel.Abort]) -> Awaitable[Any]:
        # trio.lowlevel.wait_task_rescheduled's own trap, awaited in the caller's
        # frame: the parked task's every suspension and resumption passes one
        # coroutine frame fewer. Its outcome: unwrap() it, as Trio's function does.
        return _async_yield(_WaitTaskRescheduled(abort))

except ImportError:  # pragma: no cover - a Trio that moved its traps gets the public way
    import outcome

    async def _park(abort: Callable[[Any], trio.lowlevel.Abort]) -> Any:
        return outcome.Value(await trio.lowlevel.wait_task_rescheduled(abort))


@attrs.frozen
class ModelInfo:
    """A loaded model, as [`Engine.models()`][trioinfer.Engine.models] reports it.

    Attributes:
        name: The name requests use.
        config: The configuration it was loaded with.
        signature: Its inputs and outputs, read from the loaded model.
        devices: Where each instance really runs (after any fallback to the CPU).
        preferred_batch_sizes: The batch sizes its backend says it runs fastest
            (e.g. measured at load with the ONNX Runtime backend's
            ``tune_batch_sizes``); empty when it does not say.
        decoupled: Whether it answers with a stream of responses, through
            [`Engine.infer_stream()`][trioinfer.Engine.infer_stream] only.
        out_of_service: Why it answers nothing, or ``None`` while it serves:
            one of its plugins broke its contract so that its state cannot be
            trusted (see ``ModelStatistics.out_of_service``). Such a model is
            not ready; loading it again brings it back.
        unavailable: Why it is not ready, or ``None`` while an instance serves
            it: *out_of_service*, or every instance is out of service (a
            fallback's breaker took it out, until it is back) or gone (its
            backend says it can serve no more: a Ray actor that died; requests
            fail until the ``resilient`` fallback re-creates it or the model is
            loaded again). The server's readiness says what this says.
    """

    name: str
    config: ModelConfig
    signature: ModelSignature
    devices: tuple[str, ...]
    preferred_batch_sizes: tuple[int, ...] = ()
    decoupled: bool = False
    out_of_service: str | None = None
    unavailable: str | None = None


@attrs.frozen
class InferenceResult:
    """Outputs, and which instance and fallback steps produced them.

    Attributes:
        outputs: The outputs by name, as [`Engine.infer()`][trioinfer.Engine.infer] returns them.
        model: The model that computed them: the one asked for, or the one a
            fallback failed over to.
        instance: The index of *model*'s instance that computed them, or
            ``None`` for a fallback's default answer.
        device: Where that instance runs, or ``None``.
        fallbacks: The fallback steps taken on the way, in order (empty when
            the first execution answered): ``"retry instance 0 (cpu)"``,
            ``"failover instance 1 (cpu)"``, ``"hedge instance 1 (cpu)"``,
            ``"model small"``, ``"default"``.
        parameters: The answer's response parameters, where its model gave some
            (a Triton Python model's ``InferenceResponse(parameters=...)``; see
            `trioinfer.lowlevel.set_response_parameters`); empty otherwise.
    """

    outputs: Outputs
    model: str
    instance: int | None
    device: str | None
    fallbacks: tuple[str, ...]
    parameters: Mapping[str, Parameter] = NO_PARAMETERS


@attrs.frozen
class EngineStatistics:
    """A snapshot of the engine's counters, per model.

    Attributes:
        closing: Whether the engine has stopped accepting work.
        models: Per-model counters, by model name.
        cache_size: The response cache's bound in bytes (0: no cache).
        cache_bytes: What the cache holds now, in bytes, all models together.
        resources: The rate limiter's pools (see ``open_engine(resources=...)``),
            by name then device: their sizes, what is held and who waited.
    """

    closing: bool
    models: Mapping[str, ModelStatistics]
    cache_size: int = 0
    cache_bytes: int = 0
    resources: tuple[ResourcePoolStatistics, ...] = ()


@final
@attrs.define(eq=False)
class Engine:
    """Loads models and runs inference; create one with [`open_engine()`][trioinfer.open_engine]."""

    _task_group: anyio.abc.TaskGroup = attrs.field(alias="task_group")
    _registry: Registry = attrs.field(alias="registry")
    drain_period: float
    _device_limits: dict[str, anyio.CapacityLimiter] = attrs.field(alias="device_limits")
    # The rate limiter's pools (open_engine's resources=), which instances with
    # resource needs take before each execution.
    _resources: ResourcePools = attrs.field(
        factory=lambda: ResourcePools({}, {}, enabled=True), alias="resources"
    )
    _cache: ResponseCache | None = attrs.field(default=None, alias="cache")
    # OpenTelemetry spans (trioinfer._tracing), None when tracing is off.
    _tracing: Tracing | None = attrs.field(default=None, alias="tracing")
    # Every loaded model: a runner with queue and instances, or a pipeline of steps.
    _runners: dict[str, ModelRunner | Pipeline] = attrs.field(factory=dict, init=False)
    # The decoupled models (answered by streams), by name: their admission and instances.
    _gates: dict[str, StreamGate] = attrs.field(factory=dict, init=False)
    # The runners Engine.infer takes in its own frame, by name: plain models (see
    # ModelRunner.plain) that are not decoupled, while the engine is open and
    # does not trace. Kept beside _runners and _gates, so that infer asks once.
    _plain: dict[str, ModelRunner] = attrs.field(factory=dict, init=False)
    # Those of them whose requests may skip engine.infer as pipeline steps and run in
    # the pipeline's task (ModelRunner.alone_ok; its idle_replica says when): each
    # pipeline looks its steps' models up here, one dict lookup a step.
    _alone: dict[str, ModelRunner] = attrs.field(factory=dict, init=False)
    # The pipelines Engine.infer takes in its own frame (no cache, not traced, the
    # engine open), as _plain's models: straight to Pipeline.call.
    _pipes: dict[str, Pipeline] = attrs.field(factory=dict, init=False)
    # The models being loaded, each with when its load began (time.monotonic(): read
    # from a watchdog thread too, see _executing).
    _loading: dict[str, float] = attrs.field(factory=dict, init=False)
    # The loads, and the unloads (and replaced models' retirements), running in callers'
    # tasks, by their cancel scopes: closing cancels them and waits for them to end, so
    # that no instance, thread or runner of theirs outlives the engine's block.
    _loads: set[anyio.CancelScope] = attrs.field(factory=set, init=False)
    _retiring: set[anyio.CancelScope] = attrs.field(factory=set, init=False)
    _settled: anyio.Event | None = attrs.field(default=None, init=False)
    _stopping: bool = attrs.field(default=False, init=False)  # past the drain, if any
    _closing: bool = attrs.field(default=False, init=False)
    # Closing, and within its drain period: the requests made for requests accepted
    # before (a pipeline's steps, a fallback's failover to another model) are still
    # admitted (_submit's follow_up), so that those requests may finish.
    _draining: bool = attrs.field(default=False, init=False)
    _closed: bool = attrs.field(default=False, init=False)
    # How infer_follow_up names models, when the engine's names are not its users'
    # (trioinfer serve loads "digits" version 2 as "digits.v2"): the server's resolver.
    _follow_up_names: Callable[[str], str] | None = attrs.field(default=None, init=False)
    # The models' own metric families (custom_metrics()), and which load of each
    # serving model owns its series (a newer load's or an unload's drop them).
    _custom: CustomMetrics = attrs.field(factory=CustomMetrics, init=False)
    _metric_owners: dict[str, _Owner] = attrs.field(factory=dict, init=False)

    @property
    def registry(self) -> Registry:
        """The plugin registry this engine resolves plugin names with."""
        return self._registry

    @property
    def closing(self) -> bool:
        """Whether the engine has stopped accepting work (its block is exiting)."""
        return self._closing

    async def load(
        self,
        config: ModelConfig,
        *,
        replace: bool = False,
        _check: Callable[[ModelInfo, ModelSignature | None], None] | None = None,
        _retiring: Collection[str] = (),
    ) -> ModelInfo:
        """Load a model: create its plugins, load every instance, start its workers.

        Returns once the model is ready to serve. Loading runs under the
        caller's cancel scope: cancelling it closes whatever was loaded.

        With ``replace=True`` a model of the same name may be loaded already:
        it keeps serving while the new one loads, then new requests go to the
        new one and the old one is unloaded as by [`unload()`][trioinfer.Engine.unload]
        (its accepted requests may finish within `drain_period`). If loading
        fails, the old one goes on serving.

        (``_check``, the server's: called with the loaded model's info and its
        backend's full signature once it is ready, before it serves or replaces
        anything; what it raises fails the load, the new model closed.
        ``_retiring``, the server's too: the models it unloads once this one
        serves, the versions its policy no longer selects; a custom metric
        family that only they and this model declare, it may declare otherwise.)

        Raises:
            ConfigError: A model of that name is loaded (or loading) already and
                *replace* is false, or the config is refused, or *config* is not a
                ``ModelConfig`` or *replace* not a bool.
            PluginError: A plugin name is unknown, or a plugin fails to load (a
                ``ConfigError``: the configuration names it).
            PluginContractError: A plugin does not implement its contract.
            BackendError: An instance could not be loaded (``BackendUnavailable`` if its
                device cannot be used and CPU fallback is off). When several fail,
                one error names each failure, and its ``__cause__`` is an
                ``ExceptionGroup`` of them all.
            EngineClosed: The engine is closing, or began to close while the model
                loaded (what was loaded is closed again).
        """
        self._check_open()
        if not isinstance(config, ModelConfig):
            # A dict (a TOML table) or None ended in AttributeError: a 500 in a server.
            hint = " (make one with ModelConfig.from_dict())" if isinstance(config, Mapping) else ""
            raise ConfigError(f"engine.load() takes a ModelConfig, got {config!r}{hint}")
        if replace is not True and replace is not False:
            raise ConfigError(f"replace must be True or False, got {replace!r}")
        name = config.name
        if name in self._loading:
            raise ConfigError(f"a model named {name!r} is being loaded already")
        if name in self._runners and not replace:
            raise ConfigError(
                f"a model named {name!r} is loaded already; unload it first or load with "
                "replace=True"
            )
        if config.response_cache and self._cache is None:
            raise ConfigError(
                f"model {name!r} sets response_cache, but the engine has no cache: give it "
                "one with open_engine(cache_size=...) (trioinfer serve --cache-size)"
            )
        self._loading[name] = time.monotonic()
        # The backend's load, and every task the model starts, can tell which engine
        # serves it (lowlevel.current_engine: a Python model calling other models).
        engine_token = _current_engine.set(self)
        # What the model declares at its load (current_model_metrics) is this load's.
        owner = self._custom.begin(name, retiring=_retiring)
        metrics_token = _current_owner.set((self._custom, owner))
        installed = False
        try:
            with self._owned(self._loads) as loading:
                runner: ModelRunner | Pipeline | None = None
                with loading:
                    if config.backend == PIPELINE and config.batcher == "none":
                        runner = Pipeline(
                            config,
                            self._infer_held,
                            self._step_signature,
                            self._steps_of,
                            self._alone.get,
                        )
                    else:
                        runner = await self._new_runner(config)
                if runner is None:
                    return await self._cut_off(name)
                # Shielded (it is quick): a task cancelled before it first runs never runs
                # its finally (on asyncio), and the runner's closes the loaded instances.
                with anyio.CancelScope(shield=True):
                    await self._task_group.start(runner.run)
                if anyio.current_effective_deadline() <= anyio.current_time():
                    # The caller gave up while its model started: it is not to serve.
                    with anyio.CancelScope(shield=True):
                        await runner.stop()
                    self._drop_resources(runner)
                    await anyio.lowlevel.checkpoint()  # raises the caller's cancellation
                if _check is not None:
                    try:
                        _check(self._info(runner), getattr(runner, "backend_signature", None))
                    except BaseException:
                        # Refused before it serves: a model it would replace serves on.
                        with anyio.CancelScope(shield=True):
                            await runner.stop()
                        self._drop_resources(runner)
                        raise
                old = self._runners.get(name)
                old_gate = self._gates.get(name)
                self._runners[name] = runner
                self._set_gate(name, runner)
                self._set_plain(name, runner)
                # Answers of the model it replaces may not hold; its counters start
                # again with the new runner's.
                self._forget(name, restart=True)
                self._step_model_loaded(name, runner)
                # Its custom series are shown from now on, those of the load it
                # replaces go (as its statistics do).
                installed = True
                self._custom.install(owner)
                if (old_owner := self._metric_owners.get(name)) is not None:
                    self._custom.drop(old_owner)
                self._metric_owners[name] = owner
        finally:
            _current_engine.reset(engine_token)
            _current_owner.reset(metrics_token)
            if not installed:
                self._custom.drop(owner)
            self._loading.pop(name, None)
        if old is not None:
            await self._retire(old, old_gate)
        return self._info(runner)

    @staticmethod
    async def _cut_off(name: str) -> NoReturn:
        # A load the engine's closing cancelled (what it had loaded is closed).
        await anyio.lowlevel.checkpoint_if_cancelled()  # the caller's own cancellation
        raise EngineClosed(f"the engine closed while model {name!r} was loading")

    async def _new_runner(self, config: ModelConfig) -> ModelRunner:
        # A model's plugins, its loaded instances, and the runner that will serve them.
        # A pipeline that batches its own requests is one too: its backend runs its
        # steps once per batch (trioinfer._pipeline_batched).
        name = config.name
        registry = self._registry
        pipeline = config.backend == PIPELINE
        backend: Backend | None = None if pipeline else registry.create("backends", config.backend)
        scheduler: Scheduler = registry.create(
            "schedulers", config.scheduler, config.scheduler_options
        )
        batcher: Batcher = registry.create("batchers", config.batcher, config.batcher_options)
        fallback: Fallback = registry.create("fallbacks", config.fallback, config.fallback_options)
        checks: tuple[tuple[Kind, str, object, type], ...] = (
            ("backends", config.backend, backend, Backend),
            ("schedulers", config.scheduler, scheduler, Scheduler),
            ("batchers", config.batcher, batcher, Batcher),
            ("fallbacks", config.fallback, fallback, Fallback),
        )
        # The package each plugin came from, for every error that says one broke its
        # contract: the operator must know whom to tell.
        sources = {
            kind: registry._distribution(kind, plugin_name) for kind, plugin_name, _, _ in checks
        }
        for kind, plugin_name, plugin, protocol in checks[1:] if pipeline else checks:
            if not isinstance(plugin, protocol):
                raise PluginContractError(
                    f"{plugin_label(kind, plugin_name, sources[kind])} of model "
                    f"{name!r} does not implement trioinfer.abc.{protocol.__name__}: "
                    f"got {type(plugin).__name__}, which lacks "
                    f"{', '.join(missing_members(plugin, protocol)) or '(unknown)'}",
                    kind=kind,
                    plugin=plugin_name,
                )
        graph: BatchedPipeline | None = None
        if backend is None:
            graph = BatchedPipeline(
                config,
                self._infer_step,
                self._step_signature,
                self._steps_of,
                self._alone.get,
                batcher,
            )
            backend, batcher = graph, graph.batcher
        # Opened before its instances load, which may start tasks in it; ended by the
        # runner once they closed, or here if the load fails.
        tasks = await open_model_tasks(name, self._task_group)
        try:
            with loading_for(tasks):
                instances = await _load_instances(backend, config, sources["backends"])
        except BaseException:
            await tasks.aclose(CLEANUP_S)
            raise
        try:
            runner = ModelRunner._create(
                config,
                scheduler=scheduler,
                batcher=batcher,
                fallback=fallback,
                instances=instances,
                # A pipeline's graph computes nothing itself: its steps' models are limited.
                device_limits=self._device_limits if graph is None else {},
                backend=backend,
                infer_elsewhere=self._infer_elsewhere,
                tracing=self._tracing,
                sources=sources,
                tasks=tasks,
            )
            if graph is None:
                self._take_resources(runner)
            if graph is not None:
                graph.attach(runner)
            # Before it serves: the first callers must not pay for the runtime's first runs.
            await warm_up(
                name,
                config.warmup,
                runner.backend_signature,
                runner.input_limits,
                instances,
                [replica.label for replica in runner.replicas],
                max_batch_size=runner.max_batch_size,
            )
        except BaseException:
            # A plugin refused the model in attach(), or a warm-up failed: do not leave
            # instances behind.
            self._resources.detach(id(instances))
            await close_instances(name, instances)
            await tasks.aclose(CLEANUP_S)
            raise
        if self._closing:
            # The engine began to close while we loaded: do not leave instances behind.
            self._resources.detach(id(instances))
            await close_instances(name, instances)
            await tasks.aclose(CLEANUP_S)
            self._check_open()
        return runner

    def _take_resources(self, runner: ModelRunner) -> None:
        # Triton's rate limiter: each instance that needs resources gets a gate,
        # which the runner takes (with the device's limiter) before each execution.
        # Keyed by the instances, which a load and its runner share.
        config = runner.config
        groups = [group for group in config.instances for _ in range(group.count)]
        if not any(g.resources or g.global_resources for g in groups):
            return
        if not self._resources.enabled:
            logger.warning(
                "model %r: its instances' resources are not taken: rate limiting is off",
                config.name,
            )
            return
        if decoupled(runner):
            # Its streams' generators run outside executions: nothing would take them.
            raise ConfigError(
                f"model {config.name!r} is decoupled (it answers with streams), whose "
                "generators the rate limiter does not gate: expected no resources on its "
                "instances"
            )
        gates = self._resources.attach(
            id(runner._instances),
            config.name,
            [
                (replica.device, g.resources, g.global_resources, g.resource_priority)
                for replica, g in zip(runner.replicas, groups, strict=True)
            ],
            self._device_limits,
        )
        for replica, gate in zip(runner.replicas, gates, strict=True):
            replica._gate = gate

    def _drop_resources(self, runner: ModelRunner | Pipeline) -> None:
        # A stopped model's needs no longer size the pools.
        if isinstance(runner, ModelRunner):
            self._resources.detach(id(runner._instances))

    async def unload(self, name: str) -> None:
        """Stop serving a model: refuse new requests, drain, then close its instances.

        Requests already accepted may finish within `drain_period`; those
        still queued or running after it fail with [`EngineClosed`][trioinfer.EngineClosed].

        Raises:
            ModelNotFound: No model of that name is loaded.
            EngineClosed: The engine has closed (every model was unloaded with it).
        """
        if self._closed:
            self._check_open()
        runner = self._runners.pop(name, None)
        self._plain.pop(name, None)
        self._alone.pop(name, None)
        self._pipes.pop(name, None)
        if runner is None:
            raise ModelNotFound(f"no model named {name!r} is loaded; loaded: {self._names()}")
        self._forget(name)
        if (owner := self._metric_owners.pop(name, None)) is not None:
            self._custom.drop(owner)  # as Triton's go with the model
        gate = self._gates.pop(name, None)
        await self._retire(runner, gate)

    def _set_gate(self, name: str, runner: ModelRunner | Pipeline) -> None:
        gate = StreamGate.of(runner)
        if gate is None:
            self._gates.pop(name, None)
        else:
            self._gates[name] = gate
            assert isinstance(runner, ModelRunner)
            runner.streams_closed = gate.wait_closed  # before its instances close

    def _set_plain(self, name: str, runner: ModelRunner | Pipeline) -> None:
        if (
            type(runner) is ModelRunner
            and runner.plain
            and self._tracing is None
            and not self._closing
            and name not in self._gates
        ):
            self._plain[name] = runner
            if runner.alone_ok:
                self._alone[name] = runner
            else:
                self._alone.pop(name, None)
        else:
            self._plain.pop(name, None)
            self._alone.pop(name, None)
        if (
            type(runner) is Pipeline
            and not runner.config.response_cache
            and self._tracing is None
            and not self._closing
        ):
            self._pipes[name] = runner
        else:
            self._pipes.pop(name, None)

    def _step_signature(self, model: str) -> ModelSignature:
        # A pipeline step's model, for its load's checks. A decoupled one answers with
        # streams, and a stateful one needs a sequence_id, which a step cannot take or
        # give: refused at load, or every request through the pipeline would fail, as
        # the client's fault (a 400), for its config's.
        runner = self._runner(model)
        if model in self._gates:
            raise ConfigError(
                f"model {model!r} is decoupled (it answers with a stream of responses), but a "
                "pipeline's step needs one answer per request; call it with "
                "engine.infer_stream() instead, or use a model that answers once"
            )
        if runner.config.sequence is not None:
            raise ConfigError(
                f"model {model!r} is stateful (it has a [sequence] config), but a pipeline's "
                "step request carries no sequence_id; call it with its sequence, or use a "
                "model without one"
            )
        return runner.signature

    def _steps_of(self, model: str) -> tuple[str, ...]:
        # The models a pipeline's steps call (none for a model that is not one).
        return tuple(s.model for s in _pipeline_steps(self._runners.get(model)))

    def _step_model_loaded(self, name: str, runner: ModelRunner | Pipeline) -> None:
        # The pipelines with a step on *name* ask its model for the outputs they keep
        # (step_outputs): those the model now in place has, not the one they loaded with.
        for other in self._runners.values():
            graph = other if isinstance(other, Pipeline) else other._backend
            if isinstance(graph, (Pipeline, BatchedPipeline)) and graph is not runner:
                graph.step_model_loaded(name, runner.signature)

    def _forget(self, name: str, seen: set[str] | None = None, *, restart: bool = False) -> None:
        # The cached answers of *name* no longer hold, nor those of the pipelines
        # it is a step of (and theirs, in turn); with *restart*, *name*'s cache
        # counters start again (it was loaded anew).
        if self._cache is None:
            return
        seen = seen if seen is not None else set()
        seen.add(name)
        self._cache.forget(name, restart=restart)
        for other, runner in self._runners.items():
            if other not in seen and any(step.model == name for step in _pipeline_steps(runner)):
                self._forget(other, seen)

    async def _retire(self, runner: ModelRunner | Pipeline, gate: StreamGate | None = None) -> None:
        # The runner takes no new requests already; let accepted ones finish, then stop it.
        # The engine's closing ends this drain with its own (see _shutdown).
        with self._owned(self._retiring) as drain:
            try:
                with drain, anyio.move_on_after(self.drain_period):
                    await runner.wait_idle()
            finally:
                # Even if the caller is cancelled while draining, the model must stop.
                with anyio.CancelScope(shield=True):
                    await runner.stop()
                    self._drop_resources(runner)
                    if gate is not None:
                        await gate.wait_closed()  # its streams' generators, closing now

    def models(self) -> list[ModelInfo]:
        """The loaded models, sorted by name."""
        return [self._info(self._runners[name]) for name in sorted(self._runners)]

    def model(self, name: str) -> ModelInfo:
        """One loaded model's description.

        Raises:
            ModelNotFound: No model of that name is loaded.
        """
        return self._info(self._runner(name))

    async def infer(
        self,
        model: str,
        inputs: Mapping[str, Any],
        *,
        priority: int = 0,
        tenant: str | None = None,
        request_id: str | None = None,
        sequence: SequenceFlags | None = None,
        parameters: Mapping[str, Parameter] | None = None,
        outputs: Sequence[str] | None = None,
    ) -> Outputs:
        """Run *model* on *inputs* and return its outputs by name.

        There is no timeout argument: the caller's cancel scope is the timeout.
        Its effective deadline travels with the request; a request whose
        deadline passes (or whose caller is cancelled) while it waits is taken
        out of the queue and never reaches a backend. A caller cancelled while
        its request runs gets ``Cancelled`` at once, and the execution is
        aborted if nobody else waits for it.

        Args:
            model: A loaded model's name.
            inputs: One array per model input, by name; dtypes must match the model's
                (see ``ModelConfig.casting``).
            priority: An integer; higher runs sooner under priority-aware schedulers.
            tenant: Who the request is for, for fair-share schedulers.
            request_id: An id for logs and tracing; generated if not given.
            sequence: For a stateful model (one with a ``sequence`` config), the
                sequence this request belongs to and whether it starts or ends
                it; required there, refused elsewhere.
            parameters: The request's own parameters, by name (Triton's parameters
                extension: ``{"temperature": 0.7, "max_tokens": 16}``), each a
                ``bool``, ``int``, ``float`` or ``str``. A Python model reads them
                (see the python backend's reference); an ONNX model ignores them.
                They are part of the response cache's key, and a pipeline passes
                them to each of its steps.
            outputs: The names of the outputs wanted (Triton's requested outputs):
                the answer holds those alone, and the request carries them
                (``Request.requested_outputs``) for a model that computes only
                what was asked (a Triton Python model reads them). None or
                empty: every output.

        Raises:
            ModelNotFound: No model of that name is loaded.
            InvalidInput: The inputs do not fit the model's signature or limits, or
                *priority* is not an integer, or *tenant* or *request_id* not a string,
                or *parameters* not a mapping of strings to bool, int, float or str,
                or *outputs* names an output the model does not have.
            SequenceError: The request does not fit its sequence (none in
                progress, released after being idle, ended, or broken by an
                earlier request that was not computed).
            QueueFull: The model's queue is full; ``retry_after`` says when to try again.
            DeadlineExceeded: The deadline passed before the request could run and
                the caller's scope did not report it first (a caller under
                ``fail_after`` normally sees ``TooSlowError`` instead).
            BackendError: The backend failed while running it.
            CircuitOpen: Every instance of the model is out of service (a fallback's
                circuit breaker took them out); ``retry_after`` says when to try again.
            EngineClosed: The engine is closing, or closed before the request ended.
        """
        if (
            priority.__class__ is not int
            or parameters is not None
            or outputs
            or not (tenant.__class__ in _STR_OR_NONE and request_id.__class__ in _STR_OR_NONE)
        ):
            priority = _checked_arguments(model, priority, tenant, request_id)
            given = NO_PARAMETERS if parameters is None else checked_parameters(parameters)
            if given or outputs:
                # Requests with parameters or requested outputs take _submit's way: the
                # fast ways below make requests that carry neither (and cost nothing
                # more for that).
                request = await self._submit(
                    model,
                    inputs,
                    priority,
                    tenant,
                    request_id,
                    sequence=sequence,
                    parameters=given,
                    outputs=outputs,
                )
                return _answer_of(request)
        runner = self._plain.get(model)
        if runner is not None and sequence is None:
            # The common case, in this one frame: what _submit and ModelRunner.call
            # do, step for step, without the two coroutine frames that every
            # suspension and resumption of the caller's task would pass through.
            # A change to either must be made here too: the test
            # test_infer_and_infer_detailed_end_requests_alike holds the two ways alike.
            arrays, n = runner.validate(inputs)
            clock = runner.clock
            deadline = clock.current_effective_deadline()
            if deadline != -math.inf:  # else a cancellation to raise: _submit does
                if runner.alone_ok:
                    # An idle instance on the loop: the request runs here, in this
                    # task, with no queue, worker or wake-up (ModelRunner.run_here):
                    # to its end if it does not suspend, else on in this task.
                    replica = runner.idle_inline_replica()
                    if replica is not None:
                        if runner.slice_spent(replica):
                            # Such requests never park: yield once per inline slice, as
                            # a pipeline's step does, lest callers looping on the model
                            # keep the rest of the program waiting.
                            await _yield_for_slice(runner)
                            return await self._infer_after_yield(
                                model, inputs, priority, tenant, request_id
                            )
                        now = clock.current_time()
                        if deadline > now and runs_inline(replica):
                            # run_here's inline way, with no coroutine of its own.
                            answer = runner.run_now(replica, arrays, n, deadline, now)
                            if answer.__class__ is not Unfinished:
                                return answer  # type: ignore[return-value]
                            return await runner.finish_here(answer, request_id, priority, tenant)
                        return await runner.run_here(
                            replica, arrays, n, request_id, priority, tenant, deadline, now
                        )
                request = make_request(
                    model,
                    arrays,
                    request_id,
                    priority,
                    tenant,
                    deadline,
                    clock.current_time(),
                    n,
                )
                state = request._state
                if runner.on_trio:
                    # The task itself waits in the request, rescheduled when it ends:
                    # no event, and one wake-up the cheapest way Trio has.
                    runner.admit(request)
                    state.task = _current_task()
                    try:
                        (await _park(state.abort)).unwrap()
                    except anyio.get_cancelled_exc_class():
                        runner.withdraw(request)
                        raise
                else:
                    runner.enter(request)
                    assert state.done is not None
                    try:
                        await state.done.wait()
                    except anyio.get_cancelled_exc_class():
                        runner.withdraw(request)
                        raise
                if runner.alone_ok:
                    restart_inline_slice()
                if state.error is not None:
                    await runner.raise_error(state.error, own_deadline=True)
                assert state.outputs is not None
                return state.outputs
        elif sequence is None:
            pipeline = self._pipes.get(model)
            if pipeline is not None:
                # A pipeline, in this frame too: what _submit does for it.
                arrays, n = pipeline.validate(inputs)
                clock = pipeline.clock
                deadline = clock.current_effective_deadline()
                # Else a cancellation to raise, or the queue policy's deadline: _submit's.
                if deadline != -math.inf and (deadline != math.inf or not pipeline.queue_timeouts):
                    now = clock.current_time()
                    done = pipeline.run_now(arrays, n, deadline, now)
                    if done.__class__ is Resume and done.spent:
                        # The loop's inline slice was spent before a step (with a step
                        # of hundreds of microseconds: every request): yield and go on
                        # as plain calls, with no request object or call() of its own.
                        done = await pipeline.run_after_yield(n, done, now)
                    if done.__class__ is not Resume:
                        return done  # type: ignore[return-value]
                    return await pipeline.call(
                        make_request(model, arrays, request_id, priority, tenant, deadline, now, n),
                        resume=done,
                    )
        request = await self._submit(model, inputs, priority, tenant, request_id, sequence=sequence)
        assert request._state.outputs is not None
        return request._state.outputs

    async def _infer_after_yield(
        self,
        model: str,
        inputs: Mapping[str, Any],
        priority: int,
        tenant: str | None,
        request_id: str | None,
    ) -> Outputs:
        # infer's request on an idle model on the loop, after it yielded for the inline
        # slice: anything may have changed meanwhile (the model replaced, busy or
        # gone, the engine closing), so ask again; busy or gone, _submit's way.
        found = self._idle_here(model)
        if found is not None:
            outputs = await self._run_here(*found, inputs, priority, tenant, request_id)
            if outputs is not None:
                return outputs
        request = await self._submit(model, inputs, priority, tenant, request_id)
        assert request._state.outputs is not None
        return request._state.outputs

    def _idle_here(self, model: str) -> tuple[ModelRunner, Replica] | None:
        # The runner of *model* and an idle instance of it that runs on the loop, when
        # a request to it may run in its caller's task (ModelRunner.idle_inline_replica).
        runner = self._alone.get(model)
        if runner is not None:
            replica = runner.idle_inline_replica()
            if replica is not None:
                return runner, replica
        return None

    async def _run_here(
        self,
        runner: ModelRunner,
        replica: Replica,
        inputs: Mapping[str, Any],
        priority: int,
        tenant: str | None,
        request_id: str | None,
        wanted: tuple[str, ...] = (),
    ) -> Outputs | None:
        # A request run on *replica* (from _idle_here, no await since) in this task;
        # None for a cancelled caller (_submit raises what it must). *wanted*: the
        # outputs it asked for (checked; empty: all), which its answer holds.
        arrays, n = runner.validate(inputs)
        clock = runner.clock
        deadline = clock.current_effective_deadline()
        if deadline == -math.inf:
            return None
        return await runner.run_here(
            replica,
            arrays,
            n,
            request_id,
            priority,
            tenant,
            deadline,
            clock.current_time(),
            wanted=wanted,
        )

    def infer_stream(
        self,
        model: str,
        inputs: Mapping[str, Any],
        *,
        priority: int = 0,
        tenant: str | None = None,
        request_id: str | None = None,
        parameters: Mapping[str, Parameter] | None = None,
        outputs: Sequence[str] | None = None,
        ahead: int = STREAM_AHEAD,
    ) -> AbstractAsyncContextManager[ResponseStream]:
        """Run a decoupled *model* on *inputs*: its responses, as they come.

        Use it as::

            async with engine.infer_stream("repeat", inputs) as responses:
                async for outputs in responses:
                    ...

        Entering the block admits the request; the model's generator then runs
        in a task of the block's own, at most *ahead* responses ahead of the
        reader (a slow reader slows it, nothing piles up). Leaving the block early,
        being cancelled or reaching the deadline of the caller's cancel scope
        stops the generator at the ``yield`` it waits at. Once that deadline
        has passed (or the scope is cancelled) the next read raises
        ``Cancelled``, also with responses waiting in the buffer. Every admitted
        stream ends once: with its last response, or with an error raised by
        the iteration after the responses before it.

        Streams do not queue and are not batched: each is admitted at once or
        refused, and runs alone on the model's instance with the fewest open
        streams; ``max_queue_size`` bounds the streams open at once. A model
        that is not decoupled answers with its one response, as
        [`infer()`][trioinfer.Engine.infer] would (queue, batching and all).

        With tracing on, a stream is sampled as a request is, and a sampled
        one has a ``stream`` span (a child of the caller's current span) with
        the model's generator as its ``generate`` child (see the tracing how-to).

        Args:
            model: A loaded model's name.
            inputs: One array per model input, by name, as for `infer()`.
            priority: As for `infer()` (used by a model that is not decoupled).
            tenant: As for `infer()`.
            request_id: An id for logs and tracing; generated if not given.
            parameters: The request's parameters, as for `infer()`.
            outputs: The outputs wanted, as for `infer()`: each response holds those alone.
            ahead: The most responses the model may make that the reader has not
                taken, at least 1 (16 by default): those wait in the stream's
                buffer, where the reader takes them without waiting, and the
                model waits once they are *ahead*. 1: the model makes the next
                response while the reader holds the last, then waits to hand
                it over (one response in memory, for large ones).

        Raises:
            ModelNotFound: (Entering) no model of that name is loaded.
            InvalidInput: (Entering) the inputs do not fit the model's signature, or
                *priority*, *tenant*, *request_id* or *parameters* is of the wrong type,
                or *ahead* is not an integer of at least 1 (raised at the call,
                before entering).
            QueueFull: (Entering) the model has ``max_queue_size`` streams open.
            CircuitOpen: (Entering) every instance is out of service.
            BackendError: (Iterating) the model raised; the responses before it
                were delivered.
            EngineClosed: The engine is closing, or the model was unloaded
                before the stream ended.
            StreamClosed: (Iterating) the stream's block has ended; iterate it
                inside the block.

        For a model that is not decoupled, entering raises only
        ``ModelNotFound`` and ``EngineClosed``; its other errors, those of
        `infer()`, come from the iteration.
        """
        priority = _checked_arguments(model, priority, tenant, request_id)
        given = NO_PARAMETERS if parameters is None else checked_parameters(parameters)
        if ahead.__class__ is not int or ahead < 1:
            raise InvalidInput(
                f"infer_stream of model {model!r}: ahead must be an integer of at least 1 "
                f"(responses the model may make before the reader takes them), got {ahead!r}"
            )
        return open_stream(
            self,
            model,
            inputs,
            priority,
            tenant,
            request_id,
            parameters=given,
            outputs=outputs,
            ahead=ahead,
        )

    async def infer_detailed(
        self,
        model: str,
        inputs: Mapping[str, Any],
        *,
        priority: int = 0,
        tenant: str | None = None,
        request_id: str | None = None,
        sequence: SequenceFlags | None = None,
        parameters: Mapping[str, Parameter] | None = None,
        outputs: Sequence[str] | None = None,
    ) -> InferenceResult:
        """Like [`infer()`][trioinfer.Engine.infer], and say which instance answered and how.

        Use it to tell whether a fallback served the request (a retry, another
        instance or device, another model, a default answer). Same arguments
        and errors as `infer()`.
        """
        if priority.__class__ is not int or not (
            tenant.__class__ in _STR_OR_NONE and request_id.__class__ in _STR_OR_NONE
        ):
            priority = _checked_arguments(model, priority, tenant, request_id)
        given = NO_PARAMETERS if parameters is None else checked_parameters(parameters)
        # A request with parameters takes _submit's way (run here, it would not carry
        # them); one that names its outputs may run here: its answer is narrowed
        # after (only a model that reads its requests, _per_request, sees them).
        found = self._idle_here(model) if sequence is None and not given else None
        if found is not None and found[0]._per_request:
            found = None  # (its answers may carry parameters, which the request keeps)
        wanted: tuple[str, ...] = ()
        if found is not None and outputs:
            wanted = requested_outputs(model, found[0].signature, outputs)
        if found is not None:
            # As infer runs a request on an idle inline model: in this task.
            if found[0].clock.current_effective_deadline() == -math.inf:
                # Cancelled before it called: _submit raises that, counting nothing, as
                # infer does (read first, as infer does: _yield_for_slice counts a
                # caller that leaves once the request is taken).
                found = None
            elif found[0].slice_spent(found[1]):
                await _yield_for_slice(found[0])
                found = self._idle_here(model)
            if found is not None:
                replica = found[1]
                answered = await self._run_here(
                    *found, inputs, priority, tenant, request_id, wanted
                )
                if answered is not None:
                    answered = _narrowed(answered, wanted)
                    return InferenceResult(answered, model, replica.index, replica.device, ())
        request = await self._submit(
            model,
            inputs,
            priority,
            tenant,
            request_id,
            sequence=sequence,
            parameters=given,
            outputs=outputs,
        )
        state = request._state
        answer = _answer_of(request)
        served_by = state.served_by
        if isinstance(served_by, tuple):  # answered by another model: (its name, its replica)
            model, served_by = served_by
        given = state.response_parameters
        if served_by is None:  # answered by a fallback itself (a default answer)
            return InferenceResult(answer, model, None, None, state.fallbacks, given)
        return InferenceResult(
            answer, model, served_by.index, served_by.device, state.fallbacks, given
        )

    def _infer_step(
        self,
        model: str,
        inputs: Mapping[str, Any],
        *,
        priority: int,
        tenant: str | None,
        request_id: str,
        parameters: Mapping[str, Parameter] | None = None,
        outputs: tuple[str, ...] = (),
    ) -> Awaitable[Outputs]:
        # A pipeline's step, for a pipeline request already accepted: engine.infer,
        # also while the engine drains (else the request could not finish in the
        # drain period, as any other accepted request may). Returns infer's own
        # coroutine while the engine is open: no frame of its own on each step.
        # *outputs*: those the step asks for (step_outputs; empty: all); its answer
        # holds at least those.
        if self._closing:
            return self._infer_draining(
                model, inputs, priority, tenant, request_id, parameters or NO_PARAMETERS, outputs
            )
        return self.infer(
            model,
            inputs,
            priority=priority,
            tenant=tenant,
            request_id=request_id,
            parameters=parameters,
            outputs=outputs,
        )

    def _follow_up(
        self,
        model: str,
        inputs: Mapping[str, Any],
        priority: int,
        tenant: str | None,
        caller: str | None = None,
        parameters: Mapping[str, Parameter] | None = None,
        sequence: SequenceFlags | None = None,
    ) -> Awaitable[Outputs]:
        # lowlevel.infer_follow_up: a request made for one accepted already.
        named = model
        model = self._follow_up_name(model, caller)
        if self._gates and model in self._gates:
            # The calling model's code is at fault, not its client (a 500, not a 400).
            by = f"model {caller!r}" if caller is not None else "a model"
            raise BackendError(
                f"{by} called model {named!r} for one answer, but it is decoupled (it "
                "answers with a stream of responses): call it with infer_stream_follow_up "
                "(from a Python model, models.infer_stream)"
            )
        if sequence is not None:
            # A call within a sequence (Triton's BLS correlation_id and flags): the
            # pipeline steps' way (_infer_step) takes none, and stays as lean.
            if self._closing:
                return self._infer_draining(
                    model,
                    inputs,
                    priority,
                    tenant,
                    next_request_id(),
                    parameters or NO_PARAMETERS,
                    sequence=sequence,
                )
            return self.infer(
                model,
                inputs,
                priority=priority,
                tenant=tenant,
                request_id=next_request_id(),
                parameters=parameters,
                sequence=sequence,
            )
        return self._infer_step(
            model,
            inputs,
            priority=priority,
            tenant=tenant,
            request_id=next_request_id(),
            parameters=parameters,
        )

    def _follow_up_name(self, model: str, caller: str | None) -> str:
        # The engine's name for a follow-up's *model*, which may not be *caller* itself.
        named = model
        if self._follow_up_names is not None:
            model = self._follow_up_names(model)
        if model == caller:
            # Judged by the engine's name: under serve "m" is "m.v1", the caller's own.
            raise ValueError(
                f"model {caller!r} called itself (as {named!r}); a model cannot: its "
                "instances may all be busy computing this very call's caller"
            )
        return model

    def _follow_up_runner(self, model: str) -> ModelRunner | Pipeline:
        # _runner, for a request made for one accepted already: also while draining.
        runner = self._runners.get(model)
        if runner is None or (self._closing and not self._draining):
            runner = self._runner(model)  # raises what is wrong
        return runner

    async def _infer_held(
        self,
        model: str,
        inputs: Mapping[str, Any],
        *,
        priority: int,
        tenant: str | None,
        request_id: str,
        held: dict[Request, ModelRunner],
        scopes: set[anyio.CancelScope],
        parameters: Mapping[str, Parameter] = NO_PARAMETERS,
        outputs: tuple[str, ...] = (),
    ) -> Outputs:
        # An unbatched pipeline's step (its request runs in its caller's task, which no
        # scope of the engine's encloses): _infer_step, leaving the pipeline a way to end
        # the step if the pipeline stops first. On a plain model (the fast path of infer,
        # step for step: a change there belongs here too) its request, in *held* while
        # it waits, for ModelRunner.cut_off: no cancel scope, which costs more than the
        # rest of the step's own work. Any other way, a cancel scope, in *scopes*.
        # (A request with parameters: _infer_step's way, which carries them.)
        runner = None if parameters else self._plain.get(model)
        if runner is not None:
            arrays, n = runner.validate(inputs)
            clock = runner.clock
            deadline = clock.current_effective_deadline()
            if deadline != -math.inf:  # else a cancellation to raise: below
                request = make_request(
                    model,
                    arrays,
                    request_id,
                    priority,
                    tenant,
                    deadline,
                    clock.current_time(),
                    n,
                    requested_outputs=outputs,
                )
                state = request._state
                if runner.on_trio:
                    runner.admit(request)
                    held[request] = runner
                    state.task = _current_task()
                    try:
                        (await _park(state.abort)).unwrap()
                    except anyio.get_cancelled_exc_class():
                        runner.withdraw(request)
                        raise
                    finally:
                        del held[request]
                else:
                    runner.enter(request)
                    held[request] = runner
                    assert state.done is not None
                    try:
                        await state.done.wait()
                    except anyio.get_cancelled_exc_class():
                        runner.withdraw(request)
                        raise
                    finally:
                        del held[request]
                if state.error is not None:
                    await runner.raise_error(state.error, own_deadline=True)
                assert state.outputs is not None
                return state.outputs
        scope = anyio.CancelScope()
        scopes.add(scope)
        try:
            with scope:
                return await self._infer_step(
                    model,
                    inputs,
                    priority=priority,
                    tenant=tenant,
                    request_id=request_id,
                    parameters=parameters or None,
                    outputs=outputs,
                )
        finally:
            scopes.discard(scope)
        # The pipeline stopped under the step (Pipeline.stop cancelled its scope).
        raise EngineClosed(f"step request {request_id!r} for model {model!r} was cut off")

    async def _infer_draining(
        self,
        model: str,
        inputs: Mapping[str, Any],
        priority: int,
        tenant: str | None,
        request_id: str,
        parameters: Mapping[str, Parameter] = NO_PARAMETERS,
        outputs: tuple[str, ...] = (),
        *,
        sequence: SequenceFlags | None = None,
    ) -> Outputs:
        request = await self._submit(
            model,
            inputs,
            priority,
            tenant,
            request_id,
            follow_up=True,
            sequence=sequence,
            parameters=checked_parameters(parameters),
            outputs=outputs,
        )
        assert request._state.outputs is not None
        return request._state.outputs

    async def _infer_elsewhere(self, model: str, original: Request) -> Request:
        # A fallback's failover of one request to another model, on the worker's task:
        # the request's deadline becomes this call's cancel scope. It carries what the
        # original does (its id, parameters and requested outputs). The answered request
        # is returned, the original left as it is: Execution.respond gives it who made
        # that answer and its response parameters, only if that answer is the one given.
        with anyio.CancelScope(deadline=original.deadline):
            request = await self._submit(
                model,
                original.inputs,
                original.priority,
                original.tenant,
                original.id,
                True,
                follow_up=True,
                parameters=original.parameters,
                outputs=original.requested_outputs,
            )
            assert request._state.outputs is not None
            return request
        raise DeadlineExceeded(
            f"request {original.id!r} reached its deadline while failing over to model {model!r}"
        )

    async def _submit(
        self,
        model: str,
        inputs: Mapping[str, Any],
        priority: int,
        tenant: str | None,
        request_id: str | None,
        failover: bool = False,
        *,
        sequence: SequenceFlags | None = None,
        follow_up: bool = False,
        parameters: Mapping[str, Parameter] = NO_PARAMETERS,
        outputs: Sequence[str] | None = None,
    ) -> Request:
        # follow_up: made for a request accepted already (a pipeline's step, a
        # fallback's failover), so admitted while the engine drains. *parameters*:
        # checked already (checked_parameters). *outputs*: the caller's, unchecked.
        runner = self._runners.get(model)
        if runner is None or (self._closing and not (follow_up and self._draining)):
            runner = self._runner(model)  # raises what is wrong
        wanted = requested_outputs(model, runner.signature, outputs) if outputs else ()
        if self._gates and model in self._gates:
            raise InvalidInput(
                f"model {model!r} is decoupled: it answers with a stream of responses; call "
                "engine.infer_stream() (over HTTP: POST .../generate_stream)"
            )
        if sequence is not None and runner.config.sequence is None:
            raise InvalidInput(
                f"model {model!r} is not stateful (it has no [sequence] config), so its "
                f"requests take no sequence; got sequence_id {sequence.id!r}"
            )
        arrays, n = validate_rows(
            model, runner.signature, inputs, runner.input_limits, runner.batched
        )
        clock = runner.clock
        deadline = clock.current_effective_deadline()
        if deadline == -math.inf:
            # A cancelled caller's effective deadline is -inf: only then is there a
            # cancellation to raise, at a checkpoint, before anything is queued.
            # (Reading the deadline first spares every other request that await.)
            await clock.checkpoint_if_cancelled()
            if self._runners.get(model) is not runner:
                # Replaced or unloaded while we yielded: queue on what serves the name now.
                runner = self._runner(model)
                arrays, n = validate_rows(
                    model, runner.signature, inputs, runner.input_limits, runner.batched
                )
                clock = runner.clock
            deadline = clock.current_effective_deadline()
        arrival = clock.current_time()
        own_deadline = True
        if deadline == math.inf and runner.queue_timeouts:
            timeout = runner.queue_timeouts.get(priority)
            if timeout is not None:
                # The model's queue policy gives this request the deadline its caller did not.
                deadline, own_deadline = arrival + timeout, False
        request = make_request(
            model,
            arrays,
            request_id if request_id is not None else next_request_id(),
            priority,
            tenant,
            deadline,
            arrival,
            n,
            sequence,
            parameters,
            wanted,
        )
        # A request a fallback sent here from another model fails over no further.
        request._state.failover = failover
        if not own_deadline:
            # Not its caller's deadline: calls its execution makes do not inherit it.
            request._state.queue_timeout = True
        tracing = self._tracing
        if tracing is not None:
            # Decided here, at once, so that a request not traced costs no more.
            parent = tracing.sampled_parent(model, failover)
            pipeline = isinstance(runner, Pipeline)
            if parent is not None or pipeline:
                return await tracing.submit(
                    request,
                    parent,
                    # With a cache, a request is queued only if it computes (below).
                    not (pipeline or runner.config.response_cache),
                    lambda: self._answer(runner, request, own_deadline),
                )
        if not runner.config.response_cache:
            await runner.call(request, own_deadline=own_deadline)
            return request
        return await self._answer(runner, request, own_deadline)

    async def _answer(
        self, runner: ModelRunner | Pipeline, request: Request, own_deadline: bool
    ) -> Request:
        # The request's way through the cache (if its model uses one) and the runner.
        if not runner.config.response_cache:
            await runner.call(request, own_deadline=own_deadline)
            return request

        computation: Callable[[], Computation]
        if isinstance(runner, ModelRunner):
            computation = lambda: _RunnerComputation(runner, request, self._tracing)  # noqa: E731
        else:
            computation = lambda: _PipelineComputation(  # noqa: E731
                runner, request, self._task_group, self._tracing
            )
        assert self._cache is not None  # load() refuses response_cache without a cache
        outputs, origin, computed = await self._cache.answer(
            request.model,
            request.inputs,
            computation,
            deadline=request.deadline,
            own_deadline=own_deadline,
            parameters=request.parameters,
            requested_outputs=request.requested_outputs,
        )
        if origin is not None:
            # An identical request's fallback answered (or its answer carries response
            # parameters): this one says so as well.
            served_by, fallbacks, given = cast(
                "tuple[Any, tuple[str, ...], Mapping[str, Parameter]]", origin
            )
            state = request._state
            state.served_by, state.fallbacks, state.response_parameters = (
                served_by,
                fallbacks,
                given,
            )
        request._state.outputs, request._state.status = outputs, Status.DONE
        if request._state.trace is not None:
            assert self._tracing is not None
            self._tracing.cache_answered(request, hit=not computed)
        return request

    def statistics(self) -> EngineStatistics:
        """A snapshot of every loaded model's counters."""
        cache = self._cache
        models = {}
        for name, runner in sorted(self._runners.items()):
            stats = runner.statistics()
            if cache is not None and runner.config.response_cache:
                stats = attrs.evolve(stats, cache=cache.statistics(name))
            models[name] = stats
        return EngineStatistics(
            closing=self._closing,
            models=models,
            cache_size=cache.size if cache is not None else 0,
            cache_bytes=cache.bytes if cache is not None else 0,
            resources=self._resources.statistics(),
        )

    def _executing(self) -> list[str]:
        # Each execution in progress, for a process that must end while some still
        # run (trioinfer serve's exit timeout): "model 'm': instance 0 (cpu), running for 12.3s".
        # Models being unloaded are no longer here, nor what a plugin runs of its own.
        # A load is named too: a backend's may run on a thread that cannot be stopped
        # (a Python model's constructor, a session reading its file).
        now = time.monotonic()
        return [
            f"model {name!r}: {label}, running for {seconds:.1f}s"
            for name, runner in sorted(self._runners.items())
            if isinstance(runner, ModelRunner)
            for label, seconds in runner.executing()
        ] + [
            f"model {name!r}: its load, running for {now - began:.1f}s"
            for name, began in sorted(self._loading.items())
        ]

    def custom_metrics(self) -> tuple[CustomMetricFamily, ...]:
        """A snapshot of the metric families the loaded models declared, sorted by name.

        A model declares its own families through the
        [`ModelMetrics`][trioinfer.ModelMetrics] its backend hands it (the
        ``python`` backend's ``metrics`` keyword); ``trioinfer serve`` shows
        them on ``/metrics``. Each sample is a serving model's series, named
        as the engine names the model: those of a model being loaded are not
        there yet, and those of a model unloaded or replaced by a new load are
        gone (a load starts again from zero). A family stays while any loaded
        model declares it, even with no series yet.

        Each family is copied under its lock, so a histogram's buckets, count
        and sum agree with each other; families are copied one after the
        other, so updates made meanwhile (from a model's threads) may be in
        one family and not yet in the next.
        """
        return self._custom.snapshot()

    def _runner(self, model: str) -> ModelRunner | Pipeline:
        self._check_open()
        runner = self._runners.get(model)
        if runner is None:
            raise ModelNotFound(f"no model named {model!r} is loaded; loaded: {self._names()}")
        return runner

    def _check_open(self) -> None:
        if self._closing:
            state = "has closed" if self._closed else "is closing"
            raise EngineClosed(f"the engine {state} and accepts no new work")

    def _names(self) -> str:
        return ", ".join(map(repr, sorted(self._runners))) or "none"

    def _info(self, runner: ModelRunner | Pipeline) -> ModelInfo:
        return ModelInfo(
            runner.config.name,
            runner.config,
            runner.signature,
            runner.devices,
            runner.preferred_batch_sizes,
            decoupled(runner),
            runner.out_of_service if isinstance(runner, ModelRunner) else None,
            runner.unavailable if isinstance(runner, ModelRunner) else None,
        )

    @contextmanager
    def _owned(self, scopes: set[anyio.CancelScope]) -> Iterator[anyio.CancelScope]:
        # A load or a retirement in the caller's task: the scope it yields (for the
        # part that closing may cancel) is in *scopes* until the block ends, and a
        # closing engine that waits for them all is told when the last one has.
        scope = anyio.CancelScope()
        if self._stopping:
            scope.cancel()  # an unload begun while the engine stops drains no longer
        scopes.add(scope)
        try:
            yield scope
        finally:
            scopes.discard(scope)
            if self._settled is not None and not (self._loads or self._retiring):
                self._settled.set()

    async def _wait_settled(self) -> None:
        # Until no load or retirement is in progress (see _owned).
        while self._loads or self._retiring:
            self._settled = anyio.Event()
            await self._settled.wait()

    async def _shutdown(self, drain: bool) -> None:
        self._closing = True
        self._plain.clear()
        self._alone.clear()
        self._pipes.clear()
        for scope in self._loads:
            scope.cancel()  # a load now could only be closed again: stop it at once
        if drain:
            self._draining = True
            try:
                with anyio.move_on_after(self.drain_period):
                    for runner in list(self._runners.values()):
                        await runner.wait_idle()
                    await self._wait_settled()  # models being unloaded drain too
            finally:
                self._draining = False  # no step starts after the drain period
        with anyio.CancelScope(shield=True):
            self._stopping = True
            for scope in self._retiring:
                scope.cancel()  # an unload's drain ends with the engine's
            # Loads and unloads in callers' tasks: wait until they have closed what
            # they loaded or retired, so that nothing of theirs outlives the block;
            # bounded, as any cleanup, for a backend whose load cannot be stopped.
            with anyio.move_on_after(CLEANUP_S):
                await self._wait_settled()
            if self._loads or self._retiring:
                logger.error(
                    "the engine closed with %d loads and %d unloads of other tasks still "
                    "in progress after %ss; what they hold may outlive it",
                    len(self._loads),
                    len(self._retiring),
                    CLEANUP_S,
                )
            for runner in list(self._runners.values()):
                await runner.stop()
            for gate in list(self._gates.values()):
                await gate.wait_closed()  # nothing a stream started outlives the engine
        self._runners.clear()
        self._gates.clear()


def open_engine(
    *,
    registry: Registry | None = None,
    drain_period: float = 10.0,
    device_limits: Mapping[str, int] | None = None,
    cache_size: int = 0,
    tracer_provider: Any = None,
    trace_rate: float = 1.0,
    resources: Mapping[str, int | Mapping[str, int]] | None = None,
    rate_limit: bool = True,
) -> AbstractAsyncContextManager[Engine]:
    """An inference engine whose task group owns all its work, as an async context manager.

    Use it as ``async with open_engine() as engine:``. Leaving the block
    normally stops new work ([`EngineClosed`][trioinfer.EngineClosed]), lets
    accepted requests finish for at most *drain_period* seconds (an accepted
    pipeline request still runs its remaining steps, and an accepted request
    may still fail over to another model, though other callers of those
    models are refused), then cancels what is left (those callers get
    ``EngineClosed``) and closes every backend instance. A load in progress
    in another task is cancelled at once (it raises ``EngineClosed``), and a
    model being unloaded in another task drains with the engine; the block
    ends only after they have closed what they held. Leaving it with an
    exception or cancellation skips the drain. An internal failure in the
    engine's tasks surfaces from this block as an exception group rather
    than a hang. A backend execution that does not end when cancelled (a
    thread stuck in blocking code that its abort cannot stop) keeps the block
    waiting until it returns (Ctrl-C too cannot end that wait): nothing can
    abandon a thread; an error is logged after 10 seconds naming the instance.
    (``trioinfer serve``, which owns its process, ends it past its exit
    timeout instead.)

    Args:
        registry: Where plugin names are resolved; by default, installed entry points.
        drain_period: Seconds in-flight work may take to finish at exit.
        device_limits: Most executions that may run at once on a device, across
            all models, by device (``{"cpu": 1}``, ``{"cuda:0": 2}``); devices not
            named are not limited. On a small machine, a CPU limit below the core
            count keeps instances and the event loop from oversubscribing it.
        cache_size: Bytes the response cache may hold, for all models together,
            least recently used answers evicted first; 0 (the default) for no
            cache. Models take part with ``ModelConfig.response_cache``.
        tracer_provider: An OpenTelemetry ``TracerProvider`` to trace requests with
            (needs the ``otel`` extra), for instance
            ``opentelemetry.trace.get_tracer_provider()`` for the global one; None
            (the default) for no tracing, at the cost of one check per request.
            See the tracing how-to for the spans.
        trace_rate: The share of requests that start a trace which are traced
            (0.001 = 1 in 1000); a request whose caller's span is valid follows
            that span's sampled flag instead. The provider's own sampler applies too.
        resources: The sizes of the rate limiter's pools, by resource name: a
            count for every device's pool (and for the global pool of a global
            resource), or a table of device = count (``{"R1": {"cuda:0": 4}}``).
            A pool not named holds the largest need of any loaded instance, as in
            Triton. Instances declare their needs in
            [`Instance.resources`][trioinfer.Instance]; a need bigger than its
            configured pool is refused at load with ``ConfigError``.
        rate_limit: Whether instances take the resources they declare (Triton's
            ``--rate-limit=execution_count``); False runs them as if they declared
            none (``--rate-limit=off``), and says so in the log at each load.
    """
    if not (isinstance(drain_period, (int, float)) and drain_period >= 0):
        raise ConfigError(f"drain_period must be a number of seconds >= 0, got {drain_period!r}")
    if math.isnan(drain_period):
        raise ConfigError("drain_period must not be NaN")
    limiters = {}
    for device, limit in (device_limits or {}).items():
        name = str(Device.parse(device))
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise ConfigError(
                f"device_limits[{device!r}] must be a positive integer, got {limit!r}"
            )
        limiters[name] = anyio.CapacityLimiter(limit)
    if not isinstance(cache_size, int) or isinstance(cache_size, bool) or cache_size < 0:
        raise ConfigError(f"cache_size must be a number of bytes >= 0, got {cache_size!r}")
    cache = ResponseCache(cache_size) if cache_size else None
    pools = ResourcePools(*to_resource_sizes(resources), enabled=bool(rate_limit))
    tracing: Tracing | None = None
    if tracer_provider is not None:
        from ._tracing import Tracing  # imports opentelemetry: only when tracing is on

        tracing = Tracing(tracer_provider, trace_rate)
    return _EngineManager(
        _engine_scope(registry or Registry(), float(drain_period), limiters, cache, tracing, pools)
    )


class _EngineManager(AbstractAsyncContextManager["Engine"]):
    """What `open_engine` returns: the engine's scope, with a hint for its misuses.

    ``with open_engine()`` and ``engine = open_engine()`` are the first mistakes
    of a new user; without this they end in Python's own words about context
    managers or a missing ``infer`` attribute, which do not say what to write.
    """

    __slots__ = ("_scope",)

    def __init__(self, scope: AbstractAsyncContextManager[Engine]) -> None:
        self._scope = scope

    async def __aenter__(self) -> Engine:
        return await self._scope.__aenter__()

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        return await self._scope.__aexit__(*exc_info)

    def __enter__(self) -> NoReturn:
        raise TypeError(
            "open_engine() is an async context manager: write "
            "'async with open_engine(...) as engine:', not 'with open_engine(...)'"
        )

    def __exit__(self, *exc_info: object) -> None:  # pragma: no cover - never called
        """Never reached: `__enter__` refuses."""

    def __getattr__(self, name: str) -> NoReturn:
        raise AttributeError(
            f"open_engine() returns a context manager, not the engine, so it has no {name!r}: "
            "write 'async with open_engine(...) as engine:' and use engine there"
        )


#: The engine a model is loaded by (see `current_engine`).
_current_engine: ContextVar[Engine | None] = ContextVar("trioinfer_engine", default=None)


def current_engine() -> Engine:
    """The engine that is loading the current model, or whose task this is.

    For a backend whose models call other models of the same engine (the
    ``python`` backend's ``models`` keyword): call it in ``load``, or in a
    task the model's load or execution started, and keep what it returns.

    Raises:
        RuntimeError: Outside an engine's load and tasks.
    """
    engine = _current_engine.get()
    if engine is None:
        raise RuntimeError(
            "current_engine() is only known in a backend's load() and in the tasks of the "
            "model it loads"
        )
    return engine


async def infer_follow_up(
    engine: Engine,
    model: str,
    inputs: Mapping[str, Any],
    *,
    priority: int = 0,
    tenant: str | None = None,
    caller: str | None = None,
    deadline: float | None = None,
    parameters: Mapping[str, Parameter] | None = None,
    sequence: SequenceFlags | None = None,
) -> Outputs:
    """``engine.infer``, for a request made on behalf of one the engine accepted already.

    As a pipeline's steps are: also while the engine drains, so that the
    request it is made for can finish in the drain period as any other
    accepted request may (``engine.infer`` refuses new work then, with
    ``EngineClosed``). A model that calls another model while it computes
    uses it; the caller's cancel scope is the timeout, as for ``infer``.

    The request also carries the deadline of the requests it is made for, so
    that the other model's queue drops it (counted as expired) once nobody
    waits for it: *deadline*, or when None `current_callers_deadline()`
    (known in the task of a backend instance's ``execute``, which runs under
    no scope of its callers' when the engine runs it in a worker task of its
    own). Pass it from where that is not known: a call relayed from a worker
    thread, which read it in ``execute``.

    *caller* is the model (its name as the engine loaded it) whose computation
    makes the call: a call that reaches that very model, by whatever name, is
    refused (it could wait for ever for the instance that makes it).
    *parameters* are the request's own, and *sequence* the sequence of a
    stateful model it belongs to, as for ``engine.infer``.

    Raises:
        ValueError: *model* is *caller*.
        DeadlineExceeded: The deadline of the requests it is made for passed
            first (where the caller's own cancel scope does not carry it).
        TrioInferError: As `Engine.infer`.
    """
    if deadline is None:
        deadline = current_callers_deadline()
    if deadline >= anyio.current_effective_deadline():
        # The caller's scope carries it already (a run in its caller's task), or none.
        return await engine._follow_up(
            model, inputs, priority, tenant, caller, parameters, sequence
        )
    with anyio.CancelScope(deadline=deadline):
        return await engine._follow_up(
            model, inputs, priority, tenant, caller, parameters, sequence
        )
    by = f"a call by model {caller!r}" if caller is not None else "a call"
    raise DeadlineExceeded(
        f"{by} to model {model!r} did not end before the deadline of the requests it was "
        "made for: nobody waits for it any more"
    )


def infer_stream_follow_up(
    engine: Engine,
    model: str,
    inputs: Mapping[str, Any],
    *,
    priority: int = 0,
    tenant: str | None = None,
    caller: str | None = None,
    deadline: float | None = None,
    parameters: Mapping[str, Parameter] | None = None,
    ahead: int | None = None,
) -> AbstractAsyncContextManager[ResponseStream]:
    """``engine.infer_stream``, for a stream opened on behalf of a request accepted already.

    As `infer_follow_up` is to ``engine.infer``: admitted while the engine
    drains, the call to *caller* itself refused, and the stream ended at the
    deadline of the requests it is made for (*deadline*, or when None
    `current_callers_deadline()`), as by a cancel scope of the caller's. Use
    it as ``engine.infer_stream``::

        async with infer_stream_follow_up(engine, "tokens", inputs) as responses:
            async for outputs in responses:
                ...

    A model that is not decoupled answers with its one response. *ahead*: as
    for ``engine.infer_stream``, None for its default (a reader on a worker
    thread, which takes one response per hop to the loop, passes 1).

    Raises:
        ValueError: (At the call) *model* is *caller*, or *ahead* is not an integer of at
            least 1.
        DeadlineExceeded: (Leaving the block) the deadline of the requests it
            is made for passed first (the stream was stopped then).
        TrioInferError: As `Engine.infer_stream`.
    """
    model = engine._follow_up_name(model, caller)
    priority = _checked_arguments(model, priority, tenant, None)
    given = NO_PARAMETERS if parameters is None else checked_parameters(parameters)
    if ahead is None:
        ahead = STREAM_AHEAD
    elif ahead.__class__ is not int or ahead < 1:
        raise ValueError(f"ahead must be an integer of at least 1, got {ahead!r}")
    return _stream_follow_up(
        engine, model, inputs, priority, tenant, caller, deadline, given, ahead
    )


@asynccontextmanager
async def _stream_follow_up(
    engine: Engine,
    model: str,
    inputs: Mapping[str, Any],
    priority: int,
    tenant: str | None,
    caller: str | None,
    deadline: float | None,
    parameters: Mapping[str, Parameter],
    ahead: int,
) -> AsyncIterator[ResponseStream]:
    if deadline is None:
        deadline = current_callers_deadline()
    # A scope of its own only where the caller's does not carry the deadline already.
    scope = anyio.CancelScope(
        deadline=deadline if deadline < anyio.current_effective_deadline() else math.inf
    )
    with scope:
        async with open_stream(
            engine,
            model,
            inputs,
            priority,
            tenant,
            None,
            follow_up=True,
            parameters=parameters,
            ahead=ahead,
        ) as stream:
            yield stream
    if scope.cancelled_caught:
        by = f" opened by model {caller!r}" if caller is not None else ""
        raise DeadlineExceeded(
            f"a stream from model {model!r}{by} did not end before the deadline of the requests "
            "it was opened for: nobody waits for it any more"
        )


@asynccontextmanager
async def _engine_scope(
    registry: Registry,
    drain_period: float,
    limiters: dict[str, anyio.CapacityLimiter],
    cache: ResponseCache | None,
    tracing: Tracing | None = None,
    resources: ResourcePools | None = None,
) -> AsyncIterator[Engine]:
    body_error: BaseException | None = None
    try:
        # Inline requests yield once per slice of the loop; a slice held by
        # nobody (the loop idle, polling) must not count against them.
        with restart_slice_at_each_poll():
            async with anyio.create_task_group() as tg:
                engine = Engine(
                    task_group=tg,
                    registry=registry,
                    drain_period=drain_period,
                    device_limits=limiters,
                    resources=resources or ResourcePools({}, {}, enabled=True),
                    cache=cache,
                    tracing=tracing,
                )
                try:
                    yield engine
                except BaseException as exc:
                    body_error = exc
                    raise
                finally:
                    await engine._shutdown(drain=body_error is None)
                    engine._closed = True
                    tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The task group wraps the block's own exception; hand it back as the caller raised it.
        if body_error is not None and _only(group, body_error):
            raise body_error from None
        raise


_STR_OR_NONE: Final = frozenset({str, type(None)})


async def _yield_for_slice(runner: ModelRunner) -> None:
    # The yield before a request runs in its caller's task once the loop's inline
    # slice is spent. A caller that leaves meanwhile (its deadline passed, or it was
    # cancelled) is counted as one that left its queued request: it was in no counter.
    try:
        await runner.clock.checkpoint()
    except anyio.get_cancelled_exc_class():
        runner.cancelled += 1
        raise
    restart_inline_slice()


def _checked_arguments(model: str, priority: object, tenant: object, request_id: object) -> int:
    # The priority of a request, as an int, or InvalidInput saying which argument is wrong.
    # Checked before the request reaches its scheduler: a priority scheduler that took
    # priority="high" into its levels broke, and the model went out of service for all.
    # Only for arguments the callers' one-line class checks did not pass: a protocol's
    # isinstance costs microseconds, too much for every request.
    if isinstance(priority, bool) or not isinstance(priority, SupportsIndex):
        raise InvalidInput(
            f"priority of a request to model {model!r} must be an integer (higher runs "
            f"sooner), got {priority!r}"
        )
    for name, value in (("tenant", tenant), ("request_id", request_id)):
        if value is not None and not isinstance(value, str):
            raise InvalidInput(
                f"{name} of a request to model {model!r} must be a string or None, got "
                f"{value!r} ({type(value).__name__})"
            )
    return operator.index(priority)


def _answer_of(request: Request) -> Outputs:
    # A finished request's outputs: those it asked for alone, where it named some.
    outputs = request._state.outputs
    assert outputs is not None
    return _narrowed(outputs, request.requested_outputs)


def _narrowed(outputs: Outputs, wanted: tuple[str, ...]) -> Outputs:
    # *outputs* narrowed to the *wanted* names (checked: each an output, once); none: all.
    if not wanted or len(outputs) == len(wanted):
        return outputs
    return {name: outputs[name] for name in wanted}


def _pipeline_steps(runner: ModelRunner | Pipeline | None) -> tuple[Step, ...]:
    # A pipeline's steps: a Pipeline's, or those of the graph a batched one's runner runs.
    if isinstance(runner, Pipeline):
        return runner.steps
    if runner is not None and runner.config.backend == PIPELINE:
        return _steps(runner.config.name, runner.config.backend_options.get("steps"))
    return ()


def _only(group: BaseExceptionGroup[BaseException], error: BaseException) -> bool:
    # Whether every leaf of *group* is a leaf of *error*, or a cancellation. Not
    # identity of the groups: a cancel scope on the way out (the task group's own,
    # once cancelled) splits Cancelled out of a group and so re-raises a copy of the
    # caller's group (one from the caller's own nursery), with the same leaves. A
    # cancellation left is that of a scope around the block (the engine's tasks run
    # inside the caller's scopes), which cancels again at its next checkpoint.
    mine = {id(leaf) for leaf in _leaves(error)}
    cancelled = anyio.get_cancelled_exc_class()
    return all(id(leaf) in mine or isinstance(leaf, cancelled) for leaf in _leaves(group))


def _leaves(error: BaseException) -> Iterator[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            yield from _leaves(inner)
    else:
        yield error


async def _load_instances(
    backend: Backend, config: ModelConfig, dist: str | None
) -> list[BackendInstance]:
    # *dist*: the distribution that declared the backend (the runner's sources), named
    # in every error that blames it, as the other plugins' errors name theirs.
    placements = config.placements()
    named = plugin_label("backends", config.backend, dist)
    loaded: list[BackendInstance | None] = [None] * len(placements)
    errors: dict[int, TrioInferError] = {}

    async def load_one(i: int) -> None:
        try:
            pending: object = backend.load(config, placements[i])
            if not inspect.isawaitable(pending):
                # A plain def load(): what it made is closed with the rest, and the
                # author told what the contract asks, not "can't be used in 'await'".
                if isinstance(pending, BackendInstance):
                    loaded[i] = pending
                errors[i] = PluginContractError(
                    f"{named} broke its contract: its load() returned "
                    f"a {type(pending).__name__!r} object for instance {i} of model "
                    f"{config.name!r} instead of an awaitable; load() is an async def",
                    kind="backends",
                    plugin=config.backend,
                )
                return
            instance: object = await pending
        except TrioInferError as exc:
            errors[i] = exc
        except Exception as exc:
            error = BackendError(
                f"{named} could not load instance {i} of model "
                f"{config.name!r}: {type(exc).__name__}: {exc}"
            )
            error.__cause__ = exc
            errors[i] = error
        else:
            if isinstance(instance, BackendInstance):
                loaded[i] = instance  # closed with the others if it is refused below
            if (wrong := _not_an_instance(instance)) is not None:
                errors[i] = PluginContractError(
                    f"{named} broke its contract: load() of instance {i} "
                    f"of model {config.name!r} returned {wrong}",
                    kind="backends",
                    plugin=config.backend,
                )

    try:
        async with anyio.create_task_group() as tg:
            for i in range(len(placements)):
                tg.start_soon(load_one, i)
    except BaseException:
        # Cancelled: maybe only as the task group ended, every instance loaded by then.
        await close_instances(config.name, [i for i in loaded if i is not None])
        raise
    done = [instance for instance in loaded if instance is not None]
    if errors:
        await close_instances(config.name, done)
        raise _load_error(config, placements, errors)
    signatures = {instance.signature for instance in done}
    if len(signatures) != 1:
        await close_instances(config.name, done)
        raise BackendError(
            f"instances of model {config.name!r}, loaded by {named}, report different signatures"
        )
    if config.sequence is not None and any(
        isinstance(instance, StreamingInstance) and instance.decoupled for instance in done
    ):
        # Streams bypass the sequence batcher: its control and state inputs would never come.
        await close_instances(config.name, done)
        raise ConfigError(
            f"model {config.name!r} is decoupled (it streams responses) and stateful (it has a "
            "[sequence] config); a model can be one or the other, not both"
        )
    return done


#: How many distinct reasons, and instance numbers per reason, a load error names.
_REASONS_SHOWN: Final = 5
_IDS_SHOWN: Final = 10


def _some(ids: list[int]) -> str:
    shown = ", ".join(map(str, ids[:_IDS_SHOWN]))
    return shown if len(ids) <= _IDS_SHOWN else f"{shown}, ... ({len(ids)} in all)"


def _load_error(
    config: ModelConfig, placements: list[Placement], errors: dict[int, TrioInferError]
) -> TrioInferError:
    # One error for the caller, naming every instance that failed: the class they
    # all share (BackendUnavailable for two GPUs that are missing, say), with the
    # errors themselves in an ExceptionGroup as its cause.
    if len(errors) == 1:
        return next(iter(errors.values()))
    failed = sorted(errors)
    kinds = {type(errors[i]) for i in failed}
    cls: type[TrioInferError] = next(
        c
        for c in type(errors[failed[0]]).__mro__
        if issubclass(c, TrioInferError) and all(issubclass(k, c) for k in kinds)
    )
    # Instances that failed for the same reason (a missing ONNX Runtime, say) share one entry.
    same: dict[tuple[str, str], list[int]] = {}
    for i in failed:
        same.setdefault((str(placements[i].device), str(errors[i])), []).append(i)
    # Bounded: each instance's own message differs when it names the instance, and
    # count = 100000 once made a message of 12 MB (logged, and sent to an HTTP client).
    groups = list(same.items())
    parts = [
        f"instance{'s' if len(ids) > 1 else ''} {_some(ids)} ({device}): {why}"
        for (device, why), ids in groups[:_REASONS_SHOWN]
    ]
    if len(groups) > _REASONS_SHOWN:
        rest = sum(len(ids) for _, ids in groups[_REASONS_SHOWN:])
        parts.append(f"and {rest} more, for {len(groups) - _REASONS_SHOWN} other reasons")
    message = (
        f"{len(failed)} of {len(placements)} instances of model {config.name!r} failed to load: "
        + "; ".join(parts)
    )
    error = cls.__new__(cls)
    error.__dict__.update(errors[failed[0]].__dict__)
    error.args = (message,)
    error.__cause__ = ExceptionGroup(
        f"instances of model {config.name!r} that failed to load", [errors[i] for i in failed]
    )
    return error


def _computed(request: Request, own: bool) -> Computed | BaseException:
    # What the response cache's computation of *request* ended with.
    state = request._state
    if state.error is not None:
        return state.error
    assert state.outputs is not None
    # Keep only the model's own answer (from one of its instances, after a retry or
    # failover between them as well): not a fallback's default, nor another model's;
    # nor one with response parameters, which the cache does not keep (those waiting
    # for it now get them with it).
    given = state.response_parameters
    own = (own or (state.served_by is not None and not isinstance(state.served_by, tuple))) and (
        not given
    )
    return state.outputs, own, (state.served_by, state.fallbacks, given)


@final
class _RunnerComputation:
    # The response cache's computation of a model's answer (`_cache.Computation`): the
    # request that missed, in the model's queue, run by its runner for every caller
    # waiting for it; none of their tasks carries it, so one that leaves ends nothing.
    __slots__ = ("_request", "_runner", "_tracing", "done")

    def __init__(self, runner: ModelRunner, request: Request, tracing: Tracing | None) -> None:
        self._runner = runner
        self._request = request
        self._tracing = tracing
        # Many callers wait for it: an event, not the runner's one-waiter kind.
        self.done: Event = cast("Event", runner._new_event())

    def start(self) -> None:
        request = self._request
        if request._state.trace is not None:
            assert self._tracing is not None
            self._tracing.queued(request)
        request._state.done = self.done  # set when the runner ends the request
        self._runner.admit(request)

    def outcome(self) -> Computed | BaseException:
        return _computed(self._request, False)

    def abandon(self) -> None:
        # Out of the queue, or its run aborted when nobody else in its batch waits.
        self._runner.withdraw(self._request)

    def retarget(self, deadline: float, requeue: bool) -> float:
        self._runner.move_deadline(self._request, deadline, requeue=requeue)
        return self._request.deadline

    def started(self) -> bool:
        return self._request._state.status is not Status.QUEUED

    def expire(self) -> bool:
        # As without the cache: the request expires in the queue, counted so.
        runner = self._runner
        runner._expire(self._request, runner.clock.current_time())
        return True


@final
class _PipelineComputation:
    # The response cache's computation of a pipeline's answer (`_cache.Computation`):
    # the pipeline runs its steps in the task that calls it, so here in a task of the
    # engine's task group, under the latest deadline of those waiting for it, and
    # cancelled when none is left.
    __slots__ = ("_pipeline", "_request", "_scope", "_task_group", "_tracing", "done", "error")

    def __init__(
        self,
        pipeline: Pipeline,
        request: Request,
        task_group: anyio.abc.TaskGroup,
        tracing: Tracing | None,
    ) -> None:
        self._pipeline = pipeline
        self._tracing = tracing
        self._request = request
        self._task_group = task_group
        self._scope = anyio.CancelScope(deadline=request.deadline)
        self.done: Event = cast("Event", anyio.Event())
        self.error: BaseException | None = None

    def start(self) -> None:
        if self._request._state.trace is not None:
            assert self._tracing is not None
            self._tracing.queued(self._request)
        self._task_group.start_soon(self._run)

    async def _run(self) -> None:
        request = self._request
        try:
            with self._scope:
                try:
                    await self._pipeline.call(request, own_deadline=True)
                except Exception as exc:  # every caller's; it must not end the engine's tasks
                    self.error = exc
            if self._scope.cancelled_caught and self.error is None:
                self.error = DeadlineExceeded(
                    f"request {request.id!r} for pipeline {request.model!r} reached its "
                    "deadline before its steps ended"
                )
        except anyio.get_cancelled_exc_class():
            self.error = EngineClosed(
                f"the engine closed before request {request.id!r} for pipeline "
                f"{request.model!r} ended"
            )
            raise
        finally:
            self.done.set()

    def outcome(self) -> Computed | BaseException:
        if self.error is not None:
            return self.error
        return _computed(self._request, True)  # its steps' models' own answer

    def abandon(self) -> None:
        self._scope.cancel()

    def retarget(self, deadline: float, requeue: bool) -> float:
        self._scope.deadline = deadline
        return deadline

    def started(self) -> bool:
        return True  # it has no queue of its own (its steps' requests do)

    def expire(self) -> bool:
        return False
