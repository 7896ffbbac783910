"""The served-model table: which repository model versions the engine runs, and loading them.

The HTTP app asks this table which engine model serves ``(model, version)``;
repository load and unload requests change it. One engine model serves each
version, named ``<model>.v<version>``; a version whose files changed on disk is
loaded anew beside the old one, which keeps serving until the new one is ready
(`Engine.load(..., replace=True)`).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import hashlib
import itertools
import logging
import math
import random
import re
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, final

import anyio
import anyio.from_thread
import attrs

from .._config import PIPELINE, ModelConfig
from .._engine import Engine, ModelInfo
from .._exceptions import ConfigError, ModelNotFound, TrioInferError
from .._tensors import ModelSignature
from ..abc import ConfigCompletingBackend
from ._codec import config_datatype
from ._errors import without_host_paths
from ._repository import ModelRepository, VersionPolicy, parse_traffic
from ._triton import NARROWING_BACKENDS, TritonModel

log = logging.getLogger("trioinfer.server")


class OneProcessOnly(ConfigError):
    """A stateful model under ``serve --workers N``: each worker would keep its own sequences.

    Not the model's fault nor its config's (it serves with one process): the
    start leaves it out with a WARNING rather than counting it a failed load
    (``--exit-on-error``), and a load over the API is refused with this 400.
    """


#: Seconds a model loads at start-up before the log says so (then twice as long, ...).
SLOW_LOAD_S: Final = 10.0


@contextlib.asynccontextmanager
async def _said_while_loading(model: str) -> AsyncIterator[None]:
    """Log a warning now and then while *model* loads at start-up, naming it.

    Models load one after another before anything is served: a plugin whose
    ``load()`` never returns held the start for ever with nothing in the log.
    """

    async def warn() -> None:
        waited, wait = 0.0, SLOW_LOAD_S
        while True:
            await anyio.sleep(wait)
            waited += wait
            log.warning(
                "model %r is still loading after %.0f s; nothing is served until it has "
                "loaded or failed (a backend's load() that never returns holds it for ever)",
                model,
                waited,
            )
            wait *= 2

    raised: BaseException | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(warn)
        try:
            yield
        except BaseException as exc:  # raised again below, as it came
            raised = exc
        finally:
            tg.cancel_scope.cancel()
    if raised is not None:
        # Outside the task group, which would wrap it in an ExceptionGroup: the
        # caller catches a load's TrioInferError by its class.
        raise raised


#: Longest model name the server accepts: the engine's 128 less room for ``.v<version>``.
MAX_MODEL_NAME = 100


def _shown(name: str) -> str:
    """*name* quoted for an error message; a client's overlong name is cut, not echoed whole.

    The answer would otherwise grow with the request: over gRPC past the 16 KiB that
    grpcio takes in a trailer, so that the client saw a transport error, not NOT_FOUND.
    """
    if len(name) <= MAX_MODEL_NAME:
        return repr(name)
    return f"{name[:MAX_MODEL_NAME]!r}... ({len(name)} characters)"


@attrs.frozen
class ServedVersion:
    """One model version the engine serves.

    Attributes:
        model: The model's name in the repository and in URLs.
        version: Its version number.
        engine_name: The engine model that serves it.
        fingerprint: The files' state when it was loaded, to notice changes on disk.
        override: The config override it was loaded with, if any.
        info: What the engine reports about it.
        triton: Its Triton configuration (``config.pbtxt``, or Triton keys of
            the override), or ``None``.
        labels: Each output's class labels (Triton's ``label_filename``), for
            the classification extension.
        policy: The repository's version policy of the model when it was loaded.
        config: Its config as the repository gave it: other models (a pipeline's
            steps, a fallback's models) named as the repository names them
            (``info.config`` names them as the engine does, ``digits.v1``).
    """

    model: str
    version: int
    engine_name: str
    fingerprint: tuple[int, ...]
    override: Mapping[str, Any] | None
    info: ModelInfo
    triton: TritonModel | None = None
    labels: Mapping[str, tuple[str, ...]] = attrs.field(factory=dict)
    policy: VersionPolicy | None = None
    config: ModelConfig | None = None

    @property
    def fell_back(self) -> bool:
        """Whether an instance runs elsewhere than its config asked (a GPU it ran without).

        The backend decides (ONNX Runtime's falls back to the CPU, with a warning
        that says why, when the config's ``cpu_fallback`` allows); ``info.devices``
        says where each instance really runs, in the order the config lists them.
        """
        devices = self.info.devices
        if not devices:
            return False  # a pipeline: its steps' models have instances, it has none
        asked = [
            str(group.device) for group in self.info.config.instances for _ in range(group.count)
        ]
        return asked != list(devices)


def _check_decoupled(decoupled: bool | None, info: ModelInfo, model: str) -> None:
    # A load override's model_transaction_policy against the model that loaded.
    if decoupled is not None and decoupled != info.decoupled:
        raise ConfigError(
            f"model {model!r}: the config override says model_transaction_policy "
            f"decoupled: {str(decoupled).lower()}, but the model "
            f"{'streams' if info.decoupled else 'does not stream'}; its own "
            "config says whether it streams (the Python backend's decoupled "
            "option): leave model_transaction_policy out, or say what it does"
        )


def _decoupled(policy: object, model: str) -> bool:
    # model_transaction_policy of a load override: {"decoupled": bool} (or {}), as
    # GET .../config answers it; anything else is refused, naming what was expected.
    if isinstance(policy, Mapping) and set(policy) <= {"decoupled"}:
        value = policy.get("decoupled", False)
        if isinstance(value, bool):
            return value
    raise ConfigError(
        f"model {model!r}: the config override's model_transaction_policy must be "
        f'{{"decoupled": true}} or {{"decoupled": false}}, got {policy!r}'
    )


@final
@attrs.define(eq=False)
class ServedModels:
    """The repository's models as the engine serves them now; one per server."""

    engine: Engine
    repository: ModelRepository
    _served: dict[str, dict[int, ServedVersion]] = attrs.field(factory=dict, init=False)
    _errors: dict[str, str] = attrs.field(factory=dict, init=False)
    _locks: dict[str, anyio.Lock] = attrs.field(factory=dict, init=False)
    #: Wall-clock time (ms since the epoch) of each version's last successful inference.
    last_inference_ms: dict[tuple[str, int], int] = attrs.field(factory=dict, init=False)
    #: Each model's traffic split: its versions and their cumulative shares, up to 1.
    _traffic: dict[str, tuple[tuple[int, ...], tuple[float, ...]]] = attrs.field(
        factory=dict, init=False
    )
    #: Picks a version by weight for requests without a routing key (seed it in tests).
    rng: random.Random = attrs.field(factory=random.Random)
    #: This process's place among ``trioinfer serve --workers N``'s: (its index, N), or None.
    worker: tuple[int, int] | None = attrs.field(default=None, kw_only=True)
    #: False under ``--disable-auto-complete-config``: a config.pbtxt is served as written
    #: (``ModelEntry.config``'s *auto_complete*).
    auto_complete: bool = attrs.field(default=True, kw_only=True)
    # The override each model configured by a load override alone (an ensemble in a
    # directory without a config file) was last loaded with: its only config, which a
    # load without one reuses, after an unload too. Kept in memory only: a restart
    # forgets it (the docs say so).
    _own_configs: dict[str, Mapping[str, Any]] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        # A served Python model's calls to others name them as clients do: the engine
        # knows them by version (lowlevel.infer_follow_up).
        self.engine._follow_up_names = self.engine_name

    def unavailable(self) -> list[str]:
        """The models whose last load failed and that serve no version, sorted."""
        return sorted(model for model in self._errors if not self._served.get(model))

    def engine_name(self, name: str) -> str:
        """The engine's name for the version a call from a served model to *name* goes to.

        *name* is a model as clients name it, optionally with ``:<version>``
        (``"digits"``, ``"digits:2"``): a Python model's ``models.infer`` goes
        through the traffic split or to the highest version, as a request over
        HTTP that names no version does.

        Raises:
            ModelNotFound: The model or that version is not served.
        """
        model, _, version = name.partition(":")
        return self.resolve(model, version or None).engine_name

    def resolve(
        self, model: str, version: str | None = None, *, key: str | None = None
    ) -> ServedVersion:
        """The served version a request for *model* (and *version*, if given) goes to.

        Without a version, the model's ``traffic`` split picks one by weight:
        by a hash of *key* when given (the same key, the same version, while
        the weights stay), at random otherwise. Without a split, the highest
        served version.

        Raises:
            ModelNotFound: The model or that version is not served.
        """
        versions = self._served.get(model)
        if not versions:
            # A model between an unload and a load has an entry without versions: not served.
            served = ", ".join(repr(m) for m in sorted(self._served) if self._served[m]) or "none"
            # Triton's wording, which its clients check for; then why, when its load failed
            # (a newcomer's model with a typo in its config.toml is in the repository).
            failed = self._errors.get(model)
            raise ModelNotFound(
                f"Request for unknown model: {_shown(model)} is not served; served models: "
                f"{served}" + (f"; {failed}" if failed else "")
            )
        if version is None:
            split = self._traffic.get(model)
            if split is None:
                return versions[max(versions)]
            numbers, bounds = split
            point = self.rng.random() if key is None else _unit(key)
            return versions[numbers[bisect.bisect_right(bounds, point * bounds[-1])]]
        number = _version_number(version)
        found = versions.get(number) if number is not None else None
        if found is None:
            have = ", ".join(str(v) for v in sorted(versions))
            raise ModelNotFound(
                f"Request for unknown model: {model!r} has no served version {_shown(version)}; "
                f"served versions: {have}"
            )
        return found

    def reroute(self, served: ServedVersion, key: str | None) -> ServedVersion:
        """Where a request that named no version goes now, routed to *served* before.

        *served* while it still serves; if it was unloaded or replaced since (while
        the request's body arrived), the version the split (or *key*) picks now.

        Raises:
            ModelNotFound: No version of the model is served any more.
        """
        if self._served.get(served.model, {}).get(served.version) is served:
            return served
        return self.resolve(served.model, key=key)

    def splits(self, model: str) -> bool:
        """Whether a traffic split picks the version of *model*'s requests that name none."""
        return model in self._traffic

    def traffic(self, model: str) -> dict[int, float]:
        """*model*'s traffic split: each version's share of requests, adding up to 1."""
        numbers, bounds = self._traffic.get(model, ((), ()))
        shares, below = {}, 0.0
        for number, bound in zip(numbers, bounds, strict=True):
            shares[number] = (bound - below) / bounds[-1]
            below = bound
        return shares

    def _set_traffic(self, model: str, weights: Mapping[int, float]) -> None:
        # Versions with weight 0 get none; bisect over the cumulative weights.
        chosen = sorted((v, w) for v, w in weights.items() if w > 0)
        if not chosen:
            self._traffic.pop(model, None)
            return
        numbers = tuple(v for v, _ in chosen)
        # Weights near a float's limit (1e308 each) would add up to infinity, and
        # every request would fail to pick a version: those go relative to the largest.
        scale = max(w for _, w in chosen) if math.isinf(sum(w for _, w in chosen)) else 1.0
        bounds = tuple(itertools.accumulate(w / scale for _, w in chosen))
        self._traffic[model] = (numbers, bounds)

    def versions(self, model: str) -> list[ServedVersion]:
        """The served versions of *model*, ascending; empty if it is not served."""
        versions = self._served.get(model, {})
        return [versions[v] for v in sorted(versions)]

    def all(self) -> list[ServedVersion]:
        """Every served version, by model then version."""
        return [s for model in sorted(self._served) for s in self.versions(model)]

    def not_ready(self, served: ServedVersion) -> str | None:
        """Why *served* is not ready (see `ModelInfo.unavailable`), or None while it serves.

        HTTP and gRPC readiness, and the repository index, say what this says:
        a plugin of it broke its contract (until loaded again), or no instance
        of it serves (each taken out by a breaker, or gone: a Ray actor that died).
        """
        try:
            reason = self.engine.model(served.engine_name).unavailable
        except ModelNotFound:
            return None  # unloaded meanwhile: resolve() says so next time
        return None if reason is None else self.public_message(reason)

    def error(self, model: str) -> str:
        """Why the last load of *model* failed, or ``""``."""
        return self._errors.get(model, "")

    def failures(self) -> dict[str, str]:
        """Why the last load of each model failed, by model (those whose last load did)."""
        return dict(self._errors)

    def take_failures(self, failures: Mapping[str, str]) -> None:
        """Hold *failures* (another server's `failures`) as this one's own.

        For a ``--workers`` worker that restarts, once it serves what the
        others serve: it did not try again the loads that failed on them since
        it first started (a model that appeared broken, say), and a load that
        failed only for it (a model gone from disk) was not theirs. The
        repository index and ``--strict-readiness`` must say what theirs say.
        """
        self._errors = dict(failures)

    def public_message(self, error: BaseException | str) -> str:
        """*error*'s message as HTTP clients should read it.

        Engine model names (``digits.v1``) become the names clients use, host
        paths under the repository become paths relative to it, and no other
        absolute path is left (see `without_host_paths`).
        """
        message = public_names(str(error) or type(error).__name__)
        return without_host_paths(message, str(self.repository.root))

    def mark_inference(self, served: ServedVersion) -> None:
        """Note that *served* just answered a request (for the statistics endpoint)."""
        self.last_inference_ms[served.model, served.version] = time.time_ns() // 1_000_000

    async def load_all(
        self, names: Sequence[str] | None = None, overrides: Mapping[str, Any] | None = None
    ) -> list[str]:
        """Load every model in the repository (or *names*); return those that failed (logged).

        A stateful model under ``--workers N`` (`OneProcessOnly`) is not among them:
        it is left out with a WARNING (the bundled repository holds one), and the
        index lists it as unavailable, saying why.

        *overrides* gives models a config override to load with, as `load` takes it.
        """
        failed = []
        if (hint := self.repository.layout_hint()) is not None:
            log.warning("%s", hint)
        for name in self._in_dependency_order(
            self.repository.names() if names is None else list(names)
        ):
            try:
                async with _said_while_loading(name):
                    await self.load(name, (overrides or {}).get(name))
            except OneProcessOnly as exc:
                # Not a fault of the model's, nor of its config: the server's mode. The
                # others serve; the index lists it UNAVAILABLE, saying why.
                log.warning("%s", exc)
            except TrioInferError as exc:
                log.error("%s", exc)  # noqa: TRY400  # it says "failed to load" and why, in full
                failed.append(name)
        return failed

    async def load_with_steps(self, model: str) -> None:
        """Load *model* after the repository models its pipeline steps name, theirs first.

        For a model served alone (``trioinfer bench --in-process``): a pipeline's
        steps are other models of the repository, and so are theirs when a step is
        a pipeline too; each is loaded before the models that call it, as
        `load_all` orders them. A model that is no pipeline loads alone.

        Raises:
            ConfigError: A step names a model the repository does not hold (the
                message names it), or any error of `load`.
            ModelNotFound: No such model in the repository.
        """
        names = set(self.repository.names())
        needed: list[str] = []
        pending = [model]
        while pending:
            name = pending.pop()
            if name in needed:
                continue
            needed.append(name)
            # A step missing from the repository is left to the pipeline's own load,
            # which refuses it naming the step.
            pending.extend(step for step in self._steps(name) if step in names)
        for name in self._in_dependency_order(needed):
            await self.load(name)

    def effective_override(
        self, model: str, override: Mapping[str, Any] | None
    ) -> Mapping[str, Any] | None:
        """The override a load of *model* with *override* uses.

        *override*, but for a load without one of a model that a load override
        configures whole (an ensemble in a directory without a config file):
        the override it was last loaded with, its only config, if this server
        loaded it before. (Resolved where a load arrives, so that ``--workers``
        sends every worker, and a worker that restarts, the config itself.)
        """
        if override is None and model in self._own_configs:
            if not self.repository.has_config_file(model):
                return self._own_configs[model]
            del self._own_configs[model]  # a config file now: it is the model's config
        return override

    def reloadable_versions(self, model: str) -> tuple[int, ...]:
        """The versions a load without an override would serve again (else none).

        Only for a model configured by a load override alone, whose versions the
        repository cannot list without that override.
        """
        override = self.effective_override(model, None)
        if override is None:
            return ()
        try:
            return self.repository.entry(model, override).selected()
        except TrioInferError:
            return ()

    async def load(self, model: str, override: Mapping[str, Any] | None = None) -> None:
        """Serve the versions of *model* its version policy selects, as they are on disk now.

        Versions not served yet are loaded; served ones whose files (or
        override) changed are loaded anew while the old one keeps serving;
        versions the policy no longer selects are unloaded. Loads of one model
        are serialised; different models load concurrently. A model that a
        load override configures whole is loaded with its last one when
        *override* is None (`effective_override`).

        Raises:
            ConfigError: An invalid name, config or override.
            ModelNotFound: No such model in the repository.
            TrioInferError: Loading failed (the versions that were served stay served).
        """
        if len(model) > MAX_MODEL_NAME:
            raise ConfigError(
                f"model name {model[:20]!r}... is {len(model)} characters long; the server "
                f"accepts at most {MAX_MODEL_NAME}"
            )
        async with self._lock(model):
            override = self.effective_override(model, override)
            try:
                await self._load(model, override)
            except TrioInferError as exc:
                # Triton's wording, which its clients check for; the class (and so the
                # status) stays the cause's.
                if not str(exc).startswith("failed to load"):
                    exc.args = (f"failed to load {model!r}: {exc}", *exc.args[1:])
                if model in self._served or self._in_repository(model):
                    self._errors[model] = self.public_message(exc)
                # else: no such model, a 404 and nothing more. Triton's readiness
                # (--strict-readiness) and its index count the models it found in the
                # repository and tried to load; one it never found is neither.
                raise
            finally:
                if not self._served.get(model, True):
                    del self._served[model]  # nothing of it is served after all
            self._errors.pop(model, None)
        # Pipelines over this model name its versions as they were: load them again.
        for dependent in self._dependents(model):
            # With the override it was loaded with (one may configure it whole).
            loaded = list(self._served.get(dependent, {}).values())
            try:
                await self.load(dependent, loaded[-1].override if loaded else None)
            except TrioInferError as exc:
                log.error("could not reload pipeline %r: %s", dependent, exc)  # noqa: TRY400

    def _in_repository(self, model: str) -> bool:
        """Whether the repository holds a directory for *model* (an invalid name: no)."""
        try:
            return model in self.repository.names()
        except ConfigError:
            return True  # it cannot be listed: not known to be missing

    async def _load(self, model: str, override: Mapping[str, Any] | None) -> None:
        traffic: dict[int, float] | None = None
        if isinstance(override, Mapping) and "traffic" in override:
            # A load override may change the split alone: promote, roll back, ramp up.
            override = dict(override)
            traffic = parse_traffic(override.pop("traffic"))
            override = override or None
        decoupled: bool | None = None
        if isinstance(override, Mapping) and "model_transaction_policy" in override:
            # What GET .../config answers for a streaming model, sent back: whether a
            # model streams is its own (a Python generator), so this is only checked.
            override = dict(override)
            decoupled = _decoupled(override.pop("model_transaction_policy"), model)
            override = override or None
        entry = self.repository.entry(model, override)
        wanted = entry.selected()
        if traffic is None:
            traffic = dict(entry.traffic)
        strays = sorted(set(traffic) - set(wanted))
        if strays:
            raise ConfigError(
                f"model {model!r}: traffic names version {', '.join(map(str, strays))}, which "
                f"is not served; served versions: {', '.join(map(str, wanted))}"
            )
        served = self._served.setdefault(model, {})
        # Unloaded once the wanted ones serve (below): their custom metric families
        # are the new versions' to declare otherwise.
        retiring = [served[v].engine_name for v in sorted(set(served) - set(wanted))]
        for version in wanted:
            fingerprint = entry.fingerprint(version)
            old = served.get(version)
            engine_name = f"{model}.v{version}"
            # On a thread: completing a config.pbtxt from the model's code (Triton's
            # auto_complete_config) imports it, which may take seconds (torch, say).
            named, triton = await anyio.to_thread.run_sync(
                functools.partial(
                    entry.config_and_triton,
                    version,
                    override,
                    complete=self._complete,
                    auto_complete=self.auto_complete,
                )
            )
            config = self._engine_names(model, attrs.evolve(named, name=engine_name))
            labels = entry.labels(triton)
            if (
                old is not None
                and old.fingerprint == fingerprint
                and old.override == override
                and old.info.config == config  # a pipeline's steps may name other versions now
                and self.not_ready(old) is None  # one that serves nothing is loaded afresh
            ):
                continue
            if config.sequence is not None and self.worker is not None and self.worker[1] > 1:
                # Each worker would keep its own sequences, and a sequence restarted over
                # another connection (as the error for a request reaching the wrong worker
                # advised) lived on in the first worker too: the sequence's later requests
                # were answered from either state, by connection, with no error.
                raise OneProcessOnly(
                    f"model {model!r} is stateful ([sequence]): it cannot be served by "
                    f"{self.worker[1]} worker processes, which would each keep their own "
                    "sequences (a sequence's requests reach whichever worker their "
                    "connection reached, and a sequence started again on another worker "
                    "would live on in both); serve it with --workers 1"
                )
            try:
                # Checked before it serves: a reload refused leaves the version that was
                # served serving (unloaded after the swap, a typo took the model down).
                check = functools.partial(
                    _check_loaded, decoupled, triton, _triton_source(entry.triton, override), model
                )
                info = await self.engine.load(
                    config, replace=old is not None, _check=check, _retiring=retiring
                )
            except ModelNotFound as exc:
                self._say_why_a_step_is_missing(model, exc)
                raise
            except ConfigError as exc:
                # The operator's fault in this model's config (a plugin refusing its
                # options, a backend its backend_options): say which file gave it.
                source = entry.config_source(override)
                if source is not None and not str(exc).startswith(source):
                    exc.args = (f"{source}: {exc}", *exc.args[1:])
                raise
            served[version] = ServedVersion(
                model,
                version,
                engine_name,
                fingerprint,
                override,
                info,
                triton,
                labels,
                entry.policy,
                named,
            )
            log.info(
                "%s model %r version %d on %s",
                "reloaded" if old is not None else "loaded",
                model,
                version,
                ", ".join(info.devices) or "its steps' models (a pipeline)",
            )
            if triton is not None and served[version].fell_back:
                # The backend said why, per instance; this ties it to what the user wrote.
                log.warning(
                    "model %r version %d: its instance_group asked for KIND_GPU (%s) but runs "
                    "on %s; the backend's warnings above say why, and GET "
                    "/v2/models/%s/config reports the instance_group that runs (KIND_CPU)",
                    model,
                    version,
                    ", ".join(f"{group.device} x{group.count}" for group in info.config.instances),
                    ", ".join(info.devices),
                    model,
                )
        if entry.from_override and override is not None:
            self._own_configs[model] = override
        # The new split takes effect once every version it names serves, and before
        # any version it no longer names is unloaded (after its requests drain).
        self._set_traffic(model, traffic)
        for version in sorted(set(served) - set(wanted)):
            await self._unload_version(served, version)

    def _complete(
        self, backend: str, config: Mapping[str, Any], path: Path
    ) -> Mapping[str, Any] | None:
        # A config.pbtxt model's configuration as its backend's models complete it
        # (ConfigCompletingBackend, Triton's auto_complete_config); on a worker thread,
        # the plugin resolved on the event loop's (where the engine uses the registry).
        try:
            plugin = anyio.from_thread.run_sync(self.engine.registry.create, "backends", backend)
        except TrioInferError:
            return None  # an unknown backend: the load says so, naming it
        if isinstance(plugin, ConfigCompletingBackend):
            return plugin.complete_triton_config(config, path)
        return None

    def _say_why_a_step_is_missing(self, model: str, exc: ModelNotFound) -> None:
        # A pipeline (a Triton ensemble) whose step model is not loaded: the engine can
        # say only that ("no model named 'classifier' (version 2) is loaded"). When the
        # step's own load failed, its reason is the answer: it replaces the message.
        for step in self._steps(model):
            reason = self._errors.get(step)
            if reason and not self._served.get(step):
                exc.args = (f"its step model {step!r} is not loaded: {reason}", *exc.args[1:])
                return

    def _steps(self, model: str) -> list[str]:
        # The repository models a pipeline's steps name (none for other models).
        try:
            settings: Mapping[str, Any] = self.repository.entry(model).settings
        except TrioInferError:
            settings = {}  # its own load says what is wrong with it
        served = [v.config for v in self._served.get(model, {}).values() if v.config is not None]
        if not settings and served:
            # A pipeline its load override configures whole (no config file): as it runs.
            settings = {
                "backend": served[-1].backend,
                "backend_options": served[-1].backend_options,
            }
        return steps_named(settings)

    def _in_dependency_order(self, names: list[str]) -> list[str]:
        # Every model after the models its steps name (pipelines of pipelines too).
        return in_dependency_order(names, self._steps)

    def _dependents(self, model: str) -> list[str]:
        # Served pipelines with a step over *model*.
        return [name for name in sorted(self._served) if model in self._steps(name)]

    def _engine_names(self, owner: str, config: ModelConfig) -> ModelConfig:
        # Other models named in a config (a fallback's ``models``, a pipeline's
        # steps) are repository names as a config author knows them ("small",
        # or "small:2" for one version); the engine knows them as "small.v2".
        names = config.fallback_options.get("models")
        if isinstance(names, list | tuple) and all(isinstance(n, str) for n in names):
            options = {
                **config.fallback_options,
                "models": [self._engine_name(owner, "fallback model", n) for n in names],
            }
            config = attrs.evolve(config, fallback_options=options)
        steps = config.backend_options.get("steps")
        if config.backend == PIPELINE and isinstance(steps, list | tuple):
            steps = [
                {**step, "model": self._engine_name(owner, "step model", step["model"])}
                if isinstance(step, Mapping) and isinstance(step.get("model"), str)
                else step  # the pipeline refuses it with its own message
                for step in steps
            ]
            config = attrs.evolve(
                config, backend_options={**config.backend_options, "steps": steps}
            )
        return config

    def _engine_name(self, owner: str, what: str, name: str) -> str:
        model, _, version = name.partition(":")
        number = _version_number(version) if version else None
        if version and number is None:
            raise ConfigError(
                f"{what} {name!r} of model {owner!r}: the version after ':' must be a positive "
                "integer"
            )
        if number is None:
            try:
                number = max(self.repository.entry(model).selected())
            except ModelNotFound as exc:
                raise ConfigError(
                    f"{what} {model!r} of model {owner!r} is not in the repository"
                ) from exc
            except ConfigError as exc:
                # It is there, but its directory or config is broken: say what is wrong
                # with it, not that it is missing (its author would look for a typo).
                raise ConfigError(f"{what} {model!r} of model {owner!r}: {exc}") from exc
        return f"{model}.v{number}"

    async def unload(self, model: str) -> None:
        """Stop serving every version of *model*; their accepted requests drain first.

        Raises:
            ModelNotFound: The model is neither served nor in the repository.
        """
        async with self._lock(model):
            served = self._served.get(model)
            if served is None:
                self.repository.entry(model)  # raises ModelNotFound if it does not exist
                self._errors.pop(model, None)  # unloaded on purpose: no longer a failure
                return
            # A failed reload's reason (its served versions went on) is not why it is
            # not served from now on: its 404 would say "failed to load".
            self._errors.pop(model, None)
            # The split goes first: while each version drains in turn, requests that name
            # none go to the highest one left, not to one unloaded already (a KeyError).
            self._traffic.pop(model, None)
            for version in sorted(served):
                await self._unload_version(served, version)
            del self._served[model]

    async def _unload_version(self, served: dict[int, ServedVersion], version: int) -> None:
        gone = served.pop(version)
        self.last_inference_ms.pop((gone.model, version), None)
        await self.engine.unload(gone.engine_name)
        log.info("unloaded model %r version %d", gone.model, version)

    def _lock(self, model: str) -> anyio.Lock:
        lock = self._locks.get(model)
        if lock is None:
            lock = self._locks[model] = anyio.Lock()
        return lock


def steps_named(settings: Mapping[str, Any]) -> list[str]:
    """The repository models a pipeline's *settings* name as steps (none for other models)."""
    steps = settings.get("backend_options", {}).get("steps", [])
    if settings.get("backend") != PIPELINE or not isinstance(steps, list | tuple):
        return []
    return [
        step["model"].partition(":")[0]
        for step in steps
        if isinstance(step, Mapping) and isinstance(step.get("model"), str)
    ]


def in_dependency_order(names: Sequence[str], steps: Callable[[str], list[str]]) -> list[str]:
    """*names*, each after those of them its *steps* name (pipelines of pipelines too)."""
    order: list[str] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if name in order or name in visiting:
            return  # done, or a cycle, which the pipeline's load refuses
        visiting.add(name)
        for step in steps(name):
            if step in names:
                visit(step)
        visiting.discard(name)
        order.append(name)

    for name in names:
        visit(name)
    return order


# An engine model name as the server makes them, quoted: 'digits.v1'.
_ENGINE_NAME = re.compile(r"'([A-Za-z0-9][A-Za-z0-9_.\-]*)\.v([0-9]+)'")


def _check_loaded(
    decoupled: bool | None,
    triton: TritonModel | None,
    source: str,
    model: str,
    info: ModelInfo,
    full: ModelSignature | None,
) -> None:
    """Refuse a loaded model that its Triton config does not fit (before it serves).

    *full*: the backend's signature, a stateful model's control and state inputs
    included (its signature hides them).
    """
    _check_decoupled(decoupled, info, model)
    _check_tensors(triton, info, model, source)
    _check_sequence(triton, full, model)


def _triton_source(file: TritonModel | None, override: object) -> str:
    """How an error names where a model's Triton config came from."""
    if file is None:
        return "the load override"
    return "config.pbtxt with the load override" if override else "config.pbtxt"


def _check_tensors(
    triton: TritonModel | None, info: ModelInfo, model: str, source: str = "config.pbtxt"
) -> None:
    """Refuse a Triton config whose input or output does not match the model's own.

    *source*: where the config came from, for the message (`_triton_source`).
    """
    if triton is None:
        return
    batched = int(triton.doc.get("max_batch_size", 0)) > 0
    signature = info.signature
    for kind, declared, specs in (
        ("input", triton.doc.get("input", []), signature.inputs),
        ("output", triton.doc.get("output", []), signature.outputs),
    ):
        by_name = {spec.name: spec for spec in specs}
        for tensor in declared:
            spec = by_name.get(tensor.get("name", ""))
            if spec is None:
                raise ConfigError(
                    f"model {model!r}: {source} declares {kind} {tensor.get('name')!r}, "
                    f"which the model does not have; its {kind}s are "
                    f"{', '.join(map(repr, by_name))}"
                )
            if kind == "input" and bool(tensor.get("optional", False)) != spec.optional:
                # Metadata and the config answer must say what requests may leave out.
                said, is_ = (
                    ("optional", "required") if not spec.optional else ("required", "optional")
                )
                raise ConfigError(
                    f"model {model!r}: {source} declares input {spec.name!r} {said}; the "
                    f"model's is {is_} (its backend's inputs say optional = "
                    f"{str(spec.optional).lower()})"
                )
            want = tensor.get("data_type", "TYPE_INVALID").removeprefix("TYPE_")
            have = config_datatype(spec)
            if want != have:
                raise ConfigError(
                    f"model {model!r}: {source} declares {kind} {spec.name!r} as TYPE_{want}; "
                    f"the model's is TYPE_{have}"
                )
            dims = [int(d) for d in tensor.get("dims", [])]
            shape = [d if isinstance(d, int) else -1 for d in spec.shape]
            if batched:
                shape = shape[1:]
            if len(dims) != len(shape) or any(
                a != b and -1 not in (a, b) for a, b in zip(dims, shape, strict=False)
            ):
                batch = " after the batch dimension" if batched else ""
                raise ConfigError(
                    f"model {model!r}: {source} declares {kind} {spec.name!r} with dims "
                    f"{dims}; the model's are {shape}{batch}"
                )
            backend = info.config.backend
            if backend not in NARROWING_BACKENDS and any(
                a != -1 and b == -1 for a, b in zip(dims, shape, strict=True)
            ):
                # Narrowed nowhere, these sizes would be the config's word only: metadata
                # and the checks of requests and answers follow the model's declaration.
                raise ConfigError(
                    f"model {model!r}: {source} declares {kind} {spec.name!r} with dims "
                    f"{dims}, fixing sizes the model leaves open ({shape}); the {backend!r} "
                    f"backend's shapes are its own declaration (backend_options "
                    f"{kind}s): fix the sizes there, or give dims -1 where it does"
                )


#: A control's false/true field, and the one input type Triton feeds it in.
_FALSE_TRUE: Final = {
    "int32_false_true": "INT32",
    "fp32_false_true": "FP32",
    "bool_false_true": "BOOL",
}


def _check_sequence(
    triton: TritonModel | None, signature: ModelSignature | None, model: str
) -> None:
    """Refuse a config.pbtxt whose sequence_batching data types are not the model's inputs'.

    Its state ``dims`` are the sequence batcher's to check: they become the
    ``[[sequence.state]]`` shape, which it refuses at load, for any config,
    when the state input fixes other sizes (the engine's load fails first).
    """
    if triton is None or signature is None or "sequence_batching" not in triton.doc:
        return
    batching = triton.doc["sequence_batching"]
    specs = {spec.name: spec for spec in signature.inputs}

    def check(name: str, want: str, what: str) -> None:
        spec = specs.get(name)
        if spec is None:
            return  # the sequence batcher names a missing input at load
        have = config_datatype(spec)
        if want != have:
            raise ConfigError(
                f"model {model!r}: config.pbtxt's sequence_batching {what} {name!r} is "
                f"TYPE_{want}; the model's input is TYPE_{have}"
            )

    for item in batching.get("control_input", []):
        for control in item.get("control", []):
            for field, want in _FALSE_TRUE.items():
                if field in control:
                    check(item["name"], want, f"control ({field})")
            if "data_type" in control:
                check(item["name"], control["data_type"].removeprefix("TYPE_"), "control")
    for state in batching.get("state", []):
        name = state.get("input_name", "")
        if "data_type" in state:
            check(name, state["data_type"].removeprefix("TYPE_"), "state")


def _unit(key: str) -> float:
    # A routing key's place in [0, 1): the same key, the same place, on every server.
    # 53 bits, as many as a float holds: 64 bits over 2**64 rounded up to 1.0 for the
    # highest 2**10 values, past the last bound of the split (an IndexError, a 500).
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") >> 11) / 2**53


def public_names(text: str) -> str:
    """*text* with every engine model name (``'digits.v1'``) as people name it.

    ``'digits' (version 1)``: how errors, answers and log lines name a
    version, whether it is served now or not.
    """
    return _ENGINE_NAME.sub(lambda m: f"'{m.group(1)}' (version {m.group(2)})", text)


def _version_number(text: str) -> int | None:
    if not (text.isascii() and text.isdigit()) or len(text) > 18:
        return None
    number = int(text)
    return number if number > 0 else None
